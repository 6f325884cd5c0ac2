"""The on-disk profile cache: a stored PLD gives exactly the ε of a fresh one, a bad entry is
never used (rebuilt instead, and the ε is then right), and a new process reads the entry."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from peer.base.errors import InvalidArgument
from peer.dp.accounting import ApproxDP, TrainingRecord
from peer.dp.accounting import profile_cache as pc
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.accounting.profiles import _derived_profile, forget_profiles, privacy_profile

ORDERS = tuple(float(a) for a in DEFAULT_ORDERS)
INTERVAL = 1e-4
ACC = Accountant(ORDERS, INTERVAL)
POISSON = TrainingRecord.constant("add-remove", 2000, 0.1, 1.0, 1.0, 0.01)
MODELS = [
    POISSON,
    TrainingRecord.constant("replace-one", 500, 0.1, 1.0, 1.5, 0.02),
    TrainingRecord.constant("replace-one", 100, 0.1, 1.0, 10.0, 1.0),
    ApproxDP(1.0, 1e-6, "add-remove"),
]
DELTAS = (1e-3, 1e-5, 1e-8)


@pytest.fixture(autouse=True)
def _cold():
    forget_profiles()
    yield
    forget_profiles()


def fresh(model):
    """The profile built from the record, bypassing every cache."""
    return _derived_profile.__wrapped__(model, model.adjacency, ORDERS, INTERVAL)


def assert_same_privacy(profile, reference):
    for d in DELTAS:
        got, want = profile.epsilon(d), reference.epsilon(d)
        assert got.pld == want.pld and got.rdp == want.rdp and got.closed_form == want.closed_form
    np.testing.assert_array_equal(profile.rdp, reference.rdp)
    assert profile.mu == reference.mu and profile.source == reference.source


@pytest.mark.parametrize("model", MODELS, ids=["poisson", "poisson-replace", "full-batch", "approx-dp"])
def test_stored_profile_gives_the_fresh_epsilon_exactly(tmp_path, model):
    written = pc.cached_profile(model, tmp_path)
    assert pc.load_entry(tmp_path, model, model.adjacency, ACC) is not None
    forget_profiles()
    loaded = pc.cached_profile(model, tmp_path)
    assert _derived_profile.cache_info().currsize == 0  # read from disk, not built
    assert loaded is not written
    assert_same_privacy(loaded, fresh(model))
    # and later requests in the process get it from memory
    assert privacy_profile(model) is loaded


def test_key_covers_record_adjacency_orders_interval():
    base = pc.profile_key(POISSON, "add-remove", ACC)
    other_record = TrainingRecord.constant("add-remove", 2001, 0.1, 1.0, 1.0, 0.01)
    assert pc.profile_key(other_record, "add-remove", ACC) != base
    assert pc.profile_key(POISSON, "replace-one", ACC) != base
    assert pc.profile_key(POISSON, "add-remove", Accountant(ORDERS[:-1], INTERVAL)) != base
    assert pc.profile_key(POISSON, "add-remove", Accountant(ORDERS, 1e-3)) != base
    assert pc.profile_key(POISSON, "add-remove", ACC) == base


def _paths(directory: Path, model=POISSON):
    key = pc.profile_key(model, model.adjacency, ACC)
    return directory / f"{key}.json", directory / f"{key}.npz"


def _rewrite(directory: Path, change_arrays=None, change_entry=None, model=POISSON):
    """Rewrite the entry of ``model`` with changed arrays and/or JSON, keeping it self-consistent
    (digest recomputed) unless ``change_entry`` says otherwise: each check is tested alone."""
    json_path, npz_path = _paths(directory, model)
    with np.load(npz_path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    if change_arrays:
        change_arrays(arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    npz_path.write_bytes(buf.getvalue())
    entry = json.loads(json_path.read_text())
    entry["arrays_sha256"] = pc._digest(arrays)
    if change_entry:
        change_entry(entry)
    json_path.write_text(json.dumps(entry))


def _shift_mass_down(arrays):
    # move 1% of the mass from the top half of the losses to the bottom: a PLD that under-charges
    p = arrays["remove_probs"]
    half = p.size // 2
    moved = 0.01 * p[half:].sum() / p[half:].sum() * p[half:]
    p[half:] -= moved
    p[:half] += moved.sum() / half


def _drop_mass(arrays):
    arrays["remove_probs"][arrays["remove_probs"].size // 2 :] = 0.0


def _other_version(entry):
    entry["inputs"]["dp_accounting"] = "0.0.1"


def _other_model(entry):
    entry["inputs"]["model"]["steps"][0]["count"] = 1000


def _stale_digest(entry):
    entry["arrays_sha256"] = "0" * 64


def _bad_rdp(arrays):
    arrays["rdp"] = arrays["rdp"][:-1]


def _coarser(arrays):
    arrays["remove_meta"][2] = 1e-3


BAD_ENTRIES = {
    "mass-shifted-down": (_shift_mass_down, None),
    "mass-dropped": (_drop_mass, None),
    "stale-digest": (None, _stale_digest),
    "other-dp-accounting-version": (None, _other_version),
    "other-model-under-this-key": (None, _other_model),
    "rdp-wrong-shape": (_bad_rdp, None),
    "other-interval": (_coarser, None),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_bad_entry_is_ignored_and_rebuilt(tmp_path, case):
    pc.cached_profile(POISSON, tmp_path)
    _rewrite(tmp_path, *BAD_ENTRIES[case])
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is None
    forget_profiles()
    profile = pc.cached_profile(POISSON, tmp_path)
    assert_same_privacy(profile, fresh(POISSON))
    # and the rebuilt entry was written back, valid
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is not None


@pytest.mark.parametrize("damage", ["truncated-npz", "garbage-json", "missing-npz", "pickle-in-npz"])
def test_corrupt_files_are_ignored_and_rebuilt(tmp_path, damage):
    pc.cached_profile(POISSON, tmp_path)
    json_path, npz_path = _paths(tmp_path)
    if damage == "truncated-npz":
        npz_path.write_bytes(npz_path.read_bytes()[:1000])
    elif damage == "garbage-json":
        json_path.write_text("{not json")
    elif damage == "missing-npz":
        npz_path.unlink()
    else:  # an object array would need pickle to load: refused, never unpickled
        buf = io.BytesIO()
        np.savez(buf, remove_probs=np.array([object()]), remove_meta=np.zeros(4), rdp=np.zeros(len(ORDERS)))
        npz_path.write_bytes(buf.getvalue())
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is None
    forget_profiles()
    assert_same_privacy(pc.cached_profile(POISSON, tmp_path), fresh(POISSON))


def test_unwritable_directory_still_gives_the_profile(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be: writing fails with OSError
    assert_same_privacy(pc.cached_profile(POISSON, blocked / "cache"), fresh(POISSON))


def test_a_new_process_reads_the_entry(tmp_path):
    pc.cached_profile(POISSON, tmp_path)
    want = fresh(POISSON).epsilon(1e-5).pld
    script = (
        "import sys, json\n"
        "from peer.dp.accounting import TrainingRecord\n"
        "from peer.dp.accounting import profile_cache as pc\n"
        "from peer.dp.accounting.profiles import _derived_profile\n"
        "m = TrainingRecord.constant('add-remove', 2000, 0.1, 1.0, 1.0, 0.01)\n"
        "p = pc.cached_profile(m, sys.argv[1])\n"
        "print(json.dumps({'built': _derived_profile.cache_info().currsize, 'eps': p.epsilon(1e-5).pld}))\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "proto")])}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"built": 0, "eps": want}


def test_pool_cache_directory_is_a_hidden_sibling(tmp_path):
    from peer.dp.pools import profile_cache_directory

    assert profile_cache_directory(tmp_path / "pool") == tmp_path.resolve() / ".pool.profiles"


def test_record_hash_follows_equality():
    from peer.dp.accounting import GaussianStep

    step = GaussianStep(0.1, 1.0, 1.0, 0.01)
    explicit = TrainingRecord("add-remove", tuple([step] * 2000))
    assert explicit == POISSON and hash(explicit) == hash(POISSON)
    longer = TrainingRecord.constant("add-remove", 2001, 0.1, 1.0, 1.0, 0.01)
    assert longer != POISSON and hash(longer) != hash(POISSON)


def test_pool_warm_up_writes_beside_the_pool_and_a_restart_reads_it(tmp_path):
    from peer.dp.merging import PoolModel
    from peer.dp.pools import profile_cache_directory, warm_pool_profiles

    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    pool = [PoolModel(f"p{i}", {}, {}, m) for i, m in enumerate(MODELS[:2])]
    # the models mix adjacencies: refused (the daemon skips such a pool), nothing written
    with pytest.raises(InvalidArgument, match="adjacenc"):
        warm_pool_profiles(pool, pool_dir)
    pool = [PoolModel("p0", {}, {}, POISSON), PoolModel("p1", {}, {}, MODELS[3])]
    first = warm_pool_profiles(pool, pool_dir)
    assert len(list(profile_cache_directory(pool_dir).glob("*.npz"))) == 2
    assert list(pool_dir.iterdir()) == []  # the pool directory itself holds models only
    forget_profiles()  # a restart
    again = warm_pool_profiles(pool, pool_dir)
    assert _derived_profile.cache_info().currsize == 0
    for a, b in zip(first, again, strict=True):
        assert_same_privacy(b, a)


def _nudge_deltas(factor):
    def change(entry):
        entry["deltas_at_check_epsilons"] = [[d * factor for d in ds] for ds in entry["deltas_at_check_epsilons"]]

    return change


def test_recorded_deltas_are_checked_up_to_rounding_only(tmp_path):
    """The δ recomputed at load may differ in their last bits (another BLAS thread count sums the
    dot products in another order): 1e-12 relative is accepted, 1e-6 is not."""
    pc.cached_profile(POISSON, tmp_path)
    _rewrite(tmp_path, None, _nudge_deltas(1 + 1e-12))
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is not None
    _rewrite(tmp_path, None, _nudge_deltas(1 + 1e-6))
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is None


def test_an_entry_written_with_other_blas_threads_is_read(tmp_path):
    """A daemon runs with one BLAS thread; a cache written by a process with several is still its
    cache (and the other way round)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    for writer, reader in ((None, 1), (1, None)):
        forget_profiles()
        d = tmp_path / f"w{writer}-r{reader}"
        with threadpoolctl.threadpool_limits(writer):
            pc.cached_profile(POISSON, d)
        with threadpoolctl.threadpool_limits(reader):
            assert pc.load_entry(d, POISSON, "add-remove", ACC) is not None


def test_a_profile_seen_before_is_still_written_beside_each_pool(tmp_path):
    """Two pools trained with the same record (sites of one simulation): the second directory
    gets its entry too, although the profile came from memory."""
    first = pc.cached_profile(POISSON, tmp_path / "a")
    again = pc.cached_profile(POISSON, tmp_path / "b")
    assert again is first and _derived_profile.cache_info().currsize == 1
    assert pc.load_entry(tmp_path / "b", POISSON, "add-remove", ACC) is not None


# ---- an entry must match what its training record determines (issue 20, item 5) ----

# The pair: b is full-batch DP-GD with μ = 8 (weak), a with μ = 0.1; each one step of
# sensitivity 2C = 2 under replace-one.
WEAK = TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 2.0 / 8.0)
STRONG = TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 2.0 / 0.1)


def _forge(directory, model, donor, rdp=None):
    """Write ``donor``'s PLD as ``model``'s entry, self-consistent (digest and recorded δ computed
    from the donor's arrays, as an editor with the code at hand would): what the old load_entry
    accepted."""
    donor_profile = fresh(donor)
    own = fresh(model)
    pc.save_entry(directory, model, model.adjacency, ACC, donor_profile.pld, own.rdp if rdp is None else rdp)


def test_forged_entry_with_a_more_private_models_pld_is_rejected_and_rebuilt(tmp_path, caplog):
    """Regression (issue 20, item 5): with a far more private model's PLD written into the weak
    model's entry, the old cache gave the weak model the strong one's ε — π moved onto it and the
    published ε said ~2 while the truth was far above. Now the entry is checked against the
    record's exact μ-GDP curve, rejected (with a warning naming it) and rebuilt."""
    from peer.dp.accounting.conversions import gdp_epsilon
    from peer.dp.accounting.profiles import profile_from_pld
    from peer.dp.accounting.targets import choose_pi

    # what the forged entry made of the weak model (the old load_entry's result): it looks like the
    # strong one, π goes all on it, and the published ε is ~0.445 against a true ε of ~65.3
    forged = profile_from_pld(WEAK, "replace-one", ACC, fresh(STRONG).pld, fresh(WEAK).rdp)
    fooled = choose_pi([fresh(STRONG), forged], [0.0, 1.0], 2.0, 1e-5)
    assert fooled.weights == pytest.approx((0.0, 1.0)) and fooled.epsilon.pld < 0.5
    assert accounting_rs_epsilon([STRONG, WEAK], fooled.weights) == pytest.approx(gdp_epsilon(8.0, 1e-5), abs=2e-3)
    assert gdp_epsilon(8.0, 1e-5) > 65

    _forge(tmp_path, WEAK, STRONG)
    with caplog.at_level("WARNING", logger="peer.dp.accounting.profile_cache"):
        assert pc.load_entry(tmp_path, WEAK, "replace-one", ACC) is None
    assert "profile-cache-entry-rejected" in caplog.text and "Gaussian mechanism" in caplog.text
    forget_profiles()
    weak = pc.cached_profile(WEAK, tmp_path)
    assert weak.epsilon(1e-5).pld == pytest.approx(gdp_epsilon(8.0, 1e-5), abs=2e-3)
    assert_same_privacy(weak, fresh(WEAK))
    # the published figure of an RS merge is the true one: π on the weak model is what the target allows
    strong = pc.cached_profile(STRONG, tmp_path)
    choice = choose_pi([strong, weak], [0.0, 1.0], 2.0, 1e-5)
    assert choice.epsilon.pld <= 2.0
    assert accounting_rs_epsilon([STRONG, WEAK], choice.weights) <= 2.0 + 1e-9


def accounting_rs_epsilon(models, pi):
    from peer.dp.accounting import rs_epsilon

    return rs_epsilon([fresh(m) for m in models], pi, 1e-5).pld


def test_forged_poisson_entry_is_rejected_by_its_order_two_moment(tmp_path):
    """A subsampled record has no closed form: its entry's order-2 Rényi divergence must reach
    the record's order-2 RDP. A more private Poisson model's PLD (σ = 2 for the record's σ = 1)
    falls far short; the honest entry passes."""
    donor = TrainingRecord.constant("add-remove", 2000, 0.1, 1.0, 2.0, 0.01)
    pc.cached_profile(POISSON, tmp_path)
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is not None
    _forge(tmp_path, POISSON, donor)
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is None
    problem = pc.fingerprint_problem(POISSON, "add-remove", ACC, fresh(donor).pld, fresh(POISSON).rdp)
    assert problem is not None and "order-2" in problem


def test_forged_rdp_curve_is_rejected(tmp_path):
    """The stored RDP curve is recomputed from the record: a lowered one (the published RDP ε)
    is refused, even with the honest PLD."""
    lowered = np.array(fresh(POISSON).rdp) * 0.5
    _forge(tmp_path, POISSON, POISSON, rdp=lowered)
    assert pc.load_entry(tmp_path, POISSON, "add-remove", ACC) is None


@pytest.mark.parametrize(
    "model", [*MODELS, WEAK], ids=["poisson", "poisson-replace", "full-batch", "approx-dp", "full-batch-mu-8"]
)
def test_honest_entries_match_their_fingerprint(model):
    profile = fresh(model)
    assert pc.fingerprint_problem(model, model.adjacency, ACC, profile.pld, profile.rdp) is None


def test_approx_dp_entry_must_be_its_records_pld(tmp_path):
    other = ApproxDP(0.1, 1e-9, "add-remove")
    model = MODELS[3]
    _forge(tmp_path, model, other, rdp=fresh(model).rdp)
    assert pc.load_entry(tmp_path, model, model.adjacency, ACC) is None
