"""The peer daemon: one site's models, pool, probe set, policy, trust and ledger behind gRPC.

``privfusion peer serve --config site.toml`` (the ``[site]`` table: ``peer.net.site``; the
``[policy]`` table: ``peer.budget.policy``).

On start the daemon takes an exclusive lock on its ledger (``LEDGER.lock`` beside it, held
for the daemon's life: two daemons never share one ledger), loads everything, opens (or
creates) the ledger, and serves
privfusion.v1.Peer, grpc.health.v1.Health and server reflection on one mutually authenticated
port. The TLS trust anchors are the pinned certificates, re-read for every new connection, so
``privfusion peer trust add/remove`` takes effect without a restart (calls on connections
already open are re-checked against the pins on every call).

Limits (``peer.net.limits``): streaming calls hold at most ``workers`` threads, the
``reserve_workers`` more stay free for health checks and GetPeerInfo, one peer may have at most
``max_calls_per_peer`` calls in progress, and a client stream that stalls is cut
(DEADLINE_EXCEEDED, nothing charged). ``metrics_listen`` opts in to a Prometheus endpoint
(``peer.net.metrics``). The port is bound exclusively (no SO_REUSEPORT): a
second daemon on a taken port fails at start, naming the address.

SIGTERM/SIGINT: health turns NOT_SERVING, new releases are refused (nothing charged), in-flight
releases get ``shutdown_grace_s`` to finish; after that they are cancelled. A cancelled release
keeps its charge (bytes may have left) and gets a "send-failed" event in the ledger.

Logs are JSON lines on stderr: events, site names, record ids and public parameters only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from peer.base.errors import FailedPrecondition, InvalidArgument, PrivFusionError
from peer.base.records import FIXED_SEED_WARNING
from peer.budget.policy import LimitChange, Policy, limit_changes
from peer.net import wire
from peer.net.identity import fingerprint
from peer.net.limits import LimitsInterceptor
from peer.net.metrics import MetricsEndpoint
from peer.net.service import ErrorInterceptor, PeerService, add_to_server
from peer.net.site import Site, SiteConfig, log_event
from privfusion.v1 import peer_pb2 as pb

log = logging.getLogger("privfusion.peer")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name


# ------------------------------------------------------------------------ the server


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        message = record.getMessage()
        try:
            fields = json.loads(message)
        except ValueError:
            fields = None
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["msg"] = message
        if record.exc_info and record.levelno >= logging.ERROR and record.exc_info[2] is not None:
            # where it failed (file:line function), never the message or locals: they may hold values
            out["where"] = [
                f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(record.exc_info[2])[-6:]
            ]
        return json.dumps(out, sort_keys=True, default=str)


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("privfusion")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in ("peer.budget.ledger", "peer.budget.policy"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False


SEED_WARNING = (
    "FIXED SEED: NOT PRIVATE. site.seed makes every release's noise reproducible by anyone who "
    "knows the seed, who can then subtract it. Simulations and tests only; every record says "
    f"{FIXED_SEED_WARNING!r}."
)

POOL_SEED_WARNING = (
    "FIXED SEED: NOT PRIVATE. Pool models trained with `privfusion pool train --seed`, or stored "
    "releases drawn with a fixed seed, are served by this --simulation daemon; every record made "
    f"from them says {FIXED_SEED_WARNING!r}. Simulations and tests only."
)

INSECURE_WARNING = (
    "INSECURE MODE: this peer serves without TLS. Callers are not authenticated (any claimed "
    "sender is believed), nothing is encrypted, and receipts are the only integrity check. "
    "Never use this outside a sealed test network."
)


class Daemon:
    """A running peer: the gRPC server, its services and the site behind them."""

    def __init__(self, site: Site):
        self.site = site
        self.service = PeerService(site)
        self.health = health.HealthServicer()
        self.interceptor = ErrorInterceptor()
        limits = site.config.limits
        self.limits = LimitsInterceptor(limits, site.name, self._describe_caller, self._stream_cut)
        # opt-in (site.metrics_listen): the metrics interceptor is outermost, so it sees the
        # status the error mapping gives and times whole calls, limits included
        self.metrics: MetricsEndpoint | None = None
        interceptors = [self.interceptor, self.limits]
        if site.config.metrics_listen is not None:
            self.metrics = MetricsEndpoint(site.config.metrics_listen, lambda: site.ledger.summary(pld=False))
            interceptors.insert(0, self.metrics.interceptor)
        # one thread per call for its whole life: `workers` for streaming calls, the reserve for
        # health checks and GetPeerInfo (peer.net.limits); the error interceptor wraps the limits,
        # so their refusals are mapped and logged like every other
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=limits.threads, thread_name_prefix="peer"),
            interceptors=interceptors,
            # no SO_REUSEPORT: a second daemon on a taken port must fail, not share it
            options=[*wire.grpc_options(), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=limits.threads * 4,
        )
        add_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port: int | None = None
        self._stopped = threading.Event()

    def _stream_cut(self, method: str, context) -> None:
        log_event(
            "stream-cut",
            method=method,
            caller=self._describe_caller(context),
            why=f"the caller took no message for {self.site.config.limits.stream_idle_s:g} s (site.stream_idle_s)",
        )

    def _describe_caller(self, context) -> str:
        pems = context.auth_context().get("x509_pem_cert") or []
        if not pems:
            return f"the caller at {context.peer()}"
        pinned = self.site.pinned_by_fingerprint(fingerprint(pems[0]))
        return repr(pinned.name) if pinned else "an unpinned certificate"

    def _credentials(self) -> grpc.ServerCredentials:
        state = {"version": None}

        def configuration():
            ident = self.site.identity  # the pair in use now (Site.refresh_identity)
            # the pins, and our own certificate: `privfusion peer health` connects with the site's own
            # key; it is never pinned, so the Peer service refuses every call made with it
            roots = self.site.trust.bundle() + ident.cert_pem
            return grpc.ssl_server_certificate_configuration([(ident.key_pem, ident.cert_pem)], root_certificates=roots)

        def fetch():
            # called by gRPC at every handshake: our own pair after a rotation, then the pins
            renewed = self.site.refresh_identity()
            if renewed is not None:
                log_event("identity-reloaded", certificate_sha256=renewed)
            version = self.site.trust.version()
            if version == state["version"] and renewed is None:
                return None
            if version != state["version"]:
                state["version"] = version
                log_event("trust-reloaded", pinned=sorted(self.site.pinned()))
            return configuration()

        state["version"] = self.site.trust.version()
        return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=True)

    def start(self) -> int:
        listen = self.site.config.listen
        log_event("binding", listen=listen, tls=not self.site.insecure)
        try:
            if self.site.insecure:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, self._credentials())
        except RuntimeError:  # gRPC's "Failed to bind": say why in words
            self.port = 0
        if not self.port:
            raise FailedPrecondition(f"site.listen: cannot listen on {listen!r}: {_why_not_listening(listen)}")
        if self.metrics is not None:
            self.metrics.start(self.site.name)  # after the gRPC port is ours, before any call is served
        if self.site.insecure:
            log.warning(json.dumps({"event": "insecure", "warning": INSECURE_WARNING}))
            print(f"privfusion peer: WARNING: {INSECURE_WARNING}", file=sys.stderr, flush=True)
        if self.site.config.seed is not None:
            log.warning(json.dumps({"event": "fixed-seed", "warning": SEED_WARNING}))
            print(f"privfusion peer: WARNING: {SEED_WARNING}", file=sys.stderr, flush=True)
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log_event(
            "serving",
            site=self.site.name,
            listen=self.site.config.listen,
            port=self.port,
            tls=not self.site.insecure,
            models=sorted(self.site.models),
            pools=sorted(self.site.pools),
            pinned=sorted(self.site.pinned()),
            probe_set=self.site.probe is not None,
            fixed_seed=self.site.config.seed is not None,
        )
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Refuse new releases, let in-flight ones finish within ``grace``, then stop."""
        if self._stopped.is_set():
            return
        grace = self.site.config.shutdown_grace_s if grace is None else grace
        self.service.drain()
        self.health.enter_graceful_shutdown()
        log_event("stopping", site=self.site.name, grace_s=grace)
        started = time.monotonic()
        drained = self.service.releases.wait_idle(grace)
        # A finished release has handed its last frame to gRPC, which may still be sending it:
        # stop with what is left of the grace (at least a moment) so those bytes and the final
        # status go out; gRPC returns as soon as no call is left and cancels any that still are.
        self.server.stop(max(grace - (time.monotonic() - started), 1.0)).wait()
        # cancelled calls still run their bookkeeping (a "send-failed" note in the ledger):
        # the ledger is closed only after the last one, never under a call that is using it
        settled = self.interceptor.calls.wait_idle(30)
        if self.metrics is not None:
            self.metrics.stop()  # before the ledger it reads is closed
        if settled:
            self.site.close()
        self._stopped.set()
        log_event("stopped", site=self.site.name, drained=drained, settled=settled)

    def wait(self) -> None:
        self._stopped.wait()


def _why_not_listening(listen: str) -> str:
    """Why gRPC could not bind ``listen`` (it only says that it could not)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError) as e:
        return f"the host {host!r} does not resolve ({e})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use (another daemon, or another program, listens there)"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host!r} is not an address of this machine"
            if e.errno == errno.EACCES:
                return f"not allowed to bind port {port} (ports below 1024 need privileges)"
            return e.strerror or str(e)
    return "gRPC refused the address"


def open_site(
    config_path: str | os.PathLike,
    insecure: bool = False,
    simulation: bool | None = None,
    *,
    ledger: str | os.PathLike | None = None,
) -> Site:
    """The site of ``config_path``, checked for what it would serve before anything is opened
    (:func:`check_servable`). ``simulation`` None: a site with a fixed seed of its own is a
    simulation (``peer serve`` refuses such a seed without ``--simulation``,
    :func:`check_seed_allowed`). ``ledger``: open this ledger file instead of site.ledger
    (``privfusion site check`` opens a snapshot of it, :func:`check_site`).

    Logs each step as it starts (loading models and pools, opening and verifying the ledger):
    a daemon with large pools or a long ledger takes a while, and says what it is doing. A
    budget whose limits in ``[policy]`` differ from those its ledger recorded with its last
    charge is applied from the next charge on and logged as a warning naming both
    (:func:`peer.budget.policy.limit_changes`); one lowered to or below what it already spent is
    exhausted."""
    started = time.monotonic()
    config = SiteConfig.load(config_path)
    simulation = config.seed is not None if simulation is None else bool(simulation)
    log_event("starting", site=config.name, config=str(config_path))
    check_servable(config, simulation)
    policy = Policy.from_toml(config_path)
    if ledger is not None:
        config = dataclasses.replace(config, ledger=Path(ledger))
    site = Site(config, policy, insecure=insecure, simulation=simulation)
    try:
        for change in budget_limit_changes(site.ledger):
            log.warning(
                json.dumps({"event": "budget-limits-changed", "budget": change.budget, "detail": change.describe()})
            )
    except BaseException:
        site.close()
        raise
    log_event("site-loaded", site=config.name, seconds=round(time.monotonic() - started, 3))
    return site


def budget_limit_changes(ledger) -> list[LimitChange]:
    """The budgets of ``ledger`` (opened with the site's policy) whose limits in the policy
    differ from those recorded with their last charge (read from the same file without a
    policy, after the verified open)."""
    from peer.budget.ledger import Ledger

    recorded = Ledger(ledger.path, verify=False)
    try:
        return limit_changes(recorded.budget_states(), ledger.budget_states())
    finally:
        recorded.close()


@dataclasses.dataclass(frozen=True)
class SiteCheck:
    """What ``peer serve`` would do with a site (:func:`check_site`): it would start (else
    :func:`check_site` raised its refusal), leaving out ``broken`` (files that exist and do not
    load, or do not belong) and ``pending`` (a pool with no model yet, a probe set not made yet),
    with these budget ``changes`` applied; ``checked`` says what was looked at."""

    checked: tuple[str, ...]
    broken: tuple[tuple[str, str], ...]
    pending: tuple[tuple[str, str], ...]
    changes: tuple[LimitChange, ...]


def check_site(config_path: str | os.PathLike, simulation: bool = False) -> SiteCheck:
    """Everything ``privfusion peer serve --config CONFIG_PATH`` checks before it binds, by the
    same code: :func:`check_seed_allowed`, then :func:`open_site` (site.toml's ``[site]`` and
    ``[policy]`` with every key and value, what :func:`check_servable` refuses, the identity
    and its name, the model store, the pools, the probe set, the site's own networks, the
    ledger's hash chain, totals and anchor, and each budget's limits against those its ledger
    recorded) — on a snapshot of the ledger and its anchor in a temporary directory, so the
    check writes nothing beside the site (no ledger is created, no anchor appended) and runs
    while the daemon serves. Raises the refusal ``peer serve`` would raise."""
    config = SiteConfig.load(config_path)
    check_seed_allowed(config, simulation)
    with tempfile.TemporaryDirectory(prefix="privfusion-check-") as tmp:
        snapshot = _snapshot_ledger(config.ledger, Path(tmp))
        try:
            site = open_site(config_path, simulation=simulation, ledger=snapshot)
        except PrivFusionError as e:  # the refusal peer serve would give: about the site's own files
            here, there = str(snapshot.parent) + os.sep, str(config.ledger.parent) + os.sep
            e.args = tuple(a.replace(here, there) if isinstance(a, str) else a for a in e.args)
            raise
        try:
            changes = tuple(budget_limit_changes(site.ledger))
            entries = len(site.ledger.entries())
        finally:
            site.close()
    base = config.path.resolve().parent if config.path else config.models.parent
    broken, pending = [], []
    for shown, why in site.unusable:
        p = Path(shown) if Path(shown).is_absolute() else base / shown
        not_yet = not p.exists() or (p.is_dir() and not any(p.iterdir()))
        (pending if not_yet else broken).append((shown, why))
    ledger_words = (
        f"ledger {config.ledger} ({entries} charges: hash chain, totals and anchor verified on a snapshot)"
        if config.ledger.exists()
        else f"ledger {config.ledger}: none yet (the daemon creates it at its first start)"
    )
    checked = (
        f"{config.path or config_path}: [site] and [policy] (every key and value)",
        f"identity {config.identity} (key, certificate, name {config.name!r})",
        f"model store {config.models} ({len(site.models)} models load)",
        *(f"pool {name!r} ({len(pool)} models load)" for name, pool in sorted(site.pools.items())),
        ledger_words,
        "budget limits in [policy] against those the ledger recorded",
    )
    return SiteCheck(checked, tuple(broken), tuple(pending), changes)


def _snapshot_ledger(ledger: Path, directory: Path) -> Path:
    """A consistent copy of ``ledger`` and its anchor under ``directory`` (same file names: the
    anchor names its ledger), the anchor first so that the copy is never behind it; the path
    of the copy (not created when there is no ledger). A file SQLite cannot read is copied as
    bytes, for the ledger's own refusal to name what is wrong with it."""
    import shutil
    import sqlite3

    from peer.budget.anchor import anchor_path

    copy = directory / ledger.name
    if anchor_path(ledger).exists():
        shutil.copyfile(anchor_path(ledger), anchor_path(copy))
    if not ledger.exists():
        return copy
    try:
        src = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
        try:
            dst = sqlite3.connect(copy)
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()
    except sqlite3.Error:
        copy.unlink(missing_ok=True)
        shutil.copyfile(ledger, copy)
    return copy


def check_servable(config: SiteConfig, simulation: bool) -> None:
    """Refuse to start (FailedPrecondition naming the model or file, the rule and what to do,
    before the ledger or any model is opened) a site that would release what its records do
    not cover:

    - outside a simulation, a pool model trained with a fixed noise seed (``privfusion pool
      train --seed``: its record says "fixed-seed"; anyone who knows the seed reproduces the
      model on D and not on D minus one record), or an entry of the release store (a merge or
      an iterate segment) drawn or trained with one;
    - in any mode, a pool whose add-remove models state their true record count
      (``peer.dp.pools.check_declared_counts``).

    A ``--simulation`` daemon serves fixed-seed models, and every record made from them says
    "fixed seed: not private" (``peer.dp.merging.with_models_randomness``); it logs a warning
    naming them. Read from the pools' manifests and the store's JSON only (a file that does not
    parse is left to the loader, which says what is wrong with it)."""
    # lazy: peer.dp loads dp_accounting (slow to import), needed only by a site with pools
    from peer.dp.pools import states_true_count, true_count_refusal

    fixed_models, stated = [], {}
    for pool, directory in config.pools.items():
        for name, record in _pool_records(directory):
            if record.get("randomness") == "fixed-seed":
                fixed_models.append((pool, name, record.get("seed")))
            if states_true_count(record):
                stated.setdefault(pool, []).append(name)
    for pool, names in stated.items():
        raise FailedPrecondition(true_count_refusal(pool, names))
    fixed_releases = _fixed_seed_releases(config.ledger.with_name(config.ledger.stem + ".releases"))
    if simulation:
        if fixed_models or fixed_releases:
            names = [f"{p}/{m}" for p, m, _ in fixed_models] + [f for f, _ in fixed_releases]
            log.warning(json.dumps({"event": "fixed-seed-releases", "warning": POOL_SEED_WARNING, "sources": names}))
            print(f"privfusion peer: WARNING: {POOL_SEED_WARNING}", file=sys.stderr, flush=True)
        return
    if fixed_models:
        pool, name, seed = fixed_models[0]
        others = [f"{p}/{m}" for p, m, _ in fixed_models[1:]]
        raise FailedPrecondition(
            f"pool {pool!r}: model {name!r} was trained with the fixed noise seed {seed} (privfusion pool train "
            "--seed, or a simulation): "
            f"{FIXED_SEED_WARNING} — anyone who knows the seed reproduces its noise"
            + (f" (so were {others})" if others else "")
            + ". Retrain it without --seed (CSPRNG noise), or start the daemon with --simulation for tests "
            "and simulations"
        )
    if fixed_releases:
        path, what = fixed_releases[0]
        raise FailedPrecondition(
            f"release store: {path} ({what}) was drawn or trained with a fixed noise seed: {FIXED_SEED_WARNING}. "
            "A daemon without --simulation never serves it: delete that file and its .safetensors (a merge is then "
            "made anew and charged; a segment is no longer offered), or start the daemon with --simulation"
        )


def _pool_records(directory: Path) -> list[tuple[str, Mapping]]:
    """(model name, its stored "dpsgd" record dict) of every model manifest of a pool directory."""
    out = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        record = manifest.get("metadata", {}).get("record") if isinstance(manifest, dict) else None
        if isinstance(record, Mapping):
            out.append((path.stem, record))
    return out


def _fixed_seed_releases(directory: Path) -> list[tuple[str, str]]:
    """(file, what) of every release-store entry whose record says fixed-seed (read from the
    entries' JSON only; an unreadable entry is left to the check made before serving it)."""
    from peer.base.records import ReleaseRecord

    out = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            record = ReleaseRecord.from_json(entry["record_json"])
        except (OSError, ValueError, KeyError, TypeError, InvalidArgument):
            continue
        if any(r.randomness == "fixed-seed" for r in (record, *record.components)):
            segment = record.parameters.get("segment")
            what = (
                f"segment of run {segment.get('run')!r} round {segment.get('round')}"
                if isinstance(segment, Mapping)
                else f"{record.mechanism} of {record.subject!r}"
            )
            out.append((str(path), what))
    return out


def check_seed_allowed(config: SiteConfig, simulation: bool) -> None:
    """A fixed noise seed makes every release reproducible, hence not private: ``peer serve``
    refuses one unless started with ``--simulation`` (FailedPrecondition naming the field)."""
    if config.seed is not None and not simulation:
        where = f" in {config.path}" if config.path else ""
        raise FailedPrecondition(
            f"site.seed{where}: a fixed noise seed is not private (anyone who knows it can subtract the noise); "
            "remove it for production (noise is then CSPRNG-seeded, fresh per release) or start the daemon with "
            "--simulation for tests and simulations"
        )


def _limit_arenas(arenas: int = 2) -> None:
    """glibc's ``mallopt(M_ARENA_MAX, arenas)``: by default each thread that allocates while
    another holds the heap gets an arena of its own (up to 8 per core), and each keeps what its
    thread freed; a daemon's workers run short releases, so a few shared arenas hold less for
    the same work. A no-op where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-8, arenas)  # M_ARENA_MAX (malloc.h)


def _malloc_trim():
    """glibc's ``malloc_trim(0)``: hand the free pages of the heap back to the OS. Freed memory
    otherwise stays resident in the process (glibc keeps it for later allocations): after
    start-up a daemon of the bundled scenarios holds about 30 MB it no longer uses. A no-op
    where the C library is not glibc."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    fn.argtypes = [ctypes.c_size_t]
    return lambda: fn(0)


def serve(
    config_path: str | os.PathLike, insecure: bool = False, ready_file: str | None = None, simulation: bool = False
) -> int:
    """Run a daemon until SIGTERM/SIGINT (the ``privfusion peer serve`` command). A ``seed`` in
    site.toml, a pool model trained with a fixed seed and a stored release drawn with one are
    refused unless ``simulation`` (:func:`check_seed_allowed`, :func:`check_servable`)."""
    configure_logging(os.environ.get("PRIVFUSION_LOG_LEVEL", "INFO"))
    faulthandler.enable()  # a crash in native code leaves the Python stacks in the log
    check_seed_allowed(SiteConfig.load(config_path), simulation)
    _limit_arenas()  # before the gRPC and worker threads exist
    daemon = Daemon(open_site(config_path, insecure=insecure, simulation=simulation))
    try:
        port = daemon.start()
    except BaseException:
        daemon.site.close()  # the ledger and its lock
        raise
    stop = threading.Event()

    def on_signal(signum, _frame):
        log_event("signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    trim = _malloc_trim()
    trim()  # start-up's transient buffers (model and pool loading, profile warm-up) back to the OS
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"port": port, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    # Python runs signal handlers in the main thread, but the kernel may deliver the signal to
    # any thread (gRPC's, the workers'): a wait that never wakes up would miss it. Poll.
    polls = 0
    while not stop.wait(0.2):
        polls += 1
        if polls % 25 == 0:
            trim()  # every 5 s: what finished releases freed (many daemons share one small machine)
    daemon.stop()
    return 0
