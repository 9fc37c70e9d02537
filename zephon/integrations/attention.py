"""Per-document attention from training tensors: document ids, FlexAttention block masks, varlen boundaries.

A packed row holds several documents; a token should attend only to tokens of its own document, and
padding should take no part in attention. :func:`document_ids` numbers the documents of every row of
a :func:`~zephon.to_training` output (padding is ``-1``), :func:`document_block_mask` turns the ids
into a FlexAttention ``BlockMask`` (document-causal, document-bidirectional, optionally with a
sliding window), and :func:`varlen_boundaries` gives the flat ``cu_seqlens``/``max_seqlen`` that
variable-length kernels (flash-attn's ``*_varlen_func``) take. Everything is computed with torch
operations on the tensors' own device; nothing is kept between calls.

Documents are read, in order of preference, from a ``document_ids`` tensor, from ``cu_seqlens``
(``return_cu_seqlens=True``) or from the zeros of ``positions`` (``pack_flat(emit_positions=True)``
with the default ``position_mode="preserve"``). Padding is known from ``attention_mask`` (0 on
padding; emitted whenever ``padding=`` is requested) or ``padding_mask`` (``return_padding_mask=True``).

torch is imported with this module, never by ``import zephon``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

__all__ = ["document_block_mask", "document_ids", "varlen_boundaries"]

#: The id of padding tokens in :func:`document_ids`: a document of its own that attends to nothing.
PADDING = -1


def document_ids(tensors: Mapping[str, Any]) -> torch.Tensor:
    """The document index of every token of a training batch, ``-1`` on padding.

    Args:
        tensors: a :func:`~zephon.to_training` output with torch tensors, padded ``(B, T)`` or flattened
            ``(B*T,)`` (``flatten=True``). Documents come from ``document_ids`` when present, else from
            ``cu_seqlens``, else from the zeros of ``positions``; padding from ``attention_mask`` (0) or
            ``padding_mask`` (True), and negative ``document_ids``.

    Returns:
        A ``torch.long`` tensor of the token layout's shape, on its device: per row, documents are
        numbered ``0, 1, ...`` in order (flattened: across the whole batch). Without a padding field,
        the padding that packing appends (its positions restart at 0) is a document of its own: no real
        token attends to it, but it is not ``-1``.

    Raises:
        KeyError: none of ``document_ids``, ``cu_seqlens`` and ``positions`` is present (the message
            names the ``to_training`` options that add them).
        ValueError: a field of the wrong shape or rank, ``cu_seqlens`` that do not cover the row, or
            positions whose rows do not start at zero.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"document_ids: tensors must be a to_training output (a mapping), got {type(tensors).__name__}")
    if "document_ids" in tensors:
        ids = _tensor(tensors, "document_ids").long()
        _check_layout(ids, "document_ids")
    elif "cu_seqlens" in tensors:
        ids = _from_cu_seqlens(_tensor(tensors, "cu_seqlens"), _layout_shape(tensors))
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

    Query ``q`` attends to key ``k`` of the same row when both belong to the same document (see
    :func:`document_ids`), neither is padding, and, with ``causal``, ``k <= q``; with
    ``sliding_window=w`` also ``|q - k| < w`` (a token sees itself and the ``w - 1`` tokens before it,
    and after it when not causal). Padding queries attend to nothing: ``flex_attention`` returns zeros
    for such rows (their log-sum-exp is ``-inf``), never NaN, and no real token attends to padding.

    Args:
        tensors: a :func:`~zephon.to_training` output with torch tensors, ``(B, T)`` or flattened.
        causal: document-causal (decoders, the default) or document-bidirectional (encoders).
        sliding_window: optional window length in tokens (a positive int).
        block_size: FlexAttention's ``BLOCK_SIZE``, an int or ``(q, kv)`` pair.
        compile: build the mask with ``torch.compile`` (``create_block_mask(_compile=True)``); the eager
            build evaluates the mask at every ``(q, k)`` pair, ``B * T * T`` booleans at a time.

    Returns:
        A ``BlockMask`` of shape ``(B, 1, T, T)`` (flattened: ``(1, 1, B*T, B*T)``) on the tensors' device,
        broadcast over heads; pass it as ``flex_attention(q, k, v, block_mask=mask)``.
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
    mask_mod = _mask_mod(rows, causal, sliding_window)
    return create_block_mask(mask_mod, B, None, T, T, device=rows.device, BLOCK_SIZE=block_size, _compile=compile)


def varlen_boundaries(tensors: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` over the flattened batch, for variable-length attention kernels.

    Every document of every row is one sequence; each run of padding within a row is one sequence too
    (so the offsets cover all ``B*T`` tokens and padding attends only to padding). ``cu_seqlens`` is
    an int32 tensor on the tensors' device starting at 0 and ending at ``B*T``; ``max_seqlen`` an int.
    """
    ids = document_ids(tensors)
    rows = ids if ids.dim() == 2 else ids[None]
    B, T = rows.shape
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    offsets = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([B * T], dtype=offsets.dtype, device=offsets.device)
    cu = torch.cat([offsets, end]).to(torch.int32)
    return cu, int(torch.diff(cu).max()) if len(cu) > 1 else 0


# -- pieces -------------------------------------------------------------------------------------------------


def _mask_mod(rows: torch.Tensor, causal: bool, window: int | None) -> Callable[..., torch.Tensor]:
    def same_document(b, h, q, k):
        doc = rows[b, q]
        allowed = (doc == rows[b, k]) & (doc != PADDING)
        if causal:
            allowed = allowed & (k <= q)
        if window is not None:
            allowed = allowed & (q - k < window) & (k - q < window)
        return allowed

    return same_document


def _tensor(tensors: Mapping[str, Any], name: str) -> torch.Tensor:
    value = tensors[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"document_ids: field {name!r} must be a torch tensor, got {type(value).__name__}; "
            "call to_training with a torch dtype (dtype='auto' gives torch.long)"
        )
    return value


def _check_layout(t: torch.Tensor, name: str) -> None:
    if t.dim() not in (1, 2):
        raise ValueError(
            f"document_ids: field {name!r} must be (B, T) or flattened (B*T,), got shape {tuple(t.shape)}"
        )


def _layout_shape(tensors: Mapping[str, Any]) -> tuple[int, ...]:
    """The token layout's shape, from the first token-aligned field present."""
    for name in ("input_ids", "tokens", "positions", "attention_mask", "padding_mask", "labels"):
        if name in tensors:
            t = _tensor(tensors, name)
            _check_layout(t, name)
            return tuple(t.shape)
    raise KeyError("document_ids: cu_seqlens needs a token-aligned field ('input_ids', 'positions', ...) for its shape")


def _from_positions(positions: torch.Tensor) -> torch.Tensor:
    _check_layout(positions, "positions")
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
            t = _tensor(tensors, name)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"document_ids: field {name!r} has shape {tuple(t.shape)}, the documents {tuple(shape)}"
                )
            padding = pads(t) if padding is None else padding | pads(t)
    if "document_ids" in tensors:
        negative = tensors["document_ids"] < 0
        padding = negative if padding is None else padding | negative
    return padding
