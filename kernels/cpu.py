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
    output: np.ndarray  # None only where the caller gave output arrays (CudaBackend.run's outs)
    backend: str
    activation_format: str
    timing_ms: dict[str, float] = field(default_factory=dict)
    activations_q8_1: reference.Q8_1 | None = None  # kept for callers that check against the reference
    finite: bool | None = None  # every output value finite, where the backend checked (None: not checked)
    x_amax: list[float] | None = None  # per part of a product: max|x| of its rows, not finite if a value is not


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
        self.unload(lambda key: key[0] == version)  # type: ignore[index]

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Drop the prepared weights whose (file version, tensor) key matches; the bytes freed."""
        freed = 0
        for full, size in self.cache.sizes().items():
            if match(full[0]):  # type: ignore[index]
                self.cache.pop(full)
                freed += size
        return freed

    def entries(self) -> list[tuple[Hashable, str, int]]:
        """((file version, tensor), layout, bytes) of every prepared weight kept."""
        return [(full[0], full[1], size) for full, size in self.cache.sizes().items()]  # type: ignore[index]

    def memory(self) -> tuple[int, int]:
        """(bytes of prepared weights kept, the budget)."""
        return self.cache.used, self.cache.budget

    def prepare(self, kernel: str, w: Weights) -> int:
        """Prepare (and keep, within the budget) the weights `kernel` reads, ahead of its first product; their bytes."""
        value, _ = self._weights_for(kernel, w)
        return int(getattr(value, "nbytes", 0))

    def _weights_for(self, kernel: str, w: Weights) -> tuple[object, float]:
        if kernel in ("ref_q8_1", "ref_mmq"):
            return self._prepared(w, "blocks", lambda raw: reference.prepare_block_weights(w.type_name, raw),
                                  lambda v: v.nbytes)  # type: ignore[attr-defined]
        if kernel in FLOAT_ACTIVATIONS:
            fmt, round_x = FLOAT_ACTIVATIONS[kernel]
            return self._prepared(w, fmt, lambda raw: round_x(reference.dequantize_weights(w.type_name, raw)),
                                  lambda v: v.nbytes)  # type: ignore[attr-defined]
        if kernel == "ref_f16_mmvf":  # the stored halves as they are: nothing to prepare
            raw = np.asarray(w.raw())
            return raw.view(np.float16) if raw.dtype == np.uint8 else raw, 0.0
        raise KeyError(f"the CPU backend has no kernel {kernel!r}")

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
        prepared, prep = self._weights_for(kernel, w)
        if kernel in ("ref_q8_1", "ref_mmq"):
            mmq = kernel == "ref_mmq"
            t0 = time.perf_counter()
            a = reference.quantize_q8_1_mmq(x, mmq_ds_layout(w.type_name)) if mmq else reference.quantize_q8_1(x)
            tq = _ms(t0)
            t0 = time.perf_counter()
            y = (reference.ref_mmq if mmq else reference.ref_q8_1)(prepared, a)  # type: ignore[arg-type]
            tg = _ms(t0)
            timing = {"weights": prep, "quantize": tq, "gemm": tg}
            res = Result(y, self.name, "q8_1_mmq" if mmq else "q8_1_mmvq", timing, a)
        elif kernel in FLOAT_ACTIVATIONS:
            fmt, round_x = FLOAT_ACTIVATIONS[kernel]
            t0 = time.perf_counter()
            xr = round_x(x)
            tq = _ms(t0)
            t0 = time.perf_counter()
            y = reference.ref_f32(prepared, xr)  # type: ignore[arg-type]
            res = Result(y, self.name, fmt, {"weights": prep, "quantize": tq, "gemm": _ms(t0)})
        else:  # ref_f16_mmvf
            t0 = time.perf_counter()
            y = reference.ref_f16_mmvf(prepared, x)  # type: ignore[arg-type]
            res = Result(y, self.name, "f16_mmvf", {"weights": 0.0, "quantize": 0.0, "gemm": _ms(t0)})
        res.timing_ms["total"] = _ms(t_all)
        return res
