"""The local steps after a round's fusion (``coordinator_free.after_fusion``): REPAIR with the
fusion's weights, candidate selection on public data, fine-tuning on the site's own records —
their configuration (errors name key and line), the math on real models, and a real round
against daemons on loopback whose report records both and whose ledgers show nothing charged."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from peer_harness import running
from test_rounds import ARCH, build, charges_of, config, ledger_entries, roster_for, trained  # noqa: F401

from coordinator_free import after_fusion
from coordinator_free.rounds import RoundConfig, fusion_weights
from coordinator_free.runner import load_local_site, run_round
from peer.base.config import ConfigError, Section, parse_toml
from peer.ldp.fusion import average_arrays
from peer.ldp.repair import combined_statistics, unit_statistics
from peer.nn.architectures import input_tensor, model_from_arrays, state_arrays, train_classifier
from peer.nn.store import load_model
from peer.nn.tracing import derive_structure


def parse(tmp_path, body: str) -> RoundConfig:
    text = '[round]\nroster = "r.toml"\nmodel = "mlp"\n' + body
    return RoundConfig.from_section(
        Section(parse_toml(text, "x.toml", "round"), (), text, "x.toml").section("round"), tmp_path
    )


def test_after_fusion_is_off_by_default(tmp_path):
    c = parse(tmp_path, "")
    assert (c.repair, c.finetune_epochs, c.records, c.select_validation) == ("off", 0, None, None)
    assert not after_fusion.enabled(c)
    c = parse(tmp_path, '[round.records]\npath = "own.npz"\nprepared = true\n[round.repair]\ndata = "own"\n')
    assert c.records == tmp_path / "own.npz" and c.records_prepared and c.repair == "own" and after_fusion.enabled(c)
    assert c.public()["records"] == str(tmp_path / "own.npz")


@pytest.mark.parametrize(
    "body, key, line, fragment",
    [
        ('[round.repair]\ndata = "own"\n', "round.repair.data", 5, "own records"),
        ('[round.repair]\ndata = "magic"\n', "round.repair.data", 5, "must be one of"),
        ('[round.repair]\ndat = "own"\n', "round.repair.dat", 5, "unknown key"),
        ("[round.finetune]\nepochs = 3\n", "round.finetune.epochs", 5, "own records"),
        (
            '[round.records]\npath = "r.npz"\n[round.finetune]\nepochs = -1\n',
            "round.finetune.epochs",
            7,
            "between 0 and",
        ),
        (
            '[round.records]\npath = "r.npz"\n[round.finetune]\nlearning_rate = 0\n',
            "round.finetune.learning_rate",
            7,
            "> 0",
        ),
        ("[round.select]\nalphas = [0.5, 0.7]\n", "round.select.alphas", 5, "validation"),
        ('[round.select]\nvalidation = "v.npz"\nalphas = [1.5]\n', "round.select.alphas[0]", 6, "<= 1"),
        ('[round.records]\npath = "r.npz"\nprepared = "yes"\n', "round.records.prepared", 6, "true or false"),
    ],
)
def test_after_fusion_config_errors_name_key_and_line(tmp_path, body, key, line, fragment):
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, body)
    assert e.value.key == key and e.value.line == line, str(e.value)
    assert fragment in str(e.value)


def test_records_file_errors_name_the_round_key(tmp_path, trained):  # noqa: F811 (the imported fixture)
    arrays, probe, _ = trained
    from peer.base.errors import FailedPrecondition, InvalidArgument
    from peer.nn.store import StoredModel

    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 64), np.float32))
    c = parse(tmp_path, '[round.records]\npath = "bad.npz"\nprepared = true\n[round.repair]\ndata = "own"\n')
    with pytest.raises(InvalidArgument, match=r"round\.records\.path"):
        after_fusion.load_local_data(c, StoredModel("mlp", ARCH, arrays), probe)
    c = parse(tmp_path, '[round.records]\npath = "own.csv"\n[round.repair]\ndata = "own"\n')
    with pytest.raises(FailedPrecondition, match="stores no preprocessing"):
        after_fusion.load_local_data(c, StoredModel("mlp", ARCH, arrays), probe)


@pytest.fixture(scope="module")
def three_models(trained):  # noqa: F811
    """Three digits MLPs trained from different seeds on different records (not permutations of
    one another), the first one's own records, and a public validation split."""
    _, _, ds = trained
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [
            state_arrays(
                train_classifier(
                    ARCH, ds.x_train[i * 300 : (i + 1) * 300], ds.y_train[i * 300 : (i + 1) * 300], seed=i, epochs=15
                )
            )
            for i in range(3)
        ]
    finally:
        torch.set_num_threads(threads)
    own = (ds.x_train[:300], ds.y_train[:300])
    validation = (ds.x_train[900:1100], ds.y_train[900:1100])
    return models, own, validation, ds


def _config(**kw) -> RoundConfig:
    from pathlib import Path

    return RoundConfig(roster=Path("r.toml"), model="mlp", **kw)


def test_repair_sets_the_fusion_weighted_statistics_of_every_endpoint(three_models):
    models, own, _, _ = three_models
    own_arrays, b, c = models
    weights = fusion_weights(0.5, 2)
    fused = average_arrays([own_arrays, b, c], weights)
    data = after_fusion.LocalData(own, "own.npz", own[0][:50])
    after = after_fusion.after_fusion(ARCH, own_arrays, {"b": b, "c": c}, fused, _config(repair="own"), data, seed=1)
    assert set(after.stages) == {"repaired"}
    x = input_tensor(ARCH, own[0])
    points = derive_structure(model_from_arrays(ARCH, own_arrays), (64,)).stat_points
    targets = combined_statistics(
        [unit_statistics(model_from_arrays(ARCH, m), points, x) for m in (own_arrays, b, c)], weights
    )
    before = unit_statistics(model_from_arrays(ARCH, fused), points, x)
    after_stats = unit_statistics(model_from_arrays(ARCH, after.stages["repaired"]), points, x)
    for p in points:
        t, got, was = targets[p.module], after_stats[p.module], before[p.module]
        # float32 weights: moments agree to ~1e-5 relative; the fused network's own std was
        # clearly off the target (the variance collapse REPAIR undoes)
        np.testing.assert_allclose(got.mean, t.mean, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.std, t.std, rtol=1e-4, atol=1e-4)
        assert np.mean(was.std / t.std) < 0.95
    rep = after.report
    assert rep["repair"] == {
        "data": "own",
        "examples": 300,
        "points": [p.module for p in points],
        "units": 16,
        "endpoints": 3,
        "kept": ["b", "c"],
        "alpha": 0.5,
    }
    assert rep["records"] == {"file": "own.npz", "count": 300}
    # no public validation set and prepared records (no held-out split known): nothing shows a
    # stage beats the own model, so the own model is recommended, and the reason says so
    assert rep["adopt"] == "own" and "no public validation set" in rep["adopt_reason"] and "finetune" not in rep
    # on the probe set instead: the statistics of the data used, not of the records
    probe = after_fusion.after_fusion(ARCH, own_arrays, {"b": b, "c": c}, fused, _config(repair="probe"), data, seed=1)
    assert probe.report["repair"]["data"] == "probe" and probe.report["repair"]["examples"] == 50
    got = unit_statistics(model_from_arrays(ARCH, probe.stages["repaired"]), points, input_tensor(ARCH, data.probe))
    t = combined_statistics(
        [
            unit_statistics(model_from_arrays(ARCH, m), points, input_tensor(ARCH, data.probe))
            for m in (own_arrays, b, c)
        ],
        weights,
    )
    np.testing.assert_allclose(got[points[0].module].std, t[points[0].module].std, rtol=1e-4, atol=1e-4)


def test_selection_and_fine_tuning(three_models):
    models, own, validation, _ = three_models
    own_arrays, b, c = models
    fused = average_arrays([own_arrays, b, c], fusion_weights(0.5, 2))
    data = after_fusion.LocalData(own, "own.npz", own[0][:50], validation, "validation.npz")
    cfg = _config(
        repair="own",
        select_validation="validation.npz",
        select_alphas=(0.5, 0.8),
        finetune_epochs=2,
        finetune_learning_rate=1e-3,
    )
    after = after_fusion.after_fusion(ARCH, own_arrays, {"b": b, "c": c}, fused, cfg, data, seed=7)
    sel = after.report["select"]
    # every non-empty subset of the two contributions at both α: 3 × 2 candidates, the best kept
    assert len(sel["candidates"]) == 6 and sel["search"] == "exhaustive"
    best = max(sel["candidates"], key=lambda t: (t["validation_accuracy"], -t["validation_log_loss"]))
    assert sel["validation_accuracy"] == best["validation_accuracy"]
    assert sel["validation_log_loss"] == best["validation_log_loss"]
    assert (sel["kept"], sel["alpha"]) == (best["kept"], best["alpha"])
    assert sorted(sel["kept"] + sel["dropped"]) == ["b", "c"]
    # the repaired stage is the chosen candidate
    from peer.nn.architectures import accuracy

    acc = accuracy(ARCH, model_from_arrays(ARCH, after.stages["repaired"]), *validation)
    assert acc == pytest.approx(sel["validation_accuracy"])
    ft = after.report["finetune"]
    assert ft == {"from": "repaired", "records": 300, "epochs": 2, "learning_rate": 1e-3, "batch_size": 64, "seed": 7}
    assert not all(np.array_equal(after.stages["finetuned"][k], after.stages["repaired"][k]) for k in own_arrays)
    again = after_fusion.after_fusion(ARCH, own_arrays, {"b": b, "c": c}, fused, cfg, data, seed=7)
    assert all(np.array_equal(after.stages["finetuned"][k], again.stages["finetuned"][k]) for k in own_arrays)
    scores = after.report["validation_accuracy"]  # before / after each stage, on public data
    assert list(scores) == ["own", "fused", "repaired", "finetuned"]
    assert scores["repaired"] == sel["validation_accuracy"]
    losses = after.report["validation_log_loss"]
    ranked = {k: (scores[k], -losses[k]) for k in scores}
    assert after.report["adopt"] in scores and ranked[after.report["adopt"]] == max(ranked.values())
    assert "public validation" in after.report["adopt_reason"]
    assert after.report["selection"] == {"data": "public validation", "source": "validation.npz", "examples": 200}


def test_a_round_repairs_and_fine_tunes_without_charging_anything_more(tmp_path, trained):  # noqa: F811
    """Real daemons: the requester's round with REPAIR on its own records and one fine-tuning
    epoch; the report records both, the stages are stored, and the ledgers hold exactly the
    releases of a plain round (two per peer), the requester's none."""
    _, _, ds = trained
    sites, _ = build(tmp_path, trained, ["hospital-a", "hospital-b", "hospital-c"])
    a, b, c = sites
    np.savez(tmp_path / "own.npz", x=ds.x_train[:200], y=ds.y_train[:200])
    cfg = config(
        tmp_path,
        records=tmp_path / "own.npz",
        records_prepared=True,
        repair="own",
        finetune_epochs=1,
        weights_epsilon=20.0,
        go_on_without_signal=True,  # ε 20 is below the 64-16-10 MLP's signal threshold (≈46)
    )
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster = roster_for(tmp_path, sites, addresses)
        result = run_round(load_local_site(a.config, "mlp"), roster, cfg)
    r = result.report
    assert result.status == "fused", result.reason
    af = r["after_fusion"]
    assert af["records"] == {"file": "own.npz", "count": 200}
    assert af["repair"]["data"] == "own" and af["repair"]["examples"] == 200 and af["repair"]["endpoints"] == 3
    assert af["finetune"]["epochs"] == 1 and af["finetune"]["records"] == 200 and af["finetune"]["from"] == "repaired"
    assert af["adopt"] == "own" and r["adopt_model"] == r["model"]  # nothing to score stages on
    out = tmp_path / "out" / "models"
    fused = load_model(out, r["fused_model"]).arrays
    repaired = load_model(out, r["repaired_model"])
    assert repaired.metadata["stage"] == "repaired" and repaired.metadata["after_fusion"]["repair"]["data"] == "own"
    assert all(np.array_equal(fused[k], result.arrays[k]) for k in fused)  # the un-repaired fusion is kept
    # REPAIR as the math says, with the round's own weights and aligned contributions
    x = input_tensor(ARCH, ds.x_train[:200])
    points = derive_structure(model_from_arrays(ARCH, fused), (64,)).stat_points
    own = load_model(a.root / "models", "mlp").arrays
    ends = [own, *(result.contributions[n] for n in r["contributors"])]
    targets = combined_statistics(
        [unit_statistics(model_from_arrays(ARCH, e), points, x) for e in ends], list(r["weights"].values())
    )
    got = unit_statistics(repaired.module(), points, x)
    for p in points:
        np.testing.assert_allclose(got[p.module].std, targets[p.module].std, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[p.module].mean, targets[p.module].mean, rtol=1e-4, atol=1e-4)
    # nothing charged by either step: two releases per peer, as in a plain round; none by A
    for peer in (b, c):
        assert [ch["step"] for ch in charges_of(r, peer.name)] == ["features", "weights"]
        assert len(ledger_entries(peer, "hospital-a")) == 2
    assert ledger_entries(a) == []
    assert any(e["event"] == "after-fusion" for e in r["events"])


def test_statistic_points_are_traced_once_so_round_threads_never_meet_a_trace():
    """torch.fx replaces nn.Module.__call__ process-wide while it traces: a forward pass on another
    thread during a trace fails ("module is not installed as a submodule"). The simulator runs
    several sites' rounds on threads, so the REPAIR points are traced once per architecture,
    before those threads start, and remembered: later rounds trace nothing."""
    import threading

    import torch

    from coordinator_free import after_fusion
    from peer.nn.architectures import build_model

    arch = {"kind": "mlp", "input_dim": 30, "hidden": [32], "output_dim": 2, "activation": "relu"}
    first = after_fusion.stat_points_of(arch, (30,))
    assert first  # one hidden layer: its statistic points
    stop, errors = threading.Event(), []

    def forward_passes():
        model = build_model(arch)
        while not stop.is_set():
            try:
                model(torch.zeros(4, 30))
            except Exception as e:  # a trace running now would make this fail
                errors.append(repr(e))
                return

    t = threading.Thread(target=forward_passes)
    t.start()
    try:
        for _ in range(50):
            assert after_fusion.stat_points_of(arch, (30,)) == first
    finally:
        stop.set()
        t.join()
    assert errors == []
