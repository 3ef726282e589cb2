"""The grouped formats (K-quants, IQ4_NL / IQ4_XS, MXFP4): their blocks decoded to the integers and group scales
llama.cpp's CUDA dot products multiply, and valid random blocks of each (gguf cannot quantize most of them).

Every one of these formats is, to llama.cpp's dot products with Q8_1, integer values q with a scale per group
of 16 or 32 values and, for Q2_K / Q4_K / Q5_K, a minimum per group.  The two formulas take them differently
(docs/formats.md and its reports say which of llama.cpp's functions each mirrors):

* MMVQ (`vecdotq.cuh`, M <= 8): y = Σ_groups d_a * (scale * sumi + coef * Σq_a), all in float; scale and coef
  are exact products of the block's fields (d*sc, -dmin*m, 2^(e-127)/2...), Σq_a the group's integer sum of
  activation quants (`dp4a(0x01010101, u)`), not the block's float sum s_a.
* MMQ (`mmq.cuh`, `mmq-load-tiles.cuh`, M > 8): y = Σ_groups d_a * mmq_scale * sumi + mmq_min * S, where
  Q4_K / Q5_K round (d*sc, -dmin*m) to half (`dm * make_half2(sc, m)`) and S is the block's half sum s_a
  (layout DS4); Q2_K rounds (d*sc, dmin*m) to half and reads its D2S6 activations (`quantize_q8_1_d2s6`);
  Q3_K / Q6_K / IQ4 / MXFP4 have no min and keep their scales in float (layout D4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from kernels.formats import FORMATS

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # E2M1 values times 2

@dataclass(frozen=True)
class GroupWeights:
    """A matrix of a grouped format as the two formulas read it (float64 arrays are exact values).

    q int8 [N, K] (int16 in mmq's two-digit tiles, `mmq_weights`): the integers of the dot products (unsigned
    0..3 / 0..15 / 0..31 for the formats with a min, signed otherwise); scale, coef [N, K/group]: MMVQ's per-group
    scale and the factor of d_a*Σq_a (None: no min); mmq_scale, mmq_min: MMQ's (mmq_min multiplies the
    activations' group sum S)."""

    type_name: str
    q: np.ndarray
    group: int
    scale: np.ndarray
    coef: np.ndarray | None
    mmq_scale: np.ndarray
    mmq_min: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.coef, self.mmq_scale, self.mmq_min) if a is not None)


def _half(v: np.ndarray) -> np.ndarray:
    """A product rounded to half, as `__hmul2` does, back in float64."""
    with np.errstate(over="ignore"):
        return np.asarray(v, np.float64).astype(np.float16).astype(np.float64)


def _f64(h: np.ndarray) -> np.ndarray:
    return np.asarray(h, np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes to 32 values: byte j's low nibble is value j, its high nibble value j + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes to 8 six-bit scales and 8 mins (get_scale_min_k4)."""
    s = scales.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes to 16 six-bit scales minus 32: low 4 bits from bytes i%8 (nibble i/8), high 2 from 8 + i%4."""
    s = scales.astype(np.int32)
    i = np.arange(16)
    low = (s[..., i % 8] >> (4 * (i // 8))) & 0xF
    high = (s[..., 8 + i % 4] >> (2 * (i // 4))) & 3
    return (low | (high << 4)) - 32


# ---- one class per format: its block (llama.cpp's block_<type>, ggml-common.h, field by field), the order
# groups.cuh's decoders take its field planes in (p0, p1, ...), its decode, and its valid random blocks
class GroupedFormat:
    """A grouped format's Python side, as gguf-py's quants.py keeps one class per format."""

    name: str
    dtype: np.dtype
    planes: tuple[str | tuple[str, ...], ...]  # a tuple: adjacent fields kept together (one load for all)
    # gemv.cu's skinny MMA takes its products of skinny_min_m..8 rows (launch.py takes_skinny; 0: none; gemv_groups
    # the rest): a code book's 16 bytes of nibbles a 32-value block in plane p0 with the scales in p1 (SkinnyCodes),
    # or a K-quant's value fields `skinny_runs` (low bits, then high bits: the runs a stage copies) and scale fields
    # `skinny_scales` (copied into each stage by its producer warp; SkinnyGroups).
    # The row counts from which it is the faster, H100, N = 4096, K = 4096 and 14336 (kernels-at-the-limit.md, fifth
    # and sixth sessions): IQ4_NL, IQ4_XS, MXFP4 5; Q5_K 4; Q4_K 5 (4 at K = 14336); Q3_K and Q6_K 6 (5 at 14336).
    skinny_min_m = 0
    # a code book's nibble field: its plane holds them as paired_nibbles packs them (what groups.cuh's lookup16x8 reads)
    code_plane: str | None = None
    skinny_runs: tuple[str, ...] = ()
    skinny_scales: tuple[str, ...] = ()
    # mmq (mmq.cuh, M > 8) multiplies a format with a scale per 16 values as two k16 MMAs a block, each scaled in
    # fp32 (H = 2), unless its integer scales fold into int8 values: then one k32 MMA and one scale a block
    # (`mmq_folded`), half the epilogue.  Where the folded values take two int8 digits (`mmq_digits` 2: Q6_K),
    # mmq keeps the two k16 MMAs and mmq_d2 takes the fold: two k32 MMAs and three FFMAs an output and block
    # instead of four, for twice the weight bytes (layouts.py MMQ_D2 splits them).
    mmq_folds = False
    mmq_digits = 1

    def mmq_folded(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values [.., K] with the integer group scales folded in, int8 or, for two digits, int16; their scale
        per 32 values)."""
        sc, d = self.mmq_fold_scales(b)
        q = self.decode(b)[0].reshape(*b.shape, 16, 16).astype(np.int16)
        folded = (q * sc.astype(np.int16)[..., None]).astype(np.int8 if self.mmq_digits == 1 else np.int16)
        return folded.reshape(*b.shape[:-1], -1), np.repeat(d[..., None], 8, axis=-1).reshape(*b.shape[:-1], -1)

    def mmq_fold_scales(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the integer scales [.., 16] a folding format multiplies into its values, the float scale a
        super-block [..] left), their product being MMQ's scale."""
        raise NotImplementedError

    @property
    def skinny(self) -> bool:
        return self.skinny_min_m > 0

    def skinny_run_bytes(self) -> tuple[int, ...]:
        """Bytes a super-block of each `skinny_runs` field (gemv.cu's T::QS_BYTES, T::HI_BYTES)."""
        return tuple(self.dtype[f].itemsize for f in self.skinny_runs)

    def skinny_scale_bytes(self) -> int:
        """Bytes a super-block of the `skinny_scales` fields (groups.cuh's T::scale_bytes, summed)."""
        return sum(self.dtype[f].itemsize for f in self.skinny_scales)

    def decode(self, b: np.ndarray) -> tuple:
        """Structured blocks [N, blocks] to (q, scale, coef, mmq_scale, mmq_min) (coef, mmq_min None: no min)."""
        raise NotImplementedError

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        """Set the float fields of uniformly random blocks so that values are about `scale` in size."""
        raise NotImplementedError

    @staticmethod
    def halves(b: np.ndarray, rng: np.random.Generator, typical: float) -> np.ndarray:
        shape = b.shape
        return (rng.uniform(0.5, 1.5, shape) * typical * rng.choice([-1.0, 1.0], shape)).astype(np.float16)


class Q2K(GroupedFormat):
    name, planes = "Q2_K", ("qs", "scales", "d", "dmin")
    dtype = np.dtype([("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")])

    def decode(self, b: np.ndarray) -> tuple:
        shift = 2 * np.arange(4).reshape(1, 4, 1)
        q = (b["qs"].reshape(*b.shape, 2, 1, 32) >> shift) & 3  # [.., half n, shift j, l]: value 128n + 32j + l
        sc, mn = b["scales"] & 0xF, b["scales"] >> 4  # per 16 values, in value order
        d, dmin = _f64(b["d"])[..., None], _f64(b["dmin"])[..., None]
        return q, d * sc, -(dmin * mn), _half(d * sc), -_half(dmin * mn)

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = np.abs(self.halves(b, rng, 2 * scale / (15 * 3)))  # d*sc*q reaches 15 * 3 units of d
        b["dmin"] = np.abs(self.halves(b, rng, scale / 15))


class Q3K(GroupedFormat):
    name, planes = "Q3_K", ("qs", "hmask", "scales", "d")
    skinny_min_m, skinny_runs, skinny_scales = 6, ("qs", "hmask"), ("scales", "d")
    dtype = np.dtype([("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")])

    def decode(self, b: np.ndarray) -> tuple:
        j = np.arange(4).reshape(1, 4, 1)
        low = (b["qs"].reshape(*b.shape, 2, 1, 32) >> (2 * j)) & 3
        high = (b["hmask"].reshape(*b.shape, 1, 1, 32) >> (4 * np.arange(2).reshape(2, 1, 1) + j)) & 1
        q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
        scale = _f64(b["d"])[..., None] * _q3_k_scales(b["scales"])
        return q, scale, None, scale, None

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = self.halves(b, rng, scale / (32 * 4))

    # q in -4..3 times sc in -32..31 is -124..128, so -(q sc) is an int8 (-128..124) with scale -d: the sum of
    # a block's two halves, sc_0 sumi_0 + sc_1 sumi_1, exact in the MMA's int32 (|.| <= 32 * 128 * 127)
    mmq_folds = True

    def mmq_fold_scales(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return -_q3_k_scales(b["scales"]), -_f64(b["d"])


class Q4K(GroupedFormat):
    name, planes = "Q4_K", ("qs", "scales", "d", "dmin")
    skinny_min_m, skinny_runs, skinny_scales = 5, ("qs",), ("scales", "d", "dmin")
    dtype = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
    top = 63 * 15  # d*sc*q reaches this many units of d

    def quants(self, b: np.ndarray) -> np.ndarray:
        return (b["qs"].reshape(*b.shape, 4, 1, 32) >> (4 * np.arange(2).reshape(1, 2, 1))) & 0xF  # sub-block 2p + hi

    def decode(self, b: np.ndarray) -> tuple:
        sc, mn = scale_min_k4(b["scales"])
        d, dmin = _f64(b["d"])[..., None], _f64(b["dmin"])[..., None]
        return self.quants(b), d * sc, -(dmin * mn), _half(d * sc), _half(-(dmin * mn))

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = np.abs(self.halves(b, rng, 2 * scale / self.top))
        b["dmin"] = np.abs(self.halves(b, rng, scale / 63))


class Q5K(Q4K):
    name, planes = "Q5_K", ("qs", "scales", "d", "dmin", "qh")
    skinny_min_m, skinny_runs = 4, ("qs", "qh")
    dtype = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)])
    top = 63 * 31

    def quants(self, b: np.ndarray) -> np.ndarray:
        return super().quants(b) | (((b["qh"].reshape(*b.shape, 1, 1, 32) >> np.arange(8).reshape(4, 2, 1)) & 1) << 4)


class Q6K(GroupedFormat):
    name, planes = "Q6_K", ("ql", "qh", "scales", "d")
    skinny_min_m, skinny_runs, skinny_scales = 6, ("ql", "qh"), ("scales", "d")
    dtype = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])

    def decode(self, b: np.ndarray) -> tuple:
        ql = b["ql"].reshape(*b.shape, 2, 1, 2, 32)  # [.., n, nibble, half of ql_n, l]
        qh = b["qh"].reshape(*b.shape, 2, 1, 1, 32)
        quarter = np.arange(4).reshape(2, 2, 1)  # value 128n + 32*quarter + l: quarter = 2*nibble + half
        low = (ql >> (4 * np.arange(2).reshape(2, 1, 1))) & 0xF
        q = (low | (((qh >> (2 * quarter)) & 3) << 4)).astype(np.int16) - 32
        scale = _f64(b["d"])[..., None] * b["scales"].astype(np.float64)
        return q, scale, None, scale, None

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = self.halves(b, rng, scale / (128 * 32))

    # q in -32..31 times sc in -128..127 is -4064..4096: two int8 digits (128 hi + lo) with scale d, the block's
    # two halves summed exactly in the MMAs' int32 (mmq.cuh D = 2); llama.cpp's scales are the float d*sc (exact)
    mmq_folds, mmq_digits = True, 2

    def mmq_fold_scales(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return b["scales"], _f64(b["d"])


class IQ4NL(GroupedFormat):
    name, planes = "IQ4_NL", ("qs", "d")
    code_plane = "qs"
    skinny_min_m = 5
    dtype = np.dtype([("d", "<f2"), ("qs", "u1", 16)])

    def decode(self, b: np.ndarray) -> tuple:
        scale = _f64(b["d"])[..., None]
        return KVALUES_IQ4NL[_nibbles(b["qs"])], scale, None, scale, None

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = self.halves(b, rng, scale / 127)


class IQ4XS(GroupedFormat):
    name, planes = "IQ4_XS", ("qs", ("d", "scales_h", "scales_l"))
    code_plane = "qs"
    skinny_min_m = 5
    dtype = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", 128)])

    @staticmethod
    def scales(b: np.ndarray) -> np.ndarray:
        """The 8 sub-blocks' 6-bit scales ls of each block (int32 [..., 8]; the scale is d * (ls - 32))."""
        ib = np.arange(8)
        return ((b["scales_l"][..., ib // 2].astype(np.int32) >> (4 * (ib % 2))) & 0xF) | \
            (((b["scales_h"][..., None].astype(np.int32) >> (2 * ib)) & 3) << 4)

    def decode(self, b: np.ndarray) -> tuple:
        q = KVALUES_IQ4NL[_nibbles(b["qs"].reshape(*b.shape, 8, 16))]
        scale = _f64(b["d"])[..., None] * (self.scales(b) - 32)
        return q, scale, None, scale, None

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        b["d"] = self.halves(b, rng, scale / (32 * 127))


class MXFP4(GroupedFormat):
    name, planes = "MXFP4", ("qs", "e")
    code_plane = "qs"
    skinny_min_m = 5
    dtype = np.dtype([("e", "u1"), ("qs", "u1", 16)])

    def decode(self, b: np.ndarray) -> tuple:
        scale = np.ldexp(0.5, b["e"].astype(np.int32) - 127)[..., None]  # e8m0 * 0.5 (e = 0: 2^-127)
        return KVALUES_MXFP4[_nibbles(b["qs"])], scale, None, scale, None

    def randomize(self, b: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        centre = 127 + int(np.round(np.log2(scale / 6)))  # 2^(e-127) * 6 about `scale`: e within a few octaves
        b["e"] = rng.integers(centre - 3, centre + 4, b.shape).astype(np.uint8)


def _fields(plane: str | tuple[str, ...]) -> tuple[str, ...]:
    return plane if isinstance(plane, tuple) else (plane,)


GROUPED: dict[str, GroupedFormat] = {f.name: f for f in (Q2K(), Q3K(), Q4K(), Q5K(), Q6K(), IQ4NL(), IQ4XS(), MXFP4())}
# the formats whose folded values take two int8 digits: what mmq.cu's mmq_d2 multiplies
MMQ_D2_TYPES: tuple[str, ...] = tuple(t for t, f in GROUPED.items() if f.mmq_folds and f.mmq_digits == 2)
for _f in GROUPED.values():
    assert sorted(_field for _p in _f.planes for _field in _fields(_p)) == sorted(_f.dtype.names), _f.name
    assert _f.dtype.itemsize == FORMATS[GGMLQuantizationType[_f.name]].block_bytes, _f.name
    assert FORMATS[GGMLQuantizationType[_f.name]].grouped, _f.name


def grouped(type_name: str) -> GroupedFormat:
    f = GROUPED.get(type_name)
    if f is None:
        raise ValueError(f"{type_name} is not a grouped format")
    return f


def blocks_of(type_name: str, raw: np.ndarray) -> np.ndarray:
    """Raw GGUF rows (uint8 [N, row_bytes]) as structured blocks [N, K/values]."""
    raw = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8))
    return raw.reshape(raw.shape[0], -1).view(grouped(type_name).dtype)


def decode(type_name: str, raw: np.ndarray) -> GroupWeights:
    fmt = grouped(type_name)
    b = blocks_of(type_name, raw)
    n = b.shape[0]
    q, scale, coef, mmq_scale, mmq_min = fmt.decode(b)

    def flat(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(np.asarray(a, np.float64).reshape(n, -1))

    group = FORMATS[GGMLQuantizationType[type_name]].group_values
    return GroupWeights(type_name, np.ascontiguousarray(np.asarray(q).astype(np.int8).reshape(n, -1)), group,
                        flat(scale), flat(coef), flat(mmq_scale), flat(mmq_min))  # type: ignore[arg-type]


def mmq_weights(type_name: str, raw: np.ndarray, digits: int = 1) -> GroupWeights:
    """What mmq's tiles of `digits` int8 digits a value hold: `decode`'s values and MMQ scales, or where the
    format folds its integer scales into values of that many digits (`mmq_folds`, `mmq_digits`), those with a
    scale per 32 values (the MMVQ fields then unused: None)."""
    if not mmq_weights_fold(type_name, digits):
        return decode(type_name, raw)
    fmt = grouped(type_name)
    q, d = fmt.mmq_folded(blocks_of(type_name, raw))
    return GroupWeights(type_name, np.ascontiguousarray(q), 32, None, None, d, None)  # type: ignore[arg-type]


def int8_digits(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integers |q| <= 128 * 127 + 63 as two int8 digits (lo in -64..63, hi): q = 128 hi + lo."""
    q = np.asarray(q, np.int32)
    lo = ((q + 64) & 127) - 64
    hi = (q - lo) >> 7
    if hi.size and (hi.min() < -128 or hi.max() > 127):
        raise ValueError("values past two int8 digits")
    return lo.astype(np.int8), hi.astype(np.int8)


def mmq_scales_a_block(type_name: str, digits: int = 1) -> int:
    """Weight scales a 32-value block of mmq's tiles of `digits` digits (mmq.cuh's H): 2 for a scale per 16
    values, unless folded."""
    fmt = FORMATS[GGMLQuantizationType[type_name]]
    return 2 if fmt.group_values == 16 and not mmq_weights_fold(type_name, digits) else 1


def mmq_weights_fold(type_name: str, digits: int = 1) -> bool:
    """Whether mmq's tiles of `digits` int8 digits a value hold the format's folded values (`mmq_weights`)."""
    fmt = GROUPED.get(type_name)
    return fmt is not None and fmt.mmq_folds and fmt.mmq_digits <= digits


def dequantize(w: GroupWeights) -> np.ndarray:
    """float64 [N, K] from the decoded fields: scale*q + coef (what gguf's dequantize computes, in float64)."""
    n, k = w.q.shape
    v = w.q.reshape(n, -1, w.group).astype(np.float64) * w.scale[..., None]
    if w.coef is not None:
        v += w.coef[..., None]
    return v.reshape(n, k)


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """GGUF rows (uint8 [N, row_bytes]) of random blocks: every quant and sub-scale byte uniform (so every code
    occurs), the float fields finite and chosen so that values are about `scale` in size."""
    fmt, bf = FORMATS[GGMLQuantizationType[type_name]], grouped(type_name)
    nb = k // fmt.block_values
    b = np.frombuffer(rng.integers(0, 256, n * nb * fmt.block_bytes, dtype=np.uint8).tobytes(),
                      bf.dtype).reshape(n, nb).copy()
    bf.randomize(b, rng, scale)
    return np.ascontiguousarray(b).view(np.uint8).reshape(n, nb * fmt.block_bytes)


def paired_nibbles(qs: np.ndarray) -> np.ndarray:
    """A code book's nibble bytes, 16 a 32-value block (GGUF's order: byte l holds value l low and l + 16 high),
    as groups.cuh's lookup16x8 reads them: in word i of a block, nibbles 0-3 are values 4i..4i+3 and nibbles 4-7
    values 16+4i..16+4i+3, the values that pair with the activations' words i and i + 4 as looked up."""
    c = np.concatenate([qs.reshape(-1, 16) & 0xF, qs.reshape(-1, 16) >> 4], axis=1)  # [blocks, 32] in value order
    c = c.reshape(-1, 2, 4, 2, 2).transpose(0, 2, 1, 3, 4)  # [block, word i, half, byte of the half, nibble]
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8).reshape(qs.shape)


def field_planes(type_name: str, raw: np.ndarray) -> list[np.ndarray]:
    """The blocks' fields, each as one contiguous byte array, in the format's `planes` order (the gemv layout); a
    plane of several fields holds their bytes together, block after block (the fields are adjacent in the block);
    a code book's nibbles paired as its lookup reads them."""
    fmt = grouped(type_name)
    b = blocks_of(type_name, raw).reshape(-1)
    rows = b.view(np.uint8).reshape(b.size, -1)
    planes = []
    for plane in fmt.planes:
        names = _fields(plane)
        start = b.dtype.fields[names[0]][1]
        end = b.dtype.fields[names[-1]][1] + b.dtype.fields[names[-1]][0].itemsize
        assert end - start == sum(b.dtype.fields[f][0].itemsize for f in names), (type_name, plane)  # adjacent
        p = np.ascontiguousarray(rows[:, start:end]).reshape(-1)
        planes.append(paired_nibbles(p) if plane == fmt.code_plane else p)
    return planes
