"""An opt-in Prometheus endpoint: what an operator watches of a running site.

``[site] metrics_listen = "127.0.0.1:9464"`` makes the daemon serve the Prometheus text format
at ``http://127.0.0.1:9464/metrics`` (``prometheus_client``'s own HTTP server and exposition, on a
registry of this daemon's own: several daemons may run in one process). Absent, nothing is
opened. The endpoint has neither TLS nor authentication, so a loopback address is what it is
meant for (a Prometheus or an agent on the same host); any other address is served only because
site.toml says so, and the daemon logs it as a warning.

Two sources, both outside the service (docs/deployment.md, "Monitoring", lists every name):

- :class:`MetricsInterceptor`, the outermost gRPC server interceptor, sees every call as it
  enters and as it ends: calls by method and final status code, latency, calls in flight, bytes
  received and sent (the sum of the protobuf messages' sizes, ``ByteSize()`` or the length of a
  frame the service serialised itself: the payload, not TLS or HTTP/2 framing), and refusals by the ``google.rpc.ErrorInfo`` reason that the service's one
  error mapping puts in the ``grpc-status-details-bin`` trailer — read back from the call's
  trailing metadata, the very bytes the caller receives;
- :class:`LedgerCollector` reads the ledger at scrape time (``Ledger.summary``: what
  ``privfusion ledger show --json`` prints, without the PLD composition): releases and ε charged
  by level, unit, counterparty and model, and every budget's limit, spent and remaining ε (the
  RDP filter's figures). One read serves every scrape for ``cache_s`` seconds, so a scrape storm
  cannot load the ledger.

Nothing private is in a label: method names (the server's own), status codes, refusal reasons
(UPPER_SNAKE_CASE constants; anything else is reported as ``OTHER``), levels, units, site names
(public: they are the certificates' CNs), model and pool names (public: GetPeerInfo lists them)
and budget names (made of those). No record value, record id or release id is exported, and
the ε figures are those the ledger computes from the releases' public parameters.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from peer.base.errors import FailedPrecondition
from peer.net.limits import wrap_handler
from peer.net.site import log_event

log = logging.getLogger("privfusion.peer")

#: Latency buckets (seconds): health checks take milliseconds, a large release minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: How long one ledger read serves scrapes (seconds).
LEDGER_CACHE_S = 5.0
#: What a refusal reason must look like to be a label value (the service's reasons are constants).
REASON_PATTERN = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
STATUS_DETAILS_KEY = "grpc-status-details-bin"


# ------------------------------------------------------------------------ RPCs


class RpcMetrics:
    """The RPC families on ``registry`` (names in docs/deployment.md, "Monitoring")."""

    def __init__(self, registry: CollectorRegistry):
        self.calls = Counter(
            "privfusion_rpc_calls",
            "RPCs finished, by method and final gRPC status code (CANCELLED: the caller went away)",
            ("method", "code"),
            registry=registry,
        )
        self.latency = Histogram(
            "privfusion_rpc_duration_seconds",
            "Time from a call's arrival to its end, by method",
            ("method",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "privfusion_rpc_in_flight",
            "Calls in progress (streams included), by method",
            ("method",),
            registry=registry,
        )
        self.received = Counter(
            "privfusion_rpc_received_bytes",
            "Request message bytes received (protobuf message sizes, no TLS or HTTP/2 framing), by method",
            ("method",),
            registry=registry,
        )
        self.sent = Counter(
            "privfusion_rpc_sent_bytes",
            "Response message bytes handed to the transport (protobuf message sizes), by method",
            ("method",),
            registry=registry,
        )
        self.refusals = Counter(
            "privfusion_refusals",
            "Calls the site refused (ended with a status other than OK; a caller that went away is not one), "
            "by method, code and ErrorInfo reason "
            '("none" when the refusal names none)',
            ("method", "code", "reason"),
            registry=registry,
        )


def refusal_reason(trailing_metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The ``google.rpc.ErrorInfo.reason`` of a refusal's ``grpc-status-details-bin`` trailer:
    "none" when there is no such detail, "OTHER" when it is not an UPPER_SNAKE_CASE name (a
    label value is never free text)."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # a malformed trailer is not ours to fix here: no reason to report
            return "none"
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if not info.reason:
                    return "none"
                return info.reason if REASON_PATTERN.fullmatch(info.reason) else "OTHER"
    return "none"


def message_bytes(message) -> int:
    """A message's size: ``ByteSize()`` of a protobuf message, the length of one the service
    serialised itself (its release frames are encoded once, then handed over as bytes)."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        return len(message)
    return message.ByteSize()


class _Call:
    """One call being observed: counts its bytes, and at its end its status and latency."""

    __slots__ = ("method", "metrics", "received", "sent", "started")

    def __init__(self, metrics: RpcMetrics, method: str):
        self.metrics, self.method = metrics, method
        self.received, self.sent = metrics.received.labels(method), metrics.sent.labels(method)
        self.started = time.perf_counter()
        metrics.in_flight.labels(method).inc()

    def request(self, message) -> Any:
        self.received.inc(message_bytes(message))
        return message

    def requests(self, messages: Iterable) -> Iterator:
        for message in messages:
            self.received.inc(message_bytes(message))
            yield message

    def response(self, message) -> None:
        if message is not None:
            self.sent.inc(message_bytes(message))

    def end(self, context: grpc.ServicerContext, raised: BaseException | None) -> None:
        m, method = self.metrics, self.method
        code = context.code()
        if not context.is_active() or isinstance(raised, GeneratorExit):
            # the caller went away (it cancelled, its deadline passed, or the site cut a stream it
            # stopped reading): whatever the site would have answered reaches no one — not a refusal
            code = grpc.StatusCode.CANCELLED
        elif code is None:
            # no status set: a normal end, or something that escaped the error mapping (gRPC
            # then answers UNKNOWN)
            code = grpc.StatusCode.OK if raised is None else grpc.StatusCode.UNKNOWN
        elif code != grpc.StatusCode.OK:
            m.refusals.labels(method, code.name, refusal_reason(context.trailing_metadata())).inc()
        m.calls.labels(method, code.name).inc()
        m.latency.labels(method).observe(time.perf_counter() - self.started)
        m.in_flight.labels(method).dec()


class MetricsInterceptor(grpc.ServerInterceptor):
    """Observes every call from outside the service: install it first (outermost), so that it
    sees the status the error mapping gave and times the whole call, limits included."""

    def __init__(self, metrics: RpcMetrics):
        self.metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED, no label is made
            return None
        method = handler_call_details.method.lstrip("/")
        metrics = self.metrics
        streamed_request = handler.request_streaming

        def unary(behavior):
            def run(request, context):
                call = _Call(metrics, method)
                raised = None
                try:
                    request = call.requests(request) if streamed_request else call.request(request)
                    response = behavior(request, context)
                    call.response(response)
                    return response
                except BaseException as e:
                    raised = e
                    raise
                finally:
                    call.end(context, raised)

            return run

        def streaming(behavior):
            def run(request, context):
                call = _Call(metrics, method)
                raised = None
                try:
                    request = call.requests(request) if streamed_request else call.request(request)
                    for message in behavior(request, context):
                        yield message
                        # resumed once gRPC has handed the message to the transport
                        call.response(message)
                except BaseException as e:
                    raised = e
                    raise
                finally:
                    call.end(context, raised)

            return run

        return wrap_handler(handler, unary, streaming)


# ------------------------------------------------------------------------ the ledger


class LedgerCollector(Collector):
    """The ledger's releases and budgets, read at scrape time and kept ``cache_s`` seconds.

    ``read()`` returns what ``Ledger.summary(pld=False)`` returns (the daemon passes the site's
    ledger's). Families (labels: ``level``, ``unit``, ``counterparty``, ``model``; budgets also
    ``budget``):

    - ``privfusion_ledger_releases`` / ``privfusion_ledger_epsilon_charged``: the charged (not
      cancelled) releases and the sum of the ε each states (its record, in the budget's unit, at
      its own δ — a plain sum, not the budgets' composition);
    - ``privfusion_budget_epsilon_limit``, ``_delta_limit``, ``_epsilon_spent``,
      ``_epsilon_remaining`` and ``privfusion_budget_releases``: each budget as ``ledger show``
      states it (spent and remaining by the RDP filter at the budget's δ; a budget whose limit is
      unknown has no limit, remaining or spent sample);
    - ``privfusion_ledger_up``: 1 when the last read succeeded, 0 when it failed (logged by
      error type only), ``privfusion_ledger_read_seconds``: how long it took.

    These are gauges, not counters: a cancelled charge (``privfusion ledger cancel``) leaves the
    figures, so they can go down.

    Reads run on one thread of the collector's own: the HTTP server answers each scrape on a new
    thread, and the ledger keeps one SQLite connection per thread that reads it (until it is
    closed), so reading from the scrape's thread would leave a connection behind per scrape.
    """

    def __init__(self, read: Callable[[], dict], cache_s: float = LEDGER_CACHE_S, clock=time.monotonic):
        self._read = read
        self.cache_s = cache_s
        self._clock = clock
        self._lock = threading.Lock()
        self._families: list | None = None
        self._at = 0.0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-ledger")

    def close(self) -> None:
        """Stop the reading thread (the daemon does, before it closes the ledger)."""
        self._reader.shutdown(wait=True)

    def describe(self):
        return []  # registering must not read the ledger

    def collect(self):
        with self._lock:  # concurrent scrapes wait for one read instead of each making their own
            now = self._clock()
            if self._families is None or now - self._at >= self.cache_s:
                self._families = self._reader.submit(self._collect_now).result()
                self._at = self._clock()
            return list(self._families)

    def _collect_now(self) -> list:
        started = time.perf_counter()
        try:
            summary = self._read()
        except Exception as e:  # a scrape must not take the daemon down; say what failed, never values
            log.error(json.dumps({"event": "metrics-ledger-unreadable", "error_type": type(e).__name__}))
            up = GaugeMetricFamily("privfusion_ledger_up", "1 when the ledger was read at the last scrape, else 0")
            up.add_metric([], 0.0)
            return [up]
        families = ledger_families(summary)
        up = GaugeMetricFamily("privfusion_ledger_up", "1 when the ledger was read at the last scrape, else 0")
        up.add_metric([], 1.0)
        took = GaugeMetricFamily("privfusion_ledger_read_seconds", "How long the last ledger read took")
        took.add_metric([], time.perf_counter() - started)
        return [*families, up, took]


RELEASE_LABELS = ("level", "unit", "counterparty", "model")
BUDGET_LABELS = ("budget", "level", "unit", "model", "counterparty")


def ledger_families(summary: dict) -> list[GaugeMetricFamily]:
    """The ledger's gauge families from ``Ledger.summary()``'s data (see :class:`LedgerCollector`)."""
    releases = GaugeMetricFamily(
        "privfusion_ledger_releases", "Releases charged to the ledger and not cancelled", labels=RELEASE_LABELS
    )
    charged = GaugeMetricFamily(
        "privfusion_ledger_epsilon_charged",
        "Sum of the epsilon each charged release states (its record, at its own delta; not a composition)",
        labels=RELEASE_LABELS,
    )
    count: dict[tuple, int] = defaultdict(int)
    epsilon: dict[tuple, float] = defaultdict(float)
    for e in summary["entries"]:
        key = (e["level"], e["unit"], e["counterparty"], e["subject"])
        count[key] += 1
        epsilon[key] += e["epsilon"] if e["epsilon"] is not None else float("inf")
    for key in sorted(count):
        releases.add_metric(list(key), count[key])
        charged.add_metric(list(key), epsilon[key])
    budget = {
        "epsilon_limit": GaugeMetricFamily(
            "privfusion_budget_epsilon_limit", "A budget's epsilon limit", labels=BUDGET_LABELS
        ),
        "delta_limit": GaugeMetricFamily("privfusion_budget_delta_limit", "A budget's delta", labels=BUDGET_LABELS),
        "spent_epsilon_filter": GaugeMetricFamily(
            "privfusion_budget_epsilon_spent",
            "Epsilon spent from a budget (the RDP filter's figure at the budget's delta)",
            labels=BUDGET_LABELS,
        ),
        "remaining_epsilon_filter": GaugeMetricFamily(
            "privfusion_budget_epsilon_remaining",
            "Epsilon limit minus spent (a guide: the filter admits by composing RDP, not by this difference)",
            labels=BUDGET_LABELS,
        ),
        "count": GaugeMetricFamily("privfusion_budget_releases", "Releases charged to a budget", labels=BUDGET_LABELS),
    }
    for b in summary["budgets"]:
        labels = [b["budget"], b["level"], b["unit"], b["model"] or "", b["counterparty"] or ""]
        for field, family in budget.items():
            if b[field] is not None:  # None: no limit known for this budget (summary's jsonable NaN)
                family.add_metric(labels, float(b[field]))
    return [releases, charged, *budget.values()]


# ------------------------------------------------------------------------ the endpoint


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as in ``HOST:PORT``, IPv6 in brackets) is a loopback address or
    ``localhost``."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsEndpoint:
    """This daemon's registry, its interceptor, and the HTTP server that exposes it."""

    def __init__(self, listen: str, read_ledger: Callable[[], dict], cache_s: float = LEDGER_CACHE_S):
        self.listen = listen
        self.registry = CollectorRegistry()
        # prometheus_client's standard process_* figures of this process (CPU, memory, open fds)
        ProcessCollector(registry=self.registry)
        self.rpc = RpcMetrics(self.registry)
        self.interceptor = MetricsInterceptor(self.rpc)
        self.ledger = LedgerCollector(read_ledger, cache_s)
        self.registry.register(self.ledger)
        self.port: int | None = None
        self._server = None
        self._thread = None

    def start(self, site: str) -> int:
        """Serve ``/metrics`` on ``listen``; the port (port 0: any free one). FailedPrecondition
        naming ``site.metrics_listen`` when it cannot be bound."""
        host, _, port = self.listen.rpartition(":")
        addr = host.strip("[]")
        try:
            self._server, self._thread = start_http_server(int(port), addr=addr, registry=self.registry)
        except OSError as e:
            raise FailedPrecondition(
                f"site.metrics_listen: cannot listen on {self.listen!r}: {e.strerror or e}"
            ) from None
        self.port = self._server.server_port
        loopback = is_loopback(host)
        log_event("metrics-serving", site=site, listen=self.listen, port=self.port, loopback=loopback)
        if not loopback:
            log.warning(
                json.dumps(
                    {
                        "event": "metrics-not-loopback",
                        "listen": self.listen,
                        "warning": "the metrics endpoint has no TLS and no authentication: whoever reaches "
                        f"{self.listen} reads the site's budgets, counterparties and call counts "
                        "(site.metrics_listen asks for it)",
                    }
                )
            )
        return self.port

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self._server = None
        self.ledger.close()
