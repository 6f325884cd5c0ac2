"""Matching two networks of one permutation structure, group by group (non-private baseline).

The layered spectral matcher (``peer.ldp.matching``) aligns chains of hidden layers. A network
with residual streams and normalisation has permutation *groups* instead
(``peer.nn.tracing``): one group may be written by several layers and read by several others.
This module aligns such networks with the two signals a group has:

* **activations** — each group element's responses on a probe set, pooled over the group's
  member tensors: the outputs of every module writing into the group (its producers and its
  BatchNorms), each averaged over spatial positions, concatenated along the probe axis (so a
  node's feature row has length P · members). The similarity of A's unit i and B's unit j is
  the correlation of their standardised rows, S_act[i, j] ∈ [−1, 1] (the signal of
  activation matching, Jordan et al., REPAIR, ICLR 2023, §4);
* **weights** — Git Re-Basin's weight matching over permutation specs (Ainsworth et al., 2023,
  Alg. 1): for group g, with every other group's current permutation applied to B,
  S_w[i, j] = Σ_{(p, axis) ∈ g} ⟨W_A[p] unfolded along axis at unit i, W_B[p] … at unit j⟩,
  each term divided by its largest magnitude so that parameters of any scale count alike.

It maximises Σ_g tr(P_gᵀ (S_act + S_w)) by coordinate descent: start from the activation
matching, then sweep the groups in a seeded random order, solving each group's linear
assignment (Hungarian, ``scipy.optimize.linear_sum_assignment``) with the others held, until a
sweep changes nothing or ``sweeps`` is reached. Input and output units are fixed (they are in
no group). Result convention as everywhere: ``perm[g][i] = j`` says unit i of A is unit j of B.

What it reads: both sites' exact activations and weights — the non-private baseline for
networks the layered matcher cannot take yet (local-DP release of group features is not
implemented here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.graph import extract_group_graph
from peer.nn.tracing import PermutationStructure, permute_state


def group_activations(module: nn.Module, structure: PermutationStructure, probe_x) -> dict[str, np.ndarray]:
    """For every group, its (n, P · members) activation rows
    (:func:`peer.nn.graph.extract_group_graph`)."""
    return {g.name: g.activations for g in extract_group_graph(module, structure, probe_x).groups}


def _correlation(fa: np.ndarray, fb: np.ndarray) -> np.ndarray:
    def standardise(f):
        f = f - f.mean(axis=1, keepdims=True)
        norm = np.linalg.norm(f, axis=1, keepdims=True)
        return f / np.where(norm > 0, norm, 1.0)

    return standardise(fa) @ standardise(fb).T


def _unfold(t: np.ndarray, axis: int, size: int) -> np.ndarray:
    return np.moveaxis(np.asarray(t, dtype=np.float64), axis, 0).reshape(size, -1)


def match_groups(
    structure: PermutationStructure,
    arrays_a: Mapping[str, Any],
    arrays_b: Mapping[str, Any],
    activations_a: Mapping[str, np.ndarray] | None = None,
    activations_b: Mapping[str, np.ndarray] | None = None,
    *,
    sweeps: int = 30,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Permutations of B's groups aligning it to A (see the module docstring)."""
    structure.check_arrays(arrays_a, "arrays_a")
    structure.check_arrays(arrays_b, "arrays_b")
    act = {}
    for g in structure.groups:
        if activations_a is not None and activations_b is not None:
            fa, fb = np.asarray(activations_a[g.name]), np.asarray(activations_b[g.name])
            if fa.shape != fb.shape or fa.shape[0] != g.size:
                raise InvalidArgument(f"activations[{g.name}]", f"must both be ({g.size}, P) arrays of one shape")
            act[g.name] = _correlation(fa, fb)
        else:
            act[g.name] = np.zeros((g.size, g.size))
    perms = {g.name: linear_sum_assignment(-act[g.name])[1] for g in structure.groups}
    rng = np.random.default_rng(seed)
    for _ in range(sweeps):
        changed = False
        for k in rng.permutation(len(structure.groups)):
            g = structure.groups[k]
            others = {name: p for name, p in perms.items() if name != g.name}
            b_rest = permute_state(structure, arrays_b, others)
            score = act[g.name].copy()
            for ax in g.axes:
                wa = _unfold(arrays_a[ax.param], ax.axis, g.size)
                wb = _unfold(b_rest[ax.param], ax.axis, g.size)
                term = wa @ wb.T
                scale = np.abs(term).max()
                if scale > 0:
                    score += term / scale
            new = linear_sum_assignment(-score)[1]
            if not np.array_equal(new, perms[g.name]):
                perms[g.name] = new
                changed = True
        if not changed:
            break
    return perms


def fuse_state(
    structure: PermutationStructure, arrays_a: Mapping[str, Any], arrays_b_aligned: Mapping[str, Any], alpha: float
) -> dict[str, np.ndarray]:
    """α·A + (1 − α)·B_aligned on every floating-point entry of the state (weights, biases,
    BatchNorm affine and running statistics); integer buffers (``num_batches_tracked``) keep A's."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidArgument("alpha", f"must lie in [0, 1], got {alpha}")
    out = {}
    for k in structure.parameters:
        a, b = np.asarray(arrays_a[k]), np.asarray(arrays_b_aligned[k])
        out[k] = (alpha * a + (1 - alpha) * b).astype(a.dtype) if np.issubdtype(a.dtype, np.floating) else a.copy()
    return out
