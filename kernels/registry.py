"""The one registry of matmul kernels.

Each spec declares what it can run (weight types, activation format, the device it needs, shape
constraints) and answers `can_run(...)` with a reason or None.  `/v1/kernels`, `/v1/matmul`,
`auto` and the bench all read this table; backends look kernels up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernels.formats import BNB4_TYPES, FLOAT_TYPES, MMQ_SIGNED_TYPES, QK, QUANT_TYPES, format_of

Backend = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    backend: Backend
    weight_types: tuple[str, ...]
    # the formula it computes: llama.cpp's MMVQ (`q8_1_mmvq`) or MMQ (`q8_1_mmq`) on Q8_1 activations
    # (reference.py says what each is), or a float product of dequantized weights (`f32`, `f16` activations)
    activation_format: Literal["q8_1_mmvq", "q8_1_mmq", "f32", "f16", "bf16", "f16_mmvf"]
    description: str
    min_cc: int = 0  # compute capability as major*10+minor; 0 for the CPU
    max_cc: int | None = None  # for architecture-specific instructions (sm_90a's wgmma exists on 9.0 only)
    k_multiple: int = QK
    max_m: int | None = None
    weight_layout: str = "gguf"  # the layout its weights are uploaded in (cached per layout)
    # Q8_1 as block_q8_1 records, "split" (int8 rows + half2 scales) or "mmq" (int8 rows + scales as mmq reads them)
    activation_layout: str = "blocks"

    @property
    def quantizes(self) -> bool:
        """Whether it quantizes the activations to Q8_1 (either of llama.cpp's formulas)."""
        return self.activation_format.startswith("q8_1")

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
        """Why this kernel cannot run on this machine, or None."""
        if self.backend == "cpu":
            return None
        if cuda_cc is None:
            return "needs a CUDA GPU through CuPy; this server runs on the CPU backend"
        if cuda_cc < self.min_cc:
            return f"needs compute capability {self.min_cc / 10:.1f}; the device has {cuda_cc / 10:.1f}"
        if self.max_cc is not None and cuda_cc > self.max_cc:
            return (f"uses instructions of compute capability {self.min_cc / 10:.1f} to {self.max_cc / 10:.1f} only; "
                    f"the device has {cuda_cc / 10:.1f}")
        return None

    def can_run(self, type_name: str, m: int, n: int, k: int, cuda_cc: int | None) -> str | None:
        return self.device_reason(cuda_cc) or self.shape_reason(type_name, m, n, k)


WEIGHTS = (*QUANT_TYPES, *FLOAT_TYPES, *BNB4_TYPES)  # every type `auto` multiplies
LADDER_WEIGHTS = ("Q4_0", "Q8_0")  # the teaching ladder's rungs (whole GGUF blocks in the kernel)
# mmq_wgmma takes any format whose MMQ form is signed int8 with one scale a block: only the upload differs
MMVQ_MAX_BATCH = 8  # llama.cpp's MMVQ_MAX_BATCH_SIZE: above it, MMQ (ggml_cuda_mul_mat, sm_90)


def llama_formula(m: int, type_name: str | None = None) -> str:
    """The formula llama.cpp's CUDA backend computes weights of this type with at batch size M on an sm_90
    GPU (the same on every NVIDIA GPU with int8 MMA, Turing on): for block formats MMVQ up to 8 rows, MMQ
    above; float matrices as the format table says (`float_formulas`)."""
    fmt = format_of(type_name) if type_name else None
    if fmt is not None and fmt.matmul and not fmt.quantizes_activations:  # floats; bitsandbytes' formats
        return fmt.float_formulas[0 if m == 1 else 1]
    return "q8_1_mmvq" if m <= MMVQ_MAX_BATCH else "q8_1_mmq"


# the CPU kernel of each formula
CPU_REFERENCE = {"q8_1_mmvq": "ref_q8_1", "q8_1_mmq": "ref_mmq", "f32": "ref_f32", "f16": "ref_f16",
                 "bf16": "ref_bf16", "f16_mmvf": "ref_f16_mmvf"}


AUTO_DESCRIPTION = ("llama.cpp's own choice of formula for the batch's M (MMVQ for M <= 8, MMQ above, as on an "
                    "sm_90 GPU) and, among the kernels computing it, the fastest: on a GPU from the tuned table "
                    "(kernels/tuning), on the CPU the reference of that formula")

KERNELS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec("ref_q8_1", "cpu", QUANT_TYPES, "q8_1_mmvq",
                   "numpy reference on the CPU of llama.cpp's MMVQ formula (its path for M <= 8): activations to "
                   "Q8_1 with half2 (d, s), integer block dots over the stored quants, d_w*(d_a*sumi - c*s_a) "
                   "(Q4_0 c=8, Q5_0 c=16), d_w*d_a*sumi (Q8_0), sumi*half(d_w*d_a) + half(m_w*s_a) (Q4_1, Q5_1)"),
        KernelSpec("ref_mmq", "cpu", QUANT_TYPES, "q8_1_mmq",
                   "numpy reference on the CPU of llama.cpp's MMQ formula (its tensor-core path for M > 8): "
                   "activations to Q8_1 as quantize_mmq_q8_1 does (d float for Q5_0/Q8_0, half for Q4_0/Q4_1/"
                   "Q5_1), weights as signed int8 (q-8, q-16) with sumi*d_w*d_a per block, or unsigned with "
                   "(d_w*d_a)*sumi + m_w*s_a (Q4_1, Q5_1)"),
        KernelSpec("ref_f32", "cpu", WEIGHTS, "f32",
                   "numpy on the CPU: weights dequantized with gguf.quants (float matrices as they are), fp32 "
                   "activations, fp32 GEMM"),
        KernelSpec("ref_f16_mmvf", "cpu", ("F16",), "f16_mmvf",
                   "numpy on the CPU of llama.cpp's product of an F16 matrix with one activation row "
                   "(mul_mat_vec_f): per thread half2 sums of fma(w, half(x)), then float butterflies; bit for bit "
                   "ggml's", max_m=1),
        KernelSpec("ref_f16", "cpu", ("F16",), "f16",
                   "numpy on the CPU of llama.cpp's product of F16 matrices at M > 1 (cuBLAS on half operands): "
                   "activations rounded to half (to nearest even), fp32 GEMM (ggml accumulates in half: "
                   "docs/formats.md)"),
        KernelSpec("ref_bf16", "cpu", ("BF16",), "bf16",
                   "numpy on the CPU of llama.cpp's product of BF16 matrices at M > 1: activations rounded to bf16 "
                   "(to nearest even), fp32 GEMM"),
    )
}


def _cuda(name: str, fmt: str, layout: str, description: str, min_cc: int = 52,
          types: tuple[str, ...] = LADDER_WEIGHTS, **kw: object) -> KernelSpec:
    return KernelSpec(name, "cuda", types, fmt, description, min_cc=min_cc,  # type: ignore[arg-type]
                      weight_layout=layout, **kw)  # type: ignore[arg-type]


for _spec in (
    _cuda("naive", "q8_1_mmvq", "gguf", "one thread per output on GGUF blocks, scalar int8 products, the per-block "
          "compensation epilogue"),
    _cuda("tiled", "q8_1_mmvq", "gguf", "16x16 output tiles; activation and weight blocks staged in shared memory "
          "(weights unpacked to int8), scalar products"),
    _cuda("dp4a", "q8_1_mmvq", "gguf", "one thread per output, __dp4a on packed int8 words", min_cc=61),
    _cuda("tiled_dp4a", "q8_1_mmvq", "gguf", "64x64 tiles in shared memory, 4x4 outputs per thread, __dp4a",
          min_cc=61),
    _cuda("vec_dp4a", "q8_1_mmvq", "split", "a warp per weight row, 16-byte loads of a split quants/scales layout, "
          "4 activation rows per weight load, __dp4a", min_cc=61),
    _cuda("w16_naive", "f32", "gguf", "W4A16/W8A16: one thread per output, weights dequantized in the kernel, "
          "fp32 activations and math"),
    _cuda("w16_tiled", "f32", "gguf", "W4A16/W8A16: 64x64 tiles, weights dequantized into shared memory, fp32"),
    _cuda("cublas_f16", "f16", "f16", "weights dequantized once to fp16 at upload (cached; F16 matrices as they "
          "are), activations cast to fp16, cuBLAS GemmEx with fp32 accumulation and output (llama.cpp's path for "
          "F16 matrices at M > 1, which accumulates in half)", types=(*QUANT_TYPES, "F16")),
    _cuda("cublas_f32", "f32", "f32", "weights dequantized once to fp32 at upload (cached; float matrices cast), "
          "cuBLAS SGEMM", types=WEIGHTS),
    _cuda("cublas_bf16", "bf16", "bf16", "BF16 matrices as stored, activations rounded to bf16 on the GPU, cuBLAS "
          "GemmEx with fp32 accumulation and output (llama.cpp's path for BF16 at M > 1)", types=("BF16",)),
    _cuda("mmvf_f16", "f16_mmvf", "f16", "an F16 matrix times one row as llama.cpp's mul_mat_vec_f computes it, bit "
          "for bit: a block of threads a row summing half2 FMAs of weights and half activations, float butterflies",
          max_m=1, types=("F16",)),
    _cuda("mmv_bf16", "f32", "bf16", "a BF16 matrix times one fp32 row (llama.cpp's formula at M = 1): a warp per "
          "row streaming 16-byte loads of bf16 weights, fp32 FMAs, a butterfly", max_m=1, types=("BF16",)),
    _cuda("mmq", "q8_1_mmq", "mmq", "llama.cpp's MMQ formula on int8 tensor cores (mma.sync m16n8k32, one quant block "
          "per MMA), weights repacked to signed int8 rows + block-major fp32 scales, Q8_1 activations quantized "
          "into the layout the kernel reads, sumi*d_a*d_w in two fp32 FMAs per block, 2-stage pipeline "
          "(Hopper bulk copies, cp.async otherwise), split-K when the grid would leave SMs idle; formats with a "
          "minimum (Q4_1, Q5_1) keep unsigned weights and add m_w*s_a per block in a third FMA",
          min_cc=80, activation_layout="mmq", types=QUANT_TYPES),
    _cuda("mmq_wgmma", "q8_1_mmq", "mmq", "mmq's formula, tiles, layouts and two-FMA epilogue through Hopper's "
          "asynchronous wgmma (two warpgroups, m64n64k32 per quant block with operands read from shared memory "
          "by descriptor; the bias made by a second wgmma on constant tiles; one block's epilogue overlapping "
          "the next block's MMAs)", min_cc=90, max_cc=90, activation_layout="mmq", types=MMQ_SIGNED_TYPES),
    _cuda("gemv", "q8_1_mmvq", "split", "M <= 8 on the split weight layout: M = 1 a warp per weight row streaming "
          "16-byte loads with several in flight (dp4a), started during the quantize kernel on sm_90+; 2..8 a "
          "skinny int8 MMA (16 weight rows x 8 activation rows) with K split across the block's warps",
          min_cc=80, max_m=8, activation_layout="split", types=QUANT_TYPES),
    _cuda("gemv_rows", "q8_1_mmvq", "split", "M <= 8 on the split weight layout: gemv's M = 1 stream (a warp per "
          "weight row, several 16-byte loads in flight, dp4a) with each weight block reused for every activation row",
          min_cc=80, max_m=8, activation_layout="split", types=QUANT_TYPES),
    _cuda("bnb4_gemv", "f32", "bnb4", "bitsandbytes' NF4/FP4 (weight_format nf4/fp4) for M <= 8. M = 1 (K a "
          "multiple of 32, up to 16384): a persistent block per SM streams groups of 4 weight rows with the next "
          "group's 16-byte code loads in flight, each thread's 32 activations in registers, a byte decoded by one "
          "PRMT and an 8-byte lookup in a per-lane pair table; else a warp per weight row decoding each 4-byte "
          "word once for every activation row. fp32 activations and sums, times the block's absmax",
          min_cc=70, max_m=8, types=BNB4_TYPES),
    _cuda("bnb4_dequant", "f32", "bnb4", "bitsandbytes' NF4/FP4 for any M as bitsandbytes runs it: the codes "
          "dequantized on the device per product (code * absmax, float32) and cuBLAS SGEMM; the weights stay 4-bit",
          min_cc=70, types=BNB4_TYPES),
):
    KERNELS[_spec.name] = _spec


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in KERNELS or spec.name == "auto":
        raise ValueError(f"kernel {spec.name!r} is registered twice")
    KERNELS[spec.name] = spec
    return spec


def known_names() -> list[str]:
    return ["auto", *KERNELS]
