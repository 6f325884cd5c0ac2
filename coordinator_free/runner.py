"""Running a coordinator-free fusion round: the I/O around ``coordinator_free.rounds``.

``run_round(local, roster, config)`` dials every roster peer with this site's identity (mutual
TLS, pinned certificates), runs the steps of :mod:`coordinator_free.rounds` — health checks
first (all peers at once), then one thread per live peer (info → merged, or features → align
→ weights) — and fuses what arrived. It returns a :class:`RoundResult` and, unless told not to,
writes the fused model (a ``peer.nn.store`` entry whose metadata holds the round's record) and the
round report (JSON: every peer's steps, the signed receipts of every charged release, every
drop with its step, time and reason).

``privfusion round --config site.toml`` is the command (``coordinator_free.cli``).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free import after_fusion
from coordinator_free.roster import Roster, RosterSite
from coordinator_free.round_journal import MODEL_LEVEL_STEPS, RoundJournal, round_plan
from coordinator_free.rounds import (
    CHARGED_STEPS,
    RoundConfig,
    RoundState,
    charged_status,
    details_line,
    failure_reason,
    fusion_weights,
    public_view,
)
from peer.base.config import Section, load_toml
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import now_rfc3339
from peer.ldp.fusion import average_arrays
from peer.ldp.mechanisms import default_entry_bound
from peer.ldp.pipeline import Alignment, align, align_graphs
from peer.net.client import HEALTH_SERVICE, PeerClient, PeerError
from peer.net.codec import graph_from_release
from peer.net.identity import Identity, load_identity
from peer.net.site import SiteConfig
from peer.net.trust import TrustStore
from peer.nn.architectures import model_from_arrays, validate_architecture, weight_layers
from peer.nn.graph import NetworkGraph, extract_graph
from peer.nn.store import StoredModel, load_model, save_model


@dataclass(frozen=True)
class LocalSite:
    """What the requester brings to its own round: who it is, its model, its public probe set."""

    identity: Identity
    trust: TrustStore
    model: StoredModel
    probe: np.ndarray
    activation_clip: tuple[float, float] | None = None
    # a site's own network (peer.nn.imported.ImportedModel): ``model`` then carries its public
    # architecture, state and preprocessing (if any); ``factory`` (site code, run only here)
    # rebuilds the module; the fused model and its stages are written to ``own_store`` under
    # the site's key names
    own: Any = None
    factory: Callable[[], Any] | None = None
    own_store: Path | None = None

    @property
    def name(self) -> str:
        return self.identity.name


@dataclass
class RoundResult:
    round_id: str
    status: str  # "fused" | "aborted" | "interrupted"
    reason: str
    report: dict
    arrays: dict[str, np.ndarray] | None
    model_name: str | None = None
    report_path: Path | None = None
    #: the fused model's later local stages ("selected", "repaired", "finetuned" → arrays; for
    #: a network with BatchNorm also "own_bn_reset", the reference of coordinator_free.after_fusion)
    stages: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: each contributor's aligned arrays as fused (in memory only: never written)
    contributions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


class _Failure:
    """A failed call: its status, message and whether it was charged."""

    def __init__(self, status: str, message: str, charged: str, details: dict | None = None):
        self.status, self.message, self.charged, self.details = status, message, charged, details


_STOP = object()  # the quorum became unreachable: stop asking


# ------------------------------------------------------------------------------ loading from files


def load_local_site(site_config: str | os.PathLike, model: str) -> LocalSite:
    """The requester's side of a round from its daemon's site.toml (identity, model store,
    probe set, default activation range)."""
    from peer.nn.probes import bound_probe, model_input

    cfg = SiteConfig.load(site_config)
    if cfg.probe is None:
        raise FailedPrecondition(f"{site_config}: a round needs this site's public probe set ([site].probe)")
    identity = load_identity(cfg.identity)
    if identity.name != cfg.name:
        raise FailedPrecondition(f"site.name is {cfg.name!r} but the identity in {cfg.identity} is {identity.name!r}")
    if cfg.own_models is not None and (cfg.own_models / f"{model}.json").is_file():
        from peer.nn.imported import imported_architecture, load_factory, load_imported

        own = load_imported(cfg.own_models, model)
        site_dir = cfg.path.resolve().parent if cfg.path else cfg.own_models.parent
        return LocalSite(
            identity,
            TrustStore(identity.trust_dir),
            StoredModel(
                own.name,
                imported_architecture(own.structure),
                dict(own.arrays),
                dict(own.metadata),
                own.preprocessing,
            ),
            bound_probe(cfg.probe, model_input(own), model),  # rows of the input this network reads
            cfg.activation_clip,
            own=own,
            factory=load_factory(own.factory, [site_dir]),
            own_store=cfg.own_models,
        )
    stored = load_model(cfg.models, model)
    return LocalSite(
        identity,
        TrustStore(identity.trust_dir),
        stored,
        bound_probe(cfg.probe, model_input(stored), model),  # rows of the input this model reads
        cfg.activation_clip,
    )


def load_round_config(
    path: str | os.PathLike, default_clip: tuple[float, float] | None = None, site: str | None = None
) -> RoundConfig:
    """The ``[round]`` table of a file (site.toml or a separate round file).

    The roster is read too: a ``quorum`` larger than the sites a round can have (the roster's
    peers of ``site`` plus ``site``; without ``site``, every roster site plus the requester
    should it not be listed) could never be met, and is refused here, naming key and line.
    """
    p = Path(path)
    data, text = load_toml(p, "round file")
    if "round" not in data:
        raise InvalidArgument(f"round ({p})", "the file has no [round] table")
    section = Section(data["round"], ("round",), text, str(p))
    config = RoundConfig.from_section(section, p.resolve().parent, default_clip)
    roster = Roster.load(config.roster)
    sites = len(roster.peers_of(site)) + 1 if site is not None else len(roster.sites) + 1
    if config.quorum > sites:
        section.fail(
            "quorum",
            f"is {config.quorum}, but a round over the roster {config.roster} has only {sites} "
            f"sites ({'this one' if site is None else repr(site)} included): it could never fuse",
        )
    return config


# ------------------------------------------------------------------------------ the round


def _weight_boxes(arch: Mapping[str, Any], bound: float | None) -> dict[str, tuple[float, float]]:
    """Each weight layer's public box, as the peer's multi-bit release uses it."""
    return {
        s.name: (-(bound or default_entry_bound(s.fan_in)), bound or default_entry_bound(s.fan_in))
        for s in weight_layers(arch)
    }


def _same_architecture(theirs: Mapping[str, Any] | None, arch: Mapping[str, Any]) -> bool:
    from peer.nn.imported import is_imported_architecture, structure_of, structure_sha256

    if theirs is None:  # the peer sent an architecture that is not a JSON object
        return False
    try:
        if is_imported_architecture(arch) or is_imported_architecture(theirs):
            # a site's own network: the same traced structure, digest for digest
            return (
                is_imported_architecture(arch)
                and is_imported_architecture(theirs)
                and structure_sha256(structure_of(theirs)) == structure_sha256(structure_of(arch))
            )
        return validate_architecture(theirs) == validate_architecture(arch)
    except (ValueError, InvalidArgument):
        return False


def choose_model(info, wanted: str | None, arch: Mapping[str, Any], own_name: str) -> str | None:
    """The peer's model to ask for: the roster's choice, else one with our architecture
    (preferring our model's name)."""
    models = {m.name: m for m in info.models}
    if wanted is not None:
        m = models.get(wanted)
        return wanted if m is not None and _same_architecture(m.architecture, arch) else None
    fits = sorted(n for n, m in models.items() if _same_architecture(m.architecture, arch))
    return own_name if own_name in fits else (fits[0] if fits else None)


def choose_pool(info, wanted: str | None, arch: Mapping[str, Any], method: str) -> str | None:
    pools = {p.name: p for p in info.pools}
    fits = sorted(n for n, p in pools.items() if method in p.methods and _same_architecture(p.architecture, arch))
    if wanted is not None:
        return wanted if wanted in fits else None
    return fits[0] if fits else None


@dataclass(frozen=True)
class _OwnNetwork:
    """The requester's own network in a round (``peer.nn.imported``): its structure, its module
    (built by its own factory), the probe set shaped as its input. A peer's merged model is run
    in *this* module class, never in code from the peer."""

    local: LocalSite
    structure: Any
    module: Any
    probe_x: Any

    @classmethod
    def of(cls, local: LocalSite, probe: np.ndarray) -> _OwnNetwork:
        from peer.nn.imported import input_batch, module_from_arrays

        structure = local.own.structure
        module = module_from_arrays(local.factory, structure, local.own.arrays)
        return cls(local, structure, module, input_batch(structure, probe))

    def mismatch(self, info, wanted: str | None, method: str) -> str | None:
        """Why the peer's pool (the roster's, else any of a site's own network offering
        ``method``) is not our network, naming the first difference; None when it offers none."""
        pools = [p for p in info.pools if method in p.methods]
        return self._first_difference(pools, wanted, "pool")

    def model_mismatch(self, info, wanted: str | None) -> str:
        """Why no model the peer offers (the roster's, else any of a site's own network) is our
        network, naming the first difference."""
        found = self._first_difference(info.models, wanted, "model")
        return found or f"{info.name!r} offers no model {wanted or ''} of this network".replace("  ", " ")

    def _first_difference(self, offers, wanted: str | None, what: str) -> str | None:
        """The first difference between our structure and an offer's (``wanted`` by name, else
        any offer of a site's own network), or None."""
        from peer.nn.imported import check_same_structure, is_imported_architecture

        for offer in offers:
            if wanted is not None and offer.name != wanted:
                continue
            theirs = offer.architecture
            if theirs is None:
                continue
            if not is_imported_architecture(theirs) and wanted is None:
                continue
            try:
                check_same_structure(self.structure, theirs, f"{what} {offer.name!r}")
            except FailedPrecondition as e:
                return str(e)
        return None

    def _own_module(self):
        """A copy of our module for one peer's alignment: the round aligns its peers at once
        (one worker thread each), and the activation hooks each alignment puts on the module
        would otherwise fire in every other peer's pass through the shared one (its pairing
        then fails: "did not run the same hooked modules")."""
        import copy

        return copy.deepcopy(self.module)

    def features_alignment(self, release, clip) -> tuple[dict[str, np.ndarray], dict]:
        """A peer's group features release (``ReleaseFeatures`` of its own network) aligned to
        ours: its structure digest checked against ours (FailedPrecondition naming the first
        difference), its tensors against our structure, then :func:`_align_group_release` with
        our exact activations on the same probe rows, clipped to the public range the peer
        clipped its own to (None: its default, unknown here; then unclipped)."""
        from peer.ldp.group_matching import group_activations
        from peer.net.codec import group_features_from_release
        from peer.nn.imported import check_same_structure

        check_same_structure(self.structure, release.architecture, "the peer's features")
        theirs, features = group_features_from_release(
            self.structure, release.metadata, release.arrays, int(self.probe_x.shape[0])
        )
        ours = group_activations(self._own_module(), self.structure, self.probe_x)
        if clip is not None:
            ours = {g: np.clip(a, clip[0], clip[1]) for g, a in ours.items()}
        own_state = {k: v.detach().numpy().copy() for k, v in self.module.state_dict().items()}
        perms, diagnostics = _align_group_release(self.structure, ours, own_state, theirs, features)
        return perms, {
            "matcher": "factorised spectral matching over the permutation groups (our exact activations "
            "and weights against the peer's Laplace rows and multi-bit weight features)",
            "match": diagnostics,
            "permutations": {g: p.tolist() for g, p in perms.items()},
        }

    def aligned_weights(self, release, perms) -> dict[str, np.ndarray]:
        """A peer's PFA weights (``ReleaseWeights`` of its own network) permuted by ``perms``,
        after checking its structure digest and every tensor against ours."""
        from peer.net.codec import group_weights_from_release
        from peer.nn.imported import check_same_structure
        from peer.nn.tracing import permute_state

        check_same_structure(self.structure, release.architecture, "the peer's weights")
        return permute_state(self.structure, group_weights_from_release(self.structure, release.arrays), perms)

    def align(self, architecture, arrays, who: str) -> tuple[dict[str, np.ndarray], dict]:
        """The received state dict aligned to ours (activation matching on the probe set), after
        checking that its structure digest is ours (FailedPrecondition naming the first
        difference) and loading it, strictly, into our own module."""
        from peer.ldp.pipeline import align_groups
        from peer.nn.imported import check_same_structure, module_from_arrays

        check_same_structure(self.structure, architecture, f"{who}'s merged model")
        theirs = module_from_arrays(self.local.factory, self.structure, arrays)
        alignment = align_groups(self.structure, self._own_module(), theirs, self.probe_x)
        state = {k: v.detach().numpy().copy() for k, v in theirs.state_dict().items()}
        aligned = alignment.apply(self.structure, state)
        # the permutations stay in the requester's own report
        return aligned, {
            "matcher": "activation matching (unit correlations on the probe set, per permutation group)",
            "permutations": {g: p.tolist() for g, p in alignment.permutations.items()},
        }

    @property
    def kind(self) -> after_fusion.OwnNetworkKind:
        """How the steps after fusion run this network (``coordinator_free.after_fusion``)."""
        own = self.local.own
        return after_fusion.OwnNetworkKind(own.name, self.local.factory, self.structure, own.preprocessing)

    def state(self) -> dict[str, np.ndarray]:
        return self.kind.arrays(self.module)

    def fuse(self, contributions, weights) -> dict[str, np.ndarray]:
        """The weighted average of our state and the aligned contributions (every floating-point
        entry, BatchNorm statistics included: they describe no network until REPAIR or a
        BatchNorm reset re-estimates them, ``[round.repair]``)."""
        return self.kind.average([self.state(), *contributions], weights)

    def after_fusion_config(self, config: RoundConfig) -> RoundConfig:
        """``config`` with the own-network default of ``[round.repair] data``: "probe" when the
        round file does not set it (an own network's averaged BatchNorm statistics must be
        re-estimated, and the probe set is public), what it says otherwise ("off" included)."""
        if config.repair_set or config.repair != "off":
            return config
        return replace(config, repair="probe")


def _align_group_release(
    structure, own_acts: Mapping[str, np.ndarray], own_arrays, their_acts: Mapping[str, np.ndarray], their_arrays
) -> tuple[dict[str, np.ndarray], dict]:
    """How a peer's own network lines up with ours, from its local-DP group release: for every
    permutation group g, ``perm[g][i] = j`` (our unit i ↔ their unit j), and the matcher's
    diagnostics.

    Reads our exact activations and state (they never leave us) and the peer's noisy ones
    (Laplace activation rows, multi-bit weight features: post-processing of its release), and
    solves the joint problem over all groups with the factorised spectral matcher
    (``peer.ldp.matching.groups.match_group_features``: activation affinities per group, a
    Kronecker block per weight tensor between the groups it connects, then a per-group
    refinement that keeps only changes raising the objective; docs/matching.md, "Permutation
    groups")."""
    from peer.ldp.matching.groups import match_group_features

    result = match_group_features(structure, own_acts, own_arrays, their_acts, their_arrays)
    perms = {g: np.asarray(p, dtype=np.int64) for g, p in result.perms.items()}
    return perms, {"objective": float(result.objective), **result.diagnostics}


def _match_report(own: NetworkGraph, alignment: Alignment) -> dict:
    result = alignment.match
    # The permutations stay in the requester's own report: they are computed from its exact graph.
    return {
        "objective": alignment.objective,
        "solver": result.solver,
        "iterations": int(result.iterations),
        "converged": bool(result.converged),
        "permutations": {h.name: p.tolist() for h, p in zip(own.hidden, alignment.permutations, strict=True)},
    }


def _never_connected(details: str) -> bool:
    low = details.lower()
    return "failed to connect" in low or "connection refused" in low


@dataclass
class _Round:
    """One round in progress at the requester: what every step reads — the site, the round's
    config, the public probe set, our network (``own``: a site's own network, else the built-in
    architecture's graph ``own_graph`` and its public view ``own_public``) and one client per
    peer — and the bookkeeping every step writes (``state``: steps, drops, receipts, events).

    Which of the two kinds of network the round runs is decided once, in :func:`_open_round`
    (``own`` set or not); the steps below read it."""

    local: LocalSite
    config: RoundConfig
    state: RoundState
    peers: list[RosterSite]
    arch: Mapping[str, Any]
    probe: np.ndarray
    clip: tuple[float, float] | None
    own: _OwnNetwork | None
    own_graph: NetworkGraph | None
    own_public: NetworkGraph | None
    #: how the steps after fusion run our network (``coordinator_free.after_fusion``; None: built-in)
    kind: Any
    #: the site's own data for those steps (None when none is configured)
    local_data: Any
    clients: dict[str, PeerClient] = field(default_factory=dict)
    #: the journal of a named round (``coordinator_free.round_journal``; None: unnamed)
    journal: RoundJournal | None = None
    #: :func:`weights_signal` of the round (None: the ldp weights release carries signal)
    no_signal: dict | None = None

    # ------------------------------------------------------------------ one call to a peer

    def ask(self, name: str, step: str, call: Callable[[], Any], subject: str = ""):
        """``call()`` as step ``step`` of peer ``name``: its result, a :class:`_Failure` (the
        status, the reason, whether it may have charged), or ``_STOP`` once the quorum is out
        of reach or the round is stopping (then nothing is asked).

        In a rerun of a named round (``coordinator_free.round_journal``), what an earlier
        attempt got from this peer at this step for ``subject`` is reused instead: the release
        it received whole (not asked for again), or — charged, its bytes lost — a model-level
        release is not bought again (a failure that charged nothing) while a merge is asked for
        again (the peer serves the identical bytes again at no charge)."""
        journal = self.journal
        earlier = journal.earlier(name, step, subject) if journal is not None else None
        if earlier is not None and earlier.release is not None:
            if not self.state.begin(name, step):
                return _STOP
            self.state.charged(name, earlier.release.receipt, reused_from=earlier.round_id)
            self.state.delivered(name, step)
            return earlier.release
        if earlier is not None and step in MODEL_LEVEL_STEPS:
            if not self.state.begin(name, step):
                return _STOP
            if earlier.receipt is not None:
                status, what = "CHARGED_BEFORE", f"was charged (its ledger entry {earlier.receipt['ledger_entry_id']})"
            else:
                status, what = "MAYBE_CHARGED_BEFORE", "was asked for (and may have been charged: no receipt arrived)"
            return _Failure(
                status,
                f"{step} of {subject!r} {what} by {name!r} for attempt {earlier.round_id} of this round, but its "
                "bytes never arrived; a model-level release is not bought twice for one round, so this peer "
                "sits this attempt out",
                "no",
            )
        if not self.state.begin(name, step):
            return _STOP
        if journal is not None and step in CHARGED_STEPS:
            journal.asking(name, step, subject)  # before the call: the peer may charge from here on
        try:
            result = call()
        except PeerError as e:
            seen = self.state.receipt_seen(name, step)
            connected = not _never_connected(e.details)
            return _Failure(
                e.status,
                failure_reason(e.status, str(e), e.details, connected, self.config.call_timeout_s),
                charged_status(e.status, seen, connected),
                e.structured(),
            )
        except InvalidArgument as e:  # the release failed our checks (signature, checksums, order)
            return _Failure("INVALID_RELEASE", str(e), "yes" if self.state.receipt_seen(name, step) else "unknown")
        if self.journal is not None:
            self.journal.received(name, step, result)
        self.state.delivered(name, step)
        return result

    def check_health(self, p: RosterSite) -> None:
        """Whether ``p`` is alive: its standard health status, within the health timeout."""
        try:
            status = self.clients[p.name].health(HEALTH_SERVICE, timeout=self.config.health_timeout_s)
            serving = status == "SERVING"
            self.state.set_alive(p.name, serving, "" if serving else f"health status {status}")
        except Exception as e:
            code = getattr(e, "code", lambda: None)()
            self.state.set_alive(
                p.name,
                False,
                f"no health answer within {self.config.health_timeout_s:g}s"
                f" ({code.name if code is not None else type(e).__name__})",
            )

    def released_weights(self, p: RosterSite, c: PeerClient, model: str):
        """The peer's PFA weights of ``model`` (the second release of method ldp), or None once
        the peer is dropped (or the round is stopping)."""
        config = self.config
        w = self.ask(
            p.name,
            "weights",
            lambda: c.weights(
                model, epsilon=config.weights_epsilon, delta=config.weights_delta, timeout=config.call_timeout_s
            ),
            model,
        )
        if w is _STOP:
            return None
        if isinstance(w, _Failure):
            self.state.drop(p.name, "weights", w.status, w.message, w.charged, w.details)
            return None
        return w

    def released_features(self, p: RosterSite, c: PeerClient, model: str, **kw):
        """The peer's noisy graph features of ``model`` on our probe set (the first release of
        method ldp; ``kw``: the built-in architectures' unit and weight bound), or None once the
        peer is dropped (or the round is stopping)."""
        config = self.config
        f = self.ask(
            p.name,
            "features",
            lambda: c.features(
                model,
                self.probe,
                activation_epsilon=config.activation_epsilon,
                weight_epsilon=config.weight_epsilon,
                activation_clip=self.clip,
                timeout=config.call_timeout_s,
                **kw,
            ),
            model,
        )
        if f is _STOP:
            return None
        if isinstance(f, _Failure):
            self.state.drop(p.name, "features", f.status, f.message, f.charged, f.details)
            return None
        return f

    # ------------------------------------------------------------------ a peer's contribution

    def exchange_features(self, p: RosterSite, c: PeerClient, model: str):
        """Method ldp for a built-in architecture: features → match our public graph → weights
        → permute; the aligned arrays, or None once the peer is dropped."""
        arch, state = self.arch, self.state
        f = self.released_features(p, c, model, unit=self.config.unit, weight_bound=self.config.weight_bound)
        if f is None:
            return None
        if f.architecture is None or validate_architecture(f.architecture) != arch:
            state.drop(p.name, "features", "FAILED_PRECONDITION", "the features are of another architecture", "yes")
            return None
        state.begin(p.name, "align")
        try:
            alignment = align_graphs(self.own_public, graph_from_release(arch, f.metadata, f.arrays))
        except (InvalidArgument, ValueError) as e:
            state.drop(p.name, "align", "ALIGNMENT_FAILED", str(e), "n/a")
            return None
        w = self.released_weights(p, c, model)
        if w is None:
            return None
        try:
            aligned = alignment.apply(arch, w.arrays)
            model_from_arrays(arch, aligned)
        except InvalidArgument as e:
            state.drop(p.name, "weights", "INVALID_RELEASE", str(e), "yes")
            return None
        state.contributed(p.name, "ldp", _match_report(self.own_public, alignment))
        return aligned

    def exchange_group_features(self, p: RosterSite, c: PeerClient, model: str):
        """Method ldp for a site's own network: group features → align → weights → permute."""
        own, state = self.own, self.state
        f = self.released_features(p, c, model)
        if f is None:
            return None
        state.begin(p.name, "align")
        try:
            perms, report = own.features_alignment(f, self.clip)
        except FailedPrecondition as e:
            state.drop(p.name, "align", "FAILED_PRECONDITION", str(e), "n/a")
            return None
        except (InvalidArgument, ValueError) as e:
            state.drop(p.name, "align", "ALIGNMENT_FAILED", str(e), "n/a")
            return None
        w = self.released_weights(p, c, model)
        if w is None:
            return None
        try:
            aligned = own.aligned_weights(w, perms)
        except (InvalidArgument, FailedPrecondition) as e:
            state.drop(p.name, "weights", "INVALID_RELEASE", str(e), "yes")
            return None
        state.contributed(p.name, "ldp", report)
        return aligned

    def merged(self, p: RosterSite, c: PeerClient, pool: str):
        """Method merged: the peer's RS/LC merge of ``pool`` aligned to our model; a
        :class:`_Failure` for the caller to fall back on or drop, ``_STOP`` once dropped."""
        config, own, state = self.config, self.own, self.state
        r = self.ask(
            p.name,
            "merged",
            lambda: c.merged(
                pool,
                method=config.merge_method,
                epsilon=config.merge_epsilon,
                delta=config.merge_delta,
                timeout=config.call_timeout_s,
            ),
            pool,
        )
        if r is _STOP or isinstance(r, _Failure):
            return r
        if own is not None:
            state.begin(p.name, "align")
            try:
                aligned, report = own.align(r.architecture, r.arrays, p.name)
            except FailedPrecondition as e:
                state.drop(p.name, "align", "FAILED_PRECONDITION", str(e), "n/a")
                return _STOP
            except (InvalidArgument, ValueError) as e:
                state.drop(p.name, "align", "ALIGNMENT_FAILED", f"the merged model cannot be aligned: {e}", "n/a")
                return _STOP
            state.contributed(p.name, "merged", report)
            return aligned
        arch = self.arch
        try:
            module = model_from_arrays(arch, r.arrays)
            state.begin(p.name, "align")
            aligned, alignment = align(arch, self.own_graph, extract_graph(arch, module, self.probe), r.arrays)
        except (InvalidArgument, ValueError) as e:
            state.drop(p.name, "align", "ALIGNMENT_FAILED", f"the merged model cannot be aligned: {e}", "n/a")
            return _STOP
        state.contributed(p.name, "merged", _match_report(self.own_graph, alignment))
        return aligned

    def contribution(self, p: RosterSite):
        """Everything asked of one peer: info → (merged, or features → align → weights); its
        aligned arrays, or None once it is dropped."""
        config, own, state = self.config, self.own, self.state
        c = self.clients[p.name]
        state.begin(p.name, "info")
        try:
            info = c.info(timeout=config.call_timeout_s)
        except PeerError as e:
            reason = failure_reason(e.status, str(e), e.details, not _never_connected(e.details), config.call_timeout_s)
            state.drop(p.name, "info", e.status, reason, "n/a")
            return None
        model = choose_model(info, p.model, self.arch, self.local.model.name)
        pool = choose_pool(info, p.pool, self.arch, config.merge_method) if config.method != "ldp" else None
        if own is not None and pool is None and config.method != "ldp":
            why = own.mismatch(info, p.pool, config.merge_method)
            if why is not None:  # refused before anything is asked: nothing is charged
                state.drop(p.name, "info", "FAILED_PRECONDITION", why, "n/a")
                return None
        state.chose(p.name, model, pool)
        if config.method in ("merged", "auto") and pool is not None:
            r = self.merged(p, c, pool)
            if r is _STOP:
                return None
            if not isinstance(r, _Failure):
                return r
            if config.method == "merged" or r.charged != "no":
                state.drop(p.name, "merged", r.status, r.message, r.charged, r.details)
                return None
            why = details_line(r.details)
            state.note(
                p.name,
                f"merge refused before any charge ({r.status}{': ' + why if why else ''}); "
                "falling back to features + weights",
            )
        elif config.method == "merged":
            state.drop(
                p.name,
                "info",
                "FAILED_PRECONDITION",
                f"{p.name!r} offers no pool of this architecture for {config.merge_method!r} merges",
                "n/a",
            )
            return None
        if self.no_signal is not None and not config.go_on_without_signal:
            # method auto falling back to ldp: refused before anything is asked (nothing charged)
            state.drop(p.name, "features", "FAILED_PRECONDITION", f"not asked: {self.no_signal['message']}", "n/a")
            return None
        if own is not None:
            if model is None:  # refused before anything is asked: nothing is charged
                state.drop(p.name, "info", "FAILED_PRECONDITION", own.model_mismatch(info, p.model), "n/a")
                return None
            return self.exchange_group_features(p, c, model)
        if model is None:
            state.drop(
                p.name,
                "info",
                "FAILED_PRECONDITION",
                f"{p.name!r} offers no model {p.model or ''} of this architecture".replace("  ", " "),
                "n/a",
            )
            return None
        return self.exchange_features(p, c, model)

    def guarded_contribution(self, p: RosterSite):
        """A peer's failure, whatever it is, drops that peer; it never takes the round down."""
        state = self.state
        try:
            return self.contribution(p)
        except Exception as e:
            step = state.current_step(p.name) or "info"
            state.drop(
                p.name,
                step,
                "INTERNAL",
                f"{type(e).__name__}: {e}",
                "yes" if state.receipt_seen(p.name, step) else ("unknown" if step in CHARGED_STEPS else "n/a"),
            )
            return None


def weights_signal(config: RoundConfig, arch: Mapping[str, Any], structure: Any = None) -> dict | None:
    """Whether the ldp exchange's weights release at the round's (ε, δ) carries signal, from the
    public parameters alone (``peer.ldp.mechanisms.signal``; ``structure``: a site's own
    network's, else the built-in ``arch``): None when every weight tensor can, else what the
    report and the refusal say — the tensors predicted constant, σ there, and the smallest ε
    at which none is (None: some tensor never clears the filter's margin)."""
    from peer.ldp.mechanisms.signal import architecture_parts, parts_without_signal, signal_epsilon, structure_parts

    parts = structure_parts(structure) if structure is not None else architecture_parts(arch)
    silent = parts_without_signal(parts, config.weights_epsilon, config.weights_delta)
    if not silent:
        return None
    need = signal_epsilon(parts, config.weights_delta)
    sigmas = sorted(
        {round(p.noise_std(config.weights_epsilon, config.weights_delta) / p.spread_bound, 3) for p in silent}
    )
    names = [p.name for p in silent]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    where = (
        f"every weight tensor can carry signal from ε ≈ {need:.3g} per neuron"
        if need is not None
        else "some weight tensor has too few entries to clear the filter's margin at any ε"
    )
    message = (
        f"the ldp weights release at ε={config.weights_epsilon:g}, δ={config.weights_delta:g} per neuron "
        f"would come back constant for {shown}: there the noise is {sigmas[0]:g}–{sigmas[-1]:g} times "
        "the largest spread the public bounds allow, which the PFA's smoothing filter cannot tell from "
        "noise, so the fused model would be this site's own model rescaled while every peer is "
        f'charged ({where}; docs/mechanisms.md, "When a weights release carries no signal"). '
        'Use method = "merged" (the peers\' DP-SGD pools), or set [round.weights] '
        "go_on_without_signal = true to run it anyway"
    )
    return {"constant": names, "epsilon_needed": need, "message": message}


def _open_round(
    local: LocalSite,
    roster: Roster,
    config: RoundConfig,
    on_event: Callable[[dict], None] | None,
    round_id: str,
    stop: threading.Event | None,
) -> _Round:
    """The round before anything is asked: pins checked, the local files of the steps after
    fusion read first (a bad one costs nobody budget), our graph or network from the probe set,
    the ``started`` event, one client per roster peer."""
    me = local.name
    roster.check_pins(local.trust, me)
    peers: list[RosterSite] = roster.peers_of(me)
    state = RoundState(round_id, me, [(p.name, p.address) for p in peers], config.quorum, on_event, stop=stop)
    probe = np.asarray(local.probe)
    clip = config.activation_clip if config.activation_clip is not None else local.activation_clip
    no_signal = None
    if config.method in ("ldp", "auto"):
        no_signal = weights_signal(
            config, local.model.architecture, local.own.structure if local.own is not None else None
        )
        if no_signal is not None and config.method == "ldp" and not config.go_on_without_signal:
            raise InvalidArgument("round.weights.epsilon", f"nothing was requested: {no_signal['message']}")
    # before anything is asked or computed: a rerun whose plan differs is refused here
    journal = RoundJournal.open(
        config.out, config.label, round_id, round_plan(config, [p.name for p in peers], probe), local.trust
    )
    own = _OwnNetwork.of(local, probe) if local.own is not None else None
    kind = None
    if own is not None:
        arch = local.model.architecture
        own_graph = own_public = None
        config = own.after_fusion_config(config)
        kind = own.kind
        local_data = (
            after_fusion.load_local_data(config, local.model, probe, kind) if after_fusion.enabled(config) else None
        )
    else:
        arch = validate_architecture(local.model.architecture)
        local_data = after_fusion.load_local_data(config, local.model, probe) if after_fusion.enabled(config) else None
        own_graph = extract_graph(arch, local.model.module(), probe)
        own_public = public_view(own_graph, clip, _weight_boxes(arch, config.weight_bound))
    state.event(
        "started",
        label=config.label,
        peers=[p.name for p in peers],
        quorum=config.quorum,
        method=config.method,
        alpha=config.alpha,
        **({"attempts_before": journal.attempts} if journal is not None and journal.attempts else {}),
    )
    r = _Round(local, config, state, peers, arch, probe, clip, own, own_graph, own_public, kind, local_data)
    r.journal = journal
    r.no_signal = no_signal
    if no_signal is not None and config.go_on_without_signal:
        state.event("warning", message=f"asked to go on: {no_signal['message']}")

    def on_receipt(receipt, name: str) -> None:
        if journal is not None:  # on disk first: a charge the peer made is never forgotten
            journal.receipt(name, state.current_step(name) or "?", receipt)
        state.charged(name, receipt)

    for p in peers:
        r.clients[p.name] = PeerClient(
            local.identity,
            p.address,
            peer=p.name,
            trust=local.trust,
            on_receipt=lambda receipt, name=p.name: on_receipt(receipt, name),
        )
    return r


def _gather_contributions(r: _Round) -> dict[str, dict[str, np.ndarray]]:
    """Health checks first (every peer at once), then, if the quorum can still be met, one
    thread per live peer (:meth:`_Round.guarded_contribution`); each contributor's aligned
    arrays. The clients are closed whatever happens."""
    state, config, peers = r.state, r.config, r.peers
    contributions: dict[str, dict[str, np.ndarray]] = {}
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(peers)), thread_name_prefix="round") as workers:
            list(workers.map(r.check_health, peers))
            alive = [p for p in peers if state.peers[p.name].alive]
            if state.interrupted():
                state.aborted = "interrupted before anything was requested"
            elif len(alive) + 1 < config.quorum:
                state.aborted = (
                    f"only {len(alive)} of {len(peers)} peers answered the health check; with this site "
                    f"that is {len(alive) + 1} < quorum {config.quorum}; nothing was requested"
                )
            else:
                for p, arrays in zip(alive, workers.map(r.guarded_contribution, alive), strict=True):
                    if arrays is not None:
                        contributions[p.name] = arrays
    finally:
        for c in r.clients.values():
            c.close()
    return contributions


def _fuse_contributions(
    r: _Round, contributions: dict[str, dict[str, np.ndarray]]
) -> tuple[list[str], list[float], dict[str, np.ndarray] | None, after_fusion.AfterFusion | None]:
    """The round's end at the requester: aborted (interrupted, or short of the quorum) or fused
    with the fusion weights, then the local steps after fusion (``coordinator_free.after_fusion``;
    a failure there keeps the fused model, already paid for). Returns the contributors, the
    weights (ours first), the fused arrays (None unless fused) and what the local steps made."""
    state, config, own = r.state, r.config, r.own
    fused = after = None
    if state.aborted is None and state.interrupted():
        state.aborted = (
            "interrupted: nothing more was requested, the releases in flight were waited for; "
            "no model was fused (what peers released stays charged; receipts below)"
        )
    if state.aborted is None and len(contributions) + 1 < config.quorum:
        state.aborted = (
            f"{len(contributions)} peers contributed; with this site that is {len(contributions) + 1} "
            f"< quorum {config.quorum}; no model was fused (what peers released stays charged)"
        )
    contributors = [n for n in state.contributors() if n in contributions]
    weights = fusion_weights(config.alpha, len(contributors))
    if state.aborted is None:
        if own is not None:
            fused = own.fuse([contributions[n] for n in contributors], weights)
        else:
            fused = average_arrays([r.local.model.arrays] + [contributions[n] for n in contributors], weights)
        state.event("fused", step="fuse", contributors=contributors, weights=weights)
        if r.local_data is not None:
            try:
                after = after_fusion.after_fusion(
                    r.arch,
                    own.state() if own is not None else r.local.model.arrays,
                    {n: contributions[n] for n in contributors},
                    fused,
                    config,
                    r.local_data,
                    seed=int(state.round_id[:8], 16),
                    kind=r.kind,
                )
                state.event("after-fusion", step="fuse", stages=list(after.stages), adopt=after.report["adopt"])
            except Exception as e:  # local steps only: the fused model (already paid for) is kept
                error = f"{type(e).__name__}: {e}"
                reason = "the own model: the local steps after fusion failed, so no stage was scored against it"
                after = after_fusion.AfterFusion(report={"error": error, "adopt": "own", "adopt_reason": reason})
                state.event("after-fusion", step="fuse", stages=[], adopt="own", error=error)
    elif state.interrupted():
        state.event("interrupted", step="fuse", reason=state.aborted)
    else:
        state.event("aborted", step="fuse", reason=state.aborted)
    return contributors, weights, fused, after


def _round_report(
    r: _Round,
    started: str,
    contributors: list[str],
    weights: list[float],
    fused: dict[str, np.ndarray] | None,
    after: after_fusion.AfterFusion | None,
) -> dict:
    """The round report (JSON-ready): every peer's steps, the signed receipts of every charged
    release, every drop with its step, time and reason; what the local steps did."""
    state, me = r.state, r.local.name
    report = {
        "round_id": state.round_id,
        "label": r.config.label,
        "site": me,
        "model": r.local.model.name,
        "status": "fused" if fused is not None else ("interrupted" if state.interrupted() else "aborted"),
        "reason": state.aborted or "",
        "may_have_charged": state.may_have_charged(),
        "started_at": started,
        "finished_at": now_rfc3339(),
        "config": r.config.public(),
        "roster": [p.name for p in r.peers],
        "contributors": contributors,
        "weights": dict(zip([me, *contributors], weights, strict=True)) if fused is not None else {},
        "peers": state.peers_dict(),
        "charges": [vars(c) for c in state.charges()],
        "releases": state.release_counts(),
        "events": state.events,
    }
    if r.no_signal is not None:
        report["weights_signal"] = {**r.no_signal, "went_on": r.config.go_on_without_signal}
    if r.journal is not None:
        report["attempts_before"] = r.journal.attempts
        if fused is None:
            report["journal"] = str(r.journal.directory)
    if after is not None:
        report["after_fusion"] = after.report
    if fused is not None:
        check = (after.report.get("fused_vs_own") if after is not None else None) or _fused_vs_own_on_probe(r, fused)
        report["fused_vs_own"] = check
        line = after_fusion.same_as_own_line(check)
        if line is not None:
            report["fused_vs_own_note"] = line
    return report


def _fused_vs_own_on_probe(r: _Round, fused: dict[str, np.ndarray]) -> dict:
    """``coordinator_free.after_fusion.fused_vs_own`` on the public probe set, for a round whose
    local steps did not run (or failed)."""
    kind = r.kind if r.kind is not None else after_fusion.BuiltIn(r.arch)
    own = r.own.state() if r.own is not None else r.local.model.arrays
    try:
        return after_fusion.fused_vs_own(kind, own, fused, r.probe, "public probe set")
    except Exception as e:  # a report note only: the fused model (already paid for) is kept
        return {"error": f"{type(e).__name__}: {e}", "same_as_own": False}


def run_round(
    local: LocalSite,
    roster: Roster,
    config: RoundConfig,
    on_event: Callable[[dict], None] | None = None,
    write: bool = True,
    round_id: str | None = None,
    stop: threading.Event | None = None,
) -> RoundResult:
    """Run one fusion round for ``local`` over ``roster`` (see coordinator_free.rounds): open it
    (:func:`_open_round`), gather the peers' contributions (:func:`_gather_contributions`),
    fuse them and run the local steps after fusion (:func:`_fuse_contributions`), report
    (:func:`_round_report`) and write the report and models (:func:`write_round`).

    ``stop`` (set e.g. by SIGINT/SIGTERM) interrupts the round: nothing more is requested, the
    releases in flight are waited for (their receipts are kept), no model is fused, and the
    report says ``interrupted`` and, for each peer, whether it may have charged.
    """
    round_id = round_id or uuid.uuid4().hex
    started = now_rfc3339()
    r = _open_round(local, roster, config, on_event, round_id, stop)
    contributions = _gather_contributions(r)
    contributors, weights, fused, after = _fuse_contributions(r, contributions)
    report = _round_report(r, started, contributors, weights, fused, after)
    result = RoundResult(round_id, report["status"], report["reason"], report, fused)
    result.contributions = {n: contributions[n] for n in contributors}
    if after is not None:
        result.stages = after.stages
    if write:
        write_round(result, r.config.out, r.arch, own=local if r.own is not None else None)
    if r.journal is not None and fused is not None:
        r.journal.close()  # fused: the report holds every receipt, reused ones too
    return result


def write_round(result: RoundResult, out: Path, arch: Mapping[str, Any], own: LocalSite | None = None) -> None:
    """The report as ``OUT/round-ID.json``, the fused model and every later stage
    (``coordinator_free.after_fusion``: MODEL-STAGE-ID) in the store ``OUT/models`` (a site's own
    network: in its own store, ``own_models``, under its key names, so that ``privfusion model
    export`` writes them for the site's own class)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if result.arrays is not None:
        if own is not None:
            from peer.nn.imported import save_imported

            def save(name: str, arrays, metadata: dict) -> None:
                # aligned to our network, it reads our input: it keeps our preprocessing
                save_imported(
                    own.own_store,
                    name,
                    own.own.factory,
                    own.own.structure,
                    arrays,
                    metadata=metadata,
                    preprocessing=own.own.preprocessing,
                )
        else:

            def save(name: str, arrays, metadata: dict) -> None:
                save_model(out / "models", name, arch, arrays, metadata=metadata)

        round_meta = {k: result.report[k] for k in ("round_id", "label", "site", "contributors", "weights", "charges")}
        name = f"{result.report['model']}-fused-{result.round_id[:12]}"
        save(name, result.arrays, {"round": round_meta})
        result.model_name = name
        result.report["fused_model"] = name
        if own is not None:
            result.report["fused_store"] = str(own.own_store)
        for stage, arrays in result.stages.items():
            # e.g. mlp-repaired-ID: the same round, after the local steps (coordinator_free.after_fusion)
            staged = f"{result.report['model']}-{stage}-{result.round_id[:12]}"
            save(staged, arrays, {"round": round_meta, "after_fusion": result.report["after_fusion"], "stage": stage})
            result.report[f"{stage}_model"] = staged
        adopt = result.report.get("after_fusion", {}).get("adopt")
        if adopt is not None:
            result.report["adopt_model"] = result.report["model"] if adopt == "own" else result.report[f"{adopt}_model"]
    path = out / f"round-{result.round_id}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.report, indent=2, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)
    result.report_path = path


def _secure_possible(cfg) -> bool:
    """Whether a ``secure = true`` iterate run has the sites it needs (coalition + 2): fewer
    run the local-noise iterate, the fallback."""
    return len(Roster.load(cfg.roster).sites) >= cfg.coalition + 2


def run_rounds(
    site_config: str | os.PathLike,
    round_files: list[str | os.PathLike] | None = None,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    simulation: bool = False,
    resume: bool = False,
) -> Iterator[tuple[RoundConfig, RoundResult]]:
    """The rounds of ``privfusion round``: each file's ``[round]`` table (default: site.toml's),
    run in sequence with this site's identity, trust store, model and probe set; yields each
    round's config and result as it ends. Every file is read and checked before the first round
    starts (a bad file fails before anything is requested). The caller decides what an
    aborted or interrupted round means for the rest (the command stops after an interrupted
    one); ``stop`` interrupts the round in progress (see :func:`run_round`). ``simulation``
    lets an iterate run draw its noise from site.toml's fixed ``seed`` (refused otherwise:
    ``coordinator_free.iterate.run_iterate``); ``resume`` lets an iterate run that stopped
    continue where it stopped (``run_iterate``'s ``resume``)."""
    from coordinator_free.iterate import IterateConfig, is_iterate_file, load_iterate_config, run_iterate

    site = SiteConfig.load(site_config)
    configs = [
        load_iterate_config(f) if is_iterate_file(f) else load_round_config(f, site.activation_clip, site=site.name)
        for f in round_files or [site_config]
    ]
    for cfg in configs:
        if isinstance(cfg, IterateConfig) and cfg.secure and _secure_possible(cfg):
            # DP-SGD over every site's records with one secure sum per step (secure_iterate)
            from coordinator_free.secure_iterate import run_secure_iterate

            if resume:
                raise InvalidArgument("resume", "a secure iterate run does not resume (each step is one secure sum)")
            yield cfg, run_secure_iterate(site_config, cfg, on_event=on_event, stop=stop, simulation=simulation)
            continue
        if isinstance(cfg, IterateConfig):  # a multi-round peer-to-peer run (coordinator_free.iterate)
            yield cfg, run_iterate(site_config, cfg, on_event=on_event, stop=stop, simulation=simulation, resume=resume)
            continue
        result = run_round(load_local_site(site_config, cfg.model), Roster.load(cfg.roster), cfg, on_event, stop=stop)
        yield cfg, result
