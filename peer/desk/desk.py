"""The release desk: the one path every release of a site takes, and the only caller of
``Ledger.charge``.

    policy → make → record → charge (or serve again, or cancel) → sign → (the transport streams)

* **policy**: the site's policy must let the caller — and, for a relayed release, the site it
  is finally for — ask for every kind the request is (``Policy.allows``; PermissionDenied, nothing
  computed). The transport may ask it early (:meth:`ReleaseDesk.policy`: before a probe set is
  uploaded); :meth:`ReleaseDesk.issue` asks it again, so no path skips it.
* **make**: the core's mechanism or merge with the site's public defaults (``peer.desk.make``),
  noise from a fresh CSPRNG stream.
* **record**: the mechanism's release record, stamped with the counterparty, the subject and the
  request's public parameters; it is what the ledger charges and the receipt signs.
* **charge**: ``Ledger.charge`` (atomic check-and-charge, the per-request caps in the budget's
  unit; BudgetExhausted → nothing leaves) *before* any byte can leave. A data-level release asked
  for again is *served again* instead (``Ledger.serve_again``: identical bytes, no charge). The one
  withdrawal is a *cancel* (``Ledger.cancel``), for the relay Fuse's contribution, charged before
  the partner is asked and cancelled when the exchange fails before anything was sent. A charge is
  never refunded once bytes may have left.
* **sign**: the receipt over the record, the ledger entry, the ledger's chain position and the
  manifest (the transport's signer: ``peer.net.signing``).

The transport then streams receipt → manifest → tensors → end and tells the desk how it ended
(:meth:`ReleaseDesk.finish`: a "sent" or "send-failed" ledger event; the charge stands either way).

The desk holds no state of its own: the site (``peer.net.site.Site``, anything with its
attributes) holds the ledger, the policy, the models, pools, the release store and the
randomness. It imports no gRPC and no protobuf: what the wire needs (the features' tensor names,
the receipt's manifest) comes in as a :class:`Transport`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound
from peer.base.records import ReleaseRecord
from peer.desk import make
from peer.desk.events import log_event
from peer.desk.kinds import (
    Issued,
    IssuedFeatures,
    IssuedFusion,
    IssuedMerge,
    IssuedSecureShare,
    IssuedSegment,
    IssuedWeights,
)
from peer.desk.requests import (
    FeaturesRequest,
    FuseRequest,
    MergeRequest,
    Request,
    SecureShareRequest,
    SegmentRequest,
    WeightsRequest,
)
from peer.desk.store import (
    SEGMENT_AUDIENCE,
    StoredRelease,
    check_run_name,
    digest,
    pool_fingerprint,
    release_key,
    release_sha256,
    segment_key,
    segment_rounds,
)

log = logging.getLogger("privfusion.peer")


def _charge(ledger, record: ReleaseRecord, counterparty: str, kind=None, also: tuple[str, ...] = ()) -> str:
    """The one call of ``Ledger.charge`` in the code base (``tests/test_layout.py`` checks it)."""
    return str(ledger.charge(record, counterparty, kind=kind, also_counterparties=also).entry_id)


class Gate:
    """Admission of releases (the daemon's graceful shutdown): ``admit`` raises to refuse a
    release before it is charged or served, ``leave`` ends one admitted. This one admits all."""

    def admit(self, what: str) -> None:
        return None

    def leave(self) -> None:
        return None


@dataclass(frozen=True)
class Transport:
    """What the desk needs of the wire, supplied by the shell (``peer.net.signing``):
    ``features_tensors(made, probe_rows)`` → (named tensors, public metadata) of a features
    release; ``sign(issued, ledger_seq, ledger_head)`` → its signed receipt."""

    features_tensors: Callable[[Any, int], tuple[list, dict]]
    sign: Callable[[Issued, int, bytes], Any]


class ReleaseDesk:
    """The release path of one site (see the module docstring)."""

    def __init__(self, site, transport: Transport | None = None, gate: Gate | None = None):
        self.site = site
        self.transport = transport
        self.gate = gate or Gate()

    # ---- policy ---------------------------------------------------------------------------

    def policy(self, request: Request) -> None:
        """PermissionDenied unless the policy lets the caller (and the site it relays for) ask
        for every kind of ``request``; checked before any work. A secure-sum share goes to
        every peer of its attempt: each of them must be allowed."""
        askers = request.peers if isinstance(request, SecureShareRequest) else (request.caller, request.on_behalf_of)
        for who in askers:
            if who is not None:
                for kind in request.kinds:
                    self.site.policy_allows(who, kind)

    # ---- the path ---------------------------------------------------------------------------

    def issue(self, request: Request) -> Issued:
        """Policy → make → record → charge (or serve again, or cancel) → sign: the release the
        transport streams, then reports on with :meth:`finish`. Every refusal before the charge
        leaves nothing charged; one after it (signing) keeps the charge, recorded as not sent."""
        self.policy(request)
        if isinstance(request, FeaturesRequest):
            return self._after_charge(self._features(request))
        if isinstance(request, WeightsRequest):
            return self._after_charge(self._weights(request))
        if isinstance(request, FuseRequest):
            return self._after_charge(self._fused(request))
        if isinstance(request, MergeRequest):
            self.gate.admit("nothing was charged")
            return self._after_charge(self._admitted(self.merged, request))
        if isinstance(request, SegmentRequest):
            self.gate.admit("nothing was served")
            return self._after_charge(self._admitted(self.segment, request))
        if isinstance(request, SecureShareRequest):
            return self._after_charge(self._secure_share(request))
        raise InvalidArgument("request", f"is not a release request: {type(request).__name__}")

    def _admitted(self, step: Callable[[Request], Issued], request: Request) -> Issued:
        try:
            return step(request)
        except BaseException:
            self.gate.leave()
            raise

    def _charged(self, record: ReleaseRecord, request: Request, kind) -> str:
        """Admit (the gate may refuse: nothing charged), then charge ``record`` to the caller and
        the site it relays for; the entry id. A refused charge leaves the gate again."""
        self.gate.admit("nothing was charged")
        try:
            also = (request.on_behalf_of,) if request.on_behalf_of else ()
            return _charge(self.site.ledger, record, request.caller, kind, also)
        except BaseException:
            self.gate.leave()
            raise

    def _after_charge(self, issued: Issued) -> Issued:
        """Log the charge (or serving again) and sign; a failure here keeps the charge and
        records the release as not sent."""
        record = issued.record
        try:
            log_event(
                "served-again" if issued.served_again else "charged",
                method=_METHODS[issued.kind],
                caller=issued.caller,
                entry=issued.entry_id,
                release=record.release_id,
                mechanism=record.mechanism,
                privacy_level=record.level,
                unit=record.unit,
                epsilon=record.epsilon,
                delta=record.delta,
                model=issued.subject,
            )
            return self.sign(issued)
        except BaseException:
            self.finish(issued, sent=False)
            raise

    def sign(self, issued: Issued) -> Issued:
        """``issued`` with its receipt: the ledger's position right after its charge (or its
        serving again) travels, signed, with the bytes (``docs/wire.md`` 6.3)."""
        if self.transport is None:
            return issued
        seq, head = self.site.ledger.chain_position(issued.entry_id, issued.served_again)
        return dataclasses.replace(issued, receipt=self.transport.sign(issued, seq, bytes.fromhex(head)))

    def finish(self, issued: Issued, sent: bool, started: float | None = None) -> None:
        """The transport's report: every byte went (a "sent" event) or the stream ended before
        its end frame (the client went away, the server is stopping: "send-failed"; the charge
        stands, bytes may have left). Ends the release's admission."""
        method, record = _METHODS[issued.kind], issued.record
        try:
            if sent:
                detail = f"served again ({issued.served_again}) to {issued.caller}" if issued.served_again else ""
                self.site.ledger.record_event(record.release_id, "sent", detail)
                log_event(
                    "released",
                    method=method,
                    caller=issued.caller,
                    entry=issued.entry_id,
                    release=record.release_id,
                    bytes=sum(a.nbytes for _, a in issued.tensors),
                    seconds=round(time.perf_counter() - started, 3) if started is not None else 0.0,
                )
            else:
                log_event(
                    "aborted-after-charge",
                    method=method,
                    caller=issued.caller,
                    entry=issued.entry_id,
                    release=record.release_id,
                )
                try:
                    self.site.ledger.record_event(record.release_id, "send-failed", "stream ended before ReleaseEnd")
                except Exception as e:
                    log_event("event-not-recorded", entry=issued.entry_id, error_type=type(e).__name__)
        finally:
            self.gate.leave()

    # ---- make → record → charge, per kind ---------------------------------------------------

    def _features(self, req: FeaturesRequest) -> IssuedFeatures:
        if req.probe is None:
            raise InvalidArgument("probe", "is required")
        site = self.site
        stored = site.model(req.model, "model", own=True)
        made = make.features(
            site,
            stored,
            req.probe,
            activation_epsilon=req.activation_epsilon,
            weight_epsilon=req.weight_epsilon,
            activation_clip=req.activation_clip,
            weight_bounds=req.weight_bounds,
            unit=req.unit,
            weights=req.weights,
        )
        rows = int(req.probe.shape[0])
        tensors, meta = self.transport.features_tensors(made, rows)
        relayed = {"on_behalf_of": req.on_behalf_of} if req.on_behalf_of else {}
        record = make.stamp(made.record, req.caller, req.model, probe_rows=rows, **relayed)
        entry_id = self._charged(record, req, req.kinds if req.weights is not None else "features")
        return IssuedFeatures(
            req.release_kind, req.model, req.caller, record, site.architecture_of(stored), meta, tensors, entry_id
        )

    def _weights(self, req: WeightsRequest) -> IssuedWeights:
        site = self.site
        stored = site.model(req.model, "model", own=True)
        arrays, record = make.weights(site, stored, req.epsilon, req.delta, req.caller, on_behalf_of=req.on_behalf_of)
        tensors = [(k, arrays.pop(k)) for k in sorted(arrays)]
        entry_id = self._charged(record, req, "weights")
        # docs/wire.md §5.2: weights always leave unpermuted
        return IssuedWeights(
            "weights",
            req.model,
            req.caller,
            record,
            site.architecture_of(stored),
            {"permuted": False},
            tensors,
            entry_id,
        )

    def _fused(self, req: FuseRequest) -> IssuedFusion:
        """The relay Fuse (``peer.net.fuse``): our contribution — noisy features of our model on
        our probe set and its PFA weights, from one randomness stream, matched on as noisy too —
        is made and charged to the caller (kind "fuse") BEFORE ``req.exchange`` asks the partner
        anything; when the exchange, the matching or the fusion fails, or the caller has gone,
        the charge is cancelled (no byte of ours went anywhere) and the error raised."""
        site = self.site
        stored = site.model(req.model, "model")
        own = make.features(
            site,
            stored,
            req.probe,
            activation_epsilon=req.activation_epsilon,
            weight_epsilon=req.weight_epsilon,
            activation_clip=req.activation_clip,
            weights=(req.weights_epsilon, req.weights_delta),
            release="fusion",
        )
        record = make.stamp(
            own.record, req.caller, stored.name, alpha=req.alpha, partner=req.partner, partner_model=req.partner_model
        )
        entry_id = self._charged(record, req, "fuse")
        try:
            log_event(
                "charged-before-partner",
                method="Fuse",
                caller=req.caller,
                entry=entry_id,
                release=record.release_id,
                epsilon=record.epsilon,
                delta=record.delta,
                model=stored.name,
                partner=req.partner,
            )
            try:
                arrays, objective, upstream = req.exchange(own)
                if not req.caller_active():  # the caller left while we waited: nothing of ours was sent
                    raise FailedPrecondition(
                        "the caller cancelled the Fuse before anything was sent", reason="CALLER_CANCELLED"
                    )
            except BaseException as e:
                self._cancel(record, entry_id, req, e)
                raise
            tensors = [(k, arrays.pop(k)) for k in sorted(arrays)]
            metadata = {
                "alpha": req.alpha,
                "partner": req.partner,
                "partner_model": req.partner_model,
                "upstream": [upstream.ledger_entry_id],
                "match_objective": objective,
            }
        except BaseException:
            self.gate.leave()
            raise
        return IssuedFusion(
            "fused",
            req.model,
            req.caller,
            record,
            stored.architecture,
            metadata,
            tensors,
            entry_id,
            upstream=(upstream,),
            objective=objective,
        )

    def _secure_share(self, req: SecureShareRequest) -> IssuedSecureShare:
        """A masked share of one secure-sum step, charged once (counterparty "*", every peer
        of the attempt) before its bytes may leave. The record must be a distributed-Skellam
        step of this run, step and attempt naming exactly ``req.peers``; BudgetExhausted (the
        step would overspend the data budget) leaves nothing charged and nothing sent — the
        caller must not send the vector."""
        record = req.record
        if not isinstance(record, ReleaseRecord) or record.mechanism != "distributed-skellam":
            raise InvalidArgument("record", "a secure-sum share is charged as a 'distributed-skellam' record")
        params = record.parameters
        want = {"run": req.run, "step": req.step, "attempt": req.attempt, "peers": tuple(sorted(req.peers))}
        for name, value in want.items():
            if params.get(name) != value:
                raise InvalidArgument(
                    f"record.parameters.{name}", f"must be {value!r} (the request's), got {params.get(name)!r}"
                )
        if params.get("sites") != len(req.peers) + 1:
            raise InvalidArgument(
                "record.parameters.sites", f"must be the {len(req.peers) + 1} sites of the attempt (us and the peers)"
            )
        masked = req.masked
        if getattr(masked, "ndim", None) != 1 or str(getattr(masked, "dtype", "")) != "uint64":
            raise InvalidArgument("masked", "must be a 1-D uint64 vector of residues")
        self.site.check_randomness(record, f"a secure-sum share of run {req.run!r} step {req.step}")
        entry_id = self._charged(record, req, None)
        metadata = {"run": req.run, "step": req.step, "attempt": req.attempt, "peers": list(want["peers"])}
        # residues travel as the same 8 bytes read as int64 (the wire's dtypes: docs/wire.md)
        tensors = [("masked", masked.view(np.int64))]
        return IssuedSecureShare(req.release_kind, req.run, req.caller, record, None, metadata, tensors, entry_id)

    def secure_share_charged(self, release_id: str, run: str, step: int, attempt: int, peers) -> str:
        """The ledger entry id of the standing charge ``release_id`` of a secure-sum share of
        exactly (``run``, ``step``, ``attempt``) to ``peers``; FailedPrecondition
        (SECAGG_NOT_CHARGED) otherwise. What the daemon asks before it serves a masked vector
        its own run published: the bytes leave only after their charge."""
        charge = self.site.ledger.charge_of(release_id)
        if charge is None or charge[1]:
            raise FailedPrecondition(
                f"secure-sum share {release_id!r}: no standing charge in this site's ledger; it is not served",
                reason="SECAGG_NOT_CHARGED",
            )
        entry, _ = charge
        record = entry.record
        params = record.parameters
        want = {"run": run, "step": step, "attempt": attempt, "peers": tuple(sorted(peers))}
        if record.mechanism != "distributed-skellam" or any(params.get(k) != v for k, v in want.items()):
            raise FailedPrecondition(
                f"secure-sum share {release_id!r}: the charge is of another release, not run {run!r} step "
                f"{step} attempt {attempt} to {list(want['peers'])}; it is not served",
                reason="SECAGG_NOT_CHARGED",
            )
        return str(entry.entry_id)

    def _cancel(self, record: ReleaseRecord, entry_id: str, req: FuseRequest, error: BaseException) -> None:
        """Withdraw the charge of a Fuse contribution none of whose bytes went anywhere."""
        reason = f"Fuse with partner {req.partner!r} failed before any byte was sent ({type(error).__name__})"
        try:
            self.site.ledger.cancel(record.release_id, reason)
            log_event(
                "cancelled",
                method="Fuse",
                caller=req.caller,
                entry=entry_id,
                release=record.release_id,
                partner=req.partner,
                error_type=type(error).__name__,
            )
        except Exception as c:
            log_event("cancel-failed", method="Fuse", entry=entry_id, error_type=type(c).__name__)

    def merged(self, req: MergeRequest) -> IssuedMerge:
        """The merge of ``req.pool`` at (ε, δ) for the caller, charged once however often it is
        asked for (unsigned; :meth:`issue` signs it).

        A merge is a DP output of the pool's training records (data level), so the identical
        bytes may be served again at no cost (post-processing). With one lock per request key:
        an entry of the release store (``peer.desk.store``) whose charge stands in the ledger
        is served again — ``Ledger.serve_again`` records it, naming the original charge, and no
        budget changes; otherwise a new merge is made, its record binds its bytes
        (``parameters.release_sha256``), it is stored atomically, *then* charged to the caller.
        A stored entry whose charge is missing (a crash between store and charge: its bytes never
        left) or cancelled is discarded and replaced; a tampered one is refused
        (FailedPrecondition), never served. BudgetExhausted from the charge leaves the new entry
        uncharged (discarded by the next request)."""
        site, pool, method, caller = self.site, req.pool, req.merge_method, req.caller
        members = site.pool(pool)
        prints = site.__dict__.setdefault("_pool_fingerprints", {})
        if pool not in prints:  # pools are fixed while the daemon runs
            prints[pool] = pool_fingerprint(members)
        key = release_key(pool, method, req.epsilon, req.delta, prints[pool])
        with site.releases.lock(key):
            stored = site.releases.get(key)
            if stored is not None:
                again = self.serve_again(
                    stored, caller, f"entry {key}", f"ReleaseMerged {pool} {method} to {caller}", IssuedMerge, pool=pool
                )
                if again is not None:
                    return again
                site.releases.remove(key)  # never left the site (no charge) or withdrawn: make anew
            made = make.merge(site, pool, method, req.epsilon, req.delta, caller)
            site.check_randomness(made.record, f"a merge of pool {pool!r}")  # before it is stored or charged
            tensors = [(k, made.arrays.pop(k)) for k in sorted(made.arrays)]
            sha = release_sha256([(n, digest(a)) for n, a in tensors])
            record = made.record.with_(parameters={**made.record.parameters, "release_sha256": sha})
            # public: the method, π or λ, the ε each accountant reports, the selection and its utility
            metadata = {"choice": made.choice.to_dict()}
            parameters = {"pool": pool, "method": method, "epsilon": req.epsilon, "delta": req.delta}
            site.releases.put(key, parameters, StoredRelease(key, record, made.architecture, metadata, tensors))
            entry_id = _charge(site.ledger, record, caller, "merge")
            return IssuedMerge("merged", pool, caller, record, made.architecture, metadata, tensors, entry_id)

    def segment(self, req: SegmentRequest) -> IssuedSegment:
        """This site's newest published segment of ``req.run`` with min_round ≤ round ≤
        max_round (None: no upper limit), served again to the caller (no charge:
        :func:`publish_segment` charged it once when the run published it). Never trains and
        never charges.

        Only an entry whose charge stands in the ledger (not cancelled, same record byte for
        byte) is served; one without (its publisher died between store and charge, or was
        refused by the budget) is skipped. NotFound when no segment qualifies yet."""
        site, run = self.site, req.run
        check_run_name(run)
        for number, key in segment_rounds(site.releases, run):
            if req.max_round is not None and number > req.max_round:
                continue
            if number < req.min_round:
                break
            stored = site.releases.get(key)
            if stored is None:
                continue
            again = self.serve_again(
                stored,
                req.caller,
                f"segment {run!r} round {number}",
                f"ReleaseSegment {run} round {number} to {req.caller}",
                IssuedSegment,
                run=run,
                round=number,
            )
            if again is not None:
                return again
        upto = "" if req.max_round is None else f" and ≤ {req.max_round}"
        raise NotFound(
            f"segment: {site.name!r} has published no segment of run {run!r} at round ≥ {req.min_round}{upto} yet",
            reason="SEGMENT_NOT_PUBLISHED",
        )

    def serve_again(self, stored: StoredRelease, caller: str, what: str, detail: str, kind=IssuedMerge, **log_fields):
        """``stored`` served again to ``caller`` at no charge (``Ledger.serve_again`` records it,
        naming the original charge), or None when its charge is missing or cancelled (its bytes
        never left, or must not: the caller makes anew or skips it). A stored record that differs
        from the charged one is refused (FailedPrecondition), never served."""
        site = self.site
        charge = site.ledger.charge_of(stored.record.release_id)
        if charge is None or charge[1]:
            return None
        entry, _ = charge
        if entry.record.canonical_json() != stored.record.canonical_json():
            raise FailedPrecondition(
                f"release store: the record of {what} differs from the one ledger entry {entry.entry_id} "
                "charged; it is not served",
                reason="STORED_RELEASE_MISMATCH",
            )
        site.check_randomness(stored.record, what)
        served = site.ledger.serve_again(stored.record.release_id, caller, detail)
        log_event(
            "served-again",
            caller=caller,
            entry=entry.entry_id,
            served_again=served["id"],
            release=stored.record.release_id,
            **log_fields,
        )
        return kind(
            "segment" if kind is IssuedSegment else "merged",
            str(log_fields.get("run", log_fields.get("pool", ""))),
            caller,
            stored.record,
            stored.architecture,
            stored.metadata,
            stored.tensors,
            str(entry.entry_id),
            str(served["id"]),
        )


#: The RPC each kind of release is asked by (log lines name it).
_METHODS = {
    "features": "ReleaseFeatures",
    "features+weights": "ReleaseFeatures",
    "weights": "ReleaseWeights",
    "fused": "Fuse",
    "merged": "ReleaseMerged",
    "segment": "ReleaseSegment",
    "secure-share": "SecureShare",
}


def publish_segment(store, ledger, run: str, round_number: int, release: StoredRelease) -> str:
    """Store a segment of a multi-round run, then charge it ONCE to ``ledger`` (counterparty
    :data:`SEGMENT_AUDIENCE`); the ledger entry id. Before the charge returns nothing can be
    served (:meth:`ReleaseDesk.segment` serves an entry only when its charge stands), so the
    charge precedes every byte that leaves.

    ``release.record`` must bind the tensors (``parameters.release_sha256``). BudgetExhausted
    from the charge (or any refusal) leaves the entry uncharged — never served — and it is
    removed here."""
    key = segment_key(run, round_number)
    if release.key != key:
        raise InvalidArgument("release.key", f"a segment of {run!r} round {round_number} is stored under {key}")
    with store.lock(key):
        store.put(key, {"kind": "segment", "run": run, "round": int(round_number)}, release)
        try:
            return _charge(ledger, release.record, SEGMENT_AUDIENCE)
        except Exception:
            store.remove(key)  # uncharged: never served; a charge that did commit stands (conservative)
            raise


__all__ = ["Gate", "ReleaseDesk", "Transport", "publish_segment"]
