"""A pipeline as a torch ``IterableDataset`` of training tensors, and the lane arithmetic of torch workers.

Item ``j`` of a rank's stream is lane ``j mod n``'s output ``j div n``, and a torch DataLoader asks
its ``W`` workers in turn, so each worker runs the lanes of one residue class mod ``W`` (the largest
divisor of ``n`` at most ``W`` run). At the end of finite data they agree through
:class:`WorkerSync` and stop where the pipeline's loader stops.
"""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Any, Iterator, Mapping

import attrs
import torch.utils.data

from ..ops.batch import Batch
from ..runtime.checkpoint import merge_checkpoints, select_lanes, validate
from ..runtime.loader import Loader
from ..runtime.skip_steps import SkippedSteps, check_count
from ..training.convert import training_spec

__all__ = ["TrainingDataset", "TrainingStream", "checkpoint_from_state", "position_problem", "whole_steps_problem"]

#: The key of zephon's checkpoint in an iterator's ``state_dict()``.
STATE_KEY = "zephon_checkpoint"


@attrs.frozen
class LaneShare:
    """The lanes one iterator runs: a rank's lanes, or one DataLoader worker's share of them."""

    canonical_replicas: int
    dp_degree: int
    dp_rank: int
    lanes: tuple[int, ...]


def stream_position(counts: Mapping[int, int]) -> int:
    """The position in a rank's stream of the first item after lanes that delivered ``counts``.

    After ``p`` items the first ``p mod n`` lanes delivered ``p div n + 1`` outputs and the others
    ``p div n``; other counts (a drained tail, other ranks' lanes) raise ``ValueError``.
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


def whole_steps_problem(accumulate: int, lanes: int, degree: int) -> str | None:
    """Why ``accumulate`` microbatches per rank and optimizer step are not whole global steps
    (one microbatch of every lane), which keeps optimizer steps the same rows for every ``degree``;
    ``None`` if they are."""
    if accumulate % lanes == 0:
        return None
    return (
        f"{accumulate} microbatch(es) per optimizer step are not whole zephon steps: each of the {degree} "
        f"data-parallel rank(s) owns {lanes} lane(s), and a global step takes one microbatch from every lane. "
        f"Accumulate {lanes} (or a multiple): then every optimizer step trains on the same rows whatever the number "
        "of devices"
    )


def skip_count(n: Any, what: str) -> int:
    """``n`` if it is a count of optimizer steps whose data a trainer skips, else a ``ValueError``
    starting with ``what`` (the argument as the caller names it)."""
    try:
        return check_count(n)
    except ValueError:
        raise ValueError(f"{what} must be an int >= 0 (optimizer steps whose data is skipped), got {n!r}") from None


def skip_optimizer_steps(loader: Any, n: int, accumulate: int, lanes: int, degree: int, who: str) -> SkippedSteps:
    """Skip on ``loader`` the data of ``n`` optimizer steps of ``accumulate`` microbatches per rank
    (``lanes`` of them per global step): ``n * accumulate / lanes`` global steps, which must be whole."""
    problem = whole_steps_problem(accumulate, lanes, degree)
    if problem:
        raise ValueError(f"{who}: skipping the data of {n} optimizer step(s) needs whole zephon steps per optimizer step: {problem}")
    return loader.skip_steps(n * accumulate // lanes)


def position_problem(checkpoint: Mapping[str, Any], lanes: tuple[int, ...], degree: int) -> str | None:
    """Why ``checkpoint``'s states of ``lanes`` are no position of this rank's stream (``None`` if they are one)."""
    counts = {lane: int(state["delivered"]) for lane, state in select_lanes(dict(checkpoint), lanes).items()}
    try:
        stream_position(counts)
    except ValueError:
        return (
            f"the checkpoint's lanes delivered {counts} microbatches, which is no position of this rank's stream over "
            f"{degree} data-parallel rank(s): it was saved in the middle of a global step on another number of "
            "devices. Resume it on the device count it was saved on, or save at whole global steps (accumulate a "
            "multiple of the rank's lanes per optimizer step)"
        )
    return None


def _counts(states: Mapping[int, Any], lanes: tuple[int, ...]) -> dict[int, int]:
    """Each lane's delivered outputs in encoded lane ``states``."""
    return {lane: int(states[lane]["delivered"]) for lane in lanes}


def _offset(states: Mapping[int, Any] | None, lanes: tuple[int, ...], workers: int) -> int:
    """The stream position of ``states`` mod ``workers``: worker ``w`` runs the class of position ``offset + w``."""
    return stream_position(_counts(states, lanes)) % workers if states is not None and workers > 1 else 0


def _active_workers(lanes: int, workers: int) -> int:
    """The most DataLoader workers, at most ``workers``, that divide ``lanes`` (each gets as many)."""
    return max(w for w in range(1, min(lanes, workers) + 1) if lanes % w == 0)


def _idle_warning(lanes: int, workers: int, active: int) -> str:
    return (
        f"DataLoader(num_workers={workers}) does not divide this rank's {lanes} lanes; {active} workers run them and "
        f"{workers - active} stay idle. Use num_workers in {[w for w in range(1, lanes + 1) if lanes % w == 0]}"
    )


def _in_worker(options: Any) -> Any:
    """Run options inside a DataLoader worker: a daemonic process cannot start zephon's, and workers are not ranks."""
    return options.evolve(workers=0, agree_on_end=False)


class TrainingDataset(torch.utils.data.IterableDataset):
    """This rank's training tensors from a pipeline, for ``DataLoader(ds, batch_size=None)``.

    Args:
        pipeline: a :class:`~zephon.Pipeline` ending in ``batch()``.
        stateful: ``True`` (default): iterators have ``state_dict()``/``load_state_dict()`` for
            ``StatefulDataLoader``; ``False``: plain iterators (resuming replays the data).
        checkpoint: where every iteration starts (holding this rank's lanes); ``None``: the
            beginning (``pipeline.to_torch_dataset()`` passes the pipeline's own).
        **to_training_options: the options of :func:`~zephon.to_training`, validated once.

    Each ``iter()`` starts a :class:`TrainingStream` at ``checkpoint`` (or the state a
    ``StatefulDataLoader`` loads into it). The plan is compiled once and travels to the workers.

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
        self.pipeline, self.stateful = pipeline, stateful
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
            options = _in_worker(options)
            workers, worker = _active_workers(len(lanes), info.num_workers), info.id
            if worker >= workers:
                if worker == workers:
                    message = _idle_warning(len(lanes), info.num_workers, workers)
                    warnings.warn(f"to_torch_dataset: {message}", RuntimeWarning, stacklevel=2)
                return iter(())  # an idle worker: the DataLoader drops it from its rotation
            if workers > 1:
                if self._sync is None:
                    raise RuntimeError(
                        "to_torch_dataset: this dataset reached a DataLoader worker without its shared end-of-data "
                        "block (it was pickled outside the start of a worker process); build the dataset in the "
                        "process that creates the DataLoader"
                    )
                cls = (worker + _offset(start, lanes, workers)) % workers
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

    Per seat (residue class ``c``, whose item ``m`` is item ``m * W + c`` of the stream) a shared
    array holds the iteration it serves, the items produced and whether its lanes ended. A worker
    hands item ``m`` over once every earlier item exists, and stops if one never will. The
    primitives come from the ``spawn`` context, so they reach forked and spawned workers alike.
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
            while (clear := self._clear_before(m)) is None:
                self.sync._cond.wait(timeout=1.0)  # woken by every publish; the timeout only bounds a lost wake-up
            return clear

    def _clear_before(self, m: int) -> bool | None:
        """Under the lock: ``True`` if the items before item ``m`` exist, ``False`` if one never will,
        ``None`` to wait. A seat of another iteration (a worker not started yet) has produced nothing."""
        slots, waiting = self.sync._slots, False
        for other in range(self.workers):
            if other == self.worker:
                continue
            iteration, produced, ended = slots[3 * other : 3 * other + 3]
            need = m + 1 if other < self.worker else m  # its items with a smaller index in the stream
            if iteration != self.iteration or produced < need:
                if iteration == self.iteration and ended:
                    return False
                waiting = True
        return None if waiting else True


_NEVER = object()  # the sentinel of a plain iterator (iter(callable, sentinel)) that ends by StopIteration


class TrainingStream(Iterator[dict]):
    """One iteration of a :class:`TrainingDataset`: this share's training tensors, and its state.

    The loader starts at the first ``next()`` (so ``load_state_dict()`` before it costs nothing)
    from ``start`` (a checkpoint holding the share's lanes; ``None``: the beginning).
    """

    def __init__(
        self, plan: Any, share: LaneShare, options: Any, spec: Any, *, seat: WorkerSeat | None = None, start: Any = None
    ):
        self.plan, self.share, self.options, self.spec = plan, share, options, spec
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
            self._publish()
        return self._loader

    def _publish(self) -> None:
        self._produced = sum(self._loader.delivered.values())
        if self._seat is not None:
            self._seat.publish(self._produced)

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
        if batch is not None:
            self._produced = m + 1
        self._seat.publish(self._produced, ended=batch is None)
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
            self._stopped = False
            self._publish()
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
                "saved with. Keep num_workers as saved, or use zephon.integrations.torch.DataLoader(pipeline, "
                "num_workers=W, ...) resumes on any number of workers, from its own state_dict() or from a "
                "StatefulDataLoader's (loader.load_state_dict(state))"
            )

    def close(self) -> None:
        """Stop the loader's worker thread or processes, if any."""
        if self._loader is not None:
            self._loader.close()


def checkpoint_from_state(state: Any) -> dict[str, Any]:
    """zephon's checkpoint inside a ``StatefulDataLoader.state_dict()`` (every worker's lanes,
    merged), which restores on any number of ranks and workers.

    Raises:
        ValueError: the state holds no zephon checkpoint.
    """

    def walk(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, Mapping) and isinstance(node.get(STATE_KEY), Mapping):
            yield dict(node[STATE_KEY])
        elif isinstance(node, (Mapping, list, tuple)):
            for value in node.values() if isinstance(node, Mapping) else node:
                yield from walk(value)

    found = list(walk(state))
    if not found:
        raise ValueError(
            f"no zephon checkpoint (key {STATE_KEY!r}) in this state; pass the state_dict() of a StatefulDataLoader "
            "over pipeline.to_torch_dataset(), after at least one iter()"
        )
    return merge_checkpoints(found)
