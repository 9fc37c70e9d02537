"""Pre-tokenized token files (nanoGPT, Megatron-LM, OLMo): flat arrays of concatenated documents.

A ``.npy`` file, or a raw ``.bin`` (``uint16`` unless given). Documents end with, and include,
each ``eos_token_id`` (cached offsets), or are the sequences of a Megatron ``.idx`` beside the
``.bin``. A row is ``{"input_ids": ids}``, a read-only view of the mapped file.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from ..core.cache import ProcessCache
from .files import FileIdentity, open_cached
from .digest import ShardChangedError
from .jsonl import load_index, save_index, stamp

TOKEN_SUFFIXES = (".bin", ".npy")
#: the ``token_dtype`` values of a flat token file
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_SCAN = 1 << 26
_OPEN = ProcessCache(clear_after_fork=False, max_entries=128)


def megatron_index(path: str) -> tuple[np.dtype, np.ndarray] | None:
    """``(dtype, token offsets of each document)`` from the Megatron ``.idx`` beside ``path``, if any."""
    idx = os.path.splitext(path)[0] + ".idx"
    if not os.path.isfile(idx):
        return None
    with open(idx, "rb") as f:
        if f.read(9) != _MEGATRON_MAGIC:
            return None
        # version, dtype code, sequence count, document count (sequences are our documents)
        version, code, count, _ = struct.unpack("<QBQQ", f.read(25))
        sizes = np.fromfile(f, dtype=np.int32, count=count)
    if version != 1 or code not in _MEGATRON_DTYPES or sizes.shape[0] != count:
        raise ValueError(f"{idx} is not a Megatron MMIDIDX version-1 index (or is cut short); re-create it")
    return np.dtype(_MEGATRON_DTYPES[code]), np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))


def eos_offsets(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Document starts of ``tokens`` split after each ``eos``, then ``len(tokens)``.

    Example:
        >>> eos_offsets(np.array([5, 1, 0, 7, 0, 3], dtype=np.uint16), 0).tolist()
        [0, 3, 5, 6]
    """
    n = tokens.shape[0]
    ends = [np.flatnonzero(tokens[lo : lo + _SCAN] == eos) + lo + 1 for lo in range(0, n, _SCAN)]
    cuts = np.concatenate([np.zeros(0, np.int64)] + ends).astype(np.int64)
    if cuts.size and cuts[-1] == n:
        cuts = cuts[:-1]
    return np.concatenate(([0], cuts, [n])).astype(np.int64) if n else np.zeros(1, np.int64)


class TokenShard(FileIdentity):
    """One flat token file read as documents of token ids (``dtype``: as given, unless the ``.npy``
    header or Megatron index says; ``eos_token_id``: the separator)."""

    __slots__ = FileIdentity._id_fields + ("dtype", "eos_token_id", "__weakref__")

    def __init__(self, path: str, shard_id: str, *, dtype: str | None, eos_token_id: int | None, cache_dir: str, verify: str = "quick", digest: str | None = None):
        self._init_identity(path, shard_id, verify, cache_dir, digest)
        self.dtype = dtype
        self.eos_token_id = eos_token_id

    def count_rows(self, dataset: str, io: Any = None) -> int:
        self.num_rows = self._open(dataset)[1].shape[0] - 1
        return self.num_rows

    def _open(self, dataset: str) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, document offsets)``, opened once per process."""
        return open_cached(_OPEN, self, dataset, lambda: self._build(dataset))

    def _build(self, dataset: str) -> tuple[np.ndarray, np.ndarray]:
        mega = megatron_index(self.path) if self.path.endswith(".bin") else None
        if self.path.endswith(".npy"):
            try:
                tokens = np.load(self.path, mmap_mode="r")
            except ValueError as err:
                raise ValueError(f"dataset {dataset!r}: {self.path} is not a readable .npy file ({err}); it may be cut short") from err
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise ValueError(f"dataset {dataset!r}: {self.path} holds a {tokens.ndim}-d {tokens.dtype} array; token files are flat integer arrays")
        else:
            dtype = np.dtype(mega[0] if mega else (self.dtype or "uint16"))
            if self.size % dtype.itemsize:
                raise ValueError(f"dataset {dataset!r}: {self.path} has {self.size} bytes, not a whole number of {dtype} tokens; it was cut short, or its dtype is not {dtype} (pass token_dtype=)")
            tokens = np.memmap(self.path, dtype=dtype, mode="r") if self.size else np.zeros(0, dtype)
        if mega is not None:
            offsets = mega[1]
            if offsets[-1] != tokens.shape[0]:
                raise ValueError(f"dataset {dataset!r}: the Megatron index of {self.path} counts {int(offsets[-1])} tokens, the file holds {tokens.shape[0]}; one of them is cut short or they do not belong together")
        else:
            if self.eos_token_id is None:
                raise ValueError(f"dataset {dataset!r}: {self.path} has no Megatron .idx beside it, so documents are split at an end-of-document token: pass eos_token_id= (for GPT-2 tokenizers 50256)")
            key = f"{self.path}#tokens-eos={self.eos_token_id}"
            # The cached offsets are keyed by the file, its content and its length in tokens.
            offsets = load_index(self.cache_dir, key, tokens.shape[0], stamp(self.digest))
            if offsets is None:
                offsets = eos_offsets(tokens, self.eos_token_id)
                save_index(self.cache_dir, key, tokens.shape[0], stamp(self.digest), offsets)
        if self.num_rows >= 0 and offsets.shape[0] - 1 != self.num_rows:
            raise ShardChangedError(f"dataset {dataset!r}: {self.path} now has {offsets.shape[0] - 1} documents, not {self.num_rows}; open the dataset again")
        tokens = tokens.view(np.ndarray)  # a plain read-only view of the mapping
        tokens.flags.writeable = False
        return tokens, offsets

    def read(self, rows: np.ndarray, dataset: str, io: Any = None) -> list:
        tokens, offsets = self._open(dataset)
        return [{"input_ids": tokens[offsets[r] : offsets[r + 1]]} for r in rows.tolist()]
