"""/v1/models: list models, look inside them, load and unload their weights on the GPU."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.concurrency import run_in_threadpool

from app.errors import ApiError
from app.openapi import errors
from app.quant_report import METHOD, error_rows
from app.schemas import (
    LoadRequest,
    LoadResponse,
    ModelDetail,
    ModelId,
    ModelList,
    QuantizationReport,
    TensorDetail,
    TensorHistograms,
    TensorList,
    TensorName,
    UnloadRequest,
    UnloadResponse,
)
from app.tensors import scheme_of
from kernels.bnb4 import BLOCKSIZES
from kernels.formats import format_of
from models import inspect
from models.store import Model, NotFound, Unreadable

router = APIRouter(tags=["models"])

# OpenAPI links: how a client (or schemathesis' stateful phase) goes from one answer to the next call
_MODEL_ID = {"model_id": "$response.body#/models/0/id"}
MODEL_LINKS = {"GetModel": {"operationId": "get_model", "parameters": _MODEL_ID},
               "ListTensors": {"operationId": "list_tensors", "parameters": _MODEL_ID}}
TENSOR_LINKS = {"GetTensor": {"operationId": "get_tensor", "parameters": {
                    "model_id": "$request.path.model_id", "name": "$response.body#/tensors/0/name"}},
                "LoadTensor": {"operationId": "load_model", "parameters": {"model_id": "$request.path.model_id"},
                               "requestBody": {"tensors": ["$response.body#/tensors/0/name"]}}}
LOADED_LINKS = {"UnloadTensor": {"operationId": "unload_model", "parameters": {"model_id": "$request.path.model_id"},
                                 "requestBody": {"tensors": ["$response.body#/loaded/0/tensor"]}},
                "GetModelAfterLoad": {"operationId": "get_model", "parameters": {"model_id": "$request.path.model_id"}}}


def summary(model: Model) -> dict[str, Any]:
    return {"id": model.id, "file": model.path.name, "size_bytes": model.size_bytes, "status": model.status,
            "error": model.error, "architecture": model.architecture, "tensor_count": len(model.tensors)}


def _model(request: Request, model_id: str) -> Model:
    """The model as its file is now (sync routes run on a thread: a re-read there blocks nobody)."""
    try:
        return request.app.state.store.get(model_id)
    except NotFound as exc:
        raise ApiError(404, "model_not_found", str(exc)) from None


async def _model_now(request: Request, model_id: str) -> Model:
    """The same for async routes (the store's `current`: a re-read off the event loop)."""
    try:
        return await request.app.state.store.current(model_id)
    except NotFound as exc:
        raise ApiError(404, "model_not_found", str(exc)) from None


def _readable(model: Model) -> Model:
    if model.status != "ok":
        raise Unreadable(f"model {model.id!r} could not be read: {model.error}")
    return model


def _ok_model(request: Request, model_id: str) -> Model:
    return _readable(_model(request, model_id))


@router.get("/models", response_model=ModelList, operation_id="list_models",
            responses={200: {"links": MODEL_LINKS}})
def list_models(request: Request) -> dict[str, Any]:
    return {"models": [summary(m) for m in request.app.state.store.scan()]}


@router.get("/models/{model_id}", response_model=ModelDetail, operation_id="get_model", responses=errors(404))
async def get_model(request: Request, model_id: ModelId) -> dict[str, Any]:
    model = await _model_now(request, model_id)
    ok = model.status == "ok"
    return {**summary(model),
            "header": inspect.header(model) if ok else None,
            "metadata": inspect.metadata(model) if ok else {},
            "tensor_types": inspect.types_summary(model),
            "parameter_count": sum(t.n_elements for t in model.tensors.values()),
            "tensor_bytes": sum(t.n_bytes for t in model.tensors.values()),
            "quant_mix": inspect.quant_mix(model) if ok else None,
            "resident": await request.app.state.service.residency(model)}


@router.get("/models/{model_id}/tensors", response_model=TensorList, operation_id="list_tensors",
            responses={200: {"links": TENSOR_LINKS}, **errors(404, 409)})
def list_tensors(request: Request, model_id: ModelId) -> dict[str, Any]:
    model = _ok_model(request, model_id)
    return {"tensors": [inspect.tensor_row(t) for t in model.tensors.values()]}


@router.get("/models/{model_id}/tensors/{name}", response_model=TensorDetail, operation_id="get_tensor",
            responses=errors(404, 409))
def get_tensor(request: Request, model_id: ModelId, name: TensorName) -> dict[str, Any]:
    model, info = _tensor(request, model_id, name)
    stats, stats_error = None, None
    try:
        stats = _stats(request, model, name)
    except (NotImplementedError, ValueError) as exc:  # a type gguf cannot dequantize
        stats_error = f"{type(exc).__name__}: {exc}"
    fmt = format_of(info.type_name)
    return {**inspect.tensor_row(info), "model": model.id, "n_elements": info.n_elements,
            "block_format": fmt.layout if fmt else None, "matmul_reason": info.matmul_reason,
            "stats": stats, "stats_error": stats_error}


def _tensor(request: Request, model_id: str, name: str) -> tuple[Model, Any]:
    model = _ok_model(request, model_id)
    info = model.tensors.get(name)
    if info is None:
        raise ApiError(404, "tensor_not_found", f"tensor {name!r} not found in model {model_id!r}")
    return model, info


def _stats(request: Request, model: Model, name: str) -> dict[str, Any]:
    """The tensor's statistics, computed once per file version (bounded cache of 64 tensors)."""
    cache, key = request.app.state.stats_cache, (model.version_key, name)
    stats = cache.get(key)
    if stats is None:
        stats = inspect.tensor_stats(model.tensors[name], model.raw(name))
        cache.put(key, stats, 1)
    return stats


@router.get("/models/{model_id}/tensors/{name}/histogram", response_model=TensorHistograms,
            operation_id="tensor_histogram", responses=errors(404, 409, 422))
def tensor_histogram(request: Request, model_id: ModelId, name: TensorName,
                     bins: int = Query(48, ge=4, le=256, description="bins of each histogram")) -> dict[str, Any]:
    model, info = _tensor(request, model_id, name)
    cache, key = request.app.state.stats_cache, (model.version_key, name, "histogram", bins)
    hist = cache.get(key)
    if hist is None:
        try:
            stats = _stats(request, model, name)
            hist = inspect.tensor_histograms(info, model.raw(name), stats["min"], stats["max"], bins)
        except (NotImplementedError, ValueError) as exc:
            raise ApiError(422, "not_dequantizable", f"{info.type_name} values cannot be decoded here: {exc}") from exc
        cache.put(key, hist, 1)
    return {"model": model.id, "tensor": name, "type": info.type_name, **hist}


MAX_COMPARE_M = 4  # batch sizes one report times


@router.get("/models/{model_id}/tensors/{name}/quantization", response_model=QuantizationReport,
            operation_id="tensor_quantization", responses=errors(404, 409, 422))
async def tensor_quantization(
        request: Request, model_id: ModelId, name: TensorName,
        m: list[int] = Query([1], description=f"GPU: the batch sizes to time each scheme's product at (at most "
                                              f"{MAX_COMPARE_M}, each at most QGEMM_MAX_ROWS)",
                             json_schema_extra={"items": {"type": "integer", "minimum": 1, "maximum": 8192},
                                                "minItems": 1, "maxItems": MAX_COMPARE_M}),
        blocksize: int = Query(64, description="nf4/fp4: values per absmax",
                               json_schema_extra={"enum": list(BLOCKSIZES)}),
        double_quant: bool = Query(False, description="nf4/fp4: 8-bit absmax values")) -> dict[str, Any]:
    """What each scheme does to this tensor: its values (the file's, dequantized: the reference) requantized to
    Q4_0, Q4_1, Q5_0, Q8_0 (gguf's quantizer) and bitsandbytes' NF4 and FP4; each one's NMSE, largest error and
    bits per weight, and on a GPU the time of its product at each M."""
    model = _readable(await _model_now(request, model_id))
    info = model.tensors.get(name)
    if info is None:
        raise ApiError(404, "tensor_not_found", f"tensor {name!r} not found in model {model_id!r}")
    settings, service = request.app.state.settings, request.app.state.service
    if info.n_elements > settings.quant_compare_max_values:
        raise ApiError(422, "tensor_too_large", f"{name} has {info.n_elements} values; comparisons take tensors of "
                                                f"at most {settings.quant_compare_max_values} "
                                                "(QGEMM_QUANT_COMPARE_MAX_VALUES)")
    scheme_of("nf4", blocksize, double_quant)  # a 422 for a blocksize bitsandbytes has not
    if not m or len(m) > MAX_COMPARE_M or any(r < 1 or r > settings.max_rows for r in m):
        raise ApiError(422, "bad_m", f"m takes 1 to {MAX_COMPARE_M} batch sizes, each 1..{settings.max_rows}")
    cache = request.app.state.stats_cache
    key = (model.version_key, name, "quantization", blocksize, double_quant)
    cached = cache.get(key)
    if cached is None:
        cached = await run_in_threadpool(error_rows, model, info, blocksize, double_quant)
        cache.put(key, cached, 1)
    rows = [dict(r) for r in cached[0]]
    device, timed = await service.quant_times(model, info, rows, cached[1], sorted(set(m)))
    return {"model": model.id, "tensor": name, "type": info.type_name, "shape": list(info.shape),
            "reference": f"the tensor's own values: gguf's dequantization of its {info.type_name} bytes",
            "device": device, "method": METHOD if timed else None, "schemes": rows}


@router.post("/models/{model_id}/load", response_model=LoadResponse, operation_id="load_model",
             responses={200: {"links": LOADED_LINKS}, **errors(404, 409, 422, 503)})
async def load_model(request: Request, model_id: ModelId,
                     body: LoadRequest | None = Body(None, description="optional: all matmul tensors when absent or "
                                                                       "null")) -> dict[str, Any]:
    """Upload a model's matmul tensors (or the named ones) to the GPU, ahead of the first request: where
    `devices` and `placement` say (a copy on each device, or one copy split by rows across them), else each
    on the device with the most free budget (split across all when none holds it)."""
    model = _readable(await _model_now(request, model_id))
    names = body.tensors if body and body.tensors else [t.name for t in model.tensors.values() if t.matmul]
    infos = []
    for n in names:
        info = model.tensors.get(n)
        if info is None:
            raise ApiError(404, "tensor_not_found", f"tensor {n!r} not found in model {model_id!r}")
        infos.append(info)  # one that cannot be multiplied: a 422 from the engine, before anything loads
    scheme = scheme_of(body.weight_format, body.blocksize, body.double_quant) if body else None
    done = await request.app.state.service.load(model, infos, body.kernel if body else None, scheme,
                                                body.devices if body else None, body.placement if body else None)
    return {"model": model.id, **done}


@router.post("/models/{model_id}/unload", response_model=UnloadResponse, operation_id="unload_model",
             responses=errors(404))
async def unload_model(request: Request, model_id: ModelId,
                       body: UnloadRequest | None = Body(None, description="optional: all of the model's tensors "
                                                                           "when absent or null")) -> dict[str, Any]:
    """Free a model's weights (or the named tensors') from every device, and forget where they were placed."""
    model = await _model_now(request, model_id)
    names = set(body.tensors) if body and body.tensors else None
    return {"model": model.id, **await request.app.state.service.unload(model, names)}
