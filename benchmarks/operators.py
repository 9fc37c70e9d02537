"""Per-operator micro-benchmarks on prebuilt records, in tokens per second.

The corpus is tokenized once (untimed) into the records a pipeline's ``tokenize`` step would
produce (``{"input_ids": int32 array}`` plus EOS, one record per document, in chunks of 64).
Then each operator is timed alone, ``--repeats`` times, median reported:

- ``pack_flat(2049)`` with every algorithm (``first_fit``/``best_fit`` with ``--num-bins`` open
  bins, EOS as ``pad_token_id`` and ``oversized="split"`` so that no document is dropped;
  ``best_fit_wrap`` with its default pool) over the documents;
- ``shuffle(1024)``, ``batch(8)`` and ``to_training(return_labels=True)`` (numpy and torch) over
  the rows of ``pack_flat(2049, algorithm="wrap")``, chunked as that step emitted them;
- a checkpoint round trip of a full shuffle buffer: ``encode_state`` + ``json.dumps``, and
  ``json.loads`` + ``decode_state`` with the buffered rows looked up (no rebuild) or rebuilt by
  ``pack_flat`` from the documents (no tokenizing).

Baselines in the same run: a plain ``np.concatenate`` of the same arrays, per 64-document chunk
for the document-level operators and per 8 rows for the row-level ones; ``x baseline`` is an
operator's tokens/s over its baseline's. Tokens are the input tokens each operator consumed.

Usage::

    python benchmarks/operators.py
    python benchmarks/operators.py --max-docs 800 --repeats 3 --json ops.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

ROW = 2049
READ = 64
BUFFER = 1024
MICRO = 8


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return C.median(times), times, result


def _run_chunks(op: Any, chunks: list[list]) -> tuple[Any, list[list]]:
    """Step ``op`` over ``chunks`` and flush, keeping its outputs per step (the flush is the last)."""
    state = op.init(0)
    per_step = []
    for chunk in chunks:
        state, out = op.step(state, chunk)
        per_step.append(out)
    state, out = op.flush(state)
    per_step.append(out)
    return state, per_step


def build_documents(corpus: Path, tokenizer: Path, max_docs: int | None) -> tuple[list[list], int]:
    """Tokenized documents as pipeline records, in chunks of ``READ``; and the EOS id."""
    from zephon.ops import Tokenize
    from zephon.types import Meta, Record, Segment

    op = Tokenize(tokenizer=str(tokenizer), special_tokens="eos")  # "auto": any exact backend will do here
    eos = op.handle.eos_token_id
    docs = []
    left = max_docs
    for shard, path in enumerate(C.corpus_files(corpus)):
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        if left is not None:
            rows = rows[:left]
            left -= len(rows)
        for start in range(0, len(rows), 256):
            part = rows[start : start + 256]
            for i, (out,) in enumerate(op.apply_many(part)):
                docs.append(Record(out, Meta(0, (Segment(0, shard, start + i, 0, 0, -1),), 0)))
        if left is not None and left <= 0:
            break
    return [docs[i : i + READ] for i in range(0, len(docs), READ)], eos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--num-bins", type=int, default=8, help="open bins for first_fit/best_fit")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from zephon.ops import pack as _pack
    from zephon.ops import Batch, PackFlat, Shuffle
    from zephon.testing import input_resolver

    algorithms = getattr(_pack, "ALGORITHMS", ("first_fit", "best_fit", "wrap", "best_fit_wrap"))

    load_start = C.load_average()
    t0 = time.perf_counter()
    doc_chunks, eos = build_documents(args.corpus, args.tokenizer, args.max_docs)
    n_docs = sum(len(c) for c in doc_chunks)
    doc_tokens = sum(len(r.payload["input_ids"]) for c in doc_chunks for r in c)
    print(f"{n_docs} documents, {doc_tokens:,} tokens (EOS included), tokenized in {time.perf_counter() - t0:.1f} s "
          f"(untimed); {args.repeats} repeats, median; load average {load_start}")

    results: list[dict[str, Any]] = []

    def record(name: str, base: str | None, items: str, tokens: int, fn: Callable[[], Any], **extra: Any) -> Any:
        med, times, out = _timed(fn, args.repeats)
        results.append({"operator": name, "baseline": base, "items": items, "tokens": tokens, "median_s": med,
                        "times_s": times, "tokens_per_s": tokens / med if med else None, **extra})
        print(f"  {name:44s} {med * 1000:9.1f} ms  {tokens / med:>14,.0f} tokens/s", flush=True)
        return out

    # -- document-level ----------------------------------------------------------------------------------
    def concat_docs():
        for chunk in doc_chunks:
            np.concatenate([r.payload["input_ids"] for r in chunk])

    record("baseline: np.concatenate docs (per 64)", None, f"{n_docs} docs", doc_tokens, concat_docs)

    rows_by_step = None
    for alg in algorithms:
        kwargs: dict[str, Any] = {"algorithm": alg}
        if alg in ("first_fit", "best_fit"):
            # "split" keeps every token (their default, "drop", would discard documents over 2049 tokens).
            kwargs.update(num_bins=args.num_bins, pad_token_id=eos, oversized="split")
        elif alg == "best_fit_wrap":
            kwargs.update(pad_token_id=eos)
        op = PackFlat(ROW, **kwargs)
        label = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "algorithm")
        name = f"pack_flat({ROW}, {alg}{', ' + label if label else ''})"
        state, per_step = record(name, "docs", f"{n_docs} docs", doc_tokens, lambda op=op: _run_chunks(op, doc_chunks))
        rep = op.report(state)
        results[-1].update(rows=rep["rows"], padding_tokens=rep["padding_tokens"], dropped_tokens=rep["dropped_tokens"])
        if alg == "wrap":
            rows_by_step = per_step
            pack_wrap = op

    # -- row-level ---------------------------------------------------------------------------------------
    row_chunks = [c for c in rows_by_step if c]
    rows = [r for c in row_chunks for r in c]
    row_tokens = sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in rows)

    def concat_rows():
        for i in range(0, len(rows), MICRO):
            np.concatenate([r.payload["input_ids"] for r in rows[i : i + MICRO]])

    record("baseline: np.concatenate rows (per 8)", None, f"{len(rows)} rows", row_tokens, concat_rows)

    shuffle = Shuffle(BUFFER, seed=42)
    _, shuffled = record(f"shuffle({BUFFER}, seed=42)", "rows", f"{len(rows)} rows", row_tokens,
                         lambda: _run_chunks(shuffle, row_chunks))
    shuffled = [c for c in shuffled if c]
    batch_op = Batch(MICRO)
    _, batched = record(f"batch({MICRO})", "rows", f"{len(rows)} rows", row_tokens, lambda: _run_chunks(batch_op, shuffled))
    batches = [b for c in batched for b in c]
    batch_tokens = sum(len(r.payload["input_ids"]) - r.meta.padding_length for b in batches for r in b.records)

    def training(dtype):
        def go():
            for b in batches:
                b.to_training(return_labels=True, dtype=dtype)

        return go

    record("to_training(return_labels=True) numpy int64", "rows", f"{len(batches)} batches", batch_tokens, training(np.int64))
    record("to_training(return_labels=True) torch.long", "rows", f"{len(batches)} batches", batch_tokens, training(torch.long))

    # -- checkpoint of a full shuffle buffer ---------------------------------------------------------------
    state = shuffle.init(0)
    best = state
    for chunk in row_chunks:
        state, _ = shuffle.step(state, chunk)
        if len(state.buffer) > len(best.buffer):
            best = state
        if len(best.buffer) >= BUFFER:
            break
    held = len(best.buffer)
    held_tokens = sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in best.buffer)
    blob = json.dumps(shuffle.encode_state(best))
    lookup = input_resolver(row_chunks)
    doc_lookup = input_resolver(doc_chunks)

    def repack(metas):
        return pack_wrap.rebuild(metas, doc_lookup)

    fill = f"{held}/{BUFFER} rows"
    record("checkpoint encode: encode_state + json.dumps", "rows", fill, held_tokens,
           lambda: json.dumps(shuffle.encode_state(best)), bytes=len(blob))
    record("checkpoint decode: json.loads + decode_state", "rows", fill, held_tokens,
           lambda: shuffle.decode_state(json.loads(blob), lookup), bytes=len(blob))
    restored = record("checkpoint decode + pack_flat rebuild of rows", "rows", fill, held_tokens,
                      lambda: shuffle.decode_state(json.loads(blob), repack), bytes=len(blob))
    same = all(
        a.meta == b.meta and np.array_equal(a.payload["input_ids"], b.payload["input_ids"])
        for a, b in zip(restored.buffer, best.buffer)
    )

    # -- table -----------------------------------------------------------------------------------------------
    base = {"docs": results[0]["tokens_per_s"], "rows": next(r for r in results if r["operator"].startswith("baseline: np.concatenate rows"))["tokens_per_s"]}
    headers = ["operator", "input", "tokens", "median ms", "tokens/s", "x baseline", "notes"]
    table = []
    for r in results:
        ratio = r["tokens_per_s"] / base[r["baseline"]] if r["baseline"] else None
        notes = []
        if "rows" in r and isinstance(r.get("rows"), int):
            notes.append(f"{r['rows']} rows, {r['padding_tokens']:,} pad, {r['dropped_tokens']:,} dropped")
        if "bytes" in r:
            notes.append(f"{r['bytes'] / 1024:.1f} KiB JSON")
        r["x_baseline"] = ratio
        table.append([r["operator"], r["items"], f"{r['tokens']:,}", f"{r['median_s'] * 1000:.1f}",
                      C.fmt_num(r["tokens_per_s"]), C.fmt_num(ratio, ".3f") if ratio is not None else "1 (base)",
                      "; ".join(notes)])
    print()
    C.print_table(headers, table, right=[False, False, True, True, True, True, False])
    load_end = C.load_average()
    print(f"\nrestored buffer equals the original: {same}; load average at start {load_start}, at end {load_end}")
    if args.json:
        args.json.write_text(json.dumps({"machine": C.machine_info(), "documents": n_docs, "doc_tokens": doc_tokens,
                                         "repeats": args.repeats, "load_average_start": load_start,
                                         "load_average_end": load_end, "results": results}, indent=2), encoding="utf-8")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
