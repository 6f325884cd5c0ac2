"""``privfusion experiment paper``: the smallest configuration runs end to end and writes its
files; every private row charges exactly what the ledger's own conversion of its records says."""

import contextlib
import io
import json

import numpy as np
import pytest

from peer.base.records import ReleaseRecord
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy
from peer.cli import main
from peer.experiments.paper import ABLATION, COUNTERPARTY, PARTS, SUBJECT, UNITS

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
    return [r for table in ("fig3", "table2", "table3") for r in result[table]["rows"]]


def test_quick_run_writes_its_files(quick):
    result, out = quick
    for name in ("paper.json", "paper.md", "fig3.png", "table2.png", "table3.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000, name
        if name.endswith(".png"):
            assert data[:8] == PNG
    assert json.loads((out / "paper.json").read_text()) == result
    md = (out / "paper.md").read_text()
    for claim in result["claims"].values():
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
    for unit in UNITS:
        assert v["count"][unit] == sum(v[t][unit]["reproduced"] for t in ("fig3", "table2", "table3"))
    # the noise seeds are reported and distinct across rows
    seeds = [r["noise_seed"] for r in _rows(result)]
    assert len(set(seeds)) == len(seeds)


def test_seeds_option_is_checked(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["experiment", "paper", "--quick", "--seeds", "0,0", "--out", str(tmp_path)])
    assert "--seeds must be distinct" in capsys.readouterr().err
