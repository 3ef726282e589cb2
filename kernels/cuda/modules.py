"""Compile the .cu sources once per process for the device's architecture.

The shared header is inlined into each source before compiling, so that CuPy's on-disk kernel
cache (keyed on the source text) never serves a kernel built against an older header.
"""

from __future__ import annotations

import time
from pathlib import Path

import cupy

from kernels.cuda import pdl

HERE = Path(__file__).parent
SOURCES = ("q8_1.cu", "ladder.cu", "w16.cu", "fast.cu", "peak.cu")


def source(name: str) -> str:
    header = (HERE / "common.cuh").read_text()
    return (HERE / name).read_text().replace('#include "common.cuh"', header)


def arch_option(cc: int) -> str:
    # sm_90a unlocks Hopper's wgmma / setmaxnreg; other GPUs get their own plain target
    return "-arch=sm_90a" if cc == 90 else f"-arch=sm_{cc}"


class Modules:
    """One compiled RawModule per source; `errors` holds the sources that failed to compile."""

    def __init__(self, cc: int, sources: tuple[str, ...] = SOURCES, dependent_launch: bool = True):
        self.dependent_launch = dependent_launch and pdl.available(cc)  # see pdl.py
        self.modules: dict[str, cupy.RawModule] = {}
        self.errors: dict[str, str] = {}
        self._functions: dict[str, cupy.RawKernel] = {}
        t0 = time.perf_counter()
        for name in sources:
            try:
                mod = cupy.RawModule(code=source(name), options=(arch_option(cc), "-std=c++17"))
                mod.compile()  # compile now (start-up), never inside a request
                self.modules[name] = mod
            except Exception as exc:  # keep the other modules usable; the registry reports why
                self.errors[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        self.compile_ms = (time.perf_counter() - t0) * 1e3
        self.sm_count = int(cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"])

    def function(self, source_name: str, name: str) -> cupy.RawKernel:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.modules[source_name].get_function(name)
        return fn
