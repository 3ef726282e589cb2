"""What the routes ask of the engine, in one interface: `LocalService` runs the engine in this process (tests, Ray
Serve replicas, `--fronts 0`); `RemoteService` (app/serving/front.py) asks the engine processes over the channel,
the same questions with the same answers.  Every serving feature lives behind this edge, not in the routes.
`open_engine` is the one factory of an engine, its model store and its metrics, for this process or an engine
process alike."""

from __future__ import annotations

from typing import Any, Literal, Protocol

import numpy as np
from fastapi.concurrency import run_in_threadpool

from app.announce import announce, announce_models
from app.checks import Checked
from app.engine import Engine
from app.metrics import Metrics
from app.scheduler import Answer
from app.settings import Settings
from kernels.errors import Conflict, InvalidRequest
from kernels.requant import Scheme
from kernels.select import KernelChooser
from models.store import Model, ModelStore, TensorInfo


def open_engine(settings: Settings, metrics: Metrics) -> tuple[Engine, ModelStore]:
    """An engine on the devices the settings name, the model store whose retired file versions it forgets, and
    their metrics: what the one-process app, a Ray replica and an engine process each serve with."""
    engine = Engine(settings)
    announce(settings, engine)
    store = ModelStore(settings.models_dir, settings.max_header_bytes, on_retire=engine.forget,
                       cache_dir=settings.index_dir, background=True)
    for worker in engine.workers:
        worker.scheduler.observe = metrics.observe_batch
    metrics.track(engine.workers, engine.pools["cuda"], engine.outputs)
    announce_models(settings, store.scan())
    return engine, store


class Service(Protocol):
    async def chooser(self) -> KernelChooser:
        """What app/checks.py checks a named kernel against: the engine's devices."""
        ...

    async def health(self) -> dict[str, Any]: ...

    async def kernel_table(self) -> list[dict[str, Any]]: ...

    async def matmul(self, model: Model, checked: Checked, x: np.ndarray) -> Answer:
        """The product of a request app/checks.py checked (its values are the engine's to check)."""
        ...

    async def load(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None,
                   devices: list[int] | None, placement: Literal["replicate", "split"] | None) -> dict[str, Any]: ...

    async def unload(self, model: Model, tensors: set[str] | None) -> dict[str, Any]: ...

    async def residency(self, model: Model) -> dict[str, Any]: ...

    async def quant_times(self, model: Model, info: TensorInfo, rows: list[dict[str, Any]], schemes: list[Scheme],
                          ms: list[int]) -> tuple[str | None, bool]: ...

    async def metrics_text(self) -> str: ...


class LocalService:
    """The engine of this process, behind the routes' interface."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def chooser(self) -> KernelChooser:
        return self.engine.chooser

    async def health(self) -> dict[str, Any]:
        e = self.engine
        return {"backend": e.backend, "device": e.device,
                "compile_ms": e.compile_ms,
                "devices": [w.state() for w in e.workers]}

    async def kernel_table(self) -> list[dict[str, Any]]:
        return self.engine.kernel_table()

    async def matmul(self, model: Model, checked: Checked, x: np.ndarray) -> Answer:
        return await self.engine.run(model, checked, x)

    async def load(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None,
                   devices: list[int] | None, placement: Literal["replicate", "split"] | None,
                   alone: bool = True, rows: tuple[int, int] | None = None) -> dict[str, Any]:
        """`alone` False: this engine is one of a server's several (an engine process per device); `rows`: only
        that block of rows of each tensor, this engine's share of a tensor split across them."""
        e = self.engine
        backend = e.backend
        if e.gpu is None and len(e.pools["cpu"]) == 1 and alone:
            raise Conflict(f"this server runs on the CPU backend ({e.cuda_error}); nothing to load", "no_gpu")
        if rows is not None:
            loaded = []
            for info in infos:
                loaded += await run_in_threadpool(e.preload_rows, model, info, kernel, scheme, rows, backend)
            return {"loaded": loaded, "resident": e.residency(model)}
        pool = [e.worker_named(backend, d) for d in devices] if devices else None
        if pool is not None and len(set(pool)) != len(pool):
            raise InvalidRequest("devices names a device twice", "bad_device")
        loaded = await run_in_threadpool(e.preload, model, infos, kernel, scheme, pool, placement, backend)
        return {"loaded": loaded, "resident": e.residency(model)}

    async def unload(self, model: Model, tensors: set[str] | None) -> dict[str, Any]:
        freed = await run_in_threadpool(self.engine.unload, model, tensors)
        return {"freed_bytes": freed, "resident": self.engine.residency(model)}

    async def residency(self, model: Model) -> dict[str, Any]:
        return self.engine.residency(model)

    async def quant_times(self, model: Model, info: TensorInfo, rows: list[dict[str, Any]], schemes: list[Scheme],
                          ms: list[int]) -> tuple[str | None, bool]:
        """Time each scheme's product on the GPU into `rows` (where there is one); (the device, whether timed)."""
        from app.quant_report import time_schemes

        e = self.engine
        if e.gpu is None or info.matmul_reason:  # a vector's errors are reported, not timed
            return e.device, False
        await run_in_threadpool(time_schemes, e, model, info, rows, schemes, ms)
        return e.device, True

    async def metrics_text(self) -> str:
        return ""  # the engine's metrics are in this process's registry already
