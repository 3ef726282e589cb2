"""The channel between fronts and engines (app/serving/channel.py), the contract of its messages
(app/serving/contract.py) and their shared memory (app/serving/arenas.py), without a server."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.errors import ApiError, as_http
from app.serving import arenas as shm
from app.serving import channel as ipc
from app.serving import contract
from app.serving.supervisor import arena_bytes_for
from kernels.errors import Conflict, DeviceOutOfMemory, InvalidRequest, Overloaded
from models.store import FileChanged, NotFound, Unreadable

MiB = 1 << 20


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _echo(delay: float) -> ipc.OnRequests:
    """An engine that answers Residency(model) with the model's name after `delay` times the digit after "slow",
    and with an error of its own for "boom"."""

    def on_requests(end: ipc.Framed, requests: list[contract.Request]) -> None:
        for r in requests:
            assert isinstance(r, contract.Residency)

            async def one(r: contract.Residency = r) -> None:
                if r.model == "boom":
                    end.send(contract.failed(r.id, RuntimeError("broken")))
                    return
                await asyncio.sleep(delay * int(r.model[4:] or 0) if r.model.startswith("slow") else 0)
                end.send(contract.Reply(r.id, r.model))

            asyncio.get_running_loop().create_task(one())

    return on_requests


def test_many_calls_in_flight_each_get_their_own_answer(tmp_path: Path) -> None:
    """Answers come back out of order (the slow ones last) and each finds its caller; a fault of the engine's own
    is an EngineFault (500 at the edge), and the connection keeps serving."""
    path = str(tmp_path / "e.sock")

    async def main() -> None:
        server = await ipc.serve(path, _echo(0.05))
        channel = ipc.Channel(path)
        names = [f"slow{i % 3}" for i in range(200)]
        answers = await asyncio.gather(*(channel.call(contract.Residency(model=n)) for n in names))
        assert [a.value for a in answers] == names
        assert len({a.id for a in answers}) == 200
        with pytest.raises(contract.EngineFault, match="broken"):
            await channel.call(contract.Residency(model="boom"))
        assert (await channel.call(contract.Residency(model="after"))).value == "after"
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # this user's processes only
        await channel.close()
        server.close()

    run(main())


@pytest.mark.parametrize("error", [InvalidRequest("K must be 64", "k_mismatch"), Conflict("no", "no_gpu"),
                                   Overloaded("full"), DeviceOutOfMemory("oom"), NotFound("no tensor 'x'"),
                                   FileChanged("changed"), Unreadable("cut short")])
def test_domain_errors_cross_as_themselves(error: Exception) -> None:
    """An engine's error reaches the front as the same class, code and message: the HTTP answer is the one a
    one-process server gives (app/errors.py maps it at the edge)."""
    body = contract.encode([contract.failed(7, error)])
    (answer,) = contract.decode_answers(body)
    again = contract.error_of(answer)  # type: ignore[arg-type]
    assert type(again) is type(error) and answer.id == 7
    assert as_http(again) == as_http(error)


def test_every_message_round_trips() -> None:
    messages = [contract.Matmul(1, "demo", ("demo", 1, 2, 3, 4, 5), "t", "auto", ("nf4", 64, True), "seg", 0, 256,
                                3, 64, 33, False),
                contract.Load(2, "demo", ["a", "b"], None, None, [0, 1], "split"), contract.Health(3),
                contract.Unload(4, "demo", None), contract.QuantTimes(5, "demo", "t", [{"a": 1}], [("q8_0", 0, False)],
                                                                     [1, 8])]
    assert contract.decode_requests(contract.encode(messages)) == messages
    answers = [contract.Done(1, "ref_q8_1", "cpu", "q8_1_mmvq", {"gemm": 0.5}, (3, 5, 1), 0.25, ["cpu:0"]),
               contract.Reply(2, {"x": [1, 2]}), contract.Failed(3, "NotFound", "", "gone")]
    assert contract.decode_answers(contract.encode(answers)) == answers


def test_frames_cut_anywhere_are_put_back_together() -> None:
    got: list[contract.Request] = []
    end = ipc.Framed(contract.decode_requests, lambda _, ms: got.extend(ms), lambda: None)
    frames = []
    for i in range(50):
        body = contract.encode([contract.Residency(i, "x" * i)])
        frames.append(ipc.HEADER.pack(len(body)) + body)
    data = b"".join(frames)
    for at in range(0, len(data), 7):  # 7 bytes at a time: headers and bodies split everywhere
        end.data_received(data[at:at + 7])
    assert [m.id for m in got] == list(range(50))


def test_a_frame_too_large_or_garbled_drops_the_connection() -> None:
    class Transport:
        def __init__(self) -> None:
            self.closed = False

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

    for data in (ipc.HEADER.pack(ipc.MAX_FRAME + 1) + b"{}", ipc.HEADER.pack(3) + b"\xc1\xc1\xc1"):
        transport = Transport()

        end = ipc.Framed(contract.decode_requests, lambda *_: pytest.fail("no message from a broken peer"),
                         lambda: None)
        end.connection_made(transport)  # type: ignore[arg-type]
        end.data_received(data)
        assert transport.closed


ENGINE = """
import asyncio, sys
from app.serving import channel, contract

def on_requests(end, requests):
    for r in requests:
        async def one(r=r):
            await asyncio.sleep(30 if r.model == "slow" else 0)
            end.send(contract.Reply(r.id, r.model))
        asyncio.get_running_loop().create_task(one())

async def main():
    await channel.serve(sys.argv[1], on_requests)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_calls_fail_at_once_when_the_engine_goes(tmp_path: Path) -> None:
    """A kill -9 of the engine: the call waiting on it fails at once (EngineUnavailable), and so does the next."""
    path = str(tmp_path / "e.sock")
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, path], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent)
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"

        async def main() -> None:
            channel = ipc.Channel(path)
            assert (await channel.call(contract.Residency(model="one"))).value == "one"
            waiting = asyncio.ensure_future(channel.call(contract.Residency(model="slow")))
            await asyncio.sleep(0.1)
            engine.kill()
            t0 = time.perf_counter()
            with pytest.raises(ipc.EngineUnavailable):
                await asyncio.wait_for(waiting, 5)
            assert time.perf_counter() - t0 < 1.0
            os.unlink(path)
            with pytest.raises(ipc.EngineUnavailable):
                await channel.call(contract.Residency(model="three"))

        run(main())
    finally:
        engine.kill()
        engine.wait()


def test_a_segment_dev_shm_cannot_hold_is_an_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs files are sparse: without the reservation, the first write past a full /dev/shm is a SIGBUS."""

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm.segment_name("test", os.getpid(), 999)
    with pytest.raises(shm.NoSharedMemory, match="--shm-size"):
        shm.create(name, 8 * MiB)
    assert not (shm.SHM_DIR / name).exists()  # nothing left behind


def test_a_front_answers_503_when_no_segment_fits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from app.checks import Checked
    from app.serving.front import RemoteService
    from models.gguf_index import TensorInfo

    service = RemoteService([str(tmp_path / "none.sock")], tmp_path, "test", 4 * MiB)
    service.open()
    try:
        monkeypatch.setattr(os, "posix_fallocate",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        info = TensorInfo(name="w", type_name="Q8_0", shape=(4096, 4096), n_elements=4096 * 4096,
                          n_bytes=4096 * 4352, offset=0)
        x = np.ones((512, 4096), np.float32)  # 8 MiB of X and 8 of Y: more than the 4 MiB arena
        with pytest.raises(ApiError) as caught:
            run(service.matmul(None, Checked(info, None, info, None), x))  # type: ignore[arg-type]
        assert caught.value.status == 503 and caught.value.code == "no_shared_memory"
        assert caught.value.headers == {"Retry-After": "1"}
    finally:
        run(service.close())


@pytest.mark.parametrize(("want", "fronts", "free", "expected"), [
    (64 * MiB, 8, 128 << 30, 64 * MiB),  # a host's /dev/shm: as asked
    (64 * MiB, 8, 64 * MiB, 4 * MiB),  # Docker's default 64 MiB: half of it over 8 fronts
    (64 * MiB, 2, 200 * MiB, 50 * MiB),
])
def test_arenas_shrink_to_what_dev_shm_holds(want: int, fronts: int, free: int, expected: int) -> None:
    assert arena_bytes_for(want, fronts, free) == expected


def test_a_dev_shm_too_small_for_any_arena_is_refused() -> None:
    with pytest.raises(ValueError, match="--shm-size"):
        arena_bytes_for(64 * MiB, 8, 8 * MiB)


def test_serve_refuses_in_one_line_when_dev_shm_is_too_small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from app.serving import supervisor
    from app.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(shm, "shm_free", lambda: 1 * MiB)
    settings = Settings(models_dir=tmp_path, cache_dir=tmp_path / "cache", port=port, backend="cpu")
    with caplog.at_level("ERROR", logger="qgemm"):
        assert supervisor.Supervisor(settings, 8).run() == 2
    assert "--shm-size" in caplog.text
    assert not list(supervisor.run_base().glob(supervisor.run_dir_prefix(port) + "*"))  # nothing started or left


def test_segment_names_cannot_be_guessed_and_a_taken_one_is_avoided(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user who creates the name a front would take next gets nothing: the front takes another name."""
    import secrets

    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    squatted = shm.SHM_DIR / f"qgemm-test-{os.getpid()}-0aaaaaaaaaaaa"
    squatted.write_bytes(b"\0" * 4096)
    try:
        arena = shm.Arena("test", 1 * MiB)
        assert arena.name == f"qgemm-test-{os.getpid()}-1bbbbbbbbbbbb" and shm.owner(arena.name) == os.getpid()
        arena.close()
    finally:
        squatted.unlink()


def test_segments_of_their_own_stay_within_the_fronts_budget() -> None:
    """Requests too large for the arena get segments of their own only up to the in-flight budget (503 past it:
    retry), and one request over the whole budget is refused outright (it would never fit)."""
    arena = shm.Arena("test", 1 * MiB, own_budget=20 * MiB)
    try:
        first = arena.slot(512, 4096, 1024)  # 8 + 2 MiB: its own segment
        assert first.own is not None and arena.own_bytes == first.nbytes
        with pytest.raises(shm.OverBudget, match="QGEMM_FRONT_INFLIGHT_BYTES"):
            arena.slot(1024, 4096, 1024)  # 20 MiB more
        with pytest.raises(ValueError, match="over the 20 MiB"):
            arena.slot(4096, 4096, 1024)
        arena.release(first)
        assert arena.own_bytes == 0
        second = arena.slot(1024, 4096, 256)  # fits once the first is gone
        arena.release(second)
    finally:
        arena.close()


def test_a_body_read_into_the_arena_is_given_back_after_its_request_and_its_product() -> None:
    """A front's body regions (app/edge.py reads large bodies into them): X found where it lies, the region held
    by the request and by a product until both are done, and the arena whole again afterwards, in either order."""
    from app.serving.front import RemoteService

    service = RemoteService([], Path("/nonexistent"), "test", 4 * MiB)
    service.open()
    arena = service.arena
    assert arena is not None
    try:
        whole = list(arena._free)
        got = service.body_buffer(2 * MiB + 100)
        assert got is not None and service.body_buffer(3 * MiB) is None  # no room: the body reads into its own
        view, release = got
        x = np.frombuffer(view, np.float32, 1000 * 64, 128).reshape(1000, 64)
        offset, at = service._body_holding(x)  # type: ignore[misc]
        assert at == offset + 128
        assert service._body_holding(np.ones((4, 64), np.float32)) is None  # memory of its own
        service._bodies[offset][1] += 1  # a product holds it
        release()  # the request is over first
        assert arena._free != whole
        service._let_go_body(offset)  # then the product
        assert arena._free == whole and not service._bodies
        del x  # no view of the arena left: it closes whole
        view.release()
    finally:
        arena.close()
