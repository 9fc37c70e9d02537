"""Resolving tokenizers into :class:`TokenizerHandle`, a frozen value that encodes text batches.

The tiktoken backend is used only once proven to give the ``tokenizers`` ids
(:mod:`zephon.text.tiktoken_encoding`); else ``backend="auto"`` logs why and uses ``tokenizers``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from . import bpe_files as _bpe_files
from . import hub as _hub
from . import tokenizer_cache as _tokcache
from ..core.cache import ProcessCache
from ..core.log import logger
from .encoder_threads import EXTRA_ENCODER_THREADS as EXTRA_ENCODER_THREADS
from .encoder_threads import _encode_longest_first, _encoder_threads, _size_rayon_pool
from .tiktoken_encoding import _build_tiktoken, _tiktoken_available, _tiktoken_plan, _tiktoken_usable, _verify_tiktoken

__all__ = ["BACKENDS", "TokenizerHandle", "TokenizerLoadError", "load_tokenizer"]

#: Encoding backends a handle can be asked for.
BACKENDS = ("auto", "tokenizers", "tiktoken")

_LOCAL_ADVICE = (
    'pass a local file instead: tokenize(tokenizer="path/to/tokenizer.json") (or tokenizer_id="path/to/tokenizer.json"), '
    'a folder holding tokenizer.json (and optionally tokenizer_config.json): tokenize(tokenizer="path/to/folder"), '
    "or a tokenizers.Tokenizer object: tokenize(tokenizer=Tokenizer.from_file(...))"
)

# Special tokens tried in order when no config names them; GPT-2's <|endoftext|> is EOS only.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<BOS>", "<|startoftext|>", "[CLS]")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<EOS>", "<|endoftext|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<PAD>", "<|padding|>")
_ROLES = ("bos", "eos", "pad")


class TokenizerLoadError(ValueError):
    """A tokenizer could not be found or read; the message says how to pass one locally."""


@attrs.frozen(eq=False, repr=False)
class TokenizerHandle:
    """A resolved tokenizer (:func:`load_tokenizer`): its content, special ids and a batch encoder.

    It pickles as the canonical JSON (sorted keys, no truncation or padding) and the ids; the live
    tokenizer is built once per process, on first use. ``backend``: ``"tokenizers"`` or
    ``"tiktoken"`` (only when proven exact). ``encode_special_tokens``: special tokens written in
    the text are plain text. ``source`` is for messages only, not part of the identity.

    Examples:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
        >>> tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> _ = tok.add_special_tokens(["<s>", "</s>"])
        >>> handle = load_tokenizer(tok)
        >>> handle.bos_token_id, handle.eos_token_id, handle.pad_token_id
        (1, 2, None)
        >>> handle.encode_batch(["hello world", "world"])
        [array([3, 4], dtype=int32), array([4], dtype=int32)]
    """

    tokenizer_json: str
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    backend: str = "tokenizers"
    encode_special_tokens: bool = False
    source: str = ""
    _json_digest: str = attrs.field(init=False)
    _content: str = attrs.field(init=False)
    _digest: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.backend not in ("tokenizers", "tiktoken"):
            raise ValueError(f"TokenizerHandle: backend must be 'tokenizers' or 'tiktoken', got {self.backend!r}")
        # _content names what encodes text; _digest adds the special ids.
        json_digest = hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()
        content = json_digest + ("+encode_special_tokens" if self.encode_special_tokens else "")
        ids = json.dumps([self.bos_token_id, self.eos_token_id, self.pad_token_id])
        object.__setattr__(self, "_json_digest", json_digest)
        object.__setattr__(self, "_content", content)
        object.__setattr__(self, "_digest", hashlib.sha256(f"{content}\0{ids}".encode("ascii")).hexdigest())

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical JSON and the special ids (not the backend: both give the same ids)."""
        return self._digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenizerHandle):
            return NotImplemented
        return self._digest == other._digest and self.backend == other.backend

    def __hash__(self) -> int:
        return hash((self._digest, self.backend))

    def __repr__(self) -> str:
        ids = f"bos_token_id={self.bos_token_id}, eos_token_id={self.eos_token_id}, pad_token_id={self.pad_token_id}"
        return f"TokenizerHandle(source={self.source!r}, {ids}, backend={self.backend!r}, fingerprint={self._digest[:12]!r})"

    def __reduce__(self):
        # The live tokenizer never travels; the receiving process rebuilds it from the JSON.
        fields = (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.backend, self.encode_special_tokens)
        return TokenizerHandle, (self.tokenizer_json, *fields, self.source)

    @property
    def tokenizer(self) -> Any:
        """The live ``tokenizers.Tokenizer`` of this process (built on first use, then shared)."""
        return _LIVE.get(("tokenizer", self._content), self._build_tokenizer)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or ``None`` when it is not in the vocabulary."""
        return self.tokenizer.token_to_id(token)

    def _build_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        # From proven cached model files (quicker for a large BPE); the first build proves them.
        tok = _bpe_files.build(self._json_digest)
        if tok is None:
            tok = Tokenizer.from_str(self.tokenizer_json)
            _bpe_files.remember(self.tokenizer_json, self._json_digest, tok)
        if self.encode_special_tokens:
            tok.encode_special_tokens = True
        return tok

    def _encoding(self) -> Any:
        return _LIVE.get(("tiktoken", self._content), self._build_encoding)

    def _build_encoding(self) -> Any:
        plan, reason = _tokcache.load_proof(self._content)
        if plan is None:
            plan, reason = _tiktoken_plan(json.loads(self.tokenizer_json))
        if plan is None:  # cannot happen for a handle made by load_tokenizer
            raise RuntimeError(f"tokenizer cannot use the tiktoken backend: {reason}")
        return _build_tiktoken(plan, self._content)

    def load_encoder(self) -> TokenizerHandle:
        """Build this process's live encoder now, not in the first encode; returns self."""
        self._encoding() if self.backend == "tiktoken" and _tiktoken_usable() else self.tokenizer
        return self

    def with_backend(self, backend: str) -> TokenizerHandle:
        """This handle with the encoder chosen again for ``backend`` (``auto``, ``tokenizers``, ``tiktoken``)."""
        effective = _choose_backend(self, backend)
        if effective == "tokenizers":
            _bpe_files.prepare(self.tokenizer_json, self._json_digest)
        return self if effective == self.backend else attrs.evolve(self, backend=effective)

    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[np.ndarray]:
        """Encode texts to one writable ``int32`` id array each, adding no special tokens.

        ``num_threads`` (``None``: one per CPU) sizes tiktoken's pool, or ``tokenizers``' Rayon
        pool, which takes the size given before its first use in the process (a later one warns).
        Raises ``ValueError`` for a text that is not UTF-8 (an unpaired surrogate).
        """
        return self.encode_bracketed(texts, num_threads=num_threads)

    def encode_bracketed(
        self, texts: Sequence[str], *, bos: int | None = None, eos: int | None = None, keep: int | None = None,
        num_threads: int | None = None,
    ) -> list[np.ndarray]:
        """:meth:`encode_batch`, each text's ids cut to their first ``keep`` and put between ``bos``
        and ``eos`` (each when not ``None``), copied into their array once."""
        if not texts:
            return []
        try:
            if self.backend == "tiktoken" and _tiktoken_usable():
                return self._encode_tiktoken(texts, num_threads, bos, eos, keep)
            return self._encode_tokenizers(texts, num_threads, bos, eos, keep)
        except (TypeError, UnicodeEncodeError, ValueError) as exc:
            _raise_unencodable(texts, exc)
            raise

    def _encode_tokenizers(
        self, texts: Sequence[str], num_threads: int | None, bos: int | None, eos: int | None, keep: int | None
    ) -> list[np.ndarray]:
        tok = self.tokenizer
        texts = texts if isinstance(texts, list) else list(texts)
        _size_rayon_pool(_LIVE, num_threads)
        # encode_batch_fast skips the offsets; the ids list is cut and bracketed, then read once.
        encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        encodings = encode(texts, add_special_tokens=False)
        out = []
        for enc in encodings:
            ids = enc.ids
            if keep is not None and len(ids) > keep:
                del ids[keep:]
            if bos is not None:
                ids.insert(0, bos)
            if eos is not None:
                ids.append(eos)
            out.append(np.fromiter(ids, dtype=np.int32, count=len(ids)))
        return out

    def _encode_tiktoken(
        self, texts: Sequence[str], num_threads: int | None, bos: int | None, eos: int | None, keep: int | None
    ) -> list[np.ndarray]:
        enc = self._encoding()
        allowed = frozenset() if self.encode_special_tokens else enc.special_tokens_set
        start = 0 if bos is None else 1
        extra = start + (eos is not None)
        if hasattr(enc, "encode_to_numpy"):  # uint32, read-only: a view of tiktoken's buffer
            ids_of = functools.partial(
                enc.encode_to_numpy, allowed_special=allowed, disallowed_special=()
            )
        else:  # tiktoken < 0.8

            def ids_of(text: str) -> np.ndarray:
                return np.array(enc.encode(text, allowed_special=allowed, disallowed_special=()), dtype=np.int32)

        def one(text: str) -> np.ndarray:
            ids = ids_of(text)
            if keep is not None and len(ids) > keep:
                ids = ids[:keep]
            out = np.empty(len(ids) + extra, dtype=np.int32)
            if bos is not None:
                out[0] = bos
            out[start : start + len(ids)] = ids
            if eos is not None:
                out[-1] = eos
            return out

        threads = min(num_threads or _encoder_threads(), len(texts))
        if threads == 1:
            return [one(t) for t in texts]
        return _encode_longest_first(one, texts, _thread_pool(threads - 1), threads)


def _raise_unencodable(texts: Sequence[str], exc: BaseException) -> None:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} of the batch is a {type(text).__name__}, expected str") from exc
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as bad:
            raise ValueError(
                f"text {i} of the batch cannot be encoded as UTF-8 ({bad.reason} at character {bad.start}); "
                "repair it before tokenizing, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
            ) from exc


# Live tokenizers, tiktoken encodings and thread pools of this process.
_LIVE = ProcessCache()
# Why the tiktoken path is not exact ("" when it is), by content; kept in forked children.
_VERIFIED = ProcessCache(clear_after_fork=False)


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    return _LIVE.get(("pool", threads), lambda: ThreadPoolExecutor(threads, thread_name_prefix="zephon-tiktoken"))


def load_tokenizer(tokenizer: Any = None, tokenizer_id: str | None = None, *, backend: str = "auto") -> TokenizerHandle:
    """Resolve a tokenizer into a :class:`TokenizerHandle`.

    Special ids come from ``tokenizer_config.json`` / ``special_tokens_map.json`` (the latter wins;
    ``null`` means none), a transformers tokenizer's ``*_token_id``, else well-known special tokens
    of the vocabulary (``<s>``, ``<|end_of_text|>``, ``[SEP]``, ``<pad>``...).

    ``tokenizer``: a ``tokenizers.Tokenizer``, a transformers fast tokenizer, a path to a
    ``tokenizer.json`` or its folder, or a handle; ``tokenizer_id``: a local path or a Hugging Face
    id (:mod:`zephon.text.hub`); ``backend``: ``"tokenizers"``, ``"tiktoken"`` (when proven exact,
    else an error) or ``"auto"``. Raises :class:`TokenizerLoadError` when none can be loaded,
    ``TypeError``, ``ValueError`` (an unknown backend), ``ImportError`` (tiktoken missing).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if tokenizer is None and tokenizer_id is None:
        raise TokenizerLoadError(
            "no tokenizer given: pass tokenizer= (a tokenizers.Tokenizer, a transformers fast tokenizer, "
            'a tokenizer.json path or a folder), or tokenizer_id= (a local path or a Hugging Face id like "gpt2")'
        )
    if tokenizer is not None and tokenizer_id is not None:
        raise TokenizerLoadError(
            "pass either tokenizer= or tokenizer_id=, not both (got tokenizer="
            + (repr(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else f"<{type(tokenizer).__name__}>")
            + f" and tokenizer_id={tokenizer_id!r})"
        )
    if isinstance(tokenizer, TokenizerHandle):
        handle = tokenizer
    elif tokenizer is not None:
        handle = _from_object(tokenizer)
    elif isinstance(tokenizer_id, (str, os.PathLike)):
        handle = _from_id(os.fspath(tokenizer_id))
    else:
        raise TypeError(
            "tokenizer_id must be a str (a local path or a Hugging Face id), "
            f"got {type(tokenizer_id).__name__}"
        )
    return handle.with_backend(backend)


def _from_object(obj: Any) -> TokenizerHandle:
    from tokenizers import Tokenizer

    if isinstance(obj, (str, os.PathLike)):
        path = Path(os.fspath(obj)).expanduser()
        if not path.exists():
            hint = ""
            if isinstance(obj, str) and not os.path.isabs(obj) and obj.count("/") <= 1:
                hint = f"; to load a Hugging Face model by name use tokenizer_id={obj!r}"
            raise TokenizerLoadError(f"tokenizer={obj!r}: no such file or folder{hint}")
        return _from_path(path)
    if isinstance(obj, Tokenizer):
        return _make_handle(obj, {}, "tokenizers.Tokenizer object")
    backend = getattr(obj, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        given = {role: getattr(obj, f"{role}_token_id") for role in _ROLES if hasattr(obj, f"{role}_token_id")}
        ids = {role: None if value is None else int(value) for role, value in given.items()}
        name = getattr(obj, "name_or_path", None) or type(obj).__name__
        return _make_handle(backend, ids, f"{type(obj).__name__} {name!r}")
    raise TypeError(
        f"tokenizer must be a tokenizers.Tokenizer, an object with a .backend_tokenizer (a transformers fast "
        f"tokenizer), or a path to tokenizer.json or its folder; got {type(obj).__name__}"
    )


def _from_path(path: Path) -> TokenizerHandle:
    from tokenizers import Tokenizer

    folder = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        present = sorted(p.name for p in folder.iterdir())[:12]
        slow = [n for n in present if n in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model")]
        hint = (
            f"; it holds {slow}, the files of a slow tokenizer: save a fast one first, e.g. "
            "AutoTokenizer.from_pretrained(folder).save_pretrained(folder) with transformers"
        ) if slow else ""
        raise TokenizerLoadError(f"no tokenizer.json in {str(folder)!r} (it holds {present}){hint}")
    key = None  # the file's key in the on-disk cache: the sha256 of its bytes
    if _tokcache.cache_enabled():
        with contextlib.suppress(OSError):
            key = _tokcache.file_digest(str(file))
    cached = _cached_file_handle(file, key, path.is_dir()) if key else None
    if cached is not None:
        return cached
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerLoadError(
            f"cannot read {str(file)!r} as a Hugging Face tokenizer.json ({type(exc).__name__}: {exc}); "
            "pass the tokenizer.json written by tokenizers/transformers, or the folder holding it"
        ) from exc
    # A file stands alone: sibling config files are read only when the folder is passed.
    ids = _config_ids(tok, folder) if path.is_dir() else {}
    handle = _make_handle(tok, ids, str(folder if path.is_dir() else file), owned=True)
    if key:
        entry = {"json": handle.tokenizer_json, "content": handle._content, "ids": _guess_ids(tok)}
        _tokcache.store_entry("file", key, {**entry, "encode_special_tokens": handle.encode_special_tokens})
    return handle


def _cached_file_handle(file: Path, key: str, folder_given: bool) -> TokenizerHandle | None:
    """The handle of ``file`` from its cache entry, or ``None``; a folder's configs are reread."""
    entry = _tokcache.load_entry("file", key)
    if entry is None:
        return None
    try:
        guessed = {role: entry["ids"][role] for role in _ROLES}
        handle = TokenizerHandle(
            entry["json"], *guessed.values(), "tokenizers", bool(entry["encode_special_tokens"]), str(file)
        )
    except (KeyError, TypeError, ValueError):
        return None
    if handle._content != entry.get("content"):
        return None
    if not folder_given:
        return handle
    ids = {**guessed, **_config_ids(handle, file.parent)}
    return attrs.evolve(handle, source=str(file.parent), **{f"{role}_token_id": v for role, v in ids.items()})


def _config_ids(tok: Any, folder: Path) -> dict[str, int | None]:
    """The special ids named by the folder's config files (``null``: none; unknown tokens warn)."""
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # later files win
        p = folder / name
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot read {str(p)!r}: {exc}; fix or remove it") from exc
        if isinstance(data, dict):
            config.update((r, data[f"{r}_token"]) for r in _ROLES if f"{r}_token" in data)
    ids: dict[str, int | None] = {}
    for role, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        ids[role] = None if value is None else tok.token_to_id(str(value))
        if value is not None and ids[role] is None:
            logger.warning(
                "tokenizer in %s: %s_token %r from its config is not in the vocabulary; treating it as absent",
                folder, role, value,
            )
    return ids


def _guess_ids(tok: Any) -> dict[str, int | None]:
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    candidates = (_BOS_CANDIDATES, _EOS_CANDIDATES, _PAD_CANDIDATES)
    return {role: next((tok.token_to_id(c) for c in cs if c in specials), None) for role, cs in zip(_ROLES, candidates)}


def _canonical_json(tok: Any) -> str:
    try:
        spec = json.loads(tok.to_str())
    except Exception as exc:
        raise TokenizerLoadError(
            f"this tokenizer cannot be serialized ({type(exc).__name__}: {exc}); custom Python components are "
            "not supported, " + _LOCAL_ADVICE
        ) from exc
    # Truncation and padding are zephon's job (and would silently change ids); drop them.
    spec.update(truncation=None, padding=None)
    return json.dumps(spec, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _make_handle(tok: Any, ids: dict[str, int | None], source: str, *, owned: bool = False) -> TokenizerHandle:
    """The handle of ``tok``; ``owned`` when no one else holds ``tok``, so it may serve as the live copy."""
    resolved = {**_guess_ids(tok), **ids}  # given ids (None included) win
    special = bool(getattr(tok, "encode_special_tokens", False))
    handle = TokenizerHandle(_canonical_json(tok), *resolved.values(), "tokenizers", special, source)
    if owned:
        # The live copy of this process (never a caller's object, which the caller may change).
        tok.no_truncation()
        tok.no_padding()
        _LIVE.get(("tokenizer", handle._content), lambda: tok)
    return handle


def _from_id(tokenizer_id: str) -> TokenizerHandle:
    local = Path(tokenizer_id).expanduser()
    if local.exists():
        return _from_path(local)
    if tokenizer_id.startswith(("/", "./", "../", "~")) or tokenizer_id.endswith(".json"):
        raise TokenizerLoadError(f"tokenizer_id={tokenizer_id!r}: no such file or folder")
    cache = _hub.cache_dir()
    found = _hub.snapshots(tokenizer_id, cache)
    if len(found) > 1:
        raise TokenizerLoadError(
            f"tokenizer_id={tokenizer_id!r}: the hub cache holds {len(found)} snapshots with a "
            f"tokenizer.json ({[p.name for p in found]}) and no refs/main to choose one; "
            f'pass the one you want as tokenizer="{found[-1]}"'
        )
    if found:
        return attrs.evolve(_from_path(found[0]), source=f"{tokenizer_id} (hub cache {found[0]})")
    looked = cache / ("models--" + tokenizer_id.replace("/", "--")) / "snapshots" / "*" / "tokenizer.json"
    folder, reason = _hub.download(tokenizer_id, cache)
    if folder is not None:
        return attrs.evolve(_from_path(folder), source=f"{tokenizer_id} (downloaded to {folder})")
    raise TokenizerLoadError(
        f"cannot load tokenizer_id={tokenizer_id!r}: it is not a local path, it is not in the local Hugging Face "
        f"cache (looked for {looked}), and it cannot be fetched from the hub: {reason}. To use a tokenizer you have as a "
        f"file, {_LOCAL_ADVICE}"
    )


def _choose_backend(handle: TokenizerHandle, backend: str) -> str:
    """The encoder ``handle`` uses for ``backend``: an explicit ``"tiktoken"`` is used or raises;
    ``"auto"`` takes tiktoken when installed and proven exact, else ``tokenizers`` (logged)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "tokenizers":
        return "tokenizers"
    if not _tiktoken_available():
        if backend == "tiktoken":
            raise ImportError(
                "backend='tiktoken' needs tiktoken, which is not installed: pip install 'zephon-lanes[fast]'; or use "
                "backend='auto' (tiktoken where it is installed and exact, else tokenizers, same ids) or backend='tokenizers'"
            )
        logger.info("tokenizer %s: tiktoken is not installed; using tokenizers", handle.source)
        return "tokenizers"
    reason = _VERIFIED.get(handle._content, lambda: _prove_tiktoken(handle))
    if reason:
        if backend == "tiktoken":
            raise TokenizerLoadError(
                f"backend='tiktoken' cannot encode the tokenizer {handle.source} exactly: {reason}; use backend='auto' "
                "(tiktoken where it is exact, else tokenizers, same ids) or backend='tokenizers'"
            )
        logger.info("tokenizer %s: not using tiktoken because %s; using tokenizers", handle.source, reason)
        return "tokenizers"
    return "tiktoken"


def _prove_tiktoken(handle: TokenizerHandle) -> str:
    """``""`` when the tiktoken path is exact for ``handle`` (keeping its encoding), else why not;
    stored in the on-disk cache for later processes."""
    key = handle._content
    plan, reason = _tokcache.load_proof(key)
    if reason:
        return reason
    if plan is not None:
        with contextlib.suppress(Exception):  # an entry tiktoken no longer takes: prove again
            encoding = _build_tiktoken(plan, key)
            _LIVE.get(("tiktoken", key), lambda: encoding)
            return ""
    plan, reason = _tiktoken_plan(json.loads(handle.tokenizer_json))
    if plan is None:
        _tokcache.store_proof(key, None, reason)
        return reason
    try:
        encoding = _build_tiktoken(plan, key)
    except Exception as exc:  # tiktoken refused the ranks
        return f"tiktoken could not build it ({type(exc).__name__}: {exc})"
    reason = _verify_tiktoken(handle.tokenizer, encoding, plan, handle.encode_special_tokens)
    if not reason:
        _LIVE.get(("tiktoken", key), lambda: encoding)
    _tokcache.store_proof(key, plan, reason)
    return reason
