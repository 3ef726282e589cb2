"""`qgemm bench --model FILE`: a real model's matmuls, timed with the kernels `auto` picks (what the service runs).

Every matmul tensor of the GGUF file, at each M (default 1, 8 and 512): quantize (FP32 to Q8_1 on the device, or the
cast) + GEMM as one pair, captured in a CUDA graph and replayed between CUDA events (tools/bench.py's method), with
the weights rotating among enough copies to fill L2 three times over ("HBM": what a decode step of a model larger
than L2 sees) and from one buffer ("same buffer": as llama.cpp's test-backend-ops times itself).  The time depends on
the tensor's type and shape, not its values, so each distinct (type, N, K) is timed once, on the first tensor of that
shape, and every tensor of that shape is given its time.  The rows are summed for the file, its blocks (`blk.N.`)
and the rest.  `--times model-bench.json` summarises a file from times measured before, on it or on a cut of it that
holds each of its shapes (models/cut.py: a GPU machine without the whole file), without a GPU.  `--llama-cpp` takes
`qgemm ggml perf --model FILE`'s output of the same machine session, so that each shape has llama.cpp's time beside
ours.

Which bound a tensor meets: "bandwidth" where its bytes at the copy bandwidth of the same run take at least
LAUNCH_BOUND_US, else "launch" (a small tensor's time is the fixed cost of a launch or two, not its bytes).  Each row
also holds `read_only_us`, the time a kernel that only reads the tensor's bytes takes the same way (tools/bench.py
read_only_ms): the least a one-launch product of it can take on that GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from tools.side_by_side import parse_perf_shapes

LAUNCH_BOUND_US = 4.0  # below this many µs of bytes at copy bandwidth, a product's time is its launches'
BLOCK = re.compile(r"^blk\.(\d+)\.")

Shape = tuple[str, int, int]  # (type, N, K)


def matmul_tensors(model: Any) -> dict[Shape, list[str]]:
    """Every matmul tensor's name, by (type, N, K), in the file's order."""
    shapes: dict[Shape, list[str]] = defaultdict(list)
    for name, t in model.tensors.items():
        if t.matmul and not t.matmul_reason:
            shapes[(t.type_name, t.shape[0], t.shape[1])].append(name)
    return dict(shapes)


def block_count(model: Any) -> int | None:
    """The model's layer count from its metadata (`{arch}.block_count`), or None."""
    arch = model.architecture
    value = model.index.metadata.get(f"{arch}.block_count") if arch and model.index is not None else None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def time_shapes(model: Any, shapes: dict[Shape, list[str]], ms: list[int], reps: int, warmup: int) -> dict[str, Any]:
    """Each shape at each M with auto's kernel: µs from HBM and from one buffer (tools/bench.py's timing)."""
    import cupy
    import numpy as np

    from app.settings import Settings
    from kernels.cuda.backend import CudaBackend
    from kernels.select import KernelChooser
    from tools.bench import activation_step, copy_bandwidth, read_only_ms, timed_ms

    backend = CudaBackend(Settings.from_env(backend="cuda"))
    chooser = KernelChooser(backend)
    mods = backend.modules
    args = argparse.Namespace(reps=reps, warmup=warmup)
    rows: list[dict[str, Any]] = []

    def work() -> float:
        with backend.stream:
            bw = copy_bandwidth(cupy)
            for (type_name, n, k), names in sorted(shapes.items()):
                raw = model.raw(names[0])
                read_us = read_only_ms(cupy, mods, raw.nbytes, backend.l2_bytes, args) * 1e3
                kernels = {m: chooser.choose("auto", names[0], type_name, m, n, k) for m in ms}
                made: dict[str, list[dict]] = {}
                for kernel in kernels.values():
                    if kernel.weights.name not in made:
                        one = kernel.weights.make(mods, type_name, raw, n, k)
                        size = sum(int(a.nbytes) for a in one.values())
                        copies = max(2, math.ceil(3 * backend.l2_bytes / size))
                        made[kernel.weights.name] = [one, *({key: a.copy() for key, a in one.items()}
                                                            for _ in range(copies - 1))]
                for m in ms:
                    kernel = kernels[m]
                    x = cupy.asarray(np.random.default_rng().standard_normal((m, k)).astype(np.float32))
                    y = cupy.empty((m, n), dtype=cupy.float32)
                    prep = activation_step(mods, kernel, x, type_name)
                    copies = made[kernel.weights.name]

                    def pair(i: int, kernel: Any = kernel, copies: list = copies, y: Any = y,
                             shape: tuple = (type_name, m, n, k), prep: Any = prep) -> None:
                        t, rows, cols, depth = shape
                        kernel.launch(mods, t, copies[i], prep(), y, rows, cols, depth)

                    hbm, method = timed_ms(cupy, pair, args, len(copies))
                    same, _ = timed_ms(cupy, pair, args, 1)
                    moved = raw.nbytes + m * k * 4 + m * n * 4
                    floor_us = moved / bw * 1e6
                    rows.append({"type": type_name, "N": n, "K": k, "M": m, "kernel": kernel.name,
                                 "tensors": len(names), "weight_bytes": int(raw.nbytes), "hbm_us": hbm * 1e3,
                                 "same_us": same * 1e3, "floor_us": floor_us, "bw_share": floor_us / (hbm * 1e3),
                                 "bound": "bandwidth" if floor_us >= LAUNCH_BOUND_US else "launch",
                                 "read_only_us": read_us, "timing": method})
                    print(f"{type_name:<6} [{n:>6}, {k:>6}] M={m:<4} {kernel.name:<14} HBM {hbm * 1e3:8.2f} µs  "
                          f"same buffer {same * 1e3:8.2f} µs  ({100 * floor_us / (hbm * 1e3):.0f}% of copy bandwidth; "
                          f"reading its weights alone {read_us:.2f} µs)", flush=True)
                del made
                cupy.get_default_memory_pool().free_all_blocks()
        return bw

    bw = backend._call(work)
    result = {"device": backend.device_name, "compute_capability": backend.cc, "sm_count": backend.sm_count,
              "l2_bytes": backend.l2_bytes, "copy_bandwidth_gbps": bw / 1e9, "rows": rows}
    backend.close()
    return result


def summarise(model: Any, shapes: dict[Shape, list[str]], result: dict[str, Any],
              llama: dict[tuple[str, int, int, int], float]) -> dict[str, Any]:
    """Per M: the sum over the file's matmul tensors, over its blocks' (and per block, on average) and over the rest;
    ours (HBM and same buffer), the bytes at copy bandwidth, and llama.cpp's where every shape has its time.
    `result`'s rows may come from another file of the same shapes (`--times`)."""
    by_shape = {(r["type"], r["N"], r["K"], r["M"]): r for r in result["rows"]}
    ms = sorted({r["M"] for r in result["rows"]})
    missing = [f"{t} [{n}, {k}] M={m}" for t, n, k in shapes for m in ms if (t, n, k, m) not in by_shape]
    if missing:
        raise ValueError(f"no time for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    rows = []
    for (t, n, k), names in sorted(shapes.items()):
        for m in ms:
            r = {**by_shape[(t, n, k, m)], "tensors": len(names)}
            theirs = llama.get((t.upper(), n, k, m), r.get("llama_cpp_us"))
            r["llama_cpp_us"] = theirs
            r["ratio"] = round(r["same_us"] / theirs, 3) if theirs else None
            rows.append(r)
    by_shape = {(r["type"], r["N"], r["K"], r["M"]): r for r in rows}
    blocks = sorted({int(b.group(1)) for names in shapes.values() for n in names if (b := BLOCK.match(n))})
    totals = {}
    for m in ms:
        sums: dict[str, dict[str, float | None]] = {}
        for part in ("file", "blocks", "outside"):
            total = {"hbm_us": 0.0, "same_us": 0.0, "floor_us": 0.0, "llama_cpp_us": 0.0}
            unknown = False
            for shape, names in shapes.items():
                count = sum(1 for name in names
                            if part == "file" or (BLOCK.match(name) is not None) == (part == "blocks"))
                if count == 0:
                    continue
                r = by_shape[(*shape, m)]
                for key in ("hbm_us", "same_us", "floor_us"):
                    total[key] += count * r[key]
                if r["llama_cpp_us"] is None:
                    unknown = True
                else:
                    total["llama_cpp_us"] += count * r["llama_cpp_us"]
            sums[part] = {**total, "llama_cpp_us": None if unknown else total["llama_cpp_us"]}
        sums["per_block"] = {key: None if v is None or not blocks else v / len(blocks)
                             for key, v in sums["blocks"].items()}
        totals[str(m)] = sums
    return {**{k: v for k, v in result.items() if k != "rows"}, "rows": rows, "model": model.id,
            "file_bytes": model.size_bytes, "blocks_in_file": len(blocks), "block_count": block_count(model),
            "date": result.get("date") or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "method": __doc__.split("\n\n")[1].replace("\n", " "), "totals": totals}


def merged_times(paths: list[str]) -> dict[str, Any]:
    """The rows of several model-bench.json files of one machine session (cuts of one file measured apart)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    devices = {(d["device"], d.get("date", "")[:10]) for d in docs}
    if len(devices) > 1:
        raise ValueError(f"the times come from different devices or days ({sorted(devices)}): they do not compare")
    return {**docs[0], "rows": [r for d in docs for r in d["rows"]]}


def _us(v: float | None) -> str:
    return f"{v:,.1f}" if v is not None else "–"


def report(doc: dict[str, Any]) -> str:
    cut = "" if doc["block_count"] in (None, doc["blocks_in_file"]) else \
        f" (the file holds {doc['blocks_in_file']} of the model's {doc['block_count']} blocks)"
    lines = [f"# {doc['model']}: its matmuls on {doc['device']}", "",
             f"Measured {doc['date']} with `qgemm bench --model`; copy bandwidth {doc['copy_bandwidth_gbps']:.0f} GB/s "
             f"in the same run. Sums over the file's matmul tensors{cut}; a block is the average of its blocks.", "",
             f"Method: {doc['method']}", "",
             "| M | the file (HBM) | its bytes at copy bandwidth | share | the file (same buffer) | llama.cpp (same "
             "buffer) | ratio | a block (HBM) | outside the blocks (HBM) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, t in doc["totals"].items():
        f, ratio = t["file"], ""
        if f["llama_cpp_us"]:
            ratio = f"{f['same_us'] / f['llama_cpp_us']:.2f}x"
        lines.append(f"| {m} | {_us(f['hbm_us'])} µs | {_us(f['floor_us'])} µs | "
                     f"{100 * f['floor_us'] / f['hbm_us']:.0f}% | {_us(f['same_us'])} µs | "
                     f"{_us(f['llama_cpp_us'])} µs | {ratio} | "
                     f"{_us(t['per_block']['hbm_us'])} µs | {_us(t['outside']['hbm_us'])} µs |")
    lines += ["", "| type | N | K | tensors | M | kernel | HBM µs | same buffer µs | share of copy bandwidth | bound "
              "| llama.cpp µs | ratio |", "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['type']} | {r['N']} | {r['K']} | {r['tensors']} | {r['M']} | {r['kernel']} | "
                     f"{r['hbm_us']:.2f} | {r['same_us']:.2f} | {100 * r['bw_share']:.0f}% | {r['bound']} | "
                     f"{_us(r['llama_cpp_us'])} | {r['ratio'] or ''} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    from models.store import ModelStore

    path = Path(args.model)
    if not path.is_file():
        print(f"qgemm bench: --model: {path} is not a file")
        return 2
    try:
        llama = parse_perf_shapes(Path(args.llama_cpp).read_text()) if args.llama_cpp else {}
    except OSError as exc:
        print(f"qgemm bench: --llama-cpp: {exc}")
        return 2
    model = ModelStore(path.parent).get(path.stem)
    if model.status != "ok":
        print(f"qgemm bench: {path} could not be read: {model.error}")
        return 2
    shapes = matmul_tensors(model)
    if not shapes:
        print(f"qgemm bench: {path} holds no tensor a matmul can take")
        return 2
    if args.times:  # times measured before (on this file, or on cuts of it): summarised here, no GPU needed
        try:
            doc = summarise(model, shapes, merged_times(args.times.split(",")), llama)
        except (OSError, ValueError, KeyError) as exc:
            print(f"qgemm bench: --times: {exc}")
            return 2
    else:
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("qgemm bench needs CuPy and a GPU (pip install -e '.[cuda]')")
            return 2
        ms = [int(v) for v in (args.m or "1,8,512").split(",")]
        doc = summarise(model, shapes, time_shapes(model, shapes, ms, args.reps, args.warmup), llama)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model-bench.json").write_text(json.dumps(doc, indent=1))
    text = report(doc)
    (out / "model-bench.md").write_text(text)
    print(text)
    return 0

