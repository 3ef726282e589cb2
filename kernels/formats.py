"""The table of GGML block formats qgemm knows.

One row per format: how many values a block holds, how many bytes it takes, and whether qgemm
can multiply weights stored in it.  Everything else (the store's `matmul` flag, the kernels'
weight types, the byte arithmetic of uploads) reads this table rather than repeating numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK = 32  # values per block for Q4_0, Q8_0, Q4_1 and Q8_1


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: GGMLQuantizationType
    block_values: int
    block_bytes: int
    matmul: bool  # weights of this type can be multiplied
    layout: str   # one line: what a block holds
    offset: int = 0  # unsigned quants: x = d*(q - offset); llama.cpp's dot with Q8_1 takes it back as offset*s_a
    # the activation-scale layout llama.cpp's MMQ (tensor cores, mmq.cuh) quantizes X into for these weights:
    # "D4" keeps each block's d_a in float, "DS4" stores (d_a, s_a) as half2 (its formula reads d_a as a half)
    mmq_ds_layout: str = ""

    @property
    def uses_activation_sum(self) -> bool:
        """Whether its dot product with Q8_1 reads the activations' block sum s_a (then s_a must fit in half)."""
        return self.offset != 0

    def row_bytes(self, k: int) -> int:
        return k // self.block_values * self.block_bytes


def _fmt(t: GGMLQuantizationType, matmul: bool, layout: str, nbytes: int | None = None, offset: int = 0,
         mmq_ds_layout: str = "") -> BlockFormat:
    values, table_bytes = GGML_QUANT_SIZES[t]
    return BlockFormat(t.name, t, values, nbytes or table_bytes, matmul, layout, offset, mmq_ds_layout)


FORMATS: dict[GGMLQuantizationType, BlockFormat] = {
    f.ggml_type: f
    for f in (
        _fmt(GGMLQuantizationType.Q4_0, True,
             "half d; 16 bytes of nibbles: byte j holds q[j] (low) and q[j+16] (high); x = d*(q-8)", offset=8,
             mmq_ds_layout="DS4"),
        _fmt(GGMLQuantizationType.Q8_0, True, "half d; 32 int8 q; x = d*q", mmq_ds_layout="D4"),
        _fmt(GGMLQuantizationType.Q8_1, False,
             "half2 ds = (d, sum of the original x); 32 int8 q; x = d*q (activations only)",
             nbytes=36),  # llama.cpp's CUDA block_q8_1; gguf-py's table lists an older 40-byte one
        _fmt(GGMLQuantizationType.Q4_1, False, "half d, half m; 16 bytes of nibbles; x = d*q + m"),
        _fmt(GGMLQuantizationType.F16, False, "one half per value"),
        _fmt(GGMLQuantizationType.F32, False, "one float per value"),
    )
}

MATMUL_TYPES: frozenset[str] = frozenset(f.name for f in FORMATS.values() if f.matmul)


def mmq_ds_layout(type_name: str) -> str:
    """The MMQ activation-scale layout for weights of this type ("D4" or "DS4")."""
    fmt = format_of(type_name)
    if fmt is None or not fmt.mmq_ds_layout:
        raise ValueError(f"llama.cpp's MMQ has no formula for {type_name} here")
    return fmt.mmq_ds_layout


def format_of(type_name: str) -> BlockFormat | None:
    try:
        return FORMATS.get(GGMLQuantizationType[type_name])
    except KeyError:
        return None
