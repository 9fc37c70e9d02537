"""The on-disk tokenizer cache (canonical JSON and the tiktoken proof) and ``parallelism``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _shared import shared_path
from zephon.text import encoder_threads
from zephon.text import tokenizer_cache as _tokcache
from zephon.text import tokenizer as _tokenizer
from zephon.text.tokenizer import load_tokenizer

pytest.importorskip("tiktoken")


@pytest.fixture()
def gpt2(tmp_path):
    """A private copy of the GPT-2 tokenizer.json (so that a test may edit it)."""
    src = shared_path("data", "gpt2", "tokenizer.json")
    dst = tmp_path / "tokenizer.json"
    dst.write_bytes(src.read_bytes())
    return dst


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(folder))
    monkeypatch.delenv("ZEPHON_TOKENIZER_CACHE", raising=False)
    _tokenizer._LIVE.clear()  # no live tokenizer or encoding of an earlier test
    yield folder / "tokenizers"
    _tokenizer._LIVE.clear()


def _fresh_process_load(path, env) -> dict:
    """Load ``path`` in a new process; report the backend and whether the checks ran."""
    code = textwrap.dedent(
        f"""
        import json
        from zephon.text import tiktoken_encoding as _tiktoken, tokenizer as _tokenizer
        ran = []
        original = _tokenizer._verify_tiktoken
        _tokenizer._verify_tiktoken = lambda *a: ran.append(1) or original(*a)
        h = _tokenizer.load_tokenizer({str(path)!r})
        print(json.dumps({{"backend": h.backend, "verified": bool(ran), "fingerprint": h.fingerprint(),
                           "ids": h.encode_batch(["Hello, world! 12 cafés"])[0].tolist()}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_skips_the_proof_and_gets_the_same_handle(gpt2, cache):
    env = {**os.environ}
    first = _fresh_process_load(gpt2, env)
    second = _fresh_process_load(gpt2, env)
    assert first["backend"] == second["backend"] == "tiktoken"
    assert first["verified"] and not second["verified"]
    assert first["fingerprint"] == second["fingerprint"] and first["ids"] == second["ids"]
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["file", "proof"]


def test_the_cache_gives_what_loading_without_it_gives(gpt2, cache, monkeypatch):
    cached_first = load_tokenizer(gpt2)
    _tokenizer._LIVE.clear()
    _tokenizer._VERIFIED.clear()
    cached = load_tokenizer(gpt2)  # from the entries written above
    monkeypatch.setenv("ZEPHON_TOKENIZER_CACHE", "0")
    _tokenizer._LIVE.clear()
    _tokenizer._VERIFIED.clear()
    plain = load_tokenizer(gpt2)
    for h in (cached_first, cached):
        assert h.fingerprint() == plain.fingerprint() and h.tokenizer_json == plain.tokenizer_json
        assert (h.bos_token_id, h.eos_token_id, h.pad_token_id, h.backend) == (
            plain.bos_token_id, plain.eos_token_id, plain.pad_token_id, plain.backend)
    texts = ["Hello, world!", " spaces  and\ttabs\n", "中文 émoji 😀 <|endoftext|> x"]
    assert [a.tolist() for a in cached.encode_batch(texts)] == [a.tolist() for a in plain.encode_batch(texts)]


def test_an_edited_file_gets_a_new_entry_and_a_new_proof(gpt2, cache):
    env = {**os.environ}
    _fresh_process_load(gpt2, env)
    spec = json.loads(gpt2.read_text(encoding="utf-8"))
    spec["normalizer"] = {"type": "Lowercase"}  # tiktoken cannot do this
    gpt2.write_text(json.dumps(spec), encoding="utf-8")
    again = _fresh_process_load(gpt2, env)
    assert again["backend"] == "tokenizers"
    assert len([p for p in cache.iterdir() if p.name.startswith("file-")]) == 2


def test_entries_made_with_other_versions_or_damaged_are_ignored(gpt2, cache, monkeypatch):
    load_tokenizer(gpt2)
    for entry in cache.iterdir():
        entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])  # truncated
    _tokenizer._LIVE.clear()
    _tokenizer._VERIFIED.clear()
    ran = []
    original = _tokenizer._verify_tiktoken
    monkeypatch.setattr(_tokenizer, "_verify_tiktoken", lambda *a: ran.append(1) or original(*a))
    assert load_tokenizer(gpt2).backend == "tiktoken" and ran == [1]
    monkeypatch.setattr(_tokcache, "salt", lambda: "another version")
    _tokenizer._LIVE.clear()
    _tokenizer._VERIFIED.clear()
    assert load_tokenizer(gpt2).backend == "tiktoken" and ran == [1, 1]


def test_the_cache_can_be_turned_off(gpt2, cache, monkeypatch):
    monkeypatch.setenv("ZEPHON_TOKENIZER_CACHE", "off")
    load_tokenizer(gpt2)
    assert not cache.exists()


def test_an_unwritable_cache_folder_only_costs_time(gpt2, tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("x")
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(blocker))
    _tokenizer._LIVE.clear()
    _tokenizer._VERIFIED.clear()
    assert load_tokenizer(gpt2).backend == "tiktoken"


def test_parallelism_sizes_the_tokenizers_pool_of_a_fresh_process(gpt2, tmp_path):
    """tokenizers runs on one Rayon pool per process: the first tokenize to encode sizes it."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads through /proc (Linux)")
    code = textwrap.dedent(
        f"""
        import os, logging
        logging.basicConfig()
        os.environ.pop("RAYON_NUM_THREADS", None)
        from zephon import Pipeline
        texts = [{{"text": "some words " * (50 + i)}} for i in range(64)]
        before = len(os.listdir("/proc/self/task"))
        pipe = Pipeline(texts).tokenize({str(gpt2)!r}, special_tokens="eos", backend="tokenizers", parallelism=3).batch(4)
        next(iter(pipe))
        print("threads", len(os.listdir("/proc/self/task")) - before, os.environ["RAYON_NUM_THREADS"])
        again = Pipeline(texts).tokenize({str(gpt2)!r}, special_tokens="eos", backend="tokenizers", parallelism=5).batch(4)
        next(iter(again))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("threads")][-1].split()
    assert line[2] == "3" and int(line[1]) >= 3
    assert "parallelism=5" in out.stderr and "already runs 3 threads" in out.stderr


def test_parallelism_sizes_the_tiktoken_pool(gpt2, cache):
    handle = load_tokenizer(gpt2, backend="tiktoken")
    texts = ["a few words"] * 8
    handle.encode_batch(texts, num_threads=3)
    # The calling thread encodes too, beside a pool of two.
    pool = _tokenizer._LIVE.peek(("pool", 2))
    assert pool is not None and pool._max_workers == 2


def test_threaded_tiktoken_keeps_the_order_and_the_ids(gpt2, cache):
    handle = load_tokenizer(gpt2, backend="tiktoken")
    # Lengths in no order, so that longest-first scheduling reorders the work but not the output.
    texts = [f"text {i} " + "several more words here " * ((i * 7) % 13) for i in range(40)]
    single = handle.encode_batch(texts, num_threads=1)
    for threads in (2, 3, 8):
        assert [a.tolist() for a in handle.encode_batch(texts, num_threads=threads)] == [a.tolist() for a in single]


def test_threaded_tiktoken_reports_a_bad_text(gpt2, cache):
    handle = load_tokenizer(gpt2, backend="tiktoken")
    texts = ["fine"] * 10 + ["bad \ud800 surrogate"] + ["fine too"] * 10
    with pytest.raises(ValueError, match="text 10 of the batch"):
        handle.encode_batch(texts, num_threads=3)


def test_worker_processes_size_the_tiktoken_threads(monkeypatch):
    monkeypatch.setenv("ZEPHON_ENCODER_THREADS", "1")
    assert encoder_threads._encoder_threads() == 1
    monkeypatch.setenv("ZEPHON_ENCODER_THREADS", "")
    assert encoder_threads._encoder_threads() == encoder_threads._cpu_count()
