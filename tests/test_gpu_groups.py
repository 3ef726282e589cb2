"""The grouped formats (K-quants, IQ4_NL / IQ4_XS, MXFP4) on the GPU (`pytest -m gpu`): every kernel that takes
them against the numpy reference fed the Q8_1 blocks the device produced, on odd shapes (N odd, M from 1 to 300,
K a multiple of 256 that is not a power of two), blocks at their extremes, and Q2_K's D2S6 quantizer."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import groups
from kernels import reference as ref
from kernels.formats import GROUPED_TYPES
from kernels.registry import KERNELS
from tests.test_gpu import backend, check_kernel  # noqa: F401  (the module's backend fixture)

pytestmark = pytest.mark.gpu

KERNELS_OF_GROUPS = [name for name, s in KERNELS.items() if s.backend == "cuda" and s.quantizes
                     and set(GROUPED_TYPES) & set(s.weight_types) or name == "mmq_wgmma"]
MMQ_OF_GROUPS = ["mmq", "mmq_d2"]  # mmq's kernels for the grouped formats (mmq_d2: Q6_K)
SHAPES = [(1, 257, 768), (2, 33, 4352), (5, 1, 256), (8, 257, 4352), (9, 257, 768), (17, 33, 4352),
          (130, 257, 768), (300, 257, 4352), (64, 256, 1280)]


@pytest.mark.parametrize("kernel", KERNELS_OF_GROUPS)
@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_grouped_kernel_matches_reference(backend, rng: np.random.Generator, kernel: str, type_name: str) -> None:  # noqa: F811
    spec = KERNELS[kernel]
    ran = 0
    for m, n, k in SHAPES:
        if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
            continue
        raw = groups.random_blocks(type_name, n, k, rng, rng.uniform(0.005, 0.05))
        x = rng.standard_normal((m, k)) * rng.uniform(0.1, 10)
        check_kernel(backend, spec, type_name, raw, x, key=f"groups {kernel} {m}")
        ran += 1
    if not ran:
        pytest.skip(f"{kernel} takes no {type_name} shape here")


def one_value_activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Activation blocks of one value each, of either sign: every q_a = +-127."""
    signs = rng.choice([-1.0, 1.0], size=(m, k // 32, 1)) * rng.uniform(0.5, 2.0, size=(m, k // 32, 1))
    return np.broadcast_to(signs, (m, k // 32, 32)).reshape(m, k)


@pytest.mark.parametrize("kernel", ["gemv", *MMQ_OF_GROUPS])
@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_grouped_extreme_blocks(backend, rng: np.random.Generator, kernel: str, type_name: str) -> None:  # noqa: F811
    """Every quant and sub-scale byte of a block at 0x00 or 0xFF (the lowest and highest codes, the largest
    sub-scales and minima), against activation blocks of one value (every q_a = +-127)."""
    spec = KERNELS[kernel]
    m, n, k = (65 if kernel.startswith("mmq") else 5), 130, 512
    if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
        pytest.skip(f"{kernel} does not take {type_name} here")
    raw = groups.random_blocks(type_name, n, k, rng)
    b = groups.blocks_of(type_name, raw)
    for field in b.dtype.names:
        if b.dtype[field].kind in "ui" and b.dtype[field].shape:  # quant and sub-scale bytes, not d / e
            v = b[field].view(np.uint8)
            pick = rng.integers(0, 3, v.shape[:2])
            v[pick == 1] = 0x00
            v[pick == 2] = 0xFF
    check_kernel(backend, spec, type_name, np.ascontiguousarray(b).view(np.uint8).reshape(n, -1),
                 one_value_activations(rng, m, k), key=f"extreme groups {kernel}")


@pytest.mark.parametrize("kernel", ["gemv", *MMQ_OF_GROUPS])
def test_q6_k_folded_values_at_their_limits(backend, rng: np.random.Generator, kernel: str) -> None:  # noqa: F811
    """Q6_K's values at -32 or 31 with sub-scales of -128, 127, +-2 and +-1, so that q * sc reaches 4096 and
    -4064 (mmq_d2's high digit +-32) and 64 / -64 (its low digit -64), against activation blocks of one value:
    the sums of both digits at their extremes, inside mmq.cuh's biases (MMQ_BIAS_LO, MMQ_BIAS_HI)."""
    spec = KERNELS[kernel]
    m, n, k = (65 if kernel.startswith("mmq") else 5), 130, 512
    if spec.can_run("Q6_K", m, n, k, backend.cc) or backend.kernel_reason(spec):
        pytest.skip(f"{kernel} does not take Q6_K here")
    b = groups.blocks_of("Q6_K", groups.random_blocks("Q6_K", n, k, rng))
    low = rng.integers(0, 2, b.shape)[..., None] == 1  # a super-block's values all -32 (ql, qh 0) or all 31
    b["ql"], b["qh"] = np.where(low, 0x00, 0xFF), np.where(low, 0x00, 0xFF)
    b["scales"] = rng.choice(np.array([-128, 127, -2, 2, -1, 1], np.int8), size=b["scales"].shape)
    q = groups.mmq_weights("Q6_K", b.view(np.uint8).reshape(n, -1), 2).q
    assert q.max() == 4096 and q.min() == -4064 and 64 in q and -64 in q
    check_kernel(backend, spec, "Q6_K", np.ascontiguousarray(b).view(np.uint8).reshape(n, -1),
                 one_value_activations(rng, m, k), key=f"q6_k limits {kernel}")


def test_quantize_d2s6_bit_exact(backend, rng: np.random.Generator) -> None:  # noqa: F811
    for m, k in ((1, 256), (3, 768), (70, 4352)):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30)).astype(np.float32)
        x[0, :64] = 0.0  # a zero scale group
        got, want = backend.quantize(x, "mmq_d2s6"), ref.quantize_q8_1_d2s6(x)
        assert np.array_equal(got.q, want.q) and np.array_equal(got.d, want.d), (m, k)
        ulp = np.spacing(np.abs(want.s)).astype(np.float32)
        assert np.all(np.abs(got.s.astype(np.float32) - want.s.astype(np.float32)) <= ulp), (m, k)


@pytest.mark.parametrize("kernel", MMQ_OF_GROUPS)
@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_grouped_mmq_several_waves(backend, rng: np.random.Generator, monkeypatch, kernel: str,  # noqa: F811
                                   type_name: str) -> None:
    """mmq (mmq16 for the formats with 16-value scales; mmq_d2 for Q6_K's two digits) over grids of several
    waves, without split-K."""
    spec = KERNELS[kernel]
    if spec.can_run(type_name, 300, 257, 768, backend.cc) or backend.kernel_reason(spec):
        pytest.skip(f"{kernel} does not take {type_name} here")
    monkeypatch.setattr(backend.modules, "sm_count", 2)
    for m, n, k in ((300, 257, 768), (70, 129, 4352)):
        raw = groups.random_blocks(type_name, n, k, rng)
        check_kernel(backend, spec, type_name, raw, rng.standard_normal((m, k)), key=f"waves {kernel} {m}")


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_gemv_m1_every_split(backend, rng: np.random.Generator, monkeypatch, type_name: str, split: int) -> None:  # noqa: F811
    """gemv's M = 1 kernel with K over 1, 2 or 4 warps a row (gemv.cu gemv1_<type>_s<S>, whichever GROUPS_SPLIT
    picks): N not a multiple of the rows a block takes, K of 1 to 17 super-blocks (lanes without sub-blocks)."""
    from kernels.cuda import launch

    monkeypatch.setitem(launch.GROUPS_SPLIT, type_name, split)
    for n, k in ((3, 256), (257, 4352), (130, 1280)):
        raw = groups.random_blocks(type_name, n, k, rng, rng.uniform(0.005, 0.05))
        check_kernel(backend, KERNELS["gemv"], type_name, raw, rng.standard_normal((1, k)) * 3,
                     key=f"split {split} {n} {k}")


@pytest.mark.parametrize("type_name", [t for t in GROUPED_TYPES if groups.GROUPED[t].skinny])
def test_skinny_grouped(backend, rng: np.random.Generator, monkeypatch, type_name: str) -> None:  # noqa: F811
    """gemv at 2 <= M <= 8 for the code-book formats and the K-quants the skinny MMA takes, each through it on their
    planes (which takes only M >= its skinny_min_m in service): every activation row count, K split over blocks
    or not, a last stage of 8 quant blocks (one super-block), scale runs that start 8 bytes into a 16-byte chunk
    (K / 32 = 8 or 40), N past the last 16-row block (the K-quants' scales read for the block's last row), and a
    deep K split into a zeroed output."""
    monkeypatch.setattr(groups.GROUPED[type_name], "skinny_min_m", 2)
    spec = KERNELS["gemv"]
    for m, n, k in ((2, 33, 1280), (8, 2113, 1280), (6, 257, 256), (8, 17, 14336), (5, 130, 4352), (3, 1, 256),
                    (4, 4096, 2304), (7, 31, 768)):
        raw = groups.random_blocks(type_name, n, k, rng, rng.uniform(0.005, 0.05))
        x = rng.standard_normal((m, k)) * rng.uniform(0.1, 10)
        check_kernel(backend, spec, type_name, raw, x, key=f"skinny {m} {n} {k}")
