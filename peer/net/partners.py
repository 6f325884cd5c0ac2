"""Clients of the partner sites a site dials itself (the relay Fuse), whose failures are the
partner's, not the caller's. Mixed into ``peer.net.site.Site`` (``config``, ``name``,
``identity``, ``insecure``, ``trust`` and ``pinned()`` are the site's)."""

from __future__ import annotations

from peer.base.errors import FailedPrecondition
from peer.net.client import PeerClient, PeerError


class SitePartners:
    """A site's clients of its partners (see the module docstring)."""

    def client_for(self, partner: str) -> PartnerClient:
        """A client of a pinned partner this site knows the address of (site.toml [site.peers])."""
        address = self.config.peers.get(partner)
        if address is None:
            raise FailedPrecondition(
                f"partner: {self.name!r} does not know where {partner!r} listens (site.toml [site.peers.{partner}])",
                reason="PARTNER_UNKNOWN",
                metadata={"partner": partner},
            )
        if partner not in self.pinned():
            raise FailedPrecondition(
                f"partner: {partner!r} is not pinned at {self.name!r}",
                reason="PARTNER_NOT_PINNED",
                metadata={"partner": partner},
            )
        return PartnerClient(PeerClient(self.identity, address, peer=partner, insecure=self.insecure, trust=self.trust))


class PartnerClient:
    """A client of a partner site whose failures become this site's FAILED_PRECONDITION /
    UNAVAILABLE (the caller's budget here is not what ran out when the partner refuses)."""

    def __init__(self, client: PeerClient):
        self._client = client

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except PeerError as e:
                status = "UNAVAILABLE" if e.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "FAILED_PRECONDITION"
                # the partner's own reason travels in the metadata: this refusal is the partner's
                raise PeerError(
                    status,
                    f"partner {self._client.peer_name!r} refused or failed ({e.status}): {e}",
                    e.details,
                    reason="PARTNER_UNAVAILABLE" if status == "UNAVAILABLE" else "PARTNER_REFUSED",
                    metadata={
                        "partner": self._client.peer_name,
                        "partner_status": e.status,
                        **({"partner_reason": e.reason} if e.reason else {}),
                    },
                ) from None

        return call
