"""``StaticMixtureWorkSource``: which sample pointer comes at each global position, a pure function.

Work chunks of ``chunk_size`` positions go whole to lanes (a seeded permutation of each block of
``L`` chunks, or ``g % L``), so a lane's cursor is two integers. Position -> (dataset, index) by
the :class:`Timeline`, index -> (epoch, position) -> (shard, row) by per-epoch Feistel
permutations keyed by (seed, dataset, epoch[, shard]); no list of sample ids is built.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Iterator, Literal, Mapping, Sequence

import attrs
import msgspec
import numpy as np

from ..core.keys import fold_in, permutation, permute_np, seed_key
from .estimate import Calibration, TokenEstimation
from .manifest import source_entries
from .mixture import Interleave, MixtureSchedule, MixtureSpec, Timeline, as_mixture, interleave, resolve_timeline

_POLICIES = ("stop", "repeat", "redistribute")
#: Settings that enter the fingerprint as they are, in this order.
_SETTINGS = (
    "seed", "shuffle_shards", "shuffle_within_shard", "exhausted_policy", "passes", "chunk_size", "lane_assignment"
)
_STEP_FIELDS = ("samples_per_step", "tokens_per_step", "step_lanes")


class SourceState(msgspec.Struct, frozen=True, tag="source", forbid_unknown_fields=True):
    """A lane's read cursor: its ``chunk``-th work chunk, ``offset`` positions into it."""

    chunk: int = 0
    offset: int = 0


def _as_datasets(datasets: Any) -> tuple:
    from .dataset import Dataset

    if isinstance(datasets, Dataset):
        datasets = [datasets]
    out = tuple(datasets)
    if not out:
        raise ValueError("StaticMixtureWorkSource needs at least one dataset")
    for d in out:
        if not isinstance(d, Dataset):
            raise TypeError(f"datasets must be zephon.io.Dataset objects, got {type(d).__name__}")
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ValueError(f"dataset names must be unique (they key the mixture), got {names}")
    return out


def _as_policy(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _as_estimation(value: Any) -> TokenEstimation | None:
    if value is None or isinstance(value, TokenEstimation):
        return value
    if value == "measure" or isinstance(value, (Mapping, int, float)):
        return TokenEstimation(value)
    raise TypeError(f"token_estimation must be a TokenEstimation, 'measure', {{name: tokens_per_byte}} or None, got {value!r}")


@attrs.frozen
class Change:
    """A plan changed from ``position`` on: positions before it follow ``before`` (a resolved timeline)."""

    position: int
    before: Timeline
    step: int | None = None
    #: The old plan's weight jumps (:attr:`StaticMixtureWorkSource.switch_positions`), kept before ``position``.
    switches: tuple[int, ...] = ()

    def describe(self) -> dict[str, Any]:
        digest = hashlib.sha256(json.dumps(self.before.describe()).encode()).hexdigest()[:16]
        return {"from_position": self.position, "from_step": self.step, "previous_timeline": digest}


@attrs.frozen(eq=False)
class StaticMixtureWorkSource:
    """Mix datasets by sample or token weight, or by a schedule of weights, with shuffles and epochs.

    Args:
        datasets: the datasets (unique names).
        mixture: ``{name: weight}``, a :class:`MixtureSpec` or a :class:`MixtureSchedule`.
        seed: decides shard orders, within-shard orders and lane routing.
        shuffle_shards: visit shards in a fresh pseudo-random order every epoch.
        shuffle_within_shard: also permute rows inside each shard every epoch.
        exhausted_policy: one policy or ``{name: policy}`` (others ``"repeat"``). ``None``: every
            dataset completes ``passes`` passes, faster ones repeating; ``"stop"``: end where the
            dataset would start its second pass; ``"repeat"``: a fresh pass (``max_repeats=N``:
            stop after ``1 + N``); ``"redistribute"``: after ``1 + max_repeats`` passes the
            dataset drops out and the others share its weight (the end: when all dropped out).
        max_repeats: ``None`` (unbounded), an int >= 0 or ``{name: int}``: extra passes.
        passes: passes of the slowest dataset before stopping (``exhausted_policy=None``).
        chunk_size: positions per work chunk.
        lane_assignment: ``"permute"`` (seeded permutation of each block of L chunks) or
            ``"modulo"`` (chunk ``g`` to lane ``g % L``).
        token_estimation: how tokens per sample are obtained (:class:`TokenEstimation`).
        calibration: the measured numbers (:class:`Calibration`), filled in by the pipeline.
        samples_per_step, tokens_per_step: source samples (or tokens, for packed rows) per global
            step, which place a schedule ``by="step"`` (filled in by the pipeline).
        step_lanes: the lanes of a global step: schedule points start at the first block of
            ``step_lanes`` chunks at or after their position, so no lane switches early or late.

    Examples:
        >>> from zephon.io import Dataset
        >>> ds = Dataset.from_rows("d", [{"text": str(i)} for i in range(5)])
        >>> src = StaticMixtureWorkSource([ds], {"d": 1.0}, shuffle_shards=False)
        >>> src.pointers(0, 5)
        [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4)]
    """

    datasets: tuple = attrs.field(converter=_as_datasets)
    mixture: MixtureSpec | MixtureSchedule = attrs.field(converter=as_mixture)
    seed: int = 0
    shuffle_shards: bool = True
    shuffle_within_shard: bool = False
    exhausted_policy: Any = attrs.field(default=None, converter=_as_policy)
    passes: int = 1
    chunk_size: int = 64
    lane_assignment: Literal["permute", "modulo"] = "permute"
    max_repeats: Any = attrs.field(default=None, converter=_as_policy, kw_only=True)
    token_estimation: TokenEstimation | None = attrs.field(default=None, converter=_as_estimation, kw_only=True)
    calibration: Calibration | None = attrs.field(default=None, kw_only=True)
    samples_per_step: int | None = attrs.field(default=None, kw_only=True)
    tokens_per_step: int | None = attrs.field(default=None, kw_only=True)
    step_lanes: int | None = attrs.field(default=None, kw_only=True)
    change: Change | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self.mixture.validate_for(self.names)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        self._check_policies()
        if not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"passes must be an int >= 1, got {self.passes!r}")
        if self.passes != 1 and self.exhausted_policy is not None:
            raise ValueError("passes only applies with exhausted_policy=None; 'stop' ends at the first exhaustion")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if self.lane_assignment not in ("permute", "modulo"):
            raise ValueError(f"lane_assignment must be 'permute' or 'modulo', got {self.lane_assignment!r}")
        for name in _STEP_FIELDS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        pieces = self.mixture.pieces() if isinstance(self.mixture, MixtureSchedule) else [(0, self.mixture.weights)]
        for d in self.datasets:
            if d.num_rows == 0 and any(w[d.name] > 0 for _, w in pieces):
                raise ValueError(f"datasets {[d.name]} have no rows; remove them from the mixture (or give them weight 0 in every schedule point)")
        if self.calibration is not None:
            missing = [n for n in self.names if n not in self.calibration.datasets]
            if missing:
                raise ValueError(f"the calibration has no numbers for datasets {missing}; measure or pin them")
            zero = [n for n in self.names if self.calibration.datasets[n].tokens_per_sample <= 0]
            if zero and self.needs_tokens:
                raise ValueError(f"datasets {zero} measured 0 tokens per sample; a token-weighted mixture cannot place them")
        if self.resolvable:
            self._resolved  # an impossible plan fails here, at construction

    def _check_policies(self) -> None:
        ep, mr = self.exhausted_policy, self.max_repeats
        if isinstance(ep, dict):
            unknown = [n for n in ep if n not in self.names]
            if unknown:
                raise ValueError(f"exhausted_policy names unknown datasets {unknown}; the datasets are {list(self.names)}")
            bad = {n: v for n, v in ep.items() if v not in _POLICIES}
            if bad:
                raise ValueError(f"exhausted_policy values must be one of {list(_POLICIES)}, got {bad}")
        elif ep is not None and ep not in _POLICIES:
            raise ValueError(f"exhausted_policy must be None, 'stop', 'repeat', 'redistribute' or {{name: policy}}, got {ep!r}")
        reps = mr if isinstance(mr, dict) else ({n: mr for n in self.names} if mr is not None else {})
        for n, v in reps.items():
            if n not in self.names:
                raise ValueError(f"max_repeats names unknown dataset {n!r}; the datasets are {list(self.names)}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"max_repeats of {n!r} must be an int >= 0, got {v!r}")
            if self.policy(n) == "stop":
                raise ValueError(f"max_repeats of {n!r} has no effect: its exhausted_policy is 'stop'; use 'repeat' or 'redistribute'")
        if mr is not None and ep is None:
            raise ValueError("max_repeats needs an exhausted_policy ('repeat' or 'redistribute'); exhausted_policy=None uses passes")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.datasets)

    def policy(self, name: str) -> str:
        """The exhausted policy of dataset ``name`` (``"repeat"`` under ``exhausted_policy=None``)."""
        ep = self.exhausted_policy
        return ep.get(name, "repeat") if isinstance(ep, dict) else ep or "repeat"

    def pass_limit(self, name: str) -> int | None:
        """How many passes dataset ``name`` makes before it stops or drops out (``None``: unbounded)."""
        pol = self.policy(name)
        if pol == "stop":
            return 1
        mr = self.max_repeats.get(name) if isinstance(self.max_repeats, dict) else self.max_repeats
        if pol == "redistribute":
            return 1 + (mr or 0)
        return None if mr is None else 1 + mr

    @property
    def unit(self) -> str:
        """What the weights count: the mixture's unit; unset, tokens with ``token_estimation``, else samples."""
        return self.mixture.unit or ("tokens" if self.token_estimation is not None else "samples")

    @property
    def needs_tokens(self) -> bool:
        """Whether placing samples needs tokens per sample (a token unit, or a schedule in tokens)."""
        m = self.mixture
        many = isinstance(m, MixtureSchedule) and len(m.points) > 1
        return self.unit == "tokens" or (many and (m.by == "tokens" or (m.by == "step" and self.samples_per_step is None)))

    @property
    def needs_calibration(self) -> bool:
        return self.calibration is None and (self.needs_tokens or self.token_estimation is not None)

    @property
    def estimation(self) -> TokenEstimation:
        return self.token_estimation or TokenEstimation()

    @property
    def needs_step_size(self) -> bool:
        m = self.mixture
        return isinstance(m, MixtureSchedule) and len(m.points) > 1 and m.by == "step" and self.samples_per_step is None and self.tokens_per_step is None

    @property
    def resolvable(self) -> bool:
        """Whether the timeline can be computed (calibration and step size present where needed)."""
        return not self.needs_step_size and not (self.needs_tokens and self.calibration is None)

    def with_calibration(self, calibration: Calibration) -> "StaticMixtureWorkSource":
        return attrs.evolve(self, calibration=calibration)

    @functools.cached_property
    def _resolved(self) -> tuple[Timeline, int | None, str | None, list, list]:
        if not self.resolvable:
            if self.needs_step_size:
                raise ValueError(
                    "a schedule by='step' needs to know how many samples (or tokens) a global step takes: build the "
                    "source into a Pipeline that ends in batch() (it fills this in), or pass samples_per_step= or "
                    "tokens_per_step= to the source"
                )
            raise ValueError(
                "this mixture counts tokens, so it needs tokens per sample for each dataset: run it in a Pipeline with a "
                "tokenize step (which measures them), or pin them with token_estimation=TokenEstimation({name: tokens_per_byte})"
            )
        return resolve_timeline(self)

    @property
    def timeline(self) -> Timeline:
        """Positions to datasets: the phases of constant integer weights (see :class:`Timeline`)."""
        return self._resolved[0]

    @property
    def interleave(self) -> Interleave | Timeline:
        """The interleave of a one-phase timeline (a static mixture); otherwise the timeline itself."""
        tl = self.timeline
        return interleave(tl.phases[0].weights) if len(tl.phases) == 1 else tl

    @property
    def end(self) -> int | None:
        """One past the last global position, or ``None`` for an endless source."""
        return self._resolved[1]

    @property
    def end_reason(self) -> str | None:
        """Why the data ends where it does (which dataset, which policy), or ``None`` when endless."""
        return self._resolved[2]

    def __len__(self) -> int:
        if self.end is None:
            raise TypeError("an endless source (a dataset repeats without max_repeats) has no length")
        return self.end

    def epochs_at(self, position: int) -> dict[str, float]:
        """Passes each dataset has made (fractional) over the positions before ``position``."""
        counts = self.timeline.counts_before(position)
        return {d.name: (int(c) / d.num_rows if d.num_rows else 0.0) for d, c in zip(self.datasets, counts)}

    def counts_before(self, position: int) -> dict[str, int]:
        """Samples of each dataset among the positions before ``position``."""
        return dict(zip(self.names, (int(c) for c in self.timeline.counts_before(position))))

    def target_at(self, position: int) -> dict[str, float]:
        """The mixture in force at ``position``, in the mixture's unit (tokens or samples), normalized."""
        if isinstance(self.mixture, MixtureSpec) and self.change is None and self.timeline.weights_at(position) == self.timeline.phases[0].weights:
            return dict(self.mixture.weights)  # the weights as given (the integers round them)
        w = self.timeline.weights_at(position)
        if self.unit == "tokens":
            w = [x * t for x, t in zip(w, self.calibration.tokens_per_sample(self.names))]
        total = sum(w) or 1
        return {n: x / total for n, x in zip(self.names, w)}

    def tokens_before(self, position: int) -> float:
        """Estimated tokens of the positions before ``position`` (needs a calibration)."""
        tps = self.calibration.tokens_per_sample(self.names)
        return float(sum(int(c) * t for c, t in zip(self.timeline.counts_before(position), tps)))

    @functools.cached_property
    def _key(self) -> int:
        return seed_key(self.seed)

    def pointers(self, t0: int, t1: int) -> list[tuple[int, int, int]]:
        """Sample pointers ``(dataset, shard, row)`` of global positions ``[t0, t1)``."""
        ds, shards, rows = self.pointer_arrays(t0, t1)
        return list(zip(ds.tolist(), shards.tolist(), rows.tolist()))

    def pointer_arrays(self, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.end is not None and t1 > self.end:
            raise IndexError(f"positions up to {t1} requested but the source ends at {self.end}")
        comps, index = self.timeline.assign(t0, t1)
        shard_out = np.empty(len(comps), dtype=np.int64)
        row_out = np.empty(len(comps), dtype=np.int64)
        for j, d in enumerate(self.datasets):
            sel = np.flatnonzero(comps == j)
            if not sel.size:
                continue
            epochs, pos = np.divmod(index[sel], d.num_rows)
            for epoch in sorted(set(epochs.tolist())):
                part = sel[epochs == epoch]
                p = pos[epochs == epoch]
                order, starts = _layout(d, self.shuffle_shards, self._key, epoch)
                slot = np.searchsorted(starts, p, side="right") - 1
                shard = order[slot]
                row = p - starts[slot]
                if self.shuffle_within_shard:
                    for s in sorted(set(shard.tolist())):
                        m = shard == s
                        key = fold_in(self._key, "rows", d.name, epoch, s)
                        row[m] = permute_np(row[m].astype(np.uint64), int(d.shard_rows[s]), key)
                shard_out[part] = shard
                row_out[part] = row
        return comps.astype(np.int64), shard_out, row_out

    def lane_chunk(self, lanes: int, lane: int, k: int) -> int:
        """The global chunk index of lane ``lane``'s ``k``-th chunk among ``lanes`` lanes."""
        if self.lane_assignment == "modulo" or lanes == 1:
            return k * lanes + lane
        return k * lanes + _inverse_block(self._key, lanes, k)[lane]

    def lane_range(self, lanes: int, lane: int, k: int) -> tuple[int, int] | None:
        """Global positions ``[t0, t1)`` of lane ``lane``'s ``k``-th chunk; ``None`` past its end.

        Block ``k`` gives each lane one whole chunk. The ``R`` positions from the first incomplete
        block on are cut into ``L`` contiguous ranges (the first ``R % L`` one longer), range
        ``s`` to the lane in slot ``s``, so lane totals differ by at most one.

        Examples:
            >>> from zephon.io import Dataset
            >>> ds = Dataset.from_rows("d", [{"i": i} for i in range(20)])
            >>> src = StaticMixtureWorkSource([ds], {"d": 1}, lane_assignment="modulo", chunk_size=4)
            >>> [[src.lane_range(2, lane, k) for k in range(4)] for lane in range(2)]
            [[(0, 4), (8, 12), (16, 18), None], [(4, 8), (12, 16), (18, 20), None]]
        """
        g = self.lane_chunk(lanes, lane, k)
        size = self.chunk_size
        if self.end is None:
            return g * size, (g + 1) * size
        complete = self.end // (lanes * size)
        if k < complete:
            return g * size, (g + 1) * size
        if k > complete:
            return None
        # The last, partial block: spread so that no lane ends whole chunks early.
        base = complete * lanes * size
        width, extra = divmod(self.end - base, lanes)
        slot = g - k * lanes
        t0 = base + slot * width + min(slot, extra)
        t1 = t0 + width + (slot < extra)
        return (t0, t1) if t1 > t0 else None

    def read(self, state: SourceState, lanes: int, lane: int, n: int) -> tuple[SourceState, list, bool]:
        """Up to ``n`` pointers of a lane from ``state``; returns (state, pointers, exhausted)."""
        out: list = []
        chunk, offset = state.chunk, state.offset
        while len(out) < n:
            rng = self.lane_range(lanes, lane, chunk)
            if rng is None:
                return SourceState(chunk, offset), out, True
            t0, t1 = rng
            take = min(n - len(out), t1 - t0 - offset)
            out.extend(self.pointers(t0 + offset, t0 + offset + take))
            offset += take
            if t0 + offset >= t1:
                chunk, offset = chunk + 1, 0
        exhausted = self.lane_range(lanes, lane, chunk) is None
        return SourceState(chunk, offset), out, exhausted

    def check_cursor(self, state: SourceState, lanes: int, lane: int) -> None:
        """Raise ``ValueError`` unless :meth:`read` can leave lane ``lane`` of ``lanes`` at
        ``state``: inside one of its chunks, or at offset 0 of the first chunk past its data.

        Examples:
            >>> from zephon.io import Dataset
            >>> ds = Dataset.from_rows("d", [{"i": i} for i in range(20)])
            >>> src = StaticMixtureWorkSource([ds], {"d": 1}, lane_assignment="modulo", chunk_size=4)
            >>> src.check_cursor(SourceState(2, 1), 2, 0)
            >>> src.check_cursor(SourceState(2, 2), 2, 0)
            Traceback (most recent call last):
            ...
            ValueError: offset 2 is past the end of work chunk 2, which holds 2 of the lane's positions
        """
        chunk, offset = state.chunk, state.offset
        for name, value in (("chunk", chunk), ("offset", offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the cursor's {name} must be an int >= 0, got {value!r}")
        rng = self.lane_range(lanes, lane, chunk)
        if rng is not None:
            if rng[1] > 2**62:
                raise ValueError(f"work chunk {chunk} lies past any position the source can number ({rng[0]})")
            if offset >= rng[1] - rng[0]:
                raise ValueError(f"offset {offset} is past the end of work chunk {chunk}, which holds {rng[1] - rng[0]} of the lane's positions")
            return
        if offset:
            raise ValueError(f"work chunk {chunk} is past the end of the lane's data, where the offset is 0, got {offset}")
        if chunk and self.lane_range(lanes, lane, chunk - 1) is None:
            # Chunks before the last, partial block are whole; the lane ends in that block or at it.
            end = self.end // (lanes * self.chunk_size) if self.end is not None else chunk
            end += self.lane_range(lanes, lane, end) is not None
            raise ValueError(f"work chunk {chunk} is past the end of the lane's data, which ends at chunk {end}")

    def with_io_options(self, io_options: Any) -> "StaticMixtureWorkSource":
        """The same source with every dataset read with ``io_options`` (see ``Dataset.with_io_options``)."""
        return attrs.evolve(self, datasets=tuple(d.with_io_options(io_options) for d in self.datasets))

    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides which sample comes where (datasets: ``source_entries``)."""
        m = self.mixture
        plain = isinstance(m, MixtureSpec) and self.unit == "samples" and self.change is None
        fp: dict[str, Any] = {
            "source": "StaticMixtureWorkSource",
            "datasets": source_entries(self.datasets),
            "mixture": {n: w for n, w in zip(self.names, m.integer_weights(self.names))} if plain else {**m.describe(), "unit": self.unit},
            **{k: getattr(self, k) for k in _SETTINGS},
        }
        if self.max_repeats is not None:
            fp["max_repeats"] = self.max_repeats
        if self.calibration is not None:
            fp["token_estimation"] = self.calibration.describe()
        if self.token_estimation is not None or self.calibration is not None or self.needs_tokens:
            fp["estimation"] = self.estimation.describe()
        fp.update({k: getattr(self, k) for k in _STEP_FIELDS if getattr(self, k) is not None})
        if self.change is not None:
            fp["change"] = self.change.describe()
        if not plain and self.resolvable:
            fp["timeline"] = self.timeline.describe()
        return fp

    @property
    def switch_positions(self) -> tuple[int, ...]:
        """Positions where the weights jump (a shuffle drains at each): a step schedule's points
        after the first and, under a changed plan, the old plan's jumps before the change."""
        start = self.change.position if self.change is not None else 0
        kept = tuple(p for p in self.change.switches if p < start) if self.change is not None else ()
        m = self.mixture
        if not isinstance(m, MixtureSchedule) or m.interpolation != "step":
            return kept
        return kept + tuple(sorted({pos for _, pos in self.point_positions[1:] if pos > start}))

    @property
    def point_positions(self) -> list[tuple[Any, int]]:
        """``(at, position)`` of every schedule point: where its weights take over."""
        return self._resolved[3]

    @property
    def piece_positions(self) -> list[tuple[int, dict[str, float]]]:
        """``(position, weights)`` of every stretch of constant schedule weights (ramp pieces
        too), in the schedule's unit, without redistributions and plan changes."""
        return self._resolved[4]


@functools.lru_cache(maxsize=4096)
def _inverse_block(key: int, lanes: int, block: int) -> tuple[int, ...]:
    perm = permutation(lanes, fold_in(key, "lanes", block))  # slot -> lane
    inv = np.empty(lanes, dtype=np.int64)
    inv[perm] = np.arange(lanes)
    return tuple(inv.tolist())


@functools.lru_cache(maxsize=256)
def _layout(d: Any, shuffle: bool, key: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Dataset ``d``'s shard order in ``epoch`` and each shard's first position; cached by dataset
    object, so all sources of one run share one copy."""
    sizes = d.shard_rows
    if shuffle and len(sizes) > 1:
        order = permutation(len(sizes), fold_in(key, "shards", d.name, epoch))
    else:
        order = np.arange(len(sizes), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[order])[:-1]]).astype(np.int64)
    # Shards with no rows never receive a position: searchsorted(side="right") skips them.
    return order, starts


def make_source(source: Any, *, seed: int = 0) -> StaticMixtureWorkSource:
    """A work source from itself, a plan, a ``Dataset``, a list of datasets or of dicts, or an HF dataset."""
    from .dataset import Dataset, as_dataset
    from .hf import hf_kind, refuse_stream

    if isinstance(source, StaticMixtureWorkSource):
        return source
    as_source = getattr(source, "as_source", None)
    if callable(as_source):  # a zephon.pipeline.plan.Plan (named by its method: plans sit above sources)
        return as_source()
    if hf_kind(source) in ("Dataset", "DatasetDict"):
        source = Dataset.from_hf("data", source)
    if isinstance(source, Dataset):
        return StaticMixtureWorkSource([source], {source.name: 1.0}, seed=seed, shuffle_shards=False)
    if isinstance(source, Sequence) and source and all(isinstance(d, Dataset) for d in source):
        return StaticMixtureWorkSource(list(source), {d.name: float(d.num_rows) for d in source}, seed=seed)
    if isinstance(source, (list, tuple)):
        ds = as_dataset(list(source))
        return StaticMixtureWorkSource([ds], {ds.name: 1.0}, seed=seed, shuffle_shards=False)
    if isinstance(source, Mapping):
        raise TypeError(
            "Pipeline() takes a work source, a zephon.io.Dataset, or a list of dicts; "
            "for a mixture use StaticMixtureWorkSource(datasets, {name: weight})"
        )
    if hf_kind(source) is not None or isinstance(source, Iterator):
        raise refuse_stream(source, "data")
    if isinstance(source, (str, os.PathLike)):
        where = os.fspath(source)
        raise TypeError(f"Pipeline() got the path {where!r}; open files with Pipeline(Dataset.from_path('data', {where!r}))")
    kind = f"{type(source).__module__}.{type(source).__qualname__}"
    raise TypeError(
        f"Pipeline() cannot read from a {kind}; pass a zephon.io.Dataset (Dataset.from_path, Dataset.from_hf, "
        "Dataset.from_rows), a Hugging Face datasets.Dataset, a list of dicts, or a work source"
    )
