"""``privfusion pool train`` with an optimiser on the privatised gradient (``--optimizer`` for every
model, ``optimizer=...`` and its constants per ``--model``): the record names it, the pool reads
it back, ε is that of the same steps with SGD, and bad options are refused naming the entry."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from peer.cli.app import main
from peer.dp.accounting import Optimizer
from peer.dp.pools import load_pool

TINY_PY = '''\
"""A site's own small network for 8x8 digits."""

import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(4)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.pool(F.relu(self.norm(self.conv(x)))).flatten(1))


def make_model():
    return Tiny()
'''


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pool_train_records_each_models_optimizer(tmp_path, capsys):
    pool = tmp_path / "pool"
    code, out, err = _run(
        capsys,
        "pool", "train", "--out", str(pool), "--steps", "4", "--seed", "2", "--optimizer", "momentum",
        "--model", "name=a,noise=3,clip=1,optimizer=adam,lr=0.03,beta2=0.99",
        "--model", "name=b,noise=3,clip=1",
        "--model", "name=c,noise=3,clip=1,optimizer=sgd",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    models = {m["name"]: m for m in json.loads(out)["models"]}
    assert models["a"]["training"]["optimizer"] == {"name": "adam", "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
    assert models["b"]["training"]["optimizer"] == {"name": "momentum", "momentum": 0.9}  # the --optimizer default
    assert "optimizer" not in models["c"]["training"]
    # post-processing: the same steps give the same ε whatever the optimiser
    assert models["a"]["epsilon"] == models["b"]["epsilon"] == models["c"]["epsilon"]
    stored = json.loads((pool / "a.json").read_text())["metadata"]
    assert stored["record"]["parameters"]["training"]["optimizer"]["name"] == "adam"
    assert "beta1" in stored["record"]["parameters"]["update"]
    read = {m.name: m.privacy.optimizer for m in load_pool(pool)}
    assert read == {
        "a": Optimizer.of("adam", beta2=0.99),
        "b": Optimizer.of("momentum"),
        "c": Optimizer(),
    }


@pytest.mark.parametrize(
    ("spec", "field", "rule"),
    [
        ("noise=3,clip=1,optimizer=rmsprop", "model[0].optimizer", "must be one of"),
        ("noise=3,clip=1,optimizer=adam,momentum=0.5", "model[0].momentum", "is not a parameter of 'adam'"),
        ("noise=3,clip=1,beta1=0.5", "model[0].beta1", "is not a parameter of 'sgd'"),
        ("noise=3,clip=1,optimizer=momentum,momentum=1", "model[0].momentum", "must be in [0, 1)"),
        ("noise=3,clip=1,optimizer=adam,eps=0", "model[0].eps", "must be > 0"),
        ("noise=3,clip=1,optimizer=adam,beta2=x", "model[0].beta2", "must be a float"),
    ],
)
def test_bad_optimizer_options_are_refused_naming_the_entry(tmp_path, capsys, spec, field, rule):
    code, _, err = _run(capsys, "pool", "train", "--out", str(tmp_path / "p"), "--steps", "2", "--model", spec)
    assert code == 2 and field in err and rule in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_pool_train_from_an_own_network_with_adam(tmp_path, capsys):
    """``--from-model``: the site's own network trained with Adam on the privatised gradients;
    the record names it and the pool model loads with it."""
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "tiny.py").write_text(TINY_PY)
    site = tmp_path / "site"
    argv = ["site", "new", "--name", "st-anne", "--dir", str(site), "--listen", "127.0.0.1:0", "--address", "127.0.0.1"]
    argv += ["--adjacency", "replace-one"]  # the unit of the pools this file checks
    assert main(argv) == 0
    module = {}
    exec(compile(TINY_PY, "tiny.py", "exec"), module)
    torch.manual_seed(0)
    torch.save(module["make_model"]().state_dict(), tmp_path / "tiny.pt")
    argv = ["model", "import", "--site", str(site), "--name", "tiny", "--factory", f"{code_dir / 'tiny.py'}:make_model",
            "--weights", str(tmp_path / "tiny.pt"), "--input-shape", "1", "8", "8"]  # fmt: skip
    assert main(argv) == 0
    pool = tmp_path / "pool"
    code, out, err = _run(
        capsys,
        "pool", "train", "--site", str(site), "--from-model", "tiny", "--dataset", "digits", "--out", str(pool),
        "--steps", "3", "--seed", "1", "--model", "name=m,noise=2,clip=1,lr=0.01,optimizer=adam", "--json",
    )  # fmt: skip
    assert code == 0, err
    (row,) = json.loads(out)["models"]
    assert row["training"]["optimizer"]["name"] == "adam"
    (pm,) = load_pool(pool)
    assert pm.privacy.optimizer == Optimizer.of("adam")
    assert np.isfinite(row["epsilon"]["pld"])
