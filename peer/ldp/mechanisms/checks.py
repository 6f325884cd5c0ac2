"""Checks shared by every mechanism: the values released, the public parameters, the randomness.

Each raises InvalidArgument naming the field and the rule. ``UNITS`` are the units of privacy a
release may state (docs/mechanisms.md, "Unit of privacy").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.rng import Randomness, make_randomness

UNITS = ("neuron", "entry")


def _randomness(randomness: Randomness | None) -> Randomness:
    if randomness is None:
        return make_randomness()
    if not isinstance(randomness, Randomness):
        raise InvalidArgument(
            "randomness", f"must be a peer.base.rng.Randomness or None, got {type(randomness).__name__}"
        )
    return randomness


def _positive_finite(value: Any, field: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a number, got {value!r}") from None
    if isinstance(value, bool) or not (math.isfinite(v) and v > 0):
        raise InvalidArgument(field, f"must be finite and > 0, got {value!r}")
    return v


def _check_delta(delta: Any, field: str = "delta") -> float:
    try:
        v = float(delta)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a number in (0, 1), got {delta!r}") from None
    if isinstance(delta, bool) or not 0 < v < 1:
        raise InvalidArgument(field, f"must be in (0, 1), got {delta!r}")
    return v


def _check_interval(bounds: Any, field: str) -> tuple[float, float]:
    if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
        raise InvalidArgument(field, f"must be a pair (lo, hi) of finite numbers, got {bounds!r}")
    try:
        lo, hi = float(bounds[0]), float(bounds[1])
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a pair (lo, hi) of finite numbers, got {bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidArgument(field, f"must be finite, got {bounds!r}")
    if not lo < hi:
        raise InvalidArgument(field, f"needs lo < hi, got {bounds!r}")
    return lo, hi


def _check_unit(unit: Any) -> str:
    if unit not in UNITS:
        raise InvalidArgument("unit", f"must be one of {UNITS}, got {unit!r}")
    return unit


def _check_matrix(values: Any, field: str) -> np.ndarray:
    try:
        x = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgument(field, "must be a numeric array") from None
    if x.ndim != 2:
        raise InvalidArgument(field, f"must be a 2-d array (units × entries), got shape {x.shape}")
    if x.size == 0:
        raise InvalidArgument(field, f"is empty (shape {x.shape})")
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(field, "contains NaN or infinite values")
    return x


def _release_inputs(
    values: Any, field: str, epsilon: Any, bounds: Any, bounds_field: str, unit: Any, randomness: Randomness | None
) -> tuple[np.ndarray, float, float, float, str, Randomness]:
    """The checked inputs of a pure-ε mechanism on a clipped box, in the order every such
    mechanism reports errors: (values, ε, lo, hi, unit, randomness)."""
    x = _check_matrix(values, field)
    eps = _positive_finite(epsilon, "epsilon")
    lo, hi = _check_interval(bounds, bounds_field)
    return x, eps, lo, hi, _check_unit(unit), _randomness(randomness)
