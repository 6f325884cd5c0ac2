"""Secure aggregation over real daemons on loopback (mTLS, PublishSecAgg / FetchSecAgg): four
sites run a few steps of DP-SGD on a logistic regression together, each as its own run
(``RunSite``: identity, trust, ledger) beside its own daemon, with one secure sum per step; a
site that goes away is left behind and the step re-runs among the rest."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import pytest
from peer_harness import make_site, pin_each_other, running
from test_secure_iterate import POLICY

from coordinator_free.secure_iterate import (
    DaemonTransport,
    RunSite,
    SecureParty,
    SecureSumPlan,
    apply_update,
    secure_sum,
)
from peer.base.errors import InvalidArgument
from peer.desk.desk import ReleaseDesk
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.distributed.encoding import Encoding, modular_overflow_probability
from peer.dp.distributed.skellam import calibrate_share
from peer.net.client import PeerClient, PeerError
from peer.net.secagg import MaskContext, MaskedShare, make_ephemeral, sign_masked
from peer.net.signing import wire_transport

FEATURES = 6
DIM = FEATURES + 1  # weights and bias
RECORDS = 30
ENCODING = Encoding(dim=DIM, clip_norm=1.0, scale=1024.0, bits=32, beta=0.0)
STEPS = 3


def records_of(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7 + i)
    x = rng.normal(size=(RECORDS, FEATURES))
    y = (x @ np.linspace(-1, 1, FEATURES) + 0.3 * rng.normal(size=RECORDS) > 0).astype(float)
    return x, y


def per_record_gradients(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∇ of the logistic loss of each record at θ = (w, b): rows (records, DIM)."""
    p = 1 / (1 + np.exp(-(x @ theta[:FEATURES] + theta[FEATURES])))
    return np.hstack([(p - y)[:, None] * x, (p - y)[:, None]])


def plan() -> SecureSumPlan:
    cal = calibrate_share(
        4.0, 1e-5, 4, 1, ENCODING.l1_sensitivity, ENCODING.l2_sensitivity, 1.0, STEPS + 1, DEFAULT_ORDERS
    )
    return SecureSumPlan("run-d", ENCODING, 1, cal.total_variance, 1.0, 1e-5)


@pytest.fixture
def network(tmp_path):
    files = [make_site(tmp_path, f"site-{i:02d}", policy=POLICY) for i in range(4)]
    pin_each_other(*files)
    with contextlib.ExitStack() as stack:
        daemons = [stack.enter_context(running(f)) for f in files]
        addresses = {f.name: address for f, (_, address) in zip(files, daemons, strict=True)}
        runs = [RunSite(f.config) for f in files]
        for r in runs:
            stack.callback(r.close)
        yield files, daemons, addresses, runs


def test_sites_train_together_over_daemons_and_each_ledger_holds_its_shares(network):
    _, daemons, addresses, runs = network
    p = plan()
    thetas: dict[str, list[np.ndarray]] = {}
    errors: dict[str, BaseException] = {}

    def site_run(i: int, leave_after: int | None) -> None:
        run = runs[i]
        x, y = records_of(i)
        transport = DaemonTransport(run.identity, addresses[run.name], addresses, wait_s=10.0)
        party = SecureParty(run, ReleaseDesk(run, wire_transport(run)))
        theta = np.zeros(DIM)
        names = sorted(addresses)
        history = []
        try:
            for step in range(STEPS):
                if leave_after is not None and step > leave_after:
                    break
                if leave_after is not None and step == leave_after:
                    # once every peer has finished the last step (it publishes its key of the
                    # next), this site goes away: its daemon answers no more
                    nxt = MaskContext(p.run, step, 0, tuple(names), ENCODING.bits)
                    transport.collect(nxt, "key", run.name, [n for n in names if n != run.name])
                    daemons[i][0].stop(grace=0.5)
                    break
                at = theta  # the gradients of this step are taken at this step's θ

                def gradients(idx, at=at):
                    return per_record_gradients(at, x, y)[idx]

                result = secure_sum(party, transport, p, step, names, gradients, RECORDS)
                names = list(result.context.sites)  # who is left
                theta = apply_update(theta, result.noisy_sum, 1.0, len(names) * RECORDS)
                history.append(theta)
        except BaseException as e:  # the test reads every site's outcome
            errors[run.name] = e
        finally:
            transport.close()
        thetas[run.name] = history

    threads = [threading.Thread(target=site_run, args=(i, 2 if i == 3 else None)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    survivors = ["site-00", "site-01", "site-02"]
    # every site ends with the same model, step by step (bit for bit)
    for step in range(STEPS):
        assert len({thetas[n][step].tobytes() for n in survivors}) == 1
    for step in range(2):
        assert thetas["site-03"][step].tobytes() == thetas["site-00"][step].tobytes()
    # and it learned something: the loss fell
    x0, y0 = records_of(0)
    assert (
        np.abs(per_record_gradients(thetas["site-00"][-1], x0, y0).mean(axis=0)).sum()
        < np.abs(per_record_gradients(np.zeros(DIM), x0, y0).mean(axis=0)).sum()
    )
    # each ledger holds its charged shares: steps 0, 1 (4 sites) and step 2's attempt 1 (3
    # sites); attempt 0 of step 2 was abandoned before any charge (site-03's key never came)
    for r in runs[:3]:
        got = [
            (e.record.parameters["step"], e.record.parameters["attempt"], e.record.parameters["sites"])
            for e in r.ledger.entries()
        ]
        assert got == [(0, 0, 4), (1, 0, 4), (2, 1, 3)]
        assert all(e.record.mechanism == "distributed-skellam" and e.counterparty == "*" for e in r.ledger.entries())
    assert [(e.record.parameters["step"]) for e in runs[3].ledger.entries()] == [0, 1]


def test_a_daemon_serves_only_charged_vectors_of_its_own_run_to_the_sites_of_the_context(network):
    _, _, addresses, runs = network
    me, peer = runs[0], runs[1]
    context = MaskContext("run-x", 0, 0, ("site-00", "site-01", "site-02"), 32)
    own = PeerClient(me.identity, addresses["site-00"], peer="site-00")
    key = make_ephemeral(me.identity, context)
    assert own.publish_secagg(context, "key", key.signed, ["site-01", "site-02"]) == 2
    y = np.arange(DIM, dtype=np.uint64)
    share = MaskedShare(y, sign_masked(me.identity, context, y), "no-such-charge")
    with pytest.raises(PeerError) as e:  # a masked vector with no standing charge is never served
        own.publish_secagg(context, "masked", share, ["site-01", "site-02"])
    assert e.value.status == "FAILED_PRECONDITION" and e.value.reason == "SECAGG_NOT_CHARGED"
    # a peer may fetch what was published for it …
    from_peer = PeerClient(peer.identity, addresses["site-00"], peer="site-00")
    assert from_peer.fetch_secagg(context, "key") == key.signed
    with pytest.raises(PeerError) as e:  # … NOT_FOUND for what is not (yet) published
        from_peer.fetch_secagg(context, "masked")
    assert e.value.status == "NOT_FOUND" and e.value.reason == "SECAGG_NOT_PUBLISHED"
    # a site outside the context fetches nothing; a peer cannot publish as the daemon's site
    outsider = PeerClient(runs[3].identity, addresses["site-00"], peer="site-00")
    with pytest.raises(PeerError) as e:
        outsider.fetch_secagg(context, "key")
    assert e.value.status == "PERMISSION_DENIED" and e.value.reason == "SECAGG_NOT_A_MEMBER"
    with pytest.raises(PeerError) as e:
        from_peer.publish_secagg(context, "key", key.signed, ["site-02"])
    assert e.value.status == "PERMISSION_DENIED" and e.value.reason == "SECAGG_NOT_OWN"
    for c in (own, from_peer, outsider):
        c.close()


def test_round_with_secure_true_trains_over_daemons_and_every_site_ends_with_the_same_model(tmp_path):
    """``privfusion round``'s runner with ``method = "iterate"``, ``secure = true``: three sites
    (coalition 1) on loopback, 2 rounds × 2 local steps, one secure sum per step."""
    from peer_harness import model_arrays
    from test_iterate import ARCH, policy, round_file

    from coordinator_free.roster import write_roster
    from coordinator_free.runner import run_rounds
    from peer.budget.ledger import Ledger
    from peer.nn.store import load_model

    allow = '"segment", "ledger", "secure-sum"'
    sites = [
        make_site(tmp_path, n, models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(8.0, allow=allow))
        for n in ("site-a", "site-b", "site-c")
    ]
    pin_each_other(*sites)
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(running(s))[1] for s in sites]
        roster = write_roster(
            tmp_path / "roster.toml",
            [(s.name, a, str(s.identity_dir / "site.crt")) for s, a in zip(sites, addresses, strict=True)],
        )
        extra = "secure = true\ncoalition = 1\nsecure_scale = 256.0\n"
        files = {s.name: round_file(s, roster, rounds=2, wait_s=20.0, extra=extra) for s in sites}
        for s in sites:  # one public n at every site: the denominator q·k·n
            path = Path(files[s.name])
            path.write_text(path.read_text().replace("declared_records = 50", "declared_records = 25"))
        results, events = {}, []

        def run(site):
            [(_, result)] = list(run_rounds(site.config, [files[site.name]], events.append))
            results[site.name] = result

        threads = [threading.Thread(target=run, args=(s,)) for s in sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert set(results) == {"site-a", "site-b", "site-c"}
    for r in results.values():
        assert r.status == "finished", r.reason
        assert r.report["secure"] and len(r.report["steps"]) == 4
        # the chance that a step's sum wraps mod 2^b, at the public count k·n (utility only):
        # the round's own bound on its own encoding and the k shares' variance
        plan = r.report["plan"]
        enc = Encoding(
            dim=plan["dim"], clip_norm=plan["clip_norm"], scale=plan["scale"], bits=plan["modulus_bits"], beta=0.0
        )
        assert plan["overflow_probability_at_declared"] == modular_overflow_probability(
            enc, 3 * 25, 3 * plan["total_variance"] / 2
        )
        assert 0.0 <= plan["overflow_probability_at_declared"] < 1e-9
    # its events read as lines (the simulator and `privfusion round` print them with describe)
    from coordinator_free.iterate import describe

    lines = [describe(e) for e in events if e["event"].startswith("iterate-")]
    assert sum("secure iterate run 't1' started: 4 steps" in (x or "") for x in lines) == 3, lines
    assert sum("secure iterate run finished after 4 steps" in (x or "") for x in lines) == 3, lines
    steps = {n: [(x["step"], x["attempt"], tuple(x["sites"])) for x in r.report["steps"]] for n, r in results.items()}
    assert len(set(map(tuple, steps.values()))) == 1, steps
    models = [load_model(s.root / "rounds" / "models", "t1-final").arrays for s in sites]
    for m in models[1:]:
        assert {k: v.tobytes() for k, v in m.items()} == {k: v.tobytes() for k, v in models[0].items()}
    from peer.nn.architectures import build_model

    init = {k: v.detach().numpy() for k, v in build_model(ARCH, seed=5).named_parameters()}  # θ_0 (init_seed 5)
    assert all(not np.allclose(models[0][k], init[k]) for k in init)  # every tensor moved
    for s in sites:
        with Ledger(s.ledger) as led:
            entries = led.entries()
            spent = next(b for b in led.budget_states() if b.key.level == "data").spent_epsilon
        assert [e.record.parameters["step"] for e in entries] == [0, 1, 2, 3]
        assert all(e.record.mechanism == "distributed-skellam" and e.record.parameters["sites"] == 3 for e in entries)
        assert 0 < spent <= 4.0  # calibrated for the run's ε = 4 against the ledger's filter


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('secure = true\nadjacency = "replace-one"', "round.iterate.adjacency"),
        ("secure = 1", "round.iterate.secure"),
        ("secure = true\nmodulus_bits = 65", "round.iterate.modulus_bits"),
    ],
)
def test_a_bad_secure_iterate_table_names_the_key(tmp_path, extra, field):
    from peer_harness import model_arrays
    from test_iterate import ARCH, policy, round_file

    from coordinator_free.iterate import load_iterate_config

    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    with pytest.raises(InvalidArgument) as e:
        load_iterate_config(round_file(a, tmp_path / "roster.toml", rounds=1, extra=extra))
    assert e.value.field.split(" (")[0] == field  # the key, then the file and line


def test_secure_needs_coalition_plus_two_sites_else_the_local_noise_iterate_runs(tmp_path):
    from coordinator_free.iterate import IterateConfig
    from coordinator_free.roster import write_roster
    from coordinator_free.runner import _secure_possible

    files = [make_site(tmp_path, n) for n in ("site-a", "site-b", "site-c")]
    roster = write_roster(
        tmp_path / "r.toml", [(f.name, "127.0.0.1:9", str(f.identity_dir / "site.crt")) for f in files]
    )
    cfg = IterateConfig(roster, "mlp", tmp_path / "x.npz", tmp_path, secure=True, coalition=1)
    assert _secure_possible(cfg)
    assert not _secure_possible(IterateConfig(roster, "mlp", tmp_path / "x.npz", tmp_path, secure=True, coalition=2))
