"""The ledger's storage: one SQLite file in WAL mode with ``synchronous=FULL``, one connection
per thread, write transactions (``BEGIN IMMEDIATE``, serialising writers across threads and
processes) and read snapshots, the schema's creation and the filter's orders read back.

``LedgerStorage`` is what every part of the ledger works over (``peer.budget.charging``,
``corrections``, ``verification``, ``reading``): the file, the policy, the filter's orders, the
accountant at those orders and the anchor. ``peer.budget.ledger.Ledger`` is a ``LedgerStorage``
that verifies the file at open and offers the ledger's methods; see its module docstring.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from peer.base.records import now_rfc3339
from peer.budget.anchor import Anchor, anchor_path
from peer.budget.chain import SCHEMA_VERSION, dumps, schema_statements
from peer.budget.filter import validate_orders
from peer.budget.policy import Policy
from peer.dp.accounting.accountant import Accountant


class LedgerStorage:
    """A ledger file opened for the ledger's parts: ``path``, ``policy`` (None: read only),
    ``orders`` (the filter's, fixed for the file's lifetime), ``accountant`` (at those orders),
    ``anchor``; ``_conn``, ``_write`` and ``_read`` give a thread's connection, a write
    transaction and a read snapshot."""

    def __init__(
        self,
        path: str | os.PathLike,
        policy: Policy | None = None,
        *,
        accountant: Accountant | None = None,
        busy_timeout_s: float = 30.0,
    ):
        self.path = Path(path)
        self.policy = policy
        if accountant is not None and not isinstance(accountant, Accountant):
            raise InvalidArgument("accountant", f"must be an Accountant, got {type(accountant).__name__}")
        self._busy_timeout_s = float(busy_timeout_s)
        self._pid = os.getpid()
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        if policy is None and not self.path.exists():
            raise NotFound(f"no ledger at {self.path}")
        con = self._conn()
        if policy is not None:
            self._create(con, policy.orders)
        self.orders = self._read_orders(con)
        if policy is not None and tuple(policy.orders) != self.orders:
            raise FailedPrecondition(
                f"ledger {self.path} was created with filter orders {list(self.orders)}; the policy asks for "
                f"{list(policy.orders)}. A filter's orders are fixed for its lifetime."
            )
        self.accountant = (accountant or Accountant()).with_orders(self.orders)
        self.anchor = Anchor(anchor_path(self.path))

    # ---- connections and transactions ---------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if os.getpid() != self._pid:
            raise FailedPrecondition("a Ledger cannot be used across fork(); open a new one in the child")
        con = getattr(self._local, "con", None)
        if con is None:
            uri = f"file:{self.path}?mode={'rwc' if self.policy is not None else 'rw'}"
            try:
                con = sqlite3.connect(
                    uri, uri=True, isolation_level=None, timeout=self._busy_timeout_s, check_same_thread=False
                )
            except sqlite3.OperationalError as e:
                raise FailedPrecondition(f"cannot open ledger {self.path}: {e}") from None
            con.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            try:
                mode = con.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.DatabaseError as e:  # not an SQLite file at all
                con.close()
                raise FailedPrecondition(f"{self.path} is not a PrivFusion ledger: {e}") from None
            if mode.lower() != "wal":
                raise FailedPrecondition(f"ledger {self.path}: SQLite refused WAL mode (got {mode!r})")
            con.execute("PRAGMA synchronous = FULL")
            con.execute("PRAGMA foreign_keys = ON")
            self._local.con = con
            with self._lock:
                self._all.append(con)
        return con

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        con = self._conn()
        try:
            con.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise Unavailable(f"ledger {self.path} is busy: {e}", reason="LEDGER_BUSY") from None
        try:
            yield con
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every query inside sees the same snapshot of the file (WAL
        readers see the last commit before their first read, whatever other processes commit
        meanwhile), so a reader never pairs rows with totals from different moments. Nested
        reads, and reads inside a write, join the transaction already open."""
        con = self._conn()
        if con.in_transaction:
            yield con
            return
        con.execute("BEGIN")
        try:
            yield con
        finally:
            if con.in_transaction:
                con.execute("COMMIT")  # nothing was written: this only ends the snapshot

    def close(self) -> None:
        with self._lock:
            for con in self._all:
                con.close()
            self._all.clear()
        self._local = threading.local()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _create(self, con: sqlite3.Connection, orders: tuple[float, ...]) -> None:
        with self._write() as c:
            for statement in schema_statements():
                c.execute(statement)
            for key, value in (
                ("schema_version", SCHEMA_VERSION),
                ("orders", dumps(list(orders))),
                ("created_at", now_rfc3339()),
            ):
                c.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _read_orders(self, con: sqlite3.Connection) -> tuple[float, ...]:
        try:
            with self._read() as c:
                rows = dict(c.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise FailedPrecondition(f"{self.path} is not a PrivFusion ledger: {e}") from None
        version = rows.get("schema_version")
        if version == "1":
            raise FailedPrecondition(
                f"ledger {self.path} has schema version 1, whose hash chain leaves columns that decide a budget "
                f"(level, unit, ε, δ, pure ε, limits, pool models) unprotected; this version reads schema "
                f"{SCHEMA_VERSION} only. It is not migrated: re-hashing would vouch for values the old chain never "
                "covered. Keep the old file for the record and start a new ledger (a new path) under this version."
            )
        if version != SCHEMA_VERSION:
            raise FailedPrecondition(f"ledger {self.path}: schema version {version!r}, expected {SCHEMA_VERSION}")
        return validate_orders(json.loads(rows["orders"]))
