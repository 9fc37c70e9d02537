"""A faster build of a BPE tokenizer: ``models.BPE.from_file`` on vocabulary and merges files.

Every process that encodes with ``tokenizers`` builds the tokenizer, and ``from_file`` is faster
than ``Tokenizer.from_str``. The files go to :mod:`zephon.text.tokenizer_cache` once a fast build
serializes exactly as ``from_str``'s (else the entry records why not). A fast build takes the
model from the files (checked by sha256), the rest from a skeleton (the JSON without vocabulary,
merges and added tokens), then the added tokens in order.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from . import tokenizer_cache as _tokcache
from ..core.atomic import discard, replacing

__all__ = ["build", "prepare", "remember"]

KIND = "bpe"
#: The options ``models.BPE.from_file`` takes besides the two files.
_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges")


def build(key: str) -> Any | None:
    """The tokenizer whose JSON has sha256 ``key``, built from its cached files; ``None`` without a proven entry."""
    entry = _tokcache.load_entry(KIND, key)
    if entry is None or entry.get("reason") != "":
        return None
    try:
        files = _checked_files(key, entry)
        return None if files is None else _assemble(entry, *files)
    except Exception:  # a damaged entry only costs the slow build; remember() rewrites it
        return None


def remember(tokenizer_json: str, key: str, tok: Any) -> None:
    """Prove the fast build of ``tokenizer_json`` (sha256 ``key``) against ``tok``, its
    ``Tokenizer.from_str``, and record the outcome (unless the cache is off or has it intact)."""
    if not _tokcache.cache_enabled():
        return
    entry = _tokcache.load_entry(KIND, key)
    if entry is not None and (entry.get("reason") != "" or _checked_files(key, entry) is not None):
        return
    try:
        entry = _prove(key, json.loads(tokenizer_json), tok)
    except OSError:
        return  # an unwritable folder: every process builds the slow way
    except Exception as exc:  # never fails a build: recorded, and built from the JSON from now on
        entry = {"reason": f"the proof failed ({type(exc).__name__}: {exc})"}
    _tokcache.store_entry(KIND, key, entry)


def prepare(tokenizer_json: str, key: str) -> None:
    """Prove the files of ``tokenizer_json`` (sha256 ``key``) now, unless an entry exists: once per
    machine, where the tokenizer is loaded, not in a worker or restore."""
    if not _tokcache.cache_enabled() or _tokcache.load_entry(KIND, key) is not None:
        return
    from tokenizers import Tokenizer

    remember(tokenizer_json, key, Tokenizer.from_str(tokenizer_json))


def _prove(key: str, spec: dict[str, Any], tok: Any) -> dict[str, Any]:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return {"reason": f"the model is {model.get('type')!r}, not BPE"}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    if any(len(m) != 2 or any(not p or " " in p or "\n" in p or "\r" in p for p in m) for m in merges):
        return {"reason": "a merge has a token with a space or a line break, which merges.txt cannot hold"}
    vocab = json.dumps(model.get("vocab", {}), ensure_ascii=False).encode("utf-8")
    text = ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)).encode("utf-8")
    entry: dict[str, Any] = {
        "reason": "",
        "skeleton": json.dumps({**spec, "model": {"type": "BPE", "vocab": {}, "merges": []}, "added_tokens": []}),
        "options": {k: model[k] for k in _OPTIONS if model.get(k) is not None},
        "added": spec.get("added_tokens") or [],
        "vocab_sha": hashlib.sha256(vocab).hexdigest(),
        "merges_sha": hashlib.sha256(text).hexdigest(),
    }
    paths = _paths(key)
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    for path, data in zip(paths, (vocab, text)):
        with replacing(path) as out:
            out.write(data)
    try:
        differs = _assemble(entry, *paths).to_str() != tok.to_str()
        reason = "the fast build serializes differently" if differs else ""
    except Exception as exc:
        reason = f"the fast build failed ({type(exc).__name__}: {exc})"
    if reason:
        for path in paths:  # never used: not kept
            discard(path)
        return {"reason": reason}
    return entry


def _paths(key: str) -> tuple[str, str]:
    return _tokcache.entry_path(KIND, key, "vocab.json"), _tokcache.entry_path(KIND, key, "merges.txt")


def _checked_files(key: str, entry: dict[str, Any]) -> tuple[str, str] | None:
    """The entry's two files, if they still hold what it recorded."""
    paths = _paths(key)
    try:
        digests = [_tokcache.file_digest(p) for p in paths]
    except OSError:
        return None
    return paths if digests == [entry.get("vocab_sha"), entry.get("merges_sha")] else None


def _assemble(entry: dict[str, Any], vocab: str, merges: str) -> Any:
    from tokenizers import AddedToken, Tokenizer, models

    skeleton = Tokenizer.from_str(entry["skeleton"])
    tok = Tokenizer(models.BPE.from_file(vocab, merges, **entry["options"]))
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        value = getattr(skeleton, part)
        if value is not None:
            setattr(tok, part, value)
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    added = [AddedToken(t["content"], **{flag: t[flag] for flag in flags}) for t in entry["added"]]
    if added:
        tok.add_tokens(added)
    return tok
