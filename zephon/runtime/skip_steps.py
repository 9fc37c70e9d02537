"""Skipping global steps: the lanes run on as the uninterrupted run's, and the skipped outputs are dropped.

Skipping ``n`` global steps moves every lane ``n`` outputs on: its operators produce them as they
would, and they are dropped where produced (never rebuilt, counted in the mixture, sent or
converted), so what follows is the uninterrupted run's. A run's skips are kept as ``(first step,
count)`` pairs in every lane state of its checkpoints.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import msgspec

from .lanes import LaneState, Plan, caller_order


@attrs.frozen
class SkippedSteps:
    """What one :meth:`~zephon.runtime.loader.Loader.skip_steps` call skipped: global steps ``first``
    to ``first + count - 1``; ``ended_at``: the first missing step where finite data ended inside
    them (``None``: none)."""

    first: int
    count: int
    ended_at: int | None = None
    discarded: int = 0  # outputs read ahead for the skipped steps and dropped unseen
    seconds: float = 0.0
    keyframe: int | None = None  # the step of the keyframe the skip started from

    @property
    def last(self) -> int:
        """The last global step skipped (``first - 1`` when none was)."""
        return self.first + self.count - 1

    def __str__(self) -> str:
        if not self.count:
            return f"no steps skipped at step {self.first}"
        return f"steps {self.first}\u2013{self.last} skipped"


def check_count(n: Any) -> int:
    """``n`` if it is a step count (an int >= 0), else a ``ValueError`` naming it."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(
            f"skip_steps: n must be an int >= 0 (the number of global steps to skip), got {n!r} "
            f"({type(n).__name__})"
        )
    return n


def skip_lanes(plan: Plan, states: dict[int, LaneState], targets: Mapping[int, int], meter: Any = None,
               ahead: Any = None) -> set[int]:
    """Advance ``states`` in place until each lane has ``targets[lane]`` outputs behind it,
    round-robin in the caller's order (reading ahead serves several lanes at once). Returns the
    lanes whose data ended first."""
    order = caller_order({lane: states[lane].delivered for lane in targets})
    live = [lane for lane in order if states[lane].delivered < targets[lane]]
    ended: set[int] = set()
    while live:
        for lane in list(live):
            state = plan.produce(lane, states[lane], meter, ahead)
            k = min(targets[lane] - state.delivered, len(state.pending))
            states[lane] = msgspec.structs.replace(state, pending=state.pending[k:], delivered=state.delivered + k)
            if not k:
                ended.add(lane)
            if not k or states[lane].delivered >= targets[lane]:
                live.remove(lane)
    return ended


def without_counts(state: LaneState, ahead: LaneState, base: LaneState, datasets: int) -> LaneState:
    """``state`` with the mixture counts of the outputs between ``base`` and ``ahead`` (run ahead,
    then skipped) taken off: a skipped output is never counted."""
    delta = [a - b for a, b in zip(ahead.mixture or [0] * (2 * datasets), base.mixture or [0] * (2 * datasets))]
    if not any(delta):
        return state
    counts = state.mixture or (0,) * (2 * datasets)
    return msgspec.structs.replace(state, mixture=tuple(c - d for c, d in zip(counts, delta)))


def skips_of(encoded: Mapping[int, Any]) -> tuple[tuple[int, int], ...]:
    """The skips recorded in restored lane states (ValueError if lanes record different ones)."""
    found = {lane: tuple((int(a), int(b)) for a, b in data.get("skipped_steps", ())) for lane, data in encoded.items()}
    kinds = set(found.values())
    if len(kinds) > 1:
        shown = "; ".join(f"lane {lane}: {list(s)}" for lane, s in sorted(found.items()))
        raise ValueError(
            f"the lane states record different skipped steps ({shown}): every rank must skip the same global steps; "
            "restore checkpoints taken by the ranks of one run at one step"
        )
    return kinds.pop() if kinds else ()


def merged_ranges(skips: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(first, last)`` step ranges covered by ``(first, count)`` skips, overlapping or touching ones joined."""
    out: list[list[int]] = []
    for first, count in sorted(skips):
        last = first + count - 1
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return [(a, b) for a, b in out]
