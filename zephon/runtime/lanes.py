"""Lanes: independent, pure per-lane streams, and their checkpoint encoding.

A :class:`Plan` holds what decides a lane's output (work source, operator chain, lane count) and
read settings. ``plan.next(lane, state)`` returns the next output and the state after it, so any
process can run any lane. Operators run wrapped (:class:`Driven`: metered, rebuilding references).
A restore (:meth:`Plan.decode_lanes`) checks every lane and rebuilds only what the first output
due needs; the rest stays as references until due.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import defaultdict
from typing import Any, Iterator, Sequence

import attrs
import msgspec

from ..core.operator import Chain, ChainState, Operator, Resolver, StatelessState, state_type
from ..core.keys import fold_in, seed_key
from .readahead import ReadAhead, per_record_prefix
from ..core.records import UNRESOLVED, Meta, Record, SampleBatch, Segment, meta_from_ints, reference
from ..core.state import decode as decode_struct, encode_outputs, keep_references, output_ref, references, resolve
from .checkpoint import check_lane_state
from .bad_records import decode_reading, naming_operator, note_skips, reading_logged, unreadable
from .stats import Meter, items_size, mixture_counts
from ..core.bad_records import Failure, SkipLog
from ..sources.work_source import SourceState, StaticMixtureWorkSource


#: Whether :meth:`Plan.decode_lanes` defers rebuilding (``False``: every lane whole at restore).
DEFERRED_RESTORE = True


class LaneState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One lane: source cursor, operator states, outputs produced but not yet delivered.
    ``unresolved``: the operator states hold restored references, rebuilt before it next steps."""

    source: SourceState
    chain: ChainState
    pending: tuple = ()
    delivered: int = 0
    done: bool = False
    mixture: tuple[int, ...] = ()  # per dataset: samples, tokens of the outputs delivered (see mixture_counts)
    unresolved: bool = False
    skipped: tuple[SkipLog, ...] = ()  # per dataset, rows left out by reading (datasets with on_error="skip")


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector in the block (main thread only): decoding makes many
    small acyclic objects whose collections would walk the whole process."""
    if threading.current_thread() is not threading.main_thread() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@attrs.frozen(eq=False)
class Driven(Operator):
    """An operator as a lane runs it: input references rebuilt first, work counted by ``meter``."""

    op: Operator
    index: int
    plan: Any
    lane: int
    meter: Any = None

    def step(self, state: Any, chunk: Sequence[Any]) -> tuple[Any, list]:
        if any(type(r) is Record and r.payload is UNRESOLVED for r in chunk):
            holder = self.plan.chain.names[self.index - 1] if self.index else "source"
            with _restoring(self.lane, holder):
                chunk = resolve(list(chunk), self.plan.resolver_at(self.lane, self.index))
        t0 = time.perf_counter()
        name = self.plan.chain.names[self.index]
        with naming_operator(name):
            new, out = self.op.step(state, chunk)
        if type(new) is StatelessState and new.skips is not None:
            note_skips(self.plan, f"operator {name!r}", getattr(state, "skips", None), new.skips)
        if self.meter is not None:
            self.meter.add(self.index, items_size(chunk), items_size(out), time.perf_counter() - t0)
        return new, out

    def flush(self, state: Any) -> tuple[Any, list]:
        t0 = time.perf_counter()
        new, out = self.op.flush(state)
        if self.meter is not None and out:
            self.meter.add(self.index, (0, 0), items_size(out), time.perf_counter() - t0)
        return new, out


@attrs.frozen(eq=False)
class Plan:
    """The compiled, picklable description of a pipeline's lanes."""

    source: StaticMixtureWorkSource
    chain: Chain
    lanes: int
    read_size: int = 64
    read_ahead: int = 512  # samples read and tokenized together for the lanes about to read (0: off)

    def fetch(self, lane: int, pointers: Sequence[tuple[int, int, int]]) -> list[Record]:
        """The payloads of ``pointers`` (in order) as fresh sample-level records."""
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (d, s, _) in enumerate(pointers):
            groups[(d, s)].append(i)
        payloads: list[Any] = [None] * len(pointers)
        for (d, s), idx in groups.items():
            for i, p in zip(idx, self.source.datasets[d].read(s, [pointers[i][2] for i in idx])):
                payloads[i] = p
        return [Record(p, Meta(lane, (Segment(d, s, r, 0, 0, -1),), 0)) for p, (d, s, r) in zip(payloads, pointers)]

    def resolve_source(self, metas: Sequence[Meta]) -> list[Record]:
        """Rebuild sample-level records from their metas, all of one lane (the chain's input
        resolver, behind :meth:`_checked_resolver`)."""
        for m in metas:
            if len(m.segments) != 1 or m.segments[0].child != 0 or m.segments[0].end != -1:
                raise ValueError(f"not a source sample reference: {m!r}")
        out = self.fetch(metas[0].lane, [m.segments[0].pointer for m in metas]) if metas else []
        for rec in out:
            if type(rec.payload) is Failure:  # a row read before cannot be decoded now
                raise ValueError(f"{self.describe(rec.meta)} no longer decodes: {rec.payload.message}")
        return out

    def init(self, lane: int) -> LaneState:
        self._check_lane(lane)
        return LaneState(SourceState(), self.chain.init(fold_in(seed_key(0), "lane", lane)))

    def read_size_of(self, state: LaneState) -> int:
        """The lane's next read size: small until its first output, so that it arrives early."""
        return self.read_size if (state.delivered or state.pending) else min(self.read_size, 16)

    def reader(self, states: dict[int, LaneState]) -> ReadAhead | None:
        """A :class:`ReadAhead` for an executor's live lane states (``None``: off)."""
        if not self.read_ahead or not per_record_prefix(self.chain):
            return None
        return ReadAhead(self, states, self.read_ahead)

    def next(
        self, lane: int, state: LaneState, meter: Any = None, ahead: ReadAhead | None = None
    ) -> tuple[LaneState, Any]:
        """The lane's next output and the state after it (``(state, None)`` at its end); ``meter``
        and ``ahead`` (from :meth:`reader`) do not change the output. Rebuilds references."""
        state = self.produce(lane, state, meter, ahead)
        if not state.pending:
            return state, None
        out = self._rebuilt_output(lane, state.pending[0])
        counts = mixture_counts(state.mixture, (out,), len(self.source.datasets))
        after = msgspec.structs.replace(state, pending=state.pending[1:], delivered=state.delivered + 1, mixture=counts)
        return after, out

    def produce(self, lane: int, state: LaneState, meter: Any = None, ahead: ReadAhead | None = None) -> LaneState:
        """``state`` with outputs pending (not rebuilt): as it is, else after its operators stepped
        (or flushed, at the end of its data) until they gave some; none: the lane has ended."""
        if state.pending:
            return state
        source, chain, pending, done = state.source, state.chain, (), state.done
        unresolved, skipped = state.unresolved, state.skipped
        size = self.read_size_of(state)
        if unresolved:  # it steps or flushes: its operators' held records first
            chain, unresolved = self.rebuild_chain(lane, chain), False
        driven = None
        while not pending and not done:
            driven = driven or self.driven(lane, meter)
            prepared = None if ahead is None else ahead.take(lane, source, size)
            if prepared is None:
                t0 = time.perf_counter()
                source, pointers, exhausted = self.source.read(source, self.lanes, lane, size)
                records, failed = unreadable(self.fetch(lane, pointers))
                read_s = time.perf_counter() - t0
            else:
                source, pointers, exhausted, records = prepared.source, prepared.pointers, prepared.exhausted, prepared.inputs
                read_s, failed = prepared.read_s, prepared.unreadable
            if meter is not None:
                meter.read(pointers, read_s)
            try:
                skipped = reading_logged(self, skipped, pointers, failed)
                if prepared is None:
                    chain, outs = driven.step(chain, records)
                else:
                    chain, outs = _step_prepared(driven, chain, prepared, meter)
            except Exception as exc:
                self._note_records(exc, lane, records)
                raise
            if prepared is not None:
                ahead.stepped(lane, source, len(outs), exhausted)
            done = exhausted
            pending = tuple(outs)
        if not pending:  # the end of its data: the operators hand out what they hold, a piece at a time
            try:
                chain, more = (driven or self.driven(lane, meter)).flush(chain)
            except Exception as exc:
                self._note_records(exc, lane, None)
                raise
            pending = tuple(more)
        return LaneState(source, chain, pending, state.delivered, done, state.mixture, unresolved, skipped)

    def driven(self, lane: int, meter: Any = None) -> Chain:
        """The chain with every operator wrapped in a :class:`Driven` for ``lane``."""
        return Chain(tuple((name, Driven(op, i, self, lane, meter)) for i, (name, op) in enumerate(self.chain.children)))

    def resolver_at(self, lane: int, index: int) -> Resolver:
        """The resolver of operator ``index``'s input for lane ``lane`` (``len(children)``: the chain's output)."""
        return self.chain.resolver_at(index, self._checked_resolver(lane))

    def rebuild_chain(self, lane: int, chain: ChainState) -> ChainState:
        """``chain`` (deferred) with each operator that reads held payloads decoded again, whole."""
        states = list(chain.states)
        for i, (name, op) in enumerate(self.chain.children):
            if op.reads_held_payloads:
                with _restoring(lane, name):
                    states[i] = op.decode_state(op.encode_state(states[i]), self.resolver_at(lane, i))
        return ChainState(tuple(states))

    def _rebuilt_output(self, lane: int, out: Any) -> Any:
        """``out``, rebuilt if it is an undelivered output a restore left as a reference."""
        if not references(out):
            return out
        with _restoring(lane):
            return self.chain.rebuild([output_ref(out)], self._checked_resolver(lane))[0]

    def describe(self, meta: Meta) -> str:
        """Where a record came from: dataset, shard (file), row and lane of its first source sample.

        Examples:
            >>> from zephon.io import Dataset
            >>> from zephon.work import StaticMixtureWorkSource
            >>> from zephon.types import Meta, Segment
            >>> plan = Plan(StaticMixtureWorkSource([Dataset.from_rows("toy", [{"x": 1}])], {"toy": 1}), Chain(()), 1)
            >>> plan.describe(Meta(0, (Segment(0, 0, 0, 0, 0, -1),)))
            "dataset 'toy', shard '0', row 0 (lane 0)"
        """
        if not meta.segments:
            return f"a record of lane {meta.lane}"
        seg = meta.segments[0]
        more = f" (and {len(meta.segments) - 1} more segments)" if len(meta.segments) > 1 else ""
        return f"{self._shard_name(seg.dataset, seg.shard)}, row {seg.row} (lane {meta.lane}){more}"

    def _shard_name(self, dataset: int, shard: int) -> str:
        try:
            ds = self.source.datasets[dataset]
            name, shard_id, path = ds.name, ds.shard_ids[shard], ds.shard_path(shard)
        except (AttributeError, IndexError, TypeError):  # a source without named datasets
            return f"dataset {dataset}, shard {shard}"
        return f"dataset {name!r}, shard {shard_id!r}" + (f" (file {path})" if path else "")

    def _note_records(self, exc: Exception, lane: int, records: Sequence[Record] | None) -> None:
        """Note on ``exc`` the record(s) it was raised on: ``exc.zephon_meta``, else the chunk's
        records (``None``: flushing)."""
        if not hasattr(exc, "add_note") or getattr(exc, "zephon_named", False):
            return
        meta = getattr(exc, "zephon_meta", None)
        if meta is not None:
            exc.add_note(f"zephon: that record is {self.describe(meta)}")
        elif records is None:
            exc.add_note(f"zephon: raised while lane {lane} was flushing at the end of its data")
        else:
            rows: dict[tuple[int, int], list[int]] = defaultdict(list)
            for rec in records:
                seg = rec.meta.segments[0]
                rows[(seg.dataset, seg.shard)].append(seg.row)
            parts = []
            for (d, s), found in rows.items():
                shown = ", ".join(map(str, found[:8])) + (f", ... ({len(found)} rows)" if len(found) > 8 else "")
                parts.append(f"{self._shard_name(d, s)}, row{'s' if len(found) > 1 else ''} {shown}")
            exc.add_note(f"zephon: raised while lane {lane} was processing {len(records)} records: {'; '.join(parts)}")
        with contextlib.suppress(AttributeError):
            exc.zephon_named = True  # type: ignore[attr-defined]

    def meter(self) -> Meter:
        """Fresh runtime counters for this plan's operators and datasets."""
        return Meter(self.chain.names, len(self.source.datasets))

    def reports(self, state: LaneState) -> dict[str, dict[str, int]]:
        """Each operator's counters (drops, rows, ...) for one lane state."""
        return self.chain.reports(state.chain)

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} outside [0, {self.lanes}) (canonical_replicas={self.lanes})")

    def encode(self, state: LaneState) -> dict[str, Any]:
        """The lane state as builtins; ``skipped`` only when a dataset skips undecodable rows."""
        out = {
            "source": [state.source.chunk, state.source.offset],
            "ops": self.chain.encode_state(state.chain),
            "pending": encode_outputs(state.pending),
            "delivered": state.delivered,
            "done": state.done,
            "mixture": list(state.mixture) or [0] * (2 * len(self.source.datasets)),
        }
        if state.skipped:
            out["skipped"] = msgspec.to_builtins(state.skipped)
        return out

    def unread(self, encoded: dict[str, Any], outputs: Any) -> dict[str, Any]:
        """An encoded lane state before its last ``outputs`` were taken (back in ``pending``)."""
        refs = encode_outputs(outputs)
        counts = mixture_counts(encoded["mixture"], list(outputs), len(self.source.datasets), sign=-1)
        pending, delivered = refs + list(encoded["pending"]), encoded["delivered"] - len(refs)
        return {**encoded, "pending": pending, "delivered": delivered, "mixture": list(counts)}

    def decode(self, lane: int, data: Any) -> LaneState:
        """Inverse of :meth:`encode`, every record rebuilt now; a ValueError names the lane and
        field of a modified, malformed or out-of-range state, or records that no longer rebuild."""
        source, refs, counts = self._check_state(lane, data)
        resolver = self._checked_resolver(lane)
        chain = self._decode_chain(lane, data["ops"], lambda i, op, state: op.decode_state(state, self.chain.resolver_at(i, resolver)))
        with _restoring(lane):
            pending = tuple(self.chain.rebuild(refs, resolver)) if refs else ()
        skipped = decode_reading(data.get("skipped"), len(self.source.datasets), lane)
        return LaneState(source, chain, pending, data["delivered"], data["done"], counts, skipped=skipped)

    def decode_lanes(self, encoded: dict[int, Any]) -> dict[int, LaneState]:
        """Decode restored lane states: every lane checked now, the records of the lane due first
        rebuilt now, the rest when due (outputs and checkpoints as :meth:`decode` gives)."""
        if not DEFERRED_RESTORE:
            return {lane: self.decode(lane, data) for lane, data in encoded.items()}
        with no_gc():
            checked = {lane: self._check_state(lane, data) for lane, data in encoded.items()}
            first = next(iter(caller_order({lane: data["delivered"] for lane, data in encoded.items()})), None)
            out = {}
            for lane, data in encoded.items():
                source, refs, counts = checked[lane]
                chain = self._decode_deferred(lane, data["ops"])
                pending = tuple(_reference_output(r) for r in refs)
                unresolved = True
                if lane == first and pending:
                    pending = (self._rebuilt_output(lane, pending[0]),) + pending[1:]
                elif lane == first:
                    chain, unresolved = self.rebuild_chain(lane, chain), False
                skipped = decode_reading(data.get("skipped"), len(self.source.datasets), lane)
                delivered, done = data["delivered"], data["done"]
                out[lane] = LaneState(source, chain, pending, delivered, done, counts, unresolved, skipped)
            return out

    def _decode_deferred(self, lane: int, ops: Any) -> ChainState:
        """The chain's states with every field checked and no record rebuilt (the references of an
        operator that reads only metas checked up to the source below ``CHECKED_HOLDINGS``)."""

        def decoded(i: int, op: Operator, data: Any) -> Any:
            if isinstance(op, Chain):  # a nested chain's state is its children's by name: decoded whole
                return op.decode_state(data, self.resolver_at(lane, i))
            later = self.chain.resolver_at(i, self._checked_resolver(lane, then=_records_later))
            try:
                if op.reads_held_payloads:
                    op.decode_state(data, later)
                    return decode_struct(data, state_type(op))
                state = op.decode_state(data, keep_references)
                held = references(state)
                if len(held) < CHECKED_HOLDINGS:
                    later(held)
                return state
            except _RecordsLater:
                return decode_struct(data, state_type(op))

        return self._decode_chain(lane, ops, decoded)

    def _decode_chain(self, lane: int, ops: Any, decoded: Any) -> ChainState:
        """The chain's states, each ``decoded(index, op, data)``, errors named by lane and op."""
        try:
            self.chain._check_names(ops)
        except ValueError as exc:
            raise ValueError(f"lane {lane}: field 'ops': {exc}") from exc
        states = []
        for i, (name, op) in enumerate(self.chain.children):
            with _restoring(lane, name):
                states.append(decoded(i, op, ops[name]))
        return ChainState(tuple(states))

    def _check_state(self, lane: int, data: Any) -> tuple[SourceState, list, tuple[int, ...]]:
        """What :meth:`decode` checks without operators: checksum, cursor, references, counters."""
        self._check_lane(lane)
        check_lane_state(lane, data, require_checksum=False)
        source = SourceState(*data["source"])
        try:
            self.source.check_cursor(source, self.lanes, lane)
        except ValueError as exc:
            raise ValueError(f"lane {lane}: field 'source': {exc}") from None
        # Only the initial cursor can sit at the end of a lane not done (a lane without data).
        done, at_end = data["done"], self.source.lane_range(self.lanes, lane, source.chunk) is None
        if done != at_end and (done or (source.chunk, source.offset) != (0, 0)):
            raise ValueError(
                f"lane {lane}: field 'done' is {str(done).lower()} but the source cursor "
                f"{[source.chunk, source.offset]} is {'inside' if done else 'at the end of'} the lane's data"
            )
        batches = bool(self.chain.children) and self.chain.children[-1][1].kind == "batch"
        refs = [_decode_ref(r, batches, f"lane {lane}: field 'pending[{i}]'") for i, r in enumerate(data["pending"])]
        counts = data["mixture"]
        if len(counts) != 2 * len(self.source.datasets):
            raise ValueError(
                f"lane {lane}: field 'mixture' holds {len(counts)} counters, but the source has {len(self.source.datasets)} "
                "datasets (two counters each: samples, tokens)"
            )
        return source, refs, tuple(counts)

    def _checked_resolver(self, lane: int, then: Resolver | None = None) -> Resolver:
        """:meth:`resolve_source` (or ``then``) for ``lane``, refusing before any read a reference
        to another lane, a missing dataset, shard or row, or padding."""
        then = then or self.resolve_source
        datasets = self.source.datasets

        def resolve(metas: Sequence[Any]) -> list[Record]:
            for m in metas:
                if m.lane != lane:
                    raise ValueError(f"a record reference names lane {m.lane}, but the state is lane {lane}'s: {m!r}")
                if m.padding_length:
                    raise ValueError(f"a source sample reference has padding_length {m.padding_length}: {m!r}")
                for seg in m.segments:
                    d, s, r = seg.pointer
                    if not 0 <= d < len(datasets):
                        raise ValueError(f"a record reference names dataset {d}, but the source has {len(datasets)}: {m!r}")
                    sizes = datasets[d].shard_rows
                    if not 0 <= s < len(sizes):
                        raise ValueError(
                            f"a record reference names shard {s} of dataset {datasets[d].name!r}, which has {len(sizes)}: {m!r}"
                        )
                    if not 0 <= r < sizes[s]:
                        raise ValueError(
                            f"a record reference names row {r} of shard {s} of dataset {datasets[d].name!r}, which has "
                            f"{int(sizes[s])} rows: {m!r}"
                        )
            return then(metas)

        return resolve

    def fingerprint(self) -> dict[str, Any]:
        return {"source": self.source.fingerprint(), "operators": self.chain.fingerprint()["children"], "lanes": self.lanes}


def caller_order(delivered: dict[int, int]) -> list[int]:
    """Lanes in the order the caller takes their outputs: fewest delivered first, then by id."""
    return sorted(delivered, key=lambda lane: (delivered[lane], lane))


#: Up to how many references of a metas-only operator a deferred restore checks at once.
CHECKED_HOLDINGS = 256


class _RecordsLater(BaseException):
    """Raised where a deferred restore's check reaches records (a ``BaseException``: an
    operator's ``except Exception`` does not take it for a failure)."""


def _records_later(metas: Sequence[Meta]) -> list:
    if metas:
        raise _RecordsLater
    return []


def _reference_output(ref: Any) -> Any:
    """An undelivered output as a reference: a record, or a batch of records."""
    return SampleBatch(tuple(reference(m) for m in ref)) if isinstance(ref, list) else reference(ref)


def _step_prepared(driven: Chain, state: ChainState, prepared: Any, meter: Any) -> tuple[ChainState, list]:
    """``driven.step(state, prepared.inputs)`` for a :class:`Prepared` chunk, whose per-record
    operators already ran: their counters and meters advance as measured."""
    states = list(state.states)
    k = len(prepared.applied)
    for i, applied in enumerate(prepared.applied):
        driven_op = driven.children[i][1]
        with naming_operator(driven.children[i][0]):
            states[i] = driven_op.op.advance(states[i], applied, prepared.sizes[i][0])
        if states[i].skips is not None:
            note_skips(driven_op.plan, f"operator {driven.children[i][0]!r}", state.states[i].skips, states[i].skips)
        if meter is not None:
            meter.add(i, prepared.sizes[i], prepared.sizes[i + 1], prepared.seconds[i])
    tail, items = Chain(driven.children[k:]).step(ChainState(tuple(states[k:])), prepared.outputs)
    return ChainState(tuple(states[:k]) + tail.states), items


#: What rebuilding records from a modified state can raise; restore reports them as ValueError.
_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, RuntimeError, msgspec.ValidationError)


@contextlib.contextmanager
def _restoring(lane: int, operator: str | None = None) -> Iterator[None]:
    """Report what rebuilding a state raises as a ValueError naming the lane and the operator (or ``pending``)."""
    try:
        yield
    except _DECODE_ERRORS as exc:
        where = f"field 'ops': cannot restore the state of operator {operator!r}" if operator else "field 'pending'"
        raise ValueError(f"lane {lane}: {where}: {exc}") from exc


def _decode_ref(ref: Any, batches: bool, where: str) -> Any:
    """A pending output's reference: a flat meta, or a batch (``batches``: which)."""
    if not isinstance(ref, (list, tuple)) or not ref:
        raise ValueError(f"{where}: an output reference is a non-empty list, got {ref!r}")
    is_batch = not isinstance(ref[0], int) or isinstance(ref[0], bool)
    if is_batch != batches:
        want = "a batch (a list of record references)" if batches else "one record reference [lane, padding, ...]"
        raise ValueError(f"{where}: the pipeline outputs {'batches' if batches else 'records'}, so each reference is {want}, got {ref!r}")
    try:
        return [meta_from_ints(m) for m in ref] if is_batch else meta_from_ints(ref)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
