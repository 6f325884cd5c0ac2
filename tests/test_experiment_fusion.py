"""The fusion experiment (Table I): structure and invariants on a small network, and the issue's
claims on the real configuration (slow)."""

import json

import pytest

from peer.cli import main
from peer.cli.experiment_fusion import format_fusion_table
from peer.experiments.fusion import FusionConfig, run

SMALL = FusionConfig(
    architecture={"kind": "mlp", "input_dim": 64, "hidden": [24, 16], "output_dim": 10},
    epochs=4,
    probe_size=32,
    epsilons=(1.0, 0.1),
    alphas=(0.0, 0.5, 1.0),
)
ONE_TEST_EXAMPLE = 1 / 450  # digits' test split: a prediction flipped by rounding moves accuracy by this


@pytest.fixture(scope="module")
def small():
    return run(SMALL)


def test_json_has_the_issue_layout(small):
    for split in ("homogeneous", "heterogeneous"):
        r = small[split]
        assert set(r["methods"]) == {
            "model_a",
            "model_b",
            "vanilla_averaging",
            "prediction_ensemble",
            "weight_matching",
            "graph_matching",
            "graph_matching_repair",
            "activation_matching",
            "activation_matching_repair",
        }
        assert set(r["privfusion"]) == set(r["privfusion_per_neuron"]) == {"1", "0.1"}
        assert set(r["privfusion_repair"]) == set(r["privfusion_per_neuron_repair"]) == {"1", "0.1"}
        for name, sweep in r["alpha_sweep"].items():
            assert [a for a, _ in sweep] == [0.0, 0.5, 1.0], name
            assert all(0.0 <= acc <= 1.0 for _, acc in sweep)
    json.dumps(small, allow_nan=False)
    assert "PrivFusion per-neuron ε=0.1" in format_fusion_table(small)
    assert "PrivFusion per-neuron ε=0.1 + REPAIR" in format_fusion_table(small)


def test_alpha_end_points_are_the_two_models(small):
    # α = 1 is model A itself for every method; α = 0 is model B (aligned or not: a permuted
    # network computes the same function) for every method that does not perturb B.
    for split in ("homogeneous", "heterogeneous"):
        r = small[split]
        for name, sweep in r["alpha_sweep"].items():
            assert dict(sweep)[1.0] == pytest.approx(r["methods"]["model_a"], abs=ONE_TEST_EXAMPLE), name
        for name in (
            "vanilla_averaging",
            "prediction_ensemble",
            "weight_matching",
            "graph_matching",
            "graph_matching_repair",
            "activation_matching",
            "activation_matching_repair",
        ):
            assert dict(r["alpha_sweep"][name])[0.0] == pytest.approx(r["methods"]["model_b"], abs=ONE_TEST_EXAMPLE), (
                name
            )


def test_non_private_matching_recovers_a_permuted_copy(small):
    rec = small["permutation_recovery"]
    for name in ("graph_matching", "activation_matching"):
        assert rec[name]["fraction_correct"] == 1.0, name
        assert rec[name]["fused_accuracy"] == pytest.approx(rec["original_accuracy"], abs=ONE_TEST_EXAMPLE), name


@pytest.mark.slow
def test_the_real_table(capsys):
    assert main(["experiment", "fusion", "--dataset", "digits", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for split in ("homogeneous", "heterogeneous"):
        m = out[split]["methods"]
        # graph-matching fusion clearly beats vanilla averaging (by ~15 points measured)
        assert m["graph_matching"] > m["vanilla_averaging"] + 0.08
        # REPAIR on A's own records: measured 95.3% -> 95.8% on both splits (endpoints 95.8/96.4
        # homogeneous, 94.4/94.9 heterogeneous): at least the worse endpoint
        assert m["graph_matching_repair"] >= min(m["model_a"], m["model_b"])
    rec = out["permutation_recovery"]
    assert rec["graph_matching"]["fraction_correct"] == 1.0
    assert rec["privfusion_entry_eps1"]["fraction_correct"] > 0.5  # mostly right at ε = 1 per entry


@pytest.mark.slow
def test_resnet_rows():
    """The residual CNN with BatchNorm: traced, group-matched, fused over its whole state and
    repaired by resetting its BatchNorms (a short training keeps this test small)."""
    from peer.cli.experiment_fusion import format_fusion_table

    out = run(FusionConfig(model="resnet", epochs=3, probe_size=32, alphas=(0.0, 0.5, 1.0), epsilons=(1.0,)))
    # how much better activation matching aligns than spatial means plus weight terms, after
    # REPAIR, per split: measured +0.08 to +0.39 over 4 (seed, kernels) runs here (seeds 0-1;
    # ATEN_CPU_CAPABILITY avx512 / avx2 / default), +0.011 on one split of another machine, so
    # the claim is on the mean of the two splits (measured +0.16 to +0.36), not on each
    # (docs/experiments.md, "Reproducibility across machines")
    advantage = []
    for split in ("homogeneous", "heterogeneous"):
        m = out[split]["methods"]
        assert set(m) == {
            "model_a",
            "model_b",
            "vanilla_averaging",
            "vanilla_averaging_repair",
            "prediction_ensemble",
            "group_matching",
            "group_matching_repair",
            "activation_matching",
            "activation_matching_repair",
        }
        assert out[split]["privfusion"] == {}  # per-entry is not offered over groups
        assert set(out[split]["privfusion_per_neuron"]) == set(out[split]["privfusion_per_neuron_repair"]) == {"1"}
        for name in ("group_matching", "group_matching_repair", "activation_matching", "activation_matching_repair"):
            sweep = dict(out[split]["alpha_sweep"][name])
            assert sweep[1.0] == pytest.approx(m["model_a"], abs=ONE_TEST_EXAMPLE)
            assert sweep[0.0] == pytest.approx(m["model_b"], abs=ONE_TEST_EXAMPLE)
        # resetting the BatchNorms of the fused network pays (measured: 10% -> ~50% after 2 epochs)
        assert m["group_matching_repair"] > m["group_matching"] + 0.05
        # correlating every position where the units are read aligns the two ResNets better
        # than spatial means plus max-scaled weight terms (measured after REPAIR, homogeneous /
        # heterogeneous: 83.8 vs 62.9, 70.0 vs 53.8 here; 88.9 vs 53.1, 85.8 vs 72.4 at 40 epochs)
        advantage.append(m["activation_matching_repair"] - m["group_matching_repair"])
    assert sum(advantage) / len(advantage) > 0.05, advantage
    rec = out["permutation_recovery"]
    for name in ("group_matching", "activation_matching"):
        assert rec[name]["fraction_correct"] == 1.0, name
        assert rec[name]["fused_accuracy"] == pytest.approx(rec["original_accuracy"], abs=ONE_TEST_EXAMPLE), name
    assert "group_matching_repair" in format_fusion_table(out)
    assert "activation_matching_repair" in format_fusion_table(out)


def test_channels_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "fusion", "--model", "cnn", "--channels", "64"])
    assert "--channels must be two positive integers C1,C2" in capsys.readouterr().err


def test_channels_widen_the_cnn():
    from peer.experiments.fusion import _architecture

    assert _architecture(FusionConfig(model="cnn", channels=(64, 128)))["channels"] == [64, 128]
    assert _architecture(FusionConfig(model="cnn"))["channels"] == [16, 32]


def test_recipes_resolve_per_model_and_bad_ones_are_refused():
    from peer.base.errors import InvalidArgument
    from peer.experiments.fusion import resolved_recipe

    assert resolved_recipe(FusionConfig(model="cnn")) == ("sgd", 80)
    assert resolved_recipe(FusionConfig(model="mlp")) == ("adam", 40)
    assert resolved_recipe(FusionConfig(model="resnet")) == ("adam", 40)
    assert resolved_recipe(FusionConfig(model="cnn", recipe="adam", epochs=7)) == ("adam", 7)
    with pytest.raises(InvalidArgument, match="recipe"):
        resolved_recipe(FusionConfig(model="cnn", recipe="lbfgs"))
    with pytest.raises(InvalidArgument, match="resnet trains with adam only"):
        resolved_recipe(FusionConfig(model="resnet", recipe="sgd"))
    with pytest.raises(InvalidArgument, match="epochs"):
        run(FusionConfig(model="cnn", epochs=0))


def test_sgd_recipe_is_deterministic_and_learns():
    """The CNN's endpoint recipe on 600 of digits' training records: the same seed gives the same
    weights, and 20 epochs classify far above chance (10%): measured 92.9% / 95.1% on the 450 test
    images (seeds 3 / 4), so the bound 80% fails only if training is broken."""
    from peer.experiments.fusion import ARCHITECTURES, train_endpoint
    from peer.nn.architectures import accuracy, state_arrays
    from peer.nn.data import load_dataset

    arch = ARCHITECTURES["cnn"]
    ds = load_dataset("digits", seed=0)
    x, y = ds.x_train[:600], ds.y_train[:600]
    short = FusionConfig(model="cnn", epochs=2)
    s1, s2 = (state_arrays(train_endpoint(short, arch, x, y, seed=3)) for _ in range(2))
    assert all((s1[k] == s2[k]).all() for k in s1)
    model = train_endpoint(FusionConfig(model="cnn", epochs=20), arch, x, y, seed=3)
    assert accuracy(arch, model, ds.x_test, ds.y_test) > 0.8


@pytest.mark.slow
def test_the_cnn_rows():
    """The 16-32 CNN with its default recipe (SGD, cosine, weight decay, label smoothing, 80
    epochs), without the PrivFusion rows: REPAIR pays after activation matching, and aligned +
    REPAIRed fusions stay near the better endpoint.

    Every bound is the worst case measured over seeds and machines, less about three standard
    errors of the statistic on digits' 450 test images (docs/experiments.md, "Reproducibility
    across machines"). Measured on 7 (seed, kernels) runs — seeds 0-2; ATEN_CPU_CAPABILITY
    avx512 / avx2 / default with MKL and oneDNN capped alike; 1 and 2 threads — so 14 splits:
    - the worse endpoint 0.942-0.982 (bound 0.91: one accuracy's standard error is 0.010);
    - graph matching + REPAIR minus the better endpoint: -0.024 to -0.004 (bound -0.05: a
      paired difference's standard error is about 0.008);
    - activation matching + REPAIR minus the better endpoint: -0.036 to +0.007 (bound -0.06);
    - agreement of the two matchers 0.28-0.46 (bound 0.2);
    - REPAIR's gain after activation matching: +0.004 to +0.042 per split, positive on all 14,
      and +0.016 to +0.032 averaged over the two splits of a run (bound > 0 on that average: the
      worst run is about 2.5 standard errors of a mean paired difference above it). The former "+2
      points on each split" failed on another machine (+1.3) and on 3 of these 14 splits: the
      gain is real, its size is not portable."""
    from peer.experiments.fusion import ARCHITECTURES, resolved_graph_features, resolved_recipe, run_split

    cfg = FusionConfig(model="cnn", epsilons=(), alphas=(0.0, 0.5, 1.0))
    assert resolved_recipe(cfg) == ("sgd", 80)
    assert resolved_graph_features(cfg, ARCHITECTURES["cnn"]) == "exact"
    gains = []
    for split in ("homogeneous", "heterogeneous"):  # the splits only: not the permutation-recovery part
        result = run_split(cfg, split)
        m = result.methods
        better = max(m["model_a"], m["model_b"])
        assert min(m["model_a"], m["model_b"]) > 0.91, m  # the recipe's endpoints (Adam's: 94.0-96.4)
        assert m["graph_matching_repair"] >= better - 0.05, m
        assert m["activation_matching_repair"] >= better - 0.06, m
        assert result.permutation_agreement["activation_matching"] > 0.2, result.permutation_agreement
        gains.append(m["activation_matching_repair"] - m["activation_matching"])
    assert sum(gains) / len(gains) > 0, gains  # REPAIR pays after activation matching


def test_graph_features_resolve_per_model_and_bad_ones_are_refused():
    from peer.base.errors import InvalidArgument
    from peer.experiments.fusion import ARCHITECTURES, resolved_graph_features

    assert resolved_graph_features(FusionConfig(model="cnn"), ARCHITECTURES["cnn"]) == "exact"
    assert resolved_graph_features(FusionConfig(model="mlp"), ARCHITECTURES["mlp"]) == "released"
    assert resolved_graph_features(FusionConfig(model="mlp", graph_features="exact"), ARCHITECTURES["mlp"]) == "exact"
    with pytest.raises(InvalidArgument, match="graph_features"):
        run(FusionConfig(model="cnn", graph_features="positions"))  # refused before any training


def test_graph_features_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "fusion", "--model", "cnn", "--graph-features", "positions"])
    assert "--graph-features" in capsys.readouterr().err


def test_a_small_cnn_is_graph_matched_on_exact_per_position_rows():
    """A small CNN takes the ``exact`` rows by default (every position, standardised: the
    release's graph, which PrivFusion perturbs, keeps spatial means), and the non-private graph
    matcher on them maps a permuted copy back exactly."""
    from peer.experiments.fusion import permutation_recovery

    cnn = {
        "kind": "cnn",
        "input_shape": [1, 8, 8],
        "channels": [4, 8],
        "kernel_size": 3,
        "pool": [2, 2],
        "hidden": [16],
        "output_dim": 10,
        "activation": "relu",
    }
    rec = permutation_recovery(FusionConfig(architecture=cnn, model="cnn", epochs=2, probe_size=16, epsilons=()))
    assert rec["graph_matching"]["fraction_correct"] == 1.0
    assert rec["graph_matching"]["fused_accuracy"] == pytest.approx(rec["original_accuracy"], abs=ONE_TEST_EXAMPLE)
