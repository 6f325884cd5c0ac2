"""Pinned trust: a directory of other sites' certificates, like SSH known_hosts.

A site trusts exactly the certificates in its trust directory, each file ``NAME.crt`` holding
the self-signed certificate of site NAME (its common name). There is no CA and no chain: TLS
verifies a peer's certificate against this set (each certificate is its own trust anchor, and
CA:FALSE keeps it from vouching for any other), and every call is then bound to a site by the
SHA-256 fingerprint of the exact certificate presented (``TrustStore.by_fingerprint``).

Certificate rotation (``privfusion peer rotate``) needs an overlap: while a site moves to a new
key, its peers hold two pins for it, ``NAME.crt`` (the certificate it uses now) and
``NAME+next.crt`` (the one it will use; ``add(..., beside=True)``). Both are TLS trust anchors
and both bind calls to NAME; ``promote(NAME)`` then retires the old pin. ``+`` never occurs in
a site name, so the two files cannot be confused with another site's.

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

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound
from peer.net.identity import certificate_name, check_site_name, check_validity, fingerprint, load_certificate

__all__ = ["PinnedPeer", "TrustStore"]

SUFFIX = ".crt"
NEXT = "+next"  # NAME+next.crt: the certificate NAME is rotating to


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
        raise InvalidArgument(
            field, "must be self-signed (issuer == subject); PrivFusion pins site certificates, not CAs"
        )
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

    def _path(self, name: str, next_: bool = False) -> Path:
        return self.directory / f"{check_site_name(name)}{NEXT if next_ else ''}{SUFFIX}"

    def add(self, cert_pem: bytes, name: str | None = None, replace: bool = False, beside: bool = False) -> PinnedPeer:
        """Pin a certificate under the site name in its CN (``name``, if given, must match it).

        Refuses a certificate that has expired or is not yet valid, one that is not a
        self-signed site certificate, and (unless ``replace``) a name already pinned to a
        different certificate: a changed key is exactly what pinning exists to notice.
        ``beside``: the site is rotating its certificate; pin the new one next to the old
        (``NAME+next.crt``) so that both are accepted until :meth:`promote`.
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
        if beside and path.exists() and fingerprint(path.read_bytes()) != fp:
            path = self._path(cn, next_=True)
            replace = True  # a newer rotation replaces an unfinished one; the current pin stays
        if path.exists():
            old = fingerprint(path.read_bytes())
            if old == fp:
                return PinnedPeer(cn, fp, pem, path)
            if not replace:
                raise FailedPrecondition(
                    f"{cn!r} is already pinned with fingerprint {old}; the new certificate has {fp} "
                    "(use --replace only if that site really changed its key)"
                )
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{cn}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return PinnedPeer(cn, fp, pem, path)

    def remove(self, name: str) -> None:
        path, following = self._path(name), self._path(name, next_=True)
        if not path.exists() and not following.exists():
            raise NotFound(f"{name!r} is not pinned in {str(self.directory)!r}")
        for p in (path, following):
            p.unlink(missing_ok=True)

    def promote(self, name: str) -> PinnedPeer:
        """End a rotation: ``NAME+next.crt`` becomes NAME's only pin (the old one is retired)."""
        following = self._path(name, next_=True)
        if not following.exists():
            raise NotFound(
                f"{name!r} has no next certificate pinned in {str(self.directory)!r} "
                "(pin it first with `privfusion peer trust add CERT --beside`)"
            )
        pem = following.read_bytes()
        check_validity(load_certificate(pem, str(following)), str(following))
        os.replace(following, self._path(name))
        return PinnedPeer(name, fingerprint(pem), pem, self._path(name))

    def pins(self) -> list[PinnedPeer]:
        """Every pinned certificate, the next ones of rotating sites included. A file whose CN
        differs from its name is refused loudly."""
        out: list[PinnedPeer] = []
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            pem = path.read_bytes()
            cert = load_certificate(pem, str(path))
            name = certificate_name(cert)
            stem = path.stem.removesuffix(NEXT)
            if stem != name:
                raise InvalidArgument(
                    str(path),
                    f"holds the certificate of {name!r}; pinned files are named "
                    f"NAME{SUFFIX} (or NAME{NEXT}{SUFFIX} during a rotation)",
                )
            out.append(PinnedPeer(name, fingerprint(pem), pem, path))
        return out

    def pins_of(self, name: str) -> list[PinnedPeer]:
        """NAME's pins: its current certificate first, then the one it rotates to (if any)."""
        return sorted((p for p in self.pins() if p.name == name), key=lambda p: p.path.stem.endswith(NEXT))

    def peers(self) -> dict[str, PinnedPeer]:
        """Every pinned site by name, with its current certificate (``NAME.crt``)."""
        return {p.name: p for p in self.pins() if not p.path.stem.endswith(NEXT)}

    def get(self, name: str) -> PinnedPeer:
        peer = self.peers().get(name)
        if peer is None:
            raise NotFound(f"site {name!r} is not pinned in {str(self.directory)!r} (run `privfusion peer trust add`)")
        return peer

    def by_fingerprint(self, fp: str) -> PinnedPeer | None:
        for peer in self.pins():
            if peer.fingerprint == fp:
                return peer
        return None

    def bundle(self) -> bytes:
        """All pinned certificates concatenated (PEM): the TLS trust anchors."""
        return b"".join(p.cert_pem for p in self.pins())

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
