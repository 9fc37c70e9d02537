"""Running lanes in the calling thread (``workers=0``): states are kept here, as values."""

from __future__ import annotations

from typing import Any

from .lanes import LaneState, Plan
from .skip_steps import skip_lanes


class InlineExecutor:
    """Runs lanes in the calling thread; states are kept as values."""

    def __init__(self, plan: Plan, states: dict[int, LaneState]):
        self.plan = plan
        self.states = dict(states)
        self.meter = plan.meter()
        self.ahead = plan.reader(self.states)

    def next(self, lane: int) -> Any:
        state, out = self.plan.next(lane, self.states[lane], self.meter, self.ahead)
        self.states[lane] = state
        return out

    def skip(self, targets: dict[int, int]) -> tuple[dict[int, int], int]:
        """Move each lane to ``targets[lane]`` outputs delivered (or its end), dropping the outputs
        between; returns the lanes' counts and the outputs read ahead and dropped (none)."""
        skip_lanes(self.plan, self.states, targets, self.meter, self.ahead)
        return {lane: self.states[lane].delivered for lane in targets}, 0

    def meters(self) -> dict[str, Any] | None:
        """The runtime counters of the work done so far."""
        return self.meter.snapshot()

    def lane_states(self) -> dict[int, Any]:
        return {lane: self.plan.encode(s) for lane, s in self.states.items()}

    def reports(self) -> dict[int, Any]:
        return {lane: self.plan.reports(s) for lane, s in self.states.items()}

    def close(self, read_final: bool = True) -> None:
        if self.ahead is not None:
            self.ahead.close()
