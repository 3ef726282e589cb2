"""Launch geometry shared by the CUDA kernels and their sources (kernels/cuda/launch.py), on any machine: the
figures it mirrors from fast.cu, and the skinny kernel's split of K and its shared memory."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kernels.cuda import launch as L
from kernels.formats import QK

FAST = (Path(L.__file__).parent / "fast.cu").read_text()


def test_the_mirrored_constants_are_fast_cus() -> None:
    assert int(re.search(r"#define SKINNY_KB (\d+)", FAST).group(1)) == L.SKINNY_KB
    assert int(re.search(r"#define MMQ_BM (\d+)", FAST).group(1)) == L.MMQ_BM
    assert int(re.search(r"#define MMQ_BN (\d+)", FAST).group(1)) == L.MMQ_BN
    splits = {int(s) for s in re.findall(r"GEMV1_GROUPS\(t, T, (\d+)[,)]", FAST)}  # the instances fast.cu makes
    assert {L.groups_split(t) for t in L.GROUPS_SPLIT} | {1} <= splits and all(8 % s == 0 for s in splits)


@pytest.mark.parametrize("bias", [4, 32])
def test_bytes_minus_is_a_bytewise_subtraction(bias: int) -> None:
    """common.cuh's bytes_minus<B> (Q3_K's -4, Q6_K's -32) on every byte value the decoders give it, in every byte
    of a word beside every other: (v + (128 - B) * 0x01010101) ^ 0x80808080 is each byte minus B, as int8."""
    x = np.arange(128 + bias, dtype=np.uint32)
    a, b = np.meshgrid(x, x)  # bytes 0 and 2 take one value, bytes 1 and 3 the other: every pair side by side
    words = (a | (b << 8) | (a << 16) | (b << 24)).reshape(-1)
    got = ((words + np.uint32((128 - bias) * 0x01010101)) ^ np.uint32(0x80808080)).astype("<u4")
    want = words.astype("<u4").view(np.uint8).reshape(-1, 4).astype(np.int64) - bias
    np.testing.assert_array_equal(got.view(np.int8).reshape(-1, 4).astype(np.int64), want)


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
