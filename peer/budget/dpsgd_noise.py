"""DP-SGD noise calibration: for a planned run of DP-SGD steps, the smallest noise multiplier σ
whose ``steps`` steps fit a per-record budget (ε, δ), by one of three figures. (The Gaussian
mechanism's own calibration for a single release — analytic or classical σ — is
``peer.ldp.mechanisms.gaussian``.)

A DP-SGD step adds N(0, σ²C²) to a sum of per-record gradients clipped to norm C; its
sensitivity is C (add-remove) or 2C (replace-one); with Poisson rate q < 1 the step is the
subsampled Gaussian. ``steps`` such steps compose (adaptively: each starts from what the last
released). The figures, from loosest to tightest:

- ``"filter"``: what this site's ledger *enforces*: the multi-order RDP filter over
  ``FILTER_ORDERS`` with δ split evenly across the orders (``peer.budget.filter``). A run
  calibrated here is admitted by a ledger whose data budget is (ε, δ) and that holds nothing
  else; it is what a peer that charges every segment before it leaves can spend.
- ``"rdp"``: the RDP curve converted at the whole δ (dp-accounting's improved conversion) over
  dp-accounting's default orders — what an Opacus/TF-Privacy user calibrating a DP-FedAvg run
  by RDP would report.
- ``"pld"``: the exact privacy loss distribution; full batch in closed form (the composition
  of ``steps`` Gaussians is the Gaussian with μ = √steps · Δ/σ), Poisson by dp-accounting's
  PLD (discretised pessimistically).

For the same (ε, δ): σ_filter ≥ σ_rdp ≥ σ_pld. The returned σ is rounded *up* (bisection keeps
the feasible end), so the figure of the returned σ is ≤ ε.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.budget.filter import FILTER_ORDERS, FilterBudget, conversion_offset
from peer.dp.accounting import DEFAULT_ORDERS
from peer.dp.accounting.conversions import gdp_mu, rdp_to_epsilon
from peer.dp.accounting.rdp import rdp_subsampled_gaussian
from peer.dp.accounting.training_records import check_adjacency

__all__ = ["FIGURES", "noise_multiplier_for", "planned_orders", "run_epsilon"]

FIGURES = ("filter", "rdp", "pld")

# dp-accounting's default RDP orders (RdpAccountant's DEFAULT_RDP_ORDERS), the project's own default
RDP_ORDERS = tuple(DEFAULT_ORDERS)


def run_epsilon(
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    sample_rate: float = 1.0,
    adjacency: str = "add-remove",
    figure: str = "filter",
    pld_interval: float = 1e-4,
    orders: Sequence[float] = FILTER_ORDERS,
) -> float:
    """ε at ``delta`` of ``steps`` DP-SGD steps with this noise multiplier, by ``figure``
    (``orders``: the filter's Rényi orders, for ``figure="filter"`` only)."""
    if figure not in FIGURES:
        raise InvalidArgument("figure", f"must be one of {list(FIGURES)}, got {figure!r}")
    if not (isinstance(steps, int) and steps >= 1):
        raise InvalidArgument("steps", f"must be an integer ≥ 1, got {steps!r}")
    check_adjacency(adjacency)
    delta = check_delta(delta)
    sigma, q = float(noise_multiplier), float(sample_rate)
    if not (sigma > 0 and math.isfinite(sigma)):
        raise InvalidArgument("noise_multiplier", f"must be finite and > 0, got {noise_multiplier!r}")
    if not (0 < q <= 1):
        raise InvalidArgument("sample_rate", f"must be in (0, 1], got {sample_rate!r}")
    if figure == "filter":
        budget = FilterBudget(1.0, delta, tuple(orders))
        rdp = steps * rdp_subsampled_gaussian(sigma, q, budget.orders, adjacency)
        eps, _ = budget.spent_epsilon(rdp, math.inf)
        return eps
    if figure == "rdp":
        rdp = steps * rdp_subsampled_gaussian(sigma, q, RDP_ORDERS, adjacency)
        return rdp_to_epsilon(RDP_ORDERS, rdp, delta)
    from peer.dp.accounting.conversions import gdp_epsilon, pld_epsilon
    from peer.dp.accounting.pld import self_compose, subsampled_gaussian_pld

    if q == 1.0:
        return gdp_epsilon(math.sqrt(steps) * (2.0 if adjacency == "replace-one" else 1.0) / sigma, delta)
    pld = subsampled_gaussian_pld(sigma, q, adjacency=adjacency, value_discretization_interval=pld_interval)
    return pld_epsilon(self_compose(pld, steps), delta)


def noise_multiplier_for(
    epsilon: float,
    delta: float,
    steps: int,
    *,
    sample_rate: float = 1.0,
    adjacency: str = "add-remove",
    figure: str = "filter",
    rtol: float = 1e-6,
    orders: Sequence[float] = FILTER_ORDERS,
) -> float:
    """The smallest σ (to ``rtol``, rounded up) with ``run_epsilon(σ, …) ≤ epsilon``."""
    epsilon = check_epsilon(epsilon)
    check_adjacency(adjacency)
    if figure == "pld" and sample_rate == 1.0:
        delta = check_delta(delta)
        return (2.0 if adjacency == "replace-one" else 1.0) * math.sqrt(steps) / gdp_mu(epsilon, delta) * (1 + 1e-12)

    def fits(sigma: float) -> bool:
        return (
            run_epsilon(sigma, steps, delta, sample_rate=sample_rate, adjacency=adjacency, figure=figure, orders=orders)
            <= epsilon
        )

    lo, hi = 1e-3, 1.0
    while not fits(hi):
        lo, hi = hi, hi * 2.0
        if hi > 1e7:
            raise InvalidArgument("epsilon", f"{epsilon:g} cannot be met by {steps} steps at any σ ≤ 1e7")
    while hi - lo > rtol * hi:
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return float(np.nextafter(hi, math.inf))


def planned_orders(
    epsilon: float,
    delta: float,
    steps: int,
    *,
    sample_rate: float = 1.0,
    adjacency: str = "add-remove",
    candidates: Sequence[float] = RDP_ORDERS,
) -> tuple[float, ...]:
    """The one Rényi order (among ``candidates`` > 1.01) at which a ledger's filter needs the
    least noise for a planned run of ``steps`` DP-SGD steps at (ε, δ): a ledger created with
    these orders holds the whole δ at that order (no union-bound split, see
    ``peer.budget.filter``), so the run's σ is the plain RDP figure at that order.

    Legitimate only for a ledger created for that run: the orders are fixed before any release
    and depend only on the run's public plan (ε, δ, steps, q, adjacency), never on data. Such a
    ledger admits other releases only as far as they fit at that one order."""
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    check_adjacency(adjacency)
    usable = [float(o) for o in candidates if o > 1.01]
    if not usable:
        raise InvalidArgument("candidates", "must hold at least one order > 1.01")
    # ε(σ) at order α is increasing in the RDP, so the order needing the least σ is the one
    # with the smallest ε at a fixed reference σ; one σ near the answer (the RDP figure) decides it.
    sigma = noise_multiplier_for(epsilon, delta, steps, sample_rate=sample_rate, adjacency=adjacency, figure="rdp")
    rdp = steps * rdp_subsampled_gaussian(sigma, float(sample_rate), usable, adjacency)
    eps = np.asarray(rdp) + conversion_offset(usable, delta)
    return (usable[int(np.argmin(eps))],)
