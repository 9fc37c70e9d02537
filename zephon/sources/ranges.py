"""Remote Parquet read by byte ranges: the footer once per process, then only the row groups needed.

A process checks the object's size and ETag or checksum (a changed object is refused,
:class:`~zephon.io.ShardChangedError`), reads the footer and keeps the reader (one read at a time);
every read that fetches row groups checks again, so ranges never mix two versions. Decoded groups
share the local row-group cache. Objects identified by a content digest are read whole instead.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..core.cache import ProcessCache
from ..core.bad_records import RecordDecodeError
from .columnar import ROW_GROUPS, pyarrow, read_rows
from .digest import ShardChangedError
from .storage import CacheOptions, filesystem, identity_of, with_retries

__all__ = ["RangedParquet", "ranged"]

_READERS = ProcessCache(clear_after_fork=True, max_entries=256)


def ranged(identity: str) -> bool:
    """Whether an object of this identity can be read by ranges (its store gives ETags or checksums)."""
    return not identity.startswith("sha256=")


class _Reader:
    __slots__ = ("file", "starts", "lock")

    def __init__(self, file: Any, starts: np.ndarray):
        self.file, self.starts, self.lock = file, starts, threading.Lock()


class RangedParquet:
    """One remote Parquet object (``url``, ``size``, ``identity`` as recorded at opening), read by
    row group through fsspec byte ranges of the ``columns`` (``None``: all)."""

    def __init__(self, url: str, size: int, identity: str, fs_key: tuple, columns: Sequence[str] | None):
        self.url, self.size, self.identity, self.fs_key = url, size, identity, fs_key
        self.columns = None if columns is None else tuple(columns)

    def _open(self, dataset: str, options: CacheOptions) -> _Reader:
        return _READERS.get((self.url, self.size, self.identity), lambda: self._build(dataset, options))

    def check(self, dataset: str, options: CacheOptions) -> None:
        """Raise unless the object still has the size and ETag (or checksum) recorded at opening."""
        fs = filesystem(*self.fs_key)
        info = with_retries(self.url, "checking", lambda: fs.info(self.url), options)
        now = (int(info.get("size") or 0), identity_of(info))
        if now != (self.size, self.identity):
            raise ShardChangedError(
                f"dataset {dataset!r}: remote shard {self.url} changed after the dataset was opened: it had {self.size} "
                f"bytes and {self.identity}, now {now[0]} bytes and {now[1]}. Rows would shift or change; open the "
                "dataset again to read the new content."
            )

    def _build(self, dataset: str, options: CacheOptions) -> _Reader:
        pa = pyarrow()
        fs = filesystem(*self.fs_key)
        self.check(dataset, options)

        def open_file() -> Any:
            handle = fs.open(self.url, "rb", cache_type="none")
            return handle, pa.parquet.ParquetFile(handle, pre_buffer=False)

        try:
            handle, file = with_retries(self.url, "reading the footer of", open_file, options)
        except pa.ArrowException as err:
            raise ValueError(
                f"dataset {dataset!r}: {self.url} is not a readable Parquet file ({type(err).__name__}: {err}); check "
                "the object, or re-create it"
            ) from err
        meta = file.metadata
        counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        names = file.schema_arrow.names
        if self.columns is not None:
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise ValueError(f"dataset {dataset!r}: {self.url} has no column(s) {missing}; its columns are {names}. Fix columns=.")
        return _Reader(file, np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int64))

    def group_rows(self, dataset: str, options: CacheOptions) -> tuple[int, ...]:
        """Rows of each row group (from the footer: the only bytes read)."""
        return tuple(np.diff(self._open(dataset, options).starts).tolist())

    def read(self, rows: np.ndarray, dataset: str, io: Any) -> list:
        """The rows (validated ``int64``) as dicts, in the order given; fetches only their row groups."""
        if rows.shape[0] == 0:
            return []
        reader = self._open(dataset, io.cache)
        columns = list(self.columns) if self.columns else None
        checked = [False]

        def decode(g: int) -> Any:
            if not checked[0]:  # once per read that fetches: the ranges must come from the bytes of the footer
                self.check(dataset, io.cache)
                checked[0] = True
            def read_group() -> Any:
                with reader.lock:
                    return reader.file.read_row_group(g, columns=columns, use_threads=False)

            try:
                return with_retries(self.url, f"reading row group {g} of", read_group, io.cache)
            except Exception as err:
                if isinstance(err, OSError):
                    raise
                raise RecordDecodeError(
                    f"dataset {dataset!r}: {self.url}, row group {g} cannot be decoded ({type(err).__name__}: {err}); "
                    "the object is damaged: re-create it", type(err).__name__,
                ) from err

        def group(g: int) -> Any:
            return ROW_GROUPS.get((self.url, self.identity, self.columns, g), lambda: decode(g), io.row_group_cache_bytes)

        return read_rows(reader.starts, rows, group, self.url, dataset)
