"""The OpenAPI document: every status a route can answer, with the one error model.

Routes declare the statuses their own logic answers (`errors(404, 422)`); the statuses that the
request guards answer on every route (400 for a malformed Content-Length or request, 413 for a body
over the limit, 401 when an API key is set, 500 with a request id for a fault of the server's own)
are added here, once, with the bearer security scheme.
FastAPI's default 422 (its HTTPValidationError model) is removed: validation errors answer 400 with
`ErrorResponse` (app/errors.py), so that entry would describe a body the server never sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.schemas import ErrorResponse, MatmulResponse

WHY = {
    400: "Malformed request: a body or parameter that is not what the schema says (`bad_request`, `bad_json`, "
         "`bad_npy`), or a Content-Length that is not a non-negative integer.",
    401: "Missing or wrong API key (`unauthorized`): send `Authorization: Bearer <QGEMM_API_KEY>`.",
    404: "No such model or tensor (`model_not_found`, `tensor_not_found`, `not_found`).",
    409: "The request is well formed but the server's state refuses it (`no_gpu`: nothing to load on the CPU "
         "backend; `model_unreadable`: the model's file cannot be read; `model_changed`: the file changed while it "
         "was read, retry).",
    413: "The body is over QGEMM_MAX_BODY_BYTES (`body_too_large`).",
    415: "Content-Type is neither application/json nor application/x-npy (`unsupported_media_type`).",
    403: "Refused from a page of another site (`cross_origin`): without QGEMM_API_KEY a request that changes "
         "something is taken only from this server's own pages or from clients that send no Origin header.",
    422: "Well formed, but it cannot be computed with this tensor on this server: shape (`bad_shape`, "
         "`k_mismatch`, `too_many_rows`), values (`non_finite`, `activation_out_of_range`, `product_out_of_range`), "
         "`bad_dtype`, `unsupported_tensor`, `unknown_kernel`, `kernel_cannot_run`, `bad_weight_format`, "
         "`tensor_too_large`, `not_dequantizable`, `too_large_for_shared_memory` (X and Y of one request over what a "
         "front of `qgemm serve` may hold, QGEMM_FRONT_INFLIGHT_BYTES).",
    500: "A fault of the server's own (`internal`), never an answer to what the client sent: the error carries a "
         "`request_id` under which the server logged it, and the connection stays usable.",
    503: "The GPU is out of memory for these weights (`gpu_out_of_memory`); retry after the Retry-After seconds.",
    504: "The product took longer than QGEMM_PRODUCT_DEADLINE_S (`product_timeout`).",
}
GUARDS = (400, 413, 500)  # BodyLimit, request validation and errors.Unhandled, on every route
ERROR_REF = "#/components/schemas/ErrorResponse"


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the statuses a route's own logic answers."""
    return {s: {"model": ErrorResponse, "description": WHY[s]} for s in statuses}


def error_entry(status: int) -> dict[str, Any]:
    """A status's entry as the document states it (for operations written out by hand: POST /v1/matmul)."""
    return {"description": WHY[status], "content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}


def _is_fastapi_validation(entry: dict[str, Any]) -> bool:
    schema = entry.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref", "").endswith("/HTTPValidationError")


def _add_matmul(doc: dict[str, Any], operation: dict[str, Any]) -> None:
    """POST /v1/matmul, a plain route (app/routes/matmul.py says why), and the response model it refers to."""
    paths = doc.setdefault("paths", {})
    paths["/v1/matmul"] = {"post": operation}
    schema = MatmulResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(schema.pop("$defs", {}))
    schemas["MatmulResponse"] = schema
    doc["components"]["schemas"] = dict(sorted(schemas.items()))


def install(app: FastAPI, api_key_set: bool, matmul_operation: Callable[[], dict[str, Any]]) -> None:
    """`matmul_operation()`: POST /v1/matmul's entry (app/routes/matmul.py writes it; the route module uses this
    one's error entries, so it is handed in rather than imported)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _add_matmul(doc, matmul_operation())
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                if "422" in responses and _is_fastapi_validation(responses["422"]):
                    del responses["422"]
                unsafe = method.upper() not in ("GET", "HEAD", "OPTIONS")
                statuses = GUARDS + ((401,) if api_key_set and path.startswith("/v1/") else ()) + \
                    ((403,) if not api_key_set and path.startswith("/v1/") and unsafe else ())
                for status in statuses:
                    responses.setdefault(str(status), error_entry(status))
                if api_key_set and path.startswith("/v1/"):
                    op["security"] = [{"bearer": []}]
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if api_key_set:
            doc["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "QGEMM_API_KEY"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
