"""A site's own network served and fused: public structure on the wire, its releases per group
element, DP-SGD pools of it, refusals (a different network, Fuse of it, a batch-statistics BatchNorm)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_harness import client, make_site, pin_each_other, roster_of, running
from site_models import networks
from site_models.networks import SmallResNet, randomise

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.nn.imported import (
    check_same_structure,
    first_difference,
    import_model,
    imported_architecture,
    structure_of,
    structure_sha256,
)
from peer.nn.tracing import derive_structure

NETWORKS = Path(networks.__file__)


def test_the_public_architecture_carries_the_structure_and_its_digest():
    structure = derive_structure(SmallResNet(), [1, 8, 8])
    arch = imported_architecture(structure)
    assert arch["kind"] == "imported" and arch["structure_sha256"] == structure_sha256(structure)
    # it round-trips through JSON text (the wire's architecture_json) to the same structure
    assert structure_sha256(structure_of(json.loads(json.dumps(arch)))) == arch["structure_sha256"]
    tampered = json.loads(json.dumps(arch))
    tampered["structure"]["groups"][0]["size"] += 0  # unchanged: still accepted
    structure_of(tampered)
    tampered["structure"]["input_shape"] = [1, 8, 9]
    with pytest.raises(InvalidArgument, match="structure_sha256"):
        structure_of(tampered)


def test_another_network_is_refused_naming_the_first_difference():
    ours = derive_structure(SmallResNet(), [1, 8, 8])
    wider = imported_architecture(derive_structure(SmallResNet(c1=10), [1, 8, 8]))
    with pytest.raises(
        FailedPrecondition, match=r"first difference at structure\.groups\[0\]\.size: ours 8, theirs 10"
    ):
        check_same_structure(ours, wider, "riverside")
    check_same_structure(ours, imported_architecture(ours))  # the same network passes
    with pytest.raises(FailedPrecondition, match="'mlp' architecture"):
        check_same_structure(ours, {"kind": "mlp", "input_dim": 64, "hidden": [], "output_dim": 10})
    assert first_difference({"a": [1, 2]}, {"a": [1, 2, 3]}) == "structure.a: 2 entries here, 3 in theirs"
    assert first_difference({"a": 1}, {"a": 1}) is None


def test_dp_sgd_refuses_a_batch_norm_without_running_statistics():
    from peer.dp.training import check_private_training

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.norm = torch.nn.BatchNorm1d(4, track_running_stats=False)

    with pytest.raises(InvalidArgument, match=r"model\.norm.*BatchNorm1d without running statistics"):
        check_private_training(Mixer())
    check_private_training(SmallResNet())  # running statistics: frozen per step, accepted


def test_a_records_gradient_does_not_depend_on_the_other_records():
    """The reason for eval mode: with BatchNorm frozen, record i's per-example gradient is the
    same whatever the other records of the batch are (in train mode it would not be)."""
    from peer.dp.training import classifier_loss, per_example_gradients

    model = randomise(SmallResNet()).eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.standard_normal((6, 1, 8, 8)), dtype=torch.float32)
    y = torch.as_tensor(rng.integers(0, 10, 6))
    x2 = x.clone()
    x2[1:] = torch.as_tensor(rng.standard_normal((5, 1, 8, 8)), dtype=torch.float32)
    g1 = per_example_gradients(classifier_loss(model), params, x, y)
    g2 = per_example_gradients(classifier_loss(model), params, x2, y)
    for k in g1:
        torch.testing.assert_close(g1[k][0], g2[k][0], rtol=0, atol=0)


def _pool(directory: Path, factory: str, init_seed: int = 0):
    """A two-model DP-SGD pool of an imported network (3 steps: small, but real)."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.pools import load_splits, save_trained
    from peer.dp.training import train_dpsgd_module
    from peer.nn.imported import load_factory
    from peer.nn.tracing import derive_structure

    s = load_splits("digits")
    make = load_factory(factory)
    arch = imported_architecture(derive_structure(make(), [1, 8, 8]))
    rnd = make_randomness()  # CSPRNG, as production pools (a fixed seed is served by --simulation only)
    for i, sigma in enumerate((4.0, 12.0)):
        m = train_dpsgd_module(
            make,
            arch,
            [1, 8, 8],
            s.x_train[:200],
            s.y_train[:200],
            TrainingRecord.constant("replace-one", 3, 1.0, 1.0, sigma),
            init_seed=init_seed,
            randomness=rnd.spawn(),
            delta=1e-5,
            public_x=s.x_val[:64],
        )
        save_trained(directory, f"m{i}", m, data=s.description, factory=factory)
    return s


def test_a_pool_of_an_imported_network_merges_and_keeps_the_sites_keys(tmp_path):
    from peer.base.rng import make_randomness
    from peer.dp.pools import load_pool, merge_pool

    s = _pool(tmp_path / "pool", f"{NETWORKS}:small_resnet")
    pool = load_pool(tmp_path / "pool")
    assert [m.architecture["kind"] for m in pool] == ["imported", "imported"]
    assert list(pool[0].arrays) == list(SmallResNet().state_dict())  # the site's names and order
    # BatchNorm statistics come from the public rows, not from the initial (0, 1)
    assert not np.allclose(pool[0].arrays["stem_bn.running_mean"], 0.0)
    merged = merge_pool(
        pool,
        "rs",
        30.0,
        1e-5,
        selection="utility",
        validation=(s.x_val, s.y_val),
        randomness=make_randomness(1),
        subject="p",
    )
    assert merged.record.mechanism == "rs-merge" and merged.architecture["kind"] == "imported"
    assert set(merged.arrays) == set(SmallResNet().state_dict())


def test_a_daemon_lists_its_own_network_and_releases_it_per_group_element(tmp_path):
    """ReleaseFeatures / ReleaseWeights of a site's own network: the public structure on the
    wire, named tensors per group and per state-dict key, one charge per release (its record
    says the unit is one group element); Fuse of it is refused (FAILED_PRECONDITION)."""
    from peer.budget.ledger import Ledger
    from peer.net.client import PeerError
    from peer.net.codec import group_features_from_release, group_weights_from_release

    site = make_site(tmp_path, "st-anne", probe=np.zeros((4, 64), np.float32))
    other = make_site(tmp_path, "riverside")
    pin_each_other(site, other)
    model = randomise(networks.small_resnet())
    import_model(site.root / "own_models", "resnet", model, [1, 8, 8], factory=f"{NETWORKS}:small_resnet")
    probe = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    with running(site) as (_, address):
        c = client(other, address, peer="st-anne")
        try:
            info = c.info()
            (m,) = [m for m in info.models if m.name == "resnet"]
            arch = m.architecture  # parsed by the client from the wire's architecture_json
            assert arch["kind"] == "imported" and "factory" not in json.dumps(arch)
            structure = structure_of(arch)
            assert list(m.hidden_sizes) == [g.size for g in structure.groups]
            f = c.features("resnet", probe, activation_epsilon=2.0, weight_epsilon=3.0)
            w = c.weights("resnet", epsilon=4.0, delta=1e-5)
            with pytest.raises(PeerError) as e:
                c.fuse(
                    "resnet",
                    partner="x",
                    partner_model="y",
                    alpha=0.5,
                    activation_epsilon=1.0,
                    weight_epsilon=1.0,
                    weights_epsilon=1.0,
                    weights_delta=1e-5,
                )
            assert e.value.status == "FAILED_PRECONDITION" and "method ldp" in str(e.value)
        finally:
            c.close()
    assert f.architecture == arch and w.architecture == arch
    acts, features = group_features_from_release(structure, f.metadata, f.arrays, 6)
    assert set(acts) == {g.name for g in structure.groups} and set(features) == set(structure.parameters)
    assert all(len(np.unique(v)) <= 3 for v in features.values())  # multi-bit: three levels per key
    weights = group_weights_from_release(structure, w.arrays)
    assert set(weights) == set(structure.parameters)
    with Ledger(site.ledger) as ledger:
        records = [e.record for e in ledger.entries()]
    assert [r.parameters["release"] for r in records] == ["group_features", "group_weights"]
    assert all(r.parameters["unit_is"] == "one group element" for r in records)
    assert records[0].epsilon == pytest.approx(5.0) and records[1].epsilon == 4.0
    assert records[0].parameters["probe_rows"] == 6


def test_a_round_refuses_a_peer_whose_network_differs_before_anything_is_charged(tmp_path):
    """The peer offers a pool of a *wider* ResNet: the requester sees it in GetPeerInfo and
    drops the peer with FAILED_PRECONDITION naming the first difference; nothing is asked, so
    nothing is charged; likewise method ldp, when the peer offers no model of our network."""
    from coordinator_free.rounds import RoundConfig
    from coordinator_free.runner import load_local_site, run_round
    from peer.budget.ledger import Ledger

    wide = tmp_path / "wide.py"
    wide.write_text("from site_models.networks import SmallResNet\n\ndef make():\n    return SmallResNet(c1=10)\n")
    s = _pool(tmp_path / "pool", f"{wide}:make")
    a = make_site(tmp_path, "st-anne", probe=s.x_val[:32].astype(np.float32))
    b = make_site(tmp_path, "riverside", pools={"dp": tmp_path / "pool"})
    pin_each_other(a, b)
    import_model(
        a.root / "own_models",
        "resnet",
        randomise(networks.small_resnet()),
        [1, 8, 8],
        factory=f"{NETWORKS}:small_resnet",
    )
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_of(tmp_path / "roster.toml", {"st-anne": addr_a, "riverside": addr_b}, a, b)
        local = load_local_site(a.config, "resnet")
        for method, why in (
            ("merged", "first difference at structure.groups[0].size: ours 8, theirs 10"),
            ("ldp", "'riverside' offers no model of this network"),
        ):
            cfg = RoundConfig(  # go on: ε 2 carries no signal, and the refusal tested is the network's
                roster=tmp_path / "roster.toml",
                model="resnet",
                method=method,
                out=tmp_path / "out",
                quorum=2,
                go_on_without_signal=True,
            )
            result = run_round(local, roster, cfg, write=False)
            assert result.status == "aborted"
            (drop,) = [e for e in result.report["events"] if e["event"] == "dropped"]
            assert (drop["peer"], drop["status"]) == ("riverside", "FAILED_PRECONDITION")
            assert why in drop["reason"], drop
            assert result.report["charges"] == []
    with Ledger(b.ledger) as ledger:
        assert ledger.entries() == []


def test_a_merge_of_an_own_network_is_served_again_in_the_same_shapes(tmp_path):
    """Charge-once for a pool of a site's own network: the second answer is the stored entry,
    byte for byte and shape for shape — BatchNorm's 0-d ``num_batches_tracked`` included."""
    _pool(tmp_path / "pool", f"{NETWORKS}:small_resnet")
    a = make_site(tmp_path, "st-anne", pools={"dp": tmp_path / "pool"})
    b = make_site(tmp_path, "riverside")
    pin_each_other(a, b)
    with running(a) as (_, address):
        c = client(b, address, peer="st-anne")
        try:
            info = c.info()
            (pool,) = info.pools
            assert pool.architecture["kind"] == "imported" and list(pool.methods) == ["rs", "lc"]
            first = c.merged("dp", method="rs", epsilon=30.0, delta=1e-5)
            again = c.merged("dp", method="rs", epsilon=30.0, delta=1e-5)
        finally:
            c.close()
    assert not first.receipt.served_again and again.receipt.served_again
    assert first.architecture == again.architecture and first.architecture["kind"] == "imported"
    assert np.shape(again.arrays["stem_bn.num_batches_tracked"]) == ()
    for k, v in first.arrays.items():
        assert np.shape(again.arrays[k]) == np.shape(v) and np.asarray(again.arrays[k]).tobytes() == v.tobytes(), k


@pytest.mark.slow  # 256 LC candidates, each judged in a module rebuilt by the factory: ~30-100 s here
def test_an_lc_merge_of_an_own_network_is_judged_in_the_sites_own_module(tmp_path):
    from peer.dp.pools import load_pool, merge_pool

    s = _pool(tmp_path / "pool", f"{NETWORKS}:small_resnet")
    merged = merge_pool(
        load_pool(tmp_path / "pool"), "lc", 60.0, 1e-5, selection="utility", validation=(s.x_val, s.y_val)
    )
    assert merged.record.mechanism == "lc-merge" and merged.architecture["kind"] == "imported"
    assert 0.0 <= merged.choice.utility <= 1.0 and set(merged.arrays) == set(SmallResNet().state_dict())


def test_a_stored_network_with_aliased_keys_is_not_released_and_nothing_is_charged(tmp_path):
    """Issue 20, item 4, at the daemon: a model stored before imports refused aliases
    (``self.shortcut = self.skip``: four keys, two tensors, no group) had its rows released
    twice under one charge by ReleaseWeights (the structure alone cannot show the alias). The
    daemon now builds the site's module for the weights release too and refuses with
    FAILED_PRECONDITION naming both keys, before the ledger is touched."""
    from peer.budget.ledger import Ledger
    from peer.net.client import PeerError
    from peer.nn.imported import save_imported
    from peer.nn.tracing import PermutationStructure

    site = make_site(tmp_path, "st-anne")
    other = make_site(tmp_path, "riverside")
    pin_each_other(site, other)
    model = networks.aliased_skip()
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    structure = PermutationStructure((4,), (), {k: tuple(v.shape) for k, v in arrays.items()})
    save_imported(site.root / "own_models", "aliased", f"{NETWORKS}:aliased_skip", structure, arrays)
    with running(site) as (_, address):
        c = client(other, address, peer="st-anne")
        try:
            with pytest.raises(PeerError) as e:
                c.weights("aliased", epsilon=4.0, delta=1e-5)
        finally:
            c.close()
    assert e.value.status == "FAILED_PRECONDITION"
    assert "'skip.weight' = 'shortcut.weight'" in str(e.value) and "nothing was charged" in str(e.value)
    with Ledger(site.ledger) as ledger:
        assert list(ledger.entries()) == []
