"""The peer service against a real daemon: releases, malformed requests, budgets, fuzzing."""

import math
import threading

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peer_harness import ARCH, client, make_site, model_arrays, pin_each_other, running

from peer.base.rng import make_randomness
from peer.budget.ledger import Ledger
from peer.ldp.mechanisms import perturb_graph, perturb_model_weights
from peer.net import wire
from peer.net.client import PeerError
from peer.net.codec import graph_from_release
from peer.nn.architectures import model_from_arrays
from peer.nn.graph import extract_graph
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc
from privfusion.v1 import tensor_pb2 as tpb

PROBE = np.random.default_rng(0).random((24, 64))


@pytest.fixture
def sites(tmp_path):
    a = make_site(tmp_path, "site-a", seed=11)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    return a, b


def public(record):
    """A record's content without its identity (release id, time)."""
    d = record.to_dict()

    def strip(x):
        x.pop("release_id"), x.pop("created_at")
        for c in x["components"]:
            strip(c)
        return x

    return strip(d)


def entries(site):
    with Ledger(site.ledger) as led:
        return led.entries()


# ------------------------------------------------------------------------ releases


def test_features_are_the_owners_noisy_graph_on_the_callers_probe_set(sites):
    a, b = sites
    with running(a) as (_, address), client(b, address) as c:
        got = c.features("mlp", PROBE, activation_epsilon=1.5, weight_epsilon=0.5)
    # the same release computed locally from the owner's model, the caller's probe set and the
    # owner's first fixed-seed noise stream: bit for bit
    arrays = model_arrays()
    graph = extract_graph(ARCH, model_from_arrays(ARCH, arrays), PROBE)
    want, want_record = perturb_graph(
        graph, epsilon_x=1.5, epsilon_w=0.5, activation_clip=(0.0, 4.0), randomness=make_randomness(11).spawn()
    )
    have = graph_from_release(got.architecture, got.metadata, got.arrays)
    for h_have, h_want in zip(have.hidden, want.hidden, strict=True):
        np.testing.assert_array_equal(h_have.activations, h_want.activations)
        np.testing.assert_array_equal(h_have.incoming, h_want.incoming)
        np.testing.assert_array_equal(h_have.bias, h_want.bias)
    np.testing.assert_array_equal(have.output_incoming, want.output_incoming)
    record = got.receipt.record
    assert record.counterparty == "site-b" and record.subject == "mlp" and record.parameters["probe_rows"] == 24
    assert record.epsilon == want_record.epsilon == 2.0
    assert [public(c) for c in record.components] == [public(c) for c in want_record.components]
    [entry] = entries(a)
    assert str(entry.entry_id) == got.receipt.ledger_entry_id and entry.release_id == record.release_id


def test_weights_are_released_unpermuted_and_requests_cannot_carry_permutations(sites):
    # a requester's match is computed from its own model: it must never leave it, so the
    # request has no field for it (5 and "permutations" are reserved) and the weights come back
    # as perturbed, to be aligned by the requester itself
    assert "permutations" not in pb.WeightsRequest.DESCRIPTOR.fields_by_name
    assert not hasattr(pb, "Permutation")
    a, b = sites
    with running(a) as (_, address), client(b, address) as c:
        plain = c.weights("mlp", epsilon=2.0, delta=1e-5)
    want, _ = perturb_model_weights(
        ARCH, model_arrays(), epsilon=2.0, delta=1e-5, randomness=make_randomness(11).spawn()
    )
    assert sorted(plain.arrays) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(plain.arrays[k], want[k])
    # the manifest says so, as docs/wire.md §5.2 specifies; the record carries no such parameter
    assert plain.metadata == {"permuted": False} and "permuted" not in plain.receipt.record.parameters


def test_saved_release_loads_from_the_store_and_its_receipt_verifies_offline(sites, tmp_path):
    from peer.net.client import save_release
    from peer.net.receipts import SignedReceipt, verify_receipt
    from peer.nn.store import load_model

    a, b = sites
    with running(a) as (_, address), client(b, address) as c:
        got = c.weights("mlp", epsilon=2.0, delta=1e-5)
    _tensors, _doc = save_release(got, tmp_path / "out" / "mlp-a")
    stored = load_model(tmp_path / "out", "mlp-a")
    for k, v in got.arrays.items():
        np.testing.assert_array_equal(stored.arrays[k], v)
    receipt = SignedReceipt.from_json(__import__("json").dumps(stored.metadata["receipt"]))
    assert verify_receipt(receipt, a.identity.cert_pem, "site-a").release_id == got.receipt.record.release_id
    assert stored.metadata["record"]["counterparty"] == "site-b"


# ------------------------------------------------------------------------ malformed requests


def stub_for(b, a, address):
    creds = grpc.ssl_channel_credentials(
        root_certificates=a.identity.cert_pem, private_key=b.identity.key_pem, certificate_chain=b.identity.cert_pem
    )
    ch = grpc.secure_channel(address, creds, options=[*wire.grpc_options(), ("grpc.ssl_target_name_override", a.name)])
    return ch, pb_grpc.PeerStub(ch)


HEADER = pb.RequestHeader(sender="site-b", receiver="site-a")


def params(**kw):
    base = dict(header=HEADER, model="mlp", activation_epsilon=1.0, weight_epsilon=1.0)
    base.update(kw)
    return pb.FeaturesRequest(params=pb.FeaturesParams(**base))


def probe_msgs(x=PROBE, chunk_bytes=wire.MAX_CHUNK_BYTES):
    out = []
    for m in wire.tensor_messages("probe", x, chunk_bytes=chunk_bytes):
        out.append(pb.FeaturesRequest(probe=m) if isinstance(m, tpb.TensorHeader) else pb.FeaturesRequest(chunk=m))
    return out


def with_header(msgs, **kw):
    h = tpb.TensorHeader()
    h.CopyFrom(msgs[0].probe)
    for k, v in kw.items():
        if k == "shape":
            del h.shape[:]
            h.shape.extend(v)
        else:
            setattr(h, k, v)
    return [pb.FeaturesRequest(probe=h), *msgs[1:]]


FEATURE_CASES = [
    ("no params first", probe_msgs(), "INVALID_ARGUMENT", "params"),
    (
        "no sender",
        [params(header=pb.RequestHeader(receiver="site-a")), *probe_msgs()],
        "INVALID_ARGUMENT",
        "header.sender",
    ),
    ("unknown model", [params(model="nope"), *probe_msgs()], "NOT_FOUND", "model"),
    ("epsilon zero", [params(activation_epsilon=0.0), *probe_msgs()], "INVALID_ARGUMENT", "activation_epsilon"),
    ("epsilon negative", [params(weight_epsilon=-1.0), *probe_msgs()], "INVALID_ARGUMENT", "weight_epsilon"),
    ("epsilon NaN", [params(activation_epsilon=math.nan), *probe_msgs()], "INVALID_ARGUMENT", "activation_epsilon"),
    ("epsilon absurd", [params(weight_epsilon=1e300), *probe_msgs()], "INVALID_ARGUMENT", "weight_epsilon"),
    ("epsilon inf", [params(weight_epsilon=math.inf), *probe_msgs()], "INVALID_ARGUMENT", "weight_epsilon"),
    ("bad unit", [params(unit="layer"), *probe_msgs()], "INVALID_ARGUMENT", "unit"),
    ("half a clip", [params(activation_clip_low=0.0), *probe_msgs()], "INVALID_ARGUMENT", "activation_clip_high"),
    (
        "empty clip",
        [params(activation_clip_low=1.0, activation_clip_high=1.0), *probe_msgs()],
        "INVALID_ARGUMENT",
        "activation_clip_low",
    ),
    ("bad weight bound", [params(weight_bound=-1.0), *probe_msgs()], "INVALID_ARGUMENT", "weight_bound"),
    ("no probe", [params()], "INVALID_ARGUMENT", "probe"),
    ("wrong dtype", [params(), *probe_msgs(PROBE.astype(np.int64))], "INVALID_ARGUMENT", "probe.dtype"),
    ("wrong shape", [params(), *probe_msgs(PROBE[:, :63])], "INVALID_ARGUMENT", "probe.shape"),
    ("one-dimensional probe", [params(), *probe_msgs(PROBE[0])], "INVALID_ARGUMENT", "probe.shape"),
    ("NaN in probe", [params(), *probe_msgs(np.where(PROBE > 0.99, np.nan, PROBE))], "INVALID_ARGUMENT", "probe"),
    ("nbytes lie", [params(), *with_header(probe_msgs(), nbytes=8)], "INVALID_ARGUMENT", "probe.nbytes"),
    (
        "huge shape",
        [params(), *with_header(probe_msgs(), shape=[1 << 30, 64], nbytes=(1 << 30) * 64 * 8)],
        "INVALID_ARGUMENT",
        "probe.shape",
    ),
    (
        "too many bytes",
        [params(), *with_header(probe_msgs(), shape=[600000, 64], nbytes=600000 * 64 * 8)],
        "INVALID_ARGUMENT",
        "probe.nbytes",
    ),
    ("truncated stream", [params(), *probe_msgs(chunk_bytes=1024)[:-1]], "INVALID_ARGUMENT", "probe"),
    ("checksum mismatch", None, "INVALID_ARGUMENT", "probe.sha256"),
    (
        "oversize chunk",
        [
            params(),
            *with_header(probe_msgs(np.zeros((2, 64))), shape=[9000, 64], nbytes=9000 * 64 * 8)[:1],
            pb.FeaturesRequest(chunk=tpb.TensorChunk(data=bytes(wire.MAX_CHUNK_BYTES + 8))),
        ],
        "INVALID_ARGUMENT",
        "chunk.data",
    ),
    (
        "chunk before header",
        [params(), pb.FeaturesRequest(chunk=tpb.TensorChunk(data=b"x"))],
        "INVALID_ARGUMENT",
        "probe",
    ),
    ("params twice", [params(), *probe_msgs(), params()], "INVALID_ARGUMENT", "chunk"),
]


def _checksum_case():
    msgs = probe_msgs()
    h = tpb.TensorHeader()
    h.CopyFrom(msgs[0].probe)
    h.sha256 = bytes(32)
    return [params(), pb.FeaturesRequest(probe=h), *msgs[1:]]


WEIGHT_CASES = [
    (dict(model=""), "INVALID_ARGUMENT", "model"),
    (dict(model="../etc"), "NOT_FOUND", "model"),
    (dict(epsilon=0.0), "INVALID_ARGUMENT", "epsilon"),
    (dict(epsilon=1e9), "INVALID_ARGUMENT", "epsilon"),
    (dict(delta=0.0), "INVALID_ARGUMENT", "delta"),
    (dict(delta=0.5), "INVALID_ARGUMENT", "delta"),
    (dict(delta=math.nan), "INVALID_ARGUMENT", "delta"),
    (
        dict(header=pb.RequestHeader(sender="site-b", receiver="site-a", on_behalf_of="site-b")),
        "INVALID_ARGUMENT",
        "header.on_behalf_of",
    ),
    (
        dict(header=pb.RequestHeader(sender="site-b", receiver="site-a", on_behalf_of="site-a")),
        "INVALID_ARGUMENT",
        "header.on_behalf_of",
    ),
    (
        dict(header=pb.RequestHeader(sender="site-b", receiver="site-a", on_behalf_of="Not a Name!")),
        "INVALID_ARGUMENT",
        "header.on_behalf_of",
    ),
]


def call_status(fn):
    try:
        for _ in fn():
            pass
    except grpc.RpcError as e:
        return e.code().name, e.details()
    return "OK", ""


def test_malformed_requests_get_the_fitting_status_naming_the_field_and_never_touch_the_ledger(sites):
    a, b = sites
    with running(a) as (_, address):
        ch, stub = stub_for(b, a, address)
        for name, msgs, status, field in FEATURE_CASES:
            msgs = _checksum_case() if msgs is None else msgs
            got, details = call_status(lambda msgs=msgs: stub.ReleaseFeatures(iter(msgs), timeout=30))
            assert got == status, f"{name}: {got} {details}"
            assert details.startswith(field) or f"{field}:" in details or f" {field}" in details, f"{name}: {details!r}"
        for kw, status, field in WEIGHT_CASES:
            req = pb.WeightsRequest(header=HEADER, model="mlp", epsilon=1.0, delta=1e-5)
            for k, v in kw.items():
                if k == "header":
                    req.header.CopyFrom(v)
                else:
                    setattr(req, k, v)
            got, details = call_status(lambda req=req: stub.ReleaseWeights(req, timeout=30))
            assert got == status and field in details, f"{kw}: {got} {details}"
        # above gRPC's own message limit: refused by gRPC before any handler runs
        big = [params(), pb.FeaturesRequest(chunk=tpb.TensorChunk(data=bytes(wire.GRPC_MESSAGE_LIMIT + 1)))]
        assert call_status(lambda: stub.ReleaseFeatures(iter(big), timeout=30))[0] == "RESOURCE_EXHAUSTED"
        # the server is still up and serving
        with client(b, address) as c:
            assert c.info().name == "site-a"
        ch.close()
    assert entries(a) == []


def test_policy_refusals(tmp_path):
    policy = """
[policy]
[policy.model]
total = { epsilon = 100.0, delta = 1e-3 }
[policy.caps]
weights = 1.0
[policy.peers."site-b"]
allow = ["weights"]
"""
    a = make_site(tmp_path, "site-a", policy=policy)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    with running(a) as (_, address), client(b, address) as c:
        with pytest.raises(PeerError) as e:
            c.features("mlp", PROBE, activation_epsilon=0.1, weight_epsilon=0.1)
        assert e.value.status == "PERMISSION_DENIED" and "features" in str(e.value)
        with pytest.raises(PeerError) as e:
            c.weights("mlp", epsilon=2.0, delta=1e-5)
        assert e.value.status == "INVALID_ARGUMENT" and "epsilon" in str(e.value) and "cap" in str(e.value)
        with pytest.raises(PeerError) as e:
            c.ledger()
        assert e.value.status == "PERMISSION_DENIED"
        assert c.weights("mlp", epsilon=0.5, delta=1e-5).receipt.record.epsilon == 0.5
        assert c.info().budgets == ()  # show_remaining defaults to "none"
    assert len(entries(a)) == 1


# ------------------------------------------------------------------------ budget under concurrency


BUDGET_POLICY = """
[policy]
show_remaining = "own"
[policy.model]
per_counterparty = {{ epsilon = {eps}, delta = {delta} }}
[policy.peers."*"]
allow = ["features", "weights", "ledger"]
"""


def hammer(b, address, n, request):
    """n requests at once (one connection each, released together by a barrier)."""
    barrier = threading.Barrier(n)
    results = [None] * n

    def one(i):
        with client(b, address) as c:
            barrier.wait()
            try:
                results[i] = ("OK", request(c))
            except PeerError as e:
                results[i] = (e.status, str(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_concurrent_pure_releases_never_overspend(tmp_path):
    # features at (0.5 + 0.5) per neuron against a pure budget of 6: exactly 6 of 24 fit
    # one peer asks 24 times at once: lift the per-peer cap (peer.net.limits) so the budget decides
    a = make_site(
        tmp_path,
        "site-a",
        policy=BUDGET_POLICY.format(eps=6.0, delta=0.0),
        workers=32,
        extra_site="max_calls_per_peer = 32",
    )
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    with running(a) as (_, address):
        results = hammer(
            b, address, 24, lambda c: c.features("mlp", PROBE[:4], activation_epsilon=0.5, weight_epsilon=0.5)
        )
        with client(b, address) as c:
            [budget] = c.info().budgets
    ok = [r for s, r in results if s == "OK"]
    refused = [s for s, _ in results if s != "OK"]
    assert len(ok) == 6 and refused == ["RESOURCE_EXHAUSTED"] * 18
    led = entries(a)
    assert sorted(e.release_id for e in led) == sorted(r.receipt.record.release_id for r in ok)
    assert math.fsum(e.epsilon for e in led) == 6.0
    assert budget.epsilon_spent == 6.0 and budget.epsilon_remaining == 0.0 and budget.releases == 6


def test_concurrent_gaussian_releases_stop_where_the_rdp_filter_says(tmp_path):
    from peer.budget.filter import FilterBudget
    from peer.budget.policy import Policy

    text = BUDGET_POLICY.format(eps=8.0, delta=1e-4)
    a = make_site(tmp_path, "site-a", policy=text, workers=32, extra_site="max_calls_per_peer = 32")
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    with running(a) as (_, address):
        results = hammer(b, address, 24, lambda c: c.weights("mlp", epsilon=2.0, delta=1e-6))
    ok = [r for s, r in results if s == "OK"]
    assert {s for s, _ in results if s != "OK"} == {"RESOURCE_EXHAUSTED"}
    led = entries(a)
    assert len(led) == len(ok) and {e.release_id for e in led} == {r.receipt.record.release_id for r in ok}
    # every release has the same RDP curve; the filter admits k of them iff k·rdp fits
    rdp = np.asarray(led[0].rdp)
    assert all(np.array_equal(e.rdp, led[0].rdp) for e in led)
    budget = FilterBudget(8.0, 1e-4, Policy.from_toml_text(text).orders)
    k = 0
    while budget.admits(rdp * (k + 1), math.inf):
        k += 1
    assert 0 < len(ok) == k < 24


# ------------------------------------------------------------------------ fuzzing

names = st.one_of(st.just("mlp"), st.just(""), st.text(max_size=12))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1.0, 1e-6, 0.0, -1.0]))
headers = st.builds(
    pb.RequestHeader,
    sender=st.one_of(st.just("site-b"), st.text(max_size=8)),
    receiver=st.one_of(st.just("site-a"), st.text(max_size=8)),
    on_behalf_of=st.one_of(st.just(""), st.just("site-c"), st.just("site-b"), st.text(max_size=8)),
)
tensor_headers = st.builds(
    tpb.TensorHeader,
    name=st.text(max_size=5),
    dtype=st.integers(0, 6),
    shape=st.lists(st.integers(-2, 70), max_size=3),
    nbytes=st.integers(-1, 1 << 20),
    sha256=st.binary(max_size=33),
)
chunks = st.builds(tpb.TensorChunk, data=st.binary(max_size=512))
feature_params = st.one_of(
    st.builds(
        pb.FeaturesParams,
        header=headers,
        model=names,
        activation_epsilon=floats,
        weight_epsilon=floats,
        unit=st.sampled_from(["", "neuron", "entry", "x"]),
    ),
    st.builds(
        pb.FeaturesParams,
        header=headers,
        model=names,
        activation_epsilon=floats,
        weight_epsilon=floats,
        weights_epsilon=floats,
        weights_delta=floats,
    ),
)
feature_msgs = st.lists(
    st.one_of(
        feature_params.map(lambda p: pb.FeaturesRequest(params=p)),
        tensor_headers.map(lambda h: pb.FeaturesRequest(probe=h)),
        chunks.map(lambda c: pb.FeaturesRequest(chunk=c)),
    ),
    max_size=5,
)
weights_reqs = st.builds(pb.WeightsRequest, header=headers, model=names, epsilon=floats, delta=floats)
merge_reqs = st.builds(
    pb.MergeRequest,
    header=headers,
    pool=names,
    method=st.sampled_from(["rs", "lc", "", "x"]),
    epsilon=floats,
    delta=floats,
)
fuse_reqs = st.builds(
    pb.FuseRequest,
    header=headers,
    model=names,
    partner=st.text(max_size=8),
    partner_model=names,
    alpha=floats,
    activation_epsilon=floats,
    weight_epsilon=floats,
    weights_epsilon=floats,
    weights_delta=floats,
)
calls = st.one_of(
    st.tuples(st.just("GetPeerInfo"), st.builds(pb.GetPeerInfoRequest, header=headers)),
    st.tuples(st.just("ReleaseFeatures"), feature_msgs),
    st.tuples(st.just("ReleaseWeights"), weights_reqs),
    st.tuples(st.just("ReleaseMerged"), merge_reqs),
    st.tuples(st.just("Fuse"), fuse_reqs),
    st.tuples(st.just("ListLedger"), st.builds(pb.LedgerRequest, header=headers)),
    st.tuples(
        st.sampled_from(["GetPeerInfo", "ReleaseWeights", "ReleaseMerged", "Fuse", "ListLedger"]),
        st.binary(max_size=64),
    ),
)

DOMAIN_STATUSES = {
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "PERMISSION_DENIED",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
}


def test_fuzzed_messages_never_crash_the_peer_or_charge_without_a_release(sites):
    a, b = sites
    with running(a) as (_, address):
        ch, stub = stub_for(b, a, address)
        unary = {
            m: ch.unary_unary(
                f"/privfusion.v1.Peer/{m}", request_serializer=lambda x: x, response_deserializer=lambda x: x
            )
            for m in ("GetPeerInfo",)
        }
        streams = {
            m: ch.unary_stream(
                f"/privfusion.v1.Peer/{m}", request_serializer=lambda x: x, response_deserializer=lambda x: x
            )
            for m in ("ReleaseWeights", "ReleaseMerged", "Fuse", "ListLedger")
        }
        released = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(calls)
        def fuzz(call):
            method, message = call
            if isinstance(message, bytes):
                fn = (
                    (lambda: [unary[method](message, timeout=10)])
                    if method in unary
                    else (lambda: streams[method](message, timeout=10))
                )
                status, details = call_status(fn)
                # undecodable bytes are gRPC's own INTERNAL ("Exception deserializing request!")
                assert status in DOMAIN_STATUSES | {"INTERNAL"}, (status, details)
                if status == "INTERNAL":
                    assert "deserializ" in details.lower(), details
                return
            if method == "GetPeerInfo":
                status, details = call_status(lambda: [stub.GetPeerInfo(message, timeout=10)])
            elif method == "ReleaseFeatures":
                frames = []
                status, details = call_status(
                    lambda: (frames.append(f) for f in stub.ReleaseFeatures(iter(message), timeout=10))
                )
                if status == "OK":
                    released.append(frames)
            else:
                frames = []
                rpc = getattr(stub, method)
                status, details = call_status(lambda: (frames.append(f) for f in rpc(message, timeout=10)))
                if status == "OK" and method != "ListLedger":
                    released.append(frames)
            assert status in DOMAIN_STATUSES, (method, status, details)

        fuzz()
        with client(b, address) as c:
            assert c.info().name == "site-a"
        ch.close()
    # every charge is a release the caller received in full (and almost every fuzzed call was refused)
    assert len(entries(a)) == len(released)


def test_cli_asks_a_peer_and_writes_safetensors_and_the_release_document(sites, tmp_path, capsys):
    import json

    from safetensors.numpy import load_file, save_file

    from peer.cli import main

    a, b = sites
    save_file({"x": PROBE}, str(tmp_path / "probe.safetensors"))
    common = ["--identity", str(b.identity_dir)]
    with running(a) as (_, address):
        common = ["--via", address, *common]
        assert main(["peer", "info", *common]) == 0
        assert json.loads(capsys.readouterr().out)["name"] == "site-a"
        assert (
            main(
                [
                    "features",
                    *common,
                    "--model",
                    "mlp",
                    "--probe",
                    str(tmp_path / "probe.safetensors"),
                    "--activation-epsilon",
                    "1",
                    "--weight-epsilon",
                    "1",
                    "--out",
                    str(tmp_path / "f"),
                ]
            )
            == 0
        )
        assert (
            main(
                [
                    "weights",
                    *common,
                    "--model",
                    "mlp",
                    "--epsilon",
                    "2",
                    "--delta",
                    "1e-6",
                    "--out",
                    str(tmp_path / "w.safetensors"),
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "signature verified" in out
        assert main(["peer", "ledger", *common]) == 0
        ledger = json.loads(capsys.readouterr().out)
        assert (
            main(
                [
                    "weights",
                    *common,
                    "--model",
                    "nope",
                    "--epsilon",
                    "2",
                    "--delta",
                    "1e-6",
                    "--out",
                    str(tmp_path / "x"),
                ]
            )
            == 2
        )
        assert "no model 'nope'" in capsys.readouterr().err
    assert load_file(str(tmp_path / "f.safetensors"))["hidden.0.activations"].shape == (16, 24)
    doc = json.loads((tmp_path / "w.json").read_text())
    assert (
        doc["metadata"]["record"]["mechanism"] == "composite" and doc["metadata"]["record"]["counterparty"] == "site-b"
    )
    assert [e["entry_id"] for e in ledger] == ["1", "2"] and not (tmp_path / "x.safetensors").exists()
