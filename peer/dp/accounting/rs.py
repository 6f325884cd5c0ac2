"""Random selection (RS): release θ_I with I ~ Cat(π), π a distribution over the pool's models.

Unit of privacy: one training record under the merge's adjacency (``profiles.resolve_adjacency``);
every model was trained on the same dataset. π is public; the selected index I must stay secret
(revealing I would reduce the guarantee to that of model I alone).

Bounds (docs/architecture.md, "Accounting"; the model-merging paper, Yin, Zaheer & Li 2026, arXiv:2604.20985):

- RDP: ε_order^RS(π) ≤ 1/(order−1) · log Σ_i π_i exp((order−1)·ε_order,i), in log space
  (``rdp.rdp_mixture``), then the improved conversion to (ε, δ);
- PLD: δ^RS(ε) ≤ max{Σ_i π_i H_ε(P_i‖Q_i), Σ_i π_i H_ε(Q_i‖P_i)}, each model's δ(ε) curve in both
  directions (``pld.mixture_pld``), then ε(δ) by dp-accounting's inversion of the mixed curve.

A model known only by (ε_i, δ_i) enters with the worst-case profile of an (ε_i, δ_i)-DP mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.conversions import (
    DEFAULT_ORDERS,
    Deltas,
    Epsilons,
    pld_delta,
    pld_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
)
from peer.dp.accounting.profiles import DEFAULT_INTERVAL, Model, PrivacyProfile, privacy_profiles
from peer.dp.accounting.rdp import rdp_mixture

WEIGHT_TOLERANCE = 1e-6


def check_weights(weights: Sequence[float], count: int, field_name: str = "pi") -> np.ndarray:
    """Convex weights: ``count`` finite numbers ≥ 0 summing to 1 (within 1e-6, then renormalised)."""
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise InvalidArgument(field_name, f"must be a list of {count} numbers, got {weights!r}")
    if len(weights) != count:
        raise InvalidArgument(field_name, f"must have one weight per model ({count}), got {len(weights)}")
    out = np.empty(count)
    for i, w in enumerate(weights):
        if (
            isinstance(w, bool)
            or not isinstance(w, (int, float, np.integer, np.floating))
            or not math.isfinite(float(w))
        ):
            raise InvalidArgument(f"{field_name}[{i}]", f"must be a finite number, got {w!r}")
        if w < 0:
            raise InvalidArgument(f"{field_name}[{i}]", f"must be >= 0, got {w!r}")
        out[i] = float(w)
    total = float(out.sum())
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise InvalidArgument(field_name, f"must sum to 1, got {total!r}")
    return out / total


def rs_profiles(
    models: Sequence[Model],
    *,
    adjacency: str | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> list[PrivacyProfile]:
    """The models' profiles under one adjacency: compute once, then pass them (instead of the
    models) to ``rs_epsilon`` / ``rs_delta`` / ``targets.choose_pi`` for every candidate π."""
    return privacy_profiles(
        models, adjacency, orders=orders, value_discretization_interval=value_discretization_interval
    )


def _weighted_profiles(models, pi, adjacency, orders, value_discretization_interval):
    """The models' profiles and π checked against them (what every RS bound starts from)."""
    profiles = rs_profiles(
        models, adjacency=adjacency, orders=orders, value_discretization_interval=value_discretization_interval
    )
    return profiles, check_weights(pi, len(profiles))


def rs_rdp(
    models: Sequence[Model],
    pi: Sequence[float],
    *,
    adjacency: str | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> np.ndarray:
    """RS RDP at every order."""
    profiles, pi = _weighted_profiles(models, pi, adjacency, orders, value_discretization_interval)
    return rdp_mixture(pi, [p.rdp for p in profiles], profiles[0].orders)


def rs_pld(
    models: Sequence[Model],
    pi: Sequence[float],
    *,
    adjacency: str | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> pldm.PLD:
    """The mixed PLD Σ π_i PLD_i (both directions)."""
    profiles, pi = _weighted_profiles(models, pi, adjacency, orders, value_discretization_interval)
    return pldm.mixture_pld([p.pld for p in profiles], pi)


def _rs_bounds(models, pi, adjacency, orders, interval):
    """The mixed PLD and the RDP bound of the RS release, with its orders."""
    profiles = rs_profiles(models, adjacency=adjacency, orders=orders, value_discretization_interval=interval)
    pi = check_weights(pi, len(profiles))
    mixed = pldm.mixture_pld([p.pld for p in profiles], pi)
    return mixed, profiles[0].orders, rdp_mixture(pi, [p.rdp for p in profiles], profiles[0].orders)


def rs_epsilon(
    models: Sequence[Model],
    pi: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> Epsilons:
    """ε of releasing θ_I, I ~ Cat(π), at ``delta``: PLD bound and RDP bound (no closed form)."""
    delta = check_delta(delta)
    mixed, orders, rdp = _rs_bounds(models, pi, adjacency, orders, value_discretization_interval)
    return Epsilons(pld=pld_epsilon(mixed, delta), rdp=rdp_to_epsilon(orders, rdp, delta))


def rs_delta(
    models: Sequence[Model],
    pi: Sequence[float],
    epsilon: float,
    *,
    adjacency: str | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> Deltas:
    """δ of the RS release at ``epsilon``: max over directions of Σ π_i δ_i(ε), and by RDP."""
    epsilon = check_epsilon(epsilon, zero=True)
    mixed, orders, rdp = _rs_bounds(models, pi, adjacency, orders, value_discretization_interval)
    return Deltas(pld=pld_delta(mixed, epsilon), rdp=rdp_to_delta(orders, rdp, epsilon))


__all__ = ["check_weights", "rs_delta", "rs_epsilon", "rs_pld", "rs_profiles", "rs_rdp"]
