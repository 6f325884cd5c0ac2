"""Per-model privacy profiles: RDP at every order and the PLD, under one explicit adjacency.

A profile is computed once per model and reused (RS mixes cached profiles for every candidate π;
only the mixture is recomputed). For a ``TrainingRecord``:

- steps are grouped by (σ_t, q_t) — one model's per-step privacy does not depend on η_t or C_t,
  which scale sensitivity and noise alike (``peer.dp.accounting.training_records``);
- full-batch steps form one Gaussian mechanism with μ = sqrt(Σ_t (k/σ_t)²), k = 1 (add-remove)
  or 2 (replace-one): its (ε, δ) curve is the closed form (μ-GDP), its RDP is order·μ²/2, and its
  PLD is dp-accounting's Gaussian PLD for that μ;
- each group of Poisson-subsampled steps is dp-accounting's subsampled-Gaussian PLD
  self-composed ``count`` times (FFT), and RDP ``count`` × per-step RDP;
- the parts are composed (PLD by FFT, RDP by addition).

An ``ApproxDP`` model's profile is the worst case of an (ε, δ)-DP mechanism (``pld.approx_dp_pld``;
RDP = that of randomised response when δ = 0, ∞ otherwise).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant, pld_of, rdp_of
from peer.dp.accounting.conversions import (
    Deltas,
    Epsilons,
    gdp_delta,
    gdp_epsilon,
    pld_delta,
    pld_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
)
from peer.dp.accounting.events import DpSgdTraining
from peer.dp.accounting.pld import DEFAULT_INTERVAL
from peer.dp.accounting.rdp import rdp_gaussian, rdp_pure, rdp_subsampled_gaussian
from peer.dp.accounting.training_records import ADJACENCIES, ApproxDP, TrainingRecord, check_adjacency

# profiles kept for models seen before (a daemon's pools, a ledger's records): at most this many
PROFILE_CACHE_SIZE = 32


@dataclass(frozen=True, eq=False)
class PrivacyProfile:
    """One model's privacy under ``adjacency``: ``rdp`` (one value per order in ``orders``), the
    ``pld``, and ``mu`` when the model is a full-batch Gaussian composition (μ-GDP), else None."""

    adjacency: str
    orders: tuple[float, ...]
    rdp: np.ndarray
    pld: pldm.PLD
    value_discretization_interval: float
    mu: float | None = None
    source: str = "dpsgd"

    @property
    def accountant(self) -> Accountant:
        """The accountant whose orders and discretisation the profile was built at."""
        return Accountant(self.orders, self.value_discretization_interval)

    def epsilon(self, delta: float) -> Epsilons:
        delta = check_delta(delta)
        return Epsilons(
            pld=pld_epsilon(self.pld, delta),
            rdp=rdp_to_epsilon(self.orders, self.rdp, delta),
            closed_form=None if self.mu is None else gdp_epsilon(self.mu, delta),
        )

    def delta(self, epsilon: float) -> Deltas:
        epsilon = check_epsilon(epsilon, zero=True)
        return Deltas(
            pld=pld_delta(self.pld, epsilon),
            rdp=rdp_to_delta(self.orders, self.rdp, epsilon),
            closed_form=None if self.mu is None else gdp_delta(self.mu, epsilon),
        )


Model = TrainingRecord | ApproxDP | PrivacyProfile


def model_adjacency(model: Model, field_name: str = "model") -> str:
    if isinstance(model, (TrainingRecord, ApproxDP, PrivacyProfile)):
        return model.adjacency
    raise InvalidArgument(
        field_name, f"must be a TrainingRecord, ApproxDP or PrivacyProfile, got {type(model).__name__}"
    )


def resolve_adjacency(models: Sequence[Model], adjacency: str | None) -> str:
    """The adjacency a merge of ``models`` is accounted under.

    Given explicitly, every model is accounted under it (TrainingRecords exactly, ApproxDP by
    ``ApproxDP.under``). Left out, all models must agree; a mix is refused, never guessed.
    """
    if not models:
        raise InvalidArgument("models", "must contain at least one model")
    found = [model_adjacency(m, f"models[{i}]") for i, m in enumerate(models)]
    if adjacency is not None:
        return check_adjacency(adjacency)
    if len(set(found)) > 1:
        groups = "; ".join(
            f"{a} for models {[i for i, f in enumerate(found) if f == a]}" for a in ADJACENCIES if a in found
        )
        raise InvalidArgument(
            "adjacency",
            f"models mix adjacencies ({groups}): pass adjacency='replace-one' or 'add-remove' to "
            "account them all under one unit (DP-SGD records are re-derived exactly; an "
            "add-remove (epsilon, delta) model converts to replace-one by group privacy)",
        )
    return found[0]


def _step_groups(record: TrainingRecord) -> Counter:
    groups: Counter = Counter()
    for step, count in record.runs:
        groups[(step.noise_multiplier, step.sample_rate)] += count
    return groups


def _full_batch_mu(groups: Counter, adjacency: str) -> float:
    """μ of the full-batch steps' Gaussian composition (sensitivity 2 replace-one, 1 add-remove)."""
    k = 2.0 if adjacency == "replace-one" else 1.0
    return math.sqrt(sum(count * (k / sigma) ** 2 for (sigma, q), count in groups.items() if q == 1.0))


def _training_rdp(record: TrainingRecord, adjacency: str, orders: np.ndarray) -> np.ndarray:
    # first: the numerical RDP integral of a near-noiseless Poisson step (grid step ≤ σ²/2√order)
    # is as hopeless as its PLD, and every profile starts here
    check_accountable(record, adjacency)
    groups = _step_groups(record)
    if any(sigma == 0 for sigma, _ in groups):
        return np.full(orders.shape, math.inf)
    rdp = rdp_gaussian(_full_batch_mu(groups, adjacency), orders)
    for (sigma, q), count in sorted(groups.items()):
        if q != 1.0:
            rdp = rdp + count * rdp_subsampled_gaussian(sigma, q, orders, adjacency)
    return rdp


def check_accountable(
    record: TrainingRecord, adjacency: str | None = None, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> None:
    """Refuse (InvalidArgument naming the steps' noise multiplier) a training record whose PLD
    would need a grid of more than ``pld.MAX_PMF_BINS`` bins for one of its Gaussian parts (the
    full-batch steps' composition N(0,1) vs N(μ,1), or one subsampled step): called before a
    profile is built and before DP-SGD trains, so that a near-noiseless run is refused at once
    instead of the accountant taking minutes and gigabytes after the training. Cheap: bounds
    only, no PMF is built. σ = 0 is not refused (its profile is the non-private one, exactly).
    The grid is that of ``accountant``'s discretisation."""
    _check_grid(record, adjacency, accountant.value_discretization_interval)


def _check_grid(record: TrainingRecord, adjacency: str | None, interval: float) -> None:
    adjacency = check_adjacency(record.adjacency if adjacency is None else adjacency)
    groups = _step_groups(record)
    if any(sigma == 0 for sigma, _ in groups):
        return
    mu_full = _full_batch_mu(groups, adjacency)
    if mu_full > 0:
        bins, lo, hi = pldm.gaussian_pmf_bins(1.0, mu_full, interval)
        count = sum(c for (_, q), c in groups.items() if q == 1.0)
        pldm.check_grid(
            "training.steps.noise_multiplier",
            f"the {count} full-batch steps compose to a Gaussian mechanism of μ = {mu_full:.4g}",
            bins,
            lo,
            hi,
            interval,
        )
    sens = 2.0 if adjacency == "replace-one" else 1.0
    relation = (
        pldm.NeighboringRelation.REPLACE_ONE
        if adjacency == "replace-one"
        else pldm.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    for sigma, q in sorted(groups):
        if q != 1.0:
            # the PMFs pld.subsampled_gaussian_pld builds (noise σ, sensitivity 1 per direction)
            bins, lo, hi = pldm.gaussian_pmf_bins(sigma, 1.0, interval, q, relation)
            pldm.check_grid(
                "training.steps.noise_multiplier",
                f"a step of noise multiplier {sigma:g} at sample rate {q:g} (sensitivity {sens:g})",
                bins,
                lo,
                hi,
                interval,
            )


def _training_profile(record: TrainingRecord, adjacency: str, orders: np.ndarray, interval: float) -> PrivacyProfile:
    groups = _step_groups(record)
    rdp = _derived_rdp(record, adjacency, tuple(float(a) for a in orders))
    if any(sigma == 0 for sigma, _ in groups):
        return PrivacyProfile(adjacency, tuple(orders), rdp, pldm.non_private_pld(interval), interval, math.inf)
    _check_grid(record, adjacency, interval)  # at this interval (the RDP gate used the default)
    mu_full = _full_batch_mu(groups, adjacency)
    parts = [pldm.gaussian_pld(mu_full, interval)] if mu_full > 0 else []
    for (sigma, q), count in sorted(groups.items()):
        if q != 1.0:
            parts.append(pldm.self_compose(pldm.subsampled_gaussian_pld(sigma, q, adjacency, interval), count))
    full_batch = all(q == 1.0 for _, q in groups)
    return PrivacyProfile(
        adjacency, tuple(orders), rdp, pldm.compose_plds(parts, interval), interval, mu_full if full_batch else None
    )


def _approx_rdp(model: ApproxDP, adjacency: str, orders: np.ndarray) -> np.ndarray:
    m = model.under(adjacency)
    return rdp_pure(m.epsilon, orders) if m.delta == 0 else np.full(orders.shape, math.inf)


def _approx_profile(model: ApproxDP, adjacency: str, orders: np.ndarray, interval: float) -> PrivacyProfile:
    m = model.under(adjacency)
    return PrivacyProfile(
        adjacency,
        tuple(orders),
        _derived_rdp(model, adjacency, tuple(float(a) for a in orders)),
        pldm.approx_dp_pld(m.epsilon, m.delta, interval),
        interval,
        None,
        source="approx-dp",
    )


def model_rdp(model: Model, adjacency: str | None = None, *, accountant: Accountant = DEFAULT_ACCOUNTANT) -> np.ndarray:
    """A model's RDP curve at ``accountant``'s orders alone (read-only), without building its PLD:
    what an RDP filter needs (the ledger uses its own orders, so a full profile would be built anew)."""
    adjacency = check_adjacency(model_adjacency(model) if adjacency is None else adjacency)
    if isinstance(model, PrivacyProfile):
        return privacy_profile(model, adjacency, accountant=model.accountant.with_orders(accountant.orders)).rdp
    return _derived_rdp(model, adjacency, tuple(float(a) for a in accountant.orders))


@functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)
def _derived_rdp(model: TrainingRecord | ApproxDP, adjacency: str, orders: tuple[float, ...]) -> np.ndarray:
    grid = np.asarray(orders)
    rdp = _approx_rdp(model, adjacency, grid) if isinstance(model, ApproxDP) else _training_rdp(model, adjacency, grid)
    rdp = np.array(rdp, dtype=float)
    rdp.flags.writeable = False
    return rdp


def privacy_profile(
    model: Model, adjacency: str | None = None, *, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> PrivacyProfile:
    """The privacy profile of one model under ``adjacency`` (default: the model's own), at
    ``accountant``'s orders and discretisation.

    A ``PrivacyProfile`` passes through when its adjacency, orders and interval match (it cannot
    be re-derived for another adjacency: the mechanism is gone by then).
    """
    orders = accountant.orders
    interval = accountant.value_discretization_interval
    adjacency = check_adjacency(model_adjacency(model) if adjacency is None else adjacency)
    if isinstance(model, PrivacyProfile):
        if model.adjacency != adjacency:
            raise InvalidArgument(
                "adjacency",
                f"a precomputed profile is for {model.adjacency}; recompute it from the model for {adjacency}",
            )
        if tuple(orders) != tuple(model.orders) or model.value_discretization_interval != interval:
            raise InvalidArgument(
                "orders", "a precomputed profile must use the same orders and value_discretization_interval"
            )
        return model
    if isinstance(model, (ApproxDP, TrainingRecord)):
        orders_t = tuple(float(a) for a in orders)
        known = remembered_profile(model, adjacency, accountant)
        return known if known is not None else _derived_profile(model, adjacency, orders_t, interval)
    raise InvalidArgument("model", f"must be a TrainingRecord, ApproxDP or PrivacyProfile, got {type(model).__name__}")


# profiles handed in by ``peer.dp.accounting.profile_cache`` (read from disk, or built and stored
# there): consulted before building, at most PROFILE_CACHE_SIZE of them, least recently used out
_REMEMBERED: OrderedDict = OrderedDict()
_REMEMBERED_LOCK = threading.Lock()


def _settings(accountant: Accountant) -> tuple[tuple[float, ...], float]:
    return tuple(float(a) for a in accountant.orders), accountant.value_discretization_interval


def remembered_profile(
    model: TrainingRecord | ApproxDP, adjacency: str, accountant: Accountant
) -> PrivacyProfile | None:
    """The profile kept by :func:`remember_profile` for (model, adjacency, accountant), or None."""
    key = (model, adjacency, *_settings(accountant))
    with _REMEMBERED_LOCK:
        found = _REMEMBERED.get(key)
        if found is not None:
            _REMEMBERED.move_to_end(key)
        return found


def remember_profile(
    model: TrainingRecord | ApproxDP,
    adjacency: str,
    accountant: Accountant,
    profile: PrivacyProfile,
) -> None:
    """Keep ``profile`` as the profile of (model, adjacency, accountant) for later calls.
    The caller vouches that it is (``profile_cache`` checks a stored PLD before handing it in)."""
    orders, interval = _settings(accountant)
    if (profile.adjacency, profile.orders, profile.value_discretization_interval) != (adjacency, orders, interval):
        raise InvalidArgument("profile", "must be for the adjacency, orders and interval it is remembered under")
    with _REMEMBERED_LOCK:
        _REMEMBERED[(model, adjacency, orders, interval)] = profile
        _REMEMBERED.move_to_end((model, adjacency, orders, interval))
        while len(_REMEMBERED) > PROFILE_CACHE_SIZE:
            _REMEMBERED.popitem(last=False)


def forget_profiles() -> None:
    """Drop every remembered and every built profile (tests; a process that wants cold timings)."""
    with _REMEMBERED_LOCK:
        _REMEMBERED.clear()
    _derived_profile.cache_clear()
    _derived_rdp.cache_clear()


def profile_from_pld(
    model: TrainingRecord | ApproxDP,
    adjacency: str,
    accountant: Accountant,
    pld: pldm.PLD,
    rdp: np.ndarray,
) -> PrivacyProfile:
    """The profile of ``model`` at ``accountant``'s settings with a PLD and RDP curve obtained
    elsewhere (a checked disk cache entry); μ and the source are derived from the record as
    ``privacy_profile`` derives them."""
    orders, interval = _settings(accountant)
    if isinstance(model, ApproxDP):
        return PrivacyProfile(adjacency, orders, rdp, pld, interval, None, source="approx-dp")
    groups = _step_groups(model)
    if any(sigma == 0 for sigma, _ in groups):
        mu = math.inf
    elif all(q == 1.0 for _, q in groups):
        mu = _full_batch_mu(groups, adjacency)
    else:
        mu = None
    return PrivacyProfile(adjacency, orders, rdp, pld, interval, mu)


@functools.lru_cache(maxsize=PROFILE_CACHE_SIZE)
def _derived_profile(
    model: TrainingRecord | ApproxDP, adjacency: str, orders: tuple[float, ...], interval: float
) -> PrivacyProfile:
    """A model's profile, kept for the next request that names the same model: a daemon's pool
    is fixed, and a T = 10,000-step Poisson profile takes about half a second to build (PLD
    self-composition). Models are frozen dataclasses and so are the profiles (their RDP arrays
    are made read-only; PLDs are never changed in place, composition makes new ones)."""
    grid = np.asarray(orders)
    if isinstance(model, ApproxDP):
        return _approx_profile(model, adjacency, grid, interval)
    return _training_profile(model, adjacency, grid, interval)


def privacy_profiles(
    models: Sequence[Model], adjacency: str | None = None, *, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> list[PrivacyProfile]:
    """Profiles of several models under one adjacency (``resolve_adjacency``); identical models
    are profiled once."""
    adjacency = resolve_adjacency(models, adjacency)
    keys = [id(m) if isinstance(m, PrivacyProfile) else m for m in models]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)

    def one(i: int) -> PrivacyProfile:
        try:
            return privacy_profile(models[i], adjacency, accountant=accountant)
        except InvalidArgument as e:
            raise InvalidArgument(f"models[{i}].{e.field}", e.rule) from None

    built = dict(zip(first, parallel_map(one, list(first.values())), strict=True))
    return [built[key] for key in keys]


def parallel_map(fn, items: list) -> list:
    """``[fn(x) for x in items]`` on up to ``PROFILE_WORKERS`` threads (in order; the first
    exception is raised). Building a profile is mostly FFTs and NumPy array work, which release
    the GIL: five T = 10,000 Poisson profiles take 1.0 s on one thread and 0.64 s on two here."""
    workers = min(len(items), PROFILE_WORKERS)
    if workers <= 1:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="profile") as ex:
        return list(ex.map(fn, items))


PROFILE_WORKERS = max(1, min(4, os.cpu_count() or 1))


def model_epsilon(
    model: Model, delta: float, *, adjacency: str | None = None, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> Epsilons:
    """ε of one model at ``delta`` by PLD, RDP and (full batch) the closed form."""
    return privacy_profile(model, adjacency, accountant=accountant).epsilon(delta)


def model_delta(
    model: Model, epsilon: float, *, adjacency: str | None = None, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> Deltas:
    return privacy_profile(model, adjacency, accountant=accountant).delta(epsilon)


@rdp_of(DpSgdTraining)
def _dpsgd_rdp(accountant: Accountant, e: DpSgdTraining) -> np.ndarray:
    return model_rdp(e.training, e.adjacency, accountant=accountant)


@pld_of(DpSgdTraining)
def _dpsgd_pld(accountant: Accountant, e: DpSgdTraining) -> pldm.PLD:
    return privacy_profile(e.training, e.adjacency, accountant=accountant).pld


__all__ = [
    "DEFAULT_INTERVAL",
    "PrivacyProfile",
    "model_delta",
    "model_epsilon",
    "privacy_profile",
    "privacy_profiles",
    "resolve_adjacency",
]
