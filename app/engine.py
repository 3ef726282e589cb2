"""The matmul engine: picks a backend and a kernel, checks the request against them, runs it.

The CPU backend always exists; the CUDA backend exists when CuPy sees a device and the settings
allow it.  Every rule about which kernel may run what lives in kernels.registry; this module only
turns those reasons into HTTP errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from fastapi.concurrency import run_in_threadpool

from app.errors import ApiError
from app.scheduler import Answer, Scheduler
from app.settings import Settings
from kernels.cpu import CpuBackend, Result, Weights
from kernels.errors import DeviceOutOfMemory
from kernels.formats import format_of
from kernels.reference import dequantize_weights, q8_1_overflow
from kernels.registry import AUTO_DESCRIPTION, CPU_REFERENCE, KERNELS, WEIGHTS, KernelSpec, known_names, llama_formula
from kernels.requant import BNB4_TARGETS, Scheme, requantize
from models.store import Model, TensorInfo

log = logging.getLogger("qgemm")
# A lone product (nothing queued) up to this M on resident weights launches from the event loop (Engine._on_loop):
# no thread round trip.  Under load the worker thread runs batches while the loop reads requests.
LOOP_ROWS = 64
POLL_SPIN_S, POLL_SLEEP_S = 0.002, 0.0001  # poll a product's completion every loop turn for 2 ms, then every 0.1 ms
INLINE_VALUES = 1 << 16  # activations up to this many values are checked on the event loop (tens of µs)


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
        raise ApiError(422, "bad_weight_format", str(exc)) from None


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.cpu = CpuBackend(settings.cpu_cache_bytes)
        self._auto: dict[tuple[str, int, int, int], KernelSpec] = {}  # auto's pick per (type, M, N, K)
        self._cpu_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qgemm-cpu")
        self.scheduler = Scheduler(self._run_batch, settings.batch_max_rows, settings.batch_wait_us)
        self.cuda: Any = None
        self.cuda_error: str | None = None
        if settings.backend in ("auto", "cuda"):
            try:
                from kernels.cuda.backend import CudaBackend, cuda_device_present

                if cuda_device_present():
                    self.cuda = CudaBackend(settings)
                else:
                    self.cuda_error = "CuPy sees no CUDA device"
            except ImportError as exc:
                self.cuda_error = f"CuPy is not installed ({exc.name}); install the .[cuda] extra"
            except Exception as exc:  # a broken driver must not stop the CPU service in auto mode
                self.cuda_error = f"{type(exc).__name__}: {exc}"
            if self.cuda is None:
                if settings.backend == "cuda":
                    raise RuntimeError(f"QGEMM_BACKEND=cuda but the CUDA backend is unavailable: {self.cuda_error}")
                log.info("CUDA backend unavailable (%s); serving on the CPU", self.cuda_error)

    # -- what is here -------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "cuda" if self.cuda is not None else "cpu"

    @property
    def device(self) -> str | None:
        return self.cuda.device_name if self.cuda is not None else None

    @property
    def cuda_cc(self) -> int | None:
        return self.cuda.cc if self.cuda is not None else None

    def kernel_table(self) -> list[dict[str, Any]]:
        rows = [{"name": "auto", "weight_types": list(WEIGHTS), "activation_format": "auto", "backend": "auto",
                 "available": True, "reason": None, "description": AUTO_DESCRIPTION}]
        for spec in KERNELS.values():
            reason = spec.device_reason(self.cuda_cc)
            if reason is None and spec.backend == "cuda":
                reason = self.cuda.kernel_reason(spec)
            rows.append({"name": spec.name, "weight_types": list(spec.weight_types),
                         "activation_format": spec.activation_format, "backend": spec.backend,
                         "available": reason is None, "reason": reason, "description": spec.description})
        return rows

    def runnable(self, type_name: str, m: int, n: int, k: int) -> list[KernelSpec]:
        out = []
        for spec in KERNELS.values():
            if spec.can_run(type_name, m, n, k, self.cuda_cc) is None and (
                    spec.backend == "cpu" or self.cuda.kernel_reason(spec) is None):
                out.append(spec)
        return out

    # -- choosing -----------------------------------------------------------------------------
    @staticmethod
    def kernel_named(kernel: str) -> KernelSpec:
        spec = KERNELS.get(kernel)
        if spec is None:
            known = ", ".join(known_names())
            raise ApiError(422, "unknown_kernel", f"unknown kernel {kernel!r}; known kernels: {known}")
        return spec

    def choose(self, kernel: str, info: TensorInfo, m: int) -> KernelSpec:
        if info.matmul_reason:
            raise ApiError(422, "unsupported_tensor", info.matmul_reason)
        n, k = info.shape
        if kernel == "auto":
            key = (info.type_name, m, n, k)
            spec = self._auto.get(key)
            if spec is None:
                spec = (self.cuda.auto(info.type_name, m, n, k) if self.cuda is not None else None) \
                    or KERNELS[CPU_REFERENCE[llama_formula(m, info.type_name)]]
                if len(self._auto) < 65536:
                    self._auto[key] = spec
            return spec
        spec = self.kernel_named(kernel)
        reason = spec.can_run(info.type_name, m, n, k, self.cuda_cc)
        if reason is None and spec.backend == "cuda":
            reason = self.cuda.kernel_reason(spec)
        if reason is not None:
            can = [s.name for s in self.runnable(info.type_name, m, n, k)]
            raise ApiError(422, "kernel_cannot_run",
                           f"kernel {kernel!r} cannot run {info.name} ({info.type_name} [{n}, {k}]) with M={m}: "
                           f"{reason}; kernels that can: {', '.join(['auto', *can])}")
        return spec

    # -- running ------------------------------------------------------------------------------
    def check_activations(self, x: np.ndarray, info: TensorInfo) -> None:
        if x.ndim != 2:
            raise ApiError(422, "bad_shape", f"activations must be a 2-D [M, K] array; got {x.ndim}-D {list(x.shape)}")
        m, k = x.shape
        if m < 1 or k < 1:
            raise ApiError(422, "bad_shape", f"activations must have at least one row and column; got {list(x.shape)}")
        if m > self.settings.max_rows:
            raise ApiError(422, "too_many_rows", f"M={m} rows exceed the limit of {self.settings.max_rows} "
                                                 "(QGEMM_MAX_ROWS)")
        n, kw = info.shape
        if k != kw:
            raise ApiError(422, "k_mismatch", f"activations have K={k} columns but {info.name} is [{n}, {kw}]: "
                                              f"K must be {kw}")

    async def _on_loop(self, spec: KernelSpec, w: Weights, parts: list[np.ndarray]) -> Result | None:
        """A small product on resident weights, launched from the event loop (launches are asynchronous,
        and a thread round trip costs more than the product) and awaited by polling its last event;
        None if it could not launch (the worker thread then runs it, with its out-of-memory retry)."""
        try:
            pending = self.cuda.launch(spec, w, parts)
        except Exception as exc:
            log.debug("launch on the event loop failed (%s); the worker thread runs it", exc)
            return None
        done, t0 = self.cuda.events[4], time.perf_counter()
        while not done.done:
            await asyncio.sleep(0 if time.perf_counter() - t0 < POLL_SPIN_S else POLL_SLEEP_S)
        return self.cuda.finish(pending)

    @staticmethod
    def effective(info: TensorInfo, scheme: Scheme | None) -> TensorInfo:
        """The tensor as a request multiplies it: as stored, or requantized to `scheme` (its values, then
        the scheme's type: every kernel rule reads that type)."""
        if scheme is None:
            return info
        if info.matmul_reason:
            raise ApiError(422, "unsupported_tensor", info.matmul_reason)
        reason = scheme.k_reason(info.shape[1])
        if reason is not None:
            raise ApiError(422, "bad_weight_format", f"{info.name} cannot be requantized to {scheme.format}: {reason}")
        return dataclasses.replace(info, type_name=scheme.type_name)

    def weights(self, model: Model, info: TensorInfo, scheme: Scheme | None = None) -> Weights:
        n, k = info.shape
        key = (model.version_key, info.name)
        if scheme is None:
            return Weights(key, info.type_name, n, k, lambda: model.raw(info.name))
        src = info.type_name  # requantized from its values when a cache first needs them
        return Weights(key, scheme.type_name, n, k,
                       lambda: requantize(dequantize_weights(src, model.raw(info.name)), scheme), scheme.tag)

    def prepare(self, model: Model, info: TensorInfo, x: np.ndarray,
                kernel: str) -> tuple[np.ndarray, KernelSpec | None]:
        """Every check a request can fail before it queues: X as float32, and its kernel (None: auto)."""
        if info.matmul_reason:
            raise ApiError(422, "unsupported_tensor", info.matmul_reason)
        self.check_activations(x, info)
        spec = self.choose(kernel, info, x.shape[0])
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = np.ascontiguousarray(x, dtype=np.float32)
            amax = max(float(x32.max()), -float(x32.min()))  # one value says it all: NaN and inf propagate
        if not math.isfinite(amax):
            bad = np.argwhere(~np.isfinite(x))
            if len(bad):
                raise ApiError(422, "non_finite", f"activations contain NaN or infinity (first at row {bad[0][0]}, "
                                                  f"column {bad[0][1]})")
            raise ApiError(422, "non_finite", "activations overflow float32 (|x| > 3.4e38)")
        fmt = format_of(info.type_name)
        if spec.quantizes or (kernel == "auto" and fmt is not None and fmt.quantizes_activations):
            # auto may pick a Q8_1 kernel at any batch M
            overflow = q8_1_overflow(x32, uses_sum=fmt is not None and fmt.uses_activation_sum, amax=amax)
            if overflow is not None:
                raise ApiError(422, "activation_out_of_range", f"activations out of range for {spec.name}: {overflow}")
        return x32, None if kernel == "auto" else spec

    async def matmul(self, model: Model, info: TensorInfo, x: np.ndarray, kernel: str,
                     scheme: Scheme | None = None) -> Answer:
        """A request's product, through the scheduler (which may batch it with others of this tensor in the
        same weight format)."""
        eff = self.effective(info, scheme)
        if x.size <= INLINE_VALUES:
            x32, spec = self.prepare(model, eff, x, kernel)
        else:  # large X: its checks take milliseconds, off the event loop
            x32, spec = await run_in_threadpool(self.prepare, model, eff, x, kernel)
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        answer = await self.scheduler.submit(key, (model, info, scheme), x32, spec,
                                             lambda rows: self.choose("auto", eff, rows))
        if not np.isfinite(answer.output).all():
            r, c = (int(v) for v in np.argwhere(~np.isfinite(answer.output))[0])
            raise ApiError(422, "product_out_of_range",
                           f"the product overflows float32 (first at row {r}, column {c}): scale the activations down")
        return answer

    async def _run_batch(self, context: tuple[Model, TensorInfo, Scheme | None], spec: KernelSpec | None,
                         parts: list[np.ndarray], alone: bool = False) -> tuple[KernelSpec, Result]:
        """One product of stacked rows: on the backend's worker thread, so that the event loop takes in
        requests meanwhile; a lone small product on resident weights from the event loop itself."""
        model, info, scheme = context
        if spec is None:
            spec = self.choose("auto", self.effective(info, scheme), sum(p.shape[0] for p in parts))
        w = self.weights(model, info, scheme)
        if spec.backend == "cuda":
            rows = sum(p.shape[0] for p in parts)
            if alone and rows <= LOOP_ROWS and self.cuda.resident_for(spec, w):
                result = await self._on_loop(spec, w, parts)
                if result is not None:
                    return spec, result
            future = self.cuda.submit(lambda: self.cuda.run_here(spec, w, parts))
        else:
            future = self._cpu_worker.submit(
                lambda: self.cpu.run(spec.name, w, parts[0] if len(parts) == 1 else np.concatenate(parts)))
        try:
            return spec, await asyncio.wrap_future(future)
        except DeviceOutOfMemory as exc:
            raise ApiError(503, "gpu_out_of_memory", str(exc), headers={"Retry-After": "1"}) from None

    def preload(self, model: Model, infos: list[TensorInfo], kernel: str | None,
                scheme: Scheme | None = None) -> list[dict[str, Any]]:
        """Upload tensors to the GPU in the layouts `kernel` (default: what auto picks) reads, as stored or
        requantized to `scheme`."""
        assert self.cuda is not None
        loaded = []
        for info in infos:
            eff = self.effective(info, scheme)
            n, k = eff.shape
            if kernel:
                specs = [self.choose(kernel, eff, 1)]
            else:
                specs = [s for m in (1, 512) if (s := self.cuda.auto(eff.type_name, m, n, k)) is not None]
            for spec in {s.weight_layout: s for s in specs if s.backend == "cuda"}.values():
                w = self.weights(model, info, scheme)
                try:
                    nbytes = self.cuda.load(spec, w)
                except DeviceOutOfMemory as exc:
                    raise ApiError(503, "gpu_out_of_memory", str(exc)) from None
                loaded.append({"tensor": info.name, "layout": w.layout_key(spec.weight_layout), "n_bytes": nbytes})
        return loaded

    def forget(self, model: Model) -> None:
        """The store retired this file version (its file changed or went): drop its prepared and resident
        weights, each on the worker thread that fills them, so that no fill in flight outlives the drop."""
        try:
            self._cpu_worker.submit(self.cpu.forget, model.version_key)
            if self.cuda is not None:
                self.cuda.forget(model.version_key)
        except RuntimeError:  # shutting down: the workers are gone, and their memory with them
            pass

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.close()
        self._cpu_worker.shutdown(wait=True)
