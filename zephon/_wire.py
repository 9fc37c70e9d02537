"""Messages over a ``multiprocessing`` connection with their large buffers out of band.

A message is pickled with protocol 5: every contiguous buffer of at least
:data:`OUT_OF_BAND_MIN` bytes (numpy arrays, bytearrays) is left out of the pickle and sent as
a message of its own, straight from the object's memory. The receiver reads each one into a
fresh ``bytearray`` and rebuilds the arrays over it. Compared with one in-band pickle, the array
bytes are copied once fewer on each side: not into the pickle, and not out of it.

Wire format: the pickle followed by a trailer (the buffers' sizes, then their count, as
little-endian 64-bit integers; ``pickle.loads`` ignores bytes after the pickle), then each buffer.

Every array arrives writable and owns its memory (a buffer of its own, or a copy when small), as
with an in-band pickle: read-only arrays (memory-mapped token files) are sent from their memory
and rebuilt writable on the other side.
"""

from __future__ import annotations

import io
import pickle
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

#: Buffers smaller than this stay inside the pickle: a message of its own costs more than the copy.
OUT_OF_BAND_MIN = 4096
#: Array kinds sent from their memory: booleans and numbers (other dtypes pickle as numpy does).
_RAW_KINDS = "biufc"


def _rebuild_array(buf: Any, dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> np.ndarray:
    """The array over a received buffer: ``buf`` is a bytearray, bytes, or a read-only view of a bytearray."""
    if isinstance(buf, memoryview) and isinstance(buf.obj, bytearray):
        buf = buf.obj  # a read-only array's out-of-band buffer: the bytearray is this array's own
    array = np.frombuffer(buf, dtype)
    if not array.flags.writeable:
        array = array.copy()  # a small read-only array, sent in-band as bytes
    return array.reshape(shape, order="F" if fortran else "C")


def _reduce_array(array: np.ndarray) -> tuple:
    if array.dtype.kind not in _RAW_KINDS:
        return array.__reduce__()  # numpy's in-band copy, which always rebuilds a writable array
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)  # one copy here instead of one into the pickle
    fortran = not array.flags.c_contiguous
    return _rebuild_array, (pickle.PickleBuffer(array), array.dtype, array.shape, fortran)


class _Pickler(pickle.Pickler):
    """Protocol 5 with ``ForkingPickler``'s reducers, and arrays as buffers.

    ``ForkingPickler`` takes no ``buffer_callback``, so this pickler borrows its reducers: those of
    ``copyreg``, of ``multiprocessing`` (connections) and those libraries register (torch tensors).
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, 5, buffer_callback=self._keep)
        self.buffers: list[memoryview] = []
        self.dispatch_table = ForkingPickler(file).dispatch_table  # a fresh copy: nothing global changes
        self.dispatch_table[np.ndarray] = _reduce_array

    def _keep(self, buf: pickle.PickleBuffer) -> bool:
        """Whether ``buf`` stays in-band; an out-of-band one is kept to be sent after the pickle."""
        raw = buf.raw()
        if raw.nbytes < OUT_OF_BAND_MIN:
            return True
        self.buffers.append(raw)
        return False


def pack_message(msg: Any) -> list[memoryview]:
    """``msg`` (any picklable value) as the parts to send: the pickle with its trailer, then each buffer.

    The parts are views of the pickle and of the message's own arrays: they are only valid while
    those arrays are not changed.

    Raises:
        Exception: what pickling ``msg`` raises.
    """
    head = io.BytesIO()
    pickler = _Pickler(head)
    pickler.dump(msg)
    sizes = [buf.nbytes for buf in pickler.buffers]
    head.write(struct.pack(f"<{len(sizes) + 1}Q", *sizes, len(sizes)))
    return [head.getbuffer(), *pickler.buffers]


def send_message(conn: Any, msg: Any) -> None:
    """Send ``msg`` over ``conn``, its large buffers out of band (nothing is sent if it does not pickle).

    Raises:
        Exception: what pickling ``msg`` raises.
        OSError: the other end is gone.
    """
    for part in pack_message(msg):
        conn.send_bytes(part)


def recv_message(conn: Any) -> Any:
    """Receive a message sent by :func:`send_message`; its arrays are writable and own their memory.

    Raises:
        EOFError: the other end closed the connection, also in the middle of a message.
        Exception: what unpickling raises (a type that cannot be imported here, for one).
    """
    head = conn.recv_bytes()
    (count,) = struct.unpack_from("<Q", head, len(head) - 8)
    sizes = struct.unpack_from(f"<{count}Q", head, len(head) - 8 * (count + 1))
    buffers = []
    for size in sizes:
        buf = bytearray(size)
        got = conn.recv_bytes_into(buf)
        if got != size:
            raise pickle.UnpicklingError(f"a buffer of {got} bytes arrived where {size} were announced")
        buffers.append(buf)
    return pickle.loads(head, buffers=buffers)
