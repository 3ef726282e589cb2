"""What a product should be, and the one check every product test makes (kernels/accuracy.py)."""

from __future__ import annotations

import numpy as np

from kernels import accuracy
from kernels import reference as ref
from kernels.formats import mmq_ds_layout


def prepare(type_name: str, raw: np.ndarray, activation_format: str) -> ref.BlockWeights | np.ndarray:
    """The weights as the reference of this activation format reads them (worth keeping for big tensors)."""
    if activation_format.startswith("q8_1"):
        return ref.prepare_block_weights(type_name, raw)
    wf = ref.dequantize_weights(type_name, raw).astype(np.float64)
    return wf.astype(np.float16).astype(np.float64) if activation_format in ("f16", "f16_h") else wf


def reference_product(type_name: str, raw: np.ndarray, x: np.ndarray, activation_format: str,
                      q8_1: ref.Q8_1 | None = None,
                      prepared: ref.BlockWeights | np.ndarray | None = None) -> tuple[np.ndarray, ref.Terms]:
    """The reference for a kernel of this activation format, and the terms it sums.  Q8_1 kernels get
    llama.cpp's formula they declare, MMVQ's or MMQ's (on `q8_1`, the blocks the kernel used, when known);
    float kernels the FP64 product of the dequantized weights with the activations rounded as the kernel
    rounds them."""
    if activation_format == "f16_mmvf":  # an emulation of ggml's kernel, bit for bit: it is its own reference
        wf = np.asarray(raw, np.float16).astype(np.float64)
        xh = np.asarray(x, np.float32).astype(np.float16).astype(np.float64)
        return ref.ref_f16_mmvf(raw, x).astype(np.float64), ref.Terms(np.abs(xh) @ np.abs(wf).T, 2 * x.shape[1])
    w = prepared if prepared is not None else prepare(type_name, raw, activation_format)
    if activation_format == "q8_1_mmvq":
        a = q8_1 if q8_1 is not None else ref.quantize_q8_1(x)
        return ref.ref_q8_1(w, a).astype(np.float64), ref.ref_q8_1_terms(w, a)  # type: ignore[arg-type]
    if activation_format == "q8_1_mmq":
        a = q8_1 if q8_1 is not None else ref.quantize_q8_1_mmq(x, mmq_ds_layout(type_name))
        return ref.ref_mmq(w, a).astype(np.float64), ref.ref_mmq_terms(w, a)  # type: ignore[arg-type]
    xf = np.asarray(x, np.float32).astype(np.float64)
    if activation_format == "bf16":
        xf = ref.round_bf16(np.asarray(x, np.float32)).astype(np.float64)
    if activation_format in ("f16", "f16_h"):
        xf = xf.astype(np.float16).astype(np.float64)
    if activation_format == "f16_h":  # sums in half: the FP64 product, with half-precision rounding steps allowed
        return xf @ w.T, ref.ref_f16_h_terms(w, xf)  # type: ignore[union-attr]
    return xf @ w.T, ref.ref_f32_terms(w, xf)  # type: ignore[union-attr]


def assert_matches(y: np.ndarray, want: np.ndarray, terms: ref.Terms, what: str, same_q8_1: bool = True) -> None:
    assert np.shape(y) == want.shape, (what, np.shape(y), want.shape)
    cmp = accuracy.compare(y, want, terms, same_q8_1=same_q8_1)
    assert cmp.ok, f"{what}: {cmp}"
