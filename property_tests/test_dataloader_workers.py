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
from hypothesis import given, note
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.utils.data  # noqa: E402

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
