"""Corrections to the charge chain, each with a chain of its own: cancelling a charge whose
release never left, and serving a data-level release again at no charge.

The rules are in ``peer.budget.ledger`` ("Cancelling a charge", "Serving a release again");
these functions are ``Ledger.cancel``, ``cancellations``, ``serve_again`` and ``served_again``.
The chains' checks are in ``peer.budget.verification``.
"""

from __future__ import annotations

import json
import logging
import sqlite3

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound
from peer.base.records import now_rfc3339
from peer.budget.anchor import AnchorPoint
from peer.budget.chain import GENESIS, cancel_hash, dumps, served_again_hash

# one logger for the ledger, whichever of its modules writes the line
from peer.budget.storage import LedgerStorage

log = logging.getLogger("peer.budget.ledger")


def cancel(ledger: LedgerStorage, release_id: str, reason: str) -> dict:
    """Withdraw the charge of a release that never left (see "Cancelling a charge" above).

    Refused (FailedPrecondition) once a "sent" or "send-failed" event exists for the release
    — its bytes may have left — or when it is already cancelled; NotFound if it was never
    charged. The caller promises what the ledger cannot see: no byte of the release was
    handed to the transport. Returns the cancellation as :meth:`Ledger.cancellations` lists it.
    """
    if ledger.policy is None:
        raise FailedPrecondition(
            f"ledger {ledger.path} was opened without a policy: it cannot cancel", reason="LEDGER_WITHOUT_POLICY"
        )
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidArgument("reason", "must say why the charge is cancelled")
    with ledger._write() as con:
        row = con.execute(
            "SELECT seq, hash, budgets, counterparty FROM charges WHERE release_id = ?", (release_id,)
        ).fetchone()
        if row is None:
            raise NotFound(f"no charge for release {release_id}", reason="CHARGE_NOT_FOUND")
        seq, charge_hash, budgets, counterparty = row
        if is_cancelled(con, seq):
            raise FailedPrecondition(f"release {release_id} is already cancelled", reason="RELEASE_CANCELLED")
        sent = con.execute(
            "SELECT kind FROM events WHERE release_id = ? AND kind IN ('sent', 'send-failed') LIMIT 1",
            (release_id,),
        ).fetchone()
        if sent is not None:
            raise FailedPrecondition(
                f"release {release_id} has a {sent[0]!r} event: its bytes may have left, "
                "and a charge is never refunded once they may have",
                reason="CHARGE_NOT_CANCELLABLE",
            )
        if (
            has_served_again(con)
            and con.execute("SELECT 1 FROM served_again WHERE release_id = ? LIMIT 1", (release_id,)).fetchone()
        ):
            raise FailedPrecondition(
                f"release {release_id} was served again: its bytes have left", reason="CHARGE_NOT_CANCELLABLE"
            )
        head = con.execute("SELECT hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()[0]
        last = con.execute("SELECT hash FROM cancellations ORDER BY id DESC LIMIT 1").fetchone()
        prev = last[0] if last else GENESIS
        at = now_rfc3339()
        h = cancel_hash(prev, seq, release_id, charge_hash, head, at, reason)
        cur = con.execute(
            "INSERT INTO cancellations (seq, release_id, at, reason, head_hash, prev_hash, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (seq, release_id, at, reason, head, prev, h),
        )
        cancel_id = cur.lastrowid
        for budget in json.loads(budgets):
            recompute_total(ledger, con, budget)
    ledger.anchor.append([AnchorPoint("cancellations", cancel_id, h)])
    log.info(
        "cancelled release_id=%s entry=%d counterparty=%s budgets=%s",
        release_id,
        seq,
        counterparty,
        ",".join(json.loads(budgets)),
    )
    return {
        "entry_id": seq,
        "release_id": release_id,
        "counterparty": counterparty,
        "at": at,
        "reason": reason,
        "budgets": json.loads(budgets),
        "hash": h,
    }


def cancellations(ledger: LedgerStorage) -> list[dict]:
    """Every cancelled charge, in cancellation order."""
    with ledger._read() as con:
        if not has_cancellations(con):
            return []
        rows = con.execute(
            "SELECT x.seq, x.release_id, c.counterparty, x.at, x.reason, c.budgets, x.hash"
            " FROM cancellations x JOIN charges c ON c.seq = x.seq ORDER BY x.id"
        ).fetchall()
    return [
        {
            "entry_id": r[0],
            "release_id": r[1],
            "counterparty": r[2],
            "at": r[3],
            "reason": r[4],
            "budgets": json.loads(r[5]),
            "hash": r[6],
        }
        for r in rows
    ]


def serve_again(ledger: LedgerStorage, release_id: str, counterparty: str, detail: str = "") -> dict:
    """Record that the identical bytes of the charged release ``release_id`` are served
    again to ``counterparty``, at no charge: a data-level release is a DP output of the
    site's training records, and handing the same output out again is post-processing, so
    no budget's sums change. Append-only: a row of ``served_again`` chained by its own hash,
    which also covers the original charge's hash and the charge chain's head at the time.

    Refused: NotFound if ``release_id`` was never charged; FailedPrecondition if the charge
    was cancelled (its bytes must never leave) or is not data-level (a model-level release
    is per counterparty and never reused). Returns the row as :meth:`Ledger.served_again` lists it.
    """
    if not isinstance(counterparty, str) or not counterparty:
        raise InvalidArgument("counterparty", "is required")
    with ledger._write() as con:
        row = con.execute("SELECT seq, hash, level FROM charges WHERE release_id = ?", (release_id,)).fetchone()
        if row is None:
            raise NotFound(f"no charge for release {release_id}", reason="CHARGE_NOT_FOUND")
        seq, charge_hash, level = row
        if is_cancelled(con, seq):
            raise FailedPrecondition(
                f"release {release_id} was cancelled: it may not be served", reason="RELEASE_CANCELLED"
            )
        if level != "data":
            raise FailedPrecondition(
                f"release {release_id} is {level}-level: only data-level releases are served again",
                reason="NOT_SERVABLE_AGAIN",
            )
        head = con.execute("SELECT hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()[0]
        last = con.execute("SELECT id, hash FROM served_again ORDER BY id DESC LIMIT 1").fetchone()
        prev = last[1] if last else GENESIS
        at = now_rfc3339()
        detail = str(detail)
        h = served_again_hash(prev, seq, release_id, charge_hash, counterparty, head, at, detail)
        cur = con.execute(
            "INSERT INTO served_again (seq, release_id, counterparty, at, detail, head_hash, prev_hash, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (seq, release_id, counterparty, at, detail, head, prev, h),
        )
        served_id = cur.lastrowid
        head_seq = con.execute("SELECT seq FROM charges WHERE hash = ?", (head,)).fetchone()[0]
    ledger.anchor.append([AnchorPoint("served_again", served_id, h)])
    log.info("served-again release_id=%s entry=%d counterparty=%s id=%d", release_id, seq, counterparty, served_id)
    return {
        "id": served_id,
        "entry_id": seq,
        "release_id": release_id,
        "counterparty": counterparty,
        "at": at,
        "detail": detail,
        "hash": h,
        "ledger_seq": head_seq,
        "ledger_head": head,
    }


def served_again(
    ledger: LedgerStorage, *, counterparty: str | None = None, release_id: str | None = None
) -> list[dict]:
    """Every release served again (no charge), in order; each names its original entry."""
    with ledger._read() as con:
        if not has_served_again(con):
            return []
        where, args = [], []
        for col, value in (("counterparty", counterparty), ("release_id", release_id)):
            if value is not None:
                where.append(f"{col} = ?")
                args.append(value)
        sql = "SELECT id, seq, release_id, counterparty, at, detail, hash FROM served_again"
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = con.execute(sql + " ORDER BY id", args).fetchall()
    keys = ("id", "entry_id", "release_id", "counterparty", "at", "detail", "hash")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def has_served_again(con: sqlite3.Connection) -> bool:
    # a ledger written before releases were served again and opened read-only has no such table
    return (
        con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'served_again'").fetchone() is not None
    )


def has_cancellations(con: sqlite3.Connection) -> bool:
    # a ledger written before cancellations existed and opened read-only has no such table
    return (
        con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cancellations'").fetchone()
        is not None
    )


def is_cancelled(con: sqlite3.Connection, seq: int) -> bool:
    return (
        has_cancellations(con)
        and con.execute("SELECT 1 FROM cancellations WHERE seq = ?", (seq,)).fetchone() is not None
    )


def recompute_total(ledger: LedgerStorage, con: sqlite3.Connection, budget: str) -> None:
    """Rewrite one budget's cached totals from its charges that are not cancelled, summed in
    charge order exactly as :meth:`Ledger.verify` sums them (so the cache stays bit-equal)."""
    rows = con.execute(
        "SELECT c.seq, c.rdp, c.pure_epsilon FROM charges c JOIN charge_budgets b ON b.seq = c.seq"
        " WHERE b.budget = ? AND c.seq NOT IN (SELECT seq FROM cancellations) ORDER BY c.seq",
        (budget,),
    ).fetchall()
    if not rows:
        con.execute("DELETE FROM totals WHERE budget = ?", (budget,))
        return
    rdp, pure = np.zeros(len(ledger.orders)), 0.0
    for _, vec, p in rows:
        rdp = rdp + np.asarray(json.loads(vec), float)
        pure = pure + p
    con.execute(
        "UPDATE totals SET count = ?, rdp = ?, pure_epsilon = ?, last_seq = ? WHERE budget = ?",
        (len(rows), dumps(rdp.tolist()), pure, rows[-1][0], budget),
    )
