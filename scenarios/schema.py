"""Scenario files of ``privfusion simulate``: what they may say, checked key by key.

A scenario is one TOML file. Every key is optional except the sites; defaults are those of
the bundled ``hospitals.toml``. A bad value is refused with the file, the line and the key
(``peer.base.config``); a syntax error with tomllib's line and column.

    [scenario]
    name = "hospitals"          # used in the report
    description = "..."
    seed = 7                    # master seed: data split, training, probe sets and every site's
                                # (fixed-seed, reported) noise; simulations only

    [data]
    dataset = "breast_cancer"   # "breast_cancer" | "digits" (scikit-learn's bundled sets), or:
    # path = "records.csv"      # the scenario's own records (.csv, .tsv, .parquet, .npz;
    #                           # relative to the scenario file), instead of `dataset`
    # label = "outcome"         # its label column (required with path)
    # features = ["age", "ward"]  # feature columns (default: every other column)
    # categorical = ["ward"]    # columns to one-hot although they hold numbers (codes)
    # impute = false            # fill missing cells (public-set mean / most frequent) instead of refusing
    # unseen = "refuse"         # a category the public set never saw: "refuse" | "zeros"
    #                           # (the preprocessing is fitted on the public set, shared by all sites)
    test_fraction = 0.25        # global test split: what every accuracy is measured on
    public_size = 80            # training examples held out as PUBLIC data: the sites' probe
                                # sets and the merges' validation set come from it
    probe_size = 60             # rows of each site's probe set (drawn from the public data)
    split = "dirichlet"         # "dirichlet" (label skew) | "iid" | "region" (by a covariate)
    concentration = 0.5         # Dirichlet concentration (smaller = more skewed)
    # region_feature = "mean texture"  # split = "region": the protected records sorted by this
    #                           # feature column (numeric; a bundled set's scikit-learn name) and
    #                           # cut into one contiguous region per site, lowest values first
    min_per_site = 20
    # image_size = 28           # dataset = "digits" only: the 8x8 digits rendered at run time to
    #                           # PNG files of image_size x image_size (Pillow's bilinear upscaling)
    #                           # in class folders (DIR/<class>/<i>.png), one folder per site plus
    #                           # the public and test sets, and read back by peer.nn.images with a
    #                           # preprocessing fitted on the public folder; iterate reads each
    #                           # site's folder (scenarios/images.toml)

    [model]                     # every site's own model (plain training on its records)
    kind = "mlp"                # "mlp" | "cnn" (the built-in CNN: image records only)
    # factory = "scenarios.networks:residual_gn_cnn"  # instead of kind, hidden, activation and
    #                           # the cnn keys: a site's own network (MODULE:FUNCTION, no
    #                           # arguments, taking 1 x S x S digit images, S = image_size or 8),
    #                           # traced and stored as `privfusion model import` stores it
    # channels = [8, 16]        # cnn: conv widths, one 3x3 (kernel_size) conv + activation each,
    # kernel_size = 3           #      then max-pooling by its factor in pool (1: none)
    # pool = [2, 2]
    hidden = [32]
    activation = "relu"
    epochs = 60
    batch_size = 32
    learning_rate = 0.003

    [pool]                      # every site's DP-SGD pool for RS/LC merges (drop the table: none)
    noise_multipliers = [2.0, 4.0, 8.0]
    steps = 30
    learning_rate = 1.0
    clip_norm = 1.0
    sample_rate = 1.0           # 1 = full batch (what LC needs)
    adjacency = "add-remove"    # unit of privacy: "add-remove" | "replace-one"
    declared_records = 80       # PUBLIC n every site's DP-SGD divides by (required under
                                # add-remove: the true count is private there; replace-one: the
                                # site's own count when not given)
    delta = 1e-5
    optimizer = "sgd"           # fed each step's privatised gradient: "sgd" | "momentum" | "adam"
                                # (default constants; post-processing: the same epsilon)

    [policy]                    # every site's budgets
    model_epsilon = 5000.0      # model level, per neuron, one model, all counterparties
    model_epsilon_per_peer = 1700.0
    model_delta = 1e-3
    data_epsilon = 20.0         # data level, per training record (pool merges)
    data_delta = 1e-4

    [round]                     # what every site asks for in its rounds
    alpha = 0.5
    quorum = 2
    methods = ["ldp", "merged"] # rounds each site runs, in this order
    activation_epsilon = 8.0    # ldp: per neuron
    weight_epsilon = 8.0
    unit = "neuron"             # unit of the feature releases: "neuron" | "entry" (weaker)
    weights_epsilon = 16.0
    weights_delta = 1e-5
    calibration = "analytic"    # Gaussian calibration of released weights (every site)
    activation_clip = [0.0, 6.0]
    merge_method = "rs"         # merged: "rs" | "lc", per training record
    merge_epsilon = 4.0
    merge_delta = 1e-5
    frontier = [0.25, 4.0, 16.0]  # extra ldp rounds at these multiples of the ldp ε (frontier plot)
    call_timeout_s = 60.0
    health_timeout_s = 2.0

    [sites.hospital-a]          # one table per site (at least two); optional keys:
    alpha = 0.6                 #   this site's own α
    epochs = 10                 #   its own model's epochs (default: [model] epochs)
    remove_class = 0            #   drop remove_fraction of this class from the site's records
    remove_fraction = 0.8       #   (after the split; dropped records go to no site)
    [sites.hospital-b]
    ...

    [iterate]                   # optional: multi-round peer-to-peer DP training (and the DP-FedAvg
                                # baseline the simulator computes with the same numbers)
    rounds = 20                 # rounds of local DP-SGD + release + fusion at every site
    local_steps = 2             # DP-SGD steps per round on a site's own records
    learning_rate = 0.5
    clip_norm = 1.0             # per-record gradient clip C
    sample_rate = 1.0           # Poisson rate q of each step's batch (1: full batch) [default: 1.0]
    epsilon = 4.0               # per-record budget of the whole run at every site ...
    delta = 1e-5                # ... at this δ (noise calibrated to it: peer.budget.dpsgd_noise)
    adjacency = "add-remove"
    declared_records = 80       # PUBLIC n of every site's segments: DP-GD's denominator and its
                                # fusion weight (required under add-remove, as in [pool])
    init_seed = 11              # PUBLIC seed of the shared initial model (no coordinator draws it)
    baseline_seeds = [0, 1, 2]  # seeds of the simulator's DP-FedAvg baseline runs
    ledger_orders = "planned"   # Rényi orders of the ledger each site creates for the run:
                                # "default" (the filter's 20 orders: δ split 20 ways), "planned"
                                # (the one order that suits the planned run, chosen from its public
                                # plan: peer.budget.dpsgd_noise.planned_orders), or a list of orders
                                # [default: "default"]
    secure = true               # also run it with secure aggregation (coordinator_free.secure_iterate:
                                # one secure sum of every site's clipped gradients plus a Skellam
                                # share per step, the same plan and budget; add-remove only; every
                                # site's policy allows `secure-sum`) [default: false]
    coalition = 1               # t: the largest coalition of curious peers the noise covers; needs
                                # at least t + 2 sites [default: 1]
    secure_scale = 65536.0      # γ: integer units per unit of gradient of the secure run's encoding
                                # ([round.iterate] secure_scale); rounding adds up to √d to a
                                # record's integer norm γC, so a small γ costs noise [default: 1024]

    [central_dpsgd]             # optional, with [iterate]: the central DP-SGD baseline (a trusted
                                # curator on every site's records pooled, at [iterate]'s ε, δ,
                                # adjacency, init_seed and baseline_seeds; N = sites × declared_records)
    steps = 200                 # DP-SGD steps [default: [iterate] rounds × local_steps]
    sample_rate = 0.1           # Poisson rate q [default: [iterate] sample_rate]
    learning_rate = 2.0         # [default: [iterate] learning_rate]
    clip_norm = 1.0             # [default: [iterate] clip_norm]

    [secure_iterate]            # optional, with [iterate] secure = true: the secure run's own plan
                                # (its ε, δ, declared_records, init_seed and coalition are
                                # [iterate]'s); chosen by the same search on validation
                                # (privfusion simulate --tune --rows secure-aggregation)
    steps = 100                 # secure sums (DP-SGD steps) [default: [iterate] rounds × local_steps]
    sample_rate = 0.2           # Poisson rate q at every site [default: [iterate] sample_rate]
    learning_rate = 1.0         # [default: [iterate] learning_rate]
    clip_norm = 0.5             # [default: [iterate] clip_norm]

    [failure]                   # optional: kill one site mid-round
    site = "hospital-c"
    after_releases = 2          # SIGKILL its daemon (and its own round) as soon as its ledger
                                # holds this many charges
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from peer.base.config import Section, parse_toml
from peer.base.errors import InvalidArgument, NotFound
from peer.net.identity import check_site_name
from peer.nn.data import DATASETS

DEFAULT_SCENARIO = "hospitals.toml"
BUNDLED = (
    "hospitals.toml",
    "digits.toml",
    "hospitals-failure.toml",
    "hospitals-12.toml",
    "underfit.toml",
    "unbalanced.toml",
    "regions.toml",
    "images.toml",
)
#: classes of the bundled datasets (``remove_class`` is checked against them when parsed)
BUNDLED_CLASSES = {"breast_cancer": 2, "digits": 10}


@dataclass(frozen=True)
class DataSpec:
    dataset: str = "breast_cancer"  # a bundled set, or the name of the records file (``path``)
    test_fraction: float = 0.25
    public_size: int = 80
    probe_size: int = 60
    split: str = "dirichlet"
    concentration: float = 0.5
    min_per_site: int = 20
    region_feature: str | None = None  # split = "region": the covariate that makes the regions
    path: str | None = None  # the scenario's own records, resolved against the scenario file
    label: str | None = None
    features: tuple[str, ...] | None = None
    categorical: tuple[str, ...] = ()
    impute: bool = False
    unseen: str = "refuse"
    image_size: int | None = None  # digits rendered to PNG files of this size (None: arrays)


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "mlp"
    #: a site's own network for every site, ``MODULE:FUNCTION`` (e.g.
    #: ``scenarios.networks:residual_gn_cnn``): replaces kind/hidden/activation/channels/...
    factory: str | None = None
    channels: tuple[int, ...] = ()  # cnn only
    kernel_size: int = 3
    pool: tuple[int, ...] = ()
    hidden: tuple[int, ...] = (32,)
    activation: str = "relu"
    epochs: int = 60
    batch_size: int = 32
    learning_rate: float = 3e-3


@dataclass(frozen=True)
class PoolSpec:
    noise_multipliers: tuple[float, ...] = (2.0, 4.0, 8.0)
    steps: int = 30
    learning_rate: float = 1.0
    clip_norm: float = 1.0
    sample_rate: float = 1.0
    adjacency: str = "add-remove"
    delta: float = 1e-5
    optimizer: str = "sgd"
    declared_records: int | None = None


@dataclass(frozen=True)
class PolicySpec:
    model_epsilon: float = 5000.0
    model_epsilon_per_peer: float = 1700.0
    model_delta: float = 1e-3
    data_epsilon: float = 20.0
    data_delta: float = 1e-4


@dataclass(frozen=True)
class RoundSpec:
    alpha: float = 0.5
    quorum: int = 2
    methods: tuple[str, ...] = ("ldp", "merged")
    activation_epsilon: float = 8.0
    weight_epsilon: float = 8.0
    unit: str = "neuron"
    weights_epsilon: float = 16.0
    weights_delta: float = 1e-5
    calibration: str = "analytic"
    activation_clip: tuple[float, float] = (0.0, 6.0)
    merge_method: str = "rs"
    merge_epsilon: float = 4.0
    merge_delta: float = 1e-5
    frontier: tuple[float, ...] = (0.25, 4.0, 16.0)
    call_timeout_s: float = 60.0
    health_timeout_s: float = 2.0
    # after fusion, at each requester (coordinator_free.after_fusion): REPAIR on "own" records /
    # "probe" / "off"; candidate fusions compared on the PUBLIC validation set (subsets of the
    # contributions × the site's α and select_alphas), unless select = false; fine-tuning on the
    # site's own records for finetune_epochs (0: off)
    repair: str = "own"
    select: bool = True
    select_alphas: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8)
    finetune_epochs: int = 5
    finetune_learning_rate: float = 1e-4


@dataclass(frozen=True)
class IterateSpec:
    rounds: int = 20
    local_steps: int = 2
    learning_rate: float = 0.5
    clip_norm: float = 1.0
    sample_rate: float = 1.0
    epsilon: float = 4.0
    delta: float = 1e-5
    adjacency: str = "add-remove"
    declared_records: int | None = None
    init_seed: int = 11
    baseline_seeds: tuple[int, ...] = (0, 1, 2)
    ledger_orders: str | tuple[float, ...] = "default"
    secure: bool = False  # also the secure-aggregation run (coordinator_free.secure_iterate)
    coalition: int = 1  # t of that run: its noise covers coalitions of up to t curious peers
    secure_scale: float = 1024.0  # γ of that run (the round's [round.iterate] secure_scale default)


@dataclass(frozen=True)
class CentralSpec:
    """``[central_dpsgd]`` / ``[secure_iterate]``: the central DP-SGD baseline's or the secure
    run's own plan (the rest from ``[iterate]``)."""

    steps: int
    sample_rate: float
    learning_rate: float
    clip_norm: float


@dataclass(frozen=True)
class SiteSpec:
    name: str
    alpha: float | None = None
    epochs: int | None = None  # its own model's epochs (None: [model] epochs)
    remove_class: int | None = None  # class of which remove_fraction is dropped from its records
    remove_fraction: float = 0.0


@dataclass(frozen=True)
class FailureSpec:
    site: str
    after_releases: int


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    data: DataSpec
    model: ModelSpec
    pool: PoolSpec | None
    policy: PolicySpec
    round: RoundSpec
    sites: tuple[SiteSpec, ...]
    failure: FailureSpec | None = None
    iterate: IterateSpec | None = None
    central_dpsgd: CentralSpec | None = None
    secure_iterate: CentralSpec | None = None  # the secure run's plan (None: [iterate]'s)
    source: str = ""
    text: str = field(default="", repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("text")
        return out


def bundled_path(name: str = DEFAULT_SCENARIO) -> Path:
    """A scenario shipped in the ``scenarios`` package (package data)."""
    if name not in BUNDLED:
        raise NotFound(f"no bundled scenario {name!r}; bundled: {list(BUNDLED)}")
    return Path(str(resources.files("scenarios").joinpath(name)))


def load_scenario(path: str | os.PathLike | None = None) -> Scenario:
    """Read and check a scenario file (None: the bundled default ``hospitals.toml``)."""
    p = bundled_path() if path is None else Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise NotFound(f"scenario {str(p)!r}: {e.strerror}") from None
    return parse_scenario(text, str(p))


def _names(d: Section, key: str) -> tuple[str, ...] | None:
    v = d.raw(key, None)
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v) or len(set(v)) != len(v):
        d.fail(key, f"must be a non-empty array of distinct column names, got {v!r}")
    return tuple(v)


def _records(d: Section, base: Path) -> dict[str, Any]:
    """The ``[data]`` keys of a scenario's own records (empty when it uses a bundled set)."""
    if "path" not in d:
        for key in ("label", "features", "categorical", "impute", "unseen"):
            if key in d:
                d.fail(key, "belongs with the scenario's own records (`path`)")
        return {}
    if "dataset" in d:
        d.fail("dataset", "give a bundled dataset or the path of the scenario's own records, not both")
    path = d.path("path", base)
    if not path.is_file():
        d.fail("path", f"{str(path)!r} is not a file (paths are relative to the scenario file)")
    return {
        "dataset": path.name,
        "path": str(path.resolve()),
        "label": d.string("label"),
        "features": _names(d, "features"),
        "categorical": _names(d, "categorical") or (),
        "impute": d.boolean("impute", False),
        "unseen": d.string("unseen", "refuse", choices=("refuse", "zeros")),
    }


def _declared_records(t: Section) -> int | None:
    """``declared_records`` of ``[pool]`` or ``[iterate]``: the public record count every site's
    DP-SGD divides by; required under add-remove (the true count is private there: it is
    never used), optional under replace-one (default: each site's own count, public there)."""
    n = t.integer("declared_records", None, minimum=1)
    if n is None and t.string("adjacency", "add-remove", choices=("add-remove", "replace-one")) == "add-remove":
        t.fail(
            "declared_records",
            "is required under add-remove adjacency: the number of a site's training records is private "
            "there, so DP-SGD divides by a public count the scenario declares (e.g. the expected records per site)",
        )
    return n


def _ledger_orders(it: Section) -> str | tuple[float, ...]:
    """``[iterate] ledger_orders``: "default", "planned" or a list of Rényi orders."""
    v = it.raw("ledger_orders", IterateSpec.ledger_orders)
    if isinstance(v, str):
        return it.string("ledger_orders", IterateSpec.ledger_orders, choices=("default", "planned"))
    from peer.budget.filter import validate_orders

    try:
        return validate_orders(v if isinstance(v, list) else [v], "iterate.ledger_orders")
    except InvalidArgument as e:
        it.fail("ledger_orders", f'must be "default", "planned" or a list of orders: {e.rule}')


def _secure(it: Section, sites: int) -> dict[str, Any]:
    """``[iterate] secure`` and ``coalition``: the secure-aggregation run is accounted under
    add-remove only, and needs coalition + 2 sites (``coordinator_free.runner``)."""
    for key in ("coalition", "secure_scale"):
        if key in it and not it.boolean("secure", False):
            it.fail(key, "belongs with secure = true")
    secure = it.boolean("secure", IterateSpec.secure)
    coalition = it.integer("coalition", IterateSpec.coalition, minimum=0, maximum=1000)
    scale = it.number("secure_scale", IterateSpec.secure_scale, exclusive_minimum=0.0, maximum=2.0**40)
    if secure and it.string("adjacency", IterateSpec.adjacency) != "add-remove":
        it.fail("adjacency", "secure aggregation is accounted under add-remove only")
    if secure and sites < coalition + 2:
        it.fail("coalition", f"is {coalition}: secure aggregation needs coalition + 2 sites, the scenario has {sites}")
    return {"secure": secure, "coalition": coalition, "secure_scale": scale}


def _region_feature(d: Section, records: dict[str, Any]) -> str | None:
    """``[data] region_feature``: required with ``split = "region"``, refused without it; a
    feature of the bundled set (checked here) or of the scenario's own records (checked when
    they are read: ``scenarios.world.split_data``)."""
    split = d.string("split", DataSpec.split)
    if split != "region":
        if "region_feature" in d:
            d.fail("region_feature", f'belongs with split = "region", not split = {split!r}')
        return None
    name = d.string("region_feature")
    if not records:
        from peer.nn.data import feature_names

        names = feature_names(d.string("dataset", DataSpec.dataset))
        if name not in names:
            d.fail("region_feature", f"must be a feature of the dataset, one of {list(names)}, got {name!r}")
    elif records["features"] is not None and name not in records["features"]:
        d.fail("region_feature", f"must be one of the scenario's features {list(records['features'])}, got {name!r}")
    return name


def _removal(t: Section, data: DataSpec) -> tuple[int | None, float]:
    """``remove_class`` and ``remove_fraction`` of one ``[sites.NAME]`` table: both or neither."""
    if ("remove_class" in t) != ("remove_fraction" in t):
        missing = "remove_fraction" if "remove_class" in t else "remove_class"
        t.fail(missing, "is required with " + ("remove_class" if missing == "remove_fraction" else "remove_fraction"))
    if "remove_class" not in t:
        return None, 0.0
    classes = BUNDLED_CLASSES.get(data.dataset) if data.path is None else None
    label = t.integer("remove_class", minimum=0, maximum=None if classes is None else classes - 1)
    return label, t.number("remove_fraction", exclusive_minimum=0.0, maximum=1.0)


def _image_size(d: Section, records: dict[str, Any]) -> int | None:
    """``[data] image_size``: the bundled digits rendered to PNG files of that size (8..256)."""
    if "image_size" not in d:
        return None
    if records or d.string("dataset", DataSpec.dataset) != "digits":
        d.fail("image_size", 'renders the bundled digits to image files: it needs dataset = "digits"')
    return d.integer("image_size", minimum=8, maximum=256)


def _widths(m: Section, key: str, default: list[int], maximum: int) -> tuple[int, ...]:
    v = m.raw(key, default)
    if (
        not isinstance(v, list)
        or not v
        or not all(isinstance(h, int) and not isinstance(h, bool) and 1 <= h <= maximum for h in v)
    ):
        m.fail(key, f"must be a non-empty array of integers 1..{maximum}, got {v!r}")
    return tuple(v)


def _cnn_keys(m: Section, kind: str, data: DataSpec) -> dict[str, Any]:
    """``[model] channels / kernel_size / pool`` of ``kind = "cnn"`` (refused for an MLP): the
    built-in CNN (``peer.nn.architectures``) takes image records, bundled digits or rendered
    ones; every pool factor must divide the image side left by the blocks before it."""
    keys = ("channels", "kernel_size", "pool")
    if kind != "cnn":
        for key in keys:
            if key in m:
                m.fail(key, 'belongs with kind = "cnn"')
        return {}
    if data.path is not None or data.dataset != "digits":
        m.fail("kind", 'a cnn takes images: dataset = "digits" (8x8, or rendered at [data] image_size)')
    channels = _widths(m, "channels", [8, 16], 1024)
    k = m.integer("kernel_size", 3, minimum=1, maximum=15)
    if k % 2 == 0:
        m.fail("kernel_size", f"must be odd (same-size convolutions), got {k}")
    pool = _widths(m, "pool", [1] * len(channels), 16)
    if len(pool) != len(channels):
        m.fail("pool", f"must give one factor per conv block ({len(channels)}), got {len(pool)}")
    side = data.image_size or 8
    for i, p in enumerate(pool):
        if side % p:
            m.fail("pool", f"factor {p} at block {i} does not divide the image side {side} left there")
        side //= p
    return {"channels": channels, "kernel_size": k, "pool": pool}


#: the keys a ``[model] factory`` replaces (its network is the model)
_BUILTIN_MODEL_KEYS = ("kind", "hidden", "activation", "channels", "kernel_size", "pool")


def _factory(m: Section, data: DataSpec) -> str | None:
    """``[model] factory = "MODULE:FUNCTION"``: every site's own network, refused with any key of
    a built-in architecture, for records that are not digit images, or when the factory's
    network does not trace (``peer.nn.tracing.import_structure``) at the images' shape
    [1, S, S] or does not give one logit per digit class there."""
    if "factory" not in m:
        return None
    spec = m.string("factory", "")
    for key in _BUILTIN_MODEL_KEYS:
        if key in m:
            m.fail(key, "does not go with factory (the factory's network is every site's model)")
    if data.path is not None or data.dataset != "digits":
        m.fail("factory", 'a factory network takes images: dataset = "digits" (8x8, or rendered at [data] image_size)')
    if spec.count(":") != 1 or not all(spec.split(":")):
        m.fail("factory", f"must be MODULE:FUNCTION, got {spec!r}")
    import torch

    from scenarios.network import Network

    side = data.image_size or 8
    try:
        net = Network.own(spec, (1, side, side), field="factory")
        with torch.no_grad():
            out = net.build(0)(torch.zeros(2, 1, side, side))
    except InvalidArgument as e:
        m.fail("factory", e.rule)
    except Exception as e:  # the factory's own forward pass failed at the images' shape
        m.fail("factory", f"{spec} fails on [1, {side}, {side}] images: {type(e).__name__}: {e}")
    if tuple(out.shape) != (2, 10):
        m.fail(
            "factory", f"{spec} must give 10 logits (the digit classes) per image, gives shape {list(out.shape[1:])}"
        )
    return spec


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    root = Section(parse_toml(text, source, "scenario"), (), text, source)
    root.known(
        [
            "scenario",
            "data",
            "model",
            "pool",
            "policy",
            "round",
            "sites",
            "failure",
            "iterate",
            "central_dpsgd",
            "secure_iterate",
        ]
    )

    s = root.section("scenario")
    s.known(["name", "description", "seed"])
    name = s.string("name", Path(source).stem)
    description = s.string("description", "")
    seed = s.integer("seed", 7, minimum=0)

    d = root.section("data")
    d.known([f.name for f in DataSpec.__dataclass_fields__.values()])
    records = _records(d, Path(source).parent)
    data = DataSpec(
        dataset=records["dataset"] if records else d.string("dataset", DataSpec.dataset, choices=DATASETS),
        test_fraction=d.number("test_fraction", DataSpec.test_fraction, exclusive_minimum=0.0, exclusive_maximum=1.0),
        public_size=d.integer("public_size", DataSpec.public_size, minimum=2),
        probe_size=d.integer("probe_size", DataSpec.probe_size, minimum=1),
        split=d.string("split", DataSpec.split, choices=("dirichlet", "iid", "region")),
        concentration=d.number("concentration", DataSpec.concentration, exclusive_minimum=0.0),
        min_per_site=d.integer("min_per_site", DataSpec.min_per_site, minimum=1),
        region_feature=_region_feature(d, records),
        image_size=_image_size(d, records),
        **{k: v for k, v in records.items() if k != "dataset"},
    )
    if data.probe_size > data.public_size:
        d.fail(
            "probe_size", f"must be at most public_size ({data.public_size}): probe sets are drawn from the public data"
        )

    from peer.nn.architectures import ACTIVATIONS  # torch: only once a scenario is parsed, not for --help

    m = root.section("model")
    m.known([f.name for f in ModelSpec.__dataclass_fields__.values()])
    hidden = m.raw("hidden", list(ModelSpec.hidden))
    if (
        not isinstance(hidden, list)
        or not hidden
        or not all(isinstance(h, int) and not isinstance(h, bool) and 1 <= h <= 4096 for h in hidden)
    ):
        m.fail("hidden", f"must be a non-empty array of layer widths (integers 1..4096), got {hidden!r}")
    factory = _factory(m, data)
    kind = m.string("kind", ModelSpec.kind, choices=("mlp", "cnn"))
    model = ModelSpec(
        kind=kind,
        factory=factory,
        **_cnn_keys(m, kind, data),
        hidden=tuple(hidden),
        activation=m.string("activation", ModelSpec.activation, choices=tuple(ACTIVATIONS)),
        epochs=m.integer("epochs", ModelSpec.epochs, minimum=1, maximum=10_000),
        batch_size=m.integer("batch_size", ModelSpec.batch_size, minimum=1),
        learning_rate=m.number("learning_rate", ModelSpec.learning_rate, exclusive_minimum=0.0, maximum=10.0),
    )

    pool = None
    if "pool" in root:
        q = root.section("pool")
        q.known([f.name for f in PoolSpec.__dataclass_fields__.values()])
        pool = PoolSpec(
            noise_multipliers=tuple(
                q.numbers("noise_multipliers", list(PoolSpec.noise_multipliers), exclusive_minimum=0.0)
            ),
            steps=q.integer("steps", PoolSpec.steps, minimum=1, maximum=100_000),
            learning_rate=q.number("learning_rate", PoolSpec.learning_rate, exclusive_minimum=0.0),
            clip_norm=q.number("clip_norm", PoolSpec.clip_norm, exclusive_minimum=0.0),
            sample_rate=q.number("sample_rate", PoolSpec.sample_rate, exclusive_minimum=0.0, maximum=1.0),
            adjacency=q.string("adjacency", PoolSpec.adjacency, choices=("add-remove", "replace-one")),
            delta=q.number("delta", PoolSpec.delta, exclusive_minimum=0.0, exclusive_maximum=1.0),
            optimizer=q.string("optimizer", PoolSpec.optimizer, choices=("sgd", "momentum", "adam")),
            declared_records=_declared_records(q),
        )

    pol = root.section("policy")
    pol.known([f.name for f in PolicySpec.__dataclass_fields__.values()])
    policy = PolicySpec(
        model_epsilon=pol.number("model_epsilon", PolicySpec.model_epsilon, exclusive_minimum=0.0),
        model_epsilon_per_peer=pol.number(
            "model_epsilon_per_peer", PolicySpec.model_epsilon_per_peer, exclusive_minimum=0.0
        ),
        model_delta=pol.number("model_delta", PolicySpec.model_delta, minimum=0.0, exclusive_maximum=1.0),
        data_epsilon=pol.number("data_epsilon", PolicySpec.data_epsilon, exclusive_minimum=0.0),
        data_delta=pol.number("data_delta", PolicySpec.data_delta, minimum=0.0, exclusive_maximum=1.0),
    )

    r = root.section("round")
    r.known([f.name for f in RoundSpec.__dataclass_fields__.values()])
    eps = {"exclusive_minimum": 0.0, "maximum": 1000.0}
    dlt = {"exclusive_minimum": 0.0, "maximum": 0.1}
    methods = r.raw("methods", list(RoundSpec.methods))
    if (
        not isinstance(methods, list)
        or not methods
        or not all(x in ("ldp", "merged") for x in methods)
        or len(set(methods)) != len(methods)
    ):
        r.fail("methods", f"must be a non-empty array of distinct methods among ['ldp', 'merged'], got {methods!r}")
    rnd = RoundSpec(
        alpha=r.number("alpha", RoundSpec.alpha, minimum=0.0, maximum=1.0),
        quorum=r.integer("quorum", RoundSpec.quorum, minimum=1),
        methods=tuple(methods),
        activation_epsilon=r.number("activation_epsilon", RoundSpec.activation_epsilon, **eps),
        weight_epsilon=r.number("weight_epsilon", RoundSpec.weight_epsilon, **eps),
        unit=r.string("unit", RoundSpec.unit, choices=("neuron", "entry")),
        calibration=r.string("calibration", RoundSpec.calibration, choices=("analytic", "classical")),
        weights_epsilon=r.number("weights_epsilon", RoundSpec.weights_epsilon, **eps),
        weights_delta=r.number("weights_delta", RoundSpec.weights_delta, **dlt),
        activation_clip=r.interval("activation_clip", RoundSpec.activation_clip),
        merge_method=r.string("merge_method", RoundSpec.merge_method, choices=("rs", "lc")),
        merge_epsilon=r.number("merge_epsilon", RoundSpec.merge_epsilon, **eps),
        merge_delta=r.number("merge_delta", RoundSpec.merge_delta, **dlt),
        frontier=tuple(r.numbers("frontier", list(RoundSpec.frontier), min_length=0, exclusive_minimum=0.0)),
        call_timeout_s=r.number("call_timeout_s", RoundSpec.call_timeout_s, exclusive_minimum=0.0, maximum=3600.0),
        health_timeout_s=r.number("health_timeout_s", RoundSpec.health_timeout_s, exclusive_minimum=0.0, maximum=60.0),
        repair=r.string("repair", RoundSpec.repair, choices=("own", "probe", "off")),
        select=r.boolean("select", RoundSpec.select),
        select_alphas=tuple(r.numbers("select_alphas", list(RoundSpec.select_alphas), minimum=0.0, maximum=1.0)),
        finetune_epochs=r.integer("finetune_epochs", RoundSpec.finetune_epochs, minimum=0, maximum=1000),
        finetune_learning_rate=r.number(
            "finetune_learning_rate", RoundSpec.finetune_learning_rate, exclusive_minimum=0.0, maximum=10.0
        ),
    )
    if "merged" in rnd.methods and pool is None:
        r.fail(
            "methods",
            "includes 'merged' but the scenario has no [pool] table (merges come from the sites' DP-SGD pools)",
        )
    for scale in rnd.frontier:
        for key in ("activation_epsilon", "weight_epsilon", "weights_epsilon"):
            if getattr(rnd, key) * scale > 1000.0:
                r.fail(
                    "frontier",
                    f"scale {scale:g} takes {key} to {getattr(rnd, key) * scale:g}, above the 1000 a peer accepts",
                )

    sites = []
    for site_name, t in root.sections("sites").items():
        try:
            check_site_name(site_name)
        except InvalidArgument as e:
            t.fail((), e.rule)
        t.known(["alpha", "epochs", "remove_class", "remove_fraction"])
        sites.append(
            SiteSpec(
                site_name,
                t.number("alpha", None, minimum=0.0, maximum=1.0),
                t.integer("epochs", None, minimum=1, maximum=10_000),
                *_removal(t, data),
            )
        )
    if len(sites) < 2:
        root.fail("sites", f"needs at least two [sites.NAME] tables, got {len(sites)}")
    if rnd.quorum > len(sites):
        r.fail("quorum", f"is {rnd.quorum} but the scenario has only {len(sites)} sites")

    failure = None
    if "failure" in root:
        f = root.section("failure")
        f.known(["site", "after_releases"])
        victim = f.string("site")
        if victim not in {s.name for s in sites}:
            f.fail("site", f"must be one of the scenario's sites {[s.name for s in sites]}, got {victim!r}")
        failure = FailureSpec(victim, f.integer("after_releases", 1, minimum=1))

    iterate = None
    if "iterate" in root:
        it = root.section("iterate")
        it.known([f.name for f in IterateSpec.__dataclass_fields__.values()])
        seeds = it.raw("baseline_seeds", list(IterateSpec.baseline_seeds))
        if (
            not isinstance(seeds, list)
            or not seeds
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds)
        ):
            it.fail("baseline_seeds", f"must be a non-empty array of integers ≥ 0, got {seeds!r}")
        iterate = IterateSpec(
            rounds=it.integer("rounds", IterateSpec.rounds, minimum=1, maximum=10_000),
            local_steps=it.integer("local_steps", IterateSpec.local_steps, minimum=1, maximum=100_000),
            learning_rate=it.number("learning_rate", IterateSpec.learning_rate, exclusive_minimum=0.0, maximum=100.0),
            clip_norm=it.number("clip_norm", IterateSpec.clip_norm, exclusive_minimum=0.0),
            sample_rate=it.number("sample_rate", IterateSpec.sample_rate, exclusive_minimum=0.0, maximum=1.0),
            epsilon=it.number("epsilon", IterateSpec.epsilon, exclusive_minimum=0.0, maximum=1000.0),
            delta=it.number("delta", IterateSpec.delta, exclusive_minimum=0.0, maximum=0.1),
            adjacency=it.string("adjacency", IterateSpec.adjacency, choices=("add-remove", "replace-one")),
            declared_records=_declared_records(it),
            init_seed=it.integer("init_seed", IterateSpec.init_seed, minimum=0),
            baseline_seeds=tuple(seeds),
            ledger_orders=_ledger_orders(it),
            **_secure(it, len(sites)),
        )

    central = None
    if iterate is not None:
        central = _plan(root.section("central_dpsgd"), iterate)
    elif "central_dpsgd" in root:
        root.fail("central_dpsgd", "needs an [iterate] table (its ε, δ, adjacency and seeds are the run's)")

    secure_plan = None
    if "secure_iterate" in root:
        if iterate is None or not iterate.secure:
            root.fail("secure_iterate", "needs [iterate] with secure = true (its ε, δ and coalition are the run's)")
        secure_plan = _plan(root.section("secure_iterate"), iterate)

    return Scenario(
        name,
        description,
        seed,
        data,
        model,
        pool,
        policy,
        rnd,
        tuple(sites),
        failure,
        iterate,
        central,
        secure_plan,
        source,
        text,
    )


def _plan(c: Section, iterate: IterateSpec) -> CentralSpec:
    """``[central_dpsgd]`` or ``[secure_iterate]``: a DP-SGD plan of its own, each key defaulting
    to ``[iterate]``'s (steps: its rounds × local_steps)."""
    c.known([f.name for f in CentralSpec.__dataclass_fields__.values()])
    return CentralSpec(
        steps=c.integer("steps", iterate.rounds * iterate.local_steps, minimum=1, maximum=100_000),
        sample_rate=c.number("sample_rate", iterate.sample_rate, exclusive_minimum=0.0, maximum=1.0),
        learning_rate=c.number("learning_rate", iterate.learning_rate, exclusive_minimum=0.0, maximum=100.0),
        clip_norm=c.number("clip_norm", iterate.clip_norm, exclusive_minimum=0.0),
    )
