"""What a caller asks the release desk for: one typed, immutable request per kind of release.

A request holds values the transport has already validated (every field checked, named in its
error, before the desk is asked): the caller's bound site name, the site it is finally for when
relayed (``on_behalf_of``), the subject (a model, a pool or a run) and the public parameters of
the mechanism. The desk (``peer.desk.desk``) reads nothing else from the caller.

``kinds`` is what the site's policy is asked (``Policy.allows``) and what the ledger checks the
per-request caps against; ``release_kind`` is the manifest's kind (``docs/wire.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class FeaturesRequest:
    """Noisy graph features of ``model`` on the caller's public ``probe`` (Laplace on
    activations clipped to ``activation_clip``, multi-bit on weight features within
    ``weight_bounds``, per ``unit``) and, with ``weights`` = (ε, δ), its PFA weights in the same
    release (one sequential composite, one charge)."""

    method: ClassVar[str] = "ReleaseFeatures"

    caller: str
    model: str
    activation_epsilon: float
    weight_epsilon: float
    activation_clip: tuple[float, float] | None
    weight_bounds: tuple[float, float] | None = None
    unit: str = "neuron"
    weights: tuple[float, float] | None = None
    on_behalf_of: str | None = None
    probe: np.ndarray | None = None  # None while the policy is asked, before the upload

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("features", "weights") if self.weights is not None else ("features",)

    @property
    def release_kind(self) -> str:
        return "features+weights" if self.weights is not None else "features"


@dataclass(frozen=True)
class WeightsRequest:
    """PFA-perturbed, unpermuted weights of ``model`` at (``epsilon``, ``delta``) per neuron."""

    method: ClassVar[str] = "ReleaseWeights"
    kinds: ClassVar[tuple[str, ...]] = ("weights",)
    release_kind: ClassVar[str] = "weights"

    caller: str
    model: str
    epsilon: float
    delta: float
    on_behalf_of: str | None = None


@dataclass(frozen=True)
class MergeRequest:
    """An RS or LC merge (``method`` "rs" / "lc") of ``pool`` at the target (ε, δ): data level,
    served again at no charge when the identical release was made before."""

    method: ClassVar[str] = "ReleaseMerged"
    kinds: ClassVar[tuple[str, ...]] = ("merge",)
    release_kind: ClassVar[str] = "merged"

    caller: str
    pool: str
    merge_method: str
    epsilon: float
    delta: float
    on_behalf_of: None = None


@dataclass(frozen=True)
class SegmentRequest:
    """The newest published segment of a multi-round run ``run`` with ``min_round`` ≤ round ≤
    ``max_round`` (None: no upper limit): served again, never made or charged here."""

    method: ClassVar[str] = "ReleaseSegment"
    kinds: ClassVar[tuple[str, ...]] = ("segment",)
    release_kind: ClassVar[str] = "segment"

    caller: str
    run: str
    min_round: int
    max_round: int | None = None
    on_behalf_of: None = None


@dataclass(frozen=True)
class FuseRequest:
    """The relay Fuse: this site's ``model`` fused with ``partner``'s ``partner_model`` at scale
    ``alpha``, for the caller. The owner's contribution (features on ``probe`` at
    (``activation_epsilon``, ``weight_epsilon``) and PFA weights at (``weights_epsilon``,
    ``weights_delta``)) is charged before ``exchange`` — the one call to the partner, then the
    matching and fusion (``peer.net.fuse``) — and cancelled when it fails; ``caller_active``
    is asked once the model is fused."""

    method: ClassVar[str] = "Fuse"
    kinds: ClassVar[tuple[str, ...]] = ("fuse",)
    release_kind: ClassVar[str] = "fused"

    caller: str
    model: str
    partner: str
    partner_model: str
    alpha: float
    activation_epsilon: float
    weight_epsilon: float
    weights_epsilon: float
    weights_delta: float
    activation_clip: tuple[float, float] | None
    probe: np.ndarray | None = None  # None while the policy is asked
    exchange: Callable[[Any], Any] | None = None  # peer.net.fuse.partner_exchange
    caller_active: Callable[[], bool] = lambda: True
    on_behalf_of: None = None


@dataclass(frozen=True)
class SecureShareRequest:
    """This site's masked share of one secure-sum step (``run``, ``step``, ``attempt``) of a
    multi-round run, to go to every one of ``peers`` (the other sites of the attempt): the
    vector ``masked`` (uint64 residues, already masked: it reveals nothing alone) and its
    ``record`` (``peer.dp.distributed.skellam.step_record``: the distributed Skellam mechanism,
    data level), which is charged ONCE — a completed sum is a release — before any byte of
    ``masked`` may leave. Every peer must be one the policy lets take part (kind
    "secure-sum")."""

    method: ClassVar[str] = "SecureShare"
    kinds: ClassVar[tuple[str, ...]] = ("secure-sum",)
    release_kind: ClassVar[str] = "secure-share"

    run: str
    step: int
    attempt: int
    peers: tuple[str, ...]
    record: Any
    masked: np.ndarray
    on_behalf_of: None = None

    @property
    def caller(self) -> str:
        """The ledger counterparty of the charge: every peer of the attempt (they are named in
        the record's ``parameters.peers``)."""
        return SECURE_SUM_AUDIENCE


#: The ledger counterparty of a secure-sum share: it goes to every peer of the attempt at once.
SECURE_SUM_AUDIENCE = "*"

Request = FeaturesRequest | WeightsRequest | MergeRequest | SegmentRequest | FuseRequest | SecureShareRequest

__all__ = [
    "SECURE_SUM_AUDIENCE",
    "FeaturesRequest",
    "FuseRequest",
    "MergeRequest",
    "Request",
    "SecureShareRequest",
    "SegmentRequest",
    "WeightsRequest",
]
