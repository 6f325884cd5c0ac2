"""The *make* step of the release desk: the core's mechanisms with a site's public defaults.

Each function computes one release of one kind from a site's state (``site``: anything with the
attributes of ``peer.net.site.Site`` that are read here — ``randomness()``, ``config.calibration``,
``own_module()``, ``pool()``, ``pool_selection()``, ``pool_validation()``, ``rs_utilities()``)
and returns its tensors with their release record. Nothing here is charged, stored, signed or
sent: that is :class:`peer.desk.desk.ReleaseDesk`'s, which is the only caller of these for a
release that leaves. Noise comes from ``site.randomness()``: a fresh CSPRNG stream per release
(or, for a simulation, the next child of its fixed seed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.ldp.mechanisms import composite_record, perturb_graph, perturb_model_weights
from peer.nn.graph import NetworkGraph, extract_graph
from peer.nn.store import StoredModel


@dataclass(frozen=True)
class FeaturesRelease:
    """Noisy graph features of a model on a probe set and, when asked for, its perturbed
    unpermuted weights; ``record`` covers both (a sequential composite), not yet stamped."""

    graph: NetworkGraph
    weights: dict[str, np.ndarray] | None
    record: ReleaseRecord


@dataclass(frozen=True)
class GroupFeaturesRelease:
    """Noisy features of a site's own network (``peer.nn.imported``) over its permutation
    groups: each group's activation rows (Laplace), every parameter's multi-bit weight features
    (the site's key names and shapes) and, when asked for, its PFA weights; ``record`` covers
    all (a sequential composite; one unit = one group element), not yet stamped."""

    architecture: Mapping[str, Any]
    activations: dict[str, np.ndarray]
    features: dict[str, np.ndarray]
    weights: dict[str, np.ndarray] | None
    record: ReleaseRecord


def stamp(record: ReleaseRecord, caller: str, subject: str, **parameters: Any) -> ReleaseRecord:
    """``record`` as released to ``caller``: its counterparty, its subject (model or pool) and
    the request's public parameters added to the mechanism's."""
    params = dict(record.parameters)
    params.update(parameters)
    return record.with_(counterparty=caller, subject=subject, parameters=params)


def perturbed_weights(site, stored: StoredModel, epsilon: float, delta: float, randomness: Randomness | None = None):
    """PFA-perturbed, unpermuted weights of ``stored`` ((ε, δ) per neuron, the site's
    Gaussian calibration) and their record. A site's own network: per group element
    (``peer.ldp.mechanisms.groups.perturb_group_weights``), under the site's key names."""
    from peer.nn.imported import ImportedModel

    if isinstance(stored, ImportedModel):
        from peer.ldp.mechanisms.groups import perturb_group_weights

        # the structure alone cannot show that two keys name one tensor (a model stored
        # before imports refused that): the site's own module is built to check it
        site.own_module(stored)
        return perturb_group_weights(
            stored.structure,
            stored.arrays,
            epsilon=epsilon,
            delta=delta,
            calibration=site.config.calibration,
            randomness=randomness or site.randomness(),
        )
    return perturb_model_weights(
        stored.architecture,
        stored.arrays,
        epsilon=epsilon,
        delta=delta,
        calibration=site.config.calibration,
        randomness=randomness or site.randomness(),
    )


def features(
    site,
    stored: StoredModel,
    probe: np.ndarray,
    *,
    activation_epsilon: float,
    weight_epsilon: float,
    activation_clip: tuple[float, float] | None,
    weight_bounds: tuple[float, float] | None = None,
    unit: str = "neuron",
    weights: tuple[float, float] | None = None,
    release: str = "features+weights",
) -> FeaturesRelease | GroupFeaturesRelease:
    """Noisy graph features of ``stored`` on ``probe`` (Laplace on activations clipped to
    ``activation_clip``, multi-bit on weight features, per ``unit``) and, with ``weights`` =
    (ε, δ), its perturbed weights from the same randomness stream. Both parts touch every
    neuron, so they compose sequentially into one record (``parameters.release`` =
    ``release``): one release, one charge, and a refusal of either leaves nothing charged.

    A site's own network (``ImportedModel``) is released per permutation-group element
    instead (:func:`group_features`)."""
    from peer.nn.imported import ImportedModel

    if isinstance(stored, ImportedModel):
        if unit != "neuron":
            raise InvalidArgument("unit", "a site's own network is released per group element only ('neuron')")
        if weight_bounds is not None:
            raise InvalidArgument(
                "weight_bound",
                "a site's own network's weight features use each parameter's public scale; leave it unset",
            )
        return group_features(
            site,
            stored,
            probe,
            activation_epsilon=activation_epsilon,
            weight_epsilon=weight_epsilon,
            activation_clip=activation_clip,
            weights=weights,
        )
    graph = extract_graph(stored.architecture, stored.module(), probe)
    rnd = site.randomness()
    noisy, record = perturb_graph(
        graph,
        epsilon_x=activation_epsilon,
        epsilon_w=weight_epsilon,
        activation_clip=activation_clip,
        weight_bounds=weight_bounds,
        unit=unit,
        randomness=rnd,
    )
    arrays = None
    if weights is not None:
        arrays, weights_record = perturbed_weights(site, stored, *weights, randomness=rnd)
        record = composite_record(
            [record, weights_record], "sequential", randomness=rnd, parameters={"release": release}
        )
    return FeaturesRelease(noisy, arrays, record)


def group_features(
    site,
    own,
    probe: np.ndarray,
    *,
    activation_epsilon: float,
    weight_epsilon: float,
    activation_clip: tuple[float, float] | None,
    weights: tuple[float, float] | None = None,
) -> GroupFeaturesRelease:
    """Noisy features of a site's own network on ``probe`` (rows of its input), one unit =
    one group element (``peer.ldp.mechanisms.groups``): Laplace on each group element's
    activation rows (its P·m responses at the group's m member modules, clipped to
    ``activation_clip``: Δ₁ = P·m·(hi − lo)), the multi-bit mechanism on its weight-feature
    row (its slices of every parameter it owns, over their public scales) and, with
    ``weights`` = (ε, δ), the PFA on the same rows — all from one randomness stream. Every
    part touches every group element, so they compose sequentially into one record: one
    release, one charge."""
    from peer.ldp.group_matching import group_activations
    from peer.ldp.mechanisms.groups import perturb_group_activations, perturb_group_weight_features
    from peer.nn.imported import imported_architecture, input_batch

    if activation_clip is None:
        raise InvalidArgument(
            "activation_clip",
            "is required for a site's own network (its group members are unbounded pre-activations): "
            "give a public range, or set [site.mechanisms] activation_clip",
        )
    acts = group_activations(site.own_module(own), own.structure, input_batch(own.structure, probe))
    rnd = site.randomness()
    noisy_acts, r_act = perturb_group_activations(
        acts, epsilon=activation_epsilon, clip=activation_clip, randomness=rnd
    )
    features, r_w = perturb_group_weight_features(own.structure, own.arrays, epsilon=weight_epsilon, randomness=rnd)
    parts = [r_act, r_w]
    arrays = None
    if weights is not None:
        arrays, r_pfa = perturbed_weights(site, own, *weights, randomness=rnd)
        parts.append(r_pfa)
    record = composite_record(
        parts,
        "sequential",
        randomness=rnd,
        parameters={
            "release": "group_features" if weights is None else "group_features+weights",
            "unit_is": "one group element",
        },
    )
    return GroupFeaturesRelease(imported_architecture(own.structure), noisy_acts, features, arrays, record)


def weights(
    site, stored: StoredModel, epsilon: float, delta: float, caller: str, on_behalf_of: str | None = None
) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """Perturbed weights for ``caller``, always unpermuted: a requester aligns them itself,
    so its match never leaves it. The record is stamped. A site's own network: the PFA per
    group element (:func:`perturbed_weights`), under the site's key names."""
    arrays, record = perturbed_weights(site, stored, epsilon, delta)
    return arrays, stamp(record, caller, stored.name, **({"on_behalf_of": on_behalf_of} if on_behalf_of else {}))


def merge(site, pool: str, method: str, epsilon: float, delta: float, caller: str):
    """An RS or LC merge of ``pool`` at (ε, δ) for ``caller`` (``peer.dp.pools.merge_pool``:
    π / λ from public information, or — for a pool with selection = "utility" — from
    candidates scored on the pool's validation split and charged as such), its record
    stamped. Not stored, not charged: ``ReleaseDesk`` is what the service serves."""
    # lazy: peer.dp loads dp_accounting (slow to import); the site has pools, so it is loaded
    from peer.dp.pools import merge_pool

    members = site.pool(pool)
    scored = site.pool_selection(pool) == "utility"
    return merge_pool(
        members,
        method,
        epsilon,
        delta,
        selection=site.pool_selection(pool),
        validation=site.pool_validation(pool) if scored else None,
        utilities=site.rs_utilities(pool) if scored and method == "rs" else None,
        randomness=site.randomness(),
        subject=pool,
        counterparty=caller,
    )
