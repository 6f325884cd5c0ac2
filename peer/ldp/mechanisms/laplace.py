"""The Laplace mechanism on node features (activations on a probe set).

Pure ε-LDP per neuron (or per entry when asked); sensitivity from the public clip range
(docs/mechanisms.md, "Laplace on activations").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms.checks import _release_inputs


def laplace_activations(
    activations: Any,
    *,
    epsilon: float,
    clip: tuple[float, float],
    unit: str = "neuron",
    randomness: Randomness | None = None,
) -> tuple[np.ndarray, ReleaseRecord]:
    """Laplace mechanism on node features: ``clip(a, lo, hi) + Laplace(0, b)`` entrywise, b = Δ₁/ε.

    ``activations`` is (n, P): one row per neuron, one column per probe. Unit ``"neuron"``
    (default): one neuron's row is ε-LDP, Δ₁ = P·(hi − lo); ``"entry"`` (only when asked): one
    scalar, Δ₁ = hi − lo. Public: ``clip`` and ``epsilon``; values are clipped before noise
    (docs/mechanisms.md, "Laplace on activations").

    Returns the noisy (n, P) float64 array and a ``"laplace"`` record with parameters ``scale``
    (b), ``clip`` [lo, hi] and ``shape`` [n, P].
    """
    x, eps, lo, hi, unit, rnd = _release_inputs(activations, "activations", epsilon, clip, "clip", unit, randomness)
    n, p = x.shape
    sensitivity = (p if unit == "neuron" else 1) * (hi - lo)
    scale = sensitivity / eps
    noisy = np.clip(x, lo, hi) + rnd.generator.laplace(0.0, scale, size=x.shape)
    record = ReleaseRecord(
        mechanism="laplace",
        level="model",
        unit=unit,
        epsilon=eps,
        delta=0.0,
        sensitivity=sensitivity,
        sensitivity_norm="l1",
        parameters={"scale": scale, "clip": [lo, hi], "shape": [n, p]},
        **rnd.record_fields(),
    )
    return noisy, record
