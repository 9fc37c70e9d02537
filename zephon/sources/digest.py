"""Content identity of shard files: a SHA-256 of the bytes, taken once per file and cached.

A byte-identical copy is the same shard; one changed byte makes another. Digests are kept in
``<cache>/digests/`` (a JSON entry per real path) and a per-process memo, keyed by the *stat key*
(device, inode, size, mtime, ctime: every write changes ctime). A digest taken while the file
changed is not kept; an unwritable folder warns once. :func:`check_file` runs before every read.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..core.atomic import replacing

#: The digest's name, the prefix of every identity it makes (``sha256=<hex>``).
ALGORITHM = "sha256"
BLOCK = 1 << 20  # bytes hashed per read
#: Files digested at once when a dataset is opened (``hashlib`` releases the GIL while hashing).
PARALLEL = 8
_VERSION = 1

StatKey = tuple[int, int, int, int, int]


class ShardChangedError(ValueError):
    """A shard file changed (other bytes) after its dataset was opened, so its rows cannot be read;
    the message names the dataset, the file and what changed."""


def default_cache_dir() -> str:
    """The cache folder: ``$ZEPHON_CACHE_DIR`` if set, else ``~/.cache/zephon``."""
    return os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> str:
    """An absolute cache folder from an explicit value or the default."""
    root = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    return os.path.abspath(os.path.expanduser(root))


def stat_key(st: os.stat_result) -> StatKey:
    """What any change to a file changes: ``(device, inode, size, mtime_ns, ctime_ns)``."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_file(path: str) -> str:
    """The identity of a file's bytes, ``"sha256=<hex>"``."""
    h = hashlib.sha256()
    block = bytearray(BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            h.update(view[:n])
    return f"{ALGORITHM}={h.hexdigest()}"


_memo: dict[tuple[str, Any], str] = {}
_memo_lock = threading.Lock()
_warned: set[str] = set()


def cached(cache_dir: str, name: str, key: Any, compute: Callable[[], str], *, keep: Callable[[], bool] = lambda: True, usable: Callable[[str], bool] = lambda d: True) -> str:
    """The digest recorded for ``(name, key)`` (if ``usable``), else ``compute()`` recorded (when ``keep()``)."""
    key = json.loads(json.dumps(key))  # as it reads back
    memo = (name, json.dumps(key))
    with _memo_lock:
        hit = _memo.get(memo)
    if hit is not None and usable(hit):
        return hit
    entry = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    where = os.path.join(cache_dir, "digests", entry + ".json")
    try:
        with open(where, "rb") as f:
            doc = json.loads(f.read())
        if doc.get("v") == _VERSION and doc.get("name") == name and doc.get("key") == key and isinstance(doc.get("digest"), str) and usable(doc["digest"]):
            with _memo_lock:
                _memo[memo] = doc["digest"]
            return doc["digest"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = compute()
    if not keep():
        return digest
    with _memo_lock:
        _memo[memo] = digest
    doc = json.dumps({"v": _VERSION, "name": name, "key": key, "digest": digest}).encode()
    instead = "keeping shard digests in memory, so every process reads the files again"
    write_cache(where, lambda out: out.write(doc), instead)
    return digest


def write_cache(target: str, write: Callable[[Any], None], instead: str) -> bool:
    """Write the cache file ``target`` atomically; False, with one warning per folder saying what
    happens ``instead``, if its folder cannot be written (other errors propagate)."""
    folder = os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        with replacing(target) as out:
            write(out)
        return True
    except OSError as err:
        if folder not in _warned:
            _warned.add(folder)
            warnings.warn(
                f"zephon cache folder {folder} cannot be written ({type(err).__name__}: {err}); "
                f"{instead}. Pass cache_dir= or set ZEPHON_CACHE_DIR to a writable folder to keep "
                "them across processes.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False


def file_digest(path: str, cache_dir: str, key: StatKey | None = None) -> str:
    """The identity of the file at ``path`` (at stat key ``key`` if known), cached; a digest taken
    while the file changed is returned but not recorded."""
    key = key or stat_key(os.stat(path))

    def unchanged() -> bool:
        try:
            return stat_key(os.stat(path)) == key
        except OSError:
            return False

    return cached(cache_dir, os.path.realpath(path), list(key), lambda: hash_file(path), keep=unchanged)


def file_digests(paths: list[str], cache_dir: str, keys: list[StatKey]) -> list[str]:
    """:func:`file_digest` of many files (with their stat keys), up to :data:`PARALLEL` at once."""
    if len(paths) <= 1:
        return [file_digest(p, cache_dir, k) for p, k in zip(paths, keys)]
    with ThreadPoolExecutor(min(PARALLEL, len(paths))) as pool:
        return list(pool.map(lambda pk: file_digest(pk[0], cache_dir, pk[1]), zip(paths, keys)))


def short(identity: str | None) -> str:
    """``sha256=1a2b3c4d5e6f…`` for messages."""
    if not identity:
        return "none"
    name, _, value = identity.partition("=")
    return f"{name} {value[:12]}…" if value else identity[:16]


def check_file(shard: Any, dataset: str, when: str, fix: str | None = None) -> os.stat_result:
    """One ``stat`` of ``shard.path``; raises ``FileNotFoundError`` or ``ShardChangedError`` unless
    the file still holds the shard's bytes (digested again when its stat key differs from
    ``seen``, which is then updated). ``when`` and ``fix`` are for messages."""
    try:
        st = os.stat(shard.path)
    except FileNotFoundError:
        if when == "while reading":
            raise FileNotFoundError(f"dataset {dataset!r}: shard file {shard.path} was removed while reading; restore the file or open the dataset again.") from None
        raise FileNotFoundError(f"dataset {dataset!r}: shard file {shard.path} no longer exists; it was there when the dataset was opened. Restore the file or open the dataset again.") from None
    key = stat_key(st)
    if key == shard.seen:
        return st
    if st.st_size != shard.size:
        raise changed(shard, dataset, when, st, None, fix)
    now = file_digest(shard.path, shard.cache_dir, key)
    if now != shard.digest:
        raise changed(shard, dataset, when, st, now, fix)
    shard.seen = key
    return st


def changed(shard: Any, dataset: str, when: str, st: os.stat_result, now: str | None, fix: str | None = None) -> ShardChangedError:
    """The error for a shard file whose size (``now`` is ``None``) or bytes differ."""
    times = ""
    if shard.seen is not None:
        was = shard.seen[3]
        times = f"; mtime_ns was {was}, now {st.st_mtime_ns}" if was != st.st_mtime_ns else "; its modification time is the same"
    what = "" if now is None else f"; its content differs ({short(shard.digest)} → {short(now)})"
    return ShardChangedError(
        f"dataset {dataset!r}: shard file {shard.path} changed {when}: size was {shard.size} bytes, now {st.st_size}{times}{what}. "
        "Rows are located by byte offsets fixed when the dataset was opened, so reading the changed file would shift or "
        "garble samples. "
        + (fix or "Leave shard files untouched while a dataset is in use (write new files beside them), and open the dataset again with Dataset.from_path to read the new content.")
    )
