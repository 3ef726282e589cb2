"""Weights in another format than the file's: a tensor's values (gguf's dequantization) requantized at
upload, to a GGUF block format with gguf's quantizer or to bitsandbytes' NF4/FP4 (kernels/bnb4.py).

A `Scheme` names the target; its `tag` keys every cache (CPU and GPU) beside the tensor, so that each
scheme of a tensor is made once and kept like any other layout.  `compare` is the side-by-side view:
every scheme's error on the same values and its bits per weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants

from kernels import bnb4
from kernels.formats import FORMATS

GGUF_TARGETS = ("q4_0", "q4_1", "q5_0", "q8_0")  # what gguf-py's numpy quantizer writes
BNB4_TARGETS = ("nf4", "fp4")
TARGETS = (*GGUF_TARGETS, *BNB4_TARGETS)
WEIGHT_FORMATS = ("gguf", *TARGETS)  # "gguf": the file's own bytes


@dataclass(frozen=True)
class Scheme:
    format: str  # one of TARGETS
    blocksize: int = bnb4.DEFAULT_BLOCKSIZE  # bitsandbytes' formats only
    double_quant: bool = False

    def __post_init__(self) -> None:
        if self.format not in TARGETS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, not {self.format!r}")
        if self.format in BNB4_TARGETS:
            if self.blocksize not in bnb4.BLOCKSIZES:
                raise ValueError(f"blocksize must be one of {', '.join(map(str, bnb4.BLOCKSIZES))}, "
                                 f"not {self.blocksize}")
        elif self.blocksize != bnb4.DEFAULT_BLOCKSIZE or self.double_quant:
            raise ValueError(f"blocksize and double_quant apply to nf4 and fp4 only, not {self.format}")

    @property
    def type_name(self) -> str:
        return self.format.upper()

    @property
    def tag(self) -> str:
        if self.format in GGUF_TARGETS:
            return self.format
        return f"{self.format}-b{self.blocksize}" + ("-dq" if self.double_quant else "")

    def k_reason(self, k: int) -> str | None:
        """Why a matrix of K columns cannot take this scheme, or None."""
        if self.format in GGUF_TARGETS:
            values = FORMATS[GGMLQuantizationType[self.type_name]].block_values
            if k % values:
                return f"{self.type_name} rows are whole blocks of {values} values; K={k} is not a multiple"
        return None

    def split_reason(self, k: int) -> str | None:
        """Why this scheme's storage of a [N, K] matrix cannot be cut by rows (each block of rows requantized
        alone equals its rows of the whole), or None."""
        if self.format in BNB4_TARGETS:
            if self.double_quant:
                return "double quantization's absmax offset is the mean over the whole tensor"
            if k % self.blocksize:
                return f"its blocks of {self.blocksize} values cross rows (K={k})"
        return None


def requantize(values: np.ndarray, scheme: Scheme) -> Any:
    """float32 [N, K] in the scheme's storage: GGUF block bytes uint8 [N, row_bytes], or a Bnb4Tensor."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if scheme.format in GGUF_TARGETS:
        return quants.quantize(values, GGMLQuantizationType[scheme.type_name])
    return bnb4.quantize_4bit(values, scheme.format, scheme.blocksize, scheme.double_quant)


def decode(raw: Any, scheme: Scheme) -> np.ndarray:
    """The values a scheme's storage holds, float32 [N, K]."""
    if scheme.format in GGUF_TARGETS:
        return quants.dequantize(raw, GGMLQuantizationType[scheme.type_name]).astype(np.float32, copy=False)
    return bnb4.dequantize_4bit(raw)


def stored_bytes(raw: Any) -> int:
    return int(raw.nbytes)


def error_of(reference: np.ndarray, approx: np.ndarray) -> dict[str, float]:
    """NMSE (squared error over the reference's energy) and the largest absolute error, in float64."""
    ref = reference.astype(np.float64)
    diff = approx.astype(np.float64) - ref
    energy = float((ref * ref).sum())
    return {"nmse": float((diff * diff).sum()) / energy if energy else float((diff * diff).sum()),
            "max_abs_error": float(np.abs(diff).max()) if diff.size else 0.0}


def row_head(s: Scheme) -> dict[str, Any]:
    """What names a scheme in a comparison row."""
    return {"weight_format": s.format, "tag": s.tag, "blocksize": s.blocksize if s.format in BNB4_TARGETS else None,
            "double_quant": s.double_quant}


def compare(values: np.ndarray, schemes: list[Scheme]) -> list[dict[str, Any]]:
    """Each scheme's requantization of the same values: its error against them and its bits per weight
    (schemes whose blocks do not fit the rows are reported with the reason instead)."""
    rows = []
    for s in schemes:
        row = row_head(s)
        reason = s.k_reason(values.shape[1])
        if reason is not None:
            rows.append({**row, "reason": reason})
            continue
        raw = requantize(values, s)
        rows.append({**row, **error_of(values, decode(raw, s)),
                     "bits_per_weight": 8 * stored_bytes(raw) / values.size, "reason": None})
    return rows


def default_schemes(blocksize: int = bnb4.DEFAULT_BLOCKSIZE, double_quant: bool = False) -> list[Scheme]:
    return [*(Scheme(f) for f in GGUF_TARGETS),
            *(Scheme(f, blocksize, double_quant) for f in BNB4_TARGETS)]
