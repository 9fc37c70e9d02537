"""Lanes: independent, pure per-lane streams, and their checkpoint encoding.

A :class:`Plan` is everything that decides a lane's output (the work source, the operator chain,
the lane count) plus read settings that do not. ``lane_next(plan, lane, state)`` returns the lane's
next output and the state *after* it, so any process can run any lane and a checkpoint is just
the per-lane states of what the caller has received.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import attrs
import msgspec

from ._core import Chain, ChainState, Resolver
from ._keys import fold_in, seed_key
from ._records import Meta, Record, Segment, meta_from_ints
from .work._source import SourceState, StaticMixtureWorkSource


class LaneState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One lane: source cursor, operator states, outputs produced but not yet delivered."""

    source: SourceState
    chain: ChainState
    pending: tuple = ()
    delivered: int = 0
    done: bool = False


@attrs.frozen(eq=False)
class Plan:
    """The compiled, picklable description of a pipeline's lanes."""

    source: StaticMixtureWorkSource
    chain: Chain
    lanes: int
    read_size: int = 64

    # -- reading ----------------------------------------------------------------------------------------
    def fetch(self, lane: int, pointers: Sequence[tuple[int, int, int]]) -> list[Record]:
        """Read the payloads of ``pointers`` (in order) as fresh sample-level records."""
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (d, s, _) in enumerate(pointers):
            groups[(d, s)].append(i)
        payloads: list[Any] = [None] * len(pointers)
        for (d, s), idx in groups.items():
            rows = [pointers[i][2] for i in idx]
            for i, p in zip(idx, self.source.datasets[d].read(s, rows)):
                payloads[i] = p
        return [Record(p, Meta(lane, (Segment(d, s, r, 0, 0, -1),), 0)) for p, (d, s, r) in zip(payloads, pointers)]

    def resolve_source(self, metas: Sequence[Meta]) -> list[Record]:
        """Rebuild sample-level records from their metas (the chain's input resolver)."""
        by_lane: dict[int, list[int]] = defaultdict(list)
        for i, m in enumerate(metas):
            if len(m.segments) != 1 or m.segments[0].child != 0 or m.segments[0].end != -1:
                raise ValueError(f"not a source sample reference: {m!r}")
            by_lane[m.lane].append(i)
        out: list[Any] = [None] * len(metas)
        for lane, idx in by_lane.items():
            for i, rec in zip(idx, self.fetch(lane, [metas[i].segments[0].pointer for i in idx])):
                out[i] = rec
        return out

    # -- lanes ------------------------------------------------------------------------------------------
    def lane_key(self, lane: int) -> int:
        return fold_in(seed_key(0), "lane", lane)

    def init(self, lane: int) -> LaneState:
        self._check_lane(lane)
        return LaneState(SourceState(), self.chain.init(self.lane_key(lane)))

    def next(self, lane: int, state: LaneState) -> tuple[LaneState, Any]:
        """The lane's next output and the state after it; ``(state, None)`` when it has ended."""
        source, chain, pending, done = state.source, state.chain, state.pending, state.done
        # Small reads until the lane's first output, so it arrives early (read sizes never change
        # the data: every operator is chunking-invariant).
        size = self.read_size if state.delivered else min(self.read_size, 16)
        while not pending and not done:
            source, pointers, exhausted = self.source.read(source, self.lanes, lane, size)
            chain, outs = self.chain.step(chain, self.fetch(lane, pointers))
            if exhausted:
                chain, more = self.chain.flush(chain)
                outs = outs + more
                done = True
            pending = tuple(outs)
        if not pending:
            return LaneState(source, chain, (), state.delivered, True), None
        return LaneState(source, chain, pending[1:], state.delivered + 1, done), pending[0]

    def reports(self, state: LaneState) -> dict[str, dict[str, int]]:
        """Each operator's counters (drops, rows, ...) for one lane state."""
        return self.chain.reports(state.chain)

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} outside [0, {self.lanes}) (canonical_replicas={self.lanes})")

    # -- checkpoints ------------------------------------------------------------------------------------
    def encode(self, state: LaneState) -> dict[str, Any]:
        from ._core import _enc_hook

        return {
            "source": [state.source.chunk, state.source.offset],
            "ops": self.chain.encode_state(state.chain),
            "pending": msgspec.to_builtins(list(state.pending), enc_hook=_enc_hook),
            "delivered": state.delivered,
            "done": state.done,
        }

    def unread(self, encoded: dict[str, Any], outputs: Any) -> dict[str, Any]:
        """An encoded lane state as it was before its last ``outputs`` (in order) were taken.

        The outputs go back to the front of ``pending``, by reference, so a checkpoint can leave
        out outputs that were computed and taken from the lane but never delivered.
        """
        from ._core import _enc_hook

        refs = msgspec.to_builtins(list(outputs), enc_hook=_enc_hook)
        return {**encoded, "pending": refs + list(encoded["pending"]), "delivered": encoded["delivered"] - len(refs)}

    def decode(self, lane: int, data: Any) -> LaneState:
        self._check_lane(lane)
        if not isinstance(data, dict):
            raise ValueError(f"lane {lane}: state must be a mapping, got {type(data).__name__}")
        expected = {"source", "ops", "pending", "delivered", "done"}
        if set(data) != expected:
            raise ValueError(
                f"lane {lane}: state fields {sorted(data)} do not match {sorted(expected)} "
                f"(missing {sorted(expected - set(data))}, unknown {sorted(set(data) - expected)})"
            )
        chunk, offset = data["source"]
        resolver: Resolver = self.resolve_source
        chain = self.chain.decode_state(data["ops"], resolver)
        refs = [_decode_ref(r) for r in data["pending"]]
        pending = tuple(self.chain.rebuild(refs, resolver)) if refs else ()
        return LaneState(SourceState(int(chunk), int(offset)), chain, pending, int(data["delivered"]), bool(data["done"]))

    def fingerprint(self) -> dict[str, Any]:
        return {"source": self.source.fingerprint(), "operators": self.chain.fingerprint()["children"], "lanes": self.lanes}


def _decode_ref(ref: Any) -> Any:
    """A pending output's reference: a flat meta ``[lane, padding, ...]``, or a batch (list of metas)."""
    if isinstance(ref, (list, tuple)) and (not ref or not isinstance(ref[0], int)):
        return [meta_from_ints(m) for m in ref]
    return meta_from_ints(ref)
