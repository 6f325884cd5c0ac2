"""The gRPC service of one site (privfusion.v1.Peer): the thin shell around the math.

Every RPC does, in this order:

1. **bind the caller**: the TLS client certificate's SHA-256 fingerprint is looked up in the
   site's pinned trust store and must equal ``header.sender`` (OpenFL's habit; :func:`bind_caller`);
2. **validate** the request (every field, before any work) and ask the site's policy whether
   this caller may have this kind of release at these parameters;
3. call the release desk (``peer.desk.desk.ReleaseDesk``) with a typed request: policy →
   make (the core's math with the site's public defaults, noise from a fresh CSPRNG stream) →
   record → **charge** (atomic check-and-charge; BudgetExhausted → RESOURCE_EXHAUSTED and
   nothing leaves), or serve an identical data-level release again, or — the relay Fuse,
   ``peer.net.fuse`` — cancel when the partner exchange fails → sign the receipt;
4. stream the signed receipt, then the manifest, then the tensors, then the end frame.

Domain errors (``peer.base.errors``) become gRPC status codes in exactly one place:
:class:`ErrorInterceptor` (via :func:`status_of`). Nothing private is logged: log lines carry
method names, site names, record ids and public parameters only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from peer.base import checks
from peer.base.errors import FailedPrecondition, InvalidArgument, PermissionDenied, PrivFusionError, Unauthenticated
from peer.desk.desk import ReleaseDesk
from peer.desk.requests import FeaturesRequest, FuseRequest, MergeRequest, SegmentRequest, WeightsRequest
from peer.net import secagg_wire, wire
from peer.net.codec import peer_info_message
from peer.net.fuse import fuse_with_partner
from peer.net.identity import check_site_name, check_validity, fingerprint, load_certificate
from peer.net.limits import caller_left, paced, wrap_handler
from peer.net.signing import wire_transport
from peer.net.site import Site, log_event
from peer.nn.architectures import validate_architecture
from peer.nn.probes import check_probe_input, model_input
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc
from privfusion.v1 import tensor_pb2 as tpb

log = logging.getLogger("privfusion.peer")

#: No request may ask for more than this ε (per unit) or δ, whatever the policy says: above it
#: a "privacy" parameter is a typo or an attack, not a choice. Policies cap far lower.
MAX_EPSILON = 1000.0
MAX_DELTA = 0.1
#: Largest probe set accepted (rows) and its byte limit.
MAX_PROBE_ROWS = 100_000
MAX_PROBE_BYTES = 256 << 20


class InFlight:
    """Counts work in progress; ``wait_idle`` blocks until none is left (graceful shutdown)."""

    def __init__(self):
        self._count = 0
        self._cv = threading.Condition()

    def enter(self) -> None:
        with self._cv:
            self._count += 1

    def exit(self) -> None:
        with self._cv:
            self._count -= 1
            self._cv.notify_all()

    @property
    def count(self) -> int:
        return self._count

    def wait_idle(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._count == 0, timeout)


# ------------------------------------------------------------------------ error mapping


#: ``google.rpc.ErrorInfo.domain`` of every refusal this service sends.
ERROR_DOMAIN = "privfusion.v1"


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call ends with: the single error mapping."""
    if isinstance(error, PrivFusionError):
        code = getattr(grpc.StatusCode, error.status, grpc.StatusCode.INTERNAL)
        return code, str(error)
    return grpc.StatusCode.INTERNAL, "internal error"


def rich_status_of(error: BaseException, message: str | None = None) -> status_pb2.Status:
    """The ``google.rpc.Status`` a failed call ends with: :func:`status_of`'s code and message,
    plus the domain error's structured details — a ``google.rpc.BadRequest`` with one field
    violation (field, rule) per ``violations`` entry, and a ``google.rpc.ErrorInfo`` (reason,
    domain ``privfusion.v1``, metadata) when the error names a reason. Any gRPC client reads
    them from the ``grpc-status-details-bin`` trailer (``grpc_status.rpc_status.from_call``).
    Internal errors carry none."""
    code, text = status_of(error)
    status = status_pb2.Status(code=code.value[0], message=text if message is None else message)
    if code == grpc.StatusCode.INTERNAL or not isinstance(error, PrivFusionError):
        return status
    if error.violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=rule) for f, rule in error.violations
            ]
        )
        status.details.add().Pack(bad)
    if error.reason:
        status.details.add().Pack(
            error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=dict(error.metadata))
        )
    return status


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every handler: domain errors → their status; anything else → INTERNAL (logged by
    type only) — also for errors raised while a response stream is being produced. It also
    counts calls in progress (``calls``), so that shutdown closes the ledger only after the last
    one, cancelled or not, has finished its bookkeeping."""

    def __init__(self):
        self.calls = InFlight()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def fail(context, error: BaseException) -> None:
            code, message = status_of(error)
            if code == grpc.StatusCode.INTERNAL:
                incident = uuid.uuid4().hex[:12]
                log.error(
                    json.dumps(
                        {
                            "event": "internal-error",
                            "method": method,
                            "incident": incident,
                            "error_type": type(error).__name__,
                        }
                    ),
                    exc_info=error,
                )
                message = f"internal error (incident {incident})"
            log_event("refused", method=method, status=code.name, reason=message)
            context.abort_with_status(rpc_status.to_status(rich_status_of(error, message)))

        calls = self.calls

        def unary(behavior):
            def run(request, context):
                calls.enter()
                try:
                    return behavior(request, context)
                except Exception as e:  # domain errors map to their status, anything else to INTERNAL
                    fail(context, e)
                finally:
                    calls.exit()

            return run

        def streaming(behavior):
            def run(request, context):
                calls.enter()
                try:
                    yield from behavior(request, context)
                except Exception as e:  # domain errors map to their status, anything else to INTERNAL
                    fail(context, e)
                finally:
                    calls.exit()

            return run

        return wrap_handler(handler, unary, streaming)


# ------------------------------------------------------------------------ request checks


def check_epsilon(value: float, field: str) -> float:
    """A request's ε: the common rule (``peer.base.checks``), at most MAX_EPSILON."""
    return checks.check_epsilon(value, field, maximum=MAX_EPSILON)


def check_delta(value: float, field: str) -> float:
    """A request's δ: the common rule (``peer.base.checks``), at most MAX_DELTA."""
    return checks.check_delta(value, field, maximum=MAX_DELTA)


def check_unit(unit: str) -> str:
    if unit in ("", "neuron"):
        return "neuron"
    if unit == "entry":
        return "entry"
    raise InvalidArgument("unit", f"must be 'neuron' (default) or 'entry', got {unit!r}")


def probe_input(arch: Mapping[str, Any], probe: np.ndarray) -> np.ndarray:
    """Check a probe set against the architecture's input; return it as float64 rows. A site's
    own network takes rows of ``prod(input_shape)`` values, flat or already shaped."""
    if probe.ndim < 2 or probe.shape[0] < 1:
        raise InvalidArgument("probe.shape", f"must be (n, features...) with n >= 1, got {list(probe.shape)}")
    if probe.shape[0] > MAX_PROBE_ROWS:
        raise InvalidArgument("probe.shape", f"has {probe.shape[0]} rows, at most {MAX_PROBE_ROWS} are accepted")
    if arch.get("kind") == "imported":
        shape = list(arch["structure"]["input_shape"])
        if list(probe.shape[1:]) != shape and not (probe.ndim == 2 and probe.shape[1] == math.prod(shape)):
            raise InvalidArgument(
                "probe.shape", f"must be (n, {math.prod(shape)}) or (n, {', '.join(map(str, shape))}) for this model"
            )
        if not np.all(np.isfinite(probe)):
            raise InvalidArgument("probe", "contains NaN or infinite values")
        return np.asarray(probe, dtype=np.float64)
    a = validate_architecture(arch)
    need = a["input_dim"] if a["kind"] == "mlp" else math.prod(a["input_shape"])
    shape_ok = (probe.ndim == 2 and probe.shape[1] == need) or (
        a["kind"] == "cnn" and list(probe.shape[1:]) == list(a["input_shape"])
    )
    if not shape_ok:
        want = f"(n, {need})" + (f" or (n, {', '.join(map(str, a['input_shape']))})" if a["kind"] == "cnn" else "")
        raise InvalidArgument("probe.shape", f"must be {want} for this model, got {list(probe.shape)}")
    if not np.all(np.isfinite(probe)):
        raise InvalidArgument("probe", "contains NaN or infinite values")
    return np.asarray(probe, dtype=np.float64)


def requested_clip(params: pb.FeaturesParams) -> tuple[float, float] | None:
    """The activation range the caller asked for (both ends, finite, low < high), or None when
    it gave none (the site's default applies)."""
    has_low, has_high = params.HasField("activation_clip_low"), params.HasField("activation_clip_high")
    if not (has_low or has_high):
        return None
    if not (has_low and has_high):
        raise InvalidArgument(
            "activation_clip_high" if has_low else "activation_clip_low",
            "give both ends of the activation range, or neither",
        )
    lo, hi = params.activation_clip_low, params.activation_clip_high
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InvalidArgument("activation_clip_low", f"the range must be finite with low < high, got [{lo}, {hi}]")
    return (lo, hi)


# ------------------------------------------------------------------------ registration


def add_to_server(service: PeerService, server: grpc.Server) -> None:
    """Register privfusion.v1.Peer like the generated ``add_PeerServicer_to_server``, except that
    release streams go through :func:`peer.net.wire.serialize_frame` (chunk frames are pre-encoded
    protobuf bytes; the wire format is the same)."""
    descriptor = pb.DESCRIPTOR.services_by_name["Peer"]
    handlers = {}
    for method in descriptor.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        serialize = wire.serialize_frame if response is pb.ReleaseFrame else response.SerializeToString
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(service, method.name), request_deserializer=request.FromString, response_serializer=serialize
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


# ------------------------------------------------------------------------ the service


class PeerService(pb_grpc.PeerServicer):
    """privfusion.v1.Peer for one site: an adapter (bind the caller, validate, ask the site's
    policy, call the site, stream). What a release is, is the site's (``peer.net.site``)."""

    def __init__(self, site: Site):
        self.site = site
        self.releases = InFlight()  # releases being streamed
        self.desk = ReleaseDesk(site, wire_transport(site), gate=self)  # this service admits its releases
        self._draining = False
        self._drain_lock = threading.Lock()

    # ------------------------------------------------------------------ identity

    def bind_caller(self, context: grpc.ServicerContext, header: pb.RequestHeader) -> str:
        """The caller's site name: its TLS certificate's pin, which must be what it claims.

        Order of checks, and why each gets its status:
          - no certificate in the TLS session → UNAUTHENTICATED (only reachable if TLS did not
            require one: the server normally refuses such a handshake before any call);
          - a certificate whose fingerprint is not pinned (now) → UNAUTHENTICATED: e.g. a pin
            removed while the peer's connection stays open (TLS trust is only re-read per
            connection);
          - a pinned certificate that has expired or is not yet valid (now) → UNAUTHENTICATED:
            TLS checks validity only when a connection is made, and connections stay open;
          - ``header.sender`` ≠ the pinned name → PERMISSION_DENIED: the peer is known but
            claims to be someone else;
          - ``header.receiver`` ≠ this site → INVALID_ARGUMENT (a misaddressed request).
        """
        sender = header.sender
        if not sender:
            raise InvalidArgument("header.sender", "is required (the site the caller is)")
        if self.site.insecure:
            check_site_name(sender, "header.sender")
            caller = sender  # nothing to bind it to: the daemon warned loudly at start
        else:
            pems = context.auth_context().get("x509_pem_cert") or []
            if not pems:
                raise Unauthenticated("the call carries no client certificate", reason="CLIENT_CERT_MISSING")
            pinned = self.site.pinned_by_fingerprint(fingerprint(pems[0]))
            if pinned is None:
                raise Unauthenticated(
                    f"the client certificate (SHA-256 {fingerprint(pems[0])}) is not pinned at {self.site.name!r}",
                    reason="CLIENT_NOT_PINNED",
                )
            try:
                # TLS checked validity at the handshake only; a connection outlives the certificate
                check_validity(load_certificate(pems[0]), f"the client certificate of {pinned.name!r}")
            except FailedPrecondition as e:
                raise Unauthenticated(f"{e}; nothing was charged", reason="CLIENT_CERT_NOT_VALID") from None
            if sender != pinned.name:
                raise PermissionDenied(
                    f"header.sender: claims {sender!r}, but the TLS certificate is pinned as {pinned.name!r}",
                    reason="SENDER_MISMATCH",
                    metadata={"field": "header.sender", "pinned_as": pinned.name},
                )
            caller = pinned.name
        if header.receiver != self.site.name:
            raise InvalidArgument("header.receiver", f"must be this site, {self.site.name!r}; got {header.receiver!r}")
        return caller

    # ------------------------------------------------------------------ releases

    def _stream(self, issued) -> Iterator[pb.ReleaseFrame]:
        """Stream a release the desk issued (charged or served again, and signed): receipt →
        manifest → tensors → end; then tell the desk how it ended (the charge stands either way)."""
        started = time.perf_counter()
        finished = False
        try:
            yield from wire.release_frames(
                issued.receipt,
                issued.kind,
                issued.subject,
                issued.architecture,
                issued.metadata,
                issued.tensors,
                issued.upstream,
            )
            finished = True
        finally:
            self.desk.finish(issued, sent=finished, started=started)

    def drain(self) -> None:
        """From now on refuse new releases before they are charged (graceful shutdown)."""
        with self._drain_lock:
            self._draining = True

    def admit(self, what: str) -> None:
        """The desk's gate: count a release as in flight before it is charged or served, unless
        draining (FailedPrecondition SHUTTING_DOWN, ``what`` says what did not happen)."""
        with self._drain_lock:
            if self._draining:
                raise FailedPrecondition(f"{self.site.name!r} is shutting down; {what}", reason="SHUTTING_DOWN")
            self.releases.enter()

    def leave(self) -> None:
        """The desk's gate: a release admitted by :meth:`admit` has ended."""
        self.releases.exit()

    def _on_behalf_of(self, header: pb.RequestHeader, caller: str, method: str) -> str | None:
        """The site a relayed request is finally for (``header.on_behalf_of``), or None.

        The relay is the bound caller, whose pinned TLS identity vouches for the name: the
        final caller cannot be authenticated here, which is why a relayed release is charged
        to the relay's budgets as well as to the final caller's (a relay naming someone else
        spends its own budget all the same)."""
        final = header.on_behalf_of
        if not final:
            return None
        if method not in ("ReleaseFeatures", "ReleaseWeights"):
            raise InvalidArgument(
                "header.on_behalf_of",
                f"is accepted by ReleaseFeatures and ReleaseWeights only (relayed releases), not by {method}",
            )
        check_site_name(final, "header.on_behalf_of")
        if final == caller:
            raise InvalidArgument(
                "header.on_behalf_of", f"names the sender {caller!r}; it is for the site a relay asks on behalf of"
            )
        if final == self.site.name:
            raise InvalidArgument("header.on_behalf_of", f"must not name this site ({self.site.name!r})")
        return final

    # ------------------------------------------------------------------ RPCs

    def GetPeerInfo(self, request: pb.GetPeerInfoRequest, context) -> pb.PeerInfo:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "GetPeerInfo")
        self.site.policy_allows(caller, "info")
        return peer_info_message(self.site.peer_info(caller))

    def ReleaseFeatures(self, request_iterator: Iterable[pb.FeaturesRequest], context) -> Iterator[pb.ReleaseFrame]:
        # a stalled or endless upload must not hold a worker: per-frame idle limit, overall deadline
        limits = self.site.config.limits
        messages = paced(
            request_iterator, limits.stream_idle_s, limits.stream_deadline_s, "the ReleaseFeatures request stream"
        )
        first = next(messages, None)
        if first is None or first.WhichOneof("part") != "params":
            raise InvalidArgument("params", "the request stream must start with FeaturesParams")
        p = first.params
        caller = self.bind_caller(context, p.header)
        final = self._on_behalf_of(p.header, caller, "ReleaseFeatures")
        stored = self.site.model(p.model, "model", own=True)
        architecture = self.site.architecture_of(stored)
        eps_x = check_epsilon(p.activation_epsilon, "activation_epsilon")
        eps_w = check_epsilon(p.weight_epsilon, "weight_epsilon")
        unit = check_unit(p.unit)
        clip = self.site.activation_clip(requested_clip(p))
        bound = None
        if p.HasField("weight_bound"):
            bound = p.weight_bound
            if not math.isfinite(bound) or bound <= 0:
                raise InvalidArgument("weight_bound", f"must be a finite number > 0, got {bound!r}")
            bound = (-bound, bound)
        if p.HasField("weights_epsilon") != p.HasField("weights_delta"):
            raise InvalidArgument(
                "weights_delta" if p.HasField("weights_epsilon") else "weights_epsilon",
                "give both weights_epsilon and weights_delta (features with weights), or neither",
            )
        weights = None
        if p.HasField("weights_epsilon"):
            weights = (
                check_epsilon(p.weights_epsilon, "weights_epsilon"),
                check_delta(p.weights_delta, "weights_delta"),
            )
        request = FeaturesRequest(caller, p.model, eps_x, eps_w, clip, bound, unit, weights, final)
        self.desk.policy(request)  # before the probe set is uploaded

        header = next(messages, None)
        if header is None:
            caller_left(context)  # a cancelled upload ends its stream just before gRPC says so
        if header is None or header.WhichOneof("part") != "probe":
            raise InvalidArgument("probe", "FeaturesParams must be followed by the probe tensor's header")
        receiver = wire.TensorReceiver(
            header.probe, "probe", allowed=(tpb.DTYPE_FLOAT32, tpb.DTYPE_FLOAT64), max_bytes=MAX_PROBE_BYTES
        )
        for m in messages:
            if m.WhichOneof("part") != "chunk":
                raise InvalidArgument(
                    "chunk", f"only probe chunks may follow the probe header, got {m.WhichOneof('part')!r}"
                )
            receiver.add(m.chunk)
        if not receiver.complete:
            caller_left(context)  # as above: the status then is CANCELLED if the caller went away
        probe = probe_input(architecture, receiver.finish())
        yield from self._stream(self.desk.issue(dataclasses.replace(request, probe=probe)))

    def ReleaseWeights(self, request: pb.WeightsRequest, context) -> Iterator[pb.ReleaseFrame]:
        caller = self.bind_caller(context, request.header)
        final = self._on_behalf_of(request.header, caller, "ReleaseWeights")
        self.site.model(request.model, "model", own=True)  # an unknown model is NOT_FOUND first
        eps = check_epsilon(request.epsilon, "epsilon")
        dlt = check_delta(request.delta, "delta")
        yield from self._stream(self.desk.issue(WeightsRequest(caller, request.model, eps, dlt, final)))

    def Fuse(self, request: pb.FuseRequest, context) -> Iterator[pb.ReleaseFrame]:
        """Relay: fuse our model with the partner's, for the caller (see the .proto).

        Here: bind, validate every field, check that the policy allows the caller "fuse" and
        that we have a probe set (refusals here touch no ledger); then
        ``peer.net.fuse.fuse_with_partner`` has the desk charge our contribution before its one
        call to the partner and withdraw the charge if anything fails before a byte is sent; we
        stream the fused model under that charge.
        """
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "Fuse")
        stored = self.site.model(request.model, "model")
        partner = request.partner
        if not partner:
            raise InvalidArgument("partner", "is required (the site whose model to fuse with)")
        check_site_name(partner, "partner")
        if partner == self.site.name:
            raise InvalidArgument("partner", "must be another site")
        if partner == caller:
            raise InvalidArgument(
                "partner",
                f"must not be the caller ({caller!r}): fusing with your own model needs no "
                "relay; ask for this site's features and weights and fuse locally",
            )
        if not request.partner_model:
            raise InvalidArgument("partner_model", "is required")
        alpha = request.alpha
        if not math.isfinite(alpha) or not 0 <= alpha <= 1:
            raise InvalidArgument("alpha", f"must be in [0, 1], got {alpha!r}")
        fuse = FuseRequest(
            caller,
            request.model,
            partner,
            request.partner_model,
            alpha,
            check_epsilon(request.activation_epsilon, "activation_epsilon"),
            check_epsilon(request.weight_epsilon, "weight_epsilon"),
            check_epsilon(request.weights_epsilon, "weights_epsilon"),
            check_delta(request.weights_delta, "weights_delta"),
            self.site.activation_clip(),
            caller_active=context.is_active,
        )
        self.desk.policy(fuse)
        probe = self.site.probe
        if probe is None:
            raise FailedPrecondition(
                f"{self.site.name!r} has no probe set, which Fuse needs (site.toml: probe)", reason="NO_PROBE_SET"
            )
        try:  # a probe set made for another input than the model's would be matched scrambled
            check_probe_input(self.site.probe_signature, model_input(stored), "site.probe", request.model)
        except FailedPrecondition:  # the caller is told which model, not the site's columns
            raise FailedPrecondition(
                f"{self.site.name!r}'s probe set was not made for the input its model {request.model!r} reads, "
                f"which Fuse needs (its operator remakes it: privfusion probe make --model {request.model})",
                reason="PROBE_NOT_FOR_MODEL",
                metadata={"model": request.model},
            ) from None
        fuse = dataclasses.replace(fuse, probe=probe_input(stored.architecture, probe))
        yield from self._stream(fuse_with_partner(self.desk, self.site, fuse))

    def ReleaseMerged(self, request: pb.MergeRequest, context) -> Iterator[pb.ReleaseFrame]:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "ReleaseMerged")
        self.site.pool(request.pool)  # an unknown pool is NOT_FOUND before the other checks
        if request.method not in ("rs", "lc"):
            raise InvalidArgument(
                "method", f"must be 'rs' (random selection) or 'lc' (linear combination), got {request.method!r}"
            )
        eps = check_epsilon(request.epsilon, "epsilon")
        dlt = check_delta(request.delta, "delta")
        # the desk decides: serve its stored release again (no charge) or make, store and charge one
        yield from self._stream(self.desk.issue(MergeRequest(caller, request.pool, request.method, eps, dlt)))

    def ReleaseSegment(self, request: pb.SegmentRequest, context) -> Iterator[pb.ReleaseFrame]:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "ReleaseSegment")
        if request.min_round < 0:
            raise InvalidArgument("min_round", f"must be >= 0, got {request.min_round}")
        if request.max_round < 0 or (request.max_round and request.max_round < request.min_round):
            raise InvalidArgument(
                "max_round", f"must be 0 (no limit) or >= min_round ({request.min_round}), got {request.max_round}"
            )
        # served again from the store (charged once by the site's own run when it was published)
        segment = SegmentRequest(caller, request.run, request.min_round, request.max_round or None)
        yield from self._stream(self.desk.issue(segment))

    def PublishSecAgg(self, request: pb.SecAggPublishRequest, context) -> pb.SecAggPublishReply:
        """Our own run's message of one secure-aggregation context, kept for the recipients
        (only from this site's own identity; a masked vector only under a standing charge)."""
        caller = self.bind_own(context, request.header)
        self._on_behalf_of(request.header, caller, "PublishSecAgg")
        ctx = secagg_wire.context_of(request.context)
        ctx.check_member(caller, "header.sender")
        message = request.message
        secagg_wire.value_of_message(message, ctx, message.kind, caller)  # every field checked
        recipients = secagg_wire.check_recipients(request.recipients, ctx, caller)
        if message.kind == "masked":
            others = [s for s in ctx.sites if s != caller]
            self.desk.secure_share_charged(message.release_id, ctx.run_id, ctx.step, ctx.attempt, others)
        self.site.secagg.publish(ctx, message, recipients)
        return pb.SecAggPublishReply(recipients=len(recipients))

    def FetchSecAgg(self, request: pb.SecAggFetchRequest, context) -> pb.SecAggMessage:
        """What our run published for the caller in one context (NOT_FOUND until it has)."""
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "FetchSecAgg")
        ctx = secagg_wire.context_of(request.context)
        ctx.check_member(caller, "header.sender")
        ctx.check_member(self.site.name, "context.sites")
        self.site.policy_allows(caller, "secure-sum")
        return self.site.secagg.fetch(ctx, secagg_wire.check_kind(request.kind), caller)

    def bind_own(self, context: grpc.ServicerContext, header: pb.RequestHeader) -> str:
        """This site's own name, when the call comes from its own identity (its run): the TLS
        client certificate is the site's own and ``header.sender`` names it."""
        if header.sender != self.site.name or header.receiver != self.site.name:
            raise PermissionDenied(
                "only this site's own run may publish its secure-aggregation messages "
                f"(header.sender and header.receiver must be {self.site.name!r})",
                reason="SECAGG_NOT_OWN",
            )
        if not self.site.insecure:
            pems = context.auth_context().get("x509_pem_cert") or []
            if not pems or fingerprint(pems[0]) != fingerprint(self.site.identity.cert_pem):
                raise PermissionDenied(
                    "only this site's own identity may publish its secure-aggregation messages",
                    reason="SECAGG_NOT_OWN",
                )
        return self.site.name

    def ListLedger(self, request: pb.LedgerRequest, context) -> Iterator[pb.LedgerEntry]:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "ListLedger")
        self.site.policy_allows(caller, "ledger")
        for entry_id, record, created_at in self.site.ledger_entries(caller):
            yield pb.LedgerEntry(
                entry_id=entry_id, record_json=record.canonical_json(), counterparty=caller, created_at=created_at
            )
