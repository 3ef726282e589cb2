"""One worker per device: its backend (kernels/backend.py: the CUDA backend of one GPU, or a CPU backend) and its
batching (a Scheduler of its own, so that requests batch per device).  The engine keeps a pool of workers per
backend kind: every GPU of QGEMM_DEVICES, and QGEMM_CPU_DEVICES CPU workers (1 by default; more make "fake
devices" on which the placement, routing and split logic runs without a GPU)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

from app.scheduler import RunBatch, Scheduler
from kernels.backend import Backend
from kernels.kernel import Kernel
from kernels.types import Weights


class Worker:
    def __init__(self, backend: Backend, run_batch: Callable[..., Any], max_rows: int, wait_us: int):
        self.backend = backend
        self.kind = backend.name
        bound: RunBatch = partial(run_batch, self)
        self.scheduler = Scheduler(bound, max_rows, wait_us)
        self.products = 0  # products (batches) this device ran
        self.labels = [backend.label]  # an answer's devices when it ran here alone (shared: read, never changed)

    @property
    def label(self) -> str:
        return self.backend.label

    @property
    def name(self) -> str:
        return self.backend.device_name

    def backlog(self) -> int:
        """Work waiting for or running on this device: what routing balances."""
        return self.scheduler.depth() + int(self.scheduler.busy)

    def memory(self) -> tuple[int, int]:
        """(weight bytes held, the budget)."""
        return self.backend.memory()

    def free(self) -> int:
        used, budget = self.memory()
        return budget - used

    def entries(self) -> list[tuple[Hashable, str, int]]:
        return self.backend.entries()

    def prepare(self, kernel: Kernel, w: Weights) -> int:
        """The weights `kernel` reads, uploaded (GPU) or prepared (CPU) ahead of use, on this device's thread."""
        return self.backend.prepare(kernel, w)

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Free the weights whose (file version, tensor) key matches, after the product in flight."""
        return self.backend.unload(match)

    def forget(self, version_key: Hashable) -> None:
        """Drop a retired file version's weights without waiting (queued behind the product in flight)."""
        self.backend.forget(version_key)

    def state(self) -> dict[str, Any]:
        used, budget = self.memory()
        return {"device": self.label, "name": self.name, "backend": self.kind, "resident_bytes": used,
                "budget_bytes": budget, "queue_depth": self.scheduler.depth(), "busy": self.scheduler.busy,
                "products": self.products}

    def close(self) -> None:
        self.backend.close()
