"""The client side of privfusion.v1: ask a pinned peer for a release and check what comes back.

A :class:`PeerClient` dials one peer with mutual TLS: it presents this site's certificate and
trusts exactly the peer's pinned certificate (``root_certificates`` = that one certificate,
``ssl_target_name_override`` = the peer's site name, a DNS SAN of its certificate), so the
connection fails unless the server holds the pinned key, whatever address it was dialled at.

Every release is checked as it streams (:class:`peer.net.wire.ReleaseReader`): the receipt's
signature against the pinned certificate before any tensor is accepted, each tensor's
checksum against both its header and the signed receipt, the stream's order and totals, and
that the record names this site as the counterparty. gRPC failures become :class:`PeerError`
with the peer's status and a message that says what to do.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from peer.base.errors import InvalidArgument, NotFound, PrivFusionError
from peer.net import secagg_wire, wire
from peer.net.identity import Identity, fingerprint
from peer.net.messages import ledger_entry_from_message, peer_info_from_message
from peer.net.peer_info import LedgerEntry, PeerInfo
from peer.net.receipts import Manifest, SignedReceipt, receipt_digest, verify_receipt
from peer.net.trust import PinnedPeer, TrustStore
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc
from privfusion.v1 import tensor_pb2 as tpb

__all__ = [
    "HEALTH_SERVICE",
    "CallBytes",
    "PeerClient",
    "PeerError",
    "load_saved_release",
    "own_daemon_health",
    "save_release",
    "verify_saved_release",
    "verify_upstream",
]

log = logging.getLogger("privfusion.client")

RELEASE_TIMEOUT_S = 1800.0
INFO_TIMEOUT_S = 30.0
#: the service whose health a peer reports (the standard gRPC health protocol)
HEALTH_SERVICE = "privfusion.v1.Peer"


def own_daemon_health(identity: Identity, address: str, timeout: float, insecure: bool = False) -> str | None:
    """Whether this site's own daemon at ``address`` serves: None when it answers the standard
    gRPC health check of :data:`HEALTH_SERVICE` with SERVING, else why not (one line: not
    listening, not SERVING, another key answering). The call is made over mutual TLS with the
    site's own key and trusts only the site's own certificate: the daemon accepts its own
    certificate at the handshake (it is never pinned, so every Peer call made with it is
    refused; only Health answers), and a daemon holding another key fails the handshake."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if insecure:
        channel = grpc.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(
            root_certificates=identity.cert_pem, private_key=identity.key_pem, certificate_chain=identity.cert_pem
        )
        channel = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", identity.name)])
    try:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout
            )
    except grpc.RpcError as e:
        code = e.code().name if e.code() else "UNKNOWN"
        if code == "DEADLINE_EXCEEDED":
            return f"{code}: no answer within {timeout:g} s (not listening there, or not with this site's key)"
        return f"{code}: {e.details() or 'no details'}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{HEALTH_SERVICE} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


class PeerError(PrivFusionError):
    """A peer refused or failed a call; ``status`` is the gRPC status name it ended with,
    ``details`` the peer's message. The refusal's structured details, when the peer sent them
    (``google.rpc.Status`` in the trailers): ``violations`` — (field, rule) pairs of a
    ``BadRequest``, ``field`` the first of those fields (or None); ``reason`` and ``metadata``
    — an ``ErrorInfo``'s (e.g. ``BUDGET_EXHAUSTED`` with the ε spent and remaining, or
    ``TARGET_UNREACHABLE`` with the pool's reachable ε range)."""

    def __init__(
        self,
        status: str,
        message: str,
        details: str = "",
        *,
        violations: tuple[tuple[str, str], ...] = (),
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
    ):
        self.status = status
        self.details = details
        self._violations = tuple(violations)
        super().__init__(message, reason=reason, metadata=metadata)

    @property
    def violations(self) -> tuple[tuple[str, str], ...]:
        return self._violations

    @property
    def field(self) -> str | None:
        return self._violations[0][0] if self._violations else None

    def structured(self) -> dict:
        """The structured details as JSON-ready data (empty when the peer sent none)."""
        out: dict = {}
        if self._violations:
            out["violations"] = [{"field": f, "rule": r} for f, r in self._violations]
        if self.reason:
            out["reason"] = self.reason
            out["metadata"] = dict(self.metadata)
        return out


def status_details(error: grpc.RpcError) -> tuple[tuple[tuple[str, str], ...], str, dict[str, str]]:
    """(BadRequest violations, ErrorInfo reason, ErrorInfo metadata) from a failed call's
    ``google.rpc.Status`` trailer; empty when there is none or it does not parse."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    except (ValueError, TypeError, AttributeError):
        status = None  # a trailer that disagrees with the call's own status is not trusted
    violations: list[tuple[str, str]] = []
    reason, metadata = "", {}
    for any_detail in status.details if status is not None else ():
        if any_detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
    return tuple(violations), reason, metadata


def describe_details(violations: tuple[tuple[str, str], ...], reason: str, metadata: Mapping[str, str]) -> str:
    """One line for people: the fields at fault and the refusal's facts ('' when none)."""
    parts = [f"field {f!r}: {r}" for f, r in violations]
    if reason:
        facts = ", ".join(f"{k}={v}" for k, v in sorted(metadata.items()))
        parts.append(f"{reason}" + (f" ({facts})" if facts else ""))
    return "; ".join(parts)


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
            msg = (
                f"peer {peer!r} at {address} closed the connection during the TLS handshake: it does not accept this "
                f"site's certificate (not pinned there, or expired), or it is not the {peer!r} you pinned ({details})"
            )
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent rpc limit" in details.lower():
        msg = f"{peer!r} is busy (too many calls at once); nothing was charged, try again ({details})"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details.lower():
        msg = f"a message to or from {peer!r} exceeded gRPC's size limit ({details})"
    else:
        msg = _MESSAGES.get(name, "{peer!r} failed with {name}: {details}").format(
            peer=peer, name=name, details=details
        )
    violations, reason, metadata = status_details(error)
    extra = describe_details((), reason, metadata)  # the peer's message already says "field: rule"
    if extra:
        msg = f"{msg} [{extra}]"
    return PeerError(name, msg, details, violations=violations, reason=reason, metadata=metadata)


def _host_of(address: str) -> str:
    """The host part of HOST:PORT (IPv6 in brackets)."""
    if address.startswith("[") and "]" in address:
        return address[1 : address.index("]")]
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
        sans = (
            x509.load_pem_x509_certificate(p.cert_pem)
            .extensions.get_extension_for_class(x509.SubjectAlternativeName)
            .value
        )
        names = [str(n).lower() for n in sans.get_values_for_type(x509.DNSName)] + list(
            sans.get_values_for_type(x509.IPAddress)
        )
        if want in names:
            matches.append(p)
    if len(matches) != 1:
        found = ", ".join(m.name for m in matches) or "none"
        raise NotFound(
            f"cannot tell which pinned peer serves {address} (pinned certificates naming {host!r}: {found}); give --peer NAME"
        )
    return matches[0]


#: statuses of a call the peer may never have answered (its request may not have reached it)
UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


class CallBytes:
    """The payload bytes of a client's unary calls, by method: ``sent``, the request messages'
    ``ByteSize()`` of every call the peer answered (with a reply or a refusal of its own), and
    ``received``, the reply messages' ``ByteSize()`` — the protobuf payload, not TLS or HTTP/2
    framing, as the server's metrics interceptor (``peer.net.metrics``) counts its side; a call
    with no answer (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) is counted in ``unanswered``
    only. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._methods: dict[str, dict[str, int]] = {}

    def add(self, method: str, sent: int, received: int, answered: bool = True) -> None:
        with self._lock:
            m = self._methods.setdefault(method, {"calls": 0, "unanswered": 0, "sent": 0, "received": 0})
            m["calls" if answered else "unanswered"] += 1
            m["sent"] += int(sent)
            m["received"] += int(received)

    def by_method(self) -> dict[str, dict[str, int]]:
        """method → {calls, unanswered, sent, received} (a copy)."""
        with self._lock:
            return {k: dict(v) for k, v in self._methods.items()}

    def totals(self) -> dict[str, int]:
        """{calls, unanswered, sent, received} over every method."""
        out = {"calls": 0, "unanswered": 0, "sent": 0, "received": 0}
        for m in self.by_method().values():
            for k in out:
                out[k] += m[k]
        return out


class PeerClient:
    """A mutually authenticated connection to one pinned peer. ``traffic`` counts the payload
    bytes of its unary calls (:class:`CallBytes`)."""

    def __init__(
        self,
        identity: Identity,
        address: str,
        peer: str | None = None,
        insecure: bool = False,
        trust: TrustStore | None = None,
        max_release_bytes: int = wire.MAX_RELEASE_BYTES,
        on_receipt: Callable[[SignedReceipt], None] | None = None,
    ):
        """``on_receipt`` is called with each verified receipt as soon as it arrives, before any
        tensor byte (the peer has charged its ledger by then, whatever happens next)."""
        self.identity = identity
        self.on_receipt = on_receipt
        self.address = address
        self.trust = trust or TrustStore(identity.trust_dir)
        self.insecure = insecure
        self.max_release_bytes = max_release_bytes
        self.traffic = CallBytes()
        if insecure:
            if not peer:
                raise InvalidArgument(
                    "peer", "is required with --insecure (there is no certificate to tell who answers)"
                )
            log.warning(
                "INSECURE: talking to %s at %s without TLS; anyone on the path can read and alter everything",
                peer,
                address,
            )
            self.peer_name = peer
            pinned = self.trust.peers().get(peer)
            self.peer_cert = pinned.cert_pem if pinned else None
            self.channel = grpc.insecure_channel(address, options=wire.grpc_options())
        else:
            if peer is not None and peer == identity.name:
                # our own daemon (our run publishing to it): trust only our own certificate
                pinned = PinnedPeer(
                    identity.name, fingerprint(identity.cert_pem), identity.cert_pem, identity.trust_dir
                )
                self._next_certs = []
            else:
                pinned = resolve_peer(self.trust, address, peer)
                # while the peer rotates its certificate both pins are accepted (TLS and receipts)
                self._next_certs = [p.cert_pem for p in self.trust.pins_of(pinned.name)[1:]]
            self.peer_name = pinned.name
            self.peer_cert = pinned.cert_pem
            creds = grpc.ssl_channel_credentials(
                root_certificates=b"".join([pinned.cert_pem, *self._next_certs]),
                private_key=identity.key_pem,
                certificate_chain=identity.cert_pem,
            )
            self.channel = grpc.secure_channel(
                address, creds, options=[*wire.grpc_options(), ("grpc.ssl_target_name_override", pinned.name)]
            )
        self.stub = pb_grpc.PeerStub(self.channel)
        # release streams decode chunk frames without copying them (peer.net.wire.decode_frame)
        self._release = {
            "ReleaseFeatures": self._release_call(self.channel.stream_stream, "ReleaseFeatures", pb.FeaturesRequest),
            "ReleaseWeights": self._release_call(self.channel.unary_stream, "ReleaseWeights", pb.WeightsRequest),
            "ReleaseMerged": self._release_call(self.channel.unary_stream, "ReleaseMerged", pb.MergeRequest),
            "Fuse": self._release_call(self.channel.unary_stream, "Fuse", pb.FuseRequest),
            "ReleaseSegment": self._release_call(self.channel.unary_stream, "ReleaseSegment", pb.SegmentRequest),
        }

    @staticmethod
    def _release_call(make, name: str, request_type):
        return make(
            f"/privfusion.v1.Peer/{name}",
            request_serializer=request_type.SerializeToString,
            response_deserializer=wire.decode_frame,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def header(self, on_behalf_of: str | None = None) -> pb.RequestHeader:
        """Our header; ``on_behalf_of`` only when we relay a request for another site."""
        return pb.RequestHeader(sender=self.identity.name, receiver=self.peer_name, on_behalf_of=on_behalf_of or "")

    # ------------------------------------------------------------------ checks

    def _check_receipt(self, receipt: SignedReceipt) -> None:
        if self.peer_cert is None:
            raise InvalidArgument("receipt.signature", f"cannot be checked: {self.peer_name!r} is not pinned")
        record = _verify_with_any(receipt, [self.peer_cert, *getattr(self, "_next_certs", [])], self.peer_name)
        if receipt.served_again:
            # the identical bytes of an earlier charge (to whoever asked first), served to us again
            if receipt.served_to != self.identity.name:
                raise InvalidArgument(
                    "receipt.served_to", f"is {receipt.served_to!r}, not this site ({self.identity.name!r})"
                )
            if record.level != "data":
                raise InvalidArgument(
                    "receipt.served_again", f"is set on a {record.level}-level release; only data-level ones are reused"
                )
        elif record.counterparty != self.identity.name:
            raise InvalidArgument(
                "receipt.record.counterparty", f"is {record.counterparty!r}, not this site ({self.identity.name!r})"
            )
        if self.on_receipt is not None:
            self.on_receipt(receipt)

    def _read(
        self,
        call,
        expected_kind: str,
        model: str,
        out: str | os.PathLike | None = None,
        on_behalf_of: str | None = None,
    ) -> wire.Release:
        """Read a release stream, checking as it comes: the receipt's signature and counterparty
        (:meth:`_check_receipt`, before any tensor byte), then that the manifest is the one the
        receipt signed (its digest: kind, model, architecture, metadata, dtypes, shapes, upstream
        receipts; :class:`peer.net.wire.ReleaseReader`), then every tensor's bytes against the signed
        SHA-256, then that the release is what was asked for."""
        if out is None:
            sink = wire.ArraySink()
        elif hasattr(out, "writer"):  # a sink of one's own (peer.net.wire's sink protocol)
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
            raise InvalidArgument(
                "manifest",
                f"announces a {release.kind!r} release of {release.model!r}, asked for {expected_kind!r} of {model!r}",
            )
        if release.receipt.record.subject != model:
            raise InvalidArgument(
                "receipt.record.subject", f"is {release.receipt.record.subject!r}, asked for {model!r}"
            )
        named = release.receipt.record.parameters.get("on_behalf_of")
        if named != on_behalf_of:
            raise InvalidArgument(
                "receipt.record.parameters.on_behalf_of", f"is {named!r}, asked on behalf of {on_behalf_of!r}"
            )
        return release

    def _unary(self, method: str, request, timeout):
        """The unary call ``method`` of the stub, its bytes counted in ``traffic``."""
        try:
            reply = getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            answered = e.code() not in UNANSWERED
            self.traffic.add(method, request.ByteSize() if answered else 0, 0, answered=answered)
            raise explain(e, self.peer_name, self.address) from None
        self.traffic.add(method, request.ByteSize(), reply.ByteSize())
        return reply

    # ------------------------------------------------------------------ calls

    def info(self, timeout: float = INFO_TIMEOUT_S) -> PeerInfo:
        """Who the peer is and what it offers (``GetPeerInfo``, uncharged)."""
        message = self._unary("GetPeerInfo", pb.GetPeerInfoRequest(header=self.header()), timeout)
        return peer_info_from_message(message)

    def health(self, service: str = HEALTH_SERVICE, timeout: float = INFO_TIMEOUT_S) -> str:
        """The peer's standard gRPC health status of ``service`` ("SERVING", "NOT_SERVING", ...)
        on this connection; a failed call raises grpc's own error (the caller says what an
        unanswered health check means: a peer that is down is not a refusal)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # Every release call takes ``out``: None keeps the tensors in memory (Release.arrays); a
    # path streams them straight into OUT.safetensors as they arrive (Release.path) — for
    # releases larger than memory should hold; write the JSON beside with save_release. An
    # object with the sink methods of peer.net.wire (start, writer, done, finish, abort) is used as is.

    def features(
        self,
        model: str,
        probe: np.ndarray,
        *,
        activation_epsilon: float,
        weight_epsilon: float,
        unit: str = "neuron",
        activation_clip: tuple[float, float] | None = None,
        weight_bound: float | None = None,
        weights_epsilon: float | None = None,
        weights_delta: float | None = None,
        on_behalf_of: str | None = None,
        timeout: float = RELEASE_TIMEOUT_S,
        out=None,
    ) -> wire.Release:
        """Noisy graph features of ``model`` on our ``probe`` set (streamed to the peer).

        With ``weights_epsilon`` and ``weights_delta`` the same release also holds the model's
        PFA-perturbed, unpermuted weights (kind "features+weights", tensors "weights.<name>";
        ``peer.net.codec.weights_from_release`` reads them), charged with the features as one.
        ``on_behalf_of``: we relay this request for that site (the peer charges it too)."""
        params = pb.FeaturesParams(
            header=self.header(on_behalf_of),
            model=model,
            activation_epsilon=activation_epsilon,
            weight_epsilon=weight_epsilon,
            unit=unit,
        )
        if (weights_epsilon is None) != (weights_delta is None):
            raise InvalidArgument(
                "weights_delta" if weights_epsilon is not None else "weights_epsilon",
                "give both weights_epsilon and weights_delta, or neither",
            )
        if weights_epsilon is not None:
            params.weights_epsilon, params.weights_delta = float(weights_epsilon), float(weights_delta)
        if activation_clip is not None:
            params.activation_clip_low, params.activation_clip_high = (
                float(activation_clip[0]),
                float(activation_clip[1]),
            )
        if weight_bound is not None:
            params.weight_bound = float(weight_bound)
        probe = np.ascontiguousarray(probe)
        if probe.dtype not in (np.float32, np.float64):
            probe = probe.astype(np.float64)

        def requests() -> Iterator[pb.FeaturesRequest]:
            yield pb.FeaturesRequest(params=params)
            for m in wire.tensor_messages("probe", probe):
                yield (
                    pb.FeaturesRequest(probe=m) if m.DESCRIPTOR.name == "TensorHeader" else pb.FeaturesRequest(chunk=m)
                )

        kind = "features" if weights_epsilon is None else "features+weights"
        return self._read(self._release["ReleaseFeatures"](requests(), timeout=timeout), kind, model, out, on_behalf_of)

    def weights(
        self,
        model: str,
        *,
        epsilon: float,
        delta: float,
        on_behalf_of: str | None = None,
        timeout: float = RELEASE_TIMEOUT_S,
        out=None,
    ) -> wire.Release:
        """PFA-perturbed weights of ``model``, unpermuted: align them to our model here
        (``peer.ldp.fusion.permute_arrays``); a match computed from our model never leaves us."""
        req = pb.WeightsRequest(header=self.header(on_behalf_of), model=model, epsilon=epsilon, delta=delta)
        return self._read(self._release["ReleaseWeights"](req, timeout=timeout), "weights", model, out, on_behalf_of)

    def merged(
        self, pool: str, *, method: str, epsilon: float, delta: float, timeout: float = RELEASE_TIMEOUT_S, out=None
    ) -> wire.Release:
        """A model merged from ``pool`` by RS or LC at the target (ε, δ)."""
        req = pb.MergeRequest(header=self.header(), pool=pool, method=method, epsilon=epsilon, delta=delta)
        return self._read(self._release["ReleaseMerged"](req, timeout=timeout), "merged", pool, out)

    def segment(
        self,
        run: str,
        *,
        min_round: int = 0,
        max_round: int | None = None,
        timeout: float = RELEASE_TIMEOUT_S,
        out=None,
    ) -> wire.Release:
        """The peer's newest published segment of ``run`` with min_round ≤ round ≤ max_round
        (None: no limit), served again from its store (charged once when published). PeerError
        NOT_FOUND while there is none."""
        req = pb.SegmentRequest(header=self.header(), run=run, min_round=int(min_round), max_round=int(max_round or 0))
        return self._read(self._release["ReleaseSegment"](req, timeout=timeout), "segment", run, out)

    def publish_secagg(self, context, kind: str, value, recipients, timeout: float = INFO_TIMEOUT_S) -> int:
        """Publish our own run's secure-aggregation ``value`` of ``kind`` in ``context`` (a
        ``peer.net.secagg.MaskContext``) for ``recipients`` on our own daemon (this client is
        connected to it with our own identity: ``peer`` = our name); how many recipients."""
        request = pb.SecAggPublishRequest(
            header=self.header(),
            context=secagg_wire.context_message(context),
            message=secagg_wire.message_of_value(kind, self.identity.name, value, context),
            recipients=sorted(recipients),
        )
        return int(self._unary("PublishSecAgg", request, timeout).recipients)

    def fetch_secagg(self, context, kind: str, timeout: float = INFO_TIMEOUT_S):
        """What the peer published for us of ``kind`` in ``context``, read and checked
        (``secagg_wire.value_of_message``; signatures are the protocol's to verify); PeerError
        NOT_FOUND (SECAGG_NOT_PUBLISHED) while it has not yet."""
        request = pb.SecAggFetchRequest(header=self.header(), context=secagg_wire.context_message(context), kind=kind)
        message = self._unary("FetchSecAgg", request, timeout)
        return secagg_wire.value_of_message(message, context, kind, self.peer_name)

    def fuse(
        self,
        model: str,
        *,
        partner: str,
        partner_model: str,
        alpha: float,
        activation_epsilon: float,
        weight_epsilon: float,
        weights_epsilon: float,
        weights_delta: float,
        timeout: float = RELEASE_TIMEOUT_S,
        out=None,
    ) -> wire.Release:
        """The peer's ``model`` fused with ``partner``'s ``partner_model`` (the peer dials the partner)."""
        req = pb.FuseRequest(
            header=self.header(),
            model=model,
            partner=partner,
            partner_model=partner_model,
            alpha=alpha,
            activation_epsilon=activation_epsilon,
            weight_epsilon=weight_epsilon,
            weights_epsilon=weights_epsilon,
            weights_delta=weights_delta,
        )
        return self._read(self._release["Fuse"](req, timeout=timeout), "fused", model, out)

    def ledger(self, timeout: float = INFO_TIMEOUT_S) -> list[LedgerEntry]:
        """The peer's ledger entries charged to this site: (entry id, record, created at)."""
        try:
            return [
                ledger_entry_from_message(e)
                for e in self.stub.ListLedger(pb.LedgerRequest(header=self.header()), timeout=timeout)
            ]
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
            out.append(
                {
                    "signer": r.signer,
                    "ledger_entry_id": r.ledger_entry_id,
                    "verified": False,
                    "reason": f"{r.signer!r} is not pinned here",
                }
            )
            continue
        _verify_with_any(r, [p.cert_pem for p in trust.pins_of(r.signer)], None)
        out.append({"signer": r.signer, "ledger_entry_id": r.ledger_entry_id, "verified": True})
    return out


def release_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """OUT.safetensors and OUT.json for an output path given with or without the suffix."""
    p = Path(path)
    if p.suffix in (".safetensors", ".json"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".safetensors"), p.with_name(p.name + ".json")


def save_release(
    release: wire.Release, path: str | os.PathLike, upstream_checks: list[dict] | None = None
) -> tuple[Path, Path]:
    """Write ``PATH.safetensors`` (unless the release was streamed there) and the release
    document ``PATH.json`` beside it.

    The JSON is a model-store manifest (format 1: name, architecture, metadata) whose metadata
    holds the release record, the signed receipt, the release manifest exactly as signed
    (``manifest``: strings byte for byte, every tensor's dtype, shape and SHA-256) and the
    receipts it is built on, so a released model loads with ``peer.nn.store.load_model`` and the
    pair can be checked offline with the signer's certificate alone (:func:`verify_saved_release`).
    Both files are written atomically.
    """
    if release.manifest is None:
        raise InvalidArgument("release.manifest", "is missing: only a release read from the wire can be saved")
    tensors_path, doc_path = release_paths(path)
    tensors_path.parent.mkdir(parents=True, exist_ok=True)
    if release.path is None:
        sink = wire.SafetensorsSink(tensors_path)
        sink.start(
            [
                wire.TensorSpec(n, a.dtype.newbyteorder("<"), a.shape, a.nbytes, d)
                for (n, a), (_, d) in zip(release.arrays.items(), release.receipt.tensors, strict=True)
            ],
            {
                "privfusion_signer": release.receipt.signer,
                "privfusion_ledger_entry": release.receipt.ledger_entry_id,
                "privfusion_release": release.receipt.record.release_id,
            },
        )
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
            "release": {
                "kind": release.kind,
                "model": release.model,
                "signer": release.receipt.signer,
                "ledger_entry_id": release.receipt.ledger_entry_id,
                "metadata": release.metadata,
            },
            "record": release.receipt.record.to_dict(),
            "receipt": json.loads(release.receipt.to_json()),
            "manifest": release.manifest.to_dict(),
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


def load_saved_release(path: str | os.PathLike, trust: TrustStore) -> wire.Release:
    """A release written by :func:`save_release`, checked as :func:`verify_saved_release` checks
    it (signature against the signer's pin, manifest, every tensor's bytes) and read back as it
    was received: what a requester reuses instead of asking the peer for it again."""
    from safetensors.numpy import load_file

    verify_saved_release(path, trust)
    tensors_path, doc_path = release_paths(path)
    meta = json.loads(doc_path.read_text(encoding="utf-8"))["metadata"]
    manifest = Manifest.from_dict(meta["manifest"])
    arrays = load_file(str(tensors_path))
    return wire.Release(
        receipt=SignedReceipt.from_json(meta["receipt"]),
        kind=manifest.kind,
        model=manifest.model,
        architecture=json.loads(manifest.architecture_json) if manifest.architecture_json else None,
        metadata=json.loads(manifest.metadata_json or "{}"),
        arrays={t.name: arrays[t.name] for t in manifest.tensors},
        upstream=tuple(SignedReceipt.from_json(u) for u in meta.get("upstream", [])),
        total_bytes=manifest.total_bytes,
        manifest=manifest,
    )


# ---------------------------------------------------------------------- checking saved releases

_SAFETENSORS_DTYPES = {
    "F32": tpb.DTYPE_FLOAT32,
    "F64": tpb.DTYPE_FLOAT64,
    "I32": tpb.DTYPE_INT32,
    "I64": tpb.DTYPE_INT64,
}
_HASH_BLOCK = 4 << 20


def _safetensors_index(path: Path) -> tuple[dict[str, dict], int]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets) and where its data
    starts; nothing but the header is read."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise ValueError(f"declares a {n}-byte header")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise InvalidArgument("tensors", f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise InvalidArgument("tensors", f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def verify_saved_release(path: str | os.PathLike, trust: TrustStore) -> dict:
    """Check a saved release (``OUT.safetensors`` + ``OUT.json``) offline, from pinned
    certificates alone; return what was verified.

    Checks, in order: the receipt's signature against the signer's pinned certificate (the
    signed bytes of docs/wire.md, rebuilt from the saved receipt); that the saved manifest is the
    one the receipt signed (its digest); that the document's architecture and release metadata
    are the manifest's; that the safetensors file holds exactly the manifest's tensors, each
    with the signed dtype and shape and whose bytes hash to the signed SHA-256; that the saved
    upstream receipts are the ones the manifest names, each verified against its signer's pin
    where this site has one (``upstream[i].verified``). Raises ``InvalidArgument`` naming the
    field at fault, ``NotFound`` when the signer is not pinned.
    """
    tensors_path, doc_path = release_paths(path)
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
        meta = doc["metadata"]
        receipt = SignedReceipt.from_json(meta["receipt"])
        manifest = Manifest.from_dict(meta["manifest"])
        upstream = [SignedReceipt.from_json(u) for u in meta.get("upstream", [])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgument("release", f"{doc_path} is not a saved PrivFusion release: {e}") from None
    pinned = trust.peers().get(receipt.signer)
    if pinned is None:
        raise NotFound(f"{receipt.signer!r}, the release's signer, is not pinned in {trust.directory}")
    record = verify_receipt(receipt, pinned.cert_pem, manifest=manifest)

    arch = json.loads(manifest.architecture_json) if manifest.architecture_json else None
    if doc.get("architecture") != arch:
        raise InvalidArgument("architecture", f"{doc_path}: differs from the signed manifest's architecture")
    release_meta = meta.get("release", {})
    if (release_meta.get("kind"), release_meta.get("model"), release_meta.get("metadata")) != (
        manifest.kind,
        manifest.model,
        json.loads(manifest.metadata_json or "{}"),
    ):
        raise InvalidArgument(
            "metadata.release", f"{doc_path}: kind, model or metadata differ from the signed manifest"
        )

    index, base = _safetensors_index(tensors_path)
    if set(index) != {t.name for t in manifest.tensors} or len(index) != len(manifest.tensors):
        raise InvalidArgument(
            "tensors", f"{tensors_path} holds {sorted(index)}, the signed manifest {[t.name for t in manifest.tensors]}"
        )
    with open(tensors_path, "rb") as f:
        for t in manifest.tensors:
            entry = index[t.name]
            try:
                start, end = (int(x) for x in entry["data_offsets"])
                dtype, shape = _SAFETENSORS_DTYPES.get(entry["dtype"]), [int(x) for x in entry["shape"]]
            except (KeyError, TypeError, ValueError):
                raise InvalidArgument(f"tensor[{t.name}]", f"{tensors_path}: malformed safetensors entry") from None
            if dtype != t.dtype or shape != list(t.shape) or end - start != t.nbytes:
                raise InvalidArgument(
                    f"tensor[{t.name}]",
                    f"{tensors_path}: dtype {entry['dtype']} shape {shape} "
                    f"differ from the signed {tpb.DType.Name(t.dtype)} {list(t.shape)}",
                )
            f.seek(base + start)
            h, left = hashlib.sha256(), t.nbytes
            while left:
                block = f.read(min(left, _HASH_BLOCK))
                if not block:
                    raise InvalidArgument(f"tensor[{t.name}]", f"{tensors_path} is truncated")
                h.update(block)
                left -= len(block)
            if h.digest() != t.sha256:
                raise InvalidArgument(
                    f"tensor[{t.name}].sha256", f"{tensors_path}: the bytes do not match the signed checksum"
                )

    if [receipt_digest(u) for u in upstream] != list(manifest.upstream):
        raise InvalidArgument(
            "upstream", f"{doc_path}: the saved upstream receipts are not the ones the manifest signed"
        )
    checks = []
    for i, u in enumerate(upstream):
        pin = trust.peers().get(u.signer)
        if pin is None:
            checks.append(
                {
                    "signer": u.signer,
                    "ledger_entry_id": u.ledger_entry_id,
                    "verified": False,
                    "reason": f"{u.signer!r} is not pinned here",
                }
            )
            continue
        try:
            verify_receipt(u, pin.cert_pem)
        except InvalidArgument as e:
            raise InvalidArgument(f"upstream[{i}].{e.field}", e.rule) from None
        checks.append({"signer": u.signer, "ledger_entry_id": u.ledger_entry_id, "verified": True})
    return {
        "signer": receipt.signer,
        "ledger_entry_id": receipt.ledger_entry_id,
        "release_id": record.release_id,
        "counterparty": record.counterparty,
        "kind": manifest.kind,
        "model": manifest.model,
        "tensors": len(manifest.tensors),
        "total_bytes": manifest.total_bytes,
        "upstream": checks,
        "files": [str(tensors_path), str(doc_path)],
    }
