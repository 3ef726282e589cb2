"""The backends of this machine: one per GPU that QGEMM_DEVICES names (when CuPy sees one and the settings allow
it), and QGEMM_CPU_DEVICES CPU backends.  A broken or missing CUDA stack leaves the CPU backends serving (its
cause kept in `cuda_error`), unless the settings ask for CUDA; naming absent devices is a configuration error."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kernels.backend import Backend
from kernels.cpu import CpuBackend

log = logging.getLogger("qgemm")


class Options(Protocol):
    """What opening the devices reads of the service's settings (app.settings.Settings has them)."""

    backend: str
    devices: str | None
    cpu_devices: int
    cpu_device_first: int
    cpu_cache_bytes: int
    gpu_memory_bytes: int | None
    dependent_launch: bool


class BadDevices(RuntimeError):
    """QGEMM_DEVICES names devices that are not there: a configuration error, never a fall-back to the CPU."""


class CudaUnavailable(RuntimeError):
    """QGEMM_BACKEND=cuda, and no CUDA device can serve."""


def parse_devices(spec: str | None, count: int) -> list[int]:
    """QGEMM_DEVICES ("all", or CUDA ordinals "0,1") as a list of ordinals, each checked against `count`."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(range(count))
    try:
        devices = [int(d) for d in spec.replace(" ", "").split(",") if d]
    except ValueError:
        raise BadDevices(f"QGEMM_DEVICES={spec!r}: give CUDA ordinals like 0,1 or 'all'") from None
    bad = [d for d in devices if not 0 <= d < count]
    if bad or not devices or len(set(devices)) != len(devices):
        raise BadDevices(f"QGEMM_DEVICES={spec!r}: CuPy sees {count} device(s) (0..{count - 1}), each named once")
    return devices


CUDA13_DRIVER, CUDA12_DRIVER = 580, 525  # the oldest NVIDIA drivers CuPy's CUDA 13 and CUDA 12 wheels run on
FIX_EXTRA = ("pip install 'qgemm[cuda]' (CuPy for CUDA 13, driver >= 580) or 'qgemm[cuda12]' (CUDA 12, "
             "driver >= 525)")


def nvidia_driver() -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.159.04"), or None where there is none (no GPU)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"\b(\d{3,4}\.\d+(?:\.\d+)?)\b", text)
    return found.group(1) if found else "unknown"


def why_no_cuda(cause: str, driver: str | None) -> str:
    """The cause of an unusable CUDA stack and what fixes it, in one line."""
    major = int(driver.split(".")[0]) if driver and driver[0].isdigit() else None
    if "CuPy is not installed" in cause:
        fix = ("pip install 'qgemm[cuda]'" if major is None or major >= CUDA13_DRIVER else
               "pip install 'qgemm[cuda12]' (this driver is older than CUDA 13's 580)" if major >= CUDA12_DRIVER else
               f"update the NVIDIA driver to >= {CUDA12_DRIVER}, then {FIX_EXTRA}")
        return f"{cause}: {fix}"
    if "insufficient" in cause.lower() or "InsufficientDriver" in cause:
        return (f"the NVIDIA driver {driver} is too old for this CuPy build ({cause}): {FIX_EXTRA}, or update the "
                "driver")
    if "no CUDA device" in cause and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return f"{cause} (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    return cause


@dataclass
class Devices:
    cuda: list[Backend] = field(default_factory=list)  # one per GPU, in QGEMM_DEVICES order
    cpu: list[Backend] = field(default_factory=list)
    cuda_error: str | None = None  # why there is no GPU backend, and what would fix it
    gpu_present: bool = False  # an NVIDIA driver is loaded although no GPU backend serves: worth a warning

    def close(self) -> None:
        for b in self.cuda + self.cpu:
            b.close()


def open_devices(settings: Options) -> Devices:
    found = Devices(cpu=[CpuBackend(settings.cpu_cache_bytes, settings.cpu_device_first + i)
                           for i in range(settings.cpu_devices)])
    if settings.backend not in ("auto", "cuda"):
        return found
    try:
        from kernels.cuda.backend import CudaBackend, cuda_device_count

        count = cuda_device_count()
        if count:
            for i in parse_devices(settings.devices, count):
                found.cuda.append(CudaBackend(settings, device=i))
            if len({b.cc for b in found.cuda}) > 1:
                log.warning("QGEMM_DEVICES mixes compute capabilities; kernels are chosen for %s",
                            found.cuda[0].device_name)
        else:
            found.cuda_error = "CuPy sees no CUDA device"
    except ImportError as exc:
        found.cuda_error = f"CuPy is not installed ({exc.name})"
    except BadDevices:
        found.close()
        raise
    except Exception as exc:  # a broken driver must not stop the CPU service in auto mode
        for b in found.cuda:
            b.close()
        found.cuda = []
        found.cuda_error = f"{type(exc).__name__}: {exc}"
    if not found.cuda:
        driver = nvidia_driver()
        found.gpu_present = driver is not None
        found.cuda_error = why_no_cuda(found.cuda_error or "CUDA is unavailable", driver) if found.gpu_present \
            else "no NVIDIA GPU here (no driver loaded)"
        if settings.backend == "cuda":
            found.close()
            raise CudaUnavailable(f"QGEMM_BACKEND=cuda, but no CUDA device can serve: {found.cuda_error}")
    return found
