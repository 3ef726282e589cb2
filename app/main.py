"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI
from starlette.routing import Route

from app import __version__, errors, openapi, web
from app.engine import Engine
from app.limits import BodyLimit, require_api_key
from app.metrics import Metrics, RequestMetrics
from app.routes import matmul, models, system
from app.settings import Settings
from kernels.cache import ByteLRU
from models.store import ModelStore

log = logging.getLogger("qgemm")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    if settings.gil_switch_us is not None:  # here, so that every worker process (QGEMM_WORKERS) takes it
        sys.setswitchinterval(settings.gil_switch_us / 1e6)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = Engine(settings)
        store = ModelStore(settings.models_dir, settings.max_header_bytes, on_retire=engine.forget)
        for m in store.scan():
            if m.status != "ok":
                log.warning("model %s: %s", m.id, m.error)
        app.state.store, app.state.engine = store, engine
        for worker in engine.workers:
            worker.scheduler.observe = metrics.observe_batch
        metrics.track(engine.workers, engine.pools["cuda"], engine.outputs)
        app.state.stats_cache = ByteLRU(64)  # counts entries: 64 tensors' statistics
        log.info("qgemm %s: backend %s (%s), models in %s", __version__, engine.backend,
                 ", ".join(f"{w.label} {w.name}" for w in engine.pools[engine.backend]) or engine.cuda_error,
                 settings.models_dir)
        try:
            yield
        finally:
            engine.close()

    # telemetry off: the service exports Prometheus metrics (/metrics), and FastAPI's OpenTelemetry
    # check of its providers cost ~60 µs on every request (profiled, docs/reports/service.md)
    app = FastAPI(title="qgemm", version=__version__, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False},
                  description="Inspect GGUF models and multiply their quantized weights the way llama.cpp does.")
    app.state.settings = settings
    metrics = Metrics()
    app.state.metrics = metrics
    errors.install(app)
    openapi.install(app, api_key_set=settings.api_key is not None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    v1.include_router(models.router)
    v1.include_router(system.router)
    app.include_router(system.health_router)
    app.include_router(v1)
    web.install(app)  # the pages (/, /ui/...) over the same /v1 API
    # POST /v1/matmul: a plain route, first (the hot path), documented by app/openapi.py
    app.router.routes.insert(0, Route("/v1/matmul", matmul.matmul, methods=["POST"], include_in_schema=False))
    app.add_middleware(errors.Unhandled)  # innermost of ours: the metrics count its 500s
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics, templates=lambda: list(app.openapi()["paths"]))
    return app
