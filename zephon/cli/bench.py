"""``zephon bench``: the pretraining recipe on your data and tokenizer, next to the bare encoder.

Every run is a fresh process, round-robin, with the ceiling run before each recipe run and after
the last, so each recipe run is compared with the mean of its two neighbours (a machine's speed
drifts). The **ceiling** is the bare encoder in large calls over all cores with numpy packing; it
also times the rows the recipe's first batch draws from. The **recipe** (``tokenize``,
``pack_flat(wrap)``, ``shuffle``, ``batch``, ``to_training`` and periodic checkpoints) runs once
per ``--workers`` value, and a **restore** from its half-way checkpoint is timed and checked.
Rates: tokens delivered per second, and the *steady* rate of tokens built after the first batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .processes import descendants_peak_rss_mib, tree_cpu_s

__all__ = ["register", "run_bench"]


# -- child processes: one measurement each


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _texts(files: list[str], field: str, limit: int | None = None) -> list[str]:
    """The documents' texts, read with plain ``json`` (what a hand-written loop does)."""
    out: list[str] = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    out.append(json.loads(line)[field])
                    if limit is not None and len(out) >= limit:
                        return out
    return out


def pack_rows(arrays: list, rest: Any, eos: Any, row: int) -> tuple[Any, Any]:
    """The ceiling's packing: ``rest``, then each array followed by ``eos``, cut into rows of ``row``.

    Returns the ``[n, row]`` rows and the tokens left over for the next call.
    """
    import numpy as np

    flat = np.concatenate([rest, *(x for a in arrays for x in (a, eos))])
    n = len(flat) // row
    return flat[: n * row].reshape(n, row), flat[n * row :].copy()


def child_ceiling(task: dict[str, Any]) -> dict[str, Any]:
    """The bare encoder in large calls over all cores, plus numpy packing into rows."""
    import numpy as np

    from ..sources.dataset import Dataset

    t0, row = task["t0"], task["seq_len"]
    per_call, batch = task["docs_per_call"], task["batch_size"]
    eos_arr = np.array([task["eos"]], dtype=np.uint32 if task["encoder"] == "tiktoken" else np.int32)
    encode, pack = _bare_encoder(task), functools.partial(pack_rows, eos=eos_arr, row=row)
    ds = Dataset.from_path("data", task["data"])
    files = [ds.shard_path(i) for i in range(len(ds.shard_sizes))]
    ready = time.time() - t0  # started, tokenizer loaded, files listed
    rows, rest, done, want = eos_arr[:0].reshape(0, row), eos_arr[:0], 0, 16
    while len(rows) < batch:
        texts = _texts(files, task["field"], limit=want)
        more, rest = pack(encode(texts[done:]), rest)
        rows = np.concatenate([rows, more])
        if len(texts) < want:
            break
        done, want = len(texts), want * 4
    first = time.time() - t0
    # The recipe's first batch's rows: their documents counted untimed, then read, encoded by a
    # fresh tokenizer (no shared cache) and packed, added to the time to start and list the files.
    need = max(batch, task["first_rows"])
    docs = _docs_for_rows(_texts(files, task["field"], limit=64 * need), encode, need * row)
    encode_fresh = _bare_encoder(task)
    t = time.perf_counter()
    pack(encode_fresh(_texts(files, task["field"], limit=docs)), eos_arr[:0])
    first_rows = ready + time.perf_counter() - t
    # Throughput: texts in memory, the encoding loop alone.
    texts = _texts(files, task["field"])
    tokens, rest = 0, eos_arr[:0]
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), per_call):
        packed, rest = pack(encode(texts[i : i + per_call]), rest)
        tokens += packed.size
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "first_batch_s": first,
            "first_rows_s": first_rows, "first_rows": need, "first_rows_docs": docs,
            "cpu_s_per_mtok": cpu / tokens * 1e6, "rss_mib": _rss_mib()}


def _bare_encoder(task: dict[str, Any]) -> Callable[[list[str]], list]:
    """A fresh tokenizer's encode function: texts to id arrays, in large calls over all cores."""
    import numpy as np

    if task["encoder"] == "tiktoken":  # built straight from the BPE tokenizer.json, no checks
        from concurrent.futures import ThreadPoolExecutor

        import tiktoken

        from ..text.tiktoken_encoding import GPT2_PATTERN, _byte_decoder

        spec = json.loads(Path(task["tokenizer"]).read_text(encoding="utf-8"))
        decoder = _byte_decoder()
        specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        vocab = spec["model"]["vocab"].items()
        ranks = {bytes(decoder[c] for c in tok): tid for tok, tid in vocab if tok not in specials}
        enc = tiktoken.Encoding(
            "bench", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        pool = ThreadPoolExecutor(cpus)
        return lambda texts: list(pool.map(lambda t: enc.encode_to_numpy(t, disallowed_special=()), texts))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(task["tokenizer"])
    return lambda texts: [np.fromiter(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def _docs_for_rows(texts: list[str], encode: Callable[[list[str]], list], tokens: int) -> int:
    """How many of the first ``texts`` it takes to fill ``tokens`` (each document and its EOS)."""
    total = 0
    for start in range(0, len(texts), 16):
        for i, ids in enumerate(encode(texts[start : start + 16])):
            total += len(ids) + 1
            if total >= tokens:
                return start + i + 1
    return len(texts)


def _pipeline(task: dict[str, Any]) -> Any:
    from .. import Pipeline
    from ..sources.dataset import Dataset

    return (
        Pipeline(Dataset.from_path("data", task["data"]))
        .options(canonical_replicas=task["lanes"], workers=task["workers"], thread=task["thread"],
                 **({"read_size": task["read_size"]} if task.get("read_size") else {}),
                 **({"read_ahead": task["read_ahead"]} if task.get("read_ahead") is not None else {}))
        .tokenize(tokenizer=task["tokenizer"], field=task["field"], special_tokens="eos", backend=task["backend"])
        .pack_flat(task["seq_len"], algorithm="wrap")
        .shuffle(task["buffer"], seed=42)
        .batch(task["batch_size"])
    )


def child_recipe(task: dict[str, Any]) -> dict[str, Any]:
    """One pass of the recipe with periodic checkpoints; keeps the half-way checkpoint for a restore."""
    import numpy as np

    from ..runtime.ledger import batch_digest

    loader = iter(_pipeline(task))
    t0, tokens, batches, first, workers_rss = task["t0"], 0, 0, None, 0.0
    ckpt_bytes: list[int] = []
    saved: dict[str, Any] = {}
    c0, w0 = tree_cpu_s(), time.perf_counter()
    for batch in loader:
        batch.to_training(return_labels=True, dtype=np.int64)
        tokens += sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in batch.records)
        batches += 1
        if first is None:
            first = time.time() - t0
            # The steady state starts here; the count is read after the clock, so the batches the
            # workers build meanwhile are not counted in the steady rate.
            w_first = time.perf_counter()
            built_first = loader.stats()["operators"]["batch"]["real_tokens"]
        if saved.get("pending"):
            saved.update(next_digest=batch_digest(batch), pending=False)
        every = task["checkpoint_every"]
        if every and batches % every == 0:
            data = json.dumps(loader.checkpoint())
            ckpt_bytes.append(len(data))
            if task["workers"]:
                workers_rss = max([workers_rss, *descendants_peak_rss_mib(only_workers=True).values()])
            if batches <= task["half"] or not saved:
                saved = {"json": data, "after": batches, "pending": True}
    end = time.perf_counter()
    built = loader.stats()["operators"]["batch"]["real_tokens"]
    steady = (built - built_first) / (end - w_first) if first is not None and end > w_first else None
    loader.close()
    cpu = tree_cpu_s() - c0
    if saved.get("json") and task.get("checkpoint_path"):
        Path(task["checkpoint_path"]).write_text(saved["json"], encoding="utf-8")
    wall = end - w0
    return {"tokens": tokens, "batches": batches, "seconds": wall, "tokens_per_s": tokens / wall if wall else None,
            "built_tokens": built, "steady_tokens_per_s": steady,
            "first_batch_s": first, "cpu_s_per_mtok": cpu / tokens * 1e6 if tokens else None, "rss_mib": _rss_mib(),
            "workers_rss_mib": workers_rss or None, "checkpoint_bytes": max(ckpt_bytes) if ckpt_bytes else None,
            "checkpoint_after": saved.get("after"), "next_digest": saved.get("next_digest")}


def child_restore(task: dict[str, Any]) -> dict[str, Any]:
    """A new process: build the pipeline, restore the saved checkpoint, time the first batch."""
    import numpy as np

    from ..runtime.ledger import batch_digest

    ckpt = json.loads(Path(task["checkpoint_path"]).read_text(encoding="utf-8"))
    t0, pipe = task["t0"], _pipeline(task)
    t1 = time.perf_counter()
    loader = iter(pipe.restore(ckpt))
    batch = next(loader, None)
    if batch is not None:
        batch.to_training(return_labels=True, dtype=np.int64)
    seconds, call = time.time() - t0, time.perf_counter() - t1
    digest = None if batch is None else batch_digest(batch)
    loader.close()
    return {"restore_first_s": seconds, "restore_call_s": call, "digest": digest}


# -- the parent


def _run_child(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    task = {**task, "t0": time.time()}  # every row counts interpreter start-up and imports alike
    # Bytecode caches on, as Python has them by default, so no process compiles zephon anew.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run(
        [sys.executable, "-m", "zephon.cli.bench", json.dumps(task)], capture_output=True, text=True, timeout=timeout, env=env
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the {task['mode']} process failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")


def _median(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_bench(
    data: str, tokenizer: str, *, lanes: int = 8, workers: tuple[int, ...] = (0,), thread: bool = False,
    cold_workers: bool = False, backend: str = "auto", field: str = "text", seq_len: int = 2049, batch_size: int = 8,
    buffer: int = 1024, checkpoint_every: int = 100, docs_per_call: int = 512, repeats: int = 3, restore: bool = True,
    read_size: int | None = None, read_ahead: int | None = None, bracket: bool = True, timeout: float = 1800,
    out: Any = print,
) -> dict[str, Any]:
    """Measure the recipe against the ceiling (see the module docstring); returns every measurement."""
    from ..text.tokenizer import load_tokenizer

    handle = load_tokenizer(tokenizer, backend=backend)  # the ceiling uses the recipe's encoder
    if handle.eos_token_id is None:
        raise SystemExit(f"zephon bench: the tokenizer {tokenizer} has no EOS token, which the recipe needs")
    encoder, eos = handle.backend, handle.eos_token_id
    first_rows = _rows_before_first_batch(buffer, batch_size)
    common = {"data": os.path.abspath(data), "tokenizer": os.path.abspath(tokenizer), "field": field, "seq_len": seq_len,
              "batch_size": batch_size, "lanes": lanes, "buffer": buffer, "backend": backend,
              "checkpoint_every": checkpoint_every, "docs_per_call": docs_per_call, "eos": eos,
              "read_size": read_size, "read_ahead": read_ahead,
              "encoder": encoder, "first_rows": first_rows}
    configs: dict[str, dict[str, Any]] = {"ceiling": {**common, "mode": "ceiling"}}
    recipe = {**common, "mode": "recipe", "thread": False}
    for w in workers:
        configs[f"recipe workers={w}"] = {**recipe, "workers": w}
        if w and cold_workers:  # the same as the plain row, run again in the same rounds
            configs[f"recipe workers={w} cold"] = {**recipe, "workers": w}
    if thread:
        configs["recipe thread"] = {**recipe, "workers": 0, "thread": True}
    results: dict[str, Any] = {**common, "repeats": repeats, "cpus": os.cpu_count()}
    results.update(load_average_start=_load(), runs={n: [] for n in configs})
    out(f"zephon bench: {data} with {tokenizer} ({encoder}), {lanes} lanes, {os.cpu_count()} CPUs, "
        f"load average {results['load_average_start']}; {repeats} round(s)")
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        for name in configs:
            configs[name]["checkpoint_path"] = os.path.join(tmp, f"{len(name)}-{abs(hash(name))}.json")
        # One pass to count batches (for the half-way checkpoint) and build the line index once.
        probe = _run_child({**configs[next(n for n in configs if n != "ceiling")], "half": 0, "checkpoint_every": 0}, timeout)
        half = max(1, probe["batches"] // 2)
        rounds = [_schedule(list(configs), bracket, r == repeats - 1) for r in range(repeats)]
        for seq, (rnd, name) in enumerate((r, n) for r, names in enumerate(rounds) for n in names):
            res = _run_child({**configs[name], "half": half}, timeout)
            res["round"], res["seq"] = rnd, seq
            results["runs"][name].append(res)
            out(f"  [{rnd + 1}/{repeats}] {name:22s} {res['tokens_per_s'] or 0:>12,.0f} tokens/s")
        results["restores"] = {
            name: [_run_child({**task, "mode": "restore"}, timeout) for _ in range(repeats)]
            for name, task in configs.items()
            if restore and task["mode"] == "recipe" and os.path.exists(task["checkpoint_path"])
        }
    results["load_average_end"] = _load()
    results["summary"] = _summarize(results)
    return results


def _rows_before_first_batch(buffer: int, batch_size: int) -> int:
    """How many rows a lane's ``shuffle(buffer)`` takes in before it has given ``batch_size``: its
    warm-up window, then two rows for each output while the window grows (counted by the operator)."""
    from ..core.records import Meta, Record, Segment
    from ..ops.shuffle import Shuffle

    op = Shuffle(buffer, seed=0)
    state, arrived, given = op.init(0), 0, 0
    while given < batch_size:
        state, out = op.step(state, [Record({}, Meta(0, (Segment(0, 0, arrived, 0, 0, -1),)))])
        arrived, given = arrived + 1, given + len(out)
    return arrived


#: The run the others are compared with in the ``x inline`` column.
INLINE = "recipe workers=0"


def _schedule(names: list[str], bracket: bool, last_round: bool) -> list[str]:
    """The runs of one round, in order: the ceiling first, and with ``bracket`` again before each
    recipe run (and after the last one of the last round), so that every recipe run sits between two."""
    recipes = [n for n in names if n != "ceiling"]
    if not bracket:
        return ["ceiling", *recipes]
    order = [x for n in recipes for x in ("ceiling", n)]
    return order + ["ceiling"] if last_round else order


def _reference(ceilings: list[dict[str, Any]], run: dict[str, Any], key: str) -> float | None:
    """The ceiling's ``key`` when ``run`` ran: the mean of the ceiling runs just before and just after it
    (the machine's speed drifts; a run is compared with its neighbours in time), or the nearest one."""
    before = [c for c in ceilings if c["seq"] < run["seq"] and c.get(key)]
    after = [c for c in ceilings if c["seq"] > run["seq"] and c.get(key)]
    near = before[-1:] + after[:1]
    return statistics.fmean(c[key] for c in near) if near else None


#: The summary's figures per run name, each the median over rounds, in the table's order.
SUMMARY_KEYS = (
    "tokens_per_s", "ratio", "inline_ratio", "steady_tokens_per_s", "steady_ratio", "first_batch_s",
    "first_batch_minus_ceiling_s", "first_rows_s", "first_batch_minus_same_rows_s", "rss_mib", "workers_rss_mib",
    "cpu_s_per_mtok", "checkpoint_bytes",
)
#: The ceiling's own figures against itself.
_CEILING_FIXED = {"ratio": 1.0, "steady_ratio": 1.0, "inline_ratio": None, "first_batch_minus_ceiling_s": 0.0,
                  "first_batch_minus_same_rows_s": 0.0}


def _summarize(results: dict[str, Any]) -> dict[str, Any]:
    runs = results["runs"]
    ceilings = runs["ceiling"]
    recipes = [r for name, rs in runs.items() if name != "ceiling" for r in rs]
    for c in ceilings:  # the ceiling against itself; its rate is steady (it times texts in memory)
        c.update(_CEILING_FIXED, steady_tokens_per_s=c["tokens_per_s"])
    for r in recipes:  # against the ceiling when it ran (kept per run in the JSON, next to its own)
        keys = ("tokens_per_s", "first_batch_s", "first_rows_s")
        ref, first, same = (_reference(ceilings, r, key) for key in keys)
        steady, start = r.get("steady_tokens_per_s"), r.get("first_batch_s")
        r["ratio"] = r["tokens_per_s"] / ref if r.get("tokens_per_s") and ref else None
        r["steady_ratio"] = steady / ref if steady and ref else None
        r["first_batch_minus_ceiling_s"] = start - first if start and first is not None else None
        r["first_batch_minus_same_rows_s"] = start - same if start and same is not None else None
    for r in recipes:  # once every run's ratio is known, whatever the order of the runs
        # its ratio over the inline run's of its round (each over its ceiling: the drift cancels)
        inline = [i for i in runs.get(INLINE, []) if i["round"] == r["round"]]
        known = inline and r.get("ratio") and inline[0].get("ratio")
        r["inline_ratio"] = r["ratio"] / inline[0]["ratio"] if known else None
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        row = {"tokens": rs[0]["tokens"] if rs else None}
        row.update({key: _median([r.get(key) for r in rs]) for key in SUMMARY_KEYS})
        rest = results.get("restores", {}).get(name)
        if rest:
            expected = rs[0].get("next_digest")
            row["restore_first_s"] = _median([r["restore_first_s"] for r in rest])
            row["restore_call_s"] = _median([r.get("restore_call_s") for r in rest])
            row["restore_after_batches"] = rs[0].get("checkpoint_after")
            row["restore_exact"] = all(r["digest"] == expected for r in rest) if expected else None
        summary[name] = row
    return summary


#: The table: header, summary key and format of each column after the run's name.
COLUMNS = (
    ("tokens/s", "tokens_per_s", ",.0f"), ("x ceiling", "ratio", ".3f"), ("x inline", "inline_ratio", ".3f"),
    ("steady tok/s", "steady_tokens_per_s", ",.0f"), ("x ceiling", "steady_ratio", ".3f"),
    ("1st batch s", "first_batch_s", ".3f"), ("vs ceiling s", "first_batch_minus_ceiling_s", "+.3f"),
    ("vs same rows s", "first_batch_minus_same_rows_s", "+.3f"), ("RSS MiB", "rss_mib", ".0f"),
    ("wkr RSS MiB", "workers_rss_mib", ".0f"), ("CPU s/Mtok", "cpu_s_per_mtok", ".3f"),
    ("ckpt bytes", "checkpoint_bytes", ",.0f"), ("restore->1st s", "restore_first_s", ".3f"),
    ("restore() s", "restore_call_s", ".3f"),
)
#: What the ceiling's row shows instead (``None``: a dash).
_CEILING_CELLS = {"first_batch_minus_ceiling_s": (None, ""), "first_batch_minus_same_rows_s": ("first_rows_s", ".3f")}


def format_table(results: dict[str, Any]) -> str:
    """The summary as an aligned text table."""
    headers = ["run", *(h for h, _, _ in COLUMNS)]
    rows = []
    for name, s in results["summary"].items():
        row = [name]
        for _, key, spec in COLUMNS:
            if name == "ceiling":
                key, spec = _CEILING_CELLS.get(key, (key, spec))
            value = s.get(key) if key else None
            row.append("-" if value is None else format(value, spec))
        if s.get("restore_exact") is False:
            row[-2] += " MISMATCH"
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _workers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of ints, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of ints >= 0, got {text!r}")
    return values


def _main(args: argparse.Namespace) -> int:
    for what, path in (("--data", args.data), ("--tokenizer", args.tokenizer)):
        if not os.path.exists(path):
            print(f"zephon bench: {what} {path}: no such file or folder", file=sys.stderr)
            return 2
    names = ("lanes", "workers", "thread", "cold_workers", "backend", "field", "seq_len", "batch_size", "buffer",
             "checkpoint_every", "docs_per_call", "repeats", "read_size", "read_ahead")
    settings = {name: getattr(args, name) for name in names}
    results = run_bench(args.data, args.tokenizer, **settings, restore=not args.no_restore, bracket=not args.no_bracket)
    print(f"\n{format_table(results)}")
    print(f"\nload average {results['load_average_start']} at the start, {results['load_average_end']} at the end. "
          "tokens/s: tokens delivered per second over the whole pass; steady tok/s: tokens of every batch the lanes "
          "built after the first one (delivered, or left undelivered at the end of finite data) per second after the "
          "first batch; x ceiling: over the ceiling's tokens/s when the run ran (the mean of the ceiling runs just "
          "before and after it; median over rounds); x inline: its x ceiling over the inline run's (workers=0) in the "
          "same round (median over rounds); vs ceiling: time to first batch minus the ceiling's (both from "
          "process start, tokenizer load included); vs same rows: time to first batch minus the ceiling's time to encode and "
          f"pack as many rows as the recipe's first batch draws from ({results['first_rows']}: the shuffle's warm-up window, "
          "then two rows for each row of the batch; the ceiling's row shows that time)")
    Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"saved {args.json}")
    return 0


def register(sub: Any) -> None:
    """Add ``zephon bench`` to the command line."""
    p = sub.add_parser("bench", help="measure the pretraining recipe on your data and tokenizer against the bare encoder",
                       description="Run the pretraining recipe (tokenize, pack_flat, shuffle, batch, to_training, periodic "
                                   "checkpoints) on your data and tokenizer, each run in a fresh process next to the bare "
                                   "encoder, and print throughput, its ratio to the encoder, time to first batch, memory, CPU "
                                   "per token, checkpoint size and restore time.")
    p.add_argument("--data", required=True, help="a JSONL file or a folder of JSONL files (one document per line)")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json file (or its folder)")
    p.add_argument("--lanes", type=_positive, default=8, help="canonical_replicas, the number of lanes (default 8)")
    p.add_argument("--workers", type=_workers, default=(0,),
                   help="worker processes; a comma-separated list runs the recipe once per value (default 0)")
    p.add_argument("--thread", action="store_true", help="also run the recipe with a background thread (workers=0, thread=True)")
    p.add_argument("--cold-workers", action="store_true",
                   help="also run each workers > 0 recipe once more (rows marked 'cold'), in the same rounds")
    p.add_argument("--backend", default="auto", choices=("auto", "tokenizers", "tiktoken"), help="tokenize backend (default auto)")
    p.add_argument("--field", default="text", help="the JSON field holding the text (default text)")
    p.add_argument("--seq-len", type=_positive, default=2049, help="pack_flat row length (default 2049)")
    p.add_argument("--batch-size", type=_positive, default=8, help="rows per microbatch (default 8)")
    p.add_argument("--buffer", type=_positive, default=1024, help="shuffle buffer, rows per lane (default 1024)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="take a checkpoint every N batches (0: never; default 100)")
    p.add_argument("--docs-per-call", type=_positive, default=512, help="documents per encoder call in the ceiling (default 512)")
    p.add_argument("--read-size", type=_positive, default=None,
                   help="options(read_size=...): documents read (and encoded in one call) per lane step (default: the library's)")
    p.add_argument("--read-ahead", type=int, default=None,
                   help="options(read_ahead=...): samples read and tokenized ahead per call (0: off; default: the library's)")
    p.add_argument("--repeats", type=_positive, default=3, help="fresh-process rounds; medians are reported (default 3)")
    p.add_argument("--no-restore", action="store_true", help="skip the restore measurement")
    p.add_argument("--no-bracket", action="store_true",
                   help="run the ceiling once per round instead of before every recipe run (faster, but on a machine "
                        "whose speed drifts the ratios of later runs are off)")
    p.add_argument("--json", default="zephon-bench.json", help="where to write every measurement (default zephon-bench.json)")
    p.set_defaults(func=_main)


if __name__ == "__main__":  # a child process: one measurement, printed as a JSON line
    _task = json.loads(sys.argv[1])
    _child = {"ceiling": child_ceiling, "recipe": child_recipe, "restore": child_restore}
    print("RESULT " + json.dumps(_child[_task["mode"]](_task)), flush=True)
