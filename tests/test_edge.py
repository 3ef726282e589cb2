"""The HTTP connection's bounds (app/edge.py) on `qgemm serve` as a user starts it: a head over the cap is 431, a
connection silent while a request is read is 408 and closed, a slow but steady body is served, and the server
serves on after each."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.live import Server, npy

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Server]:
    s = Server(models_dir, fronts=1, QGEMM_BACKEND="cpu", QGEMM_REQUEST_READ_TIMEOUT_S=str(TIMEOUT_S)).start()
    try:
        yield s
    finally:
        s.stop()


def _exchange(server: Server, parts: list[bytes], pause: float = 0.0, wait: float = 10.0) -> tuple[int | None, dict,
                                                                                                      float]:
    """Send `parts` (`pause` s apart) on a fresh connection; (status, JSON body, seconds until the server closed)."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        t0 = time.monotonic()
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed meanwhile
                break
        sock.settimeout(wait)
        data = b""
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - t0
    if not data:
        return None, {}, took
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.startswith(b"{") else {}, took


def _still_serves(server: Server) -> None:
    assert server.post(np.ones((1, 4096), np.float32)).status_code == 200


@pytest.mark.parametrize("head", [
    b"POST /v1/matmul HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",  # one 1 MiB header
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)) + b"\r\n",
    b"GET /" + b"a" * (200 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line of 200 KiB
], ids=["big-header", "many-headers", "long-url"])
def test_a_head_over_the_cap_is_431_at_once(server: Server, head: bytes) -> None:
    status, body, took = _exchange(server, [head])
    assert status == 431 and body["error"]["code"] == "headers_too_large" and took < 5
    _still_serves(server)


@pytest.mark.parametrize("parts", [
    [],  # a connection that never sends a byte
    [b"POST /v1/mat"],  # a partial request line
    [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n"],  # headers never finished
    [b"POST /v1/matmul?model=demo&tensor=tiny.q4_0.weight HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
     b"Content-Length: 1000\r\n\r\n" + b"\x93NUMPY"],  # a promised body that stops
], ids=["silent", "partial-line", "partial-headers", "partial-body"])
def test_a_request_that_stops_is_408_and_closed(server: Server, parts: list[bytes]) -> None:
    status, body, took = _exchange(server, parts)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert TIMEOUT_S * 0.8 < took < TIMEOUT_S + 3
    _still_serves(server)


def test_a_slow_but_steady_body_is_served(server: Server) -> None:
    """The deadline is on silence, not on the whole body: a body sent in pieces 0.6 s apart (each within the 1 s)."""
    body = npy(np.full((1, 64), 0.25, np.float32))
    head = (b"POST /v1/matmul?model=demo&tensor=tiny.q4_0.weight HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/x-npy\r\nContent-Length: %d\r\n\r\n" % len(body))
    pieces = [head, *(body[i:i + 40] for i in range(0, len(body), 40))]
    status, answer, took = _exchange(server, pieces, pause=0.6)
    assert status == 200 and answer["shape"] == [1, 33] and took > 0.6 * (len(pieces) - 1)


def test_connections_past_the_cap_are_503_with_retry_after(models_dir: Path) -> None:
    """QGEMM_MAX_CONNECTIONS open connections (here idle) held: the next is answered 503 too_many_connections with
    Retry-After and closed, and once they go the process serves again."""
    s = Server(models_dir, fronts=1, QGEMM_BACKEND="cpu", QGEMM_MAX_CONNECTIONS="4").start()
    try:
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        time.sleep(0.3)  # accepted by the front
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.settimeout(10)
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        for sock in held:
            sock.close()
        time.sleep(0.3)
        _still_serves(s)
    finally:
        s.stop()


@pytest.mark.parametrize("deployment", ["in-process", "fronts"])
def test_a_product_past_its_deadline_is_504_and_the_server_serves_on(models_dir: Path, deployment: str) -> None:
    """QGEMM_PRODUCT_DEADLINE_S bounds a product from its check to its answer (here a microsecond: every product is
    late), in both deployments; the engine's late answer lets go of its memory, and the server keeps answering."""
    from tests.conftest import make_client

    body = npy(np.ones((3, 4096), np.float32))
    params = {"model": "demo", "tensor": "blk.0.attn_q.weight"}
    headers = {"Content-Type": "application/x-npy"}
    if deployment == "in-process":
        with make_client(models_dir, product_deadline_s=1e-6) as c:
            for _ in range(3):
                r = c.post("/v1/matmul", params=params, content=body, headers=headers)
                assert r.status_code == 504 and r.json()["error"]["code"] == "product_timeout", r.text
            assert c.get("/healthz").status_code == 200
        return
    s = Server(models_dir, fronts=1, QGEMM_BACKEND="cpu", QGEMM_PRODUCT_DEADLINE_S="0.000001").start()
    try:
        for _ in range(20):
            r = httpx.post(f"{s.url}/v1/matmul", params=params, content=body, headers=headers, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "product_timeout", r.text
        time.sleep(0.5)
        assert httpx.get(f"{s.url}/healthz", timeout=10).json()["status"] == "ok"
    finally:
        s.stop()


def _chunked(body: bytes) -> Iterator[bytes]:
    """The same body sent without a Content-Length (chunked): read uvicorn's way, not in place."""
    for i in range(0, len(body), 300_000):
        yield body[i:i + 300_000]


@pytest.mark.parametrize("how", ["npy", "npy-f64-fortran", "json"])
def test_a_large_body_read_in_place_answers_as_one_read_in_pieces(server: Server, how: str) -> None:
    """A body of 1 MiB and more is written once into a buffer of its declared length (app/edge.py): the answer is
    bit for bit the one of the same body sent chunked (read uvicorn's way), in each body form."""
    rng = np.random.default_rng()
    m = int(rng.integers(4200, 5200))  # [m, 64] float32: over 1 MiB
    x = rng.standard_normal((m, 64)).astype(np.float32)
    params = {"model": "demo", "tensor": "tiny.q4_0.weight"}
    if how == "json":
        body, ctype = json.dumps({**params, "activations": x.tolist()}).encode(), "application/json"
        params = {}
    else:
        body, ctype = npy(np.asfortranarray(x.astype(np.float64)) if how == "npy-f64-fortran" else x), \
            "application/x-npy"
    assert len(body) >= 1 << 20
    answers = []
    for content in (body, _chunked(body)):
        r = httpx.post(f"{server.url}/v1/matmul", params=params, content=content, timeout=60,
                       headers={"Content-Type": ctype})
        assert r.status_code == 200, r.text
        answers.append(np.asarray(r.json()["output"], np.float32))
    assert answers[0].shape == (m, 33) and np.array_equal(answers[0], answers[1])
    _still_serves(server)


def test_a_broken_large_body_read_in_place_is_400_and_the_server_serves_on(server: Server) -> None:
    """A 2 MiB body that is no .npy, and one whose header promises more data than it has: 400, then served on."""
    body = npy(np.ones((4100, 64), np.float32))
    for bad in (b"\x00" * (2 << 20), body[:128] + body[128 + 64:] + b"\x00" * 32):
        r = server.post(bad)  # the right length for the header, wrong data for the shape
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_npy", r.text
    truncated = body[:len(body) - 4096]
    r = server.post(truncated)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_npy", r.text
    _still_serves(server)


def test_a_response_s_head_goes_in_one_send_with_its_body() -> None:
    """HeadWithBody: the head written in the same turn of the loop as the body goes with it (one writelines); a head
    whose body does not follow in that turn goes alone at the turn's end, before the body; close sends what it holds."""
    import asyncio

    from app.edge import ONE_SEND_BYTES, HeadWithBody

    class Transport:
        def __init__(self) -> None:
            self.sends: list[list[bytes]] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.sends.append([bytes(data)])

        def writelines(self, parts: tuple) -> None:
            self.sends.append([bytes(p) for p in parts])

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

    async def main() -> list[list[list[bytes]]]:
        loop = asyncio.get_running_loop()
        together, apart, closed, large = Transport(), Transport(), Transport(), Transport()
        t = HeadWithBody(together, loop)  # type: ignore[arg-type]
        t.write(b"head")
        t.write(memoryview(b"body"))
        t.write(b"more")
        a = HeadWithBody(apart, loop)  # type: ignore[arg-type]
        a.write(b"head")
        await asyncio.sleep(0)
        assert apart.sends == [[b"head"]]
        a.write(b"body")
        big = b"x" * ONE_SEND_BYTES
        t.write(b"late")  # not the head: sent as it comes
        b = HeadWithBody(large, loop)  # type: ignore[arg-type]
        b.write(b"head")
        b.write(big)
        c = HeadWithBody(closed, loop)  # type: ignore[arg-type]
        c.write(b"head")
        c.close()
        await asyncio.sleep(0)
        assert large.sends == [[b"head"], [big]]  # a large body goes in a send of its own
        return [together.sends, apart.sends, closed.sends + [[b"closed"]] * closed.closed]

    together, apart, closed = asyncio.run(main())
    assert together == [[b"head", b"body"], [b"more"], [b"late"]]
    assert apart == [[b"head"], [b"body"]]
    assert closed == [[b"head"], [b"closed"]]


def test_the_read_deadline_is_one_timer_a_connection() -> None:
    """BoundedHttp's deadline: starts and progress of a read note the time and set no new timer while one is pending;
    a timer that fires after progress is set again for the silence's end; one that finds no read under way lapses;
    a silence of the whole timeout expires the read."""
    from app.edge import BoundedHttp

    class Loop:
        def __init__(self) -> None:
            self.now, self.timers = 0.0, []

        def time(self) -> float:
            return self.now

        def call_at(self, when: float, fn):  # noqa: ANN001
            self.timers.append((when, fn))
            return type("Handle", (), {"cancel": lambda _: None})()

    p = object.__new__(BoundedHttp)
    p.loop, p.read_timeout_s, p._deadline, p._reading, p._silent_since = Loop(), 30.0, None, False, 0.0
    expired: list[float] = []
    p._expired = lambda: expired.append(p.loop.now)  # type: ignore[method-assign]
    for t in (0.0, 1.0, 2.0):  # three requests' starts, progress and ends on one connection
        p.loop.now = t
        p._arm()
        p._arm()
        p._disarm()
    assert len(p.loop.timers) == 1 and p.loop.timers[0][0] == 30.0
    p.loop.now = 29.0
    p._arm()  # a read under way when the timer fires, its last progress at 29 s
    p.loop.now = 30.0
    p.loop.timers.pop()[1]()
    assert p.loop.timers == [(59.0, p._check)] and not expired
    p.loop.now = 59.0
    p.loop.timers.pop()[1]()
    assert expired == [59.0] and not p.loop.timers
    p._disarm()
    p._arm()  # a new read at 59 s: a new timer; it finds nothing being read and lapses
    p._disarm()
    p.loop.now = 89.0
    p.loop.timers.pop()[1]()
    assert not p.loop.timers and expired == [59.0] and p._deadline is None
