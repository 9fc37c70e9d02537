"""The operator protocol, stateless operators and named chains.

An operator is a frozen configuration with pure functions (optax's shape): ``init(key) -> state``,
``step(state, chunk) -> (state, outputs)``, ``flush(state) -> (state, outputs)`` (run at the end
of a lane's data until it returns nothing) and ``fingerprint()``. Inputs are never mutated, and
any split of a stream into chunks gives the same outputs. Checkpoints hold records by reference
(:mod:`zephon.core.state`); records in an operator's state are records at its *input*, rebuilt on
decode with the resolver of its input.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import attrs
import msgspec

from . import state as _state
from .fingerprint import describe_callable, is_callable_value
from .keys import fold_in
from .records import Meta, Record, Segment, describe_meta
from .bad_records import Failure, SkipLog, check_limit, check_max_skipped, check_on_error, logged, skippable
from .state import Resolver

#: Multiplier that keeps child numbers of nested fan-outs distinct.
CHILD_BASE = 1 << 16


class Empty(msgspec.Struct, frozen=True, tag="empty", forbid_unknown_fields=True):
    """The state of a stateless operator."""


EMPTY = Empty()


def config_field(
    *, default: Any = attrs.NOTHING, data: bool = True, validator=None, converter=None, kw_only: bool = False,
    omit_default: bool = False,
):
    """An operator setting; ``data=False``: it cannot change the output (not fingerprinted);
    ``omit_default``: not fingerprinted at its default, so a new setting changes no fingerprint."""
    metadata = {"data": data, "omit_default": omit_default}
    return attrs.field(default=default, validator=validator, converter=converter, kw_only=kw_only, metadata=metadata)


class Operator:
    """Base class of operators: ``@attrs.frozen``, module-level (picklable) subclasses.

    Class attributes: ``kind`` (its default name in a pipeline), ``state_type`` (the tagged frozen
    ``msgspec.Struct`` of its state), ``fans_out`` (one input may give several outputs, with new
    child numbers) and ``reads_held_payloads`` (``False`` when ``step``/``flush`` never read the
    payloads the state holds, so a restore may leave them as references). Override ``rebuild``
    only when outputs are new records, ``decode_state`` only to refuse values ``step`` never leaves.
    """

    kind: ClassVar[str] = "op"
    state_type: ClassVar[type] = Empty
    fans_out: ClassVar[bool] = False
    reads_held_payloads: ClassVar[bool] = True

    def init(self, key: int) -> Any:
        return EMPTY

    def step(self, state: Any, chunk: Sequence[Any]) -> tuple[Any, list]:
        raise NotImplementedError

    def flush(self, state: Any) -> tuple[Any, list]:
        return state, []

    def report(self, state: Any) -> dict[str, int]:
        """Counters kept in ``state`` (drops, rows, ...), shown by ``stats()``; none by default."""
        return {}

    def rebuild(self, refs: Sequence[Any], upstream: Resolver) -> list:
        """Outputs rebuilt from their refs, ``upstream`` giving the inputs (default: the inputs)."""
        return upstream(refs)

    def encode_state(self, state: Any) -> Any:
        """The state as builtins (JSON- and msgpack-safe); records become their metas."""
        return _state.encode(state)

    def decode_state(self, data: Any, upstream: Resolver) -> Any:
        """Inverse of :meth:`encode_state`; held records are rebuilt with ``upstream``."""
        return _state.resolve(_state.decode(data, state_type(self)), upstream)

    def fingerprint(self) -> dict[str, Any]:
        """Every setting that decides the output (``data=False`` fields are left out)."""
        out: dict[str, Any] = {"op": type(self).__name__}
        for f in attrs.fields(type(self)):
            value, meta = getattr(self, f.name), f.metadata
            if meta.get("data", True) and not (meta.get("omit_default") and value == f.default):
                out[f.name] = describe(value)
        return out


def describe(value: Any) -> Any:
    """A stable, JSON-friendly description of a configuration value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    fp = getattr(value, "fingerprint", None)
    if callable(fp):
        return fp()
    if is_callable_value(value):
        return describe_callable(value)
    qual = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None) or type(value).__module__
    return f"{module}.{qual}"


def state_type(op: Operator) -> type:
    """The Struct type of ``op``'s states: its ``state_type``, else the type ``init`` returns."""
    declared = type(op).state_type
    return type(op.init(0)) if declared is Empty and type(op).init is not Operator.init else declared


class StatelessState(msgspec.Struct, frozen=True, tag="stateless", forbid_unknown_fields=True, omit_defaults=True):
    """A per-payload operator's count of inputs that produced nothing, and its skip log."""

    dropped_records: int = 0
    skips: SkipLog | None = None


class Applied(NamedTuple):
    """What a per-payload operator made of a chunk: outputs, inputs that produced none, inputs skipped."""

    outputs: list
    dropped: int
    skipped: tuple[tuple[int, Meta, Failure], ...] = ()  # (position in the chunk, meta, failure)


@attrs.frozen
class StatelessOp(Operator):
    """An operator applied to each payload independently.

    Subclasses implement :meth:`apply_many`: a chunk's payloads to, per payload, a list of output
    payloads (empty drops it, several split it when ``fans_out``). With ``on_error="skip"`` a
    payload whose processing raises is left out and logged (``apply_many`` may return a
    :class:`~zephon.core.bad_records.Failure` for it); ``max_skipped`` bounds a lane's skips.
    State: :class:`StatelessState`.
    """

    on_error: str = config_field(default="raise", kw_only=True, validator=check_on_error, omit_default=True)
    max_skipped: int | float | None = config_field(
        default=None, kw_only=True, data=False, validator=check_max_skipped, omit_default=True
    )
    state_type: ClassVar[type] = StatelessState

    def apply_many(self, payloads: list) -> list[list]:
        raise NotImplementedError

    def init(self, key: int) -> StatelessState:
        return StatelessState()

    def step(self, state: StatelessState, chunk: Sequence[Record]) -> tuple[StatelessState, list]:
        applied = self.apply_records(chunk)
        return self.advance(state, applied, len(chunk)), applied.outputs

    def advance(self, state: StatelessState, applied: Applied, seen: int) -> StatelessState:
        """The state after ``applied`` for a chunk of ``seen`` inputs; raises
        :class:`~zephon.core.bad_records.SkipLimitError` past ``max_skipped``."""
        if self.on_error == "raise":
            return StatelessState(state.dropped_records + applied.dropped) if applied.dropped else state
        check_limit(state.skips, seen, applied.skipped, self.max_skipped, self.kind)
        return StatelessState(state.dropped_records + applied.dropped, logged(state.skips, seen, applied.skipped))

    def report(self, state: StatelessState) -> dict[str, int]:
        out = {"dropped_records": state.dropped_records}
        if self.on_error == "skip":
            out["skipped_records"] = state.skips.total if state.skips is not None else 0
        return out

    def apply_checked(self, payloads: list) -> list:
        """:meth:`apply_many`; with ``on_error="skip"`` a :class:`~.bad_records.Failure` for each
        payload that raised (found by its ``zephon_index``, else payload by payload)."""
        if self.on_error == "raise" or not payloads:
            return self.apply_many(payloads)
        out: list = []
        rest = payloads
        while rest:
            try:
                return [*out, *self.apply_many(rest)]
            except Exception as exc:
                if not skippable(exc):
                    raise
                index = getattr(exc, "zephon_index", None)
                if len(rest) == 1:
                    return out + [Failure.of(exc)]
                if not isinstance(index, int) or not 0 <= index < len(rest):
                    return out + [r for p in rest for r in self.apply_checked([p])]
                out += [*self.apply_checked(rest[:index]), Failure.of(exc)]
                rest = rest[index + 1 :]
        return out

    def apply_records(self, chunk: Sequence[Record], results: list | None = None) -> Applied:
        """A chunk's :class:`Applied`; ``results``: its payloads' :meth:`apply_checked` if known."""
        if not chunk:
            return Applied([], 0)
        if results is None:
            try:
                results = self.apply_checked([r.payload for r in chunk])
            except Exception as exc:
                self._name_failing_record(exc, chunk)
                raise
        if len(results) != len(chunk):
            raise RuntimeError(f"{self.kind}: apply_many returned {len(results)} results for {len(chunk)} inputs")
        out: list[Record] = []
        dropped = 0
        skipped: list[tuple[int, Meta, Failure]] = []
        for position, (rec, outs) in enumerate(zip(chunk, results)):
            if type(outs) is Failure:
                skipped.append((position, rec.meta, outs))
                continue
            dropped += not outs
            if self.fans_out:
                out.extend(Record(p, child_meta(rec.meta, i)) for i, p in enumerate(outs))
            elif len(outs) > 1:
                raise RuntimeError(
                    f"{self.kind}: produced {len(outs)} outputs for one input but does not fan out"
                )
            elif outs:
                out.append(rec if outs[0] is rec.payload else Record(outs[0], rec.meta))
        return Applied(out, dropped, tuple(skipped))

    def _name_failing_record(self, exc: Exception, chunk: Sequence[Record]) -> None:
        """Note on ``exc`` the record it was raised on (its ``zephon_index``, else found by applying
        each payload alone), and keep its meta as ``exc.zephon_meta``."""
        if getattr(exc, "zephon_meta", None) is not None or not hasattr(exc, "add_note"):
            return  # already named (by an operator nested in this one)
        index = getattr(exc, "zephon_index", None)
        if index is None and len(chunk) == 1:
            index = 0
        elif index is None:
            index = next((i for i, rec in enumerate(chunk) if _fails(self, rec.payload)), None)
        if index is None or not 0 <= index < len(chunk):
            return
        meta = chunk[index].meta
        exc.add_note(f"zephon: raised by {self.kind} on {describe_meta(meta)}")
        with contextlib.suppress(AttributeError):  # an exception type may take no attributes
            exc.zephon_meta = meta  # type: ignore[attr-defined]

    def rebuild(self, refs: Sequence[Meta], upstream: Resolver) -> list[Record]:
        parents = [parent_meta(m) for m in refs] if self.fans_out else list(refs)
        produced = {rec.meta: rec for rec in self.apply_records(upstream(list(dict.fromkeys(parents)))).outputs}
        missing = [m for m in refs if m not in produced]
        if missing:
            raise RuntimeError(
                f"{self.kind}: could not rebuild {len(missing)} record(s) (first: {missing[0]!r}); "
                "a per-sample function is not deterministic or the data changed"
            )
        return [produced[m] for m in refs]


def _fails(op: StatelessOp, payload: Any) -> bool:
    try:
        op.apply_many([payload])
    except Exception:
        return True
    return False


def child_meta(meta: Meta, i: int) -> Meta:
    if i >= CHILD_BASE:
        raise ValueError(f"one record produced more than {CHILD_BASE} children; split it upstream into smaller records")
    (seg,) = meta.segments
    return Meta(meta.lane, (seg._replace(child=seg.child * CHILD_BASE + i),), meta.padding_length)


def parent_meta(meta: Meta) -> Meta:
    (seg,) = meta.segments
    return Meta(meta.lane, (seg._replace(child=seg.child // CHILD_BASE),), meta.padding_length)


def _each(fn: Callable[[Any], Any], payloads: list, skip: bool = False) -> list:
    """``fn`` over payloads; an exception carries the failing index so the record can be named
    (``skip``: a :class:`~zephon.core.bad_records.Failure` takes the place of its result instead)."""
    out = []
    for i, p in enumerate(payloads):
        try:
            out.append(fn(p))
        except Exception as exc:
            if skip and skippable(exc):
                out.append(Failure.of(exc))
                continue
            exc.zephon_index = i  # type: ignore[attr-defined]
            raise
    return out


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        kind = type(value).__name__
        raise TypeError(f"fingerprint must be a string naming the function's version (e.g. 'v1'), got {kind}")
    return value


def _fn_fingerprint(op: StatelessOp, kind: str, field: str) -> dict[str, Any]:
    """The fingerprint of an operator of one function: its version string, else its description;
    ``on_error`` only when not the default (older fingerprints lack it)."""
    name = getattr(op, f"{field}_fingerprint")
    out = {"op": kind, field: name if name is not None else describe_callable(getattr(op, field))}
    return out if op.on_error == "raise" else {**out, "on_error": op.on_error}


@attrs.frozen
class MapOp(StatelessOp):
    """``Pipeline.map(fn)`` / ``stateless(fn)``: replace each payload with ``fn(payload)``.

    ``None`` drops the record. ``fn`` must be deterministic, and picklable for worker processes.
    Its fingerprint covers what decides its output (:mod:`zephon.core.fingerprint`), unless
    ``fn_fingerprint`` names its version (for a function holding an open file or a model).
    """

    fn: Callable[[Any], Any]
    fn_fingerprint: str | None = attrs.field(default=None, kw_only=True, converter=_optional_str)
    kind: ClassVar[str] = "map"

    def apply_many(self, payloads: list) -> list[list]:
        results = _each(self.fn, payloads, self.on_error == "skip")
        return [r if type(r) is Failure else [] if r is None else [r] for r in results]

    def fingerprint(self) -> dict[str, Any]:
        return _fn_fingerprint(self, "MapOp", "fn")


@attrs.frozen
class FilterOp(StatelessOp):
    """``Pipeline.filter(predicate)``: keep payloads for which ``predicate(payload)`` is true.

    Fingerprinted as :class:`MapOp`'s ``fn``; ``predicate_fingerprint`` replaces the derived one.
    """

    predicate: Callable[[Any], bool]
    predicate_fingerprint: str | None = attrs.field(default=None, kw_only=True, converter=_optional_str)
    kind: ClassVar[str] = "filter"

    def apply_many(self, payloads: list) -> list[list]:
        keeps = _each(self.predicate, payloads, self.on_error == "skip")
        return [keep if type(keep) is Failure else [p] if keep else [] for p, keep in zip(payloads, keeps)]

    def fingerprint(self) -> dict[str, Any]:
        return _fn_fingerprint(self, "FilterOp", "predicate")


def stateless(fn: Callable[[Any], Any], *, fingerprint: str | None = None, **skipping: Any) -> MapOp:
    """Lift a per-payload function into an operator (``None`` drops the record); ``fingerprint``: its
    version; ``on_error`` and ``max_skipped`` as for :class:`StatelessOp`."""
    return MapOp(fn, fn_fingerprint=fingerprint, **skipping)


class ChainState(msgspec.Struct, frozen=True, tag="chain", forbid_unknown_fields=True):
    """The children's states, in chain order."""

    states: tuple[Any, ...]


@attrs.frozen
class Chain(Operator):
    """A named chain of operators, itself an operator: outputs of child ``i`` feed child ``i + 1``.
    State: the children's states, in order."""

    children: tuple[tuple[str, Operator], ...] = attrs.field(converter=tuple)
    kind: ClassVar[str] = "chain"
    state_type: ClassVar[type] = ChainState

    def __attrs_post_init__(self) -> None:
        names = [n for n, _ in self.children]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Chain: operator names must be unique, {dupes} repeat; name each step distinctly")
        for name, op in self.children:
            if not isinstance(op, Operator):
                raise TypeError(f"Chain: step {name!r} is a {type(op).__name__}, not an operator")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.children)

    def init(self, key: int) -> ChainState:
        return ChainState(tuple(op.init(fold_in(key, name)) for name, op in self.children))

    def step(self, state: ChainState, chunk: Sequence[Any]) -> tuple[ChainState, list]:
        states = list(state.states)
        items = self._run(states, list(chunk), 0)
        return ChainState(tuple(states)), items

    def _run(self, states: list, items: list, start: int) -> list:
        for i in range(start, len(self.children)):
            states[i], items = self.children[i][1].step(states[i], items)
        return items

    def flush(self, state: ChainState) -> tuple[ChainState, list]:
        """The next outputs of the chain's end (``[]`` once all is handed out): children flush in
        order, each until it returns nothing, outputs running through the rest. ``ValueError``
        when a child's flush returns outputs and its state unchanged (giving them forever)."""
        states = list(state.states)
        for i, (name, op) in enumerate(self.children):
            while True:
                new, items = op.flush(states[i])
                if items and new is states[i]:
                    raise ValueError(
                        f"operator {name!r}: flush returned {len(items)} outputs and the state it was given; a flush "
                        "hands out what the state holds and returns a state without it (flushing that returns nothing)"
                    )
                states[i] = new
                if not items:
                    break
                outputs = self._run(states, items, i + 1)
                if outputs:
                    return ChainState(tuple(states)), outputs
        return ChainState(tuple(states)), []

    def reports(self, state: ChainState) -> dict[str, dict[str, int]]:
        """Each child's counters (its ``report(state)``), by name; children without counters are left out."""
        reports = ((name, op.report(s)) for (name, op), s in zip(self.children, state.states))
        return {name: dict(report) for name, report in reports if report}

    def resolver_at(self, index: int, upstream: Resolver) -> Resolver:
        """The resolver of child ``index``'s input, built on the chain's input resolver."""
        for _, op in self.children[:index]:
            upstream = _bind(op, upstream)
        return upstream

    def rebuild(self, refs: Sequence[Any], upstream: Resolver) -> list:
        return self.resolver_at(len(self.children), upstream)(refs)

    def encode_state(self, state: ChainState) -> dict[str, Any]:
        return {name: op.encode_state(s) for (name, op), s in zip(self.children, state.states)}

    def _check_names(self, data: Any) -> None:
        """Refuse a chain state that is not a mapping of exactly this chain's operator names."""
        if not isinstance(data, dict):
            raise ValueError("chain state must be a mapping of operator name to state")
        missing = [n for n in self.names if n not in data]
        unknown = [n for n in data if n not in self.names]
        if missing or unknown:
            raise ValueError(
                f"checkpoint operators do not match the pipeline: missing {missing}, unknown {unknown}; "
                f"the pipeline has {list(self.names)}"
            )

    def decode_state(self, data: Any, upstream: Resolver) -> ChainState:
        self._check_names(data)
        states = []
        for name, op in self.children:
            try:
                states.append(op.decode_state(data[name], upstream))
            except (msgspec.ValidationError, ValueError, TypeError) as exc:
                raise ValueError(f"cannot restore the state of operator {name!r}: {exc}") from exc
            upstream = _bind(op, upstream)
        return ChainState(tuple(states))

    def fingerprint(self) -> dict[str, Any]:
        return {"op": "Chain", "children": [[n, op.fingerprint()] for n, op in self.children]}


def _bind(op: Operator, upstream: Resolver) -> Resolver:
    return lambda refs: op.rebuild(refs, upstream) if refs else []


def sample_meta(lane: int, dataset: int, shard: int, row: int) -> Meta:
    """The meta of a freshly read source sample."""
    return Meta(lane, (Segment(dataset, shard, row, 0, 0, -1),), 0)


def positive_int(instance: Any, attribute: Any, value: Any) -> None:
    """The attrs validator of an operator's size settings: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{instance.kind}: {attribute.name} must be an int >= 1, got {value!r}")


def nonnegative(state: Any, names: Sequence[str]) -> None:
    """Refuse a decoded state with a negative counter, naming its field."""
    for name in names:
        if getattr(state, name) < 0:
            raise ValueError(f"field {name!r} must be an int >= 0, got {getattr(state, name)}")
