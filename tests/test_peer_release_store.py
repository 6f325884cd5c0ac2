"""Data-level releases charged once: a merge asked for again is served from the site's release
store with the identical bytes, a "served again" ledger row and no new charge (real daemons)."""

import sqlite3

import numpy as np
import pytest
from peer_harness import client, make_pool, make_site, pin_each_other, running

from peer.base.errors import FailedPrecondition
from peer.budget.ledger import Ledger
from peer.net import wire
from peer.net.client import PeerError
from peer.net.daemon import open_site
from peer.net.releases import StoredRelease, pool_fingerprint, release_key, release_sha256

MERGE = dict(method="rs", epsilon=50.0, delta=1e-5)


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
    return make_pool(tmp_path_factory.mktemp("pool") / "pool")


@pytest.fixture
def sites(tmp_path, pool_dir):
    a = make_site(tmp_path, "site-a", pools={"digits": pool_dir})
    b = make_site(tmp_path, "site-b", models={})
    c = make_site(tmp_path, "site-c", models={})
    pin_each_other(a, b, c)
    return a, b, c


def sums(ledger_path):
    """Every budget's count and filter ε, and the number of charges."""
    with Ledger(ledger_path) as led:
        states = {s.key.name: (s.count, s.spent_epsilon) for s in led.budget_states()}
        return states, len(led.entries())


def tensors(release):
    return {k: np.asarray(v).tobytes() for k, v in release.arrays.items()}


def store_files(site):
    return sorted((site.root / "ledger.releases").glob("*.safetensors"))


def test_a_merge_asked_again_is_served_from_the_store_without_a_charge(sites, capsys):
    a, b, c = sites
    with running(a) as (_, address):
        with client(b, address, peer="site-a") as cb:
            first = cb.merged("digits", **MERGE)
            after_first = sums(a.ledger)
            again = cb.merged("digits", **MERGE)
            assert sums(a.ledger) == after_first  # budget totals and charges unchanged
        with client(c, address, peer="site-a") as cc:
            other = cc.merged("digits", **MERGE)  # another peer: same bytes, still no charge
        assert sums(a.ledger) == after_first
        with client(b, address, peer="site-a") as cb:
            new_target = cb.merged("digits", method="rs", epsilon=40.0, delta=1e-5)  # a different target is charged
    assert first.receipt.served_again == "" and first.receipt.record.counterparty == "site-b"
    assert tensors(again) == tensors(first) == tensors(other)
    for r, to in ((again, "site-b"), (other, "site-c")):
        assert r.receipt.served_again and r.receipt.served_to == to
        assert r.receipt.ledger_entry_id == first.receipt.ledger_entry_id  # names the original charge
        assert r.receipt.record_json == first.receipt.record_json
        assert r.receipt.recipient == to
    assert new_target.receipt.served_again == "" and new_target.receipt.ledger_entry_id != first.receipt.ledger_entry_id
    states, charges = sums(a.ledger)
    assert charges == 2 and sum(n for n, _ in states.values()) == 2
    with Ledger(a.ledger) as led:
        led.verify()
        served = led.served_again()
        entries = led.entries()
        # reconcile: every served-again row names a charged, data-level entry; totals count charges only
        assert [s["counterparty"] for s in served] == ["site-b", "site-c"]
        assert {s["entry_id"] for s in served} == {int(first.receipt.ledger_entry_id)}
        assert {str(s["id"]) for s in served} == {again.receipt.served_again, other.receipt.served_again}
        assert all(e.level == "data" for e in entries)
        assert led.summary(pld=False)["served_again"] == served
        # the original charge was served again: it can no longer be cancelled
        with pytest.raises(FailedPrecondition):
            led.cancel(first.receipt.record.release_id, "test")
    assert len(store_files(a)) == 2
    # what a site's operator reads: `privfusion ledger show` counts the releases served again
    from peer.cli import main

    assert main(["ledger", "show", "--db", str(a.ledger), "--no-pld"]) == 0
    text = capsys.readouterr().out
    assert "2 release(s) served again at no charge" in text
    assert text.count(f"entry {first.receipt.ledger_entry_id} again to site-") == 2


def test_a_tampered_store_entry_is_refused_and_never_served(sites):
    a, b, _ = sites
    with running(a) as (_, address), client(b, address, peer="site-a") as cb:
        cb.merged("digits", **MERGE)
        before = sums(a.ledger)
        [path] = store_files(a)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01  # one bit of the last tensor's bytes
        path.write_bytes(bytes(raw))
        with pytest.raises(PeerError) as e:
            cb.merged("digits", **MERGE)
        assert e.value.status == "FAILED_PRECONDITION" and "release store" in str(e.value)
        assert sums(a.ledger) == before  # refused: nothing served, nothing charged
        # the operator removes the entry: the next request makes and charges a new release
        for p in path.parent.iterdir():
            p.unlink()
        fresh = cb.merged("digits", **MERGE)
    assert fresh.receipt.served_again == "" and sums(a.ledger)[1] == before[1] + 1


def test_a_restarted_daemon_keeps_serving_from_the_store(sites):
    a, b, _ = sites
    with running(a) as (_, address), client(b, address, peer="site-a") as cb:
        first = cb.merged("digits", **MERGE)
    with running(a) as (_, address), client(b, address, peer="site-a") as cb:
        again = cb.merged("digits", **MERGE)
    assert again.receipt.served_again and tensors(again) == tensors(first)
    assert sums(a.ledger)[1] == 1


def test_an_entry_stored_but_never_charged_is_replaced_not_served(sites):
    """A crash between the store write and the charge leaves an entry whose bytes never left:
    it is discarded, and the request makes and charges a new release (charged exactly once)."""
    a, b, _ = sites
    site = open_site(a.config)
    try:
        merged = site.merge("digits", MERGE["method"], MERGE["epsilon"], MERGE["delta"], "site-b")
        tensors_ = [(k, merged.arrays[k]) for k in sorted(merged.arrays)]
        digest = release_sha256([(n, wire.digest(t)) for n, t in tensors_])
        record = merged.record.with_(parameters={**merged.record.parameters, "release_sha256": digest})
        key = release_key("digits", **MERGE, pool_fingerprint=pool_fingerprint(site.pool("digits")))
        site.releases.put(key, {}, StoredRelease(key, record, merged.architecture, {}, tensors_))
    finally:
        site.close()
    with running(a) as (_, address), client(b, address, peer="site-a") as cb:
        got = cb.merged("digits", **MERGE)
    assert got.receipt.served_again == "" and got.receipt.record.release_id != record.release_id
    assert len(store_files(a)) == 1  # the orphan's entry (same key) was replaced, not left beside
    with Ledger(a.ledger) as led:
        assert [e.release_id for e in led.entries()] == [got.receipt.record.release_id]
        assert led.served_again() == []


def test_verify_detects_an_edited_served_again_row(sites):
    a, b, _ = sites
    with running(a) as (_, address), client(b, address, peer="site-a") as cb:
        cb.merged("digits", **MERGE)
        cb.merged("digits", **MERGE)
    con = sqlite3.connect(a.ledger)
    con.execute("DROP TRIGGER served_again_no_update")
    con.execute("UPDATE served_again SET counterparty = 'site-z'")
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="served-again hash chain broken"):
        Ledger(a.ledger)


def test_a_served_again_receipt_verifies_only_as_signed(tmp_path):
    from dataclasses import replace

    from peer.base.errors import InvalidArgument
    from peer.base.records import ReleaseRecord
    from peer.net.identity import init_identity, load_identity
    from peer.net.receipts import Manifest, TensorEntry, sign_receipt, verify_receipt

    init_identity(tmp_path / "id", "site-a", ["127.0.0.1"])
    me = load_identity(tmp_path / "id")
    cert = (tmp_path / "id" / "site.crt").read_bytes()
    record = ReleaseRecord.from_json(
        b'{"counterparty":"site-b","delta":1e-05,"epsilon":1.0,"level":"data","mechanism":"rs-merge",'
        b'"release_id":"r1","sensitivity":1.0,"sensitivity_norm":"l2","unit":"record:replace-one"}'
    )
    manifest = Manifest("merged", "digits", "{}", "{}", (TensorEntry("w", 1, (2,), 8, bytes(32)),), 8)
    fresh = sign_receipt(me, "7", record, manifest)
    again = sign_receipt(me, "7", record, manifest, "3", "site-c")
    assert verify_receipt(again, cert, "site-a", manifest) == record and again.recipient == "site-c"
    assert fresh.recipient == "site-b" and fresh.payload() != again.payload()
    for edited in (
        replace(again, served_to="site-b"),
        replace(again, served_again="4"),
        replace(again, served_again="", served_to=""),  # not a fresh receipt either
        replace(fresh, served_again="3", served_to="site-c", signature=fresh.signature),
    ):
        with pytest.raises(InvalidArgument, match=r"receipt\.signature"):
            verify_receipt(edited, cert, "site-a")
    assert type(again).from_json(again.to_json()) == again


def test_concurrent_requests_for_one_merge_are_charged_once(sites):
    """One lock per request key: the first request makes, stores and charges; the others wait
    and are served the stored bytes again."""
    from concurrent.futures import ThreadPoolExecutor

    a, b, c = sites
    with (
        running(a) as (_, address),
        client(b, address, peer="site-a") as cb,
        client(c, address, peer="site-a") as cc,
        ThreadPoolExecutor(4) as pool,
    ):
        got = list(pool.map(lambda cl: cl.merged("digits", **MERGE), [cb, cc, cb, cc]))
    assert sum(1 for r in got if not r.receipt.served_again) == 1
    assert len({r.receipt.ledger_entry_id for r in got}) == 1
    assert all(tensors(r) == tensors(got[0]) for r in got)
    assert sums(a.ledger)[1] == 1
    with Ledger(a.ledger) as led:
        assert len(led.served_again()) == 3


def test_a_consistent_rewrite_of_a_stored_release_is_refused_not_served(sites):
    """Guard: a stored record is byte for byte the charged one before it is served again.

    An attacker who can write the release store rewrites an entry *consistently*: new noisy
    tensors, their digests in the JSON, and the record's ``release_sha256`` bound to them, under
    the same release id. The store's own checks pass (the entry agrees with itself); only the
    comparison with the record the ledger charged sees it. Served, it would be new noisy bytes
    for one charge — a second release paid for by nobody."""
    import json

    from safetensors.numpy import save_file

    a, _, _ = sites
    site = open_site(a.config)
    try:
        first = site.merge_release("digits", MERGE["method"], MERGE["epsilon"], MERGE["delta"], "site-b")
        key = release_key("digits", **MERGE, pool_fingerprint=pool_fingerprint(site.pool("digits")))
        st, js = site.releases.directory / f"{key}.safetensors", site.releases.directory / f"{key}.json"
        doc = json.loads(js.read_text())
        rewritten = [(n, np.asarray(t) + np.float32(0.01)) for n, t in first.tensors]  # "fresh noise"
        listed = [(n, wire.digest(t)) for n, t in rewritten]
        record = first.record.with_(parameters={**first.record.parameters, "release_sha256": release_sha256(listed)})
        save_file(dict(rewritten), str(st))
        doc.update(
            record_json=record.canonical_json().decode(),
            tensors=[{"name": n, "sha256": d.hex()} for n, d in listed],
        )
        js.write_text(json.dumps(doc, sort_keys=True, indent=1))
        assert site.releases.get(key).record.release_id == first.record.release_id  # self-consistent
        with pytest.raises(FailedPrecondition, match="differs from the one ledger entry"):
            site.merge_release("digits", MERGE["method"], MERGE["epsilon"], MERGE["delta"], "site-c")
        assert site.ledger.served_again() == [] and len(site.ledger.entries()) == 1
    finally:
        site.close()


def test_serve_again_refuses_a_model_level_charge(tmp_path):
    """Guard: ``Ledger.serve_again`` refuses model-level (LDP) charges. Such a release is
    private per counterparty; handing it to another one at no charge would spend that
    counterparty's budget without charging it. Nothing is written."""
    from ledger_reference import laplace_record

    from peer.budget.policy import Policy

    policy = Policy.from_mapping(
        {
            "peers": {"*": {"allow": ["features", "weights", "merge"]}},
            "model": {"total": {"epsilon": 10.0, "delta": 0.0}, "per_counterparty": {"epsilon": 1.0, "delta": 0.0}},
            "data": {"unit": "record:add-remove", "epsilon": 10.0, "delta": 1e-5},
        }
    )
    with Ledger(tmp_path / "ledger.sqlite", policy) as led:
        entry = led.charge(laplace_record(epsilon=1.0), "site-b")
        with pytest.raises(FailedPrecondition, match="model-level: only data-level releases are served again"):
            led.serve_again(entry.release_id, "site-c")
        assert led.served_again() == []
        states = {s.key.name: s.count for s in led.budget_states()}
    assert states.get("model/m/peer/site-c") is None and states["model/m/peer/site-b"] == 1
