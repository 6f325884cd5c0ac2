"""RS and LC merging: the weights meet and saturate the target (re-accounted independently, by
closed forms written here), prefer the more useful models, θ_λ = Σ λ_i θ_i, draws follow π,
and the refusals. LC is charged the composition of the models it combines; pools built with
``declared=True`` stand for runs whose training records declare state-independent gradients
(as if trained with a linear loss), for which the per-step surrogate is the charge."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special, stats

import peer.dp.accounting as accounting
from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import make_randomness
from peer.dp.accounting import DEFAULT_ORDERS, ApproxDP, TrainingRecord
from peer.dp.accounting.accountant import Accountant
from peer.dp.merging import PoolModel, combine, draw_index, merge_lc, merge_rs
from peer.nn.architectures import build_model, state_arrays

ARCH = {"kind": "mlp", "input_dim": 4, "hidden": [3], "output_dim": 2, "activation": "relu"}
DELTA = 1e-5
T, LR = 40, 2.0
# (clip_norm, noise_multiplier): least private first
HYPER = [(2.0, 6.0), (1.0, 15.0), (0.5, 40.0)]


def _pool(hyper=HYPER, sample_rate=1.0, sizes=None, declared=False):
    pool = []
    for i, (c, s) in enumerate(hyper):
        training = TrainingRecord.constant(
            "replace-one", T, LR, c, s, sample_rate, state_independent_gradients=declared
        )
        pool.append(
            PoolModel(
                f"m{i}", ARCH, state_arrays(build_model(ARCH, seed=i)), training, 500 if sizes is None else sizes[i]
            )
        )
    return pool


# ---- independent accounting (closed forms, no peer.dp.accounting) ----


def _gdp_delta(mu, eps):
    """δ(ε) of μ-GDP (Dong, Roth & Su 2022, Cor. 2.13)."""
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def _gdp_epsilon(mu, delta):
    return optimize.brentq(lambda e: _gdp_delta(mu, e) - delta, 0.0, 500.0, xtol=1e-12)


def _model_mu(c_s):
    """A full-batch run of T identical steps under replace-one: μ = sqrt(T)·2/σ."""
    return math.sqrt(T) * 2.0 / c_s[1]


def _lc_mu(lam, hyper=HYPER):
    """Surrogate μ of θ_λ: per step Δ = 2 Σ λ_i η C_i, s = sqrt(Σ (λ_i η σ_i C_i)²), T identical steps."""
    sens = 2 * sum(lam_i * LR * c for lam_i, (c, s) in zip(lam, hyper, strict=True))
    std = math.sqrt(sum((lam_i * LR * s * c) ** 2 for lam_i, (c, s) in zip(lam, hyper, strict=True)))
    return math.sqrt(T) * sens / std


def _composition_mu(lam, hyper=HYPER):
    """μ of releasing every model with λ_i > 0: sqrt(Σ μ_i²)."""
    return math.sqrt(sum(_model_mu(h) ** 2 for lam_i, h in zip(lam, hyper, strict=True) if lam_i > 0))


def _rs_pld_delta(pi, eps):
    """Full-batch Gaussian models are symmetric, so the RS hockey-stick bound is Σ π_i δ_i(ε)."""
    return sum(p * _gdp_delta(_model_mu(h), eps) for p, h in zip(pi, HYPER, strict=True))


def _rs_rdp_epsilon(pi, delta):
    orders = np.asarray(DEFAULT_ORDERS)
    per_model = np.array([orders * _model_mu(h) ** 2 / 2 for h in HYPER])
    with np.errstate(divide="ignore"):
        mix = special.logsumexp((orders - 1) * per_model, axis=0, b=np.asarray(pi)[:, None]) / (orders - 1)
    return rdp_privacy_accountant.compute_epsilon(orders, mix, delta)[0]


EPS = [_gdp_epsilon(_model_mu(h), DELTA) for h in HYPER]
UTIL = [0.9, 0.8, 0.6]  # the least private model is the most useful


def test_independent_accounting_sanity():
    assert EPS[0] > EPS[1] > EPS[2]


# ---- RS ----


def test_rs_meets_and_saturates_the_target_and_prefers_accurate_models():
    target = 0.5 * (EPS[1] + EPS[2])
    merged = merge_rs(_pool(), target, DELTA, prior=UTIL, randomness=make_randomness(0))
    pi = np.asarray(merged.choice.weights)
    # δ of the RS bound at the target, by the closed form: within the budget, and saturating it
    # (1e-3 relative allows for the PLD's pessimistic discretisation)
    d = _rs_pld_delta(pi, target)
    assert d <= DELTA * (1 + 1e-6)
    assert d >= DELTA * (1 - 1e-3)
    assert merged.record.epsilon <= target and merged.choice.saturated
    # the best single feasible model is the most private one (utility 0.6): RS beats it by
    # putting some weight on more useful models
    assert merged.choice.utility > UTIL[2]
    assert pi[0] + pi[1] > 0
    # brute force over a fine grid of π: nothing feasible is more useful (to the LP's tolerance)
    best = -1.0
    for a in np.linspace(0, 1, 41):
        for b in np.linspace(0, 1 - a, round((1 - a) * 40) + 1):
            p = [a, b, max(0.0, 1 - a - b)]
            if _rs_pld_delta(p, target) <= DELTA * (1 - 1e-3):
                best = max(best, float(np.dot(p, UTIL)))
    assert merged.choice.utility >= best - 1e-9


def test_rs_by_rdp_meets_the_rdp_target():
    target = 0.5 * (EPS[0] + EPS[1])
    merged = merge_rs(_pool(), target, DELTA, prior=UTIL, randomness=make_randomness(0), figure="rdp")
    pi = merged.choice.weights
    e = _rs_rdp_epsilon(pi, DELTA)
    assert e <= target * (1 + 1e-9) and e >= target * (1 - 1e-3)
    assert merged.record.parameters["epsilon_rdp"] == pytest.approx(e, rel=1e-9)
    assert merged.record.epsilon < e  # PLD is tighter than RDP on the same π


def test_the_merges_choice_and_record_are_stated_by_the_accountant_given():
    """One accountant through the merge: a coarser PLD grid and fewer orders change the figures,
    and the choice and the record both carry that accountant's (not the default one's)."""
    acc = Accountant(orders=[2.0, 4.0, 8.0, 16.0, 32.0], value_discretization_interval=1e-2)
    target = 0.5 * (EPS[0] + EPS[1])
    pool = _pool()
    models = [m.privacy for m in pool]
    for method in ("rs", "lc"):
        if method == "rs":
            merged = merge_rs(pool, target, DELTA, prior=UTIL, randomness=make_randomness(0), accountant=acc)
            own = accounting.rs_epsilon(models, merged.choice.weights, DELTA, accountant=acc)
            default = accounting.rs_epsilon(models, merged.choice.weights, DELTA)
        else:
            merged = merge_lc(pool, target, DELTA, prior=UTIL, accountant=acc)
            own = accounting.lc_epsilon(models, merged.choice.weights, DELTA, accountant=acc)
            default = accounting.lc_epsilon(models, merged.choice.weights, DELTA)
        assert merged.record.epsilon == pytest.approx(own.pld, rel=1e-12)
        assert merged.record.parameters["epsilon_rdp"] == pytest.approx(own.rdp, rel=1e-12)
        assert merged.choice.epsilon.pld == pytest.approx(own.pld, rel=1e-12)
        # the coarse grid is pessimistic and five orders convert worse than the default's
        assert own.pld > default.pld and own.rdp > default.rdp
        assert Accountant(acc.orders, 1e-2).epsilon(merged.record, DELTA) == pytest.approx((own.pld, own.rdp))


def test_rs_whose_best_model_is_within_the_target_takes_it():
    merged = merge_rs(_pool(), EPS[0] + 1.0, DELTA, prior=UTIL, randomness=make_randomness(0))
    assert merged.choice.weights == pytest.approx((1.0, 0.0, 0.0))
    assert all(np.array_equal(merged.arrays[k], _pool()[0].arrays[k]) for k in merged.arrays)


def test_rs_draws_follow_pi():
    """20,000 draws from a fixed seed against π: chi-square goodness of fit, false-failure rate 1e-6."""
    pi = [0.5, 0.3, 0.15, 0.05]
    r = make_randomness(123)
    draws = np.array([draw_index(pi, r) for _ in range(20_000)])
    observed = np.bincount(draws, minlength=4)
    assert stats.chisquare(observed, np.asarray(pi) * len(draws)).pvalue > 1e-6


def test_rs_returns_the_drawn_model_and_its_record_does_not_say_which():
    pool = _pool()
    target = _rs_rdp_epsilon([0.5, 0.5, 0.0], DELTA)  # π = (½, ½, 0) is feasible: the draws vary
    drawn = set()
    params = set()
    for seed in range(6):
        merged = merge_rs(pool, target, DELTA, prior=UTIL, randomness=make_randomness(seed), figure="rdp")
        i = draw_index(merged.choice.weights, make_randomness(seed))  # the same stream draws the same index
        assert all(np.array_equal(merged.arrays[k], pool[i].arrays[k]) for k in merged.arrays)
        drawn.add(i)
        assert merged.choice.weights[0] >= 0.5 - 1e-9
        rec = merged.record.to_dict()
        assert rec["seed"] == seed and rec["randomness"] == "fixed-seed"
        params.add(str(sorted(rec["parameters"].items())))
    assert len(drawn) > 1
    assert len(params) == 1  # every draw's record is the same: it does not identify the model


def test_rs_accepts_models_known_only_by_epsilon_delta():
    pool = _pool()
    pool[2] = PoolModel("approx", ARCH, pool[2].arrays, ApproxDP(1.0, 1e-6, "replace-one"))
    merged = merge_rs(pool, 2.0, DELTA, prior=UTIL, randomness=make_randomness(0))
    assert merged.record.epsilon <= 2.0
    assert merged.record.parameters["models"][2] == {"epsilon": 1.0, "delta": 1e-6, "adjacency": "replace-one"}


# ---- LC ----


def _towards_weights(weights):
    """A public prior over λ (a function of λ alone, no model read): closeness to ``weights``."""
    return lambda lam: -float(np.linalg.norm(np.asarray(lam) - np.asarray(weights)))


def _towards(i):
    return _towards_weights(np.eye(len(HYPER))[i])


def _distance_utility(reference):
    """A measured utility: closeness of the weights to ``reference`` (stands for 'accuracy of θ_λ');
    reading it is a utility selection."""
    return lambda arrays: -math.sqrt(sum(float(np.sum((arrays[k] - reference[k]) ** 2)) for k in arrays))


def test_lc_surrogate_combination_is_the_weighted_sum_meets_and_saturates():
    pool = _pool(declared=True)
    target = 0.5 * (EPS[1] + EPS[2])
    merged = merge_lc(pool, target, DELTA, prior=_towards(0))
    lam = np.asarray(merged.choice.weights)
    assert lam.sum() == pytest.approx(1.0) and np.all(lam >= 0)
    for k in merged.arrays:
        expected = sum(lam_i * pool[i].arrays[k].astype(np.float64) for i, lam_i in enumerate(lam))
        np.testing.assert_allclose(merged.arrays[k], expected, rtol=1e-6, atol=1e-7)
    e = _gdp_epsilon(_lc_mu(lam), DELTA)
    assert e <= target * (1 + 1e-6) and e >= target * (1 - 1e-3)
    assert merged.record.epsilon <= target and merged.choice.bound == "surrogate"
    assert merged.record.mechanism == "lc-merge" and merged.record.randomness == "none"
    assert merged.record.parameters["lam"] == pytest.approx(list(lam))
    assert merged.record.parameters["bound"] == "surrogate" and merged.record.parameters["surrogate"]["valid"] is True


def test_lc_is_charged_the_composition_of_the_models_it_combines():
    pool = _pool()
    target = 1.02 * _gdp_epsilon(_composition_mu([0, 1, 1]), DELTA)  # {1, 2} fit together, model 0 never
    merged = merge_lc(pool, target, DELTA, prior=_towards(0))
    lam = np.asarray(merged.choice.weights)
    for k in merged.arrays:
        expected = sum(lam_i * pool[i].arrays[k].astype(np.float64) for i, lam_i in enumerate(lam))
        np.testing.assert_allclose(merged.arrays[k], expected, rtol=1e-6, atol=1e-7)
    # model 0 alone already exceeds the target: it can take no weight
    assert lam[0] == 0.0 and merged.choice.bound == "composition"
    proven = _gdp_epsilon(_composition_mu(lam), DELTA)
    assert proven <= target and merged.record.epsilon == pytest.approx(proven, abs=2e-3)
    assert merged.record.epsilon >= proven * (1 - 1e-9)  # the PLD figure is pessimistic
    params = merged.record.parameters
    assert params["bound"] == "composition" and params["surrogate"]["valid"] is False
    assert params["surrogate"]["mu"] == pytest.approx(_lc_mu(lam), rel=1e-9)
    # saturated: nothing more can be added, i.e. the support is {1, 2}
    assert merged.choice.saturated == (lam[1] > 0 and lam[2] > 0)


def test_lc_prefers_the_more_useful_model():
    """Utility = closeness to model 0 (the least private): LC puts as much weight on it as the
    target allows; closeness to model 2 instead puts all the weight on model 2."""
    for declared in (True, False):
        pool = _pool(declared=declared)
        target = 0.5 * (EPS[0] + EPS[1]) if declared else EPS[0] * 1.01
        towards0 = merge_lc(pool, target, DELTA, prior=_towards(0))
        assert int(np.argmax(towards0.choice.weights)) == 0
        towards2 = merge_lc(pool, target, DELTA, prior=_towards(2))
        assert towards2.choice.weights == pytest.approx((0.0, 0.0, 1.0), abs=1e-9)


def test_lc_beats_rs_on_a_gaussian_pool():
    """Three models with equal hyperparameters: releasing all three costs μ = √3·μ_1 (their
    composition, which for equal models is also the surrogate), and at that target LC takes the
    uniform average, while any RS release is one of the models."""
    pool = _pool(hyper=[(1.0, 15.0)] * 3)
    eps = _gdp_epsilon(_model_mu((1.0, 15.0)), DELTA)
    centre = combine([m.arrays for m in pool], [1 / 3] * 3)
    uniform_eps = _gdp_epsilon(math.sqrt(3) * _model_mu((1.0, 15.0)), DELTA)
    merged = merge_lc(pool, uniform_eps * 1.001, DELTA, prior=_towards_weights([1 / 3] * 3))
    assert merged.choice.weights == pytest.approx((1 / 3, 1 / 3, 1 / 3), abs=0.02)
    rs = merge_rs(pool, uniform_eps * 1.001, DELTA, prior=[1.0, 1.0, 1.0], randomness=make_randomness(0))
    assert _distance_utility(centre)(merged.arrays) > _distance_utility(centre)(rs.arrays)
    assert eps < uniform_eps


@pytest.mark.parametrize("method", ["rs", "lc"])
def test_refusals(method):
    def go(pool, target=5.0, delta=DELTA, figure="pld"):
        if method == "rs":
            return merge_rs(pool, target, delta, prior=[0.5] * len(pool), randomness=make_randomness(0), figure=figure)
        return merge_lc(pool, target, delta, prior=lambda lam: 0.0, figure=figure)

    with pytest.raises(InvalidArgument, match="empty"):
        go([])
    other = dict(ARCH, hidden=[5])
    mismatched = [
        *_pool()[:2],
        PoolModel("x", other, state_arrays(build_model(other, seed=0)), _pool()[0].privacy, 500),
    ]
    with pytest.raises(InvalidArgument, match="architecture"):
        go(mismatched)
    with pytest.raises(InvalidArgument, match="delta"):
        go(_pool(), delta=1.5)
    with pytest.raises(InvalidArgument, match="target_epsilon"):
        go(_pool(), target=-1.0)
    # unreachable: the message names the most private reachable ε — here the most private model
    # alone, by RDP (by PLD: test_unreachable_by_pld_names_the_most_private_model)
    rdp_eps = _rs_rdp_epsilon([0.0, 0.0, 1.0], DELTA)
    with pytest.raises(InvalidArgument, match=r"most private reachable is epsilon = ([0-9.]+)") as info:
        go(_pool(), target=0.9 * rdp_eps, figure="rdp")
    assert float(info.value.rule.rsplit("= ", 1)[1]) == pytest.approx(rdp_eps, rel=1e-4)


@pytest.mark.parametrize("method", ["rs", "lc"])
def test_unreachable_by_pld_names_the_most_private_model(method):
    with pytest.raises(InvalidArgument, match=r"most private reachable is epsilon = ([0-9.]+)") as info:
        if method == "rs":
            merge_rs(_pool(), 0.5 * EPS[2], DELTA, prior=UTIL, randomness=make_randomness(0))
        else:
            merge_lc(_pool(), 0.5 * EPS[2], DELTA, prior=lambda lam: 0.0)
    assert float(info.value.rule.rsplit("= ", 1)[1]) == pytest.approx(EPS[2], rel=1e-3)


def test_lc_refuses_epsilon_delta_only_models_and_mixed_sizes_under_the_surrogate():
    pool = _pool()
    pool[1] = PoolModel("approx", ARCH, pool[1].arrays, ApproxDP(1.0, 1e-6, "replace-one"))
    with pytest.raises(InvalidArgument, match=r"(?i)no free lunch"):
        merge_lc(pool, 5.0, DELTA, prior=lambda lam: 0.0)
    with pytest.raises(InvalidArgument, match="dataset size"):
        merge_lc(_pool(sizes=[500, 500, 400], declared=True), 5.0, DELTA, prior=lambda lam: 0.0)
    # the composition needs no common 1/n
    assert merge_lc(_pool(sizes=[500, 500, 400]), 5.0, DELTA, prior=lambda lam: 0.0).choice.bound == "composition"


def test_lc_of_subsampled_models_is_charged_by_composition():
    """The surrogate is defined for full batch only; a Poisson pool (even one that declares state
    independence) is charged the composition of its subsampled-Gaussian profiles."""
    pool = _pool(sample_rate=0.1, declared=True)
    merged = merge_lc(pool, 50.0, DELTA, prior=_towards_weights([0.5, 0.5, 0.0]))
    assert merged.choice.bound == "composition" and "surrogate" not in merged.record.parameters
    acc = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS))
    from dp_accounting import dp_event

    for (_c, s), lam_i in zip(HYPER, merged.choice.weights, strict=True):
        if lam_i > 0:
            acc.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(s)), T)
    # dp-accounting's Poisson event is add-remove; these models are replace-one, whose RDP is larger
    assert merged.record.parameters["epsilon_rdp"] >= acc.get_epsilon(DELTA)


def test_combine_checks_weights_and_shapes():
    pool = _pool()
    arrays = [m.arrays for m in pool]
    with pytest.raises(InvalidArgument, match="sum to 1"):
        combine(arrays, [0.5, 0.5, 0.5])
    with pytest.raises(InvalidArgument, match=r"lam\[1\]"):
        combine(arrays, [1.5, -0.5, 0.0])
    lam = [0.2, 0.3, 0.5]
    out = combine(arrays, lam)
    for k in out:
        np.testing.assert_allclose(out[k], sum(lam_i * a[k] for lam_i, a in zip(lam, arrays, strict=True)), rtol=1e-6)


# ---- selection: public prior by default, utility selection charged (issue 20, item 1) ----

# The two models: full-batch DP-GD, replace-one; b with μ = 8, a with μ = 0.1 (one step
# each: μ = 2C/σ with C = 1), target (2, 1e-5).
MU_A, MU_B = 0.1, 8.0


def _pair(arrays_a, arrays_b):
    a = TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 2.0 / MU_A)
    b = TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 2.0 / MU_B)
    return [PoolModel("a", ARCH, arrays_a, a, 500), PoolModel("b", ARCH, arrays_b, b, 500)]


def _two_datasets():
    """Stand-ins for the pool trained on neighbouring datasets D and D′: the same training records,
    different weights (a score of b on D is high, on D′ low)."""
    w = [state_arrays(build_model(ARCH, seed=s)) for s in range(4)]
    return _pair(w[0], w[1]), _pair(w[2], w[3])


def test_default_selection_is_public_identical_on_neighbouring_datasets():
    """Regression (issue 20, item 1): the old merge_rs chose π from each model's measured score,
    so whether π_b > 0 told D from D′ (ε_LB ≥ 8.19 against a record saying 2.0). Now π is a
    function of the training records only: the same π and the same record on D and D′, whatever
    the weights, and the RS bound of that π is the whole charge."""
    d, d_prime = _two_datasets()
    out = [merge_rs(pool, 2.0, DELTA, randomness=make_randomness(0)) for pool in (d, d_prime)]
    assert out[0].choice.weights == out[1].choice.weights
    params = [dict(m.record.parameters) for m in out]
    assert params[0] == params[1]
    sel = out[0].record.to_dict()["parameters"]["selection"]
    assert sel["kind"] == "public-prior" and sel["prior"] == "epsilon"
    # the default prior: each model's own ε; π_b > 0 always (b is the less noisy), on every dataset
    assert sel["prior_utilities"] == pytest.approx([_gdp_epsilon(MU_A, DELTA), _gdp_epsilon(MU_B, DELTA)], abs=2e-3)
    pi = np.asarray(out[0].choice.weights)
    assert pi[1] > 0
    # the charge (the ledger's reading of the record) is the RS bound of this π, within the target
    charged = accounting.record_epsilon(out[0].record, DELTA)
    assert charged[0] <= 2.0 and charged[0] == pytest.approx(out[0].record.epsilon)
    d_rs = sum(p * _gdp_delta(mu, 2.0) for p, mu in zip(pi, (MU_A, MU_B), strict=True))
    assert d_rs <= DELTA * (1 + 1e-6)


def test_utility_selection_scores_a_public_subset_and_is_charged_its_composition():
    """Utility selection (opt-in): at target 2 only {a} fits (b alone costs 52.08), so b is never
    scored and a is released, charged a's ε; at a target that the composition of {a, b} meets,
    both are scored, the better is released with certainty, and the ledger charges the
    composition μ = sqrt(8² + 0.1²), by the closed form."""
    d, _ = _two_datasets()
    read = []

    def score(arrays):
        read.append(next(m.name for m in d if m.arrays is arrays))
        return 1.0 if arrays is d[1].arrays else 0.0  # b scores best

    small = merge_rs(d, 2.0, DELTA, randomness=make_randomness(0), selection="utility", score=score)
    assert read == ["a"] and small.choice.weights == (1.0, 0.0)
    sel = small.record.to_dict()["parameters"]["selection"]
    assert sel["kind"] == "utility" and sel["scored"] == [0]
    assert small.record.epsilon == pytest.approx(_gdp_epsilon(MU_A, DELTA), abs=2e-3)

    both = _gdp_epsilon(math.hypot(MU_A, MU_B), DELTA)
    read.clear()
    big = merge_rs(d, both + 0.05, DELTA, randomness=make_randomness(0), selection="utility", score=score)
    assert sorted(read) == ["a", "b"] and big.choice.weights == (0.0, 1.0)
    assert big.record.to_dict()["parameters"]["selection"]["scored"] == [0, 1]
    # the record's ε and the ledger's interpretation (PLD and RDP) are the composition of both
    pld_eps, rdp_eps = accounting.record_epsilon(big.record, DELTA)
    assert big.record.epsilon == pytest.approx(both, abs=5e-3) and pld_eps == pytest.approx(both, abs=5e-3)
    orders = np.asarray(DEFAULT_ORDERS)
    np.testing.assert_allclose(
        accounting.rdp_of_record(big.record, orders), orders * (MU_A**2 + MU_B**2) / 2, rtol=1e-9
    )
    assert rdp_eps >= pld_eps
    # the mixture bound of the same π (what the old record would have claimed) is far below
    assert accounting.rs_epsilon([m.privacy for m in d], [0.0, 1.0], DELTA).pld < big.record.epsilon


def test_utility_selection_record_must_cover_the_weights_and_old_records_read_as_before():
    d, _ = _two_datasets()
    models = [m.privacy for m in d]
    old = accounting.rs_merge_record(models, [0.9, 0.1], DELTA, names=["a", "b"])
    assert "selection" not in old.parameters  # the pre-selection format: a mixture bound
    legacy = ReleaseRecord.from_dict({**old.to_dict()})
    np.testing.assert_array_equal(accounting.rdp_of_record(legacy), accounting.rs_rdp(models, [0.9, 0.1]))
    bad = {**old.to_dict()}
    bad["parameters"] = {**bad["parameters"], "selection": {"kind": "utility", "prior": "epsilon", "scored": [0]}}
    with pytest.raises(InvalidArgument, match=r"parameters\.selection\.scored"):
        accounting.rdp_of_record(ReleaseRecord.from_dict(bad))
    with pytest.raises(InvalidArgument, match="selection"):
        merge_rs(d, 2.0, DELTA, randomness=make_randomness(0), score=lambda a: 0.0)  # a score needs "utility"
    with pytest.raises(InvalidArgument, match="score"):
        merge_rs(d, 2.0, DELTA, randomness=make_randomness(0), selection="utility")


def test_lc_utility_selection_is_charged_the_composition_of_the_scored_subset():
    """LC's search over measured candidates: every candidate is supported on the public subset S,
    and the release is charged S's composition even when the best λ uses fewer models (and even
    for models that declare state-independent gradients)."""
    for declared in (False, True):
        pool = _pool(declared=declared)
        target = 1.02 * _gdp_epsilon(_composition_mu([0, 1, 1]), DELTA)  # {1, 2} fit together
        merged = merge_lc(
            pool, target, DELTA, selection="utility", score=_distance_utility(pool[2].arrays), candidates=30
        )
        sel = merged.record.to_dict()["parameters"]["selection"]
        assert sel["kind"] == "utility" and sel["scored"] == [1, 2]
        assert merged.choice.weights == pytest.approx((0.0, 0.0, 1.0))
        proven = _gdp_epsilon(_composition_mu([0, 1, 1]), DELTA)
        assert merged.record.epsilon == pytest.approx(proven, abs=2e-3)
        assert accounting.record_epsilon(merged.record, DELTA)[0] == pytest.approx(proven, abs=2e-3)
        assert merged.record.parameters["bound"] == "composition"


def test_declared_prior_in_the_pool_metadata_decides_pi_and_is_recorded():
    """A site's declared prior (each model's metadata "prior_utility") replaces the default ε
    prior; declared for some models only, it is refused naming the others."""
    from dataclasses import replace

    from peer.dp.merging import pool_prior

    d, _ = _two_datasets()
    declared = [replace(m, metadata={"prior_utility": u}) for m, u in zip(d, (0.9, 0.1), strict=True)]
    assert pool_prior(declared, DELTA) == ([0.9, 0.1], "declared")
    merged = merge_rs(declared, 2.0, DELTA, randomness=make_randomness(0))
    assert merged.choice.weights == pytest.approx((1.0, 0.0))  # a is both feasible and preferred
    sel = merged.record.to_dict()["parameters"]["selection"]
    assert sel == {"kind": "public-prior", "prior": "declared", "prior_utilities": [0.9, 0.1]}
    with pytest.raises(InvalidArgument, match=r"prior_utility.*\['b'\]"):
        pool_prior([declared[0], d[1]], DELTA)


def test_merge_pool_scores_nothing_unless_asked_for_a_utility_selection():
    from peer.dp.pools import merge_pool

    d, _ = _two_datasets()
    x, y = np.zeros((2, 4), np.float32), np.zeros(2, np.int64)
    with pytest.raises(InvalidArgument, match="validation"):
        merge_pool(d, "rs", 2.0, DELTA, validation=(x, y))
    with pytest.raises(InvalidArgument, match="utilities"):
        merge_pool(d, "rs", 2.0, DELTA, utilities=[0.5, 0.5])
    merged = merge_pool(d, "rs", 2.0, DELTA, selection="utility", validation=(x, y))
    assert merged.record.to_dict()["parameters"]["selection"]["scored"] == [0]


def test_site_toml_pool_selection_defaults_to_the_public_prior_and_names_bad_values(tmp_path):
    from peer.net.site import SiteConfig

    base = '[site]\nname = "h"\nlisten = "127.0.0.1:0"\nidentity = "id"\nmodels = "m"\nledger = "l.sqlite"\n'
    (tmp_path / "site.toml").write_text(
        base + '[site.pools.a]\nmodels = "pa"\n[site.pools.b]\nmodels = "pb"\nselection = "utility"\n'
    )
    config = SiteConfig.load(tmp_path / "site.toml")
    assert config.pool_selection == {"a": "public-prior", "b": "utility"}
    (tmp_path / "site.toml").write_text(base + '[site.pools.a]\nmodels = "pa"\nselection = "accuracy"\n')
    with pytest.raises(InvalidArgument, match="selection"):
        SiteConfig.load(tmp_path / "site.toml")
