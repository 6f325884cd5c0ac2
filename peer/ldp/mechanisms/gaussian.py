"""The Gaussian mechanism on released weights: calibration of σ and the PFA's perturbation unit.

Rows are projected onto the public box and L2 ball, then N(0, σ²I) is added with σ calibrated by
the analytic Gaussian mechanism (every ε) or the classical formula (ε < 1 only); the record says
which (docs/mechanisms.md, "Gaussian on released weights").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import special

from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms.checks import _check_delta, _check_matrix, _check_unit, _positive_finite, _randomness

optimize = LazyModule("scipy.optimize")  # imported at the first root-find (~0.8 s of CPU to import)

CALIBRATIONS = ("analytic", "classical")


def _log_gaussian_delta(epsilon: float, ratio: float) -> float:
    """log δ(ε) of the Gaussian mechanism with noise_std / sensitivity = ``ratio``."""
    a = 1 / (2 * ratio) - epsilon * ratio
    b = -1 / (2 * ratio) - epsilon * ratio
    log_pa = special.log_ndtr(a)
    z = epsilon + special.log_ndtr(b) - log_pa  # log of e^ε Φ(b) / Φ(a), always < 0
    if z >= 0:
        return -math.inf
    return float(log_pa + math.log(-math.expm1(z)))


def gaussian_delta(epsilon: float, noise_std: float, sensitivity: float) -> float:
    """The exact δ(ε) of the Gaussian mechanism (Balle & Wang, ICML 2018, Thm. 8).

    δ(ε) = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ), the hockey-stick divergence of
    N(0, σ²) and N(Δ, σ²); computed in log space so that it neither overflows for large ε nor
    loses precision for small δ.
    """
    eps = float(epsilon)
    if not (math.isfinite(eps) and eps >= 0):
        raise InvalidArgument("epsilon", f"must be finite and >= 0, got {epsilon!r}")
    sigma = _positive_finite(noise_std, "noise_std")
    sens = _positive_finite(sensitivity, "sensitivity")
    return math.exp(_log_gaussian_delta(eps, sigma / sens))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest σ for which Gaussian noise N(0, σ²) on an L2-sensitivity-Δ query is (ε, δ)-DP.

    The analytic Gaussian mechanism (Balle & Wang, ICML 2018): δ(ε) of :func:`gaussian_delta`
    is decreasing in σ, so σ solves δ(ε; σ) = δ. Solved by Brent's method on log σ/Δ against
    log δ (relative precision ~1e-12). Valid for every ε > 0 (unlike the classical formula).
    """
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    sens = _positive_finite(sensitivity, "sensitivity")
    target = math.log(dlt)

    def excess(log_ratio: float) -> float:
        return _log_gaussian_delta(eps, math.exp(log_ratio)) - target

    lo = hi = math.log(math.sqrt(2 * math.log(1.25 / dlt)) / eps)  # the classical ratio: a start
    while excess(lo) < 0:
        lo -= 1.0
    while excess(hi) > 0:
        hi += 1.0
    log_ratio = optimize.brentq(excess, lo, hi, xtol=1e-14, rtol=4 * np.finfo(float).eps, maxiter=500)
    return math.exp(log_ratio) * sens


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The classical calibration σ = sqrt(2 ln(1.25/δ)) · Δ/ε (Dwork & Roth 2014, Thm. A.1).

    Valid only for ε < 1: raises InvalidArgument for ε >= 1 (use
    :func:`analytic_gaussian_sigma`, which is also tighter for every ε).
    """
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    sens = _positive_finite(sensitivity, "sensitivity")
    if eps >= 1:
        raise InvalidArgument(
            "epsilon",
            f"the classical Gaussian calibration holds only for epsilon < 1, got {epsilon!r}; use calibration='analytic'",
        )
    return math.sqrt(2 * math.log(1.25 / dlt)) * sens / eps


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, calibration: str = "analytic") -> float:
    """σ by the named calibration (``"analytic"`` or ``"classical"``)."""
    if calibration == "analytic":
        return analytic_gaussian_sigma(epsilon, delta, sensitivity)
    if calibration == "classical":
        return classical_gaussian_sigma(epsilon, delta, sensitivity)
    raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")


def clip_rows(vectors: Any, *, clip_norm: float, entry_bound: float | None = None) -> np.ndarray:
    """Project each row onto {v : |v_j| <= entry_bound} ∩ {v : ‖v‖₂ <= clip_norm}.

    First each entry is clipped to the public box [−entry_bound, entry_bound] (skipped when
    ``entry_bound`` is None), then the row is scaled by min(1, clip_norm/‖row‖₂). Both steps are
    Euclidean projections onto convex sets, hence 1-Lipschitz in L2; scaling down keeps the row
    in the box, so the result lies in the intersection.
    """
    x = _check_matrix(vectors, "vectors")
    c2 = _positive_finite(clip_norm, "clip_norm")
    if entry_bound is not None:
        c = _positive_finite(entry_bound, "entry_bound")
        x = np.clip(x, -c, c)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    over = norms > c2
    return np.where(over, x * (c2 / np.where(over, norms, 1.0)), x)


def gaussian_sensitivity(unit: str, *, clip_norm: float, entry_bound: float | None, length: int) -> float:
    """L2 sensitivity Δ₂ of a clipped row of ``length`` entries under ``unit`` (docs/mechanisms.md,
    "Gaussian on released weights").
    """
    c2 = _positive_finite(clip_norm, "clip_norm")
    if _check_unit(unit) == "neuron":
        # replace-one: two points of the clip set are at most its diameter apart
        box_diameter = math.inf if entry_bound is None else 2 * float(entry_bound) * math.sqrt(length)
        return min(2 * c2, box_diameter)
    # one entry changes: the box clip moves one coordinate by <= 2c, the L2 projection is
    # 1-Lipschitz, and both rows lie in the ball
    return 2 * c2 if entry_bound is None else 2 * min(float(entry_bound), c2)


def gaussian_perturbation(
    vectors: Any,
    *,
    epsilon: float,
    delta: float,
    clip_norm: float,
    entry_bound: float | None = None,
    unit: str = "neuron",
    calibration: str = "analytic",
    randomness: Randomness | None = None,
) -> tuple[np.ndarray, ReleaseRecord]:
    """The PFA's randomized perturbation unit: ``clip_rows(v) + N(0, σ² I)``, σ calibrated to Δ₂.

    ``vectors`` is (n, k): one row per neuron (its incoming weights, its bias appended), projected
    onto the public box (``entry_bound``) and the L2 ball (``clip_norm``). Unit ``"neuron"``
    (default, replace-one): Δ₂ = 2·clip_norm, or the box diameter if smaller; ``"entry"`` (only
    when asked): Δ₂ = 2·min(c, clip_norm) (:func:`gaussian_sensitivity`). σ from
    :func:`analytic_gaussian_sigma` (default, every ε > 0) or :func:`classical_gaussian_sigma`
    (ε < 1 only); docs/mechanisms.md, "Gaussian on released weights".

    Returns the noisy (n, k) array and a ``"gaussian"`` record carrying ``noise_std``,
    ``clip_norm``, ``entry_bound`` (None if no box), ``calibration``, ``adjacency`` and ``shape``;
    ε, δ are the calibration target.
    """
    x = _check_matrix(vectors, "vectors")
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    c2 = _positive_finite(clip_norm, "clip_norm")
    c = None if entry_bound is None else _positive_finite(entry_bound, "entry_bound")
    unit = _check_unit(unit)
    if calibration not in CALIBRATIONS:
        raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")
    rnd = _randomness(randomness)
    n, k = x.shape
    sensitivity = gaussian_sensitivity(unit, clip_norm=c2, entry_bound=c, length=k)
    sigma = gaussian_sigma(eps, dlt, sensitivity, calibration)
    noisy = clip_rows(x, clip_norm=c2, entry_bound=c) + rnd.generator.normal(0.0, sigma, size=x.shape)
    record = ReleaseRecord(
        mechanism="gaussian",
        level="model",
        unit=unit,
        epsilon=eps,
        delta=dlt,
        sensitivity=sensitivity,
        sensitivity_norm="l2",
        parameters={
            "noise_std": sigma,
            "clip_norm": c2,
            "entry_bound": c,
            "calibration": calibration,
            "adjacency": "replace-one" if unit == "neuron" else "replace-entry",
            "shape": [n, k],
        },
        **rnd.record_fields(),
    )
    return noisy, record
