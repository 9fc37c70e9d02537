"""Remote shards: a small storage interface over fsspec, and a local shard cache.

A remote shard is read from a whole copy in a cache folder shared by a machine's processes,
keyed by URL and identity (size and ETag or checksum, else a content digest), so a changed object
is refused (:class:`~zephon.io.ShardChangedError`). Copies are written atomically under an
``flock`` on ``.lock-<name>`` (one download per machine), never touched after (last use: the mtime
of ``.used-<name>``), evicted least recently used past ``max_bytes``, and need room on the disk.
Downloads retry transient errors with exponential backoff. Filesystems are made once per process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
import time
from typing import Any, Callable, Mapping

import attrs

from ..core.atomic import discard, replacing
from ..core.cache import ProcessCache
from .digest import ShardChangedError, default_cache_dir

#: Errors of these ``errno`` values are retried.
_TRANSIENT_ERRNO = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EAGAIN, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EBUSY}
#: Exception class names (of storage client libraries) that mean "try again".
_TRANSIENT_NAMES = ("Timeout", "Throttl", "SlowDown", "TooManyRequests", "ServiceUnavailable", "Transient", "RetryError", "ServerDisconnected", "ClientPayloadError")
_COPY = 1 << 22


def _size(value: Any, field: str) -> int | None:
    """Bytes from an int or a string like ``"500mb"``, ``"2GiB"``; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "").removesuffix("b").removesuffix("i")
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        scale = units.get(text[-1:], 1)
        try:
            value = int(float(text[:-1] if scale > 1 else text) * scale)
        except ValueError:
            raise ValueError(f"io_options: {field} must be a number of bytes or a size like '500mb', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"io_options: {field} must be a positive number of bytes, got {value!r}")
    return value


@attrs.frozen
class CacheOptions:
    """The local shard cache of remote datasets.

    Attributes:
        enabled: read remote shards through the cache (``False``: reading one is an error).
        dir: the cache folder; default ``<ZEPHON_CACHE_DIR or ~/.cache/zephon>/shards``.
        max_bytes: size limit (an int or ``"50gb"``; LRU eviction); ``None``: unbounded.
        retries: attempts after the first on transient download errors.
        backoff_s, max_backoff_s: the first wait before a retry (doubled each time), the longest.
    """

    enabled: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    dir: str | None = attrs.field(default=None, converter=lambda v: None if v is None else os.path.abspath(os.path.expanduser(os.fspath(v))))
    max_bytes: int | None = attrs.field(default=None, converter=lambda v: _size(v, "cache.max_bytes"))
    retries: int = attrs.field(default=5, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    backoff_s: float = attrs.field(default=0.1, converter=float, validator=attrs.validators.ge(0))
    max_backoff_s: float = attrs.field(default=5.0, converter=float, validator=attrs.validators.ge(0))

    @property
    def folder(self) -> str:
        return self.dir or os.path.join(os.path.abspath(default_cache_dir()), "shards")


@attrs.frozen
class IoOptions:
    """How shards are fetched and cached; never what they hold (not in the fingerprint).

    Attributes:
        cache: the shard cache (:class:`CacheOptions`, or a dict of its fields).
        row_group_cache_bytes: per-process bound of decoded Parquet row groups (int or ``"256mb"``).
        remote_parquet: ``"ranges"``: read remote Parquet with an ETag or checksum by byte ranges,
            only the row groups needed; ``"whole"``: from a whole copy in the shard cache.
    """

    cache: CacheOptions = attrs.field(factory=CacheOptions, converter=lambda v: _as_options(CacheOptions, v, "cache"))
    row_group_cache_bytes: int = attrs.field(default=64 << 20, converter=lambda v: _size(v, "row_group_cache_bytes"))
    remote_parquet: str = attrs.field(default="ranges", validator=attrs.validators.in_(("ranges", "whole")))


def _as_options(cls: type, value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"io_options: {where} must be a dict or {cls.__name__}, got {type(value).__name__}")
    known = [f.name for f in attrs.fields(cls)]
    aliases = {"root": "dir", "limit_bytes": "max_bytes"}  # other accepted spellings (docs/guide/sources.md)
    value = {aliases.get(k, k): v for k, v in value.items()}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise TypeError(f"io_options: unknown {where} option(s) {unknown}; known: {known}")
    return cls(**value)


def io_options(value: Any) -> IoOptions:
    """``value`` (``None``, a dict or :class:`IoOptions`) as :class:`IoOptions`."""
    return IoOptions() if value is None else _as_options(IoOptions, value, "io_options")


# -- URLs and filesystems -----------------------------------------------------------------------------


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL read through fsspec (``file://`` URLs are local paths)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError("reading remote datasets needs fsspec: pip install 'zephon-lanes[remote]' (plus s3fs, gcsfs, adlfs for those stores)") from None
    return fsspec


_FILESYSTEMS = ProcessCache()


def filesystem(protocol: str, storage_options: tuple = ()) -> Any:
    """The fsspec filesystem of ``protocol``, built once per process."""
    return _FILESYSTEMS.get((protocol, storage_options), lambda: _fsspec().filesystem(protocol, **dict(storage_options)))


def split_url(url: str) -> tuple[str, str]:
    protocol, _, rest = url.partition("://")
    return protocol, rest


def identity_of(info: Mapping[str, Any]) -> str | None:
    """A remote file's identity from an fsspec ``info``: its ETag or checksum (never a time)."""
    for key in ("ETag", "etag", "md5Hash", "md5", "crc32c", "checksum", "content_md5", "sha", "oid"):
        value = info.get(key)
        if value:
            return f"{key.lower()}={str(value).strip(chr(34))}"
    return None


def transient(err: BaseException) -> bool:
    """Whether a storage error is worth retrying."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNO:
        return True
    return any(name in type(err).__name__ for name in _TRANSIENT_NAMES)


class StorageError(OSError):
    """A remote shard could not be fetched: a permanent error, or retries exhausted. Names the URL."""


def with_retries(url: str, what: str, call: Callable[[], Any], options: CacheOptions, sleep: Callable[[float], None] = time.sleep) -> Any:
    """``call()``, retried on transient errors; a permanent error is raised naming ``url``."""
    wait = options.backoff_s
    for attempt in range(options.retries + 1):
        try:
            return call()
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{what} {url}: no such object ({err}); it was listed when the dataset was opened, so it was removed; open the dataset again") from err
        except Exception as err:
            if not transient(err):
                raise StorageError(f"{what} {url} failed ({type(err).__name__}: {err}); not retried: the error is not a transient one") from err
            if attempt == options.retries:
                raise StorageError(f"{what} {url} failed {attempt + 1} times ({type(err).__name__}: {err}); raise io_options cache.retries or check the store") from err
            sleep(wait)
            wait = min(options.max_backoff_s, wait * 2 if wait else 0.0)


# -- the shard cache ------------------------------------------------------------------------------------


def cached_name(url: str, size: int, identity: str) -> str:
    key = hashlib.blake2b(f"{url}\0{size}\0{identity}".encode(), digest_size=16).hexdigest()
    base = url.rstrip("/").rsplit("/", 1)[-1][-80:]
    return f"{key}-{base}"


def _used(folder: str, name: str) -> str:
    return os.path.join(folder, ".used-" + name)


def _mark_used(folder: str, name: str) -> None:
    """Record a use of the copy ``name`` (for LRU eviction) without touching the copy itself."""
    marker = _used(folder, name)
    try:
        os.utime(marker)
    except FileNotFoundError:
        with contextlib.suppress(OSError), open(marker, "ab"):
            pass  # the order of use is a hint; reading goes on
    except OSError:
        pass


def fetch(url: str, fs: Any, size: int, identity: str, options: CacheOptions, dataset: str) -> str:
    """The local copy of ``url`` (downloaded once, whole).

    Raises ``ShardChangedError`` (size or identity differ from the recorded ones),
    ``StorageError`` (a permanent error, or retries exhausted), ``ValueError`` (the cache is
    disabled or smaller than the shard).
    """
    _require_cache(options, url, dataset)
    folder = options.folder
    name = cached_name(url, size, identity)
    target = os.path.join(folder, name)
    if _complete(target, size):
        _mark_used(folder, name)
        return target
    _require_cache(options, url, dataset, size)
    info = with_retries(url, "checking", lambda: fs.info(url), options)
    listed = identity_of(info)
    now = (int(info.get("size") or 0), listed or identity)
    if now[0] != size or (listed is not None and listed != identity):
        raise changed_object(dataset, url, size, identity, *now)
    os.makedirs(folder, exist_ok=True)
    with download_lock(folder, name):
        if _complete(target, size):  # another process of this machine downloaded it meanwhile
            _mark_used(folder, name)
            return target
        make_room(folder, options.max_bytes, size, url, dataset)
        by_content = listed is None  # a store without checksums: the identity is the content's digest
        digest = with_retries(url, "downloading", lambda: _download(fs, url, target, size, by_content), options)
        discard(_used(folder, name))
        if by_content and digest != identity:
            discard(target)
            raise changed_object(dataset, url, size, identity, size, digest)
    return target


def _complete(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


@contextlib.contextmanager
def download_lock(folder: str, name: str) -> Any:
    """Hold the machine-wide ``flock`` on ``.lock-<name>`` while downloading the copy ``name``.

    The empty lock file stays. Without ``fcntl`` there is no lock (a copy may download twice).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX systems
        yield
        return
    with open(os.path.join(folder, ".lock-" + name), "ab") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _download(fs: Any, url: str, target: str, size: int, hashed: bool = True) -> str:
    """Copy ``url`` to ``target`` (atomically); the digest of its content (when ``hashed``)."""
    h = hashlib.sha256()
    with replacing(target) as out, fs.open(url, "rb") as src:
        got = 0
        while block := src.read(_COPY):
            out.write(block)
            if hashed:
                h.update(block)
            got += len(block)
        if got != size:
            raise ConnectionError(f"download ended after {got} of {size} bytes")
    return f"sha256={h.hexdigest()}"


def _require_cache(options: CacheOptions, url: str, dataset: str, size: int = 0) -> None:
    if not options.enabled:
        raise ValueError(f"dataset {dataset!r}: {url} is remote and the shard cache is disabled; remote shards are read from a local copy, so enable it: .options(io_options={{'cache': {{'enabled': True, 'dir': ..., 'max_bytes': ...}}}})")
    if options.max_bytes is not None and size > options.max_bytes:
        raise ValueError(f"dataset {dataset!r}: shard {url} has {size} bytes, more than the shard cache's max_bytes ({options.max_bytes}); raise io_options cache.max_bytes")


def fetch_by_content(url: str, fs: Any, size: int, options: CacheOptions, dataset: str) -> str:
    """Download ``url`` into the shard cache and return its identity, its content's digest (for
    stores without ETags or checksums; the copy is kept for later reads)."""
    _require_cache(options, url, dataset, size)
    folder = options.folder
    os.makedirs(folder, exist_ok=True)
    make_room(folder, options.max_bytes, size, url, dataset)
    pending = os.path.join(folder, f".pending-{os.getpid()}-{threading.get_ident()}-{cached_name(url, size, '')}")
    identity = with_retries(url, "downloading", lambda: _download(fs, url, pending, size), options)
    name = cached_name(url, size, identity)
    os.replace(pending, os.path.join(folder, name))
    discard(_used(folder, name))
    return identity


def changed_object(
    dataset: str, url: str, size: int, identity: str, now_size: int, now_identity: Any
) -> ShardChangedError:
    """The error for a remote object whose size or identity differ from those recorded."""
    return ShardChangedError(
        f"dataset {dataset!r}: remote shard {url} changed after the dataset was opened: it had {size} bytes and "
        f"{identity}, now {now_size} bytes and {now_identity}. Rows would shift or change; open the dataset again to read "
        "the new content (a checkpoint taken on the old content will not restore against it)."
    )


def make_room(folder: str, max_bytes: int | None, size: int, url: str, dataset: str) -> None:
    """Remove least recently used copies until ``size`` more bytes fit under ``max_bytes``; then
    raise unless the disk of ``folder`` has ``size`` free bytes for a copy of ``url``."""
    entries = []
    for entry in os.scandir(folder) if max_bytes is not None else ():  # no limit: evict nothing
        if entry.is_file() and not entry.name.startswith("."):
            st = entry.stat()
            try:
                used = os.stat(_used(folder, entry.name)).st_mtime_ns
            except OSError:
                used = st.st_mtime_ns
            entries.append((max(used, st.st_mtime_ns), st.st_size, entry.path))
    total = sum(e[1] for e in entries)
    for _, nbytes, path in sorted(entries):
        if total + size <= max_bytes:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        discard(_used(folder, os.path.basename(path)))
        total -= nbytes
    free = shutil.disk_usage(folder).free
    if free < size:
        raise StorageError(
            errno.ENOSPC,
            f"dataset {dataset!r}: no room in the shard cache {folder} for {url}: the copy needs {size} bytes and "
            f"the disk has {free} free. Free {size - free} bytes or more there, lower io_options cache.max_bytes "
            "so that older copies are evicted, or point cache.dir at a larger disk",
        )
