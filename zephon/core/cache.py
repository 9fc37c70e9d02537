"""Per-process caches of objects that are costly to build and cannot travel between processes.

After ``fork`` (an at-fork hook) the child gets a new lock and no entries, unless
``clear_after_fork=False``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["ProcessCache"]

_MISSING = object()
_CACHES: weakref.WeakSet[ProcessCache] = weakref.WeakSet()


class ProcessCache:
    """Objects built once per process, by key, and shared between threads.

    ``clear_after_fork=False`` only for objects valid in a child (read-only mappings).
    ``max_entries``: most entries kept, least recently used out first; an int, a function
    returning one (read at each insertion), or ``None`` (unbounded).

    Examples:
        >>> cache = ProcessCache(max_entries=2)
        >>> cache.get("a", lambda: [1])
        [1]
        >>> cache.get("a", lambda: [2])  # built once
        [1]
        >>> _ = cache.get("b", list), cache.get("c", list)
        >>> "a" in cache, len(cache)
        (False, 2)
    """

    def __init__(self, *, clear_after_fork: bool = True, max_entries: int | Callable[[], int] | None = None) -> None:
        self._clear_after_fork = clear_after_fork
        self._max_entries = max_entries
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.RLock()  # reentrant: a build may use the same cache
        _CACHES.add(self)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The entry for ``key``, made by ``build()`` on its first use in this process."""
        value = self._entries.get(key, _MISSING)
        if value is _MISSING:
            with self._lock:
                value = self._entries.get(key, _MISSING)
                if value is _MISSING:
                    value = build()
                    self._entries[key] = value
                    self._trim()
                    return value
        if self._max_entries is not None:
            try:  # without the lock, so that reads never wait for another entry's build
                self._entries.move_to_end(key)
            except KeyError:  # dropped meanwhile; the caller still holds the value
                pass
        return value

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The entry for ``key`` if this process holds one, else ``default``; never builds."""
        return self._entries.get(key, default)

    def discard(self, key: Hashable) -> None:
        """Drop the entry for ``key``, if any."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()

    def __contains__(self, key: Hashable) -> bool:
        return self.peek(key, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._entries)

    def _trim(self) -> None:
        limit = self._max_entries() if callable(self._max_entries) else self._max_entries
        while limit is not None and len(self._entries) > max(limit, 0):
            self._entries.popitem(last=False)

    def _after_fork(self) -> None:
        self._lock = threading.RLock()
        if self._clear_after_fork:
            self._entries = OrderedDict()


def _reset_after_fork() -> None:
    for cache in list(_CACHES):
        cache._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
