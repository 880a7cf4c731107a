"""The service's in-memory caches: sealed slices and forests, each an LRU bounded by bytes.

A count bound lets memory grow with the size of the entries (100 planned steps of large slices
held 2.3 GB); a byte bound holds whatever fits. An entry larger than the whole budget is not kept.
`StepCaches` is the two caches of one core: sealed slices by (step, rank), so a miss reads (and
decompresses) that rank's slice only; forests by (step, content digest), so planning does not
re-ingest what was just submitted, and a step deleted and submitted again never finds the old one.
Thread-safe. See docs/design/service.md ("Storage").
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from planner_service import ingest
from planner_service.core.metrics import Metrics
from planner_service.forest import Forest
from planner_service.store import Store

__all__ = ["ByteLRU", "StepCaches", "forest_size"]

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


def forest_size(forest: Forest) -> int:
    """Approximate memory of a forest: its arrays plus its id strings."""
    total = 0
    for name in Forest.__slots__:
        value = getattr(forest, name)
        if hasattr(value, "nbytes"):
            total += int(value.nbytes)
        elif isinstance(value, list):
            total += sum(56 + len(s) for s in value)
    return total


class StepCaches:
    """The slice and forest caches of one core (docs/design/service.md, "Storage").

    Args:
        slice_bytes, forest_bytes: byte budgets of the two caches.
        metrics: where their sizes are reported (`harts_cache_bytes`).
        limits: `ingest.Limits` a stored body is re-ingested under (None: ingest's defaults).
    """

    def __init__(self, *, slice_bytes: int, forest_bytes: int, metrics: Metrics, limits=None):
        self.slices: ByteLRU[tuple[str, int], bytes] = ByteLRU(
            slice_bytes, len, metrics.cache_bytes.labels("slices").set)
        self.forests: ByteLRU[tuple[str, str], Forest] = ByteLRU(
            forest_bytes, forest_size, metrics.cache_bytes.labels("forests").set)
        self._limits = limits

    def drop(self, step_id: str) -> None:
        """Forget everything of a step (deleted, here or on a replica)."""
        self.slices.pop_where(lambda key: key[0] == step_id)
        self.forests.pop_where(lambda key: key[0] == step_id)

    def forest(self, store: Store, step_id: str, digest: str) -> Forest:
        """The forest of a stored step: cached, else re-ingested from its stored body."""
        forest = self.forests.get((step_id, digest))
        if forest is not None:
            return forest
        fmt, body = store.body(step_id)
        if fmt == "json":
            forest = ingest.forest_from_json(body, self._limits)
        else:
            forest = ingest.forest_from_proto(body, self._limits)
        self.forests.put((step_id, digest), forest)
        return forest
