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

Steps 1 and 3 are the release desk's (``peer.desk.desk.ReleaseDesk``: the charge and its
cancel, like every charge of the site); 2 and 4 are here (:func:`partner_exchange`). The caller
of :func:`fuse_with_partner` (the service) has validated the request; it streams the result
under the charge made in step 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.desk.desk import ReleaseDesk
from peer.desk.kinds import IssuedFusion
from peer.desk.requests import FuseRequest
from peer.ldp.pipeline import align_and_fuse
from peer.net.codec import graph_from_release, weights_from_release
from peer.net.site import Site
from peer.net.wire import Release
from peer.nn.architectures import validate_architecture
from peer.nn.graph import NetworkGraph
from peer.nn.store import StoredModel


def partner_exchange(client, stored: StoredModel, probe: np.ndarray, request: FuseRequest):
    """Steps 2 and 4 for the desk (``ReleaseDesk`` runs them after our charge and cancels it when
    they fail): ``exchange(own)`` asks the partner (one release call, on behalf of the caller) and
    fuses our noisy contribution ``own`` with its release; → (fused arrays, matching objective,
    the partner's signed receipt)."""
    partner, partner_model = request.partner, request.partner_model

    def exchange(own):
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
                activation_epsilon=request.activation_epsilon,
                weight_epsilon=request.weight_epsilon,
                activation_clip=request.activation_clip,
                weights_epsilon=request.weights_epsilon,
                weights_delta=request.weights_delta,
                on_behalf_of=request.caller,
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
            stored.architecture, own.graph, own.weights, their_graph, their_weights, request.alpha
        )
        return fused, alignment.objective, theirs.receipt

    return exchange


def fuse_with_partner(desk: ReleaseDesk, site: Site, request: FuseRequest) -> IssuedFusion:
    """Steps 1–4 of the module doc through the desk: a client of the partner (an unknown or
    unpinned partner is refused before anything is computed or charged), then
    ``desk.issue(request)`` with the exchange of :func:`partner_exchange`; the client is closed
    before the fused model is streamed."""
    stored = site.model(request.model, "model")
    client = site.client_for(request.partner)
    try:
        exchange = partner_exchange(client, stored, request.probe, request)
        return desk.issue(dataclasses.replace(request, exchange=exchange))
    finally:
        client.close()


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
