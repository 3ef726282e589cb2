"""The HTTP connection's bounds, before any request reaches the app: uvicorn's httptools protocol with a cap on a
request's head (request line and headers: 431 past `max_request_head_bytes`) and a deadline on reading it and its
body (408 when a connection sends nothing for `request_read_timeout_s`: a partial request line, unfinished headers,
a promised body that does not come, a connection that never sends a byte), and a cap on open connections (past
`max_connections` a new one is answered 503 with Retry-After and closed, before it can take the process's last file
descriptors).  uvicorn has neither bound for httptools: a 128 MB header froze a front for 20 s, and connections that
never finish a request stayed open until the front ran out of file descriptors (uvicorn's own cap,
limit_concurrency, answers text and counts requests too).  Once a request is whole, no deadline runs: a long product
is the app's to time.

A large body for `POST /v1/matmul` (1 MiB and more, within the body limit) is read in place: each piece the socket
brings is written once into a buffer of the declared length, and the app takes that buffer whole (`body_of`).  In a
front process the buffer is a region of its shared-memory arena (`body_buffers`), where the engine reads X as it is.
uvicorn's way, a 64 KiB high-water mark, a pause and a wake-up of the app per piece, and three copies (its buffer,
the message's bytes, Starlette's join), cost a front 6.6 ms of CPU per 8 MiB body, more than the product.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import error_body


def _answer(status: int, reason: str, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps(error_body(code, message)).encode()
    retry = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{retry}connection: close\r\n\r\n").encode() + body


IN_PLACE = "qgemm.body_in_place"  # the scope state's key for a body read in place
IN_PLACE_PATHS = frozenset({"/v1/matmul"})  # routes that read their body with `body_of`
READ_IN_PLACE_BYTES = 1 << 20  # bodies this large (of IN_PLACE_PATHS) are read in place


async def body_of(request: Request) -> bytes | memoryview:
    """The request's body: the buffer it was read into in place (large bodies of the routes above), else Starlette's."""
    body = await request.body()  # returns once the whole body is in, wherever it went
    return request.scope.get("state", {}).get(IN_PLACE) or body


ONE_SEND_BYTES = 1 << 16  # bodies under this go in one send with their head


class HeadWithBody:
    """A response's view of its connection: the head (status line and headers, the cycle's first write) is held
    until the body's first write, and both go in one send; a head whose body does not follow within this turn of
    the event loop (a streamed or empty body) goes alone at the turn's end.  Why: uvicorn writes the two apart, two
    sends and two TCP segments for every small answer, and the head's send was 6% of a front's samples at M = 1."""

    __slots__ = ("transport", "loop", "held", "started")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop = transport, loop
        self.held: bytes | None = None
        self.started = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.started:
            self.started = True
            self.held = bytes(data)
            self.loop.call_soon(self.flush)
        elif self.held is not None:
            head, self.held = self.held, None
            if len(data) < ONE_SEND_BYTES:
                self.transport.writelines((head, data))
            else:  # a large body: its own send (asyncio's own transports would join the two, a copy of the body)
                self.transport.write(head)
                self.transport.write(data)
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self.held is not None:
            head, self.held = self.held, None
            if not self.transport.is_closing():
                self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class BoundedHttp(HttpToolsProtocol):
    head_limit = 64 << 10
    read_timeout_s = 30.0
    max_connections = 4096
    max_body = 256 << 20  # a body over it is not read in place (the app answers 413 before reading it)
    # where a body read in place goes: (a buffer of n bytes, its release) or None (then memory of its own)
    body_buffers: Callable[[int], tuple[memoryview, Callable[[], None]] | None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._reading = False  # a head or a body is being read: data resets the deadline
        self._silent_since = 0.0  # the loop's time of the last progress while reading
        self._in_place: np.ndarray | None = None  # the body being read in place, and how much of it came
        self._in_place_at = 0

    # -- the deadline --------------------------------------------------------------------------------------------
    # One timer a connection, set again only when it fires: progress and the ends of a read just note the time and
    # whether a read is under way (a timer made and cancelled at each of them cost a request four of them).
    def _arm(self) -> None:
        """A read starts or makes progress: the silence starts now."""
        self._silent_since = self.loop.time()
        self._reading = True
        if self._deadline is None:
            self._deadline = self.loop.call_at(self._silent_since + self.read_timeout_s, self._check)

    def _disarm(self) -> None:
        self._reading = False  # a pending timer finds nothing being read and lapses

    def _check(self) -> None:
        self._deadline = None
        if not self._reading:
            return
        due = self._silent_since + self.read_timeout_s
        if self.loop.time() < due:  # progress since the timer was set
            self._deadline = self.loop.call_at(due, self._check)
        else:
            self._expired()

    def _expired(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_answer(408, "Request Timeout", "request_timeout",
                                         f"the request was not sent within {self.read_timeout_s:g} s of silence "
                                         "(QGEMM_REQUEST_READ_TIMEOUT_S)"))
        self.transport.close()

    def _refuse_head(self) -> None:
        self._disarm()
        self.transport.write(_answer(431, "Request Header Fields Too Large", "headers_too_large",
                                     f"the request line and headers are over {self.head_limit} bytes "
                                     "(QGEMM_MAX_REQUEST_HEAD_BYTES)"))
        self.transport.close()

    # -- uvicorn's protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_answer(503, "Service Unavailable", "too_many_connections",
                                    f"this process holds {self.max_connections} open connections "
                                    "(QGEMM_MAX_CONNECTIONS): retry after the Retry-After seconds", retry_after=1))
            transport.close()
            return
        self._arm()  # a connection that never sends a request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._deadline is not None:  # not left to hold the protocol until it fires
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.head_limit and not self._head_done_in(data):
                self._refuse_head()
                return
        if self._reading:
            self._arm()  # progress: the silence starts again
        super().data_received(data)

    def _head_done_in(self, data: bytes) -> bool:
        """Whether the head ends within the limit (a small head and its body arrived in one read)."""
        end = data.find(b"\r\n\r\n")
        return end >= 0 and self._head_bytes - len(data) + end + 4 <= self.head_limit

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        body = self.parser.get_method() not in (b"GET", b"HEAD") and any(
            name in (b"content-length", b"transfer-encoding") and value not in (b"0",) for name, value in self.headers)
        if body:
            self._arm()
        else:
            self._disarm()
        super().on_headers_complete()
        if self.cycle is not None:  # its task has not run yet: the response goes through HeadWithBody
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        self._in_place = None
        if body and self.scope["path"] in IN_PLACE_PATHS and self.scope["method"] == "POST":
            length = next((value for name, value in self.headers if name == b"content-length"), None)
            if length is not None and length.isdigit() and READ_IN_PLACE_BYTES <= int(length) <= self.max_body:
                n = int(length)
                got = self.body_buffers(n) if self.body_buffers is not None else None
                if got is not None:  # released once the request is over (its cycle gone), whatever its end
                    view, release = got
                    weakref.finalize(self.cycle, release)
                else:  # numpy's empty: pages are taken as the body fills them, not at a declared length
                    view = memoryview(np.empty(n, np.uint8))
                self._in_place, self._in_place_at = np.frombuffer(view, np.uint8), 0
                self.scope.setdefault("state", {})[IN_PLACE] = view

    def on_body(self, body: bytes) -> None:
        buf = self._in_place
        if buf is None:
            super().on_body(body)
            return
        at = self._in_place_at  # httptools frames the body by its Content-Length: it never runs past the buffer
        buf[at:at + len(body)] = np.frombuffer(body, np.uint8)
        self._in_place_at = at + len(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_place = None  # the app has it (scope state); the next request's body is its own
        self._in_head, self._head_bytes = True, 0  # what comes next is the next request's head
        super().on_message_complete()


def connection_cap(setting: int | None) -> int:
    """The setting, or (unset) what the process's open-file limit leaves room for: 64 descriptors kept for the
    process's own files, sockets and shared memory, at most 10,000 connections."""
    if setting is not None:
        return setting
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 10_000 if soft == resource.RLIM_INFINITY else max(16, min(10_000, soft - 64))


def bounded_http(head_limit: int, read_timeout_s: float, max_connections: int | None = None,
                 max_body: int = 256 << 20,
                 body_buffers: Callable[[int], tuple[memoryview, Callable[[], None]] | None] | None = None
                 ) -> type[BoundedHttp]:
    """The protocol class uvicorn takes (`http=`), with these bounds; `body_buffers`: where large bodies are read."""
    return type("BoundedHttp", (BoundedHttp,), {"head_limit": head_limit, "read_timeout_s": read_timeout_s,
                                                "max_connections": connection_cap(max_connections),
                                                "max_body": max_body,
                                                "body_buffers": staticmethod(body_buffers) if body_buffers else None})
