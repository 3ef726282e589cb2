"""The channel between fronts and engines (app/ipc.py) and their shared memory (app/shm.py), without a server."""

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

from app import ipc, shm
from app.errors import ApiError
from app.supervisor import arena_bytes_for

MiB = 1 << 20


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _echo_server(path: str, delay: float) -> asyncio.AbstractServer:
    async def handle(msg: dict[str, Any]) -> dict[str, Any]:
        if msg["op"] == "boom":
            raise RuntimeError("broken")
        await asyncio.sleep(delay * msg.get("slow", 0))
        return {"echo": msg["value"]}

    return await ipc.serve(path, handle)


def test_many_calls_in_flight_each_get_their_own_answer(tmp_path: Path) -> None:
    """Answers come back out of order (the slow ones last) and each finds its caller; a fault of the handler is a
    500 answer, and the connection keeps serving."""
    path = str(tmp_path / "e.sock")

    async def main() -> None:
        server = await _echo_server(path, delay=0.05)
        channel = ipc.Channel(path)
        values = [{"op": "echo", "value": i, "slow": i % 3} for i in range(200)]
        answers = await asyncio.gather(*(channel.call(dict(v)) for v in values))
        assert [a["echo"] for a in answers] == list(range(200))
        assert (await channel.call({"op": "boom"}))["error"]["status"] == 500
        assert (await channel.call({"op": "echo", "value": "after"}))["echo"] == "after"
        await channel.close()
        server.close()

    run(main())


def test_frames_cut_anywhere_are_put_back_together() -> None:
    got: list[dict[str, Any]] = []
    end = ipc.Framed(got.append, lambda: None)
    data = b"".join(ipc.frame({"i": i, "pad": "x" * i}) for i in range(50))
    for at in range(0, len(data), 7):  # 7 bytes at a time: headers and bodies split everywhere
        end.data_received(data[at:at + 7])
    assert [m["i"] for m in got] == list(range(50))


def test_a_frame_too_large_drops_the_connection() -> None:
    closed: list[bool] = []

    class Transport:
        def close(self) -> None:
            closed.append(True)

        def is_closing(self) -> bool:
            return bool(closed)

    end = ipc.Framed(lambda m: pytest.fail("no message from a broken peer"), lambda: None)
    end.connection_made(Transport())  # type: ignore[arg-type]
    end.data_received(ipc.HEADER.pack(ipc.MAX_FRAME + 1) + b"{}")
    assert closed


ENGINE = """
import asyncio, sys
from app import ipc

async def handle(msg):
    await asyncio.sleep(msg.get("slow", 0))
    return {"echo": msg["value"]}

async def main():
    await ipc.serve(sys.argv[1], handle)
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
            assert (await channel.call({"op": "echo", "value": 1}))["echo"] == 1
            waiting = asyncio.ensure_future(channel.call({"op": "echo", "value": 2, "slow": 30}))
            await asyncio.sleep(0.1)
            engine.kill()
            t0 = time.perf_counter()
            with pytest.raises(ipc.EngineUnavailable):
                await asyncio.wait_for(waiting, 5)
            assert time.perf_counter() - t0 < 1.0
            os.unlink(path)
            with pytest.raises(ipc.EngineUnavailable):
                await channel.call({"op": "echo", "value": 3})

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
    from app.remote import RemoteService
    from models.gguf_index import TensorInfo

    service = RemoteService(str(tmp_path / "none.sock"), tmp_path, "test", 4 * MiB, 8192)
    service.open()
    try:
        monkeypatch.setattr(os, "posix_fallocate",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        info = TensorInfo(name="w", type_name="Q8_0", shape=(4096, 4096), n_elements=4096 * 4096,
                          n_bytes=4096 * 4352, offset=0)
        x = np.ones((512, 4096), np.float32)  # 8 MiB of X and 8 of Y: more than the 4 MiB arena
        with pytest.raises(ApiError) as caught:
            run(service.matmul(None, info, x, "auto", None))  # type: ignore[arg-type]
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

    from app import supervisor
    from app.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(shm, "shm_free", lambda: 1 * MiB)
    settings = Settings(models_dir=tmp_path, cache_dir=tmp_path / "cache", port=port, backend="cpu")
    with caplog.at_level("ERROR", logger="qgemm"):
        assert supervisor.Supervisor(settings, 8).run() == 2
    assert "--shm-size" in caplog.text
    assert not supervisor.run_dir_for(settings).exists()  # nothing started, nothing left
