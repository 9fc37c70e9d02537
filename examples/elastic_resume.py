"""Elastic resume, end to end: train on 2 ranks, stop, resume on 1 and on 4, compare ledgers.

    python examples/elastic_resume.py [--lanes 4] [--steps 6] [--resume-steps 6]

Each "rank" is a real process of a ``torch.distributed`` gloo group (CPU only). Ranks write a
batch ledger and save the data state with ``torch.distributed.checkpoint``; the resumed runs
must produce exactly the global batches of one uninterrupted single-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from zephon import Pipeline
from zephon import ledger as zledger
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource


def make_data(folder: Path) -> Path:
    """A small corpus of numbered documents (tokenized by a module-level function)."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(4):
        with open(folder / f"shard-{s}.jsonl", "w") as fh:
            for i in range(200):
                n = (i * 7919 + s * 104729) % 57 + 3
                fh.write(json.dumps({"ids": [(i * 31 + j * 17 + s) % 5000 for j in range(n)]}) + "\n")
    return folder


def to_tokens(payload):
    import numpy as np

    return {"input_ids": np.asarray(payload["ids"], dtype=np.int32)}


def build(data: Path, lanes: int) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("docs", data)], {"docs": 1.0}, seed=7, exhausted_policy="repeat", shuffle_within_shard=True)
    return (
        Pipeline(source)
        .options(canonical_replicas=lanes)  # D and rank come from torch.distributed
        .map(to_tokens)
        .pack_flat(max_length=65)
        .shuffle(buffer_size=64, seed=1)
        .batch(microbatch_size=2)
    )


def rank_main(rank: int, world: int, port: int, data: str, lanes: int, start: int, steps: int, ckpt: str, ledger_dir: str, resume: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = build(Path(data), lanes).loader()
    if resume:
        dcp.load({"data": loader}, checkpoint_id=ckpt)  # the loader restores this rank's lanes in place
    with zledger.Ledger(Path(ledger_dir) / f"rank-{rank:03d}.jsonl") as ledger:
        for step, microbatches in zip(range(start, start + steps), loader.steps()):
            batch = [mb.to_training(return_labels=True) for mb in microbatches]  # what a trainer consumes
            assert all(b["input_ids"].shape == (2, 64) for b in batch)
            ledger.record(step, microbatches)
    if not resume:
        dcp.save({"data": loader}, checkpoint_id=ckpt)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume-steps", type=int, default=6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zephon-elastic-") as tmp:
        root = Path(tmp)
        data = str(make_data(root / "data"))
        ckpt = str(root / "ckpt")

        def launch(world: int, start: int, steps: int, name: str, resume: bool) -> Path:
            mp.spawn(rank_main, args=(world, free_port(), data, args.lanes, start, steps, ckpt, str(root / name), resume), nprocs=world, join=True)
            return root / name

        first = launch(2, 0, args.steps, "two-ranks", resume=False)
        runs = {d: launch(d, args.steps, args.resume_steps, f"resume-on-{d}", resume=True) for d in (1, 4)}

        with zledger.Ledger(root / "single" / "rank-000.jsonl") as ledger:
            for step, mbs in zip(range(args.steps + args.resume_steps), build(Path(data), args.lanes).options(dp_degree=1, dp_rank=0).steps()):
                ledger.record(step, mbs)
        reference = zledger.global_digests(zledger.read_ledger(root / "single"))
        before = zledger.global_digests(zledger.read_ledger(first))
        ok = True
        for d, folder in runs.items():
            after = zledger.global_digests(zledger.read_ledger(folder))
            same = {**before, **after} == reference
            ok &= same
            print(f"2 ranks for {args.steps} steps, resumed on {d} rank(s) for {args.resume_steps}: "
                  f"{'identical to' if same else 'DIFFERENT FROM'} the single-process run "
                  f"(step {args.steps} digest {after[args.steps][:16]}...)")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
