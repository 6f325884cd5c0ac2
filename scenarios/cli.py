"""``privfusion simulate [SCENARIO.toml] --out DIR``: several hospitals, each a real daemon on
loopback, all running fusion rounds at once (``scenarios.simulate``).

Without a scenario file the bundled ``hospitals.toml`` runs (four hospitals, breast-cancer data
split by a Dirichlet label skew). ``--scenario NAME`` picks another bundled one (``digits.toml``,
``hospitals-failure.toml``). Progress goes to stderr; the summary table to stdout; the report
(report.md, report.json, plots) and every site's files (identity, models, ledger, logs) to DIR.
``privfusion demo site`` writes one scenario site's files, to run it elsewhere (docker compose).
``privfusion simulate --baselines-only [--json]`` computes only the baselines on the scenario's
split (central pooled training; DP-FedAvg and central DP-SGD when the scenario has ``[iterate]``)
and prints them. ``privfusion simulate --tune [--rows local,central] [--smallest] [--json]``
runs the hyperparameter search of ``scenarios.tuning`` on a validation split of the protected
records and prints every configuration's score and the chosen settings as scenario tables.

The commands reach ``privfusion`` (``peer.cli.app``) through the entry-point group
``privfusion.commands`` (``simulate`` → :func:`register`, ``demo`` → :func:`register_demo`), so
that nothing under ``peer/`` imports this package.
"""

from __future__ import annotations


def _simulate(args) -> int:
    from peer.base.extras import require
    from scenarios.report import summary_table
    from scenarios.schema import bundled_path, load_scenario
    from scenarios.simulate import simulate

    if args.scenario_file and args.scenario:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("--scenario", "give a scenario file or a bundled scenario's name, not both")
    path = args.scenario_file or (bundled_path(args.scenario) if args.scenario else None)
    scenario = load_scenario(path)
    if args.baselines_only and args.tune:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("--tune", "runs the search only; leave out --baselines-only")
    if args.baselines_only:
        return _baselines(scenario, args)
    if args.tune:
        return _tune(scenario, args)
    if args.json:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("--json", "goes with --baselines-only (a simulation writes report.json into --out)")
    if args.out is None:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("--out", "is required (a new directory for the report), unless --baselines-only")
    require("matplotlib", "plots", "privfusion simulate (the report's plots)")  # before the run, not after it
    from peer.base.progress import Bars
    from scenarios.world import Progress

    bars = Bars()  # drawn on a terminal only (peer.base.progress)
    try:
        report = simulate(scenario, args.out, Progress(bars.write, bars))
    finally:
        bars.close()
    print(summary_table(report))
    if report.get("baselines"):
        from scenarios.report import comparison_table

        print("\n" + comparison_table(report))
    from scenarios.report import iterate_table

    if iterate_table(report):
        print("\n" + iterate_table(report))
    print(f"\nreport: {args.out}/report.md (and report.json, {', '.join(report['plots'])})")
    return 0


def _baselines(scenario, args) -> int:
    """Only the baselines (``scenarios.baselines``) on the scenario's split: no daemons, no files."""
    import json

    from scenarios.baselines import dp_fedavg_summary, scenario_baselines
    from scenarios.world import Progress, split_data

    if args.out is not None:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("--out", "writes a simulation's report; --baselines-only writes nothing (use --json)")
    progress = Progress()
    if scenario.iterate is None:
        progress("the scenario has no [iterate] table: central pooled training only (DP-FedAvg needs [iterate])")
    data = split_data(scenario)
    out = scenario_baselines(scenario, data.network, data.parts, data.x_test, data.y_test, progress)
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else dp_fedavg_summary(out))
    return 0


def _tune(scenario, args) -> int:
    """The hyperparameter search (``scenarios.tuning``) on the scenario's split: no daemons, no files."""
    import json

    from peer.base.errors import InvalidArgument
    from scenarios.tuning import CENTRAL, LOCAL, chosen_toml, markdown, secure_aggregation, tune
    from scenarios.world import Progress, split_data

    if args.out is not None:
        raise InvalidArgument("--out", "writes a simulation's report; --tune writes nothing (use --json)")
    models = []
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        if name == "local":
            models.append(LOCAL)
        elif name == "central":
            models.append(CENTRAL)
        elif name == "secure-aggregation":
            if args.coalition is None:
                raise InvalidArgument(
                    "--coalition", "is required with the secure-aggregation row (t, the coalition size)"
                )
            from coordinator_free.iterate import IterateConfig
            from scenarios.iterate_sites import iterate_orders

            # charged as the secure run will be: its ledgers' orders (planned per plan, or the
            # scenario's), its scale γ and the round's bits
            it = scenario.iterate
            models.append(
                secure_aggregation(
                    len(scenario.sites),
                    args.coalition,
                    orders=None if it is None or it.ledger_orders == "planned" else iterate_orders(scenario),
                    scale=IterateConfig.secure_scale if it is None else it.secure_scale,
                    bits=IterateConfig.modulus_bits,
                )
            )
        else:
            raise InvalidArgument("--rows", f"each must be one of local, central, secure-aggregation; got {name!r}")
    if not models:
        raise InvalidArgument("--rows", "names no row")
    result = tune(scenario, split_data(scenario), models, smallest=args.smallest, progress=Progress())
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else markdown(result) + "\n" + chosen_toml(result))
    return 0


def _demo_site(args) -> int:
    """One site of a scenario, as files, for running it somewhere else (docker compose)."""
    from pathlib import Path

    from scenarios.schema import bundled_path, load_scenario
    from scenarios.world import prepare_site, round_toml, site_toml, split_data

    sc = load_scenario(args.scenario_file or (bundled_path(args.scenario) if args.scenario else None))
    if args.site not in [s.name for s in sc.sites]:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument(
            "--site", f"must be one of the scenario's sites {[s.name for s in sc.sites]}, got {args.site!r}"
        )
    root = Path(args.dir)
    if (root / "site.toml").exists():
        print(f"{root / 'site.toml'} exists: leaving {args.site}'s files as they are")
        return 0
    # CSPRNG pool noise: the site's daemon runs without --simulation, which refuses a fixed-seed pool
    s = prepare_site(sc, split_data(sc), args.site, root, fixed_seed=False)
    method = sc.round.methods[0]
    (root / "site.toml").write_text(
        site_toml(
            sc,
            s,
            listen=args.listen,
            fixed_seed=False,
            round_table=round_toml(sc, s, "demo", method, 1.0, Path(args.roster)),
        ),
        encoding="utf-8",
    )
    print(
        f"{args.site}: {len(s.y)} records; model, {'pool, ' if s.pool else ''}probe set and site.toml in {root}"
        f" (listens on {args.listen}; rounds use the roster {args.roster})"
    )
    return 0


def register(subparsers) -> None:
    """``privfusion simulate``."""
    from scenarios.schema import BUNDLED

    p = subparsers.add_parser(
        "simulate",
        help="simulate several hospitals fusing models, each a real daemon on loopback",
        description="Run a multi-site scenario end to end: data split, local training, one daemon "
        "per site with its own identity and ledger, coordinator-free fusion rounds at "
        "every site at once, and a report with accuracies and budgets.",
    )
    p.add_argument(
        "scenario_file", nargs="?", metavar="SCENARIO.toml", help="scenario file (default: the bundled hospitals.toml)"
    )
    p.add_argument("--scenario", choices=BUNDLED, help="a bundled scenario by name")
    p.add_argument("--out", metavar="DIR", help="new directory for the report and the sites' files (required)")
    p.add_argument(
        "--baselines-only",
        action="store_true",
        help="compute only the baselines on the scenario's split (central pooled; DP-FedAvg and central DP-SGD "
        "with [iterate]) "
        "and print them: no daemons, no files",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="search the DP rows' hyperparameters on a validation split of the protected records (never the "
        "test set) and print every configuration's score and the chosen settings: no daemons, no files",
    )
    p.add_argument(
        "--rows",
        default="local,central",
        help="with --tune: the rows to search, comma-separated: local (DP-FedAvg / P2P local noise), central "
        "(DP-SGD on the pooled records), secure-aggregation (needs --coalition) [default: local,central]",
    )
    p.add_argument("--coalition", type=int, help="with --tune and the secure-aggregation row: the coalition size t")
    p.add_argument("--smallest", action="store_true", help="with --tune: two configurations per row, one seed (tests)")
    p.add_argument("--json", action="store_true", help="with --baselines-only or --tune: print the result as JSON")
    p.set_defaults(func=_simulate)


def register_demo(subparsers) -> None:
    """``privfusion demo site``."""
    from scenarios.schema import BUNDLED

    d = subparsers.add_parser("demo", help="one site of a scenario as files, to run elsewhere (docker compose)")
    sub = d.add_subparsers(dest="demo_command", metavar="ACTION")
    sub.required = True
    q = sub.add_parser(
        "site",
        help="write one scenario site's model, pool, probe set and site.toml (no identity)",
        description="Train one site of a scenario (its share of the data, split as the simulator splits "
        "it) and write its files into DIR: models/, pool/, probe and validation sets, and a "
        "site.toml with its policy and a [round] table. Noise is CSPRNG (no fixed seed). "
        "Make the identity with `privfusion peer init`. Does nothing if DIR/site.toml exists.",
    )
    q.add_argument(
        "scenario_file", nargs="?", metavar="SCENARIO.toml", help="scenario file (default: the bundled hospitals.toml)"
    )
    q.add_argument("--scenario", choices=BUNDLED, help="a bundled scenario by name")
    q.add_argument("--site", required=True, help="the scenario site to write")
    q.add_argument("--dir", required=True, help="the site's directory")
    q.add_argument("--listen", default="0.0.0.0:50051", help="the daemon's listen address (default 0.0.0.0:50051)")
    q.add_argument("--roster", required=True, help="path of the roster file the site's rounds use")
    q.set_defaults(func=_demo_site)
