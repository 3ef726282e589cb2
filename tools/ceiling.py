"""`qgemm ceiling`: the Python HTTP ceiling of this machine, to read `qgemm loadtest`'s figures against.

A bare FastAPI app under uvicorn (uvloop, httptools) with as many worker processes as `qgemm serve` has fronts,
answering `POST /v1/matmul` the way the service's route is shaped from outside: it reads the whole body and answers
N float32 values as `.npy` (16 KiB for N = 4096) with a Server-Timing header, and nothing else: no parsing, no
product, no engine.  `GET /v1/models/{model}/tensors/{tensor}` and `/healthz` answer what `qgemm loadtest` asks
first (the shape, and the worker processes, so that it reports their CPU per request as the fronts').  What the
service reaches of this ceiling's requests/s is what its own work (checks, the engine, the product) leaves.
"""

from __future__ import annotations

import argparse
import io
import os
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

N_ENV, K_ENV, WORKERS_ENV = "QGEMM_CEILING_N", "QGEMM_CEILING_K", "QGEMM_CEILING_WORKERS"


def _answer(n: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(0).standard_normal((1, n)).astype(np.float32))
    return buf.getvalue()


def make_app() -> FastAPI:
    n, k = int(os.environ.get(N_ENV, "4096")), int(os.environ.get(K_ENV, "4096"))
    body = _answer(n)
    app = FastAPI()

    @app.post("/v1/matmul")
    async def matmul(request: Request) -> Response:
        t0 = time.perf_counter()
        got = await request.body()
        ms = (time.perf_counter() - t0) * 1e3
        return Response(body, media_type="application/x-npy",
                        headers={"Server-Timing": f"request;dur={ms:.3f}", "X-Body-Bytes": str(len(got))})

    @app.get("/v1/models/{model}/tensors/{tensor}")
    async def tensor(model: str, tensor: str) -> dict[str, Any]:
        return {"name": tensor, "shape": [n, k], "type": "F32"}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        pids = [os.getpid()]  # one worker: uvicorn serves from its main process
        if int(os.environ.get(WORKERS_ENV, "1")) > 1:
            parent = os.getppid()
            try:  # uvicorn's workers are its main process's children
                pids = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
            except OSError:
                pass
        return {"status": "ok", "backend": "none", "processes": [{"role": "front", "pid": p} for p in pids]}

    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--fronts", type=int, default=None,
                   help="worker processes (default: what `qgemm serve` starts here, QGEMM_FRONTS's default)")
    p.add_argument("--n", type=int, default=4096, help="the answer's values (16 KiB for 4096)")
    p.add_argument("--k", type=int, default=4096, help="the K that /v1/models/.../tensors/... reports")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from app.serving.supervisor import default_fronts, engine_envs
    from app.settings import Settings

    settings = Settings.from_env()
    fronts = args.fronts or settings.fronts or default_fronts(len(engine_envs(settings)))
    os.environ[N_ENV], os.environ[K_ENV], os.environ[WORKERS_ENV] = str(args.n), str(args.k), str(max(1, fronts))
    uvicorn.run("tools.ceiling:make_app", factory=True, host=args.host, port=args.port, workers=max(1, fronts),
                loop="uvloop", http="httptools", log_level="warning", access_log=False)
    return 0
