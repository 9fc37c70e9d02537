"""Finding a dataset's shards (folders, lists, globs, URLs; formats by ending) and its index file.

Discovery gives :class:`Found` shards sorted by id (the path relative to the root), each with its
format, size and identity: a content digest, or a remote ETag or checksum; never a time. The
dataset index (``.zephon-index.json``, ``zephon index PATH``) records each shard's identity, rows
and row groups, reused only while the identity matches.
"""

from __future__ import annotations

import functools
import glob as globlib
import json
import operator
import os
import warnings
from typing import Any, Callable, Iterable, Mapping

import msgspec

from ..core.atomic import replacing
from .columnar import ARROW_SUFFIXES, PARQUET_SUFFIXES
from .digest import cached, file_digests, resolve_cache_dir, stat_key
from .jsonl import SUFFIXES
from .storage import (
    CacheOptions,
    cached_name,
    fetch_by_content,
    filesystem,
    identity_of,
    is_url,
    local_path,
    split_url,
)
from .token_files import TOKEN_SUFFIXES

#: The formats ``Dataset.from_path`` reads, and the endings that select them.
FORMATS: dict[str, tuple[str, ...]] = {
    "jsonl": tuple(SUFFIXES),
    "parquet": PARQUET_SUFFIXES,
    "arrow": ARROW_SUFFIXES,
    "tokens": TOKEN_SUFFIXES,
}
INDEX_NAME = ".zephon-index.json"
INDEX_VERSION = 2  # 2: identities are content digests (1: modification times)
_LISTED = 10
_GLOB = "*?["


class Found(msgspec.Struct, frozen=True):
    """One shard found: location, id, format, compression, size, identity (``None`` until digested).

    ``seen``: a local file's stat key when found. ``indexed``: size, identity and ``seen`` come
    from the dataset index without a ``stat`` (``index="require"``), checked on first read.
    """

    location: str  # an absolute local path or a URL
    shard_id: str
    fmt: str
    compression: str | None
    size: int
    identity: str | None
    seen: tuple | None = None
    indexed: bool = False


def format_of(filename: str, forced: str | None) -> tuple[str, str | None] | None:
    """``(format, compression)`` of a file name, or ``None``; decided by the text from its
    second-to-last dot, which decides every ending in :data:`FORMATS`."""
    last = filename.rfind(".")
    cut = filename.rfind(".", 0, last) if last >= 0 else -1
    return _format_of("" if last < 0 else filename[cut if cut >= 0 else last :].lower(), forced)


@functools.lru_cache(maxsize=4096)
def _format_of(lower: str, forced: str | None) -> tuple[str, str | None] | None:
    if forced == "jsonl":
        if lower.endswith(".gz"):
            return "jsonl", "gzip"
        if lower.endswith((".zst", ".zstd")):
            return "jsonl", "zstd"
        return "jsonl", None
    if forced is not None:
        return forced, None
    for suffix, compression in SUFFIXES.items():
        if lower.endswith(suffix):
            return "jsonl", compression
    for fmt, suffixes in FORMATS.items():
        if fmt != "jsonl" and lower.endswith(suffixes):
            return fmt, None
    return None


def _endings() -> str:
    return "; ".join(f"{fmt}: {', '.join(s)}" for fmt, s in FORMATS.items())


def _missing(name: str, path: str) -> FileNotFoundError:
    return FileNotFoundError(f"dataset {name!r}: path {path} does not exist")


def _is_glob(path: str) -> bool:
    return any(c in path for c in _GLOB)


def _glob_root(pattern: str) -> str:
    """The folder part of a glob before its first wildcard."""
    head = pattern
    while _is_glob(head):
        head = os.path.dirname(head)
    return head


def discover(name: str, path: Any, *, fmt: str | None, recursive: bool, storage_options: Mapping[str, Any] | None, cache_dir: str | None = None, cache: CacheOptions | None = None, index: str = "auto") -> tuple[str, list[Found]]:
    """``(root, shards sorted by id)`` of what ``path`` names, with their identities (from the
    dataset index for unchanged local files unless ``index="off"``; objects without checksums are
    digested as they download into the shard cache)."""
    so = tuple(sorted((storage_options or {}).items()))
    cache_dir = resolve_cache_dir(cache_dir)
    cache = cache or CacheOptions()
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if is_url(text):
            root, found = _remote(name, [text], fmt, recursive, so, (cache_dir, cache), single=True)
        else:
            root, found = _local_one(name, os.path.abspath(local_path(text)), fmt, recursive, index)
    elif isinstance(path, Iterable) and not isinstance(path, (bytes, Mapping)):
        items = [os.fspath(p) for p in path]
        if not items:
            raise ValueError(f"dataset {name!r}: the list of files is empty")
        remote = [is_url(p) for p in items]
        if any(remote) and not all(remote):
            raise ValueError(f"dataset {name!r}: the list mixes local paths and URLs; a dataset lives in one place")
        if all(remote):
            root, found = _remote(name, items, fmt, recursive, so, (cache_dir, cache), single=False)
        else:
            root, found = _local_list(name, [os.path.abspath(local_path(p)) for p in items], fmt)
    else:
        raise TypeError(f"dataset {name!r}: path must be a folder, a file, a glob, a URL or a list of files, got {type(path).__name__}")
    formats = sorted({f.fmt for f in found})
    if len(formats) > 1:
        counts = {f: sum(x.fmt == f for x in found) for f in formats}
        raise ValueError(f"dataset {name!r}: {root} holds shards of several formats {counts}; a dataset has one format: pass fmt= or a glob such as '*.parquet', and make one dataset per format")
    ids = [f.shard_id for f in found]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"dataset {name!r}: files listed more than once: {twice}")
    local = any(f.identity is None for f in found)
    doc = read_index(root) if local and index != "off" else None
    indexed = doc.shards if doc is not None and doc.settings.get("fmt") == formats[0] else {}
    return root, _identified(sorted(found, key=lambda f: f.shard_id), cache_dir, indexed)


def _identified(found: list, cache_dir: str, indexed: Mapping[str, Any]) -> list[Found]:
    """``found`` with the local files' content digests as identities (several files at once): the
    index's for a file at the stat key it recorded (any write changes the ctime), else digested."""
    out = list(found)
    local = []
    for i, f in enumerate(found):
        entry = indexed.get(f.shard_id) if f.identity is None else None
        if entry is not None and f.seen is not None and entry.stat == f.seen:
            out[i] = msgspec.structs.replace(f, identity=entry.identity)
        elif f.identity is None:
            local.append(i)
    keys = [found[i].seen for i in local]
    digests = file_digests([found[i].location for i in local], cache_dir, keys)
    for i, digest in zip(local, digests):
        out[i] = msgspec.structs.replace(found[i], identity=digest)
    return out


def _relative(full: str, root: str) -> str:
    """``full``'s path below ``root``, with ``/`` separators."""
    prefix = root.rstrip(os.sep) + os.sep
    rel = full[len(prefix):] if full.startswith(prefix) else os.path.relpath(full, root)
    return rel.replace(os.sep, "/")


def _trusted(root: str, index: str) -> Mapping[str, IndexEntry]:
    """With ``index="require"``, the index's entries: listed files are taken without a ``stat``."""
    doc = read_index(root) if index == "require" else None
    return doc.shards if doc is not None else {}


def _local_found(full: str, shard_id: str, kind: tuple[str, str | None], stat: Callable[[], os.stat_result], trusted: Mapping[str, IndexEntry]) -> Found:
    entry = trusted.get(shard_id)
    if entry is not None and entry.stat is not None and entry.fmt == kind[0]:
        return Found(full, shard_id, kind[0], kind[1], entry.bytes, entry.identity, entry.stat, indexed=True)
    st = stat()
    return Found(full, shard_id, kind[0], kind[1], st.st_size, None, stat_key(st))


def _local_one(name: str, full: str, fmt: str | None, recursive: bool, index: str) -> tuple[str, list[Found]]:
    if os.path.isdir(full):
        return full, _scan_folder(name, full, fmt, recursive, _trusted(full, index))
    if _is_glob(full) and not os.path.exists(full):
        matches = sorted(p for p in globlib.glob(full, recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"dataset {name!r}: the glob {full} matches no files")
        root = _glob_root(full)
        trusted = _trusted(root, index)
        return root, [_checked_local(name, p, root, fmt, trusted) for p in matches]
    if not os.path.exists(full):
        raise _missing(name, full)
    if not os.path.isfile(full):
        raise ValueError(f"dataset {name!r}: {full} is neither a file nor a folder")
    root = os.path.dirname(full)
    return root, [_checked_local(name, full, root, fmt)]


def _checked_local(name: str, full: str, root: str, fmt: str | None, trusted: Mapping[str, Any] | None = None) -> Found:
    kind = format_of(os.path.basename(full), fmt)
    if kind is None:
        raise ValueError(f"dataset {name!r}: cannot tell the format of {full} from its name; supported endings: {_endings()}. Pass fmt='jsonl', 'parquet', 'arrow' or 'tokens' to say it.")
    return _local_found(full, _relative(full, root), kind, functools.partial(os.stat, full), trusted or {})


def _local_list(name: str, paths: list[str], fmt: str | None) -> tuple[str, list[Found]]:
    for p in paths:
        if not os.path.exists(p):
            raise _missing(name, p)
        if not os.path.isfile(p):
            raise ValueError(f"dataset {name!r}: {p} is not a file; list files, or pass a folder on its own")
    real = [os.path.realpath(p) for p in paths]
    if len(set(real)) != len(real):
        twice = sorted({p for p, r in zip(paths, real) if real.count(r) > 1})
        raise ValueError(f"dataset {name!r}: files listed more than once: {twice}")
    root = os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath([os.path.dirname(p) for p in paths])
    return root, [_checked_local(name, p, root, fmt) for p in paths]


def _scan_folder(name: str, root: str, fmt: str | None, recursive: bool, trusted: Mapping[str, IndexEntry]) -> list[Found]:
    """The supported files of a folder (and, if ``recursive``, its subfolders), as ``os.walk`` sees
    them: hidden entries skipped, folder links not followed, unreadable subfolders passed over."""
    found: list[Found] = []
    seen: list[str] = []
    subfolders = False
    pending = [(root, "")]
    while pending:
        folder, prefix = pending.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=operator.attrgetter("name"))
        except OSError:
            continue
        dirs = []
        for entry in entries:
            filename = entry.name
            if _is_folder(entry):
                if not filename.startswith("."):
                    dirs.append(entry)
                continue
            shard_id = prefix + filename
            seen.append(shard_id)
            if filename.startswith(".") or not entry.is_file():
                continue
            if fmt == "tokens" and filename.endswith(".idx"):
                continue  # Megatron indexes sit beside their .bin
            kind = format_of(filename, fmt)
            if kind is not None:
                found.append(_local_found(entry.path, shard_id, kind, entry.stat, trusted))
        if not recursive:
            subfolders = bool(dirs)
            seen.extend(d.name + "/" for d in dirs)
            break
        pending.extend((d.path, prefix + d.name + "/") for d in reversed(dirs) if not d.is_symlink())
    if not found:
        listing = ", ".join(seen[:_LISTED]) + (f" and {len(seen) - _LISTED} more" if len(seen) > _LISTED else "")
        hint = " Subfolders are not searched; pass recursive=True to include them." if subfolders else ""
        raise ValueError(f"dataset {name!r}: no supported files in {root} (found: {listing or 'nothing'}); supported endings: {_endings()}. Pass fmt= to read other files.{hint}")
    return found


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _remote(name: str, urls: list[str], fmt: str | None, recursive: bool, so: tuple, caches: tuple[str, CacheOptions], *, single: bool) -> tuple[str, list[Found]]:
    protocols = {split_url(u)[0] for u in urls}
    if len(protocols) > 1:
        raise ValueError(f"dataset {name!r}: the URLs use several stores {sorted(protocols)}; a dataset lives in one place")
    protocol = protocols.pop()
    fs = filesystem(protocol, so)
    entries: dict[str, Mapping[str, Any]] = {}
    for url in urls:
        rest = fs._strip_protocol(url)
        if _is_glob(rest):
            hits = fs.glob(rest, detail=True)
            if not hits:
                raise FileNotFoundError(f"dataset {name!r}: the glob {url} matches no objects")
            entries.update({p: i for p, i in hits.items() if i.get("type") != "directory"})
            root = _glob_root(rest)
            continue
        if not fs.exists(rest):
            raise FileNotFoundError(f"dataset {name!r}: {url} does not exist")
        if fs.isdir(rest):
            hits = fs.find(rest, detail=True, maxdepth=None if recursive else 1)
            entries.update({p: i for p, i in hits.items() if not p.rsplit("/", 1)[-1].startswith(".")})
            root = rest.rstrip("/")
        else:
            entries[rest] = fs.info(rest)
            root = rest.rsplit("/", 1)[0]
    if not single:
        parents = [p.rsplit("/", 1)[0] for p in entries]
        root = os.path.commonpath(parents) if len(parents) > 1 else parents[0]
    found = []
    for p, info in entries.items():
        kind = format_of(p.rsplit("/", 1)[-1], fmt)
        if kind is None:
            if single and (_is_glob(urls[0]) or fs.isdir(fs._strip_protocol(urls[0]))):
                continue
            raise ValueError(f"dataset {name!r}: cannot tell the format of {p} from its name; supported endings: {_endings()}. Pass fmt=.")
        if fmt == "tokens" and p.endswith(".idx"):
            continue
        rel = p[len(root) :].lstrip("/") if p.startswith(root) else p
        url, size = fs.unstrip_protocol(p), int(info.get("size") or 0)
        found.append(Found(url, rel, kind[0], kind[1], size, identity_of(info) or _content_identity(fs, url, info, caches, name)))
    if not found:
        raise ValueError(f"dataset {name!r}: no supported files at {urls[0]}; supported endings: {_endings()}")
    return fs.unstrip_protocol(root), found


def _content_identity(fs: Any, url: str, info: Mapping[str, Any], caches: tuple[str, CacheOptions], dataset: str) -> str:
    """The content digest of an object without ETag or checksum, taken as it downloads into the
    shard cache; cached by size and listed times while the copy stays."""
    stamps = {k: str(info.get(k)) for k in ("size", "mtime", "LastModified", "last_modified", "updated", "created") if info.get(k) is not None}
    size = int(info.get("size") or 0)
    copy = lambda digest: os.path.isfile(os.path.join(caches[1].folder, cached_name(url, size, digest)))  # noqa: E731
    return cached(caches[0], url, stamps, lambda: fetch_by_content(url, fs, size, caches[1], dataset), usable=copy)


def _filesystem_of(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    return filesystem(split_url(url)[0], tuple(sorted((storage_options or {}).items())))


def index_location(root: str) -> str:
    return root.rstrip("/") + "/" + INDEX_NAME if is_url(root) else os.path.join(root, INDEX_NAME)


class IndexEntry(msgspec.Struct, frozen=True):
    """One shard in the dataset index (``stat``: a local file's stat key; ``groups``: rows each)."""

    fmt: str
    bytes: int
    identity: str
    rows: int
    stat: tuple[int, int, int, int, int] | None = None
    groups: tuple[int, ...] | None = None


class IndexDoc(msgspec.Struct, frozen=True):
    """The dataset index: its version, the settings that decide rows, and an entry per shard id."""

    zephon_index: int
    settings: dict[str, Any] = {}
    shards: dict[str, IndexEntry] = {}


_INDEX_DOC = msgspec.json.Decoder(IndexDoc)


def read_index(root: str, storage_options: Mapping[str, Any] | None = None) -> IndexDoc | None:
    """The dataset index in ``root``, or ``None`` (none, or unreadable); a local one is parsed once
    while its file is unchanged."""
    where = index_location(root)
    if is_url(where):
        return _read_index(where, storage_options)
    try:
        key = (where, stat_key(os.stat(where)))
    except OSError:
        return None
    if key not in _INDEXES:
        doc = _read_index(where, storage_options)
        _INDEXES.clear()  # the last one only: an index of 100,000 shards is tens of MB
        _INDEXES[key] = doc
    return _INDEXES[key]


_INDEXES: dict[tuple, Any] = {}


def _read_index(where: str, storage_options: Mapping[str, Any] | None) -> IndexDoc | None:
    try:
        if is_url(where):
            fs = _filesystem_of(where, storage_options)
            if not fs.exists(where):
                return None
            text = fs.cat_file(where)
        else:
            with open(where, "rb") as f:
                text = f.read()
        doc = _INDEX_DOC.decode(text)
    except FileNotFoundError:
        return None
    except msgspec.ValidationError:  # another version's layout, or not an index
        doc = None
    except (OSError, ValueError, msgspec.DecodeError) as err:
        warnings.warn(f"the dataset index {where} cannot be read ({err}); counting shards without it. Rebuild it with `zephon index`.", RuntimeWarning, stacklevel=3)
        return None
    if doc is None or doc.zephon_index != INDEX_VERSION:
        warnings.warn(f"the dataset index {where} is not a version-{INDEX_VERSION} zephon index; counting shards without it. Rebuild it with `zephon index`.", RuntimeWarning, stacklevel=3)
        return None
    return doc


def write_index(root: str, entries: dict[str, Any], settings: dict[str, Any], storage_options: Mapping[str, Any] | None = None) -> str:
    """Write the dataset index of ``root`` (atomically for local folders); returns where."""
    doc = json.dumps({"zephon_index": INDEX_VERSION, "settings": settings, "shards": entries}, sort_keys=True).encode()
    where = index_location(root)
    if is_url(where):
        _filesystem_of(where, storage_options).pipe_file(where, doc)
        return where
    with replacing(where) as out:
        out.write(doc)
    return where
