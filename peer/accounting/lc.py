"""Linear combination (LC): release θ_λ = Σ_i λ_i θ_i of independent full-batch DP-SGD runs.

Unit of privacy: one training record under the merge's adjacency; all models were trained on the
same dataset with the same public initialisation θ_0 and declared size n; λ (convex weights) is
public.

Accounting (DESIGN.md; Yin, Zaheer & Li 2026, arXiv:2604.20985, the LC analysis for DP-GD): step t
of every run is paired with step t of the others. Model i contributes the update
−λ_i η_{i,t} (Σ_j clip_{C_{i,t}}(g_ij) + σ_{i,t} C_{i,t} z_{i,t}) / n, so the combined step t is a
Gaussian mechanism with

    noise std     s_t = sqrt(Σ_i (λ_i η_{i,t} σ_{i,t} C_{i,t})²)            (independent noises)
    sensitivity   Δ_t = k · Σ_i λ_i η_{i,t} C_{i,t}                          (triangle inequality)

with k = 2 for replace-one and k = 1 for add-remove (``events``), the common 1/n cancelling.
A model with T_i < T = max_i T_i steps is padded to T with steps in which its parameters do not
change: no gradient and no noise, so it adds nothing to Δ_t or s_t for t ≥ T_i. (Counting noise
for those steps would claim noise that is not in θ_i; DESIGN.md's "noise-only padding" is read
this way.) Composing the T steps:

- RDP: Σ_t order·Δ_t²/(2 s_t²) = order·μ²/2;
- closed form: μ-GDP with μ = sqrt(Σ_t (Δ_t/s_t)²) (Dong, Roth & Su 2022, Cor. 3.3);
- PLD: numerical FFT composition of the per-step Gaussian PLDs, steps with equal Δ_t/s_t grouped
  and self-composed; it must agree with the closed form (tests: 1e-3 relative).

LC is refused for Poisson-subsampled runs (the analysis is for full batch) and for models known
only by (ε_i, δ_i) (no free lunch: from the final guarantees alone an LC can be no better than
releasing every model).

What this rests on. Treating combined step t as a Gaussian mechanism composed adaptively needs
each step's clipped gradients to be determined by public values and the released history. That
holds exactly when the gradient does not depend on the model's own state (e.g. linear losses; then
θ_λ is one Gaussian mechanism and μ above is exact). For general losses each run's state θ_{i,t}
is *not* released by the combination, and the bound is the merging paper's LC theorem for
full-batch DP-GD, which this module implements as DESIGN.md states it; the accountant cannot check
that theorem's hypotheses. The alternative with no extra assumption is the composition of all
models (``profiles``), which is always an upper bound for θ_λ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from peer.accounting import pld as pldm
from peer.accounting.conversions import (DEFAULT_ORDERS, Deltas, Epsilons, check_delta, check_epsilon,
                                         check_orders, gdp_delta, gdp_epsilon, pld_delta, pld_epsilon,
                                         rdp_to_delta, rdp_to_epsilon)
from peer.accounting.events import ApproxDP, TrainingRecord, check_adjacency
from peer.accounting.profiles import DEFAULT_INTERVAL, PrivacyProfile, resolve_adjacency
from peer.accounting.rdp import rdp_gaussian
from peer.accounting.rs import check_weights
from peer.errors import InvalidArgument

DEFAULT_MAX_GROUPS = 32

NO_FREE_LUNCH = (
    "LC needs every model's per-step hyperparameters (learning_rate, clip_norm, noise_multiplier "
    "per step); this model is known only by its final (epsilon, delta). No free lunch: from final "
    "guarantees alone a linear combination can be no more private than releasing every model "
    "together (their composition). Use RS, which works with (epsilon, delta)-only models.")


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
        std = np.sqrt((self.noise ** 2) @ (lam ** 2))
        with np.errstate(divide="ignore", invalid="ignore"):
            mu = np.where(delta == 0, 0.0, delta / std)
        return mu

    def mu(self, lam: np.ndarray) -> float:
        mu_s = self.step_ratios(lam)
        if np.any(np.isinf(mu_s)):
            return math.inf
        return float(math.sqrt(float(np.dot(self.counts, mu_s ** 2))))

    def mu_many(self, lams: np.ndarray) -> np.ndarray:
        """μ for each row of ``lams`` (m × k), vectorised (for searches over λ)."""
        lams = np.array([_effective(row) for row in np.atleast_2d(lams)])
        delta = self.k * (self.signal @ lams.T)
        var = (self.noise ** 2) @ (lams ** 2).T
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio_sq = np.where(delta == 0, 0.0, delta ** 2 / var)
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


def _check_lc_models(models: Sequence, adjacency: str | None) -> tuple[list[TrainingRecord], str]:
    if not models:
        raise InvalidArgument("models", "must contain at least one model")
    for i, m in enumerate(models):
        if isinstance(m, ApproxDP) or (isinstance(m, PrivacyProfile) and m.source == "approx-dp"):
            raise InvalidArgument(f"models[{i}]", NO_FREE_LUNCH)
        if isinstance(m, PrivacyProfile):
            raise InvalidArgument(f"models[{i}]", "LC needs the TrainingRecord (per-step hyperparameters), not a precomputed profile")
        if not isinstance(m, TrainingRecord):
            raise InvalidArgument(f"models[{i}]", f"must be a TrainingRecord, got {type(m).__name__}")
        for t_start, (step, count) in zip(np.cumsum([0] + [n for _, n in m.runs]), m.runs):
            if step.sample_rate != 1.0:
                raise InvalidArgument(
                    f"models[{i}].steps[{int(t_start)}].sample_rate",
                    f"LC is accounted for full-batch DP-SGD only (sample_rate 1), got {step.sample_rate}; "
                    "Poisson-subsampled models can be merged by RS")
    adjacency = resolve_adjacency(list(models), adjacency)
    return list(models), check_adjacency(adjacency)


def lc_segments(models: Sequence[TrainingRecord], *, adjacency: str | None = None) -> LCSegments:
    """Cut the padded pool (T = max T_i) into segments of constant hyperparameters."""
    records, adjacency = _check_lc_models(models, adjacency)
    bounds = set()
    per_model = []
    for r in records:
        ends = np.cumsum([n for _, n in r.runs])
        bounds.update(int(e) for e in ends)
        per_model.append((ends, np.array([s.learning_rate * s.clip_norm for s, _ in r.runs]),
                          np.array([s.learning_rate * s.noise_multiplier * s.clip_norm for s, _ in r.runs])))
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


def lc_mu(models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], *, adjacency: str | None = None) -> float:
    """μ = sqrt(Σ_t (Δ_t/s_t)²) of the LC release (μ-GDP)."""
    segments, lam = _segments_and_weights(models, lam, adjacency)
    return segments.mu(lam)


def lc_rdp(models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], *, adjacency: str | None = None,
           orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """Σ_t order·Δ_t²/(2 s_t²) at every order."""
    return rdp_gaussian(lc_mu(models, lam, adjacency=adjacency), check_orders(orders))


def _split_blocks(values: np.ndarray, counts: np.ndarray, max_groups: int) -> list[tuple[int, int]]:
    """Cut sorted ``values`` into at most ``max_groups`` consecutive blocks, greedily splitting the
    block whose rounding-up costs most, at its best point. The cost of block [i, j] is the growth
    of μ² when every step in it takes the block's largest value: v_j²·Σn − Σ n v²."""
    w = counts.astype(float)
    cum_n = np.concatenate([[0.0], np.cumsum(w)])
    cum_s = np.concatenate([[0.0], np.cumsum(w * values ** 2)])

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
        return [(float(v), int(n)) for v, n in zip(values, totals)], None
    blocks = _split_blocks(values, totals, max_groups)
    groups = [(float(values[j]), int(totals[i:j + 1].sum())) for i, j in blocks]
    exact = math.sqrt(float(np.dot(totals, values ** 2)))
    rounded = math.sqrt(sum(n * v * v for v, n in groups))
    return groups, (f"FFT composition rounded {values.size} distinct per-step ratios up into {len(groups)} groups: "
                    f"mu {exact:.6g} -> {rounded:.6g} (sound, conservative by {rounded / exact - 1:.2e} relative)")


def lc_pld_fft(models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], *, adjacency: str | None = None,
               value_discretization_interval: float = DEFAULT_INTERVAL,
               max_groups: int = DEFAULT_MAX_GROUPS) -> tuple[pldm.PLD, tuple[str, ...]]:
    """PLD of the LC release by numerical composition of the per-step Gaussian PLDs (dp-accounting
    PLD per distinct Δ_t/s_t, ``self_compose`` per group, FFT ``compose`` across groups).
    Returns (pld, notes); a note is present when steps had to be rounded into groups."""
    interval = pldm.check_interval(value_discretization_interval)
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
        raise InvalidArgument("max_groups", f"must be a positive integer, got {max_groups!r}")
    segments, lam = _segments_and_weights(models, lam, adjacency)
    mu_s = segments.step_ratios(lam)
    if np.any(np.isinf(mu_s)):
        return pldm.non_private_pld(interval), ()
    groups, note = _group_ratios(segments.counts, mu_s, max_groups)
    parts = [pldm.self_compose(pldm.gaussian_pld(v, interval), n) for v, n in groups]
    return pldm.compose_plds(parts, interval), (() if note is None else (note,))


def _lc_bounds(models, lam, adjacency, orders, interval, max_groups):
    """The PLD (FFT), RDP curve and μ of θ_λ, and notes: what lc_epsilon and lc_delta convert."""
    segments, lam = _segments_and_weights(models, lam, adjacency)
    mu = segments.mu(lam)
    pld, notes = lc_pld_fft(segments, lam, value_discretization_interval=interval, max_groups=max_groups)
    orders = check_orders(orders)
    return pld, orders, rdp_gaussian(mu, orders), mu, notes


def lc_epsilon(models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], delta: float, *,
               adjacency: str | None = None, orders: Sequence[float] = DEFAULT_ORDERS,
               value_discretization_interval: float = DEFAULT_INTERVAL,
               max_groups: int = DEFAULT_MAX_GROUPS) -> Epsilons:
    """ε of θ_λ at ``delta``: ``pld`` (FFT composition), ``closed_form`` (μ-GDP), ``rdp``."""
    delta = check_delta(delta)
    pld, orders, rdp, mu, notes = _lc_bounds(models, lam, adjacency, orders, value_discretization_interval, max_groups)
    return Epsilons(pld=pld_epsilon(pld, delta), rdp=rdp_to_epsilon(orders, rdp, delta),
                    closed_form=gdp_epsilon(mu, delta), notes=notes)


def lc_delta(models: Sequence[TrainingRecord] | LCSegments, lam: Sequence[float], epsilon: float, *,
             adjacency: str | None = None, orders: Sequence[float] = DEFAULT_ORDERS,
             value_discretization_interval: float = DEFAULT_INTERVAL,
             max_groups: int = DEFAULT_MAX_GROUPS) -> Deltas:
    """δ of θ_λ at ``epsilon`` by the three accountants."""
    epsilon = check_epsilon(epsilon)
    pld, orders, rdp, mu, notes = _lc_bounds(models, lam, adjacency, orders, value_discretization_interval, max_groups)
    return Deltas(pld=pld_delta(pld, epsilon), rdp=rdp_to_delta(orders, rdp, epsilon),
                  closed_form=gdp_delta(mu, epsilon), notes=notes)


__all__ = ["LCSegments", "NO_FREE_LUNCH", "lc_segments", "lc_mu", "lc_rdp", "lc_pld_fft", "lc_epsilon", "lc_delta"]
