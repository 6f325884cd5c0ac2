"""One site: its configuration (``[site]`` of site.toml) and everything it serves from.

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
    # metrics_listen = "127.0.0.1:9464"  # opt-in Prometheus endpoint (peer.net.metrics); absent: none
    # seed = 7                       # simulations only (`peer serve --simulation`): fixed-seed
    #                                # noise, "fixed seed: not private" in logs, info and every record
    declared_records = 1000          # PUBLIC record count DP-SGD divides by under add-remove
    #                                # adjacency (pool train, iterate): never the true count

    [site.mechanisms]                # public defaults of the local-DP mechanisms
    activation_clip = [0.0, 4.0]     # activation range when a caller gives none
    calibration = "analytic"         # Gaussian calibration of released weights

    [site.pools.digits]              # a DP-SGD pool for RS/LC merges (models trained on the same data)
    models = "pool"
    # selection = "public-prior"     # how pi / lambda are chosen: from the models' training records
    #                                # and their declared "prior_utility" (else each model's own
    #                                # epsilon): free; or "utility": scores a public subset of the
    #                                # models and is charged the composition of that subset
    # validation = "validation.npz"  # with selection = "utility": held-out (x, y) that scores the
    #                                # candidates (never the pool's training records); default: the
    #                                # split the models' metadata "data" describes

    [site.peers.hospital-b]          # where pinned peers listen (Fuse dials them)
    address = "10.0.0.2:50051"

    [policy]                         # budgets, caps and who may ask for what: peer.budget.policy
    ...

:class:`SiteConfig` reads the ``[site]`` table with the project's one TOML reader
(``peer.base.config``): a bad value is refused naming the file, the line and the key.

:class:`Site` is what the gRPC service asks: who we are and whom we trust, the models, pools
and probe set on offer, where noise comes from, the policy and the ledger, and the releases
themselves (:meth:`Site.features`, :meth:`Site.weights`, :meth:`Site.merge`: the core's math
with this site's public defaults). It holds plain values only — no protobuf, no gRPC — so the
service converts at its edge (``peer.net.codec``) and the site can be driven without a server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from peer.base.config import Section, load_toml
from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unsupported
from peer.base.records import FIXED_SEED_WARNING, ReleaseRecord
from peer.base.rng import Randomness, make_randomness
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy
from peer.desk import make
from peer.desk.desk import ReleaseDesk
from peer.desk.events import log_event
from peer.desk.kinds import IssuedMerge, IssuedSegment
from peer.desk.make import FeaturesRelease, GroupFeaturesRelease, stamp
from peer.desk.requests import MergeRequest, SegmentRequest
from peer.desk.store import ReleaseStore
from peer.net.address import check_listen
from peer.net.client import PeerClient, PeerError
from peer.net.identity import CERT_FILE, KEY_FILE, Identity, check_site_name, load_identity
from peer.net.limits import Limits
from peer.net.peer_info import BudgetInfo, LayerInfo, ModelInfo, PoolInfo, SiteInfo
from peer.net.trust import PinnedPeer, TrustStore
from peer.nn.architectures import hidden_sizes, weight_layers
from peer.nn.probes import read_probe
from peer.nn.store import StoredModel, list_models, load_store, site_unusable_files

log = logging.getLogger("privfusion.peer")

#: The mechanisms a site releases under (PeerInfo.mechanisms, with where its noise comes from).
MECHANISMS = ("laplace", "multibit", "gaussian", "rs-merge", "lc-merge")


# ------------------------------------------------------------------------ configuration

#: The keys of ``[site]``.
SITE_KEYS = (
    "name",
    "listen",
    "identity",
    "models",
    "ledger",
    "probe",
    "workers",
    "reserve_workers",
    "max_calls_per_peer",
    "stream_idle_s",
    "stream_deadline_s",
    "shutdown_grace_s",
    "seed",
    "declared_records",
    "metrics_listen",
    "mechanisms",
    "pools",
    "peers",
    "own_models",
)


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
    # the public record count DP-SGD divides by under add-remove (pool train, iterate runs)
    declared_records: int | None = None
    activation_clip: tuple[float, float] | None = None
    calibration: str = "analytic"
    pools: Mapping[str, Path] = field(default_factory=dict)
    peers: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None
    pool_validation: Mapping[str, Path] = field(default_factory=dict)
    # how each pool's merges choose pi / lambda (peer.dp.merging): "public-prior" unless set
    pool_selection: Mapping[str, str] = field(default_factory=dict)
    # the site's own networks (``privfusion model import``; default DIR/own_models when it exists)
    own_models: Path | None = None
    # where the opt-in Prometheus endpoint listens (peer.net.metrics); None: no endpoint
    metrics_listen: str | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> SiteConfig:
        p = Path(path)
        data, text = load_toml(p, "site config")
        return cls.from_section(Section(data, (), text, str(p)), p.resolve().parent, p)

    @classmethod
    def from_section(cls, root: Section, base: Path, path: Path | None = None) -> SiteConfig:
        """The ``[site]`` table of a parsed file (``root``: the whole file); every error names
        the file, the line and the key."""
        site = root.section("site", required=True)
        site.known(SITE_KEYS)

        def rel(s: Section, key: str, default: Any = ...) -> Path | None:
            v = s.path(key, base, default)
            return None if v is None else v.resolve()

        def checked(s: Section, key: str, check: Callable[[str, str], str]) -> str:
            """A string that ``check(value, field)`` accepts; its refusal names the file and line."""
            value = s.string(key)
            try:
                return check(value, f"site.{key}")
            except InvalidArgument as e:
                s.fail(key, e.rule)

        mechanisms = site.section("mechanisms")
        mechanisms.known(("activation_clip", "calibration"))
        clip = mechanisms.interval("activation_clip", None)
        calibration = mechanisms.string("calibration", "analytic", choices=("analytic", "classical"))
        pools, pool_validation, pool_selection = {}, {}, {}
        for name, t in site.sections("pools").items():
            t.known(("models", "validation", "selection"))
            pools[name] = rel(t, "models")
            if "validation" in t:
                pool_validation[name] = rel(t, "validation")
            pool_selection[name] = t.string("selection", "public-prior", choices=("public-prior", "utility"))
        peers = {}
        for name, t in site.sections("peers").items():
            try:
                check_site_name(name, f"site.peers.{name}")
            except InvalidArgument as e:
                t.fail((), e.rule)
            t.known(("address",))
            peers[name] = t.string("address")
        deadline = site.number("stream_deadline_s", 600.0, exclusive_minimum=0.0)
        idle = site.number("stream_idle_s", 30.0, exclusive_minimum=0.0)
        if idle > deadline:
            site.fail("stream_idle_s", f"must be at most site.stream_deadline_s ({deadline:g}), got {idle:g}")
        return cls(
            name=checked(site, "name", check_site_name),
            listen=checked(site, "listen", check_listen),
            identity=rel(site, "identity"),
            models=rel(site, "models"),
            ledger=rel(site, "ledger"),
            probe=rel(site, "probe", None),
            workers=site.integer("workers", 32, minimum=1),
            reserve_workers=site.integer("reserve_workers", 8, minimum=1),
            max_calls_per_peer=site.integer("max_calls_per_peer", 8, minimum=1),
            stream_idle_s=idle,
            stream_deadline_s=deadline,
            shutdown_grace_s=site.number("shutdown_grace_s", 20.0, minimum=0.0),
            seed=site.integer("seed", None),
            declared_records=site.integer("declared_records", None, minimum=1),
            activation_clip=clip,
            calibration=calibration,
            pools=pools,
            peers=peers,
            path=path,
            pool_validation=pool_validation,
            pool_selection=pool_selection,
            own_models=rel(site, "own_models", None)
            if "own_models" in site
            else ((base / "own_models").resolve() if (base / "own_models").is_dir() else None),
            metrics_listen=checked(site, "metrics_listen", check_listen) if "metrics_listen" in site else None,
        )

    @property
    def limits(self) -> Limits:
        return Limits(
            self.workers, self.reserve_workers, self.max_calls_per_peer, self.stream_idle_s, self.stream_deadline_s
        )


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
            raise FailedPrecondition(
                f"site.ledger: {ledger} is in use by another daemon (pid {owner}, lock "
                f"{self.path}); two daemons must never share one ledger"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def load_probe(path: Path) -> np.ndarray:
    """A site's public probe set: the tensor ``x`` of a safetensors file, finite values only."""
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


# (what a site says about itself, SiteInfo and its parts, is in peer.net.peer_info)


# ------------------------------------------------------------------------ the site


class Site:
    """Everything one site serves from, loaded once at start (what the service asks about)."""

    def __init__(self, config: SiteConfig, policy: Policy, insecure: bool = False, simulation: bool | None = None):
        self.config = config
        self.insecure = insecure
        # whether releases drawn or trained with a fixed seed may leave (``peer serve
        # --simulation``); default: a site with a fixed seed of its own is a simulation
        self.simulation = config.seed is not None if simulation is None else bool(simulation)
        self.identity: Identity = load_identity(config.identity)
        if self.identity.name != config.name:
            raise FailedPrecondition(
                f"site.name is {config.name!r} but the identity in {config.identity} is {self.identity.name!r}"
            )
        self.name = config.name
        self.lock = SiteLock(config.ledger)  # before anything opens the ledger
        try:
            self._load(config, policy)
        except BaseException:
            self.lock.release()
            raise

    def _load(self, config: SiteConfig, policy: Policy) -> None:
        self._identity_lock = threading.Lock()
        self._identity_version = self._identity_files()
        self.trust = TrustStore(self.identity.trust_dir)
        self._pins: tuple[tuple, dict[str, PinnedPeer], list[PinnedPeer]] = ((), {}, [])
        self._pins_lock = threading.Lock()
        # what the daemon will not serve, and why (a warning each; GetPeerInfo lists them): a
        # model that does not load, a pool with no model yet or a probe set not made yet is
        # left out rather than fatal
        t0 = time.monotonic()
        log_event("loading-models", models=str(config.models))
        self.models, failed = load_store(config.models)
        self.unusable = site_unusable_files(
            config.models,
            config.pools,
            config.probe,
            config.path.resolve().parent if config.path else config.models.parent,
            failed,
        )
        for path, why in self.unusable:
            log.warning(json.dumps({"event": "unusable-file", "path": path, "reason": why}))
        pools = {n: d for n, d in config.pools.items() if d.is_dir() and list_models(d)}
        self.pools: dict[str, list] = {}
        self._validation: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._rs_utilities: dict[str, list[float]] = {}
        log_event("models-loaded", models=len(self.models), seconds=round(time.monotonic() - t0, 3))
        if pools:
            t0 = time.monotonic()
            log_event("loading-pools", pools=sorted(pools))
            # lazy: peer.dp loads dp_accounting (slow to import), needed only by a site with pools
            from peer.dp.merging import check_pool
            from peer.dp.pools import load_pool, load_validation_file, pool_validation, rs_utilities, warm_pool_profiles

            self.pools = {name: load_pool(d) for name, d in pools.items()}
            for pool in self.pools.values():
                check_pool(pool)
            # pools whose merges score candidates (selection = "utility", charged): the held-out
            # split each was trained beside, or the site's validation file, and each model's
            # accuracy there (fixed while the daemon runs; a merge reads those of the public
            # subset it scores). A public-prior pool reads neither.
            scored = [name for name in self.pools if self.pool_selection(name) == "utility"]
            self._validation = {
                name: load_validation_file(config.pool_validation[name])
                if name in config.pool_validation
                else pool_validation(self.pools[name])
                for name in scored
            }
            self._rs_utilities = {name: rs_utilities(self.pools[name], self._validation[name]) for name in scored}
            # and the models' privacy profiles (PLD + RDP, kept by peer.dp.accounting for models
            # seen before): an RS request then pays for choosing π, not for T-step compositions
            # (read from each pool's profile cache on disk when a valid entry is there: a restart
            # does not compose them again)
            for name, pool in self.pools.items():
                # a pool RS cannot account (mixed adjacencies) is skipped here: each request says why
                with contextlib.suppress(InvalidArgument):
                    warm_pool_profiles(pool, pools[name])
            log_event("pools-loaded", pools=sorted(self.pools), seconds=round(time.monotonic() - t0, 3))
        probe = read_probe(config.probe, "site.probe") if config.probe and config.probe.exists() else None
        self.probe = probe.x if probe is not None else None
        # the input the probe set was made for (peer.nn.probes; None for a file of the previous version)
        self.probe_signature = probe.signature if probe is not None else None
        self.imported = self._load_imported(config)
        self.policy = policy
        t0 = time.monotonic()
        log_event("opening-ledger", ledger=str(config.ledger), checks="hash chain, totals and anchor")
        self.ledger = Ledger(config.ledger, policy)
        log_event("ledger-verified", ledger=str(config.ledger), seconds=round(time.monotonic() - t0, 3))
        self._master = make_randomness(config.seed) if config.seed is not None else None
        self._master_lock = threading.Lock()

    def _load_imported(self, config: SiteConfig) -> dict:
        """The site's own networks (``peer.nn.imported``) by name; one that does not load is
        listed as unusable, not fatal (like a built-in model)."""
        if config.own_models is None or not config.own_models.is_dir():
            return {}
        from peer.nn.imported import load_imported

        out = {}
        for name in list_models(config.own_models):
            try:
                out[name] = load_imported(config.own_models, name)
            except (InvalidArgument, NotFound) as e:
                why = f"own model does not load, not served: {e}"
                self.unusable.append((f"{config.own_models.name}/{name}.json", why))
                log.warning(json.dumps({"event": "unusable-file", "path": f"{name}.json", "reason": why}))
        return out

    def close(self) -> None:
        try:
            self.ledger.close()
        finally:
            self.lock.release()

    # ---- identity -----------------------------------------------------------------------------

    def _identity_files(self) -> tuple:
        """(inode, mtime, size) of the key and the certificate file (None where missing)."""
        out = []
        for name in (KEY_FILE, CERT_FILE):
            try:
                st = (Path(self.config.identity) / name).stat()
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def refresh_identity(self) -> str | None:
        """Put this site's key and certificate back in step with its identity files (after
        ``privfusion peer rotate --activate``, no restart needed): the new pair's fingerprint
        when it is now in use, else None. Two stats when nothing changed (the daemon asks at
        every TLS handshake). A pair that does not load — caught mid-rotation, a key others can
        read, a certificate of another site — leaves the current one in use and is logged;
        the next change of the files is tried again. Calls on connections opened before keep
        the certificate of their handshake; receipts are signed with the key in use, so during
        the rotation's overlap (peers pin both) either verifies."""
        version = self._identity_files()
        with self._identity_lock:
            if version == self._identity_version:
                return None
            self._identity_version = version
            try:
                new = load_identity(self.config.identity)
                if new.name != self.name:
                    raise FailedPrecondition(f"its certificate names {new.name!r}, this site is {self.name!r}")
            except (NotFound, FailedPrecondition, InvalidArgument, PermissionDenied) as e:
                log.warning(
                    "identity files changed but do not load (%s); still serving as %s", e, self.identity.fingerprint
                )
                return None
            if new.fingerprint == self.identity.fingerprint:
                return None
            self.identity = new
            return new.fingerprint

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

    def client_for(self, partner: str) -> PartnerClient:
        """A client of a pinned partner this site knows the address of (site.toml [site.peers])."""
        address = self.config.peers.get(partner)
        if address is None:
            raise FailedPrecondition(
                f"partner: {self.name!r} does not know where {partner!r} listens (site.toml [site.peers.{partner}])",
                reason="PARTNER_UNKNOWN",
                metadata={"partner": partner},
            )
        if partner not in self.pinned():
            raise FailedPrecondition(
                f"partner: {partner!r} is not pinned at {self.name!r}",
                reason="PARTNER_NOT_PINNED",
                metadata={"partner": partner},
            )
        return PartnerClient(PeerClient(self.identity, address, peer=partner, insecure=self.insecure, trust=self.trust))

    # ---- what is offered ----------------------------------------------------------------------

    def model(self, name: str, field_name: str = "model", own: bool = False):
        """The model ``name`` on offer: a built-in ``StoredModel`` or, with ``own`` (the
        releases that work per permutation group: ReleaseFeatures, ReleaseWeights), a site's
        own network (``peer.nn.imported.ImportedModel``)."""
        if not name:
            raise InvalidArgument(field_name, "is required")
        m = self.models.get(name)
        if m is None:
            if name in self.imported:
                if own:
                    return self.imported[name]
                raise FailedPrecondition(
                    f"{field_name}: {name!r} is a site's own network: it is released by ReleaseFeatures and "
                    "ReleaseWeights (method ldp) or through its DP pools (method merged), not by this call",
                    reason="MODEL_KIND_UNSUPPORTED",
                    metadata={"field": field_name},
                )
            raise NotFound(f"{field_name}: {self.name!r} offers no model {name!r}")
        return m

    @staticmethod
    def architecture_of(model) -> Mapping[str, Any]:
        """The public architecture a release of ``model`` carries (an own network's: its traced
        structure and digest, never its code): the model store's ``release_architecture``."""
        return model.release_architecture

    def own_module(self, own):
        """A fresh instance of a site's own network holding its stored state (built by the
        site's factory: site code, run here only; fresh per release, as a release hooks it)."""
        from peer.nn.imported import load_factory, module_from_arrays

        factories = self.__dict__.setdefault("_own_factories", {})
        if own.factory not in factories:
            base = self.config.path.resolve().parent if self.config.path else self.config.models.parent
            try:
                factories[own.factory] = load_factory(own.factory, [base])
            except InvalidArgument as e:
                raise FailedPrecondition(
                    f"model: {own.name!r}'s factory cannot be loaded at this site: {e}; nothing was charged",
                    reason="MODEL_FACTORY_UNAVAILABLE",
                ) from None
        try:
            return module_from_arrays(factories[own.factory], own.structure, own.arrays)
        except Unsupported as e:  # the site's module itself (aliased keys): not the caller's fault
            raise FailedPrecondition(f"model: {own.name!r} cannot be released: {e}; nothing was charged") from None

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

    def pool_selection(self, name: str) -> str:
        """How merges of pool ``name`` choose π / λ: "public-prior" (default) or "utility"."""
        return self.config.pool_selection.get(name, "public-prior")

    def activation_clip(self, requested: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """The public activation range: the caller's (checked by the service), else the site's
        default (None: the mechanism's own default, which exists only for bounded activations)."""
        return requested if requested is not None else self.config.activation_clip

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

    def check_randomness(self, record: ReleaseRecord, what: str) -> None:
        """Refuse (FailedPrecondition, nothing charged) a data-level release whose record says
        it was trained or drawn with a fixed seed — a pool model of ``pool train --seed``, a
        segment of a simulation — unless this site is a simulation (``peer serve --simulation``):
        anyone who knows the seed reproduces the noise."""
        if self.simulation:
            return
        fixed = [r for r in (record, *record.components) if r.randomness == "fixed-seed"]
        if fixed:
            raise FailedPrecondition(
                f"{what} was trained or drawn with a fixed noise seed (seed {fixed[0].seed}: {FIXED_SEED_WARNING}); "
                "a daemon started without --simulation does not serve it"
            )

    # ---- releases: the desk's (peer.desk), kept here as thin entry points -------------------

    @property
    def desk(self):
        """A release desk over this site (no transport: its releases are not signed; the
        service and ``privfusion merge`` make their own with one)."""
        desk = self.__dict__.get("_desk")
        if desk is None:
            desk = self.__dict__.setdefault("_desk", ReleaseDesk(self))
        return desk

    def perturbed_weights(self, stored, epsilon: float, delta: float, randomness: Randomness | None = None):
        """``peer.desk.make.perturbed_weights`` with this site's defaults (not charged)."""
        return make.perturbed_weights(self, stored, epsilon, delta, randomness)

    def features(self, stored, probe: np.ndarray, **options: Any):
        """``peer.desk.make.features`` with this site's defaults (not charged)."""
        return make.features(self, stored, probe, **options)

    def group_features(self, own, probe: np.ndarray, **options: Any):
        """``peer.desk.make.group_features`` with this site's defaults (not charged)."""
        return make.group_features(self, own, probe, **options)

    def weights(self, stored, epsilon: float, delta: float, caller: str, on_behalf_of: str | None = None):
        """``peer.desk.make.weights`` with this site's defaults (not charged)."""
        return make.weights(self, stored, epsilon, delta, caller, on_behalf_of)

    def merge(self, pool: str, method: str, epsilon: float, delta: float, caller: str):
        """``peer.desk.make.merge`` of this site's pool (not stored, not charged)."""
        return make.merge(self, pool, method, epsilon, delta, caller)

    @property
    def releases(self):
        """The store of this site's data-level releases (``LEDGER_STEM.releases/`` beside the ledger)."""
        store = self.__dict__.get("_releases")
        if store is None:
            ledger = self.config.ledger
            store = self.__dict__.setdefault("_releases", ReleaseStore(ledger.with_name(ledger.stem + ".releases")))
        return store

    def merge_release(self, pool: str, method: str, epsilon: float, delta: float, caller: str) -> IssuedMerge:
        """The merge served or charged by the desk (``ReleaseDesk.merged``), unsigned."""
        return self.desk.merged(MergeRequest(caller, pool, method, epsilon, delta))

    def segment_release(self, run: str, min_round: int, caller: str, max_round: int | None = None) -> IssuedSegment:
        """The segment served again by the desk (``ReleaseDesk.segment``), unsigned."""
        return self.desk.segment(SegmentRequest(caller, run, min_round, max_round))

    def _serve_again(self, stored, caller: str, what: str, detail: str, **log_fields: Any) -> IssuedMerge | None:
        return self.desk.serve_again(stored, caller, what, detail, IssuedMerge, **log_fields)

    # ---- policy and ledger --------------------------------------------------------------------

    def policy_allows(self, caller: str, kind: str) -> None:
        """PermissionDenied unless the policy lets ``caller`` ask for ``kind`` (checked before
        any work; the per-request caps are checked by the ledger in the budget's unit)."""
        if kind == "info":
            return  # every pinned peer may see who we are
        if not self.policy.allows(caller, kind):
            raise PermissionDenied(f"{self.name!r}'s policy does not let {caller!r} ask for {kind}")

    def ledger_entries(self, caller: str):
        for e in self.ledger.entries(counterparty=caller):
            yield str(e.entry_id), e.record, e.charged_at

    def peer_info(self, caller: str) -> SiteInfo:
        """Who we are and what we offer, for ``caller``: models with every weight layer's name
        and shapes (public: they follow from the architecture, so a caller can fill a
        layer-keyed request without a charged release first), pools and the merges they allow,
        mechanisms, and the budgets the policy lets ``caller`` see."""

        def model_info(name: str, m: StoredModel) -> ModelInfo:
            layers = weight_layers(m.architecture)
            return ModelInfo(
                name=name,
                architecture=m.architecture,
                parameter_count=sum(int(a.size) for a in m.arrays.values()),
                hidden_sizes=tuple(hidden_sizes(m.architecture)),
                layers=tuple(
                    LayerInfo(
                        name=layer.name,
                        kind=layer.kind,
                        weight_shape=tuple(m.arrays[f"{layer.name}.weight"].shape),
                        bias_shape=tuple(m.arrays[f"{layer.name}.bias"].shape),
                        hidden=i < len(layers) - 1,
                    )
                    for i, layer in enumerate(layers)
                ),
            )

        pools = []
        if self.pools:
            # lazy: peer.dp loads dp_accounting (slow to import); the site has pools, so it is loaded
            from peer.dp.accounting import TrainingRecord

            for name, members in self.pools.items():
                lc = all(isinstance(m.privacy, TrainingRecord) for m in members)  # LC needs full training records
                pools.append(
                    PoolInfo(
                        name=name,
                        architecture=members[0].architecture,
                        members=tuple(m.name for m in members),
                        methods=("rs", "lc") if lc else ("rs",),
                    )
                )
        budgets = tuple(
            BudgetInfo(
                budget=s.key.name,
                scope=s.key.scope,
                epsilon_limit=s.epsilon_limit,
                delta_limit=s.delta_limit,
                epsilon_spent=s.spent_epsilon,
                epsilon_remaining=s.remaining_epsilon,
                releases=s.count,
            )
            for s in self.ledger.remaining_for(caller)
        )

        def imported_info(name: str, m) -> ModelInfo:
            # public: the traced structure (key names, shapes, groups) and its digest, no code;
            # hidden sizes are the permutation groups' sizes; no plain layer chain to list
            from peer.nn.imported import imported_architecture

            return ModelInfo(
                name=name,
                architecture=imported_architecture(m.structure),
                parameter_count=sum(int(np.size(a)) for a in m.arrays.values()),
                hidden_sizes=m.structure.sizes,
                layers=(),
            )

        return SiteInfo(
            name=self.name,
            certificate_sha256=self.identity.fingerprint,
            insecure=self.insecure,
            models=tuple(
                sorted(
                    [model_info(n, m) for n, m in self.models.items()]
                    + [imported_info(n, m) for n, m in self.imported.items() if n not in self.models],
                    key=lambda i: i.name,
                )
            ),
            pools=tuple(pools),
            mechanisms=(*MECHANISMS, self.randomness_mechanism()),
            budgets=budgets,
            has_probe_set=self.probe is not None,
            unusable=tuple(self.unusable),
        )


class PartnerClient:
    """A client of a partner site whose failures become this site's FAILED_PRECONDITION /
    UNAVAILABLE (the caller's budget here is not what ran out when the partner refuses)."""

    def __init__(self, client: PeerClient):
        self._client = client

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except PeerError as e:
                status = "UNAVAILABLE" if e.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "FAILED_PRECONDITION"
                # the partner's own reason travels in the metadata: this refusal is the partner's
                raise PeerError(
                    status,
                    f"partner {self._client.peer_name!r} refused or failed ({e.status}): {e}",
                    e.details,
                    reason="PARTNER_UNAVAILABLE" if status == "UNAVAILABLE" else "PARTNER_REFUSED",
                    metadata={
                        "partner": self._client.peer_name,
                        "partner_status": e.status,
                        **({"partner_reason": e.reason} if e.reason else {}),
                    },
                ) from None

        return call


#: Before the release desk, a segment was served as a ``MergeRelease``; kept for code that names it.
MergeRelease = IssuedMerge

__all__ = [
    "MECHANISMS",
    "SITE_KEYS",
    "BudgetInfo",
    "FeaturesRelease",
    "GroupFeaturesRelease",
    "LayerInfo",
    "MergeRelease",
    "ModelInfo",
    "PartnerClient",
    "PoolInfo",
    "Site",
    "SiteConfig",
    "SiteInfo",
    "SiteLock",
    "check_listen",
    "load_probe",
    "log_event",
    "stamp",
]
