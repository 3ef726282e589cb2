"""Clock, board power and energy per product while one product runs for seconds (GPU machine only).

Each of the bench's pairs (quantize + GEMM, or cuBLAS's fp16 cast + GEMM on the dequantized weights)
is captured 200 times in a CUDA graph and replayed for SECONDS while `nvidia-smi` samples the SM clock,
power and clock-event reasons every 50 ms; energy per call = median power x sustained time per call.
The bench's own figures come from short bursts, which the power limit does not reach (the kernel-design report,
"Power"):

    python3 scripts/power_draw.py            # M = 512, N = 4096, K = 4096 and 14336
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the imports that need a GPU
    print(__doc__)
    sys.exit(0)

import argparse
import subprocess
import time
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np
from gguf import GGUFReader

from app.settings import Settings
from kernels.cuda.backend import CudaBackend
from kernels.registry import KERNELS
from models.demo import ensure_demo
from tools.bench import activation_step, timed_ms

M = 512
SECONDS = 3.0
PAIRS = [("mmq", "blk.0.attn_q.weight"), ("mmq", "blk.0.attn_k.weight"), ("mmq_wgmma", "blk.0.attn_q.weight"),
         ("mmq", "blk.0.ffn_down.weight"), ("mmq", "blk.1.ffn_down.weight"),
         ("cublas_f16", "blk.0.attn_q.weight"), ("cublas_f16", "blk.0.ffn_down.weight")]


def bench_pair(backend: CudaBackend, kernel: str, tensor: Any) -> Callable[[], None]:
    """The bench's pair for (kernel, tensor) at M rows: its activation step, then its GEMM."""
    spec, mods = KERNELS[kernel], backend.modules
    type_name, raw = tensor.tensor_type.name, np.asarray(tensor.data)
    n, k = raw.shape[0], int(tensor.shape[0])
    w = spec.weights.make(mods, type_name, raw, n, k)
    x = cupy.asarray(np.random.default_rng(1).standard_normal((M, k)).astype(np.float32))
    prep = activation_step(mods, spec, x, type_name)
    y = cupy.empty((M, n), dtype=cupy.float32)
    return lambda: spec.launch(mods, type_name, w, prep(), y, M, n, k)


def sustained(fn: Callable[[], None]) -> tuple[float, list[list[str]]]:
    """Microseconds per call over SECONDS of graph replays, and nvidia-smi's samples meanwhile."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # outside capture: first-call allocations (cuBLAS's workspace)
        stream.begin_capture()
        for _ in range(200):
            fn()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    t0, calls = time.time(), 0
    start.record(stream)
    while time.time() - t0 < SECONDS:
        for _ in range(20):
            graph.launch(stream)
        calls += 20 * 200
        stream.synchronize()
    stop.record(stream)
    stop.synchronize()
    smi.terminate()
    rows = [r.split(", ") for r in smi.communicate()[0].strip().splitlines()[2:-2]]  # drop ramp-in/out
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls, rows


def main() -> None:
    settings = Settings.from_env(backend="cuda")
    demo, _ = ensure_demo(settings.models_dir)
    tensors = {t.name: t for t in GGUFReader(demo).tensors}
    backend = CudaBackend(settings)
    args = argparse.Namespace(reps=20, warmup=3)
    jobs: dict[str, Callable[[], None]] = {}
    with backend.stream:
        for kernel, name in PAIRS:
            t = tensors[name]
            jobs[f"{kernel} {t.tensor_type.name} K={int(t.shape[0])}"] = bench_pair(backend, kernel, t)
        print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, M={M}, N=4096, {SECONDS:.0f} s each")
        for label, fn in jobs.items():
            burst, _ = timed_ms(cupy, lambda i, fn=fn: fn(), args, 1)
            us, rows = sustained(fn)
            clock, power = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
            capped = any(int(r[2], 16) & 0x4 for r in rows)  # SW power cap
            watts = float(np.median(power))
            print(f"{label:24s} bench {burst * 1e3:7.1f} us, sustained {us:7.1f} us, "
                  f"SM clock {np.median(clock):.0f} MHz [{min(clock):.0f}-{max(clock):.0f}], "
                  f"{watts:.0f} W{' (power cap)' if capped else ''}, {watts * us * 1e-3:.1f} mJ a call", flush=True)
            time.sleep(2)


if __name__ == "__main__":
    main()
