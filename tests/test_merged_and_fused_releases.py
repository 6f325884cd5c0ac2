"""Merged and fused releases through real daemons: RS/LC from a pool, and a three-site fusion."""

import json

import numpy as np
import pytest
from peer_harness import ARCH, client, make_pool, make_site, model_arrays, pin_each_other, running

from peer.base.rng import make_randomness
from peer.budget.ledger import Ledger
from peer.dp.merging import combine
from peer.dp.pools import load_pool
from peer.ldp.fusion import fuse_arrays, permute_arrays
from peer.ldp.matching import match_graphs
from peer.ldp.mechanisms import perturb_graph, perturb_model_weights
from peer.net.client import PeerError, save_release
from peer.nn.architectures import model_from_arrays
from peer.nn.graph import extract_graph


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
    return make_pool(tmp_path_factory.mktemp("pool") / "pool")


@pytest.fixture
def pool_sites(tmp_path, pool_dir):
    a = make_site(tmp_path, "site-a", pools={"digits": pool_dir})
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def pool_dir_of(site):
    import tomllib

    cfg = tomllib.loads(site.config.read_text())
    return (site.root / cfg["site"]["pools"]["digits"]["models"]).resolve()


def test_rs_merge_releases_one_pool_model_unchanged_and_charges_the_data_budget(pool_sites, tmp_path):
    from peer.nn.store import load_model

    a, b = pool_sites
    with running(a) as (_, address), client(b, address) as c:
        info = c.info()
        got = c.merged("digits", method="rs", epsilon=50.0, delta=1e-5, out=tmp_path / "got" / "rs")
    assert [p.name for p in info.pools] == ["digits"] and list(info.pools[0].methods) == ["rs", "lc"]
    record = got.receipt.record
    assert record.mechanism == "rs-merge" and record.level == "data" and record.counterparty == "site-b"
    choice = got.metadata["choice"]
    assert choice["method"] == "rs" and abs(sum(choice["weights"]) - 1) < 1e-9
    assert got.arrays == {} and got.path == tmp_path / "got" / "rs.safetensors"  # streamed to the file
    save_release(got, tmp_path / "got" / "rs")
    released = load_model(tmp_path / "got", "rs").arrays
    members = load_pool(pool_dir_of(a))
    assert sum(all(np.array_equal(released[k], m.arrays[k]) for k in released) for m in members) == 1
    with Ledger(a.ledger) as led:
        [entry] = led.entries()
    assert entry.level == "data" and entry.release_id == record.release_id


def test_lc_merge_is_the_convex_combination_it_reports_and_cannot_share_models(pool_sites):
    a, b = pool_sites
    members = load_pool(pool_dir_of(a))
    with running(a) as (_, address), client(b, address) as c:
        got = c.merged("digits", method="lc", epsilon=50.0, delta=1e-5)
        lam = got.metadata["choice"]["weights"]
        want = combine([m.arrays for m in members], lam)
        for k in want:
            np.testing.assert_array_equal(got.arrays[k], want[k])
        assert got.receipt.record.mechanism == "lc-merge"
        # an LC merge and any other data-level release of the same models do not compose by
        # summing: the ledger refuses the second one, and nothing is released
        with pytest.raises(PeerError) as e:
            c.merged("digits", method="rs", epsilon=50.0, delta=1e-5)
        assert e.value.status == "FAILED_PRECONDITION"
        for kw, field, status in (
            (dict(pool="nope"), "pool", "NOT_FOUND"),
            (dict(method="avg"), "method", "INVALID_ARGUMENT"),
            (dict(epsilon=-1.0), "epsilon", "INVALID_ARGUMENT"),
        ):
            args = dict(pool="digits", method="rs", epsilon=50.0, delta=1e-5) | kw
            with pytest.raises(PeerError) as e:
                c.merged(args.pop("pool"), **args)
            assert e.value.status == status and field in str(e.value)
    with Ledger(a.ledger) as led:
        assert len(led.entries()) == 1


def test_merge_command_via_a_peer(pool_sites, tmp_path, capsys):
    from peer.cli import main

    a, b = pool_sites
    with running(a) as (_, address):
        code = main(
            [
                "merge",
                "--via",
                address,
                "--identity",
                str(b.identity_dir),
                "--pool",
                "digits",
                "--target-epsilon",
                "50",
                "--delta",
                "1e-5",
                "--method",
                "rs",
                "--out",
                str(tmp_path / "m.safetensors"),
            ]
        )
    out = capsys.readouterr().out
    assert code == 0 and "rs-merge" in out and (tmp_path / "m.safetensors").exists()
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["metadata"]["record"]["mechanism"] == "rs-merge" and doc["metadata"]["receipt"]["signer"] == "site-a"


# ------------------------------------------------------------------------ fusion across three sites

PROBE = np.random.default_rng(5).random((32, 64))


def test_fuse_dials_the_partner_matches_and_fuses_exactly_as_the_math_says(tmp_path):
    arrays_b, arrays_x = model_arrays(seed=1), model_arrays(seed=2)
    x = make_site(tmp_path, "site-x", models={"mx": (ARCH, arrays_x)}, seed=21)
    with running(x) as (_, x_address):
        b = make_site(
            tmp_path, "site-b", models={"mb": (ARCH, arrays_b)}, seed=12, probe=PROBE, peers={"site-x": x_address}
        )
        c = make_site(tmp_path, "site-c", models={})
        pin_each_other(b, x)
        pin_each_other(b, c)
        with running(b) as (_, b_address), client(c, b_address) as cl:
            got = cl.fuse(
                "mb",
                partner="site-x",
                partner_model="mx",
                alpha=0.3,
                activation_epsilon=4.0,
                weight_epsilon=4.0,
                weights_epsilon=8.0,
                weights_delta=1e-5,
            )
    # the same computation from the two models, B's probe set and both sites' fixed-seed streams
    # (X serves features and weights as one release: one stream, features first)
    clip = (0.0, 4.0)
    rb, rx = make_randomness(12).spawn(), make_randomness(21).spawn()
    own_noisy, _ = perturb_graph(
        extract_graph(ARCH, model_from_arrays(ARCH, arrays_b), PROBE),
        epsilon_x=4.0,
        epsilon_w=4.0,
        activation_clip=clip,
        randomness=rb,
    )
    their_noisy, _ = perturb_graph(
        extract_graph(ARCH, model_from_arrays(ARCH, arrays_x), PROBE),
        epsilon_x=4.0,
        epsilon_w=4.0,
        activation_clip=clip,
        randomness=rx,
    )
    perms = match_graphs(own_noisy, their_noisy).permutations
    their_weights, _ = perturb_model_weights(ARCH, arrays_x, epsilon=8.0, delta=1e-5, randomness=rx)
    own_weights, _ = perturb_model_weights(ARCH, arrays_b, epsilon=8.0, delta=1e-5, randomness=rb)
    want = fuse_arrays(own_weights, permute_arrays(ARCH, their_weights, perms), 0.3)
    for k in want:
        np.testing.assert_array_equal(got.arrays[k], want[k])
    # receipts: B's own to C, and X's one to B (on behalf of C) travels along (C does not pin
    # X: checked where pinned)
    record = got.receipt.record
    assert record.counterparty == "site-c" and record.parameters["composition"] == "sequential"
    assert record.epsilon == pytest.approx(4.0 + 4.0 + 8.0)
    [upstream] = got.upstream
    assert upstream.signer == "site-x" and upstream.record.counterparty == "site-b"
    assert upstream.record.parameters["on_behalf_of"] == "site-c"
    assert upstream.record.epsilon == pytest.approx(4.0 + 4.0 + 8.0)
    assert got.metadata["upstream"] == [upstream.ledger_entry_id]
    with Ledger(x.ledger) as led:
        [entry] = led.entries()
        assert (entry.counterparty, entry.subject) == ("site-b", "mx") and str(
            entry.entry_id
        ) == upstream.ledger_entry_id
        assert sorted(entry.budgets) == ["model/mx/peer/site-b", "model/mx/peer/site-c", "model/mx/total"]
    with Ledger(b.ledger) as led:
        [entry] = led.entries()
        assert entry.counterparty == "site-c" and entry.release_id == record.release_id


def test_fuse_refusals(tmp_path):
    b = make_site(tmp_path, "site-b", models={"mb": (ARCH, model_arrays())}, peers={"site-x": "127.0.0.1:1"})
    c = make_site(tmp_path, "site-c", models={})
    x = make_site(tmp_path, "site-x", models={})
    pin_each_other(b, c)
    kw = dict(
        partner="site-x",
        partner_model="mx",
        alpha=0.5,
        activation_epsilon=1.0,
        weight_epsilon=1.0,
        weights_epsilon=1.0,
        weights_delta=1e-5,
    )
    with running(b) as (_, address), client(c, address) as cl:
        with pytest.raises(PeerError) as e:
            cl.fuse("mb", **kw)  # no probe set at b
        assert e.value.status == "FAILED_PRECONDITION" and "probe" in str(e.value)
        with pytest.raises(PeerError) as e:
            cl.fuse("mb", **(kw | {"alpha": 1.5}))
        assert e.value.status == "INVALID_ARGUMENT" and "alpha" in str(e.value)
        with pytest.raises(PeerError) as e:
            cl.fuse("mb", **(kw | {"partner": "site-b"}))
        assert e.value.status == "INVALID_ARGUMENT" and "partner" in str(e.value)
    b2 = make_site(
        tmp_path / "2", "site-b", models={"mb": (ARCH, model_arrays())}, probe=PROBE, peers={"site-x": "127.0.0.1:1"}
    )
    c2 = make_site(tmp_path / "2", "site-c", models={})
    pin_each_other(b2, c2)
    with running(b2) as (_, address), client(c2, address, peer="site-b") as cl:
        with pytest.raises(PeerError) as e:
            cl.fuse("mb", **kw)  # x is not pinned at b2
        assert e.value.status == "FAILED_PRECONDITION" and "site-x" in str(e.value)
        pin_each_other(b2, x)
        with pytest.raises(PeerError) as e:
            cl.fuse("mb", **kw)  # pinned, but nobody listens there
        assert e.value.status == "UNAVAILABLE" and "site-x" in str(e.value)
    with Ledger(b2.ledger) as led:
        assert led.entries() == []
