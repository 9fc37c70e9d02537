"""Skipping global steps against delivering them, on the recipe of ``recipe.py``, in steps per second.

The recipe (``tokenize``), with an endless source over the corpus (``exhausted_policy="repeat"``)
on 4 lanes, and the same over the corpus tokenized beforehand (``pretokenized``, no tokenizer)::

    Pipeline(source).options(canonical_replicas=4, workers=W)
        .tokenize(tokenizer=TOKENIZER, special_tokens="eos")
        .pack_flat(2049, algorithm="wrap").shuffle(1024, seed=42).batch(8)

Every measurement starts a new loader, delivers ``--warmup`` steps (workers started, shuffle buffers
full), then times ``--steps`` global steps one of three ways:

- ``train``: delivered, every microbatch converted with ``to_training(return_labels=True,
  dtype=torch.long)`` (the normal step rate: what a trainer's data loop costs);
- ``deliver``: delivered, not converted (the loader alone);
- ``skip``: ``loader.skip_steps(steps)``.

Wall and CPU seconds (this process and every process under it) per step; medians over
``--repeats`` rounds, the three modes alternating within a round. After each skip, the next step
is compared with the one the uninterrupted run delivers there (its digest), so the skip is exact.
The tokenizer's share of the operators' time while skipping says what bounds the skip rate: the
skipped steps are tokenized, packed, shuffled and batched like the others, since the token counts
decide every later row.

With ``--keyframes`` (on by default for the tokenize recipe), a run first goes through the steps
with ``options(keyframes=folder, keyframe_every=K)``; then ``skip_steps(N)`` is timed from a step
chosen so that its target lies ``R`` steps after a keyframe (``--keyframe-remainders``: about K/2
on average, K-1 at worst): the skip restores the keyframe and produces R steps, instead of N.

Usage::

    python benchmarks/skip.py                       # both recipes, inline and workers=2, 40 steps, 3 rounds
    python benchmarks/skip.py --steps 20 --repeats 1 --workers 0 --recipes tokenize
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

LANES = 4
MODES = ("train", "deliver", "skip")


def build(corpus: Path, tokenizer: Path, workers: int, recipe: str) -> Any:
    """The recipe (``tokenize``), or the same without the tokenizer over the corpus tokenized
    beforehand (``pretokenized``: rows of ``input_ids`` ending in EOS)."""
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import StaticMixtureWorkSource

    if recipe == "tokenize":
        dataset = Dataset.from_path("corpus", corpus)
    else:
        dataset = Dataset.from_rows("corpus", pretokenized(corpus, tokenizer))
    source = StaticMixtureWorkSource([dataset], {"corpus": 1.0}, seed=0, exhausted_policy="repeat")
    pipe = Pipeline(source).options(canonical_replicas=LANES, workers=workers)
    if recipe == "tokenize":
        pipe = pipe.tokenize(tokenizer=str(tokenizer), special_tokens="eos")
    return pipe.pack_flat(2049, algorithm="wrap").shuffle(1024, seed=42).batch(8)


def pretokenized(corpus: Path, tokenizer: Path) -> list[dict[str, Any]]:
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = C.eos_id(tok)
    return [{"input_ids": np.array(e.ids + [eos], dtype=np.int32)} for e in tok.encode_batch_fast(C.read_texts(corpus))]


def step_digest(step: list) -> str:
    from zephon.ledger import batch_digest
    from zephon.ledger import step_digest as digest

    return digest([batch_digest(b) for b in step])


def measure(pipe: Any, mode: str, warmup: int, steps: int) -> dict[str, Any]:
    """One timed run of ``mode``; also the digest of the step after the timed ones."""
    import torch

    with pipe.loader() as loader:
        it = loader.steps()
        for _ in range(warmup):
            next(it)
        cpu0, t0 = C.cpu_seconds(), time.perf_counter()
        if mode == "skip":
            skipped = loader.skip_steps(steps)
        else:
            for _ in range(steps):
                step = next(it)
                if mode == "train":
                    for mb in step:
                        mb.to_training(return_labels=True, dtype=torch.long)
        wall, cpu = time.perf_counter() - t0, C.cpu_seconds() - cpu0
        after = step_digest(next(it))
        out: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu, "after": after}
        if mode == "skip":
            flow = loader.stats()["flow"]
            total = sum(f["seconds"] for f in flow.values()) or 1.0
            out["tokenize_share"] = flow.get("tokenize", {}).get("seconds", 0.0) / total
            out["discarded"] = skipped.discarded
        return out


def measure_keyframes(pipe: Any, folder: str, every: int, n: int, remainder: int, digests: dict[int, str]) -> dict[str, Any]:
    """One ``skip_steps(n)`` whose target is ``remainder`` steps after a keyframe of ``folder``."""
    warmup = (remainder - n) % every
    with pipe.options(keyframes=folder, keyframe_every=every).loader() as loader:
        it = loader.steps()
        for _ in range(warmup):
            next(it)
        cpu0, t0 = C.cpu_seconds(), time.perf_counter()
        skipped = loader.skip_steps(n)
        wall, cpu = time.perf_counter() - t0, C.cpu_seconds() - cpu0
        if skipped.keyframe != warmup + n - remainder or step_digest(next(it)) != digests[warmup + n]:
            raise SystemExit(f"keyframe skip to step {warmup + n}: not from keyframe {warmup + n - remainder} or not exact")
    return {"wall_s": wall, "cpu_s": cpu}


def keyframe_rates(pipe: Any, every: int, n: int, remainders: list[int], repeats: int) -> dict[str, Any]:
    """Skip rates from keyframes saved by a first run over the steps (its digests check each skip)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="zephon-keyframes-")
    last = max((r - n) % every + n for r in remainders)
    digests = {}
    with pipe.options(keyframes=folder, keyframe_every=every).loader() as loader:
        for k, step in zip(range(last + 1), loader.steps()):
            digests[k] = step_digest(step)
    runs: dict[int, list] = {r: [] for r in remainders}
    for _ in range(repeats):
        for r in remainders:
            runs[r].append(measure_keyframes(pipe, folder, every, n, r, digests))
    return {
        r: {"steps_per_s": C.median([n / x["wall_s"] for x in rs]), "cpu_s_per_step": C.median([x["cpu_s"] / n for x in rs])}
        for r, rs in runs.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--steps", type=int, default=40, help="global steps timed per run of the tokenize recipe")
    ap.add_argument("--steps-pretokenized", type=int, default=400,
                    help="global steps timed per run of the pretokenized recipe")
    ap.add_argument("--warmup", type=int, default=3, help="global steps delivered before timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="0,2", help="comma-separated worker counts")
    ap.add_argument("--recipes", default="tokenize,pretokenized", help="comma-separated: tokenize, pretokenized")
    ap.add_argument("--keyframe-every", type=int, default=50, help="K: keyframes every K global steps (0: no keyframe runs)")
    ap.add_argument("--keyframe-skip", type=int, default=600, help="N: steps skipped from keyframes")
    ap.add_argument("--keyframe-remainders", default="25,49", help="R: steps between the keyframe and the target")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    results: dict[str, Any] = {"machine": C.machine_info(), "warmup": args.warmup, "configs": {}}
    configs = [(r, int(w)) for r in args.recipes.split(",") for w in args.workers.split(",")]
    for recipe, workers in configs:
        name = f"{recipe}, workers={workers}"
        pipe = build(args.corpus, args.tokenizer, workers, recipe)
        steps = args.steps if recipe == "tokenize" else args.steps_pretokenized
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(measure(pipe, mode, args.warmup, steps))
        digests = {r["after"] for m in MODES for r in runs[m]}
        if len(digests) != 1:
            raise SystemExit(f"{name}: the step after the skip differs from the uninterrupted run's")
        summary: dict[str, Any] = {
            m: {
                "steps_per_s": C.median([steps / r["wall_s"] for r in runs[m]]),
                "cpu_s_per_step": C.median([r["cpu_s"] / steps for r in runs[m]]),
                "wall_s": [round(r["wall_s"], 3) for r in runs[m]],
            }
            for m in MODES
        }
        summary["skip"]["tokenize_share"] = C.median([r["tokenize_share"] for r in runs["skip"]])
        summary["skip"]["discarded"] = [r["discarded"] for r in runs["skip"]]
        summary["steps"] = steps
        if args.keyframe_every and recipe == "tokenize":
            remainders = [int(r) for r in args.keyframe_remainders.split(",")]
            summary["keyframes"] = keyframe_rates(pipe, args.keyframe_every, args.keyframe_skip, remainders, args.repeats)
        results["configs"][name] = summary

    rows = []
    for name, s in results["configs"].items():
        train, skip = s["train"], s["skip"]
        rows.append([
            name,
            str(s["steps"]),
            *(C.fmt_num(s[m]["steps_per_s"], ",.1f") for m in MODES),
            C.fmt_num(skip["steps_per_s"] / train["steps_per_s"], ".2f") + "x",
            C.fmt_num(skip["steps_per_s"] / s["deliver"]["steps_per_s"], ".2f") + "x",
            *(C.fmt_num(s[m]["cpu_s_per_step"], ".3f") for m in MODES),
            C.fmt_num(100 * skip["tokenize_share"], ".0f") + "%",
        ])
    print(f"global steps of {LANES} x 8 x 2049 tokens, timed after {args.warmup}; medians of {args.repeats}")
    C.print_table(
        ["config", "steps", "train steps/s", "deliver steps/s", "skip steps/s", "skip/train", "skip/deliver",
         "train CPU s/step", "deliver CPU s/step", "skip CPU s/step", "tokenize share (skip)"],
        rows,
    )
    keyed = {name: s for name, s in results["configs"].items() if "keyframes" in s}
    if keyed:
        print(f"\nskip_steps({args.keyframe_skip}) from keyframes every {args.keyframe_every} steps, the target R steps "
              f"after a keyframe; medians of {args.repeats}")
        C.print_table(
            ["config", "R", "skip steps/s", "skip/train", "skip CPU s/step"],
            [[name, str(r), C.fmt_num(k["steps_per_s"], ",.1f"), C.fmt_num(k["steps_per_s"] / s["train"]["steps_per_s"], ".1f") + "x",
              C.fmt_num(k["cpu_s_per_step"], ".4f")] for name, s in keyed.items() for r, k in s["keyframes"].items()],
        )
    print("the step after every skip is the uninterrupted run's (digests equal)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
