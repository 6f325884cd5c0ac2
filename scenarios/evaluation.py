"""What a simulation measured (``privfusion simulate``, steps 5–6 of ``scenarios.simulate``):
every site's own, fused and merged-fused models and the non-private oracle on the test set, the
stages after fusion, each site's ledger read back after its daemon stopped, and the rounds'
receipts reconciled with the ledgers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator_free.rounds import fusion_weights
from scenarios.world import SiteWorld, World, released_epsilon

# ------------------------------------------------------------------------------------- evaluation


def round_reports(site: SiteWorld) -> dict[str, dict]:
    """The round reports a site wrote, by label (a killed site may have none)."""
    out = {}
    for p in sorted((site.root / "rounds").glob("round-*.json")):
        r = json.loads(p.read_text())
        out[r["label"]] = r
    return out


def oracle_accuracy(world: World, site: SiteWorld, contributors: list[str]) -> float:
    """NON-PRIVATE baseline: the same α-fusion, aligned by graph matching on every model's EXACT
    features on the site's probe set (the simulator holds every exact model; no site could); an
    own network's units matched group by group on the same features (``align_groups``)."""
    net = site.network
    others = [world.sites[name].arrays for name in contributors]
    fused = net.oracle_fuse(site.arrays, others, site.probe, fusion_weights(site.alpha, len(others)))
    return net.accuracy(fused, world.x_test, world.y_test)


def after_fusion_accuracies(world: World, site: SiteWorld, r: dict) -> dict:
    """Test accuracy of each local stage after fusion the round saved (``selected``,
    ``repaired``, ``finetuned``) and what the round did (kept peers, α, adopted stage)."""
    net = site.network
    out: dict[str, Any] = {}
    for stage in ("selected", "repaired", "finetuned"):
        name = r.get(f"{stage}_model")
        out[f"accuracy_{stage}"] = (
            None if not name else net.accuracy(net.load(site.root, name), world.x_test, world.y_test)
        )
    a = r.get("after_fusion") or {}
    sel = a.get("select") or {}
    out["after_fusion"] = {
        "repair": (a.get("repair") or {}).get("data", "off"),
        "kept": sel.get("kept"),
        "dropped": sel.get("dropped"),
        "alpha": sel.get("alpha"),
        "finetune_epochs": (a.get("finetune") or {}).get("epochs", 0),
        "adopt": a.get("adopt"),
        "error": a.get("error"),
    }
    return out


def evaluate(world: World) -> dict[str, dict]:
    out = {}
    for name, s in world.sites.items():
        net = s.network
        reports = round_reports(s)
        rounds = {}
        for label, method, scale in world.plan:
            r = reports.get(label)
            if r is None:
                rounds[label] = {
                    "status": "missing",
                    "method": method,
                    "scale": scale,
                    "accuracy": None,
                    "reason": "no round report (the site was killed before it finished this round)",
                }
                continue
            acc = None
            if r["status"] == "fused":
                acc = net.accuracy(net.load(s.root, r["fused_model"]), world.x_test, world.y_test)
            drops = [p["drop"] for p in r["peers"].values() if p["drop"] is not None]
            rounds[label] = {
                "status": r["status"],
                "reason": r["reason"],
                "method": method,
                "scale": scale,
                "round_id": r["round_id"],
                "accuracy": acc,
                "contributors": r["contributors"],
                "weights": r["weights"],
                "dropped": drops,
                "started_at": r["started_at"],
                "finished_at": r["finished_at"],
                "released_epsilon_per_peer": released_epsilon(world.scenario, scale) if method == "ldp" else None,
                "methods": {p: v["method"] for p, v in r["peers"].items() if v["state"] == "contributed"},
                "weights_signal": r.get("weights_signal"),
                **after_fusion_accuracies(world, s, r),
            }
        main = next((rounds[label] for label, m, sc in world.plan if m == "ldp" and sc == 1.0), None)
        contributors = (
            main["contributors"] if main and main.get("contributors") else [n for n in world.sites if n != name]
        )
        out[name] = {
            "records": len(s.y),
            "alpha": s.alpha,
            "own_accuracy": net.accuracy(s.arrays, world.x_test, world.y_test),
            "rounds": rounds,
            "oracle": {
                "accuracy": oracle_accuracy(world, s, contributors),
                "contributors": contributors,
                "label": "ORACLE (non-private): graph matching on exact features, computed by the simulator",
            },
            "pool": s.pool,
        }
    return out


def read_ledger(path: Path) -> dict:
    """A site's ledger as the file holds it: entries and budget states (the filter's ε), plus
    each budget's basic-composition sums (Σε, Σδ over its entries).

    The ledger's PLD figure is left out: composing the PLDs of a few dozen composite releases
    takes minutes on two cores, and for these per-neuron releases it is not below the
    filter's ε anyway (``privfusion ledger show`` computes it on demand)."""
    from peer.budget.ledger import Ledger

    ledger = Ledger(path)  # read-only (no policy); verified at open: integrity, hash chain, totals
    try:
        summary = ledger.summary(pld=False)
    finally:
        ledger.close()
    for b in summary["budgets"]:
        mine = [e for e in summary["entries"] if b["budget"] in e["budgets"]]
        b["epsilon_sum"] = float(sum(e["epsilon"] for e in mine))
        b["delta_sum"] = float(sum(e["delta"] for e in mine))
    return summary


def read_ledgers(world: World) -> dict[str, dict]:
    return {name: read_ledger(s.ledger) for name, s in world.sites.items()}


def reconcile(world: World, evaluation: dict, ledgers: dict) -> dict[str, dict]:
    """For each releasing site: its ledger entries against the receipts requesters reported.

    Every receipt a requester got must be an entry of the releasing site's ledger. An entry no
    surviving report holds a receipt for went to a requester that died before writing its
    report, or whose stream broke before the receipt arrived (the charge stands)."""
    receipts: dict[str, dict[str, dict]] = {n: {} for n in world.sites}
    for name, s in world.sites.items():
        for r in round_reports(s).values():
            for c in r["charges"]:
                receipts[c["peer"]][c["release_id"]] = {
                    "requester": name,
                    "round": r["label"],
                    "step": c["step"],
                    "entry_id": c["entry_id"],
                }
    out = {}
    for name in world.sites:
        entries = {e["release_id"]: e for e in ledgers[name]["entries"]}
        missing = sorted(set(receipts[name]) - set(entries))
        unreported = [
            {"entry_id": e["entry_id"], "counterparty": e["counterparty"], "mechanism": e["mechanism"]}
            for rid, e in entries.items()
            if rid not in receipts[name]
        ]
        out[name] = {
            "ledger_entries": len(entries),
            "receipts_reported": len(receipts[name]),
            "receipts_missing_from_ledger": missing,
            "entries_without_reported_receipt": unreported,
            "consistent": not missing,
        }
    return out
