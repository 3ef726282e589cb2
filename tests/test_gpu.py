"""GPU kernels against the numpy reference, and the service on the CUDA backend (`pytest -m gpu`).

Every GEMM is fed the Q8_1 blocks the device produced, so that only float summation order can
differ from the reference: each output within the bound kernels/accuracy.py derives from the sum of
its terms' magnitudes (well-conditioned at M = N = 1 too, where NMSE measured summation order).
Outputs are poisoned (NaN) before each run.
"""

from __future__ import annotations

import asyncio
import functools
import io
import itertools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from app.errors import status_of
from app.settings import Settings
from app.tensors import weights
from kernels import groups
from kernels import reference as ref
from kernels.errors import QgemmError
from kernels.formats import BNB4_TYPES, FORMATS, LEGACY_TYPES
from kernels.registry import KERNELS
from kernels.types import Weights
from models.demo import ensure_demo
from tests.conftest import stream_seed
from tests.oracles import assert_matches, prepare, reference_product

pytestmark = pytest.mark.gpu

MS, NS, KS = (1, 3, 17, 130), (1, 33, 257), (32, 96, 4096)
CUDA_KERNELS = [name for name, s in KERNELS.items() if s.backend == "cuda"]
# GGUF types: bitsandbytes' NF4/FP4 are made from values at upload (tests/test_gpu_bnb4.py)
GPU_TYPES = sorted({t for s in KERNELS.values() if s.backend == "cuda" for t in s.weight_types} - set(BNB4_TYPES))


@pytest.fixture(scope="module")
def backend():
    from kernels.cuda.backend import CudaBackend

    b = CudaBackend(Settings(backend="cuda"))
    assert not b.modules.errors, b.modules.errors
    yield b
    b.close()


def test_every_declared_entry_point_resolves_and_a_missing_one_fails_the_start(backend, monkeypatch) -> None:
    """Each kernel's entry points (CudaKernel.entry_points) exist in its compiled source: the backend's start
    resolved them all; a name a source lacks is refused by the same check, naming the kernel and the function."""
    from kernels.cuda.kernels import CudaKernel

    runs = [s for s in KERNELS.values() if isinstance(s, CudaKernel) and backend.kernel_reason(s) is None]
    declared = {(s.source, n) for s in runs for t in s.weight_types for n in s.entry_points(t)}
    assert len(declared) > 50  # every family declares its functions
    kernel = KERNELS["gemv"]
    monkeypatch.setattr(type(kernel), "entry_points", lambda self, t: ("gemv1_no_such_type",))
    with pytest.raises(RuntimeError, match="gemv: gemv1_no_such_type in gemv.cu"):
        backend.resolve_entry_points()


@pytest.fixture(scope="module")
def weights_bank():
    """Fresh random GGUF weights per (type, N, K), made once per module run from the run's seed."""
    rng = np.random.default_rng(stream_seed("tests/test_gpu.py::weights_bank"))
    bank = {}
    for t, n, k in itertools.product(GPU_TYPES, NS, KS):
        fmt = FORMATS[GGMLQuantizationType[t]]
        if k % fmt.block_values:
            continue  # no such matrix (kernels refuse the shape)
        if fmt.grouped:  # gguf cannot quantize most of them: valid random blocks
            bank[(t, n, k)] = groups.random_blocks(t, n, k, rng, rng.uniform(0.005, 0.05))
            continue
        w = (rng.standard_normal((n, k)) * rng.uniform(0.005, 0.05)).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType[t])
        bank[(t, n, k)] = raw
    return bank


# llama.cpp's MMQ activations: d_a in float, or a half (with the block sums: formats with a minimum)
MMQ_LAYOUTS = {"mmq_d4": "D4", "mmq_ds4": "DS4", "mmq_ds4s": "DS4"}
LAYOUTS = ["blocks", "split", "split_chunks", *MMQ_LAYOUTS]


def compare_quantize(backend, x: np.ndarray, layout: str) -> None:
    m, k = x.shape
    got = backend.quantize(x, layout)
    want = ref.quantize_q8_1_mmq(x, MMQ_LAYOUTS[layout]) if layout in MMQ_LAYOUTS else ref.quantize_q8_1(x)
    assert np.array_equal(got.q, want.q), (layout, m, k)
    assert got.d.dtype == want.d.dtype and np.array_equal(got.d, want.d) and \
        np.array_equal(np.signbit(got.d), np.signbit(want.d)), (layout, m, k)
    if layout in ("mmq_d4", "mmq_ds4"):
        return  # no sums: llama.cpp's MMQ formulas for the signed formats read none
    # the sum: within one half-precision ulp of the reference (summation order)
    ulp = np.spacing(np.abs(want.s)).astype(np.float32)
    assert np.all(np.abs(got.s.astype(np.float32) - want.s.astype(np.float32)) <= ulp), (layout, m, k)


def check_quantize(backend, rng: np.random.Generator, layout: str, shapes: tuple[tuple[int, int], ...]) -> None:
    for m, k in shapes:
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30)).astype(np.float32)
        x[0, :32] = 0.0  # a zero block
        compare_quantize(backend, x, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_q8_1_bit_exact(backend, rng: np.random.Generator, layout: str) -> None:
    check_quantize(backend, rng, layout, ((1, 32), (3, 96), (17, 4096), (130, 14336), (5, 576)))


def half_way_values(rng: np.random.Generator) -> np.ndarray:
    """Values whose x/d is a half-integer, or a float step from one: where x * (1/d), the kernels' fast
    path, and the reference's x / d can round apart (1/25 rounds down in fp32), so the kernels divide."""
    m, blocks = 7, 40
    d = rng.choice(np.array([25.0, 3.0, 7.0, 0.2, 1 / 3, 0.015625, 1e-3], dtype=np.float32), (m, blocks, 1))
    k_half = rng.integers(-127, 127, (m, blocks, 32)).astype(np.float32) + np.float32(0.5)
    xb = (k_half * d).astype(np.float32)
    step = rng.integers(-1, 2, xb.shape)  # nudge a third of them down and a third up by one float step
    down, up = np.nextafter(xb, np.float32(-np.inf)), np.nextafter(xb, np.float32(np.inf))
    xb = np.where(step < 0, down, np.where(step > 0, up, xb))
    xb[..., 0] = (np.float32(127) * d[..., 0]) * rng.choice(np.array([-1, 1], np.float32), (m, blocks))  # amax
    return xb.reshape(m, blocks * 32).astype(np.float32)


def tiny_values(rng: np.random.Generator) -> np.ndarray:
    """Blocks so small that d = amax/127 is subnormal (and 1/d overflows): the reference's q = roundf(x/d)
    is still well defined there.  CuPy compiles with -ftz=true, which flushed d to zero; q8_1.cu is
    compiled with -ftz=false (kernels/cuda/modules.py)."""
    m, k = 5, 256
    x = (rng.standard_normal((m, k)) * rng.choice(np.array([1e-38, 1e-40, 1.0], np.float32), (m, 1))).astype(np.float32)
    x[0, 5] = 0.0  # a zero value inside a tiny block
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_q8_1_half_way_values(backend, rng: np.random.Generator, layout: str) -> None:
    compare_quantize(backend, half_way_values(rng), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_q8_1_tiny_blocks(backend, rng: np.random.Generator, layout: str) -> None:
    compare_quantize(backend, tiny_values(rng), layout)


@pytest.mark.parametrize("layout", list(MMQ_LAYOUTS))
@pytest.mark.parametrize("kernel", ["quantize_q8_1_mmq", "quantize_q8_1_mmq2", "quantize_q8_1_mmq4",
                                    "quantize_q8_1_mmq_pair"])
def test_quantize_mmq_kernels(backend, rng: np.random.Generator, monkeypatch, kernel: str, layout: str) -> None:
    """Each mmq-layout quantizer (launch picks by size), on M and K not multiples of its rows and blocks."""
    from kernels.cuda import launch

    if kernel == "quantize_q8_1_mmq_pair" and layout.endswith("s"):
        pytest.skip("the pair kernel writes no sums: launch never takes it for mmq_ds4s")
    monkeypatch.setattr(launch, "quantize_mmq_kernel", lambda sm_count, m, k, sums=False: kernel)
    check_quantize(backend, rng, layout, ((1, 32), (3, 96), (5, 576), (67, 4128)))
    compare_quantize(backend, half_way_values(rng), layout)
    compare_quantize(backend, tiny_values(rng), layout)


@pytest.mark.parametrize("kernel", CUDA_KERNELS)
@pytest.mark.parametrize("type_name", GPU_TYPES)
def test_kernel_matches_reference(backend, weights_bank, rng: np.random.Generator, kernel: str,
                                  type_name: str) -> None:
    spec = KERNELS[kernel]
    for m, n, k in itertools.product(MS, NS, KS):
        reason = spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec)
        if reason:
            continue  # the kernel says why; auto never picks it there
        check_kernel(backend, spec, type_name, weights_bank[(type_name, n, k)], rng.standard_normal((m, k)))


def check_kernel(backend, spec, type_name: str, raw: np.ndarray, x: np.ndarray, key: str = "bank") -> None:
    """`key` names the weights in the backend's cache: the bank's are uploaded once per (type, N, K)."""
    (m, k), n = x.shape, raw.shape[0]
    x = x.astype(np.float32)
    w = Weights((key, type_name, n, k), type_name, n, k, lambda raw=raw: raw)
    res = backend.run(spec, w, x, poison=True, keep_q8_1=True)
    assert res.output.shape == (m, n) and np.isfinite(res.output).all(), (spec.name, m, n, k)
    want, terms = reference_product(type_name, raw, x, spec.activation_format, q8_1=res.activations_q8_1)
    assert_matches(res.output, want, terms, f"{spec.name} {type_name} M={m} N={n} K={k}")


def test_small_products_replay_a_graph_as_launched(backend, weights_bank, rng: np.random.Generator) -> None:
    """A product of up to 64 rows is captured as a CUDA graph at its second run and replayed after (graphs.py):
    every run, on fresh X in parts of a batch, equals the product launched step by step, is timed
    step by step, and comes from a replay from the third run on; dropping the weights drops their graphs."""
    from kernels.cuda.backend import X_AMAX_ON_DEVICE

    if backend.graphs is None:
        pytest.skip("no CUDA graphs here (QGEMM_CUDA_GRAPHS, or the driver lacks event record nodes)")
    tried = 0
    for kernel in sorted(CUDA_KERNELS):
        spec = KERNELS[kernel]
        for type_name, (n, k), m in itertools.product(("Q4_0", "Q6_K", "F16"), ((257, 4096), (33, 96)), (1, 5, 64)):
            if (type_name, n, k) not in weights_bank or spec.can_run(type_name, m, n, k, backend.cc) \
                    or backend.kernel_reason(spec):
                continue
            raw = weights_bank[(type_name, n, k)]
            w = Weights(("graphs", type_name, n, k), type_name, n, k, lambda raw=raw: raw)
            for run in range(4):
                x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
                # parts as a batch's requests; more than X_AMAX_ON_DEVICE values in one has the device check X
                parts = [x[:1], x[1:]] if (m - 1) * k <= X_AMAX_ON_DEVICE else [x[i:i + 1] for i in range(m)]
                got = backend.run(spec, w, parts)
                want = backend.run(spec, w, parts, poison=True)  # poisoned buffers: never a graph
                assert np.isfinite(want.output).all()
                # the same kernels on the same X: equal but for split-K's order of atomic adds
                scale = float(np.abs(want.output).max())
                np.testing.assert_allclose(got.output, want.output, rtol=1e-5, atol=1e-6 * scale,
                                           err_msg=f"{kernel} {type_name} M={m} N={n} K={k} run {run}")
                assert set(got.timing_ms) == set(want.timing_ms) and got.timing_ms["gemm"] > 0, got.timing_ms
            key = (w.key, w.layout_key(spec.weights.name), type_name, n, k, spec.name, m, False)
            assert key in backend.graphs.replays or key in backend.graphs.failed, (kernel, type_name, m)
            tried += key in backend.graphs.replays
            print(kernel, type_name, m, "replayed" if key in backend.graphs.replays else "step by step")
            backend.unload(lambda key, wk=w.key: key == wk)
            assert key not in backend.graphs.replays
    assert tried >= 8, f"only {tried} products replayed a graph"


def test_a_batch_in_page_locked_memory_is_read_and_written_where_it_lies(backend, weights_bank,
                                                                         rng: np.random.Generator) -> None:
    """Requests whose X and Y rows lie in registered host memory (a front's arena) give the replayed graph their
    rows' addresses (kernels/cuda/rows.cu): from the second run on it gathers X and scatters Y by them, rows at
    any 4-byte alignment, and each run's Y (poisoned first) equals the product launched step by step on the same
    X; a NaN in X shows as a Y the scatter reports not finite.  A batch of more than GRAPH_ROWS rows replays a graph
    of a larger M (the next multiple of GRAPH_ROWS), its extra rows pointed at harmless ones."""
    import mmap

    from kernels.cuda import host_memory
    from kernels.cuda.backend import GRAPH_ROWS
    from kernels.cuda.graphs import bucket

    if backend.row_kernels is None or backend.graphs is None:
        pytest.skip("no CUDA graphs, or kernels cannot use registered host pointers here")
    type_name, n, k = "Q4_0", 257, 4096
    raw = weights_bank[(type_name, n, k)]
    size = 4 << 20
    mem = mmap.mmap(-1, size)
    region = np.frombuffer(mem, np.uint8)
    base = region.ctypes.data
    host_memory.register(base, size)
    try:
        for ms in ((1, 2, 1, 3), (16, 1, 16, 16, 16, 6)):  # (parts of up to 16 rows: their max|x| the host's)
            _gathered_batches(backend, raw, mem, ms, (type_name, n, k), rng, bucket(sum(ms), GRAPH_ROWS))
    finally:
        host_memory.unregister(base)  # the mapping goes with the last view of it


def _gathered_batches(backend, raw: bytes, mem, ms: tuple[int, ...], tensor: tuple[str, int, int],
                      rng: np.random.Generator, graph_m: int) -> None:
    """The page-locked test's batch of requests of `ms` rows, run four times on each of three kernels."""
    import time

    type_name, n, k = tensor
    m = sum(ms)
    kernels = [name for name in sorted(CUDA_KERNELS) if KERNELS[name].can_run(type_name, m, n, k, backend.cc) is None
               and backend.kernel_reason(KERNELS[name]) is None]
    assert kernels
    for kernel in kernels[:3]:
        spec = KERNELS[kernel]
        w = Weights(("rows", kernel), type_name, n, k, lambda: raw)
        backend.prepare(spec, w)
        for run in range(4):
            xs, ys, x_at, y_at, at = [], [], [], [], 4  # the first X and Y rows only 4-byte aligned
            for rows in ms:
                x = np.ndarray((rows, k), np.float32, mem, at)
                x[...] = rng.standard_normal((rows, k)) * rng.uniform(0.1, 10)
                at += rows * k * 4 + 8
                y = np.ndarray((rows, n), np.float32, mem, at)
                y[...] = np.nan
                x_at += [x.__array_interface__["data"][0] + i * k * 4 for i in range(rows)]
                y_at += [y.__array_interface__["data"][0] + i * n * 4 for i in range(rows)]
                xs.append(x)
                ys.append(y)
                at = (at + rows * n * 4 + 255) // 256 * 256
            poisoned = run == 3
            if poisoned:  # a NaN in X: its row of Y is not finite, whatever the kernel (f32 or Q8_1)
                xs[1][0, 7] = np.nan
            inflight = backend.launch_inline(spec, w, xs, ys, (x_at, y_at))
            assert inflight is not None
            while not inflight.done:
                time.sleep(0.0001)
            got = inflight.result()
            assert got.output is None  # every row went where its request's Y lies
            key = (w.key, w.layout_key(spec.weights.name), type_name, n, k, spec.name, graph_m, True)
            if run >= 2 and spec.shape_reason(type_name, graph_m, n, k) is None:
                assert key in backend.graphs.replays, (kernel, m, run)
            if poisoned:
                assert got.finite is False and not np.isfinite(ys[1]).all(), kernel
                continue
            want = backend.run(spec, w, [x.copy() for x in xs], poison=True)  # step by step, never a graph
            scale = float(np.abs(want.output).max())
            np.testing.assert_allclose(np.concatenate(ys), want.output, rtol=1e-5, atol=1e-6 * scale,
                                       err_msg=f"{kernel} run {run}")
            assert got.finite is True or run == 0
        backend.unload(lambda key, wk=w.key: key == wk)


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_gemv_fused_is_gemv_bit_for_bit_in_one_launch(backend, rng: np.random.Generator, type_name: str) -> None:
    """gemv_fused (gemv.cu gemv1_fused: each block quantizes X to Q8_1 in its shared memory, then streams its rows)
    gives gemv's M = 1 products bit for bit, and the reference's: K not a multiple of 128 or of a chunk, N not a
    multiple of a block's 16 rows (and a single row), K whose Q8_1 takes more than 48 KiB of shared memory, X with an
    all-zero quant block, Y poisoned first."""
    fused, gemv = KERNELS["gemv_fused"], KERNELS["gemv"]
    reason = backend.kernel_reason(fused) or backend.kernel_reason(gemv)
    if reason:
        pytest.skip(reason)
    for n, k in ((300, 1440), (1, 32), (33, 49184)):
        w_f32 = (rng.standard_normal((n, k)) * rng.uniform(0.005, 0.05)).astype(np.float32)
        raw = quants.quantize(w_f32, GGMLQuantizationType[type_name])
        w = Weights(("fused", type_name, n, k), type_name, n, k, lambda raw=raw: raw)
        for run in range(2):
            x = (rng.standard_normal((1, k)) * rng.uniform(0.1, 10)).astype(np.float32)
            if k >= 64:
                x[0, 32:64] = 0.0  # d = 0 and q = 0 for that block
            got = backend.run(fused, w, x, poison=True)
            want = backend.run(gemv, w, x, poison=True)
            assert got.output.shape == (1, n) and np.isfinite(got.output).all(), (n, k, run)
            np.testing.assert_array_equal(got.output, want.output, err_msg=f"{type_name} N={n} K={k} run {run}")
            ref_y, terms = reference_product(type_name, raw, x, fused.activation_format)
            assert_matches(got.output, ref_y, terms, f"gemv_fused {type_name} N={n} K={k}")
        backend.unload(lambda key, wk=w.key: key == wk)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gemv_k_is_gemv_bit_for_bit_on_its_own_layout(backend, rng: np.random.Generator, monkeypatch,
                                                     type_name: str) -> None:
    """gemv_k (gemv.cu gemv1_q<n>_kr, gemv1_iq4_xsr: the sub-blocks as chunked rows, layouts.K_ROWS) gives gemv's M = 1
    products of the GGUF fields bit for bit, and the reference's: K not a whole chunk of 64 sub-blocks, N not a
    multiple of a block's 8 rows (and a single row), random scale, nibble and high-bit bytes (every code), X with
    an all-zero quant block, Y poisoned first.  gemv runs a warp a row here, as gemv_k does (Q5_K's gemv splits a
    row over 2 warps, whose two sums add in another order)."""
    from kernels.cuda import launch

    monkeypatch.setitem(launch.GROUPS_SPLIT, type_name, 1)
    kernel = "gemv_k"
    spec, gemv = KERNELS[kernel], KERNELS["gemv"]
    reason = backend.kernel_reason(spec) or backend.kernel_reason(gemv)
    if reason:
        pytest.skip(reason)
    for n, k in ((300, 2304), (1, 256), (37, 14336 + 256)):
        raw = groups.random_blocks(type_name, n, k, rng, float(rng.uniform(0.005, 0.05)))
        w = Weights(("k_rows", kernel, type_name, n, k), type_name, n, k, lambda raw=raw: raw)
        for run in range(2):
            x = (rng.standard_normal((1, k)) * rng.uniform(0.1, 10)).astype(np.float32)
            x[0, 32:64] = 0.0  # d = 0 and q = 0 for that block
            got = backend.run(spec, w, x, poison=True)
            want = backend.run(gemv, w, x, poison=True)
            assert got.output.shape == (1, n) and np.isfinite(got.output).all(), (n, k, run)
            np.testing.assert_array_equal(got.output, want.output,
                                          err_msg=f"{kernel} {type_name} N={n} K={k} run {run}")
            ref_y, terms = reference_product(type_name, raw, x, spec.activation_format)
            assert_matches(got.output, ref_y, terms, f"{kernel} {type_name} N={n} K={k}")
        backend.unload(lambda key, wk=w.key: key == wk)


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_code_books_at_m1_are_gemv_rows_bit_for_bit(backend, rng: np.random.Generator, monkeypatch,
                                                        type_name: str, split: int) -> None:
    """gemv's M = 1 kernel of the code-book formats (gemv.cu gemv_groups, LOOKAHEAD sub-blocks a lane in flight)
    adds its sub-blocks in gemv_rows' order (one a step), so a warp a row gives gemv_rows' M = 1 products bit for
    bit; split over 2 warps, the reference's.  K not a multiple of the lanes' steps, N not of a block's rows (and a
    single row), every code and scale byte, X with an all-zero quant block, Y poisoned."""
    from kernels.cuda import launch

    monkeypatch.setitem(launch.GROUPS_SPLIT, type_name, split)
    spec, rows = KERNELS["gemv"], KERNELS["gemv_rows"]
    reason = backend.kernel_reason(spec) or backend.kernel_reason(rows)
    if reason:
        pytest.skip(reason)
    for n, k in ((300, 2304), (1, 256), (37, 14336 + 256), (9, 32 * 33 * 8)):
        raw = groups.random_blocks(type_name, n, k, rng, float(rng.uniform(0.005, 0.05)))
        w = Weights(("codes1", type_name, split, n, k), type_name, n, k, lambda raw=raw: raw)
        x = (rng.standard_normal((1, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        x[0, 32:64] = 0.0  # d = 0 and q = 0 for that block
        got = backend.run(spec, w, x, poison=True)
        assert got.output.shape == (1, n) and np.isfinite(got.output).all(), (n, k)
        if split == 1:
            want = backend.run(rows, w, x, poison=True)
            np.testing.assert_array_equal(got.output, want.output, err_msg=f"{type_name} N={n} K={k}")
        ref_y, terms = reference_product(type_name, raw, x, spec.activation_format)
        assert_matches(got.output, ref_y, terms, f"gemv {type_name} S={split} N={n} K={k}")
        backend.unload(lambda key, wk=w.key: key == wk)


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_mmq_grids_of_several_waves(backend, weights_bank, rng: np.random.Generator, monkeypatch,
                                    type_name: str) -> None:
    """mmq on grids of more than one wave and without split-K, by pretending the GPU has 2 SMs."""
    if backend.kernel_reason(KERNELS["mmq"]) or KERNELS["mmq"].can_run(type_name, 300, 257, 96, backend.cc):
        pytest.skip("mmq does not run here")
    monkeypatch.setattr(backend.modules, "sm_count", 2)
    for m, n, k in ((300, 257, 96), (70, 257, 4096), (300, 33, 32)):
        check_kernel(backend, KERNELS["mmq"], type_name, weights_bank[(type_name, n, k)], rng.standard_normal((m, k)))


@pytest.mark.parametrize(("kernel", "type_name"), [("mmf_f16", "F16"), ("mmf_bf16", "BF16")])
def test_mmf_tails(backend, rng: np.random.Generator, kernel: str, type_name: str) -> None:
    """The float matrices' tensor-core kernel at 2-16 rows: one and two n8 tiles of activation rows, N past the
    last 16-row tile, K past the last 32-value chunk (a multiple of 8) and K of fewer chunks than the block has
    warps."""
    spec = KERNELS[kernel]
    for m, n, k in ((2, 17, 40), (8, 33, 200), (9, 31, 4104), (16, 257, 1000), (13, 64, 8), (5, 4096, 14336)):
        if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
            pytest.skip(f"{kernel} does not run here")
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType[type_name])
        check_kernel(backend, spec, type_name, raw, rng.standard_normal((m, k)), key=f"mmf {kernel} M={m} N={n} K={k}")


@pytest.mark.parametrize("kernel", ["mmq", "mmq_wgmma"])
@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_mmq_even_n_stores_pairs(backend, rng: np.random.Generator, kernel: str, type_name: str) -> None:
    """With N even, mmq writes each thread's two adjacent outputs as one 8-byte store, or one vector atomic
    where K is split (the other shapes here have odd N): a partial last tile, split-K over a few columns,
    and a tile that is whole in M and N."""
    spec = KERNELS[kernel]
    for m, n, k in ((130, 130, 96), (3, 130, 4096), (67, 2, 4096), (64, 256, 128)):
        if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
            pytest.skip(f"{kernel} does not run here")
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType[type_name])
        check_kernel(backend, spec, type_name, raw, rng.standard_normal((m, k)), key=f"even-n {kernel} M={m}")


@pytest.mark.parametrize("kernel", ["mmq", "mmq_wgmma", "gemv"])
@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_extreme_blocks(backend, rng: np.random.Generator, kernel: str, type_name: str) -> None:
    """Block dots at their limits: weight blocks of one extreme quant (Q8_0's -128 or 127, Q4_0/Q4_1's 0 or
    15, signed -8 or 7, Q5_0/Q5_1's 0 or 31 with every fifth bit alike, signed -16 or 15) against activation
    blocks of one value (every q_a = +-127).  The 2^19 bias of mmq's epilogue has to keep 2^19 + sumi
    non-negative down to sumi = 32 * 127 * -128."""
    spec = KERNELS[kernel]
    m, n, k = (65 if kernel.startswith("mmq") else 5), 130, 256
    if spec.can_run(type_name, m, n, k, backend.cc) or backend.kernel_reason(spec):
        pytest.skip(f"{kernel} does not run here")
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[type_name]).copy()
    fmt = FORMATS[GGMLQuantizationType[type_name]]
    quants_of = raw.reshape(n, k // 32, -1)[..., 2 * fmt.header_halves:]  # after the scales: fifth bits, quants
    pick = rng.integers(0, 3, size=(n, k // 32))  # 0: as quantized, 1: the lowest quant, 2: the highest
    low, high = (0x80, 0x7F) if type_name == "Q8_0" else (0x00, 0xFF)
    quants_of[pick == 1] = low
    quants_of[pick == 2] = high
    signs = rng.choice([-1.0, 1.0], size=(m, k // 32, 1)) * rng.uniform(0.5, 2.0, size=(m, k // 32, 1))
    x = np.broadcast_to(signs, (m, k // 32, 32)).reshape(m, k)
    check_kernel(backend, spec, type_name, raw, x, key=f"extreme {kernel}")


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_skinny_stages_splits_and_tails(backend, rng: np.random.Generator, type_name: str) -> None:
    """gemv at 2 <= M <= 8 (the skinny MMA, K staged through shared memory): every activation row count, K
    split over blocks or not, a last stage of one quant block, rows of scales not 16-byte aligned (K / 32 odd),
    N past the last 16-row block, and a deep K split into a zeroed output."""
    spec = KERNELS["gemv"]
    for m, n, k in ((2, 33, 1056), (8, 2113, 1056), (6, 257, 96), (8, 17, 14336), (5, 130, 4128), (3, 1, 32)):
        w = (rng.standard_normal((n, k)) * rng.uniform(0.005, 0.05)).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType[type_name])
        x = rng.standard_normal((m, k)) * rng.uniform(0.1, 10)
        check_kernel(backend, spec, type_name, raw, x, key=f"skinny {m} {n} {k}")


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_back_to_back_gemv_keeps_order(backend, weights_bank, rng: np.random.Generator, type_name: str) -> None:
    """M = 1 products queued on one stream with no host sync, sharing one activation buffer: each kernel may
    get resident before the one ahead ends (pdl.py), so each quantize must still wait for the gemv before it."""
    import cupy

    spec, n, k = KERNELS["gemv"], 257, 4096
    raw = weights_bank[(type_name, n, k)]
    xs = [(rng.standard_normal((1, k)) * scale).astype(np.float32) for scale in (1.0, 300.0, 0.003, 20.0)]
    with backend.stream:
        w = spec.weights.make(backend.modules, type_name, raw, n, k)
        layout = spec.activations_for(type_name)
        acts = layout.buffers(1, k)
        dx = [cupy.asarray(x) for x in xs]
        ys = [cupy.full((1, n), cupy.nan, dtype=cupy.float32) for _ in xs]
        for x, y in zip(dx, ys, strict=True):
            layout.fill(backend.modules, x, acts)
            spec.launch(backend.modules, type_name, w, acts, y, 1, n, k)
        backend.stream.synchronize()
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        want, terms = reference_product(type_name, raw, x, "q8_1_mmvq")
        assert_matches(cupy.asnumpy(y), want, terms, f"product {i} of {len(xs)}", same_q8_1=False)


@pytest.mark.parametrize(("kernel", "type_name"), [("cublas_f16", "Q8_0"), ("cublas_f32", "Q8_0"),
                                                   ("cublas_f16_h", "F16")])
def test_cublas_baselines_replay_from_a_graph(backend, weights_bank, rng: np.random.Generator, kernel: str,
                                              type_name: str) -> None:
    """The bench times every kernel from CUDA-graph replays, the cuBLAS kernels too: CuPy refuses cuBLAS
    calls during stream capture, so kernels/cuda/cublas.py calls it directly (and keeps the half outputs of
    cublas_f16_h in a buffer made before capture).  A replay equals a plain call."""
    import cupy

    spec, (m, n, k) = KERNELS[kernel], (17, 257, 4096)
    if backend.kernel_reason(spec):
        pytest.skip(backend.kernel_reason(spec))
    raw = weights_bank[(type_name, n, k)]
    x = rng.standard_normal((m, k)).astype(np.float16 if spec.activation_format in ("f16", "f16_h") else np.float32)
    with backend.stream as s:
        w = spec.weights.make(backend.modules, type_name, raw, n, k)
        xd = cupy.asarray(x)
        want, y = (cupy.full((m, n), cupy.nan, dtype=cupy.float32) for _ in range(2))
        spec.launch(backend.modules, type_name, w, xd, want, m, n, k)
        s.begin_capture()
        try:
            spec.launch(backend.modules, type_name, w, xd, y, m, n, k)
        finally:
            graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
    assert np.isfinite(cupy.asnumpy(want)).all()
    assert np.array_equal(cupy.asnumpy(y), cupy.asnumpy(want))


@pytest.mark.parametrize(("kernel", "type_name"), [("cublas_f16", "Q8_0"), ("cublas_f32", "Q8_0"),
                                                   ("cublas_f16_h", "F16")])
def test_cublas_baselines_without_ctypes(backend, weights_bank, rng: np.random.Generator, monkeypatch,
                                         kernel: str, type_name: str) -> None:
    """Where libcublas cannot be reached through ctypes, the cuBLAS kernels fall back to CuPy's cuBLAS call."""
    from kernels.cuda import cublas

    monkeypatch.setattr(cublas, "_lib", lambda: None)
    check_kernel(backend, KERNELS[kernel], type_name, weights_bank[(type_name, 257, 4096)],
                 rng.standard_normal((17, 4096)))


@pytest.mark.parametrize("entry", ["to_f16", "to_bf16", "widen_f16"])
@pytest.mark.parametrize(("size", "offset"), [(1, 0), (7, 0), (4103, 0), (4103, 1), (65536 + 9, 3), (8 * 4096, 0)])
def test_casts_round_as_one_value_a_thread(backend, rng: np.random.Generator, entry: str, size: int,
                                           offset: int) -> None:
    """w16.cu's casts (eight values a thread where aligned, one at a time in the tail and where not) give numpy's
    bits: fp32 to fp16 and to bf16 to nearest even (ties, subnormals, overflow to inf and NaN included), fp16 to
    fp32 exactly.  Odd sizes and views one to three elements into a buffer reach the tail and the unaligned path;
    outputs poisoned."""
    import cupy

    from kernels.cuda import layouts as L

    x = (rng.standard_normal(size + offset) * np.exp(rng.uniform(-30, 30, size + offset))).astype(np.float32)
    x[rng.integers(0, size + offset, max(1, size // 50))] = np.float32(np.nan)
    x[:: 97] = np.float32(1 + 2.0 ** -11)  # a tie at fp16: to even
    with np.errstate(over="ignore"):  # beyond fp16's range: inf, as on the GPU
        x16 = x.astype(np.float16)
    if entry == "widen_f16":
        src = x16
        want = src[offset:].astype(np.float32)
    elif entry == "to_f16":
        src, want = x, x16[offset:].view(np.uint16)
    else:
        src, want = x, _bf16_nearest_even(x[offset:])
    out_dtype = np.float32 if entry == "widen_f16" else np.uint16
    with backend.stream as s:
        src_d = cupy.asarray(src)[offset:]
        out = cupy.full(size + offset, 0xFFFF if out_dtype == np.uint16 else np.nan, dtype=out_dtype)[offset:]
        L.cast(backend.modules, entry, src_d, out)
        s.synchronize()
    got, nan = cupy.asnumpy(out), np.isnan(x[offset:])  # a NaN's bits are CUDA's own (ggml's too): any NaN will do
    as_float = {"to_f16": lambda b: b.view(np.float16), "to_bf16": lambda b: (b.astype(np.uint32) << 16).view(
        np.float32), "widen_f16": lambda v: v}[entry]
    assert np.isnan(as_float(got)[nan]).all()
    assert np.array_equal(got[~nan], want[~nan])


def _bf16_nearest_even(x: np.ndarray) -> np.ndarray:
    """fp32 to bf16 bits, to nearest even (NaNs left out by the caller)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _f16_halves(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16)


def _bf16_bits(w: np.ndarray) -> np.ndarray:
    return (w.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: any bits will do


@pytest.mark.parametrize("k", [8, 64, 200, 264, 776, 1032, 4096, 14336])
@pytest.mark.parametrize(("kernel", "type_name", "stored", "oracle"), [
    ("mmvf_f16", "F16", _f16_halves, "ref_f16_mmvf"), ("mmv_bf16", "BF16", _bf16_bits, "ref_bf16_mmvf")])
def test_mul_mat_vec_f_is_ggml_bit_for_bit(backend, rng: np.random.Generator, k: int, kernel: str, type_name: str,
                                           stored, oracle: str) -> None:
    """mmvf_f16 and mmv_bf16 equal ggml's mul_mat_vec_f bit for bit (reference.ref_f16_mmvf: half2 FMAs per thread;
    ref_bf16_mmvf: float fmaf sums per thread; then the block's butterflies): one or two 128-thread halves of ggml's
    block (bs from 32 to 256), ragged last steps; N = 131 leaves the last block of 4 rows short.  Weights of mixed
    scale exercise the rounding."""
    import cupy

    from kernels import reference

    spec, n = KERNELS[kernel], 131
    w = stored((rng.standard_normal((n, k)) * np.exp2(rng.integers(-6, 3, (n, 1)))).astype(np.float32))
    x = rng.standard_normal((1, k)).astype(np.float32)
    with backend.stream as s:
        wd = spec.weights.make(backend.modules, type_name, w, n, k)
        y = cupy.full((1, n), cupy.nan, dtype=cupy.float32)
        spec.launch(backend.modules, type_name, wd, cupy.asarray(x), y, 1, n, k)
        s.synchronize()
    want = getattr(reference, oracle)(w, x)
    np.testing.assert_array_equal(cupy.asnumpy(y).view(np.uint32), want.view(np.uint32))


def test_every_cuda_kernel_is_available(backend) -> None:
    for name in CUDA_KERNELS:  # every kernel this GPU's architecture can run is built and launchable
        if KERNELS[name].device_reason(backend.cc) is None:
            assert backend.kernel_reason(KERNELS[name]) is None, name


# ---- the service on the CUDA backend ---------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_models_dir() -> Path:
    d = Settings.from_env().models_dir
    ensure_demo(d)
    return d


def smol_model(d: Path) -> str | None:
    for p in sorted(d.glob("SmolLM2-135M-Instruct*.gguf")):
        if any(t.name == "token_embd.weight" for t in GGUFReader(p).tensors):
            return p.name[:-5]
    return None


@pytest.fixture(scope="module")
def gpu_client(gpu_models_dir: Path):
    from tests.conftest import make_client

    with make_client(gpu_models_dir, backend="cuda") as c:
        yield c


@functools.cache
def _reference_weights(path: Path, name: str, activation_format: str) -> tuple[str, np.ndarray, object]:
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    type_name = GGMLQuantizationType(int(t.tensor_type)).name
    return type_name, t.data, prepare(type_name, t.data, activation_format)


def check_answer(path: Path, name: str, x: np.ndarray, y: np.ndarray, activation_format: str) -> None:
    """An API answer against the reference of the kernel's activation format, the activations quantized here."""
    type_name, raw, prepared = _reference_weights(path, name, activation_format)
    want, terms = reference_product(type_name, raw, x, activation_format, prepared=prepared)
    assert_matches(y, want, terms, f"{path.name}/{name} {activation_format}", same_q8_1=False)


@pytest.mark.parametrize("name,k", [("blk.0.attn_q.weight", 4096), ("blk.0.attn_k.weight", 4096),
                                    ("blk.0.ffn_down.weight", 14336), ("blk.1.ffn_down.weight", 14336)])
def test_api_on_gpu_demo_tensors(gpu_client, gpu_models_dir: Path, rng: np.random.Generator, name: str,
                                 k: int) -> None:
    assert gpu_client.get("/healthz").json()["backend"] == "cuda"
    xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in (1, 37)}
    for kernel in ["auto", *CUDA_KERNELS]:
        for m, x in xs.items():
            if kernel != "auto" and KERNELS[kernel].shape_reason("Q4_0", m, 4096, k):
                continue  # a kernel that says it cannot run this M (gemv above 8) is tested for its 422 elsewhere
            buf = io.BytesIO()
            np.save(buf, x)
            r = gpu_client.post(f"/v1/matmul?model=demo&tensor={name}&kernel={kernel}", content=buf.getvalue(),
                                headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
            assert r.status_code == 200, r.text
            assert r.headers["x-qgemm-backend"] == "cuda"
            check_answer(gpu_models_dir / "demo.gguf", name, x, np.load(io.BytesIO(r.content)),
                         r.headers["x-qgemm-activation-format"])
            assert "gemm;dur=" in r.headers["server-timing"]


def test_api_on_gpu_smollm2_token_embd(gpu_client, gpu_models_dir: Path, rng: np.random.Generator) -> None:
    model = smol_model(gpu_models_dir)
    if model is None:
        pytest.skip("no SmolLM2 file with token_embd.weight in the models directory")
    x = rng.standard_normal((4, 576)).astype(np.float32)
    r = gpu_client.post("/v1/matmul", json={"model": model, "tensor": "token_embd.weight", "activations": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["backend"] == "cuda" and body["shape"] == [4, 49152]
    check_answer(gpu_models_dir / f"{model}.gguf", "token_embd.weight", x, np.array(body["output"]),
                 body["activation_format"])
    assert {"upload", "quantize", "gemm", "download", "total"} <= set(body["timing_ms"])


def matmul_both_ways(client, model: str, name: str, x: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """The product through JSON and through .npy (auto): [(output, activation format)] of both answers."""
    r = client.post("/v1/matmul", json={"model": model, "tensor": name, "activations": x.tolist()})
    assert r.status_code == 200, (name, r.text)
    assert r.json()["backend"] == "cuda"
    out = [(np.array(r.json()["output"], dtype=np.float32), r.json()["activation_format"])]
    buf = io.BytesIO()
    np.save(buf, x)
    r = client.post(f"/v1/matmul?model={model}&tensor={name}", content=buf.getvalue(),
                    headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200, (name, r.text)
    out.append((np.load(io.BytesIO(r.content)), r.headers["x-qgemm-activation-format"]))
    return out


def test_api_on_gpu_every_matrix_of_smollm2(gpu_client, gpu_models_dir: Path, rng: np.random.Generator) -> None:
    """Every 2-D tensor of every SmolLM2 file (or cut of one) in the models directory, through JSON and .npy,
    at M = 1, 5 and 37 (llama.cpp's MMVQ and MMQ formulas), against the reference; 1-D tensors are refused."""
    files = sorted(gpu_models_dir.glob("SmolLM2-135M-Instruct*.gguf"))
    if not files:
        pytest.skip("no SmolLM2 file in the models directory")
    seen = set()
    for path in files:
        model = path.name[:-5]
        for t in GGUFReader(path).tensors:
            if len(t.shape) != 2:
                r = gpu_client.post("/v1/matmul", json={"model": model, "tensor": t.name, "activations": [[1.0]]})
                assert r.status_code == 422, (t.name, r.text)
                continue
            k = int(t.shape[0])
            for m in (1, 5, 37):
                x = rng.standard_normal((m, k)).astype(np.float32)
                for y, fmt in matmul_both_ways(gpu_client, model, t.name, x):
                    check_answer(path, t.name, x, y, fmt)
            seen.add(GGMLQuantizationType(int(t.tensor_type)).name)
    assert seen, "no matrix multiplied"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_api_on_gpu_demo_formats(gpu_client, gpu_models_dir: Path, rng: np.random.Generator, type_name: str) -> None:
    """The demo's small and tiny tensors of every format, auto through JSON and .npy, at M = 1, 2, 9, 300."""
    reader = GGUFReader(gpu_models_dir / "demo.gguf")
    names = [t.name for t in reader.tensors if t.name in (f"small.{type_name.lower()}.weight",
                                                          f"tiny.{type_name.lower()}.weight")]
    assert names
    for name in names:
        k = int(next(t for t in reader.tensors if t.name == name).shape[0])
        for m in (1, 2, 9, 300):
            x = rng.standard_normal((m, k)).astype(np.float32)
            for y, fmt in matmul_both_ways(gpu_client, "demo", name, x):
                check_answer(gpu_models_dir / "demo.gguf", name, x, y, fmt)


def test_load_unload_and_residency(gpu_client) -> None:
    r = gpu_client.post("/v1/models/demo/load", json={"tensors": ["small.q4_0.weight"]})
    assert r.status_code == 200, r.text
    res = gpu_client.get("/v1/models/demo").json()["resident"]
    assert res["backend"] == "cuda" and any(t["tensor"] == "small.q4_0.weight" for t in res["tensors"])
    r = gpu_client.post("/v1/models/demo/unload", json={"tensors": ["small.q4_0.weight"]})
    assert r.status_code == 200 and r.json()["freed_bytes"] > 0
    res = gpu_client.get("/v1/models/demo").json()["resident"]
    assert not any(t["tensor"] == "small.q4_0.weight" for t in res["tensors"])
    assert gpu_client.post("/v1/models/demo/load", json={"tensors": ["nope"]}).status_code == 404


def test_out_of_range_activations_are_refused_before_gpu_work(gpu_client) -> None:
    """A Q8_1 block whose half scale or sum would be infinite: 422 on the CUDA backend too, naming the block,
    and the next product on the same client still answers."""
    x = [[0.25] * 64, [0.5] * 40 + [3000.0] * 24]  # row 1, block 1 sums to 72,000 > 65,504
    for kernel in ("auto", "gemv", "mmq"):
        r = gpu_client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "kernel": kernel,
                                                "activations": x})
        assert r.status_code == 422 and r.json()["error"]["code"] == "activation_out_of_range", r.text
        assert "row 1, block 1" in r.json()["error"]["message"]
    r = gpu_client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q8_0.weight", "activations": x})
    assert r.status_code == 200 and r.headers["X-Qgemm-Backend"] == "cuda", r.text  # Q8_0 never reads s_a


def test_memory_budget_evicts_and_refuses(gpu_models_dir: Path, rng: np.random.Generator) -> None:
    from tests.conftest import make_client

    budget = 40_000  # holds one small tensor (13.9 KB Q4_0, 26.2 KB Q8_0) at a time
    # one device's budget: on a host of several GPUs the tensors would spread over their budgets
    with make_client(gpu_models_dir, backend="cuda", gpu_memory_bytes=budget, devices="0") as c:
        x = rng.standard_normal((2, 96)).astype(np.float32)
        for name in ("small.q4_0.weight", "small.q8_0.weight", "small.q4_0.weight"):
            body = {"model": "demo", "tensor": name, "kernel": "dp4a", "activations": x.tolist()}
            r = c.post("/v1/matmul", json=body)
            assert r.status_code == 200, r.text
            res = c.get("/v1/models/demo").json()["resident"]
            assert [t["tensor"] for t in res["tensors"]] == [name] and res["n_bytes"] <= budget
        r = c.post("/v1/matmul", json={"model": "demo", "tensor": "blk.0.attn_q.weight", "kernel": "dp4a",
                                       "activations": [[0.1] * 4096]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "gpu_out_of_memory"
        assert "QGEMM_GPU_MEMORY_BYTES" in r.json()["error"]["message"]
        r = c.post("/v1/matmul", json={"model": "demo", "tensor": "small.q8_0.weight", "activations": x.tolist()})
        assert r.status_code == 200  # and it keeps serving


def test_concurrent_requests(gpu_client, gpu_models_dir: Path) -> None:
    names = ["small.q4_0.weight", "small.q8_0.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight"]
    ks = {"small.q4_0.weight": 96, "small.q8_0.weight": 96, "blk.0.attn_q.weight": 4096, "blk.0.attn_k.weight": 4096}
    errors: list[str] = []

    def worker(i: int) -> None:
        r_ = np.random.default_rng(stream_seed(f"tests/test_gpu.py::test_concurrent_requests {i}"))
        name = names[i % len(names)]
        kernel = ["auto", "tiled_dp4a", "vec_dp4a", "dp4a"][i % 4]
        for _ in range(5):
            x = r_.standard_normal((int(r_.integers(1, 40)), ks[name])).astype(np.float32)
            r = gpu_client.post("/v1/matmul", json={"model": "demo", "tensor": name, "kernel": kernel,
                                                    "activations": x.tolist()})
            if r.status_code != 200:
                errors.append(r.text)
                continue
            try:
                check_answer(gpu_models_dir / "demo.gguf", name, x, np.array(r.json()["output"]),
                             r.json()["activation_format"])
            except AssertionError as exc:
                errors.append(f"{kernel}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


@pytest.mark.parametrize("kernel", ["auto", "mmq", "tiled_dp4a"])
def test_large_outputs_go_straight_into_reused_pinned_memory(gpu_client, gpu_models_dir: Path,
                                                             rng: np.random.Generator, kernel: str) -> None:
    """An output of 1 MiB or more is copied by the GPU into a pinned array of the engine's pool, which reuses a
    freed buffer: the buffer is poisoned (NaN) first, so every value of the answer must come from this product;
    the device's finiteness check passes it."""
    engine = gpu_client.app.state.engine
    name, m = "blk.0.ffn_down.weight", 300  # [4096, 14336]: 300 x 4096 floats out, 4.9 MB
    stale = engine.outputs.array((m, 4096))
    assert stale is not None
    stale[...] = np.nan
    held = engine.outputs.held
    del stale  # back to the free list: the next output of its size class gets it
    x = rng.standard_normal((m, 14336)).astype(np.float32)
    r = gpu_client.post(f"/v1/matmul?model=demo&tensor={name}&kernel={kernel}", content=_npy(x),
                        headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert engine.outputs.held == held  # the poisoned buffer was reused, nothing new was pinned
    metric = next(line for line in gpu_client.get("/metrics").text.splitlines()
                  if line.startswith("qgemm_pinned_output_bytes "))
    assert float(metric.split()[1]) == held > 0
    y = np.load(io.BytesIO(r.content), allow_pickle=False)
    check_answer(gpu_models_dir / "demo.gguf", name, x, y, r.headers["x-qgemm-activation-format"])


def test_an_output_array_outlives_its_request_until_the_device_wrote_it(gpu_client, rng: np.random.Generator) -> None:
    """A request cancelled after its launch drops its output array: the backend keeps it until the device's copy
    into it is done (else the pool could hand the buffer to a product on another device under that copy), and
    lets it go at a later launch."""
    engine = gpu_client.app.state.engine
    cuda, name = engine.gpu, "blk.0.ffn_down.weight"
    model = next(m for m in gpu_client.app.state.store.scan() if m.id == "demo")
    info = model.tensors[name]
    w, spec = weights(model, info), engine.choose("mmq", info, 300)
    refs = []
    for _ in range(2):
        out = engine.outputs.array((300, 4096))
        refs.append(weakref.ref(out))
        pending = cuda.launch(spec, w, [rng.standard_normal((300, 14336)).astype(np.float32)], outs=[out])
        del out  # the request is gone
        assert refs[-1]() is not None  # held while the device writes it
        cuda.events[4].synchronize()
        assert cuda.finish(pending).output is None
    assert refs[0]() is None and refs[1]() is not None  # the second launch let the first go; the second waits


def test_a_large_output_that_overflows_is_found_on_the_device(gpu_client, gpu_models_dir: Path,
                                                              rng: np.random.Generator) -> None:
    """Past FINITE_ON_DEVICE values the device says whether the output is finite; an overflow is still a 422
    naming its row and column (found on the host once the device says there is one)."""
    name = "blk.0.attn_q.weight"
    type_name, raw, _ = _reference_weights(gpu_models_dir / "demo.gguf", name, "f32")
    w = ref.dequantize_weights(type_name, raw)
    col = int(np.abs(w).sum(axis=1).argmax())
    x = rng.standard_normal((70, 4096)).astype(np.float32)  # 70 x 4096 outputs: checked on the device
    x[37] = 3.3e38 * np.sign(w[col]) / max(1.0, float(np.abs(w[col]).sum()) / 1.5)
    assert abs((x[37].astype(np.float64) * w[col]).sum()) > 3.5e38  # past float32's largest, 3.4e38
    r = gpu_client.post(f"/v1/matmul?model=demo&tensor={name}&kernel=cublas_f32", content=_npy(x),
                        headers={"Content-Type": "application/x-npy"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "product_out_of_range", r.text
    assert f"row 37, column {col}" in r.json()["error"]["message"]


def test_large_activations_are_checked_from_the_devices_row_maxima(gpu_client, rng: np.random.Generator) -> None:
    """X of more than 64K values is checked from the max|x| per row the device measures (no pass over X on the
    host): a NaN or a Q8_1 overflow is still a 422 naming its place; values past the quick bound but in range
    multiply; and a bad request batched with good ones leaves their rows exact."""
    name, k = "blk.0.attn_q.weight", 4096
    engine = gpu_client.app.state.engine
    model = next(mm for mm in gpu_client.app.state.store.scan() if mm.id == "demo")
    info = model.tensors[name]

    def x_of(seed: str) -> np.ndarray:
        return np.random.default_rng(stream_seed(seed)).standard_normal((24, k)).astype(np.float32)  # 98,304 values

    nan, overflow, big = x_of("nan"), x_of("overflow"), x_of("big")
    nan[13, 2001] = np.nan
    overflow[7, 160:184] = 3000.0  # row 7, block 5 sums past 65,504
    big[3, 0] = 5000.0  # max|x| * 32 passes half's range, but neither d (39.4) nor block 0's sum does
    for x, code, where in ((nan, "non_finite", "row 13, column 2001"),
                           (overflow, "activation_out_of_range", "row 7, block 5")):
        r = gpu_client.post(f"/v1/matmul?model=demo&tensor={name}&kernel=mmq", content=_npy(x),
                            headers={"Content-Type": "application/x-npy"})
        error = r.json()["error"]
        assert r.status_code == 422 and error["code"] == code and where in error["message"], r.text
    good = [x_of(f"good {i}") for i in range(3)] + [big]
    alone = [gpu_client.portal.call(engine.matmul, model, info, x, "mmq").output.copy() for x in good]

    async def together() -> list:
        return await asyncio.gather(*(engine.matmul(model, info, x, "mmq") for x in [nan, *good, overflow]),
                                    return_exceptions=True)

    answers = gpu_client.portal.call(together)
    statuses = [status_of(a) if isinstance(a, QgemmError) else getattr(a, "status", None) for a in answers]
    assert statuses == [422, None, None, None, None, 422]
    for a, y in zip(answers[1:5], alone, strict=True):  # equal up to the order a split-K kernel sums in
        assert np.sum((a.output.astype(np.float64) - y) ** 2) / np.sum(y.astype(np.float64) ** 2) < 1e-10


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


@pytest.mark.parametrize("kernel", ["auto", "mmq", "gemv"])
def test_batched_requests_get_their_rows_of_the_batch_product(gpu_models_dir: Path, kernel: str) -> None:
    """16 clients at once on one tensor (CUDA backend, batching on): each answer is exactly its rows of the
    batch's product, each row meets the reference's bound (the rows of a product are independent; split-K
    kernels such as mmq at some M sum in an order that varies from run to run, so bits are compared with the
    batch's own product, not with a re-run), and some requests did run together."""
    from tests.conftest import make_client

    name, k = "blk.0.attn_q.weight", 4096
    with make_client(gpu_models_dir, backend="cuda", devices="0") as c:  # one device's batching, whatever the host
        engine = c.app.state.engine
        ran: list[tuple[object, list[np.ndarray], np.ndarray]] = []
        scheduler = engine.pools["cuda"][0].scheduler
        run_batch = scheduler.run_batch

        async def recording(context, spec, parts, alone=False, outs=None, rows_at=None):
            if alone:  # hold the device a little, so that the others queue behind it and batch
                await asyncio.sleep(0.05)
            spec_ran, result = await run_batch(context, spec, parts, alone, outs, rows_at)  # small outputs: no outs
            ran.append((spec_ran, [p.copy() for p in parts], result.output.copy()))
            return spec_ran, result

        scheduler.run_batch = recording
        xs = [np.random.default_rng(stream_seed(f"batched {kernel} {i}")).standard_normal((1 + i % 2, k))
              .astype(np.float32) for i in range(16)]

        def post(x: np.ndarray):
            return c.post("/v1/matmul", json={"model": "demo", "tensor": name, "kernel": kernel,
                                              "activations": x.tolist()})

        post(xs[0])  # weights uploaded once, outside the race
        ran.clear()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(post, xs))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:2]
        assert max(r.json()["batch"]["requests"] for r in answers) > 1
        rows = {tuple(p[0, :4]): (out, sum(q.shape[0] for q in parts[:i]))
                for spec, parts, out in ran for i, p in enumerate(parts)}
        for x, r in zip(xs, answers, strict=True):
            out, row = rows[tuple(x[0, :4])]
            y = np.array(r.json()["output"], dtype=np.float32)
            assert np.array_equal(y, out[row:row + x.shape[0]])  # its own rows, handed back whole
            check_answer(gpu_models_dir / "demo.gguf", name, x, y, r.json()["activation_format"])
