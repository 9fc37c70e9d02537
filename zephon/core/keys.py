"""Counter-based randomness: keys, ``fold_in``, uniform draws and O(1)-memory permutations.

Every random decision is a pure function of a 64-bit key (derived from the seed with
:func:`fold_in`) and a counter, as in JAX. Mixing is SplitMix64's finalizer; strings use BLAKE2b.
"""

from __future__ import annotations

import hashlib
from typing import Union

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

KeyPart = Union[int, str, bytes]


def mix64(x: int) -> int:
    """SplitMix64 finalizer of ``x + golden``: a bijective, well-mixed 64-bit hash."""
    z = (x + _GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def mix64_np(x: np.ndarray) -> np.ndarray:
    """Vectorized :func:`mix64` over a ``uint64`` array (wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def fold_in(key: int, *parts: KeyPart) -> int:
    """Derive a new key from ``key`` and any number of ints or names.

    Examples:
        >>> fold_in(0, "shuffle", 3) == fold_in(0, "shuffle", 3)
        True
        >>> fold_in(0, "shuffle", 3) != fold_in(0, "shuffle", 4)
        True
    """
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (int, str, bytes)):
            raise TypeError(f"fold_in takes ints, strings or bytes, got {type(part).__name__}: {part!r}")
        if isinstance(part, int):
            key = mix64((key ^ mix64(part & MASK64)) & MASK64)
        else:
            data = part.encode() if isinstance(part, str) else part
            digest = hashlib.blake2b(key.to_bytes(8, "little") + b"\x00" + data, digest_size=8).digest()
            key = int.from_bytes(digest, "little")
    return key


def seed_key(seed: int) -> int:
    """The root key of a user seed (any Python int; negative and huge seeds are folded in)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
    return fold_in(0x5A4550484F4E, seed)  # "ZEPHON"


def draw(key: int, counter: int) -> int:
    """The ``counter``-th 64-bit draw of ``key``."""
    return mix64(key ^ mix64(counter & MASK64))


def randbelow(key: int, counter: int, n: int) -> int:
    """A draw uniform in ``[0, n)`` (multiply-shift; bias below 2**-40 for n < 2**24)."""
    if n <= 0:
        raise ValueError(f"randbelow needs n > 0, got {n}")
    return (draw(key, counter) * n) >> 64


_ROUNDS = 6


def permute(index: int, n: int, key: int) -> int:
    """Position ``index`` of a pseudo-random permutation of ``range(n)`` (:func:`permute_np`).

    Examples:
        >>> sorted(permute(i, 10, 7) for i in range(10)) == list(range(10))
        True
    """
    if not 0 <= index < n:
        raise IndexError(f"permute index {index} outside [0, {n})")
    return int(permute_np(np.array([index], dtype=np.uint64), n, key)[0])


def permute_np(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """Positions ``indices`` of a pseudo-random permutation of ``range(n)``: a keyed Feistel
    network over the next even power of two, cycle-walking into ``[0, n)``; no state."""
    idx = np.asarray(indices, dtype=np.uint64)
    if idx.size and (int(idx.max()) >= n):
        raise IndexError(f"permute index {int(idx.max())} outside [0, {n})")
    if n == 1:
        return np.zeros_like(idx)
    half = (max(2, max(n - 1, 1).bit_length()) + 1) // 2  # bits of each half
    h, m = np.uint64(half), np.uint64((1 << half) - 1)
    round_keys = [np.uint64(fold_in(key, r)) for r in range(_ROUNDS)]
    out = idx.copy()
    todo = np.arange(idx.size)
    x = idx.copy()
    while todo.size:
        left, right = x >> h, x & m
        for rk in round_keys:
            left, right = right, left ^ (mix64_np(rk ^ right) & m)
        x = (left << h) | right
        done = x < np.uint64(n)
        out[todo[done]] = x[done]
        todo, x = todo[~done], x[~done]
    return out.astype(np.int64)


def permutation(n: int, key: int) -> np.ndarray:
    """The whole permutation of ``range(n)`` as an array (for small n: shard orders, lanes)."""
    return permute_np(np.arange(n, dtype=np.uint64), n, key) if n else np.zeros(0, dtype=np.int64)
