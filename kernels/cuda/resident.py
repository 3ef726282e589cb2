"""Weights resident on the GPU: the one place that owns their device memory.

Each (file version, tensor, layout) is uploaded once and kept under a byte budget with
least-recently-used eviction.  A layout is a dict of CuPy arrays built by a maker the kernel
backend supplies (GGUF blocks as they are, split quants/scales, dequantized fp16/fp32, ...).
Out-of-memory on upload evicts everything else and retries once, then raises DeviceOutOfMemory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from kernels.cache import ByteLRU
from kernels.errors import DeviceOutOfMemory

Layout = dict[str, Any]  # name -> cupy.ndarray


def layout_bytes(arrays: Layout) -> int:
    return sum(int(a.nbytes) for a in arrays.values())


def is_oom(exc: BaseException) -> bool:
    import cupy

    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return True
    return "cudaErrorMemoryAllocation" in str(exc) or "out of memory" in str(exc).lower()


class ResidentWeights:
    def __init__(self, budget: int, on_drop: Callable[[Hashable], None] | None = None):
        """`on_drop((key, layout))`: told of every layout the store lets go of (what reads it must let go too)."""
        self.lru: ByteLRU[Layout] = ByteLRU(budget, None if on_drop is None else lambda full, _: on_drop(full))
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        return self.lru.budget

    def has(self, key: Hashable, layout: str) -> bool:
        with self._lock:
            return self.lru.get((key, layout)) is not None

    def get(self, key: Hashable, layout: str, nbytes: int, make: Callable[[], Layout]) -> tuple[Layout, float]:
        """The layout's arrays, uploading them first if absent; and the upload time in ms (0 on a hit)."""
        import cupy

        full = (key, layout)
        with self._lock:
            hit = self.lru.get(full)
            if hit is not None:
                return hit, 0.0
            if nbytes > self.lru.budget:
                raise DeviceOutOfMemory(f"the weights need {nbytes} bytes in layout {layout!r}; the GPU budget "
                                        f"is {self.lru.budget} bytes (QGEMM_GPU_MEMORY_BYTES)")
            self.lru.make_room(nbytes)
            t0 = time.perf_counter()
            for attempt in (0, 1):
                try:
                    arrays = make()
                    cupy.cuda.get_current_stream().synchronize()
                    break
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    if attempt:
                        raise DeviceOutOfMemory(f"GPU out of memory uploading {nbytes} bytes of weights "
                                                f"({layout}) even after evicting every cached tensor") from None
                    self.evict_all()
            ms = (time.perf_counter() - t0) * 1e3
            self.lru.put(full, arrays, layout_bytes(arrays))
            return arrays, ms

    def evict_all(self) -> None:
        import cupy

        self.lru.clear()
        cupy.get_default_memory_pool().free_all_blocks()

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        freed = 0
        with self._lock:
            for full, size in self.lru.sizes().items():
                if match(full[0]):  # type: ignore[index]
                    self.lru.pop(full)
                    freed += size
        if freed:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        return freed

    def entries(self) -> list[tuple[Hashable, str, int]]:
        return [(full[0], full[1], size) for full, size in self.lru.sizes().items()]  # type: ignore[index]
