"""Refusals that help the caller, over real daemons: every refusal carries a ``google.rpc.Status``
with structured details — a ``BadRequest`` naming the field and the rule for INVALID_ARGUMENT,
an ``ErrorInfo`` (reason, metadata) for budget and target refusals. Each is read twice: with
plain grpcio + grpc_status (as any outside client would) and through ``peer.net.client.PeerError``;
a refused merge's reachable range also reaches the requester's round report and its CLI line."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from peer_harness import client, make_pool, make_site, pin_each_other, running
from test_rounds import add_pool, build, config, roster_for, trained  # noqa: F401 - trained is a fixture

from peer.budget.ledger import Ledger
from peer.net import wire
from peer.net.client import PeerError
from peer.net.trust import TrustStore
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc

BUDGET_POLICY = """
[policy]
show_remaining = "all"

[policy.data]
unit = "record:replace-one"
epsilon = 1000.0
delta = 1e-3

[policy.model]
total = { epsilon = 3.0, delta = 1e-5 }
per_counterparty = { epsilon = 3.0, delta = 1e-5 }

[policy.peers."*"]
allow = ["features", "weights", "merge", "fuse", "ledger"]
"""


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
    return make_pool(tmp_path_factory.mktemp("pool") / "pool")


@pytest.fixture
def sites(tmp_path, pool_dir):
    a = make_site(tmp_path, "site-a", pools={"digits": pool_dir}, policy=BUDGET_POLICY)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def plain_call(b, a, address, method: str, request) -> grpc.RpcError:
    """Call ``method`` with nothing but grpcio (mutual TLS with b's key, a's pinned certificate)
    and return the error it ends with."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=a.identity.cert_pem, private_key=b.identity.key_pem, certificate_chain=b.identity.cert_pem
    )
    options = [*wire.grpc_options(), ("grpc.ssl_target_name_override", a.name)]
    with grpc.secure_channel(address, creds, options=options) as ch:
        try:
            for _ in getattr(pb_grpc.PeerStub(ch), method)(request, timeout=60):
                pass
        except grpc.RpcError as e:
            return e
    pytest.fail(f"{method} was not refused")


def details_of(error: grpc.RpcError) -> tuple[list, dict]:
    """(field violations as (field, description), ErrorInfo as {reason, domain, metadata})."""
    status = rpc_status.from_call(error)
    assert status is not None, "the refusal carries no google.rpc.Status"
    assert status.code == error.code().value[0] and status.message == error.details()
    violations, info = [], {}
    for d in status.details:
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            d.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            e = error_details_pb2.ErrorInfo()
            d.Unpack(e)
            info = {"reason": e.reason, "domain": e.domain, "metadata": dict(e.metadata)}
    return violations, info


def header():
    return pb.RequestHeader(sender="site-b", receiver="site-a")


def test_a_bad_field_is_named_in_a_bad_request_violation(sites):
    a, b = sites
    with running(a) as (_, address):
        err = plain_call(
            b,
            a,
            address,
            "ReleaseMerged",
            pb.MergeRequest(header=header(), pool="digits", method="avg", epsilon=1.0, delta=1e-5),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations, info = details_of(err)
        assert [f for f, _ in violations] == ["method"] and "'rs'" in violations[0][1]
        assert info == {"reason": "INVALID_FIELD", "domain": "privfusion.v1", "metadata": {}}
        method_rule = violations[0][1]
        err = plain_call(
            b,
            a,
            address,
            "ReleaseWeights",
            pb.WeightsRequest(header=header(), model="mlp", epsilon=float("nan"), delta=1e-6),
        )
        violations, _ = details_of(err)
        assert [f for f, _ in violations] == ["epsilon"]
        with client(b, address) as c, pytest.raises(PeerError) as e:
            c.merged("digits", method="avg", epsilon=1.0, delta=1e-5)
    assert e.value.status == "INVALID_ARGUMENT" and e.value.field == "method"
    assert e.value.violations == (("method", method_rule),) and e.value.reason == "INVALID_FIELD"


def test_a_refused_merge_carries_the_pools_reachable_range(sites):
    a, b = sites
    with running(a) as (_, address):
        err = plain_call(
            b,
            a,
            address,
            "ReleaseMerged",
            pb.MergeRequest(header=header(), pool="digits", method="rs", epsilon=0.01, delta=1e-5),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations, info = details_of(err)
        assert [f for f, _ in violations] == ["target_epsilon"]
        assert info["reason"] == "TARGET_UNREACHABLE" and info["domain"] == "privfusion.v1"
        md = info["metadata"]
        lo = float(md["reachable_epsilon_min"])
        assert md["reachable_epsilon_max"] == "inf" and md["method"] == "rs" and float(md["target_epsilon"]) == 0.01
        assert 0.01 < lo < 1000
        with client(b, address) as c:
            # the range is the truth: a little below its lower end is refused, a little above is served
            with pytest.raises(PeerError) as e:
                c.merged("digits", method="rs", epsilon=lo * 0.98, delta=1e-5)
            assert e.value.reason == "TARGET_UNREACHABLE" and e.value.field == "target_epsilon"
            assert float(e.value.metadata["reachable_epsilon_min"]) == lo
            assert "reachable_epsilon_min=" in str(e.value)  # the message a person reads says it too
            got = c.merged("digits", method="rs", epsilon=lo * 1.02, delta=1e-5)
    assert got.receipt.record.epsilon <= lo * 1.02


def test_a_budget_refusal_carries_spent_and_remaining(sites):
    a, b = sites
    with running(a) as (_, address):
        with client(b, address) as c:
            c.weights("mlp", epsilon=2.0, delta=1e-6)
        err = plain_call(
            b, a, address, "ReleaseWeights", pb.WeightsRequest(header=header(), model="mlp", epsilon=2.0, delta=1e-6)
        )
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        violations, info = details_of(err)
        with client(b, address) as c, pytest.raises(PeerError) as e:
            c.weights("mlp", epsilon=2.0, delta=1e-6)
    assert violations == [] and info["reason"] == "BUDGET_EXHAUSTED"
    md = info["metadata"]
    with Ledger(a.ledger) as led:
        state = {s.key.name: s for s in led.budget_states()}[md["budget"]]
    # ε at the budget's δ, the figures `privfusion ledger show` prints for that budget
    assert float(md["delta_limit"]) == 1e-5 and float(md["epsilon_limit"]) == 3.0
    assert (
        float(md["spent_epsilon"]) == state.spent_epsilon and float(md["remaining_epsilon"]) == state.remaining_epsilon
    )
    assert 0 < float(md["remaining_epsilon"]) < float(md["request_epsilon"])
    assert e.value.status == "RESOURCE_EXHAUSTED" and e.value.reason == "BUDGET_EXHAUSTED"
    assert e.value.metadata["spent_epsilon"] == md["spent_epsilon"]


def test_the_round_report_and_its_cli_line_carry_the_reachable_range(tmp_path, trained):  # noqa: F811
    from coordinator_free.events import describe
    from coordinator_free.runner import load_local_site, run_round

    sites_, _ = build(tmp_path, trained, ["hospital-a", "hospital-b"])
    a, b = sites_
    add_pool(b, trained, data_epsilon=20.0)
    with running(a) as (_, addr_a), running(b) as (_, addr_b):
        roster = roster_for(tmp_path, sites_, {"hospital-a": addr_a, "hospital-b": addr_b})
        result = run_round(
            load_local_site(a.config, "mlp"),
            roster,
            config(tmp_path, method="merged", merge_epsilon=0.001, merge_delta=1e-5, quorum=1),
        )
    drop = result.report["peers"]["hospital-b"]["drop"]
    assert drop["status"] == "INVALID_ARGUMENT" and drop["charged"] == "no"
    details = drop["details"]
    assert details["reason"] == "TARGET_UNREACHABLE" and details["violations"][0]["field"] == "target_epsilon"
    lo = float(details["metadata"]["reachable_epsilon_min"])
    assert lo > 0.001
    [event] = [e for e in result.report["events"] if e["event"] == "dropped" and e.get("peer") == "hospital-b"]
    line = describe(event)
    assert (
        "TARGET_UNREACHABLE" in line and f"reachable_epsilon_min={details['metadata']['reachable_epsilon_min']}" in line
    )


def test_refusals_of_the_caller_and_of_the_request_name_their_reason(sites):
    """A sender that is not its certificate's pinned name, an unknown model, an unknown pool and
    a client unpinned while its connection stays open are each refused with their own reason
    (docs/wire.md 7.3), read with plain grpcio and through PeerError; the message stays the
    sentence it was."""
    a, b = sites
    with running(a) as (_, address):
        err = plain_call(
            b,
            a,
            address,
            "ReleaseWeights",
            pb.WeightsRequest(
                header=pb.RequestHeader(sender="site-c", receiver="site-a"), model="mlp", epsilon=1.0, delta=1e-6
            ),
        )
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "header.sender: claims 'site-c'" in err.details()
        assert details_of(err)[1] == {
            "reason": "SENDER_MISMATCH",
            "domain": "privfusion.v1",
            "metadata": {"field": "header.sender", "pinned_as": "site-b"},
        }

        err = plain_call(
            b, a, address, "ReleaseWeights", pb.WeightsRequest(header=header(), model="nope", epsilon=1.0, delta=1e-6)
        )
        assert err.code() == grpc.StatusCode.NOT_FOUND and "offers no model 'nope'" in err.details()
        info = {"reason": "MODEL_NOT_FOUND", "domain": "privfusion.v1", "metadata": {"field": "model"}}
        assert details_of(err) == ([], info)

        with client(b, address) as c:
            with pytest.raises(PeerError) as e:
                c.merged("no-such-pool", method="rs", epsilon=1.0, delta=1e-5)
            assert e.value.status == "NOT_FOUND" and e.value.reason == "POOL_NOT_FOUND"
            assert e.value.metadata == {"field": "pool"}
            assert c.info().name == "site-a"
            TrustStore(a.identity_dir / "trusted").remove("site-b")
            with pytest.raises(PeerError) as e:
                c.info()  # the same TLS connection: refused at the call (a new one fails its handshake)
    assert e.value.status == "UNAUTHENTICATED" and "is not pinned at 'site-a'" in str(e.value)
    assert e.value.reason == "CLIENT_NOT_PINNED" and e.value.metadata == {}
