"""Pipelines are values; loaders run them; operators and modules keep their shape."""

import warnings
from pathlib import Path

import attrs
import numpy as np
import pytest

import zephon
from zephon import Loader, Pipeline
from zephon.ops import Chain, MapOp, stateless
from zephon.testing import outputs_equal, run

from _util import docs, toy_pipeline


def _double(p):
    return {**p, "n": p["n"] * 2}


def _even(p):
    return p["n"] % 2 == 0


def _rows(n=20):
    return [{"n": i} for i in range(n)]


def test_builder_methods_return_new_pipelines_and_leave_the_receiver_unchanged():
    base = Pipeline(_rows())
    a = base.map(_double)
    b = base.filter(_even)
    assert a is not b and a is not base
    assert [n for n, _ in a.operators] == ["map"] and [n for n, _ in b.operators] == ["filter"]
    assert base.operators == ()
    assert [r.payload["n"] for r in a] == [2 * i for i in range(20)]
    assert [r.payload["n"] for r in b] == list(range(0, 20, 2))
    c = base.options(canonical_replicas=2)
    assert base.run_options.canonical_replicas == 1 and c.run_options.canonical_replicas == 2
    assert base.map(_double) == a  # equal values
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.operators = ()


def test_a_pipeline_pickles_and_copies_as_a_value_without_its_loader():
    import copy
    import pickle

    pipe = toy_pipeline(2)
    loader = iter(pipe)
    reference = [next(loader) for _ in range(3)]
    for clone in (pickle.loads(pickle.dumps(pipe)), copy.deepcopy(pipe)):
        assert clone.fingerprint() == pipe.fingerprint() and clone.resume_from is None
        assert outputs_equal([next(iter(clone))], reference[:1])  # from the start: no loader came along
    resumed = pipe.restore(loader.checkpoint())
    for clone in (pickle.loads(pickle.dumps(resumed)), copy.deepcopy(resumed)):
        assert clone.resume_from == resumed.resume_from and resumed != pipe  # the carried checkpoint is part of the value
        assert outputs_equal([next(iter(clone))], [next(iter(resumed))])
    loader.close()


def test_iterating_makes_separate_loaders_that_do_not_affect_each_other():
    pipe = toy_pipeline(2)
    one, two = iter(pipe), iter(pipe)
    assert isinstance(one, Loader) and one is not two
    first = [next(one) for _ in range(6)]
    assert outputs_equal([next(two) for _ in range(6)], first)
    assert one.stats()["delivered"] == two.stats()["delivered"] == 6


@pytest.mark.parametrize("run_options", [{}, {"thread": True}, {"workers": 1}])
def test_restore_into_a_loader_that_has_yielded_resumes_exactly(run_options):
    reference = [b for _, b in zip(range(12), toy_pipeline(2))]
    pipe = toy_pipeline(2, **run_options)
    loader = iter(pipe)
    for _ in range(4):
        next(loader)
    checkpoint = loader.checkpoint()
    for _ in range(5):  # go past it, then come back
        next(loader)
    assert loader.restore(checkpoint) is loader
    assert outputs_equal([next(loader) for _ in range(8)], reference[4:12])
    loader.close()


def test_a_restored_pipeline_is_a_new_value_and_every_loader_of_it_starts_at_its_checkpoint():
    pipe = toy_pipeline(2)
    reference = [b for _, b in zip(range(10), pipe)]
    loader = pipe.loader()
    for _ in range(3):
        next(loader)
    checkpoint = loader.checkpoint()
    resumed = pipe.restore(checkpoint)
    assert resumed is not pipe and resumed.resume_from == checkpoint and pipe.resume_from is None
    for _ in range(2):  # every time, not once
        assert outputs_equal([b for _, b in zip(range(7), resumed)], reference[3:])
        assert outputs_equal([b for _, b in zip(range(7), resumed.loader())], reference[3:])
    assert outputs_equal([b for _, b in zip(range(7), toy_pipeline(2).loader(checkpoint))], reference[3:])
    assert outputs_equal([b for _, b in zip(range(3), pipe)], reference[:3])  # the receiver is unchanged
    assert outputs_equal([next(loader)], reference[3:4])  # and so is the loader the checkpoint came from
    restored = resumed.loader()
    assert restored.checkpoint() == checkpoint  # nothing delivered yet: the carried checkpoint itself
    assert resumed.loader(restored.checkpoint()).stats()["delivered"] == 3  # counted from the checkpoint on
    with pytest.raises(ValueError, match="differ"):
        toy_pipeline(2, seed=5).restore(checkpoint)  # refused at once, listing the fields


def test_plan_never_measures_and_compile_gives_the_calibrated_plan():
    from zephon.sources import calibrate
    from zephon.testing import length_datasets, word_tokenizer
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    src = StaticMixtureWorkSource(length_datasets({"short": 5, "long": 50}, 200), MixtureSpec({"short": 1, "long": 1}, unit="tokens"), chunk_size=8)
    pipe = Pipeline(src).tokenize(word_tokenizer(), special_tokens="eos", eos_token_id=1).batch(2)
    calibrate._CACHE.clear()
    with pytest.raises(ValueError, match=r"never measures.*pipeline\.compile\(\)"):
        pipe.plan
    assert not calibrate._CACHE  # nothing was measured
    plan = pipe.compile()
    assert plan.source.calibration is not None and not plan.source.needs_calibration
    loader = iter(pipe)
    assert loader.plan.source.calibration == plan.source.calibration
    next(loader)
    calibrate._CACHE.clear()
    resumed = Pipeline(src).tokenize(word_tokenizer(), special_tokens="eos", eos_token_id=1).batch(2).restore(loader.checkpoint())
    assert resumed.plan.source.calibration == plan.source.calibration  # frozen in the checkpoint: no measuring
    assert not calibrate._CACHE


def test_the_compat_pipeline_changes_in_place_and_speaks_for_its_latest_loader():
    import pickle

    from zephon import compat

    reference = [b for _, b in zip(range(12), toy_pipeline(2))]
    value = toy_pipeline(2)
    pipe = compat.Pipeline(value)
    start = pipe.checkpoint()
    assert start == value.loader().checkpoint()  # before any iteration: the start
    assert pipe.stats()["delivered"] == 0
    loader = iter(pipe)
    assert pipe.latest is loader
    for _ in range(4):
        next(loader)
    checkpoint = pipe.checkpoint()
    assert checkpoint == loader.checkpoint() and pipe.stats()["delivered"] == 4
    next(loader)
    assert pipe.restore(checkpoint) is pipe  # the latest loader resumes in place ...
    assert outputs_equal([next(loader) for _ in range(3)], reference[4:7])
    assert pickle.loads(pickle.dumps(pipe)).checkpoint() == checkpoint  # a pending restore travels, the loader not
    assert outputs_equal([next(iter(pipe))], reference[4:5])  # ... and the next iter() starts there, once
    assert outputs_equal([next(iter(pipe))], reference[:1])
    again = compat.Pipeline(value)
    again.load_state_dict(pipe.state_dict())
    assert outputs_equal([next(iter(again))], reference[1:2])
    with compat.Pipeline(toy_pipeline(2)) as built:
        built.batch  # a builder of the value, in place: the wrapper holds the result
        assert built.options(canonical_replicas=4) is built and built.pipeline.run_options.canonical_replicas == 4
        assert built.fingerprint() == built.pipeline.fingerprint() and built.topology().lanes == (0, 1, 2, 3)
        it = iter(built)
        next(it)
    with pytest.raises(RuntimeError, match="closed loader"):
        next(it)
    assert value.resume_from is None and value.run_options.canonical_replicas == 2  # the wrapped value never changed
    loader.close()


def test_chain_steps_every_child_and_stateless_counters_live_in_their_own_state():
    calls = []

    @attrs.frozen
    class Tracing(MapOp):
        def step(self, state, chunk):
            calls.append(len(chunk))
            return super().step(state, chunk)

    chain = Chain((("trace", Tracing(lambda p: p)), ("drop", stateless(lambda p: None if p["input_ids"][0] % 2000 else p))))
    state, out = run(chain, [docs([3, 4]), docs([5])])
    assert calls == [2, 1]
    # rows 0, 1 then row 0 again: row 1's tokens start at 1000, so it alone is dropped
    assert chain.reports(state) == {"trace": {"dropped_records": 0}, "drop": {"dropped_records": 1}}
    assert state.states[1].dropped_records == 1 and len(out) == 2


def test_pad_token_id_comes_from_the_pipelines_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [" ".join(f"w{i * j % 31}" for j in range(5 + i % 9)) for i in range(60)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))
    eos = tok.token_to_id("<|endoftext|>")
    pipe = Pipeline([{"text": t} for t in texts]).tokenize(tok, special_tokens="eos").batch(4)
    batch = next(iter(pipe))
    assert batch.pad_token_id == eos != 0
    out = batch.to_training(padding="longest", dtype=np.int64)
    lengths = [len(r.payload["input_ids"]) for r in batch.records]
    for row, n in zip(out["input_ids"], lengths):
        assert (row[n:] == eos).all()
    with pytest.raises(ValueError, match="pad_token_id"):
        next(iter(Pipeline([{"input_ids": [1, 2]}, {"input_ids": [3]}]).batch(2))).to_training(padding="longest")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert [b.pad_token_id for b in Pipeline([{"input_ids": [1]}] * 4).batch(2, pad_token_id=7)] == [7, 7]
