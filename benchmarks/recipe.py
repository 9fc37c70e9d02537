"""End-to-end throughput of the seed-003 recipe against encoder ceilings measured in the same run.

The recipe, on a folder of JSONL documents and a ``tokenizer.json``::

    Pipeline(Dataset.from_path("corpus", folder))
        .options(canonical_replicas=LANES, workers=WORKERS)
        .tokenize(tokenizer=TOKENIZER, special_tokens="eos", backend=BACKEND)
        .pack_flat(2049, algorithm="wrap")
        .shuffle(1024, seed=42)
        .batch(8)
    # every batch: batch.to_training(return_labels=True, dtype=torch.long)

Every measurement runs in a fresh process (this script re-run with ``--child``), one pass over
the corpus; the table reports medians over ``--repeats``. Counted tokens are the real
(non-padding) tokens of the packed 2049-token rows of the delivered batches; the ceilings count
the same thing (document ids plus one EOS each; only whole 2049-token rows for the packing
ceilings). See benchmarks/README.md for the columns.

Usage::

    python benchmarks/recipe.py                      # every configuration, 3 repeats
    python benchmarks/recipe.py --max-docs 500 --repeats 1 --configs inline,lanes8
    python benchmarks/recipe.py --json results.json
    python benchmarks/recipe.py --profile inline     # cProfile of one in-process run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

ROW = 2049  # pack_flat max_length: 2048 inputs + 1 shifted label
READ = 64  # documents per encode call in the weak ceilings (zephon's read_size)
STRONG = 512  # documents per encode call in the strong ceilings, the ones the ratios use
BUFFER = 1024  # shuffle buffer
MICRO = 8  # microbatch size
CHECKPOINT_EVERY = 100  # the pipelines take a checkpoint (json.dumps) every this many batches

#: name -> settings. Ceilings use the tokenizer directly; pipelines name the ceiling their ratio uses.
CONFIGS: dict[str, dict[str, Any]] = {
    "ceil-encode": {"kind": "ceiling", "encoder": "tokenizers", "mode": "encode", "per_call": READ,
                    "what": "Tokenizer.encode_batch, 64 texts a call, ids left in the Encoding objects"},
    "ceil-encode-fast": {"kind": "ceiling", "encoder": "tokenizers", "mode": "encode_fast", "per_call": READ,
                         "what": "Tokenizer.encode_batch_fast (no offsets; what zephon calls), 64 texts a call, ids left native"},
    "ceil-pack": {"kind": "ceiling", "encoder": "tokenizers", "mode": "pack", "per_call": READ,
                  "what": "weak: encode_batch_fast, 64 texts a call + np.fromiter(ids) + EOS + np.concatenate/reshape into 2049-token rows"},
    "ceil-pack-strong": {"kind": "ceiling", "encoder": "tokenizers", "mode": "pack", "per_call": STRONG,
                         "what": "STRONG: encode_batch_fast, 512 texts a call (all cores) + the same numpy packing"},
    "inline": {"kind": "pipeline", "lanes": 1, "workers": 0, "backend": "tokenizers", "ceiling": "ceil-pack-strong"},
    "lanes8": {"kind": "pipeline", "lanes": 8, "workers": 0, "backend": "tokenizers", "ceiling": "ceil-pack-strong"},
    "lanes8-thread": {"kind": "pipeline", "lanes": 8, "workers": 0, "thread": True, "backend": "tokenizers",
                      "ceiling": "ceil-pack-strong"},
    "lanes8-workers1": {"kind": "pipeline", "lanes": 8, "workers": 1, "backend": "tokenizers", "ceiling": "ceil-pack-strong"},
    "lanes8-workers2": {"kind": "pipeline", "lanes": 8, "workers": 2, "backend": "tokenizers", "ceiling": "ceil-pack-strong"},
    "ceil-tiktoken": {"kind": "ceiling", "encoder": "tiktoken", "mode": "encode", "per_call": READ,
                      "what": "tiktoken Encoding.encode_ordinary_batch(num_threads=cpus), 64 texts a call, lists"},
    "ceil-tiktoken-strong": {"kind": "ceiling", "encoder": "tiktoken", "mode": "encode", "per_call": STRONG,
                             "what": "tiktoken encode_ordinary_batch(num_threads=cpus), 512 texts a call, lists (no numpy)"},
    "ceil-tiktoken-pack": {"kind": "ceiling", "encoder": "tiktoken", "mode": "pack", "per_call": READ,
                           "what": "weak: encode_to_numpy on a thread per CPU, 64 texts a call + EOS + concatenate/reshape"},
    "ceil-tiktoken-pack-strong": {"kind": "ceiling", "encoder": "tiktoken", "mode": "pack", "per_call": STRONG,
                                  "what": "STRONG: encode_to_numpy on a thread per CPU, 512 texts a call + the same numpy packing"},
    "tiktoken": {"kind": "pipeline", "lanes": 1, "workers": 0, "backend": "tiktoken", "ceiling": "ceil-tiktoken-pack-strong"},
    "default-lanes8": {"kind": "pipeline", "lanes": 8, "workers": 0, "backend": "auto", "ceiling": "ceil-tiktoken-pack-strong"},
    "default-lanes8-thread": {"kind": "pipeline", "lanes": 8, "workers": 0, "thread": True, "backend": "auto",
                              "ceiling": "ceil-tiktoken-pack-strong"},
    "tiktoken-lanes8-workers2": {"kind": "pipeline", "lanes": 8, "workers": 2, "backend": "tiktoken",
                                 "ceiling": "ceil-tiktoken-pack-strong"},
}
DEFAULT_CONFIGS = list(CONFIGS)


# ==================================================================================================
# child side: one measurement, result printed as one JSON line
# ==================================================================================================


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_pipeline(task: dict[str, Any]):
    from zephon import Pipeline
    from zephon.io import Dataset

    return (
        Pipeline(Dataset.from_path("corpus", task["corpus"]))
        .options(canonical_replicas=task["lanes"], workers=task["workers"], thread=task.get("thread", False),
                 drain=task.get("drain", False))
        .tokenize(tokenizer=task["tokenizer"], special_tokens="eos", backend=task["backend"])
        .pack_flat(ROW, algorithm="wrap")
        .shuffle(BUFFER, seed=42)
        .batch(MICRO)
    )


def _backend_of(pipe) -> str:
    """The encoder the tokenize step resolved to (its ``handle.backend``)."""
    try:
        for _, op in pipe.plan.chain.children:
            handle = getattr(op, "handle", None)
            if handle is not None:
                return handle.backend
    except AttributeError:
        pass
    return "?"


def _real_tokens(batch) -> int:
    return sum(len(r.payload["input_ids"]) - r.meta.padding_length for r in batch.records)


def child_run(task: dict[str, Any]) -> dict[str, Any]:
    """One pass of the recipe: throughput, time to first batch, peak RSS."""
    import torch

    t0 = time.perf_counter()
    pipe = build_pipeline(task)
    t_built = time.perf_counter()
    first = None
    tokens = batches = 0
    workers_peak: dict[int, float] = {}
    every = task.get("checkpoint_every", CHECKPOINT_EVERY)
    cpu0 = C.cpu_seconds()
    loader = iter(pipe)
    for batch in loader:
        tensors = batch.to_training(return_labels=True, dtype=torch.long)
        tokens += _real_tokens(batch)
        batches += 1
        if every and batches % every == 0:
            json.dumps(loader.checkpoint())
        if task["workers"]:  # workers stop with the last batch, so sample while they live
            workers_peak.update(C.children_peak_rss_mib())
        if first is None:
            first = time.perf_counter()
            shape = list(tensors["input_ids"].shape)
    t_end = time.perf_counter()
    backend = _backend_of(pipe)
    loader.close()
    cpu = C.cpu_seconds() - cpu0  # this process and its joined worker processes
    rss = _rss_mib()
    elapsed = t_end - t_built
    return {
        "tokens": tokens,
        "batches": batches,
        "batch_shape": shape if batches else None,
        "setup_s": t_built - t0,
        "iterate_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "first_batch_s": None if first is None else first - t0,
        "rss_mib": rss,
        "workers_rss_mib": max(workers_peak.values()) if workers_peak else None,
        "cpu_s_per_mtok": cpu / tokens * 1e6 if tokens else None,
        "backend": backend,
    }


def _shuffle_buffers(tree: Any) -> list:
    """Every shuffle state's buffer in a lane's encoded operator states (found by its tag)."""
    found = []
    if isinstance(tree, dict):
        if tree.get("type") == "shuffle" and "buffer" in tree:
            found.append(tree["buffer"])
        for value in tree.values():
            found.extend(_shuffle_buffers(value))
    elif isinstance(tree, list):
        for value in tree:
            found.extend(_shuffle_buffers(value))
    return found


def _buffered(ckpt: dict[str, Any]) -> int:
    return sum(len(buf) for lane in ckpt["lanes"].values() for buf in _shuffle_buffers(lane.get("ops")))


def child_checkpoint(task: dict[str, Any]) -> dict[str, Any]:
    """Run until every lane's shuffle buffer is full (or as full as it gets), save that checkpoint.

    The checkpoint is taken after each batch; the one kept is the first with full buffers, else
    the fullest. The digest of the batch that follows it is kept so a restore can be checked.
    """
    from zephon.ledger import batch_digest

    loader = build_pipeline(task).loader()
    target = task["lanes"] * BUFFER
    best = {"buffered": -1}
    pending = False
    n = 0
    for batch in loader:
        n += 1
        if pending:
            best["next_digest"] = batch_digest(batch)
            pending = False
            if best["buffered"] >= target:
                break
        ckpt = loader.checkpoint()
        buffered = _buffered(ckpt)
        if buffered > best["buffered"]:
            best = {"buffered": buffered, "after_batches": n, "json": json.dumps(ckpt), "next_digest": None}
            pending = True
    loader.close()
    Path(task["checkpoint_path"]).write_text(best["json"], encoding="utf-8")
    size = len(best["json"].encode("utf-8"))
    return {
        "after_batches": best["after_batches"],
        "buffered": best["buffered"],
        "buffer_target": target,
        "bytes": size,
        "bytes_per_lane": size / task["lanes"],
        "next_digest": best["next_digest"],
    }


def child_restore(task: dict[str, Any]) -> dict[str, Any]:
    """A new process: build the pipeline, restore the saved checkpoint, time the first batch."""
    import torch

    from zephon.ledger import batch_digest

    t0 = time.perf_counter()
    ckpt = json.loads(Path(task["checkpoint_path"]).read_text(encoding="utf-8"))
    pipe = build_pipeline(task)
    t_built = time.perf_counter()
    loader = pipe.loader(ckpt)
    batch = next(loader, None)
    if batch is not None:
        batch.to_training(return_labels=True, dtype=torch.long)
    t1 = time.perf_counter()
    digest = None if batch is None else batch_digest(batch)
    loader.close()
    rss = _rss_mib()
    return {"restore_first_s": t1 - t0, "build_s": t_built - t0, "digest": digest, "rss_mib": rss}


def child_ceiling(task: dict[str, Any]) -> dict[str, Any]:
    """An encoder on texts already in memory, optionally with numpy conversion and row packing."""
    import numpy as np
    from tokenizers import Tokenizer

    from zephon.cli.bench import pack_rows  # the same packing as `zephon bench`'s ceiling

    texts = C.read_texts(Path(task["corpus"]))
    tok = Tokenizer.from_file(task["tokenizer"])
    eos = C.eos_id(tok)
    mode, encoder = task["mode"], task["encoder"]
    ids_match = None
    if encoder == "tiktoken":
        enc = C.tiktoken_encoding(Path(task["tokenizer"]))
        sample = texts[:50]
        expected = [e.ids for e in tok.encode_batch(sample, add_special_tokens=False)]
        ids_match = expected == enc.encode_ordinary_batch(sample)
        threads = os.cpu_count() or 1
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads)
        list(pool.map(str, range(threads)))  # start the threads before timing

        def to_numpy(text: str):
            return enc.encode_to_numpy(text, disallowed_special=())

        eos_arr = np.array([eos], dtype=np.uint32)
    else:
        eos_arr = np.array([eos], dtype=np.int32)

    tokens = 0
    rows = 0
    rest = eos_arr[:0]
    per_call = task.get("per_call", READ)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    first = None
    for i in range(0, len(texts), per_call):
        chunk = texts[i : i + per_call]
        if encoder == "tokenizers" and mode == "encode":
            tokens += sum(len(e) + 1 for e in tok.encode_batch(chunk, add_special_tokens=False))
        elif encoder == "tokenizers" and mode == "encode_fast":
            tokens += sum(len(e) + 1 for e in tok.encode_batch_fast(chunk, add_special_tokens=False))
        elif encoder == "tiktoken" and mode == "encode":
            tokens += sum(len(x) + 1 for x in enc.encode_ordinary_batch(chunk, num_threads=threads))
        else:
            if encoder == "tokenizers":
                arrays = [np.fromiter(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(chunk, add_special_tokens=False)]
            else:
                arrays = list(pool.map(to_numpy, chunk))
            packed, rest = pack_rows(arrays, rest, eos_arr, ROW)
            rows += len(packed)
            tokens += packed.size
        if first is None:
            first = time.perf_counter()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rss = _rss_mib()
    return {
        "tokens": tokens,
        "cpu_s_per_mtok": cpu / tokens * 1e6 if tokens else None,
        "rows": rows if mode == "pack" else None,
        "iterate_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "first_chunk_s": None if first is None else first - t0,
        "rss_mib": rss,
        "ids_match": ids_match,
        "backend": encoder,
    }


def child_profile(task: dict[str, Any]) -> dict[str, Any]:
    import cProfile

    import torch  # noqa: F401  (imported before profiling starts, as child_run's timer also excludes it)

    prof = cProfile.Profile()
    prof.enable()
    result = child_run(task)
    prof.disable()
    prof.dump_stats(task["profile_path"])
    return result


CHILD_MODES = {"run": child_run, "checkpoint": child_checkpoint, "restore": child_restore, "ceiling": child_ceiling,
               "profile": child_profile}


def child_main(raw: str) -> None:
    task = json.loads(raw)
    result = CHILD_MODES[task["mode_child"]](task)
    result["load_average"] = C.load_average()
    print("RESULT " + json.dumps(result), flush=True)


# ==================================================================================================
# parent side
# ==================================================================================================


def run_child(task: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    return C.run_script(Path(__file__).resolve(), ["--child", json.dumps(task)], env=env, timeout=timeout,
                        what=f"child {task.get('name')} ({task['mode_child']})")


def select_configs(spec: str | None) -> list[str]:
    names = DEFAULT_CONFIGS if not spec else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    chosen = list(dict.fromkeys(names))
    # A pipeline's ratio needs its ceiling in the same run.
    for n in list(chosen):
        ceiling = CONFIGS[n].get("ceiling")
        if ceiling and ceiling not in chosen:
            chosen.insert(0, ceiling)
    return chosen


def _ceiling_of(name: str) -> str:
    spec = CONFIGS[name]
    return spec.get("ceiling") or ("ceil-pack-strong" if spec.get("encoder") == "tokenizers" else "ceil-tiktoken-pack-strong")


def paired_ratio(results: dict[str, Any], name: str) -> float | None:
    """Median over rounds of tokens/s ÷ the ceiling's tokens/s in the same round.

    Rounds run every configuration once, back to back, so a pair shares the background load of
    that moment; the ratio is steadier than a ratio of medians when the load changes.
    """
    cfgs = results["configs"]
    ceiling = cfgs.get(_ceiling_of(name))
    if ceiling is None:
        return None
    base = {r["round"]: r["tokens_per_s"] for r in ceiling["runs"] if r.get("tokens_per_s")}
    ratios = [r["tokens_per_s"] / base[r["round"]] for r in cfgs[name]["runs"] if r.get("tokens_per_s") and r["round"] in base]
    return C.median(ratios)


def summarize(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    runs = rec["runs"]
    if not runs:
        return {"tokens": None, "tokens_per_s": None, "first_batch_s": None, "setup_s": None, "rss_mib": None,
                "workers_rss_mib": None, "cpu_s_per_mtok": None, "backend": None}
    out = {
        "tokens": runs[0]["tokens"] if runs else None,
        "tokens_per_s": C.median([r["tokens_per_s"] for r in runs]),
        "tokens_per_s_min": min(r["tokens_per_s"] for r in runs),
        "tokens_per_s_max": max(r["tokens_per_s"] for r in runs),
        "first_batch_s": C.median([r.get("first_batch_s") for r in runs]),
        "setup_s": C.median([r.get("setup_s") for r in runs]),
        "rss_mib": C.median([r["rss_mib"] for r in runs]),
        "workers_rss_mib": C.median([r.get("workers_rss_mib") for r in runs]),
        "cpu_s_per_mtok": C.median([r.get("cpu_s_per_mtok") for r in runs]),
        "backend": runs[0]["backend"] if runs else None,
    }
    if rec.get("restores"):
        out["restore_first_s"] = C.median([r["restore_first_s"] for r in rec["restores"]])
        out["restore_build_s"] = C.median([r["build_s"] for r in rec["restores"]])
        ck = rec["checkpoint"]
        out["restore_matches"] = all(r["digest"] == ck["next_digest"] for r in rec["restores"]) if ck["next_digest"] else None
    return out


def print_results(results: dict[str, Any]) -> None:
    cfgs = results["configs"]
    headers = ["configuration", "backend", "lanes", "workers", "tokens", "tokens/s", "range M/s", "x ceiling", "setup s",
               "1st batch s", "RSS MiB", "wkr RSS MiB", "CPU s/Mtok", "ckpt KiB/lane", "shuffle fill", "restore->1st s"]
    rows = []
    for name, rec in cfgs.items():
        spec, s = CONFIGS[name], rec["summary"]
        ratio = s.get("x_ceiling")
        spread = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s_min'] / 1e6:.2f}-{s['tokens_per_s_max'] / 1e6:.2f}"
        ck = rec.get("checkpoint")
        restore = s.get("restore_first_s")
        restore_cell = C.fmt_num(restore, ".2f")
        if restore is not None and s.get("restore_matches") is False:
            restore_cell += " (MISMATCH)"
        rows.append([
            name,
            s["backend"] or "-",
            str(spec.get("lanes", "-")),
            str(spec.get("workers", "-")),
            C.fmt_num(s["tokens"]),
            C.fmt_num(s["tokens_per_s"]),
            spread,
            C.fmt_num(ratio, ".2f"),
            C.fmt_num(s["setup_s"], ".2f"),
            C.fmt_num(s["first_batch_s"], ".2f"),
            C.fmt_num(s["rss_mib"], ".0f"),
            C.fmt_num(s["workers_rss_mib"], ".0f"),
            C.fmt_num(s.get("cpu_s_per_mtok"), ".3f"),
            C.fmt_num(ck["bytes_per_lane"] / 1024 if ck else None, ".1f"),
            f"{ck['buffered']}/{ck['buffer_target']} @{ck['after_batches']}" if ck else "-",
            restore_cell,
        ])
    C.print_table(headers, rows, right=[False, False] + [True] * (len(headers) - 2))
    print()
    for name, rec in cfgs.items():
        if CONFIGS[name]["kind"] == "ceiling":
            extra = ""
            if rec["runs"] and rec["runs"][0].get("ids_match") is False:
                extra = "  [WARNING: ids differ from tokenizers on the sample]"
            print(f"  {name}: {CONFIGS[name]['what']}{extra}")


def print_profile(path: str, top: int) -> None:
    import pstats

    for key in ("cumulative", "tottime"):
        print(f"\n--- top {top} by {key} ---")
        pstats.Stats(path).sort_stats(key).print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=C.DEFAULT_CORPUS, help="folder of JSONL files with a 'text' field")
    ap.add_argument("--tokenizer", type=Path, default=C.DEFAULT_TOKENIZER, help="tokenizer.json")
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process runs per configuration (median reported)")
    ap.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    ap.add_argument("--configs", default=None, help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint and restore columns")
    ap.add_argument("--drain", action="store_true",
                    help="options(drain=True): with several lanes, deliver every lane's batches to the end of the data "
                         "instead of stopping at the first incomplete global step (the default)")
    ap.add_argument("--json", type=Path, default=None, help="also save every measurement here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one child process")
    ap.add_argument("--profile", metavar="CONFIG", default=None, help="profile one pipeline run of CONFIG with cProfile")
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child_main(args.child)
        return 0

    corpus, tokenizer = args.corpus.resolve(), args.tokenizer.resolve()
    if not tokenizer.is_file():
        raise SystemExit(f"tokenizer not found: {tokenizer}")
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        tmp_path = Path(tmp)
        env = dict(os.environ)
        env["ZEPHON_CACHE_DIR"] = str(tmp_path / "cache")  # line indexes of this run only
        os.environ["ZEPHON_CACHE_DIR"] = env["ZEPHON_CACHE_DIR"]
        if args.max_docs:
            corpus = C.make_subset(corpus, args.max_docs, tmp_path / "corpus")
        docs = len(C.read_texts(corpus))  # also warms the page cache
        from zephon.io import Dataset

        Dataset.from_path("corpus", corpus)  # builds the line index once, outside every measurement
        common = {"corpus": str(corpus), "tokenizer": str(tokenizer), "drain": args.drain}

        if args.profile:
            spec = CONFIGS.get(args.profile)
            if not spec or spec["kind"] != "pipeline":
                raise SystemExit(f"--profile takes a pipeline configuration: {[n for n, c in CONFIGS.items() if c['kind'] == 'pipeline']}")
            path = str(tmp_path / "profile.pstats")
            res = run_child({**common, **spec, "name": args.profile, "mode_child": "profile", "profile_path": path}, env, args.timeout)
            print(f"{args.profile} under cProfile: {res['tokens']:,} tokens, {res['tokens_per_s']:,.0f} tokens/s "
                  f"(profiling slows it), load average {res['load_average']}")
            print_profile(path, args.profile_top)
            return 0

        names = select_configs(args.configs)
        results: dict[str, Any] = {
            "recipe": f"tokenize(eos) -> pack_flat({ROW}, wrap) -> shuffle({BUFFER}, seed=42) -> batch({MICRO}) -> to_training(return_labels=True, torch.long)",
            "corpus": str(args.corpus),
            "documents": docs,
            "tokenizer": str(tokenizer),
            "repeats": args.repeats,
            "drain": args.drain,
            "machine": C.machine_info(),
            "configs": {n: {"spec": CONFIGS[n], "runs": []} for n in names},
        }
        print(f"corpus {args.corpus} ({docs} documents{', first ' + str(args.max_docs) if args.max_docs else ''}), "
              f"tokenizer {tokenizer}, {os.cpu_count()} CPUs, load average {C.load_average()}")
        print(f"configurations: {', '.join(names)}; {args.repeats} fresh-process run(s) each"
              f"{'; drain=True' if args.drain else ''}\n")
        started = time.perf_counter()
        # Repeats go round-robin over the configurations so that changing background load
        # spreads over all of them instead of falling on one.
        for rep in range(args.repeats):
            for n in names:
                spec = CONFIGS[n]
                mode = "ceiling" if spec["kind"] == "ceiling" else "run"
                try:
                    res = run_child({**common, **spec, "name": n, "mode_child": mode}, env, args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    results["configs"][n].setdefault("errors", []).append(str(exc))
                    print(f"  [{rep + 1}/{args.repeats}] {n:26s} FAILED: {str(exc).strip().splitlines()[-1]}", flush=True)
                    continue
                res["round"] = rep
                results["configs"][n]["runs"].append(res)
                print(f"  [{rep + 1}/{args.repeats}] {n:26s} {res['tokens_per_s']:>12,.0f} tokens/s  "
                      f"load {res['load_average'][0] if res['load_average'] else '?'}", flush=True)
        if not args.no_checkpoint:
            for n in names:
                spec = CONFIGS[n]
                if spec["kind"] != "pipeline":
                    continue
                path = str(tmp_path / f"{n}.checkpoint.json")
                task = {**common, **spec, "name": n, "checkpoint_path": path}
                try:
                    ck = run_child({**task, "mode_child": "checkpoint"}, env, args.timeout)
                    restores = [run_child({**task, "mode_child": "restore"}, env, args.timeout) for _ in range(args.repeats)]
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    results["configs"][n].setdefault("errors", []).append(str(exc))
                    print(f"  checkpoint {n:26s} FAILED: {str(exc).strip().splitlines()[-1]}", flush=True)
                    continue
                results["configs"][n]["checkpoint"] = ck
                results["configs"][n]["restores"] = restores
                print(f"  checkpoint {n:26s} {ck['bytes_per_lane'] / 1024:8.1f} KiB/lane after {ck['after_batches']} "
                      f"batches, shuffle {ck['buffered']}/{ck['buffer_target']}", flush=True)
        for n in names:
            results["configs"][n]["summary"] = summarize(n, results["configs"][n])
            results["configs"][n]["summary"]["x_ceiling"] = paired_ratio(results, n)
        results["wall_s"] = time.perf_counter() - started
        results["load_average_end"] = C.load_average()
        print()
        print_results(results)
        print(f"\nload average at start {results['machine']['load_average']}, at end {results['load_average_end']}; "
              f"{results['wall_s']:.0f} s in all")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
            print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
