"""Shared fixtures: the real models directory, a test models directory with broken files beside
the real ones, a CPU-backend TestClient, and fresh random generators.

Random inputs come from one seed per run (QGEMM_TEST_SEED, else a fresh one), printed in the header
and the summary of every run: `QGEMM_TEST_SEED=<seed> pytest ...` replays them.  Each test draws from
its own stream (the seed and the test's id), so a test's inputs do not depend on which others ran.
QGEMM_TEST_SEEDS=<n> runs every seeded test n times, with the seeds of n consecutive runs (the seed
sweep: scripts/seed_sweep.sh).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.demo import ensure_demo
from models.fetch import GEMMA3_Q4_K_M, SMOLLM2
from models.store import ModelStore


def _run_dir(env: str, prefix: str) -> Path:
    """A directory for the whole run, made and removed at exit by the process that starts it; pytest-xdist's workers
    inherit it through `env` (a worker's own exit hooks did not always run: one of two workers' directories was left
    behind by each CI run)."""
    if os.environ.get(env):
        return Path(os.environ[env])
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ[env] = str(d)
    atexit.register(shutil.rmtree, d, True)
    return d


# the header indexes of this run (models/gguf_index.py), for its TestClients and for the servers its tests start:
# large headers are read once per run, by `real_models_dir`, not once per client
CACHE_DIR = _run_dir("QGEMM_TEST_CACHE_DIR", "qgemm-test-cache-")
os.environ["QGEMM_CACHE_DIR"] = str(CACHE_DIR)
RUN_DIR = _run_dir("QGEMM_TEST_RUN_DIR", "qgemm-test-run-")  # scratch for what a test module makes at import
SMOL_ID = SMOLLM2.file[: -len(".gguf")]
GEMMA_ID = GEMMA3_Q4_K_M.file[: -len(".gguf")]


def find_real_models_dir() -> Path:
    """Where `qgemm fetch` put the models (QGEMM_MODELS_DIR or the default); the demo is written
    here if missing (deterministic, offline); SmolLM2 must have been fetched (else the tests skip,
    or fail under QGEMM_TEST_REQUIRE_MODELS=1, as CI runs them)."""
    d = Settings.from_env().models_dir
    ensure_demo(d)
    if not (d / SMOLLM2.file).is_file():
        msg = f"{SMOLLM2.file} is not in {d}: run `qgemm fetch` first"
        if os.environ.get("QGEMM_TEST_REQUIRE_MODELS") == "1":
            pytest.fail(msg)
        pytest.skip(msg, allow_module_level=True)
    return d


@pytest.fixture(scope="session")
def real_models_dir() -> Path:
    d = find_real_models_dir()
    ModelStore(d, cache_dir=Settings(cache_dir=CACHE_DIR).index_dir).scan()  # every large header, once
    return d


BROKEN = {
    "empty.gguf": b"",
    "notgguf.gguf": b"PK\x03\x04 this is a zip, not a GGUF file" * 4,
    "magic-only.gguf": b"GGUF",
}


def populate_models_dir(d: Path, real_models_dir: Path) -> Path:
    """The real models (linked) beside broken files of every kind."""
    for name in ("demo.gguf", SMOLLM2.file, GEMMA3_Q4_K_M.file):
        if (real_models_dir / name).is_file():  # Gemma: where fetched (tests/test_groups.py says if it must be)
            (d / name).symlink_to(real_models_dir / name)
    for name, data in BROKEN.items():
        (d / name).write_bytes(data)
    demo = (real_models_dir / "demo.gguf").read_bytes()
    (d / "truncated.gguf").write_bytes(demo[: len(demo) // 2])  # header fine, tensor data cut
    contradictory = bytearray(demo[:4096])
    contradictory[8:16] = (10**6).to_bytes(8, "little")  # claims a million tensors
    (d / "contradictory.gguf").write_bytes(bytes(contradictory))
    (d / "notes.txt").write_text("not a model")
    return d


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, real_models_dir: Path) -> Path:
    return populate_models_dir(tmp_path_factory.mktemp("models"), real_models_dir)


def make_client(models_dir: Path, **overrides: object) -> TestClient:
    overrides.setdefault("cache_dir", CACHE_DIR)
    settings = Settings(models_dir=models_dir, backend=overrides.pop("backend", "cpu"), **overrides)
    return TestClient(create_app(settings))


@pytest.fixture(scope="session")
def in_process(models_dir: Path) -> Iterator[TestClient]:
    """The app with its engine in this process (`client`; by this name where a module's `client` walks every
    deployment, for a test that reaches inside the app)."""
    with make_client(models_dir) as c:
        yield c


@pytest.fixture(scope="session")
def client(in_process: TestClient) -> TestClient:
    return in_process


RUN_SEED = int(os.environ.get("QGEMM_TEST_SEED") or secrets.randbits(32))
os.environ["QGEMM_TEST_SEED"] = str(RUN_SEED)  # pytest-xdist's workers (started after this) draw from the same seed
SWEEP = max(1, int(os.environ.get("QGEMM_TEST_SEEDS") or 1))


def pytest_report_header(config: pytest.Config) -> str:
    sweep = f", swept over {SWEEP} consecutive seeds (QGEMM_TEST_SEEDS)" if SWEEP > 1 else ""
    return f"qgemm: random inputs from QGEMM_TEST_SEED={RUN_SEED}{sweep}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    last = f"..{RUN_SEED + SWEEP - 1}" if SWEEP > 1 else ""
    terminalreporter.write_line(f"qgemm: this run's random inputs came from QGEMM_TEST_SEED={RUN_SEED}{last}; "
                                "set it to replay them")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if SWEEP > 1 and "rng" in metafunc.fixturenames:
        metafunc.parametrize("seed_offset", range(SWEEP), ids=[f"seed+{i}" for i in range(SWEEP)])


@pytest.fixture
def seed_offset() -> int:
    return 0


def stream_seed(key: str, offset: int = 0) -> list[int]:
    """The seed of one named stream of this run (a test, or a module's shared weights)."""
    return [RUN_SEED + offset, zlib.crc32(key.encode())]


@pytest.fixture
def rng(request: pytest.FixtureRequest, seed_offset: int) -> np.random.Generator:
    """Fresh inputs on every run, drawn from the run's seed and this test's id (the sweep's id left out, so
    seed+i draws what a run with QGEMM_TEST_SEED + i draws)."""
    key = request.node.nodeid.replace(f"seed+{seed_offset}-", "").replace(f"-seed+{seed_offset}", "")
    key = key.replace(f"[seed+{seed_offset}]", "")
    request.node.user_properties.append(("seed", RUN_SEED + seed_offset))
    return np.random.default_rng(stream_seed(key, seed_offset))


@pytest.fixture
def scratch_models(tmp_path: Path, real_models_dir: Path) -> Path:
    """An empty per-test models directory (the demo copied in when a test asks for it)."""
    return tmp_path


def copy_demo(real_models_dir: Path, into: Path) -> Path:
    return Path(shutil.copy(real_models_dir / "demo.gguf", into / "demo.gguf"))


def cuda_device_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_device_present():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device through CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The deployments a request can reach the engine through: the app with its engine in process (TestClient; `qgemm
# serve --fronts 0` and a Ray replica serve the same app), and `qgemm serve` as a user starts it, an HTTP front
# and engine processes.  The API, bad-input and model-route tests take `api` (the schemathesis and file-change tests
# start their own of each), so that a difference between them is a failing test.
DEPLOYMENTS = ("in-process", "fronts")


@pytest.fixture(scope="session")
def fronts_url(models_dir: Path) -> Iterator[str]:
    """A `qgemm serve` with one front and an engine process per CPU device (two), over the test models."""
    from tests.live import Server

    server = Server(models_dir, fronts=1, QGEMM_BACKEND="cpu", QGEMM_CPU_DEVICES="2").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session", params=DEPLOYMENTS)
def api(request: pytest.FixtureRequest, models_dir: Path) -> Iterator[httpx.Client]:
    """An HTTP client of the API, through each deployment in turn (TestClient is an httpx.Client)."""
    if request.param == "in-process":
        yield request.getfixturevalue("in_process")
    else:
        with httpx.Client(base_url=request.getfixturevalue("fronts_url"), timeout=120) as c:
            yield c
