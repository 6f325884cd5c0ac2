"""Reading a ledger: its entries, charges, events, each budget's state (the filter's ε, and
the PLD figure beside it), what a peer may see of them, the summary ``privfusion ledger show``
prints, and where a charge stands in the chain (what a receipt carries). Every reader runs in
one read transaction (``Ledger._read``), so it sees one committed state.
"""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np

from peer.base.errors import NotFound
from peer.base.records import ReleaseRecord
from peer.budget import corrections
from peer.budget.budgets import FIGURE_SCOPES, BudgetKey, BudgetState, LedgerEntry
from peer.budget.chain import jsonable
from peer.budget.filter import FilterBudget
from peer.budget.storage import LedgerStorage
from peer.dp.accounting.per_unit import per_neuron_record

ENTRY_COLS = "seq, release_id, charged_at, level, unit, counterparty, subject, mechanism, epsilon, delta, rdp, budgets, record, hash"


def to_entry(r: tuple) -> LedgerEntry:
    return LedgerEntry(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        r[5],
        r[6],
        r[7],
        r[8],
        r[9],
        tuple(json.loads(r[10])),
        tuple(json.loads(r[11])),
        ReleaseRecord.from_json(r[12]),
        r[13],
    )


def entry(con: sqlite3.Connection, seq: int) -> LedgerEntry:
    return to_entry(con.execute(f"SELECT {ENTRY_COLS} FROM charges WHERE seq = ?", (seq,)).fetchone())


def entries(
    ledger: LedgerStorage,
    *,
    counterparty: str | None = None,
    level: str | None = None,
    subject: str | None = None,
    include_cancelled: bool = False,
) -> list[LedgerEntry]:
    """Charged releases in charge order, optionally only those to one counterparty / level /
    model; cancelled charges (see :meth:`Ledger.cancel`) only with ``include_cancelled``."""
    where, args = [], []
    if not include_cancelled and corrections.has_cancellations(ledger._conn()):
        where.append("seq NOT IN (SELECT seq FROM cancellations)")
    for col, value in (("counterparty", counterparty), ("level", level), ("subject", subject)):
        if value is not None:
            where.append(f"{col} = ?")
            args.append(value)
    sql = f"SELECT {ENTRY_COLS} FROM charges"
    if where:
        sql += " WHERE " + " AND ".join(where)
    with ledger._read() as con:
        return [to_entry(r) for r in con.execute(sql + " ORDER BY seq", args)]


def charge_of(ledger: LedgerStorage, release_id: str) -> tuple[LedgerEntry, bool] | None:
    """The charge of ``release_id`` and whether it was cancelled, or None if never charged."""
    with ledger._read() as con:
        row = con.execute(f"SELECT {ENTRY_COLS} FROM charges WHERE release_id = ?", (release_id,)).fetchone()
        if row is None:
            return None
        return to_entry(row), corrections.is_cancelled(con, row[0])


def events(ledger: LedgerStorage, release_id: str | None = None) -> list[dict]:
    sql, args = "SELECT id, release_id, at, kind, detail FROM events", ()
    if release_id is not None:
        sql, args = sql + " WHERE release_id = ?", (release_id,)
    with ledger._read() as con:
        return [
            dict(zip(("id", "release_id", "at", "kind", "detail"), r, strict=True))
            for r in con.execute(sql + " ORDER BY id", args)
        ]


def budget_limits(ledger: LedgerStorage, con: sqlite3.Connection, key: BudgetKey) -> FilterBudget | None:
    """The budget's limits: from the policy if there is one, else as recorded at the last charge."""
    if ledger.policy is not None:
        if key.level == "data":
            return ledger.policy.data_filter() if ledger.policy.data and ledger.policy.data.unit == key.unit else None
        mb = ledger.policy.model_budgets(key.subject)
        return mb.per_counterparty if key.counterparty else mb.total
    row = con.execute(
        "SELECT epsilon_limit, delta_limit FROM charge_budgets WHERE budget = ? ORDER BY seq DESC LIMIT 1",
        (key.name,),
    ).fetchone()
    return FilterBudget(row[0], row[1], ledger.orders) if row else None


def budget_states(
    ledger: LedgerStorage, *, pld: bool = False, counterparty: str | None = None, scope: str = "all"
) -> list[BudgetState]:
    """Every budget that has charges (and the data budget the policy sets, even if unused).

    ``counterparty`` keeps the budgets that concern that peer (its own per-counterparty
    budgets, plus, with ``scope="all"``, totals and the data budget). ``pld=True`` adds the
    PLD composition of each budget's releases (slower: it composes every record's PLD).
    """
    with ledger._read() as con:
        return budget_states_in(ledger, con, pld, counterparty, scope)


def budget_states_in(
    ledger: LedgerStorage, con: sqlite3.Connection, pld: bool, counterparty: str | None, scope: str
) -> list[BudgetState]:
    rows = con.execute(
        "SELECT budget, level, unit, subject, counterparty, count, rdp, pure_epsilon FROM totals ORDER BY budget"
    ).fetchall()
    states = []
    seen = set()
    for name, level, unit, subject, cp, count, rdp, pure in rows:
        key = BudgetKey(level, unit, subject, cp)
        seen.add(name)
        if counterparty is not None and cp != counterparty and (scope == "own" or cp):
            continue
        limits = budget_limits(ledger, con, key)
        states.append(state(ledger, con, key, limits, count, np.asarray(json.loads(rdp), float), pure, pld))
    if ledger.policy is not None and ledger.policy.data is not None and scope == "all":
        key = BudgetKey("data", ledger.policy.data.unit)
        if key.name not in seen:
            states.insert(
                0, state(ledger, con, key, ledger.policy.data_filter(), 0, np.zeros(len(ledger.orders)), 0.0, pld)
            )
    return states


def state(
    ledger: LedgerStorage,
    con: sqlite3.Connection,
    key: BudgetKey,
    limits: FilterBudget | None,
    count: int,
    rdp: np.ndarray,
    pure: float,
    pld: bool,
) -> BudgetState:
    if limits is None:
        return BudgetState(key, math.nan, math.nan, count, math.nan, math.nan, None, "no limit known for this budget")
    spent, order = limits.spent_epsilon(rdp, pure)
    pld_eps, note = None, ""
    if pld:
        pld_eps, note = pld_epsilon(ledger, con, key, limits.delta)
    return BudgetState(key, limits.epsilon, limits.delta, count, spent, order, pld_eps, note)


def pld_epsilon(
    ledger: LedgerStorage, con: sqlite3.Connection, key: BudgetKey, delta: float
) -> tuple[float | None, str]:
    records = [
        ReleaseRecord.from_json(r[0])
        for r in con.execute(
            "SELECT c.record FROM charges c JOIN charge_budgets b ON b.seq = c.seq WHERE b.budget = ?"
            + (" AND c.seq NOT IN (SELECT seq FROM cancellations)" if corrections.has_cancellations(con) else "")
            + " ORDER BY c.seq",
            (key.name,),
        )
    ]
    note = "PLD composition of the charged releases as one fixed sequence; not the adaptive guarantee"
    if not records:
        return 0.0, note
    for r in records:  # a kind interpreted by RDP alone: say so (the filter's RDP figure is the charge)
        support = ledger.accountant.supports(per_neuron_record(r))
        if support and not support.pld:
            return None, support.reason
    try:
        composed, fallbacks = None, 0
        for r in records:
            charged = per_neuron_record(r)
            p = ledger.accountant.pld(charged)
            composed = p if composed is None else composed.compose(p)
            fallbacks += ledger.accountant.pld_fallbacks(charged)
        if fallbacks:
            note += (
                f"; {fallbacks} parallel release part(s) have no part that dominates the others, so their PLD "
                "is the sequential composition of the parts (conservative: it can exceed the filter's ε, "
                "which takes their maximum exactly)"
            )
        return float(composed.get_epsilon_for_delta(delta)), note
    except Exception as e:  # an accountant without a PLD for some record: say so, keep going
        return None, f"PLD unavailable: {type(e).__name__}: {e}"


def remaining_for(ledger: LedgerStorage, peer: str) -> list[BudgetState]:
    """The budgets ``peer`` may see under the policy's show_remaining ("none" → [])."""
    show = ledger.policy.shows_remaining(peer) if ledger.policy is not None else "none"
    if show == "none":
        return []
    return budget_states(ledger, counterparty=peer, scope=show)


def summary(ledger: LedgerStorage, *, counterparty: str | None = None, pld: bool = True) -> dict:
    """Everything ``privfusion ledger show`` prints, as JSON-ready data."""
    with ledger._read():  # entries and budgets from one snapshot
        return jsonable(
            {
                "ledger": str(ledger.path),
                "orders": list(ledger.orders),
                "filter": "RDP filter over the orders (δ split evenly across them) plus a pure-ε track",
                "figures": FIGURE_SCOPES,
                "anchor": anchor_state(ledger),
                "entries": [e.to_dict() for e in entries(ledger, counterparty=counterparty)],
                "budgets": [s.to_dict() for s in budget_states(ledger, pld=pld, counterparty=counterparty)],
                "cancelled": [
                    c
                    for c in corrections.cancellations(ledger)
                    if counterparty is None or c["counterparty"] == counterparty
                ],
                "served_again": corrections.served_again(ledger, counterparty=counterparty),
            }
        )


def anchor_state(ledger: LedgerStorage) -> dict:
    """The anchor file and, per chain, the row it anchors (``ledger show``)."""
    heads = ledger.anchor.heads()
    return {
        "path": str(ledger.anchor.path),
        "exists": ledger.anchor.exists(),
        "anchored": {c: {"n": p.n, "head": p.head} for c, p in sorted(heads.items())},
    }


def chain_position(
    ledger: LedgerStorage, entry_id: int | str, served_again: int | str | None = None
) -> tuple[int, str]:
    """(seq, hash) of the charge chain right after charge ``entry_id`` — its own sequence
    number and hash — or, with ``served_again`` (a served-again row of that charge), the
    chain's head when it was served again: what the release's receipt carries."""
    with ledger._read() as con:
        if served_again in (None, ""):
            row = con.execute("SELECT seq, hash FROM charges WHERE seq = ?", (int(entry_id),)).fetchone()
        else:
            row = con.execute(
                "SELECT c.seq, c.hash FROM served_again s JOIN charges c ON c.hash = s.head_hash"
                " WHERE s.id = ? AND s.seq = ?",
                (int(served_again), int(entry_id)),
            ).fetchone()
    if row is None:
        what = f"served-again row {served_again} of " if served_again not in (None, "") else ""
        raise NotFound(f"no {what}ledger entry {entry_id}")
    return int(row[0]), row[1]
