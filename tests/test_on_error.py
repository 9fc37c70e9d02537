"""on_error="skip": a record whose processing raises is left out, counted, listed and warned about.

Skipping decides on the record alone, so a skipping pipeline gives exactly the batches of the same
pipeline with those records filtered out, for every number of ranks, workers and restarts; the
skip logs live in the lane states, so a checkpoint carries them and a restore continues them.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from _util import CHAT_SPECIALS, ids_unless_bad, not_bad, texts, toks_to_ids
from zephon import Pipeline, SkipLimitError, SkippedRecordWarning
from zephon.io import Dataset, InMemoryShard
from zephon.testing import outputs_equal

pytestmark = pytest.mark.filterwarnings("ignore::zephon.SkippedRecordWarning")

BAD = {3, 4, 11, 25, 26, 27, 40}


def marked(n: int = 48, bad=BAD) -> Dataset:
    """Rows ``{"toks", "id", "bad"}`` in two shards; rows of ``bad`` are marked."""
    rows = [{"toks": list(range(i, i + 1 + i % 5)), "id": i, "bad": i in bad} for i in range(n)]
    return Dataset.from_dict("web", {"a": InMemoryShard(rows[: n // 2]), "b": InMemoryShard(rows[n // 2 :])})


def skipping(lanes: int = 2, **options) -> Pipeline:
    pipe = Pipeline(marked()).options(canonical_replicas=lanes, **options)
    return pipe.map(ids_unless_bad, on_error="skip").pack_flat(6).shuffle(4, seed=1).batch(2)


def filtered(lanes: int = 2, **options) -> Pipeline:
    pipe = Pipeline(marked()).options(canonical_replicas=lanes, **options)
    return pipe.filter(not_bad).map(toks_to_ids).pack_flat(6).shuffle(4, seed=1).batch(2)


def run(pipe: Pipeline) -> tuple[list, dict]:
    with pipe.loader() as loader:
        return list(loader), loader.stats()


def listed_rows(stats: dict) -> set[int]:
    return {r["row"] + (24 if r["shard"] == "b" else 0) for r in stats["skipped"]["records"]}


def test_map_skip_gives_exactly_the_stream_without_the_failing_records():
    got, stats = run(skipping(drain=True))
    expected, _ = run(filtered(drain=True))
    assert got and outputs_equal(got, expected)
    skipped = stats["skipped"]
    assert skipped["total"] == len(BAD) and skipped["by_operator"]["map"]["causes"] == {"ValueError": len(BAD)}
    assert skipped["by_operator"]["map"]["seen"] == 48
    assert listed_rows(stats) == BAD
    assert all(r["operator"] == "map" and "marked bad" in r["message"] for r in skipped["records"])
    assert stats["operators"]["map"]["skipped_records"] == len(BAD)


def raises_on_bad(payload):
    if payload["bad"]:
        raise KeyError("no such field")
    return payload["id"] % 2 == 0


def test_filter_skip_leaves_out_the_records_its_predicate_raises_on():
    pipe = Pipeline(marked()).filter(raises_on_bad, on_error="skip")
    with pipe.loader() as loader:
        got = [r.payload["id"] for r in loader]
        stats = loader.stats()
    assert got == [i for i in range(48) if i not in BAD and i % 2 == 0]
    assert stats["skipped"]["by_operator"]["filter"]["causes"] == {"KeyError": len(BAD)}
    assert stats["operators"]["filter"]["dropped_records"] == 48 - len(BAD) - len(got)


def test_the_first_skip_warns_naming_record_cause_and_the_skip():
    pipe = Pipeline([{"toks": [i], "bad": i in (5, 6)} for i in range(8)]).map(ids_unless_bad, on_error="skip")
    named = r"operator 'map': skipped dataset 'data', shard '0', row 5 .*ValueError"
    with pytest.warns(SkippedRecordWarning, match=named):
        assert [r.payload["input_ids"].tolist() for r in pipe] == [[0], [1], [2], [3], [4], [7]]


def test_one_warning_per_thousand_skips():
    rows = [{"bad": True, "id": i} for i in range(2500)] + [{"toks": [1], "id": -1}]
    pipe = Pipeline(rows).map(ids_unless_bad, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(list(pipe)) == 1
    counts = [w for w in caught if issubclass(w.category, SkippedRecordWarning)]
    assert len(counts) == 3  # the first skip, the 1000th and the 2000th


def _jsonl(folder, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(line + "\n" for line in lines))


def test_a_malformed_jsonl_line_is_skipped_naming_shard_and_line(tmp_path):
    lines = [json.dumps({"text": f"doc {i}", "i": i}) for i in range(12)]
    lines[4] = '{"text": "cut short'
    lines[9] = "[1, 2, 3]"
    _jsonl(tmp_path / "web", lines)
    ds = Dataset.from_path("web", tmp_path / "web", on_error="skip", cache_dir=tmp_path / "cache")
    with pytest.warns(SkippedRecordWarning, match=r"reading dataset 'web': .*shard 'a.jsonl'.*row 4"):
        with Pipeline(ds).loader() as loader:
            got = [r.payload["i"] for r in loader]
            stats = loader.stats()
    assert got == [i for i in range(12) if i not in (4, 9)]
    source = stats["skipped"]["by_operator"]["source"]
    assert source == {"skipped": 2, "seen": 12, "causes": {"JSONDecodeError": 1, "NotAnObject": 1}}
    first, second = stats["skipped"]["records"]
    assert (first["dataset"], first["shard"], first["row"]) == ("web", "a.jsonl", 4) and "line 5" in first["message"]
    assert second["row"] == 9 and "JSON array" in second["message"]
    with pytest.raises(ValueError, match=r"a.jsonl, line 5 \(row 4\) is not valid JSON"):
        list(Pipeline(Dataset.from_path("web", tmp_path / "web", cache_dir=tmp_path / "cache")))


def test_a_parquet_row_that_fails_decoding_is_skipped(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    stamps = pa.array([0, 10**15, 5, 7], type=pa.timestamp("s"))  # row 1 is past Python's datetime
    pq.write_table(pa.table({"i": [0, 1, 2, 3], "ts": stamps}), tmp_path / "pq" / "a.parquet")
    ds = Dataset.from_path("pq", tmp_path / "pq", on_error="skip", cache_dir=tmp_path / "cache")
    with Pipeline(ds).loader() as loader:
        assert [r.payload["i"] for r in loader] == [0, 2, 3]
        (record,) = loader.stats()["skipped"]["records"]
    assert (record["shard"], record["row"], record["cause"]) == ("a.parquet", 1, "OverflowError")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=CHAT_SPECIALS, show_progress=False)
    tok.train_from_iterator(texts(200), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|endoftext|>"}))
    return folder


def test_tokenize_skips_records_without_a_text_field(tok_dir):
    rows = [{"text": t} for t in texts(10, seed=3)]
    rows[2] = {"body": "no text here"}
    rows[6] = {"text": 17}
    with Pipeline(rows).tokenize(str(tok_dir), on_error="skip").loader() as loader:
        got = list(loader)
        stats = loader.stats()
    expected = list(Pipeline([r for i, r in enumerate(rows) if i not in (2, 6)]).tokenize(str(tok_dir)))
    assert [r.payload["input_ids"].tolist() for r in got] == [r.payload["input_ids"].tolist() for r in expected]
    assert [r.meta.segments[0].row for r in got] == [i for i in range(10) if i not in (2, 6)]
    assert stats["skipped"]["by_operator"]["tokenize"]["causes"] == {"ValueError": 1, "TypeError": 1}
    with pytest.raises(ValueError, match="payload has no field 'text'") as info:
        list(Pipeline(rows).tokenize(str(tok_dir)))
    assert any("row 2" in note for note in info.value.__notes__)


def test_tokenize_chat_skips_malformed_conversations(tok_dir):
    good = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "a lazy dog"}]
    rows = [{"messages": good}, {"messages": "not a list"}, {"messages": [{"content": "no role"}]}, {"messages": good}]
    with Pipeline(rows).tokenize_chat(str(tok_dir), chat_template="chatml", on_error="skip").loader() as loader:
        assert [r.meta.segments[0].row for r in loader] == [0, 3]
        assert loader.stats()["skipped"]["by_operator"]["tokenize_chat"]["skipped"] == 2


def test_max_skipped_count_turns_a_flood_into_an_error_naming_operator_count_and_record():
    pipe = Pipeline(marked()).map(ids_unless_bad, on_error="skip", max_skipped=3, name="clean")
    with pytest.raises(SkipLimitError, match=r"map: 4 records skipped in lane 0, more than max_skipped=3 per") as info:
        list(pipe)
    text = str(info.value) + " ".join(info.value.__notes__)
    assert "operator 'clean'" in text and "row 25 is marked bad" in text and "shard 'b', row 1 " in text
    assert len(list(Pipeline(marked()).map(ids_unless_bad, on_error="skip", max_skipped=len(BAD)))) == 48 - len(BAD)


def test_max_skipped_fraction_counts_the_share_of_records_seen():
    few = Pipeline(marked(bad={5, 30})).map(ids_unless_bad, on_error="skip", max_skipped=0.1)
    assert len(list(few)) == 46
    many = Pipeline(marked()).map(ids_unless_bad, on_error="skip", max_skipped=0.1)
    with pytest.raises(SkipLimitError, match=r"more than max_skipped=0.1 of the records seen \(\d+ of \d+ in"):
        list(many)


def test_reading_max_skipped_names_the_dataset(tmp_path):
    _jsonl(tmp_path / "web", ["{"] * 3 + ['{"i": 1}'])
    ds = Dataset.from_path("web", tmp_path / "web", on_error="skip", max_skipped=2, cache_dir=tmp_path / "cache")
    with pytest.raises(SkipLimitError, match="reading dataset 'web': 3 records skipped"):
        list(Pipeline(ds))


@pytest.mark.parametrize("build", [
    lambda tok: Pipeline([{"x": 1}]).map(toks_to_ids, on_error="ignore"),
    lambda tok: Pipeline([{"x": 1}]).filter(not_bad, on_error=True),
    lambda tok: Pipeline([{"text": "a"}]).tokenize(tok, on_error="warn"),
    lambda tok: Pipeline([{"messages": []}]).tokenize_chat(tok, chat_template="chatml", on_error="Skip"),
], ids=["map", "filter", "tokenize", "tokenize_chat"])
def test_an_unknown_on_error_is_a_clear_error(build, tok_dir):
    with pytest.raises(ValueError, match=r"on_error must be 'raise' .* or 'skip'"):
        build(str(tok_dir))


def test_bad_max_skipped_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_skipped must be None, an int >= 0"):
        Pipeline([{"x": 1}]).map(toks_to_ids, on_error="skip", max_skipped=1.5)
    with pytest.raises(ValueError, match="pass on_error='skip' with it"):
        Pipeline([{"x": 1}]).map(toks_to_ids, max_skipped=3)
    with pytest.raises(ValueError, match="dataset 'web': on_error must be"):
        Dataset.from_path("web", tmp_path, on_error="drop")


def test_the_default_still_raises_naming_the_record():
    with pytest.raises(ValueError, match="row 3 is marked bad") as info:
        list(Pipeline(marked()).map(ids_unless_bad))
    assert any("dataset 'web', shard 'a'" in note and "row 3" in note for note in info.value.__notes__)


def test_worker_processes_skip_in_the_worker_and_report_the_same_counts():
    inline, inline_stats = run(skipping(lanes=4, drain=True))
    with pytest.warns(SkippedRecordWarning, match=r"in the worker process for lanes \[.*operator 'map': skipped"):
        workers, worker_stats = run(skipping(lanes=4, drain=True, workers=2))
    assert outputs_equal(workers, inline)
    assert worker_stats["skipped"] == inline_stats["skipped"]
    assert worker_stats["operators"]["map"]["skipped_records"] == len(BAD)


def test_a_checkpoint_after_skips_resumes_identically_and_keeps_the_counts():
    full, full_stats = run(skipping(read_size=4))
    loader = skipping(read_size=4).loader()
    k = 0
    while loader.stats()["skipped"]["total"] == 0 or k == 0:  # a checkpoint after some skips and before others
        next(loader)
        k += 1
    checkpoint = json.loads(json.dumps(loader.checkpoint()))
    assert 0 < loader.stats()["skipped"]["total"] < len(BAD)
    resumed, resumed_stats = run(skipping().restore(checkpoint))
    assert outputs_equal(full[k:], resumed)
    assert resumed_stats["skipped"] == full_stats["skipped"]


def test_changing_on_error_is_a_plan_difference(tmp_path):
    raising = Pipeline(marked(bad=set())).map(ids_unless_bad).batch(2)
    loader = raising.loader()
    next(loader)
    checkpoint = loader.checkpoint()
    with pytest.raises(ValueError, match=r"map 'map': setting 'on_error' differs; operators\[0\]\[1\]\.on_error"):
        Pipeline(marked(bad=set())).map(ids_unless_bad, on_error="skip").batch(2).restore(checkpoint)
    _jsonl(tmp_path / "web", [json.dumps({"i": i}) for i in range(4)])
    plain = Pipeline(Dataset.from_path("web", tmp_path / "web", cache_dir=tmp_path / "c")).batch(2)
    ck = plain.loader().checkpoint()
    tolerant = Pipeline(Dataset.from_path("web", tmp_path / "web", on_error="skip", cache_dir=tmp_path / "c")).batch(2)
    with pytest.raises(ValueError, match=r"source\..*on_error: checkpoint=<absent> pipeline=\"skip\""):
        tolerant.restore(ck)
    assert np.array_equal(next(iter(plain)).records[0].payload["i"], 0)


def test_reading_skips_survive_a_checkpoint_and_agree_with_workers(tmp_path):
    lines = [json.dumps({"toks": [i, i + 1], "id": i}) for i in range(60)]
    for i in (2, 19, 33, 47):
        lines[i] = lines[i][:-3]
    _jsonl(tmp_path / "web", lines)
    ds = Dataset.from_path("web", tmp_path / "web", on_error="skip", cache_dir=tmp_path / "cache")

    def pipe(**options):
        return Pipeline(ds).options(canonical_replicas=2, read_size=4, **options).map(toks_to_ids).batch(2)

    full, stats = run(pipe())
    assert stats["skipped"]["by_operator"]["source"]["skipped"] == 4
    with_workers, worker_stats = run(pipe(workers=2))
    assert outputs_equal(with_workers, full) and worker_stats["skipped"] == stats["skipped"]
    loader = pipe().loader()
    k = 0
    while loader.stats()["skipped"]["total"] in (0, 4):
        next(loader)
        k += 1
    checkpoint = json.loads(json.dumps(loader.checkpoint()))
    resumed, resumed_stats = run(pipe().restore(checkpoint))
    assert outputs_equal(resumed, full[k:]) and resumed_stats["skipped"] == stats["skipped"]
    lane = next(key for key, state in checkpoint["lanes"].items() if "skipped" in state)
    checkpoint["lanes"][lane]["skipped"][0]["seen"] += 1
    with pytest.raises(ValueError, match=f"lane {lane}: checksum mismatch"):
        pipe().restore(checkpoint)


def test_a_skipping_operator_passes_the_operator_checks():
    from zephon.ops import MapOp
    from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance
    from zephon.types import Meta, Record, Segment

    payloads = [{"toks": [i], "bad": i % 4 == 1, "id": i} for i in range(20)]
    records = [Record(p, Meta(0, (Segment(0, 0, i, 0, 0, -1),))) for i, p in enumerate(payloads)]
    op = MapOp(ids_unless_bad, on_error="skip", max_skipped=0.4)
    assert_checkpoint_equivalence(op, [records[:7], records[7:15], records[15:]])
    assert_chunking_invariance(op, records, [3, 9])
    state, _ = op.step(op.init(0), records)
    assert op.report(state) == {"dropped_records": 0, "skipped_records": 5}
    with pytest.raises(SkipLimitError, match="map: 2 records skipped in lane 0"):
        MapOp(ids_unless_bad, on_error="skip", max_skipped=1).step(op.init(0), records)
