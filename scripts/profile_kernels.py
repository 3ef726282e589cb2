"""Run each fast kernel once on the shapes that matter, for `ncu` to profile:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        -k regex:'mmq|gemv|quantize' python3 scripts/profile_kernels.py
"""

from __future__ import annotations

import cupy
import numpy as np
from gguf import GGUFReader

from app.settings import Settings
from kernels.cuda.modules import Modules
from kernels.registry import KERNELS
from models.demo import ensure_demo

SHAPES = [("mmq", "blk.0.attn_q.weight", 512), ("mmq", "blk.1.ffn_down.weight", 128),
          ("gemv", "blk.0.ffn_down.weight", 1), ("gemv", "blk.0.ffn_down.weight", 8)]


def main() -> None:
    demo, _ = ensure_demo(Settings.from_env().models_dir)
    tensors = {t.name: t for t in GGUFReader(demo).tensors}
    device = cupy.cuda.Device(0)
    mods = Modules(int(device.compute_capability), int(device.attributes["MultiProcessorCount"]))
    for kernel, name, m in SHAPES:
        t = tensors[name]
        type_name = t.tensor_type.name
        raw = np.asarray(t.data)
        n, k = raw.shape[0], int(t.shape[0])
        spec = KERNELS[kernel]
        w = spec.weights.make(mods, type_name, raw, n, k)
        x = cupy.asarray(np.random.default_rng().standard_normal((m, k)).astype(np.float32))
        layout = spec.activations_for(type_name)
        acts = layout.fill(mods, x, layout.buffers(m, k))
        y = cupy.empty((m, n), dtype=cupy.float32)
        spec.launch(mods, type_name, w, acts, y, m, n, k)
        cupy.cuda.Device().synchronize()
        print(kernel, name, type_name, m, n, k, "ok")


if __name__ == "__main__":
    main()
