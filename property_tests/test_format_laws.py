"""Laws of file formats: the same rows stored as JSONL, Parquet or Arrow give the same batches.

A generated case is a set of shards of rows ``{"id": int, "text": str, "toks": [int, ...]}``
written three ways (JSONL, Parquet with a random row-group size, Arrow IPC with a random batch
size) and read by one recipe (``map -> pack_flat -> shuffle -> batch``) on ``L`` lanes. The format
must never change a batch, and a Parquet run stopped after any global step on ``D1`` ranks and
resumed on ``D2`` ranks must continue exactly as the uninterrupted JSONL run.
"""

from __future__ import annotations

import json
import os
import tempfile

import pyarrow as pa
import pyarrow.feather
import pyarrow.parquet
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from _budget import examples
from _util import toks_to_ids
from zephon import Pipeline, merge_checkpoints
from zephon.io import Dataset
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")


def write_copies(folder: str, shards: list[list[dict]], group_rows: int) -> dict[str, str]:
    """The shards as JSONL, Parquet and Arrow files; ``{format: folder}``."""
    out = {}
    for fmt in ("jsonl", "parquet", "arrow"):
        os.makedirs(os.path.join(folder, fmt))
        out[fmt] = os.path.join(folder, fmt)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string()), ("toks", pa.list_(pa.int64()))])
    for s, rows in enumerate(shards):
        with open(os.path.join(out["jsonl"], f"part-{s:03d}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        table = pa.Table.from_pylist(rows, schema=schema)
        pa.parquet.write_table(table, os.path.join(out["parquet"], f"part-{s:03d}.parquet"), row_group_size=group_rows)
        pa.feather.write_feather(table, os.path.join(out["arrow"], f"part-{s:03d}.arrow"), chunksize=group_rows)
    return out


@st.composite
def corpora(draw):
    sizes = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4), label="rows per shard")
    shards, token = [], 1
    for s, n in enumerate(sizes):
        rows = []
        for i in range(n):
            length = draw(st.integers(0, 9))
            rows.append({"id": s * 1000 + i, "text": f"row {s}.{i}", "toks": list(range(token, token + length))})
            token += length
        shards.append(rows)
    return shards


def build(folder: str, cache: str, *, lanes: int, dp: int = 1, rank: int = 0, seed: int = 0, **options) -> Pipeline:
    ds = Dataset.from_path("web", folder, cache_dir=cache)
    source = StaticMixtureWorkSource([ds], {"web": 1}, seed=seed, shuffle_within_shard=True, chunk_size=4)
    return (
        Pipeline(source)
        .options(canonical_replicas=lanes, dp_degree=dp, dp_rank=rank, **options)
        .map(toks_to_ids)
        .pack_flat(6, algorithm="wrap")
        .shuffle(8, seed=3)
        .batch(2)
    )


def global_steps(pipes: list[Pipeline]) -> list[list]:
    per_rank = [list(p.steps()) for p in pipes]
    n = min(len(g) for g in per_rank)
    return [[b for groups in per_rank for b in groups[k]] for k in range(n)]


@settings(max_examples=examples(12))
@given(shards=corpora(), group_rows=st.integers(1, 12), lanes=st.sampled_from([1, 2, 4]), seed=st.integers(0, 3))
def test_jsonl_parquet_and_arrow_copies_give_identical_batches(shards, group_rows, lanes, seed):
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_copies(tmp, shards, group_rows)
        cache = os.path.join(tmp, "cache")
        reference = list(build(folders["jsonl"], cache, lanes=lanes, seed=seed))
        for fmt in ("parquet", "arrow"):
            got = list(build(folders[fmt], cache, lanes=lanes, seed=seed))
            assert outputs_equal(got, reference), f"{fmt} batches differ from JSONL"


@settings(max_examples=examples(12))
@given(shards=corpora(), group_rows=st.integers(1, 12), lanes=st.sampled_from([2, 4]), data=st.data())
def test_a_parquet_run_resumed_on_another_d_continues_the_jsonl_run(shards, group_rows, lanes, data):
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_copies(tmp, shards, group_rows)
        cache = os.path.join(tmp, "cache")
        reference = global_steps([build(folders["jsonl"], cache, lanes=lanes)])
        k = data.draw(st.integers(0, len(reference)), label="steps before stopping")
        before = data.draw(st.sampled_from([d for d in (1, 2, 4) if lanes % d == 0]), label="D1")
        after = data.draw(st.sampled_from([d for d in (1, 2, 4) if lanes % d == 0]), label="D2")
        note(f"L={lanes}, {len(reference)} steps, stop after {k}, D {before} -> {after}")
        ranks = [build(folders["parquet"], cache, lanes=lanes, dp=before, rank=r).loader() for r in range(before)]
        for loader in ranks:
            steps = loader.steps()
            for _ in range(k):
                next(steps)
        merged = json.loads(json.dumps(merge_checkpoints([loader.checkpoint() for loader in ranks])))
        got = global_steps([build(folders["parquet"], cache, lanes=lanes, dp=after, rank=r, read_size=3).restore(merged) for r in range(after)])
        assert len(got) == len(reference) - k
        for step, (a, b) in enumerate(zip(got, reference[k:])):
            assert outputs_equal(a, b), f"global step {k + step} differs"
