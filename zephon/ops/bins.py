"""The packing engine of ``pack_flat`` and ``pack_sequences`` (:mod:`zephon.ops.pack`): which tokens share a bin.

Open bins, the wrap remainder and the best_fit_wrap candidate pool stay in the state *by reference*
(records and token ranges, never token arrays), so nothing depends on where the stream is cut into
chunks; only ``flush`` (the end of the data) closes partial bins. Every token not emitted is counted.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

import attrs
import msgspec
import numpy as np

from ..core.operator import Operator, Resolver, config_field, nonnegative
from ..core.state import decode, resolve
from ..training.fields import SEGMENT_KEYS, aligned_payload, check_carried, find_token_field, unique_names
from ..core.records import Meta, Record, Segment, describe_meta
from .candidates import Pool, Piece, length_of as _length
from .lengths import LengthSchedule, is_int

#: The packing algorithms, as Zephon names them.
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
#: What to do with a document longer than ``max_length``.
OVERSIZED = ("split", "drop", "truncate", "error")
_WHOLE = ("first_fit", "best_fit")  # keep documents whole in open bins
_new_tuple = tuple.__new__


def _check_int(op: str, name: str, value: Any, low: int, none: str = "") -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{op}: {name} must be an int >= {low}{none}, got {value!r}")


def _field_names(value: Any) -> Any:
    """``drop_fields`` as a tuple of names (``None``: none); anything else is left for the check."""
    return () if value is None else unique_names(value)


def _length_value(value: Any) -> Any:
    """``max_length``: an int, or ``[[step, length], ...]`` (a config document's schedule) as a LengthSchedule."""
    return LengthSchedule(value) if isinstance(value, (list, tuple)) else value


def _ranged(seg: Segment, start: int, end: int) -> Segment:
    """``seg._replace(start=start, end=end)``, without the keyword machinery (once per piece of a row)."""
    return _new_tuple(Segment, (seg[0], seg[1], seg[2], seg[3], start, end))


class PackState(msgspec.Struct, frozen=True, tag="pack", forbid_unknown_fields=True):
    """Open work (documents by reference, with token ranges) and counters.

    Attributes:
        bins: first_fit/best_fit open bins, oldest first; each a tuple of ``(record, start, end)``.
        stream: wrap's pending pieces in order (the first may start mid-document).
        pool: best_fit_wrap candidates ``(record, start, end, arrival)`` in arrival order.
        arrivals: best_fit_wrap's count of candidates ever added (ages are measured in it).
        rows, tokens, padding_tokens: outputs emitted, their real tokens and their padding.
        empty_records, oversized_*, truncated_*, split_records: documents (and tokens) per policy.
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


def _pieces(state: PackState) -> list[tuple]:
    """Every piece a state holds: open bins, then the wrap stream, then the pool."""
    return [p for b in state.bins for p in b] + list(state.stream) + list(state.pool)


class _Work:
    """The mutable working copy of a :class:`PackState` during one ``step`` or ``flush``."""

    __slots__ = ("bins", "stream", "head", "avail", "pool", "counts")

    def __init__(self, state: PackState, max_age: int):
        self.bins = [[list(b), _length(b)] for b in state.bins]
        self.stream = [list(p) for p in state.stream]
        self.head = 0
        self.avail = _length(state.stream)
        self.pool = Pool(state.pool, state.arrivals, max_age)
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
class Packer(Operator):
    """The engine of :class:`~zephon.ops.pack.PackFlat` and :class:`~zephon.ops.pack.PackSequences`.

    Subclasses set ``kind`` and ``flat`` and give ``_check_output()`` (their own settings) and
    ``_payload(pieces, padding)`` (what a finished bin becomes).
    """

    max_length: int | LengthSchedule = config_field(converter=_length_value)
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

    def __attrs_post_init__(self) -> None:
        k, alg = self.kind, self.algorithm
        if not isinstance(self.max_length, LengthSchedule):
            _check_int(k, "max_length", self.max_length, 1)
        if alg not in ALGORITHMS:
            raise ValueError(f"{k}: unknown algorithm {alg!r}; choose one of {', '.join(map(repr, ALGORITHMS))}")
        if alg in _WHOLE:
            if self.num_bins is None:
                raise ValueError(
                    f"{k}: algorithm={alg!r} needs num_bins, how many bins stay open at once (more bins pack "
                    f"tighter and hold more documents in the state); e.g. {k}({self.max_length}, algorithm={alg!r}, "
                    "num_bins=8, ...)"
                )
            _check_int(k, "num_bins", self.num_bins, 1)
        elif self.num_bins is not None:
            raise ValueError(
                f"{k}: num_bins does not apply to algorithm={alg!r}, which keeps no open bins; omit num_bins "
                "(or use algorithm='first_fit'/'best_fit')"
            )
        if self.max_sequences_per_bin is not None:
            _check_int(k, "max_sequences_per_bin", self.max_sequences_per_bin, 1, " or None")
        _check_int(k, "min_sequence_length", self.min_sequence_length, 0)
        if alg not in _WHOLE and self.min_sequence_length != 1:
            raise ValueError(
                f"{k}: min_sequence_length only applies to first_fit/best_fit (a bin closes once its free room drops "
                f"below it); algorithm={alg!r} fills rows exactly, so leave it at 1"
            )
        if alg == "best_fit_wrap":
            _check_int(k, "candidate_pool_size", self.pool_size, 1)
            _check_int(k, "max_candidate_age", self.candidate_age, 1)
        else:
            for name in ("candidate_pool_size", "max_candidate_age"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{k}: {name} only applies to algorithm='best_fit_wrap'; omit it for {alg!r}")
        self._resolve_oversized()
        if not isinstance(self.tokens_field, str) or not self.tokens_field:
            raise ValueError(f"{k}: tokens_field must be a field name or 'auto', got {self.tokens_field!r}")
        pad = self.pad_token_id
        if pad is not None and (not is_int(pad) or pad < 0):
            raise ValueError(f"{k}: pad_token_id must be a non-negative int or None, got {pad!r}")
        drop = self.drop_fields
        if isinstance(drop, str) or not isinstance(drop, tuple) or not all(isinstance(n, str) and n for n in drop):
            example = f"({drop!r},)" if isinstance(drop, str) else "('source',)"
            raise TypeError(
                f"{k}: drop_fields must be a sequence of field names, e.g. drop_fields={example}; got {drop!r}"
            )
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

    def init(self, key: int) -> PackState:
        return PackState()

    def _row_length(self, rows: int) -> int:
        """The length of the lane's row that follows ``rows`` emitted rows: ``max_length``."""
        return self.max_length

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
        L, cap = self._row_length(w.counts["rows"]), self.max_sequences_per_bin
        for pieces, _ in w.bins:  # oldest first
            self._close(w, pieces, out)
        w.bins = []
        tail = [tuple(p) for p in w.stream[w.head :]]
        w.stream, w.head, w.avail = [], 0, 0
        if tail:
            if cap is None and self.flat and self.pad_token_id is None:
                w.counts["tail_dropped_tokens"] += _length(tail)
            else:
                self._close(w, tail, out)
        pool = w.pool
        while pool.total >= L or (cap is not None and len(pool) > cap):
            self._close(w, pool.build(L, cap), out)
        if len(pool):
            self._close(w, list(pool.live.values()), out)
            pool.live.clear()  # all that ``freeze`` reads
        return w.freeze(), out

    def _normalize(self, rec: Record) -> Record:
        """The input record without its ``drop_fields``, its token field and token-aligned fields as
        1-D numpy arrays (lists from JSON travel as arrays do), its other fields checked to be
        carriable per segment. Done once per document at the input and on restore."""
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
        n, c = self._measure(rec), w.counts
        L = self._row_length(c["rows"])
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
        cap, stream = self.max_sequences_per_bin, w.stream
        while True:
            L = self._row_length(w.counts["rows"])  # a length schedule may change it from one row to the next
            if not (w.avail >= L or (cap is not None and len(stream) - w.head >= cap)):
                break
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
        padding = self._row_length(w.counts["rows"]) - used if self.flat else 0
        out.append(self._row(pieces, pieces[0][0].meta.lane, padding))
        c = w.counts
        c["rows"] += 1
        c["tokens"] += used
        c["padding_tokens"] += padding

    def _row(self, pieces: Sequence[Piece], lane: int, padding: int) -> Record:
        """The output record of one bin; ``step``, ``flush`` and ``rebuild`` all build rows here."""
        segments = tuple(_ranged(rec.meta.segments[0], a, b) for rec, a, b in pieces)
        return Record(self._payload(pieces, padding), Meta(lane, segments, padding))

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
            lengths = getattr(self.max_length, "lengths", (self.max_length,))
            fits = used + m.padding_length in lengths if self.flat else used <= self.max_length and not m.padding_length
            if not fits or m.padding_length < 0:
                raise ValueError(
                    f"{self.kind}: a row reference covers {used} tokens with padding_length {m.padding_length}, but "
                    f"rows of max_length={self.max_length} are {'padded to' if self.flat else 'at most'} that: {m!r}"
                )
        rows = [[(docs[s.sample], s.start, s.end) for s in m.segments] for m in refs]
        return [self._row(pieces, m.lane, m.padding_length) for pieces, m in zip(rows, refs)]

    def decode_state(self, data: Any, upstream: Resolver) -> PackState:
        """Inverse of ``encode_state``, refusing what ``step`` never leaves in a state: negative
        counters; open bins beyond ``num_bins`` or over ``max_length``; a wrap stream of
        ``max_length`` tokens or more; work of a kind the algorithm keeps none of; pool arrivals out
        of order or past ``arrivals``; a piece whose token range is empty or past its document."""
        state = decode(data, PackState)
        nonnegative(state, ("arrivals",) + _COUNTERS)
        alg, L = self.algorithm, self._row_length(state.rows)
        names = [f"bins[{i}][{j}]" for i, b in enumerate(state.bins) for j in range(len(b))]
        names += [f"{field}[{i}]" for field in ("stream", "pool") for i in range(len(getattr(state, field)))]
        for name, (_, start, end, *_) in zip(names, _pieces(state)):
            if not 0 <= start < end:
                raise ValueError(f"field {name!r}: token range [{start}, {end}) is empty or negative")
        for name, kept in (("bins", alg in _WHOLE), ("stream", alg == "wrap"), ("pool", alg == "best_fit_wrap")):
            if getattr(state, name) and not kept:
                raise ValueError(f"field {name!r} must be empty: algorithm={alg!r} keeps no {name}")
        if self.num_bins is not None and len(state.bins) > self.num_bins:
            raise ValueError(f"field 'bins' holds {len(state.bins)} open bins, but num_bins={self.num_bins}")
        for i, b in enumerate(state.bins):
            if not b or _length(b) > L:
                raise ValueError(f"field 'bins[{i}]' must hold 1 to max_length={L} tokens, got {_length(b)}")
        if _length(state.stream) >= L:
            raise ValueError(f"field 'stream' holds {_length(state.stream)} tokens; a row is cut at max_length={L}")
        arrivals = [0] + [arrival for *_, arrival in state.pool]
        for i, (previous, arrival) in enumerate(zip(arrivals, arrivals[1:])):
            if not previous < arrival <= state.arrivals:
                raise ValueError(
                    f"field 'pool[{i}]' has arrival {arrival}; arrivals increase along the pool, up to 'arrivals' "
                    f"({state.arrivals})"
                )
        state = resolve(state, self._inputs(upstream))
        for name, (rec, start, end, *_) in zip(names, _pieces(state)):
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
            "pending_tokens": _length(_pieces(state)),
        }
