"""A privfusion.v1 client written from the .proto files and docs/wire.md alone.

Run by tests/test_independent_client.py in its own process, whose import path holds nothing of
the project: the stubs are generated here by protoc (grpcio-tools) from proto/privfusion/v1/*.proto,
signatures are checked with ``cryptography``, tensors are reassembled with ``numpy``. It asks a
real daemon for a features, a weights and a merged release over mutual TLS, reassembles every
tensor from its frames (docs/wire.md sections 2, 4, 5), then verifies each release *offline* from
what it kept (receipt, manifest, tensor bytes) and the pinned certificate (section 6), and
writes what it found as JSON.

    python independent_client.py CONFIG.json OUT.json
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from itertools import pairwise
from pathlib import Path

PROJECT_MODULES = ("peer", "coordinator_free", "scenarios")


def generate_stubs(proto_root: Path, out: Path) -> None:
    """protoc over the contract's .proto files into ``out`` (docs: generated, never copied)."""
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "privfusion" / "v1").glob("*.proto"))
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_root}",
            f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *files,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed: {rc}")
    for d in (out / "privfusion", out / "privfusion" / "v1"):
        (d / "__init__.py").touch()
    sys.path.insert(0, str(out))


# ------------------------------------------------------------------ docs/wire.md section 6


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def blob(b: bytes) -> bytes:
    return u32(len(b)) + bytes(b)


def text(s: str) -> bytes:
    return blob(s.encode("utf-8"))


def digest32(b: bytes) -> bytes:
    if len(b) != 32:
        raise ValueError(f"a digest must be 32 bytes, got {len(b)}")
    return blob(b)


def receipt_payload(r) -> bytes:
    # docs/wire.md 6.3: a release served again is signed under its own context, with its two
    # fields after the fresh layout's; a receipt with the ledger's position (ledger_seq and
    # ledger_head, both or neither) under the "/3" (served again: "/2") context, with the two last
    positioned = bool(r.ledger_seq) or bool(r.ledger_head)
    if positioned and not (r.ledger_seq >= 1 and len(r.ledger_head) == 32):
        raise ValueError("receipt.ledger_seq/ledger_head: set together, a 32-byte head")
    if r.served_again:
        context = b"privfusion.v1/receipt-served-again/2\n" if positioned else b"privfusion.v1/receipt-served-again/1\n"
    else:
        context = b"privfusion.v1/receipt/3\n" if positioned else b"privfusion.v1/receipt/2\n"
    out = context + text(r.signer) + text(r.ledger_entry_id) + blob(r.record_json) + u32(len(r.tensors))
    for t in r.tensors:
        out += text(t.name) + digest32(t.sha256)
    out += digest32(r.manifest_sha256)
    if r.served_again:
        out += text(r.served_again) + text(r.served_to)
    if positioned:
        out += u64(r.ledger_seq) + digest32(r.ledger_head)
    return out


def manifest_bytes(m) -> bytes:
    out = (
        b"privfusion.v1/manifest/2\n"
        + text(m.kind)
        + text(m.model)
        + text(m.architecture_json)
        + text(m.metadata_json)
        + u32(len(m.tensors))
    )
    for t in m.tensors:
        out += text(t.name) + u32(t.dtype) + u32(len(t.shape)) + b"".join(u64(d) for d in t.shape)
        out += u64(t.nbytes) + digest32(t.sha256)
    out += u64(m.total_bytes) + u32(len(m.upstream))
    return out + b"".join(digest32(hashlib.sha256(receipt_payload(u)).digest()) for u in m.upstream)


def verify_offline(receipt, manifest, tensors: dict[str, bytes], cert_pem: bytes, signer: str, me: str) -> dict:
    """Everything section 4 and 6 ask of a release, from kept bytes and the pinned certificate."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    if receipt.signer != signer or receipt.signature_algorithm != "ecdsa-p256-sha256":
        raise ValueError("receipt: wrong signer or algorithm")
    key = x509.load_pem_x509_certificate(cert_pem).public_key()
    try:
        key.verify(receipt.signature, receipt_payload(receipt), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ValueError("receipt.signature: does not verify") from None
    if hashlib.sha256(manifest_bytes(manifest)).digest() != receipt.manifest_sha256:
        raise ValueError("manifest: not the signed one")
    if [(t.name, t.sha256) for t in manifest.tensors] != [(t.name, t.sha256) for t in receipt.tensors]:
        raise ValueError("manifest.tensors: not the receipt's")
    itemsize = {1: 4, 2: 8, 3: 4, 4: 8}
    for t in manifest.tensors:
        raw = tensors[t.name]
        if len(raw) != t.nbytes or t.nbytes != math.prod(t.shape) * itemsize[t.dtype]:
            raise ValueError(f"tensor {t.name}: size")
        if hashlib.sha256(raw).digest() != t.sha256:
            raise ValueError(f"tensor {t.name}: sha256")
    if manifest.total_bytes != sum(t.nbytes for t in manifest.tensors):
        raise ValueError("manifest.total_bytes")
    record = json.loads(receipt.record_json)
    if receipt.served_again:
        if receipt.served_to != me:
            raise ValueError("receipt.served_to: not this site")
    elif record["counterparty"] != me:
        raise ValueError("record.counterparty: not this site")
    return record


# ------------------------------------------------------------------ talking to the daemon


class Client:
    def __init__(self, cfg: dict):
        import grpc

        from privfusion.v1 import peer_pb2, peer_pb2_grpc

        self.pb = peer_pb2
        self.cfg = cfg
        self.peer_cert = Path(cfg["peer_cert"]).read_bytes()
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.peer_cert,
            private_key=Path(cfg["key"]).read_bytes(),
            certificate_chain=Path(cfg["cert"]).read_bytes(),
        )
        self.channel = grpc.secure_channel(
            cfg["address"],
            creds,
            options=[
                ("grpc.ssl_target_name_override", cfg["peer"]),
                ("grpc.max_receive_message_length", 16 << 20),
                ("grpc.max_send_message_length", 16 << 20),
            ],
        )
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def header(self):
        return self.pb.RequestHeader(sender=self.cfg["me"], receiver=self.cfg["peer"])

    def read(self, frames) -> tuple:
        """Reassemble a release from its frames in the order of section 4."""
        frames = iter(frames)
        first = next(frames)
        assert first.WhichOneof("frame") == "receipt", "the receipt comes first"
        receipt = first.receipt
        second = next(frames)
        assert second.WhichOneof("frame") == "manifest", "then the manifest"
        manifest = second.manifest
        assert manifest.tensor_count == len(manifest.tensors) == len(receipt.tensors)
        tensors, chunks_seen, current, end = {}, 0, None, None
        for f in frames:
            which = f.WhichOneof("frame")
            assert end is None, "nothing follows ReleaseEnd"
            if which == "tensor":
                assert current is None or len(tensors[current.name]) == current.nbytes
                current = f.tensor
                assert current == manifest.tensors[len(tensors)], "headers repeat the manifest, in order"
                tensors[current.name] = bytearray()
            elif which == "chunk":
                assert 0 < len(f.chunk.data) <= 4 << 20
                tensors[current.name] += f.chunk.data
                chunks_seen += 1
            elif which == "end":
                end = f.end
            else:
                raise AssertionError(f"unexpected {which}")
        assert end is not None and end.tensor_count == len(tensors) and end.total_bytes == manifest.total_bytes
        return receipt, manifest, {k: bytes(v) for k, v in tensors.items()}, chunks_seen

    def features(self, model: str, probe, chunk: int):
        import numpy as np

        raw = np.ascontiguousarray(probe, dtype="<f8").tobytes()
        head = self.pb.FeaturesRequest(
            probe={
                "name": "probe",
                "dtype": 2,
                "shape": list(probe.shape),
                "nbytes": len(raw),
                "sha256": hashlib.sha256(raw).digest(),
            }
        )  # the WHOLE probe's digest

        def requests():
            yield self.pb.FeaturesRequest(
                params=self.pb.FeaturesParams(
                    header=self.header(),
                    model=model,
                    activation_epsilon=2.0,
                    weight_epsilon=2.0,
                    activation_clip_low=0.0,
                    activation_clip_high=4.0,
                )
            )
            yield head
            for i in range(0, len(raw), chunk):
                yield self.pb.FeaturesRequest(chunk={"data": raw[i : i + chunk]})

        return self.read(self.stub.ReleaseFeatures(requests(), timeout=120))

    def weights(self, model: str):
        return self.read(
            self.stub.ReleaseWeights(
                self.pb.WeightsRequest(header=self.header(), model=model, epsilon=2.0, delta=1e-5), timeout=120
            )
        )

    def merged(self, pool: str):
        return self.read(
            self.stub.ReleaseMerged(
                self.pb.MergeRequest(header=self.header(), pool=pool, method="rs", epsilon=8.0, delta=1e-5), timeout=120
            )
        )


def array(manifest, tensors: dict[str, bytes], name: str):
    import numpy as np

    t = next(t for t in manifest.tensors if t.name == name)
    dtype = {1: "<f4", 2: "<f8", 3: "<i4", 4: "<i8"}[t.dtype]
    return np.frombuffer(tensors[name], dtype=dtype).reshape(tuple(t.shape))


def main(config_path: str, out_path: str) -> int:
    import numpy as np

    cfg = json.loads(Path(config_path).read_text())
    generate_stubs(Path(cfg["proto_root"]), Path(cfg["stubs"]))
    from privfusion.v1 import peer_pb2

    c = Client(cfg)
    info = c.stub.GetPeerInfo(peer_pb2.GetPeerInfoRequest(header=c.header()), timeout=30)
    [model] = [m for m in info.models if m.name == cfg["model"]]
    layers = list(model.layers)
    probe = np.random.default_rng(0).random((7, json.loads(model.architecture_json)["input_dim"]))
    kept = {
        "features": c.features(model.name, probe, chunk=1000),
        "weights": c.weights(model.name),
        "merged": c.merged(cfg["pool"]),
        "merged_again": c.merged(cfg["pool"]),  # the same request: served again, not charged
    }
    c.channel.close()

    # ---- offline: only the kept bytes and the pinned certificate from here on
    out: dict = {"stubs": peer_pb2.__file__, "releases": {}}
    for kind, (receipt, manifest, tensors, chunks) in kept.items():
        record = verify_offline(receipt, manifest, tensors, c.peer_cert, cfg["peer"], cfg["me"])
        assert manifest.kind == kind.removesuffix("_again")
        out["releases"][kind] = {
            "entry": receipt.ledger_entry_id,
            "served_again": receipt.served_again,
            "ledger_seq": receipt.ledger_seq,
            "ledger_head": receipt.ledger_head.hex(),
            "tensors_sha256": hashlib.sha256(b"".join(tensors[t.name] for t in manifest.tensors)).hexdigest(),
            "release_id": record["release_id"],
            "epsilon": record["epsilon"],
            "level": record["level"],
            "chunks": chunks,
            "names": [t.name for t in manifest.tensors],
            "shapes": {t.name: list(t.shape) for t in manifest.tensors},
            "metadata": json.loads(manifest.metadata_json),
        }
        # a verifier that cannot fail proves nothing: each edit below must be refused
        refused = []
        for field, value in (
            ("metadata_json", manifest.metadata_json + " "),
            ("kind", "fused"),
            ("architecture_json", manifest.architecture_json.replace("10", "11")),
        ):
            edited = type(manifest)()
            edited.CopyFrom(manifest)
            setattr(edited, field, value)
            try:
                verify_offline(receipt, edited, tensors, c.peer_cert, cfg["peer"], cfg["me"])
            except ValueError:
                refused.append(field)
        edited = type(manifest)()
        edited.CopyFrom(manifest)
        edited.tensors[0].shape.append(1)
        try:
            verify_offline(receipt, edited, tensors, c.peer_cert, cfg["peer"], cfg["me"])
        except ValueError:
            refused.append("shape")
        flipped = dict(tensors)
        name = manifest.tensors[0].name
        flipped[name] = bytes([flipped[name][0] ^ 1]) + flipped[name][1:]
        try:
            verify_offline(receipt, manifest, flipped, c.peer_cert, cfg["peer"], cfg["me"])
        except ValueError:
            refused.append("bytes")
        # the ledger's position is signed: another head, another count, or the two stripped
        for field, value in (("ledger_head", bytes(32)), ("ledger_seq", receipt.ledger_seq + 1), ("strip", None)):
            edited = type(receipt)()
            edited.CopyFrom(receipt)
            if field == "strip":
                edited.ClearField("ledger_seq")
                edited.ClearField("ledger_head")
            else:
                setattr(edited, field, value)
            try:
                verify_offline(edited, manifest, tensors, c.peer_cert, cfg["peer"], cfg["me"])
            except ValueError:
                refused.append(field)
        out["releases"][kind]["refused_edits"] = refused

    # ---- the layouts of section 5, checked against PeerInfo's layers
    _, fm, ft, _ = kept["features"]
    meta = json.loads(fm.metadata_json)
    hidden = [layer for layer in layers if layer.hidden]
    assert [layer["name"] for layer in meta["layers"]] == [layer.name for layer in hidden]
    want = []
    for layer in hidden:
        want += [f"hidden.{layer.name}.activations", f"hidden.{layer.name}.incoming", f"hidden.{layer.name}.bias"]
    assert [t.name for t in fm.tensors] == [*want, "output.incoming", "output.bias"]
    n_prev = meta["input_size"]
    for layer in hidden:
        n = layer.weight_shape[0]
        assert array(fm, ft, f"hidden.{layer.name}.activations").shape == (n, probe.shape[0])
        incoming = array(fm, ft, f"hidden.{layer.name}.incoming")
        assert incoming.shape == (n, n_prev, 1) == (n, layer.weight_shape[1], 1)  # Linear -> Linear: e = 1
        assert array(fm, ft, f"hidden.{layer.name}.bias").shape == (n,)
        n_prev = n
    assert array(fm, ft, "output.incoming").shape == (layers[-1].weight_shape[0], n_prev, 1)
    _, wm, wt, _ = kept["weights"]
    names = [t.name for t in wm.tensors]
    assert names == sorted(names) == sorted(f"{layer.name}.{p}" for layer in layers for p in ("weight", "bias"))
    for layer in layers:
        assert array(wm, wt, f"{layer.name}.weight").shape == tuple(layer.weight_shape)
        assert array(wm, wt, f"{layer.name}.bias").shape == tuple(layer.bias_shape)
    _, mm, mt, _ = kept["merged"]
    arch = json.loads(mm.architecture_json)
    names = [t.name for t in mm.tensors]
    assert names == sorted(names) and arch["kind"] == "mlp"
    widths = [arch["input_dim"], *arch["hidden"], arch["output_dim"]]
    assert [array(mm, mt, n).shape for n in names if n.endswith(".weight")] == [(o, i) for i, o in pairwise(widths)]
    out["project_modules_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_MODULES)
    Path(out_path).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
