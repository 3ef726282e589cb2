"""The numpy reference: llama.cpp's CUDA math, element for element.

llama.cpp's CUDA backend multiplies quantized weights by one of two formulas, chosen by the batch
size M (on an sm_90 GPU: MMVQ for M <= 8, MMQ above; `registry.llama_formula`):

* MMVQ (`mmvq.cu`, `vecdotq.cuh`), formula `q8_1_mmvq`:
  - `quantize_q8_1` is its `quantize_q8_1` kernel: per block of 32, d = amax/127 in fp32,
    q = roundf(x/d) (half away from zero), ds = half2(d, sum x).  The sum is taken in the same
    butterfly order as the warp reduction (`__shfl_xor_sync` with offsets 16, 8, 4, 2, 1), so the
    GPU kernel that reduces the same way matches it bit for bit.
  - `ref_q8_1` is `vec_dot_q4_0_q8_1` / `vec_dot_q8_0_q8_1`: an exact integer dot per block, then
    the block scales in fp32, using the *half* values of d and s as the device does:
        Q4_0: d_w * (d_a * sumi - 8 * s_a)     (q_w in 0..15)
        Q8_0: d_w * d_a * sumi
* MMQ on int8 tensor cores (`mmq.cuh`, `mmq-load-tiles.cuh`), formula `q8_1_mmq`:
  - `quantize_q8_1_mmq` is its `quantize_mmq_q8_1`: d_inv = 127/amax, q = roundf(x*d_inv),
    d = 1/d_inv, kept in float (layout D4: Q8_0) or stored as a half (DS4: Q4_0), per the format
    table's `mmq_ds_layout`;
  - `ref_mmq` is `vec_dot_q8_0_q8_1_mma` over weights unpacked to signed int8 (Q4_0: q - 8):
    sumi * d_w * d_a per block, no sum term.
* `ref_f32` dequantizes the weights with `gguf.quants.dequantize` and keeps activations in fp32.

It is the ground truth for the GPU kernels and the serving backend where there is no GPU: all
work is vectorized; the only Python loop runs over chunks of 32-value blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, quants

from kernels import bnb4, groups
from kernels.formats import FORMATS, QK, QUANT_TYPES
from kernels.groups import GroupWeights

Q8_1_BLOCK = np.dtype([("ds", "<f2", (2,)), ("qs", "i1", (QK,))])  # 36 bytes, as block_q8_1
assert Q8_1_BLOCK.itemsize == FORMATS[GGMLQuantizationType.Q8_1].block_bytes


@dataclass(frozen=True)
class Q8_1:
    """Q8_1 activations: q int8 [M, K], d and s [M, K/32]: float16, except MMQ's D4 layout (d float32)."""

    q: np.ndarray
    d: np.ndarray
    s: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def to_blocks(self) -> np.ndarray:
        """The byte image of llama.cpp's `block_q8_1` array, [M, K/32] records of 36 bytes."""
        m, k = self.q.shape
        out = np.empty((m, k // QK), dtype=Q8_1_BLOCK)
        out["ds"][..., 0] = self.d
        out["ds"][..., 1] = self.s
        out["qs"] = self.q.reshape(m, k // QK, QK)
        return out

    @classmethod
    def from_blocks(cls, blocks: np.ndarray) -> Q8_1:
        blocks = np.asarray(blocks).view(Q8_1_BLOCK)
        m, kb = blocks.shape
        return cls(np.ascontiguousarray(blocks["qs"]).reshape(m, kb * QK),
                   np.ascontiguousarray(blocks["ds"][..., 0]), np.ascontiguousarray(blocks["ds"][..., 1]))


def roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: nearest integer, halves away from zero (numpy's rint rounds them to even)."""
    v64 = v.astype(np.float64)  # |v| <= 127, so v + 0.5 is exact in float64
    return np.copysign(np.floor(np.abs(v64) + 0.5), v64)


def warp_sum(xb: np.ndarray) -> np.ndarray:
    """Sum over the last axis (32) in the order of a butterfly warp reduction, in float32."""
    s = xb.astype(np.float32, copy=False)
    width = s.shape[-1]
    while width > 1:
        width //= 2
        s = s[..., :width] + s[..., width:]
    return s[..., 0]


def _blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X [M, K] as float32 blocks [M, K/32, 32], and each block's max |x|."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    xb = x.reshape(m, k // QK, QK)
    return xb, np.abs(xb).max(axis=-1)


def quantize_q8_1(x: np.ndarray) -> Q8_1:
    xb, amax = _blocks(x)
    m, k = xb.shape[0], xb.shape[1] * QK
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = xb / d[..., None]
    q = np.where(amax[..., None] == 0, 0, roundf(v)).astype(np.int8)
    with np.errstate(over="ignore"):  # an infinite half s, as the device stores it (formats without an s term)
        return Q8_1(q.reshape(m, k), d.astype(np.float16), warp_sum(xb).astype(np.float16))


def quantize_q8_1_mmq(x: np.ndarray, ds_layout: str) -> Q8_1:
    """llama.cpp's `quantize_mmq_q8_1` (the activations of its MMQ path): d_inv = 127/amax and
    q = roundf(x*d_inv) in fp32, d = 1/d_inv; D4 keeps d in float32, DS4 stores it as a half with the
    block's sum (four values a thread added in order, then a butterfly over the block's 8 threads)."""
    if ds_layout == "D2S6":
        return quantize_q8_1_d2s6(x)
    if ds_layout not in ("D4", "DS4"):
        raise ValueError(f"no MMQ activation layout {ds_layout!r}")
    xb, amax = _blocks(x)
    m, k = xb.shape[0], xb.shape[1] * QK
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d_inv = np.float32(127) / amax  # inf for an all-zero block: its q are 0 and d = 1/inf = 0
        v = xb * d_inv[..., None]
        d = np.float32(1) / d_inv
        r = roundf(v)
    # as the device converts to int8: saturating, NaN to 0 (a block with amax below 127/FLT_MAX has
    # d_inv = inf: its q are +-127/-128 or 0 and its d is 0, so it adds nothing)
    q = np.where(np.isnan(r), 0, np.clip(r, -128, 127)).astype(np.int8)
    fours = xb.reshape(m, k // QK, 8, 4)
    s = ((fours[..., 0] + fours[..., 1]) + fours[..., 2]) + fours[..., 3]  # float32, as the thread adds
    with np.errstate(over="ignore"):
        s = warp_sum(s).astype(np.float16)
        return Q8_1(q.reshape(m, k), d.astype(np.float16) if ds_layout == "DS4" else d.astype(np.float32), s)


D2S6_SCALE, D2S6_SUM = 64, 16  # Q2_K's MMQ activations: a scale per 64 values, a sum per 16


def quantize_q8_1_d2s6(x: np.ndarray) -> Q8_1:
    """llama.cpp's `quantize_mmq_q8_1` in its D2S6 layout (Q2_K's MMQ): d_inv = 127/amax over 64 values, d a
    half; s [M, K/16] the half sums of 16 values (four a thread, then a butterfly over 4 threads) for the first
    96 values of every 128, 0 for the last 32 (its formula takes their integer sums instead).  Here d is
    [M, K/64], not per block."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if k % 128:
        raise ValueError(f"K={k} is not a multiple of 128 (Q2_K's MMQ activation blocks)")
    xb = x.reshape(m, k // D2S6_SCALE, D2S6_SCALE)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d_inv = np.float32(127) / amax
        r = roundf(xb * d_inv[..., None])
        d = (np.float32(1) / d_inv).astype(np.float16)
    q = np.where(np.isnan(r), 0, np.clip(r, -128, 127)).astype(np.int8)
    fours = x.reshape(m, k // D2S6_SUM, 4, 4)
    t = ((fours[..., 0] + fours[..., 1]) + fours[..., 2]) + fours[..., 3]
    with np.errstate(over="ignore"):
        sums = warp_sum(t).astype(np.float16).reshape(m, k // 128, 8)
    sums[..., 6:] = 0
    return Q8_1(q.reshape(m, k), d, sums.reshape(m, k // D2S6_SUM))


HALF_INF = 65520.0  # float16 rounds every |v| >= this to infinity (65504 is its largest finite value)


@dataclass(frozen=True)
class Q8_1Overflow:
    """The first Q8_1 block whose half-precision scale d or sum s would be infinite."""
    row: int
    block: int
    quantity: str  # "scale" (max|x|/127) or "sum" (Σx)
    value: float

    def __str__(self) -> str:
        limit = f"max|x|/127 < {HALF_INF:g}, i.e. max|x| < {HALF_INF * 127:.6g}" if self.quantity == "scale" \
            else f"|Σx| < {HALF_INF:g}"
        return (f"row {self.row}, block {self.block} (columns {self.block * QK}..{self.block * QK + QK - 1}): its Q8_1 "
                f"{self.quantity} {self.value:.6g} overflows half precision (needs {limit})")


def q8_1_in_range(amax: float) -> bool:
    """Whether activations of this max|x| are safe for Q8_1 whatever their blocks: neither a block's d nor its sum
    can round to a float16 infinity (False for NaN and inf)."""
    return amax * QK < HALF_INF * 0.99


def q8_1_overflow(x: np.ndarray, uses_sum: bool, amax: float | None = None) -> Q8_1Overflow | None:
    """Where `quantize_q8_1(x)` would store an infinite d (or s, when the weights' format reads it);
    `amax`: max|x| when the caller knows it already."""
    x = np.asarray(x, dtype=np.float32)
    if q8_1_in_range(float(np.abs(x).max(initial=0.0)) if amax is None else amax):  # the common case, one pass
        return None
    m, k = x.shape
    xb = x.reshape(m, k // QK, QK)
    with np.errstate(over="ignore"):
        d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float16)
        s = warp_sum(xb).astype(np.float16) if uses_sum else np.zeros_like(d)
    for quantity, values, exact in (("scale", d, lambda r, b: float(np.abs(xb[r, b]).max() / 127)),
                                    ("sum", s, lambda r, b: float(warp_sum(xb[r, b])))):
        bad = np.argwhere(np.isinf(values))
        if len(bad):
            r, b = (int(v) for v in bad[0])
            return Q8_1Overflow(r, b, quantity, exact(r, b))
    return None


def dequantize_q8_1(a: Q8_1) -> np.ndarray:
    m, k = a.shape
    qb = a.q.reshape(m, k // QK, QK).astype(np.float32)
    return (qb * a.d.astype(np.float32)[..., None]).reshape(m, k)


@dataclass(frozen=True)
class BlockWeights:
    """Quantized weights split into integer values and per-block scales, ready for dot products.

    q is float32 [K/32, 32, N] (exact small integers, laid out for one matmul per block);
    d (and m, for formats with a minimum) float32 [K/32, N], exactly the blocks' halves.  Unsigned
    formats keep q as stored (Q4_0 0..15, Q5_0 0..31); the offset is the compensation term's job.
    """

    type_name: str
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes of nibbles to 32 values: q[j] the low nibble of byte j, q[j+16] its high nibble."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """A block's uint32 qh (4 bytes, little-endian) to 32 values of 16: bit j is value j's fifth bit."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]: byte b's bit i is value 8b+i's
    return bits.astype(np.uint8) << 4


def block_fields(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Raw GGUF rows (uint8 [N, row_bytes]) split into llama.cpp's block_qX_Y fields, as the format table
    lays them out: (header float16 [N, KB, 1 or 2]: d or (d, m); qh uint8 [N, KB, 4] or None; qs uint8
    [N, KB, 16 or 32])."""
    fmt = FORMATS.get(GGMLQuantizationType[type_name]) if type_name in GGMLQuantizationType.__members__ else None
    if fmt is None or not fmt.quantizes_activations or fmt.grouped:
        raise ValueError(f"no legacy block unpacking for {type_name}")
    raw = np.asarray(raw, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, fmt.block_bytes)
    h = 2 * fmt.header_halves
    head = np.ascontiguousarray(blocks[..., :h]).view(np.float16)
    qh = np.ascontiguousarray(blocks[..., h:h + 4]) if fmt.fifth_bits else None
    return head, qh, np.ascontiguousarray(blocks[..., blocks.shape[-1] - fmt.qs_bytes:])


def unpack_blocks(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF rows (uint8 [N, row_bytes]) to (q [N, K] integers, d float16 [N, K/32], m float16 or None):
    nibbles or int8, with their fifth bits."""
    head, qh, qs = block_fields(type_name, raw)
    q = _nibbles(qs) if qs.shape[-1] == QK // 2 else qs.view(np.int8)
    if qh is not None:
        q = q | _fifth_bits(qh)
    return q.reshape(q.shape[0], -1), head[..., 0], head[..., 1] if head.shape[-1] == 2 else None


def prepare_block_weights(type_name: str, raw: np.ndarray) -> BlockWeights | GroupWeights:
    """The weights as the Q8_1 formulas read them: legacy blocks split, grouped formats decoded (groups.py)."""
    fmt = FORMATS.get(GGMLQuantizationType[type_name]) if type_name in GGMLQuantizationType.__members__ else None
    if fmt is not None and fmt.grouped:
        return groups.decode(type_name, raw)
    q, d, mins = unpack_blocks(type_name, raw)
    n, k = q.shape
    qt = np.ascontiguousarray(q.reshape(n, k // QK, QK).transpose(1, 2, 0), dtype=np.float32)
    m = np.ascontiguousarray(mins.T, dtype=np.float32) if mins is not None else None
    return BlockWeights(type_name, qt, np.ascontiguousarray(d.T, dtype=np.float32), m)


def dequantize_weights(type_name: str, raw: np.ndarray) -> np.ndarray:
    """float32 [N, K] (gguf's dequantizer; F32/F16 tensors arrive as their values already; bitsandbytes'
    NF4/FP4 as the Bnb4Tensor requant.py made)."""
    if isinstance(raw, bnb4.Bnb4Tensor):
        return bnb4.dequantize_4bit(raw)
    raw = np.asarray(raw)
    if raw.dtype.kind == "f":
        return raw.astype(np.float32, copy=False)
    return quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32, copy=False)


def _block_dots(w: BlockWeights, a: Q8_1, chunk: int, signed: bool = False):
    """Yield (sumi, d_a, s_a, d_w) for chunks of quant blocks: sumi [c, M, N] exact integers in fp32;
    `signed`: against the weights' signed values q - offset (MMQ's tiles), else their stored q."""
    m, k = a.shape
    kb_total, _, n = w.q.shape
    if k != kb_total * QK:
        raise ValueError(f"K mismatch: activations have {k}, weights {kb_total * QK}")
    if w.type_name not in QUANT_TYPES:
        raise ValueError(f"ref_q8_1 has no formula for {w.type_name}")
    qa = a.q.reshape(m, kb_total, QK).transpose(1, 0, 2).astype(np.float32)  # [KB, M, 32]
    da = a.d.astype(np.float32).T  # [KB, M]
    sa = a.s.astype(np.float32).T
    c = np.float32(_offset(w.type_name)) if signed else np.float32(0)
    for k0 in range(0, kb_total, chunk):
        k1 = min(k0 + chunk, kb_total)
        sumi = np.matmul(qa[k0:k1], w.q[k0:k1])  # |sum| < 2^24: exact
        if c:  # Σ q_a (q_w - c) = Σ q_a q_w - c Σ q_a, exact integers too
            sumi -= c * qa[k0:k1].sum(axis=-1)[..., None]
        yield sumi, da[k0:k1, :, None], sa[k0:k1, :, None], w.d[k0:k1, None, :]


def _offset(type_name: str) -> int:
    """The constant a format's unsigned quants are offset by, taken back through the activations' sum:
    d_w * (d_a * sumi - offset * s_a); 0: no offset."""
    return FORMATS[GGMLQuantizationType[type_name]].offset


def _half_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`__hmul2` on halves: the float32 product of two halves is exact, then rounded to half (as float32)."""
    with np.errstate(over="ignore"):
        return (a.astype(np.float32) * b.astype(np.float32)).astype(np.float16).astype(np.float32)


def _group_terms(w: GroupWeights, a: Q8_1, mmq: bool, chunk: int = 16):
    """Yield, per chunk of groups, the parts of a grouped format's product: (d_a [c, M, 1], sumi [c, M, N],
    q_a sums [c, M, 1], scale [c, 1, N], coef [c, 1, N] or None, S [c, M, 1] or None), float64.  MMVQ: scale,
    coef are `scale`, `coef` (coef times d_a Σq_a); MMQ: `mmq_scale` and `mmq_min` (times S: the block's s_a
    (DS4), or Q2_K's D2S6 sums of 16 and d_a Σq_a for the last 32 of every 128)."""
    m, k = a.shape
    n, kw = w.q.shape
    if k != kw:
        raise ValueError(f"K mismatch: activations have {k}, weights {kw}")
    g = w.group
    ng = k // g
    qa = a.q.reshape(m, ng, g).transpose(1, 0, 2)
    per = k // a.d.shape[1]  # values a d_a covers: 32, or 64 (D2S6)
    da = np.repeat(a.d.astype(np.float64).T, per // g, axis=0)[..., None]  # [G, M, 1]
    d2s6 = mmq and per == D2S6_SCALE
    scale, coef = (w.mmq_scale, w.mmq_min) if mmq else (w.scale, w.coef)
    for g0 in range(0, ng, chunk):
        g1 = min(g0 + chunk, ng)
        qa_c = qa[g0:g1].astype(np.float32)
        sumi = np.matmul(qa_c, np.ascontiguousarray(w.q[:, g0 * g:g1 * g].reshape(n, g1 - g0, g).transpose(1, 2, 0),
                                                    dtype=np.float32)).astype(np.float64)  # exact integers
        qsum = qa_c.sum(axis=-1, dtype=np.float64)[..., None]
        sc = scale[:, g0:g1].T[:, None, :]
        cf = None if coef is None else coef[:, g0:g1].T[:, None, :]
        big_s = None
        if mmq and coef is not None:
            if d2s6:  # the sums of 16, and for the last two groups of every 8, d_a times their integer sums
                s16 = a.s.astype(np.float64).T[g0:g1, :, None]
                last = (np.arange(g0, g1) % 8 >= 6)[:, None, None]
                big_s = np.where(last, da[g0:g1] * qsum, s16)
            else:  # DS4: groups of 32 are blocks
                big_s = a.s.astype(np.float64).T[g0:g1, :, None]
        yield da[g0:g1], sumi, qsum, sc, cf, big_s


def _ref_groups(w: GroupWeights, a: Q8_1, mmq: bool) -> np.ndarray:
    y = np.zeros((a.shape[0], w.q.shape[0]))
    for da, sumi, qsum, sc, cf, big_s in _group_terms(w, a, mmq):
        part = da * sc * sumi
        if cf is not None:
            part += cf * (big_s if mmq else da * qsum)
        y += part.sum(axis=0)
    return y.astype(np.float32)


def _ref_groups_terms(w: GroupWeights, a: Q8_1, mmq: bool) -> Terms:
    mag = np.zeros((a.shape[0], w.q.shape[0]))
    for da, sumi, qsum, sc, cf, big_s in _group_terms(w, a, mmq):
        mag += np.abs(da * sc * sumi).sum(axis=0)
        if cf is not None:
            mag += np.abs(cf * (big_s if mmq else da * qsum)).sum(axis=0)
    ng = w.q.shape[1] // w.group
    return Terms(mag, ng * (2 if w.coef is not None else 1))


def ref_q8_1(w: BlockWeights | GroupWeights, a: Q8_1, chunk: int = 8) -> np.ndarray:
    """Y[M, N] = Σ_blocks of MMVQ's per-block formula; integer sums exact (|sum| < 2^24 in fp32):
    offset formats d_w*(d_a*sumi - c*s_a), Q8_0 d_w*d_a*sumi, formats with a minimum
    sumi*half(d_w*d_a) + half(m_w*s_a) (the products rounded to half, as `__hmul2` does); grouped formats
    Σ_groups d_a*(scale*sumi + coef*Σq_a) (groups.py)."""
    if isinstance(w, GroupWeights):
        return _ref_groups(w, a, mmq=False)
    acc = np.zeros((a.shape[0], w.q.shape[2]), dtype=np.float32)
    c = np.float32(_offset(w.type_name))
    half = FORMATS[GGMLQuantizationType[w.type_name]].mmvq_half_products
    for k0, (sumi, da, sa, dw) in enumerate(_block_dots(w, a, chunk)):
        if w.m is not None:
            mw = w.m[k0 * chunk:k0 * chunk + sumi.shape[0], None, :]
            if half:
                sumi *= _half_product(dw, da)
                sumi += _half_product(mw, sa)
            else:
                sumi *= dw * da
                sumi += mw * sa
        elif c:
            sumi *= da
            sumi -= c * sa
            sumi *= dw
        else:
            sumi *= dw * da
        acc += sumi.sum(axis=0, dtype=np.float32)
    return acc


def ref_mmq(w: BlockWeights | GroupWeights, a: Q8_1, chunk: int = 8) -> np.ndarray:
    """Y[M, N] by llama.cpp's MMQ formula, `a` from `quantize_q8_1_mmq` with the weights' `mmq_ds_layout`:
    Σ_blocks sumi*d_w*d_a over signed weights (q - offset), no sum term (vec_dot_q8_0_q8_1_mma); formats
    with a minimum (d_w*d_a)*sumi + m_w*s_a in float over their unsigned q (vec_dot_q8_1_q8_1_mma); grouped
    formats Σ_groups d_a*mmq_scale*sumi + mmq_min*S (groups.py)."""
    if isinstance(w, GroupWeights):
        return _ref_groups(w, a, mmq=True)
    acc = np.zeros((a.shape[0], w.q.shape[2]), dtype=np.float32)
    for k0, (sumi, da, sa, dw) in enumerate(_block_dots(w, a, chunk, signed=True)):
        if w.m is not None:
            sumi *= dw * da
            sumi += w.m[k0 * chunk:k0 * chunk + sumi.shape[0], None, :] * sa
        else:
            sumi *= dw
            sumi *= da
        acc += sumi.sum(axis=0, dtype=np.float32)
    return acc


FLOAT_UNIT = 2.0**-23  # one fp32 ulp at 1: an upper bound on a truncating step's relative error
HALF_UNIT = 2.0**-10  # the same for half precision


@dataclass(frozen=True)
class Terms:
    """What a product's outputs are sums of, for error measures that stay well-conditioned when an output
    is a small remainder of large terms (kernels/accuracy.py).

    magnitude [M, N]: Σ over the output's terms of |term| (float64); count: how many terms each output
    sums; s_ulp [M, N]: what one half-precision ulp of each s_a moves the output by (for comparisons whose
    two sides quantized the activations separately: the device may round s_a one ulp apart)."""

    magnitude: np.ndarray
    count: int
    s_ulp: np.ndarray | None = None
    unit: float = FLOAT_UNIT  # the relative error of one rounding step of the sums (fp32; half for `f16_h`)


def _sum_coefficients(w: BlockWeights, dw: np.ndarray, k0: int, n_blocks: int) -> np.ndarray | None:
    """Per block, what multiplies s_a in the formula: c*d_w for offset formats, m_w with a minimum."""
    if w.m is not None:
        return w.m[k0:k0 + n_blocks, None, :].astype(np.float64)
    c = _offset(w.type_name)
    return c * dw.astype(np.float64) if c else None


def ref_q8_1_terms(w: BlockWeights | GroupWeights, a: Q8_1, chunk: int = 8) -> Terms:
    """The terms of `ref_q8_1`: per block |d_w*d_a*sumi| and, for formats with a sum term, |coef*s_a|."""
    if isinstance(w, GroupWeights):
        return _ref_groups_terms(w, a, mmq=False)
    m, n = a.shape[0], w.q.shape[2]
    mag, s_ulp = np.zeros((m, n)), np.zeros((m, n))
    has_sum = False
    for i, (sumi, da, sa, dw) in enumerate(_block_dots(w, a, chunk)):
        mag += (np.abs(sumi.astype(np.float64)) * np.abs(da.astype(np.float64)) * np.abs(dw.astype(np.float64))).sum(0)
        coef = _sum_coefficients(w, dw, i * chunk, sumi.shape[0])
        if coef is not None:
            has_sum = True
            mag += (np.abs(coef) * np.abs(sa.astype(np.float64))).sum(axis=0)
            ulp = np.spacing(np.abs(sa).astype(np.float16)).astype(np.float64)
            s_ulp += (np.abs(coef) * ulp).sum(axis=0)
    kb = w.q.shape[0]
    return Terms(mag, kb * (2 if has_sum else 1), s_ulp if has_sum else None)


def ref_mmq_terms(w: BlockWeights | GroupWeights, a: Q8_1, chunk: int = 8) -> Terms:
    """The terms of `ref_mmq`: |sumi * d_w * d_a| per block, and |m_w * s_a| for formats with a minimum."""
    if isinstance(w, GroupWeights):
        return _ref_groups_terms(w, a, mmq=True)
    mag = np.zeros((a.shape[0], w.q.shape[2]))
    for i, (sumi, da, sa, dw) in enumerate(_block_dots(w, a, chunk, signed=True)):
        mag += (np.abs(sumi.astype(np.float64)) * np.abs(da.astype(np.float64)) * np.abs(dw.astype(np.float64))).sum(0)
        if w.m is not None:
            mag += (np.abs(w.m[i * chunk:i * chunk + sumi.shape[0], None, :]) * np.abs(sa.astype(np.float64))).sum(0)
    return Terms(mag, w.q.shape[0] * (2 if w.m is not None else 1))


def ref_f32(w_f32: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Y = X · Wᵀ with the weights already dequantized to float32 [N, K]."""
    return np.matmul(np.asarray(x, dtype=np.float32), w_f32.T)


def ref_f16_h(w_f16: np.ndarray, x_f16: np.ndarray) -> np.ndarray:
    """llama.cpp's cuBLAS product of an F16 matrix (CUBLAS_COMPUTE_16F: half operands, half sums, half outputs,
    widened to float32), as near as numpy gets: the fp32 sums of the half operands rounded to half.  cuBLAS sums
    in half in an order of its own choosing, so this twin is within half-precision rounding of ggml, not bit for
    bit (the GPU kernel, the same cuBLAS call, is)."""
    with np.errstate(over="ignore"):
        return ref_f32(w_f16, x_f16).astype(np.float16).astype(np.float32)


HALF_SUM_STEP = 16  # values a half-precision tensor-core step sums before it rounds (mma m16n8k16 / wgmma k16)


def ref_f16_h_terms(w: np.ndarray, x: np.ndarray) -> Terms:
    """The terms of a product summed in half: |x_i * w_i|, rounded once a k16 step (and once more at the store),
    each rounding a half-precision unit (kernels/accuracy.py reads `unit`)."""
    t = ref_f32_terms(w, x)
    return Terms(t.magnitude, -(-x.shape[1] // HALF_SUM_STEP) + 1, unit=HALF_UNIT)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (to nearest, ties to even; NaN kept), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return np.where(np.isnan(x), x, rounded.view(np.float32)).astype(np.float32)


def mmvf_block_size(k: int, warp: int = 32, largest: int = 256) -> int:
    """The threads llama.cpp's `mul_mat_vec_f` gives a row of K values: the smallest block (a multiple
    of the warp, up to 256) that needs the fewest iterations over the K/2 value pairs."""
    best, niter_best = warp, -(-k // (2 * warp))
    for bs in range(2 * warp, largest + 1, warp):
        niter = -(-k // (2 * bs))
        if niter < niter_best:
            best, niter_best = bs, niter
    return best


def _butterfly(v: np.ndarray) -> np.ndarray:
    """A warp's xor-butterfly sum (offsets 16, 8, 4, 2, 1) over the last axis (32 lanes), in float32."""
    for off in (16, 8, 4, 2, 1):
        v = (v + v[..., np.arange(32) ^ off]).astype(np.float32)
    return v[..., 0]


def ref_f16_mmvf(w16: np.ndarray, x: np.ndarray, rows: int = 1024) -> np.ndarray:
    """Y [1, N] as llama.cpp multiplies an F16 matrix by one activation row (`mul_mat_vec_f`, its default
    precision): thread t of a row's block keeps a half2 sum over value pairs t, t + bs, ...; each pair adds
    fma(w, half(x), sum) rounded to half once (hfma2); then low + high in float, a butterfly warp sum, the
    warps' sums through shared memory and a second butterfly.  Bit for bit ggml's on the H100 (docs/accuracy.md)."""
    w16 = np.asarray(w16, np.float16)
    n, k = w16.shape
    x = _mmvf_row(x, k, "ref_f16_mmvf")
    bs = mmvf_block_size(k)
    pairs = k // 2
    steps = -(-pairs // bs)
    xh = np.zeros(steps * bs * 2, np.float64)
    xh[:k] = x.astype(np.float16)  # make_half2: to nearest
    xh = xh.reshape(steps, bs, 2)
    out = np.empty(n, np.float32)
    for r0 in range(0, n, rows):
        wp = np.zeros((min(rows, n - r0), steps * bs * 2), np.float64)
        wp[:, :k] = w16[r0:r0 + rows]
        wp = wp.reshape(-1, steps, bs, 2)
        acc = np.zeros(wp.shape[:1] + (bs, 2), np.float16)
        for i in range(steps):  # the product of two halves and the add are exact in float64: one rounding
            acc = (wp[:, i] * xh[i] + acc).astype(np.float16)
        out[r0:r0 + rows] = _mmvf_block_sum(acc[..., 0].astype(np.float32) + acc[..., 1].astype(np.float32))
    return out[None]


def _mmvf_row(x: np.ndarray, k: int, name: str) -> np.ndarray:
    """mul_mat_vec_f's one activation row of K (even) values, as float32."""
    x = np.asarray(x, np.float32).reshape(-1)
    if x.shape[0] != k or k % 2:
        raise ValueError(f"{name} takes one row of K={k} (even) values")
    return x


def _mmvf_block_sum(per_thread: np.ndarray) -> np.ndarray:
    """mul_mat_vec_f's reduction of its threads' float sums [rows, bs]: a butterfly per warp, then the warps' sums
    (zero-padded to 32) through a second butterfly."""
    bs = per_thread.shape[1]
    warps = _butterfly(per_thread.reshape(-1, bs // 32, 32))
    if bs > 32:
        buf = np.zeros((warps.shape[0], 32), np.float32)
        buf[:, :bs // 32] = warps
        warps = _butterfly(buf)[:, None]
    return warps[:, 0]


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) of float32 arrays, rounded once: a * b is exact in float64; the sum's float64 rounding is
    turned into rounding to odd (TwoSum's residual says which way the exact sum lies), after which rounding to
    float32 is exact rounding (53 >= 24 + 2 bits)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - c64
    e = (p - bp) + (c64 - (s - bp))  # the exact p + c is s + e
    even = (s.view(np.int64) & 1) == 0
    with np.errstate(invalid="ignore"):
        s = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def ref_bf16_mmvf(w_bits: np.ndarray, x: np.ndarray, rows: int = 1024) -> np.ndarray:
    """Y [1, N] as llama.cpp multiplies a BF16 matrix (its bits, uint16 [N, K]) by one fp32 activation row
    (`mul_mat_vec_f`): thread t of a row's block of bs threads keeps a float sum, fmaf(w, x, sum) over the values
    of pairs t, t + bs, ... (bf16 widens exactly); then the block's butterflies, as for F16."""
    w_bits = np.asarray(w_bits, np.uint16)
    n, k = w_bits.shape
    x = _mmvf_row(x, k, "ref_bf16_mmvf")
    bs = mmvf_block_size(k)
    steps = -(-(k // 2) // bs)
    xp = np.zeros(steps * bs * 2, np.float32)
    xp[:k] = x
    xp = xp.reshape(steps, bs, 2)
    out = np.empty(n, np.float32)
    for r0 in range(0, n, rows):
        wp = np.zeros((min(rows, n - r0), steps * bs * 2), np.uint32)
        wp[:, :k] = w_bits[r0:r0 + rows]
        wp = (wp << 16).view(np.float32).reshape(-1, steps, bs, 2)
        acc = np.zeros(wp.shape[:1] + (bs,), np.float32)
        for i in range(steps):  # past K: fma(0, 0, sum) == sum
            acc = fma_f32(wp[:, i, :, 0], xp[i, :, 0], acc)
            acc = fma_f32(wp[:, i, :, 1], xp[i, :, 1], acc)
        out[r0:r0 + rows] = _mmvf_block_sum(acc)
    return out[None]


def ref_f32_terms(w: np.ndarray, x: np.ndarray) -> Terms:
    """The terms of a float product: |x_i * w_i|, K of them an output."""
    return Terms(np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T, x.shape[1])


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    y64, r64 = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    denom = float(np.sum(r64 * r64))
    return float(np.sum((y64 - r64) ** 2) / denom) if denom else float(np.sum(y64 * y64))
