"""Multi-round peer-to-peer DP training (coordinator_free.iterate): the accounting of its
segments in a real ledger, and the loop over real daemons on loopback."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from peer_harness import client, make_site, model_arrays, pin_each_other, running

from coordinator_free.iterate import (
    fusion_weights_by_records,
    load_iterate_config,
    run_iterate,
)
from coordinator_free.roster import write_roster
from peer.base.errors import InvalidArgument
from peer.budget.dpsgd_noise import noise_multiplier_for, planned_orders, run_epsilon
from peer.budget.ledger import Ledger
from peer.net.client import PeerError
from peer.net.releases import ReleaseStore, segment_key, segment_rounds

ARCH = {"kind": "mlp", "input_dim": 6, "hidden": [5], "output_dim": 3, "activation": "relu"}


def policy(epsilon: float, delta: float = 1e-5, orders: str = "", allow: str = '"segment", "ledger"') -> str:
    return f"""
[policy]
show_remaining = "own"
{orders}

[policy.data]
unit = "record:add-remove"
epsilon = {epsilon!r}
delta = {delta!r}

[policy.peers."*"]
allow = [{allow}]
"""


def records(path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 6)).astype(np.float32) + y[:, None].astype(np.float32)
    np.savez(path, x=x, y=y)


#: The public record counts the sites declare (add-remove: DP-GD's denominator and the fusion
#: weight), deliberately not their true counts (30, 40, 30)
DECLARED = {"site-a": 25, "site-b": 50, "site-c": 25, "site-d": 25}


def round_file(
    site, roster, *, rounds: int, epsilon: float = 4.0, wait_s: float = 20.0, extra: str = "", declared: bool = True
) -> str:
    records(site.root / "records.npz", 30 + 10 * (site.name[-1] == "b"), seed=ord(site.name[-1]))
    declared_line = f"declared_records = {DECLARED[site.name]}" if declared else ""
    p = site.root / "iterate.toml"
    p.write_text(
        f"""
[round]
roster = "{roster}"
model = "mlp"
method = "iterate"
out = "rounds"
call_timeout_s = 10.0

[round.iterate]
records = "records.npz"
run = "t1"
rounds = {rounds}
local_steps = 2
learning_rate = 0.5
clip_norm = 1.0
epsilon = {epsilon!r}
delta = 1e-5
init_seed = 5
wait_s = {wait_s!r}
{declared_line}
{extra}
"""
    )
    return str(p)


def test_fusion_weights_are_fedavg_when_every_peer_is_on_time():
    assert fusion_weights_by_records([30, 10, 60], [0, 0, 0], 0.5) == pytest.approx([0.3, 0.1, 0.6])
    # a peer one round behind counts half
    assert fusion_weights_by_records([30, 10, 60], [0, 1, 0], 0.5) == pytest.approx(np.array([30, 5, 60]) / 95.0)
    # a fixed own weight α: the peers share 1 − α by their weights
    assert fusion_weights_by_records([30, 10, 30], [0, 0, 0], 0.5, alpha=0.6) == pytest.approx([0.6, 0.1, 0.3])


def test_planned_order_recovers_the_rdp_noise():
    """One order for the planned run: the ledger's filter then needs the plain RDP σ (no split)."""
    orders = planned_orders(4.0, 1e-5, 40)
    assert len(orders) == 1
    sigma = noise_multiplier_for(4.0, 1e-5, 40, orders=orders)
    assert sigma == pytest.approx(noise_multiplier_for(4.0, 1e-5, 40, figure="rdp"), rel=1e-4)
    assert sigma < noise_multiplier_for(4.0, 1e-5, 40) * 0.92  # the 20-order filter: ≈ 8.24 vs 7.32


@pytest.mark.parametrize("budget", [4.0, 2.5])
def test_each_segment_is_one_charge_and_the_run_stops_at_the_budget(tmp_path, budget):
    """A site alone: its ledger holds one data-level charge per segment, their filter figure is
    the filter of R·steps Gaussian steps at σ, and the segment over budget is refused, nothing of
    it stored, and the run stops there."""
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(budget))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    cfg = load_iterate_config(round_file(a, roster, rounds=5))
    result = run_iterate(a.config, cfg)
    with Ledger(a.ledger) as led:
        orders = led.orders
        entries = led.entries()
        spent = next(s.spent_epsilon for s in led.budget_states() if s.key.level == "data")
    sigma = noise_multiplier_for(4.0, 1e-5, 10, orders=orders)
    done = len(entries)
    assert all(e.mechanism == "dpsgd" and e.level == "data" and e.counterparty == "*" for e in entries)
    assert result.rounds_done == done == len(result.report["rounds"])
    assert spent == pytest.approx(run_epsilon(sigma, 2 * done, 1e-5, orders=orders), rel=1e-9)
    assert result.report["epsilon_filter"] == pytest.approx(spent)
    assert result.report["epsilon_pld"] == pytest.approx(run_epsilon(sigma, 2 * done, 1e-5, figure="pld"))
    assert result.report["epsilon_pld"] < spent  # PLD is the tight figure
    store = ReleaseStore(a.root / "ledger.releases")
    assert [r for r, _ in segment_rounds(store, "t1")] == list(range(done, 0, -1))
    if budget == 4.0:
        assert result.status == "finished" and done == 5
        assert 3.9 < spent <= 4.0  # σ is calibrated to this ledger's filter: the plan spends it all
    else:
        assert result.status == "budget" and 0 < done < 5
        assert run_epsilon(sigma, 2 * (done + 1), 1e-5, orders=orders) > budget >= spent
        assert not (store.directory / f"{segment_key('t1', done + 1)}.json").exists()
    for r in result.report["rounds"]:
        assert r["contributors"] == [] and r["own_weight"] == 1.0


def test_a_second_runs_report_says_which_epsilon_covers_what(tmp_path):
    """Issue 20, item 8 (ii): the report's ``epsilon_filter`` is the site's data budget (every
    data release, earlier runs included: cumulative, 5.898 in the issue) while ``epsilon_pld``
    covers this run only (3.232): two figures of different scopes side by side. Now the report
    states each figure's scope (``epsilon_scopes``) and adds ``epsilon_filter_run``, this run's
    segments by the same filter — the figure to set beside this run's PLD."""
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(20.0))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    first = run_iterate(a.config, load_iterate_config(round_file(a, roster, rounds=3))).report
    path = round_file(a, roster, rounds=3)
    (a.root / "iterate.toml").write_text((a.root / "iterate.toml").read_text().replace('run = "t1"', 'run = "t2"'))
    second = run_iterate(a.config, load_iterate_config(path)).report
    assert first["run"] == "t1" and second["run"] == "t2" and second["rounds_done"] == 3
    with Ledger(a.ledger) as led:
        total = next(s.spent_epsilon for s in led.budget_states() if s.key.level == "data")
        orders = led.orders
    sigma = second["noise_multiplier"]
    assert second["epsilon_filter"] == pytest.approx(total)  # the budget's total: both runs
    # this run alone, by the filter: its 3 × 2 steps, as the calibration computes them
    assert second["epsilon_filter_run"] == pytest.approx(run_epsilon(sigma, 6, 1e-5, orders=orders), rel=1e-9)
    assert first["epsilon_filter_run"] == pytest.approx(first["epsilon_filter"])  # a fresh ledger: one scope
    assert second["epsilon_filter"] > second["epsilon_filter_run"] + 0.5
    # the two figures of the same scope agree in order: the PLD is the tight one
    assert second["epsilon_pld"] < second["epsilon_filter_run"]
    assert set(second["epsilon_scopes"]) == {"epsilon_filter", "epsilon_filter_run", "epsilon_pld"}
    assert "earlier runs" in second["epsilon_scopes"]["epsilon_filter"]
    assert "this run's segments only" in second["epsilon_scopes"]["epsilon_pld"]
    last = second["rounds"][-1]
    assert (last["epsilon_filter"], last["epsilon_filter_run"]) == (
        second["epsilon_filter"],
        second["epsilon_filter_run"],
    )


def test_three_sites_on_loopback_identical_bytes_one_charge_late_and_gone_peers(tmp_path):
    """a and b run 2 rounds, c publishes round 1 only (late for round 2), d is in the roster but
    down (gone). Each segment is charged once; every peer that asks gets the identical bytes with
    a served-again row naming that charge."""
    sites = {
        n: make_site(tmp_path, n, models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0), seed=ord(n[-1]))
        for n in ("site-a", "site-b", "site-c", "site-d")
    }
    pin_each_other(*sites.values())
    a, b, c, d = sites.values()
    with running(a) as (_, addr_a), running(b) as (_, addr_b), running(c) as (_, addr_c):
        roster = write_roster(
            tmp_path / "roster.toml",
            [
                ("site-a", addr_a, str(a.identity_dir / "site.crt")),
                ("site-b", addr_b, str(b.identity_dir / "site.crt")),
                ("site-c", addr_c, str(c.identity_dir / "site.crt")),
                ("site-d", "127.0.0.1:9", str(d.identity_dir / "site.crt")),  # nothing listens: gone
            ],
        )
        results = {}

        def run(site, rounds, wait):
            results[site.name] = run_iterate(
                site.config,
                load_iterate_config(round_file(site, roster, rounds=rounds, wait_s=wait)),
                simulation=True,  # the sites have fixed seeds
            )

        threads = [
            threading.Thread(target=run, args=(a, 2, 3.0)),
            threading.Thread(target=run, args=(b, 2, 3.0)),
            threading.Thread(target=run, args=(c, 1, 3.0)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(results) == {"site-a", "site-b", "site-c"}
        # two more peers ask for a's round-1 segment: identical bytes, no new charge
        with Ledger(a.ledger) as led:
            charges_before = [e.entry_id for e in led.entries()]
        got = []
        for asker in (b, c):
            with client(asker, addr_a, peer="site-a") as cl:
                got.append(cl.segment("t1", min_round=1, max_round=1))
        with client(b, addr_a, peer="site-a") as cl:
            with pytest.raises(PeerError) as e:
                cl.segment("t1", min_round=3)
            assert e.value.status == "NOT_FOUND"
            with pytest.raises(PeerError) as e:
                cl.segment("t1", min_round=2, max_round=1)
            assert e.value.status == "INVALID_ARGUMENT"
    assert {k: v.tobytes() for k, v in got[0].arrays.items()} == {k: v.tobytes() for k, v in got[1].arrays.items()}
    assert got[0].receipt.served_again and got[0].receipt.served_to == "site-b"
    assert got[1].receipt.served_to == "site-c"
    assert got[0].receipt.ledger_entry_id == got[1].receipt.ledger_entry_id
    assert got[0].receipt.record.parameters["segment"]["round"] == 1
    with Ledger(a.ledger) as led:
        led.verify()
        entries = led.entries()
        served = led.served_again()
    assert [e.entry_id for e in entries] == charges_before and len(entries) == 2  # one charge per segment
    assert {s["entry_id"] for s in served} <= {e.entry_id for e in entries}
    r1 = [s for s in served if s["entry_id"] == int(got[0].receipt.ledger_entry_id)]
    assert sorted(s["counterparty"] for s in r1) == ["site-b", "site-b", "site-c", "site-c"]  # loop + asked again
    ra = results["site-a"].report
    assert results["site-a"].status == "finished" and ra["rounds_done"] == 2
    first, second = ra["rounds"]
    assert sorted(first["contributors"]) == ["site-b", "site-c"] and first["peers"]["site-d"]["state"] == "gone"
    assert second["peers"]["site-c"]["state"] == "stale" and second["peers"]["site-c"]["staleness"] == 1
    assert second["peers"]["site-b"]["state"] == "fresh" and second["peers"]["site-d"]["state"] == "gone"
    # weights: declared counts × 0.5^staleness, own included (FedAvg's when all are fresh);
    # the true counts (30, 40, 30) appear nowhere
    assert first["own_weight"] == pytest.approx(25 / 100)
    assert second["own_weight"] == pytest.approx(25 / (25 + 50 + 12.5))
    assert second["peers"]["site-c"]["weight"] == pytest.approx(12.5 / 87.5)
    assert all(first["peers"][p]["records"] == DECLARED[p] for p in ("site-b", "site-c"))
    assert ra["dataset_size"] == 25 and ra["dataset_size_source"] == "declared" and "records" not in ra
    assert first["bytes_received"] == 2 * first["segment"]["bytes"]
    assert first["bytes_sent"] == first["segment"]["bytes"] * len(first["served_to"])
    assert json.loads((a.root / "rounds" / "t1.json").read_text())["rounds_done"] == 2
    assert (a.root / "rounds" / "models" / "t1-r2.json").exists()


def test_a_site_whose_policy_does_not_allow_segments_refuses(tmp_path):
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0, allow='"ledger"'))
    b = make_site(tmp_path, "site-b", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    pin_each_other(a, b)
    with running(a) as (_, addr), client(b, addr, peer="site-a") as cl:
        with pytest.raises(PeerError) as e:
            cl.segment("t1")
        assert e.value.status == "PERMISSION_DENIED"
        with pytest.raises(PeerError) as e:
            cl.segment("no spaces allowed")
        assert e.value.status in ("PERMISSION_DENIED", "INVALID_ARGUMENT")


def test_a_bad_iterate_table_names_the_key(tmp_path):
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    path = round_file(a, roster, rounds=2, extra="staleness_decay = 2.0")
    with pytest.raises(InvalidArgument) as e:
        load_iterate_config(path)
    assert "staleness_decay" in str(e.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [('"default"', "default"), ('"planned"', "planned"), ("[2.0, 6.0]", (2.0, 6.0)), ("8", (8.0,))],
)
def test_scenario_ledger_orders(value, expected):
    from test_scenarios import TINY

    from scenarios.schema import parse_scenario

    sc = parse_scenario(TINY + f"\n[iterate]\ndeclared_records = 40\nledger_orders = {value}\n", "tiny.toml")
    assert sc.iterate.ledger_orders == expected


@pytest.mark.parametrize("value", ['"best"', "[6.0, 2.0]", "[1.0]", "[]"])
def test_scenario_ledger_orders_refused_with_key_and_line(value):
    from test_scenarios import TINY

    from peer.base.config import ConfigError
    from scenarios.schema import parse_scenario

    with pytest.raises(ConfigError) as e:
        parse_scenario(TINY + f"\n[iterate]\ndeclared_records = 40\nledger_orders = {value}\n", "tiny.toml")
    assert "ledger_orders" in str(e.value) and e.value.line is not None


def test_add_remove_without_a_declared_count_is_refused_by_key(tmp_path):
    """Under add-remove the DP-GD denominator must be a declared public count: a run file without
    declared_records (and a site.toml without [site] declared_records) is refused before any
    training or charge, naming both keys; [site] declared_records is taken when the run gives none."""
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    cfg = load_iterate_config(round_file(a, roster, rounds=1, declared=False))
    with pytest.raises(InvalidArgument) as e:
        run_iterate(a.config, cfg)
    assert e.value.field == "round.iterate.declared_records" and "[site] declared_records" in e.value.rule
    assert not a.ledger.exists()  # refused before the ledger was opened: nothing charged
    a.config.write_text(a.config.read_text().replace("[site]\n", "[site]\ndeclared_records = 70\n", 1))
    result = run_iterate(a.config, cfg)
    assert result.report["dataset_size"] == 70 and result.report["dataset_size_source"] == "declared"


def test_a_fixed_site_seed_is_refused_without_simulation(tmp_path):
    """run_iterate draws the segments' noise from site.toml's seed only in a simulation
    (``privfusion round --simulation``), as ``peer serve`` does: without it the run is refused
    before anything is trained or charged, naming site.seed and the flag."""
    from peer.base.errors import FailedPrecondition

    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0), seed=3)
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    cfg = load_iterate_config(round_file(a, roster, rounds=1))
    with pytest.raises(FailedPrecondition) as e:
        run_iterate(a.config, cfg)
    assert "site.seed" in str(e.value) and "--simulation" in str(e.value)
    assert not a.ledger.exists()  # refused before the ledger was opened: nothing charged
    result = run_iterate(a.config, cfg, simulation=True)
    assert result.status == "finished"
    record = json.loads((a.root / "rounds" / "t1.json").read_text())["plan"]["randomness"]
    assert record == {"randomness": "fixed-seed", "seed": 3 + 2**31}


def test_a_poisson_segment_is_the_subsampled_gaussian_by_dp_accounting(tmp_path):
    """``sample_rate`` q < 1: the segment's record states q in every step and its ε is that of
    ``local_steps`` Poisson-subsampled Gaussian steps — dp-accounting's PLD and RDP of
    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps) — with
    amplification: below the full-batch figure at the same σ."""
    from dp_accounting import dp_event, rdp
    from dp_accounting.pld import pld_privacy_accountant

    from coordinator_free.iterate import segment_training
    from peer.base.rng import make_randomness
    from peer.dp.training import dpsgd_release_record

    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    q, sigma = 0.2, 1.3
    cfg = load_iterate_config(round_file(a, roster, rounds=3, extra=f"sample_rate = {q}"))
    assert cfg.sample_rate == q
    training = segment_training(cfg, sigma)
    assert [s.sample_rate for s in training.steps] == [q, q]
    record = dpsgd_release_record(
        training, delta=1e-5, dataset_size=25, randomness=make_randomness(0), init_seed=5, architecture=ARCH
    )
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), 2)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(event)
    theirs_pld = pld.get_epsilon(1e-5)
    # both discretise pessimistically, on grids of 1e-4 per step or finer
    assert record.epsilon == pytest.approx(theirs_pld, abs=2 * 2e-4 + 1e-3 * theirs_pld)
    acc = rdp.RdpAccountant()
    acc.compose(event)
    assert float(record.parameters["epsilon_rdp"]) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    full = dpsgd_release_record(
        segment_training(load_iterate_config(round_file(a, roster, rounds=3)), sigma),
        delta=1e-5, dataset_size=25, randomness=make_randomness(0), init_seed=5, architecture=ARCH,
    )  # fmt: skip
    assert record.epsilon < 0.5 * full.epsilon


def test_a_poisson_run_is_charged_what_its_records_say(tmp_path):
    """A real run with sample_rate 0.3: σ is the filter's for 3 × 2 subsampled steps at (4, 1e-5);
    every ledger entry is one segment whose stored record states q, and what the ledger charged
    (its RDP curve, hence the filter's ε) is exactly the subsampled Gaussian of those steps; the
    report's plan and PLD figure say the same."""
    from peer.dp.accounting.rdp import rdp_subsampled_gaussian

    q = 0.3
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    roster = write_roster(tmp_path / "roster.toml", [("site-a", "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    result = run_iterate(a.config, load_iterate_config(round_file(a, roster, rounds=3, extra=f"sample_rate = {q}")))
    assert result.status == "finished" and result.rounds_done == 3
    with Ledger(a.ledger) as led:
        orders = led.orders
        entries = led.entries()
        spent = next(s.spent_epsilon for s in led.budget_states() if s.key.level == "data")
    sigma = noise_multiplier_for(4.0, 1e-5, 6, sample_rate=q, orders=orders)
    assert result.report["noise_multiplier"] == sigma and result.report["plan"]["sample_rate"] == q
    assert sigma < noise_multiplier_for(4.0, 1e-5, 6, orders=orders)  # amplification by sampling
    assert len(entries) == 3
    step = rdp_subsampled_gaussian(sigma, q, orders, "add-remove")
    store = ReleaseStore(a.root / "ledger.releases")
    for r, e in enumerate(sorted(entries, key=lambda e: e.entry_id), start=1):
        steps = e.record.parameters["training"]["steps"]
        assert [(s["count"], s["sample_rate"]) for s in steps] == [(2, q)]
        assert np.allclose(e.rdp, 2 * step, rtol=1e-12, atol=0)
        stored = store.get(segment_key("t1", r))  # what the daemon serves with the bytes
        assert stored.record.canonical_json() == e.record.canonical_json()
    assert spent == pytest.approx(run_epsilon(sigma, 6, 1e-5, sample_rate=q, orders=orders), rel=1e-9)
    assert 3.9 < spent <= 4.0
    assert result.report["epsilon_pld"] == pytest.approx(
        run_epsilon(sigma, 6, 1e-5, sample_rate=q, figure="pld"), rel=1e-9
    )
