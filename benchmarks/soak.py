"""Soak test of worker processes: a long run with checkpoints, then a resume in a new process.

Run by hand (the test suite never runs it)::

    python benchmarks/soak.py                          # 100,000 batches, 2 workers, a checkpoint every 1,000
    python benchmarks/soak.py --batches 20000 --json soak.json

A first process runs ``--batches`` small batches of an endless in-memory pipeline
(map -> pack_flat -> shuffle -> batch, 4 lanes) with ``--workers`` worker processes, digests every
batch with :func:`zephon.ledger.batch_digest`, saves a checkpoint every ``--every`` batches and
samples the resident memory of itself and of each worker. A second, new process restores one of
those checkpoints, picked at random (``--seed``), runs to the same end and digests its batches.

Checks, each printed as ``ok`` or ``FAIL`` (the exit status is 1 if any fails):

- the resumed digests equal the uninterrupted run's from the checkpoint on;
- RSS (this process and each worker) at the middle and at the end is within ``--rss-tolerance``
  (10 %) of the sample taken after warm-up (10 % of the batches, at least one checkpoint interval);
- no leaked file descriptors, threads or child processes: each process counts them before its
  first ``iter()`` and after ``close()`` once the loader is dropped (a pipeline keeps its latest
  loader, and a closed loader keeps its ended processes' handles until it is collected). The
  standard library's resource tracker, one extra process per Python process that the first
  spawned worker starts and that stays to the end, is started before the first count.

Only the standard library is imported at module level: spawned workers re-import this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from zephon.cli.processes import children

ROWS = 4000  # distinct rows in the (endless) source
LANES = 4
ROW_TOKENS = 128  # pack_flat max_length
BUFFER = 64  # shuffle buffer
MICRO = 4  # records per batch


def to_ids(payload: dict) -> dict:
    """The map step (module level, so workers can import it)."""
    import numpy as np

    n = payload["n"]
    return {"input_ids": (np.arange(n % 97 + 8, dtype=np.int32) * 7 + n) % 50_000}


def build(workers: int, prefetch: int):
    from zephon import Pipeline
    from zephon.io import Dataset, InMemoryShard
    from zephon.work import StaticMixtureWorkSource

    rows = [{"n": i} for i in range(ROWS)]
    data = Dataset.from_dict("soak", {"a": InMemoryShard(rows[: ROWS // 2]), "b": InMemoryShard(rows[ROWS // 2 :])})
    src = StaticMixtureWorkSource([data], {"soak": 1.0}, seed=7, chunk_size=16, exhausted_policy="repeat")
    return (
        Pipeline(src)
        .options(canonical_replicas=LANES, workers=workers, prefetch=prefetch)
        .map(to_ids)
        .pack_flat(ROW_TOKENS)
        .shuffle(BUFFER, seed=11)
        .batch(MICRO)
    )


# -- what a process holds ------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def resources() -> dict[str, Any]:
    """Open file descriptors, threads (Python and OS) and live child processes of this process."""
    import multiprocessing as mp

    mp.active_children()  # lets the standard library drop its references to ended processes
    gc.collect()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "children": len(children(os.getpid())),
        "mp_children": len(mp.active_children()),
    }


def _start_resource_tracker() -> None:
    """Start the standard library's resource tracker (one process per Python process, started by
    the first spawned process and kept to the end) so that the counts before and after compare."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def settle_resources(before: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """The counts after ``close()``, waiting (up to ``timeout``) for threads and processes to finish exiting."""
    deadline = time.monotonic() + timeout
    while True:
        after = resources()
        if all(after[k] <= before[k] for k in before) or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def memory(loader) -> dict[str, float | None]:
    out = {"main": _rss_mib(os.getpid())}
    for i, proc in enumerate(getattr(loader.executor, "procs", [])):
        out[f"worker{i}"] = _rss_mib(proc.pid)
    return out


# -- the two child processes ---------------------------------------------------------------------------


def child_run(task: dict[str, Any]) -> dict[str, Any]:
    from zephon.ledger import batch_digest

    _start_resource_tracker()
    n, every = task["batches"], task["every"]
    ckdir = Path(task["dir"])
    warm = min(n, max(every, n // 10))
    marks = {f"{10 * i}%": n * i // 10 for i in range(1, 11)}  # the trend, in the JSON
    marks.update({"warm": warm, "middle": max(warm, n // 2), "end": n})  # a batch may carry several names
    pipe = build(task["workers"], task["prefetch"])
    before = resources()
    loader = iter(pipe)
    ledger = open(ckdir / "digests.txt", "w")  # written as it goes: a list of 100,000 digests is 12 MiB of RSS
    rss: dict[str, dict] = {}
    ck_s = 0.0
    k = 0
    start = time.perf_counter()
    for k, batch in enumerate(loader, 1):
        ledger.write(batch_digest(batch) + "\n")
        if k % every == 0:
            t = time.perf_counter()
            ck = loader.checkpoint()
            ck_s += time.perf_counter() - t
            (ckdir / f"ck-{k}.json").write_text(json.dumps(ck))
        if k in marks.values():
            taken = memory(loader)
            rss.update({name: taken for name, at in marks.items() if at == k})
        if k == n:
            break
    elapsed = time.perf_counter() - start
    loader.close()
    ledger.close()
    del loader, pipe  # the pipeline keeps its latest loader (and with it the ended processes' handles)
    after = settle_resources(before)
    return {
        "batches": k,
        "seconds": elapsed,
        "batches_per_s": k / elapsed,
        "checkpoints": n // every,
        "checkpoint_ms": 1000 * ck_s / max(1, n // every),
        "rss_mib": rss,
        "marks": marks,
        "before": before,
        "after": after,
    }


def child_resume(task: dict[str, Any]) -> dict[str, Any]:
    from zephon.ledger import batch_digest

    _start_resource_tracker()
    ckdir = Path(task["dir"])
    at, n = task["resume_at"], task["batches"]
    ck = json.loads((ckdir / f"ck-{at}.json").read_text())
    expected = (ckdir / "digests.txt").read_text().split()[at:]
    pipe = build(task["workers"], task["prefetch"])
    before = resources()
    start = time.perf_counter()
    loader = pipe.loader(ck)
    digests: list[str] = []
    first = None
    for batch in loader:
        digests.append(batch_digest(batch))
        if first is None:
            first = time.perf_counter() - start
        if len(digests) == n - at:
            break
    elapsed = time.perf_counter() - start
    loader.close()
    del loader, pipe  # the pipeline keeps its latest loader (and with it the ended processes' handles)
    after = settle_resources(before)
    mismatch = next((i for i, (a, b) in enumerate(zip(digests, expected)) if a != b), None)
    if mismatch is None and len(digests) != len(expected):
        mismatch = min(len(digests), len(expected))
    return {
        "batches": len(digests),
        "expected": len(expected),
        "first_mismatch": None if mismatch is None else at + mismatch,
        "equal": digests == expected and len(expected) == n - at,
        "seconds": elapsed,
        "first_batch_s": first,
        "before": before,
        "after": after,
    }


def _run_child(kind: str, task: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(task)], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {kind} process failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=100_000, help="batches in the uninterrupted run (default 100,000)")
    ap.add_argument("--every", type=int, default=1000, help="batches between checkpoints (default 1,000)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--prefetch", type=int, default=4, help="outputs each lane may run ahead (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="picks the checkpoint to resume from")
    ap.add_argument("--resume-at", type=int, default=None, help="resume from this checkpoint (a multiple of --every) instead")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS change after warm-up (default 0.10)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed for each child process")
    ap.add_argument("--json", default=None, help="also save the figures here")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "TASK"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        kind, task = args.child[0], json.loads(args.child[1])
        result = (child_run if kind == "run" else child_resume)(task)
        print(json.dumps(result))
        return 0

    if args.batches < args.every:
        ap.error("--batches must be at least --every (one checkpoint)")
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="zephon-soak-") as tmp:
        task = {"batches": args.batches, "every": args.every, "workers": args.workers, "prefetch": args.prefetch, "dir": tmp}
        t0 = time.perf_counter()
        run = _run_child("run", task, args.timeout)
        points = list(range(args.every, args.batches, args.every)) or [args.batches]
        at = args.resume_at if args.resume_at is not None else int(np.random.default_rng(args.seed).choice(points))
        resume = _run_child("resume", {**task, "resume_at": at}, args.timeout)
        total = time.perf_counter() - t0

    checks: list[tuple[str, bool, str]] = []
    checks.append(("resumed digests equal", resume["equal"],
                   f"{resume['batches']:,} batches from checkpoint {at:,}"
                   + ("" if resume["equal"] else f"; first mismatch at batch {resume['first_mismatch']}")))
    rss = run["rss_mib"]
    for proc_name in rss.get("warm", {}):
        base = rss["warm"][proc_name]
        vals = [rss[m].get(proc_name) for m in ("warm", "middle", "end") if m in rss]
        if base is None or any(v is None for v in vals):
            checks.append((f"RSS {proc_name}", False, f"not measured: {vals}"))
            continue
        worst = max(abs(v - base) / base for v in vals)
        checks.append((f"RSS {proc_name} (MiB)", worst <= args.rss_tolerance,
                       " / ".join(f"{v:.1f}" for v in vals) + f" (warm / middle / end; max change {100 * worst:+.1f} %)"))
    for name, res in (("run", run), ("resume", resume)):
        b, a = res["before"], res["after"]
        leaked = {k: a[k] - b[k] for k in b if a[k] > b[k]}
        checks.append((f"no leaks ({name} process)", not leaked,
                       ", ".join(f"{k} {b[k]}->{a[k]}" for k in b)))

    print(f"zephon soak: {args.batches:,} batches, {LANES} lanes, {args.workers} workers, prefetch {args.prefetch}, "
          f"a checkpoint every {args.every:,} ({total:.0f} s in all)")
    print(f"  run:    {run['seconds']:.1f} s, {run['batches_per_s']:,.0f} batches/s, checkpoint {run['checkpoint_ms']:.1f} ms "
          f"(mean of {run['checkpoints']}); RSS sampled after batches "
          + " / ".join(f"{run['marks'][m]:,}" for m in ("warm", "middle", "end")))
    print(f"  resume: from batch {at:,}: {resume['seconds']:.1f} s for {resume['batches']:,} batches, "
          f"first batch after {resume['first_batch_s']:.2f} s")
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "resume_at": at, "run": run, "resume": resume,
                                               "checks": checks}, indent=1))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
