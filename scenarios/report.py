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
        "fused (merge)",
        ORACLE,
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
                _fmt(r["merged"]),
                _fmt(r["oracle"]),
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
        ("ORACLE: exact-feature matching (non-private)", "oracle"),
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
            hatch="//" if key == "oracle" else None,
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


# ------------------------------------------------------------------------------------- markdown


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
        f"fused with α={r['alpha']:g} (own) and (1−α)/k for each of the k peers.",
        f"- **fused (merge)**: peers answered with an {r['merge_method'].upper()} merge of their DP-SGD pool at "
        f"(ε′={r['merge_epsilon']:g}, δ′={r['merge_delta']:g}) per training record; aligned locally and fused the same way.",
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
    lines += [
        "## Rounds",
        "",
        "| site | round | status | contributors | accuracy | dropped |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in report["sites"].items():
        for label, rr in s["rounds"].items():
            drops = ", ".join(f"{d['peer']}@{d['step']}" for d in rr.get("dropped") or []) or "—"
            contribs = ", ".join(f"{p} ({m})" for p, m in (rr.get("methods") or {}).items()) or "—"
            lines.append(f"| {name} | {label} | {rr['status']} | {contribs} | {_fmt(rr['accuracy'])} | {drops} |")
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
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str), encoding="utf-8")
    (out / "report.md").write_text(markdown(report), encoding="utf-8")
