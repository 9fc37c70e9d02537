"""Changing the plan of a running job from a global step on, keeping every earlier step as it was.

The switch is at the source position after everything any lane read by step ``k`` under the old
plan (run on from a checkpoint). Later positions follow the new plan with every dataset continuing
its count, so no sample repeats or is skipped; the new source's fingerprint records the switch.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..runtime.checkpoint import build, select_lanes, validate
from ..sources.work_source import Change, make_source


def _read_end(source: Any, lanes: int, lane: int, chunk: int, offset: int) -> int:
    """One past the last position lane ``lane`` read, for its cursor ``(chunk, offset)``."""
    if offset:
        return source.lane_range(lanes, lane, chunk)[0] + offset
    for k in range(chunk - 1, -1, -1):
        rng = source.lane_range(lanes, lane, k)
        if rng is not None:
            return rng[1]
    return 0


def change_plan(pipeline: Any, new: Any, *, from_step: int, checkpoint: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """See :meth:`zephon.Pipeline.change_plan`."""
    if isinstance(from_step, bool) or not isinstance(from_step, int) or from_step < 0:
        raise ValueError(f"change_plan: from_step must be an int >= 0, got {from_step!r}")
    plan = pipeline.compile(checkpoint)
    validate(plan.fingerprint(), checkpoint)
    L = plan.lanes
    encoded = select_lanes(checkpoint, range(L))
    at = {lane: int(s["delivered"]) for lane, s in encoded.items()}
    if max(at.values()) > from_step:
        raise ValueError(
            f"change_plan: the checkpoint is at step {min(at.values())} (lanes delivered {sorted(set(at.values()))} outputs), "
            f"after from_step={from_step}; steps before {from_step} would differ. Use a checkpoint taken at or before step {from_step}"
        )
    old, new = plan.source, make_source(new)
    olds, news = [d.fingerprint() for d in old.datasets], [d.fingerprint() for d in new.datasets]
    if news[: len(olds)] != olds:
        raise ValueError(
            f"change_plan: the new plan's datasets must start with the old ones, unchanged and in order ({list(old.names)}); "
            f"got {list(new.names)}. New datasets go at the end"
        )
    for name in ("seed", "shuffle_shards", "shuffle_within_shard", "chunk_size", "lane_assignment"):
        if getattr(old, name) != getattr(new, name):
            raise ValueError(f"change_plan: {name} must stay {getattr(old, name)!r} (got {getattr(new, name)!r}); it decides the order of data already read")
    if len(new.datasets) > len(old.datasets) and any(op.kind == "ensure_mixture" for _, op in plan.chain.children):
        raise ValueError(
            "change_plan: the pipeline's ensure_mixture step knows the old datasets only; a change that adds datasets needs "
            "a pipeline without it (its target is part of the processing, which change_plan keeps)"
        )
    ends = []
    walk = attrs.evolve(plan, read_size=1)  # read no further than the lanes need: the switch comes as early as it can
    for lane in range(L):
        state = walk.decode(lane, encoded[lane])
        while state.delivered < from_step:
            state, out = walk.next(lane, state)
            if out is None:
                raise ValueError(f"change_plan: the data ends before step {from_step} (lane {lane} ends after {state.delivered} outputs)")
        ends.append(_read_end(old, L, lane, state.source.chunk, state.source.offset))
    position = max(ends)
    if old.end is not None and position > (old.end // (L * old.chunk_size)) * L * old.chunk_size:
        raise ValueError(
            f"change_plan: step {from_step} lies in the last, partial block of work chunks of the old plan (position {position} "
            f"of {old.end}); change the plan earlier"
        )
    changed = attrs.evolve(new, change=Change(position, old.timeline, from_step, switches=old.switch_positions))
    result = attrs.evolve(pipeline, source=changed, resume_from=None)
    new_plan = result.compile()
    if new_plan.source.end is not None:
        block = L * new_plan.source.chunk_size
        if new_plan.source.end // block * block < position:
            raise ValueError(f"change_plan: the new plan ends at position {new_plan.source.end}, before the lanes' whole chunks up to {position}")
    lanes = {}
    n_new = len(new.datasets)
    for lane, state in encoded.items():
        counts = list(state["mixture"]) + [0] * (2 * n_new - len(state["mixture"]))
        lanes[lane] = {k: v for k, v in state.items() if k != "checksum"} | {"mixture": counts}
        new_plan.decode(lane, lanes[lane])  # every state still decodes under the new plan
    return result, build(new_plan.fingerprint(), lanes)
