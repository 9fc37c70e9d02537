"""Messages between processes: arrays cross a pipe out of band, arrive equal, writable and unaliased."""

import multiprocessing as mp
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _util import read_only_ids, toy_dataset
from zephon import Pipeline
from zephon.core.records import Meta, Record, SampleBatch, Segment, payload_equal
from zephon.runtime.wire import pack_message, recv_message, send_message, send_parts


def round_trip(msg):
    """``msg`` sent over a real pipe (from a thread: a large message does not fit the pipe's buffer).

    Pickled here first, so that a message that does not pickle fails the test instead of leaving
    the reader waiting."""
    left, right = mp.Pipe()
    sender = threading.Thread(target=send_parts, args=(left, pack_message(msg)))
    sender.start()
    try:
        return recv_message(right)
    finally:
        sender.join()
        left.close()
        right.close()


def arrays_of(value):
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from arrays_of(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from arrays_of(v)
    elif isinstance(value, SampleBatch):
        yield from arrays_of(value.records)
    elif isinstance(value, Record):
        yield from arrays_of(value.payload)


def owner(array):
    """The object whose memory ``array`` views."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


def read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


BIG = 3 * 4096  # bytes of the larger int32, int64 and bool arrays


def every_kind_of_array():
    grid = np.arange(BIG, dtype=np.int64).reshape(-1, 8)
    return {
        "int32": np.arange(BIG // 4, dtype=np.int32),
        "int64": np.arange(BIG // 8, dtype=np.int64) - 7,
        "bool": np.arange(BIG) % 3 == 0,
        "small": np.array([1, 2, 3], dtype=np.int32),
        "zero_d": np.array(5, dtype=np.int64),
        "zero_d_bool": np.array(True),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "strided_small": np.arange(40, dtype=np.int32)[::3],
        "strided_big": np.arange(4 * BIG, dtype=np.int32)[::2],
        "column": grid[:, 3],
        "fortran": np.asfortranarray(grid),
        "transposed": grid.reshape(4, 8, -1).transpose(1, 0, 2),
        "read_only_big": read_only(np.arange(BIG // 4, dtype=np.int32)),
        "read_only_small": read_only(np.arange(10, dtype=np.int64)),
        "big_endian": np.arange(BIG // 4, dtype=">i4"),
        "words": np.array(["a", "bc"]),
        "dates": np.arange(3).astype("M8[s]"),
        "objects": np.array([{"a": 1}, None], dtype=object),
    }


def test_every_kind_of_array_arrives_equal_writable_and_with_its_dtype_and_shape():
    sent = every_kind_of_array()
    got = round_trip(sent)
    assert got.keys() == sent.keys()
    for name, array in sent.items():
        assert type(got[name]) is np.ndarray, name
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert np.array_equal(got[name], array), name
        assert got[name].flags.writeable, name
    assert got["fortran"].flags.f_contiguous
    assert got["transposed"].strides == sent["transposed"].strides


def test_arrays_nested_in_batches_records_dicts_and_lists_arrive_equal():
    def record(row):
        tokens = np.arange(row, row + 2049, dtype=np.int32)
        positions = np.arange(2049, dtype=np.int32)
        meta = Meta(lane=1, segments=(Segment(0, 0, row, 0, 0, 2049),))
        return Record({"input_ids": tokens, "positions": positions, "loss_mask": tokens % 2 == 0}, meta)

    batch = SampleBatch(tuple(record(row) for row in range(8)), pad_token_id=0)
    msg = ("out", 1, 3, batch, {"nested": [np.arange(5000, dtype=np.int64), {"x": np.ones(9, np.int32)}]})
    got = round_trip(msg)
    assert got[:3] == msg[:3]
    assert got[3] == batch and got[3].pad_token_id == 0
    assert [r.meta for r in got[3].records] == [r.meta for r in batch.records]
    assert payload_equal(got[4], msg[4])
    for array in arrays_of(got):
        assert array.flags.writeable


def test_arrays_travel_out_of_band_and_arrive_as_memory_of_their_own():
    contiguous = [np.arange(BIG // 4, dtype=np.int32), np.arange(BIG // 8, dtype=np.int64), np.arange(BIG) % 2 == 1, np.arange(3)]
    strided = np.arange(BIG // 4, dtype=np.int32)[::2]
    parts = pack_message({"contiguous": contiguous, "strided": strided})
    head, buffers = parts[0], parts[1:]
    assert [b.nbytes for b in buffers] == [a.nbytes for a in contiguous]
    assert strided.nbytes < head.nbytes < strided.nbytes + 1024  # only the strided one is copied in
    got = round_trip({"contiguous": contiguous, "strided": strided})
    for array in got["contiguous"]:
        memory = owner(array)
        assert isinstance(memory, bytearray) and len(memory) == array.nbytes
        assert np.shares_memory(array, np.frombuffer(memory, np.uint8))


def test_many_buffers_and_ones_larger_than_the_pipe_arrive_whole():
    # more buffers than one system call takes, and buffers the pipe cannot hold at once (partial writes)
    msg = [np.full(n % 7, n, dtype=np.int64) for n in range(1500)] + [np.arange(n * 100_000, dtype=np.int32) for n in (1, 3)]
    got = round_trip(msg)
    assert len(got) == len(msg) and all(payload_equal(a, b) for a, b in zip(got, msg))


def test_received_arrays_alias_exactly_as_the_sent_ones():
    base = np.arange(4 * BIG, dtype=np.int32)
    shared = np.arange(BIG, dtype=np.int64)
    got = round_trip({"a": base[:BIG], "b": base[BIG : 2 * BIG], "same": [shared, shared], "read_only": read_only(shared)})
    got["a"][:] = -1  # views of one array cross as arrays of their own: writing one leaves the other
    assert np.array_equal(got["b"], base[BIG : 2 * BIG])
    assert got["same"][0] is got["same"][1]  # one array sent twice stays one array
    got["read_only"][0] = 42
    assert got["same"][0][0] == 0
    assert not np.shares_memory(got["read_only"], got["same"][0])


def test_a_message_that_does_not_pickle_raises_and_sends_nothing():
    left, right = mp.Pipe()
    with pytest.raises(TypeError):
        send_message(left, {"ok": np.arange(BIG), "lock": threading.Lock()})
    assert not right.poll(0)


def test_a_message_cut_after_its_header_raises_eof_in_the_reader():
    left, right = mp.Pipe()
    parts = pack_message({"tokens": np.arange(BIG, dtype=np.int32)})
    assert len(parts) == 2
    send_parts(left, parts[:1])  # the pickle, which announces one buffer, and no buffer
    left.close()
    with pytest.raises(EOFError):
        recv_message(right)


def _only_here():
    """A module-level function: pickled by name."""


def test_a_name_the_reader_cannot_find_raises_an_unpickling_error_not_eof():
    left, right = mp.Pipe()
    head, buffer = pack_message(("out", _only_here, np.arange(BIG)))
    head = memoryview(bytes(head).replace(b"_only_here", b"_not_there"))  # as if the reader had other code
    send_parts(left, [head, buffer])
    with pytest.raises(AttributeError, match="_not_there"):
        recv_message(right)


def _send_from_child(conn, rows):
    send_message(conn, [np.full(2049, row, dtype=np.int32) for row in range(rows)])
    conn.close()


def test_arrays_cross_from_a_spawned_process():
    left, right = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_send_from_child, args=(left, 8))
    child.start()
    left.close()
    try:
        got = recv_message(right)
    finally:
        child.join(timeout=30)
    assert [a.tolist() for a in got] == [[row] * 2049 for row in range(8)]
    assert all(a.flags.writeable and isinstance(owner(a), bytearray) for a in got)
    with pytest.raises(EOFError):
        recv_message(right)


def test_batches_from_worker_processes_are_equal_and_writable_also_from_read_only_arrays():
    from zephon.work import StaticMixtureWorkSource

    def batches(workers):
        src = StaticMixtureWorkSource([toy_dataset(60)], {"web": 1.0}, seed=0, chunk_size=8, exhausted_policy=None)
        return list(Pipeline(src).options(canonical_replicas=2, workers=workers).map(read_only_ids).batch(4))

    inline, workers = batches(0), batches(2)
    assert inline == workers and len(workers) > 4
    inline_arrays, worker_arrays = list(arrays_of(inline)), list(arrays_of(workers))
    assert inline_arrays and not any(a.flags.writeable for a in inline_arrays)  # read-only where they were made
    assert all(a.flags.writeable for a in worker_arrays)
    assert len({id(owner(a)) for a in worker_arrays}) == len(worker_arrays)  # each has memory of its own


# -- batches: a fast form for payloads of arrays and plain values, the usual pickle for anything else --


def batch_of(payloads, pad=None):
    def meta(i):
        return Meta(lane=2, segments=(Segment(0, 1, i, 0, 0, 5 + i), Segment(1, 0, 7, 0, 2, 9)), padding_length=i % 3)

    return SampleBatch(tuple(Record(p, meta(i)) for i, p in enumerate(payloads)), pad_token_id=pad)


def same_batch(got, sent):
    """Equal records, metas, padding id, and every value of the same type (arrays: dtype and shape)."""
    assert type(got) is SampleBatch and got == sent and got.pad_token_id == sent.pad_token_id
    for g, s in zip(got.records, sent.records):
        assert g.meta == s.meta and list(g.payload) == list(s.payload)  # the keys in their order
        for key in s.payload:
            assert type(g.payload[key]) is type(s.payload[key]), key
            if isinstance(s.payload[key], np.ndarray):
                assert g.payload[key].dtype == s.payload[key].dtype and g.payload[key].shape == s.payload[key].shape
                assert g.payload[key].flags.writeable


def test_batches_of_arrays_and_plain_values_cross_in_their_fast_form_and_arrive_the_same():
    payloads = [
        {"input_ids": np.arange(i, i + 50, dtype=np.int32), "positions": read_only(np.arange(50, dtype=np.int32)),
         "loss_mask": np.arange(50) % 2 == 0, "grid": np.arange(12, dtype=">i8").reshape(3, 4), "scalar": np.array(i),
         "empty": np.zeros((0, 3), np.float32), "source": f"doc{i}", "n": i, "w": 0.5, "ok": True, "none": None, "raw": b"x"}
        for i in range(4)
    ]
    sent = batch_of(payloads, pad=7)
    parts = pack_message(sent)
    assert b"_rebuild_batch" in bytes(parts[0])
    assert len(parts) - 1 == 4 * 6  # every array out of band, the read-only one too
    got = round_trip(sent)
    same_batch(got, sent)
    arrays = list(arrays_of(got))
    assert len({id(owner(a)) for a in arrays}) == len(arrays) and all(isinstance(owner(a), bytearray) for a in arrays)
    got.records[0].payload["input_ids"][:] = -1  # arrays of their own: the others are untouched
    assert np.array_equal(got.records[1].payload["input_ids"], np.arange(1, 51, dtype=np.int32))


@pytest.mark.parametrize("odd", ["nested", "strided", "objects", "list", "same_array_twice", "not_a_dict", "subclass"])
def test_batches_the_fast_form_cannot_carry_pickle_as_usual_and_arrive_the_same(odd):
    shared = np.arange(6, dtype=np.int64)
    extra = {
        "nested": {"x": [np.arange(3), {"y": np.ones(2)}]},
        "strided": np.arange(20, dtype=np.int32)[::2],
        "objects": np.array([{"a": 1}, None], dtype=object),
        "list": [1, 2, 3],
        "same_array_twice": shared,
        "subclass": np.ma.masked_array([1, 2], mask=[0, 1]),
    }
    payloads = [{"input_ids": np.arange(i, i + 5, dtype=np.int32), "odd": extra.get(odd)} for i in range(3)]
    if odd == "not_a_dict":
        payloads = [np.arange(i, i + 5) for i in range(3)]
    sent = batch_of(payloads)
    assert b"_rebuild_batch" not in bytes(pack_message(sent)[0])
    got = round_trip(sent)
    assert got == sent and [r.meta for r in got.records] == [r.meta for r in sent.records]
    if odd == "same_array_twice":  # one array sent three times stays one array
        assert got.records[0].payload["odd"] is got.records[2].payload["odd"]
    if odd == "subclass":
        assert type(got.records[0].payload["odd"]) is np.ma.MaskedArray


_DTYPES = ["<i4", "<i8", ">i4", "<u2", "|b1", "<f4", "<M8[s]", "<U3"]


@st.composite
def payload_values(draw):
    """A payload field: an array (any dtype, shape, strides, writability), a plain value, or a nested list."""
    kind = draw(st.sampled_from(["array", "array", "plain", "nested"]))
    if kind == "plain":
        plain = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=3), st.binary(max_size=3))
        return draw(plain)
    if kind == "nested":
        return [draw(st.integers(0, 9)), np.arange(draw(st.integers(0, 4)))]
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    shape = draw(st.sampled_from([(0,), (1,), (7,), (2, 3), ()]))
    size = int(np.prod(shape))
    step = 2 if draw(st.booleans()) else 1  # every other element: a strided array (1-D), copied into the pickle
    if step == 2 and not dtype.isnative:
        dtype = dtype.newbyteorder("=")  # numpy's own pickle of a strided big-endian array comes back native
    array = np.arange(size * 2).astype(dtype)[::step][:size].reshape(shape)
    if draw(st.booleans()):
        array.flags.writeable = False
    return array


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["input_ids", "positions", "mask", "source", "n"]), payload_values(), max_size=4), max_size=4),
       st.one_of(st.none(), st.integers(0, 9)))
def test_any_batch_arrives_equal_with_its_dtypes_and_writable(payloads, pad):
    sent = batch_of(payloads, pad=pad)
    got = round_trip(sent)
    same_batch(got, sent)  # equal, every value of its type, arrays of their dtype and shape
    for array in arrays_of(got):
        assert array.flags.writeable  # also where the sent one was read-only
