"""The Open Inference Protocol (KServe v2, the REST protocol Triton speaks) beside the native API, so that Triton's
and KServe's clients and load tools reach qgemm unmodified.

A v2 model is a (GGUF model, tensor) pair, named the way the native API names it: `MODEL/TENSOR`, e.g.
`demo/blk.0.attn_q.weight` (a model id holds no slash).  Its one input `x` is FP32 [-1, K] and its one output `y`
FP32 [-1, N]; version "1".  Request parameters `kernel`, `weight_format`, `blocksize` and `double_quant` are the
native route's; the answer's parameters hold the kernel, backend, activation format, devices, batch and each
timing step (`gemm_ms`, ...).  Tensors travel as JSON `data` (flat, row-major, or nested) or by the binary tensor
data extension (`Inference-Header-Content-Length`, `binary_data_size`, `binary_data` / `binary_data_output`).
The model repository extension lists every pair (`POST /v2/repository/index`); load and unload are not offered.

The product goes the native route's one path (`matmul.multiply`: the same checks, deadline and retry), so its Y
equals the native answer's bit for bit.  Errors are the protocol's `{"error": "<message>"}` with the native
route's status (the native code leads the message).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from app import __version__
from app.errors import MAPPED, ApiError, as_http
from app.limits import check_api_key
from app.routes.matmul import INLINE_BYTES, _json_too_large, multiply
from app.tensors import scheme_of
from kernels.bnb4 import DEFAULT_BLOCKSIZE
from kernels.select import KernelChooser
from models.store import Model, ModelStore, TensorInfo


class V2Error(Exception):
    """An error answered in the protocol's shape, `{"error": "<message>"}` (app.main registers its handler)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


async def _key(request: Request) -> None:
    """The native API's key and cross-site checks (app/limits.py), answered in the protocol's shape."""
    try:
        check_api_key(request)
    except ApiError as exc:
        raise V2Error(exc.status, f"{exc.code}: {exc.message}", exc.headers) from None


async def v2_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, V2Error)
    return _error(exc.status, exc.message, exc.headers)


health = APIRouter(prefix="/v2", include_in_schema=False)  # the protocol's own text documents it; no key (probes)
router = APIRouter(prefix="/v2", include_in_schema=False, dependencies=[Depends(_key)])
VERSION = "1"
INPUT, OUTPUT, FP32 = "x", "y", "FP32"
HEADER_LENGTH = "inference-header-content-length"
EXTENSIONS = ["binary_tensor_data", "model_repository", "parameters"]
# the routes' templates for the request metrics (app/metrics.py), the most specific first
TEMPLATES = ["/v2", "/v2/health/live", "/v2/health/ready", "/v2/repository/index",
             *(f"/v2/models/{{name:path}}{v}{end}" for end in ("/infer", "/ready", "")
               for v in ("/versions/{version}", ""))]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type="application/json",
                    headers=headers)


def _as_v2(exc: Exception) -> Response:
    status, code, message, headers = as_http(exc)  # type: ignore[misc]
    return _error(status, f"{code}: {message}", headers)


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _pair(name: str) -> tuple[str, str]:
    model, sep, tensor = name.partition("/")
    if not sep or not model or not tensor:
        raise ApiError(404, "not_found", f"a model here is MODEL/TENSOR (e.g. demo/blk.0.attn_q.weight), not {name!r}")
    return model, tensor


def _version(version: str | None) -> None:
    if version not in (None, VERSION):
        raise ApiError(404, "not_found", f"version {version!r}: every model here has version {VERSION} alone")


async def _tensor(request: Request, name: str) -> tuple[Model, TensorInfo]:
    model_id, tensor = _pair(name)
    return ModelStore.tensor_of(await request.app.state.store.current(model_id), tensor)


def _metadata(name: str, info: TensorInfo) -> dict[str, Any]:
    n, k = info.shape if len(info.shape) == 2 else (-1, -1)
    return {"name": name, "versions": [VERSION], "platform": "qgemm",
            "inputs": [{"name": INPUT, "datatype": FP32, "shape": [-1, k]}],
            "outputs": [{"name": OUTPUT, "datatype": FP32, "shape": [-1, n]}],
            "parameters": {"type": info.type_name}}


# -- server ---------------------------------------------------------------------------------------------------------
@router.get("")
async def server_metadata() -> Response:
    return _json({"name": "qgemm", "version": __version__, "extensions": EXTENSIONS})


@health.get("/health/live")
async def live() -> Response:
    return _json({"live": True})


@health.get("/health/ready")
async def ready(request: Request) -> Response:
    health = await request.app.state.service.health()
    if health.get("status", "ok") != "ok":
        return _error(503, "not ready: degraded (/healthz says why)", {"Retry-After": "1"})
    return _json({"ready": True})


@router.post("/repository/index")
async def repository_index(request: Request) -> Response:
    """Every (model, tensor) pair that can be multiplied; `{"ready": true}` in the body: the ready ones alone."""
    body = await request.body()
    try:
        only_ready = bool(orjson.loads(body).get("ready", False)) if body.strip() else False
    except (orjson.JSONDecodeError, AttributeError):
        return _error(400, "bad_json: the body is a JSON object, e.g. {\"ready\": true}")
    rows = []
    for m in request.app.state.store.scan():
        if m.status != "ok":
            if not only_ready:
                rows.append({"name": f"{m.id}/", "version": VERSION, "state": "UNAVAILABLE",
                             "reason": m.error or m.status})
            continue
        rows += [{"name": f"{m.id}/{t.name}", "version": VERSION, "state": "READY", "reason": ""}
                 for t in m.tensors.values() if t.matmul]
    return _json(rows)


# -- models ---------------------------------------------------------------------------------------------------------
async def _model(request: Request, name: str, version: str | None, readiness: bool) -> Response:
    """A model's metadata, or (`readiness`) whether it is ready: 400 where the tensor is no matrix qgemm multiplies."""
    try:
        _version(version)
        _, info = await _tensor(request, name)
    except MAPPED as exc:
        return _as_v2(exc)
    if not readiness:
        return _json(_metadata(name, info))
    if not info.matmul:
        return _error(400, f"{name} is not a matrix qgemm multiplies ({info.type_name} {list(info.shape)})")
    return _json({"name": name, "ready": True})


# each route with and without /versions/1 (the protocol's optional segment): one handler for both paths, the
# versioned path registered first (the inner decorator) so that `name:path` does not swallow it
@router.get("/models/{name:path}/ready")
@router.get("/models/{name:path}/versions/{version}/ready")
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    return await _model(request, name, version, readiness=True)


@router.post("/models/{name:path}/infer")
@router.post("/models/{name:path}/versions/{version}/infer")
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    return await _infer(request, name, version)


@router.get("/models/{name:path}")
@router.get("/models/{name:path}/versions/{version}")
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    return await _model(request, name, version, readiness=False)


# -- infer ----------------------------------------------------------------------------------------------------------
def _bad(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def _request(request: Request, body: bytes) -> tuple[dict[str, Any], bytes]:
    """The JSON inference header and the binary data after it."""
    header, binary = body, b""
    length = request.headers.get(HEADER_LENGTH)
    if length is not None:
        if not length.isdigit() or int(length) > len(body):
            raise _bad(f"Inference-Header-Content-Length {length!r} is not a length within the body's {len(body)}")
        header, binary = body[:int(length)], body[int(length):]
    limit = request.app.state.settings.max_json_body_bytes
    if len(header) > limit:
        raise _json_too_large(limit)
    try:
        req = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "bad_json", f"the inference request is not JSON: {exc}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise _bad("an inference request is an object with an `inputs` list")
    return req, binary


def _input(req: dict[str, Any], binary: bytes, k: int) -> np.ndarray:
    """The request's one input, `x`: FP32 [M, K], from `data` or from the binary section."""
    inputs = req["inputs"]
    if len(inputs) != 1 or not isinstance(inputs[0], dict) or inputs[0].get("name") != INPUT:
        raise _bad(f"this model takes one input, {INPUT!r} (FP32 [-1, {k}])")
    t = inputs[0]
    if t.get("datatype") != FP32:
        raise _bad(f"input {INPUT!r} is FP32, not {t.get('datatype')!r}")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(isinstance(v, int) and v >= 0 for v in shape):
        raise _bad(f"input {INPUT!r} has shape {shape!r}: a list of non-negative integers")
    count = int(np.prod(shape)) if shape else 1
    size = (t.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size != count * 4 or size != len(binary):
            raise _bad(f"input {INPUT!r}: binary_data_size {size!r} for shape {shape} (FP32: {count * 4} bytes; "
                       f"{len(binary)} after the header)")
        return np.frombuffer(binary, "<f4").reshape(shape)
    if "data" not in t:
        raise _bad(f"input {INPUT!r} has neither `data` nor binary_data_size")
    try:
        x = np.asarray(t["data"], dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise _bad(f"input {INPUT!r}: data that are not numbers ({exc})") from None
    if x.size != count:
        raise _bad(f"input {INPUT!r}: {x.size} values for shape {shape}")
    return x.reshape(shape)


def _binary_out(req: dict[str, Any]) -> bool:
    outputs = req.get("outputs")
    if outputs is None:
        return bool((req.get("parameters") or {}).get("binary_data_output", False))
    if not isinstance(outputs, list) or any(not isinstance(o, dict) or o.get("name") != OUTPUT for o in outputs):
        raise _bad(f"this model has one output, {OUTPUT!r}")
    return any((o.get("parameters") or {}).get("binary_data", False) for o in outputs)


def _options(params: Any) -> tuple[Any, Any]:
    """The request parameters that are the native route's: the kernel (checked) and the weight format."""
    if not isinstance(params, dict):
        raise _bad("`parameters` is an object")
    kernel = str(params.get("kernel", "auto"))
    kernel_obj = kernel if kernel == "auto" else KernelChooser.named(kernel)
    if not ("weight_format" in params or "blocksize" in params or "double_quant" in params):
        return kernel_obj, None
    try:
        blocksize = int(params.get("blocksize", DEFAULT_BLOCKSIZE))
    except (TypeError, ValueError):
        raise _bad(f"parameter blocksize {params.get('blocksize')!r} is not an integer") from None
    return kernel_obj, scheme_of(str(params.get("weight_format", "gguf")), blocksize,
                                 params.get("double_quant", False) is True)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    try:
        _version(version)
        model_id, tensor = _pair(name)
        body = await request.body()
        size = len(body)
        req, binary = _request(request, body)
        kernel_obj, scheme = _options(req.get("parameters") or {})
        binary_out = _binary_out(req)

        async def x_of(info: TensorInfo) -> np.ndarray:
            k = info.shape[1] if len(info.shape) == 2 else -1
            if size < INLINE_BYTES:
                return _input(req, binary, k)
            return await run_in_threadpool(_input, req, binary, k)  # JSON numbers into an array: milliseconds

        answer, _, _ = await multiply(request.app.state, model_id, tensor, kernel_obj, scheme, x_of)
    except MAPPED as exc:
        return _as_v2(exc)
    try:
        y = answer.output
        out: dict[str, Any] = {"name": OUTPUT, "datatype": FP32, "shape": list(y.shape)}
        if binary_out:
            data = np.ascontiguousarray(y, dtype="<f4").tobytes()
            out["parameters"] = {"binary_data_size": len(data)}
        else:
            out["data"] = y.reshape(-1)
    finally:
        if answer.release is not None and binary_out:
            answer.release()
    result = answer.result
    parameters: dict[str, Any] = {"kernel": answer.kernel.name, "backend": result.backend,
                                  "activation_format": result.activation_format, "devices": ",".join(answer.devices),
                                  "batch_requests": answer.batch["requests"], "batch_rows": answer.batch["rows"],
                                  "queue_ms": round(answer.queue_ms, 4)}
    parameters.update({f"{step}_ms": round(float(ms), 4) for step, ms in result.timing_ms.items()})
    body: dict[str, Any] = {"model_name": name, "model_version": VERSION, "parameters": parameters, "outputs": [out]}
    if "id" in req:
        body["id"] = req["id"]
    try:
        header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    finally:
        if answer.release is not None and not binary_out:
            answer.release()
    if not binary_out:
        return Response(header, media_type="application/json")
    return Response(header + data, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})
