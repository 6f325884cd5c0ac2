"""The daemon's life: SIGTERM (graceful) and SIGKILL (crash) during releases, and restarts."""

import json
import os
import random
import signal
import threading
import time

import grpc
import pytest
from peer_harness import DaemonProcess, ForkedDaemons, client, make_site, model_arrays, pin_each_other

from peer.budget.ledger import Ledger
from peer.net import wire
from peer.net.client import PeerError
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc

# ~0.6 M parameters (2.4 MB): big enough to stream in a few frames, small enough to perturb fast
BIG = {"kind": "mlp", "input_dim": 64, "hidden": [512, 512, 512], "output_dim": 10, "activation": "relu"}

# 4.3 M parameters (17 MB): more than gRPC buffers for a reader that has stopped reading
HUGE = {"kind": "mlp", "input_dim": 64, "hidden": [2048, 2048], "output_dim": 10, "activation": "relu"}


@pytest.fixture(scope="module")
def forked():
    return ForkedDaemons()


def big_sites(tmp_path, **kw):
    a = make_site(tmp_path, "site-a", models={"big": (BIG, model_arrays(BIG))}, **kw)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def crash_rounds(tmp_path, forked, rounds, seed, clients=3):
    """Kill the daemon with SIGKILL at a random moment while clients ask for releases, restart,
    check the ledger; return (receipts seen, releases completed, releases cut after the receipt)."""
    a, b = big_sites(tmp_path)
    rng = random.Random(seed)
    receipts: dict[str, str] = {}  # ledger entry id -> release id, as the receipts said
    complete, cut = 0, 0
    lock = threading.Lock()
    for i in range(rounds):
        proc, address = forked.start(a)
        stop = threading.Event()
        state = {"complete": 0, "cut": 0}
        # What this round waits for before its kill: the first release completed (round 0, so
        # that every run sees completions) or a first receipt (a charge made, bytes leaving).
        # Progress is waited for; only the moment of the kill after it is random.
        reached = {"receipt": threading.Event(), "complete": threading.Event()}
        pause = rng.uniform(0.0, 0.1)

        # This round's objects are bound here: a client thread that outlives its join below must
        # not pick up the next round's address, stop event or counters.
        def work(address=address, stop=stop, state=state, reached=reached, pause=pause):
            seen_here = []

            def on_receipt(r):
                with lock:
                    receipts[r.ledger_entry_id] = r.record.release_id
                seen_here.append(r.ledger_entry_id)
                reached["receipt"].set()
                time.sleep(pause)  # a slow reader: the release stays in flight after its charge

            try:
                with client(b, address, on_receipt=on_receipt) as c:
                    while not stop.is_set():
                        n = len(seen_here)
                        try:
                            c.weights("big", epsilon=1.0, delta=1e-6, timeout=20)
                            with lock:
                                state["complete"] += 1
                            reached["complete"].set()
                        except PeerError:
                            with lock:
                                state["cut"] += len(seen_here) > n  # the receipt came, the rest did not
                            return
            except PeerError:
                return

        threads = [threading.Thread(target=work) for _ in range(clients)]
        for t in threads:
            t.start()
        milestone = "complete" if i == 0 else rng.choice(["receipt", "complete"])
        assert reached[milestone].wait(60), f"round {i}: no {milestone} within 60 s"
        time.sleep(rng.uniform(0.0, 0.3))  # a random phase after the milestone, not a wait for progress
        os.kill(proc.pid, 9)
        proc.join()
        stop.set()
        for t in threads:
            t.join(30)
        complete += state["complete"]
        cut += state["cut"]
        # after every crash: the ledger opens (verify() runs at open: integrity, hash chain,
        # totals recomputed from the rows) and holds every release whose receipt reached a client
        with Ledger(a.ledger) as led:
            charged = {str(e.entry_id): e.release_id for e in led.entries()}
        for entry_id, release_id in receipts.items():
            assert charged.get(entry_id) == release_id, f"receipt {entry_id} has no charge after the crash"
    # and a restarted daemon serves again from the same ledger
    proc, address = forked.start(a)
    try:
        with client(b, address) as c:
            got = c.weights("big", epsilon=1.0, delta=1e-6)
        with Ledger(a.ledger) as led:
            assert str(led.entries()[-1].entry_id) == got.receipt.ledger_entry_id
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
    assert proc.exitcode == 0
    return receipts, complete, cut


def test_sigkill_during_releases_never_loses_a_charge_short(tmp_path, forked):
    receipts, complete, _ = crash_rounds(tmp_path, forked, rounds=4, seed=1)
    assert receipts and complete


@pytest.mark.slow
def test_sigkill_during_releases_never_loses_a_charge_50_times(tmp_path, forked):
    _receipts, complete, cut = crash_rounds(tmp_path, forked, rounds=50, seed=2)
    # the kills did land between a charge and the end of its stream, where it matters
    assert cut > 0 and complete > 0


def health_channel(b, a, address):
    creds = grpc.ssl_channel_credentials(
        root_certificates=a.identity.cert_pem, private_key=b.identity.key_pem, certificate_chain=b.identity.cert_pem
    )
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "site-a")])


def health_of(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service="privfusion.v1.Peer"), timeout=5)
            .status
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except grpc.RpcError as e:
        return e.code().name


def slow_reader(b, a, address, request, go: threading.Event | float, out):
    """Read a weights release, pausing after the receipt until ``go`` is set (the server's sends
    back up behind flow control meanwhile; at most 60 s), or for ``go`` seconds; report the
    frames and the final status. An event, not a fixed pause, where the test checks something
    during the pause: on a loaded machine that may take longer than any pause chosen in advance."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=a.identity.cert_pem, private_key=b.identity.key_pem, certificate_chain=b.identity.cert_pem
    )
    with grpc.secure_channel(
        address, creds, options=[*wire.grpc_options(), ("grpc.ssl_target_name_override", "site-a")]
    ) as ch:
        frames = []
        try:
            for f in pb_grpc.PeerStub(ch).ReleaseWeights(request, timeout=60):
                frames.append(f.WhichOneof("frame"))
                if len(frames) == 1:
                    if isinstance(go, threading.Event):
                        go.wait(60)
                    else:
                        time.sleep(go)
            out["status"] = "OK"
        except grpc.RpcError as e:
            out["status"] = e.code().name
        out["frames"] = frames


def wait_for_charge(site, timeout=60.0):
    """Block until the site's ledger holds a charge (polled: the charge is made in the daemon's
    process; each read is one consistent snapshot of the live file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if site.ledger.exists():
            with Ledger(site.ledger) as led:
                if led.entries():
                    return
        time.sleep(0.05)
    pytest.fail(f"no charge in {site.ledger} within {timeout:g} s")


def huge_sites(tmp_path, grace):
    a = make_site(tmp_path, "site-a", models={"huge": (HUGE, model_arrays(HUGE))}, grace=grace)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def test_sigterm_lets_in_flight_releases_finish_and_refuses_new_ones(tmp_path):
    a, b = huge_sites(tmp_path, grace=30.0)
    daemon = DaemonProcess(a)  # the real `privfusion peer serve` command
    try:
        address = daemon.wait_ready()
        req = pb.WeightsRequest(
            header=pb.RequestHeader(sender="site-b", receiver="site-a"), model="huge", epsilon=1.0, delta=1e-6
        )
        out = {}
        health = health_channel(b, a, address)
        assert health_of(health) == "SERVING"
        go = threading.Event()
        t = threading.Thread(target=slow_reader, args=(b, a, address, req, go, out))
        t.start()
        try:
            wait_for_charge(a)  # charged: the release is in flight (its reader holds until go)
            daemon.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60  # the reader holds the release open meanwhile
            while health_of(health) != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health_of(health) == "NOT_SERVING"  # draining: still answering, not serving
            health.close()
            with client(b, address) as c, pytest.raises(PeerError) as e:
                c.weights("huge", epsilon=1.0, delta=1e-6)
            assert e.value.status in ("FAILED_PRECONDITION", "UNAVAILABLE")
        finally:
            go.set()  # the in-flight release may finish now
        t.join(60)
        assert daemon.proc.wait(60) == 0
    finally:
        daemon.close()
    assert out["status"] == "OK" and out["frames"][0] == "receipt" and out["frames"][-1] == "end"
    with Ledger(a.ledger) as led:
        [entry] = led.entries()
        assert [e["kind"] for e in led.events(entry.release_id)] == ["sent"]
    log = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
    events = [r["event"] for r in log if "event" in r]
    # the release was still streaming when the signal came, and finished before the stop
    assert events.index("charged") < events.index("signal") < events.index("released") < events.index("stopped")


def test_sigterm_after_the_grace_period_aborts_but_keeps_the_charge(tmp_path, forked):
    a, b = huge_sites(tmp_path, grace=0.5)
    proc, address = forked.start(a)
    req = pb.WeightsRequest(
        header=pb.RequestHeader(sender="site-b", receiver="site-a"), model="huge", epsilon=1.0, delta=1e-6
    )
    out = {}
    t = threading.Thread(target=slow_reader, args=(b, a, address, req, 4.0, out))
    t.start()
    wait_for_charge(a)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(30)
    t.join(60)
    assert proc.exitcode == 0
    assert out["status"] != "OK" and out["frames"][0] == "receipt" and "end" not in out["frames"]
    with Ledger(a.ledger) as led:
        [entry] = led.entries()  # the charge stands: bytes may have left
        assert [e["kind"] for e in led.events(entry.release_id)] == ["send-failed"]


def test_logs_are_structured_and_hold_nothing_private(tmp_path, forked):
    a, b = big_sites(tmp_path)
    proc, address = forked.start(a)
    try:
        with client(b, address) as c:
            got = c.weights("big", epsilon=1.0, delta=1e-6)
            # the client reads on to the call's status, which comes after the daemon noted the
            # release as sent: no race with a client that returns on the end frame
            with Ledger(a.ledger) as led:
                [entry] = led.entries()
                assert [e["kind"] for e in led.events(entry.release_id)] == ["sent"]
            with pytest.raises(PeerError):
                c.weights("nope", epsilon=1.0, delta=1e-6)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
    text = (a.root / "daemon.log").read_text()
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert records and all(
        {"ts", "level", "event"} <= set(r) for r in records if r.get("logger", "").startswith("privfusion")
    )
    events = [r.get("event") for r in records]
    assert {"serving", "charged", "released", "refused", "stopped"} <= set(events)
    # no key material, no tensor values: the private key's base64 body and sample weights never appear
    key_body = (a.identity_dir / "site.key").read_text().splitlines()[1]
    assert key_body not in text
    w = model_arrays(BIG)["0.weight"].ravel()[:5]
    assert not any(repr(float(x))[:8] in text for x in w)
    # released values too (those with a distinctive decimal form: the smoothing filter maps a
    # noise-swamped layer to exact zeros, and "0.0" is in any log)
    released = [x for arr in got.arrays.values() for x in arr.ravel() if len(repr(float(x))) >= 8][:5]
    assert not any(repr(float(x))[:8] in text for x in released)
