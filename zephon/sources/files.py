"""What every file shard shares: its identity when opened, the checks before each read, remote copies.

A file shard records its size and content digest when its dataset is opened and refuses
(:class:`~zephon.io.ShardChangedError`) a file that no longer holds those bytes (``verify="full"``:
hashed whole again on every open). It pickles as its description. :class:`RemoteShard` reads a
remote object from a cached copy, or a remote Parquet object by byte ranges.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from ..core.cache import ProcessCache
from .digest import ShardChangedError, check_file, file_digest, hash_file, resolve_cache_dir, short, stat_key
from .storage import IoOptions, fetch, filesystem


class FileIdentity:
    """A file as seen when its dataset was opened: path, size, content digest, and ``seen``, the
    stat key at which it last held those bytes (``None``: not yet checked here)."""

    __slots__ = ()
    _id_fields = ("path", "shard_id", "size", "digest", "seen", "cache_dir", "verify", "num_rows")

    def _init_identity(self, path: str, shard_id: str, verify: str, cache_dir: str | None, digest: str | None) -> None:
        st = os.stat(path)
        self.path, self.shard_id, self.verify = path, shard_id, verify
        self.cache_dir = cache_dir or resolve_cache_dir(None)
        self.size = st.st_size
        self.seen: Any = None
        self.digest = digest or file_digest(path, self.cache_dir, stat_key(st))
        self.num_rows = -1

    def check_stat(self, dataset: str) -> os.stat_result:
        """One ``stat``: raises unless the file still holds the bytes seen at opening (digested again when touched)."""
        return check_file(self, dataset, "after the dataset was opened")

    def check_content(self, dataset: str) -> float:
        """``verify="full"``: hash the whole file again (not from the digest cache) and compare; the seconds it took."""
        if self.verify != "full":
            return 0.0
        start = time.monotonic()
        now = hash_file(self.path)
        if now != self.digest:
            raise ShardChangedError(
                f"dataset {dataset!r}: shard file {self.path} changed after the dataset was opened: its content differs "
                f"({short(self.digest)} → {short(now)}), although its size ({self.size} bytes), times and inode are the "
                "same (the filesystem did not record the write). Leave shard files untouched while a dataset is in use, "
                "and open the dataset again to read the new content."
            )
        return time.monotonic() - start

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shard_id!r}, rows={self.num_rows})"


def open_cached(cache: ProcessCache, shard: Any, dataset: str, build: Callable[[], Any]) -> Any:
    """The shard's open state in this process, checked against the file before each use (keyed by
    description, content and inode, so a replacing copy is opened again)."""
    st = shard.check_stat(dataset)
    variant = tuple(getattr(shard, f, None) for f in ("fmt", "columns", "eos_token_id", "dtype"))
    key = (shard.path, shard.size, shard.digest, st.st_dev, st.st_ino, variant)

    def make() -> Any:
        shard.check_content(dataset)
        return build()

    return cache.get(key, make)


class RemoteShard:
    """A shard of any format on remote storage, read from a whole-file copy in the shard cache.

    ``size`` and ``identity`` (ETag or checksum, else content digest) are the object's when the
    dataset was opened; ``fs_key``: ``(protocol, storage options)``; ``make(local path, shard_id)``
    builds the shard of the copy; ``by_ranges``: a byte-range reader (remote Parquet), used when
    ``io_options`` say ``remote_parquet="ranges"``, or ``None``.
    """

    __slots__ = ("url", "shard_id", "size", "identity", "num_rows", "fs_key", "make", "by_ranges")

    def __init__(
        self, url: str, shard_id: str, size: int, identity: str, fs_key: tuple,
        make: Callable[[str, str], Any], by_ranges: Any = None,
    ):
        self.url, self.shard_id, self.size, self.identity = url, shard_id, size, identity
        self.fs_key, self.make, self.num_rows, self.by_ranges = fs_key, make, -1, by_ranges

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

        return _LOCAL.get((copy, st.st_dev, st.st_ino), build)

    def count_rows(self, dataset: str, io: IoOptions) -> int:
        if self.by_ranges is not None and io.remote_parquet == "ranges":  # the footer only
            self.num_rows = sum(self.by_ranges.group_rows(dataset, io.cache))
        else:
            self.num_rows = self.local(dataset, io).num_rows
        return self.num_rows

    def read(self, rows: np.ndarray, dataset: str, io: IoOptions | None = None) -> list:
        io = io or IoOptions()
        if self.by_ranges is not None and io.remote_parquet == "ranges":
            return self.by_ranges.read(rows, dataset, io)
        try:
            return self.local(dataset, io).read(rows, dataset, io)
        except FileNotFoundError:  # evicted by another process meanwhile: fetch again, once
            return self.local(dataset, io).read(rows, dataset, io)

    def __repr__(self) -> str:
        return f"RemoteShard({self.url!r}, rows={self.num_rows})"


_LOCAL = ProcessCache(max_entries=256)
