"""Laws of ``order_by`` in whole pipelines: exact resume at any batch, and the same global steps
whatever the number of ranks, before and after a restore on another number of ranks.

A generated case: one or two finite in-memory datasets of rows ``{"toks": [...], "score": s}``
(token values a running counter, so every record is distinct; many equal scores and lengths, so
ties are common), the recipe ``map(with_ids) -> order_by(key, window, reverse) -> batch(mbs)``, with
the key ``token_count``, the field ``"score"`` or a tuple function, and a lane count ``L``. Lanes
end in partial windows, which are sorted and emitted; with several lanes the data ends mid-step.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from _budget import examples
from zephon import Pipeline, merge_checkpoints
from zephon.io import Dataset
from zephon.ops import token_count
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")


def with_ids(payload):
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32), "score": payload["score"]}


def score_then_longest(payload):
    return (payload["score"], -len(payload["input_ids"]))


KEYS = {"token_count": token_count, "score": "score", "tuple": score_then_longest}


@attrs.frozen
class Case:
    shards: tuple[tuple[tuple[int, int], ...], ...]  # dataset -> rows of (length, score), two shards each
    key: str
    window: int
    reverse: bool
    microbatch_size: int
    drop_last: bool
    seed: int

    def build(self, lanes: int, **options) -> Pipeline:
        datasets, token = [], 1
        for j, rows in enumerate(self.shards):
            payloads = []
            for n, score in rows:
                payloads.append({"toks": list(range(token, token + n)), "score": score})
                token += n
            half = len(payloads) // 2
            datasets.append(Dataset.from_dict(f"d{j}", {"a": payloads[:half], "b": payloads[half:]}))
        weights = {d.name: 1.0 for d in datasets}
        source = StaticMixtureWorkSource(datasets, weights, seed=self.seed, chunk_size=3, shuffle_within_shard=True)
        return (
            Pipeline(source)
            .options(canonical_replicas=lanes, **options)
            .map(with_ids)
            .order_by(KEYS[self.key], self.window, reverse=self.reverse)
            .batch(self.microbatch_size, drop_last=self.drop_last)
        )


rows = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), min_size=2, max_size=40)
cases = st.builds(
    Case,
    shards=st.lists(rows.map(tuple), min_size=1, max_size=2).map(tuple),
    key=st.sampled_from(sorted(KEYS)),
    window=st.one_of(st.integers(1, 4), st.integers(5, 30)),
    reverse=st.booleans(),
    microbatch_size=st.integers(1, 3),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
)


def global_steps(case: Case, lanes: int, dp: int, checkpoint: dict | None = None) -> list[list]:
    """The global steps of ``dp`` ranks from ``checkpoint``: only steps every rank completed."""
    per_rank = [list(case.build(lanes, dp_degree=dp, dp_rank=r).loader(checkpoint).steps()) for r in range(dp)]
    n = min(len(groups) for groups in per_rank)
    return [[b for groups in per_rank for b in groups[k]] for k in range(n)]


@settings(max_examples=examples(25))
@given(case=cases, lanes=st.sampled_from([1, 2, 3]), data=st.data())
def test_resuming_after_any_batch_gives_the_uninterrupted_suffix(case, lanes, data):
    full = list(case.build(lanes))
    k = data.draw(st.integers(0, len(full)), label="batches before the checkpoint")
    loader = iter(case.build(lanes))
    taken = [next(loader) for _ in range(k)]
    checkpoint = json.loads(json.dumps(loader.checkpoint()))
    assert outputs_equal(taken + list(case.build(lanes, read_size=2).loader(checkpoint)), full)


@settings(max_examples=examples(25))
@given(case=cases, data=st.data())
def test_every_rank_count_gives_the_same_global_steps_and_resumes_on_another(case, data):
    lanes = 4
    reference = global_steps(case, lanes, 1)
    for dp in (2, 4):
        got = global_steps(case, lanes, dp)
        assert len(got) == len(reference) and all(outputs_equal(a, b) for a, b in zip(got, reference)), f"D={dp}"
    k = data.draw(st.integers(0, len(reference)), label="global steps before stopping")
    before, after = data.draw(st.sampled_from([1, 2, 4]), label="D1"), data.draw(st.sampled_from([1, 2, 4]), label="D2")
    note(f"{len(reference)} global steps; stop after {k} on {before} ranks, resume on {after}")
    ranks = [case.build(lanes, dp_degree=before, dp_rank=r).loader() for r in range(before)]
    for loader in ranks:
        steps = loader.steps()
        for _ in range(k):
            next(steps)
    merged = json.loads(json.dumps(merge_checkpoints([loader.checkpoint() for loader in ranks])))
    rest = global_steps(case, lanes, after, merged)
    assert len(rest) == len(reference) - k and all(outputs_equal(a, b) for a, b in zip(rest, reference[k:]))
