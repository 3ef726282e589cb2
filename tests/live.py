"""A real uvicorn server in a thread, for tests that need real connections (keep-alive, resets)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


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
