"""Laws of token mixtures and schedules (with and without ensure_mixture following them): the same
global batches for every D dividing L, any read chunking and any resume step; calibration frozen across resumes; the fingerprint refuses another
plan except through change_plan."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _budget import examples
from _util import global_steps
from zephon import Pipeline
from zephon.io import Dataset
from zephon.testing import word_tokenizer
from zephon.work import MixtureSchedule, MixtureSpec, StaticMixtureWorkSource

TOK = word_tokenizer(64)
NAMES = "abcd"


def dataset(name, n, mean, seed):
    rows = [{"text": " ".join(f"w{(seed + i * 7 + k) % 64}" for k in range(1 + (i * 13 + seed) % (2 * mean)))} for i in range(n)]
    half = n // 2
    return Dataset.from_dict(name, {"0": rows[:half], "1": rows[half:]})


@st.composite
def plans(draw):
    k = draw(st.integers(2, 4))
    means = [draw(st.sampled_from([2, 6, 20])) for _ in range(k)]
    sizes = [draw(st.integers(5, 30)) for _ in range(k)]
    weights = [draw(st.integers(1, 5)) for _ in range(k)]
    kind = draw(st.sampled_from(["tokens", "samples", "schedule", "linear"]))
    ensure = draw(st.booleans())
    lanes = draw(st.sampled_from([2, 4]))
    seed = draw(st.integers(0, 3))
    return dict(k=k, means=means, sizes=sizes, weights=weights, kind=kind, ensure=ensure, lanes=lanes, seed=seed)


def make(spec, *, weights=None):
    names = NAMES[: spec["k"]]
    ds = [dataset(n, s, m, spec["seed"] + i) for i, (n, s, m) in enumerate(zip(names, spec["sizes"], spec["means"]))]
    w = dict(zip(names, weights or spec["weights"]))
    if spec["kind"] in ("tokens", "samples"):
        mixture = MixtureSpec(w, unit=spec["kind"])
    else:
        later = dict(zip(names, reversed(list(w.values()))))
        mixture = MixtureSchedule([(0, w), (3, later)], interpolation="step" if spec["kind"] == "schedule" else "linear", unit="tokens")
    src = StaticMixtureWorkSource(ds, mixture, exhausted_policy="repeat", chunk_size=3, seed=spec["seed"])

    def build():
        p = Pipeline(src).tokenize(TOK, special_tokens="eos", eos_token_id=1)
        if spec["ensure"]:  # the source's weights or schedule, in the source's unit
            p = p.ensure_mixture(max_buffer_size=16, weight_by="samples" if spec["kind"] == "samples" else "auto")
        return p.pack_flat(12).shuffle(3, seed=1).batch(2)

    return build


def content(steps):
    return [[[r.meta for r in b.records] for b in step] for step in steps]


@settings(max_examples=examples(25))
@given(plans(), st.data())
def test_global_batches_are_the_same_for_every_rank_count_chunking_and_resume(spec, data):
    build = make(spec)
    L = spec["lanes"]
    steps = 8
    reference, _ = global_steps(build, L, 1, steps)
    D = data.draw(st.sampled_from([d for d in (1, 2, 4) if L % d == 0]), label="D")
    read = data.draw(st.sampled_from([1, 5, 64]), label="read_size")
    other, _ = global_steps(lambda: build().options(read_size=read), L, D, steps)
    assert content(other) == content(reference)
    # resume at any step, on another D: the rest is the same
    k = data.draw(st.integers(0, steps - 1), label="resume step")
    head, loaders = global_steps(build, L, 1, k)
    ck = loaders[0].checkpoint()
    D2 = data.draw(st.sampled_from([d for d in (1, 2, 4) if L % d == 0]), label="D after resume")
    rest, _ = global_steps(build, L, D2, steps - k, restore=ck)
    assert content(head + rest) == content(reference)


@settings(max_examples=examples(10))
@given(plans())
# A linear schedule whose ramp pieces once made the shuffle drain, at other positions once the plan changed.
@example(spec={"k": 2, "means": [2, 2], "sizes": [5, 5], "weights": [1, 2], "kind": "linear", "ensure": False, "lanes": 2, "seed": 1})
def test_calibration_is_frozen_and_other_weights_are_refused_except_by_change_plan(spec):
    from zephon.sources import calibrate as _calibrate

    build = make(spec)
    L = spec["lanes"]
    pipe = build().options(canonical_replicas=L)
    loader = iter(pipe)
    [next(loader) for _ in range(2 * L)]
    ck = loader.checkpoint()
    _calibrate._CACHE.clear()
    resumed = build().options(canonical_replicas=L).loader(ck)  # takes the numbers from the checkpoint
    assert resumed.plan.source.calibration == loader.plan.source.calibration
    changed_weights = [w + 1 if i == 0 else w for i, w in enumerate(spec["weights"])]
    other = make(spec, weights=changed_weights)().options(canonical_replicas=L)
    with pytest.raises(ValueError, match=r"the plan (and the processing )?differ"):
        other.loader(ck)
    new_pipe, ck2 = pipe.change_plan(other.source, from_step=4, checkpoint=ck)
    ref = [b for _, b in zip(range(2 * L), pipe.loader(ck))]
    got = [b for _, b in zip(range(2 * L), new_pipe.loader(ck2))]
    assert [[r.meta for r in b.records] for b in got] == [[r.meta for r in b.records] for b in ref]  # steps 2 and 3 (< from_step) unchanged
