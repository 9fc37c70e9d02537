"""Scheduled token mixtures: how close each phase of a schedule comes to its target token shares.

Two generated datasets whose documents hold 40 and 400 tokens on average (word-level tokenizer,
one token per word, the EOS included), a schedule by step that mixes ``long:short`` 70:30 by
tokens and switches to 50:50 at step 100, about 1.6 M tokens per phase, three seeds (the seed
generates the data and orders the source). Two methods:

* ``calibrated``: the schedule alone (calibrated sample weights, no reordering);
* ``ensure_mixture``: the same pipeline with ``ensure_mixture(schedule)`` after ``tokenize``.

For each phase it prints the target token share of ``long``, the share achieved over the phase
(the first block of work chunks after the switch left out: the lanes read whole chunks, so the
switch lands within one block of its step) and the difference, and the forced emissions of
``ensure_mixture``.

    python benchmarks/mixture_targets.py
    python benchmarks/mixture_targets.py --tokens 400000 --seeds 0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MEANS = {"long": 400, "short": 40}
FIRST = {"long": 0.7, "short": 0.3}
SECOND = {"long": 0.5, "short": 0.5}


def datasets(rows: int, seed: int) -> list:
    from zephon.testing import length_datasets

    return length_datasets(MEANS, rows, shards=8, seed=seed)


def schedule(switch: int):
    from zephon.work import MixtureSchedule

    return MixtureSchedule([(0, FIRST), (switch, SECOND)], by="step", unit="tokens")


def run(seed: int, *, ensure: bool, args) -> dict:
    """Deliver steps until the second phase holds ``args.tokens`` tokens; token counts per phase and dataset."""
    from zephon import Pipeline
    from zephon.testing import word_tokenizer
    from zephon.work import StaticMixtureWorkSource

    sched = schedule(args.switch)
    src = StaticMixtureWorkSource(datasets(args.rows, seed), sched, exhausted_policy="repeat", chunk_size=args.chunk, seed=seed)
    p = Pipeline(src).options(canonical_replicas=args.lanes).tokenize(word_tokenizer(), special_tokens="eos", eos_token_id=1)
    if args.shuffle:
        p = p.shuffle(args.shuffle, seed=seed)
    if ensure:
        p = p.ensure_mixture(sched)
    if args.pack:
        p = p.pack_flat(args.pack)
    p = p.batch(args.microbatch)
    names = src.names
    skip = -(-args.chunk // args.microbatch)  # steps of one block of work chunks: each lane reads one chunk per block
    phases = [{n: 0 for n in names}, {n: 0 for n in names}]
    loader = iter(p)
    t0 = time.perf_counter()
    for step, batches in enumerate(loader.steps()):
        if args.switch <= step < args.switch + skip:
            continue
        counts = phases[step >= args.switch]
        for b in batches:
            for r in b.records:
                for seg in r.meta.segments:
                    n = len(r.payload["input_ids"]) if seg.end < 0 else seg.end - seg.start
                    counts[names[seg.dataset]] += n
        if sum(phases[1].values()) >= args.tokens:
            break
    seconds = time.perf_counter() - t0
    forced = loader.stats()["operators"].get("ensure_mixture", {}).get("forced", 0)
    loader.close()
    shares = [{n: c[n] / max(1, sum(c.values())) for n in names} for c in phases]
    return {"shares": shares, "tokens": [sum(c.values()) for c in phases], "forced": forced, "seconds": seconds, "steps": step + 1}


def table(results: dict) -> str:
    lines = [
        "| method | seed | phase | target long | achieved long | error | tokens | forced |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for method, per_seed in results.items():
        for seed, r in per_seed.items():
            for i, target in enumerate((FIRST, SECOND)):
                got = r["shares"][i]["long"]
                lines.append(
                    f"| {method} | {seed} | {i + 1} | {100 * target['long']:.1f} % | {100 * got:.2f} % | "
                    f"{100 * (got - target['long']):+.2f} pp | {r['tokens'][i]:,} | {r['forced'] if i == 0 else ''} |"
                )
    for method, per_seed in results.items():
        worst = max(abs(r["shares"][i]["long"] - t["long"]) for r in per_seed.values() for i, t in enumerate((FIRST, SECOND)))
        lines.append(f"\n{method}: worst |error| {100 * worst:.2f} pp, forced emissions {sum(r['forced'] for r in per_seed.values())}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_600_000, help="tokens in the second phase (the first holds about as many)")
    ap.add_argument("--switch", type=int, default=100, help="the step of the switch to 50:50")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=18, help="samples per lane per step (8 x 18: about 16 k tokens a step at 70:30)")
    ap.add_argument("--chunk", type=int, default=64, help="the source's chunk_size")
    ap.add_argument("--rows", type=int, default=6000, help="rows per dataset")
    ap.add_argument("--pack", type=int, default=0, help="pack_flat rows of this many tokens (0: unpacked records)")
    ap.add_argument("--shuffle", type=int, default=0, help="a shuffle buffer of this many records before batch (0: none)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", choices=["calibrated", "ensure_mixture"], default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    results: dict = {}
    for method in ("calibrated", "ensure_mixture"):
        if args.only not in (None, method):
            continue
        results[method] = {}
        for seed in args.seeds:
            try:
                results[method][seed] = run(seed, ensure=method == "ensure_mixture", args=args)
            except ValueError as exc:  # e.g. a version that refuses ensure_mixture with a schedule
                print(f"{method}, seed {seed}: {exc}")
                break
    results = {m: r for m, r in results.items() if r}
    print(table(results))
    secs = {m: round(sum(r["seconds"] for r in per.values()), 1) for m, per in results.items()}
    print(f"run time (s, all seeds): {secs}; {args.lanes} lanes x {args.microbatch} samples per step, chunk_size {args.chunk}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
