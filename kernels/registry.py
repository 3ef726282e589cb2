"""The one registry of matmul kernels: every kernel object, by name, in the order registered.

Kernels register themselves where they are defined: the CPU references (kernels/cpu.py), then the CUDA
kernels (kernels/cuda/kernels.py); kernels/__init__.py imports both, so the table is whole whatever is
imported first.  `/v1/kernels`, `/v1/matmul`, `auto`, the backends, the bench and the tests read it.
"""

from __future__ import annotations

from kernels.formats import BNB4_TYPES, FLOAT_TYPES, QUANT_TYPES, format_of
from kernels.kernel import Kernel

KERNELS: dict[str, Kernel] = {}

WEIGHTS = (*QUANT_TYPES, *FLOAT_TYPES, *BNB4_TYPES)  # every type `auto` multiplies
LADDER_WEIGHTS = ("Q4_0", "Q8_0")  # the teaching ladder's rungs (whole GGUF blocks in the kernel)
MMVQ_MAX_BATCH = 8  # llama.cpp's MMVQ_MAX_BATCH_SIZE: above it, MMQ (ggml_cuda_mul_mat, sm_90)
MMF_MAX_BATCH = 16  # float matrices: mul_mat_f takes up to 16 rows (ggml_cuda_should_use_mmf)
MMF_ROWS_PER_BLOCK = 32  # ... and N a multiple of its MMF_ROWS_PER_BLOCK (NVIDIA)

AUTO_DESCRIPTION = ("llama.cpp's own choice of formula for the batch's M (MMVQ for M <= 8, MMQ above, as on an "
                    "sm_90 GPU; float matrices by M and shape, as ggml dispatches them) and, among the kernels "
                    "computing it, the fastest: on a GPU from the tuned table (kernels/tuning), on the CPU the "
                    "reference of that formula")


def register(kernel: Kernel) -> Kernel:
    """Add a kernel: the only step that makes it known everywhere."""
    if kernel.name in KERNELS or kernel.name == "auto":
        raise ValueError(f"kernel {kernel.name!r} is registered twice")
    KERNELS[kernel.name] = kernel
    return kernel


def known_names() -> list[str]:
    return ["auto", *KERNELS]


def ggml_mmf(m: int, type_name: str, n: int, k: int) -> bool:
    """Whether llama.cpp's CUDA backend multiplies a float matrix with its tensor-core mul_mat_f (mmf.cu,
    ggml_cuda_should_use_mmf on an NVIDIA sm_80+ GPU): up to MMF_MAX_BATCH rows, N a multiple of its 32 rows
    a block and K of a warp's 32 loads of 4 bytes; other shapes above M = 1 go to cuBLAS."""
    fmt = format_of(type_name)
    assert fmt is not None and fmt.is_float, type_name
    return 1 < m <= MMF_MAX_BATCH and n % MMF_ROWS_PER_BLOCK == 0 and k % (32 * 4 // fmt.block_bytes) == 0


def llama_formula(m: int, type_name: str | None, n: int, k: int) -> str:
    """The formula llama.cpp's CUDA backend computes a [N, K] matrix of this type with at batch size M on an
    sm_90 GPU (the same on every NVIDIA GPU with int8 MMA, Turing on): for block formats MMVQ up to 8 rows,
    MMQ above; float matrices as the format table says (`float_formulas`: M = 1, mmf's shapes, cuBLAS's)."""
    fmt = format_of(type_name) if type_name else None
    if fmt is not None and fmt.matmul and not fmt.quantizes_activations:  # floats; bitsandbytes' formats
        if m == 1:
            return fmt.float_formulas[0]
        return fmt.float_formulas[1 if fmt.is_float and ggml_mmf(m, type_name, n, k) else 2]  # type: ignore[arg-type]
    return "q8_1_mmvq" if m <= MMVQ_MAX_BATCH else "q8_1_mmq"


def cpu_reference(formula: str) -> Kernel:
    """The CPU kernel that computes a formula (each has exactly one: the numpy twin the GPU is tested against)."""
    for kernel in KERNELS.values():
        if kernel.backend == "cpu" and kernel.activation_format == formula:
            return kernel
    raise KeyError(f"no CPU kernel computes {formula}")
