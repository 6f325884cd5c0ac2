"""The merged, normalised affinity K of two networks' graphs, shared by both solvers.

xᵀKx over the assignments x = (vec X_0, …, vec X_{L−1}) of all hidden layers: activation
affinities and fixed-layer edge terms on the diagonal, hidden–hidden edge affinities off it, each
normalised (docs/matching.md, "The affinity" and "Normalisation"). :class:`Affinity` computes
bandwidths, expansions and normalisers once, so that its factorised operator (:meth:`Affinity.apply`,
never forming K) and its dense matrix (:meth:`Affinity.dense`) describe the same K, and the
objective of a discrete solution is computed the same way whichever solver ran.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.ldp.matching.blocks import _Block, _block_terms, _exact_fixed_unary, _make_block, _mean_kernel
from peer.ldp.matching.checks import _check_graphs
from peer.ldp.matching.dense import dense_matrix
from peer.ldp.matching.expansion import gaussian_kernel
from peer.ldp.matching.normalisation import _mean_sq_bandwidth, _spread_bandwidth, _squared_distances, sinkhorn_factors
from peer.ldp.matching.operators import _apply_block, _apply_block_constant, _Cost, _rescale, _Stacked, _transposed
from peer.ldp.matching.options import AUTO_FLOAT64_MAX_WIDTH, MatchOptions
from peer.nn.graph import NetworkGraph

# Lazily built expansion terms stay built between products while all blocks' together take at
# most this many bytes; above it a block's terms are freed after each product and rebuilt by the
# next: the peak then holds one block's terms (at width 4096 in float32, 12 terms per side of one
# block are 1.5 GiB), at the price of building them again (docs/matching.md, "Operator-adapted
# expansion").
KEEP_BUILT_TERMS_BYTES = 512 << 20
# While their spectral norms are bounded, a block's terms stay built up to this many bytes (at
# width 4096 in float32: 4 terms per side, what the first product there applies), so that the
# product that follows need not build them again; the others are built, bounded and freed.
BOUND_KEEP_BYTES = 512 << 20


class Affinity:
    """The merged, normalised affinity K of two graphs (docs/matching.md, "The affinity").

    Shared by both solvers: bandwidths, expansions, normalisers and the objective are computed
    once, here, so the factorised operator (:meth:`matvec`) and the dense matrix
    (:meth:`dense`) describe the same K — exactly for few-valued weights, and up to the
    reported expansion error bound in each kernel value otherwise.
    """

    def __init__(
        self,
        graph_a: NetworkGraph,
        graph_b: NetworkGraph,
        options: MatchOptions | None = None,
        *,
        build_operator: bool = True,
    ):
        t0 = time.perf_counter()
        options = MatchOptions.of(options)
        _check_graphs(graph_a, graph_b)
        self.options = options = options.resolved(graph_a.sizes)
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
        self._activation: list[np.ndarray] | None = []
        self._activation_factors: list[tuple[np.ndarray, np.ndarray]] = []
        for ell, (ha, hb) in enumerate(zip(graph_a.hidden, graph_b.hidden, strict=True)):
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
                raise InvalidArgument(
                    "options.activation_sigma",
                    f"{sigma:g} makes the activation affinities of hidden layer {ell} underflow to 0 or overflow",
                )
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
            self.blocks.append(
                _make_block(name, kind, np.asarray(wa, dtype=np.float64), np.asarray(wb, dtype=np.float64), options)
            )
        self.hidden_blocks = [b for b in self.blocks if b.kind == "hidden"]

        # Normalisers (shared by both solvers): ν = (neighbours) · κ̄, κ̄ in float64. The factorised
        # operator's terms are built first, unscaled, so that κ̄ reuses their function means.
        for b in self.blocks:
            e = b.weights_a.shape[2]
            build = build_operator and options.edge_weight > 0
            terms = _block_terms(b, self.dtype) if build else []
            b.mean_kernel = _mean_kernel(b)
            if not b.mean_kernel > 0:
                raise InvalidArgument(
                    "options.weight_sigma",
                    f"{b.sigma:g} is so small that every weight affinity of block {b.name} underflows to 0",
                )
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
            self._activation = None  # in the unary now; dense() recomputes it (n² float64 per layer)
            for b in self.blocks:
                if b.kind != "hidden":
                    b.terms = []  # only the unary they produced is needed from now on
        self.setup_seconds = time.perf_counter() - t0

    @property
    def is_diagonal(self) -> bool:
        """No hidden–hidden couplings: one hidden layer, or edge_weight = 0."""
        return len(self.sizes) == 1 or self.options.edge_weight == 0

    # -- construction helpers ----------------------------------------------------------------

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
            unary[0] += torch.as_tensor(
                self._balanced_fixed("input", u_in.numpy().astype(np.float64)), dtype=self.dtype
            )
            eye_out = torch.eye(out.weights_a.shape[0], dtype=self.dtype)
            u_out = _apply_block([_transposed(t) for t in out.terms], eye_out, self.sizes[-1], cost)
            unary[-1] += torch.as_tensor(
                self._balanced_fixed("output", u_out.numpy().astype(np.float64)), dtype=self.dtype
            )
        return unary

    def _balanced_activation(self, ell: int) -> np.ndarray:
        """The balanced activation affinity of hidden layer ℓ in float64: kept from the
        construction, or recomputed the same way from its factors (the factorised operator keeps
        it only inside its unary)."""
        if self._activation is not None:
            return self._activation[ell]
        r, c, offsets = self._activation_factors[ell]
        sq = _squared_distances(self.graph_a.hidden[ell].activations, self.graph_b.hidden[ell].activations)
        na = np.exp(-(sq - offsets[0][:, None] - offsets[1][None, :] + offsets[2]) / self.activation_sigma[ell])
        return r[:, None] * na * c[None, :]

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
        out = [d * x for d, x in zip(self._unary, v, strict=True)]
        for ell, b in enumerate(self.hidden_blocks, start=1):
            if not b.terms:
                continue
            _apply_block(b.terms, v[ell - 1], self.sizes[ell], cost, out=out[ell])
            _apply_block(b.terms_t, v[ell], self.sizes[ell - 1], cost, out=out[ell - 1])
        return out

    def apply_by_source(
        self,
        v: Sequence[torch.Tensor],
        cost: _Cost | None = None,
        *,
        constant: bool = False,
        ranks: Sequence[int | None] | None = None,
        unary: bool = True,
    ) -> list[dict[int, torch.Tensor]]:
        """K applied to each hidden layer's block of v alone: entry ℓ maps a target layer to its
        part of K(e_ℓ ⊗ v_ℓ) (layers ℓ−1, ℓ, ℓ+1), so that Σ_ℓ of them is K v. The same products
        as :meth:`apply`, kept apart by source layer for the layer-wise Rayleigh–Ritz step.
        ``constant``: every block of v is constant (c·J, c = its [0, 0] entry), applied with
        matrix-vector work only. ``ranks[k]``: the number of stacked terms of hidden block k
        (between layers k and k+1) to apply (all when None); :meth:`operator_error` bounds what
        the rest would add. ``ranks`` may be a function of k, called when block k is reached
        (after the blocks before it were applied and their terms freed), so that the work it
        does for block k (bounding its terms) never holds two blocks' terms at once. ``unary=False``: leave out the diagonal part D_ℓ ∘ v_ℓ (the caller
        forms it from v when it needs it, so it need not be stored)."""
        if self._unary is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        cost = _Cost() if cost is None else cost
        out = [{ell: self._unary[ell] * x} if unary else {} for ell, x in enumerate(v)]
        kept = 0  # bytes of lazily built terms left built after their block was applied
        # block by block, both directions, so that a block's terms can be freed before the next
        # block's are built (the peak then holds one block's terms)
        for k, b in enumerate(self.hidden_blocks):
            for source, target, terms in ((k, k + 1, b.terms), (k + 1, k, b.terms_t)):
                if not terms:
                    continue
                x = v[source]
                if constant:
                    out[source][target] = _apply_block_constant(
                        terms,
                        float(x[0, 0]),
                        self.sizes[target],
                        x.dtype,
                        torch.zeros((self.sizes[target],) * 2, dtype=x.dtype),
                    )
                else:
                    rank = None if ranks is None else (ranks(k) if callable(ranks) else ranks[k])
                    for t in terms:
                        if isinstance(t, _Stacked):
                            t.trim(rank)  # free lazily built terms this product does not use
                    out[source][target] = _apply_block(terms, x, self.sizes[target], cost, rank=rank)
            for t in b.terms:
                if isinstance(t, _Stacked) and t.source is not None:
                    size = t.built_bytes()
                    if kept + size > KEEP_BUILT_TERMS_BYTES:
                        t.trim(0)  # rebuilt by the next product that needs them
                    else:
                        kept += size
        return out

    def bound_terms(self, k: int, upto: int) -> None:
        """Spectral-norm bounds for hidden block k's centred terms below ``upto``
        (:meth:`_Block.bound_terms`); terms built for them stay built while the block's take at
        most BOUND_KEEP_BYTES (the product that follows applies the first of them)."""
        block = self.hidden_blocks[k]
        src = block._centred_source()
        if src is not None and len(src.bounds) < upto:
            (fr, fc), _ = src.sums
            side_bytes = min(upto, src.terms) * fr.shape[0] * fc.shape[0] * fr.element_size()
            if side_bytes > BOUND_KEEP_BYTES // 2:
                # a large bounding pass: free the other blocks' built terms first (rebuilt if a
                # later product needs them), so that the peak holds this block's alone
                for other in self.hidden_blocks:
                    if other is not block:
                        for t in other.terms:
                            if isinstance(t, _Stacked) and t.source is not None:
                                t.trim(0)
        block.bound_terms(upto, BOUND_KEEP_BYTES)

    @property
    def unary(self) -> list[torch.Tensor]:
        """D_ℓ per hidden layer as the factorised operator holds it (n_ℓ×n_ℓ, [i, j] = pair (i, j))."""
        if self._unary is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        return self._unary

    def diagonal(self) -> list[np.ndarray]:
        """D_ℓ (n_ℓ×n_ℓ, [i, j] = pair (A node i, B node j)) as the factorised operator uses it."""
        if self._unary is None:
            raise InvalidArgument("affinity", "was built without its factorised operator")
        return [x.numpy().astype(np.float64) for x in self._unary]

    def to_layers(self, vec: np.ndarray) -> list[np.ndarray]:
        """Split a vector in the stacked pygmtools layout into per-layer [i, j] matrices."""
        vec = np.asarray(vec)
        return [vec[o : o + n * n].reshape(n, n).T for o, n in zip(self.offsets[:-1], self.sizes, strict=True)]

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
        """K as a dense float64 (M×M) matrix, M = Σ n_ℓ², from exact kernel values, in pygmtools'
        layout (:func:`peer.ldp.matching.dense.dense_matrix`); small graphs only."""
        if self.dense_bytes() > self.options.dense_memory_cap:
            raise InvalidArgument(
                "graph_a.sizes",
                f"hidden layers {list(self.sizes)} give a dense affinity of {self.pairs}² entries = "
                f"{self.dense_bytes() / 2**30:.2f} GiB, over dense_memory_cap = {self.options.dense_memory_cap / 2**30:.2f} GiB; "
                "use solver='factorised'",
            )
        opts = self.options
        diagonals = []
        for ell, _n in enumerate(self.sizes):
            d = self._balanced_activation(ell) * opts.activation_weight
            if opts.edge_weight > 0:
                if ell == 0:
                    d = d + self._balanced_fixed("input", _exact_fixed_unary(self.blocks[0], incoming=True))
                if ell == len(self.sizes) - 1:
                    d = d + self._balanced_fixed("output", _exact_fixed_unary(self.blocks[-1], incoming=False))
            diagonals.append(d)
        return dense_matrix(self.sizes, self.offsets, diagonals, self.hidden_blocks if opts.edge_weight > 0 else [])

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
