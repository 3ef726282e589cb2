"""The one registry of matmul kernels.

Each spec declares what it can run (weight types, activation format, the device it needs, shape
constraints) and answers `can_run(...)` with a reason or None.  `/v1/kernels`, `/v1/matmul`,
`auto` and the bench all read this table; backends look kernels up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernels.formats import QK

Backend = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    backend: Backend
    weight_types: tuple[str, ...]
    activation_format: Literal["q8_1", "f32"]
    description: str
    min_cc: int = 0  # compute capability as major*10+minor; 0 for the CPU
    k_multiple: int = QK
    max_m: int | None = None
    weight_layout: str = "gguf"  # the layout its weights are uploaded in (cached per layout)

    def shape_reason(self, type_name: str, m: int, n: int, k: int) -> str | None:
        if type_name not in self.weight_types:
            return f"{self.name} takes {'/'.join(self.weight_types)} weights, not {type_name}"
        if m < 1 or n < 1 or k < 1:
            return f"{self.name} needs M, N, K >= 1 (got M={m}, N={n}, K={k})"
        if k % self.k_multiple:
            return f"{self.name} needs K to be a multiple of {self.k_multiple} (K={k})"
        if self.max_m is not None and m > self.max_m:
            return f"{self.name} runs M <= {self.max_m} only (M={m})"
        return None

    def device_reason(self, cuda_cc: int | None) -> str | None:
        """Why this kernel cannot run on this machine, or None."""
        if self.backend == "cpu":
            return None
        if cuda_cc is None:
            return "needs a CUDA GPU through CuPy; this server runs on the CPU backend"
        if cuda_cc < self.min_cc:
            return f"needs compute capability {self.min_cc / 10:.1f}; the device has {cuda_cc / 10:.1f}"
        return None

    def can_run(self, type_name: str, m: int, n: int, k: int, cuda_cc: int | None) -> str | None:
        return self.device_reason(cuda_cc) or self.shape_reason(type_name, m, n, k)


WEIGHTS = ("Q4_0", "Q8_0")

AUTO_DESCRIPTION = ("picks the fastest correct kernel for the weight type and shape: on a GPU from the "
                    "tuned table (kernels/tuning), on the CPU the llama.cpp-exact reference")

KERNELS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec("ref_q8_1", "cpu", WEIGHTS, "q8_1",
                   "numpy reference on the CPU: activations to Q8_1, integer block dots, llama.cpp's "
                   "d_w*(d_a*sumi - 8*s_a) / d_w*d_a*sumi epilogue"),
        KernelSpec("ref_f32", "cpu", WEIGHTS, "f32",
                   "numpy on the CPU: weights dequantized with gguf.quants, fp32 activations, fp32 GEMM"),
    )
}


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in KERNELS or spec.name == "auto":
        raise ValueError(f"kernel {spec.name!r} is registered twice")
    KERNELS[spec.name] = spec
    return spec


def known_names() -> list[str]:
    return ["auto", *KERNELS]
