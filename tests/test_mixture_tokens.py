"""Token-weighted mixing: calibration with the pipeline's tokenizer, frozen in fingerprint and checkpoint;
ensure_mixture's exact per-lane accounting; the achieved mixture in stats and checkpoints."""

from __future__ import annotations

import pytest

from zephon import Pipeline
from zephon.sources import calibrate as _calibrate
from zephon.ops.mixing import EnsureMixture
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, length_datasets, word_tokenizer
from zephon.work import MixtureSpec, StaticMixtureWorkSource, TokenEstimation

TOK = word_tokenizer()


def datasets(rows=1500, means=None, seed=0):
    return length_datasets(means or {"short": 30, "long": 300}, rows, seed=seed)


def pipeline(weights=None, *, lanes=4, ensure=False, unit="tokens", rows=1500, estimation=None, policy="repeat", means=None):
    src = StaticMixtureWorkSource(
        datasets(rows, means), MixtureSpec(weights or {"short": 0.5, "long": 0.5}, unit=unit), exhausted_policy=policy,
        chunk_size=16, token_estimation=estimation,
    )
    p = Pipeline(src).options(canonical_replicas=lanes).tokenize(TOK, special_tokens="eos", eos_token_id=1)
    if ensure:
        p = p.ensure_mixture()
    return p.batch(4)


def run(p, steps):
    loader = iter(p)
    out = [b for _, b in zip(range(steps * p.run_options.canonical_replicas), loader)]
    return loader, out


def token_shares(loader):
    return {n: v["token_share"] for n, v in loader.stats()["mixture"]["global"].items()}


# -- calibration ---------------------------------------------------------------------------------------------


def test_calibration_measures_tokens_per_sample_with_the_pipelines_tokenizer():
    p = pipeline()
    cal = p.compile().source.calibration
    # length_datasets: words uniform in [m/2, 3m/2], one token per word, plus the EOS.
    assert cal.datasets["short"].tokens_per_sample == pytest.approx(31, rel=0.03)
    assert cal.datasets["long"].tokens_per_sample == pytest.approx(301, rel=0.03)
    assert cal.datasets["short"].rows == 1500 and not cal.datasets["short"].pinned
    fp = p.fingerprint()["source"]["token_estimation"]
    assert fp["long"]["tokens_per_byte"] == cal.datasets["long"].tokens_per_byte
    # deterministic: the same sample, the same numbers, in a fresh process cache too
    _calibrate._CACHE.clear()
    assert pipeline().compile().source.calibration == cal


def test_token_weights_become_sample_weights_tokens_over_tokens_per_sample():
    src = pipeline({"short": 0.5, "long": 0.5}).compile().source
    w = src.timeline.phases[0].weights
    tps = src.calibration.tokens_per_sample(src.names)
    assert w[0] / w[1] == pytest.approx(tps[1] / tps[0], rel=1e-3)


def test_pinned_tokens_per_byte_measure_only_bytes_and_need_no_tokenizer():
    src = StaticMixtureWorkSource(datasets(), MixtureSpec({"short": 1, "long": 1}, unit="tokens"), token_estimation=TokenEstimation(0.5))
    p = Pipeline(src).batch(2)  # no tokenize step: bytes only
    cal = p.compile().source.calibration
    assert all(e.pinned and e.tokens_per_byte == 0.5 for e in cal.datasets.values())
    assert cal.datasets["long"].bytes_per_sample > 8 * cal.datasets["short"].bytes_per_sample


def test_measuring_needs_a_tokenizer_and_says_how_to_pin():
    src = StaticMixtureWorkSource(datasets(), MixtureSpec({"short": 1, "long": 1}, unit="tokens"))
    with pytest.raises(ValueError, match="needs a tokenize step"):
        Pipeline(src).batch(2).compile()
    with pytest.raises(ValueError, match="TokenEstimation"):
        src.end  # the source alone cannot place samples yet


def test_a_resume_takes_the_calibration_from_the_checkpoint_and_never_measures(monkeypatch):
    loader, first = run(pipeline(), 6)
    ck = loader.checkpoint()
    rest = [b for _, b in zip(range(12), loader)]
    _calibrate._CACHE.clear()

    def refuse(*a, **k):
        raise AssertionError("a resume measured again")

    monkeypatch.setattr(_calibrate, "calibrate", lambda source, chain, **k: source if source.calibration else refuse())
    fresh = pipeline()
    resumed = [b for _, b in zip(range(12), fresh.loader(ck))]
    assert [[r.meta for r in b.records] for b in resumed] == [[r.meta for r in b.records] for b in rest]


def test_a_checkpoint_with_other_numbers_is_refused_as_a_plan_change():
    loader, _ = run(pipeline(), 2)
    ck = loader.checkpoint()
    other = pipeline(estimation=TokenEstimation({"short": 0.9}))
    with pytest.raises(ValueError, match=r"\(the plan differs\)(.|\n)*estimation(.|\n)*change_plan"):
        other.loader(ck)


# -- accuracy (small data; the benchmark measures 2M tokens) -------------------------------------------------


def test_calibrated_weights_hit_token_shares_within_one_percent():
    loader, _ = run(pipeline({"short": 0.7, "long": 0.3}, means={"short": 30, "long": 300}), 250)
    shares = token_shares(loader)
    assert abs(shares["short"] - 0.7) < 0.01 and abs(shares["long"] - 0.3) < 0.01
    # by samples, the same weights would be 10x off in tokens
    loader, _ = run(pipeline({"short": 0.7, "long": 0.3}, unit="samples"), 100)
    assert token_shares(loader)["short"] < 0.25


def test_ensure_mixture_hits_token_shares_within_a_fifth_of_a_percent():
    loader, _ = run(pipeline({"short": 0.7, "long": 0.3}, ensure=True), 250)
    shares = token_shares(loader)
    assert abs(shares["short"] - 0.7) < 0.002 and abs(shares["long"] - 0.3) < 0.002
    assert loader.stats()["operators"]["ensure_mixture"]["forced"] == 0
    for lane in loader.stats()["mixture"]["lanes"].values():  # every lane on target by itself
        assert abs(lane["short"]["token_share"] - 0.7) < 0.01


# -- ensure_mixture as an operator ------------------------------------------------------------------------------


def _records():
    from zephon.types import Meta, Record, Segment

    import numpy as np

    recs = []
    for i in range(60):
        d = 1 if i % 5 == 0 else 0
        n = 40 if d else 4 + i % 3
        recs.append(Record({"input_ids": np.arange(n, dtype=np.int32)}, Meta(0, (Segment(d, 0, i, 0, 0, -1),), 0)))
    return recs


def test_ensure_mixture_restores_from_every_point_and_ignores_chunking():
    op = EnsureMixture({"a": 1, "b": 1}, datasets=("a", "b"), max_buffer_size=8)
    recs = _records()
    assert_checkpoint_equivalence(op, [recs[i : i + 7] for i in range(0, len(recs), 7)])
    assert_chunking_invariance(op, recs, [1, 5, 13, 30])


def test_ensure_mixture_never_discards_and_counts_forced_emissions():
    from zephon.testing import run as run_op

    op = EnsureMixture({"a": 1, "b": 1}, datasets=("a", "b"), max_buffer_size=3)
    state, out = run_op(op, [_records()])
    assert sorted(r.meta.segments[0].row for r in out) == list(range(60))
    assert op.report(state)["forced"] > 0 and op.report(state)["buffered"] == 0
    with pytest.raises(ValueError, match="max_buffer_size"):
        EnsureMixture({"a": 1}, datasets=("a",), max_buffer_size=0)
    with pytest.raises(ValueError, match="does not match the datasets"):
        EnsureMixture({"a": 1, "c": 1}, datasets=("a", "b"))


def test_ensure_mixture_needs_tokens_with_weight_by_auto():
    src = StaticMixtureWorkSource(datasets(50), {"short": 1, "long": 1})
    with pytest.raises(ValueError, match="weights count samples and ensure_mixture balances tokens"):
        Pipeline(src).ensure_mixture()
    with pytest.warns(UserWarning, match="weights count samples"):
        p = Pipeline(src).ensure_mixture({"short": 1, "long": 1}).batch(2)
    with pytest.raises(ValueError, match="place it after tokenize"):
        next(iter(p))


# -- achieved mixture in stats and checkpoints ---------------------------------------------------------------


def test_achieved_mixture_is_in_stats_and_checkpoint_and_continues_after_restore():
    loader, got = run(pipeline(lanes=2), 10)
    stats = loader.stats()["mixture"]
    delivered_tokens = sum(len(r.payload["input_ids"]) for b in got for r in b.records)
    assert sum(v["tokens"] for v in stats["global"].values()) == delivered_tokens
    assert sum(v["samples"] for v in stats["global"].values()) == 80
    assert stats["target"] == {"short": 0.5, "long": 0.5} and stats["unit"] == "tokens"
    assert stats["global"]["long"]["epochs"] == stats["global"]["long"]["samples"] / 1500
    ck = loader.checkpoint()
    assert [sum(s["mixture"][i] for s in ck["lanes"].values()) for i in (0, 2)] == [stats["global"]["short"]["samples"], stats["global"]["long"]["samples"]]
    resumed = pipeline(lanes=2).loader(ck)
    assert resumed.stats()["mixture"]["global"] == stats["global"]
    [next(resumed) for _ in range(2)]
    assert sum(v["samples"] for v in resumed.stats()["mixture"]["global"].values()) == 88


def test_zephon_drain_options_are_accepted_and_validated():
    from zephon.testing import run as run_op

    recs = _records()
    plain = EnsureMixture({"a": 1, "b": 1}, datasets=("a", "b"), max_buffer_size=20)
    drained = EnsureMixture({"a": 1, "b": 1}, datasets=("a", "b"), max_buffer_size=20, obsolete_drain_rate=0.25)
    (s1, o1), (s2, o2) = run_op(plain, [recs]), run_op(drained, [recs])
    assert plain.report(s1)["forced"] == 0 and drained.report(s2)["forced"] > 0
    assert sorted(r.meta.segments[0].row for r in o1) == sorted(r.meta.segments[0].row for r in o2) == list(range(60))
    assert_checkpoint_equivalence(drained, [recs[i : i + 9] for i in range(0, 60, 9)])
    with pytest.raises(ValueError, match="drain_target_ratio"):
        EnsureMixture({"a": 1}, datasets=("a",), drain_target_ratio=1.0)
    with pytest.raises(ValueError, match="obsolete_drain_rate"):
        EnsureMixture({"a": 1}, datasets=("a",), obsolete_drain_rate=2)


def test_zephon_spelling_token_estimation_on_the_source_means_token_weights():
    src = StaticMixtureWorkSource(datasets(), {"short": 1, "long": 1}, token_estimation=TokenEstimation())
    assert src.unit == "tokens" and src.needs_calibration
    compiled = Pipeline(src).tokenize(TOK, special_tokens="eos", eos_token_id=1).batch(2).compile().source
    w = compiled.timeline.phases[0].weights
    assert w[0] > 8 * w[1]  # ten times more short samples for the same tokens
    explicit = StaticMixtureWorkSource(datasets(), MixtureSpec({"short": 1, "long": 1}, unit="samples"), token_estimation=TokenEstimation())
    assert explicit.unit == "samples"


def test_a_token_target_over_a_sample_weighted_source_warns_with_the_fix():
    src = StaticMixtureWorkSource(datasets(50), {"short": 1, "long": 1})
    with pytest.warns(UserWarning, match=r"weights count samples(.|\n)*MixtureSpec\(weights, unit='tokens'\)"):
        Pipeline(src).ensure_mixture({"short": 0.3, "long": 0.7})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipeline(src).ensure_mixture({"short": 1, "long": 1}, weight_by="samples")  # samples over samples: no warning
        tokens = StaticMixtureWorkSource(datasets(50), MixtureSpec({"short": 1, "long": 1}, unit="tokens"))
        Pipeline(tokens).ensure_mixture({"short": 0.3, "long": 0.7})
