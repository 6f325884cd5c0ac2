"""A private fusion of two sites' models, under either unit of privacy, with what the ledger
charges for it: the rows of ``privfusion experiment paper`` (``peer.experiments.paper`` on
digits, ``peer.experiments.field_study`` on breast-cancer).

Site B releases its graph features and its weights; site A matches its own exact graph against
B's released one, permutes B's released weights and fuses them with its own at α = ½ (the
paper's fusion; the REPAIRed fusion is reported beside it). :func:`private_row` reports:

- ``accuracy`` (fused, α = ½), ``accuracy_repair`` (after REPAIR on A's own records), and
  where the endpoints carry them, ``metrics`` / ``metrics_repair`` (Table IV's scores);
- ``permutation_agreement``: the fraction of B's hidden neurons that the private match maps
  as the exact-feature matcher (``match_graphs`` on both exact graphs) maps them, and
  ``above_chance``: whether that count exceeds what a uniformly random matching reaches with
  probability ``CHANCE_TAIL`` (the fixed points of L random permutations are ≈ Poisson(L)).
  Where the agreement is at chance the released weights are fused at random positions, and a
  repaired "fusion" is site A's own model with noise added;
- ``records``: the two release records exactly as the mechanisms made them (``features``:
  activations and weight features; ``weights``: the released weights), stamped with B's model
  as subject and A as counterparty, and ``charged``: what the ledger charges each of them per
  neuron (``per_neuron_record``: the ledger's own restatement of a per-entry record), and the
  two together by basic composition (both are releases about the same neurons).

The parts and their mechanisms (``MECHANISMS``): ``activations`` (ε_a; the paper's Laplace),
``weight_features`` (ε_w; the paper's multi-bit) and ``weights``, the released weights that are
fused (ε_f; the paper's Perturbation-Filter Adapter: Gaussian perturbation unit + smoothing
filter). ``ABLATION``'s single-mechanism rows apply one mechanism to all three parts (our
reading of Table III's "Laplace only", "Gaussian only", "multi-bit only"); "hybrid" is Laplace
/ multi-bit / Gaussian perturbation without the filter, "hybrid + PFA" adds the smoothing
filter. Every Gaussian part is (ε, δ)-DP at the given δ; Laplace and multi-bit are pure ε-DP.

Public: the clip bounds (``FusionConfig``: activations in [0, 2], weight features in
±2/sqrt(fan_in); released weights in ±4/sqrt(fan_in) with L2 norm 2), the probe set, the
architecture, ε and δ. The noise seeds are fixed and reported (a simulation, not a private
release).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness, make_randomness
from peer.dp.accounting.per_unit import per_neuron_record
from peer.experiments import fusion
from peer.ldp.fusion import fuse_arrays, permute_arrays
from peer.ldp.matching import match_graphs
from peer.ldp.mechanisms import (
    composite_record,
    default_clip_norm,
    default_entry_bound,
    gaussian_perturbation,
    laplace_activations,
    multibit,
    perturb_graph,
    perturb_model_weights,
)
from peer.nn.architectures import hidden_sizes, weight_layers
from peer.nn.graph import HiddenLayer, NetworkGraph

UNITS = ("entry", "neuron")
PARTS = ("activations", "weight_features", "weights")
#: what each part may be released with; ``pfa`` (weights only) is the Gaussian perturbation unit
#: followed by the smoothing filter, ``gaussian`` on weights is the perturbation unit alone
MECHANISMS = {
    "activations": ("laplace", "gaussian", "multibit"),
    "weight_features": ("laplace", "gaussian", "multibit"),
    "weights": ("laplace", "gaussian", "multibit", "pfa"),
}
#: Table III's rows: the mechanism of each part
ABLATION: dict[str, dict[str, str]] = {
    "laplace_only": {"activations": "laplace", "weight_features": "laplace", "weights": "laplace"},
    "gaussian_only": {"activations": "gaussian", "weight_features": "gaussian", "weights": "gaussian"},
    "multibit_only": {"activations": "multibit", "weight_features": "multibit", "weights": "multibit"},
    "hybrid": {"activations": "laplace", "weight_features": "multibit", "weights": "gaussian"},
    "hybrid_pfa": {"activations": "laplace", "weight_features": "multibit", "weights": "pfa"},
}
HYBRID_PFA = ABLATION["hybrid_pfa"]
#: chance level of the permutation agreement: the count a random matching exceeds with this
#: probability
CHANCE_TAIL = 1e-6
#: the records' subject (site B's model) and counterparty (site A)
SUBJECT, COUNTERPARTY = "site-b/mlp", "site-a"


@dataclass
class Endpoints:
    """One seed's two sites: their models, graphs and the exact-feature match."""

    seed: int
    arch: dict
    fusion_config: fusion.FusionConfig
    a: dict
    b: dict
    graph_a: NetworkGraph
    graph_b: NetworkGraph
    exact_permutations: list
    accuracy: Callable[[dict], float]
    repaired: Callable[[dict, float], float]
    own: dict = field(default_factory=dict)
    #: where given, every private row also carries these scores of the fused and the repaired
    #: model (Table IV's metrics: ``peer.experiments.field_study``)
    metrics: Callable[[dict], dict] | None = None
    metrics_repaired: Callable[[dict, float], dict] | None = None


def release_rows(
    mechanism: str,
    rows: np.ndarray,
    *,
    epsilon: float,
    box: tuple[float, float],
    unit: str,
    delta: float,
    randomness: Randomness,
) -> tuple[np.ndarray, ReleaseRecord]:
    """One matrix of per-neuron rows, every entry clipped to the public ``box``, released by
    ``mechanism``: ``laplace`` (L1 sensitivity (hi − lo) per entry, P·(hi − lo) per row),
    ``multibit`` (LPGNN's, over the box) or ``gaussian`` (the perturbation unit on the rows
    centred on the box's midpoint — a public shift, undone after the noise — with the box as
    its entry bound and the box's diagonal as its L2 clip, so the box alone bounds it)."""
    lo, hi = box
    if mechanism == "laplace":
        return laplace_activations(rows, epsilon=epsilon, clip=box, unit=unit, randomness=randomness)
    if mechanism == "multibit":
        return multibit(rows, epsilon=epsilon, bounds=box, unit=unit, randomness=randomness)
    if mechanism == "gaussian":
        centre, half = (lo + hi) / 2, (hi - lo) / 2
        noisy, rec = gaussian_perturbation(
            np.clip(rows, lo, hi) - centre,
            epsilon=epsilon,
            delta=delta,
            clip_norm=half * math.sqrt(rows.shape[1]),
            entry_bound=half,
            unit=unit,
            randomness=randomness,
        )
        return noisy + centre, rec.with_(parameters={**rec.parameters, "centre": centre})
    raise InvalidArgument("mechanism", f"must be one of laplace, multibit, gaussian, got {mechanism!r}")


def release_graph(
    ep: Endpoints,
    mechanisms: Mapping[str, str],
    epsilon: Mapping[str, float],
    unit: str,
    delta: float,
    randomness: Randomness,
) -> tuple[NetworkGraph, ReleaseRecord]:
    """B's graph features released with the parts' mechanisms. The paper's pair (Laplace on
    activations, multi-bit on weight features) is ``perturb_graph`` itself; any other pair
    applies :func:`release_rows` layer by layer and composes the records as ``perturb_graph``
    does (per layer: sequential per neuron, parallel over entries per entry; layers parallel
    over neurons)."""
    clip = ep.fusion_config.activation_clip
    bounds = fusion._weight_bounds(ep.arch, ep.fusion_config)
    if (mechanisms["activations"], mechanisms["weight_features"]) == ("laplace", "multibit"):
        return perturb_graph(
            ep.graph_b,
            epsilon_x=epsilon["activations"],
            epsilon_w=epsilon["weight_features"],
            activation_clip=clip,
            weight_bounds=bounds,
            unit=unit,
            randomness=randomness,
        )
    g = ep.graph_b
    layer_how, over = ("sequential", None) if unit == "neuron" else ("parallel", "entries")

    def weights_of(name, incoming, bias):
        feats = np.concatenate([incoming.reshape(incoming.shape[0], -1), bias[:, None]], axis=1)
        noisy, rec = release_rows(
            mechanisms["weight_features"],
            feats,
            epsilon=epsilon["weight_features"],
            box=bounds[name],
            unit=unit,
            delta=delta,
            randomness=randomness,
        )
        return noisy, rec.with_(parameters={**rec.parameters, "layer": name, "part": "weights"})

    hidden, records = [], []
    for h in g.hidden:
        act, r_act = release_rows(
            mechanisms["activations"],
            h.activations,
            epsilon=epsilon["activations"],
            box=clip,
            unit=unit,
            delta=delta,
            randomness=randomness,
        )
        r_act = r_act.with_(parameters={**r_act.parameters, "layer": h.name, "part": "activations"})
        w, r_w = weights_of(h.name, h.weight_features, h.bias)
        hidden.append(HiddenLayer(h.name, h.kind, act, w[:, :-1].reshape(h.incoming.shape), w[:, -1].copy()))
        records.append(
            composite_record([r_act, r_w], layer_how, randomness=randomness, parameters={"layer": h.name}, over=over)
        )
    out_name = weight_layers(ep.arch)[-1].name
    w_out, r_out = weights_of(out_name, g.output_incoming, g.output_bias)
    graph = NetworkGraph(
        g.architecture, g.input_size, tuple(hidden), w_out[:, :-1].reshape(g.output_incoming.shape), w_out[:, -1].copy()
    )
    record = composite_record(
        [*records, r_out], "parallel", randomness=randomness, parameters={"release": "graph"}, over="neurons"
    )
    return graph, record


def release_weights(
    ep: Endpoints, mechanism: str, epsilon: float, unit: str, delta: float, randomness: Randomness
) -> tuple[dict, ReleaseRecord]:
    """B's weights released for fusion: ``pfa`` / ``gaussian`` are ``perturb_model_weights``
    with / without the smoothing filter; ``laplace`` / ``multibit`` release each neuron's row
    [weights, bias] within the same public box ±4/sqrt(fan_in) (:func:`release_rows`), layers
    parallel over neurons."""
    if mechanism in ("pfa", "gaussian"):
        return perturb_model_weights(
            ep.arch, ep.b, epsilon=epsilon, delta=delta, unit=unit, smoothing=mechanism == "pfa", randomness=randomness
        )
    out, records = {}, []
    for s in weight_layers(ep.arch):
        w, bias = np.asarray(ep.b[f"{s.name}.weight"]), np.asarray(ep.b[f"{s.name}.bias"])
        c = default_entry_bound(s.fan_in)
        rows = np.concatenate([w.reshape(s.units, -1), bias[:, None]], axis=1).astype(np.float64)
        noisy, rec = release_rows(
            mechanism, rows, epsilon=epsilon, box=(-c, c), unit=unit, delta=delta, randomness=randomness
        )
        records.append(
            rec.with_(parameters={**rec.parameters, "layer": s.name, "clip_norm": default_clip_norm(s.fan_in)})
        )
        out[f"{s.name}.weight"] = noisy[:, :-1].reshape(w.shape).astype(w.dtype)
        out[f"{s.name}.bias"] = noisy[:, -1].astype(bias.dtype)
    record = composite_record(
        records, "parallel", randomness=randomness, parameters={"release": "weights"}, over="neurons"
    )
    return out, record


def chance_count(layers: int) -> int:
    """The agreement count a uniformly random matching of ``layers`` layers exceeds with
    probability at most ``CHANCE_TAIL`` (its fixed points are ≈ Poisson(layers))."""
    from scipy.stats import poisson

    return int(poisson.isf(CHANCE_TAIL, layers))


def charged(record: ReleaseRecord) -> dict[str, Any]:
    """What the ledger charges ``record`` per neuron (its own restatement), as (ε, δ)."""
    c = per_neuron_record(record)
    return {"epsilon": float(c.epsilon), "delta": float(c.delta)}


def private_row(
    ep: Endpoints,
    mechanisms: Mapping[str, str],
    epsilon: Mapping[str, float],
    unit: str,
    delta: float,
    noise_seed: int,
) -> dict[str, Any]:
    """One private fusion: B releases features and weights, A matches, fuses at α = ½ and
    repairs (module docstring for every field)."""
    randomness = make_randomness(noise_seed)
    noisy_graph, r_features = release_graph(ep, mechanisms, epsilon, unit, delta, randomness)
    noisy_b, r_weights = release_weights(ep, mechanisms["weights"], epsilon["weights"], unit, delta, randomness.spawn())
    # what a release desk would stamp: B's model is the subject, A the counterparty
    r_features, r_weights = (r.with_(subject=SUBJECT, counterparty=COUNTERPARTY) for r in (r_features, r_weights))
    found = match_graphs(ep.graph_a, noisy_graph).permutations
    b_aligned = permute_arrays(ep.arch, noisy_b, found)
    same = sum(int(np.sum(np.asarray(p) == np.asarray(q))) for p, q in zip(found, ep.exact_permutations, strict=True))
    total = sum(hidden_sizes(ep.arch))
    per_neuron = {"features": charged(r_features), "weights": charged(r_weights)}
    per_neuron["total"] = {
        "epsilon": per_neuron["features"]["epsilon"] + per_neuron["weights"]["epsilon"],
        "delta": min(1.0, per_neuron["features"]["delta"] + per_neuron["weights"]["delta"]),
    }
    scores = {}
    if ep.metrics is not None and ep.metrics_repaired is not None:
        scores = {
            "metrics": ep.metrics(fuse_arrays(ep.a, b_aligned, 0.5)),
            "metrics_repair": ep.metrics_repaired(b_aligned, 0.5),
        }
    return {
        **scores,
        "seed": ep.seed,
        "noise_seed": noise_seed,
        "unit": unit,
        "mechanisms": dict(mechanisms),
        "epsilon": {p: float(epsilon[p]) for p in PARTS},
        "accuracy": ep.accuracy(fuse_arrays(ep.a, b_aligned, 0.5)),
        "accuracy_repair": ep.repaired(b_aligned, 0.5),
        "permutation_agreement": same / total,
        "above_chance": same > chance_count(len(ep.exact_permutations)),
        "records": {"features": r_features.to_dict(), "weights": r_weights.to_dict()},
        "record_epsilon": {"features": float(r_features.epsilon), "weights": float(r_weights.epsilon)},
        "charged": per_neuron,
    }


__all__ = [
    "ABLATION",
    "CHANCE_TAIL",
    "COUNTERPARTY",
    "HYBRID_PFA",
    "MECHANISMS",
    "PARTS",
    "SUBJECT",
    "UNITS",
    "Endpoints",
    "chance_count",
    "charged",
    "private_row",
    "release_graph",
    "release_rows",
    "release_weights",
]
