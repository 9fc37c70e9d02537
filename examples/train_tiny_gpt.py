"""Train a tiny GPT end to end on packed batches, stop in the middle, resume in a new process.

    python examples/train_tiny_gpt.py [--steps 300] [--ckpt-at 150] [--ranks 1|2] [--plot loss.png]

What it shows, on CPU in well under a minute:

- data built here: generated "stories" and "counting" documents (two JSONL datasets mixed 3:1)
  and a byte-level BPE trained on them;
- the zephon recipe tokenize -> pack_flat(wrap) -> shuffle -> batch over 4 lanes, converted with
  ``to_training`` into shifted labels, per-document ``positions`` and ``num_valid_tokens``;
- a causal transformer whose attention is block-diagonal per document (SDPA with a boolean mask
  built from ``positions``) and whose labels are -100 across document boundaries, so no token
  sees or predicts another document;
- the loss of each optimizer step normalised by the step's ``num_valid_tokens`` over all lanes;
- a checkpoint of model + optimizer + data (``torch.distributed.checkpoint``, the loader being
  ``Stateful``) after ``--ckpt-at`` steps, a resume in a new process, and the check that the
  resumed losses equal the uninterrupted run's bit for bit.

With ``--ranks 2`` the uninterrupted run uses two processes (gloo) and the resume one. The global
batches are the same whatever the number of ranks (zephon's promise); the losses are equal bit
for bit too because the gradient reduction is done in a fixed order: every microbatch's gradient
is computed on its own, gathered, and summed in lane order, exactly as a single process sums
them. (A plain DDP all-reduce sums in an order that depends on the number of ranks, so its
losses would agree only to rounding.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zephon import Pipeline, TrainingSpec
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

LANES = 4  # canonical_replicas: a multiple of every data-parallel size used (1 and 2)
MICROBATCH = 4
CONTEXT = 64  # tokens the model reads; rows hold CONTEXT + 1 tokens (inputs and shifted labels)
VOCAB = 384

# -- data the script builds ------------------------------------------------------------------------

_NOUNS = "cat dog bird fox owl frog bee ant".split()
_ADJS = "red big small quick lazy happy old young".split()
_VERBS = "sees chases likes finds helps follows".split()
_PLACES = "park river garden forest hill house".split()


def _story(rng: np.random.Generator) -> str:
    """A few sentences with a learnable grammar: 'the big cat sees the red dog in the park.'"""
    sentences = []
    for _ in range(int(rng.integers(1, 6))):
        a, b = rng.choice(_NOUNS, 2, replace=False)
        sentences.append(
            f"the {rng.choice(_ADJS)} {a} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} {b} in the {rng.choice(_PLACES)}."
        )
    return " ".join(sentences)


def _counting(rng: np.random.Generator) -> str:
    """A run of consecutive numbers: 'count 17 18 19 20 21 .'"""
    start = int(rng.integers(0, 90))
    return "count " + " ".join(str(i) for i in range(start, start + int(rng.integers(3, 25)))) + " ."


def build_data(root: Path) -> tuple[dict[str, Path], Path]:
    """Write the two datasets (JSONL shards) and train a BPE on them; returns their paths."""
    rng = np.random.default_rng(1234)
    paths = {}
    texts = []
    for name, make, docs in (("stories", _story, 1500), ("counting", _counting, 600)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for shard in range(2):
            with open(folder / f"shard-{shard:05d}.jsonl", "w", encoding="utf-8") as fh:
                for _ in range(docs // 2):
                    text = make(rng)
                    texts.append(text)
                    fh.write(json.dumps({"text": text}) + "\n")
        paths[name] = folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False))
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    return paths, tok_path


def build_pipeline(paths: dict[str, Path], tokenizer: Path) -> Pipeline:
    """The data pipeline; D and the rank come from ``torch.distributed`` when it is initialized."""
    datasets = [Dataset.from_path(name, p) for name, p in paths.items()]
    source = StaticMixtureWorkSource(
        datasets, {"stories": 0.75, "counting": 0.25}, seed=0, exhausted_policy="repeat", shuffle_within_shard=True
    )
    return (
        Pipeline(source)
        .options(canonical_replicas=LANES)
        .tokenize(tokenizer=str(tokenizer), field="text", special_tokens="eos")
        .pack_flat(max_length=CONTEXT + 1, algorithm="wrap")
        .shuffle(buffer_size=64, seed=0)
        .batch(microbatch_size=MICROBATCH)
    )


# -- the model --------------------------------------------------------------------------------------


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: token ``i`` attends to ``j`` iff ``j <= i`` in the same document.

    A document starts where ``positions`` is 0 (pack_flat restarts positions at every document),
    so the document index is a running count of zeros; the mask is block-diagonal and causal.
    """
    doc = torch.cumsum((positions == 0).to(torch.int64), dim=1)
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same = doc[:, :, None] == doc[:, None, :]
    return (same & causal)[:, None]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A pre-norm causal transformer; position embeddings are indexed by per-document positions."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2, heads: int = 4, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = document_mask(positions)
        x = self.tok(input_ids) + self.pos(positions.clamp(max=self.pos.num_embeddings - 1))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


# -- training ---------------------------------------------------------------------------------------


def deterministic() -> None:
    """Same results in every process: one thread, fixed seeds, deterministic kernels."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


#: One conversion for every microbatch: shifted labels, -100 on the prediction of a new document
#: (from the EOS that ends the previous one), per-document positions, the count of valid labels.
def training_spec(tokenizer: Path) -> TrainingSpec:
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    return TrainingSpec(return_labels=True, eos_mask_loss=True, eos_token_id=eos, return_num_valid_tokens=True, dtype=torch.long)


def microbatch_grad(model: nn.Module, batch: dict, valid_in_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This microbatch's share of the step's loss and its gradient (flattened), computed alone."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], batch["positions"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum") / valid_in_step
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def train(args: argparse.Namespace, rank: int, world: int, start: int, out: Path) -> None:
    """Run steps ``[start, args.steps)``: resume from ``args.ckpt`` when ``start > 0``; save it at ``ckpt_at``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    deterministic()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process is intended
    paths = {name: Path(args.data) / name for name in ("stories", "counting")}
    loader = build_pipeline(paths, Path(args.data) / "tokenizer.json").loader()
    model, optim = make_model()
    if start:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "data": loader}
        dcp.load(state, checkpoint_id=args.ckpt)  # the loader restores its lanes in place (any number of ranks)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    spec = training_spec(Path(args.data) / "tokenizer.json")
    losses = {}
    params = list(model.parameters())
    for step, microbatches in zip(range(start, args.steps), loader.steps()):
        tensors = [spec(mb) for mb in microbatches]
        valid = torch.tensor(sum(t["num_valid_tokens"] for t in tensors))
        if world > 1:
            dist.all_reduce(valid)  # an integer sum: exact in any order
        parts = [microbatch_grad(model, t, int(valid)) for t in tensors]
        local_loss = torch.stack([p[0] for p in parts])
        local_grads = torch.stack([p[1] for p in parts])
        if world > 1:  # every rank gets every lane's gradient; rank r holds lanes r*L/D.. (lane order)
            gathered = [torch.empty_like(local_grads) for _ in range(world)]
            dist.all_gather(gathered, local_grads)
            losses_g = [torch.empty_like(local_loss) for _ in range(world)]
            dist.all_gather(losses_g, local_loss)
            all_grads, all_losses = torch.cat(gathered), torch.cat(losses_g)
        else:
            all_grads, all_losses = local_grads, local_loss
        grad, loss = all_grads[0].clone(), all_losses[0].clone()
        for i in range(1, len(all_grads)):  # lane order, the same on any number of ranks
            grad += all_grads[i]
            loss += all_losses[i]
        offset = 0
        for p in params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optim.step()
        losses[step] = float(loss)
        if step + 1 == args.ckpt_at and start == 0:
            model_sd, optim_sd = get_state_dict(model, optim)
            dcp.save({"model": model_sd, "optim": optim_sd, "data": loader}, checkpoint_id=args.ckpt)
    if rank == 0:
        stats = loader.stats()
        out.write_text(json.dumps({"losses": {str(k): v.hex() for k, v in losses.items()}, "stats": loader.stats_table(), "tokens_per_s": stats["throughput"]["tokens_per_s"]}))
    loader.close()


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(args, rank, world, 0, Path(out))
        dist.barrier()  # no rank tears the group down while another still talks through it
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(path: Path) -> tuple[dict[int, float], dict]:
    doc = json.loads(path.read_text())
    return {int(k): float.fromhex(v) for k, v in doc["losses"].items()}, doc


def plot(path: str, full: dict[int, float], resumed: dict[int, float], ckpt_at: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(full), list(full.values()), label="uninterrupted")
    ax.plot(list(resumed), list(resumed.values()), "--", label="resumed in a new process")
    ax.axvline(ckpt_at, color="grey", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per valid token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the uninterrupted run")
    parser.add_argument("--ckpt-at", type=int, default=None, help="step after which to checkpoint (default: half of --steps)")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="data-parallel ranks of the uninterrupted run (gloo)")
    parser.add_argument("--plot", metavar="PNG", help="save the loss curves to this PNG file (needs matplotlib)")
    parser.add_argument("--every", type=int, default=None, help="print every this many steps in the loss table (default: about 20 rows)")
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # the resumed phase, in its own process
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ckpt_at = args.ckpt_at if args.ckpt_at is not None else args.steps // 2
    if not 0 < args.ckpt_at < args.steps:
        parser.error("--ckpt-at must be between 0 and --steps")
    if args.resume:
        train(args, 0, 1, args.ckpt_at, Path(args.out))
        return 0

    with tempfile.TemporaryDirectory(prefix="zephon-tiny-gpt-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        build_data(root / "data")
        args.data, args.ckpt = str(root / "data"), str(root / "ckpt")
        full_out, resumed_out = root / "full.json", root / "resumed.json"
        if args.ranks == 1:
            train(args, 0, 1, 0, full_out)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_rank_main, args=(args.ranks, _free_port(), args, str(full_out)), nprocs=args.ranks, join=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--resume", "--steps", str(args.steps), "--ckpt-at", str(args.ckpt_at)]
        cmd += ["--data", args.data, "--ckpt", args.ckpt, "--out", str(resumed_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            return proc.returncode
        full, doc = _losses(full_out)
        resumed, _ = _losses(resumed_out)

        every = args.every or max(1, args.steps // 20)
        print(f"tiny GPT: {sum(p.numel() for p in TinyGPT().parameters()):,} parameters, {LANES} lanes x microbatch {MICROBATCH} x {CONTEXT} tokens per step")
        print(f"uninterrupted run on {args.ranks} rank(s); checkpoint after step {args.ckpt_at}; resumed on 1 rank in a new process\n")
        print(f"{'step':>5}  {'uninterrupted':>14}  {'resumed':>14}  bit-identical")
        shown = sorted({s for s in full if s % every == 0 or s == args.ckpt_at or s == args.steps - 1})
        for s in shown:
            r = resumed.get(s)
            same = "" if r is None else ("yes" if r.hex() == full[s].hex() else "NO")
            print(f"{s:>5}  {full[s]:>14.6f}  {'' if r is None else f'{r:14.6f}':>14}  {same}")
        common = sorted(resumed)
        equal = common == list(range(args.ckpt_at, args.steps)) and all(resumed[s].hex() == full[s].hex() for s in common)
        first, last = full[0], full[args.steps - 1]
        print(f"\nloss {first:.3f} -> {last:.3f} over {args.steps} steps ({time.perf_counter() - t0:.1f} s in all)")
        print(
            f"resumed losses of steps {args.ckpt_at}..{args.steps - 1} "
            + ("equal the uninterrupted run's bit for bit" if equal else "DIFFER from the uninterrupted run's")
        )
        print(f"\ndata loader of the uninterrupted run (rank 0):\n{doc['stats']}")
        if args.plot:
            plot(args.plot, full, resumed, args.ckpt_at)
            print(f"loss curves saved to {args.plot}")
        return 0 if equal and last < first and math.isfinite(last) else 1


if __name__ == "__main__":
    sys.exit(main())
