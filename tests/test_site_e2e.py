"""End to end, as a hospital's IT would do it, with the command line only: three sites with
records the project has never seen (a synthetic CSV of mixed numeric and categorical columns
and a binary label, one file per site, plus a public file for probes) go from `site new` to
trained models, DP-SGD pools and probe sets, pin each other, serve, run a round with
method "auto" from one site, adopt the fused model and score it on held-out records; then
every ledger is checked against the round's signed receipts."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from peer_harness import DaemonProcess, SiteFiles, cli_parallel

pytestmark = pytest.mark.slow

SITES = ("st-anne", "riverside", "hillcrest")
LABEL = "readmitted_30d"
WARDS = ("cardiology", "neurology", "orthopaedics")
HIDDEN = 8
ARCH = json.dumps({"kind": "mlp", "hidden": [HIDDEN]})


def synthesise(path: Path, rows: int, rng: np.random.Generator, labelled: bool = True) -> None:
    """Patients: age, systolic blood pressure, length of stay (numeric), smoker (yes/no), ward
    (three categories) and whether they were readmitted within 30 days, by a logistic model."""
    age = rng.normal(62, 12, rows).round(0)
    sbp = rng.normal(132, 16, rows).round(0)
    stay = rng.gamma(2.0, 2.5, rows).round(1)
    smoker = rng.random(rows) < 0.3
    ward = rng.integers(0, 3, rows)
    logit = (
        0.06 * (age - 62)
        + 0.03 * (sbp - 132)
        + 0.25 * (stay - 5)
        + 1.2 * smoker
        + np.array([0.8, 0.0, -0.8])[ward]
        - 0.4
    )
    readmitted = rng.random(rows) < 1 / (1 + np.exp(-logit))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["age", "systolic_bp", "length_of_stay", "smoker", "ward"] + ([LABEL] if labelled else []))
        for i in range(rows):
            w.writerow(
                [int(age[i]), int(sbp[i]), stay[i], "yes" if smoker[i] else "no", WARDS[ward[i]]]
                + (["yes" if readmitted[i] else "no"] if labelled else [])
            )


def privfusion(*args: str, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(
            f"privfusion {' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        )
    return r.stdout


def phase(name: str, t0: list) -> None:
    now = time.monotonic()
    print(f"[{now - t0[0]:6.1f}s] {name}", flush=True)


def parallel(*commands: tuple[str, ...], timeout: float = 180) -> list[str]:
    """Commands of different sites at once (each site's own machine, in real life)."""
    return cli_parallel(*commands, timeout=timeout)


def test_own_csv_to_a_round_an_adopted_fused_model_and_its_scores(tmp_path):
    started = time.monotonic()
    t0 = [started]
    rng = np.random.default_rng(20261130)
    data = tmp_path / "data"
    data.mkdir()
    for s in SITES:
        synthesise(data / f"{s}.csv", 300, rng)
    synthesise(data / "public.csv", 120, rng)  # e.g. already-published or synthetic records: may be shown to anyone
    synthesise(data / "st-anne-test.csv", 400, rng)  # st-anne's own held-out records

    # 1. every site: site new, its model, its DP-SGD pool (same architecture), its probe and validation sets
    root = tmp_path / "sites"
    parallel(
        *[
            (
                "site",
                "new",
                "--name",
                s,
                "--dir",
                str(root / s),
                "--listen",
                "127.0.0.1:0",
                "--address",
                "127.0.0.1",
                "--adjacency",
                "replace-one",
            )
            for s in SITES
        ]
    )
    # every site prepares its records with the preprocessing fitted on the public file: the same
    # for all sites (fused models see inputs prepared alike) and outside every guarantee's scope
    public = ("--public", str(data / "public.csv"))
    parallel(
        *[
            (
                "model",
                "train",
                "--site",
                str(root / s),
                "--data",
                str(data / f"{s}.csv"),
                "--label",
                LABEL,
                *public,
                "--name",
                "readmission",
                "--hidden",
                str(HIDDEN),
                "--epochs",
                "30",
                "--json",
            )
            for s in SITES
        ]
    )
    phase("models trained", t0)
    # DP-SGD, full batch, T = 10: sigma = 16 and 24 give epsilon 1.5 and 1.0 (replace-one, delta = 1e-5),
    # so an RS merge at the round's target (2, 1e-5) is reachable
    parallel(
        *[
            (
                "pool",
                "train",
                "--site",
                str(root / s),
                "--data",
                str(data / f"{s}.csv"),
                "--label",
                LABEL,
                *public,
                "--architecture",
                ARCH,
                "--steps",
                "10",
                "--model",
                "name=p1,noise=16,clip=1",
                "--model",
                "name=p2,noise=24,clip=1",
                "--json",
            )
            for s in SITES
        ]
    )
    phase("pools trained", t0)
    parallel(
        *[
            (
                "probe",
                "make",
                "--site",
                str(root / s),
                "--data",
                str(data / "public.csv"),
                "--label",
                LABEL,
                "--model",
                "readmission",
                "--rows",
                "64",
            )
            for s in SITES
        ]
    )
    phase("probes made", t0)
    for s in SITES:
        for o in SITES:
            if o != s:
                privfusion(
                    "peer", "trust", "add", str(root / o / "identity" / "site.crt"), "--dir", str(root / s / "identity")
                )

    phase("pinned", t0)
    # 2. three daemons (`privfusion peer serve`), each on its own port
    daemons = {s: DaemonProcess(SiteFiles(s, root / s, root / s / "site.toml", root / s / "identity")) for s in SITES}
    try:
        addresses = {s: d.wait_ready() for s, d in daemons.items()}
        phase("daemons ready", t0)
        roster = ["# the sites' shared roster"]
        for s in SITES:
            roster += [
                f"[sites.{s}]",
                f'address = "{addresses[s]}"',
                f'certificate = "sites/{s}/identity/site.crt"',
                "",
            ]
        (tmp_path / "roster.toml").write_text("\n".join(roster))
        info = json.loads(
            privfusion(
                "peer",
                "info",
                "--via",
                addresses["riverside"],
                "--identity",
                str(root / "st-anne" / "identity"),
                "--peer",
                "riverside",
            )
        )
        assert [m["name"] for m in info["models"]] == ["readmission"] and info["has_probe_set"]
        assert [p["name"] for p in info["pools"]] == ["dpsgd"] and "unusable" not in info  # everything is used

        phase("info", t0)
        # 3. a round from st-anne, method "auto": a merge of each peer's pool at (2, 1e-5) per record
        (root / "st-anne" / "round.toml").write_text(
            '[round]\nroster = "../../roster.toml"\nmodel = "readmission"\nalpha = 0.5\nquorum = 3\n'
            'method = "auto"\ncall_timeout_s = 60\n[round.merge]\nmethod = "rs"\nepsilon = 2.0\ndelta = 1e-5\n'
        )
        privfusion(
            "round", "--config", str(root / "st-anne" / "site.toml"), "--round", str(root / "st-anne" / "round.toml")
        )
        phase("round done", t0)
        reports = sorted((root / "st-anne" / "rounds").glob("round-*.json"))
        assert len(reports) == 1
        report = json.loads(reports[0].read_text())
        assert report["status"] == "fused" and sorted(report["contributors"]) == ["hillcrest", "riverside"]
        notes = [e for e in report["events"] if e["event"] in ("note", "dropped")]
        assert {(c["peer"], c["step"], c["level"]) for c in report["charges"]} == {
            ("riverside", "merged", "data"),
            ("hillcrest", "merged", "data"),
        }, notes

        # 4. adopt the fused model and score it (and the site's own model) on st-anne's held-out records
        fused = root / "st-anne" / "rounds" / "models" / report["fused_model"]
        adopted = json.loads(
            privfusion(
                "model",
                "adopt",
                "--site",
                str(root / "st-anne"),
                "--from",
                str(fused),
                "--name",
                "readmission-v2",
                "--json",
            )
        )
        assert adopted["kind"] == "round" and adopted["round_id"] == report["round_id"]
        assert "readmission" in adopted["preprocessing_from"]
        provenance = json.loads((root / "st-anne" / "models" / "readmission-v2.provenance.json").read_text())
        assert provenance["report"]["charges"] == report["charges"]  # every signed receipt, kept with the model
        phase("adopted", t0)
        scores = {}
        for name in ("readmission", "readmission-v2"):
            scores[name] = json.loads(
                privfusion(
                    "evaluate",
                    "--site",
                    str(root / "st-anne"),
                    "--model",
                    name,
                    "--data",
                    str(data / "st-anne-test.csv"),
                    "--label",
                    LABEL,
                    "--json",
                )
            )
        for s in scores.values():
            assert {
                "accuracy",
                "macro_f1",
                "weighted_f1",
                "macro_recall",
                "macro_precision",
                "auroc",
                "confusion_matrix",
            } <= set(s)
            cm = np.array(s["confusion_matrix"])
            assert cm.sum() == 400 and s["accuracy"] == pytest.approx(np.trace(cm) / 400)
        # the round's file scores the same as the adopted model (same weights, same preprocessing)
        from_file = json.loads(
            privfusion(
                "evaluate",
                "--site",
                str(root / "st-anne"),
                "--model",
                str(fused),
                "--data",
                str(data / "st-anne-test.csv"),
                "--label",
                LABEL,
                "--json",
            )
        )
        assert from_file["accuracy"] == scores["readmission-v2"]["accuracy"]
        # Not a quality claim, a sanity bound that a broken pipeline (scrambled preprocessing,
        # misaligned neurons, wrong class order) fails: on ~200 + ~200 records the AUROC of a score
        # unrelated to the label has standard deviation sqrt((n1 + n2 + 1) / (12 n1 n2)) ~ 0.029
        # around 0.5, so 0.6 is 3.4 sd above chance (a useless model passes with probability ~3e-4).
        # Measured here: own model 0.77 (seeded training, reproducible), fused 0.77 (its peers' parts
        # are DP-SGD models drawn with fresh noise, so it varies from run to run; 0.6 leaves room).
        assert scores["readmission"]["auroc"] > 0.7 and scores["readmission-v2"]["auroc"] > 0.6

        # 5. the next round starts from the adopted model
        round2 = root / "st-anne" / "round2.toml"
        round2.write_text(
            (root / "st-anne" / "round.toml").read_text().replace('model = "readmission"', 'model = "readmission-v2"')
        )
        privfusion("round", "--config", str(root / "st-anne" / "site.toml"), "--round", str(round2))
        (second,) = [
            json.loads(p.read_text()) for p in (root / "st-anne" / "rounds").glob("round-*.json") if p != reports[0]
        ]
        assert second["status"] == "fused" and second["model"] == "readmission-v2"
    finally:
        for d in daemons.values():
            d.close()

    phase("second round", t0)
    # 6. every ledger, read with `privfusion ledger show --json` (which checks its hash chain on open),
    # holds exactly the releases the two rounds' signed receipts say were charged, nothing else
    ledgers = {
        s: json.loads(privfusion("ledger", "show", "--db", str(root / s / "ledger.sqlite"), "--json")) for s in SITES
    }
    assert ledgers["st-anne"]["entries"] == []  # the requester released nothing
    for peer in ("riverside", "hillcrest"):
        entries = ledgers[peer]["entries"]
        received = [c for r in (report, second) for c in r["charges"] if c["peer"] == peer]
        # the second round asked for the same merge: served again, no new charge (charge-once)
        charged = [c for c in received if not c.get("served_again")]
        again = [c for c in received if c.get("served_again")]
        assert [(e["release_id"], str(e["entry_id"])) for e in entries] == [
            (c["release_id"], c["entry_id"]) for c in charged
        ]
        assert {(c["release_id"], c["entry_id"]) for c in again} <= {(c["release_id"], c["entry_id"]) for c in charged}
        for e, c in zip(entries, charged, strict=True):
            assert (e["counterparty"], e["level"], e["mechanism"], e["epsilon"], e["delta"]) == (
                "st-anne",
                c["level"],
                c["mechanism"],
                c["epsilon"],
                c["delta"],
            )
        # round 1: RS releases one pool model; its record carries the merge's own (epsilon, delta), within the target
        e = entries[0]
        assert (e["level"], e["unit"], e["mechanism"]) == ("data", "record:replace-one", "rs-merge")
        assert e["epsilon"] <= 2.0 and e["delta"] <= 1e-5
        for b in ledgers[peer]["budgets"]:
            assert b["count"] >= 1 and 0 < b["spent_epsilon_filter"] <= b["epsilon_limit"]
        (data_budget,) = [b for b in ledgers[peer]["budgets"] if b["budget"].startswith("data/")]
        assert data_budget["epsilon_limit"] == 4.0 and data_budget["count"] == sum(
            c["level"] == "data" for c in charged
        )
    print(
        f"end to end in {time.monotonic() - started:.1f}s; own model {scores['readmission']}, fused {scores['readmission-v2']}"
    )
