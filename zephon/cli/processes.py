"""CPU time and peak memory of this process and every process under it, for the benchmarks.

Forkserver workers are the fork server's children, which ``getrusage(RUSAGE_CHILDREN)`` misses,
so both readings walk the whole tree under this process in ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``[]`` without ``/proc``)."""
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids.extend(int(k) for k in (task / "children").read_text().split())
    except OSError:
        pass
    return kids


def descendants() -> list[int]:
    """The live processes under this one, children first; ``[]`` without ``/proc``."""
    out = children(os.getpid())
    for kid in out:  # the list grows while it is walked: breadth first
        out.extend(children(kid))
    return out


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process, its ended children and every live process under
    it with their waited-for children; two readings differ by the tree's CPU between them."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in descendants():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the name: state, ppid, ... utime (14th field of the line), stime, cutime, cstime.
        total += sum(int(f) for f in fields[11:15]) / tick
    return total


def descendants_peak_rss_mib(only_workers: bool = False) -> dict[int, float]:
    """Peak RSS (``VmHWM``) of each live process under this one, in MiB (``{}`` without ``/proc``).

    ``only_workers`` leaves out the resource tracker and processes with children (the fork server).
    """
    out: dict[int, float] = {}
    for pid in descendants():
        try:
            proc = Path(f"/proc/{pid}")
            if only_workers and (b"resource_tracker" in (proc / "cmdline").read_bytes()
                                 or children(pid)):
                continue
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[pid] = int(line.split()[1]) / 1024
                    break
        except OSError:
            continue
    return out
