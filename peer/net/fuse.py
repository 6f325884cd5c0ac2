"""The relay Fuse: this site fuses its model with a partner's, for a caller (``Peer/Fuse``).

Three sites: the caller C, this site B (the owner of ``stored`` and of a public probe set) and
the partner X. What each learns is post-processing of noisy releases:

1. B computes its own contribution — noisy features of its model on its probe set and
   PFA-perturbed weights, from one randomness stream — and charges it to C as one sequential
   composite (kind "fuse": per-request cap, budgets) BEFORE anything is asked of X;
2. B asks X's GetPeerInfo (uncharged) whether X offers the model with B's architecture — a
   model B cannot fuse (another architecture, a site's own network) is refused here, before X
   releases and charges anything — then makes ONE release call to X: features + unpermuted
   weights of X's model on B's probe set, on behalf of C (X checks its policy for both and
   charges both B and C);
3. if that call fails, or X's release fails B's checks, or matching/fusing fails, or C has
   gone, B CANCELS its charge (no byte of its contribution went anywhere) and fails;
4. B matches its *noisy* graph with X's, permutes X's weights here (the match never leaves
   B) and fuses: W = α·W_B + (1 − α)·P(W_X) (``peer.ldp.pipeline.align_and_fuse``).

The caller of :func:`fuse_with_partner` (the service) has validated the request and checked the
policy; it streams the result under the charge made in step 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord
from peer.ldp.pipeline import align_and_fuse
from peer.net.codec import graph_from_release, weights_from_release
from peer.net.receipts import SignedReceipt
from peer.net.site import Site, log_event, stamp
from peer.net.wire import Release
from peer.nn.architectures import validate_architecture
from peer.nn.graph import NetworkGraph
from peer.nn.store import StoredModel


@dataclass(frozen=True)
class Fused:
    """A fused model ready to stream: our contribution's record (stamped) and the ledger entry
    it was charged as, the fused arrays, the matching objective (public: computed from noisy
    releases only) and the partner's signed receipt for its release."""

    record: ReleaseRecord
    entry_id: str
    arrays: dict[str, np.ndarray]
    objective: float
    upstream: SignedReceipt


def fuse_with_partner(
    site: Site,
    caller: str,
    stored: StoredModel,
    probe: np.ndarray,
    *,
    partner: str,
    partner_model: str,
    alpha: float,
    activation_epsilon: float,
    weight_epsilon: float,
    weights_epsilon: float,
    weights_delta: float,
    admit: Callable[[], None],
    caller_active: Callable[[], bool],
) -> Fused:
    """Steps 1–4 of the module doc, for ``caller``, with ``stored`` (this site's model) and
    ``probe`` (its public probe set, checked against the model's input).

    ``admit()`` is called once our contribution is computed, just before it is charged: it
    raises to refuse (e.g. the daemon is shutting down; nothing is charged then).
    ``caller_active()`` is asked once the partner has answered and the model is fused: False
    cancels our charge (nothing of ours was sent). An unknown or unpinned partner is refused
    before anything is computed or charged.
    """
    clip = site.activation_clip()
    client = site.client_for(partner)
    try:
        # 1. our own contribution, charged before anything is asked of the partner. We match on
        # our *noisy* features too: everything the caller receives is then post-processing of
        # noisy releases (ours charged here, the partner's charged by the partner).
        own = site.features(
            stored,
            probe,
            activation_epsilon=activation_epsilon,
            weight_epsilon=weight_epsilon,
            activation_clip=clip,
            weights=(weights_epsilon, weights_delta),
            release="fusion",
        )
        record = stamp(own.record, caller, stored.name, alpha=alpha, partner=partner, partner_model=partner_model)
        admit()
        entry_id = site.charge(record, caller, "fuse")
        log_event(
            "charged-before-partner",
            method="Fuse",
            caller=caller,
            entry=entry_id,
            release=record.release_id,
            epsilon=record.epsilon,
            delta=record.delta,
            model=stored.name,
            partner=partner,
        )
        try:
            # 2. the partner's model must be of our architecture: asked (GetPeerInfo, uncharged)
            # before the release is, so that a model this site cannot fuse (a site's own network,
            # say) is not released and charged at the partner first; the release is checked
            # again when it arrives
            _check_partner_offer(client, stored, partner, partner_model)
            # the one release asked: what leaves is our public probe set and public parameters
            try:
                theirs = client.features(
                    partner_model,
                    probe,
                    activation_epsilon=activation_epsilon,
                    weight_epsilon=weight_epsilon,
                    activation_clip=clip,
                    weights_epsilon=weights_epsilon,
                    weights_delta=weights_delta,
                    on_behalf_of=caller,
                )
            except InvalidArgument as e:  # its receipt, checksums or record failed our checks
                raise FailedPrecondition(
                    f"partner {partner!r}'s release failed this site's checks: {e}",
                    reason="PARTNER_RELEASE_INVALID",
                    metadata={"partner": partner},
                ) from None
            their_graph, their_weights = _partner_release(stored, partner, partner_model, theirs)
            # 4. (before anything is sent) match, permute their weights here, fuse
            fused, alignment = align_and_fuse(
                stored.architecture, own.graph, own.weights, their_graph, their_weights, alpha
            )
            if not caller_active():  # the caller left while we waited: nothing of ours was sent
                raise FailedPrecondition(
                    "the caller cancelled the Fuse before anything was sent", reason="CALLER_CANCELLED"
                )
        except BaseException as e:
            # 3. nothing of ours left: withdraw the charge, say why
            reason = f"Fuse with partner {partner!r} failed before any byte was sent ({type(e).__name__})"
            try:
                site.cancel(record, reason)
                log_event(
                    "cancelled",
                    method="Fuse",
                    caller=caller,
                    entry=entry_id,
                    release=record.release_id,
                    partner=partner,
                    error_type=type(e).__name__,
                )
            except Exception as c:
                log_event("cancel-failed", method="Fuse", entry=entry_id, error_type=type(c).__name__)
            raise
    finally:
        client.close()
    return Fused(record, entry_id, fused, alignment.objective, theirs.receipt)


def _check_partner_offer(client, stored: StoredModel, partner: str, partner_model: str) -> None:
    """FailedPrecondition unless the partner lists ``partner_model`` (GetPeerInfo, uncharged)
    with exactly ``stored``'s architecture: a partner model of another architecture (a site's
    own network, say, which the relay cannot fuse) would otherwise be released and charged at
    the partner before this site could refuse it."""
    info = client.info()
    offered = {m.name: m.architecture for m in info.models}
    if partner_model not in offered:
        raise FailedPrecondition(
            f"partner_model: {partner} offers no model {partner_model!r}; it offers {sorted(offered)}",
            reason="PARTNER_LACKS_MODEL",
            metadata={"partner": partner, "partner_model": partner_model},
        )
    try:
        theirs = validate_architecture(offered[partner_model])  # None (not a JSON object) is refused too
    except (ValueError, InvalidArgument):
        theirs = None
    if theirs != stored.architecture:
        raise FailedPrecondition(
            f"partner_model: {partner}'s {partner_model!r} has another architecture than {stored.name!r}; "
            "nothing was charged",
            reason="PARTNER_ARCHITECTURE_MISMATCH",
            metadata={"partner": partner, "partner_model": partner_model},
        )


def _partner_release(
    stored: StoredModel, partner: str, partner_model: str, theirs: Release
) -> tuple[NetworkGraph, dict[str, np.ndarray]]:
    """The partner's noisy graph and weights, checked; a release that fails the checks is the
    partner's failure (FAILED_PRECONDITION), not the caller's."""
    try:
        if theirs.architecture is None or validate_architecture(theirs.architecture) != stored.architecture:
            raise FailedPrecondition(
                f"partner_model: {partner}'s {partner_model!r} has another architecture than {stored.name!r}",
                reason="PARTNER_ARCHITECTURE_MISMATCH",
                metadata={"partner": partner, "partner_model": partner_model},
            )
        return (
            graph_from_release(theirs.architecture, theirs.metadata, theirs.arrays),
            weights_from_release(stored.architecture, theirs.arrays),
        )
    except InvalidArgument as e:
        raise FailedPrecondition(
            f"partner {partner!r}'s release failed this site's checks: {e}",
            reason="PARTNER_RELEASE_INVALID",
            metadata={"partner": partner},
        ) from None
