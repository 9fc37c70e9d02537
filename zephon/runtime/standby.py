"""Worker processes started before ``iter()``, waiting with the pipeline's encoders built.

A worker's start (fork, imports, the tokenizer's encoder: 0.1-0.3 s) would otherwise delay a run's
first batch. :func:`prepare` starts workers in the background and has them build the encoders; the
next :class:`~zephon.runtime.process_executor.ProcessExecutor` :func:`take`\\ s them. A waiting
worker owns no lane and runs no user code; one not taken within :data:`IDLE_S` exits.

State kept (per process, under one lock): the waiting workers and the thread starting them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import socket
import threading
from typing import Any, Sequence

from .executor import ignoring_sigint, shutdown, start_context, without_main
from .process_worker import in_worker, worker_main

#: Seconds a waiting worker stays without being given lanes before it exits.
IDLE_S = 120.0
_SOCKET_BUFFER = 4 << 20


@dataclasses.dataclass
class _Waiting:
    """A started worker without lanes: its process, connection and the encoders sent to it."""

    proc: Any
    conn: Any
    warmed: set = dataclasses.field(default_factory=set)


_POOL: list[_Waiting] = []
_LOCK = threading.Lock()
_starting: threading.Thread | None = None


def _forget() -> None:
    """In a child made by ``fork``: the waiting workers are the parent's, never this process's."""
    global _POOL, _LOCK, _starting
    _POOL, _LOCK, _starting = [], threading.Lock(), None


os.register_at_fork(after_in_child=_forget)


def start_worker(name: str = "zephon-worker") -> tuple[Any, Any]:
    """A new worker process (``process_worker.worker_main``), waiting for lanes, and its connection;
    it runs the caller's script only if its pipeline refers to it."""
    ctx = start_context()
    parent, child = ctx.Pipe()
    widen(parent), widen(child)
    with ignoring_sigint(), without_main() as main:
        proc = ctx.Process(target=worker_main, args=(child, IDLE_S, main), daemon=True, name=name)
        proc.start()
    child.close()
    return proc, parent


def threads_per_worker(workers: int) -> int:
    """The encoder threads of each of ``workers`` workers: their share of the CPUs."""
    return max(1, (os.cpu_count() or 1) // workers)


def prepare(workers: int, encoders: Sequence[Any] = ()) -> None:
    """Have ``workers`` workers waiting, each building ``encoders`` (tokenizer handles), started by
    a background thread; nothing inside a worker or the fork server, or without a fork server."""
    global _starting
    if workers <= 0 or in_worker() or getattr(mp.current_process(), "_inheriting", False):
        return
    if start_context().get_start_method() != "forkserver":
        return
    payload = [((e.fingerprint(), e.backend), e) for e in encoders]
    with _LOCK:
        previous = _starting
        _starting = threading.Thread(target=_fill, args=(previous, workers, payload), name="zephon-standby", daemon=True)
        _starting.start()


def _fill(previous: threading.Thread | None, workers: int, payload: list[tuple[tuple[str, str], Any]]) -> None:
    if previous is not None:
        previous.join()
    threads = threads_per_worker(workers)  # set before the first encode, as for lanes
    with _LOCK:
        _POOL[:] = [w for w in _POOL if w.proc.is_alive()]
        missing = workers - len(_POOL)
    started = []
    for _ in range(max(0, missing)):
        try:
            started.append(_Waiting(*start_worker()))
        except Exception:  # no worker now: the executor starts its own, and reports why
            break
    with _LOCK:  # a worker taken meanwhile is sent nothing more from here
        _POOL.extend(started)
        for waiting in _POOL:
            new = [e for key, e in payload if key not in waiting.warmed]
            if new:
                with contextlib.suppress(Exception):
                    waiting.conn.send(("warm", pickle.dumps(new), threads))
                    waiting.warmed.update(key for key, _ in payload)


def take(workers: int | None = None) -> list[tuple[Any, Any]]:
    """Up to ``workers`` (``None``: all) waiting workers, each ``(process, connection)``; they leave the pool."""
    with _LOCK:
        starting = _starting
    if starting is not None:
        starting.join()  # a start under way: its workers are the quickest to have
    with _LOCK:
        alive = [w for w in _POOL if w.proc.is_alive()]
        count = len(alive) if workers is None else workers
        taken, _POOL[:] = alive[:count], alive[count:]
    return [(w.proc, w.conn) for w in taken]


def discard() -> None:
    """Stop every waiting worker now (they also exit on their own after :data:`IDLE_S`)."""
    taken = take()
    shutdown([conn for _, conn in taken], [proc for proc, _ in taken])


def widen(conn: Any) -> None:
    """Ask for ``_SOCKET_BUFFER``-byte socket buffers on ``conn`` (best effort), so that a batch
    reaches the main process in fewer reads."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):
        return
    with sock:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
