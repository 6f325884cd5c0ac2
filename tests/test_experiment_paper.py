"""``privfusion experiment paper``: the smallest configuration runs end to end and writes its
files; every private row charges exactly what the ledger's own conversion of its records says."""

import contextlib
import io
import json

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy
from peer.cli import main
from peer.experiments.field_study import REGION_FEATURE, FieldConfig, site_parts
from peer.experiments.private_rows import ABLATION, COUNTERPARTY, PARTS, SUBJECT, UNITS

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The smallest configuration, run once through the command line (about 20 s of CPU)."""
    out = tmp_path_factory.mktemp("paper")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["experiment", "paper", "--quick", "--json", "--out", str(out)]) == 0
    return json.loads(buf.getvalue()), out


def _rows(result):
    digits = [r for table in ("fig3", "table2", "table3") for r in result[table]["rows"]]
    return digits + [r for s in result["table4"]["settings"].values() for r in s["rows"]]


def test_quick_run_writes_its_files(quick):
    result, out = quick
    for name in ("paper.json", "paper.md", "fig3.png", "table2.png", "table3.png", "fig5.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000, name
        if name.endswith(".png"):
            assert data[:8] == PNG
    assert json.loads((out / "paper.json").read_text()) == result
    md = (out / "paper.md").read_text()
    for claim in [*result["claims"].values(), result["table4"]["claim"]]:
        assert claim in md
    assert result["config"]["seeds"] == [0]
    # every table holds every unit, and Table III every mechanism row
    for table in ("fig3", "table2", "table3"):
        assert {s["unit"] for s in result[table]["summary"]} == set(UNITS)
    assert {s["name"] for s in result["table3"]["summary"]} == set(ABLATION)
    assert len(result["table2"]["summary"]) == 2 * len(result["config"]["grid"]) ** 3


def test_every_row_charges_what_the_ledger_converts_its_records_to(quick, tmp_path):
    result, _ = quick
    policy = Policy.from_mapping(
        {"peers": {"*": {"allow": ["features", "weights"]}}, "model": {"total": {"epsilon": 1e12, "delta": 0.5}}}
    )
    ledger = Ledger(tmp_path / "l.db", policy)
    try:
        for row in _rows(result):
            total_eps, total_delta = 0.0, 0.0
            for part in ("features", "weights"):
                record = ReleaseRecord.from_dict(row["records"][part])
                assert record.unit == row["unit"] and record.subject == SUBJECT
                assert record.epsilon == row["record_epsilon"][part]
                it = ledger.interpret(record, COUNTERPARTY)
                assert it.charged.unit == "neuron"
                assert row["charged"][part]["epsilon"] == pytest.approx(it.charged.epsilon, rel=1e-12)
                assert row["charged"][part]["delta"] == pytest.approx(it.charged.delta, rel=1e-12, abs=1e-300)
                if row["unit"] == "neuron":
                    # a per-neuron record is charged as it stands
                    assert it.charged == record
                else:
                    # a per-entry record costs more per neuron, never less
                    assert it.charged.epsilon > record.epsilon
                total_eps += it.charged.epsilon
                total_delta += it.charged.delta
            assert row["charged"]["total"]["epsilon"] == pytest.approx(total_eps, rel=1e-12)
            assert row["charged"]["total"]["delta"] == pytest.approx(total_delta, rel=1e-12, abs=1e-300)
            # the record states the ε the row was run at, per part
            feats = ReleaseRecord.from_dict(row["records"]["features"])
            if row["unit"] == "entry":
                assert feats.epsilon == max(row["epsilon"]["activations"], row["epsilon"]["weight_features"])
            else:
                assert feats.epsilon == pytest.approx(row["epsilon"]["activations"] + row["epsilon"]["weight_features"])
            assert ReleaseRecord.from_dict(row["records"]["weights"]).epsilon == row["epsilon"]["weights"]
        # charging one row for real stores exactly the converted figure
        row = _rows(result)[0]
        for part in ("features", "weights"):
            entry = ledger.charge(ReleaseRecord.from_dict(row["records"][part]), COUNTERPARTY)
            assert entry.unit == "neuron" and entry.epsilon == pytest.approx(row["charged"][part]["epsilon"], rel=1e-12)
    finally:
        ledger.close()


def test_rows_are_consistent_with_their_summaries_and_verdicts(quick):
    result, _ = quick
    chance = result["chance_count"]
    for row in _rows(result):
        assert set(row["epsilon"]) == set(PARTS)
        assert row["above_chance"] == (round(row["permutation_agreement"] * result["neurons"]) > chance)
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["accuracy_repair"] <= 1
    for table in ("fig3", "table2", "table3"):
        for s in result[table]["summary"]:
            rows = [r for r in result[table]["rows"] if r["name"] == s["name"] and r["unit"] == s["unit"]]
            assert s["accuracy"]["mean"] == pytest.approx(np.mean([r["accuracy"] for r in rows]))
    v = result["verdicts"]
    assert v["of"] == 4
    for unit in UNITS:
        assert v["count"][unit] == sum(v[t][unit]["reproduced"] for t in ("fig3", "table2", "table3", "table4"))
    # Table IV: a verdict needs the fused macro F1 above the own model's and an above-chance match
    for unit in UNITS:
        held = []
        for setting in ("underfit", "unbalanced", "regions"):
            sm = result["table4"]["settings"][setting]["summary"]
            fused = sm[f"privfusion_per_{unit}"]
            if fused["macro_f1"]["mean"] > sm["model_a"]["macro_f1"]["mean"] and fused["above_chance"]:
                held.append(setting)
        assert result["table4"]["verdicts"][unit]["held_in"] == held
    # the noise seeds are reported and distinct across rows
    seeds = [r["noise_seed"] for r in _rows(result)]
    assert len(set(seeds)) == len(seeds)


def test_seeds_option_is_checked(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["experiment", "paper", "--quick", "--seeds", "0,0", "--out", str(tmp_path)])
    assert "--seeds must be distinct" in capsys.readouterr().err


def test_table4_settings_shape_the_sites_records():
    x = np.random.default_rng(0).normal(size=(200, 30)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 2, size=200)
    cfg = FieldConfig()
    iid = site_parts(cfg, "iid", x, y, seed=0)
    assert sorted(np.concatenate(iid).tolist()) == list(range(200))
    # unbalanced: A keeps 20% of its class 0, B 30% of its class 1; the other class untouched
    a, b = site_parts(cfg, "unbalanced", x, y, seed=0)
    assert set(a) <= set(iid[0]) and set(b) <= set(iid[1])
    for part, kept, cls, frac in ((a, iid[0], 0, 0.8), (b, iid[1], 1, 0.7)):
        before = int(np.sum(y[kept] == cls))
        assert int(np.sum(y[part] == cls)) == before - round(frac * before)
        assert int(np.sum(y[part] == 1 - cls)) == int(np.sum(y[kept] == 1 - cls))
    # regions: every record of A lies below every record of B on the region covariate
    a, b = site_parts(cfg, "regions", x, y, seed=0)
    col = list(load_breast_cancer().feature_names).index(REGION_FEATURE)
    assert len(a) == len(b) == 100 and x[a, col].max() <= x[b, col].min()
    with pytest.raises(InvalidArgument):
        site_parts(cfg, "by-hospital", x, y, seed=0)
