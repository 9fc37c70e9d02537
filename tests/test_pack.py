"""Packing (pack_flat, pack_sequences): every algorithm, step by step, plus policies and errors.

The reference scenario is nine documents of lengths 3, 5, 2, 7, 4, 1, 6, 9, 2 (39 tokens; document
``i`` holds tokens ``1000 * i + [0, n)``) packed into ``max_length=8``, one document per step, then
flushed. Each scenario lists, per step, the rows it emits as ``(document, start, end)`` pieces.
"""

import json

import numpy as np
import pytest

from _util import doc, docs
from zephon.ops.pack import PackSequences, packing_info
from zephon.ops import PackFlat
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, input_resolver, run

LENGTHS = [3, 5, 2, 7, 4, 1, 6, 9, 2]


def stream(records):
    return np.concatenate([r.payload["input_ids"] for r in records])


def by_step(op, records):
    """Feed one record per step; the pieces of the rows each step (and the final flush) emits."""
    state, steps = op.init(0), []
    for rec in records:
        state, out = op.step(state, [rec])
        steps.append([pieces(r) for r in out])
    state, out = op.flush(state)
    steps.append([pieces(r) for r in out])
    return state, steps


def pieces(row):
    return [(s.row, s.start, s.end) for s in row.meta.segments]


def real_tokens(rows):
    return np.concatenate([r.payload["input_ids"][: len(r.payload["input_ids"]) - r.meta.padding_length] for r in rows])


# -- the reference scenario, per algorithm ------------------------------------------------------------


def test_reference_wrap_step_by_step():
    op = PackFlat(8)
    state, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],  # d0 (3): 3 tokens buffered
        [[(0, 0, 3), (1, 0, 5)]],  # d1 (5): 3 + 5 = 8, one full row
        [],  # d2 (2): 2 buffered
        [[(2, 0, 2), (3, 0, 6)]],  # d3 (7): 2 + 9 >= 8: d3 is cut at 6, its last token waits
        [],  # d4 (4): 1 + 4 = 5 buffered
        [],  # d5 (1): 6 buffered
        [[(3, 6, 7), (4, 0, 4), (5, 0, 1), (6, 0, 2)]],  # d6 (6): 6 + 6 >= 8; d6 continues at 2
        [[(6, 2, 6), (7, 0, 4)]],  # d7 (9): 4 + 9 = 13: one row; d7 continues at 4
        [],  # d8 (2): 5 + 2 = 7 buffered
        [],  # flush: 7 tokens left, no pad_token_id: dropped and counted (Zephon: 4 rows, 7 dropped)
    ]
    report = op.report(state)
    assert (report["rows"], report["tokens"], report["dropped_tokens"], report["dropped_tail_tokens"]) == (4, 32, 7, 7)
    assert report["split_records"] == 1  # d7 is longer than a row


def test_reference_wrap_rows_positions_and_tail_padding():
    records = docs(LENGTHS)
    _, rows = run(PackFlat(8), [records])
    assert np.array_equal(np.concatenate([r.payload["input_ids"] for r in rows]), stream(records)[:32])
    # Row 0 = d0 + d1: positions restart at each document.
    assert rows[0].payload["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    # Row 2 starts with the last token of d3 (split across rows): positions restart at the row start.
    assert rows[2].payload["positions"].tolist() == [0, 0, 1, 2, 3, 0, 0, 1]

    _, padded = run(PackFlat(8, pad_token_id=0), [records])
    assert [pieces(r) for r in padded[4:]] == [[(7, 4, 9), (8, 0, 2)]]  # the flush keeps the tail
    last = padded[-1]
    assert last.meta.padding_length == 1 and last.payload["input_ids"][-1] == 0
    assert last.payload["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]  # d7 tail, d8, pad segment
    assert np.array_equal(real_tokens(padded), stream(records))


def test_reference_first_fit_step_by_step():
    op = PackFlat(8, algorithm="first_fit", num_bins=2, pad_token_id=0)
    state, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],  # d0 (3): opens bin A [d0], room 5
        [[(0, 0, 3), (1, 0, 5)]],  # d1 (5): fits A exactly; A is full, emitted
        [],  # d2 (2): no open bin; opens B [d2], room 6
        [],  # d3 (7): B's room 6 < 7; opens C [d3] (2 open = num_bins), room 1
        [],  # d4 (4): first bin with room: B [d2 d4], room 2
        [],  # d5 (1): B (first of B, C to fit): B [d2 d4 d5], room 1
        [[(2, 0, 2), (4, 0, 4), (5, 0, 1)]],  # d6 (6): fits neither; 2 bins open, so the oldest (B) goes
        [],  # d7 (9): longer than 8: dropped (oversized="drop", the default) and counted
        [[(6, 0, 6), (8, 0, 2)]],  # d8 (2): C's room 1 < 2; D [d6 d8] fills exactly, emitted
        [[(3, 0, 7)]],  # flush: the open bin C, padded by 1
    ]
    report = op.report(state)
    assert (report["dropped_oversized_records"], report["dropped_oversized_tokens"], report["dropped_tokens"]) == (1, 9, 9)
    assert (report["rows"], report["tokens"], report["padding_tokens"]) == (4, 30, 2)  # Zephon: two bins padded by 1


def test_reference_best_fit_step_by_step():
    op = PackFlat(8, algorithm="best_fit", num_bins=2, pad_token_id=0)
    _, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],  # d0 (3): opens A [d0], room 5
        [[(0, 0, 3), (1, 0, 5)]],  # d1 (5): A fits exactly, emitted
        [],  # d2 (2): opens B [d2], room 6
        [],  # d3 (7): nothing fits; opens C [d3], room 1
        [],  # d4 (4): only B fits: B [d2 d4], room 2
        [[(3, 0, 7), (5, 0, 1)]],  # d5 (1): B (room 2) and C (room 1) fit; the tighter C wins and fills up
        [],  # d6 (6): B's room 2 is too small; one bin open < num_bins, so D [d6] opens, room 2
        [],  # d7 (9): dropped, counted
        [[(2, 0, 2), (4, 0, 4), (8, 0, 2)]],  # d8 (2): B and D both have room 2: the tie goes to the first (B)
        [[(6, 0, 6)]],  # flush: D, padded by 2
    ]


def test_reference_first_fit_splits_oversized_into_max_length_pieces():
    op = PackFlat(8, algorithm="first_fit", num_bins=2, pad_token_id=0, oversized="split")
    state, steps = by_step(op, docs(LENGTHS))
    # As plain first_fit up to d6; then d7 (9) becomes pieces [0, 8) and [8, 9):
    # [0, 8) fills a new bin on its own and is emitted at once, evicting nothing; [8, 9) is an
    # ordinary 1-token item and joins C [d3] (room 1), which is then full.
    assert steps[7] == [[(7, 0, 8)], [(3, 0, 7), (7, 8, 9)]]
    assert steps[8] == [[(6, 0, 6), (8, 0, 2)]]  # d8 fills D [d6]
    assert steps[9] == []  # nothing left open
    assert op.report(state)["dropped_tokens"] == 0 and op.report(state)["split_records"] == 1


def test_reference_capped_wrap_closes_short_rows():
    op = PackFlat(8, max_sequences_per_bin=2, pad_token_id=0)
    _, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],  # d0 (3): one piece buffered
        [[(0, 0, 3), (1, 0, 5)]],  # d1 (5): 8 tokens (and 2 pieces): a full row
        [],  # d2 (2)
        [[(2, 0, 2), (3, 0, 6)]],  # d3 (7): full row; d3's last token waits
        [[(3, 6, 7), (4, 0, 4)]],  # d4 (4): 2 pieces reach the cap: a short row (5 tokens, padded 3)
        [],  # d5 (1)
        [[(5, 0, 1), (6, 0, 6)]],  # d6 (6): cap again: 7 tokens
        [[(7, 0, 8)]],  # d7 (9): 9 >= 8: a full row of d7; [8, 9) waits
        [[(7, 8, 9), (8, 0, 2)]],  # d8 (2): cap: 3 tokens
        [],  # flush: nothing left
    ]


def test_reference_best_fit_wrap_step_by_step():
    op = PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=3, pad_token_id=0)
    state, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],  # d0 (3): pool {d0:3}
        [],  # d1 (5): pool {d0:3, d1:5}
        # d2 (2): pool holds 3 candidates and 10 >= 8 tokens: build a row: the largest that fits
        # the gap 8 is d1 (gap 3), then d0 (gap 0). d2 stays.
        [[(1, 0, 5), (0, 0, 3)]],
        [],  # d3 (7): pool {d2:2, d3:7}
        # d4 (4): 3 candidates, 13 tokens: d3 (gap 1); nothing fits 1, so the shortest (d2) is split:
        # it starts its document but the gap (1) is not less than the rest (1), so its head goes.
        [[(3, 0, 7), (2, 0, 1)]],
        [],  # d5 (1): pool {d2[1:2], d4:4, d5:1}: 6 tokens < 8
        # d6 (6): 12 tokens: d6 (gap 2), then the earliest 1-token candidate d2[1:2] (gap 1), then d5.
        [[(6, 0, 6), (2, 1, 2), (5, 0, 1)]],
        [[(7, 0, 8)]],  # d7 (9): its full window goes out directly; the remainder [8, 9) joins the pool
        [],  # d8 (2): pool {d4:4, d7[8:9], d8:2}: 7 tokens
        [[(4, 0, 4), (7, 8, 9), (8, 0, 2)]],  # flush: everything left, in arrival order, padded by 1
    ]
    assert op.report(state)["padding_tokens"] == 1


def test_reference_best_fit_wrap_places_overdue_candidates_first():
    op = PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=3, max_candidate_age=2, pad_token_id=0)
    _, steps = by_step(op, docs(LENGTHS))
    # As above until d6, whose arrival makes d2[1:2] (arrival 3, now 7) older than 2 arrivals:
    # it opens the row before the largest-first choice (d6, then d5).
    assert steps[6] == [[(2, 1, 2), (6, 0, 6), (5, 0, 1)]]


def test_best_fit_wrap_cuts_a_prefix_from_its_tail():
    op = PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=2, pad_token_id=0)
    _, steps = by_step(op, docs([6, 7]))
    # Pool {d0:6, d1:7}: d1 (gap 1); nothing fits, d0 is split: it starts its document and the
    # gap (1) is less than the rest (5), so its last token goes now, before its prefix.
    assert steps == [[], [[(1, 0, 7), (0, 5, 6)]], [[(0, 0, 5)]]]


def test_best_fit_wrap_with_a_cap():
    op = PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=3, max_sequences_per_bin=2, pad_token_id=0)
    _, steps = by_step(op, docs(LENGTHS))
    assert steps[5] == [[(4, 0, 4), (2, 1, 2)]]  # d5: 3 candidates reach the cap: d4, then d2[1:2]; short row
    assert steps[7] == [[(7, 0, 8)], [(6, 0, 6), (5, 0, 1)]]  # d7's window, then a capped row of 7 tokens


def test_first_fit_min_sequence_length_and_cap():
    op = PackFlat(8, algorithm="first_fit", num_bins=2, min_sequence_length=2, max_sequences_per_bin=2, pad_token_id=0)
    _, steps = by_step(op, docs(LENGTHS))
    assert steps == [
        [],
        [[(0, 0, 3), (1, 0, 5)]],
        [],
        [[(3, 0, 7)]],  # d3 alone leaves room 1 < 2: emitted at once, without evicting B [d2]
        [[(2, 0, 2), (4, 0, 4)]],  # B [d2 d4] holds 2 documents, the cap
        [],
        [[(5, 0, 1), (6, 0, 6)]],
        [],  # d7 dropped
        [],
        [[(8, 0, 2)]],
    ]


# -- pack_sequences ---------------------------------------------------------------------------------


def test_pack_sequences_first_fit_keeps_whole_payloads():
    records = [doc(i, n, text=f"doc {i}") for i, n in enumerate(LENGTHS)]
    _, envs = run(PackSequences(8, algorithm="first_fit", num_bins=2), [records])
    assert [pieces(e) for e in envs] == [
        [(0, 0, 3), (1, 0, 5)],
        [(2, 0, 2), (4, 0, 4), (5, 0, 1)],
        [(6, 0, 6), (8, 0, 2)],
        [(3, 0, 7)],
    ]
    first = envs[0].payload["packed_samples"]
    assert first[0] is records[0].payload and first[1] is records[1].payload  # intact, every field kept
    assert all(e.meta.padding_length == 0 for e in envs)
    assert packing_info(envs[3], 8) == {"num_sequences": 1, "total_length": 7, "packing_efficiency": 0.875, "padding_length": None}


def test_pack_sequences_wrap_slices_aligned_fields_and_keeps_the_tail():
    records = [doc(i, n, text=f"doc {i}", loss_mask=np.full(n, i % 2, np.uint8)) for i, n in enumerate(LENGTHS)]
    _, envs = run(PackSequences(8), [records])
    assert [pieces(e) for e in envs][-1] == [(7, 4, 9), (8, 0, 2)]  # the end-of-data remainder is kept
    row1 = envs[1].payload["packed_samples"]
    assert row1[0] is records[2].payload  # d2 is whole in this row
    assert sorted(row1[1]) == ["input_ids", "loss_mask", "text"]  # d3[0:6] is a piece: aligned fields sliced
    assert row1[1]["text"] == "doc 3"  # and its other fields kept
    assert row1[1]["input_ids"].tolist() == list(range(3000, 3006)) and row1[1]["loss_mask"].tolist() == [1] * 6
    got = np.concatenate([p["input_ids"] for e in envs for p in e.payload["packed_samples"]])
    assert np.array_equal(got, stream(records))


@pytest.mark.parametrize("algorithm, kw", [("wrap", {}), ("first_fit", {"num_bins": 2}), ("best_fit_wrap", {"candidate_pool_size": 3})])
def test_pack_sequences_checkpoint_equivalence(algorithm, kw):
    records = docs(LENGTHS)
    assert_checkpoint_equivalence(PackSequences(8, algorithm=algorithm, **kw), [[r] for r in records])


# -- restore, chunking, rebuild ---------------------------------------------------------------------

CONFIGS = {
    "wrap": {},
    "wrap-pad": {"pad_token_id": 0},
    "wrap-cap": {"max_sequences_per_bin": 2, "pad_token_id": 0},
    "first_fit": {"algorithm": "first_fit", "num_bins": 2, "pad_token_id": 0},
    "first_fit-split": {"algorithm": "first_fit", "num_bins": 3, "pad_token_id": 0, "oversized": "split"},
    "best_fit": {"algorithm": "best_fit", "num_bins": 2, "pad_token_id": 0, "max_sequences_per_bin": 2},
    "best_fit-truncate": {"algorithm": "best_fit", "num_bins": 1, "pad_token_id": 0, "oversized": "truncate"},
    "best_fit_wrap": {"algorithm": "best_fit_wrap", "candidate_pool_size": 3, "pad_token_id": 0},
    "best_fit_wrap-aged": {"algorithm": "best_fit_wrap", "candidate_pool_size": 2, "max_candidate_age": 1, "pad_token_id": 0},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_equivalence_at_every_boundary(name):
    records = docs(LENGTHS)
    op = PackFlat(8, **CONFIGS[name])
    assert_checkpoint_equivalence(op, [[r] for r in records])  # a boundary after every document
    assert_checkpoint_equivalence(op, [records[:2], records[2:3], [], records[3:7], records[7:]])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunking_invariance(name):
    records = docs(LENGTHS)
    op = PackFlat(8, **CONFIGS[name])
    for cut in range(1, len(records)):
        assert_chunking_invariance(op, records, [cut])
    assert_chunking_invariance(op, records, list(range(1, len(records))))


def test_state_holds_references_not_tokens():
    records = docs([30, 3, 5])
    op = PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=4, pad_token_id=0)
    state, _ = op.step(op.init(0), records)
    encoded = json.loads(json.dumps(op.encode_state(state)))
    # Candidates: d0[24:30], d1, d2 as [meta, start, end, arrival]; metas point at the documents.
    assert [c[1:] for c in encoded["pool"]] == [[24, 30, 1], [0, 3, 2], [0, 5, 3]]
    assert encoded["pool"][0][0] == [0, 0, 0, 0, 0, 0, 0, -1]  # [lane, padding, dataset, shard, row, child, start, end]
    assert "input_ids" not in json.dumps(encoded)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rows_rebuild_from_metas_alone(name):
    records = [doc(i, n, loss_mask=np.ones(n, np.uint8)) for i, n in enumerate(LENGTHS)]
    op = PackFlat(8, **CONFIGS[name])
    _, rows = run(op, [records])
    rebuilt = op.rebuild([r.meta for r in rows], input_resolver([records]))
    assert rebuilt == rows


# -- oversized policies ------------------------------------------------------------------------------

ALL_ALGORITHMS = [
    ("first_fit", {"num_bins": 2}),
    ("best_fit", {"num_bins": 2}),
    ("best_fit_wrap", {"candidate_pool_size": 1}),
    ("wrap", {}),
]


@pytest.mark.parametrize("algorithm, kw", ALL_ALGORITHMS)
def test_oversized_truncate_keeps_the_head_and_counts_the_cut(algorithm, kw):
    op = PackFlat(4, algorithm=algorithm, oversized="truncate", pad_token_id=0, **kw)
    state, rows = run(op, [docs([3, 10, 2])])
    kept = sorted(real_tokens(rows).tolist())
    assert kept == [0, 1, 2, 1000, 1001, 1002, 1003, 2000, 2001]
    report = op.report(state)
    assert (report["truncated_records"], report["truncated_tokens"], report["dropped_tokens"]) == (1, 6, 6)


@pytest.mark.parametrize("algorithm, kw", ALL_ALGORITHMS)
def test_oversized_drop_and_split(algorithm, kw):
    records = docs([3, 10, 2])
    state, rows = run(PackFlat(4, algorithm=algorithm, oversized="drop", pad_token_id=0, **kw), [records])
    assert sorted(real_tokens(rows).tolist()) == [0, 1, 2, 2000, 2001]
    op = PackFlat(4, algorithm=algorithm, oversized="drop", pad_token_id=0, **kw)
    assert op.report(state)["dropped_oversized_tokens"] == 10 == op.report(state)["dropped_tokens"]

    op = PackFlat(4, algorithm=algorithm, oversized="split", pad_token_id=0, **kw)
    state, rows = run(op, [records])
    assert sorted(real_tokens(rows).tolist()) == sorted(stream(records).tolist())  # every token, once
    assert all(len(r.payload["input_ids"]) == 4 for r in rows)
    assert op.report(state)["dropped_tokens"] == 0


def test_oversized_split_pieces_carry_their_token_ranges():
    _, rows = run(PackFlat(4, algorithm="first_fit", num_bins=1, oversized="split", pad_token_id=0), [docs([10])])
    assert [pieces(r) for r in rows] == [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10)]]
    assert rows[2].payload["input_ids"].tolist() == [8, 9, 0, 0]


@pytest.mark.parametrize("algorithm, kw", [("first_fit", {"num_bins": 2}), ("wrap", {"oversized": "error"})])
def test_oversized_error_names_the_document_and_the_policies(algorithm, kw):
    op = PackFlat(4, algorithm=algorithm, pad_token_id=0, drop_oversized=False if algorithm == "first_fit" else None, **kw)
    with pytest.raises(ValueError, match=r"\(0, 0, 1, 0\) has 10 tokens, more than max_length=4.*oversized='split'"):
        run(op, [docs([3, 10])])


def test_drop_oversized_is_zephons_alias():
    ff = dict(algorithm="first_fit", num_bins=2, pad_token_id=0)
    assert PackFlat(8, **ff).oversized_policy == "drop"
    assert PackFlat(8, drop_oversized=True, **ff).oversized_policy == "drop"
    assert PackFlat(8, drop_oversized=False, **ff).oversized_policy == "error"
    assert PackFlat(8).oversized_policy == "split" and PackFlat(8, drop_oversized=False).oversized_policy == "split"
    assert PackFlat(8, drop_oversized=True, **ff).fingerprint() == PackFlat(8, oversized="drop", **ff).fingerprint()


def test_best_fit_wrap_defaults_are_resolved():
    op = PackFlat(8, algorithm="best_fit_wrap", pad_token_id=0)
    assert (op.pool_size, op.candidate_age) == (1024, 8192)
    assert PackFlat(8, algorithm="best_fit_wrap", candidate_pool_size=4, pad_token_id=0).candidate_age == 32


# -- fields, positions, metadata ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_mask_travels_with_its_tokens(name):
    records = [doc(i, n, loss_mask=(np.arange(n) % 2).astype(np.uint8), text=f"doc {i}") for i, n in enumerate(LENGTHS)]
    _, rows = run(PackFlat(8, **CONFIGS[name]), [records])
    for row in rows:
        assert set(row.payload) == {"input_ids", "loss_mask", "positions", "segments"}  # text: per segment
        assert [s["text"] for s in row.payload["segments"]] == [f"doc {s.row}" for s in row.meta.segments]
        ids, mask = row.payload["input_ids"], row.payload["loss_mask"]
        assert len(ids) == len(mask) == len(row.payload["positions"]) == 8
        real = 8 - row.meta.padding_length
        assert np.array_equal(mask[:real], (ids[:real] % 1000) % 2)  # each token keeps its own mask value
        assert not mask[real:].any()


def test_aligned_fields_travel_and_pad_with_zero():
    records = [doc(i, n, loss_mask=np.ones(n, dtype=np.uint8) * (i % 2), text="kept") for i, n in enumerate([3, 4])]
    _, rows = run(PackFlat(5, pad_token_id=9), [records])
    assert set(rows[0].payload) == {"input_ids", "loss_mask", "positions", "segments"}
    assert rows[0].payload["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    assert rows[1].payload["loss_mask"].tolist() == [1, 1, 0, 0, 0]
    assert rows[1].payload["input_ids"].tolist() == [1002, 1003, 9, 9, 9]


def test_packing_info_from_meta():
    _, rows = run(PackFlat(8, algorithm="first_fit", num_bins=2, pad_token_id=0), [docs(LENGTHS)])
    assert [packing_info(r) for r in rows] == [
        {"num_sequences": 2, "total_length": 8, "packing_efficiency": 1.0, "padding_length": 0},
        {"num_sequences": 3, "total_length": 7, "packing_efficiency": 0.875, "padding_length": 1},
        {"num_sequences": 2, "total_length": 8, "packing_efficiency": 1.0, "padding_length": 0},
        {"num_sequences": 1, "total_length": 7, "packing_efficiency": 0.875, "padding_length": 1},
    ]
    _, envs = run(PackSequences(8, algorithm="first_fit", num_bins=2), [docs([3])])
    with pytest.raises(ValueError, match="max_length="):
        packing_info(envs[0])
    with pytest.raises(ValueError, match="not an output"):
        packing_info(doc(0, 3))


def test_empty_records_are_counted_not_silently_lost():
    for op in (PackFlat(4), PackFlat(4, algorithm="first_fit", num_bins=1, pad_token_id=0)):
        state, rows = run(op, [[doc(0, 4), doc(1, 0), doc(2, 4)]])
        assert len(rows) == 2
        assert op.report(state)["dropped_empty_records"] == 1


def test_report_accounts_for_every_token():
    records = docs([3, 12, 0, 5, 9, 1])
    total = sum(len(r.payload["input_ids"]) for r in records)
    for oversized in ("drop", "truncate", "split"):
        op = PackFlat(6, algorithm="best_fit", num_bins=2, pad_token_id=0, oversized=oversized)
        state, _ = op.step(op.init(0), records)
        mid = op.report(state)
        assert mid["tokens"] + mid["dropped_tokens"] + mid["pending_tokens"] == total
        state, _ = op.flush(state)
        end = op.report(state)
        assert end["pending_tokens"] == 0 and end["tokens"] + end["dropped_tokens"] == total


def test_emit_positions_false_and_existing_positions_error():
    _, rows = run(PackFlat(4, emit_positions=False), [[doc(0, 4)]])
    assert "positions" not in rows[0].payload
    with pytest.raises(ValueError, match="emit_positions=False"):
        run(PackFlat(4), [[doc(0, 4, positions=np.arange(4))]])


def test_documents_in_one_row_must_share_fields():
    records = [doc(0, 2, loss_mask=np.ones(2, np.uint8)), doc(1, 2)]
    with pytest.raises(ValueError, match="different token-aligned fields"):
        run(PackFlat(4, algorithm="first_fit", num_bins=1, pad_token_id=0), [records])


def test_misaligned_loss_mask_is_an_error():
    with pytest.raises(ValueError, match=r"'loss_mask' in the record from dataset 0, shard 0, row 0 .* has 3 entries but the tokens \('input_ids'\) have 2"):
        run(PackFlat(4, algorithm="first_fit", num_bins=1, pad_token_id=0), [[doc(0, 2, loss_mask=np.ones(3, np.uint8))]])


def test_inputs_must_be_whole_documents():
    _, rows = run(PackFlat(4), [docs([8])])
    with pytest.raises(ValueError, match="whole documents"):
        run(PackFlat(4), [rows])


def test_missing_token_field_names_the_fix():
    from zephon.types import Meta, Record, Segment

    rec = Record({"text": "hi"}, Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0))
    with pytest.raises(ValueError, match="tokenize"):
        run(PackFlat(4), [[rec]])
    with pytest.raises(TypeError, match="dicts"):
        run(PackFlat(4), [[Record("text", rec.meta)]])


def test_pad_value_must_fit_dtype():
    rec = doc(0, 2)
    rec.payload["input_ids"] = rec.payload["input_ids"].astype(np.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        run(PackFlat(4, pad_token_id=300), [[rec]])
    with pytest.raises(ValueError, match="does not fit"):
        run(PackFlat(4, algorithm="first_fit", num_bins=1, pad_token_id=300), [[rec]])


# -- configuration errors ----------------------------------------------------------------------------


FF = {"algorithm": "first_fit", "num_bins": 1, "pad_token_id": 0}
BFW = {"algorithm": "best_fit_wrap", "pad_token_id": 0}


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (PackFlat, {"max_length": 0}, "max_length must be an int >= 1"),
        (PackFlat, {"max_length": 8, "algorithm": "zigzag"}, "unknown algorithm 'zigzag'; choose one of 'first_fit'"),
        (PackFlat, {"max_length": 8, "pad_token_id": -1}, "pad_token_id must be a non-negative int"),
        (PackFlat, {"max_length": 8, "algorithm": "first_fit", "pad_token_id": 0}, "needs num_bins.*num_bins=8"),
        (PackFlat, {"max_length": 8, "algorithm": "best_fit", "pad_token_id": 0}, "needs num_bins"),
        (PackFlat, {"max_length": 8, **FF, "num_bins": 0}, "num_bins must be an int >= 1"),
        (PackFlat, {"max_length": 8, "num_bins": 2}, "num_bins does not apply to algorithm='wrap'"),
        (PackFlat, {"max_length": 8, **BFW, "num_bins": 2}, "num_bins does not apply"),
        (PackFlat, {"max_length": 8, "max_sequences_per_bin": 0, "pad_token_id": 0}, "max_sequences_per_bin must be an int >= 1"),
        (PackFlat, {"max_length": 8, **FF, "min_sequence_length": -1}, "min_sequence_length must be an int >= 0"),
        (PackFlat, {"max_length": 8, "min_sequence_length": 2}, "min_sequence_length only applies to first_fit/best_fit"),
        (PackFlat, {"max_length": 8, "algorithm": "first_fit", "num_bins": 2}, "'first_fit' pads partial bins.*pad_token_id is required"),
        (PackFlat, {"max_length": 8, "algorithm": "best_fit", "num_bins": 2}, "pad_token_id is required"),
        (PackFlat, {"max_length": 8, "algorithm": "best_fit_wrap"}, "pad_token_id is required"),
        (PackFlat, {"max_length": 8, "max_sequences_per_bin": 2}, "capped wrap closes rows short of max_length, so pad_token_id"),
        (PackFlat, {"max_length": 8, "candidate_pool_size": 4}, "candidate_pool_size only applies to algorithm='best_fit_wrap'"),
        (PackFlat, {"max_length": 8, "max_candidate_age": 4}, "max_candidate_age only applies to algorithm='best_fit_wrap'"),
        (PackFlat, {"max_length": 8, **BFW, "candidate_pool_size": 0}, "candidate_pool_size must be an int >= 1"),
        (PackFlat, {"max_length": 8, **BFW, "max_candidate_age": 0}, "max_candidate_age must be an int >= 1"),
        (PackFlat, {"max_length": 8, "drop_oversized": True}, "drop_oversized=True is not allowed with algorithm='wrap'.*'drop'"),
        (PackFlat, {"max_length": 8, **BFW, "drop_oversized": True}, "not allowed with algorithm='best_fit_wrap'"),
        (PackFlat, {"max_length": 8, "oversized": "shrink"}, "oversized must be one of 'split', 'drop', 'truncate', 'error'"),
        (PackFlat, {"max_length": 8, **FF, "drop_oversized": True, "oversized": "split"}, "pass only oversized="),
        (PackFlat, {"max_length": 8, "tokens_field": ""}, "tokens_field must be a field name"),
        (PackSequences, {"max_length": 8, "pad_token_id": 0}, "pack_sequences: pad_token_id does not apply"),
        (PackSequences, {"max_length": 8, "algorithm": "first_fit"}, "pack_sequences: algorithm='first_fit' needs num_bins"),
    ],
)
def test_config_errors_teach(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_pack_sequences_has_no_flat_only_options():
    with pytest.raises(TypeError):
        PackSequences(8, emit_positions=False)
    PackSequences(8, max_sequences_per_bin=2)  # no pad needed: envelopes are not padded
