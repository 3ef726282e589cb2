"""Dynamic batching (app/scheduler.py): merging, fairness, chunks, and results equal to running alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from app.scheduler import Scheduler
from kernels.registry import KERNELS
from kernels.types import Result
from tests.conftest import make_client

SPEC = KERNELS["ref_q8_1"]


class FakeDevice:
    """run_batch for the scheduler: records each batch, takes `seconds`, answers row sums."""

    def __init__(self, seconds: float = 0.01):
        self.seconds, self.batches = seconds, []

    async def __call__(self, context, spec, parts, alone=False, outs=None, rows_at=None):
        self.batches.append((context, [p.shape[0] for p in parts]))
        await asyncio.sleep(self.seconds)
        x = np.concatenate(parts)
        return spec or SPEC, Result(x.sum(axis=1, keepdims=True), "cpu", "q8_1_mmvq", {"gemm": 0.0})


def run(coro):
    return asyncio.run(coro)


def test_idle_device_starts_at_once_and_busy_arrivals_merge() -> None:
    dev = FakeDevice()
    sched = Scheduler(dev, max_rows=64, wait_us=100)

    async def main():
        first = asyncio.create_task(sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)  # the first starts alone while the device is idle
        rest = [asyncio.create_task(sched.submit("t", "A", np.full((2, 4), i, np.float32), None, lambda r: SPEC))
                for i in range(5)]
        return await first, await asyncio.gather(*rest)

    first, rest = run(main())
    assert dev.batches[0] == ("A", [1]) and first.batch == {"requests": 1, "rows": 1}
    assert dev.batches[1] == ("A", [2, 2, 2, 2, 2])  # the five that waited ran as one product
    for i, a in enumerate(rest):
        assert a.batch == {"requests": 5, "rows": 10} and np.array_equal(a.output, np.full((2, 1), 4.0 * i))


def test_batching_off_runs_one_request_at_a_time() -> None:
    dev = FakeDevice()
    sched = Scheduler(dev, max_rows=64, wait_us=0)

    async def main():
        return await asyncio.gather(*[sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC)
                                      for _ in range(4)])

    answers = run(main())
    assert [b for _, b in dev.batches] == [[1]] * 4 and all(a.batch["requests"] == 1 for a in answers)


def test_a_batch_holds_at_most_max_rows_and_a_kernels_own_limit() -> None:
    dev = FakeDevice()
    sched = Scheduler(dev, max_rows=5, wait_us=100)
    gemv = KERNELS["gemv"]  # max_m = 8: an explicit kernel keeps its limit

    async def main():
        blocker = asyncio.create_task(sched.submit("b", "B", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)
        waiting = [sched.submit("t", "A", np.ones((2, 4), np.float32), None, lambda r: SPEC) for _ in range(4)]
        await asyncio.gather(blocker, *waiting)
        sched.max_rows = 64
        blocker = asyncio.create_task(sched.submit("b", "B", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)
        await asyncio.gather(blocker, *[sched.submit("g", "G", np.ones((3, 4), np.float32), gemv, lambda r: gemv)
                                        for _ in range(4)])

    run(main())
    rows = [sum(b) for ctx, b in dev.batches if ctx == "A"]
    assert rows == [4, 4] and max(sum(b) for ctx, b in dev.batches if ctx == "G") <= 8


def test_a_huge_request_is_cut_and_small_ones_run_between_its_chunks() -> None:
    dev = FakeDevice(seconds=0.005)
    sched = Scheduler(dev, max_rows=100, wait_us=100)

    async def main():
        huge = asyncio.create_task(sched.submit("h", "H", np.ones((1000, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0.001)
        small = await sched.submit("s", "S", np.ones((1, 4), np.float32), None, lambda r: SPEC)
        return await huge, small

    huge, small = run(main())
    assert huge.output.shape == (1000, 1) and huge.batch["chunks"] == 10
    order = [ctx for ctx, _ in dev.batches]
    assert order.index("S") <= 2, order  # served after at most two of the huge request's ten chunks


def test_queues_of_different_tensors_take_turns() -> None:
    dev = FakeDevice(seconds=0.002)
    sched = Scheduler(dev, max_rows=2, wait_us=100)

    async def main():
        blocker = asyncio.create_task(sched.submit("z", "Z", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)
        jobs = [sched.submit(t, t, np.ones((2, 4), np.float32), None, lambda r: SPEC) for t in "AAAABBBB"]
        await asyncio.gather(blocker, *jobs)

    run(main())
    order = [ctx for ctx, _ in dev.batches][1:]
    assert order == list("ABABABAB"), order


def test_an_error_reaches_every_request_of_its_batch() -> None:
    async def failing(context, spec, parts, alone=False, outs=None, rows_at=None):
        await asyncio.sleep(0.005)
        raise RuntimeError("device fell over")

    sched = Scheduler(failing, max_rows=64, wait_us=100)

    async def main():
        return await asyncio.gather(*[sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC)
                                      for _ in range(3)], return_exceptions=True)

    assert all(isinstance(r, RuntimeError) for r in run(main()))


class WritingDevice(FakeDevice):
    """A device that writes each part's rows into its output array itself (the CUDA backend's pinned path)."""

    async def __call__(self, context, spec, parts, alone=False, outs=None, rows_at=None):
        spec, result = await super().__call__(context, spec, parts, alone)
        if outs is None or any(o is None for o in outs):
            return spec, result
        row = 0
        for p, o in zip(parts, outs, strict=True):
            o[...] = result.output[row:row + p.shape[0]]
            row += p.shape[0]
        return spec, Result(None, "cpu", "q8_1_mmvq", {"gemm": 0.0})


@pytest.mark.parametrize("device", [FakeDevice, WritingDevice])
def test_output_arrays_take_each_requests_rows(device: type) -> None:
    """With `out`, a request's answer is that array, holding its own rows of the batch: copied off the batch's
    output, or written by the device; a request cut into chunks gets them in place, with no join.  Arrays are
    poisoned (NaN) first; a request without one, in the same batch, gets its rows as before."""
    dev = device(seconds=0.002)
    sched = Scheduler(dev, max_rows=8, wait_us=100)
    xs = [np.full((m, 4), i + 1, np.float32) for i, m in enumerate((1, 3, 2, 20))]
    outs = [np.full((x.shape[0], 1), np.nan, np.float32) for x in xs]
    outs[2] = None

    async def main():
        blocker = asyncio.create_task(sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)
        return await asyncio.gather(*[sched.submit("t", "A", x, None, lambda r: SPEC, out)
                                      for x, out in zip(xs, outs, strict=True)]), await blocker

    answers, _ = run(main())
    for i, (a, out) in enumerate(zip(answers, outs, strict=True)):
        assert np.array_equal(a.output, np.full((xs[i].shape[0], 1), 4.0 * (i + 1)))
        assert out is None or a.output is out
    assert answers[3].batch["chunks"] == 3


# -- through the API, on the CPU backend ----------------------------------------------------------------

def _post_all(client, bodies: list[dict]) -> list:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: client.post("/v1/matmul", json=b), bodies))


@pytest.mark.parametrize("wait_us", [100, 0])
def test_concurrent_requests_equal_their_products_alone(models_dir: Path, rng: np.random.Generator,
                                                        wait_us: int) -> None:
    """16 clients at once on one tensor: each answer equals the same kernel on its rows alone, and with
    batching on, some ran together (the reference is slow enough on the CPU for requests to queue)."""
    xs = [rng.standard_normal((1 + i % 3, 4096)).astype(np.float32) for i in range(16)]
    bodies = [{"model": "demo", "tensor": "blk.0.attn_q.weight", "kernel": "ref_q8_1", "activations": x.tolist()}
              for x in xs]
    with make_client(models_dir, batch_wait_us=wait_us) as c:
        c.post("/v1/matmul", json=bodies[0])  # weights prepared once, outside the race
        answers = _post_all(c, bodies)
        alone = [c.post("/v1/matmul", json=b) for b in bodies]
    sizes = []
    for r, a in zip(answers, alone, strict=True):
        assert r.status_code == 200 and a.status_code == 200, r.text
        assert a.json()["batch"]["requests"] == 1
        assert np.array_equal(np.array(r.json()["output"], np.float32), np.array(a.json()["output"], np.float32))
        sizes.append(r.json()["batch"]["requests"])
        assert r.headers["X-Qgemm-Batch"] == f"{r.json()['batch']['requests']},{r.json()['batch']['rows']}"
    assert (max(sizes) > 1) == (wait_us > 0), sizes


def test_a_request_over_the_batch_rows_is_cut_into_chunks(models_dir: Path, rng: np.random.Generator) -> None:
    x = rng.standard_normal((70, 96)).astype(np.float32)
    body = {"model": "demo", "tensor": "small.q4_0.weight", "activations": x.tolist()}
    with make_client(models_dir, batch_max_rows=32) as c, make_client(models_dir) as whole:
        r, w = c.post("/v1/matmul", json=body), whole.post("/v1/matmul", json=body)
    assert r.json()["batch"] == {"requests": 1, "rows": 32, "chunks": 3}
    assert np.array_equal(np.array(r.json()["output"]), np.array(w.json()["output"]))


def test_metrics_count_requests_and_batches(client) -> None:
    client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64]})
    client.get("/v1/models/nope")
    text = client.get("/metrics").text
    assert 'qgemm_http_requests_total{method="POST",route="/v1/matmul",status="200"}' in text
    assert 'qgemm_http_requests_total{method="GET",route="/v1/models/{model_id}",status="404"}' in text
    assert "qgemm_batch_rows_bucket" in text and "qgemm_queue_depth 0.0" in text
    assert 'qgemm_http_request_seconds_bucket{le="0.005",route="/v1/matmul"}' in text


def test_multiprocess_metrics_name_each_process_by_its_kept_pid(tmp_path: Path, monkeypatch) -> None:
    """A front's multiprocess values are told the process id kept at start (no getpid() a value written), and a
    forked child's is its own: two processes never share a values file."""
    import os

    from prometheus_client import values

    from app import metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored after: other tests' metrics are in-process
    m = metrics.Metrics(engine=False)
    m.requests.labels("/v1/matmul", "POST", "200").inc()
    assert values.ValueClass.kept_pid and [p.name for p in tmp_path.iterdir()] == [f"counter_{os.getpid()}.db"]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its kept id is its own
        os.write(write, b"1" if metrics._PID[0] == os.getpid() else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 1) == b"1" and metrics._PID[0] == os.getpid()


def test_a_lone_product_done_at_launch_still_lets_other_requests_in() -> None:
    """Engine._poll yields to the loop at least once: a product whose last event completed during its own launch
    must not return at once, or a caller submitting again straight away would keep the loop from everyone else."""
    from app.engine import Engine

    class DoneAtLaunch:  # a product launched from the loop that had finished by the time its launch returned
        done = True

        def result(self):
            return "result"

    async def main() -> list[str]:
        seen: list[str] = []
        other = asyncio.get_running_loop().call_soon(seen.append, "other")
        for _ in range(3):
            seen.append(await Engine._poll(DoneAtLaunch()))
        other.cancel()
        return seen

    assert run(main())[:2] == ["other", "result"]


def test_each_request_gets_the_max_of_its_own_rows_that_the_device_measured() -> None:
    """Result.x_amax holds one max|x| per part of a batch; each request gets its parts' (a NaN wins), so that the
    engine can check a request's values after its product without a pass over X on the host."""

    async def measuring(context, spec, parts, alone=False, outs=None, rows_at=None):
        await asyncio.sleep(0.01)
        x = np.concatenate(parts)
        with np.errstate(invalid="ignore"):
            amax = [float(np.abs(p).max()) for p in parts]
        return SPEC, Result(x.sum(axis=1, keepdims=True), "cuda", "q8_1_mmvq", {"gemm": 0.0}, x_amax=amax)

    sched = Scheduler(measuring, max_rows=4, wait_us=100)
    xs = [np.full((2, 8), 1.0), np.full((3, 8), -5.0), np.full((10, 8), 2.0), np.full((1, 8), 3.0)]
    xs[2][6, 1] = np.nan  # in the second of its three chunks

    async def main() -> list:
        return await asyncio.gather(*(sched.submit("t", None, x, None, lambda rows: SPEC) for x in xs))

    amaxes = [a.x_amax for a in run(main())]
    assert amaxes[:2] == [1.0, 5.0] and np.isnan(amaxes[2]) and amaxes[3] == 3.0


def test_the_queue_depth_counts_requests_not_entries() -> None:
    """An entry of several requests counts each toward the depth admission bounds (QGEMM_MAX_QUEUE), and the depth
    falls back to 0 once they ran."""
    dev = FakeDevice()
    sched = Scheduler(dev, max_rows=64, wait_us=100)

    async def main() -> tuple[int, int]:
        hold = asyncio.create_task(sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)
        done: list[object] = []
        parts = [np.ones((1, 4), np.float32) for _ in range(5)]
        outs = [np.empty((1, 1), np.float32) for _ in range(5)]
        sched.enqueue_parts("t", "A", parts, 5, None, outs, done.append)
        waiting = sched.depth()
        await hold
        while not done:
            await asyncio.sleep(0.001)
        return waiting, sched.depth()

    assert run(main()) == (5, 0)


def test_entries_of_several_parts_batch_together_and_pass_their_rows_addresses_on() -> None:
    """Entries of several parts (a read's requests, Scheduler.enqueue_parts) run in one batch with a request of
    one part; each part's rows land in its own output array; the rows' addresses reach the device only where
    every entry of the batch gave them, in the order of the stacked rows."""
    seen: list[object] = []

    class Recording(FakeDevice):
        async def __call__(self, context, spec, parts, alone=False, outs=None, rows_at=None):
            seen.append(rows_at)
            return await super().__call__(context, spec, parts, alone, outs, rows_at)

    dev = Recording()
    sched = Scheduler(dev, max_rows=64, wait_us=100)

    async def main(with_lone: bool) -> list[object]:
        got: list[object] = []
        hold = asyncio.create_task(sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC))
        await asyncio.sleep(0)  # the device is busy with it: the entries below queue and batch
        parts = [np.full((m, 4), m, np.float32) for m in (1, 2)]
        outs = [np.full((m, 1), np.nan, np.float32) for m in (1, 2)]
        sched.enqueue_parts("t", "A", parts, 3, None, outs, got.append, ([10], [20, 21]))
        more = [np.full((1, 4), 5, np.float32)]
        more_out = [np.full((1, 1), np.nan, np.float32)]
        sched.enqueue_parts("t", "A", more, 1, None, more_out, got.append, ([30], [40]))
        lone = asyncio.create_task(sched.submit("t", "A", np.ones((1, 4), np.float32), None, lambda r: SPEC)) \
            if with_lone else None
        await hold
        if lone is not None:
            await lone
        while len(got) < 2:
            await asyncio.sleep(0.001)
        assert np.concatenate(outs + more_out)[:, 0].tolist() == [4.0, 8.0, 8.0, 20.0]
        assert [a.requests for a in got] == [3 + with_lone] * 2  # type: ignore[attr-defined]
        return got

    run(main(False))
    assert seen[1] == ([10, 30], [20, 21, 40])  # rows: 1 + 2 of the first entry, then the second's
    seen.clear()
    run(main(True))
    assert seen[1] is None  # a request without addresses in the batch: none are passed


def test_a_batch_whose_rows_the_device_reads_in_place_launches_from_the_loop_up_to_its_bound() -> None:
    """Engine._run_batch: a batch of up to LOOP_ROWS rows, or of up to LOOP_GATHERED_ROWS rows in parts of up to
    LOOP_ROWS with the rows' addresses (the device then replays a graph that reads and writes them where they lie),
    is launched from the event loop; a larger one, one past LOOP_ROWS without addresses, or one holding a part
    past LOOP_ROWS (its rows go by DMA) goes to the device's thread."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from app.engine import LOOP_GATHERED_ROWS, LOOP_ROWS, Engine, Job
    from app.settings import Settings

    engine = Engine(Settings(backend="cpu"))
    worker = engine.pools["cpu"][0]
    spec = next(k for k in KERNELS.values() if k.backend == worker.kind)
    calls: list[tuple[str, int, bool]] = []

    def answer(rows: int) -> Result:
        return Result(np.zeros((rows, 3), np.float32), worker.kind, spec.activation_format, {"total": 0.0})

    class Device:
        name = worker.kind

        def launch_inline(self, kernel, w, parts, outs=None, rows=None):
            m = sum(p.shape[0] for p in parts)
            calls.append(("loop", m, rows is not None))
            return SimpleNamespace(done=True, result=lambda: answer(m))

        def submit(self, kernel, w, parts, outs=None):
            m = sum(p.shape[0] for p in parts)
            calls.append(("thread", m, False))
            f: Future = Future()
            f.set_result(answer(m))
            return f

    worker.backend = Device()  # type: ignore[assignment]
    info = SimpleNamespace(name="t", shape=(3, 32), type_name="F32")
    job = Job(SimpleNamespace(version_key=("v", 1)), info, None, info, None)  # type: ignore[arg-type]

    async def main() -> None:
        for rows, gathered in ((LOOP_ROWS, False), (LOOP_ROWS + 1, False), (LOOP_ROWS + 1, True),
                               (LOOP_GATHERED_ROWS, True), (LOOP_GATHERED_ROWS + 1, True)):
            parts = [np.ones((1, 32), np.float32) for _ in range(rows)]
            at = ([i * 128 for i in range(rows)], [i * 12 for i in range(rows)]) if gathered else None
            await engine._run_batch(worker, job, spec, parts, False, [None] * rows, at)
        for sizes in ((LOOP_ROWS, LOOP_ROWS), (LOOP_ROWS + 1, 1), (LOOP_GATHERED_ROWS,)):  # one part too large
            parts = [np.ones((m, 32), np.float32) for m in sizes]
            rows = sum(sizes)
            await engine._run_batch(worker, job, spec, parts, False, [None] * len(parts),
                                    ([i * 128 for i in range(rows)], [i * 12 for i in range(rows)]))

    run(main())
    assert calls == [("loop", LOOP_ROWS, False), ("thread", LOOP_ROWS + 1, False), ("loop", LOOP_ROWS + 1, True),
                     ("loop", LOOP_GATHERED_ROWS, True), ("thread", LOOP_GATHERED_ROWS + 1, False),
                     ("loop", 2 * LOOP_ROWS, True), ("thread", LOOP_ROWS + 2, False),
                     ("thread", LOOP_GATHERED_ROWS, False)]
