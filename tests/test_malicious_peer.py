"""A malicious peer: a real gRPC server (mutual TLS, the peer's own pinned key) that serves
doctored release frames. The client must refuse every doctored release, and a round must drop
the peer as an invalid release that was (or may have been) charged — never as uncharged — and
must never fall back from a merge that may have been charged to features and weights."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from peer_harness import ARCH, client, make_site, model_arrays, pin_each_other

from coordinator_free.roster import Roster, write_roster
from coordinator_free.rounds import RoundConfig
from coordinator_free.runner import load_local_site, run_round
from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.net import wire
from peer.net.receipts import sign_receipt
from privfusion.v1 import peer_pb2 as pb

PROBE = np.random.default_rng(0).random((12, 64))
#: how each doctored release fails at the client: the field its InvalidArgument names, and
#: whether the receipt had verified (the peer's charge is then proven) before it failed
DOCTORED = {
    "bad-signature": ("receipt.signature", False),
    "wrong-counterparty": ("receipt.record.counterparty", False),
    "digest-mismatch": ("tensor[{first}].sha256", True),
    "tampered-manifest": ("manifest", True),
}


class MaliciousPeer:
    """privfusion.v1.Peer (and gRPC health) served by ``site``'s key, answering each release RPC
    as ``modes[rpc]`` says: "honest", one of DOCTORED, or a gRPC status name to abort with
    before any frame. ``calls`` lists the RPCs received, in order."""

    def __init__(self, site, caller_cert: bytes, offers_pool: bool = False):
        self.identity = site.identity
        self.modes: dict[str, str] = {}
        self.calls: list[str] = []
        self.offers_pool = offers_pool
        self.server = grpc.server(ThreadPoolExecutor(4), options=[*wire.grpc_options(), ("grpc.so_reuseport", 0)])
        handlers = {
            "GetPeerInfo": grpc.unary_unary_rpc_method_handler(
                self.info, pb.GetPeerInfoRequest.FromString, pb.PeerInfo.SerializeToString
            ),
            "ReleaseFeatures": grpc.stream_stream_rpc_method_handler(
                self.features, pb.FeaturesRequest.FromString, wire.serialize_frame
            ),
            "ReleaseWeights": grpc.unary_stream_rpc_method_handler(
                self.weights, pb.WeightsRequest.FromString, wire.serialize_frame
            ),
            "ReleaseMerged": grpc.unary_stream_rpc_method_handler(
                self.merged, pb.MergeRequest.FromString, wire.serialize_frame
            ),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("privfusion.v1.Peer", handlers),))
        h = health.HealthServicer()
        h.set("privfusion.v1.Peer", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(h, self.server)
        creds = grpc.ssl_server_credentials(
            [(self.identity.key_pem, self.identity.cert_pem)], root_certificates=caller_cert, require_client_auth=True
        )
        self.address = f"127.0.0.1:{self.server.add_secure_port('127.0.0.1:0', creds)}"

    def info(self, request, context):
        self.calls.append("GetPeerInfo")
        arch = json.dumps(ARCH, sort_keys=True)
        pools = (
            [pb.PoolInfo(name="dp", architecture_json=arch, members=["m0"], methods=["rs"])] if self.offers_pool else []
        )
        return pb.PeerInfo(
            name=self.identity.name,
            protocol=wire.PROTOCOL,
            models=[pb.ModelInfo(name="mlp", architecture_json=arch)],
            pools=pools,
            max_chunk_bytes=wire.MAX_CHUNK_BYTES,
        )

    def _release(self, rpc: str, caller: str, kind: str, subject: str, level: str, context):
        self.calls.append(rpc)
        mode = self.modes.get(rpc, "honest")
        if mode not in DOCTORED and mode != "honest":
            context.abort(getattr(grpc.StatusCode, mode), f"malicious peer: {mode}")
        tensors = sorted(model_arrays().items())
        unit = "neuron" if level == "model" else "record:add-remove"
        record = ReleaseRecord(
            mechanism="gaussian",
            level=level,
            unit=unit,
            epsilon=1.0,
            delta=1e-5,
            sensitivity=1.0,
            sensitivity_norm="l2",
            subject=subject,
            counterparty="someone-else" if mode == "wrong-counterparty" else caller,
        )
        metadata = {"permuted": False}
        receipt = sign_receipt(
            self.identity, "1", record, wire.release_manifest(kind, subject, ARCH, metadata, tensors)
        )
        frames = [
            pb.ReleaseFrame.FromString(wire.serialize_frame(f))
            for f in wire.release_frames(receipt, kind, subject, ARCH, metadata, tensors)
        ]
        if mode == "bad-signature":
            sig = bytearray(frames[0].receipt.signature)
            sig[-1] ^= 1  # inside s: still well-formed DER, no longer a valid signature
            frames[0].receipt.signature = bytes(sig)
        elif mode == "digest-mismatch":
            chunk = next(f for f in frames if f.WhichOneof("frame") == "chunk")
            data = bytearray(chunk.chunk.data)
            data[0] ^= 1
            chunk.chunk.data = bytes(data)
        elif mode == "tampered-manifest":
            frames[1].manifest.metadata_json = json.dumps({"permuted": True}, sort_keys=True)
        yield from frames

    def features(self, requests, context):
        first = next(requests)
        for _ in requests:  # the probe header and chunks: read, never looked at
            pass
        yield from self._release(
            "ReleaseFeatures", first.params.header.sender, "features", first.params.model, "model", context
        )

    def weights(self, request, context):
        yield from self._release("ReleaseWeights", request.header.sender, "weights", request.model, "model", context)

    def merged(self, request, context):
        yield from self._release("ReleaseMerged", request.header.sender, "merged", request.pool, "data", context)


@contextlib.contextmanager
def malicious(tmp_path, offers_pool: bool = False):
    """(requester site, the malicious peer) pinned to each other; the peer serving."""
    requester = make_site(tmp_path, "hospital-a", probe=PROBE)
    evil = make_site(tmp_path, "evil", models={})
    pin_each_other(requester, evil)
    peer = MaliciousPeer(evil, requester.identity.cert_pem, offers_pool)
    peer.server.start()
    try:
        yield requester, peer
    finally:
        peer.server.stop(0)


def test_the_malicious_peer_is_otherwise_well_formed(tmp_path):
    """Control: the same server's honest release is accepted, so each refusal below is due to
    its one doctored part."""
    with malicious(tmp_path) as (requester, peer), client(requester, peer.address, peer="evil") as c:
        got = c.weights("mlp", epsilon=1.0, delta=1e-5)
    assert got.receipt.signer == "evil" and got.metadata == {"permuted": False}


@pytest.mark.parametrize("mode", sorted(DOCTORED))
def test_the_client_refuses_a_doctored_release_naming_what_is_wrong(tmp_path, mode):
    field, receipt_verified = DOCTORED[mode]
    first = min(model_arrays())
    seen = []
    with malicious(tmp_path) as (requester, peer):
        peer.modes["ReleaseWeights"] = mode
        with (
            client(requester, peer.address, peer="evil", on_receipt=seen.append) as c,
            pytest.raises(InvalidArgument) as e,
        ):
            c.weights("mlp", epsilon=1.0, delta=1e-5)
    assert e.value.field == field.format(first=first)
    # the receipt is handed on (the round records the charge) only once it verified
    assert len(seen) == int(receipt_verified)


def round_config(tmp_path, requester, peer, **kw) -> tuple[Roster, RoundConfig]:
    path = write_roster(
        tmp_path / "roster.toml",
        [
            ("hospital-a", "127.0.0.1:1", str(requester.identity_dir / "site.crt")),
            ("evil", peer.address, str(requester.identity_dir / "trusted" / "evil.crt")),
        ],
    )
    base = {
        "roster": path,
        "model": "mlp",
        "quorum": 2,
        "activation_epsilon": 1.0,
        "weight_epsilon": 1.0,
        "activation_clip": (0.0, 4.0),
        "out": tmp_path / "out",
        "health_timeout_s": 5.0,
        "call_timeout_s": 30.0,
        # the releases at these ε carry no signal (docs/mechanisms.md); what is tested is how a
        # round treats a doctored one, so the round is asked to go on
        "go_on_without_signal": True,
    }
    base.update(kw)
    return Roster.load(path), RoundConfig(**base)


@pytest.mark.parametrize("mode", sorted(DOCTORED))
def test_a_round_drops_a_doctored_release_as_invalid_and_charged(tmp_path, mode):
    _, receipt_verified = DOCTORED[mode]
    with malicious(tmp_path) as (requester, peer):
        peer.modes["ReleaseFeatures"] = mode
        roster, config = round_config(tmp_path, requester, peer)
        result = run_round(load_local_site(requester.config, "mlp"), roster, config, write=False)
    drop = result.report["peers"]["evil"]["drop"]
    assert (drop["step"], drop["status"]) == ("features", "INVALID_RELEASE")
    # a verified receipt proves the charge; a receipt that fails its own checks proves nothing
    # either way, so the release may have been charged — never reported as uncharged
    assert drop["charged"] == ("yes" if receipt_verified else "unknown")
    assert peer.calls == ["GetPeerInfo", "ReleaseFeatures"]  # nothing asked after the bad release
    charges = result.report["charges"]
    assert len(charges) == int(receipt_verified) and all(c["peer"] == "evil" and not c["delivered"] for c in charges)
    assert result.status == "aborted" and result.arrays is None


@pytest.mark.parametrize(
    "merge, charged, falls_back",
    [
        ("digest-mismatch", "yes", False),  # the receipt verified: the merge was charged
        ("bad-signature", "unknown", False),  # a receipt arrived but does not verify: may have been
        ("INTERNAL", "unknown", False),  # failed after connecting, before any frame: may have been
        ("UNAVAILABLE", "unknown", False),
        ("RESOURCE_EXHAUSTED", "no", True),  # a refusal comes before the charge: falling back is safe
    ],
)
def test_auto_never_falls_back_after_a_merge_that_may_have_been_charged(tmp_path, merge, charged, falls_back):
    with malicious(tmp_path, offers_pool=True) as (requester, peer):
        peer.modes.update(ReleaseMerged=merge, ReleaseFeatures="RESOURCE_EXHAUSTED")
        roster, config = round_config(tmp_path, requester, peer, method="auto", merge_epsilon=2.0)
        result = run_round(load_local_site(requester.config, "mlp"), roster, config, write=False)
    evil = result.report["peers"]["evil"]
    if falls_back:
        assert peer.calls == ["GetPeerInfo", "ReleaseMerged", "ReleaseFeatures"]
        assert any("falling back" in n for n in evil["notes"])
        assert (evil["drop"]["step"], evil["drop"]["charged"]) == ("features", "no")
    else:
        assert peer.calls == ["GetPeerInfo", "ReleaseMerged"]  # no features, no weights
        assert (evil["drop"]["step"], evil["drop"]["charged"]) == ("merged", charged)
        assert not any("falling back" in n for n in evil["notes"])
