"""The options of :func:`~zephon.to_training` as a validated value, and their application to a batch.

:class:`TrainingSpec` normalises and validates the options once; calling it converts a batch. It
keeps no state and pickles, so one spec serves every batch of a run, from any thread or process.
Work is done on numpy buffers; torch (imported lazily) wraps them without a copy. Padding is known
*by position* (``meta.padding_length`` plus the slots ``padding=`` adds), never by token id.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterator, Mapping, Sequence

import attrs
import numpy as np

from . import context_parallel as cp
from .context_parallel import _is_int
from .fields import TOKEN_FIELDS, unique_names
from .rows import _cu_seqlens, _fill, _gather, _Output, _rename_and_exclude, _segments

__all__ = ["TrainingSpec"]

#: Modules whose frames a warning skips to reach the caller: this package and attrs (evolve).
_INTERNAL_PACKAGES = frozenset({__package__.partition(".")[0], "attr", "attrs"})


# Converters normalise only the values they recognise (validators then report the value the caller
# gave) and are idempotent, so attrs.evolve on a spec gives what the constructor gives.


def _int(value: Any) -> Any:
    return int(value) if _is_int(value) else value


def _padding(value: Any) -> Any:
    if value is None or value is False or (isinstance(value, str) and value == "do_not_pad"):
        return None
    if value is True or (isinstance(value, str) and value == "longest"):
        return "longest"
    return value


def _renames(value: Any) -> Any:
    return _FrozenDict(value or {}) if value is None or isinstance(value, Mapping) else value


def _check_names(spec: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str):
        raise TypeError(
            f"to_training: {attribute.name} must be a sequence of names, not a string; "
            f"write {attribute.name}=({value!r},)"
        )
    if not isinstance(value, tuple):
        raise TypeError(f"to_training: {attribute.name} must be a sequence of field names, got {value!r}")


def _check(valid: Any, error: type[Exception], message: str):
    """A validator raising ``error(message)`` unless ``valid(value)``; ``message`` may use
    ``{name}`` (the option), ``{value}`` and ``{kind}`` (its type)."""

    def check(spec: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not valid(value):
            raise error(message.format(name=attribute.name, value=value, kind=type(value).__name__))

    return check


def _one_of(*choices: str):
    allowed = " or ".join(repr(c) for c in choices)
    return _check(lambda v: isinstance(v, str) and v in choices, ValueError,
                  f"to_training: {{name}} must be {allowed}, got {{value!r}}")


def _optional_nonnegative_int(tail: str = ""):
    return _check(lambda v: v is None or (_is_int(v) and v >= 0), ValueError,
                  f"to_training: {{name}} must be a nonnegative integer{tail}, got {{value!r}}")


_check_eos_id, _check_pad_id = _optional_nonnegative_int(), _optional_nonnegative_int(" or None")


_check_tokens_field = _check(
    lambda v: isinstance(v, str), TypeError,
    "to_training: tokens_field must be a payload field name or 'auto', got {value!r}",
)
_check_ignore_index = _check(_is_int, ValueError, "to_training: ignore_index must be an integer, got {value!r}")
_check_renames = _check(
    lambda v: isinstance(v, _FrozenDict), TypeError,
    "to_training: rename_fields must be a mapping {{emitted name: new name}}, got {kind}",
)
_check_padding = _check(
    lambda v: v is None or (isinstance(v, str) and v in ("longest", "max_length")), ValueError,
    "to_training: padding must be None/False, 'longest' (or True) or 'max_length', got {value!r}",
)
_check_attention = _check(
    lambda v: v is None or isinstance(v, bool), ValueError,
    "to_training: return_attention_mask must be None, True or False, got {value!r}",
)


@attrs.frozen(kw_only=True)
class TrainingSpec:
    """The options of :func:`~zephon.to_training`, validated once; call it on a batch to convert it.

    ``TrainingSpec(**options)(batch)`` equals ``to_training(batch, **options)``; every option has
    the name, default and meaning documented there. Misuse fails (or warns) where the spec is
    built, and each batch skips the checks.

    Attributes (normalised): ``extra_fields``/``exclude_fields`` are tuples (``extra_fields``
    without repeats); ``rename_fields`` a read-only mapping (empty for ``None``); ``padding``
    ``None``, ``"longest"`` or ``"max_length"``; integer options Python ints; flags other than
    ``return_attention_mask`` bools. The other options are kept as given.

    Raises:
        TypeError, ValueError: an invalid option or combination, as :func:`~zephon.to_training`.

    Examples:
        >>> import numpy as np
        >>> from zephon.types import Meta, Record, SampleBatch, Segment
        >>> spec = TrainingSpec(return_labels=True, padding=True, pad_token_id=0, dtype=None)
        >>> spec.padding, spec.extra_fields
        ('longest', ())
        >>> def doc(row, tokens):
        ...     return Record({"input_ids": np.array(tokens)}, Meta(0, (Segment(0, 0, row, 0, 0, -1),)))
        >>> for batch in [SampleBatch((doc(0, [5, 6, 7]), doc(1, [8, 9]))), SampleBatch((doc(2, [4, 3]),))]:
        ...     print(spec(batch)["labels"])
        [[6, 7], [9, -100]]
        [[3]]
    """

    tokens_field: str = attrs.field(default="auto", validator=_check_tokens_field)
    return_labels: bool = attrs.field(default=False, converter=bool)
    dtype: Any = attrs.field(default="auto")
    extra_fields: tuple[str, ...] = attrs.field(default=(), converter=unique_names, validator=_check_names)
    ignore_index: int = attrs.field(default=-100, converter=_int, validator=_check_ignore_index)
    rename_fields: Mapping[str, str] = attrs.field(default=None, converter=_renames, validator=_check_renames)
    flatten: bool = attrs.field(default=False, converter=bool)
    exclude_fields: tuple[str, ...] = attrs.field(default=(), converter=unique_names, validator=_check_names)
    return_num_valid_tokens: bool = attrs.field(default=False, converter=bool)
    return_loss_mask: bool = attrs.field(default=False, converter=bool)
    return_cu_seqlens: bool = attrs.field(default=False, converter=bool)
    return_padding_mask: bool = attrs.field(default=False, converter=bool)
    eos_mask_loss: bool = attrs.field(default=False, converter=bool)
    eos_token_id: int | None = attrs.field(default=None, converter=_int, validator=_check_eos_id)
    position_mode: str = attrs.field(default="preserve", validator=_one_of("preserve", "sequence"))
    shift_labels: bool = attrs.field(default=True, converter=bool)
    padding: str | None = attrs.field(default=None, converter=_padding, validator=_check_padding)
    max_length: int | None = attrs.field(default=None, converter=_int)
    pad_to_multiple_of: int | None = attrs.field(default=None, converter=_int)
    padding_side: str = attrs.field(default="right", validator=_one_of("right", "left"))
    pad_token_id: int | None = attrs.field(default=None, converter=_int, validator=_check_pad_id)
    return_attention_mask: bool | None = attrs.field(default=None, validator=_check_attention)
    return_document_ids: bool = attrs.field(default=False, converter=bool)
    context_parallel: tuple[int, int] | None = attrs.field(default=None, converter=cp.as_pair)
    context_parallel_format: str = attrs.field(default="bshd")
    load_balance: bool = attrs.field(default=True, converter=bool)
    # Derived from dtype when the spec is built ("auto" looks for torch once, not per batch).
    _output: _Output = attrs.field(
        init=False, default=attrs.Factory(lambda spec: _Output.of(spec.dtype), takes_self=True), repr=False, eq=False
    )

    def __attrs_post_init__(self) -> None:
        for flag in ("return_loss_mask", "return_num_valid_tokens", "eos_mask_loss"):
            if getattr(self, flag) and not self.return_labels:
                raise ValueError(f"to_training: {flag} requires return_labels=True (it describes the labels)")
        if not self.shift_labels and not self.return_labels:
            raise ValueError("to_training: shift_labels=False only applies to labels; pass return_labels=True with it")
        if self.eos_mask_loss and self.eos_token_id is None:
            raise ValueError(
                "to_training: eos_mask_loss requires an explicit eos_token_id (the tokenizer's EOS id), "
                "e.g. eos_mask_loss=True, eos_token_id=tokenizer.eos_token_id"
            )
        if self.padding == "max_length":
            if not (_is_int(self.max_length) and self.max_length >= 1):
                raise ValueError(
                    "to_training: padding='max_length' requires max_length, a positive integer; "
                    f"got {self.max_length!r}"
                )
        elif self.max_length is not None:
            raise ValueError(
                "to_training: max_length is only used with padding='max_length'; pass both, or drop max_length "
                "(padding='longest' pads to the longest record)"
            )
        if self.pad_to_multiple_of is not None:
            if not _is_int(self.pad_to_multiple_of) or self.pad_to_multiple_of < 1:
                raise ValueError(
                    f"to_training: pad_to_multiple_of must be a positive integer, got {self.pad_to_multiple_of!r}"
                )
            if self.padding is None:
                raise ValueError(
                    "to_training: pad_to_multiple_of needs padding; pass padding='longest' (or 'max_length') with it"
                )
        cp.check_options(self)
        self._check_extra_fields()
        if self.eos_token_id is not None and not self.eos_mask_loss:
            _warn_at_caller(
                "to_training: eos_token_id is ignored without eos_mask_loss=True; pass eos_mask_loss=True "
                "to mask predictions made from EOS, or drop eos_token_id"
            )

    def _check_extra_fields(self) -> None:
        generated = {"ids", "texts", "input_ids"} | ({"labels"} if self.return_labels else set())
        cu = (self.return_cu_seqlens, "return_cu_seqlens=True")
        flagged = {
            "padding_mask": (self.return_padding_mask, "return_padding_mask=True"),
            "attention_mask": (
                self.emit_attention, "an attention mask (padding requested or return_attention_mask=True)"
            ),
            "cu_seqlens": cu,
            "max_seqlen": cu,
            "num_valid_tokens": (self.return_num_valid_tokens, "return_num_valid_tokens=True"),
            "document_ids": (self.return_document_ids, "return_document_ids=True"),
            "cu_seqlens_padded": (self._thd, "context_parallel_format='thd'"),
        }
        for name in self.extra_fields:
            if name in generated:
                raise ValueError(
                    f"to_training: extra_fields cannot overwrite generated field {name!r}; rename the payload field "
                    "or use rename_fields on the output"
                )
            on, why = flagged.get(name, (False, ""))
            if on:
                raise ValueError(
                    f"to_training: extra_fields cannot include {name!r} with {why}; that output is "
                    "generated"
                )
            if name == "loss_mask" and self.return_labels:
                raise ValueError(
                    "to_training: extra_fields cannot include 'loss_mask' with return_labels=True: extra fields are "
                    "input-aligned, not label-aligned. Use return_loss_mask=True for the label-aligned mask, or "
                    "return_labels=False for the raw mask."
                )

    @property
    def emit_attention(self) -> bool:
        """Whether ``attention_mask`` is emitted: ``return_attention_mask``, else whenever padding is requested."""
        return (self.padding is not None) if self.return_attention_mask is None else self.return_attention_mask

    @property
    def _thd(self) -> bool:
        """Whether rows take TransformerEngine's THD context-parallel layout (documents padded in the row)."""
        return self.context_parallel is not None and self.context_parallel_format == "thd"

    def pad_token_id_for(self, batch: Any) -> int | None:
        """The id written into added padding slots: ``pad_token_id``, else the batch's own (a
        tokenizing pipeline sets it); without padding the batch is not read and it may be ``None``.

        Raises:
            ValueError: padding is requested and neither gives an id, or the batch's id is invalid.
        """
        if self.pad_token_id is not None or (self.padding is None and not self._thd):
            return self.pad_token_id
        pad = getattr(batch, "pad_token_id", None)
        if pad is not None:
            if not _is_int(pad) or pad < 0:
                raise ValueError(
                    f"to_training: the batch's pad_token_id must be a nonnegative integer, got {pad!r}; "
                    "pass pad_token_id= to override it"
                )
            return int(pad)
        why = f"padding={self.padding!r}" if self.padding else "context_parallel_format='thd'"
        raise ValueError(
            f"to_training: {why} requires pad_token_id (the id written into added padding "
            "slots), and neither this call nor the batch (batch.pad_token_id) gives one. There is no default: "
            "id 0 is a real token in most vocabularies ('!' in GPT-2), so padding with it would silently feed "
            "the model a real token. Fix: pass pad_token_id= (e.g. tokenizer.pad_token_id, or "
            "tokenizer.eos_token_id when it has no pad token), or tokenize in the pipeline so that its batches "
            "carry the id."
        )

    def __call__(self, batch: Any) -> dict[str, Any]:
        """Convert ``batch`` as ``to_training(batch, **options)`` does (raising what it raises)."""
        pad_id = self.pad_token_id_for(batch)  # before the empty-batch shortcut: a missing id fails on every batch

        records = batch.records
        if not records:
            flat, cu = self.flatten, self.return_cu_seqlens or self._thd
            optional = (
                ("padding_mask", self.return_padding_mask, []), ("attention_mask", self.emit_attention, []),
                ("positions", self.position_mode == "sequence", []), ("loss_mask", self.return_loss_mask, []),
                ("document_ids", self.return_document_ids, []), ("num_valid_tokens", self.return_num_valid_tokens, 0),
                ("cu_seqlens", cu, [0] if flat else []), ("cu_seqlens_padded", self._thd, [0] if flat else []),
                ("max_seqlen", cu, 0 if flat else []),
            )
            empty = {"ids": [], "texts": [], **{name: value for name, wanted, value in optional if wanted}}
            return _rename_and_exclude(empty, self.rename_fields, self.exclude_fields, allow_missing=True)

        fast = self._packed(records) if self._packed_layout else None
        if fast is not None:
            return fast

        # -- gather rows -----------------------------------------------------------------------------------
        extras = self.extra_fields
        labelled = self.return_labels
        shift = cp.label_shift(self)
        documents = self.return_document_ids or self.context_parallel is not None
        need_positions = (
            self.return_cu_seqlens or self.position_mode == "preserve" or "positions" in extras or documents
        )
        rows = _gather(records, self.tokens_field, extras, need_positions=need_positions)
        if self.return_cu_seqlens and rows.positions is None:
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
        if self.padding is None:
            if B > 1 and (n != n[0]).any():
                j = int(np.flatnonzero(n != n[0])[0])
                raise ValueError(
                    f"to_training: records have different lengths (record 0: {int(n[0])} tokens, record {j}: "
                    f"{int(n[j])} tokens); pass padding='longest' to pad them to the longest record "
                    "(or padding='max_length', max_length=N)"
                )
            T = int(n[0])
        else:
            if self.padding == "longest":
                T = int(n.max())
            else:
                over = np.flatnonzero(n > self.max_length)
                if over.size:
                    i = int(over[0])
                    raise ValueError(
                        f"to_training: record {i} has {int(n[i])} tokens, more than max_length={self.max_length}; "
                        "padding never truncates: raise max_length, use padding='longest', or cut records upstream"
                    )
                T = self.max_length
            if self.pad_to_multiple_of:  # round the length the model sees (T - shift)
                T = -(-(T - shift) // self.pad_to_multiple_of) * self.pad_to_multiple_of + shift
        left = (T - n) if self.padding_side == "left" else np.zeros(B, dtype=np.int64)
        padded = bool((n != T).any())
        cols = np.arange(T, dtype=np.int64)
        stop = left + n
        every_real = not padded and not pad_len.any()  # the usual packed batch: full rows, no padding
        if every_real:
            real = np.ones((B, T), dtype=np.bool_)
        else:
            real = (cols >= left[:, None]) & (cols < (stop - pad_len)[:, None])  # real tokens, by position

        # Without requested padding every row already has length T, so no slot takes the fill value.
        tok = _fill(rows.tokens, B, T, left, 0 if pad_id is None else pad_id, np.int64)
        pos = _fill(rows.positions, B, T, left, 0, np.int64) if rows.positions is not None else None
        mask = _fill(rows.loss_mask, B, T, left, 0, np.bool_) if rows.loss_mask is not None else None
        if self.return_cu_seqlens:
            first = np.fromiter((p[0] if len(p) else 0 for p in rows.positions), dtype=np.int64, count=B)
            if (first != 0).any():
                i = int(np.flatnonzero(first != 0)[0])
                raise ValueError(
                    f"to_training: record {i}: positions must start at zero (got {int(first[i])}), because "
                    "document starts are the zeros of positions; use pack_flat(emit_positions=True)"
                )

        # -- labels (computed on the full row, then shifted views) ------------------------------------------
        W = max(T - shift, 0)  # input-aligned width
        fields: dict[str, tuple[np.ndarray, str]] = {}  # name -> (array, kind), in output order
        if self.return_padding_mask:
            fields["padding_mask"] = (~real[:, :W], "bool")
        fields["input_ids"] = (tok[:, :W], "seq")
        labels = None
        if labelled:
            # Label t (shifted) is the target row[t + 1] predicted from input row[t]: both must be real tokens.
            if every_real and mask is None and not self.eos_mask_loss:
                shifted = tok[:, 1:].copy()  # every label is a real target
            else:
                valid = real[:, 1:] & real[:, :-1]
                if mask is not None:
                    valid &= mask[:, 1:]
                if self.eos_mask_loss:
                    valid &= tok[:, :-1] != self.eos_token_id
                shifted = np.where(valid, tok[:, 1:], np.int64(self.ignore_index))
            if self.shift_labels:
                labels = shifted
            else:
                labels = np.empty((B, T), dtype=np.int64)
                labels[:, :1] = self.ignore_index
                labels[:, 1:] = shifted
            fields["labels"] = (labels, "seq")
        if self.emit_attention:
            fields["attention_mask"] = (real[:, :W], "seq")

        positions_out = pos[:, :W] if pos is not None else None
        if self.position_mode == "sequence":
            positions_out = cols[None, :W] - left[:, None]
            if padded:
                positions_out[(positions_out < 0) | (positions_out >= n[:, None])] = 0
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

        if self.return_loss_mask:
            fields["loss_mask"] = (labels != self.ignore_index, "float")
        elif mask is not None and not labelled and "loss_mask" not in fields:
            fields["loss_mask"] = (mask, "seq")  # the raw payload mask, unshifted, as 0/1

        doc = None
        if documents:  # documents start at the zeros of positions; a record without positions is one document
            starts = pos[:, :W] == 0 if pos is not None else np.zeros((B, W), dtype=np.bool_)
            doc = cp.document_ids(starts, real[:, :W], self.flatten)
            if self.return_document_ids:
                fields["document_ids"] = (doc, "int")

        # -- boundaries for variable-length attention ----------------------------------------------------
        cu = None
        if self.return_cu_seqlens:
            seg = pos
            if padded:
                # Added padding blocks count up from 0, so each block is a segment of its own.
                in_record = (cols >= left[:, None]) & (cols < stop[:, None])
                block = np.where(cols < left[:, None], cols, cols - stop[:, None])
                seg = np.where(in_record, pos, block)
            cu = _cu_seqlens(seg[:, :W] == 0, self.flatten)
        if self.context_parallel is not None:  # this rank's slice; "bshd" keeps the full row's cu_seqlens
            fields, thd_cu = cp.split(fields, doc, self, pad_id)
            labels = fields["labels"][0] if labelled else None
            cu = thd_cu if thd_cu is not None else cu

        # -- assemble: ids are the (dataset, shard, row) of every segment of every record
        out = self._output
        result: dict[str, Any] = {"ids": [[tuple(s[:3]) for s in r.meta.segments] for r in records]}
        result["texts"] = rows.texts
        segments = _segments(records, self.tokens_field, n, pad_len, left)
        if segments is not None:
            result["segments"] = segments
        for name, (arr, kind) in fields.items():
            if self.flatten:
                arr = arr.reshape(-1)
            result[name] = out.convert(arr, kind, name)
        if self.return_num_valid_tokens:
            result["num_valid_tokens"] = int(np.count_nonzero(labels != self.ignore_index))
        if cu is not None:
            *bounds, top = cu
            for name, bound in zip(("cu_seqlens", "cu_seqlens_padded"), bounds):
                result[name] = out.wrap(bound)
            result["max_seqlen"] = top if self.flatten else out.wrap(top)
        return _rename_and_exclude(result, self.rename_fields, self.exclude_fields, allow_missing=False)

    @property
    def _packed_layout(self) -> bool:
        """Whether these options convert a batch of full packed rows to plain shifted ids, labels and
        positions (the pretraining recipe), which :meth:`_packed` does with fewer copies."""
        return (
            self.padding is None and self.return_labels and self.shift_labels and not self.eos_mask_loss
            and not self.return_padding_mask and not self.emit_attention and self.position_mode == "preserve"
            and not self.extra_fields and not self.return_loss_mask and not self.return_cu_seqlens
            and not self.return_num_valid_tokens and not self.flatten
            and self._output.kind != "list" and self._output.np_dtype == np.int64
            and not self.return_document_ids and self.context_parallel is None
        )

    def _packed(self, records: Sequence[Any]) -> dict[str, Any] | None:
        """The output for records that are full rows of integer ids (and ``positions``) with nothing
        else and no padding, written straight into the shifted ``[B, T - 1]`` arrays; ``None`` for
        any other batch (the general path then checks it and names what is wrong)."""
        first = records[0].payload
        if type(first) is not dict:
            return None
        field = self.tokens_field
        if field == "auto":
            field = next((name for name in TOKEN_FIELDS if name in first), "")
        ids0 = first.get(field)
        has_positions = "positions" in first
        if type(ids0) is not np.ndarray or ids0.ndim != 1 or len(first) != 1 + has_positions or len(ids0) < 2:
            return None
        B, T = len(records), len(ids0)
        W = T - 1
        inputs = np.empty((B, W), dtype=np.int64)
        labels = np.empty((B, W), dtype=np.int64)
        positions = np.empty((B, W), dtype=np.int64) if has_positions else None
        for i, rec in enumerate(records):
            p = rec.payload
            if type(p) is not dict or len(p) != len(first) or rec.meta.padding_length:
                return None
            ids = p.get(field)
            if type(ids) is not np.ndarray or ids.shape != (T,) or ids.dtype.kind not in "iu":
                return None
            inputs[i] = ids[:W]
            labels[i] = ids[1:]
            if positions is not None:
                pos = p.get("positions")
                if type(pos) is not np.ndarray or pos.shape != (T,) or pos.dtype.kind not in "iu":
                    return None
                positions[i] = pos[:W]
        out = self._output
        result: dict[str, Any] = {
            "ids": [[tuple(s[:3]) for s in r.meta.segments] for r in records],
            "texts": [""] * B,
            "input_ids": out.convert(inputs, "seq", "input_ids"),
            "labels": out.convert(labels, "seq", "labels"),
        }
        if positions is not None:
            result["positions"] = out.convert(positions, "seq", "positions")
        return _rename_and_exclude(result, self.rename_fields, self.exclude_fields, allow_missing=False)


class _FrozenDict(Mapping):
    """A read-only, hashable, picklable copy of a mapping (``rename_fields``)."""

    def __init__(self, items: Mapping[Any, Any]):
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _warn_at_caller(message: str) -> None:
    """Warn at the first frame outside this package and attrs: ``to_training`` is reached by many
    paths (``SampleBatch.to_training``, a spec, ``attrs.evolve``), so no fixed stacklevel fits."""
    level = 1
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL_PACKAGES:
        frame = frame.f_back
        level += 1
    del frame  # do not keep the stack alive
    warnings.warn(message, UserWarning, stacklevel=level)
