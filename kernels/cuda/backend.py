"""The CUDA backend of one GPU (a Backend, kernels/backend.py): a worker thread that owns the device's stream,
compiled modules and resident weights, so that concurrent requests never race on device state.  A host with
several GPUs runs one of these per device; calls from other threads (the event loop's inline launches) enter
the device's context first.

A request is: weights from the resident store (uploaded on first use), activations uploaded,
quantized to Q8_1 on the device (or cast for the fp16/fp32 kernels), the GEMM, the download; each
step timed with CUDA events on the worker's stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import cupy
import numpy as np

from kernels import reference
from kernels.backend import Outs, RowAddresses, of_version
from kernels.cuda import graphs as product_graphs
from kernels.cuda.host_memory import all_finite, copy_in, is_page_locked
from kernels.cuda.kernels import CudaKernel
from kernels.cuda.layouts import ACTIVATIONS, ActivationLayout
from kernels.cuda.modules import SOURCES, Modules
from kernels.cuda.resident import ResidentWeights, is_oom
from kernels.errors import DeviceOutOfMemory
from kernels.kernel import Kernel
from kernels.types import Result, Weights

log = logging.getLogger("qgemm")
R = TypeVar("R")
# outputs of at least this many values are checked for NaN/inf on the device (a reduction of microseconds)
# rather than by the engine on the host (a pass over the output on the event loop: 10 ms at 15M values)
FINITE_ON_DEVICE = 1 << 18
# products with a part of more than this many activation values report each part's max|x|, measured on the device:
# the engine then checks X's values from it instead of by two passes over X on the host (Engine.check_values);
# smaller parts the engine checked on the host already
X_AMAX_ON_DEVICE = 1 << 16
# a part's rows of Y are copied by the device straight into the caller's (pinned) array from this size; smaller ones
# come back in one download of the whole product and are copied on the host (a DMA call per part costs more CPU
# than copying its few KiB: a batch of 64 single rows spent 10% of an engine's time in those calls, H100 machine)
DIRECT_OUT_BYTES = 1 << 20
DIRECT_IN_BYTES = 1 << 20  # X of this size or more is uploaded from page-locked memory where it is (no staging copy)
# products of up to this many rows (without the device checks of large X or Y) replay a CUDA graph (graphs.py)
GRAPH_ROWS = 64
# a product whose rows the graph gathers and scatters (rows.cu; its scatter checks Y finite) replays up to this many
# rows: past GRAPH_ROWS its graph is captured for M rounded up to a multiple of GRAPH_ROWS, the extra rows reading the
# first X row and writing a spare row, so that a few graphs serve every M of a busy server's batches (at 256 clients
# many batches are over 64 rows, and each launched step by step costs the engine hundreds of µs of Python)
GATHERED_GRAPH_ROWS = 512
HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
# max|x| of each row, NaN counted as infinity (numpy twin: np.where(np.isnan(x), np.inf, np.abs(x)).max(axis=1))
# (2139095040 is infinity's bits; CuPy renames the parameter's name wherever it appears, so no hex literal)
_row_amax = cupy.ReductionKernel("float32 v", "float32 y", "isnan(v) ? __int_as_float(2139095040) : fabsf(v)",
                                 "fmaxf(a, b)", "y = a", "0.0f", "qgemm_row_amax")


class Options(Protocol):
    """What the backend reads of the service's settings (app.settings.Settings has both)."""
    gpu_memory_bytes: int | None
    dependent_launch: bool
    cuda_graphs: bool


class Staging:
    """Pinned host buffers, reused across requests and grown when a larger one is needed: copies
    from and to them are truly asynchronous on the worker's stream, and nothing is allocated per request."""

    def __init__(self) -> None:
        self._mem: dict[str, Any] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        mem = self._mem.get(name)
        if mem is None or mem.size() < nbytes:
            mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1 << 16, 2 * (mem.size() if mem else 0)))
            self._mem[name] = mem
        return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)


@dataclass
class Pending:
    """A product enqueued by `CudaBackend.launch`, waiting for its last event."""
    kernel: Kernel
    m: int
    k: int
    y_h: np.ndarray | None  # None: the rows went straight into the callers' output arrays
    acts: Any
    weights_ms: float
    layout: ActivationLayout
    finite_h: np.ndarray | None = None  # the device's "every output value is finite", for large outputs
    amax_h: np.ndarray | None = None  # max|x| per row, measured on the device, for products of large X
    part_rows: tuple[int, ...] = ()  # rows of each part, to give each its own max|x|
    outs: Outs = None  # where each part's rows go from the staging buffer (small parts: `finish` copies them)


def as_cuda(kernel: Kernel) -> CudaKernel:
    """A kernel this backend launches: the layout seam (its weight and activation layouts, its launch) is
    CudaKernel's; a CPU kernel asked of a GPU is a caller's bug."""
    if not isinstance(kernel, CudaKernel):
        raise TypeError(f"{kernel.name} is not a CUDA kernel")
    return kernel


def cuda_device_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def cuda_device_present() -> bool:
    return cuda_device_count() > 0


class Launched:
    """A product launched from the caller's thread (`CudaBackend.launch_inline`): done when its last event is."""

    def __init__(self, backend: CudaBackend, pending: Pending):
        self._backend, self._pending = backend, pending

    @property
    def done(self) -> bool:
        return bool(self._backend.events[4].done)

    def result(self) -> Result:
        return self._backend.finish(self._pending)


class CudaBackend:
    name = "cuda"

    def __init__(self, settings: Options, sources: tuple[str, ...] = SOURCES, device: int = 0):
        self.device_id = device
        self.label = f"cuda:{device}"
        self._device = cupy.cuda.Device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"qgemm-gpu{device}")
        self._closed = threading.Event()
        self._call(lambda: self._start(settings, sources))

    def _start(self, settings: Options, sources: tuple[str, ...]) -> None:
        self._device.use()  # the worker thread's device, for good
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"]
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.cc = int(props["major"]) * 10 + int(props["minor"])
        self.sm_count = int(props["multiProcessorCount"])
        self.l2_bytes = int(props["l2CacheSize"])
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = Staging()
        self.events = [cupy.cuda.Event() for _ in range(5)]
        # output arrays the device is still writing, each with the event after its copies: kept alive until then,
        # so that a request cancelled meanwhile cannot return its pinned buffer for reuse under the copy
        self.writing: list[tuple[cupy.cuda.Event, list[np.ndarray]]] = []
        free, total = cupy.cuda.runtime.memGetInfo()
        budget = settings.gpu_memory_bytes if settings.gpu_memory_bytes is not None else int(free * 0.8)
        self.total_memory = int(total)
        self.graphs = product_graphs.ProductGraphs() \
            if getattr(settings, "cuda_graphs", True) and product_graphs.available() else None
        self.capture_stream = cupy.cuda.Stream(non_blocking=True)  # graphs are captured here: nothing else runs on it
        self.resident = ResidentWeights(budget, None if self.graphs is None else self.graphs.drop_weights)
        self.modules = Modules(self.cc, self.sm_count, sources, dependent_launch=settings.dependent_launch)
        for src, err in self.modules.errors.items():
            log.error("CUDA source %s failed to compile: %s", src, err)
        # a replayed product may read X's rows and write Y's where a caller's page-locked memory holds them (rows.cu):
        # where kernels can use a registered host pointer as it is, and the source compiled
        self.row_kernels: tuple[Any, Any] | None = None
        if self.graphs is not None and "rows.cu" in self.modules.modules and cupy.cuda.runtime.deviceGetAttribute(
                HOST_POINTER_FOR_REGISTERED_MEM, self.device_id) == 1:
            self.row_kernels = (self.modules.function("rows.cu", "gather_rows"),
                                self.modules.function("rows.cu", "scatter_rows"))
        self.resolve_entry_points()
        t0 = time.perf_counter()
        with self.stream:
            warm_up()
        self.warm_up_ms = (time.perf_counter() - t0) * 1e3

    def resolve_entry_points(self) -> None:
        """Every entry point each kernel this device runs declares (CudaKernel.entry_points), looked up now: a name
        its source lacks fails the start, where it used to fail the first request that launched it."""
        from kernels.registry import KERNELS

        missing = []
        for kernel in KERNELS.values():
            if not isinstance(kernel, CudaKernel) or self.kernel_reason(kernel) is not None:
                continue
            for type_name in kernel.weight_types:
                for name in kernel.entry_points(type_name):
                    try:
                        self.modules.function(kernel.source, name)
                    except Exception:
                        missing.append(f"{kernel.name}: {name} in {kernel.source}")
        if missing:
            raise RuntimeError("kernels name CUDA functions their sources lack: " + "; ".join(sorted(set(missing))))

    # -- the worker thread ----------------------------------------------------------------------
    def _call(self, fn: Callable[[], R]) -> R:
        if self._closed.is_set():
            raise RuntimeError("the CUDA backend is closed")
        return self._pool.submit(fn).result()

    def on_thread(self, fn: Callable[[], R]) -> Future[R]:
        """Run fn on the worker thread without waiting (tools and tests that touch device state)."""
        if self._closed.is_set():
            raise RuntimeError("the CUDA backend is closed")
        return self._pool.submit(fn)

    def submit(self, kernel: Kernel, w: Weights, parts: list[np.ndarray], outs: Outs = None) -> Future[Result]:
        """The product on the worker thread, without waiting (the service's scheduler awaits the future)."""
        if self._closed.is_set():
            raise RuntimeError("the CUDA backend is closed")
        return self._pool.submit(self.run_here, kernel, w, parts, False, False, outs)

    def launch_inline(self, kernel: Kernel, w: Weights, parts: list[np.ndarray], outs: Outs = None,
                      rows: RowAddresses = None) -> Launched | None:
        """A product on resident weights enqueued from the calling thread (a launch costs microseconds, a thread
        round trip more); None where the weights are not resident or the launch failed (then `submit` it: the
        worker thread has the out-of-memory retry).  `rows`: where X's and Y's rows lie in page-locked memory (a
        replayed product then reads and writes them there: no host copy)."""
        if not self.resident.has(w.key, w.layout_key(kernel.weights.name)):
            return None
        try:
            return Launched(self, self.launch(kernel, w, parts, outs=outs, rows=rows))
        except Exception as exc:
            log.debug("launch on the calling thread failed (%s); the worker thread runs it", exc)
            return None

    def close(self) -> None:
        if not self._closed.is_set():
            self._call(lambda: self.resident.evict_all())
            self._closed.set()
            self._pool.shutdown(wait=True)

    # -- the registry's questions ---------------------------------------------------------------
    @property
    def compile_ms(self) -> float:
        """NVRTC's time at start-up: our sources, then CuPy's own kernels the products use."""
        return self.modules.compile_ms + self.warm_up_ms

    def kernel_reason(self, kernel: Kernel) -> str | None:
        """Why `kernel` cannot run on this GPU (its compute capability, a source that did not compile), or None;
        CPU kernels run beside it."""
        if kernel.backend != "cuda":
            return None
        reason = kernel.device_reason(self.cc)
        if reason is not None:
            return reason
        src = as_cuda(kernel).source
        if src in self.modules.errors:
            return f"{src} failed to compile: {self.modules.errors[src]}"
        if src not in self.modules.modules:
            return f"{src} is not built by this server"
        return None

    def auto(self, type_name: str, m: int, n: int, k: int) -> Kernel | None:
        from kernels.tuning import pick

        return pick(self, type_name, m, n, k)

    # -- weights ----------------------------------------------------------------------------------
    def _weights(self, spec: Kernel, w: Weights) -> tuple[dict, float]:
        layout = as_cuda(spec).weights
        nbytes = layout.nbytes(w.type_name, w.n, w.k)
        return self.resident.get(w.key, w.layout_key(layout.name), nbytes,
                                 lambda: layout.make(self.modules, w.type_name, w.raw(), w.n, w.k))

    def prepare(self, kernel: Kernel, w: Weights) -> int:
        """The weights `kernel` reads, uploaded in its layout and kept resident; their bytes."""
        def run() -> int:
            with self.stream:
                arrays, _ = self._weights(kernel, w)
            return sum(int(a.nbytes) for a in arrays.values())
        return self._call(run)

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Free the resident weights whose (file version, tensor) key matches, after the product in flight;
        the bytes freed."""
        return self._call(lambda: self.resident.unload(match))

    def forget(self, version_key: Hashable) -> None:
        """Free a file version's weights, after the product in flight (on the worker thread, so that no
        upload that began before can land after), without waiting."""
        if self._closed.is_set():
            return
        try:
            self._pool.submit(lambda: self.resident.unload(of_version(version_key)))
        except RuntimeError:  # shutting down: the thread is gone, and the memory with it
            pass

    def memory(self) -> tuple[int, int]:
        """(weight bytes resident, the budget)."""
        return sum(size for _, _, size in self.resident.entries()), self.resident.budget

    def entries(self) -> list[tuple[Hashable, str, int]]:
        return self.resident.entries()

    # -- a matmul ---------------------------------------------------------------------------------
    def run(self, spec: Kernel, w: Weights, x: np.ndarray | list[np.ndarray], poison: bool = False,
            keep_q8_1: bool = False, outs: Outs = None) -> Result:
        return self._call(lambda: self.run_here(spec, w, x, poison, keep_q8_1, outs))

    def run_here(self, spec: Kernel, w: Weights, x: np.ndarray | list[np.ndarray], poison: bool = False,
                 keep_q8_1: bool = False, outs: Outs = None) -> Result:
        """On the worker thread: X (or its row blocks, stacked as they are copied in) times W.  With `outs` (an
        array per block, pinned: kernels/cuda/host_memory.py) each block's rows of Y are copied into its array
        and the Result's output is None."""
        parts = [x] if isinstance(x, np.ndarray) else x
        try:
            return self._run(spec, w, parts, poison, keep_q8_1, outs)
        except DeviceOutOfMemory:
            raise
        except Exception as exc:
            if not is_oom(exc):
                raise
            # free what requests left in the pool and cached weights, then try once more
            self.resident.evict_all()
            cupy.get_default_memory_pool().free_all_blocks()
            try:
                return self._run(spec, w, parts, poison, keep_q8_1, outs)
            except Exception as exc2:
                if is_oom(exc2):
                    m = sum(p.shape[0] for p in parts)
                    raise DeviceOutOfMemory(f"GPU out of memory running {spec.name} on M={m}, "
                                            f"N={w.n}, K={w.k}") from None
                raise

    def _run(self, spec: Kernel, w: Weights, parts: list[np.ndarray], poison: bool,
             keep_q8_1: bool, outs: Outs) -> Result:
        pending = self.launch(spec, w, parts, poison, outs)
        self.events[4].synchronize()  # the one synchronization of a product (or a batch)
        return self.finish(pending, keep_q8_1)

    def launch(self, spec: Kernel, w: Weights, parts: list[np.ndarray], poison: bool = False,
               outs: Outs = None, rows: RowAddresses = None) -> Pending:
        """Enqueue a product on the stream (copies in, quantize, GEMM, copy out) and return at once;
        `events[4]` completes with it.  One product at a time: the staging buffers are its own."""
        with self._device:  # a no-op on the worker thread; the event loop's thread may be on another device
            return self._launch(spec, w, parts, poison, outs, rows)

    def _launch(self, kernel: Kernel, w: Weights, parts: list[np.ndarray], poison: bool, outs: Outs,
                rows: RowAddresses = None) -> Pending:
        spec = as_cuda(kernel)
        m, k, n = sum(p.shape[0] for p in parts), parts[0].shape[1], w.n
        filled = [o for o in outs if o is not None] if outs is not None else []  # every part's array, or none
        given = len(filled) == len(parts)
        direct = given and min(p.shape[0] for p in parts) * n * 4 >= DIRECT_OUT_BYTES
        # the rows' addresses, one for each row of X and of Y, where the device can read and write them there
        gathered = (given and rows is not None and self.row_kernels is not None
                    and len(rows[0]) == m and len(rows[1]) == m)
        if (self.graphs is not None and not poison and not direct
                and (m <= GATHERED_GRAPH_ROWS if gathered else m <= GRAPH_ROWS and m * n < FINITE_ON_DEVICE)
                and max(p.shape[0] for p in parts) * k <= X_AMAX_ON_DEVICE):
            replayed = self._replay(spec, w, parts, m, k, n, outs if given else None,
                                    rows if gathered else None)  # reads X where it is, or copies it into its input
            if replayed is not None:
                return replayed
        # large parts already in page-locked memory (a front's arena, registered by the engine) are uploaded from
        # where they are; else the one host copy: request rows straight into pinned staging
        x_h = None
        if not (m * k * 4 >= DIRECT_IN_BYTES and all(p.flags.c_contiguous and p.dtype == np.float32
                                                      and is_page_locked(p) for p in parts)):
            x_h = self.staging.array("x", (m, k), np.float32)
            row = 0
            for p in parts:
                copy_in(x_h[row:row + p.shape[0]], p)
                row += p.shape[0]
        y_h = None if direct else self.staging.array("y", (m, n), np.float32)
        ev = self.events
        with self.stream as s:
            arrays, weights_ms = self._weights(spec, w)
            ev[0].record(s)
            x_d = cupy.empty((m, k), dtype=cupy.float32)  # from CuPy's pool: no cudaMalloc once warm
            if x_h is not None:
                x_d.set(x_h, stream=s)
            else:
                row = 0
                for p in parts:
                    x_d[row:row + p.shape[0]].set(p, stream=s)
                    row += p.shape[0]
            ev[1].record(s)
            layout = spec.activations_for(w.type_name)
            bufs = layout.buffers(m, k)
            if poison and layout.quantized:
                layout.poison(bufs)
            acts = layout.fill(self.modules, x_d, bufs)
            ev[2].record(s)
            y_d = cupy.empty((m, n), dtype=cupy.float32)
            if poison:
                y_d.fill(cupy.nan)
            spec.launch(self.modules, w.type_name, arrays, acts, y_d, m, n, k)
            ev[3].record(s)
            finite_h = amax_h = None
            if max(p.shape[0] for p in parts) * k > X_AMAX_ON_DEVICE:
                amax_h = self.staging.array("amax", (m,), np.float32)
                _row_amax(x_d, axis=1).get(stream=s, out=amax_h, blocking=False)
            if m * n >= FINITE_ON_DEVICE:
                finite_h = self.staging.array("finite", (1,), np.bool_)
                cupy.isfinite(y_d).all().reshape(1).get(stream=s, out=finite_h, blocking=False)
            if y_h is not None:
                y_d.get(stream=s, out=y_h, blocking=False)
            else:
                copy_rows_out(y_d, parts, filled, s)
                written = cupy.cuda.Event(disable_timing=True)
                written.record(s)
                self.writing = [(e, o) for e, o in self.writing if not e.done] + [(written, filled)]
            ev[4].record(s)
        return Pending(spec, m, k, y_h, acts, weights_ms, layout, finite_h, amax_h, tuple(p.shape[0] for p in parts),
                       outs if given and not direct else None)

    def _replay(self, spec: CudaKernel, w: Weights, parts: list[np.ndarray], m: int, k: int, n: int,
                outs: Outs, rows: RowAddresses = None) -> Pending | None:
        """The product from its CUDA graph (captured at its second sight), or None: launch it step by step.  With
        `rows` (every row in page-locked memory the device addresses: `_launch` checked them) its graph gathers X's
        rows and scatters Y's rows where they lie, and checks Y finite as it writes them."""
        graphs = self.graphs
        assert graphs is not None
        layout_key = w.layout_key(spec.weights.name)
        gathered = rows is not None
        graph_m = product_graphs.bucket(m, GRAPH_ROWS) if gathered else m
        if graph_m != m and spec.shape_reason(w.type_name, graph_m, n, k) is not None:
            return None  # (a kernel of a bounded M): step by step
        key = (w.key, layout_key, w.type_name, n, k, spec.name, graph_m, gathered)
        if key in graphs.failed:
            return None
        with self.stream:
            arrays, weights_ms = self._weights(spec, w)
        replay = graphs.get(key, arrays)
        if replay is None:
            if weights_ms or graphs.first_sight(key):
                return None
            replay = self._capture(key, spec, w, arrays, graph_m, k, n, rows)
            if replay is None:
                return None
        if replay.table is not None:
            assert rows is not None
            replay.aim(rows)
            replay.graph.launch(self.stream)
            return Pending(spec, m, k, None, replay.acts, 0.0, spec.activations_for(w.type_name), replay.finite,
                           part_rows=tuple(p.shape[0] for p in parts))
        assert replay.x_h is not None
        row = 0
        for p in parts:
            replay.x_h[row:row + p.shape[0]] = p
            row += p.shape[0]
        replay.graph.launch(self.stream)
        return Pending(spec, m, k, replay.y_h, replay.acts, 0.0, spec.activations_for(w.type_name),
                       part_rows=tuple(p.shape[0] for p in parts), outs=outs)

    def _capture(self, key: tuple, spec: CudaKernel, w: Weights, arrays: dict, m: int, k: int,
                 n: int, rows: RowAddresses = None) -> product_graphs.Replay | None:
        """Capture the product of `key` (M = `m` rows) and check one replay (its events must time it); None where it
        cannot be captured (that key then always launches step by step).  With `rows` (as many or fewer than M), a
        graph that gathers and scatters rows by its table, checked on these rows (the replay that follows computes
        the same)."""
        graphs, mods, ev = self.graphs, self.modules, self.events
        assert graphs is not None
        layout = spec.activations_for(w.type_name)

        def enqueue(x_d: Any, bufs: Any, y_d: Any) -> Any:
            acts = layout.fill(mods, x_d, bufs)
            product_graphs.record_in_graph(ev[2], self.capture_stream)
            spec.launch(mods, w.type_name, arrays, acts, y_d, m, n, k)
            return acts

        dependent = mods.dependent_launch
        mods.dependent_launch = False  # inside a graph, the kernels follow a copy node: no programmatic edge
        try:
            replay = product_graphs.capture(cupy, self.capture_stream, ev, m, k, n, lambda: layout.buffers(m, k),
                                            enqueue, self.row_kernels if rows is not None else None)
            if replay.table is not None:
                assert rows is not None
                replay.aim(rows)
            else:
                assert replay.x_h is not None
                replay.x_h[...] = 0
            replay.graph.launch(self.stream)
            ev[4].synchronize()
            for i in range(4):
                cupy.cuda.get_elapsed_time(ev[i], ev[i + 1])
        except Exception as exc:
            log.warning("a CUDA graph of %s (M=%d, N=%d, K=%d) could not be captured (%s): it runs step by step",
                        spec.name, m, n, k, exc)
            if len(graphs.failed) > 16 * graphs.kept:  # bounded, like `seen`
                graphs.failed.clear()
            graphs.failed.add(key)
            return None
        finally:
            mods.dependent_launch = dependent
        replay.weights, replay.weight_key = arrays, (w.key, w.layout_key(spec.weights.name))
        graphs.put(key, replay)
        return replay

    def finish(self, pending: Pending, keep_q8_1: bool = False) -> Result:
        """After `events[4]` completed: the output (copied off the staging buffer) and the timing."""
        ev = self.events
        q8_1 = None
        if keep_q8_1 and pending.layout.quantized:
            with self._device, self.stream:
                q8_1 = pending.layout.to_host(pending.acts, pending.m, pending.k)
        y = None
        if pending.outs is not None:  # each part's rows into its caller's array
            assert pending.y_h is not None, "a product with its outputs in staging"
            row = 0
            for rows, out in zip(pending.part_rows, pending.outs, strict=True):
                out[...] = pending.y_h[row:row + rows]
                row += rows
        elif pending.y_h is not None:
            y = pending.y_h.copy()  # the staging buffer is the next product's
        t = [cupy.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(4)]
        timing = {"weights": pending.weights_ms, "upload": t[0], "quantize": t[1], "gemm": t[2], "download": t[3],
                  "total": pending.weights_ms + sum(t)}
        finite = None if pending.finite_h is None else bool(pending.finite_h[0])
        if finite is None and pending.y_h is not None and all_finite(pending.y_h):
            finite = True  # one pass for the batch: else each request's rows are checked, as without it
        x_amax = None
        if pending.amax_h is not None:
            ends = np.cumsum(pending.part_rows)
            x_amax = [float(pending.amax_h[e - rows:e].max()) for rows, e in zip(pending.part_rows, ends, strict=True)]
        return Result(y, self.name, pending.kernel.activation_format, timing, q8_1, finite, x_amax)

    def quantize(self, x: np.ndarray, layout: str = "blocks") -> reference.Q8_1:
        """The device's Q8_1 of x in an activation layout ("blocks", "split", "mmq_d4", "mmq_ds4", ...; for tests)."""
        lay = ACTIVATIONS[layout]

        def run() -> reference.Q8_1:
            with self.stream as s:
                x_d = cupy.asarray(np.ascontiguousarray(x, dtype=np.float32))
                bufs = lay.buffers(*x.shape)
                lay.poison(bufs)
                lay.fill(self.modules, x_d, bufs)
                out = lay.to_host(bufs, *x.shape)
                s.synchronize()
            return out
        return self._call(run)



def warm_up() -> None:
    """CuPy compiles its own elementwise and reduction kernels (NVRTC) at their first call, seconds each on a cold
    cache: the checks a product makes (max|x| per row, finite outputs) and the fills run here at start-up on
    the sizes that pick their variants, so that no request waits for a compile (on the H100 machine a cold one held
    the first products of larger batches for 3 to 5 s)."""
    for m, k, n in ((1, 32, 8), (64, 4096, 4096), (512, 4096, 14336)):
        x = cupy.ones((m, k), dtype=cupy.float32)
        y = cupy.ones((m, n), dtype=cupy.float32)
        _row_amax(x, axis=1).get()
        cupy.isfinite(y).all().get()
        y.fill(0)
    cupy.cuda.get_current_stream().synchronize()


def copy_rows_out(y_d: cupy.ndarray, parts: list[np.ndarray], outs: list[np.ndarray], stream: cupy.cuda.Stream) -> None:
    """Each part's rows of Y [M, N] into its own host array, asynchronously on `stream`: a 2-D copy, so that an
    array may be a block of columns of a wider one (a split tensor's share of the request's output)."""
    n, row = y_d.shape[1], 0
    for p, o in zip(parts, outs, strict=True):
        rows = p.shape[0]
        if o.shape != (rows, n) or o.dtype != np.float32 or o.strides[1] != 4:
            raise ValueError(f"an output block {o.shape} (strides {o.strides}) cannot take {rows} x {n} float32")
        cupy.cuda.runtime.memcpy2DAsync(o.ctypes.data, o.strides[0], y_d.data.ptr + row * n * 4, n * 4, n * 4, rows,
                                        cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        row += rows
