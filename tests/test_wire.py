"""Tensors and releases on the wire (peer.net.wire) and signed receipts (peer.net.receipts)."""

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.net import wire
from peer.net.identity import init_identity
from peer.net.receipts import SignedReceipt, sign_receipt, verify_receipt
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import tensor_pb2 as tpb


def roundtrip(name, array, chunk_bytes=wire.MAX_CHUNK_BYTES):
    msgs = list(wire.tensor_messages(name, array, chunk_bytes=chunk_bytes))
    r = wire.TensorReceiver(msgs[0], "t")
    for m in msgs[1:]:
        r.add(m)
    return r.finish(), msgs


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.float64, np.int32, np.int64]),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7),
    ),
    st.integers(1, 64),
)
def test_tensors_roundtrip_bit_for_bit(array, chunk_bytes):
    got, msgs = roundtrip("x", array, chunk_bytes)
    assert got.dtype == array.dtype.newbyteorder("<") and got.shape == array.shape
    assert got.tobytes() == np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
    assert all(len(m.data) <= chunk_bytes for m in msgs[1:])


def test_big_endian_and_non_contiguous_arrays_travel_as_little_endian():
    a = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]
    got, msgs = roundtrip("x", a)
    np.testing.assert_array_equal(got, a)
    assert msgs[0].sha256 == hashlib.sha256(np.ascontiguousarray(a, dtype="<f8").tobytes()).digest()


def test_unsupported_dtype_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="dtype"):
        list(wire.tensor_messages("x", np.zeros(3, dtype=np.complex64)))


def header(**kw):
    base = dict(name="p", dtype=tpb.DTYPE_FLOAT32, shape=[2, 3], nbytes=24, sha256=b"\0" * 32)
    base.update(kw)
    return tpb.TensorHeader(**base)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(dtype=0), "probe.dtype"),
        (dict(dtype=99), "probe.dtype"),
        (dict(dtype=tpb.DTYPE_INT64), "probe.dtype"),  # not in the allowed set
        (dict(shape=[2, -3], nbytes=24), "probe.shape"),
        (dict(nbytes=25), "probe.nbytes"),
        (dict(shape=[1 << 20, 1 << 12], nbytes=(1 << 34)), "probe.shape"),
        (dict(shape=[1 << 16, 1 << 10], nbytes=1 << 28), "probe.nbytes"),  # above max_bytes
        (dict(sha256=b"short"), "probe.sha256"),
        (dict(shape=[1] * 9, nbytes=4), "probe.shape"),
    ],
)
def test_bad_headers_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidArgument) as e:
        wire.TensorReceiver(header(**kw), "probe", allowed=(tpb.DTYPE_FLOAT32, tpb.DTYPE_FLOAT64), max_bytes=1 << 20)
    assert e.value.field == field


def test_chunks_oversize_overrun_truncated_and_corrupted_are_refused():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    h, *chunks = wire.tensor_messages("p", a)
    r = wire.TensorReceiver(h, "probe")
    with pytest.raises(InvalidArgument, match=r"chunk\.data.*exceeds"):
        r.add(tpb.TensorChunk(data=b"\0" * (wire.MAX_CHUNK_BYTES + 1)))
    with pytest.raises(InvalidArgument, match=r"chunk\.data.*overruns"):
        r.add(tpb.TensorChunk(data=b"\0" * 25))
    with pytest.raises(InvalidArgument, match=r"chunk\.data.*empty"):
        r.add(tpb.TensorChunk(data=b""))
    r.add(tpb.TensorChunk(data=chunks[0].data[:10]))
    with pytest.raises(InvalidArgument, match="truncated"):
        r.finish()
    bad = bytearray(chunks[0].data)
    bad[3] ^= 1
    r = wire.TensorReceiver(h, "probe")
    r.add(tpb.TensorChunk(data=bytes(bad)))
    with pytest.raises(InvalidArgument) as e:
        r.finish()
    assert e.value.field == "probe.sha256"


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    return init_identity(tmp_path_factory.mktemp("id"), "site-a")


def record(counterparty="site-b"):
    return ReleaseRecord(
        mechanism="laplace",
        level="model",
        unit="neuron",
        epsilon=1.0,
        delta=0.0,
        sensitivity=2.0,
        sensitivity_norm="l1",
        parameters={"scale": 2.0, "clip": [0, 1], "shape": [2, 2]},
        subject="m",
        counterparty=counterparty,
    )


def manifest_of(tensors, kind="weights", model="m", arch=None, meta=None, upstream=()):
    arch = {"kind": "mlp"} if arch is None else arch
    meta = {"k": 1} if meta is None else meta
    return wire.release_manifest(kind, model, arch or None, meta, tensors, upstream)


def test_receipts_bind_record_entry_tensor_digests_and_manifest(signer, tmp_path):
    tensors = [("a", np.ones((2, 2), np.float32)), ("b", np.arange(3.0))]
    rec = record()
    m = manifest_of(tensors)
    r = sign_receipt(signer, "17", rec, m)
    assert verify_receipt(r, signer.cert_pem, "site-a", manifest=m) == rec
    assert verify_receipt(SignedReceipt.from_json(r.to_json()), signer.cert_pem) == rec
    other = init_identity(tmp_path / "o", "site-o")
    digests = r.tensors
    for forged in (
        replace(r, ledger_entry_id="18"),
        replace(r, record_json=record("site-c").canonical_json()),
        replace(r, tensors=(digests[1], digests[0])),
        replace(r, manifest_sha256=bytes(32)),
    ):
        with pytest.raises(InvalidArgument, match=r"receipt\.signature"):
            verify_receipt(forged, signer.cert_pem)
    with pytest.raises(InvalidArgument, match=r"receipt\.signature"):
        verify_receipt(r, other.cert_pem)
    with pytest.raises(InvalidArgument, match=r"receipt\.signer"):
        verify_receipt(r, signer.cert_pem, expected_signer="site-o")
    # every part of the manifest is signed: another kind, model, architecture or metadata text,
    # dtype, shape, or another upstream receipt is refused
    for other_manifest in (
        manifest_of(tensors, kind="merged"),
        manifest_of(tensors, model="n"),
        manifest_of(tensors, arch={"kind": "cnn"}),
        manifest_of(tensors, meta={"k": 2}),
        manifest_of([("a", np.ones((4,), np.float32)), tensors[1]]),
        manifest_of(tensors, upstream=(r,)),
    ):
        with pytest.raises(InvalidArgument, match="manifest"):
            verify_receipt(r, signer.cert_pem, manifest=other_manifest)
    retyped = replace(m, tensors=(replace(m.tensors[0], dtype=tpb.DTYPE_INT32), *m.tensors[1:]))
    with pytest.raises(InvalidArgument, match=r"^manifest: "):
        verify_receipt(r, signer.cert_pem, manifest=retyped)


def test_signed_bytes_follow_the_documented_layout(signer):
    """The layout of docs/wire.md, written out by hand for one release (an independent
    reimplementation lives in tests/test_independent_client.py)."""
    import struct

    def s(x: str) -> bytes:
        return struct.pack(">I", len(x.encode())) + x.encode()

    def b(x: bytes) -> bytes:
        return struct.pack(">I", len(x)) + x

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    sha = hashlib.sha256(a.astype("<f4").tobytes()).digest()
    m = manifest_of([("w", a)], arch={}, meta={})
    want_m = (
        b"privfusion.v1/manifest/2\n"
        + s("weights")
        + s("m")
        + s("")
        + s("{}")
        + struct.pack(">I", 1)
        + s("w")
        + struct.pack(">II", 1, 2)
        + struct.pack(">QQ", 2, 3)
        + struct.pack(">Q", 24)
        + b(sha)
        + struct.pack(">Q", 24)
        + struct.pack(">I", 0)
    )
    assert m.to_bytes() == want_m
    r = sign_receipt(signer, "5", record(), m)
    want_p = (
        b"privfusion.v1/receipt/2\n"
        + s("site-a")
        + s("5")
        + b(r.record_json)
        + struct.pack(">I", 1)
        + s("w")
        + b(sha)
        + b(hashlib.sha256(want_m).digest())
    )
    assert r.payload() == want_p and r.manifest_sha256 == hashlib.sha256(want_m).digest()


def frames_of(signer, tensors, chunk_bytes=wire.MAX_CHUNK_BYTES, decode=pb.ReleaseFrame.FromString):
    """The frames as a receiver decodes them from the wire bytes."""
    r = sign_receipt(signer, "1", record(), manifest_of(tensors))
    return [
        decode(wire.serialize_frame(f))
        for f in wire.release_frames(r, "weights", "m", {"kind": "mlp"}, {"k": 1}, tensors, chunk_bytes=chunk_bytes)
    ]


@pytest.mark.parametrize("decode", [pb.ReleaseFrame.FromString, wire.decode_frame])
def test_release_stream_roundtrip_and_receipt_comes_first(signer, decode):
    tensors = [("w", np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)), ("b", np.zeros(0))]
    frames = frames_of(signer, tensors, chunk_bytes=16, decode=decode)
    seen = []
    rel = wire.ReleaseReader(on_receipt=lambda r: seen.append(r)).read(iter(frames))
    assert len(seen) == 1 and frames[0].WhichOneof("frame") == "receipt"
    assert rel.kind == "weights" and rel.model == "m" and rel.metadata == {"k": 1}
    np.testing.assert_array_equal(rel.arrays["w"], tensors[0][1])
    assert rel.arrays["b"].shape == (0,)
    assert rel.total_bytes == tensors[0][1].nbytes


def test_release_reader_refuses_reordered_truncated_or_swapped_streams(signer):
    tensors = [("w", np.arange(40, dtype=np.float32)), ("v", np.arange(3, dtype=np.int64))]
    frames = frames_of(signer, tensors, chunk_bytes=32)
    reader = wire.ReleaseReader()
    with pytest.raises(InvalidArgument, match="start with its receipt"):
        reader.read(iter(frames[1:]))
    with pytest.raises(InvalidArgument, match="truncated"):
        reader.read(iter(frames[:-1]))
    with pytest.raises(InvalidArgument, match="truncated"):
        reader.read(iter(frames[:4]))
    # a tensor whose bytes were swapped for other bytes of the same length: header checksum fails
    bad = [pb.ReleaseFrame() for _ in frames]
    for i, f in enumerate(frames):
        bad[i].CopyFrom(f)
    bad[3].chunk.data = bytes(32)
    with pytest.raises(InvalidArgument, match="sha256"):
        reader.read(iter(bad))
    # a header that does not match what the receipt signed
    bad = [pb.ReleaseFrame() for _ in frames]
    for i, f in enumerate(frames):
        bad[i].CopyFrom(f)
    bad[2].tensor.name = "x"
    with pytest.raises(InvalidArgument, match="manifest"):
        reader.read(iter(bad))
    # a manifest that announces other tensors than the receipt signed
    bad = [pb.ReleaseFrame() for _ in frames]
    for i, f in enumerate(frames):
        bad[i].CopyFrom(f)
    bad[1].manifest.tensors[0].sha256 = bytes(32)
    with pytest.raises(InvalidArgument, match="receipt"):
        reader.read(iter(bad))
    with pytest.raises(InvalidArgument, match="total_bytes"):
        wire.ReleaseReader(max_bytes=100).read(iter(frames))
    # a manifest edited anywhere the receipt's manifest digest covers: refused before any tensor
    for edit in (
        lambda m: setattr(m, "metadata_json", '{"k": 2}'),
        lambda m: setattr(m, "kind", "merged"),
        lambda m: setattr(m, "architecture_json", '{"kind": "cnn"}'),
        lambda m: (m.tensors[0].shape.__setitem__(0, 20), m.tensors[0].shape.append(2)),
    ):
        bad = [pb.ReleaseFrame() for _ in frames]
        for i, f in enumerate(frames):
            bad[i].CopyFrom(f)
        edit(bad[1].manifest)
        bad[2].tensor.CopyFrom(bad[1].manifest.tensors[0])
        sink = wire.ArraySink()
        with pytest.raises(InvalidArgument) as e:
            wire.ReleaseReader(sink=sink).read(iter(bad))
        assert e.value.field == "manifest" and not getattr(sink, "arrays", None)
    # nothing may follow the end frame (the reader reads on to the stream's end to see)
    with pytest.raises(InvalidArgument, match="after ReleaseEnd"):
        reader.read(iter([*frames, frames[2]]))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300) | st.integers(1, 1 << 21).map(lambda n: bytes(n)))
def test_chunk_frames_are_encoded_exactly_as_protobuf_does_and_decoded_without_copy(data):
    ours = wire.encode_chunk_frame(memoryview(data))
    assert ours == pb.ReleaseFrame(chunk=tpb.TensorChunk(data=data)).SerializeToString()
    frame = wire.decode_frame(ours)
    assert (
        isinstance(frame, wire.ChunkFrame) and frame.WhichOneof("frame") == "chunk" and bytes(frame.chunk.data) == data
    )


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_decode_frame_agrees_with_protobuf_on_any_bytes(raw):
    try:
        want = pb.ReleaseFrame.FromString(raw)
    except Exception as refused:  # protobuf refuses these bytes: ours must, the same way
        with pytest.raises(type(refused)):
            wire.decode_frame(raw)
        return
    got = wire.decode_frame(raw)
    if isinstance(got, wire.ChunkFrame):
        assert want.WhichOneof("frame") == "chunk" and bytes(got.data) == want.chunk.data
    else:
        assert got == want


def test_other_frames_and_empty_chunks_go_through_protobuf():
    for f in (
        pb.ReleaseFrame(end=pb.ReleaseEnd(tensor_count=1, total_bytes=4)),
        pb.ReleaseFrame(chunk=tpb.TensorChunk()),
        pb.ReleaseFrame(tensor=tpb.TensorHeader(name="x", shape=[2])),
    ):
        got = wire.decode_frame(f.SerializeToString())
        assert isinstance(got, pb.ReleaseFrame) and got == f


def test_releases_stream_straight_into_a_safetensors_file(signer, tmp_path):
    from safetensors import safe_open

    tensors = [
        ("w", np.random.default_rng(1).normal(size=(33, 7)).astype(np.float32)),
        ("e", np.zeros((0, 3))),
        ("i", np.arange(5, dtype=np.int64)),
    ]
    frames = frames_of(signer, tensors, chunk_bytes=100, decode=wire.decode_frame)
    rel = wire.ReleaseReader(sink=wire.SafetensorsSink(tmp_path / "r.safetensors")).read(iter(frames))
    assert rel.arrays == {} and rel.path == tmp_path / "r.safetensors" and rel.total_bytes == 33 * 7 * 4 + 40
    with safe_open(str(rel.path), framework="numpy") as f:
        assert f.metadata()["privfusion_ledger_entry"] == "1"
        for name, a in tensors:
            np.testing.assert_array_equal(f.get_tensor(name), a)
    # a stream that breaks off leaves no file, not even a temporary one
    with pytest.raises(InvalidArgument, match="truncated"):
        wire.ReleaseReader(sink=wire.SafetensorsSink(tmp_path / "cut.safetensors")).read(iter(frames[:-2]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.safetensors"]


def test_a_receipt_signs_the_ledger_position_it_carries(signer):
    """docs/wire.md 6.3, "The ledger's position": with ``ledger_seq`` and ``ledger_head`` set the
    payload is the "/3" context, the "/2" fields, then U64(seq) BYTES(head) (written out by
    hand here); an edit of either, or stripping both, breaks the signature; exactly one set is
    refused by name; a receipt without them (as the previous version wrote it) still verifies
    under "/2", from its JSON document too, and a served-again one under its own "/2"."""
    import struct

    tensors = [("w", np.arange(6, dtype=np.float32).reshape(2, 3))]
    m = manifest_of(tensors)
    head = hashlib.sha256(b"a chain head").digest()
    rec = record()
    old = sign_receipt(signer, "5", rec, m)
    new = sign_receipt(signer, "5", rec, m, ledger_seq=5, ledger_head=head)
    assert new.payload() == b"privfusion.v1/receipt/3\n" + old.payload()[len(b"privfusion.v1/receipt/2\n") :] + (
        struct.pack(">Q", 5) + struct.pack(">I", 32) + head
    )
    assert verify_receipt(new, signer.cert_pem, "site-a", manifest=m) == rec
    for forged in (
        replace(new, ledger_seq=4),
        replace(new, ledger_head=bytes(32)),
        replace(new, ledger_seq=0, ledger_head=b""),
        replace(old, ledger_seq=5, ledger_head=head),
    ):
        with pytest.raises(InvalidArgument, match=r"receipt\.signature"):
            verify_receipt(forged, signer.cert_pem)
    for half in (replace(new, ledger_seq=0), replace(new, ledger_head=b""), replace(new, ledger_head=head[:31])):
        with pytest.raises(InvalidArgument, match=r"receipt\.ledger_"):
            verify_receipt(half, signer.cert_pem)
    # the previous version's receipt document: no position keys, verifies as it did
    doc = json.loads(old.to_json())
    assert "ledger_seq" not in doc and "ledger_head" not in doc
    assert verify_receipt(SignedReceipt.from_json(doc), signer.cert_pem, "site-a", manifest=m) == rec
    # the new fields survive JSON and protobuf
    assert SignedReceipt.from_json(new.to_json()) == new
    assert wire.receipt_from_proto(pb.Receipt.FromString(wire.receipt_to_proto(new).SerializeToString())) == new
    again = sign_receipt(signer, "5", rec, m, "3", "site-c", ledger_seq=9, ledger_head=head)
    assert again.payload().startswith(b"privfusion.v1/receipt-served-again/2\n")
    assert again.payload().endswith(struct.pack(">Q", 9) + struct.pack(">I", 32) + head)
    assert verify_receipt(again, signer.cert_pem) == rec
