"""to_training: shifted labels, loss masks, positions, cu_seqlens, dynamic padding, errors.

Expected values come from the specification (Zephon 0.2.0's worked example, the seed documents)
or are derived by hand in the comments; the property test compares against a loop-by-loop
reference written from the definitions, never against the code under test.

torch is optional: only the tests (or parameters) that produce tensors import it, through
``pytest.importorskip``, and ``test_numpy_paths_run_without_torch`` runs this whole file again with
torch made unimportable, so a numpy test that touches torch, or an eager torch import in the
library, fails there.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon.training.convert import TrainingSpec, to_training
from zephon.types import Meta, Record, SampleBatch, Segment

BOS, EOS, PAD = 1, 2, 0
#: Set in the run of this file with torch made unimportable.
NO_TORCH = os.environ.get("ZEPHON_TEST_NO_TORCH") == "1"


def torch_module():
    """torch, or skip the calling test (the numpy paths never need it)."""
    return pytest.importorskip("torch")


def rec(tokens, *, row: int = 0, padding_length: int = 0, positions=None, loss_mask=None, **fields) -> Record:
    """A record with int64 tokens, optional int32 positions and uint8 loss mask, source row ``row``."""
    payload: dict[str, Any] = {"input_ids": np.asarray(tokens, dtype=np.int64)}
    if positions is not None:
        payload["positions"] = np.asarray(positions, dtype=np.int32)
    if loss_mask is not None:
        payload["loss_mask"] = np.asarray(loss_mask, dtype=np.uint8)
    payload.update({k: np.asarray(v) for k, v in fields.items()})
    return Record(payload, Meta(0, (Segment(0, 0, row, 0, 0, -1),), padding_length))


def batch_of(*records: Record) -> SampleBatch:
    return SampleBatch(tuple(records))


class CarriesPad:
    """A stand-in batch: records and the tokenizer's pad id, all that to_training reads."""

    def __init__(self, records, pad_token_id=None):
        self.records = tuple(records)
        self.pad_token_id = pad_token_id


class RecordsOnly:
    """A stand-in batch without a pad id attribute at all."""

    def __init__(self, records):
        self.records = tuple(records)


def sample_batch_carrying(records, pad_token_id) -> SampleBatch:
    """A real SampleBatch that carries the tokenizer's pad id, as the pipeline builds it."""
    return SampleBatch(tuple(records), pad_token_id=pad_token_id)


def values(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


def dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


@pytest.fixture(params=["numpy", "torch"])
def array_dtype(request):
    return np.int64 if request.param == "numpy" else torch_module().long


@pytest.fixture(params=["list", "numpy", "torch"])
def any_dtype(request):
    return {"list": None, "numpy": np.int64}[request.param] if request.param != "torch" else torch_module().long


def is_framework(x: Any, dtype: Any) -> bool:
    if dtype is None:
        return isinstance(x, list)
    if dtype is np.int64:
        return isinstance(x, np.ndarray)
    return isinstance(x, torch_module().Tensor)


# -- Zephon 0.2.0 worked example (section C), every row --------------------------------------------------

def worked_example() -> SampleBatch:
    # BOS=1, EOS=2, pad=0. R0: two documents, no padding. R1: one document and a 5-token pad tail.
    r0 = rec([1, 11, 12, 2, 1, 21, 22, 2], row=0, positions=[0, 1, 2, 3, 0, 1, 2, 3])
    r1 = rec([1, 31, 2, 0, 0, 0, 0, 0], row=1, positions=[0, 1, 2, 0, 1, 2, 3, 4], padding_length=5)
    return batch_of(r0, r1)


def test_worked_example_defaults(array_dtype):
    out = worked_example().to_training(dtype=array_dtype)
    assert dtype_name(out["input_ids"]) == "int64" and tuple(out["input_ids"].shape) == (2, 8)
    assert values(out["input_ids"]) == [[1, 11, 12, 2, 1, 21, 22, 2], [1, 31, 2, 0, 0, 0, 0, 0]]
    assert tuple(out["positions"].shape) == (2, 8)
    assert values(out["positions"]) == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4]]
    assert list(out) == ["ids", "texts", "input_ids", "positions"]


def test_worked_example_labels(array_dtype):
    out = worked_example().to_training(dtype=array_dtype, return_labels=True)
    assert values(out["input_ids"])[0] == [1, 11, 12, 2, 1, 21, 22]
    assert values(out["labels"]) == [[11, 12, 2, 1, 21, 22, 2], [31, 2, -100, -100, -100, -100, -100]]
    assert values(out["positions"])[0] == [0, 1, 2, 3, 0, 1, 2]
    assert dtype_name(out["labels"]) == "int64"


def test_worked_example_loss_mask_and_count(array_dtype):
    out = worked_example().to_training(
        dtype=array_dtype, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True
    )
    assert dtype_name(out["loss_mask"]) == "float32"
    assert values(out["loss_mask"])[1] == [1, 1, 0, 0, 0, 0, 0]
    assert out["num_valid_tokens"] == 9 and type(out["num_valid_tokens"]) is int


def test_worked_example_eos_mask_loss(array_dtype):
    out = worked_example().to_training(
        dtype=array_dtype, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
        eos_mask_loss=True, eos_token_id=EOS,
    )
    # The EOS -> BOS prediction (input EOS at t=3) is masked; the prediction *of* EOS is kept.
    assert values(out["labels"])[0] == [11, 12, 2, -100, 21, 22, 2]
    assert out["num_valid_tokens"] == 8


def test_worked_example_cu_seqlens(array_dtype):
    out = worked_example().to_training(dtype=array_dtype, return_labels=True, return_cu_seqlens=True)
    assert values(out["cu_seqlens"]) == [[0, 4, 7], [0, 3, 7]]
    assert values(out["max_seqlen"]) == [4, 4]
    assert dtype_name(out["cu_seqlens"]) == "int32" and dtype_name(out["max_seqlen"]) == "int32"


def test_worked_example_cu_seqlens_flat(array_dtype):
    out = worked_example().to_training(dtype=array_dtype, return_labels=True, return_cu_seqlens=True, flatten=True)
    assert tuple(out["input_ids"].shape) == (14,)
    assert values(out["cu_seqlens"]) == [0, 4, 7, 10, 14]
    assert dtype_name(out["cu_seqlens"]) == "int32"
    assert out["max_seqlen"] == 4 and type(out["max_seqlen"]) is int


def test_worked_example_padding_mask(array_dtype):
    out = worked_example().to_training(dtype=array_dtype, return_labels=True, return_padding_mask=True)
    assert values(out["padding_mask"])[1] == [False, False, False, True, True, True, True]
    assert values(out["padding_mask"])[0] == [False] * 7
    assert dtype_name(out["padding_mask"]) == "bool"


def test_worked_example_sequence_positions(array_dtype):
    out = worked_example().to_training(dtype=array_dtype, return_labels=True, position_mode="sequence")
    assert values(out["positions"]) == [list(range(7)), list(range(7))]


def test_worked_example_rename_and_exclude(array_dtype):
    out = worked_example().to_training(
        dtype=array_dtype, return_labels=True, rename_fields={"input_ids": "tokens"}, exclude_fields=("ids", "texts")
    )
    assert list(out) == ["tokens", "labels", "positions"]


def test_key_order_follows_insertion():
    out = worked_example().to_training(
        dtype=np.int64, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
        return_cu_seqlens=True, return_padding_mask=True,
    )
    assert list(out) == [
        "ids", "texts", "padding_mask", "input_ids", "labels", "positions", "loss_mask",
        "num_valid_tokens", "cu_seqlens", "max_seqlen",
    ]


def test_ids_and_texts_are_per_record_lists():
    r0 = Record({"input_ids": np.array([5, 6]), "text": "a b"},
                Meta(3, (Segment(1, 2, 3, 0, 0, 1), Segment(1, 2, 4, 0, 0, 1)), 0))
    r1 = Record({"input_ids": np.array([7, 8])}, Meta(3, (Segment(0, 0, 9, 0, 0, -1),), 0))
    out = batch_of(r0, r1).to_training(dtype=np.int64)
    assert out["ids"] == [[(1, 2, 3), (1, 2, 4)], [(0, 0, 9)]]
    assert out["texts"] == ["a b", ""]


# -- seed 000: BOS a1 a2 EOS BOS b1 b2 EOS -----------------------------------------------------------

A1, A2, B1, B2 = 11, 12, 21, 22
SEED0 = [BOS, A1, A2, EOS, BOS, B1, B2, EOS]


@pytest.mark.parametrize("dtype", [None, "torch"])
def test_seed000_packed_record(dtype):
    dtype = torch_module().long if dtype == "torch" else None
    b = batch_of(rec(SEED0, positions=[0, 1, 2, 3, 0, 1, 2, 3]))
    base = dict(dtype=dtype, return_labels=True, return_loss_mask=True, return_cu_seqlens=True)
    out = b.to_training(**base)
    assert values(out["input_ids"]) == [[BOS, A1, A2, EOS, BOS, B1, B2]]
    assert values(out["labels"]) == [[A1, A2, EOS, BOS, B1, B2, EOS]]
    assert values(out["loss_mask"]) == [[1, 1, 1, 1, 1, 1, 1]]  # every prediction counts by default
    assert values(out["positions"]) == [[0, 1, 2, 3, 0, 1, 2]]  # per document
    assert values(out["cu_seqlens"]) == [[0, 4, 7]]
    # "optional: the EOS -> BOS prediction"
    masked = b.to_training(**base, eos_mask_loss=True, eos_token_id=EOS)
    assert values(masked["loss_mask"]) == [[1, 1, 1, 0, 1, 1, 1]]
    assert values(masked["labels"]) == [[A1, A2, EOS, -100, B1, B2, EOS]]
    # continuous positions; document boundaries still come from the payload positions
    seq = b.to_training(**base, position_mode="sequence")
    assert values(seq["positions"]) == [[0, 1, 2, 3, 4, 5, 6]]
    assert values(seq["cu_seqlens"]) == [[0, 4, 7]]


# -- seed 002: dynamic padding and prompt masking ------------------------------------------------------

def test_seed002_pad_to_longest_with_zero(array_dtype):
    records = (rec([15, 28, 92, 104], row=0), rec([45, 12, 88, 301, 402, 11, 9], row=1),
               rec([90, 81, 72, 63, 54], row=2))
    # Pad id 0, passed explicitly or carried by the batch (there is no default).
    for b, kwargs in ((batch_of(*records), {"pad_token_id": 0}), (CarriesPad(records, 0), {})):
        out = to_training(b, dtype=array_dtype, padding="longest", **kwargs)
        assert tuple(out["input_ids"].shape) == (3, 7)
        assert values(out["input_ids"]) == [
            [15, 28, 92, 104, 0, 0, 0],
            [45, 12, 88, 301, 402, 11, 9],
            [90, 81, 72, 63, 54, 0, 0],
        ]
        assert values(out["attention_mask"]) == [[1, 1, 1, 1, 0, 0, 0], [1] * 7, [1, 1, 1, 1, 1, 0, 0]]


def test_seed002_pad_with_gpt2_eos_and_attention_mask(array_dtype):
    b = batch_of(rec([101, 25, 48, 92], row=0), rec([205, 18, 99, 401, 55, 12], row=1), rec([310, 88, 14], row=2))
    out = b.to_training(dtype=array_dtype, padding="longest", pad_token_id=50256)
    assert tuple(out["input_ids"].shape) == (3, 6)
    assert values(out["input_ids"]) == [
        [101, 25, 48, 92, 50256, 50256],
        [205, 18, 99, 401, 55, 12],
        [310, 88, 14, 50256, 50256, 50256],
    ]
    assert values(out["attention_mask"]) == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert dtype_name(out["attention_mask"]) == "int64"


def test_seed002_prompt_masking_target_aligned(array_dtype):
    # Prompt [10, 20, 30] + response [40, 50]; the payload loss_mask marks *target* tokens (0 on the
    # prompt), as tokenize_chat emits it. Padded with 0 to 6 tokens by a longer neighbour.
    b = batch_of(rec([10, 20, 30, 40, 50], loss_mask=[0, 0, 0, 1, 1]),
                 rec([1, 2, 3, 4, 5, 6], loss_mask=[0, 1, 1, 1, 1, 1], row=1))
    # Shifted (Zephon): the supervised predictions are 30->40 and 40->50; nothing predicts a pad.
    out = b.to_training(dtype=array_dtype, return_labels=True, padding="longest", pad_token_id=PAD)
    assert values(out["input_ids"])[0] == [10, 20, 30, 40, 50]
    assert values(out["labels"])[0] == [-100, -100, 40, 50, -100]
    # Unshifted (Hugging Face): same length as input_ids, labels[t] = input_ids[t] or ignored.
    hf = b.to_training(dtype=array_dtype, return_labels=True, shift_labels=False, padding="longest", pad_token_id=PAD)
    assert values(hf["input_ids"])[0] == [10, 20, 30, 40, 50, 0]
    assert values(hf["labels"])[0] == [-100, -100, -100, 40, 50, -100]
    assert values(hf["attention_mask"])[0] == [1, 1, 1, 1, 1, 0]
    # The model's internal shift (logits[:, :-1] vs labels[:, 1:]) sees exactly the shifted labels.
    assert values(hf["labels"])[0][1:] == values(out["labels"])[0]


def test_seed002_prompt_masking_exact_vectors(array_dtype):
    # Seed 002 lists input_ids [10, 20, 30, 40, 50, 0] -> labels [-100, -100, -100, 50, 0, -100]
    # ("loss solely on positions predicting 40 -> 50 and 50 -> EOS"). Its labels are shifted left and
    # its mask is stated on the *predicting* positions (the inputs 40 and 50), and the trailing 0 is a
    # target the loss sees, i.e. a real EOS token rather than padding (a padding target is always
    # ignored). This is exactly the shifted mode: the 6-token record [10, 20, 30, 40, 50, EOS=0], whose
    # target-aligned mask marks the supervised targets 50 and EOS (the seed's input-aligned mask moved
    # one step right), padded to 7 so that the shift leaves 6 inputs. The unshifted mode cannot produce
    # it, since its labels equal their own input tokens (labels[3] would be 40).
    b = batch_of(rec([10, 20, 30, 40, 50, 0], loss_mask=[0, 0, 0, 0, 1, 1]))
    out = b.to_training(dtype=array_dtype, return_labels=True, padding="max_length", max_length=7, pad_token_id=PAD)
    assert values(out["input_ids"]) == [[10, 20, 30, 40, 50, 0]]
    assert values(out["labels"]) == [[-100, -100, -100, 50, 0, -100]]
    # Seed 002's 8-token example follows the target-aligned convention directly: prompt [15, 28, 92,
    # 104] and response [45, 12, 88, 301] + EOS give "[-100, -100, -100, 45, 12, 88, 301, EOS]".
    eos = 50256
    b = batch_of(rec([15, 28, 92, 104, 45, 12, 88, 301, eos], loss_mask=[0, 0, 0, 0, 1, 1, 1, 1, 1]))
    out = b.to_training(dtype=array_dtype, return_labels=True, return_num_valid_tokens=True)
    assert values(out["input_ids"]) == [[15, 28, 92, 104, 45, 12, 88, 301]]
    assert values(out["labels"]) == [[-100, -100, -100, 45, 12, 88, 301, eos]]
    assert out["num_valid_tokens"] == 5


def test_prompt_and_padding_labels_ignored_everywhere(array_dtype):
    b = batch_of(rec([5, 6, 7], loss_mask=[0, 1, 1]), rec([8, 9, 10, 11, 12], loss_mask=[0, 0, 1, 1, 1], row=1))
    out = b.to_training(dtype=array_dtype, return_labels=True, padding="longest", pad_token_id=PAD,
                        return_loss_mask=True, return_num_valid_tokens=True, ignore_index=-1)
    # row 0: targets 6, 7, pad, pad -> [6, 7, -1, -1]; row 1: targets 9(prompt) 10 11 12
    assert values(out["labels"]) == [[6, 7, -1, -1], [-1, 10, 11, 12]]
    assert values(out["loss_mask"]) == [[1, 1, 0, 0], [0, 1, 1, 1]]
    assert out["num_valid_tokens"] == 5


# -- padding: left side, multiples, max_length, combination with packed padding ------------------------

def test_left_padding(array_dtype):
    b = batch_of(rec([10, 20, 30, 40, 50], positions=[0, 1, 2, 0, 1], loss_mask=[0, 0, 1, 1, 1]),
                 rec([60, 70, 80], positions=[0, 1, 2], loss_mask=[0, 1, 1], row=1))
    out = b.to_training(dtype=array_dtype, padding="longest", padding_side="left", pad_token_id=99,
                        return_labels=True, return_loss_mask=True, return_padding_mask=True, return_cu_seqlens=True)
    # row 1 = [99, 99, 60, 70, 80]; inputs drop the last slot, labels are row[1:]
    assert values(out["input_ids"]) == [[10, 20, 30, 40], [99, 99, 60, 70]]
    # 99 -> 99 and 99 -> 60 are predictions from padding: ignored; 60 -> 70 (mask 1) and 70 -> 80 kept
    assert values(out["labels"]) == [[-100, 30, 40, 50], [-100, -100, 70, 80]]
    assert values(out["attention_mask"]) == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert values(out["padding_mask"]) == [[False] * 4, [True, True, False, False]]
    assert values(out["positions"]) == [[0, 1, 2, 0], [0, 0, 0, 1]]  # padded slots 0
    # The left padding block is one segment, then the record's document.
    assert values(out["cu_seqlens"]) == [[0, 3, 4], [0, 2, 4]]
    seq = b.to_training(dtype=array_dtype, padding="longest", padding_side="left", pad_token_id=99,
                        position_mode="sequence")
    assert values(seq["positions"]) == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]


def test_left_padding_unshifted_labels():
    b = batch_of(rec([10, 20, 30]), rec([60, 70], row=1))
    out = b.to_training(dtype=None, padding="longest", padding_side="left", pad_token_id=PAD, return_labels=True,
                        shift_labels=False)
    assert out["input_ids"] == [[10, 20, 30], [0, 60, 70]]
    # label 60 at t=1 would be predicted from the pad at t=0: ignored
    assert out["labels"] == [[-100, 20, 30], [-100, -100, 70]]
    assert out["attention_mask"] == [[1, 1, 1], [0, 1, 1]]


def test_pad_to_multiple_of_rounds_the_shifted_length():
    b = batch_of(rec([1, 2, 3, 4, 5, 6]), rec([7, 8], row=1))
    out = b.to_training(dtype=np.int64, return_labels=True, padding="longest", pad_to_multiple_of=4, pad_token_id=PAD)
    assert out["input_ids"].shape == (2, 8)  # 6 tokens -> 5 inputs -> rounded to 8
    assert out["labels"][1].tolist() == [8] + [-100] * 7


def test_pad_to_multiple_of(array_dtype):
    b = CarriesPad((rec([1, 2, 3]), rec([4, 5, 6, 7, 8], row=1)), PAD)
    out = to_training(b, dtype=array_dtype, padding="longest", pad_to_multiple_of=4)
    assert tuple(out["input_ids"].shape) == (2, 8)
    assert values(out["attention_mask"]) == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    out = to_training(b, dtype=array_dtype, padding="max_length", max_length=6, pad_to_multiple_of=4)
    assert tuple(out["input_ids"].shape) == (2, 8)
    out = to_training(b, dtype=array_dtype, padding="max_length", max_length=6)
    assert values(out["input_ids"]) == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0]]
    # Already a multiple: unchanged.
    out = to_training(b, dtype=array_dtype, padding="longest", pad_to_multiple_of=5)
    assert tuple(out["input_ids"].shape) == (2, 5)


def test_padding_combines_with_packed_padding_length():
    # A packed row with a 2-token pad tail (meta.padding_length) next to a longer record.
    b = batch_of(rec([1, 11, 2, 0, 0], positions=[0, 1, 2, 0, 1], padding_length=2),
                 rec([1, 21, 22, 23, 2, 1, 31], positions=[0, 1, 2, 3, 4, 0, 1], row=1))
    out = b.to_training(dtype=None, padding="longest", pad_token_id=PAD, return_labels=True, return_loss_mask=True,
                        return_padding_mask=True, return_num_valid_tokens=True, return_cu_seqlens=True)
    assert out["input_ids"] == [[1, 11, 2, 0, 0, 0], [1, 21, 22, 23, 2, 1]]
    assert out["labels"] == [[11, 2, -100, -100, -100, -100], [21, 22, 23, 2, 1, 31]]
    assert out["padding_mask"] == [[False, False, False, True, True, True], [False] * 6]
    assert out["attention_mask"] == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert out["num_valid_tokens"] == 8
    # Row 0: document [0, 3), the packed pad tail [3, 5), the added padding [5, 6)
    assert out["cu_seqlens"] == [[0, 3, 5, 6], [0, 5, 6, 6]]
    assert out["max_seqlen"] == [3, 5]


def test_attention_mask_presence():
    equal = batch_of(rec([1, 2, 3]), rec([4, 5, 6], row=1))
    # Requested padding emits the mask even when this batch needed none: stable keys across batches.
    out = equal.to_training(dtype=None, padding="longest", pad_token_id=PAD)
    assert out["attention_mask"] == [[1, 1, 1], [1, 1, 1]]
    assert "attention_mask" not in equal.to_training(dtype=None)
    ragged = batch_of(rec([1, 2, 3]), rec([4, 5], row=1))
    assert "attention_mask" not in ragged.to_training(dtype=None, padding="longest", pad_token_id=PAD,
                                                      return_attention_mask=False)
    packed = batch_of(rec([1, 2, 0], padding_length=1))
    assert packed.to_training(dtype=None, return_attention_mask=True)["attention_mask"] == [[1, 1, 0]]


def test_all_padding_row(any_dtype):
    # A row that is padding only: every label ignored (one fewer slot after the shift), all padding.
    b = batch_of(rec([0, 0, 0, 0, 0], padding_length=5), rec([1, 2, 3, 4, 5], row=1))
    out = b.to_training(dtype=any_dtype, return_labels=True, return_padding_mask=True, return_loss_mask=True,
                        return_num_valid_tokens=True)
    assert values(out["labels"]) == [[-100] * 4, [2, 3, 4, 5]]
    assert values(out["padding_mask"]) == [[True] * 4, [False] * 4]
    assert values(out["loss_mask"]) == [[0.0] * 4, [1.0] * 4]
    assert out["num_valid_tokens"] == 4


def test_all_padding_row_combined_with_added_padding():
    b = batch_of(rec([0, 0], padding_length=2), rec([7, 8, 9, 10], row=1))
    out = b.to_training(dtype=None, padding="longest", pad_token_id=PAD, return_labels=True, return_padding_mask=True,
                        return_num_valid_tokens=True)
    assert out["labels"] == [[-100, -100, -100], [8, 9, 10]]
    assert out["padding_mask"] == [[True, True, True], [False, False, False]]
    assert out["num_valid_tokens"] == 3


def test_empty_and_single_token_rows():
    b = batch_of(rec([42]), rec([43], row=1))
    out = b.to_training(dtype=None, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
                        position_mode="sequence")
    assert out["input_ids"] == [[], []] and out["labels"] == [[], []] and out["positions"] == [[], []]
    assert out["num_valid_tokens"] == 0
    b = batch_of(rec([], positions=[]), rec([5, 6], positions=[0, 1], row=1))
    out = b.to_training(dtype=None, padding="longest", pad_token_id=PAD, return_cu_seqlens=True)
    assert out["input_ids"] == [[0, 0], [5, 6]]
    assert out["cu_seqlens"] == [[0, 2], [0, 2]]  # the empty record's row is one padding segment
    single = batch_of(rec([1], positions=[0])).to_training(dtype=None, return_labels=True, return_cu_seqlens=True)
    assert single["cu_seqlens"] == [[0]] and single["max_seqlen"] == [0]


# -- the pad id: explicit, else the batch's, else an error (never a silent 0) ----------------------------

RAGGED = (rec([5, 6, 7]), rec([8, 9], row=1))
GPT2_EOS = 50256


@pytest.mark.parametrize("padding", [True, "longest", "max_length"])
@pytest.mark.parametrize("make", [RecordsOnly, CarriesPad, batch_of], ids=["no-attribute", "stand-in", "SampleBatch"])
def test_padding_without_any_pad_id_raises(padding, make):
    b = make(*RAGGED) if make is batch_of else make(RAGGED)
    assert getattr(b, "pad_token_id", None) is None
    options = {"padding": padding, "max_length": 4} if padding == "max_length" else {"padding": padding}
    with pytest.raises(ValueError, match="requires pad_token_id") as caught:
        to_training(b, dtype=None, **options)
    message = str(caught.value)
    assert "id 0 is a real token" in message  # why there is no default
    assert "pass pad_token_id=" in message and "tokenize in the pipeline" in message  # the fixes
    # Not only when this batch happens to be ragged: equal lengths and empty batches fail the same way.
    equal = (rec([1, 2]), rec([3, 4], row=1))
    for other in ((batch_of(*equal), batch_of()) if make is batch_of else (make(equal), make(()))):
        with pytest.raises(ValueError, match="requires pad_token_id"):
            to_training(other, dtype=None, **options)
    with pytest.raises(ValueError, match="requires pad_token_id"):
        TrainingSpec(dtype=None, **options)(b)


@pytest.mark.parametrize("padding", [None, False, "do_not_pad"])
def test_no_pad_id_needed_without_padding(padding):
    equal = (rec([1, 2, 3]), rec([4, 5, 6], row=1))
    for b in (RecordsOnly(equal), CarriesPad(equal), batch_of(*equal)):
        out = to_training(b, dtype=None, return_labels=True, padding=padding)
        assert out["labels"] == [[2, 3], [5, 6]] and "attention_mask" not in out
    packed = RecordsOnly((rec([1, 2, 0], padding_length=1),))  # packing's own padding needs no id here
    assert to_training(packed, dtype=None, return_attention_mask=True)["attention_mask"] == [[1, 1, 0]]
    # Ragged records still need padding, and say so (not a pad id error).
    with pytest.raises(ValueError, match="different lengths.*padding='longest'"):
        to_training(RecordsOnly(RAGGED), dtype=None, padding=padding)


def check_batch_pad_id_is_used(b, pad_id):
    out = to_training(b, dtype=None, return_labels=True, shift_labels=False, padding="longest", padding_side="left")
    assert out["input_ids"] == [[5, 6, 7], [pad_id, 8, 9]]
    assert out["labels"] == [[-100, 6, 7], [-100, -100, 9]]
    assert type(out["input_ids"][1][0]) is int
    out = to_training(b, dtype=None, padding="longest", pad_token_id=PAD)  # the call overrides the batch
    assert out["input_ids"] == [[5, 6, 7], [8, 9, PAD]]
    assert TrainingSpec(dtype=None, padding="longest")(b)["input_ids"] == [[5, 6, 7], [8, 9, pad_id]]


def test_batch_pad_token_id_is_used_and_explicit_id_wins():
    # GPT-2 has no pad token, so the pipeline sets its EOS.
    check_batch_pad_id_is_used(CarriesPad(RAGGED, GPT2_EOS), GPT2_EOS)


def test_sample_batch_pad_token_id_is_used():
    b = sample_batch_carrying(RAGGED, np.int64(GPT2_EOS))
    check_batch_pad_id_is_used(b, GPT2_EOS)
    assert b.to_training(dtype=None, padding="longest")["input_ids"] == [[5, 6, 7], [8, 9, GPT2_EOS]]


@pytest.mark.parametrize("bad", [-1, 1.0, "0", True])
def test_invalid_batch_pad_token_id(bad):
    with pytest.raises(ValueError, match="the batch's pad_token_id must be a nonnegative integer"):
        to_training(CarriesPad(RAGGED, bad), padding="longest")
    # An explicit id replaces the batch's, and without padding no id is used: the batch's is not looked at.
    assert to_training(CarriesPad(RAGGED, bad), dtype=None, padding="longest", pad_token_id=3)["input_ids"] == [
        [5, 6, 7], [8, 9, 3]]
    assert to_training(CarriesPad(RAGGED[:1], bad), dtype=None)["input_ids"] == [[5, 6, 7]]


# -- token-aligned fields as plain lists (pre-tokenized JSON) ----------------------------------------------

def json_record(row, tokens, loss_mask, **fields) -> Record:
    return Record({"input_ids": list(tokens), "loss_mask": list(loss_mask), **fields},
                  Meta(0, (Segment(0, 0, row, 0, 0, -1),), 0))


@pytest.mark.parametrize("shift_labels", [True, False])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_list_loss_mask_in_dynamic_padding(shift_labels, padding_side):
    # Labels are -100 exactly where the target's mask is 0 and on padding, as with numpy payloads.
    lists = RecordsOnly((json_record(0, [10, 20, 30, 40, 50], [0, 0, 0, 1, 1]),
                         json_record(1, [60, 70, 80], [0, 1, 0])))
    options = dict(dtype=None, return_labels=True, shift_labels=shift_labels, padding="longest",
                   padding_side=padding_side, pad_token_id=GPT2_EOS, return_loss_mask=True)
    out = to_training(lists, **options)
    arrays = batch_of(rec([10, 20, 30, 40, 50], loss_mask=[0, 0, 0, 1, 1]),
                      rec([60, 70, 80], loss_mask=[0, 1, 0], row=1))
    assert out == to_training(arrays, **options)
    expected = {  # row 1 targets: 70 (mask 1) kept, 80 (mask 0) ignored, padding ignored
        (True, "right"): [[-100, -100, 40, 50], [70, -100, -100, -100]],
        (True, "left"): [[-100, -100, 40, 50], [-100, -100, 70, -100]],
        (False, "right"): [[-100, -100, -100, 40, 50], [-100, 70, -100, -100, -100]],
        (False, "left"): [[-100, -100, -100, 40, 50], [-100, -100, -100, 70, -100]],
    }[shift_labels, padding_side]
    assert out["labels"] == expected
    assert out["loss_mask"] == [[float(x != -100) for x in row] for row in expected]


def test_list_aligned_field_of_wrong_length_names_record_and_field():
    good = json_record(0, [1, 2, 3], [0, 1, 1], weight=[1, 1, 1], labels=[1, 2, 3])
    for bad, name, length, options in [
        (json_record(1, [4, 5], [1]), "loss_mask", 1, {"return_labels": True}),
        (json_record(1, [4, 5], [1, 1], weight=[1, 1, 1]), "weight", 3, {"extra_fields": ["weight"]}),
        (json_record(1, [4, 5], [1, 1], labels=[5]), "labels", 1, {"extra_fields": ("labels",)}),
    ]:
        with pytest.raises(ValueError, match=f"record 1: '{name}' length {length} does not match 'input_ids' length 2"):
            to_training(RecordsOnly((good, bad)), padding="longest", pad_token_id=PAD, **options)


def test_empty_list_fields_keep_integer_columns():
    b = RecordsOnly((json_record(0, [], [], weight=[]), json_record(1, [5, 6], [1, 1], weight=[3, 4])))
    out = to_training(b, dtype=None, padding="longest", pad_token_id=9, extra_fields=("weight",))
    assert out["input_ids"] == [[9, 9], [5, 6]]
    assert out["weight"] == [[0, 0], [3, 4]] and type(out["weight"][0][0]) is int
    assert out["loss_mask"] == [[0, 0], [1, 1]]


# -- labels: shifted vs unshifted, EOS masking --------------------------------------------------------

def test_unshifted_labels_match_internal_shift(array_dtype):
    b = worked_example()
    kw = dict(dtype=array_dtype, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
              eos_mask_loss=True, eos_token_id=EOS, return_padding_mask=True)
    shifted = b.to_training(**kw)
    hf = b.to_training(**kw, shift_labels=False)
    assert values(hf["input_ids"]) == values(b.to_training(dtype=array_dtype)["input_ids"])
    assert [row[1:] for row in values(hf["labels"])] == values(shifted["labels"])
    assert [row[0] for row in values(hf["labels"])] == [-100, -100]
    assert hf["num_valid_tokens"] == shifted["num_valid_tokens"] == 8
    assert values(hf["padding_mask"])[1] == [False, False, False, True, True, True, True, True]
    assert tuple(hf["loss_mask"].shape) == tuple(hf["input_ids"].shape)


def test_eos_mask_with_shared_bos_eos_id():
    # ID 0 is both BOS and EOS: the first content token after each BOS is masked too.
    b = batch_of(Record({"tokens": np.array([0, 11, 0, 0, 22, 0])}, Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0)))
    out = b.to_training(dtype=None, return_labels=True, eos_mask_loss=True, eos_token_id=np.int64(0))
    assert out["input_ids"] == [[0, 11, 0, 0, 22]]
    assert out["labels"] == [[-100, 0, -100, -100, 0]]


def test_loss_mask_is_target_aligned():
    # mask[i] gates token i as a target, i.e. label slot i - 1.
    out = batch_of(rec([1, 2, 3, 4], loss_mask=[0, 1, 0, 1])).to_training(dtype=None, return_labels=True)
    assert out["labels"] == [[2, -100, 4]]
    assert "loss_mask" not in out  # consumed by the labels


def test_loss_mask_cannot_resurrect_padding():
    out = batch_of(rec([1, 2, 3, 0], loss_mask=[1, 1, 1, 1], padding_length=1)).to_training(
        dtype=None, return_labels=True)
    assert out["labels"] == [[2, 3, -100]]


def test_raw_loss_mask_without_labels(any_dtype):
    out = batch_of(rec([1, 2, 3], loss_mask=[0, 1, 1])).to_training(dtype=any_dtype)
    assert values(out["loss_mask"]) == [[0, 1, 1]]
    assert list(out) == ["ids", "texts", "input_ids", "loss_mask"]


def test_pad_id_colliding_with_content_masks_by_position():
    out = batch_of(rec([10, 0, 12, 0, 0], padding_length=2)).to_training(dtype=None, return_labels=True)
    assert out["labels"] == [[0, 12, -100, -100]]


def test_loss_mask_counts_labels_equal_to_ignore_index_as_ignored():
    # Zephon defines loss_mask and num_valid_tokens as labels != ignore_index after masking.
    out = batch_of(rec([10, 11, -7, 13])).to_training(dtype=None, return_labels=True, ignore_index=-7,
                                                       return_loss_mask=True, return_num_valid_tokens=True)
    assert out["labels"] == [[11, -7, 13]]
    assert out["loss_mask"] == [[1.0, 0.0, 1.0]] and out["num_valid_tokens"] == 2


# -- flatten, rename, exclude, extra fields ------------------------------------------------------------

def test_flatten(any_dtype):
    b = batch_of(rec([1, 2, 3], loss_mask=[0, 1, 1], text="x", weight=[7, 8, 9]),
                 rec([4, 5], loss_mask=[0, 1], row=1, weight=[5, 6]))
    out = b.to_training(dtype=any_dtype, return_labels=True, flatten=True, padding="longest", pad_token_id=PAD,
                        return_loss_mask=True, return_padding_mask=True, extra_fields=("weight",))
    assert values(out["input_ids"]) == [1, 2, 4, 5]
    assert values(out["labels"]) == [2, 3, 5, -100]
    assert values(out["attention_mask"]) == [1, 1, 1, 1]
    assert values(out["padding_mask"]) == [False, False, False, False]
    assert values(out["weight"]) == [7, 8, 5, 6]
    assert values(out["loss_mask"]) == [1.0, 1.0, 1.0, 0.0]
    assert out["ids"] == [[(0, 0, 0)], [(0, 0, 1)]] and out["texts"] == ["x", ""]
    assert is_framework(out["input_ids"], any_dtype)


def test_flatten_padding_mask_without_labels():
    b = batch_of(rec([1, 0, 0], padding_length=2), rec([2, 3, 4], row=1))
    assert b.to_training(dtype=None, return_padding_mask=True, flatten=True)["padding_mask"] == [
        False, True, True, False, False, False]


def test_extra_fields_are_sliced_and_padded(array_dtype):
    b = batch_of(rec([1, 2, 3], segment=[5, 5, 6]), rec([4, 5], row=1, segment=[7, 7]))
    out = b.to_training(dtype=array_dtype, extra_fields=("segment", "positions"), padding="longest", pad_token_id=PAD,
                        position_mode="sequence", return_labels=True)
    assert values(out["segment"]) == [[5, 5], [7, 7]]
    assert list(out) == ["ids", "texts", "input_ids", "labels", "attention_mask", "segment", "positions"]
    assert dtype_name(out["segment"]) == "int64"


def test_extra_labels_allowed_without_generated_labels():
    b = batch_of(rec([1, 2, 3], labels=[4, 5, 6]))
    assert b.to_training(dtype=None, extra_fields=("labels",))["labels"] == [[4, 5, 6]]


def test_rename_swap_and_exclude_absent():
    b = batch_of(rec([1, 2]))
    out = b.to_training(dtype=None, rename_fields={"ids": "texts", "texts": "ids"}, exclude_fields=("absent",))
    assert out["texts"] == [[(0, 0, 0)]] and out["ids"] == [""]
    out = b.to_training(dtype=None, return_labels=True, return_num_valid_tokens=True,
                        rename_fields={"input_ids": "input", "num_valid_tokens": "count"},
                        exclude_fields=("ids", "texts", "labels", "input"))
    assert out == {"count": 1}


# -- empty batch ---------------------------------------------------------------------------------------

def test_empty_batch():
    empty = SampleBatch(())
    assert empty.to_training() == {"ids": [], "texts": []}
    assert empty.to_training(return_labels=True) == {"ids": [], "texts": []}
    out = empty.to_training(return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
                            return_padding_mask=True, return_cu_seqlens=True, position_mode="sequence")
    assert list(out.items()) == [
        ("ids", []), ("texts", []), ("padding_mask", []), ("positions", []), ("loss_mask", []),
        ("num_valid_tokens", 0), ("cu_seqlens", []), ("max_seqlen", []),
    ]
    out = empty.to_training(return_cu_seqlens=True, flatten=True, exclude_fields=("ids", "texts"))
    assert out == {"cu_seqlens": [0], "max_seqlen": 0}
    assert empty.to_training(padding="longest", pad_token_id=PAD) == {"ids": [], "texts": [], "attention_mask": []}
    # Missing rename sources are fine in an empty batch; collisions are not.
    assert empty.to_training(rename_fields={"input_ids": "input"}) == {"ids": [], "texts": []}
    with pytest.raises(ValueError, match="collide"):
        empty.to_training(rename_fields={"ids": "texts"})


# -- dtypes and frameworks -----------------------------------------------------------------------------

def test_dtype_auto_is_torch_long():
    torch = torch_module()
    out = worked_example().to_training(return_labels=True, return_loss_mask=True)
    assert isinstance(out["input_ids"], torch.Tensor) and out["input_ids"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.float32


def test_dtype_none_gives_python_lists():
    out = worked_example().to_training(dtype=None, return_labels=True, return_loss_mask=True,
                                       return_padding_mask=True, return_cu_seqlens=True)
    assert type(out["labels"][0][0]) is int
    assert type(out["loss_mask"][0][0]) is float
    assert type(out["padding_mask"][0][0]) is bool
    assert type(out["cu_seqlens"][0][0]) is int and type(out["max_seqlen"][0]) is int


@pytest.mark.parametrize(("dtype", "name"), [(np.int32, "int32"), ("torch_int32", "int32"), (np.uint16, "uint16")])
def test_narrower_dtypes(dtype, name):
    dtype = torch_module().int32 if dtype == "torch_int32" else dtype
    out = worked_example().to_training(dtype=dtype, position_mode="sequence", padding="longest", pad_token_id=PAD)
    assert dtype_name(out["input_ids"]) == dtype_name(out["positions"]) == dtype_name(out["attention_mask"]) == name


def test_dtype_too_narrow_for_values_names_field():
    with pytest.raises(ValueError, match="'labels'.*uint16"):
        worked_example().to_training(dtype=np.uint16, return_labels=True)  # -100 does not fit
    with pytest.raises(ValueError, match="'input_ids'.*int16"):
        batch_of(rec([50256])).to_training(dtype=np.int16)


@pytest.mark.parametrize("payload", ["numpy", "torch"])
def test_array_payloads(any_dtype, payload):
    make = np.array if payload == "numpy" else torch_module().tensor
    b = batch_of(Record(make([1, 2, 3]), Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0)),
                 Record(make([4, 5]), Meta(0, (Segment(0, 0, 1, 0, 0, -1),), 0)))
    out = b.to_training(dtype=any_dtype, tokens_field="ignored", return_labels=True, padding="longest",
                        pad_token_id=PAD)
    assert values(out["input_ids"]) == [[1, 2], [4, 5]]
    assert values(out["labels"]) == [[2, 3], [5, -100]]
    assert out["texts"] == ["", ""]


def test_token_field_auto_detection_and_explicit():
    payload = {"encoded": np.array([1, 7, 2]), "tokens": np.array([5, 6, 7]), "ids": np.array([9, 9, 9])}
    b = batch_of(Record(payload, Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0)))
    assert b.to_training(dtype=None)["input_ids"] == [[5, 6, 7]]  # tokens before ids
    assert b.to_training(dtype=None, tokens_field="encoded")["input_ids"] == [[1, 7, 2]]


def test_outputs_do_not_alias_payloads(array_dtype):
    b = worked_example()
    before = {k: v.copy() for k, v in b.records[0].payload.items()}
    out = b.to_training(dtype=array_dtype, position_mode="sequence")
    out["input_ids"][0, 0] = 99
    out["positions"][0, 0] = 7
    assert values(out["positions"])[1][0] == 0  # rows are independent, not a broadcast view
    assert all(np.array_equal(before[k], b.records[0].payload[k]) for k in before)
    if array_dtype is not np.int64:
        assert out["positions"].view(-1).shape == (16,)  # contiguous


def test_module_imports_and_runs_without_torch():
    # torch made unimportable: an eager import anywhere on the numpy paths fails here, and
    # dtype="auto" must fall back to numpy int64.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from zephon.training.convert import TrainingSpec, to_training\n"
        "from zephon.types import Meta, Record, SampleBatch, Segment\n"
        "def rec(row, tokens):\n"
        "    return Record({'input_ids': np.array(tokens)}, Meta(0, (Segment(0, 0, row, 0, 0, -1),), 0))\n"
        "b = SampleBatch((rec(0, [1, 2, 3]), rec(1, [4, 5])))\n"
        "for dtype in ('auto', np.int64):\n"
        "    out = to_training(b, dtype=dtype, return_labels=True, padding='longest', pad_token_id=0)\n"
        "    assert isinstance(out['labels'], np.ndarray) and out['labels'].dtype == np.int64, out\n"
        "    assert out['labels'].tolist() == [[2, 3], [5, -100]], out\n"
        "assert to_training(b, dtype=None, padding=True, pad_token_id=0)['input_ids'] == [[1, 2, 3], [4, 5, 0]]\n"
        "assert TrainingSpec(return_labels=True)(SampleBatch((rec(0, [7, 8]),)))['labels'].dtype == np.int64\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(NO_TORCH, reason="this is the run without torch")
def test_numpy_paths_run_without_torch():
    # This whole file again, with torch unimportable: the numpy and list tests must pass (none may
    # touch torch) and only the tensor tests may skip, each for want of torch.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pytest\n"
        f"sys.exit(pytest.main([{__file__!r}, '-rs', '-p', 'no:cacheprovider']))\n"
    )
    env = {**os.environ, "ZEPHON_TEST_NO_TORCH": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1], env=env)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    summary = done.stdout.strip().splitlines()[-1]
    passed, skipped = re.search(r"(\d+) passed", summary), re.search(r"(\d+) skipped", summary)
    assert passed and int(passed.group(1)) >= 100, summary
    assert skipped and int(skipped.group(1)) >= 20, summary  # the torch parameters: skipped, not run
    reasons = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    unexpected = [line for line in reasons if "torch" not in line and "does not carry pad_token_id" not in line]
    assert reasons and not unexpected, unexpected


# -- TrainingSpec: options validated once, applied to many batches -----------------------------------------

def test_spec_applies_like_to_training():
    options = dict(return_labels=True, return_loss_mask=True, return_cu_seqlens=True, padding="longest",
                   pad_to_multiple_of=4, pad_token_id=PAD, dtype=np.int64, rename_fields={"input_ids": "tokens"})
    spec = TrainingSpec(**options)
    batches = [worked_example(), batch_of(rec([1, 2, 3], positions=[0, 1, 0]), rec([4], positions=[0], row=1))]
    for b in batches:
        got, want = spec(b), to_training(b, **options)
        assert list(got) == list(want)
        assert all(values(got[k]) == values(want[k]) for k in got)
    assert spec(batches[0])["tokens"].shape == (2, 8)


def test_spec_normalises_options_in_converters():
    spec = TrainingSpec(return_labels=1, padding=True, pad_token_id=np.int64(7), extra_fields=["w", "v", "w"],
                        exclude_fields=["ids"], rename_fields={"input_ids": "tokens"}, ignore_index=np.int32(-1))
    assert spec.return_labels is True and spec.padding == "longest"
    assert spec.pad_token_id == 7 and type(spec.pad_token_id) is int and type(spec.ignore_index) is int
    assert spec.extra_fields == ("w", "v") and spec.exclude_fields == ("ids",)
    assert dict(spec.rename_fields) == {"input_ids": "tokens"} and spec.emit_attention
    assert TrainingSpec(padding=False).padding is None and TrainingSpec(padding="do_not_pad").padding is None
    assert dict(TrainingSpec().rename_fields) == {} and TrainingSpec().emit_attention is False


def test_spec_is_a_frozen_value():
    renames = {"input_ids": "tokens"}
    spec = TrainingSpec(return_labels=True, padding="longest", pad_token_id=PAD, rename_fields=renames, dtype=None)
    renames["labels"] = "y"  # the spec holds its own read-only copy
    assert dict(spec.rename_fields) == {"input_ids": "tokens"}
    with pytest.raises(TypeError):
        spec.rename_fields["labels"] = "y"  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.padding = None  # type: ignore[misc]
    # evolve gives what the constructor gives, re-validated.
    evolved = attrs.evolve(spec, padding="max_length", max_length=8)
    assert evolved == TrainingSpec(return_labels=True, padding="max_length", max_length=8, pad_token_id=PAD,
                                   rename_fields={"input_ids": "tokens"}, dtype=None)
    with pytest.raises(ValueError, match="requires max_length"):
        attrs.evolve(spec, padding="max_length")
    assert attrs.evolve(spec) == spec and hash(attrs.evolve(spec)) == hash(spec)
    # It pickles (worker processes under spawn) and converts the same after the round trip.
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and copy(worked_example()) == spec(worked_example())
    assert "padding='longest'" in repr(spec) and "'input_ids': 'tokens'" in repr(spec)


# -- errors teach: what, where, and the fix -------------------------------------------------------------

@pytest.mark.parametrize(("field", "labels"), [("input_ids", False), ("input_ids", True), ("labels", True),
                                               ("ids", False), ("texts", False)])
def test_extra_field_cannot_overwrite_generated(field, labels):
    b = batch_of(Record({"encoded": np.array([1, 7, 2, 1]), field: np.array([9] * 4)},
                        Meta(0, (Segment(0, 0, 0, 0, 0, -1),), 0)))
    with pytest.raises(ValueError, match=f"cannot overwrite generated field '{field}'"):
        b.to_training(dtype=None, tokens_field="encoded", return_labels=labels, extra_fields=(field,))


@pytest.mark.parametrize(("field", "flag"), [
    ("padding_mask", {"return_padding_mask": True}),
    ("cu_seqlens", {"return_cu_seqlens": True}),
    ("max_seqlen", {"return_cu_seqlens": True}),
    ("num_valid_tokens", {"return_num_valid_tokens": True, "return_labels": True}),
    ("attention_mask", {"padding": "longest"}),
    ("attention_mask", {"return_attention_mask": True}),
])
def test_extra_field_collides_with_requested_output(field, flag):
    with pytest.raises(ValueError, match=f"extra_fields cannot include '{field}'"):
        SampleBatch(()).to_training(extra_fields=(field,), **flag)  # checked before the empty shortcut


def test_extra_loss_mask_with_labels():
    with pytest.raises(ValueError, match="'loss_mask'.*input-aligned, not label-aligned"):
        batch_of(rec([1, 2], loss_mask=[0, 1])).to_training(return_labels=True, extra_fields=("loss_mask",))


@pytest.mark.parametrize(("options", "message"), [
    ({"return_loss_mask": True}, "return_loss_mask requires return_labels=True"),
    ({"return_num_valid_tokens": True}, "return_num_valid_tokens requires return_labels=True"),
    ({"eos_mask_loss": True, "eos_token_id": 2}, "eos_mask_loss requires return_labels=True"),
    ({"return_labels": True, "eos_mask_loss": True}, "requires an explicit eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id must be a nonnegative integer"),
    ({"eos_token_id": 1.5}, "eos_token_id must be a nonnegative integer"),
    ({"eos_token_id": "2"}, "eos_token_id must be a nonnegative integer"),
    ({"eos_token_id": True}, "eos_token_id must be a nonnegative integer"),
    ({"position_mode": "document"}, "position_mode must be 'preserve' or 'sequence'"),
    ({"shift_labels": False}, "shift_labels=False only applies to labels"),
    ({"padding": "bucket"}, "padding must be"),
    ({"padding": "max_length"}, "padding='max_length' requires max_length"),
    ({"padding": "longest", "max_length": 8}, "max_length is only used with padding='max_length'"),
    ({"pad_to_multiple_of": 8}, "pad_to_multiple_of needs padding"),
    ({"padding": "longest", "pad_to_multiple_of": 0}, "pad_to_multiple_of must be a positive integer"),
    ({"padding_side": "middle"}, "padding_side must be 'right' or 'left'"),
    ({"padding": "longest", "pad_token_id": -1}, "pad_token_id must be a nonnegative integer"),
    ({"return_attention_mask": "yes"}, "return_attention_mask must be"),
    ({"ignore_index": None}, "ignore_index must be an integer"),
    ({"dtype": object()}, "dtype must be 'auto', None, a numpy dtype or a torch dtype"),
    ({"rename_fields": {"labels": "targets"}}, "source keys not in output: \\['labels'\\]"),
    ({"rename_fields": {"input_ids": "texts"}}, "target keys collide: \\['texts'\\]"),
])
def test_invalid_options(options, message):
    b = batch_of(rec([1, 2, 3]))
    with pytest.raises(ValueError, match=message):
        b.to_training(**options)
    if "rename_fields" not in options:  # renames are checked against the emitted keys, per batch
        with pytest.raises(ValueError, match=message):
            TrainingSpec(**options)  # options alone fail where the spec is built, before any batch


@pytest.mark.parametrize(("option", "suggestion"), [
    ("retrun_labels", "did you mean 'return_labels'"),
    ("pad_token", "did you mean 'pad_token_id'"),
    ("pad_id", "did you mean 'pad_token_id'"),  # spelling alone would suggest padding_side
    ("zzz", "the options are tokens_field, return_labels"),
])
def test_unknown_option(option, suggestion):
    with pytest.raises(TypeError, match=f"unknown option '{option}'; {suggestion}"):
        to_training(SampleBatch(()), **{option: True})
    with pytest.raises(TypeError, match=option):
        TrainingSpec(**{option: True})


@pytest.mark.parametrize("options", [{"exclude_fields": "ids"}, {"extra_fields": "positions"},
                                     {"rename_fields": [("input_ids", "x")]}])
def test_bare_strings_and_non_mappings_rejected(options):
    with pytest.raises(TypeError, match="not a string|must be a mapping"):
        SampleBatch(()).to_training(**options)


def test_eos_token_id_without_masking_warns_at_the_call_site():
    b = worked_example()
    with pytest.warns(UserWarning, match="eos_token_id is ignored") as caught:
        b.to_training(dtype=None, return_labels=True, eos_token_id=2)
    assert len(caught) == 1 and caught[0].filename == __file__
    with pytest.warns(UserWarning, match="eos_token_id is ignored") as caught:
        to_training(b, dtype=None, return_labels=True, eos_token_id=2)
    assert caught[0].filename == __file__
    # A spec warns once, where it is built (or evolved), not on every batch.
    with pytest.warns(UserWarning, match="eos_token_id is ignored") as caught:
        spec = TrainingSpec(dtype=None, return_labels=True, eos_token_id=2)
    assert len(caught) == 1 and caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec(b)
    with pytest.warns(UserWarning, match="eos_token_id is ignored") as caught:
        attrs.evolve(spec, return_labels=False)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.to_training(dtype=None, return_labels=True, eos_mask_loss=True, eos_token_id=2)


def test_ragged_without_padding_says_pass_padding_longest():
    b = batch_of(rec([1, 2, 3]), rec([4, 5], row=1))
    with pytest.raises(ValueError, match="record 1: 2 tokens.*padding='longest'"):
        b.to_training(dtype=np.int64)
    with pytest.raises(ValueError, match="padding='longest'"):
        b.to_training(dtype=None, padding=False)


def test_record_longer_than_max_length():
    b = batch_of(rec([1, 2, 3]), rec([4, 5, 6, 7, 8], row=1))
    with pytest.raises(ValueError, match="record 1 has 5 tokens, more than max_length=4.*never truncates"):
        b.to_training(padding="max_length", max_length=4, pad_token_id=PAD)


def test_cu_seqlens_needs_positions():
    with pytest.raises(ValueError, match="'positions'.*pack_flat\\(emit_positions=True\\)"):
        batch_of(rec([1, 2, 3])).to_training(return_cu_seqlens=True)
    with pytest.raises(ValueError, match="'positions'.*pack_flat\\(emit_positions=True\\)"):
        batch_of(rec([1, 2, 3])).to_training(return_cu_seqlens=True, position_mode="sequence")
    b = batch_of(rec([1, 2], positions=[0, 1]), rec([3, 4], positions=[1, 2], row=1))
    with pytest.raises(ValueError, match="record 1: positions must start at zero"):
        b.to_training(return_cu_seqlens=True)


def test_misaligned_fields_name_record_and_field():
    with pytest.raises(ValueError, match="record 1: 'positions' length 1 does not match 'input_ids' length 2"):
        batch_of(rec([1, 2], positions=[0, 1]), rec([3, 4], positions=[0], row=1)).to_training()
    with pytest.raises(ValueError, match="record 0: 'loss_mask' length 2 does not match 'input_ids' length 3"):
        batch_of(rec([1, 2, 3], loss_mask=[1, 1])).to_training(return_labels=True)
    with pytest.raises(ValueError, match="record 0: 'weight' length 1 does not match"):
        batch_of(rec([1, 2], weight=[1])).to_training(extra_fields=("weight",))


def test_partially_present_fields():
    with pytest.raises(ValueError, match="'loss_mask' present in some payloads but missing in record 1"):
        batch_of(rec([1, 2], loss_mask=[0, 1]), rec([3, 4], row=1)).to_training(return_labels=True)
    with pytest.raises(ValueError, match="'positions' present in some payloads but missing in record 0"):
        batch_of(rec([1, 2]), rec([3, 4], positions=[0, 1], row=1)).to_training()
    with pytest.raises(ValueError, match="record 1: extra field 'weight' not found"):
        batch_of(rec([1, 2], weight=[1, 1]), rec([3, 4], row=1)).to_training(extra_fields=("weight",))


def test_token_field_errors():
    with pytest.raises(ValueError, match="cannot auto-detect the token field.*tokens_field="):
        batch_of(Record({"text": "hi"}, Meta(0, (), 0))).to_training()
    with pytest.raises(ValueError, match="pack_sequences envelope.*use pack_flat"):
        batch_of(Record({"packed_samples": [{"input_ids": [1]}]}, Meta(0, (), 0))).to_training()
    b = batch_of(Record({"encoded": [1, 2]}, Meta(0, (), 0)), Record({"input_ids": [1, 2]}, Meta(0, (), 0)))
    with pytest.raises(ValueError, match="record 1: token field 'encoded' not found"):
        b.to_training(tokens_field="encoded")
    with pytest.raises(ValueError, match="record 0: token field 'input_ids' holds float64"):
        batch_of(Record({"input_ids": [1.5, 2.0]}, Meta(0, (), 0))).to_training()
    with pytest.raises(ValueError, match="record 0: token field 'input_ids' must be 1-D"):
        batch_of(Record({"input_ids": [[1, 2], [3, 4]]}, Meta(0, (), 0))).to_training()


def test_payload_type_errors():
    arr = Record(np.array([1, 2]), Meta(0, (), 0))
    dct = Record({"input_ids": np.array([1, 2])}, Meta(0, (), 0))
    with pytest.raises(TypeError, match="record 0 is a dict but record 1 is ndarray"):
        batch_of(dct, arr).to_training()
    with pytest.raises(TypeError, match="record 0 is an array but record 1 is dict"):
        batch_of(arr, dct).to_training()
    with pytest.raises(TypeError, match="expects dict or array-like"):
        batch_of(Record("text", Meta(0, (), 0))).to_training()
    with pytest.raises(ValueError, match="extra_fields \\['w'\\] need dict payloads"):
        batch_of(arr).to_training(extra_fields=("w",))


@pytest.mark.parametrize("padding_length", [-1, 4])
def test_padding_length_outside_row(padding_length):
    with pytest.raises(ValueError, match="record 0 has meta.padding_length=.*but only 3 tokens"):
        batch_of(rec([1, 2, 3], padding_length=padding_length)).to_training(return_padding_mask=True)


# -- property: labels, loss_mask and num_valid_tokens agree with the definitions ------------------------

IGNORE = -100


@st.composite
def ragged_batches(draw):
    count = draw(st.integers(1, 5))
    as_lists = draw(st.booleans())  # pre-tokenized JSON gives lists, tokenizers numpy arrays
    records, specs = [], []
    for i in range(count):
        n = draw(st.integers(0, 12))
        tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        pad = draw(st.integers(0, n))
        if as_lists:
            meta = Meta(0, (Segment(0, 0, i, 0, 0, -1),), pad)
            records.append(Record({"input_ids": list(tokens), "loss_mask": list(mask)}, meta))
        else:
            records.append(rec(tokens, loss_mask=mask, padding_length=pad, row=i))
        specs.append((tokens, mask, pad))
    options = dict(
        padding_side=draw(st.sampled_from(["right", "left"])),
        shift_labels=draw(st.booleans()),
        pad_to_multiple_of=draw(st.sampled_from([None, 1, 4])),
        eos=draw(st.sampled_from([None, 2])),
        pad_id=draw(st.sampled_from([0, 2, 63])),
    )
    return SampleBatch(tuple(records)), specs, options


def reference_labels(specs, *, padding_side, shift_labels, pad_to_multiple_of, eos, pad_id):
    """Labels written from the definitions, one slot at a time."""
    T = max(len(t) for t, _, _ in specs)
    if pad_to_multiple_of:  # the length the model sees is rounded: T - 1 when labels are shifted
        shift = 1 if shift_labels else 0
        T = -(-(T - shift) // pad_to_multiple_of) * pad_to_multiple_of + shift
    rows = []
    for tokens, mask, padding_length in specs:
        extra = T - len(tokens)
        lead = extra if padding_side == "left" else 0
        tok = [pad_id] * lead + list(tokens) + [pad_id] * (T - lead - len(tokens))
        m = [0] * lead + list(mask) + [0] * (T - lead - len(tokens))
        real = [lead <= t < lead + len(tokens) - padding_length for t in range(T)]
        shifted = []
        for t in range(T - 1):
            keep = real[t] and real[t + 1] and m[t + 1] == 1 and not (eos is not None and tok[t] == eos)
            shifted.append(tok[t + 1] if keep else IGNORE)
        unshifted = ([IGNORE] + shifted) if T else []
        rows.append((tok, shifted if shift_labels else unshifted))
    return rows


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches())
def test_labels_property(case):
    b, specs, opt = case
    out = b.to_training(
        dtype=np.int64, return_labels=True, return_loss_mask=True, return_num_valid_tokens=True,
        return_padding_mask=True, padding="longest", padding_side=opt["padding_side"],
        shift_labels=opt["shift_labels"], pad_to_multiple_of=opt["pad_to_multiple_of"],
        eos_mask_loss=opt["eos"] is not None, eos_token_id=opt["eos"], pad_token_id=opt["pad_id"],
    )
    labels, inputs, loss_mask = out["labels"], out["input_ids"], out["loss_mask"]
    expected = reference_labels(specs, **opt)
    assert labels.tolist() == [row for _, row in expected]
    assert out["num_valid_tokens"] == int((labels != IGNORE).sum())
    assert np.array_equal(loss_mask, (labels != IGNORE).astype(np.float32))
    assert labels.shape == loss_mask.shape
    for (tok, _), lab, inp in zip(expected, labels, inputs):
        kept = np.flatnonzero(lab != IGNORE)
        if opt["shift_labels"]:
            # labels are the input tokens shifted by one wherever not ignored
            assert all(lab[t] == tok[t + 1] for t in kept)
            assert inp.tolist() == tok[:-1]
        else:
            assert all(lab[t] == inp[t] for t in kept)
            assert inp.tolist() == tok
    # no label is ever predicted from, or is, padding
    assert not (labels != IGNORE)[out["padding_mask"]].any()




# -- the packed-rows shortcut ------------------------------------------------------------------------------
# Full packed rows of ids (and positions) with shifted labels are written straight into the output
# arrays; every batch and option set must give exactly what the general path gives.


def _general(spec: TrainingSpec, batch: SampleBatch, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        m.setattr(TrainingSpec, "_packed", lambda self, records: None)
        return spec(batch)


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        if hasattr(x, "numpy"):
            assert x.dtype == y.dtype and x.shape == y.shape and bool((x == y).all()), k
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.flags.c_contiguous and y.flags.c_contiguous and np.array_equal(x, y), k
        else:
            assert x == y, k


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 4), length=st.integers(1, 9), positions=st.booleans(), dtype=st.sampled_from(["int32", "uint16", "int64"]),
    padding=st.integers(0, 2), extra=st.sampled_from([None, "text", "loss_mask"]), segments=st.integers(1, 3), data=st.data(),
)
def test_full_packed_rows_convert_exactly_as_the_general_path(monkeypatch, rows, length, positions, dtype, padding, extra, segments, data):
    records = []
    for r in range(rows):
        ids = np.arange(7 * r, 7 * r + length).astype(dtype)
        payload = {"input_ids": ids}
        if positions:
            payload["positions"] = np.arange(length, dtype=np.int32) % 3
        if extra == "text":
            payload["text"] = f"row {r}"
        elif extra == "loss_mask":
            payload["loss_mask"] = (np.arange(length) % 2).astype(np.int8)
        segs = tuple(Segment(0, 0, r * 10 + s, 0, s, s + 1) for s in range(segments))
        records.append(Record(payload, Meta(0, segs, padding if r == rows - 1 else 0)))
    batch = SampleBatch(tuple(records))
    options = data.draw(st.sampled_from([
        {"return_labels": True, "dtype": np.int64},
        {"return_labels": True, "dtype": np.int64, "rename_fields": {"input_ids": "tokens"}, "exclude_fields": ("texts",)},
        {"return_labels": True, "dtype": np.int32},
        {"return_labels": True, "dtype": None},
        {"return_labels": True, "dtype": np.int64, "return_padding_mask": True},
        {"return_labels": False, "dtype": np.int64},
    ]))
    spec = TrainingSpec(**options)
    try:
        expected = _general(spec, batch, monkeypatch)
    except ValueError as exc:
        with pytest.raises(ValueError, match=re.escape(str(exc))):
            spec(batch)
        return
    _same(spec(batch), expected)


def test_the_packed_rows_shortcut_gives_torch_long_tensors_like_the_general_path(monkeypatch):
    torch = torch_module()
    records = [Record({"input_ids": np.arange(i, i + 9, dtype=np.int32), "positions": np.arange(9, dtype=np.int32)},
                      Meta(0, (Segment(0, 0, i, 0, 0, 9),), 0)) for i in range(3)]
    batch = SampleBatch(tuple(records))
    spec = TrainingSpec(return_labels=True, dtype=torch.long)
    assert spec._packed(records) is not None
    _same(spec(batch), _general(spec, batch, monkeypatch))
