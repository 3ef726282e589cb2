"""`qgemm ceiling` (tools/ceiling.py) answers what `qgemm loadtest` asks of a server: the shape, /healthz with its
worker processes, and POST /v1/matmul read whole and answered with N float32 values as .npy."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import httpx
import numpy as np

from tests.live import ROOT, free_port, npy


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
