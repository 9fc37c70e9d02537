"""A pipeline as torch data: an ``IterableDataset`` of training tensors, and a resumable ``DataLoader``.

``pipeline.to_torch_dataset(**to_training_options)`` returns a :class:`TrainingDataset`. Each of
its iterators runs this rank's lanes and yields ``to_training(batch, **options)`` for every
microbatch, in the pipeline's order, from the checkpoint the pipeline carries (``restore()``) or the
``checkpoint=`` given (else from the start). Iterators are ``Stateful``: torchdata's
``StatefulDataLoader`` saves their ``state_dict()`` (which holds zephon's checkpoint of exactly
the batches yielded so far) and restores it, in the main process or in each worker, with the
``num_workers`` it was saved with (torchdata's own rule).

:class:`DataLoader` (``zephon.integrations.torch.DataLoader(pipeline, num_workers=W, ...)``)
wraps ``torch.utils.data.DataLoader`` and keeps the state in the main process: every item a
worker sends carries its lane, the lane's count and the lane's state after it, so the loader
knows the state after exactly the items the caller received. Its ``state_dict()`` is zephon's
lane checkpoint, the same for any ``num_workers``, and it resumes on any ``num_workers``, from
its own state, a zephon checkpoint or a ``StatefulDataLoader`` state.

**DataLoader workers.** ``DataLoader`` asks its ``W`` worker processes for items in turn (worker
0, 1, ..., W-1, 0, ...) and delivers them in that order. Item ``j`` of a rank's stream is lane
``j mod n``'s output ``j div n`` (``n`` lanes per rank), so giving the workers the lanes of one
residue class mod ``W`` each (worker ``w`` the class of the position it is asked for first)
makes the delivered sequence exactly the pipeline's whenever ``W`` divides ``n``. Otherwise the
largest divisor of ``n`` below ``W`` runs the lanes and the other workers stay idle (they end at
once, and the DataLoader skips them), as in Zephon 0.2.0. Where finite data ends, the workers of
a plain DataLoader agree through a multiprocessing condition over a small shared array
(:class:`WorkerSync`): each publishes how many items it has produced and whether its lanes
ended, and an item is handed to the DataLoader only once no item before it in the stream is
missing, so every worker stops exactly where the pipeline's own loader stops. (:class:`DataLoader` needs no shared state: a worker whose lanes end sends an
end marker in its turn, and the main process stops there.) In a worker the lanes run in that
worker (``options(workers=...)`` applies with ``num_workers=0``).

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Any, Iterator, Mapping

import attrs
import torch.utils.data

from ..ops.batch import Batch
from ..runtime.checkpoint import (
    build,
    checkpoint_to_state_dict,
    merge_checkpoints,
    select_lanes,
    state_dict_to_checkpoint,
    validate,
)
from ..runtime.loader import Loader, out_lane, output_size
from ..training.convert import training_spec

__all__ = ["DataLoader", "TrainingDataset", "TrainingStream", "checkpoint_from_state"]

#: The key of zephon's checkpoint in an iterator's ``state_dict()``.
STATE_KEY = "zephon_checkpoint"

#: What zephon.integrations.torch.DataLoader does that a StatefulDataLoader cannot (for error messages).
_ANY_WORKERS = (
    "zephon.integrations.torch.DataLoader(pipeline, num_workers=W, ...) resumes on any number of workers, from "
    "its own state_dict() or from a StatefulDataLoader's (loader.load_state_dict(state))"
)


@attrs.frozen
class LaneShare:
    """The lanes one iterator runs: a rank's lanes, or one DataLoader worker's share of them."""

    canonical_replicas: int
    dp_degree: int
    dp_rank: int
    lanes: tuple[int, ...]


def stream_position(counts: Mapping[int, int]) -> int:
    """The position in a rank's stream of the first item after lanes that delivered ``counts``.

    Item ``j`` of the stream is lane ``j mod n``'s output ``j div n``, so after ``p`` items the
    first ``p mod n`` lanes (in lane order) delivered ``p div n + 1`` outputs and the others
    ``p div n``: the shape every checkpoint of a rank's loader has (a drained tail aside).

    Raises:
        ValueError: the counts have another shape (with the counts, and what to do).
    """
    lanes = sorted(counts)
    p = sum(counts.values())
    s, q = divmod(p, len(lanes))
    want = {lane: s + (1 if i < q else 0) for i, lane in enumerate(lanes)}
    if dict(counts) != want:
        raise ValueError(
            f"the checkpoint's lanes delivered {dict(sorted(counts.items()))} outputs, which is no position of this "
            f"rank's stream (after {p} items they would be {want}): it comes from a drained tail (drain=True) or from "
            "other ranks' lanes. Resume it with num_workers=0 (options(workers=N) runs the lanes in zephon's processes)"
        )
    return p


def _active_workers(lanes: int, workers: int) -> int:
    """The most DataLoader workers, at most ``workers``, that divide ``lanes`` (each gets as many)."""
    return max(w for w in range(1, min(lanes, workers) + 1) if lanes % w == 0)


def _worker_lanes(lanes: tuple[int, ...], start: Mapping[int, Any] | None, worker: int, workers: int) -> tuple[int, int]:
    """``(residue class, rotation)``: the lanes ``lanes[cls::workers]`` DataLoader worker ``worker`` runs.

    The DataLoader asks worker 0 first; the first item due is at position ``p`` of the stream
    (``p`` = the items before ``start``), so worker ``w`` runs the class of position ``p + w``.
    """
    offset = 0
    if start is not None and workers > 1:
        offset = stream_position({lane: int(start[lane]["delivered"]) for lane in lanes}) % workers
    return (worker + offset) % workers, offset


def _idle_warning(lanes: int, workers: int, active: int) -> str:
    return (
        f"DataLoader(num_workers={workers}) does not divide this rank's {lanes} lanes; {active} workers run them and "
        f"{workers - active} stay idle. Use num_workers in {[w for w in range(1, lanes + 1) if lanes % w == 0]}"
    )


class TrainingDataset(torch.utils.data.IterableDataset):
    """This rank's training tensors from a pipeline, for ``DataLoader(ds, batch_size=None)``.

    Args:
        pipeline: a :class:`~zephon.Pipeline` ending in ``batch()``.
        stateful: ``True`` (default): iterators have ``state_dict()``/``load_state_dict()`` for
            ``StatefulDataLoader``; ``False``: plain iterators (a ``StatefulDataLoader`` then
            fast-forwards on resume, replaying the data).
        checkpoint: where every iteration starts (a zephon checkpoint holding this rank's
            lanes); ``None``: the beginning of the data. ``pipeline.to_torch_dataset()`` passes
            the checkpoint the pipeline carries (``pipeline.restore(ck)``) here.
        **to_training_options: the options of :func:`~zephon.to_training` (``layout=``
            included), validated here, once.

    Each ``iter()`` starts a new :class:`TrainingStream` at ``checkpoint`` (or from the state a
    ``StatefulDataLoader`` loads into it). Batching belongs to the pipeline, so use
    ``batch_size=None``: a DataLoader batch size would stack several microbatches. The plan is
    compiled here, once (with the checkpoint's token calibration, if it has one), and travels
    to the workers.

    Raises:
        ValueError: the pipeline does not end in ``batch()``; invalid ``to_training`` options; a
            checkpoint of other data settings.
        TypeError: an unknown ``to_training`` option.
    """

    def __init__(self, pipeline: Any, *, stateful: bool = True, checkpoint: dict[str, Any] | None = None, **to_training_options: Any):
        super().__init__()
        if not isinstance(stateful, bool):
            raise TypeError(f"to_torch_dataset: stateful must be True or False, got {stateful!r}")
        steps = pipeline.operators
        if not steps or not isinstance(steps[-1][1], Batch):
            raise ValueError(
                "to_torch_dataset: the pipeline must end in batch(microbatch_size): every item of the dataset "
                "is one microbatch of training tensors (append .batch(8), for example)"
            )
        self.pipeline = pipeline
        self.stateful = stateful
        self.spec = training_spec(**to_training_options)
        self.plan = pipeline.compile(checkpoint)
        if checkpoint is not None:
            validate(self.plan.fingerprint(), checkpoint)
        self.checkpoint = checkpoint
        self._topology: Any = None  # resolved in the main process when pickled for spawned workers
        self._sync: WorkerSync | None = WorkerSync()
        self._iterations = 0  # iter() calls on this copy (a persistent worker's epochs)

    def topology(self) -> Any:
        """This rank's data-parallel degree, rank and lanes (resolved once, in the main process)."""
        if self._topology is None:
            self._topology = self.pipeline.topology()
        return self._topology

    def __getstate__(self) -> dict[str, Any]:
        # A spawned DataLoader worker has no torch.distributed of its own: resolve D and the rank here.
        state = dict(self.__dict__)
        state["_topology"] = self.topology()
        if multiprocessing.context.get_spawning_popen() is None:
            state["_sync"] = None  # its lock and array travel only to worker processes being started
        return state

    def __iter__(self) -> Iterator[dict]:
        topology = self.topology()
        info = torch.utils.data.get_worker_info()
        options = self.pipeline.run_options
        lanes = tuple(topology.lanes)
        start = select_lanes(self.checkpoint, lanes) if self.checkpoint is not None else None
        seat = None
        if info is not None:
            # Inside a DataLoader worker (a daemonic process, which cannot start zephon's own), run
            # the lanes here, and never enter a collective: workers are not ranks.
            options = options.evolve(workers=0, agree_on_end=False)
            workers, worker = _active_workers(len(lanes), info.num_workers), info.id
            if worker >= workers:
                if worker == workers:
                    warnings.warn(f"to_torch_dataset: {_idle_warning(len(lanes), info.num_workers, workers)}", RuntimeWarning, stacklevel=2)
                return iter(())  # an idle worker: the DataLoader drops it from its rotation
            if workers > 1:
                if self._sync is None:
                    raise RuntimeError(
                        "to_torch_dataset: this dataset reached a DataLoader worker without its shared end-of-data "
                        "block (it was pickled outside the start of a worker process); build the dataset in the "
                        "process that creates the DataLoader"
                    )
                cls, _ = _worker_lanes(lanes, start, worker, workers)
                lanes = lanes[cls::workers]
                # One iteration of one DataLoader: its workers share the base seed and epoch.
                iteration = ((info.seed - info.id) * 1_000_003 + self._iterations) & (2**62 - 1)
                seat = self._sync.join(iteration, cls, workers)
        self._iterations += 1
        share = LaneShare(topology.canonical_replicas, topology.dp_degree, topology.dp_rank, lanes)
        stream = TrainingStream(self.plan, share, options, self.spec, seat=seat, start=self.checkpoint)
        return stream if self.stateful else iter(stream.__next__, _NEVER)


class WorkerSync:
    """How a DataLoader's workers stop together at the end of finite data: a multiprocessing condition.

    Per seat three integers, in a shared array that the condition's lock guards: the iteration the
    seat serves, the items its worker has produced, and whether its lanes ended. The seat ``c`` is
    the worker running the lanes of residue class ``c`` (mod ``W``); its item ``m`` (counting its
    lanes' outputs from the start of the data) is item ``m * W + c`` of the rank's stream. A worker
    publishes its progress under the lock and wakes the others; before handing item ``m`` over it
    waits on the condition until every item before it has been produced, and stops if one of them
    never will be (its worker ended first): exactly where the pipeline stops. The primitives come
    from the ``spawn`` context, so they reach forked and spawned DataLoader workers alike (they
    travel only with a worker being started).
    """

    MAX_WORKERS = 256

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._cond = ctx.Condition()
        self._slots = ctx.Array("q", 3 * self.MAX_WORKERS, lock=False)  # guarded by _cond

    def join(self, iteration: int, worker: int, workers: int) -> "WorkerSeat":
        """Take seat ``worker`` (a residue class) in ``iteration``, its counters at zero."""
        if workers > self.MAX_WORKERS:
            raise ValueError(f"to_torch_dataset: at most {self.MAX_WORKERS} DataLoader workers, got {workers}")
        with self._cond:
            self._slots[3 * worker : 3 * worker + 3] = [iteration, 0, 0]
            self._cond.notify_all()
        return WorkerSeat(self, iteration, worker, workers)


class WorkerSeat:
    """One worker's view of a :class:`WorkerSync`: publish progress, wait for the items before its own."""

    def __init__(self, sync: WorkerSync, iteration: int, worker: int, workers: int):
        self.sync, self.iteration, self.worker, self.workers = sync, iteration, worker, workers

    def publish(self, produced: int, ended: bool = False) -> None:
        slots, base = self.sync._slots, 3 * self.worker
        with self.sync._cond:
            if slots[base] != self.iteration:
                raise RuntimeError(
                    "to_torch_dataset: two iterations of one dataset ran DataLoader workers at the same time; "
                    "finish (or delete) one DataLoader iterator before starting the next"
                )
            slots[base + 1 : base + 3] = [produced, int(ended)]
            self.sync._cond.notify_all()

    def clear_before(self, m: int) -> bool:
        """Wait until every item before this worker's item ``m`` exists; ``False`` if one never will."""
        with self.sync._cond:
            while True:
                clear = self._clear_before(m)
                if clear is not None:
                    return clear
                self.sync._cond.wait(timeout=1.0)  # woken by every publish; the timeout only bounds a lost wake-up

    def _clear_before(self, m: int) -> bool | None:
        """Under the lock: ``True`` if the items before item ``m`` exist, ``False`` if one never will,
        ``None`` to wait. A seat of another iteration (a worker not started yet) has produced nothing."""
        slots, waiting = self.sync._slots, False
        for other in range(self.workers):
            if other == self.worker:
                continue
            base = 3 * other
            need = m + 1 if other < self.worker else m  # its items with a smaller index in the stream
            if slots[base] != self.iteration:
                waiting = True
            elif slots[base + 1] < need:
                if slots[base + 2]:
                    return False
                waiting = True
        return None if waiting else True


_NEVER = object()  # the sentinel of a plain iterator (iter(callable, sentinel)) that ends by StopIteration


class TrainingStream(Iterator[dict]):
    """One iteration of a :class:`TrainingDataset`: this share's training tensors, and its state.

    The loader starts at the first ``next()`` (so ``load_state_dict()`` before it costs nothing)
    from ``start`` (a checkpoint holding the share's lanes; ``None``: the beginning) and keeps
    the lane states; ``state_dict()`` is ``{"zephon_checkpoint": checkpoint}`` after the last
    batch yielded, ``load_state_dict()`` resumes exactly from one (of the same lanes).
    """

    def __init__(
        self, plan: Any, share: LaneShare, options: Any, spec: Any, *, seat: WorkerSeat | None = None, start: dict[str, Any] | None = None
    ):
        self.plan = plan
        self.share = share
        self.options = options
        self.spec = spec
        self._seat = seat
        self._produced = 0  # items this share has taken from its loader (its index in the rank's stream)
        self._stopped = False
        self._loader: Loader | None = None
        self._pending: dict[str, Any] | None = start

    @property
    def loader(self) -> Loader:
        """The running :class:`~zephon.Loader` (started on first use)."""
        if self._loader is None:
            encoded = select_lanes(self._pending, self.share.lanes) if self._pending is not None else None
            self._loader = Loader(self.plan, self.share, self.options, encoded)
            self._pending = None
            self._produced = sum(self._loader.delivered.values())
            if self._seat is not None:
                self._seat.publish(self._produced)
        return self._loader

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._stopped:
            raise StopIteration
        loader = self.loader
        if self._seat is None:
            return self.spec(next(loader))
        m = self._produced
        batch = next(loader, None)
        if batch is None:
            self._seat.publish(m, ended=True)
        else:
            self._produced = m + 1
            self._seat.publish(m + 1)
        if batch is None or not self._seat.clear_before(m):
            self._stopped = True  # the rank's stream ends before this worker's item m
            raise StopIteration
        return self.spec(batch)

    def state_dict(self) -> dict[str, Any]:
        """``{"zephon_checkpoint": ...}``: the lanes' states after the last batch yielded."""
        return {STATE_KEY: self.loader.checkpoint()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume exactly after the last batch yielded before :meth:`state_dict`."""
        if not isinstance(state_dict, Mapping) or STATE_KEY not in state_dict:
            raise ValueError(
                f"load_state_dict: expected the mapping state_dict() returned, with key {STATE_KEY!r}; got "
                f"{type(state_dict).__name__} {sorted(state_dict)[:5] if isinstance(state_dict, Mapping) else ''}"
            )
        checkpoint = state_dict[STATE_KEY]
        self._check_lanes(checkpoint)
        if self._loader is not None:
            self._loader.restore(checkpoint)  # validates it
            self._produced, self._stopped = sum(self._loader.delivered.values()), False
            if self._seat is not None:
                self._seat.publish(self._produced)
        else:
            validate(self.plan.fingerprint(), checkpoint)
            self._pending = checkpoint

    def _check_lanes(self, checkpoint: Any) -> None:
        """Fail now, saying why, if the state lacks lanes this iterator runs (another num_workers)."""
        have = checkpoint.get("lanes") if isinstance(checkpoint, Mapping) else None
        if not isinstance(have, Mapping):
            return  # not a checkpoint at all: validate() names what is wrong
        missing = [lane for lane in self.share.lanes if str(lane) not in have]
        if missing:
            raise ValueError(
                f"load_state_dict: this state holds lanes {sorted(int(k) for k in have)}, but this iterator runs lanes "
                f"{list(self.share.lanes)} (missing {missing}): it was saved by a StatefulDataLoader with another "
                f"num_workers (or on another rank), and torchdata resumes a state only with the num_workers it was "
                f"saved with. Keep num_workers as saved, or use {_ANY_WORKERS}"
            )

    def close(self) -> None:
        """Stop the loader's worker thread or processes, if any."""
        if self._loader is not None:
            self._loader.close()


def checkpoint_from_state(state: Any) -> dict[str, Any]:
    """zephon's checkpoint inside a ``StatefulDataLoader.state_dict()`` (every worker's lanes, merged).

    The result restores with ``pipeline.loader(checkpoint)``, ``zephon.save_checkpoint`` and the
    rest of zephon's checkpoint tools, on any number of ranks and workers.

    Raises:
        ValueError: the state holds no zephon checkpoint.
    """
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if STATE_KEY in node and isinstance(node[STATE_KEY], Mapping):
                found.append(dict(node[STATE_KEY]))
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(state)
    if not found:
        raise ValueError(
            f"no zephon checkpoint (key {STATE_KEY!r}) in this state; pass the state_dict() of a StatefulDataLoader "
            "over pipeline.to_torch_dataset(), after at least one iter()"
        )
    return merge_checkpoints(found)


# -- zephon's DataLoader: the state in the main process -------------------------------------------------


@attrs.frozen
class Delivery:
    """One item a :class:`DataLoader` worker sends: a microbatch's tensors and where it leaves its lane.

    ``delivered``: the lane's outputs delivered up to and including this one; ``state``: the
    lane's encoded state after it (``None`` from the main process, whose loader is asked
    instead); ``size``: its ``(records, tokens)``, counted if it is never delivered.
    """

    lane: int
    delivered: int
    state: dict[str, Any] | None
    size: tuple[int, int]
    tensors: Any

    def pin_memory(self) -> "Delivery":
        """The same delivery with its tensors in pinned memory (the DataLoader's ``pin_memory=True``)."""
        return attrs.evolve(self, tensors=_pinned(self.tensors))


@attrs.frozen
class EndOfData:
    """A worker's last item: its lane ``lane`` has no output number ``delivered`` (0-based), so the stream ends there.

    ``undelivered``: ``(outputs, records, tokens)`` its lanes produced and never delivered.
    """

    lane: int
    delivered: int
    undelivered: tuple[int, int, int]


def _pinned(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, Mapping):
        return {k: _pinned(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_pinned(v) for v in data)
    return data


def _convert(item: Any) -> Any:
    """The DataLoader's ``collate_fn``: the tensors converted as ``batch_size=None`` converts an item."""
    return attrs.evolve(item, tensors=torch.utils.data.default_convert(item.tensors)) if isinstance(item, Delivery) else item


class LaneDataset(torch.utils.data.IterableDataset):
    """What a :class:`DataLoader` hands its torch DataLoader: this rank's lanes from ``start``, as deliveries.

    In a worker (``workers`` of them run, ``offset`` = the start position mod ``workers``), the
    lanes of the residue class of position ``start + worker``; in the main process, all of them,
    with the pipeline's own run options (``workers=N`` runs them in zephon's processes). The
    in-process loader is kept in ``local`` so the main process can read its checkpoint.
    """

    def __init__(self, plan: Any, share: LaneShare, options: Any, spec: Any, start: dict[int, Any], workers: int, offset: int):
        super().__init__()
        self.plan, self.share, self.options, self.spec = plan, share, options, spec
        self.start, self.workers, self.offset = start, workers, offset
        self.local: Loader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "local": None}

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        lanes, options = self.share.lanes, self.options
        if info is not None:
            options = options.evolve(workers=0, agree_on_end=False)  # workers are not ranks
            lanes = lanes[(info.id + self.offset) % self.workers :: self.workers]
        share = attrs.evolve(self.share, lanes=lanes)
        loader = Loader(self.plan, share, options, {lane: self.start[lane] for lane in lanes})
        if info is None:
            self.local = loader
        return _deliveries(loader, self.spec, with_states=info is not None)


def _deliveries(loader: Loader, spec: Any, *, with_states: bool) -> Iterator[Any]:
    """Each output of ``loader`` as a :class:`Delivery`, then one :class:`EndOfData` if the data ends.

    In a worker the loader's own end-of-data warning is left out: the main process warns once,
    for every worker's undelivered tail.
    """
    try:
        while True:
            if with_states:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "end of data", RuntimeWarning)
                    out = next(loader, None)
            else:
                out = next(loader, None)
            if out is None:
                break
            lane = out_lane(out)
            state = loader.lane_state(lane) if with_states else None
            yield Delivery(lane, loader.delivered[lane], state, output_size(out), spec(out))
        lane = next(iter(loader.ended), None)
        if with_states and lane is not None:  # in the main process the stream simply ends (its loader warns)
            u = loader.stats()["undelivered"]
            yield EndOfData(lane, loader.ended[lane], (u["outputs"], u["records"], u["tokens"]))
    finally:
        if with_states:
            loader.close()


#: torch DataLoader settings this loader fixes, and why.
_OWNED = {
    "batch_size": "batching belongs to the pipeline (batch(microbatch_size)); each item is one microbatch",
    "shuffle": "the order is the pipeline's (add .shuffle(buffer_size) to it)",
    "sampler": "the order is the pipeline's",
    "batch_sampler": "batching belongs to the pipeline",
    "drop_last": "the pipeline's batch(drop_last=...) decides",
    "collate_fn": "items are the pipeline's microbatches as to_training tensors (pass to_training options instead)",
    "persistent_workers": "every iter() starts its workers at the loader's state",
    "in_order": "the stream's order is the pipeline's",
}


class DataLoader:
    """A ``torch.utils.data.DataLoader`` over a pipeline whose state does not depend on ``num_workers``.

    Iterating yields this rank's microbatches as ``to_training`` tensors, exactly the pipeline's
    stream, with ``num_workers`` worker processes (the largest divisor of the rank's lanes at
    most ``num_workers`` run; the others would stay idle) or in this process (``0``; then
    ``options(workers=N)`` runs the lanes in zephon's own processes). Every item a worker sends
    carries its lane, the lane's count and the lane's encoded state after it (one lane's
    encoding per item: less than ``StatefulDataLoader``'s default snapshot of all a worker's
    lanes per item); the loader keeps, per lane, the state of the last item the caller
    received. So :meth:`state_dict` is zephon's lane checkpoint after exactly the items
    delivered, mid-step included, and :meth:`load_state_dict` resumes it on any number of
    workers, ranks dividing the lanes, or with ``pipeline.loader(checkpoint)``.

    Args:
        data: a :class:`~zephon.Pipeline` ending in ``batch()`` (the checkpoint it carries,
            ``pipeline.restore(ck)``, is the start), or a :class:`TrainingDataset` from ``pipeline.to_torch_dataset()``.
        num_workers: DataLoader worker processes.
        checkpoint: where to start (a zephon checkpoint, this loader's ``state_dict()``, or a
            ``StatefulDataLoader`` state); ``None``: the dataset's start.
        pin_memory, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor, pin_memory_device: as for ``torch.utils.data.DataLoader``.
        **to_training_options: the options of :func:`~zephon.to_training`, with a pipeline.

    State kept: per lane, the encoded state after its last delivered output; whether the last
    iteration reached the end of the data. Each ``iter()`` continues from that state (replacing
    an earlier iterator, which then raises); after the end of the data the next ``iter()``
    starts a new pass from the beginning, as a torch epoch does. There is no ``len()``: the
    number of microbatches is known only by running the data.

    Raises:
        ValueError: a torch setting the pipeline owns (``batch_size``, ``shuffle``, ...);
            ``drain=True`` with workers (a drained tail is not in the rotation's order); a
            checkpoint of other data settings.
        TypeError: an unknown ``to_training`` option.
    """

    def __init__(
        self,
        data: Any,
        *,
        num_workers: int = 0,
        checkpoint: Any = None,
        pin_memory: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        prefetch_factor: int | None = None,
        pin_memory_device: str = "",
        **to_training_options: Any,
    ):
        owned = [k for k in to_training_options if k in _OWNED]
        if owned:
            raise ValueError(f"zephon.integrations.torch.DataLoader sets {owned[0]} itself: {_OWNED[owned[0]]}")
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"DataLoader: num_workers must be an int >= 0, got {num_workers!r}")
        if isinstance(data, TrainingDataset):
            if to_training_options:
                raise TypeError(
                    f"DataLoader: to_training options {sorted(to_training_options)} go to pipeline.to_torch_dataset(), "
                    "not next to a dataset it made"
                )
            dataset = data
        else:
            dataset = data.to_torch_dataset(**to_training_options)
        self.dataset = dataset
        self.plan, self.spec = dataset.plan, dataset.spec
        self.options = dataset.pipeline.run_options
        topo = dataset.topology()
        self.share = LaneShare(topo.canonical_replicas, topo.dp_degree, topo.dp_rank, tuple(topo.lanes))
        lanes = len(self.share.lanes)
        self.num_workers = num_workers
        self.workers = _active_workers(lanes, num_workers) if num_workers else 0
        if self.options.drain and num_workers:
            raise ValueError(
                "DataLoader: options(drain=True) runs with num_workers=0 only (the drained tail of a lane that ended "
                "is not in the order the workers' rotation delivers); options(workers=N) runs the lanes in zephon's processes"
            )
        if 0 < self.workers < num_workers:
            warnings.warn(f"DataLoader: {_idle_warning(lanes, num_workers, self.workers)}", RuntimeWarning, stacklevel=2)
        self._torch_options = dict(
            pin_memory=pin_memory, timeout=timeout, worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor, pin_memory_device=pin_memory_device,
        )
        self._beginning: dict[int, Any] | None = None
        self._current: _Iteration | None = None
        self._finished = False
        start = dataset.checkpoint if checkpoint is None else _as_checkpoint(checkpoint)
        self._states = self._lanes_of(start) if start is not None else self.beginning()

    # -- state ----------------------------------------------------------------------------------------
    def beginning(self) -> dict[int, Any]:
        """This rank's lane states at the beginning of the data (encoded, sealed)."""
        if self._beginning is None:
            plan = self.plan
            self._beginning = {int(k): v for k, v in build(plan.fingerprint(), {lane: plan.encode(plan.init(lane)) for lane in self.share.lanes})["lanes"].items()}
        return dict(self._beginning)

    def _lanes_of(self, checkpoint: dict[str, Any]) -> dict[int, Any]:
        validate(self.plan.fingerprint(), checkpoint)
        return select_lanes(checkpoint, self.share.lanes)

    def checkpoint(self) -> dict[str, Any]:
        """This rank's lane states after the last item delivered: a zephon checkpoint (JSON/msgpack-safe)."""
        if self._current is not None:
            self._current.sync()
        return build(self.plan.fingerprint(), self._states)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint as a DCP-friendly mapping (``{"zephon_fingerprint": ..., "lane_00003": ...}``), as ``Loader.state_dict()``."""
        return checkpoint_to_state_dict(self.checkpoint())

    def load_state_dict(self, state: Any) -> None:
        """Resume exactly after the last item delivered before ``state`` was taken, on any ``num_workers``.

        ``state``: this loader's :meth:`state_dict`, a zephon checkpoint, or a torchdata
        ``StatefulDataLoader.state_dict()`` over ``pipeline.to_torch_dataset()`` (its workers'
        lanes merged). A running iterator is closed; the next ``iter()`` starts at ``state``.

        Raises:
            ValueError: no zephon checkpoint in ``state``; other data settings; missing lanes.
        """
        states = self._lanes_of(_as_checkpoint(state))
        self.close()
        self._states, self._finished = states, False

    # -- iteration ------------------------------------------------------------------------------------
    def __iter__(self) -> "_Iteration":
        self.close()
        if self._finished:
            self._states, self._finished = self.beginning(), False
        self._current = _Iteration(self)
        return self._current

    def close(self) -> None:
        """Stop the running iteration's workers (or in-process loader), keeping the state."""
        if self._current is not None:
            current, self._current = self._current, None
            current.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Iteration(Iterator[Any]):
    """One ``iter()`` of a :class:`DataLoader`: a torch DataLoader from the owner's state; updates that state."""

    def __init__(self, owner: DataLoader):
        self.owner = owner
        start = dict(owner._states)
        self.counts = {lane: int(start[lane]["delivered"]) for lane in owner.share.lanes}
        workers = owner.workers
        offset = stream_position(self.counts) % workers if workers > 1 else 0
        self.dataset = LaneDataset(owner.plan, owner.share, owner.options, owner.spec, start, max(workers, 1), offset)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=None, num_workers=workers, collate_fn=_convert, **owner._torch_options
        )
        self.torch_iter: Any = iter(loader)
        self.closed = False

    def expected(self) -> tuple[int, int]:
        """The lane whose output comes next, and that output's number (0-based): as the pipeline's loader orders them."""
        lane = min(self.counts, key=lambda lane: (self.counts[lane], lane))
        return lane, self.counts[lane]

    def __iter__(self) -> "_Iteration":
        return self

    def __next__(self) -> Any:
        if self.closed:
            if self.owner._current is not self and not self.owner._finished:
                raise RuntimeError(
                    "DataLoader: this iterator was replaced by a newer iter() (or load_state_dict/close) of its loader, "
                    "which continues from the items this one delivered; iterate that one"
                )
            raise StopIteration
        try:
            item = next(self.torch_iter)
        except StopIteration:
            if not self.owner.workers:  # in this process: the pipeline's own loader ended (and warned)
                self._end(None)
                raise
            self.close()
            raise RuntimeError(
                f"DataLoader: the workers ended without reaching the end of the data (the next item was lane "
                f"{self.expected()[0]}'s); a worker_init_fn or worker must not end the dataset's iteration"
            ) from None
        lane, number = self.expected()
        if isinstance(item, EndOfData):
            if (item.lane, item.delivered) != (lane, number):
                self._out_of_order(f"the end of lane {item.lane} at its output {item.delivered}", lane, number)
            self._end(item)
            raise StopIteration
        if (item.lane, item.delivered) != (lane, number + 1):
            self._out_of_order(f"lane {item.lane}'s output {item.delivered - 1}", lane, number)
        self.counts[lane] = item.delivered
        if item.state is not None:
            self.owner._states[lane] = item.state
        return item.tensors

    def _out_of_order(self, got: str, lane: int, number: int) -> None:
        self.close()
        raise RuntimeError(
            f"DataLoader: received {got} where lane {lane}'s output {number} was due; the workers' items are not in the "
            "pipeline's order (a torch DataLoader with in_order=False, or a changed dataset). The state is kept at the "
            "last item delivered: load_state_dict(state_dict()) continues from there"
        )

    def _end(self, first: EndOfData | None) -> None:
        """End of data: count what the other workers produced after it (received, never delivered), warn once."""
        outputs, records, tokens = first.undelivered if first is not None else (0, 0, 0)
        if first is not None:
            for item in self.torch_iter:
                if isinstance(item, EndOfData):
                    outputs, records, tokens = outputs + item.undelivered[0], records + item.undelivered[1], tokens + item.undelivered[2]
                else:
                    outputs, records, tokens = outputs + 1, records + item.size[0], tokens + item.size[1]
        self.close()
        self.owner._finished = True
        if outputs and first is not None:  # in this process the pipeline's own loader has warned
            warnings.warn(
                f"end of data: {outputs} output(s) ({records} records, {tokens} tokens) were produced by the DataLoader's "
                "workers but not delivered, because iteration stops at the first incomplete global step (a step takes one "
                f"output from every lane; here lane {first.lane} had no output {first.delivered}). Use an endless source "
                "(exhausted_policy='repeat') with a fixed step count, lower canonical_replicas, or num_workers=0 with "
                "options(drain=True) to receive the rest",
                RuntimeWarning,
                stacklevel=3,
            )

    def sync(self) -> None:
        """Copy the in-process loader's states (the items delivered so far) into the owner's state."""
        local = self.dataset.local
        if local is not None and not self.closed:
            ck = local.checkpoint()
            self.owner._states.update({int(k): v for k, v in ck["lanes"].items()})

    def close(self) -> None:
        if self.closed:
            return
        self.sync()
        self.closed = True
        self.torch_iter = None  # a torch iterator shuts its workers down when released
        if self.dataset.local is not None:
            self.dataset.local.close()


def _as_checkpoint(state: Any) -> dict[str, Any]:
    """A zephon checkpoint from a checkpoint, a ``state_dict()`` mapping or a ``StatefulDataLoader`` state."""
    if isinstance(state, Mapping) and "lanes" in state and "fingerprint" in state:
        return dict(state)
    if isinstance(state, Mapping) and "zephon_fingerprint" in state:
        return state_dict_to_checkpoint(dict(state))
    return checkpoint_from_state(state)
