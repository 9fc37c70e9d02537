"""Formats: the seed-003 recipe over JSONL and over the same corpus as Parquet, and memory with a 1 GB shard.

Part 1 (throughput). The shared corpus is converted to Parquet (zstd, one row group per 10,000
rows) under a temporary folder, and the recipe of ``benchmarks/recipe.py`` (tokenize, pack_flat
2049 wrap, shuffle 1024, batch 8, ``to_training``) runs over both copies, each run in a fresh
process, JSONL and Parquet alternating, ``--repeats`` times. The table gives median tokens per
wall-clock second and per CPU second (all threads of the process, which other load on the machine
disturbs much less), and the ratios Parquet / JSONL measured in the same run (target: at least 0.95).
A third configuration, JSONL in a process that has imported pyarrow, separates the cost of loading
pyarrow from the cost of reading Parquet.

Part 2 (memory). A Parquet shard of about ``--big-gb`` GB (uncompressed text rows of about 1 KB,
row groups of 10,000 rows) is written under ``--tmp`` (default: the system temp folder) and read in
a fresh process: a full sequential pass through a pipeline (map to the text's length, batch),
then ``--random-reads`` rows read in a pseudo-random order (``shuffle_within_shard``). Peak RSS
of that process is reported (target: under 0.5 GB), next to the RSS after imports. The file is
removed at the end unless ``--keep``.

Usage::

    python benchmarks/formats.py                       # both parts
    python benchmarks/formats.py --skip-big --repeats 5
    python benchmarks/formats.py --skip-throughput --big-gb 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

GROUP_ROWS = 10_000


def _rss_mib() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


# -- children -----------------------------------------------------------------------------------------


def child_recipe(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    if task.get("import_pyarrow"):  # the control: JSONL in a process that has loaded pyarrow
        import pyarrow.parquet  # noqa: F401

    from zephon import Pipeline
    from zephon.io import Dataset

    t0 = time.perf_counter()
    ds = Dataset.from_path("corpus", task["corpus"], cache_dir=task["cache"], **task.get("kwargs", {}))
    pipe = (
        Pipeline(ds)
        .options(canonical_replicas=task["lanes"])
        .tokenize(tokenizer=task["tokenizer"], special_tokens="eos")
        .pack_flat(2049, algorithm="wrap")
        .shuffle(1024, seed=42)
        .batch(8)
    )
    t1 = time.perf_counter()
    c1 = time.process_time()
    tokens = 0
    for batch in pipe:
        batch.to_training(return_labels=True, dtype=torch.long)
        tokens += sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in batch.records)
    t2 = time.perf_counter()
    cpu = time.process_time() - c1
    return {"tokens": tokens, "open_s": t1 - t0, "iterate_s": t2 - t1, "tokens_per_s": tokens / (t2 - t1), "tokens_per_cpu_s": tokens / cpu, "rss_mib": _rss_mib()}


def child_big(task: dict[str, Any]) -> dict[str, Any]:
    import zephon  # noqa: F401
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    import pyarrow.parquet  # noqa: F401

    base = _rss_mib()
    t0 = time.perf_counter()
    ds = Dataset.from_path("big", task["path"])
    t_open = time.perf_counter() - t0
    rows = chars = 0
    t0 = time.perf_counter()
    for batch in Pipeline(ds).map(_length).batch(256, drop_last=False):
        rows += len(batch.records)
        chars += sum(r.payload["n"] for r in batch.records)
    t_seq = time.perf_counter() - t0
    after_seq = _rss_mib()
    src = StaticMixtureWorkSource([ds], {"big": 1}, shuffle_within_shard=True, seed=1)
    t0 = time.perf_counter()
    got = 0
    for record in Pipeline(src).map(_length):
        got += 1
        if got >= task["random_reads"]:
            break
    t_rand = time.perf_counter() - t0
    return {
        "rows": rows,
        "text_gb": chars / 1e9,
        "open_s": t_open,
        "sequential_s": t_seq,
        "random_rows": got,
        "random_s": t_rand,
        "rss_after_imports_mib": base,
        "rss_after_sequential_mib": after_seq,
        "peak_rss_mib": _rss_mib(),
    }


def _length(payload: dict) -> dict:
    return {"n": len(payload["text"])}


# -- parent -------------------------------------------------------------------------------------------


def run_child(kind: str, task: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(task)], capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(C.HERE.parent), os.environ.get("PYTHONPATH", "")])},
    )
    if out.returncode:
        raise SystemExit(f"child {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def to_parquet(corpus: Path, out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for path in C.corpus_files(corpus):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        pq.write_table(pa.Table.from_pylist(rows), out / (path.stem + ".parquet"), compression="zstd", row_group_size=GROUP_ROWS)
    return out


def write_big(path: Path, gigabytes: float) -> None:
    """About ``gigabytes`` GB of ~1 KB text rows, uncompressed, row groups of GROUP_ROWS rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    schema = pa.schema([("text", pa.string()), ("id", pa.int64())])
    target = int(gigabytes * 1e9)
    written, start = 0, 0
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        while written < target:
            lengths = rng.integers(600, 1400, GROUP_ROWS)
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            data = letters[rng.integers(0, letters.size, int(offsets[-1]))]
            text = pa.StringArray.from_buffers(GROUP_ROWS, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes()))
            ids = pa.array(np.arange(start, start + GROUP_ROWS))
            writer.write_table(pa.Table.from_arrays([text, ids], schema=schema), row_group_size=GROUP_ROWS)
            written += int(offsets[-1])
            start += GROUP_ROWS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--random-reads", type=int, default=2000)
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, task = args.child
        print(json.dumps((child_recipe if kind == "recipe" else child_big)(json.loads(task))))
        return
    work = Path(tempfile.mkdtemp(prefix="zephon-formats-", dir=args.tmp))
    try:
        print(json.dumps(C.machine_info()))
        if not args.skip_throughput:
            parquet = to_parquet(args.corpus, work / "parquet")
            runs: dict[str, list] = {"jsonl": [], "jsonl+pyarrow": [], "parquet": []}
            configs = [("jsonl", args.corpus), ("jsonl+pyarrow", args.corpus), ("parquet", parquet)]
            for repeat in range(args.repeats):
                # The order rotates each repeat, so no configuration always runs first (or after another).
                for fmt, folder in configs[repeat % 3 :] + configs[: repeat % 3]:
                    task = {"corpus": str(folder), "tokenizer": str(args.tokenizer), "lanes": args.lanes, "cache": str(work / "cache"), "import_pyarrow": fmt == "jsonl+pyarrow"}
                    runs[fmt].append(run_child("recipe", task))
            med = {f: C.median([r["tokens_per_s"] for r in rs]) for f, rs in runs.items()}
            cpu = {f: C.median([r["tokens_per_cpu_s"] for r in rs]) for f, rs in runs.items()}
            assert runs["jsonl"][0]["tokens"] == runs["parquet"][0]["tokens"], "the two formats delivered different token counts"
            rows = [[f, C.fmt_num(med[f]), C.fmt_num(cpu[f]), C.fmt_num(C.median([r["open_s"] for r in rs]), ".3f"), C.fmt_num(C.median([r["rss_mib"] for r in rs]))] for f, rs in runs.items()]
            C.print_table(["format", "tokens/s wall (median)", "tokens per CPU-s (median)", "open s", "peak RSS MiB"], rows)
            print(f"Parquet / JSONL: {med['parquet'] / med['jsonl']:.3f} by wall time, {cpu['parquet'] / cpu['jsonl']:.3f} by CPU time "
                  f"(target >= 0.95; CPU time is the steadier figure on a shared machine); tokens per pass: {runs['jsonl'][0]['tokens']:,}")
            print(f"Parquet / (JSONL in a process that imported pyarrow): {med['parquet'] / med['jsonl+pyarrow']:.3f} by wall time, "
                  f"{cpu['parquet'] / cpu['jsonl+pyarrow']:.3f} by CPU time (what reading Parquet costs beyond loading pyarrow)")
        if not args.skip_big:
            big = work / "big.parquet"
            t0 = time.perf_counter()
            write_big(big, args.big_gb)
            size = big.stat().st_size
            print(f"wrote {big} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
            r = run_child("big", {"path": str(big), "random_reads": args.random_reads})
            print(json.dumps(r))
            print(f"1 GB-class shard ({size / 1e9:.2f} GB, {r['rows']:,} rows): peak RSS {r['peak_rss_mib']:.0f} MiB "
                  f"(after imports {r['rss_after_imports_mib']:.0f} MiB; target < 512 MiB); sequential pass {r['sequential_s']:.1f} s, "
                  f"{r['random_rows']} permuted reads {r['random_s']:.1f} s")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
