"""`qgemm ceiling` (tools/ceiling.py) answers what `qgemm loadtest` asks of a server: the shape, /healthz with its
worker processes, and POST /v1/matmul read whole and answered with N float32 values as .npy."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import httpx
import numpy as np

from tests.live import ROOT, free_port, npy
from tools.loadtest import abba, medians


def test_the_ceiling_serves_what_loadtest_asks() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools", "ceiling", "--port", str(port), "--fronts", "1",
                             "--n", "33", "--k", "64"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                health = httpx.get(f"{url}/healthz", timeout=2).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                time.sleep(0.1)
        assert [p["pid"] for p in health["processes"]] == [proc.pid] and health["processes"][0]["role"] == "front"
        assert httpx.get(f"{url}/v1/models/demo/tensors/t", timeout=5).json()["shape"] == [33, 64]
        body = npy(np.random.default_rng().standard_normal((3, 64)).astype(np.float32))
        r = httpx.post(f"{url}/v1/matmul", content=body, timeout=5, headers={"Content-Type": "application/x-npy"})
        assert r.status_code == 200 and r.headers["x-body-bytes"] == str(len(body))
        assert np.load(io.BytesIO(r.content)).shape == (1, 33) and "request;dur=" in r.headers["server-timing"]
    finally:
        proc.terminate()
        proc.wait(20)


def _ceiling(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tools", "ceiling", "--port", str(port), "--fronts", "1",
                             "--n", "33", "--k", "64"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            return proc
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.1)
    raise AssertionError("the ceiling did not start")


def test_loadtest_compares_two_servers_in_abba_order(tmp_path) -> None:
    """`--url A --url B --rounds 2`: each configuration's runs go A, B, B, A; each row names its server; the medians
    per server are printed at the end."""
    ports = [free_port(), free_port()]
    procs = [_ceiling(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    out = tmp_path / "rows.json"
    try:
        done = subprocess.run([sys.executable, "-m", "tools", "loadtest", "--url", urls[0], "--url", urls[1],
                               "--rounds", "2", "--seconds", "0.3", "--clients", "2", "--processes", "1",
                               "--tensor", "t", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        rows = json.loads(out.read_text())
        assert [r["url"] for r in rows] == [urls[0], urls[1], urls[1], urls[0]]
        assert all(r["ok"] > 0 and not r["errors"] for r in rows)
        medians = done.stderr.split("medians:")[1]
        assert all(f"{u}:" in medians and "(2 runs)" in medians for u in urls)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)


def test_abba_order_and_medians() -> None:
    assert abba(["a", "b"], 1) == ["a", "b"]
    assert abba(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert abba(["a"], 2) == ["a", "a"]
    rows = [{"url": u, "m": 1, "clients": 4, "format": "npy", "requests_per_s": v, "p99_ms": p}
            for u, v, p in (("a", 10.0, 1.0), ("b", 30.0, 3.0), ("b", 20.0, 2.0), ("a", 40.0, 4.0), ("a", 5.0, 9.0))]
    got = {s["url"]: s for s in medians(rows)}
    assert got["a"]["requests_per_s"] == 10.0 and got["a"]["p99_ms"] == 4.0 and got["a"]["runs"] == 3
    assert got["b"]["requests_per_s"] == 25.0 and got["b"]["p99_ms"] == 2.5 and got["b"]["runs"] == 2
