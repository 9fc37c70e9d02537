"""Running lanes ahead in worker processes (``workers > 0``): the main process's side.

Each worker (waiting in :mod:`~zephon.runtime.standby`, else started here) owns a fixed subset of
the rank's lanes (:mod:`~zephon.runtime.process_worker`); outputs are handed out in lane order, and
user code runs only in the workers. Kept here per lane: a recent delivered state, so the caller's
states survive stopped workers (replayed in a separate process). A worker that raises reports
lane, record and cause; one that dies, its exit code or signal and the likely cause.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import traceback
import warnings
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable

from .executor import WorkerError, closed_error, ignoring_sigint, shutdown, start_context, without_main
from .lanes import Plan
from .process_worker import replay_main
from .standby import start_worker, take, threads_per_worker
from .bad_records import SkippedRecordWarning
from .stats import merge_meters
from .wire import recv_message

_POLL_S = 0.5
#: How long ``close()`` waits for the workers' final states and counters (else they are replayed).
_CLOSE_READ_S = 10.0


_SIGNAL_CAUSES = {
    "SIGKILL": "the kernel's out-of-memory killer (check `dmesg` or the job's memory limit) or an external `kill -9`",
    "SIGSEGV": "a crash in native code (a tokenizer or another extension library), or a memory-mapped file that was "
    "changed or truncated while in use",
    "SIGBUS": "a memory-mapped file that was truncated or replaced while in use, or a full /dev/shm; also a crash in "
    "native code",
    "SIGTERM": "stopped from outside: a job scheduler (preemption or a time limit), `kill`, or a system shutdown",
    "SIGABRT": "an abort in native code (a failed assertion or a fatal error in an extension library or the interpreter)",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGILL": "native code built for another CPU (an illegal instruction)",
    "SIGHUP": "the terminal or session that started the job went away (run it under nohup, tmux or a scheduler)",
    "SIGPIPE": "a write to a closed pipe or socket",
    "SIGXCPU": "the CPU-time limit (`ulimit -t`) ran out",
    "SIGXFSZ": "the file-size limit (`ulimit -f`) was exceeded",
    "SIGUSR1": "a signal sent by a job scheduler or another process (some schedulers send it before preemption)",
    "SIGUSR2": "a signal sent by a job scheduler or another process",
    "SIGINT": "an interrupt sent to the worker itself (workers ignore SIGINT unless user code re-enables it)",
}


def _death_cause(code: int | None) -> tuple[str, str]:
    """How a worker ended (``exitcode`` of its process), and the likely cause."""
    if code is None:
        return "closed its connection while still running", "it has been stopped"
    if code < 0:
        name = {s.value: s.name for s in signal.Signals}.get(-code)
        how = f"was killed by signal {-code}" + (f" ({name})" if name else "")
        return how, "likely cause: " + _SIGNAL_CAUSES.get(name or "", "a signal sent by another process or by the system")
    if code == 0:
        return "exited with code 0", (
            "it stopped without being asked: user code that calls os._exit(), or a worker that lost its connection "
            "to this process"
        )
    return f"exited with code {code}", (
        "its stderr says why. Usually the worker could not start: a script that starts workers must guard its "
        "entry point with `if __name__ == '__main__':` (worker processes are spawned and import the main module); "
        "or user code called os._exit()"
    )


def _replay_elsewhere(plan_bytes: bytes, jobs: dict[int, tuple[Any, int, bool]]) -> dict[int, tuple[Any, Any]]:
    """``{lane: (encoded state, counters)}`` from :func:`~zephon.runtime.process_worker.replay_main`
    in a separate process (WorkerError: it raised, or died)."""
    ctx = start_context()
    parent, child = ctx.Pipe()
    with ignoring_sigint(), without_main() as main:
        args = (child, plan_bytes, jobs, dict(os.environ), main)
        proc = ctx.Process(target=replay_main, args=args, daemon=True, name="zephon-replay")
        proc.start()
    child.close()
    what = f"rebuilding the delivered states of lanes {sorted(jobs)} (a replay in a separate process)"
    got: dict[int, tuple[Any, Any]] = {}
    try:
        while len(got) < len(jobs):
            try:
                msg = parent.recv()
            except (EOFError, OSError):
                proc.join(timeout=5)
                how, why = _death_cause(proc.exitcode)
                raise WorkerError(f"{what}: the process {how} ({why})") from None
            if msg[0] == "error":
                _, lane, cause, tb = msg
                raise WorkerError(f"{what}: lane {lane} failed: {cause}\n--- traceback ---\n{tb}")
            _, lane, enc, rep = msg
            got[lane] = (enc, rep)
    finally:
        shutdown([parent], [proc])
    return got


class ProcessExecutor:
    """Runs the rank's lanes ahead in ``workers`` processes, each given the pipeline and its lanes'
    encoded states. Kept per lane: the outputs received and not taken, the count delivered, and a
    delivered state."""

    def __init__(self, plan: Plan, lanes: list[int], workers: int, *, encoded: dict[int, Any] | None, credit: int = 4):
        try:
            self.plan_bytes = pickle.dumps(plan)
        except Exception as exc:
            raise TypeError(
                "workers > 0 needs a picklable pipeline (spawned processes): every map/filter function must be "
                f"a module-level function, not a lambda or closure ({type(exc).__name__}: {exc})"
            ) from exc
        n = max(1, min(workers, len(lanes)))
        self.lanes = list(lanes)
        self.owner: dict[int, int] = {lane: i % n for i, lane in enumerate(lanes)}  # lanes w, w+n, ... of the block
        self.conns: list = []
        self.procs: list = []
        self.buffers: dict[int, deque] = {lane: deque() for lane in lanes}
        self.ended: dict[int, int] = {}  # lane -> its output count, once a worker found its end
        self.saw_end: set[int] = set()  # lanes whose end the caller was handed
        self.delivered: dict[int, int] = {lane: int(encoded[lane]["delivered"]) if encoded else 0 for lane in lanes}
        # Per lane: (outputs delivered, encoded state or None for the initial one), to replay from.
        self.base: dict[int, tuple[int, Any]] = {lane: (self.delivered[lane], encoded[lane] if encoded else None) for lane in lanes}
        self.closed = False
        self.failure: str | None = None  # a worker reported an exception: its message
        self.death: str | None = None  # a worker stopped without reporting: how
        self._final_states: dict[int, Any] | None = None
        self._final_reports: dict[int, Any] | None = None
        self._replayed: dict[int, tuple[Any, Any]] = {}  # lane -> (encoded state, counters), rebuilt after the workers stopped
        self._states: dict[tuple[int, int], Any] = {}
        self._reports: dict[int, Any] = {}
        # Skip replies: lane -> (outputs behind it, at its end, its encoded state).
        self._skipped: dict[int, tuple[int, bool, Any]] = {}
        self._meters: dict[int, Any] = {}  # per worker: its last runtime counters (sent with its reports)
        self._finalizer = weakref.finalize(self, shutdown, self.conns, self.procs)
        self._start_workers(n, credit, encoded)

    def _start_workers(self, n: int, credit: int, encoded: dict[int, Any] | None) -> None:
        """Take waiting workers, start the rest, and send each its lanes, states and pipeline."""
        threads = threads_per_worker(n)
        workers = take(n)
        workers += [start_worker(f"zephon-lanes-{self._lanes_of(w)[0]}") for w in range(len(workers), n)]
        env = dict(os.environ)
        for w, (proc, conn) in enumerate(workers):
            self.procs.append(proc)
            self.conns.append(conn)
            sub = {lane: encoded[lane] for lane in self._lanes_of(w)} if encoded else None
            with contextlib.suppress(OSError):  # a dead worker is reported by the first wait for it
                conn.send(("start", self._lanes_of(w), credit, threads, env, self.plan_bytes, sub))

    def _check_open(self) -> None:
        if self.failure is not None or self.death is not None:
            raise WorkerError(self.failure or self.death)
        if self.closed:
            raise closed_error()

    def _pump(self, until: Callable[[], bool], deadline: float | None = None) -> bool:
        """Handle messages until ``until()``; ``False`` if ``deadline`` (monotonic) passed first."""
        while not until():
            self._check_open()
            timeout = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if timeout <= 0:
                return False
            self._receive(wait(self.conns + [p.sentinel for p in self.procs], timeout=timeout))
        return True

    def _receive(self, ready: list) -> None:
        """Handle the messages (and deaths) ``wait`` found ready."""
        for obj in ready:
            if obj in self.conns:
                w = self.conns.index(obj)
                try:
                    msg = recv_message(obj)
                except (EOFError, OSError):
                    self._died(w)
                except Exception as exc:
                    self._fail(
                        f"a message from the worker process for lanes {self._lanes_of(w)} could not be unpickled "
                        f"in this process ({type(exc).__name__}: {exc}): is every payload type importable here?",
                        traceback.format_exc(),
                    )
                self._handle(w, msg)
            else:
                w = [p.sentinel for p in self.procs].index(obj)
                if self.conns[w].poll(0):
                    continue  # read what it sent before dying first
                self._died(w)

    def _handle(self, w: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            self.buffers[msg[1]].append(msg)
        elif kind == "end":
            self.ended[msg[1]] = msg[2]
        elif kind == "state":  # (lane, count) -> encoded state
            self._states[msg[1:3]] = msg[3]
        elif kind == "skipped_steps":
            self._skipped[msg[1]] = msg[2:]
        elif kind == "reports":
            self._reports.update(msg[1])
            self._meters[w] = msg[2]
        elif kind == "warning":  # records a worker skipped (on_error="skip")
            warnings.warn(f"in the worker process for lanes {self._lanes_of(w)}: {msg[1]}", SkippedRecordWarning, 2)
        elif kind == "error":
            _, lane, cause, tb = msg
            where = f"lane {lane} failed in a worker process"
            if lane is None:
                where = f"the worker process for lanes {self._lanes_of(w)} failed"
            self._fail(f"{where}: {cause}", tb)

    def _lanes_of(self, w: int) -> list[int]:
        return [lane for lane, o in self.owner.items() if o == w]

    def _fail(self, message: str, tb: str) -> None:
        self.failure = f"{message}\n--- worker traceback ---\n{tb}" if tb else message
        self._stop()
        raise WorkerError(self.failure)

    def _send(self, w: int, msg: tuple) -> None:
        try:
            self.conns[w].send(msg)
        except OSError:  # the worker is gone: report what it sent last, or how it died
            self._pump(lambda: False)

    def _died(self, w: int) -> None:
        proc = self.procs[w]
        proc.join(timeout=1)
        how, why = _death_cause(proc.exitcode)
        self.death = (
            f"the worker process for lanes {self._lanes_of(w)} {how} without reporting an error ({why}). "
            "checkpoint() still covers exactly the outputs received (rebuilt in a separate process)"
        )
        self._stop()
        raise WorkerError(self.death)

    def next(self, lane: int) -> Any:
        if self.closed:
            self._check_open()
        buf = self.buffers[lane]
        if not buf:
            self._pump(lambda: bool(buf) or lane in self.ended)
            if not buf:
                self.saw_end.add(lane)
                return None
        _, _, count, out, enc = buf.popleft()
        if count != self.delivered[lane] + 1:  # a message lost (an interrupt inside receiving): never skip
            self._fail(f"lane {lane}: output {self.delivered[lane] + 1} was lost in transfer (got {count})", "")
        self.delivered[lane] = count
        if enc is not None:
            self.base[lane] = (count, enc)
        try:
            self._send(self.owner[lane], ("delivered", lane, count))
        except WorkerError:
            if self.failure is not None:
                raise
            # It died after sending this output: the caller gets it; the next call reports it.
        return out

    def skip(self, targets: dict[int, int]) -> tuple[dict[int, int], int]:
        """Move each lane to ``targets[lane]`` outputs delivered (or its end) in its worker,
        dropping the outputs received for the skipped steps; returns the lanes' counts and drops."""
        self._check_open()
        self._skipped = {}
        for lane, target in targets.items():
            self._send(self.owner[lane], ("skip", lane, self.delivered[lane], target))
        self._pump(lambda: set(self._skipped) >= set(targets))
        reached, discarded = {}, 0
        for lane in targets:
            count, at_end, enc = self._skipped[lane]
            buf = self.buffers[lane]
            while buf and buf[0][2] <= count:
                buf.popleft()
                discarded += 1
            self.delivered[lane] = reached[lane] = count
            self.base[lane] = (count, enc)
            if at_end:
                self.ended[lane] = count
        return reached, discarded

    def _live(self, ask: Callable[[], Any]) -> Any:
        """``ask()`` of the running workers; ``None`` once they are gone (closed, or one died)."""
        if self.closed:
            return None
        try:
            return ask()
        except WorkerError:
            if self.death is None:
                raise
        return None

    def lane_states(self) -> dict[int, Any]:
        states = self._live(lambda: self._ask_states(None))
        return states if states is not None else self._stopped_states()

    def _ask_states(self, deadline: float | None, with_reports: bool = False) -> dict[int, Any] | None:
        """The lanes' encoded states after what the caller received (``None``: ``deadline`` passed);
        ``with_reports``: the counters too, kept for :meth:`reports`."""
        want = {(lane, self.delivered[lane]) for lane in self.lanes}
        for lane in self.lanes:
            self._send(self.owner[lane], ("state", lane, self.delivered[lane], lane in self.saw_end))
        if with_reports:
            self._request_reports()
        if not self._pump(lambda: want <= set(self._states) and (not with_reports or set(self._reports) >= set(self.lanes)), deadline):
            return None
        if with_reports:
            self._final_reports = {lane: self._reports[lane] for lane in self.lanes}
        states = {lane: self._states.pop((lane, self.delivered[lane])) for lane in self.lanes}
        self._states.clear()
        for lane, data in states.items():
            if lane not in self.saw_end:  # a replay starts before the end
                self.base[lane] = (self.delivered[lane], data)
        return states

    def _stopped_states(self) -> dict[int, Any]:
        """The caller's states once the workers are gone: kept, or replayed from a kept one."""
        if self.failure is not None:
            raise WorkerError(
                "the worker processes stopped after this failure, so this loader has no state to read; "
                f"Restore the last checkpoint you saved into a new pipeline.\n{self.failure}"
            )
        if self._final_states is None:
            # A kept state serves when it is after exactly the delivered outputs, before any end.
            kept = {lane: data for lane, (count, data) in self.base.items()
                    if count == self.delivered[lane] and data is not None and lane not in self.saw_end}
            rebuilt = self._rebuilt([lane for lane in self.lanes if lane not in kept])
            self._final_states = {lane: kept.get(lane) or rebuilt[lane][0] for lane in self.lanes}
        return dict(self._final_states)

    def _rebuilt(self, lanes: list[int]) -> dict[int, tuple[Any, Any]]:
        """The encoded states and counters of ``lanes`` after exactly the delivered outputs,
        replayed (once) in a separate process, so user code cannot end this one."""
        todo = [lane for lane in lanes if lane not in self._replayed]
        if todo:
            jobs = {lane: (self.base[lane][1], self.delivered[lane], lane in self.saw_end) for lane in todo}
            self._replayed.update(_replay_elsewhere(self.plan_bytes, jobs))
        return {lane: self._replayed[lane] for lane in lanes}

    def reports(self) -> dict[int, Any]:
        reports = self._live(self._ask_reports)
        if reports is not None:
            return reports
        if self._final_reports is None:
            self._stopped_states()  # raises after a failure
            rebuilt = self._rebuilt(self.lanes)
            self._final_reports = {lane: rebuilt[lane][1] for lane in self.lanes}
        return dict(self._final_reports)

    def _ask_reports(self) -> dict[int, Any]:
        """The lanes' counters (and the workers' runtime counters)."""
        self._request_reports()
        self._pump(lambda: set(self._reports) >= set(self.lanes))
        return {lane: self._reports[lane] for lane in self.lanes}

    def _request_reports(self) -> None:
        self._reports = {}
        for w in sorted(set(self.owner.values())):
            self._send(w, ("reports",))

    def meters(self) -> dict[str, Any] | None:
        """The workers' runtime counters as of their last reports."""
        return merge_meters(list(self._meters.values()))

    def close(self, read_final: bool = True) -> None:
        """Stop the workers; with ``read_final``, first keep their delivered states and counters."""
        if self.closed:
            return
        if read_final and self.failure is None and self.death is None:
            deadline = time.monotonic() + _CLOSE_READ_S
            try:
                self._final_states = self._ask_states(deadline, with_reports=True)
            except WorkerError:
                pass  # a worker died or failed: the states are rebuilt when asked for
            except BaseException:
                self._stop()
                raise
        self._stop()

    def _stop(self) -> None:
        self.closed = True
        self._finalizer()

