"""A model's tensor as a request multiplies it: as stored or requantized (`Scheme`), whole or a block of rows,
handed to a backend as `Weights`."""

from __future__ import annotations

import dataclasses
from typing import Any

from app.placement import Part
from kernels.errors import InvalidRequest
from kernels.formats import format_of
from kernels.reference import dequantize_weights
from kernels.requant import BNB4_TARGETS, Scheme, requantize
from kernels.types import Weights
from models.store import Model, TensorInfo


def scheme_of(weight_format: str, blocksize: int, double_quant: bool) -> Scheme | None:
    """The requantization a request names (None: the file's own bytes); a 422 for one that cannot be.
    blocksize and double_quant belong to nf4/fp4 and are ignored for the other formats."""
    try:
        if weight_format == "gguf":
            return None
        if weight_format not in BNB4_TARGETS:
            return Scheme(weight_format)
        return Scheme(weight_format, blocksize, double_quant)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "bad_weight_format") from None


def effective(info: TensorInfo, scheme: Scheme | None) -> TensorInfo:
    """The tensor as a request multiplies it, once checked that it can be: as stored, or requantized to `scheme`
    (its values, then the scheme's type: every kernel rule reads that type)."""
    if info.matmul_reason:
        raise InvalidRequest(info.matmul_reason, "unsupported_tensor")
    if scheme is None:
        return info
    reason = scheme.k_reason(info.shape[1])
    if reason is not None:
        raise InvalidRequest(f"{info.name} cannot be requantized to {scheme.format}: {reason}", "bad_weight_format")
    return dataclasses.replace(info, type_name=scheme.type_name)


def weight_bytes(info: TensorInfo) -> int:
    """About what a tensor takes on a device in its (effective) type: what first-use placement weighs."""
    n, k = info.shape
    fmt = format_of(info.type_name)
    if fmt is None or fmt.is_float or not fmt.block_values:
        return n * k * (2 if info.type_name in ("F16", "BF16") else 4)
    return n * (k // fmt.block_values) * fmt.block_bytes


def weights(model: Model, info: TensorInfo, scheme: Scheme | None = None, part: Part | None = None) -> Weights:
    """A tensor's weights as a backend takes them: the file's bytes or their requantization, whole or a block
    of rows (cached under its own layout name, beside the whole tensor's)."""
    n, k = info.shape
    key = (model.version_key, info.name)
    rows = slice(part.start, part.stop) if part is not None and part.rows != n else slice(None)
    variant = scheme.tag if scheme else ""
    if rows != slice(None):
        variant = "/".join(filter(None, [variant, f"rows{rows.start}-{rows.stop}"]))
        n = part.rows  # type: ignore[union-attr]

    def raw() -> Any:
        whole = model.raw(info.name)
        return whole if rows == slice(None) else whole[rows]

    if scheme is None:
        return Weights(key, info.type_name, n, k, raw, variant)
    src = info.type_name  # requantized from its values when a cache first needs them
    return Weights(key, scheme.type_name, n, k, lambda: requantize(dequantize_weights(src, raw()), scheme), variant)
