"""batch(max_tokens=N): microbatches by token budget, sorted within a window or not.

Records come from ``_util.docs`` (record ``row`` holds the tokens ``1000 * row + [0, n)``), so a
microbatch's rows and their order are visible; pipeline tests use the toy source (lengths 0-39,
some empty) mapped to ``input_ids``.
"""

import math

import numpy as np
import pytest

from _util import docs, global_steps, toks_to_ids, toy_dataset
from zephon import Pipeline
from zephon.ops import Batch
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, run
from zephon.work import StaticMixtureWorkSource


def lengths_of(batch):
    return [len(r.payload["input_ids"]) for r in batch.records]


def rows(batch):
    return [r.meta.segments[0].row for r in batch.records]


def slots(batch, multiple=1):
    """What the budget counts: rows x the longest row rounded up (a row takes at least one slot)."""
    return len(batch) * max(1, math.ceil(max(lengths_of(batch)) / multiple) * multiple)


def reference_cut(lengths, max_tokens, multiple=1):
    """The greedy rule, written plainly: a record joins unless the batch with it would exceed the budget."""
    width = lambda n: max(1, math.ceil(n / multiple) * multiple)  # noqa: E731
    out, current = [], []
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(width(lengths[j]) for j in current + [i]) > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    return out + ([current] if current else [])


def waste(batches, multiple=1):
    real = sum(sum(lengths_of(b)) for b in batches)
    return 1 - real / sum(slots(b, multiple) for b in batches)


def ragged(n=300, seed=0, high=120):
    return np.random.default_rng(seed).integers(1, high, size=n).tolist()


@pytest.mark.parametrize("max_tokens, multiple", [(128, None), (200, 8), (130, 16)])
def test_arrival_order_follows_the_greedy_rule_exactly_within_the_budget(max_tokens, multiple):
    lengths = ragged()
    op = Batch(max_tokens=max_tokens, pad_to_multiple_of=multiple, drop_last=False)
    state, out = run(op, [docs(lengths)])
    assert [rows(b) for b in out] == reference_cut(lengths, max_tokens, multiple or 1)
    assert all(slots(b, multiple or 1) <= max_tokens for b in out)
    assert len({len(b) for b in out}) > 2  # a variable number of rows
    report = op.report(state)
    assert report["batches"] == len(out) and report["rows"] == len(lengths)
    assert report["padded_slots"] == sum(slots(b, multiple or 1) for b in out)
    assert report["real_tokens"] == sum(lengths) and report["budget_slots"] == len(out) * max_tokens


def test_drop_last_drops_only_a_last_batch_the_budget_did_not_close_and_counts_it():
    op = Batch(max_tokens=128)
    state, out = run(op, [docs([60, 60, 10])])  # [60, 60] is closed: a third row of 60 exceeds 128; [10] is open
    assert [rows(b) for b in out] == [[0, 1]]
    report = op.report(state)
    assert (report["dropped_records_at_end"], report["dropped_tokens_at_end"]) == (1, 10)
    assert [rows(b) for b in run(op, [docs([60, 60])])[1]] == [[0, 1]]  # closed by the budget: kept
    assert [rows(b) for b in run(Batch(max_tokens=128, drop_last=False), [docs([60, 60, 10])])[1]] == [[0, 1], [2]]
    # sorted windows: only the last window's open batch is dropped
    records = docs([60, 5, 60, 7, 9, 3, 4])  # windows [60, 5, 60, 7] (both batches closed) and [9, 3, 4] (open)
    _, kept = run(Batch(max_tokens=128, sort_window=4, drop_last=False), [records])
    _, out = run(Batch(max_tokens=128, sort_window=4), [records])
    assert sorted(map(rows, kept)) == [[0, 2], [1, 3], [5, 6, 4]] and sorted(map(rows, out)) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("window", [1, 7, 32])
def test_sort_window_cuts_each_sorted_window_and_keeps_every_record_once(window):
    lengths = ragged(150, seed=1)
    records = docs(lengths)
    _, out = run(Batch(max_tokens=160, sort_window=window, drop_last=False), [records])
    flat = [row for b in out for row in rows(b)]
    assert sorted(flat) == list(range(len(lengths)))  # nothing lost or duplicated
    assert all(slots(b) <= 160 for b in out)
    emitted = iter(out)
    for start in range(0, len(lengths), window):
        ids = list(range(start, min(start + window, len(lengths))))
        ranked = sorted(ids, key=lambda i: (lengths[i], i))  # ties: the record id (its row here)
        expected = [[ranked[j] for j in g] for g in reference_cut([lengths[i] for i in ranked], 160)]
        mine = [rows(next(emitted)) for _ in expected]
        assert sorted(mine) == sorted(expected), f"window at {start}"
    assert next(emitted, None) is None


def test_sort_window_cuts_padding_and_is_deterministic():
    lengths = ragged(600, seed=2, high=400)
    plain = run(Batch(max_tokens=1024, drop_last=False), [docs(lengths)])[1]
    sorted_64 = run(Batch(max_tokens=1024, sort_window=64, drop_last=False), [docs(lengths)])[1]
    sorted_256 = run(Batch(max_tokens=1024, sort_window=256, drop_last=False), [docs(lengths)])[1]
    assert waste(sorted_256) < waste(sorted_64) < waste(plain) / 2
    again = run(Batch(max_tokens=1024, sort_window=64, drop_last=False), [docs(lengths)])[1]
    assert [rows(b) for b in again] == [rows(b) for b in sorted_64]
    # the window's microbatches are emitted in a drawn order, not shortest first
    widths = [max(lengths_of(b)) for b in sorted_256[:10]]
    assert widths != sorted(widths)
    other_key = run(Batch(max_tokens=1024, sort_window=64, drop_last=False), [docs(lengths)], key=5)[1]
    assert sorted(map(rows, other_key)) == sorted(map(rows, sorted_64))


def test_ties_are_broken_by_record_id_not_arrival():
    records = docs([5] * 6)
    shuffled = [records[i] for i in (4, 1, 5, 0, 3, 2)]
    _, out = run(Batch(max_tokens=10, sort_window=6, drop_last=False), [shuffled])
    assert sorted(rows(b) for b in out) == [[0, 1], [2, 3], [4, 5]]


def test_a_record_wider_than_the_budget_is_an_error_naming_it_or_a_counted_drop():
    records = docs([10, 70, 20])
    with pytest.raises(ValueError, match=r"row 1 \(lane 0\) has 70 tokens.*max_tokens=64.*oversized='drop'"):
        run(Batch(max_tokens=64), [records])
    with pytest.raises(ValueError, match=r"60 tokens \(64 slots after pad_to_multiple_of=32\).*max_tokens=63"):
        run(Batch(max_tokens=63, pad_to_multiple_of=32), [docs([60])])
    op = Batch(max_tokens=64, oversized="drop", drop_last=False, sort_window=2)
    state, out = run(op, [records])
    assert [rows(b) for b in out] == [[0, 2]]
    assert {k: v for k, v in op.report(state).items() if "oversized" in k} == {
        "dropped_oversized_records": 1, "dropped_oversized_tokens": 70
    }


def test_settings_that_exclude_each_other_fail_with_the_fix():
    with pytest.raises(ValueError, match="microbatch_size=8 and max_tokens=4096 exclude each other"):
        Batch(8, max_tokens=4096)
    with pytest.raises(ValueError, match="exclude each other"):
        Pipeline([{"input_ids": [1]}]).batch(8, max_tokens=4096)
    with pytest.raises(ValueError, match="pass microbatch_size .* or max_tokens"):
        Batch()
    with pytest.raises(ValueError, match="sort_window=k"):
        Batch(max_tokens=64, group_by_length=True)
    with pytest.raises(ValueError, match="sort_window, pad_to_multiple_of only apply with max_tokens"):
        Batch(4, sort_window=8, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="pad_to_multiple_of=128 exceeds max_tokens=64"):
        Batch(max_tokens=64, pad_to_multiple_of=128)
    with pytest.raises(ValueError, match="sort_window must be an int >= 0"):
        Batch(max_tokens=64, sort_window=-1)
    with pytest.raises(ValueError, match="oversized must be one of 'error', 'drop'"):
        Batch(max_tokens=64, oversized="truncate")
    pipe = Pipeline([{"input_ids": [1]}]).options(global_batch_size=8).batch(max_tokens=64)
    with pytest.raises(ValueError, match="global_batch_size=8 counts records"):
        pipe.topology()


def test_restoring_at_every_boundary_resumes_exactly():
    records = docs(ragged(40, seed=3, high=60))
    for op in (Batch(max_tokens=96, drop_last=False), Batch(max_tokens=96, sort_window=6, pad_to_multiple_of=8)):
        assert_checkpoint_equivalence(op, [records[:5], records[5:6], records[6:23], records[23:]])
        assert_chunking_invariance(op, records, [1, 9, 10, 31])


def test_a_restored_state_the_budget_closed_already_is_refused():
    op = Batch(max_tokens=10)
    state, _ = op.step(op.init(0), docs([3]))
    data = op.encode_state(state)
    data["partial"] = [data["partial"][0]] * 3  # three rows of 3: a fourth could not join, so it was emitted
    records = {r.meta: r for r in docs([3])}
    with pytest.raises(ValueError, match="field 'partial' holds 3 records of width 3"):
        op.decode_state(data, lambda metas: [records[m] for m in metas])


# -- pipelines ---------------------------------------------------------------------------------------


def budget_pipeline(lanes=4, *, window=0, workers=0, max_tokens=96):
    source = StaticMixtureWorkSource([toy_dataset(240)], {"web": 1.0}, seed=0, chunk_size=8, exhausted_policy="repeat")
    pipe = Pipeline(source).options(canonical_replicas=lanes, workers=workers).map(toks_to_ids)
    return pipe.batch(max_tokens=max_tokens, sort_window=window, pad_to_multiple_of=8, pad_token_id=0)


def flat(step):
    return [[r.meta for r in b.records] for b in step]


@pytest.mark.parametrize("window", [0, 16])
def test_same_global_batches_for_every_rank_count(window):
    make = lambda: budget_pipeline(window=window)  # noqa: E731
    reference, _ = global_steps(make, 4, 1, 12)
    assert len({len(b) for step in reference for b in step}) > 2
    for dp in (2, 4):
        got, _ = global_steps(make, 4, dp, 12)
        assert [flat(s) for s in got] == [flat(s) for s in reference], f"D={dp}"


def test_checkpoint_mid_step_and_mid_window_resumes_exactly():
    pipe = budget_pipeline(window=20)  # windows of 20 records, chunks of 8: windows end mid-chunk
    with pipe.loader() as loader:
        for _ in range(13):  # three global steps of four lanes, and lane 0 of the fourth
            next(loader)
        ck = loader.checkpoint()
        rest = [next(loader) for _ in range(23)]
    held = [len(lane["ops"]["batch"]["partial"]) for lane in ck["lanes"].values()]
    assert all(0 < n < 20 for n in held)  # every lane is mid-window
    with pipe.loader(ck) as resumed:
        again = [next(resumed) for _ in range(23)]
    assert [[r.meta for r in b.records] for b in again] == [[r.meta for r in b.records] for b in rest]


def test_workers_give_the_same_microbatches_as_inline():
    inline = [flat(s) for _, s in zip(range(8), budget_pipeline(2, window=8).steps())]
    with budget_pipeline(2, window=8, workers=2).loader() as loader:
        workers = [flat(s) for _, s in zip(range(8), loader.steps())]
    assert workers == inline


def test_to_training_pads_each_microbatch_to_its_own_longest_row():
    pipe = budget_pipeline(1, max_tokens=192)
    seen_rows = set()
    for _, batch in zip(range(30), pipe):
        n = np.array(lengths_of(batch))
        out = batch.to_training(
            return_labels=True, padding="longest", pad_to_multiple_of=8, position_mode="sequence", dtype=np.int64
        )
        width = max(8, math.ceil((n.max() - 1) / 8) * 8) if n.max() > 1 else out["input_ids"].shape[1]
        assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (len(n), width)
        assert out["input_ids"].size <= 192 and slots(batch, 8) <= 192
        seen_rows.add(len(n))
        for i, rec in enumerate(batch.records):
            ids, k = rec.payload["input_ids"], len(rec.payload["input_ids"])
            real = min(k, width)  # inputs are the padded row without its last slot
            assert out["attention_mask"][i].tolist() == [1] * real + [0] * (width - real)
            assert out["input_ids"][i, :real].tolist() == ids[:real].tolist()
            assert out["labels"][i, : max(k - 1, 0)].tolist() == ids[1:].tolist()
            assert (out["labels"][i, max(k - 1, 0) :] == -100).all()
            assert out["positions"][i, :real].tolist() == list(range(real))
    assert len(seen_rows) >= 2


def test_the_budget_is_in_the_fingerprint_explain_and_stats():
    pipe = budget_pipeline(2, window=16)
    ops = pipe.fingerprint()["operators"]
    assert "max_tokens" not in str(Batch(4).fingerprint())  # fixed-size batching keeps its fingerprint
    with pipe.loader() as loader:
        for _, _step in zip(range(5), loader.steps()):
            pass
        ck = loader.checkpoint()
        stats = loader.stats()
    assert ops != budget_pipeline(2, window=32).fingerprint()["operators"]
    with pytest.raises(ValueError, match="sort_window"):
        budget_pipeline(2, window=32).loader(ck)
    text = str(pipe.explain())
    assert "microbatches of up to 96 token slots" in text and "sorted 16 records at a time" in text
    assert pipe.explain().to_dict()["lanes"]["token_slots_per_global_step"] == 2 * 96
    b = stats["batching"]["batch"]
    counters = stats["operators"]["batch"]
    assert b["rows_per_microbatch"] == counters["rows"] / counters["batches"]
    assert b["padding_waste"] == 1 - counters["real_tokens"] / counters["padded_slots"]
    assert 0 < b["budget_fill"] <= 1 and "budget fill" in loader.stats_table()


def test_what_needs_a_fixed_step_size_is_refused_with_the_fix():
    from zephon.io import Dataset
    from zephon.plan import Plan
    from zephon.work import MixtureSchedule

    rows = [{"input_ids": [1] * (1 + i % 5)} for i in range(40)]
    datasets = [Dataset.from_rows("a", rows), Dataset.from_rows("b", rows)]
    by_step = MixtureSchedule([(0, {"a": 1, "b": 0}), (10, {"a": 1, "b": 1})])
    pipe = Pipeline(StaticMixtureWorkSource(datasets, by_step, exhausted_policy="repeat")).batch(max_tokens=64)
    with pytest.raises(ValueError, match=r"by='step'.*batch\(max_tokens=64\).*by='tokens'"):
        pipe.compile()
    plan = Plan([datasets[0]], {"a": 1})
    with pytest.raises(ValueError, match=r"fixed number of rows.*steps=\{lanes, microbatch_size"):
        plan.simulate(3, pipeline=Pipeline(rows).batch(max_tokens=64))
