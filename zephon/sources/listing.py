"""One listing per job: with ``torch.distributed`` initialized, rank 0 opens a dataset and the others receive it.

Opening a dataset lists its store (or reads its index) and counts the shards' rows; on hundreds of
ranks that is hundreds of identical listings of one bucket. :func:`list_once` runs the opening on
rank 0 only and broadcasts the result (the root and the opened shards, which pickle: worker
processes receive them the same way) to every rank of the default group. Each rank sends what it
asked for with the collective and refuses a result for another request, so ranks that open
different datasets fail, naming both, instead of reading rank 0's data.

What a rank receives is verified where it is read: a local shard is checked against the size and
content digest rank 0 recorded before every use (so a node whose copy differs refuses it, naming
the file), a remote one against its ETag or checksum when it is fetched.

Nothing is kept between calls. ``torch`` is never imported here: a process that has not imported
``torch.distributed`` lists on its own.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

__all__ = ["LISTING_MODES", "list_once"]

T = TypeVar("T")

#: ``"auto"``: rank 0 lists for the job when ``torch.distributed`` runs with several ranks; ``"local"``: every
#: process lists on its own (ranks that read different data).
LISTING_MODES = ("auto", "local")


def _distributed() -> Any:
    """``torch.distributed`` when it is initialized with more than one rank, else ``None``."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if dist.get_world_size() > 1 else None


def list_once(name: str, request: tuple, open_dataset: Callable[[], T], listing: str = "auto") -> T:
    """``open_dataset()``, run once per job under ``torch.distributed`` (see the module docstring).

    Args:
        name: the dataset's name, for messages.
        request: what this rank asks for (path, format, options): equal on every rank of one job.
        open_dataset: lists and opens the dataset; its result must pickle.
        listing: one of :data:`LISTING_MODES`.

    Raises:
        ValueError: an unknown ``listing``; ranks asking for different datasets.
        RuntimeError: rank 0 failed to open the dataset (every other rank raises this, naming
            rank 0's error; rank 0 raises the error itself).
    """
    if listing not in LISTING_MODES:
        raise ValueError(
            f"dataset {name!r}: unknown listing {listing!r}; use 'auto' (rank 0 lists the dataset for every rank of "
            "torch.distributed) or 'local' (every process lists it)"
        )
    dist = _distributed() if listing == "auto" else None
    if dist is None:
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
