"""The privacy-budget ledger: a durable, append-only record of every release, and the filter
that decides whether the next release may happen.

Storage
-------
SQLite (stdlib ``sqlite3``) in WAL mode with ``synchronous=FULL``: every commit fsyncs the WAL
before it returns, so a charge that returned has survived a process kill *and* a power cut.
(``NORMAL`` in WAL mode survives a process kill but may lose the last commits on power loss;
the ledger promises that a charge outlives the bytes it paid for, so it uses ``FULL``.)
Tables ``charges`` (one row per release: the record's canonical JSON plus indexed columns and
its RDP vector at the filter's orders), ``charge_budgets`` (which budgets a charge was made to,
and their limits at the time), ``charge_models`` (pool models a data-level release drew on) and
``events`` (delivery status: appended, never edited) refuse UPDATE and DELETE through triggers.
``totals`` is a cache of each budget's running sums, written in the same transaction as the
charge; ``verify()`` (run at open) recomputes it from the rows and checks the hash chain that
links every charge to the one before it. The chain covers every stored value that decides a
budget — all columns of the charge, its charge_budgets and charge_models rows, and (through the
first link) the filter's orders — so editing any of them, even with the triggers dropped, makes
the ledger refuse to open; events carry a chain of their own. A chain cannot show its end cut
off, so each chain's latest head is also appended to ``LEDGER.anchor`` beside the file
(``peer.budget.anchor``), fsync'd before a charge, cancellation, served-again row or event
returns; a ledger behind its anchor is refused at open (``docs/architecture.md``, "The ledger's
anchor", says what an attacker with write access can and cannot do). Every reader (``verify``,
``entries``, ``budget_states``, ``summary``…) runs in one read transaction: in WAL mode it sees
one committed state however many queries it makes while other processes charge.

Charging
--------
``charge(record, counterparty)`` interprets the record (``Ledger.accountant``, a
``peer.dp.accounting.accountant.Accountant`` at the filter's orders), then in ONE ``BEGIN
IMMEDIATE`` transaction — which serialises writers across threads and processes; waiting
writers block up to ``busy_timeout_s`` — reads the budgets' sums, checks the filter
(``peer.budget.filter``) and appends the charge, or raises ``BudgetExhausted`` and
writes nothing. The caller charges *first* and sends *after*: a charge is never refunded, and if
the process dies between the charge and the send the charge stands. Re-charging the same record
(same ``release_id``, same bytes) returns the existing entry instead of charging twice, so a
retried send of the *same* release costs nothing more.

``charge(..., also_counterparties=(C,))`` is for a release made to a relay R on behalf of C
(a Fuse partner serving the owner R for the final caller C): the record names C in
``parameters["on_behalf_of"]`` and the release is charged, in the same transaction, to the
model's total, to R's per-counterparty budget *and* to C's; the policy must let both ask for it.

Cancelling a charge
-------------------
``cancel(release_id, reason)`` withdraws a charge whose release never left: a site that must
charge before it asks another site for something (Fuse: the owner charges its own contribution
before calling the partner) cancels when that call fails. Allowed only while no "sent" or
"send-failed" event exists for the release — the service cancels only charges whose bytes were
never handed to gRPC — and at most once; afterwards the release id can be neither sent nor
charged again. Sound because nothing the release would have held was observed: the filter's
guarantee is over what left the site, and the refusals a reserved charge caused in between
depended only on public request parameters. Append-only: the cancellation is a row of
``cancellations`` chained by its own hash, which also covers the cancelled charge's hash and
the charge chain's head at the time; the totals of every budget the charge touched are
recomputed from the remaining rows in the same transaction, and ``verify()`` sums only charges
that are not cancelled.

Serving a release again
-----------------------
A data-level release (a DP-SGD pool model or an RS/LC merge) is a DP output of the site's
training records; handing the *identical* bytes out again is post-processing and costs nothing.
``serve_again(release_id, counterparty)`` records such a re-serving as a row of ``served_again``
(append-only, chained by its own hash over the original charge's hash and the charge chain's
head): it names the original charge and never enters a budget's sums, so ``verify()`` checks
its chain and that it names a data-level charge that is not cancelled. Model-level (LDP)
releases are per counterparty and are never served again; a charge that was served again can
no longer be cancelled.

The two budgets, kept apart
---------------------------
- **Data level** (``level="data"``: DP-SGD models, RS/LC merges; central DP on the site's
  training records): one filter for the site, in the single unit the policy names.
  ``record:add-remove`` and ``record:replace-one`` are different guarantees — neither converts
  to the other without group-privacy loss — so a release in the other unit is refused.
- **Model level** (``level="model"``: LDP releases of a model's neurons): per model M, one
  filter over all counterparties (``total``) and one per counterparty; a release about M's
  neurons to C is charged to both. The unit is one neuron; a per-entry guarantee is not a
  per-neuron one, so per-entry releases are restated per neuron (``per_neuron_record``,
  ``peer.dp.accounting.per_unit``):
  Laplace exactly — a neuron's activation row has P entries (``shape = [n, P]``) within
  ``clip = [lo, hi]``, so its L1 sensitivity is P·(hi − lo) and the per-neuron ε is
  P·(hi − lo)/scale = P × (per-entry ε); the Gaussian exactly, from the row's L2 clip;
  multi-bit as P sequentially composed ε-DP coordinates. Other per-entry releases are refused.

Releases from a shared pool (data level)
----------------------------------------
Summing per-release RDP is valid when releases are independent given the data. Merges from one
pool share the pool's models, so that needs care:
- RS releases (and single DP-SGD models, RS with one model) each output one whole model whose
  index is drawn independently of the data. Given all indices, the released distinct models
  cost at most Σ_t ε_α(I_t); joint convexity of exp((α−1)D_α) over the data-independent mixture
  then bounds the joint by Σ_t of each release's RS bound 1/(α−1)·log Σ_i π_i e^{(α−1)ε_{α,i}},
  also when π_t is chosen after seeing earlier outputs. So RS releases compose by summing.
- An LC release that shares a model with another release does NOT compose by summing: with
  models θ_1 (costly) and θ_2 (very noisy), θ_λ = λ_1θ_1 + λ_2θ_2 costs almost nothing and so
  does θ_2, but together they reveal θ_1. The ledger therefore refuses (``FailedPrecondition``)
  an LC merge that shares a model with an earlier data-level release, and any release that
  shares a model with an earlier LC merge.

Model-level releases of a pool model also reveal data-level information about its training
data; as the design keeps the two budgets apart, they are charged to model-level budgets only.

Files: this module holds the storage (SQLite, transactions, anchor sync) and the ``Ledger``;
the budgets' types are in ``peer.budget.budgets``, the schema and hash chains in
``peer.budget.chain``, the filter in ``peer.budget.filter``.

Logs carry record ids, mechanism names, levels, units, counterparty and model names and public
ε/δ — never parameters or values.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import BudgetExhausted, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from peer.base.records import ReleaseRecord, now_rfc3339
from peer.budget.anchor import Anchor, AnchorPoint, anchor_path
from peer.budget.budgets import FIGURE_SCOPES, BudgetKey, BudgetState, LedgerEntry, pool_models
from peer.budget.chain import (
    BUDGET_COLS,
    CHAIN_TABLES,
    CHAIN_WORDS,
    CHARGE_COLS,
    EVENT_COLS,
    EVENT_KINDS,
    GENESIS,
    MODEL_COLS,
    SCHEMA_VERSION,
    cancel_hash,
    chain_hash,
    dumps,
    event_hash,
    genesis,
    jsonable,
    schema_statements,
    served_again_hash,
)
from peer.budget.filter import FilterBudget, validate_orders
from peer.budget.policy import Policy
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.per_unit import per_neuron_record

log = logging.getLogger("peer.budget.ledger")


@dataclass(frozen=True)
class _Interpreted:
    record: ReleaseRecord
    charged: ReleaseRecord
    rdp: np.ndarray
    pure_epsilon: float
    budgets: tuple[tuple[BudgetKey, FilterBudget], ...]
    models: frozenset[str]
    lc: bool


class Ledger:
    """A site's privacy-budget ledger in one SQLite file.

    ``Ledger(path, policy)`` creates or opens the file; the policy supplies the budgets and the
    filter's orders (fixed for the file's lifetime). ``Ledger(path)`` without a policy opens an
    existing file for reading (``charge`` is refused). ``accountant`` is the
    ``peer.dp.accounting.accountant.Accountant`` whose PLD discretisation the ledger's PLD
    figures use (default: the project's); the ledger interprets every record at its filter's
    orders (``self.accountant`` = ``accountant.with_orders(self.orders)``). Safe to share between threads (one SQLite connection per thread) and
    to open from several processes at once.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        policy: Policy | None = None,
        *,
        accountant: Accountant | None = None,
        busy_timeout_s: float = 30.0,
        verify: bool = True,
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
        if verify:
            self.verify()
        if policy is not None:
            self._anchor_sync()

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
            raise Unavailable(f"ledger {self.path} is busy: {e}") from None
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

    def __enter__(self) -> Ledger:
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

    # ---- interpretation -------------------------------------------------------------------------

    def _budgets_for(self, charged: ReleaseRecord, counterparty: str) -> tuple[tuple[BudgetKey, FilterBudget], ...]:
        policy = self.policy
        if charged.level == "data":
            if policy.data is None:
                raise FailedPrecondition("the site's policy sets no data-level budget: data-level releases are refused")
            if charged.unit != policy.data.unit:
                raise FailedPrecondition(
                    f"release {charged.release_id} is private per {charged.unit!r}, the site's data budget per "
                    f"{policy.data.unit!r}; the two adjacencies do not convert into each other without loss, "
                    "so the ledger refuses to mix them"
                )
            return ((BudgetKey("data", charged.unit), policy.data_filter()),)
        if not charged.subject:
            raise InvalidArgument("subject", "a model-level release must name the model whose neurons it releases")
        mb = policy.model_budgets(charged.subject)
        out = []
        if mb.total is not None:
            out.append((BudgetKey("model", "neuron", charged.subject), mb.total))
        if mb.per_counterparty is not None:
            out.append((BudgetKey("model", "neuron", charged.subject, counterparty), mb.per_counterparty))
        if not out:
            raise FailedPrecondition(f"the site's policy sets no model-level budget for {charged.subject!r}: refused")
        return tuple(out)

    def _relayed_budgets(
        self, charged: ReleaseRecord, counterparty: str, also: tuple[str, ...]
    ) -> tuple[tuple[BudgetKey, FilterBudget], ...]:
        """The per-counterparty budgets of the sites a relayed release is finally for."""
        if isinstance(also, str) or not all(isinstance(c, str) and c for c in also):
            raise InvalidArgument("also_counterparties", f"must be a tuple of site names, got {also!r}")
        if not also:
            return ()
        if len(set(also)) != len(also) or counterparty in also:
            raise InvalidArgument(
                "also_counterparties",
                f"must be distinct sites other than the counterparty {counterparty!r}, got {list(also)}",
            )
        named = charged.parameters.get("on_behalf_of")
        named = (named,) if isinstance(named, str) else tuple(named or ())
        if sorted(named) != sorted(also):
            raise InvalidArgument(
                "parameters.on_behalf_of",
                f"the record names {list(named)}; a relayed charge must name every site it is for ({list(also)})",
            )
        if charged.level != "model":
            raise InvalidArgument(
                "also_counterparties",
                "only model-level releases have per-counterparty budgets to charge a relayed release to",
            )
        per = self.policy.model_budgets(charged.subject).per_counterparty
        if per is None:
            return ()
        return tuple((BudgetKey("model", "neuron", charged.subject, c), per) for c in also)

    def interpret(
        self, record: ReleaseRecord, counterparty: str, *, also_counterparties: tuple[str, ...] = ()
    ) -> _Interpreted:
        """What charging ``record`` to ``counterparty`` (and, for a relayed release, to the
        per-counterparty budgets of ``also_counterparties``) would cost, and to which budgets
        (no I/O)."""
        if self.policy is None:
            raise FailedPrecondition(f"ledger {self.path} was opened without a policy: it cannot charge")
        if not isinstance(record, ReleaseRecord):
            raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
        if not isinstance(counterparty, str) or not counterparty:
            raise InvalidArgument("counterparty", "must name the peer the release goes to")
        if record.counterparty not in (None, counterparty):
            raise InvalidArgument(
                "counterparty", f"the record names {record.counterparty!r}, the charge {counterparty!r}"
            )
        charged = per_neuron_record(record)
        models, lc = pool_models(charged)
        budgets = self._budgets_for(charged, counterparty) + self._relayed_budgets(
            charged, counterparty, also_counterparties
        )
        try:
            rdp = np.asarray(self.accountant.rdp(charged), dtype=float).reshape(-1)
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidArgument):
                raise
            raise InvalidArgument("record", f"cannot be interpreted by the accountant: {e}") from None
        # A Rényi divergence is >= 0; closed forms at tiny ε can round to -1e-17. Only rounding is
        # forgiven (and charged as 0); anything more negative is a malformed record.
        rdp = np.where((rdp < 0) & (rdp > -1e-12), 0.0, rdp)
        if rdp.shape != (len(self.orders),) or np.any(np.isnan(rdp)) or np.any(rdp < 0):
            raise InvalidArgument(
                "record", f"its RDP at the filter's orders must be {len(self.orders)} numbers >= 0, got {rdp!r}"
            )
        pure = math.inf
        if charged.delta == 0:
            pure = charged.epsilon
            # Pure ε-DP bounds every Rényi divergence by ε; a larger RDP means the record lies.
            if np.any(rdp > pure * (1 + 1e-9) + 1e-12):
                raise InvalidArgument(
                    "epsilon", f"the record claims pure ε = {pure:g} but its RDP reaches {float(rdp.max()):g}"
                )
        return _Interpreted(record, charged, rdp, pure, budgets, models, lc)

    # ---- charging -------------------------------------------------------------------------------

    def charge(
        self,
        record: ReleaseRecord,
        counterparty: str,
        *,
        kind: str | tuple[str, ...] | None = None,
        also_counterparties: tuple[str, ...] = (),
    ) -> LedgerEntry:
        """Check and charge one release, atomically; the caller sends only after this returns.

        ``kind`` ("features", "weights", "merge", "fuse"), when given, is also checked against
        the policy (peer permission, per-request ε cap in the budget's unit). A tuple of kinds
        is for a sequential composite whose components are releases of those kinds (features
        and weights in one release): each component is checked against its own kind's cap.
        ``also_counterparties``: the sites a relayed release is finally for (see the module
        docstring); the policy checks and their per-counterparty budgets apply to them too.
        Raises BudgetExhausted (nothing written) if any budget the release touches would be
        overspent; PermissionDenied / InvalidArgument / FailedPrecondition for requests the
        policy or the ledger's rules refuse.
        """
        also = also_counterparties if isinstance(also_counterparties, str) else tuple(also_counterparties)
        it = self.interpret(record, counterparty, also_counterparties=also)
        if kind is not None:
            for peer in (counterparty, *also):
                self.policy.check_request_parts(peer, self._parts(kind, it.charged))
        record_json = record.canonical_json().decode()
        with self._write() as con:
            row = con.execute(
                "SELECT seq, record, counterparty FROM charges WHERE release_id = ?", (record.release_id,)
            ).fetchone()
            if row is not None and self._is_cancelled(con, row[0]):
                raise FailedPrecondition(
                    f"release {record.release_id} was cancelled; a cancelled release is never charged again"
                )
            if row is not None:
                if row[1] == record_json and row[2] == counterparty:
                    log.info("already-charged release_id=%s entry=%d", record.release_id, row[0])
                    existing = self._entry(con, row[0])
                    # a crash may have come between its commit and its anchoring: anchor it before it is sent
                    self.anchor.append([AnchorPoint("charges", existing.entry_id, existing.hash)])
                    return existing
                raise InvalidArgument("release_id", f"{record.release_id} was already charged for a different release")
            self._check_pool(con, it)
            updates = []
            for key, budget in it.budgets:
                total = con.execute(
                    "SELECT count, rdp, pure_epsilon FROM totals WHERE budget = ?", (key.name,)
                ).fetchone()
                count, rdp0, pure0 = (
                    (total[0], np.asarray(json.loads(total[1]), float), total[2])
                    if total
                    else (0, np.zeros(len(self.orders)), 0.0)
                )
                rdp1, pure1 = rdp0 + it.rdp, pure0 + it.pure_epsilon
                if not budget.admits(rdp1, pure1):
                    self._refuse(key, budget, rdp0, pure0, it, counterparty, kind)
                updates.append((key, budget, count + 1, rdp1, pure1))
            # BEGIN IMMEDIATE holds the write lock, so the next seq is ours; the hash that chains
            # this charge to the previous one covers all of it, so the rows are complete when inserted.
            prev = con.execute("SELECT seq, hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()
            seq, prev_hash = (prev[0] + 1, prev[1]) if prev else (1, genesis(self.orders))
            charge_row = (
                seq,
                record.release_id,
                now_rfc3339(),
                it.charged.level,
                it.charged.unit,
                record.unit,
                counterparty,
                record.subject,
                record.mechanism,
                it.charged.epsilon,
                it.charged.delta,
                dumps(it.rdp.tolist()),
                it.pure_epsilon,
                dumps([k.name for k, _ in it.budgets]),
                record_json,
            )
            budget_rows = [
                (key.name, key.level, key.unit, key.subject, key.counterparty, budget.epsilon, budget.delta)
                for key, budget, *_ in updates
            ]
            model_rows = [(model, int(it.lc)) for model in sorted(it.models)]
            h = chain_hash(prev_hash, charge_row, budget_rows, model_rows)
            con.execute(
                f"INSERT INTO charges ({', '.join(c for c, _ in CHARGE_COLS)}, prev_hash, hash)"
                f" VALUES ({', '.join('?' * (len(CHARGE_COLS) + 2))})",
                (*charge_row, prev_hash, h),
            )
            for (key, _budget, count, rdp1, pure1), row in zip(updates, budget_rows, strict=True):
                con.execute("INSERT INTO charge_budgets VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (seq, *row))
                con.execute(
                    "INSERT INTO totals VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (budget) DO UPDATE SET"
                    " count = excluded.count, rdp = excluded.rdp, pure_epsilon = excluded.pure_epsilon,"
                    " last_seq = excluded.last_seq",
                    (
                        key.name,
                        key.level,
                        key.unit,
                        key.subject,
                        key.counterparty,
                        count,
                        dumps(rdp1.tolist()),
                        pure1,
                        seq,
                    ),
                )
            for row in model_rows:
                con.execute("INSERT INTO charge_models VALUES (?, ?, ?)", (seq, *row))
            # Read the rows back and hash them as verify() will: a value SQLite stores differently
            # from what was hashed fails this charge now (rolled back), not the next open.
            if self._stored_hash(con, seq, prev_hash) != h:
                raise FailedPrecondition(
                    f"ledger {self.path}: charge {seq} does not read back as hashed; nothing was charged"
                )
            entry = self._entry(con, seq)
        # committed; anchored (fsync'd outside the file) before the caller may send a byte
        self.anchor.append([AnchorPoint("charges", seq, h)])
        log.info(
            "charged release_id=%s entry=%d mechanism=%s level=%s unit=%s counterparty=%s subject=%s epsilon=%.6g delta=%.3g budgets=%s",
            record.release_id,
            seq,
            record.mechanism,
            it.charged.level,
            it.charged.unit,
            counterparty,
            record.subject,
            it.charged.epsilon,
            it.charged.delta,
            ",".join(k.name for k, _ in it.budgets),
        )
        return entry

    @staticmethod
    def _parts(kind: str | tuple[str, ...], charged: ReleaseRecord) -> list[tuple[str, float]]:
        """(request kind, ε in the budget's unit) of every part a per-request cap applies to."""
        if isinstance(kind, str):
            return [(kind, charged.epsilon)]
        kinds = tuple(kind)
        if (
            charged.mechanism != "composite"
            or charged.parameters.get("composition") != "sequential"
            or len(charged.components) != len(kinds)
        ):
            raise InvalidArgument(
                "kind",
                f"{list(kinds)} names the parts of a sequential composite of {len(kinds)} releases; "
                f"the record is a {charged.mechanism!r} with {len(charged.components)} components",
            )
        return [(k, c.epsilon) for k, c in zip(kinds, charged.components, strict=True)]

    def _check_pool(self, con: sqlite3.Connection, it: _Interpreted) -> None:
        if not it.models:
            return
        marks = ",".join("?" * len(it.models))
        sql = f"SELECT DISTINCT model FROM charge_models WHERE model IN ({marks}) AND seq NOT IN (SELECT seq FROM cancellations)"
        if not it.lc:
            sql += " AND lc = 1"
        clash = sorted(r[0] for r in con.execute(sql, sorted(it.models)))
        if clash:
            what = (
                "an LC merge cannot share models with earlier data-level releases"
                if it.lc
                else "a release cannot share models with an earlier LC merge"
            )
            raise FailedPrecondition(
                f"release {it.record.release_id} refused: {what} (shared: {clash}); their RDP does not add up "
                "to a valid bound (see peer.budget.ledger)",
                reason="POOL_MODELS_SHARED",
                metadata={"shared_models": ",".join(clash), "lc": it.lc},
            )

    def _refuse(
        self,
        key: BudgetKey,
        budget: FilterBudget,
        rdp0: np.ndarray,
        pure0: float,
        it: _Interpreted,
        counterparty: str,
        kind: str | None,
    ) -> None:
        """Raise BudgetExhausted. The requester is told the budget, its limits, this release's
        own ε at the budget's δ and the policy's per-request cap for this kind (if any); what is
        spent and remaining only as far as the policy shows that budget to it (``show_remaining``:
        "all" → its own and the shared budgets, "own" → its own only). Spent is the filter's ε at
        the budget's δ (as ``ledger show`` prints it) and remaining = limit − spent: a guide to
        what one may still ask for, not a promise — the filter admits a request by composing its
        RDP with what is spent, order by order, which can refuse a request whose own ε is a
        little below the remainder."""
        from peer.dp.accounting.conversions import rdp_to_epsilon

        spent, _ = budget.spent_epsilon(rdp0, pure0)
        # one fixed release's own ε at the δ each order holds in the filter (not the filter's guarantee)
        alone = min(
            rdp_to_epsilon(self.orders, it.rdp, budget.delta_per_order) if budget.delta > 0 else math.inf,
            it.pure_epsilon,
        )
        show = self.policy.shows_remaining(counterparty)
        visible = show == "all" or (show == "own" and key.counterparty == counterparty)
        metadata: dict[str, Any] = {
            "budget": key.name,
            "level": key.level,
            "unit": key.unit,
            "epsilon_limit": budget.epsilon,
            "delta_limit": budget.delta,
            "request_epsilon": alone,
        }
        cap = self.policy.caps.get(kind) if kind is not None else None
        if cap is not None:
            metadata["request_cap_epsilon"] = cap
        standing = "the site's policy does not show this budget's standing to you"
        if visible:
            remaining = max(0.0, budget.epsilon - spent)
            metadata.update(spent_epsilon=spent, remaining_epsilon=remaining)
            standing = (
                f"spent ε={spent:.4g}, remaining ε={remaining:.4g} at δ={budget.delta:g} (by the filter; "
                f"{budget.explain(rdp0 + it.rdp, pure0 + it.pure_epsilon)})"
            )
        msg = (
            f"privacy budget {key.name} ({key.scope}) is exhausted for this request: limit (ε={budget.epsilon:g}, "
            f"δ={budget.delta:g}), this release alone ε={alone:.4g} at that δ "
            f"(its record: ε={it.charged.epsilon:.4g}, δ={it.charged.delta:.3g}); {standing}. Nothing was released."
        )
        log.warning(
            "refused release_id=%s mechanism=%s budget=%s spent_epsilon=%.6g limit_epsilon=%g",
            it.record.release_id,
            it.record.mechanism,
            key.name,
            spent,
            budget.epsilon,
        )
        raise BudgetExhausted(msg, metadata=metadata)

    def record_event(self, release_id: str, kind: str, detail: str = "") -> None:
        """Append a delivery event ("sent", "send-failed", "note") for a charged release."""
        if kind not in EVENT_KINDS:
            raise InvalidArgument("kind", f"must be one of {list(EVENT_KINDS)}, got {kind!r}")
        with self._write() as con:
            row = con.execute("SELECT seq FROM charges WHERE release_id = ?", (release_id,)).fetchone()
            if row is None:
                raise NotFound(f"no charge for release {release_id}")
            if kind != "note" and self._is_cancelled(con, row[0]):
                raise FailedPrecondition(f"release {release_id} was cancelled: it may not be sent")
            last = con.execute("SELECT id, hash FROM events ORDER BY id DESC LIMIT 1").fetchone()
            event = ((last[0] if last else 0) + 1, release_id, now_rfc3339(), kind, str(detail))
            prev_hash = last[1] if last else GENESIS
            h = event_hash(prev_hash, event)
            con.execute(
                "INSERT INTO events (id, release_id, at, kind, detail, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*event, prev_hash, h),
            )
        # a "sent" event forbids cancelling the charge: cutting it off must not reopen a refund
        self.anchor.append([AnchorPoint("events", event[0], h)])

    # ---- cancelling -----------------------------------------------------------------------------

    def cancel(self, release_id: str, reason: str) -> dict:
        """Withdraw the charge of a release that never left (see "Cancelling a charge" above).

        Refused (FailedPrecondition) once a "sent" or "send-failed" event exists for the release
        — its bytes may have left — or when it is already cancelled; NotFound if it was never
        charged. The caller promises what the ledger cannot see: no byte of the release was
        handed to the transport. Returns the cancellation as :meth:`cancellations` lists it.
        """
        if self.policy is None:
            raise FailedPrecondition(f"ledger {self.path} was opened without a policy: it cannot cancel")
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidArgument("reason", "must say why the charge is cancelled")
        with self._write() as con:
            row = con.execute(
                "SELECT seq, hash, budgets, counterparty FROM charges WHERE release_id = ?", (release_id,)
            ).fetchone()
            if row is None:
                raise NotFound(f"no charge for release {release_id}")
            seq, charge_hash, budgets, counterparty = row
            if self._is_cancelled(con, seq):
                raise FailedPrecondition(f"release {release_id} is already cancelled")
            sent = con.execute(
                "SELECT kind FROM events WHERE release_id = ? AND kind IN ('sent', 'send-failed') LIMIT 1",
                (release_id,),
            ).fetchone()
            if sent is not None:
                raise FailedPrecondition(
                    f"release {release_id} has a {sent[0]!r} event: its bytes may have left, "
                    "and a charge is never refunded once they may have"
                )
            if (
                self._has_served_again(con)
                and con.execute("SELECT 1 FROM served_again WHERE release_id = ? LIMIT 1", (release_id,)).fetchone()
            ):
                raise FailedPrecondition(f"release {release_id} was served again: its bytes have left")
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
                self._recompute_total(con, budget)
        self.anchor.append([AnchorPoint("cancellations", cancel_id, h)])
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

    def cancellations(self) -> list[dict]:
        """Every cancelled charge, in cancellation order."""
        with self._read() as con:
            if not self._has_cancellations(con):
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

    # ---- serving a data-level release again ------------------------------------------------------

    def serve_again(self, release_id: str, counterparty: str, detail: str = "") -> dict:
        """Record that the identical bytes of the charged release ``release_id`` are served
        again to ``counterparty``, at no charge: a data-level release is a DP output of the
        site's training records, and handing the same output out again is post-processing, so
        no budget's sums change. Append-only: a row of ``served_again`` chained by its own hash,
        which also covers the original charge's hash and the charge chain's head at the time.

        Refused: NotFound if ``release_id`` was never charged; FailedPrecondition if the charge
        was cancelled (its bytes must never leave) or is not data-level (a model-level release
        is per counterparty and never reused). Returns the row as :meth:`served_again` lists it.
        """
        if not isinstance(counterparty, str) or not counterparty:
            raise InvalidArgument("counterparty", "is required")
        with self._write() as con:
            row = con.execute("SELECT seq, hash, level FROM charges WHERE release_id = ?", (release_id,)).fetchone()
            if row is None:
                raise NotFound(f"no charge for release {release_id}")
            seq, charge_hash, level = row
            if self._is_cancelled(con, seq):
                raise FailedPrecondition(f"release {release_id} was cancelled: it may not be served")
            if level != "data":
                raise FailedPrecondition(
                    f"release {release_id} is {level}-level: only data-level releases are served again"
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
        self.anchor.append([AnchorPoint("served_again", served_id, h)])
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

    def served_again(self, *, counterparty: str | None = None, release_id: str | None = None) -> list[dict]:
        """Every release served again (no charge), in order; each names its original entry."""
        with self._read() as con:
            if not self._has_served_again(con):
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

    @staticmethod
    def _has_served_again(con: sqlite3.Connection) -> bool:
        # a ledger written before releases were served again and opened read-only has no such table
        return (
            con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'served_again'").fetchone()
            is not None
        )

    def _verify_served_again(self, con: sqlite3.Connection, cancelled: set[int], problems: list[str]) -> None:
        """Check the served-again rows' own hash chain; each must name a data-level charge that
        is not cancelled (they never enter a budget's sums)."""
        if not self._has_served_again(con):
            return
        prev = GENESIS
        for sid, seq, release_id, cp, at, detail, head, prev_hash, h, charge_hash, charge_release, level in con.execute(
            "SELECT s.id, s.seq, s.release_id, s.counterparty, s.at, s.detail, s.head_hash, s.prev_hash, s.hash,"
            " c.hash, c.release_id, c.level FROM served_again s LEFT JOIN charges c ON c.seq = s.seq ORDER BY s.id"
        ):
            if charge_hash is None or charge_release != release_id:
                problems.append(f"served-again row {sid} names no such charge")
            elif prev_hash != prev or h != served_again_hash(
                prev_hash, seq, release_id, charge_hash, cp, head, at, detail
            ):
                problems.append(f"served-again hash chain broken at row {sid}")
                break
            elif seq in cancelled or level != "data":
                problems.append(f"served-again row {sid} names a cancelled or non-data-level charge (entry {seq})")
            prev = h

    @staticmethod
    def _has_cancellations(con: sqlite3.Connection) -> bool:
        # a ledger written before cancellations existed and opened read-only has no such table
        return (
            con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cancellations'").fetchone()
            is not None
        )

    def _is_cancelled(self, con: sqlite3.Connection, seq: int) -> bool:
        return (
            self._has_cancellations(con)
            and con.execute("SELECT 1 FROM cancellations WHERE seq = ?", (seq,)).fetchone() is not None
        )

    def _recompute_total(self, con: sqlite3.Connection, budget: str) -> None:
        """Rewrite one budget's cached totals from its charges that are not cancelled, summed in
        charge order exactly as :meth:`verify` sums them (so the cache stays bit-equal)."""
        rows = con.execute(
            "SELECT c.seq, c.rdp, c.pure_epsilon FROM charges c JOIN charge_budgets b ON b.seq = c.seq"
            " WHERE b.budget = ? AND c.seq NOT IN (SELECT seq FROM cancellations) ORDER BY c.seq",
            (budget,),
        ).fetchall()
        if not rows:
            con.execute("DELETE FROM totals WHERE budget = ?", (budget,))
            return
        rdp, pure = np.zeros(len(self.orders)), 0.0
        for _, vec, p in rows:
            rdp = rdp + np.asarray(json.loads(vec), float)
            pure = pure + p
        con.execute(
            "UPDATE totals SET count = ?, rdp = ?, pure_epsilon = ?, last_seq = ? WHERE budget = ?",
            (len(rows), dumps(rdp.tolist()), pure, rows[-1][0], budget),
        )

    def _verify_cancellations(self, con: sqlite3.Connection, problems: list[str]) -> set[int]:
        """Check the cancellations' own hash chain (each link covers the cancelled charge's hash);
        return the cancelled entries."""
        if not self._has_cancellations(con):
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

    # ---- reading --------------------------------------------------------------------------------

    _ENTRY_COLS = "seq, release_id, charged_at, level, unit, counterparty, subject, mechanism, epsilon, delta, rdp, budgets, record, hash"

    @staticmethod
    def _to_entry(r: tuple) -> LedgerEntry:
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

    def _entry(self, con: sqlite3.Connection, seq: int) -> LedgerEntry:
        return self._to_entry(con.execute(f"SELECT {self._ENTRY_COLS} FROM charges WHERE seq = ?", (seq,)).fetchone())

    def entries(
        self,
        *,
        counterparty: str | None = None,
        level: str | None = None,
        subject: str | None = None,
        include_cancelled: bool = False,
    ) -> list[LedgerEntry]:
        """Charged releases in charge order, optionally only those to one counterparty / level /
        model; cancelled charges (see :meth:`cancel`) only with ``include_cancelled``."""
        where, args = [], []
        if not include_cancelled and self._has_cancellations(self._conn()):
            where.append("seq NOT IN (SELECT seq FROM cancellations)")
        for col, value in (("counterparty", counterparty), ("level", level), ("subject", subject)):
            if value is not None:
                where.append(f"{col} = ?")
                args.append(value)
        sql = f"SELECT {self._ENTRY_COLS} FROM charges"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._read() as con:
            return [self._to_entry(r) for r in con.execute(sql + " ORDER BY seq", args)]

    def charge_of(self, release_id: str) -> tuple[LedgerEntry, bool] | None:
        """The charge of ``release_id`` and whether it was cancelled, or None if never charged."""
        with self._read() as con:
            row = con.execute(f"SELECT {self._ENTRY_COLS} FROM charges WHERE release_id = ?", (release_id,)).fetchone()
            if row is None:
                return None
            return self._to_entry(row), self._is_cancelled(con, row[0])

    def events(self, release_id: str | None = None) -> list[dict]:
        sql, args = "SELECT id, release_id, at, kind, detail FROM events", ()
        if release_id is not None:
            sql, args = sql + " WHERE release_id = ?", (release_id,)
        with self._read() as con:
            return [
                dict(zip(("id", "release_id", "at", "kind", "detail"), r, strict=True))
                for r in con.execute(sql + " ORDER BY id", args)
            ]

    def _limits(self, con: sqlite3.Connection, key: BudgetKey) -> FilterBudget | None:
        """The budget's limits: from the policy if there is one, else as recorded at the last charge."""
        if self.policy is not None:
            if key.level == "data":
                return self.policy.data_filter() if self.policy.data and self.policy.data.unit == key.unit else None
            mb = self.policy.model_budgets(key.subject)
            return mb.per_counterparty if key.counterparty else mb.total
        row = con.execute(
            "SELECT epsilon_limit, delta_limit FROM charge_budgets WHERE budget = ? ORDER BY seq DESC LIMIT 1",
            (key.name,),
        ).fetchone()
        return FilterBudget(row[0], row[1], self.orders) if row else None

    def budget_states(
        self, *, pld: bool = False, counterparty: str | None = None, scope: str = "all"
    ) -> list[BudgetState]:
        """Every budget that has charges (and the data budget the policy sets, even if unused).

        ``counterparty`` keeps the budgets that concern that peer (its own per-counterparty
        budgets, plus, with ``scope="all"``, totals and the data budget). ``pld=True`` adds the
        PLD composition of each budget's releases (slower: it composes every record's PLD).
        """
        with self._read() as con:
            return self._budget_states(con, pld, counterparty, scope)

    def _budget_states(
        self, con: sqlite3.Connection, pld: bool, counterparty: str | None, scope: str
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
            limits = self._limits(con, key)
            states.append(self._state(con, key, limits, count, np.asarray(json.loads(rdp), float), pure, pld))
        if self.policy is not None and self.policy.data is not None and scope == "all":
            key = BudgetKey("data", self.policy.data.unit)
            if key.name not in seen:
                states.insert(
                    0, self._state(con, key, self.policy.data_filter(), 0, np.zeros(len(self.orders)), 0.0, pld)
                )
        return states

    def _state(
        self,
        con: sqlite3.Connection,
        key: BudgetKey,
        limits: FilterBudget | None,
        count: int,
        rdp: np.ndarray,
        pure: float,
        pld: bool,
    ) -> BudgetState:
        if limits is None:
            return BudgetState(
                key, math.nan, math.nan, count, math.nan, math.nan, None, "no limit known for this budget"
            )
        spent, order = limits.spent_epsilon(rdp, pure)
        pld_eps, note = None, ""
        if pld:
            pld_eps, note = self._pld_epsilon(con, key, limits.delta)
        return BudgetState(key, limits.epsilon, limits.delta, count, spent, order, pld_eps, note)

    def _pld_epsilon(self, con: sqlite3.Connection, key: BudgetKey, delta: float) -> tuple[float | None, str]:
        records = [
            ReleaseRecord.from_json(r[0])
            for r in con.execute(
                "SELECT c.record FROM charges c JOIN charge_budgets b ON b.seq = c.seq WHERE b.budget = ?"
                + (" AND c.seq NOT IN (SELECT seq FROM cancellations)" if self._has_cancellations(con) else "")
                + " ORDER BY c.seq",
                (key.name,),
            )
        ]
        note = "PLD composition of the charged releases as one fixed sequence; not the adaptive guarantee"
        if not records:
            return 0.0, note
        try:
            composed, fallbacks = None, 0
            for r in records:
                charged = per_neuron_record(r)
                p = self.accountant.pld(charged)
                composed = p if composed is None else composed.compose(p)
                fallbacks += self.accountant.pld_fallbacks(charged)
            if fallbacks:
                note += (
                    f"; {fallbacks} parallel release part(s) have no part that dominates the others, so their PLD "
                    "is the sequential composition of the parts (conservative: it can exceed the filter's ε, "
                    "which takes their maximum exactly)"
                )
            return float(composed.get_epsilon_for_delta(delta)), note
        except Exception as e:  # an accountant without a PLD for some record: say so, keep going
            return None, f"PLD unavailable: {type(e).__name__}: {e}"

    def remaining_for(self, peer: str) -> list[BudgetState]:
        """The budgets ``peer`` may see under the policy's show_remaining ("none" → [])."""
        show = self.policy.shows_remaining(peer) if self.policy is not None else "none"
        if show == "none":
            return []
        return self.budget_states(counterparty=peer, scope=show)

    def summary(self, *, counterparty: str | None = None, pld: bool = True) -> dict:
        """Everything ``privfusion ledger show`` prints, as JSON-ready data."""
        with self._read():  # entries and budgets from one snapshot
            return jsonable(
                {
                    "ledger": str(self.path),
                    "orders": list(self.orders),
                    "filter": "RDP filter over the orders (δ split evenly across them) plus a pure-ε track",
                    "figures": FIGURE_SCOPES,
                    "anchor": self.anchor_state(),
                    "entries": [e.to_dict() for e in self.entries(counterparty=counterparty)],
                    "budgets": [s.to_dict() for s in self.budget_states(pld=pld, counterparty=counterparty)],
                    "cancelled": [
                        c for c in self.cancellations() if counterparty is None or c["counterparty"] == counterparty
                    ],
                    "served_again": self.served_again(counterparty=counterparty),
                }
            )

    # ---- consistency ----------------------------------------------------------------------------

    def _stored_hash(self, con: sqlite3.Connection, seq: int, prev_hash: str) -> str:
        """The chain hash of charge ``seq`` recomputed from what the file holds."""
        charge = con.execute(
            f"SELECT {', '.join(c for c, _ in CHARGE_COLS)} FROM charges WHERE seq = ?", (seq,)
        ).fetchone()
        budgets = con.execute(
            f"SELECT {', '.join(c for c, _ in BUDGET_COLS)} FROM charge_budgets WHERE seq = ?", (seq,)
        ).fetchall()
        models = con.execute(
            f"SELECT {', '.join(c for c, _ in MODEL_COLS)} FROM charge_models WHERE seq = ?", (seq,)
        ).fetchall()
        return chain_hash(prev_hash, charge, budgets, models)

    def verify(self) -> None:
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
        anchored = self.anchor.heads()
        problems = []
        with self._read() as con:
            behind = self._behind_anchor(con, anchored)
            check = [r[0] for r in con.execute("PRAGMA integrity_check")]
            if check != ["ok"]:
                problems.append(f"integrity_check: {check[:5]}")
            cancelled = self._verify_cancellations(con, problems)
            self._verify_served_again(con, cancelled, problems)
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
        prev = genesis(self.orders)
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
            if vec.shape != (len(self.orders),):
                problems.append(f"entry {seq}: its RDP has {vec.size} values for {len(self.orders)} orders")
                break
            for name, level, unit, subject, cp, *_ in rows:
                key = (level, unit, subject, cp)
                if BudgetKey(*key).name != name or keys.setdefault(name, key) != key:
                    problems.append(f"entry {seq}: budget {name} does not match its level/unit/model/counterparty")
                s = sums.setdefault(name, [0, np.zeros(len(self.orders)), 0.0, 0])
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
            raise FailedPrecondition(f"ledger {self.path} is inconsistent: " + "; ".join(problems))
        if behind:
            raise FailedPrecondition(
                f"ledger {self.path} is behind its anchor {self.anchor.path}: " + "; ".join(behind) + ". Its end "
                "was cut off or an older copy of the file was put back, so budget already spent would be "
                "admitted again; it is not opened. Restore the ledger that reaches the anchor (the receipts "
                "counterparties hold name each charge's entry and chain head)",
                reason="LEDGER_BEHIND_ANCHOR",
                metadata={"ledger": str(self.path), "anchor": str(self.anchor.path)},
            )

    # ---- the anchor (peer.budget.anchor) ---------------------------------------------------------

    def _chain_heads(self, con: sqlite3.Connection) -> dict[str, tuple[int, str]]:
        """(id, hash) of the last row of every chain that has rows (as stored: unchecked)."""
        out = {}
        for chain, (table, col) in CHAIN_TABLES.items():
            exists = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
            row = exists and con.execute(f"SELECT {col}, hash FROM {table} ORDER BY {col} DESC LIMIT 1").fetchone()
            if row:
                out[chain] = (row[0], row[1])
        return out

    def _behind_anchor(self, con: sqlite3.Connection, anchored: dict[str, AnchorPoint]) -> list[str]:
        """What differs between the anchored points and the file (empty: the file reaches them all)."""
        heads = self._chain_heads(con)
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

    def _anchor_sync(self) -> None:
        """At a writer's open (after :meth:`verify`): create the anchor if there is none, and
        anchor every chain the file holds further than the anchor does (a crash between a
        commit and its anchoring; a file that never had an anchor)."""
        created = not self.anchor.exists()
        if created:
            self.anchor.create(self.path.name)
        anchored = self.anchor.heads()
        with self._read() as con:
            heads = self._chain_heads(con)
        self.anchor.append(
            [AnchorPoint(c, int(n), h) for c, (n, h) in heads.items() if c not in anchored or n > anchored[c].n]
        )
        if created and heads:
            log.warning(
                "anchor-created ledger=%s anchor=%s charges=%d: this ledger had no anchor; it is anchored at its "
                "current state, so a truncation made before now cannot be detected by this site (only against "
                "the receipts its counterparties hold)",
                self.path,
                self.anchor.path,
                heads["charges"][0] if "charges" in heads else 0,
            )
        elif created:
            log.info("anchor-created ledger=%s anchor=%s", self.path, self.anchor.path)

    def anchor_state(self) -> dict:
        """The anchor file and, per chain, the row it anchors (``ledger show``)."""
        heads = self.anchor.heads()
        return {
            "path": str(self.anchor.path),
            "exists": self.anchor.exists(),
            "anchored": {c: {"n": p.n, "head": p.head} for c, p in sorted(heads.items())},
        }

    def chain_position(self, entry_id: int | str, served_again: int | str | None = None) -> tuple[int, str]:
        """(seq, hash) of the charge chain right after charge ``entry_id`` — its own sequence
        number and hash — or, with ``served_again`` (a served-again row of that charge), the
        chain's head when it was served again: what the release's receipt carries."""
        with self._read() as con:
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


# Re-exported for the code that imports them from here (the types moved to peer.budget.budgets,
# the per-neuron restatement to peer.dp.accounting.per_unit).
__all__ = [
    "EVENT_KINDS",
    "FIGURE_SCOPES",
    "GENESIS",
    "SCHEMA_VERSION",
    "BudgetKey",
    "BudgetState",
    "Ledger",
    "LedgerEntry",
    "per_neuron_record",
    "pool_models",
]
