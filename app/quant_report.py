"""Every 4-bit (and 8-bit) scheme on one real tensor, side by side: GET .../quantization and `qgemm inspect
--quant-error`.  The tensor's own values (gguf's dequantization of the file) are the reference; each scheme
requantizes them (kernels/requant.py) and is measured against them; on a GPU each scheme's product is timed
at the requested M with auto's kernel for it."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from app.tensors import effective, weights
from kernels.bnb4 import DEFAULT_BLOCKSIZE
from kernels.reference import dequantize_weights
from kernels.requant import Scheme, compare, default_schemes, row_head
from models.store import Model, TensorInfo

TIMING_RUNS = 7  # after one warm-up run: the median of these
METHOD = (f"per M, auto's kernel for the scheme on weights already on the GPU (uploaded by a warm-up run); CUDA "
          f"events around the activations' preparation (Q8_1 quantization for GGUF formats) and the product; "
          f"the median of {TIMING_RUNS} runs; random activations N(0, 1); small tensors may sit in L2")


def error_rows(model: Model, info: TensorInfo, blocksize: int = DEFAULT_BLOCKSIZE,
               double_quant: bool = False) -> tuple[list[dict[str, Any]], list[Scheme]]:
    """The reference row (the tensor as stored) and each scheme's error and size.  A vector counts as one row;
    a tensor gguf cannot dequantize gets its reason on every row."""
    schemes = default_schemes(blocksize, double_quant)
    own = {"weight_format": "gguf", "tag": info.type_name, "blocksize": None, "double_quant": False,
           "bits_per_weight": 8 * info.n_bytes / max(info.n_elements, 1), "nmse": 0.0, "max_abs_error": 0.0,
           "reason": None}
    try:
        values = dequantize_weights(info.type_name, model.raw(info.name)).reshape(-1, info.shape[-1])
        return [own, *compare(values, schemes)], schemes
    except (NotImplementedError, ValueError) as exc:  # a type gguf cannot dequantize
        reason = f"{info.type_name} cannot be dequantized here ({type(exc).__name__}: {exc})"
        return [{**own, "nmse": None, "max_abs_error": None, "reason": reason},
                *({**row_head(s), "reason": reason} for s in schemes)], schemes


def time_schemes(engine: Any, model: Model, info: TensorInfo, rows: list[dict[str, Any]], schemes: list[Scheme],
                 ms: list[int], seed: int = 0) -> None:
    """Fill each row's kernel and gemm_us per M (GPU): auto's kernel, median of TIMING_RUNS after a warm-up."""
    n, k = info.shape
    rng = np.random.default_rng(seed)
    by_tag = {s.tag: s for s in schemes}
    for row in rows:
        if row.get("reason"):
            continue
        scheme = by_tag.get(row["tag"]) if row["weight_format"] != "gguf" else None
        eff = effective(info, scheme)
        w = weights(model, info, scheme)
        row["kernel"], row["gemm_us"] = {}, {}
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            spec = engine.choose("auto", eff, m)
            engine.time_product(spec, w, x)  # warm-up: uploads the layout, loads the kernel
            times = []
            for _ in range(TIMING_RUNS):
                t = engine.time_product(spec, w, x)
                times.append(t["quantize"] + t["gemm"])
            row["kernel"][str(m)] = spec.name
            row["gemm_us"][str(m)] = round(statistics.median(times) * 1e3, 2)
