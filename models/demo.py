"""The embedded demo model, generated deterministically with gguf's writer and quantizer.

Gaussian weights (scale 0.02) from a fixed seed per tensor, so the file is the same bytes on every
machine with the same numpy and gguf.  Holds the seeds' benchmark shapes and small tensors for
quick tests.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

DEMO_FILE = "demo.gguf"
DEMO_SEED = 20261121
SCALE = 0.02

Q4_0, Q8_0, F32, F16 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0,
                        GGMLQuantizationType.F32, GGMLQuantizationType.F16)

# (name, type, row-major shape [N, K])
DEMO_TENSORS: list[tuple[str, GGMLQuantizationType, tuple[int, ...]]] = [
    ("blk.0.attn_q.weight", Q4_0, (4096, 4096)),
    ("blk.0.attn_k.weight", Q8_0, (4096, 4096)),
    ("blk.0.ffn_down.weight", Q4_0, (4096, 14336)),
    ("blk.1.ffn_down.weight", Q8_0, (4096, 14336)),
    ("small.q4_0.weight", Q4_0, (257, 96)),
    ("small.q8_0.weight", Q8_0, (257, 96)),
    ("tiny.q4_0.weight", Q4_0, (33, 64)),
    ("tiny.q8_0.weight", Q8_0, (33, 64)),
    ("small.f16.weight", F16, (64, 64)),  # a matrix of a type matmul does not take
    ("blk.0.attn_norm.weight", F32, (4096,)),
]


def _values(index: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([DEMO_SEED, index])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(SCALE)).astype(np.float32)


def write_demo(path: Path) -> Path:
    """Write the demo GGUF to `path` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".demo-", suffix=".gguf.part", dir=path.parent)
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, arch="qgemm-demo")
        writer.add_name("qgemm demo")
        writer.add_description("Gaussian weights (scale 0.02, fixed seed) at the seeds' benchmark shapes")
        writer.add_uint32("qgemm.demo.seed", DEMO_SEED)
        for i, (name, qtype, shape) in enumerate(DEMO_TENSORS):
            x = _values(i, shape)
            if qtype == F32:
                writer.add_tensor(name, x)
            elif qtype == F16:
                writer.add_tensor(name, x.astype(np.float16))
            else:
                writer.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the model is for every user of the service
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def ensure_demo(models_dir: Path) -> tuple[Path, bool]:
    """The demo's path, and whether it had to be written."""
    path = Path(models_dir) / DEMO_FILE
    if path.is_file() and path.stat().st_size > 0:
        return path, False
    return write_demo(path), True
