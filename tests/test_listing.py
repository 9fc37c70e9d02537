"""Under torch.distributed a dataset is listed once per job: rank 0 lists, every rank reads its share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _util import free_port  # noqa: E402
from zephon.io import Dataset  # noqa: E402
from zephon.sources.listing import list_once  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Each rank: a store that logs every listing call, one dataset opened from it, and this rank's first batch.
SCRIPT = textwrap.dedent(
    '''
    import json, os, sys
    import torch.distributed as dist
    from fsspec import register_implementation
    from fsspec.implementations.local import LocalFileSystem
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    class CountingStore(LocalFileSystem):
        """The local disk as an object store that logs each listing call (shared by the processes)."""
        protocol = "counting"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path[len("counting://"):] if str(path).startswith("counting://") else path)

        def unstrip_protocol(self, name):
            return "counting://" + self._strip_protocol(name)

        def _log(self, op, path):
            with open(os.environ["STORE_LOG"], "a") as f:
                f.write(f"{os.getpid()} {op} {path}\\n")

    for op in ("ls", "find", "glob", "info", "exists", "isdir"):
        def listed(self, path, *args, _op=op, **kwargs):
            self._log(_op, path)
            return getattr(LocalFileSystem, _op)(self, path, *args, **kwargs)
        setattr(CountingStore, op, listed)
    register_implementation("counting", CountingStore, clobber=True)

    data, out, listing, name = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if name == "per-rank":
        name = f"docs-{rank}"
    try:
        docs = Dataset.from_path(name, "counting://" + data, listing=listing)
    except Exception as exc:
        result = {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}
    else:
        source = StaticMixtureWorkSource([docs], {name: 1.0}, seed=0, exhausted_policy="repeat")
        pipe = Pipeline(source).options(canonical_replicas=4, dp_degree=4, dp_rank=rank).batch(2)
        loader = pipe.loader()
        batch = next(iter(loader))
        loader.close()
        result = {"pid": os.getpid(), "texts": [r.payload["text"] for r in batch.records], "shards": len(docs.shard_ids)}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    '''
)


def run_ranks(tmp_path: Path, listing: str, name: str = "docs") -> tuple[list[dict], list[list[str]]]:
    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        for s in range(12):
            rows = [json.dumps({"text": f"shard{s}-row{i}"}) for i in range(5)]
            (data / f"part-{s:03d}.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / f"out-{listing}-{name}"
    out.mkdir()
    log = out / "store.log"
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "STORE_LOG": str(log), "ZEPHON_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={port}",
               str(script), str(data), str(out), listing, name]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    calls = [line.split(" ", 2) for line in log.read_text().splitlines()] if log.exists() else []
    return ranks, calls


@pytest.mark.integration
def test_four_ranks_list_the_store_once_and_read_what_each_would_alone(tmp_path):
    shared, calls = run_ranks(tmp_path, "auto")
    assert calls, "the store was never listed: the test could not tell"
    assert {pid for pid, _, _ in calls} == {str(shared[0]["pid"])}  # rank 0 only, every listing call
    local, local_calls = run_ranks(tmp_path, "local")
    assert {pid for pid, _, _ in local_calls} == {str(r["pid"]) for r in local}  # each rank lists on its own
    assert len(local_calls) == 4 * len(calls)
    assert [r["texts"] for r in shared] == [r["texts"] for r in local]  # the same data on every rank
    assert all(r["shards"] == 12 for r in shared) and len({t for r in shared for t in r["texts"]}) == 8


@pytest.mark.integration
def test_ranks_that_open_different_datasets_are_refused(tmp_path):
    ranks, _ = run_ranks(tmp_path, "auto", name="per-rank")
    assert "error" not in ranks[0]
    for r in ranks[1:]:
        assert "ValueError" in r["error"] and "but rank 0 opened" in r["error"] and "listing='local'" in r["error"]


def test_without_torch_distributed_every_process_lists_and_bad_modes_are_refused(tmp_path):
    calls = []
    assert list_once("d", ("d",), lambda: calls.append(1) or "opened") == "opened" and calls == [1]
    with pytest.raises(ValueError, match="unknown listing 'rank0'.*'auto'.*'local'"):
        Dataset.from_path("d", tmp_path, listing="rank0")
