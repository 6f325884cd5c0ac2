"""Whole-network releases: the mechanisms applied to every layer, with one composite record.

:func:`perturb_graph` releases a graph's activations (Laplace) and weight features (multi-bit);
:func:`perturb_model_weights` releases a model's weights through the Perturbation-Filter Adapter
(Gaussian, then smoothing). Bounds are public: given, or derived from the architecture alone
(docs/mechanisms.md, "Whole networks").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms.checks import _check_delta, _check_interval, _check_unit, _positive_finite, _randomness
from peer.ldp.mechanisms.gaussian import CALIBRATIONS, gaussian_perturbation
from peer.ldp.mechanisms.laplace import laplace_activations
from peer.ldp.mechanisms.multibit import multibit
from peer.ldp.mechanisms.records import composite_record
from peer.ldp.mechanisms.smoothing import smoothing_filter
from peer.nn.architectures import WeightLayer, weight_layers
from peer.nn.graph import HiddenLayer, NetworkGraph

#: Default public weight box is [−c, c] with c = DEFAULT_BOUND_FACTOR / sqrt(fan_in): four times
#: PyTorch's Linear/Conv2d initialisation bound 1/sqrt(fan_in) (why: docs/mechanisms.md,
#: "Whole networks").
DEFAULT_BOUND_FACTOR = 4.0
#: Default public L2 clip norm of a neuron's incoming vector (weights and bias).
DEFAULT_CLIP_NORM = 2.0


def default_entry_bound(fan_in: int) -> float:
    """Public default weight box half-width c = 4/sqrt(fan_in) (architecture only)."""
    return DEFAULT_BOUND_FACTOR / math.sqrt(fan_in)


def default_clip_norm(fan_in: int) -> float:
    """Public default L2 clip norm of one neuron's incoming vector with its bias: the constant
    DEFAULT_CLIP_NORM for every layer, whatever the fan-in (docs/mechanisms.md, "Whole networks")."""
    return DEFAULT_CLIP_NORM


def _per_layer(value: Any, names: Sequence[str], field: str, check, default) -> dict[str, Any]:
    """Resolve a public bound given once for all layers, per layer (name → value), or None."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        missing = [n for n in names if n not in value]
        if unknown:
            raise InvalidArgument(field, f"unknown layers {unknown}; layers are {list(names)}")
        if missing:
            raise InvalidArgument(field, f"no value for layers {missing}")
        return {n: check(value[n], f"{field}[{n}]") for n in names}
    if value is None:
        return {n: default(n, f"{field}[{n}]") for n in names}
    return {n: check(value, field) for n in names}


def _arch_of_graph(graph: NetworkGraph) -> tuple[WeightLayer, ...]:
    specs = weight_layers(graph.architecture)
    hidden_names = tuple(h.name for h in graph.hidden)
    if tuple(s.name for s in specs[:-1]) != hidden_names:
        raise InvalidArgument(
            "graph",
            f"hidden layers {list(hidden_names)} do not match the architecture's {[s.name for s in specs[:-1]]}",
        )
    return specs


def perturb_graph(
    graph: NetworkGraph,
    *,
    epsilon_x: float,
    epsilon_w: float,
    activation_clip: tuple[float, float] | Mapping[str, tuple[float, float]] | None = None,
    weight_bounds: tuple[float, float] | Mapping[str, tuple[float, float]] | None = None,
    unit: str = "neuron",
    randomness: Randomness | None = None,
) -> tuple[NetworkGraph, ReleaseRecord]:
    """The architecture's weight layers, checked against the graph's hidden layer names."""
    if not isinstance(graph, NetworkGraph):
        raise InvalidArgument("graph", f"must be a NetworkGraph, got {type(graph).__name__}")
    eps_x = _positive_finite(epsilon_x, "epsilon_x")
    eps_w = _positive_finite(epsilon_w, "epsilon_w")
    unit = _check_unit(unit)
    rnd = _randomness(randomness)
    specs = _arch_of_graph(graph)
    hidden_names = [s.name for s in specs[:-1]]
    all_names = [s.name for s in specs]
    fan_in = {s.name: s.fan_in for s in specs}
    natural = {"tanh": (-1.0, 1.0), "sigmoid": (0.0, 1.0)}.get(graph.architecture.get("activation", "relu"))

    def default_clip(name: str, field: str) -> tuple[float, float]:
        if natural is None:
            raise InvalidArgument(
                field,
                f"is required: activation {graph.architecture.get('activation', 'relu')!r} is unbounded (give a public range)",
            )
        return natural

    clips = _per_layer(activation_clip, hidden_names, "activation_clip", _check_interval, default_clip)
    bounds = _per_layer(
        weight_bounds,
        all_names,
        "weight_bounds",
        _check_interval,
        lambda n, f: (-default_entry_bound(fan_in[n]), default_entry_bound(fan_in[n])),
    )
    # per neuron both parts touch the same neuron; per entry they touch other entries of it
    layer_composition, layer_over = ("sequential", None) if unit == "neuron" else ("parallel", "entries")

    new_hidden, layer_records = [], []
    for h in graph.hidden:
        act, r_act = laplace_activations(h.activations, epsilon=eps_x, clip=clips[h.name], unit=unit, randomness=rnd)
        feats = np.concatenate([h.weight_features, h.bias[:, None]], axis=1)
        noisy_w, r_w = multibit(feats, epsilon=eps_w, bounds=bounds[h.name], unit=unit, randomness=rnd)
        r_act = r_act.with_(parameters={**r_act.parameters, "layer": h.name, "part": "activations"})
        r_w = r_w.with_(parameters={**r_w.parameters, "layer": h.name, "part": "weights"})
        new_hidden.append(
            HiddenLayer(h.name, h.kind, act, noisy_w[:, :-1].reshape(h.incoming.shape), noisy_w[:, -1].copy())
        )
        layer_records.append(
            composite_record(
                [r_act, r_w], layer_composition, randomness=rnd, parameters={"layer": h.name}, over=layer_over
            )
        )
    out_name = specs[-1].name
    out_feats = np.concatenate(
        [graph.output_incoming.reshape(graph.output_incoming.shape[0], -1), graph.output_bias[:, None]], axis=1
    )
    noisy_out, r_out = multibit(out_feats, epsilon=eps_w, bounds=bounds[out_name], unit=unit, randomness=rnd)
    r_out = r_out.with_(parameters={**r_out.parameters, "layer": out_name, "part": "weights"})
    noisy_graph = NetworkGraph(
        graph.architecture,
        graph.input_size,
        tuple(new_hidden),
        noisy_out[:, :-1].reshape(graph.output_incoming.shape),
        noisy_out[:, -1].copy(),
    )
    record = composite_record(
        [*layer_records, r_out], "parallel", randomness=rnd, parameters={"release": "graph"}, over="neurons"
    )
    return noisy_graph, record


def perturb_model_weights(
    arch: Mapping[str, Any],
    arrays: Mapping[str, Any],
    *,
    epsilon: float,
    delta: float,
    clip_norm: float | Mapping[str, float] | None = None,
    entry_bound: float | Mapping[str, float] | None = None,
    unit: str = "neuron",
    calibration: str = "analytic",
    smoothing: bool = True,
    standardise: bool = False,
    randomness: Randomness | None = None,
) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """The Perturbation-Filter Adapter on every weight layer of a model (released weights).

    For every Linear/Conv2d, output layer included, each neuron's row [weight.reshape(units, −1),
    bias] goes through :func:`gaussian_perturbation` at (ε, δ) with the layer's public
    ``clip_norm`` and ``entry_bound`` (one value, a dict layer name → value, or None for
    :func:`default_clip_norm` / :func:`default_entry_bound`); then, if ``smoothing``,
    :func:`smoothing_filter` on the layer's weights and on its biases separately. Record: a
    ``"parallel"`` composite over ``"neurons"`` of the per-layer ``"gaussian"`` records
    (docs/mechanisms.md, "Whole networks").

    Returns arrays with the same names, shapes and dtypes (float32 stays float32), and the record.
    """
    specs = weight_layers(arch)
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    unit = _check_unit(unit)
    if calibration not in CALIBRATIONS:
        raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")
    if not isinstance(arrays, Mapping):
        raise InvalidArgument("arrays", "must be a mapping of state-dict names to arrays")
    expected = {f"{s.name}.{p}" for s in specs for p in ("weight", "bias")}
    missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing or extra:
        raise InvalidArgument("arrays", f"do not fit the architecture: missing {missing}, unexpected {extra}")
    rnd = _randomness(randomness)
    names = [s.name for s in specs]
    fan_in = {s.name: s.fan_in for s in specs}
    norms = _per_layer(clip_norm, names, "clip_norm", _positive_finite, lambda n, f: default_clip_norm(fan_in[n]))
    boxes = _per_layer(entry_bound, names, "entry_bound", _positive_finite, lambda n, f: default_entry_bound(fan_in[n]))

    out: dict[str, np.ndarray] = {}
    records = []
    for s in specs:
        w_raw, b_raw = np.asarray(arrays[f"{s.name}.weight"]), np.asarray(arrays[f"{s.name}.bias"])
        if w_raw.ndim < 2 or w_raw.shape[0] != s.units or int(np.prod(w_raw.shape[1:])) != s.fan_in:
            raise InvalidArgument(
                f"arrays[{s.name}.weight]",
                f"has shape {w_raw.shape}, the architecture needs {s.units} units × {s.fan_in} inputs",
            )
        if b_raw.shape != (s.units,):
            raise InvalidArgument(
                f"arrays[{s.name}.bias]", f"has shape {b_raw.shape}, the architecture needs ({s.units},)"
            )
        for key, arr in ((f"{s.name}.weight", w_raw), (f"{s.name}.bias", b_raw)):
            if not np.all(np.isfinite(arr)):
                raise InvalidArgument(f"arrays[{key}]", "contains NaN or infinite values")
        rows = np.concatenate([w_raw.reshape(s.units, -1), b_raw[:, None]], axis=1).astype(np.float64)
        noisy, rec = gaussian_perturbation(
            rows,
            epsilon=eps,
            delta=dlt,
            clip_norm=norms[s.name],
            entry_bound=boxes[s.name],
            unit=unit,
            calibration=calibration,
            randomness=rnd,
        )
        params = {**rec.parameters, "layer": s.name}
        if smoothing:
            sigma = rec.parameters["noise_std"]
            w_f, w_params = smoothing_filter(
                noisy[:, :-1], noise_std=sigma, entry_bound=boxes[s.name], standardise=standardise
            )
            b_f, _ = smoothing_filter(noisy[:, -1], noise_std=sigma, entry_bound=boxes[s.name], standardise=standardise)
            noisy = np.concatenate([w_f, b_f[:, None]], axis=1)
            params["smoothing"] = {**w_params, "groups": ["weight", "bias"]}
        records.append(rec.with_(parameters=params))
        out[f"{s.name}.weight"] = (
            noisy[:, :-1].reshape(w_raw.shape).astype(w_raw.dtype if w_raw.dtype.kind == "f" else np.float64)
        )
        out[f"{s.name}.bias"] = noisy[:, -1].astype(b_raw.dtype if b_raw.dtype.kind == "f" else np.float64)
    record = composite_record(records, "parallel", randomness=rnd, parameters={"release": "weights"}, over="neurons")
    return out, record
