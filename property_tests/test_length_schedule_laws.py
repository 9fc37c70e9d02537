"""Laws of sequence-length warmup: ``pack_flat(max_length=LengthSchedule(...))`` with
``batch(tokens_per_microbatch=T)``, on the toy source (documents of 0-39 tokens, some empty).

Laws, for a random schedule (1-3 phases of lengths ``k + 1`` with ``k`` dividing ``T``):
    * every microbatch of global step ``s`` holds ``T / (length - 1)`` rows of the length in force at ``s``;
    * a lane's rows, concatenated, are its documents' tokens in order (nothing lost at a switch);
    * a checkpoint at any global step, restored on D in {1, 2, 4} ranks (L=4), gives the same global
      batches as the uninterrupted run; one taken after any number of delivered microbatches (mid-step)
      resumes with exactly the rest.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from _budget import examples
from _util import global_steps, toks_to_ids, toy_dataset
from zephon import LengthSchedule, Pipeline
from zephon.work import StaticMixtureWorkSource

T = 24
LENGTHS = [k + 1 for k in range(1, T + 1) if T % k == 0]  # 2, 3, 4, 5, 7, 9, 13, 25
STEPS = 9


@st.composite
def schedules(draw):
    gaps = draw(st.lists(st.integers(1, 4), max_size=2), label="phase lengths in steps")
    starts = [0, *np.cumsum(gaps).tolist()]
    lengths = draw(st.lists(st.sampled_from(LENGTHS), min_size=len(starts), max_size=len(starts)), label="lengths")
    return LengthSchedule(list(zip(starts, lengths)))


def warmup(schedule: LengthSchedule, seed: int, lanes: int = 4) -> Pipeline:
    data = toy_dataset(80, seed=seed)
    source = StaticMixtureWorkSource([data], {"web": 1.0}, seed=seed, chunk_size=8, exhausted_policy="repeat")
    pipe = Pipeline(source).options(canonical_replicas=lanes).map(toks_to_ids)
    return pipe.pack_flat(schedule).batch(tokens_per_microbatch=T)


def content(step):
    return [[(r.meta, r.payload["input_ids"].tolist()) for r in b.records] for b in step]


@settings(max_examples=examples(10))
@given(schedule=schedules(), seed=st.integers(0, 3), at=st.integers(0, STEPS - 1), dp=st.sampled_from([1, 2, 4]))
def test_any_checkpoint_step_on_any_rank_count_resumes_the_same_batches(schedule, seed, at, dp):
    make = lambda: warmup(schedule, seed)  # noqa: E731
    reference, _ = global_steps(make, 4, 1, STEPS)
    for s, step in enumerate(reference):
        length = schedule.length_at(s)
        assert all(len(b.records) * (length - 1) == T for b in step)
        assert all(len(r.payload["input_ids"]) == length for b in step for r in b.records)
    with make().loader() as loader:
        it = loader.steps()
        for _ in range(at):
            next(it)
        ck = loader.checkpoint()
    resumed, _ = global_steps(make, 4, dp, STEPS - at, restore=ck)
    assert [content(s) for s in resumed] == [content(s) for s in reference[at:]]


@settings(max_examples=examples(8))
@given(schedule=schedules(), seed=st.integers(0, 3), stop=st.integers(0, 30))
def test_a_mid_step_checkpoint_resumes_exactly_and_no_token_is_lost(schedule, seed, stop):
    pipe = warmup(schedule, seed, lanes=2)
    with pipe.loader() as loader:
        for _ in range(stop):
            next(loader)
        ck = loader.checkpoint()
        rest = [content([next(loader)]) for _ in range(10)]
    with pipe.loader(ck) as resumed:
        assert [content([next(resumed)]) for _ in range(10)] == rest
    one = warmup(schedule, seed, lanes=1)
    rows = [r.payload["input_ids"] for _, b in zip(range(STEPS), one) for r in b.records]
    documents = [r.payload["input_ids"] for _, r in zip(range(200), Pipeline(one.source).map(toks_to_ids))]
    packed = np.concatenate(rows).tolist()
    assert packed == np.concatenate(documents).tolist()[: len(packed)]
