"""Lanes: independent, pure per-lane streams, and their checkpoint encoding.

A :class:`Plan` is everything that decides a lane's output (the work source, the operator chain,
the lane count) plus read settings that do not. ``lane_next(plan, lane, state)`` returns the lane's
next output and the state *after* it, so any process can run any lane and a checkpoint is just
the per-lane states of what the caller has received.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Sequence

import attrs
import msgspec

from ..core.operator import Chain, ChainState, Resolver, records_later
from . import lazy as _lazy
from .lazy import DeferredChain, DeferredOutput, LazyLane, LazyRows
from ..core.keys import fold_in, seed_key
from ..core.fields import payload_length
from .readahead import ReadAhead
from ..core.records import Meta, Record, SampleBatch, Segment, meta_from_ints
from .stats import Meter
from ..sources.work_source import SourceState, StaticMixtureWorkSource


class LaneState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One lane: source cursor, operator states, outputs produced but not yet delivered."""

    source: SourceState
    chain: ChainState
    pending: tuple = ()
    delivered: int = 0
    done: bool = False
    mixture: tuple[int, ...] = ()  # per dataset: samples, tokens of the outputs delivered (see mixture_counts)


def mixture_counts(counts: Sequence[int], outputs: Sequence[Any], datasets: int, sign: int = 1) -> tuple[int, ...]:
    """``counts`` (``[samples_0, tokens_0, samples_1, ...]``) plus (or minus) what ``outputs`` hold.

    A segment that starts at token 0 of its sample-level record counts as one sample (a piece of
    a document wrapped over two rows counts once); its tokens are its range, or the payload's
    token count for a whole record (0 before tokenizing).

    Examples:
        >>> from zephon.types import Meta, Segment
        >>> rec = Record({"input_ids": [1, 2, 3]}, Meta(0, (Segment(1, 0, 4, 0, 0, -1),)))
        >>> mixture_counts((), [rec], 2)
        (0, 0, 1, 3)
    """
    out = list(counts) if counts else [0] * (2 * datasets)
    for o in outputs:
        for rec in (o.records if isinstance(o, SampleBatch) else (o,)):
            for seg in rec.meta.segments:
                if seg.end >= 0:
                    tokens = seg.end - seg.start
                else:
                    try:
                        tokens = payload_length(rec.payload, "mixture")
                    except (TypeError, ValueError):
                        tokens = 0  # not tokenized (yet): samples only
                out[2 * seg.dataset] += sign * (seg.start == 0)
                out[2 * seg.dataset + 1] += sign * tokens
    return tuple(out)


def mixture_report(source: Any, counts_by_lane: dict[int, Sequence[int]]) -> dict[str, Any]:
    """The achieved mixture, per lane and over the lanes given, next to the target.

    Returns:
        ``{"unit", "target": {name: share}, "global": {name: {...}}, "lanes": {lane: {name: {...}}}}``
        where each dataset's entry holds ``samples``, ``tokens``, ``sample_share``,
        ``token_share``, ``target`` (the target share in the mixture's unit) and ``epochs``
        (samples delivered over the dataset's rows).
    """
    names = source.names
    n = len(names)
    rows = [getattr(d, "num_rows", 0) for d in source.datasets]
    total = [0] * (2 * n)
    for counts in counts_by_lane.values():
        for i, c in enumerate(counts):
            total[i] += c
    try:
        target = source.target_at(sum(total[0::2]))
    except (ValueError, AttributeError, TypeError):
        target = {}

    def block(counts: Sequence[int]) -> dict[str, Any]:
        counts = list(counts) or [0] * (2 * n)
        samples, tokens = sum(counts[0::2]), sum(counts[1::2])
        return {
            name: {
                "samples": counts[2 * j],
                "tokens": counts[2 * j + 1],
                "sample_share": counts[2 * j] / samples if samples else 0.0,
                "token_share": counts[2 * j + 1] / tokens if tokens else 0.0,
                "target": target.get(name),
                "epochs": counts[2 * j] / rows[j] if rows[j] else 0.0,
            }
            for j, name in enumerate(names)
        }

    return {
        "unit": getattr(source, "unit", "samples"),
        "target": target,
        "global": block(total),
        "lanes": {lane: block(c) for lane, c in counts_by_lane.items()},
    }


@attrs.frozen(eq=False)
class Plan:
    """The compiled, picklable description of a pipeline's lanes."""

    source: StaticMixtureWorkSource
    chain: Chain
    lanes: int
    read_size: int = 64
    read_ahead: int = 512  # samples read and tokenized together for the lanes about to read (0: off)

    # -- reading ----------------------------------------------------------------------------------------
    def fetch(self, lane: int, pointers: Sequence[tuple[int, int, int]]) -> list[Record]:
        """Read the payloads of ``pointers`` (in order) as fresh sample-level records."""
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (d, s, _) in enumerate(pointers):
            groups[(d, s)].append(i)
        payloads: list[Any] = [None] * len(pointers)
        for (d, s), idx in groups.items():
            rows = [pointers[i][2] for i in idx]
            for i, p in zip(idx, self.source.datasets[d].read(s, rows)):
                payloads[i] = p
        return [Record(p, Meta(lane, (Segment(d, s, r, 0, 0, -1),), 0)) for p, (d, s, r) in zip(payloads, pointers)]

    def resolve_source(self, metas: Sequence[Meta]) -> list[Record]:
        """Rebuild sample-level records from their metas (the chain's input resolver)."""
        by_lane: dict[int, list[int]] = defaultdict(list)
        for i, m in enumerate(metas):
            if len(m.segments) != 1 or m.segments[0].child != 0 or m.segments[0].end != -1:
                raise ValueError(f"not a source sample reference: {m!r}")
            by_lane[m.lane].append(i)
        out: list[Any] = [None] * len(metas)
        for lane, idx in by_lane.items():
            for i, rec in zip(idx, self.fetch(lane, [metas[i].segments[0].pointer for i in idx])):
                out[i] = rec
        return out

    # -- lanes ------------------------------------------------------------------------------------------
    def lane_key(self, lane: int) -> int:
        return fold_in(seed_key(0), "lane", lane)

    def init(self, lane: int) -> LaneState:
        self._check_lane(lane)
        return LaneState(SourceState(), self.chain.init(self.lane_key(lane)))

    def read_size_of(self, state: LaneState) -> int:
        """The size of the lane's next read: small until its first output, so that it arrives early
        (read sizes never change the data: every operator is chunking-invariant). A lane with
        outputs waiting delivers them first, so it reads ``read_size`` next."""
        return self.read_size if (state.delivered or state.pending) else min(self.read_size, 16)

    def reader(self, states: dict[int, LaneState]) -> ReadAhead | None:
        """A :class:`~zephon.runtime.readahead.ReadAhead` for an executor's live lane states (``None``: off)."""
        if not self.read_ahead or not self.chain.per_record_prefix:
            return None
        return ReadAhead(self, states, self.read_ahead)

    def next(
        self, lane: int, state: LaneState, meter: Any = None, ahead: ReadAhead | None = None, *, background: bool = True
    ) -> tuple[LaneState, Any]:
        """The lane's next output and the state after it; ``(state, None)`` when it has ended.

        ``meter`` (a :class:`~zephon.runtime.stats.Meter`, optional) counts the reading and each
        operator's work; ``ahead`` (from :meth:`reader`) reads and tokenizes for several lanes at
        once. Neither ever changes the output. ``background=False``: restored records are rebuilt
        only when due, none in the background (the lane is about to move to another process).
        """
        source, chain, pending, done = state.source, state.chain, state.pending, state.done
        size = self.read_size_of(state)
        if not pending:  # it steps or flushes: restored lazily, its operators are rebuilt now if not yet
            chain = _chain_of(state)
        while not pending and not done:
            prepared = None if ahead is None else ahead.take(lane, source, size)
            if prepared is None:
                t0 = time.perf_counter()
                source, pointers, exhausted = self.source.read(source, self.lanes, lane, size)
                records = self.fetch(lane, pointers)
                if meter is not None:
                    meter.read(pointers, time.perf_counter() - t0)
            else:
                source, pointers, exhausted, records = prepared.source, prepared.pointers, prepared.exhausted, prepared.inputs
                if meter is not None:
                    meter.read(pointers, prepared.read_s)
            try:
                if prepared is None:
                    chain, outs = self.chain.step(chain, records, meter)
                else:
                    chain, outs = self.chain.step_prepared(chain, prepared, meter)
            except Exception as exc:
                self._note_records(exc, lane, records)
                raise
            if prepared is not None:
                ahead.stepped(lane, source, len(outs), exhausted)
            done = exhausted
            pending = tuple(outs)
        if not pending:  # the end of its data: the operators hand out what they hold, a piece at a time
            try:
                chain, more = self.chain.flush(chain, meter)
            except Exception as exc:
                self._note_records(exc, lane, None)
                raise
            pending = tuple(more)
        if not pending:
            return LaneState(source, chain, (), state.delivered, True, state.mixture), None
        out = pending[0]
        if type(out) is DeferredOutput:  # restored lazily: rebuilt now if the background has not yet
            out = out.output()
        if background:
            _lazy.kick()  # restored records wait: rebuild them in the background from now on
        counts = mixture_counts(state.mixture, (out,), len(self.source.datasets))
        return LaneState(source, chain, pending[1:], state.delivered + 1, done, counts), out

    def warm(self) -> None:
        """Load the tokenizers the operators encode with (a worker does this before it takes its lanes)."""
        for _, op in self.chain.children:
            warm = getattr(getattr(op, "handle", None), "warm", None)
            if warm is not None:
                warm()

    # -- naming records in errors -----------------------------------------------------------------------
    def describe(self, meta: Meta) -> str:
        """Where a record came from, by name: dataset, shard (and file), row and lane.

        Names the first source sample of the record (and how many more it was built from).

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
        """Add a note to ``exc`` naming, by dataset and file, the record(s) it was raised on.

        An operator that traced the error to one record left its meta on the exception
        (``zephon_meta``, with a note by indices): that record is named. Otherwise the records
        of the chunk being processed are, grouped by file (``None``: the lane was flushing).
        """
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
        try:
            exc.zephon_named = True  # type: ignore[attr-defined]
        except AttributeError:
            pass

    def meter(self) -> Meter:
        """Fresh runtime counters for this plan's operators and datasets (see :meth:`next`)."""
        return Meter(self.chain.names, len(getattr(self.source, "datasets", ())))

    def reports(self, state: LaneState) -> dict[str, dict[str, int]]:
        """Each operator's counters (drops, rows, ...) for one lane state."""
        return self.chain.reports(_chain_of(state))

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} outside [0, {self.lanes}) (canonical_replicas={self.lanes})")

    # -- checkpoints ------------------------------------------------------------------------------------
    def encode(self, state: LaneState) -> dict[str, Any]:
        from ..core.operator import _enc_hook

        return {
            "source": [state.source.chunk, state.source.offset],
            "ops": self.chain.encode_state(_chain_of(state)),
            "pending": msgspec.to_builtins(list(state.pending), enc_hook=_enc_hook),
            "delivered": state.delivered,
            "done": state.done,
            "mixture": list(state.mixture) or [0] * (2 * len(self.source.datasets)),
        }

    def unread(self, encoded: dict[str, Any], outputs: Any) -> dict[str, Any]:
        """An encoded lane state as it was before its last ``outputs`` (in order) were taken.

        The outputs go back to the front of ``pending``, by reference, so a checkpoint can leave
        out outputs that were computed and taken from the lane but never delivered.
        """
        from ..core.operator import _enc_hook

        refs = msgspec.to_builtins(list(outputs), enc_hook=_enc_hook)
        counts = mixture_counts(encoded["mixture"], list(outputs), len(self.source.datasets), sign=-1)
        return {**encoded, "pending": refs + list(encoded["pending"]), "delivered": encoded["delivered"] - len(refs), "mixture": list(counts)}

    def decode(self, lane: int, data: Any) -> LaneState:
        """Inverse of :meth:`encode`, refusing states this plan's lane could never reach.

        A ``checksum`` field (as in a checkpoint) is verified; a state straight from
        :meth:`encode` has none. (:meth:`decode_lanes` decodes all but one lane lazily.)

        Raises:
            ValueError: naming the lane and the field: a modified state (checksum mismatch), a
                missing or unknown field, a value of the wrong type or out of range (a cursor
                past the lane's data, a negative counter, a token range past its record, a
                record of another lane or outside the data), or records that no longer rebuild.
        """
        return self._decoded(lane, data, self._check_state(lane, data), lazy=False)

    def decode_lanes(self, encoded: dict[int, Any]) -> dict[int, LaneState]:
        """Decode an executor's restored lane states: what the first output needs now, the rest lazily.

        The lane due first gives its next output now: an undelivered one is rebuilt now (its
        operator states later, as the other lanes' are); otherwise its operator states are
        rebuilt now. So the first output after a restore waits for one output's records only;
        the rest is rebuilt in the background while it is used, or when a lane is first stepped
        (every lane is checked now for what needs no operator). Whole and lazy states give the
        same outputs.
        """
        with _lazy.no_gc():
            checked = {lane: self._check_state(lane, data) for lane, data in encoded.items()}
            first = next(iter(caller_order({lane: data["delivered"] for lane, data in encoded.items()})), None)
            return {
                lane: self._decoded(lane, data, checked[lane], _lazy.LAZY_LANES, due=lane == first)
                for lane, data in encoded.items()
            }

    def _decoded(
        self, lane: int, data: Any, checked: tuple[SourceState, list, tuple[int, ...]], lazy: bool, due: bool = False
    ) -> LaneState:
        """The lane state from ``data`` once :meth:`_check_state` gave ``checked``.

        With ``lazy``, the operator states and undelivered outputs are rebuilt in the background
        (see :mod:`zephon.runtime.lazy`) or when the lane is first stepped or encoded, and raise then
        what they would raise now. A ``due`` lane gives an output first: its undelivered outputs
        are rebuilt as in an eager restore, and only its operator states lazily (when it has
        none, everything now).
        """
        source, refs, counts = checked
        if lazy and not due:
            job = LazyLane(lambda: self._rebuild(lane, data["ops"], refs, recheck=data))
            pending = tuple(DeferredOutput(job, i, ref) for i, ref in enumerate(refs))
            return LaneState(source, DeferredChain(job), pending, data["delivered"], data["done"], counts)  # type: ignore[arg-type]
        if lazy and refs:
            try:
                self.chain.check_state(data["ops"], self._checked_resolver(lane, then=records_later))
            except _DECODE_ERRORS as exc:
                raise ValueError(f"lane {lane}: field 'ops': {exc}") from exc
            resolver = self._checked_resolver(lane)
            pending = self._rebuild_pending(lane, refs, resolver)
            job = LazyLane(lambda: (self._rebuild_chain(lane, data["ops"], resolver, recheck=data), ()))
            return LaneState(source, DeferredChain(job), pending, data["delivered"], data["done"], counts)  # type: ignore[arg-type]
        chain, pending = self._rebuild(lane, data["ops"], refs)
        return LaneState(source, chain, pending, data["delivered"], data["done"], counts)

    def _check_state(self, lane: int, data: Any) -> tuple[SourceState, list, tuple[int, ...]]:
        """What :meth:`decode` checks without any operator: the checksum, the cursor, the output references, the counters."""
        from .checkpoint import check_lane_state

        if isinstance(lane, bool) or not isinstance(lane, int):
            raise ValueError(f"lane ids are ints, got {lane!r}")
        self._check_lane(lane)
        check_lane_state(lane, data, require_checksum=False)
        chunk, offset = data["source"]
        source = SourceState(chunk, offset)
        self._check_cursor(lane, source, data["done"])
        batches = bool(self.chain.children) and self.chain.children[-1][1].kind == "batch"
        refs = [_decode_ref(r, batches, f"lane {lane}: field 'pending[{i}]'") for i, r in enumerate(data["pending"])]
        counts = data["mixture"]
        if len(counts) != 2 * len(self.source.datasets):
            raise ValueError(
                f"lane {lane}: field 'mixture' holds {len(counts)} counters, but the source has {len(self.source.datasets)} "
                "datasets (two counters each: samples, tokens)"
            )
        return source, refs, tuple(counts)

    def _rebuild(self, lane: int, ops: Any, refs: list, recheck: Any = None) -> tuple[ChainState, tuple]:
        """A lane's operator states and undelivered outputs, rebuilt from their references.

        ``recheck``: the state checked earlier, checked again first (a lazily restored lane's
        state is the caller's mapping, read later: a change made since is refused by its checksum).
        """
        resolver: Resolver = self._checked_resolver(lane)
        chain = self._rebuild_chain(lane, ops, resolver, recheck)
        return chain, self._rebuild_pending(lane, refs, resolver)

    def _rebuild_chain(self, lane: int, ops: Any, resolver: Resolver, recheck: Any = None) -> ChainState:
        """A lane's operator states from their encoding (``recheck``: see :meth:`_rebuild`)."""
        if recheck is not None:
            from .checkpoint import check_lane_state

            check_lane_state(lane, recheck, require_checksum=False)
        try:
            return self.chain.decode_state(ops, resolver)
        except _DECODE_ERRORS as exc:
            raise ValueError(f"lane {lane}: field 'ops': {exc}") from exc

    def _rebuild_pending(self, lane: int, refs: list, resolver: Resolver) -> tuple:
        """A lane's undelivered outputs from their references.

        Few held records: rebuilt now, so that a damaged state fails here. More: the next output
        now and the others in the background; many (a read's worth): all of them lazily, the
        next one first (each is awaited or rebuilt when due, so a damaged one fails then).
        """
        sizes = [len(r) if isinstance(r, list) else 1 for r in refs]
        now, later = refs, []
        if sum(sizes) >= _lazy.LAZY_MIN_PENDING:
            now, later = [], refs
        elif sum(sizes[1:]) >= _lazy.LAZY_MIN_RECORDS:
            now, later = refs[:1], refs[1:]
        try:
            pending = tuple(self.chain.rebuild(now, resolver)) if now else ()
        except _DECODE_ERRORS as exc:
            raise ValueError(f"lane {lane}: field 'pending': {exc}") from exc
        if later:
            rows = LazyRows(later, lambda some: self.chain.rebuild(some, resolver), range(len(later)), check=False)
            pending += tuple(DeferredOutput(rows, i, ref) for i, ref in enumerate(later))
        return pending

    def _check_cursor(self, lane: int, source: SourceState, done: bool) -> None:
        """The source cursor is one the lane reaches, and ``done`` says whether it is at the end."""
        check = getattr(self.source, "check_cursor", None)
        if check is None:
            return
        try:
            check(source, self.lanes, lane)
        except ValueError as exc:
            raise ValueError(f"lane {lane}: field 'source': {exc}") from None
        # A lane is done exactly when its last read reached the end of its data; only the initial
        # cursor can sit at the end of a lane that has not read yet (a lane without data).
        at_end = self.source.lane_range(self.lanes, lane, source.chunk) is None
        if done and not at_end:
            raise ValueError(
                f"lane {lane}: field 'done' is true but the source cursor {[source.chunk, source.offset]} is inside the "
                "lane's data"
            )
        if not done and at_end and (source.chunk, source.offset) != (0, 0):
            raise ValueError(
                f"lane {lane}: field 'done' is false but the source cursor {[source.chunk, source.offset]} is at the "
                "end of the lane's data"
            )

    def _checked_resolver(self, lane: int, then: Resolver | None = None) -> Resolver:
        """:meth:`resolve_source` (or ``then``) for lane ``lane``'s state, refusing references outside the data.

        Every record a state holds rebuilds from source samples through here, so a reference to
        another lane, a dataset, shard or row that does not exist, or padding on a source sample
        is refused, naming it, before anything is read.
        """
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
                    sizes = datasets[d].shard_sizes
                    if not 0 <= s < len(sizes):
                        raise ValueError(
                            f"a record reference names shard {s} of dataset {datasets[d].name!r}, which has {len(sizes)}: {m!r}"
                        )
                    if not 0 <= r < sizes[s]:
                        raise ValueError(
                            f"a record reference names row {r} of shard {s} of dataset {datasets[d].name!r}, which has "
                            f"{sizes[s]} rows: {m!r}"
                        )
            return then(metas)

        return resolve

    def fingerprint(self) -> dict[str, Any]:
        return {"source": self.source.fingerprint(), "operators": self.chain.fingerprint()["children"], "lanes": self.lanes}


def caller_order(delivered: dict[int, int]) -> list[int]:
    """Lanes in the order the caller takes their outputs, from their delivered counts: fewest
    first (after a restore mid-step, the lanes that step still needs), then by id."""
    return sorted(delivered, key=lambda lane: (delivered[lane], lane))


def _chain_of(state: LaneState) -> ChainState:
    """The lane's operator states, rebuilt now if restored lazily and not rebuilt yet."""
    chain = state.chain
    return chain.value() if type(chain) is DeferredChain else chain


#: What rebuilding records from a modified state can raise; restore reports them as ValueError.
_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, RuntimeError, msgspec.ValidationError)


def _decode_ref(ref: Any, batches: bool | None = None, where: str = "a pending output") -> Any:
    """A pending output's reference: a flat meta ``[lane, padding, ...]``, or a batch (list of metas).

    ``batches`` says which the chain outputs (``None``: either); ``where`` prefixes errors.
    """
    if not isinstance(ref, (list, tuple)) or not ref:
        raise ValueError(f"{where}: an output reference is a non-empty list, got {ref!r}")
    is_batch = not isinstance(ref[0], int) or isinstance(ref[0], bool)
    if batches is not None and is_batch != batches:
        want = "a batch (a list of record references)" if batches else "one record reference [lane, padding, ...]"
        raise ValueError(f"{where}: the pipeline outputs {'batches' if batches else 'records'}, so each reference is {want}, got {ref!r}")
    try:
        return [meta_from_ints(m) for m in ref] if is_batch else meta_from_ints(ref)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
