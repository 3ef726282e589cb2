"""Which kernel runs a product: a named one if it can, or `auto`'s pick for the batch's M.

`auto` takes llama.cpp's formula for M (kernels/registry.py, `llama_formula`) and, on a GPU, the fastest
kernel of that formula from the tuned table (kernels/tuning); on the CPU, that formula's numpy twin.  Every
rule about what a kernel can run is the kernel's own (`can_run`) and the backend's (`kernel_reason`); this
module turns their reasons into the service's errors, each looked up once per product.
"""

from __future__ import annotations

from typing import Any

from kernels.backend import Backend
from kernels.errors import InvalidRequest
from kernels.kernel import Kernel
from kernels.registry import AUTO_DESCRIPTION, KERNELS, WEIGHTS, cpu_reference, known_names, llama_formula

AUTO_PICKS_KEPT = 65536  # (type, M, N, K) shapes whose auto pick is remembered


class KernelChooser:
    def __init__(self, cuda: Backend | None, reasons: dict[str, str | None] | None = None):
        """`cuda`: the GPU backend whose kernels may run (all GPUs of a server alike), or None on the CPU;
        `reasons`: why each kernel cannot run, as another process's `table()` said (a front's view of its engines:
        it checks named kernels, and never picks for auto)."""
        self.cuda = cuda
        self.reasons = reasons
        self._auto: dict[tuple[str, int, int, int], Kernel] = {}

    @classmethod
    def from_table(cls, rows: list[dict[str, Any]]) -> KernelChooser:
        return cls(None, {r["name"]: r["reason"] for r in rows})

    @property
    def cuda_cc(self) -> int | None:
        return self.cuda.cc if self.cuda is not None else None

    def reason(self, kernel: Kernel) -> str | None:
        """Why `kernel` cannot run on this server at all, or None."""
        if self.reasons is not None:
            return self.reasons.get(kernel.name, f"{kernel.name} is not served here")
        if kernel.backend == "cuda" and self.cuda is not None:
            return self.cuda.kernel_reason(kernel)
        return kernel.device_reason(self.cuda_cc)

    def table(self) -> list[dict[str, Any]]:
        """`/v1/kernels`: every kernel, whether it can run here and why not."""
        rows = [{"name": "auto", "weight_types": list(WEIGHTS), "activation_format": "auto", "backend": "auto",
                 "available": True, "reason": None, "description": AUTO_DESCRIPTION}]
        for kernel in KERNELS.values():
            reason = self.reason(kernel)
            rows.append({**kernel.row(), "available": reason is None, "reason": reason})
        return rows

    def runnable(self, type_name: str, m: int, n: int, k: int) -> list[Kernel]:
        return [s for s in KERNELS.values()
                if s.shape_reason(type_name, m, n, k) is None and self.reason(s) is None]

    @staticmethod
    def named(kernel: str) -> Kernel:
        spec = KERNELS.get(kernel)
        if spec is None:
            raise InvalidRequest(f"unknown kernel {kernel!r}; known kernels: {', '.join(known_names())}",
                                 "unknown_kernel")
        return spec

    def auto(self, type_name: str, m: int, n: int, k: int) -> Kernel:
        """llama.cpp's formula for M, by the fastest kernel here that computes it."""
        key = (type_name, m, n, k)
        spec = self._auto.get(key)
        if spec is None:
            spec = (self.cuda.auto(type_name, m, n, k) if self.cuda is not None else None) \
                or cpu_reference(llama_formula(m, type_name, n, k))  # type: ignore[attr-defined]
            if len(self._auto) < AUTO_PICKS_KEPT:
                self._auto[key] = spec
        return spec

    def check(self, spec: Kernel, tensor: str, type_name: str, m: int, n: int, k: int) -> Kernel:
        """`spec` if it can run this product here; else a 422 that says why and which kernels can."""
        reason = spec.shape_reason(type_name, m, n, k) or self.reason(spec)
        if reason is not None:
            can = [s.name for s in self.runnable(type_name, m, n, k)]
            raise InvalidRequest(f"kernel {spec.name!r} cannot run {tensor} ({type_name} [{n}, {k}]) with M={m}: "
                                 f"{reason}; kernels that can: {', '.join(['auto', *can])}", "kernel_cannot_run")
        return spec

    def choose(self, kernel: str | Kernel, tensor: str, type_name: str, m: int, n: int, k: int) -> Kernel:
        """The kernel a product runs: `auto`'s pick, or the named kernel once checked."""
        if kernel == "auto":
            return self.auto(type_name, m, n, k)
        spec = self.named(kernel) if isinstance(kernel, str) else kernel
        return self.check(spec, tensor, type_name, m, n, k)
