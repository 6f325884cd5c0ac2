"""Server-side limits, so that no single peer can take a site down by holding its workers.

gRPC's synchronous server runs each call on one thread of a fixed pool for the call's whole
life, reading of a client stream included. Without limits a pinned peer that opens ``workers``
release streams and then stops sending holds every thread, and the site stops answering
everyone (health checks included). Three limits prevent that:

- **capacity classes** — the pool has ``workers + reserve_workers`` threads. *Heavy* calls
  (every streaming call: the releases, ListLedger, Health/Watch, reflection) may hold at most
  ``workers`` of them at once; one more is refused at once with RESOURCE_EXHAUSTED (nothing is
  charged: the refusal comes before the service runs). *Light* calls (GetPeerInfo and
  Health/Check: unary, small answers, never waiting on the caller) use the rest, so at least
  ``reserve_workers`` threads always remain for them;
- **a per-peer cap** — one caller (one client certificate; in insecure mode one host) may
  have at most ``max_calls_per_peer`` calls in progress; health checks are exempt, so a site
  can always be asked whether it is alive;
- **pacing of client streams** (:func:`paced`) — a request stream must deliver its next frame
  within ``stream_idle_s`` and all of it within ``stream_deadline_s``; otherwise the call ends
  with DEADLINE_EXCEEDED and its thread is free again. Nothing has been charged then: a
  release is charged only after its whole request has arrived;
- **callers that stop reading** (:class:`_SendWatch`) — gRPC's server thread hands each
  response message to the transport and waits until it has gone; a caller that stops reading
  a response stream fills HTTP/2's flow-control window and that wait never ends (keepalive
  pings are answered by the caller's gRPC library, so the connection looks alive). A message
  the caller has not taken within ``stream_idle_s`` cancels the call (the caller sees
  CANCELLED) and frees its thread. A release's charge stands then — its first bytes may have
  left — exactly as for any other call cut after it was charged.

Refusals are domain errors (:class:`Busy`, :class:`StreamTimeout`), so the service's one error
mapping turns them into status codes and logs them like any other refusal.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from peer.base.errors import InvalidArgument, PrivFusionError

#: Unary calls with small answers that never wait on the caller: served from the reserve.
LIGHT_METHODS = frozenset({"/privfusion.v1.Peer/GetPeerInfo", "/grpc.health.v1.Health/Check"})
#: Never refused by the per-peer cap: "is this site alive?" must always get an answer.
EXEMPT_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


class Busy(PrivFusionError):
    """The site (or this caller's share of it) is at capacity; nothing was done or charged."""

    status = "RESOURCE_EXHAUSTED"


class StreamTimeout(PrivFusionError):
    """A client stream stalled or ran past its deadline; nothing was charged."""

    status = "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class Limits:
    """The limits of one daemon (``[site]`` keys of the same names; seconds)."""

    workers: int = 32
    reserve_workers: int = 8
    max_calls_per_peer: int = 8
    stream_idle_s: float = 30.0
    stream_deadline_s: float = 600.0

    def __post_init__(self):
        for key in ("workers", "reserve_workers", "max_calls_per_peer"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"site.{key}", f"must be an integer >= 1, got {v!r}")
        for key in ("stream_idle_s", "stream_deadline_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise InvalidArgument(f"site.{key}", f"must be a finite number of seconds > 0, got {v!r}")
        if self.stream_idle_s > self.stream_deadline_s:
            raise InvalidArgument(
                "site.stream_idle_s",
                f"must be at most site.stream_deadline_s ({self.stream_deadline_s:g}), got {self.stream_idle_s:g}",
            )

    @property
    def threads(self) -> int:
        """Size of the server's thread pool."""
        return self.workers + self.reserve_workers


def caller_key(context: grpc.ServicerContext) -> str:
    """Who is calling, for the per-peer cap: the SHA-256 of the client certificate as presented
    (TLS), else the caller's host (insecure mode, where nothing better is known)."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if pems:
        return "cert:" + hashlib.sha256(pems[0]).hexdigest()
    peer = context.peer() or "unknown"
    return "host:" + peer.rsplit(":", 1)[0]


class LimitsInterceptor(grpc.ServerInterceptor):
    """Applies the capacity classes and the per-peer cap to every call (see the module doc).

    ``describe(context)`` names the caller in refusals (its pinned site name where known).
    Installed *inside* the error interceptor, so its refusals are mapped and logged there.
    """

    def __init__(
        self,
        limits: Limits,
        site: str,
        describe: Callable[[grpc.ServicerContext], str] | None = None,
        on_cut: Callable[[str, grpc.ServicerContext], None] | None = None,
    ):
        self.limits = limits
        self.site = site
        self._describe = describe or (lambda context: "this caller")
        self._heavy = threading.BoundedSemaphore(limits.workers)
        self._lock = threading.Lock()
        self._per_peer: Counter[str] = Counter()
        self.sends = _SendWatch(limits.stream_idle_s, on_cut)

    def in_progress(self) -> int:
        """Calls admitted and not yet finished (health checks not counted)."""
        with self._lock:
            return sum(self._per_peer.values())

    def _admit(self, method: str, context) -> Callable[[], None]:
        """Take this call's places (or refuse it); returns what gives them back."""
        key = None
        if method not in EXEMPT_METHODS:
            key = caller_key(context)
            with self._lock:
                if self._per_peer[key] >= self.limits.max_calls_per_peer:
                    who = self._describe(context)
                    raise Busy(
                        f"{who} already has {self._per_peer[key]} calls in progress at {self.site!r}, "
                        f"the most one peer may have (site.max_calls_per_peer = "
                        f"{self.limits.max_calls_per_peer}); nothing was charged — retry when one has finished",
                        reason="PEER_CALL_LIMIT",
                        metadata={"limit": self.limits.max_calls_per_peer, "retry": "after one of your calls ends"},
                    )
                self._per_peer[key] += 1
        heavy = method not in LIGHT_METHODS
        if heavy and not self._heavy.acquire(blocking=False):
            self._leave(key)
            raise Busy(
                f"{self.site!r} is serving {self.limits.workers} streaming calls, all it serves at once "
                f"(site.workers); nothing was charged — retry later",
                reason="SITE_AT_CAPACITY",
                metadata={"limit": self.limits.workers, "retry": "later"},
            )

        def release() -> None:
            if heavy:
                self._heavy.release()
            self._leave(key)

        return release

    def _leave(self, key: str | None) -> None:
        if key is None:
            return
        with self._lock:
            self._per_peer[key] -= 1
            if self._per_peer[key] <= 0:
                del self._per_peer[key]

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        admit = self._admit
        sends = self.sends

        def unary(behavior):
            def run(request, context):
                release = admit(method, context)
                try:
                    return behavior(request, context)
                finally:
                    release()

            return run

        def streaming(behavior):
            def run(request, context):
                release = admit(method, context)
                key = object()
                try:
                    for message in behavior(request, context):
                        # resumed only once gRPC has handed the message to the caller
                        sends.sending(key, method, context)
                        yield message
                        sends.sent(key)
                finally:
                    sends.sent(key)
                    release()

            return run

        return wrap_handler(handler, unary, streaming)


class _SendWatch:
    """Cancels response streams whose caller stopped taking messages (see the module doc).

    The streaming wrapper marks a message as pending when it yields it and clears the mark
    when gRPC asks for the next one (which it does only after the previous one has been
    handed to the caller). One watcher thread, running only while a message is pending,
    cancels every call whose message has been pending for more than ``idle_s``.
    ``on_cut(method, context)`` is told about each (the daemon logs it).
    """

    def __init__(self, idle_s: float, on_cut: Callable[[str, grpc.ServicerContext], None] | None = None):
        self.idle_s = idle_s
        self._on_cut = on_cut
        self._lock = threading.Lock()
        self._pending: dict[object, tuple[float, str, grpc.ServicerContext]] = {}
        self._watcher: threading.Thread | None = None
        self.cut = 0  # calls cancelled so far

    def sending(self, key: object, method: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._pending[key] = (time.monotonic(), method, context)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="send-watch", daemon=True)
                self._watcher.start()

    def sent(self, key: object) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _watch(self) -> None:
        tick = min(0.5, self.idle_s / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                late = [(k, v) for k, v in self._pending.items() if now - v[0] > self.idle_s]
                for k, _ in late:
                    del self._pending[k]
                if not self._pending and not late:
                    self._watcher = None
                    return
            for _, (_, method, context) in late:
                # wakes the server thread's wait for the send; the call ends CANCELLED
                context.cancel()
                self.cut += 1
                if self._on_cut is not None:
                    self._on_cut(method, context)


def wrap_handler(handler: grpc.RpcMethodHandler, unary: Callable, streaming: Callable) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped by ``unary`` (calls answered by one message) or
    ``streaming`` (calls answered by a stream): what a server interceptor returns."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            streaming(handler.unary_stream), handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_stream_rpc_method_handler(
        streaming(handler.stream_stream), handler.request_deserializer, handler.response_serializer
    )


_END = object()


def paced(requests: Iterable, idle_s: float, deadline_s: float, what: str = "the request stream") -> Iterator:
    """The messages of a client stream, each within ``idle_s`` of the previous one (or of the
    start) and all within ``deadline_s`` of the start; else :class:`StreamTimeout`.

    gRPC's request iterator blocks without a timeout, so a helper thread reads it and hands
    the messages over through a small queue (at most a few frames ahead: memory stays bounded).
    When the handler gives up, the call ends and gRPC wakes the helper, which then exits.
    """
    frames: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                frames.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for message in requests:
                if not hand_over((message, None)):
                    return
            hand_over((_END, None))
        except BaseException as e:
            hand_over((None, e))

    threading.Thread(target=pump, name="stream-reader", daemon=True).start()
    started = time.monotonic()
    try:
        while True:
            left = deadline_s - (time.monotonic() - started)
            late = StreamTimeout(
                f"{what} did not finish within {deadline_s:g} s (site.stream_deadline_s); nothing was charged",
                reason="STREAM_DEADLINE",
            )
            if left <= 0:
                raise late
            wait = min(idle_s, left)
            try:
                message, error = frames.get(timeout=wait)
            except queue.Empty:
                if wait < idle_s:
                    raise late from None
                raise StreamTimeout(
                    f"{what} sent nothing for {idle_s:g} s (site.stream_idle_s); nothing was charged",
                    reason="STREAM_STALLED",
                ) from None
            if error is not None:
                raise error
            if message is _END:
                return
            yield message
    finally:
        stop.set()


#: How long a request stream that ended early waits to learn whether its caller cancelled.
CANCEL_SETTLE_S = 2.0


def caller_left(context, settle_s: float = CANCEL_SETTLE_S) -> bool:
    """Whether the caller of a call whose request stream ended early has gone away.

    A caller that cancels mid-upload ends the server's request iterator exactly as a
    half-close would, and gRPC learns of the cancellation itself a moment later (the two
    arrive as separate events). A stream that ended early is therefore given ``settle_s``
    for the cancellation to land before it is answered as a truncated upload: a caller
    that cancelled is then seen as gone (its call ends CANCELLED, not as a refusal no one
    reads), and a caller that really half-closed a short upload gets its error that much later.
    """
    ended = threading.Event()
    if not context.add_callback(ended.set):
        return True  # the call has already ended
    return ended.wait(settle_s) or not context.is_active()
