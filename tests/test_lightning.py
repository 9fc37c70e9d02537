"""ZephonDataModule under Lightning's real Trainer: exact mid-epoch resume, with workers and another device count."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _util import require

require("lightning", extra="lightning")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

# One module for both the in-process runs and the DDP script: a tiny LM over an endless pipeline.
COMMON = textwrap.dedent(
    '''
    import hashlib, json, sys
    import numpy as np
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource
    from zephon.integrations.lightning import ZephonDataModule

    def pipeline(lanes):
        rng = np.random.default_rng(0)
        rows = [{"input_ids": rng.integers(3, 200, rng.integers(4, 40)).astype(np.int32)} for _ in range(200)]
        source = StaticMixtureWorkSource([Dataset.from_rows("docs", rows)], {"docs": 1.0}, seed=7,
                                         exhausted_policy="repeat", chunk_size=16)
        return Pipeline(source).options(canonical_replicas=lanes).pack_flat(17).shuffle(16, seed=1).batch(2)

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Embedding(200, 8), torch.nn.Linear(8, 200))
            self.seen = []

        def training_step(self, batch, batch_idx):
            logits = self.net(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            digest = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()
            self.seen.append((self.global_step, digest, loss.item()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(lanes, *, steps, accumulate, workers=0, devices=1, ckpt_dir=None, ckpt_path=None):
        dm = ZephonDataModule(pipeline(lanes), num_workers=workers, return_labels=True)
        model = TinyLM()
        every_step = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
        callbacks = [] if ckpt_dir is None else [every_step]
        extra = {"strategy": "ddp"} if devices > 1 else {}
        trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=steps, accumulate_grad_batches=accumulate,
                             callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=ckpt_dir is not None, num_sanity_val_steps=0, **extra)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, model.seen
    '''
)

DDP_SCRIPT = COMMON + textwrap.dedent(
    '''
    def main(out):  # 2 ranks, 1 lane each: one microbatch per rank per optimizer step
        trainer, seen = fit(2, steps=4, accumulate=1, devices=2, ckpt_dir=out + "/ckpt")
        with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(seen, f)

    if __name__ == "__main__":
        main(sys.argv[1])  # the Trainer is released here, before the process group is torn down at exit
    '''
)


@pytest.fixture(scope="module")
def common():
    namespace: dict = {"__name__": "zephon_lightning_test"}
    exec(compile(COMMON, "<lightning-common>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_is_exact(common, tmp_path, workers, recwarn):
    # 2 lanes on one device: accumulate 2 microbatches (one global step) per optimizer step.
    _, full = common["fit"](2, steps=4, accumulate=2, workers=workers, ckpt_dir=str(tmp_path))
    assert [s for s, _, _ in full] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({d for _, d, _ in full}) == 8  # distinct microbatches: the test can tell them apart
    loader = common["pipeline"](2).loader()
    reference = [b.to_training(return_labels=True)["input_ids"] for _, b in zip(range(8), loader)]
    loader.close()
    assert [d for _, d, _ in full] == [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in reference]

    ckpt = str(tmp_path / "epoch=0-step=2.ckpt")  # saved by ModelCheckpoint mid-run, with a batch read ahead
    _, resumed = common["fit"](2, steps=4, accumulate=2, workers=workers, ckpt_path=ckpt)
    assert resumed == full[4:]  # the same microbatches, at the same steps, with bit-identical losses
    messages = [str(w.message) for w in recwarn]
    assert not [m for m in messages if "resumable" in m or "DistributedSampler" in m or "sampler" in m], messages


def test_state_holds_every_lane_and_refuses_foreign_state(common, tmp_path):
    trainer, seen = common["fit"](4, steps=1, accumulate=4, ckpt_dir=str(tmp_path))
    state = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=False)["ZephonDataModule"]
    lanes = state["zephon_checkpoint"]["lanes"]
    assert sorted(lanes, key=int) == ["0", "1", "2", "3"] and {s["delivered"] for s in lanes.values()} == {1}
    dm = common["ZephonDataModule"](common["pipeline"](4), return_labels=True)
    with pytest.raises(ValueError, match="zephon_checkpoint"):
        dm.load_state_dict({"lanes": lanes})


def test_skip_data_steps_on_resume_trains_on_the_uninterrupted_runs_later_data(common, tmp_path):
    _, full = common["fit"](2, steps=6, accumulate=2)
    common["fit"](2, steps=2, accumulate=2, ckpt_dir=str(tmp_path))  # epoch=0-step=2.ckpt
    keyframes = tmp_path / "keyframes"
    with common["pipeline"](2).options(keyframes=keyframes, keyframe_every=1).loader() as loader:
        [_ for _, _ in zip(range(5), loader.steps())]  # a run through the steps saves keyframes
    for pipe, expect_keyframe in ((common["pipeline"](2), None),
                                  (common["pipeline"](2).options(keyframes=keyframes, keyframe_every=1), 4)):
        dm = common["ZephonDataModule"](pipe, return_labels=True)
        dm.skip_data_steps(2)
        model = common["TinyLM"]()
        trainer = common["pl"].Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, logger=False,
                                       enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                       num_sanity_val_steps=0)
        trainer.fit(model, datamodule=dm, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
        # Optimizer steps 2 and 3 train on the data of the uninterrupted run's steps 4 and 5.
        assert [(s, d) for s, d, _ in model.seen] == [(s - 2, d) for s, d, _ in full[8:12]]
        assert (dm.skipped.first, dm.skipped.count, dm.skipped.keyframe) == (2, 2, expect_keyframe)
        assert all(lane["skipped_steps"] == [[2, 2]] for lane in dm.state_dict()["zephon_checkpoint"]["lanes"].values())
    with pytest.raises(ValueError, match=r"n must be an int >= 0 .*got -1"):
        dm.skip_data_steps(-1)


def test_accumulation_must_be_whole_steps(common):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=3\).*not whole zephon steps.*Accumulate 2 \(or a multiple"):
        common["fit"](2, steps=1, accumulate=3)


@pytest.mark.integration
def test_ddp_checkpoint_resumes_on_one_device(common, tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # One device, both lanes: 2 microbatches per optimizer step, from the 2-rank step-2 checkpoint.
    _, resumed = common["fit"](2, steps=4, accumulate=2, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    # Global step k on 2 ranks = rank 0's microbatch k then rank 1's (lanes 0 and 1).
    global_steps = [[r0[1], r1[1]] for r0, r1 in zip(*ranks)]
    assert [s for s, _, _ in ranks[0]] == [0, 1, 2, 3] and len({d for g in global_steps for d in g}) == 8
    # Resumed after 2 steps (Lightning's accumulation phase counts the batches it saved: 2 per rank, even).
    assert [[d for s, d, _ in resumed if s == k] for k in (2, 3)] == global_steps[2:]
    # The same rows in every optimizer step, so the losses agree (not bitwise: gloo's mean vs accumulation).
    uninterrupted = [x[2] for k in (2, 3) for x in (ranks[0][k], ranks[1][k])]
    np.testing.assert_allclose([loss for _, _, loss in resumed], uninterrupted, rtol=1e-5)
