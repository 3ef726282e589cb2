"""The values every backend takes and gives: a matmul's weights, and its result."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Weights:
    """A matmul's weights as the engine hands them to a backend."""

    key: tuple[Hashable, str]  # (the file version, the tensor): caches key on it
    type_name: str
    n: int
    k: int
    raw: Callable[[], Any]  # GGUF block bytes, uint8 [N, row_bytes] (or float values; a Bnb4Tensor for NF4/FP4)
    variant: str = ""  # a requantization's tag (kernels/requant.py): part of every cache key

    def layout_key(self, layout: str) -> str:
        """The name its arrays in `layout` are cached under."""
        return f"{layout}@{self.variant}" if self.variant else layout


@dataclass
class Result:
    output: np.ndarray  # None only where the caller gave output arrays (a backend's `outs`)
    backend: str
    activation_format: str
    timing_ms: dict[str, float] = field(default_factory=dict)
    activations_q8_1: Any = None  # reference.Q8_1, kept for callers that check against the reference
    finite: bool | None = None  # every output value finite, where the backend checked (None: not checked)
    x_amax: list[float] | None = None  # per part of a product: max|x| of its rows, not finite if a value is not
