"""qgemm against llama.cpp's own products on the same bytes (tools/parity.py).

tests/data/ggml_parity holds what ggml computed on our H100 (its README says how); every kernel whose
formula is the one llama.cpp runs at that M, and `auto` at every M, must be within NMSE 1e-9 of it.
On the GPU (`-m gpu`) the CUDA kernels run too, and QGEMM_PARITY_DIR may name a full run.sh output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import parity

FIXTURE = Path(__file__).parent / "data" / "ggml_parity"


def check(rows: list[parity.Row]) -> None:
    assert rows
    bad = [r for r in rows if not r.ok]
    assert not bad, parity.table(bad)
    assert {r.m for r in rows if r.kernel == "auto" and r.held} == {r.m for r in rows}, "auto must be held everywhere"


def test_references_equal_llama_cpp_at_every_m() -> None:
    rows = parity.compare(FIXTURE, 4096)
    check(rows)
    # both formulas are exercised: MMVQ up to 8 rows, MMQ above, and each differs from the other's regime
    by = {(r.type, r.m, r.kernel): r for r in rows}
    assert by[("Q4_0", 16, "ref_q8_1")].nmse > 1e-5 and by[("Q4_0", 8, "ref_mmq")].nmse > 1e-5
    assert by[("Q4_0", 9, "auto")].picked == "ref_mmq" and by[("Q4_0", 8, "auto")].picked == "ref_q8_1"


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["fixture", "QGEMM_PARITY_DIR"])
def test_cuda_kernels_equal_llama_cpp(where: str) -> None:
    from kernels.cuda.backend import CudaBackend, cuda_device_present

    if not cuda_device_present():
        pytest.skip("needs a CUDA device through CuPy")
    outdir = FIXTURE if where == "fixture" else os.environ.get("QGEMM_PARITY_DIR")
    if not outdir:
        pytest.skip("QGEMM_PARITY_DIR names no ../shared/ggml-parity/run.sh output")
    cuda = CudaBackend(parity.BackendOptions())
    try:
        rows = parity.compare(Path(outdir), 4096, cuda)
    finally:
        cuda.close()
    check(rows)
    assert any(r.picked in ("mmq", "mmq_wgmma") and r.held for r in rows)
