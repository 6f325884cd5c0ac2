"""``privfusion peer health``: a site checks its own daemon over its own identity.

The daemon runs as a real ``privfusion peer serve`` process with mutual TLS and a pinned peer
(so its TLS trust anchors are the pins, plus its own certificate); ``peer health`` runs as a
process too, as the image's HEALTHCHECK runs it."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest
from peer_harness import DaemonProcess, make_site, pin

from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(config, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "peer", "health", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def site(tmp_path):
    """hospital-a listening on a fixed loopback port, with hospital-b pinned."""
    a = make_site(tmp_path, "hospital-a")
    b = make_site(tmp_path, "hospital-b")
    pin(a, b)
    port = _free_port()
    a.config.write_text(a.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'))
    return a, port


def test_health_is_0_while_serving_and_says_why_not_once_stopped(site):
    a, port = site
    daemon = DaemonProcess(a)
    try:
        assert daemon.wait_ready() == f"127.0.0.1:{port}"
        ok = _health(a.config)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == f"hospital-a: privfusion.v1.Peer SERVING at 127.0.0.1:{port}"
    finally:
        daemon.proc.terminate()  # SIGTERM: the daemon's own orderly stop
        daemon.proc.wait(timeout=60)
        daemon.close()
    down = _health(a.config, "--timeout", "3")
    assert down.returncode == 1
    assert down.stderr.startswith(f"privfusion peer health: 'hospital-a' at 127.0.0.1:{port} is not healthy: ")
    assert "UNAVAILABLE" in down.stderr or "DEADLINE_EXCEEDED" in down.stderr, down.stderr


def test_the_own_certificate_reaches_health_only_never_the_peer_service(site):
    """What the daemon's acceptance of its own certificate opens: the handshake, and Health.
    A Peer call made with the site's own key is refused (the key is not pinned)."""
    a, port = site
    daemon = DaemonProcess(a)
    try:
        daemon.wait_ready()
        ident = a.identity
        creds = grpc.ssl_channel_credentials(ident.cert_pem, ident.key_pem, ident.cert_pem)
        with (
            grpc.secure_channel(
                f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "hospital-a")]
            ) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.PeerStub(channel).GetPeerInfo(
                pb.GetPeerInfoRequest(header=pb.RequestHeader(sender="hospital-a", receiver="hospital-a")),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "is not pinned at 'hospital-a'" in refused.value.details()
    finally:
        daemon.close()


def test_health_of_a_site_listening_on_an_ephemeral_port_is_refused_by_field(tmp_path):
    a = make_site(tmp_path, "hospital-a")  # listen = "127.0.0.1:0"
    out = _health(a.config)
    assert out.returncode == 2
    assert "site.listen" in out.stderr and "port 0" in out.stderr


def test_health_loads_no_torch(site):
    """The image's HEALTHCHECK runs it every 10 s beside the daemons: it reads three keys of
    site.toml and dials; importing the daemon's modules (torch) made it take over 20 s on a loaded
    2-core machine, past the check's timeout."""
    a, _ = site
    daemon = DaemonProcess(a)
    try:
        daemon.wait_ready()
        probe = (
            "import sys\n"
            "from peer.cli import main\n"
            f"rc = main(['peer', 'health', '--config', {str(a.config)!r}])\n"
            "loaded = sorted(m for m in ('torch', 'scipy', 'sklearn', 'peer.net.site') if m in sys.modules)\n"
            "print('loaded', loaded)\n"
            "sys.exit(rc)\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == "loaded []"
    finally:
        daemon.close()
