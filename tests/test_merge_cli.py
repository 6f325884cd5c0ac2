"""``privfusion merge`` outside a daemon: through a site's release desk (charged to its ledger,
signed) or from a bare pool directory (no ledger: said loudly, and recorded as uncharged).

Run as a user runs it: the command in a subprocess (``peer_harness.cli``)."""

from __future__ import annotations

import json

import pytest
from peer_harness import cli, make_pool, make_site, pin

from peer.budget.ledger import Ledger
from peer.net.client import verify_saved_release
from peer.net.trust import TrustStore
from peer.nn.store import load_model

MERGE = ("--target-epsilon", "50", "--delta", "1e-5", "--method", "rs", "--json")


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
    return make_pool(tmp_path_factory.mktemp("pool") / "pool")


def test_a_merge_of_a_bare_pool_says_loudly_that_it_is_uncharged(pool_dir, tmp_path):
    out = tmp_path / "bare.safetensors"
    proc = cli("merge", "--pool", str(pool_dir), "--out", str(out), *MERGE)
    assert "UNCHARGED" in proc.stderr and "outside any site's ledger" in proc.stderr
    result = json.loads(proc.stdout)
    assert result["charged"] is False and "ledger_entry_id" not in result
    assert load_model(tmp_path, "bare").metadata["charged"] is False


def test_a_merge_through_a_site_is_charged_to_its_ledger_and_signed(pool_dir, tmp_path):
    a = make_site(tmp_path, "site-a", pools={"digits": pool_dir})
    b = make_site(tmp_path, "site-b", models={})
    pin(b, a)
    out = tmp_path / "got" / "rs"
    proc = cli("merge", "--site", str(a.root), "--pool", "digits", "--for", "site-b", "--out", str(out), *MERGE)
    assert "UNCHARGED" not in proc.stderr
    result = json.loads(proc.stdout)
    assert result["charged"] is True and result["signer"] == "site-a" and result["served_again"] is None
    with Ledger(a.ledger) as led:
        [entry] = led.entries()
        assert entry.level == "data" and entry.counterparty == "site-b"
        assert str(entry.entry_id) == result["ledger_entry_id"]
        assert entry.release_id == result["record"]["release_id"]
        assert [e["kind"] for e in led.events(entry.release_id)] == ["sent"]
    # the files verify offline against site-a's pinned certificate, as a received release does
    checked = verify_saved_release(out, TrustStore(b.identity_dir / "trusted"))
    assert checked["signer"] == "site-a"

    # asked again: the identical bytes are served again, at no new charge
    again = json.loads(
        cli(
            "merge", "--site", str(a.root), "--pool", "digits", "--for", "site-b", "--out", str(tmp_path / "2"), *MERGE
        ).stdout
    )
    assert again["served_again"] and again["ledger_entry_id"] == result["ledger_entry_id"]
    with Ledger(a.ledger) as led:
        assert len(led.entries()) == 1 and len(led.served_again()) == 1


def test_a_merge_through_a_site_names_what_is_missing_or_not_allowed(pool_dir, tmp_path):
    a = make_site(tmp_path, "site-a", pools={"digits": pool_dir})
    out = str(tmp_path / "x.safetensors")
    proc = cli("merge", "--site", str(a.root), "--pool", "digits", "--out", out, *MERGE, check=False)
    assert proc.returncode == 2 and "--for" in proc.stderr
    proc = cli(
        "merge", "--site", str(a.root), "--pool", "digits", "--for", "site-b", "--seed", "1", "--out", out, *MERGE,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--seed" in proc.stderr
    proc = cli("merge", "--pool", "digits", "--for", "site-b", "--out", out, *MERGE, check=False)
    assert proc.returncode == 2 and "--for" in proc.stderr and "--site" in proc.stderr
    assert not a.ledger.exists()  # refused before the site (and its ledger) was opened
