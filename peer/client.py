"""The client side of privfusion.v1: ask a pinned peer for a release and check what comes back.

A :class:`PeerClient` dials one peer with mutual TLS: it presents this site's certificate and
trusts exactly the peer's pinned certificate (``root_certificates`` = that one certificate,
``ssl_target_name_override`` = the peer's site name, a DNS SAN of its certificate), so the
connection fails unless the server holds the pinned key, whatever address it was dialled at.

Every release is checked as it streams (:class:`peer.wire.ReleaseReader`): the receipt's
signature against the pinned certificate before any tensor is accepted, each tensor's
checksum against both its header and the signed receipt, the stream's order and totals, and
that the record names this site as the counterparty. gRPC failures become :class:`PeerError`
with the peer's status and a message that says what to do.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import grpc
import numpy as np

from coordinator_free.identity import Identity
from coordinator_free.trust import PinnedPeer, TrustStore
from peer import wire
from peer.errors import InvalidArgument, NotFound, PrivFusionError
from peer.receipts import SignedReceipt, verify_receipt
from peer.records import ReleaseRecord
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger("privfusion.client")

RELEASE_TIMEOUT_S = 1800.0
INFO_TIMEOUT_S = 30.0


class PeerError(PrivFusionError):
    """A peer refused or failed a call; ``status`` is the gRPC status name it ended with."""

    def __init__(self, status: str, message: str, details: str = ""):
        self.status = status
        self.details = details
        super().__init__(message)


# What each status means for the person asking (UNAVAILABLE is told apart below).
_MESSAGES = {
    "RESOURCE_EXHAUSTED": "{peer!r} refused: privacy budget exhausted; nothing was released ({details})",
    "PERMISSION_DENIED": "{peer!r} refused: not permitted ({details})",
    "UNAUTHENTICATED": "{peer!r} does not recognise this site's certificate ({details}); ask it to pin yours "
                       "(`privfusion peer trust add`)",
    "INVALID_ARGUMENT": "{peer!r} rejected the request: {details}",
    "NOT_FOUND": "{peer!r} has no such thing: {details}",
    "FAILED_PRECONDITION": "{peer!r} cannot serve this now: {details}",
    "DEADLINE_EXCEEDED": "{peer!r} did not answer in time ({details})",
    "CANCELLED": "the call to {peer!r} was cancelled ({details})",
}


def explain(error: grpc.RpcError, peer: str, address: str) -> PeerError:
    """A clear message for each way a call can fail (status kept for callers to branch on)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        handshake = any(s in low for s in ("socket closed", "handshake", "ssl", "certificate", "tsi"))
        if "connection refused" in low or not handshake:
            msg = f"peer {peer!r} at {address} is down or unreachable (no connection: {details})"
        else:
            msg = (f"peer {peer!r} at {address} closed the connection during the TLS handshake: it does not accept this "
                   f"site's certificate (not pinned there, or expired), or it is not the {peer!r} you pinned ({details})")
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent rpc limit" in details.lower():
        msg = f"{peer!r} is busy (too many calls at once); nothing was charged, try again ({details})"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details.lower():
        msg = f"a message to or from {peer!r} exceeded gRPC's size limit ({details})"
    else:
        msg = _MESSAGES.get(name, "{peer!r} failed with {name}: {details}").format(peer=peer, name=name, details=details)
    return PeerError(name, msg, details)


def _host_of(address: str) -> str:
    """The host part of HOST:PORT (IPv6 in brackets)."""
    if address.startswith("[") and "]" in address:
        return address[1:address.index("]")]
    return address.rsplit(":", 1)[0]


def resolve_peer(trust: TrustStore, address: str, peer: str | None) -> PinnedPeer:
    """The pinned certificate to expect at ``address``: ``peer``'s, or the one pinned peer
    whose certificate names that host (IP or DNS SAN)."""
    if peer:
        return trust.get(peer)
    from cryptography import x509

    host = _host_of(address)
    try:
        want: Any = ipaddress.ip_address(host)
    except ValueError:
        want = host.lower()
    matches = []
    for p in trust.peers().values():
        sans = x509.load_pem_x509_certificate(p.cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(n).lower() for n in sans.get_values_for_type(x509.DNSName)] + list(sans.get_values_for_type(x509.IPAddress))
        if want in names:
            matches.append(p)
    if len(matches) != 1:
        found = ", ".join(m.name for m in matches) or "none"
        raise NotFound(f"cannot tell which pinned peer serves {address} (pinned certificates naming {host!r}: {found}); give --peer NAME")
    return matches[0]


class PeerClient:
    """A mutually authenticated connection to one pinned peer."""

    def __init__(self, identity: Identity, address: str, peer: str | None = None, insecure: bool = False,
                 trust: TrustStore | None = None, max_release_bytes: int = wire.MAX_RELEASE_BYTES,
                 on_receipt: Callable[[SignedReceipt], None] | None = None):
        """``on_receipt`` is called with each verified receipt as soon as it arrives, before any
        tensor byte (the peer has charged its ledger by then, whatever happens next)."""
        self.identity = identity
        self.on_receipt = on_receipt
        self.address = address
        self.trust = trust or TrustStore(identity.trust_dir)
        self.insecure = insecure
        self.max_release_bytes = max_release_bytes
        if insecure:
            if not peer:
                raise InvalidArgument("peer", "is required with --insecure (there is no certificate to tell who answers)")
            log.warning("INSECURE: talking to %s at %s without TLS; anyone on the path can read and alter everything", peer, address)
            self.peer_name = peer
            pinned = self.trust.peers().get(peer)
            self.peer_cert = pinned.cert_pem if pinned else None
            self.channel = grpc.insecure_channel(address, options=wire.grpc_options())
        else:
            pinned = resolve_peer(self.trust, address, peer)
            self.peer_name = pinned.name
            self.peer_cert = pinned.cert_pem
            # while the peer rotates its certificate both pins are accepted (TLS and receipts)
            self._next_certs = [p.cert_pem for p in self.trust.pins_of(pinned.name)[1:]]
            creds = grpc.ssl_channel_credentials(root_certificates=b"".join([pinned.cert_pem, *self._next_certs]),
                                                 private_key=identity.key_pem,
                                                 certificate_chain=identity.cert_pem)
            self.channel = grpc.secure_channel(address, creds, options=wire.grpc_options() + [
                ("grpc.ssl_target_name_override", pinned.name)])
        self.stub = pb_grpc.PeerStub(self.channel)
        # release streams decode chunk frames without copying them (peer.wire.decode_frame)
        self._release = {
            "ReleaseFeatures": self._release_call(self.channel.stream_stream, "ReleaseFeatures", pb.FeaturesRequest),
            "ReleaseWeights": self._release_call(self.channel.unary_stream, "ReleaseWeights", pb.WeightsRequest),
            "ReleaseMerged": self._release_call(self.channel.unary_stream, "ReleaseMerged", pb.MergeRequest),
            "Fuse": self._release_call(self.channel.unary_stream, "Fuse", pb.FuseRequest),
        }

    @staticmethod
    def _release_call(make, name: str, request_type):
        return make(f"/privfusion.v1.Peer/{name}", request_serializer=request_type.SerializeToString,
                    response_deserializer=wire.decode_frame)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def header(self) -> pb.RequestHeader:
        return pb.RequestHeader(sender=self.identity.name, receiver=self.peer_name)

    # ------------------------------------------------------------------ checks

    def _check_receipt(self, receipt: SignedReceipt) -> None:
        if self.peer_cert is None:
            raise InvalidArgument("receipt.signature", f"cannot be checked: {self.peer_name!r} is not pinned")
        record = _verify_with_any(receipt, [self.peer_cert, *getattr(self, "_next_certs", [])], self.peer_name)
        if record.counterparty != self.identity.name:
            raise InvalidArgument("receipt.record.counterparty", f"is {record.counterparty!r}, not this site ({self.identity.name!r})")
        if self.on_receipt is not None:
            self.on_receipt(receipt)

    def _read(self, call, expected_kind: str, model: str, out: str | os.PathLike | None = None) -> wire.Release:
        if out is None:
            sink = wire.ArraySink()
        elif hasattr(out, "writer"):  # a sink of one's own (peer.wire's sink protocol)
            sink = out
        else:
            sink = wire.SafetensorsSink(release_paths(out)[0])
        try:
            release = wire.ReleaseReader(self.max_release_bytes, on_receipt=self._check_receipt, sink=sink).read(call)
        except grpc.RpcError as e:
            raise explain(e, self.peer_name, self.address) from None
        except InvalidArgument:
            call.cancel()
            raise
        if release.kind != expected_kind or release.model != model:
            raise InvalidArgument("manifest", f"announces a {release.kind!r} release of {release.model!r}, asked for {expected_kind!r} of {model!r}")
        if release.receipt.record.subject != model:
            raise InvalidArgument("receipt.record.subject", f"is {release.receipt.record.subject!r}, asked for {model!r}")
        return release

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise explain(e, self.peer_name, self.address) from None

    # ------------------------------------------------------------------ calls

    def info(self, timeout: float = INFO_TIMEOUT_S) -> pb.PeerInfo:
        return self._unary(self.stub.GetPeerInfo, pb.GetPeerInfoRequest(header=self.header()), timeout)

    # Every release call takes ``out``: None keeps the tensors in memory (Release.arrays); a
    # path streams them straight into OUT.safetensors as they arrive (Release.path) — for
    # releases larger than memory should hold; write the JSON beside with save_release. An
    # object with the sink methods of peer.wire (start, writer, done, finish, abort) is used as is.

    def features(self, model: str, probe: np.ndarray, *, activation_epsilon: float, weight_epsilon: float,
                 unit: str = "neuron", activation_clip: tuple[float, float] | None = None,
                 weight_bound: float | None = None, timeout: float = RELEASE_TIMEOUT_S, out=None) -> wire.Release:
        """Noisy graph features of ``model`` on our ``probe`` set (streamed to the peer)."""
        params = pb.FeaturesParams(header=self.header(), model=model, activation_epsilon=activation_epsilon,
                                   weight_epsilon=weight_epsilon, unit=unit)
        if activation_clip is not None:
            params.activation_clip_low, params.activation_clip_high = float(activation_clip[0]), float(activation_clip[1])
        if weight_bound is not None:
            params.weight_bound = float(weight_bound)
        probe = np.ascontiguousarray(probe)
        if probe.dtype not in (np.float32, np.float64):
            probe = probe.astype(np.float64)

        def requests() -> Iterator[pb.FeaturesRequest]:
            yield pb.FeaturesRequest(params=params)
            for m in wire.tensor_messages("probe", probe):
                yield pb.FeaturesRequest(probe=m) if m.DESCRIPTOR.name == "TensorHeader" else pb.FeaturesRequest(chunk=m)

        return self._read(self._release["ReleaseFeatures"](requests(), timeout=timeout), "features", model, out)

    def weights(self, model: str, *, epsilon: float, delta: float,
                permutations: Mapping[str, np.ndarray] | None = None, timeout: float = RELEASE_TIMEOUT_S, out=None) -> wire.Release:
        """PFA-perturbed weights of ``model``; with ``permutations`` (hidden layer name → index
        array, index[i] = j: our node i is their node j) aligned to our model."""
        perms = [pb.Permutation(layer=k, index=np.asarray(v, dtype=np.int64).tolist()) for k, v in (permutations or {}).items()]
        req = pb.WeightsRequest(header=self.header(), model=model, epsilon=epsilon, delta=delta, permutations=perms)
        return self._read(self._release["ReleaseWeights"](req, timeout=timeout), "weights", model, out)

    def merged(self, pool: str, *, method: str, epsilon: float, delta: float,
               timeout: float = RELEASE_TIMEOUT_S, out=None) -> wire.Release:
        """A model merged from ``pool`` by RS or LC at the target (ε, δ)."""
        req = pb.MergeRequest(header=self.header(), pool=pool, method=method, epsilon=epsilon, delta=delta)
        return self._read(self._release["ReleaseMerged"](req, timeout=timeout), "merged", pool, out)

    def fuse(self, model: str, *, partner: str, partner_model: str, alpha: float, activation_epsilon: float,
             weight_epsilon: float, weights_epsilon: float, weights_delta: float,
             timeout: float = RELEASE_TIMEOUT_S, out=None) -> wire.Release:
        """The peer's ``model`` fused with ``partner``'s ``partner_model`` (the peer dials the partner)."""
        req = pb.FuseRequest(header=self.header(), model=model, partner=partner, partner_model=partner_model, alpha=alpha,
                             activation_epsilon=activation_epsilon, weight_epsilon=weight_epsilon,
                             weights_epsilon=weights_epsilon, weights_delta=weights_delta)
        return self._read(self._release["Fuse"](req, timeout=timeout), "fused", model, out)

    def ledger(self, timeout: float = INFO_TIMEOUT_S) -> list[tuple[str, ReleaseRecord, str]]:
        """The peer's ledger entries charged to this site: (entry id, record, created at)."""
        try:
            return [(e.entry_id, ReleaseRecord.from_json(e.record_json), e.created_at)
                    for e in self.stub.ListLedger(pb.LedgerRequest(header=self.header()), timeout=timeout)]
        except grpc.RpcError as e:
            raise explain(e, self.peer_name, self.address) from None


# ---------------------------------------------------------------------- saving releases


def _verify_with_any(receipt: SignedReceipt, certs: list[bytes], signer: str | None):
    """The receipt's record if one of the signer's pins (current, then next) verifies it."""
    for cert in certs[1:]:
        try:
            return verify_receipt(receipt, cert, expected_signer=signer)
        except InvalidArgument:
            continue
    return verify_receipt(receipt, certs[0], expected_signer=signer)


def verify_upstream(release: wire.Release, trust: TrustStore) -> list[dict]:
    """Check the receipts a release is built on against our own pins, where we have them."""
    out = []
    for r in release.upstream:
        pinned = trust.peers().get(r.signer)
        if pinned is None:
            out.append({"signer": r.signer, "ledger_entry_id": r.ledger_entry_id, "verified": False,
                        "reason": f"{r.signer!r} is not pinned here"})
            continue
        _verify_with_any(r, [p.cert_pem for p in trust.pins_of(r.signer)], None)
        out.append({"signer": r.signer, "ledger_entry_id": r.ledger_entry_id, "verified": True})
    return out


def release_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """OUT.safetensors and OUT.json for an output path given with or without the suffix."""
    p = Path(path)
    if p.suffix == ".safetensors":
        p = p.with_suffix("")
    return p.with_name(p.name + ".safetensors"), p.with_name(p.name + ".json")


def save_release(release: wire.Release, path: str | os.PathLike, upstream_checks: list[dict] | None = None) -> tuple[Path, Path]:
    """Write ``PATH.safetensors`` (unless the release was streamed there) and the release
    document ``PATH.json`` beside it.

    The JSON is a model-store manifest (format 1: name, architecture, metadata) whose metadata
    holds the release record, the signed receipt (checkable offline with the signer's
    certificate) and the receipts it is built on, so a released model loads with
    ``peer.store.load_model``. Both files are written atomically.
    """
    tensors_path, doc_path = release_paths(path)
    tensors_path.parent.mkdir(parents=True, exist_ok=True)
    if release.path is None:
        sink = wire.SafetensorsSink(tensors_path)
        sink.start([wire.TensorSpec(n, a.dtype.newbyteorder("<"), a.shape, a.nbytes, d)
                    for (n, a), (_, d) in zip(release.arrays.items(), release.receipt.tensors)],
                   {"privfusion_signer": release.receipt.signer, "privfusion_ledger_entry": release.receipt.ledger_entry_id,
                    "privfusion_release": release.receipt.record.release_id})
        try:
            for i, a in enumerate(release.arrays.values()):
                sink.writer(i)(0, wire.raw_bytes(a))
            sink.finish()
        except BaseException:
            sink.abort()
            raise
    elif Path(release.path) != tensors_path:
        os.replace(release.path, tensors_path)
    doc = {
        "format": 1,
        "name": tensors_path.name[: -len(".safetensors")],
        "architecture": release.architecture,
        "metadata": {
            "release": {"kind": release.kind, "model": release.model, "signer": release.receipt.signer,
                        "ledger_entry_id": release.receipt.ledger_entry_id, "metadata": release.metadata},
            "record": release.receipt.record.to_dict(),
            "receipt": json.loads(release.receipt.to_json()),
            "upstream": [json.loads(u.to_json()) for u in release.upstream],
            "upstream_checks": upstream_checks or [],
        },
    }
    tmp_doc = doc_path.with_name(f".{doc_path.name}.tmp")
    with open(tmp_doc, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_doc, doc_path)
    return tensors_path, doc_path
