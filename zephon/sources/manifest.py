"""The data's identity in a fingerprint: per dataset, counts and a digest of its shard list.

A shard list (:meth:`Dataset.fingerprint`'s, ~140 bytes a shard) is summarized in a source's
fingerprint, which every checkpoint carries, as name, format, shard count, bytes, rows and the
SHA-256 of the list in canonical msgpack; the lists (the *manifest*) are written once beside
checkpoints (``zephon.runtime.manifest``), only to say which shards differ. Lists of at most
:data:`INLINE_BYTES` in all stay inline; :func:`summarize` makes both forms compare.

Kept: the encoded list of every live dataset, and those of checkpoints built in this process
(:func:`pin`, up to :data:`PINNED_BYTES`).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import attrs
import msgspec

#: A source whose shard lists encode to at most this many bytes keeps them in its fingerprint.
INLINE_BYTES = 1024
#: The shard lists of checkpointed data kept in memory after their datasets are gone, at most.
PINNED_BYTES = 256 << 20

_CANONICAL = msgspec.msgpack.Encoder(order="sorted")


@attrs.frozen(eq=False)
class ShardList:
    """One dataset's shard list as canonical msgpack (``data``) and its digest (``"sha256:<hex>"``)."""

    digest: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")

    def entries(self) -> list[dict[str, Any]]:
        """The shard entries, ``[{"id", "path", "bytes", "rows", "identity"}, ...]``, in shard order."""
        return msgspec.msgpack.decode(self.data)


def encode(shards: Sequence[Mapping[str, Any]]) -> ShardList:
    """The :class:`ShardList` of shard entries (keys sorted, so it survives JSON and msgpack round trips).

    Example:
        >>> a = encode([{"id": "a.jsonl", "bytes": 3, "rows": 1}])
        >>> a.digest == encode([{"rows": 1, "bytes": 3, "id": "a.jsonl"}]).digest, a.entries()[0]["id"]
        (True, 'a.jsonl')
    """
    data = _CANONICAL.encode(list(shards))
    return ShardList("sha256:" + hashlib.sha256(data).hexdigest(), data)


def summarize(fingerprint: Mapping[str, Any], shards: ShardList | None = None) -> dict[str, Any]:
    """A dataset fingerprint with its shard list replaced by ``shards`` (count), ``bytes`` and
    ``rows`` (totals; ``bytes`` is ``None`` when a shard's size is unknown) and the list's ``digest``.

    Example:
        >>> s = summarize({"name": "web", "format": "jsonl", "shards": [{"id": "a", "bytes": 3, "rows": 1}] * 2})
        >>> s["shards"], s["bytes"], s["rows"], s["digest"][:7]
        (2, 6, 2, 'sha256:')
    """
    entries = fingerprint["shards"]
    sizes = [s.get("bytes") for s in entries]
    known = all(isinstance(b, int) for b in sizes)
    rows = sum(int(s.get("rows") or 0) for s in entries)
    out = {k: v for k, v in fingerprint.items() if k != "shards"}
    out.update(shards=len(entries), bytes=sum(sizes) if known else None, rows=rows)
    out["digest"] = (shards or encode(entries)).digest
    return out


def is_summary(entry: Any) -> bool:
    """Whether a dataset's entry in a fingerprint is a summary (else it holds its shard list)."""
    if not isinstance(entry, Mapping):
        return False
    return isinstance(entry.get("digest"), str) and not isinstance(entry.get("shards"), list)


_lock = threading.Lock()
_of_dataset: "weakref.WeakKeyDictionary[Any, tuple[dict[str, Any], ShardList]]" = weakref.WeakKeyDictionary()
_live: "weakref.WeakValueDictionary[str, ShardList]" = weakref.WeakValueDictionary()
_pinned: "OrderedDict[str, ShardList]" = OrderedDict()


def identity(dataset: Any) -> tuple[dict[str, Any], ShardList]:
    """``(summary, shard list)`` of a dataset, computed once per dataset object (datasets are immutable)."""
    with _lock:
        hit = _of_dataset.get(dataset)
    if hit is not None:
        return hit
    fp = dataset.fingerprint()
    shards = encode(fp["shards"])
    summary = summarize(fp, shards)
    with _lock:
        shards = _live.setdefault(shards.digest, shards)  # one object per content: kept while any such dataset lives
        return _of_dataset.setdefault(dataset, (summary, shards))


def source_entries(datasets: Sequence[Any]) -> list[dict[str, Any]]:
    """The datasets' entries in a source fingerprint: their full fingerprints when all shard lists
    together encode to at most :data:`INLINE_BYTES`, else their summaries."""
    ids = [identity(d) for d in datasets]
    if sum(len(shards.data) for _, shards in ids) <= INLINE_BYTES:
        return [d.fingerprint() for d in datasets]
    return [dict(summary) for summary, _ in ids]


def shard_list(digest: str) -> ShardList | None:
    """The shard list of that digest, if a live dataset or a checkpoint built in this process has it."""
    with _lock:
        return _live.get(digest) or _pinned.get(digest)


def pin(digest: str) -> None:
    """Keep the shard list of ``digest`` (if known) after its datasets are gone, the most recent first,
    up to :data:`PINNED_BYTES` in all."""
    with _lock:
        shards = _live.get(digest) or _pinned.get(digest)
        if shards is None:
            return
        _pinned[digest] = shards
        _pinned.move_to_end(digest)
        total = sum(len(s.data) for s in _pinned.values())
        while total > PINNED_BYTES and len(_pinned) > 1:
            _, dropped = _pinned.popitem(last=False)
            total -= len(dropped.data)
