"""How the release desk's releases are written for the wire (``peer.desk.desk.Transport``):
the features' tensor names (``peer.net.codec``) and the signed receipt over the release's
manifest (``peer.net.receipts``, ``docs/wire.md`` §6). No gRPC: the CLI signs with it too."""

from __future__ import annotations

from peer.desk.desk import Transport
from peer.desk.kinds import Issued
from peer.desk.make import GroupFeaturesRelease
from peer.net import wire
from peer.net.codec import features_tensors, group_features_tensors
from peer.net.receipts import SignedReceipt, sign_receipt


def tensors_of_features(made, probe_rows: int) -> tuple[list, dict]:
    """A features release as named tensors and public metadata: a site's own network per
    permutation group element, a built-in one as a graph (with its weights when asked for)."""
    if isinstance(made, GroupFeaturesRelease):
        return group_features_tensors(made, probe_rows)
    return features_tensors(made.graph, made.weights)


def wire_transport(site) -> Transport:
    """The transport of ``site``: receipts signed with the key the site uses now (a rotation
    takes effect at once, ``Site.refresh_identity``)."""

    def sign(issued: Issued, ledger_seq: int, ledger_head: bytes) -> SignedReceipt:
        manifest = wire.release_manifest(
            issued.kind, issued.subject, issued.architecture, issued.metadata, issued.tensors, issued.upstream
        )
        return sign_receipt(
            site.identity,
            issued.entry_id,
            issued.record,
            manifest,
            issued.served_again or "",
            issued.caller if issued.served_again else "",
            ledger_seq,
            ledger_head,
        )

    return Transport(tensors_of_features, sign)


__all__ = ["tensors_of_features", "wire_transport"]
