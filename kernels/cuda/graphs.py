"""Small products replayed from CUDA graphs: the launch of a batch of a few rows costs one graph launch instead of a
dozen CuPy calls.

Launching a product step by step (upload, quantize, GEMM, download, and the events that time them) costs the
engine's thread some 400 µs of Python per batch on the H100 host, more than the GPU's work at M <= 64 (tens of
µs), so that the engine, not the GPU, bounded a server's requests per second.  A product of M rows on a tensor's
resident weights is captured once (its second time: the first runs as usual and warms up whatever allocates on
first use), with buffers of its own at fixed addresses (pinned host X and Y, device X, the activation layout's
buffers, Y), and replayed after X's rows are copied into its pinned X.  The events that time each step are
recorded inside the graph (external event records), so the answer's timing is the same.

A graph reads the weights' device arrays it was captured with: it holds them, and is dropped when the resident
store drops them (eviction, unload, a changed file) or when the store hands out other arrays under the same key.
Graphs are kept least recently used first, up to GRAPHS_KEPT and GRAPH_BYTES of buffers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("qgemm")
GRAPHS_KEPT = 512
GRAPH_BYTES = 256 << 20  # device bytes of the graphs' own buffers (as much again of pinned host memory)
_EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL: an event record node inside a captured graph


def _driver_record() -> Any:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuEventRecordWithFlags
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RECORD = _driver_record()


def record_in_graph(event: Any, stream: Any) -> None:
    """`event` recorded on a capturing `stream` as a node of the graph (a plain record would only order the capture)."""
    err = _RECORD(ctypes.c_void_p(event.ptr), ctypes.c_void_p(stream.ptr), _EVENT_RECORD_EXTERNAL)
    if err != 0:
        raise RuntimeError(f"cuEventRecordWithFlags failed with CUresult {err}")


def available() -> bool:
    return _RECORD is not None


@dataclass(eq=False)
class Replay:
    """A captured product: its graph and the buffers the graph reads and writes."""

    graph: Any  # cupy.cuda.Graph
    x_h: np.ndarray | None  # pinned [M, K] float32: the rows are copied here before each replay (None: gathered)
    y_h: np.ndarray | None  # pinned [M, N] float32: the product lands here (None: scattered)
    acts: Any  # the activation layout's device buffers (keep_q8_1 reads them)
    weights: dict  # the resident arrays it reads (held: compared on each replay)
    weight_key: tuple[Hashable, str]  # (Weights.key, layout key): dropped with them
    nbytes: int
    keep: tuple[Any, ...]  # device and host memory the graph's nodes point at
    table: np.ndarray | None = None  # pinned uint64 [2M]: the X rows' and Y rows' addresses (a gathered product)
    finite: np.ndarray | None = None  # pinned int32 [1]: set to 1 before a replay, cleared by a non-finite Y value
    spare: int = 0  # a device row of N floats: where the rows past a batch's own are scattered

    def aim(self, rows: tuple[list[int], list[int]]) -> None:
        """Point a gathered product at a batch's rows (X's addresses, Y's): rows past the batch's (the graph's M may
        be larger) read its first X row and write the spare row; the finite flag set again."""
        assert self.table is not None and self.finite is not None
        m, g = len(rows[0]), len(self.table) // 2
        table = self.table
        table[:m] = rows[0]
        table[g:g + m] = rows[1]
        if m < g:
            table[m:g] = rows[0][0]
            table[g + m:] = self.spare
        self.finite[0] = 1


class ProductGraphs:
    """Captured products by (weights, layout, kernel, M), least recently used first.  The resident store drops
    weights from the device's thread while products launch from the event loop's: a lock keeps the table whole."""

    def __init__(self, kept: int = GRAPHS_KEPT, max_bytes: int = GRAPH_BYTES):
        self.kept, self.max_bytes = kept, max_bytes
        self._lock = threading.Lock()
        self.replays: OrderedDict[Hashable, Replay] = OrderedDict()
        self.seen: set[Hashable] = set()  # ran once the usual way: captured at the next
        self.failed: set[Hashable] = set()  # could not be captured: always the usual way
        self.nbytes = 0

    def get(self, key: Hashable, weights: dict) -> Replay | None:
        with self._lock:
            r = self.replays.get(key)
            if r is None:
                return None
            if r.weights is not weights:  # the store uploaded them again: the old graph reads freed memory
                self._pop(key)
                return None
            self.replays.move_to_end(key)
            return r

    def first_sight(self, key: Hashable) -> bool:
        """True the first time `key` comes (run it the usual way then), False after."""
        if key in self.seen:
            return False
        if len(self.seen) > 16 * self.kept:
            self.seen.clear()
        self.seen.add(key)
        return True

    def put(self, key: Hashable, replay: Replay) -> None:
        with self._lock:
            self._pop(key)
            self.replays[key] = replay
            self.nbytes += replay.nbytes
            while self.replays and (len(self.replays) > self.kept or self.nbytes > self.max_bytes):
                self._pop(next(iter(self.replays)))

    def _pop(self, key: Hashable) -> None:
        r = self.replays.pop(key, None)
        if r is not None:
            self.nbytes -= r.nbytes

    def drop_weights(self, weight_key: Hashable) -> None:
        """The resident store let go of these weights: the graphs that read them go too."""
        with self._lock:
            for key in [k for k, r in self.replays.items() if r.weight_key == weight_key]:
                self._pop(key)

    def clear(self) -> None:
        with self._lock:
            self.replays.clear()
            self.nbytes = 0


def bucket(m: int, step: int) -> int:
    """The M a gathered product of `m` rows is captured for: `m` up to `step`, past it the next multiple of `step`
    (a few graphs for the many M of a busy server's batches; Replay.aim points the extra rows at harmless ones)."""
    return m if m <= step else -(-m // step) * step


def capture(cupy: Any, stream: Any, events: list[Any], m: int, k: int, n: int, buffers: Callable[[], Any],
            enqueue: Callable[[Any, Any, Any], Any], rows: tuple[Any, Any] | None = None) -> Replay:
    """Capture one product of M rows on `stream` (a stream of its own: nothing else enqueues on it meanwhile):
    `buffers()` makes the activation layout's buffers (before the capture: a graph cannot allocate),
    `enqueue(x_d, bufs, y_d)` the quantize kernel, the record of events[2] and the GEMM (it returns the activations
    as the GEMM read them); events 0, 1, 3 and 4 are recorded here, as in an ordinary launch.  `rows`: the gather
    and scatter kernels of kernels/cuda/rows.cu: the graph then reads X's rows from, and writes Y's rows to, the
    addresses its pinned table holds at each replay (and checks Y finite), instead of pinned X and Y of its own.
    Returns the Replay, less the weights it reads (the caller's to fill in)."""
    x_d = cupy.empty((m, k), dtype=cupy.float32)
    y_d = cupy.empty((m, n), dtype=cupy.float32)
    bufs = buffers()
    nbytes = int(x_d.nbytes + y_d.nbytes + sum(int(a.nbytes) for a in _arrays(bufs)))
    rt = cupy.cuda.runtime
    if rows is not None:
        gather, scatter = rows
        table_mem = cupy.cuda.alloc_pinned_memory(2 * m * 8)  # page-locked by the runtime: kernels read it in place
        finite_mem = cupy.cuda.alloc_pinned_memory(4)
        table = np.frombuffer(table_mem, np.uint64, 2 * m)
        finite = np.frombuffer(finite_mem, np.int32, 1)
        table_at, finite_at = np.uint64(table.ctypes.data), np.uint64(finite.ctypes.data)
        spare = cupy.empty((n,), dtype=cupy.float32)
        threads = np.int32(1024 if max(k, n) >= 4096 else 256)
        with stream:
            _begin(rt, stream)
            try:
                record_in_graph(events[0], stream)
                gather((m,), (int(threads),), (table_at, x_d, np.int32(k)))
                record_in_graph(events[1], stream)
                acts = enqueue(x_d, bufs, y_d)
                record_in_graph(events[3], stream)
                scatter((m,), (int(threads),), (y_d, table_at, np.int32(m), np.int32(n), finite_at))
                record_in_graph(events[4], stream)
            finally:
                graph = stream.end_capture()
        return Replay(graph, None, None, acts, {}, ("", ""), nbytes + n * 4, (table_mem, finite_mem, x_d, y_d, spare),
                      table, finite, int(spare.data.ptr))
    x_mem = cupy.cuda.alloc_pinned_memory(max(m * k * 4, 1))
    y_mem = cupy.cuda.alloc_pinned_memory(max(m * n * 4, 1))
    x_h = np.frombuffer(x_mem, np.float32, m * k).reshape(m, k)
    y_h = np.frombuffer(y_mem, np.float32, m * n).reshape(m, n)
    with stream:
        _begin(rt, stream)
        try:
            record_in_graph(events[0], stream)
            # raw copies: CuPy's set() and get() refuse host transfers on a capturing stream (pageable memory
            # cannot be captured; these buffers are pinned)
            rt.memcpyAsync(x_d.data.ptr, x_h.ctypes.data, x_h.nbytes, rt.memcpyHostToDevice, stream.ptr)
            record_in_graph(events[1], stream)
            acts = enqueue(x_d, bufs, y_d)
            record_in_graph(events[3], stream)
            rt.memcpyAsync(y_h.ctypes.data, y_d.data.ptr, y_h.nbytes, rt.memcpyDeviceToHost, stream.ptr)
            record_in_graph(events[4], stream)
        finally:
            graph = stream.end_capture()
    return Replay(graph, x_h, y_h, acts, {}, ("", ""), nbytes, (x_mem, y_mem, x_d, y_d))


def _begin(rt: Any, stream: Any) -> None:
    mode = getattr(rt, "streamCaptureModeThreadLocal", None)
    if mode is None:
        stream.begin_capture()
    else:
        stream.begin_capture(mode)


def _arrays(acts: Any) -> list[Any]:
    if isinstance(acts, dict):
        return [a for a in acts.values() if hasattr(a, "nbytes")]
    return [acts] if hasattr(acts, "nbytes") else []
