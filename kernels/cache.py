"""A least-recently-used cache bounded by bytes, shared by the CPU weight cache and the GPU store."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, budget: int, on_evict: Callable[[Hashable, V], None] | None = None):
        self.budget = budget
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.RLock()
        self._on_evict = on_evict
        self.used = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def make_room(self, nbytes: int) -> bool:
        """Evict the least recently used until nbytes fit; False when they never can."""
        with self._lock:
            if nbytes > self.budget:
                return False
            while self._items and self.used + nbytes > self.budget:
                key, (value, size) = self._items.popitem(last=False)
                self.used -= size
                if self._on_evict:
                    self._on_evict(key, value)
            return True

    def put(self, key: Hashable, value: V, nbytes: int) -> bool:
        with self._lock:
            self.pop(key)
            if not self.make_room(nbytes):
                return False
            self._items[key] = (value, nbytes)
            self.used += nbytes
            return True

    def pop(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return None
            self.used -= item[1]
            if self._on_evict:
                self._on_evict(key, item[0])
            return item[0]

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._items)

    def sizes(self) -> dict[Hashable, int]:
        with self._lock:
            return {k: size for k, (_, size) in self._items.items()}

    def clear(self) -> None:
        with self._lock:
            for key in list(self._items):
                self.pop(key)
