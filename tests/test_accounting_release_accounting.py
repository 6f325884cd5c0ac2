"""rdp_of_record / pld_of_record for every mechanism kind, each against an independent reference."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event, gaussian_mechanism, pld, rdp

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting import (
    DEFAULT_ORDERS,
    ApproxDP,
    TrainingRecord,
    lc_epsilon,
    lc_surrogate_epsilon,
    model_epsilon,
    pld_of_record,
    rdp_of_record,
    rdp_to_epsilon,
    rs_epsilon,
)
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.profiles import model_rdp
from peer.dp.accounting.release_accounting import dpsgd_record, lc_merge_record, record_epsilon, rs_merge_record

ORDERS = np.array(DEFAULT_ORDERS)
H = 1e-4


def laplace(scale=2.0, sens=1.0):
    return ReleaseRecord(
        mechanism="laplace",
        level="model",
        unit="neuron",
        epsilon=sens / scale,
        delta=0.0,
        sensitivity=sens,
        sensitivity_norm="l1",
        parameters={"scale": scale, "clip": [0.0, 1.0], "shape": [4, 8]},
        randomness="none",
    )


def multibit(eps=1.5):
    return ReleaseRecord(
        mechanism="multibit",
        level="model",
        unit="neuron",
        epsilon=eps,
        delta=0.0,
        sensitivity=2.0,
        sensitivity_norm="range",
        parameters={"bounds": [-1.0, 1.0], "m": 1, "d": 8},
        randomness="none",
    )


def gaussian(noise_std=3.0, sens=1.5):
    return ReleaseRecord(
        mechanism="gaussian",
        level="model",
        unit="neuron",
        epsilon=1.0,
        delta=1e-5,
        sensitivity=sens,
        sensitivity_norm="l2",
        parameters={"noise_std": noise_std, "clip_norm": sens / 2, "calibration": "analytic"},
        randomness="none",
    )


def composite(composition, parts):
    return ReleaseRecord(
        mechanism="composite",
        level="model",
        unit="neuron",
        epsilon=sum(p.epsilon for p in parts) if composition == "sequential" else max(p.epsilon for p in parts),
        delta=0.0,
        sensitivity=None,
        sensitivity_norm="none",
        parameters={"composition": composition},
        components=tuple(parts),
        randomness="none",
    )


def test_laplace_record():
    r = laplace(scale=2.0, sens=1.0)
    acc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    acc.compose(dp_event.LaplaceDpEvent(2.0))
    np.testing.assert_allclose(rdp_of_record(r), acc.rdp, rtol=1e-9)
    # 1-D Laplace shift with ε = Δ/b: δ(ε') = 1 − exp((ε' − ε)/2) for 0 ≤ ε' ≤ ε (exact curve).
    p = pld_of_record(r, H)
    for e in (0.0, 0.2, 0.4):
        exact = 1 - math.exp((e - 0.5) / 2)
        assert exact - 1e-12 <= p.get_delta_for_epsilon(e) <= exact + 1e-3
    assert p.get_epsilon_for_delta(1e-9) == pytest.approx(0.5, abs=1e-3)


def test_multibit_record_is_randomised_response():
    r = multibit(1.5)
    p = pld_of_record(r, H)
    for e in (0.0, 0.5, 1.0):
        assert p.get_delta_for_epsilon(e) == pytest.approx(
            (math.exp(1.5) - math.exp(e)) / (1 + math.exp(1.5)), abs=1e-3
        )
    acc = rdp.RdpAccountant(list(DEFAULT_ORDERS), pld.pld_privacy_accountant.NeighborRel.REPLACE_ONE)
    acc.compose(dp_event.RandomizedResponseDpEvent(2 / (1 + math.exp(1.5)), 2))
    np.testing.assert_allclose(rdp_of_record(r), acc.rdp, rtol=1e-9)
    with pytest.raises(InvalidArgument, match="pure epsilon-DP"):
        rdp_of_record(multibit().with_(delta=1e-6))


def test_gaussian_record():
    r = gaussian(noise_std=3.0, sens=1.5)
    np.testing.assert_allclose(rdp_of_record(r), ORDERS * 0.5**2 / 2, rtol=1e-12)
    assert pld_of_record(r, H).get_epsilon_for_delta(1e-5) == pytest.approx(
        gaussian_mechanism.get_epsilon_gaussian(2.0, 1e-5), rel=1e-5
    )


def test_sequential_composite_matches_dp_accounting():
    parts = [gaussian(3.0, 1.5), laplace(2.0, 1.0), gaussian(4.0, 1.0)]
    r = composite("sequential", parts)
    np.testing.assert_allclose(rdp_of_record(r), sum(rdp_of_record(p) for p in parts), rtol=1e-12)
    acc = pld.PLDAccountant(value_discretization_interval=H)
    acc.compose(dp_event.GaussianDpEvent(2.0))
    acc.compose(dp_event.LaplaceDpEvent(2.0))
    acc.compose(dp_event.GaussianDpEvent(4.0))
    assert pld_of_record(r, H).get_epsilon_for_delta(1e-6) == pytest.approx(acc.get_epsilon(1e-6), rel=1e-4)


def test_parallel_composite_is_the_worst_component():
    parts = [gaussian(3.0, 1.5), gaussian(2.0, 1.5), gaussian(6.0, 1.5)]
    r = composite("parallel", parts)
    np.testing.assert_allclose(rdp_of_record(r), rdp_of_record(parts[1]), rtol=1e-12)
    assert pld_of_record(r, H).get_epsilon_for_delta(1e-5) == pytest.approx(
        pld_of_record(parts[1], H).get_epsilon_for_delta(1e-5), rel=1e-12
    )
    pure = composite("parallel", [laplace(2.0, 1.0), multibit(0.8)])
    assert pld_of_record(pure, H).get_epsilon_for_delta(1e-9) == pytest.approx(0.8, abs=1e-3)
    # Mixed families: the sequential composition dominates every component (sound, conservative).
    mixed = composite("parallel", [gaussian(3.0, 1.5), laplace(2.0, 1.0)])
    eps = pld_of_record(mixed, H).get_epsilon_for_delta(1e-5)
    seq = pld_of_record(composite("sequential", mixed.components), H).get_epsilon_for_delta(1e-5)
    assert eps == pytest.approx(seq) and eps >= max(
        pld_of_record(c, H).get_epsilon_for_delta(1e-5) for c in mixed.components
    )
    np.testing.assert_allclose(
        rdp_of_record(mixed), np.maximum(rdp_of_record(mixed.components[0]), rdp_of_record(mixed.components[1]))
    )


def test_dpsgd_record():
    training = TrainingRecord.constant("add-remove", 500, 0.1, 1.0, 1.0, 0.02)
    accountant = Accountant(value_discretization_interval=1e-3)
    r = dpsgd_record(training, 1e-5, accountant=accountant)
    assert r.unit == "record:add-remove" and r.sensitivity == 1.0
    own = model_epsilon(training, 1e-5, accountant=Accountant(value_discretization_interval=1e-3))
    assert r.epsilon == pytest.approx(own.pld) and r.parameters["epsilon_rdp"] == pytest.approx(own.rdp)
    assert record_epsilon(r, 1e-5, accountant=accountant) == pytest.approx((own.pld, own.rdp))
    # without one, the record states its figure on the default accountant's grid
    assert dpsgd_record(training, 1e-5).epsilon == pytest.approx(model_epsilon(training, 1e-5).pld)
    acc = rdp.RdpAccountant(list(DEFAULT_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.0)), 500)
    np.testing.assert_allclose(rdp_of_record(r), acc.rdp, rtol=1e-9)
    back = ReleaseRecord.from_json(r.canonical_json())
    assert pld_of_record(back, 1e-3).get_epsilon_for_delta(1e-5) == pytest.approx(r.epsilon)
    with pytest.raises(InvalidArgument, match=r"training\.adjacency"):
        rdp_of_record(r.with_(unit="record:replace-one"))


def test_merge_records():
    models = [TrainingRecord.constant("replace-one", 200, 0.1, 1.0, s) for s in (20.0, 40.0)]
    rs = rs_merge_record([*models, ApproxDP(1.0, 1e-07, "replace-one")], [0.3, 0.3, 0.4], 1e-5, names=["a", "b", "c"])
    expected = rs_epsilon([*models, ApproxDP(1.0, 1e-07, "replace-one")], [0.3, 0.3, 0.4], 1e-5)
    assert rs.epsilon == pytest.approx(expected.pld) and rs.parameters["epsilon_rdp"] == "inf"
    assert record_epsilon(ReleaseRecord.from_json(rs.canonical_json()), 1e-5) == pytest.approx((expected.pld, math.inf))
    assert "selected" not in rs.parameters
    lc = lc_merge_record(models, [0.5, 0.5], 1e-5, names=["a", "b"])
    expected = lc_epsilon(models, [0.5, 0.5], 1e-5)
    assert lc.epsilon == pytest.approx(expected.pld) and lc.randomness == "none"
    assert lc.parameters["epsilon_closed_form"] == pytest.approx(expected.closed_form)
    assert rdp_to_epsilon(ORDERS, rdp_of_record(lc), 1e-5) == pytest.approx(expected.rdp)
    assert pld_of_record(lc).get_epsilon_for_delta(1e-5) == pytest.approx(expected.pld)
    # the charge is the composition of both models: the sum of their own RDP curves
    assert lc.parameters["bound"] == "composition" and lc.parameters["surrogate"]["valid"] is False
    np.testing.assert_allclose(
        rdp_of_record(lc), sum(model_rdp(m, accountant=Accountant(ORDERS)) for m in models), rtol=1e-12
    )
    assert lc.parameters["surrogate"]["epsilon_pld"] < lc.epsilon
    # declared state-independent: the surrogate is the charge, and the declaration survives the record's JSON
    declared = [
        TrainingRecord.constant("replace-one", 200, 0.1, 1.0, s, state_independent_gradients=True) for s in (20.0, 40.0)
    ]
    lc = ReleaseRecord.from_json(lc_merge_record(declared, [0.5, 0.5], 1e-5).canonical_json())
    assert lc.parameters["bound"] == "surrogate" and lc.parameters["models"][0]["state_independent_gradients"] is True
    sur = lc_surrogate_epsilon(declared, [0.5, 0.5], 1e-5)
    assert lc.epsilon == pytest.approx(sur.pld) and record_epsilon(lc, 1e-5) == pytest.approx((sur.pld, sur.rdp))
    # the record's "bound" parameter is description only: the interpretation re-derives the bound
    forged = lc.with_(parameters={**dict(lc.parameters), "models": [m.to_dict() for m in models]})
    np.testing.assert_allclose(
        rdp_of_record(forged), sum(model_rdp(m, accountant=Accountant(ORDERS)) for m in models), rtol=1e-12
    )


@pytest.mark.parametrize(
    "record, field",
    [
        (laplace().with_(mechanism="dropout"), "mechanism"),
        (laplace().with_(parameters={"clip": [0, 1]}), "parameters.scale"),
        (laplace().with_(sensitivity_norm="l2"), "sensitivity_norm"),
        (gaussian().with_(parameters={"noise_std": 0.0}), "parameters.noise_std"),
        (
            composite("sequential", [laplace()]).with_(parameters={"composition": "interleaved"}),
            "parameters.composition",
        ),
        (composite("sequential", [laplace()]).with_(components=()), "components"),
    ],
)
def test_uninterpretable_records(record, field):
    for fn in (rdp_of_record, pld_of_record):
        with pytest.raises(InvalidArgument) as e:
            fn(record)
        assert e.value.field == field


def test_bad_merge_records():
    models = [TrainingRecord.constant("replace-one", 20, 0.1, 1.0, 5.0)] * 2
    lc = lc_merge_record(models, [0.5, 0.5], 1e-5)
    bad = lc.with_(parameters={**dict(lc.parameters), "lam": [0.7, 0.7]})
    with pytest.raises(InvalidArgument, match="sum to 1"):
        rdp_of_record(bad)
    bad = lc.with_(parameters={**dict(lc.parameters), "models": [{"epsilon": 1.0, "delta": 1e-6}] * 2})
    with pytest.raises(InvalidArgument, match="free lunch"):
        pld_of_record(bad)
    bad = lc.with_(level="model", unit="neuron")
    with pytest.raises(InvalidArgument, match="data-level"):
        rdp_of_record(bad)
