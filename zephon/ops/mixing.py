"""``ensure_mixture``: per-lane exact token accounting of a mixture, by deficit.

Each lane emits next the waiting record (per-dataset queues, arrival order) of the dataset most
owed: the smallest ``(emitted_j + next_j / 2) / W_j`` for integer target weights ``W``, ties to
the earlier dataset. When the bounded buffer overflows, the most owed dataset that has a record
waiting goes (a forced emission, counted); the end of data emits the buffer; nothing is dropped.
A schedule is followed phase by phase on the lane's emissions (:func:`place_targets`), the
emitted counters restarting at each phase, so the output is the same for every number of ranks.
"""

from __future__ import annotations

import bisect
import itertools
import warnings
from collections import deque
from typing import Any, ClassVar, Sequence

import attrs
import msgspec

from ..core.operator import Chain, Operator, Resolver, config_field, nonnegative, positive_int
from ..core.state import decode, resolve
from ..training.fields import payload_length
from ..core.records import Record
from ..sources.mixture import MixtureSchedule, check_names, integer_weights, normalize
from .order import OrderBy
from .shuffle import Shuffle


class EnsureMixtureState(msgspec.Struct, frozen=True, tag="ensure_mixture", forbid_unknown_fields=True):
    """Weight emitted per dataset in the current phase, the waiting records (arrival order, by reference), emissions, forced ones."""

    emitted: tuple[int, ...]
    buffer: tuple[Record, ...] = ()
    outputs: int = 0
    forced: int = 0
    since_drain: int = 0  # on-target emissions since the last obsolete drain


def _weight_by(instance: Any, attribute: Any, value: Any) -> None:
    if not (callable(value) or isinstance(value, str)):
        raise ValueError(f"ensure_mixture: weight_by must be 'auto', 'samples', a field name or a callable, got {value!r}")


def _ratio(low_open: bool):
    def check(instance: Any, attribute: Any, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 < value < 1 if low_open else 0 <= value <= 1)
        if not ok:
            span = "in (0, 1)" if low_open else "in [0, 1]"
            raise ValueError(f"ensure_mixture: {attribute.name} must be a number {span}, got {value!r}")

    return check


def _mixture(value: Any) -> dict[str, float] | MixtureSchedule | None:
    if value is None or isinstance(value, MixtureSchedule):
        return value
    return normalize(getattr(value, "weights", value), zero_ok=True)


def _phases(value: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    out = tuple((int(start), tuple(int(w) for w in ws)) for start, ws in value)
    starts = [p[0] for p in out]
    if out and (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))):
        raise ValueError(f"ensure_mixture: phases start at emission 0 and at increasing emissions, got {starts}")
    return out


@attrs.frozen
class EnsureMixture(Operator):
    """Reorder each lane's records so that the tokens emitted per dataset follow ``mixture`` exactly.

    Place it after ``tokenize`` and before packing (``Pipeline.ensure_mixture`` fills in the
    datasets and, by default, the source's mixture).

    Args:
        mixture: target ``{dataset name: weight}``, or a :class:`~zephon.work.MixtureSchedule`.
        datasets: the source's dataset names, in order (a record names its dataset by index).
        phases: ``((first emission, integer weights), ...)``: the lane's targets phase by phase
            (filled in by the pipeline for a schedule; empty: ``mixture`` throughout).
        max_buffer_size: records a lane holds at most while it waits for the most owed dataset.
        weight_by: ``"auto"`` (tokens), ``"samples"`` (1 per record), a payload field (its
            number, or its length), or a function of the payload.
        drain_target_ratio, obsolete_drain_rate: see ``docs/guide/mixing.md``.

    State: emitted weight per dataset in the current phase, the buffer (by reference), outputs
    (the lane's clock) and forced outputs. ``report()`` gives ``buffered``, ``outputs``, ``forced``.

    Examples:
        >>> op = EnsureMixture({"web": 1, "books": 1}, datasets=("web", "books"))
        >>> op.target
        (1, 1)
    """

    mixture: dict[str, float] = config_field(converter=_mixture)
    datasets: tuple[str, ...] = config_field(converter=tuple, kw_only=True)
    max_buffer_size: int = config_field(default=1000, validator=positive_int, kw_only=True)
    weight_by: Any = config_field(default="auto", validator=_weight_by, kw_only=True)
    drain_target_ratio: float = config_field(default=0.8, validator=_ratio(True), kw_only=True)
    obsolete_drain_rate: float = config_field(default=0.0, validator=_ratio(False), kw_only=True)
    phases: tuple[tuple[int, tuple[int, ...]], ...] = config_field(default=(), converter=_phases, kw_only=True)

    kind: ClassVar[str] = "ensure_mixture"
    state_type: ClassVar[type] = EnsureMixtureState

    def __attrs_post_init__(self) -> None:
        if self.mixture is None:
            raise ValueError("ensure_mixture: give the target mixture {name: weight} (Pipeline.ensure_mixture() uses the source's)")
        if isinstance(self.mixture, MixtureSchedule):
            self.mixture.validate_for(self.datasets)
        else:
            check_names(self.mixture, self.datasets, "ensure_mixture's mixture")
        bad = [ws for _, ws in self.phases if len(ws) != len(self.datasets) or min(ws) < 0 or not any(ws)]
        if bad:
            raise ValueError(f"ensure_mixture: every phase gives one weight >= 0 per dataset ({len(self.datasets)}), one > 0; got {bad[0]}")

    @property
    def target(self) -> tuple[int, ...]:
        """The integer target weights at the start (the first phase's)."""
        if self.phases:
            return self.phases[0][1]
        first = self.mixture.weights if isinstance(self.mixture, MixtureSchedule) else self.mixture
        return integer_weights([first[n] for n in self.datasets])

    def _timeline(self) -> tuple[list[int], list[tuple[int, ...]]]:
        """Phase starts (emissions) and integer targets."""
        if self.phases:
            return [p[0] for p in self.phases], [p[1] for p in self.phases]
        if isinstance(self.mixture, MixtureSchedule) and len(self.mixture.points) > 1:
            raise ValueError(
                "ensure_mixture: a schedule of targets is placed on the lanes' records when the pipeline compiles; add "
                "it with Pipeline.ensure_mixture(schedule), or give phases= explicitly"
            )
        return [0], [self.target]

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
        starts, targets = self._timeline()
        phase = bisect.bisect_right(starts, state.outputs) - 1
        W = targets[phase]
        n = len(W)
        emitted = list(state.emitted)
        queues: list[deque] = [deque() for _ in range(n)]
        seq = itertools.count()
        for rec in state.buffer:
            queues[self._dataset(rec)].append((next(seq), rec))
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

        def oldest() -> int:
            return min((k for k in range(n) if queues[k]), key=lambda k: queues[k][0][0])

        def emit(j: int) -> None:
            nonlocal held, outputs, phase, W, live
            _, rec = queues[j].popleft()
            held -= 1
            emitted[j] += self._weight(rec)
            outputs += 1
            out.append(rec)
            if phase + 1 < len(starts) and outputs >= starts[phase + 1]:
                # A new phase: its target counts from here (the phases before it are not corrected).
                phase = bisect.bisect_right(starts, outputs) - 1
                W = targets[phase]
                live = [k for k in range(n) if W[k] > 0]
                emitted[:] = [0] * n

        def drain(final: bool) -> None:
            nonlocal forced, since
            overflow = False
            while held:
                if every and since >= every:  # the oldest waiting record goes, then on target again
                    emit(oldest())
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
                # With only datasets without target weight waiting, the oldest record goes.
                emit(most_owed(waiting) if waiting else oldest())
                forced += not final

        for rec in chunk:
            queues[self._dataset(rec)].append((next(seq), rec))
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
        state = decode(data, EnsureMixtureState)
        if len(state.emitted) != len(self.datasets):
            raise ValueError(f"field 'emitted' holds {len(state.emitted)} counters, but the mixture has {len(self.datasets)} datasets")
        nonnegative(state, ("outputs", "forced", "since_drain"))
        if min(state.emitted, default=0) < 0:
            raise ValueError(f"field 'emitted' holds a negative counter: {list(state.emitted)}")
        if len(state.buffer) > self.max_buffer_size:
            raise ValueError(f"field 'buffer' holds {len(state.buffer)} records, more than max_buffer_size={self.max_buffer_size}")
        return resolve(state, upstream)


SAMPLE_SUPPLY_WARNING = (
    "ensure_mixture balances tokens, but the source's weights count samples, so what the lanes read is not "
    "calibrated to a token target: unless the datasets' documents are about as long, the buffer fills and records "
    "leave in forced (off-target) runs. Mix the source by tokens, StaticMixtureWorkSource(datasets, "
    "MixtureSpec(weights, unit='tokens')) (or a MixtureSchedule with unit='tokens'), and call ensure_mixture() "
    "without a mixture; or pass weight_by='samples' to balance samples"
)


def make_ensure_mixture(source: Any, mixture: Any = None, **kwargs: Any) -> EnsureMixture:
    """The operator for ``source``: its dataset names, and its mixture (or schedule) when ``mixture`` is not given.

    Warns (:data:`SAMPLE_SUPPLY_WARNING`) for a token target over a source mixed by samples.
    """
    tokens = kwargs.get("weight_by", "auto") == "auto"
    if mixture is None:
        if source.unit != "tokens" and tokens:
            raise ValueError(
                "ensure_mixture: the source's weights count samples and ensure_mixture balances tokens; mix by tokens "
                "(MixtureSpec(weights, unit='tokens'), so the supply is calibrated too), or pass mixture= with the "
                "token weights you want, or weight_by='samples'"
            )
        mixture = source.mixture
        if not isinstance(mixture, MixtureSchedule) or len(mixture.points) == 1:
            mixture = mixture.weights
    elif tokens and source.unit != "tokens":
        warnings.warn(f"{SAMPLE_SUPPLY_WARNING}.", UserWarning, stacklevel=3)
    return EnsureMixture(mixture, datasets=source.names, **kwargs)


def lane_phases(source: Any, schedule: MixtureSchedule, lanes: int, names: Sequence[str]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``schedule``'s targets on one lane's emissions: ``((first emission, integer weights), ...)``.

    A piece the source places at position ``P`` (by its placement rules, or its own schedule's
    positions) starts at the lane's emission ``ceil(P / lanes)``: a lane reads every ``lanes``-th.
    """
    if schedule == source.mixture:
        placed = source
    else:
        try:
            placed = attrs.evolve(source, mixture=schedule, change=None)
            placed.piece_positions  # noqa: B018
        except ValueError as exc:
            raise ValueError(f"ensure_mixture: cannot place its schedule on the source: {exc}") from None
    out: list[tuple[int, tuple[int, ...]]] = []
    for pos, weights in placed.piece_positions:
        start = -(-pos // lanes)
        W = integer_weights([weights[n] for n in names])
        if out and out[-1][0] == start:
            out[-1] = (start, W)
        elif not out or out[-1][1] != W:
            out.append((start, W))
    return tuple(out)


def place_targets(chain: Any, source: Any, lanes: int) -> Any:
    """``chain`` with the source's schedule placed on the lanes: every ``ensure_mixture`` that
    follows a schedule gets its phases (see :func:`lane_phases`), and every ``shuffle`` and ``order_by``
    the lane positions of the source's weight jumps, where it empties its buffer (``Shuffle.drains``)."""
    positions = getattr(source, "switch_positions", ())
    switches = tuple(sorted({-(-pos // lanes) for pos in positions} - {0}))
    children, changed = [], False
    for name, op in chain.children:
        if isinstance(op, EnsureMixture) and isinstance(op.mixture, MixtureSchedule) and not op.phases:
            op = attrs.evolve(op, phases=lane_phases(source, op.mixture, lanes, op.datasets))
            changed = True
        elif isinstance(op, (Shuffle, OrderBy)) and switches and not op.drains:
            op = attrs.evolve(op, drains=switches)
            changed = True
        children.append((name, op))
    return Chain(tuple(children)) if changed else chain
