"""An on-disk cache of what loading a tokenizer computes: its canonical JSON, the tiktoken proof, fast-build files.

Loading a ``tokenizer.json`` (its canonical JSON) and proving that tiktoken gives its ids exactly
(:mod:`zephon.text.tiktoken_encoding`) would otherwise be paid in every process that starts. Both results are pure functions of their
inputs, so they are kept in the user's cache folder (``$ZEPHON_CACHE_DIR``, else
``~/.cache/zephon``), under ``tokenizers/``:

- ``file-<sha256 of the file's bytes>.msgpack``: the canonical tokenizer JSON and the special ids
  guessed from the vocabulary, for a ``tokenizer.json`` file loaded by path;
- ``proof-<content digest>.msgpack``: whether tiktoken is exact for that content (or why not) and,
  when it is, tiktoken's inputs (pattern, byte ranks, special tokens);
- ``bpe-<sha256 of the canonical JSON>.msgpack`` and its ``.vocab.json`` and ``.merges.txt``: a
  BPE tokenizer's model as files that build it faster, once proven to give the same tokenizer
  (:mod:`zephon.text.bpe_files`).

Keys name the content, never the path or the time, so an edited file gets a new entry, and every
entry also holds :data:`_SALT` (the versions of ``tokenizers`` and ``tiktoken``, this format and the
checks): any change there makes old entries unused. An entry must also repeat its key and, for a
proof, the digest of the canonical JSON it was made from. Entries are written through a temporary
file and ``os.replace``, so concurrent processes never read a partial entry; one that does not
decode is ignored and rewritten. ``ZEPHON_TOKENIZER_CACHE=0`` turns the cache off (nothing read or
written); an unwritable folder only means every process computes again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import msgspec

from ..core.atomic import replacing

__all__ = ["cache_enabled", "entry_path", "file_digest", "load_entry", "store_entry"]

logger = logging.getLogger("zephon")

#: Bump when the canonical form, the guessed ids or the tiktoken checks change.
FORMAT = 2
_ENV = "ZEPHON_TOKENIZER_CACHE"
_salt: str | None = None


def cache_enabled() -> bool:
    """Whether the cache is on (``ZEPHON_TOKENIZER_CACHE`` is not ``0``/``off``/``false``/``no``)."""
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_folder() -> str:
    root = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "tokenizers")


def _installed_version(name: str) -> str:
    """The installed version of distribution ``name`` (``"-"`` if none), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def salt() -> str:
    """What every entry must have been made with: library versions, this format, the check texts."""
    global _salt
    if _salt is None:
        try:
            import tokenizers

            tk = tokenizers.__version__
        except ImportError:  # pragma: no cover - tokenizers is a dependency
            tk = "-"
        tt = _installed_version("tiktoken")
        from .tiktoken_encoding import _verification_texts

        texts = hashlib.sha256("\0".join(_verification_texts()).encode("utf-8", "surrogatepass")).hexdigest()[:16]
        _salt = f"{FORMAT}/{tk}/{tt}/{texts}"
    return _salt


def file_digest(path: str) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _path(kind: str, key: str) -> str:
    return os.path.join(cache_folder(), f"{kind}-{key}.msgpack")


def entry_path(kind: str, key: str, name: str) -> str:
    """The path of a file that belongs to the entry ``kind``/``key`` (``name``: its suffix)."""
    return os.path.join(cache_folder(), f"{kind}-{key}.{name}")


def load_entry(kind: str, key: str) -> dict[str, Any] | None:
    """The entry stored for ``key``, or ``None`` (absent, unreadable, or made with another salt)."""
    if not cache_enabled():
        return None
    try:
        with open(_path(kind, key), "rb") as f:
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
    target = _path(kind, key)
    folder = os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        with replacing(target) as out:
            out.write(msgspec.msgpack.encode({**entry, "key": key, "salt": salt()}))
    except OSError as exc:
        logger.debug("zephon: cannot write the tokenizer cache %s: %s", folder, exc)
