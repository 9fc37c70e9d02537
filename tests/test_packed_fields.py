"""Fields that are not token-aligned survive packing and batching, per segment, or are refused by name.

A document's scalar, string and non-aligned array fields (``doc_id``, ``source``, ``pixel_values``)
are kept per segment: a ``pack_flat`` row lists its pieces in ``payload["segments"]`` (row offset,
length and the document's fields), a ``pack_sequences`` piece keeps its document's fields, and
``to_training`` exposes both, and those of plain batched records, as ``out["segments"]``. A field
that cannot be carried is refused naming it; ``drop_fields=`` drops fields explicitly and counts them.
"""

import numpy as np
import pytest
import torch

from _util import doc
from zephon import Pipeline
from zephon.io import Dataset
from zephon.ops import PackFlat, PackSequences
from zephon.testing import assert_checkpoint_equivalence, run, word_tokenizer
from zephon.types import SampleBatch
from zephon.core.records import payload_equal

TOK = word_tokenizer()
WORDS = [3, 9, 1, 5, 12, 2, 7, 4, 6, 2, 10, 3, 1, 8, 5, 4]  # words per text; tokens = words + EOS


def fields_of(i):
    return {"doc_id": i, "source": "code" if i % 3 == 0 else "web", "pixel_values": np.full((3, 2), i, np.float32)}


def mm_docs(lengths):
    """Tokenized documents with a scalar, a string and a (3, 2) array next to their tokens."""
    return [doc(i, n, **fields_of(i)) for i, n in enumerate(lengths)]


ROWS = [{"text": " ".join(f"w{(i + j) % 50}" for j in range(n)), **fields_of(i)} for i, n in enumerate(WORDS)]


def pipeline(pack="flat", **kw):
    pipe = Pipeline(Dataset.from_rows("mm", ROWS)).tokenize(
        TOK, special_tokens="eos", eos_token_id=1, preserve_upstream_payload=True
    )
    if pack == "flat":
        pipe = pipe.pack_flat(8, pad_token_id=0, **kw)
    elif pack == "sequences":
        pipe = pipe.pack_sequences(8, **kw)
    return pipe.batch(2, drop_last=False)


def check_row_segments(row, source_docs):
    """Every piece of a pack_flat row has one segment dict: its offset, length and its document's fields."""
    segs = row.payload["segments"]
    assert len(segs) == len(row.meta.segments)
    offset = 0
    for seg, piece in zip(segs, row.meta.segments):
        src = source_docs[piece.row]
        assert seg["start"] == offset and seg["length"] == piece.end - piece.start
        got = row.payload["input_ids"][seg["start"] : seg["start"] + seg["length"]]
        assert np.array_equal(got, src.payload["input_ids"][piece.start : piece.end])
        extra = {k: v for k, v in src.payload.items() if k != "input_ids"}
        assert payload_equal({k: v for k, v in seg.items() if k not in ("start", "length")}, extra)
        offset += seg["length"]


# -- pack_flat ------------------------------------------------------------------------------------------

FLAT = {
    "wrap": dict(algorithm="wrap", pad_token_id=0),
    "wrap_capped": dict(algorithm="wrap", max_sequences_per_bin=2, pad_token_id=0),
    "first_fit": dict(algorithm="first_fit", num_bins=2, pad_token_id=0, oversized="split"),
    "best_fit_wrap": dict(algorithm="best_fit_wrap", candidate_pool_size=3, pad_token_id=0),
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_pack_flat_keeps_every_documents_fields_on_each_of_its_segments(name):
    records = mm_docs([3, 5, 2, 11, 4, 1, 6, 9, 2])
    _, rows = run(PackFlat(8, **FLAT[name]), [records[:4], records[4:]])
    seen = {i: 0 for i in range(len(records))}
    for row in rows:
        check_row_segments(row, records)
        for seg in row.payload["segments"]:
            seen[seg["doc_id"]] += seg["length"]
    assert seen == {i: len(r.payload["input_ids"]) for i, r in enumerate(records)}  # every token, every document


def test_a_document_split_by_wrap_carries_its_fields_into_every_row_it_appears_in():
    records = mm_docs([3, 15, 2])
    _, rows = run(PackFlat(8, pad_token_id=0), [records])
    rows_with_doc1 = [r for r in rows if any(s["doc_id"] == 1 for s in r.payload["segments"])]
    assert len(rows_with_doc1) == 3  # 3 + 15 + 2 tokens: document 1 spans all three rows
    for row in rows_with_doc1:
        check_row_segments(row, records)


@pytest.mark.parametrize("name", sorted(FLAT))
def test_pack_flat_segments_restore_identically_at_every_boundary(name):
    records = mm_docs([3, 5, 2, 11, 4, 1, 6, 9, 2])
    assert_checkpoint_equivalence(PackFlat(8, **FLAT[name]), [records[:2], records[2:5], records[5:]])


def test_token_aligned_fields_are_still_packed_and_rows_of_bare_tokens_are_unchanged():
    records = [doc(i, n, loss_mask=np.ones(n, np.uint8), doc_id=i) for i, n in enumerate([3, 5])]
    _, rows = run(PackFlat(8), [records])
    assert sorted(rows[0].payload) == ["input_ids", "loss_mask", "positions", "segments"]
    assert rows[0].payload["loss_mask"].tolist() == [1] * 8
    assert [s["doc_id"] for s in rows[0].payload["segments"]] == [0, 1]
    _, bare = run(PackFlat(8), [[doc(0, 3), doc(1, 5)]])
    assert sorted(bare[0].payload) == ["input_ids", "positions"]


def test_a_payload_positions_field_is_packed_as_a_token_aligned_field_without_emit_positions():
    records = [doc(i, 4, positions=np.arange(4) + 10 * i) for i in range(2)]
    _, rows = run(PackFlat(8, emit_positions=False), [records])
    assert rows[0].payload["positions"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert "segments" not in rows[0].payload


def test_documents_without_fields_get_an_offset_only_segment_next_to_those_with_fields():
    records = [doc(0, 3, doc_id=7), doc(1, 5)]
    _, rows = run(PackFlat(8), [records])
    assert rows[0].payload["segments"] == [{"start": 0, "length": 3, "doc_id": 7}, {"start": 3, "length": 5}]


# -- refusals and explicit drops ------------------------------------------------------------------------


class Handle:  # a local class's instances pickle, but a lambda held in a field does not
    pass


@pytest.mark.parametrize("op", [PackFlat(8), PackSequences(8)])
def test_a_field_that_cannot_be_carried_is_refused_naming_it_and_the_fix(op):
    records = [doc(0, 3, doc_id=0, handle=lambda: None)]
    with pytest.raises(ValueError, match=r"field 'handle'.*row 0.*drop_fields=\('handle',\)"):
        run(op, [records])


@pytest.mark.parametrize("name", ["start", "length", "segments"])
def test_pack_flat_refuses_a_field_named_like_the_segment_keys(name):
    with pytest.raises(ValueError, match=rf"field '{name}'.*drop_fields"):
        run(PackFlat(8), [[doc(0, 3, **{name: 1})]])


@pytest.mark.parametrize("cls", [PackFlat, PackSequences])
def test_drop_fields_drops_explicitly_and_counts_every_dropped_value(cls):
    records = [doc(i, 3, doc_id=i, handle=lambda: None) for i in range(5)] + [doc(5, 3, doc_id=5)]
    op = cls(8, drop_fields=("handle",))
    state, rows = run(op, [records])
    assert op.report(state)["dropped_field_values"] == 5
    if cls is PackFlat:
        assert all(set(s) == {"start", "length", "doc_id"} for r in rows for s in r.payload["segments"])
    else:
        assert all("handle" not in p for r in rows for p in r.payload["packed_samples"])


def test_drop_fields_is_checked():
    with pytest.raises(TypeError, match=r"drop_fields=\('source',\)"):
        PackFlat(8, drop_fields="source")
    with pytest.raises(ValueError, match="token field 'input_ids'"):
        run(PackFlat(8, drop_fields=("input_ids",)), [[doc(0, 3)]])
    assert "drop_fields" not in PackFlat(8).fingerprint()  # checkpoints of the default settings stay valid
    assert PackFlat(8, drop_fields=("a",)).fingerprint()["drop_fields"] == ["a"]


# -- pack_sequences -------------------------------------------------------------------------------------


def test_pack_sequences_keeps_the_fields_of_split_documents_on_every_piece():
    records = mm_docs([3, 15, 2])
    _, envs = run(PackSequences(8), [records])
    pieces = [(p, s) for e in envs for p, s in zip(e.payload["packed_samples"], e.meta.segments)]
    assert len(pieces) == 5  # d0 d1[0:5] / d1[5:13] / d1[13:15] d2
    for sample, seg in pieces:
        src = records[seg.row].payload
        assert np.array_equal(sample["input_ids"], src["input_ids"][seg.start : seg.end])
        assert payload_equal({k: v for k, v in sample.items() if k != "input_ids"}, fields_of(seg.row))


@pytest.mark.parametrize("algorithm", ["wrap", "best_fit_wrap"])
def test_pack_sequences_fields_restore_identically_at_every_boundary(algorithm):
    records = mm_docs([3, 5, 2, 11, 4, 1, 6, 9, 2])
    kw = {"candidate_pool_size": 3} if algorithm == "best_fit_wrap" else {}
    assert_checkpoint_equivalence(PackSequences(8, algorithm=algorithm, **kw), [records[:3], records[3:]])


# -- to_training and the pipeline -----------------------------------------------------------------------


def run_pipeline(pack):
    """(the batches, each batch's to_training output) of a finite pipeline."""
    batches = list(pipeline(pack))
    return batches, [b.to_training(return_labels=True, padding="longest", pad_token_id=0, dtype=np.int64) for b in batches]


def test_tokenize_pack_flat_batch_exposes_every_documents_fields_in_to_training_segments():
    tokens = [n + 1 for n in WORDS]
    batches, outs = run_pipeline("flat")
    seen = {i: 0 for i in range(len(ROWS))}
    for batch, out in zip(batches, outs):
        assert len(out["segments"]) == len(batch.records)
        for row_segments, ids, rec in zip(out["segments"], out["ids"], batch.records):
            assert len(row_segments) == len(ids) == len(rec.meta.segments)
            for seg, pointer, piece in zip(row_segments, ids, rec.meta.segments):
                row = ROWS[pointer[2]]
                assert seg["doc_id"] == pointer[2] and seg["source"] == row["source"] and seg["text"] == row["text"]
                assert isinstance(seg["pixel_values"], np.ndarray) and np.array_equal(seg["pixel_values"], row["pixel_values"])
                assert seg["length"] == piece.end - piece.start
                seen[seg["doc_id"]] += seg["length"]
                # the output holds the payload's tokens at the segment's offsets
                got = rec.payload["input_ids"][seg["start"] : seg["start"] + seg["length"]]
                assert np.array_equal(got, np.asarray(TOK.encode(row["text"]).ids + [1])[piece.start : piece.end])
    assert seen == dict(enumerate(tokens))


def test_to_training_segments_do_not_alias_the_payload():
    batch = next(iter(pipeline("flat")))
    out = batch.to_training(return_labels=True, dtype=np.int64)
    out["segments"][0][0]["pixel_values"][:] = -1
    assert (batch.records[0].payload["segments"][0]["pixel_values"] >= 0).all()


def test_a_restored_run_yields_identical_rows_and_segment_fields():
    it = iter(pipeline("flat"))
    for _ in range(3):
        next(it)
    ck = it.checkpoint()
    expected = list(it)
    restored = list(pipeline("flat").restore(ck))
    assert len(restored) == len(expected) > 0
    for a, b in zip(expected, restored):
        assert [r.meta for r in a.records] == [r.meta for r in b.records]
        ta, tb = (x.to_training(return_labels=True, dtype=np.int64) for x in (a, b))
        assert np.array_equal(ta["input_ids"], tb["input_ids"]) and np.array_equal(ta["labels"], tb["labels"])
        assert payload_equal(ta["segments"], tb["segments"])


def test_batch_keeps_non_array_fields_and_to_training_lists_them_per_record():
    batches = list(pipeline(None))
    assert sum(len(b) for b in batches) == len(ROWS)
    for batch in batches:
        for rec in batch.records:  # batch holds the records whole
            assert payload_equal({k: rec.payload[k] for k in fields_of(0)}, fields_of(rec.meta.segments[0].row))
        out = batch.to_training(padding="longest", padding_side="left", pad_token_id=0, dtype=torch.long)
        assert isinstance(out["input_ids"], torch.Tensor)
        width = out["input_ids"].shape[1]
        for (seg,), rec in zip(out["segments"], batch.records):
            n = len(rec.payload["input_ids"])
            assert seg["start"] == width - n and seg["length"] == n  # offsets in the left-padded output row
            assert isinstance(seg["pixel_values"], np.ndarray)  # segments stay numpy, only tokens become tensors
            assert payload_equal({k: v for k, v in seg.items() if k not in ("start", "length")}, fields_of(rec.meta.segments[0].row))
            assert "text" not in seg  # it is in out["texts"]


def test_to_training_refuses_a_record_field_named_like_a_segment_key():
    batch = SampleBatch((doc(0, 3, start=5),))
    with pytest.raises(ValueError, match=r"record 0: field 'start'"):
        batch.to_training(dtype=None)


def test_to_training_without_fields_has_no_segments_key():
    out = SampleBatch((doc(0, 3), doc(1, 3))).to_training(dtype=None)
    assert "segments" not in out


def test_pack_sequences_pipeline_batches_keep_every_piece_with_its_fields():
    batches = list(pipeline("sequences"))
    seen = {i: 0 for i in range(len(ROWS))}
    for batch in batches:
        for env in batch.records:
            for sample, seg in zip(env.payload["packed_samples"], env.meta.segments):
                assert sample["doc_id"] == seg.row and np.array_equal(sample["pixel_values"], ROWS[seg.row]["pixel_values"])
                seen[seg.row] += len(sample["input_ids"])
    assert seen == {i: n + 1 for i, n in enumerate(WORDS)}


def test_torch_dataset_yields_the_segments():
    from torch.utils.data import DataLoader

    pipe = pipeline("flat")
    got = list(DataLoader(pipe.to_torch_dataset(return_labels=True), batch_size=None, num_workers=0))
    doc_ids = [s["doc_id"] for out in got for row in out["segments"] for s in row]
    assert set(doc_ids) == set(range(len(ROWS)))
    assert all(isinstance(out["input_ids"], torch.Tensor) for out in got)


def test_segments_come_back_from_a_worker_process_unchanged():
    here = list(pipeline("flat"))
    there = list(pipeline("flat").options(workers=1))
    assert len(there) == len(here)
    for a, b in zip(here, there):
        assert [r.meta for r in a.records] == [r.meta for r in b.records]
        assert all(payload_equal(x.payload, y.payload) for x, y in zip(a.records, b.records))
