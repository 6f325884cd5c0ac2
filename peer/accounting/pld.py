"""Privacy loss distributions (PLDs) of PrivFusion's mechanisms, built with dp-accounting.

A PLD here is dp-accounting's ``PrivacyLossDistribution`` with *pessimistic* discretisation
(connect-the-dots, Doroshenko et al. 2022), so every δ(ε) read from it is an upper bound on the
hockey-stick divergence H_{e^ε}(P ‖ Q) of the mechanism's dominating pair. It keeps two
directions — dp-accounting calls them REMOVE (μ_upper = M(D), D' = D minus one record) and ADD —
and reports the larger δ of the two. Statements relied on:

- Composition: PLDs of adaptively composed mechanisms convolve (Koskela et al. 2020; Gopi et al.
  2021); dp-accounting's ``compose`` / ``self_compose`` do it by FFT with pessimistic tail handling.
- Gaussian mechanisms compose in closed form: T steps with ratios μ_t are one Gaussian with
  μ = sqrt(Σ μ_t²) (Dong, Roth & Su 2022, Cor. 3.3) — this is also how dp-accounting's own
  ``PLDAccountant`` composes ``GaussianDpEvent``s (σ/sqrt(count)).
- Mixture (random selection): for a fixed neighbouring pair, H_γ(Σπ_i P_i ‖ Σπ_i Q_i) ≤
  Σπ_i H_γ(P_i ‖ Q_i) by joint convexity of H_γ; the same holds per direction, so
  δ^RS(ε) ≤ max{Σπ_i δ_i^REMOVE(ε), Σπ_i δ_i^ADD(ε)}. dp-accounting's ``compute_mixture`` mixes
  the two directions' PMFs separately (``PrivacyLossDistribution.compute_mixture`` calls
  ``PLDPmf.compute_mixture`` on ``_pmf_remove`` and ``_pmf_add``), and δ is linear in the PMF, so
  the mixed PLD reports exactly this bound.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.privacy_accountant import NeighboringRelation

from peer.accounting.events import check_adjacency
from peer.errors import InvalidArgument

PLD = pldlib.PrivacyLossDistribution


def check_interval(value_discretization_interval: float) -> float:
    v = value_discretization_interval
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < float(v) <= 0.1):
        raise InvalidArgument("value_discretization_interval", f"must be in (0, 0.1], got {v!r}")
    return float(v)


def identity_pld(value_discretization_interval: float) -> PLD:
    """The PLD of a release that reveals nothing (δ(ε) = 0 for every ε ≥ 0)."""
    return pldlib.identity(value_discretization_interval=value_discretization_interval)


def non_private_pld(value_discretization_interval: float) -> PLD:
    """The PLD of a release without any guarantee: all mass at +∞, δ(ε) = 1."""
    return PLD.create_from_rounded_probability({0: 0.0}, 1.0, value_discretization_interval)


def directions(pld: PLD):
    """(REMOVE PMF, ADD PMF) of a PLD. dp-accounting 0.6.0 (pinned) keeps them as
    ``_pmf_remove`` / ``_pmf_add`` (the same object when symmetric); this is the one place we
    read them, to evaluate the two RS constraints separately."""
    return pld._pmf_remove, pld._pmf_add  # noqa: SLF001 — see docstring


def infinity_mass(pld: PLD) -> float:
    """P(privacy loss = +∞), the larger of the two directions."""
    remove, add = directions(pld)
    return max(float(remove._infinity_mass), float(add._infinity_mass))  # noqa: SLF001


def is_non_private(pld: PLD) -> bool:
    return infinity_mass(pld) >= 1.0


def directional_deltas(pld: PLD, epsilon: float | Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(δ_REMOVE(ε), δ_ADD(ε)), each clamped to [0, 1]."""
    remove, add = directions(pld)
    eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
    d_remove = np.clip(remove.get_delta_for_epsilon(eps), 0.0, 1.0)
    d_add = d_remove if add is remove else np.clip(add.get_delta_for_epsilon(eps), 0.0, 1.0)
    return np.asarray(d_remove, dtype=float), np.asarray(d_add, dtype=float)


def gaussian_pld(mu: float, value_discretization_interval: float) -> PLD:
    """PLD of a Gaussian mechanism whose sensitivity is μ times its noise std: N(0,1) vs N(μ,1)
    (symmetric, so it serves both adjacencies once μ carries the adjacency's sensitivity)."""
    if mu < 0 or math.isnan(mu):
        raise InvalidArgument("mu", f"must be >= 0, got {mu!r}")
    if mu == 0:
        return identity_pld(value_discretization_interval)
    if math.isinf(mu):
        return non_private_pld(value_discretization_interval)
    return pldlib.from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=value_discretization_interval)


def subsampled_gaussian_pld(noise_multiplier: float, sample_rate: float, adjacency: str,
                            value_discretization_interval: float) -> PLD:
    """PLD of one DP-SGD step: clipped sum (clip norm = unit sensitivity), noise std σ, Poisson
    rate q, under ``adjacency``. dp-accounting's pairs: add-remove, REMOVE: (1−q)N(0)+qN(−1) vs
    N(0) and ADD: N(0) vs (1−q)N(0)+qN(1); replace-one: (1−q)N(0)+qN(−1) vs (1−q)N(0)+qN(1)
    (at q = 1, N(−1) vs N(1): sensitivity 2, as the module ``events`` states)."""
    check_adjacency(adjacency)
    sigma, q = float(noise_multiplier), float(sample_rate)
    if sigma == 0:
        return non_private_pld(value_discretization_interval)
    relation = (NeighboringRelation.REPLACE_ONE if adjacency == "replace-one"
                else NeighboringRelation.ADD_OR_REMOVE_ONE)
    return pldlib.from_gaussian_mechanism(
        sigma, sensitivity=1.0, value_discretization_interval=value_discretization_interval,
        sampling_prob=q, neighboring_relation=relation)


def laplace_pld(epsilon: float, value_discretization_interval: float) -> PLD:
    """PLD of a Laplace mechanism with ε = sensitivity/scale (dp-accounting's 1-D pair, which
    also covers an L1-bounded vector with i.i.d. Laplace noise — dp-accounting's LaplaceDpEvent)."""
    if epsilon == 0:
        return identity_pld(value_discretization_interval)
    if math.isinf(epsilon):
        return non_private_pld(value_discretization_interval)
    return pldlib.from_laplace_mechanism(1.0 / epsilon, sensitivity=1.0,
                                         value_discretization_interval=value_discretization_interval)


def approx_dp_pld(epsilon: float, delta: float, value_discretization_interval: float) -> PLD:
    """Worst-case PLD of an (ε, δ)-DP mechanism (dp-accounting ``from_privacy_parameters``:
    +∞ w.p. δ, ±ε otherwise — randomised response with an extra δ of catastrophe). With δ = 0 it
    is exactly binary randomised response, the dominating pair of pure ε-DP."""
    return pldlib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(epsilon, delta),
                                          value_discretization_interval=value_discretization_interval)


def self_compose(pld: PLD, count: int) -> PLD:
    if count == 1 or is_non_private(pld):
        return pld
    return pld.self_compose(int(count))


def compose_plds(plds: Sequence[PLD], value_discretization_interval: float) -> PLD:
    """Sequential composition of all ``plds`` (pairwise, balanced so the large FFTs come last).
    Any non-private part makes the whole non-private."""
    items = list(plds)
    if not items:
        return identity_pld(value_discretization_interval)
    if any(is_non_private(p) for p in items):
        return non_private_pld(value_discretization_interval)
    while len(items) > 1:
        nxt = [items[i].compose(items[i + 1]) for i in range(0, len(items) - 1, 2)]
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0]


def mixture_pld(plds: Sequence[PLD], weights: Sequence[float]) -> PLD:
    """Σ_i w_i · PLD_i, direction by direction (the RS hockey-stick bound; module docstring)."""
    pairs = [(p, float(w)) for p, w in zip(plds, weights) if w > 0]
    if not pairs:
        raise InvalidArgument("pi", "must put positive weight on some model")
    mixed, total = pairs[0]
    for p, w in pairs[1:]:
        mixed = mixed.compute_mixture(p, total / (total + w))
        total += w
    return mixed
