"""The release desk without a server (``peer.desk``): a real site (identity, model store, SQLite
ledger, release store), the desk's one path, and what each outcome leaves in the ledger and in
the gate that counts releases in flight (the daemon's graceful shutdown)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from peer_harness import ARCH, OPEN_POLICY, make_site

from peer.base.errors import BudgetExhausted, FailedPrecondition, InvalidArgument, PermissionDenied
from peer.budget.ledger import Ledger
from peer.desk.desk import Gate, ReleaseDesk, publish_segment
from peer.desk.kinds import IssuedFusion, IssuedMerge, IssuedSecureShare, IssuedSegment, IssuedWeights
from peer.desk.requests import FuseRequest, SecureShareRequest, SegmentRequest, WeightsRequest
from peer.desk.store import StoredRelease, digest, release_sha256, segment_key
from peer.net.daemon import open_site
from peer.net.receipts import verify_receipt
from peer.net.signing import wire_transport

TIGHT_POLICY = OPEN_POLICY.replace("total = { epsilon = 1000.0", "total = { epsilon = 1.0")


class CountingGate(Gate):
    """A gate that counts admitted releases and refuses all while ``draining``."""

    def __init__(self, draining: bool = False):
        self.inside = 0
        self.draining = draining

    def admit(self, what: str) -> None:
        if self.draining:
            raise FailedPrecondition(f"shutting down; {what}", reason="SHUTTING_DOWN")
        self.inside += 1

    def leave(self) -> None:
        self.inside -= 1


@pytest.fixture
def opened(tmp_path):
    sites = []

    def open_(policy: str = OPEN_POLICY, **kw):
        files = make_site(tmp_path, f"site-{len(sites)}", policy=policy, **kw)
        site = open_site(files.config)
        sites.append(site)
        gate = CountingGate()
        return site, ReleaseDesk(site, wire_transport(site), gate), gate

    yield open_
    for s in sites:
        s.close()


def test_weights_are_charged_then_signed_and_their_end_is_recorded(opened):
    site, desk, gate = opened()
    issued = desk.issue(WeightsRequest("site-b", "mlp", 1.0, 1e-5))
    assert isinstance(issued, IssuedWeights) and issued.kind == "weights" and issued.metadata == {"permuted": False}
    assert gate.inside == 1  # admitted until the transport says how the stream ended
    [entry] = site.ledger.entries()
    assert str(entry.entry_id) == issued.entry_id and entry.release_id == issued.record.release_id
    # the receipt signs this charge and the ledger's position right after it
    receipt = issued.receipt
    verify_receipt(receipt, site.identity.cert_pem, "site-0")
    assert (receipt.ledger_seq, receipt.ledger_head.hex()) == site.ledger.chain_position(issued.entry_id)
    desk.finish(issued, sent=True)
    assert gate.inside == 0 and [e["kind"] for e in site.ledger.events(entry.release_id)] == ["sent"]


def test_a_refused_charge_leaves_nothing_charged_and_nothing_admitted(opened):
    site, desk, gate = opened(TIGHT_POLICY)
    with pytest.raises(BudgetExhausted):
        desk.issue(WeightsRequest("site-b", "mlp", 5.0, 1e-5))
    assert gate.inside == 0 and site.ledger.entries() == []


def test_a_draining_gate_refuses_before_the_charge(opened):
    site, desk, gate = opened()
    gate.draining = True
    with pytest.raises(FailedPrecondition, match="nothing was charged") as e:
        desk.issue(WeightsRequest("site-b", "mlp", 1.0, 1e-5))
    assert e.value.reason == "SHUTTING_DOWN" and site.ledger.entries() == []


def fuse_request(site, exchange, caller_active=lambda: True) -> FuseRequest:
    return FuseRequest(
        "site-b", "mlp", "site-x", "theirs", 0.5, 1.0, 1.0, 2.0, 1e-5, (0.0, 4.0),
        probe=site.probe, exchange=exchange, caller_active=caller_active,
    )  # fmt: skip


def test_a_fuse_contribution_is_charged_before_the_exchange_and_cancelled_when_it_fails(opened):
    probe = np.random.default_rng(0).uniform(0, 1, (6, ARCH["input_dim"]))
    site, desk, gate = opened(probe=probe)
    seen = []

    def failing(own):
        seen.append(len(site.ledger.entries()))  # what the ledger holds when the partner is asked
        raise RuntimeError("the partner hung up")

    with pytest.raises(RuntimeError):
        desk.issue(fuse_request(site, failing))
    assert seen == [1] and gate.inside == 0
    with Ledger(site.config.ledger) as led:
        [cancelled] = led.cancellations()
    assert "failed before any byte was sent (RuntimeError)" in cancelled["reason"]
    # the caller gone once the model is fused: cancelled too, nothing of ours was sent
    with pytest.raises(FailedPrecondition) as e:
        desk.issue(fuse_request(site, lambda own: ({}, 0.0, None), caller_active=lambda: False))
    assert e.value.reason == "CALLER_CANCELLED" and len(site.ledger.cancellations()) == 2 and gate.inside == 0


def test_a_fused_model_is_issued_under_the_contribution_s_charge(opened):
    probe = np.random.default_rng(0).uniform(0, 1, (6, ARCH["input_dim"]))
    site, desk, gate = opened(probe=probe)

    # a signed receipt stands in for the partner's (here: one of this site's own releases)
    earlier = desk.issue(WeightsRequest("site-x", "mlp", 1.0, 1e-5))
    desk.finish(earlier, sent=True)
    upstream = earlier.receipt
    issued = desk.issue(fuse_request(site, lambda own: (dict(own.weights), 0.25, upstream)))
    assert isinstance(issued, IssuedFusion) and issued.kind == "fused" and issued.upstream == (upstream,)
    entry = site.ledger.entries()[-1]
    assert str(entry.entry_id) == issued.entry_id and site.ledger.cancellations() == []
    assert issued.metadata["upstream"] == [earlier.entry_id] and issued.metadata["match_objective"] == 0.25
    desk.finish(issued, sent=False)  # the stream broke after the charge: it stands, recorded as not sent
    assert gate.inside == 0 and [e["kind"] for e in site.ledger.events(entry.release_id)] == ["send-failed"]


def test_a_segment_is_published_once_and_served_again_as_a_segment(opened):
    from peer.dp.accounting import TrainingRecord
    from peer.dp.accounting.release_accounting import dpsgd_record

    site, desk, gate = opened(OPEN_POLICY.replace('"ledger"]', '"ledger", "segment"]'))
    tensors = [("0.weight", np.ones((10, 64), np.float32)), ("0.bias", np.zeros(10, np.float32))]
    training = TrainingRecord.constant("replace-one", 2, learning_rate=0.1, clip_norm=1.0, noise_multiplier=6.0)
    record = dpsgd_record(training, 1e-5, subject="run-1")
    record = record.with_(
        parameters={**record.parameters, "release_sha256": release_sha256([(n, digest(a)) for n, a in tensors])}
    )
    key = segment_key("run-1", 1)
    entry_id = publish_segment(site.releases, site.ledger, "run-1", 1, StoredRelease(key, record, ARCH, {}, tensors))
    issued = desk.issue(SegmentRequest("site-b", "run-1", 0))
    assert isinstance(issued, IssuedSegment) and not isinstance(issued, IssuedMerge)
    assert (issued.kind, issued.subject, issued.entry_id) == ("segment", "run-1", entry_id)
    assert issued.served_again and len(site.ledger.entries()) == 1  # served again, not charged again
    assert issued.receipt.served_again == issued.served_again and issued.receipt.served_to == "site-b"
    desk.finish(issued, sent=True)
    assert gate.inside == 0


# ---- a secure-sum share (peer.desk.requests.SecureShareRequest) ------------------------------

SECURE_POLICY = (
    OPEN_POLICY.replace('unit = "record:replace-one"', 'unit = "record:add-remove"')
    .replace("epsilon = 1000.0\ndelta = 1e-3\n\n[policy.model]", "epsilon = 4.0\ndelta = 1e-5\n\n[policy.model]")
    .replace('"ledger"]', '"ledger", "secure-sum"]')
)
SECURE_PEERS = ("site-b", "site-c", "site-d")


def secure_share(share_variance: float, step: int = 0, peers=SECURE_PEERS, **changes) -> SecureShareRequest:
    from peer.dp.distributed.encoding import Encoding
    from peer.dp.distributed.skellam import step_record

    encoding = Encoding(dim=8, clip_norm=1.0, scale=64.0, bits=20, beta=0.0)
    context = {"run": "run-1", "step": step, "attempt": 0, "peers": sorted(peers), **changes}
    record = step_record(encoding, share_variance, len(peers) + 1, 1, 1.0, 1e-5, **context)
    masked = np.arange(8, dtype=np.uint64)
    return SecureShareRequest("run-1", step, 0, tuple(peers), record, masked)


def test_a_secure_share_is_charged_once_for_every_peer_before_it_may_leave(opened):
    site, desk, gate = opened(SECURE_POLICY)
    issued = desk.issue(secure_share(1e6))
    assert isinstance(issued, IssuedSecureShare) and issued.kind == "secure-share" and issued.caller == "*"
    assert issued.metadata == {"run": "run-1", "step": 0, "attempt": 0, "peers": list(SECURE_PEERS)}
    [(name, sent)] = issued.tensors
    assert name == "masked" and sent.dtype == np.int64 and np.array_equal(sent.view(np.uint64), np.arange(8))
    [entry] = site.ledger.entries()
    assert entry.record.mechanism == "distributed-skellam" and entry.counterparty == "*"
    assert str(entry.entry_id) == issued.entry_id
    verify_receipt(issued.receipt, site.identity.cert_pem, "site-0")
    desk.finish(issued, sent=True)
    assert gate.inside == 0 and [e["kind"] for e in site.ledger.events(entry.release_id)] == ["sent"]
    # the ledger's data budget holds the RDP figure; its PLD figure says why there is none
    [state] = [s for s in site.ledger.budget_states(pld=True) if s.key.level == "data"]
    assert 0 < state.spent_epsilon <= 4.0 and state.pld_epsilon is None
    assert "PLD not offered" in state.pld_note and "RDP figure charged" in state.pld_note


def test_a_secure_share_that_would_overspend_is_refused_before_anything_is_charged(opened):
    site, desk, gate = opened(SECURE_POLICY)
    with pytest.raises(BudgetExhausted):
        desk.issue(secure_share(1.0))  # far too little noise for ε = 4
    assert gate.inside == 0 and site.ledger.entries() == []


def test_a_secure_share_needs_every_peer_allowed_and_a_record_of_this_step(opened):
    site, desk, gate = opened(SECURE_POLICY.replace(', "secure-sum"]', "]"))
    with pytest.raises(PermissionDenied, match="secure-sum"):
        desk.issue(secure_share(1e6))
    site, desk, gate = opened(SECURE_POLICY)
    request = secure_share(1e6, step=1)
    wrong = dataclasses.replace(request, step=2)
    with pytest.raises(InvalidArgument) as e:
        desk.issue(wrong)
    assert e.value.field == "record.parameters.step"
    fewer = dataclasses.replace(request, peers=("site-b", "site-c"))
    with pytest.raises(InvalidArgument) as e:
        desk.issue(fewer)
    assert e.value.field == "record.parameters.peers"
    assert site.ledger.entries() == [] and gate.inside == 0
