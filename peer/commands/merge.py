"""``privfusion merge``: release an RS or LC merge of a pool at a target (ε′, δ′).

    privfusion merge --pool POOL --target-epsilon E --delta D --method rs|lc --out FILE
                     [--validation pool|FILE.npz] [--accountant pld|rdp] [--seed N] [--json]

Writes FILE (safetensors weights; the manifest beside it holds the release record) and
FILE-stem.record.json (the release record alone), and prints what was achieved. The request is
built from the arguments by ``merge_request``; ``obtain_merge`` serves it from a local pool — a
remote form (``--via HOST:PORT``) plugs in there.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from peer.merging import METHODS, MergedModel
from peer.pool import load_pool, load_validation_file, merge_pool, save_merged
from peer.rng import make_randomness


@dataclass(frozen=True)
class MergeRequest:
    """What the requester asks for: a model at (target_epsilon, delta) by ``method``."""

    method: str
    target_epsilon: float
    delta: float
    accountant: str = "pld"


def merge_request(args: argparse.Namespace) -> MergeRequest:
    return MergeRequest(args.method, args.target_epsilon, args.delta, args.accountant)


def obtain_merge(request: MergeRequest, args: argparse.Namespace) -> MergedModel:
    """Serve the request from the local pool ``args.pool``."""
    pool = load_pool(args.pool)
    validation = None if args.validation == "pool" else load_validation_file(args.validation)
    return merge_pool(pool, request.method, request.target_epsilon, request.delta, validation=validation,
                      accountant=request.accountant, randomness=make_randomness(args.seed))


def run(args: argparse.Namespace) -> int:
    request = merge_request(args)
    merged = obtain_merge(request, args)
    weights_path, record_path = save_merged(args.out, merged)
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
        print(f"{request.method.upper()} merge: {out['weights_name']} = [{weights}] -> epsilon {eps.pld:.4f} (PLD), "
              f"{eps.rdp:.4f} (RDP) at delta {request.delta:g}; validation utility {merged.choice.utility:.4f}")
        print(f"wrote {weights_path} and {record_path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("merge", help="release an RS or LC merge of a DP-SGD pool at a target (epsilon, delta)")
    p.add_argument("--pool", required=True, help="pool directory (privfusion pool train)")
    p.add_argument("--target-epsilon", type=float, required=True)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--method", required=True, choices=METHODS, help="rs: random selection; lc: linear combination (full-batch models only)")
    p.add_argument("--out", required=True, help="output weights file (FILE.safetensors; the stem names the model)")
    p.add_argument("--validation", default="pool",
                   help="data judging candidates: 'pool' (the held-out split the pool was trained beside; default) or an .npz with x and y. "
                        "It must not be part of the protected training data")
    p.add_argument("--accountant", default="pld", choices=("pld", "rdp"), help="the accountant the target is met by (default pld)")
    p.add_argument("--seed", type=int, default=None, help="fixed seed for the RS draw (tests only; default: CSPRNG)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
