"""Readable summaries of a GGUF model: header, metadata (long arrays summarised), tensor table,
and on-demand statistics of a tensor's dequantized values."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants

from models.store import Model, TensorInfo


def header(model: Model) -> dict[str, Any]:
    assert model.index is not None
    return dict(model.index.header)


def metadata(model: Model) -> dict[str, Any]:
    """Every metadata key but GGUF.*, long arrays summarised (type, length, first items)."""
    assert model.index is not None
    return dict(model.index.metadata)


def types_summary(model: Model) -> dict[str, dict[str, int]]:
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in model.tensors.values():
        counts[t.type_name] += 1
        nbytes[t.type_name] += t.n_bytes
    return {k: {"count": counts[k], "n_bytes": nbytes[k]} for k in sorted(counts)}


def quant_mix(model: Model) -> dict[str, Any]:
    """What the file's matrices are made of, in llama.cpp's terms: its file type where the file names one
    (`general.file_type`, e.g. MOSTLY_Q4_K_M) and each type's share of the 2-D tensors' bytes, with a one-line
    summary ("Q4_K_M-like: 5% Q4_K, 4% Q6_K, ... by bytes")."""
    nbytes: Counter[str] = Counter()
    for t in model.tensors.values():
        if len(t.shape) == 2:
            nbytes[t.type_name] += t.n_bytes
    total = sum(nbytes.values())
    shares = {k: round(v / total, 4) for k, v in nbytes.most_common()} if total else {}
    file_type = model.index.file_type if model.index is not None else None
    parts = ", ".join(f"{round(100 * v)}% {k}" for k, v in shares.items())
    name = file_type.removeprefix("MOSTLY_") + "-like: " if file_type else ""
    return {"file_type": file_type, "by_bytes": shares, "summary": f"{name}{parts} by bytes" if parts else ""}


def tensor_row(t: TensorInfo) -> dict[str, Any]:
    return {"name": t.name, "type": t.type_name, "shape": list(t.shape), "n_bytes": t.n_bytes,
            "offset": t.offset, "matmul": t.matmul}


def tensor_stats(t: TensorInfo, raw: np.ndarray, rows_per_chunk: int = 1024) -> dict[str, Any]:
    """min, max, mean, std of the dequantized values and the share of all-zero 32-value blocks.

    Dequantizes a chunk of rows at a time so that a large tensor never sits in memory as fp32.
    """
    qtype = GGMLQuantizationType[t.type_name]
    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
    lo, hi, total, total_sq, count = np.inf, -np.inf, 0.0, 0.0, 0
    zero_blocks = blocks = 0
    for r0 in range(0, rows.shape[0], rows_per_chunk):
        chunk = quants.dequantize(np.asarray(rows[r0:r0 + rows_per_chunk]), qtype).astype(np.float64)
        flat = chunk.reshape(-1)
        lo, hi = min(lo, float(flat.min())), max(hi, float(flat.max()))
        total += float(flat.sum())
        total_sq += float(np.dot(flat, flat))
        count += flat.size
        usable = flat.size - flat.size % 32
        if usable:
            nonzero = np.any(flat[:usable].reshape(-1, 32) != 0, axis=1)
            blocks += nonzero.size
            zero_blocks += int(nonzero.size - np.count_nonzero(nonzero))
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    return {"min": lo, "max": hi, "mean": mean, "std": float(np.sqrt(var)),
            "zero_block_share": zero_blocks / blocks if blocks else 0.0, "n_values": count}


def tensor_histograms(t: TensorInfo, raw: np.ndarray, lo: float, hi: float, bins: int,
                      rows_per_chunk: int = 256) -> dict[str, Any]:
    """Histograms of the dequantized values over [lo, hi] and of the block scales (legacy formats: each block's
    d; grouped formats: each group's effective scale; float tensors: none), a chunk of rows at a time."""
    from kernels import groups
    from kernels.formats import format_of
    from kernels.reference import block_fields

    qtype = GGMLQuantizationType[t.type_name]
    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5  # a constant tensor: one bin in the middle
    edges = np.linspace(lo, hi, bins + 1)
    counts = np.zeros(bins, np.int64)
    fmt = format_of(t.type_name)
    blocky = fmt is not None and not fmt.is_float and not fmt.bnb4 and raw.ndim > 1 and fmt.matmul
    scales: list[np.ndarray] = []
    for r0 in range(0, rows.shape[0], rows_per_chunk):
        chunk = np.asarray(rows[r0:r0 + rows_per_chunk])
        counts += np.histogram(quants.dequantize(chunk, qtype).reshape(-1), bins=edges)[0]
        if blocky:  # the scales alone: legacy blocks' d straight from the bytes, grouped formats decoded
            d = groups.decode(t.type_name, chunk).scale if fmt.grouped else block_fields(t.type_name, chunk)[0][..., 0]
            scales.append(np.asarray(d, np.float64).reshape(-1))
    out: dict[str, Any] = {"values": {"edges": edges.tolist(), "counts": counts.tolist()}, "block_scales": None}
    if scales:
        s = np.concatenate(scales)
        s_edges = np.linspace(float(s.min()), float(s.max()) if s.max() > s.min() else float(s.min()) + 1, bins + 1)
        out["block_scales"] = {"edges": s_edges.tolist(), "counts": np.histogram(s, bins=s_edges)[0].tolist()}
    return out
