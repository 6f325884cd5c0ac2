"""Scenario files and the simulator: errors that name key and line, the bundled scenarios, and
simulations end to end (every site a real daemon process) whose reports must equal the sites'
ledger files, release by release."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.base.config import ConfigError
from peer.budget.ledger import Ledger
from scenarios.report import SECURE_ROW
from scenarios.schema import BUNDLED, bundled_path, load_scenario, parse_scenario
from scenarios.simulate import read_ledger

TINY = """
[scenario]
name = "tiny"
description = "three sites, small models, one round"
seed = 3

[data]
dataset = "breast_cancer"
public_size = 40
probe_size = 20
split = "dirichlet"
concentration = 1.0
min_per_site = 20

[model]
hidden = [8]
epochs = 20

[round]
methods = ["ldp"]
frontier = []
activation_epsilon = 50.0
weight_epsilon = 50.0
weights_epsilon = 100.0
call_timeout_s = 30.0

[sites.site-a]
[sites.site-b]
alpha = 0.7
[sites.site-c]
"""


# ---------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_scenarios_parse(name):
    sc = load_scenario(bundled_path(name))
    assert len(sc.sites) >= 3 and sc.source.endswith(name)


def test_the_default_scenario_is_package_data():
    sc = load_scenario()
    assert sc.name == "hospitals" and len(sc.sites) == 4 and sc.data.dataset == "breast_cancer"
    assert sc.data.split == "dirichlet" and sc.pool is not None and sc.round.methods == ("ldp", "merged")


def test_tiny_scenario_defaults_and_overrides():
    sc = parse_scenario(TINY, "tiny.toml")
    assert [s.name for s in sc.sites] == ["site-a", "site-b", "site-c"]
    assert sc.sites[1].alpha == 0.7 and sc.sites[0].alpha is None
    assert sc.pool is None and sc.round.quorum == 2 and sc.model.hidden == (8,)
    # the steps after fusion are on by default in simulations
    assert (sc.round.repair, sc.round.select, sc.round.finetune_epochs) == ("own", True, 5)
    pooled = parse_scenario(TINY + '\n[pool]\ndeclared_records = 40\noptimizer = "adam"\n', "tiny.toml")
    assert pooled.pool.optimizer == "adam" and load_scenario().pool.optimizer == "sgd"


def _replace(old: str, new: str) -> str:
    assert old in TINY
    return TINY.replace(old, new, 1)


def _line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if fragment in line)


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        (_replace('dataset = "breast_cancer"', 'dataset = "mnist"'), "data.dataset", 'dataset = "mnist"'),
        (_replace("epochs = 20", "epochs = -1"), "model.epochs", "epochs = -1"),
        (_replace("hidden = [8]", "hidden = [0]"), "model.hidden", "hidden = [0]"),
        (_replace("frontier = []", "frontier = []\nalpah = 0.5"), "round.alpah", "alpah = 0.5"),
        (_replace('methods = ["ldp"]', 'methods = ["ldp", "merged"]'), "round.methods", "methods ="),
        (_replace("probe_size = 20", "probe_size = 400"), "data.probe_size", "probe_size = 400"),
        (_replace("alpha = 0.7", "alpha = 1.7"), "sites.site-b.alpha", "alpha = 1.7"),
        (_replace("[sites.site-c]", "[sites.Site_C]"), "sites.Site_C", "[sites.Site_C]"),
        (TINY + '\n[failure]\nsite = "nobody"\n', "failure.site", 'site = "nobody"'),
        (TINY + '\n[pool]\ndeclared_records = 40\noptimizer = "rmsprop"\n', "pool.optimizer", 'optimizer = "rmsprop"'),
        (
            _replace("activation_epsilon = 50.0", "activation_epsilon = 0"),
            "round.activation_epsilon",
            "activation_epsilon = 0",
        ),
        (_replace("frontier = []", "frontier = [100.0]"), "round.frontier", "frontier = [100.0]"),
        (_replace("frontier = []", 'frontier = []\nrepair = "all"'), "round.repair", 'repair = "all"'),
        (_replace("frontier = []", "frontier = []\nfinetune_epochs = -2"), "round.finetune_epochs", "finetune_epochs"),
        # secure aggregation: t + 2 sites (TINY has 3), add-remove only, coalition only with secure
        (
            TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\ncoalition = 2\n",
            "iterate.coalition",
            "coalition = 2",
        ),
        (
            TINY + '\n[iterate]\nadjacency = "replace-one"\nsecure = true\n',
            "iterate.adjacency",
            'adjacency = "replace-one"',
        ),
        (TINY + "\n[iterate]\ndeclared_records = 40\ncoalition = 1\n", "iterate.coalition", "coalition = 1"),
        (TINY + "\n[iterate]\ndeclared_records = 40\nsecure = 1\n", "iterate.secure", "secure = 1"),
        # the secure run's own plan: only beside a secure run, and checked like [central_dpsgd]'s
        (
            TINY + "\n[iterate]\ndeclared_records = 40\n[secure_iterate]\nsteps = 9\n",
            "secure_iterate",
            "[secure_iterate]",
        ),
        (
            TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\n[secure_iterate]\nsample_rate = 1.5\n",
            "secure_iterate.sample_rate",
            "sample_rate = 1.5",
        ),
        (
            TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\n[secure_iterate]\nrounds = 3\n",
            "secure_iterate.rounds",
            "rounds = 3",
        ),
    ],
)
def test_a_bad_value_is_refused_with_its_key_and_line(text, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_scenario(text, "bad.toml")
    assert e.value.key == key
    assert e.value.line == _line_of(text, fragment)
    assert f"line {e.value.line}" in str(e.value) and "bad.toml" in str(e.value)


def test_iterate_secure_is_off_unless_asked_and_takes_its_coalition():
    plain = parse_scenario(TINY + "\n[iterate]\ndeclared_records = 40\n", "t.toml").iterate
    assert (plain.secure, plain.coalition) == (False, 1)
    sc = parse_scenario(TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\ncoalition = 1\n", "t.toml")
    assert (sc.iterate.secure, sc.iterate.coalition) == (True, 1)
    assert sc.to_dict()["iterate"]["secure"] is True  # and into the report's scenario
    assert sc.secure_iterate is None  # no plan of its own: [iterate]'s
    own = parse_scenario(
        TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\n[secure_iterate]\nsteps = 9\nsample_rate = 0.5\n",
        "t.toml",
    )
    p = own.secure_iterate
    assert (p.steps, p.sample_rate, p.learning_rate, p.clip_norm) == (
        9,
        0.5,
        own.iterate.learning_rate,
        own.iterate.clip_norm,
    )
    from scenarios.iterate_sites import iterate_round_toml

    text = iterate_round_toml(own, Path("roster.toml"), secure=True)
    assert "rounds = 9\nlocal_steps = 1\n" in text and "sample_rate = 0.5" in text and "secure = true" in text
    plain = iterate_round_toml(own, Path("roster.toml"))
    assert f"rounds = {own.iterate.rounds}\n" in plain and "secure" not in plain.split("run =")[1]
    # γ of the secure run's encoding travels into its round file (default: the round's own)
    assert "secure_scale = 1024.0" in text
    scaled = parse_scenario(
        TINY + '\n[iterate]\ndeclared_records = 40\nledger_orders = "planned"\nsecure = true\nsecure_scale = 65536.0\n',
        "t.toml",
    )
    assert "secure_scale = 65536.0" in iterate_round_toml(scaled, Path("roster.toml"), secure=True)


def test_a_secure_runs_ledgers_hold_the_one_integer_order_planned_for_its_skellam_steps():
    """With ledger_orders = "planned" the secure run's ledgers hold the integer order at which its
    own plan needs the least Skellam noise (the bound is stated at integer orders: at 6.1 the
    ledger would pay for order 7), a function of the public plan and encoding only."""
    from peer.dp.distributed.encoding import Encoding
    from peer.dp.distributed.skellam import PLANNED_ORDERS, calibrate_share
    from scenarios.iterate_sites import iterate_orders, secure_orders

    sc = parse_scenario(
        TINY + '\n[iterate]\ndeclared_records = 40\nledger_orders = "planned"\nsecure = true\nsecure_scale = 65536.0\n'
        "[secure_iterate]\nsteps = 40\nsample_rate = 1.0\nclip_norm = 0.5\n",
        "t.toml",
    )
    (order,) = secure_orders(sc, 1058)
    assert float(order).is_integer() and order in PLANNED_ORDERS
    enc = Encoding(dim=1058, clip_norm=0.5, scale=65536.0, bits=32, beta=0.0)

    def variance(o):
        it = sc.iterate
        return calibrate_share(
            it.epsilon, it.delta, 3, 1, enc.l1_sensitivity, enc.l2_sensitivity, 1.0, 40, (float(o),)
        ).total_variance

    assert all(variance(order) <= variance(o) for o in (order - 1, order + 1, 6.1, 12))
    assert variance(order) < variance(iterate_orders(sc)[0]) or iterate_orders(sc)[0] == order
    default = parse_scenario(TINY + "\n[iterate]\ndeclared_records = 40\nsecure = true\n", "t.toml")
    assert secure_orders(default, 1058) == iterate_orders(default)  # not planned: the scenario's own
    with pytest.raises(ConfigError) as e:
        parse_scenario(TINY + "\n[iterate]\ndeclared_records = 40\nsecure_scale = 2.0\n", "bad.toml")
    assert e.value.key == "iterate.secure_scale"


def test_a_syntax_error_names_its_line():
    text = _replace("seed = 3", 'seed = "3')
    with pytest.raises(ConfigError) as e:
        parse_scenario(text, "bad.toml")
    assert e.value.line == _line_of(text, 'seed = "3')


def test_the_command_prints_key_and_line(tmp_path, capsys):
    from peer.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text(_replace("epochs = 20", "epochs = 2.5"))
    assert main(["simulate", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"model.epochs ({bad}, line {_line_of(bad.read_text(), 'epochs = 2.5')}): must be an integer" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------- simulations


def check_report_against_ledgers(out: Path, report: dict) -> None:
    """The report's budgets are the ledgers' (entry by entry, budget by budget), every receipt a
    requester reported is in the releasing site's ledger, and every ledger file is consistent."""
    on_disk = json.loads((out / "report.json").read_text())
    for name, claimed in on_disk["ledgers"].items():
        path = out / "sites" / name / "ledger.sqlite"
        Ledger(path).close()  # opening verifies integrity, the hash chain and the cached totals
        fresh = json.loads(json.dumps(read_ledger(path), sort_keys=True, default=str))
        assert json.dumps(fresh, sort_keys=True) == json.dumps(claimed, sort_keys=True), name
        with Ledger(path) as ledger:
            entries = ledger.entries()
        assert [e["release_id"] for e in claimed["entries"]] == [e.release_id for e in entries]
        assert [e["epsilon"] for e in claimed["entries"]] == [e.epsilon for e in entries]
        for b in claimed["budgets"]:
            assert b["epsilon_sum"] == sum(e.epsilon for e in entries if b["budget"] in e.budgets)
        rec = on_disk["reconciliation"][name]
        assert rec["consistent"] and rec["receipts_missing_from_ledger"] == []
        assert rec["ledger_entries"] == len(entries)
    md = (out / "report.md").read_text()
    for name, claimed in on_disk["ledgers"].items():
        for b in claimed["budgets"]:
            assert f"| {name} | `{b['budget']}` | {b['count']} |" in md


def test_tiny_simulation_end_to_end(tmp_path):
    from scenarios.report import summary_rows, summary_table
    from scenarios.simulate import Progress, simulate

    lines = []
    out = tmp_path / "run"
    report = simulate(parse_scenario(TINY, "tiny.toml"), out, Progress(lines.append))
    for f in ("report.md", "report.json", "accuracy.png", "frontier.png", "budget.png", "roster.toml"):
        assert (out / f).is_file(), f
    assert set(report["sites"]) == {"site-a", "site-b", "site-c"}
    for name, s in report["sites"].items():
        r = s["rounds"]["ldp"]
        assert r["status"] == "fused", r
        assert sorted(r["contributors"]) == sorted(n for n in report["sites"] if n != name)
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= s["own_accuracy"] <= 1.0 and 0.0 <= s["oracle"]["accuracy"] <= 1.0
        # every other site asked this one for features and weights
        assert report["ledgers"][name]["entries"] and len(report["ledgers"][name]["entries"]) == 4
    assert report["sites"]["site-b"]["rounds"]["ldp"]["weights"]["site-b"] == 0.7
    assert report["round_exit_codes"] == {n: 0 for n in report["sites"]}  # as `privfusion round` exits
    check_report_against_ledgers(out, report)
    # every release was fixed-seed noise (a simulation option) and says so
    rec = json.loads(json.dumps(report["ledgers"]["site-a"]["entries"][0]))
    assert rec["mechanism"] == "composite"
    table = summary_table(report)
    assert "oracle (non-private)" in table and "site-b" in table
    # after fusion (local, nothing charged — the ledgers above hold only features and weights):
    # REPAIR on each site's own records after selection on the public set, then fine-tuning
    for name, s in report["sites"].items():
        r = s["rounds"]["ldp"]
        assert 0.0 <= r["accuracy_repaired"] <= 1.0 and 0.0 <= r["accuracy_finetuned"] <= 1.0
        af = r["after_fusion"]
        assert af["repair"] == "own" and af["finetune_epochs"] == 5 and af["error"] is None
        assert sorted(af["kept"] + af["dropped"]) == sorted(r["contributors"])
        assert (out / "sites" / name / "records.npz").is_file()  # the site's records stay in its directory
    for head in ("+repair", "+FT", "central pooled", "Δ central"):
        assert head in table
    rows = summary_rows(report)
    # central pooled training is always computed (the non-private ceiling); the distance to it
    central = report["baselines"]["central_pooled"]["accuracy_mean"]
    assert all(r["central"] == central for r in rows)
    for r in rows:
        base = r["merged_repaired"] if r["merged_repaired"] is not None else r["ldp_repaired"]
        assert r["to_central"] == pytest.approx(base - central)
    with_central = {**report, "baselines": {"central_pooled": {"accuracy_mean": 0.95}}}
    for r in summary_rows(with_central):
        assert r["central"] == 0.95 and r["to_central"] == pytest.approx(r["ldp_repaired"] - 0.95)
    assert any("daemon serving" in line for line in lines) and any("fused with" in line for line in lines)
    assert "ORACLE (non-private)" in (out / "report.md").read_text()


def test_a_round_thread_refusing_its_round_file_exits_as_the_command_would(tmp_path):
    """The simulator runs a site's rounds on a thread of its own process (RoundThread): a round
    file it refuses ends them with the command's status 2 and the reason, naming the file, in
    the site's rounds.log, before anything is requested."""
    import numpy as np

    from scenarios.simulate import RoundThread, SiteWorld, site_toml

    sc = parse_scenario(TINY, "tiny.toml")
    empty = np.zeros((1, 1), dtype=np.float32)
    site = SiteWorld("site-a", tmp_path, 1, 0.5, empty, np.zeros(1), empty, {}, {})
    site.config.write_text(site_toml(sc, site), encoding="utf-8")
    bad = tmp_path / "round-ldp.toml"
    bad.write_text("[round]\nalpha = 0.5\n", encoding="utf-8")  # no roster, no model
    events = []
    thread = RoundThread(site, [bad], events.append)
    assert thread.wait(60) == 2 and thread.poll() == 2
    assert events == [] and str(bad) in (tmp_path / "rounds.log").read_text()


@pytest.mark.slow
def test_default_simulation_from_the_command_line(tmp_path):
    out = tmp_path / "hospitals"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", "simulate", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hospital-a" in proc.stdout and "oracle (non-private)" in proc.stdout
    assert "daemon serving" in proc.stderr and "fused with" in proc.stderr  # progress on stderr
    report = json.loads((out / "report.json").read_text())
    assert len(report["sites"]) == 4
    for s in report["sites"].values():
        assert s["rounds"]["ldp"]["status"] == "fused"
    check_report_against_ledgers(out, report)
    # the bundled scenario's [iterate]: every site ran the multi-round peer-to-peer loop against
    # the real daemons (one charge per segment in its run ledger, served again to every peer)
    sc = load_scenario(bundled_path("hospitals.toml"))
    rounds, names = sc.iterate.rounds, set(report["sites"])
    for name, s in report["sites"].items():
        it = s["iterate"]
        assert it["status"] == "finished" and it["rounds_done"] == rounds
        assert [r["round"] for r in it["rounds"]] == list(range(1, rounds + 1))
        for r in it["rounds"]:
            assert set(r) >= {"accuracy", "epsilon_filter", "epsilon_pld", "bytes_sent", "bytes_received"}
            assert sorted(r["contributors"]) == sorted(names - {name})  # everyone on time on loopback
        assert it["final_accuracy"] == it["rounds"][-1]["accuracy"]
        eps = [r["epsilon_filter"] for r in it["rounds"]]
        assert eps == sorted(eps) and it["epsilon_pld"] < it["epsilon_filter"] <= sc.iterate.epsilon
        led = it["ledger"]
        assert led["charges"] == rounds and led["epsilon_limit"] == sc.iterate.epsilon
        assert led["epsilon_filter"] == pytest.approx(it["epsilon_filter"]) and led["epsilon_filter"] <= 4.0
        assert led["epsilon_pld"] == pytest.approx(it["epsilon_pld"], abs=0.05)
        assert led["served_again"] == rounds * (len(names) - 1)
        assert it["bytes_sent"] > 0 and it["bytes_received"] > 0
    # on time everywhere: every site fused the same average (DP-FedAvg's) in the last round
    assert len({s["iterate"]["final_accuracy"] for s in report["sites"].values()}) == 1
    # the same plan with secure aggregation ([iterate] secure = true): DP-SGD over every site's
    # records, one secure sum per step, each attempt charged to the site's own run ledger
    assert sc.iterate.secure
    # its own plan ([secure_iterate], chosen by the secure row's search on validation), or [iterate]'s
    steps = sc.secure_iterate.steps if sc.secure_iterate is not None else rounds * sc.iterate.local_steps
    for s in report["sites"].values():
        sec = s["secure_iterate"]
        assert sec["status"] == "finished" and sec["steps_done"] == steps, sec
        assert sec["epsilon_filter"] <= sc.iterate.epsilon and sec["ledger"]["epsilon_limit"] == sc.iterate.epsilon
        assert sec["ledger"]["epsilon_filter"] == pytest.approx(sec["epsilon_filter"])
        assert sec["ledger"]["charges"] >= steps and sec["wall_s"] > 0
    # every site applied the same update at every step: one model, one accuracy
    assert len({s["secure_iterate"]["final_accuracy"] for s in report["sites"].values()}) == 1
    assert SECURE_ROW in proc.stdout
    # the baselines beside it: central pooled, DP-FedAvg at both calibrations (same rounds) and
    # central DP-SGD on the pooled records at the same ε with the scenario's [central_dpsgd] plan
    b = report["baselines"]
    assert set(b) == {"dp_fedavg", "central_dpsgd", "central_pooled"}
    cd, c = b["central_dpsgd"], sc.central_dpsgd
    assert (cd["steps"], cd["sample_rate"], cd["learning_rate"]) == (c.steps, c.sample_rate, c.learning_rate)
    assert cd["epsilon_spent"]["rdp"] <= sc.iterate.epsilon and cd["seeds"] == list(sc.iterate.baseline_seeds)
    assert "central DP-SGD, trusted curator" in proc.stdout
    assert set(b["dp_fedavg"]["calibrations"]) == {"rdp", "filter"}
    for run in b["dp_fedavg"]["calibrations"].values():
        assert len(run["per_round"]) == rounds and run["seeds"] == list(sc.iterate.baseline_seeds)
        assert set(run["per_site"]) == names
    assert "baselines.png" in report["plots"] and (out / "baselines.png").is_file()
    md = (out / "report.md").read_text()
    assert "## Baselines and comparison" in md and "Multi-round" in md
    assert "multi-round peer-to-peer" in proc.stdout and "DP-FedAvg" in proc.stdout
    # every row that measured its run carries its wall time per site (the iterate row once showed 0.0)
    from scenarios.report import comparison_rows

    measured = [r for r in comparison_rows(report) if r["wall_s_per_site"] is not None]
    assert any(r["method"] == "multi-round peer-to-peer" for r in measured)
    assert any(r["method"] == SECURE_ROW for r in measured)
    assert all(r["wall_s_per_site"] > 0 for r in measured), measured
    print(f"default simulation: {elapsed:.1f}s wall ({report['timings']})")


@pytest.mark.slow
def test_failure_scenario_completes_with_the_survivors(tmp_path):
    from scenarios.simulate import Progress, simulate

    out = tmp_path / "failure"
    report = simulate(load_scenario(bundled_path("hospitals-failure.toml")), out, Progress(lambda s: None))
    f = report["failure"]
    assert f["site"] == "hospital-c" and f["killed_at"] and f["ledger_entries_at_kill"] >= 3
    survivors = [n for n in report["sites"] if n != "hospital-c"]
    drops = []
    for name in survivors:
        r = report["sites"][name]["rounds"]["ldp"]
        assert r["status"] == "fused", r
        if "hospital-c" in r["contributors"]:
            # it may contribute only with what reached this site whole before it died
            [round_file] = (out / "sites" / name / "rounds").glob("round-*.json")
            got = [c for c in json.loads(round_file.read_text())["charges"] if c["peer"] == "hospital-c"]
            assert [c["step"] for c in got] == ["features", "weights"] and all(c["delivered"] for c in got)
        drops += [d for d in r["dropped"] if d["peer"] == "hospital-c"]
    assert drops, "some survivor must have dropped the killed site"
    for d in drops:
        assert d["step"] in ("health", "info", "features", "weights") and d["at"] >= f["killed_at"][:19]
    md = (out / "report.md").read_text()
    assert "**hospital-c** was killed with SIGKILL" in md and "dropped **hospital-c** at step" in md
    check_report_against_ledgers(out, report)


@pytest.mark.slow
def test_twelve_site_scenario_lays_out_its_sites(tmp_path):
    """hospitals-12.toml: twelve sites, each with its share of the protected records (disjoint,
    at least min_per_site), its own model, a pool of the scenario's size, an identity that pins
    the eleven others, and a site.toml the daemon reads. The full run is
    benchmarks/simulate_sites.py (minutes, not a test)."""
    from peer.net.site import SiteConfig
    from peer.net.trust import TrustStore
    from scenarios.simulate import Progress, prepare, split_data

    sc = load_scenario(bundled_path("hospitals-12.toml"))
    names = [s.name for s in sc.sites]
    assert len(names) == 12 and sc.round.quorum <= 12 and sc.pool is not None
    data = split_data(sc)
    sizes = [len(y) for _, y in data.parts]
    assert len(sizes) == 12 and min(sizes) >= sc.data.min_per_site
    rows = {tuple(r) for x, _ in data.parts for r in x.round(6)}
    assert len(rows) == sum(sizes), "the sites' records overlap"
    world = prepare(sc, tmp_path, Progress(lambda s: None))
    assert list(world.sites) == names
    for name, s in world.sites.items():
        cfg = SiteConfig.load(s.config)
        assert cfg.name == name and cfg.seed == s.seed
        assert len(s.pool) == len(sc.pool.noise_multipliers)
        assert (s.root / "models").is_dir() and (s.root / "probe.safetensors").is_file()
        pinned = {p.name for p in TrustStore(s.identity / "trusted").peers().values()}
        assert pinned == set(names) - {name}


# ------------------------------------------------------------------- the field study's settings


def _without(text: str, *fragments: str) -> str:
    """``text`` without the lines that contain any of ``fragments``."""
    return "\n".join(line for line in text.splitlines() if not any(f in line for f in fragments)) + "\n"


def test_the_field_study_scenarios_build_their_settings():
    """underfit.toml, unbalanced.toml and regions.toml (Table IV's settings) are hospitals.toml
    but for the setting: the per-site epochs, the class removal (exactly round(f · m) of the m
    records of the class, nothing else), and four contiguous regions of mean texture."""
    import numpy as np

    from peer.nn.data import feature_names
    from scenarios.world import split_data

    under = load_scenario(bundled_path("underfit.toml"))
    assert [s.epochs for s in under.sites] == [10, 10, None, None] and under.model.epochs == 50
    assert under.data.split == "iid"

    path = bundled_path("unbalanced.toml")
    unbalanced = load_scenario(path)
    removed = {s.name: (s.remove_class, s.remove_fraction) for s in unbalanced.sites if s.remove_class is not None}
    assert removed == {"hospital-a": (0, 0.8), "hospital-b": (1, 0.7)}
    whole = parse_scenario(_without(path.read_text(), "remove_class", "remove_fraction"), str(path))
    got, before = split_data(unbalanced).parts, split_data(whole).parts
    for spec, (x, y), (x0, y0) in zip(unbalanced.sites, got, before, strict=True):
        kept = {tuple(r) for r in x.round(6)}
        assert kept <= {tuple(r) for r in x0.round(6)}, spec.name  # records dropped, none added
        counts, counts0 = np.bincount(y, minlength=2), np.bincount(y0, minlength=2)
        if spec.remove_class is None:
            assert np.array_equal(counts, counts0), spec.name
            continue
        c = spec.remove_class
        assert counts[c] == counts0[c] - round(spec.remove_fraction * counts0[c]), spec.name
        assert counts[1 - c] == counts0[1 - c], spec.name

    regions = load_scenario(bundled_path("regions.toml"))
    assert regions.data.split == "region" and regions.data.region_feature == "mean texture"
    column = feature_names("breast_cancer").index("mean texture")
    parts = split_data(regions).parts
    sizes = [len(y) for _, y in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == sum(len(y) for _, y in split_data(whole).parts)
    for (lo, _), (hi, _) in itertools.pairwise(parts):
        assert lo[:, column].max() <= hi[:, column].min()  # region i below region i + 1
    # regions by a covariate are not IID in the label: the lowest and highest quarters differ
    shares = [float(np.mean(y == 0)) for _, y in parts]
    assert shares[-1] - shares[0] > 0.3, shares


def test_split_by_feature_and_remove_class():
    import numpy as np

    from peer.base.errors import InvalidArgument
    from peer.nn.data import remove_class, split_by_feature

    values = np.array([5.0, 1.0, 3.0, 3.0, 0.0, 9.0, 2.0])
    parts = split_by_feature(values, 3)
    # sorted: 4, 1, 6, 2, 3, 0, 5; cut after records 7·1//3 = 2 and 7·2//3 = 4 (ties keep their order)
    assert [p.tolist() for p in parts] == [[1, 4], [2, 6], [0, 3, 5]]
    with pytest.raises(InvalidArgument, match="at least as many records"):
        split_by_feature(values, 8)
    y = np.array([0, 0, 0, 0, 1, 1, 1])
    kept = remove_class(np.arange(7), y, 0, 0.5, np.random.default_rng(0))
    assert len(kept) == 5 and set(np.arange(4, 7)) <= set(kept.tolist())


@pytest.mark.parametrize(
    "old,new,key,fragment",
    [
        ('split = "dirichlet"', 'split = "region"', "data.region_feature", "[data]"),
        (
            "concentration = 1.0",
            'concentration = 1.0\nregion_feature = "mean texture"',
            "data.region_feature",
            "region_feature",
        ),
        (
            'split = "dirichlet"',
            'split = "region"\nregion_feature = "texture"',
            "data.region_feature",
            "region_feature",
        ),
        ("alpha = 0.7", "alpha = 0.7\nremove_class = 0", "sites.site-b.remove_fraction", "[sites.site-b]"),
        (
            "alpha = 0.7",
            "alpha = 0.7\nremove_class = 2\nremove_fraction = 0.5",
            "sites.site-b.remove_class",
            "remove_class",
        ),
        (
            "alpha = 0.7",
            "alpha = 0.7\nremove_class = 1\nremove_fraction = 1.5",
            "sites.site-b.remove_fraction",
            "remove_fraction",
        ),
        ("alpha = 0.7", "alpha = 0.7\nepochs = 0", "sites.site-b.epochs", "epochs = 0"),
    ],
)
def test_a_bad_field_study_key_is_refused_with_its_line(old, new, key, fragment):
    text = _replace(old, new)
    with pytest.raises(ConfigError) as e:
        parse_scenario(text, "bad.toml")
    assert e.value.key == key
    assert e.value.line == _line_of(text, fragment)


def test_a_removal_that_leaves_too_few_records_names_its_key():
    from peer.base.errors import InvalidArgument
    from scenarios.world import split_data

    sc = parse_scenario(_replace("alpha = 0.7", "alpha = 0.7\nremove_class = 1\nremove_fraction = 1.0"), "tiny.toml")
    with pytest.raises(InvalidArgument) as e:
        split_data(sc)
    assert e.value.field == "sites.site-b.remove_fraction" and "fewer than data.min_per_site" in str(e.value)


@pytest.mark.slow
def test_underfit_scenario_end_to_end(tmp_path):
    """underfit.toml through real daemons (about a minute on 2 cores): the two underfit sites
    train 10 epochs, every site fuses, and the report is its ledgers'."""
    from scenarios.simulate import Progress, simulate

    lines = []
    out = tmp_path / "underfit"
    report = simulate(load_scenario(bundled_path("underfit.toml")), out, Progress(lines.append))
    for name, epochs in (("hospital-a", 10), ("hospital-b", 10), ("hospital-c", 50), ("hospital-d", 50)):
        assert any(f"{name}: " in line and f"own model ({epochs} epochs)" in line for line in lines), name
    for s in report["sites"].values():
        assert s["rounds"]["ldp"]["status"] == "fused" and s["rounds"]["merged"]["status"] == "fused"
    check_report_against_ledgers(out, report)


# ---------------------------------------------------------------------------------- image records

#: TINY on digits rendered to 12x12 PNG folders, with the built-in CNN
IMAGES = _replace('dataset = "breast_cancer"', 'dataset = "digits"\nimage_size = 12').replace(
    "hidden = [8]", 'kind = "cnn"\nchannels = [4]\npool = [2]\nhidden = [8]', 1
)


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        (_replace("min_per_site = 20", "min_per_site = 20\nimage_size = 28"), "data.image_size", "image_size = 28"),
        (_replace("hidden = [8]", 'hidden = [8]\nkind = "cnn"'), "model.kind", 'kind = "cnn"'),
        (_replace("hidden = [8]", "hidden = [8]\nchannels = [4]"), "model.channels", "channels = [4]"),
        (IMAGES.replace("image_size = 12", "image_size = 4"), "data.image_size", "image_size = 4"),
        (IMAGES.replace("pool = [2]", "pool = [5]"), "model.pool", "pool = [5]"),
        (IMAGES.replace("pool = [2]", "pool = [2, 2]"), "model.pool", "pool = [2, 2]"),
        (IMAGES.replace("[model]", "[model]\nkernel_size = 4"), "model.kernel_size", "kernel_size = 4"),
    ],
)
def test_a_bad_image_key_is_refused_with_its_line(text, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_scenario(text, "bad.toml")
    assert e.value.key == key
    assert e.value.line == _line_of(text, fragment)


def test_the_image_scenario_renders_folders_by_class_and_reads_them_back(tmp_path):
    """Every part of the split becomes a folder of 12x12 PNG files by class; read back through
    peer.nn.images with the preprocessing fitted on the public folder, the parts hold the same
    labels as the split of the arrays, and the pixels are the 8x8 digits upscaled."""
    import numpy as np
    from PIL import Image

    from peer.nn.images import ImagePreprocessing, read_images
    from scenarios.world import split_data

    sc = parse_scenario(IMAGES, "images.toml")
    arrays = split_data(parse_scenario(TINY.replace('dataset = "breast_cancer"', 'dataset = "digits"'), "d.toml"))
    data = split_data(sc, tmp_path)
    assert data.architecture["kind"] == "cnn" and data.architecture["input_shape"] == [1, 12, 12]
    prep = data.preprocessing
    assert isinstance(prep, ImagePreprocessing) and prep.fitted_on["split"] == "public" and prep.size == (12, 12)
    assert set(data.folders) == {"public", "test", "site-a", "site-b", "site-c"}
    for (x, y), (_, y_arrays), name in zip(data.parts, arrays.parts, ("site-a", "site-b", "site-c"), strict=True):
        assert x.shape == (len(y), 144)
        assert np.array_equal(np.bincount(y, minlength=10), np.bincount(y_arrays, minlength=10)), name
        files = read_images(data.folders[name])
        assert len(files) == len(y) and all(
            p.parent.name == str(label) for p, label in zip(files.paths, y, strict=True)
        )
        with Image.open(files.paths[0]) as im:
            assert (im.mode, im.size) == ("L", (12, 12))
    # the pixels: each record's mean intensity is its 8x8 digit's (bilinear upscaling keeps it
    # to within the rounding of 8-bit pixels and the filter's edge handling)
    (x_pub, y_pub) = (data.x_public, data.y_public)
    raw = x_pub.reshape(-1, 144) * prep.std[0] + prep.mean[0]
    ref = np.sort(arrays.x_public.mean(axis=1))
    assert np.sort(raw.mean(axis=1)) == pytest.approx(ref, abs=0.03)
    assert np.array_equal(np.bincount(y_pub, minlength=10), np.bincount(arrays.y_public, minlength=10))
    # without a folder the images go to a temporary one: the same records, no folders kept
    again = split_data(sc)
    assert again.folders is None and np.array_equal(np.sort(again.x_test, axis=0), np.sort(data.x_test, axis=0))


def test_an_image_sites_iterate_reads_its_folder():
    from pathlib import Path as P

    from scenarios.iterate_sites import iterate_round_toml

    sc = load_scenario(bundled_path("images.toml"))
    text = iterate_round_toml(sc, P("/r/roster.toml"), P("/out/images/clinic-a"))
    assert 'records = "/out/images/clinic-a"' in text
    assert 'records = "records.npz"' in iterate_round_toml(sc, P("/r/roster.toml"))


# ---------------------------------------------------------------------------------- own network

FACTORY = "scenarios.networks:residual_gn_cnn"
#: IMAGES with every site's own network (the bundled residual GroupNorm CNN) instead of the
#: built-in CNN, a `merged` round of DP-SGD pools and a short iterate run
OWN = (
    IMAGES.replace('kind = "cnn"\nchannels = [4]\npool = [2]\nhidden = [8]', f'factory = "{FACTORY}"', 1)
    .replace("image_size = 12", "image_size = 28", 1)
    .replace("epochs = 20", "epochs = 3", 1)
    .replace(
        'methods = ["ldp"]', 'methods = ["merged"]\nmerge_method = "rs"\nmerge_epsilon = 4.0\nmerge_delta = 1e-5', 1
    )
    .replace("call_timeout_s = 30.0", "call_timeout_s = 60.0\nselect_alphas = [0.5]\nfinetune_epochs = 1", 1)
    + """
[pool]
noise_multipliers = [4.0, 8.0]
steps = 3
learning_rate = 2.0
clip_norm = 0.5
declared_records = 300
delta = 1e-5

[policy]
model_epsilon = 5000.0
model_epsilon_per_peer = 1700.0
model_delta = 1e-3
data_epsilon = 20.0
data_delta = 1e-4

[iterate]
rounds = 2
local_steps = 1
learning_rate = 2.0
clip_norm = 0.5
epsilon = 4.0
delta = 1e-5
declared_records = 300
init_seed = 3
baseline_seeds = [0]

[central_dpsgd]
steps = 5
sample_rate = 1.0
learning_rate = 1.0
clip_norm = 1.0
"""
)


def test_a_factory_network_is_traced_at_the_images_shape():
    from scenarios.networks import residual_gn_cnn
    from scenarios.world import split_data

    sc = parse_scenario(OWN, "own.toml")
    assert sc.model.factory == FACTORY
    data = split_data(sc)
    net = data.network
    assert net.is_own and data.architecture == net.architecture and data.architecture["kind"] == "imported"
    assert list(net.structure.input_shape) == [1, 28, 28]
    assert net.parameters == sum(p.numel() for p in residual_gn_cnn().parameters())
    # same seed, same module; the adapter's built-in side is the built-in architecture's
    a, b = net.build(5).state_dict(), net.build(5).state_dict()
    assert all((a[k] == b[k]).all() for k in a)
    builtin = split_data(parse_scenario(IMAGES, "images.toml")).network
    assert not builtin.is_own and builtin.architecture["kind"] == "cnn"


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        # the factory's network replaces every key of a built-in architecture
        (OWN.replace(f'factory = "{FACTORY}"', f'factory = "{FACTORY}"\nkind = "cnn"'), "model.kind", 'kind = "cnn"'),
        (OWN.replace(f'factory = "{FACTORY}"', f'factory = "{FACTORY}"\nhidden = [8]'), "model.hidden", "hidden"),
        (OWN.replace(f'factory = "{FACTORY}"', f'factory = "{FACTORY}"\npool = [2]'), "model.pool", "pool = [2]"),
        # images only
        (
            _replace("hidden = [8]", f'factory = "{FACTORY}"'),
            "model.factory",
            "factory =",
        ),
        (OWN.replace(FACTORY, "scenarios.networks"), "model.factory", "factory ="),
        (OWN.replace(FACTORY, "scenarios.networks:nothing"), "model.factory", "factory ="),
        (OWN.replace(FACTORY, "no_such_module_here:f"), "model.factory", "factory ="),
        # its input shape is not the images' (the bundled network takes 28x28)
        (OWN.replace("image_size = 28", "image_size = 12"), "model.factory", "factory ="),
        # not one logit per digit class / not traceable
        (OWN.replace(FACTORY, "torch.nn:Flatten"), "model.factory", "factory ="),
        (OWN.replace(f'factory = "{FACTORY}"', "factory = 3"), "model.factory", "factory ="),
    ],
)
def test_a_bad_factory_is_refused_with_its_key_and_line(text, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_scenario(text, "bad.toml")
    assert e.value.key == key
    assert e.value.line == _line_of(text, fragment)


@pytest.mark.slow
def test_own_network_simulation_end_to_end(tmp_path):
    """Every row on the sites' own network: own models in their own-model stores (as `model
    import` stores them, with the images' preprocessing), a `merged` round fused through the
    own-network path, iterate finished with every segment charged, and the baselines."""
    from peer.nn.imported import load_imported
    from scenarios.report import summary_table
    from scenarios.simulate import Progress, simulate

    out = tmp_path / "run"
    report = simulate(parse_scenario(OWN, "own.toml"), out, Progress(lambda _: None))
    assert report["round_exit_codes"] == {n: 0 for n in report["sites"]}
    for name, s in report["sites"].items():
        site = out / "sites" / name
        own = load_imported(site / "own_models", "mlp")
        assert own.factory == FACTORY and list(own.structure.input_shape) == [1, 28, 28]
        assert own.preprocessing is not None and own.preprocessing.to_dict()["kind"] == "images"
        assert not any((site / "models").iterdir())  # no built-in model at all
        pool = json.loads((site / "pool" / "dpsgd-sigma4.json").read_text())
        assert pool["imported"]["factory"] == FACTORY
        r = s["rounds"]["merged"]
        assert r["status"] == "fused", r
        assert sorted(r["contributors"]) == sorted(n for n in report["sites"] if n != name)
        assert set(r["methods"].values()) == {"merged"}
        fused = [p.stem for p in (site / "own_models").glob("mlp-fused-*.json")]
        assert len(fused) == 1 and load_imported(site / "own_models", fused[0]).factory == FACTORY
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= s["own_accuracy"] <= 1.0
        assert 0.0 <= s["oracle"]["accuracy"] <= 1.0
        it = s["iterate"]
        assert it["status"] == "finished" and it["rounds_done"] == 2
        assert it["ledger"]["charges"] == 2  # every segment charged, one a round
        assert it["epsilon_filter"] <= 4.0 + 1e-9
        assert sorted(p.stem for p in (site / "iterate" / "own_models").glob("iterate-r*.json")) == [
            "iterate-r1",
            "iterate-r2",
        ]
    check_report_against_ledgers(out, report)
    b = report["baselines"]
    assert set(b) == {"central_pooled", "central_dpsgd", "dp_fedavg"}
    assert set(b["dp_fedavg"]["calibrations"]) == {"filter", "rdp"}
    assert 0.0 <= b["central_pooled"]["accuracy_mean"] <= 1.0
    assert "central pooled" in summary_table(report)
    assert "multi-round peer-to-peer" in (out / "report.md").read_text()
