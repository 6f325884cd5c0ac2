"""The commands a site runs on its own records, on files the tests write: ``model train``,
``pool train --data``, ``probe make``, and ``simulate`` of a scenario whose ``[data]`` points at
a CSV. Each command runs once as a subprocess (as a site runs it); the refusals and the path
rules run in-process (``peer.cli.app.main``), which is the same code without a new interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from peer_harness import cli
from test_tables import records, write_csv

from peer.base.errors import InvalidArgument

COLUMNS = ["age", "ward", "bp", "sex", "outcome"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    """The command in-process: (exit status, stdout, stderr)."""
    from peer.cli.app import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("records")
    rows = records(300, seed=11)
    return {
        "private": write_csv(d / "private.csv", rows[:240], COLUMNS),
        "public": write_csv(d / "public.csv", rows[240:], COLUMNS),
        "dir": d,
    }


@pytest.fixture(scope="module")
def site(files) -> dict:
    """A site with a model and a two-model pool trained on its own records (what the commands
    printed, too)."""
    root = files["dir"] / "site"
    model = cli(
        "model",
        "train",
        "--site",
        str(root),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--categorical",
        "sex",
        "--name",
        "own",
        "--epochs",
        "5",
        "--hidden",
        "16",
    )
    pool = cli(
        "pool",
        "train",
        "--site",
        str(root),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--public",
        str(files["public"]),
        "--categorical",
        "sex",
        "--model",
        "name=a,noise=2,clip=1",
        "--model",
        "name=b,noise=6,clip=1",
        "--steps",
        "20",
    )
    return {"root": root, "model": model, "pool": pool}


def test_model_train_saves_the_model_with_its_preprocessing(files, tmp_path, capsys):
    from peer.nn.architectures import accuracy
    from peer.nn.store import load_model
    from peer.nn.tables import prepare_records

    proc = cli(
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--name",
        "m",
        "--epochs",
        "40",
        "--hidden",
        "16",
        "--learning-rate",
        "0.01",
        "--validation-fraction",
        "0.25",
        "--json",
    )
    out = json.loads(proc.stdout)
    stored = load_model(tmp_path / "models", "m")
    assert stored.preprocessing is not None and stored.preprocessing.fitted_on["rows"] == 180
    assert out["data"]["training_rows"] == 180 and out["data"]["validation_rows"] == 60
    assert stored.architecture["input_dim"] == out["input_width"] == 2 + 3 + 2  # age, bp, ward×3, sex×2
    # the printed accuracy is the stored model's on the same held-out split, prepared by the stored preprocessing
    r = prepare_records(files["private"], label="outcome", validation_fraction=0.25, preprocessing=stored.preprocessing)
    assert accuracy(stored.architecture, stored.module(), r.x_val, r.y_val) == out["validation_accuracy"]
    # the labels are a near-deterministic function of the features: far above chance (a
    # fixed-seed run; chance is about 0.5)
    assert out["validation_accuracy"] >= 0.8 and out["training_accuracy"] >= 0.8
    code, _, err = run(
        capsys,
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--name",
        "m",
        "--epochs",
        "2",
    )
    assert code == 2 and "model 'm' is already in" in err and "--force" in err


def test_model_train_prints_accuracies(site):
    out = site["model"].stdout
    assert "model own: 192 training records, 48 held out (of 240 in private.csv)" in out
    assert "inputs: 7 entries from 4 columns (2 categorical, one-hot); classes ['sick', 'well']" in out
    assert "accuracy: training 0." in out and ", validation 0." in out and "with its preprocessing" in out


def test_model_train_refuses_bad_records_naming_the_row(files, tmp_path, capsys):
    rows = records(30, seed=4)
    rows[6][0] = "sixty"  # data row 7
    rows[9][2] = "12,5"
    bad = write_csv(tmp_path / "bad.csv", rows, COLUMNS)
    proc = cli(
        "model", "train", "--site", str(tmp_path), "--data", str(bad), "--label", "outcome", "--name", "m", check=False
    )
    assert proc.returncode == 2
    assert "bad.csv, column 'age', data row 7 (spreadsheet row 8): a non-numeric value in" in proc.stderr
    assert "sixty" not in proc.stderr
    code, _, err = run(
        capsys,
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "death",
        "--name",
        "m",
    )
    assert code == 2 and "no column 'death'; the file's columns are ['age', 'ward', 'bp', 'sex', 'outcome']" in err
    assert not (tmp_path / "models" / "m.json").exists()


def test_an_identifier_column_is_refused_by_name_and_no_record_value_is_printed(tmp_path):
    """Issue 20, item 7, as a user meets it: a CSV with a patient_id column, every column but the
    label a feature by default. It was refused with an error listing ~240 patient IDs (the held-out
    records' IDs were categories the training never saw, and the message listed the training's).
    Now stderr names the column and the --features that leave it out, and holds no ID; naming it
    in --features anyway fails later, again without any ID."""
    from test_tables import PATIENT_COLUMNS, patients

    rows, ids = patients()
    path = write_csv(tmp_path / "patients.csv", rows, PATIENT_COLUMNS)
    base = ["model", "train", "--site", str(tmp_path / "s"), "--data", str(path), "--label", "outcome", "--name", "m"]
    proc = cli(*base, check=False)
    assert proc.returncode == 2
    assert "column 'patient_id' (its name) looks like an identifier" in proc.stderr
    assert "--features age ward bp sex" in proc.stderr
    assert not any(pid in proc.stderr or pid in proc.stdout for pid in ids)
    proc = cli(*base, "--features", *PATIENT_COLUMNS[:-1], check=False)
    assert proc.returncode == 2 and "column 'patient_id'" in proc.stderr and "never saw (it saw 240)" in proc.stderr
    assert not any(pid in proc.stderr or pid in proc.stdout for pid in ids)
    assert not (tmp_path / "s" / "models" / "m.json").exists()
    # with the hint's features, the same file trains
    proc = cli(*base, "--features", "age", "ward", "bp", "sex")
    assert "inputs: 7 entries from 4 columns" in proc.stdout and not any(pid in proc.stdout for pid in ids)


def test_model_train_on_image_arrays_with_the_cnn_preset(tmp_path, capsys):
    from peer.nn.store import load_model

    rng = np.random.default_rng(0)
    y = np.arange(60) % 3
    x = rng.normal(size=(60, 1, 8, 8)).astype(np.float32) + y[:, None, None, None]
    np.savez(tmp_path / "img.npz", x=x, y=y)
    code, out, err = run(
        capsys,
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(tmp_path / "img.npz"),
        "--label",
        "y",
        "--preset",
        "cnn",
        "--name",
        "c",
        "--epochs",
        "3",
        "--json",
    )
    assert code == 0, err
    stored = load_model(tmp_path / "models", "c")
    assert stored.architecture["kind"] == "cnn" and stored.architecture["input_shape"] == [1, 8, 8]
    assert stored.preprocessing.classes == (0, 1, 2) and json.loads(out)["input_width"] == 64


def test_the_store_is_where_site_toml_says(files, tmp_path, capsys):
    def cli(*args):
        code, _, err = run(capsys, *args)
        assert code == 0, err

    (tmp_path / "site.toml").write_text(
        '[site]\nname = "h"\nlisten = "127.0.0.1:0"\nidentity = "id"\n'
        'models = "store"\nledger = "l.sqlite"\n\n[site.pools.main]\nmodels = "dp"\n'
        'validation = "public/val.npz"\n'
    )
    cli(
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--name",
        "m",
        "--epochs",
        "1",
    )
    assert (tmp_path / "store" / "m.json").is_file() and not (tmp_path / "models").exists()
    cli(
        "model",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--public",
        str(files["public"]),
        "--name",
        "p",
        "--epochs",
        "1",
    )
    from peer.nn.store import load_model

    assert load_model(tmp_path / "store", "m").preprocessing.fitted_on["split"] == "training"
    assert load_model(tmp_path / "store", "p").preprocessing.fitted_on == {
        "file": "public.csv",
        "sha256": load_model(tmp_path / "store", "p").preprocessing.fitted_on["sha256"],
        "rows": 60,
        "split": "public",
    }
    cli(
        "pool",
        "train",
        "--site",
        str(tmp_path),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--public",
        str(files["public"]),
        "--model",
        "noise=2,clip=1",
        "--steps",
        "2",
    )
    assert (tmp_path / "dp" / "dpsgd-0.json").is_file()
    code, _, err = run(capsys, "probe", "make", "--site", str(tmp_path), "--data", str(files["public"]))
    assert code == 2 and "name the model the probe set serves" in err and "['m', 'p']" in err
    cli("probe", "make", "--site", str(tmp_path), "--data", str(files["public"]), "--label", "outcome", "--model", "p")
    assert (tmp_path / "public" / "val.npz").is_file() and (tmp_path / "probe.safetensors").is_file()


def test_pool_train_declares_n_as_the_training_records(site, files, capsys):
    from peer.dp.pools import load_pool, pool_preprocessing, pool_validation

    site = site["root"]
    pool = load_pool(site / "pool")
    assert [m.name for m in pool] == ["a", "b"]
    prep = pool_preprocessing(site / "pool")
    # fitted on the public file, never on the protected records
    assert prep is not None and prep.fitted_on["split"] == "public" and prep.fitted_on["file"] == "public.csv"
    assert prep.fitted_on["rows"] == 60 and prep.categorical == ("ward", "sex")
    for m in pool:
        assert m.dataset_size == 192 and m.metadata["record"]["parameters"]["dataset_size"] == 192
        assert m.metadata["data"]["training_rows"] == 192 and m.metadata["data"]["file"] == "private.csv"
    # the held-out part of protected records never judges merges
    with pytest.raises(InvalidArgument, match=r"own records.*probe make"):
        pool_validation(pool)


def test_pool_train_prints_n_and_refuses_what_it_cannot_do(site, files, capsys):
    proc = site["pool"]
    assert "DP-SGD on 192 training records of private.csv (48 held out): declared dataset size n = 192" in proc.stderr
    assert "a: epsilon(pld)=" in proc.stdout and "declared dataset size n = 192" in proc.stdout
    code, _, err = run(capsys, "pool", "train", "--out", str(files["dir"] / "p3"), "--data", str(files["private"]))
    assert code == 2 and "--label: is required with --data" in err
    code, _, err = run(
        capsys,
        "pool",
        "train",
        "--site",
        str(site["root"]),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--public",
        str(files["public"]),
        "--model",
        "name=a,noise=2,clip=1",
    )
    assert code == 2 and "models ['a'] are already in the pool" in err
    # a pool's preprocessing never comes from its protected records
    code, _, err = run(
        capsys,
        "pool",
        "train",
        "--out",
        str(files["dir"] / "p4"),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
    )
    assert code == 2 and "--public: a DP pool's preprocessing must not come from its protected records" in err
    code, _, err = run(
        capsys,
        "pool",
        "train",
        "--out",
        str(files["dir"] / "p4"),
        "--data",
        str(files["private"]),
        "--label",
        "outcome",
        "--preprocessing",
        str(site["root"] / "models" / "own.json"),
    )
    assert (
        code == 2 and "fitted on the training split of private.csv, the protected records DP-SGD would train on" in err
    )
    assert not (files["dir"] / "p4").exists()


def test_iterate_refuses_records_its_preprocessing_was_fitted_on(site, files, tmp_path):
    """An ``iterate`` run trains with DP-SGD on the records it reads through the model's stored
    preprocessing: one fitted on those very records is refused before any step (its statistics
    would change with one record), naming the key and the rule; one fitted on public records reads
    the same file; other records than the fitted ones pass (the refusal is not by the file's kind)."""
    from coordinator_free.iterate import load_records
    from peer.nn.store import load_model

    own = load_model(site["root"] / "models", "own")
    with pytest.raises(InvalidArgument) as e:
        load_records(files["private"], own)
    assert e.value.field == "round.iterate.records"
    assert "fitted on the training split of private.csv" in e.value.rule and "--public" in e.value.rule
    x, y = load_records(files["public"], own)  # not the records it was fitted on
    assert len(x) == len(y) == 60

    root = tmp_path / "site"
    cli("model", "train", "--site", str(root), "--data", str(files["private"]), "--label", "outcome",
        "--public", str(files["public"]), "--name", "pub", "--epochs", "2", "--hidden", "8")  # fmt: skip
    x, y = load_records(files["private"], load_model(root / "models", "pub"))
    assert len(x) == len(y) == 240 and np.all(np.isfinite(x))


def test_probe_make_writes_public_files_the_daemon_reads(site, files, capsys):
    from safetensors.numpy import load_file

    from peer.dp.pools import load_pool, load_validation_file, merge_pool
    from peer.nn.store import load_model

    site = site["root"]
    proc = cli(
        "probe",
        "make",
        "--site",
        str(site),
        "--data",
        str(files["public"]),
        "--label",
        "outcome",
        "--rows",
        "25",
        "--force",
    )
    assert "PUBLIC" in proc.stdout and "becomes public" in proc.stdout
    assert "can recover those statistics" in proc.stdout  # the model's preprocessing came from its training split
    probe = load_file(str(site / "probe.safetensors"))["x"]
    prep = load_model(site / "models", "own").preprocessing
    assert probe.shape == (25, prep.width) and probe.dtype == np.float32
    x_all, _ = prep.transform(prep.read(files["public"], labelled=False))
    assert all(any(np.array_equal(row, r) for r in x_all) for row in probe)  # rows of the public file
    x, y = load_validation_file(site / "validation.npz")
    assert x.shape == (60, prep.width) and set(y.tolist()) <= {0, 1}
    # the validation set judges an RS merge of the pool
    merged = merge_pool(load_pool(site / "pool"), "rs", 30.0, 1e-5, selection="utility", validation=(x, y))
    assert merged.record.level == "data"
    code, _, err = run(capsys, "probe", "make", "--site", str(site), "--data", str(files["public"]))
    assert code == 2 and "give --force" in err
    code, _, err = run(
        capsys, "probe", "make", "--site", str(site), "--data", str(files["public"]), "--label", "ward", "--force"
    )
    assert code == 2 and "trained with label 'outcome'" in err


SCENARIO = """
[scenario]
name = "own-records"
seed = 3

[data]
path = "{csv}"
label = "outcome"
categorical = ["sex"]
public_size = 40
probe_size = 20
split = "iid"
min_per_site = 20

[model]
hidden = [8]
epochs = 20

[pool]
noise_multipliers = [2.0, 4.0]
steps = 10
declared_records = 60

[round]
methods = ["ldp", "merged"]
frontier = []
activation_epsilon = 50.0
weight_epsilon = 50.0
weights_epsilon = 100.0
call_timeout_s = 30.0

[sites.site-a]
[sites.site-b]
"""


def test_a_scenario_of_own_records_splits_into_regions_of_a_raw_column(tmp_path):
    """``split = "region"`` on the scenario's own records: the regions are cut on the column's
    raw values (age; standardising by the public set keeps their order), lowest first; a
    column that holds categories is refused, naming the key."""
    from scenarios.schema import load_scenario
    from scenarios.simulate import split_data

    write_csv(tmp_path / "recs.csv", records(200, seed=5), COLUMNS)
    region = SCENARIO.format(csv="recs.csv").replace('split = "iid"', 'split = "region"\nregion_feature = "{col}"')
    (tmp_path / "s.toml").write_text(region.replace("{col}", "age"))
    data = split_data(load_scenario(tmp_path / "s.toml"))
    (a, _), (b, _) = data.parts
    assert data.preprocessing.columns[0].name == "age" and abs(len(a) - len(b)) <= 1
    assert a[:, 0].max() <= b[:, 0].min()
    (tmp_path / "ward.toml").write_text(region.replace("{col}", "ward"))
    with pytest.raises(InvalidArgument) as e:
        split_data(load_scenario(tmp_path / "ward.toml"))
    assert e.value.field == "data.region_feature" and "numeric" in e.value.rule


def test_scenario_data_from_a_csv_is_split_and_prepared(tmp_path):
    from scenarios.schema import load_scenario
    from scenarios.simulate import split_data

    (tmp_path / "data").mkdir()
    write_csv(tmp_path / "data" / "recs.csv", records(200, seed=5), COLUMNS)
    (tmp_path / "s.toml").write_text(SCENARIO.format(csv="data/recs.csv"))
    sc = load_scenario(tmp_path / "s.toml")
    assert sc.data.path == str((tmp_path / "data" / "recs.csv").resolve()) and sc.data.dataset == "recs.csv"
    data = split_data(sc)
    assert len(data.y_test) == 50 and len(data.y_public) == 40 and sum(len(y) for _, y in data.parts) == 110
    assert data.architecture["input_dim"] == data.preprocessing.width == 7 and data.num_classes == 2
    # fitted on the public set only (shared by the sites; no protected record in it)
    assert data.preprocessing.fitted_on["rows"] == 40 and data.preprocessing.fitted_on["split"] == "public"
    age = data.preprocessing.columns[0]
    assert abs(float(data.x_public[:, 0].mean())) < 1e-5 and abs(float(data.x_public[:, 0].std()) - 1) < 1e-5
    assert age.name == "age" and abs(float(np.concatenate([x for x, _ in data.parts])[:, 0].mean())) > 1e-4
    (tmp_path / "bad.toml").write_text(SCENARIO.format(csv="nowhere.csv"))
    with pytest.raises(InvalidArgument, match=r"data\.path \(.*bad\.toml, line 7\): .*nowhere\.csv' is not a file"):
        load_scenario(tmp_path / "bad.toml")
    (tmp_path / "both.toml").write_text(
        SCENARIO.format(csv="data/recs.csv").replace("[data]\n", '[data]\ndataset = "digits"\n')
    )
    with pytest.raises(InvalidArgument, match=r"data\.dataset.*not both"):
        load_scenario(tmp_path / "both.toml")


@pytest.mark.slow
def test_simulate_runs_on_a_scenario_of_own_records(tmp_path):
    write_csv(tmp_path / "recs.csv", records(200, seed=5), COLUMNS)
    (tmp_path / "own.toml").write_text(SCENARIO.format(csv="recs.csv"))
    proc = cli("simulate", str(tmp_path / "own.toml"), "--out", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["scenario"]["data"]["dataset"] == "recs.csv"
    for name in ("site-a", "site-b"):
        s = report["sites"][name]
        assert s["rounds"]["ldp"]["status"] == "fused" and s["rounds"]["merged"]["status"] == "fused"
        assert 0.5 < s["own_accuracy"] <= 1.0
        manifest = json.loads((tmp_path / "out" / "sites" / name / "models" / "mlp.json").read_text())
        assert manifest["preprocessing"]["label"] == "outcome"
    assert "site-a" in proc.stdout
