"""Conversions between privacy descriptions: RDP → (ε, δ), Gaussian DP (μ-GDP) ↔ (ε, δ), PLD ↔ (ε, δ).

Statements relied on:

- RDP → (ε, δ), the improved conversion (Canonne, Kamath & Steinke 2020, Prop. 12 of
  arXiv:2004.00010 v4; Asoodeh et al. 2020, eq. 20), as dp-accounting's
  ``rdp.compute_epsilon`` / ``compute_delta`` implement it and which we call:
  a mechanism that is (order, r)-RDP is (ε, δ)-DP with
  ε = r + log1p(−1/order) − log(δ·order)/(order − 1), minimised over the orders.
- μ-GDP (Dong, Roth & Su 2022, Cor. 2.13; equivalently Balle & Wang 2018, Thm 8, the exact
  (ε, δ) curve of a Gaussian mechanism with sensitivity-to-noise ratio μ):
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), evaluated in log space. Adaptive composition of
  Gaussian mechanisms with ratios μ_t is exactly μ-GDP with μ = sqrt(Σ_t μ_t²) (DRS Cor. 3.3).
- PLD: dp-accounting's pessimistic privacy loss distributions give upper bounds on δ(ε); their
  δ can exceed 1 by rounding, so every δ leaving this module is clamped to [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule

optimize = LazyModule("scipy.optimize")  # imported at the first root-find (~0.8 s of CPU to import)

# imported at the first conversion (its package import costs ~1.1 s of CPU: peer.base.extras)
rdp_privacy_accountant = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")

# dp-accounting's default orders (its DEFAULT_RDP_ORDERS, written out so that reading them imports
# nothing; tests/test_accounting_conversions.py checks they are the same): 1.1 … 10.9 by 0.1,
# 11 … 63, 128, 256, 512, 1024.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)


@dataclass(frozen=True)
class Epsilons:
    """ε at a fixed δ by each accountant: ``pld`` (tight, numerical), ``rdp`` (improved
    conversion), and ``closed_form`` (μ-GDP) where one exists (full-batch Gaussian), else None.
    ``notes`` say where a figure is conservative for a stated reason."""

    pld: float
    rdp: float
    closed_form: float | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {"pld": json_number(self.pld), "rdp": json_number(self.rdp)}
        if self.closed_form is not None:
            out["closed_form"] = json_number(self.closed_form)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class Deltas:
    """δ at a fixed ε by each accountant (same fields as ``Epsilons``)."""

    pld: float
    rdp: float
    closed_form: float | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {"pld": self.pld, "rdp": self.rdp}
        if self.closed_form is not None:
            out["closed_form"] = self.closed_form
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def json_number(x: float) -> float | str:
    """JSON has no infinity: ∞ is written "inf" (as ReleaseRecord does)."""
    return "inf" if math.isinf(x) else float(x)


def check_orders(orders: Sequence[float]) -> np.ndarray:
    arr = np.asarray(orders, dtype=float)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or not np.all(arr > 1):
        raise InvalidArgument("orders", "must be a non-empty list of finite Rényi orders > 1")
    return arr


def _orders_and_curve(orders: Sequence[float], rdp: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    orders = check_orders(orders)
    rdp = np.asarray(rdp, dtype=float)
    if rdp.shape != orders.shape:
        raise InvalidArgument("rdp", f"must have one value per order ({orders.size}), got shape {rdp.shape}")
    return orders, rdp


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """Smallest ε over the orders by the improved conversion (dp-accounting's ``compute_epsilon``)."""
    delta = check_delta(delta)
    orders, rdp = _orders_and_curve(orders, rdp)
    if np.all(np.isinf(rdp)):
        return math.inf
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
    return max(0.0, float(eps))


def rdp_to_delta(orders: Sequence[float], rdp: Sequence[float], epsilon: float) -> float:
    """Smallest δ ∈ [0, 1] over the orders by the improved conversion (``compute_delta``)."""
    epsilon = check_epsilon(epsilon, zero=True)
    orders, rdp = _orders_and_curve(orders, rdp)
    if np.all(np.isinf(rdp)):
        return 1.0
    delta, _ = rdp_privacy_accountant.compute_delta(orders, rdp, epsilon)
    return min(1.0, max(0.0, float(delta)))


def _gdp_log_delta(mu: float, epsilon: float) -> float:
    """log δ(ε) of μ-GDP: log[Φ(a) − e^ε Φ(b)], a = −ε/μ + μ/2, b = −ε/μ − μ/2."""
    a = -epsilon / mu + mu / 2
    b = -epsilon / mu - mu / 2
    la = special.log_ndtr(a)
    lb = epsilon + special.log_ndtr(b)
    if lb >= la:
        return -math.inf
    return float(la + math.log1p(-math.exp(lb - la)))


def _check_mu(mu: float) -> None:
    if mu < 0 or math.isnan(mu):
        raise InvalidArgument("mu", f"must be >= 0, got {mu!r}")


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP mechanism (exact for a Gaussian mechanism with Δ/σ = μ)."""
    epsilon = check_epsilon(epsilon, zero=True)
    _check_mu(mu)
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    return min(1.0, math.exp(_gdp_log_delta(mu, epsilon)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ delta for μ-GDP (root of the exact curve, 1e-12 relative)."""
    delta = check_delta(delta)
    _check_mu(mu)
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    target = math.log(delta)
    if _gdp_log_delta(mu, 0.0) <= target:
        return 0.0
    hi = max(1.0, mu * mu)
    while _gdp_log_delta(mu, hi) > target:
        hi *= 2.0
    return float(optimize.brentq(lambda e: _gdp_log_delta(mu, e) - target, 0.0, hi, xtol=1e-14, rtol=1e-13))


def gdp_mu(epsilon: float, delta: float) -> float:
    """Largest μ whose μ-GDP curve meets (ε, δ): the inverse of ``gdp_epsilon`` in μ
    (bisection on the increasing map μ ↦ δ(ε; μ), to 1e-14 relative)."""
    epsilon = check_epsilon(epsilon, zero=True)
    delta = check_delta(delta)
    target = math.log(delta)
    lo, hi = 0.0, 1.0
    while _gdp_log_delta(hi, epsilon) <= target:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-14 * hi:
        mid = 0.5 * (lo + hi)
        if _gdp_log_delta(mid, epsilon) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def pld_epsilon(pld, delta: float) -> float:
    """ε(δ) of a dp-accounting PrivacyLossDistribution (max over its two directions)."""
    delta = check_delta(delta)
    return max(0.0, float(pld.get_epsilon_for_delta(delta)))


def pld_delta(pld, epsilon: float | np.ndarray):
    """δ(ε) of a PrivacyLossDistribution, clamped to [0, 1] (pessimistic rounding can exceed 1)."""
    out = np.clip(pld.get_delta_for_epsilon(epsilon), 0.0, 1.0)
    return float(out) if np.ndim(out) == 0 else out
