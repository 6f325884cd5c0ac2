"""Checking a ledger file: SQLite's integrity, the hash chains (charges, cancellations,
served-again rows, events), the ``totals`` cache against the chained rows, and the file
against its anchor (``peer.budget.anchor``). ``verify`` is ``Ledger.verify``, run at open.
"""

from __future__ import annotations

import json
import sqlite3

import numpy as np

from peer.base.errors import FailedPrecondition
from peer.budget import corrections
from peer.budget.anchor import AnchorPoint
from peer.budget.budgets import BudgetKey
from peer.budget.chain import (
    BUDGET_COLS,
    CHAIN_TABLES,
    CHAIN_WORDS,
    CHARGE_COLS,
    EVENT_COLS,
    GENESIS,
    MODEL_COLS,
    cancel_hash,
    chain_hash,
    event_hash,
    genesis,
    served_again_hash,
)
from peer.budget.storage import LedgerStorage


def verify_served_again(con: sqlite3.Connection, cancelled: set[int], problems: list[str]) -> None:
    """Check the served-again rows' own hash chain; each must name a data-level charge that
    is not cancelled (they never enter a budget's sums)."""
    if not corrections.has_served_again(con):
        return
    prev = GENESIS
    for sid, seq, release_id, cp, at, detail, head, prev_hash, h, charge_hash, charge_release, level in con.execute(
        "SELECT s.id, s.seq, s.release_id, s.counterparty, s.at, s.detail, s.head_hash, s.prev_hash, s.hash,"
        " c.hash, c.release_id, c.level FROM served_again s LEFT JOIN charges c ON c.seq = s.seq ORDER BY s.id"
    ):
        if charge_hash is None or charge_release != release_id:
            problems.append(f"served-again row {sid} names no such charge")
        elif prev_hash != prev or h != served_again_hash(prev_hash, seq, release_id, charge_hash, cp, head, at, detail):
            problems.append(f"served-again hash chain broken at row {sid}")
            break
        elif seq in cancelled or level != "data":
            problems.append(f"served-again row {sid} names a cancelled or non-data-level charge (entry {seq})")
        prev = h


def verify_cancellations(con: sqlite3.Connection, problems: list[str]) -> set[int]:
    """Check the cancellations' own hash chain (each link covers the cancelled charge's hash);
    return the cancelled entries."""
    if not corrections.has_cancellations(con):
        return set()
    prev, out = GENESIS, set()
    for seq, release_id, at, reason, head, prev_hash, h, charge_hash, charge_release in con.execute(
        "SELECT x.seq, x.release_id, x.at, x.reason, x.head_hash, x.prev_hash, x.hash, c.hash, c.release_id"
        " FROM cancellations x LEFT JOIN charges c ON c.seq = x.seq ORDER BY x.id"
    ):
        if charge_hash is None or charge_release != release_id:
            problems.append(f"cancellation of entry {seq} names no such charge")
        elif prev_hash != prev or h != cancel_hash(prev_hash, seq, release_id, charge_hash, head, at, reason):
            problems.append(f"cancellation hash chain broken at entry {seq}")
            break
        prev = h
        out.add(seq)
    return out


def stored_hash(con: sqlite3.Connection, seq: int, prev_hash: str) -> str:
    """The chain hash of charge ``seq`` recomputed from what the file holds."""
    charge = con.execute(f"SELECT {', '.join(c for c, _ in CHARGE_COLS)} FROM charges WHERE seq = ?", (seq,)).fetchone()
    budgets = con.execute(
        f"SELECT {', '.join(c for c, _ in BUDGET_COLS)} FROM charge_budgets WHERE seq = ?", (seq,)
    ).fetchall()
    models = con.execute(
        f"SELECT {', '.join(c for c, _ in MODEL_COLS)} FROM charge_models WHERE seq = ?", (seq,)
    ).fetchall()
    return chain_hash(prev_hash, charge, budgets, models)


def verify(ledger: LedgerStorage) -> None:
    """Raise FailedPrecondition unless, in one read snapshot:

    - the file passes SQLite's integrity check;
    - the hash chain links every charge: each charge's hash covers the previous hash, every
      column of its row and its charge_budgets and charge_models rows, and the first one
      starts from the filter's orders — so no value that decides a budget (level, unit, ε,
      δ, RDP, pure ε, budgets, limits, pool models, the record) can change unnoticed;
    - each budget's rows agree on what the budget is (its name is the one its level, unit,
      model and counterparty give) and the ``totals`` cache equals the sums recomputed from
      the chained rows, column by column;
    - the delivery events' own chain links every event.

    - every chain reaches the point its anchor (``LEDGER.anchor``, ``peer.budget.anchor``)
      records: the row the anchor names exists and has the anchored hash. A chain alone
      cannot show a tail cut off together with a rewritten cache, or an older copy of the
      file put back; the anchor, kept outside the file and fsync'd before any byte of a
      release leaves, can (a ledger behind it raises FailedPrecondition naming both files).
      Each receipt also carries the charge chain's sequence number and head after its
      charge, so a counterparty holds the evidence of its own charges.
    """
    # Read the anchor BEFORE the snapshot: every point in it was committed before it was
    # written, so the snapshot taken after includes it (another process may charge meanwhile).
    anchored = ledger.anchor.heads()
    problems = []
    with ledger._read() as con:
        behind = behind_anchor(con, anchored)
        check = [r[0] for r in con.execute("PRAGMA integrity_check")]
        if check != ["ok"]:
            problems.append(f"integrity_check: {check[:5]}")
        cancelled = verify_cancellations(con, problems)
        verify_served_again(con, cancelled, problems)
        budget_rows: dict[int, list[tuple]] = {}
        for seq, *row in con.execute(f"SELECT seq, {', '.join(c for c, _ in BUDGET_COLS)} FROM charge_budgets"):
            budget_rows.setdefault(seq, []).append(tuple(row))
        model_rows: dict[int, list[tuple]] = {}
        for seq, *row in con.execute(f"SELECT seq, {', '.join(c for c, _ in MODEL_COLS)} FROM charge_models"):
            model_rows.setdefault(seq, []).append(tuple(row))
        charges = con.execute(
            f"SELECT {', '.join(c for c, _ in CHARGE_COLS)}, prev_hash, hash FROM charges ORDER BY seq"
        ).fetchall()
        totals = {
            r[0]: r[1:]
            for r in con.execute(
                "SELECT budget, level, unit, subject, counterparty, count, rdp, pure_epsilon, last_seq FROM totals"
            )
        }
        events = con.execute(
            f"SELECT {', '.join(c for c, _ in EVENT_COLS)}, prev_hash, hash FROM events ORDER BY id"
        ).fetchall()
    prev = genesis(ledger.orders)
    sums: dict[str, list] = {}
    keys: dict[str, tuple] = {}
    chained = set()
    for row in charges:
        *charge, prev_hash, h = row
        seq, budgets, rdp, pure = charge[0], charge[13], charge[11], charge[12]
        try:
            ok = prev_hash == prev and h == chain_hash(
                prev_hash, tuple(charge), budget_rows.get(seq, []), model_rows.get(seq, [])
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            problems.append(f"hash chain broken at entry {seq}")
            break
        prev = h
        chained.add(seq)
        rows = budget_rows.get(seq, [])
        if sorted(json.loads(budgets)) != sorted(r[0] for r in rows):
            problems.append(f"entry {seq}: budgets column and charge_budgets rows differ")
        if seq in cancelled:
            continue  # withdrawn before any byte left: in no budget's sums
        vec = np.asarray(json.loads(rdp), float)
        if vec.shape != (len(ledger.orders),):
            problems.append(f"entry {seq}: its RDP has {vec.size} values for {len(ledger.orders)} orders")
            break
        for name, level, unit, subject, cp, *_ in rows:
            key = (level, unit, subject, cp)
            if BudgetKey(*key).name != name or keys.setdefault(name, key) != key:
                problems.append(f"entry {seq}: budget {name} does not match its level/unit/model/counterparty")
            s = sums.setdefault(name, [0, np.zeros(len(ledger.orders)), 0.0, 0])
            s[0] += 1
            s[1] = s[1] + vec
            s[2] = s[2] + pure
            s[3] = seq
    orphans = sorted((set(budget_rows) | set(model_rows)) - chained)
    if orphans and not any(p.startswith("hash chain") for p in problems):
        problems.append(f"charge_budgets/charge_models rows for entries not in the chain: {orphans[:5]}")
    if set(totals) != set(sums):
        problems.append(f"totals cache lists {sorted(totals)}, rows give {sorted(sums)}")
    for b, (count, rdp, pure, last) in sums.items():
        c = totals.get(b)
        if c is None:
            continue
        try:
            same = (
                tuple(c[:4]) == keys[b]
                and c[4] == count
                and json.loads(c[5]) == rdp.tolist()
                and c[6] == pure
                and c[7] == last
            )
        except (TypeError, ValueError):
            same = False
        if not same:
            problems.append(f"totals cache for {b} differs from the sum of its rows")
    prev = GENESIS
    for *event, prev_hash, h in events:
        try:
            ok = prev_hash == prev and h == event_hash(prev_hash, tuple(event))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            problems.append(f"event chain broken at event {event[0]}")
            break
        prev = h
    if problems:
        raise FailedPrecondition(f"ledger {ledger.path} is inconsistent: " + "; ".join(problems))
    if behind:
        raise FailedPrecondition(
            f"ledger {ledger.path} is behind its anchor {ledger.anchor.path}: " + "; ".join(behind) + ". Its end "
            "was cut off or an older copy of the file was put back, so budget already spent would be "
            "admitted again; it is not opened. Restore the ledger that reaches the anchor (the receipts "
            "counterparties hold name each charge's entry and chain head)",
            reason="LEDGER_BEHIND_ANCHOR",
            metadata={"ledger": str(ledger.path), "anchor": str(ledger.anchor.path)},
        )


def chain_heads(con: sqlite3.Connection) -> dict[str, tuple[int, str]]:
    """(id, hash) of the last row of every chain that has rows (as stored: unchecked)."""
    out = {}
    for chain, (table, col) in CHAIN_TABLES.items():
        exists = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
        row = exists and con.execute(f"SELECT {col}, hash FROM {table} ORDER BY {col} DESC LIMIT 1").fetchone()
        if row:
            out[chain] = (row[0], row[1])
    return out


def behind_anchor(con: sqlite3.Connection, anchored: dict[str, AnchorPoint]) -> list[str]:
    """What differs between the anchored points and the file (empty: the file reaches them all)."""
    heads = chain_heads(con)
    out = []
    for chain, point in anchored.items():
        table, col = CHAIN_TABLES[chain]
        word = CHAIN_WORDS[chain]
        last = heads.get(chain)
        row = (
            con.execute(f"SELECT hash FROM {table} WHERE {col} = ?", (point.n,)).fetchone()
            if last is not None
            else None
        )
        if row is None:
            upto = f"its {table} end at {word} {last[0]}" if last else f"it holds no {table}"
            out.append(f"the anchor records {word} {point.n} (hash {point.head[:16]}…), {upto}")
        elif row[0] != point.head:
            out.append(
                f"the anchor records {word} {point.n} with hash {point.head[:16]}…, the ledger's {word} "
                f"{point.n} has hash {row[0][:16]}…"
            )
    return out
