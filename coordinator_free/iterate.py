"""Multi-round peer-to-peer DP training with no coordinator (``method = "iterate"``).

Every site runs this loop on its own, against its peers' daemons; nobody schedules anyone::

    θ_0 = build_model(architecture, seed=init_seed)        # PUBLIC seed: all sites start equal
    for r = 1 .. R:
        θ_r^own = DP-GD(θ_{r−1}; own records, local_steps steps, σ, C, η)   # a "segment"
        store θ_r^own, then CHARGE its training record to our ledger (one data-level charge)
        publish: every peer that asks gets these identical bytes (served again, no charge)
        fetch every peer's segment of round r (wait up to wait_s), else its newest older one
        θ_r = Σ_j w_j θ_r^j / Σ_j w_j                        # fusion (weighted average)

**Every network.** ``model`` names a built-in model of the site's store, or the site's own
network (``privfusion model import``: ``own_models/NAME.json`` exists, as for one-shot rounds):
then θ_0 is its factory's module built under ``torch.manual_seed(init_seed)`` (public, the same
at every site; never the site's imported weights, trained outside any guarantee), trained in eval
mode as a pool's (``peer.dp.training.train_dpsgd_module``: BatchNorm's running statistics are
constants, only parameters are trained and released; what ``check_private_training`` refuses is
refused before anything is charged), its inputs shaped by ``input_batch``, its segments released
with its public architecture (traced structure and digest, never its code) and charged exactly
as a built-in one's. Every peer segment is checked against our network before it is averaged
(:meth:`SiteNetwork.check_segment`: an own network's structure digest for digest; for every
network our parameters' names and shapes, finite floats): one that does not fit is *dropped*
for that round with the reason.

**The segment** is DP-SGD (``peer.dp.training.run_dpsgd``): per step
θ ← θ − η·(Σ_{i∈B} clip_C(∇ℓ(θ; x_i, y_i)) + σ·C·z)/(q·n) with z ~ N(0, I) from the site's noise
(CSPRNG-seeded; a fixed seed, reported, only in simulations: a site.toml ``seed`` is refused
unless the run is started with ``simulation``, ``privfusion round --simulation``, as
``peer serve`` refuses it). B is every record when ``sample_rate`` q = 1 (the default: full-batch
DP-GD, denominator n), else a Poisson batch: each record independently with probability q, drawn
afresh every step; the denominator is then the *expected* batch q·n, a public constant (never the
realised |B|, which depends on the data). Unit of privacy: one of the site's training records, under
``adjacency``. **n is public**: under add-remove it is the count the operator declares
(``declared_records`` of ``[round.iterate]``, else ``[site] declared_records`` of site.toml;
refused when neither is set), never the true count, which differs between neighbours D and
D + {x}; under replace-one it is ``declared_records`` when given, else the number of records
(the same for both neighbours there). Its record (``"dpsgd"``, steps, σ, C, q, n and its
source, adjacency; with q < 1 each step is accounted as the Poisson-subsampled Gaussian, so
amplification by sampling counts) is charged to the site's ledger *before* the bytes can leave: the daemon serves a
segment only when its charge stands (``peer.net.releases.publish_segment``,
``Site.segment_release``). A segment starts from θ_{r−1}, which is post-processing of what the
site and its peers already released, so the segments compose *adaptively*: the ledger's RDP
filter sums them order by order, and refuses the segment that would exceed the data budget —
the loop then stops (nothing of that segment left the site). All segments together are
``R·local_steps`` Gaussian steps (subsampled at rate q): the PLD figure (tight; for full batch
the composition is the Gaussian with μ = √(R·steps)/σ, add-remove; for q < 1 dp-accounting's
PLD of the subsampled Gaussian, self-composed) is reported beside the filter's.

**The site's own loop.** With ``train = "MODULE:FUNCTION"`` the segment is taken by the site's
function, ``FUNCTION(model, records, step)``, around our DP step object
(``peer.dp.own_loop``): each ``step(transform, loss, learning_rate)`` is one step of the update
above through the same code (``peer.dp.training.take_step``), with the batch, the clipping and
the noise ours (drawn from the segment's generator in the built-in loop's order) and the site's
per-record augmentation, per-example loss and learning rate. Exactly ``local_steps`` steps must
be taken, and the module's parameters must be the step object's when the function returns;
anything else — and a function that cannot be loaded (refused when the run opens) — is refused
naming ``round.iterate.train`` before anything is charged. Its record is the built-in loop's
(the plan's σ, C, q and count, so the same charge) with each step's learning rate as taken.

**Noise.** σ is the smallest one with which the whole planned run fits (ε, δ) *by the filter
of this site's ledger* (``peer.budget.dpsgd_noise.noise_multiplier_for(figure="filter",
orders=the ledger's orders, sample_rate=q)``): what the ledger will admit. A ledger created for this run with
the one order that suits it (``calibration.planned_orders``, a site's ``[policy] orders``)
carries the whole δ at that order; the default 20 orders split δ twenty ways (σ ≈ 8.24 instead
of 7.32 for 40 steps at (4, 1e-5), add-remove).

**Fusion rule.** Peer j's segment of our round r is *fresh*; if it has not come within
``wait_s`` we take its newest older one, *stale* by s = r − its round, and weigh it down by
``staleness_decay``^s; a peer with no segment at all, unreachable or refusing, is *skipped*
(and once unreachable, asked again without waiting in later rounds). Weights are
w_j = n_j · staleness_decay^{s_j}, n_j = the n each segment's record states (public: the
DP-GD denominator, declared under add-remove), ours included with s = 0. With ``alpha`` set our own weight is
α and the peers share 1 − α in proportion to their w_j. When every peer is on time and α is
left to the record counts, every site computes the same average Σ_j n_j θ_r^j / Σ_j n_j, which
is DP-FedAvg's weighted average with local DP-GD: the same model at every site, with no server.
With declared n_j (add-remove) one local step of it is exactly θ − η·(Σ of every site's clipped
gradients and noise)/Σ_j n_j: DP-FedAvg's step with the declared total in place of the true one.
No alignment is needed: every model descends from the same public θ_0.

**Outputs** (``out``): each round's fused model in the model store ``OUT/models`` (an own
network's: in the site's own-model store, under its key names with its preprocessing and θ_0's
buffers, where ``privfusion evaluate`` and ``model adopt`` read it) as
``RUN-r{k}`` (metadata: the round, its contributors and weights) and the JSON report
``OUT/RUN.json``: the n of the segments and its source (``dataset_size``,
``dataset_size_source``; never the true count under add-remove), per round the segment's ledger entry, σ, ε spent (the ledger's filter figure
and the PLD of the run's steps so far), bytes received and sent (segment bytes × times served
again), and which peers contributed, with their staleness. Nothing private is logged: names,
rounds, ledger ids, public ε and byte counts only.

**Stopping and resuming.** The report is written when the run opens, after every round and at
the end, so a run stopped at any point leaves the rounds it completed. A run name is used once
per site (:func:`_previous_run`): rerunning a finished run is refused, a stopped one continues
only with ``resume`` (``privfusion round --resume``) from the report's last round k — θ_k from
``RUN-rk``, a segment already charged reused as stored (never trained or charged again: the
charge of the bytes that may have left stands once), fresh noise, the report appended to (each
start listed in ``sessions``). Before every charge the run asks its own daemon, over the site's
own identity at the address the roster gives its peers, whether it serves; when it does not,
the run stops before charging (status ``alone``): no peer could fetch the segment.

Config (a ``[round]`` table with ``method = "iterate"`` and its ``[round.iterate]``)::

    [round]
    roster = "roster.toml"
    model = "mlp"            # our stored model: its architecture (and stored preprocessing)
    method = "iterate"
    out = "rounds"
    call_timeout_s = 60.0
    [round.iterate]
    records = "records.npz"  # our training records: .npz (x, y) prepared, a table the model's
                             # stored preprocessing reads (CSV/TSV/Parquet), or images (a folder
                             # by class, DIR/<class>/*.png, or a manifest with a path column)
                             # that its stored image preprocessing reads; they never leave.
                             # That preprocessing must not be fitted on these records (its
                             # statistics would change with one of them, outside DP-SGD's
                             # guarantee): fitted on public records, or given; else refused
    run = "iterate"          # the run's name, the same at every site
    rounds = 20
    local_steps = 2
    learning_rate = 0.5
    clip_norm = 1.0
    sample_rate = 1.0        # Poisson rate q of every step's batch (1: full batch; q < 1: each
                             # record with probability q, accounted with amplification)
    epsilon = 4.0            # the whole run's per-record budget (σ is calibrated to it) ...
    delta = 1e-5             # ... at this δ; the ledger's own data budget is the hard stop
    adjacency = "add-remove"
    declared_records = 100   # PUBLIC n: DP-GD's denominator and our fusion weight (add-remove:
                             # required here or as [site] declared_records; never the true count)
    init_seed = 11           # PUBLIC seed of the shared initial model
    # alpha = 0.5            # our own weight (default: by record counts, as FedAvg)
    staleness_decay = 0.5    # weight factor per round a peer's segment is behind
    wait_s = 30.0            # how long to wait for a peer's segment of our round
    # train = "site_training:train"  # the site's own loop, FUNCTION(model, records, step): its
    #                        # augmentation, loss and learning-rate schedule around our DP step
    #                        # (peer.dp.own_loop); MODULE from the site's folder, or FILE.py
    #                        # (relative to this file); code that stays at the site
    # secure = true          # one secure sum per step instead of local noise
    #                        # (coordinator_free.secure_iterate; add-remove, declared_records
    #                        # the same at every site; needs coalition + 2 sites in the roster)
    # coalition = 1          # t: the largest coalition of curious peers the noise covers
    # secure_scale = 1024.0  # γ, integer units per unit of gradient
    # modulus_bits = 32      # b: masks and sums mod 2^b
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free.roster import Roster
from peer.base.config import Section, load_toml
from peer.base.errors import BudgetExhausted, FailedPrecondition, InvalidArgument
from peer.base.records import now_rfc3339

#: How often a peer's segment of our round is asked for again while we wait for it.
POLL_S = 0.1


@dataclass(frozen=True)
class IterateConfig:
    """``[round]`` (roster, model, out, call_timeout_s) + ``[round.iterate]`` of a round file."""

    roster: Path
    model: str
    records: Path
    out: Path
    run: str = "iterate"
    rounds: int = 20
    local_steps: int = 2
    learning_rate: float = 0.5
    # η_1..η_T of every segment (T = local_steps), declared: public, like every step's (σ, C, q);
    # None: learning_rate at every step. A site's own loop (train) may only take these.
    learning_rate_schedule: tuple[float, ...] | None = None
    clip_norm: float = 1.0
    sample_rate: float = 1.0
    epsilon: float = 4.0
    delta: float = 1e-5
    adjacency: str = "add-remove"
    declared_records: int | None = None
    init_seed: int = 11
    alpha: float | None = None
    staleness_decay: float = 0.5
    wait_s: float = 30.0
    call_timeout_s: float = 60.0
    health_timeout_s: float = 2.0
    # secure aggregation (coordinator_free.secure_iterate): one secure sum per step instead of
    # local noise, when the roster has at least coalition + 2 sites
    secure: bool = False
    coalition: int = 1
    secure_scale: float = 1024.0
    modulus_bits: int = 32
    # the site's own training function (peer.dp.own_loop), MODULE:FUNCTION or FILE.py:FUNCTION
    # (FILE made absolute against the round file's folder); None: the built-in loop
    train: str | None = None

    @classmethod
    def from_section(cls, r: Section, base: Path) -> IterateConfig:
        from peer.net.releases import check_run_name
        from peer.nn.imported import resolve_factory

        r.known(("roster", "model", "method", "out", "label", "call_timeout_s", "health_timeout_s", "iterate"))
        if r.string("method") != "iterate":
            r.fail("method", "must be 'iterate' here")
        it = r.section("iterate", required=True)
        it.known(
            tuple(
                f
                for f in cls.__dataclass_fields__
                if f not in ("roster", "model", "out", "call_timeout_s", "health_timeout_s")
            )
        )
        run = it.string("run", "iterate")
        try:
            check_run_name(run, "round.iterate.run")
        except InvalidArgument as e:
            it.fail("run", e.rule)
        records = it.path("records", base)
        if not (records.is_file() or records.is_dir()):
            it.fail(
                "records",
                f"{str(records)!r} is neither a file nor a folder of images by class (paths are relative to "
                "the round file)",
            )
        secure = it.boolean("secure", False)
        if secure and it.string("adjacency", "add-remove") != "add-remove":
            it.fail("adjacency", "secure aggregation is accounted under add-remove only")
        if secure and it.integer("declared_records", None, minimum=1) is None:
            it.fail(
                "declared_records",
                "is required with secure = true: every site of the run declares the same public n, the "
                "denominator q·k·n of each step's update",
            )
        train = it.string("train", None)
        if train is not None:
            if train.count(":") != 1 or not all(train.split(":")):
                it.fail(
                    "train",
                    f"must be MODULE:FUNCTION or FILE.py:FUNCTION (the site's own training function, called as "
                    f"FUNCTION(model, records, step)), got {train!r}",
                )
            if secure:
                it.fail(
                    "train",
                    "takes no own loop with secure = true: each step there is one secure sum of every site's "
                    "clipped gradients, taken by coordinator_free.secure_iterate",
                )
            train = resolve_factory(train, base)
        local_steps = it.integer("local_steps", 2, minimum=1, maximum=100_000)
        schedule = it.numbers("learning_rate_schedule", None, length=local_steps, exclusive_minimum=0.0, maximum=100.0)
        if schedule is not None and secure:
            it.fail(
                "learning_rate_schedule", "takes no schedule with secure = true: every step there uses learning_rate"
            )
        return cls(
            roster=r.path("roster", base).resolve(),
            model=r.string("model"),
            records=records.resolve(),
            out=r.path("out", base, base / "rounds").resolve(),
            run=run,
            rounds=it.integer("rounds", 20, minimum=1, maximum=10_000),
            local_steps=local_steps,
            learning_rate=it.number("learning_rate", 0.5, exclusive_minimum=0.0, maximum=100.0),
            learning_rate_schedule=None if schedule is None else tuple(schedule),
            clip_norm=it.number("clip_norm", 1.0, exclusive_minimum=0.0),
            sample_rate=it.number("sample_rate", 1.0, exclusive_minimum=0.0, maximum=1.0),
            epsilon=it.number("epsilon", 4.0, exclusive_minimum=0.0, maximum=1000.0),
            delta=it.number("delta", 1e-5, exclusive_minimum=0.0, maximum=0.1),
            adjacency=it.string("adjacency", "add-remove", choices=("add-remove", "replace-one")),
            declared_records=it.integer("declared_records", None, minimum=1),
            init_seed=it.integer("init_seed", 11, minimum=0),
            alpha=it.number("alpha", None, minimum=0.0, maximum=1.0),
            staleness_decay=it.number("staleness_decay", 0.5, minimum=0.0, maximum=1.0),
            wait_s=it.number("wait_s", 30.0, minimum=0.0, maximum=3600.0),
            call_timeout_s=r.number("call_timeout_s", 60.0, exclusive_minimum=0.0, maximum=3600.0),
            health_timeout_s=r.number("health_timeout_s", 2.0, exclusive_minimum=0.0, maximum=600.0),
            secure=secure,
            coalition=it.integer("coalition", 1, minimum=0, maximum=1000),
            secure_scale=it.number("secure_scale", 1024.0, exclusive_minimum=0.0, maximum=2.0**40),
            modulus_bits=it.integer("modulus_bits", 32, minimum=2, maximum=64),
            train=train,
        )


def is_iterate_file(path: str | os.PathLike) -> bool:
    """Whether a round file's ``[round]`` says ``method = "iterate"``."""
    data, _ = load_toml(Path(path), "round file")
    r = data.get("round")
    return isinstance(r, dict) and r.get("method") == "iterate"


def load_iterate_config(path: str | os.PathLike) -> IterateConfig:
    p = Path(path)
    data, text = load_toml(p, "round file")
    if "round" not in data:
        raise InvalidArgument(f"round ({p})", "the file has no [round] table")
    return IterateConfig.from_section(Section(data["round"], ("round",), text, str(p)), p.resolve().parent)


# ------------------------------------------------------------------------------ the pure parts


def fusion_weights_by_records(
    records: list[int], staleness: list[int], decay: float, alpha: float | None = None
) -> list[float]:
    """Weights (summing to 1) of [own, peer_1, …]: w_j ∝ n_j · decay^{s_j} (own s = 0); with
    ``alpha``, own gets α and the peers share 1 − α in proportion to their w_j. With every
    s_j = 0 and no α: n_j / Σ n — DP-FedAvg's weighted average."""
    raw = [float(n) * decay ** int(s) for n, s in zip(records, staleness, strict=True)]
    if alpha is None or len(raw) == 1:
        total = sum(raw)
        return [w / total for w in raw]
    peers = sum(raw[1:])
    if peers <= 0:
        return [1.0] + [0.0] * (len(raw) - 1)
    return [alpha] + [(1.0 - alpha) * w / peers for w in raw[1:]]


def load_records(path: Path, stored) -> tuple[np.ndarray, np.ndarray]:
    """The site's own training records, prepared as its model expects: an ``.npz`` with
    ``x`` (already prepared inputs) and ``y`` (integer labels), a table file (CSV/TSV/Parquet)
    read by the model's stored preprocessing (``peer.nn.tables``), or image records — a folder
    by class or a manifest (``peer.nn.images.is_image_source``) — decoded and normalised by
    the model's stored image preprocessing (its channels, size and per-channel statistics, as
    fitted when the model was trained: never re-fitted on these records). Every image file is
    checked before any step runs; a bad one is refused naming ``round.iterate.records`` and its
    path."""
    from peer.nn.images import ImagePreprocessing, is_image_source
    from peer.nn.tables import refuse_preprocessing_of

    field_name = "round.iterate.records"
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "x" not in z or "y" not in z:
                raise InvalidArgument(field_name, f"{path} must hold arrays 'x' and 'y'")
            x, y = np.asarray(z["x"]), np.asarray(z["y"])
    else:
        prep = stored.preprocessing
        images = is_image_source(path)
        what = "a folder of images by class" if path.is_dir() else "an image manifest" if images else "a table"
        if prep is None:
            raise InvalidArgument(
                field_name,
                f"{path} is {what}, but model {stored.name!r} has no stored preprocessing to read it with "
                "(give an .npz of prepared x, y)",
            )
        if images != isinstance(prep, ImagePreprocessing):
            raise InvalidArgument(
                field_name,
                f"{path} is {what}, but model {stored.name!r}'s stored preprocessing reads "
                f"{'images' if isinstance(prep, ImagePreprocessing) else 'tables'}",
            )
        try:
            records = prep.read(path)
        except InvalidArgument as e:
            raise InvalidArgument(field_name, f"{e.field}: {e.rule}") from None
        refuse_preprocessing_of(
            prep,
            records.digest,
            path.name,
            field_name,
            f"train model {stored.name!r} with its preprocessing fitted on public records "
            "(privfusion model train --public FILE), or give an .npz of inputs prepared without them",
        )
        try:
            x, y = prep.transform(records)
        except InvalidArgument as e:
            raise InvalidArgument(field_name, f"{e.field}: {e.rule}") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise InvalidArgument(field_name, f"{path.name}: need x (n, …) and y (n,), n ≥ 1")
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(field_name, f"{path.name}: x holds NaN or infinite values")
    return x.astype(np.float32), y.astype(np.int64)


def segment_size(cfg: IterateConfig, site_declared: int | None, records: int) -> tuple[int, str]:
    """(n, source) of every segment's DP-GD denominator: the run's ``declared_records``, else
    (add-remove) the site's ``[site] declared_records``: "declared"; under replace-one with
    neither, the number of ``records`` ("count", public in that neighbourhood). Add-remove with
    neither is refused (InvalidArgument naming both keys): the true count is never used there."""
    if cfg.declared_records is not None:
        return cfg.declared_records, "declared"
    if cfg.adjacency == "add-remove":
        if site_declared is None:
            raise InvalidArgument(
                "round.iterate.declared_records",
                "is required under add-remove adjacency (or [site] declared_records in site.toml): the number "
                "of training records is private there, so DP-GD divides by a public count you declare",
            )
        return site_declared, "declared"
    return records, "count"


def segment_training(cfg: IterateConfig, noise_multiplier: float):
    """The accountant's TrainingRecord of one segment: local_steps Gaussian steps, each on a
    Poisson batch of rate ``sample_rate`` (1: full batch), at the declared learning rates."""
    from peer.dp.accounting import GaussianStep, TrainingRecord

    if cfg.learning_rate_schedule is not None:
        steps = tuple(
            GaussianStep(lr, cfg.clip_norm, noise_multiplier, cfg.sample_rate) for lr in cfg.learning_rate_schedule
        )
        return TrainingRecord(cfg.adjacency, steps)
    return TrainingRecord.constant(
        cfg.adjacency, cfg.local_steps, cfg.learning_rate, cfg.clip_norm, noise_multiplier, cfg.sample_rate
    )


# ------------------------------------------------------------------------------ the site's network


@dataclass
class SiteNetwork:
    """The network a run trains: a built-in architecture of the site's model store (``stored``
    a ``peer.nn.store.StoredModel``), or the site's own network (``own`` a
    ``peer.nn.imported.ImportedModel`` of its own-model store ``own_store``, rebuilt by its
    ``factory``), as ``coordinator_free.runner.load_local_site`` decides: ``own_models/NAME.json``
    exists. ``arch`` is the public architecture every release of the run carries (an own
    network's traced structure and digest, never its code); ``stored`` reads the records (its
    ``preprocessing`` and ``name``). Only parameters are trained and released; an own network's
    buffers (BatchNorm's running statistics) are the constants of θ_0 (``buffers``), put back
    into every model the run saves."""

    arch: dict[str, Any]
    stored: Any
    own: Any = None
    factory: Callable | None = None
    own_store: Path | None = None
    buffers: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of_site(cls, site, model: str) -> SiteNetwork:
        from peer.nn.store import load_model

        if site.own_models is not None and (site.own_models / f"{model}.json").is_file():
            from peer.nn.imported import load_factory, load_imported

            own = load_imported(site.own_models, model)
            site_dir = site.path.resolve().parent if site.path else site.own_models.parent
            factory = load_factory(own.factory, [site_dir])
            return cls(dict(own.release_architecture), own, own, factory, site.own_models)
        stored = load_model(site.models, model)
        return cls(dict(stored.architecture), stored)

    @property
    def start_text(self) -> str:
        """Where round 1 starts, as the segment's record says."""
        if self.own is None:
            return "build_model(architecture, init_seed)"
        return "the site's factory's module built under torch.manual_seed(init_seed) (never its imported weights)"

    def initial_module(self, init_seed: int):
        """θ_0's module (public): ``build_model(arch, seed=init_seed)``; an own network's factory
        module built under ``torch.manual_seed(init_seed)`` — never the site's imported weights,
        trained outside any guarantee — checked against the stored structure and by
        ``check_private_training`` (refused before anything is charged), in eval mode as
        ``peer.dp.training.train_dpsgd_module`` trains it (BatchNorm's running statistics are
        constants; only parameters are trained). Its buffers are kept (``buffers``)."""
        if self.own is None:
            from peer.nn.architectures import build_model

            return build_model(self.arch, seed=init_seed)

        from peer.dp.training import check_private_training
        from peer.nn.architectures import seeded_initialisation
        from peer.nn.imported import build_module

        with seeded_initialisation(init_seed):  # sites in threads of one process draw one by one
            module = build_module(self.factory, self.own.factory)
        self.own.structure.check_arrays(
            {k: v.detach().numpy() for k, v in module.state_dict().items()}, "factory state dict"
        )
        check_private_training(module)
        module = module.float().eval()
        params = dict(module.named_parameters())
        self.buffers = {
            k: np.array(v.detach().numpy(), copy=True) for k, v in module.state_dict().items() if k not in params
        }
        return module

    def inputs(self, x: np.ndarray):
        if self.own is None:
            from peer.nn.architectures import input_tensor

            return input_tensor(self.arch, x)
        from peer.nn.imported import input_batch

        return input_batch(self.own.structure, x)

    def module_holding(self, theta: Mapping[str, np.ndarray]):
        """A module holding θ (its parameters; an own network's buffers are θ_0's), for a site's
        own loop."""
        if self.own is None:
            from peer.nn.architectures import model_from_arrays

            return model_from_arrays(self.arch, theta)
        from peer.nn.imported import module_from_arrays

        return module_from_arrays(self.factory, self.own.structure, self.state(theta))

    def state(self, theta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The full state dict of an own network holding parameters θ, in the site's key order."""
        full = {**self.buffers, **theta}
        return {k: full[k] for k in self.own.structure.parameters}

    def save(self, out: Path, name: str, theta: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        """A fused model: in ``out/models`` (built-in), or in the site's own-model store under its
        key names with its preprocessing (an own network: ``privfusion evaluate`` and ``model
        adopt`` read it there, as they read a round's own-network stages)."""
        if self.own is None:
            from peer.nn.store import save_model

            save_model(out / "models", name, self.arch, theta, metadata, self.stored.preprocessing)
            return
        from peer.nn.imported import save_imported

        save_imported(
            self.own_store, name, self.own.factory, self.own.structure, self.state(theta), metadata,
            self.own.preprocessing,
        )  # fmt: skip

    def refuse_overwrite(self, names: list[str]) -> None:
        """An own network's fused models go into the site's own-model store: refuse
        (FailedPrecondition, before anything is charged) a new run whose models would replace one
        there (the network itself, or another run's of the same name)."""
        if self.own is None:
            return
        taken = [m for m in names if m == self.own.name or (self.own_store / f"{m}.json").exists()]
        if taken:
            raise FailedPrecondition(
                f"round.iterate.run: this run's fused models go into the own-model store {self.own_store}, which "
                f"already holds {taken[0]!r}; give the run another name"
            )

    def load(self, out: Path, name: str, theta0: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """θ of a model :meth:`save` wrote (its parameters only, those of ``theta0``)."""
        if self.own is None:
            from peer.nn.store import load_model

            last = load_model(out / "models", name)
            return {k: np.asarray(v, dtype=np.float32) for k, v in last.arrays.items()}
        from peer.nn.imported import load_imported

        last = load_imported(self.own_store, name)
        return {k: np.asarray(last.arrays[k], dtype=np.float32) for k in theta0}

    def check_segment(self, architecture: Any, arrays: Mapping[str, Any], theta: Mapping[str, np.ndarray], who: str):
        """Why a peer's segment cannot be averaged with ours (None: it can): an own network's
        architecture must be ours digest for digest; for every network the tensors must be our
        parameters' names and shapes, floating point and finite."""
        if self.own is not None:
            from peer.nn.imported import check_same_structure

            try:
                check_same_structure(self.own.structure, architecture, who)
            except FailedPrecondition as e:
                return str(e)
        missing, extra = sorted(set(theta) - set(arrays)), sorted(set(arrays) - set(theta))
        if missing or extra:
            return f"its tensors are not our parameters: missing {missing[:5]}, unexpected {extra[:5]}"
        for k, ours in theta.items():
            a = arrays[k]
            if tuple(np.shape(a)) != tuple(np.shape(ours)):
                return f"tensor {k!r} has shape {list(np.shape(a))}, ours {list(np.shape(ours))}"
            if not np.issubdtype(np.asarray(a).dtype, np.floating):
                return f"tensor {k!r} is {np.asarray(a).dtype}, not floating point"
            if not np.all(np.isfinite(a)):
                return f"tensor {k!r} holds NaN or infinite values"
        return None


# ------------------------------------------------------------------------------ the loop


@dataclass
class IterateResult:
    status: str  # "finished" | "budget" (the ledger refused a segment) | "alone" | "interrupted"
    reason: str
    rounds_done: int
    report: dict
    report_path: Path | None = None
    models: list[str] = field(default_factory=list)


@dataclass
class _Run:
    """One iterate run in progress at this site: what every round reads (the plan, the site's
    model, records and ledger, one client per peer, how to reach its own daemon) and what the
    rounds carry forward (``theta`` — the fused model of the previous round —, the peers found
    gone, each peer's last state, the report)."""

    cfg: IterateConfig
    me: str
    arch: dict[str, Any]
    stored: Any
    n: int
    n_source: str
    ledger: Any
    store: Any
    sigma: float
    rnd_master: Any
    peers: list
    clients: dict
    loss: Any
    xt: Any
    yt: Any
    theta: dict[str, np.ndarray]
    report: dict[str, Any]
    emit: Callable[[dict], None]
    stop: threading.Event
    identity: Any = None
    own_address: str | None = None
    lock: Any = None
    first_round: int = 1
    gone: set[str] = field(default_factory=set)
    states: dict[str, str] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    #: the site's own training function (``[round.iterate] train``), None: the built-in loop
    train: Callable | None = None
    #: the network trained (built-in or the site's own): θ_0, inputs, checks, saved models
    net: SiteNetwork | None = None

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.ledger.close()
        if self.lock is not None:
            self.lock.release()


def _open_run(
    site_config: str | os.PathLike,
    cfg: IterateConfig,
    on_event: Callable[[dict], None] | None,
    stop: threading.Event | None,
    simulation: bool,
    resume: bool = False,
) -> _Run:
    """The run before its first round: the site's checks (identity, a data budget per record of
    the run's adjacency, no fixed seed outside a simulation), its model, records and ledger, the
    noise multiplier that meets the target over every step, one client per peer, round 1's
    start θ_0 = build_model(architecture, init_seed), and the report's plan — or, for a run
    started before (:func:`_previous_run`), its report, θ and next round, with ``resume``."""
    import torch

    from peer.base.rng import make_randomness
    from peer.budget.dpsgd_noise import noise_multiplier_for
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy
    from peer.dp.training import classifier_loss
    from peer.net.client import PeerClient
    from peer.net.identity import load_identity
    from peer.net.releases import ReleaseStore
    from peer.net.site import SiteConfig
    from peer.net.site_lock import SiteLock
    from peer.nn.imported import load_factory

    site = SiteConfig.load(site_config)
    if site.seed is not None and not simulation:
        raise FailedPrecondition(
            f"site.seed in {site.path or site_config}: a fixed noise seed is not private (anyone who knows it "
            "reproduces every segment's noise); remove it for production, or run with --simulation "
            "(privfusion round --simulation) for tests and simulations"
        )
    identity = load_identity(site.identity)
    if identity.name != site.name:
        raise FailedPrecondition(f"site.name is {site.name!r} but the identity in {site.identity} is {identity.name!r}")
    me = site.name
    policy = Policy.from_toml(Path(site_config))
    if policy.data is None or policy.data.unit != f"record:{cfg.adjacency}":
        raise FailedPrecondition(
            f"{site_config}: the run's segments are data-level releases per record:{cfg.adjacency}; the site's "
            f"policy needs a [policy.data] budget in that unit"
        )
    # the site's own loop, loaded (its code run) before anything is opened or charged
    train = None
    if cfg.train is not None:
        site_dir = Path(site.path or site_config).resolve().parent
        train = load_factory(cfg.train, [site_dir], field="round.iterate.train")
    # the network: built-in, or the site's own (θ_0 from its factory; refused here, before
    # anything is opened or charged, when DP-SGD cannot train it)
    net = SiteNetwork.of_site(site, cfg.model)
    stored, arch = net.stored, net.arch
    module = net.initial_module(cfg.init_seed)
    x, y = load_records(cfg.records, stored)
    n, n_source = segment_size(cfg, site.declared_records, len(y))
    roster = Roster.load(cfg.roster)
    peers = [p for p in roster.peers_of(me)]
    if peers and me not in roster.sites:
        raise FailedPrecondition(
            f"{cfg.roster}: the roster does not list this site ({me!r}): its peers fetch our segments at the "
            "address the roster gives, and the run checks our own daemon there before every charge"
        )
    cfg.out.mkdir(parents=True, exist_ok=True)
    # one process per run: a second `privfusion round` of the same run would charge its segments again
    lock = SiteLock(_report_path(cfg), field=f"round.iterate.run ({cfg.run!r})", holder="process running this run")
    ledger = Ledger(site.ledger, policy)
    try:
        store = ReleaseStore(site.ledger.with_name(site.ledger.stem + ".releases"))
        total_steps = cfg.rounds * cfg.local_steps
        sigma = noise_multiplier_for(
            cfg.epsilon,
            cfg.delta,
            total_steps,
            sample_rate=cfg.sample_rate,
            adjacency=cfg.adjacency,
            figure="filter",
            orders=ledger.orders,
        )
        previous = _previous_run(cfg, ledger, resume, n, sigma)
        if previous is None:
            net.refuse_overwrite([f"{cfg.run}-r{k}" for k in range(1, cfg.rounds + 1)])
    except BaseException:
        ledger.close()
        lock.release()
        raise
    sessions = previous.get("sessions", []) if previous else []
    # Noise: fresh CSPRNG streams; a simulation's fixed site seed (reported; refused above
    # without `simulation`) is moved off the daemon's own stream so that the two never draw
    # the same numbers, and off every earlier session's of this run (a resumed run never
    # replays the noise of the rounds it already ran).
    rnd_master = make_randomness(None if site.seed is None else site.seed + 2**31 + 2**32 * len(sessions))
    clients = {p.name: PeerClient(identity, p.address, peer=p.name) for p in peers}
    loss = classifier_loss(module)
    xt = net.inputs(x)
    yt = torch.as_tensor(y, dtype=torch.long)
    theta = {k: v.detach().numpy().astype(np.float32) for k, v in module.named_parameters()}
    report: dict[str, Any] = previous or {
        "site": me,
        "run": cfg.run,
        "method": "iterate",
        "started_at": now_rfc3339(),
        "dataset_size": n,
        "dataset_size_source": n_source,
        "plan": {
            "rounds": cfg.rounds,
            "local_steps": cfg.local_steps,
            "learning_rate": cfg.learning_rate,
            **(
                {"learning_rate_schedule": list(cfg.learning_rate_schedule)}
                if cfg.learning_rate_schedule is not None
                else {}
            ),
            "clip_norm": cfg.clip_norm,
            "noise_multiplier": sigma,
            "sample_rate": cfg.sample_rate,
            "adjacency": cfg.adjacency,
            "epsilon": cfg.epsilon,
            "delta": cfg.delta,
            "init_seed": cfg.init_seed,
            "train": cfg.train,
            "ledger_orders": list(ledger.orders),
            "alpha": cfg.alpha,
            "staleness_decay": cfg.staleness_decay,
            "wait_s": cfg.wait_s,
            "noise_multiplier_figure": "filter of this site's ledger (its orders, δ split across them)",
            "randomness": rnd_master.record_fields(),
        },
        "rounds": [],
    }
    done = len(report["rounds"])
    if done:  # θ_k: the fused model of the last round the report has (its rounds are 1..k)
        try:
            theta = net.load(cfg.out, f"{cfg.run}-r{done}", theta)
        except BaseException:
            ledger.close()
            lock.release()
            raise
    report["status"], report["reason"] = "running", f"round {done + 1} of {cfg.rounds} next"
    report["sessions"] = [
        *sessions,
        {"started_at": now_rfc3339(), "first_round": done + 1, "randomness": rnd_master.record_fields()},
    ]
    own = roster.sites[me].address if me in roster.sites else None
    run = _Run(
        cfg, me, arch, stored, n, n_source, ledger, store, sigma, rnd_master, peers, clients, loss, xt, yt, theta,
        report, on_event or (lambda e: None), stop or threading.Event(), identity, own, lock, done + 1,
        train=train, net=net,
    )  # fmt: skip
    _write_report(run)
    return run


#: What a resumed run must share with the run it continues: the plan's keys that fix σ, the
#: accounting of every segment and the path of θ (a change would make the run another run).
RESUME_KEYS = (
    "rounds",
    "local_steps",
    "learning_rate",
    "learning_rate_schedule",
    "clip_norm",
    "noise_multiplier",
    "adjacency",
    "epsilon",
    "delta",
    "init_seed",
    "train",
)


def _report_path(cfg: IterateConfig) -> Path:
    return cfg.out / f"{cfg.run}.json"


def _charged_rounds(ledger, run: str) -> list[int]:
    """The rounds of ``run``'s segments whose charge stands in ``ledger``, ascending."""
    rounds = []
    for e in ledger.entries(level="data", subject=run):
        segment = e.record.parameters.get("segment") if e.mechanism == "dpsgd" else None
        if isinstance(segment, Mapping) and segment.get("run") == run:
            rounds.append(int(segment["round"]))
    return sorted(rounds)


def _previous_run(cfg: IterateConfig, ledger, resume: bool, n: int, sigma: float) -> dict | None:
    """The report of an earlier, unfinished start of this run (to continue, with ``resume``), or
    None for a run never started. A run name is used once per site: a finished run, a run
    started before without ``resume``, a resumed run whose plan differs, and a run whose ledger
    holds charged segments but no report are refused (FailedPrecondition naming the report):
    each would charge segments of the same run again."""
    path = _report_path(cfg)
    charged = _charged_rounds(ledger, cfg.run)
    how = f"give the new run another name ([round.iterate] run in {cfg.run!r}'s round file)"
    if not path.exists():
        if charged:
            raise FailedPrecondition(
                f"run {cfg.run!r}: the ledger holds {len(charged)} charged segments of this run (rounds "
                f"{charged[0]}..{charged[-1]}) but there is no report {path} to continue it from; {how}"
            )
        return None
    try:
        previous = json.loads(path.read_text())
        status, rounds, plan = previous["status"], previous["rounds"], previous["plan"]
        done = [int(x["round"]) for x in rounds]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FailedPrecondition(
            f"run {cfg.run!r}: its report {path} does not read ({type(e).__name__}); {how}"
        ) from None
    if done != list(range(1, len(done) + 1)):
        raise FailedPrecondition(f"run {cfg.run!r}: the rounds of {path} are not 1..k ({done}); {how}")
    summary = f"{len(done)} of {plan.get('rounds')} rounds done, {len(charged)} segments charged; report {path}"
    if status == "finished":
        raise FailedPrecondition(
            f"run {cfg.run!r} has finished ({summary}): running it again would charge every segment again; {how}"
        )
    if not resume:
        how_it_ended = (
            "its process ended without finishing: killed or crashed"
            if status == "running"
            else f"{status}: {previous.get('reason')}"
        )
        raise FailedPrecondition(
            f"run {cfg.run!r} was started before and stopped ({how_it_ended}; {summary}): "
            f"continue it with `privfusion round --config SITE --round FILE --resume` (nothing charged is bought "
            f"again), or {how}"
        )
    ours = {**_plan_keys(cfg), "noise_multiplier": sigma}
    for key in RESUME_KEYS:
        if plan.get(key) != ours[key]:
            raise FailedPrecondition(
                f"run {cfg.run!r}: --resume continues the run of {path}, planned with {key} = {plan.get(key)!r}; "
                f"this round file gives {ours[key]!r} (a resumed run keeps its plan; {how} to change it)"
            )
    if previous.get("dataset_size") != n:
        raise FailedPrecondition(
            f"run {cfg.run!r}: --resume continues a run whose segments divide by n = {previous.get('dataset_size')}; "
            f"this site now gives n = {n} (declared_records must stay the same)"
        )
    return previous


def _plan_keys(cfg: IterateConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in RESUME_KEYS if k != "noise_multiplier"}


def _write_report(run: _Run) -> None:
    """OUT/RUN.json, atomically: written when the run opens, after every round and when it
    ends, so that a run stopped at any point (SIGKILL, reboot) leaves the rounds it completed —
    what ``resume`` continues from."""
    path = _report_path(run.cfg)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run.report, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def _own_daemon_gone(run: _Run) -> str | None:
    """Why our own daemon does not serve (None: it does), asked over the site's own identity at
    the address the roster gives our peers (``peer.net.client.own_daemon_health``). A run with
    no peers serves nobody and needs no daemon: None."""
    from peer.net.client import own_daemon_health

    if not run.peers:
        return None
    return own_daemon_health(run.identity, run.own_address, run.cfg.health_timeout_s)


@dataclass(frozen=True)
class _Segment:
    """Our segment of one round, as published: its arrays and tensors, its record and ledger
    entry, and the ε figures after it (the filter's, all and this run's; the PLD's)."""

    own: dict[str, np.ndarray]
    tensors: list[tuple[str, np.ndarray]]
    record: Any
    entry_id: str
    spent: float
    spent_run: float
    eps_pld: float
    reused: bool = False


#: What a segment's record says of a site's own loop (its code and its name stay at the site).
OWN_LOOP = (
    "the site's own training function around this package's DP step (peer.dp.own_loop): the site chose "
    "the per-record augmentation and the per-example loss; the batches, clipping, noise, step count and "
    "each step's learning rate (declared, listed in training) are the plan's"
)


#: What a segment's record says of an own network's norm layers (``train_dpsgd_module``'s rule).
OWN_NORM_LAYERS = "eval mode: running statistics frozen at their initial values (only parameters trained)"


class _Alone(Exception):
    """Our own daemon does not serve: a segment charged now could reach no peer."""


def _spent(run: _Run, r: int) -> tuple[float, float, float]:
    from peer.budget.dpsgd_noise import run_epsilon

    cfg = run.cfg
    eps_pld = run_epsilon(
        run.sigma, r * cfg.local_steps, cfg.delta, sample_rate=cfg.sample_rate, adjacency=cfg.adjacency, figure="pld"
    )
    return _data_spent(run.ledger), _data_spent(run.ledger, run=cfg.run), eps_pld


def _reused_segment(run: _Run, r: int) -> _Segment | None:
    """Round ``r``'s segment as an earlier session of this run published it, when its charge
    stands (it was charged, and may have been served: the same bytes are used and served again,
    never trained or charged anew); None when there is none (or it was stored but never
    charged — then nothing of it left, and the round trains a fresh one)."""
    from peer.net.releases import segment_key

    stored = run.store.get(segment_key(run.cfg.run, r))
    if stored is None:
        return None
    charge = run.ledger.charge_of(stored.record.release_id)
    if charge is None or charge[1]:
        return None
    own = {k: np.asarray(a, dtype=np.float32) for k, a in stored.tensors}
    return _Segment(own, list(stored.tensors), stored.record, str(charge[0].entry_id), *_spent(run, r), reused=True)


def _train_and_publish_segment(run: _Run, r: int) -> _Segment:
    """Round ``r``'s segment: local DP-GD from θ_{r−1} on our records, its record (the digest of
    its tensors, its place in the run), charged and published (``publish_segment``: the ledger
    first, then the store that serves it to every peer). BudgetExhausted when the ledger refuses:
    then nothing is released. :class:`_Alone`, before the charge, when our own daemon does not
    serve (nobody could fetch the segment)."""
    import torch

    from peer.dp.training import dpsgd_release_record, run_dpsgd
    from peer.net import wire
    from peer.net.releases import StoredRelease, publish_segment, release_sha256, segment_key

    cfg = run.cfg
    training = segment_training(cfg, run.sigma)
    rnd = run.rnd_master.spawn()
    if run.train is None:
        params0 = {k: torch.from_numpy(np.array(v)) for k, v in run.theta.items()}
        params = run_dpsgd(run.loss, params0, run.xt, run.yt, training.steps, randomness=rnd, dataset_size=run.n).params
    else:  # the site's own loop around the same DP step; refused here, before any charge
        from peer.dp.own_loop import run_own_loop

        own_run = run_own_loop(
            run.train, run.net.module_holding(run.theta), run.xt, run.yt, training, randomness=rnd,
            dataset_size=run.n, field="round.iterate.train", name=cfg.train,
        )  # fmt: skip
        params, training = own_run.params, own_run.training  # its record: the plan's steps as taken
    own = {k: v.numpy().astype(np.float32) for k, v in params.items()}
    tensors = [(k, own[k]) for k in sorted(own)]
    record = dpsgd_release_record(
        training, delta=cfg.delta, dataset_size=run.n, randomness=rnd, init_seed=cfg.init_seed,
        architecture=run.arch, subject=cfg.run, source=run.n_source,
    )  # fmt: skip
    digest = release_sha256([(k, wire.digest(a)) for k, a in tensors])
    record = record.with_(
        parameters={
            **record.parameters,
            "release_sha256": digest,
            "segment": {
                "run": cfg.run,
                "round": r,
                "start": "the site's fused model of the previous round (post-processing of released "
                f"segments); round 1 starts from {run.net.start_text}",
            },
            **({"loop": OWN_LOOP} if run.train is not None else {}),
            **({"norm_layers": OWN_NORM_LAYERS} if run.net.own is not None else {}),
        }
    )
    key = segment_key(cfg.run, r)
    metadata = {"run": cfg.run, "round": r, "records": run.n}
    gone = _own_daemon_gone(run)
    if gone is not None:
        raise _Alone(gone)
    entry_id = publish_segment(
        run.store, run.ledger, cfg.run, r, StoredRelease(key, record, run.arch, metadata, tensors)
    )
    return _Segment(own, tensors, record, entry_id, *_spent(run, r))


def _fetch_peer_segments(run: _Run, r: int) -> dict[str, dict]:
    """Every peer's segment of round ``r`` (or its newest older one), all at once
    (:func:`_fetch_segment`); the peers found gone are remembered, and forgotten once they answer."""
    from peer.net.client import PeerError

    names = [p.name for p in run.peers]

    def fetch(name: str) -> dict:
        return _fetch_segment(
            run.clients[name], name, run.cfg, r, name in run.gone, run.stop, PeerError, run.net, run.theta
        )

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        got = dict(zip(names, pool.map(fetch, names), strict=True))
    for name, g in got.items():
        if g["state"] == "gone":
            run.gone.add(name)
        elif name in run.gone and g["state"] in ("fresh", "stale"):
            run.gone.discard(name)
        before = run.states.get(name)
        if g["state"] != before and (before is not None or g["state"] != "fresh"):
            run.emit(
                {"event": "iterate-peer", "site": run.me, "round": r, "peer": name, "state": g["state"],
                 "was": before, "staleness": g.get("staleness"), "reason": g.get("reason")}
            )  # fmt: skip
        run.states[name] = g["state"]
    return got


def _fuse_segments(run: _Run, r: int, segment: _Segment, got: dict[str, dict]) -> tuple[str, list[str], list[float]]:
    """θ_r: our segment and every fetched one averaged with weights by records and staleness
    (:func:`fusion_weights_by_records`), saved as ``RUN-rR`` in OUT/models; the model's name,
    the contributors and the weights (ours first). The fetched arrays leave ``got`` (it goes
    into the report)."""
    from peer.ldp.fusion import average_arrays

    cfg = run.cfg
    arrays, counts, stale, contributors = [segment.own], [run.n], [0], []
    for name, g in got.items():
        if g.get("arrays") is None:
            continue
        arrays.append(g.pop("arrays"))
        counts.append(g["records"])
        stale.append(g["staleness"])
        contributors.append(name)
    for g in got.values():
        g.pop("arrays", None)
    weights = fusion_weights_by_records(counts, stale, cfg.staleness_decay, cfg.alpha)
    theta = average_arrays(arrays, weights)
    run.theta = {k: np.asarray(v, dtype=np.float32) for k, v in theta.items()}
    name = f"{cfg.run}-r{r}"
    run.net.save(
        cfg.out,
        name,
        run.theta,
        {"run": cfg.run, "round": r, "contributors": [run.me, *contributors], "weights": weights},
    )
    run.models.append(name)
    for c, w in zip(contributors, weights[1:], strict=True):
        got[c]["weight"] = w
    return name, contributors, weights


def _run_one_round(run: _Run, r: int) -> tuple[str, str] | None:
    """Round ``r``: publish our segment (or reuse the one an earlier session of the run charged),
    fetch the peers', fuse, report (written at once). ("budget", why) when the ledger refuses our
    segment, ("alone", why) when our own daemon does not serve — both before anything is
    charged or released —, else None."""
    t0 = time.monotonic()
    try:
        segment = _reused_segment(run, r) or _train_and_publish_segment(run, r)
    except BudgetExhausted as e:
        run.emit({"event": "iterate-budget", "site": run.me, "round": r, "reason": str(e)})
        return "budget", f"round {r}: the ledger refused the segment (nothing released): {e}"
    except _Alone as e:
        run.emit({"event": "iterate-alone", "site": run.me, "round": r, "address": run.own_address, "reason": str(e)})
        return "alone", (
            f"round {r}: stopped before charging its segment: our own daemon at {run.own_address} does not serve "
            f"({e}), so no peer could fetch it; start the daemon and continue with --resume"
        )
    run.emit(
        {"event": "segment", "site": run.me, "round": r, "entry_id": segment.entry_id, "reused": segment.reused,
         "epsilon_filter": segment.spent, "epsilon_filter_run": segment.spent_run, "epsilon_pld": segment.eps_pld}
    )  # fmt: skip
    got = _fetch_peer_segments(run, r)
    name, contributors, weights = _fuse_segments(run, r, segment, got)
    run.report["rounds"].append(
        {
            "round": r,
            "segment": {
                "entry_id": segment.entry_id,
                "release_id": segment.record.release_id,
                "bytes": _nbytes(segment.tensors),
                "reused": segment.reused,
            },
            "epsilon_filter": segment.spent,
            "epsilon_filter_run": segment.spent_run,
            "epsilon_pld": segment.eps_pld,
            "model": name,
            "contributors": contributors,
            "own_weight": weights[0],
            "peers": got,
            "bytes_received": int(sum(g.get("bytes", 0) for g in got.values())),
            "seconds": round(time.monotonic() - t0, 3),
        }
    )
    run.report["reason"] = f"round {r} of {run.cfg.rounds} done"
    _write_report(run)
    run.emit(
        {"event": "iterate-fused", "site": run.me, "round": r, "contributors": contributors,
         "stale": {c: got[c]["staleness"] for c in contributors if got[c]["staleness"]}}
    )  # fmt: skip
    return None


def _finish_run(run: _Run, status: str, reason: str) -> IterateResult:
    """The run's end: linger while peers fetch our last segment (a finished run only), count the
    bytes served, the ε figures of the whole run, and write OUT/RUN.json."""
    from peer.budget.dpsgd_noise import run_epsilon

    cfg, ledger, report = run.cfg, run.ledger, run.report
    if status == "finished":
        # Our last segment is still wanted by peers finishing their last round: let them
        # fetch it before we count bytes sent (their waiting is bounded by wait_s).
        _linger(ledger, report, cfg, len(run.peers), run.stop)
    _bytes_sent(ledger, report)
    report["status"], report["reason"] = status, reason
    report["rounds_done"] = len(report["rounds"])
    report["finished_at"] = now_rfc3339()
    report["noise_multiplier"] = run.sigma
    report["epsilon_filter"] = _data_spent(ledger)
    report["epsilon_filter_run"] = _data_spent(ledger, run=cfg.run)
    report["epsilon_scopes"] = EPSILON_SCOPES
    report["epsilon_pld"] = (
        run_epsilon(
            run.sigma,
            len(report["rounds"]) * cfg.local_steps,
            cfg.delta,
            sample_rate=cfg.sample_rate,
            adjacency=cfg.adjacency,
            figure="pld",
        )
        if report["rounds"]
        else 0.0
    )
    report["bytes_sent"] = int(sum(x["bytes_sent"] for x in report["rounds"]))
    report["bytes_received"] = int(sum(x["bytes_received"] for x in report["rounds"]))
    report["sessions"][-1].update(
        ended_at=report["finished_at"], status=status, rounds_done=len(report["rounds"]) - run.first_round + 1
    )
    _write_report(run)
    run.emit({"event": "iterate-finished", "site": run.me, "status": status, "rounds": len(report["rounds"])})
    return IterateResult(status, reason, len(report["rounds"]), report, _report_path(cfg), run.models)


def run_iterate(
    site_config: str | os.PathLike,
    cfg: IterateConfig,
    *,
    on_event: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    simulation: bool = False,
    resume: bool = False,
) -> IterateResult:
    """Run the loop of the module docstring for the site of ``site_config`` (its identity,
    model store, ledger and policy: the ledger is opened with the site's policy, as its daemon
    does; SQLite makes the two processes' writes safe). A ``seed`` in site.toml is refused
    unless ``simulation`` (``peer.net.daemon.check_seed_allowed``, the daemon's rule).

    A run name is used once per site: ``resume`` continues a run that stopped (SIGKILL, a
    reboot, its daemon gone, an interrupt) from its report — the rounds it completed, θ from its
    last fused model, segments already charged reused as stored — with fresh noise; without
    ``resume`` a run started before is refused, and a finished one always (:func:`_previous_run`).

    The steps: :func:`_open_run`, then per round :func:`_run_one_round` (publish our segment,
    fetch the peers', fuse), then :func:`_finish_run` (linger, count, write the report)."""
    run = _open_run(site_config, cfg, on_event, stop, simulation, resume)
    try:
        run.emit(
            {"event": "iterate-started", "site": run.me, "run": cfg.run, "peers": [p.name for p in run.peers],
             "sigma": run.sigma, "first_round": run.first_round, "rounds": cfg.rounds}
        )  # fmt: skip
        status, reason = "finished", f"all {cfg.rounds} rounds done"
        for r in range(run.first_round, cfg.rounds + 1):
            if run.stop.is_set():
                status, reason = "interrupted", f"stopped before round {r}"
                break
            ended = _run_one_round(run, r)
            if ended is not None:
                status, reason = ended
                break
        return _finish_run(run, status, reason)
    finally:
        run.close()


def _describe_peer(who: str, e: dict) -> str:
    """A peer's change of state between rounds: gone, back, behind, caught up."""
    peer, state, was, r = e["peer"], e["state"], e["was"], e["round"]
    if state == "gone":
        return f"{who} round {r}: {peer} is gone ({e['reason']}); asked again each round without waiting"
    if state == "skipped":
        return f"{who} round {r}: {peer} has published no segment of this run yet; skipped"
    if state == "dropped":
        return f"{who} round {r}: {peer} is dropped this round: {e['reason']}"
    back = "is back" if was == "gone" else ""
    if state == "stale":
        behind = f"is behind: its newest segment is {e['staleness']} round(s) old (weighed down)"
        return f"{who} round {r}: {peer} {back + ', ' if back else ''}{behind}"
    return f"{who} round {r}: {peer} {back or 'is fresh again'}: its segment of this round came in time"


def _nbytes(tensors) -> int:
    return int(sum(a.nbytes for _, a in tensors))


#: What each ε of an iterate report (and of each of its rounds) covers, and by which accountant.
EPSILON_SCOPES = {
    "epsilon_filter": "the site's data budget: every data-level release charged to its ledger (earlier runs "
    "and merges included), by the ledger's RDP filter at the budget's δ",
    "epsilon_filter_run": "this run's segments only (rounds 1..r), by the same filter at the budget's δ",
    "epsilon_pld": "this run's segments only (rounds 1..r), by PLD composition at the run's δ: tight for this "
    "fixed sequence of steps, not the filter's adaptive guarantee",
}


def _data_spent(ledger, run: str | None = None) -> float:
    """The ledger's data-level filter figure: ε spent at the budget's δ — by every data release
    (``run`` None), or by the segments of ``run`` alone (their RDP summed, read by the same
    filter)."""
    if run is None:
        for s in ledger.budget_states():
            if s.key.level == "data":
                return float(s.spent_epsilon)
        return 0.0
    entries = [e for e in ledger.entries(level="data", subject=run) if e.mechanism == "dpsgd"]
    if not entries:
        return 0.0
    rdp = np.sum([np.asarray(e.rdp, dtype=float) for e in entries], axis=0)
    return float(ledger.policy.data_filter().spent_epsilon(rdp, math.inf)[0])


def _fetch_segment(
    client, name: str, cfg: IterateConfig, r: int, was_gone: bool, stop, PeerError, net=None, theta=None
) -> dict:
    """Peer ``name``'s segment for our round ``r``: exactly round r if it comes within wait_s
    (polling while the peer answers NOT_FOUND), else its newest older one; ``state`` is
    "fresh", "stale" (with ``staleness`` = r − its round), "skipped" (nothing yet), "gone"
    (unreachable or refusing) or "dropped" (its segment does not fit our network:
    :meth:`SiteNetwork.check_segment` against our θ, with the reason; asked again next round).
    A peer found gone before is asked once, without waiting."""
    deadline = time.monotonic() + (0.0 if was_gone else cfg.wait_s)
    t0 = time.monotonic()
    while True:
        try:
            rel = client.segment(cfg.run, min_round=r, max_round=r, timeout=cfg.call_timeout_s)
            break
        except PeerError as e:
            if e.status != "NOT_FOUND":
                return {"state": "gone", "reason": f"{e.status}: {e}", "staleness": None, "arrays": None}
            if time.monotonic() >= deadline or stop.is_set():
                try:
                    rel = client.segment(cfg.run, min_round=0, max_round=r, timeout=cfg.call_timeout_s)
                    break
                except PeerError as e2:
                    state = "skipped" if e2.status == "NOT_FOUND" else "gone"
                    return {"state": state, "reason": f"{e2.status}: {e2}", "staleness": None, "arrays": None}
            time.sleep(POLL_S)
    their = int(rel.metadata.get("round", rel.receipt.record.parameters.get("segment", {}).get("round", 0)))
    records = int(rel.receipt.record.parameters.get("dataset_size", 0))
    if records <= 0:
        return {"state": "gone", "reason": "its segment's record declares no dataset_size", "staleness": None}
    if net is not None and theta is not None:
        why = net.check_segment(rel.architecture, rel.arrays, theta, name)
        if why is not None:
            return {"state": "dropped", "reason": f"its segment of round {their} does not fit our network: {why}",
                    "staleness": None, "arrays": None}  # fmt: skip
    return {
        "state": "fresh" if their == r else "stale",
        "round": their,
        "staleness": r - their,
        "records": records,
        "bytes": int(rel.total_bytes or sum(a.nbytes for a in rel.arrays.values())),
        "entry_id": rel.receipt.ledger_entry_id,
        "served_again": rel.receipt.served_again,
        "waited_s": round(time.monotonic() - t0, 3),
        "arrays": {k: np.asarray(v, dtype=np.float32) for k, v in rel.arrays.items()},
    }


def _linger(ledger, report: dict, cfg: IterateConfig, peers: int, stop) -> None:
    """Keep the run open (the daemon serves; we only watch) until every peer fetched our last
    segment or wait_s passed."""
    if not report["rounds"] or peers == 0:
        return
    rid = report["rounds"][-1]["segment"]["release_id"]
    deadline = time.monotonic() + cfg.wait_s
    while time.monotonic() < deadline and not stop.is_set():
        if len({s["counterparty"] for s in ledger.served_again(release_id=rid)}) >= peers:
            return
        time.sleep(POLL_S)


def _bytes_sent(ledger, report: dict) -> None:
    """Bytes of our segments served to peers: each served-again row is one full copy."""
    for x in report["rounds"]:
        rows = ledger.served_again(release_id=x["segment"]["release_id"])
        x["served_to"] = sorted(s["counterparty"] for s in rows)
        x["bytes_sent"] = int(x["segment"]["bytes"] * len(rows))


def describe(e: dict) -> str | None:
    """One human line for an iterate event (None: routine)."""
    who = f"[{e['site']}]"
    ev = e["event"]
    if ev == "iterate-started" and e.get("secure"):  # coordinator_free.secure_iterate's run
        return f"{who} secure iterate run {e['run']!r} started: {e['steps']} steps, one secure sum each"
    if ev == "iterate-finished" and "steps" in e:
        return f"{who} secure iterate run {e['status']} after {e['steps']} steps"
    if ev == "iterate-started":
        how = "started" if e.get("first_round", 1) == 1 else f"resumed at round {e['first_round']} of {e['rounds']}"
        return f"{who} iterate run {e['run']!r} {how}: peers {', '.join(e['peers'])}, σ = {e['sigma']:.4g}"
    if ev == "iterate-budget":
        return f"{who} round {e['round']}: the ledger refused the segment; the run stops at the budget"
    if ev == "iterate-alone":
        return (
            f"{who} round {e['round']}: our own daemon at {e['address']} does not serve ({e['reason']}): no peer "
            "could fetch our segment, so it is not charged; the run stops (start the daemon, then --resume)"
        )
    if ev == "segment" and e.get("reused"):
        return f"{who} round {e['round']}: our segment charged before (ledger entry {e['entry_id']}) is reused"
    if ev == "iterate-peer":
        return _describe_peer(who, e)
    if ev == "iterate-finished":
        return f"{who} iterate run {e['status']} after {e['rounds']} rounds"
    if ev == "iterate-fused" and e["round"] % 5 == 0:
        return f"{who} round {e['round']} fused with {', '.join(e['contributors']) or 'nobody'}"
    return None


__all__ = [
    "IterateConfig",
    "IterateResult",
    "SiteNetwork",
    "fusion_weights_by_records",
    "is_iterate_file",
    "load_iterate_config",
    "load_records",
    "run_iterate",
    "segment_training",
]
