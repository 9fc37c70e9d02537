"""The fluent ``Pipeline`` builder, its iterator, and checkpoint/restore.

A pipeline is a work source plus a named chain of operators, run as ``canonical_replicas`` (L)
independent lanes. Iterating yields one output per lane in turn (lane 0, lane 1, ..., lane 0, ...);
each output is lane-pure. Everything is a pure function of the lane states, so checkpoints are the
states of what the caller has received, and a restore picks up exactly where it left off.
"""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any, Callable, Iterator

import attrs

from ._batch import Batch
from ._core import Chain, FilterOp, MapOp, Operator, StatelessOp
from ._distributed import Topology, checkpoint_to_state_dict, resolve_topology, state_dict_to_checkpoint
from ._distributed import select_lanes as _select_lanes
from ._executor import InlineExecutor, ProcessExecutor, ThreadExecutor
from ._lanes import FORMAT, Plan
from ._records import SampleBatch
from ._pack import PackFlat, PackSequences
from ._shuffle import Shuffle
from .work._source import make_source


def _opt_int(minimum: int):
    def check(instance, attribute, value):
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"options: {attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


@attrs.frozen
class Options:
    """Run settings.

    Attributes:
        canonical_replicas: L, the number of lanes. Decides the data; keep it fixed for a run and
            choose a common multiple of every data-parallel size you may use.
        dp_degree: D, data-parallel ranks sharing the lanes (L/D each). ``None``: from
            ``torch.distributed`` when initialized, else ``WORLD_SIZE``, else 1.
        dp_rank: this rank's data-parallel index. ``None``: from ``torch.distributed``, else
            ``RANK``, else 0. Tensor/pipeline-parallel peers pass their shared DP rank explicitly.
        workers: worker processes that run this rank's lanes ahead (0: in the calling thread).
        prefetch: outputs each lane may run ahead of the caller (with ``workers > 0`` or ``thread``).
        read_size: source samples read per lane step (tokenizer batch size).
        global_batch_size: optional check: records per optimizer step must be a multiple of
            L x microbatch_size (each global step takes one microbatch from every lane).
        thread: with ``workers=0``, run the lanes ahead in a background thread (``prefetch``
            outputs per lane) so reading and tokenizing overlap with the caller's work.
        drain: at the end of finite data, keep delivering the outputs of lanes that still have
            some (round-robin) instead of stopping at the first incomplete global step. The
            drained tail is not a whole global step, so it is the same only for the same D.
    """

    canonical_replicas: int = attrs.field(default=1, validator=_opt_int(1))
    dp_degree: int | None = attrs.field(default=None, validator=_opt_int(1))
    dp_rank: int | None = attrs.field(default=None, validator=_opt_int(0))
    workers: int = attrs.field(default=0, validator=_opt_int(0))
    prefetch: int = attrs.field(default=4, validator=_opt_int(1))
    read_size: int = attrs.field(default=64, validator=_opt_int(1))
    global_batch_size: int | None = attrs.field(default=None, validator=_opt_int(1))
    drain: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    thread: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


class Pipeline:
    """Build a deterministic data pipeline by chaining operators.

    Args:
        source: a :class:`~zephon.work.StaticMixtureWorkSource`, a :class:`~zephon.io.Dataset`,
            or a plain list of dicts.

    Examples:
        >>> from zephon import Pipeline
        >>> rows = [{"n": i} for i in range(10)]
        >>> pipe = Pipeline(rows).map(lambda p: {"n": p["n"] * 10}).batch(4)
        >>> [[r.payload["n"] for r in b.records] for b in pipe]
        [[0, 10, 20, 30], [40, 50, 60, 70]]
    """

    def __init__(self, source: Any):
        self.source = make_source(source)
        self._steps: list[tuple[str, Operator]] = []
        self._options = Options()
        self._pending_restore: dict | None = None
        self._iterator: PipelineIterator | None = None

    # -- building -------------------------------------------------------------------------------------
    def options(self, **kwargs: Any) -> "Pipeline":
        """Set run options (see :class:`Options`); ``num_workers`` is accepted for ``workers``."""
        if "num_workers" in kwargs:
            kwargs["workers"] = kwargs.pop("num_workers")
        unknown = sorted(set(kwargs) - {f.name for f in attrs.fields(Options)})
        if unknown:
            raise TypeError(f"options: unknown option(s) {unknown}; known: {[f.name for f in attrs.fields(Options)]}")
        self._options = attrs.evolve(self._options, **kwargs)
        return self._changed()

    def add(self, op: Operator, *, name: str | None = None) -> "Pipeline":
        """Append any operator under ``name`` (default: its kind, numbered when repeated)."""
        if not isinstance(op, Operator):
            raise TypeError(f"add() takes an operator, got {type(op).__name__}; wrap functions with zephon.ops.stateless")
        if self._steps and isinstance(self._steps[-1][1], Batch):
            raise ValueError(f"{op.kind} cannot come after batch(); batch() must be the last step")
        if getattr(op, "fans_out", False) and any(not isinstance(o, StatelessOp) for _, o in self._steps):
            raise ValueError(
                f"{op.kind} splits records, so it must come before every buffering operator "
                f"(it follows {[n for n, o in self._steps if not isinstance(o, StatelessOp)]})"
            )
        taken = {n for n, _ in self._steps}
        if name is None:
            name, i = op.kind, 1
            while name in taken:
                name, i = f"{op.kind}_{i}", i + 1
        elif name in taken:
            raise ValueError(f"an operator named {name!r} already exists; choose another name")
        self._steps.append((name, op))
        return self._changed()

    def map(self, fn: Callable[[Any], Any], *, name: str | None = None) -> "Pipeline":
        """Replace each payload with ``fn(payload)``; returning ``None`` drops the record."""
        return self.add(MapOp(fn), name=name)

    def filter(self, predicate: Callable[[Any], bool], *, name: str | None = None) -> "Pipeline":
        """Keep only the payloads for which ``predicate(payload)`` is true (drops are counted)."""
        return self.add(FilterOp(predicate), name=name)

    def tokenize(
        self,
        tokenizer: Any = None,
        tokenizer_id: str | None = None,
        *,
        prompt_field: str | None = None,
        completion_field: str | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> "Pipeline":
        """Tokenize a text field into ``input_ids``; see :class:`zephon.ops.Tokenize`.

        With ``prompt_field`` and ``completion_field``, tokenize prompt/completion records instead:
        ``input_ids`` plus a ``loss_mask`` that is 1 on the completion (and its EOS) only; see
        :class:`zephon.ops.TokenizePromptCompletion`.
        """
        if prompt_field is None and completion_field is None:
            from ._tokenize import Tokenize

            return self.add(Tokenize(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **kwargs), name=name)
        if prompt_field is None or completion_field is None:
            raise ValueError(
                "tokenize: prompt_field and completion_field go together; pass both (e.g. prompt_field='prompt', "
                "completion_field='completion'), or neither to tokenize a single text field"
            )
        text_only = sorted(set(kwargs) & {"field", "split_long_samples", "missing_field", "preserve_upstream_payload"})
        if text_only:
            raise ValueError(f"tokenize: {text_only} apply to single-field tokenization only, not with prompt_field/completion_field")
        from ._chat import TokenizePromptCompletion

        op = TokenizePromptCompletion(
            tokenizer=tokenizer, tokenizer_id=tokenizer_id, prompt_field=prompt_field, completion_field=completion_field, **kwargs
        )
        return self.add(op, name=name)

    def tokenize_chat(self, tokenizer: Any = None, tokenizer_id: str | None = None, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Render conversations with a chat template into ``input_ids`` and an assistant ``loss_mask``.

        See :class:`zephon.ops.TokenizeChat` (``loss_scope``, built-in ``"chatml"``/``"llama3"``
        templates, ``{% generation %}`` tags or prefix rendering, ``empty_mask``).
        """
        from ._chat import TokenizeChat

        return self.add(TokenizeChat(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **kwargs), name=name)

    def pack_flat(self, max_length: int, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Pack documents into rows of at most ``max_length`` tokens; see :class:`zephon.ops.PackFlat`.

        ``algorithm`` is ``"wrap"`` (the default here; Zephon's is ``"first_fit"``), ``"first_fit"``,
        ``"best_fit"`` or ``"best_fit_wrap"``.
        """
        return self.add(PackFlat(max_length, **kwargs), name=name)

    def pack_sequences(self, max_length: int, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Pack documents into envelopes ``{"packed_samples": [...]}``; see :class:`zephon.ops.PackSequences`."""
        return self.add(PackSequences(max_length, **kwargs), name=name)

    def shuffle(self, buffer_size: int, *, seed: int = 0, name: str | None = None) -> "Pipeline":
        """Shuffle each lane through a buffer of ``buffer_size`` records."""
        return self.add(Shuffle(buffer_size, seed=seed), name=name)

    def batch(
        self,
        microbatch_size: int,
        *,
        drop_last: bool = True,
        group_by_length: bool = False,
        buffer_size: int | None = None,
        name: str | None = None,
    ) -> "Pipeline":
        """Group records into lane-pure :class:`~zephon.types.SampleBatch` of ``microbatch_size``.

        ``group_by_length=True`` batches records of similar length (sorting ``buffer_size``
        records at a time) to cut padding of ragged records; see :class:`zephon.ops.Batch`.
        """
        return self.add(Batch(microbatch_size, drop_last=drop_last, group_by_length=group_by_length, buffer_size=buffer_size), name=name)

    def _changed(self) -> "Pipeline":
        self._iterator = None
        return self

    # -- compiled view ----------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return Plan(self.source, Chain(tuple(self._steps)), self._options.canonical_replicas, self._options.read_size)

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides the data: source, operators, lane count."""
        return self.plan.fingerprint()

    # -- topology -------------------------------------------------------------------------------------
    def topology(self) -> Topology:
        """This process's data-parallel degree and rank and the lanes it owns (validated)."""
        return resolve_topology(self._options, self._microbatch_size())

    def _microbatch_size(self) -> int | None:
        last = self._steps[-1][1] if self._steps else None
        return last.microbatch_size if isinstance(last, Batch) else None

    # -- running ----------------------------------------------------------------------------------------
    def __iter__(self) -> "PipelineIterator":
        if self._iterator is not None:
            self._iterator.close()
        plan, topo = self.plan, self.topology()
        encoded = None
        if self._pending_restore is not None:
            encoded = _select_lanes(self._pending_restore, topo.lanes)
            self._pending_restore = None
        self._iterator = PipelineIterator(plan, topo, encoded, self._options)
        return self._iterator

    def steps(self, *, concat: bool = False) -> Iterator[Any]:
        """Iterate by optimizer step: this rank's L/D microbatches of each global step, in lane order.

        Args:
            concat: yield one :class:`~zephon.types.SampleBatch` holding the step's records
                instead of a list of microbatches.
        """
        it = iter(self)
        per_step = len(it.topology.lanes)
        while True:
            group = []
            for _ in range(per_step):
                try:
                    group.append(next(it))
                except StopIteration:
                    return
            yield SampleBatch(tuple(r for b in group for r in b.records)) if concat else group

    def checkpoint(self) -> dict[str, Any]:
        """This rank's lane states after the last output delivered (JSON/msgpack-safe).

        Lanes are keyed by global lane id, so checkpoints of every rank can be merged with
        :func:`merge_checkpoints` and restored on any number of ranks dividing L. Before
        iteration it is the start (or the pending restore).
        """
        if self._iterator is not None:
            return self._iterator.checkpoint()
        topo = self.topology()
        if self._pending_restore is not None:
            lanes = _select_lanes(self._pending_restore, topo.lanes)
            return {**self._pending_restore, "lanes": {str(k): v for k, v in lanes.items()}}
        plan = self.plan
        return _checkpoint(plan, {lane: plan.encode(plan.init(lane)) for lane in topo.lanes})

    def restore(self, checkpoint: dict[str, Any]) -> "Pipeline":
        """Resume from ``checkpoint`` (one rank's, merged, or full) at the next ``iter()``.

        Fails loudly, listing the differing fields, if the data settings differ; performance
        settings (workers, prefetch, read size, the number of ranks) may change freely.
        """
        _validate(self.plan, checkpoint)
        self._pending_restore = copy.deepcopy(checkpoint)
        if self._iterator is not None:
            self._iterator.close()
        self._iterator = None
        return self

    # torch.distributed.checkpoint ``Stateful`` protocol: one key per lane, so DCP can save each
    # rank's lanes and load them back on any data-parallel size.
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint as a DCP-friendly mapping (``{"fingerprint": ..., "lane_00003": ...}``)."""
        return checkpoint_to_state_dict(self.checkpoint())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (possibly loaded on another number of ranks)."""
        self.restore(state_dict_to_checkpoint(state_dict))

    def stats(self) -> dict[str, Any]:
        """Counters of the current iterator: outputs per lane and every operator's drops."""
        if self._iterator is None:
            return {"delivered": 0, "lanes": {}, "operators": {}}
        return self._iterator.stats()

    def describe_step(self, step: int) -> list[dict[str, Any]]:
        """Which source samples and token ranges make up global step ``step``, lane by lane.

        Runs every lane (in this process, from the start) up to that step; no training needed.
        Returns one entry per lane: its records' segments as
        ``(dataset name, shard id, row, start, end)`` and their padding.
        """
        plan = self.plan
        out = []
        for lane in range(plan.lanes):
            state, item = plan.init(lane), None
            for _ in range(step + 1):
                state, item = plan.next(lane, state)
                if item is None:
                    break
            records = [] if item is None else (item.records if isinstance(item, SampleBatch) else [item])
            out.append({"lane": lane, "records": [_describe_record(plan, r) for r in records]})
        return out

    def close(self) -> None:
        """Stop worker processes (also done when the pipeline is garbage collected)."""
        if self._iterator is not None:
            self._iterator.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _describe_record(plan: Plan, rec: Any) -> dict[str, Any]:
    ds = plan.source.datasets
    return {
        "segments": [
            (ds[s.dataset].name, ds[s.dataset].shard_ids[s.shard], s.row, s.start, s.end) for s in rec.meta.segments
        ],
        "padding_length": rec.meta.padding_length,
    }


class PipelineIterator(Iterator[Any]):
    """Yields this rank's lane outputs round-robin; ``checkpoint()`` covers exactly what it yielded."""

    def __init__(self, plan: Plan, topology: Topology, encoded: dict[int, Any] | None, options: Options = Options()):
        self.plan = plan
        self.drain = options.drain
        self.ended: dict[int, int] = {}
        self.topology = topology
        lanes = list(topology.lanes)
        self.delivered = {lane: (encoded[lane]["delivered"] if encoded else 0) for lane in lanes}
        if options.workers > 0:
            self.executor: Any = ProcessExecutor(plan, lanes, options.workers, encoded=encoded, credit=options.prefetch)
        else:
            states = {lane: (plan.decode(lane, encoded[lane]) if encoded else plan.init(lane)) for lane in lanes}
            self.executor = ThreadExecutor(plan, states, options.prefetch) if options.thread else InlineExecutor(plan, states)
        self.finished = False
        self._final_states: dict[int, Any] | None = None
        self._final_reports: dict[int, Any] | None = None

    def __iter__(self) -> "PipelineIterator":
        return self

    def next_lane(self) -> int:
        live = [lane for lane in self.delivered if lane not in self.ended]
        return min(live, key=lambda lane: (self.delivered[lane], lane))

    def __next__(self) -> Any:
        while not self.finished:
            lane = self.next_lane()
            out = self.executor.next(lane)
            if out is not None:
                self.delivered[lane] += 1
                return out
            self.ended[lane] = self.delivered[lane]
            if self.delivered[lane] == 0:
                warnings.warn(
                    f"lane {lane} has no data at all: the source has fewer work chunks than lanes. Lower "
                    "StaticMixtureWorkSource(chunk_size=...) or canonical_replicas, or pass options(drain=True)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if not self.drain or len(self.ended) == len(self.delivered):
                self.finished = True
                self.close()
        raise StopIteration

    def checkpoint(self) -> dict[str, Any]:
        if self._final_states is not None:
            return _checkpoint(self.plan, self._final_states)
        return _checkpoint(self.plan, self.executor.lane_states())

    def close(self) -> None:
        """Stop any worker thread or processes, keeping the final states so ``checkpoint()`` still works."""
        if isinstance(self.executor, ProcessExecutor) and not self.executor.closed:
            try:  # worker-held states are gone once the processes stop: read them first
                self._final_states = self.executor.lane_states()
                self._final_reports = self.executor.reports()
            finally:
                self.executor.close()
        self.executor.close()

    def stats(self) -> dict[str, Any]:
        reports = self._final_reports if self._final_reports is not None else self.executor.reports()
        ops: dict[str, dict[str, int]] = {}
        for lane_report in reports.values():
            for name, counters in lane_report.items():
                agg = ops.setdefault(name, {})
                for k, v in counters.items():
                    agg[k] = agg.get(k, 0) + v
        return {
            "delivered": sum(self.delivered.values()),
            "lanes": {lane: {"delivered": n, "ended": lane in self.ended} for lane, n in self.delivered.items()},
            "complete_steps": min(self.delivered.values()),
            "operators": ops,
        }


def _checkpoint(plan: Plan, encoded: dict[int, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "fingerprint": plan.fingerprint(), "lanes": {str(lane): encoded[lane] for lane in sorted(encoded)}}


def _validate(plan: Plan, checkpoint: Any) -> None:
    if not isinstance(checkpoint, dict):
        raise TypeError(f"restore() takes the dict returned by checkpoint(), got {type(checkpoint).__name__}")
    missing = [k for k in ("format", "fingerprint", "lanes") if k not in checkpoint]
    if missing:
        raise ValueError(f"not a zephon checkpoint: missing fields {missing}")
    if checkpoint["format"] != FORMAT:
        raise ValueError(f"checkpoint format {checkpoint['format']!r} is not supported (this version reads {FORMAT!r})")
    diffs = fingerprint_diff(checkpoint["fingerprint"], plan.fingerprint())
    if diffs:
        lines = "\n".join(f"  {path}: checkpoint={a} pipeline={b}" for path, a, b in diffs[:20])
        more = f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
        raise ValueError(
            "cannot restore: the checkpoint was taken with different data settings; these differ:\n"
            f"{lines}{more}\nRebuild the pipeline with the checkpoint's settings (performance options may differ)."
        )


def fingerprint_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, str, str]]:
    """The paths where two fingerprints differ, with short renderings of both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append((sub, _short(a.get(k, "<absent>")), _short(b.get(k, "<absent>"))))
            else:
                out.extend(fingerprint_diff(a[k], b[k], sub))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out.extend(fingerprint_diff(x, y, f"{path}[{i}]"))
        return out
    if _norm(a) != _norm(b):
        return [(path or "<root>", _short(a), _short(b))]
    return []


def _norm(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True, default=str))


def _short(x: Any) -> str:
    s = json.dumps(x, sort_keys=True, default=str)
    return s if len(s) <= 80 else s[:77] + "..."
