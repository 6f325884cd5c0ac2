"""The PFA's smoothing filter: an empirical-Bayes posterior mean of released weights.

Pure post-processing: it reads only the noisy values and the public (σ, box), so it costs no
privacy (docs/mechanisms.md, "The smoothing filter").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import special

from peer.base.errors import InvalidArgument
from peer.ldp.mechanisms.checks import _positive_finite

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

    E[X] = μ + s·(φ(a) − φ(b))/(Φ(b) − Φ(a)), a = (lo − μ)/s, b = (hi − μ)/s, evaluated so that neither
    tail underflows and a narrow interval does not cancel (docs/mechanisms.md, "The smoothing
    filter"); std = 0 gives clip(μ, lo, hi). Accuracy ~1e-6 relative or a few ulps of |μ| absolute,
    whichever is larger; always finite and inside [lo, hi].
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
        dens = (np.expm1(-(am**2) / 2) - np.expm1(-(bm**2) / 2)) / math.sqrt(2 * math.pi)
        shift[middle] = dens / ((special.erf(bm / _SQRT2) - special.erf(am / _SQRT2)) / 2)
        res = m + sd * shift
        mid = (lo + hi) / 2
        hn, cn = half[narrow], centre[narrow]
        res[narrow] = mid + (mid - m[narrow]) * hn**2 * (-1 / 3 + (2 + cn**2) * hn**2 / 45)
    # when the interval lies so far in a tail that a and b coincide in floating point, the
    # truncated law has collapsed onto the interval's near end
    bad = ~np.isfinite(res)
    res[bad & upper] = lo
    res[bad & lower] = hi
    out[pos] = np.clip(res, lo, hi)
    return out


#: standard errors of var(w′) the clean spread must clear before the filter trusts it
SPREAD_MARGIN = 3.0


def smoothing_filter(
    noisy: Any, *, noise_std: float, entry_bound: float, standardise: bool = False
) -> tuple[np.ndarray, dict]:
    """The PFA's smoothing filter unit: an empirical-Bayes posterior mean (pure post-processing).

    Prior w ~ N(μ, s²) truncated to the public box [−c, c], with μ and s² = var(w′) − σ² estimated
    from the noisy values (each kept only where it clears its sampling error by ``SPREAD_MARGIN``
    standard errors); output E[w | w′] = mean of N((s²w′ + σ²μ)/(s² + σ²), s²σ²/(s² + σ²)) truncated
    to [−c, c]. ``standardise=True`` then rescales deviations from μ to the estimated clean spread
    s. Reads only the noisy values and the public σ = ``noise_std`` and c = ``entry_bound``, so it
    costs no privacy (docs/mechanisms.md, "The smoothing filter").

    Returns the filtered array and the filter's public parameters (for the release record).
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
    prior_var = max(var - sigma**2 - SPREAD_MARGIN * standard_error, 0.0)
    post_mean = (prior_var * w + sigma**2 * mu) / (prior_var + sigma**2)
    post_std = math.sqrt(prior_var * sigma**2 / (prior_var + sigma**2))
    out = truncated_normal_mean(post_mean, post_std, -c, c)
    if standardise:
        spread = float(np.std(out))
        if spread > 0:
            out = np.clip(mu + (out - mu) * (math.sqrt(prior_var) / spread), -c, c)
    params = {
        "filter": "posterior-mean",
        "prior": "empirical-gaussian-in-box",
        "entry_bound": c,
        "standardise": bool(standardise),
    }
    return out, params
