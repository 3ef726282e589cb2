"""The embedded demo model, generated deterministically with gguf's writer and quantizer.

Gaussian weights (scale 0.02) from a fixed seed per tensor, so the file is the same bytes on every
machine with the same numpy and gguf.  Holds the seeds' benchmark shapes and small tensors for
quick tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from kernels.groups import random_blocks
from models.atomic import atomic_file, clean_leftovers

DEMO_FILE = "demo.gguf"
DEMO_SEED = 20261121
SCALE = 0.02

T = GGMLQuantizationType
Q4_0, Q8_0, F32, F16 = T.Q4_0, T.Q8_0, T.F32, T.F16
GROUPED = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)
DEMO_VERSION = 4  # bumped when the tensor list changes: an older demo.gguf is written again

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
    ("small.f16.weight", F16, (64, 64)),
    ("blk.0.attn_norm.weight", F32, (4096,)),  # 1-D: not a matrix
    # version 2: every legacy and float format (issue #21); appended, so that the tensors above keep their values
    *[(f"{size}.{t.name.lower()}.weight", t, shape) for t in (T.Q4_1, T.Q5_0, T.Q5_1, T.BF16, T.F32)
      for size, shape in (("small", (257, 96)), ("tiny", (33, 64)))],
    ("small.q2_k.k256.weight", T.Q2_K, (64, 256)),
    # version 3: the benchmark shapes (N = 4096) of every new format, for `qgemm bench --types` (floats at K = 4096)
    *[(f"bench.{t.name.lower()}.k{k}.weight", t, (4096, k)) for t in (T.Q4_1, T.Q5_0, T.Q5_1) for k in (4096, 14336)],
    *[(f"bench.{t.name.lower()}.k4096.weight", t, (4096, 4096)) for t in (T.F16, T.BF16)],
    # version 4: the grouped formats (issue #23: K-quants, IQ4_NL / IQ4_XS, MXFP4) from valid random blocks, small
    # (odd N, K a multiple of 256 that is not a power of two) and at the benchmark shapes; and a matrix of a
    # type matmul does not take (IQ2_XXS, random bytes)
    *[(f"{size}.{t.name.lower()}.weight", t, shape) for t in GROUPED
      for size, shape in (("small", (257, 768)), ("tiny", (33, 256)))],
    *[(f"bench.{t.name.lower()}.k{k}.weight", t, (4096, k)) for t in GROUPED for k in (4096, 14336)],
    ("small.iq2_xxs.weight", T.IQ2_XXS, (64, 256)),
]

# the tensor `qgemm bench` times each (type, K) on
BENCH_TENSORS: dict[tuple[str, int], str] = {
    ("Q4_0", 4096): "blk.0.attn_q.weight", ("Q8_0", 4096): "blk.0.attn_k.weight",
    ("Q4_0", 14336): "blk.0.ffn_down.weight", ("Q8_0", 14336): "blk.1.ffn_down.weight",
    **{(t.name, shape[1]): name for name, t, shape in DEMO_TENSORS if name.startswith("bench.")},
}


def _values(index: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([DEMO_SEED, index])
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(SCALE)).astype(np.float32)


Tensor = tuple[str, GGMLQuantizationType, np.ndarray]  # (name, type, float32 values [N, K] or [K], or block bytes)


def write_gguf(path: Path, tensors: list[Tensor], arch: str = "qgemm-demo", name: str | None = None,
               description: str | None = None, uints: dict[str, int] | None = None) -> Path:
    """A GGUF of these tensors (quantized with gguf's quantizer), written atomically: a locked part
    file beside `path`, renamed onto it (models/atomic.py)."""
    path = Path(path)
    with atomic_file(path, "write") as (_, part):
        writer = GGUFWriter(part, arch=arch)
        if name:
            writer.add_name(name)
        if description:
            writer.add_description(description)
        for key, value in (uints or {}).items():
            writer.add_uint32(key, value)
        for tname, qtype, x in tensors:
            if x.dtype == np.uint8:  # block bytes as they are (types gguf cannot quantize)
                writer.add_tensor(tname, x, raw_dtype=qtype)
            elif qtype == F32:
                writer.add_tensor(tname, x.astype(np.float32))
            elif qtype == F16:
                writer.add_tensor(tname, x.astype(np.float16))
            else:
                writer.add_tensor(tname, quants.quantize(x, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _demo_tensor(i: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([DEMO_SEED, i])
    if qtype in GROUPED:  # gguf cannot quantize most of them: valid random blocks (kernels/groups.py)
        return random_blocks(qtype.name, shape[0], shape[1], rng, SCALE)
    if qtype == T.IQ2_XXS:  # random bytes with a finite d: a type qgemm can show but not multiply
        values, nbytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (shape[0], shape[1] // values, nbytes)).astype(np.uint8)
        raw[..., :2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        return raw.reshape(shape[0], -1)
    return _values(i, shape)


def write_demo(path: Path) -> Path:
    """Write the demo GGUF to `path` atomically."""
    from tqdm import tqdm

    made = tqdm(enumerate(DEMO_TENSORS), total=len(DEMO_TENSORS), desc=f"{path.name} (tensors)", disable=None,
                leave=False)
    return write_gguf(path, [(name, qtype, _demo_tensor(i, qtype, shape)) for i, (name, qtype, shape) in made],
                      name="qgemm demo",
                      description="Gaussian weights (scale 0.02, fixed seed) at the seeds' benchmark shapes",
                      uints={"qgemm.demo.seed": DEMO_SEED, "qgemm.demo.version": DEMO_VERSION})


def demo_version(path: Path) -> int | None:
    from models.store import ModelStore

    model = ModelStore(path.parent).get(path.stem)
    if model.index is None:
        return None
    return int(model.index.metadata.get("qgemm.demo.version", 1))


def ensure_demo(models_dir: Path) -> tuple[Path, bool]:
    """The demo's path, and whether it had to be written."""
    clean_leftovers(Path(models_dir))
    path = Path(models_dir) / DEMO_FILE
    if path.is_file() and path.stat().st_size > 0 and demo_version(path) == DEMO_VERSION:
        return path, False
    return write_demo(path), True
