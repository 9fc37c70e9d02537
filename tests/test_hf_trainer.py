"""ZephonTrainer under the real transformers Trainer: exact resume without replay, on 1 and 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _util import free_port, require

require("transformers", "accelerate", extra="transformers")

import torch

ROOT = Path(__file__).resolve().parents[1]

# One module for the in-process runs and the 2-process script: a tiny GPT-2 over an endless pipeline.
COMMON = textwrap.dedent(
    '''
    import hashlib, json, os, sys
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource
    from zephon.integrations.hf import ZephonTrainer

    def pipeline(lanes, microbatch=2):
        rng = np.random.default_rng(0)
        rows = [{"input_ids": rng.integers(3, 200, rng.integers(4, 40)).astype(np.int32)} for _ in range(200)]
        source = StaticMixtureWorkSource([Dataset.from_rows("docs", rows)], {"docs": 1.0}, seed=7,
                                         exhausted_policy="repeat", chunk_size=16)
        pipe = Pipeline(source).options(canonical_replicas=lanes).pack_flat(17).shuffle(16, seed=1)
        return pipe if microbatch is None else pipe.batch(microbatch)

    def model():
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=200, n_positions=32, n_embd=16, n_layer=1, n_head=2, use_cache=False)
        return GPT2LMHeadModel(config)

    class Recording(ZephonTrainer):
        """Records (optimizer step, microbatch digest, loss) of every microbatch trained."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            digest = hashlib.sha256(inputs["input_ids"].numpy().tobytes()).hexdigest()
            self.seen.append((self.state.global_step, digest, loss.item()))
            return loss

    def train(lanes, out, *, steps, accumulate, workers=0, save_steps=2, resume=None, **extra):
        args = TrainingArguments(
            output_dir=out, max_steps=steps, gradient_accumulation_steps=accumulate, save_steps=save_steps,
            learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            dataloader_num_workers=workers, **extra)
        trainer = Recording(model=model(), args=args, pipeline=pipeline(lanes))
        trainer.train(resume_from_checkpoint=resume)
        return trainer, trainer.seen
    '''
)

DDP_SCRIPT = COMMON + textwrap.dedent(
    '''
    def main(out):  # 2 processes, 2 lanes each: 2 microbatches per rank per optimizer step
        trainer, seen = train(4, out + "/run", steps=4, accumulate=2, ddp_backend="gloo")
        with open(f"{out}/rank{trainer.args.process_index}.json", "w") as f:
            json.dump(seen, f)

    if __name__ == "__main__":
        main(sys.argv[1])
        # The Trainer's DDP model holds the process group: destroy it once the Trainer is released, so
        # the group is torn down here and not while the interpreter exits (which can abort in gloo).
        import gc, weakref

        gc.collect()
        group = weakref.ref(torch.distributed.group.WORLD)
        torch.distributed.destroy_process_group()
        assert group() is None, "something still holds the process group"
    '''
)


@pytest.fixture(scope="module")
def common():
    namespace: dict = {"__name__": "zephon_hf_test"}
    exec(compile(COMMON, "<hf-common>", "exec"), namespace)
    return namespace


def digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bit_identical_without_replay(common, tmp_path, workers):
    # 2 lanes on one process: 2 microbatches (one global step) per optimizer step, a checkpoint every 2.
    full_trainer, full = common["train"](2, str(tmp_path / "full"), steps=4, accumulate=2)
    assert [s for s, _, _ in full] == [0, 0, 1, 1, 2, 2, 3, 3]
    loader = common["pipeline"](2).loader()
    reference = [b.to_training(layout="hf")["input_ids"] for _, b in zip(range(8), loader)]
    loader.close()
    reference_hashes = [digest(t) for t in reference]
    assert [d for _, d, _ in full] == reference_hashes and len(set(reference_hashes)) == 8
    saved = tmp_path / "full" / "checkpoint-2" / "zephon"
    assert sorted(p.name for p in saved.iterdir()) == ["zephon-lanes-00000-00001.msgpack"]

    # The resumed run reads its loader state from checkpoint-2/zephon: no replay, the same microbatches
    # at the same steps, and the same losses bit for bit (the Trainer restores model, optimizer, RNG).
    resumed_trainer, resumed = common["train"](
        2, str(tmp_path / "full"), steps=4, accumulate=2, workers=workers, resume=str(tmp_path / "full" / "checkpoint-2")
    )
    assert resumed == full[4:]
    assert resumed_trainer.args.ignore_data_skip is True
    assert [d for _, d, _ in resumed] == reference_hashes[4:]


def test_resume_true_takes_the_last_checkpoint(common, tmp_path):
    _, full = common["train"](2, str(tmp_path / "full"), steps=4, accumulate=2, save_steps=10)
    common["train"](2, str(tmp_path / "run"), steps=3, accumulate=2, save_steps=1)  # checkpoint-1 ... checkpoint-3
    _, tail = common["train"](2, str(tmp_path / "run"), steps=4, accumulate=2, resume=True)
    assert tail == full[6:]  # from checkpoint-3: the last step's microbatches, with dropout, bit for bit


def test_refusals(common, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match="train_dataset= is not used with pipeline="):
        common["ZephonTrainer"](model=common["model"](), args=args, pipeline=common["pipeline"](2), train_dataset=[1])
    with pytest.raises(TypeError, match="data_collator= is not used"):
        common["ZephonTrainer"](model=common["model"](), args=args, pipeline=common["pipeline"](2), data_collator=id)
    with pytest.raises(ValueError, match="must end in batch"):
        common["ZephonTrainer"](model=common["model"](), args=args, pipeline=common["pipeline"](2, None))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3\).*not whole zephon steps.*Accumulate 2"):
        common["train"](2, str(tmp_path / "a"), steps=1, accumulate=3)
    common["train"](2, str(tmp_path / "plain"), steps=1, accumulate=2)
    plain = tmp_path / "plain" / "checkpoint-1"
    shutil.rmtree(plain / "zephon")  # as a plain Trainer saves it, or when the ranks' files were not copied
    with pytest.raises(FileNotFoundError, match=r"checkpoint-1 has no zephon state"):
        common["train"](2, str(tmp_path / "plain"), steps=2, accumulate=2, resume=str(plain))
    # A checkpoint of other data settings is refused naming what differs.
    common["train"](2, str(tmp_path / "two"), steps=2, accumulate=2)
    with pytest.raises(ValueError, match="lanes|canonical_replicas"):
        common["train"](4, str(tmp_path / "two"), steps=3, accumulate=4, resume=str(tmp_path / "two" / "checkpoint-2"))


def test_hf_layout_is_what_a_model_takes_and_masks_documents(common):
    loader = common["pipeline"](2).loader()
    batches = [b.to_training(layout="hf") for _, b in zip(range(6), loader)]
    loader.close()
    fields = batches[0]
    assert list(fields) == ["input_ids", "labels", "position_ids"]
    # Unshifted (the model shifts): labels[t] = input_ids[t], except the first, which nothing predicts.
    assert (fields["labels"][:, 0] == -100).all() and torch.equal(fields["labels"][:, 1:], fields["input_ids"][:, 1:])
    # Packed rows: position_ids restart at each document, and the model attends within documents only.
    model = common["model"]().eval()
    documents = 0
    with torch.no_grad():
        for fields in batches:
            packed = model(**fields).logits
            for row, positions in enumerate(fields["position_ids"].tolist()):
                starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
                for a, b in zip(starts, starts[1:]):
                    alone = model(input_ids=fields["input_ids"][row : row + 1, a:b]).logits[0]
                    torch.testing.assert_close(packed[row, a:b], alone, rtol=1e-5, atol=1e-5)
                    documents += a > 0
    assert documents >= 3  # rows with a document that does not start the row were checked


def test_data_parallel_part_of_a_parallelism_config():
    from types import SimpleNamespace

    from zephon.integrations.hf import data_parallel

    args = [SimpleNamespace(world_size=8, process_index=i) for i in range(8)]
    assert [data_parallel(a) for a in args[:2]] == [(8, 0), (8, 1)]
    # dp_shard 2 x tp 4: ranks 0-3 are data-parallel rank 0, 4-7 rank 1 (tensor-parallel ranks are neighbours).
    config = SimpleNamespace(data_parallel_size=2, non_data_parallel_size=4)
    assert [data_parallel(a, config) for a in args] == [(2, 0)] * 4 + [(2, 1)] * 4


@pytest.mark.integration
def test_two_processes_resume_on_one(common, tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               str(script), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all([s for s, _, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3] for seen in ranks)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoint-2" / "zephon").iterdir())
    assert len(saved) == 2  # one file per rank

    # One process, all 4 lanes: 4 microbatches per optimizer step, from the 2-process step-2 checkpoint.
    _, resumed = common["train"](4, str(tmp_path / "run"), steps=4, accumulate=4,
                                 resume=str(tmp_path / "run" / "checkpoint-2"))
    for step in (2, 3):
        two = sorted(d for seen in ranks for s, d, _ in seen if s == step)
        assert sorted(d for s, d, _ in resumed if s == step) == two and len(set(two)) == 4
    # The same global batches, in lane order, as the uninterrupted 1-process run (losses differ: dropout draws
    # other numbers on another number of processes).
    _, single = common["train"](4, str(tmp_path / "single"), steps=4, accumulate=4, save_steps=10)
    assert [(s, d) for s, d, _ in single[8:]] == [(s, d) for s, d, _ in resumed]


def test_skip_data_steps_after_a_resume_trains_on_the_uninterrupted_runs_later_data(common, tmp_path):
    from transformers import TrainingArguments

    from zephon.runtime.checkpoint import read_checkpoint

    # 2 lanes, accumulate 2: one zephon step per optimizer step; the full run's data for steps 0-5.
    _, full = common["train"](2, str(tmp_path / "full"), steps=6, accumulate=2, save_steps=10)
    common["train"](2, str(tmp_path / "run"), steps=2, accumulate=2)  # checkpoint-2
    keyframes = tmp_path / "keyframes"
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, gradient_accumulation_steps=2, save_steps=4,
                             learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    # Without keyframes the skip produces the skipped steps; with them it restores the one of step 4.
    for pipe, expect_keyframe in ((common["pipeline"](2), None),
                                  (common["pipeline"](2).options(keyframes=keyframes, keyframe_every=1), 4)):
        if expect_keyframe is not None:  # a run through the steps saves keyframes (every step here)
            with pipe.loader() as loader:
                [_ for _, _ in zip(range(5), loader.steps())]
        trainer = common["Recording"](model=common["model"](), args=args, pipeline=pipe)
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"), skip_data_steps=2)
        # Optimizer steps 2 and 3 train on the data of the uninterrupted run's steps 4 and 5.
        assert [(s, d) for s, d, _ in trainer.seen] == [(s - 2, d) for s, d, _ in full[8:12]]
        skipped = trainer.zephon_skipped
        assert (skipped.first, skipped.count, skipped.keyframe) == (2, 2, expect_keyframe)
        saved = read_checkpoint(tmp_path / "run" / "checkpoint-4" / "zephon", [0, 1])
        assert all(lane["skipped_steps"] == [[2, 2]] for lane in saved["lanes"].values())
    with pytest.raises(ValueError, match=r"skip_data_steps must be an int >= 0 .*got -1"):
        common["Recording"](model=common["model"](), args=args, pipeline=common["pipeline"](2)).train(skip_data_steps=-1)
