"""Charging a release to the ledger, and refusing one: the records' interpretation at the
filter's orders (which budgets, what RDP and pure ε), the pool-sharing rule, the filter's
check and the appended, hash-chained charge; delivery events.

The rules are the ledger's (``peer.budget.ledger``: "Charging", "The two budgets, kept apart",
"Releases from a shared pool"); these functions are ``Ledger.interpret``, ``Ledger.charge``
and ``Ledger.record_event``, over the ledger's connection, policy, accountant and anchor.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.errors import BudgetExhausted, FailedPrecondition, InvalidArgument, NotFound
from peer.base.records import ReleaseRecord, now_rfc3339
from peer.budget import corrections, reading, verification
from peer.budget.anchor import AnchorPoint
from peer.budget.budgets import BudgetKey, LedgerEntry, pool_models
from peer.budget.chain import CHARGE_COLS, EVENT_KINDS, GENESIS, chain_hash, dumps, event_hash, genesis
from peer.budget.filter import FilterBudget
from peer.budget.storage import LedgerStorage
from peer.dp.accounting.per_unit import per_neuron_record

# one logger for the ledger, whichever of its modules writes the line
log = logging.getLogger("peer.budget.ledger")


@dataclass(frozen=True)
class Interpreted:
    """What charging a record would cost (``Ledger.interpret``): the record as given and as
    charged (restated per neuron), its RDP at the filter's orders, its pure ε (inf unless δ = 0),
    the budgets it goes to with their limits, the pool models it draws on and whether it is LC."""

    record: ReleaseRecord
    charged: ReleaseRecord
    rdp: np.ndarray
    pure_epsilon: float
    budgets: tuple[tuple[BudgetKey, FilterBudget], ...]
    models: frozenset[str]
    lc: bool


def budgets_for(
    ledger: LedgerStorage, charged: ReleaseRecord, counterparty: str
) -> tuple[tuple[BudgetKey, FilterBudget], ...]:
    policy = ledger.policy
    if charged.level == "data":
        if policy.data is None:
            raise FailedPrecondition(
                "the site's policy sets no data-level budget: data-level releases are refused",
                reason="NO_BUDGET",
                metadata={"level": "data"},
            )
        if charged.unit != policy.data.unit:
            raise FailedPrecondition(
                f"release {charged.release_id} is private per {charged.unit!r}, the site's data budget per "
                f"{policy.data.unit!r}; the two adjacencies do not convert into each other without loss, "
                "so the ledger refuses to mix them",
                reason="UNIT_MISMATCH",
                metadata={"unit": charged.unit, "budget_unit": policy.data.unit},
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
        raise FailedPrecondition(
            f"the site's policy sets no model-level budget for {charged.subject!r}: refused",
            reason="NO_BUDGET",
            metadata={"level": "model", "model": charged.subject},
        )
    return tuple(out)


def relayed_budgets(
    ledger: LedgerStorage, charged: ReleaseRecord, counterparty: str, also: tuple[str, ...]
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
    per = ledger.policy.model_budgets(charged.subject).per_counterparty
    if per is None:
        return ()
    return tuple((BudgetKey("model", "neuron", charged.subject, c), per) for c in also)


def interpret(
    ledger: LedgerStorage, record: ReleaseRecord, counterparty: str, *, also_counterparties: tuple[str, ...] = ()
) -> Interpreted:
    """What charging ``record`` to ``counterparty`` (and, for a relayed release, to the
    per-counterparty budgets of ``also_counterparties``) would cost, and to which budgets
    (no I/O)."""
    if ledger.policy is None:
        raise FailedPrecondition(
            f"ledger {ledger.path} was opened without a policy: it cannot charge", reason="LEDGER_WITHOUT_POLICY"
        )
    if not isinstance(record, ReleaseRecord):
        raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
    if not isinstance(counterparty, str) or not counterparty:
        raise InvalidArgument("counterparty", "must name the peer the release goes to")
    if record.counterparty not in (None, counterparty):
        raise InvalidArgument("counterparty", f"the record names {record.counterparty!r}, the charge {counterparty!r}")
    charged = per_neuron_record(record)
    models, lc = pool_models(charged)
    budgets = budgets_for(ledger, charged, counterparty) + relayed_budgets(
        ledger, charged, counterparty, also_counterparties
    )
    try:
        rdp = np.asarray(ledger.accountant.rdp(charged), dtype=float).reshape(-1)
    except (TypeError, ValueError) as e:
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument("record", f"cannot be interpreted by the accountant: {e}") from None
    # A Rényi divergence is >= 0; closed forms at tiny ε can round to -1e-17. Only rounding is
    # forgiven (and charged as 0); anything more negative is a malformed record.
    rdp = np.where((rdp < 0) & (rdp > -1e-12), 0.0, rdp)
    if rdp.shape != (len(ledger.orders),) or np.any(np.isnan(rdp)) or np.any(rdp < 0):
        raise InvalidArgument(
            "record", f"its RDP at the filter's orders must be {len(ledger.orders)} numbers >= 0, got {rdp!r}"
        )
    pure = math.inf
    if charged.delta == 0:
        pure = charged.epsilon
        # Pure ε-DP bounds every Rényi divergence by ε; a larger RDP means the record lies.
        if np.any(rdp > pure * (1 + 1e-9) + 1e-12):
            raise InvalidArgument(
                "epsilon", f"the record claims pure ε = {pure:g} but its RDP reaches {float(rdp.max()):g}"
            )
    return Interpreted(record, charged, rdp, pure, budgets, models, lc)


def charge(
    ledger: LedgerStorage,
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
    it = interpret(ledger, record, counterparty, also_counterparties=also)
    if kind is not None:
        for peer in (counterparty, *also):
            ledger.policy.check_request_parts(peer, parts(kind, it.charged))
    record_json = record.canonical_json().decode()
    with ledger._write() as con:
        row = con.execute(
            "SELECT seq, record, counterparty FROM charges WHERE release_id = ?", (record.release_id,)
        ).fetchone()
        if row is not None and corrections.is_cancelled(con, row[0]):
            raise FailedPrecondition(
                f"release {record.release_id} was cancelled; a cancelled release is never charged again",
                reason="RELEASE_CANCELLED",
            )
        if row is not None:
            if row[1] == record_json and row[2] == counterparty:
                log.info("already-charged release_id=%s entry=%d", record.release_id, row[0])
                existing = reading.entry(con, row[0])
                # a crash may have come between its commit and its anchoring: anchor it before it is sent
                ledger.anchor.append([AnchorPoint("charges", existing.entry_id, existing.hash)])
                return existing
            raise InvalidArgument("release_id", f"{record.release_id} was already charged for a different release")
        check_pool(con, it)
        updates = []
        for key, budget in it.budgets:
            total = con.execute("SELECT count, rdp, pure_epsilon FROM totals WHERE budget = ?", (key.name,)).fetchone()
            count, rdp0, pure0 = (
                (total[0], np.asarray(json.loads(total[1]), float), total[2])
                if total
                else (0, np.zeros(len(ledger.orders)), 0.0)
            )
            rdp1, pure1 = rdp0 + it.rdp, pure0 + it.pure_epsilon
            if not budget.admits(rdp1, pure1):
                refuse(ledger, key, budget, rdp0, pure0, it, counterparty, kind)
            updates.append((key, budget, count + 1, rdp1, pure1))
        # BEGIN IMMEDIATE holds the write lock, so the next seq is ours; the hash that chains
        # this charge to the previous one covers all of it, so the rows are complete when inserted.
        prev = con.execute("SELECT seq, hash FROM charges ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev_hash = (prev[0] + 1, prev[1]) if prev else (1, genesis(ledger.orders))
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
        if verification.stored_hash(con, seq, prev_hash) != h:
            raise FailedPrecondition(
                f"ledger {ledger.path}: charge {seq} does not read back as hashed; nothing was charged",
                reason="LEDGER_READ_BACK_MISMATCH",
            )
        entry = reading.entry(con, seq)
    # committed; anchored (fsync'd outside the file) before the caller may send a byte
    ledger.anchor.append([AnchorPoint("charges", seq, h)])
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


def parts(kind: str | tuple[str, ...], charged: ReleaseRecord) -> list[tuple[str, float]]:
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


def check_pool(con: sqlite3.Connection, it: Interpreted) -> None:
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


def refuse(
    ledger: LedgerStorage,
    key: BudgetKey,
    budget: FilterBudget,
    rdp0: np.ndarray,
    pure0: float,
    it: Interpreted,
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
        rdp_to_epsilon(ledger.orders, it.rdp, budget.delta_per_order) if budget.delta > 0 else math.inf,
        it.pure_epsilon,
    )
    show = ledger.policy.shows_remaining(counterparty)
    visible = show == "all" or (show == "own" and key.counterparty == counterparty)
    metadata: dict[str, Any] = {
        "budget": key.name,
        "level": key.level,
        "unit": key.unit,
        "epsilon_limit": budget.epsilon,
        "delta_limit": budget.delta,
        "request_epsilon": alone,
    }
    cap = ledger.policy.caps.get(kind) if kind is not None else None
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


def record_event(ledger: LedgerStorage, release_id: str, kind: str, detail: str = "") -> None:
    """Append a delivery event ("sent", "send-failed", "note") for a charged release."""
    if kind not in EVENT_KINDS:
        raise InvalidArgument("kind", f"must be one of {list(EVENT_KINDS)}, got {kind!r}")
    with ledger._write() as con:
        row = con.execute("SELECT seq FROM charges WHERE release_id = ?", (release_id,)).fetchone()
        if row is None:
            raise NotFound(f"no charge for release {release_id}", reason="CHARGE_NOT_FOUND")
        if kind != "note" and corrections.is_cancelled(con, row[0]):
            raise FailedPrecondition(
                f"release {release_id} was cancelled: it may not be sent", reason="RELEASE_CANCELLED"
            )
        last = con.execute("SELECT id, hash FROM events ORDER BY id DESC LIMIT 1").fetchone()
        event = ((last[0] if last else 0) + 1, release_id, now_rfc3339(), kind, str(detail))
        prev_hash = last[1] if last else GENESIS
        h = event_hash(prev_hash, event)
        con.execute(
            "INSERT INTO events (id, release_id, at, kind, detail, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (*event, prev_hash, h),
        )
    # a "sent" event forbids cancelling the charge: cutting it off must not reopen a refund
    ledger.anchor.append([AnchorPoint("events", event[0], h)])
