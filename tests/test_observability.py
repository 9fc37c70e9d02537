"""What the loader is doing: stats, stats_table, logging, progress, explain, config files, the CLI."""

from __future__ import annotations

import argparse
import io
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import msgspec
import numpy as np
import pytest

import zephon
from zephon import Pipeline
from zephon.cli.main import COMMANDS, main
from zephon.pipeline.config import load_pipeline_config, pipeline_from_config, read_config
from zephon.core.log import disable_logging, enable_logging, progress, progress_enabled
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

ROOT = Path(__file__).resolve().parents[1]


def docs(n, start=0, width=7):
    return [{"input_ids": np.arange(1, 1 + (i % width) + 2, dtype=np.int32) + start} for i in range(n)]


def quiet_list(it):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return list(it)


# -- stats ---------------------------------------------------------------------------------------


def test_flow_counts_chain_from_stage_to_stage_and_match_the_operators_own_counters():
    pipe = Pipeline(docs(120)).options(canonical_replicas=2).filter(lambda p: len(p["input_ids"]) != 3).pack_flat(16).shuffle(4).batch(2)
    loader = iter(pipe)
    out = quiet_list(loader)
    stats = loader.stats()
    flow = stats["flow"]
    assert list(flow) == ["source", "filter", "pack_flat", "shuffle", "batch"]
    names = list(flow)
    for a, b in zip(names, names[1:]):  # what one stage emits, the next receives
        assert flow[a]["records_out"] == flow[b]["records_in"], (a, b)
        if a != "source":
            assert flow[a]["tokens_out"] == flow[b]["tokens_in"], (a, b)
    assert flow["source"]["records_out"] == 120
    dropped = sum(1 for d in docs(120) if len(d["input_ids"]) == 3)
    assert flow["filter"]["records_in"] - flow["filter"]["records_out"] == dropped == stats["operators"]["filter"]["dropped_records"]
    assert flow["pack_flat"]["records_out"] == stats["operators"]["pack_flat"]["rows"]
    assert flow["pack_flat"]["tokens_out"] == stats["operators"]["pack_flat"]["tokens"]
    assert all(f["seconds"] >= 0 for f in flow.values())
    delivered_tokens = sum(r.meta.num_tokens for b in out for r in b.records)
    t = stats["throughput"]
    assert (t["outputs"], t["records"], t["tokens"]) == (len(out), 2 * len(out), delivered_tokens)
    assert 0 <= t["wait_seconds"] <= t["seconds"] + 1e-6 and t["tokens_per_s"] > 0
    assert stats["dropped"]["filter"] == {"dropped_records": dropped}
    assert set(stats["undelivered"]) == {"outputs", "records", "tokens"}  # the keys callers already read


def test_packing_efficiency_counts_padding_of_packed_rows_and_of_ragged_batches():
    padded = Pipeline(docs(40, width=9)).pack_flat(12, algorithm="first_fit", num_bins=2, pad_token_id=0).batch(2)
    loader = iter(padded)
    out = quiet_list(loader)
    p = loader.stats()["packing"]
    real = sum(r.meta.num_tokens for b in out for r in b.records)
    assert p["real_tokens"] == real and p["slots"] == 12 * sum(len(b.records) for b in out)
    assert p["padding_tokens"] == p["slots"] - real > 0
    assert p["efficiency"] == pytest.approx(real / p["slots"]) and p["padding_waste"] == pytest.approx(1 - p["efficiency"])
    ragged = iter(Pipeline(docs(10, width=5)).batch(5))  # two batches of different lengths, padded to their longest
    batches = quiet_list(ragged)
    p = ragged.stats()["packing"]
    assert p["slots"] == sum(len(b.records) * max(len(r.payload["input_ids"]) for r in b.records) for b in batches)
    assert p["real_tokens"] == sum(len(r.payload["input_ids"]) for b in batches for r in b.records)


def test_mixture_achieved_is_reported_against_its_target():
    a = Dataset.from_rows("a", docs(300))
    b = Dataset.from_rows("b", docs(300, start=100))
    source = StaticMixtureWorkSource([a, b], {"a": 3, "b": 1}, seed=0, exhausted_policy="repeat")
    loader = iter(Pipeline(source).options(canonical_replicas=2).batch(4))
    for _ in range(100):
        next(loader)
    stats = loader.stats()
    mix = stats["mixture"]["global"]
    assert mix["a"]["target"] == pytest.approx(0.75) and mix["b"]["target"] == pytest.approx(0.25)
    assert abs(mix["a"]["sample_share"] - 0.75) < 0.02
    assert mix["a"]["samples"] + mix["b"]["samples"] == stats["throughput"]["records"]
    assert mix["a"]["tokens"] + mix["b"]["tokens"] == stats["throughput"]["tokens"]
    assert "mixture (target shares count samples)" in loader.stats_table()


@pytest.mark.integration
@pytest.mark.parametrize("opts", [{"thread": True}, {"workers": 2}])
def test_stats_flow_with_a_thread_or_worker_processes(opts):
    pipe = Pipeline(docs(64)).options(canonical_replicas=2, **opts).pack_flat(8).batch(2)
    with iter(pipe) as loader:
        out = quiet_list(loader)
        stats = loader.stats()
    assert stats["flow"]["source"]["records_out"] == 64
    assert stats["flow"]["batch"]["records_out"] >= 2 * len(out)
    assert stats["throughput"]["outputs"] == len(out) == stats["delivered"]


def test_restore_starts_the_runtime_counters_again_but_operator_counters_continue():
    pipe = Pipeline(docs(60)).options(canonical_replicas=2).filter(lambda p: len(p["input_ids"]) != 4).batch(2)
    loader = iter(pipe)
    for _ in range(6):
        next(loader)
    before = loader.stats()
    loader.restore(loader.checkpoint())
    after = loader.stats()
    assert after["throughput"]["outputs"] == 0 and after["flow"]["source"]["records_out"] == 0
    assert after["operators"]["filter"] == before["operators"]["filter"]


def test_stats_table_renders_every_section():
    a, b = Dataset.from_rows("a", docs(50)), Dataset.from_rows("b", docs(50))
    pipe = Pipeline(StaticMixtureWorkSource([a, b], {"a": 1, "b": 1})).options(canonical_replicas=2).pack_flat(8).batch(2)
    loader = iter(pipe)
    quiet_list(loader)
    table = loader.stats_table()
    stats = loader.stats()
    for text in ("tokens/s", "waited", "packing: efficiency", "records in", "pack_flat", "undelivered", "dataset", "target"):
        assert text in table
    assert f"{stats['throughput']['tokens']:,} tokens" in table
    assert loader.stats_table() == zephon.runtime.stats.format_stats(loader.stats())


# -- logging and progress --------------------------------------------------------------------------


def test_zephon_is_quiet_by_default():
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from zephon import Pipeline\n"
        "l = iter(Pipeline([{'input_ids': [1, 2, 3]}] * 10).options(canonical_replicas=2, log_every=1).batch(1))\n"
        "list(l); l.restore(l.checkpoint())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_log_every_logs_one_summary_line_per_n_steps(caplog):
    pipe = Pipeline(docs(40)).options(canonical_replicas=2, log_every=3).batch(2)
    with caplog.at_level(logging.INFO, logger="zephon"):
        steps = sum(1 for _ in pipe.steps())
    summaries = [r.getMessage() for r in caplog.records if r.name == "zephon.loader" and r.getMessage().startswith("step ")]
    assert steps == 10 and len(summaries) == steps // 3
    assert summaries[0].startswith("step 3:") and "tokens/s" in summaries[0] and "packing" in summaries[0]
    assert any("started rank 0 of 1" in r.getMessage() for r in caplog.records)


def test_enable_logging_prints_to_a_stream_and_turns_progress_on(monkeypatch):
    monkeypatch.delenv("ZEPHON_PROGRESS", raising=False)
    assert not progress_enabled()
    buf = io.StringIO()
    enable_logging("INFO", stream=buf)
    try:
        assert progress_enabled()
        loader = iter(Pipeline(docs(8)).batch(2))
        loader.restore(loader.checkpoint())
        assert "zephon.loader: restored rank 0 of 1" in buf.getvalue()
    finally:
        disable_logging()
    assert not progress_enabled()
    monkeypatch.setenv("ZEPHON_PROGRESS", "1")
    assert progress_enabled()
    bar = progress(range(3), total=3, desc="x")
    assert type(bar).__module__.startswith("tqdm") and list(bar) == [0, 1, 2]
    monkeypatch.setenv("ZEPHON_PROGRESS", "0")
    assert list(progress(range(3))) == [0, 1, 2] and not progress_enabled()


# -- explain ---------------------------------------------------------------------------------------


def test_explain_separates_data_from_performance_and_lays_out_ranks_and_workers():
    pipe = Pipeline(docs(40)).options(canonical_replicas=8, dp_degree=2, dp_rank=1, workers=3).pack_flat(8).shuffle(4).batch(2, pad_token_id=0)
    plan = pipe.explain().to_dict()
    ops = {o["name"]: o for o in plan["operators"]}
    assert ops["batch"]["data_settings"]["microbatch_size"] == 2 and ops["batch"]["performance_settings"] == {"pad_token_id": 0}
    assert ops["shuffle"]["data_settings"] == {"buffer_size": 4, "seed": 0}
    assert "up to 4 records" in ops["shuffle"]["state"]["holds"]
    assert plan["options"]["data"] == {"canonical_replicas": 8} and plan["options"]["performance"]["workers"] == 3
    lanes = plan["lanes"]
    assert lanes["ranks"] == {"0": [0, 3], "1": [4, 7]} and lanes["lanes_of_this_rank"] == [4, 5, 6, 7]
    assert lanes["records_per_global_step"] == 16
    assert plan["executor"]["lanes_per_process"] == {"worker 0": [4, 7], "worker 1": [5], "worker 2": [6]}
    assert "the workers compute every output" in plan["executor"]["start"]
    text = str(pipe.explain())
    assert "rank 1: lanes 4-7" in text and "worker 0: lanes [4, 7]" in text and "checkpoint" in text


def test_explain_checkpoint_sizes_are_those_of_real_checkpoints():
    pipe = Pipeline(docs(400)).options(canonical_replicas=2).pack_flat(8).shuffle(100).batch(2)
    plan = pipe.explain(measure=3).to_dict()
    ck = plan["checkpoint"]
    assert ck["bytes_at_start"] == len(msgspec.msgpack.encode(pipe.loader().checkpoint()))
    loader = pipe.loader()
    for _ in range(6):  # 3 outputs of each lane
        next(loader)
    lane0 = {k: v for k, v in loader.checkpoint()["lanes"]["0"].items() if k != "checksum"}
    m = ck["measured"]
    assert m["steps"] == 3 and m["lane_bytes"] == len(msgspec.msgpack.encode(lane0))
    held = m["per_operator"]["shuffle"]["records_held"]
    assert 0 < held < 100 and m["per_operator"]["shuffle"]["bytes_when_full"] > m["per_operator"]["shuffle"]["bytes"]
    assert ck["estimated_bytes_when_full"] >= 2 * m["lane_bytes"]


# -- config files ----------------------------------------------------------------------------------


def _write_data(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "shard-00000.jsonl", "w") as fh:
        for i in range(30):
            fh.write(json.dumps({"ids": list(range(1, 3 + i % 5))}) + "\n")
    return folder


def to_tokens(payload):
    return {"input_ids": np.asarray(payload["ids"], dtype=np.int32)}


CONFIG = """
[source]
seed = 3
[[source.datasets]]
name = "toy"
path = "data"
[options]
canonical_replicas = 2
workers = 0
[[operators]]
op = "map"
function = "tests.test_observability:to_tokens"
[[operators]]
op = "pack_flat"
max_length = 8
[[operators]]
op = "batch"
microbatch_size = 2
"""


def test_a_toml_or_json_config_builds_the_same_pipeline_as_python(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    data = _write_data(tmp_path / "data")
    (tmp_path / "p.toml").write_text(CONFIG)
    from_toml = load_pipeline_config(tmp_path / "p.toml")
    (tmp_path / "p.json").write_text(json.dumps(read_config(tmp_path / "p.toml")))
    from_json = load_pipeline_config(tmp_path / "p.json")
    by_hand = (
        Pipeline(StaticMixtureWorkSource([Dataset.from_path("toy", data)], {"toy": 1.0}, seed=3))
        .options(canonical_replicas=2)
        .map(to_tokens)
        .pack_flat(8)
        .batch(2)
    )
    assert from_toml.fingerprint() == from_json.fingerprint() == by_hand.fingerprint()
    assert [b.records[0].meta for b in quiet_list(from_toml)] == [b.records[0].meta for b in quiet_list(by_hand)]


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"source": {"datasets": [{"name": "toy", "path": "data"}]}, "operatorz": []}, "unknown key(s) ['operatorz']"),
        ({"source": {"datasets": [{"name": "toy", "path": "data"}]}, "operators": [{"op": "pack"}]}, "operators[0] (pack): unknown op 'pack'"),
        ({"source": {"datasets": [{"name": "toy", "path": "data"}]}, "operators": [{"op": "shuffle", "buffer": 3}]}, "operators[0] (shuffle)"),
        ({"source": {"datasets": [{"name": "toy"}]}}, "needs 'name' and 'path'"),
        ({"source": {"datasets": [{"name": "toy", "path": "data"}]}, "options": {"lanes": 2}}, "[options]"),
    ],
)
def test_config_errors_name_the_table_and_the_fix(tmp_path, doc, message):
    _write_data(tmp_path / "data")
    with pytest.raises(ValueError) as info:
        pipeline_from_config(doc, base=tmp_path, where="p.toml")
    assert message in str(info.value) and "p.toml" in str(info.value)


# -- the command line ------------------------------------------------------------------------------


def _parsers():
    parser = argparse.ArgumentParser(prog="zephon")
    sub = parser.add_subparsers()
    for register in COMMANDS:
        register(sub)
    todo, seen = [parser], []
    while todo:
        p = todo.pop()
        seen.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return sub, seen


def test_every_command_and_option_has_help():
    sub, parsers = _parsers()
    assert {c.dest for c in sub._choices_actions} >= {"demo", "ledger", "inspect", "explain"}
    assert all(c.help for c in sub._choices_actions)
    for p in parsers:
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{p.prog}: {action.dest} has no help"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"zephon-lanes {zephon.__version__}"


def test_inspect_shows_the_chat_template_rendering_and_its_loss_mask(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from _sft_data import train_tokenizer, write_dataset
    finally:
        sys.path.remove(str(ROOT / "examples"))
    data, tok = write_dataset(tmp_path / "data", n=20), train_tokenizer(tmp_path / "tok")
    rc = main(["inspect", str(data), "--n", "3", "--tokenizer", str(tok), "--chat-template", "chatml", "--tokens", "5", "--chars", "100000"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("--- ") == 3
    assert "[[About " in out and "<|im_end|>]]" in out  # supervised: the assistant's answer and its end marker
    assert "<|im_start|>user" in out and "[[<|im_start|>user" not in out
    rc = main(["inspect", str(data), "--n", "2", "--tokenizer", str(tok), "--json", "--chat", "--chat-template", "chatml"])
    reports = json.loads(capsys.readouterr().out)
    rec = reports[0]["records"][0]
    assert rc == 0 and 0 < rec["loss_tokens"] < rec["tokens"]
    assert [m for _, _, m in rec["first_tokens"]][:3] == [0, 0, 0]


def test_inspect_reports_a_wrong_field_per_row(tmp_path, capsys):
    _write_data(tmp_path / "data")
    rows = tmp_path / "texts.jsonl"
    rows.write_text("".join(json.dumps({"body": f"text number {i}"}) + "\n" for i in range(3)))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["text number 0 1 2 3"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    rc = main(["inspect", str(rows), "--tokenizer", str(tmp_path / "tok.json"), "--special-tokens", "eos"])
    captured = capsys.readouterr().out
    assert rc == 1 and captured.count("no field 'text'") == 3 and "'body'" in captured
    rc = main(["inspect", str(rows), "--tokenizer", str(tmp_path / "tok.json"), "--special-tokens", "eos", "--field", "body", "--n", "1"])
    assert rc == 0 and "text number 0<|endoftext|>" in capsys.readouterr().out


def test_explain_command_prints_the_plan_of_a_config(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    _write_data(tmp_path / "data")
    (tmp_path / "p.toml").write_text(CONFIG)
    assert main(["explain", str(tmp_path / "p.toml"), "--dp-degree", "2", "--dp-rank", "1"]) == 0
    text = capsys.readouterr().out
    assert "pack_flat: PackFlat" in text and "rank 1: lane 1" in text
    assert main(["explain", str(tmp_path / "p.toml"), "--json", "--measure", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["checkpoint"]["measured"]["steps"] == 2
    assert main(["explain", str(tmp_path / "missing.toml")]) == 2
    assert "no pipeline config file" in capsys.readouterr().err
