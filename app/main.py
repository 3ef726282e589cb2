"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.routing import Route

from app import __version__, errors, openapi, web
from app.engine import Engine
from app.limits import BodyLimit, require_api_key
from app.metrics import Metrics, RequestMetrics
from app.routes import matmul, models, system
from app.service import LocalService
from app.settings import Settings
from kernels.cache import ByteLRU
from models import gguf_index
from models.store import Model, ModelStore

log = logging.getLogger("qgemm")
GiB = 1 << 30


def announce(settings: Settings, engine: Engine) -> None:
    """The start, one line each: version, then the backend and its devices (a warning, with the fix, when a GPU is
    present but cannot serve)."""
    log.info("qgemm %s (Python %s, pid %d)", __version__, platform.python_version(), os.getpid())
    if engine.cuda is not None:
        for w in engine.pools["cuda"]:
            b = w.backend
            used, budget = b.memory()
            log.info("backend cuda: %s %s (compute capability %d.%d, %d SMs), weight budget %.1f GiB, kernels "
                     "compiled in %.0f ms", b.label, b.device_name, b.cc // 10, b.cc % 10, b.sm_count, budget / GiB,
                     b.compile_ms)
    elif engine.devices.gpu_present:
        log.warning("backend cpu (numpy), although an NVIDIA GPU is present: %s", engine.cuda_error)
    else:
        log.info("backend cpu (numpy): %s", engine.cuda_error)


def announce_models(settings: Settings, models: list[Model]) -> None:
    """The models found (and each one that cannot be read), and where the pages and the API docs are."""
    states = ", ".join(f"{m.id} ({m.status}{f', {len(m.tensors)} tensors' if m.status == 'ok' else ''})"
                       for m in models)
    log.info("models in %s: %s", settings.models_dir, states or "none (qgemm fetch writes the demo and gets real "
                                                               "ones)")
    for m in models:
        if m.status == "error":
            log.warning("model %s cannot be read: %s", m.id, m.error)
    base = f"http://{settings.host}:{settings.port}"
    log.info("serving the pages at %s/ and the API docs at %s/docs", base, base)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    if settings.gil_switch_us is not None:  # here, so that every worker process (QGEMM_WORKERS) takes it
        sys.setswitchinterval(settings.gil_switch_us / 1e6)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = Engine(settings)
        announce(settings, engine)
        store = ModelStore(settings.models_dir, settings.max_header_bytes, on_retire=engine.forget,
                           cache_dir=settings.index_dir, background=True)
        app.state.store, app.state.engine, app.state.service = store, engine, LocalService(engine)
        for worker in engine.workers:
            worker.scheduler.observe = metrics.observe_batch
        metrics.track(engine.workers, engine.pools["cuda"], engine.outputs)
        app.state.stats_cache = ByteLRU(64)  # counts entries: 64 tensors' statistics
        announce_models(settings, store.scan())
        try:
            yield
        finally:
            engine.close()
            gguf_index.shutdown()

    # telemetry off: the service exports Prometheus metrics (/metrics), and FastAPI's OpenTelemetry
    # check of its providers cost ~60 µs on every request (profiled, docs/reports/service.md)
    # the API docs page serves Swagger UI's own files (fastapi-offline): it works without internet
    app = FastAPIOffline(title="qgemm", version=__version__, lifespan=lifespan, redoc_url=None,
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
