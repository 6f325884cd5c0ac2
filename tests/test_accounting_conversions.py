"""Conversions, per-mechanism RDP and PLD builders, each against an independent reference."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event, gaussian_mechanism
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.base.errors import InvalidArgument
from peer.dp.accounting import DEFAULT_ORDERS, gdp_delta, gdp_epsilon, gdp_mu, rdp_to_delta, rdp_to_epsilon
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.rdp import (
    rdp_laplace,
    rdp_mixture,
    rdp_numerical_subsampled_gaussian,
    rdp_pure,
    rdp_subsampled_gaussian,
)

ORDERS = np.array(DEFAULT_ORDERS)


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 2.5, 10.0, 40.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-10])
def test_gdp_matches_analytic_gaussian(mu, delta):
    # dp-accounting's analytic Gaussian (Balle & Wang 2018) with σ = 1/μ is an independent implementation.
    assert gdp_epsilon(mu, delta) == pytest.approx(
        gaussian_mechanism.get_epsilon_gaussian(1 / mu, delta), rel=1e-9, abs=1e-12
    )
    eps = gdp_epsilon(mu, delta)
    if eps > 0:
        assert gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-8)
        assert gdp_mu(eps, delta) == pytest.approx(mu, rel=1e-9)


@pytest.mark.parametrize("T, expected", [(1, 4.377178), (10, 17.856587), (100, 91.817290), (1000, 633.929851)])
def test_references_sigma_one_compositions_closed_form(T, expected):
    # Independent figures (analytic GDP, Dong, Roth & Su 2019; dp-accounting 0.6): σ = 1, add/remove, δ = 1e-5: ε by PLD = analytic GDP with μ = sqrt(T).
    assert gdp_epsilon(math.sqrt(T), 1e-5) == pytest.approx(expected, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 20), st.floats(1e-12, 0.5), st.floats(1e-12, 0.5))
def test_epsilon_monotone_in_delta(mu, d1, d2):
    lo, hi = sorted((d1, d2))
    assert gdp_epsilon(mu, lo) >= gdp_epsilon(mu, hi) - 1e-12
    rdp = ORDERS * mu * mu / 2
    assert rdp_to_epsilon(ORDERS, rdp, lo) >= rdp_to_epsilon(ORDERS, rdp, hi) - 1e-12
    # RDP is never tighter than the exact Gaussian curve.
    assert rdp_to_epsilon(ORDERS, rdp, lo) >= gdp_epsilon(mu, lo) - 1e-9


def test_rdp_conversion_is_dp_accountings_and_clamps():
    acc = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS))
    acc.compose(dp_event.GaussianDpEvent(1.3), 50)
    assert rdp_to_epsilon(ORDERS, acc.rdp, 1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-12)
    assert rdp_to_delta(ORDERS, acc.rdp, 3.0) == pytest.approx(acc.get_delta(3.0), rel=1e-12)
    assert rdp_to_delta(ORDERS, np.full(ORDERS.shape, np.inf), 3.0) == 1.0
    assert rdp_to_epsilon(ORDERS, np.full(ORDERS.shape, np.inf), 1e-5) == math.inf
    with pytest.raises(InvalidArgument, match="delta"):
        rdp_to_epsilon(ORDERS, acc.rdp, 0.0)
    with pytest.raises(InvalidArgument, match="delta"):
        rdp_to_epsilon(ORDERS, acc.rdp, 1.0)


@pytest.mark.parametrize("epsilon", [0.01, 0.5, 2.0, 8.0])
def test_laplace_rdp_against_dp_accounting(epsilon):
    acc = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS))
    acc.compose(dp_event.LaplaceDpEvent(1 / epsilon))
    np.testing.assert_allclose(rdp_laplace(epsilon, ORDERS), acc.rdp, rtol=1e-9, atol=1e-14)


def test_laplace_rdp_superadditive_so_the_1d_bound_covers_vectors():
    # f(a) + f(b) <= f(a + b): the L1-sensitivity vector mechanism is bounded by the 1-D formula.
    grid = np.linspace(0.01, 5, 40)
    for order in (1.5, 2.0, 8.0, 64.0):
        f = {a: rdp_laplace(a, [order])[0] for a in grid}
        for a in grid:
            for b in grid[::7]:
                assert f[a] + rdp_laplace(b, [order])[0] <= rdp_laplace(a + b, [order])[0] + 1e-12


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 4.0])
def test_pure_dp_rdp_is_randomised_response(epsilon):
    # Binary randomised response with flip parameter p = 2/(1+e^ε) (dp-accounting's RR, k = 2).
    acc = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS), NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_event.RandomizedResponseDpEvent(2 / (1 + math.exp(epsilon)), 2))
    ours = rdp_pure(epsilon, ORDERS)
    np.testing.assert_allclose(ours, acc.rdp, rtol=1e-9, atol=1e-14)
    assert np.all(ours <= epsilon + 1e-12) and np.all(ours <= ORDERS * epsilon**2 / 2 + 1e-12)


@pytest.mark.parametrize("sigma, q", [(1.1, 0.01), (0.8, 0.3), (3.0, 0.5), (5.0, 0.001)])
def test_numerical_rdp_reproduces_dp_accounting_add_remove(sigma, q):
    # The integrator run on the add-remove pair must reproduce dp-accounting's exact integer-order
    # values; at fractional orders dp-accounting's series is an upper bound, so ours is <= it.
    ours = rdp_numerical_subsampled_gaussian(sigma, q, ORDERS, p_shift=1.0, q_shift=0.0)
    ref = np.array([rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(q, sigma, [a])[0] for a in ORDERS])
    integer = (np.round(ORDERS) == ORDERS) & np.isfinite(ref)
    np.testing.assert_allclose(ours[integer], ref[integer], rtol=1e-6, atol=1e-12)
    frac = ~integer & np.isfinite(ref)
    assert np.all(ours[frac] <= ref[frac] * (1 + 1e-6) + 1e-12)


def test_replace_one_rdp_full_batch_limit_and_ordering():
    np.testing.assert_allclose(
        rdp_numerical_subsampled_gaussian(1.3, 1.0, [2, 10, 1024], -1.0, 1.0),
        2 * np.array([2, 10, 1024]) / 1.3**2,
        rtol=1e-8,
    )
    add = rdp_subsampled_gaussian(1.1, 0.05, ORDERS, "add-remove")
    rep = rdp_subsampled_gaussian(1.1, 0.05, ORDERS, "replace-one")
    full = rdp_subsampled_gaussian(1.1, 1.0, ORDERS, "replace-one")
    assert np.all(rep >= add - 1e-12) and np.all(rep <= full)


@pytest.mark.parametrize("order", [2.0, 3.0])
def test_replace_one_rdp_monte_carlo(order):
    # No closed form: estimate E_Q[(P/Q)^order] from 400,000 samples of Q (fixed seed). The bound
    # is 6 standard errors of the mean (false-failure rate < 1e-8 by the CLT).
    sigma, q, n = 1.0, 0.2, 400_000
    rng = np.random.default_rng(12345)
    centre = np.where(rng.random(n) < q, 1.0, 0.0)
    x = centre + sigma * rng.standard_normal(n)

    def log_mix(x, shift):
        return np.logaddexp(math.log1p(-q) - x**2 / (2 * sigma**2), math.log(q) - (x - shift) ** 2 / (2 * sigma**2))

    ratio = np.exp(order * (log_mix(x, -1.0) - log_mix(x, 1.0)))
    mean, se = ratio.mean(), ratio.std() / math.sqrt(n)
    ours = math.exp((order - 1) * rdp_numerical_subsampled_gaussian(sigma, q, [order], -1.0, 1.0)[0])
    assert abs(ours - mean) < 6 * se


def test_rs_rdp_mixture_in_log_space():
    rdps = [np.array([1.0, 500.0, 2000.0]), np.array([0.5, 1.0, 3.0])]
    orders = [2.0, 64.0, 1024.0]
    mixed = rdp_mixture([0.5, 0.5], rdps, orders)
    assert np.all(np.isfinite(mixed))  # exp((order-1)·2000) would overflow
    a = np.array(orders)
    np.testing.assert_allclose(mixed[0], math.log(0.5 * math.exp(1.0) + 0.5 * math.exp(0.5)), rtol=1e-12)
    np.testing.assert_allclose(mixed[2], 2000.0 + math.log(0.5) / (a[2] - 1), rtol=1e-12)
    np.testing.assert_allclose(rdp_mixture([1.0, 0.0], [rdps[0], np.full(3, np.inf)], orders), rdps[0])


@pytest.mark.parametrize(
    "sigma, sens, q, relation",
    [
        (1.0, 1.0, 1.0, NeighboringRelation.ADD_OR_REMOVE_ONE),
        (1.0, 3.0, 1.0, NeighboringRelation.ADD_OR_REMOVE_ONE),
        (1.1, 1.0, 0.01, NeighboringRelation.ADD_OR_REMOVE_ONE),
        (0.7, 1.0, 0.3, NeighboringRelation.ADD_OR_REMOVE_ONE),
        (1.1, 1.0, 0.01, NeighboringRelation.REPLACE_ONE),
        (0.5, 1.0, 0.2, NeighboringRelation.REPLACE_ONE),
        (2.0, 1.0, 1.0, NeighboringRelation.REPLACE_ONE),
        (0.4, 1.0, 0.99, NeighboringRelation.REPLACE_ONE),
    ],
)
def test_fast_gaussian_pld_is_dp_accountings(sigma, sens, q, relation):
    ref = pldlib.from_gaussian_mechanism(
        sigma, sens, value_discretization_interval=1e-3, sampling_prob=q, neighboring_relation=relation
    )
    ours = pldm.fast_gaussian_pld(sigma, sens, 1e-3, sampling_prob=q, neighboring_relation=relation)
    for a, b in zip(pldm.directions(ref), pldm.directions(ours), strict=True):
        da, db = a.to_dense_pmf(), b.to_dense_pmf()
        assert da._lower_loss == db._lower_loss and da._probs.size == db._probs.size
        np.testing.assert_allclose(db._probs, da._probs, rtol=0, atol=1e-11)
        assert db._infinity_mass == pytest.approx(da._infinity_mass, abs=1e-12)


def test_mixture_mixes_each_direction():
    a = pldm.subsampled_gaussian_pld(1.0, 0.2, "add-remove", 1e-3)
    b = pldm.approx_dp_pld(1.0, 1e-4, 1e-3)
    eps = np.array([0.1, 0.5, 1.0, 2.0])
    mixed = pldm.mixture_pld([a, b], [0.3, 0.7])
    ra, aa = pldm.directional_deltas(a, eps)
    rb, ab = pldm.directional_deltas(b, eps)
    rm, am = pldm.directional_deltas(mixed, eps)
    np.testing.assert_allclose(rm, 0.3 * ra + 0.7 * rb, rtol=1e-9)
    np.testing.assert_allclose(am, 0.3 * aa + 0.7 * ab, rtol=1e-9)
    np.testing.assert_allclose(mixed.get_delta_for_epsilon(eps), np.maximum(rm, am), rtol=1e-9)


def test_non_private_parts():
    np_pld = pldm.non_private_pld(1e-3)
    assert pldm.is_non_private(np_pld)
    composed = pldm.compose_plds([pldm.gaussian_pld(1.0, 1e-3), np_pld], 1e-3)
    assert composed.get_epsilon_for_delta(0.5) == math.inf
    mixed = pldm.mixture_pld([pldm.gaussian_pld(1.0, 1e-3), np_pld], [0.9, 0.1])
    assert mixed.get_delta_for_epsilon(30.0) == pytest.approx(0.1, abs=1e-9)


def test_directional_deltas_match_dp_accounting():
    p = pldm.subsampled_gaussian_pld(0.8, 0.1, "add-remove", 1e-3).self_compose(50)
    eps = np.linspace(0.0, 6.0, 200)
    for mine, theirs in zip(pldm.directional_deltas(p, eps), pldm.directions(p), strict=True):
        np.testing.assert_allclose(mine, np.clip(theirs.get_delta_for_epsilon(eps), 0, 1), rtol=1e-9, atol=1e-15)
    few = pldm.directional_deltas(p, eps[::40])
    np.testing.assert_allclose(few[0], pldm.directional_deltas(p, eps)[0][::40], rtol=1e-9, atol=1e-15)


def test_pmf_deltas_on_the_tail_only_are_the_whole_grid_computation():
    """δ(ε) at a few ε is computed from the losses above ε alone; it must be the very same numbers
    as the sum over the whole grid (np.searchsorted on all losses), bit for bit."""
    import numpy as np

    from peer.dp.accounting.pld import (
        _first_above,
        _pmf_deltas,
        directions,
        laplace_pld,
        self_compose,
        subsampled_gaussian_pld,
    )

    def whole_grid(pmf, eps):
        d = pmf.to_dense_pmf()
        losses = (d._lower_loss + np.arange(d._probs.size)) * d._discretization
        out = []
        for e in eps:
            start = int(np.searchsorted(losses, e, side="right"))
            out.append(float(d._infinity_mass) + float(np.dot(d._probs[start:], -np.expm1(e - losses[start:]))))
        return np.array(out)

    eps = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, 3.7, 10.0, 100.0])
    for pld in (
        self_compose(subsampled_gaussian_pld(1.0, 0.02, "add-remove", 1e-4), 2000),
        laplace_pld(1.0, 1e-4),
        self_compose(subsampled_gaussian_pld(2.0, 1.0, "replace-one", 1e-3), 30),
    ):
        for pmf in directions(pld):
            assert np.array_equal(_pmf_deltas(pmf, eps), whole_grid(pmf, eps))
    rng = np.random.default_rng(0)
    for lower, h, n in [(-500, 1e-4, 100_000), (3, 1e-3, 10), (-20, 0.1, 50)]:
        losses = (lower + np.arange(n)) * h
        for e in [*rng.uniform(losses[0] - 1, losses[-1] + 1, 500), *losses[:: max(1, n // 200)]]:
            assert _first_above(lower, h, n, float(e)) == int(np.searchsorted(losses, e, side="right"))


def test_default_orders_are_dp_accountings_and_reading_them_imports_nothing_slow():
    """DEFAULT_ORDERS is written out (so that opening a ledger does not import dp-accounting,
    ~1.1 s of CPU a process): it must be dp-accounting's own list, in its order. And a process
    that opens a site and reads the orders has not imported dp-accounting (nor scipy.signal)."""
    import subprocess
    import sys

    assert tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS) == DEFAULT_ORDERS
    code = (
        "import sys, peer.net.site, peer.budget.ledger\n"
        "from peer.dp.accounting import DEFAULT_ORDERS\n"
        "print(sorted(m for m in sys.modules if m.startswith(('dp_accounting', 'scipy.signal'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300).stdout
    assert out.strip() == "[]", out
