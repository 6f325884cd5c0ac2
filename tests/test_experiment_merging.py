"""The merging experiment: a reduced run in the default suite, the full one marked slow."""

import json

import numpy as np
import pytest

from peer.cli import main


def _check(result, out_dir, mc_standard_errors):
    a, b = result["mean_estimation"], result["digits"]
    # (a) state-independent gradients: the surrogate is the charged bound, and the paper's findings hold
    assert a["surrogate_valid"] and a["lc_charged"] == "lc_surrogate"
    assert a["findings"]["lc_dominates_rs"] and a["findings"]["pld_no_worse_than_rdp"]
    assert any(r["ratio"] < 0.9 for r in a["findings"]["lc_over_rs_mse"])  # LC strictly better somewhere
    # the surrogate never does worse than the composition, and strictly better somewhere
    ratios = [r["ratio"] for r in a["findings"]["surrogate_over_composition_mse"]]
    assert ratios and all(r <= 1 + 1e-9 for r in ratios) and min(ratios) < 0.9
    for m in a["models"]:
        # the gradient −x_i is never clipped, so the Monte Carlo MSE must match the Gaussian closed form
        assert m["max_gradient_norm"] <= m["clip_norm"]
        assert abs(m["mse"] - m["mse_closed_form"]) < mc_standard_errors * m["mse_standard_error"]
    # (b) networks: LC is charged by composition, the surrogate is flagged
    assert not b["surrogate_valid"] and b["lc_charged"] == "lc_composition"
    for r in b["findings"]["surrogate_releases_proven_cost"]:
        # exact values: proven ≥ surrogate; the two PLD figures are discretised differently (≤ 1e-3)
        assert r["proven_epsilon"] >= r["surrogate_epsilon"] * (1 - 1e-3)
    # every chosen weighting meets its target by the accountant it was chosen for; a utility
    # selection's ε is the composition of the subset it scored, and its weights stay inside it
    for part in (a, b):
        for method in ("rs", "lc_composition", "lc_surrogate", "rs_utility", "lc_utility"):
            for acc in ("pld", "rdp"):
                for r in part["curves"][method][acc]:
                    assert r["epsilon"][acc] <= r["target_epsilon"] * (1 + 1e-9)
                    if method.endswith("_utility"):
                        assert r["scored"] and all(w == 0 or i in r["scored"] for i, w in enumerate(r["weights"]))
        assert part["curves"]["rs_utility"]["pld"] and part["curves"]["lc_utility"]["pld"]
    # (b) PLD certifies every RDP-chosen release at a smaller ε
    for method in ("rs", "lc"):
        sv = b["pld_savings"][method]
        assert sv["releases"] and all(0 < r["saving"] < r["saving_vs_classical"] for r in sv["releases"])
    for kind in ("rs", "lc"):
        rec = b["example_releases"][kind]["record"]
        assert rec["mechanism"] == f"{kind}-merge" and rec["epsilon"] <= b["example_releases"]["target_epsilon"]
    assert b["example_releases"]["lc"]["record"]["parameters"]["bound"] == "composition"
    # the example releases chose their weights from the public prior: no model was scored
    for kind in ("rs", "lc"):
        selection = b["example_releases"][kind]["record"]["parameters"]["selection"]
        assert selection["kind"] == "public-prior" and "scored" not in selection
    for name in ("merging.json", "merging.md", "mean_estimation.png", "digits_frontier.png"):
        data = (out_dir / name).read_bytes()
        assert len(data) > 1000
        if name.endswith(".png"):
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out_dir / "merging.json").read_text()) == result


def test_quick_experiment_end_to_end(tmp_path, capsys):
    assert main(["experiment", "merging", "--quick", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    # 2,000 replicas: 5 standard errors, a false-failure rate below 1e-6 per model
    _check(result, tmp_path, 5)


def test_quick_pretrained_experiment(tmp_path, capsys):
    assert main(["experiment", "merging", "--quick", "--pretrained", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    _check(result, tmp_path, 5)
    b = result["digits"]
    pre = b["pretraining"]
    # the public records are taken out of the protected ones: DP-SGD never sees them
    assert pre["public_records"] + pre["protected_records"] == 1077 and b["sizes"]["protected_train"] == 754
    assert "public" in pre["initialisation"]
    ag = b["findings"]["against_every_input"]
    best = max(m["test_accuracy"] for m in b["models"])
    assert ag["best_input_test_accuracy"] == best and ag["pretrained_test_accuracy"] == pre["test_accuracy"]
    for method in ("rs", "lc_composition", "rs_utility", "lc_utility"):
        rows = ag[method]["rows"]
        assert rows
        for r in rows:
            assert r["beats_every_input"] == (r["test_accuracy"] > best + 1e-12)
            assert r["minus_best_input"] == pytest.approx(r["test_accuracy"] - best)
        if method.startswith("rs"):
            # RS's expected accuracy is a mixture of the inputs': never above the best one
            assert not any(r["beats_every_input"] for r in rows)
    assert "Against every input model" in (tmp_path / "merging.md").read_text()


def test_a_given_initialisation_must_say_what_it_is():
    from peer.base.errors import InvalidArgument
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.training import train_dpsgd_classifier
    from peer.nn.architectures import build_model, state_arrays

    arch = {"kind": "mlp", "input_dim": 4, "hidden": [], "output_dim": 2}
    x, y = np.zeros((8, 4), dtype=np.float32), np.array([0, 1] * 4)
    training = TrainingRecord.constant("replace-one", 2, 0.1, 1.0, 2.0)
    init = state_arrays(build_model(arch, seed=3))
    with pytest.raises(InvalidArgument) as e:
        train_dpsgd_classifier(arch, x, y, training, init_seed=0, randomness=make_randomness(0), delta=1e-5, init=init)
    assert e.value.field == "init_description"
    m = train_dpsgd_classifier(
        arch, x, y, training, init_seed=0, randomness=make_randomness(0), delta=1e-5, init=init, init_description="t"
    )
    assert m.record.parameters["initialisation"] == "t"


@pytest.mark.slow
def test_full_experiment(tmp_path, capsys):
    assert main(["experiment", "merging", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    _check(result, tmp_path, 5)
    sv = result["digits"]["pld_savings"]
    assert sv["rs"]["saving_mean"] > 0.05 and sv["lc"]["saving_mean"] > 0.05
    assert sum(result["seconds"].values()) < 300
