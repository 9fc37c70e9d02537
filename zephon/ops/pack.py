"""Packing: fit a lane's documents into rows of at most ``max_length`` tokens.

:class:`PackFlat` and :class:`PackSequences` share the engine of :mod:`zephon.ops.bins` and differ
in what a finished bin becomes: a fixed-length training row, or an envelope
``{"packed_samples": [payload, ...]}``. An output's meta (its pieces as segments and its
``padding_length``) is all :meth:`~PackFlat.rebuild` needs. See ``docs/guide/packing.md``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import attrs
import numpy as np

from ..core.operator import config_field
from ..training.fields import find_token_field, segment_entry
from ..core.records import Record
from .bins import ALGORITHMS, OVERSIZED, Packer, PackState, Piece
from .lengths import LengthSchedule

__all__ = ["ALGORITHMS", "OVERSIZED", "PackFlat", "PackSequences", "PackState", "packing_info"]

_ARANGE = np.arange(1 << 16, dtype=np.int32)


def _positions(lengths: Sequence[int]) -> np.ndarray:
    if not lengths:
        return np.zeros(0, np.int32)
    if max(lengths) <= len(_ARANGE):
        return np.concatenate([_ARANGE[:n] for n in lengths])
    return np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])


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


def _slice(value: Any, a: int, b: int) -> Any:
    part = value[a:b]
    return part.copy() if isinstance(part, np.ndarray) else part


@attrs.frozen
class PackFlat(Packer):
    """Pack documents into flat training rows of exactly ``max_length`` tokens.

    The algorithms, with worked examples, are in ``docs/guide/packing.md``. Only ``flush`` closes
    partial work; every dropped or cut token, and every empty document, is counted in :meth:`report`.

    Args:
        max_length: tokens per row (``context + 1`` for shifted labels), or a
            :class:`~zephon.LengthSchedule` (algorithm ``"wrap"``, with
            ``batch(tokens_per_microbatch=T)``; the remainder carries over at a switch).
        algorithm: ``"wrap"``, ``"first_fit"``, ``"best_fit"`` or ``"best_fit_wrap"``.
        num_bins: open bins; required for first_fit/best_fit, not allowed otherwise.
        max_sequences_per_bin: the most pieces in a row (``None``: no limit).
        min_sequence_length: first/best fit emit a bin whose free room is below this.
        oversized: a document longer than ``max_length``: ``"split"``, ``"truncate"``, ``"drop"``
            or ``"error"``; ``None``: ``"drop"`` for first/best fit, else ``"split"``.
        drop_oversized: an alias: ``True`` is ``oversized="drop"``; ``False`` is ``"error"`` for
            first/best fit and ``"split"`` for the wrap kinds.
        candidate_pool_size: best_fit_wrap's pool size (default 1024).
        max_candidate_age: best_fit_wrap's age limit in arrivals (default ``8 * pool``).
        tokens_field: the token field, or ``"auto"`` (input_ids, tokens, token_ids, ids).
        pad_token_id: fills rows shorter than ``max_length``; required but for uncapped wrap,
            where ``None`` drops the end-of-data remainder (counted as ``dropped_tail_tokens``).
        emit_positions: add int32 ``positions`` restarting at 0 at every piece and at the padding;
            ``False``: a payload's own ``positions`` is packed like any token-aligned field.
        drop_fields: fields removed from every document before packing, counted in
            ``report()["dropped_field_values"]``.
        tokens_per_microbatch: with a :class:`~zephon.LengthSchedule`, the tokens of a microbatch
            (placing each row in its step); a pipeline fills it from ``batch``.

    Output: the token field and every 1-D numeric field of its length, concatenated and padded
    with ``pad_token_id`` (other fields with 0); ``positions``; ``meta.padding_length``. Documents
    with other fields give ``segments``, a dict per piece: ``{"start", "length", **its fields}``.

    State: open bins, wrap remainder or candidate pool as ``(record, start, end)`` references
    plus counters; outputs depend only on the order of the lane's documents; restores exactly;
    reshards with its lane.

    Raises:
        ValueError: contradicting settings, an oversized document under ``oversized="error"``,
            missing or misaligned token fields, fields that differ between the documents of a
            row, an existing ``positions``, a pad value outside the field's dtype, a field that
            does not pickle or is named ``start``, ``length`` or ``segments``, or ``drop_fields``
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
    tokens_per_microbatch: int | None = config_field(default=None, kw_only=True, omit_default=True)

    kind: ClassVar[str] = "pack_flat"
    flat: ClassVar[bool] = True

    def _row_length(self, rows: int) -> int:
        schedule = self.max_length
        if not isinstance(schedule, LengthSchedule):
            return schedule
        if self.tokens_per_microbatch is None:
            raise ValueError(
                "pack_flat(max_length=LengthSchedule(...)) needs tokens_per_microbatch to know the step of each row: "
                "a pipeline fills it from batch(tokens_per_microbatch=T); pass tokens_per_microbatch=T when running "
                "the operator on its own"
            )
        return schedule.row_length(rows, self.tokens_per_microbatch)

    def _check_output(self) -> None:
        self._check_schedule()
        if not isinstance(self.emit_positions, bool):
            raise ValueError(f"pack_flat: emit_positions must be True or False, got {self.emit_positions!r}")
        capped = self.max_sequences_per_bin is not None
        if self.pad_token_id is None and (self.algorithm != "wrap" or capped):
            alg = self.algorithm
            why = "capped wrap closes rows short of" if alg == "wrap" else f"algorithm={alg!r} pads partial bins to"
            raise ValueError(
                f"pack_flat: {why} max_length, so pad_token_id is required (any id the model can embed: padding is "
                "masked by position through meta.padding_length); e.g. pad_token_id=0, or the tokenizer's pad/EOS id"
            )

    def _check_schedule(self) -> None:
        schedule, tokens = self.max_length, self.tokens_per_microbatch
        if not isinstance(schedule, LengthSchedule):
            if tokens is not None:
                raise ValueError(
                    "pack_flat: tokens_per_microbatch only applies with max_length=LengthSchedule(...); with a fixed "
                    "max_length leave it out (batch(tokens_per_microbatch=T) alone sets the rows per microbatch)"
                )
            return
        if self.algorithm != "wrap" or self.oversized_policy != "split":
            raise ValueError(
                f"pack_flat: max_length=LengthSchedule(...) needs algorithm='wrap' with oversized='split' (got "
                f"algorithm={self.algorithm!r}, oversized={self.oversized_policy!r}): the token stream is cut into "
                "rows of the step's length, and the remainder carries over to the next length unchanged; other "
                "algorithms keep bins of one length open. Use the defaults, or a fixed max_length"
            )
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"pack_flat: tokens_per_microbatch must be an int >= 1, got {tokens!r}")
            schedule.phases(tokens)

    def _payload(self, pieces: Sequence[Piece], padding: int) -> dict[str, Any]:
        first = pieces[0][0].payload
        tfield = find_token_field(first, self.tokens_field, self.kind)
        fields: list[dict | None] = []  # per piece: its document's fields that are not token-aligned
        parts = self._tokens_only(pieces, tfield) if len(first) == 1 else None
        if parts is not None and not padding:  # a full row of token-only documents (wrap's usual row)
            payload = {tfield: np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])}
            if self.emit_positions:
                payload["positions"] = _positions([b - a for _, a, b in pieces])
            return payload
        columns = {tfield: parts} if parts is not None else self._columns(pieces, first, tfield, fields)
        payload: dict[str, Any] = {}
        for k, column in columns.items():
            arr = np.concatenate(column) if len(column) > 1 else np.array(column[0])
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

    @staticmethod
    def _tokens_only(pieces: Sequence[Piece], tfield: str) -> list | None:
        """The token slices of a row of documents holding only their tokens (what tokenize emits: they
        need no per-document checks), or ``None`` when some document holds more."""
        parts = []
        for rec, a, b in pieces:
            p = rec.payload
            if len(p) != 1 or tfield not in p:
                return None
            parts.append(p[tfield][a:b])
        return parts

    def _columns(self, pieces: Sequence[Piece], first: dict, tfield: str, fields: list) -> dict[str, list]:
        """The token-aligned slices of every piece, checked to be the same fields in every document;
        ``fields`` gets each piece's other fields (``None``: none)."""
        skip = self.emit_positions  # with positions emitted, a payload's own positions is refused below
        keys = _aligned_keys(first, tfield, self.kind, skip_positions=skip)
        keyset = set(keys)
        columns: dict[str, list] = {k: [] for k in keys}
        for rec, a, b in pieces:
            p = rec.payload
            if p is not first:
                own = find_token_field(p, self.tokens_field, self.kind)
                other = _aligned_keys(p, own, self.kind, skip_positions=skip)
                if set(other) != keyset:
                    raise ValueError(
                        f"pack_flat: documents in one row have different token-aligned fields: {sorted(keys)} vs "
                        f"{sorted(other)} (document {rec.meta.segments[0].pointer}); give every document the same "
                        "fields"
                    )
            if self.emit_positions and "positions" in p:
                raise ValueError("pack_flat: payload already has 'positions'; rename it or pass emit_positions=False")
            for k in keys:
                columns[k].append(np.asarray(p[k][a:b]))
            fields.append({k: v for k, v in p.items() if k not in keyset} if len(p) > len(keys) else None)
        return columns


@attrs.frozen
class PackSequences(Packer):
    """Pack documents into bins, emitted as envelopes ``{"packed_samples": [payload, ...]}``.

    Same arguments, algorithms, state, restore and resharding as :class:`PackFlat`, without
    ``emit_positions`` and ``pad_token_id`` (envelopes are never padded); for users who build their
    own tensors (``to_training`` takes ``pack_flat`` rows). A piece of a whole document is its
    payload unchanged; a part has its token-aligned fields sliced, every other field kept.
    ``padding_length`` is 0; uncapped wrap emits its end-of-data remainder as a last envelope.

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
        if isinstance(self.max_length, LengthSchedule):
            raise ValueError(
                "pack_sequences: max_length must be an int; a LengthSchedule changes the length of pack_flat rows "
                "(use pack_flat(max_length=LengthSchedule(...)) with batch(tokens_per_microbatch=T))"
            )
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


def packing_info(record: Record, max_length: int | None = None) -> dict[str, Any]:
    """Packing metadata of a ``pack_flat`` row or ``pack_sequences`` envelope, read from its meta:
    ``num_sequences`` (pieces), ``total_length`` (real tokens), ``packing_efficiency``
    (``total_length / max_length``) and ``padding_length`` (``None`` for envelopes), the fields of
    Zephon's ``_packing_metadata``. ``max_length`` defaults to a row's length (tokens plus
    padding); envelopes need it. Raises ``ValueError`` for a record that is not packed.
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
