"""What a loader is doing: runtime counters of reading, operators and deliveries, the mixture, the table.

Counting is always on and cheap. These counters decide nothing and are not in checkpoints (the
operators' own counters, ``report(state)``, are part of their states).
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..training.fields import TOKEN_FIELDS, payload_length
from ..core.records import Record, SampleBatch

#: The name of the reading stage in the runtime counters (records out = source samples read).
SOURCE = "source"
#: The counters of each stage in ``stats()["flow"]``, in the order a :class:`Meter` keeps them.
_FLOW = ("records_in", "records_out", "tokens_in", "tokens_out", "seconds")
#: Operator counters that count data not emitted, gathered into ``stats()["dropped"]``.
_DROP_WORDS = ("dropped", "truncated")


def record_tokens(rec: Any) -> int:
    """Real (non-padding) tokens of one record; 0 for a record without tokens yet (raw text)."""
    meta = rec.meta
    total = 0
    for s in meta.segments:
        if s.end < 0:
            break
        total += s.end - s.start
    else:
        if meta.segments:
            return total
    n = _length(rec.payload)
    return 0 if n is None else max(0, n - meta.padding_length)


def _length(payload: Any) -> int | None:
    """Token slots of a payload (its token field, or a bare sequence), or ``None`` if it has none."""
    if isinstance(payload, dict):
        for k in TOKEN_FIELDS:
            v = payload.get(k)
            if v is not None:
                try:
                    return len(v)
                except TypeError:
                    return None
        return None
    if isinstance(payload, (list, tuple, np.ndarray)):
        return len(payload)
    return None


def items_size(items: Sequence[Any]) -> tuple[int, int]:
    """``(records, tokens)`` of a list of records or batches of records."""
    records = tokens = 0
    for item in items:
        if isinstance(item, SampleBatch):
            records += len(item.records)
            for r in item.records:
                tokens += record_tokens(r)
        else:
            records += 1
            tokens += record_tokens(item)
    return records, tokens


class Meter:
    """Runtime counters of one executor's lanes: per operator records and tokens in and out and
    seconds; source samples per dataset and read seconds. Written by the thread running the lanes;
    readers take :meth:`snapshot`."""

    __slots__ = ("names", "ops", "samples", "read_s")

    def __init__(self, names: Sequence[str], datasets: int) -> None:
        self.names = tuple(names)
        self.ops = [[0, 0, 0, 0, 0.0] for _ in self.names]  # records in/out, tokens in/out, seconds
        self.samples = [0] * datasets
        self.read_s = 0.0

    def read(self, pointers: Sequence[tuple[int, int, int]], seconds: float) -> None:
        for d, _, _ in pointers:
            self.samples[d] += 1
        self.read_s += seconds

    def add(self, index: int, size_in: tuple[int, int], size_out: tuple[int, int], seconds: float) -> None:
        c = self.ops[index]
        c[0] += size_in[0]
        c[1] += size_out[0]
        c[2] += size_in[1]
        c[3] += size_out[1]
        c[4] += seconds

    def snapshot(self) -> dict[str, Any]:
        """The counters as builtins (picklable, mergeable with :func:`merge_meters`)."""
        return {"ops": {n: list(c) for n, c in zip(self.names, self.ops)}, "samples": list(self.samples), "read_s": self.read_s}


def merge_meters(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The sum of several :meth:`Meter.snapshot` results (workers of one rank); ``None`` if none."""
    out: dict[str, Any] | None = None
    for snap in snapshots:
        if out is None:
            out = {"ops": {}, "samples": [0] * len(snap["samples"]), "read_s": 0.0}
        for n, c in snap["ops"].items():
            acc = out["ops"].setdefault(n, [0, 0, 0, 0, 0.0])
            for i, v in enumerate(c):
                acc[i] += v
        out["samples"] = [a + b for a, b in zip(out["samples"], snap["samples"])]
        out["read_s"] += snap["read_s"]
    return out


class Deliveries:
    """What a loader handed to its caller: records, real tokens, token slots (padded to a batch's
    longest); ``wait_s``: time inside ``next()``; ``seconds``: first request to last delivery."""

    __slots__ = ("outputs", "records", "tokens", "slots", "wait_s", "first", "last")

    def __init__(self) -> None:
        self.outputs = self.records = self.tokens = self.slots = 0
        self.wait_s = 0.0
        self.first: float | None = None
        self.last: float | None = None

    def start_wait(self) -> float:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        return now

    def end_wait(self, started: float) -> None:
        self.last = time.perf_counter()
        self.wait_s += self.last - started

    def add(self, out: Any) -> None:
        records = out.records if isinstance(out, SampleBatch) else (out,)
        longest = tokens = 0
        for r in records:
            n = record_tokens(r)
            tokens += n
            length = _length(r.payload)
            longest = max(longest, n if length is None else length)
        self.outputs += 1
        self.records += len(records)
        self.tokens += tokens
        self.slots += longest * len(records)

    @property
    def seconds(self) -> float:
        return 0.0 if self.first is None or self.last is None else self.last - self.first


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(
    *,
    operators: Mapping[str, Mapping[str, int]],
    meter: Mapping[str, Any] | None,
    deliveries: Deliveries,
) -> dict[str, Any]:
    """The runtime sections of ``Loader.stats()``: ``flow``, ``throughput``, ``packing``, ``dropped``, ``batching``."""
    flow: dict[str, dict[str, Any]] = {}
    if meter is not None:
        flow[SOURCE] = dict(zip(_FLOW, (0, sum(meter["samples"]), 0, 0, meter["read_s"])))
        flow.update((name, dict(zip(_FLOW, c))) for name, c in meter["ops"].items())
    d = deliveries
    throughput = {
        "outputs": d.outputs, "records": d.records, "tokens": d.tokens, "seconds": d.seconds,
        "tokens_per_s": _ratio(d.tokens, d.seconds),
        "wait_seconds": d.wait_s, "wait_fraction": _ratio(d.wait_s, d.seconds),
    }
    packing = {
        "real_tokens": d.tokens, "slots": d.slots, "padding_tokens": d.slots - d.tokens,
        "efficiency": _ratio(d.tokens, d.slots), "padding_waste": None if not d.slots else 1.0 - d.tokens / d.slots,
    }
    dropped = {}
    for name, counters in operators.items():
        if causes := {k: v for k, v in counters.items() if any(w in k for w in _DROP_WORDS)}:
            dropped[name] = causes
    batching = {name: batching_report(c) for name, c in operators.items() if _BATCH_COUNTERS <= c.keys()}
    return {"flow": flow, "throughput": throughput, "packing": packing, "dropped": dropped, "batching": batching}


#: The counters a batching operator reports (``zephon.ops.Batch.report``).
_BATCH_COUNTERS = frozenset({"batches", "rows", "real_tokens", "padded_slots"})


def batching_report(counters: Mapping[str, int]) -> dict[str, Any]:
    """The microbatches a batching operator built, from its counters summed over lanes: with
    ``rows_per_microbatch``, ``padding_waste`` (padding over all slots) and, for a token budget,
    ``budget_fill`` (slots used over ``microbatches x max_tokens``)."""
    batches, slots, real = counters["batches"], counters["padded_slots"], counters["real_tokens"]
    out = {
        "microbatches": batches, "rows": counters["rows"], "rows_per_microbatch": _ratio(counters["rows"], batches),
        "real_tokens": real, "padded_slots": slots, "padding_tokens": slots - real,
        "padding_waste": None if not slots else 1.0 - real / slots,
    }
    if "budget_slots" in counters:
        out["budget_fill"] = _ratio(slots, counters["budget_slots"])
    return out


def mixture_report(source: Any, counts_by_lane: dict[int, Sequence[int]]) -> dict[str, Any]:
    """The achieved mixture next to the target: ``{"unit", "target", "global": {name: {...}},
    "lanes": {lane: {name: {...}}}}``, each dataset with ``samples``, ``tokens``, ``sample_share``,
    ``token_share``, ``target`` and ``epochs`` (samples over its rows)."""
    names = source.names
    n = len(names)
    rows = [getattr(d, "num_rows", 0) for d in source.datasets]
    total = [sum(column) for column in zip(*counts_by_lane.values())] or [0] * (2 * n)
    try:
        target = source.target_at(sum(total[0::2]))
    except (ValueError, AttributeError, TypeError):
        target = {}

    def block(counts: Sequence[int]) -> dict[str, Any]:  # every lane state counts each dataset
        samples, tokens = sum(counts[0::2]), sum(counts[1::2])
        return {
            name: {
                "samples": s, "tokens": t, "sample_share": s / samples if samples else 0.0,
                "token_share": t / tokens if tokens else 0.0, "target": target.get(name),
                "epochs": s / rows[j] if rows[j] else 0.0,
            }
            for j, (name, s, t) in enumerate(zip(names, counts[0::2], counts[1::2]))
        }

    return {
        "unit": getattr(source, "unit", "samples"),
        "target": target,
        "global": block(total),
        "lanes": {lane: block(c) for lane, c in counts_by_lane.items()},
    }


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_stats(stats: Mapping[str, Any]) -> str:
    """Render ``Loader.stats()`` as a plain-text report (operators, delivery, drops, mixture)."""
    t = stats.get("throughput", {})
    p = stats.get("packing", {})
    rate = t.get("tokens_per_s")
    lines = [
        f"delivered: {stats.get('delivered', 0):,} outputs ({t.get('records', 0):,} records, {t.get('tokens', 0):,} tokens) "
        f"in {stats.get('complete_steps', 0):,} complete steps",
        f"throughput: {_num(rate)} tokens/s over {_num(t.get('seconds'))} s; the caller waited {_num(t.get('wait_seconds'))} s "
        f"for data ({_pct(t.get('wait_fraction'))} of that time)",
        f"packing: efficiency {_pct(p.get('efficiency'))} ({p.get('real_tokens', 0):,} real tokens in {p.get('slots', 0):,} slots; "
        f"padding waste {_pct(p.get('padding_waste'))})",
    ]
    for name, b in stats.get("batching", {}).items():
        fill = f", budget fill {_pct(b['budget_fill'])}" if "budget_fill" in b else ""
        lines.append(
            f"batching ({name}): {b['microbatches']:,} microbatches, {_num(b['rows_per_microbatch'])} rows per "
            f"microbatch, padding waste {_pct(b['padding_waste'])}{fill}"
        )
    flow = stats.get("flow", {})
    if flow:
        lines.append("")
        total = sum(f["seconds"] for f in flow.values()) or 1.0
        rows = [
            [name, *(_num(f[k]) for k in _FLOW[:4]), f"{f['seconds']:.3f}", _pct(f["seconds"] / total)]
            for name, f in flow.items()
        ]
        lines += _table(["operator", "records in", "records out", "tokens in", "tokens out", "seconds", "time"], rows)
    ops = stats.get("operators", {})
    if ops:
        lines += ["", "operator counters (part of the checkpoint):"]
        for name, counters in ops.items():
            lines.append(f"  {name}: {', '.join(f'{k}={_num(v)}' for k, v in counters.items())}")
    und = stats.get("undelivered", {})
    dropped = stats.get("dropped", {})
    lines.append("")
    skipped = stats.get("skipped_steps", {})
    if skipped.get("ranges"):
        ranges = ", ".join(f"{a}\u2013{b}" for a, b in skipped["ranges"])
        lines.append(
            f"skipped: steps {ranges}; here {skipped.get('steps', 0):,} steps ({skipped.get('from_keyframes', 0):,} from "
            f"keyframes; {skipped.get('outputs', 0):,} outputs, {skipped.get('discarded', 0):,} read ahead and dropped) "
            f"in {_num(skipped.get('seconds'))} s"
        )
    drops = [f"{name}.{k}={_num(v)}" for name, c in dropped.items() for k, v in c.items() if v]
    lines.append("dropped: " + (", ".join(drops) if drops else "nothing"))
    skipped = stats.get("skipped") or {}
    if skipped.get("total"):
        places = [f"{name}={c['skipped']:,} ({', '.join(f'{k}: {n:,}' for k, n in c['causes'].items())})"
                  for name, c in skipped["by_operator"].items() if c["skipped"]]
        lines.append("skipped (on_error='skip'): " + "; ".join(places))
    lines.append(
        f"undelivered at the end of data: {und.get('outputs', 0):,} outputs ({und.get('records', 0):,} records, {und.get('tokens', 0):,} tokens)"
    )
    mix = stats.get("mixture")
    if mix:
        lines += ["", f"mixture (target shares count {mix.get('unit', 'samples')}):"]
        rows = [
            [name, _pct(m["target"]), _num(m["samples"]), _pct(m["sample_share"]), _num(m["tokens"]), _pct(m["token_share"]), _num(m["epochs"])]
            for name, m in mix.get("global", {}).items()
        ]
        lines += _table(["dataset", "target", "samples", "share", "tokens", "share", "epochs"], rows)
    return "\n".join(lines)


def summary_line(stats_light: Mapping[str, Any]) -> str:
    """The one-line progress summary logged every ``log_every`` steps."""
    t, p = stats_light["throughput"], stats_light["packing"]
    return (
        f"step {stats_light['complete_steps']:,}: {t['tokens']:,} tokens delivered, {_num(t['tokens_per_s'])} tokens/s, "
        f"waited {_pct(t['wait_fraction'])}, packing {_pct(p['efficiency'])}"
    )


def mixture_counts(counts: Sequence[int], outputs: Sequence[Any], datasets: int, sign: int = 1) -> tuple[int, ...]:
    """``counts`` (``[samples_0, tokens_0, samples_1, ...]``) plus (or minus) what ``outputs`` hold:
    a segment starting at token 0 counts one sample; its tokens are its range, or its payload's.

    Examples:
        >>> from zephon.types import Meta, Segment
        >>> rec = Record({"input_ids": [1, 2, 3]}, Meta(0, (Segment(1, 0, 4, 0, 0, -1),)))
        >>> mixture_counts((), [rec], 2)
        (0, 0, 1, 3)
    """
    out = list(counts) if counts else [0] * (2 * datasets)
    for o in outputs:
        for rec in (o.records if isinstance(o, SampleBatch) else (o,)):
            for seg in rec.meta.segments:
                if seg.end >= 0:
                    tokens = seg.end - seg.start
                else:
                    try:
                        tokens = payload_length(rec.payload, "mixture")
                    except (TypeError, ValueError):
                        tokens = 0  # not tokenized (yet): samples only
                out[2 * seg.dataset] += sign * (seg.start == 0)
                out[2 * seg.dataset + 1] += sign * tokens
    return tuple(out)
