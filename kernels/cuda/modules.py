"""Compile the .cu sources once per process for the device's architecture.

The shared headers are inlined into each source before compiling, so that CuPy's on-disk kernel
cache (keyed on the source text) never serves a kernel built against an older header.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

from kernels.cuda import pdl

try:
    import cupy
except ImportError:  # a machine without CuPy: the sources are named (the registry's tests read them), never built
    cupy = None

HERE = Path(__file__).parent
SOURCES = ("q8_1.cu", "ladder.cu", "w16.cu", "mmq.cu", "mmq_wgmma.cu", "gemv.cu", "peak.cu", "bnb4.cu", "rows.cu")
# Compiled with IEEE subnormals.  CuPy's RawModule appends -ftz=true to every compile (and NVRTC takes the
# last of two -ftz flags), which flushes a block's subnormal scale d = amax/127 to zero; the quantizer
# must give the reference's d and q there, so it is compiled here with -ftz=false and loaded as a cubin.
IEEE_SOURCES = ("q8_1.cu",)


def source(name: str) -> str:
    """The source with its headers (common.cuh, groups.cuh) inlined, each once."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def header(m: re.Match[str]) -> str:
            if m.group(1) in seen:
                return ""
            seen.add(m.group(1))
            return expand((HERE / m.group(1)).read_text())

        return re.sub(r'#include "([\w.]+\.cuh)"', header, text)

    return expand((HERE / name).read_text())


def arch_option(cc: int) -> str:
    # sm_90a unlocks Hopper's wgmma / setmaxnreg; other GPUs get their own plain target
    return "-arch=sm_90a" if cc == 90 else f"-arch=sm_{cc}"


def compile_module(name: str, cc: int) -> cupy.RawModule:
    """The source compiled and loaded, so that no request ever waits on NVRTC."""
    if name not in IEEE_SOURCES:
        mod = cupy.RawModule(code=source(name), options=(arch_option(cc), "-std=c++17"))
        mod.compile()
        return mod
    # NVRTC straight (no -ftz=true appended), with the include paths CuPy gives its own compiles
    options = cupy._core.core.assemble_cupy_compiler_options(("-std=c++17", "-ftz=false"))
    binary, _ = cupy.cuda.compiler.compile_using_nvrtc(source(name), options=options, arch=str(cc))
    with tempfile.TemporaryDirectory(prefix="qgemm-") as tmp:
        path = Path(tmp) / (name + ".bin")
        path.write_bytes(binary)  # a cubin, or PTX where NVRTC knows no newer SASS than this device's
        mod = cupy.RawModule(path=str(path))
        mod.compile()  # loads the module now, before the file goes
    return mod


class Modules:
    """One compiled RawModule per source for one device; `errors` holds the sources that failed to compile."""

    def __init__(self, cc: int, sm_count: int, sources: tuple[str, ...] = SOURCES, dependent_launch: bool = True):
        self.dependent_launch = dependent_launch and pdl.available(cc)  # see pdl.py
        self.modules: dict[str, cupy.RawModule] = {}
        self.errors: dict[str, str] = {}
        self._functions: dict[str, cupy.RawKernel] = {}
        t0 = time.perf_counter()
        for name in sources:
            try:
                self.modules[name] = compile_module(name, cc)  # now (start-up), never inside a request
            except Exception as exc:  # keep the other modules usable; the registry reports why
                self.errors[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        self.compile_ms = (time.perf_counter() - t0) * 1e3
        self.sm_count = sm_count  # of the device they were compiled for: grid sizes read it

    def function(self, source_name: str, name: str) -> cupy.RawKernel:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.modules[source_name].get_function(name)
        return fn
