"""Running lanes ahead in one background thread of this process (``workers=0, thread=True``)."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

from .executor import closed_error
from .inline_executor import InlineExecutor
from .lanes import LaneState, Plan, caller_order
from .skip_steps import skip_lanes, without_counts


def _prefetch(plan: Plan, states: dict[int, LaneState], queues: dict, credits: dict, stop: threading.Event, meter: Any) -> None:
    """The background thread of :class:`ThreadExecutor` (holding no reference to it, so that its
    finalizer can stop this thread)."""
    live = caller_order({lane: s.delivered for lane, s in states.items()})
    ahead = plan.reader(states)
    try:
        while live and not stop.is_set():
            for lane in list(live):
                credits[lane].acquire()
                if stop.is_set():
                    return
                state, out = plan.next(lane, states[lane], meter, ahead)
                if stop.is_set():
                    return
                states[lane] = state
                queues[lane].put(("out", state, out))
                if out is None:
                    live.remove(lane)
    except BaseException as exc:  # hand the failure to the caller, whichever lane it waits on
        for q in queues.values():
            q.put(("error", exc, None))
    finally:
        if ahead is not None:
            ahead.close()


def _stop_prefetch(stop: threading.Event, credits: dict, thread: threading.Thread) -> None:
    """Stop the background thread, waiting briefly (also at exit)."""
    stop.set()
    for sem in credits.values():  # wake the thread wherever it waits for credit
        sem.release()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=5)


class ThreadExecutor(InlineExecutor):
    """Runs lanes ahead in one background thread, up to ``credit`` outputs each, paired with the
    state after them; the caller's states advance only as it takes outputs."""

    def __init__(self, plan: Plan, states: dict[int, LaneState], credit: int = 4):
        self.plan = plan
        self.states = dict(states)  # state after the last output the caller took
        self.lanes = list(states)
        self.credit = credit
        self.closed = False
        self.meter = plan.meter()  # written by the thread; snapshots read it (its lists never change size)
        self._launch()

    def _launch(self) -> None:
        """Start the background thread from the caller's states, with empty queues and full credit."""
        self.queues = {lane: queue.Queue() for lane in self.lanes}
        self.credits = {lane: threading.Semaphore(self.credit) for lane in self.lanes}
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_prefetch, args=(self.plan, dict(self.states), self.queues, self.credits, self.stop, self.meter),
            name="zephon-prefetch", daemon=True,
        )
        self._finalizer = weakref.finalize(self, _stop_prefetch, self.stop, self.credits, self.thread)
        self.thread.start()

    def skip(self, targets: dict[int, int]) -> tuple[dict[int, int], int]:
        """Move each lane to ``targets[lane]`` outputs delivered (or its end): the thread stops,
        what it ran ahead for the skipped steps is dropped (and counted), the rest skipped here,
        and a new thread runs ahead from there."""
        if self.closed:
            raise closed_error()
        self._finalizer()
        discarded, datasets = 0, len(self.plan.source.datasets)
        for lane in self.lanes:
            base = self.states[lane]
            while True:
                try:
                    kind, state, out = self.queues[lane].get_nowait()
                except queue.Empty:
                    break
                if kind != "out" or state.delivered > targets[lane]:
                    break  # a failure, or past the skip: computed again (a failure is raised again there)
                self.states[lane] = without_counts(state, state, base, datasets)
                discarded += out is not None
        ahead = self.plan.reader(self.states)
        try:
            skip_lanes(self.plan, self.states, targets, self.meter, ahead)
        finally:
            if ahead is not None:
                ahead.close()
        self._launch()
        return {lane: self.states[lane].delivered for lane in targets}, discarded

    def next(self, lane: int) -> Any:
        if self.closed:
            raise closed_error()
        kind, state, out = self.queues[lane].get()
        if kind == "error":
            self.queues[lane].put((kind, state, out))
            raise state
        self.credits[lane].release()
        self.states[lane] = state
        return out

    def close(self, read_final: bool = True) -> None:
        if not self.closed:
            self.closed = True
            # The thread wakes at once, or exits after the step it computes.
            self._finalizer()
