"""The tail of a finite source: the last, partial block of work is spread over the lanes.

Complete blocks of ``L`` work chunks give every lane one whole chunk each; the ``R`` positions left
after the last complete block are cut into ``L`` contiguous ranges of ``R // L`` or ``R // L + 1``
positions, dealt in the block's slot order. So every lane's total is within one sample of every
other's, and the layout depends only on (end, chunk_size, L) and the routing seed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.io import Dataset, InMemoryShard
from zephon.work import SourceState, StaticMixtureWorkSource

LANE_COUNTS = (1, 2, 3, 4, 8)


def rows(n: int) -> list[dict]:
    return [{"i": i} for i in range(n)]


def source(n: int, **kwargs) -> StaticMixtureWorkSource:
    return StaticMixtureWorkSource([Dataset.from_rows("d", rows(n))], {"d": 1}, shuffle_shards=False, **kwargs)


def lane_ranges(src: StaticMixtureWorkSource, lanes: int, lane: int) -> list[tuple[int, int]]:
    out, k = [], 0
    while (rng := src.lane_range(lanes, lane, k)) is not None:
        out.append(rng)
        k += 1
    return out


def layout(src: StaticMixtureWorkSource, lanes: int) -> list[list[tuple[int, int]]]:
    return [lane_ranges(src, lanes, lane) for lane in range(lanes)]


sources = st.builds(
    lambda n, chunk, seed, routing: source(n, chunk_size=chunk, seed=seed, lane_assignment=routing),
    n=st.integers(1, 400),
    chunk=st.integers(1, 24),
    seed=st.integers(0, 2**31),
    routing=st.sampled_from(["permute", "modulo"]),
)


@settings(max_examples=150, deadline=None)
@given(src=sources, lanes=st.sampled_from(LANE_COUNTS))
def test_lane_ranges_partition_the_source(src, lanes):
    seen = []
    for ranges in layout(src, lanes):
        for t0, t1 in ranges:
            assert 0 <= t0 < t1 <= src.end, "ranges are non-empty and inside [0, end)"
        seen.extend(t for t0, t1 in ranges for t in range(t0, t1))
    assert sorted(seen) == list(range(src.end)), "every position belongs to exactly one lane, once"


@settings(max_examples=150, deadline=None)
@given(src=sources, lanes=st.sampled_from(LANE_COUNTS))
def test_lanes_end_within_one_sample_of_each_other(src, lanes):
    totals = [sum(t1 - t0 for t0, t1 in ranges) for ranges in layout(src, lanes)]
    assert max(totals) - min(totals) <= 1, totals
    assert sum(totals) == src.end


@settings(max_examples=100, deadline=None)
@given(src=sources, lanes=st.sampled_from(LANE_COUNTS))
def test_only_the_last_partial_block_is_spread(src, lanes):
    c = src.chunk_size
    full = src.end // (lanes * c)  # complete blocks
    for lane, ranges in enumerate(layout(src, lanes)):
        assert len(ranges) in (full, full + 1)
        for k, (t0, t1) in enumerate(ranges[:full]):
            g = src.lane_chunk(lanes, lane, k)
            assert (t0, t1) == (g * c, (g + 1) * c), "complete blocks keep whole chunks"
        for t0, t1 in ranges[full:]:
            assert t0 >= full * lanes * c and t1 - t0 <= -(-(src.end - full * lanes * c) // lanes)


@settings(max_examples=60, deadline=None)
@given(src=sources, lanes=st.sampled_from(LANE_COUNTS), data=st.data())
def test_read_returns_the_lane_ranges_in_pieces_of_any_size(src, lanes, data):
    for lane in range(lanes):
        expected = [p for t0, t1 in lane_ranges(src, lanes, lane) for p in src.pointers(t0, t1)]
        state, got, exhausted = SourceState(), [], False
        while not exhausted:
            state, part, exhausted = src.read(state, lanes, lane, data.draw(st.integers(1, 11), label="read size"))
            got.extend(part)
        assert got == expected
        # Once ended, a lane stays ended.
        assert src.read(state, lanes, lane, 5) == (state, [], True)


@pytest.mark.parametrize("routing", ["permute", "modulo"])
def test_twenty_rows_on_two_lanes_give_ten_each(routing):
    src = source(20, lane_assignment=routing)  # default chunk_size 64: no complete block at all
    assert [sum(t1 - t0 for t0, t1 in r) for r in layout(src, 2)] == [10, 10]
    for lane in range(2):
        _, got, done = src.read(SourceState(), 2, lane, 100)
        assert done and len(got) == 10


@pytest.mark.parametrize("lanes", LANE_COUNTS)
def test_two_thousand_samples_reach_every_lane_evenly(lanes):
    # Without spreading, L=4 and chunk_size 64 end the lanes at 512, 512, 512 and 464 samples; a
    # global step needs every lane, so at most 4 * 464 = 1856 of 2000 samples (93%) were delivered.
    src = source(2000)
    totals = [sum(t1 - t0 for t0, t1 in r) for r in layout(src, lanes)]
    assert sum(totals) == 2000 and max(totals) - min(totals) <= 1
    assert lanes * min(totals) >= 2000 - lanes


def test_the_layout_is_a_pure_function_of_length_chunk_size_and_lanes():
    # A mixture and a plain list of the same length route identically: data never moves lanes.
    mixed = StaticMixtureWorkSource(
        [
            Dataset.from_dict("a", {"x": InMemoryShard(rows(50)), "y": InMemoryShard(rows(71))}),
            Dataset.from_rows("b", rows(40)),
        ],
        {"a": 3, "b": 1},
        chunk_size=8,
        seed=5,
        exhausted_policy="stop",
    )
    plain = source(len(mixed), chunk_size=8, seed=5)
    assert len(mixed) % 32 != 0  # there is a partial block to spread for 2, 4 and 8 lanes
    for lanes in LANE_COUNTS:
        assert layout(mixed, lanes) == layout(plain, lanes)


def test_an_empty_spread_range_ends_the_lane():
    # 3 positions over 8 lanes: the lanes in slots 0..2 get one position each, the others none.
    src = source(3, lane_assignment="modulo")
    assert layout(src, 8) == [[(0, 1)], [(1, 2)], [(2, 3)], [], [], [], [], []]
    assert src.read(SourceState(), 8, 5, 4) == (SourceState(), [], True)


def test_endless_sources_keep_whole_chunks():
    src = source(10, chunk_size=4, seed=1, exhausted_policy="repeat")
    for lanes in LANE_COUNTS:
        for lane in range(lanes):
            for k in range(6):
                g = src.lane_chunk(lanes, lane, k)
                assert src.lane_range(lanes, lane, k) == (g * 4, g * 4 + 4)


def test_tail_layout_golden():
    # Known answer: 45 positions, chunk_size 8, 4 lanes, seed 0. One complete block (positions
    # 0..31) in whole chunks; the 13 positions left are cut 4, 3, 3, 3 in that block's slot order.
    src = source(45, chunk_size=8, seed=0)
    assert layout(src, 4) == TAIL_GOLDEN


TAIL_GOLDEN = [[(24, 32), (39, 42)], [(0, 8), (42, 45)], [(8, 16), (32, 36)], [(16, 24), (36, 39)]]
