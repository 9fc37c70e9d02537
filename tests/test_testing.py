"""zephon.testing: ``check_operator`` and ``records_from`` check a user's own stateful operator.

``WindowSort`` below is what a user writes: a frozen attrs config, a tagged msgspec state, and
``init``/``step``/``flush``; nothing else (no state type, no encoding, no rebuild). It passes every
check, runs in a pipeline with worker processes, and restores from a checkpoint.
"""

from __future__ import annotations

import json
from typing import ClassVar

import attrs
import msgspec
import pytest

from _util import toks_to_ids, toy_dataset
from zephon import Pipeline
from zephon.core.operator import Operator, config_field
from zephon.testing import check_operator, outputs_equal, records_from
from zephon.types import Record
from zephon.work import StaticMixtureWorkSource


class WindowState(msgspec.Struct, frozen=True, tag="window_sort", forbid_unknown_fields=True):
    held: tuple[Record, ...] = ()


@attrs.frozen
class WindowSort(Operator):
    """Emits each ``window`` records shortest first (ties in arrival order); the rest at the end."""

    window: int = config_field(default=4)
    kind: ClassVar[str] = "window_sort"

    def init(self, key: int) -> WindowState:
        return WindowState()

    def step(self, state: WindowState, chunk) -> tuple[WindowState, list]:
        held, out = state.held + tuple(chunk), []
        while len(held) >= self.window:
            out += _shortest_first(held[: self.window])
            held = held[self.window :]
        return WindowState(held), out

    def flush(self, state: WindowState) -> tuple[WindowState, list]:
        return (WindowState(), _shortest_first(state.held)) if state.held else (state, [])


def _shortest_first(records) -> list:
    return sorted(records, key=lambda r: len(r.payload["input_ids"]))


@attrs.frozen
class FlushNeverEnds(WindowSort):
    """A broken operator: its flush hands out what it holds and keeps it."""

    def flush(self, state: WindowState) -> tuple[WindowState, list]:
        return state, list(state.held)


@attrs.frozen
class KeepsCountOutside(WindowSort):
    """A broken operator: its output depends on how the input was chunked."""

    def step(self, state: WindowState, chunk) -> tuple[WindowState, list]:
        return state, list(chunk)[::-1]


def _payloads(n=11):
    return [{"input_ids": list(range((7 * i) % 5 + 1))} for i in range(n)]


def test_records_from_gives_distinct_source_records():
    recs = records_from([{"a": 1}, {"a": 2}], lane=1, dataset=2, shard=3)
    assert [r.payload for r in recs] == [{"a": 1}, {"a": 2}]
    assert [(r.meta.lane, *r.meta.segments[0].pointer) for r in recs] == [(1, 2, 3, 0), (1, 2, 3, 1)]


def test_a_user_written_stateful_operator_passes_check_operator():
    check_operator(WindowSort(4), records_from(_payloads()))
    check_operator(WindowSort(1), records_from(_payloads(3)), chunk_size=1)


def test_check_operator_refuses_a_flush_that_never_ends():
    with pytest.raises(AssertionError, match="window_sort: flush returned outputs and the state it was given"):
        check_operator(FlushNeverEnds(4), records_from(_payloads()))


def test_check_operator_refuses_an_operator_that_depends_on_chunking():
    with pytest.raises(AssertionError, match=r"window_sort: chunking at \[1, 2"):
        check_operator(KeepsCountOutside(4), records_from(_payloads()))


def _pipeline(workers=0):
    src = StaticMixtureWorkSource([toy_dataset(120)], {"web": 1.0}, chunk_size=8, exhausted_policy="stop")
    return (
        Pipeline(src)
        .options(canonical_replicas=2, workers=workers)
        .map(toks_to_ids)
        .add(WindowSort(3))
        .batch(2)
    )


def test_a_user_written_operator_runs_with_workers_and_restores():
    alone = list(_pipeline())
    assert len(alone) > 10
    assert outputs_equal(list(_pipeline(workers=2)), alone)
    it = iter(_pipeline(workers=2))
    for _ in range(5):
        next(it)
    ck = json.loads(json.dumps(it.checkpoint()))
    it.close()
    assert ck["lanes"]["0"]["ops"]["window_sort"]["type"] == "window_sort"  # by reference, generically encoded
    assert outputs_equal(list(_pipeline(workers=2).restore(ck)), alone[5:])
