"""``privfusion experiment paper``: the fusion paper's Fig. 3, Table II and Table III on digits
and Table IV with Fig. 5 on breast-cancer, each under the per-entry and the per-neuron unit,
with the paper's claims and verdicts.

    privfusion experiment paper --out DIR [--json] [--quick] [--seeds 0,1,2]

Writes DIR/paper.json, DIR/paper.md (the tables, claims and verdicts), DIR/fig3.png,
DIR/table2.png, DIR/table3.png and DIR/fig5.png; with --json the same JSON goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace


def _seeds(value: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in value.split(","))
    except ValueError:
        seeds = ()
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds must be distinct non-negative integers S1,S2,..., got {value!r}")
    return seeds


def run_paper(args: argparse.Namespace) -> int:
    from peer.base.extras import require
    from peer.experiments.paper import PaperConfig, run, write
    from peer.nn.architectures import torch_threads

    require("matplotlib", "plots", "privfusion experiment paper (its figures)")  # before the run, not after it
    cfg = PaperConfig.quick() if args.quick else PaperConfig()
    if args.seeds is not None:
        cfg = replace(cfg, seeds=args.seeds)

    def progress(s: str) -> None:
        print(f"  {s}", file=sys.stderr, flush=True)

    with torch_threads(1):
        result = run(cfg, progress)
    files = write(result, cfg, args.out)
    if args.json:
        json.dump(result, sys.stdout, indent=1, sort_keys=True, allow_nan=False)
        print()
    else:
        for table, verdict in result["verdicts"].items():
            if table in ("count", "of"):
                continue
            for unit, v in verdict.items():
                word = "reproduced" if v["reproduced"] else "not reproduced"
                print(f"{table} per {unit}: {word} — {v['why']}")
        count, of = result["verdicts"]["count"], result["verdicts"]["of"]
        print("claims reproduced: " + ", ".join(f"per {u} {n} of {of}" for u, n in count.items()))
        print(f"wrote {', '.join(files.values())}")
    return 0


def register_experiment(sub) -> None:
    p = sub.add_parser(
        "paper",
        help="the fusion paper's Fig. 3 and Tables II-IV (digits, breast-cancer), per entry and per neuron, with verdicts",
    )
    p.add_argument("--out", required=True, help="directory for the JSON, Markdown tables and PNG figures")
    p.add_argument("--json", action="store_true", help="also print the JSON result on stdout")
    p.add_argument("--quick", action="store_true", help="the smallest configuration (one seed, a small MLP; for tests)")
    p.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="seeds of data splits, training and (fixed, reported) noise, as S1,S2,... (default 0,1,2; --quick 0)",
    )
    p.set_defaults(func=run_paper)
