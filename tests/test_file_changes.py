"""Model files that change under a running server: rewritten in place, replaced by a rename, truncated,
deleted.  No product is ever computed over bytes that no longer match the table it was checked against:
the answer is the new file's product, or a 404 when the file is gone or broken, never a 500.  In each deployment:
the app with its engine in process, and `qgemm serve` with a front and an engine process, each reading the file
for itself (the engine multiplies the version the front checked, or the front reads the file again).  The same on
the CUDA backend (gpu-marked), where the old version's GPU copies are dropped too."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from kernels import reference as ref
from models.demo import write_gguf
from models.store import FileChanged, ModelStore
from tests.conftest import make_client
from tests.live import Server

Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
# (backend, deployment): the process family on the CPU as CI runs it; the CUDA backend in process (gpu-marked)
SERVERS = [pytest.param("cpu", "in-process", id="cpu-in-process"), pytest.param("cpu", "fronts", id="cpu-fronts"),
           pytest.param("cuda", "in-process", id="cuda-in-process", marks=pytest.mark.gpu)]
TIMESTAMP_TICK_S = 0.02  # past the file system's timestamp granularity (models/store.py: FileId)


def model_bytes(tmp: Path, shape: tuple[int, int], seed: int, qtype: GGMLQuantizationType = Q8_0) -> bytes:
    rng = np.random.default_rng(seed)
    path = write_gguf(tmp / f"v{seed}.gguf", [("w", qtype, rng.standard_normal(shape).astype(np.float32))],
                      arch="qgemm-test")
    data = path.read_bytes()
    path.unlink()
    return data


def expected(data: bytes, tmp: Path, x: np.ndarray) -> np.ndarray:
    """MMVQ's product (M <= 8: auto's formula on every backend) of `x` with tensor w of these bytes."""
    (tmp / "expect.gguf").write_bytes(data)
    model = ModelStore(tmp).get("expect")
    info = model.tensors["w"]
    w = ref.prepare_block_weights(info.type_name, model.raw("w"))
    return ref.ref_q8_1(w, ref.quantize_q8_1(x)).astype(np.float64)


@contextmanager
def serving(models: Path, backend: str, deployment: str) -> Iterator:
    """A client of the API over `models`: TestClient of the app in process, or httpx's of a `qgemm serve`."""
    if deployment == "in-process":
        with make_client(models, backend=backend) as c:
            yield c
        return
    server = Server(models, fronts=1, QGEMM_BACKEND=backend).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c
    finally:
        server.stop()


def product(client, x: np.ndarray) -> tuple[int, dict]:
    r = client.post("/v1/matmul", json={"model": "m", "tensor": "w", "activations": x.tolist()})
    return r.status_code, r.json()


def assert_product(client, x: np.ndarray, want: np.ndarray) -> None:
    status, body = product(client, x)
    assert status == 200, body
    y = np.asarray(body["output"], np.float64)
    assert y.shape == want.shape
    nmse = float(((y - want) ** 2).sum() / (want ** 2).sum())
    assert nmse < 1e-12, nmse  # another version's product is O(1) away


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    models, scratch = tmp_path / "models", tmp_path / "scratch"
    models.mkdir()
    scratch.mkdir()
    return models, scratch


@pytest.mark.parametrize(("backend", "deployment"), SERVERS)
def test_rewritten_in_place_with_another_shape(files: tuple[Path, Path], backend: str, deployment: str,
                                               rng: np.random.Generator) -> None:
    models, scratch = files
    old, new = model_bytes(scratch, (64, 256), 1), model_bytes(scratch, (96, 512), 2)
    (models / "m.gguf").write_bytes(old)
    x_old, x_new = rng.standard_normal((3, 256)), rng.standard_normal((2, 512))
    with serving(models, backend, deployment) as c:
        assert_product(c, x_old, expected(old, scratch, x_old))
        with open(models / "m.gguf", "r+b") as fh:  # the same inode: truncated and written again
            fh.truncate(0)
            fh.write(new)
        status, body = product(c, x_old)
        assert status == 422 and body["error"]["code"] == "k_mismatch" and "[96, 512]" in body["error"]["message"]
        assert_product(c, x_new, expected(new, scratch, x_new))
        assert c.get("/v1/models/m/tensors/w").json()["shape"] == [96, 512]
        if backend == "cuda":
            engine = c.app.state.engine
            versions = {key[0] for w in engine.pools["cuda"] for key, _, _ in w.entries()}  # every GPU's
            assert versions == {c.app.state.store.get("m").version_key}  # the old version's copies are gone


@pytest.mark.parametrize(("backend", "deployment"), SERVERS)
def test_rewritten_in_place_with_the_same_size(files: tuple[Path, Path], backend: str, deployment: str,
                                               rng: np.random.Generator) -> None:
    """Same shape, same size, other values: only the mtime tells (one timestamp tick later)."""
    models, scratch = files
    old, new = model_bytes(scratch, (64, 256), 3), model_bytes(scratch, (64, 256), 4)
    assert len(old) == len(new) and old != new
    (models / "m.gguf").write_bytes(old)
    x = rng.standard_normal((1, 256))
    with serving(models, backend, deployment) as c:
        assert_product(c, x, expected(old, scratch, x))
        time.sleep(TIMESTAMP_TICK_S)
        with open(models / "m.gguf", "r+b") as fh:
            fh.write(new)
        assert_product(c, x, expected(new, scratch, x))


@pytest.mark.parametrize(("backend", "deployment"), SERVERS)
def test_replaced_by_rename(files: tuple[Path, Path], backend: str, deployment: str,
                            rng: np.random.Generator) -> None:
    models, scratch = files
    old, new = model_bytes(scratch, (64, 256), 5), model_bytes(scratch, (64, 256), 6)
    (models / "m.gguf").write_bytes(old)
    x = rng.standard_normal((5, 256))
    with serving(models, backend, deployment) as c:
        assert_product(c, x, expected(old, scratch, x))
        (scratch / "next.gguf").write_bytes(new)
        os.replace(scratch / "next.gguf", models / "m.gguf")
        assert_product(c, x, expected(new, scratch, x))


@pytest.mark.parametrize(("backend", "deployment"), SERVERS)
def test_truncated_then_restored(files: tuple[Path, Path], backend: str, deployment: str,
                                 rng: np.random.Generator) -> None:
    models, scratch = files
    data = model_bytes(scratch, (64, 256), 7)
    (models / "m.gguf").write_bytes(data)
    x = rng.standard_normal((2, 256))
    with serving(models, backend, deployment) as c:
        assert_product(c, x, expected(data, scratch, x))
        os.truncate(models / "m.gguf", len(data) // 2)
        status, body = product(c, x)
        assert status == 409 and body["error"]["code"] == "model_unreadable" and "truncated" in body["error"][
            "message"], body  # as every route says of it
        row = next(m for m in c.get("/v1/models").json()["models"] if m["id"] == "m")
        assert row["status"] == "error"
        assert c.get("/v1/models/m/tensors/w").status_code == 409  # model_unreadable
        (models / "m.gguf").write_bytes(data)
        assert_product(c, x, expected(data, scratch, x))


@pytest.mark.parametrize(("backend", "deployment"), SERVERS)
def test_deleted(files: tuple[Path, Path], backend: str, deployment: str, rng: np.random.Generator) -> None:
    models, scratch = files
    data = model_bytes(scratch, (64, 256), 8)
    (models / "m.gguf").write_bytes(data)
    (models / "other.gguf").write_bytes(data)
    x = rng.standard_normal((1, 256))
    with serving(models, backend, deployment) as c:
        assert_product(c, x, expected(data, scratch, x))
        if backend == "cuda":
            assert c.post("/v1/models/other/load").status_code == 200
        (models / "m.gguf").unlink()
        status, body = product(c, x)
        assert status == 404 and body["error"]["code"] == "not_found", body
        assert [m["id"] for m in c.get("/v1/models").json()["models"]] == ["other"]
        assert c.get("/v1/models/m").status_code == 404
        if backend == "cuda":  # m's copies are dropped, other's stay
            ids = {key[0][0] for w in c.app.state.engine.pools["cuda"] for key, _, _ in w.entries()}  # every GPU's
            assert ids == {"other"}


def test_tensor_bytes_are_read_against_the_table(files: tuple[Path, Path]) -> None:
    """The store's own guard: raw() reads with plain reads and checks the file's identity; a file
    changed, shrunk (a mapped page of it would kill the process) or removed raises FileChanged."""
    models, scratch = files
    data = model_bytes(scratch, (64, 256), 9)
    path = models / "m.gguf"
    for change in (lambda: os.truncate(path, len(data) // 2), lambda: path.unlink(),
                   lambda: os.replace(shutil.copy(path, scratch / "copy.gguf"), path)):
        path.write_bytes(data)
        store = ModelStore(models)
        model = store.get("m")
        assert model.raw("w").shape == (64, 256 // 32 * 34)
        change()
        with pytest.raises(FileChanged):
            model.raw("w")


def test_hidden_and_part_files_are_never_listed(files: tuple[Path, Path]) -> None:
    models, scratch = files
    data = model_bytes(scratch, (64, 256), 10)
    (models / "m.gguf").write_bytes(data)
    (models / ".fetch-abc123.gguf.part").write_bytes(data)
    (models / ".hidden.gguf").write_bytes(data)
    store = ModelStore(models)
    assert [m.id for m in store.scan()] == ["m"]
    for name in (".hidden", "../m", ""):
        with pytest.raises(LookupError):
            store.get(name)
