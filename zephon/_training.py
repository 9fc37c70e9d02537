"""Training tensors from a microbatch: shifted labels, loss masks, positions, boundaries, padding.

:func:`to_training` is the last step between a :class:`~zephon._records.SampleBatch` and a
training loop. It is a pure function of the batch and its options; it keeps no state.

Everything is computed on contiguous numpy buffers (one row copy per record, then vectorized
masks), and only the final conversion picks the framework: torch tensors wrap those buffers
without a copy. torch is imported lazily, inside the function, so this module imports without it.

Padding is always known *by position*, never by token id: the trailing ``meta.padding_length``
slots that packing added, plus the slots that dynamic padding (``padding="longest"``) adds here.
A pad id that also occurs as real content therefore never loses or gains supervision.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from ._records import SampleBatch

__all__ = ["to_training"]

#: Token fields tried, in order, by ``tokens_field="auto"`` (the first one with a length wins).
TOKEN_FIELDS = ("input_ids", "tokens", "token_ids", "ids")

_INT32_MAX = 2**31 - 1
_POSITION_MODES = ("preserve", "sequence")
_PADDING_SIDES = ("right", "left")


def to_training(
    batch: SampleBatch,
    *,
    tokens_field: str = "auto",
    return_labels: bool = False,
    dtype: Any = "auto",
    extra_fields: Sequence[str] = (),
    ignore_index: int = -100,
    rename_fields: Mapping[str, str] | None = None,
    flatten: bool = False,
    exclude_fields: Sequence[str] = (),
    return_num_valid_tokens: bool = False,
    return_loss_mask: bool = False,
    return_cu_seqlens: bool = False,
    return_padding_mask: bool = False,
    eos_mask_loss: bool = False,
    eos_token_id: int | None = None,
    position_mode: str = "preserve",
    shift_labels: bool = True,
    padding: bool | str | None = None,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
    pad_token_id: int | None = None,
    return_attention_mask: bool | None = None,
) -> dict[str, Any]:
    """Convert a microbatch into the fields a training step consumes.

    **What ``labels`` means.** With ``return_labels=True`` and the default
    ``shift_labels=True``, inputs and labels are already shifted, as in Zephon 0.2.0:
    ``input_ids = row[:-1]`` and ``labels = row[1:]``, so ``labels[t]`` is the token the model
    must predict after reading ``input_ids[: t + 1]`` (pack ``context + 1`` tokens per row). A
    label is ``ignore_index`` when its target or the input predicting it is padding, when the
    payload ``loss_mask`` is 0 on its target token, or (``eos_mask_loss``) when the input
    predicting it is EOS. With ``shift_labels=False`` the labels are the Hugging Face layout for
    models that shift internally: same length as ``input_ids``, ``labels[t] = input_ids[t]`` or
    ``ignore_index``, under the same masking (so ``labels[:, 1:]`` of this layout equals the
    shifted labels, and ``labels[:, 0]`` is always ignored: nothing predicts the first token).

    The payload ``loss_mask`` (as ``tokenize_chat`` emits it) is aligned with the tokens and
    marks *target* tokens: 1 on a token means "learn to produce this token". A prompt mask of 0
    on ``[10, 20, 30]`` and 1 on ``[40, 50]`` therefore supervises the predictions 30->40 and
    40->50.

    **Padding.** Records of different lengths must be padded: ``padding="longest"`` pads every
    row to the longest record (rounded up to ``pad_to_multiple_of``), ``padding="max_length"``
    to ``max_length`` (never truncating). Padding is added on ``padding_side`` with
    ``pad_token_id`` (token field) and 0 (every other field, positions included). It combines
    with the trailing ``meta.padding_length`` of packed rows: both are masked by position in
    ``labels``, ``padding_mask`` and ``attention_mask``. For ``cu_seqlens`` each block of added
    padding is one segment of its own, like the padding tail of a packed row.

    Output keys, in order: ``ids``, ``texts``, ``padding_mask``, ``input_ids``, ``labels``,
    ``attention_mask``, extra fields (in the order given), ``positions``, ``loss_mask``,
    ``num_valid_tokens``, ``cu_seqlens``, ``max_seqlen`` (each only when it applies), then
    renamed and excluded. An empty batch gives ``{"ids": [], "texts": []}`` plus, when
    requested, ``padding_mask=[]``, ``attention_mask=[]``, ``positions=[]`` (sequence mode),
    ``loss_mask=[]``, ``num_valid_tokens=0`` and ``cu_seqlens``/``max_seqlen`` = ``[]``/``[]``
    (``[0]``/``0`` when flattened).

    The output depends only on the batch and the options; nothing is kept between calls, and
    payloads are never modified or aliased by the output.

    Args:
        batch: the microbatch. Payloads are all dicts (token field plus optional ``positions``,
            ``loss_mask``, ``text`` and extra fields) or all bare 1-D arrays of tokens.
        tokens_field: the token field of dict payloads, or ``"auto"``: the first of input_ids,
            tokens, token_ids, ids that has a length. Ignored for array payloads. The output is
            named ``input_ids`` whatever the source field.
        return_labels: emit ``labels`` (see above).
        dtype: ``"auto"`` (``torch.long`` when torch is importable, else ``np.int64``),
            ``None`` (Python lists), a numpy dtype (numpy arrays) or a torch dtype (tensors).
            Every sequence field (tokens, labels, positions, attention mask, extra fields, the
            raw payload loss mask) uses it; ``loss_mask`` is always float32, ``padding_mask``
            bool, ``cu_seqlens``/``max_seqlen`` int32.
        extra_fields: more token-aligned payload fields to stack (sliced like ``input_ids``).
            ``positions`` is surfaced without being listed.
        ignore_index: the label value the loss skips.
        rename_fields: ``{emitted name: new name}``, applied before exclusion. Sources must be
            emitted (except in an empty batch); swaps are allowed; targets must stay unique.
        flatten: reshape every sequence field to ``[B * S]`` after shifting and masking;
            ``ids`` and ``texts`` stay per-record lists and ``cu_seqlens`` becomes one compact
            batch-wide array.
        exclude_fields: output names (after renaming) to drop; absent names are ignored.
        return_num_valid_tokens: emit ``num_valid_tokens``, the Python int count of
            ``labels != ignore_index``. Requires ``return_labels``.
        return_loss_mask: emit a label-aligned float32 ``loss_mask`` equal to
            ``labels != ignore_index`` after all masking. Requires ``return_labels``.
        return_cu_seqlens: emit ``cu_seqlens`` and ``max_seqlen`` for variable-length
            attention, from the zeros of the original payload ``positions`` (even with
            ``position_mode="sequence"``). Not flat: int32 ``[B, K]``, each row padded with its
            own length, and int32 ``[B]`` maxima. Flat: one int32 array ending at ``B * S`` and
            a Python int maximum.
        return_padding_mask: emit a bool input-aligned ``padding_mask``, True on padding slots.
        eos_mask_loss: ignore every label predicted *from* an EOS input (the EOS -> next
            document prediction, not the prediction of EOS). Requires ``return_labels`` and
            ``eos_token_id``.
        eos_token_id: the EOS id for ``eos_mask_loss`` (a non-negative integer).
        position_mode: ``"preserve"`` forwards the payload ``positions`` (per document);
            ``"sequence"`` emits ``0, 1, 2, ...`` over each record instead.
        shift_labels: with ``return_labels``, ``True`` shifts inputs and labels (Zephon);
            ``False`` gives unshifted, same-length labels (Hugging Face models).
        padding: ``None``/``False`` (records must have equal lengths), ``"longest"`` (or
            ``True``), or ``"max_length"``.
        max_length: the row length for ``padding="max_length"``.
        pad_to_multiple_of: round the padded length up to a multiple of this; with shifted
            labels the rounded length is that of the returned ``input_ids`` (row length - 1).
        padding_side: ``"right"`` or ``"left"``; where added padding goes.
        pad_token_id: the token id written into added padding slots (default 0; it never
            matters for the loss, which masks padding by position).
        return_attention_mask: emit ``attention_mask`` (1 on real tokens, 0 on every padding
            slot). Default: whenever ``padding`` is requested, so every batch of a run has the
            same keys even if it needed no padding.

    Returns:
        A dict of lists / numpy arrays / torch tensors as described above.

    Raises:
        TypeError: payloads that are neither dicts nor arrays, a mix of both, or a bare string
            for ``exclude_fields`` / ``extra_fields``.
        ValueError: an invalid option or combination of options; records of different lengths
            without ``padding``; a missing, misaligned or non-integer field (the message names
            the record and field); positions unusable for ``cu_seqlens``; a padding length
            outside its row; values that do not fit the requested dtype; rename collisions.

    Examples:
        A packed row holding two documents, ``BOS a1 a2 EOS BOS b1 b2 EOS``:

        >>> import numpy as np
        >>> from zephon._records import Meta, Record, SampleBatch, Segment
        >>> row = {"input_ids": np.array([1, 11, 12, 2, 1, 21, 22, 2]),
        ...        "positions": np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int32)}
        >>> meta = Meta(0, (Segment(0, 0, 0, 0, 0, 4), Segment(0, 0, 1, 0, 0, 4)))
        >>> out = to_training(SampleBatch((Record(row, meta),)), dtype=None, return_labels=True,
        ...                   eos_mask_loss=True, eos_token_id=2, return_cu_seqlens=True)
        >>> out["input_ids"], out["labels"]
        ([[1, 11, 12, 2, 1, 21, 22]], [[11, 12, 2, -100, 21, 22, 2]])
        >>> out["positions"], out["cu_seqlens"], out["max_seqlen"]
        ([[0, 1, 2, 3, 0, 1, 2]], [[0, 4, 7]], [4])

        Ragged prompt/response records, padded to the longest:

        >>> def doc(row, tokens, mask):
        ...     payload = {"input_ids": np.array(tokens), "loss_mask": np.array(mask, np.uint8)}
        ...     return Record(payload, Meta(0, (Segment(0, 0, row, 0, 0, -1),)))
        >>> batch = SampleBatch((doc(0, [10, 20, 30, 40, 50], [0, 0, 0, 1, 1]),
        ...                      doc(1, [60, 70, 80], [0, 1, 1])))
        >>> out = to_training(batch, dtype=np.int64, return_labels=True, padding="longest")
        >>> out["input_ids"].tolist(), out["labels"].tolist()
        ([[10, 20, 30, 40], [60, 70, 80, 0]], [[-100, -100, 40, 50], [70, 80, -100, -100]])
        >>> out["attention_mask"].tolist()
        [[1, 1, 1, 1], [1, 1, 1, 0]]
    """
    # -- options (checked before the empty-batch shortcut, so misuse fails on every batch) --------
    if isinstance(exclude_fields, str):
        raise TypeError(
            f"to_training: exclude_fields must be a sequence of names, not a string; "
            f"write exclude_fields=({exclude_fields!r},)"
        )
    if isinstance(extra_fields, str):
        raise TypeError(
            f"to_training: extra_fields must be a sequence of names, not a string; "
            f"write extra_fields=({extra_fields!r},)"
        )
    if rename_fields is not None and not isinstance(rename_fields, Mapping):
        raise TypeError(
            f"to_training: rename_fields must be a mapping {{emitted name: new name}}, "
            f"got {type(rename_fields).__name__}"
        )
    extras = list(dict.fromkeys(extra_fields))
    if position_mode not in _POSITION_MODES:
        raise ValueError(f"to_training: position_mode must be 'preserve' or 'sequence', got {position_mode!r}")
    if not _is_int(ignore_index):
        raise ValueError(f"to_training: ignore_index must be an integer, got {ignore_index!r}")
    for flag, name in ((return_loss_mask, "return_loss_mask"), (return_num_valid_tokens, "return_num_valid_tokens"),
                       (eos_mask_loss, "eos_mask_loss")):
        if flag and not return_labels:
            raise ValueError(f"to_training: {name} requires return_labels=True (it describes the labels)")
    if not shift_labels and not return_labels:
        raise ValueError("to_training: shift_labels=False only applies to labels; pass return_labels=True with it")
    if eos_token_id is not None and (not _is_int(eos_token_id) or eos_token_id < 0):
        raise ValueError(f"to_training: eos_token_id must be a nonnegative integer, got {eos_token_id!r}")
    if eos_mask_loss and eos_token_id is None:
        raise ValueError(
            "to_training: eos_mask_loss requires an explicit eos_token_id (the tokenizer's EOS id), "
            "e.g. eos_mask_loss=True, eos_token_id=tokenizer.eos_token_id"
        )
    if eos_token_id is not None and not eos_mask_loss:
        # SampleBatch.to_training delegates here; point the warning at the user's line either way.
        caller = sys._getframe(1).f_code
        warnings.warn(
            "to_training: eos_token_id is ignored without eos_mask_loss=True; pass eos_mask_loss=True "
            "to mask predictions made from EOS, or drop eos_token_id",
            UserWarning,
            stacklevel=3 if caller is SampleBatch.to_training.__code__ else 2,
        )
    pad_mode = _padding_mode(padding)
    if pad_mode == "max_length":
        if not _is_int(max_length) or max_length < 1:
            raise ValueError(
                f"to_training: padding='max_length' requires max_length, a positive integer; got {max_length!r}"
            )
    elif max_length is not None:
        raise ValueError(
            "to_training: max_length is only used with padding='max_length'; pass both, or drop max_length "
            "(padding='longest' pads to the longest record)"
        )
    if pad_to_multiple_of is not None:
        if not _is_int(pad_to_multiple_of) or pad_to_multiple_of < 1:
            raise ValueError(f"to_training: pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
        if pad_mode is None:
            raise ValueError(
                "to_training: pad_to_multiple_of needs padding; pass padding='longest' (or 'max_length') with it"
            )
    if padding_side not in _PADDING_SIDES:
        raise ValueError(f"to_training: padding_side must be 'right' or 'left', got {padding_side!r}")
    if pad_token_id is not None and (not _is_int(pad_token_id) or pad_token_id < 0):
        raise ValueError(f"to_training: pad_token_id must be a nonnegative integer or None, got {pad_token_id!r}")
    if return_attention_mask is not None and not isinstance(return_attention_mask, bool):
        raise ValueError(
            f"to_training: return_attention_mask must be None, True or False, got {return_attention_mask!r}"
        )
    emit_attention = (pad_mode is not None) if return_attention_mask is None else bool(return_attention_mask)

    generated = {"ids", "texts", "input_ids"} | ({"labels"} if return_labels else set())
    flagged = {
        "padding_mask": (return_padding_mask, "return_padding_mask=True"),
        "attention_mask": (emit_attention, "an attention mask (padding requested or return_attention_mask=True)"),
        "cu_seqlens": (return_cu_seqlens, "return_cu_seqlens=True"),
        "max_seqlen": (return_cu_seqlens, "return_cu_seqlens=True"),
        "num_valid_tokens": (return_num_valid_tokens, "return_num_valid_tokens=True"),
    }
    for name in extras:
        if name in generated:
            raise ValueError(
                f"to_training: extra_fields cannot overwrite generated field {name!r}; rename the payload field "
                "or use rename_fields on the output"
            )
        if name in flagged and flagged[name][0]:
            raise ValueError(
                f"to_training: extra_fields cannot include {name!r} with {flagged[name][1]}; that output is generated"
            )
        if name == "loss_mask" and return_labels:
            raise ValueError(
                "to_training: extra_fields cannot include 'loss_mask' with return_labels=True: extra fields are "
                "input-aligned, not label-aligned. Use return_loss_mask=True for the label-aligned mask, or "
                "return_labels=False for the raw mask."
            )
    out_kind = _Output(dtype)

    # -- empty batch -----------------------------------------------------------------------------------
    records = batch.records
    if not records:
        empty: dict[str, Any] = {"ids": [], "texts": []}
        if return_padding_mask:
            empty["padding_mask"] = []
        if emit_attention:
            empty["attention_mask"] = []
        if position_mode == "sequence":
            empty["positions"] = []
        if return_loss_mask:
            empty["loss_mask"] = []
        if return_num_valid_tokens:
            empty["num_valid_tokens"] = 0
        if return_cu_seqlens:
            empty["cu_seqlens"] = [0] if flatten else []
            empty["max_seqlen"] = 0 if flatten else []
        return _rename_and_exclude(empty, rename_fields, exclude_fields, allow_missing=True)

    # -- gather rows -----------------------------------------------------------------------------------
    need_positions = return_cu_seqlens or position_mode == "preserve" or "positions" in extras
    rows = _gather(records, tokens_field, extras, need_positions=need_positions)
    if return_cu_seqlens and rows.positions is None:
        raise ValueError(
            "to_training: return_cu_seqlens requires a 'positions' field in every payload (document starts are "
            "its zeros); use pack_flat(emit_positions=True)"
        )
    B = len(records)
    n = np.fromiter((len(t) for t in rows.tokens), dtype=np.int64, count=B)
    pad_len = np.fromiter((r.meta.padding_length for r in records), dtype=np.int64, count=B)
    bad = np.flatnonzero((pad_len < 0) | (pad_len > n))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"to_training: record {i} has meta.padding_length={int(pad_len[i])} but only {int(n[i])} tokens; "
            "padding_length must lie within its row (0 <= padding_length <= tokens)"
        )

    # -- layout: row length T and where each record starts ---------------------------------------------
    if pad_mode is None:
        if B > 1 and (n != n[0]).any():
            j = int(np.flatnonzero(n != n[0])[0])
            raise ValueError(
                f"to_training: records have different lengths (record 0: {int(n[0])} tokens, record {j}: "
                f"{int(n[j])} tokens); pass padding='longest' to pad them to the longest record "
                "(or padding='max_length', max_length=N)"
            )
        T = int(n[0])
    else:
        if pad_mode == "longest":
            T = int(n.max())
        else:
            over = np.flatnonzero(n > max_length)
            if over.size:
                i = int(over[0])
                raise ValueError(
                    f"to_training: record {i} has {int(n[i])} tokens, more than max_length={max_length}; padding "
                    "never truncates: raise max_length, use padding='longest', or cut records upstream"
                )
            T = int(max_length)
        if pad_to_multiple_of:
            # Round the length the model sees: with shifted labels that is T - 1.
            shift = 1 if (return_labels and shift_labels) else 0
            T = -(-(T - shift) // pad_to_multiple_of) * pad_to_multiple_of + shift
    left = (T - n) if padding_side == "left" else np.zeros(B, dtype=np.int64)
    padded = bool((n != T).any())
    cols = np.arange(T, dtype=np.int64)
    stop = left + n
    real = (cols >= left[:, None]) & (cols < (stop - pad_len)[:, None])  # real tokens, by position

    tok = _fill(rows.tokens, B, T, left, pad_token_id or 0, np.int64)
    pos = _fill(rows.positions, B, T, left, 0, np.int64) if rows.positions is not None else None
    mask = _fill(rows.loss_mask, B, T, left, 0, np.bool_) if rows.loss_mask is not None else None
    if return_cu_seqlens:
        first = np.fromiter((p[0] if len(p) else 0 for p in rows.positions), dtype=np.int64, count=B)
        if (first != 0).any():
            i = int(np.flatnonzero(first != 0)[0])
            raise ValueError(
                f"to_training: record {i}: positions must start at zero (got {int(first[i])}), because document "
                "starts are the zeros of positions; use pack_flat(emit_positions=True)"
            )

    # -- labels (computed on the full row, then shifted views) ------------------------------------------
    W = max(T - 1, 0) if (return_labels and shift_labels) else T  # input-aligned width
    fields: dict[str, tuple[np.ndarray, str]] = {}  # name -> (array, kind), in output order
    if return_padding_mask:
        fields["padding_mask"] = (~real[:, :W], "bool")
    fields["input_ids"] = (tok[:, :W], "seq")
    labels = None
    if return_labels:
        # Label t (shifted) is the target row[t + 1] predicted from input row[t]: both must be real tokens.
        valid = real[:, 1:] & real[:, :-1]
        if mask is not None:
            valid &= mask[:, 1:]
        if eos_mask_loss:
            valid &= tok[:, :-1] != eos_token_id
        shifted = np.where(valid, tok[:, 1:], np.int64(ignore_index))
        if shift_labels:
            labels = shifted
        else:
            labels = np.empty((B, T), dtype=np.int64)
            labels[:, :1] = ignore_index
            labels[:, 1:] = shifted
        fields["labels"] = (labels, "seq")
    if emit_attention:
        fields["attention_mask"] = (real[:, :W], "seq")

    positions_out = None
    if position_mode == "sequence":
        if padded:
            positions_out = cols[None, :W] - left[:, None]
            positions_out[(positions_out < 0) | (positions_out >= n[:, None])] = 0
        else:
            positions_out = np.empty((B, W), dtype=np.int64)
            positions_out[:] = cols[:W]
    elif pos is not None:
        positions_out = pos[:, :W]
    for name in extras:
        if name == "positions":
            if positions_out is None:
                raise ValueError("to_training: extra field 'positions' is missing from the payloads")
            fields["positions"] = (positions_out, "seq")
        else:
            arr = _fill(rows.extras[name], B, T, left, 0, None)
            fields[name] = (arr[:, :W], "seq")
    if positions_out is not None and "positions" not in fields:
        fields["positions"] = (positions_out, "seq")

    if return_loss_mask:
        fields["loss_mask"] = (labels != ignore_index, "float")
    elif mask is not None and not return_labels and "loss_mask" not in fields:
        fields["loss_mask"] = (mask, "seq")  # the raw payload mask, unshifted, as 0/1

    # -- boundaries for variable-length attention ----------------------------------------------------
    cu = None
    if return_cu_seqlens:
        seg = pos
        if padded:
            # Added padding blocks count up from 0, so each block is a segment of its own.
            in_record = (cols >= left[:, None]) & (cols < stop[:, None])
            block = np.where(cols < left[:, None], cols, cols - stop[:, None])
            seg = np.where(in_record, pos, block)
        cu = _cu_seqlens(seg[:, :W] == 0, flatten)

    # -- assemble ------------------------------------------------------------------------------------
    result: dict[str, Any] = {"ids": [list(p) for p in batch.ids], "texts": rows.texts}
    for name, (arr, kind) in fields.items():
        if flatten:
            arr = arr.reshape(-1)
        result[name] = out_kind.convert(arr, kind, name)
    if return_num_valid_tokens:
        result["num_valid_tokens"] = int(np.count_nonzero(labels != ignore_index))
    if cu is not None:
        result["cu_seqlens"], result["max_seqlen"] = out_kind.boundaries(*cu, flatten)
    return _rename_and_exclude(result, rename_fields, exclude_fields, allow_missing=False)


# -- helpers -------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _padding_mode(padding: Any) -> str | None:
    if padding is None or padding is False or (isinstance(padding, str) and padding == "do_not_pad"):
        return None
    if padding is True or (isinstance(padding, str) and padding == "longest"):
        return "longest"
    if isinstance(padding, str) and padding == "max_length":
        return "max_length"
    raise ValueError(
        f"to_training: padding must be None/False, 'longest' (or True) or 'max_length', got {padding!r}"
    )


class _Rows:
    __slots__ = ("tokens", "texts", "positions", "loss_mask", "extras")

    def __init__(self, tokens, texts, positions, loss_mask, extras):
        self.tokens = tokens
        self.texts = texts
        self.positions = positions
        self.loss_mask = loss_mask
        self.extras = extras


def _gather(records: Sequence[Any], tokens_field: str, extras: list[str], *, need_positions: bool) -> _Rows:
    """Per-record 1-D numpy rows of every field the output needs, validated and named in errors."""
    payloads = [r.payload for r in records]
    first = payloads[0]
    if not isinstance(first, dict):
        if not hasattr(first, "shape"):
            raise TypeError(
                f"to_training: expects dict or array-like (numpy/torch) payloads, got {type(first).__name__} "
                "in record 0"
            )
        for i, p in enumerate(payloads):
            if isinstance(p, dict) or not hasattr(p, "shape"):
                raise TypeError(
                    f"to_training: mixed payload types: record 0 is an array but record {i} is "
                    f"{type(p).__name__}; a batch must be all dicts or all arrays"
                )
        if extras:
            raise ValueError(
                f"to_training: extra_fields {extras} need dict payloads, but the records are bare arrays"
            )
        tokens = [_tokens_row(p, i, "payload") for i, p in enumerate(payloads)]
        return _Rows(tokens, [""] * len(payloads), None, None, {})

    for i, p in enumerate(payloads):
        if not isinstance(p, dict):
            raise TypeError(
                f"to_training: mixed payload types: record 0 is a dict but record {i} is {type(p).__name__}; "
                "a batch must be all dicts or all arrays"
            )
    field = _token_field(first, tokens_field)
    tokens = []
    for i, p in enumerate(payloads):
        if field not in p:
            raise ValueError(
                f"to_training: record {i}: token field {field!r} not found in payload (keys {sorted(p)[:8]}); "
                "every record needs the same token field"
            )
        tokens.append(_tokens_row(p[field], i, field))
    texts = [str(p.get("text", "")) for p in payloads]

    positions = None
    if _present(payloads, "positions", "pack every record with pack_flat(emit_positions=True)") and need_positions:
        positions = [_aligned_row(p["positions"], i, "positions", field, len(t))
                     for i, (p, t) in enumerate(zip(payloads, tokens))]
    loss_mask = None
    if _present(payloads, "loss_mask", "give every record a loss_mask (tokenize_chat emits one)"):
        loss_mask = [_aligned_row(p["loss_mask"], i, "loss_mask", field, len(t)) != 0
                     for i, (p, t) in enumerate(zip(payloads, tokens))]
    extra_rows: dict[str, list[np.ndarray]] = {}
    for name in extras:
        if name == "positions":
            continue  # handled with the positions above, at this slot of the output
        rows = []
        for i, (p, t) in enumerate(zip(payloads, tokens)):
            if name not in p:
                raise ValueError(
                    f"to_training: record {i}: extra field {name!r} not found in payload (keys {sorted(p)[:8]})"
                )
            rows.append(_aligned_row(p[name], i, name, field, len(t)))
        extra_rows[name] = rows
    return _Rows(tokens, texts, positions, loss_mask, extra_rows)


def _token_field(payload: dict, tokens_field: str) -> str:
    if tokens_field != "auto":
        return tokens_field
    for name in TOKEN_FIELDS:
        if name in payload and hasattr(payload[name], "__len__"):
            return name
    hint = ""
    if "packed_samples" in payload:
        hint = (
            " This is a pack_sequences envelope (a list of documents), which cannot be converted: use pack_flat, "
            "or build tensors from the documents yourself."
        )
    raise ValueError(
        f"to_training: cannot auto-detect the token field: record 0 has keys {sorted(payload)[:8]}; expected one of "
        f"{', '.join(TOKEN_FIELDS)}, or pass tokens_field=.{hint}"
    )


def _present(payloads: list[dict], name: str, fix: str) -> bool:
    has = [name in p for p in payloads]
    if any(has) and not all(has):
        i = has.index(False)
        raise ValueError(f"to_training: {name!r} present in some payloads but missing in record {i}; {fix}")
    return has[0]


def _tokens_row(value: Any, i: int, field: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(
            f"to_training: record {i}: token field {field!r} must be 1-D, got shape {arr.shape}; "
            "to_training requires 2-D input_ids (one row per record)"
        )
    if arr.dtype.kind not in "iu" and arr.size:
        raise ValueError(
            f"to_training: record {i}: token field {field!r} holds {arr.dtype} values; token ids must be integers"
        )
    return arr


def _aligned_row(value: Any, i: int, name: str, field: str, length: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or len(arr) != length:
        got = f"length {len(arr)}" if arr.ndim == 1 else f"shape {arr.shape}"
        raise ValueError(
            f"to_training: record {i}: {name!r} {got} does not match {field!r} length {length}; "
            f"{name!r} must be a sequence with one entry per token"
        )
    return arr


def _fill(rows: list[np.ndarray], B: int, T: int, left: np.ndarray, fill: int, dtype: Any) -> np.ndarray:
    """Rows copied into one contiguous ``[B, T]`` buffer at their offsets; other slots hold ``fill``."""
    if dtype is None:
        dtype = np.result_type(*[r.dtype for r in rows]) if rows else np.int64
    if all(len(r) == T for r in rows):
        out = np.empty((B, T), dtype=dtype)
        for i, r in enumerate(rows):
            out[i] = r
        return out
    out = np.full((B, T), fill, dtype=dtype)
    for i, r in enumerate(rows):
        a = int(left[i])
        out[i, a : a + len(r)] = r
    return out


def _cu_seqlens(starts: np.ndarray, flatten: bool) -> tuple[np.ndarray, Any]:
    """int32 cumulative boundaries and maxima from a ``[B, W]`` bool matrix of segment starts."""
    B, W = starts.shape
    if (B * W if flatten else W) > _INT32_MAX:
        raise ValueError("to_training: cumulative sequence lengths exceed the int32 range; use shorter rows")
    if flatten:
        cu = np.append(np.flatnonzero(starts.reshape(-1)), B * W).astype(np.int32)
        return cu, int(np.diff(cu).max(initial=0))
    rows, columns = np.nonzero(starts)
    counts = starts.sum(axis=1)
    cu = np.full((B, int(counts.max(initial=0)) + 1), W, dtype=np.int32)
    offsets = np.cumsum(counts) - counts
    cu[rows, np.arange(len(rows)) - offsets[rows]] = columns
    return cu, np.diff(cu, axis=1).max(axis=1, initial=0).astype(np.int32)


class _Output:
    """The requested output framework and dtype, and the conversion of numpy results into it."""

    __slots__ = ("kind", "np_dtype", "torch", "torch_dtype")

    def __init__(self, dtype: Any):
        self.torch = None
        self.torch_dtype = None
        self.np_dtype = None
        if dtype is None:
            self.kind = "list"
        elif isinstance(dtype, str) and dtype == "auto":
            try:
                import torch
            except ImportError:
                self.kind, self.np_dtype = "numpy", np.dtype(np.int64)
            else:
                self.kind, self.torch, self.torch_dtype, self.np_dtype = "torch", torch, torch.long, np.dtype(np.int64)
        elif type(dtype).__module__ == "torch":
            import torch

            self.kind, self.torch, self.torch_dtype = "torch", torch, dtype
            try:
                self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            except (TypeError, RuntimeError):  # e.g. bfloat16 has no numpy twin: convert in torch
                self.np_dtype = None
        else:
            try:
                self.kind, self.np_dtype = "numpy", np.dtype(dtype)
            except TypeError:
                raise ValueError(
                    f"to_training: dtype must be 'auto', None, a numpy dtype or a torch dtype, got {dtype!r}"
                ) from None

    def convert(self, arr: np.ndarray, kind: str, name: str) -> Any:
        if kind == "float":
            arr = arr.astype(np.float32)
        elif kind == "bool":
            arr = np.ascontiguousarray(arr)
        elif arr.dtype == np.bool_ and self.np_dtype is None:
            arr = arr.astype(np.int64)  # masks as 0/1 ints, like every sequence field
        elif self.np_dtype is not None:
            if self.np_dtype.kind in "iu" and self.np_dtype != np.int64 and arr.size:
                info = np.iinfo(self.np_dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"to_training: field {name!r} holds values in [{lo}, {hi}] that do not fit dtype "
                        f"{self.np_dtype}; pass a wider dtype (the default is int64)"
                    )
            arr = np.ascontiguousarray(arr, dtype=self.np_dtype)
        else:
            arr = np.ascontiguousarray(arr)
        if self.kind == "list":
            return arr.tolist()
        if self.kind == "numpy":
            return arr
        t = self.torch.from_numpy(arr)
        if kind == "seq" and self.np_dtype is None:
            t = t.to(self.torch_dtype)
        return t

    def boundaries(self, cu: np.ndarray, maxima: Any, flatten: bool) -> tuple[Any, Any]:
        if self.kind == "list":
            return cu.tolist(), maxima if flatten else maxima.tolist()
        if self.kind == "numpy":
            return cu, maxima
        return self.torch.from_numpy(cu), maxima if flatten else self.torch.from_numpy(maxima)


def _rename_and_exclude(
    result: dict[str, Any],
    rename_fields: Mapping[str, str] | None,
    exclude_fields: Sequence[str],
    *,
    allow_missing: bool,
) -> dict[str, Any]:
    """Rename emitted keys (swaps allowed, collisions rejected before exclusion), then drop excluded ones."""
    if rename_fields:
        missing = [k for k in rename_fields if k not in result]
        if missing and not allow_missing:
            raise ValueError(
                f"to_training: rename_fields source keys not in output: {missing}; emitted keys: {list(result)}"
            )
        counts = Counter(rename_fields.get(k, k) for k in result)
        collisions = sorted(k for k, c in counts.items() if c > 1)
        if collisions:
            raise ValueError(
                f"to_training: rename_fields target keys collide: {collisions}; every output name must be unique"
            )
        result = {rename_fields.get(k, k): v for k, v in result.items()}
    for name in exclude_fields:
        result.pop(name, None)
    return result
