"""Rényi DP (Mironov 2017) of the mechanisms PrivFusion releases, per order.

ε_order(M) = sup over neighbours D ~ D' of D_order(M(D) ‖ M(D')), with
D_order(P ‖ Q) = 1/(order − 1) · log E_Q[(P/Q)^order]. Sequential composition adds RDP
order by order (Mironov 2017, Prop. 1).

Statements relied on (one function each):

- Gaussian with sensitivity-to-noise ratio μ: order·μ²/2 (Mironov 2017, Prop. 7).
- Poisson-subsampled Gaussian, add-remove: dp-accounting's ``RdpAccountant`` on
  ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` (Mironov, Talwar & Zhang 2019).
- Poisson-subsampled Gaussian, replace-one (dp-accounting refuses this pair for RDP): the
  Rényi divergence of the pair dp-accounting's PLD code uses for replace-one,
  P = (1−q)·N(0, σ²) + q·N(−1, σ²) and Q = (1−q)·N(0, σ²) + q·N(1, σ²) (sensitivity 1 = the
  clip norm; the replaced and the new record each move the sum by at most C, in opposite
  directions in the worst case). That pair dominates every replace-one neighbouring pair in
  hockey-stick divergence for all γ > 0 (it is symmetric, so both directions are covered), hence
  in every f-divergence (Blackwell; Zhu, Dong & Wang 2022, "Optimal accounting of differential
  privacy via characteristic function", §2 on dominating pairs), Rényi included. We integrate it
  numerically in log space (trapezoid on a grid finer than every feature of the integrand; the
  same integrator reproduces dp-accounting's add-remove values to 1e-9 relative, see the tests).
- Laplace with ε = Δ₁/b: Mironov 2017, Prop. 6,
  ε_order = 1/(order−1) · log[ order/(2order−1) · e^{(order−1)ε} + (order−1)/(2order−1) · e^{−order·ε} ].
  For a vector with L1 sensitivity Δ₁ and i.i.d. Laplace(b) noise per coordinate, the RDP of a
  shift v is Σ_i f(|v_i|/b) with f the 1-D expression above; f is convex with f(0) = 0, so
  superadditive, and the sum is at most f(Δ₁/b): the 1-D formula bounds the vector mechanism
  (the same 1-D reduction as dp-accounting's ``LaplaceDpEvent``).
- Pure ε-DP: every ε-DP pair is a post-processing of binary randomised response with
  p = e^ε/(1+e^ε) (Kairouz, Oh & Viswanath 2015), so its RDP is at most that of randomised
  response, 1/(order−1)·log[(1−p)·e^{order·ε} + p·e^{−order·ε}] — tight (attained by RR), and
  below both ε and Bun & Steinke's order·ε²/2.
- Random selection (RS) of model i with probability π_i: for each order,
  ε_order^RS ≤ 1/(order−1) · log Σ_i π_i exp((order−1)·ε_order,i) (quasi-convexity of the
  Rényi divergence's exponential, i.e. joint convexity of E_Q[(P/Q)^order]), in log space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule
from peer.dp.accounting.conversions import check_orders
from peer.dp.accounting.training_records import ADJACENCIES, check_adjacency

# imported at the first subsampled-Gaussian curve (peer.base.extras: slow to import)
dp_event = LazyModule("dp_accounting.dp_event")
rdp_privacy_accountant = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")


def rdp_gaussian(mu: float, orders: Sequence[float]) -> np.ndarray:
    """order·μ²/2 for a Gaussian mechanism with sensitivity/noise ratio μ (∞ when μ = ∞)."""
    orders = check_orders(orders)
    if math.isinf(mu):
        return np.full(orders.shape, math.inf)
    return orders * (mu * mu) / 2.0


def _edge_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray | None:
    """RDP of an ε = 0 (zeros) or ε = ∞ (infinite) mechanism; None for 0 < ε < ∞."""
    if epsilon < 0:
        raise InvalidArgument("epsilon", f"must be >= 0, got {epsilon!r}")
    if epsilon == 0:
        return np.zeros(orders.shape)
    if math.isinf(epsilon):
        return np.full(orders.shape, math.inf)
    return None


def rdp_laplace(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    """Mironov 2017, Prop. 6, for a Laplace mechanism with ε = sensitivity/scale."""
    orders = check_orders(orders)
    edge = _edge_rdp(epsilon, orders)
    if edge is not None:
        return edge
    a = orders
    log_terms = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) * epsilon, np.log((a - 1) / (2 * a - 1)) - a * epsilon)
    return np.minimum(log_terms / (a - 1), epsilon)


def rdp_pure(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of an ε-DP mechanism: that of binary randomised response (tight)."""
    orders = check_orders(orders)
    edge = _edge_rdp(epsilon, orders)
    if edge is not None:
        return edge
    log_p = -np.logaddexp(0.0, -epsilon)  # log e^ε/(1+e^ε)
    log_1mp = -np.logaddexp(0.0, epsilon)  # log 1/(1+e^ε)
    a = orders
    out = np.logaddexp(log_1mp + a * epsilon, log_p - a * epsilon) / (a - 1)
    return np.clip(out, 0.0, epsilon)


def _log_normal_pdf(x: np.ndarray, mean: float, sigma: float) -> np.ndarray:
    return -0.5 * ((x - mean) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))


def _log_mixture(x: np.ndarray, sigma: float, q: float, shift: float) -> np.ndarray:
    """log[(1−q)·N(x; 0, σ²) + q·N(x; shift, σ²)]."""
    if q == 1.0:
        return _log_normal_pdf(x, shift, sigma)
    return np.logaddexp(math.log1p(-q) + _log_normal_pdf(x, 0.0, sigma), math.log(q) + _log_normal_pdf(x, shift, sigma))


def rdp_numerical_subsampled_gaussian(
    sigma: float, q: float, orders: Sequence[float], p_shift: float, q_shift: float
) -> np.ndarray:
    """D_order(P ‖ Q) for P = (1−q)N(0,σ²) + qN(p_shift,σ²), Q = (1−q)N(0,σ²) + qN(q_shift,σ²),
    by log-space trapezoid integration of P^order · Q^(1−order).

    The grid spans the region where the integrand lives (around −order·(p_shift − q_shift)/2
    for large orders, around 0 otherwise) and is widened until both ends lie 60 nats below the
    peak; its step is below σ/16 and below the width σ²/sqrt(order) of the sharpest feature
    (the cross-over of the two mixture components), where the trapezoid rule on such smooth,
    Gaussian-tailed integrands is accurate far beyond float precision.
    """
    orders = check_orders(orders)
    if not sigma > 0:
        raise InvalidArgument("noise_multiplier", f"must be > 0 for a finite RDP, got {sigma!r}")
    if not 0 < q <= 1:
        raise InvalidArgument("sample_rate", f"must be in (0, 1], got {q!r}")
    gap = abs(p_shift - q_shift)
    out = np.empty(orders.shape)
    for k, a in enumerate(orders):
        h = min(sigma / 16.0, sigma * sigma / (2.0 * math.sqrt(a)), max(gap, 1e-3) / 16.0)
        # Large orders put the mass where order·log P + (1−order)·log Q peaks: at c + order·(p − c)
        # with c the centre of the component of Q that dominates there (0 or q_shift).
        centres = (0.0, a * p_shift, q_shift + a * (p_shift - q_shift), p_shift, q_shift)
        lo = min(centres) - 30 * sigma - 2 * gap
        hi = max(centres) + 30 * sigma + 2 * gap
        for _ in range(20):
            x = np.arange(lo, hi + h, h)
            g = a * _log_mixture(x, sigma, q, p_shift) + (1 - a) * _log_mixture(x, sigma, q, q_shift)
            top = g.max()
            if g[0] < top - 60 and g[-1] < top - 60:
                break
            width = hi - lo
            if g[0] >= top - 60:
                lo -= width
            if g[-1] >= top - 60:
                hi += width
        else:
            raise ArithmeticError("RDP integration did not localise the integrand")
        log_integral = special.logsumexp(g) + math.log(h)
        if log_integral < 1e-2:
            # Small divergence: E_Q[(P/Q)^order] − 1 = ∫ Q·expm1(order·log(P/Q)) keeps the digits
            # that log(1 + tiny) would lose.
            log_q = _log_mixture(x, sigma, q, q_shift)
            log_ratio = _log_mixture(x, sigma, q, p_shift) - log_q
            t = a * log_ratio
            small = t < 30.0
            terms = np.where(small, np.exp(log_q) * np.expm1(np.minimum(t, 30.0)), np.exp(g) - np.exp(log_q))
            excess = h * float(np.sum(terms))
            log_integral = math.log1p(excess) if excess > -1 else log_integral
        out[k] = max(0.0, log_integral / (a - 1))
    # Round up past floating-point summation error (≈1e-16 absolute on E_Q[(P/Q)^order]).
    return out * (1 + 1e-9) + 1e-12


def rdp_subsampled_gaussian(
    noise_multiplier: float, sample_rate: float, orders: Sequence[float], adjacency: str
) -> np.ndarray:
    """RDP of one DP-SGD step: Gaussian noise σ·C on a clipped sum, Poisson rate q.

    Full batch (q = 1): sensitivity/noise ratio 1/σ (add-remove) or 2/σ (replace-one), so
    order/(2σ²) or 2·order/σ². Poisson: see the module docstring.
    """
    orders = check_orders(orders)
    check_adjacency(adjacency)
    sigma, q = float(noise_multiplier), float(sample_rate)
    if sigma == 0:
        return np.full(orders.shape, math.inf)
    if q == 1.0:
        return rdp_gaussian((2.0 if adjacency == "replace-one" else 1.0) / sigma, orders)
    if adjacency == "add-remove":
        acc = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
        rdp = acc.rdp
        # dp-accounting's series for fractional orders sometimes stops without converging and
        # then reports ∞ for that order; integrate those orders numerically instead.
        failed = ~np.isfinite(rdp)
        if np.any(failed):
            rdp[failed] = rdp_numerical_subsampled_gaussian(sigma, q, orders[failed], p_shift=1.0, q_shift=0.0)
        return rdp
    return rdp_numerical_subsampled_gaussian(sigma, q, orders, p_shift=-1.0, q_shift=1.0)


def rdp_mixture(pi: Sequence[float], rdps: Sequence[np.ndarray], orders: Sequence[float]) -> np.ndarray:
    """RS: 1/(order−1) · log Σ_i π_i exp((order−1)·ε_order,i), in log space; models with π_i = 0
    do not count (an infinite ε_i with π_i = 0 is harmless)."""
    orders = check_orders(orders)
    pi = np.asarray(pi, dtype=float)
    rdps = np.asarray(rdps, dtype=float).reshape(len(pi), orders.size)
    keep = pi > 0
    if not np.any(keep):
        raise InvalidArgument("pi", "must put positive weight on some model")
    r = rdps[keep]
    if np.any(np.isinf(r)):
        return np.where(
            np.any(np.isinf(r), axis=0), math.inf, _mix_finite(pi[keep], np.where(np.isinf(r), 0.0, r), orders)
        )
    return _mix_finite(pi[keep], r, orders)


def _mix_finite(pi: np.ndarray, r: np.ndarray, orders: np.ndarray) -> np.ndarray:
    a1 = orders - 1.0
    return special.logsumexp(a1[None, :] * r + np.log(pi)[:, None], axis=0) / a1


__all__ = [
    "ADJACENCIES",
    "rdp_gaussian",
    "rdp_laplace",
    "rdp_mixture",
    "rdp_numerical_subsampled_gaussian",
    "rdp_pure",
    "rdp_subsampled_gaussian",
]
