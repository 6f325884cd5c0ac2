"""The ledger's budgets and what it returns: which filter a charge goes to (:class:`BudgetKey`),
where a budget stands (:class:`BudgetState`), one stored charge (:class:`LedgerEntry`), what
each printed ε covers (``FIGURE_SCOPES``), and which pool models a data-level release draws on
(:func:`pool_models`, for the rule that LC merges share no model). Storage is
``peer.budget.ledger``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord


def pool_models(record: ReleaseRecord) -> tuple[frozenset[str], bool]:
    """(pool models a data-level release draws on, whether it is an LC merge)."""
    if record.level != "data":
        return frozenset(), False
    if record.mechanism == "dpsgd":
        if not record.subject:
            raise InvalidArgument("subject", "a dpsgd release must name its model")
        return frozenset([record.subject]), False
    if record.mechanism in ("rs-merge", "lc-merge"):
        names = record.parameters.get("names")
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
            raise InvalidArgument("parameters.names", f"a {record.mechanism} record must name the models it merges")
        return frozenset(names), record.mechanism == "lc-merge"
    return frozenset(), False


@dataclass(frozen=True)
class BudgetKey:
    """One filter: ``level`` "data" (subject and counterparty empty) or "model" (subject = the
    model; counterparty empty for the model's total, else that counterparty's budget)."""

    level: str
    unit: str
    subject: str = ""
    counterparty: str = ""

    @property
    def name(self) -> str:
        if self.level == "data":
            return f"data/{self.unit}"
        if not self.counterparty:
            return f"model/{self.subject}/total"
        return f"model/{self.subject}/peer/{self.counterparty}"

    @property
    def scope(self) -> str:
        if self.level == "data":
            return f"data level, per {self.unit}"
        who = "all counterparties" if not self.counterparty else f"counterparty {self.counterparty}"
        return f"model {self.subject}, per neuron, {who}"


@dataclass(frozen=True)
class LedgerEntry:
    """One charged release as the ledger stored it."""

    entry_id: int
    release_id: str
    charged_at: str
    level: str
    unit: str
    counterparty: str
    subject: str
    mechanism: str
    epsilon: float
    delta: float
    rdp: tuple[float, ...]
    budgets: tuple[str, ...]
    record: ReleaseRecord
    hash: str

    def receipt(self) -> dict:
        """What travels with the bytes: the entry id, the chain hash and what was charged."""
        return {
            "entry_id": self.entry_id,
            "release_id": self.release_id,
            "charged_at": self.charged_at,
            "budgets": list(self.budgets),
            "unit": self.unit,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "ledger_hash": self.hash,
            "record_sha256": hashlib.sha256(self.record.canonical_json()).hexdigest(),
        }

    def to_dict(self) -> dict:
        out = self.receipt()
        out.update(
            level=self.level,
            counterparty=self.counterparty,
            subject=self.subject,
            mechanism=self.mechanism,
            record_unit=self.record.unit,
        )
        return out


@dataclass(frozen=True)
class BudgetState:
    """Where one budget stands. ``spent_epsilon`` is the filter's figure (the smallest budget at
    ``delta_limit`` that admits every charge so far; its order, ``inf`` for the pure track);
    ``pld_epsilon`` the PLD composition of the charged releases at ``delta_limit`` — a tight
    description, valid as a guarantee only for that fixed, non-adaptive sequence."""

    key: BudgetKey
    epsilon_limit: float
    delta_limit: float
    count: int
    spent_epsilon: float
    spent_order: float
    pld_epsilon: float | None = None
    pld_note: str = ""

    @property
    def remaining_epsilon(self) -> float:
        return max(0.0, self.epsilon_limit - self.spent_epsilon)

    def to_dict(self) -> dict:
        return {
            "budget": self.key.name,
            "scope": self.key.scope,
            "level": self.key.level,
            "unit": self.key.unit,
            "model": self.key.subject or None,
            "counterparty": self.key.counterparty or None,
            "epsilon_limit": self.epsilon_limit,
            "delta_limit": self.delta_limit,
            "count": self.count,
            "spent_epsilon_filter": self.spent_epsilon,
            "spent_order": None if math.isinf(self.spent_order) else self.spent_order,
            "spent_track": "pure" if math.isinf(self.spent_order) else "rdp",
            "remaining_epsilon_filter": self.remaining_epsilon,
            "spent_epsilon_pld": self.pld_epsilon,
            "pld_note": self.pld_note,
        }


#: What each ε of :meth:`Ledger.summary` (``ledger show``) covers, and by which accountant.
FIGURE_SCOPES = {
    "entries.epsilon": "that release alone, as its record states it (in the budget's unit: per-entry "
    "releases restated per neuron), at the entry's own δ",
    "budgets.spent_epsilon_filter": "the budget's total — every charge made to it (a model's total: all "
    "counterparties together) — by the RDP filter at the budget's δ: the adaptive guarantee",
    "budgets.spent_epsilon_pld": "the same charges, by PLD composition at the budget's δ: tight for that fixed "
    "sequence, not an adaptive guarantee (see pld_note where it exceeds the filter's)",
    "budgets.remaining_epsilon_filter": "limit − spent_epsilon_filter: a guide, not a price. A request is "
    "admitted when the filter, composing its RDP with what is spent order by order, stays within the limit; "
    "RDP composes sublinearly, so a request above the remainder can fit, and one just below it can be refused",
}
