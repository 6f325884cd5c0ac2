"""Core objects as they travel, and back: the one place that knows the tensor names.

A release carries named tensors (``peer.net.wire`` streams them, dtype and shape and raw
little-endian bytes) plus a JSON manifest of public facts. This module maps the core's objects
onto those names and checks what comes back before the core sees it:

* a (noisy) ``NetworkGraph`` ↔ ``hidden.<layer>.activations|incoming|bias``,
  ``output.incoming``, ``output.bias`` plus ``{"input_size", "layers"}`` in the metadata
  (:func:`graph_tensors`, :func:`graph_from_release`);
* released weights ↔ ``weights.<state-dict name>`` beside a graph's tensors
  (:func:`weights_tensors`, :func:`weights_from_release`);
* a site's own network (``peer.nn.imported``) released over its permutation groups ↔
  ``groups.<group>.activations``, ``features.<state-dict name>`` (multi-bit weight features)
  and, in a "features+weights" release, ``weights.<state-dict name>`` plus
  ``{"release": "group_features", "groups": [...], "probe_rows": P}`` in the metadata
  (:func:`group_features_tensors`, :func:`group_features_from_release`,
  :func:`group_weights_from_release`);
* a site's description of itself (``peer.net.peer_info.SiteInfo``) → the ``privfusion.v1.PeerInfo``
  message: :func:`peer.net.messages.peer_info_message`, importable from here too (the answers
  of the light calls, in both directions, are ``peer.net.messages``).

Every check names the tensor or field at fault (InvalidArgument); shapes follow from the
public architecture, so a release that does not fit it is refused before any matching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.desk.make import GroupFeaturesRelease
from peer.net.messages import peer_info_message
from peer.nn.architectures import validate_architecture, weight_layers
from peer.nn.graph import HiddenLayer, NetworkGraph

__all__ = [
    "features_tensors",
    "graph_from_release",
    "graph_tensors",
    "group_features_from_release",
    "group_features_tensors",
    "group_weights_from_release",
    "peer_info_message",
    "weights_from_release",
    "weights_tensors",
]

WEIGHTS_PREFIX = "weights."
GROUPS_PREFIX = "groups."
FEATURES_PREFIX = "features."
ACTIVATIONS_SUFFIX = ".activations"


# ------------------------------------------------------------------------ graph <-> tensors


def graph_tensors(graph: NetworkGraph) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """A (noisy) graph as named tensors plus the public facts needed to rebuild it."""
    tensors: list[tuple[str, np.ndarray]] = []
    for h in graph.hidden:
        tensors += [
            (f"hidden.{h.name}.activations", h.activations),
            (f"hidden.{h.name}.incoming", h.incoming),
            (f"hidden.{h.name}.bias", h.bias),
        ]
    tensors += [("output.incoming", graph.output_incoming), ("output.bias", graph.output_bias)]
    meta = {"input_size": graph.input_size, "layers": [{"name": h.name, "kind": h.kind} for h in graph.hidden]}
    return tensors, meta


def graph_from_release(
    architecture: Mapping[str, Any], metadata: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> NetworkGraph:
    """Rebuild a graph sent by :func:`graph_tensors` (checks names and shapes)."""
    try:
        layers = [(str(layer["name"]), str(layer["kind"])) for layer in metadata["layers"]]
        input_size = int(metadata["input_size"])
        hidden = tuple(
            HiddenLayer(
                name,
                kind,
                np.asarray(arrays[f"hidden.{name}.activations"]),
                np.asarray(arrays[f"hidden.{name}.incoming"]),
                np.asarray(arrays[f"hidden.{name}.bias"]),
            )
            for name, kind in layers
        )
        graph = NetworkGraph(
            validate_architecture(architecture),
            input_size,
            hidden,
            np.asarray(arrays["output.incoming"]),
            np.asarray(arrays["output.bias"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument("release", f"is not a graph release: {e}") from None
    prev = input_size
    for h in graph.hidden:
        n = h.incoming.shape[0] if h.incoming.ndim == 3 else -1
        if h.incoming.ndim != 3 or h.incoming.shape[1] != prev or h.activations.shape[0] != n or h.bias.shape != (n,):
            raise InvalidArgument(f"tensor[hidden.{h.name}]", "shapes do not form a layered graph")
        prev = n
    if graph.output_incoming.ndim != 3 or graph.output_incoming.shape[1] != prev:
        raise InvalidArgument("tensor[output.incoming]", "shape does not fit the last hidden layer")
    return graph


# ------------------------------------------------------------------------ weights <-> tensors


def weights_tensors(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """Released weights as named tensors beside a graph's (``weights.<state-dict name>``)."""
    return [(WEIGHTS_PREFIX + k, arrays[k]) for k in sorted(arrays)]


def features_tensors(
    graph: NetworkGraph, weights: Mapping[str, np.ndarray] | None = None
) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """A features release: the graph's tensors, and with ``weights`` (a "features+weights"
    release) the weights' tensors after them, listed in the metadata under ``"weights"``."""
    tensors, meta = graph_tensors(graph)
    if weights is not None:
        named = weights_tensors(weights)
        tensors += named
        meta = {**meta, "weights": [k for k, _ in named]}
    return tensors, meta


def weights_from_release(architecture: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights of a "features+weights" release, checked against the architecture."""
    got = {k[len(WEIGHTS_PREFIX) :]: np.asarray(v) for k, v in arrays.items() if k.startswith(WEIGHTS_PREFIX)}
    for s in weight_layers(architecture):
        w, b = got.get(f"{s.name}.weight"), got.get(f"{s.name}.bias")
        if w is None or b is None:
            raise InvalidArgument(
                "release", f"holds no weights of layer {s.name!r} (tensors {WEIGHTS_PREFIX}{s.name}.weight/.bias)"
            )
        if w.ndim < 2 or w.shape[0] != s.units or math.prod(w.shape[1:]) != s.fan_in or b.shape != (s.units,):
            raise InvalidArgument(
                f"tensor[{WEIGHTS_PREFIX}{s.name}]",
                f"shapes {list(w.shape)}, {list(b.shape)} do not fit the architecture",
            )
        if w.dtype.kind != "f" or b.dtype.kind != "f" or not (np.all(np.isfinite(w)) and np.all(np.isfinite(b))):
            raise InvalidArgument(f"tensor[{WEIGHTS_PREFIX}{s.name}]", "must hold finite floating-point values")
    expected = {f"{s.name}.{p}" for s in weight_layers(architecture) for p in ("weight", "bias")}
    if set(got) != expected:
        raise InvalidArgument("release", f"holds unexpected weight tensors {sorted(set(got) - expected)}")
    return got


# ------------------------------------------------------------------------ a site's own network


def group_features_tensors(release: GroupFeaturesRelease, probe_rows: int) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """A release of a site's own network over its permutation groups as named tensors: each
    group's noisy activation rows (``groups.<g>.activations``, ``(size, P·members)``), every
    state-dict entry's multi-bit weight features (``features.<name>``, the site's shape), then,
    with weights, ``weights.<name>``. The metadata lists the groups and the probe rows (public)."""
    tensors = [(f"{GROUPS_PREFIX}{g}{ACTIVATIONS_SUFFIX}", a) for g, a in release.activations.items()]
    tensors += [(FEATURES_PREFIX + k, release.features[k]) for k in sorted(release.features)]
    meta: dict[str, Any] = {
        "release": "group_features",
        "groups": list(release.activations),
        "probe_rows": int(probe_rows),
    }
    if release.weights is not None:
        named = weights_tensors(release.weights)
        tensors += named
        meta["weights"] = [k for k, _ in named]
    return tensors, meta


def _finite(name: str, a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
        raise InvalidArgument(f"tensor[{name}]", "must hold finite values")
    return a


def _state_from(structure, arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    got = {k[len(prefix) :]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}
    structure.check_arrays(got, f"tensors {prefix}*" if prefix else "tensors")
    for k, v in got.items():
        if v.dtype.kind not in "fiu":
            raise InvalidArgument(f"tensor[{prefix}{k}]", "must hold numbers")
        _finite(prefix + k, v)
    return got


def group_features_from_release(
    structure, metadata: Mapping[str, Any], arrays: Mapping[str, np.ndarray], probe_rows: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(activations by group, multi-bit weight features by state-dict name) of a release made by
    :func:`group_features_tensors`, checked against OUR structure (the caller has checked the
    release's structure digest is ours): every group present with ``(size, probe_rows ·
    members)`` finite rows, every state-dict entry with its shape, and nothing else."""
    from peer.nn.graph import group_members

    if metadata.get("release") != "group_features":
        raise InvalidArgument("release", "is not a release of a site's own network over permutation groups")
    members = group_members(structure)
    acts = {}
    for g in structure.groups:
        name = f"{GROUPS_PREFIX}{g.name}{ACTIVATIONS_SUFFIX}"
        if name not in arrays:
            raise InvalidArgument("release", f"holds no activations of group {g.name!r} (tensor {name})")
        a = np.asarray(arrays[name])
        want = (g.size, int(probe_rows) * len(members[g.name]))
        if a.shape != want or a.dtype.kind != "f":
            raise InvalidArgument(f"tensor[{name}]", f"must be a floating-point {want} array, got {list(a.shape)}")
        acts[g.name] = _finite(name, a)
    extra = [
        k
        for k in arrays
        if k.startswith(GROUPS_PREFIX) and k[len(GROUPS_PREFIX) : -len(ACTIVATIONS_SUFFIX)] not in acts
    ]
    if extra:
        raise InvalidArgument("release", f"holds tensors of unknown groups {sorted(extra)}")
    return acts, _state_from(structure, arrays, FEATURES_PREFIX)


def group_weights_from_release(structure, arrays: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """The PFA weights of a site's own network — a "weights" release (the site's key names,
    ``prefix`` "") or the ``weights.`` tensors of a "features+weights" one — checked against
    OUR structure: every state-dict entry with its shape, finite, nothing else."""
    return _state_from(structure, arrays, prefix)
