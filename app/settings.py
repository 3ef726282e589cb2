"""Settings, read once from QGEMM_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

MiB = 1 << 20


def default_models_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "qgemm" / "models"


class Settings(BaseModel):
    models_dir: Path = Field(default_factory=default_models_dir)
    backend: Literal["auto", "cuda", "cpu"] = "auto"
    max_body_bytes: int = Field(256 * MiB, gt=0)
    max_rows: int = Field(8192, gt=0)  # M of one request
    max_header_bytes: int = Field(64 * MiB, gt=0)  # a GGUF header larger than this is refused (it is parsed in memory)
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    cpu_cache_bytes: int = Field(2048 * MiB, ge=0)  # prepared weights kept for the CPU kernels
    gpu_memory_bytes: int | None = Field(None, ge=0)  # resident weights on the GPU; None: a share of free
    log_level: str = "info"
    batch_max_rows: int = Field(512, gt=0)  # rows of one batched product; longer requests are cut into chunks
    batch_wait_us: int = Field(100, ge=0)  # after a batch, when others queue: time to take in more; 0: no batching
    gil_switch_us: int | None = Field(None, gt=0)  # Python thread switch interval (its default: 5000 µs)
    access_log: bool = False  # uvicorn's line per request (off: it costs more than a small product)
    # server processes: >1 runs HTTP in that many processes (one event loop is the limit near 3,000 requests/s,
    # docs/reports/service.md), each with its own engine: its own copy of the weights on the GPU, its own batching and
    # its own /metrics; give each a share of the GPU with QGEMM_GPU_MEMORY_BYTES
    workers: int = Field(1, ge=1, le=64)
    # GET .../quantization requantizes a tensor six ways in host memory: tensors above this many values are refused
    quant_compare_max_values: int = Field(1 << 25, gt=0)
    # the GPUs to serve on: "all" (every device CuPy sees) or CUDA ordinals "0,1"; one worker per device
    devices: str | None = None
    # CPU workers: 1; more make "fake devices" (each its own thread and cpu_cache_bytes) on which tensors are
    # placed, replicated and split as on GPUs: placement and routing tested without a GPU
    cpu_devices: int = Field(1, ge=1, le=64)
    # page-locked host memory that large outputs (1 MiB and up) are copied into straight from the GPU, reused
    # across requests (kernels/cuda/host_memory.py); beyond it outputs take the staging copy; 0 turns it off
    pinned_output_bytes: int = Field(1024 * MiB, ge=0)
    dependent_launch: bool = True  # M = 1: gemv and the split quantize overlap each other (sm_90+; kernels/cuda/pdl.py)

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        return v or None

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        values: dict[str, object] = {}
        for name in cls.model_fields:
            env = os.environ.get(f"QGEMM_{name.upper()}")
            if env is not None:
                values[name] = env
        values.update(overrides)
        return cls(**values)
