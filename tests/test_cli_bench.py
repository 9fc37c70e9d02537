"""``zephon bench`` runs end to end on tiny data and writes a JSON report (no timing asserted)."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from zephon.cli.main import main


@pytest.fixture()
def tiny(tmp_path):
    texts = [" ".join(f"word{(i * 7 + j) % 50}" for j in range(20 + i % 30)) for i in range(60)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:35]), encoding="utf-8")
    (data / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[35:]), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return data, path


def test_bench_runs_on_tiny_data_and_writes_json(tiny, tmp_path, capsys):
    data, tokenizer = tiny
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--data", str(data), "--tokenizer", str(tokenizer), "--lanes", "2", "--workers", "0,1", "--seq-len", "33",
        "--batch-size", "2", "--buffer", "16", "--checkpoint-every", "2", "--repeats", "1", "--json", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report["summary"]) == {"ceiling", "recipe workers=0", "recipe workers=1"}
    for name, row in report["summary"].items():
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["first_batch_s"] > 0 and row["cpu_s_per_mtok"] > 0
        if name != "ceiling":
            assert row["checkpoint_bytes"] > 0
            assert row["restore_exact"] is True  # the restored run's first batch is the uninterrupted one's
    for run in report["runs"]["recipe workers=0"] + report["runs"]["recipe workers=1"]:
        # Every batch built is delivered or counted; the steady rate counts those built after the first.
        assert run["built_tokens"] >= run["tokens"] > 0
        assert run["steady_tokens_per_s"] is None or run["steady_tokens_per_s"] > 0
    # Inline and workers deliver the same tokens (the recipe counts the real tokens of its batches).
    assert report["summary"]["recipe workers=0"]["tokens"] == report["summary"]["recipe workers=1"]["tokens"]
    # Every recipe run sits between two ceiling runs, and its ratio is over their mean.
    runs = report["runs"]
    ceiling_seqs = sorted(r["seq"] for r in runs["ceiling"])
    for name in ("recipe workers=0", "recipe workers=1"):
        for run in runs[name]:
            before = max(q for q in ceiling_seqs if q < run["seq"])
            after = min(q for q in ceiling_seqs if q > run["seq"])
            assert (before, after) == (run["seq"] - 1, run["seq"] + 1)
            rates = {r["seq"]: r["tokens_per_s"] for r in runs["ceiling"]}
            assert run["ratio"] == pytest.approx(run["tokens_per_s"] / ((rates[before] + rates[after]) / 2))
    printed = capsys.readouterr().out
    assert "x ceiling" in printed and "restore->1st s" in printed and str(out) in printed
    # The ceiling also times the rows the recipe's first batch draws from: the shuffle's warm-up
    # window (1 row for a buffer of 16), then two rows for each of the batch's 2.
    assert report["first_rows"] == 1 + 2 * 2 - 1
    for run in runs["ceiling"]:
        assert run["first_rows"] == report["first_rows"] and run["first_rows_s"] > 0 and run["first_batch_s"] > 0
        assert 1 <= run["first_rows_docs"] <= 60  # the documents that fill those rows, and no more


def test_each_run_is_compared_with_the_ceiling_when_it_ran():
    from zephon.cli.bench import _summarize

    def run(seq, rate, first, **kw):
        return {"seq": seq, "round": 0, "tokens": 10, "tokens_per_s": rate, "first_batch_s": first, "rss_mib": 1.0,
                "cpu_s_per_mtok": 1.0, **kw}

    # The machine slows down steadily: the ceiling reads 200, then 100; the recipe, between them, 120.
    results = {"runs": {
        "ceiling": [run(0, 200.0, 0.5, first_rows_s=0.8), run(2, 100.0, 0.7, first_rows_s=1.0)],
        "recipe workers=0": [run(1, 120.0, 0.9, steady_tokens_per_s=135.0)],
        "recipe workers=1": [run(3, 90.0, 1.0, steady_tokens_per_s=None)],  # after the last ceiling: that one
    }}
    summary = _summarize(results)
    assert summary["recipe workers=0"]["ratio"] == pytest.approx(120 / 150)
    assert summary["recipe workers=0"]["steady_ratio"] == pytest.approx(135 / 150)
    assert summary["recipe workers=0"]["first_batch_minus_ceiling_s"] == pytest.approx(0.9 - 0.6)
    # ... and with the ceiling's time to as many rows as the recipe's first batch draws from.
    assert summary["recipe workers=0"]["first_batch_minus_same_rows_s"] == pytest.approx(0.9 - 0.9)
    assert summary["recipe workers=1"]["first_batch_minus_same_rows_s"] == pytest.approx(1.0 - 1.0)
    assert summary["ceiling"]["first_rows_s"] == pytest.approx(0.9)
    assert summary["recipe workers=1"]["ratio"] == pytest.approx(0.9)
    assert summary["recipe workers=1"]["steady_ratio"] is None
    assert summary["ceiling"]["ratio"] == 1.0
    # Workers against inline: each run's ratio over the inline run's of the same round.
    assert summary["recipe workers=1"]["inline_ratio"] == pytest.approx(0.9 / (120 / 150))
    assert summary["recipe workers=0"]["inline_ratio"] == pytest.approx(1.0)
    assert summary["ceiling"]["inline_ratio"] is None


def test_workers_are_compared_with_the_inline_run_of_their_own_round():
    from zephon.cli.bench import _summarize

    def run(seq, rnd, rate):
        return {"seq": seq, "round": rnd, "tokens": 10, "tokens_per_s": rate, "first_batch_s": 1.0, "rss_mib": 1.0,
                "cpu_s_per_mtok": 1.0}

    # Round 0 runs fast, round 1 slow (the ceiling too): within each round, workers are 0.9x and 1.1x inline.
    results = {"runs": {
        "ceiling": [run(0, 0, 100.0), run(2, 0, 100.0), run(4, 0, 100.0), run(5, 1, 50.0), run(7, 1, 50.0), run(9, 1, 50.0)],
        "recipe workers=0": [run(1, 0, 80.0), run(6, 1, 40.0)],
        "recipe workers=1": [run(3, 0, 72.0), run(8, 1, 44.0)],
    }}
    summary = _summarize(results)
    rounds = [r["inline_ratio"] for r in results["runs"]["recipe workers=1"]]
    assert rounds == [pytest.approx(0.9), pytest.approx(1.1)]
    assert summary["recipe workers=1"]["inline_ratio"] == pytest.approx(1.0)  # the median of the two
    # Whatever the order of the runs (--workers 1,0 lists the inline run after the other).
    reordered = {"runs": {k: results["runs"][k] for k in ("ceiling", "recipe workers=1", "recipe workers=0")}}
    for r in reordered["runs"]["recipe workers=1"] + reordered["runs"]["recipe workers=0"]:
        del r["ratio"], r["inline_ratio"]  # as measured: no figure against the ceiling yet
    assert _summarize(reordered)["recipe workers=1"]["inline_ratio"] == pytest.approx(1.0)


def test_bench_names_a_missing_path(tmp_path, capsys):
    code = main(["bench", "--data", str(tmp_path / "nope"), "--tokenizer", str(tmp_path / "t.json"), "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "--data" in capsys.readouterr().err


def test_the_same_work_ceiling_reads_the_documents_that_fill_the_rows_and_no_more():
    import numpy as np

    from zephon.cli.bench import _docs_for_rows

    texts = ["x" * n for n in [5, 9, 3, 20, 7] * 10]  # a document of n tokens is n + 1 with its EOS
    encode = lambda batch: [np.zeros(len(t), dtype=np.int32) for t in batch]  # noqa: E731
    assert _docs_for_rows(texts, encode, 6) == 1
    assert _docs_for_rows(texts, encode, 7) == 2
    assert _docs_for_rows(texts, encode, 16) == 2 and _docs_for_rows(texts, encode, 17) == 3
    assert _docs_for_rows(texts, encode, 9 * 49 + 1) == 46  # across several calls of 16 documents
    assert _docs_for_rows(texts, encode, 10**6) == len(texts)  # not enough: all of them


@pytest.mark.parametrize("buffer,batch", [(1024, 8), (16, 2), (4096, 3), (1, 8)])
def test_the_rows_before_the_first_batch_are_the_shuffles_warm_up_then_two_per_row(buffer, batch):
    from zephon.cli.bench import _rows_before_first_batch
    from zephon.ops import Shuffle

    warmup = Shuffle(buffer).warmup
    expected = batch if buffer == 1 else warmup + 2 * batch - 1
    assert _rows_before_first_batch(buffer, batch) == expected


def _spin(seconds: float) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the process tree is read from /proc (Linux)")
def test_cpu_and_memory_readings_count_the_workers_of_a_fork_server():
    from zephon.cli.processes import descendants_peak_rss_mib, tree_cpu_s
    from zephon.runtime.executor import ignoring_sigint, start_context

    ctx = start_context()  # the fork server that zephon's workers come from
    before = tree_cpu_s()
    procs = [ctx.Process(target=_spin, args=(0.4,)) for _ in range(2)]
    with ignoring_sigint():  # as the workers start: a server started here must ignore Ctrl-C as theirs does
        for p in procs:
            p.start()
    for p in procs:
        p.join()
    # The spinning processes are the fork server's children, not this process's: getrusage alone
    # would count none of their 0.8 CPU-seconds.
    assert tree_cpu_s() - before >= 0.75
    live = ctx.Process(target=_spin, args=(5.0,))
    with ignoring_sigint():
        live.start()
    try:
        _spin(0.05)
        workers = descendants_peak_rss_mib(only_workers=True)
        assert live.pid in workers and workers[live.pid] > 0
    finally:
        live.terminate()
        live.join()
