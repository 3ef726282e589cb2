"""The matmul engine: picks a backend and a kernel, checks the request against them, runs it on a device.

The CPU backend always exists; the CUDA backend exists when CuPy sees a device and the settings
allow it.  Every rule about which kernel may run what lives in kernels.registry; this module only
turns those reasons into HTTP errors.  Each backend has a pool of workers (app/workers.py: one per
GPU of QGEMM_DEVICES; QGEMM_CPU_DEVICES on the CPU); where a tensor lives among them, app/placement.py.
A request goes to the least loaded replica of its tensor; a tensor split by rows runs on all its
devices at once and their blocks of output columns are joined.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any, Literal

import numpy as np
from fastapi.concurrency import run_in_threadpool

from app import placement
from app.errors import ApiError
from app.placement import Part, Placement, Placements, Replica
from app.scheduler import Answer
from app.settings import Settings
from app.workers import Worker
from kernels.cpu import Result, Weights
from kernels.errors import DeviceOutOfMemory
from kernels.formats import format_of
from kernels.reference import dequantize_weights, q8_1_in_range, q8_1_overflow
from kernels.registry import AUTO_DESCRIPTION, CPU_REFERENCE, KERNELS, WEIGHTS, KernelSpec, known_names, llama_formula
from kernels.requant import BNB4_TARGETS, Scheme, requantize
from models.store import Model, TensorInfo

log = logging.getLogger("qgemm")
# A lone product (nothing queued) up to this M on resident weights launches from the event loop (Engine._on_loop):
# no thread round trip.  Under load the worker thread runs batches while the loop reads requests.
LOOP_ROWS = 64
POLL_SPIN_S, POLL_SLEEP_S = 0.002, 0.0001  # poll a product's completion every loop turn for 2 ms, then every 0.1 ms
INLINE_VALUES = 1 << 16  # activations up to this many values are checked on the event loop (tens of µs)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a queued product needs to find its weights: the tensor, its requantization, its block of rows."""

    model: Model
    info: TensorInfo
    scheme: Scheme | None
    eff: TensorInfo  # as multiplied: the scheme's type, and the part's rows
    part: Part | None  # None: the whole tensor


def weight_bytes(info: TensorInfo) -> int:
    """About what a tensor takes on a device in its (effective) type: what first-use placement weighs."""
    n, k = info.shape
    fmt = format_of(info.type_name)
    if fmt is None or fmt.is_float or not fmt.block_values:
        return n * k * (2 if info.type_name in ("F16", "BF16") else 4)
    return n * (k // fmt.block_values) * fmt.block_bytes


class BadDevices(RuntimeError):
    """QGEMM_DEVICES names devices that are not there: a configuration error, never a fall-back to the CPU."""


def parse_devices(spec: str | None, count: int) -> list[int]:
    """QGEMM_DEVICES ("all", or CUDA ordinals "0,1") as a list of ordinals, each checked against `count`."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(range(count))
    try:
        devices = [int(d) for d in spec.replace(" ", "").split(",") if d]
    except ValueError:
        raise BadDevices(f"QGEMM_DEVICES={spec!r}: give CUDA ordinals like 0,1 or 'all'") from None
    bad = [d for d in devices if not 0 <= d < count]
    if bad or not devices or len(set(devices)) != len(devices):
        raise BadDevices(f"QGEMM_DEVICES={spec!r}: CuPy sees {count} device(s) (0..{count - 1}), each named once")
    return devices


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
        self._auto: dict[tuple[str, int, int, int], KernelSpec] = {}  # auto's pick per (type, M, N, K)
        self.pools: dict[str, list[Worker]] = {"cpu": [
            Worker("cpu", i, self._run_batch, settings.batch_max_rows, settings.batch_wait_us, settings.cpu_cache_bytes)
            for i in range(settings.cpu_devices)], "cuda": []}
        self.placements = {"cpu": Placements(), "cuda": Placements()}
        self.cuda: Any = None  # the first GPU's backend: it answers the registry's questions (all GPUs alike)
        self.outputs: Any = None  # pinned host arrays for large GPU outputs (kernels/cuda/host_memory.py)
        self.cuda_error: str | None = None
        if settings.backend in ("auto", "cuda"):
            try:
                from kernels.cuda.backend import CudaBackend, cuda_device_count

                count = cuda_device_count()
                if count:
                    for i in parse_devices(settings.devices, count):
                        self.pools["cuda"].append(Worker("cuda", len(self.pools["cuda"]), self._run_batch,
                                                         settings.batch_max_rows, settings.batch_wait_us,
                                                         cuda=CudaBackend(settings, device=i)))
                    self.cuda = self.pools["cuda"][0].cuda
                    from kernels.cuda.host_memory import PinnedOutputs

                    self.outputs = PinnedOutputs(settings.pinned_output_bytes)
                    if len({w.cuda.cc for w in self.pools["cuda"]}) > 1:
                        log.warning("QGEMM_DEVICES mixes compute capabilities; kernels are chosen for %s",
                                    self.cuda.device_name)
                else:
                    self.cuda_error = "CuPy sees no CUDA device"
            except ImportError as exc:
                self.cuda_error = f"CuPy is not installed ({exc.name}); install the .[cuda] extra"
            except BadDevices:
                for w in self.pools["cuda"] + self.pools["cpu"]:
                    w.close()
                raise
            except Exception as exc:  # a broken driver must not stop the CPU service in auto mode
                for w in self.pools["cuda"]:
                    w.close()
                self.pools["cuda"], self.cuda = [], None
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

    @property
    def workers(self) -> list[Worker]:
        """Every device worker: the GPUs first, then the CPU's."""
        return self.pools["cuda"] + self.pools["cpu"]

    def worker_named(self, backend: str, device: int) -> int:
        """The pool index of device `device` (a CUDA ordinal, or a CPU worker's number); a 422 if absent."""
        pool = self.pools[backend]
        for i, w in enumerate(pool):
            if w.label == f"{backend}:{device}":
                return i
        raise ApiError(422, "bad_device", f"no device {backend}:{device} here; devices: "
                                          f"{', '.join(w.label for w in pool)}")

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

    @staticmethod
    async def _on_loop(cuda: Any, spec: KernelSpec, w: Weights, parts: list[np.ndarray],
                       outs: list[np.ndarray | None] | None = None) -> Result | None:
        """A small product on resident weights, launched from the event loop (launches are asynchronous,
        and a thread round trip costs more than the product) and awaited by polling its last event;
        None if it could not launch (the worker thread then runs it, with its out-of-memory retry)."""
        try:
            pending = cuda.launch(spec, w, parts, outs=outs)
        except Exception as exc:
            log.debug("launch on the event loop failed (%s); the worker thread runs it", exc)
            return None
        done, t0 = cuda.events[4], time.perf_counter()
        while True:
            # yield at least once: a product done by the end of its own launch would otherwise return without the
            # loop ever running anything else, and a caller that submits again at once would keep it for good
            await asyncio.sleep(0 if time.perf_counter() - t0 < POLL_SPIN_S else POLL_SLEEP_S)
            if done.done:
                return cuda.finish(pending)

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

    def weights(self, model: Model, info: TensorInfo, scheme: Scheme | None = None,
                part: Part | None = None) -> Weights:
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

    def prepare(self, model: Model, info: TensorInfo, x: np.ndarray, kernel: str,
                values: bool = True) -> tuple[np.ndarray, KernelSpec | None]:
        """Every check a request can fail before it queues: X as float32, and its kernel (None: auto).
        `values` False leaves X's values (NaN, inf, Q8_1's range) to `check_values` after the product, where the
        device measured each row's max|x| (a pass over X on the host costs milliseconds at M = 512)."""
        if info.matmul_reason:
            raise ApiError(422, "unsupported_tensor", info.matmul_reason)
        self.check_activations(x, info)
        spec = self.choose(kernel, info, x.shape[0])
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = np.ascontiguousarray(x, dtype=np.float32)
        if values:
            self.check_values(info, x, x32, kernel, spec)
        return x32, None if kernel == "auto" else spec

    @staticmethod
    def check_values(info: TensorInfo, x: np.ndarray, x32: np.ndarray, kernel: str, spec: KernelSpec,
                     amax: float | None = None) -> None:
        """X's values: finite, and in the range of the Q8_1 kernels that may run it; `amax`: max|x32| where a
        device measured it (NaN and inf propagate), else computed here."""
        if amax is None:
            with np.errstate(invalid="ignore"):
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

    # -- where tensors live ----------------------------------------------------------------------
    def placement_of(self, backend: str, model: Model, info: TensorInfo, scheme: Scheme | None,
                     eff: TensorInfo) -> Placement:
        """A tensor's placement in a pool of several devices, decided at its first use if nothing placed it."""
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        found = self.placements[backend].get(key)
        if found is None:
            pool = self.pools[backend]
            found = placement.first_use(eff.shape[0], weight_bytes(eff), [w.memory()[1] for w in pool],
                                        [w.free() for w in pool])
            if found.split and scheme is not None and scheme.split_reason(eff.shape[1]):
                found = placement.first_use(eff.shape[0], 0, [1] * len(pool), [w.free() for w in pool])
            self.placements[backend].set(key, found)
        return found

    def place(self, backend: str, model: Model, info: TensorInfo, scheme: Scheme | None, devices: list[int],
              how: Literal["replicate", "split"]) -> Placement:
        """POST .../load's placement: `devices` (pool indices) each with a copy, or one copy split by rows."""
        if how == "split" and len(devices) > 1 and scheme is not None:
            reason = scheme.split_reason(info.shape[1])
            if reason:
                raise ApiError(422, "cannot_split", f"{info.name} in {scheme.tag} cannot be split by rows: {reason}")
        found = placement.requested(info.shape[0], devices, how)
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        old = self.placements[backend].get(key)
        self.placements[backend].set(key, found)
        if old is not None and old.replicas != found.replicas:  # placed anew: the old copies go (the new upload)
            for d in old.devices():
                self.pools[backend][d].unload(lambda k: k == (model.version_key, info.name))
        return found

    # -- running ----------------------------------------------------------------------------------
    async def matmul(self, model: Model, info: TensorInfo, x: np.ndarray, kernel: str,
                     scheme: Scheme | None = None) -> Answer:
        """A request's product, through the scheduler of the device that holds its tensor (which may batch it
        with others of this tensor in the same weight format); on every device of a split tensor at once."""
        eff = self.effective(info, scheme)
        # large X on a GPU: its values are checked from the max|x| per row the device measures as it quantizes
        on_device = x.size > INLINE_VALUES and self.cuda is not None
        if x.size <= INLINE_VALUES or (on_device and x.dtype == np.float32 and x.flags.c_contiguous):
            x32, spec = self.prepare(model, eff, x, kernel, values=not on_device)
        else:  # large X: its checks (or its conversion) take milliseconds, off the event loop
            x32, spec = await run_in_threadpool(self.prepare, model, eff, x, kernel, not on_device)
        chosen = spec or self.choose("auto", eff, x32.shape[0])
        backend = chosen.backend
        pool = self.pools[backend]
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        if len(pool) == 1:  # one device: nothing to place
            replica: Replica = (Part(0, 0, info.shape[0]),)
        else:
            found = self.placement_of(backend, model, info, scheme, eff)
            replica = self.placements[backend].pick(found, lambda d: pool[d].load())
        # a large output is written by the GPU into pinned memory of its own: no copy, no join of a split's blocks
        out = self.outputs.array((x32.shape[0], eff.shape[0])) if backend == "cuda" and self.outputs else None
        if len(replica) == 1 and replica[0].rows == info.shape[0]:
            job = Job(model, info, scheme, eff, None)
            answer = await pool[replica[0].device].scheduler.submit(
                key, job, x32, spec, lambda rows: self.choose("auto", eff, rows), out)
            answer.devices = [pool[replica[0].device].label]
        else:
            answer = await self._split(pool, replica, key, model, info, scheme, eff, x32, kernel, spec, out)
        # a value out of range (or a backend that did not measure X): the host finds what and where
        if on_device and (answer.x_amax is None or not q8_1_in_range(answer.x_amax)):
            await run_in_threadpool(self.check_values, eff, x, x32, kernel, chosen, answer.x_amax)
        if answer.result.finite is not True and not np.isfinite(answer.output).all():  # unless the device checked
            r, c = (int(v) for v in np.argwhere(~np.isfinite(answer.output))[0])
            raise ApiError(422, "product_out_of_range",
                           f"the product overflows float32 (first at row {r}, column {c}): scale the activations down")
        return answer

    async def _split(self, pool: list[Worker], replica: Replica, key: tuple, model: Model, info: TensorInfo,
                     scheme: Scheme | None, eff: TensorInfo, x32: np.ndarray, kernel: str,
                     spec: KernelSpec | None, out: np.ndarray | None) -> Answer:
        """Each device multiplies its block of rows at once, and its block of output columns goes into `out` (or
        the blocks are joined, without one).  Rows of W are independent in every kernel, so the blocks make the
        whole product by the kernels that ran."""
        m, calls = x32.shape[0], []
        for part in replica:
            eff_part = dataclasses.replace(eff, shape=(part.rows, eff.shape[1]))
            part_spec = None if spec is None else self.choose(kernel, eff_part, m)
            job = Job(model, info, scheme, eff_part, part)
            calls.append(pool[part.device].scheduler.submit(
                (*key, part.start, part.stop), job, x32, part_spec,
                lambda rows, e=eff_part: self.choose("auto", e, rows),
                None if out is None else out[:, part.start:part.stop]))
        answers = await asyncio.gather(*calls)
        first = answers[0]
        timing = {t: max(a.result.timing_ms.get(t, 0.0) for a in answers) for t in first.result.timing_ms}
        finite = True if all(a.result.finite for a in answers) else None
        x_amax = None if any(a.x_amax is None for a in answers) else first.x_amax  # every part saw the same X
        result = Result(np.concatenate([a.output for a in answers], axis=1) if out is None else out,
                        first.result.backend, first.result.activation_format, timing,
                        finite=finite)  # the parts ran at once: each step's slowest
        return Answer(result.output, first.spec, result, first.batch, max(a.queue_ms for a in answers),
                      [pool[p.device].label for p in replica], x_amax)

    async def _run_batch(self, worker: Worker, job: Job, spec: KernelSpec | None, parts: list[np.ndarray],
                         alone: bool = False, outs: list[np.ndarray | None] | None = None) -> tuple[KernelSpec, Result]:
        """One product of stacked rows on `worker`'s device: on its thread, so that the event loop takes in
        requests meanwhile; a lone small product on resident weights from the event loop itself."""
        rows = sum(p.shape[0] for p in parts)
        if spec is None:
            spec = self.choose("auto", job.eff, rows)
        w = self.weights(job.model, job.info, job.scheme, job.part)
        if spec.backend != worker.kind:  # auto fell back to the other backend: its first device runs it
            worker = self.pools[spec.backend][0]
        worker.products += 1
        if spec.backend == "cuda":
            cuda = worker.cuda
            if alone and rows <= LOOP_ROWS and cuda.resident_for(spec, w):
                result = await self._on_loop(cuda, spec, w, parts, outs)
                if result is not None:
                    return spec, result
            future = cuda.submit(lambda: cuda.run_here(spec, w, parts, outs=outs))
        else:
            cpu = worker.cpu
            x = parts[0] if len(parts) == 1 else np.concatenate(parts)
            future = worker.submit(lambda: cpu.run(spec.name, w, x))
        try:
            return spec, await asyncio.wrap_future(future)
        except DeviceOutOfMemory as exc:
            raise ApiError(503, "gpu_out_of_memory", str(exc), headers={"Retry-After": "1"}) from None

    def preload(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None = None,
                devices: list[int] | None = None, how: Literal["replicate", "split"] | None = None,
                backend: str | None = None) -> list[dict[str, Any]]:
        """Put tensors on their devices ahead of the first request, in the layouts `kernel` (default: what auto
        picks) reads, as stored or requantized to `scheme`: where `devices`/`how` say (pool indices of
        `backend`'s pool), else where first use would."""
        backend = backend or self.backend
        pool = self.pools[backend]
        loaded = []
        for info in infos:
            eff = self.effective(info, scheme)
            n, k = eff.shape
            if devices is not None or how is not None:
                found = self.place(backend, model, info, scheme, devices or list(range(len(pool))), how or "replicate")
            elif len(pool) > 1:
                found = self.placement_of(backend, model, info, scheme, eff)
            else:
                found = Placement([(Part(0, 0, n),)], "single", n)
            for replica in found.replicas:
                for part in replica:
                    eff_part = dataclasses.replace(eff, shape=(part.rows, k))
                    if kernel:
                        specs = [self.choose(kernel, eff_part, 1)]
                    elif backend == "cuda":
                        specs = [s for m in (1, 512)
                                 if (s := self.cuda.auto(eff.type_name, m, part.rows, k)) is not None]
                    else:
                        specs = [self.choose("auto", eff_part, 1)]
                    worker = pool[part.device]
                    for spec in {s.weight_layout: s for s in specs if s.backend == backend}.values():
                        w = self.weights(model, info, scheme, part)
                        try:
                            nbytes = worker.prepare(spec, w)
                        except DeviceOutOfMemory as exc:
                            raise ApiError(503, "gpu_out_of_memory", str(exc)) from None
                        loaded.append({"tensor": info.name, "layout": w.layout_key(spec.weight_layout),
                                       "n_bytes": nbytes, "device": worker.label})
        return loaded

    def unload(self, model: Model, tensors: set[str] | None) -> int:
        """Free a model's weights (or the named tensors') on every device, and forget where they were placed."""
        for table in self.placements.values():
            table.drop(model.version_key, tensors)
        return sum(w.unload(lambda key: key[0] == model.version_key and (tensors is None or key[1] in tensors))
                   for w in self.workers)

    def residency(self, model: Model) -> dict[str, Any]:
        """What of a model's tensors each device holds, and where its placed tensors live."""
        backend = self.backend
        rows = [{"tensor": key[1], "layout": layout, "n_bytes": size, "device": w.label}  # type: ignore[index]
                for w in self.pools[backend] for key, layout, size in w.entries()
                if key[0] == model.version_key]  # type: ignore[index]
        pool = self.pools[backend]
        placed = [{"tensor": name, "weight_format": tag or "gguf", "how": p.how,
                   "replicas": [[{"device": pool[part.device].label, "rows": [part.start, part.stop]} for part in r]
                                for r in p.replicas]}
                  for name, tag, p in self.placements[backend].of(model.version_key)]
        return {"backend": backend, "n_bytes": sum(r["n_bytes"] for r in rows), "tensors": rows,
                "placements": placed}

    def forget(self, model: Model) -> None:
        """The store retired this file version (its file changed or went): drop its prepared and resident
        weights, each on the thread of the device that fills them, so that no fill in flight outlives the drop."""
        for table in self.placements.values():
            table.drop(model.version_key)
        for w in self.workers:
            w.forget(model.version_key)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.outputs is not None:
            self.outputs.release()
