"""Chat and prompt/completion tokenization: ``input_ids`` with an aligned ``loss_mask``.

:class:`TokenizeChat` renders conversations with a Jinja chat template and masks the assistant
turns; :class:`TokenizePromptCompletion` masks the completion of ``{"prompt", "completion"}``
records. The mask is unshifted (1: learn to produce this token) and never marks a record's first
token (in a packed row the token before it belongs to another document). See ``docs/guide/chat.md``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Sequence

import attrs
import numpy as np

from ..core.cache import ProcessCache
from ..core.operator import config_field
from ..training.fields import SPECIAL_TOKEN_MODES
from ..text.templates import BUILTIN_TEMPLATES, CHATML_TEMPLATE, LLAMA3_TEMPLATE, RESERVED_KWARGS, render_chat
from ..text.templates import _render, _resolve_template, check_markers, has_generation_tags, shipped_template
from ..text.templates import spans_to_mask, strip_generation_tags
from .tokenize import UNSET, Origin, TokenizerOp, check_choice, check_id, check_positive, given_settings
from .tokenize import given_tokenizer, int_like, load_given, origin_field, public_signature, shown_keys
from ..text.tokenizer import BACKENDS, TokenizerHandle, load_tokenizer

__all__ = [
    "BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "EMPTY_MASK_MODES", "LLAMA3_TEMPLATE", "LOSS_SCOPES", "RESERVED_KWARGS",
    "SPAN_SOURCES", "TokenizeChat", "TokenizePromptCompletion", "has_generation_tags", "render_chat",
    "spans_to_mask", "strip_generation_tags",
]

logger = logging.getLogger("zephon")

LOSS_SCOPES = ("assistant", "last_assistant", "all")
SPAN_SOURCES = ("auto", "generation_tags", "prefix")
EMPTY_MASK_MODES = ("error", "drop")

# Per process, by tokenizer fingerprint: a tokenizer that reports untrimmed offsets.
_ENCODERS = ProcessCache()
# Per process, by template text: whether it has {% generation %} blocks (parsing it takes a while).
_TAGGED = ProcessCache(max_entries=256)
# Per process, by template, specials and kwargs: whether the template honours add_generation_prompt.
_PROBES = ProcessCache(max_entries=256)

_IGNORES_PROMPT = (
    "tokenize_chat: the chat template renders the same text with add_generation_prompt=True and False, so "
    "prefix rendering cannot tell the assistant header from the reply. Make the template append the "
    "assistant header under {% if add_generation_prompt %}...{% endif %}, wrap each assistant reply in "
    "{% generation %}...{% endgeneration %}, or use a built-in template (chat_template='chatml' or "
    "'llama3')"
)


def _offset_encoder(handle: TokenizerHandle) -> Any:
    """A per-process ``tokenizers.Tokenizer`` of ``handle`` without its post-processor, whose offset
    trimming (ByteLevel, RoBERTa) can leave a space token an empty range; without added special
    tokens it changes offsets only, never ids."""

    def build() -> Any:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(handle.tokenizer_json)
        tok.post_processor = None
        if handle.encode_special_tokens:
            tok.encode_special_tokens = True
        return tok

    return _ENCODERS.get(handle.fingerprint(), build)


def _check_length(op: str, max_length: Any, truncation: Any) -> None:
    if not isinstance(truncation, bool):
        raise TypeError(f"{op}: truncation must be True or False, got {truncation!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(
            f"{op}: max_length must be an int >= 2 or None, got {max_length!r} (a record needs an unsupervised "
            "first token and at least one target)"
        )
    if truncation and max_length is None:
        raise ValueError(f"{op}: truncation=True requires max_length (the longest output, in tokens)")


def _finish(op: Any, ids: np.ndarray, mask: np.ndarray, what: str, empty: Callable[[], str]) -> list[dict]:
    """The output of one record: cut or reject it when long (the first token is never a target),
    then ``[]`` (dropped) or an error with ``empty()`` when no token is supervised."""
    if op.max_length is not None and len(ids) > op.max_length:
        if not op.truncation:
            raise ValueError(
                f"{op.kind}: {what} is {len(ids)} tokens long, more than max_length={op.max_length}; pass "
                "truncation=True to cut such records (the loss_mask is cut with them), raise max_length, or filter "
                "long records before this step"
            )
        ids, mask = ids[: op.max_length].copy(), mask[: op.max_length].copy()
    if len(mask):
        mask[0] = 0
    if mask.any():
        return [{"input_ids": ids, "loss_mask": mask}]
    if op.empty_mask == "drop":
        return []
    raise ValueError(empty())


def _roles_of(messages: Sequence[Any]) -> str:
    roles = [str(m.get("role", "?")) if isinstance(m, Mapping) else "?" for m in messages]
    shown = roles[:16] + ([f"... ({len(roles)} messages)"] if len(roles) > 16 else [])
    return "[" + ", ".join(shown) + "]"


def _tagged(template: str) -> bool:
    return _TAGGED.get(template, lambda: has_generation_tags(template))


def _plain_dict(value: Any) -> Any:
    """A mapping with str keys as a plain dict (a copy); any other value unchanged, for the check to name."""
    plain = isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    return dict(value) if plain else value


def _check_chat_options(v: Any) -> None:
    """The checks of ``TokenizeChat`` that need neither the template nor the tokenizer."""
    op = "tokenize_chat"
    if not isinstance(v.field, str) or not v.field:
        raise TypeError(f"{op}: field must be a non-empty str naming the messages key, got {v.field!r}")
    if v.tools_field is not None and (not isinstance(v.tools_field, str) or not v.tools_field):
        raise TypeError(f"{op}: tools_field must be a non-empty str or None, got {v.tools_field!r}")
    check_choice(op, "loss_scope", v.loss_scope, LOSS_SCOPES)
    check_choice(op, "empty_mask", v.empty_mask, EMPTY_MASK_MODES)
    check_choice(op, "span_source", v.span_source, SPAN_SOURCES)
    _check_length(op, v.max_length, v.truncation)
    kwargs = v.chat_template_kwargs
    if kwargs is not None:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"{op}: chat_template_kwargs must be a dict with str keys, got {kwargs!r}")
        reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise ValueError(
                f"{op}: chat_template_kwargs cannot set {reserved}: the operator passes them itself "
                f"(messages from field={v.field!r}, tools from tools_field={v.tools_field!r})"
            )


@attrs.frozen(init=False)
class TokenizeChat(TokenizerOp):
    """Render conversations with a chat template into ``input_ids`` and an assistant ``loss_mask``.

    A payload holds a list of messages ``{"role", "content"}``. The output ``{"input_ids": int32,
    "loss_mask": uint8}`` has 1 exactly on the selected assistant turns, end-of-turn token
    included. Turns are found by ``{% generation %}`` blocks, or by prefix rendering: the renders
    of ``messages[:i]`` with the generation prompt and of ``messages[:i + 1]`` must start the full
    text, and their difference (trailing whitespace left out) is reply ``i``; a token is
    supervised when its characters overlap a span. Details: ``docs/guide/chat.md``.

    State: none. The output depends only on the payload, the tokenizer's content, the template
    text (its sha256 is fingerprinted) and the options. ``tokenizer`` holds the resolved
    :class:`~zephon.text.tokenizer.TokenizerHandle` (``tokenizer_id`` reads ``None``),
    ``chat_template`` the text, so the operator pickles without its files. ``attrs.evolve`` equals
    construction: a template that came with the tokenizer follows a changed tokenizer.

    Args:
        tokenizer: as for :class:`~zephon.ops.Tokenize` (or ``tokenizer_id``).
        field: the payload key holding the messages.
        chat_template: a built-in name (``"chatml"``, ``"llama3"``), Jinja text, or a path;
            ``None``: the template shipped with the tokenizer.
        loss_scope: ``"assistant"``, ``"last_assistant"`` or ``"all"`` (every token but the first).
        max_length: the longest output in tokens (``>= 2``; ``None``: no limit).
        truncation: cut longer records to ``max_length``, the mask with them (else they raise).
        tools_field: the payload key of tool schemas for the template's ``tools`` (``None``: none).
        chat_template_kwargs: more template variables (e.g. ``{"enable_thinking": False}``).
        empty_mask: a record with no supervised token: ``"error"`` or ``"drop"``.
        span_source: ``"auto"`` (generation tags when the template has them, else prefix
            rendering), ``"generation_tags"`` or ``"prefix"``.

    Raises:
        ValueError: an invalid option or template (missing, not Jinja, markers not single tokens,
            lacking the tags asked for, ignoring ``add_generation_prompt`` for prefix rendering);
            while tokenizing, a malformed conversation, a template error, prefixes that do not
            start the conversation, a record over ``max_length`` without ``truncation``, or an
            all-zero mask with ``empty_mask="error"``.
        TypeError: an option of the wrong type.

    Examples:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, "user": 3, "assistant": 4,
        ...          "hi": 5, "hello": 6}
        >>> tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> _ = tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        >>> op = TokenizeChat(tok, chat_template="chatml")
        >>> [[out]] = op.apply_many([{"messages": [{"role": "user", "content": "hi"},
        ...                                        {"role": "assistant", "content": "hello"}]}])
        >>> out["input_ids"].tolist()
        [1, 3, 5, 2, 1, 4, 6, 2]
        >>> out["loss_mask"].tolist()
        [0, 0, 0, 0, 0, 0, 1, 1]
    """

    tokenizer: Any = config_field(default=None)
    field: str = config_field(default="messages", kw_only=True)
    chat_template: str | None = config_field(default=None, kw_only=True)
    loss_scope: str = config_field(default="assistant", kw_only=True)
    max_length: int | None = config_field(default=None, kw_only=True)
    truncation: bool = config_field(default=False, kw_only=True)
    tools_field: str | None = config_field(default="tools", kw_only=True)
    # A dict, so left out of the hash (config_field has no hash option).
    chat_template_kwargs: dict | None = attrs.field(
        default=None, kw_only=True, hash=False, converter=_plain_dict, metadata={"data": True}
    )
    empty_mask: str = config_field(default="error", kw_only=True)
    span_source: str = config_field(default="auto", kw_only=True)
    _origin: Origin | None = origin_field()

    kind: ClassVar[str] = "tokenize_chat"

    def __init__(self, tokenizer: Any = None, tokenizer_id: Any = UNSET, **options: Any) -> None:
        settings = given_settings(type(self), options)
        _check_chat_options(settings)
        origin = settings._origin
        tok, tid, same = given_tokenizer(tokenizer, tokenizer_id, origin)
        if tok is not None and tid is not None:
            load_tokenizer(tok, tid)  # raises: pass either tokenizer= or tokenizer_id=, not both
        # The shipped template is looked up even when chat_template is given, so that
        # attrs.evolve(op, chat_template=None) finds it without the tokenizer's files.
        shipped, missing = (origin.shipped, origin.missing) if same else shipped_template(tok, tid)
        kept = origin is not None and settings.chat_template is origin.template
        if kept and (same or not origin.from_tokenizer):
            text, from_tokenizer = origin.template, origin.from_tokenizer
        else:
            # A template that came with the tokenizer follows it when the tokenizer changes.
            given = None if kept else settings.chat_template
            if given is None and shipped is None:
                raise copy.copy(missing)  # no template given, none shipped
            text, from_tokenizer = (shipped, True) if given is None else (_resolve_template(given), False)
        handle = load_tokenizer(origin.handle) if same else load_tokenizer(tok, tid)
        origin = Origin(handle, tid, text, from_tokenizer, shipped, missing)
        self.__attrs_init__(tokenizer=handle, **{**options, "chat_template": text, "_origin": origin})

    def __attrs_post_init__(self) -> None:
        op = "tokenize_chat"
        handle = self.tokenizer
        check_markers(self.chat_template, handle.tokenizer, handle.source, op=op)
        if self.span_source == "generation_tags" and not _tagged(self.chat_template):
            raise ValueError(
                f"{op}: span_source='generation_tags' but the chat template has no {{% generation %}} blocks; wrap "
                "each assistant reply (with its end-of-turn token) in {% generation %}...{% endgeneration %}, or "
                "use span_source='auto' or 'prefix' to find replies by prefix rendering"
            )
        if self.spans_from == "prefix":
            if self.span_source == "auto":
                logger.info("%s: the chat template has no {%% generation %%} blocks; finding replies by prefix rendering", op)
            self._prompt_checked()  # rejects a template that ignores add_generation_prompt

    @property
    def template_sha256(self) -> str:
        """sha256 (hex) of the chat template text."""
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()

    @property
    def spans_from(self) -> str:
        """Where assistant spans come from: ``"tags"``, ``"prefix"`` or ``"none"`` (``loss_scope="all"``)."""
        if self.loss_scope == "all":
            return "none"
        return "tags" if self.span_source != "prefix" and _tagged(self.chat_template) else "prefix"

    def _special_texts(self) -> tuple[str, str]:
        """The BOS and EOS strings the template sees as ``bos_token`` and ``eos_token`` (``""`` without one)."""
        handle = self.tokenizer
        ids = (handle.bos_token_id, handle.eos_token_id)
        return tuple((handle.tokenizer.id_to_token(i) or "") if i is not None else "" for i in ids)

    def _prompt_checked(self) -> bool:
        """Whether the template was seen to honour ``add_generation_prompt`` (probed once per process;
        ``False``: inconclusive, so prefix rendering checks each record); raises when it ignores it."""
        key = (self.chat_template, *self._special_texts(), repr(self.chat_template_kwargs))
        return _PROBES.get(key, self._probe_generation_prompt)

    def fingerprint(self) -> dict[str, Any]:
        """The data settings; the template enters as its sha256 (``"sha256:<hex>"``)."""
        out = super().fingerprint()
        out["chat_template"] = "sha256:" + self.template_sha256
        return out

    def _render(self, messages: Sequence[Any], tools: Any, add_generation_prompt: bool = False, *, track: bool = False):
        bos, eos = self._special_texts()
        variables = dict(self.chat_template_kwargs or {}, messages=messages, tools=tools)
        variables.update(add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
        return _render(self.chat_template, variables, track=track)

    def _probe_generation_prompt(self) -> bool:
        """Reject a template that ignores add_generation_prompt; ``False`` if the probe was inconclusive."""
        probe = [{"role": "user", "content": "Hello"}]
        try:
            with_prompt, _ = self._render(probe, None, True)
            without, _ = self._render(probe, None, False)
        except Exception:  # the template rejects the probe (e.g. it needs a system turn); check per record
            return False
        if with_prompt == without:
            raise ValueError(_IGNORES_PROMPT)
        return True

    def _messages_of(self, payload: Any) -> list:
        if not isinstance(payload, Mapping):
            raise TypeError(
                f"tokenize_chat: payload is a {type(payload).__name__}, expected a dict with a {self.field!r} field "
                "holding a list of messages"
            )
        if self.field not in payload:
            raise ValueError(
                f"tokenize_chat: payload has no field {self.field!r} (its keys: [{shown_keys(payload)}]); set field= "
                "to the key holding the list of messages"
            )
        messages = payload[self.field]
        if isinstance(messages, np.ndarray):
            messages = messages.tolist()
        if not isinstance(messages, (list, tuple)):
            raise TypeError(
                f"tokenize_chat: field {self.field!r} holds a {type(messages).__name__}, expected a list of messages "
                '[{"role": ..., "content": ...}, ...]'
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(
                    f"tokenize_chat: message {i} of field {self.field!r} is {m!r:.80}; every message must be a dict "
                    'with a str "role" (and usually "content")'
                )
        return list(messages)

    def _spans(self, messages: list, tools: Any) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its selected assistant turns."""
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.spans_from == "none":
            return self._render(messages, tools)[0], []
        if self.spans_from == "tags":
            text, spans = self._render(messages, tools, track=True)
            if spans and len(spans) != len(assistants):
                raise ValueError(
                    f"tokenize_chat: the chat template marked {len(spans)} {{% generation %}} block(s) in a record with "
                    f"{len(assistants)} assistant message(s) (roles {_roles_of(messages)}), so blocks cannot be matched "
                    "to turns; wrap every assistant turn in exactly one block, or use span_source='prefix' (with "
                    "loss_scope='last_assistant' if the template rewrites earlier turns)"
                )
            if self.loss_scope == "last_assistant":
                spans = spans[-1:]
            return text, spans
        text = self._render(messages, tools)[0]
        selected = assistants[-1:] if self.loss_scope == "last_assistant" else assistants
        spans = []
        for i in selected:
            before = self._render(messages[:i], tools, True)[0]
            through = self._render(messages[: i + 1], tools)[0]
            if not self._prompt_checked() and before == self._render(messages[:i], tools)[0]:
                raise ValueError(_IGNORES_PROMPT)
            if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
                raise ValueError(
                    f"tokenize_chat: prefix rendering failed for message {i} (roles {_roles_of(messages)}): the "
                    "template renders the conversation up to that assistant turn (with the generation prompt, or "
                    "through the turn) differently from the start of the full conversation, e.g. because it "
                    "rewrites earlier turns or closes the last one differently. Wrap assistant replies in "
                    "{% generation %}...{% endgeneration %}, or use loss_scope='last_assistant' on conversations "
                    "that end with the assistant turn"
                )
            reply = through[len(before) :].rstrip()
            spans.append((len(before), len(before) + len(reply)))
        return text, spans

    def apply_many(self, payloads: list) -> list[list]:
        """Render and tokenize a chunk of conversations (one tokenizer batch call): per payload,
        ``[{"input_ids", "loss_mask"}]``, or ``[]`` when dropped; raises as the class says, and
        ``TypeError`` for a payload that is not a dict or messages that are not a list."""
        if not payloads:
            return []
        rendered = []
        for payload in payloads:
            messages = self._messages_of(payload)
            tools = payload.get(self.tools_field) if self.tools_field is not None else None
            try:
                text, spans = self._spans(messages, tools)
            except ValueError:
                raise
            except Exception as exc:
                raise ValueError(
                    f"tokenize_chat: the chat template failed on a record with roles {_roles_of(messages)}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            rendered.append((messages, text, spans))
        encodings = _offset_encoder(self.tokenizer).encode_batch([t for _, t, _ in rendered], add_special_tokens=False)
        out: list[list] = []
        for (messages, _, spans), enc in zip(rendered, encodings):
            ids = np.fromiter(enc.ids, dtype=np.int32, count=len(enc.ids))
            if self.spans_from == "none":
                mask = np.ones(len(ids), dtype=np.uint8)
            else:
                mask = spans_to_mask(np.array(enc.offsets, dtype=np.int64).reshape(-1, 2), spans)
            what = f"a record with roles {_roles_of(messages)}"
            out.append(_finish(self, ids, mask, what, lambda: self._empty_message(messages, spans, len(ids))))
        return out

    def _empty_message(self, messages: list, spans: list, full: int) -> str:
        if self.loss_scope == "all":
            reason = f"it is {full} token(s) long, and the first token is never a target"
        elif not any(m["role"] == "assistant" for m in messages):
            reason = "it has no assistant message"
        elif not spans:
            reason = "the chat template's {% generation %} blocks marked no text"
        elif self.truncation and full > (self.max_length or 0):
            reason = f"truncation to max_length={self.max_length} cut every assistant token"
        else:
            reason = "its assistant turns render as empty text"
        return (
            f"tokenize_chat: a record with roles {_roles_of(messages)} has no supervised token (loss_scope="
            f"{self.loss_scope!r}): {reason}. Training on it would silently teach nothing; fix or filter such records "
            "before tokenize_chat, or pass empty_mask='drop' to drop them (they are counted as drops)"
        )


def _check_prompt_completion_options(v: Any) -> None:
    """The checks of ``TokenizePromptCompletion`` that need no tokenizer."""
    op = "tokenize"
    for name in ("prompt_field", "completion_field"):
        value = getattr(v, name)
        if not isinstance(value, str) or not value:
            raise TypeError(f"{op}: {name} must be a non-empty str, got {value!r}")
    if v.prompt_field == v.completion_field:
        raise ValueError(f"{op}: prompt_field and completion_field are both {v.prompt_field!r}; name two keys")
    check_choice(op, "special_tokens", v.special_tokens, SPECIAL_TOKEN_MODES)
    check_choice(op, "empty_mask", v.empty_mask, EMPTY_MASK_MODES)
    check_choice(op, "backend", v.backend, BACKENDS)
    _check_length(op, v.max_length, v.truncation)
    check_positive(op, "parallelism", v.parallelism)


@attrs.frozen(init=False)
class TokenizePromptCompletion(TokenizerOp):
    """Tokenize ``{"prompt": str, "completion": str}`` records into ``input_ids`` and a completion ``loss_mask``.

    The output is ``[BOS] + prompt + completion + [EOS]`` (specials per ``special_tokens``) with
    ``loss_mask`` 0 on BOS and the prompt, 1 on the completion and the EOS. Prompt and completion
    are tokenized separately (one batch call per chunk), so their boundary is a token boundary, as
    at inference. The first token is never a target (it matters with an empty prompt and no BOS).
    State: none; the output depends on the payload, the tokenizer's content and the data options.

    Args:
        tokenizer: as for :class:`TokenizeChat` (or ``tokenizer_id``).
        prompt_field, completion_field: the payload keys of the two texts.
        special_tokens: ``"bos_eos"`` (default), ``"bos"``, ``"eos"`` or ``"none"``, as in
            ``tokenize``; ``bos_token_id``/``eos_token_id`` override the tokenizer's ids.
        max_length: the longest output in tokens (``>= 2``); longer records raise without
            ``truncation``, which keeps the first ``max_length`` (the completion is cut first).
        empty_mask: ``"error"`` or ``"drop"`` a record with no supervised token.
        parallelism, backend: as for ``tokenize``; performance only.

    Raises:
        ValueError: an invalid option, a missing BOS/EOS id for the chosen mode, a missing field,
            a record longer than ``max_length`` without ``truncation``, or an all-zero mask with
            ``empty_mask="error"``.
        TypeError: an option of the wrong type, or a field that is not a str.

    Examples:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5}
        >>> tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> _ = tok.add_special_tokens(["<s>", "</s>"])
        >>> [[out]] = TokenizePromptCompletion(tok).apply_many([{"prompt": "a b", "completion": "c"}])
        >>> out["input_ids"].tolist(), out["loss_mask"].tolist()
        ([1, 3, 4, 5, 2], [0, 0, 0, 1, 1])
    """

    tokenizer: Any = config_field(default=None)
    prompt_field: str = config_field(default="prompt", kw_only=True)
    completion_field: str = config_field(default="completion", kw_only=True)
    special_tokens: str = config_field(default="bos_eos", kw_only=True)
    bos_token_id: int | None = config_field(default=None, converter=int_like, kw_only=True)
    eos_token_id: int | None = config_field(default=None, converter=int_like, kw_only=True)
    max_length: int | None = config_field(default=None, kw_only=True)
    truncation: bool = config_field(default=False, kw_only=True)
    empty_mask: str = config_field(default="error", kw_only=True)
    parallelism: int | None = config_field(default=None, data=False, kw_only=True)
    backend: str = config_field(default="auto", data=False, kw_only=True)
    _origin: Origin | None = origin_field()

    kind: ClassVar[str] = "tokenize"

    def __init__(self, tokenizer: Any = None, tokenizer_id: Any = UNSET, **options: Any) -> None:
        settings = given_settings(type(self), options)
        _check_prompt_completion_options(settings)
        origin = load_given(tokenizer, tokenizer_id, settings._origin, backend=settings.backend)
        self.__attrs_init__(tokenizer=origin.handle, **{**options, "_origin": origin})

    def __attrs_post_init__(self) -> None:
        handle, mode = self.tokenizer, self.special_tokens
        for name, role in (("bos_token_id", "BOS"), ("eos_token_id", "EOS")):
            needed = mode in ("bos_eos", role.lower())
            value = getattr(self, name)
            if value is not None:
                if not needed:
                    why = f"special_tokens={mode!r}, which adds no {role}"
                    raise ValueError(f"tokenize: {name} cannot be used with {why}")
                check_id(name, value, handle)
            elif needed and getattr(handle, name) is None:
                raise ValueError(
                    f"tokenize: special_tokens={mode!r} needs a {role} token, but the tokenizer ({handle.source}) has "
                    f"none; pass {name}= explicitly or choose another special_tokens mode ('eos' suits tokenizers "
                    "without a BOS)"
                )

    def _text(self, payload: Any, name: str) -> str:
        field = getattr(self, name)
        if not isinstance(payload, Mapping):
            raise TypeError(
                f"tokenize: payload is a {type(payload).__name__}, expected a dict with {self.prompt_field!r} and "
                f"{self.completion_field!r} fields"
            )
        if field not in payload:
            raise ValueError(
                f"tokenize: payload has no field {field!r} (its keys: {sorted(map(str, payload))[:8]}); set "
                f"{name}= to the key holding the text"
            )
        value = payload[field]
        if not isinstance(value, str):
            raise TypeError(f"tokenize: field {field!r} holds a {type(value).__name__}, expected str")
        return value

    def apply_many(self, payloads: list) -> list[list]:
        """Tokenize a chunk of prompt/completion records (one tokenizer batch call): per payload,
        ``[{"input_ids", "loss_mask"}]``, or ``[]`` when dropped; raises as the class says."""
        if not payloads:
            return []
        n = len(payloads)
        texts = [self._text(p, "prompt_field") for p in payloads] + [self._text(p, "completion_field") for p in payloads]
        try:
            encoded = self.tokenizer.encode_batch(texts, num_threads=self.parallelism)
        except ValueError as exc:
            raise ValueError(f"tokenize: {exc}") from exc
        bos, eos = self._specials()
        head = 0 if bos is None else 1
        out: list[list] = []
        for i in range(n):
            prompt, completion = encoded[i], encoded[n + i]
            total = head + len(prompt) + len(completion) + (eos is not None)
            ids = np.empty(total, dtype=np.int32)
            mask = np.zeros(total, dtype=np.uint8)
            if bos is not None:
                ids[0] = bos
            split = head + len(prompt)
            ids[head:split] = prompt
            ids[split : split + len(completion)] = completion
            if eos is not None:
                ids[-1] = eos
            mask[split:] = 1
            what = f"a prompt/completion record ({len(prompt)} prompt and {len(completion)} completion tokens)"
            out.append(_finish(self, ids, mask, what, lambda: self._empty_message(len(prompt), total)))
        return out

    def _empty_message(self, prompt: int, total: int) -> str:
        cut = self.truncation and total > (self.max_length or 0)
        reason = (
            f"truncation to max_length={self.max_length} cut the whole completion"
            if cut
            else "its completion is empty and no EOS is added"
        )
        return (
            f"tokenize: a prompt/completion record ({prompt} prompt tokens) has no supervised token: "
            f"{reason}. Fix or filter such records first, or pass empty_mask='drop' to drop them"
        )


public_signature(TokenizeChat)
public_signature(TokenizePromptCompletion)
