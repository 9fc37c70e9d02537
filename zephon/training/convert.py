"""Training tensors from a microbatch: shifted labels, loss masks, positions, boundaries, padding.

:func:`to_training` is the last step between a :class:`~zephon.SampleBatch` and a training loop, a
pure function of the batch and its options: ``to_training(batch, **options)`` is
``TrainingSpec(**options)(batch)`` (:class:`~zephon.training.spec.TrainingSpec`). It takes any
object with ``records`` (and, optionally, ``pad_token_id``), so ``SampleBatch.to_training`` can
delegate here from the layer below.
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
    # Megatron-LM / Megatron-Core GPT batches: ``tokens``, ``labels``, ``loss_mask`` (float32),
    # ``position_ids`` (0, 1, 2, ... over the row, Megatron's default ``reset_position_ids=False``)
    # and, for packed rows, ``cu_seqlens``/``max_seqlen`` (document boundaries, int32) for its
    # packed-sequence attention (``PackedSeqParams``).
    "megatron": dict(
        return_labels=True, return_loss_mask=True, return_cu_seqlens=True, position_mode="sequence",
        rename_fields={"input_ids": "tokens", "positions": "position_ids"}, exclude_fields=("ids", "texts"),
    ),
    # Hugging Face causal LMs (``model(**batch)``, the ``Trainer``): unshifted ``labels`` (the model shifts),
    # ``attention_mask`` where rows are padded, and only the keys ``forward`` takes. Packed rows carry
    # ``position_ids`` that restart at every document and no ``attention_mask``: from those transformers
    # builds a per-document causal mask (``find_packed_sequence_indices``).
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

    **Labels.** With ``return_labels=True`` and the default ``shift_labels=True``, inputs and
    labels are already shifted: ``input_ids = row[:-1]``, ``labels = row[1:]``, so ``labels[t]`` is
    the token to predict after reading ``input_ids[: t + 1]`` (pack ``context + 1`` tokens per row).
    A label is ``ignore_index`` when its target or the input predicting it is padding, when the
    payload ``loss_mask`` is 0 on its target, or (``eos_mask_loss``) when the input predicting it
    is EOS. ``shift_labels=False`` gives the Hugging Face layout for models that shift internally:
    same length as ``input_ids``, ``labels[t] = input_ids[t]`` or ``ignore_index`` under the same
    masking (``labels[:, 1:]`` equals the shifted labels; ``labels[:, 0]`` is always ignored).

    The payload ``loss_mask`` (as ``tokenize_chat`` emits it) is token-aligned and marks *target*
    tokens: a prompt mask of 0 on ``[10, 20, 30]`` and 1 on ``[40, 50]`` supervises the predictions
    30->40 and 40->50. Token-aligned fields may be numpy arrays or plain lists.

    **Padding.** ``padding="longest"`` pads every row to the longest record (rounded up to
    ``pad_to_multiple_of``), ``padding="max_length"`` to ``max_length`` (never truncating), on
    ``padding_side``, with the pad id in the token field and 0 elsewhere. Added padding and the
    trailing ``meta.padding_length`` of packed rows are masked by position; for ``cu_seqlens`` each
    block of added padding is a segment of its own. The pad id is ``pad_token_id``, else the
    batch's own (a tokenizing pipeline sets it: the tokenizer's pad, else EOS); padding without
    either raises ``ValueError``, since id 0 is a real token in most vocabularies.

    **Segments.** Fields that are not token-aligned (a ``doc_id``, ``pixel_values``) are never
    dropped: when a record carries any, ``segments`` holds, per record, one dict per segment
    (aligned with ``ids``): ``{"start": offset in the output row, "length": its tokens, **its
    document's fields}``. ``start`` counts added left padding and is taken before the label shift
    (flattened, add ``i * row width``).
    A ``pack_flat`` row's segments are those it carries; a plain record is one segment holding its
    payload's fields other than the token field, ``text``, ``positions``, ``loss_mask`` and
    token-aligned fields. Values are copied and stay Python/numpy objects whatever ``dtype``; a
    field named ``start`` or ``length``, or one that does not pickle, is refused naming it.

    Output keys, in order: ``ids``, ``texts``, ``segments``, ``padding_mask``, ``input_ids``,
    ``labels``, ``attention_mask``, extra fields (in the order given), ``positions``,
    ``loss_mask``, ``document_ids``, ``num_valid_tokens``, ``cu_seqlens``, ``cu_seqlens_padded``,
    ``max_seqlen`` (each only when it applies), then renamed and excluded. An empty batch gives
    ``{"ids": [], "texts": []}`` plus, when requested, ``padding_mask=[]``, ``attention_mask=[]``,
    ``positions=[]`` (sequence mode), ``loss_mask=[]``, ``document_ids=[]``, ``num_valid_tokens=0``
    and ``cu_seqlens``/``cu_seqlens_padded``/``max_seqlen`` = ``[]`` (``[0]``/``[0]``/``0`` when
    flattened).

    The output depends only on the batch and the options; payloads are never modified or aliased.
    ``TrainingSpec(**options)`` validates the options once for many batches, with the same output.

    Args:
        batch: an object with ``records`` (each with a ``payload`` and a ``meta`` holding
            ``padding_length`` and ``segments``) and, optionally, ``pad_token_id``, such as a
            :class:`~zephon.SampleBatch`. Payloads are all dicts (token field plus optional
            ``positions``, ``loss_mask``, ``text`` and extra fields) or all bare 1-D token arrays.
        layout: a preset of the options below for one framework's field names (:data:`LAYOUTS`):
            ``"megatron"`` gives ``tokens``, ``labels``, float32 ``loss_mask``, ``position_ids``
            (0, 1, 2, ... per row) and ``cu_seqlens``/``max_seqlen``. Options given next to it win.
        tokens_field: the token field of dict payloads, or ``"auto"`` (default): the first of
            input_ids, tokens, token_ids, ids that has a length. Emitted as ``input_ids``.
        return_labels: emit ``labels`` (see above). Default False.
        dtype: ``"auto"`` (default: ``torch.long`` when torch imports, else ``np.int64``), ``None``
            (Python lists), a numpy or a torch dtype, for every sequence field; ``loss_mask`` is
            always float32, ``padding_mask`` bool, ``cu_seqlens``/``max_seqlen`` int32.
        extra_fields: more token-aligned payload fields to stack (sliced like ``input_ids``);
            ``positions`` is surfaced without being listed.
        ignore_index: the label value the loss skips. Default -100.
        rename_fields: ``{emitted name: new name}``, applied before exclusion. Sources must be
            emitted (except in an empty batch); swaps are allowed; targets must stay unique.
        flatten: reshape every sequence field to ``[B * S]`` after shifting and masking (``ids``
            and ``texts`` stay per record; ``cu_seqlens`` becomes one batch-wide array).
        exclude_fields: output names (after renaming) to drop; absent names are ignored.
        return_num_valid_tokens: emit the Python int count of ``labels != ignore_index``.
        return_loss_mask: emit a label-aligned float32 ``loss_mask``, ``labels != ignore_index``.
        return_cu_seqlens: emit ``cu_seqlens`` and ``max_seqlen`` for variable-length attention,
            from the zeros of the payload ``positions`` (even with ``position_mode="sequence"``).
            Not flat: int32 ``[B, K]``, each row padded with its own length, and int32 ``[B]``
            maxima. Flat: one int32 array ending at ``B * S`` and a Python int maximum.
        return_padding_mask: emit a bool input-aligned ``padding_mask``, True on padding slots.
        eos_mask_loss: ignore every label predicted *from* an EOS input (the EOS -> next
            document prediction, not the prediction of EOS); needs ``eos_token_id``.
        eos_token_id: the EOS id for ``eos_mask_loss``; given without it, ignored with a warning.
        position_mode: ``"preserve"`` (default) forwards the payload ``positions`` (per
            document); ``"sequence"`` emits ``0, 1, 2, ...`` over each record instead.
        shift_labels: ``True`` (default) shifts inputs and labels; ``False`` gives same-length labels.
        padding: ``None``/``False`` (default: equal lengths required), ``"longest"`` (or ``True``),
            or ``"max_length"``.
        max_length: the row length for ``padding="max_length"`` (never truncating).
        pad_to_multiple_of: round the padded length up to a multiple of this; with shifted
            labels, the length of the returned ``input_ids`` (row length - 1).
        padding_side: ``"right"`` (default) or ``"left"``.
        pad_token_id: the id written into added padding slots; default: the batch's
            ``pad_token_id``. It never matters for the loss, which masks padding by position.
        return_attention_mask: emit ``attention_mask`` (1 on real tokens, 0 on padding). Default:
            whenever ``padding`` is requested, so every batch of a run has the same keys.
        return_document_ids: emit int64 input-aligned ``document_ids``: per token, the index of its
            document within its row (across the batch with ``flatten``), -1 on padding; documents
            start at the zeros of ``positions`` (a record without them is one document).
        context_parallel: ``(cp_size, cp_rank)``: emit only this context-parallel rank's share of
            every sequence field (sliced after the label shift); ``num_valid_tokens`` counts it.
        context_parallel_format: ``"bshd"`` (default): the input-aligned row is cut into chunks
            (its width must divide), ``cu_seqlens`` stay the full row's. ``"thd"``: each document
            is padded to a multiple of the chunk count inside the row (which must have room) and
            cut on its own; emits ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded``.
        load_balance: ``True`` (default): ``2 * cp_size`` chunks, rank ``r`` takes chunks ``r`` and
            ``2 * cp_size - 1 - r``; ``False``: ``cp_size`` contiguous chunks.
        The options that need labels (``return_loss_mask``, ``return_num_valid_tokens``,
        ``eos_mask_loss``, ``shift_labels=False``) require ``return_labels``; the option table is
        in ``docs/guide/training_tensors.md``.

    Raises:
        TypeError: an unknown option; payloads that are neither dicts nor arrays, a mix of
            both, or a bare string for ``exclude_fields`` / ``extra_fields``.
        ValueError: an invalid option or combination of options; padding requested without a
            pad id; records of different lengths without ``padding``; a missing, misaligned or
            non-integer field (the message names the record and field); positions unusable for
            ``cu_seqlens``; a padding length outside its row; values that do not fit the
            requested dtype; rename collisions.

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

        The same options applied to many batches, validated once:

        >>> spec = TrainingSpec(dtype=np.int64, return_labels=True, padding="longest", pad_token_id=2)
        >>> spec(batch)["labels"].tolist() == out["labels"].tolist()
        True
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
