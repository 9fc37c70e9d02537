"""What every file shard shares: its identity when opened, the checks before each read, remote copies.

A file shard records its size, modification time and a content digest (:func:`content_digest`)
when its dataset is opened, and refuses, with :class:`~zephon.io.ShardChangedError`, to read a
file that no longer matches: one ``stat`` before every read, the digest again whenever the file
is opened in a process (first use, or after it was replaced by another file). A file shard pickles
as its description only; what it opens is process-local.

:class:`RemoteShard` wraps a local shard of any format around a cached copy of a remote object.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from .._cache import ProcessCache
from ._jsonl import EDGE_BYTES, ShardChangedError, content_digest
from ._storage import IoOptions, fetch, filesystem


class FileIdentity:
    """A file as seen when its dataset was opened: path, size, mtime and content digest."""

    __slots__ = ()
    _id_fields = ("path", "shard_id", "size", "mtime_ns", "verify", "digest", "num_rows")

    def _init_identity(self, path: str, shard_id: str, verify: str) -> None:
        st = os.stat(path)
        self.path, self.shard_id, self.verify = path, shard_id, verify
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
        self.digest: str | None = None
        self.num_rows = -1

    def _take_digest(self) -> None:
        if self.digest is None:
            self.digest = content_digest(self.path, self.size, self.verify == "full")

    def check_stat(self, dataset: str) -> os.stat_result:
        """One ``stat``: raises unless the file still has the size and time seen at opening."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(f"dataset {dataset!r}: shard file {self.path} was removed after the dataset was opened; restore it or open the dataset again") from None
        if (st.st_size, st.st_mtime_ns) != (self.size, self.mtime_ns):
            raise ShardChangedError(
                f"dataset {dataset!r}: shard file {self.path} changed after the dataset was opened: size was {self.size} "
                f"bytes, now {st.st_size}; mtime_ns was {self.mtime_ns}, now {st.st_mtime_ns}. Reading it would shift or "
                "garble samples; leave shard files untouched while a dataset is in use and open the dataset again."
            )
        return st

    def check_content(self, dataset: str) -> None:
        """Compare the content digest with the one taken at opening (when a process opens the file)."""
        if self.digest is None:
            return
        if content_digest(self.path, self.size, self.verify == "full") != self.digest:
            part = "its content" if self.verify == "full" else f"its first or last {EDGE_BYTES // 1024} KiB"
            raise ShardChangedError(
                f"dataset {dataset!r}: shard file {self.path} changed after the dataset was opened: {part} differ, "
                "although its size and modification time are the same. Open the dataset again to read the new content."
            )

    def fingerprint(self) -> dict[str, Any]:
        return {"path": self.shard_id, "bytes": self.size, "rows": self.num_rows, "identity": f"size={self.size},mtime_ns={self.mtime_ns}"}

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self._fields:
            setattr(self, name, state[name])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shard_id!r}, rows={self.num_rows})"


def open_cached(cache: ProcessCache, shard: Any, dataset: str, build: Callable[[os.stat_result], Any]) -> Any:
    """The shard's open state in this process, checked against the file before each use.

    The state is keyed by the shard's description and the file's inode: a file replaced by
    another of the same size and time is opened again, and its digest compared.
    """
    st = shard.check_stat(dataset)
    variant = tuple(getattr(shard, f, None) for f in ("fmt", "columns", "eos_token_id", "dtype"))
    key = (shard.path, shard.size, shard.mtime_ns, st.st_dev, st.st_ino, variant)

    def make() -> Any:
        shard.check_content(dataset)
        return build(st)

    return cache.get(key, make)


class RemoteShard:
    """A shard of any format on remote storage, read from a whole-file copy in the shard cache.

    Attributes:
        url: the object's URL.
        shard_id: its path relative to the dataset root.
        size: its size in bytes when the dataset was opened.
        identity: its ETag or checksum (else modification time) then.
        num_rows: its rows.
        fs_key: ``(protocol, storage options)`` of its filesystem.
        make: builds the local shard of the copy: ``make(local path, shard_id) -> shard``.
    """

    _fields = ("url", "shard_id", "size", "identity", "num_rows", "fs_key", "make")
    __slots__ = _fields

    def __init__(self, url: str, shard_id: str, size: int, identity: str, fs_key: tuple, make: Callable[[str, str], Any], num_rows: int = -1):
        self.url, self.shard_id, self.size, self.identity = url, shard_id, size, identity
        self.fs_key, self.make, self.num_rows = fs_key, make, num_rows

    path = property(lambda self: self.url)

    def local(self, dataset: str, io: IoOptions) -> Any:
        """The local shard of this object's cached copy (downloaded when missing)."""
        copy = fetch(self.url, filesystem(*self.fs_key), self.size, self.identity, io.cache, dataset)
        st = os.stat(copy)

        def build() -> Any:
            shard = self.make(copy, self.shard_id)
            rows = shard.count_rows(dataset)
            if self.num_rows >= 0 and rows != self.num_rows:
                raise ShardChangedError(f"dataset {dataset!r}: remote shard {self.url} now has {rows} rows, not the {self.num_rows} recorded when the dataset was opened; open the dataset again")
            return shard

        return _LOCAL.get((copy, st.st_ino, st.st_mtime_ns), build)

    def count_rows(self, dataset: str, io: IoOptions) -> int:
        self.num_rows = self.local(dataset, io).num_rows
        return self.num_rows

    def read(self, rows: np.ndarray, dataset: str, io: IoOptions | None = None) -> list:
        io = io or IoOptions()
        for attempt in range(2):
            try:
                return self.local(dataset, io).read(rows, dataset, io)
            except FileNotFoundError:  # evicted by another process meanwhile: fetch again, once
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def fingerprint(self) -> dict[str, Any]:
        return {"path": self.shard_id, "bytes": self.size, "rows": self.num_rows, "identity": self.identity}

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    def __setstate__(self, state: tuple) -> None:
        for f, v in zip(self._fields, state):
            setattr(self, f, v)

    def __repr__(self) -> str:
        return f"RemoteShard({self.url!r}, rows={self.num_rows})"


_LOCAL = ProcessCache(max_entries=256)
