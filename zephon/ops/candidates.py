"""best_fit_wrap's candidate pool (:mod:`zephon.ops.bins`): pieces of documents waiting for a row.

The pool is a working copy built from a state's ``pool`` for one ``step`` or ``flush``, indexed by
``(length, arrival)`` for the largest-fit search and by arrival for the age limit.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Sequence

from ..core.records import Record

#: A piece of a document: the record (whole, as its upstream produced it) and a token range.
Piece = tuple  # (Record, start, end)


def length_of(pieces: Sequence[tuple]) -> int:
    return sum(p[2] - p[1] for p in pieces)


class Pool:
    """best_fit_wrap's candidates: sorted by ``(length, arrival)`` and by arrival (for ages)."""

    __slots__ = ("live", "keys", "order", "total", "arrivals", "max_age")

    def __init__(self, items: Sequence[tuple], arrivals: int, max_age: int):
        self.live = {arr: (rec, a, b) for rec, a, b, arr in items}  # insertion order = arrival order
        self.keys = sorted((b - a, arr) for _, a, b, arr in items)
        self.order = deque(arr for *_, arr in items)
        self.total = length_of(items)
        self.arrivals = arrivals
        self.max_age = max_age

    def __len__(self) -> int:
        return len(self.live)

    def add(self, rec: Record, a: int, b: int) -> None:
        self.arrivals += 1
        self.live[self.arrivals] = (rec, a, b)
        insort(self.keys, (b - a, self.arrivals))
        self.order.append(self.arrivals)
        self.total += b - a

    def _take(self, length: int, arr: int) -> Piece:
        del self.keys[bisect_left(self.keys, (length, arr))]
        self.total -= length
        return self.live.pop(arr)

    def build(self, max_length: int, cap: int | None) -> list[Piece]:
        """One bin: overdue candidates, then largest fits, then one split of the shortest."""
        pieces: list[Piece] = []
        gap = max_length
        limit = len(self.live) if cap is None else min(len(self.live), cap)
        while gap > 0 and len(pieces) < limit:
            while self.order[0] not in self.live:
                self.order.popleft()
            arr = self.order[0]
            rec, a, b = self.live[arr]
            # Largest-first selection can pass over a candidate forever; age bounds its wait.
            if self.arrivals - arr <= self.max_age or b - a > gap:
                break
            gap -= b - a
            pieces.append(self._take(b - a, arr))
        while gap > 0 and len(pieces) < limit:
            i = bisect_left(self.keys, (gap + 1, -1))
            if i:
                length = self.keys[i - 1][0]
                length, arr = self.keys[bisect_left(self.keys, (length, -1))]  # earliest of that length
                gap -= length
                pieces.append(self._take(length, arr))
                continue
            length, arr = self.keys[0]  # nothing fits: split the shortest (earliest on ties)
            rec, a, b = self.live[arr]
            # Cut the end that severs fewer tokens from a document's prefix; a suffix only splits forward.
            if a == 0 and gap < length - gap:
                pieces.append((rec, b - gap, b))
                self.live[arr] = (rec, a, b - gap)
            else:
                pieces.append((rec, a, a + gap))
                self.live[arr] = (rec, a + gap, b)
            del self.keys[0]
            insort(self.keys, (length - gap, arr))
            self.total -= gap
            gap = 0
        return pieces

    def freeze(self) -> tuple:
        return tuple((rec, a, b, arr) for arr, (rec, a, b) in self.live.items())
