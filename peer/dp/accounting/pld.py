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
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule
from peer.dp.accounting.training_records import check_adjacency

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution as PLD
    from dp_accounting.privacy_accountant import NeighboringRelation

# dp-accounting is imported where a PLD is first built (peer.base.extras.LazyModule: its import
# costs every process that opens a ledger about 1.1 s of CPU, and most never build a PLD)
pld_common = LazyModule("dp_accounting.pld.common")
pld_pmf = LazyModule("dp_accounting.pld.pld_pmf")
privacy_loss_mechanism = LazyModule("dp_accounting.pld.privacy_loss_mechanism")
pldlib = LazyModule("dp_accounting.pld.privacy_loss_distribution")
_accountant = LazyModule("dp_accounting.privacy_accountant")


def __getattr__(name: str):
    """``pld.PLD`` and ``pld.NeighboringRelation``: dp-accounting's classes, imported on first use."""
    if name == "PLD":
        return pldlib.PrivacyLossDistribution
    if name == "NeighboringRelation":
        return _accountant.NeighboringRelation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the default PLD value discretisation interval (the default ``Accountant``'s)
DEFAULT_INTERVAL = 1e-4


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
    return pldlib.PrivacyLossDistribution.create_from_rounded_probability({0: 0.0}, 1.0, value_discretization_interval)


def directions(pld: PLD):
    """(REMOVE PMF, ADD PMF) of a PLD. dp-accounting 0.6.0 (pinned) keeps them as
    ``_pmf_remove`` / ``_pmf_add`` (the same object when symmetric); this is the one place we
    read them, to evaluate the two RS constraints separately."""
    return pld._pmf_remove, pld._pmf_add


def infinity_mass(pld: PLD) -> float:
    """P(privacy loss = +∞), the larger of the two directions."""
    remove, add = directions(pld)
    return max(float(remove._infinity_mass), float(add._infinity_mass))


def is_non_private(pld: PLD) -> bool:
    return infinity_mass(pld) >= 1.0


def _first_above(lower_loss: int, h: float, n: int, e: float) -> int:
    """The first k in [0, n] with (lower_loss + k)·h > e — what np.searchsorted(losses, e,
    side="right") returns on the grid losses = (lower_loss + arange(n))·h — without making the
    whole grid."""

    def loss(k: int) -> float:
        return float(((lower_loss + np.arange(k, k + 1)) * h)[0])  # the grid's own arithmetic

    if n == 0 or not math.isfinite(e):
        return 0 if e < 0 or n == 0 else n
    k = min(max(math.floor(e / h) - lower_loss + 1, 0), n)
    while k > 0 and loss(k - 1) > e:
        k -= 1
    while k < n and loss(k) <= e:
        k += 1
    return k


def _pmf_deltas(pmf, eps: np.ndarray) -> np.ndarray:
    """δ(ε) = P(L = ∞) + Σ_{l > ε} p_l (1 − e^{ε − l}) of one direction's PMF, for sorted ε.

    Few ε: the sum directly (no cancellation). Many ε: reverse cumulative sums of p and p·e^{l*−l}
    (l* the largest finite loss), valid while the loss range keeps e^{l*−l} finite; otherwise
    dp-accounting's own evaluation."""
    dense = pmf.to_dense_pmf()
    h = dense._discretization
    probs = dense._probs
    inf_mass = float(dense._infinity_mass)
    lower_loss = dense._lower_loss
    if eps.size <= 16:
        # only the losses above each ε are needed: the same grid values (lower_loss + k)·h, made
        # for the tail alone (the first index with loss > ε is found on the grid, then checked
        # against the very values np.searchsorted would compare)
        out = np.empty(eps.size)
        for i, e in enumerate(eps):
            start = _first_above(lower_loss, h, probs.size, float(e))
            tail = (lower_loss + np.arange(start, probs.size)) * h
            out[i] = inf_mass + float(np.dot(probs[start:], -np.expm1(e - tail)))
        return out
    losses = (lower_loss + np.arange(probs.size)) * h
    span = losses[-1] - losses[0] if losses.size else 0.0
    if span > 600:
        return np.asarray(pmf.get_delta_for_epsilon(eps), dtype=float)
    top = losses[-1]
    upper = np.concatenate([np.cumsum(probs[::-1])[::-1], [0.0]])
    lower = np.concatenate([np.cumsum((probs * np.exp(top - losses))[::-1])[::-1], [0.0]])
    start = np.searchsorted(losses, eps, side="right")
    return inf_mass + upper[start] - np.exp(eps - top) * lower[start]


def directional_deltas(pld: PLD, epsilon: float | Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(δ_REMOVE(ε), δ_ADD(ε)), each clamped to [0, 1]; ε sorted ascending."""
    remove, add = directions(pld)
    eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
    d_remove = np.clip(_pmf_deltas(remove, eps), 0.0, 1.0)
    d_add = d_remove if add is remove else np.clip(_pmf_deltas(add, eps), 0.0, 1.0)
    return d_remove, d_add


def _log_abs_sinh(t: np.ndarray) -> np.ndarray:
    a = np.abs(t)
    with np.errstate(divide="ignore"):
        return a + np.log1p(-np.exp(-2 * a)) - math.log(2)


def _gaussian_inverse_loss(loss: privacy_loss_mechanism.GaussianPrivacyLoss, eps: np.ndarray) -> np.ndarray:
    """Vectorised ``GaussianPrivacyLoss.inverse_privacy_loss``: the largest x whose privacy loss is
    at least ε, for the pairs of ``subsampled_gaussian_pld``. With ℓ(x) = Δ(∓x − Δ/2)/σ² the
    unsubsampled loss and c = Δ²/(2σ²):
      REMOVE  (q·N(−Δ) + (1−q)·N(0) vs N(0)):  ℓ = log(1 + (e^ε − 1)/q),  x = −Δ/2 − ℓσ²/Δ;
      ADD     (N(0) vs q·N(Δ) + (1−q)·N(0)):   ℓ = −log(1 + (e^−ε − 1)/q), x = Δ/2 − ℓσ²/Δ;
      REPLACE (q·N(−Δ)+(1−q)N(0) vs q·N(Δ)+(1−q)N(0)): solving the loss equation for u = xΔ/σ²
      gives −2 sinh(u + ε/2) = 2a sinh(ε/2) with a = e^c (1−q)/q, so
      x = σ²/Δ · (−asinh(a sinh(ε/2)) − ε/2)  (at q = 1: x = −εσ²/(2Δ)).
    """
    sigma2 = loss._standard_deviation**2
    sens, q = loss.sensitivity, loss.sampling_prob
    kind = loss.adjacency_type
    if kind == privacy_loss_mechanism.AdjacencyType.REPLACE:
        if q == 1.0:
            return -eps * sigma2 / sens / 2
        log_a = 0.5 * sens * sens / sigma2 + math.log1p(-q) - math.log(q)
        log_y = log_a + _log_abs_sinh(eps / 2)
        small = log_y < 300
        asinh = np.where(small, np.arcsinh(np.exp(np.minimum(log_y, 300))), math.log(2) + log_y)
        return sigma2 / sens * (-np.sign(eps) * asinh - eps / 2)
    if kind == privacy_loss_mechanism.AdjacencyType.ADD:
        ell = -np.log1p(np.expm1(-eps) / q) if q < 1 else eps
        return sens / 2 - ell * sigma2 / sens
    ell = np.log1p(np.expm1(eps) / q) if q < 1 else eps
    return -sens / 2 - ell * sigma2 / sens


def _grid_range(bounds, interval: float) -> tuple[int, int]:
    """The grid indices (lowest, highest) of a PMF over ``bounds``' loss range."""
    return math.floor(bounds.epsilon_lower / interval), math.ceil(bounds.epsilon_upper / interval)


def _fast_gaussian_pmf(loss: privacy_loss_mechanism.GaussianPrivacyLoss, interval: float) -> pld_pmf.PLDPmf:
    """dp-accounting's connect-the-dots PMF of a Gaussian privacy loss (its own bounds, CDFs and
    ``create_pmf_pessimistic_connect_dots_fixed_gap``), with the per-ε inverse of the privacy loss
    evaluated in one vectorised call instead of a Python loop (``GaussianPrivacyLoss.
    get_delta_for_epsilon`` loops; this is ~5× faster). Tests check the PMFs are identical."""
    lo, hi = _grid_range(loss.connect_dots_bounds(), interval)
    eps = np.arange(lo, hi + 1) * interval
    q = loss.sampling_prob
    deltas = np.zeros_like(eps)
    kind = loss.adjacency_type
    if q == 1.0 or kind == privacy_loss_mechanism.AdjacencyType.REPLACE:
        inv = np.full(eps.shape, True)
    elif kind == privacy_loss_mechanism.AdjacencyType.ADD:
        inv = eps < -math.log1p(-q)
    else:
        inv = eps > math.log1p(-q)
        deltas[~inv] = -np.expm1(eps[~inv])
    x = _gaussian_inverse_loss(loss, eps[inv])
    deltas[inv] = loss.mu_upper_cdf(x) - np.exp(eps[inv] + loss.mu_lower_log_cdf(x))
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lo, hi, np.clip(deltas, 0, 1))


def fast_gaussian_pld(
    standard_deviation: float,
    sensitivity: float,
    value_discretization_interval: float,
    sampling_prob: float = 1.0,
    neighboring_relation: NeighboringRelation | None = None,
) -> PLD:
    """Same PLD as dp-accounting's ``from_gaussian_mechanism`` (pessimistic, connect-the-dots,
    default log-mass truncation −50), built with ``_fast_gaussian_pmf``; the relation defaults
    to add-or-remove-one, as there."""
    if neighboring_relation is None:
        neighboring_relation = _accountant.NeighboringRelation.ADD_OR_REMOVE_ONE
    return pldlib.PrivacyLossDistribution(
        *(
            _fast_gaussian_pmf(loss, value_discretization_interval)
            for loss in _gaussian_losses(standard_deviation, sensitivity, sampling_prob, neighboring_relation)
        )
    )


def _gaussian_losses(
    standard_deviation: float, sensitivity: float, sampling_prob: float, neighboring_relation: NeighboringRelation
) -> list[privacy_loss_mechanism.GaussianPrivacyLoss]:
    """The privacy losses whose PMFs make the PLD, in dp-accounting's order (remove, add):
    replace-one one REPLACE loss; add-remove REMOVE, and ADD too when subsampled (at q = 1 the
    two directions are the same Gaussian pair)."""
    kinds = privacy_loss_mechanism.AdjacencyType
    if neighboring_relation == _accountant.NeighboringRelation.REPLACE_ONE:
        chosen = (kinds.REPLACE,)
    elif sampling_prob == 1.0:
        chosen = (kinds.REMOVE,)
    else:
        chosen = (kinds.REMOVE, kinds.ADD)
    return [
        privacy_loss_mechanism.GaussianPrivacyLoss(
            standard_deviation, sensitivity=sensitivity, sampling_prob=sampling_prob, adjacency_type=kind
        )
        for kind in chosen
    ]


#: The most bins one Gaussian privacy-loss PMF may have on the accountant's grid (2²⁵: 256 MiB
#: per float64 array, and composition holds several): beyond it building and composing the PLD
#: takes minutes and gigabytes. Measured: a PMF of 5.2e7 bins (μ = 63) took 44 s; σ = 0.01 at
#: q = 0.05 (6.0e7 bins per step) did not finish 100 steps in 10 minutes. Such a mechanism's ε
#: is in the thousands anyway (its RDP bound says so at once): :func:`check_grid` refuses it.
MAX_PMF_BINS = 2**25


def gaussian_pmf_bins(
    standard_deviation: float,
    sensitivity: float,
    value_discretization_interval: float,
    sampling_prob: float = 1.0,
    neighboring_relation: NeighboringRelation | None = None,
) -> tuple[int, float, float]:
    """(bins, lowest loss, highest loss) of the widest PMF that :func:`fast_gaussian_pld` (same
    arguments) builds, from dp-accounting's own connect-the-dots bounds, without building it."""
    if neighboring_relation is None:
        neighboring_relation = _accountant.NeighboringRelation.ADD_OR_REMOVE_ONE
    widest = (0, 0.0, 0.0)
    for loss in _gaussian_losses(standard_deviation, sensitivity, sampling_prob, neighboring_relation):
        b = loss.connect_dots_bounds()
        lo, hi = _grid_range(b, value_discretization_interval)
        if hi - lo + 1 > widest[0]:
            widest = (hi - lo + 1, b.epsilon_lower, b.epsilon_upper)
    return widest


def check_grid(field_name: str, what: str, bins: int, lower: float, upper: float, interval: float) -> None:
    """InvalidArgument naming ``field_name`` when one PMF would need more than
    :data:`MAX_PMF_BINS` bins (the reason is in the rule: the loss range, the bins, the limit)."""
    if bins > MAX_PMF_BINS:
        raise InvalidArgument(
            field_name,
            f"{what}: its privacy loss spans [{lower:.4g}, {upper:.4g}], {bins:.3g} bins of the PLD grid "
            f"(interval {interval:g}), over the accountant's limit of {MAX_PMF_BINS:.3g} (minutes and "
            "gigabytes to compose); a mechanism this weak protects nothing (ε in the hundreds or more): "
            "use more noise",
        )


def gaussian_pld(mu: float, value_discretization_interval: float) -> PLD:
    """PLD of a Gaussian mechanism whose sensitivity is μ times its noise std: N(0,1) vs N(μ,1)
    (symmetric, so it serves both adjacencies once μ carries the adjacency's sensitivity)."""
    if mu < 0 or math.isnan(mu):
        raise InvalidArgument("mu", f"must be >= 0, got {mu!r}")
    if mu == 0:
        return identity_pld(value_discretization_interval)
    if math.isinf(mu):
        return non_private_pld(value_discretization_interval)
    return fast_gaussian_pld(1.0, mu, value_discretization_interval)


def subsampled_gaussian_pld(
    noise_multiplier: float, sample_rate: float, adjacency: str, value_discretization_interval: float
) -> PLD:
    """PLD of one DP-SGD step: clipped sum (clip norm = unit sensitivity), noise std σ, Poisson
    rate q, under ``adjacency``. dp-accounting's pairs: add-remove, REMOVE: (1−q)N(0)+qN(−1) vs
    N(0) and ADD: N(0) vs (1−q)N(0)+qN(1); replace-one: (1−q)N(0)+qN(−1) vs (1−q)N(0)+qN(1)
    (at q = 1, N(−1) vs N(1): sensitivity 2, as the module ``training_records`` states)."""
    check_adjacency(adjacency)
    sigma, q = float(noise_multiplier), float(sample_rate)
    if sigma == 0:
        return non_private_pld(value_discretization_interval)
    relations = _accountant.NeighboringRelation
    relation = relations.REPLACE_ONE if adjacency == "replace-one" else relations.ADD_OR_REMOVE_ONE
    return fast_gaussian_pld(sigma, 1.0, value_discretization_interval, sampling_prob=q, neighboring_relation=relation)


def laplace_pld(epsilon: float, value_discretization_interval: float) -> PLD:
    """PLD of a Laplace mechanism with ε = sensitivity/scale (dp-accounting's 1-D pair, which
    also covers an L1-bounded vector with i.i.d. Laplace noise — dp-accounting's LaplaceDpEvent)."""
    if epsilon == 0:
        return identity_pld(value_discretization_interval)
    if math.isinf(epsilon):
        return non_private_pld(value_discretization_interval)
    return pldlib.from_laplace_mechanism(
        1.0 / epsilon, sensitivity=1.0, value_discretization_interval=value_discretization_interval
    )


def approx_dp_pld(epsilon: float, delta: float, value_discretization_interval: float) -> PLD:
    """Worst-case PLD of an (ε, δ)-DP mechanism (dp-accounting ``from_privacy_parameters``:
    +∞ w.p. δ, ±ε otherwise — randomised response with an extra δ of catastrophe). With δ = 0 it
    is exactly binary randomised response, the dominating pair of pure ε-DP."""
    return pldlib.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(epsilon, delta),
        value_discretization_interval=value_discretization_interval,
    )


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
    pairs = [(p, float(w)) for p, w in zip(plds, weights, strict=True) if w > 0]
    if not pairs:
        raise InvalidArgument("pi", "must put positive weight on some model")
    mixed, total = pairs[0]
    for p, w in pairs[1:]:
        mixed = mixed.compute_mixture(p, total / (total + w))
        total += w
    return mixed
