"""Datasets: named, immutable collections of shards read by ``(shard, row)``.

A sample's stable pointer is ``(dataset, shard, row)``: the dataset's position in a source, the
shard's position in the dataset, and the row's position in the shard. A :class:`Dataset` knows
the last two only. Shard order is fixed when the dataset is made (sorted relative paths for files,
insertion order for in-memory shards), and row numbers never move, so pointers stay valid for as
long as the data is unchanged.
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
    """Rows held in memory: a list of dicts, or a list or array of numpy arrays.

    Reads return the stored objects themselves (arrays as read-only views). The content hash of
    :meth:`Dataset.fingerprint` is computed once, on first use.

    Args:
        rows: a sequence of dicts, a sequence of numpy arrays, or one numpy array of two or more
            dimensions (each row along the first axis is a sample).

    Raises:
        TypeError: rows of another kind, or dicts mixed with arrays.

    Example:
        >>> InMemoryShard([{"text": "a"}, {"text": "b"}]).num_rows
        2
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
        data = self._rows
        return [data[i] for i in rows.tolist()]

    def _content_digest(self) -> tuple[str, int]:
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            total = 0
            data = self._rows
            if isinstance(data, np.ndarray):
                head = f"ndarray:{data.dtype.str}:{data.shape}".encode()
                body = np.ascontiguousarray(data).tobytes()
                h.update(head)
                h.update(body)
                total = len(body)
            else:
                encoder = msgspec.msgpack.Encoder(enc_hook=_encode_value)
                for lo in range(0, len(data), 1024):
                    chunk = encoder.encode(list(data[lo : lo + 1024]))
                    h.update(chunk)
                    total += len(chunk)
            self._digest = ("blake2b:" + h.hexdigest(), total)
        return self._digest

    def fingerprint(self) -> dict[str, Any]:
        identity, size = self._content_digest()
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

    Make one with :meth:`from_path` (files, local or remote), :meth:`from_hf`, :meth:`from_dict`
    or :meth:`from_rows` (rows in memory). A dataset pickles; open files are mapped again on first
    read in each process.

    Attributes:
        name: the dataset's name (the mixture component name).
        format: ``"jsonl"``, ``"parquet"``, ``"arrow"``, ``"tokens"``, ``"hf"`` or ``"inmem"``.
        io: how shards are fetched and cached (:class:`~zephon.io.IoOptions`; not in the
            fingerprint).
        columns: the projected columns of a Parquet or Arrow dataset (``None``: all).
        on_error: ``"raise"`` (default) or ``"skip"``: a row that cannot be decoded (a JSONL line
            that is not one JSON object, a damaged Parquet row group) is read as a
            :class:`~zephon.core.bad_records.Failure`, which a pipeline leaves out and counts.
        max_skipped: with ``"skip"``, the most rows (an int) or the largest share (a float in
            ``(0, 1)``) of its rows read a lane may skip before the pipeline raises.
        shard_ids: the shards' ids, in shard order: relative paths for files; for in-memory
            shards the mapping's keys as given, all strings or all ints.

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

        Shards are ordered by their path relative to the root (the folder, the glob's fixed part,
        or the files' common folder), whatever order they are listed or found in. Folder discovery
        skips hidden entries and, unless ``recursive``, subfolders. One dataset holds one format,
        known by its ending (``fmt=`` forces one): ``jsonl`` (``.jsonl``, ``.jsonl.gz``,
        ``.jsonl.zst``), ``parquet`` (``.parquet``, ``.pq``), ``arrow`` (``.arrow``,
        ``.feather``, ``.ipc``: IPC file or stream) and ``tokens`` (``.bin``, ``.npy``: flat
        token ids, documents split at ``eos_token_id`` or by a Megatron ``.idx`` beside a
        ``.bin``).

        A shard is identified by its content (size and SHA-256, taken once per file and kept in
        the digest cache), so a byte-identical copy of the data is the same dataset and resumes
        its checkpoints. Files must stay unchanged while the dataset is in use: a change is
        reported (:class:`~zephon.io.ShardChangedError`) instead of read, and a file cut short
        fails naming it. A remote shard is identified by its size and ETag or checksum (else a
        digest of its content) and read from a whole copy in the local shard cache.

        Args:
            path: a folder, a file, a glob (``"data/**/*.jsonl.zst"``), a list of files, or any
                of these as an fsspec URL (``s3://``, ``gs://``, ``az://``, ``hf://``,
                ``memory://``; ``file://`` is local).
            fmt: ``None`` to detect the format from the endings, or the format of every given
                (in a folder, every non-hidden) file.
            cache_dir: cache folder for content digests, JSONL indexes, decompressed copies and
                token offsets; default ``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon``.
            recursive: also search subfolders of a folder.
            verify: ``"quick"``: a file is digested again when its size, times or inode change;
                ``"full"``: also hashed whole again whenever a process opens it and now and then
                while it is read (for filesystems whose times do not follow every write).
            columns: Parquet/Arrow only: the columns to decode (rows hold only these); ``None``:
                all.
            eos_token_id: token files: the end-of-document token that splits documents.
            token_dtype: ``.bin`` token files without a Megatron index (default ``"uint16"``).
            storage_options: passed to the fsspec filesystem of a URL (credentials, endpoint).
            io_options: the shard cache and row-group cache settings (see
                :meth:`with_io_options`; usually ``Pipeline.options(io_options=...)``).
            index: ``"auto"``: use the dataset index (``.zephon-index.json``, written by
                ``zephon index PATH``) for shards whose identity still matches, counting the
                others (with a warning); ``"require"``: refuse a missing index or files not in
                it, and take each listed file as the index recorded it without a ``stat``,
                checking it when first read (a file changed since is refused then:
                :class:`~zephon.io.ShardChangedError`); ``"off"``: ignore it.
            progress: show a progress bar (needs ``tqdm``) while shards are counted.
            listing: ``"auto"``: with ``torch.distributed`` initialized on several ranks, rank 0
                lists and counts the dataset and broadcasts it, so the store is listed once per
                job (every rank must then open the same datasets in the same order);
                ``"local"``: every process lists it (data that differs per rank).
            on_error: ``"skip"``: rows that cannot be decoded are left out of a pipeline, counted
                and listed in ``stats()["skipped"]``; ``"raise"`` (default): reading them fails.
            max_skipped: with ``on_error="skip"``, an int (rows a lane may skip) or a float in
                ``(0, 1)`` (a share of the rows it read) past which reading raises.

        Raises:
            FileNotFoundError: a path does not exist, or a glob matches nothing.
            ValueError: unknown ``fmt``, ``verify`` or ``index``; no supported files; several
                formats; a file unreadable as its format or cut short; a stale index with
                ``index="require"``.
            ImportError: a format whose optional package is missing (the message names the
                ``pip install`` line).
        """
        check_file_settings(name, fmt, verify, token_dtype)
        skipping = {"on_error": on_error, "max_skipped": max_skipped}
        check_on_error(SimpleNamespace(name=name), None, on_error)  # before any file is opened
        check_max_skipped(SimpleNamespace(name=name, on_error=on_error), None, max_skipped)
        if index not in ("auto", "require", "off"):
            raise ValueError(f"unknown index {index!r} for dataset {name!r}; use 'auto', 'require' or 'off'")
        io = _as_io(io_options)

        def open_dataset() -> tuple[str, ShardSpec, ShardTable]:
            root, found = discover(name, path, fmt=fmt, recursive=recursive, storage_options=storage_options, cache_dir=resolve_cache_dir(cache_dir), cache=io.cache, index=index)
            kind = found[0].fmt
            chosen = columns
            if chosen is not None:
                if kind not in ("parquet", "arrow"):
                    raise ValueError(f"dataset {name!r}: columns= applies to Parquet and Arrow files, not {kind}")
                chosen = _column_list(name, chosen)
            spec = ShardSpec(kind, resolve_cache_dir(cache_dir), verify, None if chosen is None else tuple(chosen), eos_token_id, token_dtype)
            return kind, spec, open_shards(name, root, found, spec, storage_options, io, index=index, progress=progress)

        paths = tuple(map(_spelled, path)) if isinstance(path, Iterable) and not isinstance(path, (str, bytes)) else _spelled(path)
        request = (name, paths, fmt, recursive, verify, None if columns is None else tuple(columns), eos_token_id,
                   token_dtype, index, sorted(storage_options or {}))
        kind, spec, shards = list_once(name, request, open_dataset, listing)
        return cls(name, kind, shards.shard_ids, shards, io=io, columns=spec.columns, **skipping)

    @classmethod
    def from_hf(cls, name: str, hf_dataset: Any, *, split: str | None = None, shard_rows: int | None = None) -> Dataset:
        """A Hugging Face ``datasets.Dataset`` (or a ``DatasetDict`` split) as a dataset of format ``"hf"``.

        Rows are read by random access and come as dicts of Python values, whatever format the
        HF dataset was set to; the identity is the HF dataset's own fingerprint. Streams
        (``datasets.IterableDataset``) are refused with how to materialize them.

        Args:
            hf_dataset: a ``datasets.Dataset``, or a ``datasets.DatasetDict`` with ``split``.
            split: the split of a ``DatasetDict`` (optional when it has only one).
            shard_rows: cut the rows into shards of this many (so ``shuffle_shards`` has
                shards to shuffle); ``None``: one shard.

        Raises:
            TypeError: a stream, an iterator, or another object.
            ValueError: a ``DatasetDict`` with several splits and no ``split``; an empty dataset.
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
        """The same dataset read with other I/O settings (shard cache, row-group cache).

        They decide where copies are kept and how much stays decoded, never the rows, so they are
        not part of the fingerprint.

        Args:
            io_options: a dict or :class:`~zephon.io.IoOptions`: ``{"cache": {"enabled", "dir",
                "max_bytes", "retries", "backoff_s", "max_backoff_s"}, "row_group_cache_bytes"}``.

        Example:
            >>> ds = Dataset.from_rows("toy", [{"x": 1}])
            >>> ds.with_io_options({"cache": {"max_bytes": "10gb"}}).io.cache.max_bytes
            10737418240
        """
        return attrs.evolve(self, io=_as_io(io_options))

    @classmethod
    def from_dict(cls, name: str, shards: Mapping[ShardId, InMemoryShard | Sequence[Any]]) -> Dataset:
        """A dataset of in-memory shards (format ``"inmem"``), in the mapping's insertion order.

        Shard ids are all strings or all integers, kept as given (in :attr:`shard_ids`,
        :meth:`fingerprint` and ``Pipeline.describe_step``), so ``{0: rows}`` and ``{"0": rows}``
        are different datasets; ids never affect which sample comes where.

        Args:
            shards: shard id to :class:`InMemoryShard` (a plain list of rows is wrapped in one).

        Raises:
            ValueError: no shards.
            TypeError: a shard id that is neither a string nor an integer (``bool`` included),
                string and integer ids mixed, or rows of an unsupported kind.

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

        Example:
            >>> Dataset.from_rows("toy", [{"text": "hi"}]).shard_ids
            ('0',)
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
        """Payloads of ``rows`` of shard number ``shard``, in the order asked.

        Rows may be unsorted and repeated. A JSONL payload is the decoded object as stored; an
        in-memory payload is the stored row itself. Treat payloads as read-only. With
        ``on_error="skip"`` a row that cannot be decoded comes as a :class:`~zephon.core.bad_records.Failure`.

        Raises:
            IndexError: a shard or row out of range.
            TypeError: non-integer indices.
            ValueError: a line that is not a JSON object (named by file and line).
            ShardChangedError: a file that changed since the dataset was opened (a ``ValueError``).
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
        if self.on_error == "raise":
            return target.read(array, self.name, self.io)
        try:
            return target.read(array, self.name, self.io)
        except RecordDecodeError:
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
        """The absolute path of shard number ``shard``'s file; ``None`` for an in-memory shard.

        Example:
            >>> Dataset.from_rows("toy", [{"text": "a"}]).shard_path(0) is None
            True
        """
        return self._shards.location(shard)

    def fingerprint(self) -> dict[str, Any]:
        """``{"name", "format", "shards": [{"id", "path", "bytes", "rows", "identity"}, ...]}``: the data.

        It changes when any shard's content does: files are identified by their relative path, size
        and SHA-256, remote objects by size and ETag or checksum, in-memory shards by a BLAKE2b hash.

        Example:
            >>> fp = Dataset.from_rows("toy", [{"x": 1}]).fingerprint()
            >>> fp["shards"][0]["rows"], fp["shards"][0]["identity"].startswith("blake2b:")
            (1, True)
        """
        out: dict[str, Any] = {"name": self.name, "format": self.format}
        if self.columns is not None:  # rows hold only these fields
            out["columns"] = list(self.columns)
        if self.on_error != "raise":  # which rows reach the pipeline (absent at the default, as before)
            out["on_error"] = self.on_error
        out["shards"] = [{"id": sid, **s} for sid, s in zip(self.shard_ids, self._shards.fingerprints())]
        return out

    def __repr__(self) -> str:
        return f"Dataset(name={self.name!r}, format={self.format!r}, shards={self.num_shards}, rows={self.num_rows})"


def _shard_ids(name: str, keys: list[Any]) -> list[ShardId]:
    """Validate in-memory shard ids: all strings or all integers (numpy integers become ints)."""
    out: list[ShardId] = []
    for key in keys:
        if isinstance(key, str):
            out.append(key)
            continue
        if not isinstance(key, (bool, np.bool_)):
            try:
                out.append(int(operator.index(key)))
                continue
            except TypeError:
                pass
        raise TypeError(
            f"dataset {name!r}: shard id {key!r} ({type(key).__name__}) is neither a string nor an integer; "
            'use {"a": rows, "b": more} or {0: rows, 1: more}'
        )
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


def _column_list(name: str, columns: Any) -> list[str]:
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"dataset {name!r}: columns must be a list of column names, got {columns!r}")
    out = list(columns)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"dataset {name!r}: columns must name at least one column, each once, got {out}")
    return out


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
