"""Sequence-length warmup: pack_flat(max_length=LengthSchedule(...)) with batch(tokens_per_microbatch=T).

The toy source (documents of 0-39 tokens, some empty) mapped to ``input_ids``; rows hold 5, then 9,
then 17 tokens, and every microbatch holds T = 16 training tokens (4, 2, then 1 row).
"""

import numpy as np
import pytest

from _util import docs, global_steps, toks_to_ids, toy_dataset
from zephon import LengthSchedule, Pipeline
from zephon.ops import Batch, PackFlat
from zephon.testing import assert_chunking_invariance, run
from zephon.work import StaticMixtureWorkSource

SCHEDULE = LengthSchedule([(0, 5), (3, 9), (6, 17)])
T = 16


def source(seed=0):
    return StaticMixtureWorkSource([toy_dataset()], {"web": 1.0}, seed=seed, chunk_size=8, exhausted_policy="repeat")


def warmup(lanes=2, *, schedule=SCHEDULE, tokens=T, workers=0):
    return (
        Pipeline(source())
        .options(canonical_replicas=lanes, workers=workers)
        .map(toks_to_ids)
        .pack_flat(schedule)
        .batch(tokens_per_microbatch=tokens)
    )


def content(step):
    """A global step as comparable values: per microbatch, its rows' metas and tokens."""
    return [[(r.meta, r.payload["input_ids"].tolist()) for r in b.records] for b in step]


def take(loader_steps, n):
    return [content(s) for _, s in zip(range(n), loader_steps)]


def test_row_lengths_follow_the_schedule_and_every_microbatch_holds_T_tokens():
    for step, batches in enumerate(warmup(lanes=2).steps()):
        if step == 10:
            break
        length = SCHEDULE.length_at(step)
        assert len(batches) == 2
        for b in batches:
            lengths = {len(r.payload["input_ids"]) for r in b.records}
            assert lengths == {length}, f"step {step}"
            assert len(b.records) * (length - 1) == T
            assert all(r.meta.padding_length == 0 for r in b.records)


def test_no_token_is_lost_or_repeated_across_a_switch():
    stream = [r.payload["input_ids"] for _, r in zip(range(400), Pipeline(source()).map(toks_to_ids))]
    documents = np.concatenate(stream).tolist()
    rows = [r for _, step in zip(range(12), warmup(lanes=1).steps()) for r in step[0].records]
    packed = np.concatenate([r.payload["input_ids"] for r in rows]).tolist()
    assert packed == documents[: len(packed)]  # the rows, concatenated, are the document stream
    fixed = Pipeline(source()).map(toks_to_ids).pack_flat(17).batch(1)
    same = np.concatenate([b.records[0].payload["input_ids"] for _, b in zip(range(40), fixed)]).tolist()
    assert packed == same[: len(packed)]
    pieces = [s for r in rows for s in r.meta.segments]  # consecutive ranges: a cut piece resumes where it stopped
    for a, b in zip(pieces, pieces[1:]):
        assert (b.start == a.end and b.row == a.row) or b.start == 0


@pytest.mark.parametrize("delivered", [5, 6, 7, 8, 13])  # global steps 2, 3 (the switch), 4 done; and mid-step
def test_a_checkpoint_before_at_and_after_a_switch_resumes_exactly(delivered):
    pipe = warmup(lanes=2)
    with pipe.loader() as loader:
        for _ in range(delivered):
            next(loader)
        ck = loader.checkpoint()
        rest = [content([next(loader)]) for _ in range(10)]
    with pipe.loader(ck) as resumed:
        again = [content([next(resumed)]) for _ in range(10)]
    assert again == rest


def test_the_same_global_batches_for_any_number_of_ranks():
    make = lambda: warmup(lanes=4)  # noqa: E731
    reference, _ = global_steps(make, 4, 1, 9)
    for dp in (2, 4):
        got, _ = global_steps(make, 4, dp, 9)
        assert [content(s) for s in got] == [content(s) for s in reference], f"D={dp}"


def test_workers_give_the_same_batches_as_inline():
    inline = take(warmup(lanes=2).steps(), 8)
    with warmup(lanes=2, workers=2).loader() as loader:
        assert take(loader.steps(), 8) == inline


def test_the_operator_alone_is_chunking_invariant_and_places_rows_by_step():
    op = PackFlat(SCHEDULE, tokens_per_microbatch=T)
    records = docs([3, 30, 7, 0, 12, 25, 2, 40, 9, 18] * 3)
    for cuts in ([1, 2, 3], [5, 11, 17, 29], list(range(30))):
        assert_chunking_invariance(op, records, cuts)
    _, rows = run(op, [records])
    assert [len(r.payload["input_ids"]) for r in rows] == [SCHEDULE.row_length(i, T) for i in range(len(rows))]
    assert [SCHEDULE.step_of_row(i, T) for i in (0, 11, 12, 17, 18, 19)] == [0, 2, 3, 5, 6, 7]
    assert PackFlat([[0, 5], [3, 9], [6, 17]], tokens_per_microbatch=T) == op  # a config document's list


def test_a_fixed_max_length_takes_T_over_length_minus_one_rows():
    pipe = Pipeline(source()).map(toks_to_ids).pack_flat(9).batch(tokens_per_microbatch=32)
    assert {len(b.records) for _, b in zip(range(5), pipe)} == {4}


def test_the_schedule_is_in_the_fingerprint_and_explain():
    other = warmup(schedule=LengthSchedule([(0, 5), (4, 9), (6, 17)]))
    assert warmup().fingerprint() != other.fingerprint()
    with warmup().loader() as loader:
        next(loader)
        ck = loader.checkpoint()
    with pytest.raises(ValueError):
        other.loader(ck)
    text = str(warmup().explain())
    assert "from step 3: rows of 9 tokens, 2 per microbatch" in text and "16 training tokens per microbatch" in text
    lanes = warmup().explain().to_dict()["lanes"]
    assert lanes["row_lengths"][2] == {"from_step": 6, "length": 17, "rows_per_microbatch": 1}


@pytest.mark.parametrize(
    "points, message",
    [
        ([(0, 9), (0, 17)], "increase strictly"),
        ([(0, 9), (5, 17), (3, 5)], "increase strictly"),
        ([(1, 9)], "first point must be at step 0"),
        ([(0, 1)], "length must be an int >= 2"),
        ([], "non-empty list"),
    ],
)
def test_a_malformed_schedule_is_refused(points, message):
    with pytest.raises(ValueError, match=message):
        LengthSchedule(points)


def test_tokens_that_do_not_divide_a_phase_are_refused_naming_its_step():
    with pytest.raises(ValueError, match="phase from step 3.*common multiple"):
        warmup(schedule=LengthSchedule([(0, 5), (3, 11)]))
    with pytest.raises(ValueError, match=r"max_length=10\): 16 is not a multiple of 10 - 1 = 9"):
        Pipeline(source()).map(toks_to_ids).pack_flat(10).batch(tokens_per_microbatch=16)


@pytest.mark.parametrize(
    "between, name",
    [(lambda p: p.shuffle(8), "shuffle"), (lambda p: p.map(lambda x: x), "map"), (lambda p: p.filter(bool), "filter")],
)
def test_an_operator_between_pack_flat_and_batch_is_refused(between, name):
    pipe = between(Pipeline(source()).map(toks_to_ids).pack_flat(SCHEDULE))
    with pytest.raises(ValueError, match=f"{name}.*move them before pack_flat"):
        pipe.batch(tokens_per_microbatch=T)


def test_a_schedule_needs_batch_by_tokens_and_nothing_else():
    packed = Pipeline(source()).map(toks_to_ids).pack_flat(SCHEDULE)
    with pytest.raises(ValueError, match=r"batch\(microbatch_size=4\).*tokens_per_microbatch"):
        packed.batch(4)
    with pytest.raises(ValueError, match=r"batch\(max_tokens=64\)"):
        packed.batch(max_tokens=64)
    with pytest.raises(ValueError, match="needs batch"):
        packed.plan  # noqa: B018
    with pytest.raises(ValueError, match="exclude each other"):
        Batch(4, tokens_per_microbatch=T)
    with pytest.raises(ValueError, match="exclude each other"):
        Batch(max_tokens=64, tokens_per_microbatch=T)
    with pytest.raises(ValueError, match="no pack_flat"):
        Pipeline(source()).map(toks_to_ids).batch(tokens_per_microbatch=T)
    with pytest.raises(ValueError, match="algorithm='wrap'"):
        PackFlat(SCHEDULE, algorithm="first_fit", num_bins=2, pad_token_id=0)
    with pytest.raises(ValueError, match="pack_flat rows"):
        Pipeline(source()).pack_sequences(SCHEDULE)
    with pytest.raises(ValueError, match="needs tokens_per_microbatch"):
        run(PackFlat(SCHEDULE), [docs([30])])


def test_the_end_of_data_pads_the_last_row_to_its_steps_length():
    src = StaticMixtureWorkSource([toy_dataset(n=40)], {"web": 1.0}, chunk_size=8, exhausted_policy="stop")
    total = sum(len(r.payload["input_ids"]) for r in Pipeline(src).map(toks_to_ids))
    schedule = LengthSchedule([(0, 5), (2, 9), (4, 17)])
    pipe = Pipeline(src).map(toks_to_ids).pack_flat(schedule, pad_token_id=0)
    pipe = pipe.batch(tokens_per_microbatch=T, drop_last=False)
    steps = list(pipe)
    rows = [r for b in steps for r in b.records]
    assert sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in rows) == total  # every token, once
    for step, b in enumerate(steps):
        assert all(len(r.payload["input_ids"]) == schedule.length_at(step) for r in b.records)
    assert rows[-1].meta.padding_length > 0 and all(r.meta.padding_length == 0 for r in rows[:-1])


def test_simulate_counts_the_tokens_of_every_phase():
    from zephon.pipeline.plan import Plan, StepShape
    from zephon.sources.estimate import DatasetEstimate
    from zephon.testing import length_datasets
    from zephon.work import Calibration, MixtureSpec

    ds = length_datasets({"a": 10, "b": 100}, 200, shards=2)
    cal = Calibration({"a": DatasetEstimate(1.0, 10.0), "b": DatasetEstimate(1.0, 100.0)})
    steps = {"lanes": 2, "tokens_per_microbatch": 128, "sequence_length": [[0, 33], [50, 129]]}
    mix = MixtureSpec({"a": 1, "b": 1}, unit="tokens")
    plan = Plan(ds, mix, exhausted_policy="repeat", calibration=cal, steps=steps)
    assert plan.steps == StepShape(2, sequence_length=LengthSchedule([(0, 33), (50, 129)]), tokens_per_microbatch=128)
    sim = plan.simulate(100)
    packed = 50 * 2 * 4 * 33 + 50 * 2 * 1 * 129  # rows x length, every lane, per phase
    assert sum(sim.tokens.values()) == pytest.approx(packed, rel=0.01)
    assert "from step 50: rows of 129 tokens, 1 per microbatch" in sim.table()
    assert StepShape(**plan.steps.describe()) == plan.steps  # a [steps] table round-trips
    with pytest.raises(ValueError, match="phase from step 50"):
        Plan(ds, {"a": 1, "b": 1}, steps={**steps, "tokens_per_microbatch": 96})
    with pytest.raises(ValueError, match="leave out microbatch_size"):
        StepShape(2, 4, 33, tokens_per_microbatch=128)


def test_zephon_plan_shows_the_length_per_phase(tmp_path, capsys):
    from test_plan import write_datasets

    from zephon.cli.main import main
    from zephon.pipeline.plan import Plan
    from zephon.testing import word_tokenizer

    write_datasets(tmp_path)
    word_tokenizer().save(str(tmp_path / "tok.json"))
    (tmp_path / "plan.toml").write_text(
        'exhausted_policy = "repeat"\n\n[mixture]\nunit = "tokens"\nweights = { web = 1, books = 1 }\n\n'
        "[steps]\nlanes = 2\ntokens_per_microbatch = 64\nsequence_length = [[0, 17], [10, 65]]\n\n"
        '[[datasets]]\nname = "web"\npath = "web"\n\n[[datasets]]\nname = "books"\npath = "books"\n'
    )
    assert "sequence_length = [[0, 17], [10, 65]]" in Plan.load(tmp_path / "plan.toml").to_toml()
    assert main(["plan", str(tmp_path / "plan.toml"), "--steps", "20", "--tokenizer", str(tmp_path / "tok.json")]) == 0
    out = capsys.readouterr().out
    assert "first 20 global steps (2 lanes x 64 training tokens per microbatch)" in out
    assert "from step 0: rows of 17 tokens, 4 per microbatch" in out and "from step 10: rows of 65 tokens, 1" in out


def test_a_mixture_schedule_by_step_needs_a_fixed_step_size():
    from zephon.work import MixtureSchedule

    datasets = [toy_dataset(name="web"), toy_dataset(seed=1, name="books")]
    mixture = MixtureSchedule([(0, {"web": 1, "books": 0}), (5, {"web": 0, "books": 1})])
    src = StaticMixtureWorkSource(datasets, mixture, chunk_size=8, exhausted_policy="repeat")
    with pytest.raises(ValueError, match="by='tokens'"):
        Pipeline(src).map(toks_to_ids).pack_flat(SCHEDULE).batch(tokens_per_microbatch=T).plan  # noqa: B018
