"""The multi-bit mechanism of LPGNN (Sajadmanesh & Gatica-Perez, CCS 2021) on weight features.

Each neuron's vector, clipped to the public box [α, β]^d, is reported through m sampled
coordinates of (ε/m)-randomised response and rectified to an unbiased estimate that takes three
values only (docs/mechanisms.md, "Multi-bit on weight features").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms.checks import _check_interval, _check_matrix, _check_unit, _positive_finite, _release_inputs

#: argmin of u·coth²(u/2) (LPGNN's choice of m = ⌊ε / 2.18⌋; numerically 2.1773).
MULTIBIT_EPSILON_PER_COORDINATE = 2.18

# Rows per block in the multi-bit sampler, so that n·d up to 4096² stays within a few hundred MB.
_MULTIBIT_BLOCK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class MultibitRectifier:
    """The three-valued output structure of the multi-bit mechanism.

    Every rectified output equals ``centre + half_step · x*`` with x* ∈ {−1, 0, +1} (only ±1 when
    m = d). ``d`` is the length of the vector protected as one unit (1 under the per-entry unit),
    ``m`` the number of coordinates sampled per vector, ``epsilon`` the budget of one vector.
    """

    d: int
    m: int
    epsilon: float
    centre: float
    half_step: float

    @property
    def levels(self) -> tuple[float, float, float]:
        """The three possible output values (−1, 0, +1 codes), in increasing order."""
        return (self.centre - self.half_step, self.centre, self.centre + self.half_step)

    def codes(self, rectified: Any) -> np.ndarray:
        """The codes x* ∈ {−1, 0, +1} (int8) of rectified outputs of this rectifier.

        Raises InvalidArgument if a value is not one of the three levels (relative tolerance
        1e-9 of ``half_step``), e.g. when the output was made with other parameters.
        """
        r = np.asarray(rectified, dtype=np.float64)
        z = (r - self.centre) / self.half_step
        codes = np.rint(z)
        if not np.all(np.isfinite(z)) or np.any(np.abs(z - codes) > 1e-9) or np.any(np.abs(codes) > 1):
            raise InvalidArgument("rectified", "values are not outputs of this multi-bit rectifier")
        return codes.astype(np.int8)


def multibit_rectifier(
    d: int, *, epsilon: float, bounds: tuple[float, float], unit: str = "neuron"
) -> MultibitRectifier:
    """The rectifier of LPGNN's multi-bit mechanism for vectors of length ``d``.

    m = max(1, min(d, ⌊ε/2.18⌋)); x′ = d(β−α)/(2m) · (e+1)/(e−1) · x* + (α+β)/2 with e = exp(ε/m), so
    centre = (α+β)/2 and half_step = d(β−α)/(2m) · coth(ε/(2m)) (the same number, without overflow).
    Under ``unit="entry"`` each coordinate is its own 1-dimensional mechanism: d = m = 1.
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise InvalidArgument("d", f"must be a positive integer, got {d!r}")
    eps = _positive_finite(epsilon, "epsilon")
    lo, hi = _check_interval(bounds, "bounds")
    if _check_unit(unit) == "entry":
        d = 1
    d = int(d)
    m = int(max(1, min(d, math.floor(eps / MULTIBIT_EPSILON_PER_COORDINATE))))
    half_step = d * (hi - lo) / (2 * m) / math.tanh(eps / (2 * m))
    return MultibitRectifier(d=d, m=m, epsilon=eps, centre=(lo + hi) / 2, half_step=half_step)


def multibit_variance(
    features: Any, *, epsilon: float, bounds: tuple[float, float], unit: str = "neuron"
) -> np.ndarray:
    """Per-entry variance of the rectified multi-bit output (LPGNN's variance of the rectifier).

    Var[x′_i] = (d/m)·((β−α)/2)²·((e+1)/(e−1))² − (x_i − (α+β)/2)², for x clipped to [α, β].
    """
    x = _check_matrix(features, "features")
    lo, hi = _check_interval(bounds, "bounds")
    r = multibit_rectifier(x.shape[1], epsilon=epsilon, bounds=bounds, unit=unit)
    x = np.clip(x, lo, hi)
    return r.half_step**2 * r.m / r.d - (x - r.centre) ** 2


def multibit(
    features: Any,
    *,
    epsilon: float,
    bounds: tuple[float, float],
    unit: str = "neuron",
    randomness: Randomness | None = None,
) -> tuple[np.ndarray, ReleaseRecord]:
    """The multi-bit mechanism of LPGNN (Sajadmanesh & Gatica-Perez, CCS 2021) on weight features.

    ``features`` is (n, d), one row per neuron, clipped to the public box [α, β]^d (``bounds``);
    per row m = max(1, min(d, ⌊ε/2.18⌋)) coordinates are sampled and each reports
    x* = ±1 by (ε/m)-randomised response, the rest x* = 0; the output is the unbiased rectifier
    (:func:`multibit_rectifier`; variance :func:`multibit_variance`). Pure ε-DP with sensitivity
    β − α: per neuron the whole d-vector (default), per entry (only when asked) every coordinate
    (docs/mechanisms.md, "Multi-bit on weight features").

    Returns the rectified (n, d) array, three values only, and a ``"multibit"`` record with
    ``bounds``, ``m``, ``d`` (the length protected as one unit: 1 under ``"entry"``), ``shape``,
    ``centre`` and ``half_step``.
    """
    x, eps, lo, hi, unit, rnd = _release_inputs(features, "features", epsilon, bounds, "bounds", unit, randomness)
    n, d = x.shape
    rect = multibit_rectifier(d, epsilon=eps, bounds=(lo, hi), unit=unit)
    m = rect.m
    # Bernoulli probability in overflow-free form: 1/(e+1) = expit(−ε/m), (e−1)/(e+1) = tanh(ε/2m).
    p_floor = float(special.expit(-eps / m))
    p_slope = math.tanh(eps / (2 * m))
    u = (np.clip(x, lo, hi) - lo) / (hi - lo)
    out = np.empty_like(x)
    gen = rnd.generator
    if m == rect.d:
        # every coordinate is reported (this covers the per-entry unit)
        t = gen.random(x.shape) < p_floor + u * p_slope
        np.copyto(out, np.where(t, rect.levels[2], rect.levels[0]))
    else:
        block = max(1, _MULTIBIT_BLOCK_ELEMENTS // d)
        for start in range(0, n, block):
            ub = u[start : start + block]
            rows = np.arange(ub.shape[0])[:, None]
            # the m smallest of d i.i.d. uniform keys form a uniformly random m-subset
            keys = gen.random(ub.shape)
            sampled = np.argpartition(keys, m - 1, axis=1)[:, :m]
            t = gen.random(sampled.shape) < p_floor + ub[rows, sampled] * p_slope
            ob = out[start : start + block]
            ob.fill(rect.centre)
            ob[rows, sampled] = np.where(t, rect.levels[2], rect.levels[0])
    record = ReleaseRecord(
        mechanism="multibit",
        level="model",
        unit=unit,
        epsilon=eps,
        delta=0.0,
        sensitivity=hi - lo,
        sensitivity_norm="range",
        parameters={
            "bounds": [lo, hi],
            "m": m,
            "d": rect.d,
            "shape": [n, d],
            "centre": rect.centre,
            "half_step": rect.half_step,
        },
        **rnd.record_fields(),
    )
    return out, record
