"""Shards are identified by their content: a byte-identical copy resumes a checkpoint, a changed byte does not.

Clusters re-copy data (``cp -r``, ``rsync`` without ``-t``, staging to local disks at job start)
and touch files; none of that changes what a shard holds, so none of it may refuse a checkpoint
or break a read. A same-size rewrite whose modification time was put back does change the
content and must be refused, naming the shard. The content digest is taken once per file and
cached, so later opens do not read the files again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet
import pytest

from zephon import Pipeline
from zephon.io import Dataset, ShardChangedError
from zephon.work import StaticMixtureWorkSource
try:
    from zephon.sources import digest as _digest
except ImportError:
    _digest = None

#: Each test reads and writes its own cache folder.
pytestmark = pytest.mark.usefixtures("cache_dir")

SHARDS = 3
ROWS = 40
STEPS = 12
TAKEN_AT = 5


def write_jsonl(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for s in range(SHARDS):
        lines = [json.dumps({"id": 100 * s + i, "text": f"row {s}-{i} " + "x" * (i % 9)}) for i in range(ROWS)]
        (folder / f"shard-{s:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def write_parquet(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for s in range(SHARDS):
        table = pa.Table.from_pylist([{"id": 100 * s + i, "text": f"row {s}-{i}"} for i in range(ROWS)])
        pa.parquet.write_table(table, folder / f"part-{s}.parquet", row_group_size=7)
    return folder


def pipeline(folder: Path) -> Pipeline:
    data = Dataset.from_path("web", folder)
    src = StaticMixtureWorkSource([data], {"web": 1.0}, seed=3, chunk_size=4, shuffle_shards=True, shuffle_within_shard=True)
    return Pipeline(src).batch(4)


def ids(batch) -> list[int]:
    return [r.payload["id"] for r in batch.records]


def run_with_checkpoint(folder: Path) -> tuple[list, dict]:
    """The uninterrupted run's batches, and a checkpoint taken after ``TAKEN_AT`` of them."""
    it = iter(pipeline(folder))
    batches, checkpoint = [], None
    for step in range(STEPS):
        if step == TAKEN_AT:
            checkpoint = it.checkpoint()
        batches.append(ids(next(it)))
    return batches, checkpoint


def resumed(folder: Path, checkpoint: dict) -> list:
    it = iter(pipeline(folder).loader(checkpoint))
    return [ids(next(it)) for _ in range(STEPS - TAKEN_AT)]


def recopy_in_place(folder: Path) -> None:
    """What staging does: the same bytes, written again (new inodes, new modification times)."""
    away = folder.with_name(folder.name + "-away")
    shutil.copytree(folder, away, copy_function=shutil.copyfile)
    shutil.rmtree(folder)
    time.sleep(0.01)
    shutil.copytree(away, folder, copy_function=shutil.copyfile)


def touch_all(folder: Path) -> None:
    later = time.time_ns() + 5_000_000_000
    for f in folder.iterdir():
        os.utime(f, ns=(later, later))


@pytest.mark.parametrize("change", [recopy_in_place, touch_all], ids=["recopied", "touched"])
def test_a_checkpoint_resumes_on_a_byte_identical_recopy_or_after_touch(tmp_path, change):
    folder = write_jsonl(tmp_path / "data")
    batches, checkpoint = run_with_checkpoint(folder)
    change(folder)
    assert resumed(folder, checkpoint) == batches[TAKEN_AT:]


def test_a_checkpoint_resumes_on_a_copy_at_another_path(tmp_path):
    folder = write_jsonl(tmp_path / "data")
    batches, checkpoint = run_with_checkpoint(folder)
    staged = tmp_path / "nvme" / "job" / "data"
    shutil.copytree(folder, staged, copy_function=shutil.copyfile)  # like cp -r: new times
    assert resumed(staged, checkpoint) == batches[TAKEN_AT:]


def test_a_parquet_checkpoint_resumes_on_a_recopy(tmp_path):
    folder = write_parquet(tmp_path / "data")
    batches, checkpoint = run_with_checkpoint(folder)
    recopy_in_place(folder)
    staged = tmp_path / "elsewhere"
    shutil.copytree(folder, staged, copy_function=shutil.copyfile)
    assert resumed(folder, checkpoint) == batches[TAKEN_AT:]
    assert resumed(staged, checkpoint) == batches[TAKEN_AT:]


def change_one_byte_keeping_mtime(path: Path) -> None:
    """A same-size rewrite in place whose modification time is put back (``cp -p`` onto it, ``os.utime``)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    at = data.index(b"row") + 1
    data[at] = ord("X")
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_one_changed_byte_with_the_time_put_back_is_refused_naming_the_shard(tmp_path):
    folder = write_jsonl(tmp_path / "data")
    _, checkpoint = run_with_checkpoint(folder)
    change_one_byte_keeping_mtime(folder / "shard-00001.jsonl")
    with pytest.raises(ValueError) as info:
        pipeline(folder).loader(checkpoint)
    message = str(info.value)
    assert "shard 'shard-00001.jsonl' content differs from the checkpoint's" in message
    size = (folder / "shard-00001.jsonl").stat().st_size
    assert f"size {size} → {size}" in message and "digest " in message
    assert "restore the original files or start a new run" in message
    assert "Rebuild the pipeline with the checkpoint's settings" not in message
    assert "shard-00000.jsonl" not in message and "shard-00002.jsonl" not in message


def test_a_touched_file_is_read_on_and_a_rewritten_one_refused_while_open(tmp_path):
    folder = write_jsonl(tmp_path / "data")
    ds = Dataset.from_path("web", folder)
    first = ds.read(0, [0, 1])
    touch_all(folder)
    assert ds.read(0, [0, 1]) == first  # same bytes: read on
    change_one_byte_keeping_mtime(folder / "shard-00000.jsonl")
    with pytest.raises(ShardChangedError, match=r"shard-00000\.jsonl changed .*content differs"):
        ds.read(0, [2])


def test_a_parquet_file_touched_while_open_is_read_on(tmp_path):
    folder = write_parquet(tmp_path / "data")
    ds = Dataset.from_path("web", folder)
    first = ds.read(1, [0, 8])
    touch_all(folder)
    assert ds.read(1, [0, 8]) == first


def test_changed_content_gets_a_new_fingerprint_and_a_copy_the_same(tmp_path):
    folder = write_jsonl(tmp_path / "data")
    before = Dataset.from_path("web", folder).fingerprint()
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, copy_function=shutil.copyfile)
    assert Dataset.from_path("web", copy).fingerprint() == before
    change_one_byte_keeping_mtime(folder / "shard-00002.jsonl")
    after = Dataset.from_path("web", folder).fingerprint()
    assert [a["identity"] == b["identity"] for a, b in zip(before["shards"], after["shards"])] == [True, True, False]


def counting_hash(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = _digest.hash_file

    def spy(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(_digest, "hash_file", spy)
    return seen


def test_a_file_is_digested_once_then_read_from_the_digest_cache(tmp_path, monkeypatch, cache_dir):
    folder = write_jsonl(tmp_path / "data")
    seen = counting_hash(monkeypatch)
    Dataset.from_path("web", folder)
    assert sorted(seen) == [f"shard-{s:05d}.jsonl" for s in range(SHARDS)]
    # Another process: no memory of this one, only the digest cache on disk.
    child = """
        import json, sys
        from zephon.io import Dataset
        from zephon.sources import digest as _digest
        def refuse(path):
            raise AssertionError(f"{path} was digested again")
        _digest.hash_file = refuse
        ds = Dataset.from_path("web", sys.argv[1])
        print(json.dumps(ds.read(2, [3])))
    """
    env = {**os.environ, "ZEPHON_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(child), str(folder)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])[0]["id"] == 203
    # A same-size rewrite whose time was put back changes the ctime: digested again.
    seen.clear()
    change_one_byte_keeping_mtime(folder / "shard-00001.jsonl")
    Dataset.from_path("web", folder)
    assert seen == ["shard-00001.jsonl"]


# -- the remote shard cache --------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    mem = fsspec.filesystem("memory")
    root = f"/bucket/{tmp_path.name}"
    for s in range(3):
        mem.pipe(f"{root}/part-{s}.jsonl", "".join(json.dumps({"text": f"r{s}-{i}"}) + "\n" for i in range(5)).encode())
    yield f"memory:/{root}"
    mem.rm(root, recursive=True)


def copies(folder: Path) -> dict[str, Path]:
    return {p.name.split("-", 1)[1]: p for p in folder.iterdir() if not p.name.startswith(".")}


def test_reusing_a_cached_copy_leaves_it_untouched_and_eviction_follows_use(store, tmp_path):
    folder = tmp_path / "shards"
    size = fsspec.filesystem("memory").info(store[len("memory:/") :] + "/part-0.jsonl")["size"]
    opts = {"cache": {"dir": str(folder), "max_bytes": 2 * size}}
    ds = Dataset.from_path("r", store, io_options=opts)
    ds.read(1, [0])
    ds.read(2, [0])
    kept = copies(folder)["part-2.jsonl"]
    before = kept.stat()
    for shard in (1, 2, 1):  # reuses, a file-time tick apart: part-2 is now the least recently used
        time.sleep(0.01)
        ds.read(shard, [1])
    after = kept.stat()
    assert (after.st_mtime_ns, after.st_ctime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ctime_ns, before.st_ino)
    ds.read(0, [0])  # fetched again, evicting the least recently used copy
    assert sorted(copies(folder)) == ["part-0.jsonl", "part-1.jsonl"]


def test_a_store_without_checksums_identifies_objects_by_content(store, tmp_path):
    opts = {"cache": {"dir": str(tmp_path / "shards")}}
    ds = Dataset.from_path("r", store, io_options=opts)
    identity = ds.fingerprint()["shards"][0]["identity"]
    assert identity.startswith("sha256=") and "mtime" not in identity
    time.sleep(0.01)
    path = store[len("memory:/") :] + "/part-0.jsonl"
    mem = fsspec.filesystem("memory")
    mem.pipe(path, mem.cat_file(path))  # written again: a new time, the same bytes
    assert Dataset.from_path("r", store, io_options=opts).fingerprint() == ds.fingerprint()
