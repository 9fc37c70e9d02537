"""The rows of a batch, gathered and checked (errors name the record and field), laid into
``[B, T]`` buffers, and converted into the output framework by :class:`_Output`. Stateless.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, NamedTuple, Sequence

import attrs
import numpy as np

from .fields import SEGMENT_KEYS, TOKEN_FIELDS, check_carried, is_aligned, segment_entry

_INT32_MAX = 2**31 - 1


class _Rows(NamedTuple):
    """Per record, the 1-D rows of the output's fields (``None``: the field is absent)."""

    tokens: list
    texts: list
    positions: list | None
    loss_mask: list | None
    extras: dict


def _gather(records: Sequence[Any], tokens_field: str, extras: Sequence[str], *, need_positions: bool) -> _Rows:
    """Per-record 1-D numpy rows of every field the output needs, validated and named in errors."""
    payloads = [r.payload for r in records]
    first = payloads[0]
    if not isinstance(first, dict):
        if not hasattr(first, "shape"):
            raise TypeError(
                f"to_training: expects dict or array-like (numpy/torch) payloads, got {type(first).__name__} "
                "in record 0"
            )
        for i, p in enumerate(payloads):
            if isinstance(p, dict) or not hasattr(p, "shape"):
                raise TypeError(
                    f"to_training: mixed payload types: record 0 is an array but record {i} is "
                    f"{type(p).__name__}; a batch must be all dicts or all arrays"
                )
        if extras:
            raise ValueError(
                f"to_training: extra_fields {list(extras)} need dict payloads, but the records are bare arrays"
            )
        tokens = [_tokens_row(p, i, "payload") for i, p in enumerate(payloads)]
        return _Rows(tokens, [""] * len(payloads), None, None, {})

    for i, p in enumerate(payloads):
        if not isinstance(p, dict):
            raise TypeError(
                f"to_training: mixed payload types: record 0 is a dict but record {i} is {type(p).__name__}; "
                "a batch must be all dicts or all arrays"
            )
    field = _token_field(first, tokens_field)
    tokens = []
    for i, p in enumerate(payloads):
        if field not in p:
            raise ValueError(
                f"to_training: record {i}: token field {field!r} not found in payload (keys {sorted(p)[:8]}); "
                "every record needs the same token field"
            )
        tokens.append(_tokens_row(p[field], i, field))
    texts = [str(p.get("text", "")) for p in payloads]

    def column(name: str) -> list[np.ndarray]:
        rows = []
        for i, (p, t) in enumerate(zip(payloads, tokens)):
            if name not in p:  # only an extra field: _present has checked the others
                raise ValueError(
                    f"to_training: record {i}: extra field {name!r} not found in payload (keys {sorted(p)[:8]})"
                )
            rows.append(_aligned_row(p[name], i, name, field, len(t)))
        return rows

    positions = None
    if _present(payloads, "positions", "pack every record with pack_flat(emit_positions=True)") and need_positions:
        positions = column("positions")
    loss_mask = None
    if _present(payloads, "loss_mask", "give every record a loss_mask (tokenize_chat emits one)"):
        loss_mask = [row != 0 for row in column("loss_mask")]
    # positions are handled above, at their slot of the output
    extra_rows = {name: column(name) for name in extras if name != "positions"}
    return _Rows(tokens, texts, positions, loss_mask, extra_rows)


#: Payload fields of a plain record that the output already holds (so they are not segment fields).
_CONSUMED = frozenset({"text", "positions", "loss_mask"})


def _segments(records: Sequence[Any], tokens_field: str, n: np.ndarray, pad_len: np.ndarray, left: np.ndarray) -> list | None:
    """Per record, one dict per segment: ``start`` (in the output row, before the label shift),
    ``length`` and its document's fields that are not token-aligned (copied); ``None`` when no
    record carries such fields. A packed row's segments are its ``payload["segments"]`` (as
    ``pack_flat`` writes them); a plain record is one segment of the payload fields that the
    output does not otherwise hold.
    """
    first = records[0].payload
    if not isinstance(first, dict):
        return None
    field = _token_field(first, tokens_field)
    found: list[tuple[bool, Any]] = []  # per record: (packed, its segments' dicts or its fields)
    for i, rec in enumerate(records):
        p, segs = rec.payload, rec.meta.segments
        if segs and all(s.end >= 0 for s in segs):
            own = p.get("segments")
            if own is not None and not (
                isinstance(own, list) and len(own) == len(segs) and all(isinstance(d, dict) and "start" in d and "length" in d for d in own)
            ):
                raise ValueError(
                    f"to_training: record {i}: payload 'segments' must list one dict per meta segment "
                    f"({len(segs)}), as pack_flat writes it; got {type(own).__name__}"
                )
            found.append((True, own))
        else:
            found.append((False, _record_fields(p, field, int(n[i]), i)))
    if not any(v for _, v in found):
        return None
    out = []
    for i, (rec, (packed, value)) in enumerate(zip(records, found)):
        a = int(left[i])
        if not packed:
            out.append([segment_entry(a, int(n[i] - pad_len[i]), value, copy=True)])
        elif value is not None:
            out.append([
                segment_entry(a + d["start"], d["length"], {k: v for k, v in d.items() if k not in SEGMENT_KEYS}, copy=True)
                for d in value
            ])
        else:  # a packed row of documents without fields: offsets only
            row = []
            for s in rec.meta.segments:
                row.append(segment_entry(a, s.end - s.start, {}))
                a += s.end - s.start
            out.append(row)
    return out


def _record_fields(payload: dict, field: str, length: int, i: int) -> dict:
    """The fields of a plain record that are not token-aligned (and not otherwise in the output)."""
    fields = {}
    for name, value in payload.items():
        if name == field or name in _CONSUMED or is_aligned(value, length):
            continue
        if name in SEGMENT_KEYS:
            raise ValueError(
                f"to_training: record {i}: field {name!r} has a name that output segments use "
                f"({', '.join(map(repr, SEGMENT_KEYS))}); rename or drop it in a map() before batching"
            )
        check_carried(name, value, "to_training", f"record {i}", "drop or convert it in a map() before batching")
        fields[name] = value
    return fields


def _token_field(payload: dict, tokens_field: str) -> str:
    if tokens_field != "auto":
        return tokens_field
    for name in TOKEN_FIELDS:
        if name in payload and hasattr(payload[name], "__len__"):
            return name
    hint = ""
    if "packed_samples" in payload:
        hint = (
            " This is a pack_sequences envelope (a list of documents), which cannot be converted: use pack_flat, "
            "or build tensors from the documents yourself."
        )
    raise ValueError(
        f"to_training: cannot auto-detect the token field: record 0 has keys {sorted(payload)[:8]}; expected one of "
        f"{', '.join(TOKEN_FIELDS)}, or pass tokens_field=.{hint}"
    )


def _present(payloads: list[dict], name: str, fix: str) -> bool:
    has = [name in p for p in payloads]
    if any(has) and not all(has):
        i = has.index(False)
        raise ValueError(f"to_training: {name!r} present in some payloads but missing in record {i}; {fix}")
    return has[0]


def _tokens_row(value: Any, i: int, field: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(
            f"to_training: record {i}: token field {field!r} must be 1-D, got shape {arr.shape}; "
            "to_training requires 2-D input_ids (one row per record)"
        )
    if arr.dtype.kind not in "iu" and arr.size:
        raise ValueError(
            f"to_training: record {i}: token field {field!r} holds {arr.dtype} values; token ids must be integers"
        )
    return arr


def _aligned_row(value: Any, i: int, name: str, field: str, length: int) -> np.ndarray:
    # An empty JSON list has no element type (numpy says float64); it must not turn its column to floats.
    arr = np.zeros(0, np.int64) if isinstance(value, (list, tuple)) and not value else np.asarray(value)
    if arr.ndim != 1 or len(arr) != length:
        got = f"length {len(arr)}" if arr.ndim == 1 else f"shape {arr.shape}"
        raise ValueError(
            f"to_training: record {i}: {name!r} {got} does not match {field!r} length {length}; "
            f"{name!r} must be a sequence with one entry per token"
        )
    return arr


def _fill(rows: list[np.ndarray], B: int, T: int, left: np.ndarray, fill: int, dtype: Any) -> np.ndarray:
    """Rows copied into one contiguous ``[B, T]`` buffer at their offsets; other slots hold ``fill``."""
    if dtype is None:
        dtype = np.result_type(*[r.dtype for r in rows]) if rows else np.int64
    full = all(len(r) == T for r in rows)  # then every offset is 0
    out = np.empty((B, T), dtype=dtype) if full else np.full((B, T), fill, dtype=dtype)
    for i, r in enumerate(rows):
        a = int(left[i])
        out[i, a : a + len(r)] = r
    return out


def _cu_seqlens(starts: np.ndarray, flatten: bool) -> tuple[np.ndarray, Any]:
    """int32 cumulative boundaries and maxima from a ``[B, W]`` bool matrix of segment starts."""
    B, W = starts.shape
    if (B * W if flatten else W) > _INT32_MAX:
        raise ValueError("to_training: cumulative sequence lengths exceed the int32 range; use shorter rows")
    if flatten:
        cu = np.append(np.flatnonzero(starts.reshape(-1)), B * W).astype(np.int32)
        return cu, int(np.diff(cu).max(initial=0))
    rows, columns = np.nonzero(starts)
    counts = starts.sum(axis=1)
    cu = np.full((B, int(counts.max(initial=0)) + 1), W, dtype=np.int32)
    offsets = np.cumsum(counts) - counts
    cu[rows, np.arange(len(rows)) - offsets[rows]] = columns
    return cu, np.diff(cu, axis=1).max(axis=1, initial=0).astype(np.int32)


@attrs.frozen
class _Output:
    """The output framework (``"list"``, ``"numpy"`` or ``"torch"``) and the conversion into it.

    ``np_dtype``: the numpy dtype of sequence fields (``None``: keep their own, and apply a torch
    dtype without a numpy twin, such as bfloat16, in torch).
    """

    kind: str
    np_dtype: np.dtype | None = None
    torch_dtype: Any = None

    @classmethod
    def of(cls, dtype: Any) -> _Output:
        if dtype is None:
            return cls("list")
        if isinstance(dtype, str) and dtype == "auto":
            try:
                import torch
            except ImportError:
                return cls("numpy", np.dtype(np.int64))
            return cls("torch", np.dtype(np.int64), torch.long)
        if type(dtype).__module__ == "torch":
            import torch

            try:
                np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy twin: convert in torch
                np_dtype = None
            return cls("torch", np_dtype, dtype)
        try:
            return cls("numpy", np.dtype(dtype))
        except TypeError:
            raise ValueError(
                f"to_training: dtype must be 'auto', None, a numpy dtype or a torch dtype, got {dtype!r}"
            ) from None

    def convert(self, arr: np.ndarray, kind: str, name: str) -> Any:
        if kind == "float":
            arr = arr.astype(np.float32)
        elif kind == "int":  # indices (document ids): int64 whatever dtype, as -1 marks padding
            arr = np.ascontiguousarray(arr, dtype=np.int64)
        elif kind == "bool":
            arr = np.ascontiguousarray(arr)
        elif arr.dtype == np.bool_ and self.np_dtype is None:
            arr = arr.astype(np.int64)  # masks as 0/1 ints, like every sequence field
        elif self.np_dtype is not None:
            if self.np_dtype.kind in "iu" and self.np_dtype != np.int64 and arr.size:
                info = np.iinfo(self.np_dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"to_training: field {name!r} holds values in [{lo}, {hi}] that do not fit dtype "
                        f"{self.np_dtype}; pass a wider dtype (the default is int64)"
                    )
            arr = np.ascontiguousarray(arr, dtype=self.np_dtype)
        else:
            arr = np.ascontiguousarray(arr)
        out = self.wrap(arr)
        if self.kind == "torch" and kind == "seq" and self.np_dtype is None:
            out = out.to(self.torch_dtype)
        return out

    def wrap(self, arr: np.ndarray) -> Any:
        """``arr`` as this output's kind: a list, the array itself, or a tensor sharing its memory."""
        if self.kind == "list":
            return arr.tolist()
        if self.kind == "numpy":
            return arr
        import torch

        return torch.from_numpy(arr)


#: Output keys that only some batches have (``positions`` when the records carry them, ``segments`` when
#: they carry non-token fields): renaming one that a batch lacks is not an error.
DATA_DEPENDENT_KEYS = frozenset({"positions", "segments"})


def _rename_and_exclude(
    result: dict[str, Any], rename_fields: Mapping[str, str], exclude_fields: Sequence[str], *, allow_missing: bool
) -> dict[str, Any]:
    """Rename emitted keys (swaps allowed, collisions rejected before exclusion), then drop excluded ones."""
    if rename_fields:
        missing = [k for k in rename_fields if k not in result and k not in DATA_DEPENDENT_KEYS]
        if missing and not allow_missing:
            raise ValueError(
                f"to_training: rename_fields source keys not in output: {missing}; emitted keys: {list(result)}"
            )
        counts = Counter(rename_fields.get(k, k) for k in result)
        collisions = sorted(k for k, c in counts.items() if c > 1)
        if collisions:
            raise ValueError(
                f"to_training: rename_fields target keys collide: {collisions}; every output name must be unique"
            )
        result = {rename_fields.get(k, k): v for k, v in result.items()}
    for name in exclude_fields:
        result.pop(name, None)
    return result
