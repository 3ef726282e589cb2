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

AUTO_DESCRIPTION = ("llama.cpp's own choice of formula for the batch's M (MMVQ for M <= 8, MMQ above, as on an "
                    "sm_90 GPU) and, among the kernels computing it, the fastest: on a GPU from the tuned table "
                    "(kernels/tuning), on the CPU the reference of that formula")


def register(kernel: Kernel) -> Kernel:
    """Add a kernel: the only step that makes it known everywhere."""
    if kernel.name in KERNELS or kernel.name == "auto":
        raise ValueError(f"kernel {kernel.name!r} is registered twice")
    KERNELS[kernel.name] = kernel
    return kernel


def known_names() -> list[str]:
    return ["auto", *KERNELS]


def llama_formula(m: int, type_name: str | None = None) -> str:
    """The formula llama.cpp's CUDA backend computes weights of this type with at batch size M on an sm_90
    GPU (the same on every NVIDIA GPU with int8 MMA, Turing on): for block formats MMVQ up to 8 rows, MMQ
    above; float matrices as the format table says (`float_formulas`)."""
    fmt = format_of(type_name) if type_name else None
    if fmt is not None and fmt.matmul and not fmt.quantizes_activations:  # floats; bitsandbytes' formats
        return fmt.float_formulas[0 if m == 1 else 1]
    return "q8_1_mmvq" if m <= MMVQ_MAX_BATCH else "q8_1_mmq"


def cpu_reference(formula: str) -> Kernel:
    """The CPU kernel that computes a formula (each has exactly one: the numpy twin the GPU is tested against)."""
    for kernel in KERNELS.values():
        if kernel.backend == "cpu" and kernel.activation_format == formula:
            return kernel
    raise KeyError(f"no CPU kernel computes {formula}")
