"""The CPU backend: the numpy reference kernels, with prepared weights cached by bytes (LRU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels import reference
from kernels.formats import mmq_ds_layout
from models.cache import ByteLRU


@dataclass(frozen=True)
class Weights:
    """A matmul's weights as the engine hands them to a backend."""

    key: tuple[Hashable, str]  # (the file version, the tensor): caches key on it
    type_name: str
    n: int
    k: int
    raw: Callable[[], Any]  # GGUF block bytes, uint8 [N, row_bytes] (or float values; a Bnb4Tensor for NF4/FP4)
    variant: str = ""  # a requantization's tag (kernels/requant.py): part of every cache key

    def layout_key(self, layout: str) -> str:
        """The name its arrays in `layout` are cached under."""
        return f"{layout}@{self.variant}" if self.variant else layout


@dataclass
class Result:
    output: np.ndarray
    backend: str
    activation_format: str
    timing_ms: dict[str, float] = field(default_factory=dict)
    activations_q8_1: reference.Q8_1 | None = None  # kept for callers that check against the reference


def _as_is(x: np.ndarray) -> np.ndarray:
    return x


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


# the float kernels: (activation format, how activations and weights are rounded before an fp32 GEMM)
FLOAT_ACTIVATIONS = {"ref_f32": ("f32", _as_is), "ref_f16": ("f16", _round_f16),
                     "ref_bf16": ("bf16", reference.round_bf16)}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class CpuBackend:
    name = "cpu"

    def __init__(self, cache_bytes: int):
        self.cache: ByteLRU[object] = ByteLRU(cache_bytes)

    def forget(self, version: Hashable) -> None:
        """Drop the prepared weights of a file version that is gone."""
        for key in self.cache.keys():
            if key[0][0] == version:  # type: ignore[index]
                self.cache.pop(key)

    def _prepared(self, w: Weights, layout: str, make: Callable[[np.ndarray], object],
                  nbytes: Callable[[object], int]) -> tuple[object, float]:
        key = (w.key, w.layout_key(layout))
        hit = self.cache.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        value = make(w.raw())
        self.cache.put(key, value, nbytes(value))  # too large for the budget: used once, not kept
        return value, _ms(t0)

    def run(self, kernel: str, w: Weights, x: np.ndarray) -> Result:
        t_all = time.perf_counter()
        if kernel in ("ref_q8_1", "ref_mmq"):
            bw, prep = self._prepared(w, "blocks", lambda raw: reference.prepare_block_weights(w.type_name, raw),
                                      lambda v: v.nbytes)  # type: ignore[attr-defined]
            mmq = kernel == "ref_mmq"
            t0 = time.perf_counter()
            a = reference.quantize_q8_1_mmq(x, mmq_ds_layout(w.type_name)) if mmq else reference.quantize_q8_1(x)
            tq = _ms(t0)
            t0 = time.perf_counter()
            y = (reference.ref_mmq if mmq else reference.ref_q8_1)(bw, a)  # type: ignore[arg-type]
            tg = _ms(t0)
            timing = {"weights": prep, "quantize": tq, "gemm": tg}
            res = Result(y, self.name, "q8_1_mmq" if mmq else "q8_1_mmvq", timing, a)
        elif kernel in FLOAT_ACTIVATIONS:
            fmt, round_x = FLOAT_ACTIVATIONS[kernel]
            wf, prep = self._prepared(w, fmt, lambda raw: round_x(reference.dequantize_weights(w.type_name, raw)),
                                      lambda v: v.nbytes)  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            xr = round_x(x)
            tq = _ms(t0)
            t0 = time.perf_counter()
            y = reference.ref_f32(wf, xr)  # type: ignore[arg-type]
            res = Result(y, self.name, fmt, {"weights": prep, "quantize": tq, "gemm": _ms(t0)})
        elif kernel == "ref_f16_mmvf":
            t0 = time.perf_counter()
            raw = np.asarray(w.raw())  # the stored halves as they are (or their bytes): nothing to prepare
            y = reference.ref_f16_mmvf(raw.view(np.float16) if raw.dtype == np.uint8 else raw, x)
            res = Result(y, self.name, "f16_mmvf", {"weights": 0.0, "quantize": 0.0, "gemm": _ms(t0)})
        else:
            raise KeyError(f"the CPU backend has no kernel {kernel!r}")
        res.timing_ms["total"] = _ms(t_all)
        return res
