"""qgemm's products against llama.cpp's own, on the same bytes.

A parity harness linked against ggml (llama.cpp's tensor library, built with CUDA on the GPU) writes into
OUTDIR, per weight type, ggml's quantization of deterministic weights (TYPE.w.bin, GGUF
block bytes), the activations (x.f32) and what `ggml_mul_mat` computed on the CUDA backend at each M
(TYPE.M.y.f32).  This module runs every kernel here on those bytes (the CPU references always, the
CUDA kernels when a GPU is present) and reports the NMSE of each product against ggml's:

    python -m tools.parity OUTDIR [--k 4096] [--json parity.json]

llama.cpp computes one formula at a given M (`registry.llama_formula`): a kernel is held to ggml's
product (target NMSE <= 1e-9) where the formula it declares is that one, and `auto` everywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from kernels import reference as ref
from kernels.cpu import CpuBackend
from kernels.formats import FORMATS
from kernels.registry import llama_formula
from kernels.select import KernelChooser
from kernels.types import Weights

TARGET = 1e-9


@dataclass(frozen=True)
class BackendOptions:  # what the CUDA backend reads of the service's settings
    gpu_memory_bytes: int | None = None
    dependent_launch: bool = True


@dataclass(frozen=True)
class Row:
    type: str
    m: int
    n: int
    k: int
    kernel: str  # "auto" rows name what auto picked in `picked`
    picked: str
    formula: str
    llama_formula: str
    nmse: float
    exact: bool = True  # the kernel's `exact`: False for a twin that cannot follow the library's rounding

    @property
    def held(self) -> bool:
        """Whether the target applies: the kernel computes the formula llama.cpp computes at this M, exactly."""
        return self.formula == self.llama_formula and self.exact

    @property
    def ok(self) -> bool:
        return not self.held or self.nmse <= TARGET


def ggml_outputs(outdir: Path, k: int) -> dict[str, tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]]:
    """{type: (raw weights [N, row bytes], activations [Mmax, K], {M: ggml's Y [M, N]})} of a run.sh OUTDIR."""
    x = np.fromfile(outdir / "x.f32", dtype=np.float32).reshape(-1, k)
    out = {}
    for wfile in sorted(outdir.glob("*.w.bin")):
        tname = wfile.name.split(".")[0].upper()
        if tname not in GGMLQuantizationType.__members__:
            continue
        fmt = FORMATS.get(GGMLQuantizationType[tname])
        if fmt is None or not fmt.matmul:
            continue
        raw = np.fromfile(wfile, dtype=np.uint8)
        raw = raw.reshape(-1, fmt.row_bytes(k))
        ys = {}
        for yfile in outdir.glob(f"{wfile.name.split('.')[0]}.*.y.f32"):
            m = int(re.match(r".*\.(\d+)\.y\.f32$", yfile.name).group(1))  # type: ignore[union-attr]
            ys[m] = np.fromfile(yfile, dtype=np.float32).reshape(m, raw.shape[0])
        out[tname] = (raw, x, dict(sorted(ys.items())))
    return out


def compare(outdir: Path, k: int, cuda: Any = None) -> list[Row]:
    """Every kernel that can run each (type, M) of the run, and `auto`, against ggml's product."""
    cpu = CpuBackend(1 << 30)
    chooser = KernelChooser(cuda)
    rows: list[Row] = []
    for tname, (raw, x, ys) in ggml_outputs(outdir, k).items():
        n = raw.shape[0]
        w = Weights(("parity", tname, n, k), tname, n, k, lambda raw=raw: raw)
        for m, want in ys.items():
            xm = np.ascontiguousarray(x[:m])
            lf = llama_formula(m, tname, n, k)
            auto = chooser.auto(tname, m, n, k)
            for label, spec in [("auto", auto), *((s.name, s) for s in chooser.runnable(tname, m, n, k))]:
                y = cpu.run(spec, w, xm).output if spec.backend == "cpu" else \
                    cuda.run(spec, w, xm, poison=True).output
                rows.append(Row(tname, m, n, k, label, spec.name, spec.activation_format, lf, ref.nmse(y, want),
                                spec.exact))
    cpu.close()
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: type x M x kernel -> NMSE against ggml; a mark where the target applies and is met."""
    lines = ["| type | M | llama.cpp's formula | kernel | formula | NMSE vs ggml | target 1e-9 |",
             "|---|---:|---|---|---|---:|---|"]
    for r in rows:
        kernel = f"auto ({r.picked})" if r.kernel == "auto" else r.kernel
        mark = ("met" if r.ok else "**missed**") if r.held else \
            "n/a (other formula)" if r.formula != r.llama_formula else "n/a (not exact: its rounding is the library's)"
        lines.append(f"| {r.type} | {r.m} | {r.llama_formula} | {kernel} | {r.formula} | {r.nmse:.2e} | {mark} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path, help="a ggml parity output folder (TYPE.w.bin, x.f32, TYPE.M.y.f32)")
    p.add_argument("--k", type=int, default=4096, help="K of the run (run.sh's default 4096)")
    p.add_argument("--json", type=Path, help="write the rows here too")
    p.add_argument("--cpu", action="store_true", help="the CPU references only, even with a GPU present")
    args = p.parse_args(argv)
    cuda = None
    if not args.cpu:
        try:
            from kernels.cuda.backend import CudaBackend, cuda_device_present

            if cuda_device_present():
                cuda = CudaBackend(BackendOptions())
        except ImportError:
            cuda = None
    rows = compare(args.outdir, args.k, cuda)
    print(table(rows))
    if args.json:
        device = cuda.device_name if cuda is not None else "cpu"
        args.json.write_text(json.dumps({"device": device, "target": TARGET,
                                         "rows": [asdict(r) | {"held": r.held, "ok": r.ok} for r in rows]}, indent=1))
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows)} products, {sum(r.held for r in rows)} held to the target, {len(bad)} missed it",
          file=sys.stderr)
    if cuda is not None:
        cuda.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
