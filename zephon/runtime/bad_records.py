"""Skipped records as a lane runs them: reading's skip logs, the warnings, and ``stats()["skipped"]``.

A dataset opened with ``on_error="skip"`` hands a row it cannot decode as a
:class:`~zephon.core.bad_records.Failure`, which the lane leaves out and logs in its state (a
:class:`~zephon.core.bad_records.SkipLog` per dataset). Warnings, counted per plan and place in this
process, come at the first skip and every :data:`WARN_EVERY`-th; workers forward theirs.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator, Mapping, Sequence

import msgspec

from ..core.operator import StatelessOp
from ..core.records import Meta, Record
from ..core.bad_records import EMPTY_LOG, Failure, SkipLimitError, SkipLog, check_limit, logged

#: One warning per this many skips of one place (the first skip warns too).
WARN_EVERY = 1000
#: Skipped records ``stats()["skipped"]["records"]`` lists, lanes taken in turn.
LISTED_IN_STATS = 100
#: The name of reading (the datasets' decoding) in ``stats()["skipped"]``.
READING = "source"


class SkippedRecordWarning(RuntimeWarning):
    """Records were skipped (``on_error="skip"``): the first of a place, then one per thousand."""


_WARNED: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()
#: Where this process's skip warnings go instead of ``warnings.warn`` (in a worker or a replay).
_forward: list[Callable[[str], None]] = []


def forward_warnings(send: Callable[[str], None]) -> None:
    """Hand this process's skip warnings to ``send`` (the text of each) instead of warning here."""
    _forward[:] = [send]


def note_skips(plan: Any, place: str, before: SkipLog | None, after: SkipLog | None) -> None:
    """Warn about the skips ``after`` holds beyond ``before`` (the same place's logs), by :data:`WARN_EVERY`."""
    if after is None or after.last is None or (before is not None and before.last is after.last):
        return
    new = after.total - (before.total if before is not None else 0)
    counts = _WARNED.setdefault(plan, {})
    old = counts.get(place, 0)
    counts[place] = old + new
    if old and old // WARN_EVERY == (old + new) // WARN_EVERY:
        return
    listed = len(before.listed) if before is not None else 0
    first = after.listed[listed] if listed < len(after.listed) else after.last  # the first new skip, if listed
    text = (
        f"{place}: skipped {plan.describe(first.meta)} ({first.cause}: {first.message}), as on_error='skip' asks; "
        f"{old + new} record(s) skipped there in this process so far (one warning per {WARN_EVERY}). "
        "loader.stats()['skipped'] counts and lists them; max_skipped= turns a flood of them into an error"
    )
    if _forward:  # a worker or a replay
        _forward[0](text)
    else:
        warnings.warn(text, SkippedRecordWarning, stacklevel=2)


@contextlib.contextmanager
def naming_operator(name: str) -> Iterator[None]:
    """Add the operator's name to a :class:`~zephon.core.bad_records.SkipLimitError` raised in the block."""
    try:
        yield
    except SkipLimitError as exc:
        exc.add_note(f"zephon: raised by operator {name!r}")
        raise


def unreadable(records: Sequence[Record]) -> tuple[list[Record], list[tuple[int, Meta, Failure]]]:
    """The records read, and apart the rows a dataset could not decode, each as
    ``(position in the read, meta, failure)``."""
    if not any(type(r.payload) is Failure for r in records):
        return list(records), []
    good = [r for r in records if type(r.payload) is not Failure]
    return good, [(i, r.meta, r.payload) for i, r in enumerate(records) if type(r.payload) is Failure]


def reading_logged(
    plan: Any, logs: tuple[SkipLog, ...], pointers: Sequence[tuple[int, int, int]],
    failed: Sequence[tuple[int, Meta, Failure]],
) -> tuple[SkipLog, ...]:
    """A lane's reading logs (one per dataset, ``()`` while none skips) after reading ``pointers``,
    of which ``failed`` did not decode; ``SkipLimitError`` past a dataset's ``max_skipped``."""
    datasets = plan.source.datasets
    if not logs and not any(getattr(d, "on_error", "raise") == "skip" for d in datasets):
        return logs
    out = list(logs) or [EMPTY_LOG] * len(datasets)
    positions: dict[int, int] = Counter()  # the position of each row among its dataset's rows of this read
    ranked = []
    for d, _, _ in pointers:
        ranked.append(positions[d])
        positions[d] += 1
    by_dataset: dict[int, list] = defaultdict(list)
    for i, meta, failure in failed:
        by_dataset[meta.segments[0].dataset].append((ranked[i], meta, failure))
    for d, seen in positions.items():
        ds = datasets[d]
        if getattr(ds, "on_error", "raise") != "skip":
            continue
        skips = by_dataset.get(d, [])
        check_limit(out[d], seen, skips, ds.max_skipped, f"reading dataset {ds.name!r}", plan.describe)
        before, out[d] = out[d], logged(out[d], seen, skips)
        note_skips(plan, f"reading dataset {ds.name!r}", before, out[d])
    return tuple(out)


def decode_reading(data: Any, datasets: int, lane: int) -> tuple[SkipLog, ...]:
    """The reading logs of an encoded lane state (its optional field ``skipped``)."""
    if data is None:
        return ()
    try:
        logs = msgspec.convert(data, tuple[SkipLog, ...])
    except msgspec.ValidationError as exc:
        raise ValueError(f"lane {lane}: field 'skipped': {exc}") from None
    if len(logs) != datasets:
        raise ValueError(f"lane {lane}: field 'skipped' holds {len(logs)} logs, but the source has {datasets} datasets")
    return logs


def skip_report(plan: Any, states: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``stats()["skipped"]`` from encoded lane states: ``{"total", "by_operator": {place:
    {"skipped", "seen", "causes"}}, "records"}``, places being ``"source"`` and operator names, the
    first records listed lanes in turn."""
    places: dict[str, dict[str, Any]] = {}
    per_lane: list[list[dict[str, Any]]] = []
    for lane in sorted(states):
        state = states[lane]
        logs = [(READING, log) for log in decode_reading(state.get("skipped"), len(plan.source.datasets), lane)]
        for name, op in plan.chain.children:
            data = state["ops"].get(name)
            if isinstance(op, StatelessOp) and op.on_error == "skip" and isinstance(data, dict) and data.get("skips"):
                logs.append((name, msgspec.convert(data["skips"], SkipLog)))
        listed = []
        for place, log in logs:
            entry = places.setdefault(place, {"skipped": 0, "seen": 0, "causes": {}})
            entry["skipped"] += log.total
            entry["seen"] += log.seen
            for cause, n in log.causes:
                entry["causes"][cause] = entry["causes"].get(cause, 0) + n
            listed += [_listed(plan, place, s) for s in log.listed]
        per_lane.append(listed)
    records = [x for row in itertools.zip_longest(*per_lane) for x in row if x is not None]
    return {
        "total": sum(p["skipped"] for p in places.values()),
        "by_operator": places,
        "records": records[:LISTED_IN_STATS],
    }


def _listed(plan: Any, place: str, skipped: Any) -> dict[str, Any]:
    meta = skipped.meta
    seg = meta.segments[0]
    try:
        ds = plan.source.datasets[seg.dataset]
        dataset, shard = ds.name, ds.shard_ids[seg.shard]
    except (AttributeError, IndexError):
        dataset, shard = seg.dataset, seg.shard
    return {
        "operator": place, "dataset": dataset, "shard": shard, "row": seg.row, "lane": meta.lane,
        "cause": skipped.cause, "message": skipped.message,
    }
