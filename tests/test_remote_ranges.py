"""Remote Parquet by byte ranges: a read fetches the footer and its row groups, never the whole object."""

from __future__ import annotations

import collections
import hashlib
import io
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from zephon import Pipeline
from zephon.io import Dataset, ShardChangedError


class RangeFile(AbstractBufferedFile):
    def _fetch_range(self, start, end):
        data = self.fs.objects[self.path][start:end]
        type(self.fs).fetched[self.path] += len(data)
        return data


class RangeStore(AbstractFileSystem):
    """An object store in memory with ETags and ranged reads, counting the bytes each object sends."""

    protocol = "rangestore"
    objects: dict = {}
    fetched: collections.Counter = collections.Counter()

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("rangestore://"):] if path.startswith("rangestore://") else path
        return path.rstrip("/")

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        if path in self.objects:
            data = self.objects[path]
            return {"name": path, "size": len(data), "type": "file", "ETag": hashlib.md5(data).hexdigest()}
        if any(p.startswith(path + "/") for p in self.objects):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        names = sorted(p for p in self.objects if p.rsplit("/", 1)[0] == path)
        return [self.info(n) for n in names] if detail else names

    def _open(self, path, mode="rb", block_size="default", autocommit=True, cache_options=None, **kwargs):
        return RangeFile(self, path, mode, block_size=block_size, cache_options=cache_options, size=len(self.objects[path]), **kwargs)


fsspec.register_implementation("rangestore", RangeStore, clobber=True)


def parquet_bytes(groups: int = 40, rows: int = 50, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, 300)) for _ in range(groups * rows)]
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": words, "n": np.arange(groups * rows)}), sink, row_group_size=rows)
    return sink.getvalue()


@pytest.fixture
def remote(tmp_path):
    root = f"/bucket/{tmp_path.name}"
    RangeStore.objects[f"{root}/part-0.parquet"] = parquet_bytes()
    RangeStore.fetched.clear()
    return f"rangestore://{root}", f"{root}/part-0.parquet", {"cache": {"dir": str(tmp_path / "cache")}}


def chunk_bytes(data: bytes, groups: list[int], columns: list[str]) -> int:
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    total = 0
    for g in groups:
        for c in range(meta.num_columns):
            col = meta.row_group(g).column(c)
            if col.path_in_schema in columns:
                total += col.total_compressed_size
    return total


def test_a_read_fetches_the_footer_and_its_row_groups_only(remote):
    url, path, io_options = remote
    data = RangeStore.objects[path]
    ds = Dataset.from_path("p", url, io_options=io_options)
    footer = RangeStore.fetched[path]
    # Counting read the footer (pyarrow fetches the object's last 64 KiB for it), not the 670 KB object.
    assert ds.num_rows == 2000 and footer <= 64 << 10
    rows = ds.read(0, [120, 125, 1777, 130])  # row groups 2 and 35
    assert [r["n"] for r in rows] == [120, 125, 1777, 130]
    read = RangeStore.fetched[path] - footer
    needed = chunk_bytes(data, [2, 35], ["text", "n"])
    assert needed <= read <= 1.2 * needed, (read, needed, len(data))
    assert not Path(io_options["cache"]["dir"]).exists()  # nothing was copied


def test_projected_columns_fetch_only_their_chunks(remote):
    url, path, io_options = remote
    data = RangeStore.objects[path]
    ds = Dataset.from_path("p", url, io_options=io_options, columns=["n"])
    before = RangeStore.fetched[path]
    assert ds.read(0, [5, 1999]) == [{"n": 5}, {"n": 1999}]
    assert RangeStore.fetched[path] - before <= 1.2 * chunk_bytes(data, [0, 39], ["n"])


def test_ranges_and_whole_copies_give_the_same_stream_and_a_changed_object_is_refused(remote):
    url, path, io_options = remote
    ranged = Dataset.from_path("p", url, io_options=io_options)
    whole_options = {**io_options, "remote_parquet": "whole"}
    whole = Dataset.from_path("p", url, io_options=whole_options)
    assert ranged.fingerprint() == whole.fingerprint()

    def stream(ds, options):
        loader = Pipeline(ds).options(io_options=options, canonical_replicas=2).shuffle(64, seed=3).batch(7).loader()
        out = [[r.payload["n"] for r in b.records] for _, b in zip(range(20), loader)]
        loader.close()
        return out

    assert stream(ranged, io_options) == stream(whole, whole_options)
    unread = Dataset.from_path("u", url, io_options=io_options, columns=["n"])  # opened, nothing read yet
    RangeStore.objects[path] = parquet_bytes(seed=1)  # same size, other bytes: another ETag
    with pytest.raises(ShardChangedError, match="changed after the dataset was opened"):
        unread.read(0, [0])
    fresh = Dataset.from_path("u", url, io_options=io_options, columns=["n"])  # opened after the change: reads it
    assert fresh.read(0, [0]) == [{"n": 0}] and fresh.fingerprint() != unread.fingerprint()


def test_remote_parquet_must_be_ranges_or_whole(remote):
    url, _, io_options = remote
    with pytest.raises(ValueError, match="remote_parquet"):
        Dataset.from_path("p", url, io_options={**io_options, "remote_parquet": "stream"})
