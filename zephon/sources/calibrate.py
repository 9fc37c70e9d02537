"""Calibration: tokens per byte and per sample of each dataset, measured with the pipeline's own
tokenizer.

A small deterministic sample of each dataset runs through the per-sample steps up to the first
tokenizing step (a dropped row counts 0 tokens). The result is frozen into the source (fingerprint,
checkpoints) and cached in this process by what decides it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Sequence

import attrs
import msgspec

from ..core.operator import Chain, StatelessOp, sample_meta
from ..core.bad_records import Failure
from ..training.fields import payload_length
from ..core.records import Record
from .estimate import Calibration, DatasetEstimate
from .mixture import MixtureSchedule
from .work_source import StaticMixtureWorkSource

#: Operator kinds that turn text into tokens (the first one in a chain is the one calibration uses).
TOKENIZING = ("tokenize", "tokenize_chat", "tokenize_prompt_completion")

_CACHE: dict[str, Calibration] = {}


def sample_rows(shard_sizes: Sequence[int], rows: int, max_shards: int) -> list[tuple[int, list[int]]]:
    """``[(shard, rows)]``: about ``rows`` rows spread evenly over up to ``max_shards`` non-empty shards.

    Examples:
        >>> sample_rows([10, 0, 10], 4, 16)
        [(0, [2, 7]), (2, [2, 7])]
    """
    shards = [s for s, n in enumerate(shard_sizes) if n]
    if not shards:
        return []
    m = min(len(shards), max_shards)
    picked = [shards[(i * len(shards)) // m] for i in range(m)]
    per = -(-rows // m)
    out = []
    for s in picked:
        n = shard_sizes[s]
        q = min(n, per)
        out.append((s, sorted({int((r + 0.5) * n / q) for r in range(q)})))
    return out


def _text_bytes(payload: Any, field: str | None) -> int:
    if isinstance(payload, str):
        return len(payload.encode())
    if field is not None and isinstance(payload, dict):
        value = payload.get(field)
        if value is None and "." in field:
            value = payload
            for part in field.split("."):
                value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            return len(value.encode())
    return len(msgspec.json.encode(payload))


def tokenizer_prefix(chain: Chain) -> tuple[list[StatelessOp], Any, str | None]:
    """The per-sample steps before the first tokenizing step, and that step; or, when a step that
    keeps state across samples comes first, the steps before it, ``None`` and its name."""
    prefix: list[StatelessOp] = []
    for name, op in chain.children:
        if op.kind in TOKENIZING or type(op).__name__.startswith("Tokenize"):
            return prefix, op, None
        if not isinstance(op, StatelessOp):
            return prefix, None, name
        prefix.append(op)
    return prefix, None, None


def calibrate(source: StaticMixtureWorkSource, chain: Chain, *, progress: bool = True) -> StaticMixtureWorkSource:
    """``source`` with its :class:`Calibration` filled in (measured now, or from this process's cache)."""
    if not source.needs_calibration:
        return source
    est = source.estimation
    prefix, tok, blocked = tokenizer_prefix(chain)
    if tok is None and est.needs_tokenizer and blocked is not None and any(op.kind in TOKENIZING for _, op in chain.children):
        raise ValueError(
            f"token calibration replays the steps before tokenizing, but {blocked!r} keeps state across samples; move it "
            "after the tokenize step or pin tokens_per_byte with TokenEstimation({name: value})"
        )
    if tok is None and est.needs_tokenizer:
        raise ValueError(
            "this mixture counts tokens, and measuring tokens per byte needs a tokenize step in the pipeline; add one, "
            "or pin the numbers: token_estimation=TokenEstimation({name: tokens_per_byte}) (or one float for all datasets)"
        )
    key = json.dumps(
        [{k: v for k, v in source.fingerprint().items() if k not in ("timeline",)}, est.describe(), [op.fingerprint() for op in prefix], tok.fingerprint() if tok is not None else None],
        sort_keys=True,
        default=str,
    )
    if key in _CACHE:
        return source.with_calibration(_CACHE[key])
    field = getattr(tok, "field", None) if tok is not None else est.field
    t0 = time.perf_counter()
    shown = False
    out: dict[str, DatasetEstimate] = {}
    for j, d in enumerate(source.datasets):
        pinned = est.pinned(d.name)
        rows_read = n_bytes = n_tokens = 0
        for shard, rows in sample_rows(d.shard_sizes, est.calibration_samples, est.calibration_shards_max):
            payloads = d.read(shard, rows)
            records = [Record(p, sample_meta(0, j, shard, r)) for p, r in zip(payloads, rows) if type(p) is not Failure]
            rows_read += len(records)
            for op in prefix:
                records = op.apply_records(records).outputs
            n_bytes += sum(_text_bytes(r.payload, field) for r in records)
            if pinned is None:
                outs = tok.apply_records(records).outputs
                n_tokens += sum(payload_length(r.payload, "calibration") for r in outs)
            if progress and not shown and time.perf_counter() - t0 > 1.0:
                print(f"zephon: calibrating token weights ({len(source.datasets)} datasets, {est.calibration_samples} rows each)...", file=sys.stderr, flush=True)
                shown = True
        if not rows_read:
            out[d.name] = DatasetEstimate(1.0, 0.0, 0, pinned is not None)
            continue
        bps = n_bytes / rows_read
        tpb = pinned if pinned is not None else (n_tokens / n_bytes if n_bytes else 0.0)
        if pinned is None and not n_bytes:  # texts without bytes: only the specials the tokenizer adds
            tpb, bps = 1.0, n_tokens / rows_read
        out[d.name] = DatasetEstimate(tpb, bps, rows_read, pinned is not None)
    calibration = Calibration(out, seconds=time.perf_counter() - t0)
    if shown:
        print(f"zephon: calibrated in {calibration.seconds:.1f} s", file=sys.stderr, flush=True)
    _CACHE[key] = calibration
    return source.with_calibration(calibration)


def step_size(source: StaticMixtureWorkSource, chain: Chain, lanes: int) -> StaticMixtureWorkSource:
    """``source`` with ``samples_per_step`` (lanes x microbatch) or, for packed rows,
    ``tokens_per_step`` (times the row length) when a schedule by step needs it; a schedule also
    gets ``step_lanes``."""
    m = source.mixture
    if isinstance(m, MixtureSchedule) and len(m.points) > 1 and source.step_lanes is None:
        source = attrs.evolve(source, step_lanes=lanes)
    if not source.needs_step_size:
        return source
    batch = next((op for _, op in chain.children if op.kind == "batch"), None)
    if batch is None:
        raise ValueError(
            "a schedule by='step' needs to know what a global step holds, and the pipeline has no batch() step; add "
            "batch(), or give the source samples_per_step= or tokens_per_step=, or use a schedule by='tokens'"
        )
    if getattr(batch, "max_tokens", None) is not None:
        raise ValueError(
            f"a schedule by='step' needs to know what a global step holds, and batch(max_tokens={batch.max_tokens}) "
            "gives microbatches of a variable number of rows; use a schedule by='tokens', or give the source "
            "samples_per_step= or tokens_per_step="
        )
    pack = next((op for _, op in chain.children if op.kind in ("pack_flat", "pack_sequences")), None)
    tokens = getattr(batch, "tokens_per_microbatch", None)
    if pack is not None:
        if not isinstance(pack.max_length, int):
            raise ValueError(
                "a schedule by='step' needs a fixed size of a global step, and "
                f"pack_flat(max_length={pack.max_length}) changes the row length (and so the rows' tokens) per step; "
                "use a schedule by='tokens', or give the source tokens_per_step="
            )
        rows = batch.microbatch_size if tokens is None else tokens // (pack.max_length - 1)
        return attrs.evolve(source, tokens_per_step=lanes * rows * pack.max_length)
    return attrs.evolve(source, samples_per_step=lanes * batch.microbatch_size)


def compile_source(source: StaticMixtureWorkSource, chain: Chain, lanes: int, *, calibration: Calibration | None = None) -> StaticMixtureWorkSource:
    """The source a pipeline runs: step size and calibration filled in (``calibration`` given: no measuring)."""
    source = step_size(source, chain, lanes)
    if calibration is not None and source.calibration is None:
        source = source.with_calibration(calibration)
    return calibrate(source, chain)  # sources resolve when made: an impossible plan fails there
