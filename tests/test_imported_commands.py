"""Every command takes a site's imported network, as a new user runs them (``privfusion``
subprocesses on a site made by ``site new``, records written as CSV files here): ``model
import --data`` stores the preprocessing ``model train`` would, ``model export`` keeps it,
``evaluate`` and ``probe make`` take the network, a probe set is bound to the input a model
reads (a round refuses one made for another column order), and a round prints where its fused
model is."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_harness import cli
from safetensors.numpy import load_file, save_file

NET_PY = """
import torch
from torch import nn


class Clinic(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(torch.relu(self.enc(x)))


def build():
    return Clinic()
"""

COLUMNS = ["a", "b", "c", "d"]
IMPORT = ("model", "import", "--site")


def write_records(path: Path, n: int, seed: int) -> np.ndarray:
    """``n`` records a, b, c, d (different scales, so that standardisation matters) and a binary
    outcome depending on a and b; returns the raw feature matrix."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)) * [1.0, 5.0, 10.0, 2.0] + [0.0, 50.0, 100.0, 3.0]
    y = ((x[:, 0] + (x[:, 1] - 50.0) / 5.0 + 0.3 * rng.normal(size=n)) > 0).astype(int)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*COLUMNS, "outcome"])
        for row, label in zip(x, y, strict=True):
            w.writerow([*(f"{v:.6f}" for v in row), int(label)])
    return np.round(x, 6)


def run(*args: str) -> str:
    """``privfusion ARGS`` in this process (the steps around the command a test is about: a
    subprocess per step would cost seconds each on a loaded machine); its stdout."""
    import contextlib
    import io

    from peer.cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def refused(*args: str) -> str:
    """``privfusion ARGS`` in this process, which must fail with a usage error; its stderr."""
    import contextlib
    import io

    from peer.cli.app import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(list(args)) == 2
    return err.getvalue()


def make_site(tmp_path: Path, name: str = "a", port: int = 50901) -> Path:
    site = tmp_path / name
    run("site", "new", "--name", name, "--dir", str(site), "--listen", f"127.0.0.1:{port}")
    return site


@pytest.fixture
def setting(tmp_path):
    """A site, its records (train.csv), public records (public.csv), the factory file and a
    state dict trained here on the records as the site would (its own standardisation)."""
    site = make_site(tmp_path)
    x = write_records(tmp_path / "train.csv", 300, seed=1)
    write_records(tmp_path / "public.csv", 80, seed=2)
    (tmp_path / "net.py").write_text(NET_PY)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_test_clinic_net", tmp_path / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    module = mod.build()
    xs = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)
    ys = torch.tensor(np.array([int(r["outcome"]) for r in csv.DictReader((tmp_path / "train.csv").open())]))
    opt = torch.optim.Adam(module.parameters(), 1e-2)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(xs), ys).backward()
        opt.step()
    torch.save(module.state_dict(), tmp_path / "w.pt")
    return tmp_path, site, mod


def import_own(tmp: Path, site: Path, name: str, *extra: str, subprocess: bool = False) -> dict:
    out = (cli if subprocess else run)(
        "model",
        "import",
        "--site",
        str(site),
        "--name",
        name,
        "--factory",
        f"{tmp / 'net.py'}:build",
        "--weights",
        str(tmp / "w.pt"),
        *extra,
        "--json",
    )
    return json.loads(out.stdout if subprocess else out)


def prepared_by_hand(manifest: dict, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Raw CSV rows standardised by the manifest's stored statistics, column by column, in the
    stored column order: an independent reading of what the preprocessing means."""
    rows = list(csv.DictReader(path.open()))
    cols = manifest["preprocessing"]["columns"]
    return np.array(
        [[(float(r[c["name"]]) - c["mean"]) / c["std"] for c in cols] for r in rows], dtype=np.float32
    ), np.array([int(r["outcome"]) for r in rows])


def outputs(mod, manifest_dir: Path, name: str, x: np.ndarray) -> np.ndarray:
    from safetensors.torch import load_file as load_torch

    module = mod.build().eval()
    module.load_state_dict(load_torch(str(manifest_dir / f"{name}.safetensors")))
    with torch.no_grad():
        return torch.softmax(module(torch.as_tensor(x)).double(), dim=1).numpy()


def test_model_import_fits_the_table_preprocessing_on_the_training_split(setting):
    """``--data --label --features`` store what ``model train`` stores: the columns in the
    given order and standardisation of the training split only (the documented stratified split
    of ``--split-seed``), plus held-out accuracy."""
    from peer.nn.tables import split_indices

    tmp, site, _ = setting
    data = ("--data", str(tmp / "train.csv"), "--label", "outcome")
    out = import_own(tmp, site, "own", *data, "--features", "d", "a", "c", "b", subprocess=True)
    assert out["preprocessing"]["inputs"] == "d, a, c, b"
    prep = json.loads((site / "own_models" / "own.json").read_text())["preprocessing"]
    assert [c["name"] for c in prep["columns"]] == ["d", "a", "c", "b"]
    rows = list(csv.DictReader((tmp / "train.csv").open()))
    raw = np.array([[float(r[c]) for c in ("d", "a", "c", "b")] for r in rows])
    train, held = split_indices(len(rows), np.array([r["outcome"] for r in rows]), 0.2, 0)
    assert len(train) == 240 and len(held) == 60 and prep["fitted_on"]["rows"] == 240
    np.testing.assert_allclose([c["mean"] for c in prep["columns"]], raw[train].mean(0), rtol=1e-12)
    np.testing.assert_allclose([c["std"] for c in prep["columns"]], raw[train].std(0), rtol=1e-12)
    assert set(out["accuracy"]) == {"training", "validation"}

    # columns the network does not take: refused, naming the rule and the flag, nothing stored
    err = refused(*IMPORT, str(site), "--name", "bad", "--factory", f"{tmp / 'net.py'}:build", "--weights",
                  str(tmp / "w.pt"), *data, "--features", "a", "b", "c")  # fmt: skip
    assert "takes input shape [4]" in err and "--features" in err
    assert not (site / "own_models" / "bad.json").exists()


def test_evaluate_scores_an_imported_network_with_the_table_iv_metrics(setting):
    """Same metrics as a built-in model: accuracy, macro/weighted F1, macro recall/precision,
    AUROC, confusion matrix — each equal to scikit-learn on the network's own outputs for rows
    prepared by hand from the stored statistics."""
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_score, recall_score, roc_auc_score

    tmp, site, mod = setting
    public = ("--data", str(tmp / "public.csv"), "--label", "outcome")
    assert "own_models" in refused("evaluate", "--site", str(site), "--model", "nothing", *public)
    import_own(tmp, site, "own", "--data", str(tmp / "train.csv"), "--label", "outcome")
    got = json.loads(cli("evaluate", "--site", str(site), "--model", "own", *public, "--json").stdout)
    assert got["kind"] == "imported model" and got["records"] == 80
    x, y = prepared_by_hand(json.loads((site / "own_models" / "own.json").read_text()), tmp / "public.csv")
    proba = outputs(mod, site / "own_models", "own", x)
    pred = proba.argmax(1)
    assert got["accuracy"] == pytest.approx(accuracy_score(y, pred))
    assert got["macro_f1"] == pytest.approx(f1_score(y, pred, average="macro"))
    assert got["weighted_f1"] == pytest.approx(f1_score(y, pred, average="weighted"))
    assert got["macro_recall"] == pytest.approx(recall_score(y, pred, average="macro"))
    assert got["macro_precision"] == pytest.approx(precision_score(y, pred, average="macro", zero_division=0))
    assert got["auroc"] == pytest.approx(roc_auc_score(y, proba[:, 1]))
    assert got["confusion_matrix"] == confusion_matrix(y, pred).tolist()
    assert got["accuracy"] > 0.8  # the network learned the rule: its inputs were prepared as in training

    # imported without a preprocessing: a clear refusal naming how to give one
    import_own(tmp, site, "bare")
    err = refused("evaluate", "--site", str(site), "--model", "bare", *public)
    assert "holds no preprocessing" in err and "--data FILE --label COL" in err
    lent = json.loads(
        run("evaluate", "--site", str(site), "--model", "bare", *public, "--preprocessing-from", "own", "--json")
    )
    assert lent["preprocessing"] == "the site's model 'own'" and lent["records"] == 80


def test_export_keeps_the_preprocessing_and_an_import_elsewhere_predicts_the_same(setting, tmp_path):
    tmp, site, mod = setting
    import_own(
        tmp, site, "own", "--data", str(tmp / "train.csv"), "--label", "outcome", "--features", "c", "a", "b", "d"
    )
    out = tmp / "export" / "own.pt"
    export = ("model", "export", "--site", str(site), "--model", "own", "--format", "pt", "--out", str(out))
    printed = cli(*export).stdout
    sidecar = out.with_name("own.pt.preprocessing.json")
    assert str(sidecar) in printed and "not differentially private" in printed
    stored = json.loads((site / "own_models" / "own.json").read_text())["preprocessing"]
    assert json.loads(sidecar.read_text()) == stored
    assert "never overwrites" in refused(*export)

    other = make_site(tmp_path, "b", 50902)
    run(*IMPORT, str(other), "--name", "theirs", "--factory", f"{tmp / 'net.py'}:build", "--weights", str(out),
        "--preprocessing", str(sidecar))  # fmt: skip
    moved = json.loads((other / "own_models" / "theirs.json").read_text())["preprocessing"]
    assert moved == stored
    x, _ = prepared_by_hand({"preprocessing": moved}, tmp / "public.csv")
    np.testing.assert_array_equal(
        outputs(mod, other / "own_models", "theirs", x), outputs(mod, site / "own_models", "own", x)
    )
    public = ("--data", str(tmp / "public.csv"), "--label", "outcome", "--json")
    scores = [
        json.loads(run("evaluate", "--site", str(s), "--model", m, *public))
        for s, m in ((site, "own"), (other, "theirs"))
    ]
    for key in ("accuracy", "macro_f1", "weighted_f1", "auroc", "confusion_matrix"):
        assert scores[0][key] == scores[1][key]


def test_probe_make_for_an_imported_network_records_the_input_it_reads(setting):
    tmp, site, _ = setting
    import_own(tmp, site, "bare")
    err = refused("probe", "make", "--site", str(site), "--model", "bare", "--data", str(tmp / "public.csv"))
    assert "imported without a preprocessing" in err and "architecture" not in err

    import_own(
        tmp, site, "own", "--data", str(tmp / "train.csv"), "--label", "outcome", "--features", "b", "a", "d", "c"
    )
    probe_make = ("probe", "make", "--site", str(site), "--data", str(tmp / "public.csv"))
    made = json.loads(cli(*probe_make, "--model", "own", "--rows", "30", "--seed", "5", "--json").stdout)
    assert made["probe"]["rows"] == 30 and made["probe"]["served"] == "model own"
    x, _ = prepared_by_hand(json.loads((site / "own_models" / "own.json").read_text()), tmp / "public.csv")
    chosen = np.sort(np.random.default_rng(5).choice(80, size=30, replace=False))
    np.testing.assert_allclose(load_file(str(site / "probe.safetensors"))["x"], x[chosen], rtol=1e-5, atol=1e-6)
    from peer.nn.probes import read_probe

    probe = read_probe(site / "probe.safetensors")
    assert probe.model == "own"
    assert probe.signature == {"kind": "table", "columns": [[c, "numeric", 1] for c in "badc"], "width": 4}
    # without --model: the site's only network with a preprocessing
    assert json.loads(run(*probe_make, "--force", "--json"))["probe"]["served"] == "model own"


def _round_file(tmp: Path, site: Path, other: Path, model: str) -> Path:
    roster = tmp / "roster.toml"
    roster.write_text(
        "".join(
            f'[sites.{s.name}]\naddress = "127.0.0.1:{port}"\ncertificate = "{s / "identity" / "site.crt"}"\n\n'
            for s, port in ((site, 50901), (other, 50902))
        )
    )
    r = tmp / "round.toml"
    r.write_text(f'[round]\nroster = "{roster}"\nmodel = "{model}"\nquorum = 2\nmethod = "ldp"\n')
    return r


def test_a_probe_set_is_bound_to_the_input_its_model_reads_in_a_round(setting, tmp_path):
    """A round's matching and REPAIR run on the site's probe set: one made for another column
    order is refused before anything is asked of a peer, naming both inputs; one made for the
    round's model is used; one written before probe sets recorded their input is used as before."""
    from coordinator_free.runner import load_local_site
    from peer.base.errors import FailedPrecondition

    tmp, site, _ = setting
    other = make_site(tmp_path, "b", 50902)
    data = ("--data", str(tmp / "train.csv"), "--label", "outcome")
    import_own(tmp, site, "abcd", *data)
    import_own(tmp, site, "dcba", *data, "--features", "d", "c", "b", "a")
    probe_make = ("probe", "make", "--site", str(site), "--data", str(tmp / "public.csv"))
    run(*probe_make, "--model", "abcd")
    round_file = _round_file(tmp, site, other, "dcba")
    proc = cli("round", "--config", str(site / "site.toml"), "--round", str(round_file), check=False)
    assert proc.returncode == 2, proc.stderr
    assert "table columns a, b, c, d" in proc.stderr and "table columns d, c, b, a" in proc.stderr
    assert "'dcba'" in proc.stderr and "the same columns in another order" in proc.stderr
    assert not (site / "rounds").exists()

    assert load_local_site(site / "site.toml", "abcd").probe.shape == (80, 4)  # the model it was made for
    run(*probe_make, "--model", "dcba", "--force")
    x = load_file(str(site / "probe.safetensors"))["x"]
    np.testing.assert_array_equal(load_local_site(site / "site.toml", "dcba").probe, x)
    with pytest.raises(FailedPrecondition, match="table columns d, c, b, a"):
        load_local_site(site / "site.toml", "abcd")
    # a probe file of the previous version (tensor x only) still reads, unchecked
    save_file({"x": x}, str(site / "probe.safetensors"))
    np.testing.assert_array_equal(load_local_site(site / "site.toml", "abcd").probe, x)


def test_a_round_prints_where_the_fused_model_of_an_imported_network_is(tmp_path):
    """A round on a site's own network writes its fused model to the site's own store
    (own_models), and the line ``privfusion round`` prints names that file (it named OUT/models,
    where nothing was); the fused model keeps the preprocessing of the site's network (it is
    aligned to it and reads its input), so that ``evaluate`` takes it as it is."""
    from peer_harness import make_site as harness_site
    from peer_harness import pin_each_other, roster_of, running
    from site_models import networks
    from site_models.networks import randomise

    from peer.nn.imported import import_model

    probe = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    a = harness_site(tmp_path, "st-anne", probe=probe, activation_clip=(-4.0, 4.0))
    b = harness_site(tmp_path, "riverside", activation_clip=(-4.0, 4.0))
    pin_each_other(a, b)
    from peer.cli.model_import import load_own
    from peer.nn.tables import Preprocessing, read_table

    records = tmp_path / "records.csv"
    rng = np.random.default_rng(4)
    records.write_text(
        ",".join([*(f"c{i}" for i in range(64)), "y"])
        + "\n"
        + "".join(",".join([*(f"{v:.4f}" for v in rng.normal(size=64)), str(k % 10)]) + "\n" for k in range(40))
    )
    prep = Preprocessing.fit(read_table(records, label="y"))
    factory = f"{Path(networks.__file__)}:clinic_mlp"
    for site, seed in ((a, 1), (b, 2)):
        import_model(
            site.root / "own_models", "clinic", randomise(networks.clinic_mlp(), seed), [64], factory=factory,
            preprocessing=prep,
        )  # fmt: skip
    with running(b) as (_, address):
        roster_of(tmp_path / "roster.toml", {"st-anne": "127.0.0.1:1", "riverside": address}, a, b)
        (a.root / "round.toml").write_text(
            f'[round]\nroster = "{tmp_path / "roster.toml"}"\nmodel = "clinic"\nquorum = 2\nmethod = "ldp"\n'
            "[round.features]\nactivation_epsilon = 100.0\nweight_epsilon = 100.0\nactivation_clip = [-4.0, 4.0]\n"
            '[round.weights]\nepsilon = 100.0\ndelta = 1e-5\n[round.repair]\ndata = "off"\n'
        )
        proc = cli("round", "--config", str(a.config), "--round", str(a.root / "round.toml"))
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("round ")]
    printed = Path(line.split(" -> ", 1)[1].split(";", 1)[0])
    assert printed.parent == a.root / "own_models", line
    assert (
        printed.with_name(printed.name + ".json").is_file()
        and printed.with_name(printed.name + ".safetensors").is_file()
    )
    assert not (a.root / "rounds" / "models").exists()
    assert load_own(str(a.root), printed.name).preprocessing == prep
    scores = json.loads(
        run(
            "evaluate", "--site", str(a.root), "--model", printed.name, "--data", str(records), "--label", "y", "--json"
        )
    )
    assert scores["kind"] == "imported model" and scores["records"] == 40


def test_an_imported_image_network_is_evaluated_probed_exported_and_moved_with_its_preprocessing(tmp_path):
    """The image side of the same commands (in this process: the table tests run them as
    subprocesses): import --data FOLDER fits the image preprocessing, evaluate and probe make take
    the network, the probe records the images' channels and size, and export + import elsewhere
    give the same outputs on the same raw images."""
    from test_images import digits_images, write_folder

    from peer.cli.model_import import load_own, own_predict_proba
    from peer.nn.probes import read_probe

    pixels, labels = digits_images(36, seed=3)
    folder = write_folder(tmp_path / "scans", pixels, labels)
    (tmp_path / "cnn.py").write_text(
        "from site_models.networks import SmallResNet\n\ndef build():\n    return SmallResNet(n_out=3)\n"
    )
    from site_models.networks import SmallResNet, randomise

    torch.save(randomise(SmallResNet(n_out=3), 7).state_dict(), tmp_path / "cnn.pt")
    site = make_site(tmp_path, "a")
    shape = ("--input-shape", "1", "8", "8")
    run(*IMPORT, str(site), "--name", "cnn", "--factory", f"{tmp_path / 'cnn.py'}:build", "--weights",
        str(tmp_path / "cnn.pt"), *shape, "--data", str(folder))  # fmt: skip
    scores = json.loads(run("evaluate", "--site", str(site), "--model", "cnn", "--data", str(folder), "--json"))
    assert scores["kind"] == "imported model" and scores["records"] == 36 and len(scores["confusion_matrix"]) == 3
    run("probe", "make", "--site", str(site), "--model", "cnn", "--data", str(folder))
    assert read_probe(site / "probe.safetensors").signature == {
        "kind": "images",
        "channels": 1,
        "size": [8, 8],
        "width": 64,
    }

    out = tmp_path / "cnn-export.safetensors"
    run("model", "export", "--site", str(site), "--model", "cnn", "--format", "safetensors", "--out", str(out))
    other = make_site(tmp_path, "b", 50902)
    run(*IMPORT, str(other), "--name", "cnn", "--factory", f"{tmp_path / 'cnn.py'}:build", "--weights", str(out),
        *shape, "--preprocessing", str(out.with_name(out.name + ".preprocessing.json")))  # fmt: skip
    here, there = load_own(str(site), "cnn"), load_own(str(other), "cnn")
    assert here.preprocessing == there.preprocessing
    x, _ = there.preprocessing.transform(there.preprocessing.read(folder))
    np.testing.assert_array_equal(own_predict_proba(str(other), there, x), own_predict_proba(str(site), here, x))
    moved = json.loads(run("evaluate", "--site", str(other), "--model", "cnn", "--data", str(folder), "--json"))
    assert moved["confusion_matrix"] == scores["confusion_matrix"]
