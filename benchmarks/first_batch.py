"""The first batch with worker processes against inline: seconds from ``iter()``, alternating rounds.

Each round runs every configuration once in a fresh process: build the recipe (``tokenize ->
pack_flat(2049, wrap) -> shuffle(1024) -> batch(8)`` over L lanes of the corpus), wait ``--pause``
seconds (a trainer builds its model between the two; with workers the pipeline's workers start
meanwhile), then time ``iter()`` to the first batch. The report gives per configuration the median
and range over the rounds and the median gap to the same round's inline run.

    python benchmarks/first_batch.py --rounds 5                   # inline against workers=2, pause 1 s
    python benchmarks/first_batch.py --pause 0 --backend tokenizers
    python benchmarks/first_batch.py --pause 0 --torch           # the script imports torch, as a trainer's does
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--torch" in sys.argv:  # at the top, as in a training script: a process that runs the script imports it
    import torch  # noqa: F401

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"


def one(data: str, tokenizer: str, lanes: int, workers: int, backend: str, pause: float) -> float:
    """Seconds from ``iter()`` to the first batch, in this process."""
    from recipe import build_pipeline

    pipe = build_pipeline({"corpus": data, "tokenizer": tokenizer, "lanes": lanes, "workers": workers, "backend": backend})
    time.sleep(pause)
    start = time.perf_counter()
    loader = iter(pipe)
    next(loader)
    took = time.perf_counter() - start
    loader.close()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(SHARED / "corpus"))
    ap.add_argument("--tokenizer", default=str(SHARED / "gpt2" / "tokenizer.json"))
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="worker counts to compare (0: inline)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between building the pipeline and iter()")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="import torch at the top of the script, as a training script does")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a single run, in its own process
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.data, args.tokenizer, args.lanes, args.one, args.backend, args.pause)))
        return 0
    runs: dict[int, list[float]] = {w: [] for w in args.workers}
    gaps: dict[int, list[float]] = {w: [] for w in args.workers}
    for r in range(args.rounds):
        order = args.workers if r % 2 == 0 else args.workers[::-1]
        got = {}
        for w in order:
            cmd = [sys.executable, __file__, "--one", str(w), "--data", args.data, "--tokenizer", args.tokenizer,
                   "--lanes", str(args.lanes), "--backend", args.backend, "--pause", str(args.pause)] + ["--torch"] * args.torch
            got[w] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            runs[w].append(got[w])
        for w in args.workers:
            gaps[w].append(got[w] - got[args.workers[0]])
    print(f"iter() to the first batch, {args.rounds} alternating rounds, pause {args.pause} s, backend {args.backend}, "
          f"L={args.lanes}{', the script imports torch' if args.torch else ''}")
    print("| workers | median s | range s | median gap to the first configuration s |")
    print("|--:|--:|--:|--:|")
    for w in args.workers:
        v = runs[w]
        print(f"| {w} | {statistics.median(v):.3f} | {min(v):.3f}-{max(v):.3f} | {statistics.median(gaps[w]):+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
