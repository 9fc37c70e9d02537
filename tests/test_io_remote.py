"""Remote datasets: fsspec URLs, the local shard cache, retries, permanent errors, changed objects.

No network: fsspec's ``memory://`` filesystem, local ``file://`` URLs, and :class:`FlakyStore`, an
in-process object store that adds latency and fails a set number of times before answering.
"""

from __future__ import annotations

import io
import json
import os
import time

import fsspec
import pyarrow as pa
import numpy as np
import pyarrow.feather
import pyarrow.parquet
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from zephon import Pipeline
from zephon.io import CacheOptions, Dataset, IoOptions, ShardChangedError, StorageError
from zephon.sources import storage as _storage


class FlakyStore(MemoryFileSystem):
    """An object store in memory: ``latency_s`` per call; the first ``failures[path]`` opens fail."""

    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]
    latency_s = 0.002
    failures: dict = {}  # path -> transient failures left before opens succeed
    error: type = ConnectionResetError
    opens = 0

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(path[len("flaky://") :] if path.startswith("flaky://") else path)

    def _open(self, path, mode="rb", **kwargs):
        time.sleep(self.latency_s)
        if "r" in mode:
            type(self).opens += 1
            left = self.failures.get(path, 0)
            if left:
                self.failures[path] = left - 1
                raise self.error(f"injected failure opening {path}")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("flaky", FlakyStore, clobber=True)


def jsonl(shard: int, n: int = 5) -> bytes:
    return "".join(json.dumps({"text": f"r{shard}-{i}"}) + "\n" for i in range(n)).encode()


def parquet(shard: int, n: int = 5) -> bytes:
    sink = io.BytesIO()
    pa.parquet.write_table(pa.Table.from_pylist([{"text": f"r{shard}-{i}"} for i in range(n)]), sink, row_group_size=2)
    return sink.getvalue()


def arrow(shard: int, n: int = 5) -> bytes:
    sink = io.BytesIO()
    pa.feather.write_feather(pa.Table.from_pylist([{"text": f"r{shard}-{i}"} for i in range(n)]), sink, chunksize=2)
    return sink.getvalue()


def tokens(shard: int, n: int = 5) -> bytes:
    return b"".join(np.array([shard + 1, i + 1, 0], dtype=np.uint16).tobytes() for i in range(n))


@pytest.fixture
def stores(tmp_path):
    mem = fsspec.filesystem("memory")
    for s in range(3):
        mem.pipe(f"/bucket/{tmp_path.name}/j/part-{s}.jsonl", jsonl(s))
        mem.pipe(f"/bucket/{tmp_path.name}/p/part-{s}.parquet", parquet(s))
        mem.pipe(f"/bucket/{tmp_path.name}/a/part-{s}.arrow", arrow(s))
        mem.pipe(f"/bucket/{tmp_path.name}/t/part-{s}.bin", tokens(s))
    FlakyStore.store.clear()
    FlakyStore.failures.clear()
    FlakyStore.opens = 0
    FlakyStore.error = ConnectionResetError
    flaky = fsspec.filesystem("flaky")
    for s in range(3):
        flaky.pipe(f"/b/p/part-{s}.parquet", parquet(s))
    yield f"memory://bucket/{tmp_path.name}", tmp_path
    mem.rm(f"/bucket/{tmp_path.name}", recursive=True)


def cache(tmp_path, **kw) -> dict:
    return {"cache": {"dir": str(tmp_path / "shards"), "backoff_s": 0.001, **kw}}


def texts(pipe) -> list:
    return [r.payload["text"] for b in pipe for r in b.records]


@pytest.mark.parametrize("sub", ["j", "p"])
def test_a_memory_url_reads_through_the_shard_cache_like_local_files(stores, sub):
    root, tmp = stores
    ds = Dataset.from_path("r", f"{root}/{sub}", io_options=cache(tmp))
    assert ds.shard_ids == ("part-0.jsonl", "part-1.jsonl", "part-2.jsonl") if sub == "j" else ds.num_rows == 15
    assert ds.read(2, [4, 0]) == [{"text": "r2-4"}, {"text": "r2-0"}]
    assert len([n for n in os.listdir(tmp / "shards") if not n.startswith(".")]) == 3  # each object downloaded once
    got = texts(Pipeline(ds).options(io_options=cache(tmp)).batch(5))
    assert got == [f"r{s}-{i}" for s in range(3) for i in range(5)]
    identity = ds.fingerprint()["shards"][0]["identity"]
    assert identity.startswith("sha256=") and ds.shard_path(0).startswith("memory://")  # no checksums: the content's


@pytest.mark.parametrize("sub", ["a", "t"])
def test_arrow_and_token_files_on_a_store_read_through_the_cache(stores, sub):
    root, tmp = stores
    ds = Dataset.from_path("r", f"{root}/{sub}", io_options=cache(tmp), eos_token_id=0, cache_dir=tmp / "c")
    assert ds.format == {"a": "arrow", "t": "tokens"}[sub] and ds.shard_sizes == (5, 5, 5)
    got = ds.read(1, [4, 0])
    if sub == "a":
        assert got == [{"text": "r1-4"}, {"text": "r1-0"}]
    else:
        assert [g["input_ids"].tolist() for g in got] == [[2, 5, 0], [2, 1, 0]]


def test_globs_and_file_urls(stores):
    root, tmp = stores
    globbed = Dataset.from_path("r", f"{root}/p/part-[01].parquet", io_options=cache(tmp))
    assert globbed.shard_ids == ("part-0.parquet", "part-1.parquet")
    (tmp / "local").mkdir()
    (tmp / "local" / "a.jsonl").write_bytes(jsonl(7))
    local = Dataset.from_path("l", f"file://{tmp}/local", cache_dir=tmp / "c")
    assert local.read(0, [1]) == [{"text": "r7-1"}] and local.shard_path(0) == str(tmp / "local" / "a.jsonl")


def test_the_cache_evicts_least_recently_used_copies_under_its_limit(stores):
    root, tmp = stores
    size = len(jsonl(0))
    opts = cache(tmp, max_bytes=2 * size)
    ds = Dataset.from_path("r", f"{root}/j", io_options=opts)
    folder = tmp / "shards"
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 2 * size
    ds.read(1, [0])
    time.sleep(0.01)
    ds.read(2, [0])  # shard 1 is now the least recently used
    time.sleep(0.01)
    ds.read(0, [0])  # fetched again, evicting shard 1
    names = sorted(n.split("-", 1)[1] for n in os.listdir(folder) if not n.startswith("."))
    assert names == ["part-0.jsonl", "part-2.jsonl"]
    assert ds.read(1, [3]) == [{"text": "r1-3"}]  # evicted copies come back on demand
    with pytest.raises(ValueError, match="more than the shard cache's max_bytes"):
        Dataset.from_path("r", f"{root}/j", io_options=cache(tmp, dir=str(tmp / "tiny"), max_bytes=10))


def test_transient_failures_and_latency_are_retried_with_backoff(stores):
    root, tmp = stores
    FlakyStore.failures.update({"/b/p/part-0.parquet": 2, "/b/p/part-2.parquet": 1})
    ds = Dataset.from_path("f", "flaky://b/p", io_options=cache(tmp))
    assert FlakyStore.opens == 3 + 3  # three objects, three injected failures
    assert texts(Pipeline(ds).options(io_options=cache(tmp)).batch(5)) == [f"r{s}-{i}" for s in range(3) for i in range(5)]
    waits = []
    FlakyStore.failures["x"] = 3
    opts = CacheOptions(retries=3, backoff_s=0.1, max_backoff_s=0.25)
    calls = iter([TimeoutError("slow"), ConnectionError("reset"), OSError(104, "reset by peer"), "ok"])

    def call():
        item = next(calls)
        if isinstance(item, BaseException):
            raise item
        return item

    assert _storage.with_retries("flaky://b/x", "downloading", call, opts, sleep=waits.append) == "ok"
    assert waits == [0.1, 0.2, 0.25]


def test_retries_are_bounded_and_permanent_errors_name_the_url(stores):
    root, tmp = stores
    FlakyStore.failures["/b/p/part-1.parquet"] = 100
    with pytest.raises(StorageError, match=r"downloading flaky:///b/p/part-1.parquet failed 3 times .*injected failure"):
        Dataset.from_path("f", "flaky://b/p", io_options=cache(tmp, retries=2))
    FlakyStore.failures.clear()
    FlakyStore.error = PermissionError
    FlakyStore.failures["/b/p/part-0.parquet"] = 1
    before = FlakyStore.opens
    with pytest.raises(StorageError, match=r"downloading flaky:///b/p/part-0.parquet failed \(PermissionError.*not retried"):
        Dataset.from_path("f", "flaky://b/p", io_options=cache(tmp, dir=str(tmp / "other")))
    assert FlakyStore.opens == before + 1
    with pytest.raises(FileNotFoundError, match="memory://bucket/.*/nothing does not exist"):
        Dataset.from_path("r", f"{root}/nothing")


def test_an_object_changed_on_the_store_is_refused(stores):
    root, tmp = stores
    ds = Dataset.from_path("r", f"{root}/p", io_options=cache(tmp))
    checkpoint = Pipeline(ds).batch(5).loader().checkpoint()
    time.sleep(0.002)
    fsspec.filesystem("memory").pipe(f"{root}/p/part-1.parquet".replace("memory://", "/"), parquet(9))
    for f in (tmp / "shards").iterdir():
        f.unlink()  # the next read must fetch again
    with pytest.raises(ShardChangedError, match=r"remote shard memory:///bucket/.*part-1.parquet changed after the dataset was opened"):
        ds.read(1, [0])
    again = Dataset.from_path("r", f"{root}/p", io_options=cache(tmp))
    with pytest.raises(ValueError, match=r"shard 'part-1.parquet' content differs from the checkpoint's"):
        Pipeline(again).batch(5).restore(checkpoint)


def test_a_disabled_cache_explains_that_remote_shards_need_it(stores):
    root, tmp = stores
    with pytest.raises(ValueError, match="is remote and the shard cache is disabled"):
        Dataset.from_path("r", f"{root}/j", io_options={"cache": {"enabled": False}})
    with pytest.raises(TypeError, match=r"unknown cache option\(s\) \['size'\]"):
        Pipeline([{"a": 1}]).options(io_options={"cache": {"size": 1}})
    opts = IoOptions(cache={"root": "/x", "limit_bytes": "2gb"})  # Zephon 0.2.0's names
    assert (opts.cache.dir, opts.cache.max_bytes) == ("/x", 2 << 30)
