"""DataLoader workers deliver exactly the pipeline's stream: any lanes, ranks, workers and data end.

``torch.utils.data.DataLoader`` hands task ``i`` to the next worker still running, in turn, and
returns items in task order; a worker that ends leaves the rotation. The law is checked against
that rotation, simulated in this process (``get_worker_info`` patched, one dataset copy per
worker sharing the end-of-data block, as forked workers do), so many cases run in a few seconds;
``tests/test_torch_integration.py`` checks the same with real worker processes.
"""

from __future__ import annotations

import copy
import types
import warnings
from unittest import mock

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.utils.data  # noqa: E402

from _budget import examples  # noqa: E402
from _util import toy_dataset, toy_pipeline  # noqa: E402

OPTIONS = dict(return_labels=True, dtype=None)


def rotation(dataset, workers, limit):
    """The items a DataLoader with ``workers`` workers delivers (at most ``limit``)."""
    streams = []
    for w in range(workers):
        info = types.SimpleNamespace(num_workers=workers, id=w, seed=1234 + w)
        copied = copy.copy(dataset)  # each worker has its own copy of the dataset ...
        copied._sync = dataset._sync  # ... and shares its end-of-data block (forked workers inherit it)
        with mock.patch.object(torch.utils.data, "get_worker_info", lambda info=info: info):
            streams.append(iter(copied))
    out, active = [], list(range(workers))
    while active and len(out) < limit:
        for w in list(active):
            try:
                out.append(next(streams[w]))
            except StopIteration:
                active.remove(w)
            if len(out) == limit:
                break
    return out


@given(
    lanes=st.sampled_from([1, 2, 3, 4, 6, 8]),
    ranks=st.integers(1, 8),
    workers=st.integers(1, 6),
    rows=st.integers(1, 120),
    seed=st.integers(0, 50),
    finite=st.booleans(),
    data=st.data(),
)
def test_dataloader_rotation_delivers_the_pipeline_stream(lanes, ranks, workers, rows, seed, finite, data):
    if lanes % ranks:
        ranks = 1
    rank = data.draw(st.integers(0, ranks - 1), label="rank")
    policy = None if finite else "repeat"
    if not finite:
        rows = max(rows, 30)  # an endless source of empty rows would never give a batch
    make = lambda: toy_pipeline(lanes, policy=policy, data=toy_dataset(rows, seed=seed), dp_degree=ranks, dp_rank=rank)
    limit = 10_000 if finite else 40
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = [b.to_training(**OPTIONS) for _, b in zip(range(limit), make().loader())]
        got = rotation(make().to_torch_dataset(**OPTIONS), workers, limit)
    note(f"{len(expected)} items expected, {len(got)} delivered")
    assert got == expected


#: Who runs the lanes: zephon's DataLoader with ``num_workers`` torch workers, or the pipeline's own
#: loader with ``options(workers=...)`` zephon processes.
RUNNERS = st.sampled_from([("torch", 0), ("torch", 1), ("torch", 2), ("torch", 4), ("zephon", 0), ("zephon", 2)])


def run(runner, make, checkpoint, n):
    """Up to ``n`` training items of ``make()`` from ``checkpoint`` (None: the start), and the checkpoint after them."""
    from zephon.integrations.torch import DataLoader

    kind, workers = runner
    if kind == "torch":
        loader = DataLoader(make(), num_workers=workers, checkpoint=checkpoint, **OPTIONS)
        items = [x for _, x in zip(range(n), loader)]
    else:
        loader = make().options(workers=workers).loader(checkpoint)
        items = [torch.utils.data.default_convert(b.to_training(**OPTIONS)) for _, b in zip(range(n), loader)]
    checkpoint = loader.checkpoint()
    loader.close()
    return items, checkpoint


def same_items(xs, ys):
    return len(xs) == len(ys) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        for x, y in zip(xs, ys)
    )


@settings(max_examples=examples(8))  # each example starts up to two DataLoaders of up to 4 worker processes
@given(
    lanes=st.sampled_from([2, 4]),
    before=RUNNERS,
    after=RUNNERS,
    cut=st.integers(0, 13),
    finite=st.booleans(),
    seed=st.integers(0, 20),
)
def test_a_resume_on_other_workers_continues_the_uninterrupted_stream(lanes, before, after, cut, finite, seed):
    # Saved at any item (mid-step included) with W1 torch or zephon workers, resumed with W2: the
    # items before the save and after the resume, concatenated, are the uninterrupted run's.
    make = lambda: toy_pipeline(lanes, policy=None if finite else "repeat", data=toy_dataset(60 if finite else 120, seed=seed))  # noqa: E731
    total = 24
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the undelivered tail of finite data, tested elsewhere
        expected, _ = run(("zephon", 0), make, None, total)
        head, checkpoint = run(before, make, None, cut)
        tail, _ = run(after, make, checkpoint, total - len(head))
    note(f"{len(expected)} items expected; {len(head)} before the save, {len(tail)} after")
    assert same_items(head + tail, expected)
