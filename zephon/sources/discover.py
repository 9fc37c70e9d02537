"""Finding and opening a dataset's shards: formats by ending, folders, lists, globs, remote URLs; the index.

Discovery turns what the user passed into :class:`Found` shards sorted by id (the path relative
to the root: the folder, the glob's fixed prefix, or the listed files' common folder), each with
its format, size and identity: a local file's content digest (:mod:`zephon.sources.digest`), a
remote object's ETag or checksum (else a digest of its content); never a time, so a
byte-identical copy of the data is the same dataset.

The dataset index (``.zephon-index.json`` in the root, written by ``zephon index PATH``) records
each shard's identity, row count and row groups; an entry is reused only while the shard's
identity matches.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import warnings
from typing import Any, Iterable, Mapping

import attrs

from ..core.atomic import replacing
from ..core.log import progress as progress_bar
from .columnar import ARROW_SUFFIXES, PARQUET_SUFFIXES
from .digest import cached, file_digests, resolve_cache_dir, stat_key
from .files import RemoteShard
from .jsonl import SUFFIXES, JsonlShard
from .ranges import RangedParquet, ranged
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


@attrs.frozen
class Found:
    """One shard found: where it is, its id, format, compression, size and identity (its content's).

    A local file's ``identity`` is ``None`` until its digest is taken; ``st`` is its ``stat``.
    """

    def identified(self, identity: str) -> "Found":
        """This shard with its identity (``attrs.evolve`` costs several times more, per shard of 100,000)."""
        return Found(self.location, self.shard_id, self.fmt, self.compression, self.size, identity, self.st)

    location: str  # an absolute local path or a URL
    shard_id: str
    fmt: str
    compression: str | None
    size: int
    identity: str | None
    st: os.stat_result | None = attrs.field(default=None, eq=False, repr=False)


def format_of(filename: str, forced: str | None) -> tuple[str, str | None] | None:
    """``(format, compression)`` of a file name, or ``None`` when the name says nothing."""
    lower = filename.lower()
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
    """``(root, shards sorted by id)`` of what ``path`` names.

    Digests are cached in ``cache_dir``; objects of stores without checksums are digested as they
    are downloaded into the shard cache (``cache``). Unless ``index="off"``, local files that the
    dataset index recorded, unchanged since, take their identity from it.
    """
    so = tuple(sorted((storage_options or {}).items()))
    cache_dir = resolve_cache_dir(cache_dir)
    cache = cache or CacheOptions()
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if is_url(text):
            root, found = _remote(name, [text], fmt, recursive, so, (cache_dir, cache), single=True)
        else:
            root, found = _local_one(name, os.path.abspath(local_path(text)), fmt, recursive)
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
    indexed = doc["shards"] if doc is not None and doc.get("settings", {}).get("fmt") == formats[0] else {}
    return root, _identified(sorted(found, key=lambda f: f.shard_id), cache_dir, indexed)


def _identified(found: list, cache_dir: str, indexed: Mapping[str, Any]) -> list[Found]:
    """``found`` with the local files' content digests as identities (several files at once).

    A file whose stat key (device, inode, size, times) is the one the dataset index recorded with
    its identity still holds those bytes (any write changes its ctime), so the index's identity is
    taken as it is; the others are digested (from the digest cache when it holds).
    """
    out = list(found)
    local = []
    for i, f in enumerate(found):
        if f.identity is not None:
            continue
        entry = indexed.get(f.shard_id)
        if isinstance(entry, dict) and entry.get("stat") == list(stat_key(f.st)) and isinstance(entry.get("identity"), str):
            out[i] = f.identified(entry["identity"])
        else:
            local.append(i)
    if local:
        digests = file_digests([found[i].location for i in local], cache_dir, [found[i].st for i in local])
        for i, digest in zip(local, digests):
            out[i] = found[i].identified(digest)
    return out


def _relative(full: str, root: str) -> str:
    """``full``'s path below ``root``, with ``/`` separators."""
    prefix = root.rstrip(os.sep) + os.sep
    rel = full[len(prefix):] if full.startswith(prefix) else os.path.relpath(full, root)
    return rel.replace(os.sep, "/")


def _local_found(full: str, root: str, kind: tuple[str, str | None], st: os.stat_result) -> Found:
    return Found(full, _relative(full, root), kind[0], kind[1], st.st_size, None, st)


def _local_one(name: str, full: str, fmt: str | None, recursive: bool) -> tuple[str, list[Found]]:
    if os.path.isdir(full):
        return full, _scan_folder(name, full, fmt, recursive)
    if _is_glob(full) and not os.path.exists(full):
        matches = sorted(p for p in globlib.glob(full, recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"dataset {name!r}: the glob {full} matches no files")
        root = _glob_root(full)
        return root, [_checked_local(name, p, root, fmt) for p in matches]
    if not os.path.exists(full):
        raise _missing(name, full)
    if not os.path.isfile(full):
        raise ValueError(f"dataset {name!r}: {full} is neither a file nor a folder")
    root = os.path.dirname(full)
    return root, [_checked_local(name, full, root, fmt)]


def _checked_local(name: str, full: str, root: str, fmt: str | None) -> Found:
    kind = format_of(os.path.basename(full), fmt)
    if kind is None:
        raise ValueError(f"dataset {name!r}: cannot tell the format of {full} from its name; supported endings: {_endings()}. Pass fmt='jsonl', 'parquet', 'arrow' or 'tokens' to say it.")
    return _local_found(full, root, kind, os.stat(full))


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


def _scan_folder(name: str, root: str, fmt: str | None, recursive: bool) -> list[Found]:
    found: list[Found] = []
    seen: list[str] = []
    subfolders = False
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        with os.scandir(folder) as it:
            entries = {e.name: e for e in it}
        for filename in sorted(files):
            seen.append(_relative(os.path.join(folder, filename), root))
            entry = entries.get(filename)
            if filename.startswith(".") or entry is None or not entry.is_file():
                continue
            if fmt == "tokens" and filename.endswith(".idx"):
                continue  # Megatron indexes sit beside their .bin
            kind = format_of(filename, fmt)
            if kind is not None:
                found.append(_local_found(entry.path, root, kind, entry.stat()))
        if not recursive:
            subfolders = bool(dirs)
            seen.extend(d + "/" for d in dirs)
            break
    if not found:
        listing = ", ".join(seen[:_LISTED]) + (f" and {len(seen) - _LISTED} more" if len(seen) > _LISTED else "")
        hint = " Subfolders are not searched; pass recursive=True to include them." if subfolders else ""
        raise ValueError(f"dataset {name!r}: no supported files in {root} (found: {listing or 'nothing'}); supported endings: {_endings()}. Pass fmt= to read other files.{hint}")
    return found


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
    """The content digest of an object on a store that gives no ETag or checksum.

    Taken as the object is downloaded into the shard cache, and kept in the digest cache keyed by
    its size and listed times, for as long as its copy is in the shard cache.
    """
    stamps = {k: str(info.get(k)) for k in ("size", "mtime", "LastModified", "last_modified", "updated", "created") if info.get(k) is not None}
    size = int(info.get("size") or 0)
    copy = lambda digest: os.path.isfile(os.path.join(caches[1].folder, cached_name(url, size, digest)))  # noqa: E731
    return cached(caches[0], url, stamps, lambda: fetch_by_content(url, fs, size, caches[1], dataset), usable=copy)


def _filesystem_of(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    return filesystem(split_url(url)[0], tuple(sorted((storage_options or {}).items())))


def index_location(root: str) -> str:
    return root.rstrip("/") + "/" + INDEX_NAME if is_url(root) else os.path.join(root, INDEX_NAME)


def read_index(root: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The dataset index in ``root``, or ``None`` when there is none (or it is unreadable).

    A local index is parsed once per process while its file is unchanged (discovery and counting
    both read it); callers do not modify the document.
    """
    where = index_location(root)
    if not is_url(where):
        try:
            key = (where, stat_key(os.stat(where)))
        except OSError:
            return None
        if key in _INDEXES:
            return _INDEXES[key]
        doc = _read_index(where, storage_options)
        _INDEXES.clear()  # the last one only: an index of 100,000 shards is tens of MB
        _INDEXES[key] = doc
        return doc
    return _read_index(where, storage_options)


_INDEXES: dict[tuple, Any] = {}


def _read_index(where: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    try:
        if is_url(where):
            fs = _filesystem_of(where, storage_options)
            if not fs.exists(where):
                return None
            text = fs.cat_file(where)
        else:
            with open(where, "rb") as f:
                text = f.read()
        doc = json.loads(text)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        warnings.warn(f"the dataset index {where} cannot be read ({err}); counting shards without it. Rebuild it with `zephon index`.", RuntimeWarning, stacklevel=3)
        return None
    if not isinstance(doc, dict) or doc.get("zephon_index") != INDEX_VERSION or not isinstance(doc.get("shards"), dict):
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


@attrs.frozen
class ShardSpec:
    """How to open a local file of a dataset as a shard (picklable; also used for remote copies)."""

    fmt: str
    cache_dir: str
    verify: str
    columns: tuple[str, ...] | None = None
    eos_token_id: int | None = None
    token_dtype: str | None = None

    def __call__(self, path: str, shard_id: str, compression: str | None = None, digest: str | None = None) -> Any:
        """The shard of the file at ``path``; ``digest``: its content identity if known (else taken)."""
        if self.fmt == "jsonl":
            compression = compression or format_of(path, "jsonl")[1]
            return JsonlShard(path, shard_id, compression, self.cache_dir, self.verify, digest)
        if self.fmt in ("parquet", "arrow"):
            from .columnar import ColumnarShard

            return ColumnarShard(path, shard_id, self.fmt, self.columns, self.verify, cache_dir=self.cache_dir, digest=digest)
        from .token_files import TokenShard

        return TokenShard(path, shard_id, dtype=self.token_dtype, eos_token_id=self.eos_token_id, cache_dir=self.cache_dir, verify=self.verify, digest=digest)

    def settings(self) -> dict[str, Any]:
        """What decides an index entry's rows and digest."""
        return {"fmt": self.fmt, "verify": self.verify, "eos_token_id": self.eos_token_id, "token_dtype": self.token_dtype}


def make_shard(found: Any, spec: ShardSpec, storage_options: Mapping[str, Any] | None) -> Any:
    """The shard of one found file: local, or a remote object read through the shard cache."""
    if is_url(found.location):
        fs_key = (split_url(found.location)[0], tuple(sorted((storage_options or {}).items())))
        by_ranges = None
        if spec.fmt == "parquet" and ranged(found.identity):
            by_ranges = RangedParquet(found.location, found.size, found.identity, fs_key, spec.columns)
        return RemoteShard(found.location, found.shard_id, found.size, found.identity, fs_key, spec, by_ranges=by_ranges)
    return spec(found.location, found.shard_id, found.compression, found.identity)


def index_entry(found: Any, shard: Any) -> dict[str, Any]:
    """The dataset-index entry of a counted shard (with a local file's stat key: see :func:`_identified`)."""
    entry: dict[str, Any] = {"fmt": found.fmt, "bytes": found.size, "identity": found.identity, "rows": shard.num_rows}
    if getattr(found, "st", None) is not None:
        entry["stat"] = list(stat_key(found.st))
    if getattr(shard, "group_rows", None):
        entry["groups"] = list(shard.group_rows)
    return entry


def _apply_entry(shard: Any, entry: Mapping[str, Any]) -> None:
    shard.num_rows = int(entry["rows"])
    if "groups" in entry and hasattr(shard, "group_rows"):
        shard.group_rows = tuple(int(g) for g in entry["groups"])


def open_shards(name: str, root: str, found: list, spec: ShardSpec, storage_options: Any, io: Any, *, index: str = "auto", progress: bool = False) -> list:
    """Shards of every found file, counted, or taken from the dataset index where it still holds."""
    doc = read_index(root, storage_options) if index != "off" else None
    entries: Mapping[str, Any] = {}
    if doc is not None:
        if doc.get("settings") == spec.settings():
            entries = doc["shards"]
        elif index == "require":
            raise ValueError(f"dataset {name!r}: the index in {root} was built with {doc.get('settings')}, not {spec.settings()}; rebuild it with `zephon index {root}`")
    elif index == "require":
        raise ValueError(f"dataset {name!r}: {root} has no dataset index; build it with `zephon index {root}` (or pass index='auto')")
    stale, unlisted, shards = [], [], []
    for f in progress_bar(found, total=len(found), desc=f"counting {name}", unit="shard", force=progress or None):
        shard = make_shard(f, spec, storage_options)
        entry = entries.get(f.shard_id)
        if entry is not None and (entry.get("fmt"), entry.get("bytes"), entry.get("identity")) == (f.fmt, f.size, f.identity):
            _apply_entry(shard, entry)
        else:
            (stale if entry is not None else unlisted).append(f.shard_id)
            if index == "require":
                raise ValueError(
                    f"dataset {name!r}: the index in {root} is stale: shard {f.shard_id} "
                    f"{'changed since it was indexed' if entry is not None else 'is not in it'}; rebuild it with `zephon index {root}`"
                )
            shard.count_rows(name, io)
        shards.append(shard)
    if doc is not None and (stale or unlisted):
        listed = ", ".join((stale + unlisted)[:_LISTED])
        warnings.warn(
            f"dataset {name!r}: the index in {root} is stale for {len(stale)} changed and {len(unlisted)} new shard(s) "
            f"({listed}); they were counted again, not trusted. Rebuild it with `zephon index {root}`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return shards
