"""Operators are values: ``attrs.evolve(op, **changes)`` is the constructor with changed arguments.

For every operator exported by ``zephon.ops``, hypothesis draws a valid configuration (the
keyword arguments ``given``) and ``changes`` (valid or not), then compares
``attrs.evolve(type(op)(**given), **changes)`` with ``type(op)(**{**given, **changes})``: both
raise the same exception type, or both succeed with equal fields, equal ``fingerprint()`` and
equal outputs on a few records. The same holds after the operator went through pickle (as it
does to spawned workers). Configurations are normalised in converters and factories, never
rewritten after construction; a source check keeps it that way.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

pytest.importorskip("jinja2")

import zephon  # noqa: E402
import zephon.ops  # noqa: E402
from zephon.ops import (  # noqa: E402
    Batch,
    Chain,
    EnsureMixture,
    FilterOp,
    MapOp,
    Operator,
    OrderBy,
    PackFlat,
    PackSequences,
    Shuffle,
    StatelessOp,
    Tokenize,
    TokenizeChat,
    TokenizePromptCompletion,
)
from zephon.text.templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE, strip_generation_tags  # noqa: E402
from zephon.text.tokenizer import TokenizerLoadError, load_tokenizer  # noqa: E402
from zephon.testing import outputs_equal, run  # noqa: E402
from zephon.types import Meta, Record, Segment  # noqa: E402
from _util import CHAT_SPECIALS  # noqa: E402

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)

WORDS = "the quick brown fox jumps over a lazy dog while system user assistant answers questions about numbers".split()
TEXTS = [
    "the quick brown fox",
    "a lazy dog sleeps while the fox jumps over it again and again",
    "",
    "numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
    "assistant answers the user",
]
CONVERSATIONS = [
    [{"role": "user", "content": "what is the fox?"}, {"role": "assistant", "content": "a quick brown fox."}],
    [
        {"role": "system", "content": "answer about numbers"},
        {"role": "user", "content": "1 2 3?"},
        {"role": "assistant", "content": "4 5 6."},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "7 8 9 10 11 12, the lazy dog."},
    ],
    [{"role": "user", "content": "jumps?"}, {"role": "assistant", "content": "over the dog"}, {"role": "user", "content": "ok"}],
]
PROMPTS = [
    {"prompt": "the quick", "completion": " brown fox", "q": "a", "a": " dog"},
    {"prompt": "numbers 1 2 3", "completion": " 4 5 6 7 8 9", "q": "", "a": " over"},
    {"prompt": "", "completion": "", "q": "user", "a": " assistant answers"},
]


def records(payloads: list) -> list[Record]:
    return [Record(p, Meta(0, (Segment(0, 0, i, 0, 0, -1),))) for i, p in enumerate(payloads)]


def token_docs(lengths=(3, 5, 2, 7, 4, 1, 6, 9, 0, 11, 3)) -> list[Record]:
    return records([{"input_ids": np.arange(100 * i, 100 * i + n, dtype=np.int32)} for i, n in enumerate(lengths)])


# -- module-level callables (operators pickle them by reference) ------------------------------------------------


def double_ids(payload):
    return {"input_ids": payload["input_ids"] * 2}


def same_payload(payload):
    return payload


def drop_short(payload):
    return payload if len(payload["input_ids"]) > 3 else None


def even_length(payload):
    return len(payload["input_ids"]) % 2 == 0


def nonempty(payload):
    return len(payload["input_ids"]) > 0


# -- tokenizers ------------------------------------------------------------------------------------------------


class Env(NamedTuple):
    a: Path  # bos <|bos|>, eos <|endoftext|>, ships ChatML
    b: Path  # bos <|begin_of_text|>, eos <|eot_id|>, ships Llama 3
    c: Path  # no bos, eos <|endoftext|>, no template
    template_file: Path  # ChatML without generation tags, as a .jinja file
    tok: Any  # a tokenizers.Tokenizer object (ids guessed, no template)
    handle_b: Any  # a TokenizerHandle of b (no template)

    def sources(self) -> list[dict]:
        """Ways to give a tokenizer, each as constructor keywords."""
        return [
            {"tokenizer": str(self.a)},
            {"tokenizer": self.a / "tokenizer.json"},
            {"tokenizer_id": str(self.a)},
            {"tokenizer": str(self.b)},
            {"tokenizer": self.tok},
            {"tokenizer": self.handle_b},
            {"tokenizer": str(self.c)},
            {"tokenizer_id": str(self.c)},
        ]

    def tokenizer_changes(self) -> list[dict]:
        return self.sources() + [
            {"tokenizer": str(self.b), "tokenizer_id": None},
            {"tokenizer_id": str(self.b)},
            {"tokenizer_id": None},
            {"tokenizer": None, "tokenizer_id": str(self.a)},
        ]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=CHAT_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = TEXTS + [json.dumps(c) for c in CONVERSATIONS] + [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus * 5, trainer)
    root = tmp_path_factory.mktemp("operator-values")
    configs = {
        "a": {"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE},
        "b": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
        "c": {"bos_token": None, "eos_token": "<|endoftext|>"},
    }
    for name, config in configs.items():
        (root / name).mkdir()
        tok.save(str(root / name / "tokenizer.json"))
        (root / name / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    template_file = root / "plain_chatml.jinja"
    template_file.write_text(strip_generation_tags(CHATML_TEMPLATE), encoding="utf-8")
    return Env(root / "a", root / "b", root / "c", template_file, tok, load_tokenizer(root / "b"))


# -- strategies: a valid configuration and changes per operator -------------------------------------------------

INVALID = st.sampled_from([0, -1, True, "2", 2.5])


def maybe(strategy):
    return st.one_of(st.none(), strategy)


def changes_of(draw, options: dict[str, Any], *, min_size: int = 1) -> dict[str, Any]:
    """A subset of ``options`` (name -> strategy), each drawn."""
    names = draw(st.lists(st.sampled_from(sorted(options)), min_size=min_size, max_size=4, unique=True))
    return {n: draw(options[n]) for n in names}


def with_tokenizer_change(draw, env, options: dict[str, Any]) -> dict[str, Any]:
    """Changes of ``options``, and half the time of the tokenizer (``tokenizer=`` and/or ``tokenizer_id=``)."""
    if not draw(st.booleans()):
        return changes_of(draw, options)
    return {**changes_of(draw, options, min_size=0), **draw(st.sampled_from(env.tokenizer_changes()))}


def batch_given(draw, env):
    mbs = draw(st.integers(1, 4))
    grouped = draw(st.booleans())
    out = {"microbatch_size": mbs, "drop_last": draw(st.booleans()), "group_by_length": grouped}
    if grouped and draw(st.booleans()):
        out["buffer_size"] = mbs * draw(st.integers(1, 3))
    if draw(st.booleans()):
        out["pad_token_id"] = draw(st.integers(0, 9))
    return out


def batch_changes(draw, env):
    return changes_of(
        draw,
        {
            "microbatch_size": st.one_of(st.integers(1, 4), INVALID),
            "drop_last": st.booleans(),
            "group_by_length": st.booleans(),
            "buffer_size": maybe(st.one_of(st.integers(1, 8), INVALID)),
            "pad_token_id": maybe(st.integers(0, 9)),
        },
    )


def shuffle_given(draw, env):
    return {"buffer_size": draw(st.integers(1, 8)), "seed": draw(st.integers(0, 3))}


def shuffle_changes(draw, env):
    return changes_of(
        draw,
        {
            "buffer_size": st.one_of(st.integers(1, 8), INVALID),
            "seed": st.one_of(st.integers(0, 3), st.sampled_from(["1", np.int64(1), None])),
        },
    )


def longest_first(payload):
    return -len(payload["input_ids"])


ORDER_KEYS = [zephon.ops.token_count, even_length, "input_ids", longest_first]


def order_given(draw, env):
    return {"key": draw(st.sampled_from(ORDER_KEYS)), "window": draw(st.integers(1, 6)), "reverse": draw(st.booleans())}


def order_changes(draw, env):
    return changes_of(
        draw,
        {
            "key": st.sampled_from([*ORDER_KEYS, "", 3, None]),
            "window": st.one_of(st.integers(1, 6), INVALID),
            "reverse": st.sampled_from([True, False, 1, "no"]),
            "key_fingerprint": st.sampled_from([None, "v1", 1]),
            "drains": st.sampled_from([(), (2,), (3, 1)]),
        },
    )


def ensure_given(draw, env):
    return {
        "mixture": {"a": draw(st.integers(1, 4)), "b": draw(st.integers(0, 4))},
        "datasets": ("a", "b"),
        "max_buffer_size": draw(st.integers(1, 8)),
        "weight_by": draw(st.sampled_from(["auto", "samples"])),
        "drain_target_ratio": draw(st.sampled_from([0.5, 0.8])),
        "obsolete_drain_rate": draw(st.sampled_from([0.0, 0.25])),
    }


def ensure_changes(draw, env):
    return changes_of(
        draw,
        {
            "mixture": st.sampled_from([{"a": 1, "b": 3}, {"a": 2, "b": 0}, {"a": 1}, {"a": -1, "b": 1}]),
            "max_buffer_size": st.one_of(st.integers(1, 8), INVALID),
            "weight_by": st.sampled_from(["auto", "samples", 3]),
            "drain_target_ratio": st.sampled_from([0.3, 0.9, 1.0, 0]),
            "obsolete_drain_rate": st.sampled_from([0.0, 0.5, 1.5]),
        },
    )


def skipping_given(draw):
    """The skip settings of a per-payload operator: the default, skipping, or skipping with a bound."""
    return draw(st.sampled_from([{}, {"on_error": "skip"}, {"on_error": "skip", "max_skipped": 2}]))


def skipping_changes(draw):
    out = {}
    if draw(st.booleans()):
        out["on_error"] = draw(st.sampled_from(["raise", "skip", "ignore"]))
    if draw(st.booleans()):
        out["max_skipped"] = draw(st.sampled_from([None, 0, 3, 0.25, 1.5, -1, True]))
    return out


def map_given(draw, env):
    return {"fn": draw(st.sampled_from([double_ids, same_payload, drop_short])), **skipping_given(draw)}


def map_changes(draw, env):
    return {"fn": draw(st.sampled_from([double_ids, same_payload, drop_short])), **skipping_changes(draw)}


def filter_given(draw, env):
    return {"predicate": draw(st.sampled_from([even_length, nonempty])), **skipping_given(draw)}


def filter_changes(draw, env):
    return {"predicate": draw(st.sampled_from([even_length, nonempty])), **skipping_changes(draw)}


CHILDREN = {
    "double": MapOp(double_ids),
    "even": FilterOp(even_length),
    "short": MapOp(drop_short),
    "shuffle": Shuffle(3, seed=1),
}


def chain_children(draw, *, allow_invalid: bool):
    names = draw(st.lists(st.sampled_from(sorted(CHILDREN)), min_size=1, max_size=3, unique=not allow_invalid))
    children = [(n, CHILDREN[n]) for n in names]
    if allow_invalid and draw(st.booleans()):
        children.append(("not_an_op", double_ids))
    return draw(st.sampled_from([tuple, list]))(children)


def chain_given(draw, env):
    return {"children": chain_children(draw, allow_invalid=False)}


def chain_changes(draw, env):
    return {"children": chain_children(draw, allow_invalid=True)}


def pack_given(flat: bool):
    def draw_given(draw, env):
        algorithm = draw(st.sampled_from(["first_fit", "best_fit", "wrap", "best_fit_wrap"]))
        out: dict[str, Any] = {"max_length": draw(st.integers(2, 8)), "algorithm": algorithm}
        if algorithm in ("first_fit", "best_fit"):
            out["num_bins"] = draw(st.integers(1, 3))
            if draw(st.booleans()):
                out["min_sequence_length"] = draw(st.integers(0, 3))
        if algorithm == "best_fit_wrap" and draw(st.booleans()):
            out["candidate_pool_size"] = draw(st.integers(1, 4))
            out["max_candidate_age"] = draw(maybe(st.integers(1, 8)))
        if draw(st.booleans()):
            out["max_sequences_per_bin"] = draw(st.integers(1, 3))
        policy = draw(st.sampled_from(["default", "oversized", "drop_oversized"]))
        if policy == "oversized":
            out["oversized"] = draw(st.sampled_from(["split", "drop", "truncate"]))
        elif policy == "drop_oversized":
            out["drop_oversized"] = draw(st.booleans()) if algorithm in ("first_fit", "best_fit") else False
        if flat:
            if algorithm != "wrap" or "max_sequences_per_bin" in out or draw(st.booleans()):
                out["pad_token_id"] = draw(st.integers(0, 3))
            out["emit_positions"] = draw(st.booleans())
        return out

    return draw_given


def pack_changes(flat: bool):
    def draw_changes(draw, env):
        options = {
            "max_length": st.one_of(st.integers(1, 8), INVALID),
            "algorithm": st.sampled_from(["first_fit", "best_fit", "wrap", "best_fit_wrap", "next_fit"]),
            "num_bins": maybe(st.one_of(st.integers(1, 3), INVALID)),
            "max_sequences_per_bin": maybe(st.integers(0, 3)),
            "min_sequence_length": st.integers(-1, 3),
            "oversized": maybe(st.sampled_from(["split", "drop", "truncate", "error", "wrap"])),
            "drop_oversized": maybe(st.sampled_from([True, False, 1])),
            "candidate_pool_size": maybe(st.integers(0, 4)),
            "max_candidate_age": maybe(st.integers(0, 8)),
            "tokens_field": st.sampled_from(["auto", "input_ids", "", "tokens"]),
            "pad_token_id": maybe(st.integers(-1, 3)),
        }
        if flat:
            options["emit_positions"] = st.sampled_from([True, False, 1])
        changes = changes_of(draw, options)
        # Known past failures, drawn often: first_fit -> wrap kept oversized="drop", and
        # best_fit_wrap -> wrap raised over the pool settings it had filled in.
        if draw(st.integers(0, 3)) == 0:
            changes.update(algorithm="wrap", num_bins=None)
        return changes

    return draw_changes


def tokenize_given(draw, env):
    out = dict(draw(st.sampled_from(env.sources())))
    out["field"] = draw(st.sampled_from(["text", "body"]))
    out["special_tokens"] = mode = draw(st.sampled_from(["bos_eos", "bos", "eos", "none"]))
    if mode != "none" and draw(st.booleans()):
        out["bos_token_id" if mode == "bos" else "eos_token_id"] = draw(st.sampled_from([0, 1, np.int64(3)]))
    cut = draw(st.sampled_from(["none", "truncation", "split"]))
    if cut != "none":
        out["max_length"] = draw(st.sampled_from([3, 5, np.int64(4), 8]))
        out["truncation" if cut == "truncation" else "split_long_samples"] = True
    for name in ("missing_field", "preserve_upstream_payload"):
        if draw(st.booleans()):
            out[name] = draw(st.sampled_from(["empty"] if name == "missing_field" else [True]))
    if draw(st.booleans()):
        out["parallelism"] = draw(st.sampled_from([1, np.int32(2)]))
    out["backend"] = draw(st.sampled_from(["tokenizers", "auto"]))
    return out


def tokenize_changes(draw, env):
    return with_tokenizer_change(
        draw,
        env,
        {
            "field": st.sampled_from(["text", "body", "", "absent"]),
            "special_tokens": st.sampled_from(["bos_eos", "bos", "eos", "none", "tokenizer_default"]),
            "bos_token_id": maybe(st.sampled_from([1, np.int64(2), 10**6, "1", True])),
            "eos_token_id": maybe(st.sampled_from([0, np.int16(3), -1])),
            "max_length": maybe(st.sampled_from([1, 2, 4, np.int64(6), 0, True])),
            "truncation": st.sampled_from([True, False, 1]),
            "split_long_samples": st.booleans(),
            "missing_field": st.sampled_from(["error", "empty", "skip"]),
            "preserve_upstream_payload": st.booleans(),
            "parallelism": maybe(st.sampled_from([1, np.int64(2), 0])),
            "backend": st.sampled_from(["auto", "tokenizers", "fast"]),
        },
    )


TEMPLATES = ["chatml", "llama3", strip_generation_tags(CHATML_TEMPLATE), LLAMA3_TEMPLATE]


def chat_given(draw, env):
    source = dict(draw(st.sampled_from(env.sources())))
    shipped = source.get("tokenizer") in (str(env.a), env.a / "tokenizer.json", str(env.b)) or "tokenizer_id" in source
    templates = TEMPLATES + [str(env.template_file)]
    out = {**source, "chat_template": draw(maybe(st.sampled_from(templates)) if shipped else st.sampled_from(templates))}
    out["loss_scope"] = draw(st.sampled_from(["assistant", "last_assistant", "all"]))
    if draw(st.booleans()):
        out["max_length"] = draw(st.sampled_from([8, 40]))
        out["truncation"] = True
    if draw(st.booleans()):
        out["chat_template_kwargs"] = {"unused": draw(st.integers(0, 2))}
    out["empty_mask"] = draw(st.sampled_from(["error", "drop"]))
    out["span_source"] = draw(st.sampled_from(["auto", "prefix"]))
    return out


def chat_changes(draw, env):
    templates = TEMPLATES + [str(env.template_file), "chatml3", 3]
    return with_tokenizer_change(
        draw,
        env,
        {
            "field": st.sampled_from(["messages", "", "conversation"]),
            "chat_template": maybe(st.sampled_from(templates)),
            "loss_scope": st.sampled_from(["assistant", "last_assistant", "all", "last"]),
            "max_length": maybe(st.sampled_from([1, 8, 40])),
            "truncation": st.sampled_from([True, False, "yes"]),
            "tools_field": maybe(st.sampled_from(["tools", ""])),
            "chat_template_kwargs": maybe(st.sampled_from([{"unused": 1}, {"messages": []}, {1: 2}, ["x"]])),
            "empty_mask": st.sampled_from(["error", "drop", "keep"]),
            "span_source": st.sampled_from(["auto", "prefix", "generation_tags", "tags"]),
        },
    )


def prompt_completion_given(draw, env):
    out = dict(draw(st.sampled_from(env.sources())))
    if draw(st.booleans()):
        out.update(prompt_field="q", completion_field="a")
    out["special_tokens"] = mode = draw(st.sampled_from(["bos_eos", "bos", "eos", "none"]))
    if mode in ("bos_eos", "eos") and draw(st.booleans()):
        out["eos_token_id"] = draw(st.sampled_from([0, np.int64(1)]))
    if draw(st.booleans()):
        out["max_length"] = draw(st.sampled_from([3, 6]))
        out["truncation"] = draw(st.booleans())
    out["empty_mask"] = draw(st.sampled_from(["error", "drop"]))
    out["backend"] = draw(st.sampled_from(["tokenizers", "auto"]))
    return out


def prompt_completion_changes(draw, env):
    return with_tokenizer_change(
        draw,
        env,
        {
            "prompt_field": st.sampled_from(["prompt", "q", "a", ""]),
            "completion_field": st.sampled_from(["completion", "a", "q"]),
            "special_tokens": st.sampled_from(["bos_eos", "bos", "eos", "none", "tokenizer_default"]),
            "bos_token_id": maybe(st.sampled_from([1, np.int64(2), 10**6, "1"])),
            "eos_token_id": maybe(st.sampled_from([0, np.int64(3), -1])),
            "max_length": maybe(st.sampled_from([1, 3, 6, np.int64(6)])),
            "truncation": st.sampled_from([True, False, 0]),
            "empty_mask": st.sampled_from(["error", "drop", "keep"]),
            "parallelism": maybe(st.sampled_from([1, 2, 0])),
            "backend": st.sampled_from(["auto", "tokenizers", "fast"]),
        },
    )


class Case(NamedTuple):
    given: Callable  # (draw, env) -> constructor keywords of a valid operator
    changes: Callable  # (draw, env) -> keywords for attrs.evolve
    inputs: Callable[[], list[Record]]


def text_records() -> list[Record]:
    return records([{"text": t, "body": t[::-1]} for t in TEXTS])


def chat_records() -> list[Record]:
    return records([{"messages": c} for c in CONVERSATIONS])


def prompt_records() -> list[Record]:
    return records(PROMPTS)


CASES: dict[type, Case] = {
    Batch: Case(batch_given, batch_changes, token_docs),
    Chain: Case(chain_given, chain_changes, token_docs),
    EnsureMixture: Case(ensure_given, ensure_changes, token_docs),
    FilterOp: Case(filter_given, filter_changes, token_docs),
    MapOp: Case(map_given, map_changes, token_docs),
    OrderBy: Case(order_given, order_changes, token_docs),
    PackFlat: Case(pack_given(True), pack_changes(True), token_docs),
    PackSequences: Case(pack_given(False), pack_changes(False), token_docs),
    Shuffle: Case(shuffle_given, shuffle_changes, token_docs),
    Tokenize: Case(tokenize_given, tokenize_changes, text_records),
    TokenizeChat: Case(chat_given, chat_changes, chat_records),
    TokenizePromptCompletion: Case(prompt_completion_given, prompt_completion_changes, prompt_records),
}


# -- the law ---------------------------------------------------------------------------------------------------


def attempt(make: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return make(), None
    except Exception as exc:  # the law compares failures too
        return None, exc


def outcome_of(op: Operator, inputs: list[Record]) -> tuple[Any, BaseException | None]:
    """All outputs over two chunks (and the flush), or the exception raised."""
    return attempt(lambda: run(op, [inputs[:2], inputs[2:]], key=7)[1])


def assert_same_operator(a: Operator, b: Operator, inputs: list[Record], what: str) -> None:
    assert a == b, f"{what}: {a!r} != {b!r}"
    assert a.fingerprint() == b.fingerprint(), what
    (out_a, err_a), (out_b, err_b) = outcome_of(a, inputs), outcome_of(b, inputs)
    assert type(err_a) is type(err_b), f"{what}: running raised {err_a!r} vs {err_b!r}"
    if err_a is None:
        assert outputs_equal(out_a, out_b), what


def check_law(cls: type, given_kwargs: dict, changes: dict, inputs: list[Record]) -> None:
    op = cls(**given_kwargs)
    assert_same_operator(attrs.evolve(op), op, inputs, "attrs.evolve without changes")
    expected, expected_error = attempt(lambda: cls(**{**given_kwargs, **changes}))
    for label, base in (("evolve", op), ("evolve after pickle", pickle.loads(pickle.dumps(op)))):
        got, error = attempt(lambda: attrs.evolve(base, **changes))
        what = f"{label}: {cls.__name__}({given_kwargs}) with {changes}"
        assert type(error) is type(expected_error), f"{what}: raised {error!r}, the constructor {expected_error!r}"
        if error is None:
            assert_same_operator(got, expected, inputs, what)


@pytest.mark.parametrize("cls", sorted(CASES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_evolve_equals_the_constructor(env, cls, data):
    case = CASES[cls]
    given_kwargs = data.draw(st.composite(lambda draw: case.given(draw, env))(), label="given")
    changes = data.draw(st.composite(lambda draw: case.changes(draw, env))(), label="changes")
    try:
        cls(**given_kwargs)
    except ValueError:  # a few drawn combinations are contradictory (e.g. a tokenizer without BOS)
        reject()
    check_law(cls, given_kwargs, changes, case.inputs())


def test_every_exported_operator_is_covered():
    bases = {Operator, StatelessOp}  # the protocol itself, not operators
    exported = [getattr(zephon.ops, name) for name in zephon.ops.__all__]
    operators = {x for x in exported if isinstance(x, type) and issubclass(x, Operator) and x not in bases}
    assert operators == set(CASES), f"add strategies for {sorted(c.__name__ for c in operators - set(CASES))}"


# -- known cases -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls,extra", [(PackFlat, {"pad_token_id": 0}), (PackSequences, {})], ids=["flat", "sequences"])
def test_first_fit_to_wrap_takes_wraps_oversized_default(cls, extra):
    op = cls(8, algorithm="first_fit", num_bins=2, **extra)
    assert op.oversized_policy == "drop"
    wrapped = attrs.evolve(op, algorithm="wrap", num_bins=None)
    assert wrapped.oversized_policy == "split"
    assert_same_operator(wrapped, cls(8, algorithm="wrap", **extra), token_docs(), "first_fit -> wrap")


@pytest.mark.parametrize("cls,extra", [(PackFlat, {"pad_token_id": 0}), (PackSequences, {})], ids=["flat", "sequences"])
def test_best_fit_wrap_to_wrap_does_not_raise(cls, extra):
    op = cls(8, algorithm="best_fit_wrap", **extra)
    assert op.fingerprint()["candidate_pool_size"] == 1024
    wrapped = attrs.evolve(op, algorithm="wrap")
    assert "candidate_pool_size" in wrapped.fingerprint() and wrapped.fingerprint()["candidate_pool_size"] is None
    assert_same_operator(wrapped, cls(8, algorithm="wrap", **extra), token_docs(), "best_fit_wrap -> wrap")


def test_numpy_ints_are_stored_as_int(env):
    op = Tokenize(env.a, max_length=np.int64(6), truncation=True, parallelism=np.int32(2), eos_token_id=np.int16(0))
    assert [type(x) for x in (op.max_length, op.parallelism, op.eos_token_id)] == [int, int, int]
    assert type(attrs.evolve(op, bos_token_id=np.int64(1)).bos_token_id) is int
    pc = TokenizePromptCompletion(env.a, bos_token_id=np.int64(1))
    assert type(pc.bos_token_id) is int and pc == TokenizePromptCompletion(env.a, bos_token_id=1)


def test_evolve_reuses_the_handle_and_tokenizer_id_stays_exclusive(env):
    op = Tokenize(tokenizer_id=str(env.a))
    assert op.tokenizer_id is None and attrs.evolve(op, special_tokens="eos").tokenizer is op.tokenizer
    # tokenizer_id keeps its meaning: a new id replaces the tokenizer ...
    swapped = attrs.evolve(op, tokenizer_id=str(env.b))
    assert swapped == Tokenize(tokenizer_id=str(env.b)) and swapped.tokenizer.bos_token_id != op.tokenizer.bos_token_id
    # ... and, as in the constructor, tokenizer= cannot join the tokenizer_id the operator was built with.
    with pytest.raises(TokenizerLoadError, match="not both"):
        attrs.evolve(op, tokenizer=env.tok)
    assert attrs.evolve(op, tokenizer=env.tok, tokenizer_id=None) == Tokenize(env.tok)
    with pytest.raises(TokenizerLoadError, match="not both"):
        attrs.evolve(Tokenize(env.tok), tokenizer_id=str(env.a))


def test_a_shipped_template_follows_the_tokenizer_and_a_given_one_stays(env):
    shipped = TokenizeChat(env.a)
    assert shipped.chat_template == CHATML_TEMPLATE
    follows = attrs.evolve(shipped, tokenizer=str(env.b))
    assert follows.chat_template == LLAMA3_TEMPLATE and follows == TokenizeChat(env.b)
    with pytest.raises(ValueError, match="no chat template given"):
        attrs.evolve(shipped, tokenizer=env.tok)  # a tokenizers.Tokenizer ships none, as TokenizeChat(env.tok) says
    given_one = TokenizeChat(env.a, chat_template="chatml")
    assert attrs.evolve(given_one, tokenizer=str(env.b)).chat_template == CHATML_TEMPLATE


def test_evolve_needs_no_files_after_pickling(env, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(env.a, folder)
    op = TokenizeChat(folder, chat_template="llama3")
    blob = pickle.dumps(op)
    shutil.rmtree(folder)
    back = pickle.loads(blob)
    # chat_template=None asks for the template shipped with the tokenizer: looked up when it was built.
    assert attrs.evolve(back, chat_template=None).chat_template == CHATML_TEMPLATE
    assert attrs.evolve(back, loss_scope="all") == attrs.evolve(op, loss_scope="all")
    assert attrs.evolve(back, loss_scope="all").spans_from == "none"


def test_no_configuration_is_rewritten_after_construction():
    package = Path(zephon.__file__).parent
    for name in ("ops/pack.py", "ops/tokenize.py", "ops/chat.py", "ops/batch.py", "ops/shuffle.py", "ops/order.py",
                 "core/operator.py"):
        assert "object.__setattr__" not in (package / name).read_text(encoding="utf-8"), name


def test_a_template_given_with_a_new_tokenizer_stays_even_when_it_equals_the_old_shipped_one(env):
    # Found by the law above: the template shipped with b, given again (an equal text, not the
    # operator's own) together with another tokenizer, is a given template, as in the constructor.
    op = TokenizeChat(str(env.b))
    given = json.loads((env.b / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert given == op.chat_template and given is not op.chat_template
    for base in (op, pickle.loads(pickle.dumps(op))):
        evolved = attrs.evolve(base, tokenizer=str(env.a), chat_template=given)
        assert evolved == TokenizeChat(str(env.a), chat_template=given)
        assert evolved.chat_template == given
        # Passed through unchanged (the operator's own text), the shipped template follows the tokenizer.
        assert attrs.evolve(base, tokenizer=str(env.a)) == TokenizeChat(str(env.a))
