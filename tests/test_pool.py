"""The pool on disk and the command line end to end: real training, real files, real merges."""

import json

import numpy as np
import pytest

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import make_randomness
from peer.cli import main
from peer.dp.accounting import TrainingRecord
from peer.dp.accounting.release_accounting import record_epsilon
from peer.dp.pools import load_pool, load_splits, save_trained
from peer.dp.training import train_pool
from peer.nn.store import load_model

LOGREG = {"kind": "mlp", "input_dim": 64, "hidden": [], "output_dim": 10}


def test_splits_are_disjoint_and_validation_is_held_out():
    s = load_splits("digits")
    train = {r.tobytes() for r in s.x_train}
    assert not any(r.tobytes() in train for r in s.x_val)
    assert len(s.x_val) == pytest.approx(0.2 * (len(s.x_train) + len(s.x_val)), abs=1)


def test_pool_round_trip_and_record_consistency(tmp_path):
    s = load_splits("digits")
    trainings = [TrainingRecord.constant("replace-one", 3, 2.0, 1.0, sigma) for sigma in (5.0, 10.0)]
    models = train_pool(LOGREG, s.x_train, s.y_train, trainings, init_seed=0, randomness=make_randomness(1), delta=1e-5)
    for i, m in enumerate(models):
        save_trained(tmp_path, f"m{i}", m, accuracy=0.5, data=s.description)
    pool = load_pool(tmp_path)
    assert [p.name for p in pool] == ["m0", "m1"]
    assert pool[0].privacy == trainings[0] and pool[0].dataset_size == len(s.x_train)
    assert not np.array_equal(pool[0].arrays["0.weight"], pool[1].arrays["0.weight"])  # independent noise
    # a manifest whose release record describes another training is refused
    manifest = json.loads((tmp_path / "m1.json").read_text())
    manifest["metadata"]["training"] = trainings[0].to_dict()
    (tmp_path / "m1.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgument, match=r"m1\.metadata\.record"):
        load_pool(tmp_path)


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_trains_a_pool_and_merges_it(tmp_path, capsys):
    pool_dir = tmp_path / "pool"
    code, out, _ = _run(
        capsys,
        "pool",
        "train",
        "--out",
        str(pool_dir),
        "--steps",
        "8",
        "--seed",
        "3",
        "--model",
        "name=a,noise=3,clip=1",
        "--model",
        "name=b,noise=12,clip=0.5",
        "--json",
    )
    assert code == 0
    summary = json.loads(out)
    eps = {m["name"]: m["epsilon"]["pld"] for m in summary["models"]}
    assert eps["a"] > eps["b"]
    target = 0.5 * (eps["a"] + eps["b"])
    # `pool train` built the pool's privacy profiles and cached them beside the pool, so a daemon
    # loading it (and its first merge) reads them instead of composing the steps again
    from peer.dp.pools import profile_cache_directory

    assert len(list(profile_cache_directory(pool_dir).glob("*.npz"))) == 2

    pool = {m.name: m for m in load_pool(pool_dir)}
    for method in ("lc", "rs"):
        out_file = tmp_path / "out" / f"{method}-merged.safetensors"
        code, out, err = _run(
            capsys,
            "merge",
            "--pool",
            str(pool_dir),
            "--target-epsilon",
            str(target),
            "--delta",
            "1e-5",
            "--method",
            method,
            "--out",
            str(out_file),
            "--seed",
            "0",
            "--json",
        )
        assert code == 0, err
        result = json.loads(out)
        assert out_file.is_file() and (tmp_path / "out" / f"{method}-merged.record.json").is_file()
        record = ReleaseRecord.from_json((tmp_path / "out" / f"{method}-merged.record.json").read_text())
        assert record.mechanism == f"{method}-merge" and record.epsilon <= target
        assert record.to_dict() == result["record"]
        # the ledger's view: the record alone re-accounts to the same ε
        pld_eps, rdp_eps = record_epsilon(record, 1e-5)
        assert pld_eps == pytest.approx(record.epsilon, rel=1e-9)
        assert rdp_eps == pytest.approx(result["epsilon"]["rdp"], rel=1e-9) and rdp_eps > pld_eps
        merged = load_model(tmp_path / "out", f"{method}-merged")
        assert merged.metadata["record"] == record.to_dict()
        weights = result["weights"]
        if method == "lc":
            for k, v in merged.arrays.items():
                expected = weights[0] * pool["a"].arrays[k].astype(np.float64) + weights[1] * pool["b"].arrays[k]
                np.testing.assert_allclose(v, expected, rtol=1e-6, atol=1e-7)
        else:
            assert any(all(np.array_equal(merged.arrays[k], m.arrays[k]) for k in m.arrays) for m in pool.values())
            assert "drawn" not in json.dumps(result) and "selected" not in json.dumps(result)

    # an explicit validation file works the same way
    s = load_splits("digits")
    np.savez(tmp_path / "val.npz", x=s.x_val, y=s.y_val)
    code, _, err = _run(
        capsys,
        "merge",
        "--pool",
        str(pool_dir),
        "--target-epsilon",
        str(target),
        "--delta",
        "1e-5",
        "--method",
        "lc",
        "--out",
        str(tmp_path / "v.safetensors"),
        "--selection",
        "utility",
        "--validation",
        str(tmp_path / "val.npz"),
    )
    assert code == 0, err


def test_cli_refusals_are_one_clear_line(tmp_path, capsys):
    pool_dir = tmp_path / "poisson"
    code, _, _ = _run(
        capsys,
        "pool",
        "train",
        "--out",
        str(pool_dir),
        "--steps",
        "4",
        "--seed",
        "1",
        "--sample-rate",
        "0.2",
        "--model",
        "noise=5,clip=1",
        "--model",
        "noise=9,clip=1",
    )
    assert code == 0
    # LC of a Poisson-subsampled pool is charged the composition of the models it combines
    code, _, err = _run(
        capsys,
        "merge",
        "--pool",
        str(pool_dir),
        "--target-epsilon",
        "5",
        "--delta",
        "1e-5",
        "--method",
        "lc",
        "--out",
        str(tmp_path / "lc.safetensors"),
    )
    assert code == 0, err
    record = json.loads((tmp_path / "lc.record.json").read_text())
    assert record["parameters"]["bound"] == "composition" and record["epsilon"] <= 5
    assert "surrogate" not in record["parameters"]  # not defined for subsampled runs
    code, _, err = _run(
        capsys,
        "merge",
        "--pool",
        str(pool_dir),
        "--target-epsilon",
        "1e-3",
        "--delta",
        "1e-5",
        "--method",
        "lc",
        "--out",
        str(tmp_path / "x.safetensors"),
    )
    assert code == 2 and "most private reachable" in err and len(err.strip().splitlines()) == 1
    # RS serves the same Poisson-subsampled pool
    code, out, err = _run(
        capsys,
        "merge",
        "--pool",
        str(pool_dir),
        "--target-epsilon",
        "5",
        "--delta",
        "1e-5",
        "--method",
        "rs",
        "--out",
        str(tmp_path / "rs.safetensors"),
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["epsilon"]["pld"] <= 5 and (tmp_path / "rs.record.json").is_file()
    code, _, err = _run(
        capsys,
        "merge",
        "--pool",
        str(pool_dir),
        "--target-epsilon",
        "1e-3",
        "--delta",
        "1e-5",
        "--method",
        "rs",
        "--accountant",
        "rdp",
        "--out",
        str(tmp_path / "x.safetensors"),
    )
    assert code == 2 and "most private reachable" in err
    code, _, err = _run(
        capsys,
        "merge",
        "--pool",
        str(tmp_path / "nothing"),
        "--target-epsilon",
        "5",
        "--delta",
        "1e-5",
        "--method",
        "rs",
        "--out",
        str(tmp_path / "x.safetensors"),
    )
    assert code == 2 and "does not exist" in err
    code, _, err = _run(capsys, "pool", "train", "--out", str(pool_dir), "--model", "noise=5")
    assert code == 2 and "clip" in err
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.record.json").exists()
