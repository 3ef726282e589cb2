"""Dynamic batching: the one place where products meet the device.

Every product goes through `Scheduler.submit`.  A request that finds the device idle starts at once.
Requests that arrive while it is busy wait in a queue per (tensor, kernel); when the device frees,
the next queue in round-robin order (so different tensors are served fairly) gives up to
QGEMM_BATCH_MAX_ROWS rows of its requests, stacked row-wise into one product, and each request gets
its own rows back.  `auto` picks the kernel by the batch's M; a named kernel is kept (and its own M
limit bounds the batch).  Rows are independent in every kernel (each output row depends on its own
activations only), so a request's rows equal what that kernel computes for them alone at the
batch's M.

A request of more than QGEMM_BATCH_MAX_ROWS rows is cut into chunks of that many, all run by the
kernel its full chunks choose, and queued like other work: a huge product never holds the device
for its whole length while small ones wait.  QGEMM_BATCH_WAIT_US is how long the scheduler lets the
event loop take in more requests after a batch, when others are already queued (never when the
device is idle); 0 turns batching off: one request (or chunk) at a time, in arrival order per queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kernels.backend import RowAddresses
from kernels.kernel import Kernel
from kernels.types import Result

log = logging.getLogger("qgemm")


@dataclass
class BatchAnswer:
    """What one chunk got back from the batch it ran in."""

    output: np.ndarray | None  # its rows of Y (None for a chunk of several parts: they are in its `outs`)
    kernel: Kernel  # the kernel that ran
    result: Result
    requests: int  # requests (parts of chunks) in that batch
    rows: int  # rows in that batch
    queue_ms: float
    x_amax: float | None = None  # max|x| of its rows, as the device measured it (None: not measured)


@dataclass(slots=True)
class Chunk:
    """A request's rows, a block of them, or the requests of one frame for one tensor (a part each), waiting for
    the device: one entry of a queue, settled once."""

    parts: list[np.ndarray]  # float32 [m_i, K] each
    m: int  # rows of all its parts
    context: Any  # what run_batch needs to find the weights (the same for a whole queue)
    kernel: Kernel | None  # None: auto, picked by the batch's M
    settle: Callable[[BatchAnswer | BaseException], None]  # called once, with its answer or the batch's error
    outs: list[np.ndarray | None]  # per part, where its rows of Y go (a block of the request's output), if given
    rows_at: RowAddresses = None  # its X and Y rows' addresses in page-locked memory, if there
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class Answer:
    output: np.ndarray
    kernel: Kernel  # the kernel that ran
    result: Result  # the (last) batch's result: backend, activation format, timing
    batch: dict[str, int]  # {"requests", "rows"} of the largest batch this request ran in (+ "chunks" if cut)
    queue_ms: float
    devices: list[str] = field(default_factory=list)  # where it ran (several: a tensor split by rows)
    x_amax: float | None = None  # max|x| of the request's activations, where the device measured every row of it
    release: Callable[[], None] | None = None  # once the answer is sent: frees the memory `output` lives in


def settle_future(future: asyncio.Future, outcome: Any) -> None:
    """`outcome` (an answer, or the error it raised) into `future`, unless its caller went away."""
    if future.done():  # a client that went away leaves a cancelled future
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def largest(amaxes: list[float]) -> float:
    """The largest of several max|x|, a NaN winning (it stands for a NaN in X)."""
    return max(amaxes, key=lambda v: v if v == v else math.inf)


def _call(settle: Callable[[Any], None], outcome: Any) -> None:
    """One request's settle: its fault is its own, never the other requests' of the batch."""
    try:
        settle(outcome)
    except Exception:
        log.exception("settling a product's answer failed")


RunBatch = Callable[[Any, Kernel | None, list[np.ndarray], bool, list[np.ndarray | None],
                    RowAddresses], Awaitable[tuple[Kernel, Result]]]


class Scheduler:
    def __init__(self, run_batch: RunBatch, max_rows: int, wait_us: int,
                 observe: Callable[[int, int], None] | None = None):
        """`run_batch(context, kernel, parts, alone, outs, rows_at)` runs the product of the stacked parts on the
        device and returns (the kernel that ran, its Result); `alone`: nothing else waits (the backend may then take
        its lowest-latency path); `outs`: per part, an array its rows may be written into (None: the
        Result's output holds them; where it does, they are copied into the part's array); `rows_at`: the rows'
        addresses in page-locked memory, where every chunk of the batch gave them;
        `observe(requests, rows)` sees each batch."""
        self.run_batch, self.max_rows, self.wait_s = run_batch, max_rows, wait_us / 1e6
        self.observe = observe
        self.queues: OrderedDict[Hashable, deque[Chunk]] = OrderedDict()
        self.waiting = 0  # requests (parts of chunks) in the queues (asked at every admission: kept, not summed)
        self.busy = False

    @property
    def batching(self) -> bool:
        return self.wait_s > 0

    def depth(self) -> int:
        return self.waiting

    async def submit(self, key: Hashable, context: Any, x: np.ndarray, kernel: Kernel | None,
                     chunk_kernel: Callable[[int], Kernel], out: np.ndarray | None = None) -> Answer:
        """Queue X [M, K] under `key` (a tensor); `kernel` None is auto.
        `chunk_kernel(rows)` names the kernel for a request cut into chunks of `rows`.
        `out` [M, N]: the array the answer's output is written into (no join of chunks then)."""
        m = x.shape[0]
        step = self.max_rows
        if m > step and kernel is None:
            kernel = chunk_kernel(step)
        if kernel is not None and kernel.max_m is not None:
            step = min(step, kernel.max_m)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(0, m, step)]
        chunks = [Chunk([x[i:i + step]], min(step, m - i), context, kernel, partial(settle_future, f),
                        [None if out is None else out[i:i + step]])
                  for i, f in zip(range(0, m, step), futures, strict=True)]
        qkey = (key, kernel.name if kernel is not None else None)
        if not self.busy and len(chunks) == 1 and not self.queues:
            # the device is idle and nobody waits: run in this coroutine (no task, no queue)
            self.busy = True
            try:
                await self._run(chunks, alone=True)
            finally:
                self._handoff()
        else:
            self._queue(qkey, chunks)
        answers: list[BatchAnswer] = [await f for f in futures]
        if out is None:
            out = answers[0].output if len(answers) == 1 else np.concatenate([a.output for a in answers])
        big = max(answers, key=lambda a: a.rows)
        batch = {"requests": big.requests, "rows": big.rows}
        if len(answers) > 1:
            batch["chunks"] = len(answers)
        amaxes = [a.x_amax for a in answers]
        x_amax = None if None in amaxes else largest(amaxes)
        return Answer(out, answers[-1].kernel, answers[-1].result, batch, max(a.queue_ms for a in answers),
                      x_amax=x_amax)

    def enqueue(self, key: Hashable, context: Any, x: np.ndarray, kernel: Kernel | None, out: np.ndarray | None,
                settle: Callable[[BatchAnswer | BaseException], None]) -> None:
        """Queue X [M, K] (M within a batch: no chunks) without awaiting: `settle` gets its BatchAnswer, or the
        error its batch raised, from the loop turn that finishes it.  No coroutine, task or future per request:
        what an engine process's loop does for every request of a frame."""
        self._queue((key, kernel.name if kernel is not None else None),
                    [Chunk([x], x.shape[0], context, kernel, settle, [out])])

    def enqueue_parts(self, key: Hashable, context: Any, parts: list[np.ndarray], rows: int, kernel: Kernel | None,
                      outs: list[np.ndarray], settle: Callable[[BatchAnswer | BaseException], None],
                      rows_at: RowAddresses = None) -> None:
        """Queue several requests' X (`rows` in all, within a batch) as one entry, each part's rows of Y written into
        its own array of `outs`: `settle` is called once for all of them (one frame's requests for one tensor).
        `rows_at`: the addresses of their X rows and Y rows where all lie in page-locked memory (kernels/backend.py's
        RowAddresses)."""
        self._queue((key, kernel.name if kernel is not None else None),
                    [Chunk(parts, rows, context, kernel, settle, outs, rows_at)])  # type: ignore[arg-type]

    def _queue(self, qkey: Hashable, chunks: list[Chunk]) -> None:
        queue = self.queues.get(qkey)
        if queue is None:
            queue = self.queues[qkey] = deque()
        queue.extend(chunks)
        self.waiting += sum(len(c.parts) for c in chunks)
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._pump())

    def _take(self) -> list[Chunk] | None:
        """The next batch: round-robin over queues, up to max_rows rows (one chunk when batching is off)."""
        while self.queues:
            qkey, queue = next(iter(self.queues.items()))
            self.queues.move_to_end(qkey)
            if not queue:
                del self.queues[qkey]
                continue
            taken = [queue.popleft()]
            limit = self.max_rows
            if taken[0].kernel is not None and taken[0].kernel.max_m is not None:
                limit = min(limit, taken[0].kernel.max_m)
            rows = taken[0].m
            while self.batching and queue and rows + queue[0].m <= limit:
                rows += queue[0].m
                taken.append(queue.popleft())
            if not queue:
                del self.queues[qkey]
            self.waiting -= sum(len(c.parts) for c in taken)
            return taken
        return None

    async def _pump(self) -> None:
        try:
            while True:
                batch = self._take()
                if batch is None:
                    return
                await self._run(batch, alone=len(batch) == 1 and not self.queues)
                if self.batching and self.queues:
                    await asyncio.sleep(self.wait_s)  # let the loop read requests that belong with the next batch
        finally:
            self._handoff()

    def _handoff(self) -> None:
        """The device is free: a pump for what queued meanwhile, or idle."""
        self.busy = False
        if self.queues:
            self.busy = True
            asyncio.create_task(self._pump())

    async def _run(self, batch: list[Chunk], alone: bool = False) -> None:
        started = time.perf_counter()
        if len(batch) == 1:
            parts, outs, rows_at = batch[0].parts, batch[0].outs, batch[0].rows_at
        else:
            parts = [p for c in batch for p in c.parts]
            outs = [o for c in batch for o in c.outs]
            rows_at = None
            if all(c.rows_at is not None for c in batch):
                rows_at = ([a for c in batch for a in c.rows_at[0]],  # type: ignore[index]
                           [a for c in batch for a in c.rows_at[1]])  # type: ignore[index]
        rows = sum(c.m for c in batch)
        try:
            kernel, result = await self.run_batch(batch[0].context, batch[0].kernel, parts, alone, outs, rows_at)
        except Exception as exc:
            for c in batch:
                _call(c.settle, exc)
            return
        if self.observe is not None:
            self.observe(len(parts), rows)
        row = part = 0
        for c in batch:
            if len(c.parts) == 1:
                m, out = c.m, c.outs[0]
                if out is None:
                    output = result.output[row:row + m]
                else:
                    if result.output is not None:  # the backend did not write the out arrays itself
                        out[...] = result.output[row:row + m]
                    output = out
                x_amax = None if result.x_amax is None else result.x_amax[part]
            else:
                output = None
                if result.output is not None:
                    at = row
                    for p, o in zip(c.parts, c.outs, strict=True):
                        o[...] = result.output[at:at + p.shape[0]]  # type: ignore[index]
                        at += p.shape[0]
                x_amax = None if result.x_amax is None else largest(result.x_amax[part:part + len(c.parts)])
            _call(c.settle, BatchAnswer(output, kernel, result, len(parts), rows, (started - c.enqueued) * 1e3, x_amax))
            row += c.m
            part += len(c.parts)

