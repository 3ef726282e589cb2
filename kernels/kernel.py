"""What a matmul kernel is: one object that declares what it runs and owns how it runs it.

A kernel names the weight types it takes, the formula it computes (`Formula`: llama.cpp's MMVQ or MMQ on
Q8_1 activations, or a float product), its limits (compute capability, K's multiple, largest M), the
layout its weights are kept in and the layout its activations are prepared in, and how it runs: a CPU
kernel computes with numpy (kernels/cpu.py), a CUDA kernel launches on a stream (kernels/cuda/kernels.py).
`can_run` says why it cannot take a product, or None.  Registering the object (kernels/registry.py) is
the only step to add one: `/v1/kernels`, `auto`, the backends, the bench and the tests read the registry.

This shape follows vLLM's MPLinearKernel (`can_implement`, weights processed once, `apply`) and ggml's
`mmq_type_traits` (what a format needs, in one place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from kernels.formats import QK, format_of

# the formulas a kernel computes: llama.cpp's MMVQ (`q8_1_mmvq`, its path for M <= 8) and MMQ (`q8_1_mmq`, M > 8)
# on Q8_1 activations (kernels/reference.py spells out each), or a float product of (dequantized) weights with
# activations kept in fp32 (`f32`), rounded to half (`f16`) or bfloat16 (`bf16`), llama.cpp's half2 kernel of
# F16 matrices at M = 1 (`f16_mmvf`), or its cuBLAS call for F16 matrices (`f16_h`: half operands, sums and outputs)
Formula = Literal["q8_1_mmvq", "q8_1_mmq", "f32", "f16", "bf16", "f16_mmvf", "f16_h"]
FORMULAS: tuple[str, ...] = get_args(Formula)
Device = Literal["cpu", "cuda"]


class Layout:
    """A form a kernel's weights or activations take; kernels that share one share its cached arrays."""

    name: str

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


@dataclass(frozen=True, kw_only=True, eq=False)
class Kernel:
    name: str
    weight_types: tuple[str, ...]
    activation_format: Formula  # the formula it computes
    description: str
    min_cc: int = 0  # compute capability as major*10+minor; 0 for the CPU
    max_cc: int | None = None  # for architecture-specific instructions (sm_90a's wgmma exists on 9.0 only)
    k_multiple: int = QK
    max_m: int | None = None
    # where `auto` tries it for shapes the tuned table lacks (kernels/tuning): lower first, among the kernels
    # of llama.cpp's formula for that M; None: after every ranked one, in registration order
    auto_rank: int | None = None
    # `auto` takes it only for weights of up to this many bytes, where it measured faster (None: any size)
    auto_max_weight_bytes: int | None = None
    # False where it computes its formula only up to rounding it cannot know: the CPU twin of cuBLAS's half
    # sums (`f16_h`), whose order is the library's own; parity (tools/parity.py) holds only exact kernels to ggml
    exact: bool = True

    backend: ClassVar[Device]

    # -- what it reads --------------------------------------------------------------------------
    @property
    def weights(self) -> Layout:
        """The layout its weights are kept in (uploaded or prepared once, cached per tensor and layout)."""
        raise NotImplementedError

    def activations_for(self, type_name: str) -> Layout:
        """The layout its activations are prepared in, for weights of this type."""
        raise NotImplementedError

    @property
    def quantizes(self) -> bool:
        """Whether it quantizes the activations to Q8_1 (either of llama.cpp's formulas)."""
        return self.activation_format.startswith("q8_1")

    # -- what it can run ------------------------------------------------------------------------
    def shape_reason(self, type_name: str, m: int, n: int, k: int) -> str | None:
        if type_name not in self.weight_types:
            return f"{self.name} takes {'/'.join(self.weight_types)} weights, not {type_name}"
        if m < 1 or n < 1 or k < 1:
            return f"{self.name} needs M, N, K >= 1 (got M={m}, N={n}, K={k})"
        if k % self.k_multiple:
            return f"{self.name} needs K to be a multiple of {self.k_multiple} (K={k})"
        fmt = format_of(type_name)
        if fmt is not None and fmt.whole_block_rows and k % fmt.block_values:
            return f"{type_name} rows are whole blocks of {fmt.block_values} values; K={k} is not a multiple"
        if self.max_m is not None and m > self.max_m:
            return f"{self.name} runs M <= {self.max_m} only (M={m})"
        return None

    def device_reason(self, cuda_cc: int | None) -> str | None:
        """Why this kernel cannot run on this machine (a GPU of compute capability `cuda_cc`, or none), or None."""
        return None

    def can_run(self, type_name: str, m: int, n: int, k: int, cuda_cc: int | None) -> str | None:
        """Why it cannot take this product here, or None (vLLM's `can_implement`)."""
        return self.device_reason(cuda_cc) or self.shape_reason(type_name, m, n, k)

    def row(self) -> dict[str, Any]:
        """What `/v1/kernels` says of it, bar where it runs."""
        return {"name": self.name, "weight_types": list(self.weight_types),
                "activation_format": self.activation_format, "backend": self.backend,
                "description": self.description}
