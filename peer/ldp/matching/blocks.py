"""One layer pair's weight affinity: its bandwidth, its kernel expansion, its separable terms, κ̄.

A block holds the weights between two consecutive layers of A and of B (hidden–hidden, or a
hidden layer and the fixed input or output layer) as (n_rows, n_cols, e) arrays. The kernel of two
edges is the mean over the e components of the scalar Gaussian κ (docs/matching.md, "The
affinity"); :func:`_block_terms` writes it as separable terms for the factorised operator and
:func:`_mean_kernel` gives the mean κ̄ its normaliser divides by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from peer.ldp.matching.expansion import (
    ChebyshevExpansion,
    OperatorExpansion,
    both_sides,
    few_values,
    gaussian_expansion,
    gaussian_kernel,
    operator_expansion,
)
from peer.ldp.matching.normalisation import _mean_sq_bandwidth
from peer.ldp.matching.operators import _Factor, _indicator_factor, _LazyTerms, _Stacked, _table_right_factor
from peer.ldp.matching.options import MatchOptions


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
    operator: OperatorExpansion | None = None  # expansion_rule "operator" (hidden blocks, e = 1)

    @property
    def error_bound(self) -> float:
        if self.operator is not None:
            return self.operator.error_bound
        return self.chebyshev.error_bound if self.chebyshev is not None else 0.0

    def operator_error(self, terms: int | None = None, deterministic: bool = False) -> float:
        """A bound on ‖ΔE‖₂, the spectral norm of this hidden block's scaled n_ℓ²×n_{ℓ−1}² part of K
        minus the exact-kernel one, when its first ``terms`` terms are applied (all when None)
        (docs/matching.md, "Operator-adapted expansion").

        Always: ‖ΔE‖₂ ≤ ‖ΔE‖_F = scale · n_ℓ n_{ℓ−1} · (root mean square of the kernel error over
        the pairs) — deterministic, and what ``deterministic=True`` returns. With centred terms
        (the mean parts of every kept term applied exactly) and spectral-norm bounds b_k of the
        centred terms F̃_k ⊗ H̃_k (:meth:`bound_terms`), also, for every L ≥ ``terms``:
        ‖ΔE‖₂ ≤ Σ_{terms ≤ k < L} b_k + scale · n_ℓ n_{ℓ−1} · rms(L), since the operator norm of
        V ↦ F̃ V H̃ᵀ is ‖F̃‖₂‖H̃‖₂ and the rest is bounded in Frobenius norm; the smallest is
        returned. It holds unless a b_k fails (probability :attr:`bound_failure`)."""
        pairs = self.weights_a.shape[0] * self.weights_a.shape[1]
        if self.operator is None:
            return self.scale * pairs * self.error_bound * self.weights_a.shape[2]
        rank = self.operator.terms if terms is None else int(terms)
        best = self.scale * pairs * self.operator.rms_bound(rank)
        src = self._centred_source()
        if deterministic or src is None:
            return best
        acc = 0.0
        for k in range(rank, len(src.bounds)):
            acc += src.bounds[k]
            best = min(best, acc + self.scale * pairs * self.operator.rms_bound(k + 1))
        return best

    def _centred_source(self):
        """The lazily built, centred stacked terms' source (_LazyTerms), or None."""
        for t in self.terms:
            if isinstance(t, _Stacked) and t.source is not None and t.source.means is not None:
                return t.source
        return None

    def bound_terms(self, upto: int, keep_bytes: int = 0) -> None:
        """Spectral-norm bounds for the centred terms below ``upto`` (:meth:`_Stacked.bound`)."""
        for t in self.terms:
            if isinstance(t, _Stacked) and t.source is not None and t.source.means is not None:
                t.bound(upto, keep_bytes)

    @property
    def bound_failure(self) -> float:
        """The probability that one of this block's spectral-norm bounds is wrong (a union bound)."""
        src = self._centred_source()
        return 0.0 if src is None else src.failure

    @property
    def terms_per_component(self) -> int:
        """Separable terms of the scalar kernel expansion (per weight component)."""
        if self.expansion in ("table", "table-a"):
            return len(self.values_a)
        if self.expansion == "table-b":
            return len(self.values_b)
        if self.operator is not None:
            return self.operator.terms
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
        if self.operator is not None:
            d.update(
                expansion="operator",
                degree=self.operator.degree,
                interval=[self.operator.lo, self.operator.hi],
                interpolation_bound=self.operator.interpolation_bound,
                rms_bound=self.operator.rms_bound(self.operator.terms),
                operator_error_bound=self.operator_error(),
            )
        elif self.chebyshev is not None:
            d.update(
                degree=self.chebyshev.degree,
                interval=[self.chebyshev.lo, self.chebyshev.hi],
                interpolation_bound=self.chebyshev.interpolation_bound,
                truncation_bound=self.chebyshev.truncation_bound,
            )
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
        if block.operator is not None:
            total += block.operator.mean_kernel
            continue
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
            # coefficients are S = Pᵀ T P, P = [[1, −1, −1], [0, 1, 0], [0, 0, 1]] (cut to size);
            # docs/matching.md, "Few-valued weights".
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
                terms.append(
                    (_indicator_factor(wa == va[p], dtype), _Factor(shape, dense=torch.as_tensor(diff, dtype=dtype)))
                )
        elif block.expansion == "table-b":
            vb = block.values_b
            k0 = gaussian_kernel(wa, vb[0], sigma)
            terms.append((_Factor(shape, dense=torch.as_tensor(k0, dtype=dtype)), _Factor(shape, ones=1.0)))
            for q in range(1, len(vb)):
                diff = gaussian_kernel(wa, vb[q], sigma) - k0
                terms.append(
                    (_Factor(shape, dense=torch.as_tensor(diff, dtype=dtype)), _indicator_factor(wb == vb[q], dtype))
                )
        elif block.operator is not None:
            terms.extend(_centred_operator_terms(block.operator, wa, wb, dtype))
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


def _stacked_functions(
    ch: ChebyshevExpansion, w: np.ndarray, dtype: torch.dtype
) -> tuple[list[torch.Tensor], np.ndarray]:
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


def _stacked_operator_functions(
    op: OperatorExpansion, w: np.ndarray, side: str, dtype: torch.dtype, start: int = 0, stop: int | None = None
) -> list:
    """σ_k f_k(w) (side "a") or h_k(w) (side "b"), start ≤ k < stop, as groups of _Stacked.GROUP
    terms (n, group, n′)."""
    n, m = w.shape
    stop = op.terms if stop is None else stop
    count = stop - start
    g = _Stacked.GROUP
    groups = [torch.empty((n, min(g, count - r), m), dtype=dtype) for r in range(0, count, g)]
    rows = max(1, (1 << 20) // max(1, m))
    for i in range(0, n, rows):
        vals = op.functions(w[i : i + rows], side, start, stop)  # (count, rows, n′), float64
        for k, grp in enumerate(groups):
            grp[i : i + rows] = torch.as_tensor(vals[k * g : (k + 1) * g].transpose(1, 0, 2), dtype=dtype)
    return groups


def _lazy_operator_terms(op: OperatorExpansion, wa: np.ndarray, wb: np.ndarray, dtype: torch.dtype) -> _Stacked:
    """The operator-adapted expansion's terms as a _Stacked that builds them when a product first
    needs them: the Rayleigh–Ritz iteration applies only the first few to small residuals, and the
    constant start needs only the line sums, which the expansion keeps from its Gram pass."""
    sums_a, sums_b = op.line_sums("a"), op.line_sums("b")
    if sums_a is None or sums_b is None:  # no line sums (a trivial interval): build every term now
        phi = _stacked_operator_functions(op, wa, "a", dtype)
        psi = _stacked_operator_functions(op, wb, "b", dtype)
        return _Stacked(phi, psi)

    def make(start: int, stop: int):
        return (
            _stacked_operator_functions(op, wa, "a", dtype, start, stop),
            _stacked_operator_functions(op, wb, "b", dtype, start, stop),
        )

    sums = tuple(tuple(torch.as_tensor(x, dtype=dtype) for x in side) for side in (sums_a, sums_b))
    return _Stacked([], [], source=_LazyTerms(op.terms, make, sums))


def _stacked_side_functions(
    op: OperatorExpansion, w: np.ndarray, side: str, dtype: torch.dtype, start: int, stop: int, mean: bool
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """:func:`_stacked_operator_functions` of one side, and, with ``mean``, the side's mean
    function g_A(W^A) or g_B(W^B) (:meth:`OperatorExpansion.mean_function_coefficients`) as an
    (n, n′) tensor from the same pass of the recurrence (one more coefficient column)."""
    n, m = w.shape
    count = stop - start
    coef = op.coefficients(side)[:, start:stop]
    if mean:
        coef = np.concatenate([coef, op.mean_function_coefficients(side)[:, None]], axis=1)
    g = _Stacked.GROUP
    groups = [torch.empty((n, min(g, count - r), m), dtype=dtype) for r in range(0, count, g)]
    extra = torch.empty((n, m), dtype=dtype) if mean else None
    rows = max(1, (1 << 18) // max(1, m))  # float64 temporaries of ~30 MB per thread
    starts = list(range(0, n, rows))

    def fill(half: int) -> None:  # every other chunk of rows: the two threads write disjoint rows
        for i in starts[half::2]:
            vals = op.functions(w[i : i + rows], side, coef=coef)  # (count [+ 1], rows, n′), float64
            for k, grp in enumerate(groups):
                grp[i : i + rows] = torch.as_tensor(vals[k * g : k * g + grp.shape[1]].transpose(1, 0, 2), dtype=dtype)
            if mean:
                extra[i : i + rows] = torch.as_tensor(vals[count], dtype=dtype)

    both_sides(fill, (0, 1)) if len(starts) > 1 else fill(0)
    return groups, extra


def _centred_operator_terms(op: OperatorExpansion, wa: np.ndarray, wb: np.ndarray, dtype: torch.dtype) -> list:
    """The operator-adapted expansion as its mean parts plus centred terms:
    Σ_k F_k ⊗ H_k = J ⊗ G_B + G_A ⊗ J − c J ⊗ J + Σ_k F̃_k ⊗ H̃_k, with G_A = g_A(W^A),
    G_B = g_B(W^B) (:meth:`OperatorExpansion.mean_function_coefficients`), c = Σ_k m^A_k m^B_k,
    F̃_k = F_k − m^A_k J, H̃_k = H_k − m^B_k J. The mean parts (of every kept term) cost
    matrix–vector products and are applied by every product; the centred terms are built
    lazily, and their spectral norms — about 2√n against ‖·‖_F ≈ n for a random-like n×n
    matrix — bound what a product that leaves them out changes (docs/matching.md,
    "Operator-adapted expansion"). Falls back to :func:`_lazy_operator_terms` when the
    expansion has no line sums."""
    means_a, means_b = op.term_means("a"), op.term_means("b")
    if means_a is None or means_b is None:
        return [_lazy_operator_terms(op, wa, wb, dtype)]
    (ra, ca), (rb, cb) = op.line_sums("a"), op.line_sums("b")
    n, m = wa.shape
    # line sums of the centred terms: F̃_k 1 = F_k 1 − m_k n′ 1, F̃_kᵀ 1 = F_kᵀ 1 − m_k n 1
    sums = (
        (torch.as_tensor(ra - means_a * m, dtype=dtype), torch.as_tensor(ca - means_a * n, dtype=dtype)),
        (torch.as_tensor(rb - means_b * m, dtype=dtype), torch.as_tensor(cb - means_b * n, dtype=dtype)),
    )
    # line sums of the mean functions, from the Chebyshev line sums of the Gram pass
    lines_a, lines_b = op.lines_a, op.lines_b
    coef_a, coef_b = op.mean_function_coefficients("a"), op.mean_function_coefficients("b")
    mean_sums = tuple(
        torch.as_tensor(x, dtype=dtype)
        for x in (lines_a[0] @ coef_a, lines_a[1] @ coef_a, lines_b[0] @ coef_b, lines_b[1] @ coef_b)
    )

    def make(start: int, stop: int):
        return (
            _stacked_operator_functions(op, wa, "a", dtype, start, stop),
            _stacked_operator_functions(op, wb, "b", dtype, start, stop),
        )

    def make_side(start: int, stop: int, side: str, mean: bool):
        return _stacked_side_functions(op, wa if side == "a" else wb, side, dtype, start, stop, mean)

    centred = (make_side, (means_a, means_b), mean_sums, float(means_a @ means_b))
    return [_Stacked([], [], source=_LazyTerms(op.terms, make, sums, centred=centred))]


def _make_block(name: str, kind: str, wa: np.ndarray, wb: np.ndarray, opts: MatchOptions) -> _Block:
    """The block of weights wa, wb (n_rows, n_cols, e) with its bandwidth σ_w (given, or the
    mean-squared-difference rule) and its expansion: the exact table where a side is few-valued,
    else a Chebyshev expansion on the interval holding both sides' values."""
    sigma = (
        opts.weight_sigma if opts.weight_sigma is not None else _mean_sq_bandwidth(wa.reshape(-1, 1), wb.reshape(-1, 1))
    )
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
        if opts.expansion_rule == "operator" and kind == "hidden" and wa.shape[2] == 1:
            # κ̄ ≥ e⁻¹ under the default bandwidth rule, so rms ≤ tol·κ̄/8 holds with
            # rms ≤ tol·e⁻¹/8; a given σ_w may make κ̄ smaller: then use its upper interval value
            kbar = math.exp(-1.0) if opts.weight_sigma is None else math.exp(-((hi - lo) ** 2) / sigma)
            op = operator_expansion(lo, hi, sigma, wa[:, :, 0], wb[:, :, 0], opts.tol * kbar / 8.0)
            return _Block(name, kind, wa, wb, float(sigma), kind_exp, va, vb, None, operator=op)
        cheb = gaussian_expansion(lo, hi, sigma, opts.expansion_tol)
    return _Block(name, kind, wa, wb, float(sigma), kind_exp, va, vb, cheb)


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
