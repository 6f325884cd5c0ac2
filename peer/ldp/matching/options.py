"""What a matcher takes and returns, whichever solver runs: :class:`MatchOptions`, :class:`MatchResult`.

Every option is public (it travels in reports); docs/matching.md gives the math behind each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument

BANDWIDTH_RULES = ("spread", "mean")
SOLVERS = ("factorised", "dense")
EIGENSOLVERS = ("auto", "ritz", "power")
EXPANSION_RULES = ("auto", "operator", "uniform")
# "auto" (both options): the Rayleigh–Ritz iteration with the operator-adapted expansion while some
# hidden layer has more than this many nodes, the reference path (power iteration, uniform
# expansion) up to it, where products are cheap and the fixed costs of the faster path dominate
# (docs/matching.md, "Spectral matching").
AUTO_FAST_MIN_WIDTH = 128
DTYPES = ("auto", "float32", "float64")
# dtype="auto" computes in float64 while every hidden layer has at most this many nodes, float32
# above, where it halves the memory and recovers the same matches (docs/matching.md, "Precision").
AUTO_FLOAT64_MAX_WIDTH = 512
# threads=None runs single-threaded while every hidden layer has at most this many nodes.
AUTO_SINGLE_THREAD_MAX_WIDTH = 512


@dataclass(frozen=True)
class MatchOptions:
    """How to match (docs/matching.md explains every term).

    ``solver``: ``"factorised"`` (default; never forms K) or ``"dense"`` (pygmtools' ``sm`` on
    the dense K; small graphs only).
    ``activation_weight`` / ``edge_weight``: w_act and w_edge, the weights of the normalised
    activation and weight affinities in the merged K (non-negative, not both zero).
    ``activation_sigma`` / ``weight_sigma``: Gaussian bandwidths σ (exp(−d²/σ), σ not squared);
    ``None`` = a public rule that reads only the arrays given (docs/matching.md, "Bandwidths").
    ``eigensolver``: how the factorised solver finds the leading eigenvector of K: ``"ritz"``
    (power iteration accelerated by a layer-wise Rayleigh–Ritz step, a few products of K),
    ``"power"`` (the reference: shifted power iteration from the uniform vector, pygmtools'
    rule; docs/matching.md, "Spectral matching") or ``"auto"`` (default: ``"ritz"`` when some
    hidden layer has more than ``AUTO_FAST_MIN_WIDTH`` (128) nodes and some hidden–hidden block
    has exact weights on a side, else ``"power"``). The dense solver is always power iteration.
    ``max_iter`` / ``tol``: the iteration stops after ``max_iter`` steps or when
    ‖v_k − v_{k−1}‖₂ < ``tol`` (``"power"``: pygmtools' rule and default tolerance) or
    ‖K v − θ v‖₂ < ``tol``·θ/10 (``"ritz"``, θ the Rayleigh quotient of the unit vector v; why
    a tenth: docs/matching.md, "Layer-wise Rayleigh–Ritz").
    ``expansion_rule``: how exact weights between two hidden layers are expanded:
    ``"operator"`` — the expansion optimal in the mean square over the block's weight
    pairs, with as many terms as keep the spectral norm of the change it makes to K below
    ``tol``·λ₁/8 per block, and fewer terms in the products with small residuals: the mean parts
    of every term are applied exactly and the centred terms left out are bounded by their
    spectral norms (Lanczos estimates that hold except with a reported probability; the
    Frobenius-only bound is reported too) (docs/matching.md, "Operator-adapted expansion"); ``"uniform"`` (the reference) — every kernel value within
    ``expansion_tol``; ``"auto"`` (default) — ``"operator"`` when some hidden layer has more
    than ``AUTO_FAST_MIN_WIDTH`` nodes, else ``"uniform"``. Blocks to the fixed input and output layers, and blocks whose edges carry
    several weights (convolutions), always use the uniform rule.
    ``expansion_tol``: the largest error allowed in any kernel value κ ∈ (0, 1] by the uniform
    expansion of exact weights (few-valued weights are expanded exactly).
    ``few_valued``: detect ≤ 3-valued weight arrays and use their exact sparse expansion.
    ``dtype``: ``"auto"`` (float64 while every hidden layer has ≤ 512 nodes, else float32),
    ``"float32"`` or ``"float64"``; the factorised solver's arithmetic. The dense path is float64.
    ``dense_memory_cap``: bytes the dense K may take before ``solver="dense"`` refuses.
    ``shift``: power iteration runs on K + shift·I (the same leading eigenvector, since K ≥ 0);
    ``None`` = half of ‖K v₀‖/‖v₀‖ for the uniform start v₀, about λ₁/2 (docs/matching.md, "Spectral
    matching");
    0 = plain power iteration as in pygmtools' ``sm``.
    ``balance``: Sinkhorn-balance every unary term (docs/matching.md, "Normalisation"); on by default.
    ``activation_bandwidth``: the public rule for σ_act when ``activation_sigma`` is None:
    ``"spread"`` (default) or ``"mean"`` (docs/matching.md, "Bandwidths").
    ``vector_weight``: the weight of a permutation group's vector term (its biases and
    normalisation parameters: ``peer.ldp.matching.groups``), ``None`` = ``edge_weight``; 0
    leaves it out, which makes the group matcher's K on a chain of groups (a built-in
    architecture) the layered matcher's, which has no bias term (docs/matching.md, "One matcher
    for every network"). The layered matcher ignores it.
    ``threads``: torch intra-op threads (a process-wide torch setting: set on entry, restored on
    exit, so two matches running in threads of one process share it). ``None`` = the products
    run on 1 thread while every hidden layer has ≤ 512 nodes and on torch's current setting
    above, and everything else in the power iteration (gathers, scatter-adds, elementwise work)
    on 1 (why: docs/matching.md, "Threads"). A number = every part on that many threads.
    """

    solver: str = "factorised"
    eigensolver: str = "auto"
    expansion_rule: str = "auto"
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
    vector_weight: float | None = None

    @classmethod
    def of(cls, options: MatchOptions | None) -> MatchOptions:
        """``options`` as given (the defaults for None); anything else is refused by name."""
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise InvalidArgument("options", f"must be a MatchOptions, got {type(options).__name__}")
        return options

    def resolved(self, sizes) -> MatchOptions:
        """These options with "auto" replaced by what it means for hidden layers of ``sizes``."""
        fast = max(int(n) for n in sizes) > AUTO_FAST_MIN_WIDTH
        eigensolver = ("ritz" if fast else "power") if self.eigensolver == "auto" else self.eigensolver
        rule = ("operator" if fast else "uniform") if self.expansion_rule == "auto" else self.expansion_rule
        return replace(self, eigensolver=eigensolver, expansion_rule=rule)

    def __post_init__(self):
        if self.solver not in SOLVERS:
            raise InvalidArgument("options.solver", f"must be one of {SOLVERS}, got {self.solver!r}")
        if self.eigensolver not in EIGENSOLVERS:
            raise InvalidArgument("options.eigensolver", f"must be one of {EIGENSOLVERS}, got {self.eigensolver!r}")
        if self.expansion_rule not in EXPANSION_RULES:
            raise InvalidArgument(
                "options.expansion_rule", f"must be one of {EXPANSION_RULES}, got {self.expansion_rule!r}"
            )
        if not isinstance(self.balance, bool):
            raise InvalidArgument("options.balance", f"must be true or false, got {self.balance!r}")
        if self.activation_bandwidth not in BANDWIDTH_RULES:
            raise InvalidArgument(
                "options.activation_bandwidth", f"must be one of {BANDWIDTH_RULES}, got {self.activation_bandwidth!r}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument("options.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("activation_weight", "edge_weight"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"options.{name}", f"must be a finite number >= 0, got {v!r}")
        if self.vector_weight is not None and (
            not _is_real(self.vector_weight) or not math.isfinite(self.vector_weight) or self.vector_weight < 0
        ):
            raise InvalidArgument(
                "options.vector_weight",
                f"must be None (edge_weight) or a finite number >= 0, got {self.vector_weight!r}",
            )
        if self.activation_weight == 0 and self.edge_weight == 0:
            raise InvalidArgument("options.edge_weight", "activation_weight and edge_weight cannot both be 0")
        for name in ("activation_sigma", "weight_sigma"):
            v = getattr(self, name)
            if v is not None and (not _is_real(v) or not math.isfinite(v) or v <= 0):
                raise InvalidArgument(
                    f"options.{name}", f"must be None (public rule) or a finite number > 0, got {v!r}"
                )
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, (int, np.integer)) or self.max_iter < 1:
            raise InvalidArgument("options.max_iter", f"must be a positive integer, got {self.max_iter!r}")
        if not _is_real(self.tol) or not 0 < self.tol < 1:
            raise InvalidArgument("options.tol", f"must be in (0, 1), got {self.tol!r}")
        if not _is_real(self.expansion_tol) or not 1e-12 <= self.expansion_tol < 1:
            raise InvalidArgument("options.expansion_tol", f"must be in [1e-12, 1), got {self.expansion_tol!r}")
        if not isinstance(self.few_valued, bool):
            raise InvalidArgument("options.few_valued", f"must be a bool, got {self.few_valued!r}")
        if self.shift is not None and (not _is_real(self.shift) or not math.isfinite(self.shift) or self.shift < 0):
            raise InvalidArgument(
                "options.shift", f"must be None (the rule) or a finite number >= 0, got {self.shift!r}"
            )
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, (int, np.integer)) or self.threads < 1
        ):
            raise InvalidArgument(
                "options.threads", f"must be None (the rule) or a positive integer, got {self.threads!r}"
            )
        if (
            isinstance(self.dense_memory_cap, bool)
            or not isinstance(self.dense_memory_cap, (int, np.integer))
            or self.dense_memory_cap <= 0
        ):
            raise InvalidArgument(
                "options.dense_memory_cap", f"must be a positive number of bytes, got {self.dense_memory_cap!r}"
            )


@dataclass(frozen=True)
class MatchResult:
    """What a matcher returns, whichever solver ran.

    ``permutations[ℓ][i] = j``: node i of A's hidden layer ℓ is matched to node j of B's, so B
    aligned to A is ``B[perm]`` (rows of its incoming weights, its bias, its activations).
    ``objective``: xᵀKx of the discrete solution, computed from exact kernel values in the same
    way for both solvers (:meth:`Affinity.objective`). ``relaxed[ℓ]``: the leading-eigenvector
    estimate reshaped to n_ℓ×n_ℓ ([i, j] = pair (A node i, B node j)), unit norm over all
    layers — what pygmtools' ``sm`` returns. ``iterations``: eigensolver steps taken;
    ``converged``: whether its stopping rule (``MatchOptions.tol``) was met. ``diagnostics``: expansions and
    their error bounds, bandwidths, normalisers, products per iteration, timings. ``groups``:
    the name of each permuted set, in the order of ``permutations`` — hidden layers for
    :func:`peer.ldp.matching.match_graphs`, permutation groups for
    :func:`peer.ldp.matching.groups.match_group_features` (both return this one type).
    """

    permutations: tuple[np.ndarray, ...]
    objective: float
    solver: str
    iterations: int
    converged: bool
    relaxed: tuple[np.ndarray, ...]
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    groups: tuple[str, ...] = ()

    @property
    def perms(self) -> dict[str, np.ndarray]:
        """The permutations by name: ``perms[g][i] = j`` for group (or hidden layer) ``g``, in
        ``groups`` order (the layered matcher names each hidden layer by its weight layer's
        state-dict prefix, which is its group's name in the traced chain)."""
        return dict(zip(self.groups, self.permutations, strict=True))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
