"""One secure-sum step of multi-round DP-SGD among k sites, with no coordinator.

Every site of a run runs :func:`secure_sum` for each step on its own; nobody schedules anyone.
For attempt a of step s among the sorted sites S (``docs/secure_aggregation.md``, "Protocol of
one step"; the masks are ``peer.net.secagg``, the noise and encoding ``peer.dp.distributed``)::

    context  = MaskContext(run, s, a, S, bits)
    publish  our ephemeral X25519 key, signed by our pinned identity
    collect  every peer's signed key; verify each against its pin (refuse: unpinned, wrong
             context, bad signature); derive the pairwise seeds
    x        = encode(clip(g_i) for i in a fresh Poisson sample of our records)
               + Skellam share of variance v = V/(|S| − t)            (mod 2^bits)
    y        = x + masks;  digest = our signature over y
    CHARGE   the step's record to our ledger through the desk (BudgetExhausted: stop here,
             nothing left the site)
    publish  the same y and digest to every peer
    collect  every peer's y and digest; verify each digest
    publish  the digests we got;  collect every peer's; refuse two digests signed by one site
             (equivocation)
    Σ y mod 2^bits = Σ x (the masks cancel);  decode → the noisy sum of every site's clipped
             gradients, the same at every site

**Dropouts.** When a peer's message does not come within ``wait_s`` the attempt is abandoned
and the step is run again, attempt a + 1, among the sites that did answer, with fresh keys,
masks, sample and noise; every attempt this site reached the charge of is charged (a masked
vector alone reveals nothing, a completed sum is a release, and we cannot know whether a peer
completed it). The share is recomputed for the smaller set, v = V/(|S′| − t), so the honest
shares still add up to V; with |S′| < t + 2 the step stops (too few sites for the coalition
bound: the local-noise iterate is the fallback). Every survivor misses the same site (it did
not publish), so they agree on S′; a set that disagrees shows up as a wrong-context refusal.

A site that completes an attempt and then goes away before its peers have fetched its forwarded
digests makes them abandon the attempt it completed: they re-run the step without it and their
models part from its own (both sums were charged; nothing is lost to privacy). A daemon outlives
its run, so a site that ends keeps serving its last messages; one that must stop should wait
until its peers have started the next step.

**Unit and charge.** One record of this site, add/remove; per attempt the distributed Skellam
mechanism with the encoding's integer sensitivities, the site's sample rate and the honest
shares' variance (``events.DistributedSkellamSteps``). V is the planned total variance
(``calibrate_share`` for the run's target and steps); the ledger's filter admits each step or
refuses it (BudgetExhausted before the vector leaves).

**Transport.** :class:`StepTransport` is all the protocol needs of the wire: ``publish`` a
value of one kind ("key", "masked", "digests") for (context, sender), to each recipient, and
``collect`` the values of some senders for a receiver, or raise :class:`SitesDropped` naming
the ones that did not come. :class:`InProcessBoard` implements it in memory (tests and
benchmarks, with the real crypto); the daemons' RPCs implement it over mTLS.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from peer.base.rng import make_randomness
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy
from peer.desk.requests import SecureShareRequest
from peer.dp.distributed.encoding import (
    Encoding,
    decode_sum,
    encode_records,
    encode_sum,
    modular_overflow_probability,
    to_modular,
)
from peer.dp.distributed.skellam import check_sites, skellam_share, step_record
from peer.net.client import PeerClient, PeerError
from peer.net.identity import load_identity
from peer.net.secagg import (
    MaskContext,
    MaskedShare,
    SignedKey,
    aggregate,
    check_no_equivocation,
    make_ephemeral,
    masked_vector,
    pairwise_seeds,
    pinned_certificates,
    sign_masked,
    verify_masked,
    verify_signed_key,
)
from peer.net.site import Site, SiteConfig
from peer.net.trust import TrustStore

KINDS = ("key", "masked", "digests")
#: the byte counts of :meth:`DaemonTransport.traffic` a secure run reports per step and in all
BYTE_FIELDS = ("bytes_sent", "bytes_received", "bytes_published")


class SitesDropped(Unavailable):
    """Some peers' messages of an attempt did not come: ``sites`` (sorted) dropped."""

    reason = "SECAGG_SITES_DROPPED"

    def __init__(self, context: MaskContext, kind: str, sites: Sequence[str]):
        self.sites = tuple(sorted(sites))
        super().__init__(
            f"run {context.run_id!r} step {context.step} attempt {context.attempt}: no {kind} from "
            f"{', '.join(self.sites)}; the attempt is abandoned",
            metadata={"sites": ",".join(self.sites), "kind": kind},
        )


class StepTransport(Protocol):
    """What one step needs of the wire (module docstring)."""

    def publish(self, context: MaskContext, kind: str, sender: str, values: Mapping[str, Any]) -> None:
        """Make ``values[recipient]`` available to each recipient (an honest site gives every
        recipient the same value)."""

    def collect(self, context: MaskContext, kind: str, receiver: str, senders: Sequence[str]) -> dict[str, Any]:
        """The value each of ``senders`` published for ``receiver``; SitesDropped naming those
        whose value did not come in time."""


class InProcessBoard:
    """:class:`StepTransport` in memory, for sites running in threads of one process (the
    protocol's real crypto, no sockets). ``wait_s``: how long ``collect`` waits for a sender."""

    def __init__(self, wait_s: float = 5.0):
        self.wait_s = float(wait_s)
        self._values: dict[tuple, Any] = {}
        self._changed = threading.Condition()

    @staticmethod
    def _key(context: MaskContext, kind: str, sender: str, recipient: str) -> tuple:
        return (context.canonical(), kind, sender, recipient)

    def publish(self, context: MaskContext, kind: str, sender: str, values: Mapping[str, Any]) -> None:
        if kind not in KINDS:
            raise InvalidArgument("kind", f"must be one of {KINDS}, got {kind!r}")
        with self._changed:
            for recipient, value in values.items():
                self._values[self._key(context, kind, sender, recipient)] = value
            self._changed.notify_all()

    def published(self, context: MaskContext, kind: str, sender: str) -> dict[str, Any]:
        """What ``sender`` published of ``kind`` in ``context``, by recipient (for checks)."""
        with self._changed:
            return {k[3]: v for k, v in self._values.items() if k[:3] == (context.canonical(), kind, sender)}

    def collect(self, context: MaskContext, kind: str, receiver: str, senders: Sequence[str]) -> dict[str, Any]:
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            while True:
                got = {s: self._values.get(self._key(context, kind, s, receiver)) for s in senders}
                missing = [s for s, v in got.items() if v is None]
                if not missing:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SitesDropped(context, kind, missing)
                self._changed.wait(left)


#: The first pause of a collect that found a sender not yet published (doubling up to ``poll_s``).
FIRST_POLL_S = 0.005


class DaemonTransport:
    """:class:`StepTransport` over the daemons (``PublishSecAgg`` / ``FetchSecAgg``, mTLS):
    this site's run publishes on its own daemon (``own_address``, with its own identity) and
    fetches from each peer's daemon (``addresses``: site → HOST:PORT, pinned peers), polling
    (after 5 ms, then twice as long each time, up to every ``poll_s``) while a message is not yet published (NOT_FOUND) or a daemon does not
    answer (UNAVAILABLE, or a call cut short as it stops: CANCELLED), up to ``wait_s``; then that sender has dropped. Any other refusal is
    raised as it came."""

    def __init__(
        self,
        identity,
        own_address: str,
        addresses: Mapping[str, str],
        wait_s: float = 30.0,
        poll_s: float = 0.05,
        insecure: bool = False,
    ):
        self.identity = identity
        self.wait_s = float(wait_s)
        self.poll_s = float(poll_s)
        self._own = PeerClient(identity, own_address, peer=identity.name, insecure=insecure)
        self._peers = {
            name: PeerClient(identity, address, peer=name, insecure=insecure)
            for name, address in addresses.items()
            if name != identity.name
        }

    def close(self) -> None:
        for c in (self._own, *self._peers.values()):
            c.close()

    def traffic(self) -> dict[str, Any]:
        """The payload bytes this site's run moved so far, counted at its gRPC clients
        (``PeerClient.traffic``: protobuf ``ByteSize()`` of every request a daemon answered and
        of every reply, polls included): ``bytes_sent``, the FetchSecAgg requests to the peers'
        daemons; ``bytes_received``, their replies (the peers' keys, masked vectors and
        forwarded digests); ``bytes_published``, the PublishSecAgg requests (and replies) to
        its own daemon, each of its messages once, which the daemon then serves to every
        recipient that fetches it (what a peer fetches from us is in *that* peer's
        ``bytes_received`` ``by_peer``); ``by_peer``: site → {calls, unanswered, sent,
        received}."""
        own = self._own.traffic.totals()
        by_peer = {n: c.traffic.totals() for n, c in sorted(self._peers.items())}
        return {
            "bytes_sent": sum(t["sent"] for t in by_peer.values()),
            "bytes_received": sum(t["received"] for t in by_peer.values()),
            "bytes_published": own["sent"] + own["received"],
            "by_peer": by_peer,
        }

    def publish(self, context: MaskContext, kind: str, sender: str, values: Mapping[str, Any]) -> None:
        if sender != self.identity.name:
            raise InvalidArgument("sender", f"this transport publishes for {self.identity.name!r} only")
        groups: dict[int, tuple[Any, list[str]]] = {}
        for recipient, value in values.items():  # one call per distinct value (honest: one call)
            groups.setdefault(id(value), (value, []))[1].append(recipient)
        for value, recipients in groups.values():
            self._own.publish_secagg(context, kind, value, recipients)

    def collect(self, context: MaskContext, kind: str, receiver: str, senders: Sequence[str]) -> dict[str, Any]:
        if receiver != self.identity.name:
            raise InvalidArgument("receiver", f"this transport collects for {self.identity.name!r} only")
        unknown = sorted(set(senders) - set(self._peers))
        if unknown:
            raise InvalidArgument("senders", f"no address for {unknown}")
        deadline = time.monotonic() + self.wait_s
        got: dict[str, Any] = {}
        pause = min(FIRST_POLL_S, self.poll_s)  # a barrier about to open is seen within ms
        while True:
            for s in senders:
                if s in got:
                    continue
                try:
                    got[s] = self._peers[s].fetch_secagg(context, kind, timeout=max(1.0, self.wait_s))
                except PeerError as e:
                    if e.status not in ("NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
                        raise
            missing = [s for s in senders if s not in got]
            if not missing:
                return got
            if time.monotonic() >= deadline:
                raise SitesDropped(context, kind, missing)
            time.sleep(pause)
            pause = min(2.0 * pause, self.poll_s)


@dataclass(frozen=True)
class SecureSumPlan:
    """The public parameters of a run's secure sums, the same at every site.

    ``encoding``: the integer encoding (clip norm, scale, bits, rounding, rotation);
    ``coalition``: t; ``total_variance``: V, the Skellam variance per coordinate the honest
    shares of every attempt add up to (``calibrate_share(...).total_variance``);
    ``sample_rate``: each site's Poisson rate q; ``delta``: the δ a step's record states its ε
    at; ``max_attempts``: attempts per step before the step gives up.
    """

    run: str
    encoding: Encoding
    coalition: int
    total_variance: float
    sample_rate: float = 1.0
    delta: float = 1e-5
    max_attempts: int = 3

    def share_variance(self, sites: int) -> float:
        """v = V/(k − t) for k sites (refused below t + 2)."""
        k, t = check_sites(sites, self.coalition)
        return self.total_variance / (k - t)


@dataclass(frozen=True)
class SecureSum:
    """What one site holds after a step: ``noisy_sum`` (decoded, length ``encoding.dim``, the
    same at every site of the completed attempt), the residues ``total`` it was decoded from,
    the completed ``context``, this site's ledger ``entries`` (one per attempt it charged, in
    order) and ``own_input``: this site's unmasked residues x of the completed attempt (never
    sent; kept for the site's own checks)."""

    noisy_sum: np.ndarray
    total: np.ndarray
    context: MaskContext
    entries: tuple[str, ...]
    own_input: np.ndarray = field(repr=False)


class RunSite:
    """The site as a run process holds it (the daemon holds the site's lock, so a run opens the
    parts it needs, as ``iterate`` does): identity, trust store, ledger and policy, and the
    site's own rules for randomness and permissions (the same functions as ``Site``'s). What
    :class:`SecureParty` and the release desk need of a site."""

    policy_allows = Site.policy_allows
    randomness = Site.randomness
    check_randomness = Site.check_randomness

    def __init__(self, site_config, simulation: bool = False):
        config = SiteConfig.load(site_config)
        if config.seed is not None and not simulation:
            raise FailedPrecondition(
                f"site.seed in {site_config}: a fixed noise seed is not private; remove it, or run as a simulation"
            )
        self.identity = load_identity(config.identity)
        if self.identity.name != config.name:
            raise FailedPrecondition(
                f"site.name is {config.name!r} but the identity in {config.identity} is {self.identity.name!r}"
            )
        self.name = config.name
        self.simulation = bool(simulation)
        self.policy = Policy.from_toml(site_config)
        self.trust = TrustStore(self.identity.trust_dir)
        self.ledger = Ledger(config.ledger, self.policy)
        self._master = make_randomness(config.seed) if config.seed is not None else None
        self._master_lock = threading.Lock()

    def close(self) -> None:
        self.ledger.close()


def poisson_sample(n: int, sample_rate: float, generator: np.random.Generator) -> np.ndarray:
    """Indices of a Poisson sample: each of ``n`` records independently with probability q."""
    if sample_rate >= 1.0:
        return np.arange(n)
    return np.flatnonzero(generator.random(n) < sample_rate)


def flat_gradients(grads: Mapping[str, Any], order: Sequence[str], records: int) -> np.ndarray:
    """Per-record gradients (``per_example_gradients``: name → (records, *shape)) as one
    (records, d) float32 matrix, the parameters in ``order``. Float32 on purpose: the encoder
    converts each chunk to float64 exactly, so the encoded sum is the one a float64 copy would
    give, bit for bit, at half the memory and without the copy."""
    import torch

    return torch.cat([grads[k].detach().reshape(records, -1) for k in order], dim=1).numpy()


def sampled_rows(flat: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The rows of the sampled records: ``flat`` itself when the sample is every record in order
    (a full batch), else a copy of those rows."""
    if len(idx) == len(flat) and np.array_equal(idx, np.arange(len(flat))):
        return flat
    return flat[idx]


class SecureParty:
    """One site's side of the protocol: its site (identity, trust store, randomness) and its
    release desk (the only way its share is charged). A subclass may override :meth:`send`
    only to model a peer that misbehaves (tests)."""

    def __init__(self, site, desk):
        self.site = site
        self.desk = desk

    @property
    def name(self) -> str:
        return self.site.identity.name

    def send(self, transport: StepTransport, context: MaskContext, share: MaskedShare) -> None:
        """The same masked vector and signed digest to every peer of the attempt."""
        peers = [s for s in context.sites if s != self.name]
        transport.publish(context, "masked", self.name, {p: share for p in peers})

    def attempt(
        self,
        transport: StepTransport,
        plan: SecureSumPlan,
        step: int,
        attempt: int,
        sites: Sequence[str],
        gradients: Callable[[np.ndarray], np.ndarray],
        records: int,
        entries: list[str],
    ) -> SecureSum:
        """One attempt (module docstring); appends the ledger entry of its charge to ``entries``."""
        enc = plan.encoding
        context = MaskContext(plan.run, step, attempt, tuple(sites), enc.bits)
        me = self.name
        peers = [s for s in context.sites if s != me]
        share_variance = plan.share_variance(len(context.sites))
        pins = pinned_certificates(self.site.trust, peers)

        own_key = make_ephemeral(self.site.identity, context)
        transport.publish(context, "key", me, {p: own_key.signed for p in peers})
        keys: dict[str, SignedKey] = transport.collect(context, "key", me, peers)
        verified = {p: verify_signed_key(keys[p], context, pins) for p in peers}
        seeds = pairwise_seeds(context, me, own_key, verified)

        randomness = self.site.randomness()
        gen = randomness.generator
        sample = poisson_sample(records, plan.sample_rate, gen)
        rows = np.asarray(gradients(sample))
        if rows.dtype not in (np.float32, np.float64):  # the encoder reads float32 rows chunk by chunk as float64
            rows = rows.astype(np.float64)
        rows = rows.reshape(len(sample), enc.dim)
        encoded = encode_sum(rows, enc, gen) if enc.beta == 0 else encode_records(rows, enc, gen)
        x = to_modular(encoded + skellam_share(share_variance, enc.padded_dim, gen), enc.bits)
        y = masked_vector(x, context, me, seeds)
        signed = sign_masked(self.site.identity, context, y)

        record = step_record(
            enc,
            share_variance,
            len(context.sites),
            plan.coalition,
            plan.sample_rate,
            plan.delta,
            subject=plan.run,
            run=plan.run,
            step=step,
            attempt=attempt,
            peers=sorted(peers),
            **randomness.record_fields(),
        )
        issued = self.desk.issue(SecureShareRequest(plan.run, step, attempt, tuple(peers), record, y))
        entries.append(issued.entry_id)
        try:
            self.send(transport, context, MaskedShare(y, signed, record.release_id))
        except BaseException:
            self.desk.finish(issued, sent=False)
            raise
        self.desk.finish(issued, sent=True)

        got = transport.collect(context, "masked", me, peers)
        pinned = pinned_certificates(self.site.trust, peers)
        for p in peers:
            if got[p].signed.site != p:
                raise PermissionDenied(
                    f"masked vector: what {p!r} sent is signed as {got[p].signed.site!r}",
                    reason="SECAGG_WRONG_SENDER",
                    metadata={"site": p},
                )
            verify_masked(got[p].y, got[p].signed, context, pinned)
        received = tuple(got[p].signed for p in peers)
        transport.publish(context, "digests", me, {p: received for p in peers})
        forwarded = transport.collect(context, "digests", me, peers)
        reports = [signed, *received]
        for p in peers:
            reports.extend(forwarded[p])
        check_no_equivocation(reports, context, {**pinned, me: [self.site.identity.cert_pem]})

        total = aggregate({me: y, **{p: got[p].y for p in peers}}, context)
        return SecureSum(decode_sum(total, enc), total, context, tuple(entries), x)


def secure_sum(
    party: SecureParty,
    transport: StepTransport,
    plan: SecureSumPlan,
    step: int,
    sites: Sequence[str],
    gradients: Callable[[np.ndarray], np.ndarray],
    records: int,
) -> SecureSum:
    """Step ``step`` among ``sites`` (this site among them): attempts until one completes (a
    dropout re-runs it among the rest, module docstring). ``gradients(indices)`` gives the
    per-record gradients (rows, ``encoding.dim`` wide) of the records at those indices (the
    encoder clips them); ``records``: how many records the site holds (the sample is drawn
    here, afresh per attempt). Refusals (an unpinned or forged key, equivocation, the budget)
    are raised as they are: they are not dropouts."""
    if party.name not in sites:
        raise InvalidArgument("sites", f"must include this site {party.name!r}")
    current = sorted(set(sites))
    entries: list[str] = []
    last: SitesDropped | None = None
    for attempt in range(plan.max_attempts):
        try:
            return party.attempt(transport, plan, step, attempt, current, gradients, records, entries)
        except SitesDropped as e:
            last = e
            current = [s for s in current if s not in e.sites]
            try:
                check_sites(len(current), plan.coalition)
            except InvalidArgument as small:
                raise FailedPrecondition(
                    f"run {plan.run!r} step {step}: {small.rule} after {', '.join(e.sites)} dropped",
                    reason="SECAGG_TOO_FEW_SITES",
                ) from e
    raise FailedPrecondition(
        f"run {plan.run!r} step {step}: no attempt completed in {plan.max_attempts} ({last})",
        reason="SECAGG_ATTEMPTS_EXHAUSTED",
    )


def apply_update(theta: np.ndarray, noisy_sum: np.ndarray, learning_rate: float, denominator: float) -> np.ndarray:
    """θ − η·(noisy sum of clipped gradients)/denominator; ``denominator`` public (the expected
    batch over all sites, q·Σ declared n_j). The same at every site given the same sum."""
    if not denominator > 0:
        raise InvalidArgument("denominator", f"must be > 0, got {denominator!r}")
    return np.asarray(theta, dtype=np.float64) - learning_rate * np.asarray(noisy_sum) / denominator


def run_secure_iterate(
    site_config,
    cfg,
    *,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    simulation: bool = False,
) -> Any:
    """``method = "iterate"`` with ``secure = true`` (``coordinator_free.runner`` dispatches
    here when the roster has at least coalition + 2 sites; fewer: the local-noise iterate).

    DP-SGD over the union of every site's records: θ_0 = build_model(architecture, init_seed)
    (public; for a site's own network the factory's module under torch.manual_seed(init_seed),
    in eval mode: ``iterate.SiteNetwork``), then for each of the T = rounds·local_steps steps a :func:`secure_sum` of the
    clipped per-record gradients at θ of a fresh Poisson sample (rate q) at every site, and
    θ ← θ − η·(noisy sum)/(q·k·n), n the ``declared_records`` every site's round file states
    (public), k the sites of the step's completed attempt: every site applies the same update.
    The total variance V is calibrated so that T steps of the honest shares' noise meet
    (ε, δ/|orders|) at the ledger's orders (the filter splits δ across them); each attempt is
    charged before its vector leaves, and the ledger's filter is the hard stop (status
    "budget"). Writes OUT/RUN.json (with the payload bytes the run moved, per step and in all:
    :meth:`DaemonTransport.traffic`) and the final model ``RUN-final`` in OUT/models (an own
    network's: in the site's own-model store). Returns an
    ``iterate.IterateResult``."""
    import torch

    from coordinator_free.iterate import IterateResult, SiteNetwork, load_records
    from coordinator_free.roster import Roster
    from peer.base.errors import BudgetExhausted
    from peer.base.records import now_rfc3339
    from peer.desk.desk import ReleaseDesk
    from peer.dp.distributed.skellam import calibrate_share
    from peer.dp.training import classifier_loss, per_example_gradients
    from peer.net.signing import wire_transport

    emit = on_event or (lambda e: None)
    stop = stop or threading.Event()
    site = RunSite(site_config, simulation=simulation)
    transport = None
    try:
        config = SiteConfig.load(site_config)
        if site.policy.data is None or site.policy.data.unit != "record:add-remove":
            raise FailedPrecondition(
                f"{site_config}: a secure run's steps are data-level releases per record:add-remove; the "
                "site's policy needs a [policy.data] budget in that unit"
            )
        # built-in, or the site's own network (θ_0 from its factory under init_seed, eval mode;
        # refused here, before anything is charged, when DP-SGD cannot train it)
        net = SiteNetwork.of_site(config, cfg.model)
        module = net.initial_module(cfg.init_seed)
        x, y = load_records(cfg.records, net.stored)
        roster = Roster.load(cfg.roster)
        if site.name not in roster.sites:
            raise FailedPrecondition(f"{cfg.roster}: the roster does not list this site ({site.name!r})")
        names = sorted(roster.sites)
        check_sites(len(names), cfg.coalition)
        net.refuse_overwrite([f"{cfg.run}-final"])  # an own network's final model: the site's own store
        loss = classifier_loss(module)
        params = {k: v.detach().clone() for k, v in module.named_parameters()}
        order = sorted(params)
        shapes = {k: tuple(params[k].shape) for k in order}
        dim = int(sum(int(np.prod(shapes[k])) for k in order))
        encoding = Encoding(dim=dim, clip_norm=cfg.clip_norm, scale=cfg.secure_scale, bits=cfg.modulus_bits, beta=0.0)
        steps = cfg.rounds * cfg.local_steps
        orders = site.ledger.orders
        cal = calibrate_share(
            cfg.epsilon,
            cfg.delta / len(orders),
            len(names),
            cfg.coalition,
            encoding.l1_sensitivity,
            encoding.l2_sensitivity,
            cfg.sample_rate,
            steps,
            orders,
        )
        plan = SecureSumPlan(cfg.run, encoding, cfg.coalition, cal.total_variance, cfg.sample_rate, cfg.delta)
        # utility only (the modulus is post-processing of the noisy sum): the chance that some
        # coordinate of a step's sum wraps, at the public count k·n of records and the k shares
        overflow = modular_overflow_probability(
            encoding, len(names) * cfg.declared_records, len(names) * cal.share_variance
        )
        transport = DaemonTransport(
            site.identity, roster.sites[site.name].address, {n: roster.sites[n].address for n in names}, cfg.wait_s
        )
        party = SecureParty(site, ReleaseDesk(site, wire_transport(site)))
        xt = net.inputs(x)
        yt = torch.as_tensor(y, dtype=torch.long)
        report: dict[str, Any] = {
            "site": site.name,
            "run": cfg.run,
            "method": "iterate",
            "secure": True,
            "started_at": now_rfc3339(),
            "dataset_size": cfg.declared_records,
            "dataset_size_source": "declared",
            "plan": {
                "steps": steps,
                "learning_rate": cfg.learning_rate,
                "sample_rate": cfg.sample_rate,
                "epsilon": cfg.epsilon,
                "delta": cfg.delta,
                "coalition": cfg.coalition,
                "total_variance": cal.total_variance,
                "calibration_delta": cfg.delta / len(orders),
                "overflow_probability_at_declared": overflow,
                "ledger_orders": list(orders),
                **encoding.record_fields(),
            },
            "steps": [],
        }
        emit({"event": "iterate-started", "site": site.name, "run": cfg.run, "secure": True, "steps": steps})
        status, reason = "finished", f"all {steps} steps done"
        current = names
        before = transport.traffic()
        for step in range(steps):
            if stop.is_set():
                status, reason = "interrupted", f"stopped before step {step}"
                break
            flat = flat_gradients(per_example_gradients(loss, params, xt, yt), order, len(y))

            def rows(idx: np.ndarray, flat: np.ndarray = flat) -> np.ndarray:
                return sampled_rows(flat, idx)

            try:
                result = secure_sum(party, transport, plan, step, current, rows, len(y))
            except BudgetExhausted as e:
                status, reason = "budget", f"step {step}: {e}"
                break
            current = list(result.context.sites)
            moved = transport.traffic()
            denominator = cfg.sample_rate * len(current) * cfg.declared_records
            update = apply_update(np.zeros(dim), result.noisy_sum, cfg.learning_rate, denominator)
            at = 0
            for k in order:
                size = int(np.prod(shapes[k]))
                params[k] = params[k] + torch.as_tensor(
                    update[at : at + size].reshape(shapes[k]), dtype=params[k].dtype
                )
                at += size
            report["steps"].append(
                {
                    "step": step,
                    "attempt": result.context.attempt,
                    "sites": current,
                    "entries": list(result.entries),
                    # this step's payload bytes at the transport (its attempts, polls included)
                    **{k: moved[k] - before[k] for k in BYTE_FIELDS},
                }
            )
            before = moved
        arrays = {k: v.detach().numpy().astype(np.float32) for k, v in params.items()}
        model_name = f"{cfg.run}-final"
        if net.own is None:
            from peer.nn.store import save_model

            save_model(cfg.out / "models", model_name, net.arch, arrays)
        else:  # the site's own network: into its own-model store, under its key names
            net.save(cfg.out, model_name, arrays, {"run": cfg.run, "secure": True})
        spent = [s for s in site.ledger.budget_states() if s.key.level == "data"]
        report.update(
            status=status,
            reason=reason,
            finished_at=now_rfc3339(),
            epsilon_filter=spent[0].spent_epsilon if spent else None,
            **transport.traffic(),
        )
        cfg.out.mkdir(parents=True, exist_ok=True)
        path = cfg.out / f"{cfg.run}.json"
        path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str), encoding="utf-8")
        emit({"event": "iterate-finished", "site": site.name, "status": status, "steps": len(report["steps"])})
        return IterateResult(status, reason, len(report["steps"]), report, path, [model_name])
    finally:
        if transport is not None:
            transport.close()
        site.close()


__all__ = [
    "BYTE_FIELDS",
    "KINDS",
    "DaemonTransport",
    "InProcessBoard",
    "RunSite",
    "SecureParty",
    "SecureSum",
    "SecureSumPlan",
    "SitesDropped",
    "StepTransport",
    "apply_update",
    "flat_gradients",
    "poisson_sample",
    "run_secure_iterate",
    "sampled_rows",
    "secure_sum",
]
