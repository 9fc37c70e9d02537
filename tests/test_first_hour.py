"""What a new user meets first: the tokenizer backend, an offline hub id, explain, the CLI, the demo.

Each test states a behaviour that must never be silent: a backend that was asked for and cannot
be used raises (and ``explain()`` names the encoder actually used), a hub id fails at once when
the hub cannot be reached, ``explain`` refuses a topology iteration refuses, and the CLI picks
defaults that suit the tokenizer and names its own flags in errors.
"""

from __future__ import annotations

import importlib
import json
import re
import socket
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from _shared import shared_path
from zephon import Pipeline
from zephon.ops import Tokenize
from zephon.cli.main import main
from zephon.text.tokenizer import TokenizerLoadError, load_tokenizer

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
    with pytest.raises(ImportError, match=r"pip install 'zephon-lanes\[fast\]'"):
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
    from zephon.pipeline.config import load_pipeline_config

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


# -- 4. the CLI: defaults that follow the tokenizer, errors in flags ------------------------------------


@pytest.fixture(scope="module")
def gpt2_file() -> Path:
    return shared_path("data", "gpt2", "tokenizer.json")


@pytest.fixture
def rows(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(3)))
    return path


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["inspect", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _first_ids(out: str) -> list[int]:
    reports = json.loads(out)
    return [t[0] for t in reports[0]["records"][0]["first_tokens"]]


def test_inspect_with_a_bare_gpt2_file_defaults_to_eos(gpt2_file, rows, capsys):
    eot = Tokenizer.from_file(str(gpt2_file)).token_to_id("<|endoftext|>")
    rc, out, err = _inspect(capsys, rows, "--tokenizer", gpt2_file, "--json")
    assert rc == 0, err
    ids = _first_ids(out)
    expected = Tokenizer.from_file(str(gpt2_file)).encode("hello world number 0", add_special_tokens=False).ids + [eot]
    assert ids == expected  # EOS after the text, no BOS: GPT-2's file has none


def test_inspect_defaults_to_bos_and_eos_when_the_tokenizer_has_a_bos(gpt2_file, rows, capsys):
    # The folder's tokenizer_config.json names <|endoftext|> as BOS too, as transformers reads it.
    rc, out, err = _inspect(capsys, rows, "--tokenizer", gpt2_file.parent, "--json")
    assert rc == 0, err
    tok = Tokenizer.from_file(str(gpt2_file))
    eot = tok.token_to_id("<|endoftext|>")
    assert _first_ids(out) == [eot, *tok.encode("hello world number 0", add_special_tokens=False).ids, eot]


def test_inspect_errors_name_the_flags(gpt2_file, rows, capsys):
    rc, out, err = _inspect(capsys, rows, "--tokenizer", gpt2_file, "--special-tokens", "bos_eos")
    assert rc == 2 and out == ""
    assert "--special-tokens bos_eos needs a BOS token" in err and "use --special-tokens eos" in err
    assert "special_tokens=" not in err and "bos_token_id=" not in err
    rc, out, err = _inspect(capsys, rows, "--tokenizer", gpt2_file, "--field", "body")
    assert rc == 1 and out.count("no field 'body'") == 3
    assert "set --field to the key" in out and "field=" not in out.replace("missing_field=", "")
    rc, out, err = _inspect(capsys, rows, "--tokenizer", rows.parent / "missing.json")
    assert rc == 2 and "--tokenizer " in err and "no such file or folder" in err and "tokenizer_id=" not in err


def test_inspect_takes_a_hub_id_as_its_help_says(gpt2_file, rows, capsys, monkeypatch, tmp_path):
    parser_help = _help_of("inspect")
    assert "Hugging Face id" in parser_help
    hub = tmp_path / "hf" / "hub" / "models--org--gpt"
    (hub / "snapshots" / "abc").mkdir(parents=True)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("abc")
    (hub / "snapshots" / "abc" / "tokenizer.json").write_bytes(gpt2_file.read_bytes())
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, err = _inspect(capsys, rows, "--tokenizer", "org/gpt", "--json")
    assert rc == 0, err
    rc, out, err = _inspect(capsys, rows, "--tokenizer", "org/absent")
    assert rc == 2 and "cannot load --tokenizer org/absent" in err and "offline mode is on" in err
    assert "--tokenizer path/to/tokenizer.json" in err and "tokenizer_id=" not in err and "tokenize(" not in err


def _help_of(command: str) -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        main([command, "--help"])
    return buffer.getvalue()


def test_index_errors_name_the_flags(tmp_path, capsys):
    (tmp_path / "tokens.bin").write_bytes(b"x")  # one byte: no whole uint16 token
    assert main(["index", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "pass --token-dtype" in err and "token_dtype=" not in err


def test_plan_help_promises_what_its_tokenizer_flag_takes():
    text = " ".join(_help_of("plan").split())
    assert "Hugging Face id" in text and "default: bos_eos when the tokenizer has a BOS token, else eos" in text


# -- 5. the demo prints the stats table and where every token went -----------------------------------------


def test_demo_prints_the_stats_table_and_the_drops_in_total(capsys):
    from zephon.cli.demo import run_demo

    assert run_demo(lanes=2) == 0
    out = capsys.readouterr().out
    assert "{'tokenize'" not in out and "{'" not in out  # no raw dict of counters
    assert "operator   records in" in out and "dropped: " in out  # the stats table
    (line,) = [line for line in out.splitlines() if line.startswith("tokens: ")]
    numbers = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) (?:tokenized|delivered|dropped in total|undelivered)", line)]
    produced, delivered, dropped, undelivered = numbers
    assert produced == delivered + dropped + undelivered and dropped > 0
    by_op = re.search(r"\(([^;]*);", line).group(1)
    assert sum(int(n.replace(",", "")) for n in re.findall(r" (\d[\d,]*)", " " + by_op)) == dropped
