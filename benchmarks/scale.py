"""Scale: start-up, checkpoint bytes, restore time and source memory over shards, lanes and ranks.

The data are in-memory shards of two tiny rows each (building them is the data's cost, not the
plan's, and is not counted); the recipe is ``map -> pack_flat(16) -> batch(2)`` over a repeating
source, without a shuffle buffer, so what is measured is the plan, the lanes and the checkpoints.
For each point of the grid (shards x lanes x ranks, one rank ``r`` of ``D`` simulated in this
process through ``options(canonical_replicas=L, dp_degree=D, dp_rank=r)``):

* start-up: building the source and the pipeline, and the rank's first step (``L/D`` outputs);
* checkpoint: bytes of the rank's checkpoint file (``encode_file``, what ``save_checkpoint``
  writes) after ``--steps`` steps;
* restore: a built pipeline's loader from that checkpoint until its first step, and that minus
  the same step's own work in the uninterrupted run (``restore overhead``), per restored lane;
* source memory: ``tracemalloc`` of building the source and the layout of the first epoch
  (bytes kept, per shard), and apart from it the data's identity (the shard list's digest and
  its canonical encoding, kept once per dataset for the manifest) with its time.

Times are CPU seconds of this process (``time.process_time``), the median of ``--repeats``, after
one warm-up run that pays the process's one-time costs.
Growth exponents are log-log least-squares slopes: over shards at fixed lanes, over lanes per
rank at fixed shards (``D = 1``).

``--files N`` measures the same start-up on files instead: N tiny JSONL files in a temporary
folder with their dataset index (``build_index``, not counted), then, in a fresh process per round
and alternating ``index="require"`` and ``index="auto"``: ``Dataset.from_path`` and a rank's first
step (rank 0 of 2 over 4 lanes), CPU seconds, the median of ``--repeats``.

    python benchmarks/scale.py                 # shards 1k/10k/100k, lanes 1..1024, 1,024 lanes on 512 ranks
    python benchmarks/scale.py --quick         # shards 1k/10k, lanes 1..64, 64 lanes on 32 ranks
    python benchmarks/scale.py --shards 100000 --lanes 1,1024 --profile   # cProfile of the slowest restore
    python benchmarks/scale.py --files 100000  # opening 100,000 indexed files: from_path + first step
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from zephon import Pipeline
from zephon.io import Dataset, InMemoryShard, build_index
from zephon.runtime.checkpoint import encode_file
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource

CHUNK = 4


def toks(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32)}


def in_memory(shards: int, name: str = "web") -> Dataset:
    """``shards`` in-memory shards of two short rows each, named like files (``part-000042``)."""
    rows = [[{"toks": [i % 997 + 1, 2, 3]}, {"toks": [4, 5, i % 5 + 1]}] for i in range(shards)]
    return Dataset.from_dict(name, {f"part-{i:06d}": InMemoryShard(r) for i, r in enumerate(rows)})


def source(data: Dataset) -> StaticMixtureWorkSource:
    return StaticMixtureWorkSource([data], {data.name: 1.0}, seed=1, chunk_size=CHUNK, exhausted_policy="repeat")


def recipe(data: Dataset, lanes: int, dp: int = 1, rank: int = 0) -> Pipeline:
    """The measured pipeline as rank ``rank`` of ``dp`` over ``lanes`` lanes (no shuffle buffer)."""
    return (
        Pipeline(source(data))
        .options(canonical_replicas=lanes, dp_degree=dp, dp_rank=rank)
        .map(toks)
        .pack_flat(16)
        .batch(2)
    )


def cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``fn()`` and its result."""
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def measure(data: Dataset, lanes: int, dp: int = 1, rank: int = 0, *, steps: int = 3) -> dict[str, Any]:
    """One rank's start-up, checkpoint bytes and restore (see the module docstring); CPU seconds.

    ``data`` has its identity (shard list digest) computed already, as in a process that opened it.
    """
    gc.collect()

    def start():
        loader = recipe(data, lanes, dp, rank).loader()
        it = loader.steps()
        next(it)
        return loader, it

    startup_s, (loader, it) = cpu(start)
    for _ in range(steps - 1):
        next(it)
    ck = json.loads(json.dumps(loader.checkpoint()))
    ckpt_bytes = len(encode_file(ck))
    step_s, expected = cpu(lambda: next(it))  # the first step after the checkpoint, uninterrupted
    loader.close()
    pipe = recipe(data, lanes, dp, rank)
    pipe.fingerprint()  # built, as by a trainer before it restores

    def restore():
        restored = pipe.loader(ck)
        return restored, next(restored.steps())

    restore_s, (restored, got) = cpu(restore)
    restored.close()
    if not outputs_equal(got, expected):
        where = f"shards {data.num_shards}, L={lanes}, rank {rank} of {dp}"
        raise AssertionError(f"the restored step differs from the uninterrupted one ({where})")
    mine = lanes // dp
    return {
        "shards": data.num_shards, "lanes": lanes, "dp": dp, "rank": rank, "rank_lanes": mine,
        "startup_s": startup_s, "ckpt_bytes": ckpt_bytes, "step_s": step_s, "restore_s": restore_s,
        "restore_overhead_s": max(restore_s - step_s, 0.0), "restore_per_lane_s": max(restore_s - step_s, 0.0) / mine,
    }


def source_memory(data: Dataset) -> dict[str, Any]:
    """Bytes kept by building the source and its first epoch's layout (``data`` fresh, its row
    counts not yet taken), and apart from it by the data's identity (digest and shard list), with
    its CPU seconds; both per shard."""
    gc.collect()
    tracemalloc.start()
    src = source(data)
    src.pointer_arrays(0, CHUNK)  # the first read: the epoch's shard order and starts
    layout, layout_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    identity_s, _ = cpu(src.fingerprint)
    identity = tracemalloc.get_traced_memory()[0] - layout
    tracemalloc.stop()
    n = data.num_shards
    return {"layout_bytes": layout, "layout_per_shard": layout / n, "layout_peak_per_shard": layout_peak / n,
            "identity_per_shard": identity / n, "identity_s": identity_s}


def repeated(fn: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The median of every float field of ``repeats`` calls of ``fn`` (other fields of the first)."""
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}


def exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ``log y`` over ``log x``: ``y ~ x^slope``.

    Example:
        >>> round(exponent([1, 10, 100], [3, 30, 300]), 6), round(exponent([1, 10, 100], [5, 5, 5]), 6)
        (1.0, 0.0)
    """
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def grid(shards: Sequence[int], lanes: Sequence[int], ranks: Sequence[tuple[int, int]], repeats: int,
         steps: int = 3) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """Every (shards, L, D=1) and (shards, L, D) point of ``ranks`` (``(L, D)``: rank 0 and rank
    D-1), and the source memory per shard count."""
    rows, memory = [], {}
    measure(in_memory(8), 2, steps=steps)  # the process's one-time costs (msgspec's type decoders, imports)
    for n in shards:
        memory[n] = source_memory(in_memory(n))
        data = in_memory(n)
        source(data).fingerprint()  # the identity, once per dataset (see source_memory)
        for L in lanes:
            rows.append(repeated(lambda: measure(data, L, steps=steps), repeats))
        for L, D in ranks:
            for r in sorted({0, D - 1}):
                rows.append(repeated(lambda: measure(data, L, D, r, steps=steps), repeats))
    return rows, memory


def exponents(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Growth exponents of ``key``: over shards (per L at D = 1, the mean) and over lanes per rank
    (per shard count at D = 1, the mean; and over L >= 64, where the per-lane part dominates)."""
    plain = [r for r in rows if r["dp"] == 1]
    by_lanes: dict[int, list] = {}
    by_shards: dict[int, list] = {}
    for r in plain:
        by_lanes.setdefault(r["lanes"], []).append(r)
        by_shards.setdefault(r["shards"], []).append(r)
    over_shards = [exponent([r["shards"] for r in g], [r[key] for r in g]) for g in by_lanes.values() if len(g) > 1]
    over_lanes = [exponent([r["lanes"] for r in g], [r[key] for r in g]) for g in by_shards.values() if len(g) > 1]
    wide = [[r for r in g if r["lanes"] >= 64] for g in by_shards.values()]
    over_wide = [exponent([r["lanes"] for r in g], [r[key] for r in g]) for g in wide if len(g) > 1]
    mean = lambda v: statistics.fmean(v) if v else float("nan")  # noqa: E731
    return {"shards": mean(over_shards), "lanes": mean(over_lanes), "lanes>=64": mean(over_wide)}


def report(rows: list[dict[str, Any]], memory: dict[int, dict[str, Any]]) -> None:
    head = ("shards", "L", "D", "rank", "lanes/rank", "start-up ms", "ckpt bytes", "step ms", "restore ms",
            "restore-step ms", "per lane ms")
    table = [
        (f"{r['shards']:,}", r["lanes"], r["dp"], r["rank"], r["rank_lanes"], f"{1e3 * r['startup_s']:.1f}",
         f"{r['ckpt_bytes']:,}", f"{1e3 * r['step_s']:.2f}", f"{1e3 * r['restore_s']:.2f}",
         f"{1e3 * r['restore_overhead_s']:.2f}", f"{1e3 * r['restore_per_lane_s']:.3f}")
        for r in rows
    ]
    widths = [max(len(str(h)), *(len(str(t[i])) for t in table)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(t, widths)) + " |")
    print("\nsource memory (tracemalloc, bytes kept per shard): layout = source + first epoch's order and starts;"
          " identity = digest + canonical shard list (kept once per dataset, for the manifest)")
    for n, m in memory.items():
        print(f"  {n:>9,} shards: layout {m['layout_per_shard']:.1f} B/shard (peak {m['layout_peak_per_shard']:.1f}), "
              f"identity {m['identity_per_shard']:.1f} B/shard in {1e3 * m['identity_s']:.0f} ms")
    print("\ngrowth exponents (log-log least squares; D = 1):")
    for key in ("startup_s", "ckpt_bytes", "restore_s", "restore_overhead_s"):
        e = exponents(rows, key)
        print(f"  {key:<19} shards {e['shards']:+.3f}   lanes {e['lanes']:+.3f}   lanes>=64 {e['lanes>=64']:+.3f}")
    if len(memory) > 1:
        ns = sorted(memory)
        print(f"  {'layout bytes':<19} shards {exponent(ns, [memory[n]['layout_bytes'] for n in ns]):+.3f}")
    largest = max(memory)
    big = [r for r in rows if r["shards"] == largest]
    worst_start = max(r["startup_s"] for r in big if r["rank_lanes"] < r["lanes"] or r["lanes"] == 1)
    worst_lane = max(r["restore_per_lane_s"] for r in rows)
    print(f"\ntargets at {largest:,} shards: start-up + first step of a rank <= 1 s: {worst_start:.3f} s "
          f"(ranks of D > 1 and L = 1); restore overhead per lane <= 2 ms: worst {1e3 * worst_lane:.3f} ms; "
          f"layout <= 64 B/shard: {memory[largest]['layout_per_shard']:.1f} B/shard")


def text_ids(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"input_ids": np.frombuffer(payload["text"].encode(), dtype=np.uint8).astype(np.int32)}


def write_files(folder: str, shards: int) -> None:
    """``shards`` JSONL files of two short rows each (``part-000042.jsonl``) in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for i in range(shards):
        with open(os.path.join(folder, f"part-{i:06d}.jsonl"), "w", encoding="utf-8") as f:
            f.write(f'{{"text": "document {i} alpha"}}\n{{"text": "document {i} beta gamma"}}\n')


def open_files(folder: str, index: str) -> dict[str, Any]:
    """CPU seconds of ``Dataset.from_path(folder, index=index)`` and of rank 0 of 2's first step over 4 lanes,
    and the wall seconds of both."""
    w0, t0 = time.perf_counter(), time.process_time()
    data = Dataset.from_path("web", folder, index=index)
    t1 = time.process_time()
    pipe = Pipeline(source(data)).options(canonical_replicas=4, dp_degree=2, dp_rank=0).map(text_ids).pack_flat(16).batch(2)
    loader = pipe.loader()
    next(loader.steps())
    t2, w2 = time.process_time(), time.perf_counter()
    loader.close()
    return {"shards": data.num_shards, "open_s": t1 - t0, "step_s": t2 - t1, "total_s": t2 - t0, "wall_s": w2 - w0}


def files_report(shards: int, repeats: int) -> None:
    """Start-up on ``shards`` indexed files, each round in a fresh process (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder, env = os.path.join(tmp, "data"), {**os.environ, "ZEPHON_CACHE_DIR": os.path.join(tmp, "cache")}
        made = time.perf_counter()
        write_files(folder, shards)
        os.environ["ZEPHON_CACHE_DIR"] = env["ZEPHON_CACHE_DIR"]
        build_index(folder)
        print(f"{shards:,} files written and indexed in {time.perf_counter() - made:.0f} s (not counted)")
        runs: dict[str, list[dict[str, Any]]] = {"require": [], "auto": []}
        for _ in range(repeats):
            for index in runs:
                out = subprocess.run([sys.executable, __file__, "--open", folder, "--index", index], env=env,
                                     check=True, capture_output=True, text=True).stdout
                runs[index].append(json.loads(out.splitlines()[-1]))
    print("| index | from_path CPU s | first step CPU s | total CPU s | total wall s | rounds |")
    print("|---|--:|--:|--:|--:|--:|")
    for index, got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in ("open_s", "step_s", "total_s", "wall_s")}
        print(f"| {index} | {med['open_s']:.3f} | {med['step_s']:.3f} | {med['total_s']:.3f} | {med['wall_s']:.3f} | {len(got)} |")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=_ints, default=None, help="comma-separated shard counts")
    ap.add_argument("--lanes", type=_ints, default=None, help="comma-separated lanes per rank (D = 1)")
    ap.add_argument("--ranks", default=None, help="comma-separated L/D pairs, e.g. 1024/512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps before the checkpoint")
    ap.add_argument("--quick", action="store_true", help="shards 1k/10k, lanes 1..64, 64 lanes on 32 ranks, 1 repeat")
    ap.add_argument("--profile", action="store_true", help="cProfile the restore at the largest point")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--files", type=int, default=None, help="measure start-up on this many indexed JSONL files instead")
    ap.add_argument("--open", default=None, help=argparse.SUPPRESS)  # one round of --files, in its own process
    ap.add_argument("--index", default="require", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.open:
        print(json.dumps(open_files(args.open, args.index)))
        return 0
    if args.files:
        files_report(args.files, args.repeats)
        return 0
    if args.quick:
        shards, lanes, ranks, repeats = [1_000, 10_000], [1, 4, 16, 64], "64/32", 1
    else:
        shards, lanes, ranks, repeats = [1_000, 10_000, 100_000], [4**k for k in range(6)], "1024/512", args.repeats
    shards = args.shards or shards
    lanes = args.lanes or lanes
    pairs = [tuple(map(int, p.split("/"))) for p in (args.ranks or ranks).split(",") if p]
    rows, memory = grid(shards, lanes, pairs, repeats, args.steps)
    report(rows, memory)
    if args.profile:
        data = in_memory(max(shards))
        source(data).fingerprint()
        prof = cProfile.Profile()
        prof.runcall(measure, data, max(lanes), steps=args.steps)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "memory": memory}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
