"""The typed events and the one Accountant: cross-checked against dp-accounting's own events and
accountants where it has one (Gaussian, Laplace, Poisson-sampled Gaussian self-composed,
composition), refusals that name the field, and the dispatch covering every kind."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from dp_accounting import dp_event, pld, rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from ledger_reference import gaussian_record, laplace_record

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.budget.filter import FILTER_ORDERS
from peer.budget.ledger import Ledger, per_neuron_record
from peer.budget.policy import Policy
from peer.dp.accounting import TrainingRecord
from peer.dp.accounting.accountant import _NO_PLD, _PLD, _RDP, Accountant
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.accounting.events import (
    EVENT_CLASSES,
    EVENT_TYPES,
    READERS,
    Composition,
    DistributedSkellamSteps,
    DpSgdTraining,
    GaussianRelease,
    LaplaceRelease,
    MultiBitRelease,
    event_class,
    event_of,
)
from peer.dp.accounting.release_accounting import dpsgd_record, rs_merge_record

ORDERS = np.array(DEFAULT_ORDERS)
DELTA = 1e-5


def dp_rdp(event, orders=ORDERS, relation=NeighboringRelation.ADD_OR_REMOVE_ONE) -> np.ndarray:
    acc = rdp.RdpAccountant(list(orders), relation)
    acc.compose(event)
    return np.asarray(acc._rdp)


def dp_pld_epsilon(event, interval=1e-4, relation=NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    acc = pld.PLDAccountant(relation, value_discretization_interval=interval)
    acc.compose(event)
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("sensitivity,noise_std", [(1.0, 1.0), (2.0, 3.0), (0.5, 4.0)])
def test_gaussian_event_matches_dp_accountings_gaussian_event(sensitivity, noise_std):
    acc = Accountant()
    event = GaussianRelease(sensitivity, noise_std)
    theirs = dp_event.GaussianDpEvent(noise_std / sensitivity)
    np.testing.assert_allclose(acc.rdp(event), dp_rdp(theirs), rtol=1e-12)
    # the same pessimistic discretisation: the figures agree to the interval's order
    assert acc.epsilon(event, DELTA)[0] == pytest.approx(dp_pld_epsilon(theirs), abs=2e-3)


@pytest.mark.parametrize("sensitivity,scale", [(1.0, 1.0), (1.0, 0.5), (3.0, 12.0)])
def test_laplace_event_matches_dp_accountings_laplace_event(sensitivity, scale):
    acc = Accountant()
    event = LaplaceRelease(sensitivity, scale)
    theirs = dp_event.LaplaceDpEvent(scale / sensitivity)
    np.testing.assert_allclose(acc.rdp(event), dp_rdp(theirs), rtol=1e-9)
    assert acc.epsilon(event, DELTA)[0] == pytest.approx(dp_pld_epsilon(theirs), abs=2e-3)


def test_sequential_composition_matches_dp_accountings_composed_event():
    acc = Accountant()
    event = Composition("sequential", (GaussianRelease(1.0, 2.0), LaplaceRelease(1.0, 2.0), GaussianRelease(2.0, 5.0)))
    theirs = dp_event.ComposedDpEvent(
        [dp_event.GaussianDpEvent(2.0), dp_event.LaplaceDpEvent(2.0), dp_event.GaussianDpEvent(2.5)]
    )
    np.testing.assert_allclose(acc.rdp(event), dp_rdp(theirs), rtol=1e-9)
    assert acc.epsilon(event, DELTA)[0] == pytest.approx(dp_pld_epsilon(theirs), abs=5e-3)


def test_poisson_sampled_gaussian_self_composed_matches_dp_accounting():
    """DP-SGD of ``steps`` Poisson-sampled steps (add-remove): dp-accounting's
    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps)."""
    q, sigma, steps = 0.02, 1.1, 60
    training = TrainingRecord.constant("add-remove", steps, 0.1, 1.0, sigma, q)
    event = DpSgdTraining(training, "add-remove")
    theirs = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    acc = Accountant(value_discretization_interval=1e-3)
    np.testing.assert_allclose(acc.rdp(event), dp_rdp(theirs), rtol=1e-6)
    assert acc.epsilon(event, DELTA)[0] == pytest.approx(dp_pld_epsilon(theirs, 1e-3), rel=1e-3)
    # and the record of the same training reads into that event
    assert event_of(dpsgd_record(training, DELTA)) == event


def test_records_read_into_their_events():
    assert event_of(laplace_record(epsilon=0.5, shape=(4, 3))) == LaplaceRelease(3.0, 6.0)
    assert event_of(gaussian_record(noise_std=10.0, sensitivity=2.0)) == GaussianRelease(2.0, 10.0)
    t = TrainingRecord.constant("replace-one", 10, 0.5, 1.0, 6.0)
    rs = event_of(rs_merge_record([t, t], [0.25, 0.75], DELTA, names=["a", "b"]))
    assert rs.pi == (0.25, 0.75) and rs.models == (t, t) and rs.adjacency == "replace-one" and rs.scored is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        rs.pi = (1.0, 0.0)


def _bad(record: ReleaseRecord, **changes) -> ReleaseRecord:
    return ReleaseRecord.from_dict({**record.to_dict(), **changes})


@pytest.mark.parametrize(
    "record,field",
    [
        (_bad(laplace_record(), parameters={"clip": [0, 1], "shape": [4, 3]}), "parameters.scale"),
        (_bad(laplace_record(), parameters={"scale": -1.0}), "parameters.scale"),
        (_bad(laplace_record(), sensitivity_norm="l2"), "sensitivity_norm"),
        (_bad(gaussian_record(), parameters={}), "parameters.noise_std"),
        (_bad(gaussian_record(), mechanism="multibit"), "delta"),
        (_bad(gaussian_record(), mechanism="exponential"), "mechanism"),
        (
            _bad(
                gaussian_record(),
                mechanism="composite",
                parameters={"composition": "interleaved"},
                components=[gaussian_record().to_dict()],
            ),
            "parameters.composition",
        ),
        (_bad(gaussian_record(), mechanism="composite", parameters={"composition": "sequential"}), "components"),
        (_bad(gaussian_record(), mechanism="dpsgd", parameters={}), "unit"),
    ],
)
def test_malformed_records_are_refused_naming_the_field_and_not_supported(record, field):
    with pytest.raises(InvalidArgument) as e:
        event_of(record)
    assert e.value.field == field
    support = Accountant().supports(record)
    assert not support and support.reason.startswith(field + ":")
    with pytest.raises(InvalidArgument):
        Accountant().rdp(record)


def test_supports_says_yes_for_every_kind_and_no_for_what_is_not_an_event():
    t = TrainingRecord.constant("replace-one", 10, 0.5, 1.0, 6.0)
    for record in (laplace_record(), gaussian_record(), dpsgd_record(t, DELTA), rs_merge_record([t], [1.0], DELTA)):
        assert Accountant().supports(record)
    assert Accountant().supports(MultiBitRelease(1.0))
    with pytest.raises(InvalidArgument, match="ReleaseRecord or an event"):
        Accountant().rdp({"mechanism": "laplace"})


def test_every_record_kind_reads_into_an_event_the_accountant_interprets():
    # every kind has an RDP interpreter, and a PLD one or a stated reason why none is offered
    assert set(_RDP) == set(_PLD) | set(_NO_PLD) == set(EVENT_TYPES) and not set(_PLD) & set(_NO_PLD)
    assert set(_NO_PLD) == {DistributedSkellamSteps}
    assert set(READERS) == {
        "laplace",
        "gaussian",
        "multibit",
        "composite",
        "dpsgd",
        "rs-merge",
        "lc-merge",
        "distributed-skellam",
    }
    assert set(EVENT_CLASSES) == set(READERS) and set(EVENT_CLASSES.values()) == set(EVENT_TYPES)


def test_a_records_kind_is_the_class_of_the_event_it_reads_into():
    t = TrainingRecord.constant("replace-one", 10, 0.5, 1.0, 6.0)
    records = (laplace_record(), gaussian_record(), dpsgd_record(t, DELTA), rs_merge_record([t], [1.0], DELTA))
    for record in records:
        assert event_class(record) is type(event_of(record))
    assert event_class(laplace_record().with_(mechanism="smoothing")) is None


def test_per_neuron_restatement_dispatches_on_the_kind_and_refuses_kinds_without_one():
    from peer.base.errors import FailedPrecondition
    from peer.dp.accounting.per_unit import _PER_NEURON

    assert set(_PER_NEURON) == {Composition, LaplaceRelease, GaussianRelease, MultiBitRelease}
    t = TrainingRecord.constant("replace-one", 10, 0.5, 1.0, 6.0)
    per_entry_training = dpsgd_record(t, DELTA).with_(level="model", unit="entry")
    with pytest.raises(FailedPrecondition, match="per-entry 'dpsgd' release has no sound per-neuron conversion"):
        per_neuron_record(per_entry_training)


def test_the_accountant_holds_its_settings_and_the_ledger_its_filters_orders(tmp_path):
    acc = Accountant(orders=[2.0, 8.0], value_discretization_interval=1e-3)
    event = GaussianRelease(1.0, 2.0)
    np.testing.assert_allclose(acc.rdp(event), [2.0 / 8, 8.0 / 8])
    assert acc.with_orders(DEFAULT_ORDERS).value_discretization_interval == 1e-3
    with pytest.raises(InvalidArgument) as e:
        Accountant(orders=[0.5])
    assert e.value.field == "orders"
    policy = Policy.from_mapping(
        {"peers": {"*": {"allow": ["features"]}}, "model": {"total": {"epsilon": 5.0, "delta": 1e-6}}}
    )
    ledger = Ledger(tmp_path / "l.db", policy, accountant=acc)
    assert tuple(ledger.accountant.orders) == tuple(FILTER_ORDERS) == ledger.orders
    assert ledger.accountant.value_discretization_interval == 1e-3
    record = gaussian_record(noise_std=4.0)
    entry = ledger.charge(record, "b")
    np.testing.assert_allclose(entry.rdp, Accountant(FILTER_ORDERS).rdp(per_neuron_record(record)), rtol=1e-12)
    ledger.close()
    with pytest.raises(InvalidArgument) as e:
        Ledger(tmp_path / "l.db", policy, accountant="peer.dp.accounting")
    assert e.value.field == "accountant"
