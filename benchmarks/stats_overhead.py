"""What the always-on loader stats cost: the same lanes run with and without counting.

Two pipelines over the shared corpus, each run to the end of its data in this process, in lane
order, as a loader runs them:

- ``recipe``: the seed-003 recipe (tokenize -> pack_flat(2049, wrap) -> shuffle(1024) -> batch(8)),
  where tokenizing dominates;
- ``cheap``: the same documents tokenized beforehand (untimed), then pack_flat -> shuffle -> batch
  only: the worst case for the counters, whose cost is per record and per chunk.

``bare`` calls ``Plan.next(lane, state)`` (no meter) and touches each output; ``counted`` passes
a :class:`zephon.runtime.stats.Meter` and adds each output to a :class:`zephon.runtime.stats.Deliveries` with
the two clock reads of a ``next()`` call, which is everything ``stats()`` gathers on the way.
Runs alternate, ``--repeats`` times each; the median is reported, with ``counted / bare``.

Usage::

    python benchmarks/stats_overhead.py [--max-docs 1975] [--repeats 5] [--lanes 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def run(plan, lanes: int, counted: bool) -> tuple[float, int]:
    from zephon.runtime.stats import Deliveries

    meter = plan.meter() if counted else None
    deliveries = Deliveries(len(plan.source.datasets))
    states = {lane: plan.init(lane) for lane in range(lanes)}
    live = list(range(lanes))
    outputs = 0
    t0 = time.perf_counter()
    while live:
        for lane in list(live):
            if counted:
                waited = deliveries.start_wait()
            states[lane], out = plan.next(lane, states[lane], meter)
            if out is None:
                live.remove(lane)
                continue
            outputs += 1
            if counted:
                deliveries.add(out)
                deliveries.end_wait(waited)
    return time.perf_counter() - t0, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    parser.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    parser.add_argument("--max-docs", type=int, default=1975)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lanes", type=int, default=4)
    args = parser.parse_args()

    import numpy as np

    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    with tempfile.TemporaryDirectory() as tmp:
        corpus = C.make_subset(args.corpus, args.max_docs, Path(tmp) / "corpus")
        source = StaticMixtureWorkSource([Dataset.from_path("corpus", corpus)], {"corpus": 1.0}, seed=0, shuffle_within_shard=True)
        recipe = (
            Pipeline(source)
            .options(canonical_replicas=args.lanes)
            .tokenize(tokenizer=str(args.tokenizer), field="text", special_tokens="eos")
            .pack_flat(2049, algorithm="wrap")
            .shuffle(1024, seed=0)
            .batch(8)
        )
        tok = recipe.operators[0][1]
        texts = C.read_texts(corpus)
        ids = tok.tokenizer.encode_batch(texts)
        eos = tok.tokenizer.eos_token_id
        rows = [{"input_ids": np.concatenate([a, np.array([eos], a.dtype)])} for a in ids]
        cheap = Pipeline(rows).options(canonical_replicas=args.lanes).pack_flat(2049, algorithm="wrap").shuffle(1024, seed=0).batch(8)

        print(f"{len(texts):,} documents, {args.lanes} lanes, {args.repeats} alternating runs each (median)\n")
        print(f"{'pipeline':<8} {'bare s':>9} {'counted s':>10} {'counted / bare':>15} {'outputs':>8}")
        for name, pipe in (("recipe", recipe), ("cheap", cheap)):
            plan = pipe.plan
            run(plan, args.lanes, True)  # warm caches (tokenizer, file maps)
            bare, counted = [], []
            for _ in range(args.repeats):
                t, n_bare = run(plan, args.lanes, False)
                bare.append(t)
                t, n_counted = run(plan, args.lanes, True)
                counted.append(t)
            assert n_bare == n_counted
            b, c = statistics.median(bare), statistics.median(counted)
            print(f"{name:<8} {b:>9.3f} {c:>10.3f} {c / b:>15.3f} {n_bare:>8,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
