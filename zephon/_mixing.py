"""``ensure_mixture``: per-lane exact token accounting of a mixture (Zephon's operator, done by deficit).

Each lane reorders its records so that the tokens it has emitted track the target mixture: the
next record comes from the dataset most owed (the smallest ``(emitted_j + next_j / 2) / W_j`` for
integer target weights ``W`` and ``next_j`` the weight of its next waiting record, ties to the
earlier dataset), taken from a per-dataset queue in arrival order. When
that dataset has nothing waiting, records wait in a bounded buffer; when the buffer is full, the
most owed dataset that *has* a record waiting goes next (a forced emission, counted). The end of the
lane's data emits the buffer in the same order: nothing is discarded, ever.

Because it runs per lane on the lane's own stream, which is a pure function of the lane, the output
is identical for every number of ranks. State: one integer per dataset (tokens, or the weight
``weight_by`` gives, emitted) plus the buffer, held by reference, and two counters.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar, Sequence

import attrs
import msgspec

from ._core import Operator, Resolver, _dec_hook, config_field, resolve_tree
from ._fields import payload_length
from ._records import Record
from .work._mixture import check_names, integer_weights, normalize


class EnsureMixtureState(msgspec.Struct, frozen=True, tag="ensure_mixture", forbid_unknown_fields=True):
    """Weight emitted per dataset, the waiting records (arrival order, by reference), emissions, forced ones."""

    emitted: tuple[int, ...]
    buffer: tuple[Record, ...] = ()
    outputs: int = 0
    forced: int = 0
    since_drain: int = 0  # on-target emissions since the last obsolete drain


def _weight_by(instance: Any, attribute: Any, value: Any) -> None:
    if not (callable(value) or isinstance(value, str)):
        raise ValueError(f"ensure_mixture: weight_by must be 'auto', 'samples', a field name or a callable, got {value!r}")


def _buffer_size(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ensure_mixture: max_buffer_size must be an int >= 1, got {value!r}")


def _ratio(low_open: bool):
    def check(instance: Any, attribute: Any, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 < value < 1 if low_open else 0 <= value <= 1)
        if not ok:
            span = "in (0, 1)" if low_open else "in [0, 1]"
            raise ValueError(f"ensure_mixture: {attribute.name} must be a number {span}, got {value!r}")

    return check


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value)


def _mixture(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    weights = getattr(value, "weights", value)
    return normalize(weights, zero_ok=True)


@attrs.frozen
class EnsureMixture(Operator):
    """Reorder each lane's records so that the tokens emitted per dataset follow ``mixture`` exactly.

    Place it after ``tokenize`` and before packing (``Pipeline.ensure_mixture`` fills in the
    datasets and, by default, the source's mixture).

    Args:
        mixture: target ``{dataset name: weight}`` (weights >= 0).
        datasets: the source's dataset names, in order (a record names its dataset by index).
        max_buffer_size: records a lane holds at most while it waits for the most owed dataset.
        weight_by: ``"auto"`` (tokens: the length of ``input_ids``/``tokens``/...), ``"samples"``
            (1 per record), a payload field (its number, or its length), or a function of the
            payload.
        drain_target_ratio: when the buffer overflows, forced emissions bring it down to
            ``drain_target_ratio * max_buffer_size`` records (Zephon's option; default 0.8).
        obsolete_drain_rate: after every ``int(1 / rate)`` on-target emissions, the oldest
            waiting record goes next, so no record waits without bound (Zephon's option; 0, the
            default here, turns it off: the buffer bound already limits waiting).

    State: emitted weight per dataset, the buffer (by reference), outputs and forced outputs.
    Restores and reshards like every lane state; ``report()`` gives ``buffered``, ``outputs``
    and ``forced`` (emissions off target because the buffer was full).

    Examples:
        >>> op = EnsureMixture({"web": 1, "books": 1}, datasets=("web", "books"))
        >>> op.target
        (1, 1)
    """

    mixture: dict[str, float] = config_field(converter=_mixture)
    datasets: tuple[str, ...] = config_field(converter=_names, kw_only=True)
    max_buffer_size: int = config_field(default=1000, validator=_buffer_size, kw_only=True)
    weight_by: Any = config_field(default="auto", validator=_weight_by, kw_only=True)
    drain_target_ratio: float = config_field(default=0.8, validator=_ratio(True), kw_only=True)
    obsolete_drain_rate: float = config_field(default=0.0, validator=_ratio(False), kw_only=True)

    kind: ClassVar[str] = "ensure_mixture"
    state_type: ClassVar[type] = EnsureMixtureState

    def __attrs_post_init__(self) -> None:
        if self.mixture is None:
            raise ValueError("ensure_mixture: give the target mixture {name: weight} (Pipeline.ensure_mixture() uses the source's)")
        check_names(self.mixture, self.datasets, "ensure_mixture's mixture")

    @property
    def target(self) -> tuple[int, ...]:
        return integer_weights([self.mixture[n] for n in self.datasets])

    def init(self, key: int) -> EnsureMixtureState:
        return EnsureMixtureState(tuple(0 for _ in self.datasets))

    def _weight(self, rec: Record) -> int:
        by, p = self.weight_by, rec.payload
        try:
            if by == "samples":
                return 1
            if by == "auto":
                return payload_length(p, "ensure_mixture")
            value = by(p) if callable(by) else p[by]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"ensure_mixture: cannot weigh a record ({exc}); with weight_by={by!r} place it after tokenize "
                "(weight_by='auto' counts tokens), or use weight_by='samples'"
            ) from None
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else len(value)

    def _dataset(self, rec: Record) -> int:
        segs = rec.meta.segments
        d = segs[0].dataset
        if any(s.dataset != d for s in segs[1:]):
            raise ValueError("ensure_mixture: a record holds several datasets' samples; place ensure_mixture before packing")
        if not 0 <= d < len(self.datasets):
            raise ValueError(f"ensure_mixture: a record of dataset {d}, but the operator knows {len(self.datasets)} datasets")
        return d

    def _run(self, state: EnsureMixtureState, chunk: Sequence[Record], flushing: bool) -> tuple[EnsureMixtureState, list[Record]]:
        W = self.target
        n = len(W)
        emitted = list(state.emitted)
        queues: list[deque] = [deque() for _ in range(n)]
        seq = 0
        for rec in state.buffer:
            queues[self._dataset(rec)].append((seq, rec))
            seq += 1
        held = len(state.buffer)
        outputs, forced = state.outputs, state.forced
        out: list[Record] = []
        live = [j for j in range(n) if W[j] > 0]

        def most_owed(among: list[int]) -> int:
            # Compare at the middle of each dataset's next record (2E + w): the emitted weight then
            # stays within half a record of its target either way (a dataset with nothing waiting
            # counts its next record as empty, so it looks most owed and is waited for).
            mid = [2 * emitted[j] + (self._weight(queues[j][0][1]) if queues[j] else 0) for j in range(n)]
            best = among[0]
            for j in among[1:]:
                if mid[j] * W[best] < mid[best] * W[j]:
                    best = j
            return best

        every = int(1 / self.obsolete_drain_rate) if self.obsolete_drain_rate else 0
        low = int(self.drain_target_ratio * self.max_buffer_size)
        since = state.since_drain

        def emit(j: int) -> None:
            nonlocal held, outputs
            _, rec = queues[j].popleft()
            held -= 1
            emitted[j] += self._weight(rec)
            outputs += 1
            out.append(rec)

        def drain(final: bool) -> None:
            nonlocal forced, since
            overflow = False
            while held:
                if every and since >= every:  # the oldest waiting record goes, then on target again
                    emit(min((k for k in range(n) if queues[k]), key=lambda k: queues[k][0][0]))
                    since = 0
                    forced += 1
                    continue
                j = most_owed(live) if live else -1
                if j >= 0 and queues[j]:
                    emit(j)
                    since += 1
                    continue
                overflow = overflow or held > self.max_buffer_size
                if not (final or (overflow and held > low)):
                    return
                waiting = [k for k in live if queues[k]]
                if waiting:
                    j = most_owed(waiting)
                else:  # only datasets without target weight wait: the oldest record goes
                    j = min((k for k in range(n) if queues[k]), key=lambda k: queues[k][0][0])
                emit(j)
                forced += not final

        for rec in chunk:
            queues[self._dataset(rec)].append((seq, rec))
            seq += 1
            held += 1
            drain(False)
        if flushing:
            drain(True)
        rest = sorted((item for q in queues for item in q), key=lambda item: item[0])
        return EnsureMixtureState(tuple(emitted), tuple(r for _, r in rest), outputs, forced, since), out

    def step(self, state: EnsureMixtureState, chunk: Sequence[Record]) -> tuple[EnsureMixtureState, list[Record]]:
        return self._run(state, chunk, False)

    def flush(self, state: EnsureMixtureState) -> tuple[EnsureMixtureState, list[Record]]:
        return self._run(state, (), True)

    def report(self, state: EnsureMixtureState) -> dict[str, int]:
        return {"buffered": len(state.buffer), "outputs": state.outputs, "forced": state.forced}

    def decode_state(self, data: Any, upstream: Resolver) -> EnsureMixtureState:
        """Inverse of ``encode_state``, refusing counters and buffers that ``step`` never leaves."""
        state = msgspec.convert(data, EnsureMixtureState, dec_hook=_dec_hook)
        if len(state.emitted) != len(self.datasets):
            raise ValueError(f"field 'emitted' holds {len(state.emitted)} counters, but the mixture has {len(self.datasets)} datasets")
        for name in ("outputs", "forced", "since_drain"):
            if getattr(state, name) < 0:
                raise ValueError(f"field {name!r} must be an int >= 0, got {getattr(state, name)}")
        if min(state.emitted, default=0) < 0:
            raise ValueError(f"field 'emitted' holds a negative counter: {list(state.emitted)}")
        if len(state.buffer) > self.max_buffer_size:
            raise ValueError(f"field 'buffer' holds {len(state.buffer)} records, more than max_buffer_size={self.max_buffer_size}")
        return resolve_tree(state, upstream)


def make_ensure_mixture(source: Any, mixture: Any = None, **kwargs: Any) -> EnsureMixture:
    """The operator for ``source``: its dataset names, and its mixture when ``mixture`` is not given."""
    from .work._mixture import MixtureSchedule

    if mixture is None:
        m = source.mixture
        if isinstance(m, MixtureSchedule) and len(m.points) > 1:
            raise ValueError(
                "ensure_mixture: the source follows a schedule, and ensure_mixture keeps one target; pass mixture= "
                "explicitly (the schedule's weights still decide what each lane reads)"
            )
        if source.unit != "tokens" and kwargs.get("weight_by", "auto") == "auto":
            raise ValueError(
                "ensure_mixture: the source's weights count samples and ensure_mixture balances tokens; mix by tokens "
                "(MixtureSpec(weights, unit='tokens'), so the supply is calibrated too), or pass mixture= with the "
                "token weights you want, or weight_by='samples'"
            )
        mixture = m.weights
    return EnsureMixture(mixture, datasets=source.names, **kwargs)

