"""Every operator in the library passes the same checkpoint checks (the conformance registry).

Adding an operator: add an entry to ``REGISTRY`` with a factory and its input. The checks run
``zephon.testing.assert_checkpoint_equivalence`` (stop and restore at every step boundary,
through JSON) and chunking invariance on it. A factory receives :class:`Tokenizers`, the folders
of two small tokenizers trained here: one for plain text and one for chat templates.
"""

import json
from typing import ClassVar, NamedTuple

import numpy as np
import pytest

from _util import CHAT_SPECIALS, WORDS, Holds, docs, text_records, texts, train_bytelevel
from zephon import ops
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance
from zephon.types import Meta, Record, Segment



class Tokenizers(NamedTuple):
    text: str  # byte-level BPE with <|bos|> and <|endoftext|>
    chat: str  # byte-level BPE with CHAT_SPECIALS, BOS <|begin_of_text|>, EOS <|endoftext|>


def train_chat_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=CHAT_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(300) + ["system user assistant"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    text = train_bytelevel(tmp_path_factory.mktemp("tok")).parent
    chat = train_chat_tokenizer(tmp_path_factory.mktemp("chat-tok"))
    return Tokenizers(str(text), str(chat))


def _lengths():
    return [3, 5, 2, 7, 4, 1, 6, 9, 2, 11, 0, 8, 3]


def double(payload):
    return {"input_ids": payload["input_ids"] * 2}


def is_even_length(payload):
    return len(payload["input_ids"]) % 2 == 0


def _records(payloads):
    return [Record(p, Meta(0, (Segment(0, 0, i, 0, 0, -1),), 0)) for i, p in enumerate(payloads)]


def _conversations(n=12):
    """Conversations of one to three exchanges, some with a system turn, every fifth without a reply."""
    words = texts(3 * n, seed=1)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for j in range(1 + i % 3):
            messages.append({"role": "user", "content": words[(3 * i + j) % len(words)] or "hi"})
            if i % 5 != 4 or j < i % 3:
                messages.append({"role": "assistant", "content": WORDS[(i + j) % len(WORDS)] + " " + words[(3 * i + j + 1) % len(words)]})
        out.append({"messages": messages})
    return _records(out)


def _prompt_completions(n=12):
    words = texts(2 * n, seed=2)
    return _records([{"prompt": words[2 * i], "completion": words[2 * i + 1]} for i in range(n)])


def _masked(lengths):
    return [
        r.__class__({**r.payload, "loss_mask": (np.arange(len(r.payload["input_ids"])) % 2).astype(np.uint8)}, r.meta)
        for r in docs(lengths)
    ]


REGISTRY = {
    "map": (lambda tok: ops.MapOp(double), lambda: docs(_lengths())),
    "filter": (lambda tok: ops.FilterOp(is_even_length), lambda: docs(_lengths())),
    "tokenize": (lambda tok: ops.Tokenize(tokenizer=tok.text, special_tokens="eos"), lambda: text_records(texts(12))),
    "tokenize_split": (
        lambda tok: ops.Tokenize(tokenizer=tok.text, special_tokens="bos_eos", max_length=8, split_long_samples=True),
        lambda: text_records(texts(12)),
    ),
    "tokenize_chat_chatml": (
        lambda tok: ops.TokenizeChat(tok.chat, chat_template="chatml", empty_mask="drop"),
        _conversations,
    ),
    "tokenize_chat_llama3_prefix_truncated": (
        lambda tok: ops.TokenizeChat(
            tok.chat, chat_template="llama3", span_source="prefix", loss_scope="last_assistant", max_length=100,
            truncation=True, empty_mask="drop",
        ),
        _conversations,
    ),
    "tokenize_prompt_completion": (lambda tok: ops.TokenizePromptCompletion(tok.chat), _prompt_completions),
    "tokenize_prompt_completion_truncated": (
        lambda tok: ops.TokenizePromptCompletion(tok.chat, special_tokens="eos", max_length=40, truncation=True, empty_mask="drop"),
        _prompt_completions,
    ),
    "pack_flat_wrap": (lambda tok: ops.PackFlat(8), lambda: docs(_lengths())),
    "pack_flat_wrap_padded": (lambda tok: ops.PackFlat(8, pad_token_id=0), lambda: _masked(_lengths())),
    "shuffle": (lambda tok: ops.Shuffle(5, seed=3), lambda: docs(_lengths())),
    "order_by": (lambda tok: ops.OrderBy(ops.token_count, window=4), lambda: docs(_lengths())),
    "order_by_reverse_drained": (
        lambda tok: ops.OrderBy(ops.token_count, window=5, reverse=True, drains=(3, 9)), lambda: docs(_lengths())
    ),
    "batch": (lambda tok: ops.Batch(3, drop_last=False), lambda: docs(_lengths())),
    "batch_grouped": (lambda tok: ops.Batch(2, group_by_length=True, buffer_size=4, drop_last=False), lambda: docs(_lengths())),
    "batch_max_tokens": (lambda tok: ops.Batch(max_tokens=12, drop_last=False), lambda: docs(_lengths())),
    "batch_max_tokens_sorted": (
        lambda tok: ops.Batch(max_tokens=16, sort_window=4, pad_to_multiple_of=4), lambda: docs(_lengths())
    ),
    "chain": (
        lambda tok: ops.Chain((("pack", ops.PackFlat(6, pad_token_id=0)), ("shuffle", ops.Shuffle(4)), ("batch", ops.Batch(2)))),
        lambda: docs(_lengths()),
    ),
}


for _algo, _extra in (
    ("first_fit", {"num_bins": 2}),
    ("best_fit", {"num_bins": 2}),
    ("best_fit_wrap", {"candidate_pool_size": 3}),
):
    REGISTRY[f"pack_flat_{_algo}"] = (
        lambda tok, algo=_algo, extra=_extra: ops.PackFlat(8, algorithm=algo, pad_token_id=0, **extra),
        lambda: _masked(_lengths()),
    )
REGISTRY["pack_flat_wrap_capped"] = (lambda tok: ops.PackFlat(8, max_sequences_per_bin=2, pad_token_id=0), lambda: docs(_lengths()))
def _two_datasets():
    recs = docs(_lengths())
    return [r.__class__(r.payload, Meta(0, (Segment(int(i % 3 == 0), 0, i, 0, 0, -1),), 0)) for i, r in enumerate(recs)]


REGISTRY["ensure_mixture"] = (lambda tok: ops.EnsureMixture({"a": 1, "b": 1}, datasets=("a", "b"), max_buffer_size=4), _two_datasets)
REGISTRY["pack_sequences"] = (lambda tok: ops.PackSequences(8, algorithm="first_fit", num_bins=2), lambda: docs(_lengths()))
REGISTRY["pack_sequences_wrap"] = (lambda tok: ops.PackSequences(8), lambda: docs(_lengths()))


def _chunkings(records):
    n = len(records)
    return [
        [records],
        [records[i : i + 1] for i in range(n)],
        [records[:3], [], records[3:7], records[7:]],
    ]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_checkpoint_equivalence(name, tokenizer):
    make_op, make_input = REGISTRY[name]
    op = make_op(tokenizer)
    for chunks in _chunkings(make_input()):
        assert_checkpoint_equivalence(op, chunks, key=11)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_chunking_invariance(name, tokenizer):
    make_op, make_input = REGISTRY[name]
    records = make_input()
    for cuts in ([1], [2, 5], [4, 6, 9], list(range(1, len(records)))):
        assert_chunking_invariance(make_op(tokenizer), records, cuts, key=5)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_fingerprint_is_stable_and_json_friendly(name, tokenizer):
    import json

    make_op, _ = REGISTRY[name]
    a, b = make_op(tokenizer).fingerprint(), make_op(tokenizer).fingerprint()
    assert a == b
    json.dumps(a)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_operators_pickle(name, tokenizer):
    import pickle

    from zephon.testing import outputs_equal, run

    make_op, make_input = REGISTRY[name]
    op = make_op(tokenizer)
    clone = pickle.loads(pickle.dumps(op))
    assert outputs_equal(run(op, [make_input()])[1], run(clone, [make_input()])[1])


class _FlushesForever(Holds):
    """Hands out what it holds at the end and returns the state it was given: it would never end."""

    kind: ClassVar[str] = "flushes_forever"

    def flush(self, state):
        return state, list(state.records)


def test_a_flush_that_keeps_its_state_is_refused_naming_the_operator():
    from zephon.core.operator import Chain
    from zephon.testing import run

    records = docs([3, 4])
    chain = Chain((("forever", _FlushesForever()),))
    state, _ = chain.step(chain.init(0), records)
    with pytest.raises(ValueError, match="operator 'forever': flush returned 2 outputs and the state it was given"):
        chain.flush(state)
    with pytest.raises(AssertionError, match="flushes_forever: flush returned outputs and the state it was given"):
        run(_FlushesForever(), [records])
