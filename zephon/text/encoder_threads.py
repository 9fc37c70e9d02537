"""Encoder threads: how many, tokenizers' Rayon pool size, and tiktoken's longest-first split.

No state of its own: the pools and the Rayon record live in the tokenizer module's cache.
"""

from __future__ import annotations

import contextvars
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from ..core.cache import ProcessCache
from ..core.log import logger

__all__ = ["EXTRA_ENCODER_THREADS"]

#: Encoder threads beyond one per CPU in this context (the read-ahead thread sets 1).
EXTRA_ENCODER_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("zephon_extra_encoder_threads", default=0)


def _encoder_threads() -> int:
    """The encoder's threads without ``parallelism``: ``ZEPHON_ENCODER_THREADS`` (a worker's share
    of the CPUs), else one per CPU plus :data:`EXTRA_ENCODER_THREADS`."""
    env = os.environ.get("ZEPHON_ENCODER_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)  # a worker's share: one more each would put W more threads on the cores
    return _cpu_count() + EXTRA_ENCODER_THREADS.get()


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def _encode_longest_first(
    one: Callable[[str], np.ndarray], texts: Sequence[str], pool: ThreadPoolExecutor, threads: int
) -> list:
    """``[one(t) for t in texts]`` on this thread and ``threads - 1`` of ``pool``, each taking the
    longest text left (balanced even under preemption); raises once every thread stopped."""
    out: list = [None] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    taken = itertools.count()  # next() on it is atomic: each index goes to one thread
    failed: list[bool] = []

    def drain() -> None:
        try:
            for k in taken:
                if k >= len(order) or failed:  # done, or another thread failed
                    return
                out[order[k]] = one(texts[order[k]])
        except BaseException:
            failed.append(True)
            raise

    futures = [pool.submit(drain) for _ in range(threads - 1)]
    try:
        drain()  # a failure here is raised first, after the wait below
    finally:
        errors = [f.exception() for f in futures]  # waits for every thread
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return out


def _size_rayon_pool(live: ProcessCache, threads: int | None) -> None:
    """Size tokenizers' Rayon pool (``RAYON_NUM_THREADS``) before its first use, else warn once per
    size; its size and the warnings are kept in ``live``, the process's cache."""
    started = live.peek(("rayon",))
    if started is None:
        if threads is not None:
            os.environ["RAYON_NUM_THREADS"] = str(threads)
        env = os.environ.get("RAYON_NUM_THREADS", "")
        live.get(("rayon",), lambda: int(env) if env.isdigit() and int(env) > 0 else _cpu_count())
        return
    if threads is not None and threads != started and live.peek(("rayon-warned", threads)) is None:
        live.get(("rayon-warned", threads), lambda: True)
        logger.warning(
            "tokenize(parallelism=%d): the tokenizers thread pool of this process already runs %d threads and cannot "
            "be resized; the first tokenize to encode in a process sets it (or RAYON_NUM_THREADS, set before that), "
            "and with workers > 0 each worker process sizes its own", threads, started,
        )
