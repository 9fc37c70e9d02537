"""A pipeline as a Lightning ``LightningDataModule``: :class:`ZephonDataModule`.

Its loader is zephon's :class:`~zephon.integrations.torch.DataLoader` on the strategy's
data-parallel degree and rank, so Lightning neither shards nor re-batches it. Its state, gathered
from every rank (Lightning saves it from rank 0), is every lane after the batches handed to
``training_step``, so checkpoints resume exactly mid-epoch on any device count dividing the lanes.

Requires ``lightning`` (``pip install 'zephon-lanes[lightning]'``); importing this module imports it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping

try:
    import lightning.pytorch as pl
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"zephon.integrations.lightning needs lightning: pip install 'zephon-lanes[lightning]' ({exc})"
    ) from exc

from ..runtime.checkpoint import merge_checkpoints, validate
from ..runtime.skip_steps import SkippedSteps
from .torch import DataLoader
from .torch_dataset import STATE_KEY, position_problem, skip_count, skip_optimizer_steps, whole_steps_problem

__all__ = ["ZephonDataModule"]


class _Feed:
    """The iterable Lightning's fit loop reads: a :class:`DataLoader`'s items, and the state before each.

    ``_before`` holds the loader's checkpoint before each item handed over and not yet taken by
    ``training_step``, so :meth:`checkpoint` is the state after exactly the items taken. It has no
    ``state_dict``, so Lightning does not save it (rank 0's lanes only).
    """

    def __init__(self, loader: DataLoader, layout: tuple[int, int]):
        self.loader, self.layout = loader, layout  # layout: (data-parallel degree, rank)
        self._before: deque[dict[str, Any]] = deque()

    def __iter__(self) -> Iterator[Any]:
        self._before.clear()
        return self._items(iter(self.loader))

    def _items(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            before = self.loader.checkpoint()
            try:
                item = next(it)
            except StopIteration:
                return
            self._before.append(before)
            yield item

    def taken(self) -> None:
        """One item reached ``training_step``."""
        if self._before:
            self._before.popleft()

    def checkpoint(self) -> dict[str, Any]:
        """This rank's lane states after the items taken (not those read ahead)."""
        return self._before[0] if self._before else self.loader.checkpoint()

    def close(self) -> None:
        self.loader.close()


class _TakenCounter(pl.Callback):
    """Tells the datamodule's feed that a training batch left Lightning's fetcher (one per ``training_step``)."""

    def __init__(self, datamodule: "ZephonDataModule"):
        self.datamodule = datamodule

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        feed = self.datamodule._feed
        if feed is not None:
            feed.taken()


class ZephonDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` whose training data is a zephon pipeline, resumable mid-epoch on any device count.

    Args:
        pipeline: a :class:`~zephon.Pipeline` ending in ``batch(microbatch_size)``; each training
            batch is one microbatch of one lane. Without a loaded Lightning checkpoint it starts
            at the checkpoint the pipeline carries.
        num_workers: DataLoader worker processes per rank (the largest divisor of the rank's lanes
            at most ``num_workers`` run).
        whole_steps: ``True`` (default): refuse an ``accumulate_grad_batches`` that is not a
            multiple of the rank's lanes (``L / D``), since only then is every optimizer step the
            same rows for every ``D``; ``False`` allows it (the data stays exact).
        pin_memory, timeout, prefetch_factor, multiprocessing_context: as for ``torch.utils.data.DataLoader``.
        **to_training_options: the options of :func:`~zephon.to_training`.

    State kept: the checkpoint loaded by :meth:`load_state_dict` (where the next
    ``train_dataloader()`` starts), the data steps skipped there, and the running loader, which a
    reload (``reload_dataloaders_every_n_epochs``) returns to go on where it is; after ``fit()`` the
    state of the batches taken is kept for the next ``fit()`` or ``state_dict()``.

    Raises (from ``train_dataloader()``):
        ValueError: the data-parallel degree does not divide the lanes; ``accumulate_grad_batches`` not
            whole steps (see ``whole_steps``); a checkpoint of other data settings, or one whose lanes are
            at no position of this rank's stream (saved mid-step, resumed on another device count).
    """

    def __init__(
        self,
        pipeline: Any,
        *,
        num_workers: int = 0,
        whole_steps: bool = True,
        pin_memory: bool = False,
        timeout: float = 0,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        **to_training_options: Any,
    ):
        super().__init__()
        if not isinstance(whole_steps, bool):
            raise TypeError(f"ZephonDataModule: whole_steps must be True or False, got {whole_steps!r}")
        self.pipeline = pipeline
        self.num_workers = num_workers
        self.whole_steps = whole_steps
        self.loader_options = dict(
            num_workers=num_workers, pin_memory=pin_memory, timeout=timeout, prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
        )
        self.to_training_options = to_training_options
        self.pipeline.to_torch_dataset(**to_training_options)  # fail now on a bad pipeline or option
        self._checkpoint: dict[str, Any] | None = None
        self._feed: _Feed | None = None
        self._skip = 0
        self.skipped: SkippedSteps | None = None  # what skip_data_steps() skipped, once fit() started

    def skip_data_steps(self, n: int) -> None:
        """Skip the data of ``n`` optimizer steps where the next ``fit()`` starts (after a loss spike:
        ``dm.skip_data_steps(600); trainer.fit(model, datamodule=dm, ckpt_path=earlier)``); needs
        whole global steps per optimizer step. :attr:`skipped` holds the skip once ``fit()``
        started, and later checkpoints record it."""
        self._skip = skip_count(n, "ZephonDataModule.skip_data_steps: n")

    def train_dataloader(self) -> Any:
        """This rank's microbatches from the loaded checkpoint (or the pipeline's start), as training tensors."""
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(
                "ZephonDataModule.train_dataloader() is called by a Trainer: trainer.fit(model, datamodule=dm)"
            )
        sampler = trainer.distributed_sampler_kwargs  # empty or None on a single device
        degree, rank = (int(sampler["num_replicas"]), int(sampler["rank"])) if sampler else (1, 0)
        dataset = self.pipeline.options(dp_degree=degree, dp_rank=rank).to_torch_dataset(**self.to_training_options)
        lanes = tuple(dataset.topology().lanes)
        accumulate = trainer.accumulate_grad_batches
        problem = whole_steps_problem(accumulate, len(lanes), degree) if self.whole_steps else None
        if problem:
            raise ValueError(
                f"ZephonDataModule: Trainer(accumulate_grad_batches={accumulate}): {problem}. "
                "Pass ZephonDataModule(..., whole_steps=False) to allow it anyway"
            )
        if self._feed is not None and self._feed.layout == (degree, rank):
            return self._feed  # a reload (reload_dataloaders_every_n_epochs): the running loader goes on
        start = self.checkpoint()
        if self._feed is not None:
            self._feed.close()
        if start is not None:
            validate(dataset.plan.fingerprint(), start)
            problem = position_problem(start, lanes, degree)
            if problem:
                raise ValueError(
                    f"ZephonDataModule: {problem} (ModelCheckpoint(every_n_train_steps=...))"
                )
        loader = DataLoader(dataset, checkpoint=start, **self.loader_options)
        if self._skip:
            self.skipped = skip_optimizer_steps(
                loader, self._skip, accumulate, len(lanes), degree, "ZephonDataModule"
            )
            self._skip = 0
        self._feed = _Feed(loader, (degree, rank))
        if not any(isinstance(cb, _TakenCounter) and cb.datamodule is self for cb in trainer.callbacks):
            trainer.callbacks.append(_TakenCounter(self))
        return self._feed

    def teardown(self, stage: str) -> None:
        if self._feed is not None and stage == "fit":
            self._checkpoint = self._feed.checkpoint()
            self._feed.close()
            self._feed = None

    def checkpoint(self) -> dict[str, Any] | None:
        """This rank's zephon checkpoint after the batches taken (``None`` before any data and any load)."""
        return self._feed.checkpoint() if self._feed is not None else self._checkpoint

    def state_dict(self) -> dict[str, Any]:
        """``{"zephon_checkpoint": every rank's lanes}``; a collective when distributed (Lightning
        calls it on every rank)."""
        local = self.checkpoint()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            if any(ck is None for ck in gathered):
                if all(ck is None for ck in gathered):
                    return {}
                raise RuntimeError(
                    "ZephonDataModule.state_dict(): some ranks have no data state; "
                    "call it after fit() starts on every rank"
                )
            return {STATE_KEY: merge_checkpoints(gathered)}
        return {} if local is None else {STATE_KEY: local}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Start the next ``train_dataloader()`` at ``state_dict`` (:meth:`state_dict`'s, any device count)."""
        if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get(STATE_KEY), Mapping):
            raise ValueError(
                "ZephonDataModule.load_state_dict: expected the mapping state_dict() returned, with key "
                f"{STATE_KEY!r}; got {type(state_dict).__name__}"
            )
        self._checkpoint = dict(state_dict[STATE_KEY])
        if self._feed is not None:
            self._feed.close()
            self._feed = None

