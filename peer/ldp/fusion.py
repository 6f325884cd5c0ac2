"""Fusion in weight space, and the baselines PrivFusion is compared against.

Permutation convention (shared with ``peer.ldp.matching``): for every hidden layer ℓ, ``perm[ℓ][i] =
j`` says node i of model A corresponds to node j of model B, so B aligned to A is B's layer
re-indexed by ``perm``. Applying it to a network (Ainsworth et al., Git Re-Basin, 2023, §2):
the rows (output units / output channels) of the weight layer producing ℓ and its bias are
re-indexed by perm[ℓ]; the columns (input units / input channels) of the next weight layer are
re-indexed by the same perm[ℓ]. For the last conv block → first Linear the Flatten is
channel-major, so the H·W columns of each channel move together. The network function is
unchanged (``test_fusion`` checks this). Input and output layers are never permuted.

α-scaled fusion (PrivFusion): W = α·W_A + (1 − α)·P(W_B) for every weight and bias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.extras import LazyModule
from peer.nn.architectures import WeightLayer, hidden_sizes, model_from_arrays, predict_proba, weight_layers

_optimize = LazyModule("scipy.optimize")  # imported at the first assignment (~0.8 s of CPU to import)

__all__ = [
    "average_arrays",
    "ensemble_proba",
    "fuse_arrays",
    "fuse_many",
    "permute_arrays",
    "vanilla_average",
    "weight_matching",
]


def check_permutations(arch: Mapping[str, Any], permutations: Sequence[np.ndarray]) -> list[np.ndarray]:
    sizes = hidden_sizes(arch)
    if len(permutations) != len(sizes):
        raise InvalidArgument("permutations", f"need one per hidden layer ({len(sizes)}), got {len(permutations)}")
    out = []
    for i, (p, n) in enumerate(zip(permutations, sizes, strict=True)):
        p = np.asarray(p)
        if p.shape != (n,) or not np.issubdtype(p.dtype, np.integer) or not np.array_equal(np.sort(p), np.arange(n)):
            raise InvalidArgument(f"permutations[{i}]", f"must be a permutation of 0..{n - 1}")
        out.append(p.astype(np.int64))
    return out


def _permute_input_axis(w: np.ndarray, perm: np.ndarray, layer: WeightLayer) -> np.ndarray:
    """The layer's weight with its input nodes re-indexed by perm (a channel's kernel, or its H·W
    columns after Flatten, move together)."""
    if layer.kind == "conv" or layer.entries_per_input == 1:
        return w[:, perm]
    n_out = w.shape[0]
    blocks = w.reshape(n_out, -1, layer.entries_per_input)
    return blocks[:, perm, :].reshape(n_out, -1)


def permute_arrays(
    arch: Mapping[str, Any], arrays: Mapping[str, np.ndarray], permutations: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """Model B's arrays re-indexed so that its hidden nodes line up with model A's."""
    perms = check_permutations(arch, permutations)
    layers = weight_layers(arch)
    out = {k: np.array(v, copy=True) for k, v in arrays.items()}
    for idx, layer in enumerate(layers):
        w, b = f"{layer.name}.weight", f"{layer.name}.bias"
        if w not in out or b not in out:
            raise InvalidArgument("arrays", f"missing {w} or {b}")
        if idx < len(perms):  # this layer produces hidden layer idx
            out[w] = out[w][perms[idx]]
            out[b] = out[b][perms[idx]]
        if idx > 0:  # its inputs are hidden layer idx-1
            out[w] = _permute_input_axis(out[w], perms[idx - 1], layer)
    return out


def _check_same_shapes(arrays_a: Mapping[str, np.ndarray], arrays_b: Mapping[str, np.ndarray]) -> None:
    if set(arrays_a) != set(arrays_b):
        raise InvalidArgument("arrays", f"models have different parameters: {sorted(set(arrays_a) ^ set(arrays_b))}")
    for k in arrays_a:
        if np.shape(arrays_a[k]) != np.shape(arrays_b[k]):
            raise InvalidArgument(f"arrays[{k}]", f"shapes differ: {np.shape(arrays_a[k])} vs {np.shape(arrays_b[k])}")


def fuse_arrays(
    arrays_a: Mapping[str, np.ndarray], arrays_b_aligned: Mapping[str, np.ndarray], alpha: float
) -> dict[str, np.ndarray]:
    """α·A + (1 − α)·B for every parameter (B already aligned to A)."""
    if not (0.0 <= alpha <= 1.0):
        raise InvalidArgument("alpha", f"must be in [0, 1], got {alpha!r}")
    return average_arrays([arrays_a, arrays_b_aligned], [alpha, 1.0 - alpha])


def average_arrays(models: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Σ_k w_k·θ_k over aligned models (weights non-negative, summing to 1)."""
    if len(models) == 0 or len(models) != len(weights):
        raise InvalidArgument("weights", f"need one weight per model ({len(models)}), got {len(weights)}")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(~np.isfinite(w)) or np.any(w < 0) or abs(w.sum() - 1.0) > 1e-9:
        raise InvalidArgument("weights", f"must be non-negative and sum to 1, got {list(weights)}")
    for m in models[1:]:
        _check_same_shapes(models[0], m)
    return {
        k: sum(float(wi) * np.asarray(m[k], dtype=np.float64) for wi, m in zip(w, models, strict=True)).astype(
            np.float32
        )
        for k in models[0]
    }


def fuse_many(
    arch: Mapping[str, Any],
    models: Sequence[Mapping[str, np.ndarray]],
    permutations_to_reference: Sequence[Sequence[np.ndarray] | None],
    weights: Sequence[float],
) -> dict[str, np.ndarray]:
    """Multi-model fusion: every model aligned to the reference (entry 0, whose permutations
    are None/identity) by its permutations, then the weighted average."""
    if len(models) != len(permutations_to_reference):
        raise InvalidArgument("permutations_to_reference", "need one entry per model")
    aligned = [dict(models[0])] + [
        dict(m) if p is None else permute_arrays(arch, m, p)
        for m, p in zip(models[1:], permutations_to_reference[1:], strict=True)
    ]
    return average_arrays(aligned, weights)


# --- baselines -------------------------------------------------------------------------------


def vanilla_average(
    arrays_a: Mapping[str, np.ndarray], arrays_b: Mapping[str, np.ndarray], alpha: float = 0.5
) -> dict[str, np.ndarray]:
    """Weight averaging with no alignment (McMahan et al.'s FedAvg step for two models)."""
    return fuse_arrays(arrays_a, arrays_b, alpha)


def ensemble_proba(
    arch: Mapping[str, Any],
    arrays_a: Mapping[str, np.ndarray],
    arrays_b: Mapping[str, np.ndarray],
    x: np.ndarray,
    alpha: float = 0.5,
) -> np.ndarray:
    """Prediction ensemble: α·p_A(y|x) + (1 − α)·p_B(y|x) (needs both models at inference)."""
    if not (0.0 <= alpha <= 1.0):
        raise InvalidArgument("alpha", f"must be in [0, 1], got {alpha!r}")
    pa = predict_proba(arch, model_from_arrays(arch, arrays_a), x)
    pb = predict_proba(arch, model_from_arrays(arch, arrays_b), x)
    return alpha * pa + (1 - alpha) * pb


@dataclass(frozen=True)
class WeightMatchingResult:
    permutations: tuple[np.ndarray, ...]
    sweeps: int
    converged: bool
    objective: float


def weight_matching(
    arch: Mapping[str, Any],
    arrays_a: Mapping[str, np.ndarray],
    arrays_b: Mapping[str, np.ndarray],
    *,
    max_sweeps: int = 100,
    seed: int = 0,
) -> WeightMatchingResult:
    """Git Re-Basin weight matching (Ainsworth et al. 2023, Algorithm 1): maximise
    Σ_ℓ ⟨W_A^ℓ, P_ℓ W_B^ℓ P_{ℓ−1}ᵀ⟩ (+ biases) by coordinate descent over layers in random
    order, each step a linear assignment (Hungarian) on
    S_ℓ = W_A^ℓ (W_B^ℓ P_{ℓ−1}ᵀ)ᵀ + b_A b_Bᵀ + (W_A^{ℓ+1})ᵀ P_{ℓ+1} W_B^{ℓ+1},
    until a full sweep changes nothing. Uses exact weights: a non-private baseline."""
    _check_same_shapes(arrays_a, arrays_b)
    sizes = hidden_sizes(arch)
    layers = weight_layers(arch)
    rng = np.random.default_rng(seed)
    perms = [np.arange(n) for n in sizes]
    A = {k: np.asarray(v, dtype=np.float64) for k, v in arrays_a.items()}
    B = {k: np.asarray(v, dtype=np.float64) for k, v in arrays_b.items()}

    def in_blocks(arrs, idx, perm_prev):
        """Weight layer idx as (n_out, n_in_nodes, e) with the input nodes permuted."""
        layer = layers[idx]
        w = arrs[f"{layer.name}.weight"]
        w3 = w.reshape(w.shape[0], layer.inputs, layer.entries_per_input)
        return w3 if perm_prev is None else w3[:, perm_prev, :]

    def score(ell):
        prev = perms[ell - 1] if ell > 0 else None
        wa, wb = in_blocks(A, ell, None), in_blocks(B, ell, prev)
        s = wa.reshape(wa.shape[0], -1) @ wb.reshape(wb.shape[0], -1).T
        s += np.outer(A[f"{layers[ell].name}.bias"], B[f"{layers[ell].name}.bias"])
        na, nb = in_blocks(A, ell + 1, None), in_blocks(B, ell + 1, None)
        if ell + 1 < len(sizes):
            nb = nb[perms[ell + 1]]
        # outgoing: columns (input nodes) of the next layer
        s += np.einsum("oie,oje->ij", na, nb)
        return s

    converged = False
    sweeps = 0
    # the loop variable is the result: the number of sweeps run (B007 sees it unused in the body)
    for sweeps in range(1, max_sweeps + 1):  # noqa: B007
        changed = False
        for ell in rng.permutation(len(sizes)):
            s = score(ell)
            _, col = _optimize.linear_sum_assignment(s, maximize=True)
            if not np.array_equal(col, perms[ell]):
                gain = s[np.arange(len(col)), col].sum() - s[np.arange(len(col)), perms[ell]].sum()
                if gain > 1e-12:
                    perms[ell] = col
                    changed = True
        if not changed:
            converged = True
            break
    aligned = permute_arrays(arch, arrays_b, perms)
    objective = float(sum(np.sum(A[k] * aligned[k]) for k in A))
    return WeightMatchingResult(tuple(perms), sweeps, converged, objective)
