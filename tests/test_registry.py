"""The kernel registry: every registered kernel is whole (the formula it computes, a weight layout, an activation
layout for each type it takes, a way to run), and every kernel this machine can run runs every type it takes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kernels import groups
from kernels import reference as ref
from kernels.cpu import CpuBackend, CpuKernel
from kernels.cuda.kernels import CudaKernel
from kernels.cuda.modules import SOURCES
from kernels.formats import BNB4_TYPES, MATMUL_TYPES, format_of
from kernels.kernel import FORMULAS, Layout
from kernels.registry import KERNELS, cpu_reference, known_names, register
from kernels.requant import Scheme, requantize
from kernels.types import Weights

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


def _nmse(y: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((y.astype(np.float64) - want) ** 2) / np.sum(want ** 2))


def _walk(run, names: list[str], rng: np.random.Generator) -> None:
    """Each kernel on each type it takes, at its largest M up to 3: a product within Q8_1's (or the formula's
    float's) rounding of the FP64 product of the dequantized weights."""
    for name in names:
        kernel = KERNELS[name]
        m = min(3, kernel.max_m or 3)
        for t in kernel.weight_types:
            raw = random_raw(t, rng)
            x = rng.standard_normal((m, K)).astype(np.float32)
            want = x.astype(np.float64) @ ref.dequantize_weights(t, raw).astype(np.float64).T
            y = run(kernel, Weights(("registry", name, t), t, N, K, lambda raw=raw: raw), x)  # a key per raw
            assert y.shape == (m, N) and np.isfinite(y).all(), (name, t)
            assert _nmse(y, want) < 1e-3, (name, t, _nmse(y, want))


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
