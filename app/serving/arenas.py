"""Shared memory between a front process and the engines: the request's activations and the product's output
travel here, never through the channel (app/serving/channel.py).

Each front owns one arena (a POSIX shared-memory segment, `multiprocessing.shared_memory`) cut into slots per
request: X [M, K] and Y [M, N] float32, side by side.  A request too large for what the arena has free gets a
segment of its own for its lifetime.  A large body is read straight into a region of the arena (app/edge.py): its
X is multiplied where it landed, and its slot holds Y alone.  An engine attaches to a front's arena once, and reads
X and writes Y in place.

Segments are named `qgemm-<instance>-<pid>-<n>`: the supervisor removes a dead front's by its pid, and a start
removes those of processes that no longer exist (a `kill -9` of everything leaves nothing behind for good).
"""

from __future__ import annotations

import bisect
import itertools
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

PREFIX = "qgemm"
ALIGN = 256  # slot boundaries: whole cache lines, and CUDA's copy alignment
SHM_DIR = Path("/dev/shm")


def segment_name(instance: str, pid: int, n: int) -> str:
    """A segment's name: the instance and the pid that owns it (what `clean` removes by), then a number and a random
    part, so that no other user can guess a name and squat it."""
    return f"{PREFIX}-{instance}-{pid}-{n}{secrets.token_hex(6)}"


def _untracked(shm: SharedMemory) -> SharedMemory:
    """Python's resource tracker would unlink a segment when the process that merely attached it exits (and warn
    of "leaks" at every exit): the lifetime of qgemm's segments is the supervisor's business."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # no tracker running: nothing to undo
        pass
    return shm


class NoSharedMemory(OSError):
    """/dev/shm cannot hold a segment (a container's --shm-size, 64 MiB by default in Docker)."""


def shm_free() -> int:
    """Bytes free in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create(name: str, nbytes: int) -> SharedMemory:
    """A segment whose pages are all reserved now: a tmpfs file is sparse, and touching a page that /dev/shm
    cannot back kills the process with SIGBUS; reserved up front, a full /dev/shm is an error here instead."""
    shm = _untracked(SharedMemory(name=name, create=True, size=max(nbytes, ALIGN)))
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(shm._fd, 0, shm.size)  # type: ignore[attr-defined]
    except OSError as exc:
        shm.close()
        remove(name)
        raise NoSharedMemory(f"/dev/shm cannot hold {shm.size >> 20} MiB more ({shm_free() >> 20} MiB free: "
                             f"{exc.strerror}); give the container more (docker run --shm-size) or lower "
                             "QGEMM_FRONT_ARENA_BYTES / QGEMM_FRONTS") from None
    return shm


def attach(name: str) -> SharedMemory:
    return _untracked(SharedMemory(name=name))


def remove(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def owner(name: str) -> int | None:
    """The pid in a segment's name, or None for a name not made by `segment_name`."""
    try:
        return int(name.split("-")[-2])
    except (ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean(instance: str, pid: int | None = None) -> list[str]:
    """Remove this instance's segments of process `pid`, or (None) of every process that no longer runs."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}-{instance}-*"):
        made_by = owner(path.name)
        if made_by is None:
            continue
        if (pid is not None and made_by == pid) or (pid is None and not alive(made_by)):
            remove(path.name)
            removed.append(path.name)
    return removed


@dataclass
class Slot:
    """Where one request's X and Y live: a segment, and their offsets in it."""

    segment: str
    offset: int
    nbytes: int
    m: int
    k: int
    n: int
    buf: memoryview
    own: SharedMemory | None = None  # a segment of its own (unlinked when the slot is released)

    @property
    def y_offset(self) -> int:
        return self.offset + _aligned(self.m * self.k * 4)

    def x(self) -> np.ndarray:
        return np.ndarray((self.m, self.k), np.float32, self.buf, self.offset)

    def y(self) -> np.ndarray:
        return np.ndarray((self.m, self.n), np.float32, self.buf, self.y_offset)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_bytes(m: int, k: int, n: int) -> int:
    return _aligned(m * k * 4) + _aligned(m * n * 4)


class OverBudget(NoSharedMemory):
    """The requests in flight already hold this front's budget of segments of their own: retry shortly."""


class Arena:
    """A front's segment and its free space (first fit, neighbours merged on release), and the segments of their own
    that requests too large for it hold, at most `own_budget` bytes at once (/dev/shm is all of RAM on many hosts:
    it is never filled by requests).  Used from the front's event loop only."""

    def __init__(self, instance: str, nbytes: int, own_budget: int = 1 << 62):
        self.own_budget, self.own_bytes = own_budget, 0
        self.instance, self.size = instance, _aligned(nbytes)
        self._names = itertools.count()
        self.shm = self._create(self.size)
        self.name = self.shm.name.lstrip("/")
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), sorted by offset
        self._base = np.frombuffer(self.shm.buf, np.uint8).ctypes.data  # the mapping's address (for `contains`)

    def _create(self, nbytes: int) -> SharedMemory:
        """A new segment of this front's, under a fresh name (another where one is taken)."""
        for attempt in range(3):
            try:
                return create(segment_name(self.instance, os.getpid(), next(self._names)), nbytes)
            except FileExistsError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _take(self, need: int) -> int | None:
        """The offset of `need` free bytes of the arena (first fit), or None."""
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, size - need)
                return off
        return None

    def region(self, nbytes: int) -> int | None:
        """The offset of `nbytes` of the arena for a body read in place, or None where the arena has no room (the
        body is then read into memory of its own); given back with `give_back(offset, nbytes)`."""
        return self._take(_aligned(nbytes))

    def contains(self, a: np.ndarray) -> int | None:
        """The offset of `a`'s first byte in the arena, where `a` lies in it (a body read in place), else None."""
        at = a.ctypes.data - self._base
        return at if 0 <= at and at + a.nbytes <= self.size else None

    def slot(self, m: int, k: int, n: int, spill: bool = True) -> Slot:
        """A slot for X [m, k] and Y [m, n] (k = 0: Y alone); a segment of its own where the arena has no room and
        `spill`, else NoSharedMemory."""
        need = slot_bytes(m, k, n)
        off = self._take(need)
        if off is not None:
            return Slot(self.name, off, need, m, k, n, self.shm.buf)
        if not spill:
            raise NoSharedMemory(f"the arena has no {need} bytes free")
        if need > self.own_budget:
            raise ValueError(f"X and Y of this request take {need >> 20} MiB of shared memory, over the "
                             f"{self.own_budget >> 20} MiB a front may hold in flight (QGEMM_FRONT_INFLIGHT_BYTES)")
        if self.own_bytes + need > self.own_budget:
            raise OverBudget(f"requests in flight on this front hold {self.own_bytes >> 20} MiB of shared memory of "
                             f"their own (QGEMM_FRONT_INFLIGHT_BYTES: {self.own_budget >> 20} MiB); retry after the "
                             "Retry-After seconds")
        own = self._create(need)  # too large for what is free: a segment of its own
        self.own_bytes += need
        return Slot(own.name.lstrip("/"), 0, need, m, k, n, own.buf, own)

    def release(self, slot: Slot) -> None:
        if slot.own is not None:
            self.own_bytes -= slot.nbytes
            try:
                slot.own.close()
            except BufferError:  # a view of it is still alive: the mapping goes with it
                pass
            remove(slot.segment)
            return
        self.give_back(slot.offset, slot.nbytes)

    def give_back(self, offset: int, nbytes: int) -> None:
        nbytes = _aligned(nbytes)
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, nbytes))
        # merge with the next, then the previous block
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])

    def close(self) -> None:
        try:
            self.shm.close()
        except BufferError:  # an answer still holds a view: the mapping goes with the process
            pass
        remove(self.name)
