"""qgemm loadtest's HTTP client (tools/loadtest.py Connection): answers read straight into their arrays, whole and in
order over a kept-alive connection, a closed one made again, and bodies not kept when they are not wanted."""

from __future__ import annotations

import asyncio

import numpy as np

from tools.loadtest import Connection, cpu_use, request_bytes


def test_connection_reads_large_answers_whole_and_reconnects_after_close() -> None:
    rng = np.random.default_rng()
    bodies = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (0, 7, (3 << 20) + 5, 65_537)]
    served: list[int] = []

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport, self.buf = transport, bytearray()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = bytes(self.buf[:end]).lower()
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(self.buf) < end + 4 + length:
                    return
                del self.buf[:end + 4 + length]
                i = len(served)
                served.append(i)
                body = bodies[i % len(bodies)]
                close = b"connection: close\r\n" if i == 1 else b""
                answer = b"HTTP/1.1 200 OK\r\n" + close + b"content-length: %d\r\n\r\n" % len(body) + body
                for at in range(0, len(answer), 4099):  # the head and body cut at odd places
                    self.transport.write(answer[at:at + 4099])
                if close:
                    self.transport.close()

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        host, port, request = request_bytes("POST", f"http://127.0.0.1:{port}/v1/matmul", {}, b"x" * 1001)
        kept = Connection(host, port, request)
        for i in range(6):
            status, headers, body = await kept.send()
            assert status == 200 and bytes(body) == bodies[i % len(bodies)], i
        dropped = Connection(host, port, request, keep_body=False)
        status, headers, body = await dropped.send()
        assert status == 200 and body == b"" and int(headers["content-length"]) == len(bodies[6 % len(bodies)])
        kept.close()
        dropped.close()
        server.close()

    asyncio.run(run())
    assert len(served) == 7


def test_cpu_use_adds_a_roles_processes_per_request_and_names_its_busiest() -> None:
    """loadtest's CPU figures: each role's processes summed per request answered, and the busiest process's share
    of a core over the run (what says which process bounds it)."""
    before = {("front", 1): 10.0, ("front", 2): 4.0, ("engine", 3): 7.0, ("client", 4): 1.0}
    after = {("front", 1): 13.6, ("front", 2): 5.0, ("engine", 3): 7.5, ("client", 4): 1.2}
    per_request, busiest = cpu_use(before, after, requests=20_000, seconds=4.0)
    assert per_request == {"front": 230.0, "engine": 25.0, "client": 10.0}
    assert busiest == {"front": 0.9, "engine": 0.125, "client": 0.05}
