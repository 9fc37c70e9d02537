"""Laws of batching by token budget (``batch(max_tokens=N)``), on generated streams and pipelines.

Records are ``_util.docs``: document ``row`` holds the tokens ``1000 * row + [0, n)``, so its row
names it. A reference cuts the stream the plain way (a record joins the open microbatch unless
rows x widest row would exceed the budget), sorted windows first where the operator sorts.

Laws:
    * the budget: every microbatch's rows x longest row, rounded up to ``pad_to_multiple_of``,
      is at most ``max_tokens``;
    * the greedy rule: in arrival order the microbatches are exactly the reference's; with a sort
      window, each window of arrivals gives exactly the reference's microbatches of that window
      sorted by (length, record id), in some order;
    * conservation: every record is emitted once, or counted (as oversized, or as the end's
      dropped batch), and the counters add up;
    * pipelines: the same global steps for every rank count dividing the lane count, and a
      checkpoint after any number of delivered microbatches resumes with exactly the rest.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from _budget import examples
from _util import docs, global_steps, toks_to_ids, toy_dataset
from zephon import Pipeline
from zephon.ops import Batch
from zephon.testing import run
from zephon.work import StaticMixtureWorkSource


def width(n: int, multiple: int) -> int:
    return max(1, math.ceil(n / multiple) * multiple)


def reference(lengths: list[int], ids: list[int], max_tokens: int, multiple: int) -> tuple[list[list[int]], bool]:
    """Microbatches of ``ids`` (with these lengths) by the plain rule, and whether the last is still open."""
    out, current = [], []
    for i, n in zip(ids, lengths):
        widest = max([width(n, multiple)] + [width(lengths[ids.index(j)], multiple) for j in current])
        if current and (len(current) + 1) * widest > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    if not current:
        return out, False
    widest = max(width(lengths[ids.index(j)], multiple) for j in current)
    return out + [current], (len(current) + 1) * widest <= max_tokens


@st.composite
def settings_and_stream(draw):
    multiple = draw(st.sampled_from([1, 1, 2, 4, 8]), label="pad_to_multiple_of")
    max_tokens = draw(st.integers(multiple, 160), label="max_tokens")
    lengths = draw(st.lists(st.integers(0, 48), max_size=90), label="lengths")
    window = draw(st.sampled_from([0, 0, 1, 3, 8, 17]), label="sort_window")
    op = Batch(
        max_tokens=max_tokens, sort_window=window, pad_to_multiple_of=multiple if multiple > 1 else None,
        drop_last=draw(st.booleans(), label="drop_last"), oversized="drop",
    )
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=6), label="cuts"))
    return op, lengths, cuts


@given(case=settings_and_stream(), key=st.integers(0, 2**64 - 1))
def test_token_budget_batches_follow_the_greedy_rule_within_the_budget(case, key):
    op, lengths, cuts = case
    records = docs(lengths)
    bounds = [0, *cuts, len(records)]
    state, out = run(op, [records[a:b] for a, b in zip(bounds, bounds[1:])], key=key)
    m = op.multiple
    fits = [i for i, n in enumerate(lengths) if width(n, m) <= op.max_tokens]  # the others are dropped, counted
    for b in out:
        ls = [len(r.payload["input_ids"]) for r in b.records]
        assert len(ls) * width(max(ls), m) <= op.max_tokens
    got = [[r.meta.segments[0].row for r in b.records] for b in out]
    end_dropped = []
    windows = [fits[i : i + op.sort_window] for i in range(0, len(fits), op.sort_window)] if op.sort_window else [fits]
    emitted = iter(got)
    for w, ids in enumerate(windows):
        if op.sort_window:
            ids = sorted(ids, key=lambda i: (lengths[i], i))
        mine, is_open = reference([lengths[i] for i in ids], ids, op.max_tokens, m)
        # only a window that the end of data closed can lose its open batch (a full one emits at once)
        at_end = w == len(windows) - 1 and (not op.sort_window or len(ids) < op.sort_window)
        if at_end and is_open and op.drop_last:
            end_dropped = mine.pop()
        window_out = [next(emitted) for _ in mine]
        assert (sorted(window_out) if op.sort_window else window_out) == (sorted(mine) if op.sort_window else mine)
    assert next(emitted, None) is None
    report = op.report(state)
    assert report["rows"] == sum(map(len, got)) == len(fits) - len(end_dropped)
    assert report["dropped_records_at_end"] == len(end_dropped)
    assert report["dropped_tokens_at_end"] == sum(lengths[i] for i in end_dropped)
    assert report["dropped_oversized_records"] == len(lengths) - len(fits)
    assert report["dropped_oversized_tokens"] == sum(lengths) - sum(lengths[i] for i in fits)
    assert report["real_tokens"] == sum(lengths[i] for b in got for i in b)
    assert report["padded_slots"] == sum(len(b) * math.ceil(max(lengths[i] for i in b) / m) * m for b in got)


def budget_pipeline(max_tokens: int, window: int, seed: int):
    data = toy_dataset(120, seed=seed)
    source = StaticMixtureWorkSource([data], {"web": 1.0}, seed=seed, chunk_size=8, exhausted_policy="repeat")
    pipe = Pipeline(source).map(toks_to_ids)
    return pipe.batch(max_tokens=max_tokens, sort_window=window, oversized="drop", pad_token_id=0)


def metas(batches):
    return [[r.meta for r in b.records] for b in batches]


@settings(max_examples=examples(8))
@given(
    max_tokens=st.integers(8, 200), window=st.sampled_from([0, 5, 24]), seed=st.integers(0, 3),
    lanes=st.sampled_from([2, 4]), stop=st.integers(0, 30),
)
def test_token_budget_pipelines_are_rank_count_free_and_resume_exactly(max_tokens, window, seed, lanes, stop):
    make = lambda: budget_pipeline(max_tokens, window, seed)  # noqa: E731
    one, _ = global_steps(make, lanes, 1, 10)
    many, _ = global_steps(make, lanes, lanes // 2, 10)
    assert [metas(s) for s in many] == [metas(s) for s in one]
    pipe = make().options(canonical_replicas=lanes)
    with pipe.loader() as loader:
        for _ in range(stop):
            next(loader)
        ck = loader.checkpoint()
        rest = [next(loader) for _ in range(12)]
    with pipe.loader(ck) as resumed:
        assert metas(next(resumed) for _ in range(12)) == metas(rest)
