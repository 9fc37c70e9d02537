"""Nothing silent: aligned fields survive packing, the end of data is counted, ranks stop together."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from zephon import Pipeline
from zephon.io import Dataset

IGNORE = -100


def _write_sft_jsonl(path: Path, n: int = 60, seed: int = 0) -> list[dict]:
    """Pre-tokenized SFT rows stored as JSON lists: a prompt (mask 0) then a completion (mask 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt, completion = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        ids = rng.integers(1, 500, size=prompt + completion).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * completion, "id": i})
    path.mkdir(parents=True, exist_ok=True)
    (path / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _expected_row(rows: list[dict], rec) -> tuple[np.ndarray, np.ndarray]:
    """A packed row's tokens and mask rebuilt from the source rows its segments name."""
    ids, mask = [], []
    for seg in rec.meta.segments:
        ids += rows[seg.row]["input_ids"][seg.start : seg.end]
        mask += rows[seg.row]["loss_mask"][seg.start : seg.end]
    pad = rec.meta.padding_length
    return np.array(ids + [0] * pad), np.array(mask + [0] * pad)


PACKERS = {
    "wrap": dict(algorithm="wrap"),
    "first_fit": dict(algorithm="first_fit", num_bins=4, pad_token_id=0),
    "best_fit": dict(algorithm="best_fit", num_bins=4, pad_token_id=0),
    "best_fit_wrap": dict(algorithm="best_fit_wrap", candidate_pool_size=8, pad_token_id=0),
}


@pytest.mark.parametrize("algorithm", sorted(PACKERS))
def test_a_list_loss_mask_from_jsonl_masks_the_labels_for_every_packing_algorithm(tmp_path, algorithm):
    rows = _write_sft_jsonl(tmp_path / "sft")
    pipe = Pipeline(Dataset.from_path("sft", tmp_path / "sft")).pack_flat(17, **PACKERS[algorithm]).batch(2)
    seen = 0
    for batch in pipe:
        out = batch.to_training(return_labels=True, dtype=np.int64)
        assert out["labels"].shape == out["input_ids"].shape
        for b, rec in enumerate(batch.records):
            ids, mask = _expected_row(rows, rec)
            real = len(ids) - rec.meta.padding_length
            assert rec.payload["loss_mask"].tolist() == mask.tolist()
            assert out["input_ids"][b].tolist() == ids[:-1].tolist()
            # labels[t] predicts token t + 1: ignored exactly where its mask is 0 or it is padding
            target_ignored = (mask[1:] == 0) | (np.arange(1, len(ids)) >= real)
            labels = out["labels"][b]
            assert ((labels == IGNORE) == target_ignored).all()
            assert (labels[~target_ignored] == ids[1:][~target_ignored]).all()
            seen += int((~target_ignored).sum())
    assert seen > 0


def test_a_list_loss_mask_survives_pack_sequences(tmp_path):
    rows = _write_sft_jsonl(tmp_path / "sft")
    for env in Pipeline(Dataset.from_path("sft", tmp_path / "sft")).pack_sequences(12):
        for sample, seg in zip(env.payload["packed_samples"], env.meta.segments):
            src = rows[seg.row]
            assert list(sample["loss_mask"]) == src["loss_mask"][seg.start : seg.end]
            assert list(sample["input_ids"]) == src["input_ids"][seg.start : seg.end]


def test_a_list_loss_mask_masks_the_labels_with_unpacked_dynamic_padding(tmp_path):
    rows = _write_sft_jsonl(tmp_path / "sft")
    for batch in Pipeline(Dataset.from_path("sft", tmp_path / "sft")).batch(4):
        out = batch.to_training(return_labels=True, padding="longest", pad_token_id=0, dtype=np.int64)
        for b, rec in enumerate(batch.records):
            src = rows[rec.meta.segments[0].row]
            mask = np.array(src["loss_mask"])
            labels = out["labels"][b]
            n = len(mask)
            assert ((labels[: n - 1] == IGNORE) == (mask[1:] == 0)).all()
            assert (labels[n - 1 :] == IGNORE).all()  # padding


def test_a_misaligned_list_field_is_an_error_naming_the_record(tmp_path):
    (tmp_path / "bad").mkdir()
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5, 6], "loss_mask": [0, 1]}]
    (tmp_path / "bad" / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pipe = Pipeline(Dataset.from_path("bad", tmp_path / "bad")).pack_flat(4)
    with pytest.raises(ValueError, match=r"'loss_mask' in the record from dataset 0, shard 0, row 1 .* has 2 entries"):
        list(pipe)


# -- the end of finite data -------------------------------------------------------------------------


def _five_token_rows(n=2000):
    return [{"input_ids": [i % 7 + 1] * 5} for i in range(n)]


@pytest.mark.parametrize("batched", [False, True])
def test_four_lanes_deliver_nearly_all_tokens_and_drain_delivers_all(batched):
    total = 2000 * 5
    pipe = Pipeline(_five_token_rows()).options(canonical_replicas=4)
    pipe = pipe.batch(8, drop_last=False) if batched else pipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = iter(pipe)
        got = list(loader)
    tokens = sum(5 * (len(o) if batched else 1) for o in got)
    assert tokens >= 0.98 * total
    assert tokens + loader.stats()["undelivered"]["tokens"] == total
    drained = list(pipe.options(drain=True))
    assert sum(5 * (len(o) if batched else 1) for o in drained) == total


def test_every_token_is_delivered_or_counted_with_packing_and_batching():
    rng = np.random.default_rng(1)
    rows = [{"input_ids": list(range(int(n)))} for n in rng.integers(1, 40, size=500)]
    total = sum(len(r["input_ids"]) for r in rows)
    pipe = Pipeline(rows).options(canonical_replicas=4).pack_flat(32, algorithm="first_fit", num_bins=2, pad_token_id=0, oversized="split").batch(4)
    with pytest.warns(RuntimeWarning, match="not delivered"):
        loader = iter(pipe)
        out = list(loader)
    delivered = sum(r.meta.num_tokens for b in out for r in b.records)
    stats = loader.stats()
    ops = stats["operators"]
    assert ops["pack_flat"]["dropped_tokens"] == 0 and ops["pack_flat"]["pending_tokens"] == 0
    accounted = delivered + stats["undelivered"]["tokens"] + ops["batch"]["dropped_tokens_at_end"]
    assert accounted == total
    per_lane = stats["lanes"]
    assert sum(s["undelivered"]["tokens"] for s in per_lane.values()) == stats["undelivered"]["tokens"]


def test_the_warning_says_drain_only_when_it_would_help():
    with pytest.warns(RuntimeWarning, match=r"options\(drain=True\)"):
        list(Pipeline(_five_token_rows(21)).options(canonical_replicas=4).batch(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(Pipeline(_five_token_rows(21)).options(canonical_replicas=4, drain=True).batch(2))


# -- ranks agree on the end ----------------------------------------------------------------------------

AGREE = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    from zephon import Pipeline

    class DropRows:
        def __init__(self, rows):
            self.rows = frozenset(rows)
        def __call__(self, payload):
            return payload["id"] not in self.rows

    def build(drop):
        rows = [{{"id": i, "input_ids": [i + 1] * 3}} for i in range(200)]
        return Pipeline(rows).options(canonical_replicas=2).filter(DropRows(drop)).batch(1)

    def main(rank, world, drop, out):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=world)
        steps = 0
        for group in build(drop).steps():
            t = torch.ones(1)
            dist.all_reduce(t)  # the training step's collective: a rank that went on alone would hang here
            steps += 1
        json.dump({{"steps": steps}}, open(os.path.join(out, f"rank{{rank}}.json"), "w"))
        dist.barrier()  # no rank tears the group down while another still talks through it
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        drop, out = json.loads(sys.argv[1]), sys.argv[2]
        mp.spawn(main, args=(2, drop, out), nprocs=2, join=True)
    """
)


@pytest.mark.integration
def test_two_gloo_ranks_whose_lanes_end_at_different_steps_stop_together(tmp_path):
    pytest.importorskip("torch")
    import socket

    from zephon import Pipeline

    # Drop ten of lane 1's rows, so lane 1 (rank 1) ends ten steps before lane 0 (rank 0).
    rows = [{"id": i, "input_ids": [i + 1] * 3} for i in range(200)]
    plan = Pipeline(rows).options(canonical_replicas=2).plan
    lane1 = [p[2] for p in plan.source.pointers(*plan.source.lane_range(2, 1, 0))]
    drop = lane1[:10]
    per_lane = [100, 90]

    script = tmp_path / "agree.py"
    script.write_text(AGREE.format(tests=str(Path(__file__).parent)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PORT": str(port)}
    subprocess.run([sys.executable, str(script), json.dumps(drop), str(tmp_path)], check=True, env=env, timeout=240)
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2)]
    assert steps == [min(per_lane)] * 2


def test_agree_on_end_and_drain_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        iter(Pipeline(_five_token_rows(10)).options(drain=True, agree_on_end=True))


def test_twenty_dicts_on_two_lanes_are_all_delivered():
    rows = [{"n": i} for i in range(20)]
    loader = iter(Pipeline(rows).options(canonical_replicas=2))
    got = sorted(r.payload["n"] for r in loader)
    assert got == list(range(20))
    assert {lane: s["delivered"] for lane, s in loader.stats()["lanes"].items()} == {0: 10, 1: 10}
