"""State encoding: operator states (msgspec Structs) as builtins, records held by reference.

:func:`encode` stores each record as its meta's ints, :func:`decode` gives references back, and
:func:`resolve` rebuilds them with one bulk call (``docs/design/state-by-reference.md``).

Examples:
    >>> import msgspec
    >>> from zephon.types import Meta, Record, Segment
    >>> class Held(msgspec.Struct, frozen=True, tag="held"):
    ...     records: tuple[Record, ...] = ()
    >>> rec = Record({"x": 1}, Meta(0, (Segment(0, 0, 3, 0, 0, -1),)))
    >>> encode(Held((rec,)))
    {'type': 'held', 'records': ([0, 0, 0, 0, 3, 0, 0, -1],)}
    >>> decode(encode(Held((rec,))), Held).records[0].is_reference
    True
    >>> resolve(decode(encode(Held((rec,))), Held), lambda metas: [rec]) == Held((rec,))
    True
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec

from .records import UNRESOLVED, Meta, Record, SampleBatch, meta_from_ints, meta_to_ints, reference

__all__ = ["Resolver", "decode", "encode", "encode_outputs", "output_ref", "references", "resolve", "keep_references"]

#: Rebuilds records from their metas at one point of a chain (bulk, order-preserving).
Resolver = Callable[[Sequence[Meta]], list]


def enc_hook(obj: Any) -> Any:
    """msgspec's ``enc_hook``: a record as its meta's ints, a batch as a list of them."""
    if isinstance(obj, Record):
        return meta_to_ints(obj.meta)
    if isinstance(obj, SampleBatch):
        return [meta_to_ints(r.meta) for r in obj.records]
    raise TypeError(f"cannot encode {type(obj).__name__} in operator state; keep state to ints, tuples, arrays and records")


def dec_hook(typ: type, obj: Any) -> Any:
    """msgspec's ``dec_hook`` for states: records come back as references."""
    if typ is Record:
        return reference(meta_from_ints(obj))
    if typ is SampleBatch:
        return SampleBatch(tuple(reference(meta_from_ints(m)) for m in obj))
    raise TypeError(f"cannot decode {typ!r} in an operator state")


def encode(state: Any) -> Any:
    """``state`` as builtins; the records it holds as their metas."""
    return msgspec.to_builtins(state, enc_hook=enc_hook)


def decode(data: Any, typ: type) -> Any:
    """Inverse of :func:`encode` into ``typ``, records as references (``msgspec.ValidationError``
    names a bad field)."""
    return msgspec.convert(data, typ, dec_hook=dec_hook)


def encode_outputs(outputs: Sequence[Any]) -> list:
    """Lane outputs (records or batches) by reference, as a checkpoint stores undelivered ones."""
    return msgspec.to_builtins(list(outputs), enc_hook=enc_hook)


def output_ref(output: Any) -> Any:
    """The reference a rebuild takes for an output: its meta, or a batch's list of metas."""
    if isinstance(output, SampleBatch):
        return [r.meta for r in output.records]
    if isinstance(output, Record):
        return output.meta
    raise TypeError(f"an output is a Record or a SampleBatch, got {type(output).__name__}")


def keep_references(metas: Sequence[Meta]) -> list[Record]:
    """A resolver that rebuilds nothing: each meta stays a reference (a restore that defers)."""
    return [reference(m) for m in metas]


def _collect(tree: Any, out: list) -> None:
    if isinstance(tree, Record):
        if tree.payload is UNRESOLVED:
            out.append(tree.meta)
    elif isinstance(tree, SampleBatch):
        for r in tree.records:
            _collect(r, out)
    elif isinstance(tree, msgspec.Struct):
        for name in tree.__struct_fields__:
            _collect(getattr(tree, name), out)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _collect(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _collect(x, out)


def references(tree: Any) -> list[Meta]:
    """The metas of the references in ``tree`` (a state, an output, a list of them), in order."""
    out: list = []
    _collect(tree, out)
    return out


def _substitute(tree: Any, it) -> Any:
    if isinstance(tree, Record):
        return next(it) if tree.payload is UNRESOLVED else tree
    if isinstance(tree, SampleBatch):
        return SampleBatch(tuple(_substitute(r, it) for r in tree.records), tree.pad_token_id)
    if isinstance(tree, msgspec.Struct):
        changes = {n: _substitute(getattr(tree, n), it) for n in tree.__struct_fields__}
        return msgspec.structs.replace(tree, **changes) if changes else tree
    if isinstance(tree, tuple):
        return tuple(_substitute(x, it) for x in tree)
    if isinstance(tree, list):
        return [_substitute(x, it) for x in tree]
    if isinstance(tree, dict):
        return {k: _substitute(v, it) for k, v in tree.items()}
    return tree


def resolve(tree: Any, upstream: Resolver) -> Any:
    """``tree`` with every reference rebuilt by one bulk call to ``upstream``; ``RuntimeError``
    when that gives another number of records or another meta."""
    if upstream is keep_references:
        return tree
    metas = references(tree)
    if not metas:
        return tree
    records = upstream(metas)
    if len(records) != len(metas):
        raise RuntimeError(f"rebuild returned {len(records)} records for {len(metas)} references")
    for meta, rec in zip(metas, records):
        if rec.meta != meta:
            raise RuntimeError(
                f"checkpoint restore rebuilt a different record: expected {meta!r}, got {rec.meta!r}; "
                "the data or a per-sample function changed since the checkpoint was taken"
            )
    return _substitute(tree, iter(records))
