"""Discovery: opening a dataset of many shards, cold, with warm per-file caches, and with the index.

Datasets (generated under a temporary folder, removed at the end):

- ``--jsonl`` small JSONL shards (default 1,000, ``--rows`` rows each);
- ``--parquet`` Parquet shards (default 100, same rows);
- the same Parquet shards on fsspec's in-memory store (``memory://``), read through the shard cache.

For each, ``Dataset.from_path`` is timed (median of ``--repeats``):

- **cold**: no dataset index and an empty zephon cache folder (every JSONL file is scanned for
  its line offsets; every Parquet footer is read; every remote shard is downloaded);
- **warm caches** (JSONL only): no dataset index, but the per-file line-offset indexes that the
  cold open left in the cache folder;
- **indexed**: after ``zephon index`` (``build_index``): one listing plus one small file.

Usage::

    python benchmarks/discovery.py
    python benchmarks/discovery.py --jsonl 5000 --parquet 500
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def child(task: dict) -> dict:
    """Open the dataset once in this fresh process; the time of ``Dataset.from_path`` alone."""
    from zephon.io import Dataset

    if task.get("memory"):  # a memory:// store lives in its process: fill this one's
        _fill_memory(Path(task["memory"]))
    build_s = None
    if task.get("build"):
        from zephon.io import build_index

        t0 = time.perf_counter()
        build_index(task["target"], cache_dir=task["cache"] + "-build", io_options={"cache": {"dir": task["shards"] + "-build"}})
        build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ds = Dataset.from_path("d", task["target"], index=task["index"], cache_dir=task["cache"], io_options={"cache": {"dir": task["shards"]}})
    took = time.perf_counter() - t0
    assert not Path(task["shards"]).exists() or task["index"] == "off", "an indexed remote open downloaded shards"
    return {"s": took, "build_s": build_s, "rows": ds.num_rows, "fingerprint": json.dumps(ds.fingerprint(), sort_keys=True)}


def _fill_memory(folder: Path) -> None:
    import fsspec

    mem = fsspec.filesystem("memory")
    for path in sorted(folder.iterdir()):
        if path.name.endswith(".parquet"):
            mem.pipe(f"/bench-discovery/{path.name}", path.read_bytes())


def run(task: dict, repeats: int) -> tuple[float, dict]:
    """Median seconds over ``repeats`` fresh processes."""
    out = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(task)], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return statistics.median(r["s"] for r in out), out[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl", type=int, default=1000)
    ap.add_argument("--parquet", type=int, default=100)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.io import Dataset, build_index

    work = Path(tempfile.mkdtemp(prefix="zephon-discovery-"))
    try:
        (work / "jsonl").mkdir()
        (work / "parquet").mkdir()
        for s in range(args.jsonl):
            lines = "".join(json.dumps({"text": f"document {s}-{i} " * 8}) + "\n" for i in range(args.rows))
            (work / "jsonl" / f"part-{s:05d}.jsonl").write_text(lines)
        for s in range(args.parquet):
            table = pa.Table.from_pylist([{"text": f"document {s}-{i} " * 8} for i in range(args.rows)])
            pq.write_table(table, work / "parquet" / f"part-{s:05d}.parquet", row_group_size=64)
        url = "memory://bench-discovery"
        print(json.dumps(C.machine_info()))
        rows = []
        counter = iter(range(10**6))

        def fresh_cache() -> Path:
            return work / f"cache-{next(counter)}"

        def cold(target, **kw):
            return lambda: Dataset.from_path("d", target, index="off", cache_dir=fresh_cache(), io_options={"cache": {"dir": str(fresh_cache())}}, **kw)

        for label, target, n in (("JSONL", work / "jsonl", args.jsonl), ("Parquet", work / "parquet", args.parquet), ("Parquet, memory://", url, args.parquet)):
            memory = str(work / "parquet") if target == url else None

            def task(index: str, cache: Path | None = None, shards: Path | None = None) -> dict:
                return {"target": str(target), "index": index, "cache": str(cache or fresh_cache()), "shards": str(shards or fresh_cache()), "memory": memory}

            t_cold, cold = run(task("off"), args.repeats)  # a fresh cache folder every time
            line = [f"{label} ({n} shards, {cold['rows']:,} rows)", f"{t_cold:.3f}"]
            if label == "JSONL":
                warm_dir = fresh_cache()
                run(task("off", warm_dir), 1)
                t_warm, _ = run(task("off", warm_dir), args.repeats)
                line.append(f"{t_warm:.3f}")
            else:
                line.append("-")
            if target == url:  # the store lives in each child: the child builds the index (untimed)
                t_idx, indexed = run({**task("require"), "build": True}, args.repeats)
                t_build = indexed["build_s"]
            else:
                t0 = time.perf_counter()
                build_index(target, cache_dir=fresh_cache())
                t_build = time.perf_counter() - t0
                t_idx, indexed = run(task("require"), args.repeats)
                assert indexed["fingerprint"] == cold["fingerprint"], "the index gave another dataset"
            assert indexed["rows"] == cold["rows"]
            line += [f"{t_idx:.3f}", f"{t_cold / t_idx:.0f}x", f"{t_build:.3f}"]
            rows.append(line)
        C.print_table(["dataset", "cold s", "warm caches s", "indexed s", "cold / indexed", "zephon index s"], rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
