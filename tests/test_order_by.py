"""order_by: each lane's records sorted by a key inside consecutive windows (a sample-level curriculum).

Records here are ``_util.docs``: row ``i`` holds ``n`` tokens, so a record's row is its identity and
its token count is its length. Windows are cut in arrival order; the tail of a finite lane is a
last, shorter window.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from _util import docs, global_steps, toks_to_ids
from zephon import Pipeline, merge_checkpoints, ops
from zephon.io import Dataset
from zephon.ops import FingerprintWarning, OrderBy, token_count
from zephon.testing import assert_checkpoint_equivalence, check_operator, outputs_equal, records_from, run
from zephon.types import Meta, Record, Segment
from zephon.work import MixtureSchedule, StaticMixtureWorkSource

LENGTHS = [5, 3, 9, 3, 0, 7, 1, 3, 8, 2, 6, 4, 3]


def rows_of(outputs):
    return [r.meta.segments[0].row for r in outputs]


def windows(records, size):
    return [records[i : i + size] for i in range(0, len(records), size)]


# -- the operator ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 4, 5, 13, 50])
def test_each_window_is_sorted_and_every_record_is_emitted_once_unchanged(window):
    records = docs(LENGTHS)
    state, out = run(OrderBy(token_count, window=window), [records])
    by_length = lambda r: (len(r.payload["input_ids"]), r.meta.segments)  # noqa: E731
    want = [r for w in windows(records, window) for r in sorted(w, key=by_length)]
    assert rows_of(out) == rows_of(want)  # the tail (13 % window records) is sorted and emitted too
    assert all(a is b for a, b in zip(out, want)), "order_by passes records through unchanged"
    assert OrderBy(token_count, window=window).report(state) == {
        "buffered": 0, "windows": -(-len(records) // window), "emitted": len(records)
    }


def test_a_window_is_emitted_as_it_fills_and_the_rest_waits():
    op = OrderBy(token_count, window=4)
    state, out = op.step(op.init(0), docs(LENGTHS[:6]))
    assert rows_of(out) == [1, 3, 0, 2]
    assert rows_of(state.buffer) == [4, 5] and op.report(state)["buffered"] == 2


def test_ties_go_by_record_identity_whatever_the_arrival_order():
    same = docs([2] * 6)
    arrivals = [same[i] for i in (4, 1, 5, 0, 3, 2)]
    assert rows_of(run(OrderBy(token_count, window=6), [arrivals])[1]) == [0, 1, 2, 3, 4, 5]
    # Identity is the whole meta: dataset before shard before row.
    metas = [Meta(0, (Segment(d, s, r, 0, 0, -1),)) for d, s, r in [(1, 0, 0), (0, 1, 0), (0, 0, 7), (0, 0, 2)]]
    recs = [Record({"k": 1}, m) for m in metas]
    out = run(OrderBy("k", window=4), [recs])[1]
    assert [r.meta.segments[0][:3] for r in out] == [(0, 0, 2), (0, 0, 7), (0, 1, 0), (1, 0, 0)]


def test_reverse_sorts_descending_and_keeps_ties_by_identity():
    records = docs(LENGTHS)
    out = run(OrderBy(token_count, window=13, reverse=True), [records])[1]
    assert [len(r.payload["input_ids"]) for r in out] == sorted(LENGTHS, reverse=True)
    threes = [r for r in rows_of(out) if LENGTHS[r] == 3]
    assert threes == [1, 3, 7, 12]


def test_a_field_name_orders_by_that_fields_value():
    scores = [0.5, np.float32(-1.5), 2, np.int64(0), float("inf"), -3]
    records = records_from([{"score": s, "i": i} for i, s in enumerate(scores)])
    assert [r.payload["i"] for r in run(OrderBy("score", window=6), [records])[1]] == [5, 1, 3, 0, 2, 4]
    texts = records_from([{"t": t} for t in ("pear", "apple", "fig")])
    assert [r.payload["t"] for r in run(OrderBy("t", window=3), [texts])[1]] == ["apple", "fig", "pear"]


def test_a_function_key_may_return_a_tuple():
    records = records_from([{"a": a, "b": b} for a, b in [(1, "z"), (0, "y"), (1, "a"), (0, "b")]])
    out = run(OrderBy(lambda p: (p["a"], p["b"]), window=4), [records])[1]
    assert [(r.payload["a"], r.payload["b"]) for r in out] == [(0, "b"), (0, "y"), (1, "a"), (1, "z")]


def test_token_count_counts_the_token_field_an_envelope_or_a_sequence():
    assert token_count({"input_ids": np.zeros(7), "text": "..."}) == 7
    assert token_count({"tokens": [1, 2]}) == 2
    assert token_count({"packed_samples": [{"input_ids": [1, 2]}, {"input_ids": [3]}]}) == 3
    assert token_count([4, 5, 6]) == 3
    with pytest.raises(ValueError, match=r"no token field .* put order_by after tokenize\(\)"):
        token_count({"text": "hello"})


@pytest.mark.parametrize(
    "value, error, message",
    [
        (None, TypeError, r"the key returned NoneType None for the record from dataset 0, shard 0, row 2 .*an int"),
        ([1, 2], TypeError, r"returned list \[1, 2\] for the record from dataset 0, shard 0, row 2"),
        (np.arange(3), TypeError, r"returned ndarray .* row 2 .*zephon.ops.token_count"),
        (float("nan"), ValueError, r"the key returned NaN for the record from dataset 0, shard 0, row 2 .*not sort"),
        ((1, np.float64("nan")), ValueError, r"NaN for the record from dataset 0, shard 0, row 2"),
        ((1, [2]), TypeError, r"returned list \[2\] for the record from dataset 0, shard 0, row 2"),
    ],
)
def test_a_key_value_that_does_not_sort_is_an_error_naming_the_record(value, error, message):
    records = records_from([{"k": 1}, {"k": 2}, {"k": value}, {"k": 0}])
    with pytest.raises(error, match=message):
        run(OrderBy("k", window=4), [records])


def test_keys_that_do_not_compare_name_both_records():
    records = records_from([{"k": 1}, {"k": 2}, {"k": "x"}])
    clash = r"do not compare: 1 for the record from dataset 0, shard 0, row 0 .* 'x' for .* row 2"
    with pytest.raises(TypeError, match=clash):
        run(OrderBy("k", window=3), [records])


def test_a_missing_field_and_a_failing_key_name_the_record():
    records = records_from([{"k": 1}, {"j": 2}])
    with pytest.raises(ValueError, match=r"key field 'k' missing; payload keys are \['j'\]") as info:
        run(OrderBy("k", window=2), [records])
    assert "row 1" in "\n".join(getattr(info.value, "__notes__", []))

    def failing(p):
        return 1 / p["k"]

    with pytest.raises(ZeroDivisionError) as info:
        run(OrderBy(failing, window=2), [records_from([{"k": 1}, {"k": 0}])])
    assert "order_by's key on the record from dataset 0, shard 0, row 1" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8", None])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match=r"order_by: window must be an int >= 1, got"):
        OrderBy("length", window=window)
    with pytest.raises(ValueError, match=r"order_by: window must be an int >= 1"):
        Pipeline([{"length": 1}]).order_by("length", window)


def test_a_bad_key_or_direction_is_refused():
    with pytest.raises(TypeError, match=r"key must be a function of the payload or a field name, got int"):
        OrderBy(3, window=4)
    with pytest.raises(ValueError, match="must not be empty"):
        OrderBy("", window=4)
    with pytest.raises(TypeError, match="reverse must be True or False"):
        OrderBy("length", window=4, reverse="yes")


def test_it_passes_the_operator_checks_and_restores_mid_window():
    records = docs(LENGTHS)
    check_operator(OrderBy(token_count, window=4), records)
    check_operator(OrderBy(token_count, window=5, reverse=True), records, chunk_size=2)
    # A state holding part of a window restores and gives the same rest of the stream.
    assert_checkpoint_equivalence(OrderBy(token_count, window=6), [records[:2], records[2:9], records[9:]])


def test_a_restore_refuses_a_full_window_or_a_phase_past_the_drains():
    op = OrderBy(token_count, window=2)
    state = op.encode_state(op.step(op.init(0), docs([1]))[0])
    with pytest.raises(ValueError, match="holds 2 records, but order_by emits its window as soon as 2"):
        op.decode_state({**state, "buffer": state["buffer"] * 2}, lambda metas: [])
    with pytest.raises(ValueError, match="field 'phase' is 1, past the 0 schedule switch"):
        op.decode_state({**state, "phase": 1}, lambda metas: [])
    with pytest.raises(ValueError, match="field 'emitted' must be an int >= 0"):
        op.decode_state({**state, "emitted": -1}, lambda metas: [])


def test_a_window_never_holds_records_of_two_schedule_phases():
    records = docs(LENGTHS)
    out = run(OrderBy(token_count, window=4, drains=(3, 10)), [records])[1]
    # Windows: rows 0-2 (closed early at the switch at sample 3), 3-6, 7-9 (closed at 10), 10-12.
    want = [sorted(w, key=lambda r: (LENGTHS[r], r)) for w in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12])]
    assert rows_of(out) == [r for w in want for r in w]


# -- in a pipeline -----------------------------------------------------------------------------------------


def source(n=96, policy=None):
    rng = np.random.default_rng(0)
    rows = [{"toks": list(range(int(rng.integers(0, 30)))), "score": int(rng.integers(0, 5))} for _ in range(n)]
    data = Dataset.from_dict("web", {"a": rows[: n // 2], "b": rows[n // 2 :]})
    return StaticMixtureWorkSource([data], {"web": 1.0}, chunk_size=8, seed=1, exhausted_policy=policy)


def curriculum(lanes=2, window=5, key=token_count, rows=96, **options):
    return (
        Pipeline(source(rows))
        .options(canonical_replicas=lanes, **options)
        .map(toks_to_ids)
        .order_by(key, window, name="curriculum")
        .batch(2, drop_last=False)
    )


def lane_records(batches, lane):
    return [r for b in batches if b.lane == lane for r in b.records]


def test_in_a_pipeline_each_lane_is_sorted_window_by_window_and_keeps_its_tail():
    plain = list(Pipeline(source()).options(canonical_replicas=2).map(toks_to_ids).batch(2, drop_last=False))
    ordered = list(curriculum())
    for lane in (0, 1):
        arrived, got = lane_records(plain, lane), lane_records(ordered, lane)
        assert len(arrived) % 5, "the lane ends in a partial window"
        by_tokens = lambda r: (token_count(r.payload), r.meta.segments)  # noqa: E731
        want = [r for w in windows(arrived, 5) for r in sorted(w, key=by_tokens)]
        assert outputs_equal(got, want)


def test_a_checkpoint_mid_window_resumes_exactly():
    full, mid_window = list(curriculum(rows=48, read_size=4)), 0
    for k in range(len(full) + 1):  # windows of 5 records, batches of 2
        loader = iter(curriculum(rows=48, read_size=4))
        taken = [next(loader) for _ in range(k)]
        ck = json.loads(json.dumps(loader.checkpoint()))
        mid_window += any(lane["ops"]["curriculum"]["buffer"] for lane in ck["lanes"].values())
        assert outputs_equal(taken + list(curriculum(rows=48, read_size=3).loader(ck)), full), f"resume after {k} batches"
    assert mid_window > len(full) // 2, "most checkpoints hold part of a window"


def test_worker_processes_give_the_inline_batches_and_restore():
    inline = list(curriculum())
    with curriculum(workers=2).loader() as loader:
        assert outputs_equal(list(loader), inline)
    with curriculum(workers=2).loader() as loader:
        taken = [next(loader) for _ in range(7)]
        ck = json.loads(json.dumps(loader.checkpoint()))
    assert outputs_equal(taken + list(curriculum().loader(ck)), inline)


def with_ids(payload):
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32), "score": payload["score"]}


def endless(window=6):
    return Pipeline(source(policy="repeat")).map(with_ids).order_by("score", window).batch(2)


def test_every_data_parallel_size_gives_the_same_global_batches_and_resumes_on_another():
    reference, _ = global_steps(endless, 4, 1, 12)
    for dp in (2, 4):
        steps, _ = global_steps(endless, 4, dp, 12)
        assert all(outputs_equal(a, b) for a, b in zip(steps, reference)), f"D={dp}"
    first, loaders = global_steps(endless, 4, 2, 5)
    ck = merge_checkpoints([loader.checkpoint() for loader in loaders])
    rest, _ = global_steps(endless, 4, 4, 7, restore=ck)
    assert all(outputs_equal(a, b) for a, b in zip(first + rest, reference))


def make_key(k):
    return lambda p: len(p["input_ids"]) % k


def test_the_plan_changes_with_the_key_function_the_window_and_the_direction():
    base = curriculum(key=make_key(3)).fingerprint()
    assert base == curriculum(key=make_key(3)).fingerprint()
    assert base != curriculum(key=make_key(4)).fingerprint()
    assert base != curriculum(key=lambda p: -len(p["input_ids"])).fingerprint()
    assert base != curriculum(key=make_key(3), window=6).fingerprint()
    ids = Pipeline(source()).map(toks_to_ids)
    forward, reverse = (ids.order_by(make_key(3), 5, reverse=r, name="curriculum").batch(2) for r in (False, True))
    assert forward.fingerprint() != reverse.fingerprint()
    assert curriculum(key="score").fingerprint()["operators"][1][1]["key"] == {"field": "score"}


def checkpoint_of(pipe, n=3):
    loader = iter(pipe)
    for _ in range(n):
        next(loader)
    return loader.checkpoint()


@pytest.mark.parametrize(
    "after, message",
    [
        (curriculum(key=make_key(4)), "order_by 'curriculum': closure cell 'k' differs"),
        (curriculum(key=lambda p: 0), "order_by 'curriculum': the code differs"),
        (curriculum(key=make_key(3), window=4), "order_by 'curriculum': setting 'window' differs"),
    ],
)
def test_a_restore_into_another_key_or_window_is_refused_naming_it(after, message):
    ck = checkpoint_of(curriculum(key=make_key(3)))
    assert outputs_equal(list(curriculum(key=make_key(3)).loader(ck)), list(curriculum(key=make_key(3)))[3:])
    with pytest.raises(ValueError, match=message):
        after.loader(ck)


def test_a_key_holding_an_undescribable_value_warns_and_refuses_until_named(tmp_path):
    with open(tmp_path / "f.txt", "w") as f:

        def by_length(p):
            f.flush()
            return len(p["input_ids"])

        warned = r"order_by 'curriculum'.*TextIOWrapper.*order_by\(\.\.\., fingerprint='v1'\)"
        with pytest.warns(FingerprintWarning, match=warned):
            unnamed = curriculum(key=by_length)
        with pytest.raises(ValueError, match=r"order_by 'curriculum' holds a value its fingerprint cannot describe"):
            unnamed.loader(checkpoint_of(unnamed))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FingerprintWarning)
            named = Pipeline(source()).map(toks_to_ids).order_by(by_length, 5, name="curriculum", fingerprint="v1")
            named = named.batch(2)
        assert named.fingerprint()["operators"][1][1]["key"] == "v1"
        assert outputs_equal(list(named.loader(checkpoint_of(named))), list(named)[3:])


def test_explain_and_stats_show_the_window():
    pipe = curriculum(window=7)
    text = str(pipe.explain())
    assert "curriculum: OrderBy" in text and "window=7" in text and "up to 6 records (the open window)" in text
    (entry,) = [o for o in pipe.explain().to_dict()["operators"] if o["name"] == "curriculum"]
    assert entry["data_settings"]["window"] == 7 and entry["data_settings"]["reverse"] is False
    with pipe.loader() as loader:
        delivered = sum(len(b) for b in loader)
        counters = loader.stats()["operators"]["curriculum"]
    assert counters["emitted"] == delivered and counters["buffered"] == 0 and counters["windows"] >= delivered // 7


def test_under_a_schedule_no_window_mixes_two_phases():
    def ds(name):
        return Dataset.from_dict(name, {"0": [{"toks": list(range(1 + i % 9))} for i in range(200)]})

    schedule = MixtureSchedule([(0, {"a": 1, "b": 0}), (10, {"a": 0, "b": 1})])
    src = StaticMixtureWorkSource([ds("a"), ds("b")], schedule, exhausted_policy="repeat", chunk_size=4, seed=3)
    pipe = Pipeline(src).options(canonical_replicas=2).map(toks_to_ids).order_by(token_count, 7).batch(2)
    (op,) = [op for name, op in pipe.plan.chain.children if name == "order_by"]
    assert op.drains == (20,)  # global step 10 of 4 samples is sample 40, lane sample 20: inside a window
    by_lane: dict[int, list[int]] = {}
    for _, b in zip(range(40), pipe):
        by_lane.setdefault(b.lane, []).extend(r.meta.segments[0].dataset for r in b.records)
    for lane, datasets in by_lane.items():
        assert datasets == sorted(datasets) and 1 in datasets, f"lane {lane} moved a record across the switch"


def test_a_config_file_names_the_key_by_field_or_by_function(tmp_path):
    from zephon.pipeline.config import pipeline_from_config

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("".join(json.dumps({"n": i % 3}) + "\n" for i in range(9)))
    source = {"datasets": [{"name": "toy", "path": "data"}]}
    by_field = {"op": "order_by", "key": "n", "window": 4, "reverse": True}
    by_function = {"op": "order_by", "function": "zephon.ops:token_count", "window": 4}
    pipe = pipeline_from_config({"source": source, "operators": [by_field]}, base=tmp_path)
    assert pipe.operators[0][1] == OrderBy("n", window=4, reverse=True)
    arrived = list(pipeline_from_config({"source": source}, base=tmp_path))
    by_identity = lambda w: sorted(w, key=lambda r: r.meta.segments)  # noqa: E731
    want = [r for w in windows(arrived, 4) for r in sorted(by_identity(w), key=lambda r: r.payload["n"], reverse=True)]
    assert outputs_equal(list(pipe), want)
    pipe = pipeline_from_config({"source": source, "operators": [by_function]}, base=tmp_path)
    assert pipe.operators[0][1].key is ops.token_count
    with pytest.raises(ValueError, match=r"operators\[0\] \(order_by\): give key \(a field name\) or function"):
        pipeline_from_config({"source": source, "operators": [{**by_field, **by_function}]}, base=tmp_path)
