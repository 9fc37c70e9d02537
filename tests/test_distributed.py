"""Elastic data parallelism: ranks own lanes; global batches are identical for every D | L."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _util import free_port, global_steps, toy_pipeline
from zephon import load_checkpoint, merge_checkpoints, save_checkpoint
from zephon.ledger import batch_digest
from zephon.testing import outputs_equal

L = 8


def digests(steps):
    return [[batch_digest(b) for b in step] for step in steps]


def test_global_steps_identical_for_every_dp_size():
    reference, _ = global_steps(lambda: toy_pipeline(), L, 1, 12)
    assert all([b.lane for b in step] == list(range(L)) for step in reference)
    for dp in (2, 4, 8):
        got, _ = global_steps(lambda: toy_pipeline(), L, dp, 12)
        assert digests(got) == digests(reference), f"dp={dp} differs"


@pytest.mark.parametrize("d1, d2, k", [(2, 1, 3), (1, 4, 5), (4, 8, 2), (8, 2, 7), (2, 4, 0)])
def test_stop_on_d1_ranks_resume_on_d2_ranks(d1, d2, k):
    reference, _ = global_steps(lambda: toy_pipeline(), L, 1, k + 6)
    _, pipes = global_steps(lambda: toy_pipeline(), L, d1, k)
    merged = json.loads(json.dumps(merge_checkpoints([p.checkpoint() for p in pipes])))
    resumed, _ = global_steps(lambda: toy_pipeline(), L, d2, 6, restore=merged)
    assert digests(resumed) == digests(reference[k:])


def test_resume_mid_step_keeps_the_global_order():
    # Rank 0 of 2 took 3 microbatches (one step and a half); resume on 1 rank.
    reference, _ = global_steps(lambda: toy_pipeline(), 4, 1, 6)
    flat = [b for step in reference for b in step]
    its = [iter(toy_pipeline(4, dp_degree=2, dp_rank=r)) for r in range(2)]
    for _ in range(3):
        next(its[0])
    for _ in range(2):
        next(its[1])
    merged = merge_checkpoints([it.checkpoint() for it in its])
    rest = list(zip(range(10), toy_pipeline(4).restore(merged)))
    # Lanes 0,1 delivered 2 and 1 outputs, lanes 2,3 one each: the next is lane 1's second output.
    assert [b.lane for _, b in rest[:4]] == [1, 2, 3, 0]
    expected = [flat[5], flat[6], flat[7], flat[8]]
    assert outputs_equal([b for _, b in rest[:4]], expected)


def test_topology_errors_teach():
    with pytest.raises(ValueError, match="not divisible"):
        iter(toy_pipeline(6, dp_degree=4, dp_rank=0))
    with pytest.raises(ValueError, match="exceeds canonical_replicas"):
        iter(toy_pipeline(2, dp_degree=4, dp_rank=0))
    with pytest.raises(ValueError, match="dp_rank=4"):
        iter(toy_pipeline(4, dp_degree=4, dp_rank=4))
    with pytest.raises(ValueError, match="global_batch_size"):
        iter(toy_pipeline(4, global_batch_size=10))
    iter(toy_pipeline(4, global_batch_size=16))  # 2 x (4 lanes x 2 per microbatch) is fine


def test_topology_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert toy_pipeline(4).topology().lanes == (2, 3)


def test_restore_needs_the_lanes_of_this_rank():
    ck = toy_pipeline(4, dp_degree=2, dp_rank=0).loader().checkpoint()
    with pytest.raises(ValueError, match="missing \\[2, 3\\]"):
        iter(toy_pipeline(4, dp_degree=2, dp_rank=1).restore(ck))


def test_merge_rejects_conflicts_and_different_settings():
    a = iter(toy_pipeline(2, dp_degree=2, dp_rank=0))
    next(a)
    early = toy_pipeline(2, dp_degree=2, dp_rank=0).loader().checkpoint()
    with pytest.raises(ValueError, match="same step"):
        merge_checkpoints([a.checkpoint(), early])
    with pytest.raises(ValueError, match="different data settings"):
        merge_checkpoints([a.checkpoint(), toy_pipeline(2, seed=3, dp_degree=2, dp_rank=1).loader().checkpoint()])


def test_files_per_rank_and_resume_on_another_size(tmp_path):
    reference, _ = global_steps(lambda: toy_pipeline(), L, 1, 9)
    _, pipes = global_steps(lambda: toy_pipeline(), L, 4, 4)
    for p in pipes:
        save_checkpoint(tmp_path, p)
    assert len(list(tmp_path.glob("zephon-lanes-*.msgpack"))) == 4
    ranks = [load_checkpoint(tmp_path, toy_pipeline(L, dp_degree=2, dp_rank=r)) for r in range(2)]
    its = [r.steps() for r in ranks]
    resumed = [[b for it in its for b in next(it)] for _ in range(5)]
    assert digests(resumed) == digests(reference[4:])


def test_state_dict_round_trip():
    it = iter(toy_pipeline(4, dp_degree=2, dp_rank=1))
    for _ in range(3):
        next(it)
    sd = it.state_dict()
    assert sorted(k for k in sd if k.startswith("lane_")) == ["lane_00002", "lane_00003"]
    q = toy_pipeline(4, dp_degree=2, dp_rank=1).loader()
    q.load_state_dict(sd)
    assert outputs_equal([next(it) for _ in range(4)], [b for _, b in zip(range(4), q)])


def test_describe_step_lists_sources_and_ranges():
    p = toy_pipeline(2)
    info = p.describe_step(3)
    steps, _ = global_steps(lambda: toy_pipeline(), 2, 1, 4)
    assert [d["lane"] for d in info] == [0, 1]
    for lane, entry in enumerate(info):
        batch = steps[3][lane]
        assert [[seg[2:] for seg in r["segments"]] for r in entry["records"]] == [
            [(s.row, s.start, s.end) for s in rec.meta.segments] for rec in batch.records
        ]
        assert all(seg[0] == "web" and seg[1] in ("a", "b") for r in entry["records"] for seg in r["segments"])


SCRIPT = textwrap.dedent(
    """
    import os, sys, json
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _util import toy_pipeline
    from zephon.ledger import Ledger

    def main(rank, world, phase, ckpt_dir, ledger_dir, steps):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["ZEPHON_TEST_PORT"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        loader = toy_pipeline({lanes}).loader()  # D and r come from torch.distributed
        if phase == "resume":
            state = {{"data": loader}}
            dcp.load(state, checkpoint_id=ckpt_dir)
        start = 0 if phase == "first" else {k}
        with Ledger(os.path.join(ledger_dir, f"rank-{{rank:03d}}.jsonl")) as ledger:
            for step, group in zip(range(start, start + steps), loader.steps()):
                ledger.record(step, group)
        if phase == "first":
            dcp.save({{"data": loader}}, checkpoint_id=ckpt_dir)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        world, phase, ckpt_dir, ledger_dir, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        mp.spawn(main, args=(world, phase, ckpt_dir, ledger_dir, steps), nprocs=world, join=True)
    """
)


@pytest.mark.integration
def test_torch_distributed_gloo_save_on_2_resume_on_1_and_4(tmp_path):
    pytest.importorskip("torch")
    from zephon import ledger

    lanes, k, rest = 4, 5, 6
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), lanes=lanes, k=k))

    def launch(world, phase, ckpt, led, steps):
        env = {**os.environ, "ZEPHON_TEST_PORT": str(free_port())}
        subprocess.run([sys.executable, str(script), str(world), phase, str(ckpt), str(led), str(steps)], check=True, env=env, timeout=300)

    launch(2, "first", tmp_path / "ckpt", tmp_path / "run2", k)
    launch(1, "resume", tmp_path / "ckpt", tmp_path / "resume1", rest)
    launch(4, "resume", tmp_path / "ckpt", tmp_path / "resume4", rest)

    with ledger.Ledger(tmp_path / "single" / "rank-000.jsonl") as single:
        for step, group in zip(range(k + rest), toy_pipeline(lanes).steps()):
            single.record(step, group)
    full = ledger.global_digests(ledger.read_ledger(tmp_path / "single"))
    first = ledger.global_digests(ledger.read_ledger(tmp_path / "run2"))
    one = ledger.global_digests(ledger.read_ledger(tmp_path / "resume1"))
    four = ledger.global_digests(ledger.read_ledger(tmp_path / "resume4"))
    assert sorted(first) == list(range(k)) and sorted(one) == sorted(four) == list(range(k, k + rest))
    assert {**first, **one} == full
    assert {**first, **four} == full
