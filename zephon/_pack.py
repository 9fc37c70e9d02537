"""Packing: cut a lane's token stream into fixed-length rows.

``pack_flat(max_length, algorithm="wrap")`` concatenates the lane's documents and cuts rows of
exactly ``max_length`` tokens. Unlike packers that drop or pad at periodic flushes, no token is
lost mid-stream: the records not yet fully emitted stay in the state (by reference), so every
input token appears exactly once, in order. Only at the end of the data is the final partial row
padded (``pad_token_id`` given, ``padding_length`` recorded) or dropped and counted.

Each output row's meta lists its pieces as segments ``(dataset, shard, row, child, start, end)``,
which is also how checkpoints rebuild rows without storing tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

import attrs
import msgspec
import numpy as np

from ._core import Operator, Resolver, config_field
from ._records import Meta, Record, Segment

TOKEN_FIELDS = ("input_ids", "tokens", "token_ids", "ids")
_ARANGE = np.arange(1 << 16, dtype=np.int32)


def _positions(lengths: Sequence[int]) -> np.ndarray:
    if max(lengths) <= len(_ARANGE):
        return np.concatenate([_ARANGE[:n] for n in lengths]) if lengths else np.zeros(0, np.int32)
    return np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])


def token_field_of(payload: Any, tokens_field: str, where: str) -> str:
    """The name of the token field of ``payload`` (``"auto"``: the first of input_ids, tokens, token_ids, ids)."""
    if not isinstance(payload, dict):
        raise TypeError(f"{where}: payloads must be dicts with a token field, got {type(payload).__name__}")
    if tokens_field != "auto":
        if tokens_field not in payload:
            raise ValueError(
                f"{where}: token field {tokens_field!r} missing; payload keys are {sorted(payload)[:8]}; "
                "tokenize first or pass tokens_field="
            )
        return tokens_field
    for name in TOKEN_FIELDS:
        if name in payload:
            return name
    raise ValueError(
        f"{where}: no token field ({', '.join(TOKEN_FIELDS)}) in payload with keys {sorted(payload)[:8]}; "
        "put tokenize() before pack_flat() or pass tokens_field="
    )


class PackState(msgspec.Struct, frozen=True, tag="pack_flat", forbid_unknown_fields=True):
    """Records not yet fully emitted (``offset`` tokens of the first already are), and counters."""

    pending: tuple[Record, ...] = ()
    offset: int = 0
    rows: int = 0
    dropped_tokens: int = 0
    dropped_records: int = 0


@attrs.frozen
class PackFlat(Operator):
    """Pack documents into rows of exactly ``max_length`` tokens (the ``wrap`` algorithm).

    Args:
        max_length: tokens per row (pack ``context + 1`` when labels are shifted for training).
        algorithm: ``"wrap"``: concatenate and cut; documents may span rows.
        pad_token_id: pad the final partial row at the end of data with this id (its
            ``padding_length`` is recorded); ``None`` drops that remainder and counts it.
        emit_positions: add int32 ``positions`` that restart at 0 at every document start, at
            every row start, and at the padding tail.
        tokens_field: the token field, or ``"auto"`` (input_ids, tokens, token_ids, ids).

    Output payload: the token field, every other array field of the same length (``loss_mask``
    travels with its tokens; padded with 0), and ``positions``. State: the pending records (by
    reference) and the offset into the first; restores exactly; per lane.
    """

    max_length: int = config_field()
    algorithm: Literal["wrap"] = config_field(default="wrap")
    pad_token_id: int | None = config_field(default=None)
    emit_positions: bool = config_field(default=True)
    tokens_field: str = config_field(default="auto")

    kind: ClassVar[str] = "pack_flat"
    state_type: ClassVar[type] = PackState

    def __attrs_post_init__(self) -> None:
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"pack_flat: max_length must be an int >= 1, got {self.max_length!r}")
        if self.algorithm != "wrap":
            raise ValueError(
                f"pack_flat: unknown algorithm {self.algorithm!r}; available: 'wrap' "
                "(first_fit, best_fit and best_fit_wrap are separate packers)"
            )
        if self.pad_token_id is not None and (isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0):
            raise ValueError(f"pack_flat: pad_token_id must be a non-negative int or None, got {self.pad_token_id!r}")

    def init(self, key: int) -> PackState:
        return PackState()

    # -- stepping -------------------------------------------------------------------------------------
    def step(self, state: PackState, chunk: Sequence[Record]) -> tuple[PackState, list[Record]]:
        pending = list(state.pending)
        offset, rows, dropped_records = state.offset, state.rows, state.dropped_records
        avail = sum(self._length(r) for r in pending) - offset
        head = 0  # index of the first pending record still needed
        out: list[Record] = []
        L = self.max_length
        for rec in chunk:
            n = self._length(rec)
            if n == 0:
                dropped_records += 1
                continue
            pending.append(rec)
            avail += n
            while avail >= L:
                pieces, head, offset = self._take(pending, head, offset, L)
                out.append(self._build(pieces, rec.meta.lane, 0))
                avail -= L
                rows += 1
        return PackState(tuple(pending[head:]), offset, rows, state.dropped_tokens, dropped_records), out

    def flush(self, state: PackState) -> tuple[PackState, list[Record]]:
        avail = sum(self._length(r) for r in state.pending) - state.offset
        if avail == 0:
            return state, []
        if self.pad_token_id is None:
            return PackState((), 0, state.rows, state.dropped_tokens + avail, state.dropped_records), []
        pieces, _, _ = self._take(list(state.pending), 0, state.offset, avail)
        row = self._build(pieces, state.pending[0].meta.lane, self.max_length - avail)
        return PackState((), 0, state.rows + 1, state.dropped_tokens, state.dropped_records), [row]

    def _length(self, rec: Record) -> int:
        field = token_field_of(rec.payload, self.tokens_field, "pack_flat")
        if len(rec.meta.segments) != 1 or rec.meta.segments[0].end != -1:
            raise ValueError(
                "pack_flat: inputs must be whole documents, but a record built from "
                f"{len(rec.meta.segments)} segment(s) arrived; put pack_flat before other packers"
            )
        return len(rec.payload[field])

    def _take(self, pending: list[Record], head: int, offset: int, need: int):
        pieces = []
        while need:
            rec = pending[head]
            n = self._length(rec) - offset
            take = min(n, need)
            pieces.append((rec, offset, offset + take))
            need -= take
            if take == n:
                head, offset = head + 1, 0
            else:
                offset += take
        return pieces, head, offset

    def _build(self, pieces: list[tuple[Record, int, int]], lane: int, padding: int) -> Record:
        first = pieces[0][0].payload
        tfield = token_field_of(first, self.tokens_field, "pack_flat")
        keys = _aligned_keys(first, tfield)
        payload: dict[str, Any] = {}
        for key in keys:
            parts = []
            for rec, a, b in pieces:
                value = rec.payload.get(key)
                if value is None or set(_aligned_keys(rec.payload, tfield)) != set(keys):
                    raise ValueError(
                        f"pack_flat: records in one row have different fields: {sorted(keys)} vs "
                        f"{sorted(_aligned_keys(rec.payload, tfield))} (record {rec.meta.segments[0].pointer}); "
                        "give every record the same token-aligned fields"
                    )
                parts.append(np.asarray(value)[a:b])
            arr = np.concatenate(parts)
            if padding:
                fill = self.pad_token_id if key == tfield else 0
                info = np.iinfo(arr.dtype) if arr.dtype.kind in "iu" else None
                if info is not None and not info.min <= fill <= info.max:
                    raise ValueError(f"pack_flat: pad value {fill} does not fit field {key!r} of dtype {arr.dtype}")
                arr = np.concatenate([arr, np.full(padding, fill, dtype=arr.dtype)])
            payload[key] = arr
        if self.emit_positions:
            if "positions" in first:
                raise ValueError("pack_flat: payload already has 'positions'; pass emit_positions=False")
            lengths = [b - a for _, a, b in pieces] + ([padding] if padding else [])
            payload["positions"] = _positions(lengths)
        segments = tuple(rec.meta.segments[0]._replace(start=a, end=b) for rec, a, b in pieces)
        return Record(payload, Meta(lane, segments, padding))

    # -- checkpoints ------------------------------------------------------------------------------------
    def rebuild(self, refs: Sequence[Meta], upstream: Resolver) -> list[Record]:
        wanted = list(dict.fromkeys(Meta(m.lane, (s._replace(start=0, end=-1),), 0) for m in refs for s in m.segments))
        docs = {r.meta.segments[0].sample: r for r in upstream(wanted)}
        out = []
        for m in refs:
            pieces = [(docs[s.sample], s.start, s.end) for s in m.segments]
            out.append(self._build(pieces, m.lane, m.padding_length))
        return out

    def report(self, state: PackState) -> dict[str, int]:
        return {
            "rows": state.rows,
            "dropped_tokens": state.dropped_tokens,
            "dropped_empty_records": state.dropped_records,
            "pending_tokens": sum(self._length(r) for r in state.pending) - state.offset,
        }


def _aligned_keys(payload: dict, tfield: str) -> list[str]:
    n = len(payload[tfield])
    keys = [tfield]
    for k, v in payload.items():
        if k == tfield or k == "positions":
            continue
        if isinstance(v, np.ndarray) and v.ndim == 1 and len(v) == n:
            keys.append(k)
        elif isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) != n and k in ("loss_mask", "labels", "attention_mask"):
            raise ValueError(f"pack_flat: field {k!r} has length {len(v)} but the tokens have {n}; align it with the tokens")
    return keys
