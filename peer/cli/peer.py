"""``privfusion peer ...``: a site's identity, its pinned peers, and its daemon.

privfusion peer init --name hospital-a --dir site/identity --address 10.0.0.1 --address a.example.org
privfusion peer trust add other.crt [--dir site/identity] [--replace | --beside]
privfusion peer trust list [--dir site/identity]
privfusion peer trust remove hospital-b [--dir site/identity]
privfusion peer trust promote hospital-b [--dir site/identity]   # end of hospital-b's rotation
privfusion peer rotate --dir site/identity [--address ...] [--days N]   # stage a new key + certificate
privfusion peer rotate --dir site/identity --activate                   # switch to it (a running daemon follows)
privfusion peer serve --config site.toml [--simulation]
privfusion peer health --config site.toml [--timeout S]   # this site's own daemon: exit 0 when SERVING
privfusion peer info --via HOST:PORT --identity DIR [--peer NAME]
privfusion peer ledger --via HOST:PORT --identity DIR [--peer NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peer.base.errors import InvalidArgument
from peer.net.client import HEALTH_SERVICE
from peer.net.identity import (
    CERT_FILE,
    KEY_FILE,
    NEXT_DIR,
    activate_rotation,
    format_fingerprint,
    init_identity,
    load_certificate,
    load_identity,
    stage_rotation,
)
from peer.net.trust import TrustStore


def _init(args) -> int:
    ident = init_identity(args.dir, args.name, args.address, days=args.days)
    print(f"identity of {ident.name!r} in {args.dir}: {KEY_FILE} (mode 600), {CERT_FILE}")
    print(f"certificate SHA-256 fingerprint: {format_fingerprint(ident.fingerprint)}")
    print(
        f"give {Path(args.dir) / CERT_FILE} to the sites you work with; read them this fingerprint over another channel"
    )
    return 0


def _trust_add(args) -> int:
    try:
        pem = Path(args.cert).read_bytes()
    except OSError as e:
        raise InvalidArgument("CERT", f"cannot read {args.cert}: {e.strerror}") from None
    if args.replace and args.beside:
        raise InvalidArgument(
            "--beside",
            "pins a rotating site's next certificate next to its current one; "
            "--replace swaps the current one: give one of them",
        )
    pinned = TrustStore(Path(args.dir) / "trusted").add(pem, name=args.name, replace=args.replace, beside=args.beside)
    print(f"pinned {pinned.name!r} ({pinned.path})")
    print(f"SHA-256 fingerprint: {format_fingerprint(pinned.fingerprint)}")
    print("compare it with the fingerprint the site reads out to you; a running daemon picks it up for new connections")
    return 0


def _trust_list(args) -> int:
    for p in TrustStore(Path(args.dir) / "trusted").pins():
        cert = load_certificate(p.cert_pem)
        role = "\tnext (rotation)" if p.path.stem.endswith("+next") else ""
        print(f"{p.name}\t{format_fingerprint(p.fingerprint)}\tvalid until {cert.not_valid_after_utc.date()}{role}")
    return 0


def _trust_promote(args) -> int:
    pinned = TrustStore(Path(args.dir) / "trusted").promote(args.name)
    print(
        f"{args.name!r} is now pinned only with SHA-256 {format_fingerprint(pinned.fingerprint)}; its old "
        "certificate is no longer accepted (open connections are refused at their next call)"
    )
    return 0


def _rotate(args) -> int:
    d = Path(args.dir)
    if args.activate:
        old, new, retired = activate_rotation(d)
        print(
            f"{new.name!r} now uses the certificate SHA-256 {format_fingerprint(new.fingerprint)}; the old one "
            f"({format_fingerprint(old.fingerprint)}) is in {retired}"
        )
        print(
            "a running daemon serves it from its next TLS handshake (no restart); then ask every peer to run "
            f"`privfusion peer trust promote {new.name}` to retire the old pin"
        )
        return 0
    new = stage_rotation(d, args.address or None, days=args.days)
    print(f"staged a new key and certificate for {new.name!r} in {d / NEXT_DIR} (not in use yet)")
    print(f"certificate SHA-256 fingerprint: {format_fingerprint(new.fingerprint)}")
    print(
        f"1. give {d / NEXT_DIR / CERT_FILE} to every peer: `privfusion peer trust add site.crt --beside` "
        "(both certificates are then accepted); read them this fingerprint over another channel"
    )
    print(f"2. when all have, run `privfusion peer rotate --dir {d} --activate` (a running daemon follows)")
    print(f"3. then each peer runs `privfusion peer trust promote {new.name}`")
    return 0


def _trust_remove(args) -> int:
    TrustStore(Path(args.dir) / "trusted").remove(args.name)
    print(f"unpinned {args.name!r}: new connections from it are refused, open ones at their next call")
    return 0


def _serve(args) -> int:
    from peer.net.daemon import serve

    return serve(args.config, insecure=args.insecure, ready_file=args.ready_file, simulation=args.simulation)


def _own_daemon(path: Path) -> tuple[str, str, Path]:
    """site.toml's ``[site]`` name, listen and identity (read with the one TOML reader, errors
    naming file, line and key). Only these three: a health check runs every few seconds and
    must not pay for loading the daemon's modules (torch); `peer serve` and `site check` check
    the rest of the file."""
    from peer.base.config import Section, load_toml

    data, text = load_toml(path, "site config")
    site = Section(data, (), text, str(path)).section("site", required=True)
    return site.string("name"), site.string("listen"), site.path("identity", path.resolve().parent)


def _own_address(listen: str) -> str:
    """Where this site's own daemon is reached from this machine: a wildcard listen address
    (0.0.0.0, [::], empty host) is dialled on loopback; a named host as written."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise InvalidArgument("site.listen", f'must be HOST:PORT (e.g. "0.0.0.0:50051"), got {listen!r}')
    if port == "0":
        raise InvalidArgument(
            "site.listen", f"has port 0 (a port chosen at start), so there is no fixed port to check; got {listen!r}"
        )
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"{host}:{port}"


def _health(args) -> int:
    """Ask this site's own daemon (site.toml's listen address, on loopback when it listens on
    every address) for the standard gRPC health status of ``privfusion.v1.Peer``, over mutual TLS
    with the site's own key (``peer.net.client.own_daemon_health``). Exit 0 when SERVING, 1 with
    the reason otherwise (not listening, not SERVING, another key answering)."""
    from peer.net.client import own_daemon_health

    if args.timeout <= 0:
        raise InvalidArgument("--timeout", f"must be > 0 seconds, got {args.timeout:g}")
    name, listen, identity_dir = _own_daemon(Path(args.config))
    identity = load_identity(identity_dir)
    address = _own_address(listen)
    why = own_daemon_health(identity, address, args.timeout, insecure=args.insecure)
    if why is not None:
        print(f"privfusion peer health: {name!r} at {address} is not healthy: {why}", file=sys.stderr)
        return 1
    print(f"{name}: {HEALTH_SERVICE} SERVING at {address}")
    return 0


def client_from_args(args):
    """A PeerClient from the common --via/--identity/--peer/--insecure options."""
    from peer.net.client import PeerClient

    return PeerClient(load_identity(args.identity), args.via, peer=args.peer, insecure=args.insecure)


def add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--via", required=True, metavar="HOST:PORT", help="the peer to ask")
    p.add_argument(
        "--identity", required=True, metavar="DIR", help="this site's identity directory (privfusion peer init)"
    )
    p.add_argument(
        "--peer",
        metavar="NAME",
        help="the pinned site expected at --via (default: the one pinned certificate naming that host)",
    )
    p.add_argument("--insecure", action="store_true", help="no TLS (test networks only; loud)")


def _info(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from peer.net.messages import peer_info_message

    with client_from_args(args) as c:
        info = c.info()
    # printed as the message it came in (its proto3 JSON form): the answer encodes back to itself
    message = peer_info_message(info)
    print(json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2, sort_keys=True))
    return 0


def _ledger(args) -> int:
    with client_from_args(args) as c:
        entries = c.ledger()
    print(
        json.dumps(
            [{"entry_id": e, "created_at": at, "record": r.to_dict()} for e, r, at in entries], indent=2, sort_keys=True
        )
    )
    return 0


def register(subparsers) -> None:
    peer = subparsers.add_parser("peer", help="this site's identity, pinned peers and daemon")
    sub = peer.add_subparsers(dest="peer_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("init", help="make this site's key pair and self-signed certificate")
    p.add_argument("--name", required=True, help="the site name (certificate CN and DNS SAN)")
    p.add_argument("--dir", required=True, help="identity directory to create")
    p.add_argument("--address", action="append", default=[], help="a host or IP the site is dialled by (repeatable)")
    p.add_argument("--days", type=int, default=730, help="certificate validity in days (default 730)")
    p.set_defaults(func=_init)

    trust = sub.add_parser("trust", help="pin, list or unpin other sites' certificates")
    tsub = trust.add_subparsers(dest="trust_command", metavar="ACTION")
    tsub.required = True
    p = tsub.add_parser("add", help="pin another site's certificate")
    p.add_argument("cert", metavar="CERT", help="the other site's certificate (PEM)")
    p.add_argument("--dir", default=".", help="this site's identity directory (default .)")
    p.add_argument("--name", help="expected site name (must be the certificate's CN)")
    p.add_argument("--replace", action="store_true", help="replace a different certificate pinned under that name")
    p.add_argument(
        "--beside",
        action="store_true",
        help="the site is rotating its certificate: pin the new one next to the old (both accepted)",
    )
    p.set_defaults(func=_trust_add)
    p = tsub.add_parser("list", help="list pinned sites and fingerprints")
    p.add_argument("--dir", default=".", help="this site's identity directory (default .)")
    p.set_defaults(func=_trust_list)
    p = tsub.add_parser("remove", help="unpin a site")
    p.add_argument("name")
    p.add_argument("--dir", default=".", help="this site's identity directory (default .)")
    p.set_defaults(func=_trust_remove)
    p = tsub.add_parser("promote", help="end a site's rotation: its next certificate becomes its only pin")
    p.add_argument("name")
    p.add_argument("--dir", default=".", help="this site's identity directory (default .)")
    p.set_defaults(func=_trust_promote)

    p = sub.add_parser("rotate", help="roll this site's certificate with an overlap window (stage, then --activate)")
    p.add_argument("--dir", required=True, help="this site's identity directory")
    p.add_argument("--activate", action="store_true", help="switch to the staged key and certificate")
    p.add_argument(
        "--address",
        action="append",
        default=[],
        help="a host or IP the site is dialled by (repeatable; default: those of the current certificate)",
    )
    p.add_argument("--days", type=int, default=730, help="validity of the new certificate in days (default 730)")
    p.set_defaults(func=_rotate)

    p = sub.add_parser("serve", help="run this site's peer daemon")
    p.add_argument("--config", required=True, help="site.toml")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve WITHOUT TLS: no authentication, no encryption (sealed test networks only; warns loudly)",
    )
    p.add_argument(
        "--simulation",
        action="store_true",
        help="allow a fixed noise seed (site.seed, pool models of `pool train --seed`, stored releases drawn "
        "with one) for simulations and tests: NOT PRIVATE, said in logs, peer info and every record; without "
        "this flag each is refused at start-up, by name",
    )
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.set_defaults(func=_serve)

    p = sub.add_parser("health", help="check this site's own daemon (gRPC health, its own key): exit 0 when SERVING")
    p.add_argument("--config", required=True, help="site.toml (its [site] listen and identity)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    p.add_argument("--insecure", action="store_true", help="the daemon serves without TLS (peer serve --insecure)")
    p.set_defaults(func=_health)

    p = sub.add_parser("info", help="ask a peer who it is, what it offers and what budget it shows")
    add_client_options(p)
    p.set_defaults(func=_info)

    p = sub.add_parser("ledger", help="a peer's ledger entries charged to this site")
    add_client_options(p)
    p.set_defaults(func=_ledger)
