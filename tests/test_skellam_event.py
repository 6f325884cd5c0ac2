"""The distributed Skellam step as a typed event (``events.DistributedSkellamSteps``): read out of
its release record, interpreted by the accountant, cross-checked against an independent
recomputation of Agarwal, Kairouz & Liu's integer-order bound (and Zhu & Wang's subsampling bound)
written here from the papers, and against dp-accounting's Gaussian RDP at large variance."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting import Accountant
from peer.dp.accounting.conversions import DEFAULT_ORDERS, rdp_to_epsilon
from peer.dp.accounting.events import Composition, DistributedSkellamSteps, GaussianRelease, event_of
from peer.dp.distributed.encoding import Encoding
from peer.dp.distributed.skellam import step_record

DELTA = 1e-5
ENCODING = Encoding(dim=1000, clip_norm=1.0, scale=256.0, bits=24, beta=0.0)


def record(share_variance=2e6, sites=4, coalition=1, sample_rate=1.0, steps=1, **context) -> ReleaseRecord:
    return step_record(ENCODING, share_variance, sites, coalition, sample_rate, DELTA, steps=steps, **context)


def akl_bound(d1: float, d2: float, variance: float, order: int) -> float:
    """Agarwal, Kairouz & Liu (NeurIPS 2021) Thm 3.5, variance parametrisation, one integer order."""
    return order * d2**2 / (2 * variance) + min(
        ((2 * order - 1) * d2**2 + 6 * d1) / (4 * variance**2), 3 * d1 / (2 * variance)
    )


def zhu_wang(eps_at, q: float, order: int) -> float:
    """Zhu & Wang (ICML 2019) Thm 6, summed directly (no log space: small orders only)."""
    if q == 1:
        return eps_at(order)
    total = (1 - q) ** (order - 1) * (order * q - q + 1)
    total += math.comb(order, 2) * q**2 * (1 - q) ** (order - 2) * math.exp(eps_at(2))
    for ell in range(3, order + 1):
        total += 3 * math.comb(order, ell) * (1 - q) ** (order - ell) * q**ell * math.exp((ell - 1) * eps_at(ell))
    return min(math.log(total) / (order - 1), eps_at(order))


def reference_rdp(share, k, t, q, steps, orders) -> np.ndarray:
    d2 = math.sqrt(math.floor((ENCODING.scale * ENCODING.clip_norm + math.sqrt(ENCODING.dim)) ** 2))
    d1 = min(d2 * d2, math.sqrt(ENCODING.dim) * d2)
    honest = (k - t) * share
    out = []
    for a in orders:
        n = max(2, math.ceil(a - 1e-12))  # fractional orders by the next integer order
        out.append(steps * zhu_wang(lambda ell: akl_bound(d1, d2, honest, ell), q, n))
    return np.array(out)


@pytest.mark.parametrize(
    ("share", "k", "t", "q", "steps"),
    [(2e6, 4, 1, 1.0, 1), (5e5, 5, 2, 1.0, 20), (1e6, 4, 1, 0.05, 100), (3e5, 12, 3, 0.01, 50)],
)
def test_the_charge_is_akl_at_the_honest_variance_recomputed_independently(share, k, t, q, steps):
    orders = [1.5, 2, 3, 4, 5, 8, 10, 16, 20, 32]  # small orders: the direct sum stays finite
    acc = Accountant(orders=orders)
    r = record(share, k, t, q, steps)
    ours = acc.rdp(r)
    ref = reference_rdp(share, k, t, q, steps, orders)
    assert np.allclose(ours, ref, rtol=1e-9, atol=0)
    # the record's own ε is the project's one conversion of the same curve (at its default orders)
    assert r.epsilon == pytest.approx(rdp_to_epsilon(DEFAULT_ORDERS, Accountant().rdp(r), DELTA), rel=1e-12)


def test_a_coalition_faces_only_the_honest_shares():
    """k sites with a coalition of t are charged as k − t sites with no coalition (same share)."""
    acc = Accountant()
    assert np.array_equal(acc.rdp(record(1e6, 6, 2)), acc.rdp(record(1e6, 4, 0)))
    assert np.all(acc.rdp(record(1e6, 6, 3)) > acc.rdp(record(1e6, 6, 2)))


def test_at_large_variance_the_charge_is_the_gaussians_of_dp_accounting():
    """For V ≫ Δ² the discreteness term vanishes: RDP → α·Δ₂²/(2V), dp-accounting's Gaussian
    RDP with noise multiplier √V/Δ₂ (integer orders, where both are exact statements)."""
    orders = [2, 3, 4, 8, 16, 32, 64]
    share, k, t = 4e8, 4, 1
    r = record(share, k, t)
    d2 = r.sensitivity
    sigma = math.sqrt((k - t) * share) / d2
    gauss = rdp_privacy_accountant.RdpAccountant(orders)
    gauss.compose(dp_event.GaussianDpEvent(sigma))
    ref = np.array(gauss._rdp)
    ours = Accountant(orders=orders).rdp(r)
    assert np.all(ours >= ref)
    assert np.allclose(ours, ref, rtol=1e-4)
    # at V = 10·Δ₂² the discreteness term is still there (small: O(1/V²) per unit of Δ)
    share = 10 * d2**2 / (k - t)
    small = Accountant(orders=orders).rdp(record(share, k, t))
    gauss_small = np.array(orders) * d2**2 / (2 * (k - t) * share)
    assert np.all(small > gauss_small)


def test_the_event_is_read_from_its_record_and_the_record_round_trips():
    r = record(2e6, 4, 1, run="run-1", step=3, attempt=0, peers=["b", "c", "d"])
    e = event_of(r)
    assert isinstance(e, DistributedSkellamSteps)
    assert (e.sites, e.coalition, e.modulus_bits, e.scale, e.sample_rate, e.steps) == (4, 1, 24, 256.0, 1.0, 1)
    assert e.honest_variance == 3 * 2e6 and e.l2_sensitivity == r.sensitivity
    again = ReleaseRecord.from_json(r.canonical_json())
    assert again == r and again.canonical_json() == r.canonical_json() and event_of(again) == e


def test_supports_says_rdp_is_charged_and_no_pld_is_offered():
    acc = Accountant()
    r = record()
    support = acc.supports(r)
    assert support and not support.pld
    assert support.reason.startswith("PLD not offered for this mechanism (DistributedSkellamSteps: ")
    assert support.reason.endswith("RDP figure charged")
    with pytest.raises(FailedPrecondition) as e:
        acc.pld(r)
    assert e.value.reason == "PLD_NOT_OFFERED"
    pld_eps, rdp_eps = acc.epsilon(r, DELTA)
    assert pld_eps is None and rdp_eps == pytest.approx(r.epsilon)
    # inside a composition: supported by RDP, PLD not offered; other kinds keep their PLD
    both = Composition("sequential", (event_of(r), GaussianRelease(1.0, 2.0)))
    assert acc.supports(both) and not acc.supports(both).pld
    assert np.allclose(acc.rdp(both), acc.rdp(r) + acc.rdp(GaussianRelease(1.0, 2.0)))
    assert acc.supports(GaussianRelease(1.0, 2.0)).pld and acc.epsilon(GaussianRelease(1.0, 2.0), DELTA)[0] > 0


def _bad(changes: dict | None = None, **fields) -> ReleaseRecord:
    d = record().to_dict()
    d["parameters"].update(changes or {})
    d.update(fields)
    return ReleaseRecord.from_dict(d)


def _without(name: str) -> ReleaseRecord:
    d = record().to_dict()
    del d["parameters"][name]
    return ReleaseRecord.from_dict(d)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (_without("share_variance"), "parameters.share_variance"),
        (_bad({"share_variance": -1.0}), "parameters.share_variance"),
        (_bad({"sites": 2, "coalition": 1}), "parameters.sites"),
        (_bad({"coalition": -1}), "parameters.coalition"),
        (_bad({"modulus_bits": 65}), "parameters.modulus_bits"),
        (_bad({"sample_rate": 1.5}), "parameters.sample_rate"),
        (_bad({"steps": 0}), "parameters.steps"),
        (_bad({"l2_sensitivity": 1.0}), "parameters.l2_sensitivity"),
        (_bad({"total_variance": 1.0}), "parameters.total_variance"),
        (_bad(unit="record:replace-one"), "unit"),
        (_bad(sensitivity_norm="l1"), "sensitivity_norm"),
    ],
)
def test_malformed_records_are_refused_naming_the_field(bad, field):
    with pytest.raises(InvalidArgument) as e:
        event_of(bad)
    assert e.value.field == field
    support = Accountant().supports(bad)
    assert not support and support.reason.startswith(field + ":")
