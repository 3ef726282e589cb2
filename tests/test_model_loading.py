"""Large GGUF headers are read off the request path, once per file version: a model whose header is being read
in a child process is listed as `loading` (nothing else waits for it), a request for it waits for that read
alone, and the index is kept on disk so that the next start (or `qgemm inspect`) reads it in milliseconds."""

from __future__ import annotations

import time
from pathlib import Path

from app.cli import inspect_file
from models.store import ModelStore
from tests.conftest import SMOL_ID, make_client


def _dir_with_smollm2(tmp_path: Path, real_models_dir: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    (d / f"{SMOL_ID}.gguf").symlink_to(real_models_dir / f"{SMOL_ID}.gguf")  # a 1.8 MB header
    (d / "demo.gguf").symlink_to(real_models_dir / "demo.gguf")  # a 4 KB one
    return d


def test_a_large_header_is_read_in_the_background_and_cached(tmp_path: Path, real_models_dir: Path) -> None:
    models, cache = _dir_with_smollm2(tmp_path, real_models_dir), tmp_path / "cache"
    with make_client(models, cache_dir=cache) as c:
        t0 = time.perf_counter()
        listed = {m["id"]: m for m in c.get("/v1/models").json()["models"]}
        assert time.perf_counter() - t0 < 1.0  # never waits for a header
        assert listed["demo"]["status"] == "ok"  # small headers are read at once
        assert listed[SMOL_ID]["status"] in ("loading", "ok")  # ok only if the child was that quick
        assert c.get("/healthz").status_code == 200
        r = c.get(f"/v1/models/{SMOL_ID}")  # this request waits for its model, and only for it
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["tensor_count"] == 272
        assert r.json()["metadata"]["general.architecture"] == "llama"
        listed = {m["id"]: m for m in c.get("/v1/models").json()["models"]}
        assert listed[SMOL_ID]["status"] == "ok"
    assert len(list((cache / "gguf-index").glob("*.json"))) == 1  # kept for the next start
    with make_client(models, cache_dir=cache) as c:  # the next start: from the index, at once
        listed = {m["id"]: m for m in c.get("/v1/models").json()["models"]}
        assert listed[SMOL_ID]["status"] == "ok" and listed[SMOL_ID]["tensor_count"] == 272


def test_a_broken_large_header_is_an_error_after_loading(tmp_path: Path, real_models_dir: Path) -> None:
    d = tmp_path / "models"
    d.mkdir()
    data = bytearray((real_models_dir / f"{SMOL_ID}.gguf").read_bytes()[: 3 << 20])  # header whole, data cut
    (d / "cut.gguf").write_bytes(bytes(data))
    store = ModelStore(d, cache_dir=tmp_path / "cache", background=True)
    assert store.scan()[0].status == "loading"
    (model,) = store.settled()
    assert model.status == "error" and "past the end of the file" in model.error
    assert not list((tmp_path / "cache").glob("*.json"))  # nothing cached for a broken file


def test_inspect_reads_the_file_alone(tmp_path: Path, real_models_dir: Path, monkeypatch) -> None:
    d = _dir_with_smollm2(tmp_path, real_models_dir)
    (d / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    monkeypatch.setenv("QGEMM_CACHE_DIR", str(tmp_path / "cache"))
    opened: list[str] = []
    real_read = ModelStore._read

    def spy(self: ModelStore, model_id: str, path: Path, old: object) -> object:
        opened.append(model_id)
        return real_read(self, model_id, path, old)

    monkeypatch.setattr(ModelStore, "_read", spy)
    info = inspect_file(d / "demo.gguf")
    assert info["status"] == "ok" and opened == ["demo"]
    info = inspect_file(d / f"{SMOL_ID}.gguf")
    assert info["status"] == "ok" and len(info["tensors"]) == 272 and opened == ["demo", SMOL_ID]
