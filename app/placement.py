"""Where each tensor lives on a host with several devices: the one place that decides it.

A tensor's placement is a list of replicas; each replica is a list of parts that together cover its
rows (N) in order: one part (the tensor whole on one device) or several (split by rows across devices,
each device multiplying its block of rows; the blocks of output columns are joined).  A request runs
on one replica, the least loaded.  Placements are decided at a tensor's first use (the device with the
most free weight budget; split across every device when no single budget holds it) or by
POST /v1/models/{id}/load (devices, replicate or split), and dropped with their file version.

Pure bookkeeping: no device calls, so that CI tests it with fake devices.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

ROW_ALIGN = 128  # split points fall on multiples of this many rows (a GEMM tile), except the end

How = Literal["first use", "single", "replicate", "split"]


@dataclass(frozen=True)
class Part:
    device: int  # the worker's index in its pool
    start: int  # rows [start, stop) of the weight matrix
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


Replica = tuple[Part, ...]


@dataclass
class Placement:
    replicas: list[Replica]
    how: How
    n: int  # the tensor's rows

    def devices(self) -> list[int]:
        return sorted({p.device for r in self.replicas for p in r})

    @property
    def split(self) -> bool:
        return any(len(r) > 1 for r in self.replicas)


def split_rows(n: int, devices: Sequence[int], shares: Sequence[float] | None = None,
               align: int = ROW_ALIGN) -> Replica:
    """N rows cut into contiguous blocks, one per device in the given order, sized by `shares` (default
    equal), cut points on multiples of `align`; a device whose block would be empty is left out."""
    if not devices:
        raise ValueError("no devices to split across")
    shares = list(shares) if shares is not None else [1.0] * len(devices)
    total = float(sum(shares)) or 1.0
    cuts, acc = [0], 0.0
    for s in shares[:-1]:
        acc += s
        cut = min(n, max(cuts[-1], round(n * acc / total / align) * align))
        cuts.append(cut)
    cuts.append(n)
    return tuple(Part(d, a, b) for d, a, b in zip(devices, cuts[:-1], cuts[1:], strict=True) if b > a)


def first_use(n: int, nbytes: int, budgets: Sequence[int], free: Sequence[int]) -> Placement:
    """Where a tensor goes when a request first needs it: whole, on the device with the most free budget
    (the lowest index among equals) when some budget holds it; else split across every device by budget."""
    fits = [d for d, b in enumerate(budgets) if nbytes <= b]
    if fits or len(budgets) == 1:
        best = max(fits or [0], key=lambda d: (free[d], -d))
        return Placement([(Part(best, 0, n),)], "first use", n)
    return Placement([split_rows(n, range(len(budgets)), budgets)], "first use", n)


def requested(n: int, devices: Sequence[int], how: Literal["replicate", "split"]) -> Placement:
    """Where POST .../load puts a tensor: a whole copy on each device, or one copy split across them."""
    if how == "split" and len(devices) > 1:
        return Placement([split_rows(n, devices)], "split", n)
    return Placement([(Part(d, 0, n),) for d in devices], "replicate" if len(devices) > 1 else "single", n)


class Placements:
    """The placements of one pool of devices, keyed by (file version, tensor, weight format)."""

    def __init__(self) -> None:
        self._map: dict[tuple[Hashable, str, str], Placement] = {}
        self._turn = itertools.count()  # breaks ties between equally loaded replicas in turn

    def get(self, key: tuple[Hashable, str, str]) -> Placement | None:
        return self._map.get(key)

    def set(self, key: tuple[Hashable, str, str], placement: Placement) -> None:
        self._map[key] = placement

    def pop(self, key: tuple[Hashable, str, str]) -> Placement | None:
        return self._map.pop(key, None)

    def drop(self, version_key: Hashable, tensors: set[str] | None = None) -> None:
        for key in [k for k in self._map if k[0] == version_key and (tensors is None or k[1] in tensors)]:
            del self._map[key]

    def of(self, version_key: Hashable) -> list[tuple[str, str, Placement]]:
        return [(k[1], k[2], p) for k, p in self._map.items() if k[0] == version_key]

    def pick(self, placement: Placement, load: Callable[[int], int]) -> Replica:
        """The replica to run on: the one whose busiest device has the least queued (in turn among equals)."""
        if len(placement.replicas) == 1:
            return placement.replicas[0]
        turn = next(self._turn)
        count = len(placement.replicas)
        order = [placement.replicas[(turn + i) % count] for i in range(count)]
        return min(order, key=lambda r: max(load(p.device) for p in r))
