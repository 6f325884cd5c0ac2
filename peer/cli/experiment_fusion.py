"""``privfusion experiment fusion``: the paper's Table I — fusion methods on digits.

privfusion experiment fusion --dataset digits [--model mlp|cnn|resnet] [--channels C1,C2] [--recipe adam|sgd]
    [--epochs N] [--graph-features released|exact] [--json] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys


def _channels(value: str) -> tuple[int, int]:
    try:
        widths = tuple(int(c) for c in value.split(","))
    except ValueError:
        widths = ()
    if len(widths) != 2 or min(widths) <= 0:
        raise argparse.ArgumentTypeError(f"--channels must be two positive integers C1,C2, got {value!r}")
    return widths


def register_experiment(group) -> None:
    f = group.add_parser("fusion", help="Table I: fusion methods on digits, homogeneous and heterogeneous splits")
    f.add_argument("--dataset", choices=["digits"], default="digits")
    f.add_argument(
        "--model",
        choices=["mlp", "cnn", "resnet"],
        default="mlp",
        help="MLP 64-128-128-10, CNN 16-32 conv + 128, or a residual CNN with BatchNorm (16, 32 channels)",
    )
    f.add_argument(
        "--channels",
        type=_channels,
        default=None,
        help="the two conv stages' widths of the cnn/resnet as C1,C2 (default 16,32), e.g. 64,128",
    )
    f.add_argument("--seed", type=int, default=0, help="seed for data splits, training and (fixed, reported) noise")
    f.add_argument(
        "--recipe",
        choices=["adam", "sgd"],
        default=None,
        help="the endpoints' training recipe (default: sgd for the cnn, adam for the mlp and resnet)",
    )
    f.add_argument("--epochs", type=int, default=None, help="default: the recipe's (adam 40, sgd 80)")
    f.add_argument(
        "--graph-features",
        choices=["released", "exact"],
        default=None,
        help="activation rows of the exact graphs that non-private graph matching reads: released (spatial "
        "means, as a release carries) or exact (every position, standardised); default exact for the cnn, "
        "released for the mlp",
    )
    f.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    f.set_defaults(func=_fusion)


def _fusion(args) -> int:
    from peer.experiments.fusion import FusionConfig, run

    cfg = FusionConfig(
        model=args.model,
        seed=args.seed,
        epochs=args.epochs,
        recipe=args.recipe,
        channels=args.channels,
        graph_features=args.graph_features,
    )

    def progress(s: str) -> None:
        print(f"  {s}", file=sys.stderr, flush=True)

    results = run(cfg, progress)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print(format_fusion_table(results))
    return 0


def format_fusion_table(results: dict) -> str:
    """Table I as text: accuracy (%) at α = 0.5 per method and split, then the best α."""
    splits = ("homogeneous", "heterogeneous")
    rows: list[tuple[str, list[str]]] = []

    def best(sweep):
        a, v = max(sweep, key=lambda t: t[1])
        return f"{100 * v:5.1f} (α={a:.1f})"

    names = [
        "model_a",
        "model_b",
        "vanilla_averaging",
        "vanilla_averaging_repair",
        "prediction_ensemble",
        "weight_matching",
        "graph_matching",
        "graph_matching_repair",
        "group_matching",
        "group_matching_repair",
        "activation_matching",
        "activation_matching_repair",
    ]
    for name in (n for n in names if n in results[splits[0]]["methods"]):
        cells = []
        for s in splits:
            r = results[s]
            cell = f"{100 * r['methods'][name]:5.1f}"
            if name in r["alpha_sweep"]:
                cell += f"   best {best(r['alpha_sweep'][name])}"
            cells.append(cell)
        rows.append((name, cells))
    for key, label in (("privfusion", "PrivFusion per-entry"), ("privfusion_per_neuron", "PrivFusion per-neuron")):
        for eps in results[splits[0]][key]:
            cells = []
            for s in splits:
                r = results[s]
                sweep = r["alpha_sweep"].get(f"{key}_eps{eps}")  # the resnet rows have α = ½ only
                cells.append(
                    f"{100 * r[key][eps]:5.1f}"
                    + (f"   best {best(sweep)}" if sweep else "")
                    + f"   perm. agreement {100 * r['permutation_agreement'][f'{key}_eps{eps}']:.0f}%"
                )
            rows.append((f"{label} ε={eps}", cells))
        for eps in results[splits[0]].get(f"{key}_repair", {}):
            rows.append(
                (f"{label} ε={eps} + REPAIR", [f"{100 * results[s][f'{key}_repair'][eps]:5.1f}" for s in splits])
            )
    width = max(len(r[0]) for r in rows)
    colw = max(len(c) for _, cells in rows for c in cells)
    lines = [
        f"{'method':<{width}}  " + "  ".join(f"{s:<{colw}}" for s in splits),
        f"{'':<{width}}  " + "  ".join(f"{'acc % at α=0.5':<{colw}}" for _ in splits),
    ]
    lines.append("-" * len(lines[0]))
    for name, cells in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:<{colw}}" for c in cells))
    return "\n".join(lines)
