"""Per-document attention from training tensors: document ids, FlexAttention block masks, varlen boundaries.

A token of a packed row should attend only to tokens of its own document, and padding to nothing.
Documents are read from ``document_ids``, else ``cu_seqlens``, else the zeros of ``positions``;
padding from ``attention_mask`` (0) or ``padding_mask``. Computed with torch on the tensors' own
device; nothing is kept between calls.

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["document_block_mask", "document_ids", "varlen_boundaries"]

#: The id of padding tokens in :func:`document_ids`: a document of its own that attends to nothing.
PADDING = -1


def document_ids(tensors: Mapping[str, Any]) -> torch.Tensor:
    """The document index of every token of a training batch, ``-1`` on padding.

    Args:
        tensors: a :func:`~zephon.to_training` output with torch tensors, ``(B, T)`` or flattened.

    Returns:
        A ``torch.long`` tensor of the token layout's shape: per row (flattened: per batch)
        documents numbered ``0, 1, ...``. Without a padding field, the padding packing appends is
        a document of its own (no real token attends to it), not ``-1``.

    Raises:
        KeyError: none of ``document_ids``, ``cu_seqlens`` and ``positions`` is present.
        ValueError: a field of the wrong shape, ``cu_seqlens`` that do not cover the row, or
            positions whose rows do not start at zero.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"document_ids: tensors must be a to_training output (a mapping), got {type(tensors).__name__}")
    if "document_ids" in tensors:
        ids = _tensor(tensors, "document_ids").long()
    elif "cu_seqlens" in tensors:
        ids = _from_cu_seqlens(_tensor(tensors, "cu_seqlens", aligned=False), _layout_shape(tensors))
    elif "positions" in tensors:
        ids = _from_positions(_tensor(tensors, "positions"))
    else:
        raise KeyError(
            "document_ids: the tensors have no 'document_ids', 'cu_seqlens' or 'positions' field; call "
            "to_training(return_cu_seqlens=True), or keep the packed positions (pack_flat(emit_positions=True) "
            "with position_mode='preserve', the default)"
        )
    padding = _padding(tensors, ids.shape)
    return ids.masked_fill(padding, PADDING) if padding is not None else ids


def document_block_mask(
    tensors: Mapping[str, Any],
    causal: bool = True,
    *,
    sliding_window: int | None = None,
    block_size: int | tuple[int, int] = 128,
    compile: bool = False,
) -> Any:
    """A FlexAttention ``BlockMask`` keeping each token's attention within its own document.

    Query ``q`` attends to key ``k`` of its row when both are of the same document (see
    :func:`document_ids`), not padding, and, with ``causal``, ``k <= q``; with ``sliding_window=w``
    also ``|q - k| < w``. Padding queries attend to nothing (``flex_attention`` gives zeros).

    Args:
        tensors: a :func:`~zephon.to_training` output with torch tensors, ``(B, T)`` or flattened.
        causal: document-causal (decoders, the default) or document-bidirectional (encoders).
        sliding_window: optional window length in tokens (a positive int).
        block_size: FlexAttention's ``BLOCK_SIZE``, an int or ``(q, kv)`` pair.
        compile: build the mask with ``torch.compile`` (the eager build evaluates B * T * T pairs).

    Returns:
        A ``BlockMask`` of shape ``(B, 1, T, T)`` (flattened: ``(1, 1, B*T, B*T)``), broadcast over
        heads: ``flex_attention(q, k, v, block_mask=mask)``.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if not isinstance(causal, bool):
        raise TypeError(f"document_block_mask: causal must be True or False, got {causal!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"document_block_mask: sliding_window must be a positive int or None, got {sliding_window!r}")
    ids = document_ids(tensors)
    rows = ids if ids.dim() == 2 else ids[None]
    B, T = rows.shape
    if T == 0:
        raise ValueError("document_block_mask: the batch has no tokens (rows of length 0); nothing to attend over")

    def same_document(b, h, q, k):
        doc = rows[b, q]
        allowed = (doc == rows[b, k]) & (doc != PADDING)
        if causal:
            allowed = allowed & (k <= q)
        if sliding_window is not None:
            allowed = allowed & (q - k < sliding_window) & (k - q < sliding_window)
        return allowed

    device = rows.device
    return create_block_mask(same_document, B, None, T, T, device=device, BLOCK_SIZE=block_size, _compile=compile)


def varlen_boundaries(tensors: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` over the flattened batch, for variable-length attention kernels:
    every document and every run of padding of a row is one sequence, so the int32 offsets run from
    0 to ``B*T``."""
    ids = document_ids(tensors)
    rows = ids if ids.dim() == 2 else ids[None]
    B, T = rows.shape
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    offsets = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([B * T], dtype=offsets.dtype, device=offsets.device)
    cu = torch.cat([offsets, end]).to(torch.int32)
    return cu, int(torch.diff(cu).max()) if len(cu) > 1 else 0


def _tensor(tensors: Mapping[str, Any], name: str, *, aligned: bool = True) -> torch.Tensor:
    """``tensors[name]``, a torch tensor (``aligned``: in the token layout, ``(B, T)`` or ``(B*T,)``)."""
    value = tensors[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"document_ids: field {name!r} must be a torch tensor, got {type(value).__name__}; "
            "call to_training with a torch dtype (dtype='auto' gives torch.long)"
        )
    if aligned and value.dim() not in (1, 2):
        raise ValueError(
            f"document_ids: field {name!r} must be (B, T) or flattened (B*T,), got shape {tuple(value.shape)}"
        )
    return value


def _layout_shape(tensors: Mapping[str, Any]) -> tuple[int, ...]:
    """The token layout's shape, from the first token-aligned field present."""
    for name in ("input_ids", "tokens", "positions", "attention_mask", "padding_mask", "labels"):
        if name in tensors:
            return tuple(_tensor(tensors, name).shape)
    raise KeyError("document_ids: cu_seqlens needs a token-aligned field ('input_ids', 'positions', ...) for its shape")


def _from_positions(positions: torch.Tensor) -> torch.Tensor:
    rows = positions if positions.dim() == 2 else positions[None]
    if rows.shape[-1] and bool((rows[:, 0] != 0).any()):
        raise ValueError(
            "document_ids: every row's positions must start at zero, because document starts are the zeros "
            "of positions; pack with pack_flat(emit_positions=True) and keep position_mode='preserve'"
        )
    ids = torch.cumsum((rows == 0).long(), dim=-1) - 1
    return ids.reshape(positions.shape)


def _from_cu_seqlens(cu: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    flat = len(shape) == 1
    if cu.dim() != (1 if flat else 2) or (not flat and cu.shape[0] != shape[0]):
        want = "(K + 1,) for a flattened batch" if flat else f"({shape[0]}, K + 1) for a ({shape[0]}, {shape[1]}) batch"
        raise ValueError(f"document_ids: cu_seqlens must be {want}, got shape {tuple(cu.shape)}")
    cu = cu.long()
    rows = cu[None] if flat else cu
    width = shape[-1]
    if rows.shape[-1] and (
        bool((rows[:, 0] != 0).any()) or bool((rows[:, -1] != width).any()) or bool((rows.diff(dim=-1) < 0).any())
    ):
        raise ValueError(
            f"document_ids: cu_seqlens must rise from 0 to the row length {width} in every row; "
            "pass the to_training(return_cu_seqlens=True) output unchanged"
        )
    columns = torch.arange(width, device=cu.device).expand(rows.shape[0], width).contiguous()
    ids = torch.searchsorted(rows.contiguous(), columns, right=True) - 1
    return ids.reshape(shape)


def _padding(tensors: Mapping[str, Any], shape: torch.Size) -> torch.Tensor | None:
    """A bool tensor, True on padding, from ``attention_mask``/``padding_mask`` and negative ``document_ids``."""
    padding = None
    for name, pads in (("attention_mask", lambda t: t == 0), ("padding_mask", lambda t: t.bool())):
        if name in tensors:
            t = _tensor(tensors, name, aligned=False)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"document_ids: field {name!r} has shape {tuple(t.shape)}, the documents {tuple(shape)}"
                )
            padding = pads(t) if padding is None else padding | pads(t)
    if "document_ids" in tensors:
        negative = tensors["document_ids"] < 0
        padding = negative if padding is None else padding | negative
    return padding
