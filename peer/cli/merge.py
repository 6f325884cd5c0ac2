"""``privfusion merge``: release an RS or LC merge of a pool at a target (ε′, δ′).

    privfusion merge --pool POOL --target-epsilon E --delta D --method rs|lc --out FILE
                     [--selection public-prior|utility] [--validation pool|FILE.npz]
                     [--figure pld|rdp] [--seed N] [--json]

π / λ are chosen from public information by default (``--selection public-prior``: the models'
training records and their declared ``prior_utility``, else each model's own ε); ``--selection
utility`` scores a public subset of the models on ``--validation`` and is charged (and recorded)
as the composition of that subset (``peer.dp.merging``).

Writes FILE (safetensors weights; the manifest beside it holds the release record) and
FILE-stem.record.json (the release record alone), and prints what was achieved. The request is
built from the arguments by ``merge_request``; ``obtain_merge`` serves it from a local pool.
A merge of a bare pool directory is made outside any site's ledger: nothing records it in a
budget. The command says so loudly on stderr, and the output says ``"charged": false`` (the
JSON printed and the model's metadata); whoever holds it must account for it.

    privfusion merge --site DIR --pool NAME --for SITE --target-epsilon E --delta D --method rs|lc
                     --out FILE [--json]

releases through the site's release desk instead (``peer.desk``), as its daemon would for SITE:
the site's policy, its pool NAME's selection (site.toml), CSPRNG noise, its ledger (charged to
SITE's budgets, or served again when the identical release was made before) and a receipt
signed with the site's key; FILE and FILE-stem.json are written as ``--via`` writes them
(``privfusion release verify`` checks them). The site's daemon must not be running (one ledger,
one writer: the site's lock refuses), else ask it with ``--via``.

    privfusion merge --via HOST:PORT --identity DIR [--peer NAME] --pool NAME --target-epsilon E
                     --delta D --method rs|lc --out FILE [--json]

asks a peer instead: it merges its pool NAME, charges its ledger, and streams the model with its
signed receipt into FILE (FILE-stem.json beside it holds the record and the receipt).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peer.base.errors import InvalidArgument

if TYPE_CHECKING:  # for annotations only: the merge code (torch) is imported when a command runs
    from peer.dp.merging import MergedModel


@dataclass(frozen=True)
class MergeRequest:
    """What the requester asks for: a model at (target_epsilon, delta) by ``method``."""

    method: str
    target_epsilon: float
    delta: float
    figure: str = "pld"
    selection: str = "public-prior"


def merge_request(args: argparse.Namespace) -> MergeRequest:
    return MergeRequest(args.method, args.target_epsilon, args.delta, args.figure, args.selection)


def obtain_merge(request: MergeRequest, args: argparse.Namespace, pool=None) -> MergedModel:
    """Serve the request from the local pool ``args.pool`` (or its models ``pool``, loaded)."""
    from peer.base.rng import make_randomness
    from peer.dp.pools import load_pool, load_validation_file, merge_pool

    pool = load_pool(args.pool) if pool is None else pool
    if request.selection != "utility" and args.validation != "pool":
        raise InvalidArgument(
            "--validation", "scores candidates, which only --selection utility does (charged as the scored models)"
        )
    validation = None if args.validation == "pool" else load_validation_file(args.validation)
    return merge_pool(
        pool,
        request.method,
        request.target_epsilon,
        request.delta,
        selection=request.selection,
        validation=validation,
        figure=request.figure,
        randomness=make_randomness(args.seed),
    )


def run_via(request: MergeRequest, args: argparse.Namespace) -> int:
    """Ask the peer at ``args.via`` for a merge of its pool ``args.pool`` (the remote form)."""
    from peer.cli.peer import client_from_args
    from peer.net.client import save_release, verify_upstream

    if not args.identity:
        raise InvalidArgument("--identity", "is required with --via (this site's identity directory)")
    if args.validation != "pool" or args.seed is not None or args.selection != "public-prior":
        raise InvalidArgument(
            "--via",
            "the peer merges with its own selection, validation split and CSPRNG; --selection, --validation and "
            "--seed are local options",
        )
    with client_from_args(args) as c:
        release = c.merged(
            args.pool, method=request.method, epsilon=request.target_epsilon, delta=request.delta, out=args.out
        )
        weights_path, doc_path = save_release(release, args.out, verify_upstream(release, c.trust))
    record = release.receipt.record
    choice = release.metadata.get("choice", {})
    out = {
        **choice,
        "weights_name": "pi" if request.method == "rs" else "lam",
        "record": record.to_dict(),
        "signer": release.receipt.signer,
        "ledger_entry_id": release.receipt.ledger_entry_id,
        "files": {"weights": str(weights_path), "release": str(doc_path)},
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        weights = ", ".join(f"{w:.4f}" for w in choice.get("weights", []))
        print(
            f"{request.method.upper()} merge of {release.receipt.signer}:{args.pool}: {out['weights_name']} = [{weights}] -> "
            f"{record.mechanism}, epsilon {record.epsilon:.4f} (PLD) at delta {record.delta:g}; "
            f"charged to {release.receipt.signer}'s ledger as entry {release.receipt.ledger_entry_id}; signature verified"
        )
        print(f"wrote {weights_path} and {doc_path}")
    return 0


#: What a merge of a bare pool directory prints on stderr: it is in no budget.
UNCHARGED_WARNING = (
    "WARNING: this merge was made outside any site's ledger and is UNCHARGED: no budget records "
    "it, so releasing it spends privacy nobody accounts for. Account for it yourself, or release "
    "through a site with --site DIR --for SITE (charged to its ledger, with a signed receipt)"
)


def run_site(request: MergeRequest, args: argparse.Namespace) -> int:
    """Release a merge of the site ``args.site``'s pool ``args.pool`` for ``args.counterparty``
    through the site's release desk (policy, make, store, charge or serve again, sign), then
    write it as a received release (``peer.net.client.save_release``)."""
    from pathlib import Path

    from peer.desk.desk import ReleaseDesk
    from peer.desk.requests import MergeRequest as DeskMergeRequest
    from peer.net import wire
    from peer.net.client import save_release
    from peer.net.daemon import open_site
    from peer.net.identity import check_site_name
    from peer.net.signing import wire_transport

    if not args.counterparty:
        raise InvalidArgument("--for", "is required with --site: the site the merge is for (its budgets are charged)")
    check_site_name(args.counterparty, "--for")
    if args.validation != "pool" or args.seed is not None or args.selection != "public-prior" or args.figure != "pld":
        raise InvalidArgument(
            "--site",
            "the site merges with its own selection (site.toml), validation split, figure and CSPRNG; "
            "--selection, --validation, --figure and --seed are options of a bare pool directory",
        )
    site = open_site(Path(args.site) / "site.toml")
    try:
        desk = ReleaseDesk(site, wire_transport(site))
        issued = desk.issue(
            DeskMergeRequest(args.counterparty, args.pool, request.method, request.target_epsilon, request.delta)
        )
        written = False
        try:
            manifest = wire.release_manifest(
                issued.kind, issued.subject, issued.architecture, issued.metadata, issued.tensors, issued.upstream
            )
            release = wire.Release(
                issued.receipt,
                issued.kind,
                issued.subject,
                dict(issued.architecture),
                dict(issued.metadata),
                dict(issued.tensors),
                total_bytes=manifest.total_bytes,
                manifest=manifest,
            )
            weights_path, doc_path = save_release(release, args.out)
            written = True
        finally:
            desk.finish(issued, sent=written)
    finally:
        site.close()
    record, receipt = issued.record, issued.receipt
    choice = issued.metadata.get("choice", {})
    out = {
        **choice,
        "weights_name": "pi" if request.method == "rs" else "lam",
        "record": record.to_dict(),
        "charged": True,
        "signer": receipt.signer,
        "ledger_entry_id": receipt.ledger_entry_id,
        "served_again": issued.served_again,
        "files": {"weights": str(weights_path), "release": str(doc_path)},
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        weights = ", ".join(f"{w:.4f}" for w in choice.get("weights", []))
        how = (
            f"served again at no charge (the identical release of ledger entry {receipt.ledger_entry_id})"
            if issued.served_again
            else f"charged to {receipt.signer}'s ledger as entry {receipt.ledger_entry_id}"
        )
        print(
            f"{request.method.upper()} merge of {receipt.signer}:{args.pool} for {args.counterparty}: "
            f"{out['weights_name']} = [{weights}] -> {record.mechanism}, epsilon {record.epsilon:.4f} (PLD) at "
            f"delta {record.delta:g}; {how}; receipt signed"
        )
        print(f"wrote {weights_path} and {doc_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    with torch_threads(1):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from peer.dp.pools import load_pool, save_merged

    request = merge_request(args)
    if args.via and args.site:
        raise InvalidArgument("--site", "asks this machine's site; --via asks a peer's daemon: give one of them")
    if args.via:
        return run_via(request, args)
    if args.site:
        return run_site(request, args)
    if args.counterparty:
        raise InvalidArgument("--for", "names the site a merge is charged for, which only --site does")
    pool = load_pool(args.pool)
    merged = obtain_merge(request, args, pool)
    weights_path, record_path = save_merged(args.out, merged, pool, charged=False)
    print(f"privfusion merge: {UNCHARGED_WARNING}", file=sys.stderr, flush=True)
    out = {
        **merged.choice.to_dict(),
        "weights_name": "pi" if request.method == "rs" else "lam",
        "record": merged.record.to_dict(),
        "charged": False,
        "files": {"weights": str(weights_path), "record": str(record_path)},
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        eps = merged.choice.epsilon
        weights = ", ".join(f"{w:.4f}" for w in merged.choice.weights)
        selection = merged.choice.selection or {}
        if selection.get("kind") == "utility":
            how = (
                f"utility selection over models {selection['scored']} (validation utility {merged.choice.utility:.4f}), "
                "charged as their composition"
            )
        else:
            how = f"chosen by the public prior ({selection.get('prior', 'epsilon')}; no model scored)"
        print(
            f"{request.method.upper()} merge: {out['weights_name']} = [{weights}] -> epsilon {eps.pld:.4f} (PLD), "
            f"{eps.rdp:.4f} (RDP) at delta {request.delta:g}, this release; {how}; UNCHARGED (no ledger)"
        )
        print(f"wrote {weights_path} and {record_path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("merge", help="release an RS or LC merge of a DP-SGD pool at a target (epsilon, delta)")
    p.add_argument(
        "--pool",
        required=True,
        help="pool directory (privfusion pool train: the merge is UNCHARGED, no ledger records it); with --site "
        "or --via, the name of the site's pool",
    )
    p.add_argument("--target-epsilon", type=float, required=True)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument(
        "--method",
        required=True,
        choices=("rs", "lc"),
        help="rs: random selection; lc: linear combination (full-batch models only)",
    )
    p.add_argument("--out", required=True, help="output weights file (FILE.safetensors; the stem names the model)")
    p.add_argument(
        "--selection",
        default="public-prior",
        choices=("public-prior", "utility"),
        help="public-prior (default): pi/lambda from the models' training records and declared prior_utility (else "
        "their own epsilon), free; utility: score a public subset of the models on --validation, charged as "
        "releasing that whole subset",
    )
    p.add_argument(
        "--validation",
        default="pool",
        help="with --selection utility, data scoring candidates: 'pool' (the held-out split the pool was trained "
        "beside; default) or an .npz with x and y. It must not be part of the protected training data",
    )
    p.add_argument(
        "--figure",
        "--accountant",
        dest="figure",
        default="pld",
        choices=("pld", "rdp"),
        help="the epsilon figure the target is met by: pld (tight) or rdp (default pld; --accountant is the old name)",
    )
    p.add_argument("--seed", type=int, default=None, help="fixed seed for the RS draw (tests only; default: CSPRNG)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    site = p.add_argument_group("releasing through this machine's site (charged to its ledger, signed receipt)")
    site.add_argument("--site", metavar="DIR", help="the site directory (its site.toml); its daemon must not run")
    site.add_argument(
        "--for", dest="counterparty", metavar="SITE", help="the site the merge is for (with --site; charged to it)"
    )
    remote = p.add_argument_group("asking a peer instead (the peer merges its own pool and charges its ledger)")
    remote.add_argument("--via", metavar="HOST:PORT", help="the peer to ask")
    remote.add_argument("--identity", metavar="DIR", help="this site's identity directory (with --via)")
    remote.add_argument("--peer", metavar="NAME", help="the pinned site expected at --via")
    remote.add_argument("--insecure", action="store_true", help="no TLS (test networks only; loud)")
    p.set_defaults(func=run)
