"""Every check a product request needs, in one place that every deployment runs (in process, fronts and
engines, Ray): `check_request` before anything is queued or copied (the tensor is a matrix that can be multiplied
as asked, X's shape, the kernel), run by the route wherever it serves; `check_values` (finite, within Q8_1's
range) and `check_output` by the engine, where the device may have measured max|x| already.  Each raises the
domain's InvalidRequest."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.tensors import effective
from kernels.errors import InvalidRequest
from kernels.formats import format_of
from kernels.kernel import Kernel
from kernels.reference import q8_1_overflow
from kernels.requant import Scheme
from kernels.select import KernelChooser
from models.store import TensorInfo

INLINE_VALUES = 1 << 16  # activations up to this many values are checked on the event loop (tens of µs)


@dataclass(frozen=True)
class Checked:
    """A request that passed `check_request`: the tensor as multiplied and the kernel it names."""

    info: TensorInfo  # as stored
    scheme: Scheme | None
    eff: TensorInfo  # as multiplied (the scheme's type)
    kernel: Kernel | None  # None: auto, picked by the batch's M


def check_request(chooser: KernelChooser, info: TensorInfo, scheme: Scheme | None, shape: tuple[int, ...],
                  kernel: str | Kernel, max_rows: int) -> Checked:
    """The checks that need no values: `info` can be multiplied (as `scheme` asks), X of `shape` fits it, and a
    named kernel can run it here."""
    eff = effective(info, scheme)
    check_shape(shape, eff, max_rows)
    spec = None if kernel == "auto" else chooser.choose(kernel, eff.name, eff.type_name, shape[0], *eff.shape)
    return Checked(info, scheme, eff, spec)


def check_splittable(info: TensorInfo, scheme: Scheme | None) -> None:
    """A tensor that can be split by rows across devices in this weight format (a bitsandbytes scheme's blocks may
    straddle rows)."""
    if scheme is not None:
        reason = scheme.split_reason(info.shape[1])
        if reason:
            raise InvalidRequest(f"{info.name} in {scheme.tag} cannot be split by rows: {reason}", "cannot_split")


def check_shape(shape: tuple[int, ...], info: TensorInfo, max_rows: int) -> None:
    if len(shape) != 2:
        raise InvalidRequest(f"activations must be a 2-D [M, K] array; got {len(shape)}-D {list(shape)}", "bad_shape")
    m, k = shape
    if m < 1 or k < 1:
        raise InvalidRequest(f"activations must have at least one row and column; got {list(shape)}", "bad_shape")
    if m > max_rows:
        raise InvalidRequest(f"M={m} rows exceed the limit of {max_rows} (QGEMM_MAX_ROWS)", "too_many_rows")
    n, kw = info.shape
    if k != kw:
        raise InvalidRequest(f"activations have K={k} columns but {info.name} is [{n}, {kw}]: K must be {kw}",
                             "k_mismatch")


def amax_of(x: np.ndarray) -> float:
    """max|x|, NaN where X holds one (NaN and inf propagate: one value says whether X needs a closer look)."""
    with np.errstate(invalid="ignore"):
        return max(float(x.max()), -float(x.min()))


def check_values(info: TensorInfo, x: np.ndarray, x32: np.ndarray, auto: bool, spec: Kernel,
                 amax: float | None = None) -> None:
    """X's values: finite, and in the range of the Q8_1 kernels that may run it (`auto`: any kernel its batch may
    pick); `amax`: max|x32| where a device (or the front that wrote X) measured it, else computed here."""
    if amax is None:
        amax = amax_of(x32)
    if not math.isfinite(amax):
        bad = np.argwhere(~np.isfinite(x))
        if len(bad):
            raise InvalidRequest(f"activations contain NaN or infinity (first at row {bad[0][0]}, column "
                                 f"{bad[0][1]})", "non_finite")
        raise InvalidRequest("activations overflow float32 (|x| > 3.4e38)", "non_finite")
    fmt = format_of(info.type_name)
    if spec.quantizes or (auto and fmt is not None and fmt.quantizes_activations):
        # auto may pick a Q8_1 kernel at any batch M
        overflow = q8_1_overflow(x32, uses_sum=fmt is not None and fmt.uses_activation_sum, amax=amax)
        if overflow is not None:
            raise InvalidRequest(f"activations out of range for {spec.name}: {overflow}", "activation_out_of_range")


def check_output(y: np.ndarray, first_column: int = 0) -> None:
    """A product that overflowed float32 (where the device did not check it already); `y` may be a block of the
    output's columns, from `first_column` on."""
    if not np.isfinite(y).all():
        r, c = (int(v) for v in np.argwhere(~np.isfinite(y))[0])
        c += first_column
        raise InvalidRequest(f"the product overflows float32 (first at row {r}, column {c}): scale the activations "
                             "down", "product_out_of_range")
