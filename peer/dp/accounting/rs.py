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

These bounds hold when π is a function of public information only (the models' training records
and a prior the site declares). A π chosen from measured utilities of the models is a function of
those models, hence of the training records: such a release is charged instead as releasing every
model whose utility was read (``composition_epsilon``; ``targets.choose_pi_by_utility``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant, pld_of, rdp_of
from peer.dp.accounting.conversions import (
    Deltas,
    Epsilons,
    gdp_epsilon,
    pld_delta,
    pld_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
)
from peer.dp.accounting.events import RandomSelectionMerge
from peer.dp.accounting.profiles import Model, PrivacyProfile, model_rdp, privacy_profiles
from peer.dp.accounting.rdp import rdp_mixture
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord
from peer.dp.accounting.weights import check_subset, check_weights


def rs_profiles(
    models: Sequence[Model],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> list[PrivacyProfile]:
    """The models' profiles under one adjacency: compute once, then pass them (instead of the
    models) to ``rs_epsilon`` / ``rs_delta`` / ``targets.choose_pi`` for every candidate π."""
    return privacy_profiles(models, adjacency, accountant=accountant)


def _weighted_profiles(models, pi, adjacency, accountant):
    """The models' profiles and π checked against them (what every RS bound starts from)."""
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    return profiles, check_weights(pi, len(profiles))


def rs_rdp(
    models: Sequence[Model],
    pi: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> np.ndarray:
    """RS RDP at every order."""
    profiles, pi = _weighted_profiles(models, pi, adjacency, accountant)
    return rdp_mixture(pi, [p.rdp for p in profiles], profiles[0].orders)


def rs_pld(
    models: Sequence[Model],
    pi: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> pldm.PLD:
    """The mixed PLD Σ π_i PLD_i (both directions)."""
    profiles, pi = _weighted_profiles(models, pi, adjacency, accountant)
    return pldm.mixture_pld([p.pld for p in profiles], pi)


def _rs_bounds(models, pi, adjacency, accountant):
    """The mixed PLD and the RDP bound of the RS release, with its orders."""
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    pi = check_weights(pi, len(profiles))
    mixed = pldm.mixture_pld([p.pld for p in profiles], pi)
    return mixed, profiles[0].orders, rdp_mixture(pi, [p.rdp for p in profiles], profiles[0].orders)


def rs_epsilon(
    models: Sequence[Model],
    pi: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> Epsilons:
    """ε of releasing θ_I, I ~ Cat(π), at ``delta``: PLD bound and RDP bound (no closed form)."""
    delta = check_delta(delta)
    mixed, orders, rdp = _rs_bounds(models, pi, adjacency, accountant)
    return Epsilons(pld=pld_epsilon(mixed, delta), rdp=rdp_to_epsilon(orders, rdp, delta))


def rs_delta(
    models: Sequence[Model],
    pi: Sequence[float],
    epsilon: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> Deltas:
    """δ of the RS release at ``epsilon``: max over directions of Σ π_i δ_i(ε), and by RDP."""
    epsilon = check_epsilon(epsilon, zero=True)
    mixed, orders, rdp = _rs_bounds(models, pi, adjacency, accountant)
    return Deltas(pld=pld_delta(mixed, epsilon), rdp=rdp_to_delta(orders, rdp, epsilon))


def composition_bounds(
    models: Sequence[Model],
    subset: Sequence[int],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> tuple[pldm.PLD, np.ndarray, np.ndarray]:
    """(PLD, orders, RDP) of releasing every model of ``subset`` together: the models are
    independent DP-SGD runs (or (ε, δ) mechanisms) on the same records, so their PLDs compose and
    their RDP curves add (sequential composition)."""
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    chosen = check_subset(subset, len(profiles))
    plds = [profiles[i].pld for i in chosen]
    pld = plds[0] if len(plds) == 1 else pldm.compose_plds(plds, profiles[0].value_discretization_interval)
    rdp = np.sum([profiles[i].rdp for i in chosen], axis=0)
    return pld, profiles[0].orders, rdp


def composition_epsilon(
    models: Sequence[Model],
    subset: Sequence[int],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> Epsilons:
    """ε at ``delta`` of releasing every model of ``subset`` (``composition_bounds``): what a
    selection that read the measured utility of those models costs, whatever it then releases of
    them (the choice and the release are post-processing of releasing them all). Kept in memory
    for models given by their records (a daemon's pool asks for the same subsets again)."""
    delta = check_delta(delta)
    if all(isinstance(m, (TrainingRecord, ApproxDP)) for m in models):
        return _remembered_composition(
            tuple(models),
            check_subset(subset, len(models)),
            delta,
            adjacency,
            accountant,
        )
    return _composition_epsilon(models, subset, delta, adjacency, accountant)


@functools.lru_cache(maxsize=256)
def _remembered_composition(models, subset, delta, adjacency, accountant) -> Epsilons:
    return _composition_epsilon(models, subset, delta, adjacency, accountant)


def _composition_epsilon(models, subset, delta, adjacency, accountant) -> Epsilons:
    pld, grid, rdp = composition_bounds(models, subset, adjacency=adjacency, accountant=accountant)
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    mus = [profiles[i].mu for i in check_subset(subset, len(profiles))]
    closed = gdp_epsilon(math.sqrt(sum(m * m for m in mus)), delta) if all(m is not None for m in mus) else None
    return Epsilons(pld=pld_epsilon(pld, delta), rdp=rdp_to_epsilon(grid, rdp, delta), closed_form=closed)


# ---- the accountant's interpretation of an RS merge event -------------------------------------


def scored_rdp(accountant: Accountant, models: Sequence, scored: Sequence[int], adjacency: str) -> np.ndarray:
    """RDP of releasing every model of ``scored`` (what a utility selection costs): the sum of
    their curves (``profiles.model_rdp``: no PLD is built)."""
    out = []
    for i in scored:
        try:
            out.append(model_rdp(models[i], adjacency, accountant=accountant))
        except InvalidArgument as e:
            raise InvalidArgument(f"models[{i}].{e.field}", e.rule) from None
    return np.sum(out, axis=0)


def scored_pld(accountant: Accountant, models: Sequence, scored: Sequence[int], adjacency: str) -> pldm.PLD:
    """PLD of releasing every model of ``scored``: their PLDs composed."""
    profiles = privacy_profiles([models[i] for i in scored], adjacency, accountant=accountant)
    if len(profiles) == 1:
        return profiles[0].pld
    return pldm.compose_plds([p.pld for p in profiles], accountant.value_discretization_interval)


@rdp_of(RandomSelectionMerge)
def _rs_event_rdp(accountant: Accountant, e: RandomSelectionMerge) -> np.ndarray:
    if e.scored is not None:
        return scored_rdp(accountant, e.models, e.scored, e.adjacency)
    rdps = []
    for i, m in enumerate(e.models):
        try:
            rdps.append(model_rdp(m, e.adjacency, accountant=accountant))
        except InvalidArgument as err:
            raise InvalidArgument(f"models[{i}].{err.field}", err.rule) from None
    return rdp_mixture(np.asarray(e.pi), rdps, accountant.orders)


@pld_of(RandomSelectionMerge)
def _rs_event_pld(accountant: Accountant, e: RandomSelectionMerge) -> pldm.PLD:
    if e.scored is not None:
        return scored_pld(accountant, e.models, e.scored, e.adjacency)
    profiles = privacy_profiles(list(e.models), e.adjacency, accountant=accountant)
    return pldm.mixture_pld([p.pld for p in profiles], np.asarray(e.pi))


__all__ = [
    "check_subset",
    "check_weights",
    "composition_bounds",
    "composition_epsilon",
    "rs_delta",
    "rs_epsilon",
    "rs_pld",
    "rs_profiles",
    "rs_rdp",
]
