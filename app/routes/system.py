"""Health and the kernel registry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app import __version__
from app.errors import RETRY_AFTER, ApiError
from app.schemas import ErrorResponse, Health, KernelList

health_router = APIRouter(tags=["system"])
router = APIRouter(tags=["system"])


@health_router.get("/healthz", response_model=Health, operation_id="healthz")
async def healthz(request: Request) -> dict[str, Any]:
    return {"status": "ok", "version": __version__, **await request.app.state.service.health()}  # or degraded


READY_503 = ("Not ready (`not_ready`): /healthz says degraded, the engine process starting (compiling its kernels "
             "on a fresh GPU machine) or coming back, and products would answer 503 `engine_unavailable`; retry after "
             "the Retry-After seconds.")


@health_router.get("/readyz", response_model=Health, operation_id="readyz",
                   responses={503: {"model": ErrorResponse, "description": READY_503}})
async def readyz(request: Request) -> dict[str, Any]:
    """For a load balancer or readiness probe: /healthz's answer while it says ok, else 503 (/healthz itself answers
    200 whenever the process is up: liveness)."""
    health = await healthz(request)
    if health["status"] != "ok":
        down = [f"{p['role']} {p['index']} {p['state']}" for p in health.get("processes", []) if p["state"] != "ok"]
        raise ApiError(503, "not_ready", f"degraded ({', '.join(down) or 'the engine does not answer'})",
                       {"Retry-After": RETRY_AFTER[503]})
    return health


@router.get("/kernels", response_model=KernelList, operation_id="list_kernels")
async def kernels(request: Request) -> dict[str, Any]:
    return {"kernels": await request.app.state.service.kernel_table()}


METRICS_DOC = ("Prometheus text exposition: qgemm_http_requests_total, qgemm_http_request_seconds, "
               "qgemm_batch_requests, qgemm_batch_rows, qgemm_queue_depth, qgemm_gpu_resident_bytes, "
               "qgemm_gpu_budget_bytes (all devices together); per device (label `device`): "
               "qgemm_device_queue_depth, qgemm_device_resident_bytes, qgemm_device_budget_bytes, "
               "qgemm_device_products_total")


@health_router.get("/metrics", operation_id="metrics", response_class=Response, responses={
    200: {"description": METRICS_DOC, "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """For Prometheus to scrape (no API key, like /healthz and /readyz)."""
    extra = await request.app.state.service.metrics_text()
    return Response(request.app.state.metrics.render(extra), media_type=CONTENT_TYPE_LATEST)
