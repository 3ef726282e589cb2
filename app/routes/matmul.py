"""POST /v1/matmul: JSON or .npy in, JSON or .npy out, timing in the body and in Server-Timing."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from app.errors import ApiError
from app.openapi import errors
from app.schemas import DEMO_K, DEMO_MODEL, DEMO_TENSOR, KERNEL_NAMES, MatmulRequest, MatmulResponse
from models.store import NotFound

router = APIRouter(tags=["matmul"])

NPY = "application/x-npy"
JSON = "application/json"


def _media(value: str | None) -> str:
    return (value or "").split(";")[0].strip().lower()


def parse_json(body: bytes) -> MatmulRequest:
    try:
        return MatmulRequest.model_validate_json(body)
    except ValidationError as exc:
        errs = exc.errors()
        if errs and errs[0]["type"] == "json_invalid":
            why = errs[0].get("ctx", {}).get("error", "")
            raise ApiError(400, "bad_json", f"body is not valid JSON: {why}") from None
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errs[:3]]
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        raise ApiError(400, "bad_request", "; ".join(parts) + more) from None


def rows_to_array(rows: list[list[float]]) -> np.ndarray:
    """The JSON rows as X; checked after the tensor is found, so that an unknown tensor is a 404 first."""
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise ApiError(422, "bad_shape", f"activations rows have different lengths ({sorted(widths)[:5]}): "
                                         "X must be a rectangular [M, K] array")
    return np.array(rows, dtype=np.float64)


def parse_npy(body: bytes) -> np.ndarray:
    try:
        x = np.load(io.BytesIO(body), allow_pickle=False)
    except ValueError as exc:
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: {exc}") from None
    except Exception as exc:  # truncated or garbage headers raise several kinds
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: {type(exc).__name__}: {exc}") from None
    if not isinstance(x, np.ndarray):
        raise ApiError(400, "bad_npy", "body holds no single .npy array")
    if x.dtype not in (np.float32, np.float64):
        raise ApiError(422, "bad_dtype", f".npy activations must be float32 or float64, not {x.dtype}")
    return x


def server_timing(timing: dict[str, float]) -> str:
    return ", ".join(f"{k};dur={v:.3f}" for k, v in timing.items())


MATMUL_HEADERS = {
    "Server-Timing": "the timing_ms entries (upload, quantize, gemm, download, total, request) in ms",
    "X-Qgemm-Kernel": "the kernel that ran (auto resolved)",
    "X-Qgemm-Backend": "cpu or cuda",
    "X-Qgemm-Activation-Format": "the activation format the kernel computes with",
    "X-Qgemm-Shape": "M,N of the output",
}
REQUEST_BODY = {
    "required": True,
    "description": "JSON: a MatmulRequest. Or `application/x-npy`: a NumPy .npy file (float32 or float64, 2-D [M, K], "
                   "no pickles) with `model`, `tensor` and `kernel` as query parameters, e.g. "
                   f"`curl --data-binary @x.npy -H 'Content-Type: {NPY}' "
                   f"'.../v1/matmul?model={DEMO_MODEL}&tensor={DEMO_TENSOR}'`.",
    "content": {JSON: {"schema": MatmulRequest.model_json_schema()},
                NPY: {"schema": {"type": "string", "format": "binary",
                                 "description": f"a .npy file holding X [M, K] (K = {DEMO_K} for {DEMO_TENSOR})"}}},
}


@router.post(
    "/matmul",
    operation_id="matmul",
    response_model=MatmulResponse,
    responses={200: {"description": "Y [M, N]: JSON (MatmulResponse), or a float32 .npy with `Accept: "
                                    f"{NPY}` (the timing then in Server-Timing and the other values in X-Qgemm-*)",
                     "content": {NPY: {"schema": {"type": "string", "format": "binary"}}},
                     "headers": {h: {"description": d, "schema": {"type": "string"}}
                                 for h, d in MATMUL_HEADERS.items()}},
               **errors(404, 415, 422, 503)},
    openapi_extra={"requestBody": REQUEST_BODY},
)
async def matmul(
    request: Request,
    model: str | None = Query(None, description="required with a .npy body: the model id (ignored for JSON bodies)",
                              examples=[DEMO_MODEL]),
    tensor: str | None = Query(None, description="required with a .npy body: the tensor name (ignored for JSON bodies)",
                               examples=[DEMO_TENSOR]),
    kernel: str = Query("auto", description=".npy bodies: the kernel (ignored for JSON bodies)",
                        json_schema_extra={"enum": KERNEL_NAMES}),
) -> Response:
    """Y[M, N] = X[M, K] · W[N, K]ᵀ with W a model's tensor.  JSON body, or a .npy body with the
    model, tensor and kernel as query parameters; `Accept: application/x-npy` answers .npy."""
    t_request = time.perf_counter()
    if kernel != "auto":  # checked wherever it appears, although a JSON body names its own kernel
        request.app.state.engine.kernel_named(kernel)
    ctype = _media(request.headers.get("content-type"))
    if ctype not in (JSON, NPY):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Type must be {JSON} or {NPY}, not {ctype or 'missing'}")
    body = await request.body()
    if ctype == JSON:
        req = await run_in_threadpool(parse_json, body)
        model_id, tensor_name, kernel_name = req.model, req.tensor, req.kernel
    else:
        if not model or not tensor:
            raise ApiError(400, "bad_request", ".npy bodies need the model and tensor as query parameters "
                                               "(?model=...&tensor=...)")
        model_id, tensor_name, kernel_name = model, tensor, kernel
    state = request.app.state
    try:
        mdl, info = state.store.tensor(model_id, tensor_name)
    except NotFound as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    x = await run_in_threadpool(rows_to_array, req.activations) if ctype == JSON \
        else await run_in_threadpool(parse_npy, body)
    spec, result = await state.engine.run_matmul(mdl, info, x, kernel_name)
    timing = {k: round(float(v), 4) for k, v in result.timing_ms.items()}
    y = result.output
    headers = {"X-Qgemm-Kernel": spec.name, "X-Qgemm-Backend": result.backend,
               "X-Qgemm-Activation-Format": result.activation_format,
               "X-Qgemm-Shape": f"{y.shape[0]},{y.shape[1]}"}
    wants_npy = NPY in (request.headers.get("accept") or "").lower()
    if wants_npy:
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(y, dtype=np.float32), allow_pickle=False)
        content, media = buf.getvalue(), NPY
    else:
        payload: dict[str, Any] = {"output": y.tolist(), "shape": list(y.shape), "model": mdl.id,
                                   "tensor": info.name, "kernel": spec.name,
                                   "activation_format": result.activation_format,
                                   "backend": result.backend, "timing_ms": timing}
        content, media = json.dumps(payload, allow_nan=False).encode(), JSON
    timing["request"] = round((time.perf_counter() - t_request) * 1e3, 4)
    headers["Server-Timing"] = server_timing(timing)
    return Response(content, media_type=media, headers=headers)
