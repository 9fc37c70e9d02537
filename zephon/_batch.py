"""Grouping records into lane-pure microbatches."""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import attrs
import msgspec

from ._core import Operator, Resolver, config_field
from ._records import Meta, Record, SampleBatch


class BatchState(msgspec.Struct, frozen=True, tag="batch", forbid_unknown_fields=True):
    """The records of the batch being filled (by reference), and records dropped at the end."""

    partial: tuple[Record, ...] = ()
    batches: int = 0
    dropped_records: int = 0


def _check_size(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch: microbatch_size must be an int >= 1, got {value!r}")


@attrs.frozen
class Batch(Operator):
    """Group each lane's records into :class:`~zephon.types.SampleBatch` of ``microbatch_size``.

    Args:
        microbatch_size: records per batch.
        drop_last: at the end of data, drop a short final batch (counted in ``stats()``)
            instead of emitting it. There are no mid-stream flushes, so only the very end can
            be short.

    State: the partial batch, by reference.
    """

    microbatch_size: int = config_field(validator=_check_size)
    drop_last: bool = config_field(default=True)

    kind: ClassVar[str] = "batch"
    state_type: ClassVar[type] = BatchState

    def init(self, key: int) -> BatchState:
        return BatchState()

    def step(self, state: BatchState, chunk: Sequence[Record]) -> tuple[BatchState, list[SampleBatch]]:
        partial = list(state.partial)
        batches = state.batches
        out: list[SampleBatch] = []
        for rec in chunk:
            partial.append(rec)
            if len(partial) == self.microbatch_size:
                out.append(SampleBatch(tuple(partial)))
                partial = []
                batches += 1
        return BatchState(tuple(partial), batches, state.dropped_records), out

    def flush(self, state: BatchState) -> tuple[BatchState, list[SampleBatch]]:
        if not state.partial:
            return state, []
        if self.drop_last:
            return BatchState((), state.batches, state.dropped_records + len(state.partial)), []
        return BatchState((), state.batches + 1, state.dropped_records), [SampleBatch(state.partial)]

    def rebuild(self, refs: Sequence[Any], upstream: Resolver) -> list[SampleBatch]:
        flat: list[Meta] = [m for ref in refs for m in ref]
        records = iter(upstream(flat))
        return [SampleBatch(tuple(next(records) for _ in ref)) for ref in refs]

    def report(self, state: BatchState) -> dict[str, int]:
        return {"batches": state.batches, "dropped_records_at_end": state.dropped_records}
