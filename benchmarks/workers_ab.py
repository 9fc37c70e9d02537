"""Workers against inline, directly: the bench's recipe process, configurations alternating in rounds.

A ratio to a ceiling measured minutes apart moves with the machine; this script compares the
configurations with each other instead. Each round runs every configuration once in a fresh
process (`zephon bench`'s recipe: L lanes, `to_training`, a checkpoint every 100 batches), the
order reversed every other round, and the report gives, per configuration, the median tokens/s,
the median and the geometric mean of its ratios to the same round's first configuration, and in
how many rounds it was faster than that one.

A configuration is ``NAME=WORKERS`` or ``NAME=WORKERS:KEY=VALUE,...`` (environment variables set
for that run only), for example::

    python benchmarks/workers_ab.py --rounds 8                                   # inline, workers=1, workers=2
    python benchmarks/workers_ab.py --backend tokenizers --configs inline=0 w1=1
    python benchmarks/workers_ab.py --configs w1=1 w1-3threads=1:ZEPHON_ENCODER_THREADS=3
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def parse_config(text: str) -> tuple[str, int, dict[str, str]]:
    """``NAME=WORKERS[:KEY=VALUE,...]`` as (name, workers, environment)."""
    name, _, rest = text.partition("=")
    workers, _, env = rest.partition(":")
    if not name or not workers.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=WORKERS or NAME=WORKERS:KEY=VALUE,...")
    pairs = [kv.partition("=") for kv in env.split(",") if kv]
    if any(not k or not sep for k, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: the environment part must be KEY=VALUE pairs, comma-separated")
    return name, int(workers), {k: v for k, _, v in pairs}


def run_round(configs: list, task: dict, reverse: bool) -> dict[str, float]:
    """One fresh recipe process per configuration; tokens/s by name."""
    from zephon.cli.bench import _run_child

    order = configs[:1] + configs[1:][::-1] if reverse else configs
    rates = {}
    for name, workers, env in order:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the child inherits it
        try:
            res = _run_child({**task, "workers": workers}, timeout=1800)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rates[name] = res["tokens_per_s"]
    return rates


def summarize(rounds: list[dict[str, float]], names: list[str]) -> list[list]:
    base = names[0]
    rows = []
    for name in names:
        ratios = [r[name] / r[base] for r in rounds]
        faster = sum(x > 1 for x in ratios)
        rows.append([
            name, f"{statistics.median(r[name] for r in rounds) / 1e6:.2f}", f"{statistics.median(ratios):.3f}",
            f"{math.exp(statistics.fmean(math.log(x) for x in ratios)):.3f}",
            "-" if name == base else f"{faster} of {len(ratios)}",
        ])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS, help="JSONL folder (default: the shared corpus)")
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--backend", default="auto", choices=("auto", "tokenizers", "tiktoken"))
    ap.add_argument("--copies", type=int, default=4,
                    help="read the data this many times over (copied into a temporary folder; default 4: the shared corpus "
                         "then holds 18 M tokens, enough that the workers' start-up is not most of the difference)")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--configs", nargs="+", type=parse_config, default=None,
                    help="NAME=WORKERS[:KEY=VALUE,...]; the first is the baseline (default: inline, workers=1 and workers=2)")
    args = ap.parse_args()
    configs = args.configs or [("inline", 0, {}), ("workers=1", 1, {}), ("workers=2", 2, {})]
    names = [c[0] for c in configs]
    if len(set(names)) != len(names):
        ap.error("configuration names must differ")
    with tempfile.TemporaryDirectory(prefix="zephon-ab-") as tmp:
        data = args.corpus.resolve()
        if args.copies > 1:
            data = Path(tmp)
            for r in range(args.copies):
                for f in C.corpus_files(args.corpus):
                    shutil.copyfile(f, data / f"r{r}-{f.name}")
        run(args, configs, names, data)


def run(args: argparse.Namespace, configs: list, names: list[str], data: Path) -> None:
    task = {"mode": "recipe", "data": str(data), "tokenizer": str(args.tokenizer.resolve()), "field": "text",
            "seq_len": 2049, "batch_size": 8, "lanes": args.lanes, "buffer": 1024, "backend": args.backend,
            "checkpoint_every": 100, "thread": False, "half": 0}
    print(f"{os.cpu_count()} CPUs, load average {C.load_average()}; {args.corpus} with {args.tokenizer.name} "
          f"({args.backend}) x{args.copies}, {args.lanes} lanes, {args.rounds} rounds")
    rounds = []
    for i in range(args.rounds):
        rates = run_round(configs, task, reverse=i % 2 == 1)
        rounds.append(rates)
        print(f"  round {i + 1}: " + "  ".join(f"{n} {rates[n] / 1e6:.2f}M" for n in names), flush=True)
    print()
    C.print_table(["config", "median M tok/s", f"median ratio to {names[0]}", "geometric mean", f"faster than {names[0]}"],
                  summarize(rounds, names))


if __name__ == "__main__":
    main()
