"""Laws of ``on_error="skip"``: skipping is filtering, for every lane split, rank count and restore point.

A generated case is rows ``{"toks", "id", "bad"}`` in one to three shards, a random set of them
marked bad, and the recipe ``map(ids_unless_bad, on_error="skip") -> pack_flat -> shuffle -> batch``
on ``L`` lanes, where ``ids_unless_bad`` raises on a marked row. Whatever the bad rows, the
checkpoint point and the data-parallel sizes ``D1`` (before the checkpoint) and ``D2`` (after),
the global steps are those of the uninterrupted single-rank run, which are those of the same recipe
with the bad rows filtered out; and the skip log restored from the checkpoint and run on to the end
of every lane has counted and listed each bad row exactly once.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from _budget import examples
from _util import ids_unless_bad, not_bad, toks_to_ids
from zephon import Pipeline, merge_checkpoints
from zephon.io import Dataset, InMemoryShard
from zephon.testing import outputs_equal

pytestmark = [
    pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::zephon.SkippedRecordWarning"),
]


@st.composite
def cases(draw):
    shards = draw(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=20), min_size=1, max_size=3))
    n = sum(len(s) for s in shards)
    bad = draw(st.sets(st.integers(0, n - 1), max_size=n))
    lanes = draw(st.sampled_from([1, 2, 4]))
    recipe = {"max_length": draw(st.integers(2, 9)), "buffer": draw(st.integers(1, 5)), "mbs": draw(st.integers(1, 3))}
    return shards, frozenset(bad), lanes, recipe


def dataset(shards, bad) -> Dataset:
    mapping, i, token = {}, 0, 1
    for s, lengths in enumerate(shards):
        rows = []
        for n in lengths:
            rows.append({"toks": list(range(token, token + n)), "id": i, "bad": i in bad})
            i, token = i + 1, token + n
        mapping[f"s{s}"] = InMemoryShard(rows)
    return Dataset.from_dict("web", mapping)


def build(case, *, skip=True, dp=1, rank=0, **options) -> Pipeline:
    shards, bad, lanes, recipe = case
    pipe = Pipeline(dataset(shards, bad)).options(canonical_replicas=lanes, dp_degree=dp, dp_rank=rank, **options)
    pipe = pipe.map(ids_unless_bad, on_error="skip") if skip else pipe.filter(not_bad).map(toks_to_ids)
    return pipe.pack_flat(recipe["max_length"]).shuffle(recipe["buffer"], seed=3).batch(recipe["mbs"])


def assemble(per_rank):
    n = min(len(groups) for groups in per_rank)
    return [[b for groups in per_rank for b in groups[k]] for k in range(n)]


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@settings(max_examples=examples(30))
@given(case=cases(), data=st.data())
def test_skipping_resumed_on_other_ranks_gives_the_filtered_uninterrupted_run(case, data):
    lanes = case[2]
    reference = list(build(case).steps())
    filtered = list(build(case, skip=False).steps())
    assert outputs_equal([b for step in reference for b in step], [b for step in filtered for b in step])
    k = data.draw(st.integers(0, len(reference)), label="global steps before the checkpoint")
    before = data.draw(st.sampled_from(divisors(lanes)), label="D1")
    after = data.draw(st.sampled_from(divisors(lanes)), label="D2")
    read_size = data.draw(st.sampled_from([1, 3, 64]), label="read size")
    note(f"bad rows {sorted(case[1])}, L={lanes}, k={k}, D1={before}, D2={after}")
    ranks = [build(case, dp=before, rank=r).loader() for r in range(before)]
    for loader in ranks:
        steps = loader.steps()
        for _ in range(k):
            next(steps)
    checkpoint = json.loads(json.dumps(merge_checkpoints([loader.checkpoint() for loader in ranks])))
    resumed = [build(case, dp=after, rank=r, read_size=read_size).restore(checkpoint).loader() for r in range(after)]
    got = assemble([list(loader.steps()) for loader in resumed])
    assert len(got) == len(reference) - k
    for a, b in zip(got, reference[k:]):
        assert outputs_equal(a, b)
    with build(case, drain=True).restore(checkpoint).loader() as drained:  # every lane to its end, from there
        list(drained)
        skipped = drained.stats()["skipped"]
    assert skipped["total"] == len(case[1])  # the checkpoint's skips and the rest: each bad row once
    assert {r["row"] + sum(len(s) for s in case[0][: int(r["shard"][1:])]) for r in skipped["records"]} == case[1]
