"""Restore: the first batch after a restore, for shuffle buffers of different sizes, lazy and eager.

For each ``--buffers`` size, one process runs the recipe (``--lanes``, 1 by default; the corpus
repeated so that the buffers fill) until every lane's shuffle buffer is full and half the lanes have
delivered one more batch (``--later N``: N batches after that), saves that checkpoint and the
digest of the batch that follows it, and says what the lane due first holds (its first output
after the restore is rebuilt from that). ``--at-end`` reads the corpus once instead and takes the
checkpoint where the lane due first has read all its data: its next output comes from flushing
its shuffle buffer. Then fresh processes (``--repeats`` each, round-robin)
build the pipeline, restore the checkpoint and take the first batch: with the default lazy
rebuild, and with the rebuild made eager (every lane and buffered record rebuilt before the first
batch). Each restored batch is checked against the uninterrupted run's.

    python benchmarks/restore.py                         # buffers 1024 and 16384, 3 repeats
    python benchmarks/restore.py --buffers 1024 --repeats 1
    python benchmarks/restore.py --buffers 1024 --lanes 8 --backend tokenizers
    python benchmarks/restore.py --lanes 8 --no-eager --workers 2   # restoring into worker processes
    python benchmarks/restore.py --buffers 1024 --lanes 8 --later 3 --no-eager
    python benchmarks/restore.py --buffers 1024 --lanes 8 --at-end --no-eager   # the lane due first flushes next
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

ROW, MICRO = 2049, 8


def build(task: dict[str, Any]):
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    ds = Dataset.from_path("corpus", task["corpus"])
    source = StaticMixtureWorkSource([ds], {"corpus": 1.0}, exhausted_policy="stop" if task.get("at_end") else "repeat")
    return (
        Pipeline(source)
        .options(canonical_replicas=task["lanes"], workers=task.get("workers", 0))
        .tokenize(tokenizer=task["tokenizer"], special_tokens="eos", backend=task["backend"])
        .pack_flat(ROW, algorithm="wrap")
        .shuffle(task["buffer"], seed=42)
        .batch(MICRO)
    )


def child_fill(task: dict[str, Any]) -> dict[str, Any]:
    """Run to the checkpoint wanted (every buffer full, or with ``at_end`` the lane due first at its
    end); save it and the next batch's digest."""
    from zephon.ledger import batch_digest

    it = iter(build(task))
    t0 = time.perf_counter()
    if task.get("at_end"):
        batches = _run_until_the_due_lane_ends(it)
    else:
        warmup = max(1, min(128, task["buffer"] // 16))
        rows_needed = task["buffer"] - warmup  # the buffer holds min(buffer, warmup + emitted) rows
        # every lane's buffer full, and the checkpoint half-way through a global step
        batches = -(-rows_needed // MICRO) * task["lanes"] + task["lanes"] // 2 + task.get("later", 0)
        for _ in range(batches):
            next(it)
    ckpt = it.checkpoint()
    text = json.dumps(ckpt)
    digest = batch_digest(next(it))
    it.close()
    Path(task["path"]).write_text(text, encoding="utf-8")
    return {"batches": batches, "fill_s": time.perf_counter() - t0, "bytes": len(text), "digest": digest, "due": due_lane(ckpt)}


def _run_until_the_due_lane_ends(it) -> int:
    """Batches taken until the lane due first has read all its data and delivered what that gave:
    its next output comes from flushing its shuffle buffer."""
    for batches in itertools.count(1):
        next(it)
        _, state = _due(it.checkpoint())
        if state["done"] and not state["pending"] and state["ops"]["shuffle"]["buffer"]:
            return batches


def _due(ckpt: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The lane due first after a restore of ``ckpt`` (fewest delivered outputs, then lowest id) and its state."""
    lanes = ckpt["lanes"]
    lane = min(lanes, key=lambda k: (lanes[k]["delivered"], int(k)))
    return int(lane), lanes[lane]


def due_lane(ckpt: dict[str, Any]) -> dict[str, int]:
    """What the lane due first after a restore of ``ckpt`` holds.

    Its first output is rebuilt from one undelivered output when it holds some; otherwise from its
    open rows and partial batch, then the records its shuffle draws.
    """
    lane, state = _due(ckpt)
    return {"lane": lane, "undelivered": len(state["pending"]), "partial": len(state["ops"]["batch"]["partial"]),
            "open_pieces": len(state["ops"]["pack_flat"]["stream"]), "buffered": len(state["ops"]["shuffle"]["buffer"])}


def child_restore(task: dict[str, Any]) -> dict[str, Any]:
    t0 = task["t0"]
    import zephon.runtime.lanes as lanes
    from zephon.ledger import batch_digest

    if task["eager"]:
        lanes.DEFERRED_RESTORE = False
    ckpt = json.loads(Path(task["path"]).read_text(encoding="utf-8"))
    pipe = build(task)
    t1 = time.perf_counter()
    it = iter(pipe.restore(ckpt))
    batch = next(it)
    first, call = time.time() - t0, time.perf_counter() - t1
    it.close()
    return {"restore_first_s": first, "restore_call_s": call, "digest": batch_digest(batch)}


def run(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    task = {**task, "t0": time.time()}
    return C.run_script(__file__, ["--child", json.dumps(task)], timeout=timeout, what=f"the {task['mode']} child")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--buffers", default="1024,16384", help="comma-separated shuffle buffer sizes")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--lanes", type=int, default=1, help="canonical_replicas (each lane's buffer fills: lanes x buffer rows)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="worker processes of the restoring runs (the filling run: 0)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager restores (slow for large buffers)")
    ap.add_argument("--later", type=int, default=0,
                    help="take the checkpoint this many batches later (another lane is due first, holding other work)")
    ap.add_argument("--at-end", action="store_true",
                    help="the corpus read once; checkpoint where the lane due first has read all its data (it flushes next)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        task = json.loads(args.child)
        result = (child_fill if task["mode"] == "fill" else child_restore)(task)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    buffers = [int(b) for b in args.buffers.split(",")]
    print(f"{args.corpus} repeated, {args.tokenizer}, L={args.lanes}, workers={args.workers}, load average {C.load_average()}")
    results: dict[str, Any] = {"machine": C.machine_info(), "buffers": {}}
    with tempfile.TemporaryDirectory(prefix="zephon-restore-") as tmp:
        common = {"corpus": str(args.corpus.resolve()), "tokenizer": str(args.tokenizer.resolve()), "lanes": args.lanes,
                  "backend": args.backend}
        for b in buffers:
            task = {**common, "buffer": b, "path": os.path.join(tmp, f"{b}.json"), "later": args.later, "at_end": args.at_end}
            fill = run({**task, "mode": "fill"}, args.timeout)
            due = fill["due"]
            print(f"  buffer {b}: checkpoint after {fill['batches']} batches ({fill['fill_s']:.1f} s), {fill['bytes']:,} bytes; "
                  f"lane due first: {due['lane']}, holding {due['undelivered']} undelivered outputs, {due['partial']} rows "
                  f"of a partial batch, {due['open_pieces']} pieces of an open row, {due['buffered']} buffered rows")
            rec = {"fill": fill, "lazy": [], "eager": []}
            for _ in range(args.repeats):
                for mode in ("lazy",) if args.no_eager else ("lazy", "eager"):
                    r = run({**task, "mode": "restore", "eager": mode == "eager", "workers": args.workers}, args.timeout)
                    r["exact"] = r["digest"] == fill["digest"]
                    rec[mode].append(r)
            results["buffers"][b] = rec
    headers = ["buffer rows", "ckpt bytes", "lazy: start->1st s", "lazy: restore()->1st s", "eager: start->1st s",
               "eager: restore()->1st s", "exact"]
    rows = []
    for b, rec in results["buffers"].items():
        cells = []
        for mode in ("lazy", "eager"):
            for key in ("restore_first_s", "restore_call_s"):
                cells.append(C.fmt_num(C.median([r.get(key) for r in rec[mode]]), ".3f"))
        exact = all(r["exact"] for r in rec["lazy"] + rec["eager"])
        rows.append([f"{b:,}", f"{rec['fill']['bytes']:,}", *cells, "yes" if exact else "MISMATCH"])
    print()
    C.print_table(headers, rows, right=[True] * len(headers))
    print(f"\nload average at the end {C.load_average()}; start->1st: from process start (imports and tokenizer load "
          "included); restore()->1st: from the restore() call of a built pipeline")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
