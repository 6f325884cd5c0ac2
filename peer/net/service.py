"""The gRPC service of one site (privfusion.v1.Peer): the thin shell around the math.

Every RPC does, in this order:

1. **bind the caller**: the TLS client certificate's SHA-256 fingerprint is looked up in the
   site's pinned trust store and must equal ``header.sender`` (OpenFL's habit; :func:`bind_caller`);
2. **validate** the request (every field, before any work) and ask the site's policy whether
   this caller may have this kind of release at these parameters;
3. compute the release with the pure math modules (noise drawn from a fresh CSPRNG stream);
4. **charge** the release record to the ledger (atomic check-and-charge; BudgetExhausted →
   RESOURCE_EXHAUSTED and nothing leaves);
5. stream the signed receipt, then the manifest, then the tensors, then the end frame.

Domain errors (``peer.base.errors``) become gRPC status codes in exactly one place:
:class:`ErrorInterceptor` (via :func:`status_of`). Nothing private is logged: log lines carry
method names, site names, record ids and public parameters only.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from typing import Any, Iterable, Iterator, Mapping

import grpc
import numpy as np
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from peer.net.identity import check_site_name, check_validity, fingerprint, load_certificate
from peer.base.errors import FailedPrecondition, InvalidArgument, PermissionDenied, PrivFusionError, Unauthenticated
from peer.nn.graph import HiddenLayer, NetworkGraph, extract_graph
from peer.net.limits import paced
from peer.nn.architectures import validate_architecture
from peer.net.receipts import sign_receipt
from peer.base.records import ReleaseRecord
from peer.net import wire
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
MECHANISMS = ("laplace", "multibit", "gaussian", "rs-merge", "lc-merge")


def log_event(event: str, **fields: Any) -> None:
    """One structured log line (JSON): public facts only, never tensors, keys or raw values."""
    log.info(json.dumps({"event": event, **fields}, sort_keys=True, default=str))


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
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=rule) for f, rule in error.violations])
        status.details.add().Pack(bad)
    if error.reason:
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN,
                                                               metadata=dict(error.metadata)))
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
                log.error(json.dumps({"event": "internal-error", "method": method, "incident": incident,
                                      "error_type": type(error).__name__}), exc_info=error)
                message = f"internal error (incident {incident})"
            log_event("refused", method=method, status=code.name, reason=message)
            context.abort_with_status(rpc_status.to_status(rich_status_of(error, message)))

        calls = self.calls

        def unary(behavior):
            def run(request, context):
                calls.enter()
                try:
                    return behavior(request, context)
                except PrivFusionError as e:
                    fail(context, e)
                except Exception as e:  # noqa: BLE001 - the one place unexpected errors end a call
                    fail(context, e)
                finally:
                    calls.exit()
            return run

        def streaming(behavior):
            def run(request, context):
                calls.enter()
                try:
                    yield from behavior(request, context)
                except PrivFusionError as e:
                    fail(context, e)
                except Exception as e:  # noqa: BLE001
                    fail(context, e)
                finally:
                    calls.exit()
            return run

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), handler.request_deserializer, handler.response_serializer)


# ------------------------------------------------------------------------ request checks


def check_epsilon(value: float, field: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(field, f"must be a finite number > 0, got {value!r}")
    if value > MAX_EPSILON:
        raise InvalidArgument(field, f"must be at most {MAX_EPSILON:g}, got {value!r}")
    return float(value)


def check_delta(value: float, field: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= MAX_DELTA:
        raise InvalidArgument(field, f"must be in (0, {MAX_DELTA:g}], got {value!r}")
    return float(value)


def check_unit(unit: str) -> str:
    if unit in ("", "neuron"):
        return "neuron"
    if unit == "entry":
        return "entry"
    raise InvalidArgument("unit", f"must be 'neuron' (default) or 'entry', got {unit!r}")


def probe_input(arch: Mapping[str, Any], probe: np.ndarray) -> np.ndarray:
    """Check a probe set against the architecture's input; return it as float64 rows."""
    a = validate_architecture(arch)
    if probe.ndim < 2 or probe.shape[0] < 1:
        raise InvalidArgument("probe.shape", f"must be (n, features...) with n >= 1, got {list(probe.shape)}")
    if probe.shape[0] > MAX_PROBE_ROWS:
        raise InvalidArgument("probe.shape", f"has {probe.shape[0]} rows, at most {MAX_PROBE_ROWS} are accepted")
    need = a["input_dim"] if a["kind"] == "mlp" else math.prod(a["input_shape"])
    shape_ok = (probe.ndim == 2 and probe.shape[1] == need) or (
        a["kind"] == "cnn" and list(probe.shape[1:]) == list(a["input_shape"]))
    if not shape_ok:
        want = f"(n, {need})" + (f" or (n, {', '.join(map(str, a['input_shape']))})" if a["kind"] == "cnn" else "")
        raise InvalidArgument("probe.shape", f"must be {want} for this model, got {list(probe.shape)}")
    if not np.all(np.isfinite(probe)):
        raise InvalidArgument("probe", "contains NaN or infinite values")
    return np.asarray(probe, dtype=np.float64)


# ------------------------------------------------------------------------ graph <-> tensors


def graph_tensors(graph: NetworkGraph) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """A (noisy) graph as named tensors plus the public facts needed to rebuild it."""
    tensors: list[tuple[str, np.ndarray]] = []
    for h in graph.hidden:
        tensors += [(f"hidden.{h.name}.activations", h.activations), (f"hidden.{h.name}.incoming", h.incoming),
                    (f"hidden.{h.name}.bias", h.bias)]
    tensors += [("output.incoming", graph.output_incoming), ("output.bias", graph.output_bias)]
    meta = {"input_size": graph.input_size, "layers": [{"name": h.name, "kind": h.kind} for h in graph.hidden]}
    return tensors, meta


WEIGHTS_PREFIX = "weights."


def weights_tensors(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """Released weights as named tensors beside a graph's (``weights.<state-dict name>``)."""
    return [(WEIGHTS_PREFIX + k, arrays[k]) for k in sorted(arrays)]


def weights_from_release(architecture: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights of a "features+weights" release, checked against the architecture."""
    from peer.nn.architectures import weight_layers

    got = {k[len(WEIGHTS_PREFIX):]: np.asarray(v) for k, v in arrays.items() if k.startswith(WEIGHTS_PREFIX)}
    for s in weight_layers(architecture):
        w, b = got.get(f"{s.name}.weight"), got.get(f"{s.name}.bias")
        if w is None or b is None:
            raise InvalidArgument("release", f"holds no weights of layer {s.name!r} (tensors {WEIGHTS_PREFIX}{s.name}.weight/.bias)")
        if w.ndim < 2 or w.shape[0] != s.units or math.prod(w.shape[1:]) != s.fan_in or b.shape != (s.units,):
            raise InvalidArgument(f"tensor[{WEIGHTS_PREFIX}{s.name}]", f"shapes {list(w.shape)}, {list(b.shape)} do not fit the architecture")
        if w.dtype.kind != "f" or b.dtype.kind != "f" or not (np.all(np.isfinite(w)) and np.all(np.isfinite(b))):
            raise InvalidArgument(f"tensor[{WEIGHTS_PREFIX}{s.name}]", "must hold finite floating-point values")
    expected = {f"{s.name}.{p}" for s in weight_layers(architecture) for p in ("weight", "bias")}
    if set(got) != expected:
        raise InvalidArgument("release", f"holds unexpected weight tensors {sorted(set(got) - expected)}")
    return got


def graph_from_release(architecture: Mapping[str, Any], metadata: Mapping[str, Any],
                       arrays: Mapping[str, np.ndarray]) -> NetworkGraph:
    """Rebuild a graph sent by :func:`graph_tensors` (checks names and shapes)."""
    try:
        layers = [(str(l["name"]), str(l["kind"])) for l in metadata["layers"]]
        input_size = int(metadata["input_size"])
        hidden = tuple(HiddenLayer(name, kind, np.asarray(arrays[f"hidden.{name}.activations"]),
                                   np.asarray(arrays[f"hidden.{name}.incoming"]), np.asarray(arrays[f"hidden.{name}.bias"]))
                       for name, kind in layers)
        graph = NetworkGraph(validate_architecture(architecture), input_size, hidden,
                             np.asarray(arrays["output.incoming"]), np.asarray(arrays["output.bias"]))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument("release", f"is not a graph release: {e}") from None
    prev = input_size
    for h in graph.hidden:
        n = h.incoming.shape[0] if h.incoming.ndim == 3 else -1
        if h.incoming.ndim != 3 or h.incoming.shape[1] != prev or h.activations.shape[0] != n or h.bias.shape != (n,):
            raise InvalidArgument(f"tensor[hidden.{h.name}]", "shapes do not form a layered graph")
        prev = n
    if graph.output_incoming.ndim != 3 or graph.output_incoming.shape[1] != prev:
        raise InvalidArgument("tensor[output.incoming]", "shape does not fit the last hidden layer")
    return graph


# ------------------------------------------------------------------------ registration


def add_to_server(service: "PeerService", server: grpc.Server) -> None:
    """Register privfusion.v1.Peer like the generated ``add_PeerServicer_to_server``, except that
    release streams go through :func:`peer.net.wire.serialize_frame` (chunk frames are pre-encoded
    protobuf bytes; the wire format is the same)."""
    descriptor = pb.DESCRIPTOR.services_by_name["Peer"]
    handlers = {}
    for method in descriptor.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        serialize = wire.serialize_frame if response is pb.ReleaseFrame else response.SerializeToString
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}[
            (method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(service, method.name), request_deserializer=request.FromString,
                                     response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


# ------------------------------------------------------------------------ the service


class PeerService(pb_grpc.PeerServicer):
    """privfusion.v1.Peer for one site (``site`` is a ``peer.net.daemon.Site``)."""

    def __init__(self, site):
        self.site = site
        self.releases = InFlight()  # releases being streamed
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
                raise Unauthenticated("the call carries no client certificate")
            pinned = self.site.pinned_by_fingerprint(fingerprint(pems[0]))
            if pinned is None:
                raise Unauthenticated(f"the client certificate (SHA-256 {fingerprint(pems[0])}) is not pinned at {self.site.name!r}")
            try:
                # TLS checked validity at the handshake only; a connection outlives the certificate
                check_validity(load_certificate(pems[0]), f"the client certificate of {pinned.name!r}")
            except FailedPrecondition as e:
                raise Unauthenticated(f"{e}; nothing was charged") from None
            if sender != pinned.name:
                raise PermissionDenied(f"header.sender: claims {sender!r}, but the TLS certificate is pinned as {pinned.name!r}")
            caller = pinned.name
        if header.receiver != self.site.name:
            raise InvalidArgument("header.receiver", f"must be this site, {self.site.name!r}; got {header.receiver!r}")
        return caller

    # ------------------------------------------------------------------ releases

    def _release(self, method: str, caller: str, record: ReleaseRecord, kind: str, model: str,
                 architecture: Mapping | None, metadata: Mapping, tensors: list[tuple[str, np.ndarray]],
                 upstream=(), policy_kind: str | tuple[str, ...] | None = None, on_behalf_of: str | None = None,
                 charged_entry: str | None = None) -> Iterator[pb.ReleaseFrame]:
        """Charge, then stream receipt → manifest → tensors → end. The charge is never undone.

        ``policy_kind`` is the request kind the policy's per-request cap is checked for (in
        the budget's unit, by the ledger, inside the charge; a tuple names the parts of a
        sequential composite). ``on_behalf_of``: the site a relayed release is finally for
        (charged too). ``charged_entry``: the release was charged (and admitted past the
        drain check) by the caller of this function already — Fuse charges before it calls
        its partner.
        """
        digests = [(name, wire.digest(a)) for name, a in tensors]
        with self._drain_lock:
            if self._draining and charged_entry is None:
                raise FailedPrecondition(f"{self.site.name!r} is shutting down; nothing was charged")
            self.releases.enter()
        entry_id = None
        finished = False
        started = time.perf_counter()
        try:
            entry_id = charged_entry if charged_entry is not None else \
                self.site.charge(record, caller, policy_kind or kind, on_behalf_of)
            log_event("charged", method=method, caller=caller, entry=entry_id, release=record.release_id,
                      mechanism=record.mechanism, privacy_level=record.level, unit=record.unit,
                      epsilon=record.epsilon, delta=record.delta, model=model)
            receipt = sign_receipt(self.site.identity, entry_id, record,
                                   wire.release_manifest(kind, model, architecture, metadata, tensors, upstream, digests))
            yield from wire.release_frames(receipt, kind, model, architecture, metadata, tensors, upstream)
            finished = True
            self.site.release_event(record, "sent")
            log_event("released", method=method, caller=caller, entry=entry_id, release=record.release_id,
                      bytes=sum(a.nbytes for _, a in tensors), seconds=round(time.perf_counter() - started, 3))
        finally:
            if entry_id is not None and not finished:
                # the client went away or the server is stopping: the charge stands (bytes may have left)
                log_event("aborted-after-charge", method=method, caller=caller, entry=entry_id,
                          release=record.release_id)
                try:
                    self.site.release_event(record, "send-failed", "stream ended before ReleaseEnd")
                except Exception as e:  # noqa: BLE001 - the charge stands either way; say why the note is missing
                    log_event("event-not-recorded", entry=entry_id, error_type=type(e).__name__)
            self.releases.exit()

    def drain(self) -> None:
        """From now on refuse new releases before they are charged (graceful shutdown)."""
        with self._drain_lock:
            self._draining = True

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
            raise InvalidArgument("header.on_behalf_of", f"is accepted by ReleaseFeatures and ReleaseWeights only (relayed releases), not by {method}")
        check_site_name(final, "header.on_behalf_of")
        if final == caller:
            raise InvalidArgument("header.on_behalf_of", f"names the sender {caller!r}; it is for the site a relay asks on behalf of")
        if final == self.site.name:
            raise InvalidArgument("header.on_behalf_of", f"must not name this site ({self.site.name!r})")
        return final

    def _policy_allows(self, caller: str, on_behalf_of: str | None, *kinds: str) -> None:
        """PermissionDenied unless the policy lets the caller (and the site it relays for) ask
        for every kind."""
        for who in (caller, on_behalf_of):
            if who is not None:
                for kind in kinds:
                    self.site.policy_allows(who, kind)

    def _stamp(self, record: ReleaseRecord, caller: str, subject: str, **parameters: Any) -> ReleaseRecord:
        params = dict(record.parameters)
        params.update(parameters)
        return record.with_(counterparty=caller, subject=subject, parameters=params)

    # ------------------------------------------------------------------ RPCs

    def GetPeerInfo(self, request: pb.GetPeerInfoRequest, context) -> pb.PeerInfo:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "GetPeerInfo")
        self.site.policy_allows(caller, "info")
        return self.site.peer_info(caller)

    def ReleaseFeatures(self, request_iterator: Iterable[pb.FeaturesRequest], context) -> Iterator[pb.ReleaseFrame]:
        # a stalled or endless upload must not hold a worker: per-frame idle limit, overall deadline
        limits = self.site.config.limits
        messages = paced(request_iterator, limits.stream_idle_s, limits.stream_deadline_s, "the ReleaseFeatures request stream")
        first = next(messages, None)
        if first is None or first.WhichOneof("part") != "params":
            raise InvalidArgument("params", "the request stream must start with FeaturesParams")
        p = first.params
        caller = self.bind_caller(context, p.header)
        final = self._on_behalf_of(p.header, caller, "ReleaseFeatures")
        stored = self.site.model(p.model, "model")
        eps_x = check_epsilon(p.activation_epsilon, "activation_epsilon")
        eps_w = check_epsilon(p.weight_epsilon, "weight_epsilon")
        unit = check_unit(p.unit)
        clip = self.site.activation_clip(p)
        bound = None
        if p.HasField("weight_bound"):
            bound = p.weight_bound
            if not math.isfinite(bound) or bound <= 0:
                raise InvalidArgument("weight_bound", f"must be a finite number > 0, got {bound!r}")
            bound = (-bound, bound)
        if p.HasField("weights_epsilon") != p.HasField("weights_delta"):
            raise InvalidArgument("weights_delta" if p.HasField("weights_epsilon") else "weights_epsilon",
                                  "give both weights_epsilon and weights_delta (features with weights), or neither")
        with_weights = p.HasField("weights_epsilon")
        if with_weights:
            weights_eps = check_epsilon(p.weights_epsilon, "weights_epsilon")
            weights_dlt = check_delta(p.weights_delta, "weights_delta")
        kinds = ("features", "weights") if with_weights else ("features",)
        self._policy_allows(caller, final, *kinds)

        header = next(messages, None)
        if header is None or header.WhichOneof("part") != "probe":
            raise InvalidArgument("probe", "FeaturesParams must be followed by the probe tensor's header")
        receiver = wire.TensorReceiver(header.probe, "probe", allowed=(tpb.DTYPE_FLOAT32, tpb.DTYPE_FLOAT64),
                                       max_bytes=MAX_PROBE_BYTES)
        for m in messages:
            if m.WhichOneof("part") != "chunk":
                raise InvalidArgument("chunk", f"only probe chunks may follow the probe header, got {m.WhichOneof('part')!r}")
            receiver.add(m.chunk)
        probe = probe_input(stored.architecture, receiver.finish())

        from peer.ldp.mechanisms import perturb_graph

        graph = extract_graph(stored.architecture, stored.module(), probe)
        rnd = self.site.randomness()
        noisy, record = perturb_graph(graph, epsilon_x=eps_x, epsilon_w=eps_w, activation_clip=clip,
                                      weight_bounds=bound, unit=unit, randomness=rnd)
        tensors, meta = graph_tensors(noisy)
        kind = "features"
        if with_weights:
            from peer.ldp.mechanisms import composite_record

            # one release, one charge: both parts touch every neuron (sequential composition),
            # and a refusal of either leaves nothing charged
            arrays, weights_record = self.site.perturbed_weights(stored, weights_eps, weights_dlt, randomness=rnd)
            record = composite_record([record, weights_record], "sequential", randomness=rnd,
                                      parameters={"release": "features+weights"})
            named = weights_tensors(arrays)
            tensors += named
            meta = {**meta, "weights": [k for k, _ in named]}
            kind = "features+weights"
        relayed = {"on_behalf_of": final} if final else {}
        record = self._stamp(record, caller, p.model, probe_rows=int(probe.shape[0]), **relayed)
        yield from self._release("ReleaseFeatures", caller, record, kind, p.model, stored.architecture, meta, tensors,
                                 policy_kind=kinds if with_weights else "features", on_behalf_of=final)

    def ReleaseWeights(self, request: pb.WeightsRequest, context) -> Iterator[pb.ReleaseFrame]:
        caller = self.bind_caller(context, request.header)
        final = self._on_behalf_of(request.header, caller, "ReleaseWeights")
        stored = self.site.model(request.model, "model")
        eps = check_epsilon(request.epsilon, "epsilon")
        dlt = check_delta(request.delta, "delta")
        self._policy_allows(caller, final, "weights")
        # Always unpermuted: a requester aligns them itself; its match never leaves it.
        arrays, record = self.site.perturbed_weights(stored, eps, dlt)
        record = self._stamp(record, caller, request.model, **({"on_behalf_of": final} if final else {}))
        tensors = [(k, arrays.pop(k)) for k in sorted(arrays)]
        yield from self._release("ReleaseWeights", caller, record, "weights", request.model,
                                 stored.architecture, {}, tensors, on_behalf_of=final)

    def Fuse(self, request: pb.FuseRequest, context) -> Iterator[pb.ReleaseFrame]:
        """Relay: fuse our model with the partner's, for the caller (see the .proto).

        Order, so that a refused Fuse spends nothing anywhere and nothing private leaves:
          1. bind, validate every field, check the policy allows the caller "fuse" and that we
             can reach the partner (refusals here touch no ledger);
          2. compute our own contribution — noisy features on our public probe set and
             PFA-perturbed weights (one randomness stream) — and charge it to the caller as one
             sequential composite (kind "fuse": per-request cap, budgets) BEFORE any call out;
          3. ONE call to the partner: features + unpermuted weights of its model on our probe
             set, on behalf of the caller (the partner checks and charges both of us);
          4. if that fails, or the partner's release fails our checks, or matching/fusing
             fails, CANCEL our charge (no byte of it went anywhere) and fail;
          5. match our noisy graph with the partner's, permute its weights here (the match
             never leaves), fuse, and stream under the charge of step 2.
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
            raise InvalidArgument("partner", f"must not be the caller ({caller!r}): fusing with your own model needs no "
                                  "relay; ask for this site's features and weights and fuse locally")
        if not request.partner_model:
            raise InvalidArgument("partner_model", "is required")
        alpha = request.alpha
        if not math.isfinite(alpha) or not 0 <= alpha <= 1:
            raise InvalidArgument("alpha", f"must be in [0, 1], got {alpha!r}")
        eps_x = check_epsilon(request.activation_epsilon, "activation_epsilon")
        eps_w = check_epsilon(request.weight_epsilon, "weight_epsilon")
        eps = check_epsilon(request.weights_epsilon, "weights_epsilon")
        dlt = check_delta(request.weights_delta, "weights_delta")
        self.site.policy_allows(caller, "fuse")
        probe = self.site.probe
        if probe is None:
            raise FailedPrecondition(f"{self.site.name!r} has no probe set, which Fuse needs (site.toml: probe)")
        probe = probe_input(stored.architecture, probe)
        clip = self.site.activation_clip(None)

        from peer.ldp.mechanisms import composite_record, perturb_graph

        client = self.site.client_for(partner)  # unknown or unpinned partner: refused before any charge
        admitted = False  # counted among the releases in flight (graceful shutdown waits for it)
        try:
            # 2. our own contribution, charged before anything is asked of the partner. We match on
            # our *noisy* features too: everything the caller receives is then post-processing
            # of noisy releases (ours charged here, the partner's charged by the partner).
            rnd = self.site.randomness()
            own_graph = extract_graph(stored.architecture, stored.module(), probe)
            own_noisy, own_features_record = perturb_graph(own_graph, epsilon_x=eps_x, epsilon_w=eps_w,
                                                           activation_clip=clip, randomness=rnd)
            own_weights, own_weights_record = self.site.perturbed_weights(stored, eps, dlt, randomness=rnd)
            record = composite_record([own_features_record, own_weights_record], "sequential", randomness=rnd,
                                      parameters={"release": "fusion"})
            record = self._stamp(record, caller, request.model, alpha=alpha, partner=partner,
                                 partner_model=request.partner_model)
            with self._drain_lock:
                if self._draining:
                    raise FailedPrecondition(f"{self.site.name!r} is shutting down; nothing was charged")
                self.releases.enter()
                admitted = True
            entry_id = self.site.charge(record, caller, "fuse")
            log_event("charged-before-partner", method="Fuse", caller=caller, entry=entry_id, release=record.release_id,
                      epsilon=record.epsilon, delta=record.delta, model=request.model, partner=partner)
            try:
                # 3. the one call out: what leaves is our public probe set and public parameters
                try:
                    theirs = client.features(request.partner_model, probe, activation_epsilon=eps_x, weight_epsilon=eps_w,
                                             activation_clip=clip, weights_epsilon=eps, weights_delta=dlt,
                                             on_behalf_of=caller)
                except InvalidArgument as e:  # its receipt, checksums or record failed our checks
                    raise FailedPrecondition(f"partner {partner!r}'s release failed this site's checks: {e}") from None
                fused, objective = self._fuse_with(stored, request, theirs, own_noisy, own_weights, alpha)
                if not context.is_active():  # the caller left while we waited: nothing of ours was sent
                    raise FailedPrecondition("the caller cancelled the Fuse before anything was sent")
            except BaseException as e:
                # 4. nothing of ours left: withdraw the charge, say why
                reason = f"Fuse with partner {partner!r} failed before any byte was sent ({type(e).__name__})"
                try:
                    self.site.cancel(record, reason)
                    log_event("cancelled", method="Fuse", caller=caller, entry=entry_id, release=record.release_id,
                              partner=partner, error_type=type(e).__name__)
                except Exception as c:  # noqa: BLE001 - the charge then stands (conservative); say so
                    log_event("cancel-failed", method="Fuse", entry=entry_id, error_type=type(c).__name__)
                raise
            finally:
                client.close()
            # 5. the caller's release, under the charge made in step 2
            tensors = [(k, fused.pop(k)) for k in sorted(fused)]
            yield from self._release("Fuse", caller, record, "fused", request.model, stored.architecture,
                                     {"alpha": alpha, "partner": partner, "partner_model": request.partner_model,
                                      "upstream": [theirs.receipt.ledger_entry_id], "match_objective": objective},
                                     tensors, upstream=(theirs.receipt,), charged_entry=entry_id)
        finally:
            client.close()  # idempotent; also when we failed before the call
            if admitted:
                self.releases.exit()

    @staticmethod
    def _fuse_with(stored, request: pb.FuseRequest, theirs, own_noisy: NetworkGraph,
                   own_weights: Mapping[str, np.ndarray], alpha: float) -> tuple[dict[str, np.ndarray], float]:
        """Check the partner's release, match, permute its weights locally, fuse; a release that
        fails the checks is the partner's failure (FAILED_PRECONDITION), not the caller's."""
        from peer.ldp.fusion import fuse_arrays, permute_arrays
        from peer.ldp.matching import match_graphs

        partner = request.partner
        try:
            if theirs.architecture is None or validate_architecture(theirs.architecture) != stored.architecture:
                raise FailedPrecondition(f"partner_model: {partner}'s {request.partner_model!r} has another architecture than {request.model!r}")
            their_graph = graph_from_release(theirs.architecture, theirs.metadata, theirs.arrays)
            their_weights = weights_from_release(stored.architecture, theirs.arrays)
        except InvalidArgument as e:
            raise FailedPrecondition(f"partner {partner!r}'s release failed this site's checks: {e}") from None
        match = match_graphs(own_noisy, their_graph)
        perms = [np.asarray(p, dtype=np.int64) for p in match.permutations]
        aligned = permute_arrays(stored.architecture, their_weights, perms)
        return fuse_arrays(own_weights, aligned, alpha), float(match.objective)

    def ReleaseMerged(self, request: pb.MergeRequest, context) -> Iterator[pb.ReleaseFrame]:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "ReleaseMerged")
        pool = self.site.pool(request.pool)
        if request.method not in ("rs", "lc"):
            raise InvalidArgument("method", f"must be 'rs' (random selection) or 'lc' (linear combination), got {request.method!r}")
        eps = check_epsilon(request.epsilon, "epsilon")
        dlt = check_delta(request.delta, "delta")
        self.site.policy_allows(caller, "merge")

        from peer.dp.pools import merge_pool

        merged = merge_pool(pool, request.method, eps, dlt, validation=self.site.pool_validation(request.pool),
                            utilities=self.site.rs_utilities(request.pool) if request.method == "rs" else None,
                            randomness=self.site.randomness(), subject=request.pool, counterparty=caller)
        tensors = [(k, merged.arrays.pop(k)) for k in sorted(merged.arrays)]
        # public: the method, π or λ, the ε each accountant reports, the validation utility
        yield from self._release("ReleaseMerged", caller, merged.record, "merged", request.pool,
                                 merged.architecture, {"choice": merged.choice.to_dict()}, tensors, policy_kind="merge")

    def ListLedger(self, request: pb.LedgerRequest, context) -> Iterator[pb.LedgerEntry]:
        caller = self.bind_caller(context, request.header)
        self._on_behalf_of(request.header, caller, "ListLedger")
        self.site.policy_allows(caller, "ledger")
        for entry_id, record, created_at in self.site.ledger_entries(caller):
            yield pb.LedgerEntry(entry_id=entry_id, record_json=record.canonical_json(), counterparty=caller,
                                 created_at=created_at)
