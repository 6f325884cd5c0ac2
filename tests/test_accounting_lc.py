"""Linear combination: per-step Gaussian surrogate, padding, closed form vs FFT, refusals."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event, pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.accounting import (DEFAULT_ORDERS, ApproxDP, GaussianStep, TrainingRecord, gdp_epsilon, lc_delta,
                             lc_epsilon, lc_mu, lc_rdp, lc_segments, model_epsilon, rdp_to_epsilon)
from peer.errors import InvalidArgument


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
        for m, w in zip(models, lam):
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
    lc = lc_epsilon([m], [1.0], 1e-5)
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
    assert lc_mu(HETERO, lam) == pytest.approx(brute_force_mu(HETERO, lam, 2.0), rel=1e-12)
    assert lc_mu(HETERO, lam, adjacency="add-remove") == pytest.approx(brute_force_mu(HETERO, lam, 1.0), rel=1e-12)


def test_padding_adds_no_noise():
    # Two identical constant models, one stopped halfway: after T/2 only the long one moves.
    long = TrainingRecord.constant("add-remove", 100, 0.1, 1.0, 4.0)
    short = TrainingRecord.constant("add-remove", 50, 0.1, 1.0, 4.0)
    lam = (0.5, 0.5)
    # First 50 steps: Δ = 0.1, s = 0.1·4·sqrt(0.5) -> (Δ/s)² = 1/8; last 50: Δ = 0.05, s = 0.2 -> 1/16.
    assert lc_mu([long, short], lam) == pytest.approx(math.sqrt(50 / 8 + 50 / 16), rel=1e-12)


def test_two_identical_independent_runs_combine_to_sqrt_two_times_mu():
    m = TrainingRecord.constant("replace-one", 400, 0.1, 1.0, 40.0)
    single = lc_mu([m], [1.0])
    assert lc_mu([m, m], [0.5, 0.5]) == pytest.approx(math.sqrt(2) * single, rel=1e-12)


def test_closed_form_equals_fft_composition_heterogeneous():
    for lam in ((1 / 3, 1 / 3, 1 / 3), (0.1, 0.8, 0.1)):
        eps = lc_epsilon(HETERO, lam, 1e-5)
        assert not eps.notes                       # exact grouping, no rounding
        assert eps.pld == pytest.approx(eps.closed_form, rel=1e-3)
        assert eps.pld >= eps.closed_form * (1 - 1e-6)   # pessimistic discretisation
        d = lc_delta(HETERO, lam, eps.closed_form)
        assert d.pld == pytest.approx(1e-5, rel=1e-2) and d.closed_form == pytest.approx(1e-5, rel=1e-6)


def test_fft_rounding_for_many_distinct_steps_is_sound():
    # A cosine learning-rate schedule: every step differs. The FFT path rounds the per-step ratios
    # up into at most max_groups groups (sound: may only increase ε), says so in a note, and still
    # agrees with the exact closed form to 1e-3 with the default 32 groups.
    T = 2000
    lrs = 0.06 + 0.05 * np.cos(np.linspace(0, np.pi, T))
    cosine = TrainingRecord("replace-one", tuple(GaussianStep(float(lr), 1.0, 60.0) for lr in lrs))
    other = TrainingRecord.constant("replace-one", 1500, 0.08, 1.0, 50.0)
    coarse = lc_epsilon([cosine, other], [0.5, 0.5], 1e-5, max_groups=4, value_discretization_interval=1e-3)
    eps = lc_epsilon([cosine, other], [0.5, 0.5], 1e-5)
    for e in (coarse, eps):
        assert e.notes and "rounded" in e.notes[0]
        assert e.pld >= e.closed_form * (1 - 1e-6)
    assert eps.pld == pytest.approx(eps.closed_form, rel=1e-3)
    assert coarse.pld > eps.pld


def test_lc_rdp_is_order_mu_squared_over_two():
    mu = lc_mu(HETERO, (0.2, 0.3, 0.5))
    r = lc_rdp(HETERO, (0.2, 0.3, 0.5))
    np.testing.assert_allclose(r, np.array(DEFAULT_ORDERS) * mu * mu / 2, rtol=1e-12)
    assert rdp_to_epsilon(DEFAULT_ORDERS, r, 1e-5) >= gdp_epsilon(mu, 1e-5)


def test_lc_equals_dp_accounting_pld_of_the_composed_gaussians():
    lam = (0.5, 0.2, 0.3)
    seg = lc_segments(HETERO)
    mu_s = seg.step_ratios(np.array(lam))
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    for n, m in zip(seg.counts, mu_s):
        acc.compose(dp_event.GaussianDpEvent(1 / m), int(n))
    assert lc_epsilon(HETERO, lam, 1e-5, value_discretization_interval=1e-3).pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0.0, 1.0).map(lambda w: 0.0 if w < 1e-9 else w), min_size=3, max_size=3)
       .filter(lambda w: sum(w) > 0.05))
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
    with pytest.raises(InvalidArgument, match="no free lunch|No free lunch"):
        lc_epsilon([HETERO[0], ApproxDP(1.0, 1e-6, "replace-one")], [0.5, 0.5], 1e-5)
    poisson = TrainingRecord.constant("replace-one", 10, 0.1, 1.0, 1.0, 0.1)
    with pytest.raises(InvalidArgument, match="full-batch") as e:
        lc_epsilon([HETERO[0], poisson], [0.5, 0.5], 1e-5)
    assert e.value.field == "models[1].steps[0].sample_rate"
    with pytest.raises(InvalidArgument, match="mix adjacencies"):
        lc_epsilon([HETERO[0], TrainingRecord.constant("add-remove", 10, 0.1, 1.0, 1.0)], [0.5, 0.5], 1e-5)
    with pytest.raises(InvalidArgument, match="sum to 1"):
        lc_epsilon(HETERO, [0.5, 0.5, 0.5], 1e-5)
    with pytest.raises(InvalidArgument, match=r"lam\[0\]"):
        lc_epsilon(HETERO, [-0.5, 1.0, 0.5], 1e-5)


def test_unnoised_model_alone_is_non_private():
    bare = TrainingRecord.constant("replace-one", 10, 0.1, 1.0, 0.0)
    eps = lc_epsilon([HETERO[2], bare], [0.0, 1.0], 1e-5)
    assert eps.pld == math.inf and eps.closed_form == math.inf and eps.rdp == math.inf
    assert lc_epsilon([HETERO[2], bare], [1.0, 0.0], 1e-5).pld < math.inf
