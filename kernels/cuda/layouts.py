"""The layouts CUDA kernels read, each an object: weight layouts made on the device once from a tensor's bytes
(and cached per tensor under their name), and activation layouts X is prepared in for every product
(quantized to Q8_1 in one of llama.cpp's arrangements, or cast to the formula's float).

Importable without CuPy (a CPU machine lists the kernels that read these); only making and filling them
needs a device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from kernels.cuda.launch import (
    ACT_DS_ROW,
    ACT_ROW,
    CHUNK_BLOCKS,
    I64,
    MMQ_BKB,
    MMQ_BM,
    MMQ_BN,
    cdiv,
    chunk_bytes,
    chunked_row_bytes,
    mmq_min_bytes,
    mmq_tiles,
    quantize_mmq_kernel,
    quantize_mmq_warps,
    takes_skinny,
)
from kernels.formats import FORMATS, QK, format_of, mmq_ds_layout
from kernels.groups import GROUPED, MMQ_D2_TYPES, int8_digits, mmq_scales_a_block, mmq_weights
from kernels.kernel import Layout

try:
    import cupy
except ImportError:  # a machine without CuPy: the layouts are named, never made
    cupy = None

Q8_1_BYTES = FORMATS[GGMLQuantizationType.Q8_1].block_bytes
POISON_Q8_1 = 0xAB  # what Q8_1 buffers are filled with before a test's product: a kernel that reads an unwritten
# byte gives a wrong answer, never a lucky one
DEVICE_DEQUANTIZERS = ("Q4_0", "Q8_0")  # w16.cu's dequantize_{f16,f32}_<type>; other types dequantize on the host
DeviceArrays = dict[str, Any]  # name -> cupy.ndarray


def suffix(type_name: str) -> str:
    """The suffix of a type's kernels in the .cu sources (X-macro instantiations)."""
    return type_name.lower()


# ---- weight layouts ------------------------------------------------------------------------------
class WeightLayout(Layout):
    """Weights in the form a family of kernels reads, made on the device from the tensor's bytes."""

    def __init__(self, name: str):
        self.name = name

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        """Device bytes it takes (what the budget reserves before the upload)."""
        raise NotImplementedError

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        """Upload the tensor's bytes and turn them into this layout on the device."""
        raise NotImplementedError


class GgufBlocks(WeightLayout):
    """The GGUF blocks as stored (the ladder kernels and w16 read whole blocks)."""

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        return n * _format(type_name).row_bytes(k)

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        return {"w": _upload_bytes(raw)}


class SplitPlanes(WeightLayout):
    """The same bytes regrouped into planes: legacy blocks' quants, scales (d or (d, m)) and fifth bits apart
    (16-byte loads of each), or a grouped format's fields each in its own plane (groups.cuh decodes them)."""

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        return n * _format(type_name).row_bytes(k)

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        if _format(type_name).grouped:
            from kernels.groups import field_planes

            return {f"p{i}": _padded(p.shape, p.dtype, p) for i, p in enumerate(field_planes(type_name, raw))}
        from kernels.reference import block_fields

        head, qh, qs = block_fields(type_name, raw)
        planes = {"qs": qs.reshape(-1), "d": head.reshape(-1)}
        if qh is not None:
            planes["qh"] = qh.reshape(-1).view(np.uint32)
        return {name: _padded(a.shape, a.dtype, a) for name, a in planes.items()}


class MmqTiles(WeightLayout):
    """Signed (or, with a minimum, unsigned) int8 rows in the core-matrix order mmq.cuh's tiles copy, and
    block-major fp32 scales, and minima as halves in row-major pieces (mmq.cuh MmqSmem; Q2_K's last two halves of a
    stage also as floats): llama.cpp's MMQ tiles, made on the host once.  `digits` 2 (mmq_d2): Q6_K's values with
    their integer scales folded in, each as two int8 digits (groups.py MMQ_D2_TYPES)."""

    def __init__(self, name: str, digits: int = 1):
        super().__init__(name)
        self.digits = digits

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        fmt = _format(type_name)
        h = mmq_scales_a_block(type_name, self.digits) if fmt.grouped else 1  # weight scales a block (and minima)
        minimum = fmt.has_min or fmt.group_min
        per_block = QK * self.digits + 4 * h + (mmq_min_bytes(h) // MMQ_BKB if minimum else 0)
        return math.prod(mmq_tiles(n, k, MMQ_BN)) * MMQ_BN * MMQ_BKB * per_block

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        fmt = _format(type_name)
        kb = k // QK
        nt, sb = mmq_tiles(n, k, MMQ_BN)
        rows, kbp = nt * MMQ_BN, sb * MMQ_BKB
        digits = self.digits
        if digits == 2 and type_name not in MMQ_D2_TYPES:
            raise ValueError(f"{self.name} holds {', '.join(MMQ_D2_TYPES)} only, not {type_name}")
        qp = np.zeros((rows, kbp * QK), dtype=np.int8 if digits == 1 else np.int16)  # padding: zeros
        if fmt.grouped:  # the integers and group scales of llama.cpp's MMQ tiles (groups.py)
            gw = mmq_weights(type_name, raw, digits)
            qp[:n, :k] = gw.q
            d, mins, h = gw.mmq_scale, gw.mmq_min, QK // gw.group
        else:
            from kernels.reference import unpack_blocks

            q, d, mins = unpack_blocks(type_name, raw)
            qp[:n, :k] = q.astype(np.int16) - fmt.offset  # signed, as llama.cpp's MMQ tiles (Q4_0: q - 8; Q4_1: q)
            h = 1

        def scale_tiles(v: np.ndarray, dtype: Any = np.float32, row_major: bool = False) -> np.ndarray:
            """Per block, half and row: [tile][stage][block][half][row] (or [tile][stage][row][block][half])."""
            full = np.zeros((rows, kbp * h), dtype=dtype)
            full[:n, :kb * h] = v.astype(dtype)
            t = full.reshape(nt, MMQ_BN, sb, MMQ_BKB * h).transpose((0, 2, 1, 3) if row_major else (0, 2, 3, 1))
            return np.ascontiguousarray(t).reshape(-1)

        def cores(q: np.ndarray) -> np.ndarray:
            """Quants in core-matrix order within a piece: [row/8][k/16][row%8][k%16]."""
            return q.reshape(nt, MMQ_BN // 8, 8, sb, 8, 16).transpose(0, 3, 1, 4, 2, 5)

        if digits == 1:
            wq = cores(qp)
        else:  # two int8 digits (Q6_K's q * sc): each stage piece the low digits' 128 rows, then the high digits'
            # (mmq.cuh D = 2), whose sum is in units of 2^-7 of mmq's: the scale d * 2^7 (exact)
            wq = np.stack([cores(p) for p in int8_digits(qp)], axis=2)
            d = d * 128.0
        out = {"wq": cupy.asarray(np.ascontiguousarray(wq).reshape(-1)), "wd": cupy.asarray(scale_tiles(d))}
        if mins is not None:  # m_w, what the m_w s_a term multiplies by: halves (as in llama.cpp), the B operand of
            # mmq's fp16 MMA, [tile][stage][row][block][half]; for Q2_K (H = 2) each piece then has halves 6 and 7
            # of its stage as floats [2][row] (mmq.cuh MmqSmem)
            wm = scale_tiles(mins, np.float16, True)
            if h == 2:
                f = scale_tiles(mins).reshape(nt, sb, MMQ_BKB * h, MMQ_BN)[:, :, 6:]
                wm = np.concatenate([wm.view(np.uint8).reshape(nt * sb, -1),
                                     np.ascontiguousarray(f).view(np.uint8).reshape(nt * sb, -1)], axis=1)
            out["wm"] = cupy.asarray(wm.reshape(-1))
        return out


class FloatMatrix(WeightLayout):
    """The values as fp16, fp32 or bf16 [N, K]: dequantized once on the device (the ladder's types) or on the
    host (gguf's dequantization; float matrices cast), bf16 only as BF16 matrices store it."""

    DTYPES = {"f16": np.float16, "f32": np.float32, "bf16": np.uint16}  # bf16 as its bits: CuPy has no bfloat16

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        return n * k * np.dtype(self.DTYPES[self.name]).itemsize

    def host_values(self, type_name: str, raw: Any) -> np.ndarray:
        """The tensor's values in this layout, made on the host."""
        from kernels.reference import dequantize_weights

        if self.name == "bf16":
            if type_name != "BF16":
                raise ValueError(f"the bf16 layout holds BF16 matrices only, not {type_name}")
            return np.ascontiguousarray(raw).view(np.uint16)
        return dequantize_weights(type_name, raw).astype(self.DTYPES[self.name])

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        if type_name not in DEVICE_DEQUANTIZERS or self.name == "bf16":
            return {"w": cupy.asarray(self.host_values(type_name, raw).reshape(n, k))}
        w = _upload_bytes(raw)
        out = cupy.empty((n, k), dtype=self.DTYPES[self.name])
        fn = mods.function("w16.cu", f"dequantize_{self.name}_{suffix(type_name)}")
        fn((cdiv(n * k, 256),), (256,), (w, out, I64(n * k)))
        return {"w": out}


class Bnb4Codes(WeightLayout):
    """bitsandbytes' NF4/FP4: the codes as it packs them and its scales (8-bit ones when nested), from a
    Bnb4Tensor (kernels/bnb4.py)."""

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        return n * k // 2 + cdiv(n * k, 32) * 4  # codes and a float scale per block: at most blocksize 32's

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        from kernels.bnb4 import DYNAMIC_CODE

        arrays = {"qs": cupy.asarray(raw.packed)}
        if raw.nested is None:
            arrays["absmax"] = cupy.asarray(raw.absmax)
        else:
            arrays.update(qabs=cupy.asarray(raw.nested.q), absmax2=cupy.asarray(raw.nested.absmax2),
                          code8=cupy.asarray(DYNAMIC_CODE), offset_h=np.float32(raw.nested.offset))
        return arrays


def _format(type_name: str) -> Any:
    fmt = format_of(type_name)
    assert fmt is not None, type_name
    return fmt


PLANE_SLACK = 16  # bytes readable past a plane's end: gemv.cu's skinny copies runs in 16-byte chunks


def _padded(shape: tuple[int, ...], dtype: Any, host: np.ndarray | None = None) -> Any:
    """A device array with PLANE_SLACK bytes of allocation after it (filled from `host` when given)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    a = cupy.empty(nbytes + PLANE_SLACK, dtype=cupy.uint8)[:nbytes].view(dtype).reshape(shape)
    if host is not None:
        a.set(np.ascontiguousarray(host))
    return a


def _upload_bytes(raw: Any) -> Any:
    return cupy.asarray(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))


class ChunkedRows(WeightLayout):
    """gemv's layout: a legacy format's rows as chunks of CHUNK_BLOCKS blocks, each chunk's quants, fifth bits and
    scales together (common.cuh ChunkedRows; one copy a row and stage for the skinny kernel); a grouped format's
    fields each in its own plane (groups.cuh decodes them)."""

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        fmt = _format(type_name)
        return n * (fmt.row_bytes(k) if fmt.grouped else chunked_row_bytes(fmt.block_bytes, k // QK))

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        if _format(type_name).grouped:
            return SPLIT.make(mods, type_name, raw, n, k)
        rows = chunked_rows(type_name, raw)
        return {"w": _padded(rows.shape, rows.dtype, rows)}


def chunked_rows(type_name: str, raw: np.ndarray) -> np.ndarray:
    """Raw GGUF rows of a legacy format (uint8 [N, row_bytes]) as ChunkedRows: uint8 [N, chunked_row_bytes]."""
    from kernels.reference import block_fields

    head, qh, qs = block_fields(type_name, raw)
    parts = [qs, qh, head.view(np.uint8)] if qh is not None else [qs, head.view(np.uint8)]
    return _chunks(parts, _format(type_name).block_bytes)


def _chunks(parts: list[np.ndarray], block_bytes: int, super_parts: tuple[np.ndarray, ...] = (),
            super_bytes: int = 0) -> np.ndarray:
    """Rows of chunks (common.cuh ChunkedRows): each chunk of up to CHUNK_BLOCKS blocks holds its blocks' bytes of
    each part [N, KB, ...] in turn, then its super-blocks' of each super part [N, KB / 8, ...], padded to 16 bytes."""
    n, kb = parts[0].shape[:2]
    out = np.zeros((n, chunked_row_bytes(block_bytes, kb, super_bytes)), np.uint8)
    full = chunk_bytes(block_bytes, CHUNK_BLOCKS, super_bytes)
    for first in range(0, kb, CHUNK_BLOCKS):
        last = min(first + CHUNK_BLOCKS, kb)
        pieces = [p[:, first:last] for p in parts] + [p[:, first // 8:last // 8] for p in super_parts]
        chunk = np.concatenate([p.reshape(n, -1) for p in pieces], axis=1)
        at = first // CHUNK_BLOCKS * full
        out[:, at:at + chunk.shape[1]] = chunk
    return out


class KQuantRows(WeightLayout):
    """The K-quants as gemv's chunked rows for their M = 1 stream (groups.cuh Q4_KR, Q5_KR, Q6_KR): each 32-value
    sub-block a legacy block of 16 nibble bytes in Q4_0's order, its high bits (Q5_K: a uint32, bit l value l's
    fifth; Q6_K: two uint32 of 2-bit pairs) and its scales unpacked to two bytes, and each super-block's float
    fields once after a chunk's scales (Q4_K 148 bytes a super-block against the file's 144, Q5_K 180 against 176,
    Q6_K 212 against 210).  IQ4_XS the same way (groups.cuh IQ4_XSR): 16 code bytes a sub-block as its lookup reads
    them (groups.py paired_nibbles), its scale minus 32 as an int8, d once a super-block: 138 bytes against 136."""

    # bytes a sub-block (its block in the chunk) and a super-block (after the chunk's scales)
    GEOMETRY = {"Q4_K": (18, 4), "Q5_K": (22, 4), "Q6_K": (26, 2), "IQ4_XS": (17, 2)}
    TYPES = tuple(GEOMETRY)

    def nbytes(self, type_name: str, n: int, k: int) -> int:
        block_bytes, super_bytes = self.GEOMETRY[type_name]
        return n * chunked_row_bytes(block_bytes, k // QK, super_bytes)

    def make(self, mods: Any, type_name: str, raw: Any, n: int, k: int) -> DeviceArrays:
        rows = k_quant_rows(type_name, raw)
        return {"w": _padded(rows.shape, rows.dtype, rows)}


def k_quant_rows(type_name: str, raw: np.ndarray) -> np.ndarray:
    """Raw GGUF rows of a format KQuantRows holds (uint8 [N, row_bytes]) as KQuantRows: uint8
    [N, chunked_row_bytes(block bytes, K / 32, super bytes)]."""
    from kernels.groups import IQ4XS, blocks_of, grouped, paired_nibbles, scale_min_k4

    if type_name not in KQuantRows.TYPES:
        raise ValueError(f"the {K_ROWS.name} layout holds {', '.join(KQuantRows.TYPES)} only, not {type_name}")
    b = blocks_of(type_name, raw)
    n, sbs = b.shape
    kb = 8 * sbs
    fmt = grouped(type_name)
    if type_name == "IQ4_XS":
        qs = paired_nibbles(np.ascontiguousarray(b["qs"]).reshape(n, kb, 16))
        scales = (IQ4XS.scales(b) - 32).astype(np.int8).view(np.uint8).reshape(n, kb, 1)
        sup = np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, sbs, 2)
        block_bytes, super_bytes = KQuantRows.GEOMETRY[type_name]
        return _chunks([qs, scales], block_bytes, (sup,), super_bytes)
    if type_name == "Q6_K":
        q = (fmt.decode(b)[0].reshape(n, kb, 32) + 32).astype(np.uint32)  # 0..63
        # high bit pairs: value 4i + c (i < 4) at bits 8c + 2i of word 0; value 16 + 4i + c the same in word 1
        hp = (q >> 4).reshape(n, kb, 2, 4, 4)  # [.., word, i, c]
        shift = 8 * np.arange(4).reshape(1, 4) + 2 * np.arange(4).reshape(4, 1)
        high = (hp << shift).sum(axis=(-2, -1), dtype=np.uint32).astype("<u4").view(np.uint8).reshape(n, kb, 8)
        scales = b["scales"].view(np.uint8).reshape(n, kb, 2)  # int8 scales of values 0-15 and 16-31
        sup = np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, sbs, 2)
    else:
        q = fmt.quants(b).reshape(n, kb, 32).astype(np.uint32)
        sc, mn = scale_min_k4(b["scales"])
        scales = (sc | (mn << 8)).astype("<u2").reshape(n, kb).view(np.uint8).reshape(n, kb, 2)
        sup = b.view(np.uint8).reshape(n, sbs, -1)[..., :4]  # the block's first fields: d, dmin
        high = None
        if type_name == "Q5_K":
            bits = (q >> 4) << np.arange(32, dtype=np.uint32)  # bit l: value l's fifth
            high = bits.sum(axis=-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(n, kb, 4)
    low = (q & 0xF).astype(np.uint8)
    qs = low[..., :16] | (low[..., 16:] << 4)  # byte l: value l low, value l + 16 high
    parts = [qs, scales] if high is None else [qs, high, scales]
    block_bytes, super_bytes = KQuantRows.GEOMETRY[type_name]
    return _chunks(parts, block_bytes, (sup,), super_bytes)


GGUF = GgufBlocks("gguf")
SPLIT = SplitPlanes("split")
CHUNKED = ChunkedRows("chunked")
K_ROWS = KQuantRows("k_rows")
MMQ = MmqTiles("mmq")
MMQ_D2 = MmqTiles("mmq_d2", digits=2)
F16 = FloatMatrix("f16")
F32 = FloatMatrix("f32")
BF16 = FloatMatrix("bf16")
BNB4 = Bnb4Codes("bnb4")


# ---- activation layouts ----------------------------------------------------------------------------
class ActivationLayout(Layout):
    """X [M, K] (fp32 on the device) as a kernel reads it: buffers made per product, then filled."""

    quantized = False  # Q8_1 (then `to_host` reads it back, for tests)

    def __init__(self, name: str):
        self.name = name

    def buffers(self, m: int, k: int) -> Any:
        """Device buffers for M x K activations (uninitialised), or None where the kernel reads X itself."""
        return None

    def fill(self, mods: Any, x: Any, bufs: Any) -> Any:
        """Prepare X into the buffers on the current stream; what the kernel takes."""
        return x

    def poison(self, bufs: Any) -> None:
        """Fill the buffers with a byte no kernel writes, so that a byte left unwritten shows in the product."""
        for buf in bufs.values() if isinstance(bufs, dict) else [bufs]:
            buf.view(cupy.uint8).fill(POISON_Q8_1)

    def to_host(self, bufs: Any, m: int, k: int) -> Any:
        raise NotImplementedError(f"{self.name} activations are not Q8_1")


class FloatActivations(ActivationLayout):
    """fp32 as they are (f32, and f16_mmvf, whose kernel rounds them itself), cast to fp16, or rounded to bf16."""

    def buffers(self, m: int, k: int) -> Any:
        if self.name == "f16":
            return cupy.empty((m, k), dtype=cupy.float16)
        if self.name == "bf16":
            return cupy.empty((m, k), dtype=cupy.uint16)
        return None

    def fill(self, mods: Any, x: Any, bufs: Any) -> Any:
        if self.name not in ("f16", "bf16"):
            return x
        cast(mods, f"to_{self.name}", x, bufs)
        return bufs


CAST_THREADS, CAST_PER_THREAD = 256, 8  # as w16.cu's casts


def cast(mods: Any, entry: str, src: Any, dst: Any) -> None:
    """w16.cu's `to_f16`, `to_bf16` (fp32 -> 16 bits, to nearest even) or `widen_f16` (half -> fp32) of contiguous
    arrays of one size, on the current stream."""
    assert src.size == dst.size and src.flags.c_contiguous and dst.flags.c_contiguous
    if src.size:
        mods.function("w16.cu", entry)((cdiv(src.size, CAST_THREADS * CAST_PER_THREAD),), (CAST_THREADS,),
                                       (src, dst, I64(src.size)))


class Q8_1InKernel(ActivationLayout):
    """fp32 X as it is, for a kernel that quantizes it to Q8_1 itself (gemv_fused: in its shared memory): no buffer
    to fill, poison or read back (a product's `activations_q8_1` is then None)."""

    quantized = True

    def poison(self, bufs: Any) -> None:
        pass

    def to_host(self, bufs: Any, m: int, k: int) -> Any:
        return None


class Q8_1Blocks(ActivationLayout):
    """llama.cpp's block_q8_1 records: half2 (d, s) and 32 int8 quants a block (the ladder kernels)."""

    quantized = True

    def buffers(self, m: int, k: int) -> Any:
        return cupy.empty(m * (k // QK) * Q8_1_BYTES, dtype=cupy.uint8)

    def fill(self, mods: Any, x: Any, bufs: Any) -> Any:
        n = x.size  # 4 values a thread
        mods.function("q8_1.cu", "quantize_q8_1")((cdiv(n, 1024),), (256,), (x, bufs, I64(n)))
        return bufs

    def to_host(self, bufs: Any, m: int, k: int) -> Any:
        from kernels.reference import Q8_1

        return Q8_1.from_blocks(cupy.asnumpy(bufs).reshape(m, -1))


class Q8_1Split(ActivationLayout):
    """int8 quants and half2 (d, s) scales apart (gemv's 16-byte loads), by row ([M, K] and [M, K / 32]); where the
    skinny kernel reads them (`chunks`: a product of m rows) in chunks of CHUNK_BLOCKS blocks holding the M rows'
    padded parts (common.cuh act_q, act_ds), so that a stage's activations are two copies into shared rows 4 banks
    apart."""

    quantized = True

    def __init__(self, name: str, chunks: Callable[[int], bool] = lambda m: False):
        super().__init__(name)
        self.chunks = chunks

    def buffers(self, m: int, k: int) -> Any:
        if not self.chunks(m):
            return {"qs": cupy.empty((m, k), dtype=cupy.int8), "ds": _padded((m, k // QK, 2), cupy.float16)}
        n = cdiv(k // QK, CHUNK_BLOCKS)
        return {"qs": cupy.empty((n, m, ACT_ROW), dtype=cupy.int8), "ds": _padded((n, m, ACT_DS_ROW, 2), cupy.float16)}

    def fill(self, mods: Any, x: Any, bufs: Any) -> Any:
        from kernels.cuda import pdl

        m, k = x.shape  # dependent launch: it may get resident while the GEMM ahead of it ends (pdl.py)
        pdl.launch(mods.function("q8_1.cu", "quantize_q8_1_split"), (cdiv(x.size, 1024),), (256,),
                   (x, bufs["qs"], bufs["ds"], I64(x.size), np.int32(m), np.int32(k), np.int32(self.chunks(m))),
                   mods.dependent_launch)
        return bufs

    def to_host(self, bufs: Any, m: int, k: int) -> Any:
        from kernels.reference import Q8_1

        qs, ds = cupy.asnumpy(bufs["qs"]), cupy.asnumpy(bufs["ds"])
        if self.chunks(m):  # chunks of M padded row parts back to rows
            qs = qs[:, :, :CHUNK_BLOCKS * QK].transpose(1, 0, 2).reshape(m, -1)[:, :k]
            ds = ds[:, :, :CHUNK_BLOCKS].transpose(1, 0, 2, 3).reshape(m, -1, 2)[:, :k // QK]
        return Q8_1(np.ascontiguousarray(qs), ds[..., 0].copy(), ds[..., 1].copy())


class Q8_1Mmq(ActivationLayout):
    """Q8_1 tiled as mmq.cuh's tiles read it, in pieces of 64 rows x one stage, with the scale layout llama.cpp's
    MMQ quantizes into for the weights' format: "mmq_d4" d_a in float; "mmq_ds4" d_a a half; "mmq_ds4s" and the
    block sums its m_w s_a term reads (formats with a minimum); "mmq_d2s6" Q2_K's half d_a per 64 values and
    half sums of 16."""

    quantized = True

    def __init__(self, name: str, half_d: bool, sums: int):
        super().__init__(name)
        # sums: s_a per block: 0; 1 (DS4: a half, [tile][stage][row][block]); 2 (D2S6: per half block, mmq.cuh
        # MmqSmem H = 2: pieces of [row][8] halves and [2][row] floats)
        self.half_d, self.sums = half_d, sums

    def buffers(self, m: int, k: int) -> Any:
        pieces = math.prod(mmq_tiles(m, k, MMQ_BM))
        bufs = {"qs": cupy.empty(pieces * MMQ_BM * MMQ_BKB * QK, dtype=cupy.int8),
                "dc": cupy.empty(pieces * MMQ_BKB * MMQ_BM * 2, dtype=cupy.float32)}
        if self.sums:
            bufs["sa"] = cupy.empty(pieces * MMQ_BM * mmq_min_bytes(self.sums), dtype=cupy.uint8)
        return bufs

    def fill(self, mods: Any, x: Any, bufs: Any) -> Any:
        m, k = x.shape
        sb = mmq_tiles(m, k, MMQ_BM)[1]
        if self.name == "mmq_d2s6":  # a warp a (row, stage of 128 values)
            args = (x, bufs["qs"], bufs["dc"], bufs["sa"], np.int32(m), np.int32(k), np.int32(sb))
            mods.function("q8_1.cu", "quantize_q8_1_mmq_d2s6")((cdiv(m * (k // 128), 8),), (256,), args)
            return bufs
        sa = bufs.get("sa")
        name = quantize_mmq_kernel(mods.sm_count, m, k, sums=sa is not None)
        mods.function("q8_1.cu", name)((cdiv(quantize_mmq_warps(name, m, k), 8),), (256,),
                                       (x, bufs["qs"], bufs["dc"], sa if sa is not None else I64(0), np.int32(m),
                                        np.int32(k), np.int32(sb), np.int32(self.half_d)))
        return bufs

    def to_host(self, bufs: Any, m: int, k: int) -> Any:
        """Untiled: d from the (d 2^111, -d 2^-19) pairs, s from s 2^-38."""
        from kernels.reference import Q8_1

        mt, sb = mmq_tiles(m, k, MMQ_BM)
        kb, kbp = k // QK, sb * MMQ_BKB

        def untile(a: Any, *last: int) -> np.ndarray:  # [tile][stage][block][row](...) -> [m, kb](...)
            t = cupy.asnumpy(a).reshape(mt, sb, MMQ_BKB, MMQ_BM, *last).transpose(0, 3, 1, 2, *range(4, 4 + len(last)))
            return np.ascontiguousarray(t.reshape(-1, kbp, *last)[:m, :kb])

        qs = cupy.asnumpy(bufs["qs"]).reshape(mt, sb, MMQ_BM // 8, 8, 8, 16).transpose(0, 2, 4, 1, 3, 5)
        d = untile(bufs["dc"], 2)[..., 0] * np.float32(2.0 ** -111)  # exact
        q = np.ascontiguousarray(qs.reshape(-1, kbp * QK)[:m, :k])
        if self.name == "mmq_d2s6":  # d per 64 values; sums per 16, those of halves 6 and 7 (d Σq there) as 0
            pieces = cupy.asnumpy(bufs["sa"]).reshape(mt, sb, -1)[:, :, :MMQ_BM * 16]  # the halves
            t = pieces.copy().view(np.float16).reshape(mt, sb, MMQ_BM, 8).transpose(0, 2, 1, 3)
            s16 = np.ascontiguousarray(t.reshape(-1, sb * 8)[:m, :kb * 2])
            return Q8_1(q, d[:, ::2].astype(np.float16), s16)
        if "sa" in bufs:  # [tile][stage][row][block] halves
            t = cupy.asnumpy(bufs["sa"]).view(np.float16).reshape(mt, sb, MMQ_BM, MMQ_BKB).transpose(0, 2, 1, 3)
            s = np.ascontiguousarray(t.reshape(-1, kbp)[:m, :kb])
        else:  # no sums: the signed formats' formula reads none
            s = np.zeros((m, kb), dtype=np.float16)
        return Q8_1(q, d.astype(np.float16) if self.half_d else np.ascontiguousarray(d), s)


X_F32 = FloatActivations("f32")
X_F16 = FloatActivations("f16")
X_BF16 = FloatActivations("bf16")
Q8_1_BLOCKS = Q8_1Blocks("blocks")
Q8_1_IN_KERNEL = Q8_1InKernel("in_kernel")
Q8_1_SPLIT = Q8_1Split("split")
Q8_1_SPLIT_CHUNKS = Q8_1Split("split_chunks", lambda m: m >= 2)  # the legacy formats' gemv (skinny from 2 rows)
# the grouped formats' gemv, chunked from the rows where their skinny MMA takes over (launch.takes_skinny)
Q8_1_SPLIT_CHUNKS_GROUPED = {t: Q8_1Split(f"split_chunks_{t.lower()}", functools.partial(takes_skinny, t))
                             for t, f in GROUPED.items() if f.skinny}
MMQ_ACTIVATIONS = {a.name: a for a in (Q8_1Mmq("mmq_d4", False, 0), Q8_1Mmq("mmq_ds4", True, 0),
                                       Q8_1Mmq("mmq_ds4s", True, 1), Q8_1Mmq("mmq_d2s6", True, 2))}
ACTIVATIONS: dict[str, ActivationLayout] = {a.name: a for a in (
    X_F32, X_F16, X_BF16, Q8_1_BLOCKS, Q8_1_IN_KERNEL, Q8_1_SPLIT, Q8_1_SPLIT_CHUNKS,
    *Q8_1_SPLIT_CHUNKS_GROUPED.values(),
    *MMQ_ACTIVATIONS.values())}


def mmq_activations(type_name: str) -> Q8_1Mmq:
    """The MMQ activation layout llama.cpp quantizes X into for weights of this type (mmq_get_q8_1_ds_layout):
    its scale layout, and the block sums where the format has a minimum and reads them per block (DS4)."""
    fmt = _format(type_name)
    ds = mmq_ds_layout(type_name)
    sums = (fmt.has_min or fmt.group_min) and ds == "DS4"
    return MMQ_ACTIVATIONS["mmq_" + ds.lower() + ("s" if sums else "")]
