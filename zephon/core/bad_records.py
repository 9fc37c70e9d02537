"""Skipping bad records: the ``on_error`` and ``max_skipped`` settings and the skip log in state.

With ``on_error="skip"`` a record whose processing raises is left out, a decision of the record
alone (the same for any ranks, workers and restarts), and logged in the state of what skipped it
(:class:`SkipLog`, so checkpoints keep it). ``max_skipped`` raises :class:`SkipLimitError` past
an int (records a lane may skip) or a float in ``(0, 1)`` (a share of the records seen, checked
once ``1 / fraction`` were seen).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import msgspec

from .records import Meta, describe_meta, meta_from_ints, meta_to_ints

#: The values of ``on_error``.
ON_ERROR = ("raise", "skip")
#: Skips each lane lists (per operator, and per dataset for reading); every skip is counted.
LISTED = 100
#: Characters of a skipped record's error message kept in its listing.
MESSAGE_CHARS = 200


class SkipLimitError(RuntimeError):
    """More records were skipped than ``max_skipped`` allows; names the operator, the count and the last record."""


class RecordDecodeError(ValueError):
    """A stored record could not be decoded; ``cause``: the underlying error, as skips count it."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.cause))


class Failure(NamedTuple):
    """The result of a payload whose processing raised, with ``on_error="skip"``: the exception's type and text."""

    cause: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        text = str(exc)
        if len(text) > MESSAGE_CHARS:
            text = text[: MESSAGE_CHARS - 3] + "..."
        return cls(exc.cause if isinstance(exc, RecordDecodeError) else type(exc).__name__, text)


def skippable(exc: BaseException) -> bool:
    """Whether an exception may be skipped as a bad record: any ``Exception`` but running out of memory
    and a skip limit reached downstream."""
    return isinstance(exc, Exception) and not isinstance(exc, (MemoryError, SkipLimitError))


class Skipped(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One skipped record: its meta as ints (:func:`~zephon.core.records.meta_to_ints`), cause and message."""

    record: tuple[int, ...]
    cause: str
    message: str

    @property
    def meta(self) -> Meta:
        return meta_from_ints(list(self.record))


class SkipLog(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A lane's skips at one place: records seen, skips per cause, the first ones, the last."""

    seen: int = 0
    causes: tuple[tuple[str, int], ...] = ()
    listed: tuple[Skipped, ...] = ()
    last: Skipped | None = None

    @property
    def total(self) -> int:
        return sum(n for _, n in self.causes)


EMPTY_LOG = SkipLog()


def logged(log: SkipLog | None, seen: int, skips: Sequence[tuple[int, Meta, Failure]]) -> SkipLog:
    """``log`` after a chunk of ``seen`` more records, of which ``skips`` (``(position in the chunk, meta,
    failure)``, in order) were skipped."""
    log = log or EMPTY_LOG
    if not skips:
        return SkipLog(log.seen + seen, log.causes, log.listed, log.last)
    counts = dict(log.causes)
    for _, _, failure in skips:
        counts[failure.cause] = counts.get(failure.cause, 0) + 1
    entries = [Skipped(tuple(meta_to_ints(meta)), f.cause, f.message) for _, meta, f in skips]
    listed = log.listed + tuple(entries[: max(0, LISTED - len(log.listed))])
    return SkipLog(log.seen + seen, tuple(counts.items()), listed, entries[-1])


def check_limit(
    log: SkipLog | None, seen: int, skips: Sequence[tuple[int, Meta, Failure]], max_skipped: int | float | None,
    where: str, describe: Any = None,
) -> None:
    """Raise :class:`SkipLimitError` if a chunk of ``seen`` records with ``skips`` takes ``log``
    past ``max_skipped``, at the same record however the stream is chunked. ``where`` names what
    skipped; ``describe`` words a meta; the error keeps the last skipped meta as ``zephon_meta``."""
    if max_skipped is None:
        return
    log = log or EMPTY_LOG
    total = log.total
    if isinstance(max_skipped, int):
        for _, meta, failure in skips:
            total += 1
            if total > max_skipped:
                _raise(where, total, f"max_skipped={max_skipped} per lane", meta, failure, describe)
        return
    start = math.ceil(1 / max_skipped)  # before this many records, a single skip is more than the share
    at_start = start - log.seen - 1  # the position in this chunk of the record that reaches it
    checks = [(pos, meta, failure) for pos, meta, failure in skips]
    if 0 <= at_start < seen and all(pos != at_start for pos, _, _ in skips):
        checks = sorted(checks + [(at_start, None, None)], key=lambda c: c[0])
    last = (log.last.meta, Failure(log.last.cause, log.last.message)) if log.last is not None else None
    for pos, meta, failure in checks:
        if meta is not None:
            total, last = total + 1, (meta, failure)
        count = log.seen + pos + 1
        if count >= start and total > max_skipped * count and last is not None:
            bound = f"max_skipped={max_skipped} of the records seen ({total} of {count} in this lane)"
            _raise(where, total, bound, *last, describe)


def _raise(where: str, total: int, bound: str, meta: Meta, failure: Failure, describe: Any) -> None:
    exc = SkipLimitError(
        f"{where}: {total} records skipped in lane {meta.lane}, more than {bound} allows; the last was "
        f"{(describe or describe_meta)(meta)} ({failure.cause}: {failure.message}). Fix the data or the function, "
        "or raise max_skipped"
    )
    exc.zephon_meta = meta  # type: ignore[attr-defined]
    raise exc


def _owner(instance: Any) -> str:
    """An operator's kind, else a dataset by its name, for errors."""
    kind = getattr(instance, "kind", None)
    if isinstance(kind, str):
        return kind
    name = getattr(instance, "name", None)
    return f"dataset {name!r}" if isinstance(name, str) else type(instance).__name__


def check_on_error(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of ``on_error``: ``"raise"`` or ``"skip"``."""
    if value not in ON_ERROR:
        kind = _owner(instance)
        raise ValueError(
            f"{kind}: on_error must be 'raise' (a record whose processing raises ends the run, naming it) or 'skip' "
            f"(it is left out and counted in stats()['skipped']), got {value!r}"
        )


def check_max_skipped(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of ``max_skipped``: ``None``, an int >= 0 or a float in (0, 1), with ``on_error="skip"``."""
    kind = _owner(instance)
    if value is None:
        return
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, float) and 0.0 < value < 1.0
    )
    if not ok:
        raise ValueError(
            f"{kind}: max_skipped must be None, an int >= 0 (records a lane may skip) or a float in (0, 1) (the "
            f"share of the records seen), got {value!r}"
        )
    if getattr(instance, "on_error", "skip") != "skip":
        raise ValueError(f"{kind}: max_skipped={value!r} applies to skipped records; pass on_error='skip' with it")
