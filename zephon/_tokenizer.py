"""Resolving, wrapping and pickling tokenizers.

:func:`load_tokenizer` turns whatever the user passes (a ``tokenizers.Tokenizer``, a transformers
fast tokenizer, a ``tokenizer.json`` file, a folder, or a Hugging Face model id found in the local
cache) into a :class:`TokenizerHandle`: a frozen, picklable value that knows the tokenizer's
content (its canonical JSON), the resolved BOS/EOS/PAD ids and a content fingerprint, and that
encodes batches of text to ``int32`` arrays.

A handle pickles as its JSON text and ids only. The live ``tokenizers.Tokenizer`` (and, for the
tiktoken fast path, the ``tiktoken.Encoding``) is rebuilt lazily, once per process, and shared by
every handle with the same content, so a handle is cheap to send to ``spawn`` workers.

The tiktoken fast path is exact by construction checks and by test: it is offered only for GPT-2
style byte-level BPE vocabularies whose merge order matches their token ids, and it is used only
after it reproduced the ``tokenizers`` ids on a built-in sample of varied text and on every
vocabulary entry. Otherwise the handle falls back to ``tokenizers`` and logs why on the
``"zephon"`` logger.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

__all__ = ["BACKENDS", "TokenizerHandle", "TokenizerLoadError", "load_tokenizer"]

logger = logging.getLogger("zephon")

#: Encoding backends a handle can be asked for.
BACKENDS = ("auto", "tokenizers", "tiktoken")

_LOCAL_ADVICE = (
    'pass a local file instead: tokenize(tokenizer="path/to/tokenizer.json"), or a folder holding '
    'tokenizer.json (and optionally tokenizer_config.json): tokenize(tokenizer="path/to/folder")'
)

# Well-known special tokens, tried in order when no tokenizer_config.json names them. GPT-2's
# <|endoftext|> is a document separator, so it counts as EOS only (GPT-2 has no BOS of its own).
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<BOS>", "<|startoftext|>", "[CLS]")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<EOS>", "<|endoftext|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<PAD>", "<|padding|>")

#: The pre-tokenization regex of GPT-2, as ``tokenizers``' ByteLevel pre-tokenizer applies it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerLoadError(ValueError):
    """A tokenizer could not be found or read; the message says how to pass one locally."""


# -- the handle ---------------------------------------------------------------------------------------


@attrs.frozen(eq=False, repr=False)
class TokenizerHandle:
    """A resolved tokenizer: its content, its special ids and a fast batch encoder.

    Build one with :func:`load_tokenizer`. The handle is immutable and pickles as the canonical
    tokenizer JSON plus the resolved ids; the live tokenizer is rebuilt lazily in each process
    and cached there, so unpickling many handles of one tokenizer loads it once.

    Attributes:
        tokenizer_json: the canonical ``tokenizer.json`` text (sorted keys, truncation and padding
            disabled).
        bos_token_id: the BOS id, or ``None`` when the tokenizer has none.
        eos_token_id: the EOS id, or ``None``.
        pad_token_id: the PAD id, or ``None``.
        backend: the encoder in use, ``"tokenizers"`` or ``"tiktoken"`` (the latter only when it
            was verified to give identical ids).
        encode_special_tokens: whether special tokens written in the text are encoded as plain
            text (``tokenizers.Tokenizer.encode_special_tokens``; ``False`` by default, so a literal
            ``<|endoftext|>`` in a document becomes the special id, as with Hugging Face).
        source: where the tokenizer came from (for messages only; not part of the identity).

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
    _content: str = attrs.field(init=False)
    _digest: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.backend not in ("tokenizers", "tiktoken"):
            raise ValueError(f"TokenizerHandle: backend must be 'tokenizers' or 'tiktoken', got {self.backend!r}")
        # _content names what encodes text (shared by handles that differ only in special ids);
        # _digest adds the ids, which decide the bracketing.
        content = hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()
        if self.encode_special_tokens:
            content += "+encode_special_tokens"
        ids = json.dumps([self.bos_token_id, self.eos_token_id, self.pad_token_id])
        object.__setattr__(self, "_content", content)
        object.__setattr__(self, "_digest", hashlib.sha256(f"{content}\0{ids}".encode("ascii")).hexdigest())

    # -- identity -----------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical tokenizer JSON and the resolved special ids.

        The encoder backend is not included: the tiktoken path is used only when it gives the
        same ids as ``tokenizers``.
        """
        return self._digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenizerHandle):
            return NotImplemented
        return self._digest == other._digest and self.backend == other.backend

    def __hash__(self) -> int:
        return hash((self._digest, self.backend))

    def __repr__(self) -> str:
        return (
            f"TokenizerHandle(source={self.source!r}, bos_token_id={self.bos_token_id}, "
            f"eos_token_id={self.eos_token_id}, pad_token_id={self.pad_token_id}, backend={self.backend!r}, "
            f"fingerprint={self._digest[:12]!r})"
        )

    def __reduce__(self):
        # The live tokenizer never travels; the receiving process rebuilds it from the JSON.
        return (
            TokenizerHandle,
            (
                self.tokenizer_json,
                self.bos_token_id,
                self.eos_token_id,
                self.pad_token_id,
                self.backend,
                self.encode_special_tokens,
                self.source,
            ),
        )

    # -- live objects -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The live ``tokenizers.Tokenizer`` of this process (built on first use, then shared)."""
        return _live(("tokenizer", self._content), self._build_tokenizer)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or ``None`` when it is not in the vocabulary."""
        return self.tokenizer.token_to_id(token)

    def _build_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(self.tokenizer_json)
        if self.encode_special_tokens:
            tok.encode_special_tokens = True
        return tok

    def _encoding(self) -> Any:
        return _live(("tiktoken", self._content), self._build_encoding)

    def _build_encoding(self) -> Any:
        plan, reason = _tiktoken_plan(json.loads(self.tokenizer_json))
        if plan is None:  # cannot happen for a handle made by load_tokenizer
            raise RuntimeError(f"tokenizer cannot use the tiktoken backend: {reason}")
        return _build_tiktoken(plan, self._content)

    def with_backend(self, backend: str) -> TokenizerHandle:
        """This handle with the encoder chosen again for ``backend`` (``auto``, ``tokenizers``, ``tiktoken``)."""
        effective = _choose_backend(self, backend)
        return self if effective == self.backend else attrs.evolve(self, backend=effective)

    # -- encoding -----------------------------------------------------------------------------------
    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[np.ndarray]:
        """Encode texts to ``int32`` id arrays, without adding special tokens.

        The whole batch goes to the native encoder in one call (``tokenizers`` parallelizes it on
        its Rayon pool; the tiktoken backend on ``num_threads`` threads).

        Args:
            texts: the texts.
            num_threads: threads for the tiktoken backend (``None``: one per CPU). The
                ``tokenizers`` backend always uses its native pool, sized by ``RAYON_NUM_THREADS``.

        Returns:
            One writable ``int32`` array per text.

        Raises:
            ValueError: a text cannot be encoded as UTF-8 (it holds an unpaired surrogate).
        """
        if not texts:
            return []
        try:
            if self.backend == "tiktoken" and _tiktoken_usable():
                return self._encode_tiktoken(texts, num_threads)
            return self._encode_tokenizers(texts)
        except (TypeError, UnicodeEncodeError, ValueError) as exc:
            _raise_unencodable(texts, exc)
            raise

    def _encode_tokenizers(self, texts: Sequence[str]) -> list[np.ndarray]:
        tok = self.tokenizer
        texts = texts if isinstance(texts, list) else list(texts)
        # encode_batch_fast skips the offsets, which we never use (same ids, ~25% faster).
        encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        encodings = encode(texts, add_special_tokens=False)
        # Encoding.ids builds a Python list (most of the cost); np.fromiter over it beat np.array,
        # np.asarray and fromiter with count= in measurements (about 5% of the encode time).
        return [np.fromiter(enc.ids, dtype=np.int32) for enc in encodings]

    def _encode_tiktoken(self, texts: Sequence[str], num_threads: int | None) -> list[np.ndarray]:
        enc = self._encoding()
        allowed = frozenset() if self.encode_special_tokens else enc.special_tokens_set
        if hasattr(enc, "encode_to_numpy"):

            def one(text: str) -> np.ndarray:
                return enc.encode_to_numpy(text, allowed_special=allowed, disallowed_special=()).astype(np.int32)

        else:  # tiktoken < 0.8

            def one(text: str) -> np.ndarray:
                return np.array(enc.encode(text, allowed_special=allowed, disallowed_special=()), dtype=np.int32)

        threads = num_threads or _cpu_count()
        if threads == 1 or len(texts) == 1:
            return [one(t) for t in texts]
        return list(_thread_pool(threads).map(one, texts))


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


# -- per-process caches -------------------------------------------------------------------------------

_LIVE: dict[tuple, Any] = {}
_LIVE_LOCK = threading.Lock()
_VERIFIED: dict[str, tuple[bool, str]] = {}


def _live(key: tuple, build) -> Any:
    """A per-process cached object; entries inherited through ``fork`` are not reused."""
    full = (os.getpid(),) + key
    obj = _LIVE.get(full)
    if obj is None:
        with _LIVE_LOCK:
            obj = _LIVE.get(full)
            if obj is None:
                pid = os.getpid()
                for stale in [k for k in _LIVE if k[0] != pid]:
                    del _LIVE[stale]
                obj = build()
                _LIVE[full] = obj
    return obj


def _reset_after_fork() -> None:
    # A lock held by another thread at fork time would never be released in the child; worker
    # threads of a pool do not survive fork either.
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    return _live(("pool", threads), lambda: ThreadPoolExecutor(threads, thread_name_prefix="zephon-tiktoken"))


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def _tiktoken_usable() -> bool:
    """Whether this process can run the tiktoken backend (warns once per process when not)."""

    def check() -> bool:
        if _tiktoken_available():
            return True
        logger.warning("tiktoken is not installed in this process; encoding with tokenizers (same ids)")
        return False

    return _live(("tiktoken-usable",), check)


def _tiktoken_available() -> bool:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return True


# -- loading ------------------------------------------------------------------------------------------


def load_tokenizer(tokenizer: Any = None, tokenizer_id: str | None = None, *, backend: str = "auto") -> TokenizerHandle:
    """Resolve a tokenizer into a :class:`TokenizerHandle`.

    Special ids come from ``tokenizer_config.json`` / ``special_tokens_map.json`` when they are
    present (the latter wins, as in transformers; a key set to ``null`` means "none"), from a
    transformers tokenizer's ``bos_token_id``/``eos_token_id``/``pad_token_id``, and otherwise from
    well-known special tokens of the vocabulary (``<s>``/``</s>``, ``<|begin_of_text|>``/
    ``<|end_of_text|>``, ``<bos>``/``<eos>``, ``[CLS]``/``[SEP]``, ``<pad>``/``[PAD]``...). A bare
    GPT-2 ``tokenizer.json`` resolves ``<|endoftext|>`` as EOS only; GPT-2's own
    ``tokenizer_config.json`` also names it BOS, and wins when present.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``; an object exposing one as ``backend_tokenizer``
            (a transformers fast tokenizer); a path to a ``tokenizer.json`` file or to a folder
            holding one; or a :class:`TokenizerHandle`.
        tokenizer_id: a local path (as above) or a Hugging Face model id such as ``"gpt2"`` or
            ``"org/name"``, looked up in the local hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
            ``~/.cache/huggingface/hub``) and, when ``huggingface_hub`` is installed and not
            offline, downloaded.
        backend: ``"tokenizers"``; ``"tiktoken"`` (used when it is verified exact for this
            tokenizer, else ``tokenizers`` with a warning); or ``"auto"`` (the same choice, logged at
            INFO).

    Returns:
        The handle.

    Raises:
        TokenizerLoadError: nothing or both of ``tokenizer``/``tokenizer_id`` given, a path with no
            ``tokenizer.json``, an unreadable file, or a model id neither cached nor downloadable.
        TypeError: ``tokenizer`` is of an unsupported type.
        ValueError: ``backend`` is not one of ``"auto"``, ``"tokenizers"``, ``"tiktoken"``.
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
            f"pass either tokenizer= or tokenizer_id=, not both (got tokenizer={_brief(tokenizer)} and "
            f"tokenizer_id={tokenizer_id!r})"
        )
    if isinstance(tokenizer, TokenizerHandle):
        return tokenizer.with_backend(backend)
    if tokenizer is not None:
        handle = _from_object(tokenizer)
    else:
        if not isinstance(tokenizer_id, (str, os.PathLike)):
            raise TypeError(
                f"tokenizer_id must be a str (a local path or a Hugging Face id), got {type(tokenizer_id).__name__}"
            )
        handle = _from_id(os.fspath(tokenizer_id))
    return handle.with_backend(backend)


def _brief(obj: Any) -> str:
    return repr(obj) if isinstance(obj, (str, os.PathLike)) else f"<{type(obj).__name__}>"


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
        ids = {}
        for role in ("bos", "eos", "pad"):
            if hasattr(obj, f"{role}_token_id"):
                value = getattr(obj, f"{role}_token_id")
                ids[role] = None if value is None else int(value)
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
            if slow
            else ""
        )
        raise TokenizerLoadError(f"no tokenizer.json in {str(folder)!r} (it holds {present}){hint}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerLoadError(
            f"cannot read {str(file)!r} as a Hugging Face tokenizer.json ({type(exc).__name__}: {exc}); "
            "pass the tokenizer.json written by tokenizers/transformers, or the folder holding it"
        ) from exc
    if not path.is_dir():
        # A file stands alone: sibling config files are read only when the folder is passed.
        return _make_handle(tok, {}, str(file), owned=True)
    return _make_handle(tok, _config_ids(tok, _read_special_config(folder), folder), str(folder), owned=True)


def _read_special_config(folder: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # later files win
        p = folder / name
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot read {str(p)!r}: {exc}; fix or remove it") from exc
        if isinstance(data, dict):
            for role in ("bos", "eos", "pad"):
                if f"{role}_token" in data:
                    merged[role] = data[f"{role}_token"]
    return merged


def _config_ids(tok: Any, config: dict[str, Any], folder: Path) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for role, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            ids[role] = None
            continue
        tid = tok.token_to_id(str(value))
        if tid is None:
            logger.warning(
                "tokenizer in %s: %s_token %r from its config is not in the vocabulary; treating it as absent",
                folder,
                role,
                value,
            )
        ids[role] = tid
    return ids


def _special_contents(tok: Any) -> set[str]:
    try:
        return {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    except AttributeError:  # very old tokenizers
        return set()


def _guess_ids(tok: Any) -> dict[str, int | None]:
    specials = _special_contents(tok)
    out: dict[str, int | None] = {}
    for role, candidates in (("bos", _BOS_CANDIDATES), ("eos", _EOS_CANDIDATES), ("pad", _PAD_CANDIDATES)):
        out[role] = next((tok.token_to_id(c) for c in candidates if c in specials), None)
    return out


def _canonical_json(tok: Any) -> str:
    try:
        spec = json.loads(tok.to_str())
    except Exception as exc:
        raise TokenizerLoadError(
            f"this tokenizer cannot be serialized ({type(exc).__name__}: {exc}); custom Python components are "
            "not supported, " + _LOCAL_ADVICE
        ) from exc
    # Truncation and padding are zephon's job (and would silently change ids); drop them.
    spec["truncation"] = None
    spec["padding"] = None
    return json.dumps(spec, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _make_handle(tok: Any, ids: dict[str, int | None], source: str, *, owned: bool = False) -> TokenizerHandle:
    """The handle of ``tok``; ``owned`` when no one else holds ``tok``, so it may serve as the live copy."""
    guessed = _guess_ids(tok)
    resolved = {role: ids[role] if role in ids else guessed[role] for role in ("bos", "eos", "pad")}
    handle = TokenizerHandle(
        _canonical_json(tok),
        resolved["bos"],
        resolved["eos"],
        resolved["pad"],
        "tokenizers",
        bool(getattr(tok, "encode_special_tokens", False)),
        source,
    )
    if owned:
        # Saves rebuilding it from the JSON in this process; a caller's object is never reused,
        # since the caller may still change it.
        tok.no_truncation()
        tok.no_padding()
        _live(("tokenizer", handle._content), lambda: tok)
    return handle


# -- Hugging Face hub ----------------------------------------------------------------------------------


def _hub_cache_dir() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _offline() -> bool:
    truthy = ("1", "on", "yes", "true")
    if any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (snapshots / commit / "tokenizer.json").is_file():
            return snapshots / commit
    found = sorted(p for p in snapshots.iterdir() if (p / "tokenizer.json").is_file())
    if len(found) > 1:
        raise TokenizerLoadError(
            f"tokenizer_id={repo_id!r}: the hub cache holds {len(found)} snapshots with a tokenizer.json "
            f"({[p.name for p in found]}) and no refs/main to choose one; pass the one you want as "
            f'tokenizer="{found[-1]}"'
        )
    return found[0] if found else None


def _from_id(tokenizer_id: str) -> TokenizerHandle:
    local = Path(tokenizer_id).expanduser()
    if local.exists():
        return _from_path(local)
    if tokenizer_id.startswith(("/", "./", "../", "~")) or tokenizer_id.endswith(".json"):
        raise TokenizerLoadError(f"tokenizer_id={tokenizer_id!r}: no such file or folder")
    cache = _hub_cache_dir()
    snapshot = _cached_snapshot(tokenizer_id, cache)
    if snapshot is not None:
        handle = _from_path(snapshot)
        return attrs.evolve(handle, source=f"{tokenizer_id} (hub cache {snapshot})")
    looked = cache / ("models--" + tokenizer_id.replace("/", "--")) / "snapshots" / "*" / "tokenizer.json"
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        reason = "huggingface_hub is not installed"
    else:
        if _offline():
            reason = "offline mode is on (HF_HUB_OFFLINE)"
        else:
            try:
                file = Path(hf_hub_download(tokenizer_id, "tokenizer.json", cache_dir=str(cache)))
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                reason = f"the download failed ({type(exc).__name__}: {first}; HF_HUB_OFFLINE=1 skips the attempt)"
            else:
                for extra in ("tokenizer_config.json", "special_tokens_map.json"):
                    try:
                        hf_hub_download(tokenizer_id, extra, cache_dir=str(cache))
                    except Exception:  # optional files; absent for many models
                        pass
                handle = _from_path(file.parent)
                return attrs.evolve(handle, source=f"{tokenizer_id} (downloaded to {file.parent})")
    raise TokenizerLoadError(
        f"cannot load tokenizer_id={tokenizer_id!r}: it is not a local path, it is not in the local Hugging Face "
        f"cache (looked for {looked}), and the hub is unreachable: {reason}. To use a tokenizer you have as a "
        f"file, {_LOCAL_ADVICE}"
    )


# -- the tiktoken fast path -------------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table (each byte is shown as one printable char)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _tiktoken_plan(spec: dict) -> tuple[dict | None, str]:
    """Check that a tokenizer is GPT-2 style byte-level BPE and build tiktoken's inputs.

    Returns ``(plan, "")`` or ``(None, reason)``. The checks make tiktoken's algorithm (merge the
    adjacent pair whose concatenation has the lowest id; a piece that is a whole token is kept)
    coincide with ``tokenizers``' BPE (merge the pair with the lowest merge rank).
    """
    if spec.get("normalizer") is not None:
        return None, f"it has a normalizer ({spec['normalizer'].get('type')})"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None, "its ByteLevel pre-tokenizer adds a prefix space or has no regex"
        pattern = GPT2_PATTERN
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") != "Split"
            or regex is None
            or split.get("behavior") != "Isolated"
            or split.get("invert")
            or byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space")
            or byte_level.get("use_regex")
        ):
            return None, "its pre-tokenizer is not Split(regex, isolated) + ByteLevel"
        pattern = regex
    else:
        return None, f"its pre-tokenizer is {pre.get('type')!r}, not GPT-2's byte-level one"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"its model is {model.get('type')!r}, not BPE"
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "its BPE uses dropout or subword prefixes/suffixes"
    added = spec.get("added_tokens") or []
    for t in added:
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return None, f"added token {t['content']!r} strips spaces or matches single words only"
    contents = [t["content"] for t in added]
    for a in contents:
        for b in contents:
            if a != b and b.startswith(a):
                return None, f"added tokens {a!r} and {b!r} overlap"
    # Map each byte-level char to the latin-1 char of its byte; chars outside the alphabet are
    # deleted (U+0000-U+00FF) or fail to encode (above), and either way the entry is rejected.
    table = {c: None for c in range(256)}
    table.update({ord(ch): chr(b) for ch, b in _byte_decoder().items()})
    vocab: dict[str, int] = model.get("vocab") or {}
    added_ids = {t["content"]: t["id"] for t in added}
    ranks: dict[bytes, int] = {}
    for token, tid in vocab.items():
        if token in added_ids:
            continue
        mapped = token.translate(table)
        try:
            if len(mapped) != len(token):
                raise UnicodeError
            ranks[mapped.encode("latin-1")] = tid
        except UnicodeError:
            return None, f"vocabulary entry {token!r} is not byte-level"
    if len(ranks) != len(vocab) - sum(1 for t in vocab if t in added_ids):
        return None, "two vocabulary entries decode to the same bytes"
    if any(bytes([b]) not in ranks for b in range(256)):
        return None, "not every single byte has a token"
    merged: set[str] = set()
    last = -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tid = vocab.get(a + b)
        if tid is None or tid <= last:
            return None, "its merge order does not follow its token ids"
        last = tid
        merged.add(a + b)
    multi = {t for t in vocab if t not in added_ids and len(t) > 1}
    if multi - merged:
        return None, f"{len(multi - merged)} multi-byte tokens are produced by no merge"
    if merged & set(added_ids):
        return None, "an added token is also produced by a merge"
    if len(set(added_ids.values())) != len(added_ids) or set(added_ids.values()) & set(ranks.values()):
        return None, "added token ids collide with vocabulary ids"
    plan = {
        "pattern": pattern,
        "ranks": ranks,
        "specials": added_ids,
        "vocab": vocab,
        "ignore_merges": bool(model.get("ignore_merges")),
    }
    return plan, ""


def _build_tiktoken(plan: dict, digest: str) -> Any:
    import tiktoken

    return tiktoken.Encoding(
        f"zephon-{digest[:16]}",
        pat_str=plan["pattern"],
        mergeable_ranks=plan["ranks"],
        special_tokens=plan["specials"],
    )


def _verification_texts() -> list[str]:
    """Varied text for checking an alternative encoder against ``tokenizers``."""
    texts = [
        "",
        " ",
        "Hello, world! It's a test: don't, I'll, we've, you're, she'd, I'm, THEY'RE, O'Neil's.",
        "  leading and trailing spaces   ",
        "tabs\tand\t\tnewlines\n\n\nand\r\ncarriage returns\r   \n \t \n",
        "numbers 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 2024-01-31 12:30:45",
        "Ünïcödé: café naïve façade Straße ÆØÅ æøå ñ ç œ İstanbul ǅ",
        "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
        "Русский текст, Ελληνικά, עברית, العربية, हिन्दी, ไทย, ქართული",
        "emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✨ 🧑🏻‍💻 #️⃣",
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\n\tif x:\n\t\tpass\n",
        '{"key": "value", "list": [true, false, null], "nested": {"n": -1.5e3}}',
        "int main(void) { printf(\"%d\\n\", a[i++] >> 2 && b != c); return 0; }",
        "<html><body class=\"x\">&amp; &lt;tag&gt; https://example.com/path?q=1&r=two#frag</body></html>",
        "punctuation!!! ??? ... --- *** ___ ~~~ ``` ''' \"\"\" ((())) [[[]]] {{{}}} ;;; ::: ,,, ///",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "          many spaces          then words          ",
        "nbsp\u00a0here\u2003em space\u3000ideographic\u200bzero-width\ufeffbom",
        "mixedCASE camelCase snake_case kebab-case SCREAMING_CASE PascalCase x1y2z3",
        "end with newline\n",
        "<|endoftext|>",
        "text<|endoftext|>more text <|endoftext|> and again<|endoftext|>",
        "\x00\x01\x02 control \x1b[31m colors \x7f",
    ]
    sweep = "".join(chr(c) for c in range(0x20, 0x3400, 3) if not 0xD800 <= c < 0xE000)
    texts.append(sweep)
    texts.append(" ".join(sweep[i : i + 7] for i in range(0, len(sweep), 7)))
    texts.append("\n".join(texts))
    return texts


def _verify_tiktoken(tok: Any, encoding: Any, plan: dict, encode_special_tokens: bool) -> str:
    """``""`` when tiktoken reproduced ``tokenizers`` on the sample and every vocabulary entry."""
    texts = _verification_texts()
    # One by one: a batch call would start tokenizers' thread pool in this (often the parent)
    # process, and tokenizers then disables its parallelism in every forked child.
    expected = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    allowed = frozenset() if encode_special_tokens else encoding.special_tokens_set
    for text, ids in zip(texts, expected):
        got = encoding.encode(text, allowed_special=allowed, disallowed_special=())
        if got != ids:
            return f"its ids differ from tokenizers on the sample text {text[:40]!r}"
    if not plan["ignore_merges"]:
        # tiktoken keeps a piece that is a whole token; tokenizers must reach it by merges.
        model = tok.model
        for token, tid in plan["vocab"].items():
            if token in plan["specials"]:
                continue
            pieces = model.tokenize(token)
            if len(pieces) != 1 or pieces[0].id != tid:
                return f"tokenizers does not merge the vocabulary entry {token!r} into one token"
    return ""


def _choose_backend(handle: TokenizerHandle, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "tokenizers":
        return "tokenizers"
    log = logger.warning if backend == "tiktoken" else logger.info
    if not _tiktoken_available():
        log("tokenizer %s: tiktoken is not installed; using tokenizers", handle.source)
        return "tokenizers"
    key = handle._content
    if key not in _VERIFIED:
        plan, reason = _tiktoken_plan(json.loads(handle.tokenizer_json))
        if plan is not None:
            try:
                encoding = _build_tiktoken(plan, key)
            except Exception as exc:  # tiktoken refused the ranks
                reason = f"tiktoken could not build it ({type(exc).__name__}: {exc})"
            else:
                reason = _verify_tiktoken(handle.tokenizer, encoding, plan, handle.encode_special_tokens)
                if not reason:
                    _live(("tiktoken", key), lambda: encoding)
        _VERIFIED[key] = (not reason, reason)
    ok, reason = _VERIFIED[key]
    if not ok:
        log("tokenizer %s: not using tiktoken because %s; using tokenizers", handle.source, reason)
        return "tokenizers"
    return "tiktoken"
