"""Data parallelism: which lanes a rank owns, and checkpoints keyed by global lane id.

Rank ``r`` of ``D`` owns the contiguous block of lanes ``[r * L/D, (r + 1) * L/D)``. Global step
``k`` is lane 0's ``k``-th output, then lane 1's, ..., lane L-1's; a rank's share of it is its
block, in lane order. Checkpoints carry states per global lane, so they merge by union and
restore on any ``D`` that divides ``L``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import attrs
import msgspec


@attrs.frozen
class Topology:
    """A rank's view: lanes ``L``, data-parallel degree ``D``, rank ``r``, and its lanes."""

    canonical_replicas: int
    dp_degree: int
    dp_rank: int

    @property
    def lanes(self) -> tuple[int, ...]:
        per = self.canonical_replicas // self.dp_degree
        return tuple(range(self.dp_rank * per, (self.dp_rank + 1) * per))


def _from_environment() -> tuple[int, int, str]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), "torch.distributed"
    if "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0")), "WORLD_SIZE/RANK"
        except ValueError as exc:
            raise ValueError(f"WORLD_SIZE/RANK must be integers: {exc}") from exc
    return 1, 0, "default"


def resolve_topology(options: Any, microbatch_size: int | None) -> Topology:
    """Resolve and validate (L, D, r) from the options, ``torch.distributed`` or the environment."""
    L = options.canonical_replicas
    env_d, env_r, origin = _from_environment()
    D = options.dp_degree if options.dp_degree is not None else env_d
    r = options.dp_rank if options.dp_rank is not None else (env_r if options.dp_degree is None else 0)
    if options.dp_degree is not None and options.dp_rank is None and D > 1:
        r = env_r
    where = "options" if options.dp_degree is not None else origin
    if D > L:
        raise ValueError(
            f"dp_degree={D} (from {where}) exceeds canonical_replicas={L}: every rank needs at least one lane. "
            f"Set canonical_replicas to a common multiple of every data-parallel size you will use (e.g. {D * max(1, L)})."
        )
    if L % D:
        raise ValueError(
            f"canonical_replicas={L} is not divisible by dp_degree={D} (from {where}); ranks must own equal lane "
            f"blocks. Use an L that every data-parallel size divides, e.g. {_lcm(L, D)}."
        )
    if not 0 <= r < D:
        raise ValueError(f"dp_rank={r} is outside [0, {D}); pass dp_rank between 0 and dp_degree - 1")
    gbs = options.global_batch_size
    if gbs is not None and microbatch_size is not None and gbs != L * microbatch_size * (gbs // (L * microbatch_size) or 1):
        raise ValueError(
            f"global_batch_size={gbs} is not a multiple of canonical_replicas x microbatch_size = {L} x {microbatch_size} "
            f"= {L * microbatch_size}; each global step takes one microbatch from every lane"
        )
    return Topology(L, D, r)


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)


# -- checkpoints ---------------------------------------------------------------------------------------


def select_lanes(checkpoint: dict[str, Any], lanes: Iterable[int]) -> dict[int, Any]:
    """The states of ``lanes`` from a (merged) checkpoint; errors name the missing lanes."""
    have = checkpoint["lanes"]
    lanes = list(lanes)
    missing = [lane for lane in lanes if str(lane) not in have]
    if missing:
        raise ValueError(
            f"the checkpoint holds lanes {sorted(int(k) for k in have)} but this rank needs {lanes} "
            f"(missing {missing}); merge every rank's checkpoint with zephon.merge_checkpoints, "
            "or save and load them with zephon.save_checkpoint / zephon.load_checkpoint"
        )
    return {lane: have[str(lane)] for lane in lanes}


def merge_checkpoints(checkpoints: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Join per-rank checkpoints into one holding every lane.

    Ranks that share lanes (tensor/pipeline-parallel peers) must agree on them exactly.

    Raises:
        ValueError: different formats or fingerprints, or conflicting states for one lane.
    """
    from ._pipeline import fingerprint_diff

    checkpoints = list(checkpoints)
    if not checkpoints:
        raise ValueError("merge_checkpoints needs at least one checkpoint")
    first = checkpoints[0]
    lanes: dict[str, Any] = {}
    for i, ck in enumerate(checkpoints):
        if ck.get("format") != first.get("format"):
            raise ValueError(f"checkpoint {i} has format {ck.get('format')!r}, checkpoint 0 has {first.get('format')!r}")
        diffs = fingerprint_diff(first["fingerprint"], ck["fingerprint"])
        if diffs:
            raise ValueError(f"checkpoint {i} was taken with different data settings than checkpoint 0: {diffs[:5]}")
        for lane, state in ck["lanes"].items():
            if lane in lanes and lanes[lane] != state:
                raise ValueError(
                    f"checkpoints disagree on lane {lane}: were they taken at the same step on every rank? "
                    "Call checkpoint() on all ranks after the same number of steps."
                )
            lanes[lane] = state
    return {"format": first["format"], "fingerprint": first["fingerprint"], "lanes": dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))}


_STATE_KEY = re.compile(r"^lane_(\d+)$")


def checkpoint_to_state_dict(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as one entry per lane, for ``torch.distributed.checkpoint``.

    Each rank's entries have distinct keys, so DCP keeps every rank's lanes, and a rank of
    another data-parallel size asks for exactly the lanes it needs.
    """
    out: dict[str, Any] = {"zephon_format": checkpoint["format"], "zephon_fingerprint": msgspec.json.encode(checkpoint["fingerprint"]).decode()}
    for lane, state in checkpoint["lanes"].items():
        out[f"lane_{int(lane):05d}"] = msgspec.msgpack.encode(state)
    return out


def state_dict_to_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`checkpoint_to_state_dict`."""
    try:
        lanes = {}
        for key, value in state_dict.items():
            m = _STATE_KEY.match(key)
            if m:
                data = bytes(value) if not isinstance(value, bytes) else value
                lanes[str(int(m.group(1)))] = msgspec.msgpack.decode(data)
        return {"format": state_dict["zephon_format"], "fingerprint": msgspec.json.decode(state_dict["zephon_fingerprint"]), "lanes": lanes}
    except KeyError as exc:
        raise ValueError(f"not a zephon state_dict: missing {exc}; pass the mapping returned by Pipeline.state_dict()") from exc


# -- files --------------------------------------------------------------------------------------------

_FILE = re.compile(r"^zephon-lanes-(\d+)-(\d+)\.msgpack$")


def save_checkpoint(directory: str | os.PathLike, pipeline: Any) -> Path:
    """Write this rank's checkpoint to ``directory`` (one file per rank, named by its lanes).

    Returns the written path. The write is atomic, so a crash never leaves a torn file.
    """
    ck = pipeline.checkpoint()
    lanes = sorted(int(k) for k in ck["lanes"])
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"zephon-lanes-{lanes[0]:05d}-{lanes[-1]:05d}.msgpack"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(msgspec.msgpack.encode(ck))
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | os.PathLike, pipeline: Any) -> Any:
    """Restore ``pipeline`` from the files in ``directory`` that hold its lanes.

    Works for any data-parallel size: a rank reads only the files covering its lanes.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {d}")
    need = set(pipeline.topology().lanes)
    files = []
    for p in sorted(d.iterdir()):
        m = _FILE.match(p.name)
        if m and need & set(range(int(m.group(1)), int(m.group(2)) + 1)):
            files.append(p)
    if not files:
        raise FileNotFoundError(f"no zephon-lanes-*.msgpack file in {d} covers lanes {sorted(need)}")
    merged = merge_checkpoints(msgspec.msgpack.decode(p.read_bytes()) for p in files)
    return pipeline.restore(merged)
