"""Choosing π / λ for a target: optimality against brute force, saturation, unreachable targets."""

import itertools
import math

import numpy as np
import pytest

from peer.accounting import (ApproxDP, TrainingRecord, UnreachableTarget, choose_lam, choose_pi, lc_epsilon,
                             lc_segments, rs_epsilon, rs_profiles)
from peer.accounting.targets import lc_mu_for_target, rs_most_private_epsilon
from peer.errors import InvalidArgument

INTERVAL = 1e-3
POOL = [TrainingRecord.constant("add-remove", 100, 0.1, 1.0, s) for s in (5.0, 10.0, 20.0)]
ACC = [0.9, 0.8, 0.7]


@pytest.fixture(scope="module")
def profiles():
    return rs_profiles(POOL, value_discretization_interval=INTERVAL)


def simplex_grid(k, m):
    for combo in itertools.combinations_with_replacement(range(k), m):
        yield np.bincount(combo, minlength=k) / m


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target", [2.5, 4.0, 8.0])
def test_choose_pi_is_feasible_optimal_and_saturating(profiles, accountant, target):
    choice = choose_pi(profiles, ACC, target, 1e-5, accountant=accountant, value_discretization_interval=INTERVAL)
    achieved = getattr(choice.epsilon, accountant)
    assert achieved <= target + 1e-9
    assert choice.utility == pytest.approx(np.dot(ACC, choice.weights))
    # No grid point that meets the target does better.
    best_grid = max(np.dot(ACC, pi) for pi in simplex_grid(3, 10)
                    if getattr(rs_epsilon(profiles, pi, 1e-5, value_discretization_interval=INTERVAL), accountant) <= target)
    assert choice.utility >= best_grid - 1e-9
    # The most useful model alone misses the target, so the budget is spent.
    assert choice.saturated and achieved == pytest.approx(target, rel=1e-4)


def test_choose_pi_picks_the_best_model_when_it_is_private_enough(profiles):
    choice = choose_pi(profiles, ACC, 50.0, 1e-5, value_discretization_interval=INTERVAL)
    assert choice.weights == (1.0, 0.0, 0.0) and not choice.saturated


def test_unreachable_rs_target_names_the_most_private_epsilon(profiles):
    with pytest.raises(UnreachableTarget) as e:
        choose_pi(profiles, ACC, 1.0, 1e-5, value_discretization_interval=INTERVAL)
    best = profiles[2].epsilon(1e-5).pld
    assert e.value.most_private_epsilon == pytest.approx(best, rel=1e-5)
    assert "most private reachable is epsilon = " in str(e.value) and e.value.field == "target_epsilon"


def test_mixtures_can_beat_every_single_model():
    # Two (ε, δ)-style profiles private in opposite directions: a 50/50 mixture halves the δ of
    # both directions, so RS reaches an ε no single model reaches; the bisection finds it.
    from peer.accounting import pld as pldm
    from peer.accounting.profiles import PrivacyProfile
    orders = (2.0,)
    a = pldm.non_private_pld(INTERVAL)
    remove_only = pldm.PLD(pldm.directions(a)[0], pldm.directions(pldm.identity_pld(INTERVAL))[0])
    add_only = pldm.PLD(pldm.directions(pldm.identity_pld(INTERVAL))[0], pldm.directions(a)[0])
    profs = [PrivacyProfile("add-remove", orders, np.array([np.inf]), p, INTERVAL) for p in (remove_only, add_only)]
    assert rs_most_private_epsilon(profs, 0.6) == 0.0
    assert all(p.epsilon(0.6).pld == math.inf for p in profs)


def test_choose_pi_with_approx_dp_models():
    models = POOL[:2] + [ApproxDP(1.5, 1e-7, "add-remove")]
    choice = choose_pi(models, ACC, 3.0, 1e-5, value_discretization_interval=INTERVAL)
    assert choice.epsilon.pld <= 3.0 and choice.weights[2] > 0
    with pytest.raises(UnreachableTarget):
        choose_pi(models, ACC, 3.0, 1e-5, accountant="rdp", value_discretization_interval=INTERVAL)


@pytest.mark.parametrize("target", [3.0, 6.0])
def test_choose_lam_linear_proxy(target):
    choice = choose_lam(POOL, ACC, target, 1e-5, value_discretization_interval=INTERVAL)
    assert choice.epsilon.pld <= target and choice.saturated
    assert choice.epsilon.closed_form == pytest.approx(target, rel=1e-3)
    seg = lc_segments(POOL)
    mu_max = lc_mu_for_target(target, 1e-5)
    grid = np.array(list(simplex_grid(3, 40)))
    feasible = grid[seg.mu_many(grid) <= mu_max]
    assert choice.utility >= (feasible @ np.array(ACC)).max() - 1e-9


def test_choose_lam_with_a_callable_utility():
    # A concave utility (best at an interior λ) is evaluated on boundary candidates only.
    peak = np.array([0.2, 0.3, 0.5])

    def utility(lam):
        return -float(np.sum((lam - peak) ** 2))

    loose = choose_lam(POOL, utility, 50.0, 1e-5, value_discretization_interval=INTERVAL)
    assert np.allclose(loose.weights, peak, atol=0.05) and not loose.saturated
    tight = choose_lam(POOL, utility, 3.0, 1e-5, value_discretization_interval=INTERVAL)
    assert tight.epsilon.pld <= 3.0
    assert lc_epsilon(POOL, tight.weights, 1e-5, value_discretization_interval=INTERVAL).pld <= 3.0


def test_choose_lam_rdp_and_unreachable():
    choice = choose_lam(POOL, ACC, 4.0, 1e-5, accountant="rdp", value_discretization_interval=INTERVAL)
    assert choice.epsilon.rdp <= 4.0 + 1e-9 and choice.epsilon.rdp == pytest.approx(4.0, rel=1e-4)
    with pytest.raises(UnreachableTarget) as e:
        choose_lam(POOL, ACC, 1.0, 1e-5, value_discretization_interval=INTERVAL)
    assert e.value.most_private_epsilon == pytest.approx(POOL and rs_profiles(POOL[2:], value_discretization_interval=INTERVAL)[0].epsilon(1e-5).pld, rel=1e-4)


def test_target_input_errors(profiles):
    with pytest.raises(InvalidArgument, match="utilities"):
        choose_pi(profiles, [0.9, 0.8], 3.0, 1e-5, value_discretization_interval=INTERVAL)
    with pytest.raises(InvalidArgument, match="target_epsilon"):
        choose_pi(profiles, ACC, -1.0, 1e-5, value_discretization_interval=INTERVAL)
    with pytest.raises(InvalidArgument, match="accountant"):
        choose_pi(profiles, ACC, 3.0, 1e-5, accountant="moments", value_discretization_interval=INTERVAL)
    with pytest.raises(InvalidArgument, match="No free lunch|no free lunch"):
        choose_lam(POOL[:2] + [ApproxDP(1.0, 1e-6, "add-remove")], ACC, 3.0, 1e-5)
