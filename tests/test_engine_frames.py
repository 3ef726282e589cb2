"""An engine process's work per read (app/serving/engine.py): the requests of one frame for one tensor run as one
entry of the device's queue and are answered by one Done, without a server or a front."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from app.serving import arenas, contract
from app.serving.engine import EngineServer
from app.settings import Settings
from kernels.cpu import CpuBackend
from kernels.registry import KERNELS
from kernels.types import Weights
from tests.conftest import CACHE_DIR

TENSOR = "tiny.q4_0.weight"  # [33, 64]: odd N


class End:
    """The engine's end of a channel, keeping what it is sent."""

    open = True

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def answered(self) -> set[int]:
        ids = set()
        for a in self.sent:
            ids.add(a.id)
            ids.update(getattr(a, "more", ()))
        return ids


def test_a_frames_requests_for_one_tensor_run_as_one_entry_and_get_one_answer(models_dir: Path,
                                                                             rng: np.random.Generator) -> None:
    """Seven requests of one read (M = 1 to 7) are answered by one Done naming them all, each Y bit for bit what the
    kernel that ran gives for its rows alone; an eighth whose X holds a NaN fails on its own, and its slot is
    left as it was."""

    async def main() -> None:
        server = EngineServer(Settings(models_dir=models_dir, backend="cpu", fronts=0, cache_dir=CACHE_DIR))
        model = await server.store.current("demo")
        n, k = model.tensors[TENSOR].shape
        ms = [1, 2, 3, 4, 5, 6, 7, 2]
        name = arenas.segment_name(f"test{secrets.token_hex(3)}", os.getpid(), 0)
        segment = arenas.create(name, sum(m * (k + n) * 4 for m in ms) + 4096)
        try:
            end = End()
            requests, xs, ys, at = [], [], [], 0
            for i, m in enumerate(ms):
                x = np.ndarray((m, k), np.float32, segment.buf, at)
                x[...] = rng.standard_normal((m, k), dtype=np.float32)
                y = np.ndarray((m, n), np.float32, segment.buf, at + m * k * 4)
                y[...] = np.nan  # poisoned: every value must be written
                xs.append(x)
                ys.append(y)
                amax = float(np.abs(x).max())
                if i == len(ms) - 1:
                    x[0, 5] = np.nan
                    amax = float("nan")
                requests.append(contract.Matmul(100 + i, "demo", model.version_key, TENSOR, "auto", None, name,
                                                at, at + m * k * 4, m, k, n, False, amax))
                at += m * (k + n) * 4
            # the tensor's first request resolves it (off the frame's path); the frame then runs together
            server.on_requests(end, contract.decode_requests(contract.encode([requests[0]])))
            while not end.sent:
                await asyncio.sleep(0.001)
            end.sent.clear()
            server.on_requests(end, contract.decode_requests(contract.encode(requests)))
            while len(end.answered()) < len(ms):
                await asyncio.sleep(0.001)
            dones = [a for a in end.sent if type(a) is contract.Done]
            failed = [a for a in end.sent if type(a) is contract.Failed]
            assert len(dones) == 1 and sorted([dones[0].id, *dones[0].more]) == list(range(100, 107))
            assert dones[0].batch[0] == 7 and dones[0].batch[1] == sum(ms[:-1])
            assert [(f.id, f.error) for f in failed] == [(107, "InvalidRequest")]
            info = model.tensors[TENSOR]
            cpu = CpuBackend(1 << 30)
            w = Weights((model.version_key, TENSOR), info.type_name, *info.shape, lambda: model.raw(TENSOR))
            spec = KERNELS[dones[0].kernel]
            for x, y in zip(xs[:-1], ys[:-1], strict=True):
                assert np.array_equal(y, cpu.run(spec, w, np.array(x)).output)
            assert np.isnan(ys[-1]).all()
            cpu.close()
        finally:
            del xs, ys, x, y
            server.close()
            segment.close()
            arenas.remove(name)

    asyncio.run(main())
