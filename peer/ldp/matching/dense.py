"""The dense reference: K materialised in pygmtools' layout, and pygmtools' ``sm`` on it.

Small graphs only: K has (Σ n_ℓ²)² entries. It is the baseline the factorised solver is checked
against and benchmarked with (docs/matching.md, "The dense reference").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from peer.ldp.matching.blocks import _Block
from peer.ldp.matching.expansion import gaussian_kernel
from peer.ldp.matching.options import MatchOptions


def dense_matrix(
    sizes: Sequence[int], offsets: Sequence[int], diagonals: Sequence[np.ndarray], hidden_blocks: Sequence[_Block]
) -> np.ndarray:
    """K as a dense float64 (M×M) matrix, M = Σ n_ℓ², from the per-layer diagonals D_ℓ
    ([i, j] = pair (A node i, B node j)) and the scaled hidden–hidden blocks (none when the
    edge weight is 0).

    Layout (pygmtools'): within hidden layer ℓ, the pair (A node i, B node j) is row
    offset_ℓ + j·n_ℓ + i (vec(X) column-major, K indexed by (node2, node1) pairs); the layers'
    blocks are stacked. pygmtools' K for the union of all hidden nodes would add rows and
    columns for pairs across layers, which are all zero (those assignments are forbidden);
    this is its principal submatrix on the within-layer pairs, so power iteration from the
    uniform start gives the same vector (tests check both against ``build_aff_mat``).
    """
    pairs = offsets[-1]
    k = np.zeros((pairs, pairs))
    for ell, n in enumerate(sizes):
        o = offsets[ell]
        idx = np.arange(o, o + n * n)
        k[idx, idx] = diagonals[ell].T.reshape(-1)
    for ell, b in enumerate(hidden_blocks, start=1):
        n, m = sizes[ell], sizes[ell - 1]
        ro, co = offsets[ell], offsets[ell - 1]
        e = b.weights_a.shape[2]
        for j in range(n):
            # rows (i, j) for fixed j; columns (k, l): κ(W_a[i, k], W_b[j, l]) at [i, l, k]
            blk = np.zeros((n, m, m))
            for c in range(e):
                blk += gaussian_kernel(b.weights_b[j, :, c][None, :, None], b.weights_a[:, :, c][:, None, :], b.sigma)
            k[ro + j * n : ro + (j + 1) * n, co : co + m * m] = blk.reshape(n, m * m) * b.scale
        k[co : co + m * m, ro : ro + n * n] = k[ro : ro + n * n, co : co + m * m].T
    return k


def power_iteration_dense(k: np.ndarray, options: MatchOptions):
    """pygmtools.sm on K + sI, one step at a time, warm-started from its previous iterate (its
    state is only v), so that this loop counts iterations and applies the same stopping rule
    with ``tol``. The shift is added to K's diagonal in place and removed after. Returns
    (v, iterations, converged, residual, eigenvalue estimate, shift)."""
    import pygmtools

    opts = options
    m = k.shape[0]
    v = np.full(m, 1.0 / m)
    shift = opts.shift if opts.shift is not None else 0.5 * float(np.linalg.norm(k @ v) / np.linalg.norm(v))
    diag = np.arange(m)
    k[diag, diag] += shift
    converged, it, residual = False, 0, float("inf")
    # the loop variable is the result: the number of iterations run (B007 sees it unused in the body)
    for it in range(1, opts.max_iter + 1):  # noqa: B007
        x = pygmtools.sm(k, n1max=m, n2max=1, x0=v.reshape(1, m, 1), max_iter=1, backend="numpy")
        w = np.asarray(x).reshape(m)
        residual = float(np.linalg.norm(w - v))
        v = w
        if residual < opts.tol:
            converged = True
            break
    norm = float(np.linalg.norm(k @ v)) - shift
    k[diag, diag] -= shift
    return v, it, converged, residual, norm, shift
