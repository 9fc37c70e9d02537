"""JSONL shards: line-offset indexes and their cache, decompression, fast row decoding.

A row is a byte range of an ``mmap`` (from a cached ``int64`` line-offset index), decoded with
``msgspec``. Indexes (``<cache>/index/``) and decompressed copies (``<cache>/decompressed/``) are
keyed by the content digest and written atomically; an unwritable cache keeps them in memory
(one warning per folder). Each process maps at most :data:`MAX_OPEN_SHARDS` shards (LRU). Besides
the checks of every file shard (:mod:`zephon.sources.files`), a mapped decompressed copy must keep
its length (a shrunk mapping crashes the process), and ``verify="full"`` hashes the file again at
most once a second and 1% of the time.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import mmap
import os
import time
from typing import Any, Callable

import msgspec
import numpy as np

from ..core.atomic import discard
from ..core.cache import ProcessCache
from ..core.bad_records import RecordDecodeError
from .digest import ShardChangedError, check_file, write_cache
from .files import FileIdentity

#: File name endings read as JSONL, and the compression each implies.
SUFFIXES: dict[str, str | None] = {".jsonl": None, ".jsonl.gz": "gzip", ".jsonl.zst": "zstd"}

#: Shards kept mapped per process; older ones are unmapped and reopened on their next read.
MAX_OPEN_SHARDS = 128

_INDEX_MAGIC = b"ZPHIDX02"
_INDEX_HEADER = 32  # magic, then little-endian int64 size, content stamp, rows
_SCAN_BLOCK = 1 << 26  # bytes compared per numpy pass while looking for newlines
_COPY_BLOCK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_JSON_WS = b" \t\r\n"
_SNIPPET = 120
_ZSTD_BLOCK = 1 << 16  # compressed bytes per decompress call (bounds the output of one call)

#: ``verify`` settings of :meth:`zephon.io.Dataset.from_path`.
VERIFY_MODES = ("quick", "full")
# With verify="full", a mapped file's content is hashed again at most every _RECHECK_S seconds,
# and never more than _RECHECK_SHARE of the time (hashing a large file takes long).
_RECHECK_S = 1.0
_RECHECK_SHARE = 0.01

_DECODE = msgspec.json.Decoder(dict)
_DECODE_ANY = msgspec.json.Decoder()
_KINDS = {list: "array", str: "string", bool: "boolean", type(None): "null"}  # else "number"


def _path_key(path: str) -> str:
    return hashlib.blake2b(os.path.realpath(path).encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


_UNWRITABLE = (
    "keeping JSONL indexes and decompressed shards in memory, so every process rebuilds them"
)


def stamp(digest: str | None) -> int:
    """A cache entry's 64-bit stamp of a content digest: entries of other content do not match."""
    value = hashlib.blake2b((digest or "").encode(), digest_size=8).digest()
    return int.from_bytes(value, "little", signed=True)


def build_line_index(buf: Any) -> np.ndarray:
    """Byte offsets of every non-blank line of ``buf`` (bytes, mmap, memoryview), then its length.

    A line of only JSON whitespace is blank; a last line without a newline counts; a leading
    UTF-8 byte-order mark is skipped. Row ``i`` is ``buf[offsets[i]:offsets[i + 1]]``.

    Example:
        >>> build_line_index(b'{"a": 1}\\n\\n  \\n{"a": 2}').tolist()
        [0, 13, 21]
    """
    size = len(buf)
    if size == 0:
        return np.zeros(1, dtype=np.int64)
    data = np.frombuffer(buf, dtype=np.uint8)
    newlines = [np.flatnonzero(data[lo : lo + _SCAN_BLOCK] == 10) + lo for lo in range(0, size, _SCAN_BLOCK)]
    nl = np.concatenate(newlines).astype(np.int64, copy=False)
    first = 3 if size >= 3 and bytes(buf[:3]) == _BOM else 0
    starts = np.concatenate((np.array([first], dtype=np.int64), nl + 1))
    ends = np.concatenate((nl, np.array([size], dtype=np.int64)))
    keep = ends > starts
    # Only lines that start with whitespace can be blank; check those few one by one.
    head = data[np.minimum(starts, size - 1)]
    maybe_blank = keep & ((head == 32) | (head == 9) | (head == 13))
    for i in np.flatnonzero(maybe_blank).tolist():
        if not bytes(buf[starts[i] : ends[i]]).strip(_JSON_WS):
            keep[i] = False
    return np.concatenate((starts[keep], np.array([size], dtype=np.int64)))


def _index_file(cache_dir: str, data_path: str) -> str:
    return os.path.join(cache_dir, "index", _path_key(data_path) + ".idx")


def load_index(cache_dir: str, data_path: str, size: int, content: int, *, rows_only: bool = False) -> Any:
    """The cached index of ``data_path`` matching ``size`` and ``content`` (a :func:`stamp`), else
    ``None``; with ``rows_only``, its row count from the header."""
    try:
        with open(_index_file(cache_dir, data_path), "rb") as f:
            head = f.read(_INDEX_HEADER)
            if len(head) != _INDEX_HEADER or head[:8] != _INDEX_MAGIC:
                return None
            c_size, c_stamp, rows = (int(x) for x in np.frombuffer(head, dtype="<i8", offset=8))
            if c_size != size or c_stamp != content or rows < 0:
                return None
            if rows_only:
                return rows
            offsets = np.fromfile(f, dtype="<i8", count=rows + 1)
    except (OSError, ValueError):
        return None
    if offsets.shape[0] != rows + 1 or int(offsets[-1]) != size:
        return None
    return offsets.astype(np.int64, copy=False)


def save_index(cache_dir: str, data_path: str, size: int, content: int, offsets: np.ndarray) -> bool:
    """Cache ``offsets`` for ``data_path`` (atomically); False when the cache cannot be written."""
    header = _INDEX_MAGIC + np.array([size, content, offsets.shape[0] - 1], dtype="<i8").tobytes()
    body = offsets.astype("<i8", copy=False).tobytes()
    target = _index_file(cache_dir, data_path)
    return write_cache(target, lambda out: out.writelines((header, body)), _UNWRITABLE)


class _SourceError(Exception):
    """A compressed source could not be read (kept apart from cache-write failures)."""


def _chunks(source: str, compression: str):
    """Decompressed blocks of ``source``; unreadable input raises :class:`_SourceError`."""
    hint = f"gzip -t {source}" if compression == "gzip" else f"zstd -t {source}"
    if compression != "gzip":  # a missing package is not a bad file
        try:
            import zstandard as zstd
        except ImportError:
            raise ImportError(
                "reading .jsonl.zst shards needs the optional zstandard package: pip install zstandard "
                "(or pip install zephon-lanes[zstd])"
            ) from None
    try:
        if compression == "gzip":  # gzip raises EOFError itself when the last member is cut short
            with gzip.open(source, "rb") as reader:
                yield from iter(lambda: reader.read(_COPY_BLOCK), b"")
        else:
            yield from _zstd_blocks(zstd, source)
    except Exception as err:  # gzip raises OSError/EOFError, zstandard its own ZstdError
        raise _SourceError(
            f"could not decompress {source} ({err.__class__.__name__}: {err}); check the file is complete "
            f"and really {compression}-compressed (for example with `{hint}`), or re-create it"
        ) from err


def _zstd_blocks(zstd: Any, source: str):
    """Decompressed blocks of a zstd file, frame by frame, so that a cut-short last frame raises
    (zstandard's stream reader would stop quietly)."""
    dctx = zstd.ZstdDecompressor()
    frame = dctx.decompressobj()
    inside = False  # whether the current frame has had input and not ended
    with open(source, "rb") as f:
        while True:
            data = f.read(_ZSTD_BLOCK)
            if not data:
                break
            while data:
                inside = True
                block = frame.decompress(data)
                if block:
                    yield block
                if not frame.eof:
                    break
                data = frame.unused_data  # the start of the next frame, if any
                frame = dctx.decompressobj()
                inside = False
    if inside:
        raise EOFError(
            "the file ends inside a zstd frame (it was cut short, for example by an interrupted copy or write)"
        )


def _decompressed_file(cache_dir: str, source: str, size: int, digest: str | None) -> str:
    version = hashlib.blake2b(f"3:{size}:{digest}".encode(), digest_size=8).hexdigest()
    return os.path.join(cache_dir, "decompressed", f"{_path_key(source)}-{version}.jsonl")


def decompress(cache_dir: str, source: str, compression: str, size: int, digest: str | None) -> str | bytes:
    """The decompressed text of ``source``: a cache file path (older copies removed), or bytes if
    the cache is unwritable."""
    target = _decompressed_file(cache_dir, source, size, digest)
    if os.path.isfile(target):
        return target
    blocks = functools.partial(_chunks, source, compression)
    try:
        if not write_cache(target, lambda out: out.writelines(blocks()), _UNWRITABLE):
            return b"".join(blocks())
    except _SourceError as err:
        raise ValueError(str(err)) from err.__cause__
    prefix = os.path.basename(target).split("-")[0] + "-"
    folder = os.path.dirname(target)
    for name in os.listdir(folder):
        if name.startswith(prefix) and name != os.path.basename(target):
            discard(os.path.join(folder, name))
    return target


# The :class:`_Open` of each shard in use by ``id(shard)``, dropped with the shard; the most recent
# MAX_OPEN_SHARDS stay. Read-only mappings stay valid in a forked child.
_MAPS = ProcessCache(clear_after_fork=False, max_entries=lambda: MAX_OPEN_SHARDS)


class _Open:
    """A shard as this process holds it: its text, line offsets, and what was opened."""

    __slots__ = ("buf", "offsets", "mapped", "length", "inode", "checked", "check_s")

    def __init__(self, buf: Any, offsets: np.ndarray, mapped: mmap.mmap | None, inode: tuple[int, int], check_s: float):
        self.buf = buf
        self.offsets = offsets
        self.mapped = mapped  # the mapping behind ``buf``; None for text held in memory
        self.length = len(buf)
        self.inode = inode  # (st_dev, st_ino) of the source file when it was opened
        self.checked = time.monotonic()  # when the content was last hashed (verify="full")
        self.check_s = check_s  # how long that took


def _map(path: str) -> tuple[memoryview, mmap.mmap | None, os.stat_result]:
    """``(memoryview, mapping, stat)`` of a file mapped read-only (no mapping for an empty file)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size == 0:
            return memoryview(b""), None, st
        mapped = mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_READ)
        return memoryview(mapped), mapped, st


class JsonlShard(FileIdentity):
    """One JSONL file (plain, gzip or zstd) read by random access.

    Attributes:
        path, shard_id, size, digest, seen, cache_dir, verify, num_rows: as for every file shard.
        compression: ``None``, ``"gzip"`` or ``"zstd"``.
    """

    __slots__ = FileIdentity._id_fields + ("compression", "__weakref__")

    def __init__(self, path: str, shard_id: str, compression: str | None, cache_dir: str, verify: str = "quick", digest: str | None = None):
        self._init_identity(path, shard_id, verify, cache_dir, digest)
        self.compression = compression

    def __del__(self) -> None:
        # The mapping is keyed by id(self), which a later object may reuse: drop it with the shard.
        if _MAPS is not None:  # None while the interpreter shuts down
            _MAPS.discard(id(self))

    def _mapped(self, dataset: str) -> _Open:
        """The open shard, mapping the file on first use in this process."""
        return _MAPS.get(id(self), lambda: self._load(dataset))

    def count_rows(self, dataset: str, io: Any = None) -> int:
        """Count rows once (at dataset creation), from a cached index header when there is one."""
        plain, size = self.path, self.size
        if self.compression is not None:
            plain = _decompressed_file(self.cache_dir, self.path, self.size, self.digest)
            try:
                size = os.stat(plain).st_size
            except OSError:
                size = -1  # no copy yet: no index matches
        rows = load_index(self.cache_dir, plain, size, stamp(self.digest), rows_only=True)
        if rows is None:
            rows = self._mapped(dataset).offsets.shape[0] - 1
        self.num_rows = rows
        return rows

    def _verify(self, state: _Open, dataset: str) -> _Open:
        """``state`` once the file is known to be the one opened, before touching the mapping (a
        shrunk file's lost pages are a ``SIGBUS``); raises if it changed."""
        st = check_file(self, dataset, "while reading")
        if (st.st_dev, st.st_ino) != state.inode:
            # Replaced by a file with the same bytes (a copy): map the new one.
            _MAPS.discard(id(self))
            return self._mapped(dataset)
        if self.compression is not None and state.mapped is not None:
            now = state.mapped.size()  # an fstat of the mapped copy
            if now != state.length:
                raise ShardChangedError(
                    f"dataset {dataset!r}: the decompressed copy of shard file {self.path} in {self.cache_dir} "
                    f"changed while reading: size was {state.length} bytes, now {now}. Something other than zephon "
                    "wrote to the cache folder; leave it alone while datasets are in use, and open the dataset again."
                )
        wait = max(_RECHECK_S, state.check_s / _RECHECK_SHARE)
        if self.verify == "full" and time.monotonic() - state.checked >= wait:
            state.check_s = self.check_content(dataset)
            state.checked = time.monotonic()
        return state

    def _load(self, dataset: str) -> _Open:
        st = self.check_stat(dataset)
        if self.compression is None:
            for attempt in range(3):  # the file checked must be the file mapped
                try:
                    buf, mapped, mst = _map(self.path)
                except FileNotFoundError:
                    mst = None
                if mst is not None and (mst.st_dev, mst.st_ino, mst.st_size) == (st.st_dev, st.st_ino, st.st_size):
                    break
                if attempt == 2:
                    raise ShardChangedError(f"dataset {dataset!r}: shard file {self.path} is being replaced again and again while it is opened; leave shard files untouched while a dataset is in use")
                st = self.check_stat(dataset)
        check_s = self.check_content(dataset)
        content = stamp(self.digest)
        plain: str | None = self.path
        size = st.st_size
        if self.compression is not None:
            buf, mapped, plain, size = self._decompressed()
        offsets = None if plain is None else load_index(self.cache_dir, plain, size, content)
        if offsets is None:
            offsets = build_line_index(buf)
            if plain is not None:
                save_index(self.cache_dir, plain, size, content, offsets)
        if self.num_rows >= 0 and offsets.shape[0] - 1 != self.num_rows:
            raise ShardChangedError(
                f"dataset {dataset!r}: shard file {self.path} now has {offsets.shape[0] - 1} rows, not the "
                f"{self.num_rows} it had when the dataset was opened; open the dataset again."
            )
        return _Open(buf, offsets, mapped, (st.st_dev, st.st_ino), check_s)

    def _decompressed(self) -> tuple[memoryview, mmap.mmap | None, str | None, int]:
        """``(buffer, mapping, cache path, size)`` of the decompressed text (mapping, path ``None``
        when it is held in memory)."""
        for attempt in range(2):
            text = decompress(self.cache_dir, self.path, self.compression or "", self.size, self.digest)
            if isinstance(text, bytes):
                return memoryview(text), None, None, len(text)
            try:
                buf, mapped, st = _map(text)
                return buf, mapped, text, st.st_size
            except FileNotFoundError:  # removed from the cache meanwhile: decompress again, once
                if attempt:
                    raise

    def read(self, rows: np.ndarray, dataset: str, io: Any = None) -> list:
        """Decode ``rows`` (validated ``int64``, any order, repeats allowed), in the order given."""
        state = self._verify(self._mapped(dataset), dataset)
        buf, offsets = state.buf, state.offsets
        return _decode_rows(buf, offsets, rows, lambda r, err: self._bad_row(buf, offsets, r, err, dataset))

    def _bad_row(self, buf: Any, offsets: np.ndarray, row: int, err: Exception, dataset: str) -> RecordDecodeError:
        a, b = int(offsets[row]), int(offsets[row + 1])
        line = int(np.count_nonzero(np.frombuffer(buf[:a], dtype=np.uint8) == 10)) + 1
        raw = bytes(buf[a:b]).strip(_JSON_WS)
        snippet = raw[:_SNIPPET].decode("utf-8", "replace") + ("..." if len(raw) > _SNIPPET else "")
        where = f"dataset {dataset!r}: {self.path}, line {line} (row {row})"
        if isinstance(err, msgspec.ValidationError):
            kind = _KINDS.get(type(_DECODE_ANY.decode(raw)), "number")
            return RecordDecodeError(
                f"{where} holds a JSON {kind}, not an object: {snippet!r}. Each line of a JSONL shard must be "
                'one JSON object such as {"text": "..."}; wrap the value in an object under a field name.',
                "NotAnObject",
            )
        return RecordDecodeError(
            f"{where} is not valid JSON ({err}): {snippet!r}. Each non-blank line of a JSONL shard must be one "
            "complete JSON object on a single line; fix or remove that line (blank lines are skipped).",
            "JSONDecodeError",
        )


class _Miscount(Exception):
    """A byte range decoded to more values than lines (two objects on one line)."""


def _decode_rows(buf: Any, offsets: np.ndarray, rows: np.ndarray, bad: Callable[[int, Exception], Exception]) -> list:
    """Decode ``rows`` of a JSONL buffer in the order given: sorted runs of consecutive rows are one
    ``decode_lines`` call each; repeats are decoded again, so no two payloads share objects."""
    n = rows.shape[0]
    if n == 0:
        return []
    if n == 1:
        r = int(rows[0])
        try:
            return [_DECODE.decode(buf[offsets[r] : offsets[r + 1]])]
        except msgspec.DecodeError as err:
            raise bad(r, err) from None
    step = np.diff(rows)
    order = None
    if (step < 0).any():
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        step = np.diff(rows)
    cut = np.flatnonzero(step != 1) + 1
    first = np.concatenate(([0], cut))
    last = np.concatenate((cut, [n])) - 1
    lo = offsets[rows[first]].tolist()
    hi = offsets[rows[last] + 1].tolist()
    count = (last - first + 1).tolist()
    out: list = []
    try:
        for a, b, k in zip(lo, hi, count):
            if k == 1:
                out.append(_DECODE.decode(buf[a:b]))
            else:
                values = _DECODE.decode_lines(buf[a:b])
                if len(values) != k:
                    raise _Miscount
                out.extend(values)
    except (msgspec.DecodeError, _Miscount):
        out = []
        for r in rows.tolist():
            try:
                out.append(_DECODE.decode(buf[offsets[r] : offsets[r + 1]]))
            except msgspec.DecodeError as err:
                raise bad(r, err) from None
    if order is None:
        return out
    result: list = [None] * n
    for i, payload in zip(order.tolist(), out):
        result[i] = payload
    return result
