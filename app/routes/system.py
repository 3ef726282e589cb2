"""Health and the kernel registry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app import __version__
from app.schemas import Health, KernelList

health_router = APIRouter(tags=["system"])
router = APIRouter(tags=["system"])


@health_router.get("/healthz", response_model=Health, operation_id="healthz")
def healthz(request: Request) -> dict[str, Any]:
    engine = request.app.state.engine
    return {"status": "ok", "backend": engine.backend, "device": engine.device, "version": __version__,
            "compile_ms": engine.cuda.compile_ms if engine.cuda is not None else None}


@router.get("/kernels", response_model=KernelList, operation_id="list_kernels")
def kernels(request: Request) -> dict[str, Any]:
    return {"kernels": request.app.state.engine.kernel_table()}
