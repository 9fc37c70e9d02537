"""What every executor shares: worker failure, the closed executor, how workers start.

An executor (inline, thread or process) hands out a rank's lanes' outputs one lane at a time
(``next(lane)``), with ``lane_states()``, ``reports()``, ``meters()``, ``skip()`` and ``close()``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing import spawn
from typing import Any, Iterator


#: What the fork server imports once for every worker forked from it (missing ones are skipped).
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
    """The start method of workers and replays: ``forkserver`` (``spawn`` where there is none),
    whose server (shared with other uses) preloads :data:`_PRELOAD` when zephon starts it."""
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
    """Start the fork server now (it imports in the background), so later workers fork from a
    ready server. Idempotent."""
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
    """Processes started on this thread inside the block do not run the caller's main script at
    their start (its imports would delay every worker); yields the script's path (``None``: none)
    for them to run only when needed (:func:`~zephon.runtime.process_worker.loads`). Other
    threads are unaffected: a wrapper of ``spawn.get_preparation_data`` acts for this one only.
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


#: How long :func:`shutdown` waits for workers to exit on their own before it terminates them.
_STOP_GRACE_S = 0.2


def shutdown(conns: list, procs: list) -> None:
    """Stop worker processes: ask, then past a short grace terminate (they hold nothing to flush)."""
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.send(("stop",))
    grace = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, grace - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """Ignore SIGINT (main thread only) while workers are started, so that they ignore it from
    their first instruction on (an ignored signal stays ignored across ``exec``)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
