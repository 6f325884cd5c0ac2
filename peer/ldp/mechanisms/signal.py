"""Whether a weights release can carry signal at all, predicted from its public parameters.

The PFA's smoothing filter (``smoothing``) trusts a layer's clean spread only where the noisy
variance clears σ² by ``SPREAD_MARGIN`` standard errors of the variance estimate; otherwise it
returns the layer's (soft-thresholded) mean for every entry — a constant. Whether that happens
is decided, up to sampling error, by public numbers alone: σ (from ε, δ, the clip norm and the
box), the number N of values filtered together, and the largest spread the clean values can
have. Clean entries are clipped to the box [−c, c] and every row of k entries to the L2 ball of
radius C, so their variance is at most s² = min(c, C/√k)². With the noisy variance at its
expectation s² + σ², the filter's estimate of the clean variance is

    s² − m·(s² + σ²),   m = SPREAD_MARGIN·sqrt(2/(N − 1)),

and the release of that part is constant (it carries no signal) when this is ≤ 0, i.e. when
σ² ≥ s²(1 − m)/m — even for a network whose weights filled the public box. A real network's
spread is smaller, so a part predicted constant here is constant in practice; a part predicted
to clear may still come back constant. Nothing here reads a weight: it is a function of the
architecture (or the traced structure) and the requested (ε, δ), so a requester can run it
before asking anyone for anything (``coordinator_free.runner``). The analytic calibration is
assumed (the smallest σ of ``CALIBRATIONS``): a site calibrating classically adds more noise,
so a part predicted constant stays constant there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peer.ldp.mechanisms.gaussian import gaussian_sensitivity, gaussian_sigma
from peer.ldp.mechanisms.groups import CLIP_SCALE, release_units
from peer.ldp.mechanisms.network import default_clip_norm, default_entry_bound
from peer.ldp.mechanisms.smoothing import SPREAD_MARGIN
from peer.nn.architectures import weight_layers
from peer.nn.tracing import PermutationStructure

__all__ = [
    "FilteredPart",
    "architecture_parts",
    "filter_keeps_signal",
    "parts_without_signal",
    "signal_epsilon",
    "structure_parts",
]

#: the largest ε a round may ask for (``coordinator_free.rounds``): beyond it, "never"
EPSILON_CEILING = 1000.0


@dataclass(frozen=True)
class FilteredPart:
    """One call of the smoothing filter in a weights release, as its public parameters fix it:
    ``values`` entries filtered together (a layer's weights, or its biases), drawn from rows of
    ``row_length`` entries clipped to L2 norm ``clip_norm`` and to the box [−``entry_bound``,
    ``entry_bound``] (in the coordinates the noise is added in); ``weights``: a weight tensor
    (two axes or more), whose constant release takes the layer's signal with it."""

    name: str
    values: int
    row_length: int
    clip_norm: float
    entry_bound: float
    weights: bool

    @property
    def spread_bound(self) -> float:
        """The largest standard deviation the clean entries can have: min(c, C/√k)."""
        return min(self.entry_bound, self.clip_norm / math.sqrt(self.row_length))

    def noise_std(self, epsilon: float, delta: float) -> float:
        """σ of the Gaussian unit for this part's rows at (ε, δ) per neuron (analytic)."""
        sensitivity = gaussian_sensitivity(
            "neuron", clip_norm=self.clip_norm, entry_bound=self.entry_bound, length=self.row_length
        )
        return gaussian_sigma(epsilon, delta, sensitivity, "analytic")


def filter_keeps_signal(values: int, noise_std: float, spread_bound: float) -> bool:
    """Whether the smoothing filter keeps a spread of ``spread_bound`` among ``values`` entries
    under noise ``noise_std``, the noisy variance at its expectation (module docstring)."""
    m = SPREAD_MARGIN * math.sqrt(2.0 / max(values - 1, 1))
    total = spread_bound**2 + noise_std**2
    return spread_bound**2 - m * total > 0


def architecture_parts(arch: Mapping[str, Any]) -> list[FilteredPart]:
    """The filter calls of ``perturb_model_weights`` on a built-in architecture at its public
    defaults (``default_clip_norm``, ``default_entry_bound``): per layer, its weights and its
    biases."""
    parts = []
    for s in weight_layers(arch):
        k, c, clip = s.fan_in + 1, default_entry_bound(s.fan_in), default_clip_norm(s.fan_in)
        parts.append(FilteredPart(f"{s.name}.weight", s.units * s.fan_in, k, clip, c, True))
        parts.append(FilteredPart(f"{s.name}.bias", s.units, k, clip, c, False))
    return parts


def structure_parts(structure: PermutationStructure) -> list[FilteredPart]:
    """The filter calls of ``perturb_group_weights`` on a traced network: per release unit, one
    per parameter of its rows, in the scaled coordinates (box 1, clip ``CLIP_SCALE``·√k)."""
    parts = []
    for params in release_units(structure).values():
        if not params:
            continue
        shapes = [structure.parameters[p] for p in params]
        widths = [math.prod(shape[1:]) for shape in shapes]
        k = sum(widths)
        for p, shape, w in zip(params, shapes, widths, strict=True):
            parts.append(FilteredPart(p, shape[0] * w, k, CLIP_SCALE * math.sqrt(k), 1.0, len(shape) >= 2))
    return parts


def parts_without_signal(parts: Sequence[FilteredPart], epsilon: float, delta: float) -> list[FilteredPart]:
    """The weight tensors among ``parts`` whose release at (ε, δ) is constant (module docstring)."""
    return [
        p for p in parts if p.weights and not filter_keeps_signal(p.values, p.noise_std(epsilon, delta), p.spread_bound)
    ]


def signal_epsilon(parts: Sequence[FilteredPart], delta: float, ceiling: float = EPSILON_CEILING) -> float | None:
    """The smallest ε (to 0.1 %) at which no weight tensor of ``parts`` is predicted constant, or
    None when some tensor is constant even at ``ceiling`` (too few values for the filter's margin,
    whatever the noise)."""
    if parts_without_signal(parts, ceiling, delta):
        return None
    lo, hi = 1e-6, ceiling
    if not parts_without_signal(parts, lo, delta):
        return lo
    while hi / lo > 1.001:  # σ falls as ε grows, so "no tensor constant" is monotone in ε
        mid = math.sqrt(lo * hi)
        if parts_without_signal(parts, mid, delta):
            lo = mid
        else:
            hi = mid
    return hi
