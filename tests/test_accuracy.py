"""Tests of the tests: kernels/accuracy.py passes every legitimate summation order for every seed, and
fails a deliberately wrong formula (a dropped compensation term, fp32 where llama.cpp keeps half scales,
a wrong block), cancelling outputs included."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kernels import accuracy
from kernels import reference as ref
from kernels.formats import FORMATS

TYPES = ["Q4_0", "Q8_0"]
SHAPES = [(1, 1, 32), (1, 1, 4096), (1, 33, 96), (17, 257, 96), (3, 64, 4096)]  # the GPU tests' kinds of shape


def weights(rng: np.random.Generator, type_name: str, n: int, k: int) -> ref.BlockWeights:
    w = (rng.standard_normal((n, k)) * rng.uniform(0.005, 0.05)).astype(np.float32)
    return ref.prepare_block_weights(type_name, quants.quantize(w, GGMLQuantizationType[type_name]))


def offset(type_name: str) -> np.float32:
    return np.float32(FORMATS[GGMLQuantizationType[type_name]].offset)


def block_dots(w: ref.BlockWeights, a: ref.Q8_1) -> tuple[np.ndarray, ...]:
    """sumi [KB, M, N] and the scales as fp32, broadcastable to it."""
    m, k = a.shape
    qa = a.q.reshape(m, k // 32, 32).transpose(1, 0, 2).astype(np.float32)
    return (np.matmul(qa, w.q), a.d.astype(np.float32).T[..., None], a.s.astype(np.float32).T[..., None],
            w.d[:, None, :])


# -- legitimate kernels: other summation orders and groupings of the same formula ---------------------------
def mmq_order(w: ref.BlockWeights, a: ref.Q8_1) -> np.ndarray:
    """mmq's grouping: d_w*d_a*sumi and offset*d_w*s_a as two fp32 running sums, blocks last to first."""
    sumi, da, sa, dw = block_dots(w, a)
    main = np.zeros(sumi.shape[1:], np.float32)
    comp = np.zeros_like(main)
    for b in reversed(range(sumi.shape[0])):
        main += (dw[b] * da[b]) * sumi[b]
        comp += (offset(w.type_name) * dw[b]) * sa[b]
    return main - comp


def pairwise_order(w: ref.BlockWeights, a: ref.Q8_1) -> np.ndarray:
    """The reference's per-block values, summed as a tree (numpy's pairwise float32 sum)."""
    sumi, da, sa, dw = block_dots(w, a)
    per_block = dw * (da * sumi - offset(w.type_name) * sa)
    return np.add.reduce(per_block, axis=0, dtype=np.float32)


def split_k_order(w: ref.BlockWeights, a: ref.Q8_1, rng: np.random.Generator) -> np.ndarray:
    """Split-K: blocks dealt to a random number of slices, each summed on its own, slices added in a random order
    (what atomics into Y do)."""
    sumi, da, sa, dw = block_dots(w, a)
    per_block = dw * (da * sumi - offset(w.type_name) * sa)
    slices = rng.integers(0, int(rng.integers(1, 9)), per_block.shape[0])
    y = np.zeros(per_block.shape[1:], np.float32)
    for s in rng.permutation(int(slices.max()) + 1):
        y += per_block[slices == s].sum(axis=0, dtype=np.float32)
    return y


# -- wrong kernels ------------------------------------------------------------------------------------------
def no_compensation(w: ref.BlockWeights, a: ref.Q8_1) -> np.ndarray:
    sumi, da, _, dw = block_dots(w, a)
    return (dw * da * sumi).sum(axis=0, dtype=np.float32)


def fp32_scales(w: ref.BlockWeights, x: np.ndarray) -> np.ndarray:
    """d_a = amax/127 and s_a kept in fp32 where llama.cpp stores them as half."""
    a = ref.quantize_q8_1(x)
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    a32 = ref.Q8_1(a.q, (np.abs(xb).max(-1) / np.float32(127)), ref.warp_sum(xb))
    sumi, da, sa, dw = block_dots(w, a32)
    return (dw * (da * sumi - offset(w.type_name) * sa)).sum(axis=0, dtype=np.float32)


def shifted_block(w: ref.BlockWeights, a: ref.Q8_1) -> np.ndarray:
    """Each block multiplied with the next block's weight scale."""
    return ref.ref_q8_1(ref.BlockWeights(w.type_name, w.q, np.roll(w.d, 1, axis=0)), a)


def compare(y: np.ndarray, w: ref.BlockWeights, a: ref.Q8_1) -> accuracy.Comparison:
    return accuracy.compare(y, ref.ref_q8_1(w, a), ref.ref_q8_1_terms(w, a))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_legitimate_orders_pass(rng: np.random.Generator, type_name: str, m: int, n: int, k: int) -> None:
    for _ in range(20 if m * n < 100 else 2):  # tiny shapes, where NMSE failed by chance, many times a seed
        w = weights(rng, type_name, n, k)
        a = ref.quantize_q8_1((rng.standard_normal((m, k)) * rng.uniform(0.01, 30)).astype(np.float32))
        for y in (mmq_order(w, a), pairwise_order(w, a), split_k_order(w, a, rng)):
            cmp = compare(y, w, a)
            assert cmp.ok, cmp


@pytest.mark.parametrize("type_name", TYPES)
def test_legitimate_order_on_a_cancelling_output(rng: np.random.Generator, type_name: str) -> None:
    """An output that is a small remainder of large terms (x nearly orthogonal to the weight row), the case where
    NMSE, the old measure, measured summation order (issue 18: 1 full GPU run in 5 failed at M = N = 1)."""
    k = 4096
    w = weights(rng, type_name, 1, k)
    wrow = (w.q[:, :, 0] - offset(type_name)) * w.d[:, :1]  # [KB, 32]: the dequantized row
    wrow = wrow.reshape(-1).astype(np.float64)
    x = rng.standard_normal(k)
    x = (x - (x @ wrow) / (wrow @ wrow) * wrow).astype(np.float32)[None, :]  # orthogonal, up to rounding
    a = ref.quantize_q8_1(x)
    y, want = mmq_order(w, a), ref.ref_q8_1(w, a)
    terms = ref.ref_q8_1_terms(w, a)
    assert abs(float(want[0, 0])) < 1e-2 * terms.magnitude[0, 0]  # it does cancel (Q8_1 leaves ~1e-4..1e-3)
    assert compare(y, w, a).ok


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_wrong_formulas_fail(rng: np.random.Generator, type_name: str, m: int, n: int, k: int) -> None:
    w = weights(rng, type_name, n, k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30)).astype(np.float32)
    a = ref.quantize_q8_1(x)
    if k > 32 and m * n > 1:  # one block: nothing to shift; one output can land on its bound by chance (~0.1%)
        assert not compare(shifted_block(w, a), w, a).ok
    if type_name == "Q4_0":
        assert not compare(no_compensation(w, a), w, a).ok
    if k <= 96 and m * n > 1:  # fp32 scales move each block by ~1e-4 of itself: caught where blocks are few
        assert not compare(fp32_scales(w, x), w, a).ok


def test_nan_and_shape_mismatch_never_pass(rng: np.random.Generator) -> None:
    w = weights(rng, "Q8_0", 5, 64)
    a = ref.quantize_q8_1(rng.standard_normal((2, 64)).astype(np.float32))
    y = ref.ref_q8_1(w, a)
    y[1, 3] = np.nan
    assert not compare(y, w, a).ok
    with pytest.raises(ValueError):
        accuracy.compare(y[:1], ref.ref_q8_1(w, a), ref.ref_q8_1_terms(w, a))


def test_the_bound_is_tight_enough_to_matter() -> None:
    """For the 256 terms of a Q4_0 row of K = 4096 the bound is 6.2e-5 of Σ|terms|, under the 2.4e-4 that one
    half rounding of a scale can move a block; for one block, 1.4e-6."""
    assert accuracy.tolerance(2 * 4096 // 32) < 6.5e-5
    assert accuracy.tolerance(2) < 2e-6
