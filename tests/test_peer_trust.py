"""Mutual TLS with pinned identities, against a real daemon on loopback.

Which status each refusal gets, and why (gRPC Python cannot make a server *request* a client
certificate without also *requiring and verifying* it against the trust anchors, so every
refusal the TLS layer makes happens before any call exists):

- no client certificate, an unpinned one, an expired one, plaintext: the TLS handshake fails;
  the server never sees a call, the client sees UNAVAILABLE ("Socket closed");
- a server certificate other than the one the client pinned: the client refuses the
  handshake: UNAVAILABLE;
- a pinned certificate whose request claims another site: PERMISSION_DENIED;
- a certificate unpinned while its connection stays open: UNAUTHENTICATED at the next call.
"""

import datetime as dt

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from peer_harness import client, make_site, pin, pin_each_other, running

from peer.net import wire
from peer.net.client import PeerClient, PeerError
from peer.net.identity import init_identity
from peer.net.trust import TrustStore
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc


@pytest.fixture
def two_sites(tmp_path):
    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def raw_stub(identity, server_cert, server_name, address):
    creds = grpc.ssl_channel_credentials(
        root_certificates=server_cert, private_key=identity.key_pem, certificate_chain=identity.cert_pem
    )
    ch = grpc.secure_channel(
        address, creds, options=[*wire.grpc_options(), ("grpc.ssl_target_name_override", server_name)]
    )
    return ch, pb_grpc.PeerStub(ch)


def test_a_pinned_peer_is_served_and_sees_who_it_talks_to(two_sites):
    a, b = two_sites
    with running(a) as (_, address), client(b, address) as c:
        info = c.info()
    assert info.name == "site-a" and info.protocol == "privfusion.v1" and not info.insecure
    assert info.certificate_sha256 == a.identity.fingerprint
    assert [m.name for m in info.models] == ["mlp"] and list(info.models[0].hidden_sizes) == [16, 12]
    assert "laplace" in info.mechanisms and info.max_chunk_bytes == wire.MAX_CHUNK_BYTES
    # the client found the pinned peer by the address's IP SAN (no --peer given)
    assert c.peer_name == "site-a"


def test_unpinned_client_is_refused_at_the_handshake(two_sites, tmp_path):
    a, _ = two_sites
    stranger = make_site(tmp_path, "stranger", models={})
    pin(stranger, a)  # the stranger trusts a, but a does not know it
    with running(a) as (_, address), client(stranger, address) as c, pytest.raises(PeerError) as e:
        c.info()
    assert e.value.status == "UNAVAILABLE" and "TLS handshake" in str(e.value)


def test_no_client_certificate_and_plaintext_are_refused(two_sites):
    a, _ = two_sites
    with running(a) as (_, address):
        ch = grpc.secure_channel(
            address,
            grpc.ssl_channel_credentials(root_certificates=a.identity.cert_pem),
            options=[("grpc.ssl_target_name_override", "site-a")],
        )
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PeerStub(ch).GetPeerInfo(
                pb.GetPeerInfoRequest(header=pb.RequestHeader(sender="site-b", receiver="site-a")), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()
        ch = grpc.insecure_channel(address)
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PeerStub(ch).GetPeerInfo(
                pb.GetPeerInfoRequest(header=pb.RequestHeader(sender="site-b", receiver="site-a")), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()


def test_expired_certificate_is_refused_even_when_pinned(two_sites, tmp_path):
    a, _ = two_sites
    old = init_identity(
        tmp_path / "old", "site-old", ["127.0.0.1"], days=1, not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    )
    fresh = init_identity(tmp_path / "fresh", "site-fresh", ["127.0.0.1"])
    # pinned while it was valid: put it in the trust directory as `trust add` did back then
    # (the same way for a valid certificate, the control)
    for ident in (old, fresh):
        (a.identity_dir / "trusted" / f"{ident.name}.crt").write_bytes(ident.cert_pem)
        TrustStore(ident.trust_dir).add(a.identity.cert_pem)
    with running(a) as (_, address):
        with PeerClient(fresh, address, peer="site-a") as c:
            assert c.info().name == "site-a"
        with PeerClient(old, address, peer="site-a") as c, pytest.raises(PeerError) as e:
            c.info()
    assert e.value.status == "UNAVAILABLE"


def test_claiming_another_sites_name_is_permission_denied(two_sites, tmp_path):
    a, b = two_sites
    c_site = make_site(tmp_path, "site-c", models={})
    pin_each_other(a, c_site)
    with running(a) as (_, address):
        ch, stub = raw_stub(b.identity, a.identity.cert_pem, "site-a", address)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetPeerInfo(
                pb.GetPeerInfoRequest(header=pb.RequestHeader(sender="site-c", receiver="site-a")), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "header.sender" in e.value.details() and "site-b" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.GetPeerInfo(
                pb.GetPeerInfoRequest(header=pb.RequestHeader(sender="site-b", receiver="site-z")), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.receiver" in e.value.details()
        ch.close()


def test_unpinning_an_open_connection_is_unauthenticated_and_pinning_needs_no_restart(two_sites, tmp_path):
    a, b = two_sites
    late = make_site(tmp_path, "site-late", models={})
    pin(late, a)
    with running(a) as (_, address):
        with client(b, address) as c:
            assert c.info().name == "site-a"
            TrustStore(a.identity_dir / "trusted").remove("site-b")
            with pytest.raises(PeerError) as e:
                c.info()  # same channel, same TLS connection: refused at the call
            assert e.value.status == "UNAUTHENTICATED"
        with client(b, address) as c, pytest.raises(PeerError) as e:
            c.info()  # a new connection: refused at the handshake
        assert e.value.status == "UNAVAILABLE"
        with client(late, address) as c, pytest.raises(PeerError):
            c.info()
        pin(a, late)
        with client(late, address) as c:
            assert c.info().name == "site-a"  # the running daemon picked the new pin up


def test_client_refuses_a_server_that_is_not_the_pinned_one(two_sites, tmp_path):
    _a, b = two_sites
    impostor = make_site(tmp_path, "impostor")
    # the impostor has its own key but is dialled where b expects site-a
    pin(impostor, b)
    with running(impostor) as (_, address), client(b, address, peer="site-a") as c, pytest.raises(PeerError) as e:
        c.info()
    assert e.value.status == "UNAVAILABLE"


def test_health_and_reflection_answer_standard_clients(two_sites):
    a, b = two_sites
    with running(a) as (_, address):
        ch, _ = raw_stub(b.identity, a.identity.cert_pem, "site-a", address)
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "privfusion.v1.Peer"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        )
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"privfusion.v1.Peer", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        files = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="privfusion.v1.Peer")]), timeout=10
            )
        )
        assert files[0].file_descriptor_response.file_descriptor_proto
        ch.close()


def test_insecure_mode_is_explicit_and_loud(two_sites, caplog):
    a, b = two_sites
    with running(a, insecure=True) as (_, address):
        with client(b, address, peer="site-a", insecure=True) as c:
            info = c.info()
        assert info.insecure
        # a TLS client cannot talk to it by accident
        with client(b, address, peer="site-a") as c, pytest.raises(PeerError) as e:
            c.info()
        assert e.value.status == "UNAVAILABLE"
    with pytest.raises(Exception, match="peer"):
        PeerClient(b.identity, "127.0.0.1:1", insecure=True)


def test_a_peer_that_is_down_is_told_apart_from_a_refused_handshake(two_sites):
    _, b = two_sites
    with client(b, "127.0.0.1:1", peer="site-a") as c, pytest.raises(PeerError) as e:
        c.info()
    assert e.value.status == "UNAVAILABLE" and "down or unreachable" in str(e.value)


# ------------------------------------------------------------------------ certificate rotation


def test_rotation_keeps_working_through_the_overlap_and_retires_the_old_certificate(tmp_path, capsys):
    """site-b rolls its certificate with the command: stage, site-a pins the new one beside the
    old, site-b activates (restart), site-a retires the old pin. Calls work in both directions
    at every step; after the promote the old certificate is refused, even on an open connection."""
    from peer.cli import main
    from peer.net.identity import load_identity

    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b")
    pin_each_other(a, b)
    old_b = b.identity
    assert main(["peer", "rotate", "--dir", str(b.identity_dir)]) == 0
    staged = load_identity(b.identity_dir / "next")
    assert staged.name == "site-b" and staged.fingerprint != old_b.fingerprint
    assert b.identity.fingerprint == old_b.fingerprint  # not in use yet
    assert main(["peer", "rotate", "--dir", str(b.identity_dir)]) == 2  # one rotation at a time
    assert (
        main(
            [
                "peer",
                "trust",
                "add",
                str(b.identity_dir / "next" / "site.crt"),
                "--beside",
                "--dir",
                str(a.identity_dir),
            ]
        )
        == 0
    )
    assert main(["peer", "trust", "list", "--dir", str(a.identity_dir)]) == 0
    listing = capsys.readouterr().out
    assert listing.count("site-b\t") == 2 and "next (rotation)" in listing
    with running(a) as (_, addr_a):
        with running(b) as (_, addr_b):  # still the old certificate: works as before
            with client(b, addr_a, "site-a") as c:
                assert c.info().name == "site-a"
            with client(a, addr_b, "site-b") as c:
                assert c.weights("mlp", epsilon=2.0, delta=1e-5).receipt is not None
        old_conn = PeerClient(old_b, addr_a, peer="site-a", trust=TrustStore(b.identity_dir / "trusted"))
        assert old_conn.info().name == "site-a"  # opened with the old certificate
        assert main(["peer", "rotate", "--dir", str(b.identity_dir), "--activate"]) == 0
        assert b.identity.fingerprint == staged.fingerprint
        assert len(list((b.identity_dir / "retired").glob("*/site.crt"))) == 1
        with running(b) as (_, addr_b):  # restarted with the new certificate
            with client(b, addr_a, "site-a") as c:  # a accepts b's new certificate (the +next pin)
                assert c.info().name == "site-a"
            with client(a, addr_b, "site-b") as c:  # a dials b: TLS and the receipt check accept it
                assert c.weights("mlp", epsilon=2.0, delta=1e-5).receipt.signer == "site-b"
            assert old_conn.info().name == "site-a"  # the overlap: the old one still works
            assert main(["peer", "trust", "promote", "site-b", "--dir", str(a.identity_dir)]) == 0
            with pytest.raises(PeerError) as e:
                old_conn.info()
            assert e.value.status == "UNAUTHENTICATED"
            with client(b, addr_a, "site-a") as c:
                assert c.info().name == "site-a"
            with client(a, addr_b, "site-b") as c:
                assert c.weights("mlp", epsilon=2.0, delta=1e-5).receipt is not None
        old_conn.close()
    assert [p.fingerprint for p in TrustStore(a.identity_dir / "trusted").pins_of("site-b")] == [staged.fingerprint]


def test_a_running_daemon_serves_its_rotated_certificate_without_a_restart(tmp_path):
    """After `peer rotate --activate` the daemon takes the new pair at the next TLS handshake
    (no restart): new connections see the new certificate and receipts signed with the new key;
    once the peer promotes the new pin, calls keep working. Files that do not load (caught
    mid-rotation, a certificate of another site) leave the current pair in use."""
    from peer.cli import main
    from peer.net.identity import init_identity, load_identity

    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b")
    pin_each_other(a, b)
    old_b = b.identity
    assert main(["peer", "rotate", "--dir", str(b.identity_dir)]) == 0
    staged = load_identity(b.identity_dir / "next")
    beside = ["peer", "trust", "add", str(b.identity_dir / "next" / "site.crt"), "--beside", "--dir"]
    assert main([*beside, str(a.identity_dir)]) == 0
    with running(b) as (daemon, addr_b):
        with client(a, addr_b, "site-b") as c:
            assert c.info().certificate_sha256 == old_b.fingerprint
        assert main(["peer", "rotate", "--dir", str(b.identity_dir), "--activate"]) == 0
        with client(a, addr_b, "site-b") as c:  # a new connection: a new handshake
            assert c.info().certificate_sha256 == staged.fingerprint
            assert c.weights("mlp", epsilon=2.0, delta=1e-5).receipt.signer == "site-b"
        assert daemon.site.identity.fingerprint == staged.fingerprint
        assert main(["peer", "trust", "promote", "site-b", "--dir", str(a.identity_dir)]) == 0
        with client(a, addr_b, "site-b") as c:  # a now trusts only the new certificate
            assert c.weights("mlp", epsilon=2.0, delta=1e-5).receipt is not None
        # a certificate of another site written over site.crt: refused, the pair in use stays
        other = init_identity(tmp_path / "other", "site-x", ["127.0.0.1"])
        (b.identity_dir / "site.crt").write_bytes(other.cert_pem)
        assert daemon.site.refresh_identity() is None
        assert daemon.site.identity.fingerprint == staged.fingerprint
        with client(a, addr_b, "site-b") as c:
            assert c.info().certificate_sha256 == staged.fingerprint
