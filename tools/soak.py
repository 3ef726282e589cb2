"""`qgemm soak`: a server under concurrent products while its model files are rewritten under it.

Starts `qgemm serve` on a scratch models directory holding two models: `steady` (never touched) and
`soak`, whose tensor `w` is replaced every few seconds by the next of four versions (other values,
another type, another shape, the same size as an earlier one), in turn rewritten in place (truncated,
then written in two halves with a pause between), replaced by a rename, truncated for a while and
then rewritten, and deleted for a while.  Meanwhile `clients` keep-alive connections send products
(JSON and .npy, M from 1 to 24, both Ks) and one more loads, unloads and lists models.

Every 200 is checked: it must be the product (by the formula the answer names) of a version that was
live at some moment between the request and its answer; anything else counts as wrong.  A version is
live from the start of its write until the next version's write ends.  Reported: answers by status, 5xx,
reset connections, wrong products, rewrites by kind, and the server's resident memory (and GPU weight
bytes) sampled every second.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from gguf import GGMLQuantizationType

from kernels import reference as ref
from kernels.formats import mmq_ds_layout
from models.demo import write_gguf
from models.store import ModelStore
from tools.loadtest import Connection, request_bytes

Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
# the versions of soak's tensor w: (type, [N, K]); the last has the first's size (only the mtime tells them apart)
VERSIONS = [(Q8_0, (96, 256)), (Q4_0, (96, 256)), (Q8_0, (64, 512)), (Q8_0, (96, 256))]
STEADY = (Q4_0, (128, 256))
MS = (1, 5, 24)  # rows per request: MMVQ's formula alone, and MMQ's (batching may give any request either)
MATCH_NMSE = 1e-9  # another version's product is O(1) away; the same formula's on GPU or CPU ~1e-14
KINDS = ("in_place", "rename", "truncate", "delete")


@dataclass(frozen=True)
class SoakPlan:
    backend: str = "cpu"
    clients: int = 8
    seconds: float = 60.0
    rewrite_every_s: float = 2.0
    gone_s: float = 0.3  # how long a truncated or deleted file stays so
    seed: int = 0


@dataclass
class Weights:
    """A tensor's weights in both formulas' prepared forms."""
    type_name: str
    blocks: ref.BlockWeights
    shape: tuple[int, int]

    def product(self, x: np.ndarray, formula: str) -> np.ndarray:
        if formula == "q8_1_mmvq":
            return ref.ref_q8_1(self.blocks, ref.quantize_q8_1(x)).astype(np.float64)
        return ref.ref_mmq(self.blocks, ref.quantize_q8_1_mmq(x, mmq_ds_layout(self.type_name))).astype(np.float64)


@dataclass
class Tally:
    statuses: dict[str, int] = field(default_factory=dict)
    resets: int = 0
    reset_kinds: dict[str, int] = field(default_factory=dict)
    checked: int = 0
    wrong: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    rewrites: dict[str, int] = field(default_factory=dict)
    control: dict[str, int] = field(default_factory=dict)
    errors_5xx: dict[str, int] = field(default_factory=dict)  # by the answer's error code: what each 5xx was

    def status(self, what: str, status: int, body: bytes = b"") -> None:
        key = f"{what} {status}"
        self.statuses[key] = self.statuses.get(key, 0) + 1
        if status >= 500:
            try:
                error = orjson.loads(body)["error"]
                code = f"{error['code']}: {str(error['message'])[:70]}"
            except Exception:
                code = body[:80].decode(errors="replace") or "(no body)"
            self.errors_5xx[f"{what} {code}"] = self.errors_5xx.get(f"{what} {code}", 0) + 1


def _model_file(path: Path, qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> tuple[bytes, Weights]:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    write_gguf(path, [("w", qtype, values)], arch="qgemm-soak")
    model = ModelStore(path.parent).get(path.stem)
    info = model.tensors["w"]
    return path.read_bytes(), Weights(info.type_name, ref.prepare_block_weights(info.type_name, model.raw("w")),
                                      shape)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_bytes(pid: int) -> int:
    """Resident memory of the server: the process and every process under it (fronts, engine)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # it ended meanwhile
        return total
    return total + sum(_rss_bytes(int(c)) for c in children)


class History:
    """Which version of soak/w was live when: a version is live from the start of its write until the
    end of the next one's."""

    def __init__(self, first: int):
        self.writes: list[tuple[float, float, int]] = [(float("-inf"), float("-inf"), first)]

    def add(self, begin: float, end: float, version: int) -> None:
        self.writes.append((begin, end, version))

    def live(self, t0: float, t1: float) -> set[int]:
        out = set()
        for i, (begin, _, version) in enumerate(self.writes):
            until = self.writes[i + 1][1] if i + 1 < len(self.writes) else float("inf")
            if begin <= t1 and until >= t0:
                out.add(version)
        return out


class Soak:
    def __init__(self, plan: SoakPlan, workdir: Path):
        self.plan, self.workdir = plan, workdir
        self.models = workdir / "models"
        self.models.mkdir(parents=True, exist_ok=True)
        scratch = workdir / "scratch"
        scratch.mkdir(exist_ok=True)
        self.versions = [_model_file(scratch / f"v{i}.gguf", q, s, plan.seed * 100 + i)
                         for i, (q, s) in enumerate(VERSIONS)]
        _, self.steady = _model_file(scratch / "steady.gguf", *STEADY, plan.seed * 100 + 99)
        shutil.copy(scratch / "steady.gguf", self.models / "steady.gguf")
        (self.models / "soak.gguf").write_bytes(self.versions[0][0])
        rng = np.random.default_rng(plan.seed)
        self.xs = {(m, k): rng.standard_normal((m, k)).astype(np.float32) for m in MS for k in (256, 512)}
        self.history = History(0)
        self.tally = Tally()
        self.rss: list[tuple[float, int]] = []
        self.gpu_bytes: list[tuple[float, int]] = []
        self.expected: dict[tuple[str, int, int, int, str], np.ndarray] = {}

    # -- what a 200 must be --------------------------------------------------------------------
    def _want(self, model: str, version: int, m: int, k: int, formula: str) -> np.ndarray | None:
        w = self.steady if model == "steady" else self.versions[version][1]
        if w.shape[1] != k:
            return None
        key = (model, version, m, k, formula)
        if key not in self.expected:
            self.expected[key] = w.product(self.xs[(m, k)], formula)
        return self.expected[key]

    def check(self, model: str, m: int, k: int, y: np.ndarray, formula: str, t0: float, t1: float) -> None:
        self.tally.checked += 1
        versions = {0} if model == "steady" else self.history.live(t0, t1)
        for v in versions:
            want = self._want(model, v, m, k, formula)
            if want is not None and want.shape == y.shape and \
                    float(((y - want) ** 2).sum() / max((want ** 2).sum(), 1e-300)) < MATCH_NMSE:
                return
        self.tally.wrong += 1
        if len(self.tally.wrong_examples) < 10:
            self.tally.wrong_examples.append(f"{model} M={m} K={k} {formula} shape {list(y.shape)}: matches none "
                                             f"of the live versions {sorted(versions)}")

    # -- the load ------------------------------------------------------------------------------
    def _matmul_request(self, model: str, m: int, k: int, npy: bool) -> bytes:
        x = self.xs[(m, k)]
        if npy:
            buf = io.BytesIO()
            np.save(buf, x)
            return request_bytes("POST", f"{self.url}/v1/matmul?model={model}&tensor=w",
                                 {"Content-Type": "application/x-npy", "Accept": "application/x-npy"},
                                 buf.getvalue())[2]
        body = orjson.dumps({"model": model, "tensor": "w", "activations": x}, option=orjson.OPT_SERIALIZE_NUMPY)
        return request_bytes("POST", f"{self.url}/v1/matmul", {"Content-Type": "application/json"}, body)[2]

    async def client(self, i: int, end: float) -> None:
        rng = random.Random(self.plan.seed * 1000 + i)
        conn = Connection(self.host, self.port, b"")
        requests = {(model, m, k, npy): self._matmul_request(model, m, k, npy)
                    for model, k in (("soak", 256), ("soak", 512), ("steady", 256)) for m in MS for npy in (0, 1)}
        keys = list(requests)
        while time.time() < end:
            model, m, k, npy = key = rng.choice(keys)
            t0 = time.time()
            try:
                status, headers, body = await conn.send(requests[key])
            except Exception as exc:
                conn.close()
                self.tally.resets += 1
                name = type(exc).__name__
                self.tally.reset_kinds[name] = self.tally.reset_kinds.get(name, 0) + 1
                continue
            t1 = time.time()
            self.tally.status("matmul", status, body)
            if status != 200:
                continue
            if npy:
                y = np.load(io.BytesIO(body)).astype(np.float64)
                formula = headers.get("x-qgemm-activation-format", "")
            else:
                answer = orjson.loads(body)
                y, formula = np.asarray(answer["output"], np.float64), answer["activation_format"]
            self.check(model, m, k, y, formula, t0, t1)
        conn.close()

    async def control(self, end: float) -> None:
        """Load, unload, list and look at models the whole time, as an operator would."""
        conn = Connection(self.host, self.port, b"")
        calls = [("POST", "/v1/models/steady/load"), ("POST", "/v1/models/soak/load"),
                 ("POST", "/v1/models/soak/unload"), ("GET", "/v1/models"), ("GET", "/v1/models/soak/tensors/w"),
                 ("POST", "/v1/models/steady/unload")]
        for method, path in itertools.cycle(calls):
            if time.time() >= end:
                break
            req = request_bytes(method, f"{self.url}{path}", {"Content-Type": "application/json"} if method == "POST"
                                else {})[2]
            try:
                status, _, body = await conn.send(req)
                self.tally.status(path.rsplit("/", 1)[-1] if method == "POST" else f"GET {path}", status, body)
            except Exception as exc:
                conn.close()
                self.tally.resets += 1
                name = type(exc).__name__
                self.tally.reset_kinds[name] = self.tally.reset_kinds.get(name, 0) + 1
            await asyncio.sleep(0.1)
        conn.close()

    async def rewriter(self, end: float) -> None:
        path, part = self.models / "soak.gguf", self.models / ".soak-next.gguf"
        version = 0
        for kind in itertools.cycle(KINDS):
            await asyncio.sleep(self.plan.rewrite_every_s)
            if time.time() >= end - 1:
                break
            version = (version + 1) % len(self.versions)
            data = self.versions[version][0]
            begin = time.time()
            if kind in ("in_place", "truncate"):
                if kind == "truncate":
                    os.truncate(path, len(self.versions[version - 1][0]) // 2)
                    await asyncio.sleep(self.plan.gone_s)
                with open(path, "r+b") as fh:  # the same inode: emptied, then written in two halves
                    fh.truncate(0)
                    fh.write(data[: len(data) // 2])
                    fh.flush()
                    await asyncio.sleep(0.05)
                    fh.write(data[len(data) // 2:])
            else:
                if kind == "delete":
                    path.unlink()
                    await asyncio.sleep(self.plan.gone_s)
                part.write_bytes(data)
                os.replace(part, path)
            self.history.add(begin, time.time(), version)
            self.tally.rewrites[kind] = self.tally.rewrites.get(kind, 0) + 1

    async def sampler(self, pid: int, end: float) -> None:
        conn = Connection(self.host, self.port, request_bytes("GET", f"{self.url}/metrics", {})[2])
        while time.time() < end:
            t = time.time()
            self.rss.append((t, _rss_bytes(pid)))
            try:
                status, _, body = await conn.send()
                for line in body.decode().splitlines():
                    if line.startswith("qgemm_gpu_resident_bytes "):
                        self.gpu_bytes.append((t, int(float(line.split()[1]))))
            except Exception:
                conn.close()
            await asyncio.sleep(1.0)
        self.rss.append((time.time(), _rss_bytes(pid)))
        conn.close()

    # -- the run ---------------------------------------------------------------------------------
    def _start_server(self) -> subprocess.Popen:
        self.port = _free_port()
        self.host, self.url = "127.0.0.1", f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "QGEMM_MODELS_DIR": str(self.models), "QGEMM_BACKEND": self.plan.backend,
               "QGEMM_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
        self.log_path = self.workdir / "server.log"
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", self.host, "--port",
                                 str(self.port)], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(self.log_path, "wb"), cwd=Path(__file__).resolve().parent.parent)
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:  # ready: /readyz answers 200 (503 while the engine process starts; /healthz 200 already)
                with socket.create_connection((self.host, self.port), timeout=1) as s:
                    s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        return proc
            except OSError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError("the server was not ready (/readyz) within 180 s")

    async def _run(self, pid: int) -> float:
        start = time.time()
        end = start + self.plan.seconds
        await asyncio.gather(*(self.client(i, end) for i in range(self.plan.clients)), self.control(end),
                             self.rewriter(end), self.sampler(pid, end))
        return time.time() - start

    def run(self) -> dict[str, Any]:
        proc = self._start_server()
        try:
            wall = asyncio.run(self._run(proc.pid))
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        t = self.tally
        fivexx = sum(n for key, n in t.statuses.items() if key.rsplit(" ", 1)[1].startswith("5"))
        log = self.log_path.read_text(errors="replace")
        rss = [b for _, b in self.rss]
        warm = rss[min(len(rss) - 1, max(1, len(rss) // 10))] if rss else 0  # after uploads and first parses
        mib = 1 << 20
        return {
            "plan": vars(self.plan), "wall_s": round(wall, 1), "server_alive": alive,
            "answers": dict(sorted(t.statuses.items())), "requests": sum(t.statuses.values()),
            "5xx": fivexx, "errors_5xx": t.errors_5xx, "resets": t.resets, "reset_kinds": t.reset_kinds,
            "products_checked": t.checked, "wrong_products": t.wrong, "wrong_examples": t.wrong_examples,
            "rewrites": t.rewrites,
            "rss_mib": {"start": round(rss[0] / mib, 1) if rss else None, "warm": round(warm / mib, 1),
                        "end": round(rss[-1] / mib, 1) if rss else None,
                        "max": round(max(rss) / mib, 1) if rss else None},
            "rss_growth_after_warmup_mib": round((rss[-1] - warm) / mib, 1) if rss else None,
            "gpu_resident_mib": {"max": round(max(b for _, b in self.gpu_bytes) / mib, 2),
                                 "end": round(self.gpu_bytes[-1][1] / mib, 2)} if self.gpu_bytes else None,
            "server_log_errors": log.count("unhandled error") + log.count("Traceback"),
        }


def soak(plan: SoakPlan, workdir: Path | None = None) -> dict[str, Any]:
    if workdir is not None:
        return Soak(plan, Path(workdir)).run()
    with tempfile.TemporaryDirectory(prefix="qgemm-soak-") as tmp:
        return Soak(plan, Path(tmp)).run()


def passed(report: dict[str, Any], max_growth_mib: float = 100.0) -> list[str]:
    """What the report fails of the issue's bar (empty: it passes)."""
    fails = []
    if not report["server_alive"]:
        fails.append("the server died")
    for key in ("5xx", "resets", "wrong_products", "server_log_errors"):
        if report[key]:
            fails.append(f"{key}: {report[key]}")
    if not report["products_checked"]:
        fails.append("no product was checked")
    growth = report["rss_growth_after_warmup_mib"]
    if growth is None or growth > max_growth_mib:
        fails.append(f"resident memory grew {growth} MiB after warm-up (limit {max_growth_mib})")
    return fails


def main(args: Any) -> int:
    plan = SoakPlan(backend=args.backend, clients=args.clients, seconds=args.seconds,
                    rewrite_every_s=args.rewrite_every, seed=args.seed)
    report = soak(plan)
    report["verdict"] = passed(report) or "pass"
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if report["verdict"] == "pass" else 1
