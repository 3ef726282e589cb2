"""Error measures that cannot fail by chance and still catch a wrong formula.

NMSE of a product against its reference is ill-conditioned when an output is a small remainder of
large terms: at M = N = 1 it measures fp32 summation order, not the kernel.  Here each output is
compared with the reference relative to the sum of the magnitudes of the terms that make it
(`reference.Terms`), against a bound that holds for *any* order of summation:

    |y - ref| <= TWO_SIDES * UNIT * (count + ROUNDINGS) * Σ|terms|      (+ allowance)

Summing n terms in fp32 in any order (any tree, split-K atomics included) errs by at most
γ_{n-1} Σ|t| with γ_n ~ n·u (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2); each
term itself takes a few roundings (scale products, the s-term).  UNIT is 2u = 2^-23, not u, because
tensor cores accumulate with truncation (an error of up to one ulp, not half).  Both the kernel and the
reference err that way, hence TWO_SIDES.  The bound is rigorous, so a legitimate kernel passes for every
input; a wrong formula (a dropped compensation term, a scale kept in fp32 where llama.cpp rounds it to
half, a wrong block) moves outputs by far more than it on the shapes the tests use
(tests/test_accuracy.py shows each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.reference import FLOAT_UNIT, Terms

UNIT = FLOAT_UNIT  # one fp32 ulp at 1: an upper bound on a truncating step's relative error (sums in half: Terms.unit)
ROUNDINGS = 4  # roundings inside one term (d_a*sumi, the s-term, times d_w, the store) beyond the sum's
TWO_SIDES = 2  # the kernel and the reference both err


def tolerance(count: int, unit: float = UNIT) -> float:
    """The relative bound for a sum of `count` terms (rounding steps), both sides summing in any order."""
    return TWO_SIDES * unit * (count + ROUNDINGS)


@dataclass(frozen=True)
class Comparison:
    worst: float  # max over outputs of |y - ref| / bound: <= 1 passes
    index: tuple[int, ...]  # where the worst is
    error: float  # |y - ref| there
    bound: float  # the bound there
    result: float  # ref there
    scale: float  # Σ|terms| there

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0

    def __str__(self) -> str:
        return (f"worst output {list(self.index)}: |error| {self.error:.3g} over its bound {self.bound:.3g} "
                f"({self.worst:.3g}x); result {self.result:.4g}, Σ|terms| {self.scale:.4g}")


def compare(y: np.ndarray, want: np.ndarray, terms: Terms, *, same_q8_1: bool = True,
            count: int | None = None) -> Comparison:
    """y against want, output by output.  `same_q8_1=False` where the two sides quantized the activations
    each on their own (an API answer against a CPU reference): their s_a may then differ by one
    half-precision ulp (tests/test_gpu.py checks the device's quantizer to that), which the bound adds."""
    y64, w64 = np.asarray(y, np.float64), np.asarray(want, np.float64)
    if y64.shape != w64.shape or not y64.size:
        raise ValueError(f"shapes differ or are empty: {y64.shape} against {w64.shape}")
    bound = tolerance(terms.count if count is None else count, terms.unit) * terms.magnitude
    if not same_q8_1 and terms.s_ulp is not None:
        bound = bound + terms.s_ulp
    err = np.abs(y64 - w64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0))
    ratio = np.where(np.isnan(y64), np.inf, ratio)  # NaN never passes
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return Comparison(float(ratio[i]), tuple(int(v) for v in i), float(err[i]), float(bound[i]), float(w64[i]),
                      float(terms.magnitude[i]))
