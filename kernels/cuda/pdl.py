"""Programmatic dependent launch (Hopper and later): launch a kernel so that it may get resident while
the kernel before it on the stream still runs.  It waits in `griddepcontrol.wait` (common.cuh's
wait_for_inputs) for that kernel to end before it reads what it wrote or writes what it reads; the
kernel before calls `griddepcontrol.launch_dependents` to let it start early.

Used at M = 1, both ways round: gemv's kernel is launched dependent on its quantize kernel
(`quantize_q8_1_split` lets it launch as it starts, and gemv issues its first weight loads before it
waits), and the split quantize kernel is launched dependent on whatever came before (gemv lets it launch
once its own first loads are out; it waits before it reads x).  That hides both launch gaps of a stream
of M = 1 products.  H100, quantize + GEMM from HBM, A/B in one run: the gemv side alone took Q4_0
K = 14336 from 14.9 to 14.5 us and Q8_0 K = 4096 from 9.3 to 8.9; the quantize side took them on to
13.9 and 8.2 (all of it off: 14.6-14.8 and 9.4).

Not used for the others.  Launched early, a grid lands on whichever SMs the quantize kernel leaves free,
unevenly: mmq_wgmma (3 blocks an SM) at M = 512 went from 75 to 94 us and the skinny M <= 8 kernel lost
15% at K = 14336; mmq gained nothing measurable, nor did launching mmq's quantize kernel dependent on it.

CuPy launches have no launch attributes, so this calls the driver's cuLaunchKernelEx through ctypes
with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.  It works inside stream capture (the
bench's CUDA graphs get a programmatic edge).  Where the driver lacks the entry point, or the GPU is
older than sm_90, or QGEMM_DEPENDENT_LAUNCH=false, `launch` is CuPy's ordinary launch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID, cuda.h


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


def _driver_launch() -> Any:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_LAUNCH = _driver_launch()


def _ctype(arg: Any) -> Any:
    if hasattr(arg, "data") and hasattr(arg.data, "ptr"):  # a device array (cupy.ndarray)
        return ctypes.c_void_p(arg.data.ptr)
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, np.int64):
        return ctypes.c_int64(int(arg))
    raise TypeError(f"unsupported kernel argument {type(arg).__name__}")


def available(cc: int) -> bool:
    return _LAUNCH is not None and cc >= 90


def launch(kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], dependent: bool,
           shared_mem: int = 0) -> None:
    """kernel(grid, block, args) on the current stream; `dependent` (where `available`): it may start
    before the kernel ahead of it ends."""
    if not dependent:
        kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)
        return
    import cupy

    values = [_ctype(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    g, b = (list(grid) + [1, 1])[:3], (list(block) + [1, 1])[:3]
    config = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                     ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), ctypes.pointer(attr), 1)
    err = _LAUNCH(ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
