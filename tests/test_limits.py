"""Body limit (413 before the body is read), API key, and the unknown-route error shape."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import make_client


def test_body_over_limit_is_413_from_content_length(models_dir: Path) -> None:
    with make_client(models_dir, max_body_bytes=1000) as c:
        r = c.post("/v1/matmul", content=b"x" * 1001, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert "QGEMM_MAX_BODY_BYTES" in r.json()["error"]["message"]
        assert c.get("/healthz").status_code == 200


def test_chunked_body_over_limit_is_413(models_dir: Path) -> None:
    def chunks():
        for _ in range(20):
            yield b"y" * 100

    with make_client(models_dir, max_body_bytes=1000) as c:
        r = c.post("/v1/matmul", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413


def test_limit_refuses_before_reading_the_body(models_dir: Path) -> None:
    """Drive the ASGI app directly: a body that never arrives must not be waited for."""
    from app.limits import BodyLimit

    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        await asyncio.sleep(3600)

    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the app ran")

    scope = {"type": "http", "headers": [(b"content-length", b"5000000")]}
    asyncio.run(asyncio.wait_for(BodyLimit(app, 1000)(scope, receive, send), 5))
    assert reads == 0 and sent[0]["status"] == 413


def test_bad_content_length_is_400(models_dir: Path) -> None:
    from app.limits import BodyLimit

    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def nothing():  # pragma: no cover
        return {}

    scope = {"type": "http", "headers": [(b"content-length", b"-5")]}
    asyncio.run(BodyLimit(None, 1000)(scope, nothing, send))  # type: ignore[arg-type]
    assert sent[0]["status"] == 400


def test_api_key_guards_v1_only(models_dir: Path) -> None:
    with make_client(models_dir, api_key="s3cret") as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = c.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q8_0.weight", "activations": [[1.0] * 64]},
                   headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_unknown_route_and_method_have_the_error_shape(client) -> None:
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/matmul")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
