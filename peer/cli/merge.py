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


def run(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    with torch_threads(1):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from peer.dp.pools import load_pool, save_merged

    request = merge_request(args)
    if args.via:
        return run_via(request, args)
    pool = load_pool(args.pool)
    merged = obtain_merge(request, args, pool)
    weights_path, record_path = save_merged(args.out, merged, pool)
    out = {
        **merged.choice.to_dict(),
        "weights_name": "pi" if request.method == "rs" else "lam",
        "record": merged.record.to_dict(),
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
            f"{eps.rdp:.4f} (RDP) at delta {request.delta:g}, this release; {how}"
        )
        print(f"wrote {weights_path} and {record_path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("merge", help="release an RS or LC merge of a DP-SGD pool at a target (epsilon, delta)")
    p.add_argument(
        "--pool", required=True, help="pool directory (privfusion pool train); with --via, the peer's pool name"
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
    remote = p.add_argument_group("asking a peer instead (the peer merges its own pool and charges its ledger)")
    remote.add_argument("--via", metavar="HOST:PORT", help="the peer to ask")
    remote.add_argument("--identity", metavar="DIR", help="this site's identity directory (with --via)")
    remote.add_argument("--peer", metavar="NAME", help="the pinned site expected at --via")
    remote.add_argument("--insecure", action="store_true", help="no TLS (test networks only; loud)")
    p.set_defaults(func=run)
