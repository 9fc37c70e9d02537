"""Data parallelism: which lanes a rank owns, and how ranks agree on the end of data.

Rank ``r`` of ``D`` owns lanes ``[r * L/D, (r + 1) * L/D)``; global step ``k`` is every lane's
``k``-th output, in lane order.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import attrs


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
            f"blocks. Use an L that every data-parallel size divides, e.g. {math.lcm(L, D)}."
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


def distributed_group() -> Any:
    """``torch.distributed`` when it is imported and initialized with more than one rank, else ``None``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def all_ranks_have(flag: bool, dist: Any) -> bool:
    """Whether every rank passed ``flag=True``: one all-reduce (MIN; on CUDA for NCCL), so that
    ranks whose lanes end at different steps stop together."""
    import torch

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
