"""What a batch costs to cross from a worker process to the main process: in-band pickle vs out of band.

The message is what a worker sends for one output, ``("out", lane, count, batch, None)``, where
``batch`` is a real ``pack_flat(seq) -> batch(8)`` output: 8 records, each with int32
``input_ids`` and ``positions`` of ``seq`` tokens (128 KiB of arrays for 2,049 tokens, 2 MiB
for 32,768). A spawned process sends it
``--count`` times over a ``multiprocessing`` pipe, as a worker's sender thread does; this process
receives each one, as ``ProcessExecutor`` does:

- ``old``: ``send_bytes(ForkingPickler.dumps(msg))`` / ``conn.recv()``, the arrays copied into
  the pickle and out of it;
- ``new``: ``zephon.runtime.wire.send_message`` / ``recv_message``, the arrays sent out of band
  (pickle protocol 5) and received into buffers the rebuilt arrays keep.

Runs alternate, ``--repeats`` times each; the median of each figure is reported: wall time per
batch, and CPU time per batch on each side, with ``new / old``.

Usage::

    python benchmarks/transfer.py [--count 2000] [--seq 2049,32768] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def make_message(seq: int):
    """One worker message holding a real ``pack_flat(seq) -> batch(8)`` output."""
    import numpy as np

    from zephon.ops import Batch, PackFlat
    from zephon.testing import run
    from zephon.types import Meta, Record, Segment

    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1500, size=8 * seq // 700 + 16)
    docs = [Record({"input_ids": rng.integers(0, 50257, n, dtype=np.int32)}, Meta(0, (Segment(0, 0, i, 0, 0, -1),))) for i, n in enumerate(lengths)]
    _, rows = run(PackFlat(seq, algorithm="wrap"), [docs])
    _, batches = run(Batch(8), [rows])
    return ("out", 0, 1, batches[0], None)


def sender(conn, mode: str, seq: int, count: int) -> None:
    """The worker side: send the message ``count`` times, then the CPU seconds it took."""
    from multiprocessing.reduction import ForkingPickler

    from zephon.runtime.wire import send_message

    msg = make_message(seq)
    conn.recv()  # start together with the receiver's clock
    cpu = time.process_time()
    for _ in range(count):
        if mode == "old":
            conn.send_bytes(ForkingPickler.dumps(msg))
        else:
            send_message(conn, msg)
    conn.send(time.process_time() - cpu)


def measure(mode: str, seq: int, count: int) -> dict[str, float]:
    """Per batch: wall seconds, and CPU seconds of the sender and of the receiver."""
    from zephon.runtime.wire import recv_message

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(there, mode, seq, count))
    proc.start()
    there.close()
    receive = here.recv if mode == "old" else (lambda: recv_message(here))
    here.send("go")
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for _ in range(count):
        batch = receive()[3]
        tokens += len(batch.records[0].payload["input_ids"])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sent_cpu = here.recv()
    proc.join()
    if tokens != seq * count:
        raise SystemExit(f"{mode}: the batches arrived with {tokens} tokens, not {seq * count}")
    return {"wall": wall / count, "send_cpu": sent_cpu / count, "recv_cpu": cpu / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="batches of 2,049-token rows sent per run, fewer for longer rows (default 2000)")
    parser.add_argument("--seq", default="2049,32768", help="row lengths to measure, comma-separated (default 2049,32768)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path, alternating (default 3)")
    args = parser.parse_args()
    print(f"{'batch':<16}{'per batch':<20}{'old (in-band)':>15}{'new (out of band)':>19}{'new / old':>11}")
    for seq in (int(s) for s in args.seq.split(",")):
        count = max(50, args.count * 2049 // seq)  # about the same bytes for every length
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(mode, seq, count))
        median = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        for key, label in (("wall", "wall time"), ("send_cpu", "CPU, worker side"), ("recv_cpu", "CPU, main side")):
            old, new = median["old"][key], median["new"][key]
            print(f"{f'[8, {seq}] x{count}':<16}{label:<20}{old * 1e6:>12.1f} us{new * 1e6:>16.1f} us{new / old:>11.2f}")


if __name__ == "__main__":
    main()
