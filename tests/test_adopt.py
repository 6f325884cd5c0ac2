"""What a round recommends and what ``privfusion model adopt`` takes (``coordinator_free.after_fusion``,
``peer.cli.model``): the own model is always a candidate, scored with every stage on the site's
own held-out records (the split its stored model kept) when no public validation set is given,
so the recommendation never scores below it; an explicit adopt of a worse stage warns with both
scores; a fused model that is the own model up to a positive scaling of its logits is flagged.

The round is real (daemons on loopback, mutual TLS, ledgers), its requester's model trained on a
CSV by ``prepare_records`` as ``privfusion model train`` does, the adopt command a subprocess."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_harness import cli, make_site, pin_each_other, running
from test_rounds import ARCH, CLIP, policy, roster_for, trained  # noqa: F401

from coordinator_free import after_fusion
from coordinator_free.rounds import RoundConfig, fusion_weights
from peer.cli import main
from peer.ldp.fusion import average_arrays, permute_arrays
from peer.nn.architectures import state_arrays, train_classifier
from peer.nn.store import load_model, save_model
from peer.nn.tables import prepare_records

LOGREG = {"kind": "mlp", "input_dim": 64, "hidden": [], "output_dim": 10}

FRACTION, SPLIT_SEED = 0.25, 3


@pytest.fixture(scope="module")
def site_csv(tmp_path_factory, trained):  # noqa: F811 (the imported fixture)
    """600 digits records as a CSV (64 feature columns and a label), and the requester's model
    trained on its training split (``prepare_records``, as ``model train`` does): its metadata
    keeps the file's SHA-256 and the public split, its store the preprocessing."""
    _, _, ds = trained
    root = tmp_path_factory.mktemp("csv")
    path = root / "records.csv"
    header = ",".join([*(f"f{i}" for i in range(64)), "label"])
    rows = [
        ",".join([*(f"{v:g}" for v in x), str(int(y))]) for x, y in zip(ds.x_train[:600], ds.y_train[:600], strict=True)
    ]
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    records = prepare_records(path, label="label", validation_fraction=FRACTION, split_seed=SPLIT_SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_classifier(ARCH, records.x_train, records.y_train, seed=0, epochs=20)
    finally:
        torch.set_num_threads(threads)
    return path, records, state_arrays(model)


def _store_own(directory, records, arrays) -> None:
    save_model(directory, "mlp", ARCH, arrays, {"data": records.description}, records.preprocessing)


def test_the_own_models_held_out_split_is_recovered_from_its_training_file(tmp_path, site_csv):
    """The round's raw records file is the model's training file: the held-out rows are exactly
    the training split's validation part and only the training rows go to REPAIR and fine-tuning.
    Another file (one row fewer) has no known split: no held-out records, all rows used."""
    path, records, arrays = site_csv
    _store_own(tmp_path / "models", records, arrays)
    model = load_model(tmp_path / "models", "mlp")
    cfg = RoundConfig(roster=tmp_path / "r.toml", model="mlp", records=path, repair="own")
    data = after_fusion.load_local_data(cfg, model, records.x_train[:10])
    np.testing.assert_array_equal(data.heldout[0], records.x_val)
    np.testing.assert_array_equal(data.heldout[1], records.y_val)
    np.testing.assert_array_equal(data.records[0], records.x_train)
    assert data.selection()[0] == "own held-out records" and "150 rows" in data.heldout_source
    other = tmp_path / "other.csv"
    other.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    data = after_fusion.load_local_data(
        RoundConfig(roster=tmp_path / "r.toml", model="mlp", records=other, repair="own"), model, records.x_train[:10]
    )
    assert data.heldout is None and data.selection() is None and len(data.records[1]) == 599


def test_a_stage_worse_than_own_is_not_recommended_nor_adopted_by_default(tmp_path, site_csv, capsys):
    """A real round at a low weights ε (the peers' weights drown in noise) with REPAIR on the
    site's own records: fused and repaired both score below the own model on its held-out
    records, so the round recommends the own model, ``model adopt --from round-ID.json`` adopts
    nothing, and adopting the repaired stage explicitly works but warns with both scores."""
    path, records, arrays = site_csv
    probe = np.ascontiguousarray(records.x_train[:30])
    rng = np.random.default_rng(1)
    sites = []
    for i, name in enumerate(["hospital-a", "hospital-b", "hospital-c"]):
        perm = np.arange(16) if i == 0 else rng.permutation(16)
        site = make_site(
            tmp_path,
            name,
            models={},
            probe=probe,
            seed=100 + i,
            policy=policy(),
            activation_clip=CLIP,
        )
        if i == 0:
            _store_own(site.root / "models", records, arrays)
        else:
            save_model(site.root / "models", "mlp", ARCH, permute_arrays(ARCH, arrays, [perm]))
        sites.append(site)
    pin_each_other(*sites)
    a = sites[0]
    round_file = tmp_path / "round.toml"
    round_file.write_text(
        f"""[round]
roster = "{tmp_path / "roster.toml"}"
model = "mlp"
out = "{tmp_path / "out"}"
alpha = 0.25
[round.features]
activation_epsilon = 500.0
weight_epsilon = 500.0
[round.weights]
epsilon = 0.5
go_on_without_signal = true
[round.records]
path = "{path}"
[round.repair]
data = "own"
"""
    )
    with contextlib.ExitStack() as stack:
        addresses = {s.name: stack.enter_context(running(s))[1] for s in sites}
        roster_for(tmp_path, sites, addresses)
        code = main(["round", "--config", str(a.config), "--round", str(round_file)])
    console = capsys.readouterr()
    assert code == 0, console.err
    (report_path,) = (tmp_path / "out").glob("round-*.json")
    r = json.loads(report_path.read_text())
    assert r["status"] == "fused", r["reason"]
    # the console names the recommendation and the scores it rests on
    assert "recommended: own — no stage beats the own model on the own held-out records" in console.out
    assert "note:" not in console.out
    af = r["after_fusion"]
    assert af["selection"]["data"] == "own held-out records" and af["selection"]["examples"] == len(records.y_val)
    assert af["records"]["count"] == len(records.y_train) and af["records"]["held_out"]["count"] == 150
    acc = af["selection_accuracy"]
    # the premise: the noisy peers make every stage worse than the own model on its held-out rows
    assert acc["fused"] < acc["own"] and acc["repaired"] < acc["own"], acc
    assert af["adopt"] == "own" and r["adopt_model"] == "mlp"
    assert "no stage beats the own model" in af["adopt_reason"]
    assert r["fused_vs_own"]["same_as_own"] is False and "fused_vs_own_note" not in r

    store = a.root / "models"
    by_default = cli("model", "adopt", "--site", str(a.root), "--from", str(report_path), "--name", "mlp-v2")
    assert "recommends own" in by_default.stdout and "nothing adopted" in by_default.stdout
    assert f"own {acc['own']:.3f}" in by_default.stdout and not (store / "mlp-v2.json").exists()

    repaired = tmp_path / "out" / "models" / r["repaired_model"]
    explicit = cli("model", "adopt", "--site", str(a.root), "--from", str(repaired), "--name", "mlp-repaired")
    assert (store / "mlp-repaired.json").is_file()  # the user asked: allowed
    assert "warning: repaired scored" in explicit.stderr
    assert f"{acc['repaired']:.3f}" in explicit.stderr and f"{acc['own']:.3f}" in explicit.stderr


def test_a_stage_that_beats_own_is_what_model_adopt_takes(tmp_path, site_csv):
    """The other side of the rule: a round report whose steps after fusion scored the repaired
    stage above own (a copy of the model as that stage) is followed by ``model adopt``."""
    _, records, arrays = site_csv
    site = make_site(tmp_path, "hospital-a", models={})
    _store_own(site.root / "models", records, arrays)
    out = tmp_path / "rounds"
    rid = "ab" * 16
    save_model(
        out / "models",
        f"mlp-repaired-{rid[:12]}",
        ARCH,
        arrays,
        {"round": {"round_id": rid, "site": "hospital-a", "contributors": ["hospital-b"]}},
    )
    scores = {"own": 0.5, "fused": 0.4, "repaired": 0.9}
    pick, reason = after_fusion.recommend({k: (v, 1.0) for k, v in scores.items()}, "own held-out records")
    report = {
        "round_id": rid,
        "status": "fused",
        "model": "mlp",
        "site": "hospital-a",
        "contributors": ["hospital-b"],
        "repaired_model": f"mlp-repaired-{rid[:12]}",
        "after_fusion": {
            "adopt": pick,
            "adopt_reason": reason,
            "selection": {"data": "own held-out records"},
            "selection_accuracy": scores,
            "selection_log_loss": dict.fromkeys(scores, 1.0),
        },
    }
    (out / f"round-{rid}.json").write_text(json.dumps(report))
    assert pick == "repaired"
    got = cli("model", "adopt", "--site", str(site.root), "--from", str(out / f"round-{rid}.json"), "--name", "v2")
    assert "recommends repaired" in got.stdout and "own 0.500" in got.stdout and not got.stderr.strip()
    assert load_model(site.root / "models", "v2").metadata["adopted"]["round_id"] == rid


def test_recommend_never_picks_below_own_and_ties_go_to_own():
    rank = {"own": (0.8, 0.5), "fused": (0.8, 0.5), "repaired": (0.7, 0.1)}
    assert after_fusion.recommend(rank, "public validation")[0] == "own"
    assert after_fusion.recommend({**rank, "finetuned": (0.8, 0.4)}, "x")[0] == "finetuned"
    assert after_fusion.recommend({**rank, "finetuned": (0.8, 0.4), "tuned2": (0.8, 0.4)}, "x")[0] == "tuned2"
    pick, reason = after_fusion.recommend(None, None)
    assert pick == "own" and "no public validation set and no held-out records" in reason


def test_a_fused_model_that_is_the_own_model_scaled_is_flagged(trained):  # noqa: F811
    """Peers whose aligned contributions are zero, on a softmax regression (one linear layer):
    θ = 0.25·θ_own, so the logits are exactly 0.25 × the own model's (the issue's round) —
    flagged, with the scale. A two-layer ReLU MLP with biases is not positively homogeneous
    (0.25·b₂ beside 0.0625·W₂h): a genuine fusion of it with a different model is not flagged."""
    _, probe, ds = trained
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        own = state_arrays(train_classifier(LOGREG, ds.x_train[:400], ds.y_train[:400], seed=0, epochs=10))
        mlp = state_arrays(train_classifier(ARCH, ds.x_train[:400], ds.y_train[:400], seed=0, epochs=10))
        other = state_arrays(train_classifier(ARCH, ds.x_train[400:800], ds.y_train[400:800], seed=5, epochs=10))
    finally:
        torch.set_num_threads(threads)
    zeros = {k: np.zeros_like(v) for k, v in own.items()}
    fused = average_arrays([own, zeros], fusion_weights(0.25, 1))
    data = after_fusion.LocalData((ds.x_train[:100], ds.y_train[:100]), "own.npz", probe)
    cfg = RoundConfig(roster=Path("r.toml"), model="mlp", repair="own")
    rep = after_fusion.after_fusion(LOGREG, own, {"b": zeros}, fused, cfg, data, seed=1).report
    check = rep["fused_vs_own"]
    assert check["same_as_own"] is True and check["data"] == "public probe set" and check["examples"] == len(probe)
    assert check["scale"] == pytest.approx(0.25, rel=1e-5) and check["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert "same predictions as the own model" in after_fusion.same_as_own_line(check)
    mixed = average_arrays([mlp, other], fusion_weights(0.5, 1))
    check = after_fusion.fused_vs_own(after_fusion.BuiltIn(ARCH), mlp, mixed, ds.x_test[:200], "held-out")
    assert check["same_as_own"] is False and check["cosine"] < after_fusion.SAME_AS_OWN_COSINE
    assert after_fusion.same_as_own_line(check) is None
