"""Reading ahead (``options(read_ahead=...)``): the same data, failures named by their own lane,
no work thrown away, and no thread left behind. The laws over generated pipelines are in
``property_tests/test_pipeline_laws.py``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _util import fail_on_row_7, toks_to_ids, toy_dataset
from zephon import Pipeline
from zephon.runtime import readahead as _readahead
from zephon.core.operator import StatelessOp
from zephon.testing import outputs_equal

pytestmark = pytest.mark.filterwarnings("ignore:end of data:RuntimeWarning")


def recipe(lanes: int = 4, **options) -> Pipeline:
    return (
        Pipeline(toy_dataset(400))
        .options(canonical_replicas=lanes, read_size=8, **options)
        .map(toks_to_ids)
        .pack_flat(16, algorithm="wrap")
        .shuffle(32, seed=3)
        .batch(2)
    )


def test_the_default_reads_ahead_and_gives_what_each_lane_reading_alone_gives():
    with recipe().loader() as alone, recipe(read_ahead=0).loader() as plain:
        assert alone.plan.read_ahead == 512 and plain.plan.read_ahead == 0
        assert outputs_equal(list(alone), list(plain))


def test_a_failure_is_raised_by_its_own_lane_with_the_same_message_and_notes():
    def run(read_ahead: int):
        pipe = (
            Pipeline(toy_dataset(200))
            .options(canonical_replicas=4, read_size=4, read_ahead=read_ahead)
            .map(fail_on_row_7)
            .map(toks_to_ids)
            .batch(2)
        )
        got = []
        with pytest.raises(ValueError) as info:
            for batch in pipe:
                got.append(batch)
        return got, info.value

    plain, plain_error = run(0)
    ahead, ahead_error = run(512)
    assert outputs_equal(ahead, plain)  # delivered up to the same point
    assert str(ahead_error) == str(plain_error) == "row 7 is bad"
    assert ahead_error.__notes__ == plain_error.__notes__
    assert any("row 7" in note for note in ahead_error.__notes__)


def test_no_sample_is_read_ahead_that_the_lanes_do_not_read(monkeypatch):
    prepared = []
    real = _readahead.prepare

    def counting(plan, wanted):
        out = real(plan, wanted)
        prepared.extend(len(p.inputs) for p in out)
        return out

    monkeypatch.setattr(_readahead, "prepare", counting)
    for lanes in (1, 4, 8):
        prepared.clear()
        loader = iter(recipe(lanes))
        list(loader)
        read = loader.stats()["flow"]["source"]["records_out"]
        loader.close()
        assert read > 0 and sum(prepared) == read, f"{lanes} lanes: {sum(prepared)} samples prepared, {read} read"


def test_the_background_thread_ends_with_the_loader():
    def alive():
        return {t for t in threading.enumerate() if t.name == "zephon-read-ahead"}

    before = alive()  # other tests' loaders may not have been collected yet
    loader = iter(recipe())
    next(loader)
    next(loader)
    mine = alive() - before
    assert len(mine) == 1, "the loader reads ahead in one background thread"
    loader.close()
    assert not any(t.is_alive() for t in mine), "close() waits for the thread to end"


class _Counting(StatelessOp):
    """Doubles ``x``; counts its ``apply_many`` calls (class-level, for the test)."""

    kind = "counting"
    calls = 0

    def apply_many(self, payloads):
        type(self).calls += 1
        return [[{"x": p["x"] * 2}] if p["x"] % 5 else [] for p in payloads]

    def fingerprint(self):
        return {"op": "counting"}


def test_one_call_of_the_per_record_operators_serves_every_chunk_read_together():
    from zephon.io import Dataset

    rows = [{"x": i} for i in range(1, 41)]
    pipe = Pipeline(Dataset.from_rows("n", rows)).options(canonical_replicas=4, read_size=3).add(_Counting(), name="double")
    plan = pipe.plan
    states = {lane: plan.init(lane) for lane in range(4)}
    wanted = [(lane, (states[lane].source, 3)) for lane in range(4)]
    _Counting.calls = 0
    chunks = _readahead.prepare(plan, wanted)
    assert _Counting.calls == 1
    for lane, chunk in zip(range(4), chunks):
        alone_source, pointers, exhausted = plan.source.read(states[lane].source, 4, lane, 3)
        records = plan.fetch(lane, pointers)
        expected, dropped, _ = _Counting().apply_records(records)
        assert (chunk.source, chunk.pointers, chunk.exhausted) == (alone_source, pointers, exhausted)
        assert [r.payload for r in chunk.outputs] == [r.payload for r in expected]
        assert [r.meta for r in chunk.outputs] == [r.meta for r in expected]
        assert tuple(a.dropped for a in chunk.applied) == (dropped,)


def test_nothing_reads_ahead_without_a_per_record_operator_first():
    from zephon.io import Dataset

    rows = [{"input_ids": np.arange(5, dtype=np.int32)} for _ in range(20)]
    pipe = Pipeline(Dataset.from_rows("t", rows)).options(canonical_replicas=2).pack_flat(8, algorithm="wrap").batch(2)
    assert _readahead.per_record_prefix(pipe.plan.chain) == 0
    assert pipe.plan.reader({0: pipe.plan.init(0)}) is None
    assert len(list(pipe)) > 0


def test_read_ahead_must_be_a_nonnegative_int():
    with pytest.raises(ValueError, match="read_ahead"):
        recipe(read_ahead=-1)
