"""Grouping records into lane-pure microbatches: a fixed number of rows, or a token budget
(``docs/design/token-budget.md``). Every mode holds records by reference and counts rows, real
tokens and padded slots for ``stats()``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

import attrs
import msgspec

from ..core.operator import Operator, Resolver, config_field, nonnegative, positive_int
from ..core.state import decode, resolve
from ..core.keys import fold_in, randbelow
from ..training.fields import TOKEN_FIELDS, payload_length
from ..core.records import Meta, Record, SampleBatch, describe_meta
from .lengths import rows_per_microbatch

#: What a token budget does with a record that cannot fit a microbatch on its own.
OVERSIZED = ("error", "drop")
#: The settings of token-budget batching, left out of the fingerprint of fixed-size batching.
_BUDGET_SETTINGS = ("max_tokens", "sort_window", "pad_to_multiple_of", "oversized")
#: The settings of fixed-size batching, left out of the fingerprint of token-budget batching.
_FIXED_SETTINGS = ("microbatch_size", "group_by_length", "buffer_size")


class BatchState(msgspec.Struct, frozen=True, tag="batch", forbid_unknown_fields=True):
    """Counters and, by reference, ``partial``: the open batch, or the window being filled
    (``group_by_length``, ``sort_window``)."""

    key: int = 0
    partial: tuple[Record, ...] = ()
    batches: int = 0
    dropped_records: int = 0
    dropped_tokens: int = 0
    real_tokens: int = 0
    slots: int = 0
    rows: int = 0
    oversized_records: int = 0
    oversized_tokens: int = 0


def record_length(rec: Record, where: str = "batch") -> int:
    """Tokens in a record (its token field, or its first dimension for a bare array)."""
    return payload_length(rec.payload, where)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _has_tokens(records: Sequence[Record]) -> bool:
    p = records[0].payload if records else None
    return isinstance(p, dict) and any(k in p for k in TOKEN_FIELDS)


def _real_tokens(records: Sequence[Record]) -> int:
    if not _has_tokens(records):
        return 0
    return sum(record_length(r) - r.meta.padding_length for r in records)


def cut_by_budget(widths: Sequence[int], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy microbatches of rows with these padded widths, in order: ``(closed, open)`` index lists.

    A row joins the open microbatch unless ``(rows + 1) x max(width)`` would exceed ``max_tokens``,
    else it starts the next. A microbatch also closes as soon as one more row of its width would
    not fit, so ``open`` is one another row could still join. Every width is within the budget.

    Examples:
        >>> cut_by_budget([3, 3, 4, 2, 8], 8)
        ([[0, 1], [2, 3], [4]], [])
        >>> cut_by_budget([1, 2, 2], 8)
        ([], [0, 1, 2])
    """
    closed, current, width = [], [], 0
    for i, w in enumerate(widths):
        if current and (len(current) + 1) * max(width, w) > max_tokens:
            closed.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, w)
        if (len(current) + 1) * width > max_tokens:
            closed.append(current)
            current, width = [], 0
    return closed, current


@attrs.frozen
class Batch(Operator):
    """Group each lane's records into :class:`~zephon.types.SampleBatch` es: ``microbatch_size`` rows each,
    or as many rows as fit a token budget (``max_tokens``).

    Args:
        microbatch_size: records per batch (exclusive with ``max_tokens``).
        drop_last: drop (and count in ``stats()``) a last batch the end of data closed: short of
            ``microbatch_size``, or one the budget did not close. Only the end can be short.
        group_by_length: sort ``buffer_size`` records by length and emit their batches in an
            order drawn from the key (less padding, no length curriculum).
        buffer_size: records sorted together when grouping (default ``64 * microbatch_size``).
        max_tokens: the token budget of a microbatch: rows x its longest row (rounded up to
            ``pad_to_multiple_of``; at least one slot) never exceeds it.
        sort_window: with ``max_tokens``: sort ``sort_window`` records at a time by length and
            emit the window's microbatches in a drawn order; ``0`` (default): arrival order.
        pad_to_multiple_of: with ``max_tokens``: the width the budget counts is the longest row
            rounded up to this (pass the same to ``to_training``).
        oversized: with ``max_tokens``, a record wider than the budget on its own: ``"error"``
            (default; the message names the record) or ``"drop"`` (counted in ``stats()``).
        tokens_per_microbatch: training tokens per microbatch of ``pack_flat`` rows: ``T / (length
            - 1)`` rows of ``length`` tokens (required with a :class:`~zephon.LengthSchedule`).
            Exclusive with ``microbatch_size`` and ``max_tokens``.
        pad_token_id: stamped on each batch for ``to_training``'s dynamic padding (the pipeline
            fills it from the tokenizer's pad, else EOS); it never changes the batches.

    Records are held whole, every payload field kept. The batches depend only on the lane's
    records, the settings and the key (not on chunking, workers or ranks); a restore resumes them
    exactly. State: the waiting records by reference, a key (grouping order), counters.
    """

    microbatch_size: int | None = config_field(default=None, validator=attrs.validators.optional(positive_int))
    drop_last: bool = config_field(default=True)
    group_by_length: bool = config_field(default=False)
    buffer_size: int | None = config_field(default=None, validator=attrs.validators.optional(positive_int))
    max_tokens: int | None = config_field(default=None, kw_only=True, validator=attrs.validators.optional(positive_int))
    sort_window: int = config_field(default=0, kw_only=True)
    pad_to_multiple_of: int | None = config_field(
        default=None, kw_only=True, validator=attrs.validators.optional(positive_int)
    )
    oversized: Literal["error", "drop"] = config_field(default="error", kw_only=True)
    tokens_per_microbatch: int | None = config_field(
        default=None, kw_only=True, omit_default=True, validator=attrs.validators.optional(positive_int)
    )
    pad_token_id: int | None = config_field(default=None, data=False, kw_only=True)

    kind: ClassVar[str] = "batch"
    state_type: ClassVar[type] = BatchState

    def __attrs_post_init__(self) -> None:
        if self.tokens_per_microbatch is not None:
            self._check_tokens()
            return
        if self.max_tokens is not None:
            self._check_budget()
            return
        if self.microbatch_size is None:
            raise ValueError(
                "batch: pass microbatch_size (records per microbatch, e.g. batch(8)) or max_tokens (a token budget "
                "per microbatch, e.g. batch(max_tokens=8192))"
            )
        given = self._given(_BUDGET_SETTINGS[1:])
        if given:
            raise ValueError(f"batch: {', '.join(given)} only apply with max_tokens; pass max_tokens=N with them")
        if self.buffer_size is not None and not self.group_by_length:
            raise ValueError("batch: buffer_size only applies with group_by_length=True")
        if self.group_by_length and self.window % self.microbatch_size:
            raise ValueError(
                f"batch: buffer_size={self.window} must be a multiple of microbatch_size={self.microbatch_size} "
                "so that every group fills whole batches"
            )

    def _check_tokens(self) -> None:
        T = self.tokens_per_microbatch
        for name in ("microbatch_size", "max_tokens"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"batch: {name}={getattr(self, name)} and tokens_per_microbatch={T} exclude each other: "
                    "tokens_per_microbatch sets the rows of each microbatch (T / (row length - 1)); pass one"
                )
        given = self._given((*_BUDGET_SETTINGS[1:], *_FIXED_SETTINGS[1:]))
        if given:
            raise ValueError(
                f"batch: {', '.join(given)} do not apply with tokens_per_microbatch (rows in arrival order, "
                "T / (row length - 1) per microbatch); leave them out"
            )

    def _given(self, names: Sequence[str]) -> list[str]:
        """The settings among ``names`` passed with other than their default."""
        defaults = attrs.fields_dict(Batch)
        return [n for n in names if getattr(self, n) != defaults[n].default]

    def rows_for(self, rec: Record) -> int:
        """With ``tokens_per_microbatch``: the rows of a microbatch that starts with ``rec``."""
        n = record_length(rec, "batch: tokens_per_microbatch")
        return rows_per_microbatch(n, self.tokens_per_microbatch, f"{n} tokens ({describe_meta(rec.meta)})")

    def _step_tokens(self, state: BatchState, chunk: Sequence[Record]) -> tuple[BatchState, list[SampleBatch]]:
        partial = list(state.partial)
        out: list[SampleBatch] = []
        for rec in chunk:
            if partial and record_length(rec) != record_length(partial[0]):
                raise ValueError(
                    f"batch: tokens_per_microbatch={self.tokens_per_microbatch}: row {describe_meta(rec.meta)} has "
                    f"{record_length(rec)} tokens but its microbatch started with a row of "
                    f"{record_length(partial[0])}; "
                    "the rows of one microbatch share a length: put pack_flat directly before batch"
                )
            partial.append(rec)
            if len(partial) == self.rows_for(partial[0]):
                out.append(self._batch(partial))
                partial = []
        return self._advance(state, tuple(partial), out), out

    def _check_budget(self) -> None:
        if self.microbatch_size is not None:
            raise ValueError(
                f"batch: microbatch_size={self.microbatch_size} and max_tokens={self.max_tokens} exclude each other: a "
                "token budget decides the rows of each microbatch. Pass one: batch(microbatch_size) for a fixed number "
                "of rows, or batch(max_tokens=N) for microbatches of at most N padded tokens"
            )
        if self.group_by_length or self.buffer_size is not None:
            raise ValueError(
                "batch: group_by_length and buffer_size belong to fixed-size batches; with max_tokens, sort by length "
                "with sort_window=k (records sorted together)"
            )
        if isinstance(self.sort_window, bool) or not isinstance(self.sort_window, int) or self.sort_window < 0:
            raise ValueError(f"batch: sort_window must be an int >= 0 (0: no sorting), got {self.sort_window!r}")
        if self.oversized not in OVERSIZED:
            choices = ", ".join(map(repr, OVERSIZED))
            raise ValueError(f"batch: oversized must be one of {choices}, got {self.oversized!r}")
        if self.multiple > self.max_tokens:
            raise ValueError(
                f"batch: pad_to_multiple_of={self.pad_to_multiple_of} exceeds max_tokens={self.max_tokens}, so no "
                "record fits a microbatch; lower pad_to_multiple_of or raise max_tokens"
            )

    @property
    def window(self) -> int:
        """Records collected before cutting: the sort window, the grouping buffer, or one batch."""
        if self.max_tokens is not None:
            return self.sort_window
        if self.group_by_length:
            return self.buffer_size if self.buffer_size is not None else 64 * self.microbatch_size
        return self.microbatch_size

    @property
    def multiple(self) -> int:
        return self.pad_to_multiple_of or 1

    def width(self, rec: Record) -> int:
        """Slots a record takes per row of a token-budget microbatch: its length rounded up, at least 1."""
        return max(1, round_up(record_length(rec, "batch: max_tokens"), self.multiple))

    def init(self, key: int) -> BatchState:
        return BatchState(key=fold_in(key, "group"))

    def fingerprint(self) -> dict[str, Any]:
        """The settings of the mode in use: fixed-size batching keeps the fingerprint it always had;
        a token budget leaves out the fixed-size settings (which it refuses)."""
        out = super().fingerprint()
        if self.tokens_per_microbatch is not None:
            unused = (*_BUDGET_SETTINGS, *_FIXED_SETTINGS)
        else:
            unused = _BUDGET_SETTINGS if self.max_tokens is None else _FIXED_SETTINGS
        for name in unused:
            del out[name]
        return out

    def step(self, state: BatchState, chunk: Sequence[Record]) -> tuple[BatchState, list[SampleBatch]]:
        if self.tokens_per_microbatch is not None:
            return self._step_tokens(state, chunk)
        kept, over = chunk, []
        if self.max_tokens is not None:
            kept = []
            for rec in chunk:
                (over if self.width(rec) > self.max_tokens else kept).append(rec)
            if over:
                self._oversized(over[0])
        if self.max_tokens is not None and not self.sort_window:
            # The open microbatch was cut by the same rule from its first record, so cutting it
            # again with the new records continues exactly where the last chunk stopped.
            records = [*state.partial, *kept]
            closed, tail = cut_by_budget([self.width(r) for r in records], self.max_tokens)
            out = [self._batch([records[i] for i in group]) for group in closed]
            partial = [records[i] for i in tail]
        else:
            partial, out, size = list(state.partial), [], self.window
            for rec in kept:
                partial.append(rec)
                if len(partial) == size:
                    out.extend(self._emit(state, partial, len(out)))
                    partial = []
        state = self._advance(state, tuple(partial), out)
        if over:
            tokens = sum(record_length(r) - r.meta.padding_length for r in over)
            state = msgspec.structs.replace(
                state,
                oversized_records=state.oversized_records + len(over),
                oversized_tokens=state.oversized_tokens + tokens,
            )
        return state, out

    def _oversized(self, rec: Record) -> None:
        if self.oversized == "drop":
            return
        n = record_length(rec)
        rounded = ""
        if self.multiple > 1:
            rounded = f" ({self.width(rec)} slots after pad_to_multiple_of={self.pad_to_multiple_of})"
        raise ValueError(
            f"batch: {describe_meta(rec.meta)} has {n} tokens{rounded}, more than max_tokens={self.max_tokens}, so it "
            "cannot fit a microbatch even alone. Raise max_tokens, cut long records upstream (tokenize(..., "
            "max_length=N, truncation=True) or split_long_samples=True), or pass batch(..., oversized='drop') to "
            "drop such records (counted in stats()['dropped'])"
        )

    def flush(self, state: BatchState) -> tuple[BatchState, list[SampleBatch]]:
        """The end of data: the open batch or window, less what ``drop_last`` drops: a short
        batch, or with a token budget a last microbatch the budget did not close."""
        if not state.partial:
            return state, []
        records = list(state.partial)
        if self.max_tokens is not None:
            groups, dropped = self._cut_window(records) if self.sort_window else ([], records)
            if dropped and not self.drop_last:
                groups, dropped = groups + [dropped], []
            out = self._drawn(state, groups, 0)
        elif self.tokens_per_microbatch is not None:
            out, dropped = ([], records) if self.drop_last else ([self._batch(records)], [])
        else:
            keep = len(records) - len(records) % self.microbatch_size if self.drop_last else len(records)
            out = self._emit(state, records[:keep], 0) if keep else []
            dropped = records[keep:]
        state = self._advance(state, (), out)
        changes = {
            "dropped_records": state.dropped_records + len(dropped),
            "dropped_tokens": state.dropped_tokens + _real_tokens(dropped),
        }
        return msgspec.structs.replace(state, **changes), out

    def _cut_window(self, records: list[Record]) -> tuple[list[list[Record]], list[Record]]:
        """A window sorted by (length, record id, arrival) and cut by the budget: ``(closed, open)``."""
        order = sorted(range(len(records)), key=lambda i: (record_length(records[i]), records[i].meta.segments, i))
        closed, tail = cut_by_budget([self.width(records[i]) for i in order], self.max_tokens)
        return [[records[order[j]] for j in group] for group in closed], [records[order[j]] for j in tail]

    def _batch(self, records: Sequence[Record]) -> SampleBatch:
        return SampleBatch(tuple(records), self.pad_token_id)

    def _drawn(self, state: BatchState, groups: list, already: int) -> list[SampleBatch]:
        """``groups`` as batches in an order drawn from the key (counter = batches emitted before)
        when they were sorted by length; in their own order otherwise."""
        if not (self.group_by_length or self.sort_window):
            return [self._batch(g) for g in groups]
        groups, out, first = [tuple(g) for g in groups], [], state.batches + already
        for counter in range(first, first + len(groups)):
            out.append(self._batch(groups.pop(randbelow(state.key, counter, len(groups)))))
        return out

    def _emit(self, state: BatchState, records: list[Record], already: int) -> list[SampleBatch]:
        """The batches of a full window (or the end's records): cut by the budget, or by size."""
        if self.max_tokens is not None:
            closed, tail = self._cut_window(records)
            return self._drawn(state, closed + ([tail] if tail else []), already)
        mbs = self.microbatch_size
        if not self.group_by_length:
            return [self._batch(records[i : i + mbs]) for i in range(0, len(records), mbs)]
        order = sorted(range(len(records)), key=lambda i: (record_length(records[i], "batch: group_by_length"), i))
        groups = [[records[j] for j in order[i : i + mbs]] for i in range(0, len(order), mbs)]
        return self._drawn(state, groups, already)

    def _advance(self, state: BatchState, partial: tuple, out: list[SampleBatch]) -> BatchState:
        real = slots = rows = 0
        for b in out:
            rows += len(b.records)
            if _has_tokens(b.records):
                lengths = [record_length(r) for r in b.records]
                real += sum(n - r.meta.padding_length for n, r in zip(lengths, b.records))
                slots += len(lengths) * round_up(max(lengths), self.multiple)
        return msgspec.structs.replace(
            state, partial=partial, batches=state.batches + len(out), real_tokens=state.real_tokens + real,
            slots=state.slots + slots, rows=state.rows + rows,
        )

    def decode_state(self, data: Any, upstream: Resolver) -> BatchState:
        """Inverse of ``encode_state``, refusing negative counters and waiting records ``step`` never leaves.

        ``step`` emits as soon as ``microbatch_size`` records wait (the window size when grouping or
        sorting), so fewer wait in any state; with a token budget in arrival order the open batch
        could still take a row. Checked before any record is rebuilt, the budget after.
        """
        state = decode(data, BatchState)
        counters = ("batches", "dropped_records", "dropped_tokens", "real_tokens", "slots", "rows")
        nonnegative(state, counters + ("oversized_records", "oversized_tokens"))
        if self.tokens_per_microbatch is not None:
            state = resolve(state, upstream)
            if state.partial:
                lengths = {record_length(r) for r in state.partial}
                rows = self.rows_for(state.partial[0])
                if len(lengths) > 1 or len(state.partial) >= rows:
                    raise ValueError(
                        f"field 'partial' holds {len(state.partial)} rows of lengths {sorted(lengths)}, but an open "
                        f"microbatch holds fewer than {rows} rows of one length (tokens_per_microbatch="
                        f"{self.tokens_per_microbatch})"
                    )
            return state
        size = self.window or self.max_tokens
        if len(state.partial) >= size:
            raise ValueError(f"field 'partial' holds {len(state.partial)} records, but a batch is emitted as soon as {size} wait")
        state = resolve(state, upstream)
        if self.max_tokens is not None and not self.sort_window and state.partial:
            width = max(self.width(r) for r in state.partial)
            if (len(state.partial) + 1) * width > self.max_tokens:
                raise ValueError(
                    f"field 'partial' holds {len(state.partial)} records of width {width}, a microbatch that "
                    f"max_tokens={self.max_tokens} has closed already"
                )
        return state

    def rebuild(self, refs: Sequence[Any], upstream: Resolver) -> list[SampleBatch]:
        modes = ("tokens_per_microbatch", "max_tokens", "microbatch_size")
        name = next(n for n in modes if getattr(self, n) is not None)
        most = getattr(self, name)
        for ref in refs:
            if not 0 < len(ref) <= most:
                raise ValueError(f"a batch reference holds {len(ref)} records; batches hold 1 to {name}={most}")
        flat: list[Meta] = [m for ref in refs for m in ref]
        records = iter(upstream(flat))
        return [SampleBatch(tuple(next(records) for _ in ref), self.pad_token_id) for ref in refs]

    def report(self, state: BatchState) -> dict[str, int]:
        """Counters: microbatches, their rows, real tokens and padded slots (rows x longest row, rounded
        up to ``pad_to_multiple_of``), the end's drops and, with ``max_tokens``, the budget's slots and
        the records dropped as oversized."""
        out = {
            "batches": state.batches,
            "rows": state.rows,
            "dropped_records_at_end": state.dropped_records,
            "dropped_tokens_at_end": state.dropped_tokens,
            "real_tokens": state.real_tokens,
            "padded_slots": state.slots,
        }
        if self.max_tokens is not None:
            out["budget_slots"] = state.batches * self.max_tokens
            out["dropped_oversized_records"] = state.oversized_records
            out["dropped_oversized_tokens"] = state.oversized_tokens
        return out
