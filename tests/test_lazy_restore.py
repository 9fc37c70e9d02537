"""Lazy restore of whole lanes: what the first output needs is rebuilt at ``restore``, the rest later.

The lane due first gives its next output at ``restore``: an undelivered output it holds is rebuilt
then (its operator states later, as the other lanes' are); otherwise its operator states are.
The batches and checkpoints are those of an eager restore (property-tested in
``property_tests/test_pipeline_laws.py``); here: what waits, that it is rebuilt in the
background without being stepped, that a checkpoint taken before then is the restored one, and
that a state which fails only once it is rebuilt is refused, naming lane and field, when its lane
is due.
"""

import json
import time
from typing import ClassVar

import msgspec
import pytest

import zephon.runtime.lazy as zephon_lazy
from _util import Held, Holds, toy_dataset, toy_pipeline
from zephon.runtime.checkpoint import seal
from zephon.core.operator import Chain, ChainState, records_later
from zephon.runtime.lazy import DeferredChain, DeferredOutput
from zephon.testing import outputs_equal
from zephon.types import Meta, Record, Segment


def _pipe(lanes=4, **kw):
    return toy_pipeline(lanes, data=toy_dataset(80), buffer=4, **kw)


def _running(lanes=4, steps=6):
    """A checkpoint after ``steps`` outputs of a ``lanes``-lane pipeline, and the 12 outputs after it."""
    it = iter(_pipe(lanes))
    for _ in range(steps):
        next(it)
    ck = json.loads(json.dumps(it.checkpoint()))
    after = [next(it) for _ in range(12)]
    it.close()
    return ck, after


def _first(ck):
    """The lane due first after restoring ``ck``: fewest delivered outputs, then lowest id."""
    lanes = range(len(ck["lanes"]))
    return min(lanes, key=lambda ln: (ck["lanes"][str(ln)]["delivered"], ln))


def _running_until(lanes, wanted):
    """The first ``_running(lanes, steps)`` checkpoint for which ``wanted(ck, first lane)`` holds."""
    for steps in range(lanes, 80):
        ck, after = _running(lanes, steps)
        if wanted(ck, _first(ck)):
            return ck, after
    raise AssertionError("no such checkpoint")


def _decode(ck, lanes=4):
    return _pipe(lanes).plan.decode_lanes({lane: ck["lanes"][str(lane)] for lane in range(lanes)})


def test_only_the_output_due_first_is_rebuilt_at_restore():
    ck, _ = _running(4, steps=6)  # lanes 0, 1 delivered 2 outputs, lanes 2, 3 one: lane 2 is due first
    assert _first(ck) == 2 and ck["lanes"]["2"]["pending"]  # it holds undelivered outputs
    states = _decode(ck)
    assert all(type(s.chain) is DeferredChain for s in states.values())  # every lane's operator states wait
    assert type(states[2].pending[0]) is not DeferredOutput  # the output due first is rebuilt
    assert all(type(out) is DeferredOutput for lane in (0, 1, 3) for out in states[lane].pending)
    # A lane due first that holds no undelivered output steps for its next one: its states are rebuilt now.
    ck, _ = _running_until(4, lambda ck, first: not ck["lanes"][str(first)]["pending"])
    states = _decode(ck)
    assert sorted(lane for lane, s in states.items() if type(s.chain) is DeferredChain) == sorted(set(range(4)) - {_first(ck)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zephon_lazy, "LAZY_LANES", False)
        eager = _decode(ck)
    assert not any(type(s.chain) is DeferredChain for s in eager.values())


def test_lazily_restored_lanes_give_the_same_outputs_and_checkpoints():
    ck, after = _running(4, steps=6)
    it = iter(_pipe(4).restore(ck))
    assert json.loads(json.dumps(it.checkpoint())) == ck  # nothing rebuilt yet but the lane due first
    got = []
    for _ in range(12):
        got.append(next(it))
        json.dumps(it.checkpoint())
    assert outputs_equal(got, after)


def test_the_other_lanes_are_rebuilt_in_the_background_after_the_first_output():
    ck, _ = _running(4, steps=6)
    it = iter(_pipe(4).restore(ck))
    lazy = {lane: s.chain.lane for lane, s in it.executor.states.items() if type(s.chain) is DeferredChain}
    assert sorted(lazy) == [0, 1, 2, 3]  # lane 2 gives an undelivered output first: its states wait too
    assert not any(job._rows.done() for job in lazy.values())  # nothing before the first output
    next(it)  # lane 2's output; it starts the background rebuild
    deadline = time.monotonic() + 30
    while not all(job._rows.done() for job in lazy.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(job._rows.done() for job in lazy.values())
    it.close()


def _damaged(ck, lane):
    """``ck`` with ``lane``'s open packing row reaching past its document, re-signed: only a rebuild finds it.

    A wrap row's open piece is the tail of its document, so one more token is outside it.
    """
    state = json.loads(json.dumps(ck["lanes"][str(lane)]))
    stream = state["ops"]["pack_flat"]["stream"]
    ref, start, end = stream[-1]
    stream[-1] = [ref, start, end + 1]
    return {**ck, "lanes": {**ck["lanes"], str(lane): seal(lane, state)}}


def _open_tokens(ck, lane):
    return sum(end - start for _, start, end in ck["lanes"][str(lane)]["ops"]["pack_flat"]["stream"])


def _with_open_rows(lanes):
    """A checkpoint where the lane due first and another lane hold open packing rows; both lanes."""
    for steps in range(lanes, 40):
        ck, _ = _running(lanes, steps)
        first = min(range(lanes), key=lambda ln: (ck["lanes"][str(ln)]["delivered"], ln))
        # an open row with room for one more token (a full one would have been emitted)
        holding = [ln for ln in range(lanes) if 0 < _open_tokens(ck, ln) < 15]
        others = [ln for ln in holding if ln != first]
        if first in holding and others:
            return ck, others[0], first
    raise AssertionError("no checkpoint with open rows in the lane due first and another")


def test_a_state_that_fails_only_when_rebuilt_is_refused_when_its_lane_is_due():
    ck, lane, first = _with_open_rows(4)
    bad = _damaged(ck, lane)
    message = rf"lane {lane}: field 'ops': .*'pack_flat': field 'stream\[\d+\]': token range \[\d+, \d+\) is outside"
    it = iter(_pipe(4).restore(bad))  # the lane is checked for what needs no record, and waits
    with pytest.raises(ValueError, match=message):
        for _ in range(4):  # one global step: every lane is due within it
            next(it)
    it.close()
    with pytest.MonkeyPatch.context() as mp:  # rebuilt at restore: the same error, there
        mp.setattr(zephon_lazy, "LAZY_LANES", False)
        with pytest.raises(ValueError, match=message):
            iter(_pipe(4)).restore(bad)
    # The lane due first: its states are rebuilt when it steps, after the undelivered outputs it holds ...
    bad, held = _damaged(ck, first), len(ck["lanes"][str(first)]["pending"])
    assert held
    it = iter(_pipe(4)).restore(bad)
    with pytest.raises(ValueError, match=rf"lane {first}: field 'ops': .*token range"):
        for _ in range(4 * (held + 1)):
            next(it)
    it.close()
    # ... and at restore when it holds none: its next output needs them.
    ck, _ = _running_until(4, lambda ck, first: not ck["lanes"][str(first)]["pending"] and 0 < _open_tokens(ck, first) < 15)
    with pytest.raises(ValueError, match=rf"lane {_first(ck)}: field 'ops': .*token range"):
        iter(_pipe(4)).restore(_damaged(ck, _first(ck)))


def test_a_bad_operator_state_of_a_waiting_lane_is_refused_when_the_lane_is_due():
    ck, _ = _running(4, steps=6)  # lane 2 is due first
    state = json.loads(json.dumps(ck["lanes"]["0"]))
    state["ops"]["shuffle"]["draws"] = "three"
    bad = {**ck, "lanes": {**ck["lanes"], "0": seal(0, state)}}
    message = r"lane 0: field 'ops': .*operator 'shuffle'.*draws"
    it = iter(_pipe(4).restore(bad))
    with pytest.raises(ValueError, match=message):
        for _ in range(4):
            next(it)
    it.close()
    with pytest.raises(ValueError, match=message):  # a checkpoint needs the lane's states: rebuilt then
        iter(_pipe(4).restore(bad)).checkpoint()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zephon_lazy, "LAZY_LANES", False)
        with pytest.raises(ValueError, match=message):
            iter(_pipe(4)).restore(bad)


def test_the_background_stops_rebuilding_a_buffer_nothing_else_holds():
    import threading
    import weakref

    calls: list[int] = []
    gate = threading.Event()

    def resolve(refs):
        gate.wait(10)
        calls.append(len(refs))
        return list(refs)

    rows = zephon_lazy.LazyRows(list(range(1000)), resolve, range(1000), check=False)
    held = weakref.ref(rows)
    zephon_lazy.kick()  # the background takes the first chunk, and waits at the gate
    del rows  # dropped (a loader closed, or its lanes moved to worker processes)
    gate.set()
    deadline = time.monotonic() + 10
    while held() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held() is None
    time.sleep(0.2)
    assert len(calls) <= 1  # at most the chunk it was rebuilding; 1,000 references waited


def test_a_record_due_before_the_background_takes_the_next_ones_it_will_need_along():
    calls: list[list[int]] = []

    def resolve(refs):
        calls.append(list(refs))
        return [r * 10 for r in refs]

    order = [5, 2, 9, 0, 7, 1, 8, 3, 6, 4, 11, 10]
    rows = zephon_lazy.LazyRows(list(range(12)), resolve, order, check=False, along=3)
    assert rows.record(5) == 50
    assert calls == [[5, 2, 9, 0]]  # one bulk call: the record due and the next three in need order
    assert [rows.record(i) for i in (2, 9, 0)] == [20, 90, 0] and len(calls) == 1
    assert rows.record(4) == 40  # out of order: with the next waiting ones in need order
    assert calls[1] == [4, 7, 1, 8]
    alone = zephon_lazy.LazyRows(list(range(4)), resolve, range(4), check=False)  # along=0: alone
    assert alone.record(2) == 20 and calls[-1] == [2]


def test_materialize_all_rebuilds_the_waiting_records_in_one_call_per_buffer():
    calls: list[list[int]] = []

    def resolve(refs):
        calls.append(list(refs))
        if 13 in refs:
            raise ValueError("row 13 changed")
        return [Record({"v": r}, r) for r in refs]

    rows = zephon_lazy.LazyRows(list(range(20)), resolve, range(20))
    other = zephon_lazy.LazyRows([100, 101], resolve, range(2))
    rows.record(3)  # rebuilt earlier, alone
    records = [Record(zephon_lazy.Deferred(rows, i), i) for i in (7, 3, 1, 12)]
    records += [Record({"v": "real"}, 50), Record(zephon_lazy.Deferred(other, 1), 101)]
    got = zephon_lazy.materialize_all(records)
    assert [r.payload["v"] for r in got] == [7, 3, 1, 12, "real", 101]
    assert calls[1:] == [[7, 1, 12], [101]]  # the waiting ones, one call per buffer, in order
    with pytest.raises(ValueError, match="row 13 changed"):  # an error is raised for the records it names
        zephon_lazy.materialize_all([Record(zephon_lazy.Deferred(rows, 13), 13)])


class _WrapsErrors(Holds):
    """Holds records; reports any failure to rebuild them in its own words (as user operators may)."""

    kind: ClassVar[str] = "wraps"

    def decode_state(self, data, upstream):
        try:
            return super().decode_state(data, upstream)
        except Exception as exc:
            raise ValueError(f"wraps: cannot rebuild its records ({exc})") from exc


def test_checking_a_state_stops_before_its_records_even_inside_an_operator_that_wraps_errors():
    chain = Chain((("wraps", _WrapsErrors()),))
    meta = Meta(0, (Segment(0, 0, 3, 0, 0, -1),))
    data = chain.encode_state(ChainState((Held((Record({"x": 1}, meta),)),)))
    chain.check_state(data, records_later)  # stops where the record would be rebuilt: no error

    def refuses(refs):
        raise ValueError("row 3 does not exist")

    with pytest.raises(ValueError, match=r"operator 'wraps': wraps: cannot rebuild its records \(row 3 does not exist\)"):
        chain.check_state(data, refuses)
    with pytest.raises(ValueError, match=r"operator 'wraps'"):  # a malformed state, before any record
        chain.check_state({"wraps": {"type": "held", "records": "three"}}, records_later)


def test_a_lane_whose_data_ended_rebuilds_one_piece_of_its_buffer_for_its_next_output(monkeypatch):
    """Restored between pieces of its flush, a lane rebuilds one piece of its buffer, not all of it."""
    import threading

    from _util import toy_dataset, toy_pipeline
    from zephon.ops.shuffle import FLUSH_PIECE

    def pipe():
        return toy_pipeline(1, data=toy_dataset(600), buffer=128, mbs=2, policy="stop")

    stream = list(pipe())
    it = iter(pipe())
    for delivered in range(len(stream)):
        next(it)
        ck = json.loads(json.dumps(it.checkpoint()))
        lane = ck["lanes"]["0"]
        if lane["done"] and not lane["pending"] and len(lane["ops"]["shuffle"]["buffer"]) >= 64:
            break
    else:
        raise AssertionError("no checkpoint between pieces of a flush")
    it.close()
    main = threading.get_ident()
    rebuilt: list[int] = []
    rebuild = zephon_lazy.LazyRows._rebuild

    def counting(self, indices):
        if threading.get_ident() == main:
            rebuilt.append(len(indices))
        return rebuild(self, indices)

    monkeypatch.setattr(zephon_lazy.LazyRows, "_rebuild", counting)
    resumed = iter(pipe().restore(ck))
    first = next(resumed)
    assert sum(rebuilt) <= FLUSH_PIECE < len(lane["ops"]["shuffle"]["buffer"])
    rest = [first, *resumed]
    assert outputs_equal(rest, stream[delivered + 1 :])


def _large_shuffle_state():
    from _util import docs
    from zephon.ops import Shuffle

    op = Shuffle(64, seed=2)
    state, _ = op.step(op.init(0), docs([3] * 100))
    assert len(state.buffer) >= zephon_lazy.LAZY_MIN_RECORDS
    return op, json.loads(json.dumps(op.encode_state(state)))


def _resigned(edit):
    def apply(data):
        data = json.loads(json.dumps(data))
        edit(data)
        return data

    return apply


SHUFFLE_EDITS = {
    "draws": _resigned(lambda d: d.update(draws=d["draws"] + 1)),
    "negative": _resigned(lambda d: d.update(draws=-1, emitted=-1)),
    "too many": _resigned(lambda d: d["buffer"].extend(d["buffer"][:40])),
    "bool in a reference": _resigned(lambda d: d["buffer"][3].__setitem__(4, True)),
    "short reference": _resigned(lambda d: d["buffer"][5].pop()),
    "float in a reference": _resigned(lambda d: d["buffer"][0].__setitem__(2, 1.5)),
    "unknown field": _resigned(lambda d: d.update(extra=1)),
}


def test_checking_a_large_shuffle_buffer_decodes_no_reference(monkeypatch):
    from zephon.ops import Shuffle

    op, data = _large_shuffle_state()

    def decode(*args):
        raise AssertionError("decoded")

    monkeypatch.setattr(Shuffle, "decode_state", decode)
    op.check_state(data, records_later)  # counters, size and the form of each reference, none decoded


@pytest.mark.parametrize("edit", SHUFFLE_EDITS, ids=list(SHUFFLE_EDITS))
def test_checking_a_large_shuffle_buffer_refuses_what_decoding_it_refuses(edit):
    op, data = _large_shuffle_state()
    bad = SHUFFLE_EDITS[edit](data)
    with pytest.raises((ValueError, TypeError, msgspec.ValidationError)) as decoding:
        op.decode_state(bad, records_later)
    with pytest.raises(type(decoding.value)) as checking:
        op.check_state(bad, records_later)
    assert str(checking.value) == str(decoding.value)
