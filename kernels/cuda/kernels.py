"""The CUDA kernels, one object each: what it runs, the .cu source it needs, the layouts it reads, and its launch
(grid, block, arguments) on the current stream.  Registering the object is all it takes to serve it.

Importable without CuPy: a machine without a GPU lists these kernels with the reason they cannot run there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np

from kernels.cuda import layouts as L
from kernels.cuda.launch import (
    FUSED_ROWS,
    I32,
    I64,
    MMQ16_SMEM,
    MMQ16_SMEM_MIN,
    MMQ_BM,
    MMQ_BN,
    MMQ_D2_SMEM,
    MMQ_SMEM,
    MMQ_SMEM_MIN,
    MMQ_THREADS,
    MMQ_WGMMA_SMEM,
    SKINNY_ROWS,
    SKINNY_THREADS,
    cdiv,
    groups_split,
    mmq_splits,
    mmq_tiles,
    skinny_chunks,
    skinny_stage,
    skinny_stages,
    skinny_weights,
    takes_skinny,
)
from kernels.cuda.layouts import ActivationLayout, DeviceArrays, WeightLayout, suffix
from kernels.formats import BNB4_TYPES, LEGACY_TYPES, MMQ_SIGNED_TYPES, QK, QUANT_TYPES, format_of
from kernels.groups import GROUPED, MMQ_D2_TYPES, mmq_scales_a_block
from kernels.kernel import Device, Kernel
from kernels.registry import LADDER_WEIGHTS, WEIGHTS, register

# the activations a float formula reads (f16_mmvf: fp32, which its kernel rounds itself)
FLOAT_ACTIVATIONS = {"f32": L.X_F32, "f16": L.X_F16, "f16_h": L.X_F16, "bf16": L.X_BF16, "f16_mmvf": L.X_F32}


@dataclass(frozen=True, kw_only=True, eq=False)
class CudaKernel(Kernel):
    backend: ClassVar[Device] = "cuda"
    source: str  # the .cu file it needs compiled (for cuBLAS: the one holding its activation cast)
    layout: WeightLayout
    acts: ActivationLayout | None = None  # None: block_q8_1 records (Q8_1 formulas) or the formula's float
    weight_types: tuple[str, ...] = LADDER_WEIGHTS
    min_cc: int = 52

    @property
    def weights(self) -> WeightLayout:
        return self.layout

    def activations_for(self, type_name: str) -> ActivationLayout:
        if self.acts is not None:
            return self.acts
        return L.Q8_1_BLOCKS if self.quantizes else FLOAT_ACTIVATIONS[self.activation_format]

    def device_reason(self, cuda_cc: int | None) -> str | None:
        if cuda_cc is None:
            return "needs a CUDA GPU through CuPy; this server runs on the CPU backend"
        if cuda_cc < self.min_cc:
            return f"needs compute capability {self.min_cc / 10:.1f}; the device has {cuda_cc / 10:.1f}"
        if self.max_cc is not None and cuda_cc > self.max_cc:
            return (f"uses instructions of compute capability {self.min_cc / 10:.1f} to {self.max_cc / 10:.1f} only; "
                    f"the device has {cuda_cc / 10:.1f}")
        return None

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        """Enqueue Y [M, N] = acts · Wᵀ on the current stream (`mods`: the device's compiled sources)."""
        raise NotImplementedError

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        """Every function of `source` that `launch` may call for weights of `type_name`: resolved at the backend's
        start (a name the source lacks fails the start, not a request under load) and checked against the
        compiled sources by a test."""
        return ()


# ---- the seeds' ladder, and W4A16 --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class ThreadPerOutput(CudaKernel):
    entry: str  # the kernel's name in its source, before the type suffix

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"{self.entry}_{suffix(type_name)}",)

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        mods.function(self.source, f"{self.entry}_{suffix(type_name)}")(
            (cdiv(n, 32), cdiv(m, 8)), (32, 8), (w["w"], acts, y, I32(m), I32(n), I32(k)))


@dataclass(frozen=True, kw_only=True, eq=False)
class Tiled(CudaKernel):
    entry: str
    tile_m: int
    tile_n: int

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"{self.entry}_{suffix(type_name)}",)

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        mods.function(self.source, f"{self.entry}_{suffix(type_name)}")(
            (cdiv(n, self.tile_n), cdiv(m, self.tile_m)), (256,), (w["w"], acts, y, I32(m), I32(n), I32(k)))


@dataclass(frozen=True, kw_only=True, eq=False)
class VecDp4a(CudaKernel):
    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"vec_dp4a_{suffix(type_name)}",)

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        mods.function(self.source, f"vec_dp4a_{suffix(type_name)}")(
            (cdiv(n, 4), cdiv(m, 4)), (128,), (w["qs"], w["d"], acts, y, I32(m), I32(n), I32(k)))


# ---- float kernels ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class Cublas(CudaKernel):
    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import cublas

        if self.activation_format == "f16_h":  # llama.cpp's call for F16 matrices: sums and outputs in half
            L.cast(mods, "widen_f16", cublas.gemm_xwt_half(acts, w["w"], y.shape), y)
        else:
            cublas.gemm_xwt(acts, w["w"], y)  # fp16, bf16 or fp32 weights, dequantized (or as stored) at upload


MMVF_WARP_THREADS = 128  # 4 rows a block: 50 us against 55 with 8 at N = 4096, K = 14336 (H100)
MMF_MAX_M = 16  # two n8 tiles of activation rows


@dataclass(frozen=True, kw_only=True, eq=False)
class MulMatF(CudaKernel):
    """A float matrix (`element`: f16 or bf16) times 2-16 rows on tensor cores (w16.cu mmf_skinny): ggml's
    mul_mat_f formula, 16-bit products summed in fp32, the weights streamed once."""

    element: str

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"mmf_{self.element}_m1", f"mmf_{self.element}_m2")

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        if k % 8 or m > MMF_MAX_M:  # shape_reason (k_multiple, max_m) keeps both from here
            raise ValueError(f"{self.name} needs K % 8 == 0 and M <= {MMF_MAX_M} (M = {m}, K = {k})")
        mods.function(self.source, f"mmf_{self.element}_m{1 if m <= 8 else 2}")(
            (cdiv(n, 16),), (256,), (w["w"], acts, y, I32(m), I32(n), I32(k)))


@dataclass(frozen=True, kw_only=True, eq=False)
class MulMatVecF(CudaKernel):
    """ggml's mul_mat_vec_f for a float matrix (`element`: f16 or bf16) and one row, a warp a row (w16.cu
    mmvf_warp), launched dependent (pdl.py)."""

    element: str

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        # h: blocks of 128 threads a row (reference.mmvf_block_size: at most 256 threads)
        return tuple(f"mmvf_warp_{self.element}_h{h}" for h in (1, 2))

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import pdl
        from kernels.reference import mmvf_block_size

        if k % 8 or acts.data.ptr % 16:  # K % 32 == 0 (k_multiple) and CuPy's buffers make neither happen
            raise ValueError(f"{self.name} needs K % 8 == 0 and 16-byte aligned activations (K = {k})")
        bs, rows = mmvf_block_size(k), MMVF_WARP_THREADS // 32
        pdl.launch(mods.function(self.source, f"mmvf_warp_{self.element}_h{cdiv(bs, 128)}"), (cdiv(n, rows),),
                   (MMVF_WARP_THREADS,), (w["w"], acts, y, I32(n), I32(k), I32(bs)), mods.dependent_launch)


# ---- llama.cpp's formulas at speed --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class Mmq(CudaKernel):
    """mmq (mma.sync, 4 warps) or mmq_wgmma (two warpgroups): the same tiles, layouts and grid; one kernel for
    every signed weight type (its layouts hold the format), `_min` for formats with a minimum, `mmq16` for a
    scale per 16 values; mmq_d2 (entry and layout of its own) for Q6_K's folded values in two int8 digits; up to
    32 rows (one row of 64-row tiles, half empty) mma.sync's `_m32` variants, whose four warps share rows 0-31
    instead of leaving two on padding."""

    entry: str = "mmq"
    SHAPES: ClassVar[dict[str, tuple[int, int]]] = {  # (threads, dynamic shared memory)
        "mmq": (MMQ_THREADS, MMQ_SMEM), "mmq_min": (MMQ_THREADS, MMQ_SMEM_MIN), "mmq16": (MMQ_THREADS, MMQ16_SMEM),
        "mmq16_min": (MMQ_THREADS, MMQ16_SMEM_MIN), "mmq_d2": (MMQ_THREADS, MMQ_D2_SMEM),
        "mmq_wgmma": (2 * MMQ_THREADS, MMQ_WGMMA_SMEM)}

    def activations_for(self, type_name: str) -> ActivationLayout:
        return L.mmq_activations(type_name)

    def _base(self, type_name: str, minimum: bool) -> str:
        """The variant for these weights (`minimum`: their layout holds minima, "wm"), before its _m32 form."""
        base, fmt = self.entry, format_of(type_name)
        if base == "mmq" and fmt is not None and fmt.grouped and mmq_scales_a_block(type_name) == 2:
            base = "mmq16"
        if minimum:
            assert base != "mmq_wgmma", "mmq_wgmma takes the signed formats only"
            base += "_min"
        return base

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        minima = (False, True) if self.entry == "mmq" else (False,)  # whether a layout holds minima: its own say
        bases = [self._base(type_name, minimum) for minimum in minima]
        return tuple(bases) if self.entry == "mmq_wgmma" else tuple(n for b in bases for n in (b, f"{b}_m32"))

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        splits = mmq_splits(mods.sm_count, m, n, k)
        stages = mmq_tiles(m, k, MMQ_BM)[1]
        per = cdiv(stages, splits)  # stages per split
        splits = cdiv(stages, per)
        if splits > 1:
            y.fill(0)
        grid = (cdiv(n, MMQ_BN), cdiv(m, MMQ_BM), splits)
        minimum = "wm" in w
        base = self._base(type_name, minimum)
        threads, smem = self.SHAPES[base]
        if base != "mmq_wgmma" and m <= MMQ_BM // 2:  # one row of tiles, half empty: mmq.cuh's HALF variant
            base += "_m32"
        fn = mods.function(self.source, base)
        if fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem  # two stages: over the 48 KiB default
        extra = (acts["sa"], w["wm"]) if minimum else ()
        fn(grid, (threads,), (w["wq"], w["wd"], acts["qs"], acts["dc"], *extra, y, I32(m), I32(n), I32(k), I32(per),
                              I32(splits > 1)), shared_mem=smem)


@dataclass(frozen=True, kw_only=True, eq=False)
class Gemv(CudaKernel):
    """M <= 8 on the split layout: M = 1 a warp per weight row (dp4a), launched dependent on its quantize kernel
    (pdl.py); 2..8 the skinny int8 MMA (gemv.cu's skinny: K staged through shared memory, split over blocks when
    the 16-row blocks leave SMs idle), or (`rows_reuse`) the M = 1 stream with each weight block reused for
    every activation row.  Grouped formats: gemv_groups (gemv.cu), one kernel a row count, except where the skinny
    MMA takes them (groups.py `skinny_min_m` rows on: the code books and the K-quants bar Q2_K)."""

    rows_reuse: bool = False

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        t, fmt = suffix(type_name), GROUPED.get(type_name)
        if fmt is not None:  # M = 1 on the format's split; 2..8 row by row, or the skinny MMA from skinny_min_m
            skinny = (f"skinny1_{t}",) if fmt.skinny and not self.rows_reuse else ()
            return (f"gemv1_{t}_s{groups_split(type_name)}", f"gemv_rows_{t}", *skinny)
        return (f"gemv_rows_{t}",) if self.rows_reuse else (f"gemv1_{t}", f"skinny1_{t}")

    def activations_for(self, type_name: str) -> ActivationLayout:
        """Split Q8_1, in chunks where the skinny kernel takes the product (the legacy formats from 2 rows, the grouped
        formats from their `skinny_min_m`; layouts.Q8_1Split)."""
        if self.rows_reuse or (type_name in GROUPED and not GROUPED[type_name].skinny):
            return L.Q8_1_SPLIT
        return L.Q8_1_SPLIT_CHUNKS_GROUPED[type_name] if type_name in GROUPED else L.Q8_1_SPLIT_CHUNKS

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import pdl

        t, grouped = suffix(type_name), "p0" in w
        if grouped:  # a grouped format's field planes; unused planes: any pointer, never read
            planes = tuple(w.get(f"p{i}", w["p0"]) for i in range(5))
        else:  # a legacy format's chunked rows (layouts.CHUNKED)
            planes = (w["w"],)
        rows = (acts["qs"], acts["ds"], y, I32(m), I32(n), I32(k))
        if m == 1 and (grouped or not self.rows_reuse):  # it may start during the quantize kernel (pdl.py)
            split = groups_split(type_name) if grouped else 1
            name = f"gemv1_{t}_s{split}" if grouped else f"gemv1_{t}"
            pdl.launch(mods.function(self.source, name), (cdiv(n, 8 // split),), (256,),
                       (*planes, acts["qs"], acts["ds"], y, I32(n), I32(k)), mods.dependent_launch)
        elif self.rows_reuse or (grouped and not takes_skinny(type_name, m)):
            # each decoded block serves every row
            # (their activations are by row: activations_for chunks only the skinny kernel's products)
            mods.function(self.source, f"gemv_rows_{t}")((cdiv(n, 8),), (256,), (*planes, *rows))
        else:  # 16 weight rows x up to 8 activation rows per tensor-core MMA, staged through shared memory
            if grouped and GROUPED[type_name].skinny_runs:  # a K-quant's value runs (groups.py `skinny_runs`)
                fmt = GROUPED[type_name]
                weights = skinny_weights(run_bytes=fmt.skinny_run_bytes(), field_bytes=fmt.skinny_scale_bytes())
            elif grouped:  # a code-book format's quants and scales: planes p0 and p1 (groups.py `skinny`)
                weights = skinny_weights(scale_bytes=planes[1].nbytes // (n * (k // QK)))
            else:
                weights = skinny_weights(block_bytes=format_of(type_name).block_bytes)
            stage = skinny_stage(weights, m)
            stages = skinny_stages(stage)
            per, splits = skinny_chunks(mods.sm_count, n, k)
            if splits > 1:
                y.fill(0)
            fn = mods.function(self.source, f"skinny1_{t}")
            if fn.max_dynamic_shared_size_bytes < stages * stage:
                fn.max_dynamic_shared_size_bytes = stages * stage  # over the 48 KiB default
            fn((cdiv(n, SKINNY_ROWS), splits), (SKINNY_THREADS,), (*planes, *rows, I32(per), I32(stages)),
               shared_mem=stages * stage)


FUSED_MAX_K = 160 * 1024 * 8 // 9 // QK * QK  # K * 9 / 8 bytes of shared memory within sm_80's 163 KiB a block
# auto's bound on gemv_fused's weights: its blocks of 16 warps hold half the warps an SM of gemv holds, so bandwidth-
# bound products stream slower (one H200: faster up to 17.8 MB, Q8_0 [4096, 4096]; slower from 30 MB, SmolLM2's
# Q8_0 LM head [49152, 576] 22.2 against 16.2 us, and every K = 14336 product)
FUSED_AUTO_MAX_BYTES = 24 << 20


@dataclass(frozen=True, kw_only=True, eq=False)
class GemvFused(CudaKernel):
    """M = 1 in one launch (gemv.cu gemv1_fused): each block quantizes X into Q8_1 in its shared memory, then streams
    FUSED_ROWS weight rows as gemv's M = 1 kernel does, so that its products are gemv's bit for bit."""

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"gemv1_fused_{suffix(type_name)}",)

    def shape_reason(self, type_name: str, m: int, n: int, k: int) -> str | None:
        if k > FUSED_MAX_K:
            return f"{self.name} holds X's Q8_1 in shared memory: K <= {FUSED_MAX_K} (K={k})"
        return super().shape_reason(type_name, m, n, k)

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import pdl

        fn = mods.function(self.source, f"gemv1_fused_{suffix(type_name)}")
        smem = k + k // QK * 4  # the split Q8_1 of X: K int8, K / 32 half2
        if smem > 48 << 10 and fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem  # over the 48 KiB default
        pdl.launch(fn, (cdiv(n, FUSED_ROWS),), (FUSED_ROWS * 32,), (w["w"], acts, y, I32(n), I32(k)),
                   mods.dependent_launch, shared_mem=smem)


@dataclass(frozen=True, kw_only=True, eq=False)
class GemvKRows(CudaKernel):
    """M = 1 for Q4_K, Q5_K, Q6_K and IQ4_XS on their own chunked rows (layouts.K_ROWS): gemv.cu's gemv1_q<n>_kr and
    gemv1_iq4_xsr, gemv1's legacy stream over them, launched dependent on its quantize kernel (pdl.py)."""

    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return (f"gemv1_{suffix(type_name)}r",)

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import pdl

        pdl.launch(mods.function(self.source, f"gemv1_{suffix(type_name)}r"), (cdiv(n, 8),), (256,),
                   (w["w"], acts["qs"], acts["ds"], y, I32(n), I32(k)), mods.dependent_launch)


# ---- bitsandbytes' NF4 / FP4 (bnb4.cu) --------------------------------------------------------------
BNB4_STREAM_ROWS = 4  # bnb4.cu's BNB4_STREAM_ROWS: weight rows a block takes at a time
BNB4_STREAM_SMEM = 256 * 32 * 8  # its per-lane pair tables


def _bnb4_args(type_name: str, w: DeviceArrays, n: int, k: int) -> tuple[str, tuple]:
    """(the kernels' suffix, their weight arguments) for a bnb4 layout: its blocksize from the count of
    scales (blocks over the flat N*K values), double quantization when the 8-bit scales are there."""
    from kernels.bnb4 import BLOCKSIZES

    dq = "qabs" in w
    blocks = int((w["qabs"] if dq else w["absmax"]).size)
    bs = next((b for b in BLOCKSIZES if cdiv(n * k, b) == blocks), BLOCKSIZES[-1])
    z = w["qs"]  # arguments a variant never reads: any pointer
    args = (w["qs"], w.get("absmax", z), w.get("qabs", z), w.get("absmax2", z), w.get("code8", z),
            np.float32(w["offset_h"]) if dq else np.float32(0), I32(bs.bit_length() - 1))
    return _bnb4_suffixes(type_name)[dq], args


@cache
def _stream_grid_cap(fn: Any, threads: int, sm_count: int) -> int:
    """Blocks of the persistent stream kernel the device holds at once (its resident-block limit times SMs)."""
    import cupy

    fn.max_dynamic_shared_size_bytes = BNB4_STREAM_SMEM
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, BNB4_STREAM_SMEM)
    return max(1, per_sm) * sm_count


def dequantize_bnb4(mods: Any, type_name: str, w: DeviceArrays, n: int, k: int, out: Any = None) -> Any:
    """The float32 [N, K] matrix bitsandbytes' dequantize_4bit gives, on the device."""
    import cupy

    sfx, args = _bnb4_args(type_name, w, n, k)
    out = cupy.empty((n, k), dtype=cupy.float32) if out is None else out
    words = n * k // 8
    mods.function("bnb4.cu", f"dequantize_bnb4_{sfx}")((cdiv(words, 256),), (256,), (*args, out, I64(words)))
    return out


def _bnb4_suffixes(type_name: str) -> tuple[str, str]:
    """A bnb4 type's kernel suffixes: without and with double quantization (`_bnb4_args` says which)."""
    return type_name.lower(), f"{type_name.lower()}_dq"


@dataclass(frozen=True, kw_only=True, eq=False)
class Bnb4Gemv(CudaKernel):
    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return tuple(name for sfx in _bnb4_suffixes(type_name)
                     for name in (f"gemv_bnb4_stream_{sfx}", *(f"gemv_bnb4_{sfx}_{mr}" for mr in (1, 2, 4, 8))))

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        sfx, args = _bnb4_args(type_name, w, n, k)
        if m == 1 and k % 32 == 0 and k // 32 <= 512:  # the stream kernel: a thread per 32-value column of K
            fn = mods.function(self.source, f"gemv_bnb4_stream_{sfx}")
            threads = 32 * cdiv(k // 32, 32)
            grid = min(cdiv(n, BNB4_STREAM_ROWS), _stream_grid_cap(fn, threads, mods.sm_count))
            fn((grid,), (threads,), (*args, acts, y, I32(m), I32(n), I32(k)), shared_mem=BNB4_STREAM_SMEM)
            return
        mr = next(r for r in (1, 2, 4, 8) if m <= r)
        mods.function(self.source, f"gemv_bnb4_{sfx}_{mr}")((cdiv(n, 8),), (256,),
                                                            (*args, acts, y, I32(m), I32(n), I32(k)))


@dataclass(frozen=True, kw_only=True, eq=False)
class Bnb4Dequant(CudaKernel):
    def entry_points(self, type_name: str) -> tuple[str, ...]:
        return tuple(f"dequantize_bnb4_{sfx}" for sfx in _bnb4_suffixes(type_name))

    def launch(self, mods: Any, type_name: str, w: DeviceArrays, acts: Any, y: Any, m: int, n: int, k: int) -> None:
        from kernels.cuda import cublas

        cublas.gemm_xwt(acts, dequantize_bnb4(mods, type_name, w, n, k), y)  # a float copy per product


# ---- the registered kernels, in the order /v1/kernels lists them ------------------------------------
register(ThreadPerOutput(
    name="naive", activation_format="q8_1_mmvq", source="ladder.cu", entry="naive", layout=L.GGUF,
    description="one thread per output on GGUF blocks, scalar int8 products, the per-block compensation epilogue"))
register(Tiled(
    name="tiled", activation_format="q8_1_mmvq", source="ladder.cu", entry="tiled", tile_m=16, tile_n=16,
    layout=L.GGUF, description="16x16 output tiles; activation and weight blocks staged in shared memory (weights "
                               "unpacked to int8), scalar products"))
register(ThreadPerOutput(
    name="dp4a", activation_format="q8_1_mmvq", source="ladder.cu", entry="dp4a", layout=L.GGUF, min_cc=61,
    description="one thread per output, __dp4a on packed int8 words"))
register(Tiled(
    name="tiled_dp4a", activation_format="q8_1_mmvq", source="ladder.cu", entry="tiled_dp4a", tile_m=64, tile_n=64,
    layout=L.GGUF, min_cc=61, auto_rank=3,
    description="64x64 tiles in shared memory, 4x4 outputs per thread, __dp4a"))
register(VecDp4a(
    name="vec_dp4a", activation_format="q8_1_mmvq", source="ladder.cu", layout=L.SPLIT, min_cc=61, auto_rank=2,
    description="a warp per weight row, 16-byte loads of a split quants/scales layout, 4 activation rows per weight "
                "load, __dp4a"))
register(ThreadPerOutput(
    name="w16_naive", activation_format="f32", source="w16.cu", entry="w16_naive", layout=L.GGUF,
    description="W4A16/W8A16: one thread per output, weights dequantized in the kernel, fp32 activations and math"))
register(Tiled(
    name="w16_tiled", activation_format="f32", source="w16.cu", entry="w16_tiled", tile_m=64, tile_n=64,
    layout=L.GGUF, description="W4A16/W8A16: 64x64 tiles, weights dequantized into shared memory, fp32"))
register(Cublas(
    name="cublas_f16", activation_format="f16", source="w16.cu", layout=L.F16, weight_types=(*QUANT_TYPES, "F16"),
    description="weights dequantized once to fp16 at upload (cached; F16 matrices as they are), activations cast to "
                "fp16, cuBLAS GemmEx with fp32 accumulation and output (llama.cpp's formula for F16 matrices where "
                "its tensor-core mul_mat_f takes them)"))
register(Cublas(
    name="cublas_f16_h", activation_format="f16_h", source="w16.cu", layout=L.F16, weight_types=("F16",),
    description="an F16 matrix as llama.cpp multiplies it through cuBLAS (M > 1 where its mul_mat_f does not take "
                "the shape): activations cast to fp16, cuBLAS GemmEx with CUBLAS_COMPUTE_16F (half sums and "
                "outputs, ggml's call), the outputs widened to fp32"))
register(Cublas(
    name="cublas_f32", activation_format="f32", source="w16.cu", layout=L.F32, weight_types=WEIGHTS,
    description="weights dequantized once to fp32 at upload (cached; float matrices cast), cuBLAS SGEMM"))
register(Cublas(
    name="cublas_bf16", activation_format="bf16", source="w16.cu", layout=L.BF16, weight_types=("BF16",),
    description="BF16 matrices as stored, activations rounded to bf16 on the GPU, cuBLAS GemmEx with fp32 "
                "accumulation and output (llama.cpp's path for BF16 at M > 1)"))
register(MulMatVecF(  # ranked: auto takes them over the cuBLAS kernels of their formula (the tuned table has no floats)
    name="mmvf_f16", element="f16", activation_format="f16_mmvf", source="w16.cu", layout=L.F16, max_m=1,
    weight_types=("F16",), auto_rank=0,
    description="an F16 matrix times one row as llama.cpp's mul_mat_vec_f computes it, bit for bit: half2 FMAs of "
                "weights and half activations per thread of its block, float butterflies; a warp a row"))
register(MulMatVecF(
    name="mmv_bf16", element="bf16", activation_format="f32", source="w16.cu", layout=L.BF16, max_m=1,
    weight_types=("BF16",), auto_rank=0,
    description="a BF16 matrix times one fp32 row as llama.cpp's mul_mat_vec_f sums it, bit for bit "
                "(reference.ref_bf16_mmvf): fp32 FMAs per thread of its block, float butterflies; a warp a row"))
register(MulMatF(  # not ranked: measured (docs/performance.md; seventh session)
    name="mmf_f16", element="f16", activation_format="f16", source="w16.cu", layout=L.F16, min_cc=80,
    max_m=MMF_MAX_M, k_multiple=8, weight_types=("F16",),
    description="an F16 matrix times 2-16 rows on tensor cores (mma.sync m16n8k16, fp32 accumulators): llama.cpp's "
                "mul_mat_f formula, taken where its mul_mat_f takes the shape; each lane's 16-byte loads of two weight "
                "rows and one activation row are the operands of two MMAs, the weights streamed once"))
register(MulMatF(
    name="mmf_bf16", element="bf16", activation_format="bf16", source="w16.cu", layout=L.BF16, min_cc=80,
    max_m=MMF_MAX_M, k_multiple=8, weight_types=("BF16",),
    description="a BF16 matrix times 2-16 rows on tensor cores (mma.sync m16n8k16, fp32 accumulators): the formula "
                "of llama.cpp's BF16 products above one row (activations rounded to bf16, products summed in fp32); "
                "each lane's 16-byte loads of two weight rows and one activation row are the operands of two MMAs"))
register(Mmq(
    name="mmq", activation_format="q8_1_mmq", source="mmq.cu", layout=L.MMQ, min_cc=80, weight_types=QUANT_TYPES,
    auto_rank=5,
    description="llama.cpp's MMQ formula on int8 tensor cores (mma.sync m16n8k32, one quant block per MMA), weights "
                "repacked to signed int8 rows + block-major fp32 scales, Q8_1 activations quantized into the layout "
                "the kernel reads, sumi*d_a*d_w in two fp32 FMAs per block, 2-stage pipeline (Hopper bulk copies, "
                "cp.async otherwise), split-K when the grid would leave SMs idle; formats with a minimum (Q4_1, "
                "Q5_1, Q2_K, Q4_K, Q5_K) keep unsigned weights and add m_w*s_a (both halves, as in llama.cpp) as an "
                "fp16 MMA a stage; a scale per 16 values (Q2_K, Q6_K) as two k16 MMAs a block, Q3_K's folded into "
                "its int8 values"))
register(Mmq(
    name="mmq_d2", activation_format="q8_1_mmq", source="mmq.cu", entry="mmq_d2", layout=L.MMQ_D2, min_cc=80,
    weight_types=MMQ_D2_TYPES, auto_rank=6,
    description="mmq for Q6_K with its integer scales folded into the values (q * sc, 13 bits) held as two int8 "
                "digits: two k32 MMAs a block (one a digit) and three fp32 FMAs an output where mmq's two k16 MMAs "
                "(a scale per 16 values) take four; twice mmq's weight bytes (faster from 128 rows on the H100, "
                "slower below)"))
register(Mmq(
    name="mmq_wgmma", activation_format="q8_1_mmq", source="mmq_wgmma.cu", entry="mmq_wgmma", layout=L.MMQ, min_cc=90,
    max_cc=90, weight_types=MMQ_SIGNED_TYPES, auto_rank=6,
    description="mmq's formula, tiles, layouts and two-FMA epilogue through Hopper's asynchronous wgmma (two "
                "warpgroups, m64n64k32 per quant block with operands read from shared memory by descriptor; the bias "
                "made by a second wgmma on constant tiles; one block's epilogue overlapping the next block's MMAs)"))
register(Gemv(
    name="gemv", activation_format="q8_1_mmvq", source="gemv.cu", layout=L.CHUNKED, acts=L.Q8_1_SPLIT, min_cc=80,
    max_m=8, weight_types=QUANT_TYPES, auto_rank=0,
    description="M <= 8 on the split weight layout: M = 1 a warp per weight row streaming 16-byte loads with several "
                "in flight (dp4a; Q2_K and Q5_K split a row's K over 2 and 4 warps), started during the quantize "
                "kernel on sm_90+; 2..8 a skinny int8 MMA (16 weight "
                "rows x 8 activation rows), K staged through shared memory 64 quant blocks at a time (bulk copies on "
                "sm_90+, cp.async otherwise) and split across the block's warps, and across blocks when the rows "
                "leave SMs idle: the legacy formats, IQ4_NL, IQ4_XS and MXFP4 from 5 rows (codes looked up 8 at a "
                "time), Q3_K to Q6_K from 4 to 6 rows (two k16 MMAs a block for a scale per 16, an all-ones MMA for "
                "the activations' sums where there is a minimum; their scale fields staged by the producer warp a "
                "stage ahead); Q2_K (and the others below those rows) a warp per weight row, each decoded sub-block "
                "reused for every activation row"))
register(Gemv(
    name="gemv_rows", activation_format="q8_1_mmvq", source="gemv.cu", layout=L.CHUNKED, acts=L.Q8_1_SPLIT,
    min_cc=80, max_m=8, weight_types=QUANT_TYPES, rows_reuse=True, auto_rank=1,
    description="M <= 8 on the split weight layout: gemv's M = 1 stream (a warp per weight row, several 16-byte "
                "loads in flight, dp4a) with each weight block reused for every activation row"))
register(GemvFused(
    name="gemv_fused", activation_format="q8_1_mmvq", source="gemv.cu", layout=L.CHUNKED, acts=L.Q8_1_IN_KERNEL,
    min_cc=80, max_m=1, weight_types=LEGACY_TYPES, auto_max_weight_bytes=FUSED_AUTO_MAX_BYTES,
    description="M = 1 in one launch for the legacy formats: each block of 16 warps quantizes X to Q8_1 in its "
                "shared memory (the quantize kernel's values and sums), then streams 16 weight rows a warp each as "
                "gemv's M = 1 kernel does (its products bit for bit), its first weights in flight meanwhile"))
register(GemvKRows(
    name="gemv_k", activation_format="q8_1_mmvq", source="gemv.cu", layout=L.K_ROWS, acts=L.Q8_1_SPLIT, min_cc=80,
    max_m=1, weight_types=L.KQuantRows.TYPES, auto_rank=0,
    description="M = 1 for Q4_K, Q5_K, Q6_K and IQ4_XS on their own layout, made at upload: each 32-value sub-block "
                "as a legacy block (16 nibble bytes, Q5_K's fifth bits as Q5_0's, Q6_K's two high bits in 8 bytes, its "
                "scales unpacked to two bytes; IQ4_XS's codes in its lookup's order, its scale an int8; the "
                "super-block's d (and dmin) once a super-block), streamed as gemv streams the legacy formats: 3-4 "
                "loads a sub-block where gemv's decode of the GGUF fields makes 7-9; gemv's products bit for bit"))
register(Bnb4Gemv(
    name="bnb4_gemv", activation_format="f32", source="bnb4.cu", layout=L.BNB4, min_cc=70, max_m=8,
    weight_types=BNB4_TYPES, auto_rank=4,
    description="bitsandbytes' NF4/FP4 (weight_format nf4/fp4) for M <= 8. M = 1 (K a multiple of 32, up to 16384): "
                "a persistent block per SM streams groups of 4 weight rows with the next group's 16-byte code loads "
                "in flight, each thread's 32 activations in registers, a byte decoded by one PRMT and an 8-byte "
                "lookup in a per-lane pair table; else a warp per weight row decoding each 4-byte word once for "
                "every activation row. fp32 activations and sums, times the block's absmax"))
register(Bnb4Dequant(
    name="bnb4_dequant", activation_format="f32", source="bnb4.cu", layout=L.BNB4, min_cc=70,
    weight_types=BNB4_TYPES, auto_rank=7,
    description="bitsandbytes' NF4/FP4 for any M as bitsandbytes runs it: the codes dequantized on the device per "
                "product (code * absmax, float32) and cuBLAS SGEMM; the weights stay 4-bit"))
