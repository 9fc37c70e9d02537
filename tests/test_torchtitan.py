"""TorchTitan: ZephonDataLoader against the installed torchtitan's protocol and CheckpointManager (CPU, gloo)."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
import torch  # noqa: E402

from _shared import shared_path  # noqa: E402

CORPUS = shared_path("data", "corpus")
TOKENIZER = shared_path("data", "gpt2", "tokenizer.json")

# One rank of a training run: build the loader as TorchTitan's Trainer does (config.build with the
# trainer's keyword arguments), save model + optimizer + lr scheduler + data through TorchTitan's own
# CheckpointManager after `save_at` optimizer steps, and record a digest of every microbatch.
RANK = textwrap.dedent(
    """
    import hashlib, json, os, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from zephon.integrations.torchtitan import ZephonDataLoader, ZephonDataset, ZephonProcessing

    L, MBS, SEQ = 4, 2, 32

    def digest(input_dict, labels):
        h = hashlib.sha256()
        for t in (input_dict["input"], input_dict["positions"], labels):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    def main(rank, world, folder, out, phase, save_at, steps):
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["ZEPHON_TEST_PORT"])
            dist.init_process_group("gloo", rank=rank, world_size=world)
        cfg = ZephonDataLoader.Config(
            datasets=[ZephonDataset(name="corpus", path={corpus!r})],
            processing=ZephonProcessing(tokenizer={tokenizer!r}, shuffle_buffer=16),
            canonical_replicas=L, global_batch_size=L * MBS,
        )
        loader = cfg.build(dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=MBS,
                           snapshot_every_n_steps=None)
        assert isinstance(loader, BaseDataLoader)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50257, 4), torch.nn.Linear(4, 8))
        optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=100)
        ckpt = CheckpointManager.Config(enable=True, folder="checkpoint", interval=save_at, last_save_model_only=False,
                                        keep_latest_k=0).build(
            dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={{}}, sd_adapter=None, base_folder=folder)
        start = 0
        if phase == "resume":
            assert ckpt.load(step=save_at), "no checkpoint loaded"
            start = save_at
        accumulation = L // world  # global batch L x MBS = L/D microbatches per rank per optimizer step
        it = iter(loader)
        record = []
        for step in range(start + 1, start + steps + 1):
            for _ in range(accumulation):
                input_dict, labels = next(it)
                assert set(input_dict) == {{"input", "positions"}}
                assert input_dict["input"].shape == labels.shape == (MBS, SEQ) and labels.dtype == torch.int64
                loss = model(input_dict["input"]).sum() * 0.0
                loss.backward()
                record.append([step, digest(input_dict, labels)])
            optimizers.step()
            schedulers.step()
            ckpt.save(curr_step=step)
        ckpt.close()
        with open(os.path.join(out, f"rank-{{rank}}.json"), "w") as f:
            json.dump(record, f)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        world, folder, out, phase, save_at, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        if world == 1:
            main(0, 1, folder, out, phase, save_at, steps)
        else:
            mp.start_processes(main, args=(world, folder, out, phase, save_at, steps), nprocs=world, join=True, start_method="fork")
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_steps(out_dir, world):
    """{optimizer step: [microbatch digests in lane order]} assembled from every rank's record."""
    steps = {}
    for rank in range(world):
        for step, d in json.loads((out_dir / f"rank-{rank}.json").read_text()):
            steps.setdefault(step, []).append(d)  # rank order is lane order
    return steps


@pytest.mark.integration
def test_two_gloo_ranks_save_through_torchtitan_checkpointer_and_resume_on_one(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(repo=str(repo), corpus=str(CORPUS), tokenizer=str(TOKENIZER)))

    def launch(world, folder, out, phase, save_at, steps):
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ZEPHON_TEST_PORT": str(_free_port())}
        done = subprocess.run(
            [sys.executable, str(script), str(world), str(folder), str(out), phase, str(save_at), str(steps)],
            env=env, timeout=300, capture_output=True, text=True,
        )
        assert done.returncode == 0, done.stderr[-4000:]

    # 2 ranks (D=2) train 5 optimizer steps, saving through CheckpointManager at step 3.
    launch(2, tmp_path / "run", tmp_path / "two", "first", 3, 5)
    assert (tmp_path / "run" / "checkpoint" / "step-3").is_dir()
    two = _global_steps(tmp_path / "two", 2)
    # 1 rank (D=1) resumes from TorchTitan's step-3 checkpoint and trains steps 4 and 5.
    launch(1, tmp_path / "run", tmp_path / "one", "resume", 3, 2)
    one = _global_steps(tmp_path / "one", 1)
    assert sorted(one) == [4, 5]
    for step in (4, 5):
        assert len(one[step]) == 4 and one[step] == two[step], f"global batch of step {step} differs"
    # An uninterrupted single-rank run gives the same global batches from the start.
    single = _config(processing=_processing(16)).build(dp_world_size=1, dp_rank=0, seq_len=32, local_batch_size=2)
    it = iter(single)
    for step in range(1, 6):
        assert [_digest(*next(it)) for _ in range(4)] == two[step], f"step {step} differs from one rank's"


def _digest(input_dict, labels):
    h = hashlib.sha256()
    for t in (input_dict["input"], input_dict["positions"], labels):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def _processing(shuffle_buffer):
    from zephon.integrations.torchtitan import ZephonProcessing

    return ZephonProcessing(tokenizer=str(TOKENIZER), shuffle_buffer=shuffle_buffer)


def _config(**changes):
    from zephon.integrations.torchtitan import ZephonDataLoader, ZephonDataset, ZephonProcessing

    base = dict(
        datasets=[ZephonDataset(name="corpus", path=str(CORPUS))],
        processing=ZephonProcessing(tokenizer=str(TOKENIZER), shuffle_buffer=8),
        canonical_replicas=4,
        global_batch_size=8,
    )
    return ZephonDataLoader.Config(**{**base, **changes})


def test_items_have_the_layout_torchtitan_models_read():
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX

    loader = _config().build(dp_world_size=2, dp_rank=1, seq_len=16, local_batch_size=2)
    assert isinstance(loader, BaseDataLoader)
    input_dict, labels = next(iter(loader))
    assert list(input_dict) == ["input", "positions"]
    assert input_dict["input"].shape == input_dict["positions"].shape == labels.shape == (2, 16)
    assert input_dict["input"].dtype == input_dict["positions"].dtype == labels.dtype == torch.int64
    # Labels are the inputs shifted by one, except where the input is EOS (a document's end).
    eos = 50256
    inp, pos = input_dict["input"], input_dict["positions"]
    shifted_ok = (labels[:, :-1] == inp[:, 1:]) | (labels[:, :-1] == IGNORE_INDEX)
    assert bool(shifted_ok.all())
    assert bool((labels[inp == eos] == IGNORE_INDEX).all())
    assert bool((pos[:, 0] == 0).all())  # every row starts a piece at position 0
    # The state holds one entry per lane of this rank (DCP keys), and resumes exactly.
    it = iter(loader)
    state = loader.state_dict()
    assert sorted(k for k in state if k.startswith("lane_")) == ["lane_00002", "lane_00003"]
    after = [next(it) for _ in range(3)]
    fresh = _config().build(dp_world_size=2, dp_rank=1, seq_len=16, local_batch_size=2)
    fresh.load_state_dict(state)
    again = [x for _, x in zip(range(3), fresh)]
    for (a, la), (b, lb) in zip(after, again):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
    fresh.load_state_dict({})  # an empty state (a checkpoint without data) is accepted, as TorchTitan's loaders do


def test_startup_checks_name_the_numbers_to_change():
    with pytest.raises(ValueError, match=r"canonical_replicas=4 lanes cannot be split evenly over the data-parallel degree 3.*e\.g\. 12"):
        _config().build(dp_world_size=3, dp_rank=0, seq_len=16, local_batch_size=2)
    with pytest.raises(ValueError, match=r"training.global_batch_size=12 is not whole zephon steps.*4 x 2 = 8 rows.*to 8 or a multiple"):
        _config(global_batch_size=12).build(dp_world_size=2, dp_rank=0, seq_len=16, local_batch_size=2)
    with pytest.raises(ValueError, match=r"default global batch local_batch_size x data-parallel degree = 2 x 2 = 4"):
        _config(global_batch_size=-1).build(dp_world_size=2, dp_rank=0, seq_len=16, local_batch_size=2)
    with pytest.raises(ValueError, match="plan.weights names datasets \\['web'\\]"):
        from zephon.integrations.torchtitan import ZephonPlan

        _config(plan=ZephonPlan(weights={"web": 1.0})).build(dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)


def test_use_zephon_copies_the_global_batch_and_checks_the_layout():
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig, TrainingConfig

    from zephon.integrations.torchtitan import use_zephon

    # The sections of Trainer.Config that use_zephon reads and writes (importing torchtitan.trainer
    # needs triton, which a CPU-only install lacks).
    def trainer_config(shard):
        return SimpleNamespace(training=TrainingConfig(local_batch_size=2, global_batch_size=16, seq_len=16),
                               parallelism=ParallelismConfig(data_parallel_shard_degree=shard), dataloader=None)

    trainer = use_zephon(trainer_config(2), _config(global_batch_size=-1))
    assert trainer.dataloader.global_batch_size == 16 and trainer.dataloader.canonical_replicas == 4
    bad = trainer_config(8)
    with pytest.raises(ValueError, match="data-parallel degree 8"):
        use_zephon(bad, _config())


def test_the_trainers_tokenizer_and_a_custom_pipeline(tmp_path):
    import shutil

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from zephon import Pipeline
    from zephon.integrations.torchtitan import ZephonProcessing

    # TorchTitan's own tokenizer (hf_assets_path: tokenizer.json + tokenizer_config.json) with BOS and EOS.
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
    titan_tok = HuggingFaceTokenizer(tokenizer_path=str(tmp_path))
    assert titan_tok.bos_id == titan_tok.eos_id == 50256
    section = _config(processing=ZephonProcessing(shuffle_buffer=0))
    input_dict, labels = next(iter(section.build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=2, tokenizer=titan_tok)))
    first = input_dict["input"][0]
    assert int(first[0]) == 50256  # the first document starts with the trainer tokenizer's BOS
    start = titan_tok.decode(first[1:8].tolist())
    texts = [json.loads(line)["text"] for f in sorted(CORPUS.glob("*.jsonl")) for line in f.open()]
    assert any(t.startswith(start) for t in texts)  # ... followed by the start of a corpus document

    # processing.pipeline_fn: any pipeline ending in batch(local_batch_size) of seq_len + 1 token rows.
    import numpy as np

    def rows(seq_len, local_batch_size, tokenizer):
        docs = [{"input_ids": np.arange(i, i + 20, dtype=np.int32) % 97 + 1} for i in range(200)]
        from zephon.io import Dataset
        from zephon.work import StaticMixtureWorkSource

        src = StaticMixtureWorkSource([Dataset.from_rows("d", docs)], {"d": 1.0}, exhausted_policy="repeat")
        return Pipeline(src).pack_flat(seq_len + 1).batch(local_batch_size)

    custom = _config(processing=ZephonProcessing(pipeline_fn=rows))
    json.dumps(custom.to_dict())  # TorchTitan logs its configs as JSON
    input_dict, labels = next(iter(custom.build(dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)))
    assert input_dict["input"].shape == (2, 16) and torch.equal(labels[:, :-1], input_dict["input"][:, 1:])
    with pytest.raises(ValueError, match=r"must return a Pipeline ending in batch\(2\)"):
        _config(processing=ZephonProcessing(pipeline_fn=lambda **kw: rows(**{**kw, "local_batch_size": 3}))).build(
            dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)


def test_as_torchtitans_validation_loader_one_finite_pass(tmp_path):
    from dataclasses import replace

    from zephon.integrations.torchtitan import ZephonDataset

    words = "the of and to in is it that for on with as was by this be are from at an".split()
    with open(tmp_path / "val.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(5 + i % 30))}) + "\n")
    section = _config(datasets=[ZephonDataset(name="val", path=str(tmp_path / "val.jsonl"))], processing=_processing(0))
    # TorchTitan's Validator builds its loader with replace(config.dataloader, infinite=...).
    one_pass = replace(section, infinite=False)
    with pytest.warns(RuntimeWarning, match="not delivered"):
        first = [labels for _, labels in one_pass.build(dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)]
    again = [labels for _, labels in one_pass.build(dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)]
    assert 4 <= len(first) == len(again) and all(torch.equal(a, b) for a, b in zip(first, again))
    endless = replace(section, infinite=True).build(dp_world_size=1, dp_rank=0, seq_len=16, local_batch_size=2)
    it = iter(endless)
    assert len([next(it) for _ in range(len(first) + 5)]) == len(first) + 5
