"""The factorised operator's algebra: how one block of K acts on V without forming K.

A block whose kernel has the separable form κ(x, y) = Σ_t f_t(x) h_t(y) acts as
E(V) = Σ_t F_t V H_tᵀ, F_t = f_t(W^A), H_t = h_t(W^B) elementwise. Each factor here is
c·J + R (J all ones, R sparse, dense or absent), so that indicator matrices of few-valued weights
cost gathers instead of dense products, and dense Chebyshev terms are stacked into a few large
products. docs/matching.md, "The factorised operator", counts what each case costs.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from peer.ldp.matching.expansion import both_sides
from peer.nn.architectures import torch_threads

# A few-valued indicator denser than this is applied as a dense matrix: sparse products stop paying.
SPARSE_MAX_DENSITY = 0.01


class _Sparse:
    """A sparse matrix as sorted coordinate lists, applied with gathers and ``index_add_``.

    Built for the indicator matrices of few-valued weights, which typically hold one non-zero
    per row (the multi-bit mechanism's m sampled coordinates); for them a gather beats
    ``torch.sparse.mm`` by far (docs/matching.md, "Implementation notes"). ``touched`` lists the
    non-empty rows and ``local`` maps each non-zero to its position in ``touched``.
    """

    __slots__ = ("cols", "full", "local", "one_per_row", "rows", "shape", "touched", "unit", "vals")

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

    def t(self) -> _Sparse:
        return _Sparse((self.shape[1], self.shape[0]), self.cols, self.rows, self.vals)

    def scaled(self, s: float) -> _Sparse:
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

    __slots__ = ("dense", "ones", "shape", "sparse")

    def __init__(self, shape, ones: float = 0.0, sparse: _Sparse | None = None, dense: torch.Tensor | None = None):
        self.shape = (int(shape[0]), int(shape[1]))
        self.ones = float(ones)
        self.sparse = sparse
        self.dense = dense

    def t(self) -> _Factor:
        return _Factor(
            (self.shape[1], self.shape[0]),
            self.ones,
            None if self.sparse is None else self.sparse.t(),
            None if self.dense is None else self.dense.T,
        )

    def scaled(self, s: float) -> _Factor:
        return _Factor(
            self.shape,
            self.ones * s,
            None if self.sparse is None else self.sparse.scaled(s),
            None if self.dense is None else self.dense * s,
        )

    def row_sums(self, dtype: torch.dtype) -> torch.Tensor:
        """(c·J + R) 1: what the factor does to a constant vector, without a dense product."""
        out = torch.full((self.shape[0],), self.ones * self.shape[1], dtype=dtype)
        if self.sparse is not None:
            out += self.sparse.matvec(torch.ones(self.shape[1], dtype=dtype))
        elif self.dense is not None:
            out += self.dense.sum(dim=1)
        return out

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
    torch's ``index_add_`` is much slower on several threads, while a large product can use them
    (docs/matching.md, "Threads")."""

    __slots__ = ("flops", "product_threads", "products")

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

    __slots__ = ("col_sums", "per_col", "per_row", "row_sums", "scalar", "total")

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
    if (f.sparse is None and f.dense is None) or (h.sparse is None and h.dense is None):
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
    __slots__ = ("phi", "psi", "source", "transposed")

    def __init__(
        self,
        phi: list[torch.Tensor],
        psi: list[torch.Tensor],
        transposed: bool = False,
        source: _LazyTerms | None = None,
    ):
        self.phi, self.psi, self.transposed, self.source = phi, psi, transposed, source

    def t(self) -> _Stacked:
        # the same lists and source: terms built or freed through one view serve the other
        return _Stacked(self.phi, self.psi, not self.transposed, self.source)

    def _built(self) -> int:
        return sum(int(g.shape[1]) for g in self.phi)

    def built_bytes(self) -> int:
        """Bytes held by the built terms (both sides)."""
        return sum(g.numel() * g.element_size() for g in (*self.phi, *self.psi))

    def ensure(self, terms: int | None) -> None:
        """Build the first ``terms`` terms (all when None) where they are built lazily."""
        if self.source is None:
            return
        want = self.source.terms if terms is None else min(int(terms), self.source.terms)
        have = self._built()
        if have < want:
            phi, psi = self.source.build(have, want)
            self.phi.extend(phi)
            self.psi.extend(psi)

    def trim(self, terms: int | None) -> None:
        """Free the terms after the first ``terms`` (lazily built terms only: they can be rebuilt)."""
        if self.source is None or terms is None:
            return
        keep, k = int(terms), 0
        for i, grp in enumerate(self.phi):
            if k + grp.shape[1] > keep:
                cut = keep - k
                if cut > 0:
                    self.phi[i] = grp[:, :cut].contiguous()
                    self.psi[i] = self.psi[i][:, :cut].contiguous()
                    i += 1
                del self.phi[i:], self.psi[i:]
                return
            k += grp.shape[1]

    def bound(self, upto: int, keep_bytes: int = 0) -> None:
        """Fill ``source.bounds`` up to term ``upto`` (lazily built, centred terms only): built
        terms are bounded where they are; the others are built one side at a time in one pass of
        the recurrence, bounded (two threads), and the first of them kept while the block's built
        terms stay within ``keep_bytes`` (the product that follows applies the first terms), the
        rest freed."""
        src = self.source
        if src is None or src.means is None:
            return
        upto = min(int(upto), src.terms)
        if len(src.bounds) >= upto:
            return
        side_bounds: dict[tuple[int, str], tuple[float, float]] = {}

        def add(groups, side, first):
            todo = []
            at = first
            for grp in groups:
                for r in range(grp.shape[1]):
                    k = at + r
                    if len(src.bounds) <= k < upto and (k, side) not in side_bounds:
                        todo.append((k, grp[:, r, :]))
                at += grp.shape[1]

            def run(half):  # the norms on two threads (matrix–vector work, GIL released)
                return [(k, _spectral_norm_bound(f, 7919 * k + (side == "b"))) for k, f in todo[half::2]]

            for part in both_sides(run, (0, 1)) if len(todo) > 1 else [run(0)]:
                for k, result in part:
                    side_bounds[(k, side)] = result

        add(self.phi, "a", 0)
        add(self.psi, "b", 0)
        at = self._built()
        if at < upto:
            (fr, fc), _ = src.sums
            per_term = 2 * fr.shape[0] * fc.shape[0] * fr.element_size()  # one term, both sides
            keep = min(upto, at + max(0, (keep_bytes - self.built_bytes()) // per_term))
            kept = {}
            # one side at a time (each built on two threads, row halves): the peak holds one
            # side's terms below ``upto`` and the other side's kept prefix
            for side in ("a", "b"):
                groups = src.build_side(at, upto, side)
                add(groups, side, at)
                kept[side], first = [], at
                for grp in groups:
                    if first + grp.shape[1] <= keep:
                        kept[side].append(grp)
                    elif first < keep:
                        kept[side].append(grp[:, : keep - first].contiguous())
                    first += grp.shape[1]
                del groups
            self.phi.extend(kept["a"])
            self.psi.extend(kept["b"])
        for k in range(len(src.bounds), upto):
            (bf, pf), (bh, ph) = side_bounds[(k, "a")], side_bounds[(k, "b")]
            src.bounds.append(bf * bh)
            src.failure += pf + ph

    def apply(self, v: torch.Tensor, out: torch.Tensor, cost: _Cost, terms: int | None = None) -> None:
        """out += Σ_r F_r V H_rᵀ (or the transposed sum) over the first ``terms`` terms (all when None)."""
        self.ensure(terms)
        left = None if terms is None else int(terms)
        for phi_g, psi_g in zip(self.phi, self.psi, strict=True):
            if left is not None:
                if left <= 0:
                    break
                if left < phi_g.shape[1]:
                    phi_g, psi_g = phi_g[:, :left].contiguous(), psi_g[:, :left].contiguous()
                left -= phi_g.shape[1]
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
        if self.source is not None and self.source.means is not None:
            self.source.apply_means(v, out, self.transposed)

    def apply_constant(self, c: float, out: torch.Tensor) -> None:
        """out += Σ_r F_r (c·J) H_rᵀ = c Σ_r (F_r 1)(H_r 1)ᵀ: matrix-vector work only (all terms;
        for lazily built terms from their line sums, without building them)."""
        if self.source is not None:
            (fr, fc), (hr, hc) = self.source.sums
            if not self.transposed:
                out += (c * self.source.scale) * (fr @ hr.T)
            else:
                out += (c * self.source.scale) * (fc @ hc.T)
            if self.source.means is not None:
                self.source.apply_means_constant(c, out, self.transposed)
            return
        for phi_g, psi_g in zip(self.phi, self.psi, strict=True):
            if not self.transposed:
                out += c * (phi_g.sum(dim=2) @ psi_g.sum(dim=2).T)  # (n, g) @ (g, n)
            else:
                out += c * (phi_g.sum(dim=0).T @ psi_g.sum(dim=0))  # (n′, g) @ (g, n′)


class _LazyTerms:
    """Dense separable terms built on demand: ``build(start, stop)`` returns the groups (F, H) of
    terms start … stop−1 as _Stacked lays them out (H multiplied by ``scale``); ``sums`` holds
    ((F_r 1, F_rᵀ 1), (H_r 1, H_rᵀ 1)) of all ``terms`` terms, unscaled, as (n, R), (m, R) tensors.
    A product that needs only the first k terms then never pays for — or stores — the others
    (docs/matching.md, "Operator-adapted expansion").

    Centred terms (``centred`` given): ``centred = (make_side, means, mean_sums, c)``, where
    ``make_side(start, stop, side, mean)`` builds one side's groups (and, with ``mean``, the
    side's mean function G_A or G_B in the same pass), ``means`` = (m^F_r, m^H_r) the terms' grand
    means, ``mean_sums`` = (G_A 1, G_Aᵀ 1, G_B 1, G_Bᵀ 1) and c = Σ_r m^F_r m^H_r. The terms are
    then built centred, F̃_r = F_r − m^F_r J, H̃_r = H_r − m^H_r J (``sums`` are those of the
    centred terms), and :class:`_Stacked` adds the mean parts J ⊗ G_B + G_A ⊗ J − c J ⊗ J of all
    terms to every product (matrix–vector work). ``bounds[r]`` (filled by
    :meth:`_Stacked.bound`): an upper bound on ‖F̃_r‖₂ ‖H̃_r‖₂ (H̃ scaled), which bounds the
    spectral norm of the operator V ↦ F̃_r V H̃_rᵀ; ``failure``: the probability that some bound
    in ``bounds`` is wrong (:func:`_spectral_norm_bound`, a union bound over the norms)."""

    __slots__ = ("bounds", "c", "failure", "g", "make", "make_side", "mean_sums", "means", "scale", "sums", "terms")

    def __init__(self, terms: int, make, sums, centred=None):
        self.terms, self.make, self.sums, self.scale = int(terms), make, sums, 1.0
        self.make_side, self.means, self.mean_sums, self.c = centred if centred is not None else (None,) * 4
        self.g: dict[str, torch.Tensor] = {}  # the mean functions G_A ("a") and G_B ("b", scaled)
        self.bounds: list[float] = []
        self.failure = 0.0

    def build_side(self, start: int, stop: int, side: str) -> list[torch.Tensor]:
        """One side's groups of centred terms start … stop−1 (side "b" scaled); builds the side's
        mean function in the same pass the first time."""
        groups, g = self.make_side(start, stop, side, side not in self.g)
        if g is not None:
            self.g[side] = g if side == "a" or self.scale == 1.0 else g * self.scale
        means = self.means[0 if side == "a" else 1]
        at = start
        for grp in groups:
            k = grp.shape[1]
            grp -= torch.as_tensor(means[at : at + k], dtype=grp.dtype)[None, :, None]
            at += k
            if side == "b" and self.scale != 1.0:
                grp *= self.scale
        return groups

    def build(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.make_side is not None:
            return self.build_side(start, stop, "a"), self.build_side(start, stop, "b")
        phi, psi = self.make(start, stop)
        if self.scale != 1.0:
            for grp in psi:
                grp *= self.scale
        return phi, psi

    def mean_functions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(G_A, s·G_B), built (alone) if no term has been built yet."""
        for side in ("a", "b"):
            if side not in self.g:
                self.build_side(0, 0, side)
        return self.g["a"], self.g["b"]

    def apply_means(self, v: torch.Tensor, out: torch.Tensor, transposed: bool) -> None:
        """out += the mean parts' image of V: s·G_A V J + J V (s·G_B)ᵀ − s c J V J (or the
        transposed map, U ↦ s·G_Aᵀ U J + J U (s·G_B) − s c J U J): matrix–vector products."""
        g_a, g_b = self.mean_functions()
        s = self.scale
        if not transposed:
            out += (s * (g_a @ v.sum(dim=1)))[:, None]
            out += (g_b @ v.sum(dim=0))[None, :]
        else:
            out += (s * (g_a.T @ v.sum(dim=1)))[:, None]
            out += (g_b.T @ v.sum(dim=0))[None, :]
        out -= s * self.c * v.sum()

    def apply_means_constant(self, c0: float, out: torch.Tensor, transposed: bool) -> None:
        """out += the mean parts' image of c0·J, from the line sums of G_A and G_B."""
        ga_rows, ga_cols, gb_rows, gb_cols = self.mean_sums
        s = self.scale
        inner = ga_cols.shape[0] if not transposed else ga_rows.shape[0]  # the side V lives on
        if not transposed:
            out += (s * c0 * inner * ga_rows)[:, None] + (s * c0 * inner * gb_rows)[None, :]
        else:
            out += (s * c0 * inner * ga_cols)[:, None] + (s * c0 * inner * gb_cols)[None, :]
        out -= s * self.c * c0 * inner * inner


# Spectral-norm bounds of centred terms (:func:`_spectral_norm_bound`): matrices with both sides
# at most EXACT_NORM_MAX get the exact norm (an SVD); larger ones LANCZOS_STARTS independent
# Lanczos runs of LANCZOS_STEPS products with the Gram matrix, each failing with probability at
# most 1.648·√d·exp(−√ε(2k − 1)), k = LANCZOS_STEPS − 1, ε = LANCZOS_EPSILON (Kuczyński and
# Woźniakowski 1992, Lanczos with a random start); the bound fails only if every run does.
EXACT_NORM_MAX = 256
LANCZOS_STEPS = 8
LANCZOS_STARTS = 8
LANCZOS_EPSILON = 0.3
NORM_ROUNDING_MARGIN = 1e-4


def _spectral_norm_bound(f: torch.Tensor, seed: int) -> tuple[float, float]:
    """(b, p): ‖f‖₂ ≤ b except with probability at most p over the start vectors (p = 0 for the
    exact norm of a small matrix).

    For d = min(n, n′) > EXACT_NORM_MAX: Lanczos on the d×d Gram matrix M (fᵀf or f fᵀ) from
    LANCZOS_STARTS independent start vectors uniform on the unit sphere (seeded Gaussians,
    normalised), LANCZOS_STEPS products each, full reorthogonalisation in float64; λ̂ = the
    largest Ritz value of M on the Krylov spaces (a Rayleigh quotient: λ̂ ≤ λ_max(M) = ‖f‖₂²).
    Kuczyński & Woźniakowski (SIAM J. Matrix Anal. Appl. 13, 1992): for symmetric positive
    (semi)definite M and a uniform start, the Lanczos estimate after k products falls below
    (1 − ε) λ_max with probability at most 1.648 √d e^{−√ε (2k − 1)}. Independent starts all fail
    with the product of their probabilities; then ‖f‖₂ ≤ sqrt(λ̂/(1 − ε)) (1 + margin), the margin
    covering the float32 products' rounding. Docs: docs/matching.md, "Operator-adapted expansion"."""
    n, m = f.shape
    if min(n, m) <= EXACT_NORM_MAX:
        exact = float(torch.linalg.matrix_norm(f.to(torch.float64), 2))
        return exact * (1.0 + NORM_ROUNDING_MARGIN), 0.0
    a = f if m <= n else f.T  # M = aᵀa has the smaller side d
    d = a.shape[1]
    gen = torch.Generator().manual_seed(int(seed))
    q = torch.randn((d, LANCZOS_STARTS), generator=gen, dtype=torch.float64)
    q /= q.norm(dim=0)
    basis, images = [], []
    for _ in range(LANCZOS_STEPS):
        basis.append(q)
        x = q.to(a.dtype)
        w = (a.T @ (a @ x)).to(torch.float64)
        images.append(w)
        w = w.clone()
        for _ in range(2):  # full reorthogonalisation, twice (float64)
            for u in basis:
                w -= u * (u * w).sum(dim=0)
        norm = w.norm(dim=0)
        q = w / norm.clamp_min(1e-300)
    # Rayleigh–Ritz on each start's Krylov basis: the largest eigenvalue of Qᵀ M Q
    qs = torch.stack(basis, dim=2)  # (d, starts, steps)
    ms = torch.stack(images, dim=2)
    best = 0.0
    for s in range(LANCZOS_STARTS):
        gram = qs[:, s, :].T @ qs[:, s, :]
        proj = qs[:, s, :].T @ ms[:, s, :]
        proj = (proj + proj.T) / 2.0
        mu, vec = torch.linalg.eigh(gram)
        keep = mu > 1e-10 * mu.max()
        white = vec[:, keep] / mu[keep].sqrt()
        best = max(best, float(torch.linalg.eigvalsh(white.T @ proj @ white).max()))
    k = LANCZOS_STEPS - 1
    per_start = min(1.0, 1.648 * np.sqrt(d) * np.exp(-np.sqrt(LANCZOS_EPSILON) * (2 * k - 1)))
    bound = np.sqrt(max(best, 0.0) / (1.0 - LANCZOS_EPSILON)) * (1.0 + NORM_ROUNDING_MARGIN)
    return float(bound), float(per_start**LANCZOS_STARTS)


def _sparse_indicator(mask: np.ndarray, dtype: torch.dtype, coef: float = 1.0) -> _Sparse:
    r, c = np.nonzero(mask)
    return _Sparse(
        mask.shape,
        torch.as_tensor(r, dtype=torch.int64),
        torch.as_tensor(c, dtype=torch.int64),
        torch.full((r.shape[0],), coef, dtype=dtype),
    )


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
        sp = _Sparse(
            w.shape,
            torch.cat([p.rows for p in parts]),
            torch.cat([p.cols for p in parts]),
            torch.cat([p.vals for p in parts]),
        )
        return _Factor(w.shape, ones=coefs[0], sparse=sp)
    dense = np.zeros(w.shape)
    for m, c in masks:
        dense[m] += c
    return _Factor(w.shape, ones=coefs[0], dense=torch.as_tensor(dense, dtype=dtype))


def _rescale(terms: list, s: float) -> list:
    """The terms with every H multiplied by s (in place for stacked dense terms)."""
    out = []
    for t in terms:
        if isinstance(t, _Stacked):
            for grp in t.psi:
                grp *= s
            if t.source is not None:
                t.source.scale *= s  # for the terms built later
            out.append(t)
        else:
            out.append((t[0], t[1].scaled(s)))
    return out


def _apply_block(
    terms, v: torch.Tensor, n_rows: int, cost: _Cost, out: torch.Tensor | None = None, rank: int | None = None
) -> torch.Tensor:
    """out += Σ_t F_t V H_tᵀ (a new zero matrix when ``out`` is None), returned; ``rank``: apply
    only the first ``rank`` stacked dense terms (all when None)."""
    if out is None:
        out = torch.zeros((n_rows, n_rows), dtype=v.dtype)
    ones = None
    for term in terms:
        if isinstance(term, _Stacked):
            term.apply(v, out, cost, rank)
        else:
            ones = ones or _RankOne(v, n_rows)
            _apply_term(term[0], term[1], v, ones, out, cost)
    if ones is not None:
        ones.add_to(out)
    return out


def _apply_block_constant(terms, c: float, n_rows: int, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """out += Σ_t F_t (c·J) H_tᵀ = c Σ_t (F_t 1)(H_t 1)ᵀ: the block applied to a constant matrix,
    at the cost of matrix-vector products (no n³ product)."""
    for term in terms:
        if isinstance(term, _Stacked):
            term.apply_constant(c, out)
        else:
            f, h = term
            out += c * torch.outer(f.row_sums(dtype), h.row_sums(dtype))
    return out


def _transposed(term):
    if isinstance(term, _Stacked):
        return term.t()
    return (term[0].t(), term[1].t())
