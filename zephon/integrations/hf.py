"""The Hugging Face ``Trainer`` (and TRL's trainers) over a zephon pipeline: :class:`ZephonTrainerMixin`.

The Trainer's own data path (sampler, collator, ``accelerator.prepare``, ``skip_first_batches``) is
bypassed. With every ``checkpoint-N/`` each rank saves its lanes' state in ``checkpoint-N/zephon/``;
``train(resume_from_checkpoint=...)`` resumes from it, on any world size dividing the lanes,
replaying nothing (``args.ignore_data_skip = True``).

Requires ``transformers`` (``pip install 'zephon-lanes[transformers]'``); importing this module imports it.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

try:
    import transformers
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"zephon.integrations.hf needs transformers: pip install 'zephon-lanes[transformers]' ({exc})") from exc

from ..runtime.checkpoint import read_checkpoint, save_checkpoint, validate
from ..runtime.skip_steps import SkippedSteps
from .torch import DataLoader
from .torch_dataset import position_problem, skip_count, skip_optimizer_steps, whole_steps_problem

__all__ = ["STATE_DIR", "ZephonTrainer", "ZephonTrainerMixin", "data_parallel", "pipeline_rows"]

#: The folder inside a Trainer checkpoint (``checkpoint-N/``) that holds every rank's zephon checkpoint.
STATE_DIR = "zephon"


class _SaveZephonState(transformers.TrainerCallback):
    """Writes this rank's zephon checkpoint into the ``checkpoint-N/`` folder the Trainer just saved."""

    def __init__(self, trainer: "ZephonTrainerMixin"):
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.trainer.zephon_loader
        if loader is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_DIR)
            save_checkpoint(folder, loader)


class ZephonTrainerMixin:
    """Makes a ``transformers.Trainer`` (or a subclass, such as TRL's ``SFTTrainer``) train on a zephon pipeline.

    Put it first among the bases: ``class T(ZephonTrainerMixin, SFTTrainer)``.

    Args:
        pipeline: a :class:`~zephon.Pipeline` ending in ``batch(microbatch_size)``; each training
            batch is one microbatch of one lane (not ``per_device_train_batch_size``). A run not
            resumed starts at its checkpoint.
        whole_steps: ``True`` (default): refuse a ``gradient_accumulation_steps`` that is not a
            multiple of the rank's lanes (``L / D``): only then is every optimizer step the same
            rows for every world size (and a checkpoint resumable on another); ``False`` allows it.
        to_training: options of :func:`~zephon.to_training` over the ``layout="hf"`` preset
            (``layout=None``: none).
        *args, **kwargs: the Trainer's own, except ``train_dataset`` and ``data_collator``. The
            loader takes ``dataloader_num_workers``, ``dataloader_pin_memory`` and
            ``dataloader_prefetch_factor`` from ``TrainingArguments``.

    State kept: the running loader (:attr:`zephon_loader`), the Trainer checkpoint ``train()``
    resumes from and the data steps it skips.

    Raises:
        TypeError: ``train_dataset`` or ``data_collator`` given; an unknown ``to_training`` option.
        ValueError: the pipeline does not end in ``batch()``; (from ``train()``) the world size does
            not divide the lanes, an accumulation that is not whole steps, a checkpoint of other data
            settings or saved mid-step on another world size.
        FileNotFoundError: (from ``train(resume_from_checkpoint=...)``) the checkpoint has no zephon state.
    """

    def __init__(
        self,
        *args: Any,
        pipeline: Any,
        whole_steps: bool = True,
        to_training: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        for name in ("train_dataset", "data_collator"):
            if kwargs.get(name) is not None:
                raise TypeError(
                    f"{type(self).__name__}: {name}= is not used with pipeline= (the pipeline is the training data and "
                    "converts its microbatches itself; pass to_training={...} for other fields)"
                )
        if not isinstance(whole_steps, bool):
            raise TypeError(f"{type(self).__name__}: whole_steps must be True or False, got {whole_steps!r}")
        options = {"layout": "hf", **(to_training or {})}
        self.zephon_pipeline, self.zephon_options = pipeline, options
        self.zephon_whole_steps = whole_steps
        self.zephon_loader: DataLoader | None = None
        self.zephon_skipped: SkippedSteps | None = None  # what train(skip_data_steps=...) skipped
        self._zephon_resume: str | None = None
        self._zephon_skip = 0
        dataset = pipeline.to_torch_dataset(**options)  # fails now on a bad pipeline or option
        # TRL's trainers accept only a 🤗 datasets dataset as train_dataset.
        trl = any(base.__module__.split(".")[0] == "trl" for base in type(self).__mro__)
        kwargs["train_dataset"] = pipeline_rows(pipeline, options) if trl else dataset
        super().__init__(*args, **kwargs)
        self.add_callback(_SaveZephonState(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, skip_data_steps: int = 0,
              **kwargs: Any) -> Any:
        """``Trainer.train``, with zephon's loader resuming from ``checkpoint-N/zephon/`` instead of a replay.

        ``skip_data_steps``: skip the data of this many optimizer steps at the start (after a loss
        spike): the next optimizer step trains on what the uninterrupted run trains on that many
        steps later. Later checkpoints record the skip; :attr:`zephon_skipped` holds it (for
        ``Ledger.record_skip``).
        """
        self._zephon_skip = skip_count(skip_data_steps, f"{type(self).__name__}.train: skip_data_steps")
        resume = resume_from_checkpoint
        if resume is True:
            resume = get_last_checkpoint(self.args.output_dir)  # None: the Trainer raises its own error
        self._zephon_resume = os.fspath(resume) if resume else None
        self.args.ignore_data_skip = True
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """This rank's microbatches, from the checkpoint ``train()`` resumes (or the pipeline's start)."""
        args = self.args
        degree, rank = data_parallel(args, getattr(self.accelerator, "parallelism_config", None))
        dataset = self.zephon_pipeline.options(dp_degree=degree, dp_rank=rank).to_torch_dataset(**self.zephon_options)
        lanes = tuple(dataset.topology().lanes)
        name = type(self).__name__
        problem = whole_steps_problem(args.gradient_accumulation_steps, len(lanes), degree)
        if problem and self.zephon_whole_steps:
            raise ValueError(
                f"{name}: TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}): {problem}. "
                f"Pass {name}(..., whole_steps=False) to allow it anyway"
            )
        start = None
        if self._zephon_resume is not None:
            folder = os.path.join(self._zephon_resume, STATE_DIR)
            if not os.path.isdir(folder):
                raise FileNotFoundError(
                    f"{name}: the Trainer checkpoint {self._zephon_resume} has no zephon state ({folder} is "
                    "missing): it was not saved by a trainer with ZephonTrainerMixin, or its ranks' files were not copied. "
                    "Resume from a checkpoint this trainer saved"
                )
            start = read_checkpoint(folder, lanes)
            validate(dataset.plan.fingerprint(), start)
            problem = position_problem(start, lanes, degree)
            if problem:
                raise ValueError(f"{name}: {self._zephon_resume}: {problem}")
        if self.zephon_loader is not None:
            self.zephon_loader.close()
        self.zephon_loader = DataLoader(
            dataset, checkpoint=start, num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            prefetch_factor=args.dataloader_prefetch_factor if args.dataloader_num_workers else None,
        )
        if self._zephon_skip:
            self.zephon_skipped = skip_optimizer_steps(
                self.zephon_loader, self._zephon_skip, args.gradient_accumulation_steps, len(lanes), degree, name
            )
            self._zephon_skip = 0
        return self.zephon_loader


class ZephonTrainer(ZephonTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` over a zephon pipeline (see :class:`ZephonTrainerMixin`)."""


def data_parallel(args: Any, parallelism: Any = None) -> tuple[int, int]:
    """``(degree, rank)`` of data parallelism: the world size and process index, or the
    data-parallel part of Accelerate's ``ParallelismConfig`` (the ranks of one model-parallel
    group read the same data)."""
    if parallelism is None:
        return int(args.world_size), int(args.process_index)
    inner = int(parallelism.non_data_parallel_size)
    return int(parallelism.data_parallel_size), int(args.process_index) // inner


def pipeline_rows(pipeline: Any, to_training: dict[str, Any] | None = None) -> Any:
    """The pipeline's training rows, as lists, as a ``datasets.IterableDataset``: what a trainer
    that insists on a 🤗 dataset (TRL's) inspects at construction; training reads zephon's loader."""
    import datasets

    return datasets.IterableDataset.from_generator(_rows, gen_kwargs={"pipeline": pipeline, "options": to_training or {}})


def _rows(pipeline: Any, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    loader = pipeline.loader()
    try:
        for batch in loader:
            fields = batch.to_training(**options)
            for i in range(len(batch)):
                yield {k: v[i].tolist() for k, v in fields.items() if hasattr(v, "tolist")}
    finally:
        loader.close()
