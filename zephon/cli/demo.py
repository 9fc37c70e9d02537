"""The quickstart demo: a generated corpus, a locally trained tokenizer, and the seed recipe.

Runs tokenize -> pack_flat -> shuffle -> batch in a temporary folder (no downloads), prints shapes,
throughput, stats and where every token went, then checks an exact resume from a mid-run checkpoint.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

_WORDS = (
    "the data loader packs tokens into rows so every batch is identical across restarts and any number of "
    "accelerators lanes shuffle seed checkpoint resume model training gradient step document sequence "
    "attention position label mask padding mixture corpus shard epoch worker process rank tensor"
).split()
_CODE = ["def", "return", "for", "in", "if", "else", "import", "class", "(", ")", ":", "=", "+", "x", "y", "i", "self", "0", "1"]


def make_corpus(folder: Path, *, docs: int = 1200, seed: int = 0) -> dict[str, Path]:
    """Write two small JSONL datasets ("prose" and "code") of generated documents."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, vocab, shards in (("prose", _WORDS, 4), ("code", _CODE, 2)):
        d = folder / name
        d.mkdir(parents=True, exist_ok=True)
        per = docs // shards
        for s in range(shards):
            with open(d / f"shard-{s:05d}.jsonl", "w", encoding="utf-8") as fh:
                for i in range(per):
                    n = int(rng.integers(20, 900))
                    words = [vocab[j] for j in rng.integers(0, len(vocab), size=n)]
                    fh.write(json.dumps({"text": " ".join(words) + ".", "id": f"{name}-{s}-{i}"}) + "\n")
        out[name] = d
    return out


def train_tokenizer(folder: Path, texts: list[str]) -> Path:
    """Train a small byte-level BPE tokenizer with an end-of-text token; returns tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def build(paths: dict[str, Path], tokenizer: Path, lanes: int, workers: int = 0):
    from .. import Pipeline
    from ..sources.dataset import Dataset
    from ..sources.work_source import StaticMixtureWorkSource

    datasets = [Dataset.from_path(name, p) for name, p in paths.items()]
    source = StaticMixtureWorkSource(datasets, {"prose": 0.7, "code": 0.3}, seed=42, shuffle_within_shard=True, exhausted_policy="stop")
    return (
        Pipeline(source)
        .options(canonical_replicas=lanes, workers=workers)
        .tokenize(tokenizer=str(tokenizer), field="text", special_tokens="eos")
        .pack_flat(max_length=257, algorithm="wrap")
        .shuffle(buffer_size=256, seed=42)
        .batch(microbatch_size=8)
    )


def token_account(stats: dict) -> str:
    """Where every tokenized token went: delivered, dropped (by operator, from ``stats["flow"]``)
    or left undelivered; at the end of the data they add up to the tokens produced."""
    flow = [(name, f) for name, f in stats["flow"].items() if f["tokens_in"] or f["tokens_out"]]
    if not flow:
        return "tokens: no per-operator flow measured"
    produced = flow[0][1]["tokens_in"] or flow[0][1]["tokens_out"]
    lost = {name: f["tokens_in"] - f["tokens_out"] for name, f in flow if f["tokens_in"] and f["tokens_in"] != f["tokens_out"]}
    delivered, left = stats["throughput"]["tokens"], stats["undelivered"]
    by_op = ", ".join(f"{name} {n:,}" for name, n in lost.items()) or "none"
    return (
        f"tokens: {produced:,} tokenized = {delivered:,} delivered + {sum(lost.values()):,} dropped in total ({by_op}; "
        f"{sum(lost.values()) / max(produced, 1):.2%}) + {left['tokens']:,} undelivered ({left['outputs']} output(s) short of "
        "a whole global step; options(drain=True) delivers them)"
    )


def run_demo(*, lanes: int = 4, workers: int = 0) -> int:
    from ..runtime.ledger import batch_digest

    with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
        folder = Path(tmp)
        paths = make_corpus(folder)
        texts = [json.loads(line)["text"] for p in paths.values() for f in sorted(p.glob("*.jsonl")) for line in open(f)]
        tokenizer = train_tokenizer(folder, texts[:400])
        print(f"corpus: {len(texts)} documents in {folder} | tokenizer: BPE trained locally ({tokenizer.name})")

        start, first, batches, tokens = time.perf_counter(), None, [], 0
        loader = iter(build(paths, tokenizer, lanes, workers))
        with warnings.catch_warnings():  # the end-of-data accounting is printed below instead
            warnings.simplefilter("ignore", RuntimeWarning)
            for batch in loader:
                first = time.perf_counter() - start if first is None else first
                batches.append(batch)
                tokens += sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in batch.records)
        elapsed = time.perf_counter() - start
        tensors = batches[0].to_training(return_labels=True, return_loss_mask=True)
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items() if hasattr(v, "shape"))
        print(f"lanes: {lanes} | batches: {len(batches)} | first batch: lane {batches[0].lane}, {shapes}")
        print(f"lane order of the first {2 * lanes} batches: {[b.lane for b in batches[: 2 * lanes]]}")
        print(f"throughput: {tokens / elapsed:,.0f} tokens/s ({tokens:,} tokens in {elapsed:.2f} s; first batch after {first:.3f} s)")
        print(f"\n{loader.stats_table()}\n{token_account(loader.stats())}\n")

        k = len(batches) // 3
        it = iter(build(paths, tokenizer, lanes))
        for _ in range(k):
            next(it)
        wire = json.dumps(it.checkpoint())
        size = len(wire) / lanes
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            rest = list(build(paths, tokenizer, lanes).loader(json.loads(wire)))
        restore_s = time.perf_counter() - t0
        same = [batch_digest(b) for b in rest] == [batch_digest(b) for b in batches[k:]]
        print(
            f"checkpoint after {k} batches: {size / 1024:.1f} KiB per lane (JSON); resumed run "
            f"{'matches' if same else 'DIFFERS FROM'} the uninterrupted run for all {len(rest)} remaining batches "
            f"({restore_s:.2f} s to restore and finish)"
        )
        return 0 if same else 1


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run a demo pipeline on a generated corpus with a locally trained tokenizer")
    demo.add_argument("--lanes", type=int, default=4, help="canonical_replicas: the number of lanes (default 4)")
    demo.add_argument(
        "--workers", type=int, default=0, help="worker processes running the lanes (default 0: in this process)"
    )
    demo.set_defaults(func=lambda args: run_demo(lanes=args.lanes, workers=args.workers))
