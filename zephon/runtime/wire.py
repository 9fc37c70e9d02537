"""Messages over a ``multiprocessing`` connection with their buffers out of band.

Pickled with protocol 5, every contiguous buffer is written after the pickle from the object's
memory and read into a fresh writable ``bytearray``; batches of dict payloads of arrays and plain
values reduce to a compact form (:func:`_reduce_batch`). Wire format: the pickle's length, the
pickle and a trailer (the buffers' sizes, then their count; little-endian 64-bit), then the
buffers, with one ``writev`` (on Windows, one connection message each).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

import msgspec
import numpy as np

from ..core.records import Meta, Record, SampleBatch

#: Where numpy's protocol-5 pickles find the function that rebuilds an array over its buffer.
_NUMPY_FROMBUFFER = {("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer")}


class _Pickler(pickle.Pickler):
    """Protocol 5 with ``ForkingPickler``'s reducers (which take no ``buffer_callback``: borrowed
    here) and :func:`_reduce_batch`; buffers are kept apart in ``buffers``."""

    def __init__(self, file: io.BytesIO) -> None:
        self.buffers: list[pickle.PickleBuffer] = []
        super().__init__(file, 5, buffer_callback=self.buffers.append)
        self.dispatch_table = ForkingPickler(file).dispatch_table  # a fresh copy of the current reducers
        self.dispatch_table[SampleBatch] = _reduce_batch


#: Payload values a batch's fast form carries as they are (anything else: the batch pickles as usual).
_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


def _reduce_batch(batch: SampleBatch) -> Any:
    """A batch in a form that pickles without Python code per array and meta: per record its
    payload's keys and values (arrays as buffers, dtype and shape), the metas as msgpack. Any other
    batch (nested containers, other arrays, one array twice) pickles as usual."""
    records, seen, out = batch.records, set(), []
    for r in records:
        payload = r.payload
        if type(payload) is not dict:
            return batch.__reduce_ex__(5)
        values, arrays = list(payload.values()), []
        for i, v in enumerate(values):
            t = type(v)
            if t is np.ndarray and v.flags.c_contiguous and not v.dtype.hasobject and id(v) not in seen:
                try:
                    values[i] = pickle.PickleBuffer(v)
                except (BufferError, ValueError):  # no buffer for its dtype (datetimes): numpy pickles it
                    return batch.__reduce_ex__(5)
                seen.add(id(v))
                arrays.append((i, v.dtype, v.shape))
            elif t not in _PLAIN:
                return batch.__reduce_ex__(5)
        out.append((tuple(payload), values, arrays))
    return _rebuild_batch, (out, _META_ENCODER.encode([r.meta for r in records]), batch.pad_token_id)


def _rebuild_batch(records: list, metas: bytes, pad_token_id: Any) -> SampleBatch:
    """Inverse of :func:`_reduce_batch`: every array writable, over the buffer received for it."""
    out = []
    for (keys, values, arrays), meta in zip(records, _META_DECODER.decode(metas)):
        for i, dtype, shape in arrays:
            values[i] = _frombuffer(values[i], dtype, shape, "C")
        out.append(Record(dict(zip(keys, values)), meta))
    return SampleBatch(tuple(out), pad_token_id)


_META_ENCODER = msgspec.msgpack.Encoder()
_META_DECODER = msgspec.msgpack.Decoder(list[Meta])


class _Unpickler(pickle.Unpickler):
    """Rebuilds numpy arrays writable, over the buffers received for them."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_FROMBUFFER:
            return _frombuffer
        return super().find_class(module, name)


def _frombuffer(buf: Any, dtype: np.dtype, shape: tuple[int, ...], order: str, axis_order: Any = None) -> np.ndarray:
    """numpy's ``_frombuffer`` over a received bytearray, writable (an array read-only in the sender
    arrives as a read-only view of one)."""
    if isinstance(buf, memoryview) and isinstance(buf.obj, bytearray):
        buf = buf.obj
    array = np.frombuffer(buf, dtype=dtype)
    if len(shape) == 1:
        return array
    if order == "K" and axis_order is not None:
        return array.reshape(shape, order="C").transpose(axis_order)
    return array.reshape(shape, order=order)


def pack_message(msg: Any) -> list[memoryview]:
    """``msg`` as the parts to send: the pickle with its trailer, then each buffer (views of the
    message's own arrays); raises what pickling raises."""
    head = io.BytesIO()
    pickler = _Pickler(head)
    pickler.dump(msg)
    buffers = [buf.raw() for buf in pickler.buffers]
    sizes = [buf.nbytes for buf in buffers]
    head.write(struct.pack(f"<{len(sizes) + 1}Q", *sizes, len(sizes)))
    return [head.getbuffer(), *buffers]


def send_parts(conn: Any, parts: list[memoryview]) -> None:
    """Send what :func:`pack_message` made (``OSError``: the other end is gone)."""
    if _RAW:
        _write_all(conn.fileno(), [memoryview(struct.pack("<Q", parts[0].nbytes)), *parts])
    else:
        for part in parts:
            conn.send_bytes(part)


def send_message(conn: Any, msg: Any) -> None:
    """Send ``msg`` over ``conn``, buffers out of band (nothing is sent if it does not pickle)."""
    send_parts(conn, pack_message(msg))


def recv_message(conn: Any) -> Any:
    """A message sent by :func:`send_message`, its arrays writable (``EOFError``: closed)."""
    if _RAW:
        length = bytearray(8)
        _read_all(conn.fileno(), [length])
        head = bytearray(int.from_bytes(length, "little"))
        _read_all(conn.fileno(), [head])
    else:
        head = conn.recv_bytes()
    (count,) = struct.unpack_from("<Q", head, len(head) - 8)
    sizes = struct.unpack_from(f"<{count}Q", head, len(head) - 8 * (count + 1))
    buffers = [bytearray(size) for size in sizes]
    if _RAW:
        _read_all(conn.fileno(), buffers)
    else:
        for buf in buffers:
            got = conn.recv_bytes_into(buf)
            if got != len(buf):
                raise pickle.UnpicklingError(f"a buffer of {got} bytes arrived where {len(buf)} were announced")
    return _Unpickler(io.BytesIO(head), buffers=buffers).load()


# On POSIX a message is written with one system call, not one framed message per part.
_RAW = hasattr(os, "writev") and sys.platform != "win32"
_IOV_MAX = 512  # buffers per system call: Linux and macOS take up to 1024


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    views = [buf for buf in buffers if buf.nbytes]
    while views:
        done = os.writev(fd, views[:_IOV_MAX])
        views = _advance(views, done)


def _read_all(fd: int, buffers: list[bytearray]) -> None:
    views = [memoryview(buf) for buf in buffers if buf]
    while views:
        done = os.readv(fd, views[:_IOV_MAX])
        if done == 0:
            raise EOFError("the connection was closed by the other end")
        views = _advance(views, done)


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``done`` bytes were written or read."""
    i = 0
    while i < len(views) and done >= views[i].nbytes:
        done -= views[i].nbytes
        i += 1
    rest = views[i:]
    if done:
        rest[0] = rest[0][done:]
    return rest
