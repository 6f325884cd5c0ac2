"""Tests of peer.ldp.mechanisms.

Statistical tests use fixed seeds (so they are deterministic) and tolerances derived from the
sample size; each states the false-failure rate it would have under a fresh seed.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import make_randomness
from peer.ldp import mechanisms as M
from peer.nn.architectures import build_model, state_arrays, weight_layers
from peer.nn.graph import extract_graph

MLP = {"kind": "mlp", "input_dim": 12, "hidden": [8, 6], "output_dim": 3}
CNN = {
    "kind": "cnn",
    "input_shape": [1, 8, 8],
    "channels": [4, 8],
    "kernel_size": 3,
    "pool": [2, 2],
    "hidden": [16],
    "output_dim": 10,
}
P_FAIL = 1e-5  # per-test false-failure budget of the statistical tests below


def rnd(seed=0):
    return make_randomness(seed)


def z_two_sided(alpha):
    """The |z| threshold of a two-sided test at level alpha."""
    return float(stats.norm.isf(alpha / 2))


# --------------------------------------------------------------------------------------------
# Laplace
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unit,factor", [("neuron", 40), ("entry", 1)])
def test_laplace_noise_matches_its_calibration(unit, factor):
    # 500 neurons × 40 probes inside the clip range: the noise is Laplace(0, b), b = Δ₁/ε.
    # KS test at level P_FAIL (the p-value is uniform under a correct calibration).
    x = np.random.default_rng(1).uniform(0, 2, size=(500, 40))
    noisy, rec = M.laplace_activations(x, epsilon=0.7, clip=(0, 2), unit=unit, randomness=rnd(2))
    b = factor * 2 / 0.7
    assert rec.parameters["scale"] == pytest.approx(b) and rec.sensitivity == pytest.approx(factor * 2)
    assert rec.epsilon == pytest.approx(rec.sensitivity / rec.parameters["scale"])
    assert stats.kstest((noisy - x).ravel(), stats.laplace(0, b).cdf).pvalue > P_FAIL
    # and not a Laplace of half or double the scale (the test has power)
    assert stats.kstest((noisy - x).ravel(), stats.laplace(0, b / 2).cdf).pvalue < P_FAIL


def test_laplace_clips_before_noise():
    # Values far outside [lo, hi] are clipped first: with the same seed the output equals that
    # of the clip bound itself (noise does not depend on the value), and it is centred on the
    # bound: mean within z·b·sqrt(2)/sqrt(N) (CLT; two-sided, false-failure rate P_FAIL).
    n, p = 2000, 5
    lo, hi = -1.0, 3.0
    far = np.full((n, p), 1e6)
    far[: n // 2] = -1e6
    at_bounds = np.where(far > 0, hi, lo)
    out_far, rec = M.laplace_activations(far, epsilon=1.0, clip=(lo, hi), randomness=rnd(5))
    out_bounds, _ = M.laplace_activations(at_bounds, epsilon=1.0, clip=(lo, hi), randomness=rnd(5))
    assert np.array_equal(out_far, out_bounds)
    b = rec.parameters["scale"]
    noise = out_far - at_bounds
    assert abs(noise.mean()) < z_two_sided(P_FAIL) * b * math.sqrt(2) / math.sqrt(noise.size)
    assert np.abs(out_far).max() < 1e5


def test_laplace_is_pure_dp_at_its_epsilon_by_dp_accounting():
    # Independent reference: dp-accounting's PLD of a Laplace(b) mechanism with sensitivity Δ
    # has δ(ε) = 0 at ε = Δ/b and δ > 0 just below it.
    from dp_accounting.pld import privacy_loss_distribution as pld

    _, rec = M.laplace_activations(np.zeros((3, 4)), epsilon=0.8, clip=(0, 1), randomness=rnd())
    dist = pld.from_laplace_mechanism(
        rec.parameters["scale"], sensitivity=rec.sensitivity, value_discretization_interval=1e-4
    )
    assert dist.get_delta_for_epsilon(rec.epsilon + 1e-3) == pytest.approx(0, abs=1e-12)
    assert dist.get_delta_for_epsilon(rec.epsilon - 0.1) > 1e-3


# --------------------------------------------------------------------------------------------
# Gaussian calibration
# --------------------------------------------------------------------------------------------


def test_gaussian_calibration_reference_values():
    # Balle & Wang (2018), analytic vs classical calibration (sensitivity 1)
    assert M.analytic_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(3.730632, abs=1e-6)
    assert M.analytic_gaussian_sigma(1.0, 1e-10, 1.0) == pytest.approx(5.867778, abs=1e-6)
    # the classical formula approaches its ε = 1 values from below the boundary
    assert M.classical_gaussian_sigma(1 - 1e-12, 1e-5, 1.0) == pytest.approx(4.844805, abs=1e-6)
    assert M.classical_gaussian_sigma(1 - 1e-12, 1e-10, 1.0) == pytest.approx(6.818943, abs=1e-6)
    # linear in the sensitivity
    assert M.analytic_gaussian_sigma(0.3, 1e-6, 2.5) == pytest.approx(
        2.5 * M.analytic_gaussian_sigma(0.3, 1e-6, 1.0), rel=1e-12
    )


@pytest.mark.parametrize(
    "epsilon,delta", [(0.1, 1e-5), (0.5, 1e-3), (1.0, 1e-5), (2.0, 1e-8), (3.0, 1e-6), (10.0, 1e-5)]
)
def test_analytic_sigma_against_dp_accounting_hockey_stick(epsilon, delta):
    # dp-accounting's PLD of the Gaussian mechanism (pessimistic discretisation with interval h)
    # gives δ(ε) between the exact δ and δ(ε − h): that bracket is the tolerance.
    from dp_accounting.pld import privacy_loss_distribution as pld

    h, sens = 1e-4, 2.0
    sigma = M.analytic_gaussian_sigma(epsilon, delta, sens)
    got = pld.from_gaussian_mechanism(
        standard_deviation=sigma, sensitivity=sens, value_discretization_interval=h
    ).get_delta_for_epsilon(epsilon)
    upper = M.gaussian_delta(epsilon - h, sigma, sens)
    assert delta * (1 - 1e-9) <= got <= upper
    # the exact δ(ε) is a strictly decreasing function of σ: 0.1 % less noise breaks δ
    assert M.gaussian_delta(epsilon, sigma * 0.999, sens) > delta * 1.0001


def test_analytic_sigma_against_dp_accounting_calibration_over_a_wide_range():
    from dp_accounting.gaussian_mechanism import get_sigma_gaussian

    for eps in (0.01, 0.3, 1.0, 3.0, 30.0, 300.0, 1e4):
        for delta in (1e-2, 1e-6, 1e-12, 1e-100):
            assert M.analytic_gaussian_sigma(eps, delta, 1.0) == pytest.approx(get_sigma_gaussian(eps, delta), rel=1e-9)


def test_classical_is_looser_than_analytic_and_refuses_large_epsilon():
    for eps in (0.01, 0.1, 0.5, 0.99):
        for delta in (1e-3, 1e-5, 1e-10):
            assert M.classical_gaussian_sigma(eps, delta, 1.0) > M.analytic_gaussian_sigma(eps, delta, 1.0)
    for eps in (1.0, 1.5, 10.0):
        with pytest.raises(InvalidArgument, match="epsilon"):
            M.classical_gaussian_sigma(eps, 1e-5, 1.0)
    with pytest.raises(InvalidArgument, match="epsilon"):
        M.gaussian_perturbation(
            np.zeros((2, 3)), epsilon=2.0, delta=1e-5, clip_norm=1.0, calibration="classical", randomness=rnd()
        )


def test_gaussian_noise_matches_sigma():
    # Rows of zeros are untouched by clipping, so the output is pure noise N(0, σ²).
    # Chi-square variance test and KS test, each two-sided at P_FAIL / 2.
    rows = np.zeros((400, 50))
    noisy, rec = M.gaussian_perturbation(rows, epsilon=2.0, delta=1e-5, clip_norm=1.5, randomness=rnd(3))
    sigma = rec.parameters["noise_std"]
    assert sigma == pytest.approx(M.analytic_gaussian_sigma(2.0, 1e-5, 3.0))
    assert rec.sensitivity == pytest.approx(3.0)
    x = noisy.ravel()
    n = x.size
    t = np.sum(x**2) / sigma**2  # ~ chi2(n): the mean is known (0)
    assert stats.chi2.ppf(P_FAIL / 4, n) < t < stats.chi2.isf(P_FAIL / 4, n)
    assert stats.kstest(x, stats.norm(0, sigma).cdf).pvalue > P_FAIL / 2
    assert not stats.chi2.ppf(P_FAIL / 4, n) < np.sum(x**2) / (1.05 * sigma) ** 2 < stats.chi2.isf(P_FAIL / 4, n)


def test_gaussian_clips_before_noise():
    # A row of norm 1000·C is scaled onto the ball first: averaged over 4000 noisy copies the
    # output is the clipped row, within z·σ/sqrt(n) per coordinate (Bonferroni over 3
    # coordinates; false-failure rate P_FAIL).
    row = np.array([[600.0, -800.0, 0.0]])
    rows = np.repeat(row, 4000, axis=0)
    noisy, rec = M.gaussian_perturbation(rows, epsilon=5.0, delta=1e-5, clip_norm=1.0, randomness=rnd(4))
    sigma = rec.parameters["noise_std"]
    tol = z_two_sided(P_FAIL / 3) * sigma / math.sqrt(len(rows))
    assert np.all(np.abs(noisy.mean(axis=0) - [0.6, -0.8, 0.0]) < tol)


def test_gaussian_entry_unit_sensitivity_from_public_box():
    _, rec = M.gaussian_perturbation(
        np.zeros((2, 9)), epsilon=1.0, delta=1e-5, clip_norm=2.0, entry_bound=0.25, unit="entry", randomness=rnd()
    )
    assert rec.unit == "entry" and rec.sensitivity == pytest.approx(0.5)
    assert rec.parameters["noise_std"] == pytest.approx(M.analytic_gaussian_sigma(1.0, 1e-5, 0.5))
    # without a box, one entry can move the row anywhere in the ball
    _, rec = M.gaussian_perturbation(
        np.zeros((2, 9)), epsilon=1.0, delta=1e-5, clip_norm=2.0, unit="entry", randomness=rnd()
    )
    assert rec.sensitivity == pytest.approx(4.0)
    # per neuron: the diameter of box ∩ ball, 2·min(C, c·sqrt(k))
    _, rec = M.gaussian_perturbation(
        np.zeros((2, 9)), epsilon=1.0, delta=1e-5, clip_norm=2.0, entry_bound=0.25, randomness=rnd()
    )
    assert rec.sensitivity == pytest.approx(2 * 0.25 * 3)


finite = st.floats(-1e3, 1e3, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=12), st.integers(0, 11), finite, st.floats(0.01, 10), st.floats(0.01, 10))
def test_clip_rows_realises_the_stated_sensitivities(v, j, new, clip_norm, bound):
    # The sensitivity argument, checked directly: two rows differing in one entry are at most
    # 2·min(c, C) apart after clipping; any two rows at most 2·min(C, c·sqrt(k)).
    a = np.array([v])
    b = a.copy()
    b[0, j % a.shape[1]] = new
    ca = M.clip_rows(a, clip_norm=clip_norm, entry_bound=bound)
    cb = M.clip_rows(b, clip_norm=clip_norm, entry_bound=bound)
    k = a.shape[1]
    slack = 1 + 1e-9
    assert np.linalg.norm(ca) <= clip_norm * slack and np.all(np.abs(ca) <= bound * slack)
    assert (
        np.linalg.norm(ca - cb)
        <= M.gaussian_sensitivity("entry", clip_norm=clip_norm, entry_bound=bound, length=k) * slack
    )
    far = M.clip_rows(-np.sign(a + 0.5) * 1e6, clip_norm=clip_norm, entry_bound=bound)
    assert (
        np.linalg.norm(ca - far)
        <= M.gaussian_sensitivity("neuron", clip_norm=clip_norm, entry_bound=bound, length=k) * slack
    )


# --------------------------------------------------------------------------------------------
# Multi-bit
# --------------------------------------------------------------------------------------------


def test_multibit_variance_formula_reference_values():
    # (LPGNN's Monte Carlo, Sajadmanesh & Gatica-Perez 2021, d = 10, a coordinate at a bound of [0, 1]).
    x = np.zeros((1, 10))
    assert M.multibit_variance(x, epsilon=8.0, bounds=(0, 1))[0, 0] == pytest.approx(0.851, abs=1e-3)
    assert M.multibit_variance(x, epsilon=1.0, bounds=(0, 1))[0, 0] == pytest.approx(11.46, abs=1e-2)
    assert M.multibit_rectifier(10, epsilon=8.0, bounds=(0, 1)).m == 3


@pytest.mark.parametrize("epsilon,d,m", [(1.0, 10, 1), (8.0, 10, 3), (20.0, 32, 9), (60.0, 16, 16), (0.5, 1, 1)])
def test_multibit_is_unbiased_with_the_stated_variance(epsilon, d, m):
    # n copies of one vector x (values spread over the box, two of them outside it to check
    # clipping). Per coordinate: the mean within z·sd/sqrt(n) of clip(x), and the sample
    # variance within z·sqrt((μ4 − σ⁴)/n) of the formula, with μ4 the exact fourth central
    # moment of the three-valued output. Bonferroni over 2·d tests at total rate P_FAIL.
    lo, hi = -0.5, 1.5
    n = 40000
    x = np.linspace(lo - 0.3, hi + 0.3, d)
    xc = np.clip(x, lo, hi)
    out, rec = M.multibit(np.repeat(x[None, :], n, axis=0), epsilon=epsilon, bounds=(lo, hi), randomness=rnd(7))
    r = M.multibit_rectifier(d, epsilon=epsilon, bounds=(lo, hi))
    assert rec.parameters["m"] == r.m == m and rec.parameters["d"] == d
    p = 1 / (math.exp(epsilon / m) + 1) + (xc - lo) / (hi - lo) * math.tanh(epsilon / (2 * m))
    values = np.stack([np.full(d, r.levels[0]), np.full(d, r.centre), np.full(d, r.levels[2])])
    probs = np.stack([m / d * (1 - p), np.full(d, 1 - m / d), m / d * p])
    assert np.allclose((values * probs).sum(0), xc)  # the exact mean is clip(x)
    var = M.multibit_variance(x[None, :], epsilon=epsilon, bounds=(lo, hi))[0]
    assert np.allclose(((values - xc) ** 2 * probs).sum(0), var)  # formula = exact second moment
    mu4 = ((values - xc) ** 4 * probs).sum(0)
    z = z_two_sided(P_FAIL / (2 * d))
    assert np.all(np.abs(out.mean(0) - xc) <= z * np.sqrt(var / n))
    assert np.all(np.abs(out.var(0, ddof=1) - var) <= z * np.sqrt(np.maximum(mu4 - var**2, 1e-300) / n) + 1e-12)


def test_multibit_three_valued_structure_and_bernoulli_probability():
    # Every output is centre + half_step·x*, x* ∈ {−1, 0, 1}; exactly m coordinates per row are
    # sampled; among sampled coordinates P(x* = 1) = p(x). Binomial z-test per coordinate,
    # Bonferroni over d, total false-failure rate P_FAIL.
    rng = np.random.default_rng(0)
    d, n, eps = 24, 30000, 15.0
    x = rng.uniform(0, 1, d)
    out, rec = M.multibit(np.repeat(x[None, :], n, axis=0), epsilon=eps, bounds=(0, 1), randomness=rnd(11))
    r = M.multibit_rectifier(d, epsilon=eps, bounds=(0, 1))
    assert (rec.parameters["centre"], rec.parameters["half_step"]) == (r.centre, r.half_step)
    codes = r.codes(out)
    assert set(np.unique(codes)) == {-1, 0, 1}
    assert np.all(np.count_nonzero(codes, axis=1) == r.m)
    em = math.exp(eps / r.m)
    p = (x * (em - 1) + 1) / (em + 1)  # the form of the Bernoulli probability
    sampled = np.count_nonzero(codes, axis=0)
    ones = np.sum(codes == 1, axis=0)
    z = z_two_sided(P_FAIL / d)
    assert np.all(np.abs(ones / sampled - p) <= z * np.sqrt(p * (1 - p) / sampled))
    # sampling is uniform over coordinates: each is sampled with probability m/d
    q = r.m / d
    assert np.all(np.abs(sampled / n - q) <= z * math.sqrt(q * (1 - q) / n))
    with pytest.raises(InvalidArgument, match="rectified"):
        r.codes(out + 0.25)


def test_multibit_entry_unit_applies_the_one_dimensional_mechanism_everywhere():
    x = np.full((20000, 3), 0.25)
    out, rec = M.multibit(x, epsilon=1.0, bounds=(0, 1), unit="entry", randomness=rnd(2))
    assert rec.unit == "entry" and rec.parameters["d"] == 1 and rec.parameters["m"] == 1
    assert rec.parameters["shape"] == (20000, 3)
    h = 0.5 / math.tanh(0.5)
    assert set(np.unique(out)) == {0.5 - h, 0.5 + h}
    sd = math.sqrt(M.multibit_variance(x[:1], epsilon=1.0, bounds=(0, 1), unit="entry")[0, 0])
    assert np.all(np.abs(out.mean(0) - 0.25) <= z_two_sided(P_FAIL / 3) * sd / math.sqrt(len(x)))


def test_multibit_handles_large_epsilon_and_large_inputs():
    # 4096 × 1024 spans two row blocks of the sampler; m = ⌊1000/2.18⌋ = 458 of 1024.
    x = np.random.default_rng(0).random((4096, 1024))
    out, rec = M.multibit(x, epsilon=1000.0, bounds=(0, 1), randomness=rnd())
    r = M.multibit_rectifier(1024, epsilon=1000.0, bounds=(0, 1))
    assert r.m == rec.parameters["m"] == 458 and np.all(np.isfinite(out))
    assert np.all(np.count_nonzero(r.codes(out), axis=1) == r.m)
    # ε/m large enough that exp(ε/m) overflows a double: the stable forms still work
    out, rec = M.multibit(x[:4, :3], epsilon=3000.0, bounds=(0, 1), randomness=rnd())
    assert rec.parameters["m"] == 3 and np.all(np.isfinite(out))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 40),
    st.floats(1e-3, 300),
    finite,
    st.floats(1e-3, 100),
    st.sampled_from(["neuron", "entry"]),
    st.integers(0, 2**32),
)
def test_multibit_outputs_lie_on_the_three_levels(n, d, eps, lo, width, unit, seed):
    x = np.random.default_rng(seed).uniform(lo - width, lo + 2 * width, size=(n, d))
    out, _rec = M.multibit(x, epsilon=eps, bounds=(lo, lo + width), unit=unit, randomness=rnd(seed))
    r = M.multibit_rectifier(d, epsilon=eps, bounds=(lo, lo + width), unit=unit)
    assert out.shape == x.shape and np.all(np.isfinite(out))
    assert np.all(np.isin(r.codes(out), (-1, 0, 1)))
    assert np.all(out >= r.levels[0] - 1e-9 * r.half_step) and np.all(out <= r.levels[2] + 1e-9 * r.half_step)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 30),
    st.floats(1e-3, 1e3),
    finite,
    st.floats(1e-3, 100),
    st.sampled_from(["neuron", "entry"]),
)
def test_laplace_outputs_are_finite_with_the_same_shape(n, p, eps, lo, width, unit):
    x = np.random.default_rng(0).uniform(lo - width, lo + 2 * width, size=(n, p))
    out, rec = M.laplace_activations(x, epsilon=eps, clip=(lo, lo + width), unit=unit, randomness=rnd())
    assert out.shape == x.shape and np.all(np.isfinite(out))
    assert rec.sensitivity == pytest.approx((p if unit == "neuron" else 1) * width)


# --------------------------------------------------------------------------------------------
# Smoothing filter
# --------------------------------------------------------------------------------------------


def test_truncated_normal_mean_against_scipy_and_its_tails():
    rng = np.random.default_rng(0)
    mu = rng.uniform(-8, 8, 500)
    sd = rng.uniform(0.05, 5, 500)
    ref = stats.truncnorm.mean((-1 - mu) / sd, (1 - mu) / sd, loc=mu, scale=sd)
    assert np.allclose(M.truncated_normal_mean(mu, sd, -1, 1), ref, rtol=1e-9, atol=1e-12)
    # far outside the interval the truncated normal is exponential at the near end with rate
    # (distance)/sd², so the mean is (end ∓ sd²/distance) to first order
    far = M.truncated_normal_mean(np.array([1e4, -1e4]), np.array([1.0, 1.0]), -1, 1)
    assert far == pytest.approx([1 - 1 / (1e4 - 1), -1 + 1 / (1e4 - 1)], abs=1e-7)
    assert np.array_equal(M.truncated_normal_mean(np.array([3.0, 0.2]), 0.0, -1, 1), [1.0, 0.2])
    # a normal far wider than the interval is nearly flat on it: the mean is near the midpoint,
    # tilted towards μ by (interval half-width)²/3 · (midpoint − μ)/sd²
    wide = M.truncated_normal_mean(np.array([0.3, -1.0, 5e5]), np.array([1e12, 1e9, 1e6]), -1, 1)
    assert wide == pytest.approx([0.3 / 3e24, -1 / 3e18, 5e5 / 3e12], rel=1e-6, abs=1e-300)
    # against a 60-digit reference over scales from 1e-3 to 1e12 (scipy is no reference for wide
    # normals: it cancels to ~1e-7 absolute error). The result is μ + sd·shift in double
    # precision, so its absolute accuracy is a few ulps of |μ|.
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60

    def reference(mu, sd, lo, hi):
        mu, sd = mpmath.mpf(mu), mpmath.mpf(sd)
        a, b = (lo - mu) / sd, (hi - mu) / sd
        pdf = lambda t: mpmath.exp(-(t**2) / 2) / mpmath.sqrt(2 * mpmath.pi)  # noqa: E731
        upper_tail = lambda t: mpmath.erfc(t / mpmath.sqrt(2)) / 2  # noqa: E731
        mass = upper_tail(a) - upper_tail(b) if a > 0 else upper_tail(-b) - upper_tail(-a)
        return float(mu + sd * (pdf(a) - pdf(b)) / mass)

    for sd in (1e-3, 0.1, 1.0, 30.0, 100.0, 1e3, 9e3, 1.01e4, 3e4, 1e8, 1e12):
        for mu in (0.5, 3.0, -40.0, 1e-3, 0.999, -1.0, 7.0, -300.0, 1e3, -1e5, 1e7):
            ref = reference(mu, sd, -1, 1)
            got = M.truncated_normal_mean(np.array([mu]), np.array([sd]), -1, 1)[0]
            assert abs(got - ref) <= 1e-6 * abs(ref) + 1e-14 * (1 + abs(mu)), (mu, sd, got, ref)


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e200, 1e200), st.floats(0, 1e200), st.floats(-1e3, 1e3), st.floats(1e-6, 1e3))
def test_truncated_normal_mean_is_finite_and_inside_the_interval(mu, sd, lo, width):
    out = M.truncated_normal_mean(np.array([mu]), np.array([sd]), lo, lo + width)
    assert np.isfinite(out[0]) and lo <= out[0] <= lo + width


def test_filter_is_close_to_bayes_optimal_for_gaussian_weights():
    # Clean values w ~ N(0.05, s²) (inside the box in practice), noise N(0, σ²): the linear
    # posterior mean has MSE s²σ²/(s²+σ²). Its error is Gaussian, so the sample MSE of N
    # values has relative sd sqrt(2/N); we allow 6 sd, and 6 more for the plug-in estimates of
    # μ and s² (false-failure rate below 1e-8).
    g = np.random.default_rng(3)
    s, sigma, n = 0.1, 0.3, 40000
    w = np.clip(g.normal(0.05, s, n), -1, 1)
    noisy = w + g.normal(0, sigma, n)
    out, params = M.smoothing_filter(noisy, noise_std=sigma, entry_bound=1.0)
    bayes = s**2 * sigma**2 / (s**2 + sigma**2)
    assert np.mean((out - w) ** 2) <= bayes * (1 + 12 * math.sqrt(2 / n))
    assert params["entry_bound"] == 1.0 and params["standardise"] is False
    # standardisation restores the clean spread ŝ, estimated from noisy moments only:
    # ŝ² = var(w′) − σ² has sd sqrt(2/N)(s² + σ²), so ŝ has relative sd ½·sqrt(2/N)(s²+σ²)/s²;
    # 6 of those (false-failure rate 2e-9)
    out_std, _ = M.smoothing_filter(noisy, noise_std=sigma, entry_bound=1.0, standardise=True)
    assert out_std.std() == pytest.approx(s, rel=6 * 0.5 * math.sqrt(2 / n) * (s**2 + sigma**2) / s**2)


def test_filter_falls_back_to_a_constant_when_noise_swamps_the_spread():
    # Clean spread s = 0.01 under noise σ = 10 with N = 8192 values: var(w′) − σ² has standard
    # error ≈ σ²·sqrt(2/N) ≈ 1.6 ≫ s² = 1e-4, so the clean spread is indistinguishable from
    # sampling noise and every output must be the constant μ (the prior mean estimate). Under
    # the Gaussian approximation the margin is crossed with probability ≈ 1.3e-3 for a fresh
    # seed; the seed is fixed. μ = mean(w′) is within 6σ/sqrt(N) of the clean mean
    # (false-failure rate 2e-9).
    g = np.random.default_rng(11)
    sigma, n = 10.0, 8192
    w = g.normal(0.02, 0.01, n)
    noisy = w + g.normal(0, sigma, n)
    out, _ = M.smoothing_filter(noisy, noise_std=sigma, entry_bound=1.0)
    assert np.ptp(out) == 0.0
    assert abs(out[0] - w.mean()) <= 6 * sigma / math.sqrt(n)
    # the clean mean 0.02 is far below 3 standard errors of mean(w′) (3σ/sqrt(N) ≈ 0.33): the
    # constant is the box's centre, not mean(w′) (whose own error is ~0.11)
    assert out[0] == 0.0


@pytest.fixture(scope="module")
def trained_digits_mlp():
    from peer.nn.architectures import train_classifier
    from peer.nn.data import load_dataset

    arch = {"kind": "mlp", "input_dim": 64, "hidden": [64], "output_dim": 10}
    ds = load_dataset("digits")
    # one thread: this tiny model trains in a fraction of a second, while two threads on a
    # shared 2-core machine spend seconds waiting for each other
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_classifier(arch, ds.x_train, ds.y_train, seed=0, epochs=8, batch_size=128, learning_rate=3e-3)
    finally:
        torch.set_num_threads(threads)
    return arch, state_arrays(model)


@pytest.mark.parametrize("unit,epsilon", [("neuron", 100.0), ("neuron", 1000.0), ("entry", 30.0), ("entry", 300.0)])
def test_filter_lowers_the_error_on_trained_weights(trained_digits_mlp, unit, epsilon):
    # Real trained weights (digits MLP 64-64-10). The error of each entry against the clipped
    # clean weights, raw vs filtered: the paired mean gain g = mean(e_raw² − e_filt²) must be
    # more than 5 of its standard errors above 0. With no gain at all, z ~ N(0, 1) would pass
    # with probability 3e-7; the observed z values are 15–45 (so the
    # true gain is ≥ 10 standard errors: a fresh seed fails with probability far below P_FAIL).
    arch, arrays = trained_digits_mlp
    raw, rec_raw = M.perturb_model_weights(
        arch, arrays, epsilon=epsilon, delta=1e-5, unit=unit, smoothing=False, randomness=rnd(9)
    )
    filt, rec = M.perturb_model_weights(
        arch, arrays, epsilon=epsilon, delta=1e-5, unit=unit, smoothing=True, randomness=rnd(9)
    )
    gains = []
    for spec, comp in zip(weight_layers(arch), rec.components, strict=True):

        def rows(a, spec=spec):
            return np.concatenate(
                [a[f"{spec.name}.weight"].reshape(spec.units, -1), a[f"{spec.name}.bias"][:, None]], axis=1
            )

        clean = M.clip_rows(
            rows(arrays), clip_norm=comp.parameters["clip_norm"], entry_bound=comp.parameters["entry_bound"]
        )
        gains.append(((rows(raw) - clean) ** 2 - (rows(filt) - clean) ** 2).ravel())
    g = np.concatenate(gains)
    assert g.mean() > 5 * g.std(ddof=1) / math.sqrt(g.size)
    # same noise draw (same seed): the filter only post-processes
    assert rec_raw.components[0].parameters["noise_std"] == rec.components[0].parameters["noise_std"]
    assert "smoothing" in rec.components[0].parameters and "smoothing" not in rec_raw.components[0].parameters


# --------------------------------------------------------------------------------------------
# Whole networks and records
# --------------------------------------------------------------------------------------------


def small_graph(arch=MLP, activation=None):
    a = dict(arch, **({"activation": activation} if activation else {}))
    model = build_model(a, seed=0)
    probe = np.random.default_rng(0).random((5, 64 if a["kind"] == "cnn" else a["input_dim"]))
    return a, extract_graph(a, model, probe), model


def test_records_follow_the_contract_and_report_randomness():
    x = np.random.default_rng(0).random((4, 6))
    _, r = M.laplace_activations(x, epsilon=1.0, clip=(0, 1), randomness=rnd(42))
    assert r.mechanism == "laplace" and r.level == "model" and r.unit == "neuron" and r.delta == 0
    assert r.sensitivity_norm == "l1" and {"scale", "clip", "shape"} <= set(r.parameters)
    assert (r.randomness, r.seed) == ("fixed-seed", 42)
    _, r = M.laplace_activations(x, epsilon=1.0, clip=(0, 1))
    assert (r.randomness, r.seed) == ("csprng", None)
    _, r = M.multibit(x, epsilon=1.0, bounds=(0, 1), randomness=rnd(1))
    assert r.mechanism == "multibit" and r.delta == 0 and r.sensitivity == 1 and r.sensitivity_norm == "range"
    assert {"bounds", "m", "d"} <= set(r.parameters)
    _, r = M.gaussian_perturbation(x, epsilon=1.0, delta=1e-6, clip_norm=1.0)
    assert r.mechanism == "gaussian" and r.delta == 1e-6 and r.sensitivity_norm == "l2" and r.seed is None
    assert {"noise_std", "clip_norm", "calibration"} <= set(r.parameters) and r.parameters["calibration"] == "analytic"
    assert ReleaseRecord.from_json(r.canonical_json()) == r
    # two CSPRNG releases draw different noise
    a, _ = M.gaussian_perturbation(x, epsilon=1.0, delta=1e-6, clip_norm=1.0)
    b, _ = M.gaussian_perturbation(x, epsilon=1.0, delta=1e-6, clip_norm=1.0)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("arch", [MLP, CNN])
def test_perturb_graph_touches_every_neuron_and_composes(arch):
    a, graph, _ = small_graph(arch)
    noisy, rec = M.perturb_graph(graph, epsilon_x=0.5, epsilon_w=2.0, activation_clip=(0, 4), randomness=rnd(8))
    specs = weight_layers(a)
    assert rec.mechanism == "composite" and rec.parameters["composition"] == "parallel"
    assert rec.parameters["parallel_over"] == "neurons"  # layers: other neurons
    assert len(rec.components) == len(graph.hidden) + 1
    assert rec.epsilon == pytest.approx(2.5) and rec.delta == 0 and rec.seed == 8
    hidden = len(graph.hidden)  # the hidden layers' components and specs; the output layer's come last
    for h, hn, comp, spec in zip(graph.hidden, noisy.hidden, rec.components[:hidden], specs[:hidden], strict=True):
        assert comp.parameters["composition"] == "sequential" and comp.epsilon == pytest.approx(2.5)
        lap, mb = comp.components
        assert (lap.mechanism, lap.parameters["part"], lap.parameters["layer"]) == ("laplace", "activations", h.name)
        assert (mb.mechanism, mb.parameters["part"], mb.parameters["d"]) == ("multibit", "weights", spec.fan_in + 1)
        c = M.default_entry_bound(spec.fan_in)
        assert tuple(mb.parameters["bounds"]) == (-c, c)
        r = M.multibit_rectifier(spec.fan_in + 1, epsilon=2.0, bounds=(-c, c))
        r.codes(hn.incoming), r.codes(hn.bias)  # the bias is the weight feature's last coordinate
        assert hn.incoming.shape == h.incoming.shape and hn.activations.shape == h.activations.shape
        assert not np.array_equal(hn.activations, h.activations)
    out = rec.components[-1]
    assert (out.mechanism, out.parameters["layer"]) == ("multibit", specs[-1].name)
    assert noisy.output_incoming.shape == graph.output_incoming.shape
    r_out = M.multibit_rectifier(specs[-1].fan_in + 1, epsilon=2.0, bounds=tuple(out.parameters["bounds"]))
    r_out.codes(noisy.output_incoming), r_out.codes(noisy.output_bias)
    assert noisy.input_size == graph.input_size and noisy.architecture == graph.architecture
    assert ReleaseRecord.from_json(rec.canonical_json()) == rec


def test_perturb_graph_entry_unit_is_parallel_throughout_and_bounds_per_layer():
    a, graph, _ = small_graph()
    names = [s.name for s in weight_layers(a)]
    wb = {n: (-0.5 - i, 0.5 + i) for i, n in enumerate(names)}
    _noisy, rec = M.perturb_graph(
        graph,
        epsilon_x=0.5,
        epsilon_w=2.0,
        activation_clip={"0": (0, 1), "2": (0, 2)},
        weight_bounds=wb,
        unit="entry",
        randomness=rnd(),
    )
    assert rec.unit == "entry" and rec.epsilon == pytest.approx(2.0)
    assert all(c.parameters["composition"] == "parallel" for c in rec.components[:-1])
    # parallel per entry only: a layer's activations and weights are entries of the same neurons
    assert all(c.parameters["parallel_over"] == "entries" for c in rec.components[:-1])
    assert rec.parameters["parallel_over"] == "neurons"
    assert [tuple(c.components[1].parameters["bounds"]) for c in rec.components[:-1]] == [wb[n] for n in names[:-1]]
    assert tuple(rec.components[0].components[0].parameters["clip"]) == (0, 1)
    assert rec.components[1].components[0].parameters["scale"] == pytest.approx(2 / 0.5)
    with pytest.raises(InvalidArgument, match="weight_bounds"):
        M.perturb_graph(graph, epsilon_x=1, epsilon_w=1, activation_clip=(0, 1), weight_bounds={"0": (-1, 1)})
    with pytest.raises(InvalidArgument, match="activation_clip"):
        M.perturb_graph(graph, epsilon_x=1, epsilon_w=1, activation_clip={"0": (0, 1), "9": (0, 1), "2": (0, 1)})
    with pytest.raises(InvalidArgument, match="activation_clip"):
        M.perturb_graph(graph, epsilon_x=1, epsilon_w=1)  # relu is unbounded: the range must be given
    _, tanh_graph, _ = small_graph(activation="tanh")
    _, rec = M.perturb_graph(tanh_graph, epsilon_x=1, epsilon_w=1, randomness=rnd())
    assert tuple(rec.components[0].components[0].parameters["clip"]) == (-1, 1)


@pytest.mark.parametrize("arch", [MLP, CNN])
def test_perturb_model_weights_releases_every_layer(arch):
    model = build_model(arch, seed=1)
    arrays = state_arrays(model)
    noisy, rec = M.perturb_model_weights(arch, arrays, epsilon=3.0, delta=1e-5, randomness=rnd(6))
    specs = weight_layers(arch)
    assert list(noisy) == list(arrays)
    for k in arrays:
        assert noisy[k].shape == arrays[k].shape and noisy[k].dtype == arrays[k].dtype
        assert not np.array_equal(noisy[k], arrays[k]) and np.all(np.isfinite(noisy[k]))
    assert rec.mechanism == "composite" and rec.parameters["composition"] == "parallel"
    assert rec.parameters["parallel_over"] == "neurons"
    assert [c.parameters["layer"] for c in rec.components] == [s.name for s in specs]
    assert specs[-1].is_output and rec.epsilon == 3.0 and rec.delta == 1e-5
    for c, s in zip(rec.components, specs, strict=True):
        assert c.mechanism == "gaussian" and c.parameters["shape"] == (s.units, s.fan_in + 1)
        assert c.parameters["clip_norm"] == M.DEFAULT_CLIP_NORM
        assert c.parameters["entry_bound"] == pytest.approx(M.default_entry_bound(s.fan_in))
        assert c.parameters["smoothing"]["filter"] == "posterior-mean"
        # the filtered weights respect the public box the filter's prior lives on
        assert np.all(np.abs(noisy[f"{s.name}.weight"]) <= c.parameters["entry_bound"] + 1e-6)
    noisy_again, _ = M.perturb_model_weights(arch, arrays, epsilon=3.0, delta=1e-5, randomness=rnd(6))
    assert all(np.array_equal(noisy[k], noisy_again[k]) for k in arrays)


def test_perturb_model_weights_per_layer_bounds_and_classical_calibration():
    arrays = state_arrays(build_model(MLP, seed=1))
    norms = {"0": 1.0, "2": 2.0, "4": 3.0}
    _, rec = M.perturb_model_weights(
        MLP,
        arrays,
        epsilon=0.5,
        delta=1e-5,
        clip_norm=norms,
        entry_bound=10.0,
        calibration="classical",
        smoothing=False,
        randomness=rnd(),
    )
    for c in rec.components:
        assert c.parameters["calibration"] == "classical" and c.sensitivity == pytest.approx(
            2 * norms[c.parameters["layer"]]
        )
        assert c.parameters["noise_std"] == pytest.approx(M.classical_gaussian_sigma(0.5, 1e-5, c.sensitivity))
    with pytest.raises(InvalidArgument, match="clip_norm"):
        M.perturb_model_weights(MLP, arrays, epsilon=1, delta=1e-5, clip_norm={"0": 1.0})
    bad = dict(arrays)
    bad["2.weight"] = np.full_like(arrays["2.weight"], np.nan)
    with pytest.raises(InvalidArgument, match=r"arrays\[2.weight\]"):
        M.perturb_model_weights(MLP, bad, epsilon=1, delta=1e-5)
    with pytest.raises(InvalidArgument, match="arrays"):
        M.perturb_model_weights(MLP, {k: v for k, v in arrays.items() if k != "4.bias"}, epsilon=1, delta=1e-5)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


X = np.ones((3, 4))


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: M.laplace_activations(np.full((2, 2), np.nan), epsilon=1, clip=(0, 1)), "activations"),
        (lambda: M.laplace_activations(np.array([[1.0, np.inf]]), epsilon=1, clip=(0, 1)), "activations"),
        (lambda: M.laplace_activations(np.zeros((0, 3)), epsilon=1, clip=(0, 1)), "activations"),
        (lambda: M.laplace_activations(np.zeros(3), epsilon=1, clip=(0, 1)), "activations"),
        (lambda: M.laplace_activations(X, epsilon=0, clip=(0, 1)), "epsilon"),
        (lambda: M.laplace_activations(X, epsilon=-1, clip=(0, 1)), "epsilon"),
        (lambda: M.laplace_activations(X, epsilon=math.inf, clip=(0, 1)), "epsilon"),
        (lambda: M.laplace_activations(X, epsilon=math.nan, clip=(0, 1)), "epsilon"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(1, 1)), "clip"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(2, 1)), "clip"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(0, math.inf)), "clip"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(0,)), "clip"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(0, 1), unit="person"), "unit"),
        (lambda: M.multibit(np.full((2, 2), np.nan), epsilon=1, bounds=(0, 1)), "features"),
        (lambda: M.multibit(np.zeros((2, 0)), epsilon=1, bounds=(0, 1)), "features"),
        (lambda: M.multibit(X, epsilon=0, bounds=(0, 1)), "epsilon"),
        (lambda: M.multibit(X, epsilon=1, bounds=(1, 0)), "bounds"),
        (lambda: M.multibit(X, epsilon=1, bounds=(0, 1), unit="layer"), "unit"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=0, clip_norm=1), "delta"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=1, clip_norm=1), "delta"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=-0.1, clip_norm=1), "delta"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=1e-5, clip_norm=0), "clip_norm"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=1e-5, clip_norm=1, entry_bound=-1), "entry_bound"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=1e-5, clip_norm=1, calibration="rdp"), "calibration"),
        (lambda: M.gaussian_perturbation(X, epsilon=1, delta=1e-5, clip_norm=1, unit="x"), "unit"),
        (lambda: M.gaussian_perturbation(np.full((2, 2), np.inf), epsilon=1, delta=1e-5, clip_norm=1), "vectors"),
        (lambda: M.analytic_gaussian_sigma(0, 1e-5, 1), "epsilon"),
        (lambda: M.analytic_gaussian_sigma(1, 1e-5, 0), "sensitivity"),
        (lambda: M.analytic_gaussian_sigma(1, 1.5, 1), "delta"),
        (lambda: M.classical_gaussian_sigma(0.5, 0, 1), "delta"),
        (lambda: M.smoothing_filter(np.array([np.nan]), noise_std=1, entry_bound=1), "noisy"),
        (lambda: M.smoothing_filter(np.ones(3), noise_std=0, entry_bound=1), "noise_std"),
        (lambda: M.laplace_activations(X, epsilon=1, clip=(0, 1), randomness=np.random.default_rng(0)), "randomness"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(InvalidArgument) as info:
        call()
    assert info.value.field == field


def test_whole_model_bad_input():
    _a, graph, _ = small_graph()
    for kwargs, field in [
        ({"epsilon_x": 0, "epsilon_w": 1}, "epsilon_x"),
        ({"epsilon_x": 1, "epsilon_w": -1}, "epsilon_w"),
        ({"epsilon_x": 1, "epsilon_w": 1, "unit": "layer"}, "unit"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            M.perturb_graph(graph, activation_clip=(0, 1), **kwargs)
        assert info.value.field == field
    with pytest.raises(InvalidArgument, match="activation_clip\\[0\\]"):
        M.perturb_graph(graph, epsilon_x=1, epsilon_w=1, activation_clip={"0": (1, 0), "2": (0, 1)})
    with pytest.raises(InvalidArgument, match="graph"):
        M.perturb_graph("graph", epsilon_x=1, epsilon_w=1, activation_clip=(0, 1))
    arrays = state_arrays(build_model(MLP, seed=0))
    with pytest.raises(InvalidArgument) as info:
        M.perturb_model_weights(MLP, arrays, epsilon=1, delta=2)
    assert info.value.field == "delta"
