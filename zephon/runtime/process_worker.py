"""The worker side of :mod:`~zephon.runtime.process_executor`: a worker's loop, and the replay process.

A worker runs its lanes ahead within a per-lane credit window and sends each output with its index
(now and then with the lane's encoded state). It keeps the state after each output sent until its
delivery is confirmed; a receiving thread answers state requests from that history, so a
checkpoint never waits for the loop.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing import spawn
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..core.records import SampleBatch, describe_meta
from .lanes import LaneState, Plan, caller_order
from .skip_steps import skip_lanes, without_counts
from .bad_records import forward_warnings
from .wire import pack_message, send_message, send_parts

_in_worker = False


def in_worker() -> bool:
    """Whether this process is a worker or a replay (pipelines built here by user code start no workers)."""
    return _in_worker


def _become_worker() -> None:
    global _in_worker
    _in_worker = True


#: How often a worker attaches a lane's encoded state to an output (bounds a replay's work).
_ATTACH_S = 5.0


def unpicklable_output(msg: tuple, exc: BaseException) -> tuple:
    """The error message for an output of a worker that cannot be pickled: lane, record, cause."""
    kind = msg[0]
    if kind != "out":
        cause = f"a {kind!r} message cannot be sent to the main process: {type(exc).__name__}: {exc}"
        return ("error", None, cause, traceback.format_exc())
    _, lane, count, out, _ = msg
    records = out.records if isinstance(out, SampleBatch) else (out,)
    culprit = records[0] if records else None
    for rec in records:  # name the first record that does not pickle
        try:
            ForkingPickler.dumps(getattr(rec, "payload", rec))
        except Exception:
            culprit = rec
            break
    where = describe_meta(culprit.meta) if hasattr(culprit, "meta") else "the output"
    cause = (
        f"output {count} of lane {lane} cannot be sent between processes ({type(exc).__name__}: {exc}); it holds "
        f"{where}. With workers > 0 every payload must pickle: keep results of map to arrays, numbers, strings, "
        "lists and dicts (no locks, open files, generators or connections), or run with workers=0"
    )
    return ("error", lane, cause, traceback.format_exc())


class _Outbox:
    """Sends a worker's messages from a thread, so producing never waits for the pipe; a message
    that cannot be pickled is reported as an error, and nothing after it is sent."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.queue: Any = queue.Queue()
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="zephon-outbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in iter(self.queue.get, None):
                if self.failed:
                    continue  # after a failure, the main process stops this worker
                try:
                    parts = pack_message(msg)
                except Exception as exc:
                    self.failed = True
                    parts = pack_message(unpicklable_output(msg, exc))
                send_parts(self.conn, parts)
        except OSError:  # the main process is gone
            return
        except BaseException as exc:  # never end silently: the main process would wait forever
            self.failed = True
            with contextlib.suppress(Exception):
                cause = f"the worker's sender thread failed: {type(exc).__name__}: {exc}"
                send_message(self.conn, ("error", None, cause, traceback.format_exc()))

    def send(self, msg: tuple) -> None:
        self.queue.put(msg)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)


def _load_error(exc: BaseException) -> str:
    """Why a worker could not unpickle the pipeline, and what to do."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (AttributeError, ImportError)) or "Can't get attribute" in str(exc):
        return (
            f"the worker could not load the pipeline ({text}). Functions given to map/filter (and any other object in "
            "the pipeline or its records) must be importable by module and name in a fresh process, because workers are spawned "
            "and look them up by name: define them at the top level of a module, not inside "
            "`if __name__ == '__main__':`, inside another function, in a notebook cell or in `python -c`. Move the "
            "function above the `if __name__ == '__main__':` line of your script, or into a module that the script "
            "imports"
        )
    return f"the worker could not load the pipeline ({text})"


def loads(data: bytes, main: str | None) -> Any:
    """``data`` unpickled, after running the caller's script ``main`` as ``__mp_main__`` if it
    refers to it (``__main__`` or ``__mp_main__``), as a spawned process would at its start."""
    if main is not None and (b"__main__" in data or b"__mp_main__" in data):
        process = mp.current_process()
        process._inheriting = True  # as while a spawned process starts: the script's unguarded code may not start processes
        try:
            spawn.import_main_path(main)
        finally:
            del process._inheriting
    return pickle.loads(data)


def take_environment(env: dict[str, str] | None) -> None:
    """Make this process's environment the caller's as of the start (``env``), not the fork server's."""
    if env is not None and env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def _set_threads(threads: int) -> None:
    # Before the first encode. Parallelism "true" even for one thread: the sequential path costs
    # more per token, and RAYON_NUM_THREADS bounds the pool.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("ZEPHON_ENCODER_THREADS", str(threads))


def _wait_for_lanes(conn, idle_s: float | None, main: str | None) -> tuple | None:
    """The ``("start", ...)`` message, building the encoders of each ``("warm", handles, threads)``
    meanwhile; ``None`` on ``stop``, a closed pipe, or ``idle_s`` seconds without a message."""
    while True:
        if idle_s is not None and not conn.poll(idle_s):
            return None
        msg = conn.recv()
        if msg[0] != "warm":
            return msg if msg[0] == "start" else None
        _set_threads(msg[2])
        with contextlib.suppress(Exception):  # built again from the plan, where it fails by lane
            for handle in loads(msg[1], main):
                handle.load_encoder()


def worker_main(conn, idle_s: float | None = None, main: str | None = None) -> None:
    """A worker: waits for its lanes (``("start", lanes, credit, threads, env, plan, states)``),
    then runs them ahead until ``stop``. ``main``: the caller's script."""
    # Only the main process sees a Ctrl-C, so the workers stay alive to answer checkpoint().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _become_worker()
    try:
        start = _wait_for_lanes(conn, idle_s, main)
    except (EOFError, OSError, KeyboardInterrupt):
        return
    if start is None:
        return
    _, lanes, credit, threads, env, plan_bytes, encoded = start
    take_environment(env)
    _set_threads(threads)
    outbox = _Outbox(conn)
    forward_warnings(lambda text: outbox.send(("warning", text)))
    current = None
    try:
        try:
            plan: Plan = loads(plan_bytes, main)
        except Exception as exc:
            outbox.send(("error", None, _load_error(exc), traceback.format_exc()))
            return
        states = plan.decode_lanes({lane: encoded[lane] for lane in lanes}) if encoded else {lane: plan.init(lane) for lane in lanes}
        history = {lane: deque([(states[lane].delivered, states[lane])]) for lane in lanes}
        kept = threading.Lock()  # guards `history` between this loop and the receiving thread
        inbox = _receive(conn, plan, history, kept, outbox)
        meter = plan.meter()
        credits = {lane: credit for lane in lanes}
        attach_at = {lane: time.monotonic() + _ATTACH_S for lane in lanes}
        ended: set[int] = set()
        order = deque(caller_order({lane: s.delivered for lane, s in states.items()}))
        ahead = plan.reader(states)
        while True:
            while not inbox.empty() or not any(credits[lane] > 0 and lane not in ended for lane in lanes):
                msg = inbox.get()
                kind = msg[0]
                if kind == "stop":
                    return
                if kind == "failed":  # in the receiving thread
                    raise RuntimeError(msg[1])
                if kind == "delivered":  # the caller received output number `count` of `lane`
                    _, lane, count = msg
                    credits[lane] += 1
                    with kept:
                        hist = history[lane]
                        while len(hist) > 1 and hist[0][0] < count:
                            hist.popleft()
                elif kind == "reports":
                    outbox.send(("reports", {lane: plan.reports(states[lane]) for lane in lanes}, meter.snapshot()))
                elif kind == "skip":  # the caller skips from `count` to `target` outputs of `lane`
                    _, lane, count, target = msg
                    current = lane
                    with kept:
                        uncount(plan, history[lane], count, target)
                    states[lane] = history[lane][-1][1]
                    if lane not in ended and states[lane].delivered < target:
                        ended |= skip_lanes(plan, states, {lane: target}, meter, ahead)
                        with kept:
                            history[lane] = deque([(states[lane].delivered, states[lane])])
                    with kept:
                        outbox.send(skipped_to(plan, lane, target, history[lane], lane in ended))
                    credits[lane] = credit - (states[lane].delivered - min(target, states[lane].delivered))
            lane = next(lane for lane in order if credits[lane] > 0 and lane not in ended)
            order.remove(lane)
            order.append(lane)
            current = lane
            state, out = plan.next(lane, states[lane], meter, ahead)
            states[lane] = state
            with kept:
                history[lane].append((state.delivered, state))  # at the end: once its end was seen
            if out is None:
                ended.add(lane)
                outbox.send(("end", lane, state.delivered))
                continue
            credits[lane] -= 1
            now = time.monotonic()
            enc = None
            if now >= attach_at[lane]:  # now and then, the state after this output rides along
                enc = plan.encode(state)
                attach_at[lane] = now + _ATTACH_S
            outbox.send(("out", lane, state.delivered, out, enc))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return
    except BaseException as exc:  # report every failure with its lane, then exit
        cause = "".join(traceback.format_exception_only(exc)).strip()  # keeps the exception's notes
        outbox.send(("error", current, cause, traceback.format_exc()))
    finally:
        outbox.close()


def _receive(conn, plan: Plan, history: dict[int, deque], kept: threading.Lock, outbox: "_Outbox") -> queue.Queue:
    """Start the thread that reads the caller's messages: it answers ``state`` requests from
    ``history`` and queues the others for the loop (``("stop",)`` once the caller is gone)."""
    inbox: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] != "state":
                    inbox.put(msg)
                    continue
                _, lane, count, at_end = msg
                with kept:
                    match = [s for c, s in history[lane] if c == count]
                if not match:
                    inbox.put(("failed", f"no state kept for lane {lane} after {count} outputs"))
                    return
                outbox.send(("state", lane, count, plan.encode(match[-1] if at_end else match[0])))
        except (EOFError, OSError):
            inbox.put(("stop",))
        except BaseException as exc:  # never end silently: the loop reports it
            inbox.put(("failed", f"the worker's receiving thread failed: {type(exc).__name__}: {exc}"))

    threading.Thread(target=run, name="zephon-inbox", daemon=True).start()
    return inbox


def uncount(plan: Plan, history: deque, count: int, target: int) -> None:
    """Take the mixture counts of the outputs run ahead after ``count`` up to ``target`` (skipped)
    off the states ``history`` keeps."""
    base = next(s for c, s in history if c == count)
    ahead = [s for c, s in history if c <= target][-1]
    datasets = len(plan.source.datasets)
    for i, (c, s) in enumerate(history):
        if c > count:
            history[i] = (c, without_counts(s, ahead, base, datasets))


def skipped_to(plan: Plan, lane: int, target: int, history: deque, ended: bool) -> tuple:
    """The reply to a skip of ``lane`` to ``target`` outputs: its count (fewer where it ended),
    whether it is at its end, and its encoded state there; ``history`` keeps from there on."""
    count = min(target, history[-1][0])
    while len(history) > 1 and history[0][0] < count:
        history.popleft()
    at_end = ended and count == history[-1][0]
    state = [s for c, s in history if c == count][-1 if at_end else 0]
    return ("skipped_steps", lane, count, at_end, plan.encode(state))


def replay_lane(plan: Plan, lane: int, data: Any, delivered: int, at_end: bool) -> LaneState:
    """The lane's state after exactly ``delivered`` outputs, replayed from ``data`` (``None``: the
    start); ``at_end``: the caller saw the lane end, so does the state."""
    state = plan.decode(lane, data) if data is not None else plan.init(lane)
    while state.delivered < delivered:
        state, out = plan.next(lane, state)
        if out is None:
            raise RuntimeError(f"lane {lane} ended after {state.delivered} outputs while replaying to {delivered}")
    if at_end:
        state, out = plan.next(lane, state)
        if out is not None:
            raise RuntimeError(f"lane {lane} did not end after {state.delivered - 1} outputs while replaying")
    return state


def replay_main(conn, plan_bytes: bytes, jobs: dict[int, tuple[Any, int, bool]], env: dict[str, str] | None = None,
                main: str | None = None) -> None:
    """The process that replays lanes after the workers stopped: sends each lane's encoded state
    and counters (``main``: the caller's script)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _become_worker()
    take_environment(env)
    forward_warnings(lambda text: None)  # the workers warned about these records already
    lane = None
    try:
        plan: Plan = loads(plan_bytes, main)
        for lane, (data, delivered, at_end) in jobs.items():
            state = replay_lane(plan, lane, data, delivered, at_end)
            conn.send(("replayed", lane, plan.encode(state), plan.reports(state)))
    except BaseException as exc:
        cause = "".join(traceback.format_exception_only(exc)).strip()
        with contextlib.suppress(OSError):
            conn.send(("error", lane, cause, traceback.format_exc()))
    finally:
        conn.close()
