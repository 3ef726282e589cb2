"""Shared fixtures: the real models directory, a test models directory with broken files beside
the real ones, a CPU-backend TestClient, and fresh random generators."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.demo import ensure_demo
from models.fetch import SMOLLM2

SMOL_ID = SMOLLM2.file[: -len(".gguf")]


@pytest.fixture(scope="session")
def real_models_dir() -> Path:
    """Where `qgemm fetch` put the models (QGEMM_MODELS_DIR or the default); the demo is written
    here if missing (deterministic, offline); SmolLM2 must have been fetched."""
    d = Settings.from_env().models_dir
    ensure_demo(d)
    if not (d / SMOLLM2.file).is_file():
        msg = f"{SMOLLM2.file} is not in {d}: run `qgemm fetch` first"
        if os.environ.get("QGEMM_TEST_REQUIRE_MODELS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return d


BROKEN = {
    "empty.gguf": b"",
    "notgguf.gguf": b"PK\x03\x04 this is a zip, not a GGUF file" * 4,
    "magic-only.gguf": b"GGUF",
}


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, real_models_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name in ("demo.gguf", SMOLLM2.file):
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


def make_client(models_dir: Path, **overrides: object) -> TestClient:
    settings = Settings(models_dir=models_dir, backend=overrides.pop("backend", "cpu"), **overrides)
    return TestClient(create_app(settings))


@pytest.fixture(scope="session")
def client(models_dir: Path) -> Iterator[TestClient]:
    with make_client(models_dir) as c:
        yield c


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A fresh seed for every test (never the same inputs twice); printed so a failure can be replayed."""
    seed = int(os.environ.get("QGEMM_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


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
