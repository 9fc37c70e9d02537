"""Manifests beside checkpoint files, and what a restore names when the data differs.

A fingerprint names each dataset by counts and the digest of its shard list; the lists are the
manifest, ``zephon-manifest-<key>.msgpack`` beside the checkpoint files: msgpack ``{"format",
"datasets": [{"name", "digest", "shards": <canonical msgpack of the list>}]}``, each list verified
against its digest when read. A restore into other data names the shards that differ from the
checkpoint's lists (in it, in memory, or in the manifest of the folder it was read from).

Kept: where the last :data:`_NOTED` loaded checkpoints' manifests lie, and the manifests this
process wrote (hard-linked into the next folder).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import msgspec

from ..core.atomic import replacing
from ..sources.manifest import ShardList, encode, is_summary, pin, shard_list, summarize

#: The layout of a manifest file.
FORMAT = "zephon.manifest/1"
_NOTED = 64
_lock = threading.Lock()
_noted: "OrderedDict[str, Path]" = OrderedDict()
_written: dict[str, Path] = {}


def _datasets(fingerprint: Any) -> list:
    source = fingerprint.get("source") if isinstance(fingerprint, Mapping) else None
    datasets = source.get("datasets") if isinstance(source, Mapping) else None
    return datasets if isinstance(datasets, list) else []


def normalized(fingerprint: Any) -> Any:
    """``fingerprint`` with every dataset that holds its shard list summarized, so fingerprints of
    either form compare (the same object when there is nothing to change)."""
    datasets = _datasets(fingerprint)
    if not any(isinstance(d, Mapping) and isinstance(d.get("shards"), list) for d in datasets):
        return fingerprint
    out = []
    for d in datasets:
        try:
            out.append(summarize(d) if isinstance(d, Mapping) and isinstance(d.get("shards"), list) else d)
        except (TypeError, ValueError, AttributeError, KeyError):
            out.append(d)  # not a shard list this version wrote: compared as it is
    return {**fingerprint, "source": {**fingerprint["source"], "datasets": out}}


def manifest_key(fingerprint: Any) -> str | None:
    """The key naming a fingerprint's manifest; ``None`` when every dataset holds its list."""
    digests = [d["digest"] for d in _datasets(fingerprint) if is_summary(d)]
    if not digests:
        return None
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]


def manifest_name(key: str) -> str:
    """``zephon-manifest-<key>.msgpack``."""
    return f"zephon-manifest-{key}.msgpack"


def pin_data(fingerprint: Any) -> None:
    """Keep the shard lists of a checkpoint's data in memory (see ``zephon.sources.manifest.pin``)."""
    for d in _datasets(fingerprint):
        if is_summary(d):
            pin(d["digest"])


def write_manifest(directory: str | os.PathLike, fingerprint: Any) -> Path | None:
    """Write the manifest of ``fingerprint``'s data into ``directory`` (atomically, or as a hard
    link to one this process wrote) unless it is there; its path (``None``: none needed)."""
    key = manifest_key(fingerprint)
    if key is None:
        return None
    path = Path(directory) / manifest_name(key)
    if path.exists():
        return path
    with _lock:
        earlier = _written.get(key)
    if earlier is not None:
        try:
            os.link(earlier, path)
            return path
        except FileExistsError:
            return path
        except OSError:
            pass  # gone, or another filesystem: write it
    entries = [d for d in _datasets(fingerprint) if is_summary(d)]
    lists = [shard_list(d["digest"]) for d in entries]
    if None in lists:
        missing = [d.get("name") for d, s in zip(entries, lists) if s is None]
        warnings.warn(
            f"the shard lists of datasets {missing} are not known in this process, so {path} is not written; a "
            "restore into other data will give the counts of what differs, not the shards. Save checkpoints from "
            "the loader that took them",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    listed = [{"name": d.get("name"), "digest": s.digest, "shards": s.data} for d, s in zip(entries, lists)]
    doc = {"format": FORMAT, "datasets": listed}
    with replacing(path, durable=True) as out:
        out.write(msgspec.msgpack.encode(doc))
    with _lock:
        _written[key] = path
    return path


def note_folder(fingerprint: Any, directory: str | os.PathLike) -> None:
    """Note that a checkpoint of ``fingerprint`` was read from ``directory`` (with its manifest)."""
    key = manifest_key(fingerprint)
    if key is None:
        return
    with _lock:
        _noted[key] = Path(directory) / manifest_name(key)
        _noted.move_to_end(key)
        while len(_noted) > _NOTED:
            _noted.popitem(last=False)


def read_manifest(path: str | os.PathLike) -> dict[str, ShardList]:
    """The verified shard lists of a manifest file, by digest (ValueError: not one, or damaged)."""
    where = f"manifest {os.fspath(path)}"
    try:
        doc = msgspec.msgpack.decode(Path(path).read_bytes())
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where} is not valid msgpack ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("datasets"), list):
        raise ValueError(f"{where} is not a {FORMAT!r} manifest")
    out = {}
    for d in doc["datasets"]:
        data = d.get("shards") if isinstance(d, dict) else None
        if not isinstance(data, bytes):
            raise ValueError(f"{where}: a dataset entry holds no shard list")
        shards = encode(msgspec.msgpack.decode(data))
        if shards.data != data or shards.digest != d.get("digest"):
            raise ValueError(
                f"{where}: the shard list of dataset {d.get('name')!r} does not match its digest (a damaged copy)"
            )
        out[shards.digest] = shards
    return out


_DATA_FIELD = re.compile(r"source\.datasets\[(\d+)\]\.(shards|bytes|rows|digest)")


def explain(checkpoint_fp: Any, fingerprint: Any, diffs: list[tuple[str, str, str]]) -> str | None:
    """What differs in the data, naming the shards and the fix, when the fingerprints differ only
    in datasets' content; else ``None``."""
    found = [_DATA_FIELD.fullmatch(path) for path, _, _ in diffs]
    if not found or None in found:
        return None
    old_sets, new_sets = _datasets(checkpoint_fp), _datasets(fingerprint)
    indices = sorted({int(m[1]) for m in found})
    if any(i >= len(old_sets) or i >= len(new_sets) for i in indices):
        return None
    said, older, lookup = [], False, _Lookup(checkpoint_fp)
    for i in indices:
        old, new = old_sets[i], new_sets[i]
        of = f"dataset {old.get('name')!r}: " if isinstance(old, Mapping) and "name" in old else ""
        old_list, new_list = lookup.shards(old), _entries(new)
        if old_list is None or new_list is None:
            sizes = f"({_size(old)} in the checkpoint; {_size(new)} now)"
            missing = lookup.missing(new_list is None)
            said.append(f"{of}the data differs from the checkpoint's {sizes}; {missing}")
            continue
        older = older or any("mtime_ns=" in str(s.get("identity")) for s in old_list)
        said.append(of + _shards_changed(old_list, new_list))
    fix = (
        "the checkpoint identifies files by modification time (it was written before shards were identified by "
        "their content), so it cannot be matched to these files; start a new run, or resume with the zephon "
        "version that wrote it"
        if older
        else "the data changed since the checkpoint was written; restore the original files or start a new run"
    )
    return f"{'; '.join(said)}: {fix}"


def _entries(entry: Any) -> list | None:
    """The shard entries a dataset's entry holds or this process knows, else ``None``."""
    if isinstance(entry, Mapping) and isinstance(entry.get("shards"), list):
        return entry["shards"]
    shards = shard_list(entry["digest"]) if is_summary(entry) else None
    return None if shards is None else shards.entries()


class _Lookup:
    """Finds the checkpoint's shard lists: in it, in memory, else in its folder's manifest."""

    def __init__(self, fingerprint: Any):
        key = manifest_key(fingerprint)
        with _lock:
            self.path = _noted.get(key) if key else None
        self.key, self.read, self.problem = key, None, None

    def shards(self, entry: Any) -> list | None:
        known = _entries(entry)
        if known is not None or self.path is None or not is_summary(entry):
            return known
        if self.read is None and self.problem is None:
            try:
                self.read = read_manifest(self.path)
            except FileNotFoundError:
                self.problem = f"its manifest, which names the shards, was expected at {self.path} and is not there"
            except (OSError, ValueError) as exc:
                self.problem = f"its manifest could not be used ({exc})"
        found = (self.read or {}).get(entry["digest"])
        if found is None and self.problem is None:
            self.problem = f"its manifest {self.path} does not list this dataset"
        return None if found is None else found.entries()

    def missing(self, here: bool) -> str:
        if here:
            return "this process does not know the current shard list, so the shards that differ are not named"
        if self.problem:
            return self.problem
        name = manifest_name(self.key) if self.key else "zephon-manifest-<key>.msgpack"
        return (
            "no manifest came with the checkpoint to name the shards that differ: zephon.save_checkpoint writes "
            f"{name} beside the checkpoint files and zephon.load_checkpoint reads it from there"
        )


def _size(entry: Any) -> str:
    """A dataset's fingerprint entry in words: shards, rows, bytes, digest."""
    if isinstance(entry, Mapping) and isinstance(entry.get("shards"), list):
        entry = summarize(entry)
    entry = entry if isinstance(entry, Mapping) else {}
    total = f", {entry.get('bytes')} bytes" if entry.get("bytes") is not None else ""
    return f"{entry.get('shards')} shards, {entry.get('rows')} rows{total}, digest {_short(entry.get('digest'))}"


def _short(identity: Any) -> str:
    name, sep, value = str(identity).partition("=" if "=" in str(identity) else ":")
    return f"{name}{sep}{value[:12]}…" if len(value) > 12 else str(identity)


def _key(shard: Mapping[str, Any]) -> Any:
    return shard.get("id", shard.get("path"))


def _shards_changed(old: list, new: list) -> str:
    """``"shard 'b.jsonl' content differs from the checkpoint's (size 10 → 12, ...)"`` and such."""
    olds = {_key(s): s for s in old}
    news = {_key(s): s for s in new}
    said = []
    for key, was in olds.items():
        now = news.get(key)
        if now is None:
            said.append(f"shard {key!r} was removed (it had {was.get('bytes')} bytes, {was.get('rows')} rows)")
        elif now != was:
            rows = f", rows {was.get('rows')} → {now.get('rows')}" if was.get("rows") != now.get("rows") else ""
            said.append(
                f"shard {key!r} content differs from the checkpoint's (size {was.get('bytes')} → "
                f"{now.get('bytes')}{rows}, digest {_short(was.get('identity'))} → {_short(now.get('identity'))})"
            )
    added = [(key, s) for key, s in news.items() if key not in olds]
    said += [f"shard {key!r} was added ({s.get('bytes')} bytes, {s.get('rows')} rows)" for key, s in added]
    if not said:
        return "the same shards, in another order than the checkpoint's"
    listed = "; ".join(said[:5]) + (f"; and {len(said) - 5} more" if len(said) > 5 else "")
    if len(old) != len(new) or len(said) > 5:
        listed += f" ({len(old)} shards in the checkpoint, {len(new)} now)"
    return listed
