"""Plans as values: printing, TOML/JSON documents, fingerprints, simulate against a real run, `zephon plan`."""

from __future__ import annotations

import json

import attrs
import pytest

from zephon import Pipeline
from zephon.cli.main import main
from zephon.pipeline.plan import Plan, StepShape
from zephon.testing import length_datasets, word_tokenizer
from zephon.work import MixtureSchedule, MixtureSpec


def write_datasets(folder, means=None, rows=300):
    out = []
    for d in length_datasets(means or {"web": 20, "books": 200}, rows, shards=3):
        (folder / d.name).mkdir(parents=True, exist_ok=True)
        for s in range(d.num_shards):
            rows_ = d.read(s, list(range(d.shard_sizes[s])))
            (folder / d.name / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
        out.append(d.name)
    return out


PLAN_TOML = """
seed = 7
exhausted_policy = { web = "repeat", books = "stop" }

[schedule]
by = "step"
interpolation = "step"
points = [[0, { web = 3, books = 1 }], [20, { web = 1, books = 1 }]]

[steps]
lanes = 2
microbatch_size = 4

[[datasets]]
name = "web"
path = "web"

[[datasets]]
name = "books"
path = "books"
"""


@pytest.fixture
def plan_file(tmp_path):
    write_datasets(tmp_path)
    path = tmp_path / "plan.toml"
    path.write_text(PLAN_TOML)
    return path


def test_a_plan_round_trips_through_toml_and_json_and_keeps_its_fingerprint(plan_file):
    plan = Plan.load(plan_file)
    assert isinstance(plan.mixture, MixtureSchedule) and plan.steps == StepShape(2, 4)
    again = Plan.from_toml(plan.to_toml())
    assert again.fingerprint() == plan.fingerprint() and again.to_dict() == plan.to_dict()
    assert Plan.from_json(plan.to_json()).fingerprint() == plan.fingerprint()
    other = attrs.evolve(plan, seed=8)
    assert other.fingerprint() != plan.fingerprint()
    text = str(plan)
    assert plan.fingerprint() in text and "at 20: web 0.5, books 0.5" in text and "'books' runs out" in text


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: "sead = 1\n" + t, r"the plan: unknown key\(s\) \['sead'\]"),
        (
            lambda t: t.replace('by = "step"', 'by = "step"\nramp = 2'),
            r"\[schedule\]: unknown key\(s\) \['ramp'\]",
        ),
        (
            lambda t: t.replace("lanes = 2", "lanes = 2\ngpus = 8"),
            r"steps: unknown key\(s\) \['gpus'\]",
        ),
        (lambda t: t + '\n[mixture]\nweights = { web = 1, books = 1 }\n', "exactly one of"),
        (
            lambda t: t.replace('name = "web"', 'name = "web"\nformat = "jsonl"'),
            r"\[datasets\]: unknown key\(s\) \['format'\]",
        ),
    ],
)
def test_unknown_keys_and_contradictions_are_errors(plan_file, edit, match):
    plan_file.write_text(edit(PLAN_TOML))
    with pytest.raises(ValueError, match=match):
        Plan.load(plan_file)


def test_in_memory_datasets_cannot_be_written_to_a_document():
    (d,) = length_datasets({"x": 5}, 10)
    with pytest.raises(ValueError, match="lives in memory"):
        Plan([d], {"x": 1}).to_dict()


def test_simulated_sample_counts_equal_a_real_run_exactly(plan_file):
    plan = Plan.load(plan_file)
    steps = 40
    pipe = Pipeline(plan).options(canonical_replicas=2).tokenize(word_tokenizer(), special_tokens="eos", eos_token_id=1).batch(4)
    sim = plan.simulate(steps, pipeline=pipe)
    loader = iter(pipe)
    batches = [b for _, b in zip(range(steps * 2), loader)]
    real = {n: 0 for n in plan.source().names}
    for b in batches:
        for r in b.records:
            real[plan.source().names[r.meta.segments[0].dataset]] += 1
    assert sim.samples == real
    assert {n: v["samples"] for n, v in loader.stats()["mixture"]["global"].items()} == real
    # the schedule shows: web 3:1 until step 20, 1:1 from the first block of lanes' chunks at or after it
    at = plan.source().point_positions[1][1] // 8  # 8 samples a step
    assert 20 <= at <= 20 + 64 // 4  # at most one block (chunk_size / microbatch_size steps) late
    early, late = sim.per_step[:20].sum(axis=0), sim.per_step[at:].sum(axis=0)
    assert early[0] > 2.5 * early[1] and abs(late[0] - late[1]) <= 0.2 * late.sum()
    assert sim.weights[0][1] == {"web": 0.75, "books": 0.25} and sim.weights[-1][1] == {"web": 0.5, "books": 0.5}
    # without a pipeline the plan's own steps give the same counts
    assert plan.simulate(steps).samples == real


def test_simulate_reports_epochs_and_exhaustion():
    ds = length_datasets({"a": 4, "b": 4}, 40, shards=2)
    plan = Plan(ds, {"a": 1, "b": 1}, exhausted_policy="repeat", steps={"lanes": 2, "microbatch_size": 5})
    sim = plan.simulate(20)
    assert sim.samples == {"a": 100, "b": 100}
    assert sim.epochs == {"a": 2.5, "b": 2.5}
    assert sim.exhausted_at["a"] == 7  # 40 samples of a after 8 steps of 10 samples, half a's
    assert "first pass ends at step" in sim.table()


def test_simulate_packed_steps_estimates_tokens_from_the_calibration():
    from zephon.work import Calibration
    from zephon.sources.estimate import DatasetEstimate

    ds = length_datasets({"a": 10, "b": 100}, 200, shards=2)
    cal = Calibration({"a": DatasetEstimate(1.0, 10.0), "b": DatasetEstimate(1.0, 100.0)})
    plan = Plan(ds, MixtureSpec({"a": 1, "b": 1}, unit="tokens"), exhausted_policy="repeat", calibration=cal, steps={"lanes": 2, "microbatch_size": 2, "sequence_length": 100})
    sim = plan.simulate(100)  # 40,000 tokens: 2,000 of a's samples, 200 of b's
    assert not sim.exact and abs(sim.samples["a"] - 2000) <= 10 and abs(sim.samples["b"] - 200) <= 2
    assert sim.tokens["a"] == pytest.approx(20000, rel=0.01)


def test_zephon_plan_command_prints_the_plan_and_its_simulation(plan_file, tmp_path, capsys):
    assert main(["plan", str(plan_file), "--steps", "40"]) == 0
    out = capsys.readouterr().out
    # the point at step 20 starts at the first block of 2 lanes' 64-sample chunks at or after it: step 32
    assert "first 40 global steps (2 lanes x 4 samples)" in out and "web" in out and "step 32: web 0.5000, books 0.5000" in out
    png = tmp_path / "shares.png"
    assert main(["plan", str(plan_file), "--steps", "30", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan_file.write_text("bogus = 1\n" + PLAN_TOML)
    assert main(["plan", str(plan_file), "--steps", "30"]) == 2
    assert "the plan: unknown key(s) ['bogus']" in capsys.readouterr().err


def test_zephon_plan_measures_a_token_plan_with_a_tokenizer(tmp_path, capsys):
    write_datasets(tmp_path)
    word_tokenizer().save(str(tmp_path / "tok.json"))
    text = PLAN_TOML.replace('interpolation = "step"', 'interpolation = "step"\nunit = "tokens"')
    (tmp_path / "plan.toml").write_text(text)
    assert main(["plan", str(tmp_path / "plan.toml"), "--steps", "10"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "plan.toml"), "--steps", "10", "--tokenizer", str(tmp_path / "tok.json")]) == 0
    out = capsys.readouterr().out
    assert "calibration (tokens per sample): web" in out and "token share" in out
