"""Choosing merge weights for a target (ε′, δ′): π for RS, λ for LC.

Pure functions of the pool's mechanism descriptions and of utilities given by the caller; no
model weights are read here.

Every choice is public or charged. The RS bound (``rs``) and the LC bound (``lc``) hold for
weights fixed independently of the training records. A weight chosen from the *measured* utility
of a pool model (its accuracy on a validation split, however public that split) is not: the
model is a function of the training records, so its score is too, and so is a π or λ chosen by
it. (Two models, b with μ = 8 and a with μ = 0.1, target (2, 1e-5): whether π_b > 0 then tells
neighbouring datasets apart with probability 0.99995 against 0.00005, ε ≥ 8.19 against a record
that said 2.) So there are two selections, and the record says which was used:

- **public prior** (the default; ``choose_pi`` / ``choose_lam`` with the prior as utilities):
  the utilities are a prior the site declares (per-model numbers, or a function of λ computed
  from public information only), or by default ``privacy_prior``: each model's own ε at δ (a
  model trained with less noise is presumed the more useful). A function of the training records'
  privacy parameters only, so the RS / LC bound of the chosen weights is the whole cost.
- **charged utility selection** (opt-in; ``choose_pi_by_utility`` / ``choose_lam_by_utility``):
  a public subset S of models is fixed first (``scored_subset``: among the subsets whose
  composition meets the target, the one with the largest total prior); only S's models are
  scored, and the best is released. The choice and the release are post-processing of releasing
  every model of S, so the release is charged their composition (PLDs composed, RDP summed) —
  proven for any training and any scoring rule. RS then puts all of π on the best scored model
  (mixing can only lower the expected score at that cost); LC searches λ on S's face.

Why not a cheaper private selection. Report-noisy-max / the exponential mechanism need a score
with bounded sensitivity per training record *and* a fresh release of the selected candidate; here
the selected model is the very one that was scored, and a validation score of a privately
trained model has no useful sensitivity per training record (one record can move the whole
model, so only the trivial bound of the score's range holds, and the released weights are not a
fresh run). Private hyperparameter selection (Liu & Talwar 2019; Papernot & Steinke 2022) needs
i.i.d. repetitions of one mechanism, run a *random* number of times; a pool is a fixed set of
different, already trained models. Neither proof applies, so neither is implemented.

RS (``choose_pi``). The expected utility Σ π_i u_i is linear in π, and so are both constraints:

- PLD: ε^RS(π) ≤ E ⇔ δ^RS(E; π) ≤ δ ⇔ Σ π_i δ_i^REMOVE(E) ≤ δ and Σ π_i δ_i^ADD(E) ≤ δ (δ(ε) is
  non-increasing, and ε(δ) is the smallest ε with δ(ε) ≤ δ). So the best π is a linear program
  over the simplex with two constraints, solved exactly (HiGHS); its optimum saturates the budget
  whenever the most useful model alone is not private enough.
- RDP: for each order, ε_order^RS(π) + log1p(−1/order) − log(δ·order)/(order−1) ≤ E is
  Σ π_i exp((order−1)(ε_order,i − E_order)) ≤ 1 with E_order = E − log1p(−1/order) +
  log(δ·order)/(order−1): one linear constraint, whose optimum over the simplex has at most two
  non-zero weights (enumerated in log space). The best order wins.

LC (``choose_lam``). The charged privacy of θ_λ (``lc``) is, for models trained by DP-SGD on
networks, the composition of the models with λ_i > 0: it does not depend on λ beyond its
support. So the choice is which subset S of models to combine (and λ over S): maximise the
utility over every λ whose support S has a composition meeting (E, δ) by the chosen ε
figure (``choose_lam_composition``). Composition grows with S, so the feasible subsets are
closed under taking subsets; the search enumerates them (pools are small: at most
``MAX_LC_MODELS``), and for each maximal feasible S runs a simplex grid on its face. With a linear
proxy Σ λ_i u_i the optimum is a vertex — the most useful single model whose own ε meets the
target: without evaluating combinations there is no reason to combine. LC then pays off only when
a measured combination beats every single model and RS at the same composition cost.

Only when every model declares state-independent gradients is θ_λ charged by the per-step
surrogate μ(λ) (μ-GDP); then λ itself matters (``choose_lam_surrogate``): the target is met iff
μ(λ) ≤ μ* (the largest μ meeting (E, δ) by the chosen figure; the PLD figure is then checked
by FFT and μ* lowered if the pessimistic discretisation overshoots). μ(λ) is not convex, and the
utility of a combination cannot be known without evaluating it, so the search is a grid on the
simplex projected onto the feasible boundary by bisection towards the most private λ (docs/architecture.md:
"bisection or grid on the feasible boundary"), optionally polished by SLSQP for a linear proxy.
``choose_lam_surrogate`` on models that do not declare state independence returns a figure that
is not a bound (the merging experiment reports it as such).

The caller gives either per-model utilities (linear proxy Σ λ_i u_i — what ``privfusion account``
uses, because M.json holds no weights) or a callable evaluating a candidate λ. Either must be
public (a declared prior) unless the choice is charged (``choose_lam_by_utility``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import Any

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant
from peer.dp.accounting.conversions import Epsilons, gdp_mu, json_number, rdp_to_epsilon
from peer.dp.accounting.lc import (
    DEFAULT_MAX_GROUPS,
    LCSegments,
    check_lc_models,
    lc_composition_epsilon,
    lc_segments,
    lc_surrogate_epsilon,
    surrogate_is_bound,
)
from peer.dp.accounting.profiles import Model, PrivacyProfile
from peer.dp.accounting.rdp import rdp_gaussian
from peer.dp.accounting.rs import check_subset, composition_epsilon, rs_epsilon, rs_profiles
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord
from peer.dp.accounting.weights import SELECTIONS

optimize = LazyModule("scipy.optimize")  # imported at the first root-find (~0.8 s of CPU to import)

#: the ε figure a target is met by: "pld" (tight, numerical) or "rdp" (the RDP conversion)
FIGURES = ("pld", "rdp")
#: where a public prior comes from: declared by the site, or the default proxy (``privacy_prior``)
PRIORS = ("declared", "epsilon")
# LC under the composition bound enumerates subsets of the pool (2^k − 1 of them)
MAX_LC_MODELS = 12
Utility = Sequence[float] | Callable[[np.ndarray], float]


class UnreachableTarget(InvalidArgument):
    """No weighting of the pool meets the target; ``most_private_epsilon`` is the best reachable.

    Every target at or above it is reachable (a larger ε only widens the feasible weights), so
    the pool's reachable range at this δ is [most_private_epsilon, ∞); the refusal carries it
    (reason ``TARGET_UNREACHABLE``, metadata ``reachable_epsilon_min`` / ``_max``) so the
    requester can ask again at a target the pool can serve. It is public: a function of the
    pool's published privacy profiles, not of the data."""

    def __init__(self, method: str, target_epsilon: float, delta: float, figure: str, most_private_epsilon: float):
        self.method = method
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.figure = figure
        self.most_private_epsilon = most_private_epsilon
        super().__init__(
            "target_epsilon",
            f"no {method.upper()} weighting of these models reaches epsilon <= {target_epsilon:g} at delta = {delta:g} "
            f"({figure}); the most private reachable is epsilon = {most_private_epsilon:.6g}",
            reason="TARGET_UNREACHABLE",
            metadata={
                "method": method,
                "accountant": figure,  # the key docs/wire.md documents for TARGET_UNREACHABLE
                "target_epsilon": float(target_epsilon),
                "delta": float(delta),
                "reachable_epsilon_min": float(most_private_epsilon),
                "reachable_epsilon_max": math.inf,
            },
        )


@dataclass(frozen=True)
class WeightChoice:
    """The chosen weights (``pi`` for RS, ``lam`` for LC) and what they achieve. For LC, ``bound``
    names the bound ``epsilon`` is ("composition" or "surrogate"); ``saturated`` means, for the
    surrogate, that μ(λ) is on the target's boundary, and for the composition, that no model
    outside λ's support could be added within the target."""

    method: str
    weights: tuple[float, ...]
    target_epsilon: float
    delta: float
    figure: str
    epsilon: Epsilons
    utility: float
    saturated: bool
    bound: str | None = None
    #: how the weights were chosen, as the release record states it (``Selection.to_dict``); None
    #: when the caller of ``choose_*`` has not said (``peer.dp.merging`` always does)
    selection: Mapping[str, Any] | None = None

    def to_dict(self) -> dict:
        out = {
            "method": self.method,
            "weights": list(self.weights),
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.figure,  # the serialised key, unchanged from records written before
            "epsilon": self.epsilon.to_dict(),
            "utility": json_number(self.utility),
            "saturated": self.saturated,
        }
        if self.bound is not None:
            out["bound"] = self.bound
        if self.selection is not None:
            out["selection"] = _plain(self.selection)
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_figure(figure: str) -> str:
    if figure not in FIGURES:
        raise InvalidArgument("figure", f"must be one of {FIGURES}, got {figure!r}")
    return figure


def _check_utilities(utilities: Sequence[float], count: int) -> np.ndarray:
    if isinstance(utilities, (str, bytes)) or not hasattr(utilities, "__len__") or len(utilities) != count:
        raise InvalidArgument("utilities", f"must give one number per model ({count})")
    out = np.empty(count)
    for i, u in enumerate(utilities):
        if (
            isinstance(u, bool)
            or not isinstance(u, (int, float, np.integer, np.floating))
            or not math.isfinite(float(u))
        ):
            raise InvalidArgument(f"utilities[{i}]", f"must be a finite number, got {u!r}")
        out[i] = float(u)
    return out


def _clean(weights: np.ndarray) -> np.ndarray:
    w = np.where(weights < 1e-12, 0.0, weights)
    return w / w.sum()


# ----------------------------------------------------------------------------------------- RS


def _rs_lp(coeffs: np.ndarray, utilities: np.ndarray, bound: float) -> np.ndarray | None:
    """argmax u·π over the simplex subject to coeffs @ π ≤ bound (rows: the two directions).

    Rows are scaled by 1/bound (HiGHS' feasibility tolerance is absolute, ~1e-7, while δ may be
    1e-10), and the solution is then repaired exactly: if a row still exceeds the bound, the
    solution is mixed with the most private π (``_rs_min_t``), just enough."""
    scaled = coeffs / bound
    res = optimize.linprog(
        -utilities,
        A_ub=scaled,
        b_ub=np.ones(coeffs.shape[0]),
        A_eq=np.ones((1, utilities.size)),
        b_eq=[1.0],
        bounds=[(0, None)] * utilities.size,
        method="highs",
    )
    if res.status != 0:
        return None
    pi = _clean(np.clip(res.x, 0, None))
    load = scaled @ pi
    if np.all(load <= 1.0):
        return pi
    _t_min, pi_min = _rs_min_t(coeffs, bound)
    load_min = scaled @ pi_min
    if np.any(load_min >= 1.0):
        return None
    over = load > 1.0
    tau = float(np.max((load[over] - 1.0) / (load[over] - load_min[over])))
    return _clean((1 - tau) * pi + tau * pi_min)


def _rs_min_t(coeffs: np.ndarray, delta: float) -> tuple[float, np.ndarray]:
    """(t, π): π minimises max(coeffs @ π) over the simplex and t is that maximum divided by
    delta, so some π meets δ iff t ≤ 1 (rows scaled by 1/δ for the solver's absolute tolerance)."""
    coeffs = coeffs / delta
    k = coeffs.shape[1]
    c = np.zeros(k + 1)
    c[-1] = 1.0
    a_ub = np.hstack([coeffs, -np.ones((coeffs.shape[0], 1))])
    a_eq = np.hstack([np.ones((1, k)), np.zeros((1, 1))])
    res = optimize.linprog(
        c,
        A_ub=a_ub,
        b_ub=np.zeros(coeffs.shape[0]),
        A_eq=a_eq,
        b_eq=[1.0],
        bounds=[(0, None)] * k + [(None, None)],
        method="highs",
    )
    pi = _clean(np.clip(res.x[:k], 0, None))
    return float(np.max(coeffs @ pi)), pi


def _pld_coeffs(profiles: Sequence[PrivacyProfile], epsilon: float) -> np.ndarray:
    rows = [pldm.directional_deltas(p.pld, epsilon) for p in profiles]
    return np.array([[r[0][0] for r in rows], [r[1][0] for r in rows]])


def rs_most_private_epsilon(profiles: Sequence[PrivacyProfile], delta: float, figure: str = "pld") -> float:
    """min over π of ε^RS(π). RDP: the most private single model (for each order the mixture's
    log-sum-exp is smallest at a vertex). PLD: bisection on E of the LP feasibility
    min_π max_direction Σ π_i δ_i^direction(E) ≤ δ (a mixture can beat every single model when
    the models are private in different directions)."""
    delta = check_delta(delta)
    singles = [p.epsilon(delta) for p in profiles]
    if figure == "rdp":
        return min(s.rdp for s in singles)

    def feasible(e: float) -> bool:
        return _rs_min_t(_pld_coeffs(profiles, e), delta)[0] <= 1.0

    if feasible(0.0):
        return 0.0
    lo, hi = 0.0, min(s.pld for s in singles)
    if math.isinf(hi):
        hi = 1.0
        while not feasible(hi):
            lo, hi = hi, 2 * hi
            if hi > 1e6:
                return math.inf
    while hi - lo > 1e-7 * max(hi, 1e-9):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _rs_rdp_choice(
    profiles: Sequence[PrivacyProfile], utilities: np.ndarray, target: float, delta: float
) -> np.ndarray | None:
    orders = np.asarray(profiles[0].orders)
    rdp = np.array([p.rdp for p in profiles])  # k × orders
    best, best_value = None, -math.inf
    for j, a in enumerate(orders):
        if a <= 1.01:
            continue  # compute_epsilon's improved bound needs order > 1.01
        e_order = target - math.log1p(-1 / a) + math.log(delta * a) / (a - 1)
        with np.errstate(invalid="ignore"):
            log_w = (a - 1) * (rdp[:, j] - e_order)  # log of the constraint coefficients
        log_w = np.where(np.isnan(log_w), math.inf, log_w)
        feasible = np.flatnonzero(log_w <= 0)
        if feasible.size == 0:
            continue
        i0 = feasible[np.argmax(utilities[feasible])]
        if utilities[i0] > best_value:
            best_value, best = utilities[i0], np.eye(len(profiles))[i0]
        for i in feasible:
            for jj in np.flatnonzero((log_w > 0) & (utilities > utilities[i])):
                # π_jj = (1 − w_i)/(w_jj − w_i), in log space (w_jj may overflow).
                if math.isinf(log_w[jj]):
                    continue
                w_i = math.exp(log_w[i])
                log_pj = (
                    math.log1p(-w_i) - log_w[jj] - math.log1p(-math.exp(log_w[i] - log_w[jj])) if w_i < 1 else -math.inf
                )
                pj = math.exp(log_pj) * (1 - 1e-12)
                value = (1 - pj) * utilities[i] + pj * utilities[jj]
                if value > best_value:
                    best_value = value
                    best = np.zeros(len(profiles))
                    best[i], best[jj] = 1 - pj, pj
    return best


def choose_pi(
    models: Sequence[Model],
    utilities: Sequence[float],
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> WeightChoice:
    """π maximising Σ π_i utilities_i subject to ε^RS(π) ≤ target_epsilon at ``delta`` by
    ``figure`` ("pld" or "rdp"); exact (linear programming, module docstring).

    ``models`` may be precomputed ``PrivacyProfile``s (``rs.rs_profiles``): nothing per-model is
    recomputed then. Raises ``UnreachableTarget`` (with the most private reachable ε) when no π
    meets the target."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    figure = _check_figure(figure)
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    u = _check_utilities(utilities, len(profiles))
    pi = None
    if figure == "pld":
        coeffs = _pld_coeffs(profiles, target)
        for shrink in (1e-9, 1e-6, 1e-3):
            pi = _rs_lp(coeffs, u, delta * (1 - shrink))
            if pi is None:
                break
            achieved = rs_epsilon(profiles, pi, delta, accountant=accountant)
            if achieved.pld <= target:
                break
        else:
            pi = None
        saturated = pi is not None and float(np.max(coeffs @ pi)) >= delta * (1 - 1e-6)
    else:
        pi = _rs_rdp_choice(profiles, u, target, delta)
        if pi is not None:
            pi = _clean(pi)
            achieved = rs_epsilon(profiles, pi, delta, accountant=accountant)
            if achieved.rdp > target:
                pi = None
        saturated = pi is not None and achieved.rdp >= target * (1 - 1e-6)
    if pi is None:
        raise UnreachableTarget("rs", target, delta, figure, rs_most_private_epsilon(profiles, delta, figure))
    return WeightChoice(
        "rs", tuple(float(x) for x in pi), target, delta, figure, achieved, float(u @ pi), bool(saturated)
    )


# ------------------------------------------------------------------------------ selection


@dataclass(frozen=True)
class Selection:
    """How a merge's weights were chosen, as its record states it (parameters["selection"]).

    ``kind`` "public-prior": the weights are a function of the models' training records and of
    ``prior`` ("declared" by the site, or "epsilon": ``privacy_prior``), whose per-model values are
    ``prior_utilities`` (None for a declared prior that is a function of λ); the RS / LC bound of
    the weights is the charge. ``kind`` "utility": the measured utilities of the models ``scored``
    (indices into the merge's models, a public subset) were read, and the release is charged the
    composition of those models."""

    kind: str
    prior: str
    prior_utilities: tuple[float, ...] | None = None
    scored: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in SELECTIONS:
            raise InvalidArgument("selection", f"must be one of {SELECTIONS}, got {self.kind!r}")
        if self.prior not in PRIORS:
            raise InvalidArgument("prior", f"must be one of {PRIORS}, got {self.prior!r}")
        if self.kind == "utility" and not self.scored:
            raise InvalidArgument("scored", "a utility selection names the models whose utility it read")
        if self.kind == "public-prior" and self.scored:
            raise InvalidArgument("scored", "a public-prior selection reads no measured utility")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "prior": self.prior}
        if self.prior_utilities is not None:
            out["prior_utilities"] = [float(u) for u in self.prior_utilities]
        if self.kind == "utility":
            out["scored"] = [int(i) for i in self.scored]
            out["charged"] = "composition of the scored models"
        return out


def privacy_prior(
    models: Sequence[Model],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> list[float]:
    """The default public prior: each model's own ε at ``delta`` by PLD (finite; a model that is
    not private at all gets 1e9). A model trained with less noise is presumed the more useful; a
    function of the training records only. A site whose models do not follow that order declares
    its own prior (``peer.dp.merging``)."""
    delta = check_delta(delta)
    if all(isinstance(m, (TrainingRecord, ApproxDP)) for m in models):
        # kept in memory: a daemon's pool asks for the same prior at every request
        return list(_remembered_prior(tuple(models), delta, adjacency, accountant))
    return list(_privacy_prior(models, delta, adjacency, accountant))


@functools.lru_cache(maxsize=64)
def _remembered_prior(models, delta, adjacency, accountant) -> tuple[float, ...]:
    return _privacy_prior(models, delta, adjacency, accountant)


def _privacy_prior(models, delta, adjacency, accountant) -> tuple[float, ...]:
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    return tuple(min(float(p.epsilon(delta).pld), 1e9) for p in profiles)


def scored_subset(
    models: Sequence[Model],
    prior: Sequence[float],
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> tuple[tuple[int, ...], Epsilons]:
    """The public subset S of models a charged utility selection may score, and the ε of its
    composition: among the subsets whose composition meets (target_epsilon, delta) by
    ``figure``, the one with the largest total ``prior`` (ties: more models, then the first in
    pool order). A function of the training records and the prior only. Supersets of a subset
    that misses the target are skipped (composition only grows). Raises ``UnreachableTarget``
    when no single model meets the target."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    figure = _check_figure(figure)
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    k = len(profiles)
    if k > MAX_LC_MODELS:
        raise InvalidArgument(
            "models", f"a utility selection searches subsets of the pool: at most {MAX_LC_MODELS} models, got {k}"
        )
    u = _check_utilities(prior, k)

    def by_figure(e: Epsilons) -> float:
        return e.pld if figure == "pld" else e.rdp

    feasible: dict[tuple[int, ...], Epsilons] = {}
    singles = []
    for size in range(1, k + 1):
        found = False
        for subset in itertools.combinations(range(k), size):
            if size > 1 and any(sub not in feasible for sub in itertools.combinations(subset, size - 1)):
                continue
            eps = composition_epsilon(
                models,
                subset,
                delta,
                adjacency=adjacency,
                accountant=accountant,
            )
            if size == 1:
                singles.append(by_figure(eps))
            if by_figure(eps) <= target:
                feasible[subset] = eps
                found = True
        if not found:
            break
    if not feasible:
        raise UnreachableTarget("rs", target, delta, figure, min(singles))
    best = max(feasible, key=lambda sub: (float(u[list(sub)].sum()), len(sub), tuple(-i for i in sub)))
    return best, feasible[best]


def _scores(utility: Sequence[float] | Callable[[int], float], scored: tuple[int, ...], k: int) -> dict[int, float]:
    """The measured utilities of the scored models only (a callable is called for them alone)."""
    if callable(utility):
        out = {}
        for i in scored:
            v = utility(i)
            out[i] = float(_check_utilities([v], 1)[0])
        return out
    u = _check_utilities(utility, k)
    return {i: float(u[i]) for i in scored}


def choose_pi_by_utility(
    models: Sequence[Model],
    utility: Sequence[float] | Callable[[int], float],
    target_epsilon: float,
    delta: float,
    *,
    prior: Sequence[float] | None = None,
    prior_name: str = "epsilon",
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> WeightChoice:
    """RS with charged utility selection (module docstring): S = ``scored_subset`` by ``prior``
    (default ``privacy_prior``), then π = all weight on the model of S with the largest measured
    ``utility`` (``utility(i)`` is called for the models of S only; a list is read at S only).
    ``epsilon`` is the composition of S — what the release is charged."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
    k = len(profiles)
    if prior is None:
        prior, prior_name = (
            privacy_prior(profiles, delta, accountant=accountant),
            "epsilon",
        )
    prior_u = _check_utilities(prior, k)
    scored, achieved = scored_subset(
        models,
        prior_u,
        target,
        delta,
        figure=figure,
        adjacency=adjacency,
        accountant=accountant,
    )
    scores = _scores(utility, scored, k)
    best = max(scored, key=lambda i: (scores[i], prior_u[i], -i))
    pi = np.eye(k)[best]
    selection = Selection("utility", prior_name, tuple(float(x) for x in prior_u), scored)
    return WeightChoice(
        "rs",
        tuple(float(x) for x in pi),
        target,
        delta,
        _check_figure(figure),
        achieved,
        scores[best],
        False,
        selection=selection.to_dict(),
    )


# ----------------------------------------------------------------------------------------- LC


def lc_mu_for_target(
    target_epsilon: float, delta: float, figure: str = "pld", accountant: Accountant = DEFAULT_ACCOUNTANT
) -> float:
    """The largest μ whose Gaussian mechanism meets (target_epsilon, delta) by ``figure``:
    the exact μ-GDP inversion ("pld") or the RDP curve order·μ²/2 at ``accountant``'s orders
    with the improved conversion ("rdp", bisection on the increasing map μ ↦ ε)."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    if _check_figure(figure) == "pld":
        return gdp_mu(target, delta)
    orders = accountant.orders
    lo, hi = 0.0, 1.0
    while rdp_to_epsilon(orders, rdp_gaussian(hi, orders), delta) <= target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if rdp_to_epsilon(orders, rdp_gaussian(mid, orders), delta) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def _simplex_grid(k: int, max_points: int) -> np.ndarray:
    """All λ with coordinates in {0, 1/m, …, 1} summing to 1, m as large as keeps ≤ max_points."""
    m = 1
    while math.comb(m + 1 + k - 1, k - 1) <= max_points and m < 1000:
        m += 1
    points = []
    for combo in combinations_with_replacement(range(k), m):
        p = np.bincount(combo, minlength=k) / m
        points.append(p)
    return np.array(points)


def lc_most_private(segments: LCSegments) -> tuple[np.ndarray, float]:
    """(λ, μ) minimising μ(λ) over the simplex: SLSQP on μ² from every vertex and the centre
    (μ is not convex in λ), keeping the best point found."""
    k = segments.num_models
    starts = [np.eye(k)[i] for i in range(k)] + [np.full(k, 1.0 / k)]
    best = min(starts, key=segments.mu)
    best_mu = segments.mu(best)
    cons = [{"type": "eq", "fun": lambda x: x.sum() - 1.0}]
    for x0 in starts:
        res = optimize.minimize(
            lambda x: segments.mu(np.clip(x, 0, None)) ** 2,
            x0,
            method="SLSQP",
            bounds=[(0, 1)] * k,
            constraints=cons,
            options={"maxiter": 200, "ftol": 1e-12},
        )
        x = _clean(np.clip(res.x, 0, None))
        mu = segments.mu(x)
        if mu < best_mu:
            best, best_mu = x, mu
    return best, best_mu


def lc_boundary_candidates(
    segments: LCSegments, mu_max: float, *, lam_private: np.ndarray | None = None, max_points: int = 2000
) -> np.ndarray:
    """Feasible λ's (μ(λ) ≤ mu_max) on a simplex grid; each infeasible grid point is replaced by
    the last feasible point on the segment from the most private λ towards it (bisection, 40
    halvings): the feasible boundary the utility search runs on."""
    if lam_private is None:
        lam_private, _ = lc_most_private(segments)
    grid = _simplex_grid(segments.num_models, max_points)
    mus = segments.mu_many(grid)
    feasible = mus <= mu_max
    out = [grid[feasible]]
    bad = grid[~feasible]
    if bad.size:
        lo = np.zeros(len(bad))
        hi = np.ones(len(bad))
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            pts = (1 - mid)[:, None] * lam_private[None, :] + mid[:, None] * bad
            ok = segments.mu_many(pts) <= mu_max
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid)
        out.append((1 - lo)[:, None] * lam_private[None, :] + lo[:, None] * bad)
    cand = np.vstack([*out, lam_private[None, :]])
    cand = cand / cand.sum(axis=1, keepdims=True)
    return np.unique(np.round(cand, 12), axis=0)


def choose_lam_surrogate(
    models: Sequence | LCSegments,
    utility: Utility,
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
    max_points: int = 2000,
) -> WeightChoice:
    """λ maximising ``utility`` subject to the per-step surrogate ε(λ) ≤ target_epsilon at
    ``delta`` (module docstring). A proven choice only when every model declares state-independent
    gradients (``choose_lam`` calls it then); otherwise the figure is not a bound.

    ``utility``: per-model numbers (the linear proxy Σ λ_i u_i, then polished by SLSQP) or a
    callable ``utility(lam) -> float`` evaluated on every boundary candidate (at most about
    ``max_points`` of them). Raises ``UnreachableTarget`` when even the most private λ misses
    the target."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    figure = _check_figure(figure)
    segments = models if isinstance(models, LCSegments) else lc_segments(models, adjacency=adjacency)
    k = segments.num_models
    linear = None if callable(utility) else _check_utilities(utility, k)
    mu_max = lc_mu_for_target(target, delta, figure, accountant)
    lam_private, mu_private = lc_most_private(segments)

    def achieved_of(lam):
        return lc_surrogate_epsilon(
            segments,
            lam,
            delta,
            accountant=accountant,
            max_groups=max_groups,
        )

    if mu_private > mu_max:
        eps = achieved_of(lam_private)
        raise UnreachableTarget("lc", target, delta, figure, eps.pld if figure == "pld" else eps.rdp)
    for _ in range(8):
        cands = lc_boundary_candidates(segments, mu_max, lam_private=lam_private, max_points=max_points)
        if linear is not None:
            values = cands @ linear
            lam = cands[int(np.argmax(values))]
            lam = _polish_linear(segments, linear, lam, mu_max)
            value = float(linear @ lam)
        else:
            values = np.array([float(utility(c.copy())) for c in cands])
            lam = cands[int(np.argmax(values))]
            value = float(np.max(values))
        achieved = achieved_of(lam)
        reached = achieved.pld if figure == "pld" else achieved.rdp
        if reached <= target:
            saturated = segments.mu(lam) >= mu_max * (1 - 1e-6)
            return WeightChoice(
                "lc",
                tuple(float(x) for x in lam),
                target,
                delta,
                figure,
                achieved,
                value,
                bool(saturated),
                "surrogate",
            )
        # The FFT figure is pessimistic by its discretisation: aim slightly lower and retry.
        mu_max *= 1 - 2 * (reached - target) / max(target, 1e-12) - 1e-6
        if mu_max < mu_private:
            break
    eps = achieved_of(lam_private)
    raise UnreachableTarget("lc", target, delta, figure, eps.pld if figure == "pld" else eps.rdp)


def _subset_figure(
    records, adjacency: str, subset: tuple[int, ...], delta: float, figure: str, accountant: Accountant
) -> float:
    lam = np.zeros(len(records))
    lam[list(subset)] = 1.0 / len(subset)
    eps = lc_composition_epsilon(records, lam, delta, adjacency=adjacency, accountant=accountant)
    return eps.pld if figure == "pld" else eps.rdp


def lc_feasible_subsets(
    models: Sequence,
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> dict[tuple[int, ...], float]:
    """{subset: its composition's ε by ``figure``} for every non-empty subset of the models
    whose composition meets (target_epsilon, delta). Supersets of an infeasible subset are skipped
    (composition only grows)."""
    records, adjacency = check_lc_models(models, adjacency)
    if len(records) > MAX_LC_MODELS:
        raise InvalidArgument(
            "models", f"LC searches every subset of the pool: at most {MAX_LC_MODELS} models, got {len(records)}"
        )
    feasible: dict[tuple[int, ...], float] = {}
    k = len(records)
    for size in range(1, k + 1):
        found = False
        for subset in itertools.combinations(range(k), size):
            if size > 1 and any(sub not in feasible for sub in itertools.combinations(subset, size - 1)):
                continue
            reached = _subset_figure(records, adjacency, subset, delta, figure, accountant)
            if reached <= target_epsilon:
                feasible[subset] = reached
                found = True
        if not found:
            break
    return feasible


def choose_lam_composition(
    models: Sequence,
    utility: Utility,
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_points: int = 2000,
) -> WeightChoice:
    """λ maximising ``utility`` subject to the composition of the models with λ_i > 0 meeting
    target_epsilon at ``delta`` (a proven bound for any training; module docstring). Linear
    utilities: the most useful single feasible model. A callable: evaluated on a simplex grid over
    each maximal feasible subset (about ``max_points`` candidates in all). Raises
    ``UnreachableTarget`` when even the most private single model misses the target."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    figure = _check_figure(figure)
    records, adjacency = check_lc_models(models, adjacency)
    k = len(records)
    linear = None if callable(utility) else _check_utilities(utility, k)
    feasible = lc_feasible_subsets(
        records,
        target,
        delta,
        figure=figure,
        adjacency=adjacency,
        accountant=accountant,
    )
    if not feasible:
        singles = [_subset_figure(records, adjacency, (i,), delta, figure, accountant) for i in range(k)]
        raise UnreachableTarget("lc", target, delta, figure, min(singles))
    maximal = [s for s in feasible if not any(set(s) < set(t) for t in feasible)]
    if linear is not None:
        singles = [s[0] for s in feasible if len(s) == 1]
        best = max(singles, key=lambda i: linear[i])
        lam = np.eye(k)[best]
        value = float(linear[best])
    else:
        per_face = max(1, max_points // len(maximal))
        seen: dict[tuple, float] = {}
        lam, value = None, -math.inf
        for face in maximal:
            for w in _simplex_grid(len(face), per_face):
                cand = np.zeros(k)
                cand[list(face)] = w
                key = tuple(np.round(cand, 12))
                if key in seen:
                    continue
                seen[key] = u = float(utility(cand.copy()))
                if u > value:
                    lam, value = cand, u
    support = tuple(int(i) for i in np.flatnonzero(lam > 0))
    achieved = lc_composition_epsilon(
        records,
        lam,
        delta,
        adjacency=adjacency,
        accountant=accountant,
    )
    return WeightChoice(
        "lc",
        tuple(float(x) for x in lam),
        target,
        delta,
        figure,
        achieved,
        value,
        support in maximal,
        "composition",
    )


def choose_lam(
    models: Sequence,
    utility: Utility,
    target_epsilon: float,
    delta: float,
    *,
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
    max_points: int = 2000,
) -> WeightChoice:
    """λ maximising ``utility`` subject to the charged LC bound meeting target_epsilon at ``delta``:
    ``choose_lam_surrogate`` when every model declares state-independent gradients (full batch),
    else ``choose_lam_composition`` (the cost is the composition of λ's support, whatever λ is on
    it; module docstring)."""
    if isinstance(models, LCSegments):
        raise InvalidArgument(
            "models",
            "choose_lam needs the TrainingRecords (their declarations decide the bound); "
            "choose_lam_surrogate takes segments",
        )
    models = list(models)
    if models and surrogate_is_bound(models):
        return choose_lam_surrogate(
            models,
            utility,
            target_epsilon,
            delta,
            figure=figure,
            adjacency=adjacency,
            accountant=accountant,
            max_groups=max_groups,
            max_points=max_points,
        )
    return choose_lam_composition(
        models,
        utility,
        target_epsilon,
        delta,
        figure=figure,
        adjacency=adjacency,
        accountant=accountant,
        max_points=max_points,
    )


def choose_lam_by_utility(
    models: Sequence[TrainingRecord],
    utility: Callable[[np.ndarray], float],
    target_epsilon: float,
    delta: float,
    *,
    prior: Sequence[float] | None = None,
    prior_name: str = "epsilon",
    figure: str = "pld",
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_points: int = 2000,
) -> WeightChoice:
    """LC with charged utility selection (module docstring): S = ``scored_subset`` by ``prior``
    (default ``privacy_prior``); ``utility(λ)`` is measured on a simplex grid over S's face (about
    ``max_points`` candidates, every one supported in S) and the best λ is kept. ``epsilon`` is the
    composition of S — what the release is charged, whatever λ's support (also for models that
    declare state-independent gradients: the scores of many combinations are not one Gaussian
    release)."""
    target = check_epsilon(target_epsilon, "target_epsilon", zero=True)
    delta = check_delta(delta)
    figure = _check_figure(figure)
    records, adjacency = check_lc_models(models, adjacency)
    k = len(records)
    if not callable(utility):
        raise InvalidArgument("utility", "a utility selection for LC measures each candidate λ: give a callable")
    profiles = rs_profiles(records, adjacency=adjacency, accountant=accountant)
    if prior is None:
        prior, prior_name = (
            privacy_prior(profiles, delta, accountant=accountant),
            "epsilon",
        )
    prior_u = _check_utilities(prior, k)
    try:
        scored, achieved = scored_subset(
            records,
            prior_u,
            target,
            delta,
            figure=figure,
            adjacency=adjacency,
            accountant=accountant,
        )
    except UnreachableTarget as e:
        raise UnreachableTarget("lc", target, delta, figure, e.most_private_epsilon) from None
    lam, value = None, -math.inf
    for w in _simplex_grid(len(scored), max_points):
        cand = np.zeros(k)
        cand[list(scored)] = w
        u = float(utility(cand.copy()))
        if u > value:
            lam, value = cand, u
    selection = Selection("utility", prior_name, tuple(float(x) for x in prior_u), check_subset(scored, k))
    return WeightChoice(
        "lc",
        tuple(float(x) for x in lam),
        target,
        delta,
        figure,
        achieved,
        value,
        False,
        "composition",
        selection=selection.to_dict(),
    )


def _polish_linear(segments: LCSegments, linear: np.ndarray, lam0: np.ndarray, mu_max: float) -> np.ndarray:
    """SLSQP on max linear·λ s.t. μ(λ)² ≤ mu_max², from the best grid candidate; kept only if
    feasible and better."""
    k = segments.num_models
    cons = [
        {"type": "eq", "fun": lambda x: x.sum() - 1.0},
        {"type": "ineq", "fun": lambda x: mu_max**2 - segments.mu(np.clip(x, 0, None)) ** 2},
    ]
    res = optimize.minimize(
        lambda x: -float(linear @ x),
        lam0,
        method="SLSQP",
        bounds=[(0, 1)] * k,
        constraints=cons,
        options={"maxiter": 200, "ftol": 1e-12},
    )
    x = _clean(np.clip(res.x, 0, None))
    if segments.mu(x) <= mu_max and linear @ x > linear @ lam0:
        return x
    return lam0


__all__ = [
    "FIGURES",
    "MAX_LC_MODELS",
    "PRIORS",
    "SELECTIONS",
    "Selection",
    "UnreachableTarget",
    "WeightChoice",
    "choose_lam",
    "choose_lam_by_utility",
    "choose_lam_composition",
    "choose_lam_surrogate",
    "choose_pi",
    "choose_pi_by_utility",
    "lc_boundary_candidates",
    "lc_feasible_subsets",
    "lc_most_private",
    "lc_mu_for_target",
    "privacy_prior",
    "rs_most_private_epsilon",
    "scored_subset",
]
