"""The local steps after fusion (``coordinator_free.after_fusion``) in a round on a site's OWN
network (``peer.nn.imported``): ``[round.records]``, ``[round.select]``, ``[round.repair]`` and
``[round.finetune]`` run in the site's own module class, the own_bn_reset reference is scored
for a network with BatchNorm, every stage is stored in the site's own store (and exports for its
class), the records never leave (the peer's ledger holds exactly a plain round's charges), and a
bad records file is refused before anything is asked. Two real daemons, mutual TLS on loopback,
a small ResNet with BatchNorm (``site_models.networks.SmallResNet``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peer_harness import make_site, pin_each_other, roster_of, running
from site_models.networks import SmallResNet
from test_after_fusion import parse
from test_imported_e2e import outputs, train_own
from test_imported_ldp import NETWORKS, digits  # noqa: F401 (digits: the fixture)

from coordinator_free import after_fusion
from coordinator_free.rounds import RoundConfig
from coordinator_free.runner import _OwnNetwork, load_local_site, run_round
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.budget.ledger import Ledger
from peer.nn.imported import export_model, import_model, load_imported

FACTORY = f"{NETWORKS}:small_resnet"
CLIP = (-4.0, 4.0)
PROBE_ROWS = 24
RECORDS = 96  # the requester's own records (prepared x/y)
BN = ["stem_bn", "stage1.bn1", "stage1.bn2", "stage2.bn1", "stage2.bn2"]
#: small releases: two rounds fit the harness policy's 1000 per counterparty
RELEASE = {"activation_epsilon": 50.0, "weight_epsilon": 50.0, "weights_epsilon": 100.0, "weights_delta": 1e-5}


def _stem_means(arrays, x: np.ndarray) -> np.ndarray:
    """The per-channel mean of the stem convolution's output on ``x``: what a BatchNorm reset
    puts into ``stem_bn.running_mean`` (the stem is the first layer, so nothing before it
    depends on other statistics)."""
    model = SmallResNet()
    model.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in arrays.items()})
    with torch.no_grad():
        return model.stem(torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8)).mean((0, 2, 3)).numpy()


@pytest.fixture
def sites(tmp_path, digits):  # noqa: F811
    """St Anne (the requester: probe set, own records, public validation file) and Riverside,
    each with its own SmallResNet trained on 64 records of its half of digits, imported."""
    torch.set_num_threads(1)
    s = digits
    n = len(s.y_train)
    a = make_site(tmp_path, "st-anne", probe=s.x_val[:PROBE_ROWS].astype(np.float32), activation_clip=CLIP)
    b = make_site(tmp_path, "riverside", activation_clip=CLIP)
    pin_each_other(a, b)
    for site, rows, seed in ((a, slice(0, 64), 1), (b, slice(n // 2, n // 2 + 64), 2)):
        model = train_own(SmallResNet, s.x_train[rows], s.y_train[rows], seed=seed)
        import_model(site.root / "own_models", "resnet", model, [1, 8, 8], factory=FACTORY)
    np.savez(tmp_path / "own.npz", x=s.x_train[:RECORDS].astype(np.float32), y=s.y_train[:RECORDS])
    np.savez(tmp_path / "validation.npz", x=s.x_val[100:160].astype(np.float32), y=s.y_val[100:160])
    return a, b


def _config(tmp_path, out: str, **kw) -> RoundConfig:
    return RoundConfig(
        roster=tmp_path / "roster.toml",
        model="resnet",
        method="ldp",
        out=tmp_path / out,
        quorum=2,
        activation_clip=CLIP,
        go_on_without_signal=True,  # the stages after fusion are tested, at ε below the signal threshold
        **RELEASE,
        **kw,
    )


@pytest.mark.slow
def test_an_own_network_round_runs_every_stage_after_fusion_and_charges_nothing_more(tmp_path, sites, digits):  # noqa: F811
    a, b = sites
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_of(tmp_path / "roster.toml", {"st-anne": addr_a, "riverside": addr_b}, a, b)
        local = load_local_site(a.config, "resnet")

        # 1. a plain round: [round.repair] data = "off" said in so many words, nothing after fusion
        plain = run_round(local, roster, _config(tmp_path, "plain", repair="off", repair_set=True))
        assert plain.status == "fused", plain.reason
        assert "after_fusion" not in plain.report and plain.stages == {}

        # 2. the same round with every local step: own records, public selection, REPAIR on the
        # own records, one fine-tuning epoch
        cfg = _config(
            tmp_path,
            "staged",
            records=tmp_path / "own.npz",
            records_prepared=True,
            repair="own",
            select_validation=tmp_path / "validation.npz",
            select_alphas=(0.3, 0.6),
            finetune_epochs=1,
            finetune_batch_size=32,
        )
        result = run_round(local, roster, cfg)
        assert result.status == "fused", result.reason
        r = result.report
        af = r["after_fusion"]
        assert "error" not in af, af
        assert af["records"] == {"file": "own.npz", "count": RECORDS}
        assert af["repair"]["data"] == "own" and af["repair"]["examples"] == RECORDS
        assert af["repair"]["batchnorm_reset"] == BN and af["repair"]["endpoints"] == 2
        assert af["own_bn_reset"] == {"data": "own", "examples": RECORDS, "batchnorm_reset": BN}
        assert [(c["kept"], c["alpha"]) for c in af["select"]["candidates"]] == [
            (["riverside"], 0.3),
            (["riverside"], 0.6),
        ]
        assert af["finetune"]["from"] == "repaired" and af["finetune"]["records"] == RECORDS
        scores, losses = af["validation_accuracy"], af["validation_log_loss"]
        assert list(scores) == ["own", "own_bn_reset", "fused", "repaired", "finetuned"]
        ranked = {k: (scores[k], -losses[k]) for k in scores}
        assert ranked[af["adopt"]] == max(ranked.values()) and "own_bn_reset" in af["adopt_reason"]
        assert set(result.stages) == {"repaired", "finetuned", "own_bn_reset"}

        # every stage in the site's own store, under its key names; the adopted one named; each
        # exports for the site's class and computes what the store's copy computes
        store = a.root / "own_models"
        x_test = digits.x_test[:50]
        for stage in ("fused", "repaired", "finetuned", "own_bn_reset"):
            stored = load_imported(store, r[f"{stage}_model"])
            arrays = result.arrays if stage == "fused" else result.stages[stage]
            assert all(np.array_equal(np.asarray(stored.arrays[k]), np.asarray(arrays[k])) for k in arrays), stage
            if stage != "fused":
                assert stored.metadata["stage"] == stage and stored.metadata["after_fusion"]["adopt"] == af["adopt"]
            mine = SmallResNet()
            mine.load_state_dict(torch.load(export_model(stored, tmp_path / f"{stage}.pt", "pt"), weights_only=True))
            copy = SmallResNet()
            copy.load_state_dict(stored.state_dict())
            assert torch.equal(outputs(mine, x_test), outputs(copy, x_test)), stage
        assert r["adopt_model"] == (r["model"] if af["adopt"] == "own" else r[f"{af['adopt']}_model"])

        # own_bn_reset is our own model with only its BatchNorm statistics re-estimated on the records
        own_state = _OwnNetwork.of(local, local.probe).state()
        reset = result.stages["own_bn_reset"]
        x_records = np.load(tmp_path / "own.npz")["x"]
        np.testing.assert_allclose(reset["stem_bn.running_mean"], _stem_means(own_state, x_records), atol=1e-5)
        assert all(np.array_equal(reset[k], own_state[k]) for k in own_state if "running" not in k)

        # the records never left: exactly a plain round's releases, at the same ε; none by St Anne
        def charged(res):
            return [(c["peer"], c["step"], c["level"], c["epsilon"]) for c in res.report["charges"]]

        assert charged(result) == charged(plain) and [c[1] for c in charged(plain)] == ["features", "weights"]
        with Ledger(b.ledger) as ledger:
            entries = [e.record for e in ledger.entries()]
        assert len(entries) == 4
        assert [(e.counterparty, e.epsilon) for e in entries[2:]] == [(e.counterparty, e.epsilon) for e in entries[:2]]
        with Ledger(a.ledger) as ledger:
            assert ledger.entries() == []

        # 3. a records file that is not this network's input is refused before anyone is asked
        np.savez(tmp_path / "wide.npz", x=np.zeros((4, 50), np.float32), y=np.zeros(4, np.int64))
        with pytest.raises(InvalidArgument) as e:
            run_round(
                local,
                roster,
                _config(tmp_path, "bad", records=tmp_path / "wide.npz", records_prepared=True, repair="own"),
            )
        assert e.value.field == "round.records.path" and "wide.npz" in str(e.value) and "[1, 8, 8]" in str(e.value)
        with Ledger(b.ledger) as ledger:
            assert len(ledger.entries()) == 4
        assert not (tmp_path / "bad").exists()

    # 4. REPAIR on the probe set instead, on the round's own contributions (no new release):
    # the report counts the probe's rows, and the BatchNorm reset is measured on the probe
    probe = after_fusion.after_fusion(
        local.model.architecture,
        own_state,
        result.contributions,
        result.arrays,
        RoundConfig(roster=tmp_path / "roster.toml", model="resnet", repair="probe"),
        after_fusion.LocalData(None, None, local.probe),
        seed=1,
        kind=_OwnNetwork.of(local, local.probe).kind,
    )
    assert probe.report["repair"]["examples"] == PROBE_ROWS and probe.report["own_bn_reset"]["examples"] == PROBE_ROWS
    on_probe = probe.stages["own_bn_reset"]["stem_bn.running_mean"]
    np.testing.assert_allclose(on_probe, _stem_means(own_state, local.probe), atol=1e-5)
    assert not np.allclose(on_probe, reset["stem_bn.running_mean"], atol=1e-3)  # other data, other statistics
    assert probe.report["adopt"] == "own"  # no validation set, no held-out records: the own model


def test_own_network_records_are_checked_naming_the_round_key_file_and_row(tmp_path):
    """load_local_data for a site's own network: rows of another shape, labels outside its
    outputs and raw records without a stored preprocessing are refused, naming the round key."""
    site = make_site(tmp_path, "st-anne", probe=np.zeros((4, 64), np.float32), activation_clip=CLIP)
    import_model(site.root / "own_models", "resnet", SmallResNet().eval(), [1, 8, 8], factory=FACTORY)
    local = load_local_site(site.config, "resnet")
    kind = _OwnNetwork.of(local, local.probe).kind

    def load(body: str):
        cfg = _OwnNetwork.of(local, local.probe).after_fusion_config(parse(tmp_path, body))
        return after_fusion.load_local_data(cfg, local.model, local.probe, kind)

    np.savez(tmp_path / "images.npz", x=np.zeros((3, 1, 8, 8), np.float32), y=np.array([0, 9, 2]))
    np.savez(tmp_path / "flat.npz", x=np.zeros((3, 64), np.float32), y=np.array([0, 1, 2]))
    data = load('[round.records]\npath = "images.npz"\nprepared = true\n[round.repair]\ndata = "own"\n')
    assert data.records[0].shape == (3, 1, 8, 8) and data.records_source == "images.npz"
    assert load('[round.records]\npath = "flat.npz"\nprepared = true\n').records[0].shape == (3, 64)

    np.savez(tmp_path / "odd.npz", x=np.zeros((3, 8, 9), np.float32), y=np.array([0, 1, 2]))
    with pytest.raises(InvalidArgument) as e:
        load('[round.records]\npath = "odd.npz"\nprepared = true\n')
    assert e.value.field == "round.records.path" and "[8, 9]" in e.value.rule and "'resnet'" in e.value.rule
    np.savez(tmp_path / "labels.npz", x=np.zeros((3, 64), np.float32), y=np.array([0, 10, 2]))
    with pytest.raises(InvalidArgument) as e:
        load('[round.records]\npath = "labels.npz"\nprepared = true\n[round.finetune]\nepochs = 1\n')
    assert (
        e.value.field == "round.records.path" and "row 1 has label 10" in e.value.rule and "10 outputs" in e.value.rule
    )
    with pytest.raises(InvalidArgument) as e:
        load('[round.select]\nvalidation = "labels.npz"\n')
    assert e.value.field == "round.select.validation" and "row 1" in e.value.rule
    (tmp_path / "raw.csv").write_text("a,b,label\n1,2,0\n")
    with pytest.raises(FailedPrecondition) as e:
        load('[round.records]\npath = "raw.csv"\n[round.repair]\ndata = "own"\n')
    assert "round.records" in str(e.value) and "prepared = true" in str(e.value)


def test_an_own_network_repairs_on_the_probe_unless_the_round_file_says_otherwise(tmp_path):
    """No [round.repair]: an own network's averaged BatchNorm statistics are re-estimated on the
    public probe set (the default); data = "off" is honoured, and reported as such."""
    site = make_site(tmp_path, "st-anne", probe=np.zeros((4, 64), np.float32), activation_clip=CLIP)
    import_model(site.root / "own_models", "resnet", SmallResNet().eval(), [1, 8, 8], factory=FACTORY)
    local = load_local_site(site.config, "resnet")
    own = _OwnNetwork.of(local, local.probe)
    default = own.after_fusion_config(parse(tmp_path, ""))
    assert default.repair == "probe" and after_fusion.enabled(default) and default.public()["repair"] == "probe"
    off = own.after_fusion_config(parse(tmp_path, '[round.repair]\ndata = "off"\n'))
    assert off.repair == "off" and not after_fusion.enabled(off) and "repair_set" not in off.public()
    assert parse(tmp_path, "").public() == {**default.public(), "repair": "off"}  # a built-in's stays off


def test_raw_records_of_an_own_network_are_read_by_its_stored_preprocessing_and_input_shape_rule(tmp_path):
    """An own network that stores a preprocessing reads raw records with it, then the input
    shape rule of ``pool train --from-model NAME --data FILE``: 64 numeric columns become the
    [1, 8, 8] input; records missing its columns, or a preprocessing with one-hot entries (no
    pixels) for this shaped input, are refused naming the round key and the file."""
    from peer.nn.imported import save_imported
    from peer.nn.tables import Preprocessing, read_table

    rng = np.random.default_rng(0)

    def table(path, rows: int, numeric: int, category: bool = False) -> None:
        header = [f"p{i}" for i in range(numeric)] + (["ward"] if category else [])
        lines = [",".join([*header, "label"])]
        for i in range(rows):
            cells = [f"{v:.3f}" for v in rng.normal(size=numeric)] + (["ab"[i % 2]] if category else [])
            lines.append(",".join([*cells, str(i % 10)]))
        path.write_text("\n".join(lines) + "\n")

    table(tmp_path / "public.csv", 30, 64)
    table(tmp_path / "records.csv", 12, 64)
    table(tmp_path / "narrow.csv", 12, 10)
    table(tmp_path / "wards.csv", 30, 62, category=True)
    site = make_site(tmp_path, "st-anne", probe=np.zeros((4, 64), np.float32), activation_clip=CLIP)
    own = import_model(site.root / "own_models", "resnet", SmallResNet().eval(), [1, 8, 8], factory=FACTORY)

    def load(prep, records: str):
        save_imported(site.root / "own_models", "resnet", own.factory, own.structure, own.arrays, preprocessing=prep)
        local = load_local_site(site.config, "resnet")
        cfg = parse(tmp_path, f'[round.records]\npath = "{records}"\n[round.repair]\ndata = "own"\n')
        return after_fusion.load_local_data(cfg, local.model, local.probe, _OwnNetwork.of(local, local.probe).kind)

    numeric = Preprocessing.fit(read_table(tmp_path / "public.csv", label="label"), split="public")
    data = load(numeric, "records.csv")
    assert data.records[0].shape == (12, 64) and data.records_source == "records.csv"
    with pytest.raises(InvalidArgument) as e:
        load(numeric, "narrow.csv")
    assert e.value.field == "round.records.path" and "narrow.csv" in e.value.rule and "p10" in e.value.rule
    wards = Preprocessing.fit(read_table(tmp_path / "wards.csv", label="label", categorical=["ward"]), split="public")
    assert wards.width == 64
    with pytest.raises(InvalidArgument) as e:
        load(wards, "wards.csv")
    assert e.value.field == "round.records.path" and "wards.csv" in e.value.rule and "categorical" in e.value.rule
