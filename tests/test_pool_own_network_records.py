"""``privfusion pool train --from-model NAME --data FILE``: a DP-SGD pool of a site's OWN network
(its class in its own .py file, imported with ``privfusion model import``) on the site's OWN
records (CSV, Parquet, .npz files written here as a site writes them: the csv module, pandas,
numpy). The commands run as subprocesses, as a site runs them; the refusals run in-process
(``peer.cli.app.main``, the same code without a new interpreter), and so do the site's set-up
(``site new``, ``model import``), except one refusal that checks the exit status of the real
command.

The records are scikit-learn's digits (8x8 images, 10 classes), one column per pixel: a site's
table. The statistical checks: a chance-level classifier (accuracy 0.1 on 10 balanced classes)
scores above 0.1 + 4.5 standard deviations of a binomial proportion on m held-out records with
probability about 3e-6 (normal approximation), so "better than chance" is asserted at that
margin; the networks here score far above it (0.6-0.9), so the assertion fails falsely with
negligible probability (and the seeds are fixed).
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.base.errors import InvalidArgument

TABULAR_PY = '''\
"""Our network for the 64 pixel columns of a scanned digit (the hospital's own code)."""

import torch.nn.functional as F
from torch import nn


class TabularNet(nn.Module):
    def __init__(self, width=64, hidden=32, classes=10):
        super().__init__()
        self.inp = nn.Linear(width, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = F.relu(self.norm(self.inp(x)))
        h = F.relu(h + self.mid(h))
        return self.out(h)


def make_model():
    return TabularNet()
'''

CNN_PY = '''\
"""Our small CNN for 8x8 digit images (the hospital's own code)."""

import torch.nn.functional as F
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self, channels=8, classes=10):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(4 * channels, classes)

    def forward(self, x):
        return self.head(self.pool(F.relu(self.norm(self.conv(x)))).flatten(1))


def make_model():
    return DigitsCNN()
'''

PIXELS = [f"p{i}" for i in range(64)]
CHANCE = 0.1  # 10 balanced classes


def beats_chance(accuracy: float, m: int) -> bool:
    """accuracy above chance + 4.5 binomial standard deviations on m records (module docstring)."""
    return accuracy > CHANCE + 4.5 * math.sqrt(CHANCE * (1 - CHANCE) / m)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )
    if check:
        assert proc.returncode == 0, f"privfusion {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def run(capsys, *args: str) -> tuple[int, str]:
    """The command in-process: (exit status, stderr)."""
    from peer.cli.app import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, columns=PIXELS) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([*columns, "digit"])
        for row, label in zip(x, y, strict=True):
            w.writerow([*(int(v) for v in row[: len(columns)]), int(label)])
    return path


def import_network(site: Path, name: str, code: Path, shape: list[int]) -> None:
    module = {}
    exec(compile(code.read_text(), str(code), "exec"), module)  # the site's class, as its own scripts use it
    torch.manual_seed(3)
    weights = site / f"{name}.pt"
    torch.save(module["make_model"]().state_dict(), weights)
    from peer.cli.app import main  # in-process: the pools below are what runs as a site runs it

    argv = ["model", "import", "--site", str(site), "--name", name, "--factory", f"{code}:make_model",
            "--weights", str(weights), "--input-shape", *map(str, shape)]  # fmt: skip
    assert main(argv) == 0


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict:
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = d.data[order], d.target[order]
    root = tmp_path_factory.mktemp("own")
    code = root / "code"
    code.mkdir()
    (code / "tabular_net.py").write_text(TABULAR_PY)
    (code / "digits_cnn.py").write_text(CNN_PY)
    site = root / "site"
    from peer.cli.app import main

    assert main(["site", "new", "--name", "st-anne", "--dir", str(site), "--listen", "127.0.0.1:0", "--address", "127.0.0.1", "--adjacency", "replace-one"]) == 0  # fmt: skip
    import_network(site, "tab", code / "tabular_net.py", [64])
    import_network(site, "cnn", code / "digits_cnn.py", [1, 8, 8])
    return {
        "x": x,
        "y": y,
        "root": root,
        "site": site,
        "private": write_csv(root / "private.csv", x[:1200], y[:1200]),
        "public": write_csv(root / "public.csv", x[1200:1500], y[1200:1500]),
    }


def closed_form_epsilon(steps: int, noise: float, delta: float) -> float:
    """ε at δ of T full-batch Gaussian steps, replace-one: the clipped sum moves by at most 2C
    under noise σC, so the run is μ-GDP with μ = 2√T/σ (Dong, Roth & Su 2022), and
    δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    mu = 2 * math.sqrt(steps) / noise
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 500)


@pytest.fixture(scope="module")
def csv_pool(digits) -> dict:
    site = digits["site"]
    proc = cli("pool", "train", "--site", str(site), "--from-model", "tab", "--data", str(digits["private"]),
               "--label", "digit", "--public", str(digits["public"]), "--steps", "20",
               "--model", "name=a,noise=2,clip=1", "--model", "name=b,noise=6,clip=1", "--seed", "5", "--json")  # fmt: skip
    return {"out": json.loads(proc.stdout), "stderr": proc.stderr}


def test_csv_pool_of_own_network_trains_with_the_imported_paths_record(digits, csv_pool):
    from peer.dp.pools import load_pool, pool_preprocessing
    from peer.nn.imported import load_imported, structure_sha256

    site, out = digits["site"], csv_pool["out"]
    own = load_imported(site / "own_models", "tab")
    assert (
        "DP-SGD on 960 training records of private.csv (240 held out): declared dataset size n = 960"
        in (csv_pool["stderr"])
    )
    assert "inputs of tab: rows of 64 entries, as they are" in csv_pool["stderr"]
    assert out["pool"] == str(site / "pool") and out["pool_name"] == "dpsgd"  # where site.toml says
    assert out["architecture"] == {"kind": "imported", "structure_sha256": structure_sha256(own.structure)}
    assert out["dataset_size"] == 960 and out["norm_statistics"] == "public records"
    pool = load_pool(site / "pool")
    assert [m.name for m in pool] == ["a", "b"]
    for m, (name, noise) in zip(pool, (("a", 2.0), ("b", 6.0)), strict=True):
        record = m.metadata["record"]
        params = record["parameters"]
        assert (record["mechanism"], record["level"], record["unit"]) == ("dpsgd", "data", "record:replace-one")
        assert record["subject"] == name and record["randomness"] == "fixed-seed"
        assert m.metadata["training"] == {
            "adjacency": "replace-one",
            "steps": [
                {"clip_norm": 1.0, "count": 20, "learning_rate": 4.0, "noise_multiplier": noise, "sample_rate": 1.0}
            ],
        }
        assert params["dataset_size"] == 960 and m.dataset_size == 960 and params["init_seed"] == 0
        assert params["architecture"]["structure_sha256"] == structure_sha256(own.structure)
        assert params["norm_layers"] == "eval mode; BatchNorm statistics measured on public records before every step"
        # full batch: the accountant's PLD is the Gaussian's exactly (up to its discretisation)
        assert record["epsilon"] == pytest.approx(closed_form_epsilon(20, noise, 1e-5), rel=2e-3)
        assert list(m.arrays) == list(own.structure.parameters)  # the site's key names, in its order
        assert m.metadata["data"]["file"] == "private.csv" and m.metadata["data"]["training_rows"] == 960
    by_name = {r["name"]: r for r in out["models"]}
    print("csv validation accuracies", {k: r["validation_accuracy"] for k, r in by_name.items()})
    assert beats_chance(by_name["a"]["validation_accuracy"], 240)
    assert beats_chance(by_name["b"]["validation_accuracy"], 240)
    prep = pool_preprocessing(site / "pool")  # stored with every model, fitted on the public file only
    assert prep.fitted_on["split"] == "public" and prep.fitted_on["file"] == "public.csv" and prep.width == 64
    # the pool trains nothing into the ledger: its merges are what a site releases (and charges)
    assert not (site / "ledger.sqlite").exists()


def test_csv_pool_is_exactly_the_imported_paths_training(digits, csv_pool):
    """Model a, rebuilt from the library calls the imported pool path documents (the same
    records, split, preprocessing, public statistics and noise stream), is bit for bit the
    stored one."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.pools import load_pool
    from peer.dp.training import train_dpsgd_module
    from peer.nn.architectures import torch_threads
    from peer.nn.imported import imported_architecture, load_factory, load_imported
    from peer.nn.tables import prepare_records

    own = load_imported(digits["site"] / "own_models", "tab")
    records = prepare_records(digits["private"], label="digit", public=digits["public"])
    prep = records.preprocessing
    public_x, _ = prep.transform(prep.read(digits["public"], labelled=False))
    with torch_threads(1):  # as the command runs: one thread sums in one order
        model = train_dpsgd_module(
            load_factory(own.factory),
            imported_architecture(own.structure),
            own.structure.input_shape,
            records.x_train,
            records.y_train,
            TrainingRecord.constant("replace-one", 20, 4.0, 1.0, 2.0, 1.0),
            init_seed=0,
            randomness=make_randomness(5).spawn(),
            delta=1e-5,
            public_x=public_x,
        )
    (stored,) = [m for m in load_pool(digits["site"] / "pool") if m.name == "a"]
    for k in own.structure.parameters:
        np.testing.assert_array_equal(stored.arrays[k], model.arrays[k], err_msg=k)


def test_the_pool_is_served_and_judged_on_public_records(digits, csv_pool):
    """`probe make --pool` prepares the public validation set as the pool's models take their
    inputs, and the daemon's own check of the site then serves every file."""
    site = digits["site"]
    cli("probe", "make", "--site", str(site), "--data", str(digits["public"]), "--label", "digit", "--pool", "dpsgd")  # fmt: skip
    with np.load(site / "validation.npz") as v:
        assert v["x"].shape == (300, 64) and v["y"].shape == (300,)
    # the pool was trained with --seed: as a --simulation daemon serves it
    proc = cli("site", "check", "--site", str(site), "--json", "--simulation", check=False)
    assert proc.returncode in (0, 1), proc.stderr  # 1: the daemon would leave out some other file
    unusable = json.loads(proc.stdout)
    assert not [u for u in unusable if "pool" in u["path"]], (unusable, proc.stdout)


def test_a_local_merge_of_the_pool_is_stored_as_the_sites_own_network(digits, csv_pool, tmp_path):
    """`privfusion merge` on a pool of an own network (RS at a target between the two models'
    ε): the merge is written as an imported model under the site's key names — one of the
    pool's models exactly, as RS releases — with its record beside it."""
    from peer.dp.pools import load_pool
    from peer.nn.imported import load_imported

    site = digits["site"]
    pool = {m.name: m for m in load_pool(site / "pool")}
    if not (site / "validation.npz").exists():  # public records judge the candidates
        cli("probe", "make", "--site", str(site), "--data", str(digits["public"]), "--label", "digit", "--pool", "dpsgd")  # fmt: skip
    out = tmp_path / "merged" / "m.safetensors"
    proc = cli("merge", "--pool", str(site / "pool"), "--method", "rs", "--target-epsilon", "30", "--delta", "1e-5",
               "--selection", "utility", "--validation", str(site / "validation.npz"), "--out", str(out), "--seed", "1", "--json")  # fmt: skip
    result = json.loads(proc.stdout)
    merged = load_imported(out.parent, "m")
    assert list(merged.structure.parameters) == list(pool["a"].arrays)  # the site's names, in its order
    assert set(merged.arrays) == set(pool["a"].arrays)
    drawn = [n for n, m in pool.items() if all(np.array_equal(merged.arrays[k], m.arrays[k]) for k in m.arrays)]
    assert len(drawn) == 1
    assert merged.metadata["record"]["mechanism"] == result["record"]["mechanism"] == "rs-merge"
    assert json.loads((out.parent / "m.record.json").read_text())["epsilon"] <= 30 + 1e-9


def test_parquet_table_reshaped_into_a_cnn_and_npz_images(digits, tmp_path):
    import pandas as pd

    from peer.dp.pools import load_pool

    site = digits["site"]
    x, y = digits["x"], digits["y"]
    frame = pd.DataFrame(x[:1200].astype(np.int64), columns=PIXELS).assign(digit=y[:1200])
    frame.to_parquet(tmp_path / "private.parquet")
    pd.DataFrame(x[1200:1500].astype(np.int64), columns=PIXELS).assign(digit=y[1200:1500]).to_parquet(
        tmp_path / "public.parquet"
    )
    proc = cli("pool", "train", "--site", str(site), "--from-model", "cnn", "--data", str(tmp_path / "private.parquet"),
               "--label", "digit", "--public", str(tmp_path / "public.parquet"), "--out", str(tmp_path / "pq"),
               "--steps", "20", "--model", "name=c,noise=2,clip=1", "--seed", "1", "--json")  # fmt: skip
    assert "rows of 64 numeric columns reshaped to [1, 8, 8] (row-major, in column order)" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["input_shape"] == [1, 8, 8] and out["dataset_size"] == 960
    print("parquet cnn validation accuracy", out["models"][0]["validation_accuracy"])
    assert beats_chance(out["models"][0]["validation_accuracy"], 240)
    (m,) = load_pool(tmp_path / "pq")
    assert m.metadata["data"]["file"] == "private.parquet" and m.metadata["training"]["steps"][0]["count"] == 20

    # .npz images of the network's own shape go in as they are
    np.savez(tmp_path / "private.npz", x=x[:1200].reshape(-1, 1, 8, 8).astype(np.float32), y=y[:1200])
    np.savez(tmp_path / "public.npz", x=x[1200:1500].reshape(-1, 1, 8, 8).astype(np.float32), y=y[1200:1500])
    proc = cli("pool", "train", "--site", str(site), "--from-model", "cnn", "--data", str(tmp_path / "private.npz"),
               "--label", "y", "--public", str(tmp_path / "public.npz"), "--out", str(tmp_path / "npz"),
               "--steps", "20", "--model", "name=c,noise=2,clip=1", "--seed", "1", "--json")  # fmt: skip
    assert "inputs of cnn: images of shape [1, 8, 8], as they are" in proc.stderr
    npz_accuracy = json.loads(proc.stdout)["models"][0]["validation_accuracy"]
    print("npz cnn validation accuracy", npz_accuracy)
    assert beats_chance(npz_accuracy, 240)


def test_bad_records_are_refused_naming_file_column_and_row(digits, tmp_path, capsys):
    site, x, y = digits["site"], digits["x"], digits["y"]
    common = ("pool", "train", "--site", str(site), "--from-model", "tab", "--out", str(tmp_path / "p"), "--steps", "2")
    public = ("--public", str(digits["public"]))

    # the real command: exit status 2 and one line naming the file and the missing column
    proc = cli(*common, "--data", str(digits["private"]), "--label", "outcome", *public, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "public.csv" in proc.stderr and "'outcome'" in proc.stderr and "Traceback" not in proc.stderr

    # a NaN cell: the file, the column and the row
    bad = write_csv(tmp_path / "holes.csv", x[:200], y[:200])
    lines = bad.read_text().splitlines()
    cells = lines[37].split(",")
    cells[10] = "NaN"  # data row 37, column p10
    lines[37] = ",".join(cells)
    bad.write_text("\n".join(lines) + "\n")
    code, err = run(capsys, *common, "--data", str(bad), "--label", "digit", *public)
    assert code == 2
    assert "holes.csv, column 'p10', data row 37 (spreadsheet row 38)" in err and "missing" in err

    # the wrong width: 63 pixel columns for a network of 64 inputs
    narrow = {k: write_csv(tmp_path / f"{k}63.csv", v[0], v[1], PIXELS[:63]) for k, v in
              {"private": (x[:300], y[:300]), "public": (x[300:400], y[300:400])}.items()}  # fmt: skip
    code, err = run(capsys, *common, "--data", str(narrow["private"]), "--label", "digit", "--public",
                    str(narrow["public"]))  # fmt: skip
    assert code == 2
    assert f"{narrow['private']}: features" in err and "63 input entries" in err and "input shape [64] = 64" in err

    # a table with a categorical (one-hot) column is no image: refused for the CNN, by rule
    cat_private, cat_public = tmp_path / "cat.csv", tmp_path / "catpub.csv"
    for path, rows in ((cat_private, slice(0, 300)), (cat_public, slice(300, 400))):
        # 62 pixels and a two-category column: 64 entries, two of them one-hot
        frame_rows = [[*map(int, r[:62]), "AB"[int(r[63]) % 2], int(label)] for r, label in zip(x[rows], y[rows], strict=True)]  # fmt: skip
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([[*PIXELS[:62], "scanner", "digit"], *frame_rows])
    code, err = run(capsys, "pool", "train", "--site", str(site), "--from-model", "cnn", "--out", str(tmp_path / "q"),
                    "--data", str(cat_private), "--label", "digit", "--public", str(cat_public))  # fmt: skip
    assert code == 2 and "takes input shape [1, 8, 8]" in err and "['scanner'] are categorical" in err

    # images of another shape are never reshaped into the network's
    np.savez(tmp_path / "wide.npz", x=x[:300].reshape(-1, 4, 16).astype(np.float32), y=y[:300])
    np.savez(tmp_path / "widepub.npz", x=x[300:400].reshape(-1, 4, 16).astype(np.float32), y=y[300:400])
    code, err = run(capsys, "pool", "train", "--site", str(site), "--from-model", "cnn", "--out", str(tmp_path / "r"),
                    "--data", str(tmp_path / "wide.npz"), "--label", "y", "--public", str(tmp_path / "widepub.npz"))  # fmt: skip
    assert code == 2 and "wide.npz: x: holds images of shape [1, 4, 16]" in err and "takes [1, 8, 8]" in err

    # the existing --data rules hold here too: public preprocessing, no second architecture
    code, err = run(capsys, *common, "--data", str(digits["private"]), "--label", "digit")
    assert code == 2 and "--public: a DP pool's preprocessing must not come from its protected records" in err
    code, err = run(capsys, *common, "--data", str(digits["private"]), "--label", "digit", *public, "--arch", "{}")
    assert code == 2 and "--architecture" in err
    code, err = run(capsys, "pool", "train", "--site", str(site), "--from-model", "nope", "--out",
                    str(tmp_path / "p"), "--data", str(digits["private"]), "--label", "digit", *public)  # fmt: skip
    assert code == 2 and "model 'nope' is not in the store" in err
    assert not any((tmp_path / d).exists() for d in ("p", "q", "r"))  # nothing was written


def test_the_shape_rule_in_process():
    """records_fit_network's rule on preprocessings built directly (no training)."""
    from peer.nn.imported import records_fit_network
    from peer.nn.tables import ColumnPrep, Preprocessing

    def prep(width: int, shape=None, categorical=False):
        cols = [ColumnPrep(f"c{i}", "numeric", 0.0, 1.0) for i in range(width)]
        if categorical:
            cols[-1] = ColumnPrep(f"c{width - 1}", "categorical", categories=("a",))
        return Preprocessing("y", (0, 1), tuple(cols), "refuse", shape, {})

    class Structure:
        def __init__(self, shape):
            self.input_shape = shape

    assert "as they are" in records_fit_network(Structure((64,)), prep(64), "f.csv", "n")
    assert "flattened" in records_fit_network(Structure((64,)), prep(64, (1, 8, 8)), "f.npz", "n")
    assert "reshaped to [1, 8, 8]" in records_fit_network(Structure((1, 8, 8)), prep(64), "f.csv", "n")
    assert "one-hot categories included" in _refusal(records_fit_network, Structure((63,)), prep(64, categorical=True))
    assert "categorical" in _refusal(records_fit_network, Structure((1, 8, 8)), prep(64, categorical=True))
    assert "scramble" in _refusal(records_fit_network, Structure((1, 8, 8)), prep(64, (4, 4, 4)))


def _refusal(fn, *args) -> str:
    with pytest.raises(InvalidArgument) as e:
        fn(*args, "f", "n")
    return str(e.value)


def test_a_given_preprocessing_from_an_own_network_pool_and_no_public_records(digits, csv_pool, tmp_path, capsys):
    """--preprocessing may name a model manifest of a pool of an own network (it holds the
    preprocessing); with no public records BatchNorm keeps its initial statistics, and the
    record and the summary say so."""
    from peer.cli.app import main
    from peer.dp.pools import load_pool

    site = digits["site"]
    capsys.readouterr()
    argv = ["pool", "train", "--site", str(site), "--from-model", "tab", "--data", str(digits["private"]), "--label",
            "digit", "--preprocessing", str(site / "pool" / "a.json"), "--out", str(tmp_path / "given"), "--steps",
            "3", "--model", "name=g,noise=3,clip=1", "--seed", "2", "--json"]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "its statistics stay at their initial values" in captured.err
    out = json.loads(captured.out)
    assert (
        out["norm_statistics"] == "initial values"
        and out["data"]["preprocessing"] == "fitted on public records (public.csv)"
    )
    (m,) = load_pool(tmp_path / "given")
    assert (
        m.metadata["record"]["parameters"]["norm_layers"]
        == "eval mode: running statistics frozen at their initial values"
    )
