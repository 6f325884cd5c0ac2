"""Features → match → weights, written once: how a partner's model is lined up with ours.

Every place that fuses a partner's model does the same three steps (the relay ``Fuse`` of
``peer.net.site``, the ``ldp`` and ``merged`` steps of a coordinator-free round, the
simulator's non-private oracle):

1. **match** our graph with theirs (``peer.ldp.matching.match_graphs``: one permutation per
   hidden layer, ``perm[ℓ][i] = j`` — our node i ↔ their node j);
2. **permute** their weights by it (``peer.ldp.fusion.permute_arrays``: rows of the layer
   producing ℓ, columns of the next; the network function is unchanged);
3. **fuse**: α·θ_own + (1 − α)·P(θ_theirs) for two models (``fuse_arrays``), or a weighted
   average over several aligned models (``average_arrays``), which the caller does.

Pure functions over graphs and arrays: no I/O, no randomness. What they read decides what is
private: for a remote model pass its *released* (noisy) graph and weights — matching, permuting
and fusing are then post-processing of noisy releases and cost no further privacy. The
permutations are computed from our own graph, so they stay with the site that computed them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.ldp.fusion import fuse_arrays, permute_arrays
from peer.ldp.matching import MatchOptions, MatchResult, match_graphs
from peer.nn.graph import NetworkGraph

__all__ = ["Alignment", "align", "align_and_fuse", "align_graphs", "align_groups", "average_states", "repair_states"]


@dataclass(frozen=True)
class Alignment:
    """How their hidden units line up with ours: one ``int64`` permutation per hidden layer
    (``permutations[ℓ][i] = j``: our node i ↔ their node j) and the matcher's full result
    (objective xᵀKx, solver, iterations, convergence)."""

    permutations: tuple[np.ndarray, ...]
    match: MatchResult

    @property
    def objective(self) -> float:
        return float(self.match.objective)

    def apply(self, architecture: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Their weights re-indexed so that their hidden nodes line up with ours (a copy)."""
        return permute_arrays(architecture, arrays, self.permutations)


def align_graphs(own: NetworkGraph, theirs: NetworkGraph, options: MatchOptions | None = None) -> Alignment:
    """Step 1 alone, for callers that ask for the weights only once the match has succeeded (a
    round's ``ldp`` step: features first, so that a partner whose features cannot be aligned
    is not asked to spend budget on its weights)."""
    result = match_graphs(own, theirs, options)
    return Alignment(tuple(np.asarray(p, dtype=np.int64) for p in result.permutations), result)


def align(
    architecture: Mapping[str, Any],
    own: NetworkGraph,
    theirs: NetworkGraph,
    their_arrays: Mapping[str, np.ndarray],
    options: MatchOptions | None = None,
) -> tuple[dict[str, np.ndarray], Alignment]:
    """Steps 1 and 2: their weights aligned to our model, and the alignment that did it."""
    alignment = align_graphs(own, theirs, options)
    return alignment.apply(architecture, their_arrays), alignment


def align_and_fuse(
    architecture: Mapping[str, Any],
    own: NetworkGraph,
    own_arrays: Mapping[str, np.ndarray],
    theirs: NetworkGraph,
    their_arrays: Mapping[str, np.ndarray],
    alpha: float,
    options: MatchOptions | None = None,
) -> tuple[dict[str, np.ndarray], Alignment]:
    """Steps 1–3 for two models: W = α·W_own + (1 − α)·P(W_theirs) for every weight and bias
    (α ∈ [0, 1], the fusion scale), and the alignment P."""
    aligned, alignment = align(architecture, own, theirs, their_arrays, options)
    return fuse_arrays(own_arrays, aligned, alpha), alignment


# ---------------------------------------------------------------------------------------------
# A site's own network: the same three steps over permutation groups (peer.nn.tracing)


@dataclass(frozen=True)
class GroupAlignment:
    """How their units line up with ours, group by group: ``permutations[g][i] = j`` (our unit
    i of group g ↔ their unit j). Stays with the site that computed it."""

    permutations: Mapping[str, np.ndarray]

    def apply(self, structure, arrays: Mapping[str, Any]) -> dict[str, Any]:
        from peer.nn.tracing import permute_state

        return permute_state(structure, arrays, self.permutations)


def align_groups(structure, own_module, theirs_module, probe_x) -> GroupAlignment:
    """Step 1 for two networks of one permutation structure: activation matching
    (``peer.ldp.group_matching.group_correlations`` + ``match_correlations``: each group's units
    paired by their correlation over every probe record and position, read where the next layer
    reads them — REPAIR's matching signal; on two digits ResNets it fuses, after REPAIR, to
    80 / 85% where the older ``match_groups`` signal gave 53 / 72%). ``theirs_module`` is *our
    own* module class holding the state dict we received (a DP release: reading it is
    post-processing); ``probe_x`` is the public probe set shaped as the network's input."""
    from peer.ldp.group_matching import group_correlations, match_correlations

    perms = match_correlations(structure, group_correlations(own_module, theirs_module, structure, probe_x))
    return GroupAlignment({g: np.asarray(p, dtype=np.int64) for g, p in perms.items()})


def average_states(structure, states, weights) -> dict[str, np.ndarray]:
    """Σ_k w_k·θ_k on every floating-point entry of aligned states (weights, biases, BatchNorm
    affine and running statistics, in each entry's own dtype); integer buffers
    (``num_batches_tracked``) keep the first state's (ours). Weights non-negative, summing to 1."""
    from peer.base.errors import InvalidArgument

    w = np.asarray(weights, dtype=np.float64)
    if len(states) == 0 or len(states) != len(w) or np.any(~np.isfinite(w)) or np.any(w < 0) or abs(w.sum() - 1) > 1e-9:
        raise InvalidArgument("weights", f"need one non-negative weight per state, summing to 1; got {list(weights)}")
    out = {}
    for k in structure.parameters:
        first = np.asarray(states[0][k])
        if not np.issubdtype(first.dtype, np.floating):
            out[k] = first.copy()
            continue
        total = sum(float(wi) * np.asarray(s[k], dtype=np.float64) for wi, s in zip(w, states, strict=True))
        out[k] = np.asarray(total, dtype=first.dtype)
    return out


def repair_states(structure, fused_module, endpoints, weights, x):
    """REPAIR of a multi-model fusion (``peer.ldp.repair``): every affine statistic point's
    target moments are the weighted average Σ_k w_k·(μ_k, σ_k) of the endpoints' (each measured
    on ``x``: data the requester may use — its records, or the public probe set), BatchNorm
    running statistics are reset to the fused network's own on ``x``. Returns the repaired
    module (a copy)."""
    from peer.ldp.repair import UnitStatistics, repair, unit_statistics

    points = [p for p in structure.stat_points if p.kind == "affine"]
    stats = [unit_statistics(m, points, x) for m in endpoints]
    targets = {
        p.module: UnitStatistics(
            sum(float(w) * s[p.module].mean for w, s in zip(weights, stats, strict=True)),
            sum(float(w) * s[p.module].std for w, s in zip(weights, stats, strict=True)),
        )
        for p in points
    }
    return repair(fused_module, structure.stat_points, targets, x)
