"""The routes' Service in a front process of `qgemm serve` (app/service.py's interface): every question goes to the
engine processes over the channel (app/serving/channel.py, messages of app/serving/contract.py); a product's X is
written into this front's shared-memory arena (app/serving/arenas.py) and its Y read from there.

There is an engine per device (app/serving/supervisor.py); a product goes to the engine with the fewest of this
front's requests in flight, ties to the one its tensor hashes to (so a lightly loaded server keeps each tensor on
one device).  Every engine holds a copy of the weights it multiplied: a tensor is replicated where it is used.  An
engine that is down answers 503 with Retry-After at once, for the requests in flight on it as for new ones, and
/healthz says `degraded` until the supervisor has it back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from app.checks import INLINE_VALUES, Checked, amax_of, check_splittable
from app.errors import ApiError
from app.metrics import merge_exposition
from app.placement import split_rows
from app.scheduler import Answer
from app.serving import arenas, contract
from app.serving.channel import Channel, EngineUnavailable
from app.tensors import effective
from kernels.errors import InvalidRequest
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


def scheme_fields(scheme: Scheme | None) -> contract.Scheme | None:
    return (scheme.format, scheme.blocksize, scheme.double_quant) if scheme is not None else None


class RemoteService:
    """app/service.py's Service, answered by the engine processes."""

    def __init__(self, sockets: list[str], run_dir: Path, instance: str, arena_bytes: int,
                 inflight_bytes: int = 1 << 62):
        self.channels = [Channel(path) for path in sockets]
        self.run_dir, self.instance, self.arena_bytes = run_dir, instance, arena_bytes
        self.inflight_bytes = inflight_bytes
        self.arena: arenas.Arena | None = None
        self._bodies: dict[int, list[int]] = {}  # bodies read in place: region offset -> [bytes, holders]
        # tensors split across engines: (model, tensor, weight format tag) -> [(engine, start, stop)], as the engines
        # last said (each answer carries its engine's epoch: a new one and the table is asked for again)
        self.splits: dict[tuple[str, str, str], list[tuple[int, int, int]]] = {}
        self._epochs = [0] * len(self.channels)
        self._stale = False  # an epoch changed since the table was last asked for
        self._refreshing: asyncio.Task | None = None
        self._chooser: KernelChooser | None = None
        self._kernels: list[dict[str, Any]] | None = None
        self._last_health: dict[str, Any] = {"backend": "cpu", "device": None, "compile_ms": None, "devices": []}

    def open(self) -> None:
        self.arena = arenas.Arena(self.instance, self.arena_bytes, self.inflight_bytes)

    def ready(self) -> None:
        """Tell the supervisor this front's app has started (it is `ok` from then on, not from its process's start)."""
        (self.run_dir / f"front-{os.getpid()}.ready").touch()

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        if self.arena is not None:
            self.arena.close()

    async def _call(self, request: contract.Request, channel: Channel | None = None,
                    timeout: float | None = None) -> contract.Answer:
        try:
            return await (channel or self.channels[0]).call(request, timeout)
        except EngineUnavailable as exc:
            raise ApiError(503, "engine_unavailable", f"{exc}; retry after the Retry-After seconds", RETRY) from None

    async def _each(self, make: Any, timeout: float | None = None) -> list[Any]:
        """`make()`'s request asked of every engine; their Reply values, in engine order."""
        replies = await asyncio.gather(*(self._call(make(), c, timeout) for c in self.channels))
        return [r.value for r in replies]

    def _engine_for(self, tensor: str) -> Channel:
        return self.channels[self._engine_index(tensor)]

    def _engine_index(self, tensor: str) -> int:
        channels = self.channels
        if len(channels) == 1:
            return 0
        home = zlib.crc32(tensor.encode()) % len(channels)
        return min(range(len(channels)), key=lambda i: (channels[i].in_flight, i != home))

    # -- the questions ---------------------------------------------------------------------------------------
    async def chooser(self) -> KernelChooser:
        if self._chooser is None:
            self._chooser = KernelChooser.from_table(await self.kernel_table())
        return self._chooser

    async def health(self) -> dict[str, Any]:
        state = supervisor_state(self.run_dir)
        processes = state.get("processes", [])
        down = any(p["role"] == "engine" and p["state"] != "ok" for p in processes)
        answers = await asyncio.gather(*(self._call(contract.Health(), c, 2.0) for c in self.channels),
                                       return_exceptions=True)
        healths = [a.value for a in answers if isinstance(a, contract.Reply)]
        if healths:
            first = healths[0]
            self._last_health = {**first, "devices": [d for h in healths for d in h["devices"]]}
        down = down or len(healths) < len(self.channels)
        return {**self._last_health, "status": "degraded" if down else "ok", "processes": processes}

    async def kernel_table(self) -> list[dict[str, Any]]:
        if self._kernels is None:  # every engine's table is the same: the first that answers gives it
            for i, channel in enumerate(self.channels):
                try:
                    self._kernels = (await self._call(contract.Kernels(), channel)).value
                    break
                except ApiError:
                    if i == len(self.channels) - 1:
                        raise
        return self._kernels  # type: ignore[return-value]

    # -- bodies read in place (app/edge.py) into regions of this front's arena ----------------------------------
    def body_buffer(self, nbytes: int) -> tuple[memoryview, Callable[[], None]] | None:
        """A region of the arena for a request body of `nbytes` read in place, and its release (the HTTP request's
        end); None where the arena has no room.  A product whose X lies in it holds it too, until its answer."""
        if self.arena is None:
            return None
        offset = self.arena.region(nbytes)
        if offset is None:
            return None
        self._bodies[offset] = [nbytes, 1]
        return self.arena.shm.buf[offset:offset + nbytes], lambda: self._let_go_body(offset)

    def _let_go_body(self, offset: int) -> None:
        held = self._bodies[offset]
        held[1] -= 1
        if held[1] == 0:
            del self._bodies[offset]
            assert self.arena is not None
            self.arena.give_back(offset, held[0])

    def _body_holding(self, x: np.ndarray) -> tuple[int, int] | None:
        """(the region's offset, X's) where X lies in a body read in place into the arena, as float32 rows."""
        if not self._bodies or x.dtype != np.float32 or not x.flags.c_contiguous or self.arena is None:
            return None
        at = self.arena.contains(x)
        if at is None:
            return None
        for offset, (nbytes, _) in self._bodies.items():
            if offset <= at and at + x.nbytes <= offset + nbytes:
                return offset, at
        return None

    async def matmul(self, model: Model, checked: Checked, x: np.ndarray) -> Answer:
        (m, k), n = x.shape, checked.eff.shape[0]
        assert self.arena is not None, "the front's arena is made at its start"
        body, slot = self._body_holding(x), None
        if body is not None:  # X is multiplied where the body landed: the slot holds Y alone
            try:
                slot = self.arena.slot(m, 0, n, spill=False)
                self._bodies[body[0]][1] += 1
            except arenas.NoSharedMemory:
                body = None
        if slot is None:
            try:
                slot = self.arena.slot(m, k, n)
            except arenas.NoSharedMemory as exc:  # the arena is full and /dev/shm (or the budget) holds no more now
                raise ApiError(503, "no_shared_memory", str(exc), RETRY) from None
            except ValueError as exc:  # this request alone is over the budget: not a matter of waiting
                raise InvalidRequest(str(exc), "too_large_for_shared_memory") from None
            x_slot = slot.x()
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(x_slot, x, casting="unsafe")
        else:
            x_slot = x
        # measured here, where every front shares the work, not in the one engine process all of them wait on
        amax = amax_of(x_slot) if x.size <= INLINE_VALUES else None
        kernel = checked.kernel.name if checked.kernel is not None else "auto"
        request = contract.Matmul(0, model.id, model.version_key, checked.info.name, kernel,
                                  scheme_fields(checked.scheme), slot.segment,
                                  slot.offset if body is None else body[1], slot.y_offset, m, k, n,
                                  slot.own is not None, amax)
        tag = checked.scheme.tag if checked.scheme is not None else ""
        split = self._split_of(model.id, checked.info.name, tag, n)
        sends = [(self._engine_index(checked.info.name), request)] if split is None else \
            [(engine, msgspec.structs.replace(request, part=(start, stop))) for engine, start, stop in split]
        futures: list[asyncio.Future] = []
        try:
            for engine, part in sends:
                if not self.channels[engine].connected:
                    await self.channels[engine].connect()
                futures.append(self.channels[engine].send(part))  # a future: no task of its own
        except EngineUnavailable as exc:
            self._after(futures, slot, body)  # the blocks already asked for write into the slot until answered
            raise ApiError(503, "engine_unavailable", f"{exc}; retry after the Retry-After seconds", RETRY) from None
        answer = futures[0] if len(futures) == 1 else asyncio.gather(*futures, return_exceptions=True)
        if body is not None:  # the engines read X until they answer, whatever the answer
            answer.add_done_callback(lambda _, offset=body[0]: self._let_go_body(offset))
        try:
            got = await asyncio.shield(answer)
            dones = [got] if len(futures) == 1 else got
            failed = next((d for d in dones if isinstance(d, BaseException)), None)
            if failed is not None:
                raise failed
        except asyncio.CancelledError:  # the client went: the engines may still write Y; the slot waits for them
            self._after(futures, slot, None)  # the body's region goes with `answer`'s callback above
            raise
        except EngineUnavailable as exc:
            self.arena.release(slot)
            raise ApiError(503, "engine_unavailable", f"{exc}; retry after the Retry-After seconds", RETRY) from None
        except BaseException:
            self.arena.release(slot)
            raise
        done = dones[0]
        assert isinstance(done, contract.Done)
        timing, queue_ms, devices = done.timing, done.queue_ms, done.devices
        if len(dones) == 1:
            if done.epoch != self._epochs[sends[0][0]]:
                self._saw(sends[0][0], done.epoch)
        else:  # the blocks ran at once: each step's slowest
            for (engine, _), each in zip(sends, dones, strict=True):
                self._saw(engine, each.epoch)
            timing = {t: max(d.timing.get(t, 0.0) for d in dones) for t in done.timing}
            queue_ms = max(d.queue_ms for d in dones)
            devices = [d for each in dones for d in each.devices]
        result = Result(None, done.backend, done.activation_format, timing)  # type: ignore[arg-type]
        requests, rows, chunks = done.batch
        batch = {"requests": requests, "rows": rows, **({"chunks": chunks} if chunks > 1 else {})}
        return Answer(slot.y(), KERNELS[done.kernel], result, batch, queue_ms, devices,
                      release=lambda: self.arena.release(slot))  # type: ignore[union-attr]

    def _after(self, futures: list[asyncio.Future], slot: arenas.Slot, body: tuple[int, int] | None) -> None:
        """The slot (and the body's region) let go once every engine already asked has answered (their errors
        retrieved: nobody else awaits them)."""
        def release(_: object = None) -> None:
            if body is not None:
                self._let_go_body(body[0])
            assert self.arena is not None
            self.arena.release(slot)

        if futures:
            asyncio.gather(*futures, return_exceptions=True).add_done_callback(release)
        else:
            release()

    # -- tensors split across engines ---------------------------------------------------------------------------
    def _split_of(self, model: str, tensor: str, tag: str, n: int) -> list[tuple[int, int, int]] | None:
        """The engines' blocks of a tensor split across them, where they cover its N rows in order; else None."""
        parts = self.splits.get((model, tensor, tag)) if self.splits else None
        if not parts or len(parts) < 2 or parts[0][1] != 0 or parts[-1][2] != n:
            return None
        if any(a[2] != b[1] for a, b in itertools.pairwise(parts)):
            return None
        return parts

    def _saw(self, engine: int, epoch: int) -> None:
        """An engine's answer named its splits' epoch: a new one, and the table is asked for again (once more after
        the asking in flight, which may have missed it)."""
        if epoch != self._epochs[engine]:
            self._epochs[engine] = epoch
            self._stale = True
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self._refresh_splits())

    async def _refresh_splits(self) -> None:
        while self._stale:
            self._stale = False
            table: dict[tuple[str, str, str], list[tuple[int, int, int]]] = {}
            for engine, channel in enumerate(self.channels):
                try:
                    held = (await self._call(contract.Splits(), channel, 2.0)).value
                except ApiError:  # an engine that is down: its blocks are unknown, so those tensors run whole
                    continue
                for model, tensor, tag, start, stop in held:
                    table.setdefault((model, tensor, tag), []).append((engine, start, stop))
            self.splits = {key: sorted(parts, key=lambda p: p[1]) for key, parts in table.items()}

    async def _engines_of(self, devices: list[int] | None) -> list[Channel]:
        """The engines serving `devices` (device numbers as the API names them), or all of them."""
        if devices is None or len(self.channels) == 1:
            return self.channels
        healths = [(await self._call(contract.Health(), c)).value for c in self.channels]
        labels = [[d["device"] for d in h["devices"] if d["backend"] == h["backend"]] for h in healths]
        picked = [c for c, held in zip(self.channels, labels, strict=True)
                  if any(int(label.split(":")[1]) in devices for label in held)]
        if len(picked) != len(set(devices)):
            known = ", ".join(label for held in labels for label in held)
            raise InvalidRequest(f"devices {devices} are not all served here; devices: {known}", "bad_device")
        return picked

    async def load(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None,
                   devices: list[int] | None, placement: Literal["replicate", "split"] | None) -> dict[str, Any]:
        engines = await self._engines_of(devices)
        tag = scheme.tag if scheme is not None else ""
        if len(self.channels) > 1:
            if placement == "split" and len(engines) > 1:
                return await self._load_split(model, infos, kernel, scheme, engines)
            for info in infos:  # a whole copy on each engine named: no longer split
                self.splits.pop((model.id, info.name, tag), None)
            devices, placement = None, None  # each engine loads onto its own device
        request = {"model": model.id, "tensors": [i.name for i in infos], "kernel": kernel,
                   "scheme": scheme_fields(scheme), "devices": devices, "placement": placement,
                   "alone": len(self.channels) == 1}
        replies = await asyncio.gather(*(self._call(contract.Load(**request), c) for c in engines))
        loaded = [row for r in replies for row in r.value["loaded"]]
        return {"loaded": loaded, "resident": await self.residency(model)}

    async def _load_split(self, model: Model, infos: list[TensorInfo], kernel: str | None, scheme: Scheme | None,
                          engines: list[Channel]) -> dict[str, Any]:
        """Each tensor split by rows across the engines named, each holding its block; a product then asks each for
        its columns of Y, written into the one slot."""
        for info in infos:
            check_splittable(info, scheme)
        tag = scheme.tag if scheme is not None else ""
        loaded = []
        for info in infos:
            parts = split_rows(effective(info, scheme).shape[0], [self.channels.index(c) for c in engines])
            replies = await asyncio.gather(*(self._call(contract.Load(
                model=model.id, tensors=[info.name], kernel=kernel, scheme=scheme_fields(scheme), alone=False,
                part=(p.start, p.stop)), self.channels[p.device]) for p in parts))
            loaded += [row for r in replies for row in r.value["loaded"]]
            self.splits[(model.id, info.name, tag)] = [(p.device, p.start, p.stop) for p in parts]
        return {"loaded": loaded, "resident": await self.residency(model)}

    async def unload(self, model: Model, tensors: set[str] | None) -> dict[str, Any]:
        names = sorted(tensors) if tensors is not None else None
        for key in [k for k in self.splits if k[0] == model.id and (tensors is None or k[1] in tensors)]:
            del self.splits[key]
        freed = await self._each(lambda: contract.Unload(model=model.id, tensors=names))
        return {"freed_bytes": sum(f["freed_bytes"] for f in freed), "resident": await self.residency(model)}

    async def residency(self, model: Model) -> dict[str, Any]:
        each = await self._each(lambda: contract.Residency(model=model.id))
        tensors = [t for r in each for t in r["tensors"]]
        placed: dict[tuple[str, str], dict[str, Any]] = {}  # a tensor split across engines: its blocks joined
        whole = []
        for p in (p for r in each for p in r["placements"]):
            if p["how"] != "split":
                whole.append(p)
                continue
            joined = placed.setdefault((p["tensor"], p["weight_format"]), {**p, "replicas": [[]]})
            joined["replicas"][0] += [part for replica in p["replicas"] for part in replica]
        for p in placed.values():
            p["replicas"][0].sort(key=lambda part: part["rows"][0])
        return {"backend": each[0]["backend"], "n_bytes": sum(t["n_bytes"] for t in tensors), "tensors": tensors,
                "placements": whole + list(placed.values())}

    async def quant_times(self, model: Model, info: TensorInfo, rows: list[dict[str, Any]], schemes: list[Scheme],
                          ms: list[int]) -> tuple[str | None, bool]:
        reply = await self._call(contract.QuantTimes(model=model.id, tensor=info.name, rows=rows,
                                                     schemes=[scheme_fields(s) for s in schemes], ms=ms),
                                 self._engine_for(info.name))
        rows[:] = reply.value["rows"]
        return reply.value["device"], reply.value["timed"]

    async def metrics_text(self) -> str:
        answers = await asyncio.gather(*(self._call(contract.MetricsText(), c, 2.0) for c in self.channels),
                                       return_exceptions=True)
        texts = [a.value for a in answers if isinstance(a, contract.Reply)]
        return merge_exposition(texts)  # the engines that are down leave the fronts' own metrics
