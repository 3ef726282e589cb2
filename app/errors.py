"""One error shape for every failure: {"error": {"code", "message"}} with the right status, and the
guard that turns an exception nothing else handled into such an answer without losing the connection."""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kernels.errors import Conflict, DeviceOutOfMemory, InvalidRequest, Overloaded, QgemmError
from models.store import FileChanged, NotFound, Unreadable

log = logging.getLogger("qgemm")


class ApiError(Exception):
    """An HTTP answer a route gives about the request itself (its body, headers, parameters)."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_body(code: str, message: str, request_id: str | None = None) -> dict:
    detail = {"code": code, "message": message}
    if request_id is not None:
        detail["request_id"] = request_id
    return {"error": detail}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


# the domain's errors (kernels/errors.py) as HTTP: the one place that maps them
DOMAIN_STATUS: dict[type[QgemmError], int] = {InvalidRequest: 422, Conflict: 409, DeviceOutOfMemory: 503,
                                              Overloaded: 503}
RETRY_AFTER = {503: "1"}  # seconds: a GPU out of memory (or a full queue) may have room once products in flight end

def status_of(exc: QgemmError) -> int:
    """The HTTP status of a domain error."""
    return next((s for cls, s in DOMAIN_STATUS.items() if isinstance(exc, cls)), 500)


def as_http(exc: BaseException) -> tuple[int, str, str, dict[str, str] | None] | None:
    """(status, code, message, headers) of an error the service answers with, or None for a fault of its own;
    the handlers below and the engine process (its answers to the fronts) both say it this way."""
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.message, exc.headers
    if isinstance(exc, QgemmError):
        status = status_of(exc)
        retry = RETRY_AFTER.get(status)
        return status, exc.code, exc.message, {"Retry-After": retry} if retry else None
    if isinstance(exc, FileChanged):
        return 409, "model_changed", f"{exc}; the server reads it again: retry the request", None
    if isinstance(exc, Unreadable):
        return 409, "model_unreadable", str(exc), None
    if isinstance(exc, NotFound):
        return 404, "not_found", str(exc), None
    return None


MAPPED = (ApiError, QgemmError, FileChanged, NotFound, Unreadable)  # the errors answered as themselves (as_http)


def mapped_response(exc: Exception) -> JSONResponse:
    return error_response(*as_http(exc))  # type: ignore[misc]


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 415: "unsupported_media_type", 422: "unprocessable", 503: "unavailable"}


def install(app: FastAPI) -> None:
    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        return mapped_response(exc)

    for kind in MAPPED:
        app.add_exception_handler(kind, _mapped)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
        return error_response(400, "bad_request", "; ".join(parts) or "invalid request")


def request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it sent a sane one (so that its logs and ours meet), else a new one."""
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id" and 0 < len(value) <= 128 and value.isascii() and value.decode().isprintable():
            return value.decode()
    return uuid.uuid4().hex


class Unhandled:
    """ASGI middleware: an exception that no handler turned into an answer becomes a JSON 500 with a
    request id, logged with its traceback under the same id, and the call returns normally.

    Starlette's own last resort (ServerErrorMiddleware) answers and then re-raises, and uvicorn closes
    a connection whose application raised: the client's next request on it was reset.  Returning here
    keeps the connection usable.  When half an answer is already out, closing is the only honest end,
    so the exception goes on.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # the client went away mid-request: nobody to answer, nothing went wrong here
            scope.setdefault("state", {})["client_gone"] = True
        except Exception as exc:
            rid = request_id(scope)
            log.error("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"), rid,
                      exc_info=exc)
            if started:
                raise
            body = json.dumps(error_body("internal", f"internal error ({type(exc).__name__}); quote request id "
                                                     f"{rid} when reporting it", rid)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"x-request-id", rid.encode())]})
            await send({"type": "http.response.body", "body": body})
