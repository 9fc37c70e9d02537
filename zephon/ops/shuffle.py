"""A per-lane streaming shuffle buffer, deterministic and restorable.

The buffer fills to a warm-up window ``w = max(1, min(128, buffer_size // 16))``; then each
arrival past ``min(buffer_size, w + emitted)`` evicts the record of the ``draws``-th
counter-based draw of the key (swap-pop), so outputs come early and the window grows to
``buffer_size``. ``flush`` drains the rest in draw order, a piece per call. The output is a
permutation of the input, independent of chunking. Under a mixture schedule the first record at
or after a switch (``drains``: lane sample positions, counted in sample starts) first empties the
buffer, so the phases' shares never mix.
"""

from __future__ import annotations

import bisect
from typing import Any, ClassVar, Sequence

import attrs
import msgspec

from ..core.operator import Operator, Resolver, config_field, nonnegative, positive_int
from ..core.keys import fold_in, randbelow
from ..core.records import Record
from ..core.state import decode, resolve


#: Records a flush hands out per call (see :meth:`Shuffle.flush`): one output's worth for a typical batch.
FLUSH_PIECE = 8


class ShuffleState(msgspec.Struct, frozen=True, tag="shuffle", forbid_unknown_fields=True):
    """The buffered records (by reference), the draw counter and the number emitted; with
    ``drains``, the sample starts seen and the schedule phase of the buffered records."""

    key: int
    buffer: tuple[Record, ...] = ()
    draws: int = 0
    emitted: int = 0
    samples: int = 0
    phase: int = 0


def drain_positions(value: Any) -> tuple[int, ...]:
    """The converter of a ``drains`` setting (shuffle, order_by): increasing lane sample positions >= 1."""
    out = tuple(int(d) for d in value)
    if any(d < 1 for d in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"drains are increasing lane sample positions >= 1, got {list(out)}")
    return out


def next_phase(
    drains: tuple[int, ...], samples: int, phase: int, rec: Record
) -> tuple[bool, int, int]:
    """Advance the lane clock past ``rec``: whether it opens a new phase, and the new
    ``(samples, phase)``. A record's clock is the samples whose first token it holds."""
    starts = sum(1 for seg in rec.meta.segments if seg.start == 0 and seg.child == 0)
    if not starts:
        return False, samples, phase
    at = bisect.bisect_right(drains, samples)
    return at != phase, samples + starts, at


def _draw(buffer: list[Record], key: int, draws: int) -> Record:
    """Take the ``draws``-th draw of ``key`` out of ``buffer`` (swap-pop: the last record fills its place)."""
    i = randbelow(key, draws, len(buffer))
    rec = buffer[i]
    buffer[i] = buffer[-1]
    buffer.pop()
    return rec


def _int(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"shuffle: seed must be an int, got {value!r}")


@attrs.frozen
class Shuffle(Operator):
    """Shuffle each lane's records through a buffer of ``buffer_size``.

    Args:
        buffer_size: records held at most; larger mixes better and costs memory.
        seed: the shuffle's seed; the key is ``fold_in(lane key, "shuffle", seed)``.
        drains: the lane's sample positions of the source schedule's switches, where the buffer
            is emptied (see the module docstring); filled in by the pipeline.

    State: the buffer by reference, two counters and the key (with ``drains``, two more: the
    sample starts seen and the buffered records' phase). It reads only the metas of the records
    it holds (``reads_held_payloads = False``), so a restore may leave its buffer as references:
    the runtime rebuilds each record as it is drawn (the outputs are the same).

    Examples:
        >>> op = Shuffle(4, seed=1)
        >>> op.warmup
        1
    """

    buffer_size: int = config_field(validator=positive_int)
    seed: int = config_field(default=0, validator=_int)
    drains: tuple[int, ...] = config_field(
        default=(), converter=drain_positions, kw_only=True, omit_default=True
    )

    kind: ClassVar[str] = "shuffle"
    state_type: ClassVar[type] = ShuffleState
    reads_held_payloads: ClassVar[bool] = False

    @property
    def warmup(self) -> int:
        return 0 if self.buffer_size == 1 else max(1, min(128, self.buffer_size // 16))

    def init(self, key: int) -> ShuffleState:
        return ShuffleState(key=fold_in(key, self.seed))

    def step(self, state: ShuffleState, chunk: Sequence[Record]) -> tuple[ShuffleState, list[Record]]:
        buffer, out = list(state.buffer), []
        key, size, warmup, drains = state.key, self.buffer_size, self.warmup, self.drains
        draws, emitted, samples, phase = state.draws, state.emitted, state.samples, state.phase
        for rec in chunk:
            if drains:
                switched, samples, phase = next_phase(drains, samples, phase, rec)
                while switched and buffer:  # a new phase's first record: empty the buffer first
                    out.append(_draw(buffer, key, draws))
                    draws, emitted = draws + 1, emitted + 1
            buffer.append(rec)
            if len(buffer) > min(size, warmup + emitted) or size == 1:
                out.append(_draw(buffer, key, draws))
                draws, emitted = draws + 1, emitted + 1
        return ShuffleState(key, tuple(buffer), draws, emitted, samples, phase), out

    def flush(self, state: ShuffleState) -> tuple[ShuffleState, list[Record]]:
        """The next ``FLUSH_PIECE`` records in draw order; the rest stays buffered for the next call.

        A piece at a time, so that a lane whose data ends right after a restore rebuilds one
        piece for its next output, not its whole buffer. Pieces concatenate to the whole flush,
        so the stream is the same; a checkpoint taken between pieces holds the rest.
        """
        buffer, n = list(state.buffer), min(FLUSH_PIECE, len(state.buffer))
        out = [_draw(buffer, state.key, d) for d in range(state.draws, state.draws + n)]
        changes = {"buffer": tuple(buffer), "draws": state.draws + n, "emitted": state.emitted + n}
        return msgspec.structs.replace(state, **changes), out

    def report(self, state: ShuffleState) -> dict[str, int]:
        return {"buffered": len(state.buffer), "emitted": state.emitted}

    def decode_state(self, data: Any, upstream: Resolver) -> ShuffleState:
        """Inverse of ``encode_state``, refusing, before any record is rebuilt, what ``step`` never
        leaves: every record leaves the buffer through one draw, so ``draws == emitted``; after
        ``emitted`` outputs at most ``min(buffer_size, warmup + emitted)`` records wait (none when
        ``buffer_size`` is 1)."""
        state = decode(data, ShuffleState)
        nonnegative(state, ("draws", "emitted"))
        buffered, draws, emitted = len(state.buffer), state.draws, state.emitted
        if draws != emitted:
            raise ValueError(f"fields 'draws' ({draws}) and 'emitted' ({emitted}) must be equal: each output is one draw")
        limit = 0 if self.buffer_size == 1 else min(self.buffer_size, self.warmup + emitted)
        if buffered > limit:
            raise ValueError(
                f"field 'buffer' holds {buffered} records, but after {emitted} outputs a shuffle of "
                f"buffer_size={self.buffer_size} holds at most {limit}"
            )
        return resolve(state, upstream)
