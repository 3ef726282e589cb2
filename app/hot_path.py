"""POST /v1/matmul's short way in: straight to its handler, wrapped only in what every request gets (its metrics, the
body limit, the unhandled-error guard, the domain errors as JSON answers); every other request goes through the
app's whole middleware stack and router.

Why: at M = 1 a front spends more on the framework around the route than on the route (py-spy of a front under
64 clients, H100 host: Starlette's and FastAPI's middleware, exception wrappers and route matching took about half
of its samples).  The answers are the same (the API, bad-input and conformance tests run through this path).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import MAPPED, Unhandled, mapped_response
from app.limits import BodyLimit
from app.metrics import Metrics, RequestMetrics
from app.routes import matmul

PATH = "/v1/matmul"


async def _endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    try:
        response = await matmul.matmul(Request(scope, receive))
    except MAPPED as exc:
        response = mapped_response(exc)
    await response(scope, receive, send)


class HotPath:
    def __init__(self, app: ASGIApp, metrics: Metrics, limit: int):
        self.app = app
        self.matmul = RequestMetrics(BodyLimit(Unhandled(_endpoint), limit=limit), metrics=metrics,
                                     templates=lambda: [PATH])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == PATH and scope["method"] == "POST":
            await self.matmul(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def install(app: FastAPI, metrics: Metrics, limit: int) -> None:
    """HotPath outside the app's middleware stack (built at the first request, as Starlette builds it)."""
    build: Callable[[], ASGIApp] = app.build_middleware_stack
    app.build_middleware_stack = lambda: HotPath(build(), metrics, limit)  # type: ignore[method-assign]
