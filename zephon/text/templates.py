"""Chat templates: the built-ins, rendering with ``{% generation %}`` spans, markers, span masks.

Templates are Hugging Face Jinja, rendered as transformers renders them (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``tojson``, ``raise_exception``, ``loopcontrols``). Needs ``jinja2``; the
operators are in :mod:`zephon.ops.chat`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import hub as _hub
from ..core.cache import ProcessCache

__all__ = [
    "BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "LLAMA3_TEMPLATE", "RESERVED_KWARGS", "check_markers",
    "has_generation_tags", "render_chat", "spans_to_mask", "strip_generation_tags", "template_markers",
]

# The render variable holding its span recorder (per render: compiled templates are shared).
_RECORDER = "_zephon_generation_recorder"
#: Render variables a template receives from the operator; chat_template_kwargs cannot set them.
RESERVED_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", _RECORDER}
)


# Every tag strips the whitespace before it ({%- / {{-): only the quoted strings produce output.

#: ChatML as Qwen writes it: ``<|im_start|>role\n...<|im_end|>\n`` turns, tools in the system turn,
#: tool calls as ``<tool_call>`` JSON, tool results as ``tool`` turns.
CHATML_TEMPLATE = r"""
{%- set has_system = messages and messages[0]['role'] == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('chatml: a system message may only come first') }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
            {%- if message['content'] %}
                {{- message['content'] }}
            {%- endif %}
            {%- for call in message['tool_calls'] or [] %}
                {%- if call['function'] is defined %}
                    {%- set call = call['function'] %}
                {%- endif %}
                {%- if message['content'] or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' + (call['name'] | tojson) + ', "arguments": ' }}
                {%- if call['arguments'] is string %}
                    {{- call['arguments'] }}
                {%- else %}
                    {{- call['arguments'] | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- elif message['content'] %}
            {{- message['content'] | tojson }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

#: Llama 3 style: ``bos_token``, ``<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>`` turns
#: (trimmed), tools in the system turn, ``{"name", "parameters"}`` calls, ``ipython`` results.
LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- set has_system = messages and messages[0]['role'] == 'system' %}
{%- if has_system or tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if has_system %}
        {{- messages[0]['content'] | trim }}
    {%- endif %}
    {%- if tools %}
        {%- if has_system %}
            {{- '\n\n' }}
        {%- endif %}
        {{- 'You have access to the following functions. To call a function, respond with JSON of the form {"name": function name, "parameters": dictionary of argument name and its value}.\n' }}
        {%- for tool in tools %}
            {{- '\n' + (tool | tojson) }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('llama3: a system message may only come first') }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- generation %}
            {%- if message['content'] %}
                {{- message['content'] | trim }}
            {%- endif %}
            {%- for call in message['tool_calls'] or [] %}
                {%- if call['function'] is defined %}
                    {%- set call = call['function'] %}
                {%- endif %}
                {%- if message['content'] or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '{"name": ' + (call['name'] | tojson) + ', "parameters": ' }}
                {%- if call['arguments'] is string %}
                    {{- call['arguments'] }}
                {%- else %}
                    {{- call['arguments'] | tojson }}
                {%- endif %}
                {{- '}' }}
            {%- endfor %}
            {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
        {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- elif message['content'] %}
            {{- message['content'] | tojson }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

#: Built-in templates by name (each with ``{% generation %}`` blocks; see :func:`strip_generation_tags`).
BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE}

_TAG = re.compile(r"\{%([-+]?)(\s*)(end)?generation(\s*)([-+]?)%\}")


def strip_generation_tags(template: str) -> str:
    """``template`` with its ``{% generation %}`` tags as ``{% if true %}`` / ``{% endif %}``, same
    whitespace controls: the same text, without the spans.

    Examples:
        >>> strip_generation_tags("{%- generation %}{{ x }}{% endgeneration -%}")
        '{%- if true %}{{ x }}{% endif -%}'
    """

    def replace(m: re.Match) -> str:
        left, lspace, end, rspace, right = m.groups()
        word = "endif" if end else "if true"
        return "{%" + left + (lspace or " ") + word + (rspace or " ") + right + "%}"

    return _TAG.sub(replace, template)


def has_generation_tags(template: str) -> bool:
    """Whether ``template`` has a ``{% generation %}`` block; ``ValueError`` if it is not Jinja."""
    jinja2 = _jinja()
    return any(node.name == "_record" for node in _parse(template).find_all(jinja2.nodes.ExtensionAttribute))


def _parse(template: str) -> Any:
    return _valid_jinja(lambda: _environment().parse(template))


def _valid_jinja(build: Any) -> Any:
    """``build()``, a Jinja syntax error raised as ``ValueError``."""
    try:
        return build()
    except _jinja().TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc} (line {exc.lineno})") from exc


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "chat templates need jinja2, which is not installed; install it with pip install 'zephon-lanes[chat]'"
        ) from exc
    return jinja2


@dataclasses.dataclass(slots=True)
class _Recorder:
    """One render's output length so far and each generation block's start and text."""

    length: int = 0
    blocks: list[tuple[int, str]] = dataclasses.field(default_factory=list)


# The Jinja environment and the compiled templates (by their text) of this process.
_JINJA = ProcessCache()


def _environment() -> Any:
    """The process's sandboxed environment, configured as transformers configures its own."""
    return _JINJA.get("environment", _new_environment)


def _new_environment() -> Any:
    jinja2 = _jinja()

    class GenerationExtension(jinja2.ext.Extension):
        """``{% generation %}``: renders its body and records its start, the output length so far
        (exact unless buffered by a macro, ``set`` or ``filter`` block; :func:`_render` checks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_record", [jinja2.nodes.ContextReference()])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _record(self, context, caller):
            text = caller()
            recorder = context.get(_RECORDER)
            if isinstance(recorder, _Recorder):
                recorder.blocks.append((recorder.length, str(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers: no HTML escaping, keyword options exposed.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # No strftime_now: the data must not depend on the day it was built.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationExtension, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render_chat(
    template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
    tools: Any = None, bos_token: str = "", eos_token: str = "", **kwargs: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation (``template``: a built-in name or Jinja text; the other arguments are
    template variables) and give the text and the ``[start, end)`` span of each generation block.

    Raises:
        ValueError: the template is not valid Jinja, or a generation block sits inside a macro, a
            ``{% set %}`` or a ``{% filter %}`` block (its span cannot be tracked).
        jinja2.TemplateError: the template raised (``raise_exception``) or failed.

    Examples:
        >>> text, spans = render_chat("chatml", [{"role": "user", "content": "hi"},
        ...                                      {"role": "assistant", "content": "hello"}])
        >>> text
        '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nhello<|im_end|>\\n'
        >>> [text[a:b] for a, b in spans]
        ['hello<|im_end|>']
    """
    fixed = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
    variables = {**kwargs, **fixed, "bos_token": bos_token, "eos_token": eos_token}
    return _render(BUILTIN_TEMPLATES.get(template, template), variables, track=True)


def _render(template: str, variables: dict[str, Any], *, track: bool) -> tuple[str, list[tuple[int, int]]]:
    """Render ``template``; with ``track``, also the checked spans of its generation blocks."""
    compiled = _JINJA.get(  # compiled once per process
        ("template", template), lambda: _valid_jinja(lambda: _environment().from_string(template))
    )
    if not track:
        return compiled.render(variables), []
    recorder = _Recorder()
    parts = []
    for piece in compiled.generate({**variables, _RECORDER: recorder}):
        parts.append(piece)
        recorder.length += len(piece)
    text = "".join(parts)
    spans = []
    for start, block in recorder.blocks:
        end = start + len(block)
        if text[start:end] != block:
            raise ValueError(
                "a {% generation %} block of the chat template is rendered inside a macro, a {% set %} block or a "
                "{% filter %} block, so where its text lands cannot be tracked; move the generation tags out to "
                "the template's main flow (around the text of each assistant turn), or strip them and use "
                "span_source='prefix'"
            )
        spans.append((start, end))
    return text, spans


def _folder_template(folder: Path) -> tuple[str | None, str]:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        return _config_template(config), str(config)
    return None, str(config)


def _config_template(config: Path) -> str | None:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenize_chat: cannot read {str(config)!r}: {exc}; fix or remove it") from exc
    value = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(value, list):  # named templates, as transformers saves several
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"tokenize_chat: {str(config)!r} holds named chat templates {sorted(map(str, named))} and none is "
                "called 'default'; pass the one you want as chat_template="
            )
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise ValueError(f"tokenize_chat: 'chat_template' in {str(config)!r} is a {type(value).__name__}, not text")
    return value


def _tokenizer_template(tokenizer: Any, tokenizer_id: Any) -> tuple[str | None, list[str]]:
    """The chat template shipped with the tokenizer, and where it was looked for."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own:  # a transformers tokenizer object
        return own, []
    folder = None
    for candidate in (tokenizer, tokenizer_id):
        path = Path(os.fspath(candidate)).expanduser() if isinstance(candidate, (str, os.PathLike)) else None
        if path is not None and path.exists():
            folder = path if path.is_dir() else path.parent
            break
    else:
        if isinstance(tokenizer_id, str):  # a Hugging Face id: the snapshot load_tokenizer read the tokenizer from
            found = _hub.snapshots(tokenizer_id, _hub.cache_dir())
            folder = found[0] if len(found) == 1 else None
    if folder is None:
        return None, []
    text, where = _folder_template(folder)
    return text, [] if text is not None else [where]


def _usage() -> str:
    names = ", ".join(repr(n) for n in BUILTIN_TEMPLATES)
    where = "a path to a .jinja file or a tokenizer_config.json"
    return f"pass chat_template= as a built-in name ({names}), Jinja text, or {where}"


def shipped_template(tokenizer: Any, tokenizer_id: Any) -> tuple[str | None, BaseException | None]:
    """The chat template shipped with a tokenizer, else ``None`` and the error (without traceback)
    to raise where ``chat_template=None`` needs it: an operator looks it up once, when built."""
    try:
        text, looked = _tokenizer_template(tokenizer, tokenizer_id)
    except Exception as exc:  # an unreadable config; raised when the template is asked for
        exc.__traceback__ = exc.__cause__ = exc.__context__ = None
        return None, exc
    if text is not None:
        return text, None
    where = f" (looked in {', '.join(looked)})" if looked else ""
    return None, ValueError(f"tokenize_chat: no chat template given and none ships with the tokenizer{where}; {_usage()}")


def _resolve_template(chat_template: Any) -> str:
    """The text of a given ``chat_template``: a built-in name, Jinja text, a file or a folder."""
    usage = _usage()
    if isinstance(chat_template, os.PathLike):
        chat_template = os.fspath(chat_template)
    if not isinstance(chat_template, str):
        raise TypeError(f"tokenize_chat: chat_template must be a str or None, got {type(chat_template).__name__}; {usage}")
    if chat_template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[chat_template]
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if path.is_dir():
        text, where = _folder_template(path)
        if text is None:
            raise ValueError(f"tokenize_chat: chat_template={chat_template!r}: no chat template in {where}; {usage}")
        return text
    if path.is_file():
        if path.suffix == ".json":
            text = _config_template(path)
            if text is None:
                raise ValueError(f"tokenize_chat: {chat_template!r} has no 'chat_template' entry; {usage}")
            return text
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"tokenize_chat: chat_template={chat_template!r} is not a built-in name, not Jinja text and not an existing "
        f"file; {usage}"
    )


def spans_to_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 mask, one entry per token, of the tokens whose character range (``offsets``: ``[n, 2]``)
    overlaps one of the ``[start, end)`` character ``spans``."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if len(offsets) and spans:
        starts, ends = offsets[:, 0], offsets[:, 1]
        for a, b in spans:
            if b > a:
                mask[(starts < b) & (ends > a)] = 1
    return mask


#: Special-token markers: ``<|...|>``, DeepSeek's ``<｜...｜>``, ``<s>``, ``</s>`` (not ``[INST]``,
#: which some tokenizers rightly encode as plain text).
_MARKER = re.compile(r"<\|[^|<>\s]{1,64}\|>|<｜[^｜<>\s]{1,64}｜>|</?s>")


def template_markers(template: str) -> tuple[str, ...]:
    """The special-token markers ``template`` writes in its text and string constants, in order of
    first appearance (not ``bos_token`` and the like); ``ValueError`` if it is not Jinja.

    Examples:
        >>> template_markers(CHATML_TEMPLATE)
        ('<|im_start|>', '<|im_end|>')
        >>> template_markers("{# <|ignored|> #}{{ bos_token }}[INST] {{ messages[0]['content'] }}</s>")
        ('</s>',)
    """
    nodes = _jinja().nodes
    found: dict[str, None] = {}
    for node in _parse(template).find_all((nodes.TemplateData, nodes.Const)):
        text = node.data if isinstance(node, nodes.TemplateData) else node.value
        if isinstance(text, str):
            found.update(dict.fromkeys(_MARKER.findall(text)))
    return tuple(found)


def _unsplit_markers(markers: Sequence[str], tokenizer: Any) -> dict[str, int]:
    """The markers a ``tokenizers.Tokenizer`` does not encode as their own single token, each with the
    number of ids it encodes to (1 when it is one foreign id, such as ``[UNK]``)."""
    out = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False).ids
        if len(ids) != 1 or ids[0] != tokenizer.token_to_id(marker):
            out[marker] = len(ids)
    return out


def check_markers(template: str, tokenizer: Any, name: str, *, op: str = "tokenize_chat") -> None:
    """Raise ``ValueError`` unless every special marker of ``template`` is one token of
    ``tokenizer`` (a ``tokenizers.Tokenizer``; ``name`` and ``op`` are for the message): a split
    marker would teach a turn format the model never sees at inference."""
    bad = _unsplit_markers(template_markers(template), tokenizer)
    if not bad:
        return
    listed = ", ".join(f"{m!r} ({n} ids)" if n != 1 else f"{m!r} (an unrelated id)" for m, n in bad.items())
    known = [m for m in bad if tokenizer.token_to_id(m) is not None]
    why = (
        f"; its vocabulary has {', '.join(map(repr, known))}, but it encodes special tokens written in text as "
        "plain text (encode_special_tokens=True): turn that off"
    ) if known and getattr(tokenizer, "encode_special_tokens", False) else ""
    fits = [f"chat_template={key!r}" for key, text in BUILTIN_TEMPLATES.items()
            if text != template and not _unsplit_markers(template_markers(text), tokenizer)]
    pick = f" ({' or '.join(fits)} does)" if fits else ""
    markers = "[" + ", ".join(map(repr, bad)) + "]"
    raise ValueError(
        f"{op}: the chat template writes special tokens that the tokenizer ({name}) does not have as single "
        f"tokens: {listed}{why}. Rendered conversations would carry them as ordinary text pieces, unlike the "
        f"format the model sees at inference. Add them as special tokens before passing the tokenizer "
        f"(tokenizer.add_special_tokens({markers}) on a tokenizers.Tokenizer, or "
        f"add_special_tokens({{'additional_special_tokens': {markers}}}) on a transformers tokenizer, then "
        f"resize the model's embeddings), use the tokenizer the template was written for, or pick a template "
        f"that matches this tokenizer{pick}"
    )
