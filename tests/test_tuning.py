"""The hyperparameter search (scenarios.tuning): its validation split, its noise models, the
calibration every configuration gets, its choice, and the command, on the smallest grids."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event, rdp

from peer.base.errors import InvalidArgument
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.distributed.encoding import Encoding
from peer.dp.distributed.skellam import calibrate_share, planned_order
from scenarios.schema import parse_scenario
from scenarios.tuning import (
    CENTRAL,
    LOCAL,
    LocalConfig,
    PooledConfig,
    local_grid,
    markdown,
    pooled_grid,
    score,
    secure_aggregation,
    secure_grid,
    tune,
    validation_split,
)

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
epochs = 5

[round]
methods = ["ldp"]
frontier = []

[iterate]
rounds = 3
local_steps = 2
learning_rate = 0.5
declared_records = 60

[sites.site-a]
[sites.site-b]
[sites.site-c]
"""

ARCH = {"kind": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2, "activation": "tanh"}


def _parts(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, size=n).astype(np.int64)) for n in sizes]


def test_the_validation_split_is_carved_from_each_sites_records():
    parts = _parts((10, 21, 7))
    train, (xv, yv) = validation_split(parts, 0.2, seed=5)
    # ⌈0.2·n_i⌉ of each site held out, the rest kept; together exactly the site's records
    assert [len(y) for _, y in train] == [8, 16, 5] and len(yv) == 2 + 5 + 2
    offset = 0
    for (x, _), (xt, _) in zip(parts, train, strict=True):
        k = len(x) - len(xt)
        held = xv[offset : offset + k]
        offset += k
        together = np.concatenate([xt, held])
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, x.tolist()))
    again, (xv2, _) = validation_split(parts, 0.2, seed=5)
    assert np.array_equal(xv, xv2) and all(np.array_equal(a[0], b[0]) for a, b in zip(train, again, strict=True))
    with pytest.raises(InvalidArgument, match="fraction"):
        validation_split(parts, 1.0, seed=5)
    with pytest.raises(InvalidArgument, match="no training records"):
        validation_split(_parts((1, 5)), 0.5, seed=5)


def test_grids_are_a_few_dozen_at_most_and_cheaper_plans_first():
    assert len(local_grid()) == 24 and len(pooled_grid()) == 24 and len(secure_grid()) == 28
    assert len(secure_grid(smallest=True)) == 2
    assert [c.steps for c in secure_grid() if c.sample_rate == 1.0] == sorted(
        c.steps for c in secure_grid() if c.sample_rate == 1.0
    )
    assert len(local_grid(smallest=True)) == 2 and len(pooled_grid(smallest=True)) == 2
    steps = [c.rounds * c.local_steps for c in local_grid()]
    assert steps == sorted(steps)
    assert [c.steps for c in pooled_grid()] == sorted(c.steps for c in pooled_grid())


def test_every_configuration_spends_the_target_by_dp_accounting_and_noise_models_scale_it():
    """σ meets (ε, δ) for the configuration's own steps and rate (dp-accounting's RDP accountant
    on the same PoissonSampled Gaussian events); secure aggregation's σ is the curator's times
    √(k/(k − t))."""
    parts = _parts((20, 30))
    xv, yv = parts[0]
    kw = dict(epsilon=2.0, delta=1e-5, adjacency="add-remove", init_seed=0, dataset_size=50, seeds=(0,))
    pooled = PooledConfig(steps=20, learning_rate=1.0, sample_rate=0.3, clip_norm=1.0)
    c = score(CENTRAL, pooled, ARCH, parts, xv, yv, **kw)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.3, dp_event.GaussianDpEvent(c["noise_multiplier"])), 20)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=1e-4)
    full = PooledConfig(steps=20, learning_rate=1.0, sample_rate=1.0, clip_norm=1.0)
    cf = score(CENTRAL, full, ARCH, parts, xv, yv, **kw)
    dim = 3 * 4 + 4 + 4 * 2 + 2
    for orders, scale in ((DEFAULT_ORDERS, 1024.0), (None, 65536.0)):
        secure = secure_aggregation(4, 1, orders=orders, scale=scale)
        sf = score(secure, full, ARCH, parts, xv, yv, **kw)
        # the secure row is charged as the run is: the Skellam sum of 4 shares, each V/(k − t),
        # V calibrated on the encoding's integer sensitivities (δ split over the ledger's
        # orders; None: the one integer order planned for the plan); in units of C on the sum
        enc = Encoding(dim=dim, clip_norm=1.0, scale=scale, bits=32, beta=0.0)
        d1, d2 = enc.l1_sensitivity, enc.l2_sensitivity
        used = orders if orders is not None else (float(planned_order(2.0, 1e-5, 4, 1, d1, d2, 1.0, 20)),)
        cal = calibrate_share(2.0, 1e-5 / len(used), 4, 1, d1, d2, 1.0, 20, used)
        assert sf["noise_multiplier"] == pytest.approx(math.sqrt(4 * cal.total_variance / 3) / scale, rel=1e-12)
    # full batch at one integer order and γC = 65536: the Skellam sum needs no more noise than
    # the Gaussian stand-in √(k/(k − t)) × the curator's σ (by dp-accounting's RDP at its own,
    # fractional orders), to within the discreteness term and the order grid
    assert len(used) == 1 and float(used[0]).is_integer()
    ratio = sf["noise_multiplier"] / (cf["noise_multiplier"] * math.sqrt(4 / 3))
    assert 1.0 - 1e-3 < ratio < 1.01
    # subsampled: the general Poisson bound the run is charged by asks for far more noise
    s = score(secure, pooled, ARCH, parts, xv, yv, **kw)
    assert s["noise_multiplier"] > 1.5 * c["noise_multiplier"] * math.sqrt(4 / 3)
    local = LocalConfig(rounds=2, local_steps=3, learning_rate=1.0, sample_rate=1.0, clip_norm=1.0)
    lo = score(LOCAL, local, ARCH, parts, xv, yv, **kw)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(lo["noise_multiplier"]), 6)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=1e-4)
    with pytest.raises(InvalidArgument, match="config"):
        score(LOCAL, pooled, ARCH, parts, xv, yv, **kw)
    with pytest.raises(InvalidArgument, match="coalition"):
        secure_aggregation(4, 3, orders=DEFAULT_ORDERS)
    with pytest.raises(InvalidArgument, match="adjacency"):
        score(secure, full, ARCH, parts, xv, yv, **{**kw, "adjacency": "replace-one"})


def test_the_search_chooses_the_best_validation_score_and_never_reads_the_test_set():
    """The chosen configuration has the highest mean validation accuracy; replacing the test set
    by NaN changes nothing (the search never reads it)."""
    from scenarios.world import split_data

    sc = parse_scenario(TINY, "tiny.toml")
    data = split_data(sc)
    result = tune(sc, data, (LOCAL, CENTRAL), smallest=True)
    blind = dataclasses.replace(data, x_test=np.full_like(data.x_test, np.nan), y_test=-np.ones_like(data.y_test))
    blind_rows = tune(sc, blind, (LOCAL, CENTRAL), smallest=True)["rows"]

    def without_time(rows):
        return {k: {f: v for f, v in row.items() if f != "wall_s"} for k, row in rows.items()}

    assert without_time(blind_rows) == without_time(result["rows"])
    for row in result["rows"].values():
        means = [r["accuracy_mean"] for r in row["configs"]]
        assert row["chosen"] == int(np.argmax(means))
    p = result["protocol"]
    assert p["validation_records"] + p["training_records"] == sum(len(y) for _, y in data.parts)
    assert p["pooled_dataset_size"] == round(60 * 3 * 0.8)
    md = markdown(result)
    assert md.count("**chosen**") == 2 and "| rounds | local_steps |" in md


def test_the_command(tmp_path, capsys):
    from peer.cli import main

    f = tmp_path / "tiny.toml"
    f.write_text(TINY)
    assert main(["simulate", str(f), "--tune", "--smallest", "--rows", "central", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["rows"]) == {"central"} and len(out["rows"]["central"]["configs"]) == 2
    assert main(["simulate", str(f), "--tune", "--smallest", "--rows", "secure-aggregation"]) == 2
    assert "--coalition" in capsys.readouterr().err
    assert main(["simulate", str(f), "--tune", "--baselines-only"]) == 2
