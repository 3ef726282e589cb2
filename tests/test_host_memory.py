"""The pool of pinned output buffers (kernels/cuda/host_memory.py), on plain host memory: its size classes,
reuse, cap and returns, which the CUDA backend relies on (the GPU side is in tests/test_gpu.py)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kernels.cuda.host_memory import MIN_BYTES, PinnedOutputs, all_finite, size_class

MiB = 1 << 20


class Allocations:
    """bytearray buffers, counted."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, size: int) -> bytearray:
        self.sizes.append(size)
        return bytearray(size)


@pytest.mark.parametrize("size", [1, 5, 4096 * 6 + 3, (1 << 18) + 1])
def test_all_finite_finds_a_nan_or_an_infinity_anywhere_and_passes_any_finite_values(
        size: int, rng: np.random.Generator) -> None:
    """Values near float32's largest (a sum of them overflows) pass; one NaN, +inf or -inf at any place fails, as
    np.isfinite says; the array is left as it was."""
    y = (rng.standard_normal(size) * 3e38).clip(-3.4e38, 3.4e38).astype(np.float32)
    assert np.isfinite(y).all() and all_finite(y) and all_finite(y.reshape(1, -1))
    for bad in (np.nan, np.inf, -np.inf):
        at = int(rng.integers(size))
        z = y.copy()
        z[at] = bad
        assert not all_finite(z), (bad, at)
    assert all_finite(y) and np.isfinite(y).all()


@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 58_720_256, 10**9 + 7])
def test_size_classes_hold_the_request_and_waste_at_most_a_quarter(nbytes: int) -> None:
    size = size_class(nbytes)
    assert nbytes <= size <= max(nbytes * 1.25, 8)
    assert size_class(size) == size  # a class is its own class


def test_small_outputs_and_a_zero_cap_take_the_staging_path() -> None:
    assert PinnedOutputs(1 << 30, Allocations()).array((1, MIN_BYTES // 4 - 1)) is None
    assert PinnedOutputs(0, Allocations()).array((512, 4096)) is None


def test_a_freed_buffer_is_reused_by_its_size_class_only_when_its_views_are_gone() -> None:
    alloc = Allocations()
    pool = PinnedOutputs(64 * MiB, alloc)
    a = pool.array((512, 4096))
    assert a is not None and a.shape == (512, 4096) and a.dtype == np.float32
    a[...] = 7.0
    view = a[100:200, 5:9]  # a block of it, as the scheduler and a split hand out
    del a
    b = pool.array((512, 4096))
    assert len(alloc.sizes) == 2  # the view keeps the first buffer out
    del view, b
    c = pool.array((511, 4100))  # another shape of the same size class takes a returned buffer
    assert len(alloc.sizes) == 2 and pool.held == 2 * size_class(512 * 4096 * 4)
    assert c is not None and c.shape == (511, 4100)


def test_the_cap_bounds_what_is_held_and_frees_other_sizes_for_room() -> None:
    alloc = Allocations()
    pool = PinnedOutputs(10 * MiB, alloc)
    live = [pool.array((MiB,)) for _ in range(3)]  # 3 x 4 MiB: the third does not fit under 10 MiB
    assert live[2] is None and pool.held == 8 * MiB
    del live
    big = pool.array((2 * MiB,))  # 8 MiB: the two free 4 MiB buffers are dropped to make room
    assert big is not None and pool.held == 8 * MiB and alloc.sizes[-1] == 8 * MiB
    assert pool.array((MiB,)) is None  # 8 + 4 > 10 while big is alive
    del big
    pool.release()
    assert pool.held == 0


def test_returns_from_the_garbage_collector_and_other_threads_never_deadlock() -> None:
    """A buffer may come back from a finalizer run by the cyclic collector inside the pool's own allocation,
    or on another thread: it is queued, not locked, and reused."""
    alloc = Allocations()
    pool = PinnedOutputs(256 * MiB, alloc)

    class Cycle:
        def __init__(self, arr: np.ndarray) -> None:
            self.arr, self.me = arr, self

    for _ in range(20):
        Cycle(pool.array((MiB,)))  # each array lives until the collector breaks its cycle
    gc.collect()

    def churn() -> None:
        for _ in range(200):
            out = pool.array((MiB,))
            assert out is not None
            out[:3] = 1.0

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert pool.held <= 24 * 4 * MiB and len(alloc.sizes) <= 24  # reused, not allocated per product


@pytest.mark.parametrize("rows", [1, 3, 257, 1001])
def test_copy_in_copies_every_row_small_or_in_blocks_on_threads(rows: int) -> None:
    """copy_in: an array of PARALLEL_COPY_BYTES or more goes in row blocks on several threads; every row lands."""
    from kernels.cuda.host_memory import PARALLEL_COPY_BYTES, copy_in

    cols = max(8, PARALLEL_COPY_BYTES // 4 // 256)  # 257 rows and more pass the threshold
    src = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    dst = np.full((rows + 2, cols), np.nan, np.float32)
    copy_in(dst[1:-1], src)
    assert np.array_equal(dst[1:-1], src) and np.isnan(dst[0]).all() and np.isnan(dst[-1]).all()
