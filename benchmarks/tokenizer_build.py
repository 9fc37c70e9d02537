"""Building the live ``tokenizers`` tokenizer in a fresh process: from its JSON, from the cached model files.

Every process that encodes with ``backend="tokenizers"`` builds the tokenizer once (a restore,
each worker). Each round runs, in fresh processes and in alternating order: ``from_file`` (what a
hand-written loop does: ``Tokenizer.from_file`` of the ``tokenizer.json``), ``from_str`` (the
canonical JSON of zephon's handle, how it is built without the cached model files) and ``files``
(``zephon.text.bpe_files.build``: the vocabulary and merges files proven for that JSON). Only the
build is timed (imports and reading the handle are not); each tokenizer then encodes a sample and
the ids are checked equal. A private cache folder is used; a first process proves the files.

    python benchmarks/tokenizer_build.py                 # GPT-2's tokenizer, 8 rounds
    python benchmarks/tokenizer_build.py --tokenizer path/to/tokenizer.json --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

WAYS = ("from_file", "from_str", "files")
SAMPLE = ["Hello, world! 12 cafés", "中文 émoji 😀 <|endoftext|> and some more words of English text"]


def child(way: str, path: str) -> dict:
    import time

    from tokenizers import Tokenizer

    from zephon.text import bpe_files as _bpe_files
    from zephon.text.tokenizer import load_tokenizer

    handle = load_tokenizer(path, backend="tokenizers")  # from the cache: the canonical JSON, not built
    t = time.perf_counter()
    if way == "from_file":
        tok = Tokenizer.from_file(path)
    elif way == "from_str":
        tok = Tokenizer.from_str(handle.tokenizer_json)
    else:
        tok = _bpe_files.build(handle._json_digest)
        if tok is None:
            raise SystemExit("no proven model files for this tokenizer (not a BPE model, or the proof failed)")
    seconds = time.perf_counter() - t
    return {"s": seconds, "ids": [e.ids for e in tok.encode_batch(SAMPLE, add_special_tokens=False)]}


def run(way: str, path: str, env: dict) -> dict:
    return C.run_script(__file__, ["--child", way, path], env=env, what=way)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return 0
    path = str(args.tokenizer.resolve())
    with tempfile.TemporaryDirectory(prefix="zephon-tokbuild-") as cache:
        env = {**os.environ, "ZEPHON_CACHE_DIR": cache, "ZEPHON_TOKENIZER_CACHE": "1"}
        # Loading it for the tokenizers backend caches the handle and proves the model files.
        subprocess.run([sys.executable, "-c", f"from zephon.text.tokenizer import load_tokenizer as L; L({path!r}, backend='tokenizers')"],
                       env=env, check=True)
        print(f"{path}, {args.rounds} rounds, load average {C.load_average()}")
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        reference = None
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                res = run(way, path, env)
                reference = reference or res["ids"]
                if res["ids"] != reference:
                    raise SystemExit(f"{way}: other ids than the first build's")
                times[way].append(res["s"])
    base = times["from_file"]
    rows = []
    for way in WAYS:
        ratios = [a / b for a, b in zip(times[way], base)]
        rows.append([way, f"{statistics.median(times[way]) * 1000:.1f}", f"{min(times[way]) * 1000:.1f}-{max(times[way]) * 1000:.1f}",
                     f"{statistics.median(ratios):.2f}"])
    print()
    C.print_table(["build", "median ms", "range ms", "x from_file (median per round)"], rows)
    print(f"\nload average at the end {C.load_average()}; every build gave the same ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
