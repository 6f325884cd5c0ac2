"""The pool on disk and the command line end to end: real training, real files, real merges."""

import json

import numpy as np
import pytest
from peer_harness import holds_count

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


# ------------------------------------------------------------------------ add-remove: a declared n


def test_cli_add_remove_pool_divides_by_the_declared_count_and_states_no_true_one(tmp_path, capsys):
    """Issue 20, item 2: `pool train` took n = len(training records) under add-remove too, and
    wrote it into every record and the summary. Now add-remove needs --declared-records (refused
    by name without it, nothing trained); the records, the stored metadata and the summary carry
    the declared n; replace-one keeps the true count (public there) and says so."""
    base = ["pool", "train", "--dataset", "digits", "--steps", "2", "--model", "noise=5,clip=1", "--json"]
    code, _, err = _run(capsys, *base, "--out", str(tmp_path / "refused"), "--adjacency", "add-remove")
    assert code != 0 and "--declared-records" in err and "private" in err
    assert not (tmp_path / "refused").exists()
    code, out, err = _run(
        capsys, *base, "--out", str(tmp_path / "ar"), "--adjacency", "add-remove", "--declared-records", "900"
    )
    assert code == 0, err
    summary = json.loads(out)
    true_count = len(load_splits("digits").y_train)
    assert summary["dataset_size"] == 900 and summary["dataset_size_source"] == "declared"
    [model] = load_pool(tmp_path / "ar")
    record = model.metadata["record"]
    assert model.dataset_size == 900 and record["parameters"]["dataset_size"] == 900
    assert record["parameters"]["dataset_size_source"] == "declared" and record["unit"] == "record:add-remove"
    assert not holds_count(json.loads((tmp_path / "ar" / f"{model.name}.json").read_text()), (true_count,))
    code, out, _ = _run(capsys, *base, "--out", str(tmp_path / "ro"))
    [model] = load_pool(tmp_path / "ro")
    assert model.metadata["record"]["parameters"]["dataset_size"] == true_count
    assert model.metadata["record"]["parameters"]["dataset_size_source"] == "count"


def _as_before_declared_counts(directory) -> None:
    """Rewrite a pool's manifests as a pool written before declared counts: its records carry
    the true count and no ``dataset_size_source``."""
    for path in directory.glob("*.json"):
        manifest = json.loads(path.read_text())
        params = manifest["metadata"]["record"]["parameters"]
        params.pop("dataset_size_source")
        params["dataset_size"] = 1078
        path.write_text(json.dumps(manifest))


def test_an_add_remove_pool_that_states_its_true_count_is_refused_by_name(tmp_path, capsys):
    """Old add-remove pools (the true count in every record, and as the denominator) still load
    and list, but nothing is merged or served from them: merge_pool and a daemon's start refuse,
    naming the pool and the models and what to do, never the count. Old replace-one pools (no
    dataset_size_source either) merge as before."""
    from peer.base.errors import FailedPrecondition
    from peer.dp.pools import merge_pool
    from peer.net.daemon import check_servable
    from peer.net.site import SiteConfig

    s = load_splits("digits")
    for adjacency, directory in (("add-remove", tmp_path / "ar"), ("replace-one", tmp_path / "ro")):
        trainings = [TrainingRecord.constant(adjacency, 2, 2.0, 1.0, sigma) for sigma in (5.0, 10.0)]
        models = train_pool(
            LOGREG, s.x_train, s.y_train, trainings, init_seed=0, randomness=make_randomness(), delta=1e-5,
            dataset_size=900,
        )  # fmt: skip
        for i, m in enumerate(models):
            save_trained(directory, f"m{i}", m, data=s.description)
        _as_before_declared_counts(directory)
    old = load_pool(tmp_path / "ar")
    with pytest.raises(FailedPrecondition) as e:
        merge_pool(old, "rs", 50.0, 1e-5, subject="digits")
    assert "pool 'digits'" in str(e.value) and "['m0', 'm1']" in str(e.value) and "--declared-records" in str(e.value)
    assert "1078" not in str(e.value)
    merged = merge_pool(load_pool(tmp_path / "ro"), "rs", 50.0, 1e-5, subject="ro")
    assert merged.record.unit == "record:replace-one"
    code, out, _ = _run(capsys, "pool", "list", "--pool", str(tmp_path / "ar"), "--json")
    assert code == 0 and all("true record count" in m["not_served"][0] for m in json.loads(out)["models"])
    config = tmp_path / "site.toml"
    config.write_text(
        '[site]\nname = "site-a"\nlisten = "127.0.0.1:0"\nidentity = "identity"\nmodels = "models"\n'
        'ledger = "ledger.sqlite"\n\n[site.pools.old]\nmodels = "ar"\n'
    )
    with pytest.raises(FailedPrecondition, match=r"pool 'old': models \['m0', 'm1'\]"):
        check_servable(SiteConfig.load(config), simulation=True)
