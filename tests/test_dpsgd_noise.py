"""Noise calibration for planned DP-SGD runs, cross-checked against dp-accounting and the filter."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event, rdp
from dp_accounting.pld import pld_privacy_accountant

from peer.base.errors import InvalidArgument
from peer.budget.dpsgd_noise import FIGURES, noise_multiplier_for, run_epsilon
from peer.budget.filter import FILTER_ORDERS, FilterBudget
from peer.dp.accounting.rdp import rdp_subsampled_gaussian


def test_figures_order_and_meet_target():
    sigmas = {f: noise_multiplier_for(4.0, 1e-5, 40, figure=f) for f in FIGURES}
    assert sigmas["filter"] > sigmas["rdp"] > sigmas["pld"]
    for f, s in sigmas.items():
        assert run_epsilon(s, 40, 1e-5, figure=f) <= 4.0
        assert run_epsilon(s * (1 - 1e-4), 40, 1e-5, figure=f) > 4.0


def test_rdp_figure_is_dp_accountings():
    s = noise_multiplier_for(4.0, 1e-5, 40, figure="rdp")
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(s), 40)
    assert acc.get_epsilon(1e-5) == pytest.approx(4.0, abs=1e-5)


def test_pld_figure_full_batch_is_dp_accountings_pld():
    s = noise_multiplier_for(4.0, 1e-5, 40, figure="pld")
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(s), 40)
    # discretisation is pessimistic: dp-accounting's ε is at or slightly above the exact 4.0
    assert 4.0 - 1e-6 <= acc.get_epsilon(1e-5) <= 4.0 + 40 * 1e-4


def test_filter_figure_is_what_the_filter_admits():
    s = noise_multiplier_for(4.0, 1e-5, 40, figure="filter")
    budget = FilterBudget(4.0, 1e-5, FILTER_ORDERS)
    step = rdp_subsampled_gaussian(s, 1.0, FILTER_ORDERS, "add-remove")
    assert budget.admits(40 * step, math.inf)
    tighter = rdp_subsampled_gaussian(s * (1 - 1e-4), 1.0, FILTER_ORDERS, "add-remove")
    assert not budget.admits(40 * tighter, math.inf)


def test_replace_one_doubles_sensitivity():
    a = noise_multiplier_for(2.0, 1e-5, 10, figure="pld")
    b = noise_multiplier_for(2.0, 1e-5, 10, figure="pld", adjacency="replace-one")
    assert b == pytest.approx(2 * a, rel=1e-9)


def test_poisson_rdp_is_dp_accountings():
    s = noise_multiplier_for(2.0, 1e-5, 200, sample_rate=0.05, figure="rdp", rtol=1e-5)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(s)), 200)
    assert acc.get_epsilon(1e-5) <= 2.0 + 1e-4
    assert np.isfinite(s)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"figure": "moments"}, "figure"),
        ({"steps": 0}, "steps"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = {"noise_multiplier": 1.0, "steps": 5, "delta": 1e-5} | kwargs
    with pytest.raises(InvalidArgument) as e:
        run_epsilon(args.pop("noise_multiplier"), args.pop("steps"), args.pop("delta"), **args)
    assert field in str(e.value)


def test_poisson_pld_is_dp_accountings_pld():
    """Poisson sampling by the PLD figure (it once passed its arguments in the wrong order and
    always refused): the σ it finds gives dp-accounting's PLDAccountant ε at the target, within
    the discretisation's pessimism (both discretise at 1e-4; dp-accounting composes by FFT too)."""
    s = noise_multiplier_for(2.0, 1e-5, 200, sample_rate=0.05, figure="pld")
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(s)), 200)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=2e-3)
    # and PLD asks for less noise than RDP for the same run
    assert s < noise_multiplier_for(2.0, 1e-5, 200, sample_rate=0.05, figure="rdp")
