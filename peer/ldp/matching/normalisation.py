"""The public normalisation of each affinity term: bandwidth rules and Sinkhorn balancing.

Bandwidths read only the arrays the matcher is given (for a remote graph, its released noisy
features), never another site's exact values. Why these rules, and why balancing helps under
noise: docs/matching.md, "Normalisation" and "Bandwidths".
"""

from __future__ import annotations

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.ldp.matching.expansion import _matmul
from peer.nn.architectures import torch_threads


def _mean_sq_bandwidth(x: np.ndarray, y: np.ndarray) -> float:
    """Mean of ‖x_i − y_j‖² over all pairs of rows (closed form); 1.0 when it is 0."""
    x = x.reshape(x.shape[0], -1)
    y = y.reshape(y.shape[0], -1)
    s = float(
        np.mean(np.sum(x * x, axis=1)) + np.mean(np.sum(y * y, axis=1)) - 2.0 * np.dot(x.mean(axis=0), y.mean(axis=0))
    )
    return s if s > 1e-300 else 1.0


SINKHORN_TWO_THREADS_MIN = 1 << 22


def sinkhorn_factors(
    m: np.ndarray, what: str, *, tol: float = 1e-10, max_iter: int = 10_000
) -> tuple[np.ndarray, np.ndarray]:
    """Positive r, c with diag(r)·m·diag(c) doubly stochastic up to scale: every row sums to
    the number of columns and every column to the number of rows (so the mean entry is 1, for
    square m). Sinkhorn–Knopp iterations; they converge for every strictly positive m (Sinkhorn
    1967). Stops when every row and column sum is within ``tol`` (relative) of its target."""
    m = np.asarray(m, dtype=np.float64)
    if not np.all(np.isfinite(m)) or np.any(m < 0) or not np.all(m.sum(axis=1) > 0) or not np.all(m.sum(axis=0) > 0):
        raise InvalidArgument(
            "options.balance",
            f"cannot balance the {what}: it needs finite, non-negative values with no all-zero row or column (a bandwidth too small?)",
        )
    n_rows, n_cols = m.shape
    # float64 matrix-vector products through torch, with the transpose made contiguous: numpy's
    # m.T @ r on a shared machine was over 10× slower (docs/matching.md, "Threads"). One thread
    # for small matrices; from 2²² entries two: the products are memory-bound and a second thread
    # halves them (4096²: 8.6 → 4.1 ms per product, measured on this 2-core machine)
    with torch_threads(2 if m.size >= SINKHORN_TWO_THREADS_MIN else 1):
        mat = torch.as_tensor(m)
        mat_t = mat.T.contiguous()
        r = torch.ones(n_rows, dtype=torch.float64)
        c = torch.ones(n_cols, dtype=torch.float64)
        mc = torch.mv(mat, c)
        for _ in range(max_iter):
            r = n_cols / mc
            c = n_rows / torch.mv(mat_t, r)
            # m @ c serves both this step's check and the next step's r: two products per step
            mc = torch.mv(mat, c)
            if float(torch.max(torch.abs(r * mc - n_cols))) <= tol * n_cols:
                break
    return r.numpy(), c.numpy()


def _spread_bandwidth(a: np.ndarray, b: np.ndarray) -> float:
    """The "spread" rule: std over all pairs of ‖a_i − b_j‖² with row and column means removed,
    = 2·std⟨a_i − ā, b_j − b̄⟩ (one n×P×n product); the mean rule where that is 0."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ca = a - a.mean(axis=0)
    cb = b - b.mean(axis=0)
    spread = 2.0 * float(np.std(_matmul(ca, cb.T)))
    return spread if spread > 1e-300 else _mean_sq_bandwidth(a, b)


def _squared_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """‖a_i − b_j‖² for all pairs of rows (float64)."""
    sq = np.sum(a * a, axis=1)[:, None] + np.sum(b * b, axis=1)[None, :] - 2.0 * _matmul(a, b.T)
    return np.maximum(sq, 0.0)
