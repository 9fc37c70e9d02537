"""TorchTitan's own Trainer (torchtitan.train under torchrun, CPU, gloo) trains on zephon's batches.

Runs ``examples/torchtitan_cpu.py`` (a one-layer Llama 3 debug model): 2 ranks train 4 steps and
checkpoint at step 2; 1 rank resumes from that checkpoint and trains steps 3 and 4. A recording
subclass of ``ZephonDataLoader`` writes a digest of every microbatch the trainer pulls; they must be
the pipeline's own global batches, in order, before and after the resume.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
try:
    import triton  # noqa: F401  (import torchtitan.trainer needs it)
except ImportError:
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail("triton is missing: .ci/run installs it (import torchtitan.trainer needs it)", pytrace=False)
    pytest.skip("triton is not installed (import torchtitan.trainer needs it)", allow_module_level=True)

from _shared import shared_path  # noqa: E402

CORPUS = shared_path("data", "corpus")
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torchtitan_cpu.py"

# The example's config with the data loader swapped for one that records what the trainer pulls.
RECORDING = textwrap.dedent(
    """
    import hashlib, os
    from dataclasses import dataclass, fields
    from torchtitan_cpu import tiny_zephon
    from zephon.integrations.torchtitan import ZephonDataLoader


    class RecordingLoader(ZephonDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(ZephonDataLoader.Config):
            record: str = ""

        def __iter__(self):
            for input_dict, labels in super().__iter__():
                h = hashlib.sha256()
                for t in (input_dict["input"], input_dict["positions"], labels):
                    h.update(t.numpy().tobytes())
                with open(os.path.join(self.config.record, f"rank-{self.dp_rank}.txt"), "a") as f:
                    f.write(h.hexdigest()[:16] + "\\n")
                yield input_dict, labels


    def recorded():
        config = tiny_zephon()
        section = config.dataloader
        config.dataloader = RecordingLoader.Config(
            **{f.name: getattr(section, f.name) for f in fields(section)}, record=os.environ["ZEPHON_RECORD"])
        return config
    """
)


def _tokenizer(folder):
    """A 512-token byte-level BPE (the debug model's vocabulary is 2048) with an EOS, as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir()
    texts = [json.loads(line)["text"] for line in (CORPUS / "shard-00000.jsonl").read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _train(tmp_path, ranks, dump, record):
    record.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEPHON_TITAN_DATA": str(CORPUS), "ZEPHON_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(EXAMPLE),
           "--module", "recording_config", "--config", "recorded", "--hf_assets_path", str(tmp_path / "tokenizer"),
           "--dump_folder", str(dump), "--training.steps", "4", "--checkpoint.interval", "2"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, timeout=240, capture_output=True, text=True)
    log = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, log[-6000:]
    losses = {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([-\d.naif]+)", log)}
    digests = [(record / f"rank-{r}.txt").read_text().split() for r in range(ranks)]
    return log, losses, digests


@pytest.mark.integration
def test_torchtitan_trainer_trains_on_zephon_batches_and_resumes_on_fewer_ranks(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from zephon.integrations.torchtitan import ZephonDataLoader, ZephonDataset, ZephonProcessing

    _tokenizer(tmp_path / "tokenizer")
    (tmp_path / "recording_config.py").write_text(RECORDING)

    # The pipeline's own global batches: one rank owning both lanes, the same tokenizer object.
    section = ZephonDataLoader.Config(datasets=[ZephonDataset(name="corpus", path=str(CORPUS))],
                                      processing=ZephonProcessing(shuffle_buffer=16), canonical_replicas=2,
                                      global_batch_size=4)
    reference = section.build(dp_world_size=1, dp_rank=0, seq_len=32, local_batch_size=2,
                              tokenizer=HuggingFaceTokenizer(tokenizer_path=str(tmp_path / "tokenizer")))
    it = iter(reference)
    expected = {step: [_digest(*next(it)) for _lane in range(2)] for step in range(1, 5)}

    # 2 ranks (1 lane each, 1 microbatch per step each) train steps 1-4, checkpointing at 2 and 4.
    log2, losses2, (rank0, rank1) = _train(tmp_path, 2, tmp_path / "two", tmp_path / "rec-two")
    assert "Training starts at step 1" in log2
    assert sorted(losses2) == [1, 2, 3, 4] and all(0 < v < 20 for v in losses2.values())
    assert len(rank0) == len(rank1) == 4, "the trainer pulled one microbatch per rank per step"
    assert {step: [rank0[step - 1], rank1[step - 1]] for step in range(1, 5)} == expected
    step2 = tmp_path / "two" / "checkpoint" / "step-2"
    assert step2.is_dir()

    # 1 rank (both lanes, 2 microbatches per step) resumes from the 2-rank step-2 checkpoint.
    shutil.copytree(step2, tmp_path / "one" / "checkpoint" / "step-2")
    log1, losses1, (single,) = _train(tmp_path, 1, tmp_path / "one", tmp_path / "rec-one")
    assert "Training starts at step 3" in log1
    assert sorted(losses1) == [3, 4]
    assert single == expected[3] + expected[4], "the resumed trainer continues zephon's stream exactly"
    # Model and optimizer came back too: same weights and data, so the same loss up to reduction order.
    for step in (3, 4):
        assert losses1[step] == pytest.approx(losses2[step], rel=1e-4)


def _digest(input_dict, labels):
    h = hashlib.sha256()
    for t in (input_dict["input"], input_dict["positions"], labels):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
