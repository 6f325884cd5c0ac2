"""The daemon's limits over real daemons on loopback: stalled uploads, the per-peer cap, the
capacity kept for health checks and GetPeerInfo, certificates that expire on an open
connection, an exclusive port and ledger, and listen addresses that cannot work."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from peer_harness import DaemonProcess, client, make_site, pin_each_other, running

from peer.budget.ledger import Ledger
from peer.net import wire
from peer.net.client import PeerError
from peer.net.identity import init_identity, load_certificate
from peer.net.limits import StreamTimeout, paced
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc

# 2 chunks of probe at a 4 MiB chunk size: the stalled uploads send the first and stop
PROBE = np.random.default_rng(0).random((9000, 64))


def entries(site):
    with Ledger(site.ledger) as ledger:
        return ledger.entries()


# ------------------------------------------------------------------------ pacing (no server)


def test_paced_passes_a_stream_through_and_cuts_a_stalled_one():
    assert list(paced(iter(range(5)), idle_s=1.0, deadline_s=5.0)) == list(range(5))

    def stalls():
        yield 1
        threading.Event().wait(10)  # never sends again
        yield 2

    got = []
    started = time.monotonic()
    with pytest.raises(StreamTimeout, match=r"sent nothing for 0.3 s \(site.stream_idle_s\)"):
        for m in paced(stalls(), idle_s=0.3, deadline_s=5.0):
            got.append(m)
    assert got == [1] and time.monotonic() - started < 2.0


def test_paced_cuts_a_trickle_at_the_deadline():
    def trickle():
        while True:
            time.sleep(0.05)
            yield 0

    started = time.monotonic()
    with pytest.raises(StreamTimeout, match=r"did not finish within 0.5 s \(site.stream_deadline_s\)"):
        for _ in paced(trickle(), idle_s=0.3, deadline_s=0.5):
            pass
    assert time.monotonic() - started < 2.0


def test_paced_hands_on_the_stream_error():
    def broken():
        yield 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        list(paced(broken(), idle_s=1.0, deadline_s=5.0))


# ------------------------------------------------------------------------ stalled uploads


def stalled_upload(stub, sender: str, release: threading.Event):
    """A ReleaseFeatures call that sends params, the probe header and half the probe, then
    nothing until ``release`` is set (an operator's stalled peer)."""
    params = pb.FeaturesParams(
        header=pb.RequestHeader(sender=sender, receiver="site-a"),
        model="mlp",
        activation_epsilon=1.0,
        weight_epsilon=1.0,
    )

    def requests():
        yield pb.FeaturesRequest(params=params)
        messages = list(wire.tensor_messages("probe", PROBE))
        assert len(messages) == 3  # header + 2 chunks
        yield pb.FeaturesRequest(probe=messages[0])
        yield pb.FeaturesRequest(chunk=messages[1])
        release.wait(60)

    return stub.ReleaseFeatures(requests(), timeout=60)


def reason_of(error: grpc.RpcError) -> str:
    """The ``google.rpc.ErrorInfo`` reason a refusal carries (read as any gRPC client would)."""
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def run_stalled(calls, started: float | None = None):
    """Wait for each call in a thread; record (status, message, seconds from ``started`` —
    before the calls were made, so that a call's own start is never earlier — until it ended,
    the ``google.rpc.ErrorInfo`` reason or "")."""
    results = [None] * len(calls)
    started = time.monotonic() if started is None else started

    def wait(i, call):
        try:
            for _ in call:
                pass
            results[i] = ("OK", "", time.monotonic() - started, "")
        except grpc.RpcError as e:
            results[i] = (e.code().name, e.details(), time.monotonic() - started, reason_of(e))

    threads = [threading.Thread(target=wait, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return results, threads


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def timed(fn):
    started = time.monotonic()
    out = fn()
    return out, time.monotonic() - started


def test_stalled_uploads_of_one_peer_cannot_starve_the_others(tmp_path):
    """20 stalled uploads from site-b at a site with 16 workers: 16 are admitted and hold every
    release worker, 4 are refused at once; site-c's GetPeerInfo, health checks and (once the
    idle limit has cut the stalled ones) releases are answered within 1 s throughout."""
    a = make_site(
        tmp_path,
        "site-a",
        workers=16,
        extra_site="max_calls_per_peer = 64\nstream_idle_s = 2.5\nstream_deadline_s = 60",
    )
    b = make_site(tmp_path, "site-b", models={})
    c = make_site(tmp_path, "site-c", models={})
    pin_each_other(a, b, c)
    release = threading.Event()
    # readers left by earlier tests in this process (e.g. the pacing unit tests) are not ours
    earlier = {t for t in threading.enumerate() if t.name == "stream-reader"}
    with running(a) as (daemon, address), client(b, address, "site-a") as cb, client(c, address, "site-a") as cc:
        cc.info()  # connect first: the handshake is not what is measured
        stub = pb_grpc.PeerStub(cb.channel)
        started = time.monotonic()
        results, threads = run_stalled([stalled_upload(stub, "site-b", release) for _ in range(20)], started)
        try:
            wait_until(
                lambda: daemon.limits.in_progress() == 16 and sum(r is not None for r in results) == 4,
                10,
                "16 stalled uploads admitted and 4 refused",
            )
            refused = [r for r in results if r is not None]
            assert {r[0] for r in refused} == {"RESOURCE_EXHAUSTED"}
            assert all("site.workers" in r[1] and "nothing was charged" in r[1] for r in refused)
            assert {r[3] for r in refused} == {"SITE_AT_CAPACITY"}  # busy, not a budget: retry
            health = health_pb2_grpc.HealthStub(cc.channel)
            while time.monotonic() - started < 2.0:  # while every release worker is held
                info, seconds = timed(lambda: cc.info(timeout=1.0))
                assert info.name == "site-a" and seconds < 1.0
                reply, seconds = timed(
                    lambda: health.Check(health_pb2.HealthCheckRequest(service="privfusion.v1.Peer"), timeout=1.0)
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING and seconds < 1.0
            assert daemon.limits.in_progress() == 16  # still stalled, still held
            for t in threads:
                t.join(15)
            # the calls are over while their clients still hold back: the readers have exited too
            wait_until(
                lambda: not any(t.name == "stream-reader" and t not in earlier for t in threading.enumerate()),
                15,
                "the stream readers to exit",
            )
        finally:
            release.set()
        cut = [r for r in results if r[0] != "RESOURCE_EXHAUSTED"]
        assert len(cut) == 16 and {r[0] for r in cut} == {"DEADLINE_EXCEEDED"}, cut
        assert all("site.stream_idle_s" in r[1] for r in cut)
        # cut by the idle limit (2.5 s after their last frame), long before their own 60 s deadline
        assert all(2.0 < r[2] < 10.0 for r in cut), [r[2] for r in cut]
        wait_until(lambda: daemon.limits.in_progress() == 0, 5, "the workers to be free again")
        released, seconds = timed(lambda: cc.features("mlp", PROBE[:8], activation_epsilon=1.0, weight_epsilon=1.0))
        assert released.receipt is not None
    # nothing of the stalled uploads was charged; site-c's release was
    assert [e.record.counterparty for e in entries(a)] == ["site-c"]


def test_one_peer_cannot_have_more_than_its_share_of_calls(tmp_path):
    a = make_site(tmp_path, "site-a", workers=16, extra_site="max_calls_per_peer = 4\nstream_idle_s = 2.0")
    b = make_site(tmp_path, "site-b", models={})
    c = make_site(tmp_path, "site-c", models={})
    pin_each_other(a, b, c)
    release = threading.Event()
    with running(a) as (daemon, address), client(b, address, "site-a") as cb, client(c, address, "site-a") as cc:
        stub = pb_grpc.PeerStub(cb.channel)
        results, threads = run_stalled([stalled_upload(stub, "site-b", release) for _ in range(6)])
        try:
            wait_until(
                lambda: daemon.limits.in_progress() == 4 and sum(r is not None for r in results) == 2,
                10,
                "4 uploads admitted and 2 refused",
            )
            refused = [r for r in results if r is not None]
            assert {r[0] for r in refused} == {"RESOURCE_EXHAUSTED"}
            assert all(
                "'site-b' already has 4 calls in progress" in r[1] and "site.max_calls_per_peer" in r[1]
                for r in refused
            )
            assert {r[3] for r in refused} == {"PEER_CALL_LIMIT"}
            # the cap is per peer: site-b itself may not even ask for info now; site-c is served
            with pytest.raises(PeerError) as e:
                cb.info(timeout=1.0)
            # "busy, retry" is told apart from "budget spent" by its reason (docs/wire.md §7.3)
            assert e.value.status == "RESOURCE_EXHAUSTED" and e.value.reason == "PEER_CALL_LIMIT"
            assert e.value.metadata["limit"] == "4"
            release_c, seconds = timed(lambda: cc.weights("mlp", epsilon=2.0, delta=1e-5))
            assert release_c.receipt is not None and seconds < 5.0
            # health checks are exempt from the cap
            reply = health_pb2_grpc.HealthStub(cb.channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for t in threads:
                t.join(15)
        finally:
            release.set()
        assert sorted(r[0] for r in results) == ["DEADLINE_EXCEEDED"] * 4 + ["RESOURCE_EXHAUSTED"] * 2
    assert [e.record.counterparty for e in entries(a)] == ["site-c"]


# ------------------------------------------------------------------------ certificate validity


def test_a_certificate_that_expires_on_an_open_connection_is_refused_at_its_next_call(tmp_path):
    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b", models={})
    shutil.rmtree(b.identity_dir)
    now = dt.datetime.now(dt.UTC)
    init_identity(
        b.identity_dir,
        "site-b",
        ["127.0.0.1"],
        not_before=now - dt.timedelta(seconds=1),
        valid_for=dt.timedelta(seconds=5),
    )
    pin_each_other(a, b)
    expires = load_certificate(b.identity.cert_pem).not_valid_after_utc
    with running(a) as (_, address), client(b, address, "site-a") as cb:
        assert cb.weights("mlp", epsilon=2.0, delta=1e-5).receipt is not None
        assert len(entries(a)) == 1
        # X.509 times have whole seconds: wait until the certificate has certainly expired
        while dt.datetime.now(dt.UTC) < expires + dt.timedelta(seconds=1.2):
            time.sleep(0.1)
        with pytest.raises(PeerError) as e:
            cb.weights("mlp", epsilon=2.0, delta=1e-5)
        # UNAUTHENTICATED from the per-call check: a new connection would fail its handshake instead
        assert e.value.status == "UNAUTHENTICATED" and "expired on" in str(e.value), str(e.value)
        with pytest.raises(PeerError) as e:
            cb.info()
        assert e.value.status == "UNAUTHENTICATED"
    assert len(entries(a)) == 1  # nothing charged for the refused call


# ------------------------------------------------------------------------ port, lock, address


def import_floor() -> float:
    """Seconds a Python process takes, on this machine right now, to import what the daemon
    imports: the floor of any daemon start, failed or not (it grows with the machine's load)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import peer.net.daemon"], check=True, capture_output=True, timeout=600)
    return time.monotonic() - started


def serve(config):
    """``privfusion peer serve`` in a subprocess that is expected to fail fast, and whether it
    did: within its imports plus a few seconds (3 × the import floor measured just before, + 5 s),
    not after retrying or waiting — a bound that scales with a slow or loaded machine."""
    limit = 3 * import_floor() + 5.0
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", "peer", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=limit + 60,
        check=False,
    )
    seconds = time.monotonic() - started
    return proc, (seconds < limit, seconds, limit)


def test_a_second_daemon_on_a_taken_port_fails_and_the_first_keeps_serving(tmp_path):
    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    first = DaemonProcess(a)
    try:
        address = first.wait_ready()
        port = address.rsplit(":", 1)[1]
        b.config.write_text(b.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'))
        proc, fast = serve(b.config)
        assert proc.returncode != 0 and fast[0], fast
        assert f"'127.0.0.1:{port}'" in proc.stderr and f"port {port} is already in use" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        with client(b, address, "site-a") as cb:
            assert cb.info().name == "site-a"
        assert first.proc.poll() is None
    finally:
        first.close()


def test_a_second_daemon_on_the_same_ledger_is_refused_by_the_lock(tmp_path):
    a = make_site(tmp_path, "site-a")
    with running(a):  # listens on its own port; the second would get another (port 0)
        proc, fast = serve(a.config)
    assert proc.returncode != 0 and fast[0], fast
    assert "is in use by another daemon" in proc.stderr and str(a.ledger) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    with running(a) as (_, address):  # the lock went with the first daemon
        assert address


@pytest.mark.parametrize(
    "listen, message",
    [
        # a malformed address is refused naming the file and the line (3 in make_site's site.toml)
        ("localhost", "site.listen ({config}, line 3): must be HOST:PORT"),
        ("127.0.0.1:99999", "site.listen ({config}, line 3): must be HOST:PORT with a port in 0..65535"),
        ("::1:50051", "site.listen ({config}, line 3): an IPv6 host is written in brackets"),
        ("192.0.2.1:50051", "'192.0.2.1' is not an address of this machine"),
    ],
)
def test_a_bad_listen_address_is_a_clear_error(tmp_path, listen, message):
    a = make_site(tmp_path, "site-a")
    a.config.write_text(a.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "{listen}"'))
    proc, fast = serve(a.config)
    assert proc.returncode == 2 and fast[0], fast
    assert message.format(config=a.config) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        # make_site writes the extra [site] line as line 9
        ("reserve_workers = 0", r"site\.reserve_workers \(.*site\.toml, line 9\): must be >= 1, got 0"),
        ("stream_idle_s = 700", r"site\.stream_idle_s \(.*line 9\): must be at most site\.stream_deadline_s \(600\)"),
        ("max_calls_per_peer = -1", r"site\.max_calls_per_peer \(.*line 9\): must be >= 1"),
    ],
)
def test_bad_limits_are_refused_at_start(tmp_path, extra, message):
    from peer.base.errors import InvalidArgument
    from peer.net.site import SiteConfig

    a = make_site(tmp_path, "site-a", extra_site=extra)
    with pytest.raises(InvalidArgument, match=message):
        SiteConfig.load(a.config)


# ------------------------------------------------------------------------ callers that stop reading


def test_a_caller_that_stops_reading_a_response_stream_loses_the_call_not_a_thread():
    """A real gRPC server on loopback with the daemon's LimitsInterceptor and a handler that
    streams 256 × 4 MiB: a caller that takes one message and then stops reading fills the
    flow-control window, and the server thread's wait for the send would never end. With
    stream_idle_s = 0.5 the watcher cancels the call: the thread and the caller's places are
    free again within a few seconds, the caller sees CANCELLED, and a caller that reads gets
    every message."""
    from concurrent import futures as cf

    from peer.net.limits import Limits, LimitsInterceptor

    chunk = b"x" * (4 << 20)
    served = []

    def stream(request, context):
        n = 0
        try:
            for n in range(1, int(request) + 1):  # noqa: B007 - n is read in finally
                yield chunk
        finally:
            served.append(n)

    cuts = []
    limits = Limits(workers=2, reserve_workers=1, stream_idle_s=0.5, stream_deadline_s=5.0)
    interceptor = LimitsInterceptor(limits, "site-a", on_cut=lambda method, ctx: cuts.append(method))
    handler = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=lambda b: int(b.decode()), response_serializer=lambda b: b
            )
        },
    )
    server = grpc.server(
        cf.ThreadPoolExecutor(max_workers=limits.threads), interceptors=[interceptor], options=wire.grpc_options()
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.grpc_options())
        call = channel.unary_stream(
            "/t.T/Stream", request_serializer=lambda n: str(n).encode(), response_deserializer=bytes
        )
        stalled = call(256, timeout=60)
        assert len(next(stalled)) == len(chunk)
        wait_until(lambda: interceptor.in_progress() == 0, 10.0, "the stalled call's thread to be freed")
        assert cuts == ["/t.T/Stream"] and interceptor.sends.cut == 1
        assert served and served[0] < 256  # the handler stopped early: the stream was cut
        with pytest.raises(grpc.RpcError) as err:
            for _ in stalled:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
        # a caller that reads is never cut, however long the stream
        assert sum(len(m) for m in call(8, timeout=60)) == 8 * len(chunk)
        assert interceptor.sends.cut == 1 and interceptor.in_progress() == 0
        channel.close()
    finally:
        server.stop(None)
