"""Mixture weights and the deterministic interleave of components over global positions.

Weights are resolved once to small integers ``W`` (exact for simple ratios, else to multiples of
1/65536). Component ``j``'s ``k``-th element gets the virtual time ``(2k + 1) / (2 W_j)``; sorting
one period of ``S = sum(W)`` elements by (time, component) gives the order, which then repeats.
So the component of global position ``t`` and its index within that component are pure integer
functions of ``t``, with exact long-run ratios and every prefix within one element of its target
(a smooth weighted round-robin, as in Grain's index-based mixing).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Mapping

import attrs
import numpy as np

_QUANTUM = 1 << 16


def _convert_weights(weights: Mapping[str, float]) -> dict[str, float]:
    if isinstance(weights, MixtureSpec):
        return dict(weights.weights)
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"a mixture is a non-empty mapping of dataset name to weight, got {weights!r}")
    out: dict[str, float] = {}
    for name, w in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"mixture keys are dataset names (str), got {name!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"mixture weight of {name!r} must be a finite number > 0, got {w!r}")
        out[name] = float(w)
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


@attrs.frozen
class MixtureSpec:
    """Relative weights of the datasets in a mixture, normalized to sum to 1 (insertion order kept).

    Examples:
        >>> MixtureSpec({"web": 3, "code": 1}).weights
        {'web': 0.75, 'code': 0.25}
    """

    weights: dict[str, float] = attrs.field(converter=_convert_weights)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def validate_for(self, names: tuple[str, ...]) -> None:
        missing = [n for n in names if n not in self.weights]
        unknown = [n for n in self.weights if n not in names]
        if missing or unknown:
            raise ValueError(
                f"mixture does not match the datasets: datasets without a weight {missing}, "
                f"weights for unknown datasets {unknown}; give one weight per dataset name {list(names)}"
            )

    def integer_weights(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """Resolve the weights (in ``names`` order) to co-prime integers; see the module note."""
        ws = [self.weights[n] for n in names]
        fracs = [Fraction(w).limit_denominator(1000) for w in ws]
        exact = all(abs(float(f) - w) <= 1e-12 * max(1.0, w) for f, w in zip(fracs, ws))
        lcm = math.lcm(*(f.denominator for f in fracs))
        if exact and lcm <= _QUANTUM:
            ints = [int(f * lcm) for f in fracs]
        else:
            raw = [w * _QUANTUM for w in ws]
            ints = [max(1, int(r)) for r in raw]
            short = _QUANTUM - sum(ints)
            order = sorted(range(len(ws)), key=lambda i: (-(raw[i] - int(raw[i])), i))
            for i in order[: max(0, short)]:
                ints[i] += 1
        g = math.gcd(*ints)
        return tuple(i // g for i in ints)


class Interleave:
    """The periodic interleave of components for integer weights ``W`` (see module docstring)."""

    def __init__(self, weights: tuple[int, ...]):
        self.weights = np.asarray(weights, dtype=np.int64)
        self.period = int(self.weights.sum())
        comps = np.repeat(np.arange(len(weights)), weights)
        ks = np.concatenate([np.arange(w) for w in weights])
        times = (2 * ks + 1) / (2 * self.weights[comps])  # exact ordering for S <= 2**16
        order = np.lexsort((comps, times))
        self.table = comps[order].astype(np.int32)
        self._where = [np.flatnonzero(self.table == j) for j in range(len(weights))]

    def counts_before(self, t: int) -> np.ndarray:
        """How many elements of each component come before global position ``t``."""
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
        """Global position of component ``component``'s ``k``-th element."""
        q, r = divmod(k, int(self.weights[component]))
        return q * self.period + int(self._where[component][r])
