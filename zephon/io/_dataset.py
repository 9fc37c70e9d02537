"""Datasets: named, immutable collections of shards read by ``(shard, row)``.

A sample's stable pointer is ``(dataset, shard, row)``: the dataset's position in a source, the
shard's position in the dataset, and the row's position in the shard. A :class:`Dataset` knows
the last two only. Shard order is fixed when the dataset is made (sorted relative paths for files,
insertion order for in-memory shards), and row numbers never move, so pointers stay valid for as
long as the data is unchanged.
"""

from __future__ import annotations

import hashlib
import operator
import os
from typing import Any, Iterable, Mapping, Sequence, Union

import attrs
import msgspec
import numpy as np

from .._log import progress
from ._jsonl import SUFFIXES, VERIFY_MODES, JsonlShard, resolve_cache_dir

PathLike = Union[str, "os.PathLike[str]"]
ShardId = Union[str, int]

_FORMATS = ("jsonl",)
_LISTED = 10


class InMemoryShard:
    """Rows held in memory: a list of dicts, or a list or array of numpy arrays.

    Reads return the stored objects themselves (arrays as read-only views); treat payloads as
    read-only. The content hash used by :meth:`Dataset.fingerprint` is computed once, on first
    use.

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

    def read(self, rows: np.ndarray, dataset: str) -> list:
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

    def __getstate__(self) -> tuple[Any, Any]:
        return (self._rows, self._digest)

    def __setstate__(self, state: tuple[Any, Any]) -> None:
        self._rows, self._digest = state

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

    Make one with :meth:`from_path` (JSONL files), :meth:`from_dict` or :meth:`from_rows` (rows in
    memory). A dataset pickles with the standard library; open files are not pickled but mapped
    again on first read in each process.

    Attributes:
        name: the dataset's name (the mixture component name).
        format: ``"jsonl"`` or ``"inmem"``.
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
    _shards: tuple[Any, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a dataset needs a non-empty string name, got {self.name!r}")
        if len(self.shard_ids) != len(self._shards):
            raise ValueError(f"{len(self.shard_ids)} shard ids for {len(self._shards)} shards")
        if not self._shards:
            raise ValueError(f"dataset {self.name!r} has no shards")
        if len(set(self.shard_ids)) != len(self.shard_ids):
            raise ValueError(f"dataset {self.name!r} has repeated shard ids: {list(self.shard_ids)}")

    # -- construction ---------------------------------------------------------------------------------

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
    ) -> Dataset:
        """Open JSONL files as a dataset, one shard per file.

        ``path`` is a folder, one file, or a list of files. Shards are ordered by their path
        relative to the folder (or, for a list, to the files' common folder), sorted, whatever order
        the files are listed or found in. Folder discovery skips hidden entries and, unless
        ``recursive``, subfolders.

        Each file's rows are its non-blank lines (lines of only spaces, tabs or ``\\r`` are skipped
        and get no row number); a last line without a newline counts. Rows are counted here through
        a line-offset index, built once per file by a fast scan and cached under
        ``<cache_dir>/index/``; ``.gz`` and ``.zst`` files are decompressed once into
        ``<cache_dir>/decompressed/``. When the cache folder cannot be written, both are kept in
        memory (with a ``RuntimeWarning``).

        Files must stay unchanged while the dataset is in use; a change is reported instead of read
        (:class:`~zephon.io.ShardChangedError`). Every read compares the file's size and
        modification time with those seen here. When a file is mapped (first use in a process, or
        again after more than 128 files were in use) and at most once a second while it stays
        mapped, a digest of its content is compared too: of its first and last 64 KiB by default;
        of the whole file with ``verify="full"``, which also catches a rewrite that keeps size and
        time and changes only the middle, at the cost of reading the whole file each time. See
        "What is detected" in the sources guide for the exact limits.

        Args:
            name: the dataset's name.
            path: a folder, a file, or a list of files.
            fmt: ``None`` to detect from the endings ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``;
                ``"jsonl"`` to read every given (or, in a folder, every non-hidden) file as JSONL,
                gzip- or zstd-compressed when it ends in ``.gz`` or ``.zst``.
            cache_dir: cache folder; default ``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon``.
            recursive: also search subfolders of a folder.
            verify: ``"quick"`` (digest of the first and last 64 KiB of each file) or ``"full"``
                (digest of whole files, read in full when the dataset is opened and whenever a
                file is mapped). Decides only how changed files are detected, never the data.

        Returns:
            The dataset, with format ``"jsonl"``.

        Raises:
            FileNotFoundError: a path does not exist.
            ValueError: unknown ``fmt`` or ``verify``; no supported files; a file that cannot be
                decompressed, or a compressed file that is cut short.
            ImportError: a ``.zst`` file without the ``zstandard`` package.
        """
        if fmt is not None and fmt not in _FORMATS:
            raise ValueError(
                f"unknown fmt {fmt!r} for dataset {name!r}; supported: 'jsonl' (files ending in "
                f"{', '.join(SUFFIXES)}), or fmt=None to detect it from the file endings"
            )
        if verify not in VERIFY_MODES:
            raise ValueError(
                f"unknown verify {verify!r} for dataset {name!r}; use 'quick' (the first and last 64 KiB of each "
                "file are checked for changes) or 'full' (whole files)"
            )
        cache = resolve_cache_dir(cache_dir)
        files = _find_files(name, path, forced=fmt is not None, recursive=recursive)
        shards = []
        for full, shard_id, compression in progress(files, total=len(files), desc=f"indexing {name}", unit="file"):
            shard = JsonlShard(full, shard_id, compression, cache, verify)
            shard.count_rows(name)
            shards.append(shard)
        return cls(name, "jsonl", [s.shard_id for s in shards], shards)

    @classmethod
    def from_dict(cls, name: str, shards: Mapping[ShardId, InMemoryShard | Sequence[Any]]) -> Dataset:
        """A dataset of in-memory shards, in the mapping's insertion order.

        Shard ids are either all strings or all integers (as Zephon 0.2.0 takes them, for example
        ``{0: InMemoryShard(rows), 1: InMemoryShard(more)}``). They are kept as given: integer ids
        stay Python ints in :attr:`shard_ids`, in :meth:`fingerprint` and in
        ``Pipeline.describe_step``, so ``{0: rows}`` and ``{"0": rows}`` are different datasets
        (their fingerprints differ). Shard *order* is the insertion order either way; ids never
        affect which sample comes where.

        Args:
            name: the dataset's name.
            shards: shard id to :class:`InMemoryShard` (a plain list of rows is wrapped in one).

        Returns:
            The dataset, with format ``"inmem"``.

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
        """A dataset of one in-memory shard.

        Args:
            name: the dataset's name.
            rows: what :class:`InMemoryShard` accepts.
            shard_id: the shard's id (a string or an integer, see :meth:`from_dict`).

        Returns:
            The dataset, with format ``"inmem"``.

        Example:
            >>> Dataset.from_rows("toy", [{"text": "hi"}]).shard_ids
            ('0',)
        """
        return cls.from_dict(name, {shard_id: InMemoryShard(rows)})

    # -- shape ------------------------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self._shards)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Rows per shard, in shard order."""
        return tuple(s.num_rows for s in self._shards)

    @property
    def num_rows(self) -> int:
        """Rows over all shards."""
        return sum(s.num_rows for s in self._shards)

    # -- reading ----------------------------------------------------------------------------------------

    def read(self, shard: int, rows: Sequence[int] | np.ndarray) -> list[Any]:
        """Payloads of ``rows`` of shard number ``shard``, in the order asked.

        Rows may be unsorted and repeated; they are read in sorted order and put back. A JSONL
        payload is the decoded object as stored (dicts, lists, str, int, float, bool, None); an
        in-memory payload is the stored row itself. Treat payloads as read-only.

        Args:
            shard: shard index, ``0 <= shard < num_shards``.
            rows: row indices within the shard (integers).

        Returns:
            One payload per requested row.

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
        return target.read(self._row_array(rows, index, target.num_rows), self.name)

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
        return getattr(self._shards[shard], "path", None)

    # -- identity ---------------------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-friendly description of the data, which changes when any shard's content changes.

        Files are identified by size and modification time as seen when the dataset was opened (a
        copy of the same files elsewhere gets a different identity); in-memory shards by a
        BLAKE2b hash of their rows, computed once.

        Returns:
            ``{"name", "format", "shards": [{"id", "path", "bytes", "rows", "identity"}, ...]}``.

        Example:
            >>> fp = Dataset.from_rows("toy", [{"x": 1}]).fingerprint()
            >>> fp["shards"][0]["rows"], fp["shards"][0]["identity"].startswith("blake2b:")
            (1, True)
        """
        return {
            "name": self.name,
            "format": self.format,
            "shards": [{"id": sid, **s.fingerprint()} for sid, s in zip(self.shard_ids, self._shards)],
        }

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
    """``obj`` as a :class:`Dataset`: a dataset as is, or a list of dicts as one in-memory shard.

    Args:
        obj: a :class:`Dataset`, or a list (or tuple) of dicts.
        name: the name given to a dataset made from a list.

    Returns:
        The dataset.

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


# -- file discovery -----------------------------------------------------------------------------------


def _compression_of(filename: str, forced: bool) -> tuple[bool, str | None]:
    """(is JSONL, compression) of a file name; ``forced`` reads any name as JSONL."""
    lower = filename.lower()
    for suffix, compression in SUFFIXES.items():
        if lower.endswith(suffix):
            return True, compression
    if forced:
        if lower.endswith(".gz"):
            return True, "gzip"
        if lower.endswith((".zst", ".zstd")):
            return True, "zstd"
        return True, None
    return False, None


def _missing(name: str, path: str) -> FileNotFoundError:
    return FileNotFoundError(f"dataset {name!r}: path {path} does not exist")


def _find_files(name: str, path: Any, *, forced: bool, recursive: bool) -> list[tuple[str, str, str | None]]:
    """``(absolute path, shard id, compression)`` of every shard, sorted by shard id."""
    supported = ", ".join(SUFFIXES)
    if isinstance(path, (str, os.PathLike)):
        full = os.path.abspath(os.fspath(path))
        if os.path.isdir(full):
            return _scan_folder(name, full, forced=forced, recursive=recursive)
        if not os.path.exists(full):
            raise _missing(name, full)
        if not os.path.isfile(full):
            raise ValueError(f"dataset {name!r}: {full} is neither a file nor a folder")
        paths = [full]
    elif isinstance(path, Iterable) and not isinstance(path, (bytes, Mapping)):
        paths = [os.path.abspath(os.fspath(p)) for p in path]
        if not paths:
            raise ValueError(f"dataset {name!r}: the list of files is empty")
    else:
        raise TypeError(
            f"dataset {name!r}: path must be a folder, a file or a list of files, got {type(path).__name__}"
        )
    for p in paths:
        if not os.path.exists(p):
            raise _missing(name, p)
        if not os.path.isfile(p):
            raise ValueError(f"dataset {name!r}: {p} is not a file; list files, or pass a folder on its own")
        if not _compression_of(os.path.basename(p), forced)[0]:
            raise ValueError(
                f"dataset {name!r}: cannot tell the format of {p} from its name; supported endings: {supported}. "
                "Pass fmt='jsonl' if it holds one JSON object per line."
            )
    real = [os.path.realpath(p) for p in paths]
    if len(set(real)) != len(real):
        twice = sorted({p for p, r in zip(paths, real) if real.count(r) > 1})
        raise ValueError(f"dataset {name!r}: files listed more than once: {twice}")
    root = os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath([os.path.dirname(p) for p in paths])
    found = [
        (p, os.path.relpath(p, root).replace(os.sep, "/"), _compression_of(os.path.basename(p), forced)[1])
        for p in paths
    ]
    return sorted(found, key=lambda item: item[1])


def _scan_folder(name: str, root: str, *, forced: bool, recursive: bool) -> list[tuple[str, str, str | None]]:
    found: list[tuple[str, str, str | None]] = []
    seen: list[str] = []
    subfolders = False
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for filename in sorted(files):
            full = os.path.join(folder, filename)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            seen.append(rel)
            if filename.startswith(".") or not os.path.isfile(full):
                continue
            ok, compression = _compression_of(filename, forced)
            if ok:
                found.append((full, rel, compression))
        if not recursive:
            subfolders = bool(dirs)
            seen.extend(d + "/" for d in dirs)
            break
    if not found:
        listing = ", ".join(seen[:_LISTED]) + (f" and {len(seen) - _LISTED} more" if len(seen) > _LISTED else "")
        hint = " Subfolders are not searched; pass recursive=True to include them." if subfolders else ""
        raise ValueError(
            f"dataset {name!r}: no JSONL files in {root} (found: {listing or 'nothing'}); supported endings: "
            f"{', '.join(SUFFIXES)}. Pass fmt='jsonl' to read other files as JSONL.{hint}"
        )
    return sorted(found, key=lambda item: item[1])
