"""Files written by the previous version still read, verify and account as they did.

``tests/fixtures/previous_version/`` was written by ``tests/fixtures/make_previous_version.py``
at the commit before release records became typed events: a ledger with per-neuron and
per-entry Laplace / multi-bit / Gaussian releases, a parallel composite, a DP-SGD segment, an
RS merge, an LC merge, a cancelled charge, a delivery event and a release served again; a pool
with one DP-SGD model; a signed receipt. ``expected.json`` holds what that code computed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from peer.base.records import ReleaseRecord
from peer.budget.ledger import Ledger, per_neuron_record
from peer.dp.accounting.conversions import DEFAULT_ORDERS, pld_epsilon, rdp_to_epsilon
from peer.dp.accounting.release_accounting import pld_of_record, rdp_of_record
from peer.dp.pools import load_pool
from peer.net.receipts import SignedReceipt, verify_receipt

FIXTURE = Path(__file__).parent / "fixtures" / "previous_version"


@pytest.fixture
def old(tmp_path) -> tuple[Path, dict]:
    """A copy of the fixture (opening a ledger writes beside it) and what the old code computed."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    return tmp_path / "old", json.loads((FIXTURE / "expected.json").read_text())


def _policy():
    import sys

    sys.path.insert(0, str(FIXTURE.parent))
    try:
        from make_previous_version import policy
    finally:
        sys.path.pop(0)
    return policy()


def test_the_old_ledger_opens_verifies_and_keeps_every_records_bytes(old):
    path, expected = old
    ledger = Ledger(path / "ledger.db", _policy())  # verify() runs at open
    ledger.verify()
    assert list(ledger.orders) == expected["orders"]
    entries = ledger.entries(include_cancelled=True)
    assert {e.release_id for e in entries} == set(expected["entries"])
    kinds = {(e.record.mechanism, e.record.unit) for e in entries}
    for kind in ("laplace", "multibit", "gaussian"):
        assert {(kind, "neuron"), (kind, "entry")} <= kinds
    assert {"composite", "dpsgd", "rs-merge", "lc-merge"} <= {k for k, _ in kinds}
    raw = dict(ledger._conn().execute("SELECT release_id, record FROM charges").fetchall())
    for e in entries:
        want = expected["entries"][e.release_id]
        stored = raw[e.release_id].encode()
        assert e.record.canonical_json() == stored
        assert ReleaseRecord.from_json(stored).canonical_json() == stored
        assert hashlib.sha256(stored).hexdigest() == want["record_sha256"]
        assert e.entry_id == want["entry_id"] and list(e.rdp) == want["stored_rdp"]
    assert [c["release_id"] for c in ledger.cancellations()] == [expected["cancelled"]]
    (served,) = ledger.served_again()
    assert served.items() <= expected["served_again"].items()
    ledger.close()


def test_the_old_records_account_to_the_same_figures(old):
    path, expected = old
    ledger = Ledger(path / "ledger.db")
    delta = expected["delta"]
    for e in ledger.entries(include_cancelled=True):
        want = expected["entries"][e.release_id]
        charged = per_neuron_record(e.record)
        assert charged.epsilon == pytest.approx(want["charged_epsilon"], rel=1e-12)
        np.testing.assert_allclose(rdp_of_record(charged, ledger.orders), want["rdp_at_ledger_orders"], rtol=1e-12)
        rdp = rdp_of_record(charged, DEFAULT_ORDERS)
        assert rdp_to_epsilon(DEFAULT_ORDERS, rdp, delta) == pytest.approx(want["epsilon_rdp"], rel=1e-12)
        assert pld_epsilon(pld_of_record(charged), delta) == pytest.approx(want["epsilon_pld"], rel=1e-9)
    ledger.close()


def test_the_old_ledgers_budgets_stand_where_they_stood_and_it_keeps_charging(old):
    path, expected = old
    ledger = Ledger(path / "ledger.db", _policy())
    got = [s.to_dict() for s in ledger.budget_states(pld=True)]
    assert [g["budget"] for g in got] == [b["budget"] for b in expected["budgets"]]
    for g, want in zip(got, expected["budgets"], strict=True):
        for k, v in want.items():
            assert g[k] == (pytest.approx(v, rel=1e-9) if isinstance(v, float) else v), k
    # the old file takes new charges and still verifies after them
    old_record = next(e.record for e in ledger.entries() if e.record.mechanism == "laplace")
    again = old_record.with_(release_id="0" * 32, counterparty="b")
    ledger.charge(again, "b")
    ledger.verify()
    ledger.close()
    Ledger(path / "ledger.db").close()  # and reopens (verify at open, against the anchor)


def test_the_old_pool_and_receipt_read_and_verify(old):
    path, expected = old
    (model,) = load_pool(path / "pool")
    record = ReleaseRecord.from_dict(expected["pool"]["p1"]["metadata_record"])
    assert hashlib.sha256(record.canonical_json()).hexdigest() == expected["pool"]["p1"]["record_sha256"]
    assert model.privacy.to_dict() == record.to_dict()["parameters"]["training"]
    receipt = SignedReceipt.from_json((path / "receipt.json").read_text())
    got = verify_receipt(receipt, (path / "signer.pem").read_bytes(), expected_signer="site-a")
    assert got.canonical_json() == receipt.record_json
    assert got.release_id == expected["receipt"]["release_id"]
    assert receipt.manifest_sha256 == hashlib.sha256(bytes.fromhex(expected["receipt"]["manifest"])).digest()
