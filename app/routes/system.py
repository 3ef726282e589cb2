"""Health and the kernel registry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app import __version__
from app.schemas import Health, KernelList

health_router = APIRouter(tags=["system"])
router = APIRouter(tags=["system"])


@health_router.get("/healthz", response_model=Health, operation_id="healthz")
def healthz(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    return {"status": "ok", "backend": engine.backend, "device": engine.device, "version": __version__,
            "compile_ms": engine.cuda.compile_ms if engine.cuda is not None else None,
            "devices": [w.state() for w in engine.workers]}


@router.get("/kernels", response_model=KernelList, operation_id="list_kernels")
def kernels(request: Request) -> dict[str, Any]:
    return {"kernels": request.app.state.engine.kernel_table()}


METRICS_DOC = ("Prometheus text exposition: qgemm_http_requests_total, qgemm_http_request_seconds, "
               "qgemm_batch_requests, qgemm_batch_rows, qgemm_queue_depth, qgemm_gpu_resident_bytes, "
               "qgemm_gpu_budget_bytes (all devices together); per device (label `device`): "
               "qgemm_device_queue_depth, qgemm_device_resident_bytes, qgemm_device_budget_bytes, "
               "qgemm_device_products_total")


@health_router.get("/metrics", operation_id="metrics", response_class=Response, responses={
    200: {"description": METRICS_DOC, "content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(request: Request) -> Response:
    """For Prometheus to scrape (no API key, like /healthz)."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
