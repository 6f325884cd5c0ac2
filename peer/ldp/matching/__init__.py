"""Spectral graph matching of two networks (being split into one concept per file)."""

from peer.ldp.matching.affinity import (  # noqa: F401
    AUTO_FLOAT64_MAX_WIDTH, AUTO_SINGLE_THREAD_MAX_WIDTH, BANDWIDTH_RULES, DTYPES, FEW_VALUED_MAX,
    MAX_CHEBYSHEV_DEGREE, SOLVERS, SPARSE_MAX_DENSITY, Affinity, ChebyshevExpansion, MatchOptions,
    MatchResult, chebyshev_interpolation_bound, few_values, gaussian_expansion, gaussian_kernel,
    match_graphs, sinkhorn_factors)
