"""Choosing π / λ for a target: optimality against brute force, saturation, unreachable targets.

LC: a pool that declares state-independent gradients is charged by the per-step surrogate (λ
matters); any other pool by the composition of λ's support (only the subset matters)."""

import itertools
import math

import numpy as np
import pytest

from peer.base.errors import InvalidArgument
from peer.dp.accounting import (
    ApproxDP,
    TrainingRecord,
    UnreachableTarget,
    choose_lam,
    choose_pi,
    gdp_epsilon,
    lc_epsilon,
    lc_segments,
    rs_epsilon,
    rs_profiles,
)
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.targets import lc_feasible_subsets, lc_mu_for_target, rs_most_private_epsilon

INTERVAL = 1e-3
ACCOUNTANT = Accountant(value_discretization_interval=INTERVAL)
POOL = [TrainingRecord.constant("add-remove", 100, 0.1, 1.0, s) for s in (5.0, 10.0, 20.0)]
# the same runs, declared state-independent (e.g. mean estimation with a linear loss)
DECLARED = [
    TrainingRecord.constant("add-remove", 100, 0.1, 1.0, s, state_independent_gradients=True) for s in (5.0, 10.0, 20.0)
]
OWN_MU = [2.0, 1.0, 0.5]  # sqrt(100)/σ, add-remove
ACC = [0.9, 0.8, 0.7]


@pytest.fixture(scope="module")
def profiles():
    return rs_profiles(POOL, accountant=ACCOUNTANT)


def simplex_grid(k, m):
    for combo in itertools.combinations_with_replacement(range(k), m):
        yield np.bincount(combo, minlength=k) / m


@pytest.mark.parametrize("figure", ["pld", "rdp"])
@pytest.mark.parametrize("target", [2.5, 4.0, 8.0])
def test_choose_pi_is_feasible_optimal_and_saturating(profiles, figure, target):
    choice = choose_pi(profiles, ACC, target, 1e-5, figure=figure, accountant=ACCOUNTANT)
    achieved = getattr(choice.epsilon, figure)
    assert achieved <= target + 1e-9
    assert choice.utility == pytest.approx(np.dot(ACC, choice.weights))
    # No grid point that meets the target does better.
    best_grid = max(
        np.dot(ACC, pi)
        for pi in simplex_grid(3, 10)
        if getattr(rs_epsilon(profiles, pi, 1e-5, accountant=ACCOUNTANT), figure) <= target
    )
    assert choice.utility >= best_grid - 1e-9
    # The most useful model alone misses the target, so the budget is spent.
    assert choice.saturated and achieved == pytest.approx(target, rel=1e-4)


def test_choose_pi_picks_the_best_model_when_it_is_private_enough(profiles):
    choice = choose_pi(profiles, ACC, 50.0, 1e-5, accountant=ACCOUNTANT)
    assert choice.weights == (1.0, 0.0, 0.0) and not choice.saturated


def test_unreachable_rs_target_names_the_most_private_epsilon(profiles):
    with pytest.raises(UnreachableTarget) as e:
        choose_pi(profiles, ACC, 1.0, 1e-5, accountant=ACCOUNTANT)
    best = profiles[2].epsilon(1e-5).pld
    assert e.value.most_private_epsilon == pytest.approx(best, rel=1e-5)
    assert "most private reachable is epsilon = " in str(e.value) and e.value.field == "target_epsilon"


def test_mixtures_can_beat_every_single_model():
    # Two (ε, δ)-style profiles private in opposite directions: a 50/50 mixture halves the δ of
    # both directions, so RS reaches an ε no single model reaches; the bisection finds it.
    from peer.dp.accounting import pld as pldm
    from peer.dp.accounting.profiles import PrivacyProfile

    orders = (2.0,)
    a = pldm.non_private_pld(INTERVAL)
    remove_only = pldm.PLD(pldm.directions(a)[0], pldm.directions(pldm.identity_pld(INTERVAL))[0])
    add_only = pldm.PLD(pldm.directions(pldm.identity_pld(INTERVAL))[0], pldm.directions(a)[0])
    profs = [PrivacyProfile("add-remove", orders, np.array([np.inf]), p, INTERVAL) for p in (remove_only, add_only)]
    assert rs_most_private_epsilon(profs, 0.6) == 0.0
    assert all(p.epsilon(0.6).pld == math.inf for p in profs)


def test_choose_pi_with_approx_dp_models():
    models = [*POOL[:2], ApproxDP(1.5, 1e-07, "add-remove")]
    choice = choose_pi(models, ACC, 3.0, 1e-5, accountant=ACCOUNTANT)
    assert choice.epsilon.pld <= 3.0 and choice.weights[2] > 0
    with pytest.raises(UnreachableTarget):
        choose_pi(models, ACC, 3.0, 1e-5, figure="rdp", accountant=ACCOUNTANT)


@pytest.mark.parametrize("target", [3.0, 6.0])
def test_choose_lam_surrogate_linear_proxy(target):
    choice = choose_lam(DECLARED, ACC, target, 1e-5, accountant=ACCOUNTANT)
    assert choice.bound == "surrogate" and choice.epsilon.pld <= target and choice.saturated
    assert choice.epsilon.closed_form == pytest.approx(target, rel=1e-3)
    seg = lc_segments(DECLARED)
    mu_max = lc_mu_for_target(target, 1e-5)
    grid = np.array(list(simplex_grid(3, 40)))
    feasible = grid[seg.mu_many(grid) <= mu_max]
    assert choice.utility >= (feasible @ np.array(ACC)).max() - 1e-9


def test_choose_lam_surrogate_with_a_callable_utility():
    # A concave utility (best at an interior λ) is evaluated on boundary candidates only.
    peak = np.array([0.2, 0.3, 0.5])

    def utility(lam):
        return -float(np.sum((lam - peak) ** 2))

    loose = choose_lam(DECLARED, utility, 50.0, 1e-5, accountant=ACCOUNTANT)
    assert np.allclose(loose.weights, peak, atol=0.05) and not loose.saturated
    tight = choose_lam(DECLARED, utility, 3.0, 1e-5, accountant=ACCOUNTANT)
    assert tight.epsilon.pld <= 3.0
    assert lc_epsilon(DECLARED, tight.weights, 1e-5, accountant=ACCOUNTANT).pld <= 3.0


def test_choose_lam_surrogate_rdp_and_unreachable():
    choice = choose_lam(DECLARED, ACC, 4.0, 1e-5, figure="rdp", accountant=ACCOUNTANT)
    assert choice.epsilon.rdp <= 4.0 + 1e-9 and choice.epsilon.rdp == pytest.approx(4.0, rel=1e-4)
    with pytest.raises(UnreachableTarget) as e:
        choose_lam(DECLARED, ACC, 1.0, 1e-5, accountant=ACCOUNTANT)
    assert e.value.most_private_epsilon == pytest.approx(
        rs_profiles(POOL[2:], accountant=ACCOUNTANT)[0].epsilon(1e-5).pld, rel=1e-4
    )


def _composition_closed_form(subset):
    return gdp_epsilon(math.sqrt(sum(OWN_MU[i] ** 2 for i in subset)), 1e-5)


@pytest.mark.parametrize("target", [2.5, 5.0, 9.5, 30.0])
def test_feasible_subsets_are_the_compositions_meeting_the_target(target):
    found = lc_feasible_subsets(POOL, target, 1e-5, accountant=ACCOUNTANT)
    # brute force over every subset with the closed form (the PLD figure is pessimistic by ≤ 1e-2 here)
    expected = {
        s for k in (1, 2, 3) for s in itertools.combinations(range(3), k) if _composition_closed_form(s) <= target
    }
    assert set(found) == expected
    for s, eps in found.items():
        assert eps == pytest.approx(_composition_closed_form(s), abs=2e-2) and eps <= target


@pytest.mark.parametrize("target", [2.5, 5.0, 9.5])
def test_choose_lam_composition_linear_proxy_picks_the_best_single_feasible_model(target):
    choice = choose_lam(POOL, ACC, target, 1e-5, accountant=ACCOUNTANT)
    best = min(i for i in range(3) if _composition_closed_form((i,)) <= target)  # ACC decreases with i
    assert choice.bound == "composition" and choice.weights == tuple(np.eye(3)[best])
    assert choice.utility == ACC[best] and choice.epsilon.pld <= target
    assert choice.epsilon.closed_form == pytest.approx(_composition_closed_form((best,)), rel=1e-9)


def test_choose_lam_composition_callable_is_best_over_the_feasible_faces():
    # Utility peaks at an interior λ; at target 5 only {1, 2} can be combined (μ² = 1.25), so the
    # best is the grid point of that face closest to the peak's projection.
    peak = np.array([0.2, 0.3, 0.5])
    calls = []

    def utility(lam):
        calls.append(lam.copy())
        return -float(np.sum((lam - peak) ** 2))

    choice = choose_lam(POOL, utility, 5.0, 1e-5, accountant=ACCOUNTANT, max_points=200)
    assert choice.bound == "composition" and choice.weights[0] == 0.0 and choice.saturated
    assert all(c[0] == 0.0 for c in calls)  # never a λ that puts weight on model 0
    assert choice.weights[1] == pytest.approx(0.4, abs=0.02) and choice.weights[2] == pytest.approx(0.6, abs=0.02)
    assert choice.epsilon.closed_form == pytest.approx(_composition_closed_form((1, 2)), rel=1e-9)
    # the cost does not depend on λ over the support
    assert lc_epsilon(POOL, [0, 0.9, 0.1], 1e-5).closed_form == pytest.approx(
        lc_epsilon(POOL, [0, 0.1, 0.9], 1e-5).closed_form
    )
    # not saturated: a single model while a pair would fit
    single = choose_lam(POOL, lambda lam: float(lam[2]), 5.0, 1e-5, accountant=ACCOUNTANT, max_points=50)
    assert single.weights == (0.0, 0.0, 1.0) and not single.saturated


def test_choose_lam_composition_rdp_and_unreachable():
    choice = choose_lam(POOL, ACC, 6.0, 1e-5, figure="rdp", accountant=ACCOUNTANT)
    assert choice.epsilon.rdp <= 6.0
    assert choice.weights == (0.0, 1.0, 0.0)  # model 0 alone: RDP ε ≈ 9 > 6
    with pytest.raises(UnreachableTarget) as e:
        choose_lam(POOL, ACC, 1.0, 1e-5, accountant=ACCOUNTANT)
    assert e.value.most_private_epsilon == pytest.approx(
        rs_profiles(POOL[2:], accountant=ACCOUNTANT)[0].epsilon(1e-5).pld, rel=1e-4
    )


def test_target_input_errors(profiles):
    with pytest.raises(InvalidArgument, match="utilities"):
        choose_pi(profiles, [0.9, 0.8], 3.0, 1e-5, accountant=ACCOUNTANT)
    with pytest.raises(InvalidArgument, match="target_epsilon"):
        choose_pi(profiles, ACC, -1.0, 1e-5, accountant=ACCOUNTANT)
    with pytest.raises(InvalidArgument, match="must be one of") as e:
        choose_pi(profiles, ACC, 3.0, 1e-5, figure="moments", accountant=ACCOUNTANT)
    assert e.value.field == "figure"
    with pytest.raises(InvalidArgument, match=r"No free lunch|no free lunch"):
        choose_lam([*POOL[:2], ApproxDP(1.0, 1e-06, "add-remove")], ACC, 3.0, 1e-5)


@pytest.mark.parametrize("target", [3.0, 5.0, 9.0, 12.0])
def test_scored_subset_is_the_feasible_subset_of_largest_prior_by_brute_force(target):
    """The public subset a utility selection scores: among all subsets whose composition (μ =
    sqrt(Σ μ_i²), closed form) meets the target, the one with the largest total prior (ties: more
    models, then pool order); its ε is that composition's."""
    from peer.dp.accounting.targets import scored_subset

    prior = [3.0, 1.0, 1.0]
    best, best_key = None, None
    for size in range(1, 4):
        for sub in itertools.combinations(range(3), size):
            mu = math.sqrt(sum(OWN_MU[i] ** 2 for i in sub))
            if gdp_epsilon(mu, 1e-5) <= target - 2e-3:  # the PLD figure is pessimistic by ~1e-3
                key = (sum(prior[i] for i in sub), len(sub), tuple(-i for i in sub))
                if best_key is None or key > best_key:
                    best, best_key = sub, key
    got, eps = scored_subset(POOL, prior, target, 1e-5, accountant=ACCOUNTANT)
    assert got == best
    assert eps.pld == pytest.approx(gdp_epsilon(math.sqrt(sum(OWN_MU[i] ** 2 for i in got)), 1e-5), abs=5e-3)
    assert eps.closed_form == pytest.approx(gdp_epsilon(math.sqrt(sum(OWN_MU[i] ** 2 for i in got)), 1e-5))


def test_utility_selections_read_only_the_scored_models():
    from peer.dp.accounting import choose_lam_by_utility, choose_pi_by_utility

    read = []

    def score(i):
        read.append(i)
        return [0.1, 0.9, 0.5][i]

    target = gdp_epsilon(math.sqrt(1.0**2 + 0.5**2), 1e-5) + 0.01  # {1, 2} fit together, model 0 never
    choice = choose_pi_by_utility(POOL, score, target, 1e-5, accountant=ACCOUNTANT)
    assert sorted(read) == [1, 2] and choice.weights == (0.0, 1.0, 0.0)
    assert choice.selection["scored"] == [1, 2] and choice.selection["kind"] == "utility"
    seen = set()

    def lam_score(lam):
        seen.update(int(i) for i in np.flatnonzero(lam))
        return float(lam[2])

    lc = choose_lam_by_utility(POOL, lam_score, target, 1e-5, accountant=ACCOUNTANT, max_points=20)
    assert seen == {1, 2} and lc.weights == pytest.approx((0.0, 0.0, 1.0))
    # charged the composition of {1, 2}, not of λ's support {2}
    assert lc.epsilon.closed_form == pytest.approx(gdp_epsilon(math.sqrt(1.25), 1e-5))
    with pytest.raises(UnreachableTarget):
        choose_pi_by_utility(POOL, score, 0.5, 1e-5, accountant=ACCOUNTANT)
