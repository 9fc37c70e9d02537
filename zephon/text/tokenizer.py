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
vocabulary entry (:mod:`zephon.text.tiktoken_encoding`). ``backend="auto"`` otherwise uses ``tokenizers`` and
logs why on the ``"zephon"`` logger; an explicit ``backend="tiktoken"`` raises instead.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from . import bpe_files as _bpe_files
from . import tokenizer_cache as _tokcache
from ..core.cache import ProcessCache
from .tiktoken_encoding import GPT2_PATTERN as GPT2_PATTERN  # noqa: F401  (public here too)
from .tiktoken_encoding import (
    _build_tiktoken,
    _tiktoken_available,
    _tiktoken_plan,
    _tiktoken_usable,
    _verify_tiktoken,
)
from .tiktoken_encoding import _byte_decoder as _byte_decoder  # noqa: F401  (benchmarks import it from here)

__all__ = ["BACKENDS", "TokenizerHandle", "TokenizerLoadError", "load_tokenizer"]

logger = logging.getLogger("zephon")

#: Encoding backends a handle can be asked for.
BACKENDS = ("auto", "tokenizers", "tiktoken")

_LOCAL_ADVICE = (
    'pass a local file instead: tokenize(tokenizer="path/to/tokenizer.json") (or tokenizer_id="path/to/tokenizer.json"), '
    'a folder holding tokenizer.json (and optionally tokenizer_config.json): tokenize(tokenizer="path/to/folder"), '
    "or a tokenizers.Tokenizer object: tokenize(tokenizer=Tokenizer.from_file(...))"
)

# Well-known special tokens, tried in order when no tokenizer_config.json names them. GPT-2's
# <|endoftext|> is a document separator, so it counts as EOS only (GPT-2 has no BOS of its own).
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<BOS>", "<|startoftext|>", "[CLS]")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<EOS>", "<|endoftext|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<PAD>", "<|padding|>")


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
    _json_digest: str = attrs.field(init=False)
    _content: str = attrs.field(init=False)
    _digest: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.backend not in ("tokenizers", "tiktoken"):
            raise ValueError(f"TokenizerHandle: backend must be 'tokenizers' or 'tiktoken', got {self.backend!r}")
        # _content names what encodes text (shared by handles that differ only in special ids);
        # _digest adds the ids, which decide the bracketing.
        json_digest = hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()
        content = json_digest
        if self.encode_special_tokens:
            content += "+encode_special_tokens"
        ids = json.dumps([self.bos_token_id, self.eos_token_id, self.pad_token_id])
        object.__setattr__(self, "_json_digest", json_digest)
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

        # From the cached model files where they were proven to give this tokenizer (a quicker
        # build of a large BPE); the first build from the JSON proves them (zephon.text.bpe_files).
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
        plan, reason = _cached_plan(self)
        if plan is None:
            plan, reason = _tiktoken_plan(json.loads(self.tokenizer_json))
        if plan is None:  # cannot happen for a handle made by load_tokenizer
            raise RuntimeError(f"tokenizer cannot use the tiktoken backend: {reason}")
        return _build_tiktoken(plan, self._content)

    def with_backend(self, backend: str) -> TokenizerHandle:
        """This handle with the encoder chosen again for ``backend`` (``auto``, ``tokenizers``, ``tiktoken``)."""
        effective = _choose_backend(self, backend)
        if effective == "tokenizers":
            # Once per machine: here, where the tokenizer is loaded, rather than in every worker
            # or restore that builds it first (zephon.text.bpe_files).
            _bpe_files.prepare(self.tokenizer_json, self._json_digest)
        return self if effective == self.backend else attrs.evolve(self, backend=effective)

    # -- encoding -----------------------------------------------------------------------------------
    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[np.ndarray]:
        """Encode texts to ``int32`` id arrays, without adding special tokens.

        The whole batch goes to the native encoder in one call (``tokenizers`` parallelizes it on
        its Rayon pool; the tiktoken backend on ``num_threads`` threads).

        Args:
            texts: the texts.
            num_threads: threads for the encoder (``None``: one per CPU). The tiktoken backend runs
                on a pool of that many threads. ``tokenizers`` runs on its native Rayon pool, which
                exists once per process: ``num_threads`` sizes it when it is given before the
                pool's first use in the process (``RAYON_NUM_THREADS``); later, a different size
                is logged once as a warning and the pool keeps its size.

        Returns:
            One writable ``int32`` array per text.

        Raises:
            ValueError: a text cannot be encoded as UTF-8 (it holds an unpaired surrogate).
        """
        return self.encode_bracketed(texts, num_threads=num_threads)

    def encode_bracketed(
        self,
        texts: Sequence[str],
        *,
        bos: int | None = None,
        eos: int | None = None,
        keep: int | None = None,
        num_threads: int | None = None,
    ) -> list[np.ndarray]:
        """Like :meth:`encode_batch`, each text's ids cut to their first ``keep`` and put between
        ``bos`` and ``eos`` (each only when not ``None``), in one new array per text.

        ``tokenize`` brackets every document this way: with ``tokenizers``, the ids are cut and
        bracketed while they are still the Python list ``Encoding.ids`` returns, so that they are
        copied into an array once.
        """
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
        _size_rayon_pool(num_threads)
        # encode_batch_fast skips the offsets, which we never use (same ids, less work).
        encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        encodings = encode(texts, add_special_tokens=False)
        # Encoding.ids builds a Python list (most of the cost of getting the ids out); it is cut and
        # bracketed as a list, then np.fromiter reads it once into its array.
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
        if hasattr(enc, "encode_to_numpy"):

            def ids_of(text: str) -> np.ndarray:  # uint32, read-only: a view of tiktoken's buffer
                return enc.encode_to_numpy(text, allowed_special=allowed, disallowed_special=())

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


def _encode_longest_first(one: Callable[[str], np.ndarray], texts: Sequence[str], pool: ThreadPoolExecutor, threads: int) -> list:
    """``[one(t) for t in texts]`` on ``threads`` threads: the calling thread and ``threads - 1`` of ``pool``.

    Every thread takes the longest text not yet taken until none is left, so the work stays
    balanced (no thread is left alone with one long document) even when the OS preempts one of
    them, and a call costs ``threads - 1`` futures instead of one per text.
    """
    out: list = [None] * len(texts)
    order = iter(sorted(range(len(texts)), key=lambda i: -len(texts[i])))
    lock = threading.Lock()

    def drain() -> None:
        try:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                out[i] = one(texts[i])
        except BaseException:
            with lock:
                for _ in order:  # the other threads stop at their next text
                    pass
            raise

    futures = [pool.submit(drain) for _ in range(threads - 1)]
    error: BaseException | None = None
    try:
        drain()
    except BaseException as exc:
        error = exc
    for f in futures:  # wait for every thread, then raise the first failure
        if error is None:
            error = f.exception()
        else:
            f.exception()
    if error is not None:
        raise error
    return out


#: Encoder threads beyond one per CPU for encodes started in the current thread's context; the
#: runtime's read-ahead thread sets 1 (see :func:`_encoder_threads`).
EXTRA_ENCODER_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("zephon_extra_encoder_threads", default=0)


def _encoder_threads() -> int:
    """The encoder's threads when ``parallelism`` is not given: in the calling process one per CPU, and
    one more in the read-ahead thread; in a worker process, its share.

    A worker process of ``workers=N`` gets ``ZEPHON_ENCODER_THREADS`` = CPUs // N, so that N
    workers do not each start a thread per CPU, and even a single worker leaves the main process
    room to receive its batches. In the calling process, the read-ahead thread encodes while the
    lanes run Python code in another thread, and each tiktoken call takes the GIL back between
    documents: one more thread keeps the cores busy while another waits for it (the figures are in
    ``benchmarks/README.md``, "Tokenizer fast paths").
    """
    env = os.environ.get("ZEPHON_ENCODER_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)  # a worker's share: one more each would put W more threads on the cores
    return _cpu_count() + EXTRA_ENCODER_THREADS.get()


def _size_rayon_pool(threads: int | None) -> None:
    """Size tokenizers' Rayon pool for ``threads`` before its first use in this process, else warn once.

    Rayon reads ``RAYON_NUM_THREADS`` when the pool starts (at the first parallel batch encode of
    the process), and the pool then keeps its size.
    """
    started = _LIVE.peek(("rayon",))
    if started is None:
        if threads is not None:
            os.environ["RAYON_NUM_THREADS"] = str(threads)
        env = os.environ.get("RAYON_NUM_THREADS", "")
        _LIVE.get(("rayon",), lambda: int(env) if env.isdigit() and int(env) > 0 else _cpu_count())
        return
    if threads is not None and threads != started and _LIVE.peek(("rayon-warned", threads)) is None:
        _LIVE.get(("rayon-warned", threads), lambda: True)
        logger.warning(
            "tokenize(parallelism=%d): the tokenizers thread pool of this process already runs %d threads and cannot "
            "be resized; the first tokenize to encode in a process sets it (or RAYON_NUM_THREADS, set before that), "
            "and with workers > 0 each worker process sizes its own",
            threads,
            started,
        )


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

# Live tokenizers, tiktoken encodings and thread pools, rebuilt in each process (never inherited
# through fork: pool threads do not survive it).
_LIVE = ProcessCache()
# Whether the tiktoken path proved exact, by tokenizer content. Kept in forked children: the
# verdict depends only on the content, and proving it again takes seconds for large vocabularies.
_VERIFIED = ProcessCache(clear_after_fork=False)


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    return _LIVE.get(("pool", threads), lambda: ThreadPoolExecutor(threads, thread_name_prefix="zephon-tiktoken"))


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


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
            offline (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``), downloaded; a connection probe
            of about a second (to ``$HF_ENDPOINT`` or the HTTPS proxy) comes first, so that an
            unreachable hub fails at once instead of after the hub client's retries.
        backend: ``"tokenizers"``; ``"tiktoken"`` (used when it is verified exact for this
            tokenizer, else an error: an explicit request is never replaced); or ``"auto"``
            (tiktoken when it is installed and exact, else ``tokenizers``, logged at INFO). The
            handle's ``backend`` says which one is used.

    Returns:
        The handle.

    Raises:
        TokenizerLoadError: nothing or both of ``tokenizer``/``tokenizer_id`` given, a path with no
            ``tokenizer.json``, an unreadable file, or a model id neither cached nor downloadable.
        TypeError: ``tokenizer`` is of an unsupported type.
        ValueError: ``backend`` is not one of ``"auto"``, ``"tokenizers"``, ``"tiktoken"``; or
            ``backend="tiktoken"`` for a tokenizer tiktoken cannot encode exactly
            (``TokenizerLoadError``, with the reason).
        ImportError: ``backend="tiktoken"`` without tiktoken installed (``pip install 'zephon[fast]'``).
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
    cached = _cached_file_handle(file, path.is_dir())
    if cached is not None:
        return cached
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerLoadError(
            f"cannot read {str(file)!r} as a Hugging Face tokenizer.json ({type(exc).__name__}: {exc}); "
            "pass the tokenizer.json written by tokenizers/transformers, or the folder holding it"
        ) from exc
    if not path.is_dir():
        # A file stands alone: sibling config files are read only when the folder is passed.
        handle = _make_handle(tok, {}, str(file), owned=True)
    else:
        handle = _make_handle(tok, _config_ids(tok, _read_special_config(folder), folder), str(folder), owned=True)
    _store_file_handle(file, tok, handle)
    return handle


def _cached_file_handle(file: Path, folder_given: bool) -> TokenizerHandle | None:
    """The handle of ``file`` from the on-disk cache (:mod:`zephon.text.tokenizer_cache`), or ``None``.

    The canonical JSON and the guessed ids are looked up by the file's sha256; the live tokenizer
    is then built from that JSON only when something needs it. A folder's config files are read
    every time (they are small, and not part of the key).
    """
    if not _tokcache.cache_enabled():
        return None
    try:
        digest = _tokcache.file_digest(str(file))
    except OSError:
        return None
    entry = _tokcache.load_entry("file", digest)
    if entry is None:
        return None
    try:
        guessed = {role: entry["ids"][role] for role in ("bos", "eos", "pad")}
        handle = TokenizerHandle(
            entry["json"], guessed["bos"], guessed["eos"], guessed["pad"], "tokenizers", bool(entry["encode_special_tokens"]),
            str(file),
        )
    except (KeyError, TypeError, ValueError):
        return None
    if handle._content != entry.get("content"):
        return None
    if not folder_given:
        return handle
    ids = _config_ids(handle, _read_special_config(file.parent), file.parent)
    if not ids:
        return attrs.evolve(handle, source=str(file.parent))
    return attrs.evolve(
        handle, source=str(file.parent), **{f"{role}_token_id": ids[role] if role in ids else guessed[role] for role in ("bos", "eos", "pad")}
    )


def _store_file_handle(file: Path, tok: Any, handle: TokenizerHandle) -> None:
    if not _tokcache.cache_enabled():
        return
    try:
        digest = _tokcache.file_digest(str(file))
    except OSError:
        return
    entry = {
        "json": handle.tokenizer_json,
        "content": handle._content,
        "ids": _guess_ids(tok),
        "encode_special_tokens": handle.encode_special_tokens,
    }
    _tokcache.store_entry("file", digest, entry)


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
        _LIVE.get(("tokenizer", handle._content), lambda: tok)
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


#: Seconds the hub probe waits for a TCP connection (name resolution included).
HUB_PROBE_TIMEOUT_S = 1.0


def _hub_address() -> tuple[str, int]:
    """``(host, port)`` a download would connect to first: the HTTPS proxy if one is set, else the hub.

    The hub is ``$HF_ENDPOINT`` (as ``huggingface_hub`` reads it), by default ``https://huggingface.co``.
    """
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    endpoint = os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co"
    url = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    host = url.hostname or "huggingface.co"
    proxy = getproxies().get(url.scheme) or getproxies().get("all")
    if proxy and not proxy_bypass(host):
        purl = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if purl.hostname:
            return purl.hostname, purl.port or (443 if purl.scheme == "https" else 80)
    return host, url.port or (443 if url.scheme == "https" else 80)


def _hub_unreachable() -> str:
    """``""`` when a TCP connection to the hub (:func:`_hub_address`) opens within
    :data:`HUB_PROBE_TIMEOUT_S`, else why not.

    A download attempt against an unreachable hub retries for about 20 seconds; this probe
    answers within about a second, so that ``tokenizer_id=`` fails fast offline. The probe runs in
    a daemon thread, because name resolution ignores socket timeouts.
    """
    import socket

    host, port = _hub_address()
    outcome: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append("")
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=probe, name="zephon-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.25)
    if not outcome:
        return f"no connection to {host}:{port} within {HUB_PROBE_TIMEOUT_S:g} s"
    return f"no connection to {host}:{port} ({outcome[0]})" if outcome[0] else ""


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
            reason = "offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)"
        elif unreachable := _hub_unreachable():
            reason = f"{unreachable}; HF_HUB_OFFLINE=1 skips the probe"
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
        f"cache (looked for {looked}), and it cannot be fetched from the hub: {reason}. To use a tokenizer you have as a "
        f"file, {_LOCAL_ADVICE}"
    )


# -- choosing the backend -------------------------------------------------------------------------------


def _choose_backend(handle: TokenizerHandle, backend: str) -> str:
    """The encoder ``handle`` uses for ``backend``: an explicit ``"tiktoken"`` is used or raises, never replaced.

    ``"auto"`` takes tiktoken when it is installed and proven exact for this tokenizer, else
    ``tokenizers`` (logged at INFO); the choice is the handle's ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "tokenizers":
        return "tokenizers"
    if not _tiktoken_available():
        if backend == "tiktoken":
            raise ImportError(
                f"backend='tiktoken' needs tiktoken, which is not installed: pip install 'zephon[fast]'; or use "
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
    """``""`` when the tiktoken path is exact for ``handle`` (its encoding is then kept), else why not.

    The outcome is kept in the on-disk cache (:mod:`zephon.text.tokenizer_cache`) under the content digest,
    with tiktoken's inputs when it is exact, so later processes skip the checks.
    """
    key = handle._content
    plan, reason = _cached_plan(handle)
    if plan is None and reason:
        return reason
    if plan is not None:
        try:
            encoding = _build_tiktoken(plan, key)
        except Exception:  # an entry tiktoken no longer accepts: prove again
            plan = None
        else:
            _LIVE.get(("tiktoken", key), lambda: encoding)
            return ""
    plan, reason = _tiktoken_plan(json.loads(handle.tokenizer_json))
    if plan is None:
        _store_proof(handle, None, reason)
        return reason
    try:
        encoding = _build_tiktoken(plan, key)
    except Exception as exc:  # tiktoken refused the ranks
        return f"tiktoken could not build it ({type(exc).__name__}: {exc})"
    reason = _verify_tiktoken(handle.tokenizer, encoding, plan, handle.encode_special_tokens)
    if not reason:
        _LIVE.get(("tiktoken", key), lambda: encoding)
    _store_proof(handle, plan, reason)
    return reason


def _cached_plan(handle: TokenizerHandle) -> tuple[dict | None, str]:
    """From the on-disk cache: ``(plan, "")`` if tiktoken was proven exact, ``(None, reason)`` if
    it was proven not to be, ``(None, "")`` if there is no usable entry."""
    entry = _tokcache.load_entry("proof", handle._content)
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


def _store_proof(handle: TokenizerHandle, plan: dict | None, reason: str) -> None:
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
    _tokcache.store_entry("proof", handle._content, entry)
