"""Grouping records into lane-pure microbatches, optionally grouped by length.

``batch(microbatch_size)`` cuts each lane's stream into batches in arrival order.
``batch(microbatch_size, group_by_length=True, buffer_size=N)`` collects ``N`` records, sorts
them by length (ties by arrival), cuts batches of similar lengths and emits them in a
pseudo-random order drawn from the operator's key, which cuts padding for ragged records (the
``group_by_length`` of Hugging Face trainers) without a length curriculum. Both keep their
records by reference, and count real tokens and padded slots so ``stats()`` reports waste.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import attrs
import msgspec

from ..core.operator import Operator, Resolver, config_field, nonnegative, positive_int
from ..core.state import decode, resolve
from ..core.keys import fold_in, randbelow
from ..training.fields import TOKEN_FIELDS, payload_length
from ..core.records import Meta, Record, SampleBatch


class BatchState(msgspec.Struct, frozen=True, tag="batch", forbid_unknown_fields=True):
    """Records waiting for a batch (by reference) and counters."""

    key: int = 0
    partial: tuple[Record, ...] = ()
    batches: int = 0
    dropped_records: int = 0
    dropped_tokens: int = 0
    real_tokens: int = 0
    slots: int = 0


def record_length(rec: Record) -> int:
    """Tokens in a record (its token field, or its first dimension for a bare array)."""
    return payload_length(rec.payload, "batch: group_by_length")


def _has_tokens(records: Sequence[Record]) -> bool:
    p = records[0].payload if records else None
    return isinstance(p, dict) and any(k in p for k in TOKEN_FIELDS)


def _real_tokens(records: Sequence[Record]) -> int:
    if not _has_tokens(records):
        return 0
    return sum(record_length(r) - r.meta.padding_length for r in records)


@attrs.frozen
class Batch(Operator):
    """Group each lane's records into :class:`~zephon.types.SampleBatch` of ``microbatch_size``.

    Args:
        microbatch_size: records per batch.
        drop_last: at the end of data, drop a short final batch (counted in ``stats()``)
            instead of emitting it. There are no mid-stream flushes: only the end can be short.
        group_by_length: batch records of similar length together (see the module docstring).
        buffer_size: records sorted together when grouping (default ``64 * microbatch_size``).
        pad_token_id: stamped on each :class:`~zephon.types.SampleBatch` for ``to_training``'s
            dynamic padding; ``Pipeline.batch`` fills it from the pipeline's tokenizer (its pad
            token, else its EOS). It never changes which records form a batch.

    Records are held whole, every payload field kept (scalars, strings, arrays of any shape);
    ``to_training`` lists the fields that are not token-aligned per record in ``segments``.

    State: the waiting records, by reference; a key (grouping order); counters.
    """

    microbatch_size: int = config_field(validator=positive_int)
    drop_last: bool = config_field(default=True)
    group_by_length: bool = config_field(default=False)
    buffer_size: int | None = config_field(default=None, validator=attrs.validators.optional(positive_int))
    pad_token_id: int | None = config_field(default=None, data=False, kw_only=True)

    kind: ClassVar[str] = "batch"
    state_type: ClassVar[type] = BatchState

    def __attrs_post_init__(self) -> None:
        if self.buffer_size is not None and not self.group_by_length:
            raise ValueError("batch: buffer_size only applies with group_by_length=True")
        if self.group_by_length and self.window % self.microbatch_size:
            raise ValueError(
                f"batch: buffer_size={self.window} must be a multiple of microbatch_size={self.microbatch_size} "
                "so that every group fills whole batches"
            )

    @property
    def window(self) -> int:
        return self.buffer_size if self.buffer_size is not None else 64 * self.microbatch_size

    def init(self, key: int) -> BatchState:
        return BatchState(key=fold_in(key, "group"))

    def step(self, state: BatchState, chunk: Sequence[Record]) -> tuple[BatchState, list[SampleBatch]]:
        partial = list(state.partial)
        size = self.window if self.group_by_length else self.microbatch_size
        out: list[SampleBatch] = []
        for rec in chunk:
            partial.append(rec)
            if len(partial) == size:
                out.extend(self._emit(state, partial, len(out)))
                partial = []
        return self._advance(state, tuple(partial), out), out

    def flush(self, state: BatchState) -> tuple[BatchState, list[SampleBatch]]:
        if not state.partial:
            return state, []
        records = list(state.partial)
        keep = len(records) - len(records) % self.microbatch_size if self.drop_last else len(records)
        out = self._emit(state, records[:keep], 0) if keep else []
        state = self._advance(state, (), out)
        dropped = records[keep:]
        return (
            msgspec.structs.replace(
                state,
                dropped_records=state.dropped_records + len(dropped),
                dropped_tokens=state.dropped_tokens + _real_tokens(dropped),
            ),
            out,
        )

    def _emit(self, state: BatchState, records: list[Record], already: int) -> list[SampleBatch]:
        mbs = self.microbatch_size
        if not self.group_by_length:
            return [SampleBatch(tuple(records[i : i + mbs]), self.pad_token_id) for i in range(0, len(records), mbs)]
        order = sorted(range(len(records)), key=lambda i: (record_length(records[i]), i))
        groups = [tuple(records[j] for j in order[i : i + mbs]) for i in range(0, len(order), mbs)]
        # Emit the groups in a drawn order (counter = batches emitted before), not shortest first.
        counter = state.batches + already
        out = []
        while groups:
            out.append(SampleBatch(groups.pop(randbelow(state.key, counter, len(groups))), self.pad_token_id))
            counter += 1
        return out

    def _advance(self, state: BatchState, partial: tuple, out: list[SampleBatch]) -> BatchState:
        real = slots = 0
        for b in out:
            if _has_tokens(b.records):
                lengths = [record_length(r) for r in b.records]
                real += sum(n - r.meta.padding_length for n, r in zip(lengths, b.records))
                slots += len(lengths) * max(lengths)
        return msgspec.structs.replace(
            state, partial=partial, batches=state.batches + len(out), real_tokens=state.real_tokens + real, slots=state.slots + slots
        )

    def decode_state(self, data: Any, upstream: Resolver) -> BatchState:
        """Inverse of ``encode_state``, refusing negative counters and a full waiting batch.

        ``step`` emits as soon as ``microbatch_size`` records wait (``buffer_size`` when grouping by
        length), so fewer wait in any state. Checked before any record is rebuilt.
        """
        state = decode(data, BatchState)
        nonnegative(state, ("batches", "dropped_records", "dropped_tokens", "real_tokens", "slots"))
        size = self.window if self.group_by_length else self.microbatch_size
        if len(state.partial) >= size:
            raise ValueError(f"field 'partial' holds {len(state.partial)} records, but a batch is emitted as soon as {size} wait")
        return resolve(state, upstream)

    def rebuild(self, refs: Sequence[Any], upstream: Resolver) -> list[SampleBatch]:
        for ref in refs:
            if not 0 < len(ref) <= self.microbatch_size:
                raise ValueError(f"a batch reference holds {len(ref)} records; batches hold 1 to microbatch_size={self.microbatch_size}")
        flat: list[Meta] = [m for ref in refs for m in ref]
        records = iter(upstream(flat))
        return [SampleBatch(tuple(next(records) for _ in ref), self.pad_token_id) for ref in refs]

    def report(self, state: BatchState) -> dict[str, int]:
        return {
            "batches": state.batches,
            "dropped_records_at_end": state.dropped_records,
            "dropped_tokens_at_end": state.dropped_tokens,
            "real_tokens": state.real_tokens,
            "padded_slots": state.slots,
        }
