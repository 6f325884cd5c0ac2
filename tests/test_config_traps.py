"""No traps in the configuration: what ``privfusion site new`` writes works, as a user runs it.

Every test drives the ``privfusion`` command as a subprocess in a temporary directory (site
new, model/pool train, round, peer serve, site check), editing site.toml as an operator would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from peer_harness import SiteFiles, cli, client, make_site, pin_each_other, running

from coordinator_free.roster import write_roster

LABEL = "outcome"


def write_records(path: Path, rows: int, seed: int) -> Path:
    """A small table: three numeric columns and a binary label that depends on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = (x @ np.array([1.0, -0.5, 0.25]) + 0.3 * rng.normal(size=rows) > 0).astype(int)
    lines = [f"a,b,c,{LABEL}"] + [f"{r[0]:.5f},{r[1]:.5f},{r[2]:.5f},{v}" for r, v in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def new_site(root: Path, name: str = "hospital-a", *extra: str) -> Path:
    d = root / name
    cli("site", "new", "--name", name, "--dir", str(d), "--listen", "127.0.0.1:0", "--address", "127.0.0.1", *extra)
    return d


def documented_iterate(text: str) -> str:
    """The iterate round file of docs/deployment.md (section 3.1), as a user copies it."""
    block = re.search(r"```toml\n(# iterate\.toml.*?)```", text, re.S)
    assert block, "docs/deployment.md has no iterate.toml block"
    return block[1]


# ------------------------------------------------------------------------------ 1. site new's budgets


def test_a_fresh_site_admits_its_documented_pool_merges_and_iterate_run(tmp_path):
    """Before: ``site new`` wrote a replace-one data budget; the documented iterate run (add-remove,
    its default) was refused ("the site's policy needs a [policy.data] budget in that unit"), and
    after switching the budget to add-remove, merges of pools trained by ``pool train``'s
    defaults (replace-one) were refused. Now a fresh site's budget is add-remove, ``pool train
    --site`` trains in the site's unit (declared n = [site] declared_records, no true count in
    any record), a merge at a round's default target (2, 1e-5) is served, and the documented
    iterate run goes through, every segment charged to the same budget."""
    d = new_site(tmp_path)
    records = write_records(tmp_path / "records.csv", 240, 1)
    public = write_records(tmp_path / "public.csv", 120, 2)
    common = ("--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public))
    cli("model", "train", *common, "--name", "mlp", "--epochs", "5")
    cli("pool", "train", *common, "--architecture", '{"kind": "mlp", "hidden": [64]}')
    for manifest in sorted((d / "pool").glob("dpsgd-*.json")):
        record = json.loads(manifest.read_text())["metadata"]["record"]
        assert record["unit"] == "record:add-remove", manifest.name
        params = record["parameters"]
        assert (params["dataset_size"], params["dataset_size_source"]) == (1000, "declared"), manifest.name
        assert "240" not in manifest.read_text() and "192" not in manifest.read_text()  # no true count

    # a peer asks for an RS merge at a round's default target: admitted and charged to the data budget
    site = SiteFiles("hospital-a", d, d / "site.toml", d / "identity")
    peer = make_site(tmp_path, "hospital-b", models={})
    pin_each_other(site, peer)
    with running(site) as (_, address), client(peer, address, peer="hospital-a") as c:
        merged = c.merged("dpsgd", method="rs", epsilon=2.0, delta=1e-5)
        assert merged.receipt.record.unit == "record:add-remove"

    # the documented iterate run on another fresh site (the run's noise is calibrated to the whole
    # (4, 1e-5) budget, which the merge above has partly spent), alone in its roster
    d = new_site(tmp_path, "hospital-c")
    cli("model", "train", *common[:1], str(d), *common[2:], "--name", "mlp", "--epochs", "5")
    write_roster(d / "roster.toml", [("hospital-c", "127.0.0.1:1", "identity/site.crt")])
    docs = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text(encoding="utf-8")
    round_file = documented_iterate(docs).replace('records = "records.csv"', f'records = "{records}"')
    (d / "iterate.toml").write_text(round_file.replace("rounds = 20", "rounds = 3"), encoding="utf-8")
    proc = cli("round", "--config", str(d / "site.toml"), "--round", str(d / "iterate.toml"), check=False)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(cli("ledger", "show", "--db", str(d / "ledger.sqlite"), "--json", "--no-pld").stdout)
    segments = [e for e in shown["entries"] if e["mechanism"] == "dpsgd"]
    assert len(segments) == 3 and {e["unit"] for e in segments} == {"record:add-remove"}, proc.stdout
    assert "iterate run iterate: finished (all 3 rounds done)" in proc.stdout, proc.stdout


def test_a_replace_one_site_trains_replace_one_pools(tmp_path):
    """``site new --adjacency replace-one``: the data budget and ``pool train --site``'s default
    unit are replace-one (n = the true count, public there); an explicit --adjacency still wins
    and a pool in the other unit is the operator's choice."""
    d = new_site(tmp_path, "hospital-a", "--adjacency", "replace-one")
    assert 'unit = "record:replace-one"' in (d / "site.toml").read_text()
    records = write_records(tmp_path / "records.csv", 100, 1)
    public = write_records(tmp_path / "public.csv", 60, 2)
    cli("pool", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public),
        "--steps", "3")  # fmt: skip
    record = json.loads((d / "pool" / "dpsgd-a.json").read_text())["metadata"]["record"]
    assert record["unit"] == "record:replace-one" and record["parameters"]["dataset_size_source"] == "count"
