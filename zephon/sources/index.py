"""The dataset index: every shard counted once and recorded in ``.zephon-index.json``."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from .dataset import Dataset, PathLike, check_file_settings
from .digest import resolve_cache_dir
from .discover import discover, write_index
from .shard_table import ShardSpec, index_entry, open_shards
from .storage import io_options as _as_io


def build_index(
    path: PathLike | Sequence[PathLike],
    *,
    fmt: str | None = None,
    recursive: bool = False,
    verify: str = "quick",
    eos_token_id: int | None = None,
    token_dtype: str | None = None,
    cache_dir: PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
    io_options: Any = None,
    progress: bool = False,
) -> tuple[str, Dataset]:
    """Count every shard and write ``.zephon-index.json`` in the root; ``(where, the dataset)``.

    ``Dataset.from_path`` then takes rows and row groups from it while shards are unchanged. The
    arguments are ``from_path``'s and must match where they decide rows.
    """
    name = "index"
    check_file_settings(name, fmt, verify, token_dtype)
    io = _as_io(io_options)
    root, found = discover(name, path, fmt=fmt, recursive=recursive, storage_options=storage_options, cache_dir=resolve_cache_dir(cache_dir), cache=io.cache)
    spec = ShardSpec(found[0].fmt, resolve_cache_dir(cache_dir), verify, None, eos_token_id, token_dtype)
    shards = open_shards(name, root, found, spec, storage_options, io, index="off", progress=progress)
    entries = {f.shard_id: index_entry(f, int(rows), shards.groups.get(i)) for i, (f, rows) in enumerate(zip(shards.found, shards.rows))}
    where = write_index(root, entries, spec.settings(), storage_options)
    return where, Dataset(os.path.basename(root.rstrip("/")) or "data", spec.fmt, shards.shard_ids, shards, io=io)
