"""The CPU kernels (numpy twins of llama.cpp's formulas, kernels/reference.py) and the CPU backend that runs
them on a thread of its own, with prepared weights cached by bytes (LRU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kernels import reference
from kernels.backend import RowAddresses, of_version
from kernels.cache import ByteLRU
from kernels.formats import QUANT_TYPES, mmq_ds_layout
from kernels.kernel import Device, Kernel, Layout
from kernels.registry import WEIGHTS, register
from kernels.types import Result, Weights


@dataclass(frozen=True, eq=False)
class HostWeights(Layout):
    """Weights as a CPU kernel reads them, made once from the tensor's bytes (None: the bytes as they are)."""

    name: str
    make: Callable[[str, np.ndarray], Any] | None


@dataclass(frozen=True, eq=False)
class HostActivations(Layout):
    """X as a CPU kernel reads it: quantized to Q8_1 as llama.cpp does, or rounded to the formula's float."""

    name: str
    prepare: Callable[[np.ndarray, str], Any]


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _stored_halves(type_name: str, raw: Any) -> np.ndarray:
    raw = np.asarray(raw)
    return raw.view(np.float16) if raw.dtype == np.uint8 else raw


def _dequantized(round_to: Callable[[np.ndarray], np.ndarray]) -> Callable[[str, np.ndarray], np.ndarray]:
    return lambda type_name, raw: round_to(reference.dequantize_weights(type_name, raw))


BLOCKS = HostWeights("blocks", reference.prepare_block_weights)
F32 = HostWeights("f32", _dequantized(lambda v: v))
F16 = HostWeights("f16", _dequantized(_round_f16))
BF16 = HostWeights("bf16", _dequantized(reference.round_bf16))
STORED = HostWeights("stored", None)  # F16 halves for the mmvf twin: nothing to prepare

Q8_1_MMVQ = HostActivations("q8_1", lambda x, t: reference.quantize_q8_1(x))
Q8_1_MMQ = HostActivations("q8_1_mmq", lambda x, t: reference.quantize_q8_1_mmq(x, mmq_ds_layout(t)))
X_F32 = HostActivations("f32", lambda x, t: x)
X_F16 = HostActivations("f16", lambda x, t: _round_f16(x))
X_BF16 = HostActivations("bf16", lambda x, t: reference.round_bf16(x))


@dataclass(frozen=True, kw_only=True, eq=False)
class CpuKernel(Kernel):
    """A numpy kernel: its weights prepared once (`layout`), X prepared per product (`acts`), then `gemm`."""

    backend: ClassVar[Device] = "cpu"
    layout: HostWeights
    acts: HostActivations
    gemm: Callable[[Any, Any], np.ndarray]

    @property
    def weights(self) -> HostWeights:
        return self.layout

    def activations_for(self, type_name: str) -> HostActivations:
        return self.acts


register(CpuKernel(
    name="ref_q8_1", weight_types=QUANT_TYPES, activation_format="q8_1_mmvq", layout=BLOCKS, acts=Q8_1_MMVQ,
    gemm=reference.ref_q8_1,
    description="numpy reference on the CPU of llama.cpp's MMVQ formula (its path for M <= 8): activations to Q8_1 "
                "with half2 (d, s), integer block dots over the stored quants, d_w*(d_a*sumi - c*s_a) (Q4_0 c=8, "
                "Q5_0 c=16), d_w*d_a*sumi (Q8_0), sumi*half(d_w*d_a) + half(m_w*s_a) (Q4_1, Q5_1)"))
register(CpuKernel(
    name="ref_mmq", weight_types=QUANT_TYPES, activation_format="q8_1_mmq", layout=BLOCKS, acts=Q8_1_MMQ,
    gemm=reference.ref_mmq,
    description="numpy reference on the CPU of llama.cpp's MMQ formula (its tensor-core path for M > 8): "
                "activations to Q8_1 as quantize_mmq_q8_1 does (d float for Q5_0/Q8_0, half for Q4_0/Q4_1/Q5_1), "
                "weights as signed int8 (q-8, q-16) with sumi*d_w*d_a per block, or unsigned with (d_w*d_a)*sumi "
                "+ m_w*s_a (Q4_1, Q5_1)"))
register(CpuKernel(
    name="ref_f32", weight_types=WEIGHTS, activation_format="f32", layout=F32, acts=X_F32, gemm=reference.ref_f32,
    description="numpy on the CPU: weights dequantized with gguf.quants (float matrices as they are), fp32 "
                "activations, fp32 GEMM"))
register(CpuKernel(
    name="ref_f16_mmvf", weight_types=("F16",), activation_format="f16_mmvf", max_m=1, layout=STORED, acts=X_F32,
    gemm=reference.ref_f16_mmvf,
    description="numpy on the CPU of llama.cpp's product of an F16 matrix with one activation row "
                "(mul_mat_vec_f): per thread half2 sums of fma(w, half(x)), then float butterflies; bit for bit "
                "ggml's"))
register(CpuKernel(
    name="ref_f16", weight_types=("F16",), activation_format="f16", layout=F16, acts=X_F16, gemm=reference.ref_f32,
    description="numpy on the CPU of llama.cpp's product of F16 matrices where its tensor-core mul_mat_f takes "
                "them (2 to 16 rows, N % 32 == 0, K % 64 == 0): activations rounded to half (to nearest even), "
                "fp32 GEMM"))
register(CpuKernel(
    name="ref_f16_h", weight_types=("F16",), activation_format="f16_h", layout=F16, acts=X_F16,
    gemm=reference.ref_f16_h, exact=False,
    description="numpy on the CPU of llama.cpp's cuBLAS product of F16 matrices (M > 1 where mul_mat_f does not "
                "take the shape; CUBLAS_COMPUTE_16F): activations rounded to half, fp32 GEMM rounded to half. cuBLAS "
                "sums in half in its own order, so this is within half-precision rounding of ggml, not bit for bit"))
register(CpuKernel(
    name="ref_bf16", weight_types=("BF16",), activation_format="bf16", layout=BF16, acts=X_BF16,
    gemm=reference.ref_f32,
    description="numpy on the CPU of llama.cpp's product of BF16 matrices at M > 1: activations rounded to bf16 "
                "(to nearest even), fp32 GEMM"))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class CpuBackend:
    """The Backend (kernels/backend.py) of numpy kernels: one thread, prepared weights under a byte budget."""

    name = "cpu"
    cc: int | None = None
    sm_count: int | None = None
    compile_ms: float | None = None  # numpy compiles nothing
    device_name = "CPU (numpy)"

    def __init__(self, cache_bytes: int, index: int = 0):
        self.index = index
        self.label = f"cpu:{index}"
        self.cache: ByteLRU[object] = ByteLRU(cache_bytes)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"qgemm-cpu{index}")

    # -- the registry's question -------------------------------------------------------------------
    def kernel_reason(self, kernel: Kernel) -> str | None:
        return kernel.device_reason(None)

    def auto(self, type_name: str, m: int, n: int, k: int) -> Kernel | None:
        return None  # no measurements here: the registry's rule picks

    # -- weights -----------------------------------------------------------------------------------
    def forget(self, version: Hashable) -> None:
        """Drop a retired file version's prepared weights without waiting (behind the product in flight)."""
        try:
            self._thread.submit(self._unload, of_version(version))
        except RuntimeError:  # shutting down: the thread is gone, and the memory with it
            pass

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Drop the prepared weights whose (file version, tensor) key matches, after the product in flight;
        the bytes freed."""
        return self._thread.submit(self._unload, match).result()

    def _unload(self, match: Callable[[Hashable], bool]) -> int:
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

    def prepare(self, kernel: Kernel, w: Weights) -> int:
        """Prepare (and keep, within the budget) the weights `kernel` reads, ahead of its first product; their
        bytes.  On this backend's thread."""
        return self._thread.submit(lambda: int(getattr(self._weights_for(kernel, w)[0], "nbytes", 0))).result()

    def _weights_for(self, kernel: Kernel, w: Weights) -> tuple[object, float]:
        layout = kernel.weights
        assert isinstance(layout, HostWeights), f"{kernel.name} is not a CPU kernel"
        if layout.make is None:
            return _stored_halves(w.type_name, w.raw()), 0.0
        key = (w.key, w.layout_key(layout.name))
        hit = self.cache.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        value = layout.make(w.type_name, w.raw())
        self.cache.put(key, value, int(getattr(value, "nbytes", 0)))  # too large for the budget: used once
        return value, _ms(t0)

    # -- a matmul ----------------------------------------------------------------------------------
    def run(self, kernel: Kernel, w: Weights, x: np.ndarray) -> Result:
        """X times W by `kernel`, on the calling thread."""
        assert isinstance(kernel, CpuKernel), f"{kernel.name} is not a CPU kernel"
        t_all = time.perf_counter()
        prepared, prep = self._weights_for(kernel, w)
        t0 = time.perf_counter()
        a = kernel.acts.prepare(x, w.type_name)
        tq = _ms(t0)
        t0 = time.perf_counter()
        y = kernel.gemm(prepared, a)
        res = Result(y, self.name, kernel.activation_format, {"weights": prep, "quantize": tq, "gemm": _ms(t0)},
                     a if kernel.quantizes else None)
        res.timing_ms["total"] = _ms(t_all)
        return res

    def submit(self, kernel: Kernel, w: Weights, parts: list[np.ndarray],
               outs: list[np.ndarray | None] | None = None) -> Future[Result]:
        """The product of the stacked parts on this backend's thread (`outs` unused: the Result holds Y)."""
        x = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return self._thread.submit(self.run, kernel, w, x)

    def launch_inline(self, kernel: Kernel, w: Weights, parts: list[np.ndarray],
                      outs: list[np.ndarray | None] | None = None, rows: RowAddresses = None) -> None:
        """A numpy product is never cheap enough to run on the caller's thread."""
        return None

    def close(self) -> None:
        self._thread.shutdown(wait=True)
