"""An engine process of `qgemm serve`: it owns the CUDA context (or the CPU backend), the resident weights, the
batching scheduler and the kernels, and answers the front processes over a Unix socket (app/ipc.py).

A front writes a request's X into its shared-memory arena (app/shm.py) and names the slot; the engine attaches to
that arena once (on a GPU: registered as page-locked memory), multiplies X in place and writes Y into the same
slot, then answers with the timing and the batch.  Requests from every front meet in one scheduler per device,
so batching sees all clients.  The engine reads model files itself, through its own store: each product is
computed over bytes checked against the file version it names, as in one process.
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

from app import ipc, shm
from app.errors import ApiError, as_http
from app.settings import Settings
from app.tensors import scheme_from
from kernels.errors import QgemmError
from models.store import FileChanged, Model, ModelStore, NotFound

log = logging.getLogger("qgemm")
HOUSEKEEPING_S = 5.0  # how often the engine lets go of the arenas of fronts that are gone


def error_reply(exc: BaseException) -> dict[str, Any]:
    """An exception as the front turns it back into the same HTTP answer (app/errors.py's mapping)."""
    mapped = as_http(exc)
    if mapped is None:
        raise exc
    status, code, message, headers = mapped
    return {"error": {"status": status, "code": code, "message": message, "headers": headers}}


class Segments:
    """The fronts' arenas this engine has attached, by name; a request's own segment is attached for its product
    alone.  With `pin` (QGEMM_PIN_ARENAS, on a GPU) an arena is page-locked once, at its first request, and the
    device copies Y into it by DMA; without, X goes through the backend's pinned staging as in one process and Y
    is copied into the slot through the driver's staging."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.attached: dict[str, tuple[Any, int | None]] = {}

    def buffer(self, name: str, own: bool = False) -> memoryview:
        hit = self.attached.get(name)
        if hit is None:
            segment = shm.attach(name)
            ptr = None
            if self.pin and not own:  # a request's own segment lives for one product: not worth locking
                from kernels.cuda import host_memory

                ptr = np.frombuffer(segment.buf, np.uint8).ctypes.data
                host_memory.register(ptr, segment.size)
            hit = self.attached[name] = (segment, ptr)
        return hit[0].buf

    def drop(self, name: str) -> None:
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
        for name in list(self.attached):
            pid = shm.owner(name)
            if pid is None or not shm.alive(pid):
                self.drop(name)


class EngineServer:
    def __init__(self, settings: Settings):
        from app.announce import announce, announce_models
        from app.engine import Engine
        from app.metrics import Metrics
        from app.service import LocalService

        self.settings = settings
        self.engine = Engine(settings)
        announce(settings, self.engine)
        self.store = ModelStore(settings.models_dir, settings.max_header_bytes, on_retire=self.engine.forget,
                                cache_dir=settings.index_dir, background=True)
        announce_models(settings, self.store.scan())
        self.service = LocalService(self.engine)
        self.metrics = Metrics(engine=True)
        for worker in self.engine.workers:
            worker.scheduler.observe = self.metrics.observe_batch
        self.metrics.track(self.engine.workers, self.engine.pools["cuda"], self.engine.outputs)
        self.segments = Segments(pin=settings.pin_arenas and self.engine.cuda is not None)

    async def model(self, model_id: str) -> Model:
        model = await self.store.current(model_id)
        if model.status != "ok":
            raise ApiError(409, "model_unreadable", f"model {model_id!r} could not be read: {model.error}")
        return model

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return await getattr(self, "op_" + msg["op"])(msg)
        except (ApiError, QgemmError, FileChanged, NotFound) as exc:
            return error_reply(exc)

    async def op_matmul(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        m, k, n = msg["m"], msg["k"], msg["n"]
        own = msg.get("own", False)
        buf = self.segments.buffer(msg["segment"], own)
        x = y = None
        try:
            x = np.ndarray((m, k), np.float32, buf, msg["x"])
            y = np.ndarray((m, n), np.float32, buf, msg["y"])
            for attempt in (0, 1):  # a file that changes under the request: read again, and run once more
                try:
                    mdl, info = ModelStore.tensor_of(await self.store.current(msg["model"]), msg["tensor"])
                    answer = await self.service.matmul(mdl, info, x, msg["kernel"], scheme_from(msg.get("scheme")),
                                                       out=y)
                    break
                except FileChanged:
                    if attempt:
                        raise
            if answer.output is not y:  # a backend that gave its own array (the CPU's): into the slot
                np.copyto(y, answer.output)
            result = answer.result
            timing = {**result.timing_ms, "engine": (time.perf_counter() - t0) * 1e3}  # the engine's whole share
            return {"kernel": answer.spec.name, "activation_format": result.activation_format,
                    "backend": result.backend, "timing": timing, "batch": answer.batch,
                    "devices": answer.devices, "queue_ms": answer.queue_ms}
        finally:
            del x, y
            if own:
                self.segments.drop(msg["segment"])

    async def op_health(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.service.health()

    async def op_kernels(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"kernels": await self.service.kernel_table()}

    async def op_metrics(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"text": self.metrics.render().decode()}

    async def op_residency(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.service.residency(await self.model(msg["model"]))

    async def op_load(self, msg: dict[str, Any]) -> dict[str, Any]:
        model = await self.model(msg["model"])
        infos = [model.tensors[name] for name in msg["tensors"] if name in model.tensors]
        return await self.service.load(model, infos, msg.get("kernel"), scheme_from(msg.get("scheme")),
                                       msg.get("devices"), msg.get("placement"))

    async def op_unload(self, msg: dict[str, Any]) -> dict[str, Any]:
        model = await self.store.current(msg["model"])
        tensors = set(msg["tensors"]) if msg.get("tensors") is not None else None
        return await self.service.unload(model, tensors)

    async def op_quant_times(self, msg: dict[str, Any]) -> dict[str, Any]:
        model = await self.model(msg["model"])
        rows = msg["rows"]
        device, timed = await self.service.quant_times(model, model.tensors[msg["tensor"]], rows,
                                                       [scheme_from(s) for s in msg["schemes"]], msg["ms"])
        return {"rows": rows, "device": device, "timed": timed}

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
    this engine's devices)."""
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
    server = await ipc.serve(socket_path, engine.handle)
    keeper = asyncio.create_task(engine.housekeeping())
    health = await engine.service.health()
    log.info("engine process %d: %s, %s, ready in %.1f s on %s", os.getpid(), health["backend"],
             health["device"] or "numpy", time.perf_counter() - t0, socket_path)
    try:
        await stop.wait()
    finally:
        keeper.cancel()
        server.close()
        engine.close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
