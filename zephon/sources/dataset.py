"""Datasets: named, immutable lists of shards whose rows are read by ``(shard, row)``.

Shard order is fixed when the dataset is made (sorted relative paths for files, insertion order
in memory) and rows never move, so ``(dataset, shard, row)`` names a sample while the data holds.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Sequence, Union

import attrs
import msgspec
import numpy as np

from ..core.bad_records import Failure, RecordDecodeError, check_max_skipped, check_on_error
from .digest import resolve_cache_dir
from .discover import FORMATS, discover
from .jsonl import VERIFY_MODES
from .listing import list_once
from .shard_table import ObjectShards, ShardSpec, ShardTable, open_shards
from .storage import IoOptions
from .storage import io_options as _as_io
from .token_files import TOKEN_DTYPES

PathLike = Union[str, "os.PathLike[str]"]
ShardId = Union[str, int]


class InMemoryShard:
    """Rows held in memory: dicts, numpy arrays, or the rows of one array of 2+ dimensions.

    Reads return the stored objects (arrays as read-only views); the content hash is taken once.
    Raises ``TypeError`` for rows of another kind, or dicts mixed with arrays.
    """

    __slots__ = ("_rows", "_digest")

    def __init__(self, rows: Sequence[Any] | np.ndarray):
        self._digest: tuple[str, int] | None = None
        if isinstance(rows, np.ndarray) and rows.dtype != object:
            if rows.ndim < 2:
                raise TypeError(
                    f"InMemoryShard got a {rows.ndim}-d numpy array; pass a 2-d (or higher) array whose rows "
                    "are samples, or a list of arrays or dicts"
                )
            self._rows: Any = _read_only(rows)
            return
        if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable):
            raise TypeError(
                f"InMemoryShard expects a list of dicts or of numpy arrays, got {type(rows).__name__}; "
                'for example InMemoryShard([{"text": "..."}, ...])'
            )
        items = list(rows)
        kind = np.ndarray if items and isinstance(items[0], np.ndarray) else dict
        for i, row in enumerate(items):
            if not isinstance(row, kind):
                raise TypeError(
                    f"InMemoryShard rows must all be dicts or all be numpy arrays; row {i} is a "
                    f"{type(row).__name__} (row 0 is a {type(items[0]).__name__})"
                )
        if kind is np.ndarray:
            items = [_read_only(x) for x in items]
        self._rows = tuple(items)

    @property
    def num_rows(self) -> int:
        """Number of rows."""
        return len(self._rows)

    def read(self, rows: np.ndarray, dataset: str, io: Any = None) -> list:
        return [self._rows[i] for i in rows.tolist()]

    def fingerprint(self) -> dict[str, Any]:
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            data = self._rows
            if isinstance(data, np.ndarray):
                h.update(f"ndarray:{data.dtype.str}:{data.shape}".encode())
                chunks: Iterable[bytes] = [np.ascontiguousarray(data).tobytes()]
            else:
                enc = msgspec.msgpack.Encoder(enc_hook=_encode_value)
                chunks = (enc.encode(list(data[i : i + 1024])) for i in range(0, len(data), 1024))
            total = 0
            for chunk in chunks:
                h.update(chunk)
                total += len(chunk)
            self._digest = ("blake2b:" + h.hexdigest(), total)
        identity, size = self._digest
        return {"path": None, "bytes": size, "rows": self.num_rows, "identity": identity}

    def __repr__(self) -> str:
        return f"InMemoryShard(rows={self.num_rows})"


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _encode_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        head = f"{value.dtype.str}:{value.shape}:".encode()
        return msgspec.msgpack.Ext(1, head + np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(
        f"cannot fingerprint an in-memory row holding a {type(value).__name__}; rows may hold dicts, lists, "
        "str, int, float, bool, None and numpy arrays"
    )


@attrs.frozen(eq=False, repr=False)
class Dataset:
    """A named, immutable list of shards; every sample is addressed by ``(shard, row)``.

    Made by :meth:`from_path` (files, local or remote), :meth:`from_hf`, :meth:`from_dict` or
    :meth:`from_rows`. It pickles; files are opened again on first read in each process.

    Attributes:
        name: the mixture component name.
        format: ``"jsonl"``, ``"parquet"``, ``"arrow"``, ``"tokens"``, ``"hf"`` or ``"inmem"``.
        io: how shards are fetched and cached (:class:`~zephon.io.IoOptions`; not fingerprinted).
        columns: the projected columns of a Parquet or Arrow dataset (``None``: all).
        on_error: ``"raise"`` or ``"skip"``: an undecodable row is read as a
            :class:`~zephon.core.bad_records.Failure`, which a pipeline leaves out and counts.
        max_skipped: with ``"skip"``, the most rows (int) or share (float in ``(0, 1)``) of its
            rows read a lane may skip before the pipeline raises.
        shard_ids: relative paths for files; for in-memory shards the keys as given.

    Example:
        >>> ds = Dataset.from_rows("toy", [{"text": "a"}, {"text": "b"}, {"text": "c"}])
        >>> ds.num_shards, ds.num_rows
        (1, 3)
        >>> ds.read(0, [2, 0, 2])
        [{'text': 'c'}, {'text': 'a'}, {'text': 'c'}]
    """

    name: str
    format: str
    shard_ids: tuple[ShardId, ...] = attrs.field(converter=tuple)
    _shards: ShardTable | ObjectShards = attrs.field(converter=lambda s: s if isinstance(s, (ShardTable, ObjectShards)) else ObjectShards(s))
    io: IoOptions = attrs.field(factory=IoOptions, kw_only=True, converter=_as_io)
    columns: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)
    on_error: str = attrs.field(default="raise", kw_only=True, validator=check_on_error)
    max_skipped: int | float | None = attrs.field(default=None, kw_only=True, validator=check_max_skipped)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a dataset needs a non-empty string name, got {self.name!r}")
        if len(self.shard_ids) != len(self._shards):
            raise ValueError(f"{len(self.shard_ids)} shard ids for {len(self._shards)} shards")
        if not self._shards:
            raise ValueError(f"dataset {self.name!r} has no shards")
        if len(set(self.shard_ids)) != len(self.shard_ids):
            raise ValueError(f"dataset {self.name!r} has repeated shard ids: {list(self.shard_ids)}")

    @classmethod
    def from_path(
        cls,
        name: str,
        path: PathLike | Sequence[PathLike],
        *,
        fmt: str | None = None,
        cache_dir: PathLike | None = None,
        recursive: bool = False,
        verify: str = "quick",
        columns: Sequence[str] | None = None,
        eos_token_id: int | None = None,
        token_dtype: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        io_options: Any = None,
        index: str = "auto",
        progress: bool = False,
        listing: str = "auto",
        on_error: str = "raise",
        max_skipped: int | float | None = None,
    ) -> Dataset:
        """Open files as a dataset, one shard per file: JSONL, Parquet, Arrow IPC or token files.

        Shards are sorted by path relative to the root (the folder, the glob's fixed part, or the
        files' common folder); folders skip hidden entries and, unless ``recursive``, subfolders.
        One format per dataset, told by the ending or ``fmt=``: ``jsonl`` (``.jsonl[.gz|.zst]``),
        ``parquet`` (``.parquet``, ``.pq``), ``arrow`` (``.arrow``, ``.feather``, ``.ipc``) and
        ``tokens`` (``.bin``, ``.npy``: documents split at ``eos_token_id`` or by a Megatron
        ``.idx``). A shard is identified by its content (size and SHA-256, cached), so an
        identical copy resumes the same checkpoints; a changed file raises
        :class:`~zephon.io.ShardChangedError` instead of being read. A remote shard (identified by
        size and ETag or checksum, else a content digest) is read from the local shard cache.

        Args:
            path: a folder, file, glob (``"data/**/*.jsonl.zst"``) or list of files, or any of
                these as an fsspec URL (``s3://``, ``gs://``, ``hf://``...; ``file://`` is local).
            fmt: the format of every file; ``None``: detect it from the endings.
            cache_dir: for digests, indexes, decompressed copies and token offsets; default
                ``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon``.
            recursive: also search subfolders.
            verify: ``"quick"``: digest again when size, times or inode change; ``"full"``: also
                hash whole files on open and now and then while reading.
            columns: Parquet/Arrow only: the columns to decode (``None``: all).
            eos_token_id: token files: the end-of-document token.
            token_dtype: ``.bin`` files without a Megatron index (default ``"uint16"``).
            storage_options: for the fsspec filesystem (credentials, endpoint).
            io_options: shard cache and row-group cache settings (see :meth:`with_io_options`).
            index: ``"auto"``: take rows from ``.zephon-index.json`` (``zephon index PATH``) for
                unchanged shards, counting the others with a warning; ``"require"``: refuse a
                missing or stale index, trusting listed files without a ``stat`` until first
                read; ``"off"``: ignore it.
            progress: show a progress bar (needs ``tqdm``) while counting.
            listing: ``"auto"``: under multi-rank ``torch.distributed`` rank 0 lists and
                broadcasts (every rank opens the same datasets in order); ``"local"``: each
                process lists.
            on_error, max_skipped: as the attributes (skipped rows are in ``stats()["skipped"]``).

        Raises:
            FileNotFoundError: a missing path, or a glob matching nothing.
            ValueError: unknown settings; no supported files; several formats; an unreadable or
                cut-short file; a stale index with ``index="require"``.
            ImportError: a format whose optional package is missing.
        """
        check_file_settings(name, fmt, verify, token_dtype)
        check_on_error(SimpleNamespace(name=name), None, on_error)  # before any file is opened
        check_max_skipped(SimpleNamespace(name=name, on_error=on_error), None, max_skipped)
        if index not in ("auto", "require", "off"):
            raise ValueError(f"unknown index {index!r} for dataset {name!r}; use 'auto', 'require' or 'off'")
        io = _as_io(io_options)

        def open_dataset() -> tuple[str, ShardSpec, ShardTable]:
            cache = resolve_cache_dir(cache_dir)
            root, found = discover(name, path, fmt=fmt, recursive=recursive, cache_dir=cache,
                                   storage_options=storage_options, cache=io.cache, index=index)
            kind = found[0].fmt
            if columns is not None and kind not in ("parquet", "arrow"):
                raise ValueError(f"dataset {name!r}: columns= applies to Parquet and Arrow files, not {kind}")
            chosen = None if columns is None else _column_list(name, columns)
            spec = ShardSpec(kind, cache, verify, chosen, eos_token_id, token_dtype)
            return kind, spec, open_shards(name, root, found, spec, storage_options, io, index=index, progress=progress)

        paths = tuple(map(_spelled, path)) if isinstance(path, Iterable) and not isinstance(path, (str, bytes)) else _spelled(path)
        request = (name, paths, fmt, recursive, verify, None if columns is None else tuple(columns), eos_token_id,
                   token_dtype, index, sorted(storage_options or {}))
        kind, spec, shards = list_once(name, request, open_dataset, listing)
        skipping = {"on_error": on_error, "max_skipped": max_skipped}
        return cls(name, kind, shards.shard_ids, shards, io=io, columns=spec.columns, **skipping)

    @classmethod
    def from_hf(cls, name: str, hf_dataset: Any, *, split: str | None = None, shard_rows: int | None = None) -> Dataset:
        """A Hugging Face ``datasets.Dataset`` (or a ``DatasetDict``'s ``split``) as format "hf".

        Rows come by random access as dicts of Python values; the identity is the HF fingerprint.
        ``shard_rows`` cuts the rows into shards of that many (``None``: one shard). Raises
        ``TypeError`` for streams (saying how to materialize them) and other objects, and
        ``ValueError`` for an empty dataset or a ``DatasetDict`` of several splits and no ``split``.
        """
        from .hf import HfShard, select_split

        data = select_split(hf_dataset, name, split)
        total = len(data)
        if total == 0:
            raise ValueError(f"dataset {name!r}: the Hugging Face dataset has no rows")
        if shard_rows is not None and (isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1):
            raise ValueError(f"dataset {name!r}: shard_rows must be an int >= 1 or None, got {shard_rows!r}")
        step = shard_rows or total
        shards = [HfShard(data, lo, min(lo + step, total)) for lo in range(0, total, step)]
        return cls(name, "hf", list(range(len(shards))), shards)

    def with_io_options(self, io_options: Any) -> Dataset:
        """The same dataset read with other I/O settings (a dict or :class:`~zephon.io.IoOptions`).

        They never change the rows, so they are not part of the fingerprint.

        Example:
            >>> ds = Dataset.from_rows("toy", [{"x": 1}])
            >>> ds.with_io_options({"cache": {"max_bytes": "10gb"}}).io.cache.max_bytes
            10737418240
        """
        return attrs.evolve(self, io=_as_io(io_options))

    @classmethod
    def from_dict(cls, name: str, shards: Mapping[ShardId, InMemoryShard | Sequence[Any]]) -> Dataset:
        """In-memory shards (format "inmem"): shard id to :class:`InMemoryShard` or list of rows.

        Ids are all strings or all integers (not ``bool``; else ``TypeError``), kept as given, so
        ``{0: rows}`` and ``{"0": rows}`` are different datasets; they never decide the order.

        Example:
            >>> ds = Dataset.from_dict("toy", {"a": InMemoryShard([{"x": 1}]), "b": InMemoryShard([{"x": 2}])})
            >>> ds.shard_ids, ds.shard_sizes
            (('a', 'b'), (1, 1))
            >>> Dataset.from_dict("toy", {0: [{"x": 1}], 1: [{"x": 2}]}).shard_ids
            (0, 1)
        """
        if not isinstance(shards, Mapping):
            raise TypeError(
                f"Dataset.from_dict expects a mapping of shard id to InMemoryShard, got {type(shards).__name__}; "
                'for example Dataset.from_dict("web", {"0": InMemoryShard(rows)})'
            )
        if not shards:
            raise ValueError(f"Dataset.from_dict({name!r}, ...) needs at least one shard")
        ids = _shard_ids(name, list(shards))
        values = [value if isinstance(value, InMemoryShard) else InMemoryShard(value) for value in shards.values()]
        return cls(name, "inmem", ids, values)

    @classmethod
    def from_rows(cls, name: str, rows: Sequence[Any] | np.ndarray, *, shard_id: ShardId = "0") -> Dataset:
        """A dataset of one in-memory shard: ``rows`` as :class:`InMemoryShard` takes them, under ``shard_id``.
        """
        return cls.from_dict(name, {shard_id: InMemoryShard(rows)})

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self._shards)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Rows per shard, in shard order (a tuple built from :attr:`shard_rows`)."""
        return tuple(self.shard_rows.tolist())

    @property
    def shard_rows(self) -> np.ndarray:
        """Rows per shard, in shard order: a read-only int64 array, counted once (8 bytes a shard)."""
        return self._shards.rows

    @functools.cached_property
    def num_rows(self) -> int:
        """Rows over all shards."""
        return int(self.shard_rows.sum())

    def read(self, shard: int, rows: Sequence[int] | np.ndarray) -> list[Any]:
        """Read-only payloads of ``rows`` (any order, repeats allowed) of shard number ``shard``.

        With ``on_error="skip"`` an undecodable row comes as a
        :class:`~zephon.core.bad_records.Failure`. Raises ``IndexError`` (out of range),
        ``TypeError`` (non-integer indices), ``ValueError``
        (a JSONL line that is not an object; ``ShardChangedError``: a file changed since opening).
        """
        try:
            index = operator.index(shard)
        except TypeError:
            raise TypeError(f"dataset {self.name!r}: shard must be an integer index, got {shard!r}") from None
        if not 0 <= index < len(self._shards):
            count = len(self._shards)
            raise IndexError(f"dataset {self.name!r} has {count} shards (0..{count - 1}); got shard {index}")
        target = self._shards[index]
        array = self._row_array(rows, index, target.num_rows)
        try:
            return target.read(array, self.name, self.io)
        except RecordDecodeError:
            if self.on_error == "raise":
                raise
            return [self._row_or_failure(target, array[i : i + 1]) for i in range(array.shape[0])]

    def _row_or_failure(self, target: Any, row: np.ndarray) -> Any:
        try:
            return target.read(row, self.name, self.io)[0]
        except RecordDecodeError as exc:
            return Failure.of(exc)

    def _row_array(self, rows: Any, shard: int, size: int) -> np.ndarray:
        array = np.asarray(rows)
        if array.ndim != 1:
            raise ValueError(
                f"dataset {self.name!r}: rows must be a 1-d sequence of integers, got shape {array.shape}"
            )
        if array.size == 0:
            return np.empty(0, dtype=np.int64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"dataset {self.name!r}: rows must be integers, got dtype {array.dtype}")
        array = array.astype(np.int64, copy=False)
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= size:
            bad = low if low < 0 else high
            raise IndexError(
                f"dataset {self.name!r}: shard {shard} ({self.shard_ids[shard]!r}) has {size} rows (0..{size - 1}); "
                f"got row {bad}"
            )
        return array

    def shard_path(self, shard: int) -> str | None:
        """The absolute path (or URL) of shard number ``shard``'s file; ``None`` in memory."""
        return self._shards.location(shard)

    def fingerprint(self) -> dict[str, Any]:
        """``{"name", "format", "shards": [{"id", "path", "bytes", "rows", "identity"}, ...]}``.

        Changes with any shard's content: path, size and SHA-256 for files, size and ETag or
        checksum for remote objects, a BLAKE2b hash in memory.
        """
        out: dict[str, Any] = {"name": self.name, "format": self.format}
        if self.columns is not None:  # rows hold only these fields
            out["columns"] = list(self.columns)
        if self.on_error != "raise":  # which rows reach the pipeline
            out["on_error"] = self.on_error
        out["shards"] = [{"id": sid, **s} for sid, s in zip(self.shard_ids, self._shards.fingerprints())]
        return out

    def __repr__(self) -> str:
        return f"Dataset(name={self.name!r}, format={self.format!r}, shards={self.num_shards}, rows={self.num_rows})"


def _shard_ids(name: str, keys: list[Any]) -> list[ShardId]:
    """Validate in-memory shard ids: all strings or all integers (numpy integers become ints)."""
    out: list[ShardId] = []
    for key in keys:
        try:
            if isinstance(key, (bool, np.bool_)):
                raise TypeError
            out.append(key if isinstance(key, str) else int(operator.index(key)))
        except TypeError:
            raise TypeError(
                f"dataset {name!r}: shard id {key!r} ({type(key).__name__}) is neither a string nor an integer; "
                'use {"a": rows, "b": more} or {0: rows, 1: more}'
            ) from None
    if len({isinstance(i, str) for i in out}) > 1:
        raise TypeError(
            f"dataset {name!r}: shard ids mix strings and integers ({list(out)!r}); use all strings "
            '({"0": rows, "1": more}) or all integers ({0: rows, 1: more})'
        )
    return out


def as_dataset(obj: Any, name: str = "data") -> Dataset:
    """``obj`` as a :class:`Dataset`: a dataset as is, a list (or tuple) of dicts as the dataset ``name``.

    Raises:
        TypeError: anything else, with how to make a dataset from it.

    Example:
        >>> as_dataset([{"text": "a"}, {"text": "b"}], name="toy")
        Dataset(name='toy', format='inmem', shards=1, rows=2)
    """
    if isinstance(obj, Dataset):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        where = os.fspath(obj)
        raise TypeError(f"as_dataset got the path {where!r}; open files with Dataset.from_path({name!r}, {where!r})")
    if isinstance(obj, (list, tuple)):
        for i, row in enumerate(obj):
            if not isinstance(row, dict):
                raise TypeError(
                    f"as_dataset accepts a list of dicts, but item {i} is a {type(row).__name__}; for arrays use "
                    f"Dataset.from_rows({name!r}, rows), for files Dataset.from_path({name!r}, path)"
                )
        return Dataset.from_rows(name, list(obj))
    raise TypeError(
        f"cannot use a {type(obj).__name__} as a dataset; pass a zephon.io.Dataset (Dataset.from_path(name, path) "
        "for JSONL files, Dataset.from_dict(name, {shard_id: InMemoryShard(rows)}) for rows in memory) or a list "
        "of dicts"
    )


def _column_list(name: str, columns: Any) -> tuple[str, ...]:
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"dataset {name!r}: columns must be a list of column names, got {columns!r}")
    out = list(columns)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"dataset {name!r}: columns must name at least one column, each once, got {out}")
    return tuple(out)


def check_file_settings(name: str, fmt: str | None, verify: str, token_dtype: str | None) -> None:
    """A ``ValueError`` naming the setting and its choices for an unknown ``fmt``, ``verify`` or ``token_dtype``."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(
            f"unknown fmt {fmt!r} for dataset {name!r}; supported: {', '.join(map(repr, FORMATS))}, "
            "or fmt=None to detect it from the file endings"
        )
    if verify not in VERIFY_MODES:
        raise ValueError(
            f"unknown verify {verify!r} for dataset {name!r}; use 'quick' (a file is digested again when its "
            "size, times or inode change) or 'full' (also hashed whole again whenever a process opens it)"
        )
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"dataset {name!r}: token_dtype must be 'uint16', 'uint32', 'int32' or 'int64', got {token_dtype!r}")


def _spelled(path: Any) -> str:
    """A path as the text ranks compare (a path object by its text, anything else by its repr)."""
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
