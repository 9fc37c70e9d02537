"""``StaticMixtureWorkSource``: the order of sample pointers, as a pure function of position.

The source decides *which* sample comes at each global position ``t``; it reads nothing. Global
positions are grouped into work chunks of ``chunk_size``; chunk ``g`` belongs to exactly one lane
(a seeded permutation of each block of ``L`` chunks, or ``g % L``). A lane's input is therefore a
function of (source, L, lane) alone, and its cursor is two integers.

Position ``t`` maps to a component (dataset) and an index in it through :class:`Interleave`; the
index maps to (epoch, position in epoch), and the position in epoch to (shard, row) through a
per-epoch shard order and an optional within-shard permutation, both O(1)-memory Feistel
permutations keyed by (seed, dataset name, epoch[, shard]). No list of sample ids is ever built.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator, Literal, Mapping, Sequence

import attrs
import msgspec
import numpy as np

from .._keys import fold_in, permutation, permute_np, seed_key
from ._mixture import Interleave, MixtureSpec

ExhaustedPolicy = Literal["stop", "repeat"]


class SourceState(msgspec.Struct, frozen=True, tag="source", forbid_unknown_fields=True):
    """A lane's read cursor: its ``chunk``-th work chunk, ``offset`` positions into it."""

    chunk: int = 0
    offset: int = 0


def _as_datasets(datasets: Any) -> tuple:
    from ..io import Dataset

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


def _as_mixture(m: Any) -> MixtureSpec:
    return m if isinstance(m, MixtureSpec) else MixtureSpec(m)


@attrs.frozen(eq=False)
class StaticMixtureWorkSource:
    """Mix datasets by sample weight, with shard and row shuffles and epochs.

    Args:
        datasets: the datasets (names must be unique).
        mixture: ``{name: weight}`` or a :class:`MixtureSpec`; weights are per *sample*.
        seed: decides shard orders, within-shard orders and lane routing.
        shuffle_shards: visit each dataset's shards in a fresh pseudo-random order every epoch.
        shuffle_within_shard: also permute rows inside each shard, freshly every epoch.
        exhausted_policy: ``None`` (default): every dataset completes ``passes`` full passes,
            the faster ones repeating until the slowest finishes; ``"stop"``: stop as soon as any
            dataset runs out in its first pass; ``"repeat"``: never stop.
        passes: passes of the slowest dataset before stopping (with ``exhausted_policy=None``).
        chunk_size: positions per work chunk; chunks are routed whole to lanes, except the last,
            partial block of ``L`` chunks of a finite source, which is spread over the lanes (see
            :meth:`lane_range`).
        lane_assignment: ``"permute"`` (a seeded permutation of each block of L chunks, which
            spreads periodic patterns over lanes) or ``"modulo"`` (chunk ``g`` to lane ``g % L``).

    Examples:
        >>> from zephon.io import Dataset
        >>> ds = Dataset.from_rows("d", [{"text": str(i)} for i in range(5)])
        >>> src = StaticMixtureWorkSource([ds], {"d": 1.0}, shuffle_shards=False)
        >>> src.pointers(0, 5)
        [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4)]
    """

    datasets: tuple = attrs.field(converter=_as_datasets)
    mixture: MixtureSpec = attrs.field(converter=_as_mixture)
    seed: int = 0
    shuffle_shards: bool = True
    shuffle_within_shard: bool = False
    exhausted_policy: ExhaustedPolicy | None = None
    passes: int = 1
    chunk_size: int = 64
    lane_assignment: Literal["permute", "modulo"] = "permute"

    def __attrs_post_init__(self) -> None:
        self.mixture.validate_for(self.names)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.exhausted_policy not in (None, "stop", "repeat"):
            raise ValueError(f"exhausted_policy must be None, 'stop' or 'repeat', got {self.exhausted_policy!r}")
        if not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"passes must be an int >= 1, got {self.passes!r}")
        if self.passes != 1 and self.exhausted_policy is not None:
            raise ValueError("passes only applies with exhausted_policy=None; 'stop' ends at the first exhaustion")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if self.lane_assignment not in ("permute", "modulo"):
            raise ValueError(f"lane_assignment must be 'permute' or 'modulo', got {self.lane_assignment!r}")
        empty = [d.name for d in self.datasets if d.num_rows == 0]
        if empty:
            raise ValueError(f"datasets {empty} have no rows; remove them from the mixture")

    # -- derived structure ----------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.datasets)

    @functools.cached_property
    def interleave(self) -> Interleave:
        return Interleave(self.mixture.integer_weights(self.names))

    @functools.cached_property
    def end(self) -> int | None:
        """One past the last global position, or ``None`` for an endless source."""
        sizes = [d.num_rows for d in self.datasets]
        il = self.interleave
        if self.exhausted_policy == "repeat":
            return None
        if self.exhausted_policy == "stop":
            return min(il.position_of(j, n) for j, n in enumerate(sizes))
        return max(il.position_of(j, self.passes * n - 1) for j, n in enumerate(sizes)) + 1

    def __len__(self) -> int:
        if self.end is None:
            raise TypeError("an endless source (exhausted_policy='repeat') has no length")
        return self.end

    @functools.cached_property
    def _key(self) -> int:
        return seed_key(self.seed)

    # -- the order ----------------------------------------------------------------------------------------
    def pointers(self, t0: int, t1: int) -> list[tuple[int, int, int]]:
        """Sample pointers ``(dataset, shard, row)`` of global positions ``[t0, t1)``."""
        ds, shards, rows = self.pointer_arrays(t0, t1)
        return list(zip(ds.tolist(), shards.tolist(), rows.tolist()))

    def pointer_arrays(self, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.end is not None and t1 > self.end:
            raise IndexError(f"positions up to {t1} requested but the source ends at {self.end}")
        comps, index = self.interleave.assign(t0, t1)
        shard_out = np.empty(len(comps), dtype=np.int64)
        row_out = np.empty(len(comps), dtype=np.int64)
        for j, d in enumerate(self.datasets):
            sel = np.flatnonzero(comps == j)
            if not sel.size:
                continue
            epochs, pos = np.divmod(index[sel], d.num_rows)
            for epoch in np.unique(epochs).tolist():
                part = sel[epochs == epoch]
                p = pos[epochs == epoch]
                order, starts = _layout(self, j, epoch)
                slot = np.searchsorted(starts, p, side="right") - 1
                shard = order[slot]
                row = p - starts[slot]
                if self.shuffle_within_shard:
                    for s in np.unique(shard).tolist():
                        m = shard == s
                        key = fold_in(self._key, "rows", d.name, epoch, s)
                        row[m] = permute_np(row[m].astype(np.uint64), d.shard_sizes[s], key)
                shard_out[part] = shard
                row_out[part] = row
        return comps.astype(np.int64), shard_out, row_out

    # -- lanes ---------------------------------------------------------------------------------------------
    def lane_chunk(self, lanes: int, lane: int, k: int) -> int:
        """The global chunk index of lane ``lane``'s ``k``-th chunk among ``lanes`` lanes."""
        if self.lane_assignment == "modulo" or lanes == 1:
            return k * lanes + lane
        return k * lanes + _inverse_block(self._key, lanes, k)[lane]

    def lane_range(self, lanes: int, lane: int, k: int) -> tuple[int, int] | None:
        """Global positions ``[t0, t1)`` of lane ``lane``'s ``k``-th chunk; ``None`` past its end.

        Block ``k`` (global chunks ``k*L .. k*L+L-1``) gives each lane one whole chunk. For a finite
        source, the ``R = end - B`` positions from ``B``, the first position of the first block that
        is not complete, are cut into ``L`` contiguous ranges, the first ``R % L`` of ``R // L + 1``
        positions and the rest of ``R // L``; the lane in slot ``s`` of that block (the lane that
        would get its chunk ``k*L + s``) gets range ``s``. An empty range ends the lane. So every
        lane's total is within one position of every other's, and the layout depends only on
        ``end``, ``chunk_size``, ``L`` and the routing, never on ranks, workers or reads.

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
        # The last, partial block: spread its positions so that no lane ends whole chunks early
        # (a global step needs every lane, so those chunks would never be delivered).
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
        """Raise ``ValueError`` unless ``state`` is a cursor that lane ``lane`` of ``lanes`` reaches.

        :meth:`read` leaves a cursor inside one of the lane's chunks (its offset below the chunk's
        length), or at the lane's end: the first chunk past its data, offset 0.

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

    # -- identity -----------------------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        return {
            "source": "StaticMixtureWorkSource",
            "datasets": [d.fingerprint() for d in self.datasets],
            "mixture": {n: w for n, w in zip(self.names, self.mixture.integer_weights(self.names))},
            "seed": self.seed,
            "shuffle_shards": self.shuffle_shards,
            "shuffle_within_shard": self.shuffle_within_shard,
            "exhausted_policy": self.exhausted_policy,
            "passes": self.passes,
            "chunk_size": self.chunk_size,
            "lane_assignment": self.lane_assignment,
        }


@functools.lru_cache(maxsize=4096)
def _inverse_block(key: int, lanes: int, block: int) -> tuple[int, ...]:
    perm = permutation(lanes, fold_in(key, "lanes", block))  # slot -> lane
    inv = np.empty(lanes, dtype=np.int64)
    inv[perm] = np.arange(lanes)
    return tuple(inv.tolist())


@functools.lru_cache(maxsize=256)
def _layout(source: StaticMixtureWorkSource, j: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Dataset ``j``'s shard order in ``epoch`` and the first position of each shard in it."""
    d = source.datasets[j]
    sizes = np.asarray(d.shard_sizes, dtype=np.int64)
    if source.shuffle_shards and len(sizes) > 1:
        order = permutation(len(sizes), fold_in(source._key, "shards", d.name, epoch))
    else:
        order = np.arange(len(sizes), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[order])[:-1]]).astype(np.int64)
    # Shards with no rows never receive a position: searchsorted(side="right") skips them.
    return order, starts


def make_source(source: Any, *, seed: int = 0) -> StaticMixtureWorkSource:
    """Accept a work source, a ``Dataset``, a list of datasets, a plain list of dicts, or a
    Hugging Face ``datasets.Dataset`` (or a one-split ``DatasetDict``)."""
    from ..io import Dataset, as_dataset
    from ..io._hf import hf_kind, refuse_stream

    if isinstance(source, StaticMixtureWorkSource):
        return source
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
