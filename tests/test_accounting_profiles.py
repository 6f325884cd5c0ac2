"""Per-model profiles against dp-accounting's own accountants on the equivalent DpEvents."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event, pld, rdp
from dp_accounting.privacy_accountant import NeighboringRelation

from peer.base.errors import InvalidArgument
from peer.dp.accounting import (
    DEFAULT_ORDERS,
    ApproxDP,
    GaussianStep,
    TrainingRecord,
    model_delta,
    model_epsilon,
    privacy_profile,
    privacy_profiles,
)
from peer.dp.accounting.accountant import Accountant

ORDERS = np.array(DEFAULT_ORDERS)


def test_references_poisson_figures():
    # dp-accounting 0.6 (PLD at interval 1e-4 and RDP, computed independently): q = 0.01, σ = 1.1, T = 10,000, add/remove, δ = 1e-5: PLD 5.1926, RDP 5.6320.
    eps = model_epsilon(TrainingRecord.constant("add-remove", 10_000, 0.1, 1.0, 1.1, 0.01), 1e-5)
    assert eps.pld == pytest.approx(5.1926, abs=5e-5)
    assert eps.rdp == pytest.approx(5.6320, abs=5e-5)
    assert eps.closed_form is None


@pytest.mark.parametrize(
    "T, pld_ref, rdp_ref",
    [(1, 4.377178, 4.728507), (10, 17.856587, 19.053598), (100, 91.817290, 96.116308), (1000, 633.929851, 654.861260)],
)
def test_references_sigma_one_compositions(T, pld_ref, rdp_ref):
    # A composed Gaussian with large μ spans a wide loss range; the interval is scaled so the PMF
    # stays ~10^5 points (the connect-the-dots error stays far below the 2e-6 asked here).
    interval = 1e-4 if T <= 10 else 1e-3 if T <= 100 else 1e-2
    eps = model_epsilon(
        TrainingRecord.constant("add-remove", T, 0.1, 1.0, 1.0),
        1e-5,
        accountant=Accountant(value_discretization_interval=interval),
    )
    assert eps.pld == pytest.approx(pld_ref, abs=2e-6)
    assert eps.closed_form == pytest.approx(pld_ref, abs=1e-6)
    assert eps.rdp == pytest.approx(rdp_ref, abs=1e-6)


def test_poisson_profile_matches_pld_and_rdp_accountants():
    # Two phases with different (σ, q) and learning rates (which must not matter for one model).
    steps = (GaussianStep(0.1, 1.0, 0.9, 0.05),) * 300 + (GaussianStep(0.05, 2.0, 1.4, 0.02),) * 500
    record = TrainingRecord("add-remove", steps)
    event = dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(0.9)), 300),
            dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.4)), 500),
        ]
    )
    pld_acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    pld_acc.compose(event)
    rdp_acc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    rdp_acc.compose(event)
    eps = model_epsilon(record, 1e-6, accountant=Accountant(value_discretization_interval=1e-3))
    assert eps.pld == pytest.approx(pld_acc.get_epsilon(1e-6), rel=1e-6)
    assert eps.rdp == pytest.approx(rdp_acc.get_epsilon(1e-6), rel=1e-9)
    d = model_delta(record, 2.0, accountant=Accountant(value_discretization_interval=1e-3))
    assert d.pld == pytest.approx(pld_acc.get_delta(2.0), rel=1e-5)
    assert d.rdp == pytest.approx(rdp_acc.get_delta(2.0), rel=1e-9)


def test_replace_one_full_batch_is_add_remove_with_double_sensitivity():
    # Theorem used: replace-one moves the clipped sum by 2C, add-remove by C; the noise is σC.
    steps = (GaussianStep(0.1, 1.0, 2.0),) * 4 + (GaussianStep(0.1, 3.0, 4.0),) * 6
    rep = privacy_profile(
        TrainingRecord("replace-one", steps), accountant=Accountant(value_discretization_interval=1e-3)
    )
    assert rep.mu == pytest.approx(math.sqrt(4 * (2 / 2.0) ** 2 + 6 * (2 / 4.0) ** 2))
    acc = pld.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(2.0), 4))
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(4.0), 6))
    eps = rep.epsilon(1e-5)
    assert eps.pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-5)
    assert eps.closed_form == pytest.approx(eps.pld, rel=1e-5)
    # Same mechanism re-derived under add-remove: μ halves.
    add = privacy_profile(
        TrainingRecord("replace-one", steps), "add-remove", accountant=Accountant(value_discretization_interval=1e-3)
    )
    assert add.mu == pytest.approx(rep.mu / 2)


def test_replace_one_poisson_pld_matches_dp_accounting():
    record = TrainingRecord.constant("replace-one", 200, 0.1, 1.0, 1.0, 0.05)
    acc = pld.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.0)), 200))
    eps = model_epsilon(record, 1e-5, accountant=Accountant(value_discretization_interval=1e-3))
    assert eps.pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    # The numerical replace-one RDP gives a valid but looser bound than the PLD.
    assert eps.rdp >= eps.pld


def test_approx_dp_profile():
    p = privacy_profile(ApproxDP(1.0, 1e-6, "add-remove"))
    assert np.all(np.isinf(p.rdp))
    assert p.epsilon(1e-6).pld == pytest.approx(1.0, abs=1e-3)
    assert p.epsilon(1e-7).pld == math.inf
    pure = privacy_profile(ApproxDP(2.0, 0.0, "replace-one"))
    assert pure.epsilon(1e-9).pld == pytest.approx(2.0, abs=1e-3) and pure.epsilon(1e-9).rdp < math.inf


def test_non_private_model():
    eps = model_epsilon(TrainingRecord.constant("add-remove", 5, 0.1, 1.0, 0.0), 1e-5)
    assert eps.pld == math.inf and eps.rdp == math.inf


def test_mixed_adjacencies_are_refused_or_converted_explicitly():
    a = TrainingRecord.constant("add-remove", 10, 0.1, 1.0, 2.0)
    b = TrainingRecord.constant("replace-one", 10, 0.1, 1.0, 2.0)
    with pytest.raises(InvalidArgument, match="mix adjacencies"):
        privacy_profiles([a, b])
    pa, pb = privacy_profiles([a, b], "replace-one")
    assert pa.mu == pytest.approx(pb.mu)
    with pytest.raises(InvalidArgument) as e:
        privacy_profiles([a, ApproxDP(1.0, 1e-6, "replace-one")], "add-remove")
    assert e.value.field.startswith("models[1]")


def test_profiles_of_a_model_seen_before_are_reused_and_cannot_be_changed():
    from peer.dp.accounting.profiles import _derived_profile

    model = TrainingRecord.constant("add-remove", 200, 0.1, 1.0, 1.1, 0.01)
    first = privacy_profile(model)
    # an equal record (another object) finds the same profile; other settings do not
    assert privacy_profile(TrainingRecord.constant("add-remove", 200, 0.1, 1.0, 1.1, 0.01)) is first
    assert privacy_profile(model, accountant=Accountant(value_discretization_interval=1e-3)) is not first
    assert privacy_profile(model, "replace-one").adjacency == "replace-one"
    with pytest.raises(ValueError):
        first.rdp[0] = 0.0
    # and the kept profile is the one a fresh computation gives
    fresh = _derived_profile.__wrapped__(model, "add-remove", tuple(float(a) for a in DEFAULT_ORDERS), 1e-4)
    assert fresh is not first
    assert first.epsilon(1e-5) == fresh.epsilon(1e-5)


def test_rdp_alone_is_the_profiles_rdp_without_building_a_pld():
    from peer.dp.accounting.profiles import _derived_profile, model_rdp

    orders = [1.5, 2.0, 3.0, 8.0, 32.0]
    for model in (
        TrainingRecord.constant("add-remove", 300, 0.1, 1.0, 1.3, 0.02),
        TrainingRecord.constant("replace-one", 40, 0.1, 1.0, 3.0),
        ApproxDP(1.0, 0.0, "add-remove"),
    ):
        before = _derived_profile.cache_info().currsize
        rdp = model_rdp(model, accountant=Accountant(orders))
        assert _derived_profile.cache_info().currsize == before  # no PLD was built for it
        np.testing.assert_array_equal(rdp, privacy_profile(model, accountant=Accountant(orders)).rdp)
        with pytest.raises(ValueError):
            rdp[0] = 0.0
