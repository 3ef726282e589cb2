"""bitsandbytes' NF4 / FP4 on the GPU (`pytest -m gpu`): our kernels against the numpy reference (poisoned
outputs, odd shapes, every variant), and the reference against bitsandbytes itself where its wheel and PyTorch
are installed (the GPU machine): quantized bytes, absmax values and dequantized weights bit for bit on random
and real weights at every blocksize, gemv_4bit to its own rounding."""

from __future__ import annotations

import numpy as np
import pytest

from app.settings import Settings
from kernels import bnb4
from kernels.reference import dequantize_weights
from kernels.registry import KERNELS
from kernels.types import Weights
from models.store import ModelStore
from tests.test_gpu import backend  # noqa: F401  (the module's backend fixture)

pytestmark = pytest.mark.gpu
VARIANTS = [("nf4", 64, False), ("fp4", 64, False), ("nf4", 32, True), ("fp4", 4096, True), ("nf4", 128, False)]


def relative_error(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    """Largest |y - exact| over the sum of |x_j w_j| of that output: well-conditioned whatever cancels."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    exact = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    return float(np.max(np.abs(y.astype(np.float64) - exact) / np.maximum(scale, 1e-30)))


@pytest.mark.parametrize("kernel", ["bnb4_gemv", "bnb4_dequant"])
@pytest.mark.parametrize("quant_type,blocksize,dq", VARIANTS)
def test_bnb4_kernel_matches_reference(backend, rng: np.random.Generator, kernel: str, quant_type: str,  # noqa: F811
                                       blocksize: int, dq: bool) -> None:
    spec = KERNELS[kernel]
    # M = 1 with K % 32 == 0 and K <= 16384 runs the stream kernel (idle lanes, N under a row group, 448 threads)
    for m, n, k in [(1, 37, 352), (1, 3, 1024), (1, 45, 14336), (1, 9, 16416), (3, 129, 4160), (8, 64, 96),
                    (17, 33, 1056)]:
        if spec.can_run(quant_type.upper(), m, n, k, backend.cc):
            continue
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1)).astype(np.float32)
        w[rng.integers(0, n), :] = 0  # an all-zero row: zero blocks, absmax 0
        t = bnb4.quantize_4bit(w, quant_type, blocksize, dq)
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        weights = Weights((f"bnb4 {kernel} {quant_type} {blocksize} {dq} {m}x{n}x{k}", "w"), quant_type.upper(), n, k,
                          lambda t=t: t, f"{quant_type}-b{blocksize}{'-dq' if dq else ''}")
        y = backend.run(spec, weights, x, poison=True).output
        assert np.isfinite(y).all()
        assert relative_error(y, x, bnb4.dequantize_4bit(t)) < 2e-6, (m, n, k)


@pytest.mark.parametrize("quant_type,blocksize,dq", VARIANTS)
def test_bnb4_device_dequantize_is_bit_exact(backend, rng: np.random.Generator, quant_type: str,  # noqa: F811
                                             blocksize: int, dq: bool) -> None:
    import cupy

    from kernels.cuda import layouts
    from kernels.cuda.kernels import dequantize_bnb4

    n, k = 77, 640
    t = bnb4.quantize_4bit((rng.standard_normal((n, k)) * 0.05).astype(np.float32), quant_type, blocksize, dq)

    def run() -> np.ndarray:
        with backend.stream:
            arrays = layouts.BNB4.make(backend.modules, quant_type.upper(), t, n, k)
            out = cupy.full((n, k), cupy.nan, dtype=cupy.float32)
            dequantize_bnb4(backend.modules, quant_type.upper(), arrays, n, k, out)
            return out.get()
    got = backend._call(run)
    np.testing.assert_array_equal(got.view(np.uint32), bnb4.dequantize_4bit(t).view(np.uint32))


# ---- bitsandbytes itself ---------------------------------------------------------------------------------
def _bnb():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    F = pytest.importorskip("bitsandbytes.functional")
    return torch, F


def real_matrices() -> list[np.ndarray]:
    """SmolLM2's first block's projections (dequantized from the file), where the model is here."""
    d = Settings.from_env().models_dir
    model = next((m for m in ModelStore(d).scan() if m.id.startswith("SmolLM2")), None) if d.is_dir() else None
    if model is None or model.status != "ok":
        return []
    names = [n for n in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight") if n in model.tensors]
    return [dequantize_weights(model.tensors[n].type_name, model.raw(n)) for n in names]


def weight_families(rng: np.random.Generator, blocksize: int) -> list[np.ndarray]:
    """The weights #42 names, each with all-zero blocks: Gaussian with outliers (1 in 500 values 20-200x), small
    integers times a scale (dequantized Q4 weights: x / absmax lands on FP4's thresholds), grid values (each
    block's values are NF4 or FP4 code values times the block's scale, +1 among them), and SmolLM2's first
    block's projections where the model is here."""
    n, k = 65, 4096
    out = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2)).astype(np.float32)
    idx = rng.choice(out.size, out.size // 500, replace=False)
    out.reshape(-1)[idx] *= rng.uniform(20, 200, idx.size).astype(np.float32)
    ints = (rng.integers(-8, 8, (n, k)) * np.float32(0.0123)).astype(np.float32)
    grids = []
    for code in (bnb4.NF4_CODE, bnb4.FP4_CODE):
        scale = rng.uniform(0.001, 3, (n * k) // blocksize).astype(np.float32)
        grid = (code[rng.integers(0, 16, n * k)] * np.repeat(scale, blocksize)).astype(np.float32)
        grid.reshape(-1, blocksize)[:, 0] = scale
        grids.append(grid.reshape(n, k))
    mats = [out, ints, *grids, *real_matrices()]
    for w in mats:
        w[3, :blocksize] = 0  # a zero block (where the row holds one)
        w[7, blocksize:3 * blocksize] = 0
    return mats


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", bnb4.BLOCKSIZES)
def test_quantize_and_dequantize_equal_bitsandbytes(rng: np.random.Generator, quant_type: str, blocksize: int) -> None:
    torch, F = _bnb()
    for w in weight_families(rng, blocksize):
        qb, state = F.quantize_4bit(torch.from_numpy(w).cuda(), blocksize=blocksize, quant_type=quant_type)
        ours = bnb4.quantize_4bit(w, quant_type, blocksize)
        np.testing.assert_array_equal(qb.cpu().numpy().reshape(-1), ours.packed)
        np.testing.assert_array_equal(state.absmax.cpu().numpy().view(np.uint32), ours.absmax.view(np.uint32))
        theirs = F.dequantize_4bit(qb, state).cpu().numpy()
        np.testing.assert_array_equal(theirs.view(np.uint32), bnb4.dequantize_4bit(ours).view(np.uint32))


def test_torch_mean_f32_is_torchs_on_this_gpu(rng: np.random.Generator) -> None:
    """bnb4.torch_mean_f32 against torch.mean on this GPU, with its SM count: up to 128 values, one CTA, CTAs by
    values a thread, and past 32,768 values an SM, CTAs by the SM count."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (1, 7, 128, 129, 255, 4097, 131_075, 1_000_003, 40_000 * sm_count + 3):
        x = rng.uniform(0.001, rng.uniform(0.01, 100), n).astype(np.float32)
        theirs = np.float32(torch.from_numpy(x).cuda().mean().item())
        assert np.float32(bnb4.torch_mean_f32(x, sm_count)).view(np.uint32) == theirs.view(np.uint32), n


def assert_double_quantization_is_bitsandbytes(torch, F, w: np.ndarray, quant_type: str, blocksize: int) -> None:
    """quantize_4bit with compress_statistics, ours and bitsandbytes' on this GPU: codes, offset (torch's mean of
    the absmax values, in its order), 8-bit absmax codes, second-level absmax and dequantized weights bit for bit."""
    qb, state = F.quantize_4bit(torch.from_numpy(w).cuda(), blocksize=blocksize, quant_type=quant_type,
                                compress_statistics=True)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    ours = bnb4.quantize_4bit(w, quant_type, blocksize, double_quant=True, sm_count=sm_count)
    np.testing.assert_array_equal(qb.cpu().numpy().reshape(-1), ours.packed)
    assert np.float32(state.offset.item()).view(np.uint32) == ours.nested.offset.view(np.uint32), \
        (float(state.offset.item()), float(ours.nested.offset), ours.absmax.size)
    absmax2 = state.state2.absmax.cpu().numpy()
    np.testing.assert_array_equal(absmax2.view(np.uint32), ours.nested.absmax2.view(np.uint32))
    np.testing.assert_array_equal(state.absmax.cpu().numpy(), ours.nested.q)
    theirs = F.dequantize_4bit(qb, state).cpu().numpy()
    np.testing.assert_array_equal(theirs.view(np.uint32), bnb4.dequantize_4bit(ours).view(np.uint32))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", bnb4.BLOCKSIZES)
def test_double_quantization_equals_bitsandbytes(rng: np.random.Generator, quant_type: str, blocksize: int) -> None:
    torch, F = _bnb()
    np.testing.assert_array_equal(F.create_dynamic_map().numpy().view(np.uint32), bnb4.DYNAMIC_CODE.view(np.uint32))
    for w in [(rng.standard_normal((300, 2048)) * 0.02).astype(np.float32), *weight_families(rng, blocksize)]:
        assert_double_quantization_is_bitsandbytes(torch, F, w, quant_type, blocksize)


def test_double_quantization_of_a_large_matrix_equals_bitsandbytes(rng: np.random.Generator) -> None:
    """300,000 blocks: torch's mean of their absmax values runs over several CTAs, split by the SM count."""
    torch, F = _bnb()
    w = (rng.standard_normal((2400, 8000)) * 0.02).astype(np.float32)
    assert_double_quantization_is_bitsandbytes(torch, F, w, "nf4", 64)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_gemv_matches_bitsandbytes_gemv_4bit(backend, rng: np.random.Generator, quant_type: str) -> None:  # noqa: F811
    """bitsandbytes' gemv_4bit with fp16 activations equals the reference's fp16 semantics to one half ulp
    (its float32 sums run in another order); with fp32 activations it and our bnb4_gemv agree to float32
    rounding (relative to the sum of |x_j w_j|)."""
    torch, F = _bnb()
    for i, w in enumerate([(rng.standard_normal((257, 4096)) * 0.03).astype(np.float32), *real_matrices()]):
        n, k = w.shape
        qb, state = F.quantize_4bit(torch.from_numpy(w).cuda(), blocksize=64, quant_type=quant_type)
        ours = bnb4.quantize_4bit(w, quant_type, 64)
        x = rng.standard_normal((1, k)).astype(np.float32)
        y16 = F.gemv_4bit(torch.from_numpy(x).half().cuda(), qb.t(), state=state).float().cpu().numpy()
        ref16 = bnb4.gemv_4bit(x, ours, np.float16).astype(np.float32)
        wd = bnb4.dequantize_4bit(ours)
        sums = np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T
        bound = np.spacing(np.abs(ref16).astype(np.float16)).astype(np.float64) + 2.0**-20 * sums
        worst = int(np.argmax(np.abs(y16 - ref16) / bound))
        assert np.all(np.abs(y16 - ref16) <= bound), (w.shape, worst, float(y16[0, worst]), float(ref16[0, worst]),
                                                      float(bound[0, worst]))
        y32 = F.gemv_4bit(torch.from_numpy(x).cuda(), qb.t(), state=state).cpu().numpy()
        assert relative_error(y32, x, wd) < 2e-6
        # the backend caches uploads by key: one per matrix
        weights = Weights((f"bnb gemv {quant_type} {i}", "w"), quant_type.upper(), n, k, lambda t=ours: t, "b64")
        mine = backend.run(KERNELS["bnb4_gemv"], weights, x, poison=True).output
        assert relative_error(mine, x, wd) < 2e-6
        assert float(np.max(np.abs(mine - y32) / sums)) < 4e-6
