"""Sample-level curriculum: each lane's records sorted by a key inside consecutive windows.

``order_by(key, window=N)`` sorts every ``N`` records of a lane by ``key(payload)``, ties by the
record's identity (never by arrival), and emits them; the end of the data emits the last, shorter
window. Under a mixture schedule the first record of a new phase (``drains``, as for the shuffle)
closes the open window early, so a window never holds records of two phases.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ClassVar, Sequence

import attrs
import msgspec
import numpy as np

from ..core.fingerprint import describe_callable
from ..core.operator import Operator, Resolver, config_field, nonnegative, positive_int
from ..core.records import Meta, Record, describe_meta
from ..core.state import decode, resolve
from ..training.fields import TOKEN_FIELDS
from .shuffle import drain_positions, next_phase


class OrderState(msgspec.Struct, frozen=True, tag="order_by", forbid_unknown_fields=True):
    """The records of the open window (by reference) and counters; with ``drains``, the sample
    starts seen and the schedule phase of the open window."""

    buffer: tuple[Record, ...] = ()
    windows: int = 0
    emitted: int = 0
    samples: int = 0
    phase: int = 0


@attrs.frozen
class FieldKey:
    """The key of ``order_by("name")``: the value of the payload's field ``name``.

    Examples:
        >>> FieldKey("score")({"score": 0.5, "text": "..."})
        0.5
    """

    name: str

    def __call__(self, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise TypeError(f"order_by: key field {self.name!r} needs dict payloads, got {type(payload).__name__}")
        if self.name not in payload:
            raise ValueError(
                f"order_by: key field {self.name!r} missing; payload keys are {sorted(payload)[:8]}; "
                "pass the name of a field every record has, or a function of the payload"
            )
        return payload[self.name]

    def fingerprint(self) -> dict[str, str]:
        return {"field": self.name}


@attrs.frozen
class TokenCount:
    """The key :data:`token_count`: the tokens of a payload's token field (``input_ids``, ...;
    padding included), of all its samples for a ``pack_sequences`` envelope, or a bare sequence's length."""

    def __call__(self, payload: Any) -> int:
        if isinstance(payload, dict) and "packed_samples" in payload:
            return sum(self(p) for p in payload["packed_samples"])
        if isinstance(payload, dict):
            for name in TOKEN_FIELDS:
                if name in payload:
                    return len(payload[name])
            raise ValueError(
                f"order_by(token_count): no token field ({', '.join(TOKEN_FIELDS)}) in a payload with keys "
                f"{sorted(payload)[:8]}; put order_by after tokenize(), or order by a field or function"
            )
        if isinstance(payload, (list, tuple, np.ndarray)):
            return len(payload)
        raise TypeError(f"order_by(token_count): cannot count the tokens of a {type(payload).__name__} payload")

    def fingerprint(self) -> dict[str, str]:
        return {"key": "token_count"}


#: ``order_by(token_count, window=N)``: short to long by tokens (see :class:`TokenCount`).
token_count = TokenCount()


def _key(value: Any) -> Callable[[Any], Any]:
    if isinstance(value, str):
        if not value:
            raise ValueError("order_by: a key field name must not be empty")
        return FieldKey(value)
    if not callable(value):
        raise TypeError(
            f"order_by: key must be a function of the payload or a field name, got {type(value).__name__}; "
            "e.g. order_by('length', window=256) or order_by(zephon.ops.token_count, window=256)"
        )
    return value


def _bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"order_by: {attribute.name} must be True or False, got {value!r}")


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"order_by: key_fingerprint must be a string naming the key's version ('v1'), got {value!r}")
    return value


def sort_value(value: Any, meta: Meta) -> Any:
    """``value`` as a key that sorts (numpy scalars as Python numbers), or an error naming the record.

    Raises:
        TypeError: not an int, float, string or tuple of them (``None``, a list, an array, ...).
        ValueError: a NaN, which compares false with everything and would leave the order undefined.
    """
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (int, np.bool_, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            raise _named(ValueError(
                f"order_by: the key returned NaN for {describe_meta(meta)}; NaN does not sort, so return a "
                "number for every record (for example a missing score as float('-inf') or 0.0)"
            ), meta)
        return float(value)
    if isinstance(value, tuple):
        return tuple(sort_value(v, meta) for v in value)
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise _named(TypeError(
        f"order_by: the key returned {type(value).__name__} {shown} for {describe_meta(meta)}; a key returns an "
        "int, a float, a string or a tuple of them (for a record's tokens use zephon.ops.token_count)"
    ), meta)


def _named(exc: Exception, meta: Meta) -> Exception:
    """``exc`` carrying the record's meta, which the lanes name by dataset and file."""
    with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
        exc.zephon_meta = meta  # type: ignore[attr-defined]
    return exc


def _incomparable(keys: list, records: Sequence[Record], exc: TypeError) -> TypeError:
    """The error for keys of one window that do not compare, naming two records whose keys clash."""
    for i in range(len(keys)):
        for j in range(i):
            try:
                keys[i] < keys[j]  # noqa: B015 - only whether they compare
            except TypeError:
                a, b = records[j].meta, records[i].meta
                return _named(TypeError(
                    f"order_by: keys of one window do not compare: {keys[j]!r} for {describe_meta(a)} and "
                    f"{keys[i]!r} for {describe_meta(b)} ({exc}); a key returns values of one kind for every record"
                ), b)
    return TypeError(f"order_by: the keys of one window do not compare ({exc}); a key returns values of one kind")


@attrs.frozen
class OrderBy(Operator):
    """Emit each lane's records sorted by ``key`` inside consecutive windows of ``window`` records.

    Args:
        key: a function of the payload (deterministic; picklable for worker processes), a field
            name, or :data:`token_count`; it returns an int, float, string or a tuple of them.
        window: records sorted together (an int >= 1): larger orders more globally and holds more.
        reverse: sort descending (ties still by record identity, ascending).
        key_fingerprint: a version string naming ``key``, replacing its derived fingerprint (for a
            function holding a value the fingerprint cannot describe, as ``map``'s ``fingerprint``).
        drains: the lane's sample positions of the source schedule's switches, where a window
            closes early (see the module docstring); filled in by the pipeline.

    State: the open window's records by reference (fewer than ``window``), counters, and with
    ``drains`` the lane clock. The key reads payloads, so a restore rebuilds the open window. The
    output depends only on the lane's input order; it restores exactly and reshards with its lane.

    Examples:
        >>> from zephon.testing import records_from, run
        >>> rows = records_from([{"length": n} for n in (3, 1, 2, 5, 4)])
        >>> [r.payload["length"] for r in run(OrderBy("length", window=3), [rows])[1]]
        [1, 2, 3, 4, 5]
        >>> [r.payload["length"] for r in run(OrderBy("length", window=3, reverse=True), [rows])[1]]
        [3, 2, 1, 5, 4]
    """

    key: Callable[[Any], Any] = config_field(converter=_key)
    window: int = config_field(validator=positive_int)
    reverse: bool = config_field(default=False, validator=_bool)
    key_fingerprint: str | None = config_field(default=None, converter=_optional_str, kw_only=True)
    drains: tuple[int, ...] = config_field(default=(), converter=drain_positions, kw_only=True)

    kind: ClassVar[str] = "order_by"
    state_type: ClassVar[type] = OrderState

    def init(self, key: int) -> OrderState:
        return OrderState()

    def fingerprint(self) -> dict[str, Any]:
        """The key (its version string, else its described function), the window, the direction;
        ``drains`` only when there are some."""
        if self.key_fingerprint is not None:
            key: Any = self.key_fingerprint
        elif isinstance(self.key, (FieldKey, TokenCount)):
            key = self.key.fingerprint()  # the library's keys by what they are, not by their code
        else:
            key = describe_callable(self.key)
        out: dict[str, Any] = {"op": "OrderBy", "key": key, "window": self.window, "reverse": self.reverse}
        if self.drains:
            out["drains"] = list(self.drains)
        return out

    def sorted_window(self, records: Sequence[Record]) -> list[Record]:
        """``records`` sorted by key (``reverse``: descending), ties by meta ascending, then by arrival."""
        keys = []
        for rec in records:
            try:
                value = self.key(rec.payload)
            except Exception as exc:
                if getattr(exc, "zephon_meta", None) is None and hasattr(exc, "add_note"):
                    exc.add_note(f"zephon: raised by order_by's key on {describe_meta(rec.meta)}")
                    _named(exc, rec.meta)
                raise
            keys.append(sort_value(value, rec.meta))
        order = sorted(range(len(records)), key=lambda i: (records[i].meta.segments, records[i].meta.padding_length))
        try:
            order.sort(key=keys.__getitem__, reverse=self.reverse)  # stable: ties keep the meta order
        except TypeError as exc:
            raise _incomparable(keys, records, exc) from exc
        return [records[i] for i in order]

    def step(self, state: OrderState, chunk: Sequence[Record]) -> tuple[OrderState, list[Record]]:
        buffer, out, windows = list(state.buffer), [], state.windows
        samples, phase = state.samples, state.phase
        for rec in chunk:
            if self.drains:
                switched, samples, phase = next_phase(self.drains, samples, phase, rec)
                if switched and buffer:  # the first record of the next phase closes the open window
                    out.extend(self.sorted_window(buffer))
                    windows, buffer = windows + 1, []
            buffer.append(rec)
            if len(buffer) == self.window:
                out.extend(self.sorted_window(buffer))
                windows, buffer = windows + 1, []
        return OrderState(tuple(buffer), windows, state.emitted + len(out), samples, phase), out

    def flush(self, state: OrderState) -> tuple[OrderState, list[Record]]:
        """The open window, sorted: the end of a lane's data is a last, shorter window."""
        if not state.buffer:
            return state, []
        out = self.sorted_window(state.buffer)
        changes = {"buffer": (), "windows": state.windows + 1, "emitted": state.emitted + len(out)}
        return msgspec.structs.replace(state, **changes), out

    def report(self, state: OrderState) -> dict[str, int]:
        return {"buffered": len(state.buffer), "windows": state.windows, "emitted": state.emitted}

    def decode_state(self, data: Any, upstream: Resolver) -> OrderState:
        """Inverse of ``encode_state``, refusing, before any record is rebuilt, what ``step`` never
        leaves: negative counters, a full window (it is emitted as it fills), a phase past the drains."""
        state = decode(data, OrderState)
        nonnegative(state, ("windows", "emitted", "samples", "phase"))
        if len(state.buffer) >= self.window:
            raise ValueError(
                f"field 'buffer' holds {len(state.buffer)} records, but order_by emits its window as soon as "
                f"{self.window} records wait"
            )
        if state.phase > len(self.drains):
            switches = len(self.drains)
            raise ValueError(f"field 'phase' is {state.phase}, past the {switches} schedule switch(es) of the lane")
        return resolve(state, upstream)
