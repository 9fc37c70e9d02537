"""Sequence-length warmup: :class:`LengthSchedule`, a ``pack_flat`` row length per global step.

With ``batch(tokens_per_microbatch=T)`` a microbatch holds ``T / (length - 1)`` rows, and a lane
delivers one microbatch per step, so a row's step follows from the rows the lane's packer emitted
(:meth:`LengthSchedule.phases`). That needs nothing between ``pack_flat`` and ``batch`` that
drops, reorders or duplicates rows: :func:`bind_lengths` checks it when the pipeline is built.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import attrs

__all__ = ["LengthSchedule", "Phase", "bind_lengths", "rows_per_microbatch"]


class Phase(NamedTuple):
    """A stretch of steps with one row length: from ``step`` on, ``rows`` rows of ``length`` tokens
    per microbatch; ``first_row`` is the lane's row index (rows emitted before) where it starts."""

    step: int
    length: int
    rows: int
    first_row: int


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _convert_points(points: Any) -> tuple[tuple[int, int], ...]:
    if isinstance(points, dict):
        points = list(points.items())
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or not points:
        raise ValueError(
            f"LengthSchedule: points is a non-empty list of (step, length) pairs, e.g. [(0, 257), (2000, 1025)]; "
            f"got {points!r}"
        )
    out = []
    for i, p in enumerate(points):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
            raise ValueError(f"LengthSchedule: point {i} must be a pair (step, length), got {p!r}")
        step, length = p
        if not is_int(step) or step < 0:
            raise ValueError(f"LengthSchedule: point {i}: step must be an int >= 0, got {step!r}")
        if not is_int(length) or length < 2:
            raise ValueError(
                f"LengthSchedule: point {i} (step {step}): length must be an int >= 2 (a row of context + 1 "
                f"tokens), got {length!r}"
            )
        out.append((step, length))
    if out[0][0] != 0:
        raise ValueError(
            f"LengthSchedule: the first point must be at step 0 (the start of training), got step {out[0][0]}; "
            f"add a point (0, length) in front"
        )
    for i, ((before, _), (step, _)) in enumerate(zip(out, out[1:]), 1):
        if step <= before:
            raise ValueError(
                f"LengthSchedule: steps must increase strictly; point {i} is at step {step} after "
                f"step {before}; sort the points and give each step one length"
            )
    return tuple(out)


def rows_per_microbatch(length: int, tokens_per_microbatch: int, where: str) -> int:
    """``tokens_per_microbatch / (length - 1)``, refused (naming ``where`` and the fix) unless it divides."""
    T = tokens_per_microbatch
    if length < 2 or T % (length - 1):
        raise ValueError(
            f"tokens_per_microbatch={T} does not divide into rows of {where}: {T} is not a multiple of {length} - 1 = "
            f"{length - 1} (the training tokens of a row), so a microbatch cannot hold exactly {T} training tokens; "
            f"choose tokens_per_microbatch as a common multiple of every length - 1, or lengths of the form k + 1 "
            f"with k dividing {T}"
        )
    return T // (length - 1)


@lru_cache(maxsize=64)
def _phases(points: tuple[tuple[int, int], ...], tokens: int) -> tuple[tuple[Phase, ...], list[int]]:
    """The phases of a schedule for ``tokens`` per microbatch, and their first rows (computed once per pair)."""
    out: list[Phase] = []
    for step, length in points:
        rows = rows_per_microbatch(length, tokens, f"the LengthSchedule phase from step {step}")
        first = out[-1].first_row + (step - out[-1].step) * out[-1].rows if out else 0
        out.append(Phase(step, length, rows, first))
    return tuple(out), [p.first_row for p in out]


@attrs.frozen
class LengthSchedule:
    """Row lengths of ``pack_flat`` over global steps: ``[(step, length), ...]``.

    From each ``step`` on, rows hold ``length`` tokens (``context + 1``); the first step is 0 and
    steps increase strictly. Used as ``pack_flat(max_length=...)`` with
    ``batch(tokens_per_microbatch=T)``, ``T`` divisible by every ``length - 1``. Part of the
    fingerprint; :meth:`describe` gives builtins (JSON- and msgpack-safe).

    Examples:
        >>> s = LengthSchedule([(0, 257), (2000, 1025)])
        >>> s.length_at(1999), s.length_at(2000)
        (257, 1025)
        >>> [tuple(p) for p in s.phases(4096)]
        [(0, 257, 16, 0), (2000, 1025, 4, 32000)]
        >>> s.row_length(31999, 4096), s.row_length(32000, 4096), s.step_of_row(32005, 4096)
        (257, 1025, 2001)
    """

    points: tuple[tuple[int, int], ...] = attrs.field(converter=_convert_points)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.points)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def length_at(self, step: int) -> int:
        """The row length at global step ``step``."""
        return self.points[bisect_right([s for s, _ in self.points], step) - 1][1]

    def phases(self, tokens_per_microbatch: int) -> tuple[Phase, ...]:
        """Every phase with its rows per microbatch and its first row; refuses a ``tokens_per_microbatch``
        that some ``length - 1`` does not divide, naming the phase's step."""
        return _phases(self.points, tokens_per_microbatch)[0]

    def _phase_of_row(self, row: int, tokens_per_microbatch: int) -> Phase:
        phases, firsts = _phases(self.points, tokens_per_microbatch)
        return phases[bisect_right(firsts, row) - 1]

    def row_length(self, row: int, tokens_per_microbatch: int) -> int:
        """The length of a lane's row ``row`` (0-based, counting every row the lane's packer emitted)."""
        return self._phase_of_row(row, tokens_per_microbatch).length

    def step_of_row(self, row: int, tokens_per_microbatch: int) -> int:
        """The global step whose microbatch holds a lane's row ``row``."""
        p = self._phase_of_row(row, tokens_per_microbatch)
        return p.step + (row - p.first_row) // p.rows

    def describe(self) -> list[list[int]]:
        return [[s, n] for s, n in self.points]

    def fingerprint(self) -> dict[str, Any]:
        """The schedule as an operator setting describes it (``pack_flat(max_length=schedule)``)."""
        return {"length_schedule": self.describe()}

    def __str__(self) -> str:
        return "LengthSchedule(" + ", ".join(f"step {s}: {n}" for s, n in self.points) + ")"


def bind_lengths(operators: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """``operators`` with ``pack_flat`` given its ``batch``'s ``tokens_per_microbatch``, after checking
    the pairing: a :class:`LengthSchedule` goes with ``batch(tokens_per_microbatch=T)`` and only with it,
    nothing stands between them, and ``T`` divides into whole rows in every phase.
    """
    batch_at = next((i for i, (_, op) in enumerate(operators) if op.kind == "batch"), None)
    batch = operators[batch_at][1] if batch_at is not None else None
    tokens = getattr(batch, "tokens_per_microbatch", None)
    flat = [i for i, (_, op) in enumerate(operators) if op.kind == "pack_flat"]
    scheduled = [i for i in flat if isinstance(operators[i][1].max_length, LengthSchedule)]
    if tokens is not None and not flat:
        raise ValueError(
            f"batch: tokens_per_microbatch={tokens} counts the tokens of pack_flat rows, but no pack_flat comes before "
            "it; add pack_flat(max_length) (a length or a LengthSchedule), or batch by rows (microbatch_size) or by "
            "budget (max_tokens)"
        )
    if not scheduled:
        if tokens is not None:
            pack = operators[flat[-1]][1]
            rows_per_microbatch(pack.max_length, tokens, f"pack_flat(max_length={pack.max_length})")
        return tuple(operators)
    at = scheduled[0]
    pack = operators[at][1]
    if batch is None:
        raise ValueError(
            "pack_flat(max_length=LengthSchedule(...)) needs batch(tokens_per_microbatch=T) as the last step: the "
            "step a row belongs to is counted in microbatches of T tokens"
        )
    if tokens is None:
        size = batch.microbatch_size
        mode = f"microbatch_size={size}" if size is not None else f"max_tokens={batch.max_tokens}"
        raise ValueError(
            f"batch({mode}) cannot follow pack_flat(max_length={pack.max_length}): a length schedule changes the row "
            "length per step, and only batch(tokens_per_microbatch=T) keeps the tokens per step constant (T / "
            "(length - 1) rows); pass batch(tokens_per_microbatch=T) instead"
        )
    between = [n for n, _ in operators[at + 1 : batch_at]]
    if between:
        raise ValueError(
            f"pack_flat(max_length=LengthSchedule(...)) must be followed directly by batch(tokens_per_microbatch=...), "
            f"but {between} stand between them: the step of a row is counted from the rows pack_flat emitted, and an "
            "operator there could drop, reorder or duplicate rows (a map may return None, a filter drops, a shuffle "
            "reorders), which would put rows of one length into a step of another; move them before pack_flat"
        )
    pack.max_length.phases(tokens)  # every phase divides, or the error names its step
    given = pack.tokens_per_microbatch
    if given is not None and given != tokens:
        raise ValueError(
            f"pack_flat: tokens_per_microbatch={given} differs from batch(tokens_per_microbatch={tokens}); leave it "
            "out of pack_flat (the pipeline fills it from batch)"
        )
    out = list(operators)
    out[at] = (out[at][0], attrs.evolve(pack, tokens_per_microbatch=tokens))
    return tuple(out)
