"""Local-DP releases of a network described by permutation groups (``peer.nn.tracing``).

The unit of privacy is **one group element** — a hidden unit together with everything that
moves with it: in a residual network, one channel of a residual stream is written by several
layers (the stem, each block's last conv) and normalised by several BatchNorms, and all of those
rows are *one* unit. Rows of the fixed output units (and of any other parameter whose first
axis no group permutes) are units of their own, one per row of each module. Every release
below is per unit and parallel over units (disjoint rows), as for the layered releases.

* :func:`perturb_group_activations` — the Laplace mechanism on each group element's activation
  row (its responses on the P probes at each of the group's m member tensors, P·m values,
  ``peer.ldp.group_matching.group_activations``), clipped to the public range [lo, hi]:
  Δ₁ = P·m·(hi − lo) per element (``laplace_activations`` with unit ``"neuron"``).
* :func:`perturb_group_weights` — the PFA on weights: a unit's row is the concatenation of its
  slice (first axis) of every parameter it owns — weights, biases, BatchNorm affine and running
  statistics. Each entry is divided by a public scale (its layer's default weight box
  4/sqrt(fan_in) for weights and biases of a Linear/Conv, ``VECTOR_BOUND`` for other vectors,
  e.g. BatchNorm's), the scaled row goes through ``gaussian_perturbation`` with entry box 1 and
  L2 clip norm ``clip_scale``·sqrt(row length) — so Δ₂ = 2·clip_norm per unit — and is scaled
  back; then, optionally, the smoothing filter per parameter (post-processing, public σ and box).
  Dividing by public constants before and multiplying after is post-processing of a Gaussian
  mechanism in the scaled coordinates, so the guarantee is that mechanism's (ε, δ).
  BatchNorm running variances are floored at ``MIN_VARIANCE`` after release (post-processing:
  a variance must be positive). 0-d buffers (``num_batches_tracked``: how many batches a
  BatchNorm has seen) carry no per-unit data and are released as they are — say so to users.
* :func:`perturb_group_weight_features` — the multi-bit mechanism (LPGNN) on the same rows as
  the PFA: a unit's row, divided entry by entry by the same public scales, is clipped to the
  public box [−1, 1]^d and released by ``multibit`` at ε per unit (pure ε-DP, sensitivity: the
  box's range 2 per coordinate of the d-vector, ``sensitivity_norm = "range"``), then scaled
  back. It is the layered ``perturb_graph`` weight-feature release with the scale folded into
  the row: the layered box [−c, c] with c = 4/sqrt(fan_in) is this box times this scale. Every
  released parameter takes at most three values (the rectifier's levels times its scale), so
  the matcher's exact few-valued expansion applies.

Units are tensors, not keys: every key of the structure must be a tensor of its own, or one
tensor's rows would be released once per key with independent noise under one charge. The
structure cannot show that (it holds names and shapes); the site's module can, and it is
checked wherever a module is built or imported (``peer.nn.tracing.check_no_aliases``: import,
``peer.nn.imported.build_module``, ``load_site_state``; the daemon builds it for a weights
release too), so an aliased network never reaches these functions through the site.

Public: the structure (names, shapes, groups), ``clip``, the scales and clip norms, ε, δ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms.checks import _check_delta, _positive_finite, _randomness
from peer.ldp.mechanisms.gaussian import gaussian_perturbation
from peer.ldp.mechanisms.laplace import laplace_activations
from peer.ldp.mechanisms.multibit import multibit
from peer.ldp.mechanisms.network import default_entry_bound
from peer.ldp.mechanisms.records import composite_record
from peer.ldp.mechanisms.smoothing import smoothing_filter
from peer.nn.tracing import PermutationStructure

#: public scale of a vector parameter that is not a Linear/Conv bias (BatchNorm weight, bias,
#: running mean and variance)
VECTOR_BOUND = 4.0
#: the L2 clip norm of a unit's scaled row is CLIP_SCALE·sqrt(row length)
CLIP_SCALE = 0.5
MIN_VARIANCE = 1e-5


def release_units(structure: PermutationStructure) -> dict[str, list[str]]:
    """Who owns which rows: unit name (a group, or ``fixed:MODULE``) -> the parameters whose
    first axis it indexes. 0-d parameters belong to no unit."""
    owner: dict[str, str] = {}
    for g in structure.groups:
        for a in g.axes:
            if a.axis == 0:
                owner[a.param] = g.name
    units: dict[str, list[str]] = {g.name: [] for g in structure.groups}
    for p, shape in structure.parameters.items():
        if len(shape) == 0:
            continue
        u = owner.get(p, f"fixed:{p.rsplit('.', 1)[0]}")
        units.setdefault(u, []).append(p)
    return units


def _scale(structure: PermutationStructure, param: str) -> float:
    shape = structure.parameters[param]
    if len(shape) >= 2:
        return default_entry_bound(math.prod(shape[1:]))
    prefix = param.rsplit(".", 1)[0]
    weight = structure.parameters.get(f"{prefix}.weight")
    if param.endswith(".bias") and weight is not None and len(weight) >= 2:
        return default_entry_bound(math.prod(weight[1:]))
    return VECTOR_BOUND


def perturb_group_activations(
    activations: Mapping[str, Any], *, epsilon: float, clip: tuple[float, float], randomness: Randomness | None = None
) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """Laplace on every group's (n, P·m) activation rows; one unit = one group element."""
    rnd = _randomness(randomness)
    if not activations:
        raise InvalidArgument("activations", "no groups to release")
    out, records = {}, []
    for g, rows in activations.items():
        noisy, rec = laplace_activations(rows, epsilon=epsilon, clip=clip, unit="neuron", randomness=rnd)
        out[g] = noisy
        records.append(rec.with_(parameters={**rec.parameters, "group": g}))
    record = composite_record(
        records,
        "parallel",
        randomness=rnd,
        over="neurons",
        parameters={"release": "group_activations", "unit_is": "one group element"},
    )
    return out, record


def perturb_group_weights(
    structure: PermutationStructure,
    arrays: Mapping[str, Any],
    *,
    epsilon: float,
    delta: float,
    clip_scale: float = CLIP_SCALE,
    smoothing: bool = True,
    calibration: str = "analytic",
    randomness: Randomness | None = None,
) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """The PFA on a whole state, one row per group element (see the module docstring).
    Returns arrays with the site's names, shapes and dtypes, and a parallel composite record."""
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    cs = _positive_finite(clip_scale, "clip_scale")
    rnd = _randomness(randomness)
    out = _checked_state(structure, arrays)
    records = []
    for unit, params in release_units(structure).items():
        if not params:
            continue
        rows, scales, widths = _unit_rows(structure, arrays, params)
        clip_norm = cs * math.sqrt(rows.shape[1])
        noisy, rec = gaussian_perturbation(
            rows,
            epsilon=eps,
            delta=dlt,
            clip_norm=clip_norm,
            entry_bound=1.0,
            unit="neuron",
            calibration=calibration,
            randomness=rnd,
        )
        sigma = rec.parameters["noise_std"]
        start = 0
        for p, s, w in zip(params, scales, widths, strict=True):
            part = noisy[:, start : start + w]
            start += w
            if smoothing:
                part, _ = smoothing_filter(part, noise_std=sigma, entry_bound=1.0)
            value = part * s
            if p.endswith("running_var"):
                value = np.maximum(value, MIN_VARIANCE)
            ref = np.asarray(arrays[p])
            out[p] = value.reshape(structure.parameters[p]).astype(ref.dtype if ref.dtype.kind == "f" else np.float64)
        records.append(
            rec.with_(
                parameters={
                    **rec.parameters,
                    "unit_owner": unit,
                    "parameters": params,
                    "scales": scales,
                    "smoothing": smoothing,
                }
            )
        )
    return out, _weights_record(structure, records, rnd, "group_weights")


def _weights_record(structure: PermutationStructure, records: list, rnd, release: str):
    """The composite of one weights release: its per-unit records in parallel (each group
    element's rows lie in exactly one unit's record), naming the scalar parameters (no group
    element's) that are not released."""
    return composite_record(
        records,
        "parallel",
        randomness=rnd,
        over="neurons",
        parameters={
            "release": release,
            "unit_is": "one group element",
            "unreleased_scalars": [p for p, s in structure.parameters.items() if len(s) == 0],
        },
    )


def _unit_rows(structure: PermutationStructure, arrays: Mapping[str, Any], params: list[str]):
    """A unit's (n, d) rows in scaled coordinates: the concatenation of its slices (first axis)
    of ``params``, each divided by its public scale; with the scales and widths."""
    n = structure.parameters[params[0]][0]
    scales = [_scale(structure, p) for p in params]
    widths = [math.prod(structure.parameters[p][1:]) for p in params]
    rows = np.concatenate(
        [np.asarray(arrays[p], dtype=np.float64).reshape(n, -1) / s for p, s in zip(params, scales, strict=True)],
        axis=1,
    )
    return rows, scales, widths


def _checked_state(structure: PermutationStructure, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Check the state against the structure (names, shapes, finite values); the 0-d buffers,
    copied: they hold no per-unit data and are released as they are."""
    structure.check_arrays(arrays, "arrays")
    out = {}
    for p, shape in structure.parameters.items():
        a = np.asarray(arrays[p])
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise InvalidArgument(f"arrays[{p}]", "contains NaN or infinite values")
        if len(shape) == 0:
            out[p] = a.copy()
    return out


def perturb_group_weight_features(
    structure: PermutationStructure,
    arrays: Mapping[str, Any],
    *,
    epsilon: float,
    randomness: Randomness | None = None,
) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """The multi-bit mechanism on every group element's weight-feature row (the module docstring).

    Per unit (a group, or ``fixed:MODULE``) its (n, d) rows — its slices of every parameter it
    owns, each entry divided by the parameter's public scale — go through
    ``multibit(rows, epsilon, bounds=(−1, 1), unit="neuron")``: each row is clipped to [−1, 1]^d,
    m = max(1, min(d, ⌊ε/2.18⌋)) coordinates report ±1 by (ε/m)-randomised response, and the
    rectifier x′ = d/m·coth(ε/2m)·x* is unbiased for the clipped row. ε-DP per group element
    (δ = 0), sensitivity 2 per coordinate in scaled coordinates (every row differs anywhere in
    the box). The rectified row is multiplied back by the scales, so parameter p takes values in
    {−h·s_p, 0, +h·s_p} (h = the unit's half step): three at most. Nothing else is done to the
    values (no floor on running variances: these are features for matching, not weights to run).

    Returns arrays with the site's names and shapes (float64 for floating-point parameters; 0-d
    buffers as they are) and a ``"parallel"`` composite over ``"neurons"`` of the per-unit
    ``"multibit"`` records, each with ``unit_owner``, ``parameters`` and ``scales`` (public).
    """
    eps = _positive_finite(epsilon, "epsilon")
    rnd = _randomness(randomness)
    out = _checked_state(structure, arrays)
    records = []
    for unit, params in release_units(structure).items():
        if not params:
            continue
        rows, scales, widths = _unit_rows(structure, arrays, params)
        noisy, rec = multibit(rows, epsilon=eps, bounds=(-1.0, 1.0), unit="neuron", randomness=rnd)
        start = 0
        for p, s, w in zip(params, scales, widths, strict=True):
            out[p] = (noisy[:, start : start + w] * s).reshape(structure.parameters[p])
            start += w
        records.append(
            rec.with_(parameters={**rec.parameters, "unit_owner": unit, "parameters": params, "scales": scales})
        )
    return out, _weights_record(structure, records, rnd, "group_weight_features")
