"""Run kernels a few times each on the demo's benchmark tensors, for `ncu` to profile (weights from HBM: ncu flushes
the caches before each replay by default):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:'gemv1_' \
        python3 scripts/profile_kernels.py gemv:Q2_K:14336:1 gemv:Q4_0:14336:1

Each argument is KERNEL:TYPE:K:M (a registered kernel, a type with a benchmark tensor at that K, in models/demo.py
BENCH_TENSORS); without arguments, mmq and gemv on Q4_0.  Each shape runs LAUNCHES (3) times.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the imports that need a GPU
    print(__doc__)
    sys.exit(0)

import os

import cupy
import numpy as np
from gguf import GGUFReader

from app.settings import Settings
from kernels.cuda.backend import CudaBackend
from kernels.registry import KERNELS
from models.demo import BENCH_TENSORS, ensure_demo

DEFAULT = ["mmq:Q4_0:4096:512", "mmq:Q4_0:14336:128", "gemv:Q4_0:14336:1", "gemv:Q4_0:14336:8"]


def main(shapes: list[str]) -> None:
    settings = Settings.from_env(backend="cuda")
    demo, _ = ensure_demo(settings.models_dir)
    tensors = {t.name: t for t in GGUFReader(demo).tensors}
    mods = CudaBackend(settings).modules
    launches = int(os.environ.get("LAUNCHES", "3"))
    for shape in shapes or DEFAULT:
        kernel, type_name, k_text, m_text = shape.split(":")
        k, m = int(k_text), int(m_text)
        raw = np.asarray(tensors[BENCH_TENSORS[(type_name, k)]].data)
        n = raw.shape[0]
        spec = KERNELS[kernel]
        w = spec.weights.make(mods, type_name, raw, n, k)
        x = cupy.asarray(np.random.default_rng().standard_normal((m, k)).astype(np.float32))
        layout = spec.activations_for(type_name)
        acts = layout.fill(mods, x, layout.buffers(m, k))
        y = cupy.empty((m, n), dtype=cupy.float32)
        for _ in range(launches):
            spec.launch(mods, type_name, w, acts, y, m, n, k)
        cupy.cuda.Device().synchronize()
        print(shape, "N", n, "ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
