"""The simulation report: ``report.json`` (everything), ``report.md`` (for people), plots, and the
summary table ``privfusion simulate`` prints.

Budgets come from the sites' ledger files as they are after the run (``read_ledgers``); the
report never recomputes them from what the rounds asked for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from peer.base.extras import pyplot

ORACLE = "oracle (non-private)"
SECURE_ROW = "P2P with secure aggregation (iterate, secure = true)"


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def budget_rows(ledger: dict) -> dict[str, dict]:
    """A ledger summary's budgets by name."""
    return {b["budget"]: b for b in ledger["budgets"]}


def spent(ledger: dict, level: str) -> dict:
    """What the site released at one level: count of entries, ε by the filter and by PLD of its
    busiest budget of that level (model level: the model's total over all counterparties)."""
    rows = [b for b in ledger["budgets"] if b["level"] == level and (level == "data" or b["counterparty"] is None)]
    if not rows:
        return {"budget": None, "releases": 0, "epsilon_filter": 0.0, "epsilon_sum": 0.0, "epsilon_limit": None}
    b = max(rows, key=lambda r: r["spent_epsilon_filter"] if not math.isnan(r["spent_epsilon_filter"]) else -1)
    return {
        "budget": b["budget"],
        "releases": b["count"],
        "epsilon_filter": b["spent_epsilon_filter"],
        "epsilon_sum": b["epsilon_sum"],
        "epsilon_limit": b["epsilon_limit"],
        "delta_limit": b["delta_limit"],
    }


def central_pooled_accuracy(report: dict) -> float | None:
    """The NON-PRIVATE ceiling, when the report has the central pooled baseline (one model
    trained on every site's records together; mean over its seeds)."""
    c = (report.get("baselines") or {}).get("central_pooled")
    return None if not c else c.get("accuracy_mean")


def after_fusion_columns(site: dict, ldp: str | None, merged: str | None, central: float | None) -> dict:
    """A site's rows after the local steps of its rounds: + REPAIR (after candidate selection on
    public data) and + fine-tuning, for the LDP and the merge round; central pooled, and the
    distance of the merge round's repaired model to it."""

    def get(label: str | None, stage: str) -> float | None:
        return site["rounds"][label].get(f"accuracy_{stage}") if label else None

    out = {
        "ldp_repaired": get(ldp, "repaired"),
        "ldp_finetuned": get(ldp, "finetuned"),
        "merged_repaired": get(merged, "repaired"),
        "merged_finetuned": get(merged, "finetuned"),
        "central": central,
    }
    base = out["merged_repaired"] if out["merged_repaired"] is not None else out["ldp_repaired"]
    out["to_central"] = None if base is None or central is None else base - central
    return out


def summary_rows(report: dict) -> list[dict]:
    plan = report["plan"]
    main_ldp = next((p["label"] for p in plan if p["method"] == "ldp" and p["scale"] == 1.0), None)
    merged = next((p["label"] for p in plan if p["method"] == "merged"), None)
    rows = []
    for name, s in report["sites"].items():
        led = report["ledgers"][name]
        model, data = spent(led, "model"), spent(led, "data")
        status = []
        for label, r in s["rounds"].items():
            drops = ", ".join(f"{d['peer']}@{d['step']}" for d in r.get("dropped") or [])
            if r["status"] != "fused" or drops:
                status.append(f"{label}: {r['status']}" + (f", dropped {drops}" if drops else ""))
        if report.get("failure", {}).get("site") == name and report["failure"].get("killed_at"):
            status.insert(0, "KILLED")
        rows.append(
            {
                "site": name,
                "records": s["records"],
                "own": s["own_accuracy"],
                "ldp": s["rounds"][main_ldp]["accuracy"] if main_ldp else None,
                "merged": s["rounds"][merged]["accuracy"] if merged else None,
                "oracle": s["oracle"]["accuracy"],
                **after_fusion_columns(s, main_ldp, merged, central_pooled_accuracy(report)),
                "model_eps": model["epsilon_filter"],
                "model_eps_sum": model["epsilon_sum"],
                "model_releases": model["releases"],
                "data_eps": data["epsilon_filter"],
                "data_releases": data["releases"],
                "notes": "; ".join(status) or "ok",
            }
        )
    return rows


def summary_table(report: dict) -> str:
    """The short table ``privfusion simulate`` prints."""
    head = [
        "site",
        "records",
        "own",
        "fused (LDP)",
        "+repair",
        "+FT",
        "fused (merge)",
        "+repair",
        "+FT",
        ORACLE,
        "central pooled",
        "Δ central",
        "model ε spent (filter/Σ, n)",
        "data ε spent (n)",
        "notes",
    ]
    lines = []
    for r in summary_rows(report):
        lines.append(
            [
                r["site"],
                str(r["records"]),
                _fmt(r["own"]),
                _fmt(r["ldp"]),
                _fmt(r["ldp_repaired"]),
                _fmt(r["ldp_finetuned"]),
                _fmt(r["merged"]),
                _fmt(r["merged_repaired"]),
                _fmt(r["merged_finetuned"]),
                _fmt(r["oracle"]),
                _fmt(r["central"]),
                _fmt(r["to_central"], "+.3f"),
                f"{_fmt(r['model_eps'], '.4g')} / {_fmt(r['model_eps_sum'], '.4g')} ({r['model_releases']})",
                f"{_fmt(r['data_eps'], '.4g')} ({r['data_releases']})",
                r["notes"],
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def iterate_table(report: dict) -> str:
    """Per site, multi-round peer-to-peer DP training (``[iterate]``): rounds done, final test
    accuracy, ε spent by the ledger's filter and by PLD (both from the ledger file), σ, bytes
    sent and received. Empty when the scenario has no ``[iterate]``."""
    rows = [(n, s["iterate"]) for n, s in report["sites"].items() if "iterate" in s]
    if not rows:
        return ""
    head = [
        "site",
        "rounds",
        "final acc",
        "ε filter",
        "ε PLD",
        "ε limit",
        "σ",
        "charges",
        "served again",
        "sent",
        "received",
    ]
    lines = []
    for name, it in rows:
        led = it.get("ledger", {})
        lines.append(
            [
                name,
                f"{it.get('rounds_done', 0)} ({it['status']})",
                _fmt(it["final_accuracy"]),
                _fmt(led.get("epsilon_filter"), ".4g"),
                _fmt(led.get("epsilon_pld"), ".4g"),
                _fmt(led.get("epsilon_limit"), "g"),
                _fmt(it.get("noise_multiplier"), ".4g"),
                str(led.get("charges", "-")),
                str(led.get("served_again", "-")),
                f"{(it.get('bytes_sent') or 0) / 1e6:.2f} MB",
                f"{(it.get('bytes_received') or 0) / 1e6:.2f} MB",
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    accs = [it["final_accuracy"] for _, it in rows if it["final_accuracy"] is not None]
    mean = f"mean final accuracy {sum(accs) / len(accs):.4f}" if accs else "no site finished"
    title = "multi-round peer-to-peer DP training (iterate; ε from each site's run ledger)"
    return "\n".join([title, fmt(head), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines), mean])


# ------------------------------------------------------------------------------------- plots


def plot_accuracy(report: dict, path: Path) -> None:
    plt = pyplot("the simulator's plots")

    rows = summary_rows(report)
    series = [
        ("own model", "own"),
        ("fused, LDP features + PFA weights", "ldp"),
        ("fused, DP merges", "merged"),
        ("fused, DP merges + REPAIR", "merged_repaired"),
        ("ORACLE: exact-feature matching (non-private)", "oracle"),
        ("central pooled (non-private)", "central"),
    ]
    series = [(label, k) for label, k in series if any(r[k] is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(
            xs,
            [r[key] if r[key] is not None else 0 for r in rows],
            width,
            label=label,
            hatch="//" if key in ("oracle", "central") else None,
        )
    ax.set_xticks(range(len(rows)), [r["site"] for r in rows])
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("Accuracy per site before and after fusion")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(report: dict, path: Path) -> None:
    plt = pyplot("the simulator's plots")
    import numpy as np

    sites = report["sites"]
    own = np.mean([s["own_accuracy"] for s in sites.values()])
    oracle = np.mean([s["oracle"]["accuracy"] for s in sites.values()])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ldp = [p for p in report["plan"] if p["method"] == "ldp"]
    if ldp:
        eps = {}
        for p in ldp:
            accs = [
                s["rounds"][p["label"]]["accuracy"]
                for s in sites.values()
                if s["rounds"][p["label"]]["accuracy"] is not None
            ]
            for name, s in sites.items():
                a = s["rounds"][p["label"]]["accuracy"]
                if a is not None:
                    eps.setdefault(name, []).append((s["rounds"][p["label"]]["released_epsilon_per_peer"], a))
            if accs:
                left.scatter(
                    [sites[next(iter(sites))]["rounds"][p["label"]]["released_epsilon_per_peer"]],
                    [np.mean(accs)],
                    color="C1",
                    zorder=3,
                )
        for name, pts in eps.items():
            pts.sort()
            left.plot([e for e, _ in pts], [a for _, a in pts], alpha=0.35, marker=".", label=name)
        means = sorted(
            (e, np.mean([a for n in eps for ee, a in eps[n] if ee == e])) for e in {e for n in eps for e, _ in eps[n]}
        )
        left.plot([e for e, _ in means], [a for _, a in means], color="C1", lw=2.5, label="mean fused (LDP)")
        left.axhline(own, ls="--", color="k", label="mean own model")
        left.axhline(oracle, ls=":", color="C3", label="mean ORACLE (non-private)")
        left.set_xscale("log")
        unit = report["scenario"]["round"]["unit"]
        left.set_xlabel(
            f"model-level ε per {unit} released per peer per round\n(features + weights, basic composition)"
        )
        left.set_ylabel("test accuracy")
        left.set_title("LDP fusion: privacy–utility")
        left.legend(fontsize=7)
    else:
        left.set_axis_off()
    for i, (name, s) in enumerate(sites.items()):
        if s["pool"]:
            right.scatter(
                [m["epsilon"] for m in s["pool"]],
                [m["accuracy"] for m in s["pool"]],
                marker="x",
                color=f"C{i}",
                label=f"{name} DP-SGD pool",
            )
    merged = next((p for p in report["plan"] if p["method"] == "merged"), None)
    if merged is not None:
        eps_m = report["scenario"]["round"]["merge_epsilon"]
        for i, s in enumerate(sites.values()):
            a = s["rounds"][merged["label"]]["accuracy"]
            if a is not None:
                right.scatter([eps_m], [a], marker="o", color=f"C{i}", edgecolor="k")
        right.scatter([], [], marker="o", color="w", edgecolor="k", label=f"fused with merges at ε′={eps_m:g}")
    right.axhline(own, ls="--", color="k", label="mean own model (non-private)")
    right.set_xlabel("data-level ε per training record")
    right.set_title("DP-SGD pools and merged fusion")
    right.set_ylim(0, 1)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(report: dict, path: Path) -> None:
    plt = pyplot("the simulator's plots")

    rows = summary_rows(report)
    names = [r["site"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(rows)), 3.8))
    xs = range(len(rows))
    a.bar([x - 0.2 for x in xs], [r["model_eps"] for r in rows], 0.4, label="filter (RDP, adaptive-valid)")
    a.bar([x + 0.2 for x in xs], [r["model_eps_sum"] for r in rows], 0.4, label="Σε (basic composition)")
    limits = [spent(report["ledgers"][n], "model")["epsilon_limit"] for n in names]
    a.scatter(
        xs, [lim if lim is not None else float("nan") for lim in limits], marker="_", s=400, color="k", label="limit"
    )
    a.set_xticks(list(xs), names)
    a.set_title("model level (per neuron, model total)")
    a.set_ylabel("ε spent (from each site's ledger)")
    a.legend(fontsize=7)
    b.bar(list(xs), [r["data_eps"] for r in rows], 0.5, color="C2")
    dl = [spent(report["ledgers"][n], "data")["epsilon_limit"] for n in names]
    b.scatter(xs, [lim if lim is not None else float("nan") for lim in dl], marker="_", s=400, color="k")
    b.set_xticks(list(xs), names)
    b.set_ylim(bottom=0)
    b.set_title("data level (per training record)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- baselines


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _p2p_bytes(it: dict) -> float:
    return float(sum((r.get("bytes_sent") or 0) + (r.get("bytes_received") or 0) for r in it.get("rounds", [])))


def comparison_rows(report: dict) -> list[dict]:
    """One row per way of training, mean over sites: own, one-shot fusion (the plan's main ldp
    and merged rounds), multi-round peer-to-peer (when sites report ``iterate``), DP-FedAvg at each
    calibration, the non-private oracle and central pooled training (from ``report["baselines"]``).

    ``accuracy_std`` is over baseline seeds (DP-FedAvg, central pooled); ``low``/``high`` over
    sites. ε is per training record at every site (data level): filter and PLD figures."""
    sites = report["sites"]
    rows: list[dict] = []

    def row(method, accs, std=None, eps_filter=None, eps_pld=None, rounds=None, nbytes=None, note="", wall=None):
        accs = [a for a in accs if a is not None]
        rows.append(
            {
                "method": method,
                "accuracy": _mean(accs),
                "accuracy_std": std,
                "low": min(accs) if accs else None,
                "high": max(accs) if accs else None,
                "epsilon_filter": eps_filter,
                "epsilon_pld": eps_pld,
                "rounds": rounds,
                "bytes_per_site": nbytes,
                "wall_s_per_site": wall,
                "note": note,
            }
        )

    row(
        "own model (local only)",
        [s["own_accuracy"] for s in sites.values()],
        eps_filter=0.0,
        note="non-private, no exchange",
    )
    plan = report["plan"]
    main_ldp = next((p["label"] for p in plan if p["method"] == "ldp" and p["scale"] == 1.0), None)
    merged = next((p["label"] for p in plan if p["method"] == "merged"), None)
    if main_ldp:
        row(
            f"one-shot fusion, LDP (`{main_ldp}`)",
            [s["rounds"][main_ldp]["accuracy"] for s in sites.values()],
            rounds=1,
            note="model-level ε per neuron (see Budgets), not per record",
        )
    if merged:
        data = [spent(report["ledgers"][n], "data")["epsilon_filter"] for n in sites]
        row(
            f"one-shot fusion, DP merges (`{merged}`)",
            [s["rounds"][merged]["accuracy"] for s in sites.values()],
            eps_filter=max(data) if data else None,
            rounds=1,
            note="ε: the busiest site's data-level ledger figure, every data-level release it made",
        )
    its = [s["iterate"] for s in sites.values() if s.get("iterate")]
    if its:
        row(
            "multi-round peer-to-peer",
            [it.get("final_accuracy") for it in its],
            eps_filter=max((it.get("epsilon_filter") or 0.0) for it in its),
            eps_pld=max((it.get("epsilon_pld") or 0.0) for it in its),
            rounds=max(len(it.get("rounds", [])) for it in its),
            nbytes=_mean([_p2p_bytes(it) for it in its]),
            wall=_mean([sum(r.get("seconds") or 0.0 for r in it.get("rounds", [])) for it in its]),
            note="ε: the largest site ledger's figures",
        )
    secure = [s["secure_iterate"] for s in sites.values() if s.get("secure_iterate")]
    if secure:
        row(
            SECURE_ROW,
            [it.get("final_accuracy") for it in secure],
            eps_filter=max(
                (it["epsilon_filter"] for it in secure if it.get("epsilon_filter") is not None), default=None
            ),
            rounds=report["scenario"]["iterate"]["rounds"],
            nbytes=_mean([(it.get("bytes_sent") or 0) + (it.get("bytes_received") or 0) for it in secure]),
            wall=_mean([it.get("wall_s") for it in secure]),
            note=f"one secure sum per step, Skellam shares (coalition {secure[0].get('coalition')}); "
            "ε: the largest site ledger's filter (RDP only); bytes: protobuf payload across each site's "
            "boundary, both ways",
        )
    b = report.get("baselines") or {}
    fa = b.get("dp_fedavg")
    if fa:
        for figure, run in fa["calibrations"].items():
            row(
                f"DP-FedAvg, σ by {figure} (σ={run['noise_multiplier']:.3g})",
                [run["final_accuracy_mean"]] * len(sites),
                std=run["final_accuracy_std"],
                eps_filter=run["epsilon_spent"]["filter"],
                eps_pld=run["epsilon_spent"]["pld"],
                rounds=fa["rounds"],
                nbytes=run["bytes_per_site"]["total"],
                wall=run["wall_s"] / (len(run["seeds"]) * len(sites)),
                note=f"central server; RDP ε {run['epsilon_spent']['rdp']:.3g}; {len(run['seeds'])} seeds",
            )
    cd = b.get("central_dpsgd")
    if cd:
        uploads = [v for k, v in cd["bytes_per_site"].items() if k != "rule"]
        row(
            f"central DP-SGD, trusted curator (σ={cd['noise_multiplier']:.3g})",
            [cd["accuracy_mean"]] * len(sites),
            std=cd["accuracy_std"],
            eps_filter=cd["epsilon_spent"]["filter"],
            eps_pld=cd["epsilon_spent"]["pld"],
            nbytes=_mean(uploads),
            wall=cd["wall_s"] / len(cd["seeds"]),
            note=f"{cd['steps']} steps at q={cd['sample_rate']:g}; RDP ε {cd['epsilon_spent']['rdp']:.3g}; "
            f"bytes: records uploaded; wall: the curator's; {len(cd['seeds'])} seeds",
        )
    row(ORACLE, [s["oracle"]["accuracy"] for s in sites.values()], note="exact-feature matching, simulator only")
    c = b.get("central_pooled")
    if c:
        row(
            "central pooled (non-private)",
            [c["accuracy_mean"]] * len(sites),
            std=c["accuracy_std"],
            note=f"all {c['records']} records in one place; {len(c['seeds'])} seeds",
        )
    return rows


def comparison_table(report: dict) -> str:
    """The comparison of every way of training, as text (what ``privfusion simulate`` prints)."""
    head = [
        "method",
        "accuracy",
        "± seeds",
        "sites min–max",
        "ε/record filter",
        "ε/record PLD",
        "rounds",
        "bytes/site",
        "wall s/site",
        "note",
    ]
    lines = [
        [
            r["method"],
            _fmt(r["accuracy"]),
            _fmt(r["accuracy_std"]),
            f"{_fmt(r['low'])}–{_fmt(r['high'])}",
            _fmt(r["epsilon_filter"], ".3g"),
            _fmt(r["epsilon_pld"], ".3g"),
            _fmt(r["rounds"], "d"),
            _fmt(r["bytes_per_site"], ",.0f"),
            _fmt(r["wall_s_per_site"], ".1f"),
            r["note"],
        ]
        for r in comparison_rows(report)
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def baselines_markdown(report: dict) -> list[str]:
    """The report's "Baselines" section (empty without baselines)."""
    b = report.get("baselines")
    if not b:
        return []
    lines = ["## Baselines and comparison", "", "```", comparison_table(report), "```", ""]
    c = b.get("central_pooled")
    if c:
        hp = c["hyperparameters"]
        lines.append(
            f"- **central pooled (NON-PRIVATE)**: the sites' architecture trained on all {c['records']} protected records "
            f"pooled ({hp['epochs']} epochs, batch {hp['batch_size']}, Adam lr {hp['learning_rate']:g}, the `[model]` "
            f"hyperparameters): {c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f} over seeds {c['seeds']} — the "
            "ceiling no fusion can honestly beat."
        )
    fa = b.get("dp_fedavg")
    if fa:
        lines.append(
            f"- **DP-FedAvg** (simulated by the simulator, central server): {fa['rounds']} rounds; in each, every site "
            f"runs {fa['local_steps']} DP-SGD steps at Poisson rate q = {fa.get('sample_rate', 1.0):g} (1: full batch; clip {fa['clip_norm']:g}, lr {fa['learning_rate']:g}, "
            f"{fa['adjacency']}) from the server model, which averages the results weighted by record counts. Every "
            f"site spends ε = {fa['epsilon']:g} per record at δ = {fa['delta']:g} by the calibration's figure; σ is "
            f"calibrated by RDP (what an Opacus / dp-accounting user reports) and by the ledger's RDP filter (what a "
            f"site that charges its ledger can spend). Accountant: {fa['accountant']}. Noise: fixed seeds (simulation)."
        )
        lines += [
            "",
            "| calibration | σ | ε filter | ε RDP | ε PLD | accuracy (mean ± std over seeds) | per seed | bytes per site |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for figure, run in fa["calibrations"].items():
            e = run["epsilon_spent"]
            seeds = ", ".join(f"{v:.3f}" for v in run["final_accuracy_per_seed"].values())
            lines.append(
                f"| {figure} | {run['noise_multiplier']:.4g} | {e['filter']:.3f} | {e['rdp']:.3f} | {e['pld']:.3f} | "
                f"{run['final_accuracy_mean']:.3f} ± {run['final_accuracy_std']:.3f} | {seeds} | "
                f"{run['bytes_per_site']['total']:,} ({run['bytes_per_site']['rule']}) |"
            )
    cd = b.get("central_dpsgd")
    if cd:
        e = cd["epsilon_spent"]
        lines.append(
            f"- **central DP-SGD** (a trusted curator, simulated): {cd['steps']} DP-SGD steps on every site's records "
            f"pooled, Poisson rate q = {cd['sample_rate']:g}, clip {cd['clip_norm']:g}, lr {cd['learning_rate']:g}, "
            f"denominator q·N with N = {cd['dataset_size']} (public: the sites' declared counts), σ = "
            f"{cd['noise_multiplier']:.4g} by RDP at ε = {cd['epsilon_target']:g} per record, δ = {cd['delta']:g} "
            f"(spent: filter {e['filter']:.3f}, RDP {e['rdp']:.3f}, PLD {e['pld']:.3f}): "
            f"{cd['accuracy_mean']:.3f} ± {cd['accuracy_std']:.3f} over seeds {cd['seeds']} — the ceiling for any DP "
            "collaboration at this ε."
        )
    if any(s.get("iterate") for s in report["sites"].values()):
        lines += [
            "",
            "| site | P2P rounds | P2P final accuracy | ε filter | ε PLD | bytes sent | bytes received |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in report["sites"].items():
            it = s.get("iterate")
            if not it:
                continue
            rs = it.get("rounds", [])
            lines.append(
                f"| {name} | {len(rs)} | {_fmt(it.get('final_accuracy'))} | {_fmt(it.get('epsilon_filter'), '.3f')} | "
                f"{_fmt(it.get('epsilon_pld'), '.3f')} | {sum(r.get('bytes_sent') or 0 for r in rs):,} | "
                f"{sum(r.get('bytes_received') or 0 for r in rs):,} |"
            )
    if any(s.get("secure_iterate") for s in report["sites"].values()):
        lines += [
            "",
            "| site | secure P2P status | steps | steps re-run | final accuracy | ε filter (ledger) | ε limit | "
            "charges | total noise variance V | wall s | bytes sent | bytes received |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in report["sites"].items():
            it = s.get("secure_iterate")
            if not it:
                continue
            led = it.get("ledger") or {}
            lines.append(
                f"| {name} | {it['status']} | {_fmt(it.get('steps_done'), 'd')} | {_fmt(it.get('steps_rerun'), 'd')} | "
                f"{_fmt(it.get('final_accuracy'))} | {_fmt(led.get('epsilon_filter'), '.3f')} | "
                f"{_fmt(led.get('epsilon_limit'), '.3g')} | {_fmt(led.get('charges'), 'd')} | "
                f"{_fmt(it.get('total_variance'), '.4g')} | {_fmt(it.get('wall_s'), '.1f')} | "
                f"{_fmt(it.get('bytes_sent'), ',d')} | {_fmt(it.get('bytes_received'), ',d')} |"
            )
    if "baselines.png" in report.get("plots", []):
        lines += ["", "![baselines](baselines.png)"]
    return [*lines, ""]


def _p2p_curve(report: dict) -> list[tuple[int, float, float | None, float | None]]:
    """(round, mean accuracy, mean ε filter, mean ε PLD) over the sites that report the round."""
    by_round: dict[int, list[dict]] = {}
    for s in report["sites"].values():
        for r in (s.get("iterate") or {}).get("rounds", []):
            if r.get("accuracy") is not None:
                by_round.setdefault(int(r["round"]), []).append(r)
    return [
        (
            k,
            _mean([r["accuracy"] for r in rs]),
            _mean([r.get("epsilon_filter") for r in rs]),
            _mean([r.get("epsilon_pld") for r in rs]),
        )
        for k, rs in sorted(by_round.items())
    ]


def plot_baselines(report: dict, path: Path) -> None:
    """Accuracy against rounds and against ε spent per record: DP-FedAvg at each calibration
    (mean ± std over seeds) and multi-round peer-to-peer (mean over sites, when present), with
    the own-model, oracle and central pooled levels. ε: solid = filter, dotted = PLD."""
    plt = pyplot("the simulator's plots")
    import numpy as np

    b = report.get("baselines") or {}
    fa = b.get("dp_fedavg")
    sites = report["sites"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"rdp": "C0", "filter": "C2"}
    if fa:
        for figure, run in fa["calibrations"].items():
            pr = run["per_round"]
            rs = np.array([p["round"] for p in pr])
            m = np.array([p["accuracy_mean"] for p in pr])
            sd = np.array([p["accuracy_std"] for p in pr])
            label = f"DP-FedAvg, σ by {figure} ({len(run['seeds'])} seeds)"
            col = colours.get(figure)
            left.plot(rs, m, color=col, label=label)
            left.fill_between(rs, m - sd, m + sd, color=col, alpha=0.2)
            right.plot([p["epsilon_filter"] for p in pr], m, color=col, label=label + ", ε filter")
            right.plot([p["epsilon_pld"] for p in pr], m, color=col, ls=":", label=label + ", ε PLD")
    p2p = _p2p_curve(report)
    if p2p:
        left.plot(
            [r for r, *_ in p2p],
            [a for _, a, *_ in p2p],
            color="C1",
            marker=".",
            label="peer-to-peer (mean over sites)",
        )
        pts = [(e, a) for _, a, e, _ in p2p if e is not None]
        right.plot([e for e, _ in pts], [a for _, a in pts], color="C1", marker=".", label="peer-to-peer, ε filter")
        pts = [(e, a) for _, a, _, e in p2p if e is not None]
        right.plot([e for e, _ in pts], [a for _, a in pts], color="C1", ls=":", label="peer-to-peer, ε PLD")
    levels = [("mean own model", _mean([s["own_accuracy"] for s in sites.values()]), "k", "--")]
    levels.append((f"mean {ORACLE}", _mean([s["oracle"]["accuracy"] for s in sites.values()]), "C3", ":"))
    if b.get("central_dpsgd"):
        levels.append(("central DP-SGD (trusted curator)", b["central_dpsgd"]["accuracy_mean"], "C5", "--"))
    if b.get("central_pooled"):
        levels.append(("central pooled (non-private)", b["central_pooled"]["accuracy_mean"], "C4", "-."))
    for label, y, col, ls in levels:
        if y is not None:
            for ax in (left, right):
                ax.axhline(y, color=col, ls=ls, lw=1, label=label if ax is left else None)
    left.set_xlabel("round")
    left.set_ylabel("test accuracy")
    left.set_title("accuracy against rounds")
    right.set_xlabel("ε per training record spent by each site (δ fixed)")
    right.set_title("accuracy against ε spent")
    left.legend(fontsize=7, loc="lower right")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- markdown


def _signal_note(report: dict) -> str:
    """What the ldp row's rounds predicted, from public parameters alone, about their weights
    release (the round report's ``weights_signal``; coordinator_free.runner.weights_signal)."""
    plan = report["plan"]
    main = next((p["label"] for p in plan if p["method"] == "ldp" and p["scale"] == 1.0), None)
    signals = [s["rounds"][main].get("weights_signal") for s in report["sites"].values() if main in s["rounds"]]
    signal = next((x for x in signals if x), None)
    if signal is None:
        return ""
    need = signal.get("epsilon_needed")
    where = f"every weight tensor clears from ε ≈ {need:.3g} per neuron" if need else "some tensor never clears"
    return (
        f" Predicted from the public parameters, that weights release is constant for "
        f'{", ".join(signal["constant"])} ({where}; docs/mechanisms.md, "When a weights release carries no '
        "signal\"): the row measures what the exchange delivers at the ε it asks for — a user's ldp round there is "
        "refused before anything is charged unless asked to go on."
    )


def markdown(report: dict) -> str:
    sc = report["scenario"]
    r = sc["round"]
    lines = [
        f"# Simulation: {sc['name']}",
        "",
        sc["description"] or "",
        "",
        f"{len(report['sites'])} sites, dataset `{sc['data']['dataset']}` split `{sc['data']['split']}`"
        + (f" (Dirichlet concentration {sc['data']['concentration']:g})" if sc["data"]["split"] == "dirichlet" else "")
        + f"; {report['public_examples']} public examples (probe sets, merge validation); accuracy on "
        f"{report['test_examples']} held-out test examples. Seed {sc['seed']} (fixed-seed noise: a simulation "
        "option, reported in every release record).",
        "",
        "Every site ran a real daemon (own process, own key and self-signed certificate, mutual TLS with pinned "
        "certificates, own SQLite ledger) on loopback, and its own rounds (own process) — all sites at once.",
        "",
        "## Summary",
        "",
        "```",
        summary_table(report),
        "```",
        "",
        "- **own**: the site's model trained on its own records only.",
        f"- **fused (LDP)**: the site's round `{next((p['label'] for p in report['plan'] if p['method'] == 'ldp' and p['scale'] == 1.0), '—')}`: "
        f"noisy graph features (ε_act={r['activation_epsilon']:g}, ε_w={r['weight_epsilon']:g} per neuron) and PFA weights "
        f"(ε={r['weights_epsilon']:g}, δ={r['weights_delta']:g} per neuron) from every live peer, aligned by graph matching, "
        f"fused with α={r['alpha']:g} (own) and (1−α)/k for each of the k peers." + _signal_note(report),
        f"- **fused (merge)**: peers answered with an {r['merge_method'].upper()} merge of their DP-SGD pool at "
        f"(ε′={r['merge_epsilon']:g}, δ′={r['merge_delta']:g}) per training record; aligned locally and fused the same way.",
        "- **+repair**, **+FT**: the same round after its local steps at the requester (nothing charged, nothing "
        "sent): candidate fusions (subsets of the contributions × α) compared on the PUBLIC validation set, the best "
        f"repaired by REPAIR on the site's `{r.get('repair', 'off')}` data (each hidden unit's mean/std reset to the "
        "fusion-weighted mix of the endpoints' statistics), then fine-tuned on the site's own records "
        f"({r.get('finetune_epochs', 0)} epochs). Each round report says which peers it kept, the α and the stage to "
        "adopt.",
        "- **central pooled (non-private)**: one model trained on every site's records together — the ceiling no "
        "fusion can honestly beat (— when the report has no baselines); **Δ central**: fused (merge) + repair minus it.",
        "- **ORACLE (non-private)**: the same fusion aligned by graph matching on every model's EXACT features, "
        "computed by the simulator, which holds every exact model. No site could compute it; it is the ceiling the "
        "private fusion is measured against.",
        "- **ε spent**: read from each site's ledger file after the run — what the site *released to others*: "
        "the model-level figure is its model's total budget over all counterparties: the privacy filter's ε "
        "(RDP over fixed orders, valid for adaptively chosen requests; what the ledger enforces) and Σε, the "
        "basic-composition sum of the releases' own ε; n = releases.",
        "",
    ]
    f = report.get("failure") or {}
    if f:
        lines += ["## Failure", ""]
        if f.get("killed_at"):
            lines.append(
                f"**{f['site']}** was killed with {f['signal']} (daemon and its own round) at {f['killed_at']} "
                f"({f['trigger']}; its ledger held {f['ledger_entries_at_kill']} charges when it died). "
                "The surviving sites dropped it as follows and finished their rounds without it:"
            )
        else:
            lines.append(f"The scripted failure of {f['site']} did not happen: {f['trigger']}.")
        lines.append("")
        for name, s in report["sites"].items():
            for label, rr in s["rounds"].items():
                for d in rr.get("dropped") or []:
                    lines.append(
                        f"- {name}, round `{label}`: dropped **{d['peer']}** at step `{d['step']}` at {d['at']} "
                        f"({d['status']}; charged: {d['charged']}): {d['reason']}"
                    )
                if rr["status"] != "fused":
                    lines.append(f"- {name}, round `{label}`: {rr['status']} — {rr.get('reason', '')}")
        lines.append("")
    lines += baselines_markdown(report)
    lines += [
        "## Rounds",
        "",
        "| site | round | status | contributors | accuracy | + repair | + FT | kept (α) | adopt | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["sites"].items():
        for label, rr in s["rounds"].items():
            drops = ", ".join(f"{d['peer']}@{d['step']}" for d in rr.get("dropped") or []) or "—"
            contribs = ", ".join(f"{p} ({m})" for p, m in (rr.get("methods") or {}).items()) or "—"
            af = rr.get("after_fusion") or {}
            kept = f"{', '.join(af['kept'])} ({af['alpha']:g})" if af.get("kept") else "all"
            lines.append(
                f"| {name} | {label} | {rr['status']} | {contribs} | {_fmt(rr['accuracy'])} | "
                f"{_fmt(rr.get('accuracy_repaired'))} | {_fmt(rr.get('accuracy_finetuned'))} | {kept} | "
                f"{af.get('adopt') or '—'} | {drops} |"
            )
    lines += [
        "",
        "## Budgets (from each site's ledger)",
        "",
        "| site | budget | releases | ε spent (filter) | Σε of releases | Σδ of releases | ε limit | δ limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, led in report["ledgers"].items():
        for b in led["budgets"]:
            lines.append(
                f"| {name} | `{b['budget']}` | {b['count']} | {_fmt(b['spent_epsilon_filter'], '.4g')} | "
                f"{_fmt(b['epsilon_sum'], '.4g')} | {_fmt(b['delta_sum'], '.3g')} | {_fmt(b['epsilon_limit'], 'g')} | {_fmt(b['delta_limit'], 'g')} |"
            )
    lines += [
        "",
        "## Ledgers and receipts",
        "",
        "Every receipt a requester reported is an entry of the releasing site's ledger; entries without a "
        "reported receipt went to a requester that died before writing its report, or whose stream broke before "
        "the receipt arrived (the charge stands: a charge is never refunded).",
        "",
    ]
    for name, c in report["reconciliation"].items():
        extra = (
            ", ".join(f"#{e['entry_id']} to {e['counterparty']}" for e in c["entries_without_reported_receipt"])
            or "none"
        )
        lines.append(
            f"- {name}: {c['ledger_entries']} ledger entries, {c['receipts_reported']} receipts reported by "
            f"requesters, missing from the ledger: {len(c['receipts_missing_from_ledger'])}; entries without a "
            f"reported receipt: {extra}"
        )
    table = iterate_table(report)
    if table:
        lines += ["", "## Multi-round peer-to-peer DP training", "", "```", table, "```"]
    t = report["timings"]
    lines += [
        "",
        "## Plots",
        "",
        "![accuracy](accuracy.png)",
        "",
        "![frontier](frontier.png)",
        "",
        "![budget](budget.png)",
        "",
        "## Timings",
        "",
        ", ".join(f"{k} {v:.1f}" for k, v in t.items()),
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out = Path(out)
    plot_accuracy(report, out / "accuracy.png")
    plot_frontier(report, out / "frontier.png")
    plot_budget(report, out / "budget.png")
    report["plots"] = ["accuracy.png", "frontier.png", "budget.png"]
    if report.get("baselines"):
        plot_baselines(report, out / "baselines.png")
        report["plots"].append("baselines.png")
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str), encoding="utf-8")
    (out / "report.md").write_text(markdown(report), encoding="utf-8")
