"""The ledger's anchor (``peer.budget.anchor``): cutting the end off the ledger, or putting an
older copy back, is refused at open.

The hash chain alone cannot see a tail cut off with the ``totals`` cache rewritten to match:
that ledger verified cleanly, and the ε the cut charges had spent was admitted again (issue 20:
1.5 released against a budget of 1.0). The anchor file beside the ledger records each chain's
head, fsync'd before any byte of a release may leave; a ledger behind it is refused.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3

import pytest
from ledger_reference import anchored_points, gaussian_record, laplace_record

from peer.base.errors import BudgetExhausted, FailedPrecondition
from peer.budget.anchor import anchor_path
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy


def pure_policy(epsilon=1.0) -> Policy:
    return Policy.from_mapping(
        {
            "peers": {"*": {"allow": ["features", "weights", "merge", "fuse", "ledger"]}},
            "model": {"total": {"epsilon": epsilon, "delta": 0.0}},
            "data": {"unit": "record:add-remove", "epsilon": 50.0, "delta": 1e-5},
        }
    )


def released(path) -> float:
    """The pure ε of every charge the file holds (what left the site, whatever the cache says)."""
    con = sqlite3.connect(path)
    try:
        return sum(r[0] for r in con.execute("SELECT pure_epsilon FROM charges"))
    finally:
        con.close()


def cut_last_charge(path) -> None:
    """What an attacker with write access to the ledger file does: drop the triggers, delete
    the last charge and its budget rows, and rewrite ``totals`` to the sums of what is left, so
    that the chain and the cache agree."""
    con = sqlite3.connect(path)
    try:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            con.execute(f"DROP TRIGGER {name}")
        (last,) = con.execute("SELECT MAX(seq) FROM charges").fetchone()
        con.execute("DELETE FROM charge_budgets WHERE seq = ?", (last,))
        con.execute("DELETE FROM charge_models WHERE seq = ?", (last,))
        con.execute("DELETE FROM charges WHERE seq = ?", (last,))
        for budget, *_ in con.execute("SELECT budget FROM totals").fetchall():
            rows = con.execute(
                "SELECT c.seq, c.rdp, c.pure_epsilon FROM charges c JOIN charge_budgets b ON b.seq = c.seq"
                " WHERE b.budget = ? ORDER BY c.seq",
                (budget,),
            ).fetchall()
            rdp = [0.0] * len(json.loads(rows[0][1]))
            pure = 0.0
            for _, vec, p in rows:
                rdp = [a + b for a, b in zip(rdp, json.loads(vec), strict=True)]
                pure += p
            con.execute(
                "UPDATE totals SET count = ?, rdp = ?, pure_epsilon = ?, last_seq = ? WHERE budget = ?",
                (len(rows), json.dumps(rdp, separators=(",", ":")), pure, rows[-1][0], budget),
            )
        con.commit()
    finally:
        con.close()


def spend_the_budget(path) -> None:
    """Budget ε = 1.0 (pure), two Laplace releases of ε = 0.5 each; a third is refused."""
    with Ledger(path, pure_policy()) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
        led.charge(laplace_record(epsilon=0.5), "b")
        with pytest.raises(BudgetExhausted):
            led.charge(laplace_record(epsilon=0.5), "b")
    assert released(path) == 1.0


def test_the_issue_truncation_is_refused_at_open(tmp_path):
    """Issue 20, item 6, with its numbers. Without the anchor (the old ledger) the cut file
    verifies and admits another 0.5: 1.5 released against a budget of 1.0. With it, the open
    is refused, naming both files and the charge that is missing."""
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    cut_last_charge(path)

    # the failure as the issue found it: the same cut file, seen with no anchor, reopens
    # cleanly and lets the budget be spent again
    old = tmp_path / "old" / "ledger.sqlite"
    old.parent.mkdir()
    shutil.copy(path, old)
    with Ledger(old, pure_policy()) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
    assert released(old) + 0.5 == 1.5  # the cut charge left the site too

    with pytest.raises(FailedPrecondition) as refused:
        Ledger(path, pure_policy())
    msg = str(refused.value)
    assert str(path) in msg and str(anchor_path(path)) in msg
    assert "behind its anchor" in msg and "the anchor records charge 2" in msg and "end at charge 1" in msg
    assert refused.value.reason == "LEDGER_BEHIND_ANCHOR"
    with pytest.raises(FailedPrecondition, match="behind its anchor"):
        Ledger(path)  # read-only opens (ledger show) refuse it too


def test_an_older_copy_put_back_is_refused(tmp_path):
    """Rollback: a backup taken after one charge, restored after the budget was spent."""
    path = tmp_path / "ledger.sqlite"
    backup = tmp_path / "backup.sqlite"
    with Ledger(path, pure_policy()) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
    shutil.copy(path, backup)
    with Ledger(path, pure_policy()) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
    shutil.copy(backup, path)
    with pytest.raises(FailedPrecondition, match="the anchor records charge 2"):
        Ledger(path, pure_policy())


def test_a_deleted_ledger_does_not_start_a_fresh_budget(tmp_path):
    """Deleting the ledger file would create an empty one at the same path: refused."""
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    path.unlink()
    with pytest.raises(FailedPrecondition, match="it holds no charges"):
        Ledger(path, pure_policy())


def test_a_rewritten_tail_of_the_same_length_is_refused(tmp_path):
    """Cut the last charge and charge a cheaper one in its place (the chain is re-linked by the
    ledger itself): same length, other head."""
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    cut_last_charge(path)
    shutil.copy(anchor_path(path), tmp_path / "kept.anchor")
    anchor_path(path).unlink()
    with Ledger(path, pure_policy()) as led:
        led.charge(laplace_record(epsilon=0.01), "b")
    shutil.copy(tmp_path / "kept.anchor", anchor_path(path))
    with pytest.raises(FailedPrecondition, match=r"the anchor records charge 2 with hash [0-9a-f]{16}…, the ledger's"):
        Ledger(path, pure_policy())


def test_cutting_a_sent_event_cannot_reopen_a_cancellation(tmp_path):
    """A "sent" event forbids cancelling (a refund) the charge; cutting it off is refused."""
    path = tmp_path / "ledger.sqlite"
    with Ledger(path, pure_policy()) as led:
        e = led.charge(laplace_record(epsilon=0.5), "b")
        led.record_event(e.release_id, "sent")
    con = sqlite3.connect(path)
    con.execute("DROP TRIGGER events_no_delete")
    con.execute("DELETE FROM events")
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match=r"the anchor records event 1.*it holds no events"):
        Ledger(path, pure_policy())


def test_cutting_a_served_again_row_is_refused(tmp_path):
    """A served-again row says which counterparty holds a release at no charge; the receipt it
    returns carries the charge chain's position at the time."""
    from test_ledger import full_batch

    from peer.dp.accounting.release_accounting import dpsgd_record

    path = tmp_path / "ledger.sqlite"
    with Ledger(path, pure_policy()) as led:
        e = led.charge(laplace_record(epsilon=0.5), "b")
        led.cancel(e.release_id, "the partner refused")
        d = led.charge(dpsgd_record(full_batch(6.0, steps=2), 1e-5, subject="pool/m0"), "b")
        served = led.serve_again(d.release_id, "c")
    assert (served["ledger_seq"], served["ledger_head"]) == (d.entry_id, d.hash)
    con = sqlite3.connect(path)
    con.execute("DROP TRIGGER served_again_no_delete")
    con.execute("DELETE FROM served_again")
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="the anchor records served-again row 1"):
        Ledger(path, pure_policy())


def test_a_ledger_without_an_anchor_is_anchored_at_first_open_and_says_so(tmp_path, caplog):
    """Ledgers written by the previous version have no anchor: the first open creates it from
    the current state (logged as a warning: a truncation before it cannot be detected), and
    from then on a cut is refused."""
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    anchor_path(path).unlink()  # as the previous version left it
    with caplog.at_level(logging.WARNING, logger="peer.budget.ledger"):
        Ledger(path, pure_policy()).close()
    assert any("anchor-created" in r.getMessage() and "cannot be detected" in r.getMessage() for r in caplog.records)
    assert anchor_path(path).exists()
    cut_last_charge(path)
    with pytest.raises(FailedPrecondition, match="behind its anchor"):
        Ledger(path, pure_policy())


def test_a_read_only_open_never_writes_an_anchor(tmp_path):
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    anchor_path(path).unlink()
    with Ledger(path) as led:
        assert len(led.entries()) == 2
    assert not anchor_path(path).exists()


def test_a_crash_between_commit_and_anchor_is_caught_up(tmp_path):
    """The ledger may be ahead of its anchor (a crash after the commit, before the anchoring:
    the release never left): it opens, and the anchor is extended to the file."""
    path = tmp_path / "ledger.sqlite"
    spend_the_budget(path)
    lines = anchor_path(path).read_text().splitlines(keepends=True)
    anchor_path(path).write_text("".join(lines[:-1]) + lines[-1][:20])  # last point lost, torn
    with Ledger(path, pure_policy()) as led:
        last = led.entries()[-1]
    assert last.entry_id == 2 and anchored_points(anchor_path(path))["charges"] == (2, last.hash)


def test_the_anchor_matches_an_independent_reading_of_both_files(tmp_path):
    """``ledger_reference.anchored_points`` reads the anchor as docs/architecture.md specifies
    it; after charges, a cancellation, a served-again row and events, each chain's anchored
    point is its last row in the SQLite file, read with plain sqlite3."""
    from test_ledger import full_batch

    from peer.dp.accounting.release_accounting import dpsgd_record

    path = tmp_path / "ledger.sqlite"
    policy = Policy.from_mapping(
        {
            "peers": {"*": {"allow": ["features", "weights", "merge"]}},
            "model": {"total": {"epsilon": 50.0, "delta": 1e-5}},
            "data": {"unit": "record:add-remove", "epsilon": 50.0, "delta": 1e-5},
        }
    )
    with Ledger(path, policy) as led:
        a = led.charge(gaussian_record(noise_std=20.0), "b")
        led.record_event(a.release_id, "sent")
        c = led.charge(laplace_record(epsilon=0.5), "c")
        led.cancel(c.release_id, "never left")
        d = led.charge(dpsgd_record(full_batch(6.0, steps=2), 1e-5, subject="pool/m0"), "b")
        led.serve_again(d.release_id, "c")
        assert led.chain_position(d.entry_id) == (3, d.hash)
    con = sqlite3.connect(path)
    expected = {
        "charges": con.execute("SELECT seq, hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone(),
        "events": con.execute("SELECT id, hash FROM events ORDER BY id DESC LIMIT 1").fetchone(),
        "cancellations": con.execute("SELECT id, hash FROM cancellations ORDER BY id DESC LIMIT 1").fetchone(),
        "served_again": con.execute("SELECT id, hash FROM served_again ORDER BY id DESC LIMIT 1").fetchone(),
    }
    con.close()
    assert anchored_points(anchor_path(path)) == expected
