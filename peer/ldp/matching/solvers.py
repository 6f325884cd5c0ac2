"""Spectral matching (Leordeanu & Hebert 2005) of two graphs over all hidden layers jointly.

The leading eigenvector of K by shifted power iteration — on the factorised operator, or with
pygmtools' ``sm`` on the dense K — then one linear assignment per hidden layer
(docs/matching.md, "Spectral matching"). Both solvers return the same :class:`MatchResult`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from peer.base.extras import LazyModule
from peer.ldp.matching.affinity import Affinity
from peer.ldp.matching.checks import _check_graphs
from peer.ldp.matching.dense import power_iteration_dense
from peer.ldp.matching.operators import _Cost
from peer.ldp.matching.options import AUTO_SINGLE_THREAD_MAX_WIDTH, MatchOptions, MatchResult
from peer.nn.architectures import torch_threads
from peer.nn.graph import NetworkGraph

_optimize = LazyModule("scipy.optimize")  # imported at the first assignment (~0.8 s of CPU to import)


def _discretise(layers: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The permutation maximising Σ_i X[i, perm(i)] per layer (Hungarian / LSA).

    Row and column means are subtracted first: every permutation takes one entry per row and
    per column, so this shifts all objectives by the same constant and leaves the set of optimal
    permutations unchanged; but the leading eigenvector is a large near-constant plus a small
    informative part, on which scipy's solver is much slower (docs/matching.md, "Implementation
    notes").
    """
    perms = []
    for x in layers:
        y = np.array(x, dtype=np.float64)
        y -= y.mean(axis=1, keepdims=True)
        y -= y.mean(axis=0, keepdims=True)
        rows, cols = _optimize.linear_sum_assignment(y, maximize=True)
        perm = np.empty(x.shape[0], dtype=np.int64)
        perm[rows] = cols
        perms.append(perm)
    return tuple(perms)


def _power_iteration_factorised(aff: Affinity, product_threads: int):
    opts = aff.options
    v = [torch.full((n, n), 1.0 / aff.pairs, dtype=aff.dtype) for n in aff.sizes]
    shift = opts.shift
    converged, it, residual, norm, cost = False, 0, float("inf"), 0.0, _Cost()
    # the loop variable is the result: the number of iterations run (B007 sees it unused in the body)
    for it in range(1, opts.max_iter + 1):  # noqa: B007
        cost = _Cost(product_threads)
        w = aff.apply(v, cost)
        if shift is None:
            shift = 0.5 * _norm(w) / _norm(v)
        for x, y in zip(w, v, strict=True):
            x.add_(y, alpha=shift)
        norm = _norm(w)
        if not norm > 0:
            break
        for x in w:
            x.div_(norm)
        residual = math.sqrt(sum(float(torch.dist(x, y)) ** 2 for x, y in zip(w, v, strict=True)))
        v = w
        if residual < opts.tol:
            converged = True
            break
    return [x.numpy() for x in v], it, converged, residual, norm - (shift or 0.0), cost, shift or 0.0


def _ritz_factorised(aff: Affinity, product_threads: int):
    """The leading eigenvector of K by power iteration with a layer-wise Rayleigh–Ritz step
    (docs/matching.md, "Layer-wise Rayleigh–Ritz").

    The search space holds, for every hidden layer ℓ separately, the layer's block of the current
    vector v, of its residual r = K v − θ v and of the previous residual: up to 3L vectors
    e_ℓ ⊗ x_ℓ, whose images K(e_ℓ ⊗ x_ℓ) are kept (their edge parts, in layers ℓ−1 and ℓ+1; the
    diagonal part D_ℓ ∘ x_ℓ is formed from x). The new v is the Perron vector of K restricted to
    that space; its image is the same combination of the kept images, so every step costs one
    product of K (with the residual), and the first none (the start is constant per layer).
    Stops when ‖K v − θ v‖ < RITZ_TOL_FACTOR·tol·θ, θ = vᵀKv (‖v‖ = 1), or, not converged, after
    STALL steps without a smaller residual.

    Each product with a residual applies only as many terms of an operator-adapted expansion as
    its size needs (docs/matching.md, "Operator-adapted expansion"); every kept image carries a
    bound on its distance from the exact-kernel image, combined with the Ritz coefficients, so
    that ``bound`` bounds ‖(K̃ − K) v‖ for the returned v.
    Returns the power iteration's tuple, with the cost summed over all steps, and a dict of
    these diagnostics.
    """
    opts = aff.options
    layers = len(aff.sizes)
    hidden = [b for b in aff.hidden_blocks if b.terms]
    tiny = 1e-12 if aff.dtype == torch.float64 else 1e-6  # relative Gram eigenvalue kept
    cost = _Cost(product_threads)

    def adjacent(ell):
        return [k for k in (ell - 1, ell) if 0 <= k < len(aff.hidden_blocks) and aff.hidden_blocks[k].terms]

    start = [torch.ones((n, n), dtype=aff.dtype) for n in aff.sizes]
    full = [aff.hidden_blocks[k].operator_error() if aff.hidden_blocks[k].terms else 0.0 for k in range(layers - 1)]
    # each basis entry: (layer, x, its edge images, error bound, deterministic error bound)
    basis = [
        (ell, x, im, sum(full[k] for k in adjacent(ell)) * float(n), sum(full[k] for k in adjacent(ell)) * float(n))
        for ell, (x, im, n) in enumerate(
            zip(start, aff.apply_by_source(start, cost, constant=True, unary=False), aff.sizes, strict=True)
        )
    ]
    previous: list = []
    ranks_used: list[list[int | None]] = []
    residuals: list[float] = []
    converged, it, residual, theta, bound, bound_det = False, 0, float("inf"), 0.0, 0.0, 0.0
    best, best_it = float("inf"), 0
    stop_at = opts.tol * RITZ_TOL_FACTOR
    v: list[torch.Tensor] = start
    for it in range(1, opts.max_iter + 1):
        theta, coef = _ritz_step(basis, aff.unary, tiny)
        # the new v and its images, formed in place over the current ones (basis[ℓ] for layer ℓ),
        # which nothing else holds: the peak is then one set of images fewer
        v, images, errors, errors_det = [], [], [0.0] * layers, [0.0] * layers
        for ell in range(layers):
            _, x, im, err, err_det = basis[ell]
            c = float(coef[ell])
            x.mul_(c)
            for y in im.values():
                y.mul_(c)
            v.append(x)
            images.append(im)
            errors[ell] += abs(c) * err
            errors_det[ell] += abs(c) * err_det
        for c, (ell, x, im, err, err_det) in zip(coef[layers:], basis[layers:], strict=True):
            if c == 0.0:
                continue
            errors[ell] += abs(c) * err
            errors_det[ell] += abs(c) * err_det
            v[ell].add_(x, alpha=c)
            for target, y in im.items():
                if target in images[ell]:
                    images[ell][target].add_(y, alpha=c)
                else:
                    images[ell][target] = y * c
        basis = None  # what is left of the old basis is in `previous`
        # K v: the diagonal part D∘v (not kept in the images) plus the edge images
        kv = [d * x for d, x in zip(aff.unary, v, strict=True)]
        for im in images:
            for target, y in im.items():
                kv[target].add_(y)
        r = [k - theta * x for k, x in zip(kv, v, strict=True)]
        del kv
        bound, bound_det = sum(errors), sum(errors_det)
        rnorm = _norm(r)
        residual = rnorm / theta if theta > 0 else float("inf")
        residuals.append(residual)
        if residual < stop_at or not theta > 0:
            converged = theta > 0
            break
        # The images of v are running combinations, not recomputed: below the arithmetic's
        # floor (a tol under float32's reach) their rounding would accumulate. Stop when the
        # residual has not improved for STALL steps.
        if residual < best:
            best, best_it = residual, it
        elif it - best_it >= STALL:
            break
        if it == opts.max_iter:
            break
        # the residual enters the next v with a coefficient of about 1/(θ − λ₂) ≤ 2/θ (for a gap
        # of at least half of θ), so a block error ε adds about 2ε‖r‖/θ to ‖(K̃ − K)v‖: keep that
        # ≤ (the stopping level)·θ/blocks per product
        budget = stop_at * theta * theta / (RANK_BUDGET_DIVISOR * max(1, len(hidden)) * rnorm)
        ranks: list[int | None] = [None] * len(aff.hidden_blocks)

        def rank_of(k, budget=budget, ranks=ranks):
            # chosen when block k is reached: bounding its terms then holds no other block's
            b = aff.hidden_blocks[k]
            ranks[k] = _rank_for(b, budget, lambda upto: aff.bound_terms(k, upto)) if b.terms else None
            return ranks[k]

        step = aff.apply_by_source(r, cost, ranks=rank_of, unary=False)
        ranks_used.append(ranks)
        rank_error = [
            aff.hidden_blocks[k].operator_error(ranks[k]) if aff.hidden_blocks[k].terms else 0.0
            for k in range(layers - 1)
        ]
        rank_error_det = [
            aff.hidden_blocks[k].operator_error(ranks[k], deterministic=True) if aff.hidden_blocks[k].terms else 0.0
            for k in range(layers - 1)
        ]
        current = [(ell, v[ell], images[ell], errors[ell], errors_det[ell]) for ell in range(layers)]
        r_norms = [math.sqrt(float(torch.sum(x * x, dtype=torch.float64))) for x in r]
        fresh = [
            (
                ell,
                r[ell],
                step[ell],
                sum(rank_error[k] for k in adjacent(ell)) * r_norms[ell],
                sum(rank_error_det[k] for k in adjacent(ell)) * r_norms[ell],
            )
            for ell in range(layers)
        ]
        basis = current + fresh + previous
        previous = fresh
    failure = float(sum(b.bound_failure for b in aff.hidden_blocks))
    extra = {
        "ranks": ranks_used,
        "residuals": residuals,
        "operator_error_bound": bound / theta if theta > 0 else float("inf"),
        "residual_bound": residual + (bound / theta if theta > 0 else float("inf")),
        "bound_failure_probability": failure,
        "operator_error_bound_deterministic": bound_det / theta if theta > 0 else float("inf"),
        "residual_bound_deterministic": residual + (bound_det / theta if theta > 0 else float("inf")),
    }
    return [x.numpy() for x in v], it, converged, residual, theta, cost, 0.0, extra


# A product's blocks each take the fewest terms whose operator error is at most
# (tol/10)·θ²/(RANK_BUDGET_DIVISOR·H·‖r‖), H the blocks (docs/matching.md, "Fewer terms for small
# residuals"): each product then adds at most about (tol/10)·θ to ‖(K̃ − K) v‖ (measured on the
# benchmark's exact graphs: operator_error_bound 2–3·10⁻⁶ at tol 10⁻⁵, within tol/2 with the
# residual).
RANK_BUDGET_DIVISOR = 2.0
# Before a product, a block's centred terms are bounded up to the rank at which the Frobenius
# tail alone is 1/BOUND_TAIL_SHARE of the budget.
BOUND_TAIL_SHARE = 4.0
# Rayleigh–Ritz steps without a smaller residual before the iteration stops (not converged).
STALL = 3
# The Rayleigh–Ritz iteration stops at ‖K v − θ v‖ < RITZ_TOL_FACTOR · tol · θ. Power iteration's
# error at its stop (a step < tol) lies mostly in the slow coarse modes, which the permutation
# does not see; the Rayleigh–Ritz step removes those, so its residual is all in the modes that
# decide the matching, and the same number would mean less accuracy there (measured: width 4096,
# mixed features, 1e-5 recovered 84.0% of the nodes, 1e-6 84.7% as the reference did).
RITZ_TOL_FACTOR = 0.1


def _rank_for(block, budget: float, bound=None) -> int | None:
    """The fewest stacked terms of a hidden block whose operator error bound is ≤ budget (all of
    them for blocks without an operator-adapted expansion). ``bound(upto)``: called first with
    the fewest terms the deterministic (Frobenius) bound allows, to bound the spectral norms of
    the centred terms below it, which can only lower the rank (docs/matching.md,
    "Operator-adapted expansion")."""
    if block.operator is None:
        return None

    def frobenius_rank(b):
        return next(
            (k for k in range(block.operator.terms + 1) if block.operator_error(k, deterministic=True) <= b),
            block.operator.terms,
        )

    frobenius = frobenius_rank(budget)
    if bound is not None and frobenius > 0:
        # bound the terms up to where the Frobenius tail alone takes a quarter of the budget, so
        # that the spectral bounds have the rest to fit in
        bound(frobenius_rank(budget / BOUND_TAIL_SHARE))
    for k in range(frobenius + 1):
        if block.operator_error(k) <= budget:
            return k
    return frobenius


def _ritz_step(basis, unary, tiny: float) -> tuple[float, np.ndarray]:
    """The largest Ritz pair of K on span(basis) (entries (layer ℓ, x_ℓ, {target ≠ ℓ: the edge
    part of K(e_ℓ ⊗ x_ℓ)}, error bound of that image); ``unary``: the diagonal D_ℓ, whose part
    of every image is formed here): θ and the coefficients of its unit-norm Ritz vector, signed
    to have a positive sum. Inner products in float64; near-dependent directions (relative Gram
    eigenvalue ≤ ``tiny``) dropped. Within a layer K is its diagonal D_ℓ (edges join different
    layers), so xᵢᵀ K xⱼ = Σ xᵢ D_ℓ xⱼ there, exactly.

    K is symmetric, so x_iᵀ K x_j can be read from either image: it is read from the one with the
    smaller error bound per unit norm. This matters: the coupling of v with its residual r is
    vᵀKr = ‖r‖², second order in ‖r‖, and must come from v's accurate image, not from r's
    (which may hold fewer expansion terms)."""
    m = len(basis)
    gram = np.zeros((m, m))
    kmat = np.zeros((m, m))
    cross = np.full((m, m), np.nan)  # cross[i, j] = x_iᵀ (the part of K x_j in x_i's layer)
    sums = np.zeros(m)  # Σ x_i
    for ell in sorted({entry[0] for entry in basis}):
        rows = [i for i, entry in enumerate(basis) if entry[0] == ell]
        cols = [j for j, entry in enumerate(basis) if ell in entry[2]]
        g, dk, p, total = _layer_products([basis[i][1] for i in rows], unary[ell], [basis[j][2][ell] for j in cols])
        sums[rows] = total
        gram[np.ix_(rows, rows)] = g
        kmat[np.ix_(rows, rows)] = dk
        if cols:
            cross[np.ix_(rows, cols)] = p
    norms = np.sqrt(np.diag(gram))
    accuracy = [entry[3] / nrm if nrm > 0 else 0.0 for entry, nrm in zip(basis, norms, strict=True)]
    for i in range(m):
        for j in range(i + 1, m):
            if basis[i][0] == basis[j][0]:
                continue
            # x_iᵀ (K x_j) from x_j's image, or x_jᵀ (K x_i) from x_i's: the more accurate one
            value = cross[i, j] if accuracy[j] <= accuracy[i] else cross[j, i]
            kmat[i, j] = kmat[j, i] = 0.0 if np.isnan(value) else value
    d = np.sqrt(np.diag(gram))
    keep_basis = d > 0
    d_k = d[keep_basis]
    g = gram[np.ix_(keep_basis, keep_basis)] / np.outer(d_k, d_k)
    k = kmat[np.ix_(keep_basis, keep_basis)] / np.outer(d_k, d_k)
    mu, q = np.linalg.eigh(g)
    keep = mu > tiny * mu.max()
    q = q[:, keep] / np.sqrt(mu[keep])
    lam, u = np.linalg.eigh(q.T @ k @ q)
    y = q @ u[:, -1]
    c = np.zeros(m)
    c[keep_basis] = y / d_k
    return float(lam[-1]), (-c if float(c @ sums) < 0 else c)


# Entries per chunk of the Ritz step's float64 inner products.
INNER_CHUNK = 1 << 18


def _layer_products(xs: list[torch.Tensor], d: torch.Tensor, ys: list[torch.Tensor]):
    """(X Xᵀ, X diag(d) Xᵀ, X Yᵀ, X 1) for the rows X = xs and Y = ys of one layer (flattened),
    in float64: chunk by chunk, each chunk converted once and multiplied as a small GEMM, rather
    than one float64 reduction over a full-size temporary per pair."""
    a, b = len(xs), len(ys)
    g, dk, p, total = np.zeros((a, a)), np.zeros((a, a)), np.zeros((a, b)), np.zeros(a)
    flat_x = [x.reshape(-1) for x in xs]
    flat_y = [y.reshape(-1) for y in ys]
    flat_d = d.reshape(-1)
    for start in range(0, flat_d.shape[0], INNER_CHUNK):
        c = slice(start, start + INNER_CHUNK)
        xc = torch.stack([x[c] for x in flat_x]).to(torch.float64)
        g += (xc @ xc.T).numpy()
        total += xc.sum(dim=1).numpy()
        dk += ((xc * flat_d[c].to(torch.float64)) @ xc.T).numpy()
        if b:
            p += (xc @ torch.stack([y[c] for y in flat_y]).to(torch.float64).T).numpy()
    return (g + g.T) / 2.0, (dk + dk.T) / 2.0, p, total


def _norm(layers: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(x * x, dtype=torch.float64)) for x in layers))


def _power_iteration_dense(aff: Affinity, k: np.ndarray):
    """The dense reference's power iteration (:func:`power_iteration_dense`), in the factorised
    one's return shape; its cost is one dense matrix-vector product per step."""
    v, it, converged, residual, norm, shift = power_iteration_dense(k, aff.options)
    cost = _Cost()
    cost.flops = 2.0 * aff.pairs * aff.pairs  # one dense matrix-vector product
    return aff.to_layers(v), it, converged, residual, norm, cost, shift


def match_graphs(graph_a: NetworkGraph, graph_b: NetworkGraph, options: MatchOptions | None = None) -> MatchResult:
    """Align graph_b's hidden nodes to graph_a's by spectral matching over all hidden layers.

    Both graphs must come from the same architecture and the same probe set. For a remote graph
    pass its released (noisy) features: the matcher reads nothing else of it, and its bandwidth
    rule uses only the arrays it is given. Returns one permutation per hidden layer
    (``perm[i] = j``: A's node i ↔ B's node j) with the objective, the relaxed solution and
    diagnostics; the same shape of result for ``options.solver`` "factorised" and "dense".
    """
    options = MatchOptions.of(options)
    _check_graphs(graph_a, graph_b)
    auto_eigensolver = options.eigensolver == "auto"
    options = options.resolved(graph_a.sizes)
    if options.threads is not None:
        threads = options.threads
    else:
        threads = 1 if max(graph_a.sizes) <= AUTO_SINGLE_THREAD_MAX_WIDTH else torch.get_num_threads()
    with torch_threads(threads):
        return _match(graph_a, graph_b, options, auto_eigensolver)


def _few_valued_only(aff: Affinity) -> bool:
    """Every hidden–hidden block has few-valued weights on both sides (two released graphs)."""
    return bool(aff.hidden_blocks) and all(b.expansion == "table" for b in aff.hidden_blocks)


def _match(
    graph_a: NetworkGraph, graph_b: NetworkGraph, options: MatchOptions, auto_eigensolver: bool = False
) -> MatchResult:
    dense = options.solver == "dense"
    aff = Affinity(graph_a, graph_b, options, build_operator=not dense)
    eigensolver = options.eigensolver
    if auto_eigensolver and _few_valued_only(aff):
        # both sides released (few-valued): a product of K costs gathers and no dense product,
        # so the Rayleigh–Ritz step's fixed work (its Gram matrices, the images it keeps) costs
        # more than the power steps it saves (docs/matching.md, "Spectral matching")
        eigensolver = "power"
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
            if eigensolver == "ritz":
                layers, it, converged, residual, norm, cost, shift, extra = _ritz_factorised(aff, product_threads)
                diag.update(extra)
            else:
                layers, it, converged, residual, norm, cost, shift = _power_iteration_factorised(aff, product_threads)
        diag["eigensolver"] = eigensolver
        diag["threads"] = {"setup": product_threads, "iteration": base, "products": product_threads}
    t_iter = time.perf_counter() - t0
    del kmat

    t0 = time.perf_counter()
    perms = _discretise(layers)
    t_assign = time.perf_counter() - t0
    objective = aff.objective(perms)

    # the power iteration's cost is per step; the Rayleigh–Ritz iteration's is summed over its steps
    per_step = 1.0 if dense or aff.is_diagonal or eigensolver == "power" else 1.0 / max(1, it)
    diag["dense_products_per_iteration"] = cost.products * per_step
    diag["flops_per_iteration"] = cost.flops * per_step
    diag["n3_products_per_iteration"] = cost.flops * per_step / (2.0 * max(aff.sizes) ** 3)
    diag["n3_products_total"] = diag["n3_products_per_iteration"] * it
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
        groups=tuple(h.name for h in graph_a.hidden),
    )
