"""``privfusion features|weights|fuse --via HOST:PORT``: ask a peer for a release.

Each writes ``OUT.safetensors`` and ``OUT.json`` beside it (the release record, the signed
receipt checked against the peer's pinned certificate, and for models a manifest that
``peer.nn.store.load_model`` reads).

    privfusion features --via 10.0.0.2:50051 --identity id --model mlp-b --probe probe.safetensors \\
        --activation-epsilon 1 --weight-epsilon 1 --activation-clip 0 4 --out got/features-b
    privfusion weights --via 10.0.0.2:50051 --identity id --model mlp-b --epsilon 2 --delta 1e-6 \\
        --out got/mlp-b-noisy
    privfusion fuse --via 10.0.0.2:50051 --identity id --model mlp-b --partner hospital-c \\
        --partner-model mlp-c --alpha 0.5 --activation-epsilon 1 --weight-epsilon 1 \\
        --weights-epsilon 2 --weights-delta 1e-6 --out got/fused
    privfusion release verify got/fused --trust id/trusted

``release verify`` checks a saved release offline, from pinned certificates alone: the
receipt's signature, the signed manifest (kind, model, architecture, metadata, every tensor's
dtype, shape and SHA-256, upstream receipts) and the tensors' bytes (docs/wire.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from peer.base.errors import InvalidArgument
from peer.cli.peer import add_client_options, client_from_args


def load_probe(path: str) -> np.ndarray:
    """A probe set from a safetensors file (tensor "x") or a .npy file (never pickled)."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            return np.load(p, allow_pickle=False)
        from safetensors.numpy import load_file

        tensors = load_file(str(p))
    except (OSError, ValueError) as e:
        raise InvalidArgument("--probe", f"cannot read {path}: {e}") from None
    if "x" not in tensors:
        raise InvalidArgument("--probe", f"{path} must hold the probe inputs as tensor 'x'")
    return tensors["x"]


def write(release, out: str, client) -> int:
    """Write the release document beside the tensors (already streamed to OUT.safetensors)."""
    from peer.net.client import save_release, verify_upstream

    checks = verify_upstream(release, client.trust)
    tensors, doc = save_release(release, out, checks)
    r = release.receipt.record
    print(
        f"{release.kind} of {release.receipt.signer}:{release.model}: {len(release.receipt.tensors)} tensors, "
        f"{release.total_bytes} bytes -> {tensors}"
    )
    print(
        f"record {r.release_id}: {r.mechanism}, level {r.level}, unit {r.unit}, epsilon {r.epsilon:g}, delta {r.delta:g}; "
        f"ledger entry {release.receipt.ledger_entry_id}; signature verified -> {doc}"
    )
    for c in checks:
        print(
            f"upstream receipt of {c['signer']} (entry {c['ledger_entry_id']}): "
            + ("signature verified" if c["verified"] else f"NOT verified: {c['reason']}")
        )
    return 0


def _features(args) -> int:
    probe = load_probe(args.probe)
    with client_from_args(args) as c:
        release = c.features(
            args.model,
            probe,
            activation_epsilon=args.activation_epsilon,
            weight_epsilon=args.weight_epsilon,
            unit=args.unit,
            activation_clip=tuple(args.activation_clip) if args.activation_clip else None,
            weight_bound=args.weight_bound,
            out=args.out,
        )
        return write(release, args.out, c)


def _weights(args) -> int:
    with client_from_args(args) as c:
        release = c.weights(args.model, epsilon=args.epsilon, delta=args.delta, out=args.out)
        return write(release, args.out, c)


def _fuse(args) -> int:
    with client_from_args(args) as c:
        release = c.fuse(
            args.model,
            partner=args.partner,
            partner_model=args.partner_model,
            alpha=args.alpha,
            activation_epsilon=args.activation_epsilon,
            weight_epsilon=args.weight_epsilon,
            weights_epsilon=args.weights_epsilon,
            weights_delta=args.weights_delta,
            out=args.out,
        )
        return write(release, args.out, c)


def _verify(args) -> int:
    from peer.net.client import verify_saved_release
    from peer.net.trust import TrustStore

    if not Path(args.trust).is_dir():
        raise InvalidArgument("--trust", f"{args.trust} is not a directory of pinned certificates")
    report = verify_saved_release(args.file, TrustStore(args.trust))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(
        f"{report['kind']} of {report['signer']}:{report['model']} to {report['counterparty']}: "
        f"{report['tensors']} tensors, {report['total_bytes']} bytes; ledger entry {report['ledger_entry_id']}, "
        f"release {report['release_id']}: signature, manifest and tensor checksums verified"
    )
    for c in report["upstream"]:
        print(
            f"upstream receipt of {c['signer']} (entry {c['ledger_entry_id']}): "
            + ("signature verified" if c["verified"] else f"NOT verified: {c['reason']}")
        )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("release", help="check saved releases")
    sub = p.add_subparsers(dest="release_command", metavar="ACTION")
    sub.required = True
    v = sub.add_parser("verify", help="check a saved release offline against pinned certificates")
    v.add_argument("file", metavar="FILE", help="the saved release: OUT, OUT.json or OUT.safetensors")
    v.add_argument(
        "--trust",
        required=True,
        metavar="DIR",
        help="directory of pinned certificates (e.g. IDENTITY/trusted) holding the signer's",
    )
    v.add_argument("--json", action="store_true", help="print what was verified as JSON")
    v.set_defaults(func=_verify)

    p = subparsers.add_parser("features", help="a peer's noisy graph features of a model on our probe set")
    add_client_options(p)
    p.add_argument("--model", required=True, help="the peer's model")
    p.add_argument("--probe", required=True, help="our probe set: safetensors (tensor 'x') or .npy")
    p.add_argument("--activation-epsilon", type=float, required=True, help="ε of the Laplace activations, per unit")
    p.add_argument("--weight-epsilon", type=float, required=True, help="ε of the multi-bit weight features, per unit")
    p.add_argument("--unit", default="neuron", choices=("neuron", "entry"), help="unit of privacy (default neuron)")
    p.add_argument("--activation-clip", type=float, nargs=2, metavar=("LOW", "HIGH"), help="public activation range")
    p.add_argument("--weight-bound", type=float, help="public weight box [-c, c] (default 4/sqrt(fan_in))")
    p.add_argument("--out", required=True, help="output path (OUT.safetensors, OUT.json)")
    p.set_defaults(func=_features)

    p = subparsers.add_parser("weights", help="a peer's PFA-perturbed weights (unpermuted: align them locally)")
    add_client_options(p)
    p.add_argument("--model", required=True)
    p.add_argument("--epsilon", type=float, required=True, help="ε of the Gaussian perturbation, per neuron")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_weights)

    p = subparsers.add_parser("fuse", help="ask a peer to fuse its model with a partner's and send the result")
    add_client_options(p)
    p.add_argument("--model", required=True, help="the peer's own model (the fusion base)")
    p.add_argument("--partner", required=True, help="the partner site the peer dials")
    p.add_argument("--partner-model", required=True)
    p.add_argument("--alpha", type=float, default=0.5, help="fusion scale: alpha*own + (1-alpha)*partner (default 0.5)")
    p.add_argument("--activation-epsilon", type=float, required=True)
    p.add_argument("--weight-epsilon", type=float, required=True)
    p.add_argument("--weights-epsilon", type=float, required=True)
    p.add_argument("--weights-delta", type=float, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_fuse)
