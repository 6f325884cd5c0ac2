"""Random selection: single-model identity, bounds between models, soundness against the exact
hockey-stick divergence of a mixture, (ε, δ)-only models, bad input."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from peer.base.errors import InvalidArgument
from peer.dp.accounting import ApproxDP, TrainingRecord, model_epsilon, rs_delta, rs_epsilon, rs_profiles
from peer.dp.accounting.accountant import Accountant

INTERVAL = 1e-3
ACCOUNTANT = Accountant(value_discretization_interval=INTERVAL)
POOL = [TrainingRecord.constant("add-remove", 60, 0.1, 1.0, s) for s in (3.0, 6.0, 12.0)]
POISSON = [TrainingRecord.constant("add-remove", 300, 0.1, 1.0, s, q) for s, q in ((0.9, 0.05), (1.5, 0.1))]


@pytest.fixture(scope="module")
def pool_profiles():
    return rs_profiles(POOL + POISSON, accountant=ACCOUNTANT)


def test_single_model_rs_is_the_model(pool_profiles):
    for i, m in enumerate(POOL + POISSON):
        pi = np.eye(len(pool_profiles))[i]
        rs = rs_epsilon(pool_profiles, pi, 1e-5, accountant=ACCOUNTANT)
        own = model_epsilon(m, 1e-5, accountant=ACCOUNTANT)
        assert rs.pld == pytest.approx(own.pld, rel=1e-12)
        assert rs.rdp == pytest.approx(own.rdp, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5).filter(lambda w: sum(w) > 0.05),
    st.sampled_from([1e-3, 1e-5, 1e-8]),
)
def test_rs_between_most_and_least_private(pool_profiles, weights, delta):
    pi = np.array(weights) / sum(weights)
    rs = rs_epsilon(pool_profiles, pi, delta, accountant=ACCOUNTANT)
    used = [p.epsilon(delta) for p, w in zip(pool_profiles, pi, strict=True) if w > 0]
    for acc in ("pld", "rdp"):
        vals = [getattr(e, acc) for e in used]
        assert min(vals) - 1e-9 <= getattr(rs, acc) <= max(vals) + 1e-9


@settings(max_examples=15, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_rs_delta_monotone_in_epsilon_and_linear_in_pi(pool_profiles, w, eps):
    profiles = pool_profiles[:2]
    lo = rs_delta(profiles, [w, 1 - w], eps, accountant=ACCOUNTANT)
    hi = rs_delta(profiles, [w, 1 - w], eps + 0.5, accountant=ACCOUNTANT)
    assert hi.pld <= lo.pld + 1e-12 and hi.rdp <= lo.rdp + 1e-12
    # Symmetric full-batch PLDs: the mixed δ is exactly the weighted sum.
    d0, d1 = (p.delta(eps).pld for p in profiles)
    assert lo.pld == pytest.approx(w * d0 + (1 - w) * d1, rel=1e-9, abs=1e-15)


def test_rs_bound_is_sound_against_exact_mixture_divergence():
    # Two full-batch Gaussian models of one 1-D statistic, noise s_i, sensitivity 1: the released
    # value under D is the mixture Σπ_i N(0, s_i²), under D' Σπ_i N(1, s_i²). Its exact δ(ε) by
    # numerical integration must not exceed the RS bound Σπ_i δ_i(ε) (joint convexity).
    s = (0.8, 2.5)
    pi = (0.4, 0.6)
    models = [TrainingRecord.constant("add-remove", 1, 0.1, 1.0, sigma) for sigma in s]
    for eps in (0.5, 2.0):

        def hockey(x, sign, eps=eps):
            p = sum(w * stats.norm.pdf(x, 0 if sign > 0 else 1, sd) for w, sd in zip(pi, s, strict=True))
            q = sum(w * stats.norm.pdf(x, 1 if sign > 0 else 0, sd) for w, sd in zip(pi, s, strict=True))
            return max(p - math.exp(eps) * q, 0.0)

        exact = max(integrate.quad(hockey, -30, 30, args=(sign,), limit=400, points=[0, 1])[0] for sign in (1, -1))
        bound = rs_delta(models, pi, eps, accountant=Accountant(value_discretization_interval=1e-4))
        assert exact <= bound.pld + 1e-9
        assert bound.pld == pytest.approx(
            sum(
                w * stats.norm.sf(eps * sd - 1 / (2 * sd)) - w * math.exp(eps) * stats.norm.sf(eps * sd + 1 / (2 * sd))
                for w, sd in zip(pi, s, strict=True)
            ),
            rel=1e-3,
        )


def test_approx_dp_models_in_rs():
    m = ApproxDP(1.0, 1e-6, "add-remove")
    single = rs_epsilon([m], [1.0], 1e-6, accountant=Accountant(value_discretization_interval=1e-4))
    assert single.pld == pytest.approx(1.0, abs=1e-3) and single.rdp == math.inf
    mixed = rs_epsilon([m, POOL[2]], [0.5, 0.5], 1e-5, accountant=ACCOUNTANT)
    own = model_epsilon(POOL[2], 1e-5, accountant=ACCOUNTANT).pld
    assert 1.0 - 1e-3 <= mixed.pld <= own + 1e-9
    # δ_target below the catastrophic mass π·δ_i cannot be met.
    assert rs_epsilon([m, POOL[2]], [0.5, 0.5], 1e-7, accountant=ACCOUNTANT).pld == math.inf
    pure = ApproxDP(0.5, 0.0, "add-remove")
    assert rs_epsilon([pure, POOL[2]], [0.3, 0.7], 1e-5, accountant=ACCOUNTANT).rdp < math.inf


def test_mixed_adjacency_rs_needs_an_explicit_unit():
    a = TrainingRecord.constant("replace-one", 20, 0.1, 1.0, 4.0)
    b = ApproxDP(0.5, 1e-7, "add-remove")
    with pytest.raises(InvalidArgument, match="mix adjacencies"):
        rs_epsilon([a, b], [0.5, 0.5], 1e-5)
    # Under replace-one the add-remove (0.5, 1e-7) model counts as (1.0, (1+e^0.5)·1e-7).
    rep = rs_epsilon(
        [a, b], [0.0, 1.0], 1e-5, adjacency="replace-one", accountant=Accountant(value_discretization_interval=1e-4)
    )
    assert rep.pld == pytest.approx(
        model_epsilon(ApproxDP(1.0, (1 + math.exp(0.5)) * 1e-7, "replace-one"), 1e-5).pld, abs=1e-9
    )
    with pytest.raises(InvalidArgument):
        rs_epsilon([a, ApproxDP(0.5, 1e-7, "replace-one")], [0.5, 0.5], 1e-5, adjacency="add-remove")


@pytest.mark.parametrize(
    "pi, message",
    [
        ([0.5, 0.6, 0.0], "sum to 1"),
        ([1.2, -0.2, 0.0], r"pi\[1\]"),
        ([0.5, 0.5], "one weight per model"),
        ([0.5, math.nan, 0.5], "finite"),
        ("0.5,0.5,0", "list"),
    ],
)
def test_bad_weights(pi, message):
    with pytest.raises(InvalidArgument, match=message):
        rs_epsilon(POOL, pi, 1e-5)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_bad_delta(delta):
    with pytest.raises(InvalidArgument, match="delta"):
        rs_epsilon(POOL, [1, 0, 0], delta)
