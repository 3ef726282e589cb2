"""What `auto` picks on the GPU: the fastest correct kernel per (weight type, M, N, K) from the
table `qgemm bench --tune` measured (kernels/tuning/table.json, committed), and a simple rule for
shapes the table lacks: the measured entry of the same type nearest in log M, then in log K."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from kernels.formats import format_of
from kernels.kernel import Kernel
from kernels.registry import KERNELS, llama_formula

TABLE = Path(__file__).with_name("table.json")


@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {"entries": []}


def _usable(backend: Any, name: str, type_name: str, m: int, n: int, k: int) -> Kernel | None:
    spec = KERNELS.get(name)
    if spec is None or spec.backend != "cuda" or spec.activation_format != llama_formula(m, type_name, n, k):
        return None  # auto answers what llama.cpp answers at this M: only kernels of its formula
    if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
        return None
    fmt = format_of(type_name)
    if spec.auto_max_weight_bytes is not None and fmt is not None and n * fmt.row_bytes(k) > spec.auto_max_weight_bytes:
        return None  # measured slower on weights this large (the table is keyed by K and M, not by size)
    return spec


def pick(backend: Any, type_name: str, m: int, n: int, k: int) -> Kernel | None:
    entries = [e for e in load_table().get("entries", []) if e["type"] == type_name]
    if entries:
        def distance(e: dict[str, Any]) -> tuple[float, float]:
            return abs(math.log2(e["M"]) - math.log2(m)), abs(math.log2(e["K"]) - math.log2(k))

        for e in sorted(entries, key=distance):
            for name in e["ranking"]:
                spec = _usable(backend, name, type_name, m, n, k)
                if spec is not None:
                    return spec
    # shapes the table lacks: the kernels' own ranks (streaming kernels first: they are the ones of M <= 8's
    # formula), then any kernel of the formula
    ranked = sorted((s for s in KERNELS.values() if s.auto_rank is not None), key=lambda s: s.auto_rank)
    for name in (*(s.name for s in ranked), *KERNELS):
        spec = _usable(backend, name, type_name, m, n, k)
        if spec is not None:
            return spec
    return None


def _correct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of one shape whose kernels compute their formula: an error against the FP64 product within twice the
    least of the kernels of the same formula (they differ only in the order of float sums), and not gross.  Not a
    fixed bound: one random X row's error under Q8_1 moves from run to run past any bound fit to one run."""
    best: dict[str, float] = {}
    for r in rows:
        fmt = KERNELS[r["kernel"]].activation_format
        best[fmt] = min(best.get(fmt, math.inf), r["nmse"])
    return [r for r in rows if r["nmse"] <= min(2 * best[KERNELS[r["kernel"]].activation_format], 1e-2)]


def write_table(result: dict[str, Any], path: Path = TABLE) -> Path:
    """Rank kernels per (type, K, M) by quantize + GEMM time with rotating weights (HBM), replacing the table's
    entries of the shapes measured.

    Only kernels with llama.cpp's semantics compete: Q8_1 activations and the block formula, so that
    `auto` never changes the numbers a user gets (cuBLAS on dequantized fp16 weights is measured beside
    them, but differs in activations and holds 4x the weight memory)."""
    measured: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        spec = KERNELS.get(r["kernel"])
        if spec is not None and spec.quantizes:
            measured.setdefault((r["type"], r["K"], r["M"]), []).append(r)
    groups = {key: correct for key, rows in measured.items() if (correct := _correct(rows))}
    entries = [{"type": t, "K": k, "M": m, "N": rows[0]["N"],
                "ranking": [r["kernel"] for r in sorted(rows, key=lambda r: r["total_us"])],
                "best_us": min(r["total_us"] for r in rows), "date": result["date"], "device": result["device"]}
               for (t, k, m), rows in sorted(groups.items())]
    # a run replaces the entries of the shapes it measured and keeps the rest, each entry naming its device (a run
    # of a few shapes on another machine must not throw away a whole table measured elsewhere)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    kept = [{**e, "device": e.get("device", old.get("device"))} for e in old.get("entries", [])
            if (e["type"], e["K"], e["M"]) not in groups]
    entries = sorted(kept + entries, key=lambda e: (e["type"], e["K"], e["M"]))
    path.write_text(json.dumps({"devices": sorted({str(e["device"]) for e in entries}),
                                "method": "qgemm bench --tune: quantize+GEMM (CUDA-graph replays), rotating weights; "
                                          "Q8_1 kernels only; each entry from the device and date it names",
                                "entries": entries}, indent=1) + "\n")
    load_table.cache_clear()
    return path


def peak_int8_tops(cupy: Any, mods: Any) -> float:
    """Int8 tensor-core ceiling from a plain mma.sync loop (dense ops: 2*16*8*32 per mma per warp), on the
    device `mods` was compiled for."""
    import statistics

    blocks, threads, iters = mods.sm_count * 4, 256, 4096
    out = cupy.empty(blocks * threads, dtype=cupy.int32)
    fn = mods.function("peak.cu", "mma_peak")
    fn((blocks,), (threads,), (out, cupy.int32(iters)))
    times = []
    for _ in range(5):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn((blocks,), (threads,), (out, cupy.int32(iters)))
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    ops = blocks * (threads // 32) * iters * 8 * 2 * 16 * 8 * 32
    return ops / (statistics.median(times) * 1e-3) / 1e12
