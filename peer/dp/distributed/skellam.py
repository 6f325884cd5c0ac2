"""The distributed Skellam mechanism: each of k sites adds a share, any k − t shares suffice.

Each site adds, per coordinate of its integer-encoded contribution, Z = P − P′ with P, P′
independent Poisson(v/2): a symmetric Skellam of variance v (the *share variance*). Independent
symmetric Skellams add up to a symmetric Skellam with the variances added, so the revealed sum
of all k sites carries Sk(k·v). Threat model: a coalition of up to t honest-but-curious sites
knows its own shares and can subtract them; what it cannot remove is the honest sites' noise,
Sk((k − t)·v). ``calibrate_share`` therefore sizes v so that (k − t)·v alone is a total variance
V that meets the target, by the Skellam RDP of ``peer.dp.accounting.skellam`` (Poisson
subsampling at the site's rate, T steps, the project's RDP → (ε, δ) conversion). Sites outside
any coalition face k·v ≥ V, which only helps.

Unit: one record at one site (add/remove); sensitivities Δ₁, Δ₂ are those of the encoding
(``Encoding.l1_sensitivity``, ``l2_sensitivity``, integer units). Randomness: the shares are
drawn from the site's CSPRNG-seeded generator (``peer.base.rng``), fresh per step and attempt.

Secure aggregation needs k ≥ t + 2: with k = t + 1 the sum minus the coalition's own vectors is
the one honest site's vector, so the masks would hide nothing (a run that small uses the local-
noise fallback).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting.conversions import DEFAULT_ORDERS, rdp_to_epsilon
from peer.dp.accounting.skellam import check_sensitivities, check_variance, rdp_skellam_steps

MECHANISM = "distributed-skellam"


def check_sites(sites: int, coalition: int) -> tuple[int, int]:
    """k and t as ints with k ≥ t + 2 and t ≥ 0."""
    for name, v in (("sites", sites), ("coalition", coalition)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgument(name, f"must be an integer, got {v!r}")
    k, t = int(sites), int(coalition)
    if t < 0:
        raise InvalidArgument("coalition", f"must be >= 0, got {t}")
    if k < t + 2:
        raise InvalidArgument(
            "sites", f"secure aggregation needs at least coalition + 2 = {t + 2} sites, got {k} (use local noise)"
        )
    return k, t


@dataclass(frozen=True)
class SkellamCalibration:
    """What ``calibrate_share`` chose, and for which target (all public).

    ``total_variance``: V, the variance per coordinate that any k − t honest shares add up to;
    ``share_variance``: v = V/(k − t), what each site adds; ``epsilon`` is the ε reached at
    ``delta`` by T steps with V (≤ the target).
    """

    share_variance: float
    total_variance: float
    sites: int
    coalition: int
    l1_sensitivity: float
    l2_sensitivity: float
    sample_rate: float
    steps: int
    target_epsilon: float
    delta: float
    epsilon: float

    def rdp(self, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
        """RDP of the T calibrated steps against the honest shares' noise alone."""
        return rdp_skellam_steps(
            self.l1_sensitivity, self.l2_sensitivity, self.total_variance, self.sample_rate, self.steps, orders
        )

    def record_fields(self) -> dict:
        return {
            "mechanism": MECHANISM,
            "share_variance": self.share_variance,
            "total_variance": self.total_variance,
            "sites": self.sites,
            "coalition": self.coalition,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "l1_sensitivity": self.l1_sensitivity,
            "l2_sensitivity": self.l2_sensitivity,
        }


def _epsilon_at(variance, d1, d2, q, steps, delta, orders) -> float:
    return rdp_to_epsilon(orders, rdp_skellam_steps(d1, d2, variance, q, steps, orders), delta)


def calibrate_share(
    epsilon: float,
    delta: float,
    sites: int,
    coalition: int,
    l1_sensitivity: float,
    l2_sensitivity: float,
    sample_rate: float = 1.0,
    steps: int = 1,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> SkellamCalibration:
    """The least total variance V (to 1e-6 relative, rounded up) whose T subsampled Skellam steps
    are (ε, δ)-DP by the RDP bound, and the share v = V/(k − t) each site adds."""
    eps = check_epsilon(epsilon)
    delta = check_delta(delta)
    k, t = check_sites(sites, coalition)
    d1, d2 = check_sensitivities(l1_sensitivity, l2_sensitivity)
    if d2 == 0:
        raise InvalidArgument("l2_sensitivity", "must be > 0 (a release that cannot change needs no noise)")
    q = float(sample_rate)
    if isinstance(sample_rate, bool) or not 0 < q <= 1:
        raise InvalidArgument("sample_rate", f"must be in (0, 1], got {sample_rate!r}")

    def eps_of(v: float) -> float:
        return _epsilon_at(v, d1, d2, q, steps, delta, orders)

    hi = max(1.0, d2 * d2)
    while eps_of(hi) > eps:
        hi *= 4.0
        if hi > 1e30:
            raise InvalidArgument("epsilon", f"{eps!r} is out of reach at delta {delta!r} for any Skellam variance")
    lo = hi / 4.0
    while lo > 1e-12 and eps_of(lo) <= eps:
        hi, lo = lo, lo / 4.0
    while hi - lo > 1e-6 * hi:
        mid = math.sqrt(lo * hi)
        if eps_of(mid) <= eps:
            hi = mid
        else:
            lo = mid
    total = hi
    return SkellamCalibration(
        share_variance=total / (k - t),
        total_variance=total,
        sites=k,
        coalition=t,
        l1_sensitivity=d1,
        l2_sensitivity=d2,
        sample_rate=q,
        steps=int(steps),
        target_epsilon=eps,
        delta=delta,
        epsilon=eps_of(total),
    )


#: The integer orders :func:`planned_order` chooses from.
PLANNED_ORDERS = tuple(range(2, 129))


def planned_order(
    epsilon: float,
    delta: float,
    sites: int,
    coalition: int,
    l1_sensitivity: float,
    l2_sensitivity: float,
    sample_rate: float = 1.0,
    steps: int = 1,
) -> int:
    """The one *integer* Rényi order (2..128) at which a run of T such steps needs the least
    total variance to meet (ε, δ): what a ledger created for the run (``[policy] orders``) should
    hold. A function of public numbers only. Integer, because the Skellam bound is stated at
    integer orders (``peer.dp.accounting.skellam``): at a fractional order α the ledger is
    charged ε(⌈α⌉), so a ledger at 6.1 pays for order 7 — about 7% more noise std on a 40-step
    full-batch run than at the best integer order. One order, so δ is not split."""
    best = None
    for order in PLANNED_ORDERS:
        v = calibrate_share(
            epsilon, delta, sites, coalition, l1_sensitivity, l2_sensitivity, sample_rate, steps, (float(order),)
        ).total_variance
        if best is None or v < best[0]:
            best = (v, order)
    return best[1]


def step_parameters(encoding, calibration: SkellamCalibration) -> dict:
    """The public parameters a step's release record carries: the encoding's and the noise's.

    Refuses a calibration made for other sensitivities than the encoding's (Δ₁, Δ₂ in integer
    units): the charge would not cover what the encoding can release.
    """
    for name, enc_value, cal_value in (
        ("l1_sensitivity", encoding.l1_sensitivity, calibration.l1_sensitivity),
        ("l2_sensitivity", encoding.l2_sensitivity, calibration.l2_sensitivity),
    ):
        if cal_value < enc_value * (1 - 1e-12):
            raise InvalidArgument(
                f"calibration.{name}",
                f"is {cal_value!r}, below the encoding's {enc_value!r}: calibrate for the encoding's sensitivities",
            )
    return {**encoding.record_fields(), **calibration.record_fields()}


def step_record(
    encoding,
    share_variance: float,
    sites: int,
    coalition: int,
    sample_rate: float,
    delta: float,
    *,
    steps: int = 1,
    subject: str = "",
    randomness: str = "csprng",
    seed: int | None = None,
    orders: Sequence[float] = DEFAULT_ORDERS,
    **context,
) -> ReleaseRecord:
    """The release record of ``steps`` secure-sum steps at one site (``docs/secure_aggregation.md``,
    "What the record of a step must hold"): data level, unit ``record:add-remove`` (one record of
    this site), L2 ``sensitivity`` Δ₂ of ``encoding`` (integer units; Δ₁ in the parameters),
    every public parameter of the encoding and the noise, and ``context`` (run, step, attempt,
    peers: public). ε is the record's own guarantee at ``delta`` against the honest shares'
    variance (k − t)·v — what the accountant charges (``events.DistributedSkellamSteps``)."""
    k, t = check_sites(sites, coalition)
    v = check_variance(share_variance, "share_variance")
    d1, d2 = encoding.l1_sensitivity, encoding.l2_sensitivity
    delta = check_delta(delta)
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise InvalidArgument("sample_rate", f"must be in (0, 1], got {sample_rate!r}")
    rdp = rdp_skellam_steps(d1, d2, (k - t) * v, float(sample_rate), steps, orders)
    parameters = {
        **encoding.record_fields(),
        "share_variance": v,
        "total_variance": (k - t) * v,
        "sites": k,
        "coalition": t,
        "sample_rate": float(sample_rate),
        "steps": int(steps),
        **context,
    }
    return ReleaseRecord(
        mechanism=MECHANISM,
        level="data",
        unit="record:add-remove",
        epsilon=rdp_to_epsilon(orders, rdp, delta),
        delta=delta,
        sensitivity=d2,
        sensitivity_norm="l2",
        parameters=parameters,
        randomness=randomness,
        seed=seed,
        subject=subject,
    )


def skellam_share(share_variance: float, size: int, generator: np.random.Generator) -> np.ndarray:
    """One site's noise share: ``size`` i.i.d. symmetric Skellam of variance v, int64."""
    v = check_variance(share_variance, "share_variance")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise InvalidArgument("size", f"must be an integer >= 0, got {size!r}")
    lam = v / 2.0
    return generator.poisson(lam, size=int(size)).astype(np.int64) - generator.poisson(lam, size=int(size)).astype(
        np.int64
    )


__all__ = [
    "MECHANISM",
    "PLANNED_ORDERS",
    "SkellamCalibration",
    "calibrate_share",
    "check_sites",
    "planned_order",
    "skellam_share",
    "step_parameters",
    "step_record",
]
