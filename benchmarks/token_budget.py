"""Padding waste of microbatches by token budget against fixed-size microbatches, on a real corpus.

The corpus is tokenized once (GPT-2 tokenizer, EOS appended, each document truncated to
``--context`` tokens, as an instruction or fine-tuning run would) and shuffled through a
1,024-record buffer; every configuration then batches the same records, in the same order, on
one lane, the whole corpus once (no record dropped at the end):

- ``batch(max_tokens=N, sort_window=k)`` for each ``N`` of ``--max-tokens`` and ``k`` of
  ``--windows`` (``0``: arrival order);
- ``batch(B)`` for each ``B`` that gives, on average, the same real tokens per microbatch as one
  of those (its mean real tokens / the mean document length, rounded), plain and
  ``group_by_length=True`` (a window of ``64 * B`` records).

Per configuration: microbatches, rows per microbatch (mean, min-max), mean real tokens per
microbatch, padding waste (padded slots / all slots, a microbatch padded to its longest row,
rounded up to ``--multiple``), and the largest microbatch in slots (rows x longest row), which
decides peak activation memory. Nothing is timed.

Usage::

    python benchmarks/token_budget.py
    python benchmarks/token_budget.py --max-tokens 4096,8192 --windows 0,64,256 --multiple 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def tokenized(corpus: Path, tokenizer: Path, context: int, max_docs: int | None) -> list[dict[str, Any]]:
    """The corpus's documents as ``{"input_ids": ...}`` records (EOS, truncated), shuffled by zephon."""
    from zephon import Pipeline
    from zephon.io import Dataset

    pipe = (
        Pipeline(Dataset.from_path("corpus", corpus))
        .tokenize(tokenizer=str(tokenizer), special_tokens="eos", max_length=context, truncation=True)
        .shuffle(1024, seed=0)
    )
    out = []
    for rec in pipe:
        out.append({"input_ids": rec.payload["input_ids"]})
        if max_docs is not None and len(out) == max_docs:
            break
    return out


def measure(rows: list[dict[str, Any]], multiple: int, **batch: Any) -> dict[str, Any]:
    """Batch ``rows`` on one lane, keeping the end; the microbatches' shape and padding."""
    from zephon import Pipeline

    pipe = Pipeline(rows).batch(**batch, drop_last=False, pad_token_id=0)
    counts, real, slots, largest = [], 0, 0, 0
    for mb in pipe:
        lengths = [len(r.payload["input_ids"]) for r in mb.records]
        width = -(-max(lengths) // multiple) * multiple
        counts.append(len(lengths))
        real += sum(lengths)
        slots += len(lengths) * width
        largest = max(largest, len(lengths) * width)
    return {
        "microbatches": len(counts),
        "rows_mean": sum(counts) / len(counts),
        "rows_min": min(counts),
        "rows_max": max(counts),
        "real_tokens_mean": real / len(counts),
        "slots_mean": slots / len(counts),
        "padding_waste": 1 - real / slots,
        "largest_slots": largest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--context", type=int, default=2048, help="tokens a document is truncated to (EOS included)")
    ap.add_argument("--max-tokens", default="4096,8192")
    ap.add_argument("--windows", default="0,64,256")
    ap.add_argument("--multiple", type=int, default=1, help="pad_to_multiple_of (1: none)")
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = tokenized(args.corpus, args.tokenizer, args.context, args.max_docs)
    mean_length = sum(len(r["input_ids"]) for r in rows) / len(rows)
    multiple = None if args.multiple == 1 else args.multiple
    results = []
    for budget in (int(x) for x in args.max_tokens.split(",")):
        sizes: dict[int, int] = {}
        for window in (int(x) for x in args.windows.split(",")):
            m = measure(rows, args.multiple, max_tokens=budget, sort_window=window, pad_to_multiple_of=multiple)
            results.append({"config": f"max_tokens={budget}, sort_window={window}", **m})
            sizes.setdefault(max(1, round(m["real_tokens_mean"] / mean_length)), window)
        for size, window in sorted(sizes.items()):
            same = f"  [mean tokens of sort_window={window}]"
            results.append({"config": f"batch({size}){same}", **measure(rows, args.multiple, microbatch_size=size)})
            grouped = measure(rows, args.multiple, microbatch_size=size, group_by_length=True)
            results.append({"config": f"batch({size}, group_by_length=True)", **grouped})
    print(
        f"{len(rows):,} documents, mean {mean_length:,.0f} tokens (truncated to {args.context}), "
        f"pad_to_multiple_of={args.multiple}"
    )
    headers = [
        "configuration", "microbatches", "rows mean (min-max)", "real tokens/mb", "slots/mb", "padding waste",
        "largest mb (slots)",
    ]
    table = [
        [
            r["config"], f"{r['microbatches']:,}", f"{r['rows_mean']:.2f} ({r['rows_min']}-{r['rows_max']})",
            f"{r['real_tokens_mean']:,.0f}", f"{r['slots_mean']:,.0f}", f"{100 * r['padding_waste']:.1f}%",
            f"{r['largest_slots']:,}",
        ]
        for r in results
    ]
    C.print_table(headers, table, right=[False, True, True, True, True, True, True])
    if args.json:
        summary = {"documents": len(rows), "mean_length": mean_length, "results": results}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
