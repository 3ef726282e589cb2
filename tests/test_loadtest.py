"""qgemm loadtest's HTTP client (tools/loadtest.py Connection): answers read straight into their arrays, whole and in
order over a kept-alive connection, a closed one made again, and bodies not kept when they are not wanted."""

from __future__ import annotations

import asyncio

import numpy as np

from tools.loadtest import Connection, request_bytes


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
