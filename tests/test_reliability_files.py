"""Files that change or lie: shards rewritten while in use, cut-short compressed files, bad fields.

Each change to a shard file is reported as an error naming the file, never read (wrong samples)
and never a crash: a mapped file that shrinks kills the process with ``SIGBUS`` when the lost
pages are touched, so those scenarios run in a child process, where a crash or a hang fails the
test instead of the test run.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import attrs
import pytest

from zephon import Pipeline
from zephon.core.operator import Operator, StatelessOp
from zephon.io import Dataset, ShardChangedError
from zephon.sources import jsonl as _jsonl

from _util import compress, train_bytelevel


#: Each test reads and writes its own cache folder.
pytestmark = pytest.mark.usefixtures("cache_dir")


def rows_of(n: int, width: int = 1000) -> list[dict]:
    """Rows of about ``width`` bytes, so that a few dozen span several pages of a mapping."""
    return [{"id": i, "text": f"row {i} " + "x" * width} for i in range(n)]


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)




def run_child(script: str, *args: str, timeout: float = 120) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line.

    A crash (a signal), a hang (``timeout``) or an unexpected exit fails the test with its output.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child process hung for {timeout} s; its output: {exc.stdout!r} {exc.stderr!r}")
    if done.returncode != 0:
        how = f"was killed by signal {-done.returncode}" if done.returncode < 0 else f"exited with {done.returncode}"
        pytest.fail(f"the child process {how}; stdout: {done.stdout!r}; stderr: {done.stderr[-3000:]!r}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- a shard that shrinks while it is read ---------------------------------------------------------------

SHRINK_WHILE_ITERATING = """
import json, sys
from pathlib import Path
from zephon import Pipeline
from zephon.io import Dataset

folder, target = Path(sys.argv[1]), sys.argv[2]
it = iter(Pipeline(Dataset.from_path("web", folder)).batch(4))
for _ in range(3):
    next(it)
if target == "source":
    shard = sorted(folder.iterdir())[0]
    open(shard, "w").write('{"text":"x"}\\n')  # shorter, rewritten in place
else:  # the decompressed copy that is mapped
    (copy,) = (Path(sys.argv[3]) / "decompressed").glob("*.jsonl")
    open(copy, "w").write('{"text":"x"}\\n')
try:
    for _ in range(200):
        next(it)
    print(json.dumps({"error": None}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "value_error": isinstance(exc, ValueError)}))
"""


def _shards(folder: Path, suffix: str, count: int = 2, n: int = 300) -> list[int]:
    folder.mkdir()
    sizes = []
    for s in range(count):
        data = compress(jsonl(rows_of(n)), suffix)
        (folder / f"p{s}{suffix}").write_bytes(data)
        sizes.append(len(data))
    return sizes


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_a_shard_rewritten_shorter_while_iterating_is_an_error_naming_it(tmp_path, cache_dir, suffix):
    # Before: a plain shard killed the interpreter (SIGBUS on the shrunk mapping), a compressed one
    # went on serving the old decompressed copy without a word.
    sizes = _shards(tmp_path / "web", suffix)
    got = run_child(SHRINK_WHILE_ITERATING, str(tmp_path / "web"), "source", str(cache_dir))
    assert got["error"] == "ShardChangedError" and got["value_error"]
    assert f"p0{suffix}" in got["message"] and "dataset 'web'" in got["message"]
    assert f"changed while reading: size was {sizes[0]} bytes, now 13" in got["message"]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_decompressed_copy_shrunk_while_iterating_is_an_error_not_a_crash(tmp_path, cache_dir, suffix):
    _shards(tmp_path / "web", suffix, count=1)
    got = run_child(SHRINK_WHILE_ITERATING, str(tmp_path / "web"), "copy", str(cache_dir))
    assert got["error"] == "ShardChangedError", got
    assert "decompressed copy of shard file" in got["message"] and f"p0{suffix}" in got["message"]
    assert "changed while reading: size was" in got["message"]


def test_a_shard_that_shrank_before_it_was_mapped_is_an_error(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl(rows_of(20)))
    ds = pickle.loads(pickle.dumps(Dataset.from_path("web", path)))  # nothing mapped in this copy
    path.write_text('{"text":"x"}\n')
    with pytest.raises(ShardChangedError, match=r"a\.jsonl changed after the dataset was opened: size was \d+ bytes, now 13"):
        ds.read(0, [5])


# -- same size, new content --------------------------------------------------------------------------------


def _rewrite(path: Path, data: bytes, *, keep_mtime: bool, in_place: bool = True) -> None:
    """Write ``data`` over ``path`` (in place, or by renaming a new file over it), its time kept or moved."""
    before = path.stat().st_mtime_ns
    if in_place:
        with open(path, "r+b") as f:
            f.write(data)
    else:
        fresh = path.with_name(path.name + ".new")
        fresh.write_bytes(data)
        os.replace(fresh, path)
    # Set the time explicitly: two writes within one clock tick can share a modification time.
    stamp = before if keep_mtime else before + 2_000_000_000
    os.utime(path, ns=(stamp, stamp))


def _same_size_variant(data: bytes, at: int) -> bytes:
    """``data`` with the first ``x`` at or after byte ``at`` made a ``y`` (the same size)."""
    i = data.index(b"x", at)
    return data[:i] + b"y" + data[i + 1 :]


def test_same_size_rewrite_with_a_new_time_fails_the_next_read(tmp_path):
    path = tmp_path / "a.jsonl"
    data = jsonl(rows_of(300))
    path.write_bytes(data)
    ds = Dataset.from_path("web", path)
    assert ds.read(0, [0, 1]) == rows_of(2)  # mapped now
    _rewrite(path, _same_size_variant(data, len(data) // 2), keep_mtime=False)
    # Before: the held mapping served the new bytes (the documented "next read fails" did not happen).
    with pytest.raises(ShardChangedError, match=rf"{path.name} changed while reading: size was {len(data)} bytes, now {len(data)}; mtime_ns was"):
        ds.read(0, [1])


@pytest.mark.parametrize("where", ["head", "tail"])
def test_same_size_and_time_rewrite_of_the_ends_is_caught_by_the_quick_digest(tmp_path, monkeypatch, where):
    path = tmp_path / "a.jsonl"
    data = jsonl(rows_of(300))  # about 300 KB: more than the two 64 KiB ends
    path.write_bytes(data)
    ds = Dataset.from_path("web", path)
    assert ds.read(0, [0]) == rows_of(1)
    reopened = pickle.loads(pickle.dumps(ds))  # a copy as a worker process gets it (nothing mapped)
    _rewrite(path, _same_size_variant(data, 10 if where == "head" else len(data) - 2000), keep_mtime=True)
    assert path.stat().st_size == len(data)
    # Mapped afresh (a new process, or after being unmapped): compared with the digest at once.
    with pytest.raises(ShardChangedError, match=r"a\.jsonl changed after the dataset was opened: size was (\d+) bytes, now \1; .*its content differs"):
        reopened.read(0, [3])
    # Held: the write changed the file's ctime, so the next read digests it again.
    with pytest.raises(ShardChangedError, match=r"a\.jsonl changed while reading: .*its modification time is the same; its content differs"):
        ds.read(0, [3])


def test_a_same_size_and_time_change_in_the_middle_is_refused_with_either_verify(tmp_path, monkeypatch):
    monkeypatch.setattr(_jsonl, "_RECHECK_S", 0.0)
    monkeypatch.setattr(_jsonl, "_RECHECK_SHARE", float("inf"))
    path = tmp_path / "a.jsonl"
    data = jsonl(rows_of(300))
    path.write_bytes(data)
    quick = Dataset.from_path("web", path)
    full = Dataset.from_path("web", path, verify="full")
    fresh_full = pickle.loads(pickle.dumps(full))
    assert quick.read(0, [0]) == full.read(0, [0]) == rows_of(1)
    middle = len(data) // 2
    changed = _same_size_variant(data, middle)
    _rewrite(path, changed, keep_mtime=True)
    row = data[: data.index(b"x", middle)].count(b"\n")  # the row whose byte changed
    # Size and time are unchanged, the ctime is not: the file is digested again (before: read silently).
    with pytest.raises(ShardChangedError, match="its content differs"):
        quick.read(0, [row])
    with pytest.raises(ShardChangedError, match="its content differs"):
        full.read(0, [row])
    with pytest.raises(ShardChangedError, match="its content differs"):
        fresh_full.read(0, [0])


def test_a_file_replaced_by_an_identical_copy_is_read_on_and_by_another_is_an_error(tmp_path):
    path = tmp_path / "a.jsonl"
    data = jsonl(rows_of(300))
    path.write_bytes(data)
    ds = Dataset.from_path("web", path)
    assert ds.read(0, [0]) == rows_of(1)
    _rewrite(path, data, keep_mtime=True, in_place=False)  # a copy that keeps times (rsync -t, cp -p)
    assert ds.read(0, [299, 1]) == [rows_of(300)[299], rows_of(2)[1]]
    _rewrite(path, _same_size_variant(data, 5), keep_mtime=True, in_place=False)
    with pytest.raises(ShardChangedError, match="its content differs"):
        ds.read(0, [2])


def test_verify_takes_two_values(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(rows_of(2)))
    with pytest.raises(ValueError, match=r"unknown verify 'all'.*'quick'.*'full'"):
        Dataset.from_path("web", tmp_path, verify="all")
    ds = Dataset.from_path("web", tmp_path, verify="full")
    assert ds.read(0, [1]) == rows_of(2)[1:]
    assert ds.fingerprint() == Dataset.from_path("web", tmp_path).fingerprint()  # not a data setting


# -- compressed files cut short ----------------------------------------------------------------------------


def test_a_cut_short_zstd_file_fails_at_open_naming_it(tmp_path):
    import zstandard

    rows = rows_of(400, width=50)
    frames = [zstandard.ZstdCompressor().compress(jsonl(rows[i : i + 100])) for i in (0, 100, 200)]
    frames[2] = zstandard.ZstdCompressor().compress(jsonl(rows[200:]))
    data = frames[0] + frames[1] + frames[2][: len(frames[2]) // 2]
    (tmp_path / "a.jsonl.zst").write_bytes(data)
    # Before: it opened without error with the 200 rows of the two complete frames.
    with pytest.raises(ValueError, match=r"could not decompress .*a\.jsonl\.zst \(EOFError: the file ends inside a zstd frame"):
        Dataset.from_path("web", tmp_path)
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(frames))
    assert Dataset.from_path("web", tmp_path).num_rows == 400


def test_a_cut_short_gzip_file_fails_at_open_naming_it(tmp_path):
    data = gzip.compress(jsonl(rows_of(100, width=50)))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl(rows_of(10))) + data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"could not decompress .*a\.jsonl\.gz \(EOFError"):
        Dataset.from_path("web", tmp_path)


# -- per-record errors name the dataset, the file and the row ---------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(train_bytelevel(tmp_path_factory.mktemp("tok")))


BAD_TEXTS = {"missing": ("no text", ValueError), "int": (5, TypeError), "list": (["a", "b"], TypeError), "none": (None, TypeError)}


def _bad_dataset(folder: Path, kind: str, bad_row: int = 13) -> Path:
    folder.mkdir(exist_ok=True)
    rows = [{"text": f"row {i} of the data"} for i in range(40)]
    value = BAD_TEXTS[kind][0]
    rows[bad_row] = {"body": value} if kind == "missing" else {"text": value}
    path = folder / "part-0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _message(exc: BaseException) -> str:
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


@pytest.mark.parametrize("kind", list(BAD_TEXTS))
def test_a_bad_text_field_names_dataset_file_and_row(tmp_path, tokenizer, kind):
    path = _bad_dataset(tmp_path / "web", kind)
    pipe = Pipeline(Dataset.from_path("web", tmp_path / "web")).tokenize(tokenizer=tokenizer, special_tokens="eos").batch(2)
    with pytest.raises(BAD_TEXTS[kind][1]) as info:  # the type the operator raised, unchanged
        list(pipe)
    text = _message(info.value)
    assert "dataset 'web'" in text and f"file {path}" in text and "row 13" in text, text
    assert text.count("zephon: raised by tokenize") == 1 and "raised while lane" not in text  # named once


@pytest.mark.parametrize("kind", ["missing", "int"])
def test_a_bad_text_field_in_a_worker_names_dataset_file_and_row(tmp_path, tokenizer, kind):
    from zephon.runtime.executor import WorkerError

    path = _bad_dataset(tmp_path / "web", kind)
    pipe = Pipeline(Dataset.from_path("web", tmp_path / "web")).options(workers=1)
    pipe = pipe.tokenize(tokenizer=tokenizer, special_tokens="eos").batch(2)
    with pytest.raises(WorkerError) as info:
        list(pipe)
    text = str(info.value)
    assert BAD_TEXTS[kind][1].__name__ in text
    assert "dataset 'web'" in text and f"file {path}" in text and "row 13" in text, text


@attrs.frozen
class FailsOnRow(Operator):
    """An operator with its own ``step`` (not a per-payload one) that fails on a given row."""

    row: int
    kind: ClassVar[str] = "fails"

    def step(self, state, chunk):
        if any(r.meta.segments[0].row == self.row for r in chunk):
            raise RuntimeError("this chunk cannot be processed")
        return state, list(chunk)


@attrs.frozen
class Strict(StatelessOp):
    """A per-payload operator whose chunk call fails without saying which payload is to blame."""

    calls: list = attrs.field(factory=list, eq=False)
    kind: ClassVar[str] = "strict"

    def apply_many(self, payloads):
        self.calls.append(len(payloads))
        if any(p.get("id") == 13 for p in payloads):
            raise ValueError("a payload is not allowed")
        return [[p] for p in payloads]


def test_an_error_that_names_no_record_gets_the_chunk_named(tmp_path):
    path = _bad_dataset(tmp_path / "web", "int")
    pipe = Pipeline(Dataset.from_path("web", tmp_path / "web")).add(FailsOnRow(13)).batch(2)
    with pytest.raises(RuntimeError, match="cannot be processed") as info:
        list(pipe)
    notes = info.value.__notes__
    assert len(notes) == 1 and notes[0].startswith("zephon: raised while lane 0 was processing 16 records: ")
    assert f"dataset 'web', shard 'part-0.jsonl' (file {path}), rows 0, 1, 2, 3, 4, 5, 6, 7, ... (16 rows)" in notes[0]


def _fails_on_13(payload):
    if payload.get("id") == 13:
        raise KeyError("no 13 here")
    return payload


def test_in_memory_records_are_named_by_dataset_and_shard(tmp_path):
    data = Dataset.from_dict("mem", {"left": [{"id": i} for i in range(10)], "right": [{"id": i} for i in range(10, 20)]})
    with pytest.raises(KeyError) as info:
        list(Pipeline(data).map(_fails_on_13).batch(1))
    assert info.value.__notes__ == [
        "zephon: raised by map on the record from dataset 0, shard 1, row 3 (lane 0)",
        "zephon: that record is dataset 'mem', shard 'right', row 3 (lane 0)",
    ]


def test_a_chunk_error_is_traced_to_its_record_by_applying_one_at_a_time(tmp_path):
    data = Dataset.from_rows("mem", [{"id": i} for i in range(30)])
    strict = Strict()
    with pytest.raises(ValueError, match="not allowed") as info:
        # Without reading ahead, whose failed grouped call would come first (then the lane reads
        # alone and fails the same way: tests/test_read_ahead.py).
        list(Pipeline(data).options(read_ahead=0).add(strict).batch(1))
    assert info.value.__notes__ == [
        "zephon: raised by strict on the record from dataset 0, shard 0, row 13 (lane 0)",
        "zephon: that record is dataset 'mem', shard '0', row 13 (lane 0)",
    ]
    assert strict.calls == [16] + [1] * 14  # one chunk call, then one call per record up to the failing one
