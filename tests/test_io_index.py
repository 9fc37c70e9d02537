"""The dataset index: ``zephon index PATH`` writes it, discovery reuses it, stale entries are never trusted."""

from __future__ import annotations

import json
import pickle
import os
import warnings

import fsspec
import pyarrow as pa
import pyarrow.parquet
import pytest

from zephon.cli.main import main
from zephon.io import Dataset, ShardChangedError, build_index
from zephon.sources import columnar as _columnar
from zephon.sources import jsonl as _jsonl


@pytest.fixture
def folder(tmp_path):
    for s in range(4):
        (tmp_path / f"part-{s}.jsonl").write_text("".join(json.dumps({"text": f"{s}-{i}"}) + "\n" for i in range(s + 3)))
    return tmp_path


def no_counting(monkeypatch):
    """Make any attempt to count a shard fail: proves rows come from the index."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self.path} was counted")

    monkeypatch.setattr(_jsonl.JsonlShard, "count_rows", refuse)
    monkeypatch.setattr(_columnar.ColumnarShard, "count_rows", refuse)


def test_the_cli_writes_an_index_that_discovery_uses_without_opening_shards(folder, monkeypatch, capsys, tmp_path):
    assert main(["index", str(folder), "--quiet", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "indexed 4 jsonl shards, 18 rows" in capsys.readouterr().out
    doc = json.loads((folder / ".zephon-index.json").read_text())
    assert sorted(doc["shards"]) == [f"part-{s}.jsonl" for s in range(4)]
    cold = Dataset.from_path("d", folder, index="off", cache_dir=tmp_path / "c")
    no_counting(monkeypatch)
    warm = Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "c")
    assert warm.fingerprint() == cold.fingerprint() and warm.shard_sizes == (3, 4, 5, 6)
    assert warm.read(3, [5, 0]) == [{"text": "3-5"}, {"text": "3-0"}]


@pytest.mark.parametrize(
    "setting, named",
    [({"fmt": "jsnl"}, "unknown fmt 'jsnl'"), ({"verify": "sometimes"}, "unknown verify 'sometimes'"),
     ({"token_dtype": "int7"}, "token_dtype must be 'uint16'")],
)
def test_an_unknown_setting_is_refused_before_any_index_is_written(folder, tmp_path, setting, named):
    with pytest.raises(ValueError, match=named):
        build_index(folder, cache_dir=tmp_path / "c", **setting)
    assert not (folder / ".zephon-index.json").exists()


def test_a_stale_entry_is_counted_again_with_a_warning_or_refused(folder, tmp_path):
    build_index(folder, cache_dir=tmp_path / "c")
    (folder / "part-2.jsonl").write_text('{"text": "new"}\n')
    os.utime(folder / "part-2.jsonl", ns=(1, 1))
    (folder / "part-9.jsonl").write_text('{"text": "extra"}\n')
    with pytest.warns(RuntimeWarning, match=r"stale for 1 changed and 1 new shard\(s\) \(part-2.jsonl, part-9.jsonl\).*zephon index"):
        ds = Dataset.from_path("d", folder, cache_dir=tmp_path / "c")
    assert ds.shard_sizes == (3, 4, 1, 6, 1)  # the truth, not the index's 5 rows for part-2
    with pytest.raises(ValueError, match="index .* is stale: shard part-9.jsonl is not in it"):
        Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "c")
    (folder / "part-9.jsonl").unlink()
    # index="require" takes each listed file as the index recorded it, without a stat, and checks
    # the file when it is first read: a changed file is refused there, naming it and the fix.
    os.utime(folder / "part-0.jsonl", ns=(5, 5))  # the same bytes: read on
    trusting = Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "c")
    assert trusting.shard_sizes == (3, 4, 5, 6) and trusting.read(0, [0]) == [{"text": "0-0"}]
    with pytest.raises(ShardChangedError, match="part-2.jsonl changed since the dataset index recorded it.*zephon index"):
        trusting.read(2, [0])
    (folder / "part-9.jsonl").write_text('{"text": "extra"}\n')
    build_index(folder, cache_dir=tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "c").shard_sizes == (3, 4, 1, 6, 1)


def test_an_index_built_with_other_settings_or_missing_is_not_used(folder, tmp_path):
    with pytest.raises(ValueError, match="has no dataset index; build it with `zephon index"):
        Dataset.from_path("d", folder, index="require")
    build_index(folder, verify="full", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="was built with .*'verify': 'full'"):
        Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "c")
    (folder / ".zephon-index.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert Dataset.from_path("d", folder, cache_dir=tmp_path / "c").num_rows == 18


def test_parquet_and_remote_indexes_carry_row_groups_and_identities(tmp_path, monkeypatch):
    (tmp_path / "p").mkdir()
    mem = fsspec.filesystem("memory")
    for s in range(3):
        table = pa.Table.from_pylist([{"text": f"{s}-{i}"} for i in range(10)])
        pa.parquet.write_table(table, tmp_path / "p" / f"{s}.parquet", row_group_size=4)
        mem.pipe(f"/idx/{tmp_path.name}/{s}.parquet", (tmp_path / "p" / f"{s}.parquet").read_bytes())
    build_index(tmp_path / "p")
    url = f"memory://idx/{tmp_path.name}"
    opts = {"cache": {"dir": str(tmp_path / "shards")}}
    assert main(["index", url, "--quiet"]) == 0
    assert mem.exists(f"/idx/{tmp_path.name}/.zephon-index.json")
    no_counting(monkeypatch)
    local = Dataset.from_path("p", tmp_path / "p", index="require")
    assert local._shards[0].group_rows == (4, 4, 2)
    remote = Dataset.from_path("p", url, index="require", io_options=opts)
    # memory:// gives no ETag or checksum, so each object is downloaded once to digest its content
    # (the copy reading uses); stores with checksums download nothing to discover.
    assert len([n for n in os.listdir(tmp_path / "shards") if not n.startswith(".")]) == 3
    assert remote.shard_sizes == (10, 10, 10)
    monkeypatch.undo()
    assert remote.read(1, [9]) == local.read(1, [9]) == [{"text": "1-9"}]


def test_unchanged_files_take_their_identity_from_the_index_and_changed_ones_are_digested(folder, tmp_path, monkeypatch):
    from zephon.sources import digest as _digest

    build_index(folder, cache_dir=tmp_path / "c")
    reference = Dataset.from_path("d", folder, cache_dir=tmp_path / "c").fingerprint()
    hashed = []
    real = _digest.hash_file
    monkeypatch.setattr(_digest, "hash_file", lambda path: hashed.append(os.path.basename(path)) or real(path))
    # A fresh digest cache: only the index can give the identities without reading the files.
    assert Dataset.from_path("d", folder, index="require", cache_dir=tmp_path / "fresh").fingerprint() == reference
    assert hashed == []
    os.utime(folder / "part-2.jsonl")  # same bytes, another stat: no longer vouched for by the index
    again = Dataset.from_path("d", folder, index="auto", cache_dir=tmp_path / "fresh2")
    assert hashed == ["part-2.jsonl"] and again.fingerprint() == reference
    (folder / "part-1.jsonl").write_text('{"text": "changed"}\n' * 4)  # other bytes, the same row count: stale
    with pytest.warns(RuntimeWarning, match="stale for 1 changed"):
        changed = Dataset.from_path("d", folder, index="auto", cache_dir=tmp_path / "fresh3")
    assert changed.read(1, [0]) == [{"text": "changed"}] and changed.fingerprint() != reference


def test_an_indexed_dataset_makes_a_shard_object_only_for_the_files_read(tmp_path, monkeypatch):
    data = tmp_path / "many"
    data.mkdir()
    for s in range(120):
        (data / f"part-{s:03d}.jsonl").write_text(json.dumps({"text": f"{s}-0"}) + "\n" + json.dumps({"text": f"{s}-1"}) + "\n")
    build_index(data, cache_dir=tmp_path / "c")
    counted = Dataset.from_path("d", data, index="off", cache_dir=tmp_path / "c")
    made: list[str] = []
    init = _jsonl.JsonlShard.__init__

    def counting(self, path, *args, **kwargs):
        made.append(os.path.basename(path))
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(_jsonl.JsonlShard, "__init__", counting)
    for index in ("require", "auto"):
        ds = Dataset.from_path("d", data, index=index, cache_dir=tmp_path / "c")
        assert ds.num_rows == 240 and ds.shard_sizes == (2,) * 120 and ds.fingerprint() == counted.fingerprint()
        assert ds.shard_path(7) == str(data / "part-007.jsonl") and made == []
        assert ds.read(7, [1, 0]) == [{"text": "7-1"}, {"text": "7-0"}] and ds.read(7, [0]) == [{"text": "7-0"}]
        assert made == ["part-007.jsonl"]  # once, on the first read
        made.clear()
    again = pickle.loads(pickle.dumps(ds))  # a worker process makes its own shard objects
    assert again.read(99, [0]) == [{"text": "99-0"}] and made == ["part-099.jsonl"]


def test_a_local_index_copied_with_the_data_to_a_store_is_used_there(tmp_path, monkeypatch):
    # `aws s3 sync data/ s3://...` copies .zephon-index.json too; on a store without checksums the
    # objects' content digests equal the local files' identities, so its entries apply there.
    (tmp_path / "p").mkdir()
    for s in range(3):
        table = pa.Table.from_pylist([{"text": f"{s}-{i}"} for i in range(10)])
        pa.parquet.write_table(table, tmp_path / "p" / f"{s}.parquet", row_group_size=4)
    build_index(tmp_path / "p", cache_dir=tmp_path / "c")
    mem = fsspec.filesystem("memory")
    for path in (tmp_path / "p").iterdir():
        mem.pipe(f"/copied/{tmp_path.name}/{path.name}", path.read_bytes())
    url = f"memory://copied/{tmp_path.name}"
    remote = Dataset.from_path("p", url, index="require", cache_dir=tmp_path / "c", io_options={"cache": {"dir": str(tmp_path / "shards")}})
    local = Dataset.from_path("p", tmp_path / "p", index="require", cache_dir=tmp_path / "c")
    assert remote.shard_sizes == local.shard_sizes == (10, 10, 10)
    assert remote.read(2, [9, 0]) == local.read(2, [9, 0]) == [{"text": "2-9"}, {"text": "2-0"}]
