"""Per-process shared resources: one per key, made on first use, undone on last release.

A process maps each pool once and registers each mapping with CUDA once, however many clients
it opens; both follow this one refcounting rule.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["PerProcess"]

T = TypeVar("T")


class PerProcess(Generic[T]):
    """Refcounted values by key; ``destroy`` runs when the last holder releases one."""

    def __init__(self, destroy: Callable[[T], None]) -> None:
        self._destroy = destroy
        self._lock = threading.Lock()
        self._entries: dict[Hashable, list] = {}  # key -> [value, holders]
        # A forked child keeps the values (its mappings are inherited) but not a lock a
        # parent's thread may have held.
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, key: Hashable, create: Callable[[], T]) -> T:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = [create(), 0]
            entry[1] += 1
            return entry[0]

    def release(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[key]
        self._destroy(entry[0])

    def holders(self) -> dict[Hashable, int]:
        with self._lock:
            return {key: e[1] for key, e in self._entries.items()}
