"""The checks every merge's weights share: convex weights over a pool's models (RS's π, LC's
λ), a subset of the models (the ones a utility selection scored), and how weights may be
chosen (``SELECTIONS``). Pure; no accounting here,
so the typed events (``events``) can check a record's weights without loading the accountants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from peer.base.errors import InvalidArgument

WEIGHT_TOLERANCE = 1e-6
#: how π / λ are chosen (``targets``): from public information only, or from measured utilities
#: of a public subset of models, charged as releasing that subset
SELECTIONS = ("public-prior", "utility")


def check_weights(weights: Sequence[float], count: int, field_name: str = "pi") -> np.ndarray:
    """Convex weights: ``count`` finite numbers ≥ 0 summing to 1 (within 1e-6, then renormalised)."""
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise InvalidArgument(field_name, f"must be a list of {count} numbers, got {weights!r}")
    if len(weights) != count:
        raise InvalidArgument(field_name, f"must have one weight per model ({count}), got {len(weights)}")
    out = np.empty(count)
    for i, w in enumerate(weights):
        if (
            isinstance(w, bool)
            or not isinstance(w, (int, float, np.integer, np.floating))
            or not math.isfinite(float(w))
        ):
            raise InvalidArgument(f"{field_name}[{i}]", f"must be a finite number, got {w!r}")
        if w < 0:
            raise InvalidArgument(f"{field_name}[{i}]", f"must be >= 0, got {w!r}")
        out[i] = float(w)
    total = float(out.sum())
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise InvalidArgument(field_name, f"must sum to 1, got {total!r}")
    return out / total


def check_subset(subset: Sequence[int], count: int, field_name: str = "scored") -> tuple[int, ...]:
    """Distinct model indices in [0, count), at least one, in increasing order."""
    if isinstance(subset, (str, bytes)) or not hasattr(subset, "__len__") or not len(subset):
        raise InvalidArgument(field_name, f"must be a non-empty list of model indices, got {subset!r}")
    out = []
    for i, v in enumerate(subset):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < count:
            raise InvalidArgument(f"{field_name}[{i}]", f"must be a model index in [0, {count}), got {v!r}")
        out.append(int(v))
    if len(set(out)) != len(out):
        raise InvalidArgument(field_name, f"must not repeat a model, got {list(out)}")
    return tuple(sorted(out))


__all__ = ["SELECTIONS", "WEIGHT_TOLERANCE", "check_subset", "check_weights"]
