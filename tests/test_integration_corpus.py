"""The seed-003 recipe on the shared corpus with the real GPT-2 tokenizer (``../shared``; fails under CI=true when absent)."""

import json

import pytest

from _shared import shared_path
from zephon import Pipeline
from zephon.io import Dataset
from zephon.ledger import batch_digest
from zephon.work import StaticMixtureWorkSource

pytestmark = pytest.mark.integration

CORPUS = shared_path("data", "corpus")
GPT2 = shared_path("data", "gpt2", "tokenizer.json")


def recipe():
    source = StaticMixtureWorkSource([Dataset.from_path("corpus", CORPUS)], {"corpus": 1.0}, seed=0)
    return (
        Pipeline(source)
        .tokenize(tokenizer=str(GPT2), field="text", special_tokens="eos")
        .pack_flat(max_length=2049, algorithm="wrap")
        .shuffle(buffer_size=1024, seed=42)
        .batch(microbatch_size=8)
    )


def test_recipe_shapes_labels_and_exact_resume_with_small_state():
    from tokenizers import Tokenizer

    pipe = recipe()
    it = iter(pipe)
    first = next(it)
    out = first.to_training(return_labels=True)
    assert tuple(out["input_ids"].shape) == (8, 2048) and tuple(out["labels"].shape) == (8, 2048)
    assert (out["labels"][:, :-1] == out["input_ids"][:, 1:]).all()

    # Every row's tokens are exactly the GPT-2 tokens of the documents its segments name.
    tok = Tokenizer.from_file(str(GPT2))
    ds = pipe.source.datasets[0]
    rec = first.records[0]
    expected = []
    for seg in rec.meta.segments:
        text = ds.read(seg.shard, [seg.row])[0]["text"]
        ids = tok.encode(text, add_special_tokens=False).ids + [50256]
        expected.extend(ids[seg.start : seg.end])
    assert rec.payload["input_ids"].tolist() == expected

    for _ in range(130):  # 1040 rows emitted: the 1024-row shuffle buffer is full
        next(it)
    ckpt = json.loads(json.dumps(it.checkpoint()))
    per_lane = len(json.dumps(ckpt["lanes"]["0"]).encode())
    assert per_lane <= 64 * 1024, f"lane state is {per_lane} bytes"
    assert len(ckpt["lanes"]["0"]["ops"]["shuffle"]["buffer"]) == 1024  # held by reference

    expected_next = [batch_digest(next(it)) for _ in range(10)]
    resumed = iter(recipe().restore(ckpt))
    assert [batch_digest(next(resumed)) for _ in range(10)] == expected_next
