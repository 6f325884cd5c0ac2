"""The simulator's baselines (scenarios.baselines): DP-FedAvg's round against a hand computation,
its noise against the calibration and its ε against the accountant (and dp-accounting), central
pooled training, the report's baselines section and plots, and a simulation with ``[iterate]``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event, rdp

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.budget.dpsgd_noise import FIGURES, noise_multiplier_for, run_epsilon
from peer.dp.accounting import GaussianStep
from peer.dp.training import classifier_loss
from peer.nn.architectures import accuracy, build_model, train_classifier
from scenarios.baselines import (
    central_dpsgd,
    central_pooled,
    dp_fedavg,
    fedavg_round,
    pooled_dpsgd,
    scenario_baselines,
)
from scenarios.schema import parse_scenario

ARCH = {"kind": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2, "activation": "tanh"}


def _parts(sizes=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(scale=3.0, size=(n, 3)).astype(np.float32), rng.integers(0, 2, size=n).astype(np.int64))
        for n in sizes
    ]


# ---------------------------------------------------------------------------------- DP-FedAvg


def test_a_round_is_the_hand_computation():
    """Per-record gradients by a plain autograd loop, clipped to C over all parameters, noise
    σ·C·z from the same seeded streams, divided by n_i, two local steps, then Σ (n_i/N) θ_i."""
    lr, clip, sigma, local_steps = 0.3, 1.5, 0.7, 2
    model = build_model(ARCH, seed=1)
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    parts = _parts()
    tensors = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in parts]

    root = make_randomness(5)
    streams = [root.spawn() for _ in parts]
    step = GaussianStep(learning_rate=lr, clip_norm=clip, noise_multiplier=sigma)
    got = fedavg_round(classifier_loss(model), params0, tensors, [step] * local_steps, streams)

    gen = np.random.default_rng(5)
    kids = [gen.spawn(1)[0] for _ in parts]
    norms = []
    expected = {k: torch.zeros_like(v) for k, v in params0.items()}
    total = sum(len(y) for _, y in parts)
    for (x, y), kid in zip(tensors, kids, strict=True):
        theta = {k: v.clone() for k, v in params0.items()}
        for _ in range(local_steps):
            summed = {k: torch.zeros_like(v) for k, v in theta.items()}
            for i in range(len(y)):
                p = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
                logits = torch.func.functional_call(model, p, (x[i : i + 1],))
                g = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y[i : i + 1]), list(p.values()))
                norm = math.sqrt(sum(float((gi.double() ** 2).sum()) for gi in g))
                norms.append(norm)
                factor = min(1.0, clip / norm)
                for k, gi in zip(p, g, strict=True):
                    summed[k] += factor * gi
            noise = {k: torch.from_numpy(kid.standard_normal(tuple(v.shape))).float() for k, v in theta.items()}
            theta = {k: theta[k] - lr * (summed[k] + sigma * clip * noise[k]) / len(y) for k in theta}
        for k in expected:
            expected[k] += (len(y) / total) * theta[k]
    # the clip was active for some records and not for others: both branches are checked
    assert min(norms) < clip < max(norms)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)


def test_noise_is_the_calibration_and_epsilon_is_the_accountants():
    parts = _parts((20, 30))
    x_test, y_test = _parts((25,), seed=1)[0]
    runs = {
        f: dp_fedavg(
            ARCH,
            parts,
            x_test,
            y_test,
            rounds=3,
            local_steps=2,
            learning_rate=0.5,
            clip_norm=1.0,
            epsilon=2.0,
            delta=1e-5,
            init_seed=3,
            seeds=(0, 1),
            figure=f,
        )
        for f in ("rdp", "filter")
    }
    for figure, run in runs.items():
        sigma = run["noise_multiplier"]
        assert sigma == noise_multiplier_for(2.0, 1e-5, 6, figure=figure)
        assert run["steps_per_site"] == 6
        for f in FIGURES:
            assert run["epsilon_spent"][f] == run_epsilon(sigma, 6, 1e-5, figure=f)
        # the calibrated figure meets the target (σ is rounded up: at most ε, by less than 1e-4)
        assert 2.0 - 1e-4 < run["epsilon_spent"][figure] <= 2.0
        # after round r a site has spent r·local_steps steps' worth; the last round is the total
        eps = [p["epsilon_filter"] for p in run["per_round"]]
        assert eps == sorted(eps) and eps[-1] == run["epsilon_spent"]["filter"]
        assert run["per_round"][0]["epsilon_pld"] == run_epsilon(sigma, 2, 1e-5, figure="pld")
        # the RDP figure is dp-accounting's own RdpAccountant on the same Gaussian steps
        acc = rdp.RdpAccountant()
        acc.compose(dp_event.GaussianDpEvent(sigma), 6)
        assert run["epsilon_spent"]["rdp"] == pytest.approx(acc.get_epsilon(1e-5), abs=1e-6)
        # every site's model is the server's: one accuracy for all, per seed and per round
        assert set(run["final_accuracy_per_seed"]) == {"0", "1"}
        assert len(run["per_round"]) == 3
        n_params = 3 * 4 + 4 + 4 * 2 + 2
        assert run["bytes_per_site"] == {
            "per_round": 2 * 4 * n_params,
            "total": 3 * 2 * 4 * n_params,
            "rule": run["bytes_per_site"]["rule"],
        }
        assert run["randomness"].startswith("fixed-seed")
    # the ledger's filter is looser than RDP at the same target: more noise for the same ε
    assert runs["filter"]["noise_multiplier"] > runs["rdp"]["noise_multiplier"]
    assert runs["rdp"]["epsilon_spent"]["filter"] > 2.0 >= runs["filter"]["epsilon_spent"]["filter"]


def test_a_seed_fixes_the_run_and_different_seeds_differ():
    parts = _parts((20, 30))
    x_test, y_test = _parts((200,), seed=1)[0]
    kw = dict(rounds=2, local_steps=1, learning_rate=1.0, clip_norm=1.0, epsilon=1.0, delta=1e-5, init_seed=3)
    a = dp_fedavg(ARCH, parts, x_test, y_test, seeds=(4,), **kw)
    b = dp_fedavg(ARCH, parts, x_test, y_test, seeds=(4,), **kw)
    assert a["per_round"] == b["per_round"]
    c = dp_fedavg(ARCH, parts, x_test, y_test, seeds=(4, 5), **kw)
    per_seed = list(c["final_accuracy_per_seed"].values())
    assert per_seed[0] == a["final_accuracy_mean"]
    assert c["final_accuracy_std"] == pytest.approx(float(np.std(per_seed, ddof=1)))
    # the seed reaches the noise: the same round from two seeds' streams gives other models
    model = build_model(ARCH, seed=3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    tensors = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in parts]
    step = [GaussianStep(learning_rate=1.0, clip_norm=1.0, noise_multiplier=1.0)]
    rounds = []
    for seed in (4, 5):
        root = make_randomness(seed)
        rounds.append(fedavg_round(classifier_loss(model), params, tensors, step, [root.spawn() for _ in parts]))
    assert all(not torch.equal(rounds[0][k], rounds[1][k]) for k in params)


# ---------------------------------------------------------------------------------- central pooled


TINY = """
[scenario]
name = "tiny"
seed = 3

[data]
dataset = "breast_cancer"
public_size = 40
probe_size = 20
split = "dirichlet"
concentration = 1.0
min_per_site = 20

[model]
hidden = [8]
epochs = 20

[round]
methods = ["ldp"]
frontier = []
activation_epsilon = 50.0
weight_epsilon = 50.0
weights_epsilon = 100.0
call_timeout_s = 30.0

[iterate]
rounds = 3
local_steps = 2
learning_rate = 0.5
declared_records = 60
baseline_seeds = [0, 1]

[sites.site-a]
[sites.site-b]
[sites.site-c]
"""


# ------------------------------------------------------------------------------ central DP-SGD


def test_a_curator_step_is_the_hand_computation():
    """One Poisson step on the pooled records: noise z first, then the mask (one uniform per
    pooled record, in site order) from the same seeded stream; every sampled record's gradient
    clipped to C; the sum plus σ·C·z divided by q·N with N declared (not the true count)."""
    lr, clip, sigma, q, declared = 0.4, 0.8, 0.9, 0.5, 10
    model = build_model(ARCH, seed=2)
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    parts = [(torch.as_tensor(x), torch.as_tensor(y)) for x, y in _parts((4, 6), seed=1)]
    step = GaussianStep(learning_rate=lr, clip_norm=clip, noise_multiplier=sigma, sample_rate=q)
    got = pooled_dpsgd(classifier_loss(model), params0, parts, [step], make_randomness(9), declared)

    gen = np.random.default_rng(9)
    noise = {k: torch.from_numpy(gen.standard_normal(tuple(v.shape))).float() for k, v in params0.items()}
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    sampled = gen.random(len(y)) < q
    assert 0 < sampled.sum() < len(y)  # a real subsample: neither empty nor everything
    summed = {k: torch.zeros_like(v) for k, v in params0.items()}
    for i in np.flatnonzero(sampled):
        p = {k: v.clone().requires_grad_(True) for k, v in params0.items()}
        logits = torch.func.functional_call(model, p, (x[i : i + 1],))
        g = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y[i : i + 1]), list(p.values()))
        norm = math.sqrt(sum(float((gi.double() ** 2).sum()) for gi in g))
        for k, gi in zip(p, g, strict=True):
            summed[k] += min(1.0, clip / norm) * gi
    for k, v in params0.items():
        expected = v - lr * (summed[k] + sigma * clip * noise[k]) / (q * declared)
        torch.testing.assert_close(got[k], expected, rtol=1e-5, atol=1e-6)


def test_central_dpsgd_noise_is_the_poisson_calibration_by_dp_accounting():
    """σ is the RDP calibration of T Poisson-subsampled Gaussian steps: dp-accounting's RDP
    accountant on the same events gives the target ε; a noise variance factor k/(k − t) (secure
    aggregation's sum) multiplies the added σ by its square root and lowers the ε spent."""
    parts = _parts((20, 30))
    x_test, y_test = parts[0]
    kw = dict(steps=50, sample_rate=0.2, learning_rate=0.5, clip_norm=1.0, epsilon=2.0, delta=1e-5, dataset_size=50)
    got = central_dpsgd(ARCH, parts, x_test, y_test, seeds=(0, 1), **kw)
    sigma = got["noise_multiplier"]
    assert sigma == noise_multiplier_for(2.0, 1e-5, 50, sample_rate=0.2, figure="rdp")
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.2, dp_event.GaussianDpEvent(sigma)), 50)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=1e-4)
    assert got["epsilon_spent"]["rdp"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    assert got["epsilon_spent"]["pld"] < got["epsilon_spent"]["rdp"] < got["epsilon_spent"]["filter"]
    assert got["bytes_per_site"]["site-0"] == 20 * 3 * 4 + 20 * 8
    shared = central_dpsgd(ARCH, parts, x_test, y_test, seeds=(0,), noise_variance_factor=4 / 3, **kw)
    assert shared["noise_multiplier"] == pytest.approx(sigma * math.sqrt(4 / 3), rel=1e-12)
    assert shared["epsilon_spent"]["rdp"] < 2.0
    with pytest.raises(InvalidArgument, match="noise_variance_factor"):
        central_dpsgd(ARCH, parts, x_test, y_test, noise_variance_factor=0.5, **kw)


def test_central_pooled_is_plain_training_on_the_pooled_records():
    from scenarios.simulate import split_data

    sc = parse_scenario(TINY, "tiny.toml")
    data = split_data(sc)
    m = sc.model
    hp = dict(epochs=m.epochs, batch_size=m.batch_size, learning_rate=m.learning_rate)
    got = central_pooled(data.architecture, data.parts, data.x_test, data.y_test, seeds=(7,), **hp)
    x = np.concatenate([p[0] for p in data.parts])
    y = np.concatenate([p[1] for p in data.parts])
    model = train_classifier(data.architecture, x, y, seed=7, **hp)
    assert got["accuracy_per_seed"] == {"7": accuracy(data.architecture, model, data.x_test, data.y_test)}
    assert got["records"] == sum(len(p[1]) for p in data.parts)
    # Pooled training sees every site's records. With a fixed seed the run is deterministic (no
    # sampling error to allow for); on this split it beats the best site's own model by 2 points
    # (0.986 against 0.965, 0.958, 0.958 on 143 test examples when written).
    own = [
        accuracy(data.architecture, train_classifier(data.architecture, xi, yi, seed=7, **hp), data.x_test, data.y_test)
        for xi, yi in data.parts
    ]
    assert got["accuracy_mean"] >= max(own)


def test_scenario_baselines_without_iterate_is_central_pooled_only():
    from scenarios.simulate import split_data

    text = TINY[: TINY.index("[iterate]")] + TINY[TINY.index("[sites.site-a]") :]
    sc = parse_scenario(text, "tiny.toml")
    data = split_data(sc)
    out = scenario_baselines(sc, data.architecture, data.parts, data.x_test, data.y_test)
    assert set(out) == {"central_pooled"} and out["central_pooled"]["seeds"] == [3500]


# ---------------------------------------------------------------------------------- report


def _report(with_iterate: bool) -> dict:
    """The parts of a simulation report the baselines section reads, with real baselines."""
    from scenarios.simulate import split_data

    sc = parse_scenario(TINY, "tiny.toml")
    data = split_data(sc)
    baselines = scenario_baselines(sc, data.architecture, data.parts, data.x_test, data.y_test)
    sites = {}
    for i, s in enumerate(sc.sites):
        sites[s.name] = {
            "records": len(data.parts[i][1]),
            "own_accuracy": 0.80 + 0.01 * i,
            "oracle": {"accuracy": 0.90},
            "rounds": {"ldp": {"accuracy": 0.85 + 0.01 * i}},
        }
        if with_iterate:
            sites[s.name]["iterate"] = {
                "rounds": [
                    {
                        "round": r,
                        "accuracy": 0.8 + 0.05 * r,
                        "epsilon_filter": 1.3 * r,
                        "epsilon_pld": 1.1 * r,
                        "bytes_sent": 1000,
                        "bytes_received": 3000,
                        "contributors": [o.name for o in sc.sites if o.name != s.name],
                    }
                    for r in (1, 2, 3)
                ],
                "final_accuracy": 0.95,
                "epsilon_filter": 3.9,
                "epsilon_pld": 3.3,
            }
    return {
        "plan": [{"label": "ldp", "method": "ldp", "scale": 1.0}],
        "sites": sites,
        "ledgers": {n: {"budgets": []} for n in sites},
        "baselines": baselines,
    }


@pytest.mark.parametrize("with_iterate", [False, True])
def test_the_comparison_and_plots(tmp_path, with_iterate):
    pytest.importorskip("matplotlib")
    from scenarios.report import baselines_markdown, comparison_rows, comparison_table, plot_baselines

    report = _report(with_iterate)
    rows = {r["method"].split(" (")[0].split(",")[0]: r for r in comparison_rows(report)}
    assert ("multi-round peer-to-peer" in rows) is with_iterate
    fa = report["baselines"]["dp_fedavg"]["calibrations"]
    by_method = {r["method"]: r for r in comparison_rows(report)}
    for figure, run in fa.items():
        r = by_method[f"DP-FedAvg, σ by {figure} (σ={run['noise_multiplier']:.3g})"]
        assert r["accuracy"] == pytest.approx(run["final_accuracy_mean"])
        assert r["epsilon_filter"] == run["epsilon_spent"]["filter"] and r["rounds"] == 3
        assert r["bytes_per_site"] == run["bytes_per_site"]["total"]
    assert rows["own model"]["accuracy"] == pytest.approx(0.81)
    if with_iterate:
        p2p = rows["multi-round peer-to-peer"]
        assert p2p["accuracy"] == pytest.approx(0.95) and p2p["epsilon_filter"] == 3.9 and p2p["rounds"] == 3
        assert p2p["bytes_per_site"] == 3 * 4000
    table = comparison_table(report)
    assert "central pooled (non-private)" in table and "DP-FedAvg, σ by rdp" in table
    cd = report["baselines"]["central_dpsgd"]
    curator = by_method[f"central DP-SGD, trusted curator (σ={cd['noise_multiplier']:.3g})"]
    assert curator["accuracy"] == pytest.approx(cd["accuracy_mean"]) and curator["wall_s_per_site"] > 0
    # each site uploads its records once: 30 float32 features and an int64 label per record
    uploads = [s["records"] * (30 * 4 + 8) for s in report["sites"].values()]
    assert curator["bytes_per_site"] == pytest.approx(np.mean(uploads))
    plot_baselines(report, tmp_path / "baselines.png")
    assert (tmp_path / "baselines.png").stat().st_size > 10_000
    report["plots"] = ["baselines.png"]
    md = "\n".join(baselines_markdown(report))
    assert "## Baselines and comparison" in md and "![baselines](baselines.png)" in md
    assert ("| site | P2P rounds |" in md) is with_iterate


def test_no_baselines_no_section():
    from scenarios.report import baselines_markdown

    assert baselines_markdown({"sites": {}}) == []


# ---------------------------------------------------------------------------------- simulation


def test_the_command_prints_the_baselines_as_json(tmp_path, capsys):
    from peer.cli import main

    f = tmp_path / "tiny.toml"
    f.write_text(TINY)
    assert main(["simulate", str(f), "--baselines-only", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"dp_fedavg", "central_dpsgd", "central_pooled"}
    # no [central_dpsgd] table: the [iterate] plan on the pooled records, N = 3 sites × 60 declared
    cd = out["central_dpsgd"]
    assert (cd["steps"], cd["sample_rate"], cd["learning_rate"], cd["dataset_size"]) == (6, 1.0, 0.5, 180)
    assert cd["epsilon_spent"]["rdp"] <= 4.0
    assert out["dp_fedavg"]["calibrations"]["rdp"]["epsilon_spent"]["rdp"] <= 4.0
    assert main(["simulate", str(f), "--json", "--out", str(tmp_path / "o")]) == 2
    assert main(["simulate", str(f)]) == 2
    assert "--out" in capsys.readouterr().err


def test_the_central_dpsgd_table():
    """``[central_dpsgd]`` overrides the [iterate] plan key by key; it needs [iterate]; a bad
    value names the key."""
    from peer.base.config import ConfigError

    sc = parse_scenario(
        TINY.replace("[sites.site-a]", "[central_dpsgd]\nsteps = 30\nsample_rate = 0.1\n\n[sites.site-a]")
    )
    c = sc.central_dpsgd
    assert (c.steps, c.sample_rate, c.learning_rate, c.clip_norm) == (30, 0.1, 0.5, 1.0)
    no_iterate = TINY[: TINY.index("[iterate]")] + "[central_dpsgd]\nsteps = 3\n" + TINY[TINY.index("[sites.site-a]") :]
    with pytest.raises(ConfigError, match="central_dpsgd"):
        parse_scenario(no_iterate)
    with pytest.raises(ConfigError, match="sample_rate"):
        parse_scenario(TINY.replace("[sites.site-a]", "[central_dpsgd]\nsample_rate = 1.5\n\n[sites.site-a]"))
