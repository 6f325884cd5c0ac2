"""Pinned trust: a directory of other sites' certificates, like SSH known_hosts.

A site trusts exactly the certificates in its trust directory, each file ``NAME.crt`` holding
the self-signed certificate of site NAME (its common name). There is no CA and no chain: TLS
verifies a peer's certificate against this set (each certificate is its own trust anchor, and
CA:FALSE keeps it from vouching for any other), and every call is then bound to a site by the
SHA-256 fingerprint of the exact certificate presented (``TrustStore.by_fingerprint``).

Adding a pin shows the fingerprint; compare it with the one the other site reads out from
``privfusion peer init`` over a channel you trust (phone, signed mail).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from coordinator_free.identity import (certificate_name, check_site_name, check_validity, fingerprint,
                                       load_certificate)
from peer.errors import FailedPrecondition, InvalidArgument, NotFound

SUFFIX = ".crt"


@dataclass(frozen=True)
class PinnedPeer:
    name: str
    fingerprint: str
    cert_pem: bytes
    path: Path


def _check_profile(cert: x509.Certificate, field: str) -> None:
    """A pinnable certificate is a self-signed end-entity certificate whose CN is a site name."""
    check_site_name(certificate_name(cert), f"{field}.subject.CN")
    if cert.issuer != cert.subject:
        raise InvalidArgument(field, "must be self-signed (issuer == subject); PrivFusion pins site certificates, not CAs")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is not None and bc.ca:
        raise InvalidArgument(field, "is a CA certificate (BasicConstraints CA:TRUE); pin a site's own certificate")


class TrustStore:
    """The pinned certificates of one site (a directory of ``NAME.crt`` files)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def _path(self, name: str) -> Path:
        return self.directory / f"{check_site_name(name)}{SUFFIX}"

    def add(self, cert_pem: bytes, name: str | None = None, replace: bool = False) -> PinnedPeer:
        """Pin a certificate under the site name in its CN (``name``, if given, must match it).

        Refuses a certificate that has expired or is not yet valid, one that is not a
        self-signed site certificate, and (unless ``replace``) a name already pinned to a
        different certificate: a changed key is exactly what pinning exists to notice.
        """
        cert = load_certificate(cert_pem)
        _check_profile(cert, "certificate")
        cn = certificate_name(cert)
        if name is not None and name != cn:
            raise InvalidArgument("name", f"the certificate is for {cn!r}, not {name!r}")
        check_validity(cert)
        pem = cert.public_bytes(serialization.Encoding.PEM)
        fp = fingerprint(pem)
        path = self._path(cn)
        if path.exists():
            old = fingerprint(path.read_bytes())
            if old == fp:
                return PinnedPeer(cn, fp, pem, path)
            if not replace:
                raise FailedPrecondition(f"{cn!r} is already pinned with fingerprint {old}; the new certificate has {fp} "
                                         "(use --replace only if that site really changed its key)")
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{cn}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return PinnedPeer(cn, fp, pem, path)

    def remove(self, name: str) -> None:
        path = self._path(name)
        if not path.exists():
            raise NotFound(f"{name!r} is not pinned in {str(self.directory)!r}")
        path.unlink()

    def peers(self) -> dict[str, PinnedPeer]:
        """Every pinned site by name. A file whose CN differs from its name is refused loudly."""
        out: dict[str, PinnedPeer] = {}
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            pem = path.read_bytes()
            cert = load_certificate(pem, str(path))
            name = certificate_name(cert)
            if path.stem != name:
                raise InvalidArgument(str(path), f"holds the certificate of {name!r}; pinned files are named NAME{SUFFIX}")
            out[name] = PinnedPeer(name, fingerprint(pem), pem, path)
        return out

    def get(self, name: str) -> PinnedPeer:
        peer = self.peers().get(name)
        if peer is None:
            raise NotFound(f"site {name!r} is not pinned in {str(self.directory)!r} (run `privfusion peer trust add`)")
        return peer

    def by_fingerprint(self, fp: str) -> PinnedPeer | None:
        for peer in self.peers().values():
            if peer.fingerprint == fp:
                return peer
        return None

    def bundle(self) -> bytes:
        """All pinned certificates concatenated (PEM): the TLS trust anchors."""
        return b"".join(p.cert_pem for p in self.peers().values())

    def version(self) -> tuple:
        """Changes whenever a pin is added, replaced or removed (to reload TLS trust lazily)."""
        out = []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return ()
        for e in entries:
            if not e.name.endswith(SUFFIX):
                continue
            try:
                st = e.stat()
            except FileNotFoundError:  # removed while we looked: it is not pinned any more
                continue
            out.append((e.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(sorted(out))
