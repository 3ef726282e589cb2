"""The table of GGML block formats qgemm knows.

One row per format: how many values a block holds, how many bytes it takes, and whether qgemm
can multiply weights stored in it.  Everything else (the store's `matmul` flag, the kernels'
weight types, the byte arithmetic of uploads) reads this table rather than repeating numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK = 32  # values per block of every legacy format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and of Q8_1


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: GGMLQuantizationType | None  # None: not a GGUF type (bitsandbytes' NF4/FP4, made at upload)
    block_values: int
    block_bytes: int
    matmul: bool  # weights of this type can be multiplied
    layout: str   # one line: what a block holds
    offset: int = 0  # unsigned quants: x = d*(q - offset); llama.cpp's dot with Q8_1 takes it back as offset*s_a
    has_min: bool = False  # x = d*q + m: the dot with Q8_1 adds m_w*s_a per block
    fifth_bits: bool = False  # a uint32 qh after the header halves: bit j is q[j]'s fifth bit (5-bit formats)
    # llama.cpp's MMVQ multiplies (d_w, m_w) by (d_a, s_a) as half2 (`__hmul2`, FAST_FP16 on sm_60+):
    # both products rounded to half before they scale sumi and are added (vec_dot_q4_1/q5_1_q8_1_impl)
    mmvq_half_products: bool = False
    # the activation-scale layout llama.cpp's MMQ (tensor cores, mmq.cuh) quantizes X into for these weights:
    # "D4" keeps each block's d_a in float, "DS4" stores (d_a, s_a) as half2 (its formula reads d_a as a half),
    # "D2S6" (Q2_K) a half d_a per 64 values and half sums of 16 for the first 96 of every 128
    mmq_ds_layout: str = ""
    is_float: bool = False  # F32/F16/BF16: values, not blocks; multiplied as floats (no Q8_1)
    # float matrices: the formula llama.cpp computes them with (measured against ggml, docs/formats.md) at M = 1
    # (mul_mat_vec_f; F16's sums half2 FMAs), at the shapes its tensor-core mul_mat_f takes (registry.ggml_mmf:
    # activations rounded to the weights' type, fp32 sums), and elsewhere (cuBLAS: F16 in half, `f16_h`)
    float_formulas: tuple[str, str, str] = ("f32", "f32", "f32")
    # grouped formats (K-quants, IQ4_NL/IQ4_XS, MXFP4; kernels/groups.py decodes them): integer values with a
    # weight scale per group of this many values (16 or 32); 0 for the legacy formats above
    group_values: int = 0
    group_min: bool = False  # x = scale*q - min per group: MMVQ takes min*d_a*Σq_a, MMQ min*s_a (DS4, D2S6)
    # bitsandbytes' 4-bit formats (kernels/bnb4.py): a code book value times a float absmax per block of
    # `blocksize` values over the flattened matrix (block_values is the default, 64); float activations
    bnb4: bool = False

    @property
    def grouped(self) -> bool:
        return self.group_values > 0

    @property
    def header_halves(self) -> int:
        """Halves a block starts with: d, or d and m."""
        return 2 if self.has_min else 1

    @property
    def qs_bytes(self) -> int:
        """Bytes of quants a legacy block ends with: 16 of nibbles or 32 of int8."""
        return self.block_bytes - 2 * self.header_halves - (4 if self.fifth_bits else 0)

    @property
    def uses_activation_sum(self) -> bool:
        """Whether its dot product with Q8_1 reads the activations' block sum s_a (then s_a must fit in half)."""
        return self.offset != 0 or self.has_min or self.group_min

    @property
    def quantizes_activations(self) -> bool:
        """Whether llama.cpp multiplies it with Q8_1 activations (block formats) or in floats."""
        return self.matmul and not self.is_float and not self.bnb4

    @property
    def whole_block_rows(self) -> bool:
        """Whether a row must be whole blocks (GGUF formats; bitsandbytes' blocks run over the flat matrix)."""
        return not self.is_float and not self.bnb4

    def row_bytes(self, k: int) -> int:
        return k // self.block_values * self.block_bytes


def _fmt(t: GGMLQuantizationType, matmul: bool, layout: str, nbytes: int | None = None, **kw: object) -> BlockFormat:
    values, table_bytes = GGML_QUANT_SIZES[t]
    return BlockFormat(t.name, t, values, nbytes or table_bytes, matmul, layout, **kw)  # type: ignore[arg-type]


T = GGMLQuantizationType
NIBBLES = "16 bytes of nibbles: byte j holds q[j] (low) and q[j+16] (high)"
FIFTH_BITS = "uint32 qh: bit j is q[j]'s fifth bit"
FORMATS: dict[GGMLQuantizationType, BlockFormat] = {
    f.ggml_type: f
    for f in (
        _fmt(T.Q4_0, True, f"half d; {NIBBLES}; x = d*(q-8)", offset=8, mmq_ds_layout="DS4"),
        _fmt(T.Q4_1, True, f"half d, half m; {NIBBLES}; x = d*q + m", has_min=True, mmvq_half_products=True,
             mmq_ds_layout="DS4"),
        _fmt(T.Q5_0, True, f"half d; {FIFTH_BITS}; {NIBBLES} (low 4 bits); x = d*(q-16)", offset=16,
             fifth_bits=True, mmq_ds_layout="D4"),
        _fmt(T.Q5_1, True, f"half d, half m; {FIFTH_BITS}; {NIBBLES} (low 4 bits); x = d*q + m", has_min=True,
             fifth_bits=True, mmvq_half_products=True, mmq_ds_layout="DS4"),
        _fmt(T.Q8_0, True, "half d; 32 int8 q; x = d*q", mmq_ds_layout="D4"),
        _fmt(T.Q8_1, False, "half2 ds = (d, sum of the original x); 32 int8 q; x = d*q (activations only)",
             nbytes=36),  # llama.cpp's CUDA block_q8_1; gguf-py's table lists an older 40-byte one
        # grouped formats: llama.cpp's MMQ activation layouts from mmq_get_q8_1_ds_layout (mmq.cuh)
        _fmt(T.Q2_K, True, "256 values: 16 bytes of 4-bit scale and min per 16, 64 bytes of 2-bit q, half d, half "
             "dmin; x = d*sc*q - dmin*m", group_values=16, group_min=True, mmq_ds_layout="D2S6"),
        _fmt(T.Q3_K, True, "256 values: 32 bytes of high bits, 64 of 2-bit q, 12 of 6-bit scales per 16, half d; "
             "x = d*(sc-32)*(q-4 if its high bit is clear else q)", group_values=16, mmq_ds_layout="D4"),
        _fmt(T.Q4_K, True, "256 values: half d, half dmin, 12 bytes of 6-bit scales and mins per 32, 128 bytes of "
             "nibbles; x = d*sc*q - dmin*m", group_values=32, group_min=True, mmq_ds_layout="DS4"),
        _fmt(T.Q5_K, True, "256 values: Q4_K's fields and 32 bytes of fifth bits; x = d*sc*q - dmin*m (q 0..31)",
             group_values=32, group_min=True, mmq_ds_layout="DS4"),
        _fmt(T.Q6_K, True, "256 values: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales per 16, half "
             "d; x = d*sc*(q-32)", group_values=16, mmq_ds_layout="D4"),
        _fmt(T.IQ4_NL, True, f"half d; {NIBBLES}; x = d*kvalues_iq4nl[q] (a non-linear code book)",
             group_values=32, mmq_ds_layout="D4"),
        _fmt(T.IQ4_XS, True, "256 values: half d, 6-bit scales per 32 (uint16 of high bits, 4 bytes of low), 128 "
             "bytes of nibbles; x = d*(ls-32)*kvalues_iq4nl[q]", group_values=32, mmq_ds_layout="D4"),
        _fmt(T.MXFP4, True, f"uint8 e (E8M0); {NIBBLES}; x = 2^(e-127) * E2M1 value of q",
             group_values=32, mmq_ds_layout="D4"),
        _fmt(T.F32, True, "one float per value", is_float=True),
        _fmt(T.F16, True, "one half per value", is_float=True, float_formulas=("f16_mmvf", "f16", "f16_h")),
        _fmt(T.BF16, True, "one bfloat16 per value", is_float=True, float_formulas=("f32", "bf16", "bf16")),
    )
}

# bitsandbytes' formats: never stored in a GGUF file, made from a tensor's values at upload (kernels/requant.py)
BNB4_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("NF4", None, 64, 36, True, "per block of 64 (32..4096) values a float32 absmax; 4-bit codes, "
                    "two a byte (first high); x = absmax * NF4[q] (quantiles of N(0, 1))", bnb4=True),
        BlockFormat("FP4", None, 64, 36, True, "per block of 64 (32..4096) values a float32 absmax; 4-bit codes, "
                    "two a byte (first high); x = absmax * FP4[q] (E2M1 with bias 2, divided by 12)", bnb4=True),
    )
}
BNB4_TYPES: tuple[str, ...] = tuple(BNB4_FORMATS)

# what a matrix can be multiplied in: a stored type, or bitsandbytes' formats it was requantized to
MATMUL_TYPES: frozenset[str] = frozenset(f.name for f in (*FORMATS.values(), *BNB4_FORMATS.values()) if f.matmul)
QUANT_TYPES: tuple[str, ...] = tuple(f.name for f in FORMATS.values() if f.quantizes_activations)  # Q8_1 dots
# llama.cpp's MMQ multiplies these as signed int8 (q - offset) with one scale per 32 values (vec_dot_q8_0_q8_1_mma)
MMQ_SIGNED_TYPES: tuple[str, ...] = tuple(
    t for t in QUANT_TYPES if (f := FORMATS[GGMLQuantizationType[t]]).mmq_ds_layout in ("D4", "DS4")
    and not f.has_min and not f.group_min and f.group_values in (0, QK))
LEGACY_TYPES: tuple[str, ...] = tuple(t for t in QUANT_TYPES if not FORMATS[GGMLQuantizationType[t]].grouped)
GROUPED_TYPES: tuple[str, ...] = tuple(t for t in QUANT_TYPES if FORMATS[GGMLQuantizationType[t]].grouped)
FLOAT_TYPES: tuple[str, ...] = tuple(f.name for f in FORMATS.values() if f.matmul and f.is_float)


def mmq_ds_layout(type_name: str) -> str:
    """The MMQ activation-scale layout for weights of this type ("D4", "DS4" or Q2_K's "D2S6")."""
    fmt = format_of(type_name)
    if fmt is None or not fmt.mmq_ds_layout:
        raise ValueError(f"llama.cpp's MMQ has no formula for {type_name} here")
    return fmt.mmq_ds_layout


def format_of(type_name: str) -> BlockFormat | None:
    if type_name in BNB4_FORMATS:
        return BNB4_FORMATS[type_name]
    try:
        return FORMATS.get(GGMLQuantizationType[type_name])
    except KeyError:
        return None
