"""What the start of a server says, a line each: the version, the backend and its devices (a warning, with the fix,
when a GPU is present but cannot serve), the models found (each one that cannot be read with its reason), and
where the pages and the API docs are.  Shared by the one-process server, the supervisor and the engine process."""

from __future__ import annotations

import logging
import os
import platform

from app import __version__
from app.engine import Engine
from app.settings import Settings
from models.store import Model

log = logging.getLogger("qgemm")
GiB = 1 << 30


def announce_version() -> None:
    log.info("qgemm %s (Python %s, pid %d)", __version__, platform.python_version(), os.getpid())


def announce(settings: Settings, engine: Engine) -> None:
    """The start, one line each: the backend and its devices (a warning, with the fix, when a GPU is present but
    cannot serve)."""
    if engine.gpu is not None:
        for w in engine.pools["cuda"]:
            b = w.backend
            used, budget = b.memory()
            cc = b.cc or 0
            log.info("backend cuda: %s %s (compute capability %d.%d, %d SMs), weight budget %.1f GiB, kernels "
                     "compiled in %.0f ms", b.label, b.device_name, cc // 10, cc % 10, b.sm_count or 0, budget / GiB,
                     b.compile_ms or 0.0)
    elif engine.devices.gpu_present:
        log.warning("backend cpu (numpy), although an NVIDIA GPU is present: %s", engine.cuda_error)
    else:
        log.info("backend cpu (numpy): %s", engine.cuda_error)


def announce_models(settings: Settings, models: list[Model]) -> None:
    """The models found (and each one that cannot be read)."""
    states = ", ".join(f"{m.id} ({m.status}{f', {len(m.tensors)} tensors' if m.status == 'ok' else ''})"
                       for m in models)
    log.info("models in %s: %s", settings.models_dir, states or "none (qgemm fetch writes the demo and gets real "
                                                               "ones)")
    for m in models:
        if m.status == "error":
            log.warning("model %s cannot be read: %s", m.id, m.error)


def announce_urls(settings: Settings) -> None:
    base = f"http://{settings.host}:{settings.port}"
    log.info("serving the pages at %s/ and the API docs at %s/docs", base, base)


