"""CPU time and peak memory of this process and every process under it, for the benchmarks.

Worker processes are not always this process's children: with the ``forkserver`` start method
they are children of the fork server, so ``getrusage(RUSAGE_CHILDREN)`` sees them only once the
fork server itself has ended, and a list of this process's children holds the fork server, not
the workers. Both readings here walk the whole tree under this process instead (Linux ``/proc``;
elsewhere only what ``getrusage`` gives).
"""

from __future__ import annotations

import os
import resource


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``[]`` without ``/proc``)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids.extend(int(k) for k in fh.read().split())
    except OSError:
        pass
    return kids


def descendants(pid: int | None = None) -> list[int]:
    """The live processes under ``pid`` (default: this one), children first; ``[]`` without ``/proc``."""
    out: list[int] = []
    todo = children(os.getpid() if pid is None else pid)
    while todo:
        kid = todo.pop(0)
        out.append(kid)
        todo.extend(children(kid))
    return out


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process, of its ended children, and of every live process
    under it together with the ended children those have waited for.

    The difference of two readings is the CPU the whole tree spent between them, as long as no
    process under this one ended without being waited for in between.
    """
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in descendants():
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the name: state, ppid, ... utime (14th field of the line), stime, cutime, cstime.
        total += sum(int(f) for f in fields[11:15]) / tick
    return total


def descendants_peak_rss_mib(only_workers: bool = False) -> dict[int, float]:
    """Peak RSS (``VmHWM``) of each live process under this one, in MiB (``{}`` without ``/proc``).

    ``only_workers`` keeps the processes that run work: not multiprocessing's resource tracker, and
    not a process with children of its own (the fork server, whose children are the workers). A
    forked process's high-water mark starts at its parent's size, so ``getrusage`` cannot stand in.
    """
    out: dict[int, float] = {}
    for pid in descendants():
        try:
            if only_workers:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read()
                if b"resource_tracker" in cmd or children(pid):
                    continue
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        out[pid] = int(line.split()[1]) / 1024
                        break
        except OSError:
            continue
    return out
