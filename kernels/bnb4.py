"""bitsandbytes' 4-bit formats, NF4 and FP4, as bitsandbytes computes them (its CUDA kernels, 0.50).

quantize_4bit: the tensor flattened, cut into blocks of `blocksize` values (32..4096, a power of two);
each block's absmax = max |x| in float32, inv = 1.0f / absmax, and each value's code is the leaf of a
comparison tree on x * inv (dQuantizeNF4 / dQuantizeFP4: the thresholds below, float32 literals), two
codes a byte, the first in the high nibble.  An all-zero block has absmax 0, x * inv = NaN, code 0.
bitsandbytes is built with --use_fast_math, so its 1.0f / absmax is rcp.approx.ftz.f32, which is not the
rounded reciprocal: for 12% of mantissas it is an ulp away.  On real weights (dequantized GGUF values, small
integers times a scale) x / absmax often lands exactly on an FP4 threshold (5/24, 7/24, 11/128), where that
ulp decides the code; `rcp_approx` reproduces the instruction from a table captured on the GPU.
dequantize_4bit: code_table[q] * absmax in float32.  Double quantization (compress_statistics) stores
absmax - mean(absmax) in 8 bits (the mean as torch takes it on the GPU, in its order of float32 additions:
`torch_mean_f32`): blockwise (256) with the signed dynamic map and the binary search of dQuantize, its own
float32 absmax per 256; decoded as code8[q] * absmax2 + offset.
gemv_4bit (kgemm_4bit_inference_naive): activations in their dtype T; the code table and absmax cast to
T, w = T(code * absmax) and T(x * w) in T, summed in float32 (per lane, then a warp's butterflies),
the result cast to T.  `gemv_4bit` below computes that in T = float16 or float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from importlib import resources

import numpy as np

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256  # quantize_4bit's quantize_blockwise of the absmax values
F32 = np.float32

# get_4bit_type("nf4"): quantiles of N(0, 1), index order
NF4_CODE = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                     0.7229568362236023, 1.0], dtype=F32)
# get_4bit_type("fp4"): 1 sign, 2 exponent, 1 mantissa bits, bit-pattern order, divided by its max (12) in float32
FP4_CODE = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3], dtype=F32) / F32(12)
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}


def float_literal(decimal: str) -> np.float32:
    """A C++ `float` literal's value: the decimal rounded once to float32, as nvcc does.  np.float32(float(s))
    rounds twice (to float64, then float32), and NF4's thresholds are midpoints of two float32 codes, so several sit
    next to a float32 tie: four of the fifteen came out an ulp from bitsandbytes' (1 code in ~4 M Gaussian values)."""
    exact = Fraction(decimal)
    near = np.float32(float(decimal))
    candidates = (np.nextafter(near, F32(-np.inf)), near, np.nextafter(near, F32(np.inf)))
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))


# dQuantizeNF4's tree: the code is how many of these (ascending) x exceeds; NaN exceeds none
NF4_THRESHOLDS = np.array([float_literal(t) for t in (
    "-0.8480964004993439", "-0.6106329262256622", "-0.4599952697753906", "-0.33967943489551544",
    "-0.23460740596055984", "-0.13791173323988914", "-0.045525018125772476", "0.03979014977812767",
    "0.1202552504837513", "0.2035212516784668", "0.2920137718319893", "0.3893125355243683",
    "0.5016634166240692", "0.6427869200706482", "0.8614784181118011")], dtype=F32)
# dQuantizeFP4's tree on |x|: thresholds exceeded -> the 3 magnitude bits; the sign bit is x < 0
FP4_THRESHOLDS = np.array([float_literal(t) for t in (
    "0.00260417", "0.0859375", "0.20833333", "0.29166667", "0.4166667", "0.583333", "0.8333333")], dtype=F32)
FP4_MAGNITUDES = np.array([0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011], dtype=np.uint8)


# bitsandbytes' create_dynamic_map(signed=True) (the 8-bit code book of double quantization) exactly as it returns
# it: float32 values from torch.linspace and products in torch, captured with bitsandbytes 0.50.2 / torch 2.11 on the
# GPU machine (2026-11-24; tests/test_gpu_bnb4.py checks it there).  A numpy emulation of torch's linspace missed
# 42 of the 256 values by an ulp, so the table is kept as torch made it.
_DYNAMIC_HEX = (
    "-0x1.fc66660000000p-1", "-0x1.f533340000000p-1", "-0x1.ee00000000000p-1", "-0x1.e6cccc0000000p-1",
    "-0x1.df999a0000000p-1", "-0x1.d866660000000p-1", "-0x1.d133340000000p-1", "-0x1.ca00000000000p-1",
    "-0x1.c2cccc0000000p-1", "-0x1.bb999a0000000p-1", "-0x1.b466660000000p-1", "-0x1.ad33340000000p-1",
    "-0x1.a600000000000p-1", "-0x1.9ecccc0000000p-1", "-0x1.97999a0000000p-1", "-0x1.9066660000000p-1",
    "-0x1.8933340000000p-1", "-0x1.8200000000000p-1", "-0x1.7acccc0000000p-1", "-0x1.73999a0000000p-1",
    "-0x1.6c66680000000p-1", "-0x1.6533340000000p-1", "-0x1.5e00000000000p-1", "-0x1.56cccc0000000p-1",
    "-0x1.4f999a0000000p-1", "-0x1.4866680000000p-1", "-0x1.4133340000000p-1", "-0x1.3a00000000000p-1",
    "-0x1.32cccc0000000p-1", "-0x1.2b999a0000000p-1", "-0x1.2466680000000p-1", "-0x1.1d33340000000p-1",
    "-0x1.1600000000000p-1", "-0x1.0ecccc0000000p-1", "-0x1.0799980000000p-1", "-0x1.0066660000000p-1",
    "-0x1.f266640000000p-2", "-0x1.e400000000000p-2", "-0x1.d599980000000p-2", "-0x1.c733340000000p-2",
    "-0x1.b8cccc0000000p-2", "-0x1.aa66660000000p-2", "-0x1.9c00000000000p-2", "-0x1.8d99980000000p-2",
    "-0x1.7f33340000000p-2", "-0x1.70cccc0000000p-2", "-0x1.6266660000000p-2", "-0x1.5400000000000p-2",
    "-0x1.4599980000000p-2", "-0x1.3733340000000p-2", "-0x1.28cccc0000000p-2", "-0x1.1a66680000000p-2",
    "-0x1.0c00000000000p-2", "-0x1.fb33320000000p-3", "-0x1.de66660000000p-3", "-0x1.c1999a0000000p-3",
    "-0x1.a4cccc0000000p-3", "-0x1.8800000000000p-3", "-0x1.6b33340000000p-3", "-0x1.4e66660000000p-3",
    "-0x1.31999a0000000p-3", "-0x1.14cccc0000000p-3", "-0x1.f000000000000p-4", "-0x1.b666680000000p-4",
    "-0x1.93d70a0000000p-4", "-0x1.8851ee0000000p-4", "-0x1.7cccce0000000p-4", "-0x1.7147ae0000000p-4",
    "-0x1.65c2900000000p-4", "-0x1.5a3d700000000p-4", "-0x1.4eb8540000000p-4", "-0x1.4333340000000p-4",
    "-0x1.37ae140000000p-4", "-0x1.2c28f60000000p-4", "-0x1.20a3d60000000p-4", "-0x1.151eba0000000p-4",
    "-0x1.09999a0000000p-4", "-0x1.fc28f60000000p-5", "-0x1.e51eba0000000p-5", "-0x1.ce147a0000000p-5",
    "-0x1.b70a3e0000000p-5", "-0x1.a000000000000p-5", "-0x1.88f5c20000000p-5", "-0x1.71eb860000000p-5",
    "-0x1.5ae1460000000p-5", "-0x1.43d70a0000000p-5", "-0x1.2cccce0000000p-5", "-0x1.15c2900000000p-5",
    "-0x1.fd70a40000000p-6", "-0x1.cf5c2a0000000p-6", "-0x1.a147ae0000000p-6", "-0x1.7333340000000p-6",
    "-0x1.451eba0000000p-6", "-0x1.170a3e0000000p-6", "-0x1.d1eb860000000p-7", "-0x1.75c2900000000p-7",
    "-0x1.3e76c80000000p-7", "-0x1.2c08300000000p-7", "-0x1.19999a0000000p-7", "-0x1.072b020000000p-7",
    "-0x1.e978d40000000p-8", "-0x1.c49ba60000000p-8", "-0x1.9fbe760000000p-8", "-0x1.7ae1480000000p-8",
    "-0x1.56041a0000000p-8", "-0x1.3126e80000000p-8", "-0x1.0c49ba0000000p-8", "-0x1.ced9140000000p-9",
    "-0x1.851eb80000000p-9", "-0x1.3b645a0000000p-9", "-0x1.e353f80000000p-10", "-0x1.4fdf3a0000000p-10",
    "-0x1.eecbfe0000000p-11", "-0x1.b3d07c0000000p-11", "-0x1.78d5000000000p-11", "-0x1.3dd9820000000p-11",
    "-0x1.02de020000000p-11", "-0x1.8fc5060000000p-12", "-0x1.19ce0a0000000p-12", "-0x1.47ae160000000p-13",
    "-0x1.743e960000000p-14", "-0x1.15df660000000p-14", "-0x1.6f00680000000p-15", "-0x1.64840c0000000p-16",
    "-0x1.040bfe0000000p-17", "-0x1.b435280000000p-19", "-0x1.27476e0000000p-21", "0x0.0p+0",
    "0x1.27476e0000000p-21", "0x1.b435280000000p-19", "0x1.040bfe0000000p-17", "0x1.64840c0000000p-16",
    "0x1.6f00680000000p-15", "0x1.15df660000000p-14", "0x1.743e960000000p-14", "0x1.47ae160000000p-13",
    "0x1.19ce0a0000000p-12", "0x1.8fc5060000000p-12", "0x1.02de020000000p-11", "0x1.3dd9820000000p-11",
    "0x1.78d5000000000p-11", "0x1.b3d07c0000000p-11", "0x1.eecbfe0000000p-11", "0x1.4fdf3a0000000p-10",
    "0x1.e353f80000000p-10", "0x1.3b645a0000000p-9", "0x1.851eb80000000p-9", "0x1.ced9140000000p-9",
    "0x1.0c49ba0000000p-8", "0x1.3126e80000000p-8", "0x1.56041a0000000p-8", "0x1.7ae1480000000p-8",
    "0x1.9fbe760000000p-8", "0x1.c49ba60000000p-8", "0x1.e978d40000000p-8", "0x1.072b020000000p-7",
    "0x1.19999a0000000p-7", "0x1.2c08300000000p-7", "0x1.3e76c80000000p-7", "0x1.75c2900000000p-7",
    "0x1.d1eb860000000p-7", "0x1.170a3e0000000p-6", "0x1.451eba0000000p-6", "0x1.7333340000000p-6",
    "0x1.a147ae0000000p-6", "0x1.cf5c2a0000000p-6", "0x1.fd70a40000000p-6", "0x1.15c2900000000p-5",
    "0x1.2cccce0000000p-5", "0x1.43d70a0000000p-5", "0x1.5ae1460000000p-5", "0x1.71eb860000000p-5",
    "0x1.88f5c20000000p-5", "0x1.a000000000000p-5", "0x1.b70a3e0000000p-5", "0x1.ce147a0000000p-5",
    "0x1.e51eba0000000p-5", "0x1.fc28f60000000p-5", "0x1.09999a0000000p-4", "0x1.151eba0000000p-4",
    "0x1.20a3d60000000p-4", "0x1.2c28f60000000p-4", "0x1.37ae140000000p-4", "0x1.4333340000000p-4",
    "0x1.4eb8540000000p-4", "0x1.5a3d700000000p-4", "0x1.65c2900000000p-4", "0x1.7147ae0000000p-4",
    "0x1.7cccce0000000p-4", "0x1.8851ee0000000p-4", "0x1.93d70a0000000p-4", "0x1.b666680000000p-4",
    "0x1.f000000000000p-4", "0x1.14cccc0000000p-3", "0x1.31999a0000000p-3", "0x1.4e66660000000p-3",
    "0x1.6b33340000000p-3", "0x1.8800000000000p-3", "0x1.a4cccc0000000p-3", "0x1.c1999a0000000p-3",
    "0x1.de66660000000p-3", "0x1.fb33320000000p-3", "0x1.0c00000000000p-2", "0x1.1a66680000000p-2",
    "0x1.28cccc0000000p-2", "0x1.3733340000000p-2", "0x1.4599980000000p-2", "0x1.5400000000000p-2",
    "0x1.6266660000000p-2", "0x1.70cccc0000000p-2", "0x1.7f33340000000p-2", "0x1.8d99980000000p-2",
    "0x1.9c00000000000p-2", "0x1.aa66660000000p-2", "0x1.b8cccc0000000p-2", "0x1.c733340000000p-2",
    "0x1.d599980000000p-2", "0x1.e400000000000p-2", "0x1.f266640000000p-2", "0x1.0066660000000p-1",
    "0x1.0799980000000p-1", "0x1.0ecccc0000000p-1", "0x1.1600000000000p-1", "0x1.1d33340000000p-1",
    "0x1.2466680000000p-1", "0x1.2b999a0000000p-1", "0x1.32cccc0000000p-1", "0x1.3a00000000000p-1",
    "0x1.4133340000000p-1", "0x1.4866680000000p-1", "0x1.4f999a0000000p-1", "0x1.56cccc0000000p-1",
    "0x1.5e00000000000p-1", "0x1.6533340000000p-1", "0x1.6c66680000000p-1", "0x1.73999a0000000p-1",
    "0x1.7acccc0000000p-1", "0x1.8200000000000p-1", "0x1.8933340000000p-1", "0x1.9066660000000p-1",
    "0x1.97999a0000000p-1", "0x1.9ecccc0000000p-1", "0x1.a600000000000p-1", "0x1.ad33340000000p-1",
    "0x1.b466660000000p-1", "0x1.bb999a0000000p-1", "0x1.c2cccc0000000p-1", "0x1.ca00000000000p-1",
    "0x1.d133340000000p-1", "0x1.d866660000000p-1", "0x1.df999a0000000p-1", "0x1.e6cccc0000000p-1",
    "0x1.ee00000000000p-1", "0x1.f533340000000p-1", "0x1.fc66660000000p-1", "0x1.0000000000000p+0"
)
DYNAMIC_CODE = np.array([float.fromhex(h) for h in _DYNAMIC_HEX], dtype=F32)


RCP_DATA = "rcp_approx_f32.npz"
TINY = F32(2.0 ** -126)  # the smallest normal float32: under fast math, smaller inputs and results are zero


@cache
def _rcp_delta() -> np.ndarray:
    """rcp.approx.ftz.f32(x) - RN(1 / x) in ulps for x in [1, 2), int8 [2^23] indexed by x's mantissa bits.
    Captured on an NVIDIA H100 (2026-11-24) by a kernel built with --use_fast_math computing 1.0f / x for every
    mantissa; the same run checked that the result only scales with x's exponent (2^-30..2^30)."""
    with resources.files("kernels.data").joinpath(RCP_DATA).open("rb") as f:
        return np.load(f)["delta"]


def rcp_approx(x: np.ndarray) -> np.ndarray:
    """1.0f / x as a --use_fast_math CUDA kernel computes it (rcp.approx.ftz.f32), float32: the rounded
    reciprocal moved by its mantissa's captured delta; subnormal inputs count as zero (inf), subnormal results
    are zero, zero gives inf, inf gives zero."""
    x = np.asarray(x, F32)
    with np.errstate(divide="ignore", over="ignore"):
        rn = np.where(np.abs(x) < TINY, np.copysign(F32(np.inf), x), F32(1) / x).astype(F32)
    moved = (rn.view(np.uint32).astype(np.int64) + _rcp_delta()[x.view(np.uint32) & 0x7FFFFF]).astype(np.uint32)
    normal = np.isfinite(rn) & (np.abs(rn) >= TINY)
    out = np.where(normal, moved.view(F32), rn)
    return np.where(np.isfinite(rn) & (np.abs(rn) < TINY), np.copysign(F32(0), x), out).astype(F32)


def _block_absmax(x: np.ndarray, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    """(x padded with zeros to whole blocks, [blocks, blocksize]; each block's max |x|, fmaxf's NaN rule)."""
    n = x.size
    blocks = -(-n // blocksize)
    padded = np.zeros(blocks * blocksize, F32)
    padded[:n] = x
    padded = padded.reshape(blocks, blocksize)
    return padded, np.fmax.reduce(np.abs(padded), axis=1).astype(F32)


def _flush(v: np.ndarray) -> np.ndarray:
    """Fast math's flush to zero: subnormals become a zero of their sign."""
    return np.where(np.abs(v) < TINY, np.copysign(F32(0), v), v).astype(F32)


def _scaled(padded: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """x * (1.0f / absmax) per block as bitsandbytes' kernels compute it (a reciprocal, then a multiply)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _flush((_flush(padded) * rcp_approx(absmax)[:, None]).astype(F32))


# bitsandbytes' double-quantization offset is `absmax.mean()` in torch on the GPU: ATen's reduce kernel for a
# contiguous float32 vector, whose order of float32 additions is reproduced below.  Recovered from 77 means
# captured on an NVIDIA H100 (torch 2.11, 2026-11-25: 13 vectors of 7 to 1,048,576 values and the absmax vectors of
# bitsandbytes 0.50.2's double quantization), all equal bit for bit; the exact mean rounded was 1-2 ulps off in
# half of them.  From 131,072 values the kernel splits the vector over CTAs, by the device's SM count past 32,768
# values an SM (4.3 M on an H100).
TORCH_SM_COUNT = 132  # the H100's, where the means were captured
TORCH_MAX_THREADS = 512  # a reduce block's threads at most (ATen's MAX_NUM_THREADS for float)


def _halving_sum(v: np.ndarray) -> np.ndarray:
    """The block's tree over its last axis (a power of two): v[i] += v[i + half] until one is left."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = (v[..., :half] + v[..., half:]).astype(F32)
    return v[..., 0]


def torch_mean_f32(x: np.ndarray, sm_count: int = TORCH_SM_COUNT) -> np.float32:
    """torch.mean of a contiguous float32 vector on a CUDA device with `sm_count` SMs, bit for bit: each thread
    of a block adds its values in float32 (from 128 values: float4 loads, one accumulator a lane, vectors
    block-strided, the odd tail on the first threads; below, the power of two of threads at most n, each with one
    or two values), the accumulators in order, the block's threads by a halving tree; long vectors over several CTAs
    whose partials the last block adds the same way; then sum * float(1 / n).  (At exactly 128 values the two orders
    often agree: 1,920 means on an H100 did not tell them apart, one on an H200 did; tests/test_bnb4.py.)"""
    x = np.asarray(x, F32).reshape(-1)
    n = x.size
    if n == 0:
        return F32(np.nan)  # torch's mean of nothing
    if n < 128:
        width = 1 << (n.bit_length() - 1)  # threads: the power of two at most n, so each has one or two values
        acc = x[:width].copy()
        acc[: n - width] = (acc[: n - width] + x[width:]).astype(F32)
        total = _halving_sum(acc)
    else:
        vectors = n // 4
        width = min(TORCH_MAX_THREADS, 1 << (vectors.bit_length() - 1))
        per_thread = -(-n // width)
        ctas = 1
        if per_thread >= 256:  # split over CTAs: enough blocks for the SMs, 16 to 256 values a thread
            ctas = max(min(sm_count * (2048 // width), -(-per_thread // 16)), -(-per_thread // 256))
        step = width * ctas  # vectors between a thread's loads
        rounds = -(-vectors // step)
        padded = np.zeros(rounds * step * 4, F32)
        padded[: vectors * 4] = x[: vectors * 4]
        loads = padded.reshape(rounds, ctas, width, 4)
        acc = np.zeros((ctas, width, 4), F32)  # from +0.0, so the padding's zeros change nothing
        for r in range(rounds):
            acc = (acc + loads[r]).astype(F32)
        tail = x[vectors * 4:]
        acc[0, : tail.size, 0] = (acc[0, : tail.size, 0] + tail).astype(F32)
        lanes = acc[..., 0]
        for i in range(1, 4):
            lanes = (lanes + acc[..., i]).astype(F32)
        partials = _halving_sum(lanes)  # [ctas]
        if ctas > 1:  # the last block: thread t adds partials t, t + width, ... in order, then its tree
            slots = np.zeros(width, F32)
            for start in range(0, ctas, width):
                part = partials[start:start + width]
                slots[: part.size] = (slots[: part.size] + part).astype(F32)
            total = _halving_sum(slots)
        else:
            total = partials[0]
    return F32(F32(total) * F32(F32(1) / F32(n)))


ENCODE_CHUNK = 1 << 18  # values compared at once: bounds the [values, thresholds] temporaries (~4 MiB)


def encode(scaled: np.ndarray, quant_type: str) -> np.ndarray:
    """dQuantizeNF4 / dQuantizeFP4 of values already scaled by 1/absmax: uint8 codes 0..15."""
    if scaled.size > ENCODE_CHUNK:
        flat = scaled.reshape(-1)
        return np.concatenate([encode(flat[i:i + ENCODE_CHUNK], quant_type)
                               for i in range(0, flat.size, ENCODE_CHUNK)]).reshape(scaled.shape)
    with np.errstate(invalid="ignore"):
        if quant_type == "nf4":
            return (scaled[..., None] > NF4_THRESHOLDS).sum(axis=-1).astype(np.uint8)
        if quant_type == "fp4":
            mag = FP4_MAGNITUDES[(np.abs(scaled)[..., None] > FP4_THRESHOLDS).sum(axis=-1)]
            return mag | np.where(scaled < 0, np.uint8(8), np.uint8(0))
    raise ValueError(f"quant_type must be 'nf4' or 'fp4', not {quant_type!r}")


def dquantize8(code: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dQuantize<0>: the binary search of an 8-bit code book (sorted, 256 values) with midpoint rounding."""
    x = np.asarray(x, F32)
    pivot = np.full(x.shape, 127)
    lo_p, hi_p = np.zeros(x.shape, int), np.full(x.shape, 255)
    lo, hi = np.full(x.shape, F32(-1)), np.full(x.shape, F32(1))
    val = code[pivot]
    for i in (64, 32, 16, 8, 4, 2, 1):
        gt = x > val
        lo_p, lo = np.where(gt, pivot, lo_p), np.where(gt, val, lo)
        hi_p, hi = np.where(gt, hi_p, pivot), np.where(gt, hi, val)
        pivot = np.where(gt, pivot + i, pivot - i)
        val = code[pivot]
    hi = np.where(hi_p == 255, code[255], hi)
    lo = np.where(lo_p == 0, code[0], lo)
    gt = x > val
    up = np.where(x > (hi + val) * F32(0.5), hi_p, pivot)
    down = np.where(x < (lo + val) * F32(0.5), lo_p, pivot)
    return np.where(gt, up, down).astype(np.uint8)


@dataclass(frozen=True)
class Nested:
    """quantize_4bit's double quantization of the absmax values (QuantState.state2 and offset)."""
    q: np.ndarray        # uint8 [blocks]: dQuantize of absmax - offset, blockwise
    absmax2: np.ndarray  # float32 [ceil(blocks / 256)]
    offset: np.float32   # mean of the absmax values

    def decode(self) -> np.ndarray:
        """dequantize_blockwise(q, state2) + offset, float32 [blocks]."""
        idx = np.arange(self.q.size) // NESTED_BLOCKSIZE
        return ((DYNAMIC_CODE[self.q] * self.absmax2[idx]).astype(F32) + self.offset).astype(F32)


@dataclass(frozen=True)
class Bnb4Tensor:
    """A matrix in bitsandbytes' 4-bit format: what quantize_4bit returns for it."""
    quant_type: str      # "nf4" or "fp4"
    blocksize: int
    shape: tuple[int, int]  # [N, K]
    packed: np.ndarray   # uint8 [N*K/2]: value 2j in byte j's high nibble, 2j+1 in its low one
    absmax: np.ndarray   # float32 [blocks] (absent values of a nested state are its decode)
    nested: Nested | None = None

    @property
    def scales(self) -> np.ndarray:
        """The absmax each block is multiplied by (decoded when double-quantized)."""
        return self.nested.decode() if self.nested is not None else self.absmax

    @property
    def nbytes(self) -> int:
        if self.nested is None:
            return self.packed.nbytes + self.absmax.nbytes
        return self.packed.nbytes + self.nested.q.nbytes + self.nested.absmax2.nbytes + 4

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def codes(self) -> np.ndarray:
        """uint8 [N*K]: each value's 4-bit code, in order."""
        out = np.empty(self.packed.size * 2, np.uint8)
        out[0::2] = self.packed >> 4
        out[1::2] = self.packed & 15
        return out[: self.shape[0] * self.shape[1]]


def quantize_blockwise(x: np.ndarray, code: np.ndarray = DYNAMIC_CODE,
                       blocksize: int = NESTED_BLOCKSIZE) -> tuple[np.ndarray, np.ndarray]:
    """quantize_blockwise (8-bit): (codes, absmax per block)."""
    padded, absmax = _block_absmax(np.asarray(x, F32).reshape(-1), blocksize)
    return dquantize8(code, _scaled(padded, absmax)).reshape(-1)[: np.size(x)], absmax


def quantize_4bit(w: np.ndarray, quant_type: str = "nf4", blocksize: int = DEFAULT_BLOCKSIZE,
                  double_quant: bool = False, sm_count: int = TORCH_SM_COUNT) -> Bnb4Tensor:
    """bitsandbytes.functional.quantize_4bit of a float32 [N, K] matrix (N*K even), as bitsandbytes computes it on
    a GPU of `sm_count` SMs (which matters only to double quantization's offset, past 32,768 blocks an SM)."""
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {', '.join(map(str, BLOCKSIZES))}, not {blocksize}")
    w = np.asarray(w, F32)
    if w.ndim != 2 or w.size % 2:
        raise ValueError(f"quantize_4bit takes a matrix with an even number of values, not {list(w.shape)}")
    padded, absmax = _block_absmax(w.reshape(-1), blocksize)
    codes = encode(_scaled(padded, absmax), quant_type).reshape(-1)[: w.size]
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    nested = None
    if double_quant:
        offset = torch_mean_f32(absmax, sm_count)  # bitsandbytes takes absmax.mean() in torch, on the GPU
        q, absmax2 = quantize_blockwise((absmax - offset).astype(F32))
        nested = Nested(q, absmax2, offset)
    return Bnb4Tensor(quant_type, blocksize, (int(w.shape[0]), int(w.shape[1])), packed, absmax, nested)


def dequantize_4bit(t: Bnb4Tensor) -> np.ndarray:
    """float32 [N, K]: code[q] * absmax (the nested absmax decoded first, as dequantize_4bit does)."""
    scales = t.scales
    idx = np.arange(t.shape[0] * t.shape[1]) // t.blocksize
    return (CODES[t.quant_type][t.codes()] * scales[idx]).astype(F32).reshape(t.shape)


def gemv_4bit(x: np.ndarray, t: Bnb4Tensor, dtype: type = np.float32) -> np.ndarray:
    """bitsandbytes' gemv_4bit of activation rows x [M, K] in `dtype` (float16 or float32): each product
    rounded as its kernel rounds it (T(code*absmax), T(x*w)), summed in float32 (here exactly, then
    rounded: the kernel's order differs by float32 rounding only), cast to `dtype`.  [M, N]."""
    x = np.asarray(x).astype(dtype)
    code = CODES[t.quant_type].astype(dtype)
    scales = t.scales.astype(dtype)
    idx = np.arange(t.shape[0] * t.shape[1]) // t.blocksize
    with np.errstate(over="ignore"):
        w = (code[t.codes()] * scales[idx]).astype(dtype).reshape(t.shape)  # exact product, one rounding
        if dtype == np.float32:
            y = x.astype(np.float64) @ w.astype(np.float64).T  # fp32 products: rounding of order 2^-24
        else:
            y = np.empty((x.shape[0], t.shape[0]), np.float64)
            for r in range(x.shape[0]):  # T(x*w): the half product of halves, rounded once
                y[r] = (x[r][None, :] * w).astype(dtype).astype(np.float64).sum(axis=1)
        return y.astype(F32).astype(dtype)
