"""An LRU map bounded by the bytes of its values (the service's slice and forest caches).

A count bound lets memory grow with the size of the entries (100 planned steps of large slices
held 2.3 GB); a byte bound holds whatever fits. An entry larger than the whole budget is not kept.
Thread-safe.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

__all__ = ["ByteLRU"]

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Least-recently-used map whose values' sizes add up to at most `max_bytes`.

    Args:
        max_bytes: byte budget (0 keeps nothing).
        size_of: bytes of one value.
        on_size: called with the new total after every change (a metrics gauge).
    """

    def __init__(self, max_bytes: int, size_of: Callable[[V], int], on_size: Callable[[int], None] | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._on_size = on_size
        self._lock = threading.Lock()
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        """Bytes held now."""

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: K, value: V) -> None:
        size = self._size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size <= self.max_bytes:
                self._items[key] = (value, size)
                self.nbytes += size
                while self.nbytes > self.max_bytes:
                    _, (_, dropped) = self._items.popitem(last=False)
                    self.nbytes -= dropped
            total = self.nbytes
        if self._on_size is not None:
            self._on_size(total)

    def pop(self, key: K) -> None:
        self._pop([key])

    def pop_where(self, match: Callable[[K], bool]) -> None:
        """Drop every entry whose key matches (a walk over the keys: for rare invalidations)."""
        with self._lock:
            keys = [k for k in self._items if match(k)]
        self._pop(keys)

    def _pop(self, keys: list[K]) -> None:
        with self._lock:
            for key in keys:
                old = self._items.pop(key, None)
                if old is not None:
                    self.nbytes -= old[1]
            total = self.nbytes
        if self._on_size is not None:
            self._on_size(total)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        return key in self._items
