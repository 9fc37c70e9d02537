"""Parquet and Arrow IPC (Feather) shards, read by row group (record batch) with column projection.

A read decodes only the groups holding its rows, and only the projected columns. Decoded Parquet
row groups stay in a per-process LRU bounded in bytes (``row_group_cache_bytes``); Arrow IPC
files are memory mapped. A payload is the row as a dict of Python values.

Remote Parquet objects with an ETag or checksum are read by byte ranges (:class:`RangedParquet`):
the footer once per process, then only the row groups needed. The object's size and identity are
checked on opening and before each read that fetches groups, so ranges never mix two versions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..core.cache import ProcessCache
from ..core.bad_records import RecordDecodeError
from .digest import ShardChangedError
from .files import FileIdentity, open_cached
from .storage import CacheOptions, changed_object, filesystem, identity_of, with_retries

#: Endings read as each columnar format.
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")

_OPEN = ProcessCache(clear_after_fork=True, max_entries=128)


def pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError("reading Parquet or Arrow files needs pyarrow: pip install 'zephon-lanes[parquet]'") from None
    return pyarrow


class RowGroupCache:
    """Decoded row groups by key (``entries``), least recently used out first, at most
    ``max_bytes`` (``nbytes`` now) in all, per process; ``misses`` counts the decodes."""

    def __init__(self) -> None:
        self.entries: OrderedDict[Any, Any] = OrderedDict()
        self.nbytes = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: Any, build: Any, max_bytes: int) -> Any:
        with self._lock:
            table = self.entries.get(key)
            if table is not None:
                self.entries.move_to_end(key)
                return table
        table = build()
        with self._lock:
            self.misses += 1
            if key not in self.entries:
                self.entries[key] = table
                self.nbytes += table.nbytes
            while self.nbytes > max_bytes and len(self.entries) > 1:
                _, old = self.entries.popitem(last=False)
                self.nbytes -= old.nbytes
        return table

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.nbytes = 0


#: The decoded row groups of this process.
ROW_GROUPS = RowGroupCache()


class _Opened:
    """A file's reader and the first row of each group, then the row count, once the projected
    ``columns`` are known to exist; ``lock``: one ranged read at a time."""

    __slots__ = ("reader", "starts", "lock")

    def __init__(
        self, reader: Any, counts: Sequence[int], names: list, columns: Any, where: str,
        dataset: str,
    ):
        missing = [c for c in columns or () if c not in names]
        if missing:
            raise ValueError(
                f"dataset {dataset!r}: {where} has no column(s) {missing}; its columns are {names}. "
                "Fix columns=."
            )
        self.reader, self.lock = reader, threading.Lock()
        self.starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int64)


class ColumnarShard(FileIdentity):
    """One Parquet or Arrow IPC file (``fmt``) read by random access: ``columns`` projected
    (``None``: all), ``group_rows`` from the footer at opening."""

    __slots__ = FileIdentity._id_fields + ("fmt", "columns", "group_rows", "__weakref__")

    def __init__(self, path: str, shard_id: str, fmt: str, columns: Sequence[str] | None = None, verify: str = "quick", *, cache_dir: str | None = None, digest: str | None = None):
        self._init_identity(path, shard_id, verify, cache_dir, digest)
        self.fmt = fmt
        self.columns = None if columns is None else tuple(columns)
        self.group_rows: tuple[int, ...] = ()

    def count_rows(self, dataset: str, io: Any = None) -> int:
        """Read the footer (row groups and schema); once, at discovery."""
        opened = self._open(dataset)
        self.group_rows = tuple(np.diff(opened.starts).tolist())
        self.num_rows = int(opened.starts[-1])
        return self.num_rows

    def _open(self, dataset: str) -> _Opened:
        return open_cached(_OPEN, self, dataset, lambda: self._build(dataset))

    def _build(self, dataset: str) -> _Opened:
        pa = pyarrow()
        try:
            if self.fmt == "parquet":
                reader = pa.parquet.ParquetFile(self.path, memory_map=False)
                meta = reader.metadata
                counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                names = reader.schema_arrow.names
            else:
                reader = _ArrowFile(pa, self.path)
                counts, names = reader.counts, reader.names
        except (pa.ArrowException, OSError, ValueError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            kind = "Parquet" if self.fmt == "parquet" else "Arrow IPC (Feather v2)"
            raise ValueError(
                f"dataset {dataset!r}: {self.path} is not a readable {kind} file ({type(err).__name__}: {err}). It may "
                "have been cut short by an interrupted copy or write (its footer is at the end), or be in another "
                "format: check the file, or re-create it."
            ) from err
        opened = _Opened(reader, counts, names, self.columns, self.path, dataset)
        if self.group_rows and tuple(counts) != self.group_rows:
            raise ShardChangedError(f"dataset {dataset!r}: shard file {self.path} now has row groups of {counts} rows, not the {list(self.group_rows)} it had when the dataset was opened; open the dataset again")
        return opened

    def _group(self, opened: _Opened, g: int, dataset: str, max_bytes: int) -> Any:
        def decode() -> Any:
            try:
                if self.fmt == "parquet":
                    return opened.reader.read_row_group(g, columns=list(self.columns) if self.columns else None, use_threads=False)
                return opened.reader.batch(g, self.columns)
            except Exception as err:
                lo, hi = int(opened.starts[g]), int(opened.starts[g + 1])
                raise RecordDecodeError(
                    f"dataset {dataset!r}: {self.path}, row group {g} (rows {lo}..{hi - 1}) cannot be decoded "
                    f"({type(err).__name__}: {err}); the file is damaged: re-create it", type(err).__name__,
                ) from err

        if self.fmt != "parquet":  # views of the mapping; nothing to keep
            return decode()
        key = (self.path, self.digest, self.columns, g)
        return ROW_GROUPS.get(key, decode, max_bytes)

    def read(self, rows: np.ndarray, dataset: str, io: Any = None) -> list:
        """The rows (validated ``int64``, any order, repeats allowed) as dicts, in the order given."""
        if rows.shape[0] == 0:
            return []
        opened = self._open(dataset)
        max_bytes = io.row_group_cache_bytes if io is not None else 64 << 20
        return read_rows(opened.starts, rows, lambda g: self._group(opened, g, dataset, max_bytes), self.path, dataset)


def read_rows(starts: np.ndarray, rows: np.ndarray, group: Any, path: str, dataset: str) -> list:
    """``rows`` of a file whose row groups start at ``starts``, as dicts in the order given; ``group(g)``
    decodes row group ``g`` (each needed group once)."""
    groups = np.searchsorted(starts, rows, side="right") - 1
    out: list = [None] * rows.shape[0]
    for g in sorted(set(groups.tolist())):
        where = np.flatnonzero(groups == g)
        table = group(g)
        local = rows[where] - starts[g]
        try:
            values = _rows_of(table, local)
        except Exception as err:
            r = int(rows[where[0]])
            raise RecordDecodeError(
                f"dataset {dataset!r}: {path}, rows near {r} (row group {g}) cannot be converted to Python "
                f"values ({type(err).__name__}: {err})", type(err).__name__,
            ) from err
        for i, v in zip(where.tolist(), values):
            out[i] = v
    return out


def _rows_of(table: Any, local: np.ndarray) -> list:
    """Rows ``local`` of a decoded group as dicts, in the order given; runs of consecutive rows are
    converted slice by slice (zero-copy, unlike ``take``)."""
    order = np.argsort(local, kind="stable")
    ordered = local[order]
    cut = np.flatnonzero(np.diff(ordered) != 1) + 1
    values: list = []
    for run in np.split(ordered, cut):
        lo, n = int(run[0]), int(run[-1]) - int(run[0]) + 1
        part = table.slice(lo, n).to_pylist()
        values.extend(part if n == run.shape[0] else [part[int(r) - lo] for r in run])
    if (np.diff(local) > 0).all():
        return values
    result: list = [None] * local.shape[0]
    for i, v in zip(order.tolist(), values):
        result[i] = v
    return result


class _ArrowFile:
    """An Arrow IPC file (random-access format) or stream, memory mapped; batches by index."""

    def __init__(self, pa: Any, path: str):
        source = pa.memory_map(path, "r")
        try:
            reader = pa.ipc.open_file(source)
            self._batch = reader.get_batch
            self.counts = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            self.names = reader.schema.names
        except pa.ArrowInvalid:
            # The stream format (what Hugging Face datasets writes): read once, zero-copy from the mapping.
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()
            batches = table.to_batches()
            self._batch = batches.__getitem__
            self.counts = [b.num_rows for b in batches]
            self.names = table.schema.names

    def batch(self, i: int, columns: Sequence[str] | None) -> Any:
        batch = self._batch(i)
        return batch.select(list(columns)) if columns else batch


_READERS = ProcessCache(clear_after_fork=True, max_entries=256)


def ranged(identity: str) -> bool:
    """Whether an object of this identity can be read by ranges (its store gives ETags or checksums)."""
    return not identity.startswith("sha256=")


class RangedParquet:
    """One remote Parquet object (``url``, ``size``, ``identity`` as recorded at opening), read by
    row group through fsspec byte ranges of the ``columns`` (``None``: all)."""

    def __init__(self, url: str, size: int, identity: str, fs_key: tuple, columns: Sequence[str] | None):
        self.url, self.size, self.identity, self.fs_key = url, size, identity, fs_key
        self.columns = None if columns is None else tuple(columns)

    def _open(self, dataset: str, options: CacheOptions) -> _Opened:
        return _READERS.get((self.url, self.size, self.identity), lambda: self._build(dataset, options))

    def check(self, dataset: str, options: CacheOptions) -> None:
        """Raise unless the object still has the size and ETag (or checksum) recorded at opening."""
        fs = filesystem(*self.fs_key)
        info = with_retries(self.url, "checking", lambda: fs.info(self.url), options)
        now = (int(info.get("size") or 0), identity_of(info))
        if now != (self.size, self.identity):
            raise changed_object(dataset, self.url, self.size, self.identity, *now)

    def _build(self, dataset: str, options: CacheOptions) -> _Opened:
        pa = pyarrow()
        fs = filesystem(*self.fs_key)
        self.check(dataset, options)

        def open_file() -> Any:
            handle = fs.open(self.url, "rb", cache_type="none")
            return pa.parquet.ParquetFile(handle, pre_buffer=False)

        try:
            file = with_retries(self.url, "reading the footer of", open_file, options)
        except pa.ArrowException as err:
            raise ValueError(
                f"dataset {dataset!r}: {self.url} is not a readable Parquet file ({type(err).__name__}: {err}); check "
                "the object, or re-create it"
            ) from err
        meta = file.metadata
        counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        return _Opened(file, counts, file.schema_arrow.names, self.columns, self.url, dataset)

    def group_rows(self, dataset: str, options: CacheOptions) -> tuple[int, ...]:
        """Rows of each row group (from the footer: the only bytes read)."""
        return tuple(np.diff(self._open(dataset, options).starts).tolist())

    def read(self, rows: np.ndarray, dataset: str, io: Any) -> list:
        """The rows (validated ``int64``) as dicts, in the order given; fetches only their row groups."""
        if rows.shape[0] == 0:
            return []
        opened = self._open(dataset, io.cache)
        columns = list(self.columns) if self.columns else None
        checked = [False]

        def decode(g: int) -> Any:
            if not checked[0]:  # once per read that fetches: the ranges must come from the bytes of the footer
                self.check(dataset, io.cache)
                checked[0] = True
            def read_group() -> Any:
                with opened.lock:
                    return opened.reader.read_row_group(g, columns=columns, use_threads=False)

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

        return read_rows(opened.starts, rows, group, self.url, dataset)
