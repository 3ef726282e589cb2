"""POST /v1/matmul: JSON or .npy in, JSON or .npy out, timing in the body and in Server-Timing."""

from __future__ import annotations

import asyncio
import io
import math
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
import orjson
from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from numpy.lib import format as npformat
from pydantic import ValidationError

from app.checks import check_request
from app.edge import body_of
from app.errors import ApiError
from app.limits import check_api_key
from app.openapi import error_entry
from app.scheduler import Answer
from app.schemas import (
    DEMO_K,
    DEMO_MODEL,
    DEMO_TENSOR,
    KERNEL_NAMES,
    WEIGHT_FORMAT_DOC,
    MatmulRequest,
)
from app.tensors import scheme_of
from kernels.bnb4 import BLOCKSIZES, DEFAULT_BLOCKSIZE
from kernels.kernel import Kernel
from kernels.requant import WEIGHT_FORMATS, Scheme
from kernels.select import KernelChooser
from models.store import FileChanged, Model, ModelStore, NotFound, TensorInfo

NPY = "application/x-npy"
OCTETS = "application/octet-stream"  # the same .npy bytes: generated clients send a file so
JSON = "application/json"
INLINE_BYTES = 1 << 18  # JSON bodies up to this size are parsed on the event loop (a thread hop costs more)
SEND_IN_PLACE_BYTES = 1 << 20  # .npy answers this large are sent from the output's own memory, not copied into a body


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


def _json_too_large(limit: int) -> ApiError:
    """JSON activations take ~40x their text in memory while parsed: beyond the limit, the .npy form carries them."""
    return ApiError(413, "body_too_large", f"a JSON body is limited to {limit} bytes (QGEMM_MAX_JSON_BODY_BYTES: "
                                           "parsing JSON numbers takes tens of times their size); send X as .npy "
                                           f"(Content-Type: {NPY}) for larger products")


def rows_to_array(rows: list[list[float]]) -> np.ndarray:
    """The JSON rows as X; checked after the tensor is found, so that an unknown tensor is a 404 first."""
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise ApiError(422, "bad_shape", f"activations rows have different lengths ({sorted(widths)[:5]}): "
                                         "X must be a rectangular [M, K] array")
    return np.array(rows, dtype=np.float64)


KEPT_BYTES = 1024  # the parse caches below keep only keys this short: 4,096 of them stay within 4 MiB
NPY_HEADERS_READ: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}


def _npy_header_of(body: bytes | memoryview) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, data offset) by numpy's own header reader, cached by the header's
    bytes: the reader parses the header dict with ast.literal_eval, which compiles it (~60 µs a request)."""
    v2 = body[6:7] in (b"\x02", b"\x03")
    size = (10 + int.from_bytes(body[8:10], "little")) if not v2 else (12 + int.from_bytes(body[8:12], "little"))
    raw = bytes(body[:size])
    hit = NPY_HEADERS_READ.get(raw)
    if hit is not None:
        return hit
    f = io.BytesIO(raw)
    try:
        version = npformat.read_magic(f)
        read_header = npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except Exception as exc:  # truncated or garbage headers raise several kinds
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: {type(exc).__name__}: {exc}") from None
    parsed = (shape, fortran, dtype, f.tell())
    if f.tell() == size and size <= KEPT_BYTES and len(NPY_HEADERS_READ) < 4096:
        NPY_HEADERS_READ[raw] = parsed
    return parsed


def parse_npy(body: bytes | memoryview) -> np.ndarray:
    """The .npy body as an array over the body's own bytes (numpy's header reader, no copy, no pickles)."""
    shape, fortran, dtype, offset = _npy_header_of(body)
    if dtype.hasobject:
        raise ApiError(400, "bad_npy", "body is not a readable .npy array: object arrays (pickles) are refused")
    if dtype.kind != "f" or dtype.itemsize not in (4, 8):
        raise ApiError(422, "bad_dtype", f".npy activations must be float32 or float64, not {dtype}")
    if any(d < 0 for d in shape):  # numpy's reader passes them, and frombuffer reads count -1 as "all of it"
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: negative dimension in {list(shape)}")
    count = math.prod(shape)  # Python's ints: numpy's product wraps past 2^63 and would pass the check below
    if len(body) - offset < count * dtype.itemsize:
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: {shape} {dtype} needs "
                                       f"{count * dtype.itemsize} bytes of data, the body has {len(body) - offset}")
    if len(shape) != 2:
        raise ApiError(422, "bad_shape", f"activations must be a 2-D [M, K] array; got {len(shape)}-D {list(shape)}")
    try:
        return np.frombuffer(body, dtype, count, offset).reshape(shape, order="F" if fortran else "C")
    except ValueError as exc:  # dims numpy cannot hold even with no data, e.g. [2^62, 0]
        raise ApiError(400, "bad_npy", f"body is not a readable .npy array: {exc}") from None


def server_timing(timing: dict[str, float]) -> str:
    return ", ".join(f"{k};dur={v:.3f}" for k, v in timing.items())


MATMUL_HEADERS = {
    "Server-Timing": "the timing_ms entries (upload, quantize, gemm, download, total, queue, request) in ms, "
                     "and the batch",
    "X-Qgemm-Kernel": "the kernel that ran (auto resolved)",
    "X-Qgemm-Backend": "cpu or cuda",
    "X-Qgemm-Activation-Format": "the activation format the kernel computes with",
    "X-Qgemm-Shape": "M,N of the output",
    "X-Qgemm-Batch": "requests,rows of the batched product this request ran in (1,M when alone)",
}
REQUEST_BODY = {
    "required": True,
    "description": "JSON: a MatmulRequest. Or `application/x-npy`: a NumPy .npy file (float32 or float64, 2-D [M, K], "
                   "no pickles) with `model`, `tensor` and `kernel` as query parameters, e.g. "
                   f"`curl --data-binary @x.npy -H 'Content-Type: {NPY}' "
                   f"'.../v1/matmul?model={DEMO_MODEL}&tensor={DEMO_TENSOR}'`. `{OCTETS}` takes the same .npy bytes "
                   "(what generated clients send as a file).",
    "content": {JSON: {"schema": MatmulRequest.model_json_schema()},
                **{media: {"schema": {"type": "string", "format": "binary",
                                      "description": f"a .npy file holding X [M, K] (K = {DEMO_K} for {DEMO_TENSOR})"}}
                   for media in (NPY, OCTETS)}},
}


def _param(name: str, schema: dict, description: str, default: object = None, **extra: object) -> dict:
    """A query parameter as the OpenAPI document states it (the handler reads it from the query string)."""
    title = name.replace("_", " ").title()
    schema = {**schema, "description": description, **({"default": default} if default is not None else {}),
              **extra, "title": title}
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_OPTIONAL_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
QUERY = [  # the query parameters of a .npy body, as `matmul` reads them
    _param("model", _OPTIONAL_STRING, "required with a .npy body: the model id (ignored for JSON bodies)",
           examples=[DEMO_MODEL]),
    _param("tensor", _OPTIONAL_STRING, "required with a .npy body: the tensor name (ignored for JSON bodies)",
           examples=[DEMO_TENSOR]),
    _param("kernel", {"type": "string"}, ".npy bodies: the kernel (ignored for JSON bodies)", enum=KERNEL_NAMES,
           default="auto"),
    _param("weight_format", {"enum": list(WEIGHT_FORMATS), "type": "string"}, ".npy bodies: " + WEIGHT_FORMAT_DOC,
           default="gguf"),
    _param("blocksize", {"type": "integer"}, ".npy bodies, nf4/fp4: values per absmax", enum=list(BLOCKSIZES),
           default=DEFAULT_BLOCKSIZE),
    _param("double_quant", {"type": "boolean"}, ".npy bodies, nf4/fp4: 8-bit absmax values", default=False),
]


def operation() -> dict:
    """POST /v1/matmul in the OpenAPI document (app/openapi.py adds it: the handler is a plain route)."""
    return {
        "tags": ["matmul"], "summary": "Matmul", "operationId": "matmul",
        "description": "Y[M, N] = X[M, K] · W[N, K]ᵀ with W a model's tensor (as stored, or requantized: "
                       "`weight_format`).\nJSON body, or a .npy body with the model, tensor and kernel as query "
                       "parameters; `Accept:\napplication/x-npy` answers .npy.",
        "parameters": QUERY,
        "requestBody": REQUEST_BODY,
        "responses": {
            "200": {"description": "Y [M, N]: JSON (MatmulResponse), or a float32 .npy with `Accept: "
                                   f"{NPY}` (the timing then in Server-Timing and the other values in X-Qgemm-*)",
                    "content": {JSON: {"schema": {"$ref": "#/components/schemas/MatmulResponse"}},
                                NPY: {"schema": {"type": "string", "format": "binary"}}},
                    "headers": {h: {"description": d, "schema": {"type": "string"}}
                                for h, d in MATMUL_HEADERS.items()}},
            **{str(status): error_entry(status) for status in (404, 409, 415, 422, 503, 504)}},
    }


async def matmul(request: Request) -> Response:
    """POST /v1/matmul: Y[M, N] = X[M, K] · W[N, K]ᵀ.  A plain Starlette route (app.main), documented by
    `operation()`: FastAPI's per-request parameter and dependency solving cost more than the product itself at
    M = 1 (profiled: docs/serving.md), so the query parameters are read here, as strings."""
    check_api_key(request)
    model, tensor, kernel, requant = _query(request.scope["query_string"])
    return await handle(request, model, tensor, kernel, requant)


Query = tuple[str | None, str | None, str, tuple[str, int, bool] | None]  # model, tensor, kernel, requantization
QUERIES_READ: dict[bytes, Query] = {}  # a client sends the same query string again and again: parsed once


def _query(raw: bytes) -> Query:
    """The query parameters `matmul` reads, as Starlette reads them (the last of a repeated name wins)."""
    hit = QUERIES_READ.get(raw)
    if hit is not None:
        return hit
    q = dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True))
    requant = None
    if "weight_format" in q or "blocksize" in q or "double_quant" in q:
        try:
            requant = (q.get("weight_format", "gguf"), int(q.get("blocksize", DEFAULT_BLOCKSIZE)),
                       {"true": True, "false": False}[q.get("double_quant", "false").lower()])
        except (ValueError, KeyError):
            raise ApiError(422, "bad_weight_format", "blocksize must be an integer and double_quant true or "
                                                     "false") from None
    parsed = q.get("model"), q.get("tensor"), q.get("kernel", "auto"), requant
    if len(raw) <= KEPT_BYTES:  # a long query string is parsed every time: kept ones stay small
        if len(QUERIES_READ) >= 4096:
            QUERIES_READ.clear()
        QUERIES_READ[raw] = parsed
    return parsed


async def handle(request: Request, model: str | None, tensor: str | None, kernel: str,
                 requant: tuple[str, int, bool] | None = None) -> Response:
    t_request = time.perf_counter()
    if kernel != "auto":  # checked wherever it appears, although a JSON body names its own kernel
        kernel_obj = KernelChooser.named(kernel)
    ctype = _media(request.headers.get("content-type"))
    if ctype == OCTETS:
        ctype = NPY
    if ctype not in (JSON, NPY):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Type must be {JSON} or {NPY} ({OCTETS}), not {ctype or 'missing'}")
    limit = request.app.state.settings.max_json_body_bytes
    if ctype == JSON and int(request.headers.get("content-length") or 0) > limit:
        raise _json_too_large(limit)
    body = await body_of(request)
    if ctype == JSON:
        if len(body) > limit:  # chunked: known once read
            raise _json_too_large(limit)
        if isinstance(body, memoryview):  # read in place (app/edge.py): pydantic reads bytes
            body = bytes(body)
        req = parse_json(body) if len(body) <= INLINE_BYTES else await run_in_threadpool(parse_json, body)
        model_id, tensor_name = req.model, req.tensor
        kernel_obj = req.kernel if req.kernel == "auto" else KernelChooser.named(req.kernel)
        requant = (req.weight_format, req.blocksize, req.double_quant)
    else:
        if not model or not tensor:
            raise ApiError(400, "bad_request", ".npy bodies need the model and tensor as query parameters "
                                               "(?model=...&tensor=...)")
        model_id, tensor_name = model, tensor
        kernel_obj = kernel if kernel == "auto" else kernel_obj
    scheme = scheme_of(*requant) if requant else None

    async def x_of(_: TensorInfo) -> np.ndarray:
        if ctype == NPY:
            return parse_npy(body)
        return rows_to_array(req.activations) if len(body) <= INLINE_BYTES \
            else await run_in_threadpool(rows_to_array, req.activations)

    answer, mdl, info = await multiply(request.app.state, model_id, tensor_name, kernel_obj, scheme, x_of)
    sent_in_place = False
    try:
        response = _respond(request, answer, mdl, info, scheme, t_request)
        sent_in_place = isinstance(response, NpyInPlace)  # it releases the output's memory once sent
        return response
    finally:
        if answer.release is not None and not sent_in_place:
            answer.release()


async def multiply(state: Any, model_id: str, tensor_name: str, kernel: str | Kernel, scheme: Scheme | None,
                   x_of: Callable[[TensorInfo], Awaitable[np.ndarray]]) -> tuple[Answer, Model, TensorInfo]:
    """A product request's one path, whichever protocol brought it (this route, the Open Inference Protocol's
    infer): the tensor as its file is now (404), X (`x_of(tensor)`, parsed once the tensor is known), the checks
    (app/checks.py), the product within its deadline; a file that changes under it is read again and the product
    run again once."""
    x = None
    for attempt in (0, 1):
        try:  # the tensor as its file is now (a re-read, seconds for a large header, off the event loop)
            mdl, info = ModelStore.tensor_of(await state.store.current(model_id), tensor_name)
        except NotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        if x is None:
            x = await x_of(info)
        checked = check_request(await state.service.chooser(), info, scheme, x.shape, kernel, state.settings.max_rows)
        try:
            return await _within_deadline(state.service.matmul(mdl, checked, x), state.settings.product_deadline_s), \
                mdl, info
        except FileChanged:
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _within_deadline(product: Awaitable[Answer], seconds: float) -> Answer:
    """The product, or 504 after `seconds` (the engine may still finish it: its memory is let go once it does).
    One timer that cancels this task, not asyncio.wait_for: its Timeout object cost a front 5-8 µs a request."""
    loop = asyncio.get_running_loop()  # once: on Python 3.11 each lookup of the running loop is a getpid() call
    task = asyncio.current_task(loop)
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = loop.call_later(seconds, expire)
    try:
        return await product
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:  # our cancel alone, not the client's going or a shutdown
            raise ApiError(504, "product_timeout", f"the product took longer than {seconds:g} s "
                                                   "(QGEMM_PRODUCT_DEADLINE_S)") from None
        raise
    finally:
        timer.cancel()


def _respond(request: Request, answer: Answer, mdl: Model, info: TensorInfo, scheme: Scheme | None,
             t_request: float) -> Response:
    result, y = answer.result, answer.output
    batch = answer.batch
    kernel = answer.kernel.name
    headers = [(b"x-qgemm-kernel", kernel.encode()), (b"x-qgemm-backend", result.backend.encode()),
               (b"x-qgemm-activation-format", result.activation_format.encode()),
               (b"x-qgemm-shape", b"%d,%d" % y.shape),
               (b"x-qgemm-batch", b"%d,%d" % (batch["requests"], batch["rows"])),
               (b"x-qgemm-devices", ",".join(answer.devices).encode())]
    npy_out = NPY in (request.headers.get("accept") or "").lower()
    if npy_out and y.nbytes >= SEND_IN_PLACE_BYTES:
        content = None
    elif npy_out:
        header = NPY_HEADERS.get(y.shape) or _npy_header(y.shape)
        buf = bytearray(len(header) + y.size * 4)  # header and data written once, sent as they are
        buf[:len(header)] = header
        np.frombuffer(buf, np.float32, y.size, len(header)).reshape(y.shape)[...] = y
        content, media = memoryview(buf), NPY_BYTES
    else:
        timing = {k: round(float(v), 4) for k, v in result.timing_ms.items()}
        timing["queue"] = round(answer.queue_ms, 4)
        content, media = orjson.dumps({
            "output": y, "shape": list(y.shape), "model": mdl.id, "tensor": info.name, "kernel": kernel,
            "weight_format": scheme.tag if scheme else "gguf",
            "activation_format": result.activation_format, "backend": result.backend, "timing_ms": timing,
            "batch": batch, "devices": answer.devices}, option=orjson.OPT_SERIALIZE_NUMPY), JSON_BYTES
    request_ms = (time.perf_counter() - t_request) * 1e3
    headers.append((b"server-timing", (f"{server_timing(result.timing_ms)}, queue;dur={answer.queue_ms:.3f}, "
                                       f"request;dur={request_ms:.3f}, batch;desc=\"{batch['requests']} requests, "
                                       f"{batch['rows']} rows\"").encode()))
    if content is None:  # sent from the output's own memory: released once sent
        return NpyInPlace(y, headers, answer.release)
    headers += [(b"content-length", b"%d" % len(content)), (b"content-type", media)]
    return Prepared(content, headers)


NPY_BYTES, JSON_BYTES = NPY.encode(), JSON.encode()


class Prepared(Response):
    """An answer whose headers are made as bytes by its route (Starlette's Response encodes a dict of them again
    for every answer: the product route's dozen headers cost a front microseconds a request)."""

    def __init__(self, content: bytes | memoryview, raw_headers: list[tuple[bytes, bytes]], status: int = 200):
        self.status_code, self.body, self.background = status, content, None
        self.raw_headers = raw_headers


class NpyInPlace(Response):
    """A large .npy answer sent as two body messages, its header and then the array's own bytes: tens of MB of
    output (pinned memory the GPU wrote, or the front's shared memory) are not copied into one body first (15 ms at
    58 MB).  `send` returns once the transport has the bytes, not once they are on the wire: a client that reads
    slowly leaves the rest queued in uvloop, which still points into that memory.  So the memory is released when
    the last reference to the buffer goes (weakref.finalize on a view made for this answer), not after `send`."""

    media_type = NPY

    def __init__(self, y: np.ndarray, headers: list[tuple[bytes, bytes]], release: Callable[[], None] | None = None):
        self.header = NPY_HEADERS.get(y.shape) or _npy_header(y.shape)
        owner = np.ascontiguousarray(y, np.float32).view()  # this answer's own view: its end is the buffer's end
        if release is not None:
            weakref.finalize(owner, release)
        self.data: memoryview | None = memoryview(owner).cast("B")
        self.status_code, self.background = 200, None
        self.raw_headers = [*headers, (b"content-length", b"%d" % (len(self.header) + self.data.nbytes)),
                            (b"content-type", NPY_BYTES)]

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        data, self.data = self.data, None  # the transport's queue holds the only reference once sent
        assert data is not None, "an answer is sent once"
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.header, "more_body": True})
        await send({"type": "http.response.body", "body": data})


NPY_HEADERS: dict[tuple[int, ...], bytes] = {}


def _npy_header(shape: tuple[int, ...]) -> bytes:
    """The .npy header of a C-order float32 array of this shape (what np.save writes), cached per shape."""
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    if len(NPY_HEADERS) < 4096:
        NPY_HEADERS[shape] = buf.getvalue()
    return buf.getvalue()
