"""``privfusion experiment merging``: DP model merging — RS vs LC (composition bound, and the
per-step surrogate beside it), PLD vs RDP.

    privfusion experiment merging --out DIR [--json] [--quick] [--seed N] [--pretrained]

Writes DIR/merging.json, DIR/merging.md (tables), DIR/mean_estimation.png and
DIR/digits_frontier.png; with --json the same JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path


def run_merging(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    with torch_threads(1):
        return _run_merging(args)


def _run_merging(args: argparse.Namespace) -> int:
    from peer.base.extras import require
    from peer.experiments.merging import Settings, markdown, plot_digits, plot_mean_estimation, run

    require("matplotlib", "plots", "privfusion experiment merging (its figures)")  # before the run, not after it
    settings = Settings.quick() if args.quick else Settings()
    settings = replace(settings, seed=args.seed, delta=args.delta, pretrained=args.pretrained)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(settings)
    result["files"] = {
        name: str(out / name) for name in ("merging.json", "merging.md", "mean_estimation.png", "digits_frontier.png")
    }
    plot_mean_estimation(result["mean_estimation"], out / "mean_estimation.png", settings.delta)
    plot_digits(result["digits"], out / "digits_frontier.png", settings.delta)
    (out / "merging.md").write_text(markdown(result))
    text = json.dumps(result, indent=2, sort_keys=True, allow_nan=False)
    (out / "merging.json").write_text(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        sv = result["digits"]["pld_savings"]
        f = result["mean_estimation"]["findings"]
        fb = result["digits"]["findings"]
        print(
            f"(a) state-independent gradients, LC charged by the surrogate: LC dominates RS: {f['lc_dominates_rs']}; "
            f"PLD no worse than RDP: {f['pld_no_worse_than_rdp']}"
        )
        beats = ", ".join(f"{t:.3g}" for t in fb["lc_beats_rs_at"]) or "no target"
        print(f"(b) networks, LC charged by composition (the surrogate is not a bound): LC beats RS at {beats}")
        for r in fb["surrogate_releases_proven_cost"]:
            print(
                f"(b) the surrogate's release at target {r['target_epsilon']:.3g} claims epsilon {r['surrogate_epsilon']:.3g}, "
                f"proven cost {r['proven_epsilon']:.3g}"
            )
        for method in ("rs", "lc"):
            if sv[method]["saving_mean"] is not None:
                print(
                    f"(b) {method.upper()}: PLD saves {100 * sv[method]['saving_mean']:.1f}% of the budget on average "
                    f"({100 * sv[method]['saving_vs_classical_mean']:.1f}% against the classical RDP conversion)"
                )
        if "against_every_input" in fb:
            ag = fb["against_every_input"]
            for method in ("rs", "lc_composition", "rs_utility", "lc_utility"):
                at = ", ".join(f"{t:.3g}" for t in sorted(set(ag[method]["beats_every_input_at"]))) or "no target"
                print(f"(b) pretrained: {method} beats every input model at {at}")
        print(f"wrote {', '.join(result['files'].values())}")
    return 0


def register_experiment(sub) -> None:
    p = sub.add_parser(
        "merging",
        help="DP model merging: Gaussian mean estimation and digits logistic regression (RS vs LC, PLD vs RDP)",
    )
    p.add_argument("--out", required=True, help="directory for the JSON, markdown tables and PNG figures")
    p.add_argument("--json", action="store_true", help="also print the JSON result on stdout")
    p.add_argument("--quick", action="store_true", help="reduced sizes (seconds; for tests)")
    p.add_argument(
        "--seed", type=int, default=0, help="fixed seed of data, training noise and draws (reported; default 0)"
    )
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="(b) starts every pool model from a non-private model pretrained on public records (30%% of the "
        "training split, declared public): RS and LC against every input model",
    )
    p.set_defaults(func=run_merging)
