"""The peer daemon: one site's models, pool, probe set, policy, trust and ledger behind gRPC.

``privfusion peer serve --config site.toml`` (all paths relative to the file)::

    [site]
    name = "hospital-a"              # must be the CN of the identity's certificate
    listen = "0.0.0.0:50051"
    identity = "identity"            # from `privfusion peer init` (site.key, site.crt, trusted/)
    models = "models"                # a peer.nn.store directory: the models this site offers
    ledger = "ledger.sqlite"         # the privacy-budget ledger (created on first start)
    probe = "probe.safetensors"      # optional: this site's public probe set (tensor "x"), for Fuse
    workers = 32                     # streaming calls (releases, ledger listings) served at once
    reserve_workers = 8              # more threads, kept for health checks and GetPeerInfo
    max_calls_per_peer = 8           # calls one peer may have in progress (health checks exempt)
    stream_idle_s = 30               # an upload (ReleaseFeatures' probe) sending nothing this long is cut
    stream_deadline_s = 600          # and one not finished after this long
    shutdown_grace_s = 20            # SIGTERM: in-flight releases get this long to finish
    # seed = 7                       # simulations only (`peer serve --simulation`): fixed-seed
    #                                # noise, "fixed seed: not private" in logs, info and every record

    [site.mechanisms]                # public defaults of the local-DP mechanisms
    activation_clip = [0.0, 4.0]     # activation range when a caller gives none
    calibration = "analytic"         # Gaussian calibration of released weights

    [site.pools.digits]              # a DP-SGD pool for RS/LC merges (models trained on the same data)
    models = "pool"
    # validation = "validation.npz"  # optional: held-out (x, y) that judges RS/LC candidates (public;
    #                                # never the pool's training records); default: the split the
    #                                # models' metadata "data" describes

    [site.peers.hospital-b]          # where pinned peers listen (Fuse dials them)
    address = "10.0.0.2:50051"

    [policy]                         # budgets, caps and who may ask for what: peer.budget.policy
    ...

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
(DEADLINE_EXCEEDED, nothing charged). The port is bound exclusively (no SO_REUSEPORT): a
second daemon on a taken port fails at start, naming the address.

SIGTERM/SIGINT: health turns NOT_SERVING, new releases are refused (nothing charged), in-flight
releases get ``shutdown_grace_s`` to finish; after that they are cancelled. A cancelled release
keeps its charge (bytes may have left) and gets a "send-failed" event in the ledger.

Logs are JSON lines on stderr: events, site names, record ids and public parameters only.
"""

from __future__ import annotations

import errno
import faulthandler
import fcntl
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import tomllib
import traceback
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from safetensors import SafetensorError
from safetensors.numpy import load_file

from peer.net.identity import Identity, check_site_name, fingerprint, load_identity
from peer.net.trust import PinnedPeer, TrustStore
from peer.net import wire
from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from peer.budget.ledger import Ledger
from peer.net.limits import Limits, LimitsInterceptor
from peer.budget.policy import Policy
from peer.base.records import FIXED_SEED_WARNING, ReleaseRecord
from peer.base.rng import Randomness, make_randomness
from peer.net.service import MECHANISMS, ErrorInterceptor, PeerService, add_to_server, log_event
from peer.nn.store import StoredModel, list_models, load_model
from privfusion.v1 import peer_pb2 as pb

log = logging.getLogger("privfusion.peer")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name


# ------------------------------------------------------------------------ configuration


def _get(table: Mapping, key: str, kind, where: str, default: Any = ...):
    if key not in table:
        if default is ...:
            raise InvalidArgument(f"{where}.{key}", "is required")
        return default
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidArgument(f"{where}.{key}", f"must be a {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True)
class SiteConfig:
    """The ``[site]`` table of site.toml, paths resolved against the file's directory."""

    name: str
    listen: str
    identity: Path
    models: Path
    ledger: Path
    probe: Path | None = None
    workers: int = 32
    shutdown_grace_s: float = 20.0
    reserve_workers: int = 8
    max_calls_per_peer: int = 8
    stream_idle_s: float = 30.0
    stream_deadline_s: float = 600.0
    seed: int | None = None
    activation_clip: tuple[float, float] | None = None
    calibration: str = "analytic"
    pools: Mapping[str, Path] = field(default_factory=dict)
    peers: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None
    pool_validation: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SiteConfig":
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise NotFound(f"site config {str(p)!r}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(str(p), f"is not valid TOML: {e}") from None
        return cls.from_mapping(data, p.resolve().parent, p)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Path, path: Path | None = None) -> "SiteConfig":
        site = data.get("site")
        if not isinstance(site, Mapping):
            raise InvalidArgument("site", "site.toml needs a [site] table")
        known = {"name", "listen", "identity", "models", "ledger", "probe", "workers", "shutdown_grace_s", "seed",
                 "mechanisms", "pools", "peers", "reserve_workers", "max_calls_per_peer", "stream_idle_s",
                 "stream_deadline_s"}
        extra = sorted(set(site) - known)
        if extra:
            raise InvalidArgument("site", f"unknown keys {extra}; known: {sorted(known)}")

        def rel(key: str, default: Any = ...) -> Path | None:
            v = _get(site, key, str, "site", default)
            return None if v is None else (base / v).resolve()

        mech = _get(site, "mechanisms", dict, "site", {})
        clip = mech.get("activation_clip")
        if clip is not None:
            if (not isinstance(clip, list) or len(clip) != 2 or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in clip)
                    or not clip[0] < clip[1] or not all(math.isfinite(c) for c in clip)):
                raise InvalidArgument("site.mechanisms.activation_clip", f"must be [low, high] with low < high, got {clip!r}")
            clip = (float(clip[0]), float(clip[1]))
        calibration = _get(mech, "calibration", str, "site.mechanisms", "analytic")
        if calibration not in ("analytic", "classical"):
            raise InvalidArgument("site.mechanisms.calibration", f"must be 'analytic' or 'classical', got {calibration!r}")
        pools, pool_validation = {}, {}
        for name, t in _get(site, "pools", dict, "site", {}).items():
            if not isinstance(t, Mapping):
                raise InvalidArgument(f"site.pools.{name}", "must be a table with `models`")
            extra = sorted(set(t) - {"models", "validation"})
            if extra:
                raise InvalidArgument(f"site.pools.{name}", f"unknown keys {extra}; known: ['models', 'validation']")
            pools[name] = (base / _get(t, "models", str, f"site.pools.{name}")).resolve()
            if "validation" in t:
                pool_validation[name] = (base / _get(t, "validation", str, f"site.pools.{name}")).resolve()
        peers = {}
        for name, t in _get(site, "peers", dict, "site", {}).items():
            check_site_name(name, f"site.peers.{name}")
            if not isinstance(t, Mapping):
                raise InvalidArgument(f"site.peers.{name}", "must be a table with `address`")
            peers[name] = _get(t, "address", str, f"site.peers.{name}")
        workers = _get(site, "workers", int, "site", 32)
        if workers < 1:
            raise InvalidArgument("site.workers", f"must be >= 1, got {workers}")
        grace = _get(site, "shutdown_grace_s", float, "site", 20.0)
        if not grace >= 0:
            raise InvalidArgument("site.shutdown_grace_s", f"must be >= 0, got {grace}")
        seed = _get(site, "seed", int, "site", None)
        limits = Limits(workers=workers, reserve_workers=_get(site, "reserve_workers", int, "site", 8),
                        max_calls_per_peer=_get(site, "max_calls_per_peer", int, "site", 8),
                        stream_idle_s=_get(site, "stream_idle_s", float, "site", 30.0),
                        stream_deadline_s=_get(site, "stream_deadline_s", float, "site", 600.0))
        return cls(
            name=check_site_name(_get(site, "name", str, "site"), "site.name"),
            listen=check_listen(_get(site, "listen", str, "site")),
            reserve_workers=limits.reserve_workers, max_calls_per_peer=limits.max_calls_per_peer,
            stream_idle_s=limits.stream_idle_s, stream_deadline_s=limits.stream_deadline_s,
            identity=rel("identity"), models=rel("models"), ledger=rel("ledger"), probe=rel("probe", None),
            workers=workers, shutdown_grace_s=grace, seed=seed, activation_clip=clip, calibration=calibration,
            pools=pools, peers=peers, path=path, pool_validation=pool_validation,
        )


    @property
    def limits(self) -> Limits:
        return Limits(self.workers, self.reserve_workers, self.max_calls_per_peer, self.stream_idle_s,
                      self.stream_deadline_s)


def check_listen(listen: str, field: str = "site.listen") -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; port 0 = any free port), else a clear error."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(field, f"must be HOST:PORT with a port in 0..65535 (e.g. \"0.0.0.0:50051\"), got {listen!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise InvalidArgument(field, f"an IPv6 host is written in brackets, e.g. \"[::]:50051\"; got {listen!r}")
    return listen


class SiteLock:
    """An exclusive ``flock`` on ``LEDGER.lock``, held while a daemon serves from the ledger.

    The kernel drops it when the process dies (even by SIGKILL), so a crash never leaves a
    stale lock; the file holds the owner's pid for the error message only.
    """

    def __init__(self, ledger: Path):
        self.path = ledger.with_name(ledger.name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                owner = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(self._fd)
                self._fd = None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FailedPrecondition(f"site.ledger: cannot lock {self.path}: {e.strerror}") from None
            raise FailedPrecondition(f"site.ledger: {ledger} is in use by another daemon (pid {owner}, lock "
                                     f"{self.path}); two daemons must never share one ledger") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


# ------------------------------------------------------------------------ the site


class Site:
    """Everything one site serves from, loaded once at start (what the service asks about)."""

    def __init__(self, config: SiteConfig, policy: Policy, insecure: bool = False):
        self.config = config
        self.insecure = insecure
        self.identity: Identity = load_identity(config.identity)
        if self.identity.name != config.name:
            raise FailedPrecondition(f"site.name is {config.name!r} but the identity in {config.identity} is {self.identity.name!r}")
        self.name = config.name
        self.lock = SiteLock(config.ledger)  # before anything opens the ledger
        try:
            self._load(config, policy)
        except BaseException:
            self.lock.release()
            raise

    def _load(self, config: SiteConfig, policy: Policy) -> None:
        self.trust = TrustStore(self.identity.trust_dir)
        self._pins: tuple[tuple, dict[str, PinnedPeer], list[PinnedPeer]] = ((), {}, [])
        self._pins_lock = threading.Lock()
        self.models: dict[str, StoredModel] = {n: load_model(config.models, n) for n in list_models(config.models)}
        self.pools: dict[str, list] = {}
        self._validation: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._rs_utilities: dict[str, list[float]] = {}
        if config.pools:
            from peer.dp.merging import check_pool
            from peer.dp.pools import load_pool, load_validation_file, pool_validation, rs_utilities

            self.pools = {name: load_pool(d) for name, d in config.pools.items()}
            for pool in self.pools.values():
                check_pool(pool)
            # the held-out split each pool was trained beside, or the site's validation file
            # (judges RS/LC candidates; public)
            self._validation = {name: load_validation_file(config.pool_validation[name]) if name in config.pool_validation
                                else pool_validation(pool) for name, pool in self.pools.items()}
            # each model's accuracy there: what RS maximises; fixed while the daemon runs
            self._rs_utilities = {name: rs_utilities(pool, self._validation[name]) for name, pool in self.pools.items()}
            # and the models' privacy profiles (PLD + RDP, kept by peer.dp.accounting for models
            # seen before): an RS request then pays for choosing π, not for T-step compositions
            from peer.dp.accounting import rs_profiles

            for pool in self.pools.values():
                try:
                    rs_profiles([m.privacy for m in pool])
                except InvalidArgument:
                    pass  # a pool RS cannot account (mixed adjacencies): each request says why
        self.probe = self._load_probe(config.probe) if config.probe else None
        self.policy = policy
        self.ledger = Ledger(config.ledger, policy)
        self._master = make_randomness(config.seed) if config.seed is not None else None
        self._master_lock = threading.Lock()

    @staticmethod
    def _load_probe(path: Path) -> np.ndarray:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise InvalidArgument("site.probe", f"{path} is not a readable safetensors file: {e}") from None
        if "x" not in tensors:
            raise InvalidArgument("site.probe", f"{path} must hold the probe inputs as tensor 'x'")
        x = tensors["x"]
        if not np.all(np.isfinite(x)):
            raise InvalidArgument("site.probe", "contains NaN or infinite values")
        return x

    def close(self) -> None:
        try:
            self.ledger.close()
        finally:
            self.lock.release()

    # ---- identity -----------------------------------------------------------------------------

    def _current_pins(self) -> tuple[tuple, dict[str, PinnedPeer], list[PinnedPeer]]:
        version = self.trust.version()
        with self._pins_lock:
            if version != self._pins[0]:
                self._pins = (version, self.trust.peers(), self.trust.pins())
            return self._pins

    def pinned(self) -> dict[str, PinnedPeer]:
        return self._current_pins()[1]

    def pinned_by_fingerprint(self, fp: str) -> PinnedPeer | None:
        """The pin with this fingerprint: a site's certificate, or the next one it rotates to."""
        for p in self._current_pins()[2]:
            if p.fingerprint == fp:
                return p
        return None

    def client_for(self, partner: str):
        """A client of a pinned partner this site knows the address of (site.toml [site.peers])."""
        from peer.net.client import PeerClient, PeerError

        address = self.config.peers.get(partner)
        if address is None:
            raise FailedPrecondition(f"partner: {self.name!r} does not know where {partner!r} listens (site.toml [site.peers.{partner}])")
        if partner not in self.pinned():
            raise FailedPrecondition(f"partner: {partner!r} is not pinned at {self.name!r}")
        return _PartnerClient(PeerClient(self.identity, address, peer=partner, insecure=self.insecure, trust=self.trust), PeerError)

    # ---- what is offered ----------------------------------------------------------------------

    def model(self, name: str, field_name: str = "model") -> StoredModel:
        if not name:
            raise InvalidArgument(field_name, "is required")
        m = self.models.get(name)
        if m is None:
            raise NotFound(f"{field_name}: {self.name!r} offers no model {name!r}")
        return m

    def pool(self, name: str):
        """The pool's models (``peer.dp.merging.PoolModel``)."""
        if not name:
            raise InvalidArgument("pool", "is required")
        p = self.pools.get(name)
        if p is None:
            raise NotFound(f"pool: {self.name!r} has no pool {name!r}")
        return p

    def pool_validation(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._validation[name]

    def rs_utilities(self, name: str) -> list[float]:
        return self._rs_utilities[name]

    def activation_clip(self, params: pb.FeaturesParams | None) -> tuple[float, float] | None:
        """The public activation range: the caller's, else the site's default (None: the
        mechanism's own default, which exists only for bounded activations)."""
        if params is not None and (params.HasField("activation_clip_low") or params.HasField("activation_clip_high")):
            if not (params.HasField("activation_clip_low") and params.HasField("activation_clip_high")):
                raise InvalidArgument("activation_clip_high" if params.HasField("activation_clip_low") else "activation_clip_low",
                                      "give both ends of the activation range, or neither")
            lo, hi = params.activation_clip_low, params.activation_clip_high
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise InvalidArgument("activation_clip_low", f"the range must be finite with low < high, got [{lo}, {hi}]")
            return (lo, hi)
        return self.config.activation_clip

    def randomness_mechanism(self) -> str:
        """Where this site's noise comes from, as listed in PeerInfo.mechanisms (no proto field
        needed): ``"randomness:csprng"`` or ``"randomness:fixed-seed (fixed seed: not private)"``."""
        if self._master is None:
            return "randomness:csprng"
        return f"randomness:fixed-seed ({FIXED_SEED_WARNING})"

    def randomness(self) -> Randomness | None:
        """Fresh CSPRNG noise per release; with a configured seed, the next child stream of it."""
        if self._master is None:
            return make_randomness()
        with self._master_lock:
            return self._master.spawn()

    def perturbed_weights(self, stored: StoredModel, epsilon: float, delta: float, randomness: Randomness | None = None):
        from peer.ldp.mechanisms import perturb_model_weights

        return perturb_model_weights(stored.architecture, stored.arrays, epsilon=epsilon, delta=delta,
                                     calibration=self.config.calibration,
                                     randomness=randomness or self.randomness())

    # ---- policy and ledger --------------------------------------------------------------------

    def policy_allows(self, caller: str, kind: str) -> None:
        """PermissionDenied unless the policy lets ``caller`` ask for ``kind`` (checked before
        any work; the per-request caps are checked by the ledger in the budget's unit)."""
        if kind == "info":
            return  # every pinned peer may see who we are
        if not self.policy.allows(caller, kind):
            raise PermissionDenied(f"{self.name!r}'s policy does not let {caller!r} ask for {kind}")

    def charge(self, record: ReleaseRecord, caller: str, kind: str | tuple[str, ...],
               on_behalf_of: str | None = None) -> str:
        """Charge ``record`` to ``caller`` (and, for a relayed release, also to the site it is
        finally for); the entry id."""
        also = (on_behalf_of,) if on_behalf_of else ()
        return str(self.ledger.charge(record, caller, kind=kind, also_counterparties=also).entry_id)

    def cancel(self, record: ReleaseRecord, reason: str) -> None:
        """Withdraw the charge of a release none of whose bytes went to the transport."""
        self.ledger.cancel(record.release_id, reason)

    def release_event(self, record: ReleaseRecord, event: str, detail: str = "") -> None:
        self.ledger.record_event(record.release_id, event, detail)

    def ledger_entries(self, caller: str):
        for e in self.ledger.entries(counterparty=caller):
            yield str(e.entry_id), e.record, e.charged_at

    def peer_info(self, caller: str) -> pb.PeerInfo:
        from peer.nn.architectures import hidden_sizes, weight_layers

        def model_info(name: str, m: StoredModel) -> pb.ModelInfo:
            # the layer names and shapes are public (they follow from the architecture), so a
            # caller can fill a layer-keyed request without a charged release first
            layers = weight_layers(m.architecture)
            return pb.ModelInfo(name=name, architecture_json=json.dumps(m.architecture, sort_keys=True),
                                parameter_count=sum(int(a.size) for a in m.arrays.values()),
                                hidden_sizes=hidden_sizes(m.architecture),
                                layers=[pb.LayerInfo(name=l.name, kind=l.kind,
                                                     weight_shape=list(m.arrays[f"{l.name}.weight"].shape),
                                                     bias_shape=list(m.arrays[f"{l.name}.bias"].shape),
                                                     hidden=i < len(layers) - 1)
                                        for i, l in enumerate(layers)])

        from peer.dp.accounting import TrainingRecord

        pools = []
        for name, members in self.pools.items():
            lc = all(isinstance(m.privacy, TrainingRecord) for m in members)  # LC needs full training records
            pools.append(pb.PoolInfo(name=name, architecture_json=json.dumps(members[0].architecture, sort_keys=True),
                                     members=[m.name for m in members], methods=["rs", "lc"] if lc else ["rs"]))
        budgets = [pb.BudgetInfo(budget=s.key.name, scope=s.key.scope, epsilon_limit=s.epsilon_limit,
                                 delta_limit=s.delta_limit, epsilon_spent=s.spent_epsilon,
                                 epsilon_remaining=s.remaining_epsilon, releases=s.count)
                   for s in self.ledger.remaining_for(caller)]
        return pb.PeerInfo(name=self.name, certificate_sha256=self.identity.fingerprint, protocol=wire.PROTOCOL,
                           insecure=self.insecure, models=[model_info(n, m) for n, m in sorted(self.models.items())],
                           pools=pools, mechanisms=[*MECHANISMS, self.randomness_mechanism()], budgets=budgets,
                           has_probe_set=self.probe is not None, max_chunk_bytes=wire.MAX_CHUNK_BYTES)


class _PartnerClient:
    """A client of a partner site whose failures become this site's FAILED_PRECONDITION /
    UNAVAILABLE (the caller's budget here is not what ran out when the partner refuses)."""

    def __init__(self, client, error_type):
        self._client = client
        self._error_type = error_type

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except self._error_type as e:
                status = "UNAVAILABLE" if e.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "FAILED_PRECONDITION"
                raise self._error_type(status, f"partner {self._client.peer_name!r} refused or failed ({e.status}): {e}", e.details) from None
        return call


# ------------------------------------------------------------------------ the server


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name}
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
            out["where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(record.exc_info[2])[-6:]]
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


SEED_WARNING = ("FIXED SEED: NOT PRIVATE. site.seed makes every release's noise reproducible by anyone who "
                "knows the seed, who can then subtract it. Simulations and tests only; every record says "
                f"{FIXED_SEED_WARNING!r}.")

INSECURE_WARNING = ("INSECURE MODE: this peer serves without TLS. Callers are not authenticated (any claimed "
                    "sender is believed), nothing is encrypted, and receipts are the only integrity check. "
                    "Never use this outside a sealed test network.")


class Daemon:
    """A running peer: the gRPC server, its services and the site behind them."""

    def __init__(self, site: Site):
        self.site = site
        self.service = PeerService(site)
        self.health = health.HealthServicer()
        self.interceptor = ErrorInterceptor()
        limits = site.config.limits
        self.limits = LimitsInterceptor(limits, site.name, self._describe_caller)
        # one thread per call for its whole life: `workers` for streaming calls, the reserve for
        # health checks and GetPeerInfo (peer.net.limits); the error interceptor wraps the limits,
        # so their refusals are mapped and logged like every other
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.threads, thread_name_prefix="peer"),
                                  interceptors=[self.interceptor, self.limits],
                                  # no SO_REUSEPORT: a second daemon on a taken port must fail, not share it
                                  options=wire.grpc_options() + [("grpc.so_reuseport", 0)],
                                  maximum_concurrent_rpcs=limits.threads * 4)
        add_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port: int | None = None
        self._stopped = threading.Event()

    def _describe_caller(self, context) -> str:
        pems = context.auth_context().get("x509_pem_cert") or []
        if not pems:
            return f"the caller at {context.peer()}"
        pinned = self.site.pinned_by_fingerprint(fingerprint(pems[0]))
        return repr(pinned.name) if pinned else "an unpinned certificate"

    def _credentials(self) -> grpc.ServerCredentials:
        ident = self.site.identity
        state = {"version": None}

        def configuration():
            roots = self.site.trust.bundle() or ident.cert_pem  # nothing pinned: only our own key could connect
            return grpc.ssl_server_certificate_configuration([(ident.key_pem, ident.cert_pem)], root_certificates=roots)

        def fetch():
            version = self.site.trust.version()
            if version == state["version"]:
                return None
            state["version"] = version
            log_event("trust-reloaded", pinned=sorted(self.site.pinned()))
            return configuration()

        state["version"] = self.site.trust.version()
        return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=True)

    def start(self) -> int:
        listen = self.site.config.listen
        try:
            if self.site.insecure:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, self._credentials())
        except RuntimeError:  # gRPC's "Failed to bind": say why in words
            self.port = 0
        if not self.port:
            raise FailedPrecondition(f"site.listen: cannot listen on {listen!r}: {_why_not_listening(listen)}")
        if self.site.insecure:
            log.warning(json.dumps({"event": "insecure", "warning": INSECURE_WARNING}))
            print(f"privfusion peer: WARNING: {INSECURE_WARNING}", file=sys.stderr, flush=True)
        if self.site.config.seed is not None:
            log.warning(json.dumps({"event": "fixed-seed", "warning": SEED_WARNING}))
            print(f"privfusion peer: WARNING: {SEED_WARNING}", file=sys.stderr, flush=True)
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log_event("serving", site=self.site.name, listen=self.site.config.listen, port=self.port,
                  tls=not self.site.insecure, models=sorted(self.site.models), pools=sorted(self.site.pools),
                  pinned=sorted(self.site.pinned()), probe_set=self.site.probe is not None,
                  fixed_seed=self.site.config.seed is not None)
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


def open_site(config_path: str | os.PathLike, insecure: bool = False) -> Site:
    config = SiteConfig.load(config_path)
    policy = Policy.from_toml(config_path)
    return Site(config, policy, insecure=insecure)


def check_seed_allowed(config: SiteConfig, simulation: bool) -> None:
    """A fixed noise seed makes every release reproducible, hence not private: ``peer serve``
    refuses one unless started with ``--simulation`` (FailedPrecondition naming the field)."""
    if config.seed is not None and not simulation:
        where = f" in {config.path}" if config.path else ""
        raise FailedPrecondition(
            f"site.seed{where}: a fixed noise seed is not private (anyone who knows it can subtract the noise); "
            "remove it for production (noise is then CSPRNG-seeded, fresh per release) or start the daemon with "
            "--simulation for tests and simulations")


def serve(config_path: str | os.PathLike, insecure: bool = False, ready_file: str | None = None,
          simulation: bool = False) -> int:
    """Run a daemon until SIGTERM/SIGINT (the ``privfusion peer serve`` command). A ``seed`` in
    site.toml is refused unless ``simulation`` (:func:`check_seed_allowed`)."""
    configure_logging(os.environ.get("PRIVFUSION_LOG_LEVEL", "INFO"))
    faulthandler.enable()  # a crash in native code leaves the Python stacks in the log
    check_seed_allowed(SiteConfig.load(config_path), simulation)
    daemon = Daemon(open_site(config_path, insecure=insecure))
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
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"port": port, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    # Python runs signal handlers in the main thread, but the kernel may deliver the signal to
    # any thread (gRPC's, the workers'): a wait that never wakes up would miss it. Poll.
    while not stop.wait(0.2):
        pass
    daemon.stop()
    return 0
