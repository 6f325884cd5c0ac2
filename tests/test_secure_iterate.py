"""One secure-sum step among real sites in one process (``coordinator_free.secure_iterate``):
real identities, pinned trust stores, SQLite ledgers and release desks, the real X25519 /
ChaCha20 / ECDSA protocol, sites in threads over an in-memory board. Over the daemons the board
is replaced by RPCs; the protocol is the same code."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from peer_harness import OPEN_POLICY, make_site, pin, pin_each_other

from coordinator_free.secure_iterate import (
    InProcessBoard,
    SecureParty,
    SecureSumPlan,
    apply_update,
    secure_sum,
)
from peer.base.errors import BudgetExhausted, FailedPrecondition, PermissionDenied
from peer.desk.desk import ReleaseDesk
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.distributed.encoding import Encoding
from peer.dp.distributed.skellam import calibrate_share
from peer.net.daemon import open_site
from peer.net.secagg import MaskContext, MaskedShare, sign_masked
from peer.net.signing import wire_transport

DIM = 24
RECORDS = 40
ENCODING = Encoding(dim=DIM, clip_norm=1.0, scale=512.0, bits=32, beta=0.0)
POLICY = (
    OPEN_POLICY.replace('unit = "record:replace-one"', 'unit = "record:add-remove"')
    .replace("epsilon = 1000.0\ndelta = 1e-3\n\n[policy.model]", "epsilon = 8.0\ndelta = 1e-5\n\n[policy.model]")
    .replace('"ledger"]', '"ledger", "secure-sum"]')
)
TIGHT = POLICY.replace("epsilon = 8.0\ndelta = 1e-5", "epsilon = 0.05\ndelta = 1e-5")


def plan(sites: int = 4, coalition: int = 1, epsilon: float = 4.0, steps: int = 4) -> SecureSumPlan:
    cal = calibrate_share(
        epsilon, 1e-5, sites, coalition, ENCODING.l1_sensitivity, ENCODING.l2_sensitivity, 1.0, steps, DEFAULT_ORDERS
    )
    return SecureSumPlan("run-1", ENCODING, coalition, cal.total_variance, 1.0, 1e-5, max_attempts=3)


def site_gradients(i: int) -> np.ndarray:
    """Site i's per-record 'gradients': fixed test data, most rows above the clip norm."""
    return np.random.default_rng(100 + i).normal(size=(RECORDS, DIM)) * 0.4


def clip_rows(g: np.ndarray, bound: float = 1.0) -> np.ndarray:
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    return g * np.minimum(1.0, bound / norms)


@pytest.fixture
def sites(tmp_path):
    opened = []

    def make(count: int = 4, policies: dict[int, str] | None = None, pinned: bool = True):
        files = [make_site(tmp_path, f"site-{i:02d}", policy=(policies or {}).get(i, POLICY)) for i in range(count)]
        if pinned:
            pin_each_other(*files)
        out = []
        for f in files:
            s = open_site(f.config)
            opened.append(s)
            out.append(s)
        return files, out

    yield make
    for s in opened:
        s.close()


def run_all(parties, board, p, step=0, names=None):
    """Every party runs the step in its own thread; {name: SecureSum or the exception}."""
    names = names or sorted(x.name for x in parties)
    out: dict[str, object] = {}

    def one(party, i):
        data = site_gradients(i)
        try:
            out[party.name] = secure_sum(party, board, p, step, names, lambda idx: data[idx], RECORDS)
        except Exception as e:  # the test looks at each site's outcome
            out[party.name] = e

    threads = [threading.Thread(target=one, args=(x, i)) for i, x in enumerate(parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def parties_of(opened):
    return [SecureParty(s, ReleaseDesk(s, wire_transport(s))) for s in opened]


def entries_of(site):
    return [e.record for e in site.ledger.entries()]


def test_masks_cancel_bit_exactly_and_every_site_holds_the_same_sum(sites):
    _, opened = sites(4)
    parties = parties_of(opened)
    p = plan()
    out = run_all(parties, InProcessBoard(wait_s=20), p)
    results = [out[x.name] for x in parties]
    assert all(not isinstance(r, Exception) for r in results), results
    first = results[0]
    for r in results:
        assert np.array_equal(r.total, first.total) and np.array_equal(r.noisy_sum, first.noisy_sum)
    # the revealed residues are exactly Σ x_i mod 2^b: every mask cancelled
    own = sum((r.own_input for r in results), start=np.zeros(ENCODING.padded_dim, dtype=np.uint64))
    assert np.array_equal(own & np.uint64(2**32 - 1), first.total)
    # and decode to the clipped sum plus noise of variance 4·v = (4/3)·V (k = 4, t = 1)
    clipped = sum(clip_rows(site_gradients(i)).sum(axis=0) for i in range(4))
    noise_std = math.sqrt(4 * p.share_variance(4)) / ENCODING.scale
    # per coordinate |noise| < 6σ (+ rounding ≤ 4/γ) fails with probability < 24·2e-9
    assert np.all(np.abs(first.noisy_sum - clipped) < 6 * noise_std + 4 / ENCODING.scale)
    # each site charged one distributed-Skellam step, attempt 0, for its own records
    for s in opened:
        [record] = entries_of(s)
        assert record.mechanism == "distributed-skellam" and record.parameters["attempt"] == 0
        assert record.parameters["sites"] == 4 and record.parameters["coalition"] == 1
        assert record.parameters["total_variance"] == pytest.approx(p.total_variance)
    # every site applies the same update
    theta = np.zeros(DIM)
    updates = {apply_update(theta, r.noisy_sum, 0.5, 4 * RECORDS).tobytes() for r in results}
    assert len(updates) == 1


class Equivocator(SecureParty):
    """A peer that sends one vector to its first peer and another to the rest, each correctly
    signed: every receiver's own check passes; only comparing digests catches it."""

    def send(self, transport, context, share):
        peers = [s for s in context.sites if s != self.name]
        other = share.y.copy()
        other[0] ^= np.uint64(1)
        values = {p: share for p in peers}
        values[peers[0]] = MaskedShare(other, sign_masked(self.site.identity, context, other), share.release_id)
        transport.publish(context, "masked", self.name, values)


def test_an_equivocating_peer_is_refused_by_every_site(sites):
    _, opened = sites(4)
    parties = parties_of(opened)
    parties[2] = Equivocator(opened[2], ReleaseDesk(opened[2], wire_transport(opened[2])))
    out = run_all(parties, InProcessBoard(wait_s=20), plan())
    for x in parties:
        e = out[x.name]
        assert isinstance(e, PermissionDenied) and e.reason == "SECAGG_EQUIVOCATION", e
        assert e.metadata["site"] == "site-02"


def test_an_unpinned_key_is_refused_and_the_step_reruns_without_that_site(sites):
    files, opened = sites(4, pinned=False)
    # everyone pins everyone, except site-00, which does not pin site-03
    for f in files:
        pin(f, *[o for o in files if o is not f and not (f.name == "site-00" and o.name == "site-03")])
    parties = parties_of(opened)
    out = run_all(parties, InProcessBoard(wait_s=3), plan())
    e = out["site-00"]
    assert isinstance(e, PermissionDenied) and e.reason == "SECAGG_UNPINNED" and e.metadata["site"] == "site-03"
    assert entries_of(opened[0]) == []  # refused before its share was made or charged
    done = [out[n] for n in ("site-01", "site-02", "site-03")]
    assert all(not isinstance(r, Exception) for r in done), done
    assert {r.context.sites for r in done} == {("site-01", "site-02", "site-03")}
    assert all(r.context.attempt == 1 for r in done)


class Killed(Exception):
    """This site dies right after its charge, before its masked vector goes out."""


class DiesMidStep(SecureParty):
    def send(self, transport, context, share):
        raise Killed()


def test_a_dropped_site_aborts_the_attempt_and_the_rerun_is_charged_again(sites):
    _, opened = sites(4)
    parties = parties_of(opened)
    parties[3] = DiesMidStep(opened[3], ReleaseDesk(opened[3], wire_transport(opened[3])))
    p = plan()
    out = run_all(parties, InProcessBoard(wait_s=3), p)
    assert isinstance(out["site-03"], Killed)
    survivors = [out[n] for n in ("site-00", "site-01", "site-02")]
    assert all(not isinstance(r, Exception) for r in survivors), survivors
    assert all(r.context.attempt == 1 and r.context.sites == ("site-00", "site-01", "site-02") for r in survivors)
    assert len({r.total.tobytes() for r in survivors}) == 1
    for s in opened[:3]:
        a0, a1 = entries_of(s)  # both attempts charged, in order
        assert (a0.parameters["attempt"], a0.parameters["sites"]) == (0, 4)
        assert (a1.parameters["attempt"], a1.parameters["sites"]) == (1, 3)
        # the re-run's share is sized for 3 sites: the honest shares still carry V
        assert a1.parameters["share_variance"] == pytest.approx(p.total_variance / 2)
        assert a1.parameters["total_variance"] == pytest.approx(p.total_variance)
        assert [e["kind"] for e in s.ledger.events(a0.release_id)] == ["sent"]
    # the dead site's charge stands (made before it died), recorded as not sent
    [dead] = entries_of(opened[3])
    assert [e["kind"] for e in opened[3].ledger.events(dead.release_id)] == ["send-failed"]


def test_a_step_that_would_overspend_is_refused_before_its_vector_leaves(sites):
    _, opened = sites(4, policies={1: TIGHT})
    parties = parties_of(opened)
    board = InProcessBoard(wait_s=3)
    out = run_all(parties, board, plan())
    assert isinstance(out["site-01"], BudgetExhausted)
    assert entries_of(opened[1]) == []
    context = MaskContext("run-1", 0, 0, tuple(x.name for x in parties), ENCODING.bits)
    assert board.published(context, "key", "site-01")  # its key went out (public) …
    assert board.published(context, "masked", "site-01") == {}  # … its masked vector never did
    rest = [out[n] for n in ("site-00", "site-02", "site-03")]
    assert all(not isinstance(r, Exception) and r.context.attempt == 1 for r in rest), rest


def test_too_few_sites_after_a_dropout_stops_the_step(sites):
    _, opened = sites(3)
    parties = parties_of(opened)
    parties[2] = DiesMidStep(opened[2], ReleaseDesk(opened[2], wire_transport(opened[2])))
    out = run_all(parties, InProcessBoard(wait_s=2), plan(sites=3))
    for n in ("site-00", "site-01"):
        e = out[n]
        assert isinstance(e, FailedPrecondition) and e.reason == "SECAGG_TOO_FEW_SITES", e


def test_the_float32_gradient_matrix_encodes_bit_for_bit_as_a_float64_copy():
    """``flat_gradients`` keeps the per-record gradients in float32 and ``sampled_rows`` hands a
    full batch over uncopied: the encoder converts each chunk to float64 exactly, so the encoded
    sums (summed and per-record rounding) equal those of the float64 copy the run used to make."""
    import torch

    from coordinator_free.secure_iterate import flat_gradients, sampled_rows
    from peer.dp.distributed.encoding import encode_records, encode_sum

    gen = torch.Generator().manual_seed(3)
    shapes = {"0.weight": (7, 5), "0.bias": (7,), "2.weight": (3, 7), "2.bias": (3,)}
    n = 9
    grads = {k: torch.randn(n, *s, generator=gen) * 3 for k, s in shapes.items()}
    order = sorted(grads)
    flat = flat_gradients(grads, order, n)
    old = np.concatenate([grads[k].detach().double().reshape(n, -1).numpy() for k in order], axis=1)
    assert flat.dtype == np.float32 and np.array_equal(flat.astype(np.float64), old)
    everyone = np.arange(n)
    assert sampled_rows(flat, everyone) is flat  # a full batch: no copy
    some = np.array([0, 4, 5])
    assert np.array_equal(sampled_rows(flat, some), flat[some]) and sampled_rows(flat, some) is not flat
    d = flat.shape[1]
    summed = Encoding(dim=d, clip_norm=1.0, scale=512.0, bits=32, beta=0.0)
    per_record = Encoding(dim=d, clip_norm=1.0, scale=512.0, bits=32, beta=float(np.exp(-0.5)))
    for rows, ref in ((flat, old), (sampled_rows(flat, some), old[some])):
        a = encode_sum(rows, summed, np.random.default_rng(11))
        b = encode_sum(ref, summed, np.random.default_rng(11))
        assert np.array_equal(a, b)
        a = encode_records(rows, per_record, np.random.default_rng(12))
        b = encode_records(ref, per_record, np.random.default_rng(12))
        assert np.array_equal(a, b)
