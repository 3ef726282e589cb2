"""One client's M = 1 `.npy` products against a running server, each step's median from Server-Timing beside the
client's own wall time: where a lone request's time goes (the device's steps, the engine's share, the front's).
    usage: python scripts/one_client_timing.py http://127.0.0.1:8000 [requests]"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the imports that need a GPU
    print(__doc__)
    sys.exit(0)

import io
import statistics
import time

import httpx
import numpy as np


def main() -> None:
    url, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400
    x = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, x)
    body = buf.getvalue()
    rows = []
    with httpx.Client() as client:
        for _ in range(count):
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/matmul", params={"model": "demo", "tensor": "blk.0.attn_q.weight"},
                            content=body, headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
            wall = (time.perf_counter() - t0) * 1e3
            steps = {}
            for part in r.headers["server-timing"].split(","):
                if ";dur=" in part:
                    name, dur = part.split(";dur=")
                    steps[name.strip()] = float(dur)
            rows.append({**steps, "client wall": wall})
    for key in rows[-1]:
        values = [row[key] for row in rows[count // 4:] if key in row]  # after a warm-up
        print(f"{key:12s} p50 {statistics.median(values):8.3f} ms")


if __name__ == "__main__":
    main()
