"""A pipeline as torch data: :class:`TrainingDataset` (``pipeline.to_torch_dataset()``) and
:class:`DataLoader`, a torch ``DataLoader`` whose lane checkpoint, kept in the main process, resumes
on any ``num_workers``; :func:`document_block_mask` keeps attention within documents.

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Mapping

import attrs
import torch.utils.data

from ..runtime.checkpoint import build, checkpoint_to_state_dict, select_lanes, state_dict_to_checkpoint, validate
from ..runtime.loader import Loader, out_lane, output_size
from ..runtime.skip_steps import SkippedSteps, check_count
from .attention import document_block_mask as document_block_mask
from .attention import document_ids as document_ids
from .attention import varlen_boundaries as varlen_boundaries
from .torch_dataset import LaneShare, _active_workers, _counts, _idle_warning, _in_worker, _offset
from .torch_dataset import TrainingDataset as TrainingDataset
from .torch_dataset import TrainingStream as TrainingStream
from .torch_dataset import checkpoint_from_state as checkpoint_from_state

__all__ = [
    "DataLoader", "TrainingDataset", "TrainingStream", "checkpoint_from_state", "document_block_mask", "document_ids",
    "varlen_boundaries",
]


@attrs.frozen
class Delivery:
    """One item a :class:`DataLoader` worker sends: a microbatch's tensors, the lane's outputs
    delivered with it, the lane's encoded state after it (``None`` from the main process, whose
    loader is asked instead) and its ``(records, tokens)``, counted if it is never delivered."""

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
    """A worker's last item: lane ``lane`` has no output number ``delivered`` (0-based), so the
    stream ends; ``undelivered``: ``(outputs, records, tokens)`` produced and never delivered."""

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
    if isinstance(item, Delivery):
        return attrs.evolve(item, tensors=torch.utils.data.default_convert(item.tensors))
    return item


class LaneDataset(torch.utils.data.IterableDataset):
    """What a :class:`DataLoader` hands its torch DataLoader: this rank's lanes from ``start``, as deliveries.

    A worker runs the lanes of the residue class of position ``offset + worker`` (mod ``workers``);
    the main process runs all of them, keeping its loader in ``local`` for its checkpoint.
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
            options = _in_worker(options)
            lanes = lanes[(info.id + self.offset) % self.workers :: self.workers]
        share = attrs.evolve(self.share, lanes=lanes)
        loader = Loader(self.plan, share, options, {lane: self.start[lane] for lane in lanes})
        if info is None:
            self.local = loader
        return _deliveries(loader, self.spec, with_states=info is not None)


def _deliveries(loader: Loader, spec: Any, *, with_states: bool) -> Iterator[Any]:
    """Each output of ``loader`` as a :class:`Delivery`, then, in a worker, one :class:`EndOfData`
    if the data ends (there the loader's end-of-data warning is left out: the main process warns
    once, for every worker's undelivered tail)."""
    try:
        while True:
            with warnings.catch_warnings() if with_states else contextlib.nullcontext():
                if with_states:
                    warnings.filterwarnings("ignore", "end of data", RuntimeWarning)
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
    stream, from worker processes (the largest divisor of the rank's lanes at most ``num_workers``
    run) or in this process. :meth:`state_dict` is the lane checkpoint after exactly the items
    delivered; it resumes on any number of workers or ranks dividing the lanes.

    Args:
        data: a :class:`~zephon.Pipeline` ending in ``batch()`` (starting at the checkpoint it
            carries), or a :class:`TrainingDataset` from ``pipeline.to_torch_dataset()``.
        num_workers: DataLoader worker processes (``0``: this process, where ``options(workers=N)``
            runs the lanes in zephon's processes).
        checkpoint: where to start (a zephon checkpoint, this loader's ``state_dict()``, or a
            ``StatefulDataLoader`` state); ``None``: the dataset's start.
        pin_memory, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor, pin_memory_device: as for ``torch.utils.data.DataLoader``.
        **to_training_options: the options of :func:`~zephon.to_training`, with a pipeline.

    ``iter()`` leaves torch's global random state alone (the workers' base seed comes from
    ``generator``), so a trainer that restores its random state draws the uninterrupted numbers.

    State kept: per lane, the encoded state after its last delivered output, and whether the last
    iteration reached the end of the data. Each ``iter()`` continues from there (an earlier
    iterator then raises), or after the end of the data starts a new pass, as a torch epoch does.

    Raises:
        ValueError: a torch setting the pipeline owns (``batch_size``, ``shuffle``, ...);
            ``drain=True`` with workers; a checkpoint of other data settings.
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
        if not isinstance(data, TrainingDataset):
            data = data.to_torch_dataset(**to_training_options)
        elif to_training_options:
            raise TypeError(
                f"DataLoader: to_training options {sorted(to_training_options)} go to pipeline.to_torch_dataset(), "
                "not next to a dataset it made"
            )
        self.dataset = dataset = data
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
                "is not in the order the workers' rotation delivers); options(workers=N) runs the lanes in zephon's "
                "processes"
            )
        if 0 < self.workers < num_workers:
            message = _idle_warning(lanes, num_workers, self.workers)
            warnings.warn(f"DataLoader: {message}", RuntimeWarning, stacklevel=2)
        if generator is None:  # the workers' base seed; never drawn from torch's global random state
            generator = torch.Generator().manual_seed(0)
        self._torch_options = dict(
            pin_memory=pin_memory, timeout=timeout, worker_init_fn=worker_init_fn, generator=generator,
            multiprocessing_context=multiprocessing_context, prefetch_factor=prefetch_factor,
            pin_memory_device=pin_memory_device,
        )
        self._beginning: dict[int, Any] | None = None
        self._current: _Iteration | None = None
        self._finished = False
        start = dataset.checkpoint if checkpoint is None else _as_checkpoint(checkpoint)
        self._states = self._lanes_of(start) if start is not None else self.beginning()

    def beginning(self) -> dict[int, Any]:
        """This rank's lane states at the beginning of the data (encoded, sealed)."""
        if self._beginning is None:
            plan = self.plan
            states = {lane: plan.encode(plan.init(lane)) for lane in self.share.lanes}
            self._beginning = {int(k): v for k, v in build(plan.fingerprint(), states)["lanes"].items()}
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
        """The checkpoint as a DCP-friendly mapping (``{"zephon_fingerprint": ..., "lane_00003": ...}``)."""
        return checkpoint_to_state_dict(self.checkpoint())

    def load_state_dict(self, state: Any) -> None:
        """Close the running iterator; the next ``iter()``, on any ``num_workers``, starts at
        ``state`` (this loader's :meth:`state_dict`, a zephon checkpoint or a ``StatefulDataLoader``
        state).

        Raises:
            ValueError: no zephon checkpoint in ``state``; other data settings; missing lanes.
        """
        states = self._lanes_of(_as_checkpoint(state))
        self.close()
        self._states, self._finished = states, False

    def skip_steps(self, n: int) -> SkippedSteps:
        """Skip the next ``n`` global steps exactly (:meth:`zephon.Loader.skip_steps`): the running
        iterator is closed, a loader in this process skips them, and the next ``iter()`` starts
        after them. The state records the skip.

        Raises:
            ValueError: ``n`` is not an int >= 0, or the state is inside a global step.
        """
        check_count(n)
        self._restart()
        with Loader(self.plan, self.share, self.options, dict(self._states)) as loader:
            skipped = loader.skip_steps(n)
            self._states = {int(k): v for k, v in loader.checkpoint()["lanes"].items()}
        return skipped

    def _restart(self) -> None:
        """Close the running iteration; after the end of the data, start a new pass."""
        self.close()
        if self._finished:
            self._states, self._finished = self.beginning(), False

    def __iter__(self) -> "_Iteration":
        self._restart()
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
        lanes, workers = owner.share.lanes, owner.workers
        self.counts = _counts(start, lanes)
        offset = _offset(start, lanes, workers)
        self.dataset = LaneDataset(owner.plan, owner.share, owner.options, owner.spec, start, max(workers, 1), offset)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=None, num_workers=workers, collate_fn=_convert, **owner._torch_options
        )
        self.torch_iter: Any = iter(loader)
        self.closed = False

    def expected(self) -> tuple[int, int]:
        """The lane whose output comes next and that output's number (0-based), in the pipeline's order."""
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
        undelivered = [0, 0, 0]
        if first is not None:
            undelivered = list(first.undelivered)
            for item in self.torch_iter:
                more = item.undelivered if isinstance(item, EndOfData) else (1, *item.size)
                undelivered = [a + b for a, b in zip(undelivered, more)]
        self.close()
        self.owner._finished = True
        outputs, records, tokens = undelivered
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
            self.owner._states.update({int(k): v for k, v in local.checkpoint()["lanes"].items()})

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
