"""The shard cache on one machine: one download of a copy at a time, and room checked before it."""

from __future__ import annotations

import collections
import hashlib
import shutil
import threading
import time

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from zephon.io import CacheOptions, StorageError
from zephon.sources import storage


class SlowStore(MemoryFileSystem):
    """An object store in memory with ETags, whose reads take ``latency_s`` and are counted per path."""

    protocol = "slowstore"
    store: dict = {}
    pseudo_dirs = [""]
    latency_s = 0.2
    opens: collections.Counter = collections.Counter()

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(path[len("slowstore://"):] if path.startswith("slowstore://") else path)

    def info(self, path, **kwargs):
        out = dict(super().info(path, **kwargs))
        out["ETag"] = hashlib.md5(self.cat_file(path)).hexdigest()
        return out

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            type(self).opens[path] += 1
            time.sleep(self.latency_s)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("slowstore", SlowStore, clobber=True)


@pytest.fixture
def obj(tmp_path):
    fs = fsspec.filesystem("slowstore")
    path = f"/b/{tmp_path.name}/shard.jsonl"
    fs.pipe(path, b'{"text": "a"}\n' * 1000)
    url = "slowstore://" + path
    info = fs.info(path)
    return fs, url, int(info["size"]), storage.identity_of(info), path


def test_concurrent_readers_of_one_copy_download_it_once(tmp_path, obj):
    fs, url, size, identity, path = obj
    options = CacheOptions(dir=str(tmp_path / "cache"))
    got, errors = [], []

    def read():
        try:
            got.append(storage.fetch(url, fs, size, identity, options, "d"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 4 and len(set(got)) == 1
    assert SlowStore.opens[path] == 1  # the others waited for the lock and found the copy
    with open(got[0], "rb") as f:
        assert f.read() == fs.cat_file(path)
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".pending")]


def test_a_download_without_room_names_the_folder_and_the_bytes(tmp_path, obj, monkeypatch):
    fs, url, size, identity, path = obj
    folder = tmp_path / "cache"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage._replace(free=size - 100))
    with pytest.raises(StorageError, match=rf"no room in the shard cache {folder} .* needs {size} bytes .* {size - 100} free"):
        storage.fetch(url, fs, size, identity, CacheOptions(dir=str(folder)), "d")
    assert SlowStore.opens[path] == 0 and not [p for p in folder.iterdir() if not p.name.startswith(".lock")]
