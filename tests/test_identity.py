"""Site identities and pinned trust (peer.net.identity, peer.net.trust)."""

import datetime as dt
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound
from peer.cli import main
from peer.net.identity import (
    fingerprint,
    format_fingerprint,
    init_identity,
    load_certificate,
    load_identity,
    verify_signature,
)
from peer.net.trust import TrustStore


def test_init_makes_a_private_key_and_a_pinnable_certificate(tmp_path):
    ident = init_identity(tmp_path / "a", "hospital-a", ["127.0.0.1", "a.example.org"])
    key = tmp_path / "a" / "site.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert = load_certificate(ident.cert_pem)
    assert cert.subject.rfc4514_string() == "CN=hospital-a"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["hospital-a", "a.example.org"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    loaded = load_identity(tmp_path / "a")
    assert loaded.name == "hospital-a" and loaded.fingerprint == ident.fingerprint == fingerprint(ident.cert_pem)


def test_init_refuses_to_overwrite_and_load_refuses_a_readable_key(tmp_path):
    init_identity(tmp_path, "site-a")
    with pytest.raises(FailedPrecondition, match="already holds an identity"):
        init_identity(tmp_path, "site-a")
    (tmp_path / "site.key").chmod(0o644)
    with pytest.raises(FailedPrecondition, match="chmod 600"):
        load_identity(tmp_path)
    with pytest.raises(NotFound):
        load_identity(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["", "Hospital", "a_b", "-a", "a-", "x" * 64, "a..b"])
def test_site_names_must_be_dns_names(tmp_path, name):
    with pytest.raises(InvalidArgument, match="name"):
        init_identity(tmp_path, name)


def test_signatures_verify_only_with_the_signers_certificate(tmp_path):
    a = init_identity(tmp_path / "a", "a")
    b = init_identity(tmp_path / "b", "b")
    sig = a.sign(b"payload")
    verify_signature(a.cert_pem, b"payload", sig)
    with pytest.raises(InvalidArgument, match="signature"):
        verify_signature(a.cert_pem, b"payloaD", sig)
    with pytest.raises(InvalidArgument, match="signature"):
        verify_signature(b.cert_pem, b"payload", sig)


def test_trust_store_pins_by_name_and_fingerprint(tmp_path):
    a = init_identity(tmp_path / "a", "a")
    b = init_identity(tmp_path / "b", "b")
    store = TrustStore(a.trust_dir)
    pinned = store.add(b.cert_pem)
    assert pinned.name == "b" and pinned.fingerprint == b.fingerprint
    assert store.by_fingerprint(b.fingerprint).name == "b"
    assert store.by_fingerprint(a.fingerprint) is None
    assert store.bundle() == b.cert_pem
    v0 = store.version()
    # the same certificate again is a no-op; another key under the same name is refused
    store.add(b.cert_pem)
    other = init_identity(tmp_path / "b2", "b")
    with pytest.raises(FailedPrecondition, match="already pinned"):
        store.add(other.cert_pem)
    store.add(other.cert_pem, replace=True)
    assert store.get("b").fingerprint == other.fingerprint and store.version() != v0
    with pytest.raises(InvalidArgument, match="name"):
        store.add(a.cert_pem, name="c")
    store.remove("b")
    assert store.peers() == {}
    with pytest.raises(NotFound):
        store.get("b")


def test_trust_refuses_expired_and_ca_certificates(tmp_path):
    old = init_identity(tmp_path / "old", "old", days=1, not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    store = TrustStore(tmp_path / "trusted")
    with pytest.raises(FailedPrecondition, match="expired"):
        store.add(old.cert_pem)
    with pytest.raises(InvalidArgument, match="certificate"):
        store.add(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


def test_cli_init_and_trust_add_show_the_fingerprint(tmp_path, capsys):
    assert main(["peer", "init", "--name", "site-a", "--dir", str(tmp_path / "a"), "--address", "127.0.0.1"]) == 0
    assert main(["peer", "init", "--name", "site-b", "--dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    fp_b = format_fingerprint(load_identity(tmp_path / "b").fingerprint)
    assert fp_b in out
    assert main(["peer", "trust", "add", str(tmp_path / "b" / "site.crt"), "--dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "pinned 'site-b'" in out and fp_b in out
    assert main(["peer", "trust", "list", "--dir", str(tmp_path / "a")]) == 0
    assert fp_b in capsys.readouterr().out
    assert main(["peer", "trust", "add", str(tmp_path / "missing.crt"), "--dir", str(tmp_path / "a")]) == 2
    assert "CERT" in capsys.readouterr().err
