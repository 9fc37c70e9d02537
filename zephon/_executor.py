"""Running lanes: in the calling thread, or ahead in worker processes.

Only this module knows about processes. Workers are spawned (no fork: safe with threads and
native tokenizers), each owning a fixed subset of the rank's lanes. A worker runs its lanes ahead
within a per-lane credit window and sends each output with its index; the main process hands
outputs out in lane order, so the result is the in-process result for any number of workers.

Lane states are pure values, so a worker keeps the state after each output it sent until the
main process confirms delivery; ``checkpoint()`` asks for the state after exactly the outputs the
caller has received. A worker that raises reports the lane and traceback; one that dies is
noticed through its process sentinel within the poll interval. ``close()`` (also on garbage
collection and at interpreter exit) stops every worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from ._lanes import LaneState, Plan

_POLL_S = 0.5


class WorkerError(RuntimeError):
    """A worker process failed; the message names its lanes and the cause."""


class InlineExecutor:
    """Runs lanes in the calling thread; states are kept as values."""

    def __init__(self, plan: Plan, states: dict[int, LaneState]):
        self.plan = plan
        self.states = dict(states)

    def next(self, lane: int) -> Any:
        state, out = self.plan.next(lane, self.states[lane])
        self.states[lane] = state
        return out

    def lane_states(self) -> dict[int, Any]:
        return {lane: self.plan.encode(s) for lane, s in self.states.items()}

    def reports(self) -> dict[int, Any]:
        return {lane: self.plan.reports(s) for lane, s in self.states.items()}

    def close(self) -> None:
        pass


class ThreadExecutor(InlineExecutor):
    """Runs lanes ahead in one background thread of this process (``workers=0, thread=True``).

    The thread computes each lane's next outputs, paired with the state after them, up to
    ``credit`` ahead per lane; the caller's view only advances when it takes an output, so the
    checkpoint is exactly what it received. Tokenizers release the GIL while encoding, so the
    caller's own work (tensor conversion, the training step) overlaps with reading ahead.
    """

    def __init__(self, plan: Plan, states: dict[int, LaneState], credit: int = 4):
        import queue
        import threading

        self.plan = plan
        self.states = dict(states)  # state after the last output the caller took
        self.lanes = list(states)
        self.queues = {lane: queue.Queue() for lane in self.lanes}
        self.credits = {lane: threading.Semaphore(credit) for lane in self.lanes}
        self.stop = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._run, args=(dict(states),), name="zephon-prefetch", daemon=True)
        self.thread.start()

    def _run(self, states: dict[int, LaneState]) -> None:
        live = list(self.lanes)
        try:
            while live and not self.stop.is_set():
                for lane in list(live):
                    while not self.credits[lane].acquire(timeout=0.1):
                        if self.stop.is_set():
                            return
                    state, out = self.plan.next(lane, states[lane])
                    states[lane] = state
                    self.queues[lane].put(("out", state, out))
                    if out is None:
                        live.remove(lane)
        except BaseException as exc:  # hand the failure to the caller, whichever lane it waits on
            for q in self.queues.values():
                q.put(("error", exc, None))

    def next(self, lane: int) -> Any:
        kind, state, out = self.queues[lane].get()
        if kind == "error":
            self.queues[lane].put((kind, state, out))
            raise state
        self.credits[lane].release()
        self.states[lane] = state
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stop.set()
            self.thread.join(timeout=5)


class _Outbox:
    """Sends a worker's messages from a thread, so producing never waits for the pipe to drain."""

    def __init__(self, conn) -> None:
        import queue
        import threading

        self.conn = conn
        self.queue: Any = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="zephon-outbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for msg in iter(self.queue.get, None):
            try:
                self.conn.send(msg)
            except OSError:  # the main process is gone
                return

    def send(self, msg: tuple) -> None:
        self.queue.put(msg)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)


def _worker_main(conn, plan_bytes: bytes, lanes: list[int], encoded: dict[int, Any] | None, credit: int, threads: int) -> None:
    # Set before the plan (and with it the tokenizer library) is unpickled in this process.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if threads > 1 else "false")
    outbox = _Outbox(conn)
    current = None
    try:
        plan: Plan = pickle.loads(plan_bytes)
        states = {}
        for lane in lanes:
            current = lane
            states[lane] = plan.decode(lane, encoded[lane]) if encoded else plan.init(lane)
        history = {lane: deque([(states[lane].delivered, states[lane])]) for lane in lanes}
        credits = {lane: credit for lane in lanes}
        ended: set[int] = set()
        order = deque(lanes)
        while True:
            while conn.poll(0) or not any(credits[lane] > 0 and lane not in ended for lane in lanes):
                msg = conn.recv()
                kind = msg[0]
                if kind == "stop":
                    return
                if kind == "delivered":  # the caller received output number `count` of `lane`
                    _, lane, count = msg
                    credits[lane] += 1
                    hist = history[lane]
                    while len(hist) > 1 and hist[0][0] < count:
                        hist.popleft()
                elif kind == "state":
                    _, lane, count = msg
                    match = [s for c, s in history[lane] if c == count]
                    if not match:
                        raise RuntimeError(f"no state kept for lane {lane} after {count} outputs")
                    outbox.send(("state", lane, count, plan.encode(match[0])))
                elif kind == "reports":
                    outbox.send(("reports", {lane: plan.reports(states[lane]) for lane in lanes}))
            lane = next(lane for lane in order if credits[lane] > 0 and lane not in ended)
            order.remove(lane)
            order.append(lane)
            current = lane
            state, out = plan.next(lane, states[lane])
            states[lane] = state
            if out is None:
                ended.add(lane)
                outbox.send(("end", lane, state.delivered))
                continue
            credits[lane] -= 1
            history[lane].append((state.delivered, state))
            outbox.send(("out", lane, state.delivered, out))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return
    except BaseException as exc:  # report every failure with its lane, then exit
        outbox.send(("error", current, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        outbox.close()


class ProcessExecutor:
    """Runs the rank's lanes ahead in ``workers`` spawned processes."""

    def __init__(self, plan: Plan, lanes: list[int], workers: int, *, encoded: dict[int, Any] | None, credit: int = 4):
        try:
            plan_bytes = pickle.dumps(plan)
        except Exception as exc:
            raise TypeError(
                "workers > 0 needs a picklable pipeline (spawned processes): every map/filter function must be "
                f"a module-level function, not a lambda or closure ({type(exc).__name__}: {exc})"
            ) from exc
        ctx = mp.get_context("spawn")
        n = max(1, min(workers, len(lanes)))
        threads = max(1, (os.cpu_count() or 1) // n)
        self.lanes = list(lanes)
        self.owner: dict[int, int] = {}
        self.conns, self.procs = [], []
        self.buffers: dict[int, deque] = {lane: deque() for lane in lanes}
        self.ended: dict[int, int] = {}
        self.delivered: dict[int, int] = {}
        self.closed = False
        for w in range(n):
            mine = lanes[w::n]
            parent, child = ctx.Pipe()
            sub = {lane: encoded[lane] for lane in mine} if encoded else None
            proc = ctx.Process(target=_worker_main, args=(child, plan_bytes, mine, sub, credit, threads), daemon=True, name=f"zephon-lanes-{mine[0]}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            for lane in mine:
                self.owner[lane] = w
                self.delivered[lane] = encoded[lane]["delivered"] if encoded else 0
        self._finalizer = weakref.finalize(self, _shutdown, self.conns, self.procs)

    # -- receiving ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise WorkerError(
                "the worker processes have stopped (after an error or close()); there is no live state to read. "
                "Restore the last checkpoint you saved into a new pipeline"
            )

    def _pump(self, until) -> None:
        while not until():
            self._check_open()
            ready = wait(self.conns + [p.sentinel for p in self.procs], timeout=_POLL_S)
            for obj in ready:
                if obj in self.conns:
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        self._died(self.conns.index(obj))
                    self._handle(msg)
                else:
                    w = [p.sentinel for p in self.procs].index(obj)
                    if self.conns[w].poll(0):
                        continue  # read what it sent before dying first
                    self._died(w)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, lane, count, out = msg
            self.buffers[lane].append((count, out))
        elif kind == "end":
            self.ended[msg[1]] = msg[2]
        elif kind == "state":
            _, lane, count, data = msg
            self._states[(lane, count)] = data
        elif kind == "reports":
            self._reports.update(msg[1])
        elif kind == "error":
            _, lane, cause, tb = msg
            self.close()
            raise WorkerError(f"lane {lane} failed in a worker process: {cause}\n--- worker traceback ---\n{tb}")

    def _send(self, w: int, msg: tuple) -> None:
        try:
            self.conns[w].send(msg)
        except OSError:  # the worker is gone: report what it sent last, or how it died
            self._pump(lambda: False)

    def _died(self, w: int) -> None:
        proc = self.procs[w]
        proc.join(timeout=1)
        lanes = [lane for lane, o in self.owner.items() if o == w]
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        hint = (
            "out of memory, or killed?"
            if code is None or code < 0
            else "its stderr says why; a script that starts workers must guard its entry point with "
            "`if __name__ == '__main__':` (worker processes are spawned and import the main module)"
        )
        self.close()
        raise WorkerError(f"the worker process for lanes {lanes} {how} without reporting an error ({hint})")

    # -- the executor interface -------------------------------------------------------------------------
    def next(self, lane: int) -> Any:
        buf = self.buffers[lane]
        self._pump(lambda: bool(buf) or lane in self.ended)
        if not buf:
            return None
        count, out = buf.popleft()
        self.delivered[lane] = count
        self._send(self.owner[lane], ("delivered", lane, count))
        return out

    def lane_states(self) -> dict[int, Any]:
        self._check_open()
        self._states: dict[tuple[int, int], Any] = {}
        for lane in self.lanes:
            self._send(self.owner[lane], ("state", lane, self.delivered[lane]))
        want = {(lane, self.delivered[lane]) for lane in self.lanes}
        self._pump(lambda: want <= set(self._states))
        return {lane: self._states[(lane, self.delivered[lane])] for lane in self.lanes}

    def reports(self) -> dict[int, Any]:
        self._check_open()
        self._reports: dict[int, Any] = {}
        for w in range(len(self.conns)):
            self._send(w, ("reports",))
        self._pump(lambda: set(self._reports) >= set(self.lanes))
        return dict(self._reports)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._finalizer()


def _shutdown(conns, procs) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except Exception:
            pass
    for proc in procs:
        proc.join(timeout=2)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        try:
            conn.close()
        except Exception:
            pass
