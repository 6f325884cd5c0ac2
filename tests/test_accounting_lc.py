"""Linear combination: the charged bound (composition of the merged models, or the per-step
surrogate when every model declares state-independent gradients), the surrogate itself (padding,
closed form vs FFT), the exact counterexample where the surrogate is not a bound, refusals."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting import dp_event, pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.base.errors import InvalidArgument
from peer.dp.accounting import (
    DEFAULT_ORDERS,
    ApproxDP,
    GaussianStep,
    TrainingRecord,
    gdp_epsilon,
    lc_delta,
    lc_epsilon,
    lc_rdp,
    lc_report,
    lc_segments,
    model_epsilon,
    privacy_profile,
    rdp_to_epsilon,
)
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.lc import (
    lc_composition_rdp,
    lc_surrogate_delta,
    lc_surrogate_epsilon,
    lc_surrogate_mu,
    lc_surrogate_rdp,
    surrogate_is_bound,
)


def piecewise(adjacency, phases):
    """phases: [(count, learning_rate, clip_norm, noise_multiplier), ...]"""
    steps = []
    for n, lr, clip, sigma in phases:
        steps += [GaussianStep(lr, clip, sigma)] * n
    return TrainingRecord(adjacency, tuple(steps))


# Step-decay schedules, different clip norms and lengths (padding), μ ≈ 1–2 so ε is moderate.
HETERO = [
    piecewise("replace-one", [(3000, 0.2, 1.0, 160.0), (4000, 0.1, 1.0, 160.0), (3000, 0.05, 0.5, 120.0)]),
    piecewise("replace-one", [(2000, 0.1, 2.0, 240.0), (5000, 0.1, 1.0, 200.0)]),
    piecewise("replace-one", [(1500, 0.3, 1.0, 180.0), (1000, 0.1, 1.0, 180.0)]),
]


def brute_force_mu(models, lam, k):
    """μ² = Σ_t Δ_t²/s_t² step by step, padding shorter runs with empty steps (the definition)."""
    T = max(m.num_steps for m in models)
    total = 0.0
    for t in range(T):
        delta = std2 = 0.0
        for m, w in zip(models, lam, strict=True):
            if t < m.num_steps:
                s = m.steps[t]
                delta += k * w * s.learning_rate * s.clip_norm
                std2 += (w * s.learning_rate * s.noise_multiplier * s.clip_norm) ** 2
        if delta > 0:
            total += delta * delta / std2
    return math.sqrt(total)


def test_lc_of_one_model_is_its_own_gaussian_composition():
    m = HETERO[0]
    own = model_epsilon(m, 1e-5)
    lc = lc_surrogate_epsilon([m], [1.0], 1e-5)
    assert lc.closed_form == pytest.approx(own.closed_form, rel=1e-12)
    assert lc.pld == pytest.approx(own.pld, rel=1e-4)
    assert lc.rdp == pytest.approx(own.rdp, rel=1e-12)
    # And dp-accounting composing the same steps (σ relative to the replace-one sensitivity 2C).
    acc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    for n, sigma in ((3000, 160.0), (4000, 160.0), (3000, 120.0)):
        acc.compose(dp_event.GaussianDpEvent(sigma / 2), n)
    assert lc.rdp == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("lam", [(1 / 3, 1 / 3, 1 / 3), (0.6, 0.1, 0.3), (0.0, 0.2, 0.8), (0.0, 0.0, 1.0)])
def test_segments_match_step_by_step_definition(lam):
    assert lc_surrogate_mu(HETERO, lam) == pytest.approx(brute_force_mu(HETERO, lam, 2.0), rel=1e-12)
    assert lc_surrogate_mu(HETERO, lam, adjacency="add-remove") == pytest.approx(
        brute_force_mu(HETERO, lam, 1.0), rel=1e-12
    )


def test_padding_adds_no_noise():
    # Two identical constant models, one stopped halfway: after T/2 only the long one moves.
    long = TrainingRecord.constant("add-remove", 100, 0.1, 1.0, 4.0)
    short = TrainingRecord.constant("add-remove", 50, 0.1, 1.0, 4.0)
    lam = (0.5, 0.5)
    # First 50 steps: Δ = 0.1, s = 0.1·4·sqrt(0.5) -> (Δ/s)² = 1/8; last 50: Δ = 0.05, s = 0.2 -> 1/16.
    assert lc_surrogate_mu([long, short], lam) == pytest.approx(math.sqrt(50 / 8 + 50 / 16), rel=1e-12)


def test_two_identical_independent_runs_combine_to_sqrt_two_times_mu():
    m = TrainingRecord.constant("replace-one", 400, 0.1, 1.0, 40.0)
    single = lc_surrogate_mu([m], [1.0])
    assert lc_surrogate_mu([m, m], [0.5, 0.5]) == pytest.approx(math.sqrt(2) * single, rel=1e-12)


def test_closed_form_equals_fft_composition_heterogeneous():
    for lam in ((1 / 3, 1 / 3, 1 / 3), (0.1, 0.8, 0.1)):
        eps = lc_surrogate_epsilon(HETERO, lam, 1e-5)
        assert not eps.notes  # exact grouping, no rounding
        assert eps.pld == pytest.approx(eps.closed_form, rel=1e-3)
        assert eps.pld >= eps.closed_form * (1 - 1e-6)  # pessimistic discretisation
        d = lc_surrogate_delta(HETERO, lam, eps.closed_form)
        assert d.pld == pytest.approx(1e-5, rel=1e-2) and d.closed_form == pytest.approx(1e-5, rel=1e-6)


def test_fft_rounding_for_many_distinct_steps_is_sound():
    # A cosine learning-rate schedule: every step differs. The FFT path rounds the per-step ratios
    # up into at most max_groups groups (sound: may only increase ε), says so in a note, and still
    # agrees with the exact closed form to 1e-3 with the default 32 groups.
    T = 2000
    lrs = 0.06 + 0.05 * np.cos(np.linspace(0, np.pi, T))
    cosine = TrainingRecord("replace-one", tuple(GaussianStep(float(lr), 1.0, 60.0) for lr in lrs))
    other = TrainingRecord.constant("replace-one", 1500, 0.08, 1.0, 50.0)
    coarse = lc_surrogate_epsilon(
        [cosine, other], [0.5, 0.5], 1e-5, max_groups=4, accountant=Accountant(value_discretization_interval=1e-3)
    )
    eps = lc_surrogate_epsilon([cosine, other], [0.5, 0.5], 1e-5)
    for e in (coarse, eps):
        assert e.notes and "rounded" in e.notes[0]
        assert e.pld >= e.closed_form * (1 - 1e-6)
    assert eps.pld == pytest.approx(eps.closed_form, rel=1e-3)
    assert coarse.pld > eps.pld


def test_lc_rdp_is_order_mu_squared_over_two():
    mu = lc_surrogate_mu(HETERO, (0.2, 0.3, 0.5))
    r = lc_surrogate_rdp(HETERO, (0.2, 0.3, 0.5))
    np.testing.assert_allclose(r, np.array(DEFAULT_ORDERS) * mu * mu / 2, rtol=1e-12)
    assert rdp_to_epsilon(DEFAULT_ORDERS, r, 1e-5) >= gdp_epsilon(mu, 1e-5)


def test_lc_equals_dp_accounting_pld_of_the_composed_gaussians():
    lam = (0.5, 0.2, 0.3)
    seg = lc_segments(HETERO)
    mu_s = seg.step_ratios(np.array(lam))
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    for n, m in zip(seg.counts, mu_s, strict=True):
        acc.compose(dp_event.GaussianDpEvent(1 / m), int(n))
    assert lc_surrogate_epsilon(
        HETERO, lam, 1e-5, accountant=Accountant(value_discretization_interval=1e-3)
    ).pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0).map(lambda w: 0.0 if w < 1e-9 else w), min_size=3, max_size=3).filter(
        lambda w: sum(w) > 0.05
    )
)
def test_lc_mu_invariants(weights):
    lam = np.array(weights) / sum(weights)
    seg = lc_segments(HETERO)
    mu = seg.mu(lam)
    # μ is scale-invariant in λ and, per step, Δ_t/s_t is at least the best single model's ratio
    # among the active ones (Cauchy–Schwarz lower bound) and at most sqrt(#active) × the worst.
    assert seg.mu_many(np.vstack([lam, 3 * lam])) == pytest.approx([mu, mu], rel=1e-12)
    ratios = seg.signal / np.where(seg.noise > 0, seg.noise, np.inf)
    active = (lam[None, :] > 0) & (seg.signal > 0)
    mu_s = seg.step_ratios(lam)
    for s in range(seg.counts.size):
        if active[s].any():
            r = 2 * ratios[s, active[s]]
            assert r.min() * (1 - 1e-12) <= mu_s[s] <= r.max() * math.sqrt(active[s].sum()) * (1 + 1e-12)


def test_lc_refusals():
    for fn in (lc_epsilon, lc_surrogate_epsilon):
        with pytest.raises(InvalidArgument, match=r"no free lunch|No free lunch") as e:
            fn([HETERO[0], ApproxDP(1.0, 1e-6, "replace-one")], [0.5, 0.5], 1e-5)
        assert e.value.field == "models[1]"
        with pytest.raises(InvalidArgument, match="mix adjacencies"):
            fn([HETERO[0], TrainingRecord.constant("add-remove", 10, 0.1, 1.0, 1.0)], [0.5, 0.5], 1e-5)
        with pytest.raises(InvalidArgument, match="sum to 1"):
            fn(HETERO, [0.5, 0.5, 0.5], 1e-5)
        with pytest.raises(InvalidArgument, match=r"lam\[0\]"):
            fn(HETERO, [-0.5, 1.0, 0.5], 1e-5)
    # The surrogate is defined for full batch only; the charged composition bound is not.
    poisson = TrainingRecord.constant("replace-one", 10, 0.1, 1.0, 1.0, 0.1)
    with pytest.raises(InvalidArgument, match="full-batch") as e:
        lc_surrogate_epsilon([HETERO[0], poisson], [0.5, 0.5], 1e-5)
    assert e.value.field == "models[1].steps[0].sample_rate"
    report = lc_report(
        [HETERO[0], poisson], [0.5, 0.5], 1e-5, accountant=Accountant(value_discretization_interval=1e-3)
    )
    assert report.bound == "composition" and report.surrogate is None and report.epsilon.closed_form is None
    # a Poisson model with weight 0 does not stop the surrogate figure
    assert lc_report([HETERO[0], poisson], [1.0, 0.0], 1e-5).surrogate is not None


def test_unnoised_model_alone_is_non_private():
    bare = TrainingRecord.constant("replace-one", 10, 0.1, 1.0, 0.0)
    for fn in (lc_epsilon, lc_surrogate_epsilon):
        eps = fn([HETERO[2], bare], [0.0, 1.0], 1e-5)
        assert eps.pld == math.inf and eps.closed_form == math.inf and eps.rdp == math.inf
        assert fn([HETERO[2], bare], [1.0, 0.0], 1e-5).pld < math.inf
    assert lc_epsilon([HETERO[2], bare], [0.5, 0.5], 1e-5).pld == math.inf


# ---------------------------------------------------------------- the charged bound: composition


def _declared(record):
    return TrainingRecord(record.adjacency, record.steps, state_independent_gradients=True)


# The paper's pair: a (σ = 10) and b (σ = 40), T = 100, η = 0.1, C = 1, full batch, replace-one.
PAPER_A = TrainingRecord.constant("replace-one", 100, 0.1, 1.0, 10.0)
PAPER_B = TrainingRecord.constant("replace-one", 100, 0.1, 1.0, 40.0)


def test_paper_pair_is_charged_the_composition_and_reports_the_surrogate():
    report = lc_report([PAPER_A, PAPER_B], [0.5, 0.5], 1e-5)
    # own μ: 2·sqrt(100)/10 = 2 and 2·sqrt(100)/40 = 0.5 -> composition μ = sqrt(4.25)
    assert report.bound == "composition" and report.support == (0, 1)
    assert report.epsilon.closed_form == pytest.approx(gdp_epsilon(math.sqrt(4.25), 1e-5), rel=1e-12)
    assert report.epsilon.pld == pytest.approx(10.378, abs=1e-3)
    assert report.epsilon.pld >= report.epsilon.closed_form * (1 - 1e-9)
    # surrogate: Δ_t = 2·(0.05 + 0.05), s_t = sqrt(0.5² + 2²) -> μ = 10·0.2/sqrt(4.25)
    sur = report.surrogate
    assert not sur.valid and "state-independent" in sur.valid_when
    assert sur.mu == pytest.approx(10 * 0.2 / math.sqrt(4.25), rel=1e-12) and sur.mu == pytest.approx(0.970, abs=5e-4)
    assert sur.epsilon.pld == pytest.approx(4.226, abs=1e-3)
    assert lc_epsilon([PAPER_A, PAPER_B], [0.5, 0.5], 1e-5) == report.epsilon


def test_composition_matches_dp_accounting():
    """Independent reference: dp-accounting composing every step of both models (full batch:
    Gaussian with σ/2 per step under replace-one; Poisson: its subsampled Gaussian event)."""
    eps = lc_epsilon([PAPER_A, PAPER_B], [0.3, 0.7], 1e-5, accountant=Accountant(value_discretization_interval=1e-3))
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    racc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    for a in (acc, racc):
        a.compose(dp_event.GaussianDpEvent(10.0 / 2), 100).compose(dp_event.GaussianDpEvent(40.0 / 2), 100)
    assert eps.pld == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)
    assert eps.rdp == pytest.approx(racc.get_epsilon(1e-5), rel=1e-9)
    # add-remove, a Poisson-subsampled model composed with a full-batch one (FFT path)
    poisson = TrainingRecord.constant("add-remove", 300, 0.1, 1.0, 1.2, 0.05)
    full = TrainingRecord.constant("add-remove", 50, 0.1, 1.0, 12.0)
    eps = lc_epsilon([poisson, full], [0.5, 0.5], 1e-5, accountant=Accountant(value_discretization_interval=1e-3))
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    racc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    for a in (acc, racc):
        a.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.2)), 300).compose(
            dp_event.GaussianDpEvent(12.0), 50
        )
    assert eps.pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-2)
    assert eps.rdp == pytest.approx(racc.get_epsilon(1e-5), rel=1e-6)


def test_only_models_with_positive_weight_are_composed():
    assert lc_epsilon([PAPER_A, PAPER_B], [0.0, 1.0], 1e-5).closed_form == pytest.approx(
        model_epsilon(PAPER_B, 1e-5).closed_form
    )
    np.testing.assert_allclose(
        lc_rdp(HETERO, [0.5, 0.0, 0.5]), privacy_profile(HETERO[0]).rdp + privacy_profile(HETERO[2]).rdp, rtol=1e-12
    )
    # two runs with the same hyperparameters are two releases: both count
    assert lc_epsilon([PAPER_A, PAPER_A], [0.5, 0.5], 1e-5).closed_form == pytest.approx(
        gdp_epsilon(math.sqrt(8), 1e-5)
    )


def test_the_declaration_decides_the_bound():
    a, b = _declared(PAPER_A), _declared(PAPER_B)
    assert surrogate_is_bound([a, b]) and not surrogate_is_bound([a, PAPER_B])
    both = lc_report([a, b], [0.5, 0.5], 1e-5)
    assert both.bound == "surrogate" and both.surrogate.valid and both.epsilon == both.surrogate.epsilon
    assert lc_epsilon([a, b], [0.5, 0.5], 1e-5).closed_form == pytest.approx(
        gdp_epsilon(0.970142500145332, 1e-5), rel=1e-9
    )
    np.testing.assert_allclose(lc_rdp([a, b], [0.5, 0.5]), lc_surrogate_rdp([a, b], [0.5, 0.5]), rtol=1e-12)
    mixed = lc_report([a, PAPER_B], [0.5, 0.5], 1e-5)
    assert mixed.bound == "composition" and not mixed.surrogate.valid
    # an undeclared model with weight 0 does not matter: θ_λ does not depend on it
    assert lc_report([a, PAPER_B], [1.0, 0.0], 1e-5).bound == "surrogate"
    d = lc_delta([a, b], [0.5, 0.5], both.epsilon.closed_form)
    assert d.closed_form == pytest.approx(1e-5, rel=1e-6)
    d = lc_delta([PAPER_A, PAPER_B], [0.5, 0.5], 10.378239459426307)
    assert d.closed_form == pytest.approx(1e-5, rel=1e-6) and d.pld == pytest.approx(1e-5, rel=2e-2)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0).map(lambda w: 0.0 if w < 1e-6 else w), min_size=3, max_size=3).filter(
        lambda w: sum(w) > 0.05
    )
)
def test_surrogate_never_exceeds_the_composition(weights):
    """Per step, Δ_t/s_t ≤ sqrt(Σ_i (k/σ_i)²) over the active models (Cauchy–Schwarz), so the
    surrogate is always below the composition: declaring state independence can only lower the
    charge, which is why the declaration must be true."""
    lam = np.array(weights) / sum(weights)
    support = [i for i in range(3) if lam[i] > 0]
    composed = math.sqrt(sum(privacy_profile(HETERO[i]).mu ** 2 for i in support))
    assert lc_surrogate_mu(HETERO, lam) <= composed * (1 + 1e-12)
    np.testing.assert_allclose(lc_composition_rdp(HETERO, lam), np.array(DEFAULT_ORDERS) * composed**2 / 2, rtol=1e-9)


# ---------------------------------------------- the counterexample: the surrogate is not a bound

# Two full-batch DP-GD runs on the same n records, replace-one, C = 1, T = 400, η = 0.5, λ = (½, ½),
# update t ← t − η(Σ_j clip(∇ℓ_j(t)) + σCz)/n, t_0 = 0. Model 1: ℓ_j(t) = a_j·t, a_j ∈ [−C, C],
# σ = 5 (state-independent). Model 2: ℓ_j(t) = (t − 0.3)²/2, σ = 100, never clipped (|t − 0.3| < C).
CE = {"n": 100_000, "clip": 1.0, "steps": 400, "eta": 0.5, "sigma": (5.0, 100.0), "lam": (0.5, 0.5)}


def exact_mu(n, clip, steps, eta, sigma, lam):
    """θ_λ is exactly Gaussian under both datasets. Model 1: t_T = −η Σ_t (A + σ₁Cz_t)/n, with A
    the gradient sum; neighbouring datasets (one a_j from −C to +C) shift A by 2C, so the mean of
    θ_λ shifts by λ₁ηT·2C/n and model 1 adds variance λ₁²T(ησ₁C/n)². Model 2: t_{k+1} − 0.3 =
    (1 − η)(t_k − 0.3) − ησ₂Cz_k/n does not see the data; its noise decays by (1 − η) per step:
    variance λ₂²(ησ₂C/n)² Σ_{k<T} (1 − η)^{2k}. μ = shift / std."""
    shift = lam[0] * eta * steps * 2 * clip / n
    var = lam[0] ** 2 * steps * (eta * sigma[0] * clip / n) ** 2
    var += lam[1] ** 2 * (eta * sigma[1] * clip / n) ** 2 * sum((1 - eta) ** (2 * k) for k in range(steps))
    return shift / math.sqrt(var)


def simulate(n, clip, steps, eta, sigma, lam, a_changed, replicas, rng):
    """θ_λ after running both models' DP-GD updates step by step, for the dataset whose gradient
    sum of model 1 is A = a_changed (all other a_j = 0). Returns (θ_λ samples, max |t₂ − 0.3|)."""
    t1 = np.zeros(replicas)
    t2 = np.zeros(replicas)
    far = 0.0
    for _ in range(steps):
        g1 = np.full(replicas, float(np.clip(a_changed, -clip, clip)))
        g2 = n * (t2 - 0.3)  # Σ_j of the unclipped per-record gradient t − 0.3
        far = max(far, float(np.max(np.abs(t2 - 0.3))))
        t1 = t1 - eta * (g1 + sigma[0] * clip * rng.standard_normal(replicas)) / n
        t2 = t2 - eta * (g2 + sigma[1] * clip * rng.standard_normal(replicas)) / n
    return lam[0] * t1 + lam[1] * t2, far


def _counterexample_models(declare_second=False):
    m1 = TrainingRecord.constant(
        "replace-one", CE["steps"], CE["eta"], CE["clip"], CE["sigma"][0], state_independent_gradients=True
    )
    m2 = TrainingRecord.constant(
        "replace-one", CE["steps"], CE["eta"], CE["clip"], CE["sigma"][1], state_independent_gradients=declare_second
    )
    return [m1, m2]


def test_counterexample_exact_mu():
    mu = exact_mu(**CE)
    # the closed form of the reference: shift 200/n, variance (625 + 2500/3)/n² (infinite series)
    assert mu == pytest.approx(200 / math.sqrt(625 + 2500 / 3), rel=1e-12)
    assert mu == pytest.approx(5.237, abs=5e-4)
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(35.32, abs=5e-3)


def test_counterexample_monte_carlo_matches_the_exact_mu():
    """R = 50,000 runs per dataset. μ̂ = (mean_D' − mean_D)/pooled std has standard error about
    sqrt(2/R + μ²/(4R)) ≈ 0.0105; the sample variance has relative standard error sqrt(1/R) ≈
    0.0045 per dataset. Tolerances of 5 standard errors: false-failure rate below 1e-6 each."""
    rng = np.random.default_rng(20260519)
    replicas = 50_000
    theta_d, far_d = simulate(**CE, a_changed=-CE["clip"], replicas=replicas, rng=rng)
    theta_e, far_e = simulate(**CE, a_changed=+CE["clip"], replicas=replicas, rng=rng)
    assert max(far_d, far_e) < CE["clip"]  # model 2 is never clipped
    mu = exact_mu(**CE)
    n, eta, clip, steps, lam = CE["n"], CE["eta"], CE["clip"], CE["steps"], CE["lam"]
    var = (lam[0] * eta * steps * 2 * clip / n / mu) ** 2
    for theta in (theta_d, theta_e):
        assert theta.var() == pytest.approx(var, rel=5 * math.sqrt(1 / replicas))
    pooled = math.sqrt((theta_d.var() + theta_e.var()) / 2)
    mu_hat = (theta_d.mean() - theta_e.mean()) / pooled  # model 1 moves against its gradient
    assert abs(mu_hat - mu) < 5 * math.sqrt(2 / replicas + mu * mu / (4 * replicas))


def test_counterexample_the_charged_bound_covers_the_truth_and_the_surrogate_is_flagged():
    models = _counterexample_models()
    exact = gdp_epsilon(exact_mu(**CE), 1e-5)  # 35.32
    report = lc_report(models, list(CE["lam"]), 1e-5)
    assert report.bound == "composition"
    assert report.epsilon.closed_form == pytest.approx(gdp_epsilon(math.sqrt(8**2 + 0.4**2), 1e-5), rel=1e-9)
    assert report.epsilon.pld >= exact and report.epsilon.rdp >= exact and report.epsilon.closed_form >= exact
    assert rdp_to_epsilon(DEFAULT_ORDERS, lc_rdp(models, list(CE["lam"])), 1e-5) >= exact
    sur = report.surrogate
    assert (
        not sur.valid and sur.mu == pytest.approx(0.799, abs=5e-4) and sur.epsilon.pld == pytest.approx(3.38, abs=5e-3)
    )
    assert sur.epsilon.pld < exact / 10  # it understates the true cost tenfold
    # A false declaration on model 2 would make the surrogate the charge: the declaration carries the proof.
    assert lc_report(_counterexample_models(declare_second=True), list(CE["lam"]), 1e-5).epsilon.pld < exact


# ------------------------------------------------------------------------------- the CLI


def test_account_lc_cli_reports_the_composition_and_the_surrogate(tmp_path):
    models = {
        "adjacency": "replace",
        "models": [
            {"name": "a", "steps": 100, "noise_multiplier": 10, "clip": 1, "learning_rate": 0.1, "sample_rate": 1},
            {"name": "b", "steps": 100, "noise_multiplier": 40, "clip": 1, "learning_rate": 0.1, "sample_rate": 1},
        ],
    }
    path = tmp_path / "M.json"
    path.write_text(json.dumps(models))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "account",
            "lc",
            "--models",
            str(path),
            "--weights",
            "0.5,0.5",
            "--delta",
            "1e-5",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bound"] == "composition"
    assert result["epsilon"]["pld"] == pytest.approx(10.378, abs=1e-3)
    assert result["epsilon"]["closed_form"] == pytest.approx(gdp_epsilon(math.sqrt(2**2 + 0.5**2), 1e-5), rel=1e-9)
    sur = result["surrogate"]
    assert set(sur) >= {"mu", "pld", "rdp", "valid_when"} and sur["valid"] is False
    assert sur["mu"] == pytest.approx(0.970, abs=5e-4) and sur["pld"] == pytest.approx(4.226, abs=1e-3)
    assert sur["rdp"] > sur["pld"]
    # declaring both models state-independent makes the surrogate the bound
    for m in models["models"]:
        m["state_independent_gradients"] = True
    path.write_text(json.dumps(models))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "account",
            "lc",
            "--models",
            str(path),
            "--weights",
            "0.5,0.5",
            "--delta",
            "1e-5",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
        check=False,
    )
    result = json.loads(out.stdout)
    assert result["bound"] == "surrogate" and result["surrogate"]["valid"] is True
    assert result["epsilon"]["pld"] == pytest.approx(4.226, abs=1e-3)
