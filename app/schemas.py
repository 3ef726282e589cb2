"""Pydantic v2 models of the HTTP API v1."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]
    backend: Literal["cpu", "cuda"]
    device: str | None
    version: str
    compile_ms: float | None = None  # CUDA kernels compiled at start-up, not inside any request


class ModelSummary(BaseModel):
    id: str
    file: str
    size_bytes: int
    status: Literal["ok", "error"]
    error: str | None
    architecture: str | None
    tensor_count: int


class ModelList(BaseModel):
    models: list[ModelSummary]


class TypeSummary(BaseModel):
    count: int
    n_bytes: int


class ResidentTensor(BaseModel):
    tensor: str
    layout: str
    n_bytes: int


class Residency(BaseModel):
    backend: Literal["cpu", "cuda"]
    n_bytes: int
    tensors: list[ResidentTensor]


class ModelDetail(ModelSummary):
    header: dict[str, Any] | None
    metadata: dict[str, Any]
    tensor_types: dict[str, TypeSummary]
    resident: Residency


class TensorRow(BaseModel):
    name: str
    type: str
    shape: list[int]
    n_bytes: int
    offset: int
    matmul: bool


class TensorList(BaseModel):
    tensors: list[TensorRow]


class TensorStats(BaseModel):
    min: float
    max: float
    mean: float
    std: float
    zero_block_share: float
    n_values: int


class TensorDetail(TensorRow):
    model: str
    n_elements: int
    block_format: str | None
    matmul_reason: str | None
    stats: TensorStats | None
    stats_error: str | None = None


class KernelInfo(BaseModel):
    name: str
    weight_types: list[str]
    activation_format: Literal["q8_1", "f32", "f16", "auto"]
    backend: Literal["cpu", "cuda", "auto"]
    available: bool
    reason: str | None
    description: str


class KernelList(BaseModel):
    kernels: list[KernelInfo]


class MatmulRequest(BaseModel):
    # strict: "1.5" or true is a malformed body, not a number; NaN and Infinity parse, then get a 422
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    tensor: str
    kernel: str = "auto"
    activations: list[list[float]] = Field(description="X as M rows of K numbers")


class MatmulResponse(BaseModel):
    output: list[list[float]]
    shape: list[int]
    model: str
    tensor: str
    kernel: str
    activation_format: Literal["q8_1", "f32", "f16"]
    backend: Literal["cpu", "cuda"]
    timing_ms: dict[str, float]


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensors: list[str] | None = None
    kernel: str | None = Field(None, description="upload in the layout this kernel reads (default: auto's)")
