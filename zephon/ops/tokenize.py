"""The ``tokenize`` operator (text to ``input_ids``, with zephon's own BOS/EOS bracketing), and
the construction the tokenizing operators share: the tokenizer is resolved into a
:class:`~zephon.text.tokenizer.TokenizerHandle` before the fields are stored, and an
:class:`Origin` records what it stands for, so ``attrs.evolve`` equals construction.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, ClassVar, Sequence

import attrs
import numpy as np

from ..core.operator import CHILD_BASE, StatelessOp, StatelessState, config_field
from ..core.bad_records import Failure
from ..training.fields import SPECIAL_TOKEN_MODES as SPECIAL_TOKEN_MODES
from ..text.tokenizer import BACKENDS, TokenizerHandle, load_tokenizer

__all__ = ["SPECIAL_TOKEN_MODES", "Tokenize"]

_MISSING = object()
#: ``tokenizer_id`` not passed (``attrs.evolve`` never passes it; ``None`` is a value).
UNSET: Any = object()


def int_like(value: Any) -> Any:
    """A numpy integer as ``int``; any other value unchanged, so that the checks can name what is wrong."""
    return int(value) if isinstance(value, np.integer) else value


def check_choice(op: str, name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_positive(op: str, name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{op}: {name} must be a positive int or None, got {value!r}")


def check_id(name: str, value: Any, handle: TokenizerHandle) -> None:
    """An explicit BOS or EOS id: an int among the tokenizer's ids."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tokenize: {name} must be an int, got {type(value).__name__}")
    if not 0 <= value < handle.vocab_size:
        raise ValueError(f"tokenize: {name}={value} is outside the tokenizer's ids [0, {handle.vocab_size})")


def shown_keys(payload: Mapping) -> str:
    """The first keys of a payload, for a message naming a missing field."""
    keys = list(payload.keys())
    return ", ".join(repr(k) for k in keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")


@attrs.frozen(eq=False)
class Origin:
    """What a tokenizing operator was built from, where its fields alone do not say it.

    ``attrs.evolve`` passes it back with the fields, telling the constructor which arguments they
    stand for. Never compared, hashed or fingerprinted; needs no files (it survives pickling).

    Attributes:
        handle: the handle held in ``tokenizer``, recognised by identity (any other is a change).
        tokenizer_id: the ``tokenizer_id`` given, ``None`` for ``tokenizer=``; changing
            ``tokenizer`` of an operator built from an id also needs ``tokenizer_id=None``.
        template: ``TokenizeChat``: the text held in ``chat_template``, recognised by identity.
        from_tokenizer: ``TokenizeChat``: the template shipped with the tokenizer is in use, so
            it follows the tokenizer when that changes.
        shipped: ``TokenizeChat``: the template shipped with the tokenizer, or ``None``.
        missing: ``TokenizeChat``: what ``chat_template=None`` raises when none ships.
    """

    handle: TokenizerHandle
    tokenizer_id: Any = None
    template: str | None = None
    from_tokenizer: bool = False
    shipped: str | None = None
    missing: BaseException | None = None


def origin_field() -> Any:
    """The private ``_origin`` field (keyword ``_origin``, passed only by ``attrs.evolve``)."""
    return attrs.field(default=None, kw_only=True, alias="_origin", eq=False, repr=False, metadata={"data": False})


def given_settings(cls: type, options: dict[str, Any], *, skip: tuple[str, ...] = ("tokenizer",)) -> SimpleNamespace:
    """The settings ``cls.__attrs_init__`` will store for ``options`` (defaults and converters
    applied), for the checks that run before the tokenizer loads; an unknown keyword raises
    ``TypeError`` as a generated ``__init__`` would."""
    fields = {f.alias: f for f in attrs.fields(cls) if f.init and f.name not in skip}
    for name in options:
        if name not in fields:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {name!r}")
    values = {}
    for alias, f in fields.items():
        value = options.get(alias, f.default)
        values[f.name] = f.converter(value) if f.converter is not None else value
    return SimpleNamespace(**values)


def given_tokenizer(tokenizer: Any, tokenizer_id: Any, origin: Origin | None) -> tuple[Any, Any, bool]:
    """The ``tokenizer=`` and ``tokenizer_id=`` a construction stands for, and whether they are
    unchanged (then the origin's handle is reused). ``attrs.evolve`` passes the operator's own
    handle, and ``tokenizer_id`` only when it is among the changes."""
    if origin is not None and tokenizer is origin.handle:
        if tokenizer_id is UNSET:
            tokenizer_id = origin.tokenizer_id
        if origin.tokenizer_id is None:
            return tokenizer, tokenizer_id, tokenizer_id is None
        return None, tokenizer_id, tokenizer_id == origin.tokenizer_id
    if tokenizer_id is UNSET:
        tokenizer_id = None if origin is None else origin.tokenizer_id
    return tokenizer, tokenizer_id, False


def load_given(tokenizer: Any, tokenizer_id: Any, origin: Origin | None, *, backend: str = "auto") -> Origin:
    """Resolve the tokenizer of a construction (see :func:`given_tokenizer`) into a fresh :class:`Origin`."""
    tok, tid, same = given_tokenizer(tokenizer, tokenizer_id, origin)
    handle = load_tokenizer(origin.handle, backend=backend) if same else load_tokenizer(tok, tid, backend=backend)
    return Origin(handle, tid)


def public_signature(cls: type) -> None:
    """Give ``cls.__init__`` the signature of its fields, ``tokenizer_id`` second and ``_origin`` left out."""
    types = {f.alias: f.type for f in attrs.fields(cls)}
    params = [
        p.replace(annotation=types.get(p.name, p.annotation))
        for p in inspect.signature(cls.__attrs_init__).parameters.values()
        if p.name != "_origin"
    ]
    tid = inspect.Parameter("tokenizer_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation="str | None")
    params.insert(2, tid)  # after self and tokenizer
    cls.__init__.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]


class TokenizerOp(StatelessOp):
    """What the tokenizing operators share: the resolved tokenizer, held in ``tokenizer``."""

    @property
    def handle(self) -> TokenizerHandle:
        return self.tokenizer

    @property
    def tokenizer_id(self) -> None:
        """Always ``None``: a ``tokenizer_id`` given to the constructor is loaded into ``tokenizer``."""
        return None

    def init(self, key: int) -> StatelessState:
        self.tokenizer.load_encoder()  # a lane starts here: its first step should not wait for the build
        return StatelessState()

    def _specials(self) -> tuple[int | None, int | None]:
        """The BOS and EOS ids a ``special_tokens`` mode adds (``None`` where it adds none):
        explicit ids win over the tokenizer's."""
        mode, bos, eos = self.special_tokens, None, None
        if mode in ("bos_eos", "bos"):
            bos = self.bos_token_id if self.bos_token_id is not None else self.tokenizer.bos_token_id
        if mode in ("bos_eos", "eos"):
            eos = self.eos_token_id if self.eos_token_id is not None else self.tokenizer.eos_token_id
        return bos, eos


@attrs.frozen(init=False)
class Tokenize(TokenizerOp):
    """Tokenize a text field into ``{"input_ids": int32 array}``.

    Options in detail: ``docs/guide/tokenization.md``. The tokenizer is resolved when the operator is built, so a missing file, BOS/EOS id or bad
    option fails when the pipeline is assembled. Each ``step`` encodes the chunk in one native
    batch call; zephon brackets each document per ``special_tokens`` (never the tokenizer's
    template).

    State: none. A record's output depends only on its payload, the tokenizer's content
    (:meth:`TokenizerHandle.fingerprint`) and the data options. ``tokenizer`` holds the resolved
    :class:`~zephon.text.tokenizer.TokenizerHandle` (``tokenizer_id`` reads ``None``), numpy
    ints are stored as ``int``, and ``attrs.evolve`` equals construction, reusing the tokenizer.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``, a transformers fast tokenizer, a path to
            ``tokenizer.json`` or its folder, or a ``TokenizerHandle``.
        tokenizer_id: instead of ``tokenizer``: a local path or a Hugging Face id.
        field: the payload key holding the text (a dot path reaches nested dicts); a ``str``
            payload is itself the text.
        special_tokens: ``"bos_eos"`` (default), ``"bos"``, ``"eos"`` or ``"none"``: which of
            BOS/EOS zephon adds around each document.
        bos_token_id, eos_token_id: override the tokenizer's ids (not with ``"none"``).
        max_length: the longest output, specials included; with ``truncation`` or
            ``split_long_samples``.
        truncation: cut content to fit ``max_length`` (BOS and EOS are kept).
        split_long_samples: bracket first, then cut into ``max_length`` pieces, each its own
            record (child ``i``): BOS on the first only, EOS on the last only; an empty
            sequence gives one empty piece, never zero records.
        missing_field: ``"error"`` raises when a payload lacks ``field``; ``"empty"`` tokenizes
            ``""`` instead.
        preserve_upstream_payload: keep the payload's other keys next to ``input_ids``.
        parallelism: encoder threads (``None``: one per CPU); performance only.
        backend: ``"auto"`` (default), ``"tokenizers"`` or ``"tiktoken"``; performance only.
        on_error: ``"raise"`` (default) or ``"skip"``: leave out a record without a usable text
            field, counted in ``stats()["skipped"]`` (``max_skipped`` bounds it per lane).

    Raises:
        ValueError: an invalid option or combination (listed in the messages), a missing BOS/EOS
            id for the chosen mode, a tokenizer that cannot be loaded (``TokenizerLoadError``),
            or ``backend="tiktoken"`` for a tokenizer tiktoken cannot encode exactly.
        ImportError: ``backend="tiktoken"`` without tiktoken installed (``pip install 'zephon-lanes[fast]'``).
        TypeError: an option of the wrong type.

    Examples:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5}
        >>> tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> _ = tok.add_special_tokens(["<s>", "</s>"])
        >>> op = Tokenize(tok)
        >>> op.apply_many([{"text": "a b c"}])
        [[{'input_ids': array([1, 3, 4, 5, 2], dtype=int32)}]]
        >>> split = Tokenize(tok, max_length=2, split_long_samples=True)
        >>> [p["input_ids"].tolist() for p in split.apply_many([{"text": "a b c"}])[0]]
        [[1, 3], [4, 5], [2]]
    """

    tokenizer: Any = config_field(default=None)
    field: str = config_field(default="text", kw_only=True)
    special_tokens: str = config_field(default="bos_eos", kw_only=True)
    bos_token_id: int | None = config_field(default=None, converter=int_like, kw_only=True)
    eos_token_id: int | None = config_field(default=None, converter=int_like, kw_only=True)
    max_length: int | None = config_field(default=None, converter=int_like, kw_only=True)
    truncation: bool = config_field(default=False, kw_only=True)
    split_long_samples: bool = config_field(default=False, kw_only=True)
    missing_field: str = config_field(default="error", kw_only=True)
    preserve_upstream_payload: bool = config_field(default=False, kw_only=True)
    parallelism: int | None = config_field(default=None, data=False, converter=int_like, kw_only=True)
    backend: str = config_field(default="auto", data=False, kw_only=True)
    _origin: Origin | None = origin_field()

    kind: ClassVar[str] = "tokenize"

    def __init__(self, tokenizer: Any = None, tokenizer_id: Any = UNSET, **options: Any) -> None:
        settings = given_settings(type(self), options)
        _check_options(settings)
        origin = load_given(tokenizer, tokenizer_id, settings._origin, backend=settings.backend)
        self.__attrs_init__(tokenizer=origin.handle, **{**options, "_origin": origin})

    def __attrs_post_init__(self) -> None:
        handle = self.tokenizer
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(self, name) is not None:
                check_id(name, getattr(self, name), handle)
        bos, eos = self._specials()
        mode = self.special_tokens
        if mode in ("bos_eos", "bos") and bos is None:
            raise ValueError(
                f"tokenize: special_tokens={mode!r} needs a BOS token, but the tokenizer ({handle.source}) has none. "
                "For GPT-2 style models use special_tokens='eos' (the usual pretraining recipe: documents "
                "separated by <|endoftext|>), or pass bos_token_id= explicitly"
            )
        if mode in ("bos_eos", "eos") and eos is None:
            raise ValueError(
                f"tokenize: special_tokens={mode!r} needs an EOS token, but the tokenizer ({handle.source}) has none; "
                "pass eos_token_id= explicitly or use special_tokens='bos'/'none'"
            )

    @property
    def fans_out(self) -> bool:  # type: ignore[override]
        """One document becomes several records exactly when ``split_long_samples`` is on."""
        return self.split_long_samples

    def apply_many(self, payloads: list) -> list[list]:
        """Tokenize a chunk of payloads (dicts holding ``field``, or ``str`` texts) in one batch
        call: per payload, its outputs (several with ``split_long_samples``). Raises ``ValueError``
        for a missing ``field`` (``missing_field="error"``) or a text that is not UTF-8, and
        ``TypeError`` for a payload that is no mapping or str, or a field that is no str."""
        if not payloads:
            return []
        texts, failed = self._texts(payloads)
        bos, eos = self._specials()
        keep = self.max_length - (bos is not None) - (eos is not None) if self.truncation else None
        try:
            encoded = self.tokenizer.encode_bracketed(texts, bos=bos, eos=eos, keep=keep, num_threads=self.parallelism)
        except ValueError as exc:
            raise ValueError(f"tokenize: field {self.field!r}: {exc}") from exc
        split = self._split if self.split_long_samples else lambda seq: [seq]
        pieces = iter(encoded)
        return [
            failed[i] if i in failed else [self._output(payload, piece) for piece in split(next(pieces))]
            for i, payload in enumerate(payloads)
        ]

    def _texts(self, payloads: list) -> tuple[list[str], dict[int, Failure]]:
        """The texts of the payloads that have one, and (``on_error="skip"``) the failures of the others by index."""
        texts, failed = [], {}
        for i, payload in enumerate(payloads):
            try:
                texts.append(self._text_of(payload))
            except (TypeError, ValueError) as exc:
                if self.on_error != "skip":
                    exc.zephon_index = i  # type: ignore[attr-defined]
                    raise
                failed[i] = Failure.of(exc)
        return texts, failed

    def _split(self, seq: np.ndarray) -> list[np.ndarray]:
        size = self.max_length
        if len(seq) <= size:
            return [seq]
        count = -(-len(seq) // size)
        if count > CHILD_BASE:
            raise ValueError(
                f"tokenize: a document of {len(seq)} tokens splits into {count} pieces of max_length={size}, more than "
                f"the {CHILD_BASE} children a record may have; raise max_length or split such documents upstream"
            )
        # Copies, so that a piece held long (by a shuffle buffer) does not pin the whole document.
        return [seq[i : i + size].copy() for i in range(0, len(seq), size)]

    def _text_of(self, payload: Any) -> str:
        if isinstance(payload, str):
            return payload
        if not isinstance(payload, Mapping):
            raise TypeError(
                f"tokenize: payload is a {type(payload).__name__}, expected a dict with a {self.field!r} field "
                "(or a str, which is tokenized as is)"
            )
        value = payload.get(self.field, _MISSING)
        if value is _MISSING and "." in self.field:
            value = payload
            for part in self.field.split("."):
                value = value.get(part, _MISSING) if isinstance(value, Mapping) else _MISSING
        if value is _MISSING:
            if self.missing_field == "empty":
                return ""
            raise ValueError(
                f"tokenize: payload has no field {self.field!r} (its keys: [{shown_keys(payload)}]); set field= to the "
                "key holding the text (a dot path like 'meta.text' reaches nested dicts), or missing_field='empty' "
                "to tokenize such payloads as ''"
            )
        if not isinstance(value, str):
            if isinstance(value, (bytes, bytearray, memoryview)):
                hint = "; decode it to str first (e.g. bytes.decode('utf-8') in a map step)"
            else:
                hint = "; convert or filter such records in a map step before tokenize"
            raise TypeError(f"tokenize: field {self.field!r} holds a {type(value).__name__}, expected str{hint}")
        return value

    def _output(self, payload: Any, ids: np.ndarray) -> dict:
        if self.preserve_upstream_payload and isinstance(payload, Mapping):
            return {**payload, "input_ids": ids}
        return {"input_ids": ids}


def _check_options(v: SimpleNamespace) -> None:
    """The checks of ``Tokenize`` that need no tokenizer (they run before it is loaded)."""
    if not isinstance(v.field, str) or not v.field:
        raise TypeError(f"tokenize: field must be a non-empty str naming the text key, got {v.field!r}")
    if v.special_tokens not in SPECIAL_TOKEN_MODES:
        hint = (
            "; zephon adds BOS/EOS itself and never applies the tokenizer's template"
            if v.special_tokens == "tokenizer_default"
            else ""
        )
        raise ValueError(
            f"tokenize: special_tokens must be one of {', '.join(map(repr, SPECIAL_TOKEN_MODES))}, "
            f"got {v.special_tokens!r}{hint}"
        )
    if v.missing_field not in ("error", "empty"):
        raise ValueError(f"tokenize: missing_field must be 'error' or 'empty', got {v.missing_field!r}")
    for name in ("truncation", "split_long_samples", "preserve_upstream_payload"):
        if not isinstance(getattr(v, name), bool):
            raise TypeError(f"tokenize: {name} must be True or False, got {getattr(v, name)!r}")
    for name in ("max_length", "parallelism"):
        check_positive("tokenize", name, getattr(v, name))
    check_choice("tokenize", "backend", v.backend, BACKENDS)
    if v.special_tokens == "none":
        given = [n for n in ("bos_token_id", "eos_token_id") if getattr(v, n) is not None]
        if given:
            raise ValueError(
                f"tokenize: {' and '.join(given)} cannot be used with special_tokens='none' (no specials are "
                "added); drop it, or choose special_tokens='bos_eos', 'bos' or 'eos'"
            )
    if v.split_long_samples and v.truncation:
        raise ValueError(
            "tokenize: split_long_samples and truncation exclude each other: truncation drops the tail, "
            "splitting keeps it as more records; choose one"
        )
    if v.split_long_samples and v.max_length is None:
        raise ValueError("tokenize: split_long_samples=True requires max_length (the length of each piece)")
    if v.truncation and v.max_length is None:
        raise ValueError("tokenize: truncation=True requires max_length (the output length, specials included)")
    if v.max_length is not None and not (v.truncation or v.split_long_samples):
        raise ValueError(
            f"tokenize: max_length={v.max_length} does nothing on its own; add truncation=True to cut "
            "documents, or split_long_samples=True to split them into max_length pieces"
        )
    n_specials = {"bos_eos": 2, "bos": 1, "eos": 1, "none": 0}[v.special_tokens]
    if v.truncation and v.max_length is not None and v.max_length - n_specials <= 0:
        raise ValueError(
            f"tokenize: max_length={v.max_length} leaves no room for content after the {n_specials} special "
            f"token(s) of special_tokens={v.special_tokens!r}; use max_length > {n_specials}"
        )


public_signature(Tokenize)
