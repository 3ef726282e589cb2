"""How each CUDA kernel is launched: its source, grid, block and arguments; and the weight layouts
they read, made on the device from the GGUF bytes.

A launcher takes (modules, type suffix, weight layout arrays, activations, output, M, N, K) and
enqueues on the current stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import cupy
import numpy as np
from gguf import GGMLQuantizationType

from kernels.cuda import cublas, pdl
from kernels.formats import FORMATS, QK, format_of, mmq_ds_layout
from kernels.registry import KernelSpec

Q8_1_BYTES = FORMATS[GGMLQuantizationType.Q8_1].block_bytes
I32, I64 = np.int32, np.int64


@dataclass(frozen=True)
class Launch:
    source: str  # the .cu file the kernel needs compiled (for cuBLAS: the one holding its dequantizer)
    fn: Callable[..., None]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_q8_1(mods: Any, x: cupy.ndarray, out: cupy.ndarray) -> None:
    n = x.size  # 4 values a thread
    mods.function("q8_1.cu", "quantize_q8_1")((cdiv(n, 1024),), (256,), (x, out, I64(n)))


def _thread_per_output(src: str, base: str) -> Launch:
    def launch(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
        mods.function(src, f"{base}_{t}")((cdiv(n, 32), cdiv(m, 8)), (32, 8), (w["w"], a, y, I32(m), I32(n), I32(k)))
    return Launch(src, launch)


def _tiled(src: str, base: str, bm: int, bn: int) -> Launch:
    def launch(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
        mods.function(src, f"{base}_{t}")((cdiv(n, bn), cdiv(m, bm)), (256,), (w["w"], a, y, I32(m), I32(n), I32(k)))
    return Launch(src, launch)


def _vec_dp4a(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    mods.function("ladder.cu", f"vec_dp4a_{t}")((cdiv(n, 4), cdiv(m, 4)), (128,),
                                                (w["qs"], w["d"], a, y, I32(m), I32(n), I32(k)))


def quantize_q8_1_split(mods: Any, x: cupy.ndarray, qs: cupy.ndarray, ds: cupy.ndarray) -> None:
    n = x.size  # dependent launch: it may get resident while the GEMM ahead of it ends (pdl.py)
    pdl.launch(mods.function("q8_1.cu", "quantize_q8_1_split"), (cdiv(n, 1024),), (256,), (x, qs, ds, I64(n)),
               mods.dependent_launch)


def mmq_tiles(rows: int, k: int, tile: int) -> tuple[int, int]:
    """(row tiles, stages of MMQ_BKB quant blocks) of an mmq-layout operand."""
    return cdiv(rows, tile), cdiv(k // QK, MMQ_BKB)


MMQ_HALF_D = {"mmq_d4": 0, "mmq_ds4": 1}  # the MMQ activation layouts: whether d_a is rounded to half


def activation_layout(spec: KernelSpec, type_name: str) -> str:
    """The layout a kernel's activations are quantized into for weights of this type: its own, and for the
    MMQ kernels the format's scale layout as well ("mmq_d4": d_a in float; "mmq_ds4": d_a a half)."""
    if spec.activation_layout == "mmq":
        return "mmq_" + mmq_ds_layout(type_name).lower()
    return spec.activation_layout


def q8_1_buffers(layout: str, m: int, k: int) -> Any:
    """Device buffers for activations quantized into `layout` (uninitialised)."""
    if layout == "split":
        return {"qs": cupy.empty((m, k), dtype=cupy.int8), "ds": cupy.empty((m, k // QK, 2), dtype=cupy.float16)}
    if layout in MMQ_HALF_D:  # pieces of 64 rows x one stage (see quantize_q8_1_mmq)
        pieces = math.prod(mmq_tiles(m, k, MMQ_BM))
        return {"qs": cupy.empty(pieces * MMQ_BM * MMQ_BKB * QK, dtype=cupy.int8),
                "dc": cupy.empty(pieces * MMQ_BKB * MMQ_BM * 2, dtype=cupy.float32)}
    return cupy.empty(m * (k // QK) * Q8_1_BYTES, dtype=cupy.uint8)


# The mmq-layout quantizers (q8_1.cu): (rows, quant blocks) a warp takes
QUANTIZE_MMQ_WARP = {"quantize_q8_1_mmq": (4, 1), "quantize_q8_1_mmq2": (4, 2), "quantize_q8_1_mmq4": (4, 4),
                     "quantize_q8_1_mmq_pair": (8, 2)}


def quantize_mmq_warps(name: str, m: int, k: int) -> int:
    rows, blocks = QUANTIZE_MMQ_WARP[name]
    return cdiv(m, rows) * cdiv(k // QK, blocks)


def quantize_mmq_kernel(sm_count: int, m: int, k: int) -> str:
    """The mmq-layout quantizer for this size.  `quantize_q8_1_mmq_pair` (2 lanes a block, a quarter of the
    instructions) once it has ~16 warps an SM; below that the 8-lane kernels' 4x more threads hide latency
    better (H100, alone: M=128 K=4096 2.3 against 2.6 us; M=128 K=14336 4.3 against 3.8), taking 1 block a
    warp while that fits in about one wave (64 warps an SM), more when there are waves to spare, so that
    each thread has several loads in flight."""
    if quantize_mmq_warps("quantize_q8_1_mmq_pair", m, k) >= 16 * sm_count:
        return "quantize_q8_1_mmq_pair"
    warps, wave = quantize_mmq_warps("quantize_q8_1_mmq", m, k), 64 * sm_count
    return "quantize_q8_1_mmq" if warps <= wave else "quantize_q8_1_mmq2" if warps <= 4 * wave else "quantize_q8_1_mmq4"


def quantize_into(mods: Any, layout: str, x: cupy.ndarray, acts: Any) -> None:
    if layout == "split":
        quantize_q8_1_split(mods, x, acts["qs"], acts["ds"])
    elif layout in MMQ_HALF_D:
        m, k = x.shape
        sb = mmq_tiles(m, k, MMQ_BM)[1]
        name = quantize_mmq_kernel(mods.sm_count, m, k)
        mods.function("q8_1.cu", name)((cdiv(quantize_mmq_warps(name, m, k), 8),), (256,),
                                       (x, acts["qs"], acts["dc"], I32(m), I32(k), I32(sb), I32(MMQ_HALF_D[layout])))
    else:
        quantize_q8_1(mods, x, acts)


def q8_1_to_host(acts: Any, m: int, k: int, layout: str = "") -> Any:
    from kernels.reference import Q8_1

    if isinstance(acts, dict) and "dc" in acts:  # mmq: untile (d from the (d 2^111, -d 2^-19) pairs); no sums
        mt, sb = mmq_tiles(m, k, MMQ_BM)
        kb, kbp = k // QK, sb * MMQ_BKB
        qs = cupy.asnumpy(acts["qs"]).reshape(mt, sb, MMQ_BM // 8, 8, 8, 16).transpose(0, 2, 4, 1, 3, 5)
        dc = cupy.asnumpy(acts["dc"]).reshape(mt, sb, MMQ_BKB, MMQ_BM, 2).transpose(0, 3, 1, 2, 4)
        d = dc.reshape(-1, kbp, 2)[:m, :kb, 0] * np.float32(2.0 ** -111)  # exact
        return Q8_1(np.ascontiguousarray(qs.reshape(-1, kbp * QK)[:m, :k]),
                    d.astype(np.float16) if MMQ_HALF_D.get(layout) else np.ascontiguousarray(d),
                    np.zeros((m, kb), dtype=np.float16))
    if isinstance(acts, dict):
        ds = cupy.asnumpy(acts["ds"])
        return Q8_1(cupy.asnumpy(acts["qs"]), ds[..., 0].copy(), ds[..., 1].copy())
    return Q8_1.from_blocks(cupy.asnumpy(acts).reshape(m, -1))


MMQ_BM, MMQ_BN, MMQ_BKB, MMQ_STAGES, MMQ_THREADS = 64, 128, 4, 2, 128  # as fast.cu
MMQ_STAGE = (MMQ_BM + MMQ_BN) * MMQ_BKB * QK + MMQ_BKB * MMQ_BM * 8 + MMQ_BKB * MMQ_BN * 4
MMQ_SMEM = MMQ_STAGES * (MMQ_STAGE + 8)  # MmqSmem::BYTES: the stage buffers and their mbarriers
MMQ_WGMMA_SMEM = cdiv(MMQ_SMEM, 128) * 128 + 2048  # MmqWgSmem::BYTES: then the 2 KiB tile of -128s


MMQ_BLOCKS_PER_SM = 2  # __launch_bounds__(MMQ_THREADS, 2), and two blocks' shared memory fit an SM


def mmq_splits(sm_count: int, m: int, n: int, k: int) -> int:
    """Split K when the output tiles alone would leave SMs idle: as many splits as keep the grid within one
    wave (rounding up would start a second, mostly empty wave)."""
    tiles = cdiv(n, MMQ_BN) * cdiv(m, MMQ_BM)
    stages = cdiv(k // QK, MMQ_BKB)
    return max(1, min(stages, (MMQ_BLOCKS_PER_SM * sm_count) // tiles)) if tiles < sm_count else 1


def _mmq(mods: Any, t: str, w: dict, a: dict, y: cupy.ndarray, m: int, n: int, k: int, base: str = "mmq") -> None:
    """mmq (mma.sync, 4 warps) or mmq_wgmma (two warpgroups): the same tiles, layouts and grid."""
    splits = mmq_splits(mods.sm_count, m, n, k)
    stages = mmq_tiles(m, k, MMQ_BM)[1]
    per = cdiv(stages, splits)  # stages per split
    splits = cdiv(stages, per)
    if splits > 1:
        y.fill(0)
    grid = (cdiv(n, MMQ_BN), cdiv(m, MMQ_BM), splits)
    fn = mods.function("fast.cu", base)  # one kernel for every weight type (its layouts carry the format)
    threads, smem = (MMQ_THREADS, MMQ_SMEM) if base == "mmq" else (2 * MMQ_THREADS, MMQ_WGMMA_SMEM)
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem  # two stages: over the 48 KiB default
    fn(grid, (threads,), (w["wq"], w["wd"], a["qs"], a["dc"], y, I32(m), I32(n), I32(k), I32(per), I32(splits > 1)),
       shared_mem=smem)


def _gemv(mods: Any, t: str, w: dict, a: dict, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    if m == 1:  # a warp per weight row, dp4a; it may start during the quantize kernel (pdl.py)
        pdl.launch(mods.function("fast.cu", f"gemv1_{t}"), (cdiv(n, 8),), (256,),
                   (w["qs"], w["d"], a["qs"], a["ds"], y, I32(n), I32(k)), mods.dependent_launch)
    else:  # 16 weight rows x up to 8 activation rows per tensor-core MMA
        mods.function("fast.cu", f"skinny1_{t}")((cdiv(n, 16),), (256,), (w["qs"], w["d"], a["qs"], a["ds"], y,
                                                                          I32(m), I32(n), I32(k)))


def _cublas(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    cublas.gemm_xwt(a, w["w"], y)  # fp16 or fp32 weights, dequantized once at upload


LAUNCHERS: dict[str, Launch] = {
    "naive": _thread_per_output("ladder.cu", "naive"),
    "dp4a": _thread_per_output("ladder.cu", "dp4a"),
    "tiled": _tiled("ladder.cu", "tiled", 16, 16),
    "tiled_dp4a": _tiled("ladder.cu", "tiled_dp4a", 64, 64),
    "vec_dp4a": Launch("ladder.cu", _vec_dp4a),
    "w16_naive": _thread_per_output("w16.cu", "w16_naive"),
    "w16_tiled": _tiled("w16.cu", "w16_tiled", 64, 64),
    "cublas_f16": Launch("w16.cu", _cublas),
    "cublas_f32": Launch("w16.cu", _cublas),
    "mmq": Launch("fast.cu", _mmq),
    "mmq_wgmma": Launch("fast.cu", partial(_mmq, base="mmq_wgmma")),
    "gemv": Launch("fast.cu", _gemv),
}


def suffix(type_name: str) -> str:
    return type_name.lower()


# ---- weight layouts ----------------------------------------------------------------------------
def layout_nbytes(layout: str, type_name: str, n: int, k: int) -> int:
    fmt = format_of(type_name)
    assert fmt is not None
    kb = k // QK
    return {"gguf": n * kb * fmt.block_bytes,
            "split": n * kb * fmt.block_bytes,  # quants + 2-byte scales: the same bytes, regrouped
            "f16": n * k * 2, "f32": n * k * 4,
            "mmq": math.prod(mmq_tiles(n, k, MMQ_BN)) * MMQ_BN * MMQ_BKB * (QK + 4)}[layout]


def make_layout(mods: Any, layout: str, type_name: str, raw: np.ndarray, n: int, k: int) -> dict[str, cupy.ndarray]:
    """Upload a tensor's GGUF bytes and turn them into `layout` on the device."""
    fmt = format_of(type_name)
    assert fmt is not None
    kb = k // QK
    if layout == "split":  # regroup on the host (a strided view), upload quants and scales apart
        blocks = np.asarray(raw, dtype=np.uint8).reshape(n, kb, fmt.block_bytes)
        return {"qs": cupy.asarray(np.ascontiguousarray(blocks[..., 2:]).reshape(-1)),
                "d": cupy.asarray(np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(-1))}
    w = cupy.asarray(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1))
    if layout == "gguf":
        return {"w": w}
    if layout in ("f16", "f32"):
        out = cupy.empty((n, k), dtype=np.float16 if layout == "f16" else np.float32)
        fn = mods.function("w16.cu", f"dequantize_{layout}_{suffix(type_name)}")
        fn((cdiv(n * k, 256),), (256,), (w, out, I64(n * k)))
        del w
        return {"w": out}
    if layout == "mmq":  # tiled as fast.cu's mmq copies it, made on the host once
        from kernels.reference import unpack_blocks

        q, d, _ = unpack_blocks(type_name, raw)  # Q4_0/Q8_0 layouts: no minimum
        nt, sb = mmq_tiles(n, k, MMQ_BN)
        rows, kbp = nt * MMQ_BN, sb * MMQ_BKB
        qp = np.zeros((rows, kbp * QK), dtype=np.int8)  # padding rows and blocks are zeros
        qp[:n, :k] = q.astype(np.int16) - fmt.offset  # signed, as llama.cpp's MMQ tiles (Q4_0: q - 8)
        wd = np.zeros((rows, kbp), dtype=np.float32)  # d_w, what the epilogue multiplies by
        wd[:n, :kb] = d.astype(np.float32)
        wd_tiles = wd.reshape(nt, MMQ_BN, sb, MMQ_BKB).transpose(0, 2, 3, 1)  # [tile][stage][block][row]

        # quants in core-matrix order within a piece: [row/8][k/16][row%8][k%16]
        cores = qp.reshape(nt, MMQ_BN // 8, 8, sb, 8, 16).transpose(0, 3, 1, 4, 2, 5)
        return {"wq": cupy.asarray(np.ascontiguousarray(cores).reshape(-1)),
                "wd": cupy.asarray(np.ascontiguousarray(wd_tiles).reshape(-1))}
    raise ValueError(f"unknown weight layout {layout!r}")


def launch_gemm(mods: Any, spec: KernelSpec, type_name: str, w: dict, acts: cupy.ndarray, y: cupy.ndarray,
                m: int, n: int, k: int) -> None:
    LAUNCHERS[spec.name].fn(mods, suffix(type_name), w, acts, y, m, n, k)
