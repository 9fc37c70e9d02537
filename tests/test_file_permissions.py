"""Files the library writes get the permissions the process umask gives, not owner-only ``0600``.

On a shared cluster a teammate must be able to read a run's checkpoints, the dataset index and
the caches: with umask ``022`` they are ``0644``, with ``027`` ``0640``.
"""

from __future__ import annotations

import gzip
import json
import os
import stat

import fsspec
import pytest

from zephon import Pipeline
from zephon.core.atomic import replacing
from zephon.runtime.checkpoint import save_checkpoint
from zephon.text.tokenizer_cache import store_entry
from zephon.io import Dataset, build_index


@pytest.fixture(params=[(0o022, 0o644), (0o027, 0o640)], ids=["022", "027"])
def umask(request):
    mask, mode = request.param
    before = os.umask(mask)
    try:
        yield mode
    finally:
        os.umask(before)


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def files_under(folder) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names)


def test_a_replaced_file_gets_the_umask_permissions(tmp_path, umask):
    with replacing(tmp_path / "a.bin") as out:
        out.write(b"x")
    with replacing(tmp_path / "b.bin", durable=True) as out:
        out.write(b"y")
    assert [mode_of(tmp_path / n) for n in ("a.bin", "b.bin")] == [umask, umask]


def test_indexes_caches_digests_and_checkpoints_get_the_umask_permissions(tmp_path, umask, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(cache))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(8)))
    (data / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "z"}\n'))
    where, _ = build_index(data)
    ds = Dataset.from_path("web", data)
    assert ds.read(1, [0]) == [{"text": "z"}]
    saved = save_checkpoint(tmp_path / "ck", iter(Pipeline(ds).batch(2)))
    store_entry("test", "k", {"v": 1})
    written = files_under(cache) + [where, str(saved)]
    kinds = {os.path.relpath(p, cache).split(os.sep)[0] for p in files_under(cache)}
    assert {"digests", "index", "decompressed"} <= kinds
    assert {p: mode_of(p) for p in written} == {p: umask for p in written}


def test_remote_shard_copies_get_the_umask_permissions(tmp_path, umask):
    mem = fsspec.filesystem("memory")
    root = f"/perm/{tmp_path.name}"
    mem.pipe(f"{root}/a.jsonl", b'{"text": "r"}\n')
    try:
        ds = Dataset.from_path("r", f"memory:/{root}", io_options={"cache": {"dir": str(tmp_path / "shards")}})
        assert ds.read(0, [0]) == [{"text": "r"}]
    finally:
        mem.rm(root, recursive=True)
    copies = files_under(tmp_path / "shards")
    assert copies and {p: mode_of(p) for p in copies} == {p: umask for p in copies}
