"""The loader: ``iter(pipeline)`` builds a :class:`Loader` for this rank's lanes.

It owns the executor (inline, a background thread, or worker processes), yields the lanes' outputs
round-robin in lane order and holds the run-time state: ``checkpoint()`` / ``restore()``,
``state_dict()``, ``stats()``, ``close()``. At the end of finite data it stops at the first
incomplete global step unless ``drain=True``, and warns once about what was not delivered.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections import Counter, deque
from typing import Any, Iterator

from .checkpoint import build, checkpoint_to_state_dict, select_lanes, state_dict_to_checkpoint, validate
from .distributed import Topology, all_ranks_have, distributed_group
from .inline_executor import InlineExecutor
from .process_executor import ProcessExecutor
from .thread_executor import ThreadExecutor
from .lanes import Plan
from ..core.log import get_logger
from .options import Options
from ..core.records import SampleBatch
from .keyframes import from_keyframe, latest_keyframe, save_keyframe
from .skip_steps import SkippedSteps, check_count, skips_of
from .bad_records import skip_report
from .stats import Deliveries, format_stats, items_size, mixture_report, summarize, summary_line

log = get_logger("loader")


def output_size(out: Any) -> tuple[int, int]:
    """``(records, tokens)`` of one lane output (a record or a batch of records)."""
    return items_size((out,))


def restored_lanes(plan: Plan, topology: Topology, options: Options, checkpoint: Any) -> dict[int, Any]:
    """This rank's lane states from ``checkpoint``, validated against ``plan`` (lanes decoded here
    are verified there, so each state is read once)."""
    lanes = topology.lanes
    validate(plan.fingerprint(), checkpoint, decoded_next=lanes if options.decodes_inline else ())
    return select_lanes(checkpoint, lanes)


class Loader(Iterator[Any]):
    """Runs a pipeline's lanes for one rank and yields their outputs in lane order: the ``k``-th
    group of ``len(topology.lanes)`` outputs is this rank's share of global step ``k``.
    ``checkpoint()`` covers exactly the outputs yielded; ``restore()`` resumes exactly, in place.
    """

    def __init__(self, plan: Plan, topology: Topology, options: Options = Options(), encoded: dict[int, Any] | None = None):
        if options.drain and options.agree_on_end:
            raise ValueError(
                "options: drain=True and agree_on_end=True exclude each other: a drained tail is not a whole "
                "global step, so ranks cannot agree on it; pick one"
            )
        self.plan, self.topology, self.options = plan, topology, options
        # Automatic agreement only when D comes from torch.distributed.
        auto = options.agree_on_end is None and options.dp_degree is None
        self._dist = distributed_group() if (options.agree_on_end or auto) else None
        self.executor: Any = None
        self._last_lane = topology.lanes[-1]  # a global step is whole once it delivers
        self._keyframes_failed = False
        self._start(encoded)

    def _start(self, encoded: dict[int, Any] | None) -> None:
        """Start over from ``encoded`` (or the beginning); a state that does not decode changes nothing."""
        lanes = list(self.topology.lanes)
        opts = self.options
        states = None
        t0 = time.perf_counter()
        if opts.decodes_inline:
            states = self.plan.decode_lanes(encoded) if encoded else {lane: self.plan.init(lane) for lane in lanes}
        if self.executor is not None:
            self.executor.close(read_final=False)  # replaced: its states are not needed
        if opts.workers:
            executor: Any = ProcessExecutor(self.plan, lanes, opts.workers, encoded=encoded, credit=opts.prefetch)
        else:
            executor = ThreadExecutor(self.plan, states, opts.prefetch) if opts.thread else InlineExecutor(self.plan, states)
        self.executor = executor
        self.delivered = {lane: (int(encoded[lane]["delivered"]) if encoded else 0) for lane in lanes}
        self._pulled = dict(self.delivered)  # outputs taken from the executor, yielded or not
        self._due = sorted((n, lane) for lane, n in self._pulled.items())  # a heap of the live lanes: (pulled, lane)
        self._unyielded: deque = deque()  # taken, not yet yielded (a step being agreed on)
        self.ended: dict[int, int] = {}
        self.finished = False
        self._final_states: dict[int, Any] | None = None
        self._final_reports: dict[int, Any] | None = None
        self._closed = False  # by close(): the stream does not go on (the end of the data is not a close)
        self._undelivered = {lane: [0, 0, 0] for lane in lanes}  # outputs, records, tokens
        self._final_meters: dict[str, Any] | None = None
        self._deliveries = Deliveries()
        self._skips = skips_of(encoded) if encoded else ()  # (first step, count) of every skip of the run
        # skip_steps() since the start; from_keyframes: the skipped steps a keyframe restore passed over
        self._skipped = Counter(steps=0, from_keyframes=0, outputs=0, discarded=0, seconds=0.0)
        self._next_log = opts.log_every or 0
        topo = self.topology
        where = f"{opts.workers} worker process(es)" if opts.workers else ("a background thread" if opts.thread else "the calling thread")
        log.info(
            "%s rank %d of %d: lanes %d-%d of %d in %s%s",
            "restored" if encoded else "started", topo.dp_rank, topo.dp_degree, lanes[0], lanes[-1], topo.canonical_replicas, where,
            f" ({time.perf_counter() - t0:.2f} s to decode the lane states)" if encoded and states is not None else "",
        )

    def restore(self, checkpoint: dict[str, Any]) -> "Loader":
        """Resume exactly from ``checkpoint`` (this rank's, merged, or full), in place; fails,
        listing the differing fields, if the data settings differ."""
        self._start(restored_lanes(self.plan, self.topology, self.options, checkpoint))
        return self

    def close(self) -> None:
        """Stop any worker thread or processes (idempotent); ``checkpoint()`` and ``stats()`` still
        work, and ``next()`` before the end of the data raises ``RuntimeError``."""
        self._closed = True
        self.executor.close(read_final=self._final_states is None)

    def _check_open(self) -> None:
        if self._closed and not self.finished:
            raise RuntimeError(
                "next() on a closed loader: close() (or leaving its `with` block) "
                "stopped it before the end of its data, and its stream does not go on. checkpoint() and stats() "
                "still work: loader.restore(loader.checkpoint()) continues from here, iter(pipeline) starts a new loader"
            )

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> Any:
        self._check_open()
        waited = self._deliveries.start_wait()
        agree = self.options.agree_on_end and self._dist is not None
        if agree and not self._unyielded and self._take_step() is None:
            raise StopIteration
        out = self._unyielded.popleft() if agree else self._pull()
        if out is None:
            raise StopIteration
        self._deliver(out, waited)
        return out

    def _deliver(self, out: Any, waited: float) -> None:
        """Count one output handed to the caller (``waited``: when the caller started waiting)."""
        lane = out_lane(out)
        self.delivered[lane] += 1
        n = self.delivered[lane]
        if self.options.keyframes and lane == self._last_lane and not n % self.options.keyframe_every:
            if not self._keyframes_failed and min(self.delivered.values()) == n:
                self._save_keyframe(n)
        d = self._deliveries
        d.add(out)
        d.end_wait(waited)
        if self._next_log and d.outputs >= self._next_log * len(self.delivered):
            self._next_log += self.options.log_every
            light = summarize(operators={}, meter=None, deliveries=d)
            log.info("%s", summary_line({"complete_steps": self.next_step, **light}))

    def steps(self, *, concat: bool = False) -> Iterator[Any]:
        """Iterate by optimizer step: this rank's microbatches of each global step, in lane order
        (``concat``: one :class:`~zephon.types.SampleBatch` of them). With ``torch.distributed`` and
        D > 1 every rank stops at the same step (off with ``options(agree_on_end=False)``)."""
        while True:
            waited = self._deliveries.start_wait()
            group = self._take_step()
            if group is None:
                return
            self._unyielded.clear()
            for out in group:
                self._deliver(out, waited)
                waited = self._deliveries.last or waited
            if concat:
                yield SampleBatch(tuple(r for b in group for r in b.records), getattr(group[0], "pad_token_id", None))
            else:
                yield group

    @property
    def next_step(self) -> int:
        """The global step the next :meth:`steps` iteration delivers (skips and restores count)."""
        return min(self.delivered.values())

    @property
    def skips(self) -> tuple[tuple[int, int], ...]:
        """Every skip of this run, restored ones included: ``(first global step, count)`` pairs."""
        return self._skips

    def skip_steps(self, n: int) -> SkippedSteps:
        """Skip the next ``n`` global steps, as the uninterrupted run would deliver them: the
        operators produce them (from the newest keyframe before the target, with
        ``options(keyframes=...)``) and they are dropped unconverted. Every rank must skip the same
        steps; the skip is recorded in later checkpoints (:attr:`skips`).

        Returns a :class:`~zephon.runtime.skip_steps.SkippedSteps` for ``Ledger.record_skip``.
        ValueError: ``n`` is not an int >= 0, or this rank is inside a global step.
        """
        n = check_count(n)
        self._check_open()
        counts = set(self.delivered.values())
        if len(counts) > 1 or self._unyielded:
            raise ValueError(
                f"skip_steps({n}): this rank is inside global step {min(counts)} (lanes delivered "
                f"{dict(self.delivered)}); skip between whole steps: take the rest of the step first, or iterate "
                "with steps()"
            )
        first = counts.pop()
        if n and self.finished:
            message = f"skip_steps({n}): the data already ended at step {first}; nothing to skip"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        if not n or self.finished:
            return SkippedSteps(first, 0, first if n else None)
        t0 = time.perf_counter()
        keyframe = self._to_keyframe(first, first + n) if self.options.keyframes else None
        reached, discarded = self.executor.skip({lane: first + n for lane in self.delivered})
        seconds = time.perf_counter() - t0
        self.delivered.update(reached)
        self._pulled.update(reached)
        end = min(reached.values())
        done = SkippedSteps(first, n, end if end < first + n else None, discarded, seconds, keyframe)
        self._skips += ((first, n),)
        self._skipped.update(
            steps=n, outputs=sum(reached.values()) - first * len(reached), discarded=discarded,
            from_keyframes=0 if keyframe is None else keyframe - first, seconds=seconds,
        )
        log.info("%s in %.2f s; %d outputs read ahead dropped", done, seconds, discarded)
        if done.ended_at is not None:
            warnings.warn(
                f"skip_steps({n}): the data ends at step {end}, inside the steps skipped from step {first}; the loader "
                "stops there (use an endless source, exhausted_policy='repeat', to skip any number of steps)",
                RuntimeWarning, stacklevel=2,
            )
        return done

    def _to_keyframe(self, first: int, target: int) -> int | None:
        """Restart from the newest keyframe in ``(first, target]``, keeping this run's skips and
        mixture counts; its step, or ``None``."""
        found = latest_keyframe(self.options.keyframes, self.plan.fingerprint(), self.topology.lanes, first, target)
        if found is None:
            return None
        step, states = found
        skips, skipped = self._skips, self._skipped
        self._start(from_keyframe(states, self._delivered_states()))
        self._skips, self._skipped = skips, skipped
        return step

    def _save_keyframe(self, step: int) -> None:
        """Save the lane states of global step ``step`` as a keyframe; a failure warns once and
        ends the saving, never the run."""
        try:
            save_keyframe(self.options.keyframes, step, self.checkpoint(), self.options.keyframe_keep)
        except OSError as exc:
            self._keyframes_failed = True
            warnings.warn(
                f"keyframes: cannot save step {step} in {self.options.keyframes} ({exc}); this loader saves no more "
                "keyframes, so skip_steps produces every skipped step (the data stays exact)",
                RuntimeWarning, stacklevel=4,
            )

    def next_lane(self) -> int:
        """The live lane due next: fewest outputs pulled, then the lowest id."""
        return self._due[0][1]

    def _pull(self) -> Any:
        """The next output in lane order, or ``None`` at the end of this rank's data (and finish)."""
        while not self.finished:
            lane = self.next_lane()
            out = self.executor.next(lane)
            if out is not None:
                self._pulled[lane] += 1
                heapq.heapreplace(self._due, (self._pulled[lane], lane))
                return out
            heapq.heappop(self._due)
            self.ended[lane] = self._pulled[lane]
            if not self.options.drain or len(self.ended) == len(self._pulled):
                self._finish()
        return None

    def _take_step(self) -> list | None:
        """This rank's next whole global step, agreed with every rank when distributed; else ``None``."""
        self._check_open()
        per_step = len(self.topology.lanes)
        group: list = list(self._unyielded)
        while len(group) < per_step and not self.finished:
            out = self._pull()
            if out is None:
                break
            group.append(out)
            self._unyielded.append(out)
        whole = len(group) == per_step
        if self._dist is not None:
            whole = all_ranks_have(whole, self._dist)
        if whole:
            return group
        if not self.finished:
            self._finish()
        return None

    def _finish(self) -> None:
        """End of data: keep the delivered states, count what was produced and not delivered, stop."""
        self.finished = True
        ex = self.executor
        self._final_states = ex.lane_states()
        for out in self._unyielded:
            self._count_undelivered(out)
        live = [lane for lane in self._pulled if lane not in self.ended]
        while live:  # what the lanes still had: counted, not delivered (round-robin, as executors run ahead)
            for lane in list(live):
                out = ex.next(lane)
                if out is None:
                    live.remove(lane)
                else:
                    self._count_undelivered(out)
        self._final_reports, self._final_meters = ex.reports(), ex.meters()
        ex.close(read_final=False)
        outputs, records, tokens = self._undelivered_totals()
        log.info(
            "end of data after %d complete steps: %d outputs delivered, %d produced and not delivered (%d records, %d tokens)",
            min(self.delivered.values()), sum(self.delivered.values()), outputs, records, tokens,
        )
        if not outputs:
            return
        empty = [lane for lane, n in self.ended.items() if n == 0]
        lanes = [lane for lane, c in self._undelivered.items() if c[0]]
        msg = (
            f"end of data: {outputs} output(s) ({records} records, {tokens} tokens) of lanes {lanes} were produced "
            "but not delivered, because iteration stops at the first incomplete global step (a step takes one "
            "output from every lane)"
        )
        if empty:
            msg += f"; lanes {empty} produced no output at all (fewer samples than lanes, or everything was dropped)"
        if self._dist is not None:
            msg += "; ranks stopped together at the last step every rank had whole"
        msg += (
            ". Pass options(drain=True) to receive the rest (the drained tail is the same only for the same "
            "data-parallel size), use an endless source (exhausted_policy='repeat') with a fixed step count, or "
            "lower canonical_replicas. stats()['undelivered'] has the counts per lane."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _count_undelivered(self, out: Any) -> None:
        counts = self._undelivered[out_lane(out)]
        for i, n in enumerate((1, *output_size(out))):
            counts[i] += n

    def _undelivered_totals(self) -> tuple[int, int, int]:
        """Outputs, records and tokens produced and not delivered, over this rank's lanes."""
        return tuple(sum(c[i] for c in self._undelivered.values()) for i in range(3))  # type: ignore[return-value]

    def checkpoint(self) -> dict[str, Any]:
        """This rank's lane states after the last output delivered, keyed by global lane id (merge
        ranks' with :func:`~zephon.merge_checkpoints`; restore on any D dividing L)."""
        return build(self.plan.fingerprint(), self._delivered_states())

    def lane_state(self, lane: int) -> dict[str, Any]:
        """One lane's encoded state (unsealed) after its last output delivered."""
        if self._final_states is None and isinstance(self.executor, InlineExecutor) and not self._unyielded:
            return self._with_skips(self.plan.encode(self.executor.states[lane]))  # in-process executors keep values
        return self._delivered_states()[lane]

    def _with_skips(self, encoded: dict[str, Any]) -> dict[str, Any]:
        """An encoded lane state with the run's ``skipped_steps`` field, once there are some."""
        return {**encoded, "skipped_steps": [[a, n] for a, n in self._skips]} if self._skips else encoded

    def _delivered_states(self) -> dict[int, Any]:
        """The encoded lane states after the last output delivered (what a checkpoint holds)."""
        states = self._final_states if self._final_states is not None else self.executor.lane_states()
        if self._unyielded:  # taken from the lanes but not delivered: give them back
            states = dict(states)
            for lane in {out_lane(o) for o in self._unyielded}:
                states[lane] = self.plan.unread(states[lane], [o for o in self._unyielded if out_lane(o) == lane])
        return {lane: self._with_skips(state) for lane, state in states.items()} if self._skips else states

    # torch.distributed.checkpoint's ``Stateful`` protocol: one key per lane.
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint as a DCP-friendly mapping (``{"zephon_fingerprint": ..., "lane_00003": ...}``)."""
        return checkpoint_to_state_dict(self.checkpoint())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (possibly saved on another number of ranks)."""
        self.restore(state_dict_to_checkpoint(state_dict))

    def stats(self) -> dict[str, Any]:
        """What this loader has done (cheap, always on; one round trip to worker processes):
        ``delivered``, ``complete_steps``, ``lanes``, ``undelivered``, ``skipped_steps``,
        ``operators``, ``flow``, ``throughput``, ``packing``, ``dropped``, ``mixture`` and
        ``skipped``, described in docs/guide/observability.md (ratios are ``None`` until defined).
        """
        reports = self._final_reports if self._final_reports is not None else self.executor.reports()
        meters = self._final_meters if self._final_reports is not None else self.executor.meters()
        summed: dict[str, Counter] = {}
        for lane_report in reports.values():
            for name, counters in lane_report.items():
                summed.setdefault(name, Counter()).update(counters)
        ops = {name: dict(counters) for name, counters in summed.items()}
        names = ("outputs", "records", "tokens")
        delivered_states = self._delivered_states()
        return {
            "delivered": sum(self.delivered.values()),
            "complete_steps": self.next_step,
            "lanes": {
                lane: {"delivered": n, "ended": lane in self.ended, "undelivered": dict(zip(names, self._undelivered[lane]))}
                for lane, n in self.delivered.items()
            },
            "undelivered": dict(zip(names, self._undelivered_totals())),
            "operators": ops,
            "skipped_steps": {**self._skipped, "ranges": [[a, a + k - 1] for a, k in self._skips]},
            **summarize(operators=ops, meter=meters, deliveries=self._deliveries),
            "mixture": mixture_report(self.plan.source, {lane: s["mixture"] for lane, s in delivered_states.items()}),
            "skipped": skip_report(self.plan, delivered_states),
        }

    def stats_table(self) -> str:
        """:meth:`stats` rendered as a plain-text report (print it)."""
        return format_stats(self.stats())


def out_lane(out: Any) -> int:
    """The lane an output came from (every output is lane-pure)."""
    return out.lane if isinstance(out, SampleBatch) else out.meta.lane

