"""Training tensors from a microbatch: :func:`to_training`, a pure function of the batch and its
options (``TrainingSpec(**options)(batch)``); it takes any object with ``records``, so
``SampleBatch.to_training`` can delegate here from the layer below.
"""

from __future__ import annotations

import difflib
from typing import Any

import attrs

from .spec import TrainingSpec

__all__ = ["LAYOUTS", "TrainingSpec", "to_training", "training_spec"]

_OPTIONS = tuple(a.alias for a in attrs.fields(TrainingSpec) if a.init)
#: Names other libraries use, which spelling distance alone would map to the wrong option.
_ALIASES = {"pad_id": "pad_token_id", "eos_id": "eos_token_id", "return_tensors": "dtype", "labels": "return_labels"}

#: Field layouts of training frameworks: ``to_training(batch, layout=name, **options)`` starts from
#: these options, and options given next to ``layout`` override them.
LAYOUTS: dict[str, dict[str, Any]] = {
    # Megatron-LM GPT batches: float32 loss_mask, position_ids 0, 1, 2, ... over the row
    # (reset_position_ids=False), cu_seqlens/max_seqlen for its PackedSeqParams.
    "megatron": dict(
        return_labels=True, return_loss_mask=True, return_cu_seqlens=True, position_mode="sequence",
        rename_fields={"input_ids": "tokens", "positions": "position_ids"}, exclude_fields=("ids", "texts"),
    ),
    # Hugging Face causal LMs: unshifted labels, only the keys forward() takes; position_ids that
    # restart at every document give a per-document causal mask (find_packed_sequence_indices).
    "hf": dict(
        return_labels=True, shift_labels=False, rename_fields={"positions": "position_ids"},
        exclude_fields=("ids", "texts", "segments"),
    ),
}


def training_spec(layout: str | None = None, **options: Any) -> TrainingSpec:
    """The :class:`TrainingSpec` of ``to_training``'s options, starting from a ``layout`` preset.

    Unknown option names fail with the closest known one; ``layout`` must be a key of
    :data:`LAYOUTS` (or ``None``), and options given next to it override the preset's.

    Examples:
        >>> spec = training_spec(layout="megatron", return_cu_seqlens=False)
        >>> spec.return_loss_mask, dict(spec.rename_fields)["input_ids"], spec.return_cu_seqlens
        (True, 'tokens', False)
    """
    unknown = [name for name in options if name not in _OPTIONS]
    if unknown:
        name = unknown[0]
        close = [_ALIASES[name]] if name in _ALIASES else difflib.get_close_matches(name, _OPTIONS + ("layout",), n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"the options are {', '.join(_OPTIONS)}, layout"
        raise TypeError(f"to_training: unknown option {name!r}; {fix}")
    if layout is not None:
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(f"to_training: unknown layout {layout!r}; the layouts are {sorted(LAYOUTS)} (or None)")
        options = {**LAYOUTS[layout], **options}
    return TrainingSpec(**options)


def to_training(batch: Any, **options: Any) -> dict[str, Any]:
    """Convert a microbatch into the fields a training step consumes.

    Every option is in the table of ``docs/guide/training_tensors.md``; ``layout`` starts from a
    preset of :data:`LAYOUTS` (``"megatron"``, ``"hf"``) that options given next to it override;
    the guide also says which labels are ``ignore_index`` and how padding is filled and masked.

    **Segments.** Fields that are not token-aligned are never dropped: ``segments`` holds, per
    record, one ``{"start", "length", **fields}`` dict per segment (``start`` before the label
    shift), with values copied; a field named ``start``/``length`` or one that does not pickle is
    refused.

    The guide lists the output keys in order, and an empty batch's output. The output depends only
    on the batch and the options; payloads are never modified or aliased.

    Args:
        batch: an object with ``records`` (each with a ``payload``, all dicts or all 1-D token
            arrays, and a ``meta`` with ``padding_length`` and ``segments``) and, optionally,
            ``pad_token_id``, such as a :class:`~zephon.SampleBatch`.
        **options: ``layout`` and the options of :class:`TrainingSpec`.

    Raises:
        TypeError: an unknown option, or one of the wrong type (a bare string for ``extra_fields``);
            payloads that are neither dicts nor arrays, or a mix.
        ValueError: an invalid option or combination; padding without a pad id; records of
            different lengths without ``padding``; a missing, misaligned or non-integer field
            (the message names the record and field); values that do not fit ``dtype``.

    Examples:
        A packed row holding two documents, ``BOS a1 a2 EOS BOS b1 b2 EOS``:

        >>> import numpy as np
        >>> from zephon.types import Meta, Record, SampleBatch, Segment
        >>> row = {"input_ids": np.array([1, 11, 12, 2, 1, 21, 22, 2]),
        ...        "positions": np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int32)}
        >>> meta = Meta(0, (Segment(0, 0, 0, 0, 0, 4), Segment(0, 0, 1, 0, 0, 4)))
        >>> out = to_training(SampleBatch((Record(row, meta),)), dtype=None, return_labels=True,
        ...                   eos_mask_loss=True, eos_token_id=2, return_cu_seqlens=True)
        >>> out["input_ids"], out["labels"]
        ([[1, 11, 12, 2, 1, 21, 22]], [[11, 12, 2, -100, 21, 22, 2]])
        >>> out["positions"], out["cu_seqlens"], out["max_seqlen"]
        ([[0, 1, 2, 3, 0, 1, 2]], [[0, 4, 7]], [4])

        Ragged prompt/response records, padded to the longest with the tokenizer's EOS (2):

        >>> def doc(row, tokens, mask):
        ...     payload = {"input_ids": np.array(tokens), "loss_mask": np.array(mask, np.uint8)}
        ...     return Record(payload, Meta(0, (Segment(0, 0, row, 0, 0, -1),)))
        >>> batch = SampleBatch((doc(0, [10, 20, 30, 40, 50], [0, 0, 0, 1, 1]),
        ...                      doc(1, [60, 70, 80], [0, 1, 1])))
        >>> out = to_training(batch, dtype=np.int64, return_labels=True, padding="longest", pad_token_id=2)
        >>> out["input_ids"].tolist(), out["labels"].tolist()
        ([[10, 20, 30, 40], [60, 70, 80, 2]], [[-100, -100, 40, 50], [70, 80, -100, -100]])
        >>> out["attention_mask"].tolist()
        [[1, 1, 1, 1], [1, 1, 1, 0]]
    """
    return _spec_of(options)(batch)


#: Specs by their options (with the values' types, so that ``1`` does not stand for ``True``).
_SPECS: dict[tuple, TrainingSpec] = {}
_SPECS_MAX = 64


def _spec_of(options: dict[str, Any]) -> TrainingSpec:
    """``training_spec(**options)``, built once per distinct options (validating costs about a fifth
    of converting a packed batch). Options that do not hash, and those that warn, are not kept."""
    try:
        key = tuple((k, type(v), v) for k, v in sorted(options.items()))
        spec = _SPECS.get(key)
    except TypeError:
        return training_spec(**options)
    if spec is None:
        spec = training_spec(**options)
        if spec.eos_token_id is None or spec.eos_mask_loss:  # it did not warn: keep it
            if len(_SPECS) >= _SPECS_MAX:
                _SPECS.clear()
            _SPECS[key] = spec
    return spec
