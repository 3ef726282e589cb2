"""Real servers for tests that need real connections: the app under uvicorn in a thread (keep-alive, resets), and
`qgemm serve` as a user starts it, fronts and engine processes (`Server`)."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI

from tests.conftest import CACHE_DIR, RUN_DIR

TENSOR, K, N = "blk.0.attn_q.weight", 4096, 4096
ROOT = Path(__file__).parents[1]
# the backend the servers run on: the CPU in CI; QGEMM_TEST_PROCESS_BACKEND=cuda runs the same faults on a GPU
BACKEND = os.environ.get("QGEMM_TEST_PROCESS_BACKEND", "cpu")


@contextmanager
def live_server(app: FastAPI) -> Iterator[tuple[str, int]]:
    """Serve `app` on a free local port (httptools, as `qgemm serve` runs it) until the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield host, port
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


class Server:
    def __init__(self, models_dir: Path, fronts: int = 2, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = RUN_DIR / f"serve-{self.port}.log"  # its stderr, for a failing test's message; gone with the run
        self.env = {**os.environ, "QGEMM_MODELS_DIR": str(models_dir), "QGEMM_BACKEND": BACKEND,
                    "QGEMM_CACHE_DIR": str(CACHE_DIR), "QGEMM_FRONTS": str(fronts), **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)],
                                     env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self.wait_ok(60)
        return self

    def health(self) -> dict:
        return httpx.get(f"{self.url}/healthz", timeout=5).json()

    def wait_ok(self, seconds: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                h = self.health()
                if h["status"] == "ok" and all(p["state"] == "ok" for p in h.get("processes") or []):
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"not healthy within {seconds} s: {self.log.read_text()[-3000:]}")

    def pids(self, role: str) -> list[int]:
        return [p["pid"] for p in self.health()["processes"] if p["role"] == role]

    def post(self, x: np.ndarray | bytes, client: httpx.Client | None = None, **params: str) -> httpx.Response:
        q = {"model": "demo", "tensor": TENSOR, **params}
        body = x if isinstance(x, bytes) else npy(x)
        return (client or httpx).post(f"{self.url}/v1/matmul", params=q, content=body, timeout=30,
                                      headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


