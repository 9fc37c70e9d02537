"""Helpers shared by the benchmark scripts: corpus access, a reference tiktoken encoding, tables.

Imports only the standard library at module level, so that worker processes spawned by a
pipeline (which re-import the running script) start without paying for numpy or torch here.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from zephon.cli.processes import descendants_peak_rss_mib, tree_cpu_s

HERE = Path(__file__).resolve().parent
DEFAULT_CORPUS = Path(os.environ.get("ZEPHON_BENCH_CORPUS", HERE.parent.parent / "shared" / "data" / "corpus"))
DEFAULT_TOKENIZER = Path(
    os.environ.get("ZEPHON_BENCH_TOKENIZER", HERE.parent.parent / "shared" / "data" / "gpt2" / "tokenizer.json")
)

#: End-of-text tokens tried, in order, when a benchmark needs the EOS id without zephon.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<EOS>")

#: GPT-2's pre-tokenization regex (what tokenizers' ByteLevel pre-tokenizer applies).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# -- corpus -------------------------------------------------------------------------------------------


def corpus_files(folder: Path) -> list[Path]:
    """The JSONL shards of a folder, in the order zephon reads them (sorted by name)."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(".jsonl") and not p.name.startswith("."))
    if not files:
        raise SystemExit(f"no .jsonl files in {folder}")
    return files


def read_texts(folder: Path, field: str = "text") -> list[str]:
    """Every document's text, shard by shard, row by row (blank lines skipped, as zephon does)."""
    texts = []
    for path in corpus_files(folder):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    texts.append(json.loads(line)[field])
    return texts


def make_subset(folder: Path, max_docs: int, out: Path) -> Path:
    """Copy the first ``max_docs`` documents (in read order) into ``out``, keeping shard names."""
    out.mkdir(parents=True, exist_ok=True)
    left = max_docs
    for path in corpus_files(folder):
        if left <= 0:
            break
        lines = []
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    lines.append(line if line.endswith("\n") else line + "\n")
                    left -= 1
                    if left == 0:
                        break
        (out / path.name).write_text("".join(lines), encoding="utf-8")
    return out


def eos_id(tokenizer: Any) -> int:
    """The EOS id of a ``tokenizers.Tokenizer`` (first known end-of-text token it has)."""
    for token in EOS_CANDIDATES:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return tid
    raise SystemExit(f"the tokenizer has none of the end-of-text tokens {EOS_CANDIDATES}")


# -- a reference tiktoken encoding built from tokenizer.json -------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted (character -> byte)."""
    from zephon.text.tiktoken_encoding import _byte_decoder as table

    return table()


def tiktoken_encoding(tokenizer_path: Path) -> Any:
    """A ``tiktoken.Encoding`` for a GPT-2 style byte-level BPE ``tokenizer.json`` (ranks = ids).

    Raises ``SystemExit`` when the file is not that kind of tokenizer (the tiktoken ceiling does
    not apply then). Callers should still compare its ids with ``tokenizers`` on a sample.
    """
    import tiktoken

    spec = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    pre = json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        raise SystemExit("tiktoken ceiling: the tokenizer is not byte-level BPE")
    decoder = _byte_decoder()
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    ranks = {}
    for token, tid in model["vocab"].items():
        if token in specials:
            continue
        try:
            ranks[bytes(decoder[c] for c in token)] = tid
        except KeyError:
            raise SystemExit(f"tiktoken ceiling: vocabulary entry {token!r} is not in the byte-level alphabet") from None
    return tiktoken.Encoding("bench-bytelevel-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


# -- CPU time and memory ---------------------------------------------------------------------------
# Both read the whole process tree (the workers are the fork server's children, not this process's).



def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of every process under it (see ``tree_cpu_s``)."""
    return tree_cpu_s()


def children_peak_rss_mib() -> dict[int, float]:
    """Peak RSS (``VmHWM``) of each live worker process under this one, in MiB (Linux; else ``{}``)."""
    return descendants_peak_rss_mib(only_workers=True)


# -- reporting ----------------------------------------------------------------------------------------


def run_script(script: str, args: Sequence[str], *, what: str, env: dict[str, str] | None = None,
               timeout: float | None = None) -> dict[str, Any]:
    """Run ``script`` with ``args`` in a fresh interpreter; the JSON of its last ``RESULT `` line.

    Raises ``RuntimeError`` naming ``what`` with the end of its output when it printed none.
    """
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{what} failed with exit code {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def load_average() -> tuple[float, float, float] | None:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": load_average(),
    }
    for name in ("numpy", "tokenizers", "tiktoken", "torch", "msgspec", "zephon"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except ImportError:
            info[name] = None
    for var in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info


def fmt_num(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None) -> None:
    """A plain-text table (also valid Markdown)."""
    right = right or [i > 0 for i in range(len(headers))]
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)) + " |"

    print(line(headers))
    print("|" + "|".join(("-" * (w + 1) + ":") if r else (":" + "-" * (w + 1)) for w, r in zip(widths, right)) + "|")
    for row in rows:
        print(line(row))
