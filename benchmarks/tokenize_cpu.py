"""CPU-seconds per million tokens of zephon's ``tokenize`` against the bare ``tokenizers`` encoder.

Each round runs every way once, each in a fresh process, in alternating order; every way encodes
the same documents in calls of ``--per-call`` documents (512: the read-ahead's group, what the
operator receives in a pipeline):

- ``bare``: ``Tokenizer.from_file`` and ``encode_batch_fast(texts, add_special_tokens=False)``,
  the ids left in the ``Encoding`` objects (the ceiling);
- ``tokenizers`` / ``tiktoken``: ``Tokenize(path, special_tokens="eos", backend=...)`` and its
  ``apply_many`` on the same documents as payloads (``int32`` arrays out, EOS added);
- ``recipe``: the whole seed-003 recipe on the same documents, read from JSONL by the pipeline
  (``tokenize(backend="tokenizers")``, ``pack_flat(2049, "wrap")``, ``shuffle(1024)``,
  ``batch(8)``, one lane); its tokens are those of the delivered rows.

A way's tokens are the documents' ids plus one EOS each. Each way also reports the CPU of its
encoder's threads (the Rayon pool: every thread alive at the end but the calling one, read from
``/proc/self/task``; Linux), so the CPU spent outside the encoder is the rest. Two CPU figures are
taken with ``time.process_time`` (every thread of the process): *whole*, from the process start (imports,
loading and the first build included), and *encode*, the encoding loop only (for the recipe:
from the pipeline's build, after the imports, to its last batch). Ratios are the bare
way's CPU per token over the way's, taken per round, and the table shows their medians.

``--cache warm`` (default) runs with a tokenizer cache filled by a first process; ``--cache off``
sets ``ZEPHON_TOKENIZER_CACHE=0``; ``--cache cold`` gives every process an empty one.

    python benchmarks/tokenize_cpu.py                              # 5 rounds, bare and tokenizers
    python benchmarks/tokenize_cpu.py --ways bare,tokenizers,tiktoken --rounds 7
    python benchmarks/tokenize_cpu.py --passes 4                   # 18 M tokens of GPT-2 a process
    python benchmarks/tokenize_cpu.py --ways bare,recipe --passes 4   # the whole recipe, same documents
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

WAYS = ("bare", "tokenizers", "tiktoken", "recipe")


def _encoder_cpu(main: int) -> float:
    """CPU seconds of every thread alive at the end but the calling one (Linux; else 0): the
    encoder's pool and, for the recipe, any pipeline thread still running (its read-ahead thread
    has ended by then)."""
    total = 0.0
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(task.name) != main:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _recipe(tokenizer: str, folder: str) -> tuple[int, float]:
    """The delivered tokens, and the CPU time once the imports are done (before the build)."""
    from zephon import Pipeline
    from zephon.io import Dataset

    start = time.process_time()
    pipe = (
        Pipeline(Dataset.from_path("corpus", folder))
        .tokenize(tokenizer=tokenizer, special_tokens="eos", backend="tokenizers")
        .pack_flat(2049, algorithm="wrap")
        .shuffle(1024, seed=42)
        .batch(8)
    )
    return sum(len(r.payload["input_ids"]) - r.meta.padding_length for batch in pipe for r in batch.records), start


def child(way: str, tokenizer: str, corpus: str, per_call: int, max_docs: int, passes: int) -> dict:
    main = threading.get_native_id()
    if way == "recipe":  # ``corpus``: the folder of ``passes`` copies made by the parent
        tokens, t = _recipe(tokenizer, corpus)
        end = time.process_time()
        return {"tokens": tokens, "whole": end, "encode": end - t, "encoder": _encoder_cpu(main)}
    texts = C.read_texts(Path(corpus))
    if max_docs:
        texts = texts[:max_docs]
    texts = texts * passes
    calls = [texts[i : i + per_call] for i in range(0, len(texts), per_call)]
    if way == "bare":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)
        t = time.process_time()
        tokens = sum(len(e) + 1 for call in calls for e in tok.encode_batch_fast(call, add_special_tokens=False))
    else:
        from zephon.ops.tokenize import Tokenize

        op = Tokenize(tokenizer, special_tokens="eos", backend=way)
        payloads = [[{"text": s} for s in call] for call in calls]
        t = time.process_time()
        tokens = sum(len(o["input_ids"]) for call in payloads for out in op.apply_many(call) for o in out)
    end = time.process_time()
    return {"tokens": tokens, "whole": end, "encode": end - t, "encoder": _encoder_cpu(main)}


def _copies(corpus: Path, passes: int, into: str) -> str:
    """A folder holding ``passes`` hard-linked (else copied) copies of the corpus's shards."""
    folder = Path(into) / "corpus"
    folder.mkdir()
    for k in range(passes):
        for path in C.corpus_files(corpus):
            target = folder / f"p{k}-{path.name}"
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)
    return str(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS)
    ap.add_argument("--ways", default="bare,tokenizers", help=f"comma-separated, from {', '.join(WAYS)}; the first is the base")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-call", type=int, default=512)
    ap.add_argument("--max-docs", type=int, default=0, help="only the first N documents (0: all)")
    ap.add_argument("--passes", type=int, default=1, help="encode the documents this many times over in each process")
    ap.add_argument("--cache", choices=("warm", "off", "cold"), default="warm")
    ap.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        way, tok, corpus, per_call, max_docs, passes = args.child
        print("RESULT " + json.dumps(child(way, tok, corpus, int(per_call), int(max_docs), int(passes))), flush=True)
        return 0
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"--ways: unknown {unknown}; choose from {', '.join(WAYS)}")
    tok = str(args.tokenizer.resolve())
    if "recipe" in ways and args.max_docs:
        raise SystemExit("--max-docs: the recipe way reads whole shards; leave it out")

    with tempfile.TemporaryDirectory(prefix="zephon-tokcpu-") as cache:
        copies = _copies(args.corpus.resolve(), args.passes, cache) if "recipe" in ways else ""

        def child_args(way: str, max_docs: int = args.max_docs, passes: int = args.passes) -> list[str]:
            corpus = copies if way == "recipe" else str(args.corpus.resolve())
            return ["--child", way, tok, corpus, str(args.per_call), str(max_docs), str(passes)]

        env = {**os.environ, "ZEPHON_CACHE_DIR": cache, "ZEPHON_TOKENIZER_CACHE": "0" if args.cache == "off" else "1"}
        if args.cache == "warm":
            for way in ways[1:]:  # fills the cache (file entry, tiktoken proof, model files)
                C.run_script(__file__, child_args(way, 1, 1), env=env, what=f"{way} (warm-up)")
        print(f"{tok}, {args.corpus} x{args.passes}, {args.rounds} rounds, {args.per_call} documents a call, cache {args.cache}, "
              f"load average {C.load_average()}")
        runs: dict[str, list[dict]] = {w: [] for w in ways}
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else ways[::-1]:
                run_env = env
                if args.cache == "cold":
                    run_env = {**env, "ZEPHON_CACHE_DIR": tempfile.mkdtemp(prefix="cold-", dir=cache)}
                runs[way].append(C.run_script(__file__, child_args(way), env=run_env, what=way))
    base = runs[ways[0]]
    rows = []
    for way in ways:
        per = {k: [x[k] / x["tokens"] * 1e6 for x in runs[way]] for k in ("whole", "encode", "encoder")}
        ratio = {k: [b[k] / b["tokens"] / (x[k] / x["tokens"]) for b, x in zip(base, runs[way])] for k in ("whole", "encode")}
        rows.append([way, f"{runs[way][0]['tokens']:,}", f"{statistics.median(per['whole']):.3f}", f"{statistics.median(ratio['whole']):.3f}",
                     f"{statistics.median(per['encode']):.3f}", f"{statistics.median(ratio['encode']):.3f}",
                     f"{statistics.median(per['encoder']):.3f}"])
    print()
    C.print_table(["way", "tokens", "whole CPU s/Mtok", f"x {ways[0]} (whole)", "encode CPU s/Mtok", f"x {ways[0]} (encode)",
                   "encoder threads CPU s/Mtok"], rows)
    print(f"\nload average at the end {C.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
