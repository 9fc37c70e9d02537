"""Mixture weights, schedules of weights, and the deterministic interleave of datasets over positions.

Weights become small integers ``W`` (exact for simple ratios, else multiples of 1/65536).
Component ``j``'s ``k``-th element gets the virtual time ``(2k + 1) / (2 W_j)``; one period of
``sum(W)`` elements sorted by (time, component) repeats: a smooth weighted round-robin with exact
long-run ratios and every prefix within one element of its target. A :class:`Timeline` chains
such interleaves as :class:`Phase` records, counts carried over; a schedule, a ``redistribute``
drop-out or a changed plan add phases (:func:`resolve_timeline`).
"""

from __future__ import annotations

import bisect
import functools
import math
from fractions import Fraction
from typing import Any, Literal, Mapping, Sequence

import attrs
import numpy as np

_QUANTUM = 1 << 16

#: Pieces a linear ramp between two schedule points is cut into (weights are constant on each).
RAMP_PIECES = 64


def _check_weight(name: Any, w: Any, *, zero_ok: bool) -> float:
    if not isinstance(name, str):
        raise TypeError(f"mixture keys are dataset names (str), got {name!r}")
    number = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
    if not number or not (w >= 0 if zero_ok else w > 0):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"mixture weight of {name!r} must be a finite number {bound}, got {w!r}")
    return float(w)


def normalize(weights: Mapping[str, float], *, zero_ok: bool = False) -> dict[str, float]:
    """``weights`` checked and scaled to sum to 1 (insertion order kept)."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"a mixture is a non-empty mapping of dataset name to weight, got {weights!r}")
    out = {name: _check_weight(name, w, zero_ok=zero_ok) for name, w in weights.items()}
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"mixture weights {dict(weights)} are all zero; give at least one dataset a weight > 0")
    return {k: v / total for k, v in out.items()}


def _convert_weights(weights: Any) -> dict[str, float]:
    return dict(weights.weights) if isinstance(weights, MixtureSpec) else normalize(weights)


def _check_unit(instance: Any, attribute: Any, value: Any) -> None:
    if value not in (None, "samples", "tokens"):
        raise ValueError(f"{type(instance).__name__}: unit must be 'samples' or 'tokens', got {value!r}")


@attrs.frozen
class MixtureSpec:
    """Relative weights of the datasets in a mixture, normalized to sum to 1 (insertion order kept).

    Args:
        weights: ``{dataset name: weight}``, every weight > 0.
        unit: what the weights count: ``"samples"``, or ``"tokens"`` (tokens per sample are
            calibrated, see :class:`~zephon.work.TokenEstimation`, so that each dataset's share of
            the *tokens* is its weight). ``None``: samples, or tokens with ``token_estimation``.

    Examples:
        >>> MixtureSpec({"web": 3, "code": 1}).weights
        {'web': 0.75, 'code': 0.25}
        >>> MixtureSpec({"web": 1, "books": 1}, unit="tokens").unit
        'tokens'
    """

    weights: dict[str, float] = attrs.field(converter=_convert_weights)
    unit: Literal["samples", "tokens"] | None = attrs.field(default=None, validator=_check_unit, kw_only=True)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def validate_for(self, names: tuple[str, ...]) -> None:
        check_names(self.weights, names)

    def integer_weights(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """Resolve the weights (in ``names`` order) to co-prime integers; see the module note."""
        return integer_weights([self.weights[n] for n in names])

    def describe(self) -> dict[str, Any]:
        return {"weights": dict(self.weights), "unit": self.unit}


def check_names(weights: Mapping[str, float], names: tuple[str, ...], where: str = "mixture") -> None:
    missing = [n for n in names if n not in weights]
    unknown = [n for n in weights if n not in names]
    if missing or unknown:
        raise ValueError(
            f"{where} does not match the datasets: datasets without a weight {missing}, "
            f"weights for unknown datasets {unknown}; give one weight per dataset name {list(names)}"
        )


def integer_weights(ws: Sequence[float]) -> tuple[int, ...]:
    """Non-negative weights as co-prime integers (zeros stay zero); see the module note."""
    ws = [float(w) for w in ws]
    total = sum(ws)
    ws = [w / total for w in ws]
    fracs = [Fraction(w).limit_denominator(1000) for w in ws]
    exact = all(abs(float(f) - w) <= 1e-12 * max(1.0, w) for f, w in zip(fracs, ws))
    lcm = math.lcm(*(f.denominator for f in fracs))
    if exact and lcm <= _QUANTUM:
        ints = [int(f * lcm) for f in fracs]
    else:
        raw = [w * _QUANTUM for w in ws]
        ints = [max(1, int(r)) if w > 0 else 0 for r, w in zip(raw, ws)]
        short = _QUANTUM - sum(ints)
        order = sorted((i for i in range(len(ws)) if ws[i] > 0), key=lambda i: (-(raw[i] - int(raw[i])), i))
        for i in order[: max(0, short)]:
            ints[i] += 1
    g = math.gcd(*ints)
    return tuple(i // g for i in ints)


def _convert_points(points: Any) -> tuple[tuple[float, dict[str, float]], ...]:
    if isinstance(points, Mapping):
        points = sorted(points.items())
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or not points:
        raise ValueError(f"MixtureSchedule: points is a non-empty list of (at, {{name: weight}}), got {points!r}")
    out = []
    for i, p in enumerate(points):
        if not (isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2):
            raise ValueError(f"MixtureSchedule: point {i} must be a pair (at, {{name: weight}}), got {p!r}")
        at, weights = p
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
            raise ValueError(f"MixtureSchedule: point {i}: 'at' must be a finite number >= 0, got {at!r}")
        try:
            w = normalize(weights, zero_ok=True)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"MixtureSchedule: point {i} (at {at}): {exc}") from None
        out.append((int(at) if float(at).is_integer() else float(at), w))
    if out[0][0] != 0:
        raise ValueError(f"MixtureSchedule: the first point must be at 0 (the start of training), got {out[0][0]}")
    for i in range(1, len(out)):
        if out[i][0] <= out[i - 1][0]:
            raise ValueError(f"MixtureSchedule: breakpoints must increase strictly; point {i} is at {out[i][0]} after {out[i - 1][0]}")
        if set(out[i][1]) != set(out[0][1]):
            raise ValueError(
                f"MixtureSchedule: point {i} names datasets {sorted(out[i][1])}, point 0 names {sorted(out[0][1])}; "
                "every point gives a weight (0 allowed) to the same datasets"
            )
    return tuple(out)


def _one_of(*allowed: str):
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"MixtureSchedule: {attribute.name} must be one of {list(allowed)}, got {value!r}")

    return check


@attrs.frozen
class MixtureSchedule:
    """Mixture weights that change over training (accepted wherever a mixture is).

    Args:
        points: ``[(at, weights), ...]``: the first at 0, ``at`` strictly increasing, weights
            >= 0 with one > 0 per point, every point naming the same datasets.
        by: what ``at`` counts: ``"step"`` (global optimizer steps) or ``"tokens"`` (tokens
            delivered, estimated with the calibration).
        interpolation: ``"step"`` (a point's weights hold until the next point) or ``"linear"``
            (linear between points, in :data:`RAMP_PIECES` even pieces; constant after the last).
        unit: what the weights count, as in :class:`MixtureSpec`.

    Examples:
        >>> s = MixtureSchedule([(0, {"web": 9, "math": 1}), (1000, {"web": 1, "math": 1})])
        >>> s.weights_at(999), s.weights_at(1000)
        ({'web': 0.9, 'math': 0.1}, {'web': 0.5, 'math': 0.5})
        >>> MixtureSchedule([(0, {"a": 1, "b": 0}), (10, {"a": 0, "b": 1})], interpolation="linear").weights_at(5)
        {'a': 0.5, 'b': 0.5}
    """

    points: tuple[tuple[float, dict[str, float]], ...] = attrs.field(converter=_convert_points)
    by: Literal["step", "tokens"] = attrs.field(default="step", kw_only=True, validator=_one_of("step", "tokens"))
    interpolation: Literal["step", "linear"] = attrs.field(default="step", kw_only=True, validator=_one_of("step", "linear"))
    unit: Literal["samples", "tokens"] | None = attrs.field(default=None, kw_only=True, validator=_check_unit)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.points[0][1])

    @property
    def weights(self) -> dict[str, float]:
        """The weights at the start (so code that reads a mixture's weights keeps working)."""
        return dict(self.points[0][1])

    def validate_for(self, names: tuple[str, ...]) -> None:
        for i, (at, w) in enumerate(self.points):
            check_names(w, names, f"schedule point {i} (at {at})")

    def weights_at(self, at: float) -> dict[str, float]:
        """The weights in force at ``at`` (a step or a token count, as ``by`` says)."""
        ats = [p[0] for p in self.points]
        i = max(k for k, a in enumerate(ats) if a <= at)
        if self.interpolation == "step" or i == len(ats) - 1:
            return dict(self.points[i][1])
        (a0, w0), (a1, w1) = self.points[i], self.points[i + 1]
        f = (at - a0) / (a1 - a0)
        return {n: w0[n] + (w1[n] - w0[n]) * f for n in w0}

    def pieces(self) -> list[tuple[float, dict[str, float]]]:
        """``(at, weights)`` of every stretch of constant weights (ramps cut into even pieces)."""
        if self.interpolation == "step":
            return [(a, dict(w)) for a, w in self.points]
        out = []
        for (a0, w0), (a1, w1) in zip(self.points, self.points[1:]):
            for k in range(RAMP_PIECES):
                f = (k + 0.5) / RAMP_PIECES
                out.append((a0 + (a1 - a0) * k / RAMP_PIECES, {n: w0[n] + (w1[n] - w0[n]) * f for n in w0}))
        out.append((self.points[-1][0], dict(self.points[-1][1])))
        return out

    def describe(self) -> dict[str, Any]:
        points = [[a, dict(w)] for a, w in self.points]
        return {"points": points, "by": self.by, "interpolation": self.interpolation,
                "unit": self.unit}

    def fingerprint(self) -> dict[str, Any]:
        """The schedule as an operator setting describes it (``ensure_mixture(schedule)``)."""
        return {"schedule": self.describe()}


def as_mixture(m: Any) -> MixtureSpec | MixtureSchedule:
    """A :class:`MixtureSpec` or :class:`MixtureSchedule` from either, or from ``{name: weight}``."""
    return m if isinstance(m, (MixtureSpec, MixtureSchedule)) else MixtureSpec(m)


class Interleave:
    """The periodic interleave of components for integer weights ``W`` (zeros allowed; see module docstring)."""

    def __init__(self, weights: tuple[int, ...]):
        self.weights = np.asarray(weights, dtype=np.int64)
        self.period = int(self.weights.sum())
        live = np.maximum(self.weights, 1)
        comps = np.repeat(np.arange(len(weights)), weights)
        ks = np.concatenate([np.arange(w) for w in weights])
        times = (2 * ks + 1) / (2 * live[comps])  # exact ordering for S <= 2**16
        order = np.lexsort((comps, times))
        self.table = comps[order].astype(np.int32)
        self._where = [np.flatnonzero(self.table == j) for j in range(len(weights))]

    def counts_before(self, t: int) -> np.ndarray:
        """How many elements of each component come before global position ``t``."""
        if not self.period:  # all weights zero: the data has ended here
            return np.zeros(len(self.weights), dtype=np.int64)
        q, r = divmod(t, self.period)
        return q * self.weights + np.bincount(self.table[:r], minlength=len(self.weights))

    def assign(self, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        """Component and within-component index of every global position in ``[t0, t1)``."""
        n = t1 - t0
        comps = self.table[(np.arange(n, dtype=np.int64) + t0) % self.period]
        index = np.empty(n, dtype=np.int64)
        base = self.counts_before(t0)
        for j in range(len(self.weights)):
            mask = comps == j
            index[mask] = base[j] + np.arange(int(mask.sum()), dtype=np.int64)
        return comps, index

    def position_of(self, component: int, k: int) -> int:
        """Global position of component ``component``'s ``k``-th element (its weight must be > 0)."""
        q, r = divmod(k, int(self.weights[component]))
        return q * self.period + int(self._where[component][r])


@functools.lru_cache(maxsize=64)
def interleave(weights: tuple[int, ...]) -> Interleave:
    return Interleave(weights)


@attrs.frozen
class Phase:
    """From position ``start`` on (until the next phase), datasets come with integer ``weights``."""

    start: int
    weights: tuple[int, ...]


@attrs.frozen(eq=False)
class Timeline:
    """Positions to (dataset, index in dataset) over a list of phases, counts carried across phases.

    Examples:
        >>> tl = Timeline((Phase(0, (1, 1)), Phase(4, (1, 0))))
        >>> tl.assign(0, 7)[0].tolist(), tl.counts_before(7).tolist()
        ([0, 1, 0, 1, 0, 0, 0], [5, 2])
        >>> tl.position_of(0, 4), tl.position_of(1, 2) is None
        (6, True)
    """

    phases: tuple[Phase, ...]

    def __attrs_post_init__(self) -> None:
        starts = [p.start for p in self.phases]
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"phases must start at 0 and at increasing positions, got {starts}")

    @functools.cached_property
    def _base(self) -> list[np.ndarray]:
        """Counts of every dataset before each phase's start."""
        base = [np.zeros(len(self.phases[0].weights), dtype=np.int64)]
        for p, q in zip(self.phases, self.phases[1:]):
            base.append(base[-1] + interleave(p.weights).counts_before(q.start - p.start))
        return base

    def phase_index(self, t: int) -> int:
        return max(bisect.bisect_right(self.phases, t, key=lambda p: p.start) - 1, 0)

    def counts_before(self, t: int) -> np.ndarray:
        i = self.phase_index(t)
        p = self.phases[i]
        return self._base[i] + interleave(p.weights).counts_before(t - p.start)

    def assign(self, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        comps, index = [], []
        t = t0
        while t < t1:
            i = self.phase_index(t)
            p = self.phases[i]
            stop = min(t1, self.phases[i + 1].start) if i + 1 < len(self.phases) else t1
            c, k = interleave(p.weights).assign(t - p.start, stop - p.start)
            comps.append(c)
            index.append(k + self._base[i][c])
            t = stop
        if not comps:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        return np.concatenate(comps), np.concatenate(index)

    def position_of(self, j: int, k: int) -> int | None:
        """The position of dataset ``j``'s ``k``-th element (0-based), or ``None`` if it never comes."""
        for i, p in enumerate(self.phases):
            if i + 1 < len(self.phases) and self._base[i + 1][j] <= k:
                continue
            if p.weights[j] == 0:
                return None
            return p.start + interleave(p.weights).position_of(j, k - int(self._base[i][j]))

    def weights_at(self, t: int) -> tuple[int, ...]:
        return self.phases[self.phase_index(t)].weights

    def with_zero_from(self, j: int, t: int) -> "Timeline":
        """This timeline with dataset ``j``'s weight zero from position ``t`` on."""
        out: list[Phase] = []
        for i, p in enumerate(self.phases):
            if p.start < t:
                out.append(p)
            if i + 1 == len(self.phases) or self.phases[i + 1].start > t:
                out.append(Phase(max(p.start, t), _zeroed(p.weights, j)))
        return Timeline(tuple(_merge_equal(out)))

    def spliced(self, t: int, later: "Timeline") -> "Timeline":
        """Positions before ``t`` from this timeline, from ``t`` on from ``later`` (counts carried)."""
        head = [p for p in self.phases if p.start < t]
        i = later.phase_index(t)
        tail = [Phase(t, later.phases[i].weights), *later.phases[i + 1 :]]
        return Timeline(tuple(_merge_equal(head + tail)))

    def describe(self) -> list[list[Any]]:
        return [[p.start, list(p.weights)] for p in self.phases]


def _zeroed(w: tuple[int, ...], j: int) -> tuple[int, ...]:
    out = list(w)
    out[j] = 0
    g = math.gcd(*out) or 1
    return tuple(x // g for x in out)


def _merge_equal(phases: list[Phase]) -> list[Phase]:
    return [p for i, p in enumerate(phases) if not i or phases[i - 1].weights != p.weights]


def _tokens_to_position(tl_phases: list[Phase], tps: tuple[float, ...], tokens: float) -> int:
    """The first position at which the estimated tokens before it reach ``tokens`` (phases so far, last one open)."""
    tl = Timeline(tuple(tl_phases))
    last = tl_phases[-1]
    done = float(sum(int(c) * t for c, t in zip(tl.counts_before(last.start), tps)))
    rate = sum(w * t for w, t in zip(last.weights, tps)) / sum(last.weights)
    if tokens <= done or rate <= 0:
        return last.start
    return last.start + int(math.ceil((tokens - done) / rate))


def _padded(tl: Timeline, n: int) -> Timeline:
    return Timeline(tuple(Phase(p.start, tuple(p.weights) + (0,) * (n - len(p.weights))) for p in tl.phases))


def resolve_timeline(src: Any) -> tuple[Timeline, int | None, str | None, list, list]:
    """A work source's timeline (schedule, units and redistributions applied), its end, why it ends
    there, and the positions of the schedule's points and pieces; ``ValueError`` for a schedule
    point after the end of the data."""
    names, m = src.names, src.mixture
    sizes = [d.num_rows for d in src.datasets]
    tps = src.calibration.tokens_per_sample(names) if src.calibration is not None else None
    schedule = isinstance(m, MixtureSchedule)
    pieces = m.pieces() if schedule else [(0, m.weights)]

    def sample_weights(w: dict[str, float]) -> tuple[int, ...]:
        ws = [w[n] for n in names]
        if src.unit == "tokens":
            ws = [x / t for x, t in zip(ws, tps)]
        return integer_weights(ws)

    phases = [Phase(0, sample_weights(pieces[0][1]))]
    positions = [0]
    for at, w in pieces[1:]:
        if m.by == "step" and src.samples_per_step is not None:
            pos = int(round(at * src.samples_per_step))
        else:
            tokens = at * src.tokens_per_step if m.by == "step" else at
            pos = _tokens_to_position(phases, tps, tokens)
        if src.step_lanes is not None:  # the first block at or after the point (see step_lanes)
            block = src.step_lanes * src.chunk_size
            pos = -(-pos // block) * block
        pos = max(pos, phases[-1].start)
        positions.append(pos)
        if pos == phases[-1].start:
            phases[-1] = Phase(pos, sample_weights(w))
        elif phases[-1].weights != sample_weights(w):
            phases.append(Phase(pos, sample_weights(w)))
    tl = Timeline(tuple(phases))
    if src.change is not None:
        tl = _padded(src.change.before, len(names)).spliced(src.change.position, tl)

    dropped: set[int] = set()
    while True:
        found = [(tl.position_of(j, src.pass_limit(n) * sizes[j]), j) for j, n in enumerate(names)
                 if src.policy(n) == "redistribute" and j not in dropped and sizes[j]]
        found = [(p, j) for p, j in found if p is not None]
        if not found:
            break
        p, j = min(found)
        tl = tl.with_zero_from(j, p)
        dropped.add(j)

    ends: list[tuple[int, str]] = []
    if src.exhausted_policy is None:
        last = [(tl.position_of(j, src.passes * n - 1), j) for j, n in enumerate(sizes) if n]
        valid = [(p + 1, j) for p, j in last if p is not None]
        if valid:
            e, j = max(valid)
            ends.append((e, f"dataset {names[j]!r} completes pass {src.passes} (exhausted_policy=None: every dataset makes {src.passes} full pass(es))"))
    else:
        for j, name in enumerate(names):
            limit = src.pass_limit(name)
            if limit is None or src.policy(name) == "redistribute" or not sizes[j]:
                continue
            p = tl.position_of(j, limit * sizes[j])
            if p is not None:
                how = "'stop'" if src.policy(name) == "stop" else f"'repeat' with max_repeats={limit - 1}"
                ends.append((p, f"dataset {name!r} runs out after {limit} pass(es) of {sizes[j]} rows (exhausted_policy {how})"))
    for ph in tl.phases:
        if not any(ph.weights):
            ends.append((ph.start, "every dataset has dropped out (exhausted_policy 'redistribute')"))
            break
    end, reason = min(ends) if ends else (None, None)
    if end is not None and src.change is not None and end < src.change.position:
        raise ValueError(f"the new plan ends at position {end}, before the change at position {src.change.position}: {reason}")

    points: list[tuple[Any, int]] = []
    if schedule:
        at_pos = dict(zip([a for a, _ in pieces], positions))
        points = [(a, at_pos[a]) for a, _ in m.points]
        for i, (a, pos) in enumerate(points):
            if i and end is not None and pos >= end and (src.change is None or pos >= src.change.position):
                raise ValueError(
                    f"schedule point {i} (at {m.by} {a}) takes effect at source position {pos}, but the data ends at position "
                    f"{end}: {reason}. Give that dataset more data, let it repeat (exhausted_policy='repeat' or max_repeats=), "
                    "or move the point earlier"
                )
    return tl, end, reason, points, [(pos, dict(w)) for pos, (_, w) in zip(positions, pieces)]
