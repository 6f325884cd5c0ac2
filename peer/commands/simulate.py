"""``privfusion simulate [SCENARIO.toml] --out DIR``: several hospitals, each a real daemon on
loopback, all running fusion rounds at once (``scenarios.simulate``).

Without a scenario file the bundled ``hospitals.toml`` runs (four hospitals, breast-cancer data
split by a Dirichlet label skew). ``--scenario NAME`` picks another bundled one (``digits.toml``,
``hospitals-failure.toml``). Progress goes to stderr; the summary table to stdout; the report
(report.md, report.json, plots) and every site's files (identity, models, ledger, logs) to DIR.
"""

from __future__ import annotations


def _simulate(args) -> int:
    from scenarios.report import summary_table
    from scenarios.schema import bundled_path, load_scenario
    from scenarios.simulate import simulate

    if args.scenario_file and args.scenario:
        from peer.errors import InvalidArgument

        raise InvalidArgument("--scenario", "give a scenario file or a bundled scenario's name, not both")
    path = args.scenario_file or (bundled_path(args.scenario) if args.scenario else None)
    scenario = load_scenario(path)
    report = simulate(scenario, args.out)
    print(summary_table(report))
    print(f"\nreport: {args.out}/report.md (and report.json, accuracy.png, frontier.png, budget.png)")
    return 0


def register(subparsers) -> None:
    from scenarios.schema import BUNDLED

    p = subparsers.add_parser("simulate", help="simulate several hospitals fusing models, each a real daemon on loopback",
                              description="Run a multi-site scenario end to end: data split, local training, one daemon "
                                          "per site with its own identity and ledger, coordinator-free fusion rounds at "
                                          "every site at once, and a report with accuracies and budgets.")
    p.add_argument("scenario_file", nargs="?", metavar="SCENARIO.toml", help="scenario file (default: the bundled hospitals.toml)")
    p.add_argument("--scenario", choices=BUNDLED, help="a bundled scenario by name")
    p.add_argument("--out", required=True, metavar="DIR", help="new directory for the report and the sites' files")
    p.set_defaults(func=_simulate)
