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
divides ``n``. Workers cannot see each other's lanes, so they cannot agree where *finite* data
ends: with ``W > 1`` the source must be endless (``exhausted_policy="repeat"``; train for a
fixed number of steps), and other settings fail at the first ``next()`` with the fix. In a
worker the lanes run in that worker (``options(workers=...)`` applies with ``num_workers=0``).

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

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
        **to_training_options: the options of :func:`~zephon.to_training` (``layout=``
            included), validated here, once.

    Each ``iter()`` starts a new :class:`TrainingStream` from the beginning of the data (or from
    the state a ``StatefulDataLoader`` loads into it). Batching belongs to the pipeline, so use
    ``batch_size=None``: a DataLoader batch size would stack several microbatches.

    Raises:
        ValueError: the pipeline does not end in ``batch()``; invalid ``to_training`` options.
        TypeError: an unknown ``to_training`` option.
    """

    def __init__(self, pipeline: Any, **to_training_options: Any):
        super().__init__()
        steps = pipeline.operators
        if not steps or not isinstance(steps[-1][1], Batch):
            raise ValueError(
                "to_torch_dataset: the pipeline must end in batch(microbatch_size): every item of the dataset "
                "is one microbatch of training tensors (append .batch(8), for example)"
            )
        self.pipeline = pipeline
        self.spec = training_spec(**to_training_options)
        self._topology: Any = None  # resolved in the main process when pickled for spawned workers

    def __getstate__(self) -> dict[str, Any]:
        # A spawned DataLoader worker has no torch.distributed of its own: resolve D and the rank here.
        state = dict(self.__dict__)
        if state["_topology"] is None:
            state["_topology"] = self.pipeline.topology()
        return state

    def __iter__(self) -> "TrainingStream":
        topology = self._topology if self._topology is not None else self.pipeline.topology()
        info = torch.utils.data.get_worker_info()
        options = self.pipeline.run_options
        lanes = tuple(topology.lanes)
        if info is not None:
            # Inside a DataLoader worker (a daemonic process, which cannot start zephon's own), run
            # the lanes here, and never enter a collective: workers are not ranks.
            options = options.evolve(workers=0, agree_on_end=False)
            workers, worker = info.num_workers, info.id
            if workers > 1:
                _check_worker_split(self.pipeline, len(lanes), workers)
                lanes = lanes[worker::workers]
        share = LaneShare(topology.canonical_replicas, topology.dp_degree, topology.dp_rank, lanes)
        return TrainingStream(self.pipeline.plan, share, options, self.spec, split=info is not None and info.num_workers > 1)


def _check_worker_split(pipeline: Any, lanes: int, workers: int) -> None:
    """Raise unless ``workers`` DataLoader workers can deliver exactly the pipeline's sequence."""
    if lanes % workers:
        fits = [w for w in range(1, lanes + 1) if lanes % w == 0]
        raise ValueError(
            f"to_torch_dataset: DataLoader(num_workers={workers}) cannot deliver this rank's {lanes} lanes in the "
            f"pipeline's order: the DataLoader takes items from its workers in turn, so the number of workers must "
            f"divide the lanes per rank (canonical_replicas / data-parallel size). Use num_workers in {fits}, or "
            "num_workers=0 with pipeline.options(workers=N) (zephon's own worker processes, any N)"
        )
    policy = getattr(pipeline.source, "exhausted_policy", None)
    if policy != "repeat":
        raise ValueError(
            f"to_torch_dataset: DataLoader(num_workers={workers}) splits this rank's lanes over worker processes "
            f"that cannot see each other's lanes, so they cannot stop together where finite data ends (this source "
            f"ends: exhausted_policy={policy!r}), and the last batches would differ from the pipeline's. Use "
            "DataLoader(num_workers=0) with pipeline.options(workers=N) (zephon's own worker processes, exact at "
            "the end), or an endless source (StaticMixtureWorkSource(..., exhausted_policy='repeat')) and a fixed "
            "number of training steps"
        )


class TrainingStream(Iterator[dict]):
    """One iteration of a :class:`TrainingDataset`: this share's training tensors, and its state.

    The loader starts at the first ``next()`` (so ``load_state_dict()`` before it costs nothing)
    and keeps the lane states; ``state_dict()`` is ``{"zephon_checkpoint": checkpoint}`` after
    the last batch yielded, ``load_state_dict()`` resumes exactly from one (of the same lanes).
    """

    def __init__(self, plan: Any, share: LaneShare, options: Any, spec: Any, *, split: bool = False):
        self.plan = plan
        self.share = share
        self.options = options
        self.spec = spec
        self._split = split
        self._loader: Loader | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def loader(self) -> Loader:
        """The running :class:`~zephon.Loader` (started on first use)."""
        if self._loader is None:
            encoded = select_lanes(self._pending, self.share.lanes) if self._pending is not None else None
            self._loader = Loader(self.plan, self.share, self.options, encoded)
            self._pending = None
        return self._loader

    def __iter__(self) -> "TrainingStream":
        return self

    def __next__(self) -> dict:
        try:
            batch = next(self.loader)
        except StopIteration:
            if self._split:
                raise RuntimeError(
                    f"to_torch_dataset: lanes {list(self.share.lanes)} of a DataLoader worker ran out of data although "
                    "the source repeats (every record was dropped?); the workers cannot stop together, so the run "
                    "stops here. Check the filters, or use num_workers=0"
                ) from None
            raise
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
        validate(self.plan.fingerprint(), checkpoint)
        if self._loader is not None:
            self._loader.restore(checkpoint)
        else:
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
