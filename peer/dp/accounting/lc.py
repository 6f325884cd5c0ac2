"""Linear combination (LC): release θ_λ = Σ_i λ_i θ_i of independent DP-SGD runs.

Unit of privacy: one training record under the merge's adjacency; all models were trained on the
same dataset from the same public initialisation θ_0; λ (convex weights) is public.

The charged bound: composition of the merged models (proven for any training)
-------------------------------------------------------------------------------
θ_λ is a post-processing of releasing every model with λ_i > 0 together (the weights are public),
and the runs are DP mechanisms on the same data, so θ_λ is at least as private as their
composition: RDP ε_order(θ_λ) ≤ Σ_{i: λ_i>0} ε_order,i (each model's own curve), and its PLD is
dominated by the FFT convolution of the models' own PLDs (one Gaussian with μ = sqrt(Σ μ_i²) when
every such model is a full-batch Gaussian composition, Dong, Roth & Su 2022, Cor. 3.3). Models
with λ_i = 0 cost nothing: θ_λ does not depend on them. This is what ``lc_epsilon``, ``lc_delta``,
``lc_rdp`` and ``lc_pld`` return and what the ledger charges (``release_accounting.rdp_of_record``), unless
every merged model declares state-independent gradients (below). The cost depends on λ only
through its support; choosing λ is then a choice of the subset of models (``targets``).

The per-step surrogate (a bound only for state-independent gradients)
---------------------------------------------------------------------
The design's per-step surrogate (Yin, Zaheer & Li 2026, arXiv:2604.20985) pairs step t of every
full-batch run. Model i contributes −λ_i η_{i,t} (Σ_j clip_{C_{i,t}}(g_ij) + σ_{i,t} C_{i,t} z_{i,t})/n,
so the combined step t is treated as a Gaussian mechanism with

    noise std     s_t = sqrt(Σ_i (λ_i η_{i,t} σ_{i,t} C_{i,t})²)            (independent noises)
    sensitivity   Δ_t = k · Σ_i λ_i η_{i,t} C_{i,t}                          (triangle inequality)

k = 2 replace-one, 1 add-remove (``training_records``), the common 1/n cancelling; a model with T_i < T =
max_i T_i is padded with steps that change nothing (no gradient, no noise). Composing the T steps
gives μ = sqrt(Σ_t (Δ_t/s_t)²) (closed form), RDP order·μ²/2, and a PLD by FFT composition of the
per-step Gaussian PLDs (equal ratios grouped; must agree with the closed form, tests: 1e-3).

That is proven only when every clipped per-example gradient is a function of the record alone,
not of the model's own state θ_{i,t} (``TrainingRecord.state_independent_gradients``): then
θ_{i,T} = θ_0 − Σ_t η_{i,t}(G_{i,t}(D) + noise)/n with G_{i,t} fixed functions of the data, θ_λ is
θ_0 minus a post-processing of the T independent Gaussian releases u_t = Σ_i λ_i η_{i,t}(G_{i,t}(D)
+ σ_{i,t}C_{i,t}z_{i,t}), each with sensitivity Δ_t and std s_t, and μ above is a bound (tight when
every Δ_t/s_t is equal). For networks it is NOT a bound: a model's own, unreleased trajectory
filters its noise. Exact counterexample (tests/test_accounting_lc.py): two full-batch DP-GD runs
on the same n records, replace-one, C = 1, T = 400, η = 0.5, λ = (½, ½); model 1 with the linear
loss a_j·t and σ = 5, model 2 with the loss (t − 0.3)²/2 (never clipped) and σ = 100, whose noise
decays by (1 − η) per step. θ_λ is exactly Gaussian with μ = 5.237 (ε = 35.3 at δ = 1e-5) while
the surrogate says μ = 0.799 (ε = 3.38). So the surrogate is reported beside the bound
(``lc_report``), labelled with its condition, and is charged only when every merged model with
λ_i > 0 declares state-independent gradients and took plain SGD steps (``surrogate_is_bound``:
momentum or Adam, ``TrainingRecord.optimizer``, make θ_T another function of the releases than
θ_0 − Σ_t η_t ĝ_t, which the surrogate's per-step weights η_t assume).

Refusals: models known only by (ε_i, δ_i) (no free lunch: from the final guarantees alone an LC
can be no more private than releasing every model — which is the composition bound itself; LC
needs the training records); the surrogate needs full-batch runs (a Poisson-subsampled model has
no surrogate figure, its LC is charged by composition).
"""

from __future__ import annotations

import math
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
    json_number,
    pld_delta,
    pld_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
)
from peer.dp.accounting.events import LinearCombinationMerge
from peer.dp.accounting.profiles import PrivacyProfile, model_rdp, privacy_profiles, resolve_adjacency
from peer.dp.accounting.rdp import rdp_gaussian
from peer.dp.accounting.rs import check_weights, scored_pld, scored_rdp
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord, check_adjacency

DEFAULT_MAX_GROUPS = 32

NO_FREE_LUNCH = (
    "LC needs every model's per-step hyperparameters (learning_rate, clip_norm, noise_multiplier "
    "per step); this model is known only by its final (epsilon, delta). No free lunch: from final "
    "guarantees alone a linear combination can be no more private than releasing every model "
    "together (their composition). Use RS, which works with (epsilon, delta)-only models."
)


@dataclass(frozen=True)
class LCSegments:
    """The pool's steps cut into segments on which every model's hyperparameters are constant.

    ``counts[s]`` steps; ``signal[s, i]`` = η·C of model i on segment s (0 once model i has
    stopped); ``noise[s, i]`` = η·σ·C likewise. For weights λ:
    Δ_s = k·signal[s]·λ, s_s = ‖noise[s] ∘ λ‖₂, μ_s = Δ_s/s_s.
    """

    adjacency: str
    counts: np.ndarray
    signal: np.ndarray
    noise: np.ndarray

    @property
    def k(self) -> float:
        return 2.0 if self.adjacency == "replace-one" else 1.0

    @property
    def num_models(self) -> int:
        return self.signal.shape[1]

    def step_ratios(self, lam: np.ndarray) -> np.ndarray:
        """μ_s = Δ_s / s_s per segment (0 where no weighted model is active; ∞ if unnoised)."""
        lam = _effective(lam)
        delta = self.k * (self.signal @ lam)
        std = np.sqrt((self.noise**2) @ (lam**2))
        with np.errstate(divide="ignore", invalid="ignore"):
            mu = np.where(delta == 0, 0.0, delta / std)
        return mu

    def mu(self, lam: np.ndarray) -> float:
        mu_s = self.step_ratios(lam)
        if np.any(np.isinf(mu_s)):
            return math.inf
        return float(math.sqrt(float(np.dot(self.counts, mu_s**2))))

    def mu_many(self, lams: np.ndarray) -> np.ndarray:
        """μ for each row of ``lams`` (m × k), vectorised (for searches over λ)."""
        lams = np.array([_effective(row) for row in np.atleast_2d(lams)])
        delta = self.k * (self.signal @ lams.T)
        var = (self.noise**2) @ (lams**2).T
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio_sq = np.where(delta == 0, 0.0, delta**2 / var)
        return np.sqrt(self.counts @ ratio_sq)


def _effective(lam: np.ndarray) -> np.ndarray:
    """λ scaled to max 1 (μ is scale-invariant) with weights below 1e-150 of the largest set to 0:
    in float64 such a term λ_i θ_i vanishes next to the others, and squaring it would underflow
    to a spurious zero noise."""
    lam = np.asarray(lam, dtype=float)
    top = lam.max()
    if top <= 0:
        return lam
    lam = lam / top
    return np.where(lam < 1e-150, 0.0, lam)


def check_lc_models(models: Sequence, adjacency: str | None) -> tuple[list[TrainingRecord], str]:
    """The models as TrainingRecords and the adjacency they are accounted under; refuses (ε, δ)-only
    models (no free lunch), precomputed profiles and a mix of adjacencies left unresolved."""
    if isinstance(models, (str, bytes)) or not isinstance(models, Sequence) or not models:
        raise InvalidArgument("models", "must contain at least one model")
    for i, m in enumerate(models):
        if isinstance(m, ApproxDP) or (isinstance(m, PrivacyProfile) and m.source == "approx-dp"):
            raise InvalidArgument(f"models[{i}]", NO_FREE_LUNCH)
        if isinstance(m, PrivacyProfile):
            raise InvalidArgument(
                f"models[{i}]", "LC needs the TrainingRecord (per-step hyperparameters), not a precomputed profile"
            )
        if not isinstance(m, TrainingRecord):
            raise InvalidArgument(f"models[{i}]", f"must be a TrainingRecord, got {type(m).__name__}")
    adjacency = resolve_adjacency(list(models), adjacency)
    return list(models), check_adjacency(adjacency)


def _check_full_batch(records: Sequence[TrainingRecord]) -> None:
    for i, m in enumerate(records):
        for t_start, (step, _count) in zip(np.cumsum([0] + [n for _, n in m.runs])[:-1], m.runs, strict=True):
            if step.sample_rate != 1.0:
                raise InvalidArgument(
                    f"models[{i}].steps[{int(t_start)}].sample_rate",
                    f"the LC per-step surrogate is defined for full-batch DP-SGD only (sample_rate 1), got "
                    f"{step.sample_rate}; the LC of Poisson-subsampled models is charged by composition",
                )


def lc_segments(models: Sequence[TrainingRecord], *, adjacency: str | None = None) -> LCSegments:
    """Cut the padded pool (T = max T_i) into segments of constant hyperparameters (for the
    per-step surrogate: full-batch models only)."""
    records, adjacency = check_lc_models(models, adjacency)
    _check_full_batch(records)
    bounds = set()
    per_model = []
    for r in records:
        ends = np.cumsum([n for _, n in r.runs])
        bounds.update(int(e) for e in ends)
        per_model.append(
            (
                ends,
                np.array([s.learning_rate * s.clip_norm for s, _ in r.runs]),
                np.array([s.learning_rate * s.noise_multiplier * s.clip_norm for s, _ in r.runs]),
            )
        )
    ends = np.array(sorted(bounds))
    starts = np.concatenate([[0], ends[:-1]])
    counts = (ends - starts).astype(float)
    signal = np.zeros((ends.size, len(records)))
    noise = np.zeros((ends.size, len(records)))
    for i, (model_ends, sig, nse) in enumerate(per_model):
        active = starts < model_ends[-1]
        run_index = np.searchsorted(model_ends, starts[active], side="right")
        signal[active, i] = sig[run_index]
        noise[active, i] = nse[run_index]
    return LCSegments(adjacency, counts, signal, noise)


def _segments_and_weights(models, lam, adjacency) -> tuple[LCSegments, np.ndarray]:
    segments = models if isinstance(models, LCSegments) else lc_segments(models, adjacency=adjacency)
    if isinstance(models, LCSegments) and adjacency is not None and adjacency != models.adjacency:
        raise InvalidArgument("adjacency", f"the segments were built for {models.adjacency}")
    return segments, check_weights(lam, segments.num_models, "lam")


def lc_surrogate_mu(
    models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], *, adjacency: str | None = None
) -> float:
    """The surrogate μ = sqrt(Σ_t (Δ_t/s_t)²) of θ_λ (μ-GDP only for state-independent gradients)."""
    segments, lam = _segments_and_weights(models, lam, adjacency)
    return segments.mu(lam)


def lc_surrogate_rdp(
    models: Sequence[TrainingRecord] | LCSegments,
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> np.ndarray:
    """The surrogate RDP Σ_t order·Δ_t²/(2 s_t²) at every one of ``accountant``'s orders."""
    return rdp_gaussian(lc_surrogate_mu(models, lam, adjacency=adjacency), accountant.orders)


def _split_blocks(values: np.ndarray, counts: np.ndarray, max_groups: int) -> list[tuple[int, int]]:
    """Cut sorted ``values`` into at most ``max_groups`` consecutive blocks, greedily splitting the
    block whose rounding-up costs most, at its best point. The cost of block [i, j] is the growth
    of μ² when every step in it takes the block's largest value: v_j²·Σn − Σ n v²."""
    w = counts.astype(float)
    cum_n = np.concatenate([[0.0], np.cumsum(w)])
    cum_s = np.concatenate([[0.0], np.cumsum(w * values**2)])

    def cost(i, j):
        return values[j] ** 2 * (cum_n[j + 1] - cum_n[i]) - (cum_s[j + 1] - cum_s[i])

    def best_split(i, j):
        m = np.arange(i, j)
        left = values[m] ** 2 * (cum_n[m + 1] - cum_n[i]) - (cum_s[m + 1] - cum_s[i])
        right = values[j] ** 2 * (cum_n[j + 1] - cum_n[m + 1]) - (cum_s[j + 1] - cum_s[m + 1])
        k = int(np.argmin(left + right))
        return int(m[k]), cost(i, j) - (left[k] + right[k])

    blocks = [(0, values.size - 1)]
    while len(blocks) < max_groups:
        gains = [(best_split(i, j), b) if j > i else ((None, -1.0), b) for b, (i, j) in enumerate(blocks)]
        (split, gain), b = max(gains, key=lambda g: g[0][1])
        if split is None or gain <= 0:
            break
        i, j = blocks.pop(b)
        blocks[b:b] = [(i, split), (split + 1, j)]
    return blocks


def _group_ratios(counts: np.ndarray, mu_s: np.ndarray, max_groups: int) -> tuple[list[tuple[float, int]], str | None]:
    """Steps grouped by equal μ_s (exact). If more than ``max_groups`` distinct values remain, the
    sorted values are cut into ``max_groups`` consecutive blocks (``_split_blocks``) and every step
    takes its block's largest μ: rounding μ up is sound (a Gaussian with smaller μ is a
    post-processing of one with larger μ — add noise), and the note says by how much μ grew."""
    keep = mu_s > 0
    values, inverse = np.unique(mu_s[keep], return_inverse=True)
    totals = np.bincount(inverse, weights=counts[keep]).astype(np.int64) if values.size else np.zeros(0, np.int64)
    if values.size <= max_groups:
        return [(float(v), int(n)) for v, n in zip(values, totals, strict=True)], None
    blocks = _split_blocks(values, totals, max_groups)
    groups = [(float(values[j]), int(totals[i : j + 1].sum())) for i, j in blocks]
    exact = math.sqrt(float(np.dot(totals, values**2)))
    rounded = math.sqrt(sum(n * v * v for v, n in groups))
    return groups, (
        f"FFT composition rounded {values.size} distinct per-step ratios up into {len(groups)} groups: "
        f"mu {exact:.6g} -> {rounded:.6g} (sound, conservative by {rounded / exact - 1:.2e} relative)"
    )


def lc_surrogate_pld(
    models: Sequence[TrainingRecord] | LCSegments,
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> tuple[pldm.PLD, tuple[str, ...]]:
    """The surrogate PLD of θ_λ by numerical composition of the per-step Gaussian PLDs (dp-accounting
    PLD per distinct Δ_t/s_t, ``self_compose`` per group, FFT ``compose`` across groups), at
    ``accountant``'s discretisation. Returns (pld, notes); a note is present when steps had to
    be rounded into groups."""
    interval = accountant.value_discretization_interval
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
        raise InvalidArgument("max_groups", f"must be a positive integer, got {max_groups!r}")
    segments, lam = _segments_and_weights(models, lam, adjacency)
    mu_s = segments.step_ratios(lam)
    if np.any(np.isinf(mu_s)):
        return pldm.non_private_pld(interval), ()
    groups, note = _group_ratios(segments.counts, mu_s, max_groups)
    parts = [pldm.self_compose(pldm.gaussian_pld(v, interval), n) for v, n in groups]
    return pldm.compose_plds(parts, interval), (() if note is None else (note,))


def _surrogate_bounds(models, lam, adjacency, accountant, max_groups):
    """The surrogate PLD (FFT), RDP curve and μ of θ_λ, and notes."""
    segments, lam = _segments_and_weights(models, lam, adjacency)
    mu = segments.mu(lam)
    pld, notes = lc_surrogate_pld(segments, lam, accountant=accountant, max_groups=max_groups)
    orders = accountant.orders
    return pld, orders, rdp_gaussian(mu, orders), mu, notes


def lc_surrogate_epsilon(
    models: Sequence[TrainingRecord] | LCSegments,
    lam: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> Epsilons:
    """The surrogate ε of θ_λ at ``delta`` (a bound only for state-independent gradients, module
    docstring): ``pld`` (FFT composition), ``closed_form`` (μ-GDP), ``rdp``."""
    delta = check_delta(delta)
    pld, orders, rdp, mu, notes = _surrogate_bounds(models, lam, adjacency, accountant, max_groups)
    return Epsilons(
        pld=pld_epsilon(pld, delta),
        rdp=rdp_to_epsilon(orders, rdp, delta),
        closed_form=gdp_epsilon(mu, delta),
        notes=notes,
    )


def lc_surrogate_delta(
    models: Sequence[TrainingRecord] | LCSegments,
    lam: Sequence[float],
    epsilon: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> Deltas:
    """The surrogate δ of θ_λ at ``epsilon`` by the three accountants (same caveat)."""
    epsilon = check_epsilon(epsilon, zero=True)
    pld, orders, rdp, mu, notes = _surrogate_bounds(models, lam, adjacency, accountant, max_groups)
    return Deltas(
        pld=pld_delta(pld, epsilon),
        rdp=rdp_to_delta(orders, rdp, epsilon),
        closed_form=gdp_delta(mu, epsilon),
        notes=notes,
    )


# ------------------------------------------------------------------------------------------------
# The charged bound: composition of the merged models, unless all declare state independence.

BOUNDS = ("composition", "surrogate")
SURROGATE_VALID_WHEN = (
    "every merged model's clipped per-example gradients do not depend on its own parameters "
    "(state-independent gradients, e.g. Gaussian mean estimation with a linear loss), declared in its "
    "training record; not a bound for DP-SGD on a neural network"
)


def lc_support(lam: Sequence[float], count: int) -> tuple[int, ...]:
    """Indices i with λ_i > 0: the models θ_λ depends on (convex weights, ``check_weights``)."""
    w = check_weights(lam, count, "lam")
    return tuple(int(i) for i in np.flatnonzero(w > 0))


def surrogate_is_bound(models: Sequence, lam: Sequence[float] | None = None) -> bool:
    """True when the per-step surrogate is a proven bound for θ_λ: every model θ_λ depends on
    (λ_i > 0; all models when ``lam`` is None) is a full-batch ``TrainingRecord`` declaring
    state-independent gradients and taking plain SGD steps (momentum and Adam weight the
    releases otherwise than the surrogate's η_t)."""
    models = list(models)
    chosen = range(len(models)) if lam is None else lc_support(lam, len(models))
    return bool(models) and all(
        isinstance(models[i], TrainingRecord)
        and models[i].state_independent_gradients
        and models[i].full_batch
        and models[i].optimizer.name == "sgd"
        for i in chosen
    )


def _composition_parts(models, lam, adjacency):
    records, adjacency = check_lc_models(models, adjacency)
    support = lc_support(lam, len(records))
    return records, adjacency, support


def lc_composition_rdp(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> np.ndarray:
    """Σ_{i: λ_i>0} ε_order,i: the RDP of releasing every model θ_λ depends on (each model's own
    curve, ``profiles.model_rdp``; cached, so a ledger charge builds no PLD)."""
    records, adjacency, support = _composition_parts(models, lam, adjacency)
    total = np.zeros(accountant.orders.shape)
    for i in support:
        total = total + model_rdp(records[i], adjacency, accountant=accountant)
    return total


def _composition_pld(records, adjacency, support, accountant) -> tuple[pldm.PLD, float | None]:
    """(PLD, μ or None) of releasing the models in ``support`` together: one Gaussian PLD with
    μ = sqrt(Σ μ_i²) when each is a full-batch Gaussian composition (exact), else the FFT
    composition of their own PLDs. Identical records are separate runs: each counts."""
    interval = accountant.value_discretization_interval
    if not support:
        return pldm.identity_pld(interval), 0.0
    profiles = privacy_profiles([records[i] for i in support], adjacency, accountant=accountant)
    if all(p.mu is not None for p in profiles):
        mu = math.sqrt(sum(p.mu**2 for p in profiles))
        return pldm.gaussian_pld(mu, interval), mu
    return pldm.compose_plds([p.pld for p in profiles], interval), None


def lc_composition_pld(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> pldm.PLD:
    """The PLD of releasing every model θ_λ depends on (``_composition_pld``)."""
    records, adjacency, support = _composition_parts(models, lam, adjacency)
    return _composition_pld(records, adjacency, support, accountant)[0]


def lc_composition_epsilon(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> Epsilons:
    """ε at ``delta`` of the composition of the models with λ_i > 0 (proven for any training):
    ``pld``, ``rdp`` and, when they are all full-batch Gaussians, ``closed_form`` (μ-GDP)."""
    delta = check_delta(delta)
    orders = accountant.orders
    records, adjacency, support = _composition_parts(models, lam, adjacency)
    pld, mu = _composition_pld(records, adjacency, support, accountant)
    rdp = lc_composition_rdp(records, lam, adjacency=adjacency, accountant=accountant)
    return Epsilons(
        pld=pld_epsilon(pld, delta),
        rdp=rdp_to_epsilon(orders, rdp, delta),
        closed_form=None if mu is None else gdp_epsilon(mu, delta),
    )


def lc_bound(models: Sequence[TrainingRecord], lam: Sequence[float], *, adjacency: str | None = None) -> str:
    """Which bound an LC merge of ``models`` with weights ``lam`` is charged: "surrogate" when
    ``surrogate_is_bound``, else "composition"."""
    records, _ = check_lc_models(models, adjacency)
    return "surrogate" if surrogate_is_bound(records, lam) else "composition"


def _restrict(records: list[TrainingRecord], lam: Sequence[float]) -> tuple[list[TrainingRecord], np.ndarray]:
    """The models with λ_i > 0 and their weights: the surrogate of θ_λ is the same without the
    others (they add nothing to any Δ_t or s_t), and they need not be full batch."""
    w = check_weights(lam, len(records), "lam")
    support = list(lc_support(w, len(records)))
    return [records[i] for i in support], w[support]


def lc_rdp(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> np.ndarray:
    """The charged RDP of θ_λ: the surrogate's order·μ²/2 when ``surrogate_is_bound``, else the
    composition Σ_{i: λ_i>0} ε_order,i."""
    records, adjacency = check_lc_models(models, adjacency)
    if surrogate_is_bound(records, lam):
        return lc_surrogate_rdp(*_restrict(records, lam), adjacency=adjacency, accountant=accountant)
    return lc_composition_rdp(records, lam, adjacency=adjacency, accountant=accountant)


def lc_pld(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> tuple[pldm.PLD, tuple[str, ...]]:
    """The charged PLD of θ_λ and notes (the surrogate's FFT when ``surrogate_is_bound``, else the
    composition's)."""
    records, adjacency = check_lc_models(models, adjacency)
    if surrogate_is_bound(records, lam):
        return lc_surrogate_pld(
            *_restrict(records, lam),
            adjacency=adjacency,
            accountant=accountant,
            max_groups=max_groups,
        )
    return lc_composition_pld(records, lam, adjacency=adjacency, accountant=accountant), ()


def lc_epsilon(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> Epsilons:
    """The charged ε of θ_λ at ``delta`` (a proven bound): the surrogate when every model with
    λ_i > 0 declares state-independent gradients, else the composition of those models."""
    records, adjacency = check_lc_models(models, adjacency)
    if surrogate_is_bound(records, lam):
        return lc_surrogate_epsilon(
            *_restrict(records, lam),
            delta,
            adjacency=adjacency,
            accountant=accountant,
            max_groups=max_groups,
        )
    return lc_composition_epsilon(
        records,
        lam,
        delta,
        adjacency=adjacency,
        accountant=accountant,
    )


def lc_delta(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    epsilon: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> Deltas:
    """The charged δ of θ_λ at ``epsilon`` (same rule as ``lc_epsilon``)."""
    epsilon = check_epsilon(epsilon, zero=True)
    records, adjacency = check_lc_models(models, adjacency)
    if surrogate_is_bound(records, lam):
        return lc_surrogate_delta(
            *_restrict(records, lam),
            epsilon,
            adjacency=adjacency,
            accountant=accountant,
            max_groups=max_groups,
        )
    orders = accountant.orders
    _, _, support = _composition_parts(records, lam, adjacency)
    pld, mu = _composition_pld(records, adjacency, support, accountant)
    rdp = lc_composition_rdp(records, lam, adjacency=adjacency, accountant=accountant)
    return Deltas(
        pld=pld_delta(pld, epsilon),
        rdp=rdp_to_delta(orders, rdp, epsilon),
        closed_form=None if mu is None else gdp_delta(mu, epsilon),
    )


@dataclass(frozen=True)
class SurrogateFigure:
    """The per-step surrogate of θ_λ, reported beside the bound: μ, ε by PLD and RDP, and whether it
    is a proven bound for these models (``valid``: all declare state-independent gradients)."""

    mu: float
    epsilon: Epsilons
    valid: bool
    valid_when: str = SURROGATE_VALID_WHEN

    def to_dict(self) -> dict:
        e = self.epsilon
        out = {
            "mu": json_number(self.mu),
            "pld": json_number(e.pld),
            "rdp": json_number(e.rdp),
            "valid": self.valid,
            "valid_when": self.valid_when,
        }
        if e.notes:
            out["notes"] = list(e.notes)
        return out


@dataclass(frozen=True)
class LCReport:
    """What an LC merge costs: ``epsilon`` is the charged, proven bound (``bound`` names it:
    "composition" or "surrogate"); ``surrogate`` the per-step surrogate figure, None for
    Poisson-subsampled models (it is not defined there)."""

    bound: str
    epsilon: Epsilons
    surrogate: SurrogateFigure | None
    support: tuple[int, ...]


def lc_report(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    delta: float,
    *,
    adjacency: str | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> LCReport:
    """The charged bound of θ_λ at ``delta`` and the surrogate figure beside it."""
    delta = check_delta(delta)
    records, adjacency = check_lc_models(models, adjacency)
    support = lc_support(lam, len(records))
    surrogate = None
    active, weights = _restrict(records, lam)
    if all(m.full_batch for m in active):
        segments = lc_segments(active, adjacency=adjacency)
        eps = lc_surrogate_epsilon(
            segments,
            weights,
            delta,
            accountant=accountant,
            max_groups=max_groups,
        )
        surrogate = SurrogateFigure(segments.mu(weights), eps, surrogate_is_bound(records, lam))
    if surrogate is not None and surrogate.valid:
        return LCReport("surrogate", surrogate.epsilon, surrogate, support)
    eps = lc_composition_epsilon(
        records,
        lam,
        delta,
        adjacency=adjacency,
        accountant=accountant,
    )
    return LCReport("composition", eps, surrogate, support)


# ---- the accountant's interpretation of an LC merge event -------------------------------------


@rdp_of(LinearCombinationMerge)
def _lc_event_rdp(accountant: Accountant, e: LinearCombinationMerge) -> np.ndarray:
    if e.scored is not None:
        return scored_rdp(accountant, e.models, e.scored, e.adjacency)
    return lc_rdp(list(e.models), np.asarray(e.lam), adjacency=e.adjacency, accountant=accountant)


@pld_of(LinearCombinationMerge)
def _lc_event_pld(accountant: Accountant, e: LinearCombinationMerge) -> pldm.PLD:
    if e.scored is not None:
        return scored_pld(accountant, e.models, e.scored, e.adjacency)
    return lc_pld(list(e.models), np.asarray(e.lam), adjacency=e.adjacency, accountant=accountant)[0]


__all__ = [
    "BOUNDS",
    "NO_FREE_LUNCH",
    "SURROGATE_VALID_WHEN",
    "LCReport",
    "LCSegments",
    "SurrogateFigure",
    "check_lc_models",
    "lc_bound",
    "lc_composition_epsilon",
    "lc_composition_pld",
    "lc_composition_rdp",
    "lc_delta",
    "lc_epsilon",
    "lc_pld",
    "lc_rdp",
    "lc_report",
    "lc_segments",
    "lc_support",
    "lc_surrogate_delta",
    "lc_surrogate_epsilon",
    "lc_surrogate_mu",
    "lc_surrogate_pld",
    "lc_surrogate_rdp",
    "surrogate_is_bound",
]
