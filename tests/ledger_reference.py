"""Independent references for the ledger tests: closed-form RDP of the Gaussian and Laplace
mechanisms, the filter's rule recomputed with dp-accounting's own RDP-to-DP conversion, and
records built as peer.base.records defines them. (The ledger itself reads records through peer.dp.accounting.)

Gaussian (Mironov 2017, Prop. 7): D_α = α Δ² / (2 σ²).
Laplace with b = scale/sensitivity (Mironov 2017, Prop. 6):
    D_α = 1/(α−1) · log( α/(2α−1) · e^{(α−1)/b} + (α−1)/(2α−1) · e^{−α/b} ).
"""

from __future__ import annotations

import json
import math

import numpy as np
from dp_accounting.gaussian_mechanism import get_epsilon_gaussian
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from peer.base.records import ReleaseRecord


def gaussian_rdp(orders, sensitivity, noise_std):
    o = np.asarray(orders, float)
    return o * sensitivity**2 / (2 * noise_std**2)


def laplace_rdp(orders, sensitivity, scale):
    o = np.asarray(orders, float)
    eps = sensitivity / scale
    a = np.log(o / (2 * o - 1)) + (o - 1) * eps
    b = np.log((o - 1) / (2 * o - 1)) - o * eps
    return np.logaddexp(a, b) / (o - 1)


def filter_admits(orders, rdp_total, pure_total, epsilon, delta):
    """The filter's rule recomputed with dp-accounting's conversion, one order at a time."""
    if pure_total <= epsilon:
        return True
    if delta == 0:
        return False
    share = delta / len(orders)
    return any(
        compute_epsilon([o], [r], share)[0] <= epsilon * (1 + 1e-12) for o, r in zip(orders, rdp_total, strict=True)
    )


def filter_spent(orders, rdp_total, pure_total, delta):
    best = pure_total
    if delta > 0:
        share = delta / len(orders)
        best = min([best] + [compute_epsilon([o], [r], share)[0] for o, r in zip(orders, rdp_total, strict=True)])
    return best


def gaussian_record(subject="m", noise_std=10.0, sensitivity=1.0, level="model", unit="neuron", **kw) -> ReleaseRecord:
    eps = get_epsilon_gaussian(noise_std / sensitivity, 1e-5)
    return ReleaseRecord(
        mechanism="gaussian",
        level=level,
        unit=unit,
        epsilon=eps,
        delta=1e-5,
        sensitivity=sensitivity,
        sensitivity_norm="l2",
        parameters={"noise_std": noise_std, "clip_norm": sensitivity, "calibration": "analytic"},
        randomness="fixed-seed",
        seed=0,
        subject=subject,
        **kw,
    )


def laplace_record(subject="m", epsilon=0.5, clip=(0.0, 1.0), shape=(4, 3), unit="neuron", **kw) -> ReleaseRecord:
    lo, hi = clip
    sensitivity = (hi - lo) * (shape[1] if unit == "neuron" else 1)
    scale = sensitivity / epsilon
    return ReleaseRecord(
        mechanism="laplace",
        level="model",
        unit=unit,
        epsilon=sensitivity / scale,
        delta=0.0,
        sensitivity=sensitivity,
        sensitivity_norm="l1",
        parameters={"scale": scale, "clip": list(clip), "shape": list(shape)},
        randomness="fixed-seed",
        seed=0,
        subject=subject,
        **kw,
    )


def isclose(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def anchored_points(path) -> dict[str, tuple[int, str]]:
    """The ledger anchor read as docs/architecture.md ("The ledger's anchor") specifies it:
    JSON lines, the first a header; every other line names a chain, a row id ``n`` and that
    row's hash; a chain's anchored point is its line with the largest ``n``. Lines that do not
    parse (a torn write) are skipped."""
    out: dict[str, tuple[int, str]] = {}
    with open(path, "rb") as f:
        for raw in f.read().split(b"\n"):
            try:
                d = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(d, dict) or d.get("format") != "privfusion-ledger-anchor/1" or "chain" not in d:
                continue
            if d["chain"] not in out or d["n"] > out[d["chain"]][0]:
                out[d["chain"]] = (d["n"], d["head"])
    return out
