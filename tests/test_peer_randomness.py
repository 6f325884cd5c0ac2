"""Where noise comes from. A real daemon: CSPRNG-seeded and fresh per release (also across a
restart of ``privfusion peer serve``); a fixed seed only with ``--simulation``, and then said in
the logs, in ``peer info`` and in every record. DP-SGD: the same PCG64 stream as every mechanism."""

import json

import numpy as np
import pytest
from peer_harness import DaemonProcess, client, make_site, pin_each_other

from peer.base.records import FIXED_SEED_WARNING
from peer.budget.ledger import Ledger

PROBE = np.random.default_rng(0).random((8, 64))


def features(site, address, caller):
    with client(caller, address) as c:
        return c.features("mlp", PROBE, activation_epsilon=1.0, weight_epsilon=1.0)


def noisy_arrays(release) -> np.ndarray:
    return np.concatenate([release.arrays[k].ravel() for k in sorted(release.arrays)])


def test_without_a_seed_every_release_draws_fresh_csprng_noise_also_after_a_restart(tmp_path):
    a = make_site(tmp_path, "site-a")
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    got = []
    for _ in range(2):  # two `privfusion peer serve` processes on the same site, one after the other
        daemon = DaemonProcess(a)
        try:
            address = daemon.wait_ready()
            with client(b, address) as c:
                info = c.info()
            assert "randomness:csprng" in info.mechanisms
            got += [features(a, address, b), features(a, address, b)]
        finally:
            daemon.close()
    assert "FIXED SEED" not in daemon.log_path.read_text()
    noise = [noisy_arrays(r) for r in got]
    assert noise[0].shape == noise[-1].shape
    # identical requests (same model, probe set, ε, clip): the clean values are the same, so any
    # two equal outputs would mean repeated noise. Laplace noise is continuous: a repeat by
    # chance has probability 0.
    for i in range(len(noise)):
        for j in range(i):
            assert not np.array_equal(noise[i], noise[j]), (i, j)
    for r in got:
        rec = r.receipt.record
        assert (rec.randomness, rec.seed) == ("csprng", None)
        assert all((c.randomness, c.seed) == ("csprng", None) for c in rec.components)
        assert "randomness_warning" not in rec.to_dict()
    with Ledger(a.ledger) as led:
        assert [e.record.randomness for e in led.entries()] == ["csprng"] * 4


def test_serve_refuses_a_seed_without_simulation_and_says_so_everywhere_with_it(tmp_path):
    a = make_site(tmp_path, "site-a", seed=7)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    refused = DaemonProcess(a, log_path=tmp_path / "refused.log", simulation=False)
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            refused.wait_ready()
    finally:
        refused.close()
    log = (tmp_path / "refused.log").read_text()
    assert "site.seed" in log and "not private" in log and "--simulation" in log
    assert not a.ledger.exists()  # refused before anything was opened

    daemon = DaemonProcess(a, log_path=tmp_path / "simulation.log", simulation=True)
    try:
        address = daemon.wait_ready()
        with client(b, address) as c:
            info = c.info()
        release = features(a, address, b)
    finally:
        daemon.close()
    assert f"randomness:fixed-seed ({FIXED_SEED_WARNING})" in info.mechanisms
    assert "FIXED SEED: NOT PRIVATE" in (tmp_path / "simulation.log").read_text()
    rec = release.receipt.record
    assert (rec.randomness, rec.seed) == ("fixed-seed", 7)
    assert rec.to_dict()["randomness_warning"] == FIXED_SEED_WARNING
    assert all(c["randomness_warning"] == FIXED_SEED_WARNING for c in rec.to_dict()["components"])
    with Ledger(a.ledger) as led:
        [entry] = led.entries()
    assert json.loads(entry.record.canonical_json())["randomness_warning"] == FIXED_SEED_WARNING


# ------------------------------------------------------------------------ one source for all noise


def test_dpsgd_noise_and_poisson_batches_are_the_releases_pcg64_stream():
    """DP-SGD draws z_t and the Poisson masks from the same NumPy PCG64 generator as every other
    mechanism (no torch generator): with a zero loss the update is −η·σ·C·z/(q·n), so the
    released parameters reveal z, which must be the stream's standard normals, in order."""
    import torch

    from peer.base.rng import make_randomness
    from peer.dp.training import run_dpsgd

    class Step:
        def __init__(self, q):
            self.learning_rate, self.clip_norm, self.noise_multiplier, self.sample_rate = 0.5, 2.0, 3.0, q

    def zero(params, x_i, y_i):
        return (params["w"] * 0.0).sum() + (params["b"] * 0.0).sum()

    n, q = 40, 0.25
    params0 = {"w": torch.zeros(3, 2, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}
    x, y = torch.zeros(n, 1, dtype=torch.float64), torch.zeros(n, dtype=torch.long)
    run = run_dpsgd(zero, params0, x, y, [Step(q)], randomness=make_randomness(123))
    gen = make_randomness(123).generator
    z = {"w": gen.standard_normal((3, 2)), "b": gen.standard_normal(3)}
    mask = gen.random(n) < q
    for k, z_k in z.items():
        np.testing.assert_allclose(run.params[k].numpy(), -0.5 * 3.0 * 2.0 * z_k / (q * n), rtol=1e-12)
    assert run.batch_sizes == (int(mask.sum()),)
    # fresh per run: two CSPRNG-seeded runs never share noise
    a, b = (run_dpsgd(zero, params0, x, y, [Step(1.0)], randomness=make_randomness()).params["w"] for _ in range(2))
    assert not torch.equal(a, b)


def test_a_fixed_seed_record_says_not_private_wherever_it_is_serialised():
    from peer.base.errors import InvalidArgument
    from peer.base.records import ReleaseRecord
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import laplace_activations

    _, fixed = laplace_activations(np.zeros((2, 3)), epsilon=1.0, clip=(0.0, 1.0), randomness=make_randomness(4))
    _, fresh = laplace_activations(np.zeros((2, 3)), epsilon=1.0, clip=(0.0, 1.0))
    assert json.loads(fixed.canonical_json())["randomness_warning"] == FIXED_SEED_WARNING
    assert "randomness_warning" not in json.loads(fresh.canonical_json())
    assert ReleaseRecord.from_json(fixed.canonical_json()) == fixed
    older = fixed.to_dict()
    del older["randomness_warning"]  # written before records carried it: still read
    assert ReleaseRecord.from_dict(older) == fixed
    forged = fresh.to_dict() | {"randomness_warning": FIXED_SEED_WARNING}
    with pytest.raises(InvalidArgument, match="randomness_warning"):
        ReleaseRecord.from_dict(forged)
    with pytest.raises(InvalidArgument, match="randomness_warning"):
        ReleaseRecord.from_dict(fixed.to_dict() | {"randomness_warning": "fine"})


# ------------------------------------------------------------------------ pools and stored releases


def test_serve_refuses_a_fixed_seed_pool_by_name_and_a_simulation_serves_it_saying_so(tmp_path):
    """Issue 20, item 3: a pool trained with `pool train --seed` was served by a production
    daemon with no warning, and the merge's record said csprng (its draw's randomness only). A
    daemon without --simulation now refuses to start, naming the pool, the model and both flags;
    with --simulation it serves the merge, whose record says fixed-seed with the models' seed."""
    from peer_harness import make_pool

    make_pool(tmp_path / "pool", seed=5)
    a = make_site(tmp_path, "site-a", pools={"digits": tmp_path / "pool"})  # no site seed
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    refused = DaemonProcess(a, log_path=tmp_path / "refused.log", simulation=False)
    try:
        with pytest.raises(RuntimeError, match="exited with"):
            refused.wait_ready()
    finally:
        refused.close()
    log = (tmp_path / "refused.log").read_text()
    assert (
        "pool 'digits': model 'm0'" in log
        and "fixed noise seed 5 (privfusion pool train --seed" in log
        and "--simulation" in log
    )
    assert FIXED_SEED_WARNING in log and not a.ledger.exists()  # refused before the ledger was opened

    daemon = DaemonProcess(a, log_path=tmp_path / "simulation.log", simulation=True)
    try:
        address = daemon.wait_ready()
        with client(b, address) as c:
            got = c.merged("digits", method="rs", epsilon=50.0, delta=1e-5)
    finally:
        daemon.close()
    assert "FIXED SEED: NOT PRIVATE" in (tmp_path / "simulation.log").read_text()
    rec = got.receipt.record
    assert (rec.randomness, rec.seed) == ("fixed-seed", 5)
    assert rec.to_dict()["randomness_warning"] == FIXED_SEED_WARNING
    assert rec.parameters["models_randomness"] == ({"randomness": "fixed-seed", "seed": 5},) * 2
    with Ledger(a.ledger) as led:
        [entry] = led.entries()
    assert entry.record.canonical_json() == rec.canonical_json()


def test_a_stored_fixed_seed_release_is_refused_at_start_and_never_served_again(tmp_path):
    """A merge drawn by a --simulation daemon and kept in the release store: a production daemon
    on the same ledger refuses to start, naming the file; a site held in memory refuses to serve
    it again (FailedPrecondition, no served-again row)."""
    from peer_harness import make_pool, running

    from peer.base.errors import FailedPrecondition
    from peer.net.daemon import open_site

    make_pool(tmp_path / "pool", seed=5)
    a = make_site(tmp_path, "site-a", pools={"digits": tmp_path / "pool"})
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    with running(a, simulation=True) as (_, address), client(b, address) as c:
        c.merged("digits", method="rs", epsilon=50.0, delta=1e-5)
    make_pool(tmp_path / "pool", seed=None)  # the pool retrained with CSPRNG noise, same names
    with pytest.raises(FailedPrecondition) as e:
        open_site(a.config, simulation=False)
    assert "release store" in str(e.value) and ".json" in str(e.value) and "--simulation" in str(e.value)
    site = open_site(a.config, simulation=True)
    try:
        site.simulation = False  # as a production site holding the entry would see it
        [path] = site.releases.directory.glob("*.json")
        stored = site.releases.get(path.stem)
        with pytest.raises(FailedPrecondition, match="fixed noise seed"):
            site._serve_again(stored, "site-b", "entry", "again")
        assert site.ledger.served_again() == []
    finally:
        site.close()


def test_a_merge_record_states_the_randomness_of_the_models_it_may_release():
    """RS with a CSPRNG draw over a CSPRNG model and a fixed-seed one: the record is fixed-seed
    (the model's seed) when the fixed-seed model has π > 0, and csprng when it has π = 0 (it
    never leaves); LC (no draw of its own) likewise; the per-model list is always there."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.accounting.release_accounting import rs_merge_record
    from peer.dp.merging import PoolModel, with_models_randomness

    training = TrainingRecord.constant("replace-one", 3, 1.0, 1.0, 4.0, 1.0)
    fixed = {"record": {"randomness": "fixed-seed", "seed": 9}}
    secure = {"record": {"randomness": "csprng", "seed": None}}
    pool = [PoolModel("a", {}, {}, training, 10, secure), PoolModel("b", {}, {}, training, 10, fixed)]
    for pi, expected in (((0.5, 0.5), ("fixed-seed", 9)), ((1.0, 0.0), ("csprng", None))):
        record = rs_merge_record(
            [training, training], pi, 1e-5, names=["a", "b"], randomness=make_randomness().record_fields()
        )
        assert (record.randomness, record.seed) == ("csprng", None)  # the draw's alone: what was wrong
        out = with_models_randomness(record, pool, pi)
        assert (out.randomness, out.seed) == expected
        assert [m["randomness"] for m in out.parameters["models_randomness"]] == ["csprng", "fixed-seed"]
