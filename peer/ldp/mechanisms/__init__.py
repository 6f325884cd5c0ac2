"""Local-DP mechanisms of PrivFusion: what a site applies to the features and weights it shares.

Each mechanism is a pure function of (values, public parameters, randomness) returning the noisy
values and one :class:`peer.base.records.ReleaseRecord` that states the mechanism, its
parameters, the unit of privacy and the sensitivity. The unit, sensitivity and calibration of
each, and why the smoothing filter is post-processing, are in docs/mechanisms.md.

One concept per module, each importing only those before it:

- ``checks``: validation of values and public parameters shared by all;
- ``records``: composite records (parallel / sequential composition);
- ``laplace``: Laplace on activations;
- ``multibit``: LPGNN's multi-bit mechanism and its rectifier, on weight features;
- ``gaussian``: Gaussian calibration and the PFA's perturbation unit, on released weights;
- ``smoothing``: the PFA's smoothing filter (post-processing);
- ``network``: whole-network releases (:func:`perturb_graph`, :func:`perturb_model_weights`).

Randomness: ``None`` draws a fresh CSPRNG-seeded generator; a fixed seed is used only when the
caller passes one, and it is reported in the record.
"""

from peer.ldp.mechanisms.checks import UNITS
from peer.ldp.mechanisms.gaussian import (
    CALIBRATIONS,
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    clip_rows,
    gaussian_delta,
    gaussian_perturbation,
    gaussian_sensitivity,
    gaussian_sigma,
)
from peer.ldp.mechanisms.laplace import laplace_activations
from peer.ldp.mechanisms.multibit import (
    MULTIBIT_EPSILON_PER_COORDINATE,
    MultibitRectifier,
    multibit,
    multibit_rectifier,
    multibit_variance,
)
from peer.ldp.mechanisms.network import (
    DEFAULT_BOUND_FACTOR,
    DEFAULT_CLIP_NORM,
    default_clip_norm,
    default_entry_bound,
    perturb_graph,
    perturb_model_weights,
)
from peer.ldp.mechanisms.records import COMPOSITIONS, PARALLEL_OVER, composite_record
from peer.ldp.mechanisms.smoothing import SPREAD_MARGIN, smoothing_filter, truncated_normal_mean

__all__ = [
    "CALIBRATIONS",
    "COMPOSITIONS",
    "DEFAULT_BOUND_FACTOR",
    "DEFAULT_CLIP_NORM",
    "MULTIBIT_EPSILON_PER_COORDINATE",
    "PARALLEL_OVER",
    "SPREAD_MARGIN",
    "UNITS",
    "MultibitRectifier",
    "analytic_gaussian_sigma",
    "classical_gaussian_sigma",
    "clip_rows",
    "composite_record",
    "default_clip_norm",
    "default_entry_bound",
    "gaussian_delta",
    "gaussian_perturbation",
    "gaussian_sensitivity",
    "gaussian_sigma",
    "laplace_activations",
    "multibit",
    "multibit_rectifier",
    "multibit_variance",
    "perturb_graph",
    "perturb_model_weights",
    "smoothing_filter",
    "truncated_normal_mean",
]
