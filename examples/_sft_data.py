"""Small chat data and a locally trained tokenizer for the SFT examples (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TOPICS = ["lanes", "packing", "shuffles", "checkpoints", "tokenizers", "mixtures", "ledgers", "workers"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn ChatML-style conversations, some with a system prompt and a tool call."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You answer questions about data loaders briefly."})
        for turn in range(int(rng.integers(1, 4))):
            words = " ".join(TOPICS[j] for j in rng.integers(0, len(TOPICS), size=int(rng.integers(3, 40))))
            messages.append({"role": "user", "content": f"Question {turn} about {topic}: {words}?"})
            if i % 5 == 0 and turn == 0:
                call = {"type": "function", "function": {"name": "lookup", "arguments": {"topic": topic}}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "content": json.dumps({"topic": topic, "found": True})})
            messages.append({"role": "assistant", "content": f"About {topic}: " + words[::-1][: int(rng.integers(10, 200))]})
        out.append({"messages": messages, "id": i})
    return out


def write_dataset(folder: Path, n: int = 400) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "chat-00000.jsonl", "w", encoding="utf-8") as fh:
        for conv in conversations(n):
            fh.write(json.dumps(conv) + "\n")
    return folder


def train_tokenizer(folder: Path) -> Path:
    """A byte-level BPE with the ChatML special tokens; returns the folder holding tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in conversations(200, seed=1) for m in c["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": "chatml"}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    return folder
