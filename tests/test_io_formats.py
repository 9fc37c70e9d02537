"""File formats and discovery: Parquet, Arrow IPC, token files, Hugging Face datasets, globs."""

from __future__ import annotations

import json
import os
import pickle
import struct

import numpy as np
import pyarrow as pa
import pyarrow.feather
import pyarrow.ipc
import pyarrow.parquet
import pytest

from zephon import Pipeline
from zephon.io import Dataset, ShardChangedError
from zephon.sources import columnar as _columnar


def rows_of(shard: int, n: int) -> list[dict]:
    return [{"id": shard * 100 + i, "text": f"doc {shard}-{i}", "toks": list(range(i % 5))} for i in range(n)]


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """Three shards of 25 rows as JSONL, Parquet (row groups of 7) and Arrow (batches of 6)."""
    for fmt in ("jsonl", "parquet", "arrow"):
        (tmp_path / fmt).mkdir()
    for s in range(3):
        rows = rows_of(s, 25)
        (tmp_path / "jsonl" / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        table = pa.Table.from_pylist(rows)
        pa.parquet.write_table(table, tmp_path / "parquet" / f"part-{s}.parquet", row_group_size=7)
        pa.feather.write_feather(table, tmp_path / "arrow" / f"part-{s}.arrow", chunksize=6)
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


# -- detection, globs, lists ----------------------------------------------------------------------------


def test_formats_are_detected_from_endings_and_read_the_same_rows(copies):
    sets = {fmt: Dataset.from_path(fmt, copies / fmt) for fmt in ("jsonl", "parquet", "arrow")}
    assert {fmt: d.format for fmt, d in sets.items()} == {"jsonl": "jsonl", "parquet": "parquet", "arrow": "arrow"}
    rows = [24, 0, 7, 6, 13, 7]
    for shard in range(3):
        expected = [rows_of(shard, 25)[r] for r in rows]
        for d in sets.values():
            assert d.read(shard, rows) == expected


def test_globs_lists_and_folders_give_sorted_recorded_shard_order(copies):
    names = ["part-2.parquet", "part-0.parquet", "part-1.parquet"]
    listed = Dataset.from_path("x", [copies / "parquet" / n for n in names])
    globbed = Dataset.from_path("x", str(copies / "parquet" / "part-*.parquet"))
    folder = Dataset.from_path("x", copies / "parquet")
    assert listed.shard_ids == globbed.shard_ids == folder.shard_ids == ("part-0.parquet", "part-1.parquet", "part-2.parquet")
    assert listed.fingerprint() == globbed.fingerprint() == folder.fingerprint()
    recursive = Dataset.from_path("x", str(copies / "**" / "*.parquet"))
    assert recursive.shard_ids == ("parquet/part-0.parquet", "parquet/part-1.parquet", "parquet/part-2.parquet")


def test_a_glob_that_matches_nothing_and_mixed_formats_are_refused(copies):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        Dataset.from_path("x", str(copies / "parquet" / "*.jsonl"))
    with pytest.raises(ValueError, match=r"several formats .*'arrow': 3.*'parquet': 3"):
        Dataset.from_path("x", [*sorted((copies / "parquet").iterdir()), *sorted((copies / "arrow").iterdir())])
    (copies / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"cannot tell the format of .*rows.csv.*parquet: \.parquet"):
        Dataset.from_path("x", copies / "rows.csv")
    with pytest.raises(ValueError, match="unknown fmt 'csv'"):
        Dataset.from_path("x", copies / "rows.csv", fmt="csv")


def test_fmt_forces_a_format_whatever_the_ending(copies):
    (copies / "odd").mkdir()
    os.link(copies / "parquet" / "part-1.parquet", copies / "odd" / "data.bin")
    ds = Dataset.from_path("x", copies / "odd", fmt="parquet")
    assert ds.format == "parquet" and ds.read(0, [3]) == [rows_of(1, 25)[3]]


# -- Parquet: row groups, the LRU, projection -------------------------------------------------------------


def test_a_read_decodes_only_the_row_groups_it_needs(copies):
    _columnar.ROW_GROUPS.clear()
    ds = Dataset.from_path("x", copies / "parquet")
    misses = _columnar.ROW_GROUPS.misses
    ds.read(1, [8, 9, 13])  # rows 7..13 are row group 1 of groups of 7
    keys = list(_columnar.ROW_GROUPS.entries)
    assert [k[-1] for k in keys] == [1] and _columnar.ROW_GROUPS.misses == misses + 1
    ds.read(1, [12, 7])  # the same group again: from the cache
    assert _columnar.ROW_GROUPS.misses == misses + 1
    ds.read(1, [24, 0])  # groups 0 and 3
    assert sorted(k[-1] for k in _columnar.ROW_GROUPS.entries) == [0, 1, 3]


def test_the_row_group_cache_stays_under_its_memory_bound(copies):
    _columnar.ROW_GROUPS.clear()
    ds = Dataset.from_path("x", copies / "parquet")
    one = ds.read(0, [0]) and _columnar.ROW_GROUPS.nbytes
    bound = 2 * one + one // 2  # room for two groups
    small = ds.with_io_options({"row_group_cache_bytes": bound})
    for shard in range(3):
        for row in range(0, 25, 3):
            small.read(shard, [row])
            assert _columnar.ROW_GROUPS.nbytes <= bound
    assert len(_columnar.ROW_GROUPS.entries) == 2


def test_columns_decode_only_the_projected_fields(copies):
    _columnar.ROW_GROUPS.clear()
    ds = Dataset.from_path("x", copies / "parquet", columns=["text"])
    assert ds.read(2, [4]) == [{"text": "doc 2-4"}]
    (table,) = _columnar.ROW_GROUPS.entries.values()
    assert table.column_names == ["text"]
    assert ds.fingerprint()["columns"] == ["text"]
    assert Dataset.from_path("x", copies / "arrow", columns=["id"]).read(0, [1]) == [{"id": 1}]
    with pytest.raises(ValueError, match=r"has no column\(s\) \['body'\]; its columns are \['id', 'text', 'toks'\]"):
        Dataset.from_path("x", copies / "parquet", columns=["body"])
    with pytest.raises(ValueError, match="columns= applies to Parquet and Arrow"):
        Dataset.from_path("x", copies / "jsonl", columns=["text"])


# -- identity and damaged files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_changed_columnar_file_is_refused_naming_it(copies, fmt):
    ds = Dataset.from_path("x", copies / fmt)
    ds.read(1, [0])
    target = copies / fmt / f"part-1.{fmt}"
    table = pa.Table.from_pylist(rows_of(9, 25))
    if fmt == "parquet":
        pa.parquet.write_table(table, target, row_group_size=7)
    else:
        pa.feather.write_feather(table, target, chunksize=6)
    with pytest.raises(ShardChangedError, match=rf"dataset 'x': shard file .*part-1.{fmt} changed"):
        ds.read(1, [0])


def test_a_columnar_file_rewritten_with_the_same_size_and_time_is_caught_by_its_digest(copies):
    target = copies / "parquet" / "part-0.parquet"
    ds = Dataset.from_path("x", copies / "parquet")
    st = os.stat(target)
    data = bytearray(target.read_bytes())
    data[-20] ^= 0xFF  # inside the footer
    replacement = copies / "new.parquet"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, target)  # another inode: the next read opens it again
    with pytest.raises(ShardChangedError, match="its modification time is the same; its content differs"):
        pickle.loads(pickle.dumps(ds)).read(0, [0])


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_truncated_columnar_file_fails_naming_it(copies, fmt):
    target = copies / fmt / f"part-2.{fmt}"
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"dataset 'x': .*part-2.{fmt} is not a readable .* cut short"):
        Dataset.from_path("x", copies / fmt)


def test_datasets_pickle_without_open_files_and_read_after(copies):
    for fmt in ("parquet", "arrow"):
        ds = Dataset.from_path("x", copies / fmt)
        ds.read(0, [0])
        again = pickle.loads(pickle.dumps(ds))
        assert again.read(2, [24, 3]) == [rows_of(2, 25)[24], rows_of(2, 25)[3]]
        assert again.fingerprint() == ds.fingerprint()


def test_an_arrow_stream_file_is_read_too(tmp_path):
    table = pa.Table.from_pylist(rows_of(0, 10))
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    ds = Dataset.from_path("s", tmp_path / "s.arrow")
    assert ds.num_rows == 10 and ds.read(0, [9, 4]) == [rows_of(0, 10)[9], rows_of(0, 10)[4]]


# -- token files ------------------------------------------------------------------------------------------------


DOCS = [[5, 6, 0], [7, 0], [8, 9, 10, 0], [11]]


def test_token_files_split_at_eos_into_documents(tmp_path):
    flat = np.array([t for d in DOCS for t in d], dtype=np.uint16)
    flat.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "val.npy", flat.astype(np.uint32))
    for path, dtype in ((tmp_path / "train.bin", np.uint16), (tmp_path / "val.npy", np.uint32)):
        ds = Dataset.from_path("t", path, eos_token_id=0, cache_dir=tmp_path / "cache")
        assert ds.format == "tokens" and ds.num_rows == 4
        got = ds.read(0, [3, 0, 2])
        assert [g["input_ids"].tolist() for g in got] == [DOCS[3], DOCS[0], DOCS[2]]
        assert got[0]["input_ids"].dtype == dtype and not got[0]["input_ids"].flags.writeable
    with pytest.raises(ValueError, match="pass eos_token_id="):
        Dataset.from_path("t", tmp_path / "train.bin")
    flat.astype(np.uint32).tofile(tmp_path / "wide.bin")
    ds = Dataset.from_path("t", tmp_path / "wide.bin", eos_token_id=0, token_dtype="uint32", cache_dir=tmp_path / "cache")
    assert ds.num_rows == 4


def test_a_megatron_index_gives_the_documents(tmp_path):
    docs = [[1, 2, 3], [4], [5, 6]]
    np.array([t for d in docs for t in d], dtype=np.int32).tofile(tmp_path / "corpus.bin")
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(sizes[:-1]) * 4)).astype(np.int64)
    with open(tmp_path / "corpus.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 3) + struct.pack("<Q", 4))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(4, dtype=np.int64).tobytes())
    ds = Dataset.from_path("m", tmp_path, fmt="tokens")
    assert ds.shard_ids == ("corpus.bin",)
    assert [r["input_ids"].tolist() for r in ds.read(0, [2, 0, 1])] == [[5, 6], [1, 2, 3], [4]]


def test_token_documents_pack_without_a_tokenizer(tmp_path):
    flat = np.array([t for d in DOCS for t in d], dtype=np.uint16)
    flat.tofile(tmp_path / "t.bin")
    ds = Dataset.from_path("t", tmp_path / "t.bin", eos_token_id=0, cache_dir=tmp_path / "cache")
    rows = [r.payload["input_ids"].tolist() for r in Pipeline(ds).pack_flat(5, algorithm="wrap")]
    assert [t for r in rows for t in r] == [t for d in DOCS for t in d]


def test_a_truncated_bin_and_a_changed_token_file_are_reported(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(5, dtype=np.uint16).tobytes()[:-1])
    with pytest.raises(ValueError, match=r"9 bytes, not a whole number of uint16 tokens; it was cut short"):
        Dataset.from_path("t", tmp_path / "t.bin", eos_token_id=0, cache_dir=tmp_path / "cache")
    np.arange(6, dtype=np.uint16).tofile(tmp_path / "t.bin")
    ds = Dataset.from_path("t", tmp_path / "t.bin", eos_token_id=0, cache_dir=tmp_path / "cache")
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ShardChangedError, match="t.bin changed after the dataset was opened"):
        ds.read(0, [0])


# -- Hugging Face datasets --------------------------------------------------------------------------------------

import datasets  # noqa: E402


def hf_rows(n: int):
    return datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(n)], "n": list(range(n))})


def test_pipeline_reads_a_hugging_face_dataset_by_row_fingerprinted_by_its_fingerprint():
    hf = hf_rows(10)
    got = [[r.payload for r in b.records] for b in Pipeline(hf).batch(5)]
    assert got == [[{"text": f"t{i}", "n": i} for i in range(k, k + 5)] for k in (0, 5)]
    ds = Dataset.from_hf("h", hf, shard_rows=4)
    assert ds.shard_sizes == (4, 4, 2) and ds.read(2, [1]) == [{"text": "t9", "n": 9}]
    ids = {s["identity"] for s in ds.fingerprint()["shards"]}
    assert all(hf._fingerprint in i for i in ids)
    changed = Dataset.from_hf("h", hf.map(lambda r: {"n": r["n"] + 1}), shard_rows=4)
    assert changed.fingerprint() != ds.fingerprint()
    numpy_view = Dataset.from_hf("h", hf.with_format("numpy"))  # rows stay Python values
    assert numpy_view.read(0, [3]) == [{"text": "t3", "n": 3}]


def test_a_dataset_dict_needs_a_split_and_streams_are_refused():
    dd = datasets.DatasetDict({"train": hf_rows(4), "test": hf_rows(2)})
    assert Dataset.from_hf("h", dd, split="test").num_rows == 2
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]; pass split='train'"):
        Dataset.from_hf("h", dd)
    with pytest.raises(TypeError, match="IterableDataset is a stream without row numbers.*streaming=False.*to_parquet"):
        Pipeline(hf_rows(4).to_iterable_dataset())
    with pytest.raises(TypeError, match="one-pass iterator without row numbers"):
        Pipeline(iter([{"text": "a"}]))
    with pytest.raises(TypeError, match="one-pass iterator without row numbers"):
        Pipeline({"text": str(i)} for i in range(3))


def test_an_unknown_source_error_names_its_full_type():
    class Dataset:  # a stranger's class that happens to share the name
        pass

    with pytest.raises(TypeError, match=r"cannot read from a \S*test_io_formats\.\S*<locals>\.Dataset; pass a zephon.io.Dataset"):
        Pipeline(Dataset())


# -- every source resumes exactly on another D ---------------------------------------------------------------


def _sources(tmp_path):
    """A token-file dataset and an HF dataset of the same documents, in 3 shards each."""
    docs = [[(7 * d + k) % 50 + 1 for k in range(d % 6)] + [0] for d in range(60)]
    for s in range(3):
        np.array([t for d in docs[s * 20 : (s + 1) * 20] for t in d], dtype=np.uint16).tofile(tmp_path / f"t{s}.bin")
    tokens = Dataset.from_path("tok", str(tmp_path / "t*.bin"), eos_token_id=0, cache_dir=tmp_path / "cache")
    hf = Dataset.from_hf("hf", datasets.Dataset.from_dict({"input_ids": docs}), shard_rows=20)
    return {"tokens": tokens, "hf": hf}


def _global_steps(pipes):
    per_rank = [list(p.steps()) for p in pipes]
    n = min(len(g) for g in per_rank)
    return [[b for groups in per_rank for b in groups[k]] for k in range(n)]


@pytest.mark.parametrize("kind", ["tokens", "hf"])
def test_token_and_hf_sources_resume_exactly_on_another_d(tmp_path, kind):
    from zephon import merge_checkpoints
    from zephon.testing import outputs_equal
    from zephon.work import StaticMixtureWorkSource

    ds = _sources(tmp_path)[kind]

    def build(dp, rank):
        src = StaticMixtureWorkSource([ds], {ds.name: 1}, seed=5, shuffle_within_shard=True, chunk_size=4)
        return Pipeline(src).options(canonical_replicas=4, dp_degree=dp, dp_rank=rank).map(_as_array).pack_flat(8, algorithm="wrap").shuffle(4, seed=1).batch(2)

    reference = _global_steps([build(1, 0)])
    assert len(reference) >= 3
    ranks = [build(2, r).loader() for r in range(2)]
    for loader in ranks:
        steps = loader.steps()
        next(steps), next(steps)
    merged = json.loads(json.dumps(merge_checkpoints([loader.checkpoint() for loader in ranks])))
    got = _global_steps([build(4, r).restore(merged) for r in range(4)])
    assert len(got) == len(reference) - 2
    assert all(outputs_equal(a, b) for a, b in zip(got, reference[2:]))


def _as_array(payload):
    return {"input_ids": np.asarray(payload["input_ids"], dtype=np.int64)}
