"""Coordinator-free fusion rounds: the pure bookkeeping, and rounds against real daemons on
loopback (mutual TLS, pinned certificates, SQLite ledgers), including peers that are down, die
mid-round or refuse, quorum aborts, concurrent rounds at every site, and no double charges."""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest
import torch
from peer_harness import DaemonProcess, make_site, pin_each_other, running

from coordinator_free.roster import Roster, write_roster
from coordinator_free.rounds import RoundConfig, RoundState, charged_status, fusion_weights, public_view
from coordinator_free.runner import load_local_site, load_round_config, run_round
from peer.base.config import ConfigError, Section, key_line, parse_toml
from peer.base.errors import FailedPrecondition
from peer.budget.ledger import Ledger
from peer.ldp.fusion import permute_arrays
from peer.nn.architectures import model_from_arrays, state_arrays, train_classifier
from peer.nn.data import load_dataset
from peer.nn.graph import extract_graph
from peer.nn.store import load_model

ARCH = {"kind": "mlp", "input_dim": 64, "hidden": [16], "output_dim": 10, "activation": "relu"}
CLIP = (0.0, 8.0)


def policy(per_peer: float = 5000.0, total: float = 20000.0) -> str:
    return f"""
[policy]
show_remaining = "own"

[policy.model]
total = {{ epsilon = {total}, delta = 1e-3 }}
per_counterparty = {{ epsilon = {per_peer}, delta = 1e-3 }}

[policy.peers."*"]
allow = ["features", "weights", "merge", "ledger"]
"""


@pytest.fixture(scope="module")
def trained():
    """A digits MLP (16 hidden units) and a public probe set: structured activations, so that
    matching at a high ε recovers a known permutation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = load_dataset("digits", seed=0)
        model = train_classifier(ARCH, ds.x_train[:400], ds.y_train[:400], seed=0, epochs=20)
    finally:
        torch.set_num_threads(threads)
    return state_arrays(model), np.ascontiguousarray(ds.x_test[:30]), ds


def build(root, trained, names, perms=None, policies=None):
    """Sites whose models are the trained model re-indexed by known permutations (site i's node
    k is the base model's node perms[i][k]); everyone pins everyone."""
    base, probe, _ = trained
    rng = np.random.default_rng(1)
    sites, truth = [], {}
    for i, name in enumerate(names):
        p = np.arange(16) if i == 0 else (perms or {}).get(name, rng.permutation(16))
        truth[name] = p
        arrays = permute_arrays(ARCH, base, [p])
        sites.append(
            make_site(
                root,
                name,
                models={"mlp": (ARCH, arrays)},
                probe=probe,
                seed=100 + i,
                policy=(policies or {}).get(name, policy()),
                activation_clip=CLIP,
            )
        )
    pin_each_other(*sites)
    return sites, truth


def roster_for(root, sites, addresses) -> Roster:
    path = write_roster(
        root / "roster.toml", [(s.name, addresses[s.name], str(s.identity_dir / "site.crt")) for s in sites]
    )
    return Roster.load(path)


def config(root, **kw) -> RoundConfig:
    base = dict(
        roster=root / "roster.toml",
        model="mlp",
        activation_epsilon=500.0,
        weight_epsilon=500.0,
        weights_epsilon=200.0,
        weights_delta=1e-5,
        activation_clip=CLIP,
        out=root / "out",
        health_timeout_s=2.0,
        call_timeout_s=60.0,
    )
    base.update(kw)
    return RoundConfig(**base)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ledger_entries(site, counterparty=None):
    with Ledger(site.ledger) as ledger:  # read-only; verified at open (hash chain, totals)
        return ledger.entries(counterparty=counterparty)


def charges_of(report, peer):
    return [c for c in report["charges"] if c["peer"] == peer]


def assert_ledger_matches_report(site, requester, reports):
    """The peer's ledger holds exactly the releases the requester's reports list (by id)."""
    in_ledger = sorted(e.release_id for e in ledger_entries(site, requester))
    reported = sorted(c["release_id"] for r in reports for c in charges_of(r, site.name))
    assert in_ledger == reported
    assert len(set(in_ledger)) == len(in_ledger)


# ---------------------------------------------------------------------------------- pure parts


def test_fusion_weights_keep_alpha_and_share_the_rest():
    assert fusion_weights(0.5, 0) == [1.0]
    assert fusion_weights(0.5, 2) == [0.5, 0.25, 0.25]
    w = fusion_weights(0.3, 3)
    assert w[0] == 0.3 and np.isclose(sum(w), 1.0) and len(set(w[1:])) == 1
    with pytest.raises(ValueError):
        fusion_weights(1.5, 2)


@pytest.mark.parametrize(
    "status,seen,connected,expected",
    [
        ("UNAVAILABLE", True, True, "yes"),  # the receipt arrived: the peer charged
        ("RESOURCE_EXHAUSTED", False, True, "no"),  # refused before charging
        ("PERMISSION_DENIED", False, True, "no"),
        ("UNAVAILABLE", False, False, "no"),  # never connected
        ("UNAVAILABLE", False, True, "unknown"),  # connection broke: it may have charged
        ("DEADLINE_EXCEEDED", False, True, "unknown"),
        ("INTERNAL", False, True, "unknown"),
    ],
)
def test_charged_status(status, seen, connected, expected):
    assert charged_status(status, seen, connected) == expected


def test_failure_reasons_say_what_happened_to_the_connection():
    from coordinator_free.rounds import failure_reason

    assert failure_reason("UNAVAILABLE", "m", "Connection refused", False, 5).startswith("could not connect")
    assert "connection broke during the call" in failure_reason("UNAVAILABLE", "m", "Socket closed", True, 5)
    assert failure_reason("DEADLINE_EXCEEDED", "m", "Deadline Exceeded", True, 5).startswith("no answer within 5s")
    assert failure_reason("RESOURCE_EXHAUSTED", "budget exhausted: ...", "", True, 5) == "budget exhausted: ..."


def test_round_state_stops_asking_once_the_quorum_is_out_of_reach():
    events = []
    st = RoundState("r", "a", [("b", "x:1"), ("c", "x:2")], quorum=3, on_event=events.append)
    assert st.begin("b", "features") and st.begin("c", "features")
    st.drop("c", "features", "UNAVAILABLE", "gone", "unknown")
    assert not st.quorum_reachable()
    assert not st.begin("b", "weights")
    assert st.peers["b"].state == "not-asked"
    assert [e["event"] for e in events][-2:] == ["dropped", "not-asked"]
    # local steps (align) are not budget: they are never refused
    st2 = RoundState("r", "a", [("b", "x:1")], quorum=3)
    assert st2.begin("b", "align")


def test_public_view_clips_own_features_to_the_public_bounds(trained):
    base, probe, _ = trained
    g = extract_graph(ARCH, model_from_arrays(ARCH, base), probe)
    boxes = {"0": (-0.1, 0.1), "2": (-0.2, 0.2)}
    v = public_view(g, (0.0, 1.0), boxes)
    assert v.hidden[0].activations.max() <= 1.0 and g.hidden[0].activations.max() > 1.0
    assert np.abs(v.hidden[0].incoming).max() <= 0.1 and np.abs(v.output_incoming).max() <= 0.2
    inside = (g.hidden[0].activations >= 0) & (g.hidden[0].activations <= 1)
    assert np.array_equal(v.hidden[0].activations[inside], g.hidden[0].activations[inside])


# ---------------------------------------------------------------------------------- config files


TOML = """# a comment
[round]
model = "mlp"
alpha = 0.5

[round.features]
activation_epsilon = 1.0
weights = { a = 1, b = 2 }

[[round.extra]]
x = 1
[[round.extra]]
x = 2
"quoted key" = 3
"""


@pytest.mark.parametrize(
    "key,line",
    [
        (("round",), 2),
        (("round", "alpha"), 4),
        (("round", "features", "activation_epsilon"), 7),
        (("round", "features", "weights", "b"), 8),  # inside an inline table: the table's line
        (("round", "extra", 1, "x"), 13),
        (("round", "extra", 1, "quoted key"), 14),
        (("round", "extra", 0), 10),
        (("nowhere",), None),
    ],
)
def test_key_line_follows_tables_arrays_and_inline_tables(key, line):
    assert key_line(TOML, key) == line


def test_round_config_errors_name_key_and_line(tmp_path):
    text = '[round]\nroster = "r.toml"\nmodel = "mlp"\n\n[round.weights]\nepsilon = 2.0\ndelta = 0.5\n'
    with pytest.raises(ConfigError) as e:
        RoundConfig.from_section(
            Section(parse_toml(text, "x.toml", "round"), (), text, "x.toml").section("round"), tmp_path
        )
    assert e.value.key == "round.weights.delta" and e.value.line == 7
    assert "line 7" in str(e.value) and "x.toml" in str(e.value)
    text = '[round]\nroster = "r.toml"\nmodel = "mlp"\nmethod = "magic"\n'
    with pytest.raises(ConfigError, match=r"round.method \(x.toml, line 4\): must be one of"):
        RoundConfig.from_section(
            Section(parse_toml(text, "x.toml", "round"), (), text, "x.toml").section("round"), tmp_path
        )
    with pytest.raises(ConfigError, match=r"line 2"):
        parse_toml("[round]\nmodel = = 1\n", "x.toml", "round")


def test_roster_errors_and_pins(tmp_path, trained):
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, b = sites
    path = tmp_path / "roster.toml"
    path.write_text(
        f'[sites.hospital-a]\naddress = "127.0.0.1:1"\ncertificate = "{a.identity_dir}/site.crt"\n\n'
        f'[sites.hospital-b]\naddress = "127.0.0.1"\ncertificate = "{b.identity_dir}/site.crt"\n'
    )
    with pytest.raises(ConfigError) as e:
        Roster.load(path)
    assert e.value.key == "sites.hospital-b.address" and e.value.line == 6
    path.write_text(f'[sites.hospital-b]\naddress = "127.0.0.1:2"\ncertificate = "{a.identity_dir}/site.crt"\n')
    with pytest.raises(ConfigError, match="certificate of 'hospital-a', not 'hospital-b'"):
        Roster.load(path)
    roster = roster_for(tmp_path, sites, {"hospital-a": "127.0.0.1:1", "hospital-b": "127.0.0.1:2"})
    roster.check_pins(_trust(a), "hospital-a")
    _trust(a).remove("hospital-b")
    with pytest.raises(FailedPrecondition, match="'hospital-b' is not pinned"):
        roster.check_pins(_trust(a), "hospital-a")
    assert [p.name for p in roster.pin_all(_trust(a), "hospital-a")] == ["hospital-b"]
    roster.check_pins(_trust(a), "hospital-a")


def _trust(site):
    from peer.net.trust import TrustStore

    return TrustStore(site.identity_dir / "trusted")


# ---------------------------------------------------------------------------------- real daemons


def test_three_site_round_aligns_fuses_and_charges_each_release_once(tmp_path, trained):
    sites, truth = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster = roster_for(tmp_path, sites, addresses)
        local = load_local_site(a.config, "mlp")
        events = []
        first = run_round(local, roster, config(tmp_path), on_event=events.append)
        second = run_round(local, roster, config(tmp_path, label="again"))
    r = first.report
    assert first.status == "fused", first.reason
    assert sorted(r["contributors"]) == ["hospital-b", "hospital-c"]
    assert r["weights"] == {"hospital-a": 0.5, "hospital-b": 0.25, "hospital-c": 0.25}
    assert "weights_signal" not in r  # at ε 200 per neuron every weight tensor can carry signal
    # alignment: the recovered permutation is the one the peer's model was built with
    # (perm[i] = j: our node i is their node j; their node j is the base model's node truth[j]).
    # Chance agreement is 1/16; the peers' noise is seeded, so this is deterministic.
    for name in ("hospital-b", "hospital-c"):
        perm = np.asarray(r["peers"][name]["match"]["permutations"]["0"])
        assert np.mean(truth[name][perm] == np.arange(16)) >= 0.5, name
    # two charged releases per peer per round, each in the peer's ledger exactly once
    for peer in (b, c):
        assert [ch["step"] for ch in charges_of(r, peer.name)] == ["features", "weights"]
        assert all(ch["delivered"] for ch in charges_of(r, peer.name))
        assert_ledger_matches_report(peer, "hospital-a", [first.report, second.report])
        assert len(ledger_entries(peer, "hospital-a")) == 4
    assert ledger_entries(a) == []  # the requester's own model never left it
    stored = load_model(tmp_path / "out" / "models", first.model_name)
    assert all(np.array_equal(stored.arrays[k], first.arrays[k]) for k in first.arrays)
    assert first.report_path.exists() and second.status == "fused"
    assert {e["event"] for e in events} >= {"started", "alive", "charged", "received", "contributed", "fused"}


def test_rounds_run_at_every_site_at_once(tmp_path, trained):
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster = roster_for(tmp_path, sites, addresses)
        results = {}

        def go(site):
            results[site.name] = run_round(
                load_local_site(site.config, "mlp"), roster, config(tmp_path, out=tmp_path / f"out-{site.name}")
            )

        threads = [threading.Thread(target=go, args=(s,)) for s in sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert {n: r.status for n, r in results.items()} == {s.name: "fused" for s in sites}
    for s in sites:
        # every other site asked s for features and weights, once each
        assert len(ledger_entries(s)) == 4
        for requester in sites:
            if requester is not s:
                assert_ledger_matches_report(s, requester.name, [results[requester.name].report])


def round_with_a_dead_peer(tmp_path, trained, quorum: int):
    """hospital-a's round over b and d, whose daemon is not running (nothing listens there)."""
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-d"])
    a, b, _d = sites
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_for(
            tmp_path, sites, {"hospital-a": addr_a, "hospital-b": addr_b, "hospital-d": f"127.0.0.1:{free_port()}"}
        )
        result = run_round(
            load_local_site(a.config, "mlp"), roster, config(tmp_path, quorum=quorum, health_timeout_s=1.0)
        )
    return result, b


def test_a_dead_peer_is_dropped_at_the_health_check(tmp_path, trained):
    result, _ = round_with_a_dead_peer(tmp_path, trained, quorum=2)
    assert result.status == "fused" and result.report["contributors"] == ["hospital-b"]
    dead = result.report["peers"]["hospital-d"]
    assert dead["state"] == "not-alive" and dead["drop"]["step"] == "health" and dead["charges"] == []
    assert "no health answer" in dead["drop"]["reason"]
    assert result.report["weights"] == {"hospital-a": 0.5, "hospital-b": 0.5}


def test_quorum_abort_before_anything_is_requested(tmp_path, trained):
    result, b = round_with_a_dead_peer(tmp_path, trained, quorum=3)
    assert result.status == "aborted" and "quorum 3" in result.reason and "nothing was requested" in result.reason
    assert result.arrays is None and result.model_name is None and result.report_path.exists()
    assert ledger_entries(b) == []


def kill_after(proc: DaemonProcess, peer: str, step: str, event: str = "received"):
    """An on_event hook that SIGKILLs ``peer``'s daemon process at a scripted point."""

    def hook(e):
        if e["event"] == event and e.get("peer") == peer and e.get("step") == step and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()

    return hook


def round_losing_a_peer(tmp_path, trained, quorum: int):
    """hospital-a's round over b (in-process) and c (its own process, SIGKILLed once its
    features have arrived at a); returns the result and the sites."""
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    victim = DaemonProcess(c)
    try:
        addr_c = victim.wait_ready()
        with running(a) as (_, addr_a), running(b) as (_, addr_b):
            roster = roster_for(tmp_path, sites, {"hospital-a": addr_a, "hospital-b": addr_b, "hospital-c": addr_c})
            result = run_round(
                load_local_site(a.config, "mlp"),
                roster,
                config(tmp_path, quorum=quorum, call_timeout_s=20.0),
                on_event=kill_after(victim, "hospital-c", "features"),
            )
    finally:
        victim.close()
    return result, sites


def test_a_peer_killed_mid_round_is_dropped_and_its_release_stays_charged(tmp_path, trained):
    result, (_a, b, c) = round_losing_a_peer(tmp_path, trained, quorum=2)
    r = result.report
    assert result.status == "fused" and r["contributors"] == ["hospital-b"]
    dropped = r["peers"]["hospital-c"]
    assert dropped["state"] == "dropped" and dropped["drop"]["step"] == "weights"
    assert dropped["drop"]["status"] == "UNAVAILABLE" and dropped["drop"]["charged"] in ("no", "unknown")
    assert dropped["drop"]["reason"].startswith(("could not connect", "the connection broke"))
    assert dropped["drop"]["at"] >= r["started_at"]
    # the features it released before dying stay charged, in its ledger file and in the report
    assert [ch["step"] for ch in charges_of(r, "hospital-c")] == ["features"]
    assert_ledger_matches_report(c, "hospital-a", [r])
    assert_ledger_matches_report(b, "hospital-a", [r])


def test_quorum_lost_mid_round_aborts_and_keeps_what_was_charged(tmp_path, trained):
    result, (_a, b, c) = round_losing_a_peer(tmp_path, trained, quorum=3)
    assert result.status == "aborted" and "quorum 3" in result.reason
    assert result.arrays is None and not (tmp_path / "out" / "models").exists()
    # b may have released features (and weights, if it got there first); whatever it released
    # is in its ledger and in the report, once
    assert_ledger_matches_report(b, "hospital-a", [result.report])
    assert_ledger_matches_report(c, "hospital-a", [result.report])


def test_a_refusal_drops_the_peer_and_the_earlier_release_stays_charged(tmp_path, trained):
    # hospital-b's budget for each counterparty fits the features (ε = 1000 per neuron, pure)
    # but not the weights on top of them
    sites, _ = build(
        tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"], policies={"hospital-b": policy(per_peer=1050.0)}
    )
    a, b, _c = sites
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        result = run_round(load_local_site(a.config, "mlp"), roster_for(tmp_path, sites, addresses), config(tmp_path))
    r = result.report
    assert result.status == "fused" and r["contributors"] == ["hospital-c"]
    drop = r["peers"]["hospital-b"]["drop"]
    assert (drop["step"], drop["status"], drop["charged"]) == ("weights", "RESOURCE_EXHAUSTED", "no")
    assert [ch["step"] for ch in charges_of(r, "hospital-b")] == ["features"]
    assert_ledger_matches_report(b, "hospital-a", [r])


def test_round_command_runs_from_site_toml(tmp_path, trained, capsys):
    from peer.cli import main

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, b = sites
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster_for(tmp_path, sites, {"hospital-a": addr_a, "hospital-b": addr_b})
        a.config.write_text(
            a.config.read_text()
            + f"""
[round]
roster = "{tmp_path / "roster.toml"}"
model = "mlp"
out = "rounds"
[round.features]
activation_epsilon = 50.0
weight_epsilon = 50.0
[round.weights]
epsilon = 20.0
go_on_without_signal = true
"""
        )
        assert load_round_config(a.config).activation_clip is None  # the site's default applies at run time
        code = main(["round", "--config", str(a.config)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "fused" in out.out and "hospital-b: features released" in out.err
    assert len(list((a.root / "rounds").glob("round-*.json"))) == 1
    assert len(ledger_entries(b, "hospital-a")) == 2


def test_the_round_command_on_a_terminal_counts_the_peers_that_answered(tmp_path, trained):
    """``privfusion round`` with stderr on a terminal: a bar of the roster's peers that have
    answered (contributed, dropped, ...), with the time left, the event lines above it; the
    releases are made in the peers' daemons, the bar is this process's waiting for them."""
    import re

    from peer_harness import cli_on_terminal

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster_for(tmp_path, sites, addresses)
        a.config.write_text(
            a.config.read_text()
            + f"""
[round]
roster = "{tmp_path / "roster.toml"}"
model = "mlp"
label = "shown"
out = "rounds"
[round.features]
activation_epsilon = 50.0
weight_epsilon = 50.0
[round.weights]
epsilon = 20.0
go_on_without_signal = true
"""
        )
        run = cli_on_terminal("round", "--config", str(a.config))
    assert run.returncode == 0, run.terminal
    frame = r"round shown: +\d+%\|[^|]*\| (\d)/2 peers \[\d\d:\d\d elapsed, (?:\d\d:\d\d|\?) left\]"
    counts = [int(n) for n in re.findall(frame, run.terminal)]  # the bar is redrawn under every line
    assert counts == sorted(counts) and set(counts) == {0, 1, 2}, run.terminal
    # each event line whole, after the bar is cleared and before it is drawn again
    assert re.search(r"\r {20,}\r\[hospital-a\] hospital-b: features released [^\r]*\r\n", run.terminal), run.terminal
    assert "round shown" not in run.stdout and "fused" in run.stdout
    for peer in (b, c):
        assert len(ledger_entries(peer, "hospital-a")) == 2


# ---------------------------------------------------------------------------------- merges


def add_pool(site, trained, data_epsilon: float) -> None:
    """A small DP-SGD pool of the site's architecture, judged on a public validation file."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.pools import save_trained
    from peer.dp.training import train_pool

    _, _probe, ds = trained
    trainings = [TrainingRecord.constant("add-remove", 10, 1.0, 1.0, nm, 1.0) for nm in (3.0, 6.0)]
    for i, m in enumerate(
        train_pool(
            ARCH,
            ds.x_train[400:500],
            ds.y_train[400:500],
            trainings,
            init_seed=5,
            randomness=make_randomness(),  # CSPRNG: a fixed-seed pool is served by --simulation daemons only
            delta=1e-5,
            dataset_size=100,  # declared: the public n under add-remove
        )
    ):
        save_trained(site.root / "pool", f"m{i}", m)
    np.savez(site.root / "validation.npz", x=ds.x_test[30:130], y=ds.y_test[30:130])
    text = (
        site.config.read_text()
        .replace(
            "[policy]\n",
            """[site.pools.dp]
models = "pool"
validation = "validation.npz"

[policy]
""",
            1,
        )
        .replace(
            "[policy.model]\n",
            f"""[policy.data]
unit = "record:add-remove"
epsilon = {data_epsilon}
delta = 1e-4

[policy.model]
""",
            1,
        )
    )
    site.config.write_text(text)


def round_with_a_pool(tmp_path, trained, method: str, data_epsilon: float):
    """hospital-a's round (``method``) with hospital-b, which offers a DP-SGD pool."""
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, b = sites
    add_pool(b, trained, data_epsilon=data_epsilon)
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_for(tmp_path, sites, {"hospital-a": addr_a, "hospital-b": addr_b})
        result = run_round(
            load_local_site(a.config, "mlp"),
            roster,
            config(tmp_path, method=method, merge_epsilon=4.0, merge_delta=1e-5),
        )
    return result, b


def test_a_peer_answers_with_a_merge_and_the_requester_aligns_it_locally(tmp_path, trained):
    result, b = round_with_a_pool(tmp_path, trained, "merged", data_epsilon=20.0)
    r = result.report
    assert result.status == "fused", result.reason
    peer = r["peers"]["hospital-b"]
    assert peer["method"] == "merged" and peer["pool"] == "dp" and peer["match"]["permutations"]["0"]
    [charge] = charges_of(r, "hospital-b")
    assert (charge["step"], charge["mechanism"], charge["level"]) == ("merged", "rs-merge", "data")
    assert charge["epsilon"] <= 4.0 + 1e-9
    assert_ledger_matches_report(b, "hospital-a", [r])


def test_a_second_round_gets_the_same_merge_served_again_without_a_charge(tmp_path, trained):
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, b = sites
    add_pool(b, trained, data_epsilon=20.0)
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_for(tmp_path, sites, {"hospital-a": addr_a, "hospital-b": addr_b})
        cfg = config(tmp_path, method="merged", merge_epsilon=4.0, merge_delta=1e-5)
        first, second = (run_round(load_local_site(a.config, "mlp"), roster, cfg) for _ in range(2))
    assert first.status == second.status == "fused", (first.reason, second.reason)
    assert first.report["releases"] == {"made": 1, "served_again": 0}
    assert second.report["releases"] == {"made": 0, "served_again": 1}
    [made], [again] = charges_of(first.report, "hospital-b"), charges_of(second.report, "hospital-b")
    assert again["served_again"] and not made["served_again"]
    assert (again["entry_id"], again["release_id"]) == (made["entry_id"], made["release_id"])
    assert any(e["event"] == "served-again" for e in second.report["events"])
    # one charge in the peer's ledger for both rounds, and one served-again row naming it
    assert [e.release_id for e in ledger_entries(b, "hospital-a")] == [made["release_id"]]
    with Ledger(b.ledger) as led:
        assert [s["entry_id"] for s in led.served_again()] == [int(made["entry_id"])]


def test_auto_falls_back_to_features_and_weights_only_when_the_merge_was_not_charged(tmp_path, trained):
    # a data budget of 0.5 fits no merge at ε′ = 4: refused before any charge
    result, b = round_with_a_pool(tmp_path, trained, "auto", data_epsilon=0.5)
    r = result.report
    assert result.status == "fused", result.reason
    peer = r["peers"]["hospital-b"]
    assert peer["method"] == "ldp" and any("falling back" in n for n in peer["notes"])
    assert [c["step"] for c in charges_of(r, "hospital-b")] == ["features", "weights"]
    assert_ledger_matches_report(b, "hospital-a", [r])
    assert all(e.level == "model" for e in ledger_entries(b))


# ---------------------------------------------------------------------------------- config checks and interruption


def test_a_quorum_larger_than_the_roster_is_refused_when_the_config_is_read(tmp_path, trained, capsys):
    from peer.cli import main

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, _b = sites
    roster_for(tmp_path, sites, {"hospital-a": "127.0.0.1:1", "hospital-b": "127.0.0.1:2"})
    path = tmp_path / "r.toml"
    path.write_text(f'[round]\nroster = "{tmp_path / "roster.toml"}"\nmodel = "mlp"\nquorum = 3\n')
    with pytest.raises(ConfigError) as e:
        load_round_config(path, site="hospital-a")
    assert e.value.key == "round.quorum" and e.value.line == 4
    assert "has only 2 sites" in str(e.value)
    # the command refuses it before any health check (nothing listens at those addresses)
    assert main(["round", "--config", str(a.config), "--round", str(path)]) == 2
    err = capsys.readouterr().err
    assert "round.quorum" in err and "line 4" in err and "could never fuse" in err
    path.write_text(path.read_text().replace("quorum = 3", "quorum = 2"))
    assert load_round_config(path, site="hospital-a").quorum == 2


def test_an_interrupted_round_writes_its_report_with_every_receipt(tmp_path, trained):
    """SIGINT to `privfusion round` while a peer is in the middle of the round: it stops asking,
    waits for the call in flight, and its report lists exactly the releases the peers charged."""
    import json
    import os
    import signal
    import subprocess
    import sys

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    daemons = {s.name: DaemonProcess(s) for s in (b, c)}
    try:
        addresses = {n: d.wait_ready() for n, d in daemons.items()}
        roster_for(tmp_path, sites, {"hospital-a": "127.0.0.1:1", **addresses})
        a.config.write_text(
            a.config.read_text()
            + f"""
[round]
roster = "{tmp_path / "roster.toml"}"
model = "mlp"
quorum = 2
out = "rounds"
call_timeout_s = 120.0
[round.features]
activation_epsilon = 50.0
weight_epsilon = 50.0
[round.weights]
epsilon = 20.0
go_on_without_signal = true
"""
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", "round", "--config", str(a.config), "--events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        stopped = False
        try:
            for line in proc.stdout:
                e = json.loads(line)
                if e["event"] == "step" and e.get("peer") == "hospital-c" and e.get("step") == "info" and not stopped:
                    os.kill(daemons["hospital-c"].proc.pid, signal.SIGSTOP)  # hospital-c hangs mid-round
                    stopped = True
                if e["event"] == "contributed" and e.get("peer") == "hospital-b":
                    break
            assert stopped
            proc.send_signal(signal.SIGINT)
            os.kill(daemons["hospital-c"].proc.pid, signal.SIGCONT)  # the call in flight can finish
            _out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            os.kill(daemons["hospital-c"].proc.pid, signal.SIGCONT)
        assert proc.returncode == 130, err
        assert "interrupted; report" in err and "hospital-b (yes)" in err, err
        [path] = list((a.root / "rounds").glob("round-*.json"))
        assert str(path) in err
        report = json.loads(path.read_text())
    finally:
        for d in daemons.values():
            d.close()
    assert report["status"] == "interrupted" and "interrupted" in report["reason"]
    assert "fused_model" not in report and not list((a.root / "rounds").glob("models/*"))
    assert report["may_have_charged"]["hospital-b"] == "yes"
    assert_ledger_matches_report(b, "hospital-a", [report])
    assert_ledger_matches_report(c, "hospital-a", [report])
    assert len(charges_of(report, "hospital-b")) == 2
    # hospital-c was stopped before its weights could be asked for: never requested after the signal
    assert len(ledger_entries(c, "hospital-a")) <= 1
    expected = "yes" if charges_of(report, "hospital-c") else "no"
    assert report["may_have_charged"]["hospital-c"] == expected
    assert report["peers"]["hospital-c"]["state"] in ("not-asked", "pending")


# ---------------------------------------------------------------------------------- a named round, killed and rerun


def test_a_journal_refuses_a_rerun_whose_plan_differs_naming_each_change(tmp_path):
    from coordinator_free.round_journal import RoundJournal, round_plan
    from peer.net.trust import TrustStore

    trust = TrustStore(tmp_path / "trusted")
    probe = np.zeros((3, 4))
    cfg = config(tmp_path)
    plan = round_plan(cfg, ["hospital-b", "hospital-c"], probe)
    assert RoundJournal.open(tmp_path, "", "r0", plan, trust) is None  # an unnamed round keeps none
    first = RoundJournal.open(tmp_path, "monday", "r1", plan, trust)
    assert first.attempts == []
    again = RoundJournal.open(tmp_path, "monday", "r2", plan, trust)
    assert again.attempts == ["r1"] and again.directory == first.directory
    changed = round_plan(
        config(tmp_path, method="merged", weights_epsilon=10.0, model="other"), ["hospital-b"], probe + 1
    )
    with pytest.raises(FailedPrecondition) as e:
        RoundJournal.open(tmp_path, "monday", "r3", changed, trust)
    text = str(e.value)
    for what in (
        "method: 'auto' then, 'merged' now",
        "weights.epsilon: 200.0 then, 10.0 now",
        "model: 'mlp' then, 'other' now",
        "peers: ['hospital-b', 'hospital-c'] then, ['hospital-b'] now",
        "probe_sha256",
        "another label",
    ):
        assert what in text, text
    # refused: the journal still holds the two attempts with the first plan
    assert RoundJournal.open(tmp_path, "monday", "r4", plan, trust).attempts == ["r1", "r2"]
    RoundJournal.open(tmp_path, "tuesday", "r5", changed, trust).close()
    assert RoundJournal.open(tmp_path, "tuesday", "r6", plan, trust).attempts == []  # closed: a new round


def test_a_killed_named_round_rerun_reuses_what_was_charged_and_charges_nothing_twice(tmp_path, trained):
    """SIGKILL of ``privfusion round`` once hospital-b has contributed (both its releases
    charged and received) and hospital-c, its features received, is frozen as its weights are
    asked for. A rerun with another plan under the same label is refused before anything is
    asked, naming the change. The rerun with the same plan fuses: every release the killed
    attempt received whole is reused (checked again against the signers' pins, not asked for),
    hospital-c's weights — asked for, maybe charged (the peer may finish the call after the
    requester died), their bytes lost — are not bought a second time, and every peer's ledger
    holds each release charged once."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    daemons = {s.name: DaemonProcess(s) for s in (b, c)}
    try:
        addresses = {n: d.wait_ready() for n, d in daemons.items()}
        roster_for(tmp_path, sites, {"hospital-a": "127.0.0.1:1", **addresses})
        round_file = tmp_path / "monday.toml"
        plan = f"""
[round]
roster = "{tmp_path / "roster.toml"}"
model = "mlp"
label = "monday"
quorum = 2
out = "{a.root / "rounds"}"
call_timeout_s = 120.0
[round.features]
activation_epsilon = 50.0
weight_epsilon = 50.0
[round.weights]
epsilon = 20.0
go_on_without_signal = true
"""
        round_file.write_text(plan)
        command = [sys.executable, "-m", "peer.cli", "round", "--config", str(a.config), "--round", str(round_file)]
        proc = subprocess.Popen(
            [*command, "--events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        frozen = False
        seen = set()
        try:
            for line in proc.stdout:
                e = json.loads(line)
                seen.add((e["event"], e.get("peer"), e.get("step")))
                if ("step", "hospital-c", "weights") in seen and not frozen:
                    os.kill(daemons["hospital-c"].proc.pid, signal.SIGSTOP)  # hospital-c hangs in its weights
                    frozen = True
                if frozen and ("contributed", "hospital-b", None) in seen:
                    break
            time.sleep(0.5)  # the journal's "asked" mark is written right after the step event
            proc.kill()  # SIGKILL: no report, nothing cleaned up
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            os.kill(daemons["hospital-c"].proc.pid, signal.SIGCONT)
        assert frozen and proc.returncode == -signal.SIGKILL
        assert not list((a.root / "rounds").glob("round-*.json"))  # killed: no report
        time.sleep(2.0)  # hospital-c may finish (and charge) the weights call it was frozen in
        charged_before = {s.name: sorted(e.release_id for e in ledger_entries(s, "hospital-a")) for s in (b, c)}
        assert len(charged_before["hospital-b"]) == 2 and len(charged_before["hospital-c"]) in (1, 2)

        # another plan under the same label: refused before anything is asked, naming the change
        round_file.write_text(plan.replace("epsilon = 20.0", "epsilon = 10.0"))
        refused = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        assert refused.returncode != 0, refused.stderr
        assert "round 'monday'" in refused.stderr and "weights.epsilon: 20.0 then, 10.0 now" in refused.stderr
        assert {s.name: sorted(e.release_id for e in ledger_entries(s, "hospital-a")) for s in (b, c)} == (
            charged_before
        )

        # the same plan: the rerun fuses, reusing what the killed attempt received
        round_file.write_text(plan)
        rerun = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        assert rerun.returncode == 0, rerun.stderr
        assert "a rerun after attempts" in rerun.stderr and "reused from attempt" in rerun.stderr, rerun.stderr
        [path] = list((a.root / "rounds").glob("round-*.json"))
        report = json.loads(path.read_text())
    finally:
        for d in daemons.values():
            d.close()
    assert report["status"] == "fused" and len(report["attempts_before"]) == 1
    first = report["attempts_before"][0]
    assert report["round_id"] != first  # a report of its own
    by_step = {(ch["peer"], ch["step"]): ch for ch in report["charges"]}
    if ("contributed", "hospital-c", None) in seen:
        # hospital-c's weights reached the requester in the moment before SIGSTOP landed (a
        # scheduling race on a loaded machine): they were received whole, so they are reused too
        for key in (("hospital-b", "features"), ("hospital-b", "weights"), ("hospital-c", "features")):
            assert by_step[key]["reused_from"] == first, key
        assert by_step[("hospital-c", "weights")]["reused_from"] == first
        assert sorted(report["contributors"]) == ["hospital-b", "hospital-c"]
        assert report["releases"] == {"made": 0, "served_again": 0, "reused": 4}
    else:
        for key in (("hospital-b", "features"), ("hospital-b", "weights"), ("hospital-c", "features")):
            assert by_step[key]["reused_from"] == first, key
        drop = report["peers"]["hospital-c"]["drop"]
        assert drop["step"] == "weights" and drop["charged"] == "no", drop
        assert drop["status"] in ("CHARGED_BEFORE", "MAYBE_CHARGED_BEFORE") and "not bought twice" in drop["reason"]
        assert report["contributors"] == ["hospital-b"]
        assert report["releases"] == {"made": 0, "served_again": 0, "reused": 3}
    # nothing more was charged anywhere: each release once, in the killed attempt
    for peer in (b, c):
        entries = ledger_entries(peer, "hospital-a")
        assert sorted(e.release_id for e in entries) == charged_before[peer.name]
        assert len({e.release_id for e in entries}) == len(entries)
    assert not any((a.root / "rounds" / "journal").iterdir())  # fused: the journal is removed


def test_an_ldp_round_without_signal_is_refused_before_anything_is_asked(tmp_path, trained):
    """At ε 2 per neuron the 64-16-10 MLP's weights release is predicted constant
    (peer.ldp.mechanisms.signal): the round refuses before asking, and no ledger holds a charge;
    asked to go on, it runs and its report says what it was told."""
    from peer.base.errors import InvalidArgument

    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    low = dict(activation_epsilon=2.0, weight_epsilon=2.0, weights_epsilon=2.0)
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster = roster_for(tmp_path, sites, addresses)
        local = load_local_site(a.config, "mlp")
        with pytest.raises(InvalidArgument) as refused:
            run_round(local, roster, config(tmp_path, method="ldp", **low))
        assert refused.value.field == "round.weights.epsilon"
        message = str(refused.value)
        assert "nothing was requested" in message and "0.weight" in message and "go_on_without_signal" in message
        assert all(ledger_entries(s) == [] for s in sites)  # nothing asked of anyone: nothing charged
        auto = run_round(local, roster, config(tmp_path, label="auto", **low))  # the default method
        assert auto.status == "aborted"  # neither peer offers a pool: both dropped, nothing asked
        assert {p["drop"]["status"] for p in auto.report["peers"].values()} == {"FAILED_PRECONDITION"}
        assert all(ledger_entries(s) == [] for s in sites)
        went = run_round(
            local, roster, config(tmp_path, method="ldp", label="anyway", go_on_without_signal=True, **low)
        )
    assert went.status == "fused", went.reason
    signal = went.report["weights_signal"]
    assert signal["went_on"] is True and "0.weight" in signal["constant"] and signal["epsilon_needed"] > 2.0
    assert len(ledger_entries(b, "hospital-a")) == 2 and len(ledger_entries(c, "hospital-a")) == 2
