"""The kernel registry: every registered kernel is whole (the formula it computes, a weight layout, an activation
layout for each type it takes, a way to run), and every kernel this machine can run runs every type it takes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kernels import accuracy, groups
from kernels.cpu import CpuBackend, CpuKernel
from kernels.cuda.kernels import CudaKernel
from kernels.cuda.modules import SOURCES
from kernels.formats import BNB4_TYPES, MATMUL_TYPES, format_of
from kernels.kernel import FORMULAS, Layout
from kernels.registry import KERNELS, cpu_reference, known_names, llama_formula, register
from kernels.requant import Scheme, requantize
from kernels.select import KernelChooser
from kernels.types import Weights
from tests.oracles import assert_matches, reference_product

N, K = 33, 256  # odd N; K whole blocks of every format (256: the K-quants' super-block)


def random_raw(type_name: str, rng: np.random.Generator) -> object:
    """Fresh random weights of a type, as its tensors hold them."""
    if type_name in BNB4_TYPES:
        return requantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), Scheme(type_name.lower()))
    if format_of(type_name).grouped:
        return groups.random_blocks(type_name, N, K, rng)
    return quants.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), GGMLQuantizationType[type_name])


def test_every_kernel_declares_what_it_reads_and_how_it_runs() -> None:
    assert known_names()[0] == "auto" and set(known_names()[1:]) == set(KERNELS)
    for kernel in KERNELS.values():
        assert kernel.activation_format in FORMULAS, kernel.name
        assert kernel.weight_types and set(kernel.weight_types) <= MATMUL_TYPES, kernel.name
        assert isinstance(kernel.weights, Layout), kernel.name
        for t in kernel.weight_types:
            acts = kernel.activations_for(t)
            assert isinstance(acts, Layout), (kernel.name, t)
        if isinstance(kernel, CudaKernel):  # a launch of its own, a source this server compiles, a byte count
            assert type(kernel).launch is not CudaKernel.launch, kernel.name
            assert kernel.source in SOURCES, kernel.name
            for t in kernel.weight_types:
                assert kernel.activations_for(t).quantized == kernel.quantizes, (kernel.name, t)
                assert kernel.weights.nbytes(t, N, K) > 0, (kernel.name, t)
        else:
            assert isinstance(kernel, CpuKernel) and callable(kernel.gemm), kernel.name
    for formula in FORMULAS:  # every formula has its numpy twin, the ground truth of the GPU kernels
        assert cpu_reference(formula).activation_format == formula


def test_a_kernel_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register(KERNELS["gemv"])


def _walk(run, names: list[str], rng: np.random.Generator) -> None:
    """Each kernel on each type it takes, at its largest M up to 3: the product of the llama.cpp formula it
    declares, within that formula's rounding bound (tests/oracles.py; the kernel quantized X on its own, so one
    half-precision ulp of s_a more).  A fixed NMSE against the FP64 product failed by chance: Q8_1's rounding
    of 33 outputs at M = 1 spreads its NMSE over a decade (Q4_1 reached 1.02e-3 on an H200)."""
    for name in names:
        kernel = KERNELS[name]
        m = min(3, kernel.max_m or 3)
        for t in kernel.weight_types:
            raw = random_raw(t, rng)
            x = rng.standard_normal((m, K)).astype(np.float32)
            y = run(kernel, Weights(("registry", name, t), t, N, K, lambda raw=raw: raw), x)  # a key per raw
            assert y.shape == (m, N) and np.isfinite(y).all(), (name, t)
            want, terms = reference_product(t, raw, x, kernel.activation_format)
            assert_matches(y, want, terms, f"{name} {t}", same_q8_1=False)


def test_every_cpu_kernel_runs_every_type_it_takes(rng: np.random.Generator) -> None:
    cpu = CpuBackend(1 << 26)
    try:
        _walk(lambda kernel, w, x: cpu.run(kernel, w, x).output,
              [n for n, s in KERNELS.items() if s.backend == "cpu"], rng)
    finally:
        cpu.close()


@pytest.mark.gpu
def test_every_cuda_kernel_runs_every_type_it_takes(rng: np.random.Generator) -> None:
    from app.settings import Settings
    from kernels.cuda.backend import CudaBackend

    cuda = CudaBackend(Settings(backend="cuda"))
    try:
        names = [n for n, s in KERNELS.items() if s.backend == "cuda" and cuda.kernel_reason(s) is None]
        assert "gemv" in names and "mmq" in names, names
        _walk(lambda kernel, w, x: cuda.run(kernel, w, x, poison=True).output, names, rng)
    finally:
        cuda.close()


@pytest.mark.parametrize(("m", "n", "k", "f16", "bf16"), [
    (1, 96, 512, "f16_mmvf", "f32"),  # mul_mat_vec_f
    (2, 96, 512, "f16", "bf16"),  # mul_mat_f: up to 16 rows, N % 32, K % 64
    (16, 4096, 14336, "f16", "bf16"),
    (17, 96, 512, "f16_h", "bf16"),  # above 16 rows: cuBLAS (F16 in half)
    (2, 95, 512, "f16_h", "bf16"),  # N not a multiple of mmf's 32 rows a block
    (8, 96, 544, "f16_h", "bf16"),  # K not a multiple of 64 values
    (256, 4096, 4096, "f16_h", "bf16"),
])
def test_float_matrices_take_ggml_s_formula_by_shape(m: int, n: int, k: int, f16: str, bf16: str) -> None:
    """ggml picks a float matrix's kernel by M and shape (ggml_cuda_mul_mat: mmvf, mmf, cuBLAS); F16's three
    round differently, so `auto` must follow the shape, not M alone.  BF16 sums in fp32 in mmf and cuBLAS alike."""
    assert llama_formula(m, "F16", n, k) == f16 and llama_formula(m, "BF16", n, k) == bf16
    assert llama_formula(m, "Q4_0", n, k) == ("q8_1_mmvq" if m <= 8 else "q8_1_mmq")
    chooser = KernelChooser(None)
    assert chooser.auto("F16", m, n, k).activation_format == f16


def test_the_f16_h_twin_rounds_half_sums_within_their_bound(rng: np.random.Generator) -> None:
    """ref_f16_h (cuBLAS's half sums, whose order is the library's own) against the FP64 product: within one
    half-precision rounding a k16 step; it is not bit for bit, so parity does not hold it to ggml.  At small K the
    bound still separates: the product without its last block of 16 values fails it."""
    from tests.oracles import reference_product

    spec = KERNELS["ref_f16_h"]
    assert not spec.exact and cpu_reference("f16_h") is spec
    cpu = CpuBackend(1 << 26)
    try:
        for m, n, k in ((2, 31, 64), (17, 33, 96), (5, 7, 1024)):
            raw = (rng.standard_normal((n, k)) * 0.05).astype(np.float16)
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = cpu.run(spec, Weights(("f16h", n, k), "F16", n, k, lambda raw=raw: raw), x).output
            want, terms = reference_product("F16", raw, x, "f16_h")
            assert np.array_equal(y, y.astype(np.float16).astype(np.float32))  # half outputs
            assert accuracy.compare(y, want, terms).ok, (m, n, k)
            if k <= 96:  # a wrong formula fails: the last 16 values dropped
                xs = x.copy()
                xs[:, -16:] = 0
                wrong = reference_product("F16", raw, xs, "f16")[0]
                assert not accuracy.compare(wrong, want, terms).ok, (m, n, k)
    finally:
        cpu.close()


class _Hopper:  # what kernels/tuning asks of a GPU backend: its compute capability, and that every kernel is built
    cc = 90

    @staticmethod
    def kernel_reason(kernel: object) -> None:
        return None


@pytest.mark.parametrize(("type_name", "m", "n", "k", "kernel"), [
    ("BF16", 1, 4096, 4096, "mmv_bf16"),  # not cublas_f32, which computes the same formula from an fp32 copy
    ("F16", 1, 4096, 4096, "mmvf_f16"),
    ("F16", 8, 4096, 4096, "cublas_f16"),  # ggml's mul_mat_f: fp32 sums
    ("F16", 8, 4095, 4096, "cublas_f16_h"),  # ggml's cuBLAS call: half sums
    ("F16", 32, 4096, 4096, "cublas_f16_h"),
    ("BF16", 8, 4096, 4096, "cublas_bf16"),
])
def test_auto_on_a_gpu_picks_ggml_s_float_kernel(type_name: str, m: int, n: int, k: int, kernel: str) -> None:
    from kernels import tuning

    assert tuning.pick(_Hopper(), type_name, m, n, k).name == kernel


class _AnyGpu:
    """What `pick` asks of a backend: a compute capability, every module built."""

    def __init__(self, cc: int) -> None:
        self.cc = cc

    def kernel_reason(self, kernel: object) -> None:
        return None


AUTO_SNAPSHOT = Path(__file__).parent / "data" / "auto_picks.json"


def _auto_picks() -> dict[str, str]:
    from kernels.tuning import pick

    picks = {}
    types = sorted(MATMUL_TYPES)
    for cc in (80, 90):
        for t in types:
            for m in (1, 2, 3, 5, 8, 9, 16, 17, 32, 64, 65, 128, 256, 512, 1024):
                for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (576, 1536), (49152, 576)):
                    spec = pick(_AnyGpu(cc), t, m, n, k)
                    picks[f"sm_{cc} {t} M={m} N={n} K={k}"] = spec.name if spec is not None else "cpu reference"
    return picks


def test_auto_picks_are_those_of_the_snapshot() -> None:
    """auto's choice for every format, compute capability 8.0 and 9.0, M from 1 to 1,024 on real models' shapes,
    against a committed snapshot: a refactor must not move a pick (a deliberate change of the table or of a kernel
    writes a new snapshot: QGEMM_UPDATE_AUTO_PICKS=1)."""
    picks = _auto_picks()
    if os.environ.get("QGEMM_UPDATE_AUTO_PICKS"):
        AUTO_SNAPSHOT.write_text(json.dumps(picks, indent=0, sort_keys=True) + "\n")
    want = json.loads(AUTO_SNAPSHOT.read_text())
    moved = {key: (want.get(key), got) for key, got in picks.items() if want.get(key) != got}
    assert not moved, f"{len(moved)} picks moved, e.g. {list(moved.items())[:5]}"


def test_the_fused_gemv_says_which_k_its_shared_memory_holds() -> None:
    """gemv_fused keeps X's Q8_1 (K * 9 / 8 bytes) in one block's shared memory: past that K it says so (a 422
    naming the kernels that can), and `auto` never picks it there."""
    from kernels.cuda.kernels import FUSED_MAX_K
    from kernels.tuning import pick

    spec = KERNELS["gemv_fused"]
    assert FUSED_MAX_K * 9 // 8 <= 163 * 1024 and FUSED_MAX_K % 32 == 0
    assert spec.can_run("Q4_0", 1, 4096, FUSED_MAX_K, 80) is None
    assert "shared memory" in spec.can_run("Q4_0", 1, 4096, FUSED_MAX_K + 32, 80)
    assert "M <= 1" in spec.can_run("Q4_0", 2, 4096, 4096, 90)
    assert pick(_AnyGpu(90), "Q4_0", 1, 4096, FUSED_MAX_K + 32).name == "gemv"


def test_auto_takes_the_fused_gemv_on_weights_of_the_size_it_measured_faster() -> None:
    """gemv_fused streams large weights slower than gemv (half the warps an SM): `auto` takes it for M = 1 products
    of up to FUSED_AUTO_MAX_BYTES of weights (Q8_0 [4096, 4096], SmolLM2's blocks), not for SmolLM2's Q8_0 LM head."""
    from kernels.cuda.kernels import FUSED_AUTO_MAX_BYTES
    from kernels.tuning import pick

    assert 4096 * 4096 * 34 // 32 <= FUSED_AUTO_MAX_BYTES < 49152 * 576 * 34 // 32
    assert pick(_AnyGpu(90), "Q8_0", 1, 4096, 4096).name == "gemv_fused"
    assert pick(_AnyGpu(90), "Q4_1", 1, 576, 1536).name == "gemv_fused"
    assert pick(_AnyGpu(90), "Q8_0", 1, 49152, 576).name == "gemv"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_auto_takes_the_k_quants_own_layout_where_it_measured_faster(type_name: str) -> None:
    """gemv_k (the K-quants' sub-blocks as chunked rows) streamed K = 14336 faster than gemv on the GGUF fields and
    K = 4096 slower (the tuned table): `auto` takes it at M = 1 from K of about 7,600 (the table's entries nearest in
    log K), gemv below, and never at M > 1 or for other formats."""
    from kernels.tuning import pick

    assert pick(_AnyGpu(90), type_name, 1, 4096, 14336).name == "gemv_k"
    assert pick(_AnyGpu(90), type_name, 1, 4096, 8192).name == "gemv_k"
    assert pick(_AnyGpu(90), type_name, 1, 4096, 4096).name in ("gemv", "gemv_rows")  # (one kernel there at M = 1)
    assert pick(_AnyGpu(90), type_name, 2, 4096, 14336).name != "gemv_k"
    assert "M <= 1" in KERNELS["gemv_k"].can_run(type_name, 2, 4096, 4096, 90)
    assert KERNELS["gemv_k"].can_run("Q3_K", 1, 4096, 4096, 90) is not None
