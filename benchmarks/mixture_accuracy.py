"""How close token-weighted mixing comes to its target shares: calibrated sample weights alone, and
with ``ensure_mixture``'s exact per-lane token accounting (and, for contrast, plain sample weights).

Two data sets:

* generated: three datasets whose mean document lengths are 50, 150 and 500 words (10x apart),
  tokenized by a word-level tokenizer (one token per word plus EOS);
* the shared corpus, split into three datasets by document length (terciles), tokenized by GPT-2.

Each method runs until the delivered tokens reach ``--tokens`` (2 M by default) and reports, per
dataset, the target token share, the achieved one and the difference (absolute, in percentage
points). Also the calibration time (a fresh measurement, cache cleared).

    python benchmarks/mixture_accuracy.py
    python benchmarks/mixture_accuracy.py --tokens 500000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import DEFAULT_CORPUS, DEFAULT_TOKENIZER, read_texts

GENERATED = {"short": 50, "medium": 150, "long": 500}
GEN_TARGET = {"short": 0.5, "medium": 0.3, "long": 0.2}
CORPUS_TARGET = {"short": 0.3, "medium": 0.3, "long": 0.4}


def generated_datasets(rows: int) -> list:
    from zephon.testing import length_datasets

    return length_datasets(GENERATED, rows, shards=8, seed=1)


def corpus_datasets(folder: Path) -> list:
    from zephon.io import Dataset

    texts = sorted(read_texts(folder), key=len)
    third = len(texts) // 3
    parts = {"short": texts[:third], "medium": texts[third : 2 * third], "long": texts[2 * third :]}
    return [Dataset.from_dict(name, {str(s): [{"text": t} for t in ts[s::4]] for s in range(4)}) for name, ts in parts.items()]


def run(datasets, target, tokenizer, tok_kwargs, *, unit, ensure, tokens, lanes, mbs):
    from zephon import Pipeline
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    src = StaticMixtureWorkSource(datasets, MixtureSpec(target, unit=unit), exhausted_policy="repeat", chunk_size=64, seed=0)
    p = Pipeline(src).options(canonical_replicas=lanes).tokenize(tokenizer, **tok_kwargs)
    if ensure:
        p = p.ensure_mixture()
    p = p.batch(mbs)
    loader = iter(p)
    delivered, steps = 0, 0
    t0 = time.perf_counter()
    for step in loader.steps():
        delivered += sum(len(r.payload["input_ids"]) for b in step for r in b.records)
        steps += 1
        if delivered >= tokens:
            break
    seconds = time.perf_counter() - t0
    stats = loader.stats()
    shares = {n: v["token_share"] for n, v in stats["mixture"]["global"].items()}
    forced = stats["operators"].get("ensure_mixture", {}).get("forced", 0)
    return {"shares": shares, "tokens": delivered, "steps": steps, "seconds": seconds, "forced": forced}


def calibration_time(datasets, target, tokenizer, tok_kwargs, lanes) -> tuple[float, dict]:
    from zephon import Pipeline
    from zephon.sources import calibrate as _calibrate
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    _calibrate._CACHE.clear()
    src = StaticMixtureWorkSource(datasets, MixtureSpec(target, unit="tokens"), exhausted_policy="repeat")
    t0 = time.perf_counter()
    cal = Pipeline(src).options(canonical_replicas=lanes).tokenize(tokenizer, **tok_kwargs).batch(1).compile().source.calibration
    return time.perf_counter() - t0, {n: round(e.tokens_per_sample, 1) for n, e in cal.datasets.items()}


def table(title, target, results) -> str:
    lines = [f"### {title}", "", "| dataset | target | samples: achieved | calibrated: achieved | error | ensure_mixture: achieved | error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n, t in target.items():
        s, c, e = (results[k]["shares"][n] for k in ("samples", "calibrated", "ensure"))
        lines.append(f"| {n} | {t:.4f} | {s:.4f} | {c:.4f} | {100 * (c - t):+.2f} pp | {e:.4f} | {100 * (e - t):+.3f} pp |")
    worst_c = max(abs(results["calibrated"]["shares"][n] - t) for n, t in target.items())
    worst_e = max(abs(results["ensure"]["shares"][n] - t) for n, t in target.items())
    lines.append("")
    lines.append(
        f"worst |error|: calibrated {100 * worst_c:.2f} pp (bound 1 pp), ensure_mixture {100 * worst_e:.3f} pp (bound 0.2 pp); "
        f"tokens delivered: {results['calibrated']['tokens']:,} / {results['ensure']['tokens']:,}; "
        f"forced emissions: {results['ensure']['forced']}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2_000_000, help="delivered tokens per run")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4000, help="rows per generated dataset")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--only", choices=["generated", "corpus"], default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    from zephon.testing import word_tokenizer

    cases = []
    if args.only in (None, "generated"):
        cases.append(("generated data (mean 50 / 150 / 500 words), word-level tokenizer", generated_datasets(args.rows), GEN_TARGET, word_tokenizer(), {"special_tokens": "eos", "eos_token_id": 1}))
    if args.only in (None, "corpus"):
        cases.append(("shared corpus split by document length (terciles), GPT-2", corpus_datasets(args.corpus), CORPUS_TARGET, str(args.tokenizer), {"special_tokens": "eos"}))
    out = {}
    for title, datasets, target, tok, kw in cases:
        secs, tps = calibration_time(datasets, target, tok, kw, args.lanes)
        results = {
            "samples": run(datasets, target, tok, kw, unit="samples", ensure=False, tokens=args.tokens, lanes=args.lanes, mbs=args.microbatch),
            "calibrated": run(datasets, target, tok, kw, unit="tokens", ensure=False, tokens=args.tokens, lanes=args.lanes, mbs=args.microbatch),
            "ensure": run(datasets, target, tok, kw, unit="tokens", ensure=True, tokens=args.tokens, lanes=args.lanes, mbs=args.microbatch),
        }
        print(table(title, target, results))
        base = results["calibrated"]["seconds"]
        print(
            f"calibration: {secs:.2f} s (tokens per sample {tps}); run time ensure_mixture / calibrated: "
            f"{results['ensure']['seconds'] / base:.2f}x ({args.lanes} lanes x {args.microbatch} samples per step)\n"
        )
        out[title] = {"calibration_seconds": secs, "tokens_per_sample": tps, "target": target, **results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
