"""Supervised fine-tuning without packing: dynamic padding to the longest record in each batch.

    python examples/sft_padded.py

Records of similar length are batched together (``group_by_length``) to cut padding; labels are
-100 on prompts and padding, and ``attention_mask`` is 0 on padding.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _sft_data import train_tokenizer, write_dataset  # noqa: E402

from zephon import Pipeline  # noqa: E402
from zephon.io import Dataset  # noqa: E402
from zephon.work import StaticMixtureWorkSource  # noqa: E402


def build(data: Path, tok: Path, grouped: bool) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("chat", data)], {"chat": 1.0}, seed=0, shuffle_within_shard=True)
    return (
        Pipeline(source)
        .tokenize_chat(tokenizer=str(tok), chat_template="chatml", max_length=512, truncation=True)
        .batch(microbatch_size=8, group_by_length=grouped, buffer_size=128 if grouped else None)
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zephon-sft-") as tmp:
        root = Path(tmp)
        data, tok = write_dataset(root / "data"), train_tokenizer(root / "tok")
        waste = {}
        for grouped in (False, True):
            loader = iter(build(data, tok, grouped))
            for i, batch in enumerate(loader):
                out = batch.to_training(return_labels=True, padding="longest", pad_to_multiple_of=8, pad_token_id=0, dtype=np.int64)
                if i == 0 and not grouped:
                    print({k: v.shape for k, v in out.items() if hasattr(v, "shape")})
                assert out["input_ids"].shape[1] % 8 == 0
                assert (out["labels"][out["attention_mask"] == 0] == -100).all()
            report = loader.stats()["operators"]["batch"]
            waste[grouped] = 1 - report["real_tokens"] / report["padded_slots"]
            print(f"group_by_length={grouped}: {report['batches']} batches, padding waste {waste[grouped]:.1%}")
        return 0 if waste[True] < waste[False] else 1


if __name__ == "__main__":
    sys.exit(main())
