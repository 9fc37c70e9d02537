"""Tokenizer resolution (``zephon.text.tokenizer``) and the ``tokenize`` operator (``zephon.ops.tokenize``).

Two tokenizers are trained here (a whitespace BPE with [PAD]/[BOS]/[EOS]/[UNK] and a GPT-2 style
byte-level BPE); the real GPT-2 tokenizer and corpus under ``<repo>/../shared/data`` are used when
present (their tests skip without them, and fail under ``CI=true``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from _shared import SHARED, shared_path
from zephon.core.cache import ProcessCache
from zephon.core.operator import CHILD_BASE, EMPTY, sample_meta
from zephon.core.records import Record
from zephon.text.tiktoken_encoding import _verification_texts, _verify_tiktoken
from zephon.ops.tokenize import Tokenize
from zephon.text.tokenizer import TokenizerHandle, TokenizerLoadError, load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "a",
    "Tokenizers turn text into ids; zephon brackets them with BOS and EOS.",
    "numbers 123 4567 and symbols !? and a longer sentence that goes on for a while to be long",
]


def _corpus_lines() -> list[str]:
    words = "the of and to in is it that for on with as was by this be are from at an not have or".split()
    out = []
    for i in range(400):
        out.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12 + i % 9)) + f" {i} tokens.")
    out += TEXTS
    return out


@pytest.fixture(scope="session")
def small_tok() -> Tokenizer:
    """A whitespace BPE with [PAD]=0, [BOS]=1, [EOS]=2, [UNK]=3 (not byte-level)."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def small_dir(small_tok, tmp_path_factory) -> Path:
    """A folder with tokenizer.json and a tokenizer_config.json naming the specials."""
    folder = tmp_path_factory.mktemp("small_tok")
    small_tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "[BOS]",
        "eos_token": {"__type": "AddedToken", "content": "[EOS]", "lstrip": False},
        "pad_token": "[PAD]",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def bytelevel_tok() -> Tokenizer:
    """A GPT-2 style byte-level BPE, eligible for the tiktoken fast path."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines() + _verification_texts(), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def gpt2_file() -> Path:
    return shared_path("data", "gpt2", "tokenizer.json")


@pytest.fixture(scope="session")
def gpt2_handles(gpt2_file):
    """(tokenizers backend, tiktoken backend) handles of the bare GPT-2 tokenizer.json."""
    return load_tokenizer(gpt2_file, backend="tokenizers"), load_tokenizer(gpt2_file, backend="tiktoken")


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def tid(tok: Tokenizer, token: str) -> int:
    return tok.token_to_id(token)


# -- loading: every form ---------------------------------------------------------------------------


def test_load_tokenizer_object_guesses_specials(small_tok):
    h = load_tokenizer(small_tok)
    assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (1, 2, 0)
    assert h.backend == "tokenizers"
    out = h.encode_batch(TEXTS)
    assert all(a.dtype == np.int32 and a.flags.writeable for a in out)
    assert [a.tolist() for a in out] == [ids_of(small_tok, t) for t in TEXTS]


def test_load_backend_tokenizer_wrapper_uses_its_ids(small_tok):
    class FastTokenizer:  # the shape of a transformers fast tokenizer
        backend_tokenizer = small_tok
        name_or_path = "my/model"
        bos_token_id = 3
        eos_token_id = 2
        pad_token_id = None

    h = load_tokenizer(FastTokenizer())
    assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (3, 2, None)
    assert "my/model" in h.source

    class Bare:
        backend_tokenizer = small_tok

    h = load_tokenizer(Bare())
    assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (1, 2, 0)


def test_load_file_and_folder(small_tok, small_dir):
    from_file = load_tokenizer(str(small_dir / "tokenizer.json"))
    from_path = load_tokenizer(small_dir / "tokenizer.json")
    from_folder = load_tokenizer(str(small_dir))
    from_id = load_tokenizer(tokenizer_id=str(small_dir))
    for h in (from_file, from_path, from_folder, from_id):
        assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (1, 2, 0)
        assert [a.tolist() for a in h.encode_batch(TEXTS)] == [ids_of(small_tok, t) for t in TEXTS]
    # Content and ids decide the fingerprint, not the way the tokenizer was passed.
    assert len({h.fingerprint() for h in (from_file, from_path, from_folder, from_id, load_tokenizer(small_tok))}) == 1


def test_folder_config_decides_ids(small_tok, tmp_path):
    small_tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "[UNK]", "eos_token": "[UNK]", "pad_token": None})
    )
    h = load_tokenizer(tmp_path)
    assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (3, 3, None)
    # special_tokens_map.json wins over tokenizer_config.json, as in transformers.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "[EOS]"}}))
    h2 = load_tokenizer(tmp_path)
    assert (h2.bos_token_id, h2.eos_token_id, h2.pad_token_id) == (3, 2, None)
    assert h.fingerprint() != h2.fingerprint()
    # A bare file ignores the configs next to it.
    h3 = load_tokenizer(tmp_path / "tokenizer.json")
    assert (h3.bos_token_id, h3.eos_token_id, h3.pad_token_id) == (1, 2, 0)


def test_config_token_missing_from_vocab_is_absent(small_tok, tmp_path, caplog):
    small_tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with caplog.at_level(logging.WARNING, logger="zephon"):
        h = load_tokenizer(tmp_path)
    assert h.bos_token_id is None and h.eos_token_id == 2
    assert "<nope>" in caplog.text


def _fake_hub_cache(hf_home: Path, repo: str, small_tok: Tokenizer, commit: str = "abc123") -> Path:
    repo_dir = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    small_tok.save(str(snap / "tokenizer.json"))
    (snap / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[UNK]"}))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """An empty HF_HOME, offline."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_tokenizer_id_from_hub_cache(small_tok, hub_env):
    snap = _fake_hub_cache(hub_env, "org/model", small_tok)
    h = load_tokenizer(tokenizer_id="org/model")
    assert h.bos_token_id == 3 and h.eos_token_id == 2  # the snapshot's config was read
    assert str(snap) in h.source
    assert [a.tolist() for a in h.encode_batch(TEXTS)] == [ids_of(small_tok, t) for t in TEXTS]


def test_tokenizer_id_hub_cache_env_var(small_tok, hub_env, monkeypatch, tmp_path):
    _fake_hub_cache(tmp_path / "elsewhere", "gpt-x", small_tok)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere" / "hub"))
    assert load_tokenizer(tokenizer_id="gpt-x").bos_token_id == 3


def test_tokenizer_id_not_cached_explains_local_file(hub_env):
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(tokenizer_id="no-org/no-model")
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "not in the local Hugging Face cache" in msg and "offline" in msg
    assert 'tokenize(tokenizer="path/to/tokenizer.json")' in msg
    assert 'tokenize(tokenizer="path/to/folder")' in msg
    assert str(hub_env / "hub" / "models--no-org--no-model") in msg


def test_tokenizer_id_without_huggingface_hub(hub_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(TokenizerLoadError, match="huggingface_hub is not installed"):
        load_tokenizer(tokenizer_id="gpt2")


def test_load_argument_errors(small_tok, tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer given"):
        load_tokenizer()
    with pytest.raises(TokenizerLoadError, match="not both"):
        load_tokenizer(small_tok, tokenizer_id="gpt2")
    with pytest.raises(TypeError, match="tokenizers.Tokenizer"):
        load_tokenizer(42)
    with pytest.raises(TokenizerLoadError, match="tokenizer_id='gpt2'"):
        load_tokenizer("gpt2")  # a name, not a path
    with pytest.raises(TokenizerLoadError, match="no such file or folder"):
        load_tokenizer(tokenizer_id=str(tmp_path / "nope" / "tokenizer.json"))
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json.*vocab.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerLoadError, match="cannot read"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="backend must be one of"):
        load_tokenizer(small_tok, backend="fast")


# -- the handle ----------------------------------------------------------------------------------------


def test_handle_pickles_small_and_rebuilds_once(small_tok):
    h = load_tokenizer(small_tok)
    data = pickle.dumps(h)
    assert len(data) < len(h.tokenizer_json) + 1000  # the JSON and ids, no live tokenizer
    a, b = pickle.loads(data), pickle.loads(data)
    assert a == h and a.fingerprint() == h.fingerprint()
    assert a.tokenizer is b.tokenizer  # loaded once per process, shared
    assert [x.tolist() for x in a.encode_batch(TEXTS)] == [x.tolist() for x in h.encode_batch(TEXTS)]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        h.bos_token_id = 5


def test_handle_in_spawned_process(bytelevel_tok):
    h = load_tokenizer(bytelevel_tok, backend="tiktoken")
    assert h.backend == "tiktoken"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply(TokenizerHandle.encode_batch, (h, TEXTS))
    assert [g.tolist() for g in got] == [ids_of(bytelevel_tok, t) for t in TEXTS]


def test_handle_ignores_truncation_and_padding_of_the_object(small_tok):
    tok = Tokenizer.from_str(small_tok.to_str())
    tok.enable_truncation(2)
    tok.enable_padding(length=50)
    h = load_tokenizer(tok)
    assert h.fingerprint() == load_tokenizer(small_tok).fingerprint()
    assert [a.tolist() for a in h.encode_batch(TEXTS)] == [ids_of(small_tok, t) for t in TEXTS]
    assert tok.truncation is not None and tok.padding is not None  # the caller's object is left alone


def test_handle_keeps_encode_special_tokens(small_tok):
    tok = Tokenizer.from_str(small_tok.to_str())
    tok.encode_special_tokens = True
    h = load_tokenizer(tok)
    assert h.encode_special_tokens
    assert h.fingerprint() != load_tokenizer(small_tok).fingerprint()
    assert 1 not in h.encode_batch(["a [BOS] b"])[0].tolist()
    assert 1 in load_tokenizer(small_tok).encode_batch(["a [BOS] b"])[0].tolist()


def test_fingerprint_changes_with_content(small_tok):
    tok = Tokenizer.from_str(small_tok.to_str())
    tok.add_tokens(["zephonword"])
    assert load_tokenizer(tok).fingerprint() != load_tokenizer(small_tok).fingerprint()


def test_unencodable_text_is_a_clear_error(small_tok):
    h = load_tokenizer(small_tok)
    with pytest.raises(ValueError, match="text 1 of the batch cannot be encoded as UTF-8"):
        h.encode_batch(["fine", "bad \ud800 surrogate"])
    op = Tokenize(small_tok)
    with pytest.raises(ValueError, match="field 'text'.*UTF-8"):
        op.apply_many([{"text": "bad \udfff"}])


# -- the operator: special tokens, truncation, splitting -------------------------------------------------


@pytest.mark.parametrize(
    "mode, head, tail",
    [("bos_eos", [1], [2]), ("bos", [1], []), ("eos", [], [2]), ("none", [], [])],
)
def test_special_token_modes(small_tok, mode, head, tail):
    op = Tokenize(small_tok, special_tokens=mode)
    out = op.apply_many([{"text": t} for t in TEXTS])
    for text, outs in zip(TEXTS, out):
        (payload,) = outs
        assert list(payload) == ["input_ids"]
        assert payload["input_ids"].dtype == np.int32
        assert payload["input_ids"].tolist() == head + ids_of(small_tok, text) + tail


def test_id_overrides(small_tok):
    op = Tokenize(small_tok, bos_token_id=3, eos_token_id=np.int64(0))
    assert op.apply_many(["a"])[0][0]["input_ids"].tolist() == [3] + ids_of(small_tok, "a") + [0]
    assert type(op.eos_token_id) is int


def test_apply_many_matches_per_document_and_calls_the_encoder_once(small_tok, monkeypatch):
    op = Tokenize(small_tok)
    calls = []
    original = TokenizerHandle.encode_bracketed

    def spy(self, texts, **kw):
        calls.append(len(texts))
        return original(self, texts, **kw)

    monkeypatch.setattr(TokenizerHandle, "encode_bracketed", spy)
    lines = _corpus_lines()[:64]
    batch = op.apply_many([{"text": t} for t in lines])
    assert calls == [64]
    single = [op.apply_many([{"text": t}])[0] for t in lines]
    def lists(outs):
        return [[p["input_ids"].tolist() for p in o] for o in outs]

    assert lists(batch) == lists(single)
    assert op.apply_many([]) == []


@pytest.mark.parametrize("mode", ["bos_eos", "bos", "eos", "none"])
@pytest.mark.parametrize("max_length", [3, 5, 8, 40])
def test_truncation_length_is_exact(small_tok, mode, max_length):
    n_specials = {"bos_eos": 2, "bos": 1, "eos": 1, "none": 0}[mode]
    if max_length <= n_specials:
        return
    full = Tokenize(small_tok, special_tokens=mode)
    op = Tokenize(small_tok, special_tokens=mode, max_length=max_length, truncation=True)
    for text in TEXTS + _corpus_lines()[:20]:
        whole = full.apply_many([text])[0][0]["input_ids"].tolist()
        got = op.apply_many([text])[0][0]["input_ids"].tolist()
        assert len(got) == min(max_length, len(whole))
        if len(whole) > max_length:
            content = ids_of(small_tok, text)[: max_length - n_specials]
            head = [1] if mode in ("bos_eos", "bos") else []
            tail = [2] if mode in ("bos_eos", "eos") else []
            assert got == head + content + tail
        else:
            assert got == whole


@pytest.mark.parametrize("mode", ["bos_eos", "bos", "eos", "none"])
@pytest.mark.parametrize("max_length", [1, 2, 3, 7, 64])
def test_split_chunks_concatenate_to_the_bracketed_sequence(small_tok, mode, max_length):
    full = Tokenize(small_tok, special_tokens=mode)
    op = Tokenize(small_tok, special_tokens=mode, max_length=max_length, split_long_samples=True)
    assert op.fans_out and not full.fans_out
    texts = TEXTS + _corpus_lines()[:20]
    for text, outs in zip(texts, op.apply_many(texts)):
        whole = full.apply_many([text])[0][0]["input_ids"].tolist()
        pieces = [p["input_ids"].tolist() for p in outs]
        assert sum(pieces, []) == whole
        assert len(pieces) == max(1, -(-len(whole) // max_length))
        assert all(len(p) == max_length for p in pieces[:-1]) and len(pieces[-1]) <= max_length
        flat = sum(pieces[1:], [])
        if mode in ("bos_eos", "bos") and max_length > 1:
            assert pieces[0][0] == 1 and 1 not in flat
        if mode in ("bos_eos", "eos"):
            assert pieces[-1][-1] == 2 and 2 not in sum(pieces[:-1], [])


def test_split_last_piece_may_be_only_eos(small_tok):
    n = len(ids_of(small_tok, TEXTS[0]))
    op = Tokenize(small_tok, max_length=n + 1, split_long_samples=True)
    pieces = [p["input_ids"].tolist() for p in op.apply_many([TEXTS[0]])[0]]
    assert pieces == [[1] + ids_of(small_tok, TEXTS[0]), [2]]


def test_split_empty_sequence_gives_one_empty_piece(small_tok):
    op = Tokenize(small_tok, special_tokens="none", max_length=4, split_long_samples=True)
    (outs,) = op.apply_many([""])
    assert [p["input_ids"].tolist() for p in outs] == [[]]


def test_split_records_get_children_and_rebuild(small_tok):
    op = Tokenize(small_tok, max_length=4, split_long_samples=True, preserve_upstream_payload=True)
    chunk = [Record({"text": t, "id": i}, sample_meta(0, 0, 0, i)) for i, t in enumerate(TEXTS)]
    _, out = op.step(EMPTY, chunk)
    n_pieces = -(-(len(ids_of(small_tok, TEXTS[0])) + 2) // 4)
    assert n_pieces > 1
    assert [r.meta.segments[0].child for r in out if r.meta.segments[0].row == 0] == list(range(n_pieces))
    assert all(r.payload["id"] == r.meta.segments[0].row for r in out)
    by_meta = {r.meta: r for r in chunk}
    rebuilt = op.rebuild([r.meta for r in out][::-1], lambda metas: [by_meta[m] for m in metas])
    assert rebuilt == out[::-1]


def test_split_too_many_pieces(small_tok):
    op = Tokenize(small_tok, special_tokens="none", max_length=1, split_long_samples=True)
    with pytest.raises(ValueError, match="more than"):
        op.apply_many(["[PAD]" * (CHILD_BASE + 1)])


# -- the operator: fields and payloads ---------------------------------------------------------------------


def test_missing_field_error_names_field_keys_and_fix(small_tok):
    op = Tokenize(small_tok, field="body")
    with pytest.raises(ValueError) as info:
        op.apply_many([{"body": "x"}, {"text": "a", "id": 3}])
    msg = str(info.value)
    assert "'body'" in msg and "'text', 'id'" in msg and "missing_field='empty'" in msg and "field=" in msg
    with pytest.raises(ValueError, match=r"'k7', \.\.\. \(12 keys\)"):
        op.apply_many([{f"k{i}": i for i in range(12)}])


def test_missing_field_empty_tokenizes_empty_text(small_tok):
    op = Tokenize(small_tok, missing_field="empty")
    assert op.apply_many([{"other": 1}])[0][0]["input_ids"].tolist() == [1, 2]
    op = Tokenize(small_tok, missing_field="empty", special_tokens="none")
    assert op.apply_many([{"other": 1}])[0][0]["input_ids"].tolist() == []


def test_dot_path_field(small_tok):
    op = Tokenize(small_tok, field="meta.body", special_tokens="none")
    assert op.apply_many([{"meta": {"body": "a"}}])[0][0]["input_ids"].tolist() == ids_of(small_tok, "a")
    assert op.apply_many([{"meta.body": "b"}])[0][0]["input_ids"].tolist() == ids_of(small_tok, "b")
    with pytest.raises(ValueError, match="'meta.body'"):
        op.apply_many([{"meta": "not a dict"}])


def test_wrong_types_are_type_errors(small_tok):
    op = Tokenize(small_tok)
    with pytest.raises(TypeError, match="field 'text' holds a int"):
        op.apply_many([{"text": 5}])
    with pytest.raises(TypeError, match="bytes.*decode"):
        op.apply_many([{"text": b"raw"}])
    with pytest.raises(TypeError, match="payload is a list"):
        op.apply_many([["a"]])


def test_preserve_upstream_payload(small_tok):
    op = Tokenize(small_tok, preserve_upstream_payload=True)
    payload = {"text": "a", "source": "web", "input_ids": "old"}
    (out,) = op.apply_many([payload])[0]
    assert list(out) == ["text", "source", "input_ids"]
    assert out["source"] == "web" and out["input_ids"].tolist() == [1] + ids_of(small_tok, "a") + [2]
    assert payload["input_ids"] == "old"  # inputs are never mutated
    assert list(op.apply_many(["a"])[0][0]) == ["input_ids"]


# -- the operator: configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"special_tokens": "both"}, ValueError, "special_tokens must be one of"),
        ({"special_tokens": "tokenizer_default"}, ValueError, "zephon adds BOS/EOS itself"),
        ({"missing_field": "skip"}, ValueError, "missing_field must be 'error' or 'empty'"),
        ({"split_long_samples": True, "truncation": True, "max_length": 8}, ValueError, "exclude each other"),
        ({"split_long_samples": True}, ValueError, "split_long_samples=True requires max_length"),
        ({"truncation": True}, ValueError, "truncation=True requires max_length"),
        ({"truncation": True, "max_length": 2}, ValueError, "no room for content"),
        ({"truncation": True, "max_length": 1, "special_tokens": "eos"}, ValueError, "no room for content"),
        ({"special_tokens": "none", "bos_token_id": 1}, ValueError, "cannot be used with special_tokens='none'"),
        ({"max_length": 8}, ValueError, "does nothing on its own"),
        ({"max_length": 0, "truncation": True}, ValueError, "max_length must be a positive int"),
        ({"parallelism": 0}, ValueError, "parallelism must be a positive int"),
        ({"backend": "rust"}, ValueError, "backend must be one of"),
        ({"bos_token_id": 10_000}, ValueError, r"outside the tokenizer's ids"),
        ({"eos_token_id": "2"}, TypeError, "eos_token_id must be an int"),
        ({"truncation": "yes"}, TypeError, "truncation must be True or False"),
        ({"field": ""}, TypeError, "field must be a non-empty str"),
    ],
)
def test_config_errors(small_tok, kwargs, error, match):
    with pytest.raises(error, match=match):
        Tokenize(small_tok, **kwargs)


def test_tokenizer_errors_surface_at_construction(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer given"):
        Tokenize()
    with pytest.raises(TokenizerLoadError, match="no such file"):
        Tokenize(str(tmp_path / "missing.json"))


def test_missing_bos_or_eos_fails_at_construction(small_tok):
    class NoBos:
        backend_tokenizer = small_tok
        bos_token_id = None
        eos_token_id = None

    with pytest.raises(ValueError, match="needs a BOS token.*special_tokens='eos'.*bos_token_id="):
        Tokenize(NoBos())
    with pytest.raises(ValueError, match="needs an EOS token"):
        Tokenize(NoBos(), special_tokens="eos")
    bare = Tokenize(NoBos(), special_tokens="none")
    assert bare.apply_many(["a"])[0][0]["input_ids"].tolist() == ids_of(small_tok, "a")
    assert Tokenize(NoBos(), bos_token_id=1, eos_token_id=2).apply_many([""])[0][0]["input_ids"].tolist() == [1, 2]


def test_op_pickles_and_round_trips(small_tok):
    op = Tokenize(small_tok, max_length=5, split_long_samples=True, preserve_upstream_payload=True)
    clone = pickle.loads(pickle.dumps(op))
    assert clone == op and clone.fingerprint() == op.fingerprint() and clone.fans_out
    payloads = [{"text": t, "i": i} for i, t in enumerate(TEXTS)]
    a, b = op.apply_many(payloads), clone.apply_many(payloads)
    assert [[(p["i"], p["input_ids"].tolist()) for p in o] for o in a] == [
        [(p["i"], p["input_ids"].tolist()) for p in o] for o in b
    ]


def test_fingerprint_is_stable_and_tracks_data_options(small_tok, small_dir):
    base = Tokenize(small_tok, max_length=16, truncation=True)
    fp = base.fingerprint()
    assert Tokenize(str(small_dir), max_length=16, truncation=True).fingerprint() == fp
    assert fp["tokenizer"] == load_tokenizer(small_tok).fingerprint()
    assert "parallelism" not in fp and "backend" not in fp and "tokenizer_id" not in fp
    assert attrs.evolve(base, parallelism=4, backend="tokenizers").fingerprint() == fp
    for change in [
        {"field": "body"},
        {"special_tokens": "eos"},
        {"bos_token_id": 3},
        {"eos_token_id": 3},
        {"max_length": 17},
        {"missing_field": "empty"},
        {"preserve_upstream_payload": True},
        {"truncation": False, "split_long_samples": True},
    ]:
        assert attrs.evolve(base, **change).fingerprint() != fp, change
    other = Tokenizer.from_str(small_tok.to_str())
    other.add_tokens(["zephonword"])
    assert Tokenize(other, max_length=16, truncation=True).fingerprint() != fp


def test_evolve_reuses_the_loaded_handle(small_dir):
    op = Tokenize(tokenizer_id=str(small_dir))
    assert isinstance(op.tokenizer, TokenizerHandle) and op.tokenizer_id is None
    op2 = attrs.evolve(op, special_tokens="eos")
    assert op2.tokenizer is op.tokenizer


# -- GPT-2 ------------------------------------------------------------------------------------------------


def test_gpt2_bare_file_has_no_bos(gpt2_file):
    h = load_tokenizer(gpt2_file, backend="tokenizers")
    assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (None, 50256, None)
    with pytest.raises(ValueError, match="special_tokens='eos'.*<\\|endoftext\\|>"):
        Tokenize(h)
    op = Tokenize(h, special_tokens="eos")
    assert op.apply_many(["Hello world"])[0][0]["input_ids"].tolist() == [15496, 995, 50256]


def test_gpt2_folder_config_names_bos(gpt2_file):
    h = load_tokenizer(gpt2_file.parent, backend="tokenizers")
    assert (h.bos_token_id, h.eos_token_id) == (50256, 50256)  # as transformers' GPT2Tokenizer
    assert Tokenize(h).apply_many(["Hello world"])[0][0]["input_ids"].tolist() == [50256, 15496, 995, 50256]


# -- the tiktoken fast path -------------------------------------------------------------------------------


@pytest.mark.parametrize("bos,eos,keep", [(None, None, None), (7, None, None), (None, 50256, 2), (7, 50256, 0), (7, 50256, 1000)])
def test_encode_bracketed_cuts_then_brackets_in_new_arrays_with_either_backend(gpt2_handles, bos, eos, keep):
    texts = ["Hello world, it's 2024", "", "a b c d e f g"]
    plain = [a.tolist() for a in gpt2_handles[0].encode_batch(texts)]
    expected = [([bos] if bos is not None else []) + ids[:keep] + ([eos] if eos is not None else []) for ids in plain]
    for handle in gpt2_handles:
        out = handle.encode_bracketed(texts, bos=bos, eos=eos, keep=keep)
        assert [a.tolist() for a in out] == expected, handle.backend
        assert all(a.dtype == np.int32 and a.flags.writeable and a.base is None for a in out), handle.backend


def test_tiktoken_matches_tokenizers_on_gpt2(gpt2_handles):
    slow, fast = gpt2_handles
    assert slow.backend == "tokenizers" and fast.backend == "tiktoken"
    assert slow.fingerprint() == fast.fingerprint()
    texts = _verification_texts() + ["x<|endoftext|>y", "   ", "\n\n", "  \n  x"]
    assert [a.tolist() for a in fast.encode_batch(texts)] == [b.tolist() for b in slow.encode_batch(texts)]
    assert [a.tolist() for a in fast.encode_batch(texts, num_threads=1)] == [
        b.tolist() for b in slow.encode_batch(texts)
    ]
    clone = pickle.loads(pickle.dumps(fast))
    assert clone.backend == "tiktoken" and clone.encode_batch(["it's 2024"])[0].tolist() == [270, 338, 48609]


def test_tiktoken_matches_tokenizers_on_a_corpus_shard(gpt2_handles):
    shard = shared_path("data", "corpus", "shard-00000.jsonl")
    texts = [json.loads(line)["text"] for line in shard.open(encoding="utf-8")]
    slow, fast = gpt2_handles
    for a, b in zip(fast.encode_batch(texts), slow.encode_batch(texts)):
        assert np.array_equal(a, b)


def test_auto_backend_picks_tiktoken_for_gpt2(gpt2_handles, gpt2_file):
    assert load_tokenizer(gpt2_file).backend == "tiktoken"
    op = Tokenize(gpt2_file, special_tokens="eos", parallelism=2)
    assert op.tokenizer.backend == "tiktoken"
    assert Tokenize(gpt2_file, special_tokens="eos", backend="tokenizers").fingerprint() == op.fingerprint()


def test_tiktoken_on_a_trained_byte_level_bpe(bytelevel_tok):
    h = load_tokenizer(bytelevel_tok, backend="tiktoken")
    assert h.backend == "tiktoken"
    texts = _verification_texts() + _corpus_lines()[:50]
    assert [a.tolist() for a in h.encode_batch(texts)] == [ids_of(bytelevel_tok, t) for t in texts]


def test_tiktoken_refused_when_not_byte_level_and_auto_falls_back(small_tok, caplog):
    with pytest.raises(TokenizerLoadError, match="backend='tiktoken' cannot encode .*pre-tokenizer"):
        load_tokenizer(small_tok, backend="tiktoken")
    with caplog.at_level(logging.INFO, logger="zephon"):
        h = load_tokenizer(small_tok)  # auto: tokenizers, logged at INFO
    assert h.backend == "tokenizers"
    assert "not using tiktoken" in caplog.text and "pre-tokenizer" in caplog.text
    assert [a.tolist() for a in h.encode_batch(TEXTS)] == [ids_of(small_tok, t) for t in TEXTS]


def test_tiktoken_plan_rejects_reordered_merges(bytelevel_tok):
    spec = json.loads(bytelevel_tok.to_str())
    assert load_tokenizer(Tokenizer.from_str(json.dumps(spec)), backend="tiktoken").backend == "tiktoken"
    merges = spec["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    with pytest.raises(TokenizerLoadError, match="its merge order does not follow its token ids"):
        load_tokenizer(Tokenizer.from_str(json.dumps(spec)), backend="tiktoken")
    spec["normalizer"] = {"type": "NFC"}
    with pytest.raises(TokenizerLoadError, match="it has a normalizer"):
        load_tokenizer(Tokenizer.from_str(json.dumps(spec)), backend="tiktoken")


def test_tiktoken_verification_catches_differences(bytelevel_tok, small_tok):
    import tiktoken
    from zephon.text.tiktoken_encoding import _tiktoken_plan

    plan, _ = _tiktoken_plan(json.loads(bytelevel_tok.to_str()))
    enc = tiktoken.Encoding(
        "t", pat_str=plan["pattern"], mergeable_ranks=plan["ranks"], special_tokens=plan["specials"]
    )
    assert _verify_tiktoken(bytelevel_tok, enc, plan, False) == ""
    assert "differ" in _verify_tiktoken(small_tok, enc, plan, False)


def test_tiktoken_missing_is_an_error_and_auto_falls_back(bytelevel_tok, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match=r"pip install 'zephon-lanes\[fast\]'"):
        load_tokenizer(bytelevel_tok, backend="tiktoken")
    with caplog.at_level(logging.INFO, logger="zephon"):
        h = load_tokenizer(bytelevel_tok)
    assert h.backend == "tokenizers" and "not installed" in caplog.text


# -- per-process caches and module layout ----------------------------------------------------------------


def test_process_cache_builds_each_entry_once_across_threads():
    import threading

    cache = ProcessCache()
    calls = []

    def build():
        calls.append(1)
        return object()

    start = threading.Barrier(8)
    got = []

    def worker():
        start.wait()
        got.append(cache.get("k", build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(g) for g in got}) == 1
    assert cache.peek("k") is got[0] and "k" in cache and cache.peek("other") is None
    cache.discard("k")
    assert "k" not in cache and len(cache) == 0


def test_process_cache_bound_drops_the_least_recently_used():
    limit = [2]
    cache = ProcessCache(max_entries=lambda: limit[0])
    for key in "abc":
        cache.get(key, lambda key=key: key.upper())
    assert [k for k in "abcde" if k in cache] == ["b", "c"]
    cache.get("b", lambda: "never")  # a hit makes "b" the most recent
    cache.get("d", lambda: "D")
    assert [k for k in "abcde" if k in cache] == ["b", "d"]  # "c" was the least recent
    limit[0] = 1  # read at each insertion
    cache.get("e", lambda: "E")
    assert [k for k in "abcde" if k in cache] == ["e"] and len(cache) == 1


def test_process_cache_build_error_leaves_no_entry():
    cache = ProcessCache()

    def boom():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get("k", boom)
    assert "k" not in cache and cache.get("k", lambda: 1) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_process_caches_after_fork(small_tok):
    from zephon.text import tokenizer as _tokenizer

    h = load_tokenizer(small_tok)
    h.tokenizer  # noqa: B018 - builds the live tokenizer in this process
    cleared, kept = ProcessCache(), ProcessCache(clear_after_fork=False)
    cleared.get("k", lambda: 1)
    kept.get("k", lambda: 1)
    assert len(_tokenizer._LIVE) >= 1
    pid = os.fork()
    if pid == 0:  # the child: live objects are rebuilt, mappings and verdicts kept
        ok = "k" not in cleared and "k" in kept and len(_tokenizer._LIVE) == 0
        ok = ok and h.encode_batch(["a b"])[0].tolist() == ids_of(small_tok, "a b") and len(_tokenizer._LIVE) >= 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert "k" in cleared  # the parent keeps its entries


def _zephon_imports(module: str) -> set[str]:
    """The zephon modules ``zephon/<module>.py`` imports (relative imports, at any depth of the file)."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[1] / "zephon" / f"{module.replace('.', '/')}.py").read_text(encoding="utf-8"))
    return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}


def test_module_layout_has_no_cycles():
    # Loading imports the tiktoken path, never the reverse; the cache is below both.
    assert "tiktoken_encoding" in _zephon_imports("text.tokenizer")
    assert _zephon_imports("text.tiktoken_encoding") == {"core.cache"}
    assert _zephon_imports("core.cache") == set()


def test_one_list_of_special_token_modes():
    from zephon.training import fields as _fields
    from zephon.ops import tokenize as _tokenize

    assert _tokenize.SPECIAL_TOKEN_MODES is _fields.SPECIAL_TOKEN_MODES


def test_shared_path(monkeypatch):
    assert SHARED == Path(__file__).resolve().parents[1].parent / "shared"
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-file"):
        shared_path("data", "no-such-file")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no-such-file.*CI=true"):
        shared_path("data", "no-such-file")


# -- laws (hypothesis) --------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LAWS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_LAWS
@given(
    texts=st.lists(st.text(max_size=60), max_size=12),
    cut=st.integers(0, 12),
    max_length=st.integers(1, 9),
    mode=st.sampled_from(["bos_eos", "bos", "eos", "none"]),
)
def test_law_chunk_boundaries_and_conservation(small_tok, texts, cut, max_length, mode):
    split = Tokenize(small_tok, special_tokens=mode, max_length=max_length, split_long_samples=True)
    whole = Tokenize(small_tok, special_tokens=mode)
    # Any split of the input into chunks gives the same outputs.
    together = split.apply_many(texts)
    assert _same(together, split.apply_many(texts[:cut]) + split.apply_many(texts[cut:]))
    # Splitting conserves every token of the bracketed sequence, in order.
    for outs, (full,) in zip(together, whole.apply_many(texts)):
        assert np.array_equal(np.concatenate([p["input_ids"] for p in outs]), full["input_ids"])


def _same(a, b) -> bool:
    return [[p["input_ids"].tolist() for p in o] for o in a] == [[p["input_ids"].tolist() for p in o] for o in b]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_law_tiktoken_equals_tokenizers_on_gpt2(gpt2_handles, text):
    slow, fast = gpt2_handles
    assert fast.encode_batch([text], num_threads=1)[0].tolist() == slow.encode_batch([text])[0].tolist()
