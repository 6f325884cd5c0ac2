"""Spectral graph matching of two networks, jointly over all hidden layers.

Finds, for every hidden layer, the permutation of B's nodes that best lines them up with A's, by
the leading eigenvector of a quadratic-assignment affinity K that is never materialised for real
layers. The theory — the affinity and its normalisation, the Kronecker (Koopmans–Beckmann) form
that lets K act through layer-sized products, the Chebyshev and few-valued kernel expansions,
Sinkhorn balancing, the bandwidth rules and the dense pygmtools reference — is in
docs/matching.md.

One concept per module, each importing only those before it:

- ``options``: :class:`MatchOptions` and :class:`MatchResult` (the one shape of every solver);
- ``expansion``: separable expansions of the scalar Gaussian kernel, with error bounds;
- ``normalisation``: the public bandwidth rules and Sinkhorn balancing;
- ``operators``: the factor algebra that applies a block of K to V without forming K;
- ``checks``: what two graphs must satisfy to be matched;
- ``blocks``: one layer pair's weight affinity (expansion, separable terms, mean kernel);
- ``dense``: the dense reference (K in pygmtools' layout, ``pygmtools.sm``);
- ``affinity``: the merged, normalised K shared by both solvers, and the objective;
- ``solvers``: :func:`match_graphs` (power iteration, discretisation).

What is public: a remote graph enters only through its released (noisy) features, and every
bandwidth rule reads only the arrays it is given.
"""

from peer.ldp.matching.affinity import Affinity
from peer.ldp.matching.expansion import (
    FEW_VALUED_MAX,
    MAX_CHEBYSHEV_DEGREE,
    ChebyshevExpansion,
    OperatorExpansion,
    chebyshev_interpolation_bound,
    few_values,
    gaussian_expansion,
    gaussian_kernel,
    operator_expansion,
)
from peer.ldp.matching.normalisation import sinkhorn_factors
from peer.ldp.matching.operators import SPARSE_MAX_DENSITY
from peer.ldp.matching.options import (
    AUTO_FAST_MIN_WIDTH,
    AUTO_FLOAT64_MAX_WIDTH,
    AUTO_SINGLE_THREAD_MAX_WIDTH,
    BANDWIDTH_RULES,
    DTYPES,
    EIGENSOLVERS,
    EXPANSION_RULES,
    SOLVERS,
    MatchOptions,
    MatchResult,
)
from peer.ldp.matching.solvers import match_graphs

__all__ = [
    "AUTO_FAST_MIN_WIDTH",
    "AUTO_FLOAT64_MAX_WIDTH",
    "AUTO_SINGLE_THREAD_MAX_WIDTH",
    "BANDWIDTH_RULES",
    "DTYPES",
    "EIGENSOLVERS",
    "EXPANSION_RULES",
    "FEW_VALUED_MAX",
    "MAX_CHEBYSHEV_DEGREE",
    "SOLVERS",
    "SPARSE_MAX_DENSITY",
    "Affinity",
    "ChebyshevExpansion",
    "MatchOptions",
    "MatchResult",
    "OperatorExpansion",
    "chebyshev_interpolation_bound",
    "few_values",
    "gaussian_expansion",
    "gaussian_kernel",
    "match_graphs",
    "operator_expansion",
    "sinkhorn_factors",
]
