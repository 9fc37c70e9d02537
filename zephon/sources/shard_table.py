"""Opening found shards: a dataset's files as a table, each shard object made on first use.

A rank reads a few of a dataset's (maybe 100,000) files, so :class:`ShardTable` keeps what
discovery found, rows per shard (``int64``) and row groups, and makes a file's shard object when
a process first reads it (a process-local map, not pickled). :class:`ObjectShards` gives shards
held as objects (in memory, Hugging Face) the same interface.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

import attrs
import numpy as np

from ..core.log import progress as progress_bar
from .columnar import ColumnarShard, RangedParquet, ranged
from .digest import check_file
from .discover import Found, format_of, read_index
from .files import RemoteShard
from .jsonl import JsonlShard
from .storage import is_url, split_url
from .token_files import TokenShard

_LISTED = 10


@attrs.frozen
class ShardSpec:
    """How to open a local file of a dataset as a shard (picklable; also used for remote copies)."""

    fmt: str
    cache_dir: str
    verify: str
    columns: tuple[str, ...] | None = None
    eos_token_id: int | None = None
    token_dtype: str | None = None

    def __call__(self, path: str, shard_id: str, compression: str | None = None, digest: str | None = None) -> Any:
        """The shard of the file at ``path``; ``digest``: its content identity if known (else taken)."""
        if self.fmt == "jsonl":
            compression = compression or format_of(path, "jsonl")[1]
            return JsonlShard(path, shard_id, compression, self.cache_dir, self.verify, digest)
        if self.fmt in ("parquet", "arrow"):
            return ColumnarShard(path, shard_id, self.fmt, self.columns, self.verify, cache_dir=self.cache_dir, digest=digest)
        return TokenShard(path, shard_id, dtype=self.token_dtype, eos_token_id=self.eos_token_id, cache_dir=self.cache_dir, verify=self.verify, digest=digest)

    def settings(self) -> dict[str, Any]:
        """What decides an index entry's rows and digest."""
        return {"fmt": self.fmt, "verify": self.verify, "eos_token_id": self.eos_token_id, "token_dtype": self.token_dtype}


def make_shard(found: Found, spec: ShardSpec, storage_options: Mapping[str, Any] | None) -> Any:
    """The shard of one found file: local (verified at the stat key it was found with), or a remote
    object read through the shard cache."""
    if is_url(found.location):
        fs_key = (split_url(found.location)[0], tuple(sorted((storage_options or {}).items())))
        by_ranges = None
        if spec.fmt == "parquet" and ranged(found.identity):
            by_ranges = RangedParquet(found.location, found.size, found.identity, fs_key, spec.columns)
        return RemoteShard(found.location, found.shard_id, found.size, found.identity, fs_key, spec, by_ranges=by_ranges)
    shard = spec(found.location, found.shard_id, found.compression, found.identity)
    shard.size, shard.seen = found.size, found.seen
    return shard


class ShardTable(Sequence):
    """A dataset's file shards: ``table[i]`` is shard ``i``'s object, made once per process (a file
    found through the index is checked then); :attr:`rows`, :meth:`fingerprints` and
    :meth:`location` need none."""

    __slots__ = ("name", "root", "found", "spec", "storage_options", "rows", "groups", "_made")

    def __init__(self, name: str, root: str, found: Sequence[Found], spec: ShardSpec, storage_options: Mapping[str, Any] | None, rows: np.ndarray, groups: Mapping[int, tuple[int, ...]] | None = None, made: Mapping[int, Any] | None = None):
        self.name, self.root = name, root
        self.found = tuple(found)
        self.spec, self.storage_options = spec, None if storage_options is None else dict(storage_options)
        self.rows = rows
        self.rows.flags.writeable = False
        self.groups = dict(groups or {})
        self._made: dict[int, Any] = dict(made or {})

    def __len__(self) -> int:
        return len(self.found)

    def __getitem__(self, i: int) -> Any:
        i = range(len(self.found))[i]
        shard = self._made.get(i)
        if shard is None:
            found = self.found[i]
            shard = make_shard(found, self.spec, self.storage_options)
            if found.indexed:
                fix = f"Rebuild the index with `zephon index {self.root}`, or open the dataset with index='auto' to count changed files again."
                check_file(shard, self.name, "since the dataset index recorded it", fix)
            shard.num_rows = int(self.rows[i])
            if i in self.groups and hasattr(shard, "group_rows"):  # a remote copy reads its own footer
                shard.group_rows = self.groups[i]
            shard = self._made.setdefault(i, shard)  # one object per shard, whichever thread made it first
        return shard

    @property
    def shard_ids(self) -> list[str]:
        return [f.shard_id for f in self.found]

    def location(self, i: int) -> str:
        """Where shard ``i`` is: an absolute local path or a URL."""
        return self.found[i].location

    def fingerprints(self) -> list[dict[str, Any]]:
        """Each shard's ``{"path", "bytes", "rows", "identity"}``, as its shard object gives it."""
        return [{"path": f.shard_id, "bytes": f.size, "rows": r, "identity": f.identity} for f, r in zip(self.found, self.rows.tolist())]

    def __getstate__(self) -> tuple:
        return self.name, self.root, self.found, self.spec, self.storage_options, self.rows, self.groups

    def __setstate__(self, state: tuple) -> None:
        self.name, self.root, self.found, self.spec, self.storage_options, self.rows, self.groups = state
        self._made = {}


class ObjectShards(Sequence):
    """Shards given as objects (in memory, Hugging Face, or any with ``num_rows``, ``read`` and
    ``fingerprint``), with the reading interface of :class:`ShardTable`; rows counted once."""

    __slots__ = ("_shards", "rows")

    def __init__(self, shards: Iterable[Any]):
        self._shards = tuple(shards)
        self.rows = np.fromiter((s.num_rows for s in self._shards), dtype=np.int64, count=len(self._shards))
        self.rows.flags.writeable = False

    def __len__(self) -> int:
        return len(self._shards)

    def __getitem__(self, i: int) -> Any:
        return self._shards[i]

    def location(self, i: int) -> str | None:
        """The shard's file (``path``), ``None`` for shards in memory."""
        return getattr(self._shards[i], "path", None)

    def fingerprints(self) -> list[dict[str, Any]]:
        return [s.fingerprint() for s in self._shards]


def open_shards(name: str, root: str, found: list[Found], spec: ShardSpec, storage_options: Any, io: Any, *, index: str = "auto", progress: bool = False) -> ShardTable:
    """The table of every found file, counted, or with its rows from the dataset index where it still holds."""
    doc = read_index(root, storage_options) if index != "off" else None
    entries: Mapping[str, Any] = {}
    if doc is not None:
        if doc.settings == spec.settings():
            entries = doc.shards
        elif index == "require":
            raise ValueError(f"dataset {name!r}: the index in {root} was built with {doc.settings}, not {spec.settings()}; rebuild it with `zephon index {root}`")
    elif index == "require":
        raise ValueError(f"dataset {name!r}: {root} has no dataset index; build it with `zephon index {root}` (or pass index='auto')")
    stale, unlisted = [], []
    rows = np.empty(len(found), dtype=np.int64)
    groups: dict[int, tuple[int, ...]] = {}
    made: dict[int, Any] = {}
    for i, f in enumerate(progress_bar(found, total=len(found), desc=f"counting {name}", unit="shard", force=progress or None)):
        entry = entries.get(f.shard_id)
        if entry is not None and (f.indexed or (entry.fmt, entry.bytes, entry.identity) == (f.fmt, f.size, f.identity)):
            rows[i] = entry.rows
            if entry.groups is not None:
                groups[i] = entry.groups
            continue
        (stale if entry is not None else unlisted).append(f.shard_id)
        if index == "require":
            raise ValueError(
                f"dataset {name!r}: the index in {root} is stale: shard {f.shard_id} "
                f"{'changed since it was indexed' if entry is not None else 'is not in it'}; rebuild it with `zephon index {root}`"
            )
        shard = made[i] = make_shard(f, spec, storage_options)
        rows[i] = shard.count_rows(name, io)
        if getattr(shard, "group_rows", None):
            groups[i] = tuple(shard.group_rows)
    if doc is not None and (stale or unlisted):
        listed = ", ".join((stale + unlisted)[:_LISTED])
        warnings.warn(
            f"dataset {name!r}: the index in {root} is stale for {len(stale)} changed and {len(unlisted)} new shard(s) "
            f"({listed}); they were counted again, not trusted. Rebuild it with `zephon index {root}`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return ShardTable(name, root, found, spec, storage_options, rows, groups, made)


def index_entry(found: Found, rows: int, groups: Sequence[int] | None) -> dict[str, Any]:
    """The dataset-index entry of a counted shard (with a local file's stat key: see ``discover._identified``)."""
    entry: dict[str, Any] = {"fmt": found.fmt, "bytes": found.size, "identity": found.identity, "rows": rows}
    if found.seen is not None:
        entry["stat"] = list(found.seen)
    if groups:
        entry["groups"] = list(groups)
    return entry
