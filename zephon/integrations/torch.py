"""A pipeline as a ``torch.utils.data.IterableDataset`` of training tensors.

``pipeline.to_torch_dataset(**to_training_options)`` returns a :class:`TrainingDataset`. Each of
its iterators runs this rank's lanes and yields ``to_training(batch, **options)`` for every
microbatch, in the pipeline's order. Iterators are ``Stateful``: torchdata's
``StatefulDataLoader`` saves their ``state_dict()`` (which holds zephon's checkpoint of exactly
the batches yielded so far) and restores it, in the main process or in each worker.

**DataLoader workers.** ``DataLoader`` asks its ``W`` worker processes for items in turn (worker
0, 1, ..., W-1, 0, ...) and delivers them in that order. Item ``j`` of a rank's stream is lane
``j mod n``'s output ``j div n`` (``n`` lanes per rank), so giving worker ``w`` the lanes
``w, w + W, w + 2W, ...`` makes the delivered sequence exactly the pipeline's whenever ``W``
divides ``n``. Otherwise the largest divisor of ``n`` below ``W`` runs the lanes and the other
workers stay idle (they end at once, and the DataLoader skips them), as in Zephon 0.2.0. Where
finite data ends, the workers agree through a small block of shared memory: each publishes how
many items it has produced and whether its lanes ended, and an item is handed to the DataLoader
only once no item before it in the stream is missing, so every worker stops exactly where the
pipeline's own loader stops. In a worker the lanes run in that worker (``options(workers=...)``
applies with ``num_workers=0``).

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

import multiprocessing
import time
import warnings
from typing import Any, Iterator, Mapping

import attrs
import torch.utils.data

from .._batch import Batch
from .._checkpoint import merge_checkpoints, select_lanes, validate
from .._loader import Loader
from .._training import training_spec

__all__ = ["TrainingDataset", "TrainingStream", "checkpoint_from_state"]

#: The key of zephon's checkpoint in an iterator's ``state_dict()``.
STATE_KEY = "zephon_checkpoint"


@attrs.frozen
class LaneShare:
    """The lanes one iterator runs: a rank's lanes, or one DataLoader worker's share of them."""

    canonical_replicas: int
    dp_degree: int
    dp_rank: int
    lanes: tuple[int, ...]


class TrainingDataset(torch.utils.data.IterableDataset):
    """This rank's training tensors from a pipeline, for ``DataLoader(ds, batch_size=None)``.

    Args:
        pipeline: a :class:`~zephon.Pipeline` ending in ``batch()``.
        stateful: ``True`` (default): iterators have ``state_dict()``/``load_state_dict()`` for
            ``StatefulDataLoader``; ``False``: plain iterators (a ``StatefulDataLoader`` then
            fast-forwards on resume, replaying the data).
        **to_training_options: the options of :func:`~zephon.to_training` (``layout=``
            included), validated here, once.

    Each ``iter()`` starts a new :class:`TrainingStream` from the beginning of the data (or from
    the state a ``StatefulDataLoader`` loads into it). Batching belongs to the pipeline, so use
    ``batch_size=None``: a DataLoader batch size would stack several microbatches.

    Raises:
        ValueError: the pipeline does not end in ``batch()``; invalid ``to_training`` options.
        TypeError: an unknown ``to_training`` option.
    """

    def __init__(self, pipeline: Any, *, stateful: bool = True, **to_training_options: Any):
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
        self._topology: Any = None  # resolved in the main process when pickled for spawned workers
        self._sync: WorkerSync | None = WorkerSync()
        self._iterations = 0  # iter() calls on this copy (a persistent worker's epochs)

    def __getstate__(self) -> dict[str, Any]:
        # A spawned DataLoader worker has no torch.distributed of its own: resolve D and the rank here.
        state = dict(self.__dict__)
        if state["_topology"] is None:
            state["_topology"] = self.pipeline.topology()
        if multiprocessing.context.get_spawning_popen() is None:
            state["_sync"] = None  # shared memory travels only to worker processes being started
        return state

    def __iter__(self) -> Iterator[dict]:
        topology = self._topology if self._topology is not None else self.pipeline.topology()
        info = torch.utils.data.get_worker_info()
        options = self.pipeline.run_options
        lanes = tuple(topology.lanes)
        seat = None
        if info is not None:
            # Inside a DataLoader worker (a daemonic process, which cannot start zephon's own), run
            # the lanes here, and never enter a collective: workers are not ranks.
            options = options.evolve(workers=0, agree_on_end=False)
            workers, worker = _active_workers(len(lanes), info.num_workers), info.id
            if worker >= workers:
                if worker == workers:
                    warnings.warn(
                        f"to_torch_dataset: DataLoader(num_workers={info.num_workers}) does not divide this rank's "
                        f"{len(lanes)} lanes; {workers} workers run them and {info.num_workers - workers} stay idle. "
                        f"Use num_workers in {[w for w in range(1, len(lanes) + 1) if len(lanes) % w == 0]}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return iter(())  # an idle worker: the DataLoader drops it from its rotation
            if workers > 1:
                if self._sync is None:
                    raise RuntimeError(
                        "to_torch_dataset: this dataset reached a DataLoader worker without its shared end-of-data "
                        "block (it was pickled outside the start of a worker process); build the dataset in the "
                        "process that creates the DataLoader"
                    )
                lanes = lanes[worker::workers]
                # One iteration of one DataLoader: its workers share the base seed and epoch.
                iteration = ((info.seed - info.id) * 1_000_003 + self._iterations) & (2**62 - 1)
                seat = self._sync.join(iteration, worker, workers)
        self._iterations += 1
        share = LaneShare(topology.canonical_replicas, topology.dp_degree, topology.dp_rank, lanes)
        stream = TrainingStream(self.pipeline.plan, share, options, self.spec, seat=seat)
        return stream if self.stateful else iter(stream.__next__, _NEVER)


class WorkerSync:
    """Shared memory through which a DataLoader's workers stop together at the end of finite data.

    Per worker three slots, written by that worker only: the iteration it serves, the items it
    has produced, and whether its lanes ended. Worker ``w``'s item ``m`` is item ``m * W + w`` of
    the rank's stream; before handing it over, a worker waits until every item before it has been
    produced, and stops if one of them never will be (its worker ended first): exactly where the
    pipeline stops. No lock is needed (each slot has one writer, and counts only grow), so the
    block is plain shared memory, which travels to forked and spawned workers alike.
    """

    MAX_WORKERS = 256

    def __init__(self) -> None:
        self._slots = multiprocessing.RawArray("q", 3 * self.MAX_WORKERS)

    def join(self, iteration: int, worker: int, workers: int) -> "WorkerSeat":
        """Take ``worker``'s seat in ``iteration``: its counters restart, then its iteration is set."""
        if workers > self.MAX_WORKERS:
            raise ValueError(f"to_torch_dataset: at most {self.MAX_WORKERS} DataLoader workers, got {workers}")
        base = 3 * worker
        self._slots[base] = -1  # readers ignore the seat while its counters restart
        self._slots[base + 1] = 0
        self._slots[base + 2] = 0
        self._slots[base] = iteration
        return WorkerSeat(self, iteration, worker, workers)


class WorkerSeat:
    """One worker's view of a :class:`WorkerSync`: publish progress, wait for the items before its own."""

    def __init__(self, sync: WorkerSync, iteration: int, worker: int, workers: int):
        self.sync, self.iteration, self.worker, self.workers = sync, iteration, worker, workers

    def publish(self, produced: int, ended: bool = False) -> None:
        slots, base = self.sync._slots, 3 * self.worker
        if slots[base] != self.iteration:
            raise RuntimeError(
                "to_torch_dataset: two iterations of one dataset ran DataLoader workers at the same time; "
                "finish (or delete) one DataLoader iterator before starting the next"
            )
        slots[base + 1] = produced  # before the end flag: a reader that sees the flag sees this count
        slots[base + 2] = int(ended)

    def clear_before(self, m: int) -> bool:
        """Wait until every item before this worker's item ``m`` exists; ``False`` if one never will.

        Every worker is looked at in each pass: one that stopped early (after another's end) never
        produces more, so waiting on it alone would never return. A seat of another iteration (a
        worker not started yet) counts as nothing produced.
        """
        slots = self.sync._slots
        pause = 0.0
        while True:
            waiting = False
            for other in range(self.workers):
                if other == self.worker:
                    continue
                base = 3 * other
                need = m + 1 if other < self.worker else m  # its items with a smaller index in the stream
                # The seat's iteration around its counters (they restart when a worker joins), and the
                # flag before the count (a set flag means a final count).
                seat = slots[base]
                ended = slots[base + 2]
                produced = slots[base + 1]
                if seat != self.iteration or slots[base] != self.iteration:
                    waiting = True
                    continue
                if produced >= need:
                    continue
                if ended:
                    return False
                waiting = True
            if not waiting:
                return True
            time.sleep(pause)
            pause = min(0.001, pause + 0.0001)


def _active_workers(lanes: int, workers: int) -> int:
    """The most DataLoader workers, at most ``workers``, that divide ``lanes`` (each gets as many)."""
    return max(w for w in range(1, min(lanes, workers) + 1) if lanes % w == 0)


_NEVER = object()  # the sentinel of a plain iterator (iter(callable, sentinel)) that ends by StopIteration


class TrainingStream(Iterator[dict]):
    """One iteration of a :class:`TrainingDataset`: this share's training tensors, and its state.

    The loader starts at the first ``next()`` (so ``load_state_dict()`` before it costs nothing)
    and keeps the lane states; ``state_dict()`` is ``{"zephon_checkpoint": checkpoint}`` after
    the last batch yielded, ``load_state_dict()`` resumes exactly from one (of the same lanes).
    """

    def __init__(self, plan: Any, share: LaneShare, options: Any, spec: Any, *, seat: WorkerSeat | None = None):
        self.plan = plan
        self.share = share
        self.options = options
        self.spec = spec
        self._seat = seat
        self._produced = 0  # items this share has taken from its loader (its index in the rank's stream)
        self._stopped = False
        self._loader: Loader | None = None
        self._pending: dict[str, Any] | None = None

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
        if self._loader is not None:
            self._loader.restore(checkpoint)  # validates it
            self._produced, self._stopped = sum(self._loader.delivered.values()), False
            if self._seat is not None:
                self._seat.publish(self._produced)
        else:
            validate(self.plan.fingerprint(), checkpoint)
            select_lanes(checkpoint, self.share.lanes)  # fail now if lanes are missing
            self._pending = checkpoint

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
