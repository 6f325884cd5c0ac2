"""Spectral graph matching of two networks, jointly over all hidden layers.

The problem
-----------
Two networks A and B of the same architecture, as graphs (``peer.nn.graph.NetworkGraph``). Hidden
layer ℓ (ℓ = 0 … L−1, width n_ℓ) gets an assignment matrix X_ℓ ∈ {0,1}^{n_ℓ×n_ℓ},
X_ℓ[i, j] = 1 when node i of A is matched to node j of B. The input and output layers are fixed
(X = identity). With x = (vec X_0, …, vec X_{L−1}) the matching maximises the quadratic
assignment objective xᵀKx (Lawler's QAP), with a symmetric, non-negative affinity K:

* **node affinity** (diagonal of K): D_ℓ[i, j] =
  w_act · N_ℓ[i, j] / mean(N_ℓ) + w_edge · (U_in[i, j] if ℓ = 0) + w_edge · (U_out[i, j] if ℓ = L−1),
  with N_ℓ[i, j] = exp(−‖a_i − b_j‖² / σ_act) on the activation rows (pygmtools'
  ``gaussian_aff_fn`` convention: σ not squared). Edges to the fixed input and output layers are
  unary because those nodes never move: U_in[i, j] = Σ_k κ(W^A[i, k], W^B[j, k]) / ν_in and
  U_out[i, j] = Σ_o κ(W^A_out[o, i], W^B_out[o, j]) / ν_out.
* **edge affinity** (off-diagonal blocks) between consecutive hidden layers ℓ−1, ℓ:
  K[(ℓ, i, j), (ℓ−1, k, l)] = w_edge · κ(W^A_ℓ[i, k], W^B_ℓ[j, l]) / ν_ℓ, and its transpose.

**Weight kernel.** An edge carries e ≥ 1 weights (e = 1 Linear→Linear, k·k for conv kernels, H·W
for the flatten block). κ(w, w′) = (1/e) Σ_c exp(−(w_c − w′_c)² / σ_w): the mean of scalar
Gaussian kernels. A mean of positive semi-definite kernels is positive semi-definite and non-
negative, and — what matters for scale — it is a sum of *scalar* kernels, so every separable
expansion of the scalar Gaussian below carries over component by component (the e-dimensional
Gaussian exp(−‖w − w′‖²/σ) would be a product over c, whose separable rank is the product of the
components' ranks).

**Normalisation ("normalised per layer, then merged").** Two steps.

*Balancing* (``MatchOptions.balance``, on by default): every unary term — the activation
affinity N_ℓ and the fixed-layer terms U_in, U_out, each an n×n matrix over (A node, B node)
pairs — is scaled to a doubly stochastic matrix with mean 1, diag(r)·N·diag(c), by Sinkhorn
iterations (Sinkhorn 1967; Cour, Srinivasan & Shi, "Balanced graph matching", NIPS 2006, who
show that bistochastic normalisation of the affinity improves spectral matching). A Gaussian
kernel factors as exp(−‖a_i‖²/σ)·exp(−‖b_j‖²/σ)·exp(2⟨a_i, b_j⟩/σ): the first two factors are
row and column weights that say nothing about which node corresponds to which, and under local
DP noise the norm of each released row — hence its whole column of affinities — is mostly
noise. For a permutation the row and column factors only multiply the objective's terms by
r_i c_π(i), and balancing removes exactly such factors (which is also why the activation kernel
is evaluated as exp(−(d² − row mean − column mean + mean)/σ) when balancing: the same balanced
matrix, without the underflow of exp(−d²/σ) under heavy noise); measured on a digits MLP matched
against its permuted copy's Laplace/multi-bit release (per-entry ε = 1, 2560 probes), it takes
the fraction of correctly matched nodes from 0.52/0.76 to 0.93/0.85 (layers 1/2), and changes
nothing for exact features.

*Scaling*: every affinity term is then divided by its expected value when the nodes of B are
paired with those of A by a uniformly random permutation, so that a term neither dominates by
scale alone (kernel values that sit near 1, or sums over many neighbours) nor vanishes (after
balancing the unary terms already have mean 1):

* activation term: divided by mean_{i,j} N_ℓ[i, j];
* an edge term that sums over the n′ neighbours on one side: divided by ν = n′ · κ̄, where κ̄ is
  the mean of κ over all pairs of A's and B's weight values of that layer pair (n′ = n_in for
  U_in, n_out for U_out). A hidden–hidden block serves both of its layers, and K must stay
  symmetric, so it uses the geometric mean ν_ℓ = sqrt(n_ℓ n_{ℓ−1}) · κ̄_ℓ (the two agree for equal
  widths).

The merged affinity is weighted by ``MatchOptions.activation_weight`` (w_act) and
``MatchOptions.edge_weight`` (w_edge).

**Bandwidths and what is public.** σ_act (per hidden layer) and σ_w (per layer pair) are either
given (public parameters) or set by a rule that reads only the arrays the matcher is given — for
a remote graph these are its noisy, released features — never another site's exact values.
σ_w follows the "mean squared difference" rule: the mean of (w − w′)² over all pairs of A's and
B's values (closed form mean w² + mean w′² − 2 w̄·w̄′; by Jensen's inequality κ̄ ≥ e⁻¹). σ_act
follows the "spread" rule by default (``MatchOptions.activation_bandwidth``): the standard
deviation, over all pairs, of the squared distances ‖a_i − b_j‖² with their row and column means
removed, which equals 2·std⟨a_i − ā, b_j − b̄⟩. Under noise the mean squared distance is mostly
the noise's own P·Var(noise), so the mean rule puts every kernel value near e⁻¹ and leaves the
correspondence signal in the third decimal; the spread rule scales the kernel to the part of the
distances that varies between pairs (the part balancing does not remove). The mean rule remains
available as ``activation_bandwidth="mean"``. Biases are not used: they are not among the
released weight features.

Spectral matching
-----------------
Leordeanu & Hebert's spectral relaxation: the leading eigenvector of K over all hidden layers
jointly, by power iteration from the uniform vector (pygmtools' start), stopping when
‖v_k − v_{k−1}‖₂ < ``tol`` (pygmtools' rule). The iteration runs on K + sI: the chain of layers
makes K nearly bipartite (the hidden–hidden blocks dominate and couple even layers only to odd
ones), so K has an eigenvalue close to −λ₁ and plain power iteration (pygmtools' ``sm``)
oscillates instead of converging (seen here: λ_min = −21.2 against λ₁ = 24.2 for three layers of
16). K ≥ 0, so its Perron eigenvector is also the leading one of K + sI for every s ≥ 0, and
s ≈ λ₁/2 brings the convergence ratio max(|λ_min + s|, λ₂ + s)/(λ₁ + s) down to about 1/2 or less.
The default s is half of ‖K v₀‖/‖v₀‖ ≤ λ₁, which the first step computes anyway; the dense path
passes K + sI to ``pygmtools.sm``. Then each layer's block of v is discretised to a permutation with
``scipy.optimize.linear_sum_assignment`` (maximise). With a single hidden layer there are no
hidden–hidden edges, K is diagonal and its leading eigenvector is a coordinate vector, so both
solvers solve the (then exact) linear assignment on the diagonal instead; the same holds when
``edge_weight`` is 0.

Scale: the factorised operator
-------------------------------
K is never formed for real layers. With V_ℓ the n_ℓ×n_ℓ block of v,
(Kv)_ℓ = D_ℓ ∘ V_ℓ + E_ℓ(V_{ℓ−1}) + E_{ℓ+1}ᵀ(V_{ℓ+1}), where for a separable kernel
κ(x, y) = Σ_t f_t(x) h_t(y) the block acts as E(V) = Σ_t F_t V H_tᵀ and Eᵀ(U) = Σ_t F_tᵀ U H_t
with F_t = f_t(W^A), H_t = h_t(W^B) applied elementwise. Expansions:

* **few-valued weights** (the multi-bit mechanism's output takes three values per layer:
  centre + half_step·x*, x* ∈ {−1, 0, +1}, with m ≪ d non-zeros per row): detected from the array
  itself (≤ 3 distinct values). With indicator matrices I_v = [W = v] the kernel is exactly
  Σ_{p,q} κ(v_p, v′_q) I_p ⊗ I′_q. Writing the most frequent value's indicator as
  I_0 = J − Σ_{p≥1} I_p (J all ones) turns it into rank-one J terms plus *sparse* indicators:
  when both sides are few-valued no dense n³ product is left at all. When only one side is, the
  exact other side enters through the 3 dense matrices κ(v_p, W) — an exact 3-term expansion —
  and each sparse indicator restricts its dense product to the rows (or columns) it touches.
* **exact weights**: a Chebyshev expansion of κ on the interval [lo, hi] holding both sides'
  values of the layer pair (:func:`gaussian_expansion`), with a computed error bound, compressed
  by the eigen-decomposition of its coefficient core; the number of terms follows from
  ``MatchOptions.expansion_tol``.

Cost of one power-iteration step, in n³-products (one n×n by n×n product, 2n³ flops), per
hidden–hidden block (three hidden layers have two blocks), both directions:

* both sides few-valued: none — gathers over the nnz = m·n non-zeros of the indicators and O(n²)
  elementwise work;
* one side few-valued (a site's exact model against a released one): the dense products are
  restricted to the rows (columns) the indicators touch; with m = 1 the rows of I_− and I_+
  partition the n rows, so about 1 + (1 − e^{−1/2})·2 ≈ 1.8 — 3.6 per step for three layers;
* exact weights: 2R per direction, 4R per block (R expansion terms) — 8R per step for three
  layers, e.g. R = 15–20 at expansion_tol = 1e-4 for Gaussian-like weights.

The diagnostics report the measured count (``n3_products_per_iteration``, from the flops of the
dense products actually run). The dense reference path (``solver="dense"``) builds the same K in pygmtools'
layout and calls ``pygmtools.sm``.

References: Leordeanu & Hebert, "A spectral technique for correspondence problems using pairwise
constraints", ICCV 2005; pygmtools 0.6 (``sm``, ``build_aff_mat``); Trefethen, *Approximation
Theory and Approximation Practice* (ATAP), Thm 8.2 (Chebyshev interpolation of analytic
functions) and Thm 15.2 (Lebesgue constant of Chebyshev points); Sajadmanesh & Gatica-Perez, CCS
2021 (the multi-bit mechanism).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from peer.base.errors import InvalidArgument
from peer.nn.graph import NetworkGraph
from peer.nn.architectures import torch_threads

BANDWIDTH_RULES = ("spread", "mean")
SOLVERS = ("factorised", "dense")
DTYPES = ("auto", "float32", "float64")
# dtype="auto" computes in float64 while every hidden layer has at most this many nodes, float32
# above: float32 products are ~2x faster and need half the memory, and at width 1024 (ε = 1
# multi-bit features) float32 and float64 recovered the same fraction of nodes to within 0.5
# percentage points (the differences are ties broken differently).
AUTO_FLOAT64_MAX_WIDTH = 512
# threads=None runs single-threaded while every hidden layer has at most this many nodes.
AUTO_SINGLE_THREAD_MAX_WIDTH = 512
# Most distinct values a layer's weight array may take to use the exact few-valued expansion.
FEW_VALUED_MAX = 3
# A few-valued indicator denser than this is applied as a dense matrix: sparse products stop paying.
SPARSE_MAX_DENSITY = 0.01
# Highest Chebyshev degree gaussian_expansion tries before giving up.
MAX_CHEBYSHEV_DEGREE = 512


# --------------------------------------------------------------------------------------------
# Options and result
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatchOptions:
    """How to match.

    ``solver``: ``"factorised"`` (default; never forms K) or ``"dense"`` (pygmtools' ``sm`` on
    the dense K; small graphs only).
    ``activation_weight`` / ``edge_weight``: w_act and w_edge, the weights of the normalised
    activation and weight affinities in the merged K (non-negative, not both zero).
    ``activation_sigma`` / ``weight_sigma``: Gaussian bandwidths σ (exp(−d²/σ), σ not squared);
    ``None`` = the public mean-squared-difference rule per layer (module docstring).
    ``max_iter`` / ``tol``: power iteration stops after ``max_iter`` steps or when
    ‖v_k − v_{k−1}‖₂ < ``tol`` (pygmtools' rule and default tolerance).
    ``expansion_tol``: the largest error allowed in any kernel value κ ∈ (0, 1] by the separable
    expansion of exact weights (few-valued weights are expanded exactly).
    ``few_valued``: detect ≤ 3-valued weight arrays and use their exact sparse expansion.
    ``dtype``: ``"auto"`` (float64 while every hidden layer has ≤ 512 nodes, else float32),
    ``"float32"`` or ``"float64"``; the factorised solver's arithmetic. The dense path is float64.
    ``dense_memory_cap``: bytes the dense K may take before ``solver="dense"`` refuses.
    ``shift``: power iteration runs on K + shift·I (the same leading eigenvector, since K ≥ 0);
    ``None`` = half of ‖K v₀‖/‖v₀‖ for the uniform start v₀, i.e. about λ₁/2 (module docstring);
    0 = plain power iteration as in pygmtools' ``sm``.
    ``balance``: Sinkhorn-balance every unary term (module docstring); on by default.
    ``activation_bandwidth``: the public rule for σ_act when ``activation_sigma`` is None:
    ``"spread"`` (default) or ``"mean"`` (module docstring).
    ``threads``: torch intra-op threads (a process-wide torch setting: set on entry, restored on
    exit, so two matches running in threads of one process share it). ``None`` = the products
    run on 1 thread while every hidden layer has ≤ 512 nodes and on torch's current setting
    above, and everything else in the power iteration (gathers, scatter-adds, elementwise work)
    on 1: measured here, torch's ``index_add_`` is 10–300x slower on two threads, and small
    products gain nothing from a second thread and lose 5–10x when another process holds a
    core. A number = every part on that many threads.
    """

    solver: str = "factorised"
    activation_weight: float = 1.0
    edge_weight: float = 1.0
    activation_sigma: float | None = None
    weight_sigma: float | None = None
    max_iter: int = 100
    tol: float = 1e-5
    expansion_tol: float = 1e-4
    few_valued: bool = True
    dtype: str = "auto"
    dense_memory_cap: int = 2 * 2**30
    shift: float | None = None
    threads: int | None = None
    balance: bool = True
    activation_bandwidth: str = "spread"

    def __post_init__(self):
        if self.solver not in SOLVERS:
            raise InvalidArgument("options.solver", f"must be one of {SOLVERS}, got {self.solver!r}")
        if not isinstance(self.balance, bool):
            raise InvalidArgument("options.balance", f"must be true or false, got {self.balance!r}")
        if self.activation_bandwidth not in BANDWIDTH_RULES:
            raise InvalidArgument("options.activation_bandwidth", f"must be one of {BANDWIDTH_RULES}, got {self.activation_bandwidth!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument("options.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("activation_weight", "edge_weight"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"options.{name}", f"must be a finite number >= 0, got {v!r}")
        if self.activation_weight == 0 and self.edge_weight == 0:
            raise InvalidArgument("options.edge_weight", "activation_weight and edge_weight cannot both be 0")
        for name in ("activation_sigma", "weight_sigma"):
            v = getattr(self, name)
            if v is not None and (not _is_real(v) or not math.isfinite(v) or v <= 0):
                raise InvalidArgument(f"options.{name}", f"must be None (public rule) or a finite number > 0, got {v!r}")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, (int, np.integer)) or self.max_iter < 1:
            raise InvalidArgument("options.max_iter", f"must be a positive integer, got {self.max_iter!r}")
        if not _is_real(self.tol) or not 0 < self.tol < 1:
            raise InvalidArgument("options.tol", f"must be in (0, 1), got {self.tol!r}")
        if not _is_real(self.expansion_tol) or not 1e-12 <= self.expansion_tol < 1:
            raise InvalidArgument("options.expansion_tol", f"must be in [1e-12, 1), got {self.expansion_tol!r}")
        if not isinstance(self.few_valued, bool):
            raise InvalidArgument("options.few_valued", f"must be a bool, got {self.few_valued!r}")
        if self.shift is not None and (not _is_real(self.shift) or not math.isfinite(self.shift) or self.shift < 0):
            raise InvalidArgument("options.shift", f"must be None (the rule) or a finite number >= 0, got {self.shift!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, (int, np.integer)) or self.threads < 1):
            raise InvalidArgument("options.threads", f"must be None (the rule) or a positive integer, got {self.threads!r}")
        if isinstance(self.dense_memory_cap, bool) or not isinstance(self.dense_memory_cap, (int, np.integer)) or self.dense_memory_cap <= 0:
            raise InvalidArgument("options.dense_memory_cap", f"must be a positive number of bytes, got {self.dense_memory_cap!r}")


@dataclass(frozen=True)
class MatchResult:
    """What a matcher returns, whichever solver ran.

    ``permutations[ℓ][i] = j``: node i of A's hidden layer ℓ is matched to node j of B's, so B
    aligned to A is ``B[perm]`` (rows of its incoming weights, its bias, its activations).
    ``objective``: xᵀKx of the discrete solution, computed from exact kernel values in the same
    way for both solvers (:meth:`Affinity.objective`). ``relaxed[ℓ]``: the leading-eigenvector
    estimate reshaped to n_ℓ×n_ℓ ([i, j] = pair (A node i, B node j)), unit norm over all
    layers — what pygmtools' ``sm`` returns. ``iterations``: power-iteration steps taken;
    ``converged``: whether ‖v_k − v_{k−1}‖ < tol was reached. ``diagnostics``: expansions and
    their error bounds, bandwidths, normalisers, products per iteration, timings.
    """

    permutations: tuple[np.ndarray, ...]
    objective: float
    solver: str
    iterations: int
    converged: bool
    relaxed: tuple[np.ndarray, ...]
    diagnostics: Mapping[str, Any] = field(default_factory=dict)


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# --------------------------------------------------------------------------------------------
# Separable expansions of the scalar Gaussian kernel
# --------------------------------------------------------------------------------------------


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float64 through torch, so that it runs on the torch threads match_graphs sets:
    numpy's BLAS starts all its threads even for small products, and stalls when a core is busy."""
    return (torch.as_tensor(np.asarray(a, dtype=np.float64)) @ torch.as_tensor(np.asarray(b, dtype=np.float64))).numpy()


def gaussian_kernel(x, y, sigma: float):
    """κ(x, y) = exp(−(x − y)² / σ) elementwise (broadcasting); numpy or torch."""
    d = x - y
    if isinstance(d, torch.Tensor):
        return torch.exp(-(d * d) / sigma)
    return np.exp(-(d * d) / sigma)


def chebyshev_interpolation_bound(beta: float, degree: int) -> float:
    """Sup-norm error bound of the 2-D tensor Chebyshev interpolant of g(s, t) = exp(−β(s−t)²)
    on [−1, 1]² at the (degree+1)² Chebyshev points of the second kind.

    For fixed real t, g(·, t) is entire and on the Bernstein ellipse E_ρ (semi-axes
    (ρ ± ρ⁻¹)/2) |g(s, t)| = exp(−β Re((s−t)²)) ≤ exp(β b²) with b = (ρ − ρ⁻¹)/2 the ellipse's
    half-height. ATAP Thm 8.2 bounds the 1-D interpolation error by E = 4 M ρ^{−p} / (ρ − 1),
    M = exp(β b²). For the tensor interpolant, f − I_s I_t f = (f − I_s f) + I_s (f − I_t f), so the
    error is ≤ (1 + Λ_p) E with Λ_p ≤ (2/π) log(p + 1) + 1 the Lebesgue constant (ATAP Thm 15.2).
    Every ρ > 1 gives a valid bound; the smallest over a fine grid of ρ is returned.
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
    log_b = np.log1p(lebesgue) + math.log(4.0) + beta * b * b - p * _LOG_RHO[None, :] - np.log(np.expm1(_LOG_RHO))[None, :]
    return np.exp(np.minimum(log_b.min(axis=1), 700.0))


@dataclass(frozen=True)
class ChebyshevExpansion:
    """κ(x, y) = exp(−(x−y)²/σ) on [lo, hi]² ≈ Σ_r λ_r φ_r(x) φ_r(y).

    φ_r(x) = Σ_j U[j, r] T_j((x − c)/h) with c, h the interval's centre and half-width: the
    eigenvectors of the symmetric coefficient core C of the 2-D Chebyshev interpolant
    Σ_{j,l} C[j, l] T_j T_l (C = U diag(λ) Uᵀ), keeping the terms whose weight |λ_r|·‖U_r‖₁² is
    largest. Since |T_j| ≤ 1 on the interval, |φ_r| ≤ ‖U_r‖₁, so the dropped terms add at most
    Σ_dropped |λ_r| ‖U_r‖₁² to the interpolation bound. ``error_bound`` is the sum: a rigorous
    bound on |κ − expansion| over [lo, hi]² in exact arithmetic (floating-point rounding of
    the evaluation, ~1e-7 relative in float32, is not included).
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
        c = (self.hi + self.lo) / 2.0
        h = (self.hi - self.lo) / 2.0
        out = np.empty((self.terms, flat.shape[0]))
        chunk = max(1, (1 << 22) // (self.degree + 1))
        for start in range(0, flat.shape[0], chunk):
            s = (flat[start : start + chunk] - c) / h if h > 0 else np.zeros_like(flat[start : start + chunk])
            cheb = np.empty((self.degree + 1, s.shape[0]))
            cheb[0] = 1.0
            if self.degree >= 1:
                cheb[1] = s
            for j in range(2, self.degree + 1):
                np.multiply(s, cheb[j - 1], out=cheb[j])
                cheb[j] *= 2.0
                cheb[j] -= cheb[j - 2]
            out[:, start : start + chunk] = _matmul(self.eigenvectors.T, cheb)
        return out.reshape((self.terms, *x.shape))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The expansion's value at every pair (x[a], y[b]) of two 1-D arrays."""
        fx = self.functions(np.asarray(x, dtype=np.float64))
        fy = self.functions(np.asarray(y, dtype=np.float64))
        return np.einsum("r,ra,rb->ab", self.eigenvalues, fx, fy)


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
        if best is None or cand.terms < best.terms or (cand.terms == best.terms and cand.error_bound < best.error_bound):
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


# --------------------------------------------------------------------------------------------
# Structured factors: c·J + (sparse or dense)
# --------------------------------------------------------------------------------------------


class _Sparse:
    """A sparse matrix as sorted coordinate lists, applied with gathers and ``index_add_``.

    Built for the indicator matrices of few-valued weights, which typically hold one non-zero
    per row (the multi-bit mechanism's m sampled coordinates); on this machine a gather is ~40x
    faster than ``torch.sparse.mm`` for them. ``touched`` lists the non-empty rows and
    ``local`` maps each non-zero to its position in ``touched``.
    """

    __slots__ = ("shape", "rows", "cols", "vals", "unit", "touched", "local", "one_per_row", "full")

    def __init__(self, shape, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor):
        self.shape = (int(shape[0]), int(shape[1]))
        order = torch.argsort(rows * self.shape[1] + cols)
        self.rows, self.cols, self.vals = rows[order], cols[order], vals[order]
        self.unit = bool(torch.all(self.vals == 1))
        self.touched, self.local = torch.unique_consecutive(self.rows, return_inverse=True)
        self.one_per_row = self.touched.shape[0] == self.rows.shape[0]
        # every row holds exactly one non-zero (the multi-bit mechanism with m = 1, both signs)
        self.full = self.one_per_row and self.touched.shape[0] == self.shape[0]

    @property
    def nnz(self) -> int:
        return int(self.rows.shape[0])

    def t(self) -> "_Sparse":
        return _Sparse((self.shape[1], self.shape[0]), self.cols, self.rows, self.vals)

    def scaled(self, s: float) -> "_Sparse":
        return _Sparse(self.shape, self.rows, self.cols, self.vals * s)

    def _chunks(self, other: int):
        step = max(1, (1 << 24) // max(1, other))
        for start in range(0, self.nnz, step):
            yield slice(start, start + step)

    def matvec(self, u: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.shape[0], dtype=u.dtype).index_add_(0, self.rows, u[self.cols] * self.vals)

    def touched_rows_times(self, v: torch.Tensor) -> torch.Tensor:
        """S[touched] @ V, shape (len(touched), V.shape[1])."""
        if self.one_per_row and self.nnz * v.shape[1] <= (1 << 24):
            g = v.index_select(0, self.cols)
            return g if self.unit else g * self.vals[:, None]
        out = torch.zeros((self.touched.shape[0], v.shape[1]), dtype=v.dtype)
        for ch in self._chunks(v.shape[1]):
            g = v.index_select(0, self.cols[ch])
            out.index_add_(0, self.local[ch], g if self.unit else g * self.vals[ch, None])
        return out

    def times_t(self, m: torch.Tensor, touched_only: bool = False) -> torch.Tensor:
        """M @ Sᵀ, shape (M.shape[0], S.shape[0]), or only its columns ``touched``."""
        if self.one_per_row and (touched_only or self.full):
            # column c of the result is column cols[c] of M, scaled: a gather, no scatter
            g = m.index_select(1, self.cols)
            return g if self.unit else g * self.vals
        width = self.touched.shape[0] if touched_only else self.shape[0]
        target = self.local if touched_only else self.rows
        out = torch.zeros((m.shape[0], width), dtype=m.dtype)
        for ch in self._chunks(m.shape[0]):
            g = m.index_select(1, self.cols[ch])
            out.index_add_(1, target[ch], g if self.unit else g * self.vals[ch])
        return out


class _Factor:
    """A matrix c·J + R (J all ones; R a _Sparse, a dense tensor, or absent)."""

    __slots__ = ("shape", "ones", "sparse", "dense")

    def __init__(self, shape, ones: float = 0.0, sparse: _Sparse | None = None, dense: torch.Tensor | None = None):
        self.shape = (int(shape[0]), int(shape[1]))
        self.ones = float(ones)
        self.sparse = sparse
        self.dense = dense

    def t(self) -> "_Factor":
        return _Factor((self.shape[1], self.shape[0]), self.ones,
                       None if self.sparse is None else self.sparse.t(),
                       None if self.dense is None else self.dense.T)

    def scaled(self, s: float) -> "_Factor":
        return _Factor(self.shape, self.ones * s,
                       None if self.sparse is None else self.sparse.scaled(s),
                       None if self.dense is None else self.dense * s)

    def matvec_rest(self, u: torch.Tensor) -> torch.Tensor | None:
        """R u (the non-constant part times a vector), or None when R is absent."""
        if self.sparse is not None:
            return self.sparse.matvec(u)
        if self.dense is not None:
            return self.dense @ u
        return None


class _Cost:
    """Counts dense matrix products and their flops (per application of K), and runs them on
    ``product_threads`` torch threads while everything else stays on the caller's setting:
    on this machine torch's ``index_add_`` is 10–300x slower with two threads than with one,
    while a large product can use both cores (switching costs ~0.4 µs)."""

    __slots__ = ("products", "flops", "product_threads")

    def __init__(self, product_threads: int | None = None):
        self.products = 0
        self.flops = 0.0
        self.product_threads = product_threads

    def add(self, a: int, b: int, c: int):
        self.products += 1
        self.flops += 2.0 * a * b * c

    def threads(self):
        """A context running torch on ``product_threads`` (no change when None)."""
        return torch_threads(self.product_threads) if self.product_threads is not None else nullcontext()


class _RankOne:
    """V's sums, computed once per block application, and the rank-one parts of the result
    (c·J, w 1ᵀ, 1 wᵀ) accumulated as a scalar and two vectors, added to the output once."""

    __slots__ = ("total", "col_sums", "row_sums", "scalar", "per_row", "per_col")

    def __init__(self, v: torch.Tensor, n_rows: int):
        self.total = v.sum()
        self.col_sums = v.sum(dim=0)  # Vᵀ1
        self.row_sums = v.sum(dim=1)  # V1
        self.scalar = torch.zeros((), dtype=v.dtype)
        self.per_row = torch.zeros(n_rows, dtype=v.dtype)  # out[i, j] += per_row[i]
        self.per_col = torch.zeros(n_rows, dtype=v.dtype)  # out[i, j] += per_col[j]

    def add_to(self, out: torch.Tensor) -> None:
        out += self.per_row[:, None]
        out += (self.per_col + self.scalar)[None, :]


def _apply_term(f: _Factor, h: _Factor, v: torch.Tensor, ones: _RankOne, out: torch.Tensor, cost: _Cost) -> None:
    """out += F V Hᵀ for F = c_F J + R_F (n×n′), V (n′×n′), H = c_H J + R_H (n×n′).

    (c_F J + R_F) V (c_H J + R_H)ᵀ = c_F c_H (1ᵀV1) J + c_F 1 (R_H Vᵀ1)ᵀ + c_H (R_F V1) 1ᵀ + R_F V R_Hᵀ:
    the J terms cost matrix-vector products only (accumulated in ``ones``); R_F V R_Hᵀ costs no
    dense product when both are sparse, one (restricted to the touched rows/columns) when one
    is sparse, two when both are dense.
    """
    if f.ones and h.ones:
        ones.scalar += f.ones * h.ones * ones.total
    if f.ones:
        w = h.matvec_rest(ones.col_sums)
        if w is not None:
            ones.per_col += f.ones * w
    if h.ones:
        w = f.matvec_rest(ones.row_sums)
        if w is not None:
            ones.per_row += h.ones * w
    if f.sparse is None and f.dense is None or h.sparse is None and h.dense is None:
        return
    if f.sparse is not None:
        m = f.sparse.touched_rows_times(v)  # the touched rows of R_F V
        if h.sparse is not None:
            part = h.sparse.times_t(m)
        else:
            cost.add(m.shape[0], m.shape[1], h.shape[0])
            with cost.threads():
                part = m @ h.dense.T
        out.index_add_(0, f.sparse.touched, part)
    elif h.sparse is not None:
        q = h.sparse.times_t(v, touched_only=True)  # the touched columns of V R_Hᵀ
        cost.add(f.shape[0], f.shape[1], q.shape[1])
        with cost.threads():
            part = f.dense @ q
        out.index_add_(1, h.sparse.touched, part)
    else:
        cost.add(f.shape[0], f.shape[1], v.shape[1])
        cost.add(f.shape[0], v.shape[1], h.shape[0])
        with cost.threads():
            out += (f.dense @ v) @ h.dense.T


class _Stacked:
    """Σ_r F_r V H_rᵀ for R dense terms, stored as (n, R, n′) so that the sum is two GEMMs.

    With Φ[i, r, k] = F_r[i, k] and Ψ[j, r, l] = H_r[j, l]:
    E(V) = reshape(Φ → (nR, n′)) @ V, viewed as (n, R·n′), times reshape(Ψ → (n, R·n′))ᵀ;
    Eᵀ(U) = reshape(Φ → (nR, n′))ᵀ @ reshape(U @ reshape(Ψ → (n, R·n′)) → (nR, n′)).
    The flops are those of 2R separate products; a few large GEMMs run much closer to the
    machine's peak than many small ones. The terms are kept in groups of ``GROUP`` so that the
    intermediate is GROUP·n·n′, not R·n·n′.
    """

    GROUP = 4
    __slots__ = ("phi", "psi", "transposed")

    def __init__(self, phi: list[torch.Tensor], psi: list[torch.Tensor], transposed: bool = False):
        self.phi, self.psi, self.transposed = phi, psi, transposed

    def t(self) -> "_Stacked":
        return _Stacked(self.phi, self.psi, not self.transposed)

    def apply(self, v: torch.Tensor, out: torch.Tensor, cost: _Cost) -> None:
        for phi_g, psi_g in zip(self.phi, self.psi):
            n, r, m = phi_g.shape
            phi = phi_g.reshape(n * r, m)
            psi = psi_g.reshape(n, r * m)
            with cost.threads():
                if not self.transposed:
                    cost.add(n * r, m, m)
                    cost.add(n, r * m, n)
                    out += (phi @ v).reshape(n, r * m) @ psi.T
                else:
                    cost.add(n, n, r * m)
                    cost.add(m, n * r, m)
                    out += phi.T @ (v @ psi).reshape(n * r, m)


# --------------------------------------------------------------------------------------------
# The affinity
# --------------------------------------------------------------------------------------------


@dataclass
class _Block:
    """Weights between two layers (hidden–hidden, or a hidden layer and a fixed one)."""

    name: str
    kind: str  # "hidden" | "input" | "output"
    weights_a: np.ndarray  # (n_rows, n_cols, e)
    weights_b: np.ndarray
    sigma: float
    expansion: str  # "table" | "table-a" | "table-b" | "chebyshev"
    values_a: np.ndarray | None
    values_b: np.ndarray | None
    chebyshev: ChebyshevExpansion | None
    mean_kernel: float = 0.0
    normaliser: float = 0.0
    scale: float = 0.0  # w_edge / (ν · e)
    terms: list = field(default_factory=list)  # (F, H) pairs or a _Stacked, scaled by `scale`
    terms_t: list = field(default_factory=list)  # the same, transposed
    function_means: dict = field(default_factory=dict)  # component -> float64 means of φ_r(W_a), φ_r(W_b)

    @property
    def error_bound(self) -> float:
        return self.chebyshev.error_bound if self.chebyshev is not None else 0.0

    @property
    def terms_per_component(self) -> int:
        """Separable terms of the scalar kernel expansion (per weight component)."""
        if self.expansion in ("table", "table-a"):
            return len(self.values_a)
        if self.expansion == "table-b":
            return len(self.values_b)
        return self.chebyshev.terms

    def describe(self) -> dict:
        d = {
            "block": self.name,
            "expansion": self.expansion,
            "terms": self.terms_per_component,
            "components": int(self.weights_a.shape[2]),
            "sigma": self.sigma,
            "mean_kernel": self.mean_kernel,
            "normaliser": self.normaliser,
            "error_bound": self.error_bound,
        }
        if self.chebyshev is not None:
            d.update(degree=self.chebyshev.degree, interval=[self.chebyshev.lo, self.chebyshev.hi],
                     interpolation_bound=self.chebyshev.interpolation_bound,
                     truncation_bound=self.chebyshev.truncation_bound)
        if self.values_a is not None:
            d["values_a"] = self.values_a.tolist()
        if self.values_b is not None:
            d["values_b"] = self.values_b.tolist()
        return d


def _mean_kernel(block: _Block) -> float:
    """κ̄: the mean of κ over all pairs of A's and B's weight values of the block, averaged over
    the e components, in float64 — exact for few-valued weights (value frequencies, or the exact
    side's mean of κ(v_p, ·)), and within the expansion's error bound for exact weights
    (Σ_r λ_r mean φ_r(A) · mean φ_r(B), which never forms a pair)."""
    total = 0.0
    e = block.weights_a.shape[2]
    for c in range(e):
        wa = block.weights_a[:, :, c]
        wb = block.weights_b[:, :, c]
        if block.expansion == "chebyshev":
            ch = block.chebyshev
            means_a, means_b = block.function_means.get(c) or (_function_means(ch, wa), _function_means(ch, wb))
            total += float(np.dot(ch.eigenvalues, means_a * means_b))
            continue
        va = block.values_a if block.expansion in ("table", "table-a") else None
        vb = block.values_b if block.expansion in ("table", "table-b") else None
        if va is not None and vb is not None:
            fa = np.array([np.count_nonzero(wa == v) for v in va]) / wa.size
            fb = np.array([np.count_nonzero(wb == v) for v in vb]) / wb.size
            total += float(fa @ gaussian_kernel(va[:, None], vb[None, :], block.sigma) @ fb)
        elif va is not None:
            fa = np.array([np.count_nonzero(wa == v) for v in va]) / wa.size
            total += float(sum(fa[p] * gaussian_kernel(va[p], wb, block.sigma).mean() for p in range(len(va))))
        else:
            fb = np.array([np.count_nonzero(wb == v) for v in vb]) / wb.size
            total += float(sum(fb[q] * gaussian_kernel(wa, vb[q], block.sigma).mean() for q in range(len(vb))))
    return total / e


def _function_means(ch: ChebyshevExpansion, w: np.ndarray) -> np.ndarray:
    """mean over w's entries of each φ_r, in float64, chunk by chunk."""
    flat = w.reshape(-1)
    chunk = 1 << 20
    acc = np.zeros(ch.terms)
    for start in range(0, flat.shape[0], chunk):
        acc += ch.functions(flat[start : start + chunk]).sum(axis=1)
    return acc / flat.shape[0]


def _mean_sq_bandwidth(x: np.ndarray, y: np.ndarray) -> float:
    """Mean of ‖x_i − y_j‖² over all pairs of rows (closed form); 1.0 when it is 0."""
    x = x.reshape(x.shape[0], -1)
    y = y.reshape(y.shape[0], -1)
    s = float(np.mean(np.sum(x * x, axis=1)) + np.mean(np.sum(y * y, axis=1)) - 2.0 * np.dot(x.mean(axis=0), y.mean(axis=0)))
    return s if s > 1e-300 else 1.0


def _sparse_indicator(mask: np.ndarray, dtype: torch.dtype, coef: float = 1.0) -> _Sparse:
    r, c = np.nonzero(mask)
    return _Sparse(mask.shape, torch.as_tensor(r, dtype=torch.int64), torch.as_tensor(c, dtype=torch.int64),
                   torch.full((r.shape[0],), coef, dtype=dtype))


def _indicator_factor(mask: np.ndarray, dtype: torch.dtype) -> _Factor:
    if np.count_nonzero(mask) <= SPARSE_MAX_DENSITY * mask.size:
        return _Factor(mask.shape, sparse=_sparse_indicator(mask, dtype))
    return _Factor(mask.shape, dense=torch.as_tensor(mask.astype(np.float64), dtype=dtype))


def _table_right_factor(w: np.ndarray, values: np.ndarray, coefs: np.ndarray, dtype: torch.dtype) -> _Factor:
    """coefs[0]·J + Σ_{q≥1} coefs[q]·[w = values[q]] as one factor."""
    masks = [(w == values[q], coefs[q]) for q in range(1, len(values)) if coefs[q] != 0.0]
    if not masks:
        return _Factor(w.shape, ones=coefs[0])
    if sum(int(np.count_nonzero(m)) for m, _ in masks) <= SPARSE_MAX_DENSITY * w.size:
        parts = [_sparse_indicator(m, dtype, c) for m, c in masks]  # disjoint supports
        sp = _Sparse(w.shape, torch.cat([p.rows for p in parts]), torch.cat([p.cols for p in parts]),
                     torch.cat([p.vals for p in parts]))
        return _Factor(w.shape, ones=coefs[0], sparse=sp)
    dense = np.zeros(w.shape)
    for m, c in masks:
        dense[m] += c
    return _Factor(w.shape, ones=coefs[0], dense=torch.as_tensor(dense, dtype=dtype))


def _block_terms(block: _Block, dtype: torch.dtype) -> list:
    """The separable terms of one block (unscaled), summed over its e components: (F_t, H_t)
    pairs, or a _Stacked group of dense terms. Records the Chebyshev function means on the
    block for κ̄."""
    terms = []
    sigma = block.sigma
    for c in range(block.weights_a.shape[2]):
        wa = block.weights_a[:, :, c]
        wb = block.weights_b[:, :, c]
        shape = wa.shape
        if block.expansion == "table":
            va, vb = block.values_a, block.values_b
            table = gaussian_kernel(va[:, None], vb[None, :], sigma)
            # κ = Σ T[p,q] I_p ⊗ I′_q with I_0 = J − Σ_{p≥1} I_p: in the basis (J, I_1, I_2) the
            # coefficients are S = Pᵀ T P, P = [[1, −1, −1], [0, 1, 0], [0, 0, 1]] (cut to size).
            pa = np.eye(len(va))
            pa[0, 1:] = -1.0
            pb = np.eye(len(vb))
            pb[0, 1:] = -1.0
            s = pa.T @ table @ pb
            for p in range(len(va)):
                f = _Factor(shape, ones=1.0) if p == 0 else _indicator_factor(wa == va[p], dtype)
                terms.append((f, _table_right_factor(wb, vb, s[p], dtype)))
        elif block.expansion == "table-a":
            va = block.values_a
            k0 = gaussian_kernel(va[0], wb, sigma)
            terms.append((_Factor(shape, ones=1.0), _Factor(shape, dense=torch.as_tensor(k0, dtype=dtype))))
            for p in range(1, len(va)):
                diff = gaussian_kernel(va[p], wb, sigma) - k0
                terms.append((_indicator_factor(wa == va[p], dtype), _Factor(shape, dense=torch.as_tensor(diff, dtype=dtype))))
        elif block.expansion == "table-b":
            vb = block.values_b
            k0 = gaussian_kernel(wa, vb[0], sigma)
            terms.append((_Factor(shape, dense=torch.as_tensor(k0, dtype=dtype)), _Factor(shape, ones=1.0)))
            for q in range(1, len(vb)):
                diff = gaussian_kernel(wa, vb[q], sigma) - k0
                terms.append((_Factor(shape, dense=torch.as_tensor(diff, dtype=dtype)), _indicator_factor(wb == vb[q], dtype)))
        else:
            ch = block.chebyshev
            phi, means_a = _stacked_functions(ch, wa, dtype)
            psi, means_b = _stacked_functions(ch, wb, dtype)
            block.function_means[c] = (means_a, means_b)
            lam = torch.as_tensor(ch.eigenvalues, dtype=dtype)
            for k, grp in enumerate(psi):
                grp *= lam[k * _Stacked.GROUP : k * _Stacked.GROUP + grp.shape[1]][None, :, None]
            terms.append(_Stacked(phi, psi))
    return terms


def _rescale(terms: list, s: float) -> list:
    """The terms with every H multiplied by s (in place for stacked dense terms)."""
    out = []
    for t in terms:
        if isinstance(t, _Stacked):
            for grp in t.psi:
                grp *= s
            out.append(t)
        else:
            out.append((t[0], t[1].scaled(s)))
    return out


def _stacked_functions(ch: ChebyshevExpansion, w: np.ndarray, dtype: torch.dtype) -> tuple[list[torch.Tensor], np.ndarray]:
    """φ_r(w) for a 2-D w (n, n′), as groups of _Stacked.GROUP terms laid out (n, group, n′),
    built a few rows at a time (no full-size temporary); and the float64 mean of each φ_r(w)."""
    n, m = w.shape
    g = _Stacked.GROUP
    groups = [torch.empty((n, min(g, ch.terms - r), m), dtype=dtype) for r in range(0, ch.terms, g)]
    sums = np.zeros(ch.terms)
    rows = max(1, (1 << 20) // max(1, m))
    for i in range(0, n, rows):
        vals = ch.functions(w[i : i + rows])  # (R, rows, n′), float64
        sums += vals.sum(axis=(1, 2))
        for k, grp in enumerate(groups):
            grp[i : i + rows] = torch.as_tensor(vals[k * g : (k + 1) * g].transpose(1, 0, 2), dtype=dtype)
    return groups, sums / w.size


def _apply_block(terms, v: torch.Tensor, n_rows: int, cost: _Cost, out: torch.Tensor | None = None) -> torch.Tensor:
    """out += Σ_t F_t V H_tᵀ (a new zero matrix when ``out`` is None), returned."""
    if out is None:
        out = torch.zeros((n_rows, n_rows), dtype=v.dtype)
    ones = None
    for term in terms:
        if isinstance(term, _Stacked):
            term.apply(v, out, cost)
        else:
            ones = ones or _RankOne(v, n_rows)
            _apply_term(term[0], term[1], v, ones, out, cost)
    if ones is not None:
        ones.add_to(out)
    return out


def _transposed(term):
    if isinstance(term, _Stacked):
        return term.t()
    return (term[0].t(), term[1].t())


class Affinity:
    """The merged, normalised affinity K of two graphs (see the module docstring).

    Shared by both solvers: bandwidths, expansions, normalisers and the objective are computed
    once, here, so the factorised operator (:meth:`matvec`) and the dense matrix
    (:meth:`dense`) describe the same K — exactly for few-valued weights, and up to the
    reported expansion error bound in each kernel value otherwise.
    """

    def __init__(self, graph_a: NetworkGraph, graph_b: NetworkGraph, options: MatchOptions | None = None, *, build_operator: bool = True):
        t0 = time.perf_counter()
        self.options = options = MatchOptions() if options is None else options
        if not isinstance(options, MatchOptions):
            raise InvalidArgument("options", f"must be a MatchOptions, got {type(options).__name__}")
        _check_graphs(graph_a, graph_b)
        self.graph_a, self.graph_b = graph_a, graph_b
        self.sizes = tuple(int(s) for s in graph_a.sizes)
        self.offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum([n * n for n in self.sizes])]))
        self.pairs = self.offsets[-1]
        if options.dtype == "auto":
            self.dtype = torch.float64 if max(self.sizes) <= AUTO_FLOAT64_MAX_WIDTH else torch.float32
        else:
            self.dtype = torch.float64 if options.dtype == "float64" else torch.float32

        # Activation affinity per hidden layer, balanced (or normalised by its mean). The row
        # and column factors are kept: the objective applies them to exact kernel values.
        self.activation_sigma: list[float] = []
        self.activation_mean: list[float] = []
        self._activation: list[np.ndarray] = []
        self._activation_factors: list[tuple[np.ndarray, np.ndarray]] = []
        for ell, (ha, hb) in enumerate(zip(graph_a.hidden, graph_b.hidden)):
            if options.activation_sigma is not None:
                sigma = options.activation_sigma
            elif options.activation_bandwidth == "spread":
                sigma = _spread_bandwidth(ha.activations, hb.activations)
            else:
                sigma = _mean_sq_bandwidth(ha.activations, hb.activations)
            sq = _squared_distances(ha.activations, hb.activations)
            if options.balance:
                # Row and column factors do not change the balanced matrix, so take them out of
                # the exponent first: exp(−(d² − row mean − column mean + mean)/σ). Under heavy
                # noise exp(−d²/σ) itself underflows to 0 in whole rows.
                offsets = (sq.mean(axis=1), sq.mean(axis=0), float(sq.mean()))
            else:
                offsets = (np.zeros(sq.shape[0]), np.zeros(sq.shape[1]), 0.0)
            na = np.exp(-(sq - offsets[0][:, None] - offsets[1][None, :] + offsets[2]) / sigma)
            mean = float(na.mean())
            if not mean > 0 or not np.all(np.isfinite(na)):
                raise InvalidArgument("options.activation_sigma", f"{sigma:g} makes the activation affinities of hidden layer {ell} underflow to 0 or overflow")
            if options.balance:
                r, c = sinkhorn_factors(na, f"activation affinity of hidden layer {ell}")
            else:
                r, c = np.full(na.shape[0], 1.0 / mean), np.ones(na.shape[1])
            self.activation_sigma.append(float(sigma))
            self.activation_mean.append(mean)
            self._activation.append(r[:, None] * na * c[None, :])
            self._activation_factors.append((r, c, offsets))

        # Weight blocks: input -> hidden 0, hidden ℓ−1 -> hidden ℓ, hidden L−1 -> output.
        L = len(self.sizes)
        specs = [("input->0", "input", graph_a.hidden[0].incoming, graph_b.hidden[0].incoming)]
        for ell in range(1, L):
            specs.append((f"{ell - 1}->{ell}", "hidden", graph_a.hidden[ell].incoming, graph_b.hidden[ell].incoming))
        specs.append((f"{L - 1}->output", "output", graph_a.output_incoming, graph_b.output_incoming))
        self.blocks: list[_Block] = []
        for name, kind, wa, wb in specs:
            self.blocks.append(self._make_block(name, kind, np.asarray(wa, dtype=np.float64), np.asarray(wb, dtype=np.float64)))
        self.hidden_blocks = [b for b in self.blocks if b.kind == "hidden"]

        # Normalisers (shared by both solvers): ν = (neighbours) · κ̄, κ̄ in float64. The factorised
        # operator's terms are built first, unscaled, so that κ̄ reuses their function means.
        for b in self.blocks:
            e = b.weights_a.shape[2]
            build = build_operator and options.edge_weight > 0
            terms = _block_terms(b, self.dtype) if build else []
            b.mean_kernel = _mean_kernel(b)
            if not b.mean_kernel > 0:
                raise InvalidArgument("options.weight_sigma", f"{b.sigma:g} is so small that every weight affinity of block {b.name} underflows to 0")
            n_rows, n_cols = b.weights_a.shape[:2]
            neighbours = {"input": n_cols, "output": n_rows, "hidden": math.sqrt(n_rows * n_cols)}[b.kind]
            b.normaliser = neighbours * b.mean_kernel
            b.scale = options.edge_weight / (b.normaliser * e)
            if build:
                b.terms = _rescale(terms, b.scale)
                if b.kind == "hidden":
                    b.terms_t = [_transposed(t) for t in b.terms]
        # Balancing factors of the fixed-layer unary terms U_in, U_out (set where they are built).
        self._fixed_factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._unary: list[torch.Tensor] | None = None
        if build_operator:
            self._unary = self._factorised_unary()
            for b in self.blocks:
                if b.kind != "hidden":
                    b.terms = []  # only the unary they produced is needed from now on
        self.setup_seconds = time.perf_counter() - t0

    @property
    def is_diagonal(self) -> bool:
        """No hidden–hidden couplings: one hidden layer, or edge_weight = 0."""
        return len(self.sizes) == 1 or self.options.edge_weight == 0

    # -- construction helpers ----------------------------------------------------------------

    def _make_block(self, name: str, kind: str, wa: np.ndarray, wb: np.ndarray) -> _Block:
        opts = self.options
        sigma = opts.weight_sigma if opts.weight_sigma is not None else _mean_sq_bandwidth(wa.reshape(-1, 1), wb.reshape(-1, 1))
        va = few_values(wa) if opts.few_valued else None
        vb = few_values(wb) if opts.few_valued else None
        cheb = None
        if va is not None and vb is not None:
            kind_exp = "table"
        elif va is not None:
            kind_exp = "table-a"
        elif vb is not None:
            kind_exp = "table-b"
        else:
            kind_exp = "chebyshev"
            lo = float(min(wa.min(), wb.min()))
            hi = float(max(wa.max(), wb.max()))
            cheb = gaussian_expansion(lo, hi, sigma, opts.expansion_tol)
        return _Block(name, kind, wa, wb, float(sigma), kind_exp, va, vb, cheb)

    def _factorised_unary(self) -> list[torch.Tensor]:
        opts = self.options
        cost = _Cost()
        unary = []
        for na in self._activation:
            unary.append(torch.as_tensor(na * opts.activation_weight, dtype=self.dtype))
        inp, out = self.blocks[0], self.blocks[-1]
        if opts.edge_weight > 0:
            eye_in = torch.eye(inp.weights_a.shape[1], dtype=self.dtype)
            u_in = _apply_block(inp.terms, eye_in, self.sizes[0], cost)
            unary[0] += torch.as_tensor(self._balanced_fixed("input", u_in.numpy().astype(np.float64)), dtype=self.dtype)
            eye_out = torch.eye(out.weights_a.shape[0], dtype=self.dtype)
            u_out = _apply_block([_transposed(t) for t in out.terms], eye_out, self.sizes[-1], cost)
            unary[-1] += torch.as_tensor(self._balanced_fixed("output", u_out.numpy().astype(np.float64)), dtype=self.dtype)
        return unary

    def _balanced_fixed(self, which: str, u: np.ndarray) -> torch.Tensor | np.ndarray:
        """A fixed-layer unary term (already scaled by its normaliser and edge_weight), balanced
        when asked; records its balancing factors for the objective."""
        if self.options.balance:
            r, c = sinkhorn_factors(u, f"{which} weight affinity")
            r = r * self.options.edge_weight  # balanced terms have mean 1; keep the merge weight
        else:
            r, c = np.ones(u.shape[0]), np.ones(u.shape[1])
        self._fixed_factors[which] = (r, c)
        return r[:, None] * u * c[None, :]

    # -- the operator ------------------------------------------------------------------------

    def apply(self, v: Sequence[torch.Tensor], cost: _Cost | None = None) -> list[torch.Tensor]:
        """K v with v given per layer as n_ℓ×n_ℓ tensors ([i, j] = pair (A node i, B node j))."""
        if self._unary is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        cost = _Cost() if cost is None else cost
        out = [d * x for d, x in zip(self._unary, v)]
        for ell, b in enumerate(self.hidden_blocks, start=1):
            if not b.terms:
                continue
            _apply_block(b.terms, v[ell - 1], self.sizes[ell], cost, out=out[ell])
            _apply_block(b.terms_t, v[ell], self.sizes[ell - 1], cost, out=out[ell - 1])
        return out

    def diagonal(self) -> list[np.ndarray]:
        """D_ℓ (n_ℓ×n_ℓ, [i, j] = pair (A node i, B node j)) as the factorised operator uses it."""
        if self._unary is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        return [x.numpy().astype(np.float64) for x in self._unary]

    def to_layers(self, vec: np.ndarray) -> list[np.ndarray]:
        """Split a vector in the stacked pygmtools layout into per-layer [i, j] matrices."""
        vec = np.asarray(vec)
        return [vec[o : o + n * n].reshape(n, n).T for o, n in zip(self.offsets, self.sizes)]

    def from_layers(self, layers: Sequence[np.ndarray]) -> np.ndarray:
        """Stack per-layer [i, j] matrices into one vector in the pygmtools layout (vec column-major)."""
        return np.concatenate([np.asarray(x).T.reshape(-1) for x in layers])

    def matvec(self, vec: np.ndarray) -> np.ndarray:
        """K·vec through the factorised operator, in the dense layout (for tests and checks)."""
        layers = [torch.as_tensor(np.ascontiguousarray(x), dtype=self.dtype) for x in self.to_layers(vec)]
        return self.from_layers([x.numpy().astype(np.float64) for x in self.apply(layers)])

    # -- the dense reference -----------------------------------------------------------------

    def dense_bytes(self) -> int:
        return self.pairs * self.pairs * 8

    def dense(self) -> np.ndarray:
        """K as a dense float64 (M×M) matrix, M = Σ n_ℓ², from exact kernel values.

        Layout (pygmtools'): within hidden layer ℓ, the pair (A node i, B node j) is row
        offset_ℓ + j·n_ℓ + i (vec(X) column-major, K indexed by (node2, node1) pairs); the layers'
        blocks are stacked. pygmtools' K for the union of all hidden nodes would add rows and
        columns for pairs across layers, which are all zero (those assignments are forbidden);
        this is its principal submatrix on the within-layer pairs, so power iteration from the
        uniform start gives the same vector (tests check both against ``build_aff_mat``).
        """
        if self.dense_bytes() > self.options.dense_memory_cap:
            raise InvalidArgument(
                "graph_a.sizes",
                f"hidden layers {list(self.sizes)} give a dense affinity of {self.pairs}² entries = "
                f"{self.dense_bytes() / 2**30:.2f} GiB, over dense_memory_cap = {self.options.dense_memory_cap / 2**30:.2f} GiB; "
                "use solver='factorised'",
            )
        opts = self.options
        k = np.zeros((self.pairs, self.pairs))
        for ell, n in enumerate(self.sizes):
            d = self._activation[ell] * opts.activation_weight
            if opts.edge_weight > 0:
                if ell == 0:
                    d = d + self._balanced_fixed("input", _exact_fixed_unary(self.blocks[0], incoming=True))
                if ell == len(self.sizes) - 1:
                    d = d + self._balanced_fixed("output", _exact_fixed_unary(self.blocks[-1], incoming=False))
            o = self.offsets[ell]
            idx = np.arange(o, o + n * n)
            k[idx, idx] = d.T.reshape(-1)
        if opts.edge_weight > 0:
            for ell, b in enumerate(self.hidden_blocks, start=1):
                n, m = self.sizes[ell], self.sizes[ell - 1]
                ro, co = self.offsets[ell], self.offsets[ell - 1]
                e = b.weights_a.shape[2]
                for j in range(n):
                    # rows (i, j) for fixed j; columns (k, l): κ(W_a[i, k], W_b[j, l]) at [i, l, k]
                    blk = np.zeros((n, m, m))
                    for c in range(e):
                        blk += gaussian_kernel(b.weights_b[j, :, c][None, :, None], b.weights_a[:, :, c][:, None, :], b.sigma)
                    k[ro + j * n : ro + (j + 1) * n, co : co + m * m] = blk.reshape(n, m * m) * b.scale
                k[co : co + m * m, ro : ro + n * n] = k[ro : ro + n * n, co : co + m * m].T
        return k

    # -- the objective -----------------------------------------------------------------------

    def objective(self, permutations: Sequence[np.ndarray]) -> float:
        """xᵀKx for the permutation matrices X_ℓ[i, perm_ℓ[i]] = 1, from exact kernel values and
        the shared normalisers (so both solvers' objectives are comparable)."""
        opts = self.options
        total = 0.0
        for ell, perm in enumerate(permutations):
            ha, hb = self.graph_a.hidden[ell], self.graph_b.hidden[ell]
            r, c, (row, col, grand) = self._activation_factors[ell]
            sq = np.sum((ha.activations - hb.activations[perm]) ** 2, axis=1) - row - col[perm] + grand
            total += opts.activation_weight * float(np.sum(np.exp(-sq / self.activation_sigma[ell]) * r * c[perm]))
        if opts.edge_weight > 0:
            inp, out = self.blocks[0], self.blocks[-1]
            r, c = self._fixed_factors_for("input")
            per_node = gaussian_kernel(inp.weights_a, inp.weights_b[permutations[0]], inp.sigma).sum(axis=(1, 2))
            total += float(np.sum(per_node * r * c[permutations[0]])) * inp.scale
            r, c = self._fixed_factors_for("output")
            per_node = gaussian_kernel(out.weights_a, out.weights_b[:, permutations[-1]], out.sigma).sum(axis=(0, 2))
            total += float(np.sum(per_node * r * c[permutations[-1]])) * out.scale
            for ell, b in enumerate(self.hidden_blocks, start=1):
                wb = b.weights_b[permutations[ell]][:, permutations[ell - 1]]
                total += 2.0 * float(gaussian_kernel(b.weights_a, wb, b.sigma).sum()) * b.scale
        return total

    def _fixed_factors_for(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Balancing factors of U_in / U_out: those the solver used, else (no solver ran yet)
        from the exact matrix."""
        if which not in self._fixed_factors:
            block = self.blocks[0] if which == "input" else self.blocks[-1]
            self._balanced_fixed(which, _exact_fixed_unary(block, incoming=which == "input"))
        return self._fixed_factors[which]

    def diagnostics(self) -> dict:
        return {
            "sizes": list(self.sizes),
            "pairs": self.pairs,
            "dtype": str(self.dtype).replace("torch.", ""),
            "activation_sigma": self.activation_sigma,
            "activation_mean_affinity": self.activation_mean,
            "blocks": [b.describe() for b in self.blocks],
            "expansion_error_bound": max(b.error_bound for b in self.blocks),
        }


def sinkhorn_factors(m: np.ndarray, what: str, *, tol: float = 1e-10, max_iter: int = 10_000) -> tuple[np.ndarray, np.ndarray]:
    """Positive r, c with diag(r)·m·diag(c) doubly stochastic up to scale: every row sums to
    the number of columns and every column to the number of rows (so the mean entry is 1, for
    square m). Sinkhorn–Knopp iterations; they converge for every strictly positive m (Sinkhorn
    1967). Stops when every row and column sum is within ``tol`` (relative) of its target."""
    m = np.asarray(m, dtype=np.float64)
    if not np.all(np.isfinite(m)) or np.any(m < 0) or not np.all(m.sum(axis=1) > 0) or not np.all(m.sum(axis=0) > 0):
        raise InvalidArgument("options.balance", f"cannot balance the {what}: it needs finite, non-negative values with no all-zero row or column (a bandwidth too small?)")
    n_rows, n_cols = m.shape
    r = np.ones(n_rows)
    c = np.ones(n_cols)
    for _ in range(max_iter):
        r = n_cols / (m @ c)
        col = m.T @ r
        c = n_rows / col
        row = r * (m @ c)
        if np.max(np.abs(row - n_cols)) <= tol * n_cols:
            break
    return r, c


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


def _exact_fixed_unary(block: _Block, incoming: bool) -> np.ndarray:
    """U_in[i, j] = Σ_k Σ_c κ(W_a[i,k,c], W_b[j,k,c]) (or U_out over the output rows), scaled."""
    wa, wb = block.weights_a, block.weights_b
    if not incoming:
        wa, wb = wa.transpose(1, 0, 2), wb.transpose(1, 0, 2)
    n = wa.shape[0]
    u = np.empty((n, wb.shape[0]))
    for i in range(n):
        u[i] = gaussian_kernel(wa[i][None], wb, block.sigma).sum(axis=(1, 2))
    return u * block.scale


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_array(name: str, arr, ndim: int) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != ndim:
        raise InvalidArgument(name, f"must have {ndim} dimensions, got shape {a.shape}")
    if a.size == 0:
        raise InvalidArgument(name, f"is empty (shape {a.shape})")
    if not np.issubdtype(a.dtype, np.number) or not np.all(np.isfinite(a)):
        raise InvalidArgument(name, "contains NaN or infinite values")
    return a


def _check_graphs(graph_a, graph_b) -> None:
    for gname, g in (("graph_a", graph_a), ("graph_b", graph_b)):
        if not isinstance(g, NetworkGraph):
            raise InvalidArgument(gname, f"must be a peer.nn.graph.NetworkGraph, got {type(g).__name__}")
        if len(g.hidden) == 0:
            raise InvalidArgument(f"{gname}.hidden", "has no hidden layers: there is nothing to match")
        for ell, h in enumerate(g.hidden):
            _check_array(f"{gname}.hidden[{ell}].activations", h.activations, 2)
            _check_array(f"{gname}.hidden[{ell}].incoming", h.incoming, 3)
        _check_array(f"{gname}.output_incoming", g.output_incoming, 3)
    if dict(graph_a.architecture) != dict(graph_b.architecture):
        raise InvalidArgument("graph_b.architecture", f"differs from graph_a's: {dict(graph_b.architecture)} vs {dict(graph_a.architecture)}")
    if len(graph_a.hidden) != len(graph_b.hidden):
        raise InvalidArgument("graph_b.hidden", f"has {len(graph_b.hidden)} hidden layers, graph_a has {len(graph_a.hidden)}")
    if graph_a.input_size != graph_b.input_size:
        raise InvalidArgument("graph_b.input_size", f"is {graph_b.input_size}, graph_a's is {graph_a.input_size}")
    n_prev = graph_a.input_size
    probes = np.asarray(graph_a.hidden[0].activations).shape[1]
    for ell, (ha, hb) in enumerate(zip(graph_a.hidden, graph_b.hidden)):
        if ha.kind != hb.kind:
            raise InvalidArgument(f"graph_b.hidden[{ell}].kind", f"is {hb.kind!r}, graph_a's is {ha.kind!r}")
        for gname, h in (("graph_a", ha), ("graph_b", hb)):
            w = np.asarray(h.incoming)
            if w.shape[1] != n_prev:
                raise InvalidArgument(f"{gname}.hidden[{ell}].incoming", f"has {w.shape[1]} inputs per node, the previous layer has {n_prev} nodes")
            act = np.asarray(h.activations)
            if act.shape[0] != w.shape[0]:
                raise InvalidArgument(f"{gname}.hidden[{ell}].activations", f"has {act.shape[0]} rows for {w.shape[0]} nodes")
            if act.shape[1] != probes:
                raise InvalidArgument(f"{gname}.hidden[{ell}].activations", f"has {act.shape[1]} probes, graph_a.hidden[0] has {probes}: both graphs must use the same probe set")
        if np.asarray(ha.incoming).shape != np.asarray(hb.incoming).shape:
            raise InvalidArgument(f"graph_b.hidden[{ell}].incoming", f"has shape {np.asarray(hb.incoming).shape}, graph_a's is {np.asarray(ha.incoming).shape}")
        n_prev = np.asarray(ha.incoming).shape[0]
    for gname, g in (("graph_a", graph_a), ("graph_b", graph_b)):
        if np.asarray(g.output_incoming).shape[1] != n_prev:
            raise InvalidArgument(f"{gname}.output_incoming", f"has {np.asarray(g.output_incoming).shape[1]} inputs per output, the last hidden layer has {n_prev} nodes")
    if np.asarray(graph_a.output_incoming).shape != np.asarray(graph_b.output_incoming).shape:
        raise InvalidArgument("graph_b.output_incoming", f"has shape {np.asarray(graph_b.output_incoming).shape}, graph_a's is {np.asarray(graph_a.output_incoming).shape}")


# --------------------------------------------------------------------------------------------
# Solvers
# --------------------------------------------------------------------------------------------


def _discretise(layers: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The permutation maximising Σ_i X[i, perm(i)] per layer (Hungarian / LSA).

    Row and column means are subtracted first: every permutation takes one entry per row and
    per column, so this shifts all objectives by the same constant and leaves the set of optimal
    permutations unchanged; but the leading eigenvector is a large near-constant plus a small
    informative part, and scipy's solver is 5–15x slower on the raw matrix (measured at 2048).
    """
    perms = []
    for x in layers:
        y = np.array(x, dtype=np.float64)
        y -= y.mean(axis=1, keepdims=True)
        y -= y.mean(axis=0, keepdims=True)
        rows, cols = linear_sum_assignment(y, maximize=True)
        perm = np.empty(x.shape[0], dtype=np.int64)
        perm[rows] = cols
        perms.append(perm)
    return tuple(perms)


def _power_iteration_factorised(aff: Affinity, product_threads: int):
    opts = aff.options
    v = [torch.full((n, n), 1.0 / aff.pairs, dtype=aff.dtype) for n in aff.sizes]
    shift = opts.shift
    converged, it, residual, norm, cost = False, 0, float("inf"), 0.0, _Cost()
    for it in range(1, opts.max_iter + 1):
        cost = _Cost(product_threads)
        w = aff.apply(v, cost)
        if shift is None:
            shift = 0.5 * _norm(w) / _norm(v)
        for x, y in zip(w, v):
            x.add_(y, alpha=shift)
        norm = _norm(w)
        if not norm > 0:
            break
        for x in w:
            x.div_(norm)
        residual = math.sqrt(sum(float(torch.dist(x, y)) ** 2 for x, y in zip(w, v)))
        v = w
        if residual < opts.tol:
            converged = True
            break
    return [x.numpy() for x in v], it, converged, residual, norm - (shift or 0.0), cost, shift or 0.0


def _norm(layers: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(x * x, dtype=torch.float64)) for x in layers))


def _power_iteration_dense(aff: Affinity, k: np.ndarray):
    """pygmtools.sm on K + sI, one step at a time, warm-started from its previous iterate (its
    state is only v), so that this loop counts iterations and applies the same stopping rule
    with ``tol``. The shift is added to K's diagonal in place."""
    import pygmtools

    opts = aff.options
    m = aff.pairs
    v = np.full(m, 1.0 / m)
    shift = opts.shift if opts.shift is not None else 0.5 * float(np.linalg.norm(k @ v) / np.linalg.norm(v))
    diag = np.arange(m)
    k[diag, diag] += shift
    converged, it, residual = False, 0, float("inf")
    for it in range(1, opts.max_iter + 1):
        x = pygmtools.sm(k, n1max=m, n2max=1, x0=v.reshape(1, m, 1), max_iter=1, backend="numpy")
        w = np.asarray(x).reshape(m)
        residual = float(np.linalg.norm(w - v))
        v = w
        if residual < opts.tol:
            converged = True
            break
    norm = float(np.linalg.norm(k @ v)) - shift
    k[diag, diag] -= shift
    cost = _Cost()
    cost.flops = 2.0 * m * m  # one dense matrix-vector product
    return aff.to_layers(v), it, converged, residual, norm, cost, shift


def match_graphs(graph_a: NetworkGraph, graph_b: NetworkGraph, options: MatchOptions | None = None) -> MatchResult:
    """Align graph_b's hidden nodes to graph_a's by spectral matching over all hidden layers.

    Both graphs must come from the same architecture and the same probe set. For a remote graph
    pass its released (noisy) features: the matcher reads nothing else of it, and its bandwidth
    rule uses only the arrays it is given. Returns one permutation per hidden layer
    (``perm[i] = j``: A's node i ↔ B's node j) with the objective, the relaxed solution and
    diagnostics; the same shape of result for ``options.solver`` "factorised" and "dense".
    """
    options = MatchOptions() if options is None else options
    if not isinstance(options, MatchOptions):
        raise InvalidArgument("options", f"must be a MatchOptions, got {type(options).__name__}")
    _check_graphs(graph_a, graph_b)
    if options.threads is not None:
        threads = options.threads
    else:
        threads = 1 if max(graph_a.sizes) <= AUTO_SINGLE_THREAD_MAX_WIDTH else torch.get_num_threads()
    with torch_threads(threads):
        return _match(graph_a, graph_b, options)


def _match(graph_a: NetworkGraph, graph_b: NetworkGraph, options: MatchOptions) -> MatchResult:
    dense = options.solver == "dense"
    aff = Affinity(graph_a, graph_b, options, build_operator=not dense)
    diag = aff.diagnostics()
    diag["threads"] = torch.get_num_threads()
    t0 = time.perf_counter()
    kmat = None
    if dense:
        kmat = aff.dense()
        diag["dense_bytes"] = aff.dense_bytes()
        diag["dtype"] = "float64"
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    diag["diagonal"] = aff.is_diagonal
    if aff.is_diagonal:
        # K is diagonal: xᵀKx = Σ_ℓ Σ_i D_ℓ[i, perm_ℓ(i)] is a linear assignment per layer,
        # solved exactly below (its leading eigenvector would be a coordinate vector).
        d = aff.to_layers(np.diag(kmat)) if dense else aff.diagonal()
        scale = math.sqrt(sum(float(np.sum(x * x)) for x in d))
        layers = [np.asarray(x) / scale for x in d]
        it, converged, residual, norm, cost, shift = 0, True, 0.0, float(max(np.max(x) for x in d)), _Cost(), 0.0
    elif dense:
        layers, it, converged, residual, norm, cost, shift = _power_iteration_dense(aff, kmat)
    else:
        # the products on the call's threads; gathers, scatters and elementwise work on one
        # (unless threads were given)
        product_threads = torch.get_num_threads()
        base = product_threads if options.threads is not None else 1
        with torch_threads(base):
            layers, it, converged, residual, norm, cost, shift = _power_iteration_factorised(aff, product_threads)
        diag["threads"] = {"setup": product_threads, "iteration": base, "products": product_threads}
    t_iter = time.perf_counter() - t0
    del kmat

    t0 = time.perf_counter()
    perms = _discretise(layers)
    t_assign = time.perf_counter() - t0
    objective = aff.objective(perms)

    diag["dense_products_per_iteration"] = cost.products
    diag["flops_per_iteration"] = cost.flops
    diag["n3_products_per_iteration"] = cost.flops / (2.0 * max(aff.sizes) ** 3)
    diag.update(
        eigenvalue=norm,
        shift=shift,
        residual=residual,
        seconds={"setup": aff.setup_seconds + t_build, "iterations": t_iter, "assignment": t_assign},
    )
    return MatchResult(
        permutations=perms,
        objective=float(objective),
        solver=options.solver,
        iterations=int(it),
        converged=bool(converged),
        relaxed=tuple(np.asarray(x) for x in layers),
        diagnostics=diag,
    )
