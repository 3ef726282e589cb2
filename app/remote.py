"""The routes' Service in a front process of `qgemm serve`: every question goes to the engine process over the
channel (app/ipc.py); a product's X is written into this front's shared-memory arena (app/shm.py), and its Y
read from there.  An engine that is down answers 503 with Retry-After at once, for the requests in flight on it
as for new ones, and /healthz says `degraded` until the supervisor has it back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from app import shm
from app.errors import ApiError
from app.ipc import Channel, EngineUnavailable
from app.scheduler import Answer
from app.tensors import scheme_fields
from app.validation import check_shape
from kernels.kernel import Kernel
from kernels.registry import KERNELS
from kernels.requant import Scheme
from kernels.select import KernelChooser
from kernels.types import Result
from models.store import Model, TensorInfo

RETRY = {"Retry-After": "1"}


def supervisor_state(run_dir: Path) -> dict[str, Any]:
    """What the supervisor last wrote of its processes (state.json), or nothing where it has not yet."""
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


class RemoteService:
    """app/service.py's Service, answered by the engine process."""

    def __init__(self, socket_path: str, run_dir: Path, instance: str, arena_bytes: int, max_rows: int):
        self.channel = Channel(socket_path)
        self.max_rows = max_rows
        self.run_dir, self.instance, self.arena_bytes = run_dir, instance, arena_bytes
        self.arena: shm.Arena | None = None
        self.chooser = KernelChooser(None)  # kernel names are checked here, against the registry
        self._kernels: list[dict[str, Any]] | None = None
        self._last_health: dict[str, Any] = {"backend": "cpu", "device": None, "compile_ms": None, "devices": []}

    def open(self) -> None:
        self.arena = shm.Arena(self.instance, self.arena_bytes)

    async def close(self) -> None:
        await self.channel.close()
        if self.arena is not None:
            self.arena.close()

    async def _call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            reply = await self.channel.call(message, timeout)
        except EngineUnavailable as exc:
            raise ApiError(503, "engine_unavailable", f"{exc}; retry after the Retry-After seconds", RETRY) from None
        error = reply.get("error")
        if error is not None:
            raise ApiError(error["status"], error["code"], error["message"], error.get("headers"))
        return reply

    async def health(self) -> dict[str, Any]:
        state = supervisor_state(self.run_dir)
        processes = state.get("processes", [])
        try:
            health = await self._call({"op": "health"}, timeout=2.0)
            self._last_health = health
            down = any(p["role"] == "engine" and p["state"] != "ok" for p in processes)
        except ApiError:
            health, down = {**self._last_health, "devices": []}, True
        return {**health, "status": "degraded" if down else "ok", "processes": processes}

    async def kernel_table(self) -> list[dict[str, Any]]:
        if self._kernels is None:
            self._kernels = (await self._call({"op": "kernels"}))["kernels"]
        return self._kernels

    async def matmul(self, model: Model, info: TensorInfo, x: np.ndarray, kernel: str | Kernel,
                     scheme: Scheme | None) -> Answer:
        check_shape(x, info, self.max_rows)  # before a slot is cut for it: the arena's bound, whatever M claims
        (m, k), n = x.shape, info.shape[0]
        assert self.arena is not None, "the front's arena is made at its start"
        try:
            slot = self.arena.slot(m, k, n)
        except shm.NoSharedMemory as exc:  # the arena is full and /dev/shm cannot hold a segment of its own
            raise ApiError(503, "no_shared_memory", str(exc), RETRY) from None
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(slot.x(), x, casting="unsafe")
        message = {"op": "matmul", "model": model.id, "tensor": info.name,
                   "kernel": kernel if isinstance(kernel, str) else kernel.name, "scheme": scheme_fields(scheme),
                   "segment": slot.segment, "own": slot.own is not None, "x": slot.offset, "y": slot.y_offset,
                   "m": m, "k": k, "n": n}
        call = asyncio.ensure_future(self._call(message))
        try:
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:  # the client went: the engine may still write Y; the slot waits for it
            call.add_done_callback(lambda _: self.arena.release(slot))  # type: ignore[union-attr]
            raise
        except BaseException:
            self.arena.release(slot)
            raise
        result = Result(None, reply["backend"], reply["activation_format"], reply["timing"])  # type: ignore[arg-type]
        return Answer(slot.y(), KERNELS[reply["kernel"]], result, reply["batch"], reply["queue_ms"], reply["devices"],
                      release=lambda: self.arena.release(slot))  # type: ignore[union-attr]

    async def load(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None,
                   devices: list[int] | None, placement: Literal["replicate", "split"] | None) -> dict[str, Any]:
        reply = await self._call({"op": "load", "model": model.id, "tensors": [i.name for i in infos],
                                  "kernel": kernel, "scheme": scheme_fields(scheme), "devices": devices,
                                  "placement": placement})
        return {"loaded": reply["loaded"], "resident": reply["resident"]}

    async def unload(self, model: Model, tensors: set[str] | None) -> dict[str, Any]:
        reply = await self._call({"op": "unload", "model": model.id,
                                  "tensors": sorted(tensors) if tensors is not None else None})
        return {"freed_bytes": reply["freed_bytes"], "resident": reply["resident"]}

    async def residency(self, model: Model) -> dict[str, Any]:
        return await self._call({"op": "residency", "model": model.id})

    async def quant_times(self, model: Model, info: TensorInfo, rows: list[dict[str, Any]], schemes: list[Scheme],
                          ms: list[int]) -> tuple[str | None, bool]:
        reply = await self._call({"op": "quant_times", "model": model.id, "tensor": info.name, "rows": rows,
                                  "schemes": [scheme_fields(s) for s in schemes], "ms": ms})
        rows[:] = reply["rows"]
        return reply["device"], reply["timed"]

    async def metrics_text(self) -> str:
        try:
            return (await self._call({"op": "metrics"}, timeout=2.0))["text"]
        except ApiError:
            return ""  # the engine is down: the fronts' own metrics still answer
