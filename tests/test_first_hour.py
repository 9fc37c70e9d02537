"""What a new user meets first: the tokenizer backend, an offline hub id, explain, the CLI, the demo.

Each test states a behaviour that must never be silent: a backend that was asked for and cannot
be used raises (and ``explain()`` names the encoder actually used), a hub id fails at once when
the hub cannot be reached, ``explain`` refuses a topology iteration refuses, and the CLI picks
defaults that suit the tokenizer and names its own flags in errors.
"""

from __future__ import annotations

import importlib
import json
import socket
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from _shared import shared_path
from zephon import Pipeline
from zephon.ops import Tokenize
from zephon.__main__ import main
from zephon._tokenizer import TokenizerLoadError, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"document {i}: the loader packs tokens into rows, {i * 7} times." for i in range(200)]


@pytest.fixture(scope="module")
def bytelevel_tok() -> Tokenizer:
    """A small GPT-2 style byte-level BPE: tiktoken can encode it exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXTS, trainer)
    return tok


@pytest.fixture(scope="module")
def word_tok() -> Tokenizer:
    """A whitespace word-level tokenizer: tiktoken cannot encode it."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def _backends(pipe: Pipeline) -> dict:
    (op,) = [o for o in pipe.explain().to_dict()["operators"] if o["name"] == "tokenize"]
    return op["performance_settings"]


# -- 1. the tokenizer backend ----------------------------------------------------------------------


def test_tiktoken_asked_for_without_tiktoken_is_an_error_naming_the_extra(bytelevel_tok, monkeypatch):
    assert load_tokenizer(bytelevel_tok, backend="tiktoken").backend == "tiktoken"  # installed: used
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # now it cannot be imported
    with pytest.raises(ImportError, match=r"pip install 'zephon\[fast\]'"):
        load_tokenizer(bytelevel_tok, backend="tiktoken")
    with pytest.raises(ImportError, match="backend='tiktoken' needs tiktoken"):
        Tokenize(bytelevel_tok, special_tokens="eos", backend="tiktoken")
    with pytest.raises(ImportError, match="backend='tiktoken'"):
        Pipeline([{"text": t} for t in TEXTS]).tokenize(bytelevel_tok, special_tokens="eos", backend="tiktoken")


def test_auto_without_tiktoken_uses_tokenizers_and_explain_says_so(bytelevel_tok, monkeypatch):
    pipe = Pipeline([{"text": t} for t in TEXTS]).tokenize(bytelevel_tok, special_tokens="eos").batch(4)
    assert _backends(pipe)["backend"] == "tiktoken" and _backends(pipe)["backend_asked"] == "auto"
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    pipe = Pipeline([{"text": t} for t in TEXTS]).tokenize(bytelevel_tok, special_tokens="eos").batch(4)
    settings = _backends(pipe)
    assert settings["backend"] == "tokenizers" and settings["backend_asked"] == "auto"
    assert "backend='tokenizers', backend_asked='auto'" in str(pipe.explain())
    expected = [bytelevel_tok.encode(t, add_special_tokens=False).ids + [bytelevel_tok.token_to_id("<|endoftext|>")] for t in TEXTS[:4]]
    assert [r.payload["input_ids"].tolist() for r in next(iter(pipe)).records] == expected


def test_tiktoken_asked_for_a_tokenizer_it_cannot_encode_is_an_error(word_tok):
    with pytest.raises(TokenizerLoadError, match="backend='tiktoken' cannot encode the tokenizer .*pre-tokenizer"):
        load_tokenizer(word_tok, backend="tiktoken")
    with pytest.raises(ValueError, match="backend='auto'"):
        Tokenize(word_tok, backend="tiktoken")
    # "auto" chooses, and says what it chose.
    pipe = Pipeline([{"text": "hello world"}] * 4).tokenize(word_tok).batch(2)
    assert _backends(pipe)["backend"] == "tokenizers"
    assert Tokenize(word_tok).tokenizer.backend == "tokenizers"


def test_explain_shows_an_explicit_backend_without_a_second_name(bytelevel_tok):
    pipe = Pipeline([{"text": t} for t in TEXTS]).tokenize(bytelevel_tok, special_tokens="eos", backend="tokenizers").batch(4)
    settings = _backends(pipe)
    assert settings["backend"] == "tokenizers" and "backend_asked" not in settings


# -- 2. explain refuses what iterating refuses ---------------------------------------------------------


def _pipe_of_four_lanes() -> Pipeline:
    rows = [{"input_ids": list(range(1, 3 + i % 5))} for i in range(40)]
    return Pipeline(rows).options(canonical_replicas=4).pack_flat(8).batch(2)


@pytest.mark.parametrize("topology", [{"dp_degree": 3}, {"dp_degree": 2, "dp_rank": 2}, {"dp_degree": 8}])
def test_explain_raises_what_iterating_raises(topology):
    pipe = _pipe_of_four_lanes().options(**topology)
    with pytest.raises(Exception) as iterating:
        next(iter(pipe))
    with pytest.raises(Exception) as explaining:
        pipe.explain()
    assert type(explaining.value) is type(iterating.value) and isinstance(iterating.value, ValueError)
    assert str(explaining.value) == str(iterating.value)


def test_explain_names_the_executor_of_every_valid_topology():
    for options in ({"dp_degree": 2, "dp_rank": 1}, {"dp_degree": 4, "workers": 1}, {"thread": True}):
        text = str(_pipe_of_four_lanes().options(**options).explain())
        assert "executor: ?" not in text
        assert any(k in text for k in ("executor: the calling thread", "executor: worker processes", "executor: a background thread"))


def test_explain_command_fails_on_a_topology_iterating_refuses(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("".join(json.dumps({"input_ids": list(range(1, 3 + i % 5))}) + "\n" for i in range(40)))
    config = tmp_path / "p.toml"
    config.write_text(
        '[source]\nseed = 0\n[[source.datasets]]\nname = "toy"\npath = "data"\n[options]\ncanonical_replicas = 4\n'
        '[[operators]]\nop = "pack_flat"\nmax_length = 8\n[[operators]]\nop = "batch"\nmicrobatch_size = 2\n'
    )
    from zephon._config import load_pipeline_config

    with pytest.raises(ValueError) as iterating:
        next(iter(load_pipeline_config(config).options(dp_degree=3, dp_rank=0)))
    assert main(["explain", str(config), "--dp-degree", "3"]) == 2
    captured = capsys.readouterr()
    assert "executor" not in captured.out
    assert "--dp-degree 3" in captured.err and str(iterating.value) in captured.err
    assert main(["explain", str(config), "--dp-degree", "2", "--dp-rank", "1"]) == 0
    assert "rank 1: lanes 2-3" in capsys.readouterr().out


# -- 3. a hub id when the hub cannot be reached ---------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty hub cache, no offline flags, no proxy, and a hub client whose download is recorded."""
    hub = pytest.importorskip("huggingface_hub")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(importlib.import_module("huggingface_hub.constants"), "HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    calls = []

    def download(*args, **kwargs):
        calls.append((args, kwargs))
        raise OSError("the test's hub answers nothing")

    monkeypatch.setattr(hub, "hf_hub_download", download)
    return calls


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connecting is refused


def _assert_says_how_to_use_a_local_file(msg: str) -> None:
    assert "tokenizer_id='gpt2'" in msg and "not in the local Hugging Face cache" in msg
    assert 'tokenizer_id="path/to/tokenizer.json"' in msg and "tokenizers.Tokenizer object" in msg


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_hub_id_offline_never_calls_the_hub(no_hub, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(tokenizer_id="gpt2")
    assert no_hub == []
    assert "offline mode is on" in str(info.value)
    _assert_says_how_to_use_a_local_file(str(info.value))


def test_hub_id_with_an_unreachable_hub_fails_before_any_download(no_hub, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(TokenizerLoadError) as info:
        Tokenize(tokenizer_id="gpt2")
    assert no_hub == []
    msg = str(info.value)
    assert f"no connection to 127.0.0.1:{port}" in msg and "HF_HUB_OFFLINE=1" in msg
    _assert_says_how_to_use_a_local_file(msg)


def test_hub_id_with_an_unreachable_proxy_fails_before_any_download(no_hub, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    with pytest.raises(TokenizerLoadError, match=f"no connection to 127.0.0.1:{port}"):
        load_tokenizer(tokenizer_id="gpt2")
    assert no_hub == []


def test_hub_id_with_a_reachable_hub_is_downloaded(no_hub, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(TokenizerLoadError, match="the download failed .*the test's hub answers nothing"):
            load_tokenizer(tokenizer_id="gpt2")
    assert [args[:2] for args, _ in no_hub] == [("gpt2", "tokenizer.json")]
