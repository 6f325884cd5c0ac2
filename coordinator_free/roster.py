"""The roster: the sites that fuse together, where each listens and which certificate it holds.

A roster is membership only — no site is in charge of it, and every site keeps its own copy.
``roster.toml`` (paths relative to the file)::

    [sites.hospital-a]
    address = "10.0.0.1:50051"           # HOST:PORT the site's daemon listens on
    certificate = "certs/hospital-a.crt" # its self-signed certificate (PEM)
    # model = "mlp"                      # the model to ask it for (default: its model whose
    #                                    #   architecture equals ours, found with GetPeerInfo)
    # pool = "dp-pool"                   # its DP-SGD pool for merges (default: one whose
    #                                    #   architecture equals ours)

    [sites.hospital-b]
    ...

The roster names certificates; trust is still the pinned set (``peer.net.trust``). A
round refuses to talk to a roster site whose certificate is not pinned, or is pinned with a
different fingerprint (:meth:`Roster.check_pins`): pinning stays a deliberate act
(``privfusion roster pin`` pins every roster certificate at once, showing fingerprints).
The site running a round may appear in the roster (one shared file for everyone); it is
skipped as a peer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from peer.base.config import Section, load_toml
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.net.identity import certificate_name, check_site_name, fingerprint, load_certificate
from peer.net.trust import PinnedPeer, TrustStore


@dataclass(frozen=True)
class RosterSite:
    name: str
    address: str
    certificate: Path
    cert_pem: bytes
    fingerprint: str
    model: str | None = None
    pool: str | None = None


@dataclass(frozen=True)
class Roster:
    sites: dict[str, RosterSite]
    path: Path | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Roster:
        p = Path(path)
        data, text = load_toml(p, "roster")
        root = Section(data, (), text, str(p))
        root.known(["sites"])
        base = p.resolve().parent
        sites: dict[str, RosterSite] = {}
        for name, s in root.sections("sites").items():
            try:
                check_site_name(name)
            except InvalidArgument as e:
                s.fail((), e.rule)
            s.known(["address", "certificate", "model", "pool"])
            address = s.string("address")
            if ":" not in address or not address.rsplit(":", 1)[1].isdigit():
                s.fail("address", f"must be HOST:PORT, got {address!r}")
            cert_path = s.path("certificate", base)
            try:
                pem = cert_path.read_bytes()
            except OSError as e:
                s.fail("certificate", f"cannot read {cert_path}: {e.strerror}")
            try:
                cn = certificate_name(load_certificate(pem))
            except InvalidArgument as e:
                s.fail("certificate", f"{cert_path}: {e.rule}")
            if cn != name:
                s.fail("certificate", f"{cert_path} is the certificate of {cn!r}, not {name!r}")
            model, pool = s.string("model", None), s.string("pool", None)
            for key, value in (("model", model), ("pool", pool)):
                if value is not None:
                    try:
                        from peer.nn.store import check_name  # here: the store imports torch

                        check_name(value)
                    except InvalidArgument as e:
                        s.fail(key, e.rule)
            sites[name] = RosterSite(name, address, cert_path, pem, fingerprint(pem), model, pool)
        if not sites:
            root.fail("sites", "the roster lists no sites ([sites.NAME] tables)")
        return cls(sites, p)

    def peers_of(self, me: str) -> list[RosterSite]:
        """Every roster site except ``me``, in roster order."""
        return [s for n, s in self.sites.items() if n != me]

    def check_pins(self, trust: TrustStore, me: str) -> None:
        """FailedPrecondition unless every peer's roster certificate is pinned for it (its current
        pin, or the next one while it rotates its certificate)."""
        pinned = trust.peers()
        problems = []
        for s in self.peers_of(me):
            p = pinned.get(s.name)
            if p is None:
                problems.append(f"{s.name!r} is not pinned")
            elif p.fingerprint != s.fingerprint and s.fingerprint not in {q.fingerprint for q in trust.pins_of(s.name)}:
                problems.append(
                    f"{s.name!r} is pinned with SHA-256 {p.fingerprint}, the roster's {s.certificate} has {s.fingerprint}"
                )
        if problems:
            raise FailedPrecondition(
                f"roster {self.path}: "
                + "; ".join(problems)
                + " (pin with `privfusion roster pin` or `privfusion peer trust add` after "
                "comparing fingerprints with each site)"
            )

    def pin_all(self, trust: TrustStore, me: str) -> list[PinnedPeer]:
        """Pin every peer's certificate (refuses one already pinned with another key)."""
        return [trust.add(s.cert_pem, name=s.name) for s in self.peers_of(me)]


def write_roster(path: str | os.PathLike, sites: list[tuple[str, str, str]]) -> Path:
    """Write a roster file from (name, address, certificate path relative to the file)."""
    lines = ["# Sites that fuse together: address and certificate of each (privfusion roster)."]
    for name, address, cert in sites:
        check_site_name(name)
        lines += ["", f'[sites."{name}"]', f'address = "{address}"', f'certificate = "{cert}"']
    p = Path(path)
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p
