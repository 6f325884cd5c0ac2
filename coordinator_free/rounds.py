"""Coordinator-free fusion rounds: the logic, without the network.

Any site (the *requester*) can start a round for itself; nobody is in charge, and rounds of
different sites may run at the same time (each peer's daemon serves them concurrently and its
ledger serialises the charges). A round of requester R over the live peers P_1..P_k:

1. **health** — ``grpc.health.v1.Health/Check`` on every roster peer with a short deadline.
   If fewer than ``quorum`` sites (R included) are alive, the round aborts here: nothing has
   been requested, so nothing is charged anywhere.
2. **info** — ``GetPeerInfo`` (free): the peer's models and pools; R picks the model (and pool)
   whose architecture equals its own (or the ones the roster names).
3. Per peer, one of two methods (``method = "ldp" | "merged" | "auto"``):

   *ldp* (model level, local DP on the peer's neurons):
     a. **features** — ``ReleaseFeatures`` of the peer's model on R's PUBLIC probe set at
        (activation_epsilon, weight_epsilon) per neuron: Laplace on clipped activations,
        multi-bit on clipped weight features. Charged to the peer's model-level budgets
        (the model's total and R's per-counterparty budget), as the peer's policy allows.
     b. **align** — at R, no I/O: graph matching of the peer's noisy graph against R's own
        graph (R's exact features clipped to the same public bounds — R's own model never
        leaves R, so it needs no noise): ``peer.ldp.matching.match_graphs(own, theirs)`` gives
        perm[ℓ][i] = j (R's node i ↔ the peer's node j). Multi-model matching is a star:
        every peer is matched against R's graph, so all end up in R's neuron order.
     c. **weights** — ``ReleaseWeights`` at (weights_epsilon, weights_delta) per neuron (PFA:
        clipped Gaussian perturbation plus smoothing filter), *without* a permutation: R
        permutes the received weights locally. The permutation is a function of R's own exact
        graph, so sending it would tell the peer something about R's model; permuting is
        post-processing either way. Charged like the features.

   *merged* (data level, central DP on the peer's training records):
     a. **merged** — ``ReleaseMerged``: an RS or LC merge of the peer's DP-SGD pool at R's
        target (merge_epsilon, merge_delta), charged to the peer's data-level budget.
     b. **align** — the merged model is a DP release, so R may compute its exact graph on the
        probe set (post-processing) and match it against its own exact graph.

   With ``auto`` (the default), R asks for a merge where the peer offers a pool of R's
   architecture and falls back to *ldp* only when the merge was refused *before anything was
   charged* — and only where the ldp weights release can carry signal at the round's (ε, δ)
   (``peer.ldp.mechanisms.signal``; else the peer is dropped, nothing charged, unless
   ``[round.weights] go_on_without_signal``). An explicit ``ldp`` round whose weights release
   is predicted constant is refused before anything is asked.

4. **fuse** — at R: θ = α·θ_R + Σ_j (1 − α)/k · P_j(θ_j) over the k peers that contributed
   (α-fusion generalised to k models: R keeps weight α, the others share 1 − α equally).
   If fewer than ``quorum`` sites (R included) contributed, the round aborts: no model is
   written, and what the peers released stays charged.
5. **after fusion** (optional, local, nothing charged) — ``coordinator_free.after_fusion``:
   candidate selection on public data, REPAIR on R's own records or probe set, fine-tuning
   on R's own records; each stage stored beside the plain fusion.

Failures. A peer that fails or times out is dropped at that step with a record (step, time,
gRPC status, message, and whether the failed call was charged: "yes" when its signed receipt
arrived — the receipt is the first frame after the peer's charge —, "no" when the peer refused
before charging or could not be reached, "unknown" when the connection broke before a receipt:
the peer charges before it sends, so it may have). A charged call is **never retried** (a
retry would be a second release, charged again); nothing else is retried either. Before each
charged request R checks that the quorum is still reachable and stops asking otherwise, so a
doomed round spends no more of anyone's budget. A named round that did not fuse is run again
under the same label without buying again what it was charged for
(``coordinator_free.round_journal``).

This module holds the pure parts (configuration, bookkeeping, weights, clipping to public
bounds); ``coordinator_free.runner`` does the I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.config import Section
from peer.base.errors import InvalidArgument
from peer.base.records import now_rfc3339
from peer.nn.graph import HiddenLayer, NetworkGraph

METHODS = ("ldp", "merged", "auto")
MERGE_METHODS = ("rs", "lc")
#: Steps of a round, in order (``align`` and ``fuse`` are local).
STEPS = ("health", "info", "merged", "features", "align", "weights", "fuse")
CHARGED_STEPS = ("merged", "features", "weights")
#: Statuses a peer answers with *before* charging (the service validates, checks its policy and
#: its budget, and only then charges and sends the receipt).
REFUSALS = (
    "RESOURCE_EXHAUSTED",
    "PERMISSION_DENIED",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
    "OUT_OF_RANGE",
    "ALREADY_EXISTS",
)


# ---------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RoundConfig:
    """What one round asks for (``[round]`` of site.toml or of a round file; see ``docs``).

    Every ε/δ is per unit of privacy: per neuron for features and weights (model level; the
    features may be asked per entry with ``[round.features] unit = "entry"``, a much weaker
    guarantee that the peer's ledger converts to its per-neuron cost), per training record for
    merges (data level, in the peer's data unit).
    """

    roster: Path
    model: str
    alpha: float = 0.5
    quorum: int = 2
    method: str = "auto"
    activation_epsilon: float = 1.0
    weight_epsilon: float = 1.0
    unit: str = "neuron"
    activation_clip: tuple[float, float] | None = None
    weight_bound: float | None = None
    weights_epsilon: float = 2.0
    weights_delta: float = 1e-5
    # ``[round.weights] go_on_without_signal``: run an ldp exchange whose weights release is
    # predicted constant (``peer.ldp.mechanisms.signal``) instead of refusing it before any request
    go_on_without_signal: bool = False
    merge_method: str = "rs"
    merge_epsilon: float = 2.0
    merge_delta: float = 1e-5
    health_timeout_s: float = 2.0
    call_timeout_s: float = 60.0
    out: Path = Path("rounds")
    label: str = ""
    # after fusion, all local (see coordinator_free.after_fusion): nothing here is charged
    records: Path | None = None
    records_prepared: bool = False
    repair: str = "off"
    # whether the round file set ``[round.repair] data``: a site's own network repairs on the
    # probe set unless told otherwise (``coordinator_free.runner._OwnNetwork``); not reported
    repair_set: bool = False
    select_validation: Path | None = None
    select_alphas: tuple[float, ...] = ()
    finetune_epochs: int = 0
    finetune_learning_rate: float = 1e-4
    finetune_batch_size: int = 64

    KEYS = (
        "roster",
        "model",
        "alpha",
        "quorum",
        "method",
        "out",
        "label",
        "health_timeout_s",
        "call_timeout_s",
        "features",
        "weights",
        "merge",
        "records",
        "repair",
        "select",
        "finetune",
    )

    @classmethod
    def from_section(cls, s: Section, base: Path, default_clip: tuple[float, float] | None = None) -> RoundConfig:
        """Parse a ``[round]`` table (paths relative to ``base``); errors name key and line."""
        s.known(cls.KEYS)
        f, w, m = s.section("features"), s.section("weights"), s.section("merge")
        f.known(["activation_epsilon", "weight_epsilon", "unit", "activation_clip", "weight_bound"])
        w.known(["epsilon", "delta", "go_on_without_signal"])
        m.known(["method", "epsilon", "delta"])
        positive = {"exclusive_minimum": 0.0, "maximum": 1000.0}
        delta = {"exclusive_minimum": 0.0, "maximum": 0.1}
        after = _after_fusion(s, base)
        return cls(
            **after,
            roster=s.path("roster", base),
            model=s.string("model"),
            alpha=s.number("alpha", 0.5, minimum=0.0, maximum=1.0),
            quorum=s.integer("quorum", 2, minimum=1),
            method=s.string("method", "auto", choices=METHODS),
            activation_epsilon=f.number("activation_epsilon", 1.0, **positive),
            weight_epsilon=f.number("weight_epsilon", 1.0, **positive),
            unit=f.string("unit", "neuron", choices=("neuron", "entry")),
            activation_clip=f.interval("activation_clip", default_clip),
            weight_bound=f.number("weight_bound", None, exclusive_minimum=0.0),
            weights_epsilon=w.number("epsilon", 2.0, **positive),
            weights_delta=w.number("delta", 1e-5, **delta),
            go_on_without_signal=w.boolean("go_on_without_signal", False),
            merge_method=m.string("method", "rs", choices=MERGE_METHODS),
            merge_epsilon=m.number("epsilon", 2.0, **positive),
            merge_delta=m.number("delta", 1e-5, **delta),
            health_timeout_s=s.number("health_timeout_s", 2.0, exclusive_minimum=0.0, maximum=600.0),
            call_timeout_s=s.number("call_timeout_s", 60.0, exclusive_minimum=0.0, maximum=86400.0),
            out=s.path("out", base, base / "rounds"),
            label=s.string("label", ""),
        )

    def public(self) -> dict:
        """The configuration as JSON-ready data (for reports)."""
        out = asdict(self)
        out["roster"], out["out"] = str(self.roster), str(self.out)
        for k in ("records", "select_validation"):
            out[k] = None if out[k] is None else str(out[k])
        del out["repair_set"]  # how the file said it, not what the round does
        return out


REPAIR_DATA = ("off", "own", "probe")


def _after_fusion(s: Section, base: Path) -> dict:
    """The local steps after fusion (``coordinator_free.after_fusion``), from ``[round.records]``,
    ``[round.repair]``, ``[round.select]`` and ``[round.finetune]``; errors name key and line.

    ``[round.records] path`` is the site's own labelled records (they never leave the site):
    raw records prepared with the model's stored preprocessing, or — ``prepared = true`` — an
    .npz of prepared arrays ``x``/``y``. ``[round.repair] data`` = "own" (REPAIR statistics on
    those records), "probe" (on the public probe set) or "off" (default; "probe" for a site's
    own network). ``[round.select] validation`` is a PUBLIC labelled .npz (``x``/``y``,
    prepared) on which candidate fusions (subsets of the contributions × ``alphas``) are
    compared; absent: every contribution is kept at ``alpha``. ``[round.finetune] epochs``
    (default 0: off), ``learning_rate``, ``batch_size``: local training of the fused model on
    the own records."""
    r, rep, sel, ft = s.section("records"), s.section("repair"), s.section("select"), s.section("finetune")
    r.known(["path", "prepared"])
    rep.known(["data"])
    sel.known(["validation", "alphas"])
    ft.known(["epochs", "learning_rate", "batch_size"])
    out = {
        "records": r.path("path", base, None),
        "records_prepared": r.boolean("prepared", False),
        "repair": rep.string("data", "off", choices=REPAIR_DATA),
        "repair_set": "data" in rep,
        "select_validation": sel.path("validation", base, None),
        "select_alphas": tuple(sel.numbers("alphas", [], minimum=0.0, maximum=1.0)),
        "finetune_epochs": ft.integer("epochs", 0, minimum=0, maximum=10_000),
        "finetune_learning_rate": ft.number("learning_rate", 1e-4, exclusive_minimum=0.0, maximum=10.0),
        "finetune_batch_size": ft.integer("batch_size", 64, minimum=1),
    }
    if out["records"] is None:
        if out["repair"] == "own":
            rep.fail("data", '"own" needs the site\'s own records: give [round.records] path')
        if out["finetune_epochs"] > 0:
            ft.fail("epochs", "fine-tuning needs the site's own records: give [round.records] path")
    if "alphas" in sel and out["select_validation"] is None:
        sel.fail("alphas", "candidate α values are compared on public data: give [round.select] validation")
    return out


# ---------------------------------------------------------------------------------- pure helpers


def fusion_weights(alpha: float, n_peers: int) -> list[float]:
    """[α, (1−α)/k, …, (1−α)/k]: the requester keeps α, k peers share 1 − α (k = 0 → [1])."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidArgument("alpha", f"must be in [0, 1], got {alpha!r}")
    if n_peers < 0:
        raise InvalidArgument("n_peers", f"must be >= 0, got {n_peers}")
    if n_peers == 0:
        return [1.0]
    return [alpha] + [(1.0 - alpha) / n_peers] * n_peers


def charged_status(status: str, receipt_seen: bool, connected: bool) -> str:
    """Whether a failed call was charged at the peer: "yes" | "no" | "unknown".

    The peer charges, then sends the signed receipt as the first frame, so a receipt proves a
    charge; a refusal status before it proves none (the service refuses before charging); a
    call that never connected cannot have been charged; anything else may have been.
    """
    if receipt_seen:
        return "yes"
    if status in REFUSALS or not connected:
        return "no"
    return "unknown"


def failure_reason(status: str, message: str, details: str, connected: bool, timeout_s: float) -> str:
    """Why a call failed, in words that say what happened to the connection (the peer's own
    message for refusals, which name the field or budget at fault)."""
    if status == "UNAVAILABLE":
        if not connected:
            return f"could not connect: the peer is down or unreachable ({details})"
        return f"the connection broke during the call: the peer died or the network was cut ({details})"
    if status == "DEADLINE_EXCEEDED":
        return f"no answer within {timeout_s:g}s: the peer is stuck or the network is cut ({details})"
    return message


def public_view(
    graph: NetworkGraph, activation_clip: tuple[float, float] | None, weight_boxes: Mapping[str, tuple[float, float]]
) -> NetworkGraph:
    """The requester's own graph clipped to the public bounds the peers' releases were clipped to
    (activations to ``activation_clip``, each layer's weights and biases to its box), so both
    sides of the matching describe the same quantities; the noisy values are unbiased estimates
    of the clipped ones. No noise: this graph never leaves the requester."""
    hidden = []
    for h in graph.hidden:
        act = h.activations if activation_clip is None else np.clip(h.activations, *activation_clip)
        lo, hi = weight_boxes[h.name]
        hidden.append(HiddenLayer(h.name, h.kind, act, np.clip(h.incoming, lo, hi), np.clip(h.bias, lo, hi)))
    out_name = next(n for n in weight_boxes if n not in {h.name for h in graph.hidden})
    lo, hi = weight_boxes[out_name]
    return NetworkGraph(
        graph.architecture,
        graph.input_size,
        tuple(hidden),
        np.clip(graph.output_incoming, lo, hi),
        np.clip(graph.output_bias, lo, hi),
    )


# ---------------------------------------------------------------------------------- bookkeeping


@dataclass
class Charge:
    """A release a peer charged for the requester in this round (from its signed receipt)."""

    peer: str
    step: str
    entry_id: str
    release_id: str
    mechanism: str
    level: str
    unit: str
    epsilon: float
    delta: float
    received_at: str
    receipt: str  # the signed receipt (JSON), checkable offline with the peer's certificate
    delivered: bool = False
    # the peer's "served again" ledger row when it served the identical bytes of an earlier
    # charge (``entry_id``, maybe another requester's) at no new charge; "" for a release made
    served_again: str = ""
    # the earlier attempt of this named round (its round id) whose release this is, reused
    # without asking the peer again (coordinator_free.round_journal); "" for one received now
    reused_from: str = ""


@dataclass
class Drop:
    """Why and when a peer left the round. ``details`` are the peer's structured refusal
    details when it sent them (``PeerError.structured()``: field violations; an ErrorInfo's
    reason and metadata, e.g. a budget's spent and remaining ε, a pool's reachable ε range)."""

    peer: str
    step: str
    at: str
    status: str
    reason: str
    charged: str  # of the failed call: "yes" | "no" | "unknown" | "n/a" (no call was made)
    details: dict | None = None


def details_line(details: Mapping[str, Any] | None) -> str:
    """A refusal's structured details in one line for people ('' when there are none)."""
    if not details:
        return ""
    parts = [f"field {v['field']!r}: {v['rule']}" for v in details.get("violations", ())]
    if details.get("reason"):
        facts = ", ".join(f"{k}={v}" for k, v in sorted((details.get("metadata") or {}).items()))
        parts.append(details["reason"] + (f" ({facts})" if facts else ""))
    return "; ".join(parts)


@dataclass
class PeerOutcome:
    name: str
    address: str
    alive: bool | None = None
    model: str | None = None
    pool: str | None = None
    method: str | None = None
    state: str = "pending"  # pending | contributed | dropped | not-alive | not-asked
    step: str | None = None
    charges: list[Charge] = field(default_factory=list)
    drop: Drop | None = None
    notes: list[str] = field(default_factory=list)
    match: dict | None = None


class RoundState:
    """The round's record, shared by the per-peer threads (one lock; events go to ``on_event``)."""

    def __init__(
        self,
        round_id: str,
        site: str,
        peers: Sequence[tuple[str, str]],
        quorum: int,
        on_event: Callable[[dict], None] | None = None,
        stop: threading.Event | None = None,
    ):
        self.round_id = round_id
        self.site = site
        self.quorum = quorum
        self.peers = {name: PeerOutcome(name, address) for name, address in peers}
        self.events: list[dict] = []
        self._on_event = on_event
        self._lock = threading.RLock()
        self.aborted: str | None = None
        self._stop = stop

    def interrupted(self) -> bool:
        """Whether the round was told to stop (SIGINT/SIGTERM): nothing more is requested."""
        return self._stop is not None and self._stop.is_set()

    def event(self, event: str, peer: str | None = None, step: str | None = None, **fields: Any) -> dict:
        e = {"at": now_rfc3339(), "round": self.round_id, "site": self.site, "event": event}
        if peer is not None:
            e["peer"] = peer
        if step is not None:
            e["step"] = step
        e.update(fields)
        # One event at a time to the listener too: peers are asked from several threads, and a
        # listener that writes lines (``privfusion round --events``) must never interleave two.
        # (the state's one re-entrant lock, so that no second lock can order against it)
        with self._lock:
            self.events.append(e)
            if self._on_event is not None:
                self._on_event(e)
        return e

    # ---- quorum --------------------------------------------------------------------------------

    def still_in(self) -> list[str]:
        """Peers not (yet) dropped: pending or contributed."""
        with self._lock:
            return [n for n, p in self.peers.items() if p.state in ("pending", "contributed")]

    def quorum_reachable(self) -> bool:
        return len(self.still_in()) + 1 >= self.quorum

    def begin(self, peer: str, step: str) -> bool:
        """Mark ``peer`` at ``step``; False (and the peer marked not-asked) when the round was
        interrupted or can no longer reach its quorum, so no further budget is spent on it."""
        with self._lock:
            p = self.peers[peer]
            if step in CHARGED_STEPS and self.interrupted():
                p.state = "not-asked"
                p.notes.append(f"{step} not requested: the round was interrupted")
                self.event("not-asked", peer, step, reason="interrupted")
                return False
            if step in CHARGED_STEPS and not self.quorum_reachable():
                p.state = "not-asked"
                p.notes.append(f"{step} not requested: the round can no longer reach its quorum of {self.quorum}")
                self.event("not-asked", peer, step, reason="quorum unreachable")
                return False
            p.step = step
        self.event("step", peer, step)
        return True

    def current_step(self, peer: str) -> str | None:
        with self._lock:
            return self.peers[peer].step

    # ---- outcomes ------------------------------------------------------------------------------

    def charged(self, peer: str, receipt, reused_from: str = "") -> Charge:
        """Record a verified receipt (called as it arrives, before any tensor byte; or, with
        ``reused_from``, the receipt of a release an earlier attempt of the round received)."""
        r = receipt.record
        with self._lock:
            c = Charge(
                peer,
                self.peers[peer].step or "?",
                receipt.ledger_entry_id,
                r.release_id,
                r.mechanism,
                r.level,
                r.unit,
                r.epsilon,
                r.delta,
                now_rfc3339(),
                receipt.to_json(),
                served_again=receipt.served_again,
                reused_from=reused_from,
            )
            self.peers[peer].charges.append(c)
        self.event(
            "reused" if reused_from else ("served-again" if c.served_again else "charged"),
            peer,
            c.step,
            **({"reused_from": reused_from} if reused_from else {}),
            entry_id=c.entry_id,
            mechanism=c.mechanism,
            level=c.level,
            unit=c.unit,
            epsilon=c.epsilon,
            delta=c.delta,
        )
        return c

    def delivered(self, peer: str, step: str) -> None:
        with self._lock:
            for c in self.peers[peer].charges:
                if c.step == step:
                    c.delivered = True
        self.event("received", peer, step)

    def receipt_seen(self, peer: str, step: str) -> bool:
        with self._lock:
            return any(c.step == step for c in self.peers[peer].charges)

    def set_alive(self, peer: str, alive: bool, reason: str = "") -> None:
        with self._lock:
            p = self.peers[peer]
            p.alive = alive
            if not alive:
                p.state = "not-alive"
                p.drop = Drop(peer, "health", now_rfc3339(), "UNAVAILABLE", reason, "n/a")
        self.event("alive" if alive else "not-alive", peer, "health", **({"reason": reason} if reason else {}))

    def drop(self, peer: str, step: str, status: str, reason: str, charged: str, details: dict | None = None) -> Drop:
        with self._lock:
            p = self.peers[peer]
            d = Drop(peer, step, now_rfc3339(), status, reason, charged, details or None)
            p.state, p.drop = "dropped", d
        self.event(
            "dropped",
            peer,
            step,
            status=status,
            reason=reason,
            charged=charged,
            **({"details": details} if details else {}),
        )
        return d

    def chose(self, peer: str, model: str | None, pool: str | None) -> None:
        """What the requester will ask ``peer`` for (from its GetPeerInfo answer)."""
        with self._lock:
            self.peers[peer].model, self.peers[peer].pool = model, pool

    def note(self, peer: str, text: str) -> None:
        with self._lock:
            self.peers[peer].notes.append(text)
        self.event("note", peer, self.current_step(peer), note=text)

    def contributed(self, peer: str, method: str, match: dict | None) -> None:
        with self._lock:
            p = self.peers[peer]
            p.state, p.method, p.match = "contributed", method, match
        self.event("contributed", peer, method=method)

    def contributors(self) -> list[str]:
        with self._lock:
            return [n for n, p in self.peers.items() if p.state == "contributed"]

    def charges(self) -> list[Charge]:
        with self._lock:
            return [c for p in self.peers.values() for c in p.charges]

    def release_counts(self) -> dict[str, int]:
        """Releases received this round: ``made`` (charged for this request) and ``served_again``
        (a data-level release the peer had made before, served again with no new charge)."""
        charges = self.charges()
        reused = sum(1 for c in charges if c.reused_from)
        again = sum(1 for c in charges if c.served_again and not c.reused_from)
        counts = {"made": len(charges) - again - reused, "served_again": again}
        if reused:  # a rerun of a named round: releases an earlier attempt received, not asked again
            counts["reused"] = reused
        return counts

    def may_have_charged(self) -> dict[str, str]:
        """Per peer: "yes" (a signed receipt arrived), "unknown" (a call broke off before its
        receipt, after the peer may have charged) or "no"."""
        with self._lock:
            out = {}
            for n, p in self.peers.items():
                if p.charges:
                    out[n] = "yes"
                elif p.drop is not None and p.drop.charged in ("yes", "unknown"):
                    out[n] = p.drop.charged
                else:
                    out[n] = "no"
            return out

    def peers_dict(self) -> dict:
        with self._lock:
            return {n: asdict(p) for n, p in self.peers.items()}
