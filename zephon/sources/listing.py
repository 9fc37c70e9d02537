"""One listing per job: under ``torch.distributed``, rank 0 opens a dataset and broadcasts it.

Each rank sends its request along and refuses rank 0's result for another one, naming both. What
a rank receives is verified where it is read (local shards by size and digest, remote ones by
ETag or checksum). ``torch`` is never imported here.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

__all__ = ["LISTING_MODES", "list_once"]

T = TypeVar("T")

#: ``"auto"``: rank 0 lists for the job when ``torch.distributed`` runs with several ranks; ``"local"``: every
#: process lists on its own (ranks that read different data).
LISTING_MODES = ("auto", "local")


def list_once(name: str, request: tuple, open_dataset: Callable[[], T], listing: str = "auto") -> T:
    """``open_dataset()`` (its result must pickle), on rank 0 only under multi-rank distributed.

    ``request`` (path, format, options) must be equal on every rank, else ``ValueError``. When rank
    0 fails it raises its error and the other ranks a ``RuntimeError`` naming it.
    """
    if listing not in LISTING_MODES:
        raise ValueError(
            f"dataset {name!r}: unknown listing {listing!r}; use 'auto' (rank 0 lists the dataset for every rank of "
            "torch.distributed) or 'local' (every process lists it)"
        )
    dist = sys.modules.get("torch.distributed") if listing == "auto" else None
    alone = dist is None or not dist.is_available() or not dist.is_initialized()
    if alone or dist.get_world_size() < 2:
        return open_dataset()
    rank = dist.get_rank()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            box[0] = (request, True, open_dataset())
        except Exception as exc:  # every rank must take part in the broadcast, then all raise
            failure = exc
            box[0] = (request, False, f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    theirs, ok, value = box[0]
    if failure is not None:
        raise failure
    if theirs != request:
        raise ValueError(
            f"dataset {name!r}: rank {rank} opens {request}, but rank 0 opened {theirs}: under torch.distributed rank 0 "
            "lists each dataset for every rank, so every rank must open the same datasets in the same order. "
            "Pass listing='local' to Dataset.from_path for data that differs per rank"
        )
    if not ok:
        raise RuntimeError(f"dataset {name!r}: rank 0 could not open it for the job: {value}")
    return value
