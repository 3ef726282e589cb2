"""Request guards that run before any route: the body-size limit and the API key."""

from __future__ import annotations

import hmac
import json

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, error_body


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413.

    With a Content-Length the refusal comes before a byte of the body is read.  Without one
    (chunked), the body is read up to the limit and refused as soon as it passes it.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, send: Send, status: int, code: str, message: str) -> None:
        body = json.dumps(error_body(code, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = f"request body is over the limit of {self.limit} bytes (QGEMM_MAX_BODY_BYTES)"
        if length is not None:
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                await self._refuse(send, 400, "bad_request", "Content-Length is not a non-negative integer")
                return
            if n > self.limit:
                await self._refuse(send, 413, "body_too_large", too_big)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send, 413, "body_too_large", too_big)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def same_origin(origin: str, request: Request) -> bool:
    """Whether `origin` (scheme://host[:port]) is this server as the request reached it (its Host header)."""
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()


async def require_api_key(request: Request) -> None:
    """Dependency of every /v1 route (async: a sync dependency costs a thread hop per request)."""
    check_api_key(request)


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def check_api_key(request: Request) -> None:
    """`Authorization: Bearer <QGEMM_API_KEY>` when a key is set.  Without a key, a request that changes something
    from a page of another site is refused (403): a browser names the page's origin, and a cross-site form or fetch
    would otherwise unload models or run products on a server of localhost."""
    key = request.app.state.settings.api_key
    if key is None:
        origin = request.headers.get("origin")
        if origin is not None and request.method not in SAFE_METHODS and not same_origin(origin, request):
            raise ApiError(403, "cross_origin", f"a {request.method} from the page of {origin!r} is refused: only "
                                                "this server's own pages, or clients that send no Origin, may change "
                                                "its state (or set QGEMM_API_KEY)")
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})
