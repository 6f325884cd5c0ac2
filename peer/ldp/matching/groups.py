"""Factorised spectral matching over permutation groups (residual streams, normalisation).

The layered matcher (:func:`peer.ldp.matching.match_graphs`) aligns a chain of hidden layers. A
network traced into permutation groups (``peer.nn.tracing``) has instead groups that several
layers write and several read, and parameters that couple any two groups — or a group with
itself (``x + f(W x)`` with one Linear on the stream). This module builds the same quadratic
assignment affinity K over the elements of every group and finds its leading eigenvector
without forming K (docs/matching.md, "Permutation groups"):

* **nodes**: one per group element; x = (vec X_g) over the groups g;
* **unary terms** (diagonal of K), each an n_g×n_g matrix over (A element, B element) pairs,
  Sinkhorn-balanced to mean 1 as in the layered case: the activation affinity of the group's
  rows (n_g, P′); one fixed-side term per weight parameter with one axis permuted by the group
  and the other by no group (the input layer, the output head, a flattened map read by the
  head), U[i, j] = Σ_k κ(W^A[i, k], W^B[j, k]) / ν, ν = (fixed neighbours) · κ̄; and one
  *vector* term per group, the mean over the group's 1-D parameters (biases, BatchNorm /
  LayerNorm affine and running statistics) of a scalar Gaussian kernel per parameter;
* **edges** (off-diagonal Kronecker blocks): every parameter of ≥ 2 axes whose axis 0 is
  permuted by g_out and axis 1 by g_in is one block E, K[(g_out, i, j), (g_in, k, l)] =
  w_edge · κ(W^A[i, k], W^B[j, l]) / (ν e), ν = sqrt(n_out n_in) · κ̄, e weights per edge
  (k·k for a convolution, the flattened block of positions); several parameters on one pair
  of groups are separate blocks, summed; a block with g_out = g_in adds E + Eᵀ to that
  group's diagonal block, so K stays symmetric.

The blocks reuse the layered matcher's kernel expansions and factor algebra
(``peer.ldp.matching.blocks``, ``operators``): Chebyshev or operator-adapted expansions of
exact weights, the exact sparse expansion of few-valued (released multi-bit) weights.
The eigensolver is shifted power iteration (the reference) or power iteration with a
group-wise Rayleigh–Ritz step (the default above 128 elements), on the joint K; each group is
then discretised by a linear assignment after centring, and the result refined by coordinate
ascent on the exact objective (one linear assignment per group with the others held, kept
only when it raises the objective). ``solver = "dense"`` builds K in pygmtools' layout
(groups stacked; within group g the pair (i, j) is row offset_g + j·n_g + i) from exact
kernel values and runs ``pygmtools.sm`` — the reference for small structures.

Result convention (that of ``peer.nn.tracing.permute_state`` and
``peer.ldp.group_matching.match_groups``): ``perms[g][i] = j`` says element i of A's group g
is element j of B's, so ``permute_state(structure, arrays_b, perms)`` is B aligned to A.

What is public: the structure (names, shapes, groups) and the options. B enters only through
the arrays given — for a remote network its released activations and weight features — and
every bandwidth rule reads only those arrays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.ldp.matching.affinity import BOUND_KEEP_BYTES, KEEP_BUILT_TERMS_BYTES
from peer.ldp.matching.blocks import _Block, _block_terms, _exact_fixed_unary, _make_block, _mean_kernel
from peer.ldp.matching.dense import power_iteration_dense
from peer.ldp.matching.expansion import gaussian_kernel
from peer.ldp.matching.normalisation import _mean_sq_bandwidth, _spread_bandwidth, _squared_distances, sinkhorn_factors
from peer.ldp.matching.operators import _apply_block, _apply_block_constant, _Cost, _rescale, _Stacked, _transposed
from peer.ldp.matching.options import AUTO_FLOAT64_MAX_WIDTH, AUTO_SINGLE_THREAD_MAX_WIDTH, MatchOptions, MatchResult
from peer.ldp.matching.solvers import RANK_BUDGET_DIVISOR, RITZ_TOL_FACTOR, STALL, _discretise, _rank_for
from peer.nn.architectures import torch_threads
from peer.nn.tracing import PermutationStructure

__all__ = ["GroupAffinity", "GroupMatchResult", "match_group_features"]

#: The group matcher's result is the one result type of every matcher
#: (:class:`peer.ldp.matching.MatchResult`): ``perms[g][i] = j`` says element i of A's group g
#: is element j of B's (B aligned to A is ``permute_state(structure, arrays_b, perms)``);
#: ``objective`` is xᵀKx of the discrete solution from exact kernel values (comparable between
#: the two solvers); ``diagnostics``: solver, iterations, convergence, the blocks and unary terms
#: with their bandwidths, normalisers and expansion error bounds, the n³ products counted,
#: timings. The name is kept for callers written before the two types were one.
GroupMatchResult = MatchResult


@dataclass
class _Unary:
    """One unary (diagonal) term of group ``group``: ``kind`` "activation", "fixed" or
    "vector"; ``exact`` the unscaled float64 matrix of exact values (kept for small groups or
    recomputed), balanced by ``r``, ``c`` and weighted by ``weight``."""

    name: str
    group: str
    kind: str
    r: np.ndarray
    c: np.ndarray
    weight: float
    info: dict
    values: Any  # callable: perm -> exact unbalanced values at (i, perm[i]) (length n)
    matrix: Any  # callable: () -> exact unbalanced (n, n) float64 matrix
    approx: np.ndarray | None = None  # the factorised operator's unbalanced matrix, if not exact
    block: _Block | None = None  # a fixed-side term's weights, bandwidth and expansion


@dataclass
class _EdgeBlock:
    param: str
    g_out: str
    g_in: str
    block: _Block


def _unfold_edge(w: np.ndarray, axis0: int, axis1: int, n0: int, n1: int) -> np.ndarray:
    """(n0·axis0, n1·axis1, *k) -> (n0, n1, axis0·axis1·Πk): one row per (out unit, in unit)
    edge, its e weights in a fixed order (the block's positions, then the kernel's)."""
    rest = int(np.prod(w.shape[2:])) if w.ndim > 2 else 1
    w = w.reshape(n0, axis0, n1, axis1, rest).transpose(0, 2, 1, 3, 4)
    return w.reshape(n0, n1, axis0 * axis1 * rest)


class GroupAffinity:
    """The merged, normalised K over every group's element pairs (module docstring), shared by
    the factorised operator (:meth:`apply`, :meth:`matvec`), the dense reference
    (:meth:`dense`) and the objective (:meth:`objective`)."""

    def __init__(
        self,
        structure: PermutationStructure,
        activations_a: Mapping[str, Any] | None,
        arrays_a: Mapping[str, Any],
        activations_b: Mapping[str, Any] | None,
        arrays_b: Mapping[str, Any],
        options: MatchOptions | None = None,
        *,
        build_operator: bool = True,
    ):
        t0 = time.perf_counter()
        options = MatchOptions.of(options)
        if not isinstance(structure, PermutationStructure):
            raise InvalidArgument("structure", f"must be a PermutationStructure, got {type(structure).__name__}")
        if not structure.groups:
            raise InvalidArgument("structure", "has no permutation groups: nothing to match")
        self.structure = structure
        self.names = [g.name for g in structure.groups]
        self.sizes = {g.name: int(g.size) for g in structure.groups}
        self.options = options = options.resolved(self.sizes.values())
        arrays_a = _check_arrays(structure, arrays_a, "arrays_a")
        arrays_b = _check_arrays(structure, arrays_b, "arrays_b")
        acts = None
        if options.activation_weight > 0:
            acts = _check_activations(structure, activations_a, activations_b)
        widest = max(self.sizes.values())
        if options.dtype == "auto":
            self.dtype = torch.float64 if widest <= AUTO_FLOAT64_MAX_WIDTH else torch.float32
        else:
            self.dtype = torch.float64 if options.dtype == "float64" else torch.float32
        offsets = np.concatenate([[0], np.cumsum([self.sizes[g] ** 2 for g in self.names])])
        self.offsets = {g: int(o) for g, o in zip(self.names, offsets[:-1], strict=True)}
        self.pairs = int(offsets[-1])

        axis_group: dict[tuple[str, int], tuple[str, int]] = {}
        for g in structure.groups:
            for a in g.axes:
                axis_group[(a.param, a.axis)] = (g.name, a.block)

        self.unary: list[_Unary] = []
        if acts is not None:
            for g in self.names:
                self.unary.append(self._activation_term(g, *acts[g]))

        # weight parameters: edges between groups, or fixed-side unary terms
        self.edges: list[_EdgeBlock] = []
        fixed_blocks: list[tuple[str, str, _Block]] = []
        vectors: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {g: [] for g in self.names}
        for p, shape in structure.parameters.items():
            if len(shape) == 0 or not np.issubdtype(np.asarray(arrays_a[p]).dtype, np.floating):
                continue
            for ax in range(2, len(shape)):
                if (p, ax) in axis_group:
                    raise InvalidArgument(
                        "structure", f"{p!r} axis {ax} is permuted: only axes 0 and 1 of a weight can be matched"
                    )
            wa = np.asarray(arrays_a[p], dtype=np.float64)
            wb = np.asarray(arrays_b[p], dtype=np.float64)
            out_g = axis_group.get((p, 0))
            if len(shape) == 1:
                if out_g is not None:
                    n, blk = self.sizes[out_g[0]], out_g[1]
                    vectors[out_g[0]].append((p, wa.reshape(n, blk), wb.reshape(n, blk)))
                continue
            in_g = axis_group.get((p, 1))
            if out_g is None and in_g is None:
                continue
            if out_g is not None and in_g is not None:
                (go, bo), (gi, bi) = out_g, in_g
                ea = _unfold_edge(wa, bo, bi, self.sizes[go], self.sizes[gi])
                eb = _unfold_edge(wb, bo, bi, self.sizes[go], self.sizes[gi])
                self.edges.append(_EdgeBlock(p, go, gi, _make_block(p, "hidden", ea, eb, options)))
            elif out_g is not None:
                g, blk = out_g
                ea = _unfold_edge(wa, blk, 1, self.sizes[g], shape[1])
                eb = _unfold_edge(wb, blk, 1, self.sizes[g], shape[1])
                fixed_blocks.append((p, g, _make_block(p, "input", ea, eb, options)))
            else:
                g, blk = in_g
                # (fixed rows, n_g·block, *k) -> (n_g, fixed rows, e): "incoming" orientation
                ea = _unfold_edge(wa, 1, blk, shape[0], self.sizes[g]).transpose(1, 0, 2)
                eb = _unfold_edge(wb, 1, blk, shape[0], self.sizes[g]).transpose(1, 0, 2)
                fixed_blocks.append(
                    (p, g, _make_block(p, "input", np.ascontiguousarray(ea), np.ascontiguousarray(eb), options))
                )

        edge_on = options.edge_weight > 0
        cost = _Cost()
        for name, g, b in fixed_blocks:
            terms = _block_terms(b, self.dtype) if (build_operator and edge_on) else []
            self._normalise(b, neighbours=b.weights_a.shape[1])
            if not edge_on:
                continue
            if build_operator:
                # U = Σ_k F[:, k] H[:, k]ᵀ = F I Hᵀ through the expansion (no n²·d kernel values)
                eye = torch.eye(b.weights_a.shape[1], dtype=self.dtype)
                u = _apply_block(_rescale(terms, b.scale), eye, self.sizes[g], cost).numpy().astype(np.float64)
            else:
                u = _exact_fixed_unary(b, incoming=True)
            self.unary.append(self._fixed_term(name, g, b, u))
        for e in self.edges:
            b = e.block
            terms = _block_terms(b, self.dtype) if (build_operator and edge_on) else []
            self._normalise(b, neighbours=math.sqrt(b.weights_a.shape[0] * b.weights_a.shape[1]))
            if build_operator and edge_on:
                b.terms = _rescale(terms, b.scale)
                b.terms_t = [_transposed(t) for t in b.terms]
        vector_weight = options.edge_weight if options.vector_weight is None else options.vector_weight
        if edge_on and vector_weight > 0:
            for g in self.names:
                term = self._vector_term(g, vectors[g], vector_weight)
                if term is not None:
                    self.unary.append(term)

        # D_g as the factorised operator holds it (working precision)
        self._diag: dict[str, torch.Tensor] | None = None
        if build_operator:
            self._diag = {g: torch.zeros((n, n), dtype=self.dtype) for g, n in self.sizes.items()}
            for u in self.unary:
                self._diag[u.group] += torch.as_tensor(self._balanced(u, approx=True), dtype=self.dtype)
        self.setup_seconds = time.perf_counter() - t0

    # -- construction ------------------------------------------------------------------------

    def _normalise(self, b: _Block, neighbours: float) -> None:
        b.mean_kernel = _mean_kernel(b)
        if not b.mean_kernel > 0:
            raise InvalidArgument(
                "options.weight_sigma",
                f"{b.sigma:g} is so small that every weight affinity of {b.name} underflows to 0",
            )
        b.normaliser = neighbours * b.mean_kernel
        b.scale = self.options.edge_weight / (b.normaliser * b.weights_a.shape[2])

    def _balance(self, m: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Sinkhorn factors (mean 1 after balancing), or, unbalanced, division by the mean."""
        if self.options.balance:
            return sinkhorn_factors(m, what)
        return np.full(m.shape[0], 1.0 / float(m.mean())), np.ones(m.shape[1])

    def _activation_term(self, g: str, fa: np.ndarray, fb: np.ndarray) -> _Unary:
        """As ``Affinity`` does for a hidden layer (docs/matching.md, "Normalisation",
        "Bandwidths"): the spread (or mean, or given) bandwidth, the kernel with its row and
        column means taken out of the exponent when balancing, Sinkhorn factors."""
        opts = self.options
        if opts.activation_sigma is not None:
            sigma = opts.activation_sigma
        elif opts.activation_bandwidth == "spread":
            sigma = _spread_bandwidth(fa, fb)
        else:
            sigma = _mean_sq_bandwidth(fa, fb)
        sq = _squared_distances(fa, fb)
        if opts.balance:
            row, col, grand = sq.mean(axis=1), sq.mean(axis=0), float(sq.mean())
        else:
            row, col, grand = np.zeros(sq.shape[0]), np.zeros(sq.shape[1]), 0.0
        na = np.exp(-(sq - row[:, None] - col[None, :] + grand) / sigma)
        mean = float(na.mean())
        if not mean > 0 or not np.all(np.isfinite(na)):
            raise InvalidArgument(
                "options.activation_sigma",
                f"{sigma:g} makes the activation affinities of group {g!r} underflow to 0 or overflow",
            )
        r, c = self._balance(na, f"activation affinity of group {g!r}")

        def values(perm, fa=fa, fb=fb, row=row, col=col, grand=grand, sigma=sigma):
            d = np.sum((fa - fb[perm]) ** 2, axis=1) - row - col[perm] + grand
            return np.exp(-d / sigma)

        def matrix(fa=fa, fb=fb, row=row, col=col, grand=grand, sigma=sigma):
            return np.exp(-(_squared_distances(fa, fb) - row[:, None] - col[None, :] + grand) / sigma)

        return _Unary(
            f"activations:{g}",
            g,
            "activation",
            r,
            c,
            opts.activation_weight,
            {"sigma": float(sigma), "mean_affinity": mean},
            values,
            matrix,
        )

    def _fixed_term(self, name: str, g: str, b: _Block, u: np.ndarray) -> _Unary:
        """A weight parameter with one axis in group g and the other fixed: unary, because the
        fixed units never move (U_in / U_out of the layered case), balanced, weight w_edge.
        ``u`` is already scaled by w_edge/(ν e); the balanced term has mean w_edge."""
        if self.options.balance:
            r, c = sinkhorn_factors(u, f"fixed-side weight affinity of {name!r}")
        else:  # already divided by its normaliser and weighted (as U_in / U_out)
            r, c = np.ones(u.shape[0]), np.ones(u.shape[1])

        def values(perm, b=b):
            return gaussian_kernel(b.weights_a, b.weights_b[perm], b.sigma).sum(axis=(1, 2)) * b.scale

        def matrix(b=b):
            return _exact_fixed_unary(b, incoming=True)

        weight = self.options.edge_weight if self.options.balance else 1.0
        return _Unary(f"fixed:{name}", g, "fixed", r, c, weight, b.describe(), values, matrix, approx=u, block=b)

    def _vector_term(self, g: str, vectors: list[tuple[str, np.ndarray, np.ndarray]], weight: float) -> _Unary | None:
        """The group's 1-D parameters (biases, normalisation affine and running statistics):
        V[i, j] = (1/m) Σ_p (1/b_p) Σ_c κ_p(v_p^A[i, c], v_p^B[j, c]), one scalar Gaussian per
        parameter with its own mean-squared-difference bandwidth (so that a running variance
        and a bias count alike whatever their scales). Parameters constant over the group's
        elements on both sides say nothing about the correspondence and are left out."""
        used = [(p, va, vb) for p, va, vb in vectors if np.ptp(va) > 0 or np.ptp(vb) > 0]
        if not used:
            return None
        sigmas = [
            self.options.weight_sigma or _mean_sq_bandwidth(va.reshape(-1, 1), vb.reshape(-1, 1)) for _, va, vb in used
        ]

        def matrix(used=used, sigmas=sigmas):
            total = 0.0
            for (_, va, vb), s in zip(used, sigmas, strict=True):
                total = total + gaussian_kernel(va[:, None, :], vb[None, :, :], s).mean(axis=2)
            return total / len(used)

        def values(perm, used=used, sigmas=sigmas):
            total = 0.0
            for (_, va, vb), s in zip(used, sigmas, strict=True):
                total = total + gaussian_kernel(va, vb[perm], s).mean(axis=1)
            return total / len(used)

        r, c = self._balance(matrix(), f"vector parameters of group {g!r}")
        info = {"parameters": [p for p, _, _ in used], "sigmas": [float(s) for s in sigmas]}
        return _Unary(f"vectors:{g}", g, "vector", r, c, weight, info, values, matrix)

    def _balanced(self, u: _Unary, approx: bool = False) -> np.ndarray:
        """The term as it enters K: weight · diag(r) · M · diag(c), M exact (or, with
        ``approx``, the factorised operator's expansion of it where it has one)."""
        m = u.approx if approx and u.approx is not None else u.matrix()
        return u.weight * u.r[:, None] * m * u.c[None, :]

    # -- the operator ------------------------------------------------------------------------

    def apply(self, v: Mapping[str, torch.Tensor], cost: _Cost | None = None) -> dict[str, torch.Tensor]:
        """K v with v given per group as n_g×n_g tensors ([i, j] = pair (A element i, B element j))."""
        if self._diag is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        cost = _Cost() if cost is None else cost
        out = {g: self._diag[g] * v[g] for g in self.names}
        for e in self.edges:
            b = e.block
            if not b.terms:
                continue
            _apply_block(b.terms, v[e.g_in], self.sizes[e.g_out], cost, out=out[e.g_out])
            _apply_block(b.terms_t, v[e.g_out], self.sizes[e.g_in], cost, out=out[e.g_in])
        return out

    def coupling(self, perms: Mapping[str, np.ndarray], g: str, cost: _Cost | None = None) -> torch.Tensor:
        """(K x)_g − D_g ∘ x_g for the permutation matrices x of ``perms``: what the blocks
        touching group g send it (factorised). A stacked term applied to a permutation matrix
        P needs one product instead of two: Σ_r F_r P H_rᵀ = [F_r]_r [H_r P-permuted]_rᵀ, the
        permutation being a gather of H's columns (or rows, for the transposed direction)."""
        cost = _Cost() if cost is None else cost
        out = torch.zeros((self.sizes[g],) * 2, dtype=self.dtype)
        for e in self.edges:
            if not e.block.terms:
                continue
            if e.g_out == g:
                _apply_permutation(e.block.terms, perms[e.g_in], self.sizes[g], cost, out, self.dtype)
            if e.g_in == g:
                _apply_permutation(e.block.terms_t, perms[e.g_out], self.sizes[g], cost, out, self.dtype)
        return out

    @property
    def is_diagonal(self) -> bool:
        return not self.edges or self.options.edge_weight == 0

    def diagonal(self) -> dict[str, np.ndarray]:
        """D_g in float64 from exact values (the factorised operator's fixed-side terms come
        from the expansion, within its bound)."""
        out = {g: np.zeros((n, n)) for g, n in self.sizes.items()}
        for u in self.unary:
            out[u.group] += self._balanced(u)
        return out

    def to_groups(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        """A vector in the dense layout -> per-group [i, j] matrices."""
        vec = np.asarray(vec)
        return {g: vec[self.offsets[g] : self.offsets[g] + n * n].reshape(n, n).T for g, n in self.sizes.items()}

    def from_groups(self, mats: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(mats[g]).T.reshape(-1) for g in self.names])

    def matvec(self, vec: np.ndarray) -> np.ndarray:
        """K·vec through the factorised operator, in the dense layout (tests and checks)."""
        v = {g: torch.as_tensor(np.ascontiguousarray(x), dtype=self.dtype) for g, x in self.to_groups(vec).items()}
        return self.from_groups({g: x.numpy().astype(np.float64) for g, x in self.apply(v).items()})

    # -- the dense reference -----------------------------------------------------------------

    def dense(self) -> np.ndarray:
        """K as a dense float64 matrix from exact kernel values, in pygmtools' layout (groups
        stacked in the structure's order; within group g the pair (A element i, B element j) is
        row offset_g + j·n_g + i); small structures only."""
        if self.pairs * self.pairs * 8 > self.options.dense_memory_cap:
            raise InvalidArgument(
                "structure",
                f"groups {self.sizes} give a dense affinity of {self.pairs}² entries, over "
                f"dense_memory_cap = {self.options.dense_memory_cap} bytes; use solver='factorised'",
            )
        k = np.zeros((self.pairs, self.pairs))
        for g, d in self.diagonal().items():
            o, n = self.offsets[g], self.sizes[g]
            idx = np.arange(o, o + n * n)
            k[idx, idx] += d.T.reshape(-1)
        if self.options.edge_weight > 0:
            for e in self.edges:
                b = e.block
                n, m = self.sizes[e.g_out], self.sizes[e.g_in]
                ro, co = self.offsets[e.g_out], self.offsets[e.g_in]
                blk_all = np.zeros((n * n, m * m))
                for j in range(n):
                    # rows (i, j) for fixed j; columns (k, l): κ(W_a[i, k], W_b[j, l]) at [i, l, k]
                    blk = np.zeros((n, m, m))
                    for c in range(b.weights_a.shape[2]):
                        blk += gaussian_kernel(
                            b.weights_b[j, :, c][None, :, None], b.weights_a[:, :, c][:, None, :], b.sigma
                        )
                    blk_all[j * n : (j + 1) * n] = blk.reshape(n, m * m) * b.scale
                # E and Eᵀ: for a block on one group (g_out = g_in) both land in its diagonal block
                k[ro : ro + n * n, co : co + m * m] += blk_all
                k[co : co + m * m, ro : ro + n * n] += blk_all.T
        return k

    # -- the objective -----------------------------------------------------------------------

    def objective(self, perms: Mapping[str, np.ndarray], only: str | None = None) -> float:
        """xᵀKx for the permutation matrices X_g[i, perms[g][i]] = 1, from exact kernel values
        and the shared normalisers and balancing factors (both solvers' are comparable).
        ``only``: the terms that involve group ``only`` (its unary terms and every block
        touching it), which is all that changes when only that group's permutation does."""
        total = 0.0
        for u in self.unary:
            if only is not None and u.group != only:
                continue
            p = perms[u.group]
            total += u.weight * float(np.sum(u.values(p) * u.r * u.c[p]))
        if self.options.edge_weight > 0:
            for e in self.edges:
                if only is not None and only not in (e.g_out, e.g_in):
                    continue
                b = e.block
                wb = b.weights_b[perms[e.g_out]][:, perms[e.g_in]]
                # E and Eᵀ (or the two off-diagonal blocks) both count: 2·scale·Σ κ
                total += 2.0 * float(gaussian_kernel(b.weights_a, wb, b.sigma).sum()) * b.scale
        return total

    def diagnostics(self) -> dict:
        return {
            "groups": dict(self.sizes),
            "pairs": self.pairs,
            "dtype": str(self.dtype).replace("torch.", ""),
            "unary": [{"term": u.name, "kind": u.kind, **u.info} for u in self.unary],
            "edges": [{"param": e.param, "out": e.g_out, "in": e.g_in, **e.block.describe()} for e in self.edges],
            "self_loops": [e.param for e in self.edges if e.g_out == e.g_in],
            "expansion_error_bound": max([e.block.error_bound for e in self.edges] + [0.0]),
            "fixed_expansion_error_bound": max(
                [u.info["error_bound"] for u in self.unary if u.kind == "fixed"] + [0.0]
            ),
        }


def _check_arrays(structure: PermutationStructure, arrays: Any, name: str) -> dict[str, np.ndarray]:
    if not isinstance(arrays, Mapping):
        raise InvalidArgument(name, f"must be a mapping of parameter name to array, got {type(arrays).__name__}")
    structure.check_arrays(arrays, name)
    out = {}
    for k, v in arrays.items():
        a = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise InvalidArgument(f"{name}[{k}]", "contains NaN or infinite values")
        out[k] = a
    return out


def _check_activations(structure, acts_a, acts_b) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for name, acts in (("activations_a", acts_a), ("activations_b", acts_b)):
        if not isinstance(acts, Mapping):
            raise InvalidArgument(
                name,
                "must map every group name to its (n_g, P') activation rows (or set options.activation_weight = 0)",
            )
        extra = set(acts) - {g.name for g in structure.groups}
        if extra:
            raise InvalidArgument(name, f"names no group of the structure: {sorted(extra)}")
    for g in structure.groups:
        pair = []
        for name, acts in (("activations_a", acts_a), ("activations_b", acts_b)):
            if g.name not in acts:
                raise InvalidArgument(f"{name}[{g.name}]", "is missing: every group needs its activation rows")
            a = np.asarray(acts[g.name], dtype=np.float64)
            if a.ndim != 2 or a.shape[0] != g.size or a.shape[1] == 0:
                raise InvalidArgument(f"{name}[{g.name}]", f"must be a ({g.size}, P') array, got shape {a.shape}")
            if not np.all(np.isfinite(a)):
                raise InvalidArgument(f"{name}[{g.name}]", "contains NaN or infinite values")
            pair.append(a)
        if pair[0].shape != pair[1].shape:
            raise InvalidArgument(
                f"activations_b[{g.name}]",
                f"has shape {pair[1].shape}, A's has {pair[0].shape}: both must come from one probe set",
            )
        out[g.name] = (pair[0], pair[1])
    return out


def _norm(v: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(x * x, dtype=torch.float64)) for x in v.values()))


def _power_iteration(aff: GroupAffinity, product_threads: int):
    """Shifted power iteration from the uniform vector (pygmtools' start and stopping rule,
    ‖v_k − v_{k−1}‖ < tol), as the layered reference path (docs/matching.md, "The shift")."""
    opts = aff.options
    v = {g: torch.full((n, n), 1.0 / aff.pairs, dtype=aff.dtype) for g, n in aff.sizes.items()}
    shift = opts.shift
    converged, it, residual, norm, cost = False, 0, float("inf"), 0.0, _Cost(product_threads)
    for it in range(1, opts.max_iter + 1):  # noqa: B007 (the loop variable is the result)
        cost = _Cost(product_threads)
        w = aff.apply(v, cost)
        if shift is None:
            shift = 0.5 * _norm(w) / _norm(v)
        for g in aff.names:
            w[g].add_(v[g], alpha=shift)
        norm = _norm(w)
        if not norm > 0:
            break
        for x in w.values():
            x.div_(norm)
        residual = math.sqrt(sum(float(torch.dist(w[g], v[g])) ** 2 for g in aff.names))
        v = w
        if residual < opts.tol:
            converged = True
            break
    return {g: x.numpy() for g, x in v.items()}, it, converged, residual, norm - (shift or 0.0), cost, shift or 0.0


def _images_by_source(
    aff: GroupAffinity,
    v: Mapping[str, torch.Tensor],
    cost: _Cost,
    constant: bool = False,
    ranks: Mapping[str, int | None] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """The edge part of K(e_g ⊗ v_g) for every group g: source g -> {target group: tensor}
    (a block E from g_in to g_out sends E(v_in) to g_out and Eᵀ(v_out) to g_in; a block on
    one group sends both to that group). ``constant``: every v_g is c·J (c = its [0, 0]
    entry), applied with matrix-vector work only. ``ranks[param]``: apply only the first so
    many terms of that block's operator-adapted expansion (all when None); while all blocks'
    lazily built terms together take more than ``KEEP_BUILT_TERMS_BYTES``, those beyond the
    rank are freed (below it they stay built for later products and the refinement, which
    would otherwise build them again). The diagonal part D_g ∘ v_g is left out."""
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in aff.names}
    built = sum(t.built_bytes() for e in aff.edges for t in e.block.terms if isinstance(t, _Stacked))
    free = built > KEEP_BUILT_TERMS_BYTES
    for e in aff.edges:
        b = e.block
        if not b.terms:
            continue
        rank = None if ranks is None else ranks.get(e.param)
        for source, target, terms in ((e.g_in, e.g_out, b.terms), (e.g_out, e.g_in, b.terms_t)):
            x = v[source]
            acc = out[source].get(target)
            if acc is None:
                acc = out[source][target] = torch.zeros((aff.sizes[target],) * 2, dtype=x.dtype)
            if constant:
                _apply_block_constant(terms, float(x[0, 0]), aff.sizes[target], x.dtype, acc)
            else:
                for t in terms:
                    if free and isinstance(t, _Stacked):
                        t.trim(rank)  # free lazily built terms this product does not use
                _apply_block(terms, x, aff.sizes[target], cost, out=acc, rank=rank)
    return out


def _source_errors(aff: GroupAffinity, ranks: Mapping[str, int | None] | None = None) -> dict[str, float]:
    """Per source group, Σ over the blocks its image passes through of the operator bound
    ‖ΔE‖₂ of the terms applied (``_Block.operator_error``; a block on one group counts twice:
    E and Eᵀ both act): times ‖x_g‖ it bounds the image's distance from the exact-kernel one."""
    out = dict.fromkeys(aff.names, 0.0)
    for e in aff.edges:
        if not e.block.terms:
            continue
        err = e.block.operator_error(None if ranks is None else ranks.get(e.param))
        out[e.g_in] += err
        out[e.g_out] += err
    return out


def _group_ritz_step(basis, diag: Mapping[str, torch.Tensor], tiny: float) -> tuple[float, np.ndarray]:
    """The largest Ritz pair of K on span(basis), entries (group g, x, {target: edge part of
    K(e_g ⊗ x)}, error bound of that image): θ and the coefficients of its unit-norm Ritz
    vector, signed to a positive sum. As ``solvers._ritz_step``, except that within a group K
    is D_g plus the blocks that join the group to itself, so xᵢᵀ K xⱼ there is Σ xᵢ D_g xⱼ plus
    the within-group part of an image. K is symmetric, so each edge part is read from the image
    with the smaller error per unit norm (the coupling vᵀKr = ‖r‖² must not come from the
    residual's image, which may hold fewer expansion terms)."""
    m = len(basis)
    gram, kmat = np.zeros((m, m)), np.zeros((m, m))
    for i, (gi, xi, _, _) in enumerate(basis):
        for j in range(i, m):
            gj, xj, _, _ = basis[j]
            if gi == gj:
                gram[i, j] = gram[j, i] = float(torch.sum(xi * xj, dtype=torch.float64))
    norms = np.sqrt(np.diag(gram))
    accuracy = [err / nrm if nrm > 0 else 0.0 for (_, _, _, err), nrm in zip(basis, norms, strict=True)]
    for i, (gi, xi, imi, _) in enumerate(basis):
        for j in range(i, m):
            gj, xj, imj, _ = basis[j]
            value = float(torch.sum(xi * diag[gi] * xj, dtype=torch.float64)) if gi == gj else 0.0
            # x_iᵀ (K x_j) from x_j's image, or x_jᵀ (K x_i) from x_i's: the more accurate one
            if accuracy[j] <= accuracy[i]:
                value += float(torch.sum(xi * imj[gi], dtype=torch.float64)) if gi in imj else 0.0
            else:
                value += float(torch.sum(xj * imi[gj], dtype=torch.float64)) if gj in imi else 0.0
            kmat[i, j] = kmat[j, i] = value
    d = norms
    keep_basis = d > 0
    d_k = d[keep_basis]
    g = gram[np.ix_(keep_basis, keep_basis)] / np.outer(d_k, d_k)
    k = kmat[np.ix_(keep_basis, keep_basis)] / np.outer(d_k, d_k)
    mu, q = np.linalg.eigh(g)
    keep = mu > tiny * mu.max()
    q = q[:, keep] / np.sqrt(mu[keep])
    lam, u = np.linalg.eigh(q.T @ k @ q)
    c = np.zeros(m)
    c[keep_basis] = (q @ u[:, -1]) / d_k
    sums = sum(float(c[i]) * float(x.sum(dtype=torch.float64)) for i, (_, x, _, _) in enumerate(basis))
    return float(lam[-1]), (-c if sums < 0 else c)


def _ritz(aff: GroupAffinity, product_threads: int):
    """Power iteration accelerated by a group-wise Rayleigh–Ritz step (docs/matching.md,
    "Layer-wise Rayleigh–Ritz", with groups for layers): the search space holds, for every
    group g separately, its block of v, of the residual r = K v − θ v and of the previous
    residual; the images of those vectors are kept (by source group), so every step costs
    one product of K, with the residual. Each such product applies only as many terms of an
    operator-adapted expansion as the residual's size needs (the layered rule,
    ``solvers._rank_for``); every kept image carries a bound on its distance from the
    exact-kernel image, combined with the Ritz coefficients into ``operator_error_bound``.
    Stops at ‖K v − θ v‖ < RITZ_TOL_FACTOR·tol·θ, or, not converged, after STALL steps
    without a smaller residual."""
    opts = aff.options
    tiny = 1e-12 if aff.dtype == torch.float64 else 1e-6
    cost = _Cost(product_threads)
    live = [e for e in aff.edges if e.block.terms]
    start = {g: torch.ones((n, n), dtype=aff.dtype) for g, n in aff.sizes.items()}
    images = _images_by_source(aff, start, cost, constant=True)
    full = _source_errors(aff)
    basis = [(g, start[g], images[g], full[g] * float(aff.sizes[g])) for g in aff.names]  # ‖J‖ = n
    previous: list = []
    ranks_used: list[dict] = []
    converged, it, residual, theta, bound = False, 0, float("inf"), 0.0, 0.0
    best, best_it = float("inf"), 0
    stop_at = opts.tol * RITZ_TOL_FACTOR
    v: dict[str, torch.Tensor] = start
    for it in range(1, opts.max_iter + 1):
        theta, coef = _group_ritz_step(basis, aff._diag, tiny)
        v, im_v, errors = {}, {}, dict.fromkeys(aff.names, 0.0)
        for c, (g, x, im, err) in zip(coef, basis, strict=True):
            errors[g] += abs(float(c)) * err
            if g not in v:
                v[g] = x * c
                im_v[g] = {t: y * c for t, y in im.items()}
                continue
            if c == 0.0:
                continue
            v[g].add_(x, alpha=c)
            for t, y in im.items():
                if t in im_v[g]:
                    im_v[g][t].add_(y, alpha=c)
                else:
                    im_v[g][t] = y * c
        basis = None
        kv = {g: aff._diag[g] * v[g] for g in aff.names}
        for im in im_v.values():
            for t, y in im.items():
                kv[t].add_(y)
        r = {g: kv[g] - theta * v[g] for g in aff.names}
        del kv
        bound = sum(errors.values())
        rnorm = _norm(r)
        residual = rnorm / theta if theta > 0 else float("inf")
        if residual < stop_at or not theta > 0:
            converged = theta > 0
            break
        if residual < best:
            best, best_it = residual, it
        elif it - best_it >= STALL:
            break
        if it == opts.max_iter:
            break
        # the layered rule (``solvers._ritz_factorised``): a block error ε adds about 2ε‖r‖/θ to
        # ‖(K̃ − K)v‖; keep that ≤ (the stopping level)·θ/blocks per product, a block on one
        # group counting twice (E and Eᵀ both act on its source), with the spectral-norm bounds
        # of the centred terms, which can only lower a rank (docs/matching.md, "One matcher for
        # every network": with a quarter of this budget and the Frobenius bound alone, the group
        # path took 2.7 times the layered one's wall time on exact weights at width 1024)
        blocks = sum(2 if e.g_in == e.g_out else 1 for e in live)
        budget = stop_at * theta * theta / (RANK_BUDGET_DIVISOR * max(1, blocks) * rnorm)
        ranks = {
            e.param: _rank_for(e.block, budget, lambda upto, b=e.block: b.bound_terms(upto, BOUND_KEEP_BYTES))
            for e in live
        }
        ranks_used.append(ranks)
        step = _images_by_source(aff, r, cost, ranks=ranks)
        per_source = _source_errors(aff, ranks)
        fresh = [
            (g, r[g], step[g], per_source[g] * math.sqrt(float(torch.sum(r[g] * r[g], dtype=torch.float64))))
            for g in aff.names
        ]
        basis = [(g, v[g], im_v[g], errors[g]) for g in aff.names] + fresh + previous
        previous = fresh
    extra = {
        "ranks": ranks_used,
        "operator_error_bound": bound / theta if theta > 0 else float("inf"),
        "residual_bound": residual + (bound / theta if theta > 0 else float("inf")),
        "bound_failure_probability": float(sum(e.block.bound_failure for e in live)),
    }
    return {g: x.numpy() for g, x in v.items()}, it, converged, residual, theta, cost, 0.0, extra


def _refine(aff: GroupAffinity, perms: dict[str, np.ndarray], sweeps: int, score) -> tuple[dict, dict]:
    """Coordinate ascent on the exact objective from the spectral solution (docs/matching.md,
    "Permutation groups"): for each group g in turn, with the others held, xᵀKx is
    Σ_ij X_g[i, j]·(D_g + 2·C_g)[i, j] + const, C_g = (K x)_g − D_g ∘ x_g the coupling from
    the blocks touching g — linear in X_g, so one linear assignment gives its best X_g
    (exactly, unless a block joins g to itself: then C_g is the linearisation at the current
    X_g). ``score(x, g)`` returns D_g + 2·C_g. A new X_g is kept only if the exact
    objective's terms involving g increase; sweeps stop when one changes nothing, so the
    objective never decreases."""
    done, moved = 0, 0
    for done in range(1, sweeps + 1):  # noqa: B007 (the loop variable is the result)
        changed = False
        for g in aff.names:
            new = _discretise([score(perms, g)])[0]
            if np.array_equal(new, perms[g]):
                continue
            candidate = {**perms, g: new}
            before = aff.objective(perms, only=g)
            if aff.objective(candidate, only=g) > before + 1e-12 * max(1.0, abs(before)):
                moved += int(np.sum(new != perms[g]))
                perms, changed = candidate, True
        if not changed:
            break
    return perms, {"sweeps": done, "elements_moved": moved}


def _apply_permutation(terms, perm: np.ndarray, n_rows: int, cost: _Cost, out: torch.Tensor, dtype) -> None:
    """out += Σ_t F_t X H_tᵀ for the permutation matrix X[k, perm[k]] = 1 (``_apply_block`` on
    X, with a gather instead of the first product for stacked dense terms, plus the mean parts
    of centred terms):
    E(X)[i, j] = Σ_r Σ_k F_r[i, k] H_r[j, perm[k]] and, transposed,
    Eᵀ(X)[k, l] = Σ_r Σ_i F_r[i, k] H_r[perm[i], l]."""
    idx = torch.as_tensor(np.asarray(perm, dtype=np.int64))
    rest = []
    for t in terms:
        if not isinstance(t, _Stacked):
            rest.append(t)
            continue
        if t.source is None or not t.phi:
            t.ensure(None)
        # else: the lazily built terms the eigensolver has built (its first product's rank):
        # a score only proposes a candidate, the exact objective decides, and building the
        # rest would cost more than the sweep itself
        for phi_g, psi_g in zip(t.phi, t.psi, strict=True):
            n, r, m = phi_g.shape
            with cost.threads():
                if not t.transposed:
                    cost.add(n, r * m, n)
                    out += phi_g.reshape(n, r * m) @ psi_g.index_select(2, idx).reshape(n, r * m).T
                else:
                    cost.add(m, n * r, m)
                    out += phi_g.reshape(n * r, m).T @ psi_g.index_select(0, idx).reshape(n * r, m)
        if t.source is not None and t.source.means is not None:
            # centred terms: their mean parts (matrix–vector work on X), as _Stacked.apply adds
            t.source.apply_means(_permutation_matrix(perm, dtype), out, t.transposed)
    if rest:
        _apply_block(rest, _permutation_matrix(perm, dtype), n_rows, cost, out=out)


def _permutation_matrix(perm: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    x = torch.zeros((len(perm), len(perm)), dtype=dtype)
    x[torch.arange(len(perm)), torch.as_tensor(np.asarray(perm, dtype=np.int64))] = 1.0
    return x


def match_group_features(
    structure: PermutationStructure,
    activations_a: Mapping[str, Any] | None,
    arrays_a: Mapping[str, Any],
    activations_b: Mapping[str, Any] | None,
    arrays_b: Mapping[str, Any],
    options: MatchOptions | None = None,
    *,
    refine_sweeps: int = 10,
) -> GroupMatchResult:
    """Align B's permutation groups to A's by spectral matching of the joint affinity over all
    groups (module docstring; docs/matching.md, "Permutation groups").

    ``activations_*``: group name -> (n_g, P′) activation rows (exact:
    ``peer.ldp.group_matching.group_activations``; released:
    ``peer.ldp.mechanisms.groups.perturb_group_activations``), both from one probe set; may be
    None only with ``options.activation_weight = 0``. ``arrays_*``: the state arrays keyed by
    the structure's parameter names (exact, or released weight features). ``options``: as for
    :func:`peer.ldp.matching.match_graphs`: ``eigensolver`` "power" (shifted power iteration,
    the reference), "ritz" (with a group-wise Rayleigh–Ritz step) or "auto" ("ritz" when some
    group has more than ``AUTO_FAST_MIN_WIDTH`` elements); ``solver = "dense"`` runs
    pygmtools' ``sm`` on the dense K. ``refine_sweeps``: sweeps of coordinate ascent on the
    exact objective after discretisation (0 = the spectral solution as it is).
    """
    options = MatchOptions.of(options)
    if not isinstance(structure, PermutationStructure):
        raise InvalidArgument("structure", f"must be a PermutationStructure, got {type(structure).__name__}")
    if isinstance(refine_sweeps, bool) or not isinstance(refine_sweeps, (int, np.integer)) or refine_sweeps < 0:
        raise InvalidArgument("refine_sweeps", f"must be an integer >= 0, got {refine_sweeps!r}")
    widest = max((g.size for g in structure.groups), default=1)
    threads = options.threads or (1 if widest <= AUTO_SINGLE_THREAD_MAX_WIDTH else torch.get_num_threads())
    with torch_threads(threads):
        return _match(structure, activations_a, arrays_a, activations_b, arrays_b, options, refine_sweeps)


def _match(
    structure, activations_a, arrays_a, activations_b, arrays_b, options, refine_sweeps: int
) -> GroupMatchResult:
    dense = options.solver == "dense"
    t0 = time.perf_counter()
    aff = GroupAffinity(structure, activations_a, arrays_a, activations_b, arrays_b, options, build_operator=not dense)
    diag = aff.diagnostics()
    kmat = aff.dense() if dense else None
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    if aff.is_diagonal:
        # K is diagonal: Σ_g Σ_i D_g[i, perm_g(i)] is one linear assignment per group, solved exactly
        d = aff.diagonal()
        layers = {g: x / max(float(np.abs(x).max()), 1e-300) for g, x in d.items()}
        it, converged, residual, norm, cost, shift = (
            0,
            True,
            0.0,
            float(max(np.max(x) for x in d.values())),
            _Cost(),
            0.0,
        )
    elif dense:
        vec, it, converged, residual, norm, shift = power_iteration_dense(kmat, aff.options)
        layers = aff.to_groups(vec)
        cost = _Cost()
        cost.flops = 2.0 * aff.pairs * aff.pairs
    else:
        product_threads = torch.get_num_threads()
        base = product_threads if options.threads is not None else 1
        with torch_threads(base):
            if aff.options.eigensolver == "ritz":
                layers, it, converged, residual, norm, cost, shift, extra = _ritz(aff, product_threads)
                diag.update(extra)
            else:
                layers, it, converged, residual, norm, cost, shift = _power_iteration(aff, product_threads)
    t_iter = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = _discretise([layers[g] for g in aff.names])
    perms = dict(zip(aff.names, found, strict=True))
    t_assign = time.perf_counter() - t0
    spectral_objective = aff.objective(perms)
    t0 = time.perf_counter()
    refinement = {"sweeps": 0, "elements_moved": 0}
    refine_cost = _Cost(torch.get_num_threads())
    if refine_sweeps > 0 and not aff.is_diagonal:
        if dense:
            diagonal = aff.diagonal()

            def score(perms, g):
                x = {h: _permutation_matrix(p, torch.float64).numpy() for h, p in perms.items()}
                kx = aff.to_groups(kmat @ aff.from_groups(x))[g]
                return diagonal[g] + 2.0 * (kx - diagonal[g] * x[g])
        else:

            def score(perms, g):
                return (aff._diag[g] + 2.0 * aff.coupling(perms, g, refine_cost)).numpy()

        perms, refinement = _refine(aff, perms, refine_sweeps, score)
    refinement["n3_products"] = refine_cost.flops / (2.0 * max(aff.sizes.values()) ** 3)
    t_refine = time.perf_counter() - t0
    kmat = None  # the dense K is not needed any more
    objective = aff.objective(perms) if refinement["elements_moved"] else spectral_objective
    widest = max(aff.sizes.values())
    # power iteration's cost is that of its last step; the Rayleigh–Ritz iteration's is summed
    ritz = not dense and not aff.is_diagonal and aff.options.eigensolver == "ritz"
    per_step = 1.0 / max(1, it) if ritz else 1.0
    diag.update(
        solver=options.solver,
        eigensolver="power" if dense else aff.options.eigensolver,
        diagonal=aff.is_diagonal,
        iterations=int(it),
        converged=bool(converged),
        residual=float(residual),
        eigenvalue=float(norm),
        shift=float(shift),
        dense_products_per_iteration=cost.products * per_step,
        flops_per_iteration=cost.flops * per_step,
        n3_products_per_iteration=cost.flops * per_step / (2.0 * widest**3),
        n3_products_total=cost.flops * per_step * max(1, it) / (2.0 * widest**3),
        spectral_objective=float(spectral_objective),
        spectral_perms={g: p.tolist() for g, p in zip(aff.names, found, strict=True)},
        refinement=refinement,
        seconds={"setup": t_build, "iterations": t_iter, "assignment": t_assign, "refinement": t_refine},
    )
    return MatchResult(
        permutations=tuple(perms[g] for g in aff.names),
        objective=float(objective),
        solver=options.solver,
        iterations=int(it),
        converged=bool(converged),
        relaxed=tuple(np.asarray(layers[g]) for g in aff.names),
        diagnostics=diag,
        groups=tuple(aff.names),
    )
