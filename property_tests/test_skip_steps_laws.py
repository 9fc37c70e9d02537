"""Laws of skipping global steps: the uninterrupted run's steps, sliced, whatever the point, count and D.

The generated cases are :mod:`test_pipeline_laws`'s elastic specs (several steps for up to 8
lanes). A run stops after ``k`` global steps on ``D1`` ranks, checkpoints, and resumes on ``D2``
ranks with ``m`` steps skipped: its steps must be the uninterrupted run's steps ``k + m`` on,
also when ``k + m`` is at or past the end of finite data (then there are none).
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from _budget import examples
from test_pipeline_laws import (
    LANE_COUNTS, assemble, assert_same_steps, divisors, elastic_run, elastic_specs, over_the_wire, ranks_after,
)
from zephon import merge_checkpoints

pytestmark = [
    pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:skip_steps:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:keyframes:RuntimeWarning"),
]


@settings(max_examples=examples(12))
@given(spec=elastic_specs, lanes=st.sampled_from(LANE_COUNTS[1:]), codec=st.sampled_from(["none", "json", "msgpack"]),
       thread=st.booleans(), data=st.data())
def test_skipping_after_a_restore_gives_the_uninterrupted_steps_sliced(spec, lanes, codec, thread, data):
    reference = elastic_run(spec, lanes, 1)
    k = data.draw(st.integers(0, len(reference)), label="steps before the checkpoint")
    m = data.draw(st.integers(0, len(reference) - k + 1), label="steps skipped")
    before = data.draw(st.sampled_from(divisors(lanes)), label="D1")
    after = data.draw(st.sampled_from(divisors(lanes)), label="D2")
    event(f"skip reaches the end: {k + m >= len(reference)}")
    note(f"L={lanes}, k={k}, m={m}, D1={before}, D2={after}, thread={thread}")

    ranks = ranks_after(spec, lanes, before, k)
    checkpoint = over_the_wire(merge_checkpoints([loader.checkpoint() for loader in ranks]), codec)
    resumed = [
        spec.build(lanes=lanes, dp_degree=after, dp_rank=r, thread=thread).loader(checkpoint, skip_steps=m)
        for r in range(after)
    ]
    try:
        assert_same_steps(assemble([list(loader.steps()) for loader in resumed]), reference[k + m:])
    finally:
        for loader in resumed:
            loader.close()


@settings(max_examples=examples(8))
@given(spec=elastic_specs, lanes=st.sampled_from(LANE_COUNTS[1:]), data=st.data())
def test_skips_compose_and_checkpoints_carry_them(spec, lanes, data):
    reference = elastic_run(spec, lanes, 1)
    # Within the data: past its end lanes stop at their own ends, and a checkpoint there is not
    # between two whole steps (the first law skips past the end).
    a = data.draw(st.integers(0, min(3, len(reference))), label="first skip")
    b = data.draw(st.integers(0, 3), label="second skip")
    dp = data.draw(st.sampled_from(divisors(lanes)), label="D")
    loaders = [spec.build(lanes=lanes, dp_degree=dp, dp_rank=r).loader() for r in range(dp)]
    for loader in loaders:
        loader.skip_steps(a)
    checkpoint = merge_checkpoints([loader.checkpoint() for loader in loaders])
    resumed = spec.build(lanes=lanes).loader(checkpoint, skip_steps=b)
    assert resumed.skips == tuple((first, count) for first, count in ((0, a), (a, b)) if count)
    assert_same_steps(list(resumed.steps()), reference[a + b:])


@settings(max_examples=examples(12))
@given(spec=elastic_specs, lanes=st.sampled_from(LANE_COUNTS[1:]), every=st.integers(1, 4), data=st.data())
def test_skipping_from_keyframes_gives_the_uninterrupted_steps_sliced(spec, lanes, every, data):
    reference = elastic_run(spec, lanes, 1)
    saver = data.draw(st.sampled_from(divisors(lanes)), label="D of the run that saves keyframes")
    skipper = data.draw(st.sampled_from(divisors(lanes)), label="D of the run that skips")
    k = data.draw(st.integers(0, len(reference)), label="steps before the skip")
    m = data.draw(st.integers(0, len(reference) - k + 1), label="steps skipped")
    note(f"L={lanes}, every={every}, D1={saver}, D2={skipper}, k={k}, m={m}")
    with tempfile.TemporaryDirectory() as folder:
        assert_same_steps(elastic_run(spec, lanes, saver, keyframes=folder, keyframe_every=every), reference)
        ranks = [spec.build(lanes=lanes, dp_degree=skipper, dp_rank=r, keyframes=folder).loader() for r in range(skipper)]
        try:
            for loader in ranks:
                steps = loader.steps()
                for _ in range(k):
                    next(steps)
                skipped = loader.skip_steps(m)
                event(f"started from a keyframe: {skipped.keyframe is not None}")
            assert_same_steps(assemble([list(loader.steps()) for loader in ranks]), reference[k + m:])
        finally:
            for loader in ranks:
                loader.close()
