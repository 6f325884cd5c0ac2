"""Rényi DP of the (multi-dimensional) Skellam mechanism, alone and Poisson-subsampled.

The mechanism: an integer vector query f(D) ∈ Z^d with integer L2 sensitivity Δ₂ and L1
sensitivity Δ₁ (over neighbouring D ~ D′, max ‖f(D) − f(D′)‖), released as f(D) + Z with
Z_i i.i.d. symmetric Skellam of *variance* V per coordinate: Z_i = P_i − P′_i with P_i, P′_i
independent Poisson(V/2). Sums of independent symmetric Skellams are symmetric Skellam with the
variances added, which is why k sites' shares add up to one mechanism.

Statements relied on:

- Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
  Learning" (NeurIPS 2021), Theorem 3.5 / Corollary 3.6, in the variance parametrisation that
  the authors' accounting code uses (TensorFlow Federated's ``distributed_dp`` accounting,
  ``_skellam_rdp`` with scale 1): for every *integer* order α > 1,

      ε(α) ≤ α·Δ₂²/(2V) + min( ((2α − 1)·Δ₂² + 6·Δ₁) / (4V²),  3·Δ₁/(2V) ).

  The first term is the Gaussian mechanism's RDP at noise variance V; the min is the price of
  discreteness, O(1/V²) per unit of sensitivity. The bound is symmetric in the pair, so it
  covers both directions of add/remove (and replace-one with the sensitivities of replace-one).
- Fractional orders: the Rényi divergence is non-decreasing in its order (van Erven &
  Harremoës 2014, Thm 3), so ε(α) ≤ ε(⌈α⌉) bounds every order, and the project's
  ``DEFAULT_ORDERS`` (fractional ones included) can be used unchanged.
- Poisson subsampling at rate q of any mechanism M with RDP ε_M at integer orders (Zhu & Wang,
  "Poisson Subsampled Rényi Differential Privacy", ICML 2019, Theorem 6, general upper bound;
  add/remove adjacency), for integer α ≥ 2:

      ε(α) ≤ 1/(α−1) · log{ (1−q)^{α−1}(αq − q + 1) + C(α,2) q² (1−q)^{α−2} e^{ε_M(2)}
                             + 3 Σ_{ℓ=3}^{α} C(α,ℓ) (1−q)^{α−ℓ} q^ℓ e^{(ℓ−1) ε_M(ℓ)} },

  evaluated in log space, and never above ε_M(α) itself (subsampling cannot hurt; take the min).
- Composition over T steps adds RDP order by order; (ε, δ) comes from the project's one
  conversion (``peer.dp.accounting.conversions.rdp_to_epsilon``).

Cross-checks (``tests/test_skellam_accounting.py``): the bound is ≥ the exact Rényi divergence
of Sk(V) + Δ against Sk(V) in one dimension (summed from scipy's Skellam PMFs) and close to it;
it tends to the Gaussian's α·Δ²/(2V) for large V; the Zhu–Wang bound applied to the Gaussian is ≥
dp-accounting's (tight) Poisson-subsampled Gaussian RDP and close to it, and applied to the 1-D
Skellam it is ≥ the exact divergence of the subsampled mixture; ε by the RDP conversion is ≥
the ε of the exact 1-D PLD from dp-accounting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import special

from peer.base.errors import InvalidArgument
from peer.dp.accounting.accountant import Accountant, pld_not_offered, rdp_of
from peer.dp.accounting.conversions import check_orders
from peer.dp.accounting.events import DistributedSkellamSteps


def check_sensitivities(l1_sensitivity: float, l2_sensitivity: float) -> tuple[float, float]:
    """Δ₁, Δ₂ as floats: finite, ≥ 0, and consistent (Δ₂ ≤ Δ₁ for any vector)."""
    out = []
    for name, v in (("l1_sensitivity", l1_sensitivity), ("l2_sensitivity", l2_sensitivity)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not (0 <= v < math.inf):
            raise InvalidArgument(name, f"must be a finite number >= 0, got {v!r}")
        out.append(float(v))
    if out[1] > out[0] * (1 + 1e-12):
        raise InvalidArgument("l2_sensitivity", f"cannot exceed l1_sensitivity ({out[0]!r}), got {out[1]!r}")
    return out[0], out[1]


def check_variance(variance: float, field: str = "variance") -> float:
    if isinstance(variance, bool) or not isinstance(variance, (int, float, np.integer, np.floating)):
        raise InvalidArgument(field, f"must be a number > 0, got {variance!r}")
    if not (0 < variance < math.inf):
        raise InvalidArgument(field, f"must be a finite number > 0, got {variance!r}")
    return float(variance)


def skellam_rdp_integer(l1_sensitivity: float, l2_sensitivity: float, variance: float, order: int) -> float:
    """Agarwal, Kairouz & Liu 2021 (module docstring) at one integer order ≥ 2."""
    a, d1, d2, v = int(order), l1_sensitivity, l2_sensitivity, variance
    gaussian = a * d2 * d2 / (2 * v)
    return gaussian + min(((2 * a - 1) * d2 * d2 + 6 * d1) / (4 * v * v), 3 * d1 / (2 * v))


def _integer_orders(orders: np.ndarray) -> np.ndarray:
    """⌈α⌉, at least 2: the integer order whose bound covers α (RDP is monotone in the order)."""
    return np.maximum(2, np.ceil(orders - 1e-12)).astype(np.int64)


def rdp_skellam(l1_sensitivity: float, l2_sensitivity: float, variance: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one Skellam release with total noise variance ``variance`` per coordinate, at
    ``orders`` (fractional orders by the next integer order)."""
    orders = check_orders(orders)
    d1, d2 = check_sensitivities(l1_sensitivity, l2_sensitivity)
    v = check_variance(variance)
    return np.array([skellam_rdp_integer(d1, d2, v, int(a)) for a in _integer_orders(orders)])


def rdp_poisson_subsampled(rdp_at: Callable[[int], float], sample_rate: float, order: int) -> float:
    """Zhu & Wang 2019, Theorem 6 (module docstring) at one integer order ≥ 2, for a mechanism
    whose RDP at integer order ℓ is ``rdp_at(ℓ)``; never above ``rdp_at(order)``."""
    q, a = float(sample_rate), int(order)
    if not 0 < q <= 1:
        raise InvalidArgument("sample_rate", f"must be in (0, 1], got {sample_rate!r}")
    if a < 2:
        raise InvalidArgument("orders", f"the subsampling bound needs integer orders >= 2, got {order!r}")
    plain = rdp_at(a)
    if q == 1.0:
        return plain
    log_q, log_1mq = math.log(q), math.log1p(-q)
    logs = [(a - 1) * log_1mq + math.log(a * q - q + 1)]
    weights = [1.0]
    log_comb_2 = math.log(a * (a - 1) / 2)
    logs.append(log_comb_2 + 2 * log_q + (a - 2) * log_1mq + rdp_at(2))
    weights.append(1.0)
    ells = np.arange(3, a + 1)
    if ells.size:
        eps = np.array([rdp_at(int(ell)) for ell in ells])
        log_comb = special.gammaln(a + 1) - special.gammaln(ells + 1) - special.gammaln(a - ells + 1)
        logs.extend(log_comb + (a - ells) * log_1mq + ells * log_q + (ells - 1) * eps)
        weights.extend([3.0] * ells.size)
    bound = float(special.logsumexp(np.array(logs), b=np.array(weights))) / (a - 1)
    return min(max(bound, 0.0), plain)


def rdp_subsampled_skellam(
    l1_sensitivity: float,
    l2_sensitivity: float,
    variance: float,
    sample_rate: float,
    orders: Sequence[float],
) -> np.ndarray:
    """RDP of one Poisson-subsampled (rate q, add/remove) Skellam step: Zhu & Wang's bound over
    Agarwal, Kairouz & Liu's, at ⌈α⌉ for fractional orders."""
    orders = check_orders(orders)
    d1, d2 = check_sensitivities(l1_sensitivity, l2_sensitivity)
    v = check_variance(variance)
    cache: dict[int, float] = {}

    def rdp_at(ell: int) -> float:
        if ell not in cache:
            cache[ell] = skellam_rdp_integer(d1, d2, v, ell)
        return cache[ell]

    done: dict[int, float] = {}
    out = np.empty(orders.shape)
    for i, a in enumerate(_integer_orders(orders)):
        a = int(a)
        if a not in done:
            done[a] = rdp_poisson_subsampled(rdp_at, sample_rate, a)
        out[i] = done[a]
    return out


def rdp_skellam_steps(
    l1_sensitivity: float,
    l2_sensitivity: float,
    variance: float,
    sample_rate: float,
    steps: int,
    orders: Sequence[float],
) -> np.ndarray:
    """T adaptively composed steps of the (subsampled) Skellam mechanism: RDP adds."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise InvalidArgument("steps", f"must be an integer >= 1, got {steps!r}")
    return int(steps) * rdp_subsampled_skellam(l1_sensitivity, l2_sensitivity, variance, sample_rate, orders)


@rdp_of(DistributedSkellamSteps)
def _distributed_skellam_rdp(acc: Accountant, e: DistributedSkellamSteps) -> np.ndarray:
    """The charge of ``e``: what a coalition of t sites faces, the honest shares' (k − t)·v."""
    return rdp_skellam_steps(e.l1_sensitivity, e.l2_sensitivity, e.honest_variance, e.sample_rate, e.steps, acc.orders)


pld_not_offered(
    DistributedSkellamSteps,
    "no dominating pair of the subsampled multi-dimensional Skellam is implemented",
)


__all__ = [
    "check_sensitivities",
    "check_variance",
    "rdp_poisson_subsampled",
    "rdp_skellam",
    "rdp_skellam_steps",
    "rdp_subsampled_skellam",
    "skellam_rdp_integer",
]
