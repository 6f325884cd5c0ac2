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

Files: ``peer.budget.storage`` holds the storage (SQLite connections, transactions, the schema's
creation, the filter's orders); this module the ``Ledger`` (anchor sync at open), whose other
methods are thin entry points to one module per concept, each a set of functions over the
ledger's storage (its connection, policy, accountant, anchor):
``peer.budget.charging`` (interpreting a record, charging and refusing it, delivery events),
``peer.budget.corrections`` (cancelling a charge, serving a release again: their own chains),
``peer.budget.verification`` (the chains, the totals cache and the anchor checked at open) and
``peer.budget.reading`` (entries, budget states, the PLD figure, the summary, chain positions).
The budgets' types are in ``peer.budget.budgets``, the schema and hash chains in
``peer.budget.chain``, the filter in ``peer.budget.filter``.

Logs carry record ids, mechanism names, levels, units, counterparty and model names and public
ε/δ — never parameters or values.
"""

from __future__ import annotations

import logging
import os

from peer.base.records import ReleaseRecord
from peer.budget import charging, corrections, reading, verification
from peer.budget.anchor import AnchorPoint
from peer.budget.budgets import FIGURE_SCOPES, BudgetKey, BudgetState, LedgerEntry, pool_models
from peer.budget.chain import EVENT_KINDS, GENESIS, SCHEMA_VERSION
from peer.budget.charging import Interpreted
from peer.budget.policy import Policy
from peer.budget.storage import LedgerStorage
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.per_unit import per_neuron_record

log = logging.getLogger("peer.budget.ledger")


class Ledger(LedgerStorage):
    """A site's privacy-budget ledger in one SQLite file.

    ``Ledger(path, policy)`` creates or opens the file; the policy supplies the budgets and the
    filter's orders (fixed for the file's lifetime). ``Ledger(path)`` without a policy opens an
    existing file for reading (``charge`` is refused). ``accountant`` is the
    ``peer.dp.accounting.accountant.Accountant`` whose PLD discretisation the ledger's PLD
    figures use (default: the project's); the ledger interprets every record at its filter's
    orders (``self.accountant`` = ``accountant.with_orders(self.orders)``). Safe to share between threads (one SQLite connection per thread) and
    to open from several processes at once.

    The storage is ``peer.budget.storage.LedgerStorage``; each method below calls the function
    of the same name in the module of its concept (``charging``, ``corrections``,
    ``verification``, ``reading``), whose docstring states what it does and refuses.
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
        super().__init__(path, policy, accountant=accountant, busy_timeout_s=busy_timeout_s)
        if verify:
            self.verify()
        if policy is not None:
            self._anchor_sync()

    # ---- interpretation -------------------------------------------------------------------------

    def interpret(
        self, record: ReleaseRecord, counterparty: str, *, also_counterparties: tuple[str, ...] = ()
    ) -> Interpreted:
        """See ``peer.budget.charging.interpret``."""
        return charging.interpret(self, record, counterparty, also_counterparties=also_counterparties)

    # ---- charging -------------------------------------------------------------------------------

    def charge(
        self,
        record: ReleaseRecord,
        counterparty: str,
        *,
        kind: str | tuple[str, ...] | None = None,
        also_counterparties: tuple[str, ...] = (),
    ) -> LedgerEntry:
        """See ``peer.budget.charging.charge``."""
        return charging.charge(self, record, counterparty, kind=kind, also_counterparties=also_counterparties)

    def record_event(self, release_id: str, kind: str, detail: str = "") -> None:
        """See ``peer.budget.charging.record_event``."""
        return charging.record_event(self, release_id, kind, detail)

    # ---- cancelling -----------------------------------------------------------------------------

    def cancel(self, release_id: str, reason: str) -> dict:
        """See ``peer.budget.corrections.cancel``."""
        return corrections.cancel(self, release_id, reason)

    def cancellations(self) -> list[dict]:
        """See ``peer.budget.corrections.cancellations``."""
        return corrections.cancellations(self)

    # ---- serving a data-level release again ------------------------------------------------------

    def serve_again(self, release_id: str, counterparty: str, detail: str = "") -> dict:
        """See ``peer.budget.corrections.serve_again``."""
        return corrections.serve_again(self, release_id, counterparty, detail)

    def served_again(self, *, counterparty: str | None = None, release_id: str | None = None) -> list[dict]:
        """See ``peer.budget.corrections.served_again``."""
        return corrections.served_again(self, counterparty=counterparty, release_id=release_id)

    # ---- reading --------------------------------------------------------------------------------

    def entries(
        self,
        *,
        counterparty: str | None = None,
        level: str | None = None,
        subject: str | None = None,
        include_cancelled: bool = False,
    ) -> list[LedgerEntry]:
        """See ``peer.budget.reading.entries``."""
        return reading.entries(
            self, counterparty=counterparty, level=level, subject=subject, include_cancelled=include_cancelled
        )

    def charge_of(self, release_id: str) -> tuple[LedgerEntry, bool] | None:
        """See ``peer.budget.reading.charge_of``."""
        return reading.charge_of(self, release_id)

    def events(self, release_id: str | None = None) -> list[dict]:
        """See ``peer.budget.reading.events``."""
        return reading.events(self, release_id)

    def budget_states(
        self, *, pld: bool = False, counterparty: str | None = None, scope: str = "all"
    ) -> list[BudgetState]:
        """See ``peer.budget.reading.budget_states``."""
        return reading.budget_states(self, pld=pld, counterparty=counterparty, scope=scope)

    def remaining_for(self, peer: str) -> list[BudgetState]:
        """See ``peer.budget.reading.remaining_for``."""
        return reading.remaining_for(self, peer)

    def summary(self, *, counterparty: str | None = None, pld: bool = True) -> dict:
        """See ``peer.budget.reading.summary``."""
        return reading.summary(self, counterparty=counterparty, pld=pld)

    # ---- consistency ----------------------------------------------------------------------------

    def verify(self) -> None:
        """See ``peer.budget.verification.verify``."""
        return verification.verify(self)

    # ---- the anchor (peer.budget.anchor) ---------------------------------------------------------

    def _anchor_sync(self) -> None:
        """At a writer's open (after :meth:`verify`): create the anchor if there is none, and
        anchor every chain the file holds further than the anchor does (a crash between a
        commit and its anchoring; a file that never had an anchor)."""
        created = not self.anchor.exists()
        if created:
            self.anchor.create(self.path.name)
        anchored = self.anchor.heads()
        with self._read() as con:
            heads = verification.chain_heads(con)
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
        """See ``peer.budget.reading.anchor_state``."""
        return reading.anchor_state(self)

    def chain_position(self, entry_id: int | str, served_again: int | str | None = None) -> tuple[int, str]:
        """See ``peer.budget.reading.chain_position``."""
        return reading.chain_position(self, entry_id, served_again)


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
