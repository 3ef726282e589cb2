"""Launch geometry shared by the CUDA kernels and their sources (kernels/cuda/launch.py), on any machine: the
figures it mirrors from fast.cu, and the skinny kernel's split of K and its shared memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.cuda import launch as L
from kernels.formats import QK

FAST = (Path(L.__file__).parent / "fast.cu").read_text()


def test_the_mirrored_constants_are_fast_cus() -> None:
    assert int(re.search(r"#define SKINNY_KB (\d+)", FAST).group(1)) == L.SKINNY_KB
    assert int(re.search(r"#define MMQ_BM (\d+)", FAST).group(1)) == L.MMQ_BM
    assert int(re.search(r"#define MMQ_BN (\d+)", FAST).group(1)) == L.MMQ_BN


@pytest.mark.parametrize("n", [1, 17, 130, 2111, 2112, 4096, 14336])
@pytest.mark.parametrize("k", [32, 96, 1056, 4096, 14336])
def test_skinny_splits_cover_k_once(n: int, k: int) -> None:
    """Every split has at least one chunk, the splits together cover K's chunks, and K is split only while the
    16-row blocks leave SMs idle."""
    per, splits = L.skinny_chunks(132, n, k)
    chunks = L.cdiv(k // QK, L.SKINNY_KB)
    assert per >= 1 and (splits - 1) * per < chunks <= splits * per
    if L.cdiv(n, L.SKINNY_ROWS) >= 132:
        assert splits == 1


@pytest.mark.parametrize("planes", [(16, 2, False), (16, 4, False), (16, 2, True), (16, 4, True), (32, 2, False)])
def test_skinny_stages_fit_two_blocks_an_sm(planes: tuple[int, int, bool]) -> None:
    for m in range(2, 9):
        stage = L.skinny_stage(*planes, m)
        stages = L.skinny_stages(stage)
        assert 2 <= stages <= 4 and stages * stage <= L.SKINNY_SMEM, (planes, m, stage, stages)
        assert 2 * (stages * stage + 4096 + 1024) <= 228 * 1024  # two blocks: buffers, the warps' sums, 1 KiB each
