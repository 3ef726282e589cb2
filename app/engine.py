"""The matmul engine: a request's product on the device that holds its tensor.

It opens the devices (kernels/devices.py: a worker per GPU of QGEMM_DEVICES, QGEMM_CPU_DEVICES on the CPU,
app/workers.py), takes requests checked by app/checks.py (`run`; `matmul` checks first), checks X's values,
has the kernel chosen (kernels/select.py), places the tensor (app/placement.py) and queues the product with that
device's scheduler (app/scheduler.py), which batches it with others.  `enqueue` is the path of every request: on
one device, a small request is queued without a coroutine of its own (an engine process does this for every
request of a frame); the rest (large X, several devices) run as a task.  A replicated tensor's request goes to its least
loaded copy; a tensor split by rows runs on all its devices at once, each writing its block of output columns.
It speaks the domain: its errors are kernels.errors' exceptions, which app/errors.py turns into HTTP answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
from fastapi.concurrency import run_in_threadpool

from app import placement
from app.checks import (
    INLINE_VALUES,
    Checked,
    amax_of,
    check_output,
    check_request,
    check_splittable,
    check_values,
)
from app.placement import Part, Placement, Placements, Replica
from app.scheduler import Answer, BatchAnswer, settle_future
from app.settings import Settings
from app.tensors import effective, weight_bytes, weights
from app.workers import Worker
from kernels.backend import Backend, InFlight, RowAddresses
from kernels.devices import open_devices
from kernels.errors import InvalidRequest, Overloaded
from kernels.kernel import Kernel
from kernels.reference import q8_1_in_range
from kernels.requant import Scheme
from kernels.select import KernelChooser
from kernels.types import Result
from models.store import Model, TensorInfo

# A product (a lone request or a batch) up to this M on resident weights launches from the event loop and is polled
# (Engine._poll): no thread round trip, no GIL handed between two threads.  Larger ones run on the device's thread.
LOOP_ROWS = 64
# the same for a batch of small requests (parts of up to LOOP_ROWS rows) whose rows the device reads and writes where
# they lie (`rows_at`: a front's page-locked arena): a replayed graph up to this M (kernels/cuda/backend.py
# GATHERED_GRAPH_ROWS), so that the loop makes no copy of their many rows.  A large part stays on the device's thread:
# its rows go by DMA from where they lie, while the loop would poll the product's millisecond and the graph would read
# them across the bus row by row (16 clients of M = 512 on one H200, ABBA: 671 and 296 req/s when they took the loop,
# 689 and 801 on the thread)
LOOP_GATHERED_ROWS = 512
POLL_SPIN_S, POLL_SLEEP_S = 0.002, 0.0001  # poll a product's completion every loop turn for 2 ms, then every 0.1 ms
JOBS_KEPT = 4096  # checked requests whose queue key and Job are kept


@dataclasses.dataclass(frozen=True)
class Job:
    """What a queued product needs to find its weights: the tensor, its requantization, its block of rows."""

    model: Model
    info: TensorInfo
    scheme: Scheme | None
    eff: TensorInfo  # as multiplied: the scheme's type, and the part's rows
    part: Part | None  # None: the whole tensor


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.devices = open_devices(settings)
        self.chooser = KernelChooser(self.devices.cuda[0] if self.devices.cuda else None)
        self.pools: dict[str, list[Worker]] = {
            kind: [Worker(b, self._run_batch, settings.batch_max_rows, settings.batch_wait_us) for b in backends]
            for kind, backends in (("cpu", self.devices.cpu), ("cuda", self.devices.cuda))}
        self.placements = {"cpu": Placements(), "cuda": Placements()}
        self._tasks: set[asyncio.Task] = set()  # products of the general path in flight
        # a checked request's queue key, Job and auto's kernel by M (an engine process keeps one Checked per
        # target): made once, not for every request
        self._jobs: dict[int, tuple[Checked, tuple, Job, dict[int, Kernel]]] = {}
        self.outputs: Any = None  # pinned host arrays for large GPU outputs (kernels/cuda/host_memory.py)
        if self.devices.cuda:
            from kernels.cuda.host_memory import PinnedOutputs

            self.outputs = PinnedOutputs(settings.pinned_output_bytes)

    # -- what is here -------------------------------------------------------------------------
    @property
    def gpu(self) -> Backend | None:
        """The first GPU's backend (it answers the registry's questions: all GPUs alike), or None."""
        return self.chooser.cuda

    @property
    def compile_ms(self) -> float | None:
        """The first GPU's kernel compile time at start-up, or None on the CPU."""
        return self.gpu.compile_ms if self.gpu is not None else None

    @property
    def cuda_error(self) -> str | None:
        return self.devices.cuda_error

    @property
    def backend(self) -> str:
        return "cuda" if self.gpu is not None else "cpu"

    @property
    def device(self) -> str | None:
        return self.gpu.device_name if self.gpu is not None else None

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
        raise InvalidRequest(f"no device {backend}:{device} here; devices: {', '.join(w.label for w in pool)}",
                             "bad_device")

    def kernel_table(self) -> list[dict[str, Any]]:
        return self.chooser.table()

    def choose(self, kernel: str | Kernel, info: TensorInfo, m: int) -> Kernel:
        """The kernel for M rows of a tensor that can be multiplied (`effective` checked it)."""
        return self.chooser.choose(kernel, info.name, info.type_name, m, *info.shape)

    # -- checks ---------------------------------------------------------------------------------
    def prepare(self, c: Checked, x: np.ndarray, values: bool = True) -> np.ndarray:
        """X as float32, its values checked (`values` False leaves NaN, inf and Q8_1's range to `check_values` after
        the product, where the device measured each row's max|x|: a pass over X on the host costs milliseconds at
        M = 512)."""
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = np.ascontiguousarray(x, dtype=np.float32)
        if values:
            check_values(c.eff, x, x32, c.kernel is None, c.kernel or self.choose("auto", c.eff, x.shape[0]))
        return x32

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
        if how == "split" and len(devices) > 1:
            check_splittable(info, scheme)
        found = placement.requested(info.shape[0], devices, how)
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        old = self.placements[backend].get(key)
        self.placements[backend].set(key, found)
        if old is not None and old.replicas != found.replicas:  # placed anew: the old copies go (the new upload)
            for d in old.devices():
                self.pools[backend][d].unload(lambda k: k == (model.version_key, info.name))
        return found

    # -- running ----------------------------------------------------------------------------------
    async def matmul(self, model: Model, info: TensorInfo, x: np.ndarray, kernel: str | Kernel,
                     scheme: Scheme | None = None, out: np.ndarray | None = None) -> Answer:
        """A product asked directly (tools, tests): checked as the routes check it, then `run`."""
        c = check_request(self.chooser, info, scheme, x.shape, kernel, self.settings.max_rows)
        return await self.run(model, c, x, out)

    async def run(self, model: Model, c: Checked, x: np.ndarray, out: np.ndarray | None = None) -> Answer:
        """A checked request's product (`enqueue`, awaited)."""
        future = asyncio.get_running_loop().create_future()
        self.enqueue(model, c, x, out, partial(settle_future, future))
        return await future

    def enqueue(self, model: Model, c: Checked, x: np.ndarray, out: np.ndarray | None,
                done: Callable[[Answer | BaseException], None], amax: float | None = None,
                rows: tuple[int, int] | None = None) -> None:
        """A checked request's product through the scheduler of the device that holds its tensor (which may batch it
        with others of this tensor in the same weight format), `done` called with its Answer or its error; on
        every device of a split tensor at once.  `out` [M, N] float32: where Y goes (a front's shared memory), else
        an array of the engine's own.  `rows`: only W's rows [start, stop), written into those columns of `out`
        (this engine's block of a tensor split across engine processes)."""
        try:
            if rows is None and self._enqueue_small(model, c, x, out, done, amax):
                return
        except Exception as exc:
            done(exc)
            return
        task = asyncio.ensure_future(self._matmul(model, c, x, out, rows))
        self._tasks.add(task)

        def finished(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            done(asyncio.CancelledError() if t.cancelled() else t.exception() or t.result())

        task.add_done_callback(finished)

    def _small(self, x: np.ndarray) -> bool:
        """X of the common case: float32, contiguous, few enough values to check on the host, within one batch."""
        return (x.size <= INLINE_VALUES and x.dtype == np.float32 and x.flags.c_contiguous
                and x.shape[0] <= self.settings.batch_max_rows)

    def _job_of(self, model: Model, c: Checked) -> tuple[tuple, Job, dict[int, Kernel]]:
        """A checked request's queue key, Job and auto's kernels by M, made once per Checked."""
        hit = self._jobs.get(id(c))
        if hit is None or hit[0] is not c or hit[2].model is not model:
            hit = (c, (model.version_key, c.info.name, c.scheme.tag if c.scheme else ""),
                   Job(model, c.info, c.scheme, c.eff, None), {})
            if len(self._jobs) >= JOBS_KEPT:
                self._jobs.clear()
            self._jobs[id(c)] = hit
        return hit[1], hit[2], hit[3]

    def _kernel_for(self, c: Checked, picks: dict[int, Kernel], m: int) -> Kernel:
        chosen = c.kernel or picks.get(m)
        if chosen is None:
            chosen = picks[m] = self.choose("auto", c.eff, m)
        return chosen

    @staticmethod
    def _check_small(c: Checked, x: np.ndarray, chosen: Kernel, amax: float | None) -> None:
        """X's values, from max|X| (`amax` where the caller measured it already: a front process, as it wrote X);
        out of Q8_1's range (or not finite): what and where, if it matters here."""
        if amax is None:
            amax = amax_of(x)
        if not q8_1_in_range(amax):
            check_values(c.eff, x, x, c.kernel is None, chosen, amax)

    def _enqueue_small(self, model: Model, c: Checked, x: np.ndarray, out: np.ndarray | None,
                       done: Callable[[Answer | BaseException], None], amax: float | None = None) -> bool:
        """The common case queued at once: float32 X small enough to check on the host, one device.  False: not it."""
        if not self._small(x):
            return False
        m = x.shape[0]
        key, job, picks = self._job_of(model, c)
        chosen = self._kernel_for(c, picks, m)
        pool = self.pools[chosen.backend]
        if len(pool) != 1:
            return False
        self._check_small(c, x, chosen, amax)
        worker = pool[0]
        self._admit([worker])
        if out is None and chosen.backend == "cuda" and self.outputs:
            out = self.outputs.array((m, c.eff.shape[0]))
        devices = worker.labels

        def settle(got: BatchAnswer | BaseException) -> None:
            if isinstance(got, BaseException):
                done(got)
                return
            if got.result.finite is not True:  # unless the device checked
                try:
                    check_output(got.output)
                except InvalidRequest as exc:
                    done(exc)
                    return
            done(Answer(got.output, got.kernel, got.result, {"requests": got.requests, "rows": got.rows},
                        got.queue_ms, devices, got.x_amax))

        worker.scheduler.enqueue(key, job, x, c.kernel, out, settle)
        return True

    def enqueue_many(self, model: Model, c: Checked, xs: list[np.ndarray], outs: list[np.ndarray],
                     amaxes: list[float | None], done: Callable[[list[int], Answer | BaseException], None],
                     rows_at: list[tuple[list[int], list[int]]] | None = None) -> None:
        """Several checked requests for one tensor (one frame's, from a front process) queued as one entry of the
        device's queue: their X rows run in the same batch, each request's Y written into its own array of `outs`.
        `done(indices, outcome)` is called with the requests' indices in `xs` and their Answer (its output None:
        Y is in `outs`) or their error; it is called once for all that succeed, and once per group that fails.
        Where the common case does not hold (large X, several devices), each goes through `enqueue`.  `rows_at`:
        per request, its X rows' and Y rows' addresses where X and Y lie in page-locked memory (a GPU then reads
        and writes them there)."""
        rows = sum(x.shape[0] for x in xs)
        key, job, picks = self._job_of(model, c)
        chosen = self._kernel_for(c, picks, xs[0].shape[0])
        pool = self.pools[chosen.backend]
        if len(pool) != 1 or rows > self.settings.batch_max_rows or not all(self._small(x) for x in xs):
            for i, (x, out, amax) in enumerate(zip(xs, outs, amaxes, strict=True)):
                self.enqueue(model, c, x, out, lambda got, i=i: done([i], got), amax)
            return
        worker = pool[0]
        try:
            self._admit([worker])
        except Overloaded as exc:
            done(list(range(len(xs))), exc)
            return
        queued = []
        for i, amax in enumerate(amaxes):
            try:
                self._check_small(c, xs[i], chosen, amax)
            except Exception as exc:  # this request's error alone
                done([i], exc)
                continue
            queued.append(i)
        if len(queued) < len(xs):
            if not queued:
                return
            xs, outs = [xs[i] for i in queued], [outs[i] for i in queued]
            rows_at = None if rows_at is None else [rows_at[i] for i in queued]
            rows = sum(x.shape[0] for x in xs)
        batch_at = None
        if rows_at is not None:
            batch_at = ([a for at in rows_at for a in at[0]], [a for at in rows_at for a in at[1]])
        devices = worker.labels

        def settle(got: BatchAnswer | BaseException) -> None:
            if isinstance(got, BaseException):
                done(queued, got)
                return
            ok = queued
            if got.result.finite is not True:  # unless the device checked: each request's Y on its own
                ok = []
                for i, out in zip(queued, outs, strict=True):
                    try:
                        check_output(out)
                        ok.append(i)
                    except InvalidRequest as exc:
                        done([i], exc)
            if ok:
                done(ok, Answer(None, got.kernel, got.result,  # type: ignore[arg-type]
                                {"requests": got.requests, "rows": got.rows}, got.queue_ms, devices, got.x_amax))

        worker.scheduler.enqueue_parts(key, job, xs, rows, c.kernel, outs, settle, batch_at)

    def _admit(self, workers: list[Worker]) -> None:
        """A bounded queue: past it, latency would grow without bound; the client retries instead."""
        for w in workers:
            if w.scheduler.depth() >= self.settings.max_queue:
                raise Overloaded(f"{w.label} has {w.scheduler.depth()} requests waiting (QGEMM_MAX_QUEUE="
                                 f"{self.settings.max_queue}): retry after the Retry-After seconds")

    async def _matmul(self, model: Model, c: Checked, x: np.ndarray, out: np.ndarray | None,
                      rows: tuple[int, int] | None = None) -> Answer:
        """The general case: large X (checked from the max|x| the device measures), several devices, a block of
        rows (`rows`, on this engine's first device)."""
        info, scheme, eff, spec = c.info, c.scheme, c.eff, c.kernel
        # large X on a GPU: its values are checked from the max|x| per row the device measures as it quantizes
        on_device = x.size > INLINE_VALUES and self.gpu is not None
        if x.size <= INLINE_VALUES or (on_device and x.dtype == np.float32 and x.flags.c_contiguous):
            x32 = self.prepare(c, x, values=not on_device)
        else:  # large X: its checks (or its conversion) take milliseconds, off the event loop
            x32 = await run_in_threadpool(self.prepare, c, x, not on_device)
        chosen = spec or self.choose("auto", eff, x32.shape[0])
        backend = chosen.backend
        pool = self.pools[backend]
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        if rows is not None:  # a block of a tensor split across engine processes: this engine's device
            if out is None:
                raise ValueError("a block of rows is written into the request's output")
            replica: Replica = (Part(0, *rows),)
        elif len(pool) == 1:  # one device: nothing to place
            replica = (Part(0, 0, info.shape[0]),)
        else:
            found = self.placement_of(backend, model, info, scheme, eff)
            replica = self.placements[backend].pick(found, lambda d: pool[d].backlog())
        self._admit([pool[part.device] for part in replica])
        # a large output is written by the GPU into pinned memory of its own: no copy, no join of a split's blocks
        if out is None and backend == "cuda" and self.outputs:
            out = self.outputs.array((x32.shape[0], eff.shape[0]))
        if len(replica) == 1 and replica[0].rows == info.shape[0]:
            job = Job(model, info, scheme, eff, None)
            answer = await pool[replica[0].device].scheduler.submit(
                key, job, x32, spec, lambda rows: self.choose("auto", eff, rows), out)
            answer.devices = [pool[replica[0].device].label]
        else:
            answer = await self._split(pool, replica, key, model, info, scheme, eff, x32, spec, out)
        # a value out of range (or a backend that did not measure X): the host finds what and where
        if on_device and (answer.x_amax is None or not q8_1_in_range(answer.x_amax)):
            await run_in_threadpool(check_values, eff, x, x32, spec is None, chosen, answer.x_amax)
        if answer.result.finite is not True and rows is None:  # unless the device checked
            check_output(answer.output)
        elif answer.result.finite is not True:  # a block: only its own columns (another engine writes the rest)
            assert rows is not None and answer.output is not None
            check_output(answer.output[:, rows[0]:rows[1]], rows[0])
        return answer

    async def _split(self, pool: list[Worker], replica: Replica, key: tuple, model: Model, info: TensorInfo,
                     scheme: Scheme | None, eff: TensorInfo, x32: np.ndarray, spec: Kernel | None,
                     out: np.ndarray | None) -> Answer:
        """Each device multiplies its block of rows at once, and its block of output columns goes into `out` (or
        the blocks are joined, without one).  Rows of W are independent in every kernel, so the blocks make the
        whole product by the kernels that ran."""
        m, calls = x32.shape[0], []
        for part in replica:
            eff_part = dataclasses.replace(eff, shape=(part.rows, eff.shape[1]))
            part_spec = None if spec is None else self.choose(spec, eff_part, m)
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
        return Answer(result.output, first.kernel, result, first.batch, max(a.queue_ms for a in answers),
                      [pool[p.device].label for p in replica], x_amax)

    async def _run_batch(self, worker: Worker, job: Job, spec: Kernel | None, parts: list[np.ndarray],
                         alone: bool = False, outs: list[np.ndarray | None] | None = None,
                         rows_at: RowAddresses = None) -> tuple[Kernel, Result]:
        """One product of stacked rows on `worker`'s device: up to LOOP_ROWS rows on resident weights
        (LOOP_GATHERED_ROWS of parts of up to LOOP_ROWS rows with `rows_at`) launched from the event loop itself and
        polled, larger ones on the device's thread (the loop takes in requests meanwhile).
        `alone` (nothing else waits) is the scheduler's to say; every small batch takes the loop's path."""
        rows = sum(p.shape[0] for p in parts)
        if spec is None:
            spec = self.choose("auto", job.eff, rows)
        w = weights(job.model, job.info, job.scheme, job.part)
        if spec.backend != worker.kind:  # auto fell back to the other backend: its first device runs it
            worker = self.pools[spec.backend][0]
        worker.products += 1
        if rows <= LOOP_ROWS or (rows_at is not None and rows <= LOOP_GATHERED_ROWS
                                 and max(p.shape[0] for p in parts) <= LOOP_ROWS):
            inflight = worker.backend.launch_inline(spec, w, parts, outs, rows_at)
            if inflight is not None:
                return spec, await self._poll(inflight)
        return spec, await asyncio.wrap_future(worker.backend.submit(spec, w, parts, outs))

    @staticmethod
    async def _poll(inflight: InFlight) -> Result:
        """A product launched from the event loop, awaited by polling its completion."""
        t0 = time.perf_counter()
        while True:
            # yield at least once: a product done by the end of its own launch would otherwise return without the
            # loop ever running anything else, and a caller that submits again at once would keep it for good
            await asyncio.sleep(0 if time.perf_counter() - t0 < POLL_SPIN_S else POLL_SLEEP_S)
            if inflight.done:
                return inflight.result()

    def time_product(self, kernel: Kernel, w: Any, x: np.ndarray) -> dict[str, float]:
        """One product of X by `kernel` on its first device, outside the scheduler (tools that time kernels on
        resident weights: .../quantization); its timing_ms.  Blocks: call it off the event loop."""
        return self.pools[kernel.backend][0].backend.submit(kernel, w, [x]).result().timing_ms

    def preload(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None = None,
                devices: list[int] | None = None, how: Literal["replicate", "split"] | None = None,
                backend: str | None = None) -> list[dict[str, Any]]:
        """Put tensors on their devices ahead of the first request, in the layouts `kernel` (default: what auto
        picks at M = 1, and on a GPU at M = 512) reads, as stored or requantized to `scheme`: where
        `devices`/`how` say (pool indices of `backend`'s pool), else where first use would.  Every tensor is
        checked before any is loaded."""
        backend = backend or self.backend
        pool = self.pools[backend]
        effs = [effective(info, scheme) for info in infos]
        loaded = []
        for info, eff in zip(infos, effs, strict=True):
            n = eff.shape[0]
            if devices is not None or how is not None:
                found = self.place(backend, model, info, scheme, devices or list(range(len(pool))), how or "replicate")
            elif len(pool) > 1:
                found = self.placement_of(backend, model, info, scheme, eff)
            else:
                found = Placement([(Part(0, 0, n),)], "single", n)
                old = self.placements[backend].pop((model.version_key, info.name, scheme.tag if scheme else ""))
                if old is not None:  # this engine's block of a split before (preload_rows): the whole copy now
                    pool[0].unload(lambda k, name=info.name: k == (model.version_key, name))
            for replica in found.replicas:
                for part in replica:
                    loaded += self._prepare(backend, model, info, scheme, eff, part, kernel)
        return loaded

    def preload_rows(self, model: Model, info: TensorInfo, kernel: str | None, scheme: Scheme | None,
                     rows: tuple[int, int], backend: str) -> list[dict[str, Any]]:
        """This engine's block of rows of a tensor split across engine processes, on its first device, placed there
        (residency lists it) in place of any whole copy."""
        eff = effective(info, scheme)
        part = Part(0, *rows)
        key = (model.version_key, info.name, scheme.tag if scheme else "")
        old = self.placements[backend].get(key)
        self.placements[backend].set(key, Placement([(part,)], "split", eff.shape[0]))
        if old is not None and old.replicas != [(part,)]:
            for d in old.devices():
                self.pools[backend][d].unload(lambda k: k == (model.version_key, info.name))
        return self._prepare(backend, model, info, scheme, eff, part, kernel)

    def _prepare(self, backend: str, model: Model, info: TensorInfo, scheme: Scheme | None, eff: TensorInfo,
                 part: Part, kernel: str | None) -> list[dict[str, Any]]:
        """A part's weights made and kept on its device in the layouts `kernel` (default: auto at M = 1, and on a GPU
        at M = 512) reads."""
        eff_part = dataclasses.replace(eff, shape=(part.rows, eff.shape[1]))
        ms = (1,) if kernel or backend != "cuda" else (1, 512)
        kernels = [self.choose(kernel or "auto", eff_part, m) for m in ms]
        worker = self.pools[backend][part.device]
        loaded = []
        for chosen in {s.weights.name: s for s in kernels if s.backend == backend}.values():
            w = weights(model, info, scheme, part)
            nbytes = worker.prepare(chosen, w)
            loaded.append({"tensor": info.name, "layout": w.layout_key(chosen.weights.name), "n_bytes": nbytes,
                           "device": worker.label})
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
        self._jobs.clear()  # they hold the model
        for w in self.workers:
            w.forget(model.version_key)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.outputs is not None:
            self.outputs.release()
