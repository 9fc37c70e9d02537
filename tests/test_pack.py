"""pack_flat(wrap) scenarios, step by step."""

import numpy as np
import pytest

from _util import doc, docs
from zephon.ops import PackFlat
from zephon.testing import assert_checkpoint_equivalence, assert_chunking_invariance, run

LENGTHS = [3, 5, 2, 7, 4, 1, 6, 9, 2]  # the reference scenario: 39 tokens, max_length 8


def stream(records):
    return np.concatenate([r.payload["input_ids"] for r in records])


def test_reference_scenario_wrap_without_padding():
    records = docs(LENGTHS)
    state, rows = run(PackFlat(8), [records])
    # 39 tokens -> 4 full rows of 8; the 7-token tail is dropped at the end and counted.
    assert [len(r.payload["input_ids"]) for r in rows] == [8, 8, 8, 8]
    assert np.array_equal(np.concatenate([r.payload["input_ids"] for r in rows]), stream(records)[:32])
    assert PackFlat(8).report(state)["dropped_tokens"] == 7
    # Row 0 = doc0[0:3] + doc1[0:5]: positions restart at each document.
    assert rows[0].payload["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert [(s.row, s.start, s.end) for s in rows[0].meta.segments] == [(0, 0, 3), (1, 0, 5)]
    # Row 2 starts with the last token of doc 3 (split across rows): positions restart at the row start.
    assert [(s.row, s.start, s.end) for s in rows[2].meta.segments] == [(3, 6, 7), (4, 0, 4), (5, 0, 1), (6, 0, 2)]
    assert rows[2].payload["positions"].tolist() == [0, 0, 1, 2, 3, 0, 0, 1]


def test_reference_scenario_wrap_with_padding_keeps_every_token():
    records = docs(LENGTHS)
    _, rows = run(PackFlat(8, pad_token_id=0), [records])
    assert len(rows) == 5
    last = rows[-1]
    assert last.meta.padding_length == 1
    assert last.payload["input_ids"][-1] == 0
    assert last.payload["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]  # doc 7 tail, doc 8, pad segment
    real = np.concatenate([r.payload["input_ids"][: len(r.payload["input_ids"]) - r.meta.padding_length] for r in rows])
    assert np.array_equal(real, stream(records))


def test_no_token_dropped_at_chunk_boundaries():
    records = docs(LENGTHS)
    for cut in range(1, len(records)):
        assert_chunking_invariance(PackFlat(8), records, [cut])
    _, rows = run(PackFlat(8), [records[i : i + 1] for i in range(len(records))])
    assert len(rows) == 4


def test_aligned_fields_travel_and_pad_with_zero():
    records = [doc(i, n, loss_mask=np.ones(n, dtype=np.uint8) * (i % 2), text="dropped") for i, n in enumerate([3, 4])]
    _, rows = run(PackFlat(5, pad_token_id=9), [records])
    assert set(rows[0].payload) == {"input_ids", "loss_mask", "positions"}
    assert rows[0].payload["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    assert rows[1].payload["loss_mask"].tolist() == [1, 1, 0, 0, 0]
    assert rows[1].payload["input_ids"].tolist() == [1002, 1003, 9, 9, 9]


def test_empty_records_are_counted_not_silently_lost():
    state, rows = run(PackFlat(4), [[doc(0, 4), doc(1, 0), doc(2, 4)]])
    assert len(rows) == 2
    assert PackFlat(4).report(state)["dropped_empty_records"] == 1


def test_emit_positions_false_and_existing_positions_error():
    _, rows = run(PackFlat(4, emit_positions=False), [[doc(0, 4)]])
    assert "positions" not in rows[0].payload
    with pytest.raises(ValueError, match="emit_positions=False"):
        run(PackFlat(4), [[doc(0, 4, positions=np.arange(4))]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 0}, "max_length"),
        ({"max_length": 8, "algorithm": "zigzag"}, "unknown algorithm"),
        ({"max_length": 8, "pad_token_id": -1}, "pad_token_id"),
    ],
)
def test_config_errors_teach(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackFlat(**kwargs)


def test_missing_token_field_names_the_fix():
    from zephon.types import Meta, Record, Segment

    rec = Record({"text": "hi"}, Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0))
    with pytest.raises(ValueError, match="tokenize"):
        run(PackFlat(4), [[rec]])


def test_pad_value_must_fit_dtype():
    rec = doc(0, 2)
    rec.payload["input_ids"] = rec.payload["input_ids"].astype(np.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        run(PackFlat(4, pad_token_id=300), [[rec]])


@pytest.mark.parametrize("pad", [None, 0])
def test_checkpoint_equivalence(pad):
    records = docs(LENGTHS)
    assert_checkpoint_equivalence(PackFlat(8, pad_token_id=pad), [records[:2], records[2:3], [], records[3:7], records[7:]])


def test_rows_rebuild_from_metas_alone():
    from zephon.testing import input_resolver

    records = docs(LENGTHS)
    op = PackFlat(6, pad_token_id=0)
    _, rows = run(op, [records])
    rebuilt = op.rebuild([r.meta for r in rows], input_resolver([records]))
    assert all(np.array_equal(a.payload["input_ids"], b.payload["input_ids"]) for a, b in zip(rows, rebuilt))
    assert [r.meta for r in rebuilt] == [r.meta for r in rows]
