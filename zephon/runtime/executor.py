"""What every executor shares: worker failure, the closed executor, lane order, how workers start.

An executor hands out a rank's lanes' outputs one lane at a time (``next(lane)``), with their
encoded states (``lane_states()``), counters (``reports()``, ``meters()``) and ``close()``: inline
(:mod:`~zephon.runtime.inline_executor`), in a background thread
(:mod:`~zephon.runtime.thread_executor`) or in worker processes
(:mod:`~zephon.runtime.process_executor`). Only these modules know about threads and processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
from multiprocessing import spawn
from typing import Any, Iterator

from .lanes import LaneState, caller_order

#: What the fork server imports once, so that a worker forked from it starts with them (a module
#: that is not installed is skipped).
_PRELOAD = (
    "__main__",
    "zephon",
    "zephon.runtime.process_worker",
    "zephon.io",
    "zephon.ops",
    "zephon.ops.tokenize",  # not imported by zephon.ops: unpickling a tokenizing plan would import it
    "zephon.ops.chat",
    "importlib.metadata",
    "tokenizers",
    "tiktoken",
)


def start_context() -> Any:
    """The start method of workers and replays: ``forkserver`` (``spawn`` where there is none).

    The server is spawned (a clean, single-threaded interpreter, safe with the caller's threads),
    imports :data:`_PRELOAD` once and forks each worker with the imports done. It is shared with
    any other use of ``forkserver``; zephon adds its modules to its preload only before it runs.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is None:
        preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
        ctx.set_forkserver_preload(preload + [m for m in _PRELOAD if m not in preload])
    return ctx


def prestart() -> None:
    """Start the fork server now (it imports in the background), so that workers started later by
    ``iter()`` fork from a ready server. Idempotent; the caller does not wait for the imports."""
    from multiprocessing import forkserver

    # Not while this process is itself set up as a worker or server: the server would start servers.
    if getattr(mp.current_process(), "_inheriting", False) or start_context().get_start_method() != "forkserver":
        return
    with ignoring_sigint():
        forkserver.ensure_running()


_inner_preparation_data = spawn.get_preparation_data  # what the wrapper below passes through to
_lean = threading.local()
_wrapped = False


def _preparation_data(name: str) -> dict[str, Any]:
    """``multiprocessing``'s start data for a child, without the main script inside :func:`without_main`."""
    data = _inner_preparation_data(name)
    if getattr(_lean, "active", False):
        data.pop("init_main_from_path", None)
    return data


@contextlib.contextmanager
def without_main() -> Iterator[str | None]:
    """Processes started on this thread inside the block do not run the caller's main script at their
    start; yields that script's path (``None``: none, e.g. a notebook, or ``python -m``, whose module a
    child still imports when it starts), to be given to them.

    A spawned or fork-server child runs the parent's script (as ``__mp_main__``) before its target,
    so that functions defined in it unpickle. A training script's imports (torch: about a second)
    would then delay every worker's start; a worker runs the script later, only when what it is
    sent refers to it (:func:`~zephon.runtime.process_worker.loads`). Other threads' starts are
    unaffected: the start data is changed only for this thread, by a wrapper of
    ``multiprocessing.spawn.get_preparation_data`` that is installed once and passes everything
    else through.
    """
    global _inner_preparation_data, _wrapped
    if not _wrapped:  # wraps whatever is there, once (a wrapper of it installed later keeps it in its chain)
        _inner_preparation_data, spawn.get_preparation_data, _wrapped = spawn.get_preparation_data, _preparation_data, True
    _lean.active = True
    try:
        yield _inner_preparation_data("zephon").get("init_main_from_path")
    finally:
        _lean.active = False


class WorkerError(RuntimeError):
    """A worker process failed; the message names its lanes and the cause."""


def closed_error() -> RuntimeError:
    return RuntimeError(
        "this executor was closed; checkpoint() still works. Call restore(checkpoint) on the loader to "
        "resume it, or iter(pipeline) for a new one"
    )


def caller_order_of(states: dict[int, LaneState]) -> list[int]:
    """The lanes in the order the caller takes their outputs, so that its next output is computed first."""
    return caller_order({lane: s.delivered for lane, s in states.items()})


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """Ignore SIGINT in this process while workers are started, so that they ignore it from their
    first instruction on (an ignored signal stays ignored across ``exec``; a mask or a handler does
    not), also while importing the main module. Only the main thread may set handlers: from another
    thread the workers ignore SIGINT once they run their own code."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
