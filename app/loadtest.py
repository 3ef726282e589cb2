"""`qgemm loadtest`: drive a running server with concurrent clients and report what they saw.

The clients are spread over several processes (each an asyncio loop of httpx connections, one per
client, keep-alive), so that the load generator is not the bottleneck; every process sends the
same prepared body bytes.  Reported: requests/s, client latency p50/p99/max, errors by status, the
server's own `request` time (Server-Timing) and the GPU's share of the wall time (quantize + GEMM of
each product, shared between the requests batched into it).
"""

from __future__ import annotations

import asyncio
import io
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Plan:
    url: str
    model: str
    tensor: str
    k: int
    m: int
    kernel: str
    fmt: str  # "npy" or "json"
    clients: int
    seconds: float
    api_key: str | None = None


def _body(plan: Plan) -> tuple[str, dict[str, str], bytes]:
    x = np.random.default_rng(0).standard_normal((plan.m, plan.k)).astype(np.float32)
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    if plan.fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, x)
        url = f"{plan.url}/v1/matmul?model={plan.model}&tensor={plan.tensor}&kernel={plan.kernel}"
        return url, {**headers, "Content-Type": "application/x-npy", "Accept": "application/x-npy"}, buf.getvalue()
    body = json.dumps({"model": plan.model, "tensor": plan.tensor, "kernel": plan.kernel,
                       "activations": x.tolist()}).encode()
    return f"{plan.url}/v1/matmul", {**headers, "Content-Type": "application/json"}, body


def _server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


async def _clients(plan: Plan, n: int, start_at: float, counter: Any) -> dict[str, Any]:
    import httpx

    url, headers, body = _body(plan)
    lat: list[float] = []
    server: list[float] = []
    gpu = 0.0
    errors: dict[str, int] = {}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:
        async def one() -> None:
            nonlocal gpu
            while time.time() < start_at:
                await asyncio.sleep(start_at - time.time())
            end = start_at + plan.seconds
            while time.time() < end:
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, content=body, headers=headers)
                    status = str(r.status_code)
                except Exception as exc:  # a dropped connection counts, it does not stop the run
                    status = type(exc).__name__
                    r = None
                if r is not None and r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                    st = _server_timing(r.headers.get("server-timing", ""))
                    server.append(st.get("request", 0.0))
                    share = r.headers.get("x-qgemm-batch", "1,1").split(",")[0]
                    gpu += (st.get("quantize", 0.0) + st.get("gemm", 0.0)) / max(int(share), 1)
                else:
                    errors[status] = errors.get(status, 0) + 1
                with counter.get_lock():
                    counter.value += 1
        await asyncio.gather(*[one() for _ in range(n)])
    return {"latency_s": lat, "server_ms": server, "gpu_ms": gpu, "errors": errors}


def _process(plan: Plan, n: int, start_at: float, counter: Any, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_clients(plan, n, start_at, counter)))


def run(plan: Plan, processes: int | None = None, progress: bool = True) -> dict[str, Any]:
    processes = max(1, min(plan.clients, processes or max(1, (os.cpu_count() or 2) // 2)))
    shares = [plan.clients // processes + (i < plan.clients % processes) for i in range(processes)]
    ctx = mp.get_context("spawn")
    counter, out = ctx.Value("l", 0), ctx.Queue()
    start_at = time.time() + 2.0 + 0.05 * processes  # every process ready before the clock starts
    procs = [ctx.Process(target=_process, args=(plan, n, start_at, counter, out)) for n in shares]
    for p in procs:
        p.start()
    while time.time() < start_at + plan.seconds:
        time.sleep(1.0)
        if progress and time.time() > start_at:
            elapsed = time.time() - start_at
            print(f"\r  {elapsed:5.1f}/{plan.seconds:.0f} s  {counter.value} requests "
                  f"({counter.value / max(elapsed, 1e-9):,.0f}/s)", end="", file=sys.stderr, flush=True)
    parts = [out.get() for _ in procs]
    for p in procs:
        p.join()
    if progress:
        print(file=sys.stderr)
    lat = np.array([v for p in parts for v in p["latency_s"]]) * 1e3
    server = np.array([v for p in parts for v in p["server_ms"]])
    errors: dict[str, int] = {}
    for p in parts:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    ok = len(lat)

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 3) if len(a) else None

    return {"m": plan.m, "k": plan.k, "clients": plan.clients, "format": plan.fmt, "kernel": plan.kernel,
            "tensor": plan.tensor, "seconds": plan.seconds, "processes": processes, "ok": ok,
            "errors": errors, "requests_per_s": round(ok / plan.seconds, 1),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": round(float(lat.max()), 3) if ok else None,
            "server_request_p50_ms": pct(server, 50),
            "gpu_share": round(sum(p["gpu_ms"] for p in parts) / (plan.seconds * 1e3), 4)}
