"""A BPE tokenizer built from proven vocabulary and merges files in the cache (``zephon.text.bpe_files``)."""

from __future__ import annotations

import hashlib
import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from _shared import shared_path
from _util import texts, train_bytelevel
from zephon.text import bpe_files as _bpe_files
from zephon.text import tokenizer_cache as _tokcache
from zephon.text import tokenizer as _tokenizer
from zephon.text.tokenizer import load_tokenizer

SAMPLES = ["Hello, world!", " spaces  and\ttabs\n", "中文 émoji 😀 <|endoftext|> x <extra> <s>", "the data of lanes"]


@pytest.fixture()
def cache(cache_dir, monkeypatch):
    monkeypatch.delenv("ZEPHON_TOKENIZER_CACHE", raising=False)
    _tokenizer._LIVE.clear()
    yield cache_dir / "tokenizers"
    _tokenizer._LIVE.clear()


def _metaspace_bpe(folder):
    """A sentencepiece-like BPE: unknown token, byte fallback, a normalizer, a template post-processor,
    special tokens and an added token that is not special."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(texts(200), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.add_tokens(["<extra>"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def _built_fresh(handle):
    """The handle's live tokenizer as a new process would build it."""
    _tokenizer._LIVE.clear()
    return handle.tokenizer


def _key(handle):
    """The cache key of a handle's files: the sha256 of its canonical JSON."""
    return hashlib.sha256(handle.tokenizer_json.encode("utf-8")).hexdigest()


def _entry(handle):
    return _tokcache.load_entry(_bpe_files.KIND, _key(handle))


@pytest.mark.parametrize("make", [train_bytelevel, _metaspace_bpe], ids=["bytelevel", "metaspace"])
def test_loading_proves_the_files_and_later_builds_use_them(make, tmp_path, cache, monkeypatch):
    handle = load_tokenizer(make(tmp_path / "tok"), backend="tokenizers")
    plain = Tokenizer.from_str(handle.tokenizer_json)
    assert _entry(handle)["reason"] == ""  # proven where it was loaded, before any build from the JSON
    assembled = []
    original = _bpe_files._assemble
    monkeypatch.setattr(_bpe_files, "_assemble", lambda *a: assembled.append(1) or original(*a))
    fast = _built_fresh(handle)
    assert assembled == [1]
    assert fast.to_str() == plain.to_str()
    for add_special in (False, True):
        assert [e.ids for e in fast.encode_batch(SAMPLES, add_special_tokens=add_special)] == [
            e.ids for e in plain.encode_batch(SAMPLES, add_special_tokens=add_special)]
    assert [a.tolist() for a in handle.encode_batch(SAMPLES)] == [e.ids for e in plain.encode_batch(SAMPLES, add_special_tokens=False)]


def test_a_tokenizer_given_as_an_object_is_proven_too(tmp_path, cache):
    tok = Tokenizer.from_file(str(train_bytelevel(tmp_path / "tok")))
    handle = load_tokenizer(tok, backend="tokenizers")
    assert _entry(handle)["reason"] == ""
    assert _bpe_files.build(_key(handle)).to_str() == tok.to_str()


def test_the_first_build_proves_what_loading_did_not(tmp_path, cache):
    # A handle made elsewhere (here: with the cache off) and built in a process with the cache on,
    # as a worker or a restore may be: its first build from the JSON proves the files.
    path = train_bytelevel(tmp_path / "tok")
    with pytest.MonkeyPatch.context() as off:
        off.setenv("ZEPHON_TOKENIZER_CACHE", "0")
        handle = load_tokenizer(path, backend="tokenizers")
    assert _entry(handle) is None
    plain = _built_fresh(handle).to_str()
    assert _entry(handle)["reason"] == ""
    assert _bpe_files.build(_key(handle)).to_str() == plain


def test_a_tokenizer_for_tiktoken_is_not_proven(tmp_path, cache):
    handle = load_tokenizer(shared_path("data", "gpt2", "tokenizer.json"))
    assert handle.backend == "tiktoken"
    assert _entry(handle) is None  # it is never built from its JSON: nothing to prove


def test_damaged_or_missing_files_are_not_used_and_are_written_again(tmp_path, cache):
    handle = load_tokenizer(train_bytelevel(tmp_path / "tok"), backend="tokenizers")
    plain = Tokenizer.from_str(handle.tokenizer_json).to_str()
    _built_fresh(handle)
    vocab = cache / f"{_bpe_files.KIND}-{_key(handle)}.vocab.json"
    merges = cache / f"{_bpe_files.KIND}-{_key(handle)}.merges.txt"
    spec = json.loads(vocab.read_text(encoding="utf-8"))
    first, second = list(spec)[:2]
    spec[first], spec[second] = spec[second], spec[first]  # two ids swapped: a different tokenizer
    vocab.write_text(json.dumps(spec), encoding="utf-8")
    assert _bpe_files.build(_key(handle)) is None
    assert _built_fresh(handle).to_str() == plain
    assert _bpe_files.build(_key(handle)).to_str() == plain  # rewritten by that build
    merges.unlink()
    assert _bpe_files.build(_key(handle)) is None
    assert _built_fresh(handle).to_str() == plain
    assert merges.exists()


def test_what_the_files_cannot_build_is_recorded_and_built_from_the_json(tmp_path, cache, monkeypatch):
    word = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    handle = load_tokenizer(word)
    assert _built_fresh(handle).encode("hello world").ids == [1, 2]
    assert "not BPE" in _entry(handle)["reason"]
    assert not list(cache.glob("*.vocab.json"))

    spaced = json.loads(Tokenizer.from_file(str(train_bytelevel(tmp_path / "a"))).to_str())
    vocab = spaced["model"]["vocab"]
    vocab[" b"], vocab["a b"] = len(vocab), len(vocab) + 1
    spaced["model"]["merges"].append(["a", " b"])  # merges.txt cannot hold a token with a space
    handle = load_tokenizer(Tokenizer.from_str(json.dumps(spaced)))
    plain = Tokenizer.from_str(handle.tokenizer_json).to_str()
    assert _built_fresh(handle).to_str() == plain
    assert "space" in _entry(handle)["reason"]

    # A fast build that does not serialize as from_str does is refused and never used.
    original = _bpe_files._assemble

    def without_added_tokens(entry, *files):
        return original({**entry, "added": []}, *files)

    monkeypatch.setattr(_bpe_files, "_assemble", without_added_tokens)
    other = load_tokenizer(train_bytelevel(tmp_path / "b"), backend="tokenizers")
    assert _built_fresh(other).to_str() == Tokenizer.from_str(other.tokenizer_json).to_str()
    assert _entry(other)["reason"] == "the fast build serializes differently"
    assert _bpe_files.build(_key(other)) is None
    assert not list(cache.glob(f"*{_key(other)}.*.*"))  # the unused files are not kept

    # A fast build or a proof that fails is recorded; the build itself goes on from the JSON.
    def refused(*_):
        raise RuntimeError("refused")

    monkeypatch.setattr(_bpe_files, "_assemble", original)
    for name in ("_assemble", "_prove"):
        kept = getattr(_bpe_files, name)
        monkeypatch.setattr(_bpe_files, name, refused)
        tok = Tokenizer.from_file(str(train_bytelevel(tmp_path / name)))
        tok.add_tokens([f"<{name}>"])  # a tokenizer of its own: no entry yet
        handle = load_tokenizer(tok, backend="tokenizers")
        assert _built_fresh(handle).to_str() == Tokenizer.from_str(handle.tokenizer_json).to_str()
        assert "failed (RuntimeError: refused)" in _entry(handle)["reason"]
        monkeypatch.setattr(_bpe_files, name, kept)


def test_nothing_is_written_with_the_cache_off(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("ZEPHON_TOKENIZER_CACHE", "0")
    handle = load_tokenizer(train_bytelevel(tmp_path / "tok"), backend="tokenizers")
    assert _built_fresh(handle).to_str() == Tokenizer.from_str(handle.tokenizer_json).to_str()
    assert not cache.exists()
