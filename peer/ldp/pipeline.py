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
