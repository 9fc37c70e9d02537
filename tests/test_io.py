"""Tests of zephon.io: JSONL and in-memory datasets, line indexes, the cache, errors, pickling."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import multiprocessing
import os
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon.io import Dataset, InMemoryShard, as_dataset
from zephon.sources import jsonl as _jsonl

from _shared import shared_path
from _util import compress


#: Each test reads and writes its own cache folder.
pytestmark = pytest.mark.usefixtures("cache_dir")


def rows_of(n: int, start: int = 0) -> list[dict]:
    return [
        {"id": i, "text": f"row {i} " + "x" * (i % 7), "tags": [i, i % 3], "ok": i % 2 == 0}
        for i in range(start, start + n)
    ]


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def reference(data: bytes) -> list:
    """What a plain json.loads reader makes of a JSONL file (blank lines skipped)."""
    return [json.loads(line) for line in data.decode().split("\n") if line.strip(" \t\r")]




def index_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "index").glob("*.idx"))


# -- reading --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_counts_and_random_access_match_reference(tmp_path, suffix):
    shards = {"b": rows_of(40), "a": rows_of(25, start=100), "c": rows_of(1, start=500)}
    for stem, rows in shards.items():
        (tmp_path / f"{stem}{suffix}").write_bytes(compress(jsonl(rows), suffix))
    ds = Dataset.from_path("web", tmp_path)
    assert ds.shard_ids == (f"a{suffix}", f"b{suffix}", f"c{suffix}")  # sorted, not creation order
    assert ds.shard_sizes == (25, 40, 1)
    assert ds.num_rows == 66 and ds.num_shards == 3 and ds.format == "jsonl"
    want = [shards["a"], shards["b"], shards["c"]]
    for shard, rows in enumerate(want):
        assert ds.read(shard, range(len(rows))) == rows
    picks = [7, 3, 3, 24, 0, 7, 12]  # unsorted and repeated
    assert ds.read(0, picks) == [want[0][i] for i in picks]
    assert ds.read(1, np.array([39, 38, 0, 1, 2, 2], dtype=np.uint32)) == [want[1][i] for i in [39, 38, 0, 1, 2, 2]]
    assert ds.read(2, []) == []


def test_repeated_rows_are_distinct_objects(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(rows_of(3)))
    out = Dataset.from_path("web", tmp_path).read(0, [1, 1, 2])
    assert out[0] == out[1] and out[0] is not out[1]


def test_multi_frame_compressed_files(tmp_path):
    import zstandard
    rows = rows_of(10)
    first, second = jsonl(rows[:4]), jsonl(rows[4:])
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(first) + gzip.compress(second))
    compressor = zstandard.ZstdCompressor()
    (tmp_path / "b.jsonl.zst").write_bytes(compressor.compress(first) + compressor.compress(second))
    ds = Dataset.from_path("web", tmp_path)
    assert ds.shard_sizes == (10, 10)
    assert ds.read(0, range(10)) == rows and ds.read(1, range(10)) == rows


def test_blank_lines_are_skipped_and_last_line_needs_no_newline(tmp_path):
    rows = rows_of(4)
    lines = [json.dumps(r) for r in rows]
    text = "\n\n" + lines[0] + "\n   \n\t\r\n" + lines[1] + "\r\n" + lines[2] + "\n\n\n" + lines[3]  # no final newline
    (tmp_path / "a.jsonl").write_text(text)
    ds = Dataset.from_path("web", tmp_path / "a.jsonl")
    assert ds.shard_sizes == (4,)
    assert ds.read(0, [3, 2, 1, 0]) == rows[::-1]
    assert ds.read(0, range(4)) == rows


def test_byte_order_mark_and_empty_files(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl(rows_of(2)))
    (tmp_path / "b.jsonl").write_bytes(b"")
    (tmp_path / "c.jsonl").write_bytes(b"\n  \n")
    ds = Dataset.from_path("web", tmp_path)
    assert ds.shard_sizes == (2, 0, 0)
    assert ds.read(0, [1, 0]) == rows_of(2)[::-1]
    assert ds.read(1, []) == []


def test_single_file_and_list_of_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "z.jsonl").write_bytes(jsonl(rows_of(2)))
    (tmp_path / "sub" / "a.jsonl").write_bytes(jsonl(rows_of(3)))
    single = Dataset.from_path("web", str(tmp_path / "z.jsonl"))
    assert single.shard_ids == ("z.jsonl",)
    listed = Dataset.from_path("web", [tmp_path / "z.jsonl", tmp_path / "sub" / "a.jsonl"])
    assert listed.shard_ids == ("sub/a.jsonl", "z.jsonl")  # sorted relative paths, whatever the list order
    assert listed.shard_sizes == (3, 2)
    with pytest.raises(ValueError, match="more than once"):
        Dataset.from_path("web", [tmp_path / "z.jsonl", tmp_path / "z.jsonl"])


def test_folder_discovery_is_flat_unless_recursive(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.jsonl").write_bytes(jsonl(rows_of(1)))
    (tmp_path / "b" / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(rows_of(2))))
    (tmp_path / ".hidden" / "d.jsonl").write_bytes(jsonl(rows_of(3)))
    (tmp_path / ".e.jsonl").write_bytes(jsonl(rows_of(4)))
    (tmp_path / "README.md").write_text("not data")
    assert Dataset.from_path("web", tmp_path).shard_ids == ("a.jsonl",)
    deep = Dataset.from_path("web", tmp_path, recursive=True)
    assert deep.shard_ids == ("a.jsonl", "b/c.jsonl.gz")
    assert deep.read(1, [1]) == [rows_of(2)[1]]


def test_fmt_forces_jsonl(tmp_path):
    (tmp_path / "data.txt").write_bytes(jsonl(rows_of(3)))
    (tmp_path / "more.json.gz").write_bytes(gzip.compress(jsonl(rows_of(2))))
    with pytest.raises(ValueError, match=r"cannot tell the format.*fmt='jsonl'"):
        Dataset.from_path("web", tmp_path / "data.txt")
    assert Dataset.from_path("web", tmp_path / "data.txt", fmt="jsonl").shard_sizes == (3,)
    assert Dataset.from_path("web", tmp_path, fmt="jsonl").shard_ids == ("data.txt", "more.json.gz")
    with pytest.raises(ValueError, match=r"unknown fmt 'csv'.*'jsonl', 'parquet'"):
        Dataset.from_path("web", tmp_path, fmt="csv")


# -- the index cache -------------------------------------------------------------------------------------


def test_index_is_cached_and_reused(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(5)))
    first = Dataset.from_path("web", path)
    (idx,) = index_files(cache_dir)
    stamp = idx.stat().st_mtime_ns

    def no_scan(buf):
        raise AssertionError("the line index was rebuilt")

    monkeypatch.setattr(_jsonl, "build_line_index", no_scan)
    second = Dataset.from_path("web", path)
    assert second.shard_sizes == (5,)
    assert second.read(0, [4, 0]) == [rows_of(5)[4], rows_of(5)[0]]  # a fresh shard loads the cached offsets
    assert index_files(cache_dir) == [idx] and idx.stat().st_mtime_ns == stamp
    assert first.fingerprint() == second.fingerprint()


def test_index_is_rebuilt_when_the_file_changes(tmp_path, cache_dir):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(5)))
    assert Dataset.from_path("web", path).num_rows == 5
    (idx,) = index_files(cache_dir)
    before = idx.read_bytes()
    with open(path, "ab") as f:
        f.write(jsonl(rows_of(1, start=5)))
    ds = Dataset.from_path("web", path)
    assert ds.num_rows == 6
    assert ds.read(0, [5]) == rows_of(1, start=5)
    assert index_files(cache_dir) == [idx] and idx.read_bytes() != before


def test_decompressed_copy_is_cached(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(rows_of(4))))
    Dataset.from_path("web", path)
    (copy,) = (cache_dir / "decompressed").glob("*.jsonl")
    assert copy.read_bytes() == jsonl(rows_of(4))

    def no_decompress(*args):
        raise AssertionError("decompressed again")

    monkeypatch.setattr(_jsonl, "_chunks", no_decompress)
    again = pickle.loads(pickle.dumps(Dataset.from_path("web", path)))
    assert again.read(0, [3, 1]) == [rows_of(4)[3], rows_of(4)[1]]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_unwritable_cache_falls_back_to_memory(tmp_path, suffix):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    (tmp_path / f"a{suffix}").write_bytes(compress(jsonl(rows_of(6)), suffix))
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        ds = Dataset.from_path("web", tmp_path / f"a{suffix}", cache_dir=blocker / "cache")
    assert ds.shard_sizes == (6,)
    assert ds.read(0, [5, 0, 5]) == [rows_of(6)[i] for i in [5, 0, 5]]
    fresh = pickle.loads(pickle.dumps(ds))  # a new process rebuilds in memory too
    assert fresh.read(0, range(6)) == rows_of(6)


def test_unreadable_cache_entries_are_rebuilt(tmp_path, cache_dir):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(3)))
    Dataset.from_path("web", path)
    (idx,) = index_files(cache_dir)
    idx.write_bytes(b"garbage")
    assert Dataset.from_path("web", path).read(0, [2]) == [rows_of(3)[2]]


def test_open_shards_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(_jsonl, "MAX_OPEN_SHARDS", 2)
    for i in range(5):
        (tmp_path / f"{i}.jsonl").write_bytes(jsonl(rows_of(3, start=10 * i)))
    ds = Dataset.from_path("web", tmp_path)
    for _ in range(2):
        for shard in range(5):
            assert ds.read(shard, [2, 0]) == [rows_of(3, start=10 * shard)[i] for i in [2, 0]]
    assert len(_jsonl._MAPS) <= 2  # shards mapped in this process


# -- errors -----------------------------------------------------------------------------------------------


def test_bad_json_names_dataset_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 0}\n\n{"id": 1}\n{"id": 2, oops}\n{"id": 3}\n')
    ds = Dataset.from_path("web", path)
    assert ds.read(0, [0, 1, 3]) == [{"id": 0}, {"id": 1}, {"id": 3}]
    with pytest.raises(ValueError) as info:
        ds.read(0, [3, 2, 0])
    message = str(info.value)
    assert "'web'" in message and str(path) in message and "line 4" in message
    assert '{"id": 2, oops}' in message and "not valid JSON" in message


def test_two_objects_on_one_line_are_an_error(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 0}\n{"id": 1} {"id": 2}\n{"id": 3}\n')
    ds = Dataset.from_path("web", path)
    with pytest.raises(ValueError, match="line 2"):
        ds.read(0, [0, 1, 2])


@pytest.mark.parametrize(
    ("value", "kind"), [("[1, 2]", "array"), ('"text"', "string"), ("3", "number"), ("null", "null")]
)
def test_non_object_lines_are_an_error(tmp_path, value, kind):
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(f'{{"id": 0}}\n{value}\n'.encode()))
    ds = Dataset.from_path("web", path)
    with pytest.raises(ValueError, match=rf"a\.jsonl\.gz, line 2 .*JSON {kind}, not an object"):
        ds.read(0, [1])


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        Dataset.from_path("web", tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="gone.jsonl"):
        Dataset.from_path("web", [tmp_path / "gone.jsonl"])
    with pytest.raises(ValueError, match=r"no supported files .*found: nothing.*\.jsonl\.zst"):
        Dataset.from_path("web", tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "deeper").mkdir()
    with pytest.raises(ValueError, match=r"found: notes\.txt, deeper/.*recursive=True"):
        Dataset.from_path("web", tmp_path)
    with pytest.raises(ValueError, match="empty"):
        Dataset.from_path("web", [])


def test_changed_file_is_detected_on_read(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(3)))
    ds = pickle.loads(pickle.dumps(Dataset.from_path("web", path)))  # nothing open yet
    with open(path, "ab") as f:
        f.write(jsonl(rows_of(1)))
    with pytest.raises(ValueError, match="changed after the dataset was opened"):
        ds.read(0, [0])
    path.unlink()
    with pytest.raises(FileNotFoundError, match="no longer exists"):
        ds.read(0, [0])


def test_corrupt_compressed_file(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl(rows_of(50)))[:40])
    with pytest.raises(ValueError, match=r"could not decompress .*a\.jsonl\.gz"):
        Dataset.from_path("web", tmp_path)


def test_missing_zstandard_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pip install zstandard.*zephon-lanes\[zstd\]"):
        Dataset.from_path("web", tmp_path)


def test_bad_indices(tmp_path):
    ds = Dataset.from_rows("toy", rows_of(3))
    with pytest.raises(IndexError, match="has 3 rows"):
        ds.read(0, [0, 3])
    with pytest.raises(IndexError, match="row -1"):
        ds.read(0, [-1])
    with pytest.raises(IndexError, match="1 shards"):
        ds.read(1, [0])
    with pytest.raises(TypeError, match="integers"):
        ds.read(0, [0.5])
    with pytest.raises(TypeError, match="integer index"):
        ds.read("0", [0])


# -- in-memory datasets -----------------------------------------------------------------------------------


def test_from_dict_with_dict_rows_keeps_insertion_order():
    ds = Dataset.from_dict("mem", {"z": InMemoryShard(rows_of(2)), "a": InMemoryShard(rows_of(3, start=5))})
    assert ds.shard_ids == ("z", "a") and ds.shard_sizes == (2, 3) and ds.format == "inmem"
    assert ds.read(1, [2, 0, 2]) == [rows_of(3, start=5)[i] for i in [2, 0, 2]]


def test_from_dict_with_int_shard_ids_as_in_zephon_0_2():
    ds = Dataset.from_dict("mem", {0: InMemoryShard(rows_of(2)), 1: InMemoryShard(rows_of(3, start=5))})
    assert ds.shard_ids == (0, 1) and all(type(i) is int for i in ds.shard_ids)
    assert ds.shard_sizes == (2, 3) and ds.read(1, [0]) == [rows_of(3, start=5)[0]]
    # Insertion order decides shard order, not the id's value; numpy integers become ints.
    flipped = Dataset.from_dict("mem", {np.int64(7): rows_of(1), 2: rows_of(1, start=1)})
    assert flipped.shard_ids == (7, 2) and type(flipped.shard_ids[0]) is int
    # Ids stay ints in the fingerprint (JSON-stable), so {0: rows} and {"0": rows} are different data.
    fp = ds.fingerprint()
    assert [s["id"] for s in fp["shards"]] == [0, 1] and json.loads(json.dumps(fp)) == fp
    as_str = Dataset.from_dict("mem", {"0": InMemoryShard(rows_of(2)), "1": InMemoryShard(rows_of(3, start=5))})
    assert as_str.shard_ids == ("0", "1") and as_str.fingerprint() != fp
    assert Dataset.from_rows("mem", rows_of(2), shard_id=0).shard_ids == (0,)
    # Pickles, and reports an int id in range errors.
    assert pickle.loads(pickle.dumps(ds)).shard_ids == (0, 1)
    with pytest.raises(IndexError, match=r"shard 1 \(1\) has 3 rows"):
        ds.read(1, [3])


@pytest.mark.parametrize(
    "shards, message",
    [
        ({0: [{"a": 1}], "1": [{"a": 2}]}, "mix strings and integers"),
        ({"a": [{"a": 1}], 1: [{"a": 2}]}, "mix strings and integers"),
        ({True: [{"a": 1}]}, r"True \(bool\) is neither a string nor an integer"),
        ({1.0: [{"a": 1}]}, r"1\.0 \(float\) is neither"),
        ({(0, 1): [{"a": 1}]}, r"\(0, 1\) \(tuple\) is neither"),
    ],
)
def test_from_dict_rejects_mixed_and_invalid_shard_ids(shards, message):
    with pytest.raises(TypeError, match=message):
        Dataset.from_dict("mem", shards)


def test_int_shard_ids_through_a_source():
    from zephon.work import StaticMixtureWorkSource

    ds = Dataset.from_dict("mem", {0: rows_of(3), 1: rows_of(2, start=3)})
    src = StaticMixtureWorkSource([ds], {"mem": 1}, shuffle_shards=False)
    assert src.pointers(0, 5) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1)]
    assert [s["id"] for s in src.fingerprint()["datasets"][0]["shards"]] == [0, 1]


def test_from_dict_with_array_rows():
    ragged = [np.arange(n, dtype=np.int32) for n in (3, 1, 4)]
    block = np.arange(12, dtype=np.int64).reshape(4, 3)
    ds = Dataset.from_dict("tok", {"ragged": InMemoryShard(ragged), "block": InMemoryShard(block)})
    assert ds.shard_sizes == (3, 4)
    got = ds.read(0, [2, 0])
    assert [g.tolist() for g in got] == [ragged[2].tolist(), ragged[0].tolist()]
    rows = ds.read(1, np.array([3, 1]))
    assert [r.tolist() for r in rows] == [[9, 10, 11], [3, 4, 5]]
    assert not rows[0].flags.writeable and not got[0].flags.writeable


def test_in_memory_rows_are_validated():
    with pytest.raises(TypeError, match="row 1 is a int"):
        InMemoryShard([{"a": 1}, 2])
    with pytest.raises(TypeError, match="1-d numpy array"):
        InMemoryShard(np.arange(3))
    with pytest.raises(TypeError, match="list of dicts"):
        InMemoryShard("text")
    with pytest.raises(ValueError, match="at least one shard"):
        Dataset.from_dict("mem", {})
    with pytest.raises(TypeError, match="neither a string nor an integer"):
        Dataset.from_dict("mem", {1.5: InMemoryShard([])})
    with pytest.raises(ValueError, match="non-empty string name"):
        Dataset.from_rows("", [{"a": 1}])


def test_as_dataset():
    ds = Dataset.from_rows("toy", rows_of(2))
    assert as_dataset(ds) is ds
    made = as_dataset(rows_of(3), name="mine")
    assert made.name == "mine" and made.num_rows == 3 and made.read(0, [1]) == [rows_of(3)[1]]
    with pytest.raises(TypeError, match=r"Dataset\.from_path\('data', 'some/folder'\)"):
        as_dataset("some/folder")
    with pytest.raises(TypeError, match="item 1 is a int"):
        as_dataset([{"a": 1}, 2])
    with pytest.raises(TypeError, match="InMemoryShard"):
        as_dataset(42)


# -- identity and pickling ----------------------------------------------------------------------------------


def test_fingerprint_changes_when_a_file_changes(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(3)))
    before = Dataset.from_path("web", tmp_path).fingerprint()
    assert json.loads(json.dumps(before)) == before
    assert before["name"] == "web" and before["format"] == "jsonl"
    (shard,) = before["shards"]
    assert shard["path"] == "a.jsonl" and shard["rows"] == 3 and shard["bytes"] == path.stat().st_size
    assert Dataset.from_path("web", tmp_path).fingerprint() == before
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))  # same bytes, new mtime
    assert Dataset.from_path("web", tmp_path).fingerprint() == before  # identified by content, not time
    path.write_bytes(jsonl(rows_of(3, start=1))[: path.stat().st_size].ljust(path.stat().st_size, b" "))
    assert Dataset.from_path("web", tmp_path).fingerprint() != before


def test_in_memory_fingerprint_follows_content():
    def fp(rows):
        return Dataset.from_rows("mem", rows).fingerprint()

    assert fp(rows_of(3)) == fp(rows_of(3))
    assert fp(rows_of(3)) != fp(rows_of(3, start=1))
    arrays = [np.arange(4), np.arange(2)]
    assert fp(arrays) == fp([a.copy() for a in arrays])
    assert fp(arrays) != fp([np.arange(4), np.arange(1, 3)])
    assert fp(np.zeros((2, 3))) != fp(np.zeros((3, 2)))
    assert fp([{"x": np.float32(1.5), "ids": np.arange(3)}])["shards"][0]["identity"].startswith("blake2b:")
    with pytest.raises(TypeError, match="cannot fingerprint"):
        fp([{"x": object()}])


def test_pickle_round_trip_reads(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(rows_of(4)))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(rows_of(3))))
    ds = Dataset.from_path("web", tmp_path)
    ds.read(0, [1])  # maps the file
    data = pickle.dumps(ds)
    assert b"mmap" not in data
    copy = pickle.loads(data)
    assert copy.shard_ids == ds.shard_ids and copy.fingerprint() == ds.fingerprint()
    assert copy.read(0, [3, 1]) == ds.read(0, [3, 1])
    assert copy.read(1, [2]) == [rows_of(3)[2]]
    mem = pickle.loads(pickle.dumps(Dataset.from_rows("mem", rows_of(2))))
    assert mem.read(0, [1]) == [rows_of(2)[1]]


def test_reads_in_a_spawned_process(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(rows_of(5)))
    ds = Dataset.from_path("web", tmp_path)
    ds.read(0, [0])
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(ds.read, 0, [4, 2]).result(timeout=120) == [rows_of(5)[4], rows_of(5)[2]]


# -- properties and real data -------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
json_keys = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
json_objects = st.dictionaries(json_keys, json_values, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(json_objects, min_size=1, max_size=30),
    blanks=st.lists(st.sampled_from(["", "  ", "\t", "\r"]), max_size=30),
    newline=st.sampled_from(["\n", "\r\n"]),
    final_newline=st.booleans(),
    suffix=st.sampled_from([".jsonl", ".jsonl.gz"]),
    data=st.data(),
)
def test_read_returns_the_written_objects(rows, blanks, newline, final_newline, suffix, data):
    lines = [json.dumps(r, ensure_ascii=bool(len(rows) % 2)) for r in rows]
    for i, blank in enumerate(blanks):
        lines.insert(data.draw(st.integers(0, len(lines)), label=f"blank {i}"), blank)
    text = newline.join(lines) + (newline if final_newline else "")
    picks = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=40), label="rows")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"data{suffix}"
        path.write_bytes(compress(text.encode(), suffix))
        ds = Dataset.from_path("prop", path, cache_dir=Path(folder) / "cache")
        assert ds.shard_sizes == (len(rows),)
        assert ds.read(0, picks) == [rows[i] for i in picks]
        assert ds.read(0, np.arange(len(rows))) == rows


def test_shared_corpus():
    corpus = shared_path("data", "corpus")
    files = sorted(corpus.glob("*.jsonl"))
    ds = Dataset.from_path("corpus", corpus)
    assert ds.num_shards == 8 and ds.num_rows == 1975
    assert ds.shard_ids == tuple(f.name for f in files)
    rng = np.random.default_rng(0)
    for shard, path in enumerate(files):
        want = reference(path.read_bytes())
        assert ds.shard_sizes[shard] == len(want)
        picks = rng.integers(0, len(want), size=50)
        assert ds.read(shard, picks) == [want[i] for i in picks]
        assert ds.read(shard, range(len(want))) == want
