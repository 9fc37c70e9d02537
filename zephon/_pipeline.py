"""The fluent ``Pipeline`` builder, its iterator, and checkpoint/restore.

A pipeline is a work source plus a named chain of operators, run as ``canonical_replicas`` (L)
independent lanes. Iterating yields one output per lane in turn (lane 0, lane 1, ..., lane 0, ...);
each output is lane-pure. Everything is a pure function of the lane states, so checkpoints are the
states of what the caller has received, and a restore picks up exactly where it left off.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Iterator

import attrs

from ._batch import Batch
from ._core import Chain, FilterOp, MapOp, Operator
from ._lanes import FORMAT, LaneState, Plan
from ._pack import PackFlat
from ._shuffle import Shuffle
from .work._source import make_source


@attrs.frozen
class Options:
    """Run settings. ``canonical_replicas`` decides the data; the others only performance."""

    canonical_replicas: int = 1
    read_size: int = 64

    def __attrs_post_init__(self) -> None:
        for name in ("canonical_replicas", "read_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"options: {name} must be an int >= 1, got {v!r}")


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
        """Set run options: ``canonical_replicas`` (L lanes, data-deciding), ``read_size``."""
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
        if getattr(op, "fans_out", False) and any(not _is_stateless(o) for _, o in self._steps):
            raise ValueError(
                f"{op.kind} splits records, so it must come before every buffering operator "
                f"(it follows {[n for n, o in self._steps if not _is_stateless(o)]})"
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

    def tokenize(self, tokenizer: Any = None, tokenizer_id: str | None = None, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Tokenize a text field into ``input_ids``; see :class:`zephon.ops.Tokenize`."""
        from ._tokenize import Tokenize

        return self.add(Tokenize(tokenizer=tokenizer, tokenizer_id=tokenizer_id, **kwargs), name=name)

    def pack_flat(self, max_length: int, *, name: str | None = None, **kwargs: Any) -> "Pipeline":
        """Pack documents into rows of exactly ``max_length`` tokens; see :class:`zephon.ops.PackFlat`."""
        return self.add(PackFlat(max_length, **kwargs), name=name)

    def shuffle(self, buffer_size: int, *, seed: int = 0, name: str | None = None) -> "Pipeline":
        """Shuffle each lane through a buffer of ``buffer_size`` records."""
        return self.add(Shuffle(buffer_size, seed=seed), name=name)

    def batch(self, microbatch_size: int, *, drop_last: bool = True, name: str | None = None) -> "Pipeline":
        """Group records into lane-pure :class:`~zephon.types.SampleBatch` of ``microbatch_size``."""
        return self.add(Batch(microbatch_size, drop_last=drop_last), name=name)

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

    # -- running ----------------------------------------------------------------------------------------
    def __iter__(self) -> "PipelineIterator":
        plan = self.plan
        if self._pending_restore is not None:
            states = _restore_states(plan, self._pending_restore)
            self._pending_restore = None
        else:
            states = {lane: plan.init(lane) for lane in range(plan.lanes)}
        self._iterator = PipelineIterator(plan, states)
        return self._iterator

    def checkpoint(self) -> dict[str, Any]:
        """The state after the last output delivered by the current iterator (JSON/msgpack-safe).

        Before iteration it is the start (or the pending restore).
        """
        if self._iterator is not None:
            return self._iterator.checkpoint()
        if self._pending_restore is not None:
            return copy.deepcopy(self._pending_restore)
        plan = self.plan
        return _checkpoint(plan, {lane: plan.init(lane) for lane in range(plan.lanes)})

    def restore(self, checkpoint: dict[str, Any]) -> "Pipeline":
        """Resume from ``checkpoint`` at the next ``iter()``; fails loudly if the data settings differ."""
        _validate(self.plan, checkpoint)
        self._pending_restore = checkpoint
        self._iterator = None
        return self

    def stats(self) -> dict[str, Any]:
        """Counters of the current iterator: outputs per lane and every operator's drops."""
        if self._iterator is None:
            return {"delivered": 0, "lanes": {}, "operators": {}}
        return self._iterator.stats()


def _is_stateless(op: Operator) -> bool:
    from ._core import StatelessOp

    return isinstance(op, StatelessOp)


class PipelineIterator(Iterator[Any]):
    """Yields lane outputs round-robin; ``checkpoint()`` covers exactly what it has yielded."""

    def __init__(self, plan: Plan, states: dict[int, LaneState]):
        self.plan = plan
        self.states = dict(states)
        self.finished = False

    def __iter__(self) -> "PipelineIterator":
        return self

    def next_lane(self) -> int:
        return min(self.states, key=lambda lane: (self.states[lane].delivered, lane))

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        lane = self.next_lane()
        state, out = self.plan.next(lane, self.states[lane])
        if out is None:
            self.finished = True
            raise StopIteration
        self.states[lane] = state
        return out

    def checkpoint(self) -> dict[str, Any]:
        return _checkpoint(self.plan, self.states)

    def stats(self) -> dict[str, Any]:
        ops: dict[str, dict[str, int]] = {}
        for state in self.states.values():
            for (name, op), s in zip(self.plan.chain.children, state.chain.states):
                report = getattr(op, "report", None)
                if report is None:
                    continue
                agg = ops.setdefault(name, {})
                for k, v in report(s).items():
                    agg[k] = agg.get(k, 0) + v
        return {
            "delivered": sum(s.delivered for s in self.states.values()),
            "lanes": {lane: {"delivered": s.delivered, "done": s.done, "undelivered": len(s.pending)} for lane, s in self.states.items()},
            "operators": ops,
        }


def _checkpoint(plan: Plan, states: dict[int, LaneState]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "fingerprint": plan.fingerprint(),
        "lanes": {str(lane): plan.encode(s) for lane, s in sorted(states.items())},
    }


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


def _restore_states(plan: Plan, checkpoint: dict[str, Any]) -> dict[int, LaneState]:
    lanes = checkpoint["lanes"]
    want = {str(lane) for lane in range(plan.lanes)}
    if set(lanes) != want:
        raise ValueError(f"checkpoint has lanes {sorted(lanes, key=int)}, the pipeline needs {sorted(want, key=int)}")
    return {int(lane): plan.decode(int(lane), data) for lane, data in lanes.items()}


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
