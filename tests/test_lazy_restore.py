"""Deferred restore: what the first output needs is rebuilt at ``restore``, the rest when due.

Lane states are plain values: a restored state holds references (records whose payload is
``UNRESOLVED``) where it held records, and the lanes rebuild them when due. The lane due first
gives its next output at ``restore``: an undelivered output it holds is rebuilt then, otherwise
its operators' held records are; every other lane's operator states are rebuilt before it next
steps, an undelivered output when it is delivered, and a shuffle's buffered records as they are
drawn. The batches and checkpoints are those of a whole restore (property-tested in
``property_tests/test_pipeline_laws.py``); here: what waits, that a checkpoint taken before it is
rebuilt is the restored one, and that what fails only once rebuilt is refused, naming lane and
field, when it is due (everything else at ``restore``).
"""

import json
import pickle

import msgspec
import pytest

import zephon.runtime.lanes as zephon_lanes
from _util import docs, toy_dataset, toy_pipeline
from zephon.core.state import keep_references, references
from zephon.ops import Shuffle
from zephon.ops.shuffle import FLUSH_PIECE
from zephon.runtime.checkpoint import seal
from zephon.testing import input_resolver, outputs_equal
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


def _held(state, op="shuffle"):
    """The references that operator ``op`` of a lane state holds."""
    return references(state.chain.states[_pipe().plan.chain.names.index(op)])


def test_only_the_output_due_first_is_rebuilt_at_restore():
    ck, _ = _running(4, steps=6)  # lanes 0, 1 delivered 2 outputs, lanes 2, 3 one: lane 2 is due first
    assert _first(ck) == 2 and ck["lanes"]["2"]["pending"]  # it holds undelivered outputs
    states = _decode(ck)
    assert all(s.unresolved and _held(s, "pack_flat") for s in states.values())  # every lane's operator states wait
    assert not references(states[2].pending[0])  # the output due first is rebuilt
    assert all(references(out) for lane in (0, 1, 3) for out in states[lane].pending)
    # A lane due first that holds no undelivered output steps for its next one: its states are rebuilt now.
    ck, _ = _running_until(4, lambda ck, first: not ck["lanes"][str(first)]["pending"])
    states = _decode(ck)
    assert sorted(lane for lane, s in states.items() if s.unresolved) == sorted(set(range(4)) - {_first(ck)})
    assert not _held(states[_first(ck)], "pack_flat") and not _held(states[_first(ck)], "batch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zephon_lanes, "DEFERRED_RESTORE", False)
        whole = _decode(ck)
    assert not any(s.unresolved or references(s.chain) or references(s.pending) for s in whole.values())


def test_restored_lane_states_are_plain_values_that_pickle_and_compare_without_rebuilding():
    ck, _ = _running(4, steps=6)
    states = _decode(ck)
    for state in states.values():
        again = pickle.loads(pickle.dumps(state))
        assert again == state  # equality compares metas and payloads; a reference is only a meta
        assert references(again.chain) == references(state.chain)
    rec = states[0].pending[0].records[0]
    with pytest.raises(AttributeError, match="immutable"):
        rec.payload = {}


def test_deferred_lanes_give_the_same_outputs_and_checkpoints():
    ck, after = _running(4, steps=6)
    it = iter(_pipe(4).restore(ck))
    assert json.loads(json.dumps(it.checkpoint())) == ck  # nothing rebuilt yet but the lane due first
    got = []
    for _ in range(12):
        got.append(next(it))
        json.dumps(it.checkpoint())
    assert outputs_equal(got, after)


def test_a_restored_buffer_is_rebuilt_as_it_is_drawn():
    def pipe():
        return toy_pipeline(1, data=toy_dataset(400), buffer=64)

    it = iter(pipe())
    for _ in range(40):
        next(it)
    ck = json.loads(json.dumps(it.checkpoint()))
    after = [next(it) for _ in range(30)]
    it.close()
    plan = pipe().plan
    state = plan.decode_lanes({0: ck["lanes"]["0"]})[0]
    waiting = [len(_held(state))]
    got = []
    for _ in range(30):
        state, out = plan.next(0, state)
        got.append(out)
        waiting.append(len(_held(state)))
    assert outputs_equal(got, after)
    assert waiting[0] == len(ck["lanes"]["0"]["ops"]["shuffle"]["buffer"]) > waiting[-1] > 0  # each drawn record, when drawn
    assert all(a >= b for a, b in zip(waiting, waiting[1:]))


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
        for _ in range(4 * (len(ck["lanes"][str(lane)]["pending"]) + 1)):  # it steps once its undelivered outputs are taken
            next(it)
    it.close()
    with pytest.MonkeyPatch.context() as mp:  # rebuilt at restore: the same error, there
        mp.setattr(zephon_lanes, "DEFERRED_RESTORE", False)
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


def test_a_malformed_operator_state_of_a_waiting_lane_is_refused_at_restore():
    ck, _ = _running(4, steps=6)  # lane 2 is due first
    state = json.loads(json.dumps(ck["lanes"]["0"]))
    state["ops"]["shuffle"]["draws"] = "three"
    bad = {**ck, "lanes": {**ck["lanes"], "0": seal(0, state)}}
    message = r"lane 0: field 'ops': .*operator 'shuffle'.*draws"
    with pytest.raises(ValueError, match=message):
        iter(_pipe(4).restore(bad))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zephon_lanes, "DEFERRED_RESTORE", False)
        with pytest.raises(ValueError, match=message):
            iter(_pipe(4)).restore(bad)


def test_a_lane_whose_data_ended_rebuilds_one_piece_of_its_buffer_for_its_next_output():
    """Restored between pieces of its flush, a lane rebuilds one piece of its buffer, not all of it."""

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
    plan = pipe().plan
    state = plan.decode_lanes({0: lane})[0]
    held = len(_held(state))
    state, first = plan.next(0, state)
    assert held - len(_held(state)) <= FLUSH_PIECE < held  # one piece rebuilt, the rest still references
    rest = [first]
    while True:
        state, out = plan.next(0, state)
        if out is None:
            break
        rest.append(out)
    assert outputs_equal(rest, stream[delivered + 1 :])


def _large_shuffle_state():
    op = Shuffle(64, seed=2)
    chunk = docs([3] * 100)
    state, _ = op.step(op.init(0), chunk)
    assert len(state.buffer) >= 32
    return op, json.loads(json.dumps(op.encode_state(state))), input_resolver([chunk])


def _edited(edit):
    def apply(data):
        data = json.loads(json.dumps(data))
        edit(data)
        return data

    return apply


SHUFFLE_EDITS = {
    "draws": _edited(lambda d: d.update(draws=d["draws"] + 1)),
    "negative": _edited(lambda d: d.update(draws=-1, emitted=-1)),
    "too many": _edited(lambda d: d["buffer"].extend(d["buffer"][:40])),
    "bool in a reference": _edited(lambda d: d["buffer"][3].__setitem__(4, True)),
    "short reference": _edited(lambda d: d["buffer"][5].pop()),
    "float in a reference": _edited(lambda d: d["buffer"][0].__setitem__(2, 1.5)),
    "unknown field": _edited(lambda d: d.update(extra=1)),
}


def test_decoding_a_large_shuffle_buffer_by_reference_rebuilds_no_record():
    op, data, resolve = _large_shuffle_state()
    state = op.decode_state(data, keep_references)
    assert all(rec.is_reference for rec in state.buffer)
    assert json.loads(json.dumps(op.encode_state(state))) == data
    assert op.decode_state(data, resolve) == op.decode_state(op.encode_state(op.decode_state(data, resolve)), resolve)


@pytest.mark.parametrize("edit", SHUFFLE_EDITS, ids=list(SHUFFLE_EDITS))
def test_decoding_by_reference_refuses_what_decoding_whole_refuses(edit):
    op, data, resolve = _large_shuffle_state()
    bad = SHUFFLE_EDITS[edit](data)
    with pytest.raises((ValueError, TypeError, msgspec.ValidationError)) as whole:
        op.decode_state(bad, resolve)
    with pytest.raises(type(whole.value)) as deferred:
        op.decode_state(bad, keep_references)
    assert str(deferred.value) == str(whole.value)


def test_a_reference_equals_only_a_reference_with_its_meta():
    meta = Meta(0, (Segment(0, 0, 3, 0, 0, -1),))
    assert Record({"x": 1}, meta) != keep_references([meta])[0]
    assert keep_references([meta]) == keep_references([meta])


def test_a_nested_chain_restores_deferred_like_the_rest():
    from _util import toks_to_ids
    from zephon import Pipeline
    from zephon.core.operator import Chain
    from zephon.work import StaticMixtureWorkSource

    def pipe():
        src = StaticMixtureWorkSource([toy_dataset(120)], {"web": 1.0}, chunk_size=8, exhausted_policy="stop")
        nested = Chain((("inner", Shuffle(4, seed=1)),))
        return Pipeline(src).options(canonical_replicas=2).map(toks_to_ids).pack_flat(16).add(nested, name="nested").batch(2)

    alone = list(pipe())
    it = iter(pipe())
    for _ in range(5):
        next(it)
    ck = json.loads(json.dumps(it.checkpoint()))
    it.close()
    assert outputs_equal(list(pipe().restore(ck)), alone[5:])
