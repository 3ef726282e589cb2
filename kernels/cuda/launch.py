"""How each CUDA kernel is launched: its source, grid, block and arguments; and the weight layouts
they read, made on the device from the GGUF bytes.

A launcher takes (modules, type suffix, weight layout arrays, activations, output, M, N, K) and
enqueues on the current stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import cupy
import numpy as np
from gguf import GGMLQuantizationType

from kernels.cuda import cublas, pdl
from kernels.formats import FORMATS, QK, format_of, mmq_ds_layout
from kernels.registry import LADDER_WEIGHTS, KernelSpec

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


# the MMQ activation layouts: whether d_a is rounded to half; "mmq_ds4s" also holds the block sums s_a
MMQ_HALF_D = {"mmq_d4": 0, "mmq_ds4": 1, "mmq_ds4s": 1, "mmq_d2s6": 1}


def activation_layout(spec: KernelSpec, type_name: str) -> str:
    """The layout a kernel's activations are quantized into for weights of this type: its own, and for the
    MMQ kernels the format's scale layout as well ("mmq_d4": d_a in float; "mmq_ds4": d_a a half; with a
    minimum, "mmq_ds4s": and the sums its m_w s_a term reads; Q2_K: "mmq_d2s6")."""
    if spec.activation_layout == "mmq":
        fmt = format_of(type_name)
        sums = fmt is not None and (fmt.has_min or fmt.group_min) and mmq_ds_layout(type_name) == "DS4"
        return "mmq_" + mmq_ds_layout(type_name).lower() + ("s" if sums else "")
    return spec.activation_layout


def q8_1_buffers(layout: str, m: int, k: int) -> Any:
    """Device buffers for activations quantized into `layout` (uninitialised)."""
    if layout == "split":
        return {"qs": cupy.empty((m, k), dtype=cupy.int8), "ds": cupy.empty((m, k // QK, 2), dtype=cupy.float16)}
    if layout in MMQ_HALF_D:  # pieces of 64 rows x one stage (see quantize_q8_1_mmq)
        pieces = math.prod(mmq_tiles(m, k, MMQ_BM))
        bufs = {"qs": cupy.empty(pieces * MMQ_BM * MMQ_BKB * QK, dtype=cupy.int8),
                "dc": cupy.empty(pieces * MMQ_BKB * MMQ_BM * 2, dtype=cupy.float32)}
        if layout.endswith("s"):
            bufs["sa"] = cupy.empty(pieces * MMQ_BKB * MMQ_BM, dtype=cupy.float32)
        elif layout == "mmq_d2s6":  # two sums a block
            bufs["sa"] = cupy.empty(2 * pieces * MMQ_BKB * MMQ_BM, dtype=cupy.float32)
        return bufs
    return cupy.empty(m * (k // QK) * Q8_1_BYTES, dtype=cupy.uint8)


# The mmq-layout quantizers (q8_1.cu): (rows, quant blocks) a warp takes
QUANTIZE_MMQ_WARP = {"quantize_q8_1_mmq": (4, 1), "quantize_q8_1_mmq2": (4, 2), "quantize_q8_1_mmq4": (4, 4),
                     "quantize_q8_1_mmq_pair": (8, 2)}


def quantize_mmq_warps(name: str, m: int, k: int) -> int:
    rows, blocks = QUANTIZE_MMQ_WARP[name]
    return cdiv(m, rows) * cdiv(k // QK, blocks)


def quantize_mmq_kernel(sm_count: int, m: int, k: int, sums: bool = False) -> str:
    """The mmq-layout quantizer for this size.  `quantize_q8_1_mmq_pair` (2 lanes a block, a quarter of the
    instructions) once it has ~16 warps an SM; below that the 8-lane kernels' 4x more threads hide latency
    better (H100, alone: M=128 K=4096 2.3 against 2.6 us; M=128 K=14336 4.3 against 3.8), taking 1 block a
    warp while that fits in about one wave (64 warps an SM), more when there are waves to spare, so that
    each thread has several loads in flight.  `sums` (formats with a minimum): the pair kernel writes none."""
    if not sums and quantize_mmq_warps("quantize_q8_1_mmq_pair", m, k) >= 16 * sm_count:
        return "quantize_q8_1_mmq_pair"
    warps, wave = quantize_mmq_warps("quantize_q8_1_mmq", m, k), 64 * sm_count
    return "quantize_q8_1_mmq" if warps <= wave else "quantize_q8_1_mmq2" if warps <= 4 * wave else "quantize_q8_1_mmq4"


def quantize_into(mods: Any, layout: str, x: cupy.ndarray, acts: Any) -> None:
    if layout == "split":
        quantize_q8_1_split(mods, x, acts["qs"], acts["ds"])
    elif layout == "mmq_d2s6":  # a warp a (row, stage of 128 values)
        m, k = x.shape
        sb = mmq_tiles(m, k, MMQ_BM)[1]
        args = (x, acts["qs"], acts["dc"], acts["sa"], I32(m), I32(k), I32(sb))
        mods.function("q8_1.cu", "quantize_q8_1_mmq_d2s6")((cdiv(m * (k // 128), 8),), (256,), args)
    elif layout in MMQ_HALF_D:
        m, k = x.shape
        sb = mmq_tiles(m, k, MMQ_BM)[1]
        sa = acts.get("sa")
        name = quantize_mmq_kernel(mods.sm_count, m, k, sums=sa is not None)
        mods.function("q8_1.cu", name)((cdiv(quantize_mmq_warps(name, m, k), 8),), (256,),
                                       (x, acts["qs"], acts["dc"], sa if sa is not None else I64(0), I32(m), I32(k),
                                        I32(sb), I32(MMQ_HALF_D[layout])))
    else:
        quantize_q8_1(mods, x, acts)


def q8_1_to_host(acts: Any, m: int, k: int, layout: str = "") -> Any:
    from kernels.reference import Q8_1

    if isinstance(acts, dict) and "dc" in acts:  # mmq: untile (d from the (d 2^111, -d 2^-19) pairs, s from s 2^-38)
        mt, sb = mmq_tiles(m, k, MMQ_BM)
        kb, kbp = k // QK, sb * MMQ_BKB

        def untile(a: cupy.ndarray, *last: int) -> np.ndarray:  # [tile][stage][block][row](...) -> [m, kb](...)
            t = cupy.asnumpy(a).reshape(mt, sb, MMQ_BKB, MMQ_BM, *last).transpose(0, 3, 1, 2, *range(4, 4 + len(last)))
            return np.ascontiguousarray(t.reshape(-1, kbp, *last)[:m, :kb])

        qs = cupy.asnumpy(acts["qs"]).reshape(mt, sb, MMQ_BM // 8, 8, 8, 16).transpose(0, 2, 4, 1, 3, 5)
        d = untile(acts["dc"], 2)[..., 0] * np.float32(2.0 ** -111)  # exact
        q = np.ascontiguousarray(qs.reshape(-1, kbp * QK)[:m, :k])
        if layout == "mmq_d2s6":  # d per 64 values; sums per 16, those of halves 6 and 7 (d Σq there) as 0
            t = cupy.asnumpy(acts["sa"]).reshape(mt, sb, MMQ_BKB * 2, MMQ_BM).transpose(0, 3, 1, 2)
            s16 = (t.reshape(-1, sb * 8)[:m, :kb * 2] * np.float32(2.0 ** 38)).reshape(m, -1, 8)
            s16[..., 6:] = 0
            return Q8_1(q, d[:, ::2].astype(np.float16), s16.reshape(m, -1).astype(np.float16))
        s = (untile(acts["sa"]) * np.float32(2.0 ** 38)).astype(np.float16) if "sa" in acts else \
            np.zeros((m, kb), dtype=np.float16)  # no sums: the signed formats' formula reads none
        return Q8_1(q, d.astype(np.float16) if MMQ_HALF_D.get(layout) else np.ascontiguousarray(d), s)
    if isinstance(acts, dict):
        ds = cupy.asnumpy(acts["ds"])
        return Q8_1(cupy.asnumpy(acts["qs"]), ds[..., 0].copy(), ds[..., 1].copy())
    return Q8_1.from_blocks(cupy.asnumpy(acts).reshape(m, -1))


MMQ_BM, MMQ_BN, MMQ_BKB, MMQ_STAGES, MMQ_THREADS = 64, 128, 4, 2, 128  # as fast.cu
MMQ_STAGE = (MMQ_BM + MMQ_BN) * MMQ_BKB * QK + MMQ_BKB * MMQ_BM * 8 + MMQ_BKB * MMQ_BN * 4
MMQ_SMEM = MMQ_STAGES * (MMQ_STAGE + 8)  # MmqSmem::BYTES: the stage buffers and their mbarriers
MMQ_SMEM_MIN = MMQ_STAGES * (MMQ_STAGE + MMQ_BKB * (MMQ_BM + MMQ_BN) * 4 + 8)  # MmqSmem<true>: with SA and WM
MMQ_WGMMA_SMEM = cdiv(MMQ_SMEM, 128) * 128 + 2048  # MmqWgSmem::BYTES: then the 2 KiB tile of -128s
# MmqSmem<MIN, 2> (mmq16, mmq16_min): two weight scales a block, and two minima and sums
MMQ16_SMEM = MMQ_STAGES * (MMQ_STAGE + MMQ_BKB * MMQ_BN * 4 + 8)
MMQ16_SMEM_MIN = MMQ_STAGES * (MMQ_STAGE + MMQ_BKB * MMQ_BN * 4 + 2 * MMQ_BKB * (MMQ_BM + MMQ_BN) * 4 + 8)


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
    # one kernel for every signed weight type (its layouts carry the format); formats with a minimum: mmq_min;
    # a scale per 16 values: mmq16 (mmq16_min)
    minimum = "wm" in w
    fmt = format_of(t.upper())
    if fmt is not None and fmt.group_values == 16:
        assert base == "mmq", "mmq_wgmma takes one scale per 32 values only"
        base = "mmq16"
    if minimum:
        assert base != "mmq_wgmma", "mmq_wgmma takes the signed formats only"
        base += "_min"
    fn = mods.function("fast.cu", base)
    threads, smem = {"mmq": (MMQ_THREADS, MMQ_SMEM), "mmq_min": (MMQ_THREADS, MMQ_SMEM_MIN),
                     "mmq16": (MMQ_THREADS, MMQ16_SMEM), "mmq16_min": (MMQ_THREADS, MMQ16_SMEM_MIN),
                     "mmq_wgmma": (2 * MMQ_THREADS, MMQ_WGMMA_SMEM)}[base]
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem  # two stages: over the 48 KiB default
    extra = (a["sa"], w["wm"]) if minimum else ()
    fn(grid, (threads,), (w["wq"], w["wd"], a["qs"], a["dc"], *extra, y, I32(m), I32(n), I32(k), I32(per),
                          I32(splits > 1)), shared_mem=smem)


def _gemv(mods: Any, t: str, w: dict, a: dict, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    if "p0" in w:  # a grouped format's field planes: gemv_groups (fast.cu), one kernel a row count
        planes = tuple(w.get(f"p{i}", w["p0"]) for i in range(5))  # unused planes: any pointer, never read
        if m == 1:
            pdl.launch(mods.function("fast.cu", f"gemv1_{t}"), (cdiv(n, 8),), (256,),
                       (*planes, a["qs"], a["ds"], y, I32(n), I32(k)), mods.dependent_launch)
        else:
            mods.function("fast.cu", f"gemv_rows_{t}")((cdiv(n, 8),), (256,),
                                                       (*planes, a["qs"], a["ds"], y, I32(m), I32(n), I32(k)))
        return
    planes = (w["qs"], w["d"], w.get("qh", w["qs"]))  # formats without fifth bits: any pointer, never read
    if m == 1:  # a warp per weight row, dp4a; it may start during the quantize kernel (pdl.py)
        pdl.launch(mods.function("fast.cu", f"gemv1_{t}"), (cdiv(n, 8),), (256,),
                   (*planes, a["qs"], a["ds"], y, I32(n), I32(k)), mods.dependent_launch)
    else:  # 16 weight rows x up to 8 activation rows per tensor-core MMA
        mods.function("fast.cu", f"skinny1_{t}")((cdiv(n, 16),), (256,), (*planes, a["qs"], a["ds"], y,
                                                                          I32(m), I32(n), I32(k)))


def _gemv_rows(mods: Any, t: str, w: dict, a: dict, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    if "p0" in w:  # grouped formats: gemv_groups reuses each decoded sub-block for every row already
        _gemv(mods, t, w, a, y, m, n, k)
        return
    mods.function("fast.cu", f"gemv_rows_{t}")((cdiv(n, 8),), (256,),
                                               (w["qs"], w["d"], w.get("qh", w["qs"]), a["qs"], a["ds"], y,
                                                I32(m), I32(n), I32(k)))


def _cublas(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    cublas.gemm_xwt(a, w["w"], y)  # fp16, bf16 or fp32 weights, dequantized (or as stored) at upload


def _mmvf_f16(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    from kernels.reference import mmvf_block_size

    mods.function("w16.cu", "mmvf_f16")((n,), (mmvf_block_size(k),), (w["w"], a, y, I32(n), I32(k)))


def _mmv_bf16(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    mods.function("w16.cu", "mmv_bf16")((cdiv(n, 8),), (256,), (w["w"], a, y, I32(n), I32(k)))


# ---- bitsandbytes' NF4 / FP4 (bnb4.cu) -------------------------------------------------------------
def _bnb4_args(t: str, w: dict, n: int, k: int) -> tuple[str, tuple]:
    """(the kernels' suffix, their weight arguments) for a bnb4 layout: its blocksize from the count of
    scales (blocks over the flat N*K values), double quantization when the 8-bit scales are there."""
    from kernels.bnb4 import BLOCKSIZES

    dq = "qabs" in w
    blocks = int((w["qabs"] if dq else w["absmax"]).size)
    bs = next((b for b in BLOCKSIZES if cdiv(n * k, b) == blocks), BLOCKSIZES[-1])
    z = w["qs"]  # arguments a variant never reads: any pointer
    args = (w["qs"], w.get("absmax", z), w.get("qabs", z), w.get("absmax2", z), w.get("code8", z),
            np.float32(w["offset_h"]) if dq else np.float32(0), I32(bs.bit_length() - 1))
    return f"{t.lower()}{'_dq' if dq else ''}", args


BNB4_STREAM_ROWS = 4  # bnb4.cu's BNB4_STREAM_ROWS: weight rows a block takes at a time
BNB4_STREAM_SMEM = 256 * 32 * 8  # its per-lane pair tables


@cache
def _stream_grid_cap(fn: Any, threads: int, sm_count: int) -> int:
    """Blocks of the persistent stream kernel the device holds at once (its resident-block limit times SMs)."""
    fn.max_dynamic_shared_size_bytes = BNB4_STREAM_SMEM
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, BNB4_STREAM_SMEM)
    return max(1, per_sm) * sm_count


def _bnb4_gemv(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    sfx, args = _bnb4_args(t, w, n, k)
    if m == 1 and k % 32 == 0 and k // 32 <= 512:  # the stream kernel: a thread per 32-value column of K
        fn = mods.function("bnb4.cu", f"gemv_bnb4_stream_{sfx}")
        threads = 32 * cdiv(k // 32, 32)
        grid = min(cdiv(n, BNB4_STREAM_ROWS), _stream_grid_cap(fn, threads, mods.sm_count))
        fn((grid,), (threads,), (*args, a, y, I32(m), I32(n), I32(k)), shared_mem=BNB4_STREAM_SMEM)
        return
    mr = next(r for r in (1, 2, 4, 8) if m <= r)
    mods.function("bnb4.cu", f"gemv_bnb4_{sfx}_{mr}")((cdiv(n, 8),), (256,), (*args, a, y, I32(m), I32(n), I32(k)))


def dequantize_bnb4(mods: Any, t: str, w: dict, n: int, k: int, out: cupy.ndarray | None = None) -> cupy.ndarray:
    """The float32 [N, K] matrix bitsandbytes' dequantize_4bit gives, on the device."""
    sfx, args = _bnb4_args(t, w, n, k)
    out = cupy.empty((n, k), dtype=cupy.float32) if out is None else out
    words = n * k // 8
    mods.function("bnb4.cu", f"dequantize_bnb4_{sfx}")((cdiv(words, 256),), (256,), (*args, out, I64(words)))
    return out


def _bnb4_dequant(mods: Any, t: str, w: dict, a: cupy.ndarray, y: cupy.ndarray, m: int, n: int, k: int) -> None:
    cublas.gemm_xwt(a, dequantize_bnb4(mods, t, w, n, k), y)  # weights stay 4-bit; a float copy per product


def float_activations(mods: Any, activation_format: str, x: cupy.ndarray, out: cupy.ndarray | None = None
                      ) -> cupy.ndarray:
    """The activations a float kernel reads: fp32 as they are (f32, f16_mmvf: the kernel rounds them), cast to
    fp16, or rounded to bf16 (its bits as uint16: CuPy has no bfloat16); into `out` when given (graphs)."""
    if activation_format not in ("f16", "bf16"):
        return x
    if out is None:
        out = cupy.empty(x.shape, dtype=cupy.float16 if activation_format == "f16" else cupy.uint16)
    if activation_format == "f16":
        cupy.copyto(out, x)
    else:
        mods.function("w16.cu", "to_bf16")((cdiv(x.size, 256),), (256,), (x, out, I64(x.size)))
    return out


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
    "cublas_bf16": Launch("w16.cu", _cublas),
    "mmvf_f16": Launch("w16.cu", _mmvf_f16),
    "mmv_bf16": Launch("w16.cu", _mmv_bf16),
    "mmq": Launch("fast.cu", _mmq),
    "mmq_wgmma": Launch("fast.cu", partial(_mmq, base="mmq_wgmma")),
    "gemv": Launch("fast.cu", _gemv),
    "gemv_rows": Launch("fast.cu", _gemv_rows),
    "bnb4_gemv": Launch("bnb4.cu", _bnb4_gemv),
    "bnb4_dequant": Launch("bnb4.cu", _bnb4_dequant),
}


def suffix(type_name: str) -> str:
    return type_name.lower()


# ---- weight layouts ----------------------------------------------------------------------------
def layout_nbytes(layout: str, type_name: str, n: int, k: int) -> int:
    fmt = format_of(type_name)
    assert fmt is not None
    if layout == "bnb4":  # codes and a float scale per block: at most blocksize 32's
        return n * k // 2 + cdiv(n * k, 32) * 4
    h = 2 if fmt.group_values == 16 else 1  # weight scales a block (and minima)
    per_block = QK + 4 * h * (2 if fmt.has_min or fmt.group_min else 1)
    return {"gguf": n * fmt.row_bytes(k),
            "split": n * fmt.row_bytes(k),  # the same bytes, regrouped (legacy) or as field planes (grouped)
            "f16": n * k * 2, "bf16": n * k * 2, "f32": n * k * 4,
            "mmq": math.prod(mmq_tiles(n, k, MMQ_BN)) * MMQ_BN * MMQ_BKB * per_block}[layout]


FLOAT_LAYOUTS = ("f16", "bf16", "f32")
DEVICE_DEQUANTIZERS = LADDER_WEIGHTS  # w16.cu's dequantize_{f16,f32}_<type>; other types dequantize on the host


def host_float_weights(type_name: str, raw: np.ndarray, layout: str) -> np.ndarray:
    """A tensor's values in a float layout: bf16 as stored (BF16 matrices only), else gguf's dequantization
    (float matrices as they are) cast to fp16 or fp32."""
    from kernels.reference import dequantize_weights

    if layout == "bf16":
        if type_name != "BF16":
            raise ValueError(f"the bf16 layout holds BF16 matrices only, not {type_name}")
        return np.ascontiguousarray(raw).view(np.uint16)
    return dequantize_weights(type_name, raw).astype(np.float16 if layout == "f16" else np.float32)


def make_layout(mods: Any, layout: str, type_name: str, raw: np.ndarray, n: int, k: int) -> dict[str, cupy.ndarray]:
    """Upload a tensor's GGUF bytes and turn them into `layout` on the device."""
    fmt = format_of(type_name)
    assert fmt is not None
    kb = k // QK
    if layout == "bnb4":  # a Bnb4Tensor: codes as bitsandbytes packs them, its scales (8-bit ones when nested)
        from kernels.bnb4 import DYNAMIC_CODE

        arrays = {"qs": cupy.asarray(raw.packed)}
        if raw.nested is None:
            arrays["absmax"] = cupy.asarray(raw.absmax)
        else:
            arrays.update(qabs=cupy.asarray(raw.nested.q), absmax2=cupy.asarray(raw.nested.absmax2),
                          code8=cupy.asarray(DYNAMIC_CODE), offset_h=np.float32(raw.nested.offset))
        return arrays
    if layout == "split" and fmt.grouped:  # each block field its own plane (groups.cuh decodes them)
        from kernels.groups import field_planes

        return {f"p{i}": cupy.asarray(p) for i, p in enumerate(field_planes(type_name, raw))}
    if layout == "split":  # regrouped on the host: quants, scales (d or (d, m)) and fifth bits apart
        from kernels.reference import block_fields

        head, qh, qs = block_fields(type_name, raw)
        planes = {"qs": qs.reshape(-1), "d": head.reshape(-1)}
        if qh is not None:
            planes["qh"] = qh.reshape(-1).view(np.uint32)
        return {name: cupy.asarray(a) for name, a in planes.items()}
    if layout in FLOAT_LAYOUTS and type_name not in DEVICE_DEQUANTIZERS:  # dequantized (or cast) on the host
        return {"w": cupy.asarray(host_float_weights(type_name, raw, layout).reshape(n, k))}
    w = cupy.asarray(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    if layout == "gguf":
        return {"w": w}
    if layout in FLOAT_LAYOUTS:
        out = cupy.empty((n, k), dtype=np.float16 if layout == "f16" else np.float32)
        fn = mods.function("w16.cu", f"dequantize_{layout}_{suffix(type_name)}")
        fn((cdiv(n * k, 256),), (256,), (w, out, I64(n * k)))
        del w
        return {"w": out}
    if layout == "mmq":  # tiled as fast.cu's mmq copies it, made on the host once
        nt, sb = mmq_tiles(n, k, MMQ_BN)
        rows, kbp = nt * MMQ_BN, sb * MMQ_BKB
        qp = np.zeros((rows, kbp * QK), dtype=np.int8)  # padding rows and blocks are zeros
        if fmt.grouped:  # the integers and group scales of llama.cpp's MMQ tiles (groups.py)
            from kernels.groups import decode

            gw = decode(type_name, raw)
            qp[:n, :k] = gw.q
            d, mins, h = gw.mmq_scale, gw.mmq_min, QK // gw.group
        else:
            from kernels.reference import unpack_blocks

            q, d, mins = unpack_blocks(type_name, raw)
            qp[:n, :k] = q.astype(np.int16) - fmt.offset  # signed, as llama.cpp's MMQ tiles (Q4_0: q - 8; Q4_1: q)
            h = 1

        def scale_tiles(v: np.ndarray) -> np.ndarray:  # per block, half and row: [tile][stage][block][half][row]
            full = np.zeros((rows, kbp * h), dtype=np.float32)
            full[:n, :kb * h] = v.astype(np.float32)
            t = full.reshape(nt, MMQ_BN, sb, MMQ_BKB * h).transpose(0, 2, 3, 1)
            return np.ascontiguousarray(t).reshape(-1)

        # quants in core-matrix order within a piece: [row/8][k/16][row%8][k%16]
        cores = qp.reshape(nt, MMQ_BN // 8, 8, sb, 8, 16).transpose(0, 3, 1, 4, 2, 5)
        out = {"wq": cupy.asarray(np.ascontiguousarray(cores).reshape(-1)), "wd": cupy.asarray(scale_tiles(d))}
        if mins is not None:  # m_w, what the m_w s_a term multiplies by
            out["wm"] = cupy.asarray(scale_tiles(mins))
        return out
    raise ValueError(f"unknown weight layout {layout!r}")


def launch_gemm(mods: Any, spec: KernelSpec, type_name: str, w: dict, acts: cupy.ndarray, y: cupy.ndarray,
                m: int, n: int, k: int) -> None:
    LAUNCHERS[spec.name].fn(mods, suffix(type_name), w, acts, y, m, n, k)
