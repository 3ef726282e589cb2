"""`qgemm loadtest`: drive a running server with concurrent clients and report what they saw.

The clients are spread over several processes, each an asyncio (uvloop) loop of keep-alive HTTP/1.1
connections, one per client, that send one prepared request's bytes again and again and read each
answer's head and body (`Connection`), so that the load generator is not the bottleneck.  Reported:
requests/s, client latency p50/p99/max, errors by status, the server's own `request` time and its
overhead (`request` minus the product's quantize + GEMM, from Server-Timing), the GPU's share of
the wall time (quantize + GEMM of each product, shared between the requests batched into it), and, when the
server runs on this machine, the CPU time each of its processes spent over the run per request answered
(engines and fronts apart: the processes /healthz names, their CPU read from /proc), and the client processes' own
(`clients`): where they share the server's cores, whether the load generator, not the server, bounds a run; and
each role's busiest process's share of a core (one near 100% is what bounds the run).
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
from urllib.parse import urlsplit

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


class _Answers(asyncio.BufferedProtocol):
    """The reading end of a Connection: each answer's head read into a small buffer, its body straight from the socket
    into an array of its length (or, where the body is not wanted, into one scratch buffer): no stream buffer that
    grows, pauses and is copied out (an 8 MiB answer cost the stream reader ~10 ms of CPU)."""

    HEAD_LIMIT = 1 << 20

    def __init__(self, keep_body: bool):
        self.keep_body = keep_body
        self.transport: asyncio.Transport | None = None
        self.head = bytearray(1 << 14)
        self.head_len = 0
        self.body: bytearray | None = None  # the answer's body being read, once its head is in
        self.body_len = self.body_at = 0
        self.scratch = bytearray(1 << 18)
        self.status, self.headers = 0, {}
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionResetError("the server closed the connection"))

    async def exchange(self, request: bytes) -> tuple[int, dict[str, str], bytes | bytearray]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is None:  # the head: grown when a read fills it
            if self.head_len == len(self.head):
                if len(self.head) >= self.HEAD_LIMIT:
                    raise ValueError("an answer's head over 1 MiB")
                self.head.extend(bytes(len(self.head)))
            return memoryview(self.head)[self.head_len:]
        if self.keep_body:
            return memoryview(self.body)[self.body_at:]
        return memoryview(self.scratch)[:max(1, min(len(self.scratch), self.body_len - self.body_at))]

    def buffer_updated(self, nbytes: int) -> None:
        if self.body is not None:
            self.body_at += nbytes
        else:
            self.head_len += nbytes
            end = self.head.find(b"\r\n\r\n", 0, self.head_len)
            if end < 0:
                return
            lines = self.head[:end].decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            self.headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name:
                    self.headers[name.strip().lower()] = value.strip()
            self.body_len = int(self.headers.get("content-length", "0"))
            extra = min(self.head_len - end - 4, self.body_len)
            self.body = bytearray(self.body_len) if self.keep_body else bytearray()
            if self.keep_body:
                self.body[:extra] = self.head[end + 4:end + 4 + extra]
            self.body_at, self.head_len = extra, 0
        if self.body_at >= self.body_len:
            body, self.body = self.body, None
            if self.headers.get("connection", "").lower() == "close" and self.transport is not None:
                self.transport.close()
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((self.status, self.headers, body if self.keep_body else b""))


class Connection:
    """One keep-alive HTTP/1.1 connection sending one prepared request over and over.  A load generator
    has to cost less than the server it measures: httpx spends ~0.5 ms of Python per request, this ~0.05; an
    8 MiB answer is read straight into its array (`keep_body`), or not kept at all."""

    def __init__(self, host: str, port: int, request: bytes, keep_body: bool = True):
        self.host, self.port, self.request, self.keep_body = host, port, request, keep_body
        self._answers: _Answers | None = None

    async def send(self, request: bytes | None = None) -> tuple[int, dict[str, str], bytes | bytearray]:
        """Send `request` (default: the prepared one); the answer's status, headers and body (empty where the body
        is not kept)."""
        if self._answers is None or self._answers.closed:
            _, self._answers = await asyncio.get_running_loop().create_connection(
                lambda: _Answers(self.keep_body), self.host, self.port)
        answers = self._answers
        result = await answers.exchange(request or self.request)
        if answers.closed:
            self._answers = None
        return result

    def close(self) -> None:
        if self._answers is not None and self._answers.transport is not None:
            self._answers.transport.close()
        self._answers = None


def request_bytes(method: str, url: str, headers: dict[str, str], body: bytes = b"") -> tuple[str, int, bytes]:
    """(host, port, the HTTP/1.1 request's bytes)."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    return parts.hostname or "127.0.0.1", parts.port or 80, ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _request_bytes(plan: Plan) -> tuple[str, int, bytes]:
    url, headers, body = _body(plan)
    return request_bytes("POST", url, headers, body)


async def _clients(plan: Plan, n: int, start_at: float, counter: Any) -> dict[str, Any]:
    host, port, request = _request_bytes(plan)
    lat: list[float] = []
    server: list[float] = []
    overhead: list[float] = []
    gpu = 0.0
    errors: dict[str, int] = {}

    async def one() -> None:
        nonlocal gpu
        conn = Connection(host, port, request, keep_body=False)  # only the status and headers are read
        while time.time() < start_at:
            await asyncio.sleep(start_at - time.time())
        end = start_at + plan.seconds
        while time.time() < end:
            t0 = time.perf_counter()
            try:
                status, headers, _ = await conn.send()
            except Exception as exc:  # a dropped connection counts, and the next request reconnects
                conn.close()
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            if status == 200:
                lat.append(time.perf_counter() - t0)
                st = _server_timing(headers.get("server-timing", ""))
                server.append(st.get("request", 0.0))
                overhead.append(st.get("request", 0.0) - st.get("quantize", 0.0) - st.get("gemm", 0.0))
                share = headers.get("x-qgemm-batch", "1,1").split(",")[0]
                gpu += (st.get("quantize", 0.0) + st.get("gemm", 0.0)) / max(int(share), 1)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1
            with counter.get_lock():
                counter.value += 1
        conn.close()

    await asyncio.gather(*[one() for _ in range(n)])
    return {"latency_s": lat, "server_ms": server, "overhead_ms": overhead, "gpu_ms": gpu, "errors": errors}


def _process(plan: Plan, n: int, start_at: float, counter: Any, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(_clients(plan, n, start_at, counter)))


def server_processes(url: str, api_key: str | None = None) -> list[tuple[str, int]]:
    """(role, pid) of each process of the server at `url`, as its /healthz names them (none where one process
    serves)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            health = json.loads(r.read())
    except (OSError, ValueError):
        return []
    return [(p["role"], p["pid"]) for p in health.get("processes") or [] if p.get("pid")]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process of this machine, or None where /proc does not show it."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_process(procs: list[tuple[str, int]]) -> dict[tuple[str, int], float] | None:
    """CPU seconds so far of each (role, pid), or None where /proc does not show one of them."""
    seconds: dict[tuple[str, int], float] = {}
    for role, pid in procs:
        t = cpu_seconds(pid)
        if t is None:
            return None
        seconds[(role, pid)] = t
    return seconds or None


def cpu_use(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float], requests: int,
            seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """Each role's CPU µs per request answered (its processes together), and the share of a core its busiest
    process used over the run: a process near 100% is what bounds the run."""
    per_request: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for (role, pid), t in after.items():
        used = t - before[(role, pid)]
        per_request[role] = per_request.get(role, 0.0) + used / requests * 1e6
        busiest[role] = max(busiest.get(role, 0.0), used / seconds)
    return ({role: round(us, 1) for role, us in per_request.items()},
            {role: round(share, 3) for role, share in busiest.items()})


def abba(urls: list[str], rounds: int) -> list[str]:
    """The order the servers at `urls` take a configuration's runs: forward, then backward, `rounds` times (A B B A
    for two servers and two rounds), so that a drift of the machine over time (two starts of one server's code served
    17% apart in one session) falls on every server alike instead of on the later one."""
    return [u for r in range(rounds) for u in (urls if r % 2 == 0 else urls[::-1])]


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server and configuration, the median of its runs' requests/s and p99 (and how many runs)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row.get("url"), row["m"], row["clients"], row["format"]), []).append(row)
    return [{"url": url, "m": m, "clients": clients, "format": fmt, "runs": len(rs),
             "requests_per_s": round(float(np.median([r["requests_per_s"] for r in rs])), 1),
             "p99_ms": round(float(np.median([r["p99_ms"] for r in rs if r["p99_ms"] is not None] or [np.nan])), 3)}
            for (url, m, clients, fmt), rs in groups.items()]


def run(plan: Plan, processes: int | None = None, progress: bool = True) -> dict[str, Any]:
    processes = max(1, min(plan.clients, processes or max(1, (os.cpu_count() or 2) // 2)))
    shares = [plan.clients // processes + (i < plan.clients % processes) for i in range(processes)]
    ctx = mp.get_context("spawn")
    counter, out = ctx.Value("l", 0), ctx.Queue()
    start_at = time.time() + 2.0 + 0.05 * processes  # every process ready before the clock starts
    procs = [ctx.Process(target=_process, args=(plan, n, start_at, counter, out)) for n in shares]
    for p in procs:
        p.start()
    # the server's processes, and this load generator's own (role "client"): whether the clients bound the run
    watched = server_processes(plan.url, plan.api_key) + [("client", p.pid) for p in procs if p.pid]
    time.sleep(max(0.0, start_at - time.time()))
    cpu_before = cpu_by_process(watched)
    while time.time() < start_at + plan.seconds:
        time.sleep(min(1.0, max(0.0, start_at + plan.seconds - time.time())))  # CPU read as the clients stop
        if progress and time.time() > start_at:
            elapsed = time.time() - start_at
            print(f"\r  {elapsed:5.1f}/{plan.seconds:.0f} s  {counter.value} requests "
                  f"({counter.value / max(elapsed, 1e-9):,.0f}/s)", end="", file=sys.stderr, flush=True)
    cpu_after = cpu_by_process(watched)
    parts = [out.get() for _ in procs]
    for p in procs:
        p.join()
    if progress:
        print(file=sys.stderr)
    lat = np.array([v for p in parts for v in p["latency_s"]]) * 1e3
    server = np.array([v for p in parts for v in p["server_ms"]])
    overhead = np.array([v for p in parts for v in p["overhead_ms"]])
    errors: dict[str, int] = {}
    for p in parts:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    ok = len(lat)
    cpu_us = busiest = None
    if cpu_before and cpu_after and ok:  # CPU µs each role spent per request answered
        cpu_us, busiest = cpu_use(cpu_before, cpu_after, ok, plan.seconds)

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 3) if len(a) else None

    return {"m": plan.m, "k": plan.k, "clients": plan.clients, "format": plan.fmt, "kernel": plan.kernel,
            "tensor": plan.tensor, "seconds": plan.seconds, "processes": processes, "ok": ok,
            "errors": errors, "requests_per_s": round(ok / plan.seconds, 1),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": round(float(lat.max()), 3) if ok else None,
            "server_request_p50_ms": pct(server, 50), "server_overhead_p50_ms": pct(overhead, 50),
            "gpu_share": round(sum(p["gpu_ms"] for p in parts) / (plan.seconds * 1e3), 4),
            "cpu_us_per_request": cpu_us, "busiest_core_share": busiest}
