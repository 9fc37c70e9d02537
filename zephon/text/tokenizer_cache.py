"""An on-disk cache of what loading a tokenizer computes, in ``$ZEPHON_CACHE_DIR/tokenizers``.

Entries (keyed by content, never path or time): ``file-<sha256 of a tokenizer.json>`` (canonical
JSON, guessed special ids), ``proof-<content>`` (whether tiktoken is exact, and its inputs) and
``bpe-<sha256 of the JSON>`` (:mod:`zephon.text.bpe_files`). Each holds its key and :func:`salt`;
a mismatch, or one that does not decode, is unused. Written atomically; an unwritable folder only
costs time; ``ZEPHON_TOKENIZER_CACHE=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import msgspec
import numpy as np

from ..core.atomic import replacing
from ..core.log import logger

__all__ = ["cache_enabled", "entry_path", "file_digest", "load_entry", "load_proof", "store_entry", "store_proof"]

#: Bump when the canonical form, the guessed ids or the tiktoken checks change.
FORMAT = 2
_ENV = "ZEPHON_TOKENIZER_CACHE"


def cache_enabled() -> bool:
    """Whether the cache is on (``ZEPHON_TOKENIZER_CACHE`` is not ``0``/``off``/``false``/``no``)."""
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_folder() -> str:
    root = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "tokenizers")


@functools.cache
def salt() -> str:
    """What every entry must have been made with: library versions, this format, the check texts."""
    from importlib.metadata import PackageNotFoundError, version

    from tokenizers import __version__ as tk

    from .tiktoken_encoding import _verification_texts

    try:
        tt = version("tiktoken")  # without importing it
    except PackageNotFoundError:
        tt = "-"
    texts = hashlib.sha256("\0".join(_verification_texts()).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{FORMAT}/{tk}/{tt}/{texts}"


def file_digest(path: str) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_path(kind: str, key: str, name: str) -> str:
    """The path of a file that belongs to the entry ``kind``/``key`` (``name``: its suffix)."""
    return os.path.join(cache_folder(), f"{kind}-{key}.{name}")


def load_entry(kind: str, key: str) -> dict[str, Any] | None:
    """The entry stored for ``key``, or ``None`` (absent, unreadable, or made with another salt)."""
    if not cache_enabled():
        return None
    try:
        with open(entry_path(kind, key, "msgpack"), "rb") as f:
            data = msgspec.msgpack.decode(f.read())
    except (OSError, msgspec.DecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("salt") != salt():
        return None
    return data


def store_entry(kind: str, key: str, entry: dict[str, Any]) -> None:
    """Store ``entry`` for ``key`` atomically; failures (an unwritable folder) are logged and ignored."""
    if not cache_enabled():
        return
    target = entry_path(kind, key, "msgpack")
    folder = os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        with replacing(target) as out:
            out.write(msgspec.msgpack.encode({**entry, "key": key, "salt": salt()}))
    except OSError as exc:
        logger.debug("zephon: cannot write the tokenizer cache %s: %s", folder, exc)


def load_proof(key: str) -> tuple[dict | None, str]:
    """The tiktoken proof for content ``key``: ``(plan, "")`` if tiktoken was proven exact,
    ``(None, reason)`` if it was proven not to be, ``(None, "")`` if there is no usable entry."""
    entry = load_entry("proof", key)
    if entry is None:
        return None, ""
    try:
        if entry["reason"]:
            return None, str(entry["reason"])
        blob, ends, ids = entry["rank_bytes"], np.frombuffer(entry["rank_ends"], np.uint32), entry["rank_ids"]
        starts = np.concatenate([[0], ends[:-1]]).tolist()
        tokens = [blob[a:b] for a, b in zip(starts, ends.tolist())]
        plan = {
            "pattern": str(entry["pattern"]),
            "ranks": dict(zip(tokens, np.frombuffer(ids, np.uint32).tolist())),
            "specials": {str(k): int(v) for k, v in entry["specials"].items()},
        }
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, ""
    return plan, ""


def store_proof(key: str, plan: dict | None, reason: str) -> None:
    """Store the outcome of proving tiktoken for content ``key``, with its plan when it is exact."""
    entry: dict[str, Any] = {"reason": reason}
    if plan is not None and not reason:
        tokens = list(plan["ranks"])
        entry.update(
            pattern=plan["pattern"],
            rank_bytes=b"".join(tokens),  # the tokens' bytes back to back, their ends and their ids
            rank_ends=np.cumsum([len(t) for t in tokens], dtype=np.uint32).tobytes(),
            rank_ids=np.array(list(plan["ranks"].values()), dtype=np.uint32).tobytes(),
            specials=plan["specials"],
        )
    store_entry("proof", key, entry)
