"""Code written for in-place pipeline builders does not run silently wrong.

Pipelines are values: ``p.tokenize(...)`` returns a new pipeline and leaves ``p`` unchanged. A
builder call used as a statement therefore does nothing, and running its receiver afterwards
runs the pipeline without that step. These tests pin down that such code warns, with the fix,
and that every correct use of values stays silent.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings

import pytest

from zephon import Pipeline
from zephon.testing import word_tokenizer


def _rows(n=12):
    return [{"text": " ".join(f"w{(i * j) % 50}" for j in range(3 + i % 5))} for i in range(n)]


def _tok():
    return dict(tokenizer=word_tokenizer(), field="text", special_tokens="eos", eos_token_id=1)


def _caught(fn):
    """Run ``fn`` recording every warning; returns (result, [messages])."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen]


def _run(pipe):
    return [b for b in pipe]


# -- in-place building, as ported code does it -------------------------------------------------------


def test_a_discarded_builder_call_warns_when_its_receiver_is_iterated_with_the_fix():
    p = Pipeline(_rows())
    p.tokenize(**_tok())
    p.batch(2)
    with pytest.warns(UserWarning) as seen:
        out = _run(p)
    messages = [str(w.message) for w in seen]
    assert any("Pipeline.tokenize(...) returned a new pipeline that was discarded" in m for m in messages), messages
    assert any("p = p.tokenize(...)" in m for m in messages), messages
    assert any("Pipeline.batch(...)" in m and "p = p.batch(...)" in m for m in messages), messages
    assert "text" in out[0].payload and "input_ids" not in out[0].payload  # what it warned about


def test_the_warning_points_at_the_line_that_runs_the_receiver():
    p = Pipeline(_rows()).tokenize(**_tok())
    p.batch(2)
    with pytest.warns(UserWarning, match="discarded") as seen:
        iter(p).close()
    assert {w.filename for w in seen if "discarded" in str(w.message)} == {__file__}


def test_a_discarded_options_call_names_the_lane_count_it_did_not_set():
    p = Pipeline(_rows()).tokenize(**_tok()).batch(2)
    p.options(canonical_replicas=4)
    with pytest.warns(UserWarning) as seen:
        loader = iter(p)
    loader.close()
    (message,) = [str(w.message) for w in seen if "discarded" in str(w.message)]
    assert "Pipeline.options(canonical_replicas=4)" in message
    assert "canonical_replicas=1" in message and "L" in message  # what it runs with instead
    assert "p = p.options(canonical_replicas=4)" in message
    assert p.topology().lanes == (0,)


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(lambda p: p.loader().close(), id="loader"),
        pytest.param(lambda p: p.plan, id="plan"),
        pytest.param(lambda p: p.compile(), id="compile"),
        pytest.param(lambda p: p.explain(), id="explain"),
        pytest.param(lambda p: next(iter(p.steps())), id="steps"),
        pytest.param(lambda p: p.topology(), id="topology"),
        pytest.param(lambda p: p.fingerprint(), id="fingerprint"),
    ],
)
def test_every_way_of_running_the_receiver_warns(run):
    p = Pipeline(_rows()).tokenize(**_tok())
    p.batch(2)
    with pytest.warns(UserWarning, match=r"Pipeline\.batch\(\.\.\.\) returned a new pipeline that was discarded"):
        run(p)


def test_to_torch_dataset_of_the_receiver_warns():
    pytest.importorskip("torch")
    p = Pipeline(_rows()).tokenize(**_tok()).batch(2)
    p.options(canonical_replicas=2)
    with pytest.warns(UserWarning, match=r"Pipeline\.options\(canonical_replicas=2\) returned a new pipeline that was discarded"):
        p.to_torch_dataset()


def test_a_discarded_chain_warns_for_its_first_call():
    p = Pipeline(_rows())
    p.tokenize(**_tok()).batch(2)  # both results discarded: only the first was made from p
    _, messages = _caught(lambda: _run(p))
    discarded = [m for m in messages if "discarded" in m]
    assert len(discarded) == 1 and "Pipeline.tokenize(...)" in discarded[0], messages


def test_each_discarded_call_warns_once():
    p = Pipeline(_rows()).tokenize(**_tok())
    p.batch(2)
    _, first = _caught(lambda: _run(p))
    _, second = _caught(lambda: _run(p))
    assert sum("discarded" in m for m in first) == 1
    assert not [m for m in second if "discarded" in m], second


def test_a_custom_operator_added_and_discarded_names_add():
    from zephon.ops import stateless

    @stateless
    def upper(payload):
        return {**payload, "text": payload["text"].upper()}

    p = Pipeline(_rows()).tokenize(**_tok())
    p.add(upper)
    with pytest.warns(UserWarning, match=r"p = p\.add\(\.\.\.\)"):
        _run(p)


def test_a_discarded_restore_warns_that_the_receiver_runs_from_its_start():
    p = Pipeline(_rows()).tokenize(**_tok()).batch(2)
    loader = iter(p)
    next(loader)
    p.restore(loader.checkpoint())  # 0.2.0 style: restore in place
    with pytest.warns(UserWarning) as seen:
        out = _run(p)
    (message,) = [str(w.message) for w in seen if "discarded" in str(w.message)]
    assert "Pipeline.restore(...)" in message and "p = p.restore(...)" in message
    assert "not from the checkpoint" in message and "zephon.compat.Pipeline" in message
    assert len(out) == len(_run(p.restore(loader.checkpoint()))) + 1  # it did run from the start


@pytest.mark.parametrize("name", ["checkpoint", "stats", "stats_table", "close", "state_dict", "load_state_dict"])
def test_running_state_asked_of_a_pipeline_names_the_loader_and_the_compat_facade(name):
    p = Pipeline(_rows()).tokenize(**_tok()).batch(2)
    with pytest.raises(AttributeError) as err:
        getattr(p, name)
    message = str(err.value)
    assert f"Pipeline.{name}()" in message and "loader = iter(p)" in message and f"loader.{name}(" in message
    assert "zephon.compat.Pipeline(p)" in message
    with pytest.raises(TypeError, match=r"with p\.loader\(\) as loader"):
        with p:
            pass


def test_ported_in_place_code_runs_as_written_on_the_compat_facade():
    from zephon import compat

    def ported():
        p = compat.Pipeline(_rows())
        p.tokenize(**_tok())
        p.batch(2)
        it = iter(p)
        first = next(it)
        ck = p.checkpoint()
        rest = list(it)
        p.restore(ck)  # in place: the next iteration starts at the checkpoint
        again = list(p)
        stats = p.stats()
        p.close()
        return first, rest, again, stats

    first, rest, again, stats = _silent(ported)
    assert "input_ids" in first.records[0].payload
    assert len(rest) == len(again) == stats["delivered"] - 1 and again[0].ids == rest[0].ids


# -- correct uses of values never warn -----------------------------------------------------------------


def _silent(fn):
    out, messages = _caught(fn)
    assert messages == [], messages
    return out


def test_assigning_the_result_and_running_it_is_silent():
    def go():
        p = Pipeline(_rows())
        p = p.tokenize(**_tok())
        p = p.batch(2)
        return _run(p)

    out = _silent(go)
    assert "input_ids" in out[0].records[0].payload


def test_running_a_result_inline_then_the_base_is_silent():
    def go():
        p = Pipeline(_rows()).tokenize(**_tok())
        for _ in p.batch(2):
            break
        q = p.batch(3)
        _run(q)
        del q  # ran, then dropped
        list(p.options(canonical_replicas=2).batch(1))  # chained and run in one expression
        return _run(p)

    _silent(go)


def test_running_the_base_while_a_result_is_alive_is_silent():
    def go():
        p = Pipeline(_rows()).tokenize(**_tok())
        q = p.batch(2)  # deliberately kept, not run yet
        base = _run(p)
        return base, _run(q)

    base, batched = _silent(go)
    assert len(base) == 2 * len(batched)


def test_results_that_were_inspected_then_dropped_are_silent():
    def go():
        p = Pipeline(_rows()).tokenize(**_tok())
        p.batch(2).explain()
        p.options(canonical_replicas=2).topology()
        p.batch(2).fingerprint()
        p.batch(2).loader().checkpoint()
        p.batch(2).restore(p.batch(2).loader().checkpoint())
        return _run(p)

    _silent(go)


def test_building_many_variants_of_one_base_is_silent():
    def go():
        base = Pipeline(_rows()).tokenize(**_tok()).batch(1)
        ranks = [base.options(canonical_replicas=2, dp_degree=2, dp_rank=r) for r in range(2)]
        outs = [_run(r) for r in ranks]
        del ranks
        gc.collect()
        return _run(base), outs

    whole, halves = _silent(go)
    assert whole and all(halves)


def test_bookkeeping_is_not_part_of_the_value():
    base, tok = Pipeline(_rows()), _tok()
    p = base.tokenize(**tok)
    p.batch(2)  # discarded: p now has something to report
    q = base.tokenize(**tok)
    assert p == q and hash(p) == hash(q)
    r = Pipeline(_rows()).tokenize(**_tok())
    r.batch(2)
    for clone in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r)):
        _silent(lambda: _run(clone))  # a copy carries no report of the original's discarded calls
        assert clone.fingerprint() == q.fingerprint()


# -- a pipeline with no operators over text ------------------------------------------------------------


def test_iterating_untokenized_text_records_warns_with_the_fix():
    with pytest.warns(UserWarning) as seen:
        out = _run(Pipeline(_rows()))
    (message,) = [str(w.message) for w in seen]
    assert "no operators" in message and "'text'" in message
    assert "p = p.tokenize(" in message
    assert out[0].payload == _rows()[0]  # the records themselves are unchanged


def test_iterating_untokenized_chat_records_suggests_tokenize_chat():
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 3
    with pytest.warns(UserWarning, match=r"'messages'.*tokenize_chat"):
        _run(Pipeline(rows))


def test_records_without_text_or_with_tokens_do_not_warn():
    _silent(lambda: _run(Pipeline([{"n": i} for i in range(5)])))
    _silent(lambda: _run(Pipeline([{"input_ids": [1, 2, 3], "text": "a b c"}] * 4)))
    _silent(lambda: _run(Pipeline(_rows()).tokenize(**_tok())))
    _silent(lambda: _run(Pipeline(_rows()).map(lambda p: {"n": len(p["text"])})))
