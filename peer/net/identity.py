"""A site's identity: an ECDSA P-256 key pair and a self-signed X.509 certificate.

There is no certificate authority. Each site makes its own key and certificate once
(``privfusion peer init``) and hands the certificate (never the key) to the sites it works
with, which pin it (``peer.net.trust``). The certificate is what TLS presents in both
directions (mutual TLS) and what release receipts are verified against.

Certificate profile (why each part is there):

- subject CN = the site name; SANs = DNS:<name> (so a client can dial any address and still
  check the name with ``grpc.ssl_target_name_override``) plus every address the site will be
  dialled by (IP or DNS);
- BasicConstraints CA:FALSE (critical): a pinned certificate can never act as an issuer, so a
  pinned site cannot mint certificates that the TLS layer would accept for someone else;
- ExtendedKeyUsage serverAuth + clientAuth: the same certificate serves and dials;
- KeyUsage digitalSignature: TLS 1.3 handshakes and receipt signatures are all it signs.

Layout of an identity directory::

    site.key      PKCS#8 PEM private key, mode 0600
    site.crt      the self-signed certificate (PEM)
    trusted/      pinned peer certificates, NAME.crt (peer.net.trust)
    next/         during a rotation: the new site.key and site.crt, not yet in use
    retired/      certificates (and keys) rotated out, one folder per rotation

Rotation (``privfusion peer rotate``) has an overlap window: :func:`stage_rotation` makes the
new key and certificate in ``next/`` while the old ones stay in use; the peers pin the new
certificate *beside* the old one (both are accepted); :func:`activate_rotation` then moves the
new pair in place (the daemon serves it after a restart) and the old one to ``retired/``; last,
the peers retire the old pin (``privfusion peer trust promote NAME``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound

__all__ = [
    "CERT_FILE",
    "KEY_FILE",
    "NEXT_DIR",
    "SIGNATURE_ALGORITHM",
    "Identity",
    "activate_rotation",
    "certificate_name",
    "check_site_name",
    "check_validity",
    "fingerprint",
    "format_fingerprint",
    "init_identity",
    "load_certificate",
    "load_identity",
    "make_certificate",
    "stage_rotation",
    "verify_signature",
]

KEY_FILE = "site.key"
CERT_FILE = "site.crt"
TRUST_DIR = "trusted"
NEXT_DIR = "next"
RETIRED_DIR = "retired"
SIGNATURE_ALGORITHM = "ecdsa-p256-sha256"
DEFAULT_VALIDITY_DAYS = 730
# A DNS label-compatible site name: it is also a DNS SAN of the site's certificate.
SITE_NAME_RULE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$")


def check_site_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or len(name) > 253 or not SITE_NAME_RULE.match(name):
        raise InvalidArgument(
            field,
            "must be a DNS-style site name (lowercase letters, digits, '-', '.'; "
            f"labels start and end with a letter or digit), got {name!r}",
        )
    return name


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the certificate's DER encoding, lowercase hex (what is pinned and shown)."""
    return hashlib.sha256(load_certificate(cert_pem).public_bytes(serialization.Encoding.DER)).hexdigest()


def format_fingerprint(fp: str) -> str:
    """The fingerprint as colon-separated upper-case byte pairs (how people compare them)."""
    return ":".join(fp[i : i + 2] for i in range(0, len(fp), 2)).upper()


def load_certificate(cert_pem: bytes, field: str = "certificate") -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(field, f"is not a PEM X.509 certificate: {e}") from None


def certificate_name(cert: x509.Certificate) -> str:
    """The site name a certificate is for (its subject common name)."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        raise InvalidArgument("certificate.subject", "must have exactly one common name (the site name)")
    return str(cns[0].value)


def _san_entry(address: str) -> x509.GeneralName:
    host = address.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not re.match(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})$", host):
        raise InvalidArgument("address", f"must be an IP address or a DNS name (no port), got {address!r}")
    return x509.DNSName(host.lower())


def make_certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    addresses: Iterable[str] = (),
    not_before: _dt.datetime | None = None,
    days: int = DEFAULT_VALIDITY_DAYS,
    valid_for: _dt.timedelta | None = None,
) -> bytes:
    """A self-signed certificate for ``name`` (PEM), valid for ``days`` (or exactly
    ``valid_for``, e.g. seconds in tests of expiry) from ``not_before``."""
    check_site_name(name)
    if isinstance(days, bool) or not isinstance(days, int) or days <= 0:
        raise InvalidArgument("days", f"must be a positive integer, got {days!r}")
    if valid_for is not None and valid_for <= _dt.timedelta(0):
        raise InvalidArgument("valid_for", f"must be a positive duration, got {valid_for!r}")
    start = not_before or (_dt.datetime.now(_dt.UTC) - _dt.timedelta(minutes=5))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    sans: list[x509.GeneralName] = [x509.DNSName(name)]
    for a in addresses:
        entry = _san_entry(a)
        if entry not in sans:
            sans.append(entry)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + (valid_for if valid_for is not None else _dt.timedelta(days=days)))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def check_validity(cert: x509.Certificate, field: str = "certificate", now: _dt.datetime | None = None) -> None:
    now = now or _dt.datetime.now(_dt.UTC)
    if now < cert.not_valid_before_utc:
        raise FailedPrecondition(f"{field}: not valid before {cert.not_valid_before_utc.isoformat()}")
    if now > cert.not_valid_after_utc:
        raise FailedPrecondition(f"{field}: expired on {cert.not_valid_after_utc.isoformat()}")


@dataclass(frozen=True)
class Identity:
    """A site's name, key and certificate, loaded from its identity directory."""

    name: str
    directory: Path
    key_pem: bytes
    cert_pem: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_pem)

    @property
    def trust_dir(self) -> Path:
        return self.directory / TRUST_DIR

    def sign(self, payload: bytes) -> bytes:
        """ECDSA P-256 / SHA-256 signature (DER) over ``payload``."""
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        return key.sign(payload, ec.ECDSA(hashes.SHA256()))


def verify_signature(cert_pem: bytes, payload: bytes, signature: bytes) -> None:
    """Check an ECDSA P-256 / SHA-256 signature against a certificate's public key.

    Raises ``InvalidArgument("signature", ...)`` when it does not verify; the caller decides
    what a forged receipt means for it.
    """
    key = load_certificate(cert_pem).public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise InvalidArgument("certificate", "must hold an elliptic-curve public key")
    try:
        key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise InvalidArgument("signature", "does not verify against the signer's pinned certificate") from None


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o600)  # the umask cannot widen it, but make the mode explicit


def init_identity(
    directory: str | os.PathLike,
    name: str,
    addresses: Iterable[str] = (),
    days: int = DEFAULT_VALIDITY_DAYS,
    not_before: _dt.datetime | None = None,
    valid_for: _dt.timedelta | None = None,
) -> Identity:
    """Create a key pair and a self-signed certificate for site ``name`` in ``directory``.

    Refuses to overwrite an existing identity (a new key would silently invalidate every pin
    other sites hold). ``addresses`` are the hosts/IPs the site will be dialled by.
    """
    check_site_name(name)
    d = Path(directory)
    if (d / KEY_FILE).exists() or (d / CERT_FILE).exists():
        raise FailedPrecondition(
            f"{d}: already holds an identity ({KEY_FILE}/{CERT_FILE}); remove it first to make a new one"
        )
    d.mkdir(parents=True, exist_ok=True)
    (d / TRUST_DIR).mkdir(exist_ok=True)
    return _write_identity(d, name, addresses, days, not_before, valid_for)


def _write_identity(
    d: Path, name: str, addresses: Iterable[str], days: int, not_before=None, valid_for=None
) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    cert_pem = make_certificate(name, key, addresses, not_before=not_before, days=days, valid_for=valid_for)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_private(d / KEY_FILE, key_pem)
    (d / CERT_FILE).write_bytes(cert_pem)
    return Identity(name, d, key_pem, cert_pem)


def certificate_addresses(cert: x509.Certificate) -> list[str]:
    """The hosts and IPs a certificate names besides the site name (its SANs)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    name = certificate_name(cert)
    return [str(v) for v in sans.get_values_for_type(x509.IPAddress)] + [
        v for v in sans.get_values_for_type(x509.DNSName) if v != name
    ]


def stage_rotation(
    directory: str | os.PathLike,
    addresses: Iterable[str] | None = None,
    days: int = DEFAULT_VALIDITY_DAYS,
    valid_for: _dt.timedelta | None = None,
) -> Identity:
    """Start a certificate rotation: a new key and certificate in ``DIR/next`` (same site name;
    the current certificate's addresses unless ``addresses`` are given). The current pair stays
    in use until :func:`activate_rotation`; meanwhile the peers pin the new certificate beside
    the old one. Refuses a second staged rotation (its certificate may already be pinned)."""
    current = load_identity(directory)
    nxt = current.directory / NEXT_DIR
    if (nxt / KEY_FILE).exists() or (nxt / CERT_FILE).exists():
        raise FailedPrecondition(
            f"{nxt}: a rotation is already staged; activate it (`privfusion peer rotate "
            f"--activate`) or remove {nxt} to start over"
        )
    if addresses is None:
        addresses = certificate_addresses(load_certificate(current.cert_pem))
    nxt.mkdir(exist_ok=True)
    return _write_identity(nxt, current.name, addresses, days, valid_for=valid_for)


def activate_rotation(directory: str | os.PathLike) -> tuple[Identity, Identity, Path]:
    """Finish a rotation at the site: the staged pair becomes ``site.key``/``site.crt`` and the
    old pair moves to ``retired/<UTC time>/``. Returns (old, new, retired folder)."""
    current = load_identity(directory)
    d = current.directory
    staged = load_identity(d / NEXT_DIR)
    if staged.name != current.name:
        raise FailedPrecondition(f"{d / NEXT_DIR} holds an identity of {staged.name!r}, not {current.name!r}")
    check_validity(load_certificate(staged.cert_pem), f"{d / NEXT_DIR / CERT_FILE}")
    retired = d / RETIRED_DIR / _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    retired.mkdir(parents=True)
    for f in (KEY_FILE, CERT_FILE):
        os.replace(d / f, retired / f)
        os.replace(d / NEXT_DIR / f, d / f)
    (d / NEXT_DIR).rmdir()
    return current, load_identity(d), retired


def load_identity(directory: str | os.PathLike) -> Identity:
    """Load a site's identity; refuses a key file others can read and a key/certificate mismatch."""
    d = Path(directory)
    kpath, cpath = d / KEY_FILE, d / CERT_FILE
    if not kpath.is_file() or not cpath.is_file():
        raise NotFound(f"identity directory {str(d)!r} has no {KEY_FILE}/{CERT_FILE} (run `privfusion peer init`)")
    mode = kpath.stat().st_mode & 0o777
    if mode & 0o077:
        raise FailedPrecondition(f"{kpath}: mode {oct(mode)} lets others read the private key; chmod 600 it")
    key_pem, cert_pem = kpath.read_bytes(), cpath.read_bytes()
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(KEY_FILE, f"is not a PEM private key: {e}") from None
    cert = load_certificate(cert_pem, CERT_FILE)
    if (
        not isinstance(key, ec.EllipticCurvePrivateKey)
        or key.public_key().public_numbers() != cert.public_key().public_numbers()
    ):
        raise InvalidArgument(CERT_FILE, f"does not belong to the key in {KEY_FILE}")
    return Identity(check_site_name(certificate_name(cert), CERT_FILE), d, key_pem, cert_pem)
