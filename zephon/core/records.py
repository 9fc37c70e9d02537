"""Records (a payload and its provenance, :class:`Meta`, which checkpoints store), microbatches."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from ..training.convert import to_training
from ..training.fields import padding_waste


class Segment(NamedTuple):
    """A token range ``[start, end)`` (``end == -1``: all) of the ``child``-th record made from source row ``row``."""

    dataset: int
    shard: int
    row: int
    child: int
    start: int
    end: int

    @property
    def pointer(self) -> tuple[int, int, int]:
        return (self.dataset, self.shard, self.row)

    @property
    def sample(self) -> tuple[int, int, int, int]:
        """The sample-level record this segment is cut from."""
        return (self.dataset, self.shard, self.row, self.child)


class Meta(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Provenance of a record: its lane, the segments it was built from in order, and trailing padding positions."""

    lane: int
    segments: tuple[Segment, ...]
    padding_length: int = 0

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens covered by the segments, when every range is explicit."""
        return sum(s.end - s.start for s in self.segments)


def describe_meta(meta: Meta) -> str:
    """Where a record came from, for error messages: its first source pointer and lane."""
    if not meta.segments:
        return f"a record of lane {meta.lane}"
    seg = meta.segments[0]
    more = f" (and {len(meta.segments) - 1} more segments)" if len(meta.segments) > 1 else ""
    return f"the record from dataset {seg.dataset}, shard {seg.shard}, row {seg.row} (lane {meta.lane}){more}"


def meta_to_ints(meta: Meta) -> list[int]:
    """A meta as one flat list ``[lane, padding, dataset, shard, row, child, start, end, ...]`` (checkpoints)."""
    out = [meta.lane, meta.padding_length]
    for seg in meta.segments:
        out.extend(seg)
    return out


def meta_from_ints(data: Any) -> Meta:
    """Inverse of :func:`meta_to_ints`; errors name what is malformed."""
    if (type(data) is list or type(data) is tuple) and len(data) >= 8 and not (len(data) - 2) % 6 and {*map(type, data)} == _INT:
        if len(data) == 8:
            return Meta(data[0], (_tuple_new(Segment, data[2:]),), data[1])
        return Meta(data[0], tuple([_tuple_new(Segment, data[i : i + 6]) for i in range(2, len(data), 6)]), data[1])
    if not isinstance(data, (list, tuple)) or len(data) < 2 or (len(data) - 2) % 6:
        raise ValueError(f"a record reference is [lane, padding, 6 ints per segment...], got {data!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise ValueError(f"a record reference holds integers only, got {data!r}")
    segments = tuple(Segment(*data[i : i + 6]) for i in range(2, len(data), 6))
    return Meta(data[0], segments, data[1])


_INT = {int}
_tuple_new = tuple.__new__


class _Unresolved:
    """The payload of a record held by reference: only its meta is known (a restored state)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unresolved>"

    def __reduce__(self) -> str:
        return "UNRESOLVED"


#: The payload of a reference: a record a restored state holds by its meta until the runtime rebuilds it.
UNRESOLVED = _Unresolved()


class Record:
    """One item of a lane: a payload and its provenance. Immutable; equal when metas and payloads
    are. With payload :data:`UNRESOLVED` it is a *reference* (:func:`reference`)."""

    __slots__ = ("payload", "meta")

    def __init__(self, payload: Any, meta: Meta):
        object.__setattr__(self, "payload", payload)
        object.__setattr__(self, "meta", meta)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Record is immutable; make a new one (Record(payload, meta)) instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("a Record is immutable")

    def __reduce__(self):
        return (Record, (self.payload, self.meta))

    def __repr__(self) -> str:
        return f"Record(meta={self.meta!r}, payload={_short(self.payload)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return self.meta == other.meta and payload_equal(self.payload, other.payload)

    __hash__ = None  # type: ignore[assignment]

    @property
    def is_reference(self) -> bool:
        """Whether only the meta is known (see :func:`reference`)."""
        return self.payload is UNRESOLVED


def reference(meta: Meta) -> Record:
    """The record behind ``meta``, held by reference until the runtime rebuilds it."""
    return Record(UNRESOLVED, meta)


class SampleBatch:
    """A lane-pure microbatch of records, the output of ``batch``. Immutable. ``pad_token_id`` (the
    tokenizer's, if known) is ``to_training``'s default, not part of equality."""

    __slots__ = ("records", "pad_token_id")

    def __init__(self, records: tuple[Record, ...], pad_token_id: int | None = None):
        object.__setattr__(self, "records", tuple(records))
        object.__setattr__(self, "pad_token_id", pad_token_id)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a SampleBatch is immutable; make a new one instead of setting {name!r}")

    def __reduce__(self):
        return (SampleBatch, (self.records, self.pad_token_id))

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleBatch):
            return NotImplemented
        return self.records == other.records

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SampleBatch(lane={self.lane}, size={len(self.records)})"

    @property
    def lane(self) -> int | None:
        """The lane every record came from (``None`` for an empty batch)."""
        return self.records[0].meta.lane if self.records else None

    @property
    def lane_ids(self) -> tuple[int, ...]:
        return tuple(r.meta.lane for r in self.records)

    @property
    def ids(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Source pointers ``(dataset, shard, row)`` of each record, in segment order."""
        return tuple(tuple(s.pointer for s in r.meta.segments) for r in self.records)

    @property
    def padding_waste(self) -> float:
        """``1 - real tokens / (B x T_batch)`` if padded to the longest record (packed padding included)."""
        return padding_waste(self.records)

    def to_training(self, **kwargs: Any) -> dict[str, Any]:
        """Convert to training tensors; see :func:`zephon.to_training` for every option."""
        return to_training(self, **kwargs)


def payload_equal(a: Any, b: Any) -> bool:
    """Exact structural equality of payloads holding numpy arrays, lists and scalars."""
    import numpy as np

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(payload_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        arrays = isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        return arrays and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(payload_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _short(payload: Any) -> str:
    if isinstance(payload, dict):
        shapes = ((k, getattr(v, "shape", None), type(v).__name__) for k, v in payload.items())
        return "{" + ", ".join(f"{k}: array{tuple(s)}" if s is not None else f"{k}: {t}" for k, s, t in shapes) + "}"
    return type(payload).__name__
