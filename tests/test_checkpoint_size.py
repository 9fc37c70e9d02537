"""A rank's checkpoint grows with its lanes, not with the shards of its data.

The data's identity in a checkpoint is per dataset a shard count, totals and a digest of the shard
list; the list is a manifest written once beside the checkpoint files. A restore into other data
still names the shards that differ (from the manifest, or from memory for a checkpoint taken in
this process), and without a manifest says that the data differs, with the counts and where the
manifest was expected. A byte-identical copy of the data at another path resumes.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest

from zephon import Pipeline, load_checkpoint, save_checkpoint
from zephon.io import Dataset, InMemoryShard
from zephon.testing import outputs_equal
from zephon.work import StaticMixtureWorkSource

TESTS = Path(__file__).parent
LANES = 4


def toks(payload):
    return {"input_ids": np.asarray(payload["toks"], dtype=np.int32)}


def in_memory(shards: int) -> Dataset:
    """``shards`` shards of two short rows each, named like files (``part-00042``)."""
    rows = {f"part-{i:05d}": [{"toks": [i % 997 + 1, 2, 3]}, {"toks": [4, 5, i % 5 + 1]}] for i in range(shards)}
    return Dataset.from_dict("web", {name: InMemoryShard(r) for name, r in rows.items()})


def recipe(data: Dataset, **options) -> Pipeline:
    """map -> pack_flat -> batch over ``LANES`` lanes: the recipe without a shuffle buffer."""
    src = StaticMixtureWorkSource(
        [data], {"web": 1.0}, seed=1, chunk_size=4, shuffle_shards=True, exhausted_policy="repeat"
    )
    return Pipeline(src).options(canonical_replicas=LANES, **options).map(toks).pack_flat(16).batch(2)


def saved_sizes(data: Dataset, folder: Path, dp: int) -> list[int]:
    """The bytes of each rank's checkpoint file after 3 outputs per rank, ``dp`` ranks."""
    sizes = []
    for rank in range(dp):
        loader = recipe(data, dp_degree=dp, dp_rank=rank).loader()
        for _ in range(3):
            next(loader)
        sizes.append(save_checkpoint(folder, loader).stat().st_size)
        assert len(json.dumps(loader.checkpoint())) <= 4096 + 2048 * LANES // dp  # the JSON form is bounded too
    return sizes


def test_a_ranks_checkpoint_is_bounded_by_its_lanes_and_does_not_grow_with_the_shards(tmp_path):
    sizes, data_part = {}, {}
    for shards in (100, 10_000):
        data = in_memory(shards)
        data_part[shards] = len(msgspec.msgpack.encode(recipe(data).fingerprint()))
        for dp in (1, 4):
            sizes[shards, dp] = saved_sizes(data, tmp_path / f"{shards}-{dp}", dp)
            assert max(sizes[shards, dp]) <= 4096 + 2048 * LANES // dp, (shards, dp, sizes[shards, dp])
        manifests = sorted((tmp_path / f"{shards}-4").glob("zephon-manifest-*.msgpack"))
        assert len(manifests) == 1  # one manifest for the four ranks
        lane_files = sorted((tmp_path / f"{shards}-4").glob("zephon-lanes-*.msgpack"))
        assert len(lane_files) == 4 and all(b"part-00042" not in p.read_bytes() for p in lane_files)
        assert b"part-00042" in manifests[0].read_bytes()
    for dp in (1, 4):
        # The lane states name shards by number (3 msgpack bytes past 127, not 1): some bytes, where the
        # shard list would add about 140 per shard, 1.4 MB here.
        assert max(sizes[10_000, dp]) - max(sizes[100, dp]) <= 256, sizes
    assert data_part[10_000] - data_part[100] <= 8  # the fingerprint: only the counts' integers widen


def write_jsonl(folder: Path, shards: int = 40, tag: str = "") -> Path:
    folder.mkdir(parents=True)
    for s in range(shards):
        rows = [json.dumps({"id": 100 * s + i, "toks": [s + 1, i + 1] * (1 + i % 3), "tag": tag}) for i in range(5)]
        (folder / f"shard-{s:05d}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def files(folder: Path) -> Pipeline:
    data = Dataset.from_path("web", folder)
    src = StaticMixtureWorkSource([data], {"web": 1.0}, seed=3, chunk_size=4, shuffle_shards=True)
    return Pipeline(src).options(canonical_replicas=LANES).batch(2)


def ids(batches) -> list[list[int]]:
    return [[r.payload["id"] for r in b.records] for b in batches]


def rewrite_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(b'"toks"') - 3] ^= 0x01  # a digit of the id: same size, other content
    path.write_bytes(bytes(data))


# Another process saves the checkpoints, so the shards these tests name come from the manifest on disk.
SAVER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_checkpoint_size import files, ids
    from zephon import save_checkpoint

    out = {{}}
    for data, ckpt in {pairs!r}:
        loader = files(data).loader()
        for _ in range(3):
            next(loader)
        save_checkpoint(ckpt, loader)
        out[data] = ids([next(loader) for _ in range(6)])
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three data folders (of different content), each with a checkpoint folder saved by another
    process, and the outputs that followed each checkpoint there."""
    root = tmp_path_factory.mktemp("saved")
    names = ("named", "unnamed", "copied")
    pairs = [(str(write_jsonl(root / name / "data", tag=name)), str(root / name / "ckpt")) for name in names]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    script = SAVER.format(tests=str(TESTS), pairs=pairs)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    return {Path(d).parent.name: (Path(d), Path(c), expected[d]) for d, c in pairs}


def test_a_mismatch_names_the_shards_from_the_manifest_beside_the_checkpoint(saved):
    data, ckpt, _ = saved["named"]
    assert len(list(ckpt.glob("zephon-manifest-*.msgpack"))) == 1
    rewrite_one_byte(data / "shard-00003.jsonl")
    (data / "shard-00007.jsonl").unlink()
    shutil.copyfile(data / "shard-00001.jsonl", data / "shard-00040.jsonl")
    with pytest.raises(ValueError) as info:
        load_checkpoint(ckpt, files(data))
    message = str(info.value)
    size = (data / "shard-00003.jsonl").stat().st_size
    changed = f"dataset 'web': shard 'shard-00003.jsonl' content differs from the checkpoint's (size {size} → {size}, "
    assert changed in message
    assert "shard 'shard-00007.jsonl' was removed" in message and "shard 'shard-00040.jsonl' was added" in message
    assert "restore the original files or start a new run" in message
    assert "shard-00001.jsonl" not in message and "shard-00002.jsonl" not in message


def test_without_the_manifest_a_mismatch_gives_the_counts_and_where_the_manifest_was_expected(saved):
    data, ckpt, _ = saved["unnamed"]
    (manifest,) = ckpt.glob("zephon-manifest-*.msgpack")
    manifest.unlink()
    rewrite_one_byte(data / "shard-00005.jsonl")
    with pytest.raises(ValueError) as info:
        load_checkpoint(ckpt, files(data))
    message = str(info.value)
    assert "dataset 'web': the data differs from the checkpoint's (40 shards, 200 rows" in message
    assert "40 shards, 200 rows" in message.split("in the checkpoint;")[1]  # and the counts now
    assert f"was expected at {manifest} and is not there" in message
    assert "restore the original files or start a new run" in message


def test_a_byte_identical_copy_at_another_path_resumes_from_the_saved_checkpoint(saved, tmp_path):
    data, ckpt, expected = saved["copied"]
    staged = tmp_path / "nvme" / "data"
    shutil.copytree(data, staged, copy_function=shutil.copyfile)
    loader = iter(load_checkpoint(ckpt, files(staged)))
    assert ids([next(loader) for _ in range(6)]) == expected


def test_a_checkpoint_kept_in_memory_names_the_changed_shard_after_its_pipeline_is_gone(tmp_path):
    data = write_jsonl(tmp_path / "data", tag="memory")
    loader = files(data).loader()
    next(loader)
    ck = loader.checkpoint()
    entry = ck["fingerprint"]["source"]["datasets"][0]
    assert (entry["shards"], entry["rows"]) == (40, 200) and entry["digest"].startswith("sha256:")
    loader.close()
    del loader
    gc.collect()
    rewrite_one_byte(data / "shard-00011.jsonl")
    with pytest.raises(ValueError, match=r"shard 'shard-00011\.jsonl' content differs from the checkpoint's") as info:
        files(data).loader(ck)
    assert "shard-00010.jsonl" not in str(info.value)


def test_a_checkpoint_holding_the_shard_list_as_earlier_versions_wrote_it_still_restores(tmp_path):
    data = in_memory(2_000)
    loader = recipe(data).loader()
    for _ in range(3):
        next(loader)
    ck = json.loads(json.dumps(loader.checkpoint()))
    expected = [next(loader) for _ in range(5)]
    old = json.loads(json.dumps(ck))
    old["fingerprint"]["source"]["datasets"] = [data.fingerprint()]  # the full list, as before digests
    assert len(json.dumps(old)) > 50 * len(json.dumps(ck))
    resumed = recipe(in_memory(2_000)).loader(old)
    got = [next(resumed) for _ in range(5)]
    assert outputs_equal(got, expected)
    changed = dict(data.fingerprint())
    changed["shards"] = [dict(s) for s in changed["shards"]]
    changed["shards"][17]["identity"] = "blake2b:" + "0" * 32
    old["fingerprint"]["source"]["datasets"] = [changed]
    with pytest.raises(ValueError, match=r"shard 'part-00017' content differs from the checkpoint's"):
        recipe(data).loader(old)
