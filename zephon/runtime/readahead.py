"""Reading ahead: the lanes' next chunks, read and tokenized in a background thread, several at a time.

One thread runs the chain's leading per-record operators (:func:`per_record_prefix`) once over
several lanes' queued chunks, up to ``group`` samples a call, instead of each lane's alone. A lane
uses a chunk only if read from its own source state and size, so it steps exactly as if it had
read it; if the background work fails, each lane reads on its own and raises it. State: per lane
at most one queued chunk, and the thread (not part of a checkpoint).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, NamedTuple, Sequence

from ..core.operator import StatelessOp
from ..text.tokenizer import EXTRA_ENCODER_THREADS
from .bad_records import unreadable
from .stats import items_size

#: The background thread's name (the tiktoken backend gives it one more encoder thread).
THREAD_NAME = "zephon-read-ahead"


def per_record_prefix(chain: Any) -> int:
    """How many leading children of ``chain`` are plain per-record operators (``StatelessOp.step``),
    whose work does not depend on their state."""
    n = 0
    for _, op in chain.children:
        if not isinstance(op, StatelessOp) or type(op).step is not StatelessOp.step:
            break
        n += 1
    return n


class Prepared(NamedTuple):
    """One lane's next chunk, read and run through the chain's per-record operators."""

    source: Any  # the source state after the read
    pointers: list
    exhausted: bool
    inputs: list  # the records read (decoded)
    outputs: list  # after the per-record operators
    applied: tuple[Any, ...]  # per per-record operator: its Applied (inputs that produced nothing, skipped)
    sizes: tuple[tuple[int, int], ...]  # (records, tokens) into each operator, then out of the last
    seconds: tuple[float, ...]  # each operator's share of the grouped call
    read_s: float
    unreadable: list  # (meta, failure) of the rows read that a dataset could not decode


class _Request(NamedTuple):
    lane: int
    key: tuple[Any, int]
    future: Future


class ReadAhead:
    """Prepares an executor's lanes' next chunks in a background thread, from its live ``states``
    (only read), at most ``group`` samples per call."""

    def __init__(self, plan: Any, states: dict[int, Any], group: int) -> None:
        self.plan, self.states, self.group = plan, states, group
        self.queued: dict[int, _Request] = {}
        self.failed = False
        self.started = False  # a chunk read here gave outputs: from then on, misses read for others too
        self._work = _Work(plan, group)
        # Also at exit: a daemon thread inside native code at finalization can abort the process.
        self._finalizer = weakref.finalize(self, self._work.stop)

    def take(self, lane: int, source: Any, size: int) -> Prepared | None:
        """The lane's chunk read from ``source`` with ``size`` (waiting for it); ``None``: read it yourself."""
        if self.failed:
            return None
        key = (source, size)
        request = self.queued.pop(lane, None)
        if request is None or request.key != key:
            request = self._submit(lane, key)
            for other, other_key in self._others(lane, size):
                self.queued[other] = self._submit(other, other_key)
        try:
            return request.future.result()
        except Exception:  # not KeyboardInterrupt: a Ctrl-C while waiting goes to the caller
            self._fail()
            return None

    def stepped(self, lane: int, source: Any, outputs: int, exhausted: bool) -> None:
        """A lane stepped a chunk that left it at ``source`` with ``outputs``: queue its next."""
        self.started = self.started or bool(outputs)
        if self.failed or exhausted or not outputs or lane in self.queued:
            return
        self.queued[lane] = self._submit(lane, (source, self.plan.read_size))

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the call it is in)."""
        self._finalizer()

    def _others(self, lane: int, size: int) -> list[tuple[int, tuple[Any, int]]]:
        """The lanes to read for with ``lane``'s chunk: after it in lane order, not done, nothing
        queued (none until a chunk read here gave outputs)."""
        if not self.started:
            return []
        states = self.states
        lanes = list(states)
        i = lanes.index(lane) if lane in lanes else -1
        total, out = size, []
        for other in lanes[i + 1 :] + lanes[: max(i, 0)]:
            if total >= self.group:
                break
            st = states[other]
            if st.done or other in self.queued:
                continue
            key = (st.source, self.plan.read_size_of(st))
            out.append((other, key))
            total += key[1]
        return out

    def _submit(self, lane: int, key: tuple[Any, int]) -> _Request:
        request = _Request(lane, key, Future())
        self._work.put(request)
        return request

    def _fail(self) -> None:
        """Stop reading ahead; the lanes read on their own once the thread has stopped."""
        self.failed = True
        self.queued.clear()
        self._work.stop()


class _Work:
    """The background thread and its queue of requests, served in groups (holds no ReadAhead)."""

    def __init__(self, plan: Any, group: int) -> None:
        self.plan, self.group = plan, group
        self.requests: deque[_Request] = deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.thread: threading.Thread | None = None  # started with the first request

    def put(self, request: _Request) -> None:
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name=THREAD_NAME, daemon=True)
                self.thread.start()
            self.requests.append(request)
            self.cond.notify()

    def stop(self) -> None:
        """Cancel what waits and end the thread, waiting for the call it is in."""
        with self.cond:
            self.stopped = True
            for r in self.requests:
                r.future.cancel()
            self.requests.clear()
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def run(self) -> None:
        # One more encoder thread: this one encodes while the lanes run Python.
        EXTRA_ENCODER_THREADS.set(1)
        while True:
            with self.cond:
                while not self.requests and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                batch, total = [], 0
                while self.requests and (not batch or total + self.requests[0].key[1] <= self.group):
                    r = self.requests.popleft()
                    batch.append(r)
                    total += r.key[1]
            try:
                results = prepare(self.plan, [(r.lane, r.key) for r in batch])
            except BaseException as exc:  # each lane then reads alone, and the failure is raised there
                for r in batch:
                    r.future.set_exception(exc)
                continue
            for r, p in zip(batch, results):
                r.future.set_result(p)


def prepare(plan: Any, wanted: Sequence[tuple[int, tuple[Any, int]]]) -> list[Prepared]:
    """Read each wanted chunk ``(lane, (source state, size))`` and run the per-record operators once over all."""
    t0 = time.perf_counter()
    reads = []
    for lane, (source, size) in wanted:
        after, pointers, exhausted = plan.source.read(source, plan.lanes, lane, size)
        reads.append((after, pointers, exhausted, *unreadable(plan.fetch(lane, pointers))))
    read_s = time.perf_counter() - t0
    n_total = sum(len(r[3]) for r in reads) or 1
    items = [r[3] for r in reads]
    sizes = [[items_size(x)] for x in items]
    applied: list[list[Any]] = [[] for _ in reads]
    seconds = []
    for _, op in plan.chain.children[: per_record_prefix(plan.chain)]:
        t = time.perf_counter()
        flat = [rec for part in items for rec in part]
        results = op.apply_checked([rec.payload for rec in flat]) if flat else []
        if len(results) != len(flat):
            raise RuntimeError(f"{op.kind}: apply_many returned {len(results)} results for {len(flat)} inputs")
        at = 0
        for j, part in enumerate(items):
            done = op.apply_records(part, results[at : at + len(part)])
            at += len(part)
            items[j] = done.outputs
            applied[j].append(done)
            sizes[j].append(items_size(done.outputs))
        seconds.append(time.perf_counter() - t)
    prepared = []
    for j, (after, pointers, exhausted, inputs, failed) in enumerate(reads):
        share = len(inputs) / n_total
        times = tuple(s * share for s in seconds)
        prepared.append(Prepared(after, pointers, exhausted, inputs, items[j], tuple(applied[j]), tuple(sizes[j]),
                                 times, read_s * share, failed))
    return prepared
