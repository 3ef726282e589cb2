"""Settings: QGEMM_* environment variables (through pydantic-settings), and the same as flags of `qgemm serve`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1 << 20


def default_models_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "qgemm" / "models"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qgemm"


class Settings(BaseSettings):
    """Every setting is a QGEMM_* environment variable (QGEMM_MODELS_DIR for models_dir) and a flag of `qgemm
    serve` (--models-dir); a flag wins over the variable.  The descriptions are the flags' help."""

    model_config = SettingsConfigDict(env_prefix="QGEMM_", extra="ignore", validate_default=True,
                                      env_ignore_empty=True)  # QGEMM_X= is unset, as in compose files

    models_dir: Path = Field(default_factory=default_models_dir, description="the directory of .gguf files")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="what is kept across starts: the indexes of large GGUF headers")
    write_demo: bool | None = Field(None, description="write the demo model if it is missing (default: only into "
                                                      "the default models directory)")
    backend: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: CUDA when CuPy sees a usable device, else the CPU; cuda: fail without one")
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(8000, gt=0, lt=65536, description="the port to listen on")
    api_key: str | None = Field(None, description="when set, every /v1 route needs Authorization: Bearer <key>")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object a line")
    access_log: bool = Field(False, description="uvicorn's line per request (it costs more than a small product)")
    max_body_bytes: int = Field(256 * MiB, gt=0, description="largest request body")
    max_request_head_bytes: int = Field(64 << 10, ge=1024, description="largest request line and headers of an HTTP "
                                                                     "request (431 past it)")
    request_read_timeout_s: float = Field(30.0, gt=0, description="seconds of silence while a request's head or body "
                                                                  "is being read (or before a new connection sends "
                                                                  "anything) after which it is answered 408 and closed")
    max_json_body_bytes: int = Field(8 * MiB, gt=0, description="largest JSON body of POST /v1/matmul (parsed, JSON "
                                                               "numbers take tens of times their text: larger X goes "
                                                               "as .npy, up to max_body_bytes)")
    max_rows: int = Field(8192, gt=0, description="largest M of one request")
    max_header_bytes: int = Field(64 * MiB, gt=0, description="largest GGUF header read (it is parsed into Python "
                                                              "objects, ~20x its size); larger: listed as an error")
    cpu_cache_bytes: int = Field(2048 * MiB, ge=0, description="prepared weights kept for the CPU kernels (LRU)")
    gpu_memory_bytes: int | None = Field(None, ge=0, description="budget for weights resident on each GPU (LRU); "
                                                                 "default: 80% of the free memory at start")
    batch_max_rows: int = Field(512, gt=0, description="most rows in one batched product; a longer request is cut "
                                                       "into chunks of this many")
    batch_wait_us: int = Field(100, ge=0, description="after a product, when others queue, how long to take in "
                                                      "more requests before the next; 0 turns batching off")
    product_deadline_s: float = Field(120.0, gt=0, description="seconds a product may take from its check to its "
                                                               "answer; past it the request is answered 504")
    engine_deadline_s: float = Field(10.0, gt=0, description="seconds an engine process may leave the supervisor's "
                                                             "ping unanswered before it is killed and started again "
                                                             "(its waiting requests answered 503)")
    max_queue: int = Field(1024, gt=0, description="requests waiting for one device beyond which a new one is "
                                                   "refused (503 with Retry-After) rather than queued")
    gil_switch_us: int | None = Field(None, gt=0, description="Python's thread switch interval (default 5000)")
    fronts: int | None = Field(None, ge=0, le=64, description="HTTP front processes beside the engine process "
                                                              "(default: half the cores, 1 to 16 per engine process); "
                                                              "0: one process serves HTTP and runs the engine")
    engines: Literal["per-device", "one"] = Field("per-device", description="engine processes beside the fronts: one "
                                                   "per device (each GPU of QGEMM_DEVICES, else each CPU device), "
                                                   "or one for every device")
    engines_per_gpu: int = Field(1, ge=1, le=8, description="engine processes on each GPU (with per-device "
                                                            "engines), each with its own queue and its own copy of "
                                                            "the weights it multiplies: more than one where an "
                                                            "engine's CPU, not its GPU, bounds the server")
    cpu_device_first: int = Field(0, ge=0, description="the number of this process's first CPU device (cpu:N): set "
                                                       "by the supervisor for an engine process per device")
    front_arena_bytes: int = Field(64 * MiB, ge=1 << 20, description="each front's shared memory for requests' "
                                                                      "activations and products (larger ones get "
                                                                      "their own)")
    front_inflight_bytes: int = Field(1024 * MiB, ge=1 << 20, description="shared memory each front's requests too "
                                                                         "large for its arena may hold at once (503 "
                                                                         "with Retry-After past it)")
    pin_arenas: bool = Field(True, description="on a GPU, the engine page-locks each front's arena, so that "
                                                "products are copied into it by DMA")
    quant_compare_max_values: int = Field(1 << 25, gt=0, description="largest tensor the quantization report "
                                                                     "requantizes (host memory)")
    devices: str | None = Field(None, description="the GPUs to serve on: all, or CUDA ordinals like 0,1 (a worker "
                                                  "per device)")
    cpu_devices: int = Field(1, ge=1, le=64, description="CPU workers; more are fake devices on which tensors are "
                                                         "placed, replicated and split as on GPUs")
    pinned_output_bytes: int = Field(1024 * MiB, ge=0, description="page-locked host memory that outputs of 1 MiB "
                                                                   "and more are written into by the GPU; 0: off")
    max_connections: int | None = Field(None, ge=1, description="open HTTP connections each HTTP process keeps (past "
                                                                  "it a new one is answered 503 with Retry-After); "
                                                                  "unset: the open-file limit less 64, at most 10000")
    dependent_launch: bool = Field(True, description="on sm_90+, M = 1 products overlap their neighbours "
                                                     "(programmatic dependent launch)")
    cuda_graphs: bool = Field(True, description="products of up to 64 rows replay a CUDA graph captured at their "
                                                "second run (one launch instead of a dozen)")

    @property
    def index_dir(self) -> Path:
        """Indexes of large GGUF headers, one per file version (models/gguf_index.py)."""
        return self.cache_dir / "gguf-index"

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        return v or None

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """The environment's settings, `overrides` (flags, tests) taking precedence."""
        return cls(**overrides)

    def as_env(self) -> dict[str, str]:
        """These settings as QGEMM_* variables, for the processes that build their own (fronts, engine, Ray)."""
        out = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is not None:
                out[f"QGEMM_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return out
