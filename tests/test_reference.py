"""The numpy reference against llama.cpp's formulas and an independent FP64 oracle."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kernels import accuracy
from kernels import reference as ref
from kernels.formats import FORMATS


def oracle(type_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    w = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    return x.astype(np.float64) @ w.T


def random_weights(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[type_name])


def test_roundf_is_half_away_from_zero() -> None:
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, -126.5], dtype=np.float32)
    assert ref.roundf(v).tolist() == [1, 2, 3, -1, -2, -3, 0, 127, -127]


def test_warp_sum_is_the_butterfly_order(rng: np.random.Generator) -> None:
    x = rng.standard_normal((5, 32)).astype(np.float32) * np.float32(1e3)
    lanes = x.copy()
    for off in (16, 8, 4, 2, 1):  # __shfl_xor_sync: lane i adds lane i^off
        lanes = lanes + lanes[:, np.arange(32) ^ off]
    assert np.array_equal(ref.warp_sum(x), lanes[:, 0])


@pytest.mark.parametrize("m,k", [(1, 32), (3, 96), (17, 4096)])
def test_q8_1_matches_the_formula(rng: np.random.Generator, m: int, k: int) -> None:
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    a = ref.quantize_q8_1(x)
    xb = x.reshape(m, k // 32, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    assert np.array_equal(a.d, d.astype(np.float16))
    v = (xb / d[..., None]).astype(np.float64)  # the fp32 quotient, rounded in fp64: roundf, independently
    q = np.trunc(v + np.copysign(0.5, v))
    assert np.array_equal(a.q.reshape(m, k // 32, 32), q.astype(np.int8))
    assert np.abs(a.q.astype(int)).max() <= 127
    # s: the fp32 sum (31 additions in any order) rounded once to half
    exact = xb.astype(np.float64).sum(-1)
    order = 31 * 2.0**-24 * np.abs(xb.astype(np.float64)).sum(-1)
    half_step = np.spacing(np.abs(exact + order).astype(np.float16)).astype(np.float64) / 2
    assert np.all(np.abs(a.s.astype(np.float64) - exact) <= order * (1 + 2.0**-10) + half_step)


def test_q8_1_round_trip_error_bound(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((9, 512)) * 3).astype(np.float32)
    a = ref.quantize_q8_1(x)
    d32 = (np.abs(x.reshape(9, 16, 32)).max(-1) / 127)[..., None]
    back = a.q.reshape(9, 16, 32) * d32
    # q = roundf(fl(x/d)): the fp32 quotient (|x/d| <= 127) errs by 127 * 2^-24 at most, and so does back's product
    assert np.all(np.abs(back - x.reshape(9, 16, 32)) <= d32 * (0.5 + 2 * 127 * 2.0**-24))
    # the stored half d costs at most half an ulp of half precision on top
    rel = np.abs(ref.dequantize_q8_1(a) - x).max() / np.abs(x).max()
    assert rel < 1 / 127


def test_q8_1_zero_blocks_and_sign_symmetry(rng: np.random.Generator) -> None:
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[1, 32:64] = 0.0
    a, b = ref.quantize_q8_1(x), ref.quantize_q8_1(-x)
    assert np.all(a.q[1, 32:64] == 0) and a.d[1, 1] == 0 and a.s[1, 1] == 0
    assert np.array_equal(a.q, -b.q) and np.array_equal(a.d, b.d) and np.array_equal(a.s, -b.s)


def test_q8_1_block_bytes_round_trip(rng: np.random.Generator) -> None:
    a = ref.quantize_q8_1(rng.standard_normal((3, 96)).astype(np.float32))
    blocks = a.to_blocks()
    assert blocks.dtype.itemsize == 36 and blocks.shape == (3, 3)
    b = ref.Q8_1.from_blocks(np.frombuffer(blocks.tobytes(), np.uint8).reshape(3, 108))
    assert np.array_equal(a.q, b.q) and np.array_equal(a.d, b.d) and np.array_equal(a.s, b.s)


def test_q8_1_rejects_k_not_multiple_of_32() -> None:
    with pytest.raises(ValueError):
        ref.quantize_q8_1(np.ones((2, 33), np.float32))


def activation_error_bound(type_name: str, raw: np.ndarray, x: np.ndarray, a: ref.Q8_1) -> np.ndarray:
    """What Q8_1 can move an output of llama.cpp's formula off the exact product, from the formula itself:
    ref - exact = Σ_blocks d_w * (Σ q_w * (q_a*d_a - x) - offset * (s_a - Σ x)), every factor known here,
    so its magnitude bounds the error for every input (and a wrong formula breaks it)."""
    qw, dw, _ = ref.unpack_blocks(type_name, raw)
    (m, k), n = x.shape, raw.shape[0]
    x64 = x.astype(np.float64).reshape(m, k // 32, 32)
    lost = np.abs(a.q.reshape(m, k // 32, 32) * a.d.astype(np.float64)[..., None] - x64)  # [M, KB, 32]
    qwb = np.abs(qw.astype(np.float64)).reshape(n, k // 32, 32)
    bound = np.einsum("mbi,nbi,nb->mn", lost, qwb, np.abs(dw.astype(np.float64)))
    offset = FORMATS[GGMLQuantizationType[type_name]].offset
    if offset:
        s_lost = np.abs(a.s.astype(np.float64) - x64.sum(-1))  # [M, KB]
        bound += offset * s_lost @ np.abs(dw.astype(np.float64)).T
    return bound


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 33, 32), (17, 257, 96), (130, 64, 4096)])
def test_ref_q8_1_error_against_fp64_is_the_formulas(rng: np.random.Generator, type_name: str,
                                                      m: int, n: int, k: int) -> None:
    """Output by output, at any shape: the reference's distance from the exact product is what Q8_1's rounding
    of the activations makes of the formula, plus fp32 summation order (kernels/accuracy.py)."""
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w, a = ref.prepare_block_weights(type_name, raw), ref.quantize_q8_1(x)
    y = ref.ref_q8_1(w, a)
    assert y.dtype == np.float32 and y.shape == (m, n)
    terms = ref.ref_q8_1_terms(w, a)
    slack = accuracy.tolerance(terms.count) * terms.magnitude + activation_error_bound(type_name, raw, x, a)
    err = np.abs(y - oracle(type_name, raw, x))
    assert np.all(err <= slack), f"worst {np.max(err / slack):.3g}x its bound"


# NMSE against FP64 where it concentrates (many outputs, many blocks): measured over 200 seeds on the CPU
# (2026-11-24), Q4_0 1.82e-4 ± 3.9e-6 and Q8_0 2.87e-5 ± 6.5e-7 at this shape, so these bounds sit over
# 15 standard deviations away and never fail by chance; a formula that lost half of its precision would.
@pytest.mark.parametrize("type_name,bound", [("Q4_0", 2.5e-4), ("Q8_0", 4e-5)])
def test_ref_q8_1_expected_error_against_fp64(rng: np.random.Generator, type_name: str, bound: float) -> None:
    m, n, k = 130, 64, 4096
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = ref.ref_q8_1(ref.prepare_block_weights(type_name, raw), ref.quantize_q8_1(x))
    assert ref.nmse(y, oracle(type_name, raw, x)) <= bound


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_ref_q8_1_is_the_per_block_formula(rng: np.random.Generator, type_name: str) -> None:
    """Spelled out block by block in float64 from the unpacked integers: the compensation form."""
    n, k, m = 7, 96, 3
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = ref.quantize_q8_1(x)
    qw, dw, _ = ref.unpack_blocks(type_name, raw)
    want = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            for b in range(k // 32):
                sl = slice(32 * b, 32 * b + 32)
                sumi = int(np.dot(a.q[i, sl].astype(int), qw[j, sl].astype(int)))
                da, sa, d = float(a.d[i, b]), float(a.s[i, b]), float(dw[j, b])
                want[i, j] += d * (da * sumi - 8 * sa) if type_name == "Q4_0" else d * da * sumi
    w = ref.prepare_block_weights(type_name, raw)
    cmp = accuracy.compare(ref.ref_q8_1(w, a), want, ref.ref_q8_1_terms(w, a))
    assert cmp.ok, cmp


def test_unpacked_weights_dequantize_like_gguf(rng: np.random.Generator) -> None:
    for type_name, offset in (("Q4_0", 8), ("Q8_0", 0)):
        raw = random_weights(rng, type_name, 5, 64)
        q, d, _ = ref.unpack_blocks(type_name, raw)
        mine = (q.astype(np.float32).reshape(5, 2, 32) - offset) * d.astype(np.float32)[..., None]
        assert np.array_equal(mine.reshape(5, 64), ref.dequantize_weights(type_name, raw))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_ref_f32_against_fp64_oracle(rng: np.random.Generator, type_name: str) -> None:
    raw = random_weights(rng, type_name, 257, 4096)
    x = rng.standard_normal((17, 4096)).astype(np.float32)
    w = ref.dequantize_weights(type_name, raw)
    cmp = accuracy.compare(ref.ref_f32(w, x), oracle(type_name, raw, x), ref.ref_f32_terms(w, x))
    assert cmp.ok, cmp


def test_reference_speed_on_the_seeds_shape() -> None:
    """M=512, N=K=4096 must take a few seconds at most on two cores (weights prepared once); a timing, so its
    inputs are fixed (random, not zeros) and the seed sweep need not repeat it."""
    import time

    rng = np.random.default_rng(4096)
    raw = random_weights(rng, "Q4_0", 4096, 4096)
    x = rng.standard_normal((512, 4096)).astype(np.float32)
    w = ref.prepare_block_weights("Q4_0", raw)
    t0 = time.perf_counter()
    ref.ref_q8_1(w, ref.quantize_q8_1(x))
    assert time.perf_counter() - t0 < 10


# ---- llama.cpp's MMQ formula (its tensor-core path for M > 8) ----------------------------------------
@pytest.mark.parametrize("layout", ["D4", "DS4"])
def test_q8_1_mmq_matches_the_formula(rng: np.random.Generator, layout: str) -> None:
    """quantize_mmq_q8_1 spelled out per block: d_inv = 127/amax and x*d_inv in fp32, q = roundf of it,
    d = 1/d_inv; D4 keeps d in float32, DS4 rounds it to half."""
    x = (rng.standard_normal((3, 96)) * rng.uniform(0.01, 30)).astype(np.float32)
    a = ref.quantize_q8_1_mmq(x, layout)
    assert a.d.dtype == (np.float32 if layout == "D4" else np.float16)
    for i in range(3):
        for b in range(3):
            xb = x[i, 32 * b:32 * b + 32]
            d_inv = np.float32(127) / np.abs(xb).max()
            for j in range(32):
                v = float(xb[j] * d_inv)  # the fp32 product, then C's roundf
                assert a.q[i, 32 * b + j] == int(np.sign(v) * np.floor(abs(v) + 0.5))
            d = np.float32(1) / d_inv
            assert a.d[i, b] == (d if layout == "D4" else np.float16(d))


def test_q8_1_mmq_extreme_blocks() -> None:
    """An all-zero block, a block too small for 127/amax (d_inv = inf, d = 0: it adds nothing), the extremes
    +-amax (q = +-127) and exact half-integers of x*d_inv (away from zero)."""
    x = np.zeros((1, 128), dtype=np.float32)
    x[0, 32:64] = np.float32(1e-38) * np.arange(-16, 16, dtype=np.float32)  # amax 1.6e-37 < 127/FLT_MAX
    x[0, 64:96] = np.linspace(-3, 3, 32, dtype=np.float32)
    x[0, 96] = 127.0  # d_inv = 1: x = k + 0.5 is a tie
    x[0, 97:100] = [0.5, -0.5, 126.5]
    for layout in ("D4", "DS4"):
        a = ref.quantize_q8_1_mmq(x, layout)
        assert not a.q[0, :32].any() and a.d[0, 0] == 0 and a.d[0, 1] == 0
        assert a.q[0, 64] == -127 and a.q[0, 95] == 127
        assert list(a.q[0, 96:100]) == [127, 1, -1, 127] and a.d[0, 3] == 1


def test_ref_mmq_is_the_per_block_formula(rng: np.random.Generator) -> None:
    """Spelled out block by block in float64 from the unpacked integers: signed weights (Q4_0: q - 8), no sum."""
    n, k, m = 7, 96, 3
    for type_name, layout in (("Q4_0", "DS4"), ("Q8_0", "D4")):
        raw = random_weights(rng, type_name, n, k)
        a = ref.quantize_q8_1_mmq(rng.standard_normal((m, k)).astype(np.float32), layout)
        qw, dw, _ = ref.unpack_blocks(type_name, raw)
        qs = qw.astype(int) - FORMATS[GGMLQuantizationType[type_name]].offset
        want = np.zeros((m, n))
        for i in range(m):
            for j in range(n):
                for b in range(k // 32):
                    sl = slice(32 * b, 32 * b + 32)
                    want[i, j] += float(dw[j, b]) * float(a.d[i, b]) * int(np.dot(a.q[i, sl].astype(int), qs[j, sl]))
        w = ref.prepare_block_weights(type_name, raw)
        cmp = accuracy.compare(ref.ref_mmq(w, a), want, ref.ref_mmq_terms(w, a))
        assert cmp.ok, (type_name, cmp)


def test_ref_mmq_at_the_extremes_of_a_block() -> None:
    """Q4_0 blocks of all 0 (-8 signed) or all 15 (+7) nibbles against activation blocks of one value
    (q = +-127): sumi = 32 * 127 * -8 or * 7, exactly d_w * d_a * sumi."""
    d_w = np.float16(0.03125)
    blocks = np.zeros((2, 2, 18), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(d_w.tobytes(), np.uint8)
    blocks[0, :, 2:] = 0x00
    blocks[1, :, 2:] = 0xFF
    raw = blocks.reshape(2, 36)
    x = np.concatenate([np.full(32, 2.0), np.full(32, -0.5)]).astype(np.float32)[None]
    a = ref.quantize_q8_1_mmq(x, "DS4")
    y = ref.ref_mmq(ref.prepare_block_weights("Q4_0", raw), a)
    d_a = [np.float64(np.float16(np.float32(1) / (np.float32(127) / np.float32(v)))) for v in (2.0, 0.5)]
    for row, q in ((0, -8), (1, 7)):
        want = float(d_w) * (d_a[0] * 32 * 127 * q + d_a[1] * 32 * -127 * q)
        assert y[0, row] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("type_name,layout", [("Q4_0", "DS4"), ("Q8_0", "D4")])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (17, 257, 96), (130, 64, 4096)])
def test_ref_mmq_error_against_fp64_is_the_formulas(rng: np.random.Generator, type_name: str, layout: str,
                                                    m: int, n: int, k: int) -> None:
    """Output by output: ref_mmq - exact = Σ_blocks d_w Σ q_w (q_a d_a - x) over the signed weights (no sum
    term), plus fp32 summation order."""
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w, a = ref.prepare_block_weights(type_name, raw), ref.quantize_q8_1_mmq(x, layout)
    y = ref.ref_mmq(w, a)
    qw, dw, _ = ref.unpack_blocks(type_name, raw)
    qs = np.abs(qw.astype(np.float64) - FORMATS[GGMLQuantizationType[type_name]].offset).reshape(n, k // 32, 32)
    lost = np.abs(a.q.reshape(m, k // 32, 32) * a.d.astype(np.float64)[..., None]
                  - x.astype(np.float64).reshape(m, k // 32, 32))
    terms = ref.ref_mmq_terms(w, a)
    slack = accuracy.tolerance(terms.count) * terms.magnitude + \
        np.einsum("mbi,nbi,nb->mn", lost, qs, np.abs(dw.astype(np.float64)))
    err = np.abs(y - oracle(type_name, raw, x))
    assert np.all(err <= slack), f"worst {np.max(err / slack):.3g}x its bound"


# NMSE against FP64 at the shape above, Gaussian activations: measured over 60 seeds on the CPU (2026-11-24),
# MMQ's formula Q4_0 2.88e-5 ± 5.3e-7 and Q8_0 2.87e-5 ± 5.2e-7, where MMVQ's gives Q4_0 1.83e-4 (its sum
# term multiplies the activations' rounding by the unsigned weights' mean 8) and Q8_0 the same 2.88e-5.
@pytest.mark.parametrize("type_name,layout", [("Q4_0", "DS4"), ("Q8_0", "D4")])
def test_ref_mmq_expected_error_against_fp64(rng: np.random.Generator, type_name: str, layout: str) -> None:
    m, n, k = 130, 64, 4096
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = ref.ref_mmq(ref.prepare_block_weights(type_name, raw), ref.quantize_q8_1_mmq(x, layout))
    assert ref.nmse(y, oracle(type_name, raw, x)) <= 4e-5


def test_fma_f32_rounds_once(rng: np.random.Generator) -> None:
    """fma_f32 is fmaf: the exact a * b + c rounded once to float32, where float64 arithmetic would round twice.
    Here a * b + c = 1 + 3 * 2^-24 - 2^-70 lies just under a float32 tie: float64 lands on the tie, and float32's
    ties-to-even then goes up; once rounded it goes down."""
    a = np.array([(1 - 2.0**-23) * 2.0**-24], np.float32)
    b = c = np.array([1 + 2.0**-23], np.float32)
    assert (a.astype(np.float64) * b + c).astype(np.float32)[0] == np.float32(1 + 2.0**-22)  # rounded twice
    assert ref.fma_f32(a, b, c)[0] == np.float32(1 + 2.0**-23)
    a, b = (rng.standard_normal(500).astype(np.float32) for _ in range(2))
    c = (rng.standard_normal(500) * np.exp2(rng.integers(-30, 30, 500))).astype(np.float32)
    got = ref.fma_f32(a, b, c)
    for i in range(500):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        near = np.float32(float(exact))
        best = min((np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))),
                   key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))
        assert got[i] == best, i


def test_ref_bf16_mmvf_sums_as_its_threads_do(rng: np.random.Generator) -> None:
    """ref_bf16_mmvf against its definition written out for one row: thread t's fmaf sum over pairs t, t + bs, ...,
    then the butterflies; and close to the float64 product."""
    k = 776  # bs = 224: 7 warps, 2 steps, the last one ragged
    w = (rng.standard_normal((3, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal(k).astype(np.float32)
    got = ref.ref_bf16_mmvf(w, x)[0]
    wf = (w.astype(np.uint32) << 16).view(np.float32)
    bs = ref.mmvf_block_size(k)
    for r in range(3):
        sums = np.zeros(bs, np.float32)
        for t in range(bs):
            for p in range(t, k // 2, bs):
                for v in (2 * p, 2 * p + 1):
                    sums[t] = ref.fma_f32(wf[r, v:v + 1], x[v:v + 1], sums[t:t + 1])[0]
        assert got[r] == ref._mmvf_block_sum(sums[None])[0]
    want = wf.astype(np.float64) @ x.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(wf).sum(axis=1).max() * np.abs(x).max()
