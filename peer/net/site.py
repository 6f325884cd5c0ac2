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

:class:`Site` holds what a daemon serves from: who we are and whom we trust, the models, pools
and probe set on offer, where noise comes from, the policy and the ledger. It holds plain values
only — no protobuf, no gRPC — so the service converts at its edge (``peer.net.codec``) and the
site can be driven without a server. Its releases are the release desk's (``peer.desk``: policy
→ make → record → charge → sign); the methods here that make or serve one are thin entry points.
One concept per file:

- ``peer.net.site_config`` — :class:`SiteConfig`, the ``[site]`` table, read with the project's
  one TOML reader (a bad value is refused naming the file, the line and the key);
- ``peer.net.site_lock`` — :class:`SiteLock`, one daemon per ledger;
- ``peer.net.site_identity`` — the site's key and certificate and its pinned peers, refreshed;
- ``peer.net.partners`` — clients of the partners it dials (Fuse);
- ``peer.net.site_offer`` — its models, pools, probe set and randomness;
- ``peer.net.peer_info`` — what it says about itself (GetPeerInfo).

Every name those define that was importable from here still is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
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
from peer.net.identity import Identity, load_identity
from peer.net.partners import PartnerClient, SitePartners
from peer.net.peer_info import BudgetInfo, LayerInfo, ModelInfo, PoolInfo, SiteInfo
from peer.net.secagg_wire import SecAggBoard
from peer.net.site_config import SITE_KEYS, SiteConfig, check_listen
from peer.net.site_identity import SiteIdentity
from peer.net.site_lock import SiteLock
from peer.net.site_offer import SiteOffer, load_probe
from peer.net.trust import PinnedPeer, TrustStore
from peer.nn.architectures import hidden_sizes, weight_layers
from peer.nn.probes import read_probe
from peer.nn.store import StoredModel, list_models, load_store, site_unusable_files

log = logging.getLogger("privfusion.peer")

#: The mechanisms a site releases under (PeerInfo.mechanisms, with where its noise comes from).
MECHANISMS = ("laplace", "multibit", "gaussian", "rs-merge", "lc-merge")


# ------------------------------------------------------------------------ the site


class Site(SiteIdentity, SitePartners, SiteOffer):
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
                f"site.name is {config.name!r} but the identity in {config.identity} is {self.identity.name!r}",
                reason="SITE_IDENTITY_MISMATCH",
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
        # the secure-aggregation messages this site's own run published, served to its peers
        self.secagg = SecAggBoard()
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
            raise PermissionDenied(
                f"{self.name!r}'s policy does not let {caller!r} ask for {kind}",
                reason="KIND_NOT_ALLOWED",
                metadata={"kind": kind},
            )

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


#: What a merge release was called before the release desk (``peer.desk.kinds``: an ``IssuedMerge``;
#: a segment, which was one too, is an ``IssuedSegment``); kept for code that names it.
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
