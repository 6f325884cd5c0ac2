"""Separable expansions of the scalar Gaussian weight kernel κ(x, y) = exp(−(x − y)²/σ).

κ ≈ Σ_r λ_r φ_r(x) φ_r(y) lets a block of the affinity act as Σ_r F_r V H_rᵀ without forming K:
a Chebyshev expansion with a computed error bound for exact weights, and the exact few-valued
table for released multi-bit weights (:func:`few_values`). Theory: docs/matching.md,
"Chebyshev expansion" and "Few-valued weights".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.nn.architectures import torch_threads

# Most distinct values a layer's weight array may take to use the exact few-valued expansion.
FEW_VALUED_MAX = 3
# Highest Chebyshev degree gaussian_expansion tries before giving up.
MAX_CHEBYSHEV_DEGREE = 512


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float64 through torch, so that it runs on the torch threads match_graphs sets:
    numpy's BLAS starts all its threads even for small products, and stalls when a core is busy."""
    return (torch.as_tensor(np.asarray(a, dtype=np.float64)) @ torch.as_tensor(np.asarray(b, dtype=np.float64))).numpy()


def both_sides(fn, sides=("a", "b")) -> list:
    """[fn(side) for side in sides], the two on two Python threads: each is single-threaded
    elementwise or matrix–vector work (the Chebyshev recurrence, Gram passes, Lanczos), which
    releases the GIL, so the two sides of a block use the machine's two cores (measured at width
    4096 under a load of 8 on 2 cores: a Gram pass of both sides 23 s → 16 s). torch's thread
    setting is process-wide: it is held at 1 around both, so that neither thread's own
    set-and-restore can leave it changed."""
    from concurrent.futures import ThreadPoolExecutor

    with torch_threads(1), ThreadPoolExecutor(len(sides)) as pool:
        return list(pool.map(fn, sides))


# Entries (times the recurrence's rows) evaluated at a time by the operator-adapted expansion's
# passes over the weights: small enough that the Chebyshev rows stay in the cache (measured at
# widths 2048–4096: about twice as fast as chunks of 2²² values).
FUNCTION_CHUNK_BITS = 19
GRAM_CHUNK_BITS = 20


def gaussian_kernel(x, y, sigma: float):
    """κ(x, y) = exp(−(x − y)² / σ) elementwise (broadcasting); numpy or torch."""
    d = x - y
    if isinstance(d, torch.Tensor):
        return torch.exp(-(d * d) / sigma)
    return np.exp(-(d * d) / sigma)


def chebyshev_interpolation_bound(beta: float, degree: int) -> float:
    """Sup-norm error bound of the 2-D tensor Chebyshev interpolant of g(s, t) = exp(−β(s−t)²)
    on [−1, 1]² at the (degree+1)² Chebyshev points of the second kind:
    min over ρ > 1 of (1 + Λ_p) · 4 exp(β b²) ρ^{−p} / (ρ − 1), b = (ρ − ρ⁻¹)/2, Λ_p ≤ (2/π) log(p + 1) + 1
    (derivation: docs/matching.md, "Chebyshev expansion"); the minimum is taken over a fine grid of ρ.
    """
    return float(_interpolation_bounds(beta, np.array([int(degree)]))[0])


# log ρ grid for the bound: every ρ > 1 is valid; a fine grid finds one near the best.
_LOG_RHO = np.geomspace(1e-6, 8.0, 1000)


def _interpolation_bounds(beta: float, degrees: np.ndarray) -> np.ndarray:
    """chebyshev_interpolation_bound for several degrees at once."""
    p = degrees.astype(np.float64)[:, None]
    rho = np.exp(_LOG_RHO)[None, :]
    b = (rho - 1.0 / rho) / 2.0
    lebesgue = 2.0 / math.pi * np.log(p + 1.0) + 1.0
    log_b = (
        np.log1p(lebesgue) + math.log(4.0) + beta * b * b - p * _LOG_RHO[None, :] - np.log(np.expm1(_LOG_RHO))[None, :]
    )
    return np.exp(np.minimum(log_b.min(axis=1), 700.0))


@dataclass(frozen=True)
class ChebyshevExpansion:
    """κ(x, y) = exp(−(x−y)²/σ) on [lo, hi]² ≈ Σ_r λ_r φ_r(x) φ_r(y), φ_r(x) = Σ_j U[j, r] T_j((x − c)/h)
    with c, h the interval's centre and half-width and C = U diag(λ) Uᵀ the compressed Chebyshev
    core. ``error_bound`` = interpolation bound + Σ_dropped |λ_r| ‖U_r‖₁²: a bound on
    |κ − expansion| over [lo, hi]² in exact arithmetic, rounding excluded (docs/matching.md,
    "Chebyshev expansion").
    """

    lo: float
    hi: float
    sigma: float
    degree: int
    eigenvalues: np.ndarray
    eigenvectors: np.ndarray
    interpolation_bound: float
    truncation_bound: float

    @property
    def terms(self) -> int:
        return int(self.eigenvalues.shape[0])

    @property
    def error_bound(self) -> float:
        return self.interpolation_bound + self.truncation_bound

    def functions(self, x):
        """φ_r(x) for every term, stacked on a new leading axis, in float64 (a torch input gives
        a torch output in its dtype). Chunk by chunk: the Chebyshev values T_j(s) by their
        three-term recurrence, then one product with the eigenvector matrix."""
        if isinstance(x, torch.Tensor):
            return torch.as_tensor(self.functions(x.detach().cpu().numpy()), dtype=x.dtype)
        x = np.asarray(x, dtype=np.float64)
        flat = x.reshape(-1)
        out = np.empty((self.terms, flat.shape[0]))
        chunk = max(1, (1 << 22) // (self.degree + 1))
        for start in range(0, flat.shape[0], chunk):
            cheb = chebyshev_values(self.lo, self.hi, self.degree, flat[start : start + chunk])
            out[:, start : start + chunk] = _matmul(self.eigenvectors.T, cheb)
        return out.reshape((self.terms, *x.shape))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The expansion's value at every pair (x[a], y[b]) of two 1-D arrays."""
        fx = self.functions(np.asarray(x, dtype=np.float64))
        fy = self.functions(np.asarray(y, dtype=np.float64))
        return np.einsum("r,ra,rb->ab", self.eigenvalues, fx, fy)


def chebyshev_values(lo: float, hi: float, degree: int, x: np.ndarray) -> np.ndarray:
    """T_j((x − c)/h) for j = 0 … degree (c, h the centre and half-width of [lo, hi]), by the
    three-term recurrence: shape (degree + 1, x.size), float64."""
    s = np.asarray(x, dtype=np.float64).reshape(-1)
    c, h = (hi + lo) / 2.0, (hi - lo) / 2.0
    s = torch.as_tensor((s - c) / h if h > 0 else np.zeros_like(s))
    # elementwise work on one thread: on a shared machine a second thread only adds waiting
    with torch_threads(1):
        cheb = torch.empty((degree + 1, s.shape[0]), dtype=torch.float64)
        cheb[0] = 1.0
        if degree >= 1:
            cheb[1] = s
        two_s = 2.0 * s  # (2s)·T = 2·(s·T) exactly: the same values as the textbook recurrence
        for j in range(2, degree + 1):
            torch.mul(two_s, cheb[j - 1], out=cheb[j])
            cheb[j] -= cheb[j - 2]
    return cheb.numpy()


def chebyshev_gram(lo: float, hi: float, degree: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The empirical Gram matrix G[j, l] = mean over w's entries of T_j T_l, and the means of
    the T_j, in float64: from the moments μ_k = mean T_k (k ≤ 2·degree) by the product rule
    T_j T_l = (T_{j+l} + T_{|j−l|})/2 — one pass of the recurrence instead of a Gram product."""
    flat = np.asarray(w, dtype=np.float64).reshape(-1)
    sums = np.zeros(2 * degree + 1)
    chunk = max(1, (1 << 22) // (2 * degree + 1))
    for start in range(0, flat.shape[0], chunk):
        sums += chebyshev_values(lo, hi, 2 * degree, flat[start : start + chunk]).sum(axis=1)
    mu = sums / flat.shape[0]
    j = np.arange(degree + 1)
    gram = (mu[j[:, None] + j[None, :]] + mu[np.abs(j[:, None] - j[None, :])]) / 2.0
    return gram, mu[: degree + 1]


def chebyshev_gram_lines(
    lo: float, hi: float, degree: int, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`chebyshev_gram` of a 2-D w (n, m), and, from the same pass of the recurrence, the
    line sums Σ_l T_j(w[i, l]) (n, degree + 1) and Σ_i T_j(w[i, l]) (m, degree + 1): with them a
    factor f(W) = Σ_j a_j T_j(W) gives f(W) 1 and f(W)ᵀ 1 without being formed.

    The Gram matrix is summed as a product of each chunk's values with themselves, (degree + 1)
    rows of the recurrence, rather than from the moments up to 2·degree: the line sums need the
    values up to the degree anyway, so this halves the recurrence, and the product runs at the
    speed of a matrix product instead of memory-bound sums. The means of the T_j are its first
    row (T_0 = 1). Exact in exact arithmetic, as the moment route."""
    w = np.asarray(w, dtype=np.float64)
    n, m = w.shape
    gram = torch.zeros((degree + 1, degree + 1), dtype=torch.float64)
    rows_sum = np.empty((n, degree + 1))
    cols_sum = np.zeros((m, degree + 1))
    rows = max(1, ((1 << GRAM_CHUNK_BITS) // (degree + 1)) // max(1, m))
    for start in range(0, n, rows):
        block = w[start : start + rows]
        low = chebyshev_values(lo, hi, degree, block)
        values = torch.as_tensor(low)
        # one thread: both sides' passes run at once (expansion.both_sides)
        with torch_threads(1):
            gram += values @ values.T
        low = low.reshape(degree + 1, block.shape[0], m)
        rows_sum[start : start + block.shape[0]] = low.sum(axis=2).T
        cols_sum += low.sum(axis=1).T
    gram = gram.numpy() / w.size
    gram = (gram + gram.T) / 2.0
    return gram, gram[0].copy(), rows_sum, cols_sum


@dataclass(frozen=True)
class OperatorExpansion:
    """κ(x, y) ≈ Σ_k σ_k f_k(x) h_k(y) on the weight pairs of one block, optimal in the mean square
    over those pairs (docs/matching.md, "Operator-adapted expansion").

    The degree-p Chebyshev interpolant T(x)ᵀ C T(y) is truncated in the inner products of the two
    sides' empirical distributions: with G_A = S_A S_Aᵀ, G_B = S_B S_Bᵀ the Gram matrices of the T_j
    over A's and B's weight values, S_Aᵀ C S_B = Y diag(σ) Zᵀ (SVD), f_k = T ᵀ S_A⁺ᵀ y_k,
    h_k = Tᵀ S_B⁺ᵀ z_k. ``tails[k]`` is the root mean square, over every pair (x from A's weights,
    y from B's), of the interpolant minus its first k terms (computed as ‖S_Aᵀ (C − C_k) S_B‖_F);
    the interpolant itself is within ``interpolation_bound`` of κ everywhere. ``left`` and
    ``right`` hold the coefficients of f_k and h_k (columns); only the first ``terms`` are kept.
    ``error_bound``: a bound on |κ − expansion| at every point of [lo, hi]² (interpolation bound +
    Σ|C − C_R| entrywise, since |T_j| ≤ 1 there).
    """

    lo: float
    hi: float
    sigma: float
    degree: int
    scales: np.ndarray
    left: np.ndarray
    right: np.ndarray
    interpolation_bound: float
    tails: np.ndarray
    mean_kernel: float
    sup_truncation_bound: float
    # Chebyshev line sums of each side's 2-D weights (rows, columns), when given as 2-D arrays
    lines_a: tuple[np.ndarray, np.ndarray] | None = None
    lines_b: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def terms(self) -> int:
        return int(self.scales.shape[0])

    @property
    def error_bound(self) -> float:
        return self.interpolation_bound + self.sup_truncation_bound

    def rms_bound(self, terms: int) -> float:
        """A bound on the root mean square over the block's weight pairs of κ minus the first
        ``terms`` terms."""
        return self.interpolation_bound + float(self.tails[min(int(terms), self.tails.shape[0] - 1)])

    def coefficients(self, side: str) -> np.ndarray:
        """The T-coefficients of σ_k f_k (side "a") or h_k (side "b"), one column per kept term."""
        return self.left * self.scales[None, :] if side == "a" else self.right

    def line_sums(self, side: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(F 1, Fᵀ 1) for F = σ_k f_k(W^A) (side "a") or h_k(W^B) (side "b"), as (n, terms) and
        (m, terms), from the Chebyshev line sums; None when the sides were not given as 2-D."""
        lines = self.lines_a if side == "a" else self.lines_b
        if lines is None:
            return None
        coef = self.coefficients(side)
        return lines[0] @ coef, lines[1] @ coef

    def term_means(self, side: str) -> np.ndarray | None:
        """The mean over the side's weight entries of each kept σ_k f_k (side "a") or h_k
        (side "b"), from the Chebyshev line sums; None when the sides were not given as 2-D."""
        lines = self.lines_a if side == "a" else self.lines_b
        if lines is None:
            return None
        count = lines[0].shape[0] * lines[1].shape[0]
        return lines[0].sum(axis=0) @ self.coefficients(side) / count

    def mean_function_coefficients(self, side: str) -> np.ndarray:
        """T-coefficients of the side's mean function: g_A = Σ_k m^B_k σ_k f_k (side "a") and
        g_B = Σ_k m^A_k h_k (side "b"), m^A_k, m^B_k the term means (:meth:`term_means`). With
        F_k = m^A_k J + F̃_k and H_k = m^B_k J + H̃_k,
        Σ_k F_k ⊗ H_k = J ⊗ g_B(W^B) + g_A(W^A) ⊗ J − (Σ_k m^A_k m^B_k) J ⊗ J + Σ_k F̃_k ⊗ H̃_k
        (docs/matching.md, "Operator-adapted expansion")."""
        other = self.term_means("b" if side == "a" else "a")
        return self.coefficients(side) @ other

    def functions(self, x, side: str, start: int = 0, stop: int | None = None, coef=None) -> np.ndarray:
        """σ_k f_k(x) (side "a") or h_k(x) (side "b") for the kept terms ``start`` ≤ k < ``stop``
        (all by default): (terms, *x.shape), float64; or, given ``coef`` ((degree + 1, count)
        T-coefficients), those functions."""
        x = np.asarray(x, dtype=np.float64)
        flat = x.reshape(-1)
        coef = self.coefficients(side)[:, start:stop] if coef is None else np.asarray(coef).reshape(self.degree + 1, -1)
        out = np.empty((coef.shape[1], flat.shape[0]))
        chunk = max(1, (1 << FUNCTION_CHUNK_BITS) // (self.degree + 1))
        for at in range(0, flat.shape[0], chunk):
            cheb = chebyshev_values(self.lo, self.hi, self.degree, flat[at : at + chunk])
            out[:, at : at + chunk] = _matmul(coef.T, cheb)
        return out.reshape((coef.shape[1], *x.shape))


def operator_expansion(
    lo: float, hi: float, sigma: float, wa: np.ndarray, wb: np.ndarray, rms_tol: float
) -> OperatorExpansion:
    """The expansion of κ on the pairs of wa's and wb's values whose mean-square error over those
    pairs is ≤ ``rms_tol`` (interpolation ≤ rms_tol/2, truncation the rest), with the fewest terms."""
    lo, hi, sigma = float(lo), float(hi), float(sigma)
    h = (hi - lo) / 2.0
    beta = h * h / sigma
    if beta == 0.0:
        one = np.ones((1, 1))
        return OperatorExpansion(lo, hi, sigma, 0, np.ones(1), one, one, 0.0, np.zeros(2), 1.0, 0.0)
    p = None
    for start in range(1, MAX_CHEBYSHEV_DEGREE + 1, 64):
        degrees = np.arange(start, min(start + 64, MAX_CHEBYSHEV_DEGREE + 1))
        ok = np.flatnonzero(_interpolation_bounds(beta, degrees) <= rms_tol / 2)
        if ok.size:
            p = int(degrees[ok[0]])
            break
    if p is None:
        raise InvalidArgument(
            "options.tol",
            f"{rms_tol:g} needs a Chebyshev degree above {MAX_CHEBYSHEV_DEGREE} for weights spanning [{lo:g}, {hi:g}] "
            f"with sigma {sigma:g}; raise tol or weight_sigma",
        )
    interp = chebyshev_interpolation_bound(beta, p)
    core = _chebyshev_core(beta, p)
    lines = {}

    def gram_pass(side):
        w = wa if side == "a" else wb
        return chebyshev_gram_lines(lo, hi, p, w) if np.ndim(w) == 2 else chebyshev_gram(lo, hi, p, w)

    for side, result in zip(("a", "b"), both_sides(gram_pass), strict=True):
        if len(result) == 4:
            lines[side] = result[2:]
        lines[side + "gram"] = result[:2]
    gram_a, mean_a = lines["agram"]
    gram_b, mean_b = lines["bgram"]

    def root(g):  # S with S Sᵀ = G, and its pseudo-inverse transposed (kept directions only)
        mu, q = np.linalg.eigh((g + g.T) / 2.0)
        mu = np.maximum(mu, 0.0)
        keep = mu > 1e-14 * mu.max()
        return q * np.sqrt(mu), q[:, keep] / np.sqrt(mu[keep]), keep

    s_a, inv_a, keep_a = root(gram_a)
    s_b, inv_b, keep_b = root(gram_b)
    m = s_a[:, keep_a].T @ core @ s_b[:, keep_b]
    y, sv, zt = np.linalg.svd(m)
    left = inv_a @ y  # T-coefficients of f_k (S_A⁺ᵀ y_k)
    right = inv_b @ zt.T
    # tails[k] = ‖S_Aᵀ (C − C_k) S_B‖_F, C_k the first k terms, computed from the coefficients
    full = len(sv)
    tails = np.zeros(full + 1)
    for k in range(full + 1):
        ck = (left[:, :k] * sv[:k]) @ right[:, :k].T
        tails[k] = float(np.linalg.norm(s_a.T @ (core - ck) @ s_b))
    terms = int(np.argmax(interp + tails <= rms_tol)) if np.any(interp + tails <= rms_tol) else full
    terms = max(1, terms)
    ck = (left[:, :terms] * sv[:terms]) @ right[:, :terms].T
    return OperatorExpansion(
        lo,
        hi,
        sigma,
        p,
        sv[:terms].copy(),
        left[:, :terms].copy(),
        right[:, :terms].copy(),
        interp,
        tails[: terms + 1].copy(),
        float(mean_a @ core @ mean_b),
        float(np.abs(core - ck).sum()),
        lines.get("a"),
        lines.get("b"),
    )


def _chebyshev_core(beta: float, degree: int) -> np.ndarray:
    """Coefficients C of the 2-D Chebyshev interpolant of exp(−β(s−t)²) (symmetric)."""
    k = np.arange(degree + 1)
    nodes = np.cos(np.pi * k / degree)
    cheb = np.cos(np.outer(np.arccos(np.clip(nodes, -1, 1)), k))  # cheb[a, j] = T_j(node_a)
    values = np.exp(-beta * (nodes[:, None] - nodes[None, :]) ** 2)
    # torch's solver runs on the caller's torch threads (match_graphs sets them); numpy's would
    # use every BLAS thread, which costs more than it gains at this size on a busy machine
    cheb_t = torch.as_tensor(cheb)
    left = torch.linalg.solve(cheb_t, torch.as_tensor(values))  # T⁻¹ G
    core = torch.linalg.solve(cheb_t, left.T).T.numpy()  # T⁻¹ G T⁻ᵀ
    return (core + core.T) / 2.0


def gaussian_expansion(lo: float, hi: float, sigma: float, tol: float) -> ChebyshevExpansion:
    """A separable expansion of exp(−(x−y)²/σ) on [lo, hi]² with error bound ≤ ``tol``.

    The smallest degree p whose interpolation bound (:func:`chebyshev_interpolation_bound`,
    β = h²/σ with h the half-width) is ≤ tol/2 and the three degrees above it are tried; for each,
    the core is compressed while the bound stays ≤ tol, and the degree giving the fewest terms
    wins.
    """
    lo, hi, sigma, tol = float(lo), float(hi), float(sigma), float(tol)
    if not (math.isfinite(lo) and math.isfinite(hi) and hi >= lo):
        raise InvalidArgument("interval", f"must be finite with lo <= hi, got [{lo}, {hi}]")
    if not (math.isfinite(sigma) and sigma > 0):
        raise InvalidArgument("sigma", f"must be a finite number > 0, got {sigma}")
    if not 0 < tol < 1:
        raise InvalidArgument("tol", f"must be in (0, 1), got {tol}")
    h = (hi - lo) / 2.0
    beta = h * h / sigma
    if beta == 0.0:
        # every value equal: κ ≡ 1, one exact term.
        return ChebyshevExpansion(lo, hi, sigma, 0, np.ones(1), np.ones((1, 1)), 0.0, 0.0)
    p_min = None
    for start in range(1, MAX_CHEBYSHEV_DEGREE + 1, 64):
        degrees = np.arange(start, min(start + 64, MAX_CHEBYSHEV_DEGREE + 1))
        ok = np.flatnonzero(_interpolation_bounds(beta, degrees) <= tol / 2)
        if ok.size:
            p_min = int(degrees[ok[0]])
            break
    if p_min is None:
        raise InvalidArgument(
            "options.expansion_tol",
            f"{tol:g} needs a Chebyshev degree above {MAX_CHEBYSHEV_DEGREE} for weights spanning [{lo:g}, {hi:g}] "
            f"with sigma {sigma:g} (h²/σ = {beta:.3g}); raise expansion_tol or weight_sigma",
        )
    best: ChebyshevExpansion | None = None
    for p in range(p_min, min(p_min + 3, MAX_CHEBYSHEV_DEGREE) + 1):
        interp = chebyshev_interpolation_bound(beta, p)
        lam_t, vec_t = torch.linalg.eigh(torch.as_tensor(_chebyshev_core(beta, p)))
        lam, vec = lam_t.numpy(), vec_t.numpy()
        weight = np.abs(lam) * np.abs(vec).sum(axis=0) ** 2
        order = np.argsort(weight)
        dropped = np.cumsum(weight[order])
        n_drop = int(np.searchsorted(dropped, tol - interp, side="right"))
        trunc = float(dropped[n_drop - 1]) if n_drop else 0.0
        keep = np.sort(order[n_drop:])
        keep = keep[np.argsort(-np.abs(lam[keep]))]
        cand = ChebyshevExpansion(lo, hi, sigma, p, lam[keep].copy(), vec[:, keep].copy(), interp, trunc)
        if (
            best is None
            or cand.terms < best.terms
            or (cand.terms == best.terms and cand.error_bound < best.error_bound)
        ):
            best = cand
    assert best is not None
    return best


def few_values(arr: np.ndarray, max_values: int = FEW_VALUED_MAX) -> np.ndarray | None:
    """The distinct values of ``arr`` ordered by decreasing frequency, or None if there are more
    than ``max_values`` of them. O(max_values · size), no sort."""
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 0:
        return None
    left = np.ones(flat.shape, dtype=bool)
    values, counts = [], []
    for _ in range(max_values):
        first = int(np.argmax(left))
        if not left[first]:
            break
        v = flat[first]
        eq = flat == v
        values.append(v)
        counts.append(int(np.count_nonzero(eq)))
        left &= ~eq
    if left.any():
        return None
    order = np.argsort(-np.asarray(counts), kind="stable")
    return np.asarray(values, dtype=np.float64)[order]
