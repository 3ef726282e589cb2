"""The one interface of a device that multiplies: the CPU backend (kernels/cpu.py) and the CUDA backend of one
GPU (kernels/cuda/backend.py) both implement it, so that the service's workers and engine never ask which
backend they hold.

A backend owns its device's state (weights kept in the layouts its kernels read, under a byte budget) and
the thread that touches it: `load`, `unload` and `submit` run there, one at a time.  `launch_inline` is the
exception a GPU allows: a small product on resident weights enqueued from the caller's thread (a launch is
asynchronous, and a thread round trip costs more than the product), polled until done.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from kernels.kernel import Kernel
from kernels.types import Result, Weights


def of_version(version: Hashable) -> Callable[[Hashable], bool]:
    """An `unload` match: the weights of one file version (their keys are (file version, tensor))."""
    return lambda key: isinstance(key, tuple) and key[0] == version


Outs = list[np.ndarray | None] | None  # per part of a product: the array its rows of Y go into (None: in Result)
# A batch's row addresses where every part of X and every output array lies in page-locked host memory the device
# addresses directly (a front's arena, registered by the engine): each X row's, then each Y row's, in order.  A GPU
# may then read and write the rows where they are; every backend may ignore them.
RowAddresses = tuple[list[int], list[int]] | None


class InFlight(Protocol):
    """A product launched from the caller's thread."""

    @property
    def done(self) -> bool: ...

    def result(self) -> Result:
        """Its Result, once `done`."""
        ...


class Backend(Protocol):
    name: str  # "cpu" or "cuda"
    label: str  # the device, as the API names it: "cuda:0", "cpu:1"
    device_name: str
    cc: int | None  # compute capability (major*10+minor) of a GPU; None on the CPU
    sm_count: int | None  # a GPU's multiprocessors; None on the CPU

    @property
    def compile_ms(self) -> float | None:
        """What making its kernels ready cost at start-up (a GPU's NVRTC compiles); None where nothing compiles."""
        ...

    def auto(self, type_name: str, m: int, n: int, k: int) -> Kernel | None:
        """The kernel this device's measurements pick for the shape (kernels/tuning), or None: the registry's rule."""
        ...

    def kernel_reason(self, kernel: Kernel) -> str | None:
        """Why `kernel` cannot run here at all (wrong device, a source that failed to compile), or None."""
        ...

    def prepare(self, kernel: Kernel, w: Weights) -> int:
        """The weights `kernel` reads, made and kept ahead of the first product; their bytes."""
        ...

    def submit(self, kernel: Kernel, w: Weights, parts: list[np.ndarray], outs: Outs = None) -> Future[Result]:
        """The product of the row-stacked parts by `kernel`, on the backend's thread.  With `outs`, each part's
        rows of Y may be written into its array (then the Result's output is None)."""
        ...

    def launch_inline(self, kernel: Kernel, w: Weights, parts: list[np.ndarray], outs: Outs = None,
                      rows: RowAddresses = None) -> InFlight | None:
        """The product enqueued from the calling thread where that is cheap (weights resident); None: submit it."""
        ...

    def unload(self, match: Callable[[Hashable], bool]) -> int:
        """Free the weights whose (file version, tensor) key matches, after the product in flight; bytes freed."""
        ...

    def forget(self, version: Hashable) -> None:
        """Free a retired file version's weights without waiting."""
        ...

    def memory(self) -> tuple[int, int]:
        """(weight bytes held, the budget)."""
        ...

    def entries(self) -> list[tuple[Hashable, str, int]]:
        """((file version, tensor), layout, bytes) of every weight held."""
        ...

    def close(self) -> None: ...
