"""tokenize_chat and prompt/completion tokenization: golden assistant masks, span sources, options.

Expected masks are checked by decoding: the tokens with loss_mask 1 form one run per assistant
turn, and each run must decode to exactly that turn's reply plus its end-of-turn token, written
out here from the messages (the reply formats of the built-in templates), not from the code under
test.
"""

import hashlib
import json
import pickle
import shutil

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jinja2  # noqa: F401  (the test extra installs it)

from _shared import shared_path  # noqa: E402
from zephon import Pipeline  # noqa: E402
from zephon.ops.chat import (
    BUILTIN_TEMPLATES,
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    TokenizeChat,
    TokenizePromptCompletion,
    has_generation_tags,
    render_chat,
    strip_generation_tags,
)
from zephon.core.records import Meta, Record, SampleBatch, Segment  # noqa: E402
from zephon.text.templates import template_markers  # noqa: E402
from zephon.text.tokenizer import TokenizerHandle  # noqa: E402
from zephon.ops import Chain, PackFlat  # noqa: E402
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance  # noqa: E402

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|endoftext|>",
]
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

MULTI_TURN = [
    SYSTEM,
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "That makes 12."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.  Anything else?"},
]
TOOL_CALL = [
    SYSTEM,
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 °C and clear in Paris."},
]
TOOL_CALLS_ONLY = [
    {"role": "user", "content": "Add 3 and 4, then 5 and 6."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
            {"name": "add", "arguments": '{"a": 5, "b": 6}'},
        ],
    },
    {"role": "tool", "content": "7"},
    {"role": "tool", "content": "11"},
    {"role": "assistant", "content": "The sums are 7 and 11."},
]
UNICODE = [
    {"role": "user", "content": "Übersetze: café 😀"},
    {"role": "assistant", "content": "Kaffee ☕ — «café» means coffee."},
    {"role": "user", "content": "Und 中文?"},
    {"role": "assistant", "content": "咖啡 (kāfēi)."},
]
ENDS_WITH_USER = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Never mind."},
]
NO_ASSISTANT = [SYSTEM, {"role": "user", "content": "Is anyone there?"}]

CONVERSATIONS = {
    "multi_turn": {"messages": MULTI_TURN},
    "tool_call": {"messages": TOOL_CALL, "tools": [WEATHER_TOOL]},
    "tool_calls_only": {"messages": TOOL_CALLS_ONLY},
    "unicode": {"messages": UNICODE},
    "ends_with_user": {"messages": ENDS_WITH_USER},
}


# -- expected replies, written from the template formats -----------------------------------------------


def _calls(message):
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn["arguments"]
        yield json.dumps(fn["name"]), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def expected_reply(template, message):
    """The text a built-in template renders for an assistant message, end-of-turn token included."""
    content = message.get("content") or ""
    if template == "llama3":
        content = content.strip()
        calls = ['{"name": ' + name + ', "parameters": ' + args + "}" for name, args in _calls(message)]
    else:
        calls = ["<tool_call>\n" + '{"name": ' + name + ', "arguments": ' + args + "}\n</tool_call>" for name, args in _calls(message)]
    body = "\n".join(([content] if content else []) + calls)
    return body + END_OF_TURN[template]


def expected_replies(template, messages, scope="assistant"):
    replies = [expected_reply(template, m) for m in messages if m["role"] == "assistant"]
    return replies[-1:] if scope == "last_assistant" else replies


# -- fixtures ---------------------------------------------------------------------------------------------


def _training_text():
    texts = []
    for conv in CONVERSATIONS.values():
        for m in conv["messages"]:
            texts.append(m.get("content") or "")
            texts.extend(name + args for name, args in _calls(m))
    texts += [
        "The quick brown fox jumps over the lazy dog. Questions and answers about the weather, numbers and sums.",
        "system user assistant tool ipython function parameters arguments name type object properties",
        "You have access to the following functions. For each function call, return a json object.",
        "def add(a, b):\n    return a + b\n\n# Tools\n\n<tools></tools> <tool_call></tool_call>",
    ]
    return texts * 20


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets moves offsets off leading spaces; the operator must not depend on it.
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_training_text(), trainer)
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def tok(tok_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def ops(tok_dir):
    """Per built-in template: generation tags, prefix rendering of the same template, and auto on a tag-free copy."""
    out = {}
    for name, text in BUILTIN_TEMPLATES.items():
        out[name] = {
            "tags": TokenizeChat(tok_dir, chat_template=name),
            "prefix": TokenizeChat(tok_dir, chat_template=name, span_source="prefix"),
            "plain": TokenizeChat(tok_dir, chat_template=strip_generation_tags(text)),
        }
    return out


def runs(tok, ids, mask):
    """Decoded text of each maximal run of supervised tokens."""
    out, start = [], None
    for i, bit in enumerate(list(mask) + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            out.append(tok.decode(ids[start:i].tolist(), skip_special_tokens=False))
            start = None
    return out


def one(op, payload):
    [[out]] = op.apply_many([payload])
    return out


# -- golden masks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("source", ["tags", "prefix", "plain"])
def test_masked_tokens_decode_to_assistant_replies(ops, tok, template, conv, source):
    payload = CONVERSATIONS[conv]
    out = one(ops[template][source], payload)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    assert set(np.unique(mask)) <= {0, 1} and mask[0] == 0
    assert runs(tok, ids, mask) == expected_replies(template, payload["messages"])
    # The whole sequence is the rendered conversation, tokenized as one text.
    text, _ = render_chat(template, payload["messages"], tools=payload.get("tools"), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == text


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_prefix_rendering_and_generation_tags_agree(ops, template):
    variants = ops[template]
    assert (variants["tags"].spans_from, variants["prefix"].spans_from, variants["plain"].spans_from) == ("tags", "prefix", "prefix")
    payloads = list(CONVERSATIONS.values())
    results = {k: op.apply_many(payloads) for k, op in variants.items()}
    for i in range(len(payloads)):
        ref = results["tags"][i][0]
        for k in ("prefix", "plain"):
            got = results[k][i][0]
            assert np.array_equal(got["input_ids"], ref["input_ids"]) and np.array_equal(got["loss_mask"], ref["loss_mask"]), (k, i)


def test_header_system_user_and_tool_tokens_are_unsupervised(ops, tok):
    out = one(ops["chatml"]["tags"], CONVERSATIONS["tool_call"])
    ids, mask = out["input_ids"], out["loss_mask"]
    unsupervised = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
    for piece in ("<|im_start|>assistant\n", "You are a helpful assistant.", "What's the weather in Paris?", '"temperature": 21'):
        assert piece in unsupervised
    im_start = tok.token_to_id("<|im_start|>")
    assert not mask[ids == im_start].any()
    assert mask[ids == tok.token_to_id("<|im_end|>")].tolist() == [0, 0, 1, 0, 1]  # system, user, reply, tool, reply


def test_offsets_follow_the_handle_ids(ops):
    """The ids come from the same tokenizer content as the handle's own encoder."""
    op = ops["llama3"]["tags"]
    for payload in CONVERSATIONS.values():
        text, _ = render_chat("llama3", payload["messages"], tools=payload.get("tools"), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
        [expected] = op.handle.encode_batch([text])
        assert np.array_equal(one(op, payload)["input_ids"], expected)


def test_offsets_are_not_trimmed(tok_dir, tok):
    """The test tokenizer's ByteLevel post-processor trims spaces off offsets; spans must not see that."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello  "}]
    out = one(TokenizeChat(tok_dir, chat_template=template), {"messages": messages})
    assert runs(tok, out["input_ids"], out["loss_mask"]) == ["Hello  "]


# -- loss scopes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("source", ["generation_tags", "prefix"])
def test_last_assistant_scope(tok_dir, tok, template, source):
    op = TokenizeChat(tok_dir, chat_template=template, span_source=source, loss_scope="last_assistant")
    for payload in CONVERSATIONS.values():
        out = one(op, payload)
        assert runs(tok, out["input_ids"], out["loss_mask"]) == expected_replies(template, payload["messages"], "last_assistant")


def test_all_scope_supervises_every_token_but_the_first(tok_dir, ops):
    op = TokenizeChat(tok_dir, chat_template="chatml", loss_scope="all")
    assert op.spans_from == "none"
    for payload in CONVERSATIONS.values():
        out = one(op, payload)
        assert np.array_equal(out["input_ids"], one(ops["chatml"]["tags"], payload)["input_ids"])
        assert out["loss_mask"].tolist() == [0] + [1] * (len(out["input_ids"]) - 1)


# -- records with nothing to learn --------------------------------------------------------------------------


def test_empty_mask_error_names_roles_and_fix(ops):
    for op in ops["chatml"].values():
        with pytest.raises(ValueError, match=r"roles \[system, user\].*no assistant message.*empty_mask='drop'"):
            op.apply_many([{"messages": NO_ASSISTANT}])


def test_empty_mask_drop_drops_only_that_record(tok_dir, tok):
    op = TokenizeChat(tok_dir, chat_template="llama3", empty_mask="drop")
    results = op.apply_many([{"messages": MULTI_TURN}, {"messages": NO_ASSISTANT}, {"messages": UNICODE}])
    assert [len(r) for r in results] == [1, 0, 1]
    assert runs(tok, results[2][0]["input_ids"], results[2][0]["loss_mask"]) == expected_replies("llama3", UNICODE)


def test_dropped_records_leave_the_pipeline(tok_dir):
    rows = [{"messages": MULTI_TURN}, {"messages": NO_ASSISTANT}, {"messages": UNICODE}]
    pipe = Pipeline(rows).add(TokenizeChat(tok_dir, chat_template="chatml", empty_mask="drop"))
    assert len(list(pipe)) == 2


def test_generation_tags_that_mark_nothing_are_an_empty_mask(tok_dir):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if false %}{% generation %}x{% endgeneration %}{% endif %}"
    op = TokenizeChat(tok_dir, chat_template=template)
    assert op.spans_from == "tags"
    with pytest.raises(ValueError, match="generation %\\} blocks marked no text"):
        op.apply_many([{"messages": MULTI_TURN}])


# -- truncation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_truncation_keeps_the_mask_aligned(tok_dir, ops, template):
    payload = CONVERSATIONS["multi_turn"]
    full = one(ops[template]["tags"], payload)
    n = len(full["input_ids"])
    for cut in (n // 2, n - 1, n, n + 5):
        out = one(TokenizeChat(tok_dir, chat_template=template, max_length=cut, truncation=True), payload)
        assert len(out["input_ids"]) == len(out["loss_mask"]) == min(cut, n)
        assert np.array_equal(out["input_ids"], full["input_ids"][:cut])
        assert np.array_equal(out["loss_mask"], full["loss_mask"][:cut])


def test_too_long_without_truncation_is_an_error(tok_dir, ops):
    n = len(one(ops["chatml"]["tags"], CONVERSATIONS["multi_turn"])["input_ids"])
    op = TokenizeChat(tok_dir, chat_template="chatml", max_length=n - 1)
    with pytest.raises(ValueError, match=rf"{n} tokens long, more than max_length={n - 1}.*truncation=True"):
        op.apply_many([CONVERSATIONS["multi_turn"]])
    assert len(one(TokenizeChat(tok_dir, chat_template="chatml", max_length=n), CONVERSATIONS["multi_turn"])["input_ids"]) == n


def test_truncation_that_cuts_every_reply(tok_dir):
    op = TokenizeChat(tok_dir, chat_template="chatml", max_length=8, truncation=True)
    with pytest.raises(ValueError, match="truncation to max_length=8 cut every assistant token"):
        op.apply_many([CONVERSATIONS["multi_turn"]])
    dropping = TokenizeChat(tok_dir, chat_template="chatml", max_length=8, truncation=True, empty_mask="drop")
    assert dropping.apply_many([CONVERSATIONS["multi_turn"]]) == [[]]


# -- where the template comes from --------------------------------------------------------------------------------


def test_template_from_tokenizer_config(tok_dir, ops):
    for kwargs in ({"tokenizer": tok_dir}, {"tokenizer": str(tok_dir / "tokenizer.json")}, {"tokenizer_id": str(tok_dir)}):
        op = TokenizeChat(**kwargs)
        assert op.chat_template == CHATML_TEMPLATE and op.tokenizer_id is None
        assert isinstance(op.tokenizer, TokenizerHandle)
        out = one(op, CONVERSATIONS["tool_call"])
        assert np.array_equal(out["loss_mask"], one(ops["chatml"]["tags"], CONVERSATIONS["tool_call"])["loss_mask"])


def test_template_sources(tok_dir, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template given.*chat_template="):
        TokenizeChat(folder)
    named = [{"name": "tool_use", "template": LLAMA3_TEMPLATE}, {"name": "default", "template": CHATML_TEMPLATE}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}), encoding="utf-8")
    assert TokenizeChat(folder).chat_template == CHATML_TEMPLATE
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE, encoding="utf-8")
    assert TokenizeChat(folder).chat_template == LLAMA3_TEMPLATE  # the .jinja file wins, as in transformers
    assert TokenizeChat(folder, chat_template=str(folder / "chat_template.jinja")).chat_template == LLAMA3_TEMPLATE
    assert TokenizeChat(folder, chat_template=str(tok_dir / "tokenizer_config.json")).chat_template == CHATML_TEMPLATE
    assert TokenizeChat(folder, chat_template="chatml").chat_template == CHATML_TEMPLATE
    with pytest.raises(ValueError, match="not a built-in name.*'chatml', 'llama3'"):
        TokenizeChat(folder, chat_template="chatml3")


def test_template_from_hub_cache(tok_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--chat" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, snapshot / name)
    (tmp_path / "hub" / "models--org--chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--chat" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert TokenizeChat(tokenizer_id="org/chat").chat_template == CHATML_TEMPLATE


def test_template_that_ignores_add_generation_prompt_is_rejected(tok_dir):
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="same text with add_generation_prompt=True and False"):
        TokenizeChat(tok_dir, chat_template=template)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        TokenizeChat(tok_dir, chat_template=template, span_source="prefix")
    # Not needed when every token is a target.
    TokenizeChat(tok_dir, chat_template=template, loss_scope="all")


def test_ignored_generation_prompt_found_per_record_when_the_probe_fails(tok_dir):
    # The template rejects the construction probe (a lone user message), so the check runs per record.
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    op = TokenizeChat(tok_dir, chat_template=template)
    with pytest.raises(ValueError, match="same text with add_generation_prompt=True and False"):
        op.apply_many([CONVERSATIONS["multi_turn"]])


def test_template_errors_name_the_record(ops):
    bad = [{"role": "user", "content": "hi"}, SYSTEM, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match=r"failed on a record with roles \[user, system, assistant\].*only come first"):
        ops["chatml"]["tags"].apply_many([{"messages": bad}])


def test_templates_that_rewrite_history_fail_prefix_rendering(tok_dir, tok):
    # Earlier assistant turns are shortened; only the last turn is rendered in full.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix rendering failed for message 2"):
        TokenizeChat(tok_dir, chat_template=template).apply_many([{"messages": MULTI_TURN}])
    out = one(TokenizeChat(tok_dir, chat_template=template, loss_scope="last_assistant"), {"messages": MULTI_TURN})
    assert runs(tok, out["input_ids"], out["loss_mask"]) == expected_replies("chatml", MULTI_TURN, "last_assistant")


def test_generation_tag_checks(tok_dir):
    plain = strip_generation_tags(CHATML_TEMPLATE)
    assert has_generation_tags(CHATML_TEMPLATE) and not has_generation_tags(plain)
    assert not has_generation_tags("{# {% generation %} #}{{ 'x' }}")
    with pytest.raises(ValueError, match="no \\{% generation %\\} blocks"):
        TokenizeChat(tok_dir, chat_template=plain, span_source="generation_tags")
    in_macro = (
        "{% macro reply(m) %}Reply: {% generation %}{{ m['content'] }}{% endgeneration %}{% endmacro %}"
        "{% for m in messages %}[{{ m['role'] }}] {% if m['role'] == 'assistant' %}{{ reply(m) }}{% else %}"
        "{{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="inside a macro"):
        TokenizeChat(tok_dir, chat_template=in_macro).apply_many([{"messages": MULTI_TURN}])
    one_block = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% generation %}{{ messages[-1]['content'] }}{% endgeneration %}"
    )
    with pytest.raises(ValueError, match="marked 1 \\{% generation %\\} block\\(s\\) in a record with 3 assistant"):
        TokenizeChat(tok_dir, chat_template=one_block).apply_many([{"messages": MULTI_TURN}])


# -- special markers must be tokens ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gpt2_like():
    """A GPT-2 style byte-level BPE whose only special token is <|endoftext|>: no chat markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_training_text(), trainer)
    return tok


def copy_of(tok):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tok.to_str())


def test_markers_of_the_builtin_templates():
    assert template_markers(CHATML_TEMPLATE) == ("<|im_start|>", "<|im_end|>")
    # Llama 3's <|begin_of_text|> comes from bos_token, the tokenizer's own BOS: not a literal.
    assert template_markers(LLAMA3_TEMPLATE) == ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    for text in BUILTIN_TEMPLATES.values():
        assert template_markers(strip_generation_tags(text)) == template_markers(text)


def test_markers_of_a_user_template():
    template = (
        "{# <|in_a_comment|> #}{{ bos_token }}{% for m in messages %}[INST] <|user|>{{ m['content'] }}"
        "{{ '<｜Assistant｜>' if m['role'] == 'assistant' }}</s>{% endfor %}<s> <tool_call> {{ eos_token }}"
    )
    # <|...|> (and the full-width form), <s> and </s>; not comments, variables, [INST] or XML-like tags.
    assert template_markers(template) == ("<|user|>", "<｜Assistant｜>", "</s>", "<s>")
    with pytest.raises(ValueError, match="not valid Jinja"):
        template_markers("{% for %}")


@pytest.mark.parametrize(
    "template, markers",
    [
        ("chatml", ["<|im_start|>", "<|im_end|>"]),
        ("llama3", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    ],
)
def test_builtin_template_markers_missing_from_the_tokenizer_fail_at_construction(gpt2_like, template, markers):
    with pytest.raises(ValueError) as err:
        TokenizeChat(gpt2_like, chat_template=template)
    message = str(err.value)
    assert message.startswith("tokenize_chat: the chat template writes special tokens")
    for marker in markers:
        assert repr(marker) in message
    assert "tokenizers.Tokenizer object" in message  # the tokenizer
    assert f"tokenizer.add_special_tokens({markers!r})" in message and "pick a template" in message  # the fix
    # In a pipeline it fails when the step is added, before any data is read.
    with pytest.raises(ValueError, match="does not have as single tokens"):
        Pipeline([{"messages": MULTI_TURN}]).tokenize_chat(gpt2_like, chat_template=template)


def test_the_gpt2_tokenizer_cannot_render_chatml():
    """The reported defect: <|im_start|> used to become 7 ordinary GPT-2 tokens, silently."""
    gpt2 = shared_path("data", "gpt2", "tokenizer.json")
    with pytest.raises(ValueError, match=r"'<\|im_start\|>' \(7 ids\), '<\|im_end\|>' \(7 ids\)") as err:
        TokenizeChat(gpt2, chat_template="chatml")
    assert str(gpt2) in str(err.value)


def test_user_template_markers_are_checked(gpt2_like):
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|><|sep|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ValueError, match=r"'<\|sep\|>' \(\d+ ids\), '<\|assistant\|>' \(\d+ ids\)\.") as err:
        TokenizeChat(gpt2_like, chat_template=template)
    assert "<|endoftext|>" not in str(err.value)  # one token of this tokenizer
    tok = copy_of(gpt2_like)
    tok.add_special_tokens(["<|sep|>", "<|assistant|>"])
    TokenizeChat(tok, chat_template=template)


def test_markers_added_as_special_tokens_are_one_id_each(gpt2_like):
    tok = copy_of(gpt2_like)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    out = one(TokenizeChat(tok, chat_template="chatml"), CONVERSATIONS["multi_turn"])
    ids = out["input_ids"].tolist()
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids.count(start) == ids.count(end) == len(MULTI_TURN)
    text, _ = render_chat("chatml", MULTI_TURN)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert runs(tok, out["input_ids"], out["loss_mask"]) == expected_replies("chatml", MULTI_TURN)


@pytest.mark.parametrize("template", sorted(BUILTIN_TEMPLATES))
def test_markers_are_one_id_each_with_a_tokenizer_trained_with_them(ops, tok, template):
    payload = CONVERSATIONS["tool_call"]
    ids = one(ops[template]["tags"], payload)["input_ids"].tolist()
    text, _ = render_chat(template, payload["messages"], tools=payload.get("tools"), bos_token="<|begin_of_text|>")
    for marker in template_markers(BUILTIN_TEMPLATES[template]):
        assert ids.count(tok.token_to_id(marker)) == text.count(marker) > 0


def test_a_matching_builtin_template_is_suggested(gpt2_like):
    tok = copy_of(gpt2_like)
    tok.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    with pytest.raises(ValueError, match=r"matches this tokenizer \(chat_template='llama3' does\)"):
        TokenizeChat(tok, chat_template="chatml")
    TokenizeChat(tok, chat_template="llama3")


def test_a_marker_read_as_unknown_is_rejected():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "user": 2, "assistant": 3, "hi": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' \(an unrelated id\)"):
        TokenizeChat(tok, chat_template="chatml")


def test_markers_written_as_text_by_encode_special_tokens(tok):
    plain = copy_of(tok)
    plain.encode_special_tokens = True
    with pytest.raises(ValueError, match="encode_special_tokens=True"):
        TokenizeChat(plain, chat_template="chatml")


def test_prompt_completion_uses_no_template(gpt2_like):
    [[out]] = TokenizePromptCompletion(gpt2_like, special_tokens="eos").apply_many([{"prompt": "Hi", "completion": " there"}])
    assert out["loss_mask"][-1] == 1


def test_template_names_stay_importable():
    import ast
    from pathlib import Path

    import zephon.ops.chat
    import zephon.text.templates
    import zephon.chat

    for name in zephon.chat.__all__:
        assert getattr(zephon.chat, name) is getattr(zephon.text.templates, name)
    for name in ("BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "LLAMA3_TEMPLATE", "RESERVED_KWARGS", "render_chat", "spans_to_mask"):
        assert getattr(zephon.ops.chat, name) is getattr(zephon.text.templates, name) and name in zephon.ops.chat.__all__
    # Templates sit below the operators: zephon/text/templates.py never imports the chat operator.
    source = (Path(__file__).resolve().parents[1] / "zephon" / "text" / "templates.py").read_text(encoding="utf-8")
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.level}
    assert not any("chat" in (m or "") for m in imported) and "core.cache" in imported


# -- options, payloads ---------------------------------------------------------------------------------------------


def test_chat_template_kwargs(tok_dir, tok):
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ suffix }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    op = TokenizeChat(tok_dir, chat_template=template, chat_template_kwargs={"suffix": "!"})
    out = one(op, {"messages": ENDS_WITH_USER})
    assert runs(tok, out["input_ids"], out["loss_mask"]) == ["Hello! How can I help?!<|im_end|>"]
    with pytest.raises(ValueError, match=r"cannot set \['messages'\]"):
        TokenizeChat(tok_dir, chat_template="chatml", chat_template_kwargs={"messages": []})


def test_tools_field(ops, tok):
    op = ops["chatml"]["tags"]
    with_tools = one(op, CONVERSATIONS["tool_call"])
    text = tok.decode(with_tools["input_ids"].tolist(), skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    without = one(op, {"messages": TOOL_CALL})
    assert "<tools>" not in tok.decode(without["input_ids"].tolist(), skip_special_tokens=False)
    assert runs(tok, without["input_ids"], without["loss_mask"]) == expected_replies("chatml", TOOL_CALL)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"loss_scope": "assistant_only"}, "loss_scope must be one of"),
        ({"empty_mask": "skip"}, "empty_mask must be one of"),
        ({"span_source": "prefix_diff"}, "span_source must be one of"),
        ({"truncation": True}, "truncation=True requires max_length"),
        ({"max_length": 1}, "max_length must be an int >= 2"),
    ],
)
def test_invalid_options(tok_dir, kwargs, error):
    with pytest.raises(ValueError, match=error):
        TokenizeChat(tok_dir, chat_template="chatml", **kwargs)


def test_malformed_payloads(ops):
    op = ops["chatml"]["tags"]
    with pytest.raises(ValueError, match="no field 'messages'.*'conversation'"):
        op.apply_many([{"conversation": MULTI_TURN}])
    with pytest.raises(TypeError, match="expected a list of messages"):
        op.apply_many([{"messages": "hello"}])
    with pytest.raises(ValueError, match='message 1 .* must be a dict with a str "role"'):
        op.apply_many([{"messages": [SYSTEM, {"content": "no role"}]}])
    custom = TokenizeChat(op.handle, chat_template="chatml", field="conversation")
    assert np.array_equal(one(custom, {"conversation": MULTI_TURN})["loss_mask"], one(op, {"messages": MULTI_TURN})["loss_mask"])


def test_one_tokenizer_call_per_chunk(ops, monkeypatch):
    import zephon.ops.chat as chat

    calls = []
    real = chat._offset_encoder

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def encode_batch(self, texts, **kw):
            calls.append(len(texts))
            return self.inner.encode_batch(texts, **kw)

    monkeypatch.setattr(chat, "_offset_encoder", lambda handle: Counting(real(handle)))
    ops["llama3"]["prefix"].apply_many(list(CONVERSATIONS.values()))
    assert calls == [len(CONVERSATIONS)]


# -- identity ---------------------------------------------------------------------------------------------------------


def test_pickle_round_trip_needs_no_files(tok_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(tok_dir, folder)
    op = TokenizeChat(folder, loss_scope="last_assistant", max_length=4096, truncation=True)
    expected = op.apply_many(list(CONVERSATIONS.values()))
    blob = pickle.dumps(op)
    shutil.rmtree(folder)
    back = pickle.loads(blob)
    assert back == op and back.fingerprint() == op.fingerprint() and back.spans_from == "tags"
    assert hash(back) == hash(op)
    evolved = attrs.evolve(back, loss_scope="assistant")
    assert evolved.chat_template == op.chat_template and evolved.fingerprint()["loss_scope"] == "assistant"
    got = back.apply_many(list(CONVERSATIONS.values()))
    for a, b in zip(got, expected):
        assert np.array_equal(a[0]["input_ids"], b[0]["input_ids"]) and np.array_equal(a[0]["loss_mask"], b[0]["loss_mask"])


def test_fingerprint_holds_the_template_hash(tok_dir, ops):
    fp = ops["chatml"]["tags"].fingerprint()
    assert fp["op"] == "TokenizeChat"
    assert fp["chat_template"] == "sha256:" + hashlib.sha256(CHATML_TEMPLATE.encode("utf-8")).hexdigest()
    assert CHATML_TEMPLATE not in json.dumps(fp)
    assert fp["tokenizer"] == ops["chatml"]["tags"].handle.fingerprint()
    assert fp != ops["llama3"]["tags"].fingerprint()
    assert fp != ops["chatml"]["plain"].fingerprint()  # a different template text
    assert fp == TokenizeChat(tok_dir).fingerprint()  # the same template, from the config
    assert fp != TokenizeChat(tok_dir, chat_template="chatml", chat_template_kwargs={"x": 1}).fingerprint()
    json.dumps(fp)


def test_conformance_with_packing(tok_dir):
    """Stateless, so checkpoints hold records by reference and rebuild them by re-tokenizing."""
    rows = [CONVERSATIONS[k] for k in sorted(CONVERSATIONS)] + [{"messages": NO_ASSISTANT}]
    records = [Record(p, Meta(0, (Segment(0, 0, i, 0, 0, -1),), 0)) for i, p in enumerate(rows * 2)]
    chain = Chain(
        (
            ("tokenize_chat", TokenizeChat(tok_dir, chat_template="llama3", empty_mask="drop")),
            ("pack_flat", PackFlat(40, pad_token_id=0)),
        )
    )
    assert_chunking_invariance(chain, records, [1, 4, 7])
    assert_checkpoint_equivalence(chain, [records[:3], records[3:5], records[5:]])


# -- packing and training tensors -----------------------------------------------------------------------------------


def test_packed_chat_records_give_labels_only_on_replies(tok_dir, tok):
    rows = [CONVERSATIONS[k] for k in sorted(CONVERSATIONS)] * 3
    op = TokenizeChat(tok_dir, chat_template="chatml")
    docs = [r[0] for r in op.apply_many(rows)]
    pipe = Pipeline(rows).add(op).pack_flat(48, pad_token_id=0).batch(2, drop_last=False)
    seen_rows = 0
    supervised = 0
    for batch in pipe:
        out = batch.to_training(return_labels=True, dtype=np.int64)
        assert isinstance(batch, SampleBatch)
        for i, rec in enumerate(batch.records):
            ids, mask, pos = rec.payload["input_ids"], rec.payload["loss_mask"], rec.payload["positions"]
            real = np.arange(len(ids)) < len(ids) - rec.meta.padding_length
            target_ok = (mask[1:] == 1) & real[1:] & real[:-1]
            expected = np.where(target_ok, ids[1:], -100)
            assert out["labels"][i].tolist() == expected.tolist()
            # A document start is never a target: the prediction across documents is masked.
            assert (out["labels"][i][pos[1:] == 0] == -100).all()
            supervised += int((out["labels"][i] != -100).sum())
            seen_rows += 1
    assert seen_rows >= 2
    # Every supervised token is a label, except those that begin a packed row (nothing predicts them).
    total = sum(int(d["loss_mask"].sum()) for d in docs)
    assert total - seen_rows <= supervised <= total


# -- prompt / completion ----------------------------------------------------------------------------------------------


def test_prompt_completion_masks(tok_dir, tok):
    op = TokenizePromptCompletion(tok_dir)
    handle = op.handle
    records = [
        {"prompt": "What is 2 + 2?", "completion": " 2 + 2 = 4."},
        {"prompt": "Translate café:", "completion": " coffee ☕"},
    ]
    results = op.apply_many(records)
    for rec, [out] in zip(records, results):
        p, c = handle.encode_batch([rec["prompt"], rec["completion"]])
        assert out["input_ids"].tolist() == [handle.bos_token_id, *p.tolist(), *c.tolist(), handle.eos_token_id]
        assert out["loss_mask"].tolist() == [0] * (1 + len(p)) + [1] * (len(c) + 1)
        assert runs(tok, out["input_ids"], out["loss_mask"]) == [rec["completion"] + "<|endoftext|>"]


def test_prompt_completion_options(tok_dir):
    rec = {"q": "", "a": "Hello world"}
    op = TokenizePromptCompletion(tok_dir, prompt_field="q", completion_field="a", special_tokens="none")
    [[out]] = op.apply_many([rec])
    assert out["loss_mask"][0] == 0 and out["loss_mask"][1:].all()  # the first token is never a target
    with pytest.raises(ValueError, match="completion is empty and no EOS is added.*empty_mask='drop'"):
        op.apply_many([{"q": "Hi", "a": ""}])
    dropping = TokenizePromptCompletion(tok_dir, prompt_field="q", completion_field="a", special_tokens="none", empty_mask="drop")
    assert dropping.apply_many([{"q": "Hi", "a": ""}, rec])[0] == []
    [[eos_only]] = TokenizePromptCompletion(tok_dir, special_tokens="eos").apply_many([{"prompt": "Hi", "completion": ""}])
    assert eos_only["loss_mask"].tolist()[-1] == 1 and eos_only["loss_mask"].sum() == 1
    long = {"prompt": "one two three four five", "completion": "six seven eight nine ten"}
    [[full]] = TokenizePromptCompletion(tok_dir).apply_many([long])
    [[cut]] = TokenizePromptCompletion(tok_dir, max_length=len(full["input_ids"]) - 2, truncation=True).apply_many([long])
    assert np.array_equal(cut["input_ids"], full["input_ids"][:-2]) and np.array_equal(cut["loss_mask"], full["loss_mask"][:-2])
    with pytest.raises(ValueError, match="more than max_length"):
        TokenizePromptCompletion(tok_dir, max_length=4).apply_many([long])
    with pytest.raises(ValueError, match="no field 'prompt'"):
        TokenizePromptCompletion(tok_dir).apply_many([{"completion": "x"}])
    with pytest.raises(ValueError, match="special_tokens='none', which adds no BOS"):
        TokenizePromptCompletion(tok_dir, special_tokens="none", bos_token_id=1)


def test_prompt_completion_one_tokenizer_call(tok_dir, monkeypatch):
    calls = []
    real = TokenizerHandle.encode_batch

    def counting(self, texts, **kw):
        calls.append(len(texts))
        return real(self, texts, **kw)

    monkeypatch.setattr(TokenizerHandle, "encode_batch", counting)
    op = TokenizePromptCompletion(tok_dir)
    op.apply_many([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)])
    assert calls == [10]
    assert pickle.loads(pickle.dumps(op)) == op


# -- property: both span sources give the exact replies on random conversations --------------------------------------

_words = st.text(alphabet="abcdefgh xyz.,!?é😀\n", min_size=1, max_size=30).map(str.strip).filter(bool)


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_words)})
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(_words)})
        messages.append({"role": "assistant", "content": draw(_words)})
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(_words)})
    return messages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), template=st.sampled_from(sorted(BUILTIN_TEMPLATES)))
def test_random_conversations(ops, tok, messages, template):
    payload = {"messages": messages}
    tagged = one(ops[template]["tags"], payload)
    assert runs(tok, tagged["input_ids"], tagged["loss_mask"]) == expected_replies(template, messages)
    for source in ("prefix", "plain"):
        other = one(ops[template][source], payload)
        assert np.array_equal(other["input_ids"], tagged["input_ids"])
        assert np.array_equal(other["loss_mask"], tagged["loss_mask"])
