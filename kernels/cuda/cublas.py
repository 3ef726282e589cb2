"""cuBLAS GEMMs (the `cublas_f16` / `cublas_f32` baselines) that a CUDA graph can capture.

CuPy refuses any cuBLAS call during stream capture ("calling cuBLAS API during stream capture is
currently unsupported": its wrappers swap per-stream workspaces), so the bench timed these two
baselines with a pair of events per call while every other kernel ran from CUDA-graph replays: their
figures carried Python's launch cost, and the comparison was not made the same way.  Here the cuBLAS
handle CuPy made for the device gets the current stream and a workspace allocated once (cuBLAS's
condition for capture: no allocation inside it), and cublasGemmEx is called through ctypes.  CuPy
sets its own stream and workspace again before its next cuBLAS call, so sharing the handle is safe.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import cupy
import numpy as np

WORKSPACE_BYTES = 32 << 20  # cuBLAS asks for 32 MiB on Hopper
_OP_N, _OP_T = 0, 1  # cublasOperation_t
_R_32F, _R_16F, _R_16BF = 0, 2, 14  # cudaDataType
_COMPUTE_16F, _COMPUTE_32F = 64, 68  # cublasComputeType_t: half accumulate; fp32 accumulate, no TF32
_GEMM_DEFAULT, _GEMM_DEFAULT_TENSOR_OP = -1, 99  # cublasGemmAlgo_t (ggml names the second)
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_H, _ZERO_H = ctypes.c_uint16(0x3C00), ctypes.c_uint16(0)  # 1.0 and 0.0 as half: the 16F call's scalars


def _library_path() -> str:
    """The libcublas CuPy loaded (by handle creation), so that both call the same library."""
    cupy.cuda.device.get_cublas_handle()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return path
    raise RuntimeError("libcublas is not loaded in this process")


@lru_cache(maxsize=1)
def _lib() -> Any | None:
    """libcublas through ctypes, or None where it cannot be reached (then CuPy's call, not capturable)."""
    try:
        lib = ctypes.CDLL(_library_path())
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        i = ctypes.c_int
        lib.cublasGemmEx.argtypes = [ctypes.c_void_p, i, i, i, i, i, ctypes.c_void_p, ctypes.c_void_p, i, i,
                                     ctypes.c_void_p, i, i, ctypes.c_void_p, ctypes.c_void_p, i, i, i, i]
        for fn in (lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2, lib.cublasGemmEx):
            fn.restype = ctypes.c_int
    except (OSError, RuntimeError, AttributeError):
        return None
    return lib


_workspaces: dict[int, cupy.ndarray] = {}  # per device, kept for the process's life


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: cublasStatus_t {status}")


def gemm_xwt(x: cupy.ndarray, w: cupy.ndarray, y: cupy.ndarray) -> None:
    """y[M, N] = x[M, K] · w[N, K]ᵀ on the current stream, x and w both fp16, both bf16 (their bits as uint16:
    CuPy has no bfloat16) or both fp32.  y fp32: fp32 accumulation.  y fp16 (fp16 operands): llama.cpp's call for
    F16 matrices, CUBLAS_COMPUTE_16F with half scalars and outputs, algorithm DEFAULT_TENSOR_OP
    (ggml_cuda_mul_mat_cublas_impl).  In cuBLAS's column-major terms: yᵀ (N x M) = op_T(w as K x N) · xᵀ (K x M)."""
    (m, k), n = x.shape, w.shape[0]
    dtype = {np.dtype(np.float16): _R_16F, np.dtype(np.uint16): _R_16BF, np.dtype(np.float32): _R_32F}[x.dtype]
    half = y.dtype == np.float16
    assert w.dtype == x.dtype and w.shape[1] == k and y.shape == (m, n) and y.dtype in (np.float32, np.float16)
    assert not half or x.dtype == np.float16, "half sums take half operands"
    assert w.flags.c_contiguous and y.flags.c_contiguous
    out, compute, algo = (_R_16F, _COMPUTE_16F, _GEMM_DEFAULT_TENSOR_OP) if half else \
        (_R_32F, _COMPUTE_32F, _GEMM_DEFAULT)
    x = cupy.ascontiguousarray(x)  # no copy for the contiguous activations every caller passes
    lib = _lib()
    if lib is None:
        _cupy_gemm(x, w, y, dtype, out, compute, algo)
        return
    handle = ctypes.c_void_p(cupy.cuda.device.get_cublas_handle())
    device = cupy.cuda.Device().id
    if device not in _workspaces:  # the first call runs outside capture (the bench warms up first)
        _workspaces[device] = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
    _check(lib.cublasSetStream_v2(handle, ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "cublasSetStream")
    _check(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(_workspaces[device].data.ptr), WORKSPACE_BYTES),
           "cublasSetWorkspace")
    one, zero = (_ONE_H, _ZERO_H) if half else (_ONE, _ZERO)
    _check(lib.cublasGemmEx(handle, _OP_T, _OP_N, n, m, k, ctypes.byref(one), ctypes.c_void_p(w.data.ptr), dtype, k,
                            ctypes.c_void_p(x.data.ptr), dtype, k, ctypes.byref(zero), ctypes.c_void_p(y.data.ptr),
                            out, n, compute, algo), "cublasGemmEx")


_half_outputs: dict[tuple[int, int], cupy.ndarray] = {}  # per device and stream: the 16F call's half products


def gemm_xwt_half(x: cupy.ndarray, w: cupy.ndarray, shape: tuple[int, int]) -> cupy.ndarray:
    """llama.cpp's F16 product's half sums and outputs (gemm_xwt on a half y of `shape`), returned for the caller to
    widen as its to_fp32 does.  They live in a buffer per device and stream, grown outside capture (the first call
    of a size runs first, as the bench's warm-up does), so that graphs can capture the call."""
    key, size = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr), shape[0] * shape[1]
    buf = _half_outputs.get(key)
    if buf is None or buf.size < size:
        buf = _half_outputs[key] = cupy.empty(size, dtype=cupy.float16)
    half = buf[:size].reshape(shape)
    gemm_xwt(x, w, half)
    return half


def _cupy_gemm(x: cupy.ndarray, w: cupy.ndarray, y: cupy.ndarray, dtype: int, out: int, compute: int,
               algo: int) -> None:
    from cupy_backends.cuda.libs import cublas

    (m, k), n = x.shape, w.shape[0]
    scalar = np.float16 if out == _R_16F else np.float32
    one, zero = np.array(1.0, scalar), np.array(0.0, scalar)
    cublas.gemmEx(cupy.cuda.device.get_cublas_handle(), _OP_T, _OP_N, n, m, k, one.ctypes.data, w.data.ptr, dtype, k,
                  x.data.ptr, dtype, k, zero.ctypes.data, y.data.ptr, out, n, compute, algo)
