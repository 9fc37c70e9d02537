"""``zephon index PATH``: count a dataset's shards once and write its index for fast discovery."""

from __future__ import annotations

import argparse
import json
import sys
import time

#: build_index's arguments -> this command's flags, for its error messages.
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "fmt", "recursive", "verify", "eos_token_id", "token_dtype", "cache_dir", "storage_options"
)}


def _index(args: argparse.Namespace) -> int:
    from ..sources.index import build_index

    options = json.loads(args.storage_options) if args.storage_options else None
    start = time.perf_counter()
    try:
        settings = {name: getattr(args, name) for name in FLAGS if name != "storage_options"}
        where, ds = build_index(args.path, **settings, storage_options=options, progress=not args.quiet)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        from .tokenizer import in_flags

        print(f"zephon index: {in_flags(str(exc), FLAGS)}", file=sys.stderr)
        return 2
    took = time.perf_counter() - start
    print(f"indexed {ds.num_shards} {ds.format} shards, {ds.num_rows} rows, in {took:.2f} s: {where}")
    return 0


def register(sub) -> None:
    cmd = sub.add_parser(
        "index",
        help="count a dataset's shards and write its index (.zephon-index.json) so later discovery is fast",
        description="Count every shard of a dataset once and write .zephon-index.json in its root. "
        "Dataset.from_path then takes row counts and identities from it for every shard whose size and "
        "modification time (or ETag) still match, and counts the others again.",
    )
    cmd.add_argument("path", help="a folder, a glob (quote it) or a URL, as Dataset.from_path takes it")
    cmd.add_argument("--fmt", choices=["jsonl", "parquet", "arrow", "tokens"], help="force a format (default: from the file endings)")
    cmd.add_argument("--recursive", action="store_true", help="also search subfolders")
    cmd.add_argument("--verify", choices=["quick", "full"], default="quick", help="content digest recorded per shard (as from_path's verify=)")
    cmd.add_argument("--eos-token-id", type=int, help="token files: the end-of-document token")
    cmd.add_argument("--token-dtype", choices=["uint16", "uint32", "int32", "int64"], help="raw .bin token files: the token dtype")
    cmd.add_argument("--cache-dir", help="zephon cache folder (default $ZEPHON_CACHE_DIR or ~/.cache/zephon)")
    cmd.add_argument("--storage-options", help="JSON object passed to the fsspec filesystem of a URL")
    cmd.add_argument("--quiet", action="store_true", help="no progress bar")
    cmd.set_defaults(func=_index)
