"""The batch ledger: a SHA-256 digest of every global batch, to prove two runs saw the same data.

Each rank digests its own lanes' microbatches; a global step's digest hashes the lane digests in
lane order, so ranks exchange no batches. ``python -m zephon ledger diff A B`` finds the first
step and lane where two runs diverge, whatever their numbers of ranks.

Examples:
    The digest covers the payload and the padding, not the provenance:

    >>> import numpy as np
    >>> from zephon.types import Meta, Record, SampleBatch, Segment
    >>> def one(tokens, lane=0, row=0):
    ...     meta = Meta(lane, (Segment(0, 0, row, 0, 0, len(tokens)),))
    ...     return SampleBatch((Record({"input_ids": np.array(tokens, dtype=np.int32)}, meta),))
    >>> a = batch_digest(one([1, 2, 3, 4]))
    >>> len(a), a == batch_digest(one([1, 2, 3, 4], row=7)), a == batch_digest(one([1, 2, 3, 5]))
    (64, True, False)

    A global step's digest depends on the lane digests and their order:

    >>> b = batch_digest(one([9, 9], lane=1))
    >>> step_digest([a, b]) == step_digest([a, b]), step_digest([a, b]) == step_digest([b, a])
    (True, False)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import msgspec
import numpy as np

from ..core.records import SampleBatch
from .skip_steps import merged_ranges

__all__ = [
    "Ledger", "batch_digest", "step_digest", "read_ledger", "read_skips", "global_digests", "diff", "DiffResult",
    "show_lines",
]


def batch_digest(batch: SampleBatch) -> str:
    """SHA-256 of a microbatch: each record's padding length and fields (arrays by name, dtype,
    shape and bytes; other values as msgpack)."""
    h = hashlib.sha256()
    for rec in batch.records:
        h.update(b"record%d;" % rec.meta.padding_length)
        payload = rec.payload if isinstance(rec.payload, dict) else {"": rec.payload}
        for key in sorted(payload):
            value = payload[key]
            if isinstance(value, np.ndarray):
                arr = np.ascontiguousarray(value)
                h.update(f"{key}:{arr.dtype.str}:{arr.shape};".encode())
                h.update(arr.tobytes())
            else:
                h.update(f"{key}:py;".encode())
                h.update(msgspec.msgpack.encode(value, enc_hook=_encode_other))
    return h.hexdigest()


def _encode_other(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return [obj.dtype.str, list(obj.shape), obj.tobytes()]
    if isinstance(obj, np.generic):
        return obj.item()
    return repr(obj)


def step_digest(lane_digests: Sequence[str]) -> str:
    """The global-step digest from the lane digests, in lane order."""
    h = hashlib.sha256()
    for d in lane_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


class Ledger:
    """Appends one flushed JSON line per optimizer step to a rank's file (parents are created):
    :meth:`record` the rank's microbatches of each step, :meth:`record_skip` each skip."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def record(self, step: int, batches: Iterable[SampleBatch]) -> dict[str, str]:
        lanes = {str(b.lane): batch_digest(b) for b in batches if b.lane is not None}
        self._write({"step": int(step), "lanes": lanes})
        return lanes

    def _write(self, entry: dict[str, Any]) -> None:
        self._fh.write(json.dumps(entry) + "\n")
        self._fh.flush()

    def record_skip(self, skipped: Any) -> None:
        """Record skipped global steps (a :class:`~zephon.runtime.skip_steps.SkippedSteps` or a
        ``(first, count)`` pair) as ``{"skip": {"first", "count"}}``; ``diff`` expects them gone."""
        first, count = (skipped.first, skipped.count) if hasattr(skipped, "first") else tuple(skipped)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in (first, count)):
            raise ValueError(
                f"record_skip: the first step and the count must be ints >= 0, got {first!r} and {count!r}"
            )
        if count:
            self._write({"skip": {"first": first, "count": count}})

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            files = sorted(p.glob("*.jsonl"))
            if not files:
                raise FileNotFoundError(f"no *.jsonl ledger files in {p}")
            return files
        if not p.exists():
            raise FileNotFoundError(f"no ledger {p}")
        return [p]
    return [Path(s) for s in source]


def _lines(source: Any) -> Any:
    """``(path, line number, line)`` of every non-blank line of the ledger files."""
    for path in _files(source):
        with open(path, encoding="utf-8") as fh:
            yield from ((path, n, line) for n, line in enumerate(fh, 1) if line.strip())


def read_ledger(source: str | os.PathLike | Sequence[str | os.PathLike]) -> dict[int, dict[int, str]]:
    """Merge per-rank ledger files into ``{step: {lane: digest}}``; conflicting lines are errors."""
    steps: dict[int, dict[int, str]] = {}
    for path, n, line in _lines(source):
        try:
            entry = json.loads(line)
            if isinstance(entry, dict) and "skip" in entry and "step" not in entry:
                continue  # read by read_skips
            step, lanes = int(entry["step"]), entry["lanes"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a ledger line ({exc}): {line[:80]!r}") from exc
        merged = steps.setdefault(step, {})
        for lane, digest in lanes.items():
            lane = int(lane)
            if merged.get(lane, digest) != digest:
                raise ValueError(f"{path}:{n}: step {step} lane {lane} recorded twice with different digests")
            merged[lane] = digest
    return steps


def read_skips(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[int, int]]:
    """The global steps the run skipped (:meth:`Ledger.record_skip`), as ``(first, last)`` ranges
    in order (every rank records the same skips)."""
    skips: list[tuple[int, int]] = []
    for path, n, line in _lines(source):
        if '"skip"' not in line:
            continue
        try:
            entry = json.loads(line)
            if "step" in entry:
                continue
            first, count = entry["skip"]["first"], entry["skip"]["count"]
            if not (isinstance(first, int) and isinstance(count, int) and first >= 0 and count >= 1):
                raise ValueError(f"first {first!r}, count {count!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a ledger skip line ({exc}): {line[:80]!r}") from exc
        skips.append((first, count))
    return merged_ranges(skips)


def show_lines(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """What ``zephon ledger show`` prints, in step order: ``"step digest"`` per complete global
    step, ``"steps a–b skipped"`` per skipped range."""
    lines = [(step, 1, f"{step} {digest}") for step, digest in global_digests(read_ledger(source)).items()]
    lines += [(first, 0, f"steps {_steps(first, last)} skipped") for first, last in read_skips(source)]
    return [text for _, _, text in sorted(lines)]


def _steps(first: int, last: int) -> str:
    return f"{first}\u2013{last}"  # an en dash


def global_digests(steps: dict[int, dict[int, str]], lanes: int | None = None) -> dict[int, str]:
    """Global digests of the steps whose every lane is recorded (``lanes`` defaults to the max seen)."""
    if lanes is None:
        lanes = max((max(v) + 1 for v in steps.values() if v), default=0)
    return {k: step_digest([v[l] for l in range(lanes)]) for k, v in sorted(steps.items()) if all(l in v for l in range(lanes))}


class DiffResult:
    """Where two ledgers first differ (``step is None`` when they match); ``skipped``: per ledger
    (``"a"``, ``"b"``), the ``(first, last)`` step ranges it skipped (not compared)."""

    def __init__(self, step: int | None, lane: int | None, compared: int, reason: str,
                 skipped: dict[str, list[tuple[int, int]]] | None = None):
        self.step, self.lane, self.compared, self.reason = step, lane, compared, reason
        self.skipped = skipped or {"a": [], "b": []}

    @property
    def match(self) -> bool:
        return self.step is None

    def __str__(self) -> str:
        skips = "".join(
            f"; steps {', '.join(_steps(a, b) for a, b in ranges)} skipped in {side.upper()} (expected, not compared)"
            for side, ranges in self.skipped.items() if ranges
        )
        if self.match:
            return f"match: {self.compared} global steps identical{skips}"
        where = f"step {self.step}" + (f", lane {self.lane}" if self.lane is not None else "")
        return f"diverge at {where}: {self.reason} ({self.compared} earlier steps identical){skips}"


def diff(a: Any, b: Any) -> DiffResult:
    """Compare two runs' ledgers (files or directories of per-rank files); steps a run skipped are
    expected missing from it."""
    la, lb = read_ledger(a), read_ledger(b)
    skipped = {"a": read_skips(a), "b": read_skips(b)}
    common = sorted(set(la) & set(lb))
    for i, step in enumerate(common):
        lanes_a, lanes_b = la[step], lb[step]
        if set(lanes_a) != set(lanes_b):
            return DiffResult(step, None, i, f"lanes {sorted(lanes_a)} vs {sorted(lanes_b)}", skipped)
        for lane in sorted(lanes_a):
            if lanes_a[lane] != lanes_b[lane]:
                return DiffResult(step, lane, i, f"digest {lanes_a[lane][:12]}... vs {lanes_b[lane][:12]}...", skipped)

    def expected(step: int) -> bool:  # missing from the ledger that skipped it
        side = skipped["a"] if step in lb else skipped["b"]
        return any(first <= step <= last for first, last in side)

    only = [step for step in sorted(set(la) ^ set(lb)) if not expected(step)]
    reason = f"; steps only in one ledger: {only[:5]}{'...' if len(only) > 5 else ''}" if only else ""
    return DiffResult(None, None, len(common), "identical" + reason, skipped)
