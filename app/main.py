"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.routing import Route

from app import __version__, errors, hot_path, openapi, web
from app.announce import announce_urls, announce_version
from app.limits import BodyLimit, require_api_key
from app.metrics import Metrics, RequestMetrics
from app.routes import inference, matmul, models, system
from app.service import LocalService, open_engine

if TYPE_CHECKING:
    from app.serving.front import RemoteService
from app.settings import Settings
from kernels.cache import ByteLRU
from models import gguf_index
from models.store import ModelStore

log = logging.getLogger("qgemm")
GiB = 1 << 30


def create_app(settings: Settings | None = None, service: RemoteService | None = None) -> FastAPI:
    """The app: with its engine in this process, or (`service`, a RemoteService) a front of `qgemm serve` whose
    engine is another process."""
    settings = settings or Settings.from_env()
    if settings.gil_switch_us is not None:  # here, so that every front process takes it
        sys.setswitchinterval(settings.gil_switch_us / 1e6)

    @asynccontextmanager
    async def front_lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.open()  # this front's shared-memory arena
        # its own store: model and tensor names answer 404 here, and the engine checks the file version again
        app.state.store = ModelStore(settings.models_dir, settings.max_header_bytes, cache_dir=settings.index_dir,
                                     background=True)
        app.state.store.scan()
        app.state.engine, app.state.service = None, service
        app.state.stats_cache = ByteLRU(64)
        service.ready()
        try:
            yield
        finally:
            await service.close()
            gguf_index.shutdown()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        announce_version()
        engine, store = open_engine(settings, metrics)
        app.state.store, app.state.engine, app.state.service = store, engine, LocalService(engine)
        app.state.stats_cache = ByteLRU(64)  # counts entries: 64 tensors' statistics
        announce_urls(settings)
        try:
            yield
        finally:
            engine.close()
            gguf_index.shutdown()

    # telemetry off: the service exports Prometheus metrics (/metrics), and FastAPI's OpenTelemetry
    # check of its providers cost ~60 µs on every request (profiled)
    # the API docs page serves Swagger UI's own files (fastapi-offline): it works without internet
    app = FastAPIOffline(title="qgemm", version=__version__, lifespan=lifespan if service is None else front_lifespan,
                         redoc_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False},
                  description="Inspect GGUF models and multiply their quantized weights the way llama.cpp does.")
    app.state.settings = settings
    metrics = Metrics(engine=service is None)  # a front's engine reports its own
    app.state.metrics = metrics
    errors.install(app)
    openapi.install(app, api_key_set=settings.api_key is not None, matmul_operation=matmul.operation)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    v1.include_router(models.router)
    v1.include_router(system.router)
    app.include_router(system.health_router)
    app.include_router(v1)
    app.include_router(inference.health)  # the Open Inference Protocol (KServe v2) beside the native API
    app.include_router(inference.router)
    app.add_exception_handler(inference.V2Error, inference.v2_error)
    web.install(app)  # the pages (/, /ui/...) over the same /v1 API
    # POST /v1/matmul: a plain route, first (the hot path), documented by app/openapi.py
    app.router.routes.insert(0, Route("/v1/matmul", matmul.matmul, methods=["POST"], include_in_schema=False))
    app.add_middleware(errors.Unhandled)  # innermost of ours: the metrics count its 500s
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics,
                       templates=lambda: [*inference.TEMPLATES, *app.openapi()["paths"]])
    hot_path.install(app, metrics, settings.max_body_bytes)  # POST /v1/matmul around all of the above
    return app
