"""An iterate run that stops (killed, its daemon gone) and continues (coordinator_free.iterate's
``resume``): nothing charged twice, nothing spent lost, the report kept, the noise fresh; a run
name used once per site; a run whose own daemon does not serve stops before its next charge."""

from __future__ import annotations

import json

import numpy as np
import pytest
from peer_harness import make_site, model_arrays, pin_each_other, running
from test_iterate import ARCH, policy, round_file

from coordinator_free.iterate import describe, load_iterate_config, run_iterate
from coordinator_free.roster import write_roster
from peer.base.errors import FailedPrecondition
from peer.budget.dpsgd_noise import run_epsilon
from peer.budget.ledger import Ledger
from peer.net.releases import ReleaseStore, segment_key
from peer.nn.store import load_model


class Killed(Exception):
    """Stands for a SIGKILL at an event of the run (the run's own cleanup still runs: the
    subprocess test tests/test_iterate_crash.py kills for real)."""


def kill_at(event: str, round_number: int):
    def on_event(e: dict) -> None:
        if e["event"] == event and e.get("round") == round_number:
            raise Killed(f"{event} of round {round_number}")

    return on_event


def segments_charged(ledger) -> list[int]:
    with Ledger(ledger) as led:
        return sorted(e.record.parameters["segment"]["round"] for e in led.entries())


def alone_site(tmp_path, name="site-a", epsilon=4.0, seed=3):
    a = make_site(tmp_path, name, models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(epsilon), seed=seed)
    roster = write_roster(tmp_path / f"roster-{name}.toml", [(name, "127.0.0.1:1", str(a.identity_dir / "site.crt"))])
    return a, roster


def test_a_run_killed_after_a_charge_resumes_reusing_it_and_ends_as_an_uninterrupted_run(tmp_path):
    """Killed right after round 3's segment was charged (before it was fused): the report has
    rounds 1–2; a rerun without resume is refused; --resume reuses round 3's stored, charged
    segment (same entry, same bytes, no new charge), restores θ and ends with 5 segments charged
    once each — the ε of an uninterrupted 5-round run, computed by the accountant — and the
    report keeps the first session's rounds and lists both sessions (fresh noise seeds)."""
    a, roster = alone_site(tmp_path)
    cfg = load_iterate_config(round_file(a, roster, rounds=5))
    with pytest.raises(Killed):
        run_iterate(a.config, cfg, simulation=True, on_event=kill_at("segment", 3))
    report_path = a.root / "rounds" / "t1.json"
    first = json.loads(report_path.read_text())
    assert first["status"] == "running" and [x["round"] for x in first["rounds"]] == [1, 2]
    assert segments_charged(a.ledger) == [1, 2, 3]
    store = ReleaseStore(a.root / "ledger.releases")
    stored3 = store.get(segment_key("t1", 3))
    with Ledger(a.ledger) as led:
        entry3 = led.charge_of(stored3.record.release_id)[0].entry_id

    with pytest.raises(FailedPrecondition) as e:
        run_iterate(a.config, cfg, simulation=True)
    assert "--resume" in str(e.value) and "t1" in str(e.value) and "3 segments charged" in str(e.value)
    assert segments_charged(a.ledger) == [1, 2, 3]

    result = run_iterate(a.config, cfg, simulation=True, resume=True)
    assert result.status == "finished" and result.rounds_done == 5
    assert segments_charged(a.ledger) == [1, 2, 3, 4, 5]  # each once
    report = json.loads(report_path.read_text())
    # the first session's rounds, kept as written (the end adds what was served of them since)
    counted = ("bytes_sent", "served_to")
    assert [{k: v for k, v in x.items() if k not in counted} for x in report["rounds"][:2]] == first["rounds"]
    third = report["rounds"][2]
    assert third["segment"]["reused"] and third["segment"]["entry_id"] == str(entry3)
    assert not any(x["segment"]["reused"] for x in report["rounds"][3:])
    # alone, θ_3 is our segment 3: the stored bytes, not a retrained segment
    r3 = load_model(a.root / "rounds" / "models", "t1-r3").arrays
    assert all(np.array_equal(r3[k], v) for k, v in stored3.tensors)
    assert [s["first_round"] for s in report["sessions"]] == [1, 3]
    seeds = [s["randomness"]["seed"] for s in report["sessions"]]
    assert seeds == [3 + 2**31, 3 + 2**31 + 2**32]  # a simulation's resumed noise never replays the first's
    assert report["sessions"][1]["status"] == "finished" and report["sessions"][1]["rounds_done"] == 3
    with Ledger(a.ledger) as led:
        led.verify()
        orders = led.orders
    sigma = report["noise_multiplier"]
    uninterrupted = run_epsilon(sigma, 5 * 2, 1e-5, orders=orders)
    assert report["epsilon_filter_run"] == pytest.approx(uninterrupted, rel=1e-9)
    assert report["epsilon_pld"] == pytest.approx(run_epsilon(sigma, 10, 1e-5, figure="pld"), rel=1e-9)

    for resume in (False, True):  # a finished run is never run again
        with pytest.raises(FailedPrecondition) as e:
            run_iterate(a.config, cfg, simulation=True, resume=resume)
        assert "has finished" in str(e.value) and "another name" in str(e.value)
    assert segments_charged(a.ledger) == [1, 2, 3, 4, 5]


def test_a_run_killed_between_rounds_resumes_from_its_last_fused_model(tmp_path):
    """Killed after round 2 was fused and reported: --resume starts round 3 from θ_2 (the stored
    RUN-r2). With the same data and a tiny σ, the resumed run's θ_5 is the uninterrupted twin's
    up to the noise; a run restarted from θ_0 would be as far from it as 3 rounds of training."""
    a, roster = alone_site(tmp_path, "site-a", epsilon=2000.0)
    twin, twin_roster = alone_site(tmp_path, "site-c", epsilon=2000.0)  # the same seed, declared n
    paths = [round_file(s, r, rounds=5, epsilon=1000.0) for s, r in ((a, roster), (twin, twin_roster))]
    (twin.root / "records.npz").write_bytes((a.root / "records.npz").read_bytes())  # the same records
    with pytest.raises(Killed):
        run_iterate(a.config, load_iterate_config(paths[0]), simulation=True, on_event=kill_at("iterate-fused", 2))
    assert segments_charged(a.ledger) == [1, 2]
    resumed = run_iterate(a.config, load_iterate_config(paths[0]), simulation=True, resume=True)
    whole = run_iterate(twin.config, load_iterate_config(paths[1]), simulation=True)
    assert resumed.status == whole.status == "finished" and segments_charged(a.ledger) == [1, 2, 3, 4, 5]
    sigma = resumed.report["noise_multiplier"]
    ours = load_model(a.root / "rounds" / "models", "t1-r5").arrays
    theirs = load_model(twin.root / "rounds" / "models", "t1-r5").arrays
    # per step each coordinate gets independent noise of std η·σ·C/n in each run; over 6 steps
    # the two runs differ by a N(0, 2·6·(η σ C / n)²) sum (a bound here: the loss is smooth and
    # the steps few); 6 std per coordinate: false failure < 1e-8 per coordinate
    noise_std = np.sqrt(2 * 6) * 0.5 * sigma * 1.0 / 25
    gap = max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)
    # restarted from θ_0, our 3 rounds would have ended near the twin's θ_3
    three = load_model(twin.root / "rounds" / "models", "t1-r3").arrays
    restarted = max(float(np.max(np.abs(ours[k] - three[k]))) for k in ours)
    assert gap <= 6 * noise_std, (gap, noise_std)
    assert restarted > 3 * gap  # θ_2 was restored, not θ_0


def test_a_run_whose_own_daemon_does_not_serve_stops_before_charging_and_resumes(tmp_path):
    """Its daemon stopped: the run stops before its first charge (status "alone", the console
    line says why), nothing is charged; with the daemon back, --resume runs it to the end."""
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    b = make_site(tmp_path, "site-b", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    pin_each_other(a, b)

    def roster_at(addr):
        return write_roster(
            tmp_path / "roster.toml",
            [
                ("site-a", addr, str(a.identity_dir / "site.crt")),
                ("site-b", "127.0.0.1:9", str(b.identity_dir / "site.crt")),
            ],
        )

    with running(a) as (_, addr):
        pass  # its port, now closed: nobody serves there
    cfg = load_iterate_config(round_file(a, roster_at(addr), rounds=3, wait_s=0.5))
    events = []
    result = run_iterate(a.config, cfg, on_event=events.append)
    assert result.status == "alone" and result.rounds_done == 0
    assert f"own daemon at {addr} does not serve" in result.reason and "--resume" in result.reason
    assert segments_charged(a.ledger) == []
    line = describe(next(e for e in events if e["event"] == "iterate-alone"))
    assert "does not serve" in line and "not charged" in line and "--resume" in line
    assert json.loads((a.root / "rounds" / "t1.json").read_text())["status"] == "alone"
    with running(a) as (_, addr):
        roster_at(addr)
        events.clear()
        result = run_iterate(a.config, cfg, on_event=events.append, resume=True)
    assert result.status == "finished" and result.rounds_done == 3
    assert segments_charged(a.ledger) == [1, 2, 3]
    # the peer down from the start is said once, on the console, not every round
    peer_lines = [describe(e) for e in events if e["event"] == "iterate-peer"]
    assert len(peer_lines) == 1 and "site-b is gone" in peer_lines[0]


def test_peers_changes_of_state_are_console_lines():
    def line(state, was, staleness=None):
        e = {"event": "iterate-peer", "site": "site-a", "round": 4, "peer": "site-b", "state": state, "was": was}
        return describe({**e, "staleness": staleness, "reason": "UNAVAILABLE: connection refused"})

    assert line("gone", "fresh") == (
        "[site-a] round 4: site-b is gone (UNAVAILABLE: connection refused); asked again each round without waiting"
    )
    assert "site-b is back" in line("fresh", "gone") and "is back, is behind" in line("stale", "gone", 2)
    assert "is behind: its newest segment is 2 round(s) old" in line("stale", "fresh", 2)
    assert "site-b is fresh again" in line("fresh", "stale")


def test_one_process_per_run(tmp_path):
    """A second process of the same run (its lock held) is refused before anything is charged."""
    from peer.net.site_lock import SiteLock

    a, roster = alone_site(tmp_path)
    cfg = load_iterate_config(round_file(a, roster, rounds=2))
    (a.root / "rounds").mkdir()
    lock = SiteLock(a.root / "rounds" / "t1.json", holder="process running this run")
    try:
        with pytest.raises(FailedPrecondition) as e:
            run_iterate(a.config, cfg, simulation=True)
        assert "in use by another process running this run" in str(e.value)
    finally:
        lock.release()
    assert run_iterate(a.config, cfg, simulation=True).status == "finished"


def test_a_resumed_run_keeps_its_plan(tmp_path):
    a, roster = alone_site(tmp_path)
    path = round_file(a, roster, rounds=4)
    with pytest.raises(Killed):
        run_iterate(a.config, load_iterate_config(path), simulation=True, on_event=kill_at("iterate-fused", 1))
    p = a.root / "iterate.toml"
    p.write_text(p.read_text().replace("learning_rate = 0.5", "learning_rate = 0.25"))
    with pytest.raises(FailedPrecondition) as e:
        run_iterate(a.config, load_iterate_config(path), simulation=True, resume=True)
    assert "learning_rate = 0.5" in str(e.value) and "0.25" in str(e.value)
    assert segments_charged(a.ledger) == [1]
