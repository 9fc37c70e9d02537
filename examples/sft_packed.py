"""Supervised fine-tuning with packing: chat data -> tokenize_chat -> pack_flat(first_fit) -> tensors.

    python examples/sft_packed.py

Assistant tokens (with their <|im_end|>) are the only targets; documents never attend across
boundaries when the model uses ``cu_seqlens`` (variable-length attention).
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


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zephon-sft-") as tmp:
        root = Path(tmp)
        data, tok = write_dataset(root / "data"), train_tokenizer(root / "tok")
        source = StaticMixtureWorkSource([Dataset.from_path("chat", data)], {"chat": 1.0}, seed=0, shuffle_within_shard=True)
        pad = 0  # <|endoftext|>
        pipe = (
            Pipeline(source)
            .options(canonical_replicas=2)
            .tokenize_chat(tokenizer=str(tok), chat_template="chatml", loss_scope="assistant", max_length=512, truncation=True)
            .pack_flat(max_length=513, algorithm="first_fit", num_bins=8, pad_token_id=pad)
            .shuffle(buffer_size=32, seed=0)
            .batch(microbatch_size=4)
        )
        real = slots = supervised = 0
        loader = iter(pipe)
        for i, batch in enumerate(loader):
            out = batch.to_training(return_labels=True, return_cu_seqlens=True, return_num_valid_tokens=True, dtype=np.int64)
            if i == 0:
                print({k: (v.shape if hasattr(v, "shape") else v) for k, v in out.items() if k not in ("ids", "texts")})
            real += sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in batch.records)
            slots += out["input_ids"].size + len(batch.records)
            supervised += out["num_valid_tokens"]
            assert (out["labels"][out["labels"] != -100] >= 0).all()
        stats = loader.stats()["operators"]
        print(f"batches: {i + 1} | packing efficiency: {real / slots:.3f} | supervised tokens: {supervised} of {real}")
        print(f"pack_flat: {stats['pack_flat']}")
        return 0 if supervised > 0 and real / slots > 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
