"""Records of a restored buffer, rebuilt on demand and in the background.

A checkpoint holds records by reference; restoring a large shuffle buffer eagerly means re-reading
and re-tokenizing every document behind it before the first output. :class:`LazyRows` instead
rebuilds them in a background thread (one per process, serving every restored buffer in turn), in
the order the buffer will emit them, while the lane runs: a record that is due before the thread
reached it is rebuilt right then (with the next few it will need, see ``along``). Each buffered
record carries a :class:`Deferred` payload until it leaves the buffer, when :func:`materialize`
swaps in the rebuilt record (:func:`materialize_all`: many at once, in one bulk call). Rebuilding
a record gives the same record whether it is done alone or in bulk, so the stream is exactly the
eager one.

This module imports nothing from zephon, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["Deferred", "DeferredChain", "DeferredOutput", "LazyLane", "LazyRows", "kick", "materialize", "materialize_all"]

#: A restored shuffle buffer, or a lane's restored undelivered outputs, holding at least this many
#: records is rebuilt lazily; smaller ones at once, so that a checkpoint whose data changed fails
#: at ``restore`` (a lazily rebuilt record fails when it is due, naming the change).
LAZY_MIN_RECORDS = 8

#: A lane's restored undelivered outputs holding at least this many records are all rebuilt
#: lazily, the next one included (below it, the next output is rebuilt at ``restore``).
LAZY_MIN_PENDING = 64

#: When a loader restores lanes, only what the lane due first needs for its next output is rebuilt
#: at ``restore`` (an undelivered output it holds, else its operator states); the rest (operator
#: states and undelivered outputs) is rebuilt in the background from the first output on, or when
#: the lane is first due (see :meth:`zephon.runtime.lanes.Plan.decode_lanes`).
LAZY_LANES = True

#: A restored shuffle record drawn before the background rebuilt it takes along this many of the
#: next draws in the same bulk call (an output draws several records).
DRAWN_ALONG = 7

_TODO, _BUSY, _DONE = 0, 1, 2
#: References rebuilt per bulk call by the background thread: the first calls are small, so that
#: the records due first are ready early, then they double up to ``CHUNK``.
FIRST_CHUNK = 4
CHUNK = 64


class LazyRows:
    """The records behind ``metas``, rebuilt by ``resolve`` in the background and on demand.

    Args:
        metas: the references, as decoded from a checkpoint.
        resolve: rebuilds a list of references into records (one bulk call).
        order: the indices of ``metas`` in the order they are needed first; the background thread
            follows it (any index it never yields is rebuilt at the end).
        check: whether each rebuilt record must carry the meta it was asked for (records; off
            for whole outputs such as batches, whose rebuild checks its records itself).
        along: a record rebuilt on demand takes along up to this many of the next waiting
            references in ``order``, in the same bulk call (a shuffle draws several records for
            one output; an encoder encodes a few documents a call far slower than many).

    State kept: per reference, whether it is waiting, being rebuilt or done, and its record (or the
    exception its rebuild raised, re-raised when the record is due). The process's rebuilder
    thread drops it once every reference is done.
    """

    def __init__(
        self,
        metas: Sequence[Any],
        resolve: Callable[[Sequence[Any]], list],
        order: Iterable[int],
        *,
        check: bool = True,
        along: int = 0,
    ):
        self._metas = list(metas)
        self._check = check
        self._along = along
        self._resolve = resolve
        self._values: list[Any] = [None] * len(self._metas)
        self._status = bytearray(len(self._metas))
        self._cond = threading.Condition()
        self._order: Iterator[int] = _guarded(iter(order))
        self._rest: Iterator[int] = iter(range(len(self._metas)))
        self._size = FIRST_CHUNK
        _REBUILDER.add(self)

    def __len__(self) -> int:
        return len(self._metas)

    def record(self, index: int) -> Any:
        """The rebuilt record at ``index``: done already, awaited, or rebuilt now in this thread."""
        with self._cond:
            while self._status[index] == _BUSY:
                self._cond.wait()
            claimed = self._status[index] == _TODO
            if claimed:
                self._status[index] = _BUSY
        if claimed:
            self._rebuild([index] + self._claim(self._order, self._along))
        value = self._values[index]
        if isinstance(value, BaseException):
            raise value
        return value

    def records(self, indices: Sequence[int]) -> list:
        """The rebuilt records at ``indices``: those still waiting rebuilt now in one bulk call."""
        todo = self._claim(iter(indices), len(indices))
        if todo:
            self._rebuild(todo)
        return [self.record(i) for i in indices]  # awaits those the background is rebuilding

    def done(self) -> bool:
        """Whether every record is rebuilt."""
        return all(s == _DONE for s in self._status)

    def _claim(self, indices: Iterator[int], size: int) -> list[int]:
        """Up to ``size`` waiting indices from ``indices``, marked busy."""
        out: list[int] = []
        if size <= 0:
            return out
        with self._cond:
            for i in indices:
                if self._status[i] == _TODO:
                    self._status[i] = _BUSY
                    out.append(i)
                    if len(out) == size:
                        break
        return out

    def _rebuild(self, indices: list[int]) -> None:
        metas = [self._metas[i] for i in indices]
        try:
            records = self._resolve(metas)
            if len(records) != len(metas):
                raise RuntimeError(f"rebuild returned {len(records)} records for {len(metas)} references")
            for meta, rec in zip(metas, records if self._check else ()):
                if rec.meta != meta:
                    raise RuntimeError(
                        f"checkpoint restore rebuilt a different record: expected {meta!r}, got {rec.meta!r}; "
                        "the data or a per-sample function changed since the checkpoint was taken"
                    )
            values: list[Any] = list(records)
        except BaseException as exc:  # kept, and raised when one of these records is due
            values = [exc] * len(indices)
        with self._cond:
            for i, v in zip(indices, values):
                self._values[i] = v
                self._status[i] = _DONE
            self._cond.notify_all()

    def rebuild_some(self) -> bool:
        """Rebuild the next few waiting records in need order (the rebuilder thread's turn); ``False`` once none wait."""
        chunk = self._claim(self._order, self._size) or self._claim(self._rest, self._size)
        if not chunk:
            return False
        self._rebuild(chunk)
        self._size = min(CHUNK, 2 * self._size)
        return True


class LazyLane:
    """A restored lane's operator states and undelivered outputs, rebuilt as one job.

    ``rebuild()`` returns ``(chain_state, pending_outputs)``; it runs once, in the background
    rebuilder thread or in the first thread that needs either part, whichever comes first. An
    error it raised is raised again to every caller (it names the lane and the field).

    State kept: the one-job :class:`LazyRows` holding the result or the error.
    """

    __slots__ = ("_rows",)

    def __init__(self, rebuild: Callable[[], tuple[Any, tuple]]):
        def run(_: Any) -> list:
            with no_gc():  # a lane's states can hold a large buffer (see no_gc)
                return [rebuild()]

        self._rows = LazyRows([None], run, [0], check=False)

    def chain(self) -> Any:
        return self._rows.record(0)[0]

    def record(self, index: int) -> Any:
        """The ``index``-th undelivered output (the :class:`DeferredOutput` protocol)."""
        out = self._rows.record(0)[1][index]
        return out.output() if type(out) is DeferredOutput else out


class _Rebuilder:
    """One background thread per process serving every :class:`LazyRows`, a chunk each in turn.

    One thread, not one per restored buffer: with many lanes, the lanes' first records get
    rebuilt first, round-robin, instead of every lane's whole buffer competing for the cores.
    It holds each buffer weakly: a buffer nothing else holds any more (a loader closed or
    restored again, lanes handed to worker processes) is no longer rebuilt.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[weakref.ref[LazyRows]] = deque()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, rows: LazyRows) -> None:
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's thread does not exist here
                self._queue, self._thread, self._pid = deque(), None, os.getpid()
            self._queue.append(weakref.ref(rows))

    def kick(self) -> None:
        """Start the thread if records wait and it is not running.

        Called once a lane has produced an output, so that the work of a restore (rebuilding each
        lane's next output) never waits behind the background's.
        """
        if not self._queue or (self._thread is not None and self._pid == os.getpid()):
            return
        with self._lock:
            if self._pid != os.getpid():
                self._queue, self._thread, self._pid = deque(), None, os.getpid()
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zephon-restore", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                ref = self._queue.popleft()
            rows = ref()
            if rows is None:  # dropped: nobody needs its records
                continue
            try:
                more = rows.rebuild_some()
            except BaseException:  # never stop serving the others
                more = False
            del rows  # while it waits in the queue, only the queue's weak reference holds it
            if more:
                with self._lock:
                    self._queue.append(ref)


_REBUILDER = _Rebuilder()


def kick() -> None:
    """Let the background rebuild of restored records start (see :meth:`_Rebuilder.kick`)."""
    _REBUILDER.kick()


def _guarded(order: Iterator[int]) -> Iterator[int]:
    """``order`` until it ends or fails (the background order is a hint; the rest follows in index order)."""
    try:
        yield from order
    except Exception:
        return


class Deferred:
    """The payload of a restored record until it is rebuilt: its place in a :class:`LazyRows`.

    Pickles as the rebuilt payload, so a state holding it travels like an eager one.
    """

    __slots__ = ("rows", "index")

    def __init__(self, rows: LazyRows, index: int):
        self.rows = rows
        self.index = index

    def value(self) -> Any:
        return self.rows.record(self.index).payload

    def __reduce__(self):
        return (_identity, (self.value(),))

    def __repr__(self) -> str:
        return f"Deferred({self.index})"


class DeferredOutput:
    """A lane output produced before a checkpoint and not delivered, until it is rebuilt.

    ``ref`` is its decoded reference (a meta, or a batch's list of metas), which a checkpoint
    stores again as is. Pickles as the rebuilt output.
    """

    __slots__ = ("rows", "index", "ref")

    def __init__(self, rows: LazyRows, index: int, ref: Any):
        self.rows = rows
        self.index = index
        self.ref = ref

    def output(self) -> Any:
        return self.rows.record(self.index)

    def __reduce__(self):
        return (_identity, (self.output(),))

    def __repr__(self) -> str:
        return f"DeferredOutput({self.index})"


class DeferredChain:
    """A restored lane's operator states until they are rebuilt (see :class:`LazyLane`).

    Pickles as the rebuilt states.
    """

    __slots__ = ("lane",)

    def __init__(self, lane: LazyLane):
        self.lane = lane

    def value(self) -> Any:
        return self.lane.chain()

    def __reduce__(self):
        return (_identity, (self.value(),))

    def __repr__(self) -> str:
        return "DeferredChain()"


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Run the block with the cyclic garbage collector paused, when called from the main thread.

    Decoding a restored state makes hundreds of thousands of small objects, none of them in a
    cycle; each collection they trigger walks every object of the process (a large checkpoint
    included): 0.1 s of a 0.25 s restore of 8 full 16,384-row shuffle buffers.

    The switch is process-wide, so only the main thread (the one that restores, and whose own
    code then runs with the collector off only inside this block) flips it. In any other thread
    (the background rebuilder, a prefetch thread) the block runs with the collector as it is:
    a background thread must never change what the rest of the process sees.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _identity(value: Any) -> Any:
    return value


def materialize(record: Any) -> Any:
    """``record`` with a :class:`Deferred` payload replaced by the rebuilt record (else itself)."""
    payload = record.payload
    if type(payload) is Deferred:
        return payload.rows.record(payload.index)
    return record


def materialize_all(records: Sequence[Any]) -> list:
    """:func:`materialize` of each record, rebuilding those still waiting in one bulk call per buffer."""
    out = list(records)
    waiting: dict[int, tuple[LazyRows, list[int]]] = {}
    for pos, rec in enumerate(out):
        payload = rec.payload
        if type(payload) is Deferred:
            waiting.setdefault(id(payload.rows), (payload.rows, []))[1].append(pos)
    for rows, positions in waiting.values():
        for pos, rec in zip(positions, rows.records([out[pos].payload.index for pos in positions])):
            out[pos] = rec
    return out
