from pathlib import Path

import numpy as np

from zephon.types import Meta, Record, Segment

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CORPUS = SHARED / "data" / "corpus"
GPT2 = SHARED / "data" / "gpt2" / "tokenizer.json"


def doc(row: int, n: int, *, lane: int = 0, dataset: int = 0, shard: int = 0, **fields) -> Record:
    """A sample-level record whose tokens are ``1000 * row + [0, n)`` (distinct per row)."""
    payload = {"input_ids": np.arange(1000 * row, 1000 * row + n, dtype=np.int32), **fields}
    return Record(payload, Meta(lane, (Segment(dataset, shard, row, 0, 0, -1),), 0))


def docs(lengths, **kw):
    return [doc(i, n, **kw) for i, n in enumerate(lengths)]




def toks_to_ids(payload):
    """Module-level (picklable) map for pipelines run in worker processes."""
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32)}


def fail_on_row_7(payload):
    if payload.get("id") == 7:
        raise ValueError("row 7 is bad")
    return payload
