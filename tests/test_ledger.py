"""The ledger: filter arithmetic against independent computations, the two budgets, unit
conversion, append-only storage, concurrency (threads and processes), crash safety, policy."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import sqlite3
import threading
import time
import traceback
from queue import Empty

import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ledger_reference import filter_admits, filter_spent, gaussian_rdp, gaussian_record, laplace_rdp, laplace_record

from peer.base.errors import BudgetExhausted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from peer.budget.filter import FILTER_ORDERS, FilterBudget
from peer.budget.ledger import Ledger, per_neuron_record
from peer.budget.policy import Policy, PolicyError


def make_policy(model_total=(4.0, 1e-6), per_cp=None, data=None, **extra) -> Policy:
    d = {"peers": {"*": {"allow": ["features", "weights", "merge", "fuse", "ledger"]}}}
    model = {}
    if model_total:
        model["total"] = {"epsilon": model_total[0], "delta": model_total[1]}
    if per_cp:
        model["per_counterparty"] = {"epsilon": per_cp[0], "delta": per_cp[1]}
    if model:
        d["model"] = model
    if data:
        d["data"] = {"unit": data[0], "epsilon": data[1], "delta": data[2]}
    d.update(extra)
    return Policy.from_mapping(d)


def open_ledger(path, policy, **kw) -> Ledger:
    return Ledger(path, policy, **kw)


# ---- the filter's arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize("epsilon,delta", [(1.0, 1e-5), (8.0, 1e-6), (0.3, 1e-9)])
def test_order_budgets_invert_dp_accountings_conversion(epsilon, delta):
    budget = FilterBudget(epsilon, delta)
    share = delta / len(FILTER_ORDERS)
    for order, b in zip(FILTER_ORDERS, budget.rdp_budget(), strict=True):
        if b > 0:
            assert compute_epsilon([order], [b], share)[0] == pytest.approx(epsilon, rel=1e-12)


def k_admitted_by_hand(orders, rho, epsilon, delta):
    """The number of identical charges the filter admits, recomputed charge by charge."""
    k = 0
    while filter_admits(orders, (k + 1) * rho, math.inf, epsilon, delta):
        k += 1
    return k


def test_gaussian_sequence_is_charged_then_refused_exactly_as_by_hand(tmp_path):
    sigma, eps_g, delta_g = 6.0, 3.0, 1e-6
    ledger = open_ledger(tmp_path / "l.db", make_policy(model_total=(eps_g, delta_g)))
    rho = gaussian_rdp(ledger.orders, 1.0, sigma)
    k = k_admitted_by_hand(ledger.orders, rho, eps_g, delta_g)
    assert 3 <= k <= 60
    for i in range(k):
        entry = ledger.charge(gaussian_record(noise_std=sigma), "b")
        assert entry.entry_id == i + 1
        assert np.allclose(entry.rdp, rho, rtol=1e-12)
        (state,) = ledger.budget_states()
        assert state.spent_epsilon == pytest.approx(
            filter_spent(ledger.orders, (i + 1) * rho, math.inf, delta_g), rel=1e-12
        )
    with pytest.raises(BudgetExhausted, match=r"model/m/total .*limit \(ε=3, δ=1e-06\).*Nothing was released"):
        ledger.charge(gaussian_record(noise_std=sigma), "b")
    assert len(ledger.entries()) == k
    (state,) = ledger.budget_states()
    assert state.count == k and state.spent_epsilon <= eps_g
    # A smaller request still fits if some order has room for it (a filter, not a stop).
    tiny = gaussian_record(noise_std=1e4)
    assert filter_admits(ledger.orders, (k * rho) + gaussian_rdp(ledger.orders, 1, 1e4), math.inf, eps_g, delta_g)
    ledger.charge(tiny, "b")


def test_pure_track_counts_laplace_by_basic_composition(tmp_path):
    # δ_G = 0: only the pure track; 0.3 + 0.3 + 0.3 ≤ 1 < 1.2.
    ledger = open_ledger(tmp_path / "p.db", make_policy(model_total=(1.0, 0.0)))
    for _ in range(3):
        ledger.charge(laplace_record(epsilon=0.3), "b")
    with pytest.raises(BudgetExhausted):
        ledger.charge(laplace_record(epsilon=0.3), "b")
    with pytest.raises(BudgetExhausted, match="δ=0"):
        ledger.charge(gaussian_record(subject="m2", noise_std=100.0), "b")
    (state,) = ledger.budget_states()
    assert state.spent_epsilon == pytest.approx(0.9) and math.isinf(state.spent_order)


def test_pure_track_admits_exactly_the_budget_and_not_1e_9_more(tmp_path):
    # δ_G = 0: only the pure track decides. 0.25 and 0.5 are exact in binary, so the sums are
    # exact: 0.25 + 0.25 + 0.5 = 1.0 is admitted (≤, not <), and 1e-9 over is refused.
    ledger = open_ledger(tmp_path / "edge.db", make_policy(model_total=(1.0, 0.0)))
    ledger.charge(laplace_record(epsilon=0.25), "b")
    ledger.charge(laplace_record(epsilon=0.25), "b")
    over = laplace_record(epsilon=0.5 + 1e-9)
    assert over.epsilon > 0.5
    with pytest.raises(BudgetExhausted):
        ledger.charge(over, "b")
    ledger.charge(laplace_record(epsilon=0.5), "b")
    (state,) = ledger.budget_states()
    assert state.count == 3 and state.spent_epsilon == 1.0 and state.remaining_epsilon == 0.0
    with pytest.raises(BudgetExhausted):
        ledger.charge(laplace_record(epsilon=1e-3), "b")


def test_a_record_claiming_less_pure_epsilon_than_its_rdp_is_refused_and_nothing_written(tmp_path):
    ledger = open_ledger(tmp_path / "liar.db", make_policy(model_total=(4.0, 0.0)))
    honest = laplace_record(epsilon=0.5)  # scale and clip give ε = 0.5
    liar = honest.with_(epsilon=0.1)  # same noise, a smaller claim
    before = ledger.summary(pld=False)
    with pytest.raises(InvalidArgument) as e:
        ledger.charge(liar, "b")
    assert e.value.field == "epsilon" and "pure ε = 0.1" in e.value.rule
    assert ledger.summary(pld=False) == before and ledger.entries() == []
    ledger.charge(honest, "b")  # the same release with its true ε is fine


def test_a_record_naming_another_counterparty_is_refused(tmp_path):
    ledger = open_ledger(tmp_path / "cp.db", make_policy(model_total=(4.0, 1e-6)))
    rec = gaussian_record(noise_std=20.0, counterparty="c")
    with pytest.raises(InvalidArgument) as e:
        ledger.charge(rec, "b")
    assert e.value.field == "counterparty" and "'c'" in e.value.rule and "'b'" in e.value.rule
    assert ledger.entries() == [] and ledger.budget_states() == []
    assert ledger.charge(rec, "c").counterparty == "c"


def test_pure_track_helps_under_an_approximate_budget(tmp_path):
    # ε_G = 4, δ_G = 1e-6, Laplace ε = 0.5: basic composition admits 8, the RDP orders alone 7.
    ledger = open_ledger(tmp_path / "q.db", make_policy(model_total=(4.0, 1e-6)))
    rho = laplace_rdp(ledger.orders, 1.0, 2.0)
    assert k_admitted_by_hand(ledger.orders, rho, 4.0, 1e-6) == 7
    for _ in range(8):
        ledger.charge(laplace_record(epsilon=0.5), "b")
    with pytest.raises(BudgetExhausted):
        ledger.charge(laplace_record(epsilon=0.5), "b")


def test_refusal_writes_nothing_and_names_the_budget(tmp_path):
    ledger = open_ledger(tmp_path / "r.db", make_policy(model_total=(1.0, 1e-6)))
    ledger.charge(gaussian_record(noise_std=20.0), "b")
    before = ledger.summary(pld=False)
    with pytest.raises(BudgetExhausted) as e:
        ledger.charge(gaussian_record(noise_std=0.5), "b")
    assert "model/m/total" in str(e.value) and "alone ε=" in str(e.value)
    assert ledger.summary(pld=False) == before
    # show_remaining defaults to "none": the requester learns the budget and its limits, not
    # what others have spent from it
    assert e.value.reason == "BUDGET_EXHAUSTED" and "spent ε=" not in str(e.value)
    assert e.value.metadata["budget"] == "model/m/total" and e.value.metadata["epsilon_limit"] == "1.0"
    assert "spent_epsilon" not in e.value.metadata and "remaining_epsilon" not in e.value.metadata


@pytest.mark.parametrize("show, cap", [("all", None), ("all", 7.5), ("own", None)])
def test_budget_refusals_say_what_is_spent_and_left_as_the_policy_shows(tmp_path, show, cap):
    extra = {"show_remaining": show, **({"caps": {"weights": cap}} if cap else {})}
    ledger = open_ledger(tmp_path / "s.db", make_policy(model_total=(1.0, 1e-6), per_cp=(1.0, 1e-6), **extra))
    ledger.charge(gaussian_record(noise_std=20.0), "b", kind="weights")
    with pytest.raises(BudgetExhausted) as e:
        ledger.charge(gaussian_record(noise_std=1.0), "b", kind="weights")
    md = e.value.metadata
    assert md.get("request_cap_epsilon") == (None if cap is None else repr(cap))
    (state,) = [s for s in ledger.budget_states() if s.key.name == md["budget"]]
    if show == "own" and md["budget"] == "model/m/total":
        assert "spent_epsilon" not in md  # the shared budget is not the requester's own
        return
    # ε at the budget's δ, the filter's own figures (what `ledger show` prints), not RDP orders
    assert float(md["spent_epsilon"]) == state.spent_epsilon > 0
    assert float(md["remaining_epsilon"]) == state.remaining_epsilon == 1.0 - state.spent_epsilon
    assert float(md["request_epsilon"]) > float(md["remaining_epsilon"]) and "spent ε=" in str(e.value)


# ---- two budgets, per counterparty, units -------------------------------------------------------


def test_model_budgets_per_counterparty_and_in_total(tmp_path):
    policy = make_policy(model_total=(3.0, 0.0), per_cp=(1.0, 0.0))
    ledger = open_ledger(tmp_path / "m.db", policy)
    e = ledger.charge(laplace_record(epsilon=1.0), "a")
    assert e.budgets == ("model/m/total", "model/m/peer/a")
    with pytest.raises(BudgetExhausted, match="model/m/peer/a"):
        ledger.charge(laplace_record(epsilon=0.5), "a")
    ledger.charge(laplace_record(epsilon=1.0), "b")
    ledger.charge(laplace_record(epsilon=1.0), "c")
    with pytest.raises(BudgetExhausted, match="model/m/total"):
        ledger.charge(laplace_record(epsilon=0.5), "d")
    # Another model has budgets of its own: every release about m touched only m's budgets.
    ledger.charge(laplace_record(subject="other", epsilon=1.0), "a")
    names = {s.key.name: s for s in ledger.budget_states()}
    assert names["model/m/total"].spent_epsilon == pytest.approx(3.0)
    assert names["model/other/total"].spent_epsilon == pytest.approx(1.0)
    assert names["model/m/peer/b"].count == 1


def test_data_and_model_levels_are_kept_apart(tmp_path):
    policy = make_policy(model_total=(1.0, 1e-6), data=("record:add-remove", 2.0, 1e-5))
    ledger = open_ledger(tmp_path / "d.db", policy)
    ledger.charge(gaussian_record(subject="pool-1", noise_std=3.0, level="data", unit="record:add-remove"), "b")
    names = {s.key.name: s for s in ledger.budget_states()}
    assert set(names) == {"data/record:add-remove"}
    ledger.charge(gaussian_record(noise_std=30.0), "b")
    names = {s.key.name: s for s in ledger.budget_states()}
    assert names["data/record:add-remove"].count == 1 and names["model/m/total"].count == 1
    with pytest.raises(FailedPrecondition, match="adjacencies"):
        ledger.charge(gaussian_record(subject="p", noise_std=3.0, level="data", unit="record:replace-one"), "b")
    no_data = open_ledger(tmp_path / "e.db", make_policy())
    with pytest.raises(FailedPrecondition, match="no data-level budget"):
        no_data.charge(gaussian_record(subject="p", noise_std=3.0, level="data", unit="record:add-remove"), "b")


def test_per_entry_laplace_is_converted_exactly_to_per_neuron(tmp_path):
    rec = laplace_record(epsilon=0.2, clip=(-1.0, 2.0), shape=(8, 5), unit="entry")
    conv = per_neuron_record(rec)
    assert conv.unit == "neuron" and conv.sensitivity == pytest.approx(15.0)
    assert conv.epsilon == pytest.approx(5 * 0.2)  # P × per-entry ε
    ledger = open_ledger(tmp_path / "n.db", make_policy(model_total=(1.5, 0.0)))
    entry = ledger.charge(rec, "b")
    assert entry.unit == "neuron" and entry.epsilon == pytest.approx(1.0)
    assert np.allclose(entry.rdp, laplace_rdp(ledger.orders, 15.0, rec.parameters["scale"]), rtol=1e-12)
    with pytest.raises(BudgetExhausted):  # 1.0 + 1.0 > 1.5, though 0.2 + 0.2 would fit per entry
        ledger.charge(laplace_record(epsilon=0.2, clip=(-1.0, 2.0), shape=(8, 5), unit="entry"), "b")
    with pytest.raises(FailedPrecondition, match="per-entry 'smoothing'"):
        ledger.charge(gaussian_record(unit="entry").with_(mechanism="smoothing"), "b")
    with pytest.raises(InvalidArgument, match="sensitivity"):
        ledger.charge(rec.with_(sensitivity=1.0, release_id="x" * 32), "b")


def rr_rdp(orders, epsilon):
    """Binary randomised response with ε (the dominating pair of ε-DP): closed-form RDP."""
    o = np.asarray(orders, float)
    p = 1 / (1 + math.exp(-epsilon))
    return np.logaddexp(o * np.log(p) + (1 - o) * np.log1p(-p), o * np.log1p(-p) + (1 - o) * np.log(p)) / (o - 1)


def test_per_entry_releases_of_the_real_mechanisms_are_restated_per_neuron(tmp_path):
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import gaussian_perturbation, gaussian_sensitivity, laplace_activations, multibit

    x = np.random.default_rng(0).normal(size=(6, 7))
    ledger = open_ledger(tmp_path / "mech.db", make_policy(model_total=(1e3, 1e-3)))
    orders = ledger.orders
    # Laplace: the per-entry release at ε and the per-neuron release at 7ε add the same noise.
    _, lap_e = laplace_activations(x, epsilon=0.3, clip=(-1.0, 1.0), unit="entry", randomness=make_randomness(1))
    _, lap_n = laplace_activations(x, epsilon=2.1, clip=(-1.0, 1.0), unit="neuron", randomness=make_randomness(1))
    conv = per_neuron_record(lap_e)
    assert conv.sensitivity == pytest.approx(lap_n.sensitivity) and conv.epsilon == pytest.approx(lap_n.epsilon)
    assert lap_e.parameters["scale"] == pytest.approx(lap_n.parameters["scale"])
    entry = ledger.charge(lap_e.with_(subject="m"), "b")
    assert np.allclose(entry.rdp, laplace_rdp(orders, 14.0, lap_e.parameters["scale"]), rtol=1e-10)
    # Gaussian (PFA unit): the same σ against the neuron's L2 sensitivity from the row clip.
    _, g_e = gaussian_perturbation(
        x, epsilon=1.0, delta=1e-5, clip_norm=2.0, entry_bound=0.5, unit="entry", randomness=make_randomness(2)
    )
    conv = per_neuron_record(g_e)
    delta_n = gaussian_sensitivity("neuron", clip_norm=2.0, entry_bound=0.5, length=7)
    assert conv.sensitivity == pytest.approx(delta_n) and delta_n > g_e.sensitivity
    assert conv.epsilon > g_e.epsilon
    entry = ledger.charge(g_e.with_(subject="m"), "b")
    assert np.allclose(entry.rdp, gaussian_rdp(orders, delta_n, g_e.parameters["noise_std"]), rtol=1e-10)
    # multi-bit: 7 independent ε-DP coordinates per neuron.
    _, mb_e = multibit(x, epsilon=0.4, bounds=(-1.0, 1.0), unit="entry", randomness=make_randomness(3))
    conv = per_neuron_record(mb_e)
    assert conv.mechanism == "composite" and len(conv.components) == 7 and conv.epsilon == pytest.approx(2.8)
    entry = ledger.charge(mb_e.with_(subject="m"), "b")
    assert np.allclose(entry.rdp, 7 * rr_rdp(orders, 0.4), rtol=1e-9)
    assert entry.epsilon == pytest.approx(2.8) and entry.unit == "neuron"


def test_composite_of_per_entry_components_is_converted_componentwise():
    a = laplace_record(epsilon=0.1, shape=(4, 10), unit="entry")
    b = laplace_record(epsilon=0.3, shape=(6, 2), unit="entry")
    from peer.base.records import ReleaseRecord

    comp = ReleaseRecord(
        mechanism="composite",
        level="model",
        unit="entry",
        epsilon=0.4,
        delta=0.0,
        sensitivity=None,
        sensitivity_norm="none",
        parameters={"composition": "parallel", "parallel_over": "neurons"},
        components=(a, b),
        randomness="none",
        subject="m",
    )
    conv = per_neuron_record(comp)
    assert conv.unit == "neuron" and conv.epsilon == pytest.approx(max(1.0, 0.6))
    assert [c.unit for c in conv.components] == ["neuron", "neuron"]


def per_entry_graph(probes=5, epsilon_x=0.5, epsilon_w=0.5):
    """A real per-entry graph release: 4 inputs → 3 hidden ReLU neurons (P probes) → 2 outputs."""
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import perturb_graph
    from peer.nn.architectures import build_model
    from peer.nn.graph import extract_graph

    arch = {"kind": "mlp", "input_dim": 4, "hidden": [3], "output_dim": 2, "activation": "relu"}
    graph = extract_graph(arch, build_model(arch, seed=0), np.random.default_rng(0).random((probes, 4)))
    _, record = perturb_graph(
        graph,
        epsilon_x=epsilon_x,
        epsilon_w=epsilon_w,
        activation_clip=(0.0, 4.0),
        unit="entry",
        randomness=make_randomness(1),
    )
    return record.with_(subject="m")


def test_per_entry_graph_release_composes_one_neurons_parts_sequentially(tmp_path):
    # P = 5 probes, ε_x = ε_w = 0.5: a hidden neuron's activation row alone costs P·ε_x = 2.5 and
    # its weight vector (4 inputs + bias) 5·ε_w = 2.5 on top; an output neuron 4·ε_w = 2.0.
    # Taking the max of the two parts (what the parallel-per-entry record used to become)
    # charged 2.5 and fit a pure per-neuron budget of 3.0.
    record = per_entry_graph()
    assert record.epsilon == 0.5 and record.parameters["parallel_over"] == "neurons"
    layer, _output = record.components
    assert layer.parameters["composition"] == "parallel" and layer.parameters["parallel_over"] == "entries"
    conv = per_neuron_record(record)
    assert conv.parameters["composition"] == "parallel"  # across layers: other neurons
    assert conv.components[0].parameters["composition"] == "sequential"  # one neuron's parts
    assert conv.epsilon == pytest.approx(5 * 0.5 + 5 * 0.5) and conv.components[1].epsilon == pytest.approx(4 * 0.5)
    ledger = open_ledger(tmp_path / "g.db", make_policy(model_total=(3.0, 0.0)))
    it = ledger.interpret(record, "b")
    assert it.pure_epsilon >= 2.5 + 2.5 - 1e-12 and it.pure_epsilon == pytest.approx(5.0)
    # RDP: the hidden neuron's Laplace row (L1 sensitivity 5·4, scale 4/0.5) plus 5 ε_w-DP
    # coordinates, against the output neuron's 4 coordinates: the worse of the two, per order
    hidden = laplace_rdp(ledger.orders, 20.0, 8.0) + 5 * rr_rdp(ledger.orders, 0.5)
    assert np.allclose(it.rdp, np.maximum(hidden, 4 * rr_rdp(ledger.orders, 0.5)), rtol=1e-9)
    assert np.all(it.rdp >= laplace_rdp(ledger.orders, 20.0, 8.0) * (1 - 1e-12))
    with pytest.raises(BudgetExhausted, match="model/m/total"):
        ledger.charge(record, "b")
    assert ledger.entries() == []


def test_a_parallel_composite_must_say_what_it_is_parallel_over():
    from peer.base.records import ReleaseRecord
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import composite_record

    a = laplace_record(epsilon=0.1, shape=(4, 10), unit="entry")
    b = laplace_record(epsilon=0.3, shape=(4, 2), unit="entry")
    rnd = make_randomness(0)
    with pytest.raises(InvalidArgument, match="over"):
        composite_record([a, b], "parallel", randomness=rnd)
    with pytest.raises(InvalidArgument, match="over"):  # same neurons are never parallel per neuron
        composite_record([a.with_(unit="neuron"), b.with_(unit="neuron")], "parallel", randomness=rnd, over="entries")
    same = per_neuron_record(composite_record([a, b], "parallel", randomness=rnd, over="entries"))
    other = per_neuron_record(composite_record([a, b], "parallel", randomness=rnd, over="neurons"))
    assert same.epsilon == pytest.approx(1.0 + 0.6) and same.parameters["composition"] == "sequential"
    assert other.epsilon == pytest.approx(1.0) and other.parameters["composition"] == "parallel"
    # a per-entry parallel composite that does not say is read as the same neurons (never less)
    silent = ReleaseRecord(
        mechanism="composite",
        level="model",
        unit="entry",
        epsilon=0.3,
        delta=0.0,
        sensitivity=None,
        sensitivity_norm="none",
        parameters={"composition": "parallel"},
        components=(a, b),
        randomness="none",
        subject="m",
    )
    assert per_neuron_record(silent).epsilon == pytest.approx(1.6)
    lying = silent.with_(
        unit="neuron",
        components=(a.with_(unit="neuron"), b.with_(unit="neuron")),
        parameters={"composition": "parallel", "parallel_over": "entries"},
    )
    with pytest.raises(InvalidArgument, match="parallel_over"):
        per_neuron_record(lying)


# ---- storage -------------------------------------------------------------------------------------


def test_charges_are_append_only(tmp_path):
    ledger = open_ledger(tmp_path / "a.db", make_policy())
    ledger.charge(gaussian_record(), "b")
    ledger.record_event(ledger.entries()[0].release_id, "sent")
    con = sqlite3.connect(tmp_path / "a.db")
    for sql in (
        "UPDATE charges SET epsilon = 0",
        "DELETE FROM charges",
        "DELETE FROM charge_budgets",
        "UPDATE events SET kind = 'x'",
        "DELETE FROM events",
        "UPDATE meta SET value = '[2.0]'",
    ):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            con.execute(sql)
    con.close()
    ledger.verify()


def test_tampering_is_detected_at_open(tmp_path):
    path = tmp_path / "t.db"
    ledger = open_ledger(path, make_policy())
    for _ in range(3):
        ledger.charge(gaussian_record(noise_std=30.0), "b")
    ledger.close()
    con = sqlite3.connect(path)
    con.execute("DROP TRIGGER charges_no_update")
    con.execute("UPDATE charges SET rdp = '[0]' WHERE seq = 2")
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="hash chain broken at entry 2"):
        open_ledger(path, make_policy())


def test_same_release_is_charged_once(tmp_path):
    ledger = open_ledger(tmp_path / "i.db", make_policy())
    rec = gaussian_record(noise_std=20.0)
    first = ledger.charge(rec, "b")
    again = ledger.charge(rec, "b")
    assert again == first and len(ledger.entries()) == 1
    with pytest.raises(InvalidArgument, match="release_id"):
        ledger.charge(rec.with_(subject="other"), "b")


def test_reopen_read_only_and_orders_are_fixed(tmp_path):
    path = tmp_path / "o.db"
    ledger = open_ledger(path, make_policy(model_total=(2.0, 1e-6)))
    ledger.charge(gaussian_record(noise_std=10.0), "b")
    ledger.close()
    ro = Ledger(path)
    (state,) = ro.budget_states()
    assert state.epsilon_limit == 2.0 and state.count == 1  # limits as recorded with the charge
    with pytest.raises(FailedPrecondition, match="without a policy"):
        ro.charge(gaussian_record(), "b")
    with pytest.raises(FailedPrecondition, match="orders are fixed"):
        open_ledger(path, make_policy(orders=[2.0, 4.0]))
    with pytest.raises(NotFound):
        Ledger(tmp_path / "absent.db")


def test_kind_checks_permission_and_caps(tmp_path):
    policy = Policy.from_mapping(
        {
            "model": {"total": {"epsilon": 10.0, "delta": 0.0}},
            "caps": {"features": 1.0},
            "peers": {"a": {"allow": ["features"]}},
        }
    )
    ledger = open_ledger(tmp_path / "k.db", policy)
    ledger.charge(laplace_record(epsilon=1.0), "a", kind="features")
    with pytest.raises(InvalidArgument, match="cap 1 for features"):
        ledger.charge(laplace_record(epsilon=1.5), "a", kind="features")
    with pytest.raises(PermissionDenied):
        ledger.charge(laplace_record(epsilon=0.5), "a", kind="weights")
    with pytest.raises(PermissionDenied):
        ledger.charge(laplace_record(epsilon=0.5), "stranger", kind="features")
    assert len(ledger.entries()) == 1


def test_remaining_is_shown_only_as_the_policy_allows(tmp_path):
    policy = Policy.from_mapping(
        {
            "model": {"total": {"epsilon": 10.0, "delta": 0.0}, "per_counterparty": {"epsilon": 3.0, "delta": 0.0}},
            "peers": {
                "a": {"allow": ["features"], "show_remaining": "own"},
                "b": {"allow": ["features"]},
                "c": {"allow": ["features"], "show_remaining": "all"},
            },
        }
    )
    ledger = open_ledger(tmp_path / "s.db", policy)
    for peer in "abc":
        ledger.charge(laplace_record(epsilon=1.0), peer)
    assert [s.key.name for s in ledger.remaining_for("a")] == ["model/m/peer/a"]
    assert ledger.remaining_for("b") == []
    assert {s.key.name for s in ledger.remaining_for("c")} == {"model/m/peer/c", "model/m/total"}
    assert ledger.remaining_for("a")[0].remaining_epsilon == pytest.approx(2.0)


def test_pld_is_reported_beside_the_filter(tmp_path):
    ledger = open_ledger(tmp_path / "pld.db", make_policy(model_total=(4.0, 1e-5)))
    for _ in range(5):
        ledger.charge(gaussian_record(noise_std=5.0), "b")
    (state,) = ledger.budget_states(pld=True)
    # Five Gaussians with σ = 5 compose to one with σ = 5/√5: the exact (analytic) ε.
    from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

    exact = get_epsilon_gaussian(5.0 / math.sqrt(5), 1e-5)
    assert state.pld_epsilon == pytest.approx(exact, abs=5 * 1e-4 + 1e-3)
    assert state.pld_epsilon < state.spent_epsilon  # the filter's figure is the looser one
    assert "not the adaptive guarantee" in state.pld_note


# ---- concurrency ---------------------------------------------------------------------------------


def test_threads_charging_at_once_never_overspend(tmp_path):
    sigma, eps_g, delta_g = 4.0, 2.0, 1e-6
    path = tmp_path / "c.db"
    ledger = open_ledger(path, make_policy(model_total=(eps_g, delta_g)))
    rho = gaussian_rdp(ledger.orders, 1.0, sigma)
    k = k_admitted_by_hand(ledger.orders, rho, eps_g, delta_g)
    n = 24
    assert 2 <= k < n
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def worker(i):
        rec = gaussian_record(noise_std=sigma)
        barrier.wait()
        try:
            results[i] = ledger.charge(rec, f"peer-{i}")
        except BudgetExhausted as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted = [r for r in results if not isinstance(r, Exception)]
    assert len(accepted) == k and sum(isinstance(r, BudgetExhausted) for r in results) == n - k
    ledger.verify()
    (state,) = ledger.budget_states()
    total = np.zeros(len(ledger.orders))
    for e in sorted(accepted, key=lambda e: e.entry_id):
        total = total + np.asarray(e.rdp)
    assert np.array_equal(total, k * rho) or np.allclose(total, k * rho, rtol=1e-15)
    con = sqlite3.connect(path)
    cached = json.loads(con.execute("SELECT rdp FROM totals").fetchone()[0])
    con.close()
    assert cached == total.tolist()  # exactly the sum of accepted records, in charge order
    assert state.count == k


def _process_worker(path, n_charges, sigma, eps_g, delta_g, queue):
    try:
        ledger = open_ledger(path, make_policy(model_total=(eps_g, delta_g)))
        ok = refused = 0
        for _ in range(n_charges):
            try:
                ledger.charge(gaussian_record(noise_std=sigma), f"pid-{os.getpid()}")
                ok += 1
            except BudgetExhausted:
                refused += 1
        ledger.close()
        queue.put(("ok", (ok, refused)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def collect(queue, procs, timeout=120.0):
    """One result per child process; a child's exception fails the test at once with its
    traceback, and so does a child that died without reporting."""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            kind, value = queue.get(timeout=0.5)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                pytest.fail(f"a child process died without reporting (exit codes {dead})")
            if time.monotonic() > deadline:
                pytest.fail(f"{len(procs) - len(out)} child processes did not report within {timeout:g} s")
            continue
        if kind == "error":
            pytest.fail(f"a child process raised:\n{value}")
        out.append(value)
    return out


def test_processes_charging_at_once_never_overspend(tmp_path):
    sigma, eps_g, delta_g = 4.0, 3.0, 1e-6
    path = tmp_path / "p.db"
    open_ledger(path, make_policy(model_total=(eps_g, delta_g))).close()
    from peer.budget.filter import FILTER_ORDERS as orders

    k = k_admitted_by_hand(orders, gaussian_rdp(orders, 1.0, sigma), eps_g, delta_g)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(path, 6, sigma, eps_g, delta_g, queue)) for _ in range(5)]
    assert k < 5 * 6
    for p in procs:
        p.start()
    outcomes = collect(queue, procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(o for o, _ in outcomes) == k and sum(r for _, r in outcomes) == 30 - k
    ledger = open_ledger(path, make_policy(model_total=(eps_g, delta_g)))
    assert len(ledger.entries()) == k
    (state,) = ledger.budget_states()
    assert state.count == k and state.spent_epsilon <= eps_g


# ---- crash safety --------------------------------------------------------------------------------


def _crash_child(path, start, write_fd):
    """Charge releases with ids crash-<i> from ``start`` on; after each commit, report the id as
    'sent' on the pipe (the stand-in for bytes reaching the client)."""
    ledger = open_ledger(path, make_policy(model_total=(1e6, 1e-6)))
    i = start
    while True:
        # The same release rebuilt byte for byte (a retry resends the stored record).
        rec = gaussian_record(noise_std=50.0, subject=f"m{i % 3}").with_(
            release_id=f"crash-{i:06d}", created_at="2026-01-01T00:00:00.000000Z"
        )
        ledger.charge(rec, "b")
        os.write(write_fd, f"{i}\n".encode())
        i += 1


def _run_crash_rounds(tmp_path, rounds, seed):
    path = tmp_path / "crash.db"
    open_ledger(path, make_policy(model_total=(1e6, 1e-6))).close()
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("fork")
    sent: list[int] = []
    next_start = 0
    for _ in range(rounds):
        r, w = os.pipe()
        child = ctx.Process(target=_crash_child, args=(path, next_start, w))
        child.start()
        os.close(w)
        reader = os.fdopen(r)
        # Kill only after the child has reported a random number (1-4) of sent releases — progress
        # is waited for, not assumed from a sleep — then at a random moment within the next
        # charges, so kills land before, inside and after commits.
        got = []
        for _ in range(rng.randint(1, 4)):
            line = reader.readline()  # blocks until the child sends, or EOF if it died
            assert line, f"the crash child died on its own (exit code {child.exitcode})"
            got.append(int(line))
        time.sleep(rng.uniform(0.0, 0.02))  # a random phase, not a wait for progress
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL  # killed, not dead of an error of its own
        with reader:
            got += [int(x) for x in reader.read().split("\n") if x.strip()]
        sent += got
        # Restart from the release after the last one sent: the one that may have been charged
        # but not sent is retried with the same release id, and must not be charged twice.
        next_start = (sent[-1] + 1) if sent else 0
        ledger = open_ledger(path, make_policy(model_total=(1e6, 1e-6)))  # verify(): integrity, chain, totals
        charged = [e.release_id for e in ledger.entries()]
        assert len(charged) == len(set(charged))
        assert set(f"crash-{i:06d}" for i in sent) <= set(charged)
        assert len(charged) <= len(sent) + 1
        ledger.close()
    return sent


def test_crash_between_charge_and_send_keeps_every_sent_charge(tmp_path):
    sent = _run_crash_rounds(tmp_path, rounds=10, seed=7)
    assert len(sent) >= 10  # each round waits for at least one sent release before its kill


@pytest.mark.slow
def test_crash_fifty_times(tmp_path):
    _run_crash_rounds(tmp_path, rounds=50, seed=11)


# ---- property: random sequences ------------------------------------------------------------------


charges = st.lists(
    st.one_of(
        st.tuples(st.just("gaussian"), st.floats(0.5, 40.0)),
        st.tuples(st.just("laplace"), st.floats(0.01, 3.0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=charges, eps_g=st.floats(0.2, 10.0), delta_g=st.sampled_from([0.0, 1e-9, 1e-6, 1e-4]))
def test_random_sequences_never_exceed_the_filter(tmp_path_factory, seq, eps_g, delta_g):
    path = tmp_path_factory.mktemp("h") / "h.db"
    ledger = open_ledger(path, make_policy(model_total=(eps_g, delta_g)), verify=False)
    orders = ledger.orders
    rdp, pure, last_spent = np.zeros(len(orders)), 0.0, 0.0
    for kind, x in seq:
        rec = gaussian_record(noise_std=x) if kind == "gaussian" else laplace_record(epsilon=x)
        r = gaussian_rdp(orders, 1.0, x) if kind == "gaussian" else laplace_rdp(orders, 3.0, 3.0 / x)
        p = rec.epsilon if rec.delta == 0 else math.inf
        try:
            ledger.charge(rec, "b")
            accepted = True
        except BudgetExhausted:
            accepted = False
        # Far from the boundary the ledger and the recomputation agree; at it, only the
        # ledger's own (stricter or equal) arithmetic decides, and it must never overspend.
        if accepted:
            rdp, pure = rdp + r, pure + p
            assert filter_admits(orders, rdp, pure, eps_g, delta_g * (1 + 1e-9))
        else:
            assert not filter_admits(orders, rdp + r, pure + p, eps_g * (1 - 1e-9), delta_g)
        states = ledger.budget_states()
        spent = states[0].spent_epsilon if states else 0.0
        assert last_spent <= spent <= eps_g * (1 + 1e-12)
        last_spent = spent
    ledger.verify()
    ledger.close()


# ---- policy --------------------------------------------------------------------------------------

EXAMPLE = """\
[site]
name = "hospital-a"

[policy]
show_remaining = "own"

[policy.data]
unit = "record:add-remove"
epsilon = 8.0
delta = 1e-5

[policy.model]
total = { epsilon = 16.0, delta = 1e-6 }
per_counterparty = { epsilon = 4.0, delta = 1e-6 }

[policy.model.overrides."mlp-a"]
total = { epsilon = 8.0, delta = 0.0 }

[policy.caps]
features = 2.0
merge = 8.0

[policy.peers."hospital-b"]
allow = ["features", "weights", "merge", "fuse", "ledger"]
show_remaining = "all"

[policy.peers."*"]
allow = ["features"]
"""


def test_policy_example_parses(tmp_path):
    (tmp_path / "site.toml").write_text(EXAMPLE)
    p = Policy.from_toml(tmp_path / "site.toml")
    assert p.data.unit == "record:add-remove" and p.data.epsilon == 8.0 and p.data.delta == 1e-5
    assert p.model.total == FilterBudget(16.0, 1e-6) and p.model.per_counterparty == FilterBudget(4.0, 1e-6)
    over = p.model_budgets("mlp-a")
    assert over.total == FilterBudget(8.0, 0.0) and over.per_counterparty == FilterBudget(4.0, 1e-6)
    assert p.caps == {"features": 2.0, "merge": 8.0}
    assert p.allows("hospital-b", "ledger") and p.allows("anyone", "features") and not p.allows("anyone", "merge")
    assert p.shows_remaining("hospital-b") == "all" and p.shows_remaining("x") == "own"
    assert p.orders == FILTER_ORDERS


def test_policy_defaults_are_closed():
    p = Policy.from_mapping({})
    assert p.data is None and p.model.total is None and p.model.per_counterparty is None
    assert not p.allows("x", "features") and p.shows_remaining("x") == "none" and dict(p.caps) == {}


@pytest.mark.parametrize(
    "change,key,line",
    [
        (("epsilon = 8.0", "epsilon = -1"), "policy.data.epsilon", 9),
        (("epsilon = 8.0", 'epsilon = "8"'), "policy.data.epsilon", 9),
        (("delta = 1e-5", "delta = 1.5"), "policy.data.delta", 10),
        (('unit = "record:add-remove"', 'unit = "record"'), "policy.data.unit", 8),
        (("features = 2.0", "featrues = 2.0"), "policy.caps.featrues", 20),
        (('show_remaining = "own"', 'show_remaining = "some"'), "policy.show_remaining", 5),
        (('allow = ["features"]\n', 'allow = ["feature"]\n'), 'policy.peers."*".allow', 28),
        (("total = { epsilon = 16.0, delta = 1e-6 }", "total = { epsilon = 16.0 }"), "policy.model.total.delta", 13),
        (
            (
                "per_counterparty = { epsilon = 4.0, delta = 1e-6 }",
                "per_counterparty = { epsilon = 4.0, delta = 1e-6, x = 1 }",
            ),
            "policy.model.per_counterparty.x",
            14,
        ),
    ],
)
def test_policy_errors_name_the_key_and_line(change, key, line):
    text = EXAMPLE.replace(*change)
    assert text != EXAMPLE
    with pytest.raises(PolicyError) as e:
        Policy.from_toml_text(text)
    assert e.value.key == key and e.value.line == line, str(e.value)
    assert f"(line {line})" in str(e.value)


def test_policy_syntax_error_carries_tomllibs_line():
    with pytest.raises(PolicyError, match=r"line 9") as e:
        Policy.from_toml_text(EXAMPLE.replace("epsilon = 8.0", "epsilon = = 8"))
    assert e.value.line == 9


def test_policy_other_errors():
    with pytest.raises(PolicyError, match="no \\[policy\\] table"):
        Policy.from_toml_text("[site]\nname = 'x'\n")
    with pytest.raises(PolicyError, match="orders"):
        Policy.from_mapping({"orders": [1.0, 2.0]})
    with pytest.raises(PolicyError, match="strictly increasing"):
        Policy.from_mapping({"orders": [4.0, 2.0]})
    with pytest.raises(PolicyError, match=r"policy\.unknown"):
        Policy.from_mapping({"unknown": 1})
    p = Policy.from_mapping({"caps": {"fuse": 1.0}, "peers": {"a": {"allow": ["fuse"]}}})
    with pytest.raises(InvalidArgument, match="cap"):
        p.check_request("a", "fuse", 2.0)
    with pytest.raises(InvalidArgument, match="kind"):
        p.check_request("a", "nonsense", 0.1)


# ---- command line --------------------------------------------------------------------------------


def test_ledger_show_prints_entries_and_budgets(tmp_path, capsys):
    from peer.cli import main

    path = tmp_path / "show.db"
    policy_text = EXAMPLE.replace('[policy.model.overrides."mlp-a"]\ntotal = { epsilon = 8.0, delta = 0.0 }\n', "")
    (tmp_path / "site.toml").write_text(policy_text)
    ledger = open_ledger(path, Policy.from_toml(tmp_path / "site.toml"))
    ledger.charge(gaussian_record(subject="mlp-a", noise_std=8.0), "hospital-b")
    ledger.charge(laplace_record(subject="mlp-a", epsilon=0.5), "hospital-c")
    ledger.record_event(ledger.entries()[0].release_id, "sent")
    ledger.close()
    assert main(["ledger", "show", "--db", str(path), "--json", "--no-pld"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["counterparty"] for e in out["entries"]] == ["hospital-b", "hospital-c"]
    budgets = {b["budget"]: b for b in out["budgets"]}
    assert set(budgets) == {"model/mlp-a/total", "model/mlp-a/peer/hospital-b", "model/mlp-a/peer/hospital-c"}
    assert budgets["model/mlp-a/peer/hospital-c"]["spent_epsilon_filter"] == pytest.approx(0.5)
    assert budgets["model/mlp-a/total"]["epsilon_limit"] == 16.0
    assert (
        main(
            [
                "ledger",
                "show",
                "--db",
                str(path),
                "--counterparty",
                "hospital-c",
                "--json",
                "--no-pld",
                "--policy",
                str(tmp_path / "site.toml"),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [e["counterparty"] for e in out["entries"]] == ["hospital-c"]
    assert {b["budget"] for b in out["budgets"]} == {
        "data/record:add-remove",
        "model/mlp-a/total",
        "model/mlp-a/peer/hospital-c",
    }
    assert main(["ledger", "show", "--db", str(path), "--no-pld"]) == 0
    text = capsys.readouterr().out
    assert "model/mlp-a/peer/hospital-b" in text and "2 entries" in text
    # every ε printed says its accountant and scope (issue 20, item 8)
    for words in (
        "spent ε filter: the budget's total — every charge made to it",
        "by the RDP filter at the budget's δ",
        "spent ε PLD: the same charges, by PLD composition",
        "remaining ε: limit − spent_epsilon_filter: a guide, not a price",
        "(ε of an entry: that release alone",
        "(verified: the ledger reaches it; charges anchored up to entry 2)",
    ):
        assert words in text, words
    assert set(out["figures"]) == {
        "entries.epsilon",
        "budgets.spent_epsilon_filter",
        "budgets.spent_epsilon_pld",
        "budgets.remaining_epsilon_filter",
    }
    assert main(["ledger", "show", "--db", str(tmp_path / "none.db")]) == 2
    assert "no ledger" in capsys.readouterr().err


def test_logs_carry_ids_and_public_epsilon_only(tmp_path, caplog):
    ledger = open_ledger(tmp_path / "log.db", make_policy(model_total=(1.0, 1e-6)))
    rec = gaussian_record(noise_std=12.3456789)
    with caplog.at_level("INFO", logger="peer.budget.ledger"):
        ledger.charge(rec, "b")
        with pytest.raises(BudgetExhausted):
            ledger.charge(gaussian_record(noise_std=0.123456789), "b")
    text = caplog.text
    assert rec.release_id in text and "mechanism=gaussian" in text and "refused" in text
    assert "12.345" not in text and "0.12345" not in text and "noise_std" not in text


def test_a_totals_cache_that_disagrees_with_the_rows_is_detected(tmp_path):
    path = tmp_path / "cache.db"
    ledger = open_ledger(path, make_policy())
    ledger.charge(gaussian_record(noise_std=30.0), "b")
    ledger.close()
    con = sqlite3.connect(path)
    con.execute("UPDATE totals SET pure_epsilon = 0.5")  # the cache is the one mutable table
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="totals cache for model/m/total differs"):
        open_ledger(path, make_policy())


# ---- with the project's accountant (peer.dp.accounting) --------------------------------------------


def test_the_accountant_agrees_with_the_closed_forms():
    from peer.dp.accounting import rdp_of_record

    orders = FILTER_ORDERS
    g = gaussian_record(noise_std=7.0, sensitivity=2.0)
    assert np.allclose(rdp_of_record(g, orders), gaussian_rdp(orders, 2.0, 7.0), rtol=1e-12)
    lap = laplace_record(epsilon=0.7)
    assert np.allclose(rdp_of_record(lap, orders), laplace_rdp(orders, 3.0, 3.0 / 0.7), rtol=1e-10)


def full_batch(noise_multiplier, steps=20):
    from peer.dp.accounting import TrainingRecord

    return TrainingRecord.constant(
        "add-remove", steps, learning_rate=0.1, clip_norm=1.0, noise_multiplier=noise_multiplier
    )


def test_dpsgd_charge_matches_the_full_batch_closed_form(tmp_path):
    from peer.dp.accounting.release_accounting import dpsgd_record

    ledger = open_ledger(tmp_path / "sgd.db", make_policy(data=("record:add-remove", 8.0, 1e-5)))
    entry = ledger.charge(dpsgd_record(full_batch(6.0, steps=20), 1e-5, subject="pool/m0"), "b")
    # Full batch, add/remove: each step is a Gaussian with noise multiplier σ: T·α/(2σ²).
    assert np.allclose(entry.rdp, 20 * gaussian_rdp(ledger.orders, 1.0, 6.0), rtol=1e-9)
    assert entry.budgets == ("data/record:add-remove",)


def test_merges_from_one_pool_compose_only_when_sound(tmp_path):
    from peer.dp.accounting.release_accounting import dpsgd_record, lc_merge_record, rs_merge_record

    ledger = open_ledger(tmp_path / "pool.db", make_policy(data=("record:add-remove", 50.0, 1e-5)))
    pool1 = {f"pool1/m{i}": full_batch(s, steps=2) for i, s in enumerate([3.0, 6.0, 12.0])}
    pool2 = {f"pool2/m{i}": full_batch(s, steps=2) for i, s in enumerate([4.0, 8.0])}

    def rs(pool, pi):
        return rs_merge_record(list(pool.values()), pi, 1e-5, names=list(pool), subject="pool")

    def lc(pool, lam):
        return lc_merge_record(list(pool.values()), lam, 1e-5, names=list(pool), subject="pool")

    # RS releases (and a single model, RS with one model) sum soundly even on shared models.
    ledger.charge(rs(pool1, [0.2, 0.3, 0.5]), "a")
    ledger.charge(rs(pool1, [0.5, 0.5, 0.0]), "b")
    ledger.charge(dpsgd_record(pool1["pool1/m2"], 1e-5, subject="pool1/m2"), "c")
    # An LC merge sharing a model with an earlier release does not.
    with pytest.raises(FailedPrecondition, match=r"LC merge cannot share models.*pool1/m0"):
        ledger.charge(lc(pool1, [0.5, 0.25, 0.25]), "a")
    ledger.charge(lc(pool2, [0.5, 0.5]), "a")  # disjoint models: independent, fine
    with pytest.raises(FailedPrecondition, match="earlier LC merge"):
        ledger.charge(rs(pool2, [1.0, 0.0]), "b")
    assert [e.mechanism for e in ledger.entries()] == ["rs-merge", "rs-merge", "dpsgd", "lc-merge"]
    with pytest.raises(InvalidArgument, match="subject"):
        ledger.charge(dpsgd_record(full_batch(5.0, steps=2), 1e-5), "c")


def test_ledger_show_reports_pld_beside_the_filter(tmp_path, capsys):
    from peer.cli import main

    path = tmp_path / "pld-show.db"
    ledger = open_ledger(path, make_policy(model_total=(6.0, 1e-5)))
    for _ in range(4):
        ledger.charge(gaussian_record(noise_std=4.0), "b")
    ledger.charge(laplace_record(epsilon=0.3, unit="entry"), "c")
    ledger.close()
    assert main(["ledger", "show", "--db", str(path), "--json"]) == 0
    (budget,) = json.loads(capsys.readouterr().out)["budgets"]
    assert budget["count"] == 5
    assert 0 < budget["spent_epsilon_pld"] < budget["spent_epsilon_filter"] <= 6.0


def test_a_release_at_a_tiny_epsilon_is_charged_not_refused_as_malformed(tmp_path):
    """The Laplace RDP closed form rounds to about -7e-17 at ε = 1e-9; a Rényi divergence is never
    negative, so rounding is charged as 0 rather than refusing the record as malformed. Anything
    really negative is still refused."""
    from peer.dp.accounting import rdp_of_record

    record = laplace_record(epsilon=1e-9, counterparty="a")
    assert np.min(rdp_of_record(record, FILTER_ORDERS)) > -1e-12  # only rounding below zero, if any
    with open_ledger(tmp_path / "l.sqlite", make_policy()) as ledger:
        entry = ledger.charge(record, "a")
        assert entry.epsilon == pytest.approx(1e-9)
        ledger.verify()


def per_neuron_graph(epsilon_x=1.0, epsilon_w=1.0, seed=1):
    """A real per-neuron features release: 4 inputs → 3 → 3 hidden ReLU neurons → 2 outputs."""
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import perturb_graph
    from peer.nn.architectures import build_model
    from peer.nn.graph import extract_graph

    arch = {"kind": "mlp", "input_dim": 4, "hidden": [3, 3], "output_dim": 2, "activation": "relu"}
    graph = extract_graph(arch, build_model(arch, seed=0), np.random.default_rng(0).random((5, 4)))
    _, record = perturb_graph(
        graph, epsilon_x=epsilon_x, epsilon_w=epsilon_w, activation_clip=(0.0, 4.0), randomness=make_randomness(seed)
    )
    return record.with_(subject="m")


def test_the_pld_of_parallel_features_releases_is_the_dominant_layers_not_their_sum(tmp_path):
    """Issue 20, item 8 (i): a model-level PLD figure above the filter's for the same releases.
    A features release is parallel over neurons: per hidden layer (Laplace ε_x then multibit
    ε_w, sequential per neuron), and the output layer's multibit ε_w. Its components are
    composites, which the PLD did not order, so it fell back to composing every layer
    sequentially — three layers' worth per release, above the filter (which takes the maximum
    over components, exactly). Now the layer that dominates the others mechanism by mechanism
    gives the PLD: per release Laplace(ε_x) ⊗ randomised response(ε_w), checked against
    dp-accounting built by hand, and never above the filter's figure."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from peer.dp.accounting import pld as pldm
    from peer.dp.accounting import pld_fallbacks, pld_of_record

    releases = 4
    ledger = open_ledger(tmp_path / "f.db", make_policy(model_total=(100.0, 1e-5)))
    records = [per_neuron_graph(seed=s) for s in range(releases)]
    for r in records:
        ledger.charge(r, "b")
    [state] = ledger.budget_states(pld=True)
    assert state.spent_epsilon == pytest.approx(releases * 2.0) and math.isinf(state.spent_order)  # pure track
    one = pld_lib.from_laplace_mechanism(1.0, 1.0, value_discretization_interval=1e-4).compose(
        pld_lib.from_privacy_parameters(pld_lib.common.DifferentialPrivacyParameters(1.0, 0.0), 1e-4)
    )
    reference = one.self_compose(releases).get_epsilon_for_delta(1e-5)
    assert state.pld_epsilon == pytest.approx(reference, abs=releases * 2e-3)
    assert state.pld_epsilon <= state.spent_epsilon
    assert all(pld_fallbacks(r) == 0 for r in records) and "sequential composition of the parts" not in state.pld_note
    # what the figure was before: every component composed, above the filter's 8.0
    before = pldm.compose_plds([pld_of_record(c) for r in records for c in r.components], 1e-4)
    assert before.get_epsilon_for_delta(1e-5) > state.spent_epsilon + 4


def test_a_parallel_release_with_no_dominant_part_keeps_the_conservative_pld_and_says_so(tmp_path):
    """Parts that are not ordered (a Gaussian part against a Laplace one) keep the sequential
    composition as their PLD (sound, conservative); ``ledger show``'s note says why it can
    exceed the filter's figure."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import pld_fallbacks
    from peer.ldp.mechanisms import composite_record

    record = composite_record(
        [gaussian_record(noise_std=2.0), laplace_record(epsilon=1.0)],
        "parallel",
        randomness=make_randomness(0),
        over="neurons",
    ).with_(subject="m")
    assert pld_fallbacks(record) == 1
    ledger = open_ledger(tmp_path / "n.db", make_policy(model_total=(100.0, 1e-5)))
    ledger.charge(record, "b")
    [state] = ledger.budget_states(pld=True)
    assert "1 parallel release part(s) have no part that dominates" in state.pld_note


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    st.lists(
        st.lists(st.sampled_from([("laplace", 0.5), ("laplace", 1.0), ("pure", 0.5), ("pure", 1.0), ("gauss", 4.0)]))
        .filter(bool)
        .map(tuple),
        min_size=2,
        max_size=3,
    )
)
def test_a_parallel_composites_pld_dominates_every_part(parts):
    """Whatever PLD a parallel composite gets (a dominant part's, or the conservative
    composition of all), its δ(ε) is at least every part's own, on a grid of ε: the dominance
    rule never picks a part that some other part exceeds. Parts are sequential composites of
    Laplace (ε), multibit (pure ε) and Gaussian (noise std, sensitivity 1) releases."""
    from peer.base.records import ReleaseRecord
    from peer.base.rng import make_randomness
    from peer.dp.accounting import pld_of_record
    from peer.ldp.mechanisms import composite_record

    rnd = make_randomness(0)

    def leaf(kind, value):
        if kind == "laplace":
            return laplace_record(epsilon=value)
        if kind == "gauss":
            return gaussian_record(noise_std=value)
        return ReleaseRecord(
            mechanism="multibit", level="model", unit="neuron", epsilon=value, delta=0.0, sensitivity=None,
            sensitivity_norm="none", parameters={"shape": [4, 3]}, randomness="fixed-seed", seed=0, subject="m",
        )  # fmt: skip

    components = [composite_record([leaf(*x) for x in p], "sequential", randomness=rnd) for p in parts]
    record = composite_record(components, "parallel", randomness=rnd, over="neurons")
    grid = np.linspace(0.0, 4.0, 17)
    whole = np.asarray(pld_of_record(record).get_delta_for_epsilon(grid))
    for c in components:
        assert np.all(whole >= np.asarray(pld_of_record(c).get_delta_for_epsilon(grid)) - 1e-9)
