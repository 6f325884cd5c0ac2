"""What the release desk hands to the transport: one release kind per kind of request.

Each is charged (``entry_id``: the ledger entry) — or, with ``served_again`` (the ledger's
served-again row), the identical bytes of that earlier charge — and signed (``receipt``, filled
by the desk's last step). ``kind`` and ``subject`` are the manifest's kind and model field
(``docs/wire.md``); ``tensors`` are in stream order; ``metadata`` is public; ``upstream`` holds
the partner's signed receipts a relayed fusion was made from. The bytes may leave only once a
release exists: every one of them is made after its charge committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.records import ReleaseRecord


@dataclass(frozen=True)
class Issued:
    """A release ready to stream (see the module docstring)."""

    kind: str
    subject: str
    caller: str
    record: ReleaseRecord
    architecture: Mapping[str, Any] | None
    metadata: Mapping[str, Any]
    tensors: list[tuple[str, np.ndarray]]
    entry_id: str
    served_again: str | None = None
    upstream: tuple = ()
    receipt: Any = None


@dataclass(frozen=True)
class IssuedFeatures(Issued):
    """Noisy features of a model on the caller's probe set (with its PFA weights when asked)."""


@dataclass(frozen=True)
class IssuedWeights(Issued):
    """PFA-perturbed weights of a model, unpermuted."""


@dataclass(frozen=True)
class IssuedMerge(Issued):
    """An RS or LC merge of a DP-SGD pool: charged once, then served again at no charge."""


@dataclass(frozen=True)
class IssuedSegment(Issued):
    """A published segment of a multi-round run, served again (charged when it was published)."""


@dataclass(frozen=True)
class IssuedSecureShare(Issued):
    """This site's masked share of one secure-sum step, charged once for every peer of the
    attempt (``caller`` "*"); ``tensors`` holds the one masked vector (its uint64 residues
    viewed as int64, the same bytes), ``metadata`` the run,
    step, attempt and peers."""


@dataclass(frozen=True)
class IssuedFusion(Issued):
    """The relay Fuse's fused model, under the charge of this site's contribution."""

    objective: float = 0.0
