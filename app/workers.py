"""One worker per device: its backend, its thread, its weights and its batching.

A CUDA worker wraps the CudaBackend of one GPU (stream, compiled modules, resident weights under that
device's budget); a CPU worker wraps a CpuBackend with its own thread and prepared-weight cache.  Each
has its own Scheduler, so that requests batch per device.  The engine keeps a pool of workers per
backend: every GPU of QGEMM_DEVICES, and QGEMM_CPU_DEVICES CPU workers (1 by default; more make
"fake devices" on which the placement, routing and split logic runs without a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

from app.scheduler import RunBatch, Scheduler
from kernels.cpu import CpuBackend, Weights
from kernels.registry import KernelSpec


class Worker:
    def __init__(self, kind: Literal["cpu", "cuda"], index: int, run_batch: Callable[..., Any], max_rows: int,
                 wait_us: int, cpu_cache_bytes: int = 0, cuda: Any = None):
        self.kind, self.index = kind, index  # index: its place in the pool (for a GPU, the CUDA ordinal too)
        self.cuda = cuda
        self.cpu = CpuBackend(cpu_cache_bytes) if kind == "cpu" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"qgemm-cpu{index}") if kind == "cpu" else None
        bound: RunBatch = partial(run_batch, self)
        self.scheduler = Scheduler(bound, max_rows, wait_us)
        self.products = 0  # products (batches) this device ran

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.cuda.device_id if self.cuda is not None else self.index}"

    @property
    def name(self) -> str:
        return self.cuda.device_name if self.cuda is not None else "CPU (numpy)"

    def load(self) -> int:
        """Work waiting for or running on this device: what routing balances."""
        return self.scheduler.depth() + int(self.scheduler.busy)

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run fn on this device's thread."""
        return self.cuda.submit(fn) if self.cuda is not None else self._thread.submit(fn)  # type: ignore[union-attr]

    def memory(self) -> tuple[int, int]:
        """(weight bytes held, the budget)."""
        return self.cuda.memory() if self.cuda is not None else self.cpu.memory()  # type: ignore[union-attr]

    def free(self) -> int:
        used, budget = self.memory()
        return budget - used

    def entries(self) -> list[tuple[Hashable, str, int]]:
        if self.cuda is not None:
            return self.cuda.resident.entries()
        return self.cpu.entries()  # type: ignore[union-attr]

    def prepare(self, spec: KernelSpec, w: Weights) -> int:
        """The weights `spec` reads, uploaded (GPU) or prepared (CPU) ahead of use, on this device's thread."""
        if self.cuda is not None:
            return self.cuda.load(spec, w)
        return self._thread.submit(self.cpu.prepare, spec.name, w).result()  # type: ignore[union-attr]

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Free the weights whose (file version, tensor) key matches, after the product in flight."""
        if self.cuda is not None:
            return self.cuda.unload(match)
        return self._thread.submit(self.cpu.unload, match).result()  # type: ignore[union-attr]

    def forget(self, version_key: Hashable) -> None:
        """Drop a retired file version's weights without waiting (queued behind the product in flight)."""
        try:
            if self.cuda is not None:
                self.cuda.forget(version_key)
            else:
                self._thread.submit(self.cpu.forget, version_key)  # type: ignore[union-attr]
        except RuntimeError:  # shutting down: the thread is gone, and the memory with it
            pass

    def state(self) -> dict[str, Any]:
        used, budget = self.memory()
        return {"device": self.label, "name": self.name, "backend": self.kind, "resident_bytes": used,
                "budget_bytes": budget, "queue_depth": self.scheduler.depth(), "busy": self.scheduler.busy,
                "products": self.products}

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.close()
        else:
            self._thread.shutdown(wait=True)  # type: ignore[union-attr]
