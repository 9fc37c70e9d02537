"""Per-document attention masks from to_training tensors: FlexAttention equals dense masked attention.

Every check builds the expected mask independently, from the records' document lengths
(``meta.segments``) and padding (``meta.padding_length`` and the padding to_training adds), and
compares ``flex_attention`` with the ``BlockMask`` against ``scaled_dot_product_attention`` with that
dense boolean mask. FlexAttention runs eagerly on CPU (forward only), which is fast at these sizes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from zephon import Pipeline
from zephon.integrations.torch import document_block_mask, document_ids, varlen_boundaries
from zephon.io import Dataset
from zephon.testing import word_tokenizer
from zephon.types import Meta, Record, SampleBatch, Segment

TOK = word_tokenizer()
WORDS = [3, 9, 1, 5, 12, 2, 7, 4, 6, 2, 10, 3, 1, 8, 5]  # words per text; tokens = words + EOS
H, D = 2, 8
TOL = 1e-5


def pipeline_batches(row_length=13, batch_size=3):
    rows = [{"text": " ".join(f"w{(i + j) % 50}" for j in range(n))} for i, n in enumerate(WORDS)]
    pipe = Pipeline(Dataset.from_rows("docs", rows)).tokenize(TOK, special_tokens="eos", eos_token_id=1)
    pipe = pipe.pack_flat(row_length, pad_token_id=0, emit_positions=True).batch(batch_size, drop_last=False)
    return list(pipe)


def packed_batch(rows):
    """A batch of packed rows, one per list of document lengths, each padded to its ``(lengths, padding)``."""
    records = []
    for i, (lengths, padding) in enumerate(rows):
        positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(padding)]).astype(np.int32)
        tokens = np.arange(2, 2 + len(positions), dtype=np.int32)
        segments = tuple(Segment(0, 0, 10 * i + j, 0, 0, n) for j, n in enumerate(lengths))
        records.append(Record({"input_ids": tokens, "positions": positions}, Meta(0, segments, padding)))
    return SampleBatch(tuple(records))


def expected_documents(batch, width, left_padding=False):
    """``(B, width)`` document index per input token, -1 on padding, from the records' segments.

    Rows are ``width + 1`` tokens before the label shift drops the last one.
    """
    rows = []
    for record in batch.records:
        row = [j for j, s in enumerate(record.meta.segments) for _ in range(s.end - s.start)]
        row += [-1] * record.meta.padding_length
        added = [-1] * (width + 1 - len(row))
        rows.append(((added + row) if left_padding else (row + added))[:width])
    return torch.tensor(rows)


def dense_mask(docs, causal=True, window=None):
    """``(B, 1, T, T)`` bool: same document, both real, causal and within the window as asked."""
    q = torch.arange(docs.shape[-1])[:, None]
    k = torch.arange(docs.shape[-1])[None, :]
    allowed = (docs[:, :, None] == docs[:, None, :]) & (docs[:, :, None] >= 0)
    if causal:
        allowed &= k <= q
    if window is not None:
        allowed &= (q - k).abs() < window
    return allowed[:, None]


def compare(tensors, docs, causal=True, window=None, block_size=8):
    """Max |flex - dense| over real queries; asserts padding queries give exact zeros, never NaN."""
    mask = document_block_mask(tensors, causal, sliding_window=window, block_size=block_size)
    flat = tensors["input_ids"].dim() == 1
    B, T = docs.shape
    gen = torch.Generator().manual_seed(B * 1000 + T)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    if flat:
        q, k, v = (x.transpose(0, 1).reshape(1, H, B * T, D) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager flex_attention warns that it is not compiled
        got = flex_attention(q, k, v, block_mask=mask)
    if flat:
        got = got.reshape(H, B, T, D).transpose(0, 1)
        q, k, v = (x.reshape(H, B, T, D).transpose(0, 1) for x in (q, k, v))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(docs, causal, window))
    real = docs >= 0
    assert not torch.isnan(got).any()
    assert torch.equal(got.transpose(1, 2)[~real], torch.zeros_like(got.transpose(1, 2)[~real]))
    return float((got - reference).abs().transpose(1, 2)[real].max())


# -- a real pipeline: tokenize -> pack_flat -> batch -> to_training --------------------------------------------


LAYOUTS = {
    "packed, padding_mask": dict(return_labels=True, return_padding_mask=True),
    "padding='longest', pad_to_multiple_of": dict(return_labels=True, padding="longest", pad_to_multiple_of=16),
    "flat cu_seqlens": dict(return_labels=True, flatten=True, return_cu_seqlens=True, return_padding_mask=True),
    "cu_seqlens, sequence positions": dict(return_labels=True, return_cu_seqlens=True, position_mode="sequence",
                                            padding="longest", pad_to_multiple_of=16),
    "to_training's document_ids": dict(return_labels=True, return_document_ids=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
def test_pipeline_batches_flex_attention_equals_dense_document_mask(layout, causal):
    batches = pipeline_batches()
    assert any(r.meta.padding_length for b in batches for r in b.records)  # the last row is padded
    for batch in batches:
        tensors = batch.to_training(**LAYOUTS[layout])
        width = tensors["input_ids"].numel() // len(batch.records)
        docs = expected_documents(batch, width)
        assert torch.equal(document_ids(tensors).reshape(docs.shape).ge(0), docs.ge(0))
        assert compare(tensors, docs, causal) < TOL


def test_sliding_window_and_left_padding():
    batch = packed_batch([([5, 9, 3], 0), ([4, 2], 11), ([19], 0)])
    tensors = batch.to_training(return_labels=True, padding="longest", padding_side="left", pad_to_multiple_of=8,
                                 pad_token_id=0)
    assert tensors["input_ids"].shape == (3, 24)
    assert compare(tensors, expected_documents(batch, 24, left_padding=True), window=4) < TOL


def test_packed_padding_without_a_padding_field_is_a_document_of_its_own():
    batch = packed_batch([([3, 4], 2), ([2], 7)])
    ids = document_ids(batch.to_training(return_labels=True))
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1]]
    padded = batch.to_training(return_labels=True, return_padding_mask=True)
    assert document_ids(padded).tolist() == [[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, -1, -1, -1, -1, -1, -1]]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 6)), min_size=1, max_size=3
    ),
    flatten=st.booleans(),
    causal=st.booleans(),
    source=st.sampled_from(["positions", "cu_seqlens"]),
)
def test_drawn_document_lengths(rows, flatten, causal, source):
    assume(all(sum(lengths) + padding > 1 for lengths, padding in rows))  # at least one input after the shift
    batch = packed_batch(rows)
    options = dict(return_labels=True, padding="longest", pad_to_multiple_of=8, flatten=flatten, pad_token_id=0)
    tensors = batch.to_training(**options, return_cu_seqlens=source == "cu_seqlens")
    width = tensors["input_ids"].numel() // len(rows)
    docs = expected_documents(batch, width)
    assert compare(tensors, docs, causal) < TOL
    cu, max_seqlen = varlen_boundaries(tensors)
    runs = torch.unique_consecutive(torch.cat([docs + 1000 * i for i, docs in enumerate(docs)]), return_counts=True)[1]
    assert cu.tolist() == [0, *torch.cumsum(runs, 0).tolist()] and max_seqlen == int(runs.max())


# -- errors ------------------------------------------------------------------------------------------------------


def test_missing_document_fields_name_the_options():
    batch = packed_batch([([3, 4], 0)])
    tensors = batch.to_training(return_labels=True, position_mode="sequence")
    del tensors["positions"]
    with pytest.raises(KeyError, match="return_cu_seqlens=True"):
        document_block_mask(tensors)


def test_wrong_shapes_and_values_fail_clearly():
    batch = packed_batch([([3, 4], 0), ([5, 2], 0)])
    tensors = batch.to_training(return_labels=True, return_cu_seqlens=True, return_padding_mask=True)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        document_ids({**tensors, "cu_seqlens": tensors["cu_seqlens"][0]})
    with pytest.raises(ValueError, match="rise from 0"):
        document_ids({**tensors, "cu_seqlens": tensors["cu_seqlens"] + 1})
    with pytest.raises(ValueError, match="padding_mask"):
        document_ids({**tensors, "padding_mask": tensors["padding_mask"][:, 1:]})
    with pytest.raises(ValueError, match="must start at zero"):
        document_ids({"positions": tensors["positions"] + 1})
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        document_ids({"positions": tensors["positions"][None]})
    with pytest.raises(TypeError, match="torch tensor"):
        document_ids({"positions": tensors["positions"].numpy()})
    with pytest.raises(ValueError, match="sliding_window"):
        document_block_mask(tensors, sliding_window=0)
