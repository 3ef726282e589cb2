"""Several devices on the GPU: split and replicated tensors through the CUDA workers.  On a one-GPU machine a
second worker shares the device (its own stream, modules and budget), which runs every code path but the
second GPU; with two GPUs the tests use both, go through POST .../load, and QGEMM_DEVBENCH_OUT=<file> also
measures issue #25's targets (engine-level: no HTTP; median of timed runs after a warm-up) into that file."""

from __future__ import annotations

import asyncio
import io
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_client, stream_seed

pytestmark = pytest.mark.gpu

try:
    import cupy

    GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:
    GPUS = 0
if not GPUS:
    pytest.skip("needs a CUDA device through CuPy", allow_module_level=True)

MODEL = "demo"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from models.demo import ensure_demo

    d = tmp_path_factory.mktemp("models")
    ensure_demo(d)
    with make_client(d, backend="cuda") as c:
        _two_workers(c.app.state.engine)
        yield c


def _two_workers(engine: object) -> bool:
    """On one GPU, a second worker of its own (stream, modules, budget) on the same device; True if added."""
    from app.workers import Worker
    from kernels.cuda.backend import CudaBackend

    if len(engine.pools["cuda"]) >= 2:
        return False
    s = engine.settings
    engine.pools["cuda"].append(Worker(CudaBackend(s, device=0), engine._run_batch, s.batch_max_rows,
                                       s.batch_wait_us))
    return True


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(b.astype(np.float64) ** 2))


def _post(c: object, tensor: str, x: np.ndarray, kernel: str) -> dict:
    """X as .npy (a JSON body of M = 300 rows of K = 14336 is past QGEMM_MAX_JSON_BODY_BYTES), the answer as JSON."""
    body = io.BytesIO()
    np.save(body, np.ascontiguousarray(x, dtype=np.float32))
    r = c.post("/v1/matmul", params={"model": MODEL, "tensor": tensor, "kernel": kernel}, content=body.getvalue(),
               headers={"Content-Type": "application/x-npy"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kernel,m", [("gemv", 1), ("mmq", 64), ("auto", 300)])
def test_a_split_tensor_equals_the_whole(two_workers: object, kernel: str, m: int) -> None:
    c, name = two_workers, "blk.0.ffn_down.weight"  # [4096, 14336] Q4_0
    engine = c.app.state.engine
    model = next(mm for mm in c.app.state.store.scan() if mm.id == MODEL)
    info = model.tensors[name]
    x = np.random.default_rng(stream_seed(f"split {kernel} {m}")).standard_normal((m, 14336)).astype(np.float32)
    engine.place("cuda", model, info, None, [0], "replicate")
    whole = _post(c, name, x, kernel)
    assert whole["devices"] == [engine.pools["cuda"][0].label]
    engine.place("cuda", model, info, None, [0, 1], "split")
    split = _post(c, name, x, kernel)
    assert len(split["devices"]) == 2
    # the same kernel on each block of rows: equal up to the order split-K kernels sum in (bits where none);
    # auto may pick another kernel for half the rows: then the two formulas' distance, far below Q8_1's error
    same = split["kernel"] == whole["kernel"]
    assert same or kernel == "auto"
    bound = 1e-10 if same else 1e-6
    assert _nmse(np.asarray(split["output"], np.float32), np.asarray(whole["output"], np.float64)) < bound


def test_a_replicated_tensor_runs_on_both_workers(two_workers: object) -> None:
    c, name = two_workers, "blk.0.attn_q.weight"
    engine = c.app.state.engine
    model = next(mm for mm in c.app.state.store.scan() if mm.id == MODEL)
    engine.place("cuda", model, model.tensors[name], None, [0, 1], "replicate")
    before = [w.products for w in engine.pools["cuda"][:2]]
    xs = [np.random.default_rng(stream_seed(f"replicas {i}")).standard_normal((1 + i % 4, 4096)).astype(np.float32)
          for i in range(32)]

    async def all_at_once() -> list:
        return await asyncio.gather(*(engine.matmul(model, model.tensors[name], x, "auto") for x in xs))

    answers = c.portal.call(all_at_once)  # on the app's own event loop
    after = [w.products for w in engine.pools["cuda"][:2]]
    assert all(b > a for a, b in zip(before, after, strict=True))  # both devices ran products
    assert {tuple(a.devices) for a in answers} == {(engine.pools["cuda"][0].label,), (engine.pools["cuda"][1].label,)}


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_two_gpus_through_the_api(two_workers: object) -> None:
    c = two_workers
    health = c.get("/healthz").json()
    assert [d["device"] for d in health["devices"] if d["backend"] == "cuda"][:2] == ["cuda:0", "cuda:1"]
    r = c.post(f"/v1/models/{MODEL}/load", json={"tensors": ["blk.0.attn_q.weight"], "devices": [0, 1],
                                                 "placement": "split"})
    assert r.status_code == 200, r.text
    assert {t["device"] for t in r.json()["loaded"]} == {"cuda:0", "cuda:1"}
    x = np.random.default_rng(stream_seed("two gpus")).standard_normal((3, 4096)).astype(np.float32)
    assert _post(c, "blk.0.attn_q.weight", x, "auto")["devices"] == ["cuda:0", "cuda:1"]
    metrics = c.get("/metrics").text
    assert 'qgemm_device_resident_bytes{device="cuda:1"}' in metrics


@pytest.mark.skipif(not os.environ.get("QGEMM_DEVBENCH_OUT"), reason="measures only when QGEMM_DEVBENCH_OUT is set")
def test_measure_the_two_gpu_targets(tmp_path: Path) -> None:
    """Issue #25's targets, engine-level: (1) two tensors under load, one per device, against both on one
    device (requests/s of 64 concurrent clients, at M = 1, 16 and 128); (2) a split [28672, 8192] Q4_0 at
    M = 512 against the whole on one device (median wall time of the product, X in and Y out included, and
    its GPU time).  On one GPU a second worker shares it: a dry run of the measurement, not a figure."""
    from gguf import GGMLQuantizationType as T

    from models.demo import write_gguf

    rng = np.random.default_rng(25)

    def q4_0(rows: int, cols: int) -> np.ndarray:  # random blocks with a sane scale: quick to write, real bits
        blocks = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
        blocks[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return blocks.reshape(rows, -1)

    write_gguf(tmp_path / "big.gguf", [("big.weight", T.Q4_0, q4_0(28672, 8192))]
               + [(f"{n}{i}.weight", T.Q4_0, q4_0(r, 4096)) for n, r in (("a", 4096), ("c", 14336))
                  for i in (0, 1)])
    out: dict[str, object] = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "date": time.strftime("%Y-%m-%d"),
                              "method": "engine-level (no HTTP): 64 concurrent clients, a 2 s warm-up, then 3 rounds "
                                        "of 2 s on one device and 2 s on two, alternated (medians; every round "
                                        "in 'rounds'); products: median of 10 after 3"}
    with make_client(tmp_path, backend="cuda") as c:
        engine = c.app.state.engine
        if _two_workers(engine):
            out["device"] = f"{out['device']} (one GPU, two workers: a dry run)"
        model = next(m for m in c.app.state.store.scan() if m.id == "big")
        big = model.tensors["big.weight"]

        def throughput(t0: object, t1: object, m: int, devices_1: list[int], seconds: float = 2.0,
                       warm: bool = False) -> float:
            """Products per second of 64 clients, half on each tensor; t0 on device 0, t1 where told."""
            engine.place("cuda", model, t0, None, [0], "replicate")
            engine.place("cuda", model, t1, None, devices_1, "replicate")
            x = rng.standard_normal((m, 4096)).astype(np.float32)

            async def drive() -> int:
                end, done = time.perf_counter() + seconds, 0

                async def client(t: object) -> None:
                    nonlocal done
                    while time.perf_counter() < end:
                        await engine.matmul(model, t, x, "auto")
                        done += 1
                await asyncio.gather(*(client(t1 if i % 2 else t0) for i in range(64)))
                return done
            if warm:
                c.portal.call(drive)
            return c.portal.call(drive) / seconds

        load = {}
        for name, m in (("a", 1), ("c", 16), ("c", 128)):
            t0, t1 = model.tensors[f"{name}0.weight"], model.tensors[f"{name}1.weight"]
            throughput(t0, t1, m, [0], warm=True)
            rounds = [(throughput(t0, t1, m, [0]), throughput(t0, t1, m, [1])) for _ in range(3)]
            one, two = (statistics.median(r[i] for r in rounds) for i in (0, 1))
            load[f"{list(t0.shape)} Q4_0 M={m}"] = {"one_device": round(one), "two_devices": round(two),
                                                    "speedup": round(two / one, 2),
                                                    "rounds": [[round(a), round(b)] for a, b in rounds]}
        out["two_tensors_requests_per_s"] = load
        x512 = rng.standard_normal((512, 8192)).astype(np.float32)

        steps: dict[str, dict[str, float]] = {}

        def product_ms(devices: list[int], how: str) -> tuple[float, float]:
            """Median wall time of the whole product (X in, Y out, the join), and of its GPU steps alone
            (quantize + GEMM by CUDA events; a split's slowest part); each step's median into `steps`."""
            engine.place("cuda", model, big, None, devices, how)
            wall, gpu, timings = [], [], []
            for i in range(13):
                t0 = time.perf_counter()
                answer = c.portal.call(engine.matmul, model, big, x512, "auto")
                if i >= 3:
                    wall.append((time.perf_counter() - t0) * 1e3)
                    gpu.append(answer.result.timing_ms["quantize"] + answer.result.timing_ms["gemm"])
                    timings.append(answer.result.timing_ms)
            steps[how] = {k: round(statistics.median(t[k] for t in timings), 3)
                          for k in ("upload", "quantize", "gemm", "download")}
            return statistics.median(wall), statistics.median(gpu)

        (whole, whole_gpu), (split, split_gpu) = product_ms([0], "replicate"), product_ms([0, 1], "split")
        out["split_28672x8192_q4_0_m512_steps_ms"] = {"one_device": steps["replicate"], "split_two": steps["split"]}
        out["split_28672x8192_q4_0_m512_ms"] = {"one_device": round(whole, 3), "split_two": round(split, 3),
                                                "speedup": round(whole / split, 2)}
        out["split_28672x8192_q4_0_m512_gpu_ms"] = {"one_device": round(whole_gpu, 3),
                                                    "split_two": round(split_gpu, 3),
                                                    "speedup": round(whole_gpu / split_gpu, 2)}
    Path(os.environ["QGEMM_DEVBENCH_OUT"]).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
