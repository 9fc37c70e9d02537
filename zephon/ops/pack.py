"""Packing: fit a lane's documents into rows of at most ``max_length`` tokens.

Two operators share one engine and differ only in what a finished bin becomes:

- :class:`PackFlat` (``pack_flat``) concatenates a bin into one fixed-length training row
  (token field and every token-aligned field, padded to ``max_length``, plus ``positions``, and
  ``segments``: per piece, its offset, length and its document's other fields);
- :class:`PackSequences` (``pack_sequences``) emits the bin as an envelope
  ``{"packed_samples": [payload, ...]}`` for users who build their own tensors.

No field is dropped silently: a field that is not token-aligned (a ``doc_id``, a ``source``, an
image's ``pixel_values``) travels with every piece of its document, one that cannot travel (it does
not pickle) is refused naming it, and only ``drop_fields=`` drops fields, counted.

Four algorithms decide which tokens share a bin (Zephon 0.2.0's semantics, see ``PackFlat``):
``first_fit`` and ``best_fit`` place whole documents into up to ``num_bins`` open bins; ``wrap``
cuts one token stream into consecutive rows; ``best_fit_wrap`` fills each row exactly from a pool
of candidates with at most one split per row.

Unlike packers that emit or drop partial bins at periodic flushes, nothing here depends on where
the stream is cut into chunks: open bins, the wrap remainder and the candidate pool stay in the
state across chunk boundaries, and only ``flush`` (the end of the data) closes partial bins. The
state holds those documents *by reference* (their metas and token ranges), never token arrays.

Every output's meta lists its pieces as segments ``(dataset, shard, row, child, start, end)`` and
its ``padding_length``; that is all :meth:`~PackFlat.rebuild` needs to rebuild the row, through
the same function that built it. The segment fields come back with the documents, by reference:
the state never holds them. Every token that is not emitted is counted in ``report()``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Any, ClassVar, Literal, Sequence

import attrs
import msgspec
import numpy as np

from ..core.operator import Operator, Resolver, config_field
from ..core.state import decode, resolve
from ..core.fields import SEGMENT_KEYS, aligned_payload, check_carried, find_token_field, segment_entry, unique_names
from ..core.records import Meta, Record, Segment, describe_meta

__all__ = ["ALGORITHMS", "OVERSIZED", "PackFlat", "PackSequences", "PackState", "packing_info"]

#: The packing algorithms, as Zephon names them.
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
#: What to do with a document longer than ``max_length``.
OVERSIZED = ("split", "drop", "truncate", "error")
_WHOLE = ("first_fit", "best_fit")  # keep documents whole in open bins
_ARANGE = np.arange(1 << 16, dtype=np.int32)

#: A piece of a document: the record (whole, as its upstream produced it) and a token range.
Piece = tuple  # (Record, start, end)


def _positions(lengths: Sequence[int]) -> np.ndarray:
    if not lengths:
        return np.zeros(0, np.int32)
    if max(lengths) <= len(_ARANGE):
        return np.concatenate([_ARANGE[:n] for n in lengths])
    return np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])


def _field_names(value: Any) -> Any:
    """``drop_fields`` as a tuple of names (``None``: none); anything else is left for the check."""
    return () if value is None else unique_names(value)


def _aligned_keys(payload: dict, tfield: str, where: str, *, skip_positions: bool = True) -> list[str]:
    """The token field, then every 1-D array field of the same length, in payload order."""
    n = len(payload[tfield])
    keys = [tfield]
    for k, v in payload.items():
        if k == tfield or (skip_positions and k == "positions"):
            continue
        if isinstance(v, np.ndarray) and v.ndim == 1 and len(v) == n:
            keys.append(k)
        elif isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) != n and k in ("loss_mask", "labels", "attention_mask"):
            raise ValueError(f"{where}: field {k!r} has length {len(v)} but the tokens have {n}; align it with the tokens")
    return keys


def _ranged(seg: Segment, start: int, end: int) -> Segment:
    """``seg._replace(start=start, end=end)``, without the keyword machinery (once per piece of a row)."""
    return _new_tuple(Segment, (seg[0], seg[1], seg[2], seg[3], start, end))


_new_tuple = tuple.__new__


def _slice(value: Any, a: int, b: int) -> Any:
    part = value[a:b]
    return part.copy() if isinstance(part, np.ndarray) else part


class PackState(msgspec.Struct, frozen=True, tag="pack", forbid_unknown_fields=True):
    """Open work (documents by reference, with token ranges) and counters.

    Attributes:
        bins: first_fit/best_fit open bins, oldest first; each a tuple of pieces
            ``(record, start, end)``.
        stream: wrap's pending pieces in order (the first may start mid-document).
        pool: best_fit_wrap candidates ``(record, start, end, arrival)`` in arrival order.
        arrivals: best_fit_wrap's count of candidates ever added (ages are measured in it).
        rows, tokens, padding_tokens: outputs emitted, their real tokens and their padding.
        empty_records: records without tokens (nothing to pack; counted).
        oversized_dropped_records, oversized_dropped_tokens: ``oversized="drop"``.
        truncated_records, truncated_tokens: ``oversized="truncate"`` (tokens cut off).
        split_records: documents longer than ``max_length`` spread over several rows.
        tail_dropped_tokens: uncapped flat wrap without ``pad_token_id``: the end-of-data remainder.
        dropped_field_values: field values removed by ``drop_fields`` (one per document and field).
    """

    bins: tuple[tuple[tuple[Record, int, int], ...], ...] = ()
    stream: tuple[tuple[Record, int, int], ...] = ()
    pool: tuple[tuple[Record, int, int, int], ...] = ()
    arrivals: int = 0
    rows: int = 0
    tokens: int = 0
    padding_tokens: int = 0
    empty_records: int = 0
    oversized_dropped_records: int = 0
    oversized_dropped_tokens: int = 0
    truncated_records: int = 0
    truncated_tokens: int = 0
    split_records: int = 0
    tail_dropped_tokens: int = 0
    dropped_field_values: int = 0


_COUNTERS = tuple(n for n in PackState.__struct_fields__ if n not in ("bins", "stream", "pool", "arrivals"))


class _Pool:
    """best_fit_wrap's candidates: sorted by ``(length, arrival)`` and by arrival (for ages)."""

    __slots__ = ("live", "keys", "order", "total", "arrivals", "max_age")

    def __init__(self, items: Sequence[tuple], arrivals: int, max_age: int):
        self.live = {arr: (rec, a, b) for rec, a, b, arr in items}  # insertion order = arrival order
        self.keys = sorted((b - a, arr) for _, a, b, arr in items)
        self.order = deque(arr for *_, arr in items)
        self.total = sum(b - a for _, a, b, _ in items)
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

    def drain(self) -> list[Piece]:
        pieces = list(self.live.values())
        self.live.clear()
        self.keys.clear()
        self.order.clear()
        self.total = 0
        return pieces

    def freeze(self) -> tuple:
        return tuple((rec, a, b, arr) for arr, (rec, a, b) in self.live.items())


class _Work:
    """The mutable working copy of a :class:`PackState` during one ``step`` or ``flush``."""

    __slots__ = ("bins", "stream", "head", "avail", "pool", "counts")

    def __init__(self, state: PackState, max_age: int):
        self.bins = [[list(b), sum(e - s for _, s, e in b)] for b in state.bins]
        self.stream = [list(p) for p in state.stream]
        self.head = 0
        self.avail = sum(e - s for _, s, e in state.stream)
        self.pool = _Pool(state.pool, state.arrivals, max_age)
        self.counts = {n: getattr(state, n) for n in _COUNTERS}

    def freeze(self) -> PackState:
        return PackState(
            bins=tuple(tuple(b[0]) for b in self.bins),
            stream=tuple(tuple(p) for p in self.stream[self.head :]),
            pool=self.pool.freeze(),
            arrivals=self.pool.arrivals,
            **self.counts,
        )


@attrs.frozen
class _Packer(Operator):
    """The packing engine shared by :class:`PackFlat` and :class:`PackSequences`."""

    max_length: int = config_field()
    algorithm: Literal["first_fit", "best_fit", "wrap", "best_fit_wrap"] = config_field(default="wrap", kw_only=True)
    num_bins: int | None = config_field(default=None, kw_only=True)
    max_sequences_per_bin: int | None = config_field(default=None, kw_only=True)
    min_sequence_length: int = config_field(default=1, kw_only=True)
    oversized: Literal["split", "drop", "truncate", "error"] | None = config_field(default=None, kw_only=True)
    # Its meaning is carried into ``oversized`` on construction, so it does not decide data twice.
    drop_oversized: bool | None = config_field(default=None, data=False, kw_only=True)
    candidate_pool_size: int | None = config_field(default=None, kw_only=True)
    max_candidate_age: int | None = config_field(default=None, kw_only=True)
    tokens_field: str = config_field(default="auto", kw_only=True)
    pad_token_id: int | None = config_field(default=None, kw_only=True)
    drop_fields: tuple[str, ...] = config_field(default=(), converter=_field_names, kw_only=True)

    state_type: ClassVar[type] = PackState
    flat: ClassVar[bool] = True

    # -- configuration ----------------------------------------------------------------------------------
    def __attrs_post_init__(self) -> None:
        k, alg = self.kind, self.algorithm
        if not _is_int(self.max_length) or self.max_length < 1:
            raise ValueError(f"{k}: max_length must be an int >= 1, got {self.max_length!r}")
        if alg not in ALGORITHMS:
            raise ValueError(f"{k}: unknown algorithm {alg!r}; choose one of {', '.join(map(repr, ALGORITHMS))}")
        if alg in _WHOLE:
            if self.num_bins is None:
                raise ValueError(
                    f"{k}: algorithm={alg!r} needs num_bins, how many bins stay open at once (more bins pack "
                    f"tighter and hold more documents in the state); e.g. {k}({self.max_length}, algorithm={alg!r}, "
                    "num_bins=8, ...)"
                )
            if not _is_int(self.num_bins) or self.num_bins < 1:
                raise ValueError(f"{k}: num_bins must be an int >= 1, got {self.num_bins!r}")
        elif self.num_bins is not None:
            raise ValueError(
                f"{k}: num_bins does not apply to algorithm={alg!r}, which keeps no open bins; omit num_bins "
                "(or use algorithm='first_fit'/'best_fit')"
            )
        cap = self.max_sequences_per_bin
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ValueError(f"{k}: max_sequences_per_bin must be an int >= 1 or None, got {cap!r}")
        if not _is_int(self.min_sequence_length) or self.min_sequence_length < 0:
            raise ValueError(f"{k}: min_sequence_length must be an int >= 0, got {self.min_sequence_length!r}")
        if alg not in _WHOLE and self.min_sequence_length != 1:
            raise ValueError(
                f"{k}: min_sequence_length only applies to first_fit/best_fit (a bin closes once its free room drops "
                f"below it); algorithm={alg!r} fills rows exactly, so leave it at 1"
            )
        if alg == "best_fit_wrap":
            if not _is_int(self.pool_size) or self.pool_size < 1:
                raise ValueError(f"{k}: candidate_pool_size must be an int >= 1, got {self.pool_size!r}")
            if not _is_int(self.candidate_age) or self.candidate_age < 1:
                raise ValueError(f"{k}: max_candidate_age must be an int >= 1, got {self.candidate_age!r}")
        else:
            for name in ("candidate_pool_size", "max_candidate_age"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{k}: {name} only applies to algorithm='best_fit_wrap'; omit it for {alg!r}")
        self._resolve_oversized()
        if not isinstance(self.tokens_field, str) or not self.tokens_field:
            raise ValueError(f"{k}: tokens_field must be a field name or 'auto', got {self.tokens_field!r}")
        pad = self.pad_token_id
        if pad is not None and (not _is_int(pad) or pad < 0):
            raise ValueError(f"{k}: pad_token_id must be a non-negative int or None, got {pad!r}")
        drop = self.drop_fields
        if isinstance(drop, str) or not isinstance(drop, tuple) or not all(isinstance(n, str) and n for n in drop):
            example = f"({drop!r},)" if isinstance(drop, str) else "('source',)"
            raise TypeError(f"{k}: drop_fields must be a sequence of field names, e.g. drop_fields={example}; got {drop!r}")
        self._check_output()

    # The settings as given stay in the fields (so ``attrs.evolve`` equals construction); what
    # they resolve to is derived here.
    @property
    def oversized_policy(self) -> str:
        """The oversized policy in force: ``oversized``, else ``drop_oversized``'s meaning, else the default."""
        return self._resolve_oversized()

    @property
    def pool_size(self) -> int:
        """best_fit_wrap's candidate pool size (``candidate_pool_size``, default 1024)."""
        return 1024 if self.candidate_pool_size is None else self.candidate_pool_size

    @property
    def candidate_age(self) -> int:
        """best_fit_wrap's age limit in arrivals (``max_candidate_age``, default ``8 * pool``)."""
        return 8 * self.pool_size if self.max_candidate_age is None else self.max_candidate_age

    def fingerprint(self) -> dict[str, Any]:
        out = super().fingerprint()
        out["oversized"] = self.oversized_policy
        if not self.drop_fields:
            del out["drop_fields"]  # the default: fingerprints (and checkpoints) from before the option stay valid
        if self.algorithm == "best_fit_wrap":
            out["candidate_pool_size"], out["max_candidate_age"] = self.pool_size, self.candidate_age
        return out

    def _resolve_oversized(self) -> str:
        k, alg, drop = self.kind, self.algorithm, self.drop_oversized
        if drop is not None and not isinstance(drop, bool):
            raise ValueError(f"{k}: drop_oversized must be True, False or None, got {drop!r}")
        if drop is True and alg not in _WHOLE:
            raise ValueError(
                f"{k}: drop_oversized=True is not allowed with algorithm={alg!r}, which splits long documents "
                "across rows; to discard them anyway pass oversized='drop'"
            )
        # Zephon's drop_oversized: first/best drop (True) or raise (False); the wrap kinds always split.
        alias = None if drop is None else ("drop" if drop else ("error" if alg in _WHOLE else "split"))
        if self.oversized is not None and self.oversized not in OVERSIZED:
            raise ValueError(f"{k}: oversized must be one of {', '.join(map(repr, OVERSIZED))}, got {self.oversized!r}")
        if alias is not None and self.oversized is not None and alias != self.oversized:
            raise ValueError(
                f"{k}: drop_oversized={drop} means oversized={alias!r} but oversized={self.oversized!r} was also "
                "given; pass only oversized="
            )
        return self.oversized or alias or ("drop" if alg in _WHOLE else "split")

    def _check_output(self) -> None:
        raise NotImplementedError

    def init(self, key: int) -> PackState:
        return PackState()

    # -- stepping -----------------------------------------------------------------------------------------
    def step(self, state: PackState, chunk: Sequence[Record]) -> tuple[PackState, list[Record]]:
        w = _Work(state, self.candidate_age)
        out: list[Record] = []
        place = getattr(self, "_place_" + self.algorithm)
        drop, counts = self.drop_fields, w.counts
        for rec in chunk:
            if drop and isinstance(rec.payload, dict):
                counts["dropped_field_values"] += sum(1 for name in drop if name in rec.payload)
            for piece in self._admit(self._normalize(rec), w):
                place(w, piece, out)
        return w.freeze(), out

    def flush(self, state: PackState) -> tuple[PackState, list[Record]]:
        w = _Work(state, self.candidate_age)
        out: list[Record] = []
        L, cap = self.max_length, self.max_sequences_per_bin
        for pieces, _ in w.bins:  # oldest first
            self._close(w, pieces, out)
        w.bins = []
        tail = [tuple(p) for p in w.stream[w.head :]]
        w.stream, w.head, w.avail = [], 0, 0
        if tail:
            if cap is None and self.flat and self.pad_token_id is None:
                w.counts["tail_dropped_tokens"] += sum(e - s for _, s, e in tail)
            else:
                self._close(w, tail, out)
        pool = w.pool
        while pool.total >= L or (cap is not None and len(pool) > cap):
            self._close(w, pool.build(L, cap), out)
        if len(pool):
            self._close(w, pool.drain(), out)
        return w.freeze(), out

    def _normalize(self, rec: Record) -> Record:
        """The input record without its ``drop_fields``, its token field and token-aligned fields as
        1-D numpy arrays, its other fields checked to be carriable per segment.

        Done once per document at the input (and when documents are rebuilt on restore), so
        lists from JSON travel with the tokens exactly as arrays do; a misaligned field, or one that
        cannot be carried, fails here, naming the record and the field.
        """
        segs = rec.meta.segments
        if len(segs) != 1 or segs[0].end != -1:
            raise ValueError(
                f"{self.kind}: inputs must be whole documents, but a record built from {len(segs)} segment(s) "
                f"{[tuple(s) for s in segs[:2]]} arrived; put {self.kind} before other packers"
            )
        payload = rec.payload
        field = find_token_field(payload, self.tokens_field, self.kind)
        ids = payload[field]
        drop = self.drop_fields
        if drop and field in drop:
            raise ValueError(
                f"{self.kind}: drop_fields names the token field {field!r}, which is what is packed; remove it "
                "from drop_fields (or filter such documents out before packing)"
            )
        if len(payload) == 1 and type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype.kind in "iu":
            return rec  # only its tokens, as an integer array (what tokenize emits): nothing to normalise
        if drop and any(name in payload for name in drop):
            payload = {k: v for k, v in payload.items() if k not in drop}
        where = describe_meta(rec.meta)
        payload, aligned = aligned_payload(payload, field, self.kind, where)
        if len(payload) > len(aligned):
            self._check_segment_fields(payload, aligned, where)
        return rec if payload is rec.payload else Record(payload, rec.meta)

    def _check_segment_fields(self, payload: dict, aligned: tuple[str, ...], where: str) -> None:
        """Refuse a field that is not token-aligned and cannot be carried with its segments."""
        for name, value in payload.items():
            if name in aligned:
                continue
            fix = (
                f"drop it explicitly with {self.kind}(..., drop_fields=({name!r},)) (counted in stats), or "
                f"convert it in a map() before {self.kind}"
            )
            if self.flat and (name in SEGMENT_KEYS or name == "segments"):
                raise ValueError(
                    f"{self.kind}: field {name!r} of {where} has a name that packed rows use for their segments "
                    f"(payload 'segments', each with {', '.join(map(repr, SEGMENT_KEYS))}); rename it in a map() "
                    f"before {self.kind}, or drop it explicitly with drop_fields=({name!r},)"
                )
            check_carried(name, value, self.kind, where, fix)

    def _inputs(self, upstream: Resolver) -> Resolver:
        return lambda metas: [self._normalize(r) for r in upstream(metas)]

    def _measure(self, rec: Record) -> int:
        return len(rec.payload[find_token_field(rec.payload, self.tokens_field, self.kind)])

    def _admit(self, rec: Record, w: _Work) -> list[Piece]:
        """The pieces of ``rec`` to pack, after the empty and oversized policies (all counted)."""
        n, L, c = self._measure(rec), self.max_length, w.counts
        if n == 0:
            c["empty_records"] += 1
            return []
        if n <= L:
            return [(rec, 0, n)]
        policy = self.oversized_policy
        if policy == "split":
            c["split_records"] += 1
            if self.algorithm == "wrap":
                return [(rec, 0, n)]  # the stream cuts it where the rows fall
            return [(rec, a, min(a + L, n)) for a in range(0, n, L)]
        if policy == "truncate":
            c["truncated_records"] += 1
            c["truncated_tokens"] += n - L
            return [(rec, 0, L)]
        if policy == "drop":
            c["oversized_dropped_records"] += 1
            c["oversized_dropped_tokens"] += n
            return []
        raise ValueError(
            f"{self.kind}: document {rec.meta.segments[0].sample} has {n} tokens, more than max_length={L}; "
            "pass oversized='split' (keep every token in max_length pieces), 'truncate' (keep the first "
            "max_length, count the rest) or 'drop' (count and skip it)"
        )

    def _full(self, pieces: list, used: int) -> bool:
        cap = self.max_sequences_per_bin
        return self.max_length - used < self.min_sequence_length or (cap is not None and len(pieces) >= cap)

    def _place_first_fit(self, w: _Work, piece: Piece, out: list) -> None:
        m = piece[2] - piece[1]
        for i, b in enumerate(w.bins):
            if self.max_length - b[1] >= m:
                self._add(w, i, piece, m, out)
                return
        self._open(w, piece, m, out)

    def _place_best_fit(self, w: _Work, piece: Piece, out: list) -> None:
        m, best, chosen = piece[2] - piece[1], self.max_length + 1, -1
        for i, b in enumerate(w.bins):
            room = self.max_length - b[1]
            if m <= room < best:  # strict: ties go to the first such bin
                best, chosen = room, i
        if chosen >= 0:
            self._add(w, chosen, piece, m, out)
        else:
            self._open(w, piece, m, out)

    def _add(self, w: _Work, i: int, piece: Piece, m: int, out: list) -> None:
        b = w.bins[i]
        b[0].append(piece)
        b[1] += m
        if self._full(b[0], b[1]):
            del w.bins[i]
            self._close(w, b[0], out)

    def _open(self, w: _Work, piece: Piece, m: int, out: list) -> None:
        if self._full([piece], m):
            self._close(w, [piece], out)  # full on its own: emitted without evicting another bin
            return
        while len(w.bins) >= self.num_bins:
            self._close(w, w.bins.pop(0)[0], out)  # evict the oldest open bin
        w.bins.append([[piece], m])

    def _place_wrap(self, w: _Work, piece: Piece, out: list) -> None:
        w.stream.append(list(piece))
        w.avail += piece[2] - piece[1]
        L, cap = self.max_length, self.max_sequences_per_bin
        stream = w.stream
        while w.avail >= L or (cap is not None and len(stream) - w.head >= cap):
            need, head, pieces = L, w.head, []
            limit = len(stream) - head if cap is None else min(len(stream) - head, cap)
            while need and len(pieces) < limit:
                item = stream[head]
                rec, s, e = item
                take = min(e - s, need)
                pieces.append((rec, s, s + take))
                need -= take
                if s + take == e:
                    head += 1
                else:
                    item[1] = s + take
            w.head = head
            w.avail -= L - need
            self._close(w, pieces, out)
        if w.head > 64:
            del stream[: w.head]
            w.head = 0

    def _place_best_fit_wrap(self, w: _Work, piece: Piece, out: list) -> None:
        rec, a, b = piece
        L, cap, pool = self.max_length, self.max_sequences_per_bin, w.pool
        if b - a == L:
            self._close(w, [piece], out)  # a full window goes out directly
            return
        pool.add(rec, a, b)
        while len(pool) >= self.pool_size and (pool.total >= L or (cap is not None and len(pool) >= cap)):
            self._close(w, pool.build(L, cap), out)

    def _close(self, w: _Work, pieces: list, out: list) -> None:
        used = 0
        for _, a, b in pieces:
            used += b - a
        padding = self.max_length - used if self.flat else 0
        out.append(self._row(pieces, pieces[0][0].meta.lane, padding))
        c = w.counts
        c["rows"] += 1
        c["tokens"] += used
        c["padding_tokens"] += padding

    # -- rows -----------------------------------------------------------------------------------------------
    def _row(self, pieces: Sequence[Piece], lane: int, padding: int) -> Record:
        """The output record of one bin; ``step``, ``flush`` and ``rebuild`` all build rows here."""
        segments = tuple(_ranged(rec.meta.segments[0], a, b) for rec, a, b in pieces)
        return Record(self._payload(pieces, padding), Meta(lane, segments, padding))

    def _payload(self, pieces: Sequence[Piece], padding: int) -> Any:
        raise NotImplementedError

    # -- checkpoints ----------------------------------------------------------------------------------------
    def rebuild(self, refs: Sequence[Meta], upstream: Resolver) -> list[Record]:
        for m in refs:
            if not m.segments:
                raise ValueError(f"{self.kind}: a row reference names no documents: {m!r}")
        wanted = list(dict.fromkeys(Meta(m.lane, (s._replace(start=0, end=-1),), 0) for m in refs for s in m.segments))
        docs = {r.meta.segments[0].sample: r for r in self._inputs(upstream)(wanted)}
        for m in refs:
            used = 0
            for i, s in enumerate(m.segments):
                self._check_range(docs[s.sample], s.start, s.end, f"row segment {i}")
                used += s.end - s.start
            padding = self.max_length - used if self.flat else 0
            if used > self.max_length or m.padding_length != padding:
                raise ValueError(
                    f"{self.kind}: a row reference covers {used} tokens with padding_length {m.padding_length}, but a row "
                    f"of max_length={self.max_length} covering {used} tokens has padding {padding}: {m!r}"
                )
        return [self._row([(docs[s.sample], s.start, s.end) for s in m.segments], m.lane, m.padding_length) for m in refs]

    def decode_state(self, data: Any, upstream: Resolver) -> PackState:
        """Inverse of ``encode_state``, refusing what ``step`` never leaves in a state.

        Refused: negative counters; open bins beyond ``num_bins`` or over ``max_length``; a wrap
        stream of ``max_length`` tokens or more (a row would have been emitted); work kept by an
        algorithm that keeps none of that kind; pool arrivals out of order or past ``arrivals``;
        and any piece whose token range is empty or past its document's tokens.
        """
        state = decode(data, PackState)
        for name in ("arrivals",) + _COUNTERS:
            if getattr(state, name) < 0:
                raise ValueError(f"field {name!r} must be an int >= 0, got {getattr(state, name)}")
        alg, L = self.algorithm, self.max_length
        pieces = [(f"bins[{i}][{j}]", p) for i, b in enumerate(state.bins) for j, p in enumerate(b)]
        pieces += [(f"{field}[{i}]", p) for field in ("stream", "pool") for i, p in enumerate(getattr(state, field))]
        for name, (_, start, end, *_) in pieces:
            if not 0 <= start < end:
                raise ValueError(f"field {name!r}: token range [{start}, {end}) is empty or negative")
        for name, kept in (("bins", alg in _WHOLE), ("stream", alg == "wrap"), ("pool", alg == "best_fit_wrap")):
            if getattr(state, name) and not kept:
                raise ValueError(f"field {name!r} must be empty: algorithm={alg!r} keeps no {name}")
        if self.num_bins is not None and len(state.bins) > self.num_bins:
            raise ValueError(f"field 'bins' holds {len(state.bins)} open bins, but num_bins={self.num_bins}")
        for i, b in enumerate(state.bins):
            if not b or sum(e - s for _, s, e in b) > L:
                raise ValueError(f"field 'bins[{i}]' must hold 1 to max_length={L} tokens, got {sum(e - s for _, s, e in b)}")
        if sum(e - s for _, s, e in state.stream) >= L:
            raise ValueError(f"field 'stream' holds {sum(e - s for _, s, e in state.stream)} tokens; a row is cut at max_length={L}")
        previous = 0
        for i, (_, _, _, arrival) in enumerate(state.pool):
            if not previous < arrival <= state.arrivals:
                raise ValueError(
                    f"field 'pool[{i}]' has arrival {arrival}; arrivals increase along the pool, up to 'arrivals' ({state.arrivals})"
                )
            previous = arrival
        state = resolve(state, self._inputs(upstream))
        resolved = [p for b in state.bins for p in b] + list(state.stream) + list(state.pool)
        for (name, _), (rec, start, end, *_) in zip(pieces, resolved):
            self._check_range(rec, start, end, f"field {name!r}")
        return state

    def _check_range(self, rec: Record, start: int, end: int, where: str) -> None:
        n = self._measure(rec)
        if not 0 <= start < end <= n:
            raise ValueError(
                f"{where}: token range [{start}, {end}) is outside {describe_meta(rec.meta)}, which has {n} tokens "
                "(a range is non-empty and inside its document)"
            )

    def report(self, state: PackState) -> dict[str, int]:
        """Counters: rows, real and padding tokens, and every token not emitted, by cause.

        ``dropped_tokens`` is the sum of the three causes (oversized drops, truncation cuts and
        an unpadded wrap remainder); input tokens = ``tokens + dropped_tokens + pending_tokens``.
        """
        pending = (
            sum(e - s for b in state.bins for _, s, e in b)
            + sum(e - s for _, s, e in state.stream)
            + sum(e - s for _, s, e, _ in state.pool)
        )
        return {
            "rows": state.rows,
            "tokens": state.tokens,
            "padding_tokens": state.padding_tokens,
            "dropped_tokens": state.oversized_dropped_tokens + state.truncated_tokens + state.tail_dropped_tokens,
            "dropped_empty_records": state.empty_records,
            "dropped_oversized_records": state.oversized_dropped_records,
            "dropped_oversized_tokens": state.oversized_dropped_tokens,
            "truncated_records": state.truncated_records,
            "truncated_tokens": state.truncated_tokens,
            "split_records": state.split_records,
            "dropped_tail_tokens": state.tail_dropped_tokens,
            "dropped_field_values": state.dropped_field_values,
            "pending_tokens": pending,
        }


_COMMON_DOC = """
    Algorithms (Zephon 0.2.0's semantics; Zephon defaults to ``first_fit``, zephon to ``wrap``):

    - ``first_fit``: each document goes into the first open bin with room for it, else into a new
      bin. Before a new bin opens while ``num_bins`` are open, the oldest open bin is emitted. A
      bin is emitted as soon as its free room drops below ``min_sequence_length`` (1: exactly
      full) or it holds ``max_sequences_per_bin`` documents; a document that fills a new bin on
      its own is emitted at once, evicting nothing.
    - ``best_fit``: the same, into the open bin with the least room that still fits (the first
      such bin on ties).
    - ``wrap``: one token stream, cut into consecutive rows of exactly ``max_length``; documents
      span rows. With ``max_sequences_per_bin`` (capped wrap) a row also closes when it holds
      that many pieces, short of ``max_length``.
    - ``best_fit_wrap``: a document first emits its full ``max_length`` windows directly; its
      remainder joins a pool of candidates. Once the pool holds ``candidate_pool_size``
      candidates and either ``max_length`` tokens or ``max_sequences_per_bin`` candidates, a
      row is built: candidates waiting more than ``max_candidate_age`` arrivals go first (oldest
      first, while they fit), then the largest candidate that fits (earliest on ties),
      repeatedly; if none fits, the shortest is split to fill the row exactly, cut from its tail
      when it starts its document and the gap is less than half of it, else from its head (at
      most one split per row, so a suffix may be emitted before its prefix).

    Nothing is flushed at chunk boundaries: open bins, the wrap remainder and the pool wait in the
    state, and only ``flush`` (the end of the data) closes them: open bins oldest first, full
    best_fit_wrap rows while possible, then one last partial row with everything left.

    Documents longer than ``max_length`` follow ``oversized``: ``"split"`` (first/best fit:
    ``max_length`` pieces, each its own item, the last one packed like any document; wrap: the
    stream cuts it; best_fit_wrap: full windows plus a candidate), ``"truncate"`` (keep the first
    ``max_length`` tokens), ``"drop"`` or ``"error"``. Defaults: ``"drop"`` for first/best fit
    (Zephon's ``drop_oversized=True``), ``"split"`` for the wrap kinds. Every dropped or cut token
    is counted in :meth:`report`; empty documents are counted too.
"""


@attrs.frozen
class PackFlat(_Packer):
    """Pack documents into flat training rows of exactly ``max_length`` tokens.

    Args:
        max_length: tokens per row (pack ``context + 1`` when labels are shifted for training).
        algorithm: ``"wrap"`` (default), ``"first_fit"``, ``"best_fit"`` or ``"best_fit_wrap"``.
        num_bins: open bins; required for first_fit/best_fit, not allowed otherwise.
        max_sequences_per_bin: the most pieces in a row (``None``: no limit).
        min_sequence_length: first/best fit emit a bin whose free room is below this.
        oversized: ``"split"``, ``"drop"``, ``"truncate"`` or ``"error"`` for documents longer
            than ``max_length``; ``None`` picks the algorithm's default.
        drop_oversized: Zephon's switch, kept as an alias: ``True`` is ``oversized="drop"``;
            ``False`` is ``"error"`` for first/best fit and ``"split"`` for the wrap kinds.
        candidate_pool_size: best_fit_wrap's pool size (default 1024).
        max_candidate_age: best_fit_wrap's age limit in arrivals (default ``8 * pool``).
        tokens_field: the token field, or ``"auto"`` (input_ids, tokens, token_ids, ids).
        pad_token_id: fills the token field of rows shorter than ``max_length``; required for
            first_fit, best_fit, best_fit_wrap and capped wrap. For uncapped wrap it only pads
            the final remainder at the end of the data (``None``: that remainder is dropped and
            counted as ``dropped_tail_tokens``).
        emit_positions: add int32 ``positions`` restarting at 0 at every piece and at the
            padding tail (document ids are ``cumsum(positions == 0) - 1``). With ``False``, a
            payload's own ``positions`` is packed like any token-aligned field.
        drop_fields: field names removed from every document before packing, counted in
            ``report()["dropped_field_values"]``: the one way to leave a field out.

    {common}

    Output: the token field and every other 1-D numeric field of the same length (``loss_mask``
    travels with its tokens), concatenated, padded with ``pad_token_id`` (other fields with 0);
    ``positions``; ``meta.padding_length`` (what ``to_training`` masks). When a document of the
    row has other fields (scalars, strings, arrays of another length such as ``pixel_values``),
    ``segments`` lists one dict per piece, in ``meta.segments`` order: ``{"start": offset in the
    row, "length": tokens, **the document's other fields}`` (a document without any gets only
    ``start`` and ``length``); a document split over rows has its fields in each of its rows.
    :func:`packing_info` gives a row's number of sequences, real tokens and efficiency.

    State: open bins, wrap remainder or candidate pool as ``(record, start, end)`` references
    plus counters; outputs depend only on the order of the lane's documents (not on chunking);
    restores exactly, segment fields included (they are rebuilt with their documents); per lane,
    so resharding moves states whole.

    Raises:
        ValueError: for settings that contradict each other (see each argument), an oversized
            document under ``oversized="error"``, missing or misaligned token fields, fields that
            differ between the documents of a row, an existing ``positions`` field, a pad value
            that does not fit the field's dtype, a field that does not pickle, a field named
            ``start``, ``length`` or ``segments`` (the names of the segments), or ``drop_fields``
            naming the token field.
        TypeError: ``drop_fields`` that is not a sequence of names.

    Examples:
        >>> import numpy as np
        >>> from zephon.testing import run
        >>> from zephon.types import Meta, Record, Segment
        >>> docs = [Record({"input_ids": np.arange(n)}, Meta(0, (Segment(0, 0, i, 0, 0, -1),)))
        ...         for i, n in enumerate([3, 5, 2, 7])]
        >>> op = PackFlat(8, algorithm="first_fit", num_bins=2, pad_token_id=0)
        >>> _, rows = run(op, [docs])
        >>> [[(s.row, s.end - s.start) for s in r.meta.segments] for r in rows]
        [[(0, 3), (1, 5)], [(2, 2)], [(3, 7)]]
        >>> rows[1].payload["positions"].tolist()
        [0, 1, 0, 1, 2, 3, 4, 5]
        >>> packing_info(rows[2])
        {'num_sequences': 1, 'total_length': 7, 'packing_efficiency': 0.875, 'padding_length': 1}
    """

    emit_positions: bool = config_field(default=True, kw_only=True)

    kind: ClassVar[str] = "pack_flat"
    flat: ClassVar[bool] = True

    def _check_output(self) -> None:
        if not isinstance(self.emit_positions, bool):
            raise ValueError(f"pack_flat: emit_positions must be True or False, got {self.emit_positions!r}")
        capped = self.max_sequences_per_bin is not None
        if self.pad_token_id is None and (self.algorithm != "wrap" or capped):
            why = "capped wrap closes rows short of" if self.algorithm == "wrap" else f"algorithm={self.algorithm!r} pads partial bins to"
            raise ValueError(
                f"pack_flat: {why} max_length, so pad_token_id is required (any id the model can embed: padding is "
                "masked by position through meta.padding_length); e.g. pad_token_id=0, or the tokenizer's pad/EOS id"
            )

    def _payload(self, pieces: Sequence[Piece], padding: int) -> dict[str, Any]:
        first = pieces[0][0].payload
        tfield = find_token_field(first, self.tokens_field, self.kind)
        if not padding and len(first) == 1:
            fast = self._tokens_only(pieces, tfield)
            if fast is not None:
                return fast
        skip = self.emit_positions  # with positions emitted, a payload's own positions is refused below
        keys = _aligned_keys(first, tfield, self.kind, skip_positions=skip)
        keyset = set(keys)
        columns: dict[str, list] = {k: [] for k in keys}
        fields: list[dict | None] = []  # per piece: its document's fields that are not token-aligned
        # Documents holding only their tokens (what tokenize emits) need no per-document checks.
        tokens_only = len(first) == 1
        for rec, a, b in pieces:
            p = rec.payload
            if tokens_only and len(p) == 1 and tfield in p:
                columns[tfield].append(np.asarray(p[tfield][a:b]))
                fields.append(None)
                continue
            if p is not first:
                other = _aligned_keys(p, find_token_field(p, self.tokens_field, self.kind), self.kind, skip_positions=skip)
                if set(other) != keyset:
                    raise ValueError(
                        f"pack_flat: documents in one row have different token-aligned fields: {sorted(keys)} vs "
                        f"{sorted(other)} (document {rec.meta.segments[0].pointer}); give every document the same fields"
                    )
            if self.emit_positions and "positions" in p:
                raise ValueError("pack_flat: payload already has 'positions'; rename it or pass emit_positions=False")
            for k in keys:
                columns[k].append(np.asarray(p[k][a:b]))
            fields.append({k: v for k, v in p.items() if k not in keyset} if len(p) > len(keys) else None)
        payload: dict[str, Any] = {}
        for k in keys:
            arr = np.concatenate(columns[k])
            if padding:
                fill = self.pad_token_id if k == tfield else 0
                if arr.dtype.kind in "iu" and not np.iinfo(arr.dtype).min <= fill <= np.iinfo(arr.dtype).max:
                    raise ValueError(
                        f"pack_flat: pad value {fill} does not fit field {k!r} of dtype {arr.dtype}; "
                        "choose a pad_token_id inside the dtype's range or widen the dtype"
                    )
                arr = np.concatenate([arr, np.full(padding, fill, dtype=arr.dtype)])
            payload[k] = arr
        if self.emit_positions:
            payload["positions"] = _positions([b - a for _, a, b in pieces] + ([padding] if padding else []))
        if any(fields):
            segments, offset = [], 0
            for (_, a, b), own in zip(pieces, fields):
                segments.append(segment_entry(offset, b - a, own or {}))
                offset += b - a
            payload["segments"] = segments
        return payload

    def _tokens_only(self, pieces: Sequence[Piece], tfield: str) -> dict[str, Any] | None:
        """The payload of a full row of documents holding only their tokens (what ``tokenize`` emits),
        or ``None`` when some document holds more (then the general path checks and aligns every field)."""
        parts = []
        for rec, a, b in pieces:
            p = rec.payload
            if len(p) != 1:
                return None
            ids = p.get(tfield)
            if ids is None:
                return None
            parts.append(ids[a:b])
        if not isinstance(parts[0], np.ndarray):
            return None
        payload = {tfield: np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])}
        if self.emit_positions:
            payload["positions"] = _positions([b - a for _, a, b in pieces])
        return payload


@attrs.frozen
class PackSequences(_Packer):
    """Pack documents into bins, emitted as envelopes ``{"packed_samples": [payload, ...]}``.

    Same arguments and algorithms as :class:`PackFlat` (``algorithm`` defaults to ``"wrap"``
    here too), without ``emit_positions``; ``pad_token_id`` is not allowed (envelopes are never
    padded). For users who build their own tensors; ``to_training`` takes ``pack_flat`` rows.

    {common}

    Output: one envelope per bin. A piece that covers its whole document is that document's
    payload unchanged (every field kept); a piece of a document is its payload with the token
    field and token-aligned fields sliced and every other field kept as it is. ``meta.segments``
    lists the pieces; ``padding_length`` is 0. ``drop_fields`` and the refusal of fields that do
    not pickle are as for :class:`PackFlat`. Unlike Zephon, uncapped wrap keeps its end-of-data
    remainder as a last, shorter envelope.

    State, restore and resharding: as :class:`PackFlat`.

    Examples:
        >>> import numpy as np
        >>> from zephon.testing import run
        >>> from zephon.types import Meta, Record, Segment
        >>> docs = [Record({"input_ids": np.arange(n), "id": i}, Meta(0, (Segment(0, 0, i, 0, 0, -1),)))
        ...         for i, n in enumerate([3, 5, 2])]
        >>> _, envs = run(PackSequences(4), [docs])
        >>> for env in envs:
        ...     print([(sorted(p), p["input_ids"].tolist()) for p in env.payload["packed_samples"]])
        [(['id', 'input_ids'], [0, 1, 2]), (['id', 'input_ids'], [0])]
        [(['id', 'input_ids'], [1, 2, 3, 4])]
        [(['id', 'input_ids'], [0, 1])]
    """

    kind: ClassVar[str] = "pack_sequences"
    flat: ClassVar[bool] = False

    def _check_output(self) -> None:
        if self.pad_token_id is not None:
            raise ValueError(
                "pack_sequences: pad_token_id does not apply: envelopes keep documents apart and are never padded; "
                "omit it, or use pack_flat for fixed-length padded rows"
            )

    def _payload(self, pieces: Sequence[Piece], padding: int) -> dict[str, Any]:
        samples = []
        for rec, a, b in pieces:
            p = rec.payload
            tfield = find_token_field(p, self.tokens_field, self.kind)
            if a == 0 and b == len(p[tfield]):
                samples.append(p)
            else:  # token-aligned fields sliced, every other field kept as it is
                aligned = set(_aligned_keys(p, tfield, self.kind, skip_positions=False))
                samples.append({k: _slice(v, a, b) if k in aligned else v for k, v in p.items()})
        return {"packed_samples": samples}


PackFlat.__doc__ = PackFlat.__doc__.replace("    {common}", _COMMON_DOC.strip("\n"))
PackSequences.__doc__ = PackSequences.__doc__.replace("    {common}", _COMMON_DOC.strip("\n"))


def packing_info(record: Record, max_length: int | None = None) -> dict[str, Any]:
    """Packing metadata of an output of ``pack_flat`` or ``pack_sequences``, read from its meta.

    Args:
        record: a packed row (or envelope).
        max_length: the packer's ``max_length``; for ``pack_flat`` rows it defaults to the row
            length (real tokens plus padding); ``pack_sequences`` envelopes need it.

    Returns:
        ``num_sequences`` (pieces), ``total_length`` (real tokens), ``packing_efficiency``
        (``total_length / max_length``) and ``padding_length`` (``None`` for envelopes), the
        fields of Zephon's ``_packing_metadata``.

    Raises:
        ValueError: for an envelope without ``max_length``, or a record that is not packed.
    """
    meta = record.meta
    if any(s.end < 0 for s in meta.segments):
        raise ValueError("packing_info: the record is not an output of pack_flat or pack_sequences (no token ranges)")
    envelope = isinstance(record.payload, dict) and "packed_samples" in record.payload
    total = meta.num_tokens
    if max_length is None:
        if envelope:
            raise ValueError("packing_info: pass max_length= for pack_sequences envelopes (they are not padded to it)")
        max_length = total + meta.padding_length
    return {
        "num_sequences": len(meta.segments),
        "total_length": total,
        "packing_efficiency": total / max_length,
        "padding_length": None if envelope else meta.padding_length,
    }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

