"""The simulation's multi-round peer-to-peer DP training (``[iterate]``,
``coordinator_free.iterate``): each site's ledger and site.toml for the run, the loop of every
site as a ``privfusion round`` process beside its daemon, and the models it fused, evaluated."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from coordinator_free.roster import write_roster
from scenarios.network import OWN_MODELS
from scenarios.processes import Daemon, RoundThread, _shut_down
from scenarios.schema import Scenario
from scenarios.world import MODEL, Progress, SiteWorld, World

# ------------------------------------------------------------------------------------- iterate
#
# Multi-round peer-to-peer DP training (``coordinator_free.iterate``), run after the rounds
# above as a deployment of its own: every site gets a fresh ledger whose data budget is the
# run's (ε, δ) per record (``[iterate]``), so that the run is measured at the same per-record
# cost as the DP-FedAvg baseline and its ledger holds nothing else; the site's identity, model
# store and probe set are the ones above. Its records are written into its own directory (they
# never leave it: the daemon serves only the charged segments).


def iterate_orders(sc: Scenario) -> tuple[float, ...]:
    """The Rényi orders of the run's ledgers (``[iterate] ledger_orders``)."""
    from peer.budget.dpsgd_noise import planned_orders
    from peer.budget.filter import FILTER_ORDERS

    it = sc.iterate
    if it.ledger_orders == "default":
        return FILTER_ORDERS
    if it.ledger_orders == "planned":
        return planned_orders(
            it.epsilon, it.delta, it.rounds * it.local_steps, sample_rate=it.sample_rate, adjacency=it.adjacency
        )
    return tuple(it.ledger_orders)


def secure_plan(sc: Scenario) -> tuple[int, float, float, float]:
    """The secure run's plan (steps, sample rate, learning rate, clip norm): ``[secure_iterate]``
    (one secure sum a step), else ``[iterate]``'s rounds × local_steps."""
    it, plan = sc.iterate, sc.secure_iterate
    if plan is not None:
        return plan.steps, plan.sample_rate, plan.learning_rate, plan.clip_norm
    return it.rounds * it.local_steps, it.sample_rate, it.learning_rate, it.clip_norm


def secure_orders(sc: Scenario, dim: int) -> tuple[float, ...]:
    """The Rényi orders of the secure run's ledgers: with ``ledger_orders = "planned"`` the one
    integer order at which the secure plan needs the least Skellam noise
    (``peer.dp.distributed.skellam.planned_order``, on the encoding of a ``dim``-entry model at
    ``[iterate] secure_scale``; public numbers only), else :func:`iterate_orders`."""
    from coordinator_free.iterate import IterateConfig
    from peer.dp.distributed.encoding import Encoding
    from peer.dp.distributed.skellam import planned_order

    it = sc.iterate
    if it.ledger_orders != "planned":
        return iterate_orders(sc)
    steps, q, _, clip = secure_plan(sc)
    enc = Encoding(dim=dim, clip_norm=clip, scale=it.secure_scale, bits=IterateConfig.modulus_bits, beta=0.0)
    n = len(sc.sites)
    return (
        float(planned_order(it.epsilon, it.delta, n, it.coalition, enc.l1_sensitivity, enc.l2_sensitivity, q, steps)),
    )


def model_dim(architecture) -> int:
    """Entries of the architecture's parameters (what a secure sum adds up): a built-in
    architecture's or a ``scenarios.network.Network``'s."""
    from scenarios.network import as_network

    return as_network(architecture).parameters


def iterate_site_toml(sc: Scenario, s: SiteWorld, *, secure: bool = False) -> str:
    """site.toml of a site's iterate deployment (``SITE/iterate/``, or ``SITE/iterate-secure/``
    for the secure-aggregation run): the site's identity, models and probe set, a fresh ledger
    with the run's data budget, segments (secure: secure sums) allowed to every peer."""
    it = sc.iterate
    allow = '"segment", "ledger", "secure-sum"' if secure else '"segment", "ledger"'
    chosen = secure_orders(sc, model_dim(s.network)) if secure else iterate_orders(sc)
    orders = ", ".join(repr(float(o)) for o in chosen)
    lines = [
        "[site]",
        f'name = "{s.name}"',
        'listen = "127.0.0.1:0"',
        'identity = "../identity"',
        'models = "../models"',
        'ledger = "ledger.sqlite"',
        'probe = "../probe.safetensors"',
        "workers = 16",
        "shutdown_grace_s = 5",
        f"seed = {s.seed}",
        "",
        "[policy]",
        'show_remaining = "own"',
        f"orders = [{orders}]",
        "",
        "[policy.data]",
        f'unit = "record:{it.adjacency}"',
        f"epsilon = {it.epsilon!r}",
        f"delta = {it.delta!r}",
        "",
        '[policy.peers."*"]',
        f"allow = [{allow}]",
    ]
    return "\n".join(lines) + "\n"


def iterate_round_toml(sc: Scenario, roster: Path, images: Path | None = None, *, secure: bool = False) -> str:
    """The iterate round file of a site: ``[iterate]``'s plan; its records are ``records.npz`` in
    its iterate directory (prepared arrays), or its folder of images by class (``images``: read
    with its model's stored image preprocessing, as a hospital's own image folder would be); with
    ``secure``, the same plan with one secure sum per step (``[round.iterate] secure = true``,
    ``coalition``)."""
    it = sc.iterate
    # the secure run's own plan ([secure_iterate]: one secure sum a step, rounds = steps), else [iterate]'s
    plan = sc.secure_iterate if secure else None
    rounds, local_steps = (plan.steps, 1) if plan is not None else (it.rounds, it.local_steps)
    learning_rate, clip_norm, sample_rate = (
        (plan.learning_rate, plan.clip_norm, plan.sample_rate)
        if plan is not None
        else (it.learning_rate, it.clip_norm, it.sample_rate)
    )
    lines = [
        "[round]",
        f'roster = "{roster}"',
        f'model = "{MODEL}"',
        'method = "iterate"',
        'out = "rounds"',
        f"call_timeout_s = {sc.round.call_timeout_s!r}",
        "",
        "[round.iterate]",
        f'records = "{"records.npz" if images is None else images.resolve()}"',
        f'run = "{"secure" if secure else "iterate"}"',
        f"rounds = {rounds}",
        f"local_steps = {local_steps}",
        f"learning_rate = {learning_rate!r}",
        f"clip_norm = {clip_norm!r}",
        *([f"sample_rate = {sample_rate!r}"] if sample_rate != 1.0 else []),
        f"epsilon = {it.epsilon!r}",
        f"delta = {it.delta!r}",
        f'adjacency = "{it.adjacency}"',
        *([f"declared_records = {it.declared_records}"] if it.declared_records is not None else []),
        f"init_seed = {it.init_seed}",
        "wait_s = 30.0",
        *(["secure = true", f"coalition = {it.coalition}", f"secure_scale = {it.secure_scale!r}"] if secure else []),
    ]
    return "\n".join(lines) + "\n"


def run_iterate_sites(world: World, progress: Progress, *, secure: bool = False) -> dict[str, SiteWorld]:
    """Every site's iterate daemon (a process of its own) and loop (a thread of this process, as
    the rounds: ``RoundThread``), all at once; the sites' iterate worlds (``SITE/iterate/``;
    with ``secure``, the secure-aggregation run's in ``SITE/iterate-secure/``, with daemons,
    ledgers and a roster of their own)."""
    import dataclasses

    from coordinator_free.iterate import describe as describe_iterate

    sc = world.scenario
    kind = "iterate-secure" if secure else "iterate"
    sites = {n: dataclasses.replace(s, root=s.root / kind) for n, s in world.sites.items()}
    for s in sites.values():
        s.root.mkdir(parents=True, exist_ok=True)
        if s.images is None:
            np.savez(s.root / "records.npz", x=s.x, y=s.y)  # the site's own records, in its own directory
        if s.network.is_own:
            # the site's own network into this run's own-model store (SITE/KIND/own_models, which
            # its daemon and loop read by default): the run's fused models go there, apart from
            # the one-shot rounds' (SITE/own_models)
            import shutil

            store = s.root / OWN_MODELS
            store.mkdir(exist_ok=True)
            for suffix in (".json", ".safetensors"):
                shutil.copyfile(world.sites[s.name].root / OWN_MODELS / f"{MODEL}{suffix}", store / f"{MODEL}{suffix}")
        s.config.write_text(iterate_site_toml(sc, s, secure=secure), encoding="utf-8")
    daemons: dict[str, Daemon] = {}
    loops: dict[str, RoundThread] = {}
    try:
        t0 = time.monotonic()
        for s in sites.values():
            daemons[s.name] = Daemon(s)
        for d in daemons.values():
            d.wait_ready()
        roster = world.out / f"roster-{kind}.toml"
        write_roster(
            roster,
            [(n, d.address, str((world.sites[n].identity / "site.crt").resolve())) for n, d in daemons.items()],
        )

        def on_event(e: dict) -> None:
            line = describe_iterate(e) if str(e.get("event", "")).startswith("iterate-") else None
            if line:
                progress(line)

        for s in sites.values():
            f = s.root / f"round-{kind}.toml"
            f.write_text(iterate_round_toml(sc, roster.resolve(), s.images, secure=secure), encoding="utf-8")
            loops[s.name] = RoundThread(s, [f], on_event)
        it = sc.iterate
        how = f"secure sums (coalition {it.coalition})" if secure else "DP-GD steps"
        some = next(iter(sites.values()))
        orders = secure_orders(sc, model_dim(some.network)) if secure else iterate_orders(sc)
        plan = sc.secure_iterate if secure else None
        shape = (
            f"{plan.steps} steps (q = {plan.sample_rate:g})"
            if plan is not None
            else f"{it.rounds} rounds × {it.local_steps}"
        )
        progress(
            f"{kind}: every site runs {shape} {how} at ε = {it.epsilon:g} "
            f"(δ = {it.delta:g}) per record, ledger orders {list(orders)}"
        )
        for n, r in loops.items():
            sites[n].exit_code = r.wait()
        world.timings[f"{kind.replace('-', '_')}_s"] = time.monotonic() - t0
    finally:
        _shut_down(loops.values(), daemons.values())
    return sites


def evaluate_iterate(world: World, sites: dict[str, SiteWorld]) -> dict[str, dict]:
    """Per site: each round's fused model on the test set, ε spent by round (the ledger's
    filter and the PLD of the steps so far), bytes, contributors; and the ledger's own figures
    read back from the file after the run (filter and PLD of every charged segment)."""
    from peer.budget.ledger import Ledger

    out = {}
    for name, s in sites.items():
        path = s.root / "rounds" / "iterate.json"
        if not path.exists():
            out[name] = {
                "status": "missing",
                "reason": f"no report (exit code {getattr(s, 'exit_code', None)}; see {s.root / 'rounds.log'})",
                "rounds": [],
                "final_accuracy": None,
                "epsilon_filter": None,
                "epsilon_pld": None,
            }
            continue
        rep = json.loads(path.read_text())
        rounds = []
        for r in rep["rounds"]:
            acc = s.network.accuracy(s.network.load(s.root, r["model"]), world.x_test, world.y_test)
            rounds.append(
                {
                    "round": r["round"],
                    "accuracy": acc,
                    "epsilon_filter": r["epsilon_filter"],
                    "epsilon_pld": r["epsilon_pld"],
                    "bytes_sent": r["bytes_sent"],
                    "bytes_received": r["bytes_received"],
                    "seconds": r["seconds"],
                    "contributors": r["contributors"],
                    "staleness": {p: v["staleness"] for p, v in r["peers"].items() if v.get("staleness") is not None},
                }
            )
        ledger = Ledger(s.ledger)  # read-only, verified at open
        try:
            data = [b for b in ledger.budget_states(pld=True) if b.key.level == "data"]
            charges = len(ledger.entries())
            served = len(ledger.served_again())
        finally:
            ledger.close()
        out[name] = {
            "status": rep["status"],
            "reason": rep["reason"],
            "rounds": rounds,
            "rounds_done": rep["rounds_done"],
            "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
            "epsilon_filter": rep["epsilon_filter"],
            "epsilon_pld": rep["epsilon_pld"],
            "noise_multiplier": rep["noise_multiplier"],
            "ledger_orders": rep["plan"]["ledger_orders"],
            "bytes_sent": rep["bytes_sent"],
            "bytes_received": rep["bytes_received"],
            "exit_code": getattr(s, "exit_code", None),
            "ledger": {
                "charges": charges,
                "served_again": served,
                "epsilon_limit": data[0].epsilon_limit if data else None,
                "epsilon_filter": data[0].spent_epsilon if data else None,
                "epsilon_pld": data[0].pld_epsilon if data else None,
            },
        }
    return out


def evaluate_secure_iterate(world: World, sites: dict[str, SiteWorld]) -> dict[str, dict]:
    """Per site, the secure-aggregation run (``coordinator_free.secure_iterate``): its final
    model on the test set, steps done and attempts, ε spent by its ledger's filter (the
    distributed Skellam steps have RDP only: no PLD figure), the total noise variance V it was
    calibrated to, its wall time (the run's own start to end) and its bytes
    (:func:`secure_bytes`)."""
    from datetime import datetime

    from peer.budget.ledger import Ledger

    reports = {
        name: json.loads(path.read_text())
        for name, s in sites.items()
        if (path := s.root / "rounds" / "secure.json").exists()
    }
    out = {}
    for name, s in sites.items():
        if name not in reports:
            out[name] = {
                "status": "missing",
                "reason": f"no report (exit code {getattr(s, 'exit_code', None)}; see {s.root / 'rounds.log'})",
                "final_accuracy": None,
                "epsilon_filter": None,
            }
            continue
        rep = reports[name]
        acc = s.network.accuracy(s.network.load(s.root, "secure-final"), world.x_test, world.y_test)
        ledger = Ledger(s.ledger)  # read-only, verified at open
        try:
            data = [b for b in ledger.budget_states() if b.key.level == "data"]
            charges = len(ledger.entries())
        finally:
            ledger.close()
        wall = (datetime.fromisoformat(rep["finished_at"]) - datetime.fromisoformat(rep["started_at"])).total_seconds()
        out[name] = {
            "status": rep["status"],
            "reason": rep["reason"],
            "steps_done": len(rep["steps"]),
            "steps_rerun": sum(1 for st in rep["steps"] if st["attempt"] > 0),  # after a dropout
            "final_accuracy": acc,
            "epsilon_filter": rep["epsilon_filter"],
            "total_variance": rep["plan"]["total_variance"],
            "coalition": rep["plan"]["coalition"],
            "ledger_orders": rep["plan"]["ledger_orders"],
            "wall_s": wall,
            **secure_bytes(name, reports),
            "exit_code": getattr(s, "exit_code", None),
            "ledger": {
                "charges": charges,
                "epsilon_limit": data[0].epsilon_limit if data else None,
                "epsilon_filter": data[0].spent_epsilon if data else None,
            },
        }
    return out


def secure_bytes(name: str, reports: dict[str, dict]) -> dict:
    """The payload bytes that crossed site ``name``'s boundary in the secure run, both ways,
    from the sites' run reports (``reports``: site → its ``secure.json``; each counts at its own
    gRPC clients, ``DaemonTransport.traffic``). What a site's daemon serves is counted by the
    peer that fetched it, so: ``bytes_sent`` = its FetchSecAgg requests to the peers + the
    replies its daemon served them (their ``by_peer[name].received``: its keys, masked vectors
    and forwarded digests, once per peer); ``bytes_received`` = the peers' replies it fetched +
    the peers' requests its daemon answered. The hop from its run to its own daemon
    (``bytes_published``) stays inside the site and is reported beside, not added."""
    own = reports[name]
    peers = [r["by_peer"][name] for n, r in reports.items() if n != name and name in r.get("by_peer", {})]
    served = sum(p["received"] for p in peers)
    answered = sum(p["sent"] for p in peers)
    return {
        "bytes_sent": own["bytes_sent"] + served,
        "bytes_received": own["bytes_received"] + answered,
        "bytes_published": own["bytes_published"],
        "bytes_wire": {
            "requests_sent": own["bytes_sent"],
            "replies_received": own["bytes_received"],
            "replies_served": served,
            "requests_answered": answered,
        },
    }
