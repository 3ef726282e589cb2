"""A gathered graph's table (kernels/cuda/graphs.py), on the CPU: a batch of fewer rows than the graph's M reads its
first X row and writes the spare row past its own."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda.graphs import Replay, bucket


@pytest.mark.parametrize(("m", "want"), [(1, 1), (63, 63), (64, 64), (65, 128), (128, 128), (129, 192), (511, 512)])
def test_the_graphs_m_is_the_batchs_up_to_a_step_then_a_multiple_of_it(m: int, want: int) -> None:
    assert bucket(m, 64) == want


def _replay(graph_m: int) -> Replay:
    table = np.full(2 * graph_m, 0xDEAD, np.uint64)  # poison: every entry must be written
    finite = np.zeros(1, np.int32)
    return Replay(None, None, None, None, {}, ("", ""), 0, (), table, finite, spare=0x5000)


def test_a_smaller_batch_fills_the_rows_past_its_own_with_harmless_addresses(rng: np.random.Generator) -> None:
    m, g = int(rng.integers(65, 128)), 128
    xs = [int(a) for a in rng.integers(1 << 20, 1 << 40, m)]
    ys = [int(a) for a in rng.integers(1 << 20, 1 << 40, m)]
    r = _replay(g)
    r.aim((xs, ys))
    assert r.table is not None and r.finite is not None
    assert r.table[:m].tolist() == xs and r.table[g:g + m].tolist() == ys
    assert (r.table[m:g] == xs[0]).all() and (r.table[g + m:] == 0x5000).all()
    assert r.finite[0] == 1
    r.aim((xs[:3], ys[:3]))  # a later, smaller batch: the rows it no longer fills point at harmless ones again
    assert (r.table[3:g] == xs[0]).all() and (r.table[g + 3:] == 0x5000).all()


def test_a_batch_of_the_graphs_m_fills_every_row() -> None:
    r = _replay(4)
    r.aim(([1, 2, 3, 4], [5, 6, 7, 8]))
    assert r.table is not None and r.table.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
