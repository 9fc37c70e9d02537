"""Context-parallel layout: each rank's slice of packed rows, checked against the unsplit row.

The reference is independent of the split: the unsplit output of the same options without
``context_parallel``, and dense causal document-masked attention over it built from its
``cu_seqlens``. Each rank's attention is computed for its own queries against every rank's keys
and values, with a mask built only from ``positions`` and ``document_ids``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zephon import to_training
from zephon.types import Meta, Record, SampleBatch, Segment

torch = pytest.importorskip("torch")

PAD = 0
LABELLED = dict(return_labels=True, return_loss_mask=True, return_num_valid_tokens=True, dtype=np.int64)


def packed_row(i: int, lengths: list[int], width: int, rng: np.random.Generator) -> Record:
    """A pack_flat-style row: documents of ``lengths`` tokens, then padding up to ``width``."""
    padding = width - sum(lengths)
    assert padding >= 0
    tokens = np.concatenate([rng.integers(1, 60, n) for n in lengths] + [np.full(padding, PAD)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(padding)])
    segments = tuple(Segment(0, 0, 10 * i + k, 0, 0, n) for k, n in enumerate(lengths))
    return Record({"input_ids": tokens, "positions": positions.astype(np.int32)}, Meta(0, segments, padding))


def batch_of(rows: list[list[int]], width: int, seed: int = 0) -> SampleBatch:
    rng = np.random.default_rng(seed)
    return SampleBatch(tuple(packed_row(i, lengths, width, rng) for i, lengths in enumerate(rows)))


def ranks(batch: SampleBatch, size: int, **options) -> list[dict]:
    return [to_training(batch, context_parallel=(size, r), **options) for r in range(size)]


def chunk_order(parts: list[np.ndarray], size: int, balanced: bool) -> np.ndarray:
    """The rank slices ``[..., n]`` of one sequence put back in chunk order."""
    m = 2 * size if balanced else size
    chunks: list = [None] * m
    for r, part in enumerate(parts):
        owned = (r, m - 1 - r) if balanced else (r,)
        for k, piece in zip(owned, np.split(part, len(owned), axis=-1)):
            chunks[k] = piece
    return np.concatenate(chunks, axis=-1)


def reassemble_bshd(outs: list[dict], name: str, size: int, balanced: bool) -> np.ndarray:
    return chunk_order([np.asarray(o[name]) for o in outs], size, balanced)


def reassemble_thd(outs: list[dict], name: str, size: int, balanced: bool) -> np.ndarray:
    """Each sequence of every row (per ``cu_seqlens_padded``) put back from the ranks' slices."""
    padded = np.asarray(outs[0]["cu_seqlens_padded"])
    rows = []
    for i, cu in enumerate(padded):
        offsets = [0] * size
        row = []
        for p in np.diff(cu):
            share = int(p) // size  # two chunks of p / (2 * size), or one of p / size
            parts = [np.asarray(o[name])[i, ..., offsets[r] : offsets[r] + share] for r, o in enumerate(outs)]
            offsets = [x + share for x in offsets]
            row.append(chunk_order(parts, size, balanced))
        rows.append(np.concatenate(row, axis=-1))
    return np.stack(rows)


FIELDS = ("input_ids", "labels", "positions", "loss_mask", "document_ids")


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bshd_slices_reassemble_to_the_unsplit_row(size, balanced):
    batch = batch_of([[5, 7], [3, 3, 2]], 12 * size + 1)
    full = to_training(batch, return_document_ids=True, **LABELLED)
    outs = ranks(batch, size, load_balance=balanced, return_document_ids=True, **LABELLED)
    for o in outs:
        assert np.asarray(o["input_ids"]).shape == (2, 12)
    for name in FIELDS:
        np.testing.assert_array_equal(reassemble_bshd(outs, name, size, balanced), full[name], err_msg=name)
    assert sum(o["num_valid_tokens"] for o in outs) == full["num_valid_tokens"]


def test_bshd_keeps_the_full_rows_boundaries_on_every_rank():
    batch = batch_of([[5, 7], [3, 3, 2]], 13)
    full = to_training(batch, return_labels=True, return_cu_seqlens=True, dtype=None)
    for o in ranks(batch, 3, return_labels=True, return_cu_seqlens=True, dtype=None):
        assert (o["cu_seqlens"], o["max_seqlen"]) == (full["cu_seqlens"], full["max_seqlen"])


def test_thd_flattened_runs_over_the_batch():
    batch = batch_of([[5, 7], [3, 3, 2]], 13)
    options = dict(return_labels=True, context_parallel_format="thd", padding="max_length", max_length=17,
                   pad_token_id=PAD, dtype=np.int64)
    for rows, flat in zip(ranks(batch, 2, **options), ranks(batch, 2, flatten=True, **options)):
        np.testing.assert_array_equal(flat["input_ids"], rows["input_ids"].reshape(-1))
        lengths = np.diff(rows["cu_seqlens_padded"], axis=1)
        np.testing.assert_array_equal(np.diff(flat["cu_seqlens_padded"]), lengths[lengths > 0])
        real = np.diff(rows["cu_seqlens"], axis=1)[lengths > 0]
        np.testing.assert_array_equal(np.diff(flat["cu_seqlens"]), real)
        assert flat["max_seqlen"] == int(lengths.max()) and flat["cu_seqlens_padded"][-1] == 2 * 16


def test_load_balanced_ranks_take_chunks_r_and_mirror():
    batch = batch_of([[9]], 9)
    rows = ranks(batch, 2, return_labels=True, dtype=None)  # 8 inputs in 4 chunks of 2
    assert [o["positions"] for o in rows] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    contiguous = ranks(batch, 2, load_balance=False, return_labels=True, dtype=None)
    assert [o["positions"] for o in contiguous] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_thd_pads_each_document_and_keeps_every_token(size, balanced):
    m = 2 * size if balanced else size
    batch = batch_of([[5, 7], [3, 3, 2]], 13)
    width = m * (-(-12 // m) + 2)  # room for the documents, each padded to a multiple of m
    options = dict(LABELLED, return_document_ids=True, padding="max_length", max_length=width + 1, pad_token_id=PAD)
    full = to_training(batch, **options)
    outs = ranks(batch, size, load_balance=balanced, context_parallel_format="thd", **options)
    cu, cu_padded = np.asarray(outs[0]["cu_seqlens"]), np.asarray(outs[0]["cu_seqlens_padded"])
    for o in outs[1:]:  # the boundaries describe the padded row, the same on every rank
        np.testing.assert_array_equal(o["cu_seqlens_padded"], cu_padded)
    assert (np.diff(cu_padded) % m == 0).all() and (cu_padded[:, -1] == width).all()
    docs = reassemble_thd(outs, "document_ids", size, balanced)
    for i in range(2):
        real = np.diff(cu[i])
        for k, (start, stop) in enumerate(zip(cu_padded[i][:-1], cu_padded[i][1:])):
            # each sequence: its real tokens first, then padding up to its padded length
            assert (docs[i, start : start + real[k]] >= 0).all() and (docs[i, start + real[k] : stop] == -1).all()
    keep = docs >= 0
    for name in FIELDS:
        back = reassemble_thd(outs, name, size, balanced)
        for i in range(2):
            np.testing.assert_array_equal(back[i][keep[i]], full[name][i][full["document_ids"][i] >= 0], err_msg=name)
        if name == "labels":
            assert (back[~keep] == -100).all()
        if name == "loss_mask":
            assert (back[~keep] == 0).all()
        if name == "input_ids":
            assert (back[~keep] == PAD).all()
    assert sum(o["num_valid_tokens"] for o in outs) == full["num_valid_tokens"]


# -- attention equivalence -----------------------------------------------------------------------------


def _qkv(ids: np.ndarray, pos: np.ndarray, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 8, generator=g, dtype=torch.float64)
    pemb = torch.randn(128, 8, generator=g, dtype=torch.float64)
    w = torch.randn(3, 8, 8, generator=g, dtype=torch.float64)
    x = emb[torch.as_tensor(ids)] + pemb[torch.as_tensor(pos)]
    return x @ w[0], x @ w[1], x @ w[2]


def _attend(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def reference_attention(full: dict, row: int) -> tuple:
    """Dense causal attention within the documents of ``cu_seqlens`` over the unsplit row."""
    ids, pos = full["input_ids"][row], full["positions"][row]
    q, k, v = _qkv(ids, pos)
    segment = torch.as_tensor(np.searchsorted(full["cu_seqlens"][row], np.arange(len(ids)), side="right"))
    index = torch.arange(len(ids))
    mask = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    real = ~torch.as_tensor(full["padding_mask"][row])
    return _attend(q, k, v, mask)[real]


def rank_attention(outs: list[dict], row: int) -> list:
    """Each rank's queries against all ranks' keys/values, masked by document ids and positions only."""
    ids = np.concatenate([o["input_ids"][row] for o in outs])
    pos = np.concatenate([o["positions"][row] for o in outs])
    doc = torch.as_tensor(np.concatenate([o["document_ids"][row] for o in outs]))
    _, k, v = _qkv(ids, pos)
    results = []
    for o in outs:
        q, _, _ = _qkv(o["input_ids"][row], o["positions"][row])
        qdoc, qpos = torch.as_tensor(o["document_ids"][row]), torch.as_tensor(o["positions"][row])
        mask = (qdoc[:, None] == doc[None, :]) & (torch.as_tensor(pos)[None, :] <= qpos[:, None])
        results.append(_attend(q, k, v, mask).T.numpy())  # [d, n]: chunks along the last axis
    return results


def check_attention(rows: list[list[int]], size: int, balanced: bool, fmt: str, width: int) -> float:
    batch = batch_of(rows, width)
    options = dict(return_labels=True, return_document_ids=True, dtype=np.int64)
    if fmt == "thd":
        options.update(padding="max_length", max_length=width, pad_token_id=PAD)
    full = to_training(batch, return_cu_seqlens=True, return_padding_mask=True, **options)
    outs = ranks(batch, size, load_balance=balanced, context_parallel_format=fmt, **options)
    worst = 0.0
    for row in range(len(rows)):
        expected = reference_attention(full, row).numpy()
        parts = rank_attention(outs, row)
        if fmt == "bshd":
            got = chunk_order(parts, size, balanced).T[~full["padding_mask"][row]]
        else:
            docs = reassemble_thd(outs, "document_ids", size, balanced)[row]
            per_rank = [{"x": p[None]} for p in parts]
            for o, p in zip(per_rank, outs):
                o["cu_seqlens_padded"] = p["cu_seqlens_padded"][row : row + 1]
            got = reassemble_thd(per_rank, "x", size, balanced)[0].T[docs >= 0]
        assert got.shape == expected.shape
        worst = max(worst, float(np.abs(got - expected).max()))
    assert worst <= 1e-6
    return worst


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("balanced", [True, False])
def test_chunked_attention_equals_the_full_rows(fmt, balanced):
    check_attention([[6, 9, 4], [12, 1, 3, 2]], 4, balanced, fmt, 8 * 8 + 1)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 11), min_size=1, max_size=4), min_size=1, max_size=2),
    size=st.integers(1, 3), balanced=st.booleans(), fmt=st.sampled_from(["bshd", "thd"]), room=st.integers(0, 1),
)
def test_chunked_attention_equals_the_full_rows_for_any_documents(rows, size, balanced, fmt, room):
    m = 2 * size if balanced else size
    if fmt == "bshd":  # inputs: a multiple of m at least the longest row minus its label-shifted token
        inputs = (-(-(max(map(sum, rows)) - 1) // m) + room) * m
    else:  # room for every document padded to a multiple of m
        inputs = (max(sum(-(-n // m) * m for n in r) for r in rows) // m + room) * m
    check_attention(rows, size, balanced, fmt, max(inputs, m) + 1)
    batch = batch_of(rows, max(inputs, m) + 1)
    extra = dict(padding="max_length", max_length=max(inputs, m) + 1, pad_token_id=PAD) if fmt == "thd" else {}
    outs = ranks(batch, size, load_balance=balanced, context_parallel_format=fmt, **extra, **LABELLED)
    counts = [o["num_valid_tokens"] for o in outs]
    assert sum(counts) == to_training(batch, **extra, **LABELLED)["num_valid_tokens"]


# -- document ids ---------------------------------------------------------------------------------------


def test_document_ids_follow_cu_seqlens_and_mark_padding():
    batch = batch_of([[3, 2], [4]], 8)
    out = to_training(batch, return_labels=True, return_document_ids=True, return_cu_seqlens=True, dtype=None)
    assert out["document_ids"] == [[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, -1, -1, -1]]
    for ids, cu in zip(out["document_ids"], out["cu_seqlens"]):
        segment = np.searchsorted(cu, np.arange(len(ids)), side="right") - 1
        real = np.asarray(ids) >= 0
        np.testing.assert_array_equal(np.asarray(ids)[real], segment[real])
    flat = to_training(batch, return_labels=True, return_document_ids=True, flatten=True, dtype=None)
    assert flat["document_ids"] == [0, 0, 0, 1, 1, -1, -1, 2, 2, 2, 2, -1, -1, -1]
    assert to_training(batch, return_document_ids=True, dtype=torch.bfloat16)["document_ids"].dtype == torch.long
    empty = to_training(SampleBatch(()), return_document_ids=True, context_parallel=(2, 0),
                        context_parallel_format="thd", pad_token_id=0)
    assert empty["document_ids"] == [] and empty["cu_seqlens_padded"] == []


def test_unpacked_records_are_one_document_each():
    def rec(i, tokens):
        return Record({"input_ids": np.array(tokens)}, Meta(0, (Segment(0, 0, i, 0, 0, -1),)))

    batch = SampleBatch((rec(0, [5, 6, 7, 8, 9]), rec(1, [4, 3])))
    out = to_training(batch, return_document_ids=True, padding="longest", pad_token_id=0, dtype=None)
    assert out["document_ids"] == [[0, 0, 0, 0, 0], [0, 0, -1, -1, -1]]


# -- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(context_parallel=(0, 0)), "cp_size must be at least 1"),
        (dict(context_parallel=(2, 2)), r"cp_rank must lie in \[0, 2\)"),
        (dict(context_parallel=(2, -1)), "cp_rank must lie"),
        (dict(context_parallel=2), "pair of integers"),
        (dict(context_parallel=(2.0, 0)), "pair of integers"),
        (dict(context_parallel=(2, 0), context_parallel_format="sbhd"), "'bshd' or 'thd'"),
        (dict(context_parallel_format="thd"), "only with context_parallel"),
        (dict(load_balance=False), "only with context_parallel"),
        (dict(context_parallel=(2, 0), padding="longest", pad_token_id=0, padding_side="left"), "padding_side"),
    ],
)
def test_invalid_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        to_training(batch_of([[4]], 5), **options)


def test_rows_that_do_not_divide_are_refused_with_the_fix():
    batch = batch_of([[3, 4]], 8)  # 7 inputs
    with pytest.raises(ValueError, match=r"cuts every row into 4 chunks.*pack_flat\(max_length=N\)"):
        to_training(batch, context_parallel=(2, 1), return_labels=True)
    assert len(to_training(batch, context_parallel=(2, 1), dtype=None)["input_ids"][0]) == 4  # 8 slots unshifted


def test_thd_rows_without_room_are_refused_with_the_fix():
    batch = batch_of([[3, 6]], 9)  # 8 inputs, but 4 + 4 + ... : the documents need 4 + 8 slots
    with pytest.raises(ValueError, match=r"row 0 needs 12 slots.*max_length of at least 13"):
        to_training(batch, context_parallel=(2, 0), context_parallel_format="thd", pad_token_id=0, return_labels=True)
    with pytest.raises(ValueError, match="context_parallel_format='thd' requires pad_token_id"):
        to_training(batch, context_parallel=(2, 0), context_parallel_format="thd", return_labels=True)
