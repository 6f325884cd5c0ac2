"""Integer encoding for secure aggregation (peer.dp.distributed.encoding) and the distributed
Skellam share and its calibration (peer.dp.distributed.skellam)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.linalg import hadamard

from peer.base.errors import InvalidArgument
from peer.dp.accounting.conversions import DEFAULT_ORDERS, rdp_to_epsilon
from peer.dp.accounting.skellam import rdp_skellam_steps
from peer.dp.distributed.encoding import (
    Encoding,
    centred,
    decode_sum,
    encode_records,
    encode_sum,
    fwht,
    modular_overflow_probability,
    round_records,
    rounded_l2_bound,
    smallest_bits,
    to_modular,
)
from peer.dp.distributed.skellam import calibrate_share, check_sites, skellam_share, step_parameters


def clipped(x: np.ndarray, c: float) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, c / np.maximum(n, 1e-300))


def test_walsh_hadamard_is_orthonormal_and_its_own_inverse():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 256))
    y = fwht(x)
    assert np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1))
    assert np.allclose(fwht(y), x)
    for n in (1, 2, 8, 64, 128, 1024):  # scipy's Sylvester–Hadamard matrix is the reference
        z = rng.normal(size=(2, n))
        assert np.allclose(fwht(z), z @ hadamard(n) / math.sqrt(n))


@settings(max_examples=30, deadline=None)
@given(
    dim=st.integers(1, 300),
    n=st.integers(0, 12),
    clip=st.floats(0.1, 10.0),
    scale=st.floats(1.0, 5000.0),
    rotate=st.booleans(),
    beta=st.sampled_from([0.0, 1e-3, math.exp(-0.5), 0.9]),
    seed=st.integers(0, 2**32 - 1),
)
def test_encoding_round_trips_within_the_rounding_bound_and_every_record_meets_the_norm_bound(
    dim, n, clip, scale, rotate, beta, seed
):
    """decode(encode(X)) = Σ clip(x) up to the rounding: each record's rounded vector is within
    √d′ (every coordinate moves by < 1) of its scaled rotated image, so the sum is within n·√d′/γ
    in L2. Each rounded record's squared norm is ≤ ⌊B²⌋ (the conditional rounding's bound)."""
    rng = np.random.default_rng(seed)
    enc = Encoding(dim=dim, clip_norm=clip, scale=scale, bits=64, beta=beta, rotation_seed=seed if rotate else None)
    records = rng.normal(size=(n, dim)) * rng.choice([0.01, 1.0, 100.0])  # inside and far outside the clip
    rounded = round_records(records, enc, np.random.default_rng(seed + 1))
    assert rounded.shape == (n, enc.padded_dim)
    assert np.all(np.einsum("ij,ij->i", rounded, rounded) <= enc.squared_bound)
    assert np.all(np.abs(rounded).sum(axis=1) <= enc.l1_sensitivity + 1e-9)
    assert np.all(np.abs(rounded) <= enc.coordinate_bound)
    total = encode_records(records, enc, np.random.default_rng(seed + 1))
    assert np.array_equal(total, rounded.sum(axis=0))  # the same draws, summed
    decoded = decode_sum(to_modular(total, 64), enc)
    expected = clipped(records, clip).sum(axis=0) if n else np.zeros(dim)
    assert np.linalg.norm(decoded - expected) <= n * math.sqrt(enc.padded_dim) / scale + 1e-9 * (1 + n * clip)


@settings(max_examples=40, deadline=None)
@given(
    dim=st.integers(1, 200),
    scale=st.floats(0.5, 300.0),
    spread=st.floats(0.0, 1e4),
    seed=st.integers(0, 2**32 - 1),
)
def test_rounding_the_sum_once_has_the_unconditional_bound_under_the_common_uniform(dim, scale, spread, seed):
    """The coupling behind ``encode_sum``: for sums y, y′ one clipped record apart and one
    uniform u, ⌊y + u⌋ − ⌊y′ + u⌋ is an integer vector within the β = 0 bounds (Δ₂², Δ₁)."""
    rng = np.random.default_rng(seed)
    enc = Encoding(dim=dim, clip_norm=1.0, scale=scale, bits=64, beta=0.0)
    y = rng.normal(size=dim) * spread
    g = clipped(rng.normal(size=(1, dim)) * rng.choice([0.1, 10.0]), 1.0)[0] * scale
    u = rng.random(dim)
    diff = (np.floor(y + g + u) - np.floor(y + u)).astype(np.int64)
    assert diff @ diff <= enc.squared_bound
    assert np.abs(diff).sum() <= enc.l1_sensitivity + 1e-9


def test_encode_sum_round_trips_and_needs_unconditional_rounding():
    rng = np.random.default_rng(8)
    enc = Encoding(dim=300, clip_norm=1.0, scale=1000.0, bits=40, beta=0.0, rotation_seed=4)
    records = rng.normal(size=(20, 300))
    decoded = decode_sum(to_modular(encode_sum(records, enc, rng), 40), enc)
    # one rounding of the whole sum: within √d′/γ of the clipped sum
    assert np.linalg.norm(decoded - clipped(records, 1.0).sum(axis=0)) <= math.sqrt(enc.padded_dim) / 1000.0
    assert np.array_equal(encode_sum(np.zeros((0, 300)), enc, rng), np.zeros(enc.padded_dim, np.int64))
    with pytest.raises(InvalidArgument, match="beta"):
        encode_sum(records, Encoding(dim=300, clip_norm=1.0, scale=1000.0, bits=40), rng)


@pytest.mark.parametrize(("dim", "norm", "beta"), [(1000, 50.0, 0.01), (4096, 10.0, 0.05), (64, 200.0, 0.01)])
def test_one_randomized_rounding_exceeds_the_bound_with_probability_at_most_beta(dim, norm, beta):
    """The bound behind conditional rounding's acceptance rate, checked by plain randomized
    rounding of 4000 vectors of norm exactly c: the fraction above B² is ≤ β + 5 SE (SE =
    √(β(1−β)/4000)); fixed seed, false-failure rate < 3e-7 per case."""
    rng = np.random.default_rng(int(dim + norm))
    x = rng.normal(size=(4000, dim))
    x *= norm / np.linalg.norm(x, axis=1, keepdims=True)
    low = np.floor(x)
    r = low + (rng.random(x.shape) < x - low)
    over = np.mean(np.einsum("ij,ij->i", r, r) > rounded_l2_bound(norm, dim, beta) ** 2)
    assert over <= beta + 5 * math.sqrt(beta * (1 - beta) / 4000), over


def test_rounding_is_unbiased():
    """Mean of 4000 independent encodings of one record (d = 64, γ = 10, C = 1): each decoded
    coordinate's mean is within 5 standard errors of the clipped value (rounding variance ≤ 1/4
    per integer coordinate, so SE ≤ 0.5/(γ·√4000)); with 64 coordinates at 5 SE the test fails with
    probability < 64·6e-7 ≈ 4e-5 over the seed."""
    enc = Encoding(dim=64, clip_norm=1.0, scale=10.0, bits=64, rotation_seed=3)
    rng = np.random.default_rng(5)
    x = clipped(rng.normal(size=(1, 64)), 1.0)
    many = np.repeat(x, 4000, axis=0)
    decoded = np.array([decode_sum(to_modular(r, 64), enc) for r in round_records(many, enc, rng)])
    se = 0.5 / (10.0 * math.sqrt(4000))
    assert np.all(np.abs(decoded.mean(axis=0) - x[0]) <= 5 * se)


def test_sensitivities_follow_the_kls_bound():
    enc = Encoding(dim=1000, clip_norm=1.0, scale=2000.0, bits=32, rotation_seed=1)
    assert enc.padded_dim == 1024
    b = rounded_l2_bound(2000.0, 1024, math.exp(-0.5))
    assert b == pytest.approx(math.sqrt(2000.0**2 + 1024 / 4 + 1.0 * (2000.0 + 16.0)))
    assert enc.l2_sensitivity == math.sqrt(math.floor(b * b)) and 2000 < enc.l2_sensitivity < b + 1e-9
    assert enc.l1_sensitivity == pytest.approx(math.sqrt(1024) * enc.l2_sensitivity)
    unconditional = Encoding(dim=1000, clip_norm=1.0, scale=2000.0, bits=32, beta=0.0)
    assert unconditional.l2_sensitivity == pytest.approx(2000.0 + math.sqrt(1000), abs=1e-3)
    record = enc.record_fields()
    for key in ("scale", "modulus_bits", "clip_norm", "rounding_beta", "rotation_seed", "l1_sensitivity"):
        assert key in record


def test_modular_residues_and_their_centred_lift_round_trip():
    v = np.array([-5, -1, 0, 1, 7, -(2**30), 2**30 - 1], dtype=np.int64)
    for bits in (32, 40, 64):
        r = to_modular(v, bits)
        assert r.dtype == np.uint64 and np.all(r < np.uint64(2**bits - 1) + np.uint64(1) if bits < 64 else True)
        assert np.array_equal(centred(r, bits), v)
    # wrap-around: 2^(b−1) is read back as −2^(b−1)
    assert centred(to_modular(np.array([8]), 4), 4).tolist() == [-8]


def test_overflow_bound_holds_against_monte_carlo_and_bits_are_chosen_for_the_target():
    """No rotation, d = 1, one record at the clip (γC = 100), Skellam noise of variance 400 from
    3 sites: the bound on P(wrap) must be ≥ the observed frequency (N = 200k; the bound is ≥ the
    frequency's 5-SE upper end at every b tried, false-failure rate < 1e-6 each)."""
    enc1 = Encoding(dim=1, clip_norm=1.0, scale=100.0, bits=8)
    rng = np.random.default_rng(11)
    n_runs = 200_000
    noise = sum(skellam_share(400.0 / 3, n_runs, rng) for _ in range(3))
    for bits in (8, 9):
        enc = Encoding(dim=1, clip_norm=1.0, scale=100.0, bits=bits)
        value = 100 + noise  # the record's rounded value (γC exactly) plus the noise
        freq = np.mean((value >= 2 ** (bits - 1)) | (value < -(2 ** (bits - 1))))
        bound = modular_overflow_probability(enc, max_records=1, noise_variance=400.0)
        assert freq <= bound, (bits, freq, bound)
    assert modular_overflow_probability(enc1, 1, 400.0) > 0.1
    b = smallest_bits(enc1, max_records=1, noise_variance=400.0, target=1e-9)
    assert modular_overflow_probability(Encoding(1, 1.0, 100.0, b), 1, 400.0) <= 1e-9
    assert modular_overflow_probability(Encoding(1, 1.0, 100.0, b - 1), 1, 400.0) > 1e-9


def test_the_rotation_saves_bits_for_a_large_vector():
    """d = 2^20, 4096 records at γC = 2^12: without the rotation the deterministic bound needs
    room for n·γC per coordinate; with it, Hoeffding over the public signs needs ≈ n·γC·√(2 ln(d/β)/d)."""
    plain = Encoding(dim=1 << 20, clip_norm=1.0, scale=4096.0, bits=64)
    rotated = Encoding(dim=1 << 20, clip_norm=1.0, scale=4096.0, bits=64, rotation_seed=9)
    v = 3.0 * rotated.l2_sensitivity**2
    assert smallest_bits(rotated, 4096, v, 1e-9) <= smallest_bits(plain, 4096, v, 1e-9) - 4


def test_bad_inputs_are_refused_by_name():
    enc = Encoding(dim=4, clip_norm=1.0, scale=10.0, bits=16)
    with pytest.raises(InvalidArgument, match="records"):
        encode_records(np.ones((2, 5)), enc, np.random.default_rng(0))
    with pytest.raises(InvalidArgument, match="records: must be finite"):
        encode_records(np.array([[1.0, np.nan, 0, 0]]), enc, np.random.default_rng(0))
    with pytest.raises(InvalidArgument, match="bits"):
        Encoding(dim=4, clip_norm=1.0, scale=10.0, bits=65)
    with pytest.raises(InvalidArgument, match="beta"):
        Encoding(dim=4, clip_norm=1.0, scale=10.0, bits=16, beta=1.0)
    with pytest.raises(InvalidArgument, match="scale"):
        Encoding(dim=4, clip_norm=1.0, scale=1e9, bits=64)
    with pytest.raises(InvalidArgument, match="total"):
        decode_sum(np.zeros(3, np.uint64), enc)


def test_shares_add_up_to_a_skellam_of_the_summed_variance():
    """Four shares of variance 1.5: their sum is Sk(6). χ² goodness of fit against scipy's PMF on
    N = 100k draws (cells with expected count ≥ 5 kept, the tails pooled), rejecting at 1e-4; the
    variance is within 5 SE (SE = V·√((2 + 1/V)/N)). Fixed seed; false-failure rate ≤ 1e-4 + 1e-6."""
    rng = np.random.default_rng(21)
    n = 100_000
    total = sum(skellam_share(1.5, n, rng) for _ in range(4))
    ks = np.arange(-12, 13)
    expected = stats.skellam.pmf(ks, 3.0, 3.0) * n
    observed = np.array([np.sum(total == k) for k in ks], dtype=float)
    keep = expected >= 5
    exp_k = np.append(expected[keep], n - expected[keep].sum())
    obs_k = np.append(observed[keep], n - observed[keep].sum())
    assert stats.chisquare(obs_k, exp_k).pvalue > 1e-4
    assert abs(total.var() - 6.0) <= 5 * 6.0 * math.sqrt((2 + 1 / 6.0) / n)


@pytest.mark.parametrize(("k", "t"), [(2, 0), (4, 1), (4, 2), (12, 3), (12, 10)])
@pytest.mark.parametrize(("q", "steps"), [(1.0, 20), (0.05, 200)])
def test_any_k_minus_t_shares_meet_the_target_and_no_fewer(k, t, q, steps):
    enc = Encoding(dim=1000, clip_norm=1.0, scale=500.0, bits=32, rotation_seed=0)
    cal = calibrate_share(4.0, 1e-5, k, t, enc.l1_sensitivity, enc.l2_sensitivity, sample_rate=q, steps=steps)

    def eps(variance):
        rdp = rdp_skellam_steps(enc.l1_sensitivity, enc.l2_sensitivity, variance, q, steps, DEFAULT_ORDERS)
        return rdp_to_epsilon(DEFAULT_ORDERS, rdp, 1e-5)

    honest = (k - t) * cal.share_variance
    assert honest == pytest.approx(cal.total_variance)
    assert eps(honest) <= 4.0 and cal.epsilon <= 4.0
    assert eps(honest * (1 - 1e-4)) > 4.0 * (1 - 1e-3)  # the least such variance, to the tolerance
    if k - t >= 2:
        assert eps((k - t - 1) * cal.share_variance) > 4.0  # one honest share fewer is not enough
    assert cal.record_fields()["coalition"] == t


def test_calibration_refuses_too_few_sites_and_bad_targets():
    with pytest.raises(InvalidArgument, match="sites"):
        check_sites(3, 2)
    with pytest.raises(InvalidArgument, match="coalition"):
        check_sites(3, -1)
    with pytest.raises(InvalidArgument, match="epsilon"):
        calibrate_share(0.0, 1e-5, 3, 1, 10.0, 5.0)
    with pytest.raises(InvalidArgument, match="delta"):
        calibrate_share(1.0, 1.0, 3, 1, 10.0, 5.0)
    with pytest.raises(InvalidArgument, match="share_variance"):
        skellam_share(-1.0, 3, np.random.default_rng(0))


def test_step_parameters_hold_the_encoding_and_the_noise_and_refuse_a_mismatched_calibration():
    enc = Encoding(dim=100, clip_norm=1.0, scale=300.0, bits=24, rotation_seed=5)
    cal = calibrate_share(2.0, 1e-5, 5, 2, enc.l1_sensitivity, enc.l2_sensitivity)
    params = step_parameters(enc, cal)
    for key in ("mechanism", "share_variance", "sites", "coalition", "modulus_bits", "scale", "rounding_beta"):
        assert key in params
    assert params["sites"] == 5 and params["coalition"] == 2 and params["modulus_bits"] == 24
    weaker = calibrate_share(2.0, 1e-5, 5, 2, enc.l1_sensitivity, enc.l2_sensitivity / 2)
    with pytest.raises(InvalidArgument, match=r"calibration\.l2_sensitivity"):
        step_parameters(enc, weaker)
