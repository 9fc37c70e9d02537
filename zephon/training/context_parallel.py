"""Context-parallel layout of training tensors: each CP rank's share of every row, and document ids.

Load-balanced (Megatron-LM, TransformerEngine, TorchTitan), a sequence is cut into ``2 * cp``
chunks and rank ``r`` takes chunks ``r`` and ``2 * cp - 1 - r``. ``"bshd"`` cuts the whole row;
``"thd"`` pads every document to a multiple of the chunk count inside the row (a row without room
fails) and cuts each on its own. Pure functions on ``[B, W]`` numpy buffers (after the label shift).
"""

from __future__ import annotations

from typing import Any

import numpy as np

FORMATS = ("bshd", "thd")

#: The value of a padding slot in ``document_ids``.
PADDING_DOCUMENT = -1


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_pair(value: Any) -> Any:
    """``context_parallel`` as a tuple of Python ints when it is a pair-like of integers, else as given."""
    if isinstance(value, (tuple, list)):
        return tuple(int(v) if _is_int(v) else v for v in value)
    return value


def check_options(spec: Any) -> None:
    """Reject invalid context-parallel options of ``spec`` (a TrainingSpec) and their combinations."""
    cp = spec.context_parallel
    if cp is None:
        if spec.context_parallel_format != "bshd" or not spec.load_balance:
            raise ValueError(
                "to_training: context_parallel_format and load_balance apply only with context_parallel="
                "(cp_size, cp_rank); pass context_parallel, or drop them"
            )
        return
    if not (isinstance(cp, tuple) and len(cp) == 2 and all(_is_int(v) for v in cp)):
        raise ValueError(
            f"to_training: context_parallel must be a pair of integers (cp_size, cp_rank), got {cp!r}"
        )
    size, rank = cp
    if size < 1:
        raise ValueError(f"to_training: context_parallel cp_size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"to_training: context_parallel cp_rank must lie in [0, {size}), got {rank}")
    if not (isinstance(spec.context_parallel_format, str) and spec.context_parallel_format in FORMATS):
        raise ValueError(
            f"to_training: context_parallel_format must be 'bshd' or 'thd', got {spec.context_parallel_format!r}"
        )
    if spec.padding_side != "right":
        raise ValueError(
            "to_training: context_parallel needs padding_side='right' (chunks are cut from the row start and "
            "documents must start at slot 0); drop padding_side='left'"
        )


def chunk_multiple(size: int, load_balance: bool) -> int:
    """How many chunks a sequence is cut into: ``2 * size`` load-balanced, ``size`` contiguous."""
    return 2 * size if load_balance else size


def label_shift(spec: Any) -> int:
    """How many tokens a row loses to the label shift (1 when labels are the next token)."""
    return int(spec.return_labels and spec.shift_labels)


def document_ids(starts: np.ndarray, real: np.ndarray, flatten: bool) -> np.ndarray:
    """Per slot, the index of its document within its row (within the batch when ``flatten``),
    ``PADDING_DOCUMENT`` on padding; ``starts`` marks document starts (zeros of positions), and
    the first real slot of a row always starts one."""
    first = real & ~np.concatenate([np.zeros_like(real[:, :1]), real[:, :-1]], axis=1)
    begins = (starts | first) & real
    counts = np.cumsum(begins, axis=1)
    if flatten:
        counts += (np.cumsum(begins.sum(axis=1)) - begins.sum(axis=1))[:, None]
    return np.where(real, counts - 1, PADDING_DOCUMENT).astype(np.int64)


def _stacked(rows: list[np.ndarray]) -> np.ndarray:
    """Rows of lengths as one ``[B, K]`` int64 array, short rows padded with zeros."""
    out = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def thd_layout(fields: dict, doc: np.ndarray, spec: Any, pad_id: int) -> tuple[dict, tuple[np.ndarray, ...]]:
    """Pad every document of every row to a multiple of the chunk count, inside the row's width.

    Returns the re-laid-out fields and, per row, ``(real_lengths, padded_lengths)`` of its
    sequences as ``[B, K]`` arrays (zero-padded); the row's trailing padding is one last sequence
    with no real tokens. Raises ``ValueError`` naming a row whose documents do not fit.
    """
    m = chunk_multiple(spec.context_parallel[0], spec.load_balance)
    B, W = doc.shape
    real_rows, padded_rows, index = [], [], np.full((B, W), -1, dtype=np.int64)
    offset = np.zeros((B, W), dtype=np.int64)  # per new slot: offset within its sequence
    start_source = np.full((B, W), -1, dtype=np.int64)  # per new slot: source slot of its sequence's start
    for i in range(B):
        ids = doc[i]
        n = int(np.count_nonzero(ids >= 0))
        lengths = np.bincount(ids[:n] - ids[0], minlength=0) if n else np.zeros(0, np.int64)
        padded = -(-lengths // m) * m
        need = int(padded.sum())
        if need > W:
            raise ValueError(
                f"to_training: context_parallel_format='thd' pads every document to a multiple of {m}; row {i} "
                f"needs {need} slots for its {len(lengths)} documents ({n} tokens) but has {W}. Give rows room: "
                f"pack with a smaller pack_flat(max_length=...) than the row width, or pass padding='max_length' "
                f"with max_length of at least {need + label_shift(spec)}"
            )
        tail = W - need
        real_rows.append(np.append(lengths, [0] if tail else []))
        padded_rows.append(np.append(padded, [tail] if tail else []))
        src = np.cumsum(lengths) - lengths
        dst = np.cumsum(padded) - padded
        for s, d, length, p in zip(src, dst, lengths, padded):
            index[i, d : d + length] = np.arange(s, s + length)
            offset[i, d : d + p] = np.arange(p)
            start_source[i, d : d + p] = s
        offset[i, need:] = np.arange(tail)
    rows = np.arange(B)[:, None]
    taken = np.maximum(index, 0)
    fills = {
        "input_ids": pad_id, "labels": spec.ignore_index, "padding_mask": True, "document_ids": PADDING_DOCUMENT,
    }
    out = {}
    for name, (arr, kind) in fields.items():
        if name == "positions":
            fill = np.where(start_source >= 0, arr[rows, np.maximum(start_source, 0)], 0) + offset
        else:
            fill = np.asarray(fills.get(name, 0), dtype=arr.dtype)
        out[name] = (np.where(index >= 0, arr[rows, taken], fill), kind)
    return out, (_stacked(real_rows), _stacked(padded_rows))


def rank_columns(padded_lengths: np.ndarray, size: int, rank: int, load_balance: bool) -> np.ndarray:
    """The slots of each row this rank takes, ``[B, W // size]``, from the ``[B, K]`` padded
    lengths of the rows' sequences."""
    m = chunk_multiple(size, load_balance)
    chunks = (rank, 2 * size - 1 - rank) if load_balance else (rank,)
    rows = []
    for lengths in padded_lengths:
        parts = []
        for s, p in zip(np.cumsum(lengths) - lengths, lengths):
            c = int(p) // m
            parts.extend(np.arange(s + k * c, s + (k + 1) * c) for k in chunks)
        rows.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    return np.stack(rows)


def split(fields: dict, doc: np.ndarray, spec: Any, pad_id: int | None) -> tuple[dict, Any]:
    """This rank's slice of every field, and for ``"thd"`` the ``(cu_seqlens, cu_seqlens_padded,
    max_seqlen)`` inputs (else ``None``): ``[B, K + 1]`` int32 per row, or flat over the batch.

    Raises:
        ValueError: the row width does not divide into the chunks, or (``"thd"``) a row has no room.
    """
    size, rank = spec.context_parallel
    m = chunk_multiple(size, spec.load_balance)
    B, W = doc.shape
    if W % m:
        shift = label_shift(spec)
        raise ValueError(
            f"to_training: context_parallel={spec.context_parallel!r} cuts every row into {m} chunks, but rows "
            f"have {W} input slots (row length {W + shift}{' minus the label shift' if shift else ''}), not a "
            f"multiple of {m}. Fix: pack rows of N tokens with pack_flat(max_length=N), N{' - 1' if shift else ''} "
            f"a multiple of {m}, or pass padding='max_length' (or pad_to_multiple_of={m})"
        )
    boundaries, padded_lengths = None, np.full((1, 1), W)  # "bshd": every row is one sequence
    if spec.context_parallel_format == "thd":
        fields, (real_lengths, padded_lengths) = thd_layout(fields, doc, spec, pad_id)
        boundaries = _boundaries(real_lengths, padded_lengths, spec.flatten)
    cols = rank_columns(padded_lengths, size, rank, spec.load_balance)
    rows = np.arange(B)[:, None]
    cols = np.broadcast_to(cols, (B, cols.shape[1]))
    return {name: (arr[rows, cols], kind) for name, (arr, kind) in fields.items()}, boundaries


def _boundaries(real: np.ndarray, padded: np.ndarray, flatten: bool) -> tuple[Any, Any, Any]:
    if flatten:  # one row of the sequences of every row, without the empty ones
        keep = padded.reshape(-1) > 0
        real, padded = real.reshape(-1)[keep][None], padded.reshape(-1)[keep][None]
    zero = np.zeros((len(real), 1), dtype=np.int64)
    cu, cu_padded = (np.concatenate([zero, np.cumsum(x, axis=1)], axis=1) for x in (real, padded))
    cu, cu_padded = cu.astype(np.int32), cu_padded.astype(np.int32)
    if flatten:
        return cu[0], cu_padded[0], int(padded.max(initial=0))
    return cu, cu_padded, padded.max(axis=1, initial=0).astype(np.int32)
