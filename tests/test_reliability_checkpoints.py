"""Checkpoints you can trust: checksums, validation, errors that name the file, atomic writes.

A checkpoint that was changed after it was written (a flipped bit, an edit that stays in range)
must be refused, never resumed into another stream; impossible values are refused naming the
lane and the field even when the state was re-signed; a bad file is named with what is wrong.
"""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from _util import toy_dataset, toy_pipeline
from zephon import load_checkpoint, merge_checkpoints, save_checkpoint
from zephon.runtime.checkpoint import FORMAT, lane_checksum, seal, state_dict_to_checkpoint
from zephon.testing import outputs_equal

TESTS = Path(__file__).parent


def small_pipeline(**kw):
    """Two lanes of map -> pack_flat(16, wrap) -> shuffle(4) -> batch(2) over 24 rows, endless."""
    return toy_pipeline(2, data=toy_dataset(24), buffer=4, **kw)


def running(steps=5, **kw):
    """A loader after ``steps`` outputs, its checkpoint, and the next 6 outputs."""
    it = iter(small_pipeline(**kw))
    for _ in range(steps):
        next(it)
    ck = it.checkpoint()
    return ck, [next(it) for _ in range(6)]


def resume(ck, n=6):
    return [x for _, x in zip(range(n), small_pipeline().restore(ck))]


# -- 1. integrity -------------------------------------------------------------------------------------


def test_every_single_byte_flip_of_a_saved_file_is_refused_naming_it(tmp_path):
    it = iter(small_pipeline())
    for _ in range(5):
        next(it)
    path = save_checkpoint(tmp_path, it)
    expected = [next(it) for _ in range(6)]
    data = path.read_bytes()
    target = small_pipeline()
    assert outputs_equal(list(zip(*zip(range(6), load_checkpoint(tmp_path, target))))[1], expected)

    silent, refused = [], 0
    target = small_pipeline()
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            load_checkpoint(tmp_path, target)
        except ValueError as exc:
            assert str(path) in str(exc), f"byte {i}: the error does not name the file: {exc}"
            refused += 1
            continue
        got = [x for _, x in zip(range(6), target)]
        if not outputs_equal(got, expected):
            silent.append(i)
        target = small_pipeline()
    assert not silent, f"{len(silent)} of {len(data)} single-byte flips resumed into another stream: bytes {silent[:20]}"
    assert refused == len(data)  # every byte is covered by the file's checksum or its exact layout


def _edit_cursor(st):
    st["source"][1] += 1


def _edit_chunk(st):
    st["source"][0] += 1


def _edit_shuffle_key(st):
    st["ops"]["shuffle"]["key"] += 1


def _remove_buffer_entry(st):
    st["ops"]["shuffle"]["buffer"].pop()


def _edit_pack_range(st):
    st["ops"]["pack_flat"]["stream"][0][1] += 1


def _remove_pending(st):
    st["pending"].pop(0)


def _edit_delivered(st):
    st["delivered"] += 1


IN_RANGE_EDITS = [_edit_cursor, _edit_chunk, _edit_shuffle_key, _remove_buffer_entry, _edit_pack_range, _remove_pending, _edit_delivered]


@pytest.mark.parametrize("edit", IN_RANGE_EDITS, ids=lambda f: f.__name__.strip("_"))
def test_in_range_hand_edits_are_refused_naming_the_lane(edit, tmp_path):
    ck, _ = running()
    edited = json.loads(json.dumps(ck))
    edit(edited["lanes"]["1"])
    message = r"^lane 1: checksum mismatch: the state was modified after it was written"
    with pytest.raises(ValueError, match=message):
        small_pipeline().restore(edited)
    with pytest.raises(ValueError, match=message):
        iter(small_pipeline()).restore(edited)
    with pytest.raises(ValueError, match=r"checkpoint 1: lane 1: checksum mismatch"):
        merge_checkpoints([ck, edited])
    sd = small_pipeline().loader().state_dict()
    sd["lane_00001"] = msgspec.msgpack.encode(edited["lanes"]["1"])
    with pytest.raises(ValueError, match=r"state_dict: lane 1: checksum mismatch"):
        state_dict_to_checkpoint(sd)


@pytest.mark.parametrize("options", [{}, {"workers": 1}], ids=["inline", "workers-decode"])
def test_a_state_changed_after_restore_is_refused_when_a_loader_reads_it_and_each_read_verifies_once(options, monkeypatch):
    """restore() verifies every lane; a loader made after it verifies its lanes once more, then decodes them.

    Inline, the decode is the loader's verification (one checksum per lane, not two); when worker
    processes decode the lanes, the loader verifies them before it starts them.
    """
    import zephon.runtime.checkpoint as zephon_checkpoint

    ck, _ = running()
    pipe = small_pipeline().options(**options).restore(ck)
    ck["lanes"]["1"]["delivered"] += 1  # the caller's copy changed after restore(): the states are shared
    with pytest.raises(ValueError, match=r"^lane 1: checksum mismatch"):
        iter(pipe)
    ck, _ = running()
    lanes = len(ck["lanes"])
    calls: list[int] = []
    checksum = zephon_checkpoint.lane_checksum
    monkeypatch.setattr(zephon_checkpoint, "lane_checksum", lambda lane, state: calls.append(lane) or checksum(lane, state))
    it = iter(small_pipeline().options(**options).restore(ck))
    try:
        assert sorted(calls) == sorted(2 * list(range(lanes)))  # restore(), then the loader's one read
    finally:
        it.close()


def test_a_lane_state_moved_to_another_lane_is_refused():
    ck, _ = running()
    swapped = copy.deepcopy(ck)
    swapped["lanes"]["0"], swapped["lanes"]["1"] = ck["lanes"]["1"], ck["lanes"]["0"]
    with pytest.raises(ValueError, match="lane 0: checksum mismatch"):
        small_pipeline().restore(swapped)


def test_unmodified_checkpoints_round_trip_through_json_msgpack_and_dcp(tmp_path):
    ck, expected = running()
    assert ck["format"] == FORMAT == "zephon.checkpoint/4"
    for lane, state in ck["lanes"].items():
        assert state["checksum"] == lane_checksum(int(lane), state)
        assert state["checksum"].startswith("blake2b:")
    for wire in (json.loads(json.dumps(ck)), msgspec.msgpack.decode(msgspec.msgpack.encode(ck)), msgspec.json.decode(msgspec.json.encode(ck))):
        assert outputs_equal(resume(wire), expected)
        restored = small_pipeline().restore(wire)
        assert restored.loader().checkpoint() == ck  # a loader of it checkpoints the same document
    sd = small_pipeline().restore(ck).loader().state_dict()
    assert sorted(k for k in sd if k.startswith("lane_")) == ["lane_00000", "lane_00001"]
    assert msgspec.msgpack.decode(sd["lane_00001"])["checksum"] == ck["lanes"]["1"]["checksum"]
    fresh = small_pipeline().loader()
    fresh.load_state_dict(sd)
    assert outputs_equal([x for _, x in zip(range(6), fresh)], expected)


def test_older_formats_are_refused_with_a_clear_message():
    ck, _ = running()
    old = {**ck, "format": "zephon.checkpoint/2", "lanes": {k: {f: v for f, v in s.items() if f != "checksum"} for k, s in ck["lanes"].items()}}
    with pytest.raises(ValueError, match=r"format 'zephon.checkpoint/2' is not supported: this version reads 'zephon.checkpoint/4'"):
        small_pipeline().restore(old)
    with pytest.raises(ValueError, match=r"checkpoint 0: checkpoint format 'zephon.checkpoint/2'"):
        merge_checkpoints([old])
    unsigned = {**ck, "lanes": {**ck["lanes"], "1": old["lanes"]["1"]}}
    with pytest.raises(ValueError, match="lane 1: the state has no checksum"):
        small_pipeline().restore(unsigned)


# -- 2. validation of re-signed states ----------------------------------------------------------------


def _set(path, value):
    def edit(st):
        node = st
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    edit.__name__ = "/".join(map(str, path))
    return edit


def _segment_end(index, value):
    """Set the end of the first segment of a flat row reference ``[lane, padding, d, s, r, child, start, end, ...]``."""

    def edit(ref):
        ref = list(ref)
        ref[7] = value
        return ref

    return edit


RESIGNED = [
    (_set(["source"], [-1, 0]), r"lane 1: field 'source' must be \[work chunk, offset\], two ints >= 0, got \[-1, 0\]"),
    (_set(["source"], ["2", 0]), r"lane 1: field 'source' must be \[work chunk, offset\]"),
    (_set(["source"], [2]), r"lane 1: field 'source' must be \[work chunk, offset\], two ints >= 0, got \[2\]"),
    (_set(["source"], None), r"lane 1: field 'source' must be"),
    (_set(["source", 1], 8), r"lane 1: field 'source': offset 8 is past the end of work chunk 2, which holds 8"),
    (_set(["delivered"], -1), r"lane 1: field 'delivered' must be an int >= 0, got -1"),
    (_set(["delivered"], 2.0), r"lane 1: field 'delivered' must be an int >= 0, got 2.0"),
    (_set(["delivered"], None), r"lane 1: field 'delivered' must be an int >= 0, got null"),
    (_set(["done"], "no"), r"lane 1: field 'done' must be true or false"),
    (_set(["done"], True), r"lane 1: field 'done' is true but the source cursor \[2, 0\] is inside the lane's data"),
    (_set(["ops"], None), r"lane 1: field 'ops' must map operator names to states"),
    (_set(["pending"], None), r"lane 1: field 'pending' must be a list"),
    (_set(["ops", "shuffle", "draws"], -1), r"lane 1: field 'ops': .*operator 'shuffle': field 'draws' must be an int >= 0, got -1"),
    (_set(["ops", "shuffle", "draws"], "3"), r"lane 1: field 'ops': .*operator 'shuffle': .*draws"),
    (_set(["ops", "shuffle", "emitted"], lambda n: n + 1), r"lane 1: field 'ops': .*'shuffle': fields 'draws' \(\d+\) and 'emitted'"),
    (_set(["ops", "shuffle", "buffer"], lambda b: b + b[:1]), r"lane 1: field 'ops': .*'shuffle': field 'buffer' holds 5 records"),
    (_set(["ops", "shuffle"], None), r"lane 1: field 'ops': .*operator 'shuffle'"),
    (_set(["ops", "batch", "batches"], -2), r"lane 1: field 'ops': .*operator 'batch': field 'batches' must be an int >= 0"),
    (_set(["ops", "batch", "partial"], lambda p: p * 2), r"lane 1: field 'ops': .*'batch': field 'partial' holds 2 records"),
    (_set(["ops", "pack_flat", "tokens"], -5), r"lane 1: field 'ops': .*'pack_flat': field 'tokens' must be an int >= 0"),
    (_set(["ops", "pack_flat", "stream", 0], lambda p: [p[0], p[1], p[1] + 15]), r"lane 1: field 'ops': .*'pack_flat': field 'stream\[0\]': token range \[\d+, \d+\) is outside the record from dataset 0, shard \d+, row \d+ \(lane 1\), which has \d+ tokens"),
    (_set(["ops", "pack_flat", "stream", 0, 2], 10**6), r"lane 1: field 'ops': .*'pack_flat': field 'stream' holds \d+ tokens; a row is cut at max_length=16"),
    (_set(["ops", "pack_flat", "stream", 0, 1], -1), r"lane 1: field 'ops': .*'pack_flat': field 'stream\[0\]': token range \[-1, \d+\) is empty or negative"),
    (_set(["ops", "pack_flat", "bins"], [[[[1, 0, 0, 0, 0, 0, 0, -1], 0, 1]]]), r"lane 1: field 'ops': .*'pack_flat': field 'bins' must be empty"),
    (_set(["ops", "shuffle", "buffer", 0], _segment_end(0, 10**6)), r"lane 1: field 'ops': .*'shuffle'.*token range \[\d+, 1000000\) is outside"),
    (_set(["ops", "shuffle", "buffer", 0, 0], 0), r"lane 1: field 'ops': .*names lane 0, but the state is lane 1's"),
    (_set(["ops", "shuffle", "buffer", 0, 4], 10**6), r"lane 1: field 'ops': .*row 1000000 of shard \d of dataset 'web', which has 12 rows"),
    (_set(["pending", 0, 0], _segment_end(0, 10**6)), r"lane 1: field 'pending': .*token range \[\d+, 1000000\) is outside"),
    (_set(["pending", 0, 0, 1], 3), r"lane 1: field 'pending': pack_flat: a row reference covers \d+ tokens with padding_length 3"),
    (_set(["pending", 0, 0, 3], 7), r"lane 1: field 'pending': .*names shard 7 of dataset 'web', which has 2"),
    (_set(["pending", 0], None), r"lane 1: field 'pending\[0\]': an output reference is a non-empty list, got None"),
    (_set(["pending", 0], []), r"lane 1: field 'pending\[0\]': an output reference is a non-empty list"),
    (_set(["pending", 0], lambda b: b[0]), r"lane 1: field 'pending\[0\]': the pipeline outputs batches"),
    (_set(["pending", 0], lambda b: b * 2), r"lane 1: field 'pending': a batch reference holds 4 records"),
    (_set(["pending", 0, 0], [1, 0, 0]), r"lane 1: field 'pending\[0\]': a record reference is \[lane, padding, 6 ints per segment"),
]


@pytest.mark.parametrize("edit, message", RESIGNED, ids=[f"{e.__name__}:{i}" for i, (e, _) in enumerate(RESIGNED)])
def test_impossible_values_are_refused_naming_lane_and_field_even_when_resigned(edit, message):
    ck, _ = running()
    edited = json.loads(json.dumps(ck))
    state = edited["lanes"]["1"]
    edit(state)
    edited["lanes"]["1"] = seal(1, state)  # re-signed with the library's own function
    assert ck["lanes"]["1"]["delivered"] < ck["lanes"]["0"]["delivered"] and ck["lanes"]["1"]["pending"]
    if "field 'ops'" in message and "is outside" in message:
        # Lane 1 is due first and gives an undelivered output first: its operator states are
        # checked at restore up to their records, and what needs a record (a token range inside
        # its document) when the lane steps again, as every other lane's.
        it = iter(small_pipeline()).restore(edited)
        with pytest.raises(ValueError, match=message):
            for _ in range(2 * (len(state["pending"]) + 1)):
                next(it)
        it.close()
    else:
        with pytest.raises(ValueError, match=message):
            iter(small_pipeline()).restore(edited)  # a loader decodes the lane states as it restores
    plan = small_pipeline().plan
    with pytest.raises(ValueError, match=message):  # the plan refuses it too, checksum or not
        plan.decode(1, {k: v for k, v in state.items() if k != "checksum"})


def test_null_states_and_lane_ids_outside_the_pipeline_are_refused():
    ck, _ = running()
    cases = [
        ({**ck["lanes"], "1": None}, r"lane 1: the state is null"),
        ({**ck["lanes"], "1": [1, 2]}, r"lane 1: the state must be a mapping, got list"),
        ({**ck["lanes"], "2": seal(2, ck["lanes"]["1"])}, r"lane 2 outside \[0, 2\): the checkpoint's pipeline has 2 lanes"),
        ({**ck["lanes"], "x": ck["lanes"]["1"]}, r"lane id 'x' is not a lane number"),
        ({**ck["lanes"], "01": ck["lanes"]["1"]}, r"lane id '01' is not a lane number"),
    ]
    for lanes, message in cases:
        with pytest.raises(ValueError, match=message):
            small_pipeline().restore({**ck, "lanes": lanes})
        with pytest.raises(ValueError, match=message):
            merge_checkpoints([{**ck, "lanes": lanes}])
    with pytest.raises(ValueError, match=r"lane 2 outside \[0, 2\)"):
        small_pipeline().plan.decode(2, ck["lanes"]["1"])


def test_a_finished_lane_must_sit_at_the_end_of_its_data():
    pipe = toy_pipeline(2, data=toy_dataset(24), buffer=4, policy=None)
    it = iter(pipe)
    list(it)
    ck = it.checkpoint()
    state = json.loads(json.dumps(ck["lanes"]["0"]))
    assert state["done"]
    for source, message in (
        ([state["source"][0] + 1, 0], r"lane 0: field 'source': work chunk \d+ is past the end of the lane's data, which ends at chunk \d+"),
        ([state["source"][0], 1], r"lane 0: field 'source': work chunk \d+ is past the end of the lane's data, where the offset is 0"),
    ):
        edited = {**ck, "lanes": {**ck["lanes"], "0": seal(0, {**state, "source": source})}}
        with pytest.raises(ValueError, match=message):
            iter(toy_pipeline(2, data=toy_dataset(24), buffer=4, policy=None)).restore(edited)
    not_done = {**ck, "lanes": {**ck["lanes"], "0": seal(0, {**state, "done": False})}}
    with pytest.raises(ValueError, match=r"lane 0: field 'done' is false but the source cursor .* is at the end"):
        iter(toy_pipeline(2, data=toy_dataset(24), buffer=4, policy=None)).restore(not_done)


# -- 3. errors name the file ------------------------------------------------------------------------


def _saved(tmp_path):
    it = iter(small_pipeline(dp_degree=2, dp_rank=1))
    next(it)
    return save_checkpoint(tmp_path, it)


def _old_file(data):
    ck = msgspec.msgpack.decode(msgspec.msgpack.decode(data)["checkpoint"])
    return msgspec.msgpack.encode({**ck, "format": "zephon.checkpoint/2"})


def _flip_body(data):
    out = bytearray(data)
    out[-5] ^= 0x10
    return bytes(out)


FILE_CASES = [
    (lambda d: d[: len(d) // 2], r"is truncated \(\d+ bytes\)"),
    (lambda d: d[:-1], r"is truncated"),
    (lambda d: b"", r"is empty \(0 bytes\)"),
    (lambda d: b"\xc1 not msgpack", r"is not a zephon checkpoint: not valid msgpack"),
    (lambda d: d + b"\x00", r"is not a zephon checkpoint: not valid msgpack"),
    (lambda d: msgspec.msgpack.encode({"weights": [1, 2]}), r"is not a zephon checkpoint: expected the fields"),
    (lambda d: msgspec.msgpack.encode([1, 2]), r"is not a zephon checkpoint"),
    (_flip_body, r": checksum mismatch: the file was modified or corrupted after it was written"),
    (_old_file, r": checkpoint format 'zephon.checkpoint/2' is not supported: this version reads 'zephon.checkpoint/4'"),
    (lambda d: d.replace(b"checkpoint-file/1", b"checkpoint-file/9"), r"has file format 'zephon.checkpoint-file/9'"),
]


@pytest.mark.parametrize("damage, message", FILE_CASES, ids=[str(i) for i in range(len(FILE_CASES))])
def test_a_bad_file_is_named_with_what_is_wrong(tmp_path, damage, message):
    path = _saved(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(tmp_path, small_pipeline(dp_degree=2, dp_rank=1))
    assert f"checkpoint file {path}" in str(info.value)


def test_a_renamed_file_is_refused(tmp_path):
    path = _saved(tmp_path)  # lanes 1-1
    path.rename(tmp_path / "zephon-lanes-00000-00000.msgpack")
    with pytest.raises(ValueError, match=r"zephon-lanes-00000-00000.msgpack holds lanes \[1\] outside the range 0-0"):
        load_checkpoint(tmp_path, small_pipeline(dp_degree=2, dp_rank=0))


# -- 4. atomic writes ----------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="tells files from directories through /proc")
def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    it = iter(small_pipeline())
    next(it)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", Path(a).parent == Path(b).parent, Path(a).name.startswith(".")))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = save_checkpoint(tmp_path, it)
    assert events == [("fsync", "file"), ("replace", True, True), ("fsync", "dir")]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file is left


def test_a_failed_write_leaves_the_previous_file_and_no_temporary_file(tmp_path, monkeypatch):
    it = iter(small_pipeline())
    next(it)
    path = save_checkpoint(tmp_path, it)
    before = path.read_bytes()
    next(it)

    def broken(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, it)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from _util import toy_dataset, toy_pipeline
    from zephon import save_checkpoint

    it = iter(toy_pipeline(2, data=toy_dataset(24), buffer=4))
    print("ready", flush=True)
    while True:
        next(it)
        save_checkpoint({directory!r}, it)
    """
)


def test_killing_the_writer_mid_save_never_leaves_a_file_that_fails_to_load(tmp_path):
    rng = random.Random(7)
    script = WRITER.format(tests=str(TESTS), directory=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    finals = sorted(tmp_path.glob("zephon-lanes-*.msgpack"))
    assert [p.name for p in finals] == ["zephon-lanes-00000-00001.msgpack"]
    # An interrupted write leaves (at most) a hidden temporary file; plant a torn one to be sure.
    (tmp_path / ".zephon-lanes-00000-00001.msgpack.torn.tmp").write_bytes(finals[0].read_bytes()[:40])
    (tmp_path / "zephon-lanes-00000-00001.msgpack.tmp123").write_bytes(b"")
    loaded = load_checkpoint(tmp_path, small_pipeline())
    assert next(iter(loaded)) is not None
