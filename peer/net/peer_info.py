"""What a peer answers, as :class:`peer.net.client.PeerClient` returns it: plain frozen values.

The client hands its callers these domain types, never a ``privfusion.v1`` message, the way
Flower's serde turns its messages into its own typed values in both directions; the site builds
its answer from the same ones. The one place that converts between them and the wire is
``peer.net.messages`` (:func:`~peer.net.messages.peer_info_message` from a site's
:class:`SiteInfo`, :func:`~peer.net.messages.peer_info_from_message` back). A release comes back
as :class:`peer.net.wire.Release` (its signed receipt and record, its manifest and tensors).

* :class:`SiteInfo` — what a site tells a pinned caller about itself: the models and pools it
  offers (:class:`ModelInfo` with its :class:`LayerInfo`, :class:`PoolInfo`), the mechanisms it
  releases under, the budgets its policy lets the caller see (:class:`BudgetInfo`), the files it
  does not serve. All of it is public.
* :class:`PeerInfo` — the same as a client receives it (``GetPeerInfo``), with the wire's own
  facts (protocol, largest chunk).
* :class:`LedgerEntry` — ``ListLedger``: one charge to the caller, with the record as charged.

No gRPC and no protobuf here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from peer.base.records import ReleaseRecord

__all__ = [
    "BudgetInfo",
    "LayerInfo",
    "LedgerEntry",
    "ModelInfo",
    "PeerInfo",
    "PoolInfo",
    "SiteInfo",
    "UnusableFile",
]


@dataclass(frozen=True)
class LayerInfo:
    """A weight layer of a model on offer: its state-dict prefix, "linear" or "conv", the shapes
    of ``NAME.weight`` and ``NAME.bias``, and whether its units are hidden (permutable) nodes."""

    name: str
    kind: str
    weight_shape: tuple[int, ...]
    bias_shape: tuple[int, ...]
    hidden: bool


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: Mapping[str, Any] | None  # None only as received: JSON that is not an object
    parameter_count: int
    hidden_sizes: tuple[int, ...]
    layers: tuple[LayerInfo, ...]


@dataclass(frozen=True)
class PoolInfo:
    name: str
    architecture: Mapping[str, Any] | None  # None only as received: JSON that is not an object
    members: tuple[str, ...]
    methods: tuple[str, ...]  # "rs", and "lc" when every member has a full training record


@dataclass(frozen=True)
class BudgetInfo:
    """One budget the policy lets the caller see: the filter's limits and what it has admitted."""

    budget: str
    scope: str
    epsilon_limit: float
    delta_limit: float
    epsilon_spent: float
    epsilon_remaining: float
    releases: int


@dataclass(frozen=True)
class SiteInfo:
    """What a site tells a pinned caller about itself (GetPeerInfo): all public."""

    name: str
    certificate_sha256: str
    insecure: bool
    models: tuple[ModelInfo, ...]
    pools: tuple[PoolInfo, ...]
    mechanisms: tuple[str, ...]
    budgets: tuple[BudgetInfo, ...]
    has_probe_set: bool
    # files in models/ or pool/ (and a probe set not made yet) the site cannot use: (path, why)
    unusable: tuple[tuple[str, str], ...] = ()


class UnusableFile(NamedTuple):
    """A file in the peer's model store or pools that it does not serve, and why (names and
    rules only, never contents); unpacks as ``(path, reason)`` like ``SiteInfo.unusable``."""

    path: str
    reason: str


@dataclass(frozen=True)
class PeerInfo:
    """A peer's ``GetPeerInfo`` answer.

    ``models`` and ``pools`` carry each offer's architecture as parsed JSON; an offer whose
    architecture the peer sent as JSON that does not parse to an object has ``architecture``
    None (it matches no architecture of ours, and nothing is asked of it)."""

    name: str
    certificate_sha256: str
    protocol: str
    insecure: bool
    models: tuple[ModelInfo, ...]
    pools: tuple[PoolInfo, ...]
    mechanisms: tuple[str, ...]
    budgets: tuple[BudgetInfo, ...]
    has_probe_set: bool
    max_chunk_bytes: int
    unusable: tuple[UnusableFile, ...] = ()


class LedgerEntry(NamedTuple):
    """One entry of the peer's ledger charged to the caller: its id, the record as charged, and
    when (RFC 3339); unpacks as ``(entry_id, record, created_at)``."""

    entry_id: str
    record: ReleaseRecord
    created_at: str
