"""The multi-hospital simulator behind ``privfusion simulate``.

Everything a real deployment does happens for real, on loopback:

1. **data** — a bundled scikit-learn set or the scenario's own records (``[data] path``, read
   and prepared by ``peer.nn.tables``, with a preprocessing fitted on the public set only and
   shared by every site), split into a global test set (every
   accuracy is measured on it), a PUBLIC set (probe sets and the merges' validation data come
   from it), and the protected records, divided among the sites by a Dirichlet label skew
   (``peer.nn.data.split_dirichlet``), IID, or into regions of a covariate
   (``peer.nn.data.split_by_feature``), then thinned per site by any class removal;
2. **sites** — each site trains its own model on its records (plain training) and, when the
   scenario has a ``[pool]``, a small DP-SGD pool (``peer.dp.training.train_pool``); it gets its
   own identity (``peer init``: key + self-signed certificate), pins every other site, and a
   ``site.toml`` with its policy, its ledger file and its fixed noise seed (reported in every
   release record — a simulation option, never production);
3. **daemons** — each site's ``privfusion peer serve`` in its own process, on a free port,
   mutual TLS with the pinned certificates; a roster of all sites is written;
4. **rounds** — every site runs the rounds of the plan, all sites at once, with its own
   identity, trust store, model and probe set (its site.toml); their events stream back as
   progress. They run here, in the simulate process, one thread per site (``RoundThread``):
   the same ``coordinator_free.runner.run_rounds`` as the ``privfusion round`` command, every
   call still a mutual-TLS call to a peer's daemon, without one more process per site that
   would load torch, gRPC and NumPy again (~330 MB resident each: at 12 sites, 4 GB). The
   failure scenario SIGKILLs one site, daemon and round, once its ledger holds a given number
   of charges: that site's rounds run as the ``privfusion round`` command in a process of its
   own (``RoundProcess``), which is what a SIGKILL can take down;
5. **evaluation** — own, privately fused and merged-fused models on the test set, and the
   non-private ORACLE (graph matching on exact features, computed here with every site's
   exact model — no real site could), with the same contributors and weights;
6. **ledgers** — after the daemons stop, every site's ledger file is opened and its entries
   and budgets go into the report as they are; the rounds' receipts are reconciled with them.

Each concept is a file: steps 1–2 are ``scenarios.world``, 3–4 ``scenarios.processes``, 5–6
``scenarios.evaluation``, the ``[iterate]`` run ``scenarios.iterate_sites`` (with ``[iterate]
secure = true``, then the same plan again with secure aggregation,
``coordinator_free.secure_iterate``, on daemons and ledgers of its own), the baselines
``scenarios.baselines`` and the report ``scenarios.report``. This module runs them in order
(:func:`simulate`) and keeps every public name of theirs importable from here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from peer.base.errors import FailedPrecondition
from scenarios.evaluation import (
    after_fusion_accuracies,
    evaluate,
    oracle_accuracy,
    read_ledger,
    read_ledgers,
    reconcile,
    round_reports,
)
from scenarios.iterate_sites import (
    evaluate_iterate,
    evaluate_secure_iterate,
    iterate_orders,
    iterate_round_toml,
    iterate_site_toml,
    run_iterate_sites,
)
from scenarios.processes import Daemon, RoundProcess, RoundThread, run_sites
from scenarios.schema import Scenario
from scenarios.world import (
    MODEL,
    POOL,
    Progress,
    ScenarioData,
    SiteWorld,
    World,
    prepare,
    prepare_site,
    released_epsilon,
    round_plan,
    round_toml,
    site_toml,
    split_data,
)

__all__ = [
    "MODEL",
    "POOL",
    "Daemon",
    "Progress",
    "RoundProcess",
    "RoundThread",
    "ScenarioData",
    "SiteWorld",
    "World",
    "after_fusion_accuracies",
    "evaluate",
    "evaluate_iterate",
    "evaluate_secure_iterate",
    "iterate_orders",
    "iterate_round_toml",
    "iterate_site_toml",
    "oracle_accuracy",
    "prepare",
    "prepare_site",
    "read_ledger",
    "read_ledgers",
    "reconcile",
    "released_epsilon",
    "round_plan",
    "round_reports",
    "round_toml",
    "run_baselines",
    "run_iterate_sites",
    "run_sites",
    "simulate",
    "site_toml",
    "split_data",
]


def run_baselines(world: World, progress: Progress) -> dict:
    """Central pooled training always, DP-FedAvg when the scenario has ``[iterate]``
    (``scenarios.baselines``), on the sites' own split and the same test set."""
    from scenarios.baselines import scenario_baselines

    t0 = time.monotonic()
    sites = [world.sites[s.name] for s in world.scenario.sites]
    out = scenario_baselines(
        world.scenario, sites[0].network, [(s.x, s.y) for s in sites], world.x_test, world.y_test, progress
    )
    world.timings["baselines_s"] = time.monotonic() - t0
    return out


def simulate(sc: Scenario, out: str | os.PathLike, progress: Progress | None = None) -> dict:
    """Run a scenario end to end and write its report into ``out``; returns the report."""
    from scenarios.report import write_report

    progress = progress or Progress()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FailedPrecondition(f"--out {out} is not empty; give a new directory (a simulation never overwrites one)")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress(f"scenario {sc.name!r}: {len(sc.sites)} sites, {sc.data.dataset}, split {sc.data.split}; output in {out}")
    # stages of the bar (a terminal only): prepare, the sites' rounds, evaluation, baselines, and
    # each iterate run when it is waited for
    progress.begin(4 + (sc.iterate is not None) + bool(sc.iterate and sc.iterate.secure), f"simulate {sc.name}")
    t0 = time.monotonic()
    world = prepare(sc, out, progress)
    world.timings["prepare_s"] = time.monotonic() - t0
    progress.advance()
    processes = run_sites(world, progress)
    progress.advance()
    # the iterate run's daemons and loops are processes of their own: they run while the
    # rounds above are evaluated here
    iterate = None
    if sc.iterate is not None:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1)
        iterate = pool.submit(run_iterate_sites, world, progress)
        # then the same plan with secure aggregation ([iterate] secure), its own daemons and ledgers
        secure = pool.submit(run_iterate_sites, world, progress, secure=True) if sc.iterate.secure else None
        pool.shutdown(wait=False)
    t0 = time.monotonic()
    progress("evaluating models and the non-private oracle; reading every ledger")
    evaluation = evaluate(world)
    ledgers = read_ledgers(world)
    world.timings["evaluate_s"] = time.monotonic() - t0
    progress.advance()
    baselines = run_baselines(world, progress)
    progress.advance()
    if iterate is not None:
        for name, it in evaluate_iterate(world, iterate.result()).items():
            evaluation[name]["iterate"] = it
        progress.advance()
        if secure is not None:
            for name, it in evaluate_secure_iterate(world, secure.result()).items():
                evaluation[name]["secure_iterate"] = it
            progress.advance()
    progress.close()
    world.timings["total_s"] = time.monotonic() - started
    report = {
        "scenario": sc.to_dict(),
        "plan": [{"label": label, "method": m, "scale": s} for label, m, s in world.plan],
        "sites": evaluation,
        "ledgers": ledgers,
        "reconciliation": reconcile(world, evaluation, ledgers),
        "baselines": baselines,
        "failure": processes["failure"],
        "round_exit_codes": processes["exit_codes"],
        "addresses": processes["addresses"],
        "timings": world.timings,
        "test_examples": len(world.y_test),
        "public_examples": len(world.y_public),
    }
    write_report(report, out)
    return report
