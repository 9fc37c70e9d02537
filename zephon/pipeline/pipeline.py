"""The ``Pipeline`` value: a work source, named operators and run options, run as L lanes.

Frozen: every builder method returns a new pipeline. ``iter(p)`` and ``p.loader()`` return the
:class:`~zephon.Loader` that runs it (executor, checkpoints, stats, ``close()``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
import warnings
from typing import Any, Callable, Iterator

import attrs

from ..ops.batch import Batch
from ..runtime.checkpoint import validate
from ..core.operator import Chain, FilterOp, MapOp, Operator, StatelessOp
from ..runtime.distributed import Topology, resolve_topology
from . import replan
from .explain import Explanation, describe_record, explain_plan, untokenized_warning
from ..core.fingerprint import FingerprintWarning, unfingerprintable
from ..runtime.lanes import Plan
from ..runtime.loader import Loader, restored_lanes
from ..runtime.skip_steps import check_count
from ..core.log import progress
from ..runtime.options import Options
from ..ops.lengths import LengthSchedule, bind_lengths
from ..ops.pack import PackFlat, PackSequences
from ..core.records import SampleBatch
from ..ops.order import OrderBy
from ..ops.shuffle import Shuffle
from ..ops.tokenize import Tokenize, TokenizerOp
from ..training.spec import _warn_at_caller
from ..sources.calibrate import compile_source, step_size
from ..ops.mixing import make_ensure_mixture, place_targets
from ..sources.estimate import Calibration
from ..sources.work_source import make_source


@attrs.define(eq=False)
class _Bookkeeping:
    """A pipeline's notes outside its value (never compared or pickled): ``plans`` memoizes
    compiling by calibration; ``origin`` and ``made`` find builder results thrown away unused."""

    plans: dict[str, Plan] = attrs.Factory(dict)
    origin: _Origin | None = None
    made: list[tuple[weakref.ref, _Origin]] = attrs.Factory(list)

    def __reduce__(self) -> tuple:
        return (_Bookkeeping, ())


@attrs.define(eq=False)
class _Origin:
    """A builder call (``"tokenize(...)"``), its parent's, a note for its warning, if it ran."""

    call: str
    parent: _Origin | None
    note: str = ""
    used: bool = False


#: The builder methods that append an operator through ``add``.
_BUILDERS = frozenset({
    "map", "filter", "tokenize", "tokenize_chat", "pack_flat", "pack_sequences", "shuffle",
    "order_by", "batch", "ensure_mixture",
})
#: What a loader owns, asked of a pipeline by code written for pipelines that run in place.
_RUNNING = frozenset({"checkpoint", "stats", "stats_table", "close", "state_dict", "load_state_dict"})


def _checked_function(pipe: "Pipeline") -> "Pipeline":
    """``pipe``, after warning if its last operator's function holds a value no fingerprint describes."""
    name, op = pipe.operators[-1]
    markers = unfingerprintable(op.fingerprint())
    if markers:
        warnings.warn(
            f"{op.kind} {name!r}: the function holds a value its fingerprint cannot describe ({'; '.join(markers)}), so "
            f"a checkpoint cannot tell whether a restore uses the same one, and restores are refused; pass "
            f"{op.kind}(..., fingerprint='v1') naming the function's version (change it whenever its output changes)",
            FingerprintWarning, stacklevel=3,
        )
    return pipe


def _steps(value: Any) -> tuple[tuple[str, Operator], ...]:
    return tuple((str(name), op) for name, op in value)


def _prestart(options: Options, pipeline: "Pipeline | None" = None) -> None:
    """With worker processes: start their fork server now (it imports while the caller works) and,
    for ``pipeline``, have its workers started and its encoders built (:mod:`zephon.runtime.standby`)."""
    if not options.workers:
        return
    from ..runtime.executor import prestart
    from ..runtime.standby import prepare

    prestart()
    if pipeline is not None:
        lanes = options.canonical_replicas // (options.dp_degree or 1) or options.canonical_replicas
        prepare(min(options.workers, lanes), [op.handle for _, op in pipeline.operators if isinstance(op, TokenizerOp)])


@attrs.frozen
class Pipeline:
    """A deterministic data pipeline: a source, named operators and run options. A value.

    Args:
        source: a :class:`~zephon.work.StaticMixtureWorkSource`, a :class:`~zephon.io.Dataset`,
            a list of datasets, or a plain list of dicts.
        operators: ``(name, operator)`` pairs, in order (usually built with the methods below).
        options: the run settings (:class:`~zephon.Options`; usually set with :meth:`options`).
        resume_from: a checkpoint every loader starts at (usually set with :meth:`restore`).

    Examples:
        >>> from zephon import Pipeline
        >>> rows = [{"n": i} for i in range(10)]
        >>> base = Pipeline(rows)
        >>> tens = base.map(lambda p: {"n": p["n"] * 10}).batch(4)
        >>> [[r.payload["n"] for r in b.records] for b in tens]
        [[0, 10, 20, 30], [40, 50, 60, 70]]
        >>> len(base.operators), len(tens.operators)   # the base is unchanged
        (0, 2)
    """

    source: Any = attrs.field(converter=make_source)
    operators: tuple[tuple[str, Operator], ...] = attrs.field(default=(), converter=_steps)
    run_options: Options = attrs.field(default=Options(), alias="options")
    resume_from: dict[str, Any] | None = attrs.field(default=None, kw_only=True, hash=False, repr=False)
    _notes: _Bookkeeping = attrs.field(init=False, factory=_Bookkeeping, eq=False, repr=False)

    def options(self, **kwargs: Any) -> "Pipeline":
        """A new pipeline with these run options changed (see :class:`Options`; ``num_workers`` means ``workers``)."""
        child = attrs.evolve(self, options=self.run_options.evolve(**kwargs))
        _prestart(child.run_options, child)
        call = "options(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
        L, note = self.run_options.canonical_replicas, ""
        if child.run_options.canonical_replicas != L:
            note = (
                f" It keeps canonical_replicas={L} (L={L} lane{'s' if L != 1 else ''}): the lane count decides every "
                "global step's data and how ranks share it, so with the wrong L a multi-GPU job does not read "
                "the data it was set up for."
            )
        return self._made(child, call, note)

    def add(self, op: Operator, *, name: str | None = None) -> "Pipeline":
        """A new pipeline with ``op`` appended under ``name`` (default: its kind, numbered when repeated)."""
        if not isinstance(op, Operator):
            raise TypeError(f"add() takes an operator, got {type(op).__name__}; wrap functions with zephon.ops.stateless")
        steps = self.operators
        if steps and isinstance(steps[-1][1], Batch):
            raise ValueError(f"{op.kind} cannot come after batch(); batch() must be the last step")
        if getattr(op, "fans_out", False) and any(not isinstance(o, StatelessOp) for _, o in steps):
            raise ValueError(
                f"{op.kind} splits records, so it must come before every buffering operator "
                f"(it follows {[n for n, o in steps if not isinstance(o, StatelessOp)]})"
            )
        if isinstance(op, Batch):
            steps = bind_lengths(steps + (("", op),))[:-1]  # refuses a wrong pairing with pack_flat's length
        taken = {n for n, _ in steps}
        if name is None:
            name, i = op.kind, 1
            while name in taken:
                name, i = f"{op.kind}_{i}", i + 1
        elif name in taken:
            raise ValueError(f"an operator named {name!r} already exists; choose another name")
        caller = sys._getframe(1).f_code.co_name  # the builder method, named in the warning about a discarded result
        method = caller if sys._getframe(1).f_globals is globals() and caller in _BUILDERS else "add"
        child = self._made(attrs.evolve(self, operators=steps + ((name, op),)), f"{method}(...)")
        if isinstance(op, TokenizerOp):
            _prestart(child.run_options, child)  # its workers build the new encoder while the caller works
        return child

    def _made(self, child: "Pipeline", call: str, note: str = "") -> "Pipeline":
        """``child``, recorded as made from this pipeline by ``call`` (see :meth:`_note_run`)."""
        child._notes.origin = origin = _Origin(call, self._notes.origin, note)
        made = [m for m in self._notes.made if not m[1].used]
        self._notes.made = [*made, (weakref.ref(child), origin)]
        return child

    def _note_run(self) -> None:
        """Mark this pipeline used; warn once about each pipeline made from it and collected unused
        (``p.tokenize(...)`` as a statement). A result still alive is a deliberate variant."""
        notes, origin = self._notes, self._notes.origin
        while origin is not None and not origin.used:  # this pipeline and its ancestors
            origin.used = True
            origin = origin.parent
        discarded = [o for ref, o in notes.made if ref() is None and not o.used]
        notes.made = [m for m in notes.made if m[0]() is not None and not m[1].used]
        for origin in discarded:
            fix = origin.call if origin.call.startswith("options(") else origin.call.split("(")[0] + "(...)"
            _warn_at_caller(
                f"Pipeline.{origin.call} returned a new pipeline that was discarded: pipelines are values, and "
                f"builder methods never change the pipeline they are called on. Write `p = p.{fix}` (or chain "
                f"the calls). Running this pipeline without it.{origin.note} Code written for pipelines that change "
                "in place (Zephon 0.2.0's style) can wrap one: `p = zephon.compat.Pipeline(p)`."
            )

    def map(
        self, fn: Callable[[Any], Any], *, name: str | None = None, fingerprint: str | None = None,
        on_error: str = "raise", max_skipped: int | float | None = None,
    ) -> "Pipeline":
        """Replace each payload with ``fn(payload)``; returning ``None`` drops the record.

        ``fn`` is fingerprinted (source, closure, defaults, globals read), so a restore into
        another ``fn`` is refused; a value it cannot describe warns and refuses restores until
        ``fingerprint="v1"`` names the version. ``on_error="skip"`` leaves out records on which
        ``fn`` raises (``stats()["skipped"]``), up to ``max_skipped`` (a count, or a float share).
        """
        op = MapOp(fn, fn_fingerprint=fingerprint, on_error=on_error, max_skipped=max_skipped)
        return _checked_function(self.add(op, name=name))

    def filter(
        self, predicate: Callable[[Any], bool], *, name: str | None = None, fingerprint: str | None = None,
        on_error: str = "raise", max_skipped: int | float | None = None,
    ) -> "Pipeline":
        """Keep only the payloads for which ``predicate(payload)`` is true (drops are counted); see :meth:`map`."""
        op = FilterOp(predicate, predicate_fingerprint=fingerprint, on_error=on_error, max_skipped=max_skipped)
        return _checked_function(self.add(op, name=name))

    def tokenize(
        self, tokenizer: Any = None, tokenizer_id: str | None = None, *, prompt_field: str | None = None,
        completion_field: str | None = None, name: str | None = None, **kwargs: Any,
    ) -> "Pipeline":
        """Tokenize a text field into ``input_ids`` (:class:`zephon.ops.Tokenize`).

        With ``prompt_field`` and ``completion_field``, the ``loss_mask`` covers the completion and
        its EOS (:class:`zephon.ops.TokenizePromptCompletion`). ``on_error`` as for :meth:`map`.
        """
        if prompt_field is None and completion_field is None:
            return self.add(Tokenize(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **kwargs), name=name)
        if prompt_field is None or completion_field is None:
            raise ValueError(
                "tokenize: prompt_field and completion_field go together; pass both (e.g. prompt_field='prompt', "
                "completion_field='completion'), or neither to tokenize a single text field"
            )
        text_only = sorted(set(kwargs) & {"field", "split_long_samples", "missing_field", "preserve_upstream_payload"})
        if text_only:
            raise ValueError(
                f"tokenize: {text_only} apply to single-field tokenization only, not with prompt_field/completion_field"
            )
        from ..ops.chat import TokenizePromptCompletion

        fields = {"prompt_field": prompt_field, "completion_field": completion_field}
        op = TokenizePromptCompletion(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **fields, **kwargs)
        return self.add(op, name=name)

    def tokenize_chat(
        self, tokenizer: Any = None, tokenizer_id: str | None = None, *, name: str | None = None, **kwargs: Any
    ) -> "Pipeline":
        """Conversations to ``input_ids`` and ``loss_mask`` (:class:`zephon.ops.TokenizeChat`)."""
        from ..ops.chat import TokenizeChat

        return self.add(TokenizeChat(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **kwargs), name=name)

    def pack_flat(self, max_length: "int | LengthSchedule", *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Pack documents into rows of at most ``max_length`` tokens (:class:`zephon.ops.PackFlat`).

        ``max_length`` may be a :class:`~zephon.LengthSchedule` (for ``tokens_per_microbatch``).
        """
        return self.add(PackFlat(max_length, **kwargs), name=name)

    def pack_sequences(self, max_length: int, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Pack documents into envelopes ``{"packed_samples": [...]}``; see :class:`zephon.ops.PackSequences`."""
        return self.add(PackSequences(max_length, **kwargs), name=name)

    def shuffle(self, buffer_size: int, *, seed: int = 0, name: str | None = None) -> "Pipeline":
        """Shuffle each lane through a buffer of ``buffer_size`` records."""
        return self.add(Shuffle(buffer_size, seed=seed), name=name)

    def order_by(
        self, key: Any, window: int, *, reverse: bool = False, name: str | None = None, fingerprint: str | None = None
    ) -> "Pipeline":
        """Sort each lane's records by ``key`` within consecutive windows of ``window`` records.

        ``key``: a payload function (fingerprinted as in :meth:`map`), a field name, or
        :data:`zephon.ops.token_count`; see :class:`zephon.ops.OrderBy`.
        """
        return _checked_function(self.add(OrderBy(key, window, reverse=reverse, key_fingerprint=fingerprint), name=name))

    def batch(
        self, microbatch_size: int | None = None, *, drop_last: bool = True, group_by_length: bool = False,
        buffer_size: int | None = None, max_tokens: int | None = None, sort_window: int = 0,
        pad_to_multiple_of: int | None = None, oversized: str = "error", pad_token_id: int | None = None,
        tokens_per_microbatch: int | None = None, name: str | None = None,
    ) -> "Pipeline":
        """Group records into :class:`~zephon.types.SampleBatch`; see :class:`zephon.ops.Batch`.

        By ``microbatch_size`` rows, by a ``max_tokens`` budget of rows x longest row, or by
        ``tokens_per_microbatch`` of ``pack_flat`` rows. ``pad_token_id`` defaults to the last
        tokenizer's pad token, else its EOS.
        """
        handles = [op.tokenizer for _, op in self.operators if hasattr(op, "tokenizer")]
        handles = [h for h in handles if hasattr(h, "eos_token_id")]
        if pad_token_id is None and handles:
            pad = getattr(handles[-1], "pad_token_id", None)
            pad_token_id = pad if pad is not None else handles[-1].eos_token_id
        op = Batch(
            microbatch_size, drop_last=drop_last, group_by_length=group_by_length,
            buffer_size=buffer_size, max_tokens=max_tokens, sort_window=sort_window,
            pad_to_multiple_of=pad_to_multiple_of, oversized=oversized, pad_token_id=pad_token_id,
            tokens_per_microbatch=tokens_per_microbatch,
        )
        return self.add(op, name=name)

    def ensure_mixture(
        self, mixture: Any = None, *, max_buffer_size: int = 1000, weight_by: Any = "auto",
        drain_target_ratio: float = 0.8, obsolete_drain_rate: float = 0.0, name: str | None = None,
    ) -> "Pipeline":
        """Reorder each lane so its tokens per dataset follow ``mixture`` (default: the source's).

        Place it after ``tokenize`` and before packing; see :class:`zephon.ops.EnsureMixture`.
        """
        drains = {"drain_target_ratio": drain_target_ratio, "obsolete_drain_rate": obsolete_drain_rate}
        op = make_ensure_mixture(self.source, mixture, max_buffer_size=max_buffer_size, weight_by=weight_by, **drains)
        return self.add(op, name=name)

    @property
    def plan(self) -> Plan:
        """The compiled plan of the lanes; never measures a calibration (:meth:`compile` does)."""
        return self.compile(measure=False)

    def compile(self, checkpoint: dict[str, Any] | None = None, *, measure: bool = True) -> Plan:
        """The compiled plan; the token calibration comes from ``checkpoint`` (default
        :attr:`resume_from`), else the source, else is measured now (once per process).

        Raises:
            ValueError: ``measure=False`` and the calibration would have to be measured; an
                impossible plan (the source's error).
        """
        self._note_run()
        checkpoint = self.resume_from if checkpoint is None else checkpoint
        calibration = None  # the one frozen in the checkpoint's fingerprint, if there is one
        if self.source.needs_calibration:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                frozen = checkpoint["fingerprint"]["source"]["token_estimation"]
                calibration = Calibration.from_description(frozen)
        opts, L = self.run_options, self.run_options.canonical_replicas
        if not measure and calibration is None and step_size(self.source, Chain(self.operators), L).needs_calibration:
            raise ValueError(
                "Pipeline.plan never measures, and this source's mixture counts tokens without a calibration: use "
                "pipeline.compile() (measures it on a small sample with the pipeline's tokenizer), or loader.plan of a loader "
                "that ran; a source given its calibration (source.with_calibration(...)) needs no measuring"
            )
        key = repr(calibration.describe()) if calibration is not None else ""
        plans = self._notes.plans
        if key not in plans:
            chain = Chain(bind_lengths(self.operators))
            source = self.source if opts.io_options is None else self.source.with_io_options(opts.io_options)
            source = compile_source(source, chain, L, calibration=calibration)
            plans[key] = Plan(source, place_targets(chain, source, L), L, opts.read_size, opts.read_ahead)
        return plans[key]

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides the data: source (the plan), operators (the processing), lane count."""
        return self.compile().fingerprint()

    def change_plan(
        self, source: Any, *, from_step: int, checkpoint: dict[str, Any]
    ) -> tuple["Pipeline", dict[str, Any]]:
        """Change the plan (mixture, datasets, ends) of a running job from step ``from_step`` on.

        Returns ``(pipeline, checkpoint)``: the changed pipeline and ``checkpoint`` (every lane, at
        or before ``from_step``) restamped for it; see :mod:`zephon.pipeline.replan`.

        Raises:
            ValueError: a late or foreign checkpoint; a new source that drops, reorders or renames
                datasets or changes the order settings; a switch in the last, partial block.
        """
        return replan.change_plan(self, source, from_step=from_step, checkpoint=checkpoint)

    def topology(self) -> Topology:
        """This process's data-parallel degree and rank and the lanes it owns (validated)."""
        self._note_run()
        last = self.operators[-1][1] if self.operators else None
        if isinstance(last, Batch) and last.max_tokens is not None and self.run_options.global_batch_size is not None:
            raise ValueError(
                f"global_batch_size={self.run_options.global_batch_size} counts records, but batch(max_tokens="
                f"{last.max_tokens}) gives microbatches of a variable number of rows; drop global_batch_size (a global "
                "step is one microbatch per lane, at most L x max_tokens token slots)"
            )
        return resolve_topology(self.run_options, last.microbatch_size if isinstance(last, Batch) else None)

    def explain(self, *, measure: int = 0) -> Explanation:
        """The compiled plan: operators, settings, lanes, ranks, executor and checkpoint size.

        With ``measure``, lane 0 runs here for ``measure`` outputs to size its state.

        Examples:
            >>> from zephon import Pipeline
            >>> pipe = Pipeline([{"input_ids": [1, 2, 3]}] * 8).options(canonical_replicas=2).pack_flat(4).batch(2)
            >>> plan = pipe.explain().to_dict()
            >>> [o["name"] for o in plan["operators"]], plan["lanes"]["records_per_global_step"]
            (['pack_flat', 'batch'], 4)
            >>> plan["operators"][1]["performance_settings"]
            {'pad_token_id': None}

        Raises:
            ValueError: a topology iterating would refuse, with the same message.
        """
        return explain_plan(self.compile(), self.run_options, self.topology(), self.operators, measure=measure)

    def describe_step(self, step: int) -> list[dict[str, Any]]:
        """Per lane, the segments (dataset, shard, row, start, end) and padding of step ``step``.

        Runs every lane here from the start.
        """
        plan, out = self.compile(), []
        for lane in progress(range(plan.lanes), total=plan.lanes, desc=f"running lanes to step {step}", unit="lane"):
            state, item = plan.init(lane), None
            for _ in range(step + 1):
                state, item = plan.next(lane, state)
                if item is None:
                    break
            records = [] if item is None else (item.records if isinstance(item, SampleBatch) else [item])
            out.append({"lane": lane, "records": [describe_record(plan, r) for r in records]})
        return out

    def loader(self, checkpoint: dict[str, Any] | None = None, *, skip_steps: int = 0) -> Loader:
        """A new loader for this rank from ``checkpoint``, else :attr:`resume_from`, else the start,
        skipping the next ``skip_steps`` global steps (:meth:`Loader.skip_steps`).

        Raises:
            ValueError: a checkpoint of other data settings or without this rank's lanes; a bad
                ``skip_steps``, or one > 0 from a checkpoint inside a global step.
        """
        try:
            check_count(skip_steps)
        except ValueError:
            raise ValueError(
                f"loader: skip_steps must be an int >= 0 (global steps to skip), got {skip_steps!r}"
            ) from None
        _prestart(self.run_options)
        checkpoint = self.resume_from if checkpoint is None else checkpoint
        plan, topo = self.compile(checkpoint), self.topology()
        encoded = None if checkpoint is None else restored_lanes(plan, topo, self.run_options, checkpoint)
        loader = Loader(plan, topo, self.run_options, encoded)
        if skip_steps:
            try:
                loader.skip_steps(skip_steps)
            except BaseException:
                loader.close()
                raise
        return loader

    def __iter__(self) -> Loader:
        loader = self.loader()
        if not self.operators:  # text records then mean a forgotten or discarded ``tokenize``
            message = untokenized_warning(loader.plan, loader.topology.lanes[0])
            if message:
                _warn_at_caller(message)
        return loader

    def steps(self, *, concat: bool = False) -> Iterator[Any]:
        """Iterate by optimizer step with a new loader; see :meth:`Loader.steps`."""
        return self.loader().steps(concat=concat)

    def restore(self, checkpoint: dict[str, Any]) -> "Pipeline":
        """A new pipeline whose loaders and torch datasets start at ``checkpoint``.

        Raises:
            ValueError: a checkpoint of other data settings, listing the differing fields.
        """
        validate(self.compile(checkpoint).fingerprint(), checkpoint)
        note = " It runs from its own start, not from the checkpoint."
        return self._made(attrs.evolve(self, resume_from=_copy_checkpoint(checkpoint)), "restore(...)", note)

    def to_torch_dataset(self, *, checkpoint: dict[str, Any] | None = None, **to_training_options: Any) -> Any:
        """This rank's microbatches as training tensors, a torch ``IterableDataset`` (needs torch).

        Each iteration starts at ``checkpoint``, else :attr:`resume_from`, else the beginning; the
        options are :func:`~zephon.to_training`'s. See :mod:`zephon.integrations.torch`.
        """
        try:
            from ..integrations.torch import TrainingDataset
        except ImportError as exc:
            raise ImportError(f"to_torch_dataset needs torch: pip install 'zephon-lanes[torch]' ({exc})") from exc
        if checkpoint is None and self.resume_from is not None:
            checkpoint = _copy_checkpoint(self.resume_from)
        return TrainingDataset(self, checkpoint=checkpoint, **to_training_options)

    def __getattr__(self, name: str) -> Any:
        if name in _RUNNING:
            raise AttributeError(
                f"Pipeline.{name}(): a Pipeline is a value and runs nothing, so it has no checkpoint, stats or workers. "
                f"The loader that runs it owns them: `loader = iter(p)` (or `p.loader(checkpoint)`), then "
                f"`loader.{name}(...)`; resume with `p.loader(ck)` or `p = p.restore(ck)`. Code written for a pipeline "
                "object that runs in place (Zephon 0.2.0's style) can wrap it: `p = zephon.compat.Pipeline(p)`"
            )
        raise AttributeError(f"'Pipeline' object has no attribute {name!r}")

    def __enter__(self) -> Any:
        raise TypeError(
            "a Pipeline is a value, not a context manager: `with p.loader() as loader:` (or `with iter(p) as loader:`) "
            "closes the loader that runs it; zephon.compat.Pipeline(p) is a context manager for code written that way"
        )

    def __exit__(self, *exc: Any) -> None:  # pragma: no cover - __enter__ raises
        return None


def _copy_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``checkpoint``'s mapping and lane table; the lane states are shared (their checksums refuse edits)."""
    return {**checkpoint, "lanes": dict(checkpoint["lanes"])}
