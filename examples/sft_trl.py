"""Supervised fine-tuning with TRL's ``SFTTrainer`` on zephon's chat masks and packing, resumed exactly.

    python examples/sft_trl.py

zephon templates the conversations (ChatML), masks everything but the assistant's tokens, packs
them into rows with ``position_ids`` that restart at every conversation, and shuffles and batches
them; TRL's trainer runs the optimisation. TRL's own preparation is skipped
(``dataset_kwargs={"skip_prepare_dataset": True}``) and its collator is never called: every batch
is zephon's, with the labels already masked. The run saves at step 3, a second trainer resumes from
that checkpoint, and its losses equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _sft_data import train_tokenizer, write_dataset  # noqa: E402

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from zephon import Pipeline  # noqa: E402
from zephon.integrations.hf import ZephonTrainerMixin  # noqa: E402
from zephon.io import Dataset  # noqa: E402
from zephon.work import StaticMixtureWorkSource  # noqa: E402

STEPS, SAVE_AT = 4, 2


class ZephonSFTTrainer(ZephonTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer reading its batches from a zephon pipeline."""


def pipeline(data: Path, tok: Path) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("chat", data)], {"chat": 1.0}, seed=0, exhausted_policy="repeat")
    return (
        Pipeline(source)
        .options(canonical_replicas=2)
        .tokenize_chat(tokenizer=str(tok), chat_template="chatml", loss_scope="assistant", max_length=128, truncation=True)
        .pack_flat(max_length=129, algorithm="first_fit", num_bins=8, pad_token_id=0)
        .shuffle(buffer_size=32, seed=0)
        .batch(microbatch_size=4)
    )


def train(out: Path, pipe: Pipeline, tokenizer: PreTrainedTokenizerFast, resume: str | None = None) -> dict[int, float]:
    """The loss of every optimizer step this run trained (a resumed run's log also holds the earlier ones)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2))
    args = SFTConfig(
        output_dir=str(out), max_steps=STEPS, gradient_accumulation_steps=2, save_steps=SAVE_AT, learning_rate=3e-3,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    trainer = ZephonSFTTrainer(model=model, args=args, pipeline=pipe, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    first = int(resume.rpartition("-")[2]) if resume else 0
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > first}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zephon-trl-") as tmp:
        root = Path(tmp)
        data, tok = write_dataset(root / "data"), train_tokenizer(root / "tok")
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(tok / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )
        pipe = pipeline(data, tok)
        fields = next(iter(pipe.loader())).to_training(layout="hf")
        print({k: tuple(v.shape) for k, v in fields.items()}, "| supervised:", int((fields["labels"] != -100).sum()))
        full = train(root / "run", pipe, tokenizer)
        resumed = train(root / "run", pipe, tokenizer, resume=str(root / "run" / f"checkpoint-{SAVE_AT}"))
        for step, loss in full.items():
            again = resumed.get(step)
            print(f"step {step}: loss {loss:.6f}" + ("" if again is None else f" | resumed {again:.6f}"))
        same = resumed == {step: loss for step, loss in full.items() if step > SAVE_AT}
        print(f"steps {SAVE_AT + 1}..{STEPS} resumed from checkpoint-{SAVE_AT}:", "bit for bit" if same else "DIFFERENT")
        return 0 if same and full[STEPS] < full[1] else 1


if __name__ == "__main__":
    sys.exit(main())
