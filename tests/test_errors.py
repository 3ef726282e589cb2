"""A fault inside a route: a JSON 500 with a request id that is logged, and the connection lives on."""

from __future__ import annotations

import http.client
import json
import logging
from pathlib import Path

import pytest

from app.main import create_app
from app.settings import Settings
from tests.live import live_server

BODY = json.dumps({"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64]})
HEADERS = {"Content-Type": "application/json"}


def test_an_unhandled_error_is_a_json_500_and_the_connection_stays_usable(
        models_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(Settings(models_dir=models_dir, backend="cpu"))
    with live_server(app) as (host, port):
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/v1/matmul", BODY, HEADERS)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        sock = conn.sock

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug inside the route")

        monkeypatch.setattr(app.state.engine, "run", broken)
        with caplog.at_level(logging.ERROR, logger="qgemm"):
            for rid in ("client-chosen-id-42", None):  # the client's X-Request-Id is kept; else one is made
                conn.request("POST", "/v1/matmul", BODY, {**HEADERS, **({"X-Request-Id": rid} if rid else {})})
                r = conn.getresponse()
                body = json.loads(r.read())
                assert r.status == 500 and r.getheader("content-type") == "application/json"
                assert body["error"]["code"] == "internal" and "RuntimeError" in body["error"]["message"]
                assert body["error"]["request_id"] == r.getheader("x-request-id")
                assert rid is None or body["error"]["request_id"] == rid
                logged = [rec for rec in caplog.records if body["error"]["request_id"] in rec.getMessage()]
                assert logged and logged[0].exc_info is not None  # the traceback is in the log, under the id
        monkeypatch.undo()
        conn.request("POST", "/v1/matmul", BODY, HEADERS)  # the same connection, not a new one
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["shape"] == [1, 33]
        assert conn.sock is sock
        conn.close()


def test_the_500_is_documented_with_its_request_id(client) -> None:
    doc = client.get("/openapi.json").json()
    assert "500" in doc["paths"]["/v1/matmul"]["post"]["responses"]
    assert "request_id" in doc["components"]["schemas"]["ErrorDetail"]["properties"]
