"""An engine process of `qgemm serve`: it owns its device (a GPU, or the CPU backend), the weights resident there,
the batching scheduler and the kernels, and answers the front processes over a Unix socket
(app/serving/channel.py, messages of app/serving/contract.py).  The supervisor starts one per device.

A front writes a request's X into its shared-memory arena (app/serving/arenas.py) and names the slot; the engine
attaches to that arena once (on a GPU: registered as page-locked memory), multiplies X in place and writes Y into
the same slot.  The work is done per read, not per request: the Matmuls a read brings for one tensor are queued as
one entry of the device's scheduler (Engine.enqueue_many: no coroutine, task or future of their own), a batch runs
as one product, those that succeed together are answered by one Done naming them all, and the answers of a loop turn
leave as one frame per front.  A request the front checked (app/checks.py) is not checked
again: the engine multiplies the file version the front saw (its own store re-reads a file whose version is new
to it, and answers FileChanged where the front's is gone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from app.checks import Checked
from app.metrics import Metrics
from app.scheduler import Answer
from app.serving import arenas, channel, contract
from app.serving.channel import Framed
from app.serving.contract import Matmul
from app.settings import Settings
from app.tensors import effective
from kernels.registry import KERNELS
from kernels.requant import Scheme
from models.store import FileChanged, Model, ModelStore, Unreadable

log = logging.getLogger("qgemm")
HOUSEKEEPING_S = 5.0  # how often the engine lets go of the arenas of fronts that are gone
TARGETS_KEPT = 4096  # (file version, tensor, weight format, kernel) a request names: checked once each


class Segments:
    """The fronts' arenas this engine has attached, by name, each with the requests in flight in it; a request's own
    segment is attached for its product alone.  A segment is unmapped only once no request uses it: a front that
    dies fails its own requests, and the products still writing into its arena finish into memory that stays
    mapped until they are done.  With `pin` (QGEMM_PIN_ARENAS, on a GPU) an arena is page-locked once, at its first
    request, and the device copies Y into it by DMA."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.attached: dict[str, tuple[Any, int | None]] = {}
        self.in_flight: dict[str, int] = {}
        self.doomed: set[str] = set()  # owner gone: unmapped when its last request is done
        self.users: dict[object, set[str]] = {}  # each front's connection: the arenas its requests named

    def take(self, name: str, own: bool = False, user: object = None) -> memoryview:
        """The segment's buffer, counted in use until `give`; `user`: the connection that named it."""
        hit = self.attached.get(name)
        if hit is None:
            segment = arenas.attach(name)
            ptr = None
            if self.pin and not own:  # a request's own segment lives for one product: not worth locking
                from kernels.cuda import host_memory

                ptr = np.frombuffer(segment.buf, np.uint8).ctypes.data
                host_memory.register(ptr, segment.size)
            hit = self.attached[name] = (segment, ptr)
            if not own:
                self.users.setdefault(user, set()).add(name)
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        return hit[0].buf

    def lost(self, user: object) -> None:
        """A front's connection closed (the front died, or stops): its arenas go once their requests are done."""
        for name in self.users.pop(user, ()):
            self.let_go(name)

    def let_go(self, name: str) -> None:
        if self.in_flight.get(name):
            self.doomed.add(name)
        else:
            self.drop(name)

    def give(self, name: str, own: bool = False) -> None:
        """A request in `name` is done; a segment of its own, or one whose owner is gone, goes with its last."""
        left = self.in_flight.get(name, 1) - 1
        if left > 0:
            self.in_flight[name] = left
            return
        self.in_flight.pop(name, None)
        if own or name in self.doomed:
            self.drop(name)

    def drop(self, name: str) -> None:
        self.doomed.discard(name)
        segment, ptr = self.attached.pop(name, (None, None))
        if segment is None:
            return
        if ptr is not None:
            from kernels.cuda import host_memory

            host_memory.unregister(ptr)
        try:
            segment.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the process
            pass

    def drop_dead(self) -> None:
        """Let go of the arenas of fronts that are gone: now where no request uses them, else after the last."""
        for name in list(self.attached):
            pid = arenas.owner(name)
            if pid is None or not arenas.alive(pid):
                self.let_go(name)


class EngineServer:
    def __init__(self, settings: Settings):
        from app.service import LocalService, open_engine

        self.settings = settings
        self.metrics = Metrics(engine=True)
        self.engine, self.store = open_engine(settings, self.metrics)
        self.service = LocalService(self.engine)
        self.segments = Segments(pin=settings.pin_arenas and self.engine.gpu is not None)
        # what a request names (model, file version, tensor, weight format, kernel), resolved once
        self.targets: dict[tuple, tuple[Model, Checked]] = {}
        self.tasks: set[asyncio.Task] = set()
        # this engine's blocks of rows of tensors split across engines, by (model, tensor, weight format tag), and
        # the count of changes to them that every answer carries (a front that sees a new count asks again)
        self.parts: dict[tuple[str, str, str], tuple[int, int]] = {}
        self.epoch = 0

    # -- the requests of one read ------------------------------------------------------------------------------
    def on_requests(self, end: Framed, requests: list[contract.Request]) -> None:
        groups: dict[tuple, tuple[tuple[Model, Checked], list[Matmul]]] | None = None
        targets = self.targets
        for r in requests:
            if type(r) is Matmul:
                key = (r.model, r.version, r.tensor, r.scheme, r.kernel)
                target = targets.get(key)
                if target is None or r.own or r.part is not None:
                    self.matmul(end, r)
                    continue
                if groups is None:
                    groups = {}
                group = groups.get(key)
                if group is None:
                    groups[key] = (target, [r])
                else:
                    group[1].append(r)
            elif type(r) is contract.Ping:  # the supervisor's watchdog: answered by the loop turn itself
                end.send(contract.Reply(r.id, None))
            else:
                self._spawn(self.control(end, r))
        if groups is not None:  # a read's requests for one tensor: one entry of the device's queue, one answer
            for target, rs in groups.values():
                self._enqueue_group(end, rs, target)

    def _enqueue_group(self, end: Framed, rs: list[Matmul], target: tuple[Model, Checked]) -> None:
        """Requests for one tensor, in the front's arena, queued as one entry (Engine.enqueue_many) and answered
        by one Done where they succeed together."""
        xs, ys, taken = [], [], []
        segments = self.segments
        # where the arenas are page-locked, each row's address: the GPU then reads X and writes Y where they are
        rows_at: list[tuple[list[int], list[int]]] | None = [] if segments.pin else None
        for r in rs:
            try:
                buf = segments.take(r.segment, False, end)
            except Exception as exc:  # a segment that is gone (its front died): only this request fails
                if end.open:
                    end.send(contract.failed(r.id, exc))
                continue
            try:
                xs.append(np.ndarray((r.m, r.k), np.float32, buf, r.x))
                ys.append(np.ndarray((r.m, r.n), np.float32, buf, r.y))
            except Exception as exc:  # offsets outside the segment: a broken front
                del xs[len(ys):]
                self._answer(end, contract.failed(r.id, exc), r)
                continue
            taken.append(r)
            if rows_at is not None:
                base = segments.attached[r.segment][1]
                if base is None:
                    rows_at = None
                elif r.m == 1:
                    rows_at.append(([base + r.x], [base + r.y]))
                else:
                    rows_at.append(([base + r.x + i * r.k * 4 for i in range(r.m)],
                                    [base + r.y + i * r.n * 4 for i in range(r.m)]))
        if not taken:
            return
        started = time.perf_counter()

        def done(indices: list[int], got: Answer | BaseException) -> None:
            for i in indices:
                segments.give(taken[i].segment)
            if not end.open:
                return
            if isinstance(got, BaseException):
                for i in indices:
                    end.send(contract.failed(taken[i].id, got))
                return
            if got.output is not None and got.output is not ys[indices[0]]:  # a backend's own array: into the slot
                np.copyto(ys[indices[0]], got.output)
            result = got.result
            timing = {**result.timing_ms, "engine": (time.perf_counter() - started) * 1e3}  # the engine's share
            b = got.batch
            end.send(contract.Done(taken[indices[0]].id, got.kernel.name, result.backend, result.activation_format,
                                   timing, (b["requests"], b["rows"], b.get("chunks", 1)), got.queue_ms,
                                   got.devices, self.epoch, [taken[i].id for i in indices[1:]]))

        self.engine.enqueue_many(target[0], target[1], xs, ys, [r.amax for r in taken], done, rows_at)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def matmul(self, end: Framed, r: Matmul) -> None:
        target = self.targets.get((r.model, r.version, r.tensor, r.scheme, r.kernel))  # a block of rows: its tensor's
        if target is None:  # a tensor (or file version) first seen: resolved off this path, then queued
            self._spawn(self._matmul_first(end, r))
            return
        self._enqueue(end, r, target)

    def _enqueue(self, end: Framed, r: Matmul, target: tuple[Model, Checked]) -> None:
        request_id = r.id
        try:
            buf = self.segments.take(r.segment, r.own, end)
        except Exception as exc:  # a segment that is gone (its front died): only this request fails
            if end.open:
                end.send(contract.failed(request_id, exc))
            return
        try:
            x = np.ndarray((r.m, r.k), np.float32, buf, r.x)
            y = np.ndarray((r.m, r.n), np.float32, buf, r.y)
        except Exception as exc:  # offsets outside the segment: a broken front
            self._answer(end, contract.failed(request_id, exc), r)
            return
        started = time.perf_counter()

        def done(got: Answer | BaseException) -> None:
            if isinstance(got, BaseException):
                self._answer(end, contract.failed(request_id, got), r)
                return
            if got.output is not y:  # a backend that gave its own array (the CPU's): into the slot
                np.copyto(y, got.output)
            result = got.result
            timing = {**result.timing_ms, "engine": (time.perf_counter() - started) * 1e3}  # the engine's share
            b = got.batch
            self._answer(end, contract.Done(request_id, got.kernel.name, result.backend, result.activation_format,
                                            timing, (b["requests"], b["rows"], b.get("chunks", 1)), got.queue_ms,
                                            got.devices, self.epoch), r)

        self.engine.enqueue(*target, x, y, done, r.amax, r.part)

    def _answer(self, end: Framed, answer: contract.Answer, r: Matmul) -> None:
        self.segments.give(r.segment, r.own)
        if end.open:
            end.send(answer)

    async def _matmul_first(self, end: Framed, r: Matmul) -> None:
        try:
            target = await self._resolve(r)
        except Exception as exc:
            if end.open:  # nothing of the request's segment was taken yet
                end.send(contract.failed(r.id, exc))
            return
        self._enqueue(end, r, target)

    async def _resolve(self, r: Matmul) -> tuple[Model, Checked]:
        """What the request names, as the front checked it: the same file version, or FileChanged (the front
        reads the file again and retries once)."""
        model = await self.store.current(r.model)
        if model.version_key != r.version:
            raise FileChanged(f"model {r.model!r} changed on disk while the request was on its way")
        mdl, info = ModelStore.tensor_of(model, r.tensor)
        scheme = Scheme(*r.scheme) if r.scheme else None
        target = mdl, Checked(info, scheme, effective(info, scheme), None if r.kernel == "auto" else KERNELS[r.kernel])
        if len(self.targets) >= TARGETS_KEPT:
            self.targets.clear()
        self.targets[(r.model, r.version, r.tensor, r.scheme, r.kernel)] = target
        return target

    # -- control questions --------------------------------------------------------------------------------------
    async def control(self, end: Framed, r: contract.Request) -> None:
        try:
            answer: contract.Answer = contract.Reply(r.id, await self.answer(r))
        except Exception as exc:
            if contract.failed(r.id, exc).error == "internal":
                log.exception("engine: %s failed", type(r).__name__)
            answer = contract.failed(r.id, exc)
        if end.open:
            end.send(answer)

    async def model(self, model_id: str) -> Model:
        model = await self.store.current(model_id)
        if model.status != "ok":
            raise Unreadable(f"model {model_id!r} could not be read: {model.error}")
        return model

    async def answer(self, r: contract.Request) -> Any:
        s = self.service
        if isinstance(r, contract.Health | contract.Ping):
            return await s.health()
        if isinstance(r, contract.Kernels):
            return await s.kernel_table()
        if isinstance(r, contract.MetricsText):
            return self.metrics.render().decode()
        if isinstance(r, contract.Residency):
            return await s.residency(await self.store.current(r.model))  # a broken file holds nothing: no error
        if isinstance(r, contract.Load):
            model = await self.model(r.model)
            infos = [model.tensors[name] for name in r.tensors if name in model.tensors]
            scheme = Scheme(*r.scheme) if r.scheme else None
            self._set_parts(r.model, [i.name for i in infos], scheme, r.part)
            return await s.load(model, infos, r.kernel, scheme, r.devices, r.placement, r.alone, r.part)
        if isinstance(r, contract.Unload):
            self._set_parts(r.model, r.tensors, None, None, every_format=True)
            return await s.unload(await self.store.current(r.model), set(r.tensors) if r.tensors is not None else None)
        if isinstance(r, contract.Splits):
            return [[*key, *rows] for key, rows in self.parts.items()]
        if isinstance(r, contract.QuantTimes):
            model = await self.model(r.model)
            rows = r.rows
            device, timed = await s.quant_times(model, model.tensors[r.tensor], rows,
                                                [Scheme(*f) for f in r.schemes], r.ms)
            return {"rows": rows, "device": device, "timed": timed}
        raise TypeError(f"no such request: {type(r).__name__}")

    def _set_parts(self, model: str, tensors: list[str] | None, scheme: Scheme | None, rows: tuple[int, int] | None,
                   every_format: bool = False) -> None:
        """Record this engine's block of each tensor (`rows`), or that it holds none (a whole copy, an unload: every
        weight format's with `every_format`); the epoch moves on any change."""
        tag = scheme.tag if scheme else ""
        before = dict(self.parts)
        for key in list(self.parts):
            if key[0] == model and (tensors is None or key[1] in tensors) and (every_format or key[2] == tag):
                del self.parts[key]
        if rows is not None:
            for name in tensors or ():
                self.parts[(model, name, tag)] = (rows[0], rows[1])
        if self.parts != before:
            self.epoch += 1

    async def housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            self.segments.drop_dead()

    def close(self) -> None:
        for name in list(self.segments.attached):
            self.segments.drop(name)
        self.engine.close()


def run(env: dict[str, str], socket_path: str) -> None:
    """The engine process's main (multiprocessing, spawn): the settings come from `env` (the supervisor's, with
    this engine's device)."""
    from app.serving.lifetime import die_with_parent

    die_with_parent()
    os.environ.update(env)
    settings = Settings.from_env()
    from app import logs

    logs.setup(settings.log_level, settings.log_format)
    if settings.gil_switch_us is not None:
        sys.setswitchinterval(settings.gil_switch_us / 1e6)
    import uvloop

    uvloop.run(_serve(settings, socket_path))


async def _serve(settings: Settings, socket_path: str) -> None:
    t0 = time.perf_counter()
    engine = EngineServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = await channel.serve(socket_path, engine.on_requests, engine.segments.lost)
    keeper = asyncio.create_task(engine.housekeeping())
    health = await engine.service.health()
    log.info("engine process %d: %s, %s, ready in %.1f s on %s", os.getpid(), health["backend"],
             ", ".join(d["device"] for d in health["devices"]), time.perf_counter() - t0, socket_path)
    try:
        await stop.wait()
    finally:
        keeper.cancel()
        server.close()
        engine.close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
