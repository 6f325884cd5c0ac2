"""The ledger's SQLite schema and its hash chains (pure: values in, hashes out).

``SCHEMA`` is every table of a ledger file; ``schema_statements`` adds the triggers that refuse
UPDATE and DELETE on the append-only tables. The charge chain links every charge to the one
before it by :func:`chain_hash` (over every column of the charge, its charge_budgets and
charge_models rows), starting from :func:`genesis` (which binds it to the filter's orders);
cancellations, served-again rows and delivery events carry chains of their own
(:func:`cancel_hash`, :func:`served_again_hash`, :func:`event_hash`). How the ledger uses them:
``peer.budget.ledger``.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

#: Version 2: the hash chain covers every column of a charge, its charge_budgets and
#: charge_models rows and the filter's orders (version 1 hashed only some columns, so a file
#: could be edited undetectably); events carry a chain of their own. Older files are refused.
SCHEMA_VERSION = "2"
GENESIS = "0" * 64
EVENT_KINDS = ("sent", "send-failed", "note")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS charges (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    release_id TEXT NOT NULL UNIQUE,
    charged_at TEXT NOT NULL,
    level TEXT NOT NULL,
    unit TEXT NOT NULL,
    record_unit TEXT NOT NULL,
    counterparty TEXT NOT NULL,
    subject TEXT NOT NULL,
    mechanism TEXT NOT NULL,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    rdp TEXT NOT NULL,
    pure_epsilon REAL NOT NULL,
    budgets TEXT NOT NULL,
    record TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS charges_counterparty ON charges (counterparty);
CREATE INDEX IF NOT EXISTS charges_subject ON charges (subject);
CREATE INDEX IF NOT EXISTS charges_level_unit ON charges (level, unit);
CREATE INDEX IF NOT EXISTS charges_time ON charges (charged_at);
CREATE TABLE IF NOT EXISTS charge_budgets (
    seq INTEGER NOT NULL REFERENCES charges (seq),
    budget TEXT NOT NULL,
    level TEXT NOT NULL,
    unit TEXT NOT NULL,
    subject TEXT NOT NULL,
    counterparty TEXT NOT NULL,
    epsilon_limit REAL NOT NULL,
    delta_limit REAL NOT NULL,
    PRIMARY KEY (budget, seq)
);
CREATE TABLE IF NOT EXISTS charge_models (
    seq INTEGER NOT NULL REFERENCES charges (seq),
    model TEXT NOT NULL,
    lc INTEGER NOT NULL,
    PRIMARY KEY (model, seq)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    release_id TEXT NOT NULL REFERENCES charges (release_id),
    at TEXT NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS totals (
    budget TEXT PRIMARY KEY,
    level TEXT NOT NULL,
    unit TEXT NOT NULL,
    subject TEXT NOT NULL,
    counterparty TEXT NOT NULL,
    count INTEGER NOT NULL,
    rdp TEXT NOT NULL,
    pure_epsilon REAL NOT NULL,
    last_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cancellations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    seq INTEGER NOT NULL UNIQUE REFERENCES charges (seq),
    release_id TEXT NOT NULL UNIQUE REFERENCES charges (release_id),
    at TEXT NOT NULL,
    reason TEXT NOT NULL,
    head_hash TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS served_again (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    seq INTEGER NOT NULL REFERENCES charges (seq),
    release_id TEXT NOT NULL REFERENCES charges (release_id),
    counterparty TEXT NOT NULL,
    at TEXT NOT NULL,
    detail TEXT NOT NULL,
    head_hash TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS served_again_release ON served_again (release_id);
"""
APPEND_ONLY = ("meta", "charges", "charge_budgets", "charge_models", "events", "cancellations", "served_again")


def schema_statements() -> list[str]:
    out = [st.strip() for st in SCHEMA.split(";") if st.strip()]
    for t in APPEND_ONLY:
        for op in ("UPDATE", "DELETE"):
            out.append(
                f"CREATE TRIGGER IF NOT EXISTS {t}_no_{op.lower()} BEFORE {op} ON {t} "
                f"BEGIN SELECT RAISE(ABORT, 'the ledger is append-only: {op} on {t} refused'); END"
            )
    return out


def jsonable(value: Any) -> Any:
    """Non-finite floats (an unknown limit, an infinite ε) become None for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    # repr-exact floats; ±inf as Infinity (read back by json.loads).
    return json.dumps(value, separators=(",", ":"))


def served_again_hash(
    prev: str, seq: int, release_id: str, charge_hash: str, counterparty: str, head_hash: str, at: str, detail: str
) -> str:
    h = hashlib.sha256(b"served-again\n")
    for part in (prev, str(seq), release_id, charge_hash, counterparty, head_hash, at, detail):
        h.update(part.encode())
        h.update(b"\n")
    return h.hexdigest()


def cancel_hash(prev: str, seq: int, release_id: str, charge_hash: str, head_hash: str, at: str, reason: str) -> str:
    h = hashlib.sha256(b"cancel\n")
    for part in (prev, str(seq), release_id, charge_hash, head_hash, at, reason):
        h.update(part.encode())
        h.update(b"\n")
    return h.hexdigest()


# The columns the hash chain covers, in hashing order, with the Python type of their SQLite
# storage class: every value is normalised to it before hashing (SQLite reads an integer ε back
# as 1.0 and −0.0 as 0.0), so the hash computed at insert equals the one recomputed from the file.
CHARGE_COLS = (
    ("seq", int),
    ("release_id", str),
    ("charged_at", str),
    ("level", str),
    ("unit", str),
    ("record_unit", str),
    ("counterparty", str),
    ("subject", str),
    ("mechanism", str),
    ("epsilon", float),
    ("delta", float),
    ("rdp", str),
    ("pure_epsilon", float),
    ("budgets", str),
    ("record", str),
)
BUDGET_COLS = (
    ("budget", str),
    ("level", str),
    ("unit", str),
    ("subject", str),
    ("counterparty", str),
    ("epsilon_limit", float),
    ("delta_limit", float),
)
MODEL_COLS = (("model", str), ("lc", int))
EVENT_COLS = (("id", int), ("release_id", str), ("at", str), ("kind", str), ("detail", str))


def normalised(cols: tuple[tuple[str, type], ...], values: tuple) -> list:
    if len(values) != len(cols):
        raise ValueError(f"expected {len(cols)} values, got {len(values)}")
    out = []
    for (_, kind), v in zip(cols, values, strict=True):
        if kind is float:
            v = float(v) + 0.0  # −0.0 → 0.0, as SQLite stores it
        out.append(kind(v))
    return out


def sha256_json(value: Any) -> str:
    # repr-exact floats, ±inf as Infinity: the same bytes for the same values on every platform
    return hashlib.sha256(json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()).hexdigest()


def genesis(orders: tuple[float, ...]) -> str:
    """The prev_hash of the first charge: binds the chain to the filter's orders (in ``meta``),
    which decide how every stored RDP vector is read."""
    return sha256_json(["privfusion-ledger-genesis", SCHEMA_VERSION, [float(o) for o in orders]])


def chain_hash(prev: str, charge: tuple, budgets: list[tuple], models: list[tuple]) -> str:
    """SHA-256 over the previous hash, every column of the charge row (``CHARGE_COLS``) and its
    charge_budgets and charge_models rows (sorted): every stored value that decides a budget."""
    return sha256_json(
        [
            "privfusion-ledger-charge",
            prev,
            normalised(CHARGE_COLS, charge),
            sorted(normalised(BUDGET_COLS, b) for b in budgets),
            sorted(normalised(MODEL_COLS, m) for m in models),
        ]
    )


def event_hash(prev: str, event: tuple) -> str:
    """The delivery events' own chain (they decide no budget, but say what left and when)."""
    return sha256_json(["privfusion-ledger-event", prev, normalised(EVENT_COLS, event)])


# The chains the anchor covers: their table and row-id column, and how errors name a row.
CHAIN_TABLES = {
    "charges": ("charges", "seq"),
    **{c: (c, "id") for c in ("cancellations", "served_again", "events")},
}
CHAIN_WORDS = {
    "charges": "charge",
    "cancellations": "cancellation",
    "served_again": "served-again row",
    "events": "event",
}
