"""Pydantic v2 models of the HTTP API v1."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field

from kernels.bnb4 import BLOCKSIZES, DEFAULT_BLOCKSIZE
from kernels.kernel import Formula
from kernels.registry import known_names
from kernels.requant import WEIGHT_FORMATS

# The demo model (`qgemm fetch --demo-only`, always present) names every example, so that clients
# generated from /openapi.json and schemathesis reach the real logic.
DEMO_MODEL = "demo"
DEMO_TENSOR = "tiny.q4_0.weight"  # Q4_0 [33, 64]: N = 33 outputs, K = 64 inputs
DEMO_K = 64
KERNEL_NAMES = known_names()

ModelId = Annotated[str, Path(description="a model id from GET /v1/models (the file name without .gguf)",
                              examples=[DEMO_MODEL])]
TensorName = Annotated[str, Path(description="a tensor name from GET /v1/models/{model_id}/tensors",
                                 examples=[DEMO_TENSOR])]


class ErrorDetail(BaseModel):
    code: str
    message: str
    request_id: str | None = Field(None, description="on 500 `internal` only: the id under which the server "
                                                     "logged the error (the client's X-Request-Id if it sent one)")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class DeviceState(BaseModel):
    device: str = Field(examples=["cuda:0"], description="`cuda:<ordinal>` or `cpu:<worker>`")
    name: str
    backend: Literal["cpu", "cuda"]
    resident_bytes: int = Field(description="weight bytes it holds")
    budget_bytes: int = Field(description="its weight budget (QGEMM_GPU_MEMORY_BYTES, or QGEMM_CPU_CACHE_BYTES)")
    queue_depth: int = Field(description="requests (or chunks) waiting for it")
    busy: bool
    products: int = Field(description="products (batches) it ran since the start")


class ProcessState(BaseModel):
    role: Literal["front", "engine"]
    index: int
    pid: int | None
    state: Literal["ok", "starting", "restarting", "stopping", "unresponsive"] = Field(
        description="unresponsive: an engine that has not answered the supervisor's ping for 2 s (it is killed and "
                    "started again at QGEMM_ENGINE_DEADLINE_S)")


class Health(BaseModel):
    status: Literal["ok", "degraded"] = Field(description="degraded: an engine process is down (its requests "
                                                          "answer 503 with Retry-After until it is back)")
    backend: Literal["cpu", "cuda"]
    device: str | None
    version: str
    compile_ms: float | None = None  # CUDA kernels compiled at start-up, not inside any request
    devices: list[DeviceState] = Field(default_factory=list, description="each device worker: GPUs first")
    processes: list[ProcessState] | None = Field(None, description="`qgemm serve`'s HTTP front and engine processes "
                                                                   "(absent where one process serves)")


class ModelSummary(BaseModel):
    id: str
    file: str
    size_bytes: int
    status: Literal["ok", "error", "loading"]  # loading: a large header being read in the background
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
    layout: str = Field(description="the layout's name; `@rows<a>-<b>` (or `@<format>/rows<a>-<b>`): a block of "
                                    "rows of a split tensor")
    n_bytes: int
    device: str = Field(examples=["cuda:0"])


class PlacedPart(BaseModel):
    device: str = Field(examples=["cuda:1"])
    rows: list[int] = Field(description="[start, stop): the weight rows (output columns) this device holds")


class Placed(BaseModel):
    tensor: str
    weight_format: str
    how: Literal["first use", "single", "replicate", "split"] = Field(
        description="`first use`: the device with the most free budget, or split across all when none holds it; "
                    "the others: as POST .../load asked")
    replicas: list[list[PlacedPart]] = Field(description="each replica's parts; a request runs on the least "
                                                         "loaded replica, on all of its parts at once")


class Residency(BaseModel):
    backend: Literal["cpu", "cuda"]
    n_bytes: int
    tensors: list[ResidentTensor] = Field(description="the weights each device holds now (GPU: resident; "
                                                      "CPU: prepared)")
    placements: list[Placed] = Field(default_factory=list, description="where tensors live on a server of several "
                                                                       "devices")


class QuantMix(BaseModel):
    file_type: str | None = Field(description="llama.cpp's file type where the file names one (general.file_type)")
    by_bytes: dict[str, float] = Field(description="each tensor type's share of the matrices' bytes")
    summary: str = Field(examples=["Q4_K_M-like: 70% Q8_0, 17% Q5_0, 5% Q4_K, 4% Q6_K by bytes"])


class ModelDetail(ModelSummary):
    header: dict[str, Any] | None
    metadata: dict[str, Any]
    tensor_types: dict[str, TypeSummary]
    parameter_count: int = Field(0, description="values in all the model's tensors")
    tensor_bytes: int = Field(0, description="bytes of all the model's tensors (8 * tensor_bytes / parameter_count: "
                                             "bits per weight)")
    quant_mix: QuantMix | None = None
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


class Histogram(BaseModel):
    edges: list[float] = Field(description="bins + 1 ascending edges; the last bin includes its right edge")
    counts: list[int]


class TensorHistograms(BaseModel):
    model: str
    tensor: str
    type: str
    values: Histogram = Field(description="the dequantized values over [min, max]")
    block_scales: Histogram | None = Field(description="each block's d (legacy formats) or each group's effective "
                                           "scale (K-quants, IQ4, MXFP4); null for float tensors and vectors")


class SchemeError(BaseModel):
    weight_format: str = Field(description="`gguf` (the tensor as stored: the reference) or the requantization")
    tag: str
    blocksize: int | None
    double_quant: bool
    bits_per_weight: float | None = Field(None, description="stored bits per weight, scales included")
    nmse: float | None = Field(None, description="squared error over the reference's energy")
    max_abs_error: float | None = None
    reason: str | None = Field(None, description="why this scheme cannot hold the tensor (then no figures)")
    kernel: dict[str, str] | None = Field(None, description="per M: the kernel auto ran (GPU only)")
    gemm_us: dict[str, float] | None = Field(None, description="per M: median device time of the activations' "
                                                                "preparation and the product (GPU only)")


class QuantizationReport(BaseModel):
    model: str
    tensor: str
    type: str
    shape: list[int]
    reference: str = Field(description="what the errors are measured against")
    device: str | None
    method: str | None = Field(description="how the times were taken (GPU only)")
    schemes: list[SchemeError]


ACTIVATION_FORMAT_DOC = (
    "the formula the kernel computes: q8_1_mmvq is llama.cpp's MMVQ (its path for M <= 8: Q8_1 activations "
    "with half2 (d, s), unsigned weights with the sum term, or a minimum's m_w*s_a), q8_1_mmq its MMQ on tensor "
    "cores (M > 8: signed weights and no sum term, or unsigned with m_w*s_a for Q4_1/Q5_1; d_a in float or as a "
    "half per format); f32 / f16 / bf16: a float product of the weights' values with the activations in that "
    "type (bf16: llama.cpp's BF16 matrices at M > 1); f16_mmvf: llama.cpp's F16 matrix times one row, "
    "summed in half2 FMAs per thread; f16_h: its cuBLAS product of F16 matrices (at M > 1 where its mul_mat_f "
    "does not take the shape), half operands, sums and outputs")


class KernelInfo(BaseModel):
    name: str
    weight_types: list[str]
    activation_format: Formula | Literal["auto"] = Field(
        description=ACTIVATION_FORMAT_DOC)
    backend: Literal["cpu", "cuda", "auto"]
    available: bool
    reason: str | None
    description: str


class KernelList(BaseModel):
    kernels: list[KernelInfo]


ACTIVATIONS_DOC = (
    "X as M rows of K numbers, K the tensor's second dimension; M ≤ QGEMM_MAX_ROWS. Kernels that quantize "
    "X to Q8_1 (activation_format q8_1_mmvq or q8_1_mmq) need each 32-value block's scale max|x|/127 and, "
    "for formats with an offset or minimum (Q4_0), its sum Σx to fit in half precision (|x| ≤ 8.32e6, "
    "|Σx| < 65520), else 422 `activation_out_of_range`; a product that overflows float32 is 422 "
    "`product_out_of_range`.")


WeightFormat = Literal[WEIGHT_FORMATS]  # type: ignore[valid-type]  # the one list: kernels/requant.py
WEIGHT_FORMAT_DOC = ("the weights as stored (`gguf`), or the tensor's values requantized once at upload (cached like "
                     "any layout): to a GGUF block format with gguf's quantizer, or to bitsandbytes' NF4/FP4 "
                     "(blockwise absmax, its code books; `blocksize`, `double_quant`)")


class RequantFields(BaseModel):
    """The weight format a request multiplies (or loads) a tensor in."""
    weight_format: WeightFormat = Field("gguf", description=WEIGHT_FORMAT_DOC)
    blocksize: int = Field(DEFAULT_BLOCKSIZE, description="nf4/fp4: values per absmax (ignored for other formats)",
                           json_schema_extra={"enum": list(BLOCKSIZES)})
    double_quant: bool = Field(False, description="nf4/fp4: the absmax values quantized to 8 bits as well "
                                                  "(bitsandbytes' compress_statistics; ignored for other formats)")


class MatmulRequest(RequantFields):
    # strict: "1.5" or true is a malformed body, not a number; NaN and Infinity parse, then get a 422
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": [
        {"model": DEMO_MODEL, "tensor": DEMO_TENSOR, "kernel": "auto",
         "activations": [[round(0.25 * ((i % 9) - 4), 2) for i in range(DEMO_K)]]}]})
    model: str = Field(description="a model id from GET /v1/models", examples=[DEMO_MODEL])
    tensor: str = Field(description="a tensor of that model whose `matmul` is true", examples=[DEMO_TENSOR])
    kernel: str = Field("auto", description="a kernel from GET /v1/kernels",
                        json_schema_extra={"enum": KERNEL_NAMES})
    activations: list[Annotated[list[float], Field(min_length=1)]] = Field(min_length=1, description=ACTIVATIONS_DOC)


class BatchInfo(BaseModel):
    requests: int = Field(description="requests (or chunks) in the product this request ran in; 1: alone")
    rows: int = Field(description="that product's M")
    chunks: int | None = Field(None, description="a request over QGEMM_BATCH_MAX_ROWS rows: the chunks it was cut into")


class MatmulResponse(BaseModel):
    output: list[list[float]]
    shape: list[int]
    model: str
    tensor: str
    kernel: str
    weight_format: str = Field(description="`gguf`, or the requantization's tag (e.g. `nf4-b64`, `fp4-b64-dq`)")
    activation_format: Formula = Field(
        description=ACTIVATION_FORMAT_DOC)
    backend: Literal["cpu", "cuda"]
    timing_ms: dict[str, float]
    batch: BatchInfo
    devices: list[str] = Field(description="the devices it ran on (several: a tensor split by rows)",
                               examples=[["cuda:0"]])


class LoadRequest(RequantFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"tensors": [DEMO_TENSOR]}, {"tensors": [DEMO_TENSOR], "devices": [0, 1], "placement": "split"}]})
    tensors: list[str] | None = Field(None, description="tensor names (default: every tensor that multiplies)")
    kernel: str | None = Field(None, description="upload in the layout this kernel reads (default: auto's)",
                               json_schema_extra={"enum": [*KERNEL_NAMES, None]})
    devices: list[Annotated[int, Field(ge=0, le=1023)]] | None = Field(
        None, max_length=64, description="the devices (CUDA ordinals, as /healthz names them) to put each tensor on "
                                         "(default: every device with `placement`, else where first use would)")
    placement: Literal["replicate", "split"] | None = Field(
        None, description="`replicate`: a whole copy on each device (requests go to the least loaded); `split`: "
                          "one copy cut by rows across them (a product runs on all at once)")


class UnloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"tensors": [DEMO_TENSOR]}]})
    tensors: list[str] | None = Field(None, description="tensor names (default: all of the model's)")


class LoadResponse(BaseModel):
    model: str
    loaded: list[ResidentTensor]
    resident: Residency


class UnloadResponse(BaseModel):
    model: str
    freed_bytes: int
    resident: Residency
