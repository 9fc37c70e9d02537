"""At 10,000 shards a rank's checkpoint is bounded by its lanes, restoring costs what it costs at
1,000, and the source keeps a few bytes per shard: the measurements of ``benchmarks/scale.py``.

Times are CPU seconds of this process (``time.process_time``), medians of repeats, and compared
as a ratio with room for noise; nothing asserts a wall time.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale  # noqa: E402

SHARDS = (1_000, 10_000)


@pytest.fixture(scope="module")
def datasets():
    """In-memory datasets of 1,000 and 10,000 shards, their identity computed (as once per process)."""
    out = {n: scale.in_memory(n) for n in SHARDS}
    for data in out.values():
        scale.source(data).fingerprint()
    scale.measure(scale.in_memory(8), 2)  # the process's one-time costs, not the first measurement's
    return out


@pytest.mark.parametrize("lanes, dp", [(1, 1), (16, 1), (64, 32)])
def test_a_ranks_checkpoint_at_10000_shards_is_bounded_by_its_lanes(datasets, lanes, dp):
    for rank in sorted({0, dp - 1}):
        point = scale.measure(datasets[10_000], lanes, dp, rank)  # also checks the restored step
        assert point["rank_lanes"] == lanes // dp
        assert point["ckpt_bytes"] <= 4096 + 2048 * (lanes // dp), point


def test_restore_time_does_not_grow_with_the_shards(datasets):
    restore = {n: statistics.median(scale.measure(datasets[n], 16)["restore_s"] for _ in range(5)) for n in SHARDS}
    assert restore[10_000] / restore[1_000] < 3, restore
    sizes = {n: scale.measure(datasets[n], 16)["ckpt_bytes"] for n in SHARDS}
    assert sizes[10_000] - sizes[1_000] <= 64 * 16, sizes  # lane states name shards by number: a byte or two each


def test_the_source_layout_keeps_at_most_64_bytes_per_shard():
    memory = scale.source_memory(scale.in_memory(10_000))
    assert memory["layout_per_shard"] <= 64, memory


def test_growth_exponents_fit_a_power_law():
    assert scale.exponent([1, 10, 100], [2, 20, 200]) == pytest.approx(1.0)
    assert scale.exponent([1_000, 10_000, 100_000], [7, 7, 7]) == pytest.approx(0.0)
    assert scale.exponent([1, 4, 16], [1, 2, 4]) == pytest.approx(0.5)
