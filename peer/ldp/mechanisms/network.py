"""Local-DP mechanisms of PrivFusion: what a site applies to the features and weights it shares.

Three mechanisms, each a pure function of (values, public parameters, randomness) that returns
the noisy values and one :class:`peer.base.records.ReleaseRecord` describing the release:

- :func:`laplace_activations` — Laplace noise on node features (activations on a probe set);
- :func:`multibit` — the multi-bit mechanism of LPGNN (Sajadmanesh & Gatica-Perez, CCS 2021)
  on weight features;
- the Perturbation-Filter Adapter (PFA) on released weights: :func:`gaussian_perturbation`
  (L2-clipped vectors plus Gaussian noise calibrated by :func:`analytic_gaussian_sigma`,
  Balle & Wang 2018, or :func:`classical_gaussian_sigma`) followed by :func:`smoothing_filter`
  (a posterior-mean denoiser: pure post-processing of noisy values and public parameters).

:func:`perturb_graph` and :func:`perturb_model_weights` apply them to a whole network and return
a composite record (CONTRACTS §1).

Unit of privacy (model level, local DP)
---------------------------------------
``"neuron"`` (default): neighbouring releases differ in *one neuron's* released features — its
activation row, its incoming weight vector and its bias — each anywhere within the public clip
bounds; everything else is fixed. The features themselves are the protected data (as in
PrivFusion's analysis): the guarantee says nothing about how a change of the training data
propagates through the network. ``"entry"``: neighbouring releases differ in one scalar entry;
allowed only when asked for, reported as such in every record. It is much weaker: a neuron has
P activation entries and d weight entries (bias included), and group privacy over them costs
that factor.

Public parameters and clipping
------------------------------
Every bound (activation range, weight box, L2 clip norm) is a public parameter given by the
caller or derived from the architecture alone (:func:`default_entry_bound`,
:func:`default_clip_norm`), never from the values being released. Values are always clipped
to the bounds *before* noise is added; the sensitivity follows from the bounds.

Randomness
----------
Every function takes ``randomness: Randomness | None``: ``None`` draws a fresh CSPRNG-seeded
generator (:func:`peer.base.rng.make_randomness`); a fixed seed is used only when the caller passes
one, and it is reported in the record. Noise is IEEE double precision: the floating-point
side channel of textbook Laplace/Gaussian samplers (Mironov, CCS 2012) is not mitigated here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from scipy import optimize, special

from peer.base.errors import InvalidArgument
from peer.nn.graph import HiddenLayer, NetworkGraph
from peer.nn.architectures import build_model, validate_architecture
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness, make_randomness

UNITS = ("neuron", "entry")
CALIBRATIONS = ("analytic", "classical")
COMPOSITIONS = ("sequential", "parallel")
#: What the components of a parallel composite are disjoint in (see :func:`composite_record`).
PARALLEL_OVER = ("neurons", "entries")

#: argmin of u·coth²(u/2) (LPGNN's choice of m = ⌊ε / 2.18⌋; numerically 2.1773).
MULTIBIT_EPSILON_PER_COORDINATE = 2.18

#: Default public weight box is [−c, c] with c = DEFAULT_BOUND_FACTOR / sqrt(fan_in): four times
#: PyTorch's Linear/Conv2d initialisation bound 1/sqrt(fan_in). Trained digits MLPs (Adam,
#: 30 epochs) stay within 3.2–4.1 / sqrt(fan_in).
DEFAULT_BOUND_FACTOR = 4.0
#: Default public L2 clip norm of a neuron's incoming vector (weights and bias). Initial rows have
#: norm ≈ 1/sqrt(3); trained digits MLP rows have norm 0.9–1.6.
DEFAULT_CLIP_NORM = 2.0

# Rows per block in the multi-bit sampler, so that n·d up to 4096² stays within a few hundred MB.
_MULTIBIT_BLOCK_ELEMENTS = 1 << 21


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _randomness(randomness: Randomness | None) -> Randomness:
    if randomness is None:
        return make_randomness()
    if not isinstance(randomness, Randomness):
        raise InvalidArgument("randomness", f"must be a peer.base.rng.Randomness or None, got {type(randomness).__name__}")
    return randomness


def _positive_finite(value: Any, field: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a number, got {value!r}") from None
    if isinstance(value, bool) or not (math.isfinite(v) and v > 0):
        raise InvalidArgument(field, f"must be finite and > 0, got {value!r}")
    return v


def _check_delta(delta: Any, field: str = "delta") -> float:
    try:
        v = float(delta)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a number in (0, 1), got {delta!r}") from None
    if isinstance(delta, bool) or not 0 < v < 1:
        raise InvalidArgument(field, f"must be in (0, 1), got {delta!r}")
    return v


def _check_interval(bounds: Any, field: str) -> tuple[float, float]:
    if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
        raise InvalidArgument(field, f"must be a pair (lo, hi) of finite numbers, got {bounds!r}")
    try:
        lo, hi = float(bounds[0]), float(bounds[1])
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a pair (lo, hi) of finite numbers, got {bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidArgument(field, f"must be finite, got {bounds!r}")
    if not lo < hi:
        raise InvalidArgument(field, f"needs lo < hi, got {bounds!r}")
    return lo, hi


def _check_unit(unit: Any) -> str:
    if unit not in UNITS:
        raise InvalidArgument("unit", f"must be one of {UNITS}, got {unit!r}")
    return unit


def _check_matrix(values: Any, field: str) -> np.ndarray:
    try:
        x = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgument(field, "must be a numeric array") from None
    if x.ndim != 2:
        raise InvalidArgument(field, f"must be a 2-d array (units × entries), got shape {x.shape}")
    if x.size == 0:
        raise InvalidArgument(field, f"is empty (shape {x.shape})")
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(field, "contains NaN or infinite values")
    return x


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def composite_record(components: Sequence[ReleaseRecord], composition: str, *, randomness: Randomness,
                     parameters: Mapping[str, Any] | None = None, over: str | None = None) -> ReleaseRecord:
    """The record of several releases made together (CONTRACTS §1, mechanism ``"composite"``).

    ``"parallel"``: the components touch disjoint parts of the release, so a neighbouring pair
    changes one component only and the guarantee is the worst component: ε = max, δ = max.
    ``over`` (required for ``"parallel"``, recorded as ``parameters["parallel_over"]``) says
    what the components are disjoint in, which decides whether the max survives a change of
    unit:

      - ``"neurons"``: every component touches other neurons (e.g. other layers). A neighbouring
        pair changes one neuron, hence one component, in either unit: parallel per neuron too.
      - ``"entries"``: the components touch other *entries of the same neurons* (a layer's
        activation entries and its weight entries). Parallel only per entry; restated per
        neuron, one neuron's change reaches every component, so they compose sequentially
        (``peer.budget.ledger.per_neuron_record``). Allowed only under ``unit="entry"``.

    ``"sequential"``: every component touches the same unit: basic composition, ε = Σ, δ = Σ
    (a conservative summary; accountants compute tighter figures from the components).
    """
    if composition not in COMPOSITIONS:
        raise InvalidArgument("composition", f"must be one of {COMPOSITIONS}, got {composition!r}")
    comps = tuple(components)
    if not comps:
        raise InvalidArgument("components", "a composite release needs at least one component")
    units = {c.unit for c in comps}
    if len(units) != 1:
        raise InvalidArgument("components", f"must share one unit of privacy, got {sorted(units)}")
    unit = comps[0].unit
    extra: dict[str, Any] = {}
    if composition == "parallel":
        if over not in PARALLEL_OVER:
            raise InvalidArgument("over", f"a parallel composite must say what its components are disjoint in, one of {PARALLEL_OVER}; got {over!r}")
        if over == "entries" and unit != "entry":
            raise InvalidArgument("over", f"components disjoint only in entries are not parallel per {unit!r}; compose them sequentially")
        extra["parallel_over"] = over
    elif over is not None:
        raise InvalidArgument("over", f"applies to parallel composites only, got {over!r} for {composition!r}")
    combine = max if composition == "parallel" else sum
    delta = combine(c.delta for c in comps)
    if delta >= 1:
        raise InvalidArgument("components", f"compose to δ = {delta} >= 1")
    return ReleaseRecord(
        mechanism="composite", level="model", unit=unit,
        epsilon=combine(c.epsilon for c in comps), delta=delta,
        sensitivity=None, sensitivity_norm="none",
        parameters={"composition": composition, **extra, **(parameters or {})},
        components=comps, **randomness.record_fields())


# --------------------------------------------------------------------------------------------
# Laplace on activations
# --------------------------------------------------------------------------------------------


def laplace_activations(activations: Any, *, epsilon: float, clip: tuple[float, float],
                        unit: str = "neuron", randomness: Randomness | None = None
                        ) -> tuple[np.ndarray, ReleaseRecord]:
    """Laplace mechanism on node features: ``clip(a, lo, hi) + Laplace(0, b)`` entrywise.

    ``activations`` is (n, P): one row per neuron, one column per probe. Math (Dwork, McSherry,
    Nissim & Smith 2006): for a function with L1 sensitivity Δ₁, adding i.i.d. Laplace(0, b)
    noise with b = Δ₁/ε is ε-DP.

    Unit of privacy and sensitivity:
      - ``"neuron"`` (default): one neuron's whole activation row changes within [lo, hi]^P, so
        Δ₁ = P·(hi − lo). Rows are different units, so each neuron's row is ε-LDP.
      - ``"entry"`` (only when asked): one scalar changes within [lo, hi], Δ₁ = hi − lo.

    Public: ``clip`` (the declared activation range), ``epsilon``. Values are clipped before
    noise; the bounds never come from the data.

    Returns the noisy (n, P) float64 array and a ``"laplace"`` record with parameters
    ``scale`` (b), ``clip`` [lo, hi] and ``shape`` [n, P].
    """
    x = _check_matrix(activations, "activations")
    eps = _positive_finite(epsilon, "epsilon")
    lo, hi = _check_interval(clip, "clip")
    unit = _check_unit(unit)
    rnd = _randomness(randomness)
    n, p = x.shape
    sensitivity = (p if unit == "neuron" else 1) * (hi - lo)
    scale = sensitivity / eps
    noisy = np.clip(x, lo, hi) + rnd.generator.laplace(0.0, scale, size=x.shape)
    record = ReleaseRecord(
        mechanism="laplace", level="model", unit=unit, epsilon=eps, delta=0.0,
        sensitivity=sensitivity, sensitivity_norm="l1",
        parameters={"scale": scale, "clip": [lo, hi], "shape": [n, p]},
        **rnd.record_fields())
    return noisy, record


# --------------------------------------------------------------------------------------------
# Multi-bit mechanism (LPGNN)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultibitRectifier:
    """The three-valued output structure of the multi-bit mechanism.

    Every rectified output equals ``centre + half_step · x*`` with x* ∈ {−1, 0, +1}
    (x* = 0 for coordinates not sampled; when m = d every coordinate is sampled and only ±1
    occur). ``d`` is the length of the vector protected as one unit (1 under the per-entry
    unit), ``m`` the number of coordinates sampled per vector, ``epsilon`` the budget of one
    vector.
    """

    d: int
    m: int
    epsilon: float
    centre: float
    half_step: float

    @property
    def levels(self) -> tuple[float, float, float]:
        """The three possible output values (−1, 0, +1 codes), in increasing order."""
        return (self.centre - self.half_step, self.centre, self.centre + self.half_step)

    def codes(self, rectified: Any) -> np.ndarray:
        """The codes x* ∈ {−1, 0, +1} (int8) of rectified outputs of this rectifier.

        Raises InvalidArgument if a value is not one of the three levels (relative tolerance
        1e-9 of ``half_step``), e.g. when the output was made with other parameters.
        """
        r = np.asarray(rectified, dtype=np.float64)
        z = (r - self.centre) / self.half_step
        codes = np.rint(z)
        if not np.all(np.isfinite(z)) or np.any(np.abs(z - codes) > 1e-9) or np.any(np.abs(codes) > 1):
            raise InvalidArgument("rectified", "values are not outputs of this multi-bit rectifier")
        return codes.astype(np.int8)


def multibit_rectifier(d: int, *, epsilon: float, bounds: tuple[float, float],
                       unit: str = "neuron") -> MultibitRectifier:
    """The rectifier of LPGNN's multi-bit mechanism for vectors of length ``d``.

    m = max(1, min(d, ⌊ε/2.18⌋)); with e = exp(ε/m) the rectifier is
    x′ = d(β−α)/(2m) · (e+1)/(e−1) · x* + (α+β)/2, so centre = (α+β)/2 and
    half_step = d(β−α)/(2m) · coth(ε/(2m)) (the same number, written without overflow).
    Under ``unit="entry"`` each coordinate is its own 1-dimensional mechanism: d = m = 1.
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise InvalidArgument("d", f"must be a positive integer, got {d!r}")
    eps = _positive_finite(epsilon, "epsilon")
    lo, hi = _check_interval(bounds, "bounds")
    if _check_unit(unit) == "entry":
        d = 1
    d = int(d)
    m = int(max(1, min(d, math.floor(eps / MULTIBIT_EPSILON_PER_COORDINATE))))
    half_step = d * (hi - lo) / (2 * m) / math.tanh(eps / (2 * m))
    return MultibitRectifier(d=d, m=m, epsilon=eps, centre=(lo + hi) / 2, half_step=half_step)


def multibit_variance(features: Any, *, epsilon: float, bounds: tuple[float, float],
                      unit: str = "neuron") -> np.ndarray:
    """Per-entry variance of the rectified multi-bit output (LPGNN's variance of the rectifier).

    Var[x′_i] = (d/m)·((β−α)/2)²·((e+1)/(e−1))² − (x_i − (α+β)/2)², for x clipped to [α, β].
    """
    x = _check_matrix(features, "features")
    lo, hi = _check_interval(bounds, "bounds")
    r = multibit_rectifier(x.shape[1], epsilon=epsilon, bounds=bounds, unit=unit)
    x = np.clip(x, lo, hi)
    return r.half_step ** 2 * r.m / r.d - (x - r.centre) ** 2


def multibit(features: Any, *, epsilon: float, bounds: tuple[float, float], unit: str = "neuron",
             randomness: Randomness | None = None) -> tuple[np.ndarray, ReleaseRecord]:
    """The multi-bit mechanism of LPGNN (Sajadmanesh & Gatica-Perez, CCS 2021).

    ``features`` is (n, d): one row per neuron. Each row is clipped to [α, β]^d (α, β =
    ``bounds``); then, per row, m = max(1, min(d, ⌊ε/2.18⌋)) coordinates are sampled without
    replacement; with e = exp(ε/m) each sampled coordinate emits
    t ~ Bernoulli(1/(e+1) + (x−α)/(β−α) · (e−1)/(e+1)), x* = 2t − 1, and the others x* = 0;
    the output is the unbiased rectifier x′ = d(β−α)/(2m)·(e+1)/(e−1)·x* + (α+β)/2
    (E[x′] = x; variance :func:`multibit_variance`).

    Unit of privacy (pure ε-DP, sensitivity = β − α, the width of the public box):
      - ``"neuron"`` (default): the whole d-vector of one neuron is ε-LDP (LPGNN's privacy theorem for the encoder): each
        sampled coordinate is an (ε/m)-randomised response and m are reported.
      - ``"entry"`` (only when asked): the 1-dimensional mechanism (d = m = 1, budget ε) is
        applied independently to every coordinate, so each entry is ε-DP.

    The output takes three values only (see :class:`MultibitRectifier`, :func:`multibit_rectifier`).
    The record (``"multibit"``) carries ``bounds`` [α, β], ``m``, ``d`` (the length of the
    vector protected as one unit: 1 under ``"entry"``), ``shape`` [n, d_features], and the
    rectifier's ``centre`` and ``half_step``.
    """
    x = _check_matrix(features, "features")
    eps = _positive_finite(epsilon, "epsilon")
    lo, hi = _check_interval(bounds, "bounds")
    unit = _check_unit(unit)
    rnd = _randomness(randomness)
    n, d = x.shape
    rect = multibit_rectifier(d, epsilon=eps, bounds=(lo, hi), unit=unit)
    m = rect.m
    # Bernoulli probability in overflow-free form: 1/(e+1) = expit(−ε/m), (e−1)/(e+1) = tanh(ε/2m).
    p_floor = float(special.expit(-eps / m))
    p_slope = math.tanh(eps / (2 * m))
    u = (np.clip(x, lo, hi) - lo) / (hi - lo)
    out = np.empty_like(x)
    gen = rnd.generator
    if m == rect.d:
        # every coordinate is reported (this covers the per-entry unit)
        t = gen.random(x.shape) < p_floor + u * p_slope
        np.copyto(out, np.where(t, rect.levels[2], rect.levels[0]))
    else:
        block = max(1, _MULTIBIT_BLOCK_ELEMENTS // d)
        for start in range(0, n, block):
            ub = u[start:start + block]
            rows = np.arange(ub.shape[0])[:, None]
            # the m smallest of d i.i.d. uniform keys form a uniformly random m-subset
            keys = gen.random(ub.shape)
            sampled = np.argpartition(keys, m - 1, axis=1)[:, :m]
            t = gen.random(sampled.shape) < p_floor + ub[rows, sampled] * p_slope
            ob = out[start:start + block]
            ob.fill(rect.centre)
            ob[rows, sampled] = np.where(t, rect.levels[2], rect.levels[0])
    record = ReleaseRecord(
        mechanism="multibit", level="model", unit=unit, epsilon=eps, delta=0.0,
        sensitivity=hi - lo, sensitivity_norm="range",
        parameters={"bounds": [lo, hi], "m": m, "d": rect.d, "shape": [n, d],
                    "centre": rect.centre, "half_step": rect.half_step},
        **rnd.record_fields())
    return out, record


# --------------------------------------------------------------------------------------------
# Gaussian calibration
# --------------------------------------------------------------------------------------------


def _log_gaussian_delta(epsilon: float, ratio: float) -> float:
    """log δ(ε) of the Gaussian mechanism with noise_std / sensitivity = ``ratio``."""
    a = 1 / (2 * ratio) - epsilon * ratio
    b = -1 / (2 * ratio) - epsilon * ratio
    log_pa = special.log_ndtr(a)
    z = epsilon + special.log_ndtr(b) - log_pa  # log of e^ε Φ(b) / Φ(a), always < 0
    if z >= 0:
        return -math.inf
    return float(log_pa + math.log(-math.expm1(z)))


def gaussian_delta(epsilon: float, noise_std: float, sensitivity: float) -> float:
    """The exact δ(ε) of the Gaussian mechanism (Balle & Wang, ICML 2018, Thm. 8).

    δ(ε) = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ), the hockey-stick divergence of
    N(0, σ²) and N(Δ, σ²); computed in log space so that it neither overflows for large ε nor
    loses precision for small δ.
    """
    eps = float(epsilon)
    if not (math.isfinite(eps) and eps >= 0):
        raise InvalidArgument("epsilon", f"must be finite and >= 0, got {epsilon!r}")
    sigma = _positive_finite(noise_std, "noise_std")
    sens = _positive_finite(sensitivity, "sensitivity")
    return math.exp(_log_gaussian_delta(eps, sigma / sens))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest σ for which Gaussian noise N(0, σ²) on an L2-sensitivity-Δ query is (ε, δ)-DP.

    The analytic Gaussian mechanism (Balle & Wang, ICML 2018): δ(ε) of :func:`gaussian_delta`
    is decreasing in σ, so σ solves δ(ε; σ) = δ. Solved by Brent's method on log σ/Δ against
    log δ (relative precision ~1e-12). Valid for every ε > 0 (unlike the classical formula).
    """
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    sens = _positive_finite(sensitivity, "sensitivity")
    target = math.log(dlt)

    def excess(log_ratio: float) -> float:
        return _log_gaussian_delta(eps, math.exp(log_ratio)) - target

    lo = hi = math.log(math.sqrt(2 * math.log(1.25 / dlt)) / eps)  # the classical ratio: a start
    while excess(lo) < 0:
        lo -= 1.0
    while excess(hi) > 0:
        hi += 1.0
    log_ratio = optimize.brentq(excess, lo, hi, xtol=1e-14, rtol=4 * np.finfo(float).eps, maxiter=500)
    return math.exp(log_ratio) * sens


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The classical calibration σ = sqrt(2 ln(1.25/δ)) · Δ/ε (Dwork & Roth 2014, Thm. A.1).

    Valid only for ε < 1: raises InvalidArgument for ε >= 1 (use
    :func:`analytic_gaussian_sigma`, which is also tighter for every ε).
    """
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    sens = _positive_finite(sensitivity, "sensitivity")
    if eps >= 1:
        raise InvalidArgument("epsilon", f"the classical Gaussian calibration holds only for epsilon < 1, got {epsilon!r}; use calibration='analytic'")
    return math.sqrt(2 * math.log(1.25 / dlt)) * sens / eps


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, calibration: str = "analytic") -> float:
    """σ by the named calibration (``"analytic"`` or ``"classical"``)."""
    if calibration == "analytic":
        return analytic_gaussian_sigma(epsilon, delta, sensitivity)
    if calibration == "classical":
        return classical_gaussian_sigma(epsilon, delta, sensitivity)
    raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")


# --------------------------------------------------------------------------------------------
# Perturbation-Filter Adapter: the Gaussian perturbation unit
# --------------------------------------------------------------------------------------------


def clip_rows(vectors: Any, *, clip_norm: float, entry_bound: float | None = None) -> np.ndarray:
    """Project each row onto {v : |v_j| <= entry_bound} ∩ {v : ‖v‖₂ <= clip_norm}.

    First each entry is clipped to the public box [−entry_bound, entry_bound] (skipped when
    ``entry_bound`` is None), then the row is scaled by min(1, clip_norm/‖row‖₂). Both steps are
    Euclidean projections onto convex sets, hence 1-Lipschitz in L2; scaling down keeps the row
    in the box, so the result lies in the intersection.
    """
    x = _check_matrix(vectors, "vectors")
    c2 = _positive_finite(clip_norm, "clip_norm")
    if entry_bound is not None:
        c = _positive_finite(entry_bound, "entry_bound")
        x = np.clip(x, -c, c)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    over = norms > c2
    return np.where(over, x * (c2 / np.where(over, norms, 1.0)), x)


def gaussian_sensitivity(unit: str, *, clip_norm: float, entry_bound: float | None, length: int) -> float:
    """L2 sensitivity of a clipped row (see :func:`gaussian_perturbation`)."""
    c2 = _positive_finite(clip_norm, "clip_norm")
    if _check_unit(unit) == "neuron":
        # replace-one: two points of the clip set are at most its diameter apart
        box_diameter = math.inf if entry_bound is None else 2 * float(entry_bound) * math.sqrt(length)
        return min(2 * c2, box_diameter)
    # one entry changes: the box clip moves one coordinate by <= 2c, the L2 projection is
    # 1-Lipschitz, and both rows lie in the ball
    return 2 * c2 if entry_bound is None else 2 * min(float(entry_bound), c2)


def gaussian_perturbation(vectors: Any, *, epsilon: float, delta: float, clip_norm: float,
                          entry_bound: float | None = None, unit: str = "neuron",
                          calibration: str = "analytic", randomness: Randomness | None = None
                          ) -> tuple[np.ndarray, ReleaseRecord]:
    """The PFA's randomized perturbation unit: ``clip_rows(v) + N(0, σ² I)``.

    ``vectors`` is (n, k): one row per neuron (its incoming weights with its bias appended).
    Rows are projected by :func:`clip_rows` (public ``entry_bound`` box, then L2 ball of radius
    ``clip_norm``), then i.i.d. Gaussian noise with σ = Δ₂·(calibration factor) is added.

    Unit of privacy and L2 sensitivity Δ₂:
      - ``"neuron"`` (default), *replace-one* adjacency: one neuron's row is replaced by any
        other row of the clip set. The number of neurons is fixed by the public architecture,
        so a neuron cannot be added or removed — only its values change; both rows lie in the
        ball, so Δ₂ = 2·clip_norm (or the box diameter 2·c·sqrt(k) if smaller).
      - ``"entry"`` (only when asked): one scalar entry changes. The box clip moves that one
        coordinate by at most 2c; the L2 projection is 1-Lipschitz; so Δ₂ = 2·min(c, clip_norm)
        with c = ``entry_bound`` (2·clip_norm when no box is given).

    σ comes from :func:`analytic_gaussian_sigma` (default, every ε > 0) or
    :func:`classical_gaussian_sigma` (ε < 1 only). The record (``"gaussian"``) carries
    ``noise_std``, ``clip_norm``, ``entry_bound`` (None if no box), ``calibration``,
    ``adjacency`` and ``shape``; ε, δ are the calibration target.
    """
    x = _check_matrix(vectors, "vectors")
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    c2 = _positive_finite(clip_norm, "clip_norm")
    c = None if entry_bound is None else _positive_finite(entry_bound, "entry_bound")
    unit = _check_unit(unit)
    if calibration not in CALIBRATIONS:
        raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")
    rnd = _randomness(randomness)
    n, k = x.shape
    sensitivity = gaussian_sensitivity(unit, clip_norm=c2, entry_bound=c, length=k)
    sigma = gaussian_sigma(eps, dlt, sensitivity, calibration)
    noisy = clip_rows(x, clip_norm=c2, entry_bound=c) + rnd.generator.normal(0.0, sigma, size=x.shape)
    record = ReleaseRecord(
        mechanism="gaussian", level="model", unit=unit, epsilon=eps, delta=dlt,
        sensitivity=sensitivity, sensitivity_norm="l2",
        parameters={"noise_std": sigma, "clip_norm": c2, "entry_bound": c, "calibration": calibration,
                    "adjacency": "replace-one" if unit == "neuron" else "replace-entry", "shape": [n, k]},
        **rnd.record_fields())
    return noisy, record


# --------------------------------------------------------------------------------------------
# Perturbation-Filter Adapter: the smoothing filter unit
# --------------------------------------------------------------------------------------------


_SQRT2 = math.sqrt(2.0)
_SQRT2_OVER_PI = math.sqrt(2.0 / math.pi)


def _upper_mills_shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(φ(a) − φ(b)) / (Φ(b) − Φ(a)) for 0 <= a < b (both in the upper tail), overflow-free.

    With Q(x) = ½ erfcx(x/√2) e^{−x²/2}, multiply through by e^{a²/2}.
    """
    log_r = -(b - a) * (b + a) / 2
    r = np.exp(log_r)
    return _SQRT2_OVER_PI * -np.expm1(log_r) / (special.erfcx(a / _SQRT2) - r * special.erfcx(b / _SQRT2))


def truncated_normal_mean(mean: Any, std: Any, lo: float, hi: float) -> np.ndarray:
    """E[X] for X ~ N(mean, std²) truncated to [lo, hi] (entrywise, broadcasting).

    E[X] = μ + s·(φ(a) − φ(b))/(Φ(b) − Φ(a)), a = (lo − μ)/s, b = (hi − μ)/s, with Φ written
    through erf/erfcx so that neither tail underflows; std = 0 gives clip(μ, lo, hi). Where the
    interval is narrow against std a series in its half-width replaces the exact form (which
    would cancel). Accuracy: ~1e-6 relative or a few ulps of |μ| absolute, whichever is larger
    (checked against a 60-digit reference in the tests); always finite and inside [lo, hi].
    """
    mu = np.asarray(mean, dtype=np.float64)
    s = np.asarray(std, dtype=np.float64)
    mu, s = np.broadcast_arrays(mu, s)
    out = np.clip(mu, lo, hi).astype(np.float64, copy=True)
    pos = s > 0
    if not np.any(pos):
        return out
    m, sd = mu[pos], s[pos]
    # Extreme inputs (a denormal sd, values 1e200 away) overflow intermediate terms to ±inf;
    # every branch below then still tends to the right limit, and what is left non-finite is
    # replaced by its limit after.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        a, b = (lo - m) / sd, (hi - m) / sd
        shift = np.empty_like(m)
        # computed from the interval directly: b − a can round to 0 when |μ| ≫ hi − lo
        centre, half = ((lo + hi) / 2 - m) / sd, (hi - lo) / (2 * sd)
        # An interval narrow against the scale of the normal (τ = half·max(|centre|, 1) small):
        # there the exact forms cancel catastrophically, so use the expansion of the mean of
        # t = x − centre under the density exp(−centre·t − t²/2) on [−half, half]:
        # E[t] = centre·half²·(−1/3 + (2 + centre²)·half²/45) + O(τ⁶) relative to the first term
        # (set below in the original units, where sd·centre = midpoint − μ exactly).
        narrow = half * np.maximum(np.abs(centre), 1.0) < 1e-2
        upper, lower = (a >= 0) & ~narrow, (b <= 0) & ~narrow
        middle = ~(upper | lower | narrow)
        shift[narrow] = 0.0
        shift[upper] = _upper_mills_shift(a[upper], b[upper])
        # the lower tail mirrors the upper one: the shift changes sign
        shift[lower] = -_upper_mills_shift(-b[lower], -a[lower])
        am, bm = a[middle], b[middle]
        dens = (np.expm1(-am ** 2 / 2) - np.expm1(-bm ** 2 / 2)) / math.sqrt(2 * math.pi)
        shift[middle] = dens / ((special.erf(bm / _SQRT2) - special.erf(am / _SQRT2)) / 2)
        res = m + sd * shift
        mid, h = (lo + hi) / 2, (hi - lo) / 2
        hn, cn = half[narrow], centre[narrow]
        res[narrow] = mid + (mid - m[narrow]) * hn ** 2 * (-1 / 3 + (2 + cn ** 2) * hn ** 2 / 45)
    # when the interval lies so far in a tail that a and b coincide in floating point, the
    # truncated law has collapsed onto the interval's near end
    bad = ~np.isfinite(res)
    res[bad & upper] = lo
    res[bad & lower] = hi
    out[pos] = np.clip(res, lo, hi)
    return out


#: standard errors of var(w′) the clean spread must clear before the filter trusts it
SPREAD_MARGIN = 3.0


def smoothing_filter(noisy: Any, *, noise_std: float, entry_bound: float, standardise: bool = False
                     ) -> tuple[np.ndarray, dict]:
    """The PFA's smoothing filter unit: an empirical-Bayes posterior mean (pure post-processing).

    Model: every clean value w of the group lies in the public box [−c, c] (c = ``entry_bound``;
    the perturbation unit clipped to it) and the release is w′ = w + N(0, σ²) with public
    σ = ``noise_std``. Prior: w ~ N(μ, s²) truncated to [−c, c], with μ = mean(w′) and
    s² = max(var(w′) − σ², 0) — moments of the *noisy* values (E var(w′) = var(w) + σ²), each
    trusted only where it clears its sampling error (below). The
    posterior of w given w′ is then N(m, v) truncated to [−c, c] with
    m = (s² w′ + σ² μ)/(s² + σ²), v = s²σ²/(s² + σ²), and the filter outputs its mean
    (:func:`truncated_normal_mean`, written with erf/erfcx — the "erf-based standardisation").

    Why it helps: the posterior mean minimises the expected squared error under the prior
    (denoising the Gaussian mechanism's output by post-processing, in the spirit of Balle &
    Wang 2018's optimal denoising); even when the prior is only a fit, the linear part alone
    (Wiener shrinkage) has MSE s²σ²/(s²+σ²) < min(s², σ²), and the truncation keeps every
    output inside the box where the clean value lies. Weights of one layer are roughly centred
    and bell-shaped, so the fit is good. When noise dominates (s² <= 0 estimated) every value
    goes to μ: the best constant. The estimate of s² keeps a margin of ``SPREAD_MARGIN``
    standard errors of var(w′), and μ is soft-thresholded towards the box's centre (0) by
    ``SPREAD_MARGIN`` standard errors of mean(w′), so that sampling noise is not taken for
    signal (a false positive has probability ≈ 0.1% under the Gaussian approximation); when
    noise swamps a layer entirely its filtered weights are 0, not a random constant. Measured on a trained digits MLP (benchmarks/pfa_filter.py):
    the MSE to the clean weights falls 2–1000× at ε where the raw release is unusable, and
    α-fusion of a clean model with a filtered noisy one keeps far more accuracy than with the
    raw one. A lone filtered model can lose accuracy against the raw one at intermediate noise:
    per-layer shrinkage changes the balance between a layer's bias and its shrunk inputs.

    ``standardise=True`` afterwards rescales deviations from μ so that their spread equals the
    estimated clean spread s (keeps layer scale, e.g. for activations downstream, at a cost in
    MSE: shrinkage is what lowers the error).

    Reads only the noisy values and the public (σ, c). Returns the filtered array and the
    filter's public parameters (for the release record).
    """
    w = np.asarray(noisy, dtype=np.float64)
    if w.size == 0:
        raise InvalidArgument("noisy", "is empty")
    if not np.all(np.isfinite(w)):
        raise InvalidArgument("noisy", "contains NaN or infinite values")
    sigma = _positive_finite(noise_std, "noise_std")
    c = _positive_finite(entry_bound, "entry_bound")
    # The prior mean too is trusted only beyond SPREAD_MARGIN standard errors of mean(w′)
    # (soft threshold towards the box's centre, 0): under heavy noise mean(w′) alone lands far
    # from the clean mean, and a whole layer collapsed onto it would shift every weight.
    mean = float(w.mean())
    mean_error = math.sqrt(float(w.var()) / w.size)
    mu = float(np.clip(math.copysign(max(abs(mean) - SPREAD_MARGIN * mean_error, 0.0), mean), -c, c))
    # The clean spread is trusted only where the noisy variance exceeds σ² by more than
    # SPREAD_MARGIN standard errors of the variance estimate (≈ var·sqrt(2/(N−1)) for N values):
    # otherwise sampling error alone would pass for signal and, when σ is large, the "posterior
    # mean" would scatter pure noise across the box.
    var = float(w.var())
    standard_error = var * math.sqrt(2.0 / max(w.size - 1, 1))
    prior_var = max(var - sigma ** 2 - SPREAD_MARGIN * standard_error, 0.0)
    post_mean = (prior_var * w + sigma ** 2 * mu) / (prior_var + sigma ** 2)
    post_std = math.sqrt(prior_var * sigma ** 2 / (prior_var + sigma ** 2))
    out = truncated_normal_mean(post_mean, post_std, -c, c)
    if standardise:
        spread = float(np.std(out))
        if spread > 0:
            out = np.clip(mu + (out - mu) * (math.sqrt(prior_var) / spread), -c, c)
    params = {"filter": "posterior-mean", "prior": "empirical-gaussian-in-box", "entry_bound": c,
              "standardise": bool(standardise)}
    return out, params


# --------------------------------------------------------------------------------------------
# Whole networks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightLayer:
    """A weight layer of an architecture: state-dict ``name`` prefix, ``fan_in`` (incoming
    weights per neuron, bias excluded), ``units`` (neurons / channels), ``is_output``."""

    name: str
    fan_in: int
    units: int
    is_output: bool


def weight_layer_specs(arch: Mapping[str, Any]) -> tuple[WeightLayer, ...]:
    """Every Linear/Conv2d layer of the architecture, in order (the last one is the output)."""
    a = validate_architecture(arch)
    model = build_model(a)
    specs = []
    for name, mod in model.named_children():
        w = getattr(mod, "weight", None)
        if w is not None:
            specs.append(WeightLayer(name, int(np.prod(w.shape[1:])), int(w.shape[0]), False))
    specs[-1] = WeightLayer(specs[-1].name, specs[-1].fan_in, specs[-1].units, True)
    return tuple(specs)


def default_entry_bound(fan_in: int) -> float:
    """Public default weight box half-width c = 4/sqrt(fan_in) (architecture only)."""
    return DEFAULT_BOUND_FACTOR / math.sqrt(fan_in)


def default_clip_norm(fan_in: int) -> float:
    """Public default L2 clip norm of one neuron's incoming vector with its bias: the constant
    DEFAULT_CLIP_NORM for every layer (trained rows have norm ≈ 1 whatever the fan-in, because
    initialisation scales entries by 1/sqrt(fan_in))."""
    return DEFAULT_CLIP_NORM


def _per_layer(value: Any, names: Sequence[str], field: str, check, default) -> dict[str, Any]:
    """Resolve a public bound given once for all layers, per layer (name → value), or None."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        missing = [n for n in names if n not in value]
        if unknown:
            raise InvalidArgument(field, f"unknown layers {unknown}; layers are {list(names)}")
        if missing:
            raise InvalidArgument(field, f"no value for layers {missing}")
        return {n: check(value[n], f"{field}[{n}]") for n in names}
    if value is None:
        return {n: default(n, f"{field}[{n}]") for n in names}
    return {n: check(value, field) for n in names}


def _arch_of_graph(graph: NetworkGraph) -> tuple[WeightLayer, ...]:
    specs = weight_layer_specs(graph.architecture)
    hidden_names = tuple(h.name for h in graph.hidden)
    if tuple(s.name for s in specs[:-1]) != hidden_names:
        raise InvalidArgument("graph", f"hidden layers {list(hidden_names)} do not match the architecture's {[s.name for s in specs[:-1]]}")
    return specs


def perturb_graph(graph: NetworkGraph, *, epsilon_x: float, epsilon_w: float,
                  activation_clip: tuple[float, float] | Mapping[str, tuple[float, float]] | None = None,
                  weight_bounds: tuple[float, float] | Mapping[str, tuple[float, float]] | None = None,
                  unit: str = "neuron", randomness: Randomness | None = None
                  ) -> tuple[NetworkGraph, ReleaseRecord]:
    """The noisy graph a site shares for matching, and its composite record.

    What is touched:
      - every hidden layer's activations (n, P): :func:`laplace_activations` with ``epsilon_x``
        and that layer's ``activation_clip``;
      - every hidden layer's weight feature: :func:`multibit` with ``epsilon_w`` on the row
        [incoming.reshape(n, −1), bias] — the bias is the last coordinate of the neuron's
        weight feature (d = n_prev·e + 1), so the released noisy ``bias`` is that coordinate;
      - the output layer's neurons (``output_incoming`` with ``output_bias`` appended) likewise
        with multi-bit and ``epsilon_w``: their incoming weights are the last hidden layer's
        outgoing edges and leave the site in the graph. Output neurons have no activations here.
      - nothing else: the input layer carries no values; the architecture is public.

    Public bounds: ``activation_clip`` is one (lo, hi) for all hidden layers or a dict layer
    name → (lo, hi); None is allowed only for bounded activations (tanh → (−1, 1), sigmoid →
    (0, 1)). ``weight_bounds`` likewise for every weight layer (hidden names and the output
    layer's name, e.g. "4"); None → (−c, c), c = :func:`default_entry_bound` (fan_in).

    Composition (CONTRACTS §1): unit ``"neuron"``: per hidden layer a ``"sequential"``
    composite of [laplace, multibit] (both touch the same neurons: ε_x + ε_w per neuron); the
    layers and the output layer touch disjoint neurons: a ``"parallel"`` composite over
    ``"neurons"`` on top. Unit ``"entry"``: a layer's activation entries and weight entries
    are different entries of the same neurons, so the layer's composite is ``"parallel"`` over
    ``"entries"`` (max(ε_x, ε_w) per entry; restated per neuron it is sequential again:
    P·ε_x + d·ε_w); the top level is parallel over ``"neurons"`` as before. Every component
    carries parameters ``layer`` and ``part`` ("activations" / "weights").
    """
    if not isinstance(graph, NetworkGraph):
        raise InvalidArgument("graph", f"must be a NetworkGraph, got {type(graph).__name__}")
    eps_x = _positive_finite(epsilon_x, "epsilon_x")
    eps_w = _positive_finite(epsilon_w, "epsilon_w")
    unit = _check_unit(unit)
    rnd = _randomness(randomness)
    specs = _arch_of_graph(graph)
    hidden_names = [s.name for s in specs[:-1]]
    all_names = [s.name for s in specs]
    fan_in = {s.name: s.fan_in for s in specs}
    natural = {"tanh": (-1.0, 1.0), "sigmoid": (0.0, 1.0)}.get(graph.architecture.get("activation", "relu"))

    def default_clip(name: str, field: str) -> tuple[float, float]:
        if natural is None:
            raise InvalidArgument(field, f"is required: activation {graph.architecture.get('activation', 'relu')!r} is unbounded (give a public range)")
        return natural

    clips = _per_layer(activation_clip, hidden_names, "activation_clip", _check_interval, default_clip)
    bounds = _per_layer(weight_bounds, all_names, "weight_bounds", _check_interval,
                        lambda n, f: (-default_entry_bound(fan_in[n]), default_entry_bound(fan_in[n])))
    # per neuron both parts touch the same neuron; per entry they touch other entries of it
    layer_composition, layer_over = ("sequential", None) if unit == "neuron" else ("parallel", "entries")

    new_hidden, layer_records = [], []
    for h in graph.hidden:
        act, r_act = laplace_activations(h.activations, epsilon=eps_x, clip=clips[h.name], unit=unit, randomness=rnd)
        feats = np.concatenate([h.weight_features, h.bias[:, None]], axis=1)
        noisy_w, r_w = multibit(feats, epsilon=eps_w, bounds=bounds[h.name], unit=unit, randomness=rnd)
        r_act = r_act.with_(parameters={**r_act.parameters, "layer": h.name, "part": "activations"})
        r_w = r_w.with_(parameters={**r_w.parameters, "layer": h.name, "part": "weights"})
        new_hidden.append(HiddenLayer(h.name, h.kind, act, noisy_w[:, :-1].reshape(h.incoming.shape), noisy_w[:, -1].copy()))
        layer_records.append(composite_record([r_act, r_w], layer_composition, randomness=rnd,
                                              parameters={"layer": h.name}, over=layer_over))
    out_name = specs[-1].name
    out_feats = np.concatenate([graph.output_incoming.reshape(graph.output_incoming.shape[0], -1),
                                graph.output_bias[:, None]], axis=1)
    noisy_out, r_out = multibit(out_feats, epsilon=eps_w, bounds=bounds[out_name], unit=unit, randomness=rnd)
    r_out = r_out.with_(parameters={**r_out.parameters, "layer": out_name, "part": "weights"})
    noisy_graph = NetworkGraph(graph.architecture, graph.input_size, tuple(new_hidden),
                               noisy_out[:, :-1].reshape(graph.output_incoming.shape), noisy_out[:, -1].copy())
    record = composite_record([*layer_records, r_out], "parallel", randomness=rnd,
                              parameters={"release": "graph"}, over="neurons")
    return noisy_graph, record


def perturb_model_weights(arch: Mapping[str, Any], arrays: Mapping[str, Any], *, epsilon: float, delta: float,
                          clip_norm: float | Mapping[str, float] | None = None,
                          entry_bound: float | Mapping[str, float] | None = None,
                          unit: str = "neuron", calibration: str = "analytic",
                          smoothing: bool = True, standardise: bool = False,
                          randomness: Randomness | None = None) -> tuple[dict[str, np.ndarray], ReleaseRecord]:
    """The Perturbation-Filter Adapter on every weight layer of a model (released weights).

    For every Linear/Conv2d layer — hidden layers *and* the output layer (output neurons are
    neurons too) — each neuron's row [weight.reshape(units, −1), bias] goes through
    :func:`gaussian_perturbation` with (ε, δ) and the layer's public ``clip_norm`` and
    ``entry_bound``; then, if ``smoothing``, :func:`smoothing_filter` runs separately on the
    layer's weight entries and on its bias entries (two groups with different spreads).

    Public bounds: one value for all layers, or a dict layer name → value, or None for the
    architecture-only defaults :func:`default_clip_norm` and :func:`default_entry_bound`
    (c = 4/sqrt(fan_in)). The box is always applied (it is what the filter's prior assumes);
    under ``unit="entry"`` it is also what bounds the sensitivity (2·min(c, clip_norm)).

    Composition: layers touch disjoint neurons (and, per entry, disjoint entries): one
    ``"parallel"`` composite over ``"neurons"`` whose components are the per-layer ``"gaussian"`` records (with
    parameters ``layer`` and, if applied, ``smoothing``). Every layer is released at (ε, δ).

    Returns arrays with the same names, shapes and dtypes (float32 stays float32).
    """
    specs = weight_layer_specs(arch)
    eps = _positive_finite(epsilon, "epsilon")
    dlt = _check_delta(delta)
    unit = _check_unit(unit)
    if calibration not in CALIBRATIONS:
        raise InvalidArgument("calibration", f"must be one of {CALIBRATIONS}, got {calibration!r}")
    if not isinstance(arrays, Mapping):
        raise InvalidArgument("arrays", "must be a mapping of state-dict names to arrays")
    expected = {f"{s.name}.{p}" for s in specs for p in ("weight", "bias")}
    missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing or extra:
        raise InvalidArgument("arrays", f"do not fit the architecture: missing {missing}, unexpected {extra}")
    rnd = _randomness(randomness)
    names = [s.name for s in specs]
    fan_in = {s.name: s.fan_in for s in specs}
    norms = _per_layer(clip_norm, names, "clip_norm", _positive_finite,
                       lambda n, f: default_clip_norm(fan_in[n]))
    boxes = _per_layer(entry_bound, names, "entry_bound", _positive_finite,
                       lambda n, f: default_entry_bound(fan_in[n]))

    out: dict[str, np.ndarray] = {}
    records = []
    for s in specs:
        w_raw, b_raw = np.asarray(arrays[f"{s.name}.weight"]), np.asarray(arrays[f"{s.name}.bias"])
        if w_raw.ndim < 2 or w_raw.shape[0] != s.units or int(np.prod(w_raw.shape[1:])) != s.fan_in:
            raise InvalidArgument(f"arrays[{s.name}.weight]", f"has shape {w_raw.shape}, the architecture needs {s.units} units × {s.fan_in} inputs")
        if b_raw.shape != (s.units,):
            raise InvalidArgument(f"arrays[{s.name}.bias]", f"has shape {b_raw.shape}, the architecture needs ({s.units},)")
        for key, arr in ((f"{s.name}.weight", w_raw), (f"{s.name}.bias", b_raw)):
            if not np.all(np.isfinite(arr)):
                raise InvalidArgument(f"arrays[{key}]", "contains NaN or infinite values")
        rows = np.concatenate([w_raw.reshape(s.units, -1), b_raw[:, None]], axis=1).astype(np.float64)
        noisy, rec = gaussian_perturbation(rows, epsilon=eps, delta=dlt, clip_norm=norms[s.name],
                                           entry_bound=boxes[s.name], unit=unit, calibration=calibration,
                                           randomness=rnd)
        params = {**rec.parameters, "layer": s.name}
        if smoothing:
            sigma = rec.parameters["noise_std"]
            w_f, w_params = smoothing_filter(noisy[:, :-1], noise_std=sigma, entry_bound=boxes[s.name], standardise=standardise)
            b_f, _ = smoothing_filter(noisy[:, -1], noise_std=sigma, entry_bound=boxes[s.name], standardise=standardise)
            noisy = np.concatenate([w_f, b_f[:, None]], axis=1)
            params["smoothing"] = {**w_params, "groups": ["weight", "bias"]}
        records.append(rec.with_(parameters=params))
        out[f"{s.name}.weight"] = noisy[:, :-1].reshape(w_raw.shape).astype(w_raw.dtype if w_raw.dtype.kind == "f" else np.float64)
        out[f"{s.name}.bias"] = noisy[:, -1].astype(b_raw.dtype if b_raw.dtype.kind == "f" else np.float64)
    record = composite_record(records, "parallel", randomness=rnd, parameters={"release": "weights"}, over="neurons")
    return out, record
