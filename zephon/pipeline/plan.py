"""Plans: which data, in which mixture or schedule, in which order, until when, as a value.

A :class:`Plan` round-trips through TOML or JSON, has its own fingerprint, becomes a pipeline's
source (``Pipeline(plan)``) and is simulated without tokenizing (:meth:`Plan.simulate`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from ..ops.lengths import LengthSchedule, Phase
from ..sources.estimate import Calibration, TokenEstimation
from ..sources.mixture import MixtureSchedule, MixtureSpec, as_mixture
from ..sources.work_source import StaticMixtureWorkSource
from .config import check_keys, parse_toml, read_config

#: The plan's settings that a document holds as they are (always, or only when set).
_PLAIN_KEYS = ("seed", "shuffle_shards", "shuffle_within_shard", "passes", "chunk_size", "lane_assignment")
_OPTIONAL_KEYS = ("exhausted_policy", "max_repeats")
_TABLES = ("datasets", "mixture", "schedule", "token_estimation", "calibration", "steps")
_TOP_KEYS = (*_PLAIN_KEYS, *_OPTIONAL_KEYS, *_TABLES)
_SHAPE_KEYS = ("lanes", "microbatch_size", "sequence_length", "tokens_per_microbatch")


def _as_length(value: Any) -> Any:
    """``sequence_length``: an int, or ``[[step, length], ...]`` as a :class:`~zephon.LengthSchedule`."""
    return LengthSchedule(value) if isinstance(value, (list, tuple)) else value


@attrs.frozen
class StepShape:
    """What one global step holds: ``lanes`` x ``microbatch_size`` records, of ``sequence_length`` tokens when packed.

    With ``tokens_per_microbatch=T``, a microbatch is ``T / (length - 1)`` packed rows, and
    ``sequence_length`` may be a :class:`~zephon.LengthSchedule` (``[[0, 257], [2000, 1025]]``).
    """

    lanes: int = 1
    microbatch_size: int = 1
    sequence_length: int | LengthSchedule | None = attrs.field(default=None, converter=_as_length)
    tokens_per_microbatch: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in _SHAPE_KEYS:
            v = getattr(self, name)
            if name == "sequence_length" and isinstance(v, LengthSchedule):
                continue
            bad = isinstance(v, bool) or not isinstance(v, int) or v < 1
            if bad and (v is not None or name not in ("sequence_length", "tokens_per_microbatch")):
                raise ValueError(f"steps.{name} must be an int >= 1, got {v!r}")
        T = self.tokens_per_microbatch
        if isinstance(self.sequence_length, LengthSchedule) and T is None:
            raise ValueError("steps: a sequence_length schedule needs tokens_per_microbatch (tokens per microbatch)")
        if T is not None:
            if self.sequence_length is None or self.microbatch_size != 1:
                raise ValueError(
                    "steps: tokens_per_microbatch counts packed rows: give sequence_length (a length or "
                    "[[step, length], ...]) and leave out microbatch_size (T / (length - 1) rows per microbatch)"
                )
            self.phases()  # every length divides T, or the error names the step

    def phases(self) -> tuple[Phase, ...]:
        """The stretches of steps with one row length (one, unless ``sequence_length`` is a schedule)."""
        length, T = self.sequence_length, self.tokens_per_microbatch
        if T is None:
            return (Phase(0, length, self.microbatch_size, 0),)
        return (length if isinstance(length, LengthSchedule) else LengthSchedule([(0, length)])).phases(T)

    @property
    def fixed(self) -> bool:
        """Whether every step holds the same number of tokens (no length schedule)."""
        return not isinstance(self.sequence_length, LengthSchedule) or len(self.sequence_length.points) == 1

    def tokens_before(self, step: int) -> int:
        """Packed tokens (rows x row length, every lane) in the global steps before ``step``."""
        total, phases = 0, self.phases()
        for p, nxt in zip(phases, [*phases[1:], None]):
            end = step if nxt is None else min(step, nxt.step)
            total += max(0, end - p.step) * self.lanes * p.rows * p.length
        return total

    def step_at_tokens(self, tokens: float) -> int:
        """The global step whose tokens include token number ``tokens`` (counting from 0)."""
        phases = self.phases()
        for p, nxt in zip(phases, [*phases[1:], None]):
            if nxt is None or tokens < self.tokens_before(nxt.step):
                return p.step + int((tokens - self.tokens_before(p.step)) // (self.lanes * p.rows * p.length))
        raise AssertionError("the last phase has no end")

    def describe(self) -> dict[str, Any]:
        """The shape as a plan document's ``[steps]`` table (a schedule as ``[[step, length], ...]``)."""
        out = {k: getattr(self, k) for k in _SHAPE_KEYS if getattr(self, k) is not None}
        if isinstance(self.sequence_length, LengthSchedule):
            out["sequence_length"] = self.sequence_length.describe()
        if self.tokens_per_microbatch is not None:
            del out["microbatch_size"]
        return out


def _as_datasets(value: Any) -> tuple:
    from ..sources.dataset import Dataset

    out = []
    for d in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(d, Dataset):
            out.append(d)
        elif isinstance(d, Mapping):
            check_keys(d, ("name", "path"), "a plan's dataset")
            if "name" not in d or "path" not in d:
                raise ValueError(f"a plan's dataset is {{name, path}}, got keys {sorted(d)}")
            out.append(Dataset.from_path(d["name"], d["path"]))
        else:
            raise TypeError(f"a plan's datasets are zephon.io.Dataset objects or {{name, path}} tables, got {d!r}")
    return tuple(out)


def _as_shape(value: Any) -> StepShape | None:
    if value is None or isinstance(value, StepShape):
        return value
    if isinstance(value, Mapping):
        return StepShape(**check_keys(value, _SHAPE_KEYS, "steps"))
    raise TypeError(f"steps must be a StepShape or a table of lanes, microbatch_size, sequence_length, got {value!r}")


@attrs.frozen(eq=False)
class Plan:
    """A data plan: datasets, a mixture or schedule, order (seed, shuffles), ends and token estimation.

    Args:
        datasets: :class:`~zephon.io.Dataset` objects (or ``{"name", "path"}`` tables).
        mixture: ``{name: weight}``, a :class:`~zephon.work.MixtureSpec` or a
            :class:`~zephon.work.MixtureSchedule`.
        steps: what a global step holds (:class:`StepShape`): places a schedule by step and
            drives :meth:`simulate`.
        calibration: frozen token estimates (a :class:`~zephon.work.Calibration`), if known.
        The rest are :class:`~zephon.work.StaticMixtureWorkSource`'s arguments.

    Examples:
        >>> from zephon.io import Dataset
        >>> a = Dataset.from_rows("a", [{"text": "x"}] * 6)
        >>> b = Dataset.from_rows("b", [{"text": "y"}] * 3)
        >>> plan = Plan([a, b], {"a": 2, "b": 1}, exhausted_policy="stop", steps={"lanes": 1, "microbatch_size": 3})
        >>> len(plan), plan.simulate(2).samples
        (9, {'a': 4, 'b': 2})
    """

    datasets: tuple = attrs.field(converter=_as_datasets)
    mixture: MixtureSpec | MixtureSchedule = attrs.field(converter=as_mixture)
    seed: int = 0
    shuffle_shards: bool = True
    shuffle_within_shard: bool = False
    exhausted_policy: Any = None
    max_repeats: Any = None
    passes: int = 1
    chunk_size: int = 64
    lane_assignment: str = "permute"
    token_estimation: TokenEstimation | None = None
    calibration: Calibration | None = None
    steps: StepShape | None = attrs.field(default=None, converter=_as_shape)

    def __attrs_post_init__(self) -> None:
        self.source()  # every check of the source runs now: an impossible plan fails at construction

    def source(self) -> StaticMixtureWorkSource:
        """The work source this plan describes (``Pipeline(plan)`` uses it)."""
        shape = self.steps
        per_step: dict[str, int] = {}
        if shape is not None:
            by_step = isinstance(self.mixture, MixtureSchedule) and len(self.mixture.points) > 1
            if shape.sequence_length is None:
                per_step["samples_per_step"] = shape.lanes * shape.microbatch_size
            elif shape.fixed:
                per_step["tokens_per_step"] = shape.tokens_before(1)
            elif by_step and self.mixture.by == "step":
                raise ValueError(
                    "a schedule by='step' needs a fixed size of a global step, and steps.sequence_length is a schedule "
                    "(its steps hold different numbers of tokens); use a schedule by='tokens'"
                )
            if by_step:
                per_step["step_lanes"] = shape.lanes  # points start at a block of lanes' chunks, as in a pipeline
        keys = (*_PLAIN_KEYS, *_OPTIONAL_KEYS, "token_estimation", "calibration")
        settings = {k: getattr(self, k) for k in keys}
        return StaticMixtureWorkSource(list(self.datasets), self.mixture, **settings, **per_step)

    #: The work source (what ``Pipeline(plan)`` calls).
    as_source = source

    def __len__(self) -> int:
        """Samples in the whole plan (``TypeError`` when a dataset repeats without end)."""
        return len(self.source())

    def fingerprint(self) -> str:
        """A digest of everything that decides which sample comes where (the plan's part of a checkpoint)."""
        data = json.dumps(self.source().fingerprint(), sort_keys=True, default=str)
        return "sha256:" + hashlib.sha256(data.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The plan as a document of builtins (datasets as ``{name, path}``; in-memory ones cannot be written)."""
        datasets = []
        for d in self.datasets:
            paths = [d.shard_path(s) for s in range(d.num_shards)]
            if None in paths or not paths:
                raise ValueError(
                    f"dataset {d.name!r} lives in memory, so a plan document cannot name it; use Dataset.from_path"
                )
            datasets.append({"name": d.name, "path": paths[0] if len(paths) == 1 else paths})
        out: dict[str, Any] = {"datasets": datasets}
        m, unit = self.mixture, self.source().unit
        if isinstance(m, MixtureSchedule):
            points = [[a, dict(w)] for a, w in m.points]
            out["schedule"] = {"by": m.by, "interpolation": m.interpolation, "unit": unit, "points": points}
        else:
            out["mixture"] = {"unit": unit, "weights": dict(m.weights)}
        out.update({name: getattr(self, name) for name in _PLAIN_KEYS})
        out.update({name: getattr(self, name) for name in _OPTIONAL_KEYS if getattr(self, name) is not None})
        for name in ("token_estimation", "calibration"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).describe()
        if self.steps is not None:
            out["steps"] = self.steps.describe()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base: str | os.PathLike | None = None) -> "Plan":
        """Inverse of :meth:`to_dict`; relative dataset paths are taken from ``base``.

        Raises:
            ValueError: unknown keys, not one of ``mixture`` and ``schedule``, a refused plan.
        """
        check_keys(data, _TOP_KEYS, "the plan")
        if ("mixture" in data) == ("schedule" in data):
            raise ValueError("a plan has exactly one of [mixture] (fixed weights) and [schedule] (weights over time)")
        kw: dict[str, Any] = {k: data[k] for k in (*_PLAIN_KEYS, *_OPTIONAL_KEYS, "steps") if k in data}
        if "mixture" in data:
            mix = check_keys(data["mixture"], ("weights", "unit"), "[mixture]")
            kw["mixture"] = MixtureSpec(mix["weights"], unit=mix.get("unit"))
        else:
            allowed = ("points", "by", "interpolation", "unit")
            sch = check_keys(data["schedule"], allowed, "[schedule]")
            options = {k: sch[k] for k in ("by", "interpolation", "unit") if k in sch}
            kw["mixture"] = MixtureSchedule([tuple(p) for p in sch["points"]], **options)
        if "token_estimation" in data:
            allowed = ("primer", "calibration_samples", "calibration_shards_max", "field")
            estimation = check_keys(data["token_estimation"], allowed, "[token_estimation]")
            kw["token_estimation"] = TokenEstimation(**estimation)
        if "calibration" in data:
            kw["calibration"] = Calibration.from_description(data["calibration"])
        datasets = []
        for d in data.get("datasets") or []:
            d = check_keys(d, ("name", "path"), "[datasets]")
            given = d.get("path", "")
            listed = isinstance(given, list)
            paths = [str(Path(base or "", x)) for x in (given if listed else [given])]
            datasets.append({"name": d.get("name"), "path": paths if listed else paths[0]})
        if not datasets:
            raise ValueError("a plan needs at least one [[datasets]] entry with name and path")
        return cls(datasets, **kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str, *, base: str | os.PathLike | None = None) -> "Plan":
        return cls.from_dict(json.loads(text), base=base)

    def to_toml(self) -> str:
        """The plan as TOML (the layout :meth:`from_toml` and ``zephon plan`` read)."""
        return _toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, base: str | os.PathLike | None = None) -> "Plan":
        return cls.from_dict(parse_toml(text), base=base)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a ``.toml`` or ``.json`` plan file; dataset paths are relative to the file's folder."""
        p = Path(path)
        return cls.from_dict(read_config(p, what="plan"), base=p.parent)

    def __str__(self) -> str:
        m, unit = self.mixture, self.source().unit
        lines = [f"Plan {self.fingerprint()}"]
        lines += [f"  dataset {d.name}: {d.num_rows} rows in {d.num_shards} shard(s)" for d in self.datasets]
        if isinstance(m, MixtureSchedule):
            lines.append(f"  schedule by {m.by} ({m.interpolation}), weights count {unit}:")
            for a, w in m.points:
                lines.append(f"    at {a}: " + ", ".join(f"{n} {x:.4g}" for n, x in w.items()))
        else:
            lines.append(f"  mixture ({unit}): " + ", ".join(f"{n} {x:.4g}" for n, x in m.weights.items()))
        src = self.source()
        ends = "after calibration"
        if src.resolvable:
            ends = f"after {src.end} samples: {src.end_reason}" if src.end is not None else "never (endless)"
        lines.append(f"  order: seed {self.seed}, shuffle_shards={self.shuffle_shards}, shuffle_within_shard={self.shuffle_within_shard}")
        lines.append(f"  ends: {ends}")
        return "\n".join(lines)

    def simulate(self, steps: int, *, pipeline: Any = None) -> "Simulation":
        """Per dataset: samples, estimated tokens, epochs and exhaustion over the first ``steps`` global steps.

        Reads no data beyond a calibration sample. Counts are exact for unpacked records with no
        shuffle, filter or split before ``batch``, estimates for packed rows. ``pipeline`` (built
        on this plan) gives the compiled source and step shape.
        """
        if pipeline is not None:
            src = pipeline.compile().source
            shape = _pipeline_shape(pipeline)
        else:
            src = self.source()
            shape = self.steps
            if src.needs_calibration:
                raise ValueError(
                    "this plan counts tokens: give it a calibration (a [calibration] table, or token_estimation with pinned "
                    "tokens_per_byte), or pass pipeline= to measure with the pipeline's tokenizer"
                )
        if shape is None:
            raise ValueError(
                "simulate needs to know what a step holds: "
                "give the plan steps={lanes, microbatch_size[, sequence_length]}"
            )
        return simulate_source(src, shape, steps)


def _pipeline_shape(pipeline: Any) -> StepShape:
    ops = [op for _, op in pipeline.operators]
    batch = next((op for op in ops if op.kind == "batch"), None)
    if batch is None:
        raise ValueError("simulate(pipeline=...) needs a pipeline that ends in batch()")
    pack = next((op.max_length for op in ops if op.kind in ("pack_flat", "pack_sequences")), None)
    lanes = pipeline.run_options.canonical_replicas
    if batch.tokens_per_microbatch is not None:
        return StepShape(lanes, 1, pack, tokens_per_microbatch=batch.tokens_per_microbatch)
    if batch.microbatch_size is None:
        raise ValueError(
            f"simulate(pipeline=...) needs a fixed number of rows per microbatch, and "
            f"batch(max_tokens={batch.max_tokens}) varies it; give the plan steps={{lanes, microbatch_size"
            "[, sequence_length]} (an average) instead"
        )
    return StepShape(lanes, batch.microbatch_size, pack)


@attrs.frozen
class Simulation:
    """What :meth:`Plan.simulate` found. ``samples``/``tokens`` are totals over the simulated steps."""

    steps: int
    shape: StepShape
    names: tuple[str, ...]
    samples: dict[str, int]
    tokens: dict[str, float | None]
    epochs: dict[str, float]
    exhausted_at: dict[str, int | None]  # the step in which each dataset's first pass completes
    weights: list[tuple[int, dict[str, float]]]  # (step, target shares) over time
    per_step: Any = attrs.field(eq=False, repr=False)  # (steps, datasets) samples per step
    unit: str = "samples"
    exact: bool = True

    def table(self) -> str:
        shape = self.shape
        head = f"first {self.steps} global steps ({shape.lanes} lanes x "
        if shape.tokens_per_microbatch is not None:
            head += f"{shape.tokens_per_microbatch} training tokens per microbatch)"
        else:
            head += f"{shape.microbatch_size} rows of {shape.sequence_length} tokens)" if shape.sequence_length else (
                f"{shape.microbatch_size} samples)"
            )
        head += "" if self.exact else "; sample counts estimated from tokens"
        total = sum(t for t in self.tokens.values() if t is not None) or 0
        rows = [("dataset", "samples", "est. tokens", "token share", "epochs", "first pass ends at step")]
        for n in self.names:
            t, end = self.tokens[n], self.exhausted_at[n]
            share = "-" if t is None or not total else f"{t / total:.4f}"
            tokens = "-" if t is None else f"{t:,.0f}"
            end = "-" if end is None else str(end)
            rows.append((n, str(self.samples[n]), tokens, share, f"{self.epochs[n]:.3f}", end))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        if shape.tokens_per_microbatch is not None:
            lines.append("sequence length over steps:")
            for p in shape.phases():
                later = " (after the simulated steps)" if p.step >= self.steps else ""
                lines.append(f"  from step {p.step}: rows of {p.length} tokens, {p.rows} per microbatch{later}")
        if len(self.weights) > 1:
            lines.append(f"target ({self.unit}) over steps:")
            lines += [f"  step {step}: " + ", ".join(f"{n} {x:.4f}" for n, x in w.items()) for step, w in self.weights]
        return "\n".join(lines)

    __str__ = table

    def plot(self, path: str | os.PathLike, tokens_per_sample: dict[str, float] | None = None) -> None:
        """Draw each dataset's share (of tokens when estimated, else samples) per step to ``path`` (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("plotting a plan needs matplotlib: pip install 'zephon-lanes[plot]'") from None
        per = np.asarray(self.per_step, dtype=float)
        if tokens_per_sample:
            per = per * np.asarray([tokens_per_sample[n] for n in self.names])
        kernel = np.ones(max(1, self.steps // 100))
        smooth = np.stack([np.convolve(per[:, j], kernel, mode="same") for j in range(per.shape[1])], axis=1)
        share = smooth / np.maximum(smooth.sum(axis=1, keepdims=True), 1e-12)
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.stackplot(np.arange(1, self.steps + 1), share.T, labels=self.names)
        ax.set(xlabel="global step", ylabel="token share" if tokens_per_sample else "sample share", ylim=(0, 1))
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def simulate_source(src: StaticMixtureWorkSource, shape: StepShape, steps: int) -> Simulation:
    """:meth:`Plan.simulate` on a compiled source."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    names, n = src.names, len(src.names)
    tps = src.calibration.tokens_per_sample(names) if src.calibration is not None else None
    L, B = shape.lanes, shape.microbatch_size
    exact = shape.sequence_length is None
    if exact:
        per_step = np.zeros((steps, n), dtype=np.int64)
        for lane in range(L):
            comps = _lane_components(src, L, lane, steps * B)
            if len(comps) < steps * B:  # the lane ends: the run stops at its last whole step
                steps = len(comps) // B
                per_step, comps = per_step[:steps], comps[: steps * B]
            per_step += (comps.reshape(steps, B, 1) == np.arange(n)).sum(axis=1)
    else:
        if tps is None:
            raise ValueError("simulating packed steps needs the calibration (tokens per sample)")
        positions = [_position_at_tokens(src, shape.tokens_before(s)) for s in range(steps + 1)]
        counts = np.stack([src.timeline.counts_before(p) for p in positions])
        per_step = np.diff(counts, axis=0)
    cum = np.cumsum(per_step, axis=0)
    total = cum[-1] if len(cum) else np.zeros(n, dtype=np.int64)
    sizes = [d.num_rows for d in src.datasets]
    hits = [np.flatnonzero(cum[:, j] >= sizes[j]) if sizes[j] else np.array([]) for j in range(n)]
    exhausted = {name: int(hit[0]) if hit.size else None for name, hit in zip(names, hits)}
    marks = {0, max(0, steps - 1), *(_step_of(src, shape, p) for _, p in src.point_positions)}
    marks |= {int(steps * f) for f in (0.25, 0.5, 0.75)}
    weights: list[tuple[int, dict[str, float]]] = []  # each change of the rounded target
    for s in sorted(m for m in marks if m < steps):
        w = {k: round(v, 4) for k, v in src.target_at(_position_of_step(src, shape, s)).items()}
        if not weights or weights[-1][1] != w:
            weights.append((s, w))
    samples = {nm: int(total[j]) for j, nm in enumerate(names)}
    tokens = {nm: (float(total[j]) * tps[j] if tps else None) for j, nm in enumerate(names)}
    epochs = {nm: (int(total[j]) / sizes[j] if sizes[j] else 0.0) for j, nm in enumerate(names)}
    return Simulation(steps, shape, names, samples, tokens, epochs, exhausted, weights, per_step, src.unit, exact)


def _lane_components(src: StaticMixtureWorkSource, lanes: int, lane: int, count: int) -> np.ndarray:
    """The datasets of lane ``lane``'s first ``count`` positions (fewer when the lane ends)."""
    parts, have, k = [], 0, 0
    while have < count:
        rng = src.lane_range(lanes, lane, k)
        if rng is None:
            break
        t0, t1 = rng
        t1 = min(t1, t0 + count - have)
        parts.append(src.timeline.assign(t0, t1)[0])
        have += t1 - t0
        k += 1
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _position_at_tokens(src: StaticMixtureWorkSource, tokens: float) -> int:
    end, hi = src.end, 1
    while src.tokens_before(hi) < tokens and (end is None or hi < end):
        hi *= 2
    positions = range(hi if end is None else min(hi, end))
    return bisect.bisect_left(positions, tokens, key=src.tokens_before)


def _position_of_step(src: StaticMixtureWorkSource, shape: StepShape, step: int) -> int:
    if shape.sequence_length is None:
        return step * shape.lanes * shape.microbatch_size
    return _position_at_tokens(src, shape.tokens_before(step))


def _step_of(src: StaticMixtureWorkSource, shape: StepShape, position: int) -> int:
    if shape.sequence_length is None:
        return position // (shape.lanes * shape.microbatch_size)
    return shape.step_at_tokens(src.tokens_before(position))


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"a plan document cannot hold {v}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ValueError(f"a plan document cannot hold {v!r}")


def _toml(doc: dict[str, Any]) -> str:
    lines = [f"{_key(k)} = {_value(v)}" for k, v in doc.items() if not isinstance(v, Mapping) and k != "datasets"]
    tables = [(f"[{k}]", v) for k, v in doc.items() if isinstance(v, Mapping)]
    for head, table in tables + [("[[datasets]]", d) for d in doc.get("datasets", [])]:
        lines += [f"\n{head}", *(f"{_key(k)} = {_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"

