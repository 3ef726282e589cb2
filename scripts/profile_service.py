"""Where an M = 1 request's server time goes (GPU machine): the backend's product alone, then the
engine's whole path (checks, scheduler, thread hop, product), each timed over many calls and profiled.
    python3 scripts/profile_service.py [tensor] [M]"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the imports that need a GPU
    print(__doc__)
    sys.exit(0)

import asyncio
import cProfile
import pstats
import time

import numpy as np

from app.engine import Engine
from app.settings import Settings
from app.tensors import weights
from models.store import ModelStore

N_CALLS = 2000


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "blk.0.attn_q.weight"
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    settings = Settings.from_env(backend="cuda")
    store = ModelStore(settings.models_dir)
    store.scan()
    model, info = store.tensor("demo", name)
    engine = Engine(settings)
    x = np.random.default_rng(0).standard_normal((m, info.shape[1])).astype(np.float32)
    spec = engine.choose("auto", info, m)
    w = weights(model, info)
    cuda = engine.cuda

    def backend_only() -> None:
        for _ in range(N_CALLS):
            cuda.run_here(spec, w, [x])

    t = [cuda.on_thread(lambda: cuda.run_here(spec, w, [x])).result().timing_ms for _ in range(50)][-1]
    print(f"{spec.name} M={m}: device timing {t}")
    t0 = time.perf_counter()
    cuda.on_thread(backend_only).result()
    print(f"backend run_here on the worker: {(time.perf_counter() - t0) / N_CALLS * 1e6:.1f} us per call")
    prof = cProfile.Profile()
    cuda.on_thread(lambda: (prof.enable(), backend_only(), prof.disable())).result()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)

    async def engine_path() -> None:
        for _ in range(N_CALLS):
            await engine.matmul(model, info, x, "auto")

    async def hops() -> None:
        for _ in range(N_CALLS):
            await asyncio.wrap_future(cuda.on_thread(lambda: None))

    t0 = time.perf_counter()
    asyncio.run(hops())
    print(f"a round trip to the worker thread and back: {(time.perf_counter() - t0) / N_CALLS * 1e6:.1f} us")

    async def prepare_only() -> None:
        for _ in range(N_CALLS):
            engine.prepare(info, x, "auto")

    t0 = time.perf_counter()
    asyncio.run(prepare_only())
    print(f"engine.prepare (the request's checks): {(time.perf_counter() - t0) / N_CALLS * 1e6:.1f} us")

    asyncio.run(engine_path())
    t0 = time.perf_counter()
    asyncio.run(engine_path())
    print(f"engine.matmul (checks + scheduler + hop + product): {(time.perf_counter() - t0) / N_CALLS * 1e6:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(engine_path())
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    engine.close()


if __name__ == "__main__":
    main()
