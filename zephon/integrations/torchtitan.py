"""TorchTitan's data loader protocol over a zephon pipeline: :class:`ZephonDataLoader`, built from a
small config section (datasets, plan, processing, lanes) and saved as a DCP ``Stateful``.

A global step takes one microbatch of ``local_batch_size`` rows from each of ``L =
canonical_replicas`` lanes, ``L / D`` per data-parallel rank; so ``D`` must divide ``L`` and the
global batch be whole steps. Then every optimizer step sees the same rows for every such ``D``,
and a run resumes on any of them.

Requires ``torchtitan`` (``pip install 'zephon-lanes[titan]'``); importing this module imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any, Callable, Iterator

try:
    import torch
    import tyro
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"zephon.integrations.torchtitan needs torchtitan: pip install 'zephon-lanes[titan]' ({exc})"
    ) from exc

from ..ops.batch import Batch
from ..runtime.checkpoint import state_dict_to_checkpoint
from ..training.spec import TrainingSpec

__all__ = ["ZephonDataLoader", "ZephonDataset", "ZephonPlan", "ZephonProcessing", "use_zephon"]


class _Section:
    """``to_dict()`` as TorchTitan's configs have it (JSON-safe: callables become their repr)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


@dataclass(kw_only=True, slots=True)
class ZephonDataset(_Section):
    """One dataset: a JSONL file or folder of shards, named for the plan's weights."""

    name: str
    """Dataset name (the key of its weight in ``plan.weights``)."""

    path: str
    """A ``.jsonl``/``.jsonl.gz``/``.jsonl.zst`` file, or a folder of them (one shard per file)."""

    weight: float | None = None
    """Its mixture weight when ``plan.weights`` is empty (``None``: 1)."""

    fmt: str | None = None
    """``None``: from the file endings; ``"jsonl"``: every file is JSONL."""


@dataclass(kw_only=True, slots=True)
class ZephonPlan(_Section):
    """How the datasets are mixed and ordered (the data plan)."""

    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights by dataset name; empty: each dataset's ``weight`` (default 1)."""

    seed: int = 0
    """Seed of the mixture's order."""

    exhausted_policy: str = "repeat"
    """``"repeat"`` (endless; recommended), ``"stop"`` (end when the first dataset is exhausted) or
    ``"passes"`` (one pass of every dataset); with finite data TorchTitan stops at the last step."""

    chunk_size: int | None = None
    """Samples per unit of work a lane takes at a time (``None``: zephon's default)."""


@dataclass(kw_only=True, slots=True)
class ZephonProcessing(_Section):
    """How samples become training rows: tokenize, pack ``seq_len + 1`` tokens, shuffle."""

    field: str = "text"
    """The text field of every record."""

    tokenizer: str | None = None
    """A ``tokenizer.json`` (or its folder); ``None``: the trainer's own tokenizer."""

    special_tokens: str = "auto"
    """``"bos_eos"``, ``"bos"``, ``"eos"``, ``"none"``, or ``"auto"``: BOS and EOS when the
    tokenizer has both, else EOS."""

    pack_algorithm: str = "wrap"
    """``pack_flat`` algorithm: ``"wrap"`` (no padding) or ``"best_fit_wrap"``, ..."""

    shuffle_buffer: int = 1024
    """Records in each lane's shuffle buffer (0: no shuffle)."""

    shuffle_seed: int = 0
    """Seed of the shuffle."""

    eos_mask_loss: bool = True
    """Ignore the label predicted from an EOS (the first token of the next document)."""

    workers: int = 0
    """zephon worker processes per rank running its lanes ahead (0: in the training process)."""

    pipeline_fn: Annotated[Callable[..., Any] | None, tyro.conf.Suppress] = None
    """Instead of the settings above: ``fn(seq_len=, local_batch_size=, tokenizer=)`` returning a
    :class:`~zephon.Pipeline` that ends in ``batch(local_batch_size)`` of ``seq_len + 1``-token rows."""


class ZephonDataLoader(BaseDataLoader):
    """TorchTitan data loader over a zephon pipeline: ``(input_dict, labels)`` microbatches.

    Each item is ``({"input": [B, S], "positions": [B, S]}, labels [B, S])`` (int64, ``B =
    training.local_batch_size``, ``S = training.seq_len``): ``positions`` restart at every document
    for TorchTitan's flex/varlen attention; labels are ``-100`` on padding and, with
    ``eos_mask_loss``, after EOS.

    Raises (when built):
        ValueError: ``canonical_replicas`` not divisible by the data-parallel degree, or a global
            batch that is not whole zephon steps; the message says which numbers to change.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        datasets: list[ZephonDataset] = field(default_factory=list)
        """The datasets (name and path of each)."""

        plan: ZephonPlan = field(default_factory=ZephonPlan)
        """Mixture weights, seed and end-of-data policy."""

        processing: ZephonProcessing = field(default_factory=ZephonProcessing)
        """Tokenization, packing and shuffling."""

        canonical_replicas: int = 8
        """L, the number of lanes: a common multiple of every data-parallel degree the run may use."""

        global_batch_size: int = -1
        """``training.global_batch_size`` (``use_zephon`` copies it; -1: TorchTitan's default,
        local_batch_size x data-parallel degree). Checked to be whole zephon steps."""

        infinite: bool | None = None
        """Set by TorchTitan's validator (``validator.dataloader``): ``True`` repeats the data,
        ``False`` makes one pass; ``None``: ``plan.exhausted_policy`` decides."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ):
        L, D, m = config.canonical_replicas, dp_world_size, local_batch_size
        check_layout(L, D, m, config.global_batch_size)
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        pipeline, eos_id = build_pipeline(config, seq_len=seq_len, local_batch_size=m, tokenizer=tokenizer)
        finite = config.processing.pipeline_fn is None and _policy(config) != "repeat"
        self.pipeline = pipeline.options(canonical_replicas=L, dp_degree=D, dp_rank=dp_rank, agree_on_end=finite)
        mask_eos = config.processing.eos_mask_loss
        self.spec = TrainingSpec(
            return_labels=True, ignore_index=IGNORE_INDEX, eos_mask_loss=mask_eos and eos_id is not None,
            eos_token_id=eos_id if mask_eos else None, dtype=torch.long,
        )
        self.loader = self.pipeline.loader()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            t = self.spec(batch)
            inputs = t["input_ids"]
            if inputs.shape[1] != self.seq_len:
                raise ValueError(
                    f"ZephonDataLoader: rows hold {inputs.shape[1] + 1} tokens, so inputs have {inputs.shape[1]}, but "
                    f"training.seq_len={self.seq_len}: pack seq_len + 1 = {self.seq_len + 1} tokens per row"
                )
            positions = {} if t.get("positions") is None else {"positions": t["positions"]}
            yield {"input": inputs, **positions}, t["labels"]

    def state_dict(self) -> dict[str, Any]:
        """One entry per lane, so DCP restores it on any data-parallel degree dividing L."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # TorchTitan: an empty state (nothing saved for the loader) is valid
            return
        self.loader.restore(state_dict_to_checkpoint(state_dict))

    def checkpoint(self) -> dict[str, Any]:
        """This rank's zephon checkpoint (see :meth:`zephon.Loader.checkpoint`)."""
        return self.loader.checkpoint()

    def close(self) -> None:
        """Stop zephon's worker processes, if any."""
        self.loader.close()


def check_layout(lanes: int, dp_degree: int, local_batch_size: int, global_batch_size: int) -> None:
    """Raise unless ``lanes`` split evenly over ``dp_degree`` and the global batch is whole zephon steps.

    Examples:
        >>> check_layout(8, 2, 4, 32)
        >>> check_layout(8, 3, 4, 32)
        Traceback (most recent call last):
        ...
        ValueError: ZephonDataLoader: canonical_replicas=8 lanes cannot be split evenly over the data-parallel degree 3 ...
    """
    L, D, m = lanes, dp_degree, local_batch_size
    if L < 1 or D < 1 or m < 1:
        raise ValueError(f"ZephonDataLoader: canonical_replicas ({L}), the data-parallel degree ({D}) and local_batch_size ({m}) must be >= 1")
    if L % D:
        lcm = L * D // math.gcd(L, D)
        raise ValueError(
            f"ZephonDataLoader: canonical_replicas={L} lanes cannot be split evenly over the data-parallel degree {D} "
            f"(parallelism.data_parallel_replicate_degree x data_parallel_shard_degree): every rank must own L/D lanes. "
            f"Set dataloader.canonical_replicas to a multiple of {D} (e.g. {lcm}, a common multiple of every degree "
            "you will use), and keep it for the whole run"
        )
    step = L * m
    gbs = global_batch_size if global_batch_size > 0 else m * D
    if gbs % step:
        origin = (
            f"training.global_batch_size={gbs}"
            if global_batch_size > 0
            else f"the default global batch local_batch_size x data-parallel degree = {m} x {D} = {gbs}"
        )
        raise ValueError(
            f"ZephonDataLoader: {origin} is not whole zephon steps: a step takes one microbatch of "
            f"local_batch_size={m} rows from each of canonical_replicas={L} lanes, {L} x {m} = {step} rows. Set "
            f"training.global_batch_size (and dataloader.global_batch_size, or call use_zephon) to {step} or a multiple "
            f"of it, or change training.local_batch_size or dataloader.canonical_replicas so that L x local_batch_size "
            f"divides the global batch"
        )


def build_pipeline(config: Any, *, seq_len: int, local_batch_size: int, tokenizer: Any) -> tuple[Any, int | None]:
    """The pipeline a config section describes, and the EOS id used to mask labels (or ``None``)."""
    proc = config.processing
    if proc.pipeline_fn is not None:
        pipe = proc.pipeline_fn(seq_len=seq_len, local_batch_size=local_batch_size, tokenizer=tokenizer)
        steps = getattr(pipe, "operators", ())
        if not steps or not isinstance(steps[-1][1], Batch) or steps[-1][1].microbatch_size != local_batch_size:
            raise ValueError(
                f"ZephonDataLoader: processing.pipeline_fn must return a Pipeline ending in batch({local_batch_size}) "
                "(training.local_batch_size rows per microbatch)"
            )
        return pipe, getattr(tokenizer, "eos_id", None)

    from .. import Pipeline
    from ..sources.dataset import Dataset
    from ..sources.work_source import StaticMixtureWorkSource

    if not config.datasets:
        raise ValueError("ZephonDataLoader: dataloader.datasets is empty; list at least one ZephonDataset(name=, path=)")
    datasets = [Dataset.from_path(d.name, d.path, fmt=d.fmt) for d in config.datasets]
    names = [d.name for d in config.datasets]
    weights = dict(config.plan.weights) or {d.name: 1.0 if d.weight is None else d.weight for d in config.datasets}
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"ZephonDataLoader: plan.weights names datasets {unknown} that are not in dataloader.datasets {names}")
    policy = _policy(config)
    extra = {} if config.plan.chunk_size is None else {"chunk_size": config.plan.chunk_size}
    source = StaticMixtureWorkSource(datasets, weights, seed=config.plan.seed, exhausted_policy=policy, **extra)

    tok: Any = proc.tokenizer
    tok_kwargs: dict[str, Any] = {}
    if tok is None:
        tok = getattr(tokenizer, "tokenizer", None)
        if tok is None:
            raise ValueError(
                "ZephonDataLoader: set processing.tokenizer (a tokenizer.json) or give TorchTitan a Hugging Face "
                "tokenizer (hf_assets_path)"
            )
        ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_id", None) for name in ("bos", "eos")}
        tok_kwargs = {k: v for k, v in ids.items() if v is not None}
    special = proc.special_tokens
    pipe = Pipeline(source).options(workers=proc.workers)
    if special == "auto":
        try:
            pipe = pipe.tokenize(tok, field=proc.field, special_tokens="bos_eos", **tok_kwargs)
        except ValueError:  # no BOS: documents separated by EOS
            tok_kwargs.pop("bos_token_id", None)
            pipe = pipe.tokenize(tok, field=proc.field, special_tokens="eos", **tok_kwargs)
    else:
        pipe = pipe.tokenize(tok, field=proc.field, special_tokens=special, **tok_kwargs)
    op = pipe.operators[-1][1]
    eos_id = op.eos_token_id if op.eos_token_id is not None else op.tokenizer.eos_token_id
    pipe = pipe.pack_flat(seq_len + 1, algorithm=proc.pack_algorithm, **({} if proc.pack_algorithm == "wrap" else {"pad_token_id": eos_id}))
    if proc.shuffle_buffer:
        pipe = pipe.shuffle(proc.shuffle_buffer, seed=proc.shuffle_seed)
    return pipe.batch(local_batch_size), eos_id


def _policy(config: Any) -> str | None:
    """The work source's ``exhausted_policy``: from ``infinite`` when TorchTitan sets it, else the plan's."""
    if config.infinite is not None:
        return "repeat" if config.infinite else None
    policies = {"repeat": "repeat", "stop": "stop", "passes": None}
    if config.plan.exhausted_policy not in policies:
        raise ValueError(
            f"ZephonDataLoader: plan.exhausted_policy must be 'repeat', 'stop' or 'passes', got {config.plan.exhausted_policy!r}"
        )
    return policies[config.plan.exhausted_policy]


def use_zephon(trainer_config: Any, loader_config: "ZephonDataLoader.Config") -> Any:
    """Make ``trainer_config`` (a ``Trainer.Config``) load its data with ``loader_config``.

    Copies ``training.global_batch_size`` into the section and checks the lane layout against the
    data-parallel degree when the config fixes it. Returns ``trainer_config``.
    """
    training = trainer_config.training
    section = replace(loader_config, global_batch_size=training.global_batch_size)
    par = trainer_config.parallelism
    dp = [getattr(par, "data_parallel_replicate_degree", 1), getattr(par, "data_parallel_shard_degree", -1)]
    if all(d > 0 for d in dp):
        check_layout(section.canonical_replicas, dp[0] * dp[1], training.local_batch_size, section.global_batch_size)
    trainer_config.dataloader = section
    return trainer_config
