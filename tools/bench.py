"""`qgemm bench`: every available GPU kernel on the seeds' shapes, timed with CUDA events.

Method: weights from the demo model (real GGUF blocks), uploaded in each kernel's layout; per
(kernel, M) warm-up calls, then back-to-back calls captured in a CUDA graph and replayed between a pair
of events (median per call); a call that cannot be captured is timed with a pair of events per call,
and the report names those kernels.  Weights rotate among enough copies to exceed L2 three times over
(HBM figure); a same-buffer figure (weights from L2 where they fit, as llama.cpp times itself) is taken
beside it.  Quantize (FP32 -> Q8_1, or the cast for fp16) + GEMM are timed together as one pair, and
apart beside it.  NMSE is against the FP64 product of the dequantized weights, computed on the GPU.
Compilation happens before timing."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.side_by_side import load_llama_cpp

# cuBLAS fp16 on the same H100 kind, measured 2026-11-21: a reference line where a run has no
# cuBLAS kernel of its own.  llama.cpp's column comes from a file of the same session (--llama-cpp), never from here.
CUBLAS_F16_US = {
    4096: {1: 8.96, 8: 9.86, 32: 18.10, 128: 27.79, 512: 53.31, 2048: 169.47},
    14336: {1: 40.36, 8: 47.46, 32: 60.37, 128: 72.53, 512: 138.76, 2048: 492.38},
}


DEFAULT_M = "1,8,32,128,512,2048"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--types", default="Q4_0,Q8_0")
    p.add_argument("--k", default="4096,14336")
    p.add_argument("--m", default=None, help=f"rows of X, comma-separated (default {DEFAULT_M}; with --model 1,8,512)")
    p.add_argument("--kernels", default="", help="comma-separated (default: every available CUDA kernel)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md, bench.png (model-bench.json "
                                                      "and model-bench.md with --model)")
    p.add_argument("--model", default=None, metavar="FILE",
                   help="time every matmul tensor of this GGUF file with auto's kernels instead "
                        "(tools/model_bench.py): per tensor, per block and for the model; --llama-cpp then takes "
                        "`qgemm ggml perf --model FILE`'s output")
    p.add_argument("--times", default=None, metavar="JSON",
                   help="with --model: summarise from model-bench.json files measured before in one session "
                        "(comma-separated: on the file, or on cuts of it that hold its shapes) instead of timing; "
                        "no GPU needed")
    p.add_argument("--tune", action="store_true", help="also write the auto table (kernels/tuning/table.json)")
    p.add_argument("--llama-cpp", default=None, metavar="FILE",
                   help="llama.cpp's times for the llama.cpp column: test-backend-ops perf -o MUL_MAT output of the "
                        "same machine session, or a side-by-side.json (tools/side_by_side.py)")


def _median_ms(cupy: Any, fn: Any, reps: int, warmup: int, rotate: int) -> float:
    for i in range(warmup):
        fn(i % rotate)
    evs = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    s = cupy.cuda.get_current_stream()
    for i, (a, b) in enumerate(evs):
        a.record(s)
        fn(i % rotate)
        b.record(s)
    evs[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) for a, b in evs)


def _graph_ms(cupy: Any, fn: Any, reps: int, rotate: int, replays: int = 20) -> float | None:
    """Capture `reps` back-to-back calls (rotating buffers) in a CUDA graph and time its replays: the
    per-call figure free of Python launch cost, as llama.cpp times a repeated op.  None if the calls
    cannot be captured (they allocate)."""
    s = cupy.cuda.get_current_stream()
    try:
        s.begin_capture()
        try:
            for i in range(reps):
                fn(i % rotate)
        finally:
            graph = s.end_capture()
    except Exception:
        return None
    graph.launch(s)
    s.synchronize()
    times = []
    for _ in range(replays):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(s)
        graph.launch(s)
        b.record(s)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) / reps)
    return statistics.median(times)


def timed_ms(cupy: Any, fn: Any, args: argparse.Namespace, rotate: int) -> tuple[float, str]:
    """Median per-call time: from CUDA-graph replays where the calls can be captured, else from one pair
    of events per call.  Slow calls (over 2 ms) go into graphs of fewer calls to bound the bench's time."""
    probe = _median_ms(cupy, fn, 3, args.warmup, rotate)
    reps = max(1, min(args.reps, int(2.0 / max(probe, 1e-3))))
    graph = _graph_ms(cupy, fn, reps, rotate, replays=args.reps)
    if graph is not None:
        return graph, "graph"
    return _median_ms(cupy, fn, args.reps, args.warmup, rotate), "events"


def copy_bandwidth(cupy: Any) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (the HBM ceiling we measure)."""
    n = 1 << 30
    src = cupy.empty(n, dtype=cupy.uint8)
    src.fill(1)
    dst = cupy.empty_like(src)
    ms = _median_ms(cupy, lambda i: cupy.copyto(dst, src), 10, 2, 1)
    return 2 * n / (ms * 1e-3)


READ_LOADS = (4, 8, 16)  # peak.cu read_only_u<U>: 16-byte loads a thread in flight; the least time counts


def read_only_ms(cupy: Any, mods: Any, nbytes: int, l2_bytes: int, args: argparse.Namespace) -> float:
    """The time a kernel that only reads `nbytes` (peak.cu read_only_u<U>) takes back to back, on copies rotated to
    fill L2 three times as the weights are: the least a one-launch product of that many weight bytes can take here,
    ramp, tail and launch gap included (copy bandwidth, over 1 GiB, leaves them out).  The least of a few U."""
    import numpy as np

    n16 = max(1, nbytes // 16)
    copies = max(2, math.ceil(3 * l2_bytes / (16 * n16)))
    bufs = [cupy.full(4 * n16, i + 1, dtype=cupy.int32) for i in range(copies)]
    best = math.inf
    for u in READ_LOADS:
        grid = -(-n16 // (256 * u))
        out = cupy.empty(grid, dtype=cupy.uint32)
        fn = mods.function("peak.cu", f"read_only_u{u}")
        ms, _ = timed_ms(cupy, lambda i, f=fn, g=grid, o=out: f((g,), (256,), (bufs[i], np.int64(n16), o)), args,
                         copies)
        best = min(best, ms)
    return best


def activation_step(mods: Any, spec: Any, x: Any, type_name: str) -> Callable[[], Any]:
    """The activation work timed with each GEMM (llama.cpp's times include it): Q8_1 quantization into the
    kernel's layout, the fp16 / bf16 cast of the cuBLAS kernels, or nothing.  Buffers are made here, beforehand:
    graphs cannot allocate."""
    layout = spec.activations_for(type_name)
    bufs = layout.buffers(*x.shape)
    return lambda: layout.fill(mods, x, bufs)


def bnb_us(values: Any, quant_type: str, x: Any, rotate_bytes: int, reps: int) -> float | None:
    """bitsandbytes' own product of the same values (quantize_4bit, blocksize 64), timed the way ours is: calls on
    rotating weight copies (3x L2) captured in a CUDA graph (torch's), the median replay per call.  M = 1:
    gemv_4bit with fp32 activations (its kernel for one row); above: dequantize_4bit + torch.matmul, as its
    matmul_4bit runs a batch.  None where PyTorch or bitsandbytes is missing."""
    try:
        import torch
        from bitsandbytes import functional as F
    except ImportError:
        return None
    w = torch.from_numpy(values).cuda()
    qb, state = F.quantize_4bit(w, blocksize=64, quant_type=quant_type)
    copies = max(2, math.ceil(rotate_bytes / (qb.numel() + state.absmax.numel() * 4)))
    bank = [(qb.clone(), F.QuantState(absmax=state.absmax.clone(), shape=state.shape, dtype=state.dtype,
                                      blocksize=64, code=state.code, quant_type=quant_type)) for _ in range(copies)]
    xt = torch.from_numpy(x.get() if hasattr(x, "get") else x).cuda()

    def call(i: int) -> Any:
        b, st = bank[i % copies]
        if xt.shape[0] == 1:
            return F.gemv_4bit(xt, b.t(), state=st)
        return xt @ F.dequantize_4bit(b, st).t()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            call(i)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(reps):
                call(i)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            graph.replay()
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) / reps)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace, llama: dict[tuple[str, int, int], float]) -> dict[str, Any]:
    """Every kernel on every (type, K, M) of `args`; `llama`: llama.cpp's µs by (type, K, M) for its column."""
    import cupy
    import numpy as np
    from gguf import GGUFReader

    from app.settings import Settings
    from kernels.cuda import layouts
    from kernels.cuda.backend import CudaBackend
    from kernels.formats import BNB4_TYPES
    from kernels.reference import dequantize_weights
    from kernels.registry import KERNELS
    from kernels.requant import Scheme, requantize
    from kernels.tuning import peak_int8_tops
    from models.demo import BENCH_TENSORS, ensure_demo

    settings = Settings.from_env(backend="cuda")
    demo, _ = ensure_demo(settings.models_dir)
    reader = GGUFReader(demo)
    tensors = {t.name: t for t in reader.tensors}
    backend = CudaBackend(settings)
    mods = backend.modules
    names = [n for n in (args.kernels.split(",") if args.kernels else KERNELS) if KERNELS[n].backend == "cuda"]
    names = [n for n in names if backend.kernel_reason(KERNELS[n]) is None]
    ms_list = [int(x) for x in (args.m or DEFAULT_M).split(",")]
    rows: list[dict[str, Any]] = []

    def work() -> dict[str, Any]:
        with backend.stream:
            bw = copy_bandwidth(cupy)
            peak = peak_int8_tops(cupy, mods)
            for type_name in args.types.split(","):
                for k in (int(x) for x in args.k.split(",")):
                    # NF4/FP4: the Q4_0 benchmark tensor's values, requantized (blocksize 64)
                    source = ("Q4_0", k) if type_name in BNB4_TYPES else (type_name, k)
                    if source not in BENCH_TENSORS:
                        print(f"{type_name} K={k}: the demo holds no benchmark tensor of it, skipped", flush=True)
                        continue
                    t = tensors[BENCH_TENSORS[source]]
                    raw = np.asarray(t.data)
                    values = None
                    if type_name in BNB4_TYPES:
                        values = dequantize_weights(source[0], raw)
                        raw = requantize(values, Scheme(type_name.lower()))
                    n = raw.shape[0]
                    wbytes = raw.nbytes
                    read_us = read_only_ms(cupy, mods, wbytes, backend.l2_bytes, args) * 1e3
                    print(f"{type_name} K={k:<5} read-only {read_us:9.2f} µs "
                          f"({wbytes / read_us / 1e3:.0f} GB/s) from HBM", flush=True)
                    w32 = layouts.F32.make(mods, type_name, raw, n, k)["w"].astype(cupy.float64)
                    made: dict[str, list[dict]] = {}  # each weight layout's rotating copies
                    for name in names:
                        lay = KERNELS[name].weights
                        if type_name in KERNELS[name].weight_types and lay.name not in made:
                            one = lay.make(mods, type_name, raw, n, k)
                            size = sum(int(a.nbytes) for a in one.values())
                            copies = max(2, math.ceil(3 * backend.l2_bytes / size))
                            more = [{key: a.copy() for key, a in one.items()} for _ in range(copies - 1)]
                            made[lay.name] = [one, *more]
                    for m in ms_list:
                        rng = np.random.default_rng()
                        x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float32))
                        want = x.astype(cupy.float64) @ w32.T
                        y = cupy.empty((m, n), dtype=cupy.float32)
                        picked = backend.auto(type_name, m, n, k)
                        for name in names:
                            spec = KERNELS[name]
                            if spec.can_run(type_name, m, n, k, backend.cc):
                                continue
                            copies = made[spec.weights.name]
                            prep = activation_step(mods, spec, x, type_name)
                            acts = prep()

                            def gemm(i: int, spec=spec, copies=copies, acts=acts, y=y, t=type_name, m=m, n=n,
                                     k=k) -> None:
                                spec.launch(mods, t, copies[i], acts, y, m, n, k)

                            def pair(i: int, spec=spec, copies=copies, y=y, t=type_name, m=m, n=n, k=k,
                                     prep=prep) -> None:
                                spec.launch(mods, t, copies[i], prep(), y, m, n, k)

                            y.fill(cupy.nan)
                            gemm(0)
                            err = float(cupy.sum((y.astype(cupy.float64) - want) ** 2) / cupy.sum(want**2))
                            qms, _ = timed_ms(cupy, lambda i, prep=prep: prep(), args, 1)
                            rot, _ = timed_ms(cupy, gemm, args, len(copies))
                            total, method = timed_ms(cupy, pair, args, len(copies))
                            total_same, _ = timed_ms(cupy, pair, args, 1)
                            moved = wbytes + m * k * 4 + m * n * 4
                            rows.append({
                                "type": type_name, "K": k, "N": n, "M": m, "kernel": name, "timing": method,
                                "auto_kernel": picked.name if picked is not None else None,
                                "quantize_us": qms * 1e3, "gemm_us": rot * 1e3, "total_us": total * 1e3,
                                "total_same_us": total_same * 1e3,
                                "tops": 2 * m * n * k / (total * 1e-3) / 1e12,
                                "gbps": moved / (total * 1e-3) / 1e9, "nmse": err,
                                "bw_share": moved / (total * 1e-3) / bw,
                                "mma_share": 2 * m * n * k / (total * 1e-3) / (peak * 1e12),
                                "floor_us": max(moved / bw, 2 * m * n * k / (peak * 1e12)) * 1e6,
                                "read_only_us": read_us,
                                "llama_cpp_us": llama.get((type_name, k, m)),
                                "cublas_f16_anchor_us": CUBLAS_F16_US.get(k, {}).get(m),
                                "bitsandbytes_us": None,
                            })
                            print(f"{type_name} K={k:<5} M={m:<4} {name:<12} total {total * 1e3:9.1f} µs "
                                  f"(same buffer {total_same * 1e3:9.1f})  NMSE {err:.2e}", flush=True)
                        if values is not None:  # bitsandbytes' own product beside ours, the same run and method
                            theirs = bnb_us(values, type_name.lower(), x, 3 * backend.l2_bytes, args.reps)
                            for r in rows:
                                if (r["type"], r["K"], r["M"]) == (type_name, k, m):
                                    r["bitsandbytes_us"] = theirs
                            print(f"{type_name} K={k:<5} M={m:<4} bitsandbytes {theirs} µs", flush=True)
                    del made, w32
                    cupy.get_default_memory_pool().free_all_blocks()
        return {"bw": bw, "peak": peak}

    ceilings = backend._call(work)
    naive = {(r["type"], r["K"], r["M"]): r["total_us"] for r in rows if r["kernel"] == "naive"}
    for r in rows:
        base = naive.get((r["type"], r["K"], r["M"]))
        r["speedup_vs_naive"] = base / r["total_us"] if base else None
    backend.close()
    return {
        "device": backend.device_name, "compute_capability": backend.cc, "sm_count": backend.sm_count,
        "l2_bytes": backend.l2_bytes, "date": datetime.date.today().isoformat(),
        "copy_bandwidth_gbps": ceilings["bw"] / 1e9, "int8_mma_peak_tops": ceilings["peak"],
        "reps": args.reps, "warmup": args.warmup, "compile_ms": backend.compile_ms, "rows": rows,
        "llama_cpp_source": args.llama_cpp,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| type | K | M | kernel | quantize µs | GEMM µs | total µs (HBM) | total µs (same buffer) | "
             "read-only µs (HBM) | llama.cpp µs | vs llama.cpp | TOPS | GB/s | share of bound | × naive | NMSE |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        llama = r["llama_cpp_us"]
        ratio = f"{llama / r['total_same_us']:.2f}x" if llama else ""
        sp = f"{r['speedup_vs_naive']:.1f}" if r["speedup_vs_naive"] else ""
        lines.append(f"| {r['type']} | {r['K']} | {r['M']} | {r['kernel']} | {r['quantize_us']:.1f} | "
                     f"{r['gemm_us']:.1f} | {r['total_us']:.1f} | {r['total_same_us']:.1f} | "
                     f"{_us(r.get('read_only_us'))} | {llama if llama else ''} | {ratio} | {r['tops']:.1f} | "
                     f"{r['gbps']:.0f} | "
                     f"{100 * r['floor_us'] / r['total_us']:.0f}% | {sp} | {r['nmse']:.1e} |")
    return "\n".join(lines)


def _us(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else ""


def _timing_note(result: dict[str, Any]) -> str:
    """Which kernels, if any, could not be captured in a graph and were timed call by call."""
    names = sorted({r["kernel"] for r in result["rows"] if r.get("timing") == "events"})
    if not names:
        return "Every row, the cuBLAS baselines included, was timed this way."
    return (f"Not capturable, so timed with a pair of events per call (their figures include Python's launch "
            f"cost): {', '.join(f'`{n}`' for n in names)}.")


def _llama_note(result: dict[str, Any]) -> str:
    source = result.get("llama_cpp_source")
    if not source:
        return "none given (`--llama-cpp FILE`: `qgemm ggml perf`'s output of the same machine session)."
    return (f"`{source}` (ggml's test-backend-ops perf -o MUL_MAT, same buffers), which must come from the same "
            "machine session to compare.")


def report(result: dict[str, Any], picture: str = "benchmarks.png") -> str:
    """The bench's report (bench.md): device, date, method, ceilings, the table and the picture."""
    return f"""# Benchmarks

Device: **{result['device']}** (compute capability {result['compute_capability'] / 10:.1f}, {result['sm_count']} SMs,
{result['l2_bytes'] >> 20} MiB L2), measured {result['date']} with `qgemm bench`.

Method: weights are the demo model's benchmark tensors of each type and K (`models/demo.py`, BENCH_TENSORS;
N=4096), uploaded in each kernel's layout.
Kernels are compiled before timing ({result['compile_ms']:.0f} ms at start-up). Per (kernel, M): warm-up
runs, then {result['reps']} back-to-back calls captured in a CUDA graph, replayed {result['reps']} times between CUDA
events; the figure is the median replay over the calls in it (calls slower than 2 ms go into graphs of fewer
calls). Graphs keep CuPy's Python launch cost out of the figures, as llama.cpp's C++ repeats its op.
{_timing_note(result)} "HBM"
rotates the weights among enough copies to fill L2 three times over; "same buffer" reuses one copy, as
llama.cpp's `test-backend-ops` times itself (so weights that fit in L2 come from L2). The
comparable figure is quantize (FP32 to Q8_1 on the device, or the fp16 cast) + GEMM, timed together as
one back-to-back pair (quantize and GEMM alone are reported beside it). NMSE is against the
FP64 product of the dequantized weights. Ceilings measured in the same run: device-to-device copy
{result['copy_bandwidth_gbps']:.0f} GB/s (read + write), int8 `mma.sync` loop {result['int8_mma_peak_tops']:.0f} TOPS.
"Share of bound" is max(bytes / copy bandwidth, ops / mma peak) over the measured time (HBM figure).
"Read-only" is a kernel that only reads the weights' bytes (16-byte loads), timed the same way on rotating copies:
the least a one-launch product of that size takes on this GPU, its ramp, tail and launch gap included.

llama.cpp's figures: {_llama_note(result)}

![time per kernel per M]({picture})

{table(result)}
"""


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["type"], r["K"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 5), squeeze=False)
    for ax, (t, k) in zip(axes[0], keys, strict=True):
        rows = [r for r in result["rows"] if r["type"] == t and r["K"] == k]
        for name in dict.fromkeys(r["kernel"] for r in rows):
            pts = sorted((r["M"], r["total_us"]) for r in rows if r["kernel"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        floor = sorted({(r["M"], r["floor_us"]) for r in rows})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="roofline floor")
        llama = sorted({(r["M"], r["llama_cpp_us"]) for r in rows if r["llama_cpp_us"]})
        ax.plot([p[0] for p in llama], [p[1] for p in llama], "kx", markersize=9, label="llama.cpp (same buffer)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (rows of X)")
        ax.set_ylabel("µs (quantize + GEMM, rotating weights)")
        ax.set_title(f"{t}, N=4096, K={k}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"qgemm on {result['device']} ({result['date']}); copy {result['copy_bandwidth_gbps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    if args.model:
        from tools.model_bench import main as model_main

        return model_main(args)
    try:  # a bad file is said before any GPU work
        llama = load_llama_cpp(args.llama_cpp) if args.llama_cpp else {}
    except (OSError, ValueError) as exc:
        print(f"qgemm bench: --llama-cpp: {exc}")
        return 2
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("qgemm bench needs CuPy and a GPU (pip install -e '.[cuda]')")
        return 2
    result = run(args, llama)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (out / "bench.md").write_text(report(result, "bench.png"))
    try:
        plot(result, out / "bench.png")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install -e '.[bench]')")
    if args.tune:
        from kernels.tuning import write_table

        write_table(result)
        write_table(result, out / "table.json")
    print(md)
    print(f"\ndevice {result['device']}, copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s, "
          f"int8 mma peak {result['int8_mma_peak_tops']:.0f} TOPS")
    return 0
