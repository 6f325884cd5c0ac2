"""The simulated world before any daemon runs (``privfusion simulate``, steps 1–2 of
``scenarios.simulate``): the plan of rounds, the data split into a global test set, a PUBLIC
set and every site's protected records, and each site prepared on disk — its own model trained
on its records, its DP-SGD pool, its identity and pins, its ``site.toml`` (policy, ledger, the
fixed noise seed of a simulation) and its round files."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from scenarios.network import Network
from scenarios.schema import Scenario

MODEL = "mlp"
POOL = "dpsgd"


def _now() -> str:
    from peer.base.records import now_rfc3339

    return now_rfc3339()


@dataclass
class SiteWorld:
    name: str
    root: Path
    seed: int
    alpha: float
    x: np.ndarray
    y: np.ndarray
    probe: np.ndarray
    architecture: dict
    arrays: dict[str, np.ndarray]
    pool: list[dict] = field(default_factory=list)
    #: the site's own records as image files (``[data] image_size``): its folder by class, which
    #: its iterate run reads with the model's stored image preprocessing; None: arrays only
    images: Path | None = None
    #: ``[model] factory``: the site's own network (its own model in ``own_models``); None: the
    #: built-in ``architecture``
    own_network: Network | None = None

    @property
    def network(self) -> Network:
        """The site's network behind one adapter (``scenarios.network``)."""
        return self.own_network if self.own_network is not None else Network.builtin(self.architecture)

    @property
    def config(self) -> Path:
        return self.root / "site.toml"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.sqlite"

    @property
    def identity(self) -> Path:
        return self.root / "identity"


@dataclass
class World:
    scenario: Scenario
    out: Path
    sites: dict[str, SiteWorld]
    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    plan: list[tuple[str, str, float]]
    timings: dict[str, float] = field(default_factory=dict)


class Progress:
    """Progress lines on stderr (or wherever ``write`` sends them), with the elapsed time; and,
    when the command line gives it ``bars`` (``peer.base.progress.Bars``: a terminal only), a bar
    counting the simulation's stages (``begin`` / ``advance`` / ``close``: no-ops without one)."""

    def __init__(self, write: Callable[[str], None] | None = None, bars=None):
        self._write = write or (lambda s: print(s, file=sys.stderr, flush=True))
        self._bars = bars
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self._lock:
            self._write(f"[{time.monotonic() - self._start:6.1f}s] {text}")

    def begin(self, total: int, description: str) -> None:
        if self._bars is not None:
            with self._lock:
                self._bars.start(total, description, "stages")

    def advance(self) -> None:
        if self._bars is not None:
            with self._lock:
                self._bars.advance()

    def close(self) -> None:
        if self._bars is not None:
            with self._lock:
                self._bars.close()


# ------------------------------------------------------------------------------------- plan


def round_plan(sc: Scenario) -> list[tuple[str, str, float]]:
    """(label, method, ε scale) of every round each site runs, in order."""
    plan = [(m, m, 1.0) for m in sc.round.methods]
    if "ldp" in sc.round.methods:
        plan += [(f"ldp-x{s:g}", "ldp", s) for s in sc.round.frontier]
    return plan


def released_epsilon(sc: Scenario, scale: float) -> float:
    """Model-level ε (per the round's unit: neuron by default) one peer releases to one requester
    in an ldp round at ``scale`` (features: activations + weight features, plus weights; basic
    composition, as asked — the ledger's figures are in the report beside it)."""
    r = sc.round
    return scale * (r.activation_epsilon + r.weight_epsilon + r.weights_epsilon)


# ------------------------------------------------------------------------------------- sites


def _policy_toml(sc: Scenario) -> str:
    p = sc.policy
    lines = ["[policy]", 'show_remaining = "own"']
    if sc.pool is not None:
        lines += [
            "",
            "[policy.data]",
            f'unit = "record:{sc.pool.adjacency}"',
            f"epsilon = {p.data_epsilon!r}",
            f"delta = {p.data_delta!r}",
        ]
    lines += [
        "",
        "[policy.model]",
        f"total = {{ epsilon = {p.model_epsilon!r}, delta = {p.model_delta!r} }}",
        f"per_counterparty = {{ epsilon = {p.model_epsilon_per_peer!r}, delta = {p.model_delta!r} }}",
        "",
        '[policy.peers."*"]',
        'allow = ["features", "weights", "merge", "ledger"]',
    ]
    return "\n".join(lines) + "\n"


def site_toml(
    sc: Scenario, s: SiteWorld, listen: str = "127.0.0.1:0", round_table: str = "", fixed_seed: bool = True
) -> str:
    """A site's site.toml: where it listens, its files, its pool and policy, optionally a
    ``[round]`` table, and — in simulations only — its fixed noise seed (reported in every
    release record; without it every release draws CSPRNG noise)."""
    lo, hi = sc.round.activation_clip
    lines = [
        "[site]",
        f'name = "{s.name}"',
        f'listen = "{listen}"',
        'identity = "identity"',
        'models = "models"',
        'ledger = "ledger.sqlite"',
        'probe = "probe.safetensors"',
        "workers = 16",
        "shutdown_grace_s = 5",
    ]
    if fixed_seed:
        lines.append(f"seed = {s.seed}")
    lines += ["", "[site.mechanisms]", f"activation_clip = [{lo!r}, {hi!r}]", f'calibration = "{sc.round.calibration}"']
    if sc.pool is not None:
        # merges judge candidates on the public set, never on the site's protected records
        lines += ["", f"[site.pools.{POOL}]", 'models = "pool"', 'validation = "validation.npz"']
    return "\n".join(lines) + "\n\n" + _policy_toml(sc) + (f"\n{round_table}" if round_table else "")


def round_toml(sc: Scenario, s: SiteWorld, label: str, method: str, scale: float, roster: Path) -> str:
    r = sc.round
    lines = [
        "[round]",
        f'roster = "{roster}"',
        f'model = "{MODEL}"',
        f"alpha = {s.alpha!r}",
        f"quorum = {r.quorum}",
        f'method = "{method}"',
        'out = "rounds"',
        f'label = "{label}"',
        f"call_timeout_s = {r.call_timeout_s!r}",
        f"health_timeout_s = {r.health_timeout_s!r}",
        "",
        "[round.features]",
        f"activation_epsilon = {r.activation_epsilon * scale!r}",
        f"weight_epsilon = {r.weight_epsilon * scale!r}",
        f'unit = "{r.unit}"',
        f"activation_clip = [{r.activation_clip[0]!r}, {r.activation_clip[1]!r}]",
        "",
        "[round.weights]",
        f"epsilon = {r.weights_epsilon * scale!r}",
        f"delta = {r.weights_delta!r}",
        # the experiment measures the ldp exchange at the ε it asks for, also where its weights
        # release is predicted constant (a user's round is refused there): the round report's
        # weights_signal, and the simulate report, say so
        *(["go_on_without_signal = true"] if method == "ldp" else []),
        "",
        "[round.merge]",
        f'method = "{r.merge_method}"',
        f"epsilon = {r.merge_epsilon!r}",
        f"delta = {r.merge_delta!r}",
    ]
    return "\n".join(lines + _after_fusion_toml(sc, s)) + "\n"


def _after_fusion_toml(sc: Scenario, s: SiteWorld) -> list[str]:
    """The round's local steps after fusion (coordinator_free.after_fusion): the site's own records
    (``records.npz`` in its own directory: they never leave it), REPAIR, candidate selection on
    the PUBLIC validation set, fine-tuning."""
    r = sc.round
    lines = ["", "[round.records]", 'path = "records.npz"', "prepared = true"]
    lines += ["", "[round.repair]", f'data = "{r.repair}"']
    if r.select:
        alphas = ", ".join(repr(a) for a in dict.fromkeys((s.alpha, *r.select_alphas)))
        lines += ["", "[round.select]", 'validation = "validation.npz"', f"alphas = [{alphas}]"]
    lines += ["", "[round.finetune]", f"epochs = {r.finetune_epochs}", f"learning_rate = {r.finetune_learning_rate!r}"]
    return lines


@dataclass(frozen=True)
class ScenarioData:
    """The scenario's data, split the same way wherever it is computed (everything follows from
    the scenario's seed): test set, public set, and each site's protected records."""

    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    parts: tuple[tuple[np.ndarray, np.ndarray], ...]
    architecture: dict
    num_classes: int
    preprocessing: Any = None  # peer.nn.tables.Preprocessing of the scenario's own records
    #: ``[data] image_size``: the folders by class the records were read back from ("public",
    #: "test" and each site's name); None when the images were rendered to a temporary folder
    folders: dict[str, Path] | None = None
    #: ``[model] factory``: every site's own network (None: the built-in ``architecture``)
    own_network: Network | None = None

    @property
    def network(self) -> Network:
        return self.own_network if self.own_network is not None else Network.builtin(self.architecture)


def _public_order(sc: Scenario, n: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the n training examples: the first ``public_size`` are the public set."""
    d = sc.data
    if d.public_size >= n - d.min_per_site * len(sc.sites):
        raise InvalidArgument(
            "data.public_size", f"{d.public_size} leaves too few of the {n} training examples for the sites"
        )
    return rng.permutation(n)


def split_data(sc: Scenario, images: Path | None = None) -> ScenarioData:
    """Test set, public set and every site's protected records of scenario ``sc``: the split
    (``[data] split``: Dirichlet label skew, IID, or regions of a covariate), then each site's
    class removal (``[sites.NAME] remove_class`` / ``remove_fraction``), drawn from the
    scenario's seed and the site's place in the file. With ``[data] image_size`` every part is
    rendered to PNG files in folders by class under ``images`` (a temporary folder when None)
    and read back as image records (:func:`render_parts`)."""
    from peer.nn.data import Dataset, load_dataset, split_by_feature, split_dirichlet, split_homogeneous

    d = sc.data
    rng = np.random.default_rng(sc.seed)
    prep = None
    region = None  # the covariate of split = "region", for every training example
    if d.path is None:
        ds = load_dataset(d.dataset, test_fraction=d.test_fraction, seed=sc.seed)
        order = _public_order(sc, len(ds.y_train), rng)
        if d.region_feature is not None:
            from peer.nn.data import feature_names

            region = ds.x_train[:, feature_names(d.dataset).index(d.region_feature)]
    else:
        from peer.nn.tables import Preprocessing, read_table

        table = read_table(
            d.path,
            label=d.label,
            features=d.features,
            categorical=d.categorical,
            missing="impute" if d.impute else "refuse",
        )
        rest, test = table.split(d.test_fraction, seed=sc.seed)
        order = _public_order(sc, len(rest), rng)
        if d.region_feature is not None:
            region = _region_column(rest, d.region_feature)
        # Fitted on the public set only: the sites' DP-SGD pools are private for one record
        # given their preprocessing, so it must not depend on the protected records.
        prep = Preprocessing.fit(rest.take(np.sort(order[: d.public_size])), unseen=d.unseen, split="public")
        (x_tr, y_tr), (x_te, y_te) = prep.transform(rest), prep.transform(test)
        ds = Dataset(d.dataset, x_tr, y_tr, x_te, y_te, prep.num_classes, None)
    public, protected = order[: d.public_size], np.sort(order[d.public_size :])
    x_prot, y_prot = ds.x_train[protected], ds.y_train[protected]
    if d.split == "dirichlet":
        idx = split_dirichlet(
            y_prot, len(sc.sites), concentration=d.concentration, seed=sc.seed, min_per_site=d.min_per_site
        )
    elif d.split == "region":
        idx = split_by_feature(region[protected], len(sc.sites))
    else:
        idx = split_homogeneous(y_prot, len(sc.sites), seed=sc.seed)
    idx = _remove_classes(sc, idx, y_prot, ds.num_classes)
    own = None
    if sc.model.factory is not None:
        side = sc.data.image_size or 8
        own = Network.own(sc.model.factory, (1, side, side))
    data = ScenarioData(
        ds.x_test,
        ds.y_test,
        ds.x_train[public],
        ds.y_train[public],
        tuple((x_prot[i], y_prot[i]) for i in idx),
        architecture(sc, ds.input_dim, ds.num_classes) if own is None else own.architecture,
        ds.num_classes,
        prep,
        own_network=own,
    )
    if d.image_size is None:
        return data
    if images is not None:
        return render_parts(sc, data, images)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="privfusion-images-") as tmp:
        return replace(render_parts(sc, data, Path(tmp)), folders=None)


def architecture(sc: Scenario, input_dim: int, num_classes: int) -> dict:
    """Every site's architecture (``[model]``): the MLP, or the built-in CNN on images of one
    channel, ``[data] image_size`` pixels square (8: the bundled digits as they are)."""
    m = sc.model
    if m.kind == "mlp":
        width = input_dim if sc.data.image_size is None else sc.data.image_size**2
        return {
            "kind": "mlp",
            "input_dim": width,
            "hidden": list(m.hidden),
            "output_dim": num_classes,
            "activation": m.activation,
        }
    side = sc.data.image_size or 8
    return {
        "kind": "cnn",
        "input_shape": [1, side, side],
        "channels": list(m.channels),
        "kernel_size": m.kernel_size,
        "pool": list(m.pool),
        "hidden": list(m.hidden),
        "output_dim": num_classes,
        "activation": m.activation,
    }


def render_digits(folder: Path, x: np.ndarray, y: np.ndarray, size: int) -> Path:
    """Digits (rows of 64 values in [0, 1], as ``peer.nn.data.load_dataset`` gives them) as
    8-bit grayscale PNG files ``folder/<label>/<i>.png`` of ``size`` x ``size`` pixels: each
    8x8 image scaled to 0..255, rounded, and upscaled by Pillow's bilinear filter (no new
    detail: the same 64 numbers, interpolated)."""
    from PIL import Image

    for i, (row, label) in enumerate(zip(x, y, strict=True)):
        a = (np.clip(np.asarray(row, dtype=np.float64).reshape(8, 8), 0.0, 1.0) * 255).round().astype(np.uint8)
        d = folder / str(int(label))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a, mode="L").resize((size, size), Image.Resampling.BILINEAR).save(d / f"{i:05d}.png")
    return folder


def render_parts(sc: Scenario, data: ScenarioData, root: Path) -> ScenarioData:
    """``data`` rendered to folders by class under ``root`` (``public``, ``test`` and one per
    site: :func:`render_digits`) and read back through ``peer.nn.images``, as a hospital's
    image records are: every file checked, the preprocessing (per-channel mean and std) fitted
    on the PUBLIC folder only and shared by every site, each part prepared with it."""
    from peer.nn.images import ImagePreprocessing, read_images

    size = sc.data.image_size
    folders = {"public": root / "public", "test": root / "test"}
    folders.update({spec.name: root / spec.name for spec in sc.sites})
    render_digits(folders["public"], data.x_public, data.y_public, size)
    render_digits(folders["test"], data.x_test, data.y_test, size)
    for spec, (x, y) in zip(sc.sites, data.parts, strict=True):
        render_digits(folders[spec.name], x, y, size)
    prep = ImagePreprocessing.fit(read_images(folders["public"]), split="public")

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        return prep.transform(read_images(folders[name]))

    (x_pub, y_pub), (x_test, y_test) = read("public"), read("test")
    parts = tuple(read(spec.name) for spec in sc.sites)
    return replace(data, x_test=x_test, y_test=y_test, x_public=x_pub, y_public=y_pub, parts=parts,
                   preprocessing=prep, folders=folders)  # fmt: skip


def _region_column(table, name: str) -> np.ndarray:
    """The raw values of the scenario's own records' column ``name`` (before preprocessing:
    regions are cut on the covariate as recorded)."""
    if name not in table.features:
        raise InvalidArgument(
            "data.region_feature", f"must be one of the records' features {list(table.features)}, got {name!r}"
        )
    col = table.columns[name]
    if col.kind != "numeric" or np.isnan(col.numbers).any():
        raise InvalidArgument(
            "data.region_feature", f"column {name!r} must be numeric with no missing cell to cut regions on"
        )
    return col.numbers


def _remove_classes(sc: Scenario, idx: list[np.ndarray], y: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """Each site's part without its ``remove_fraction`` of class ``remove_class`` (the field
    study's class imbalance). The draw is seeded by the scenario's seed and the site's index."""
    from peer.nn.data import remove_class

    out = []
    for i, (spec, part) in enumerate(zip(sc.sites, idx, strict=True)):
        if spec.remove_class is None:
            out.append(part)
            continue
        key = f"sites.{spec.name}"
        if spec.remove_class >= num_classes:
            raise InvalidArgument(
                f"{key}.remove_class", f"must be a class of the records (0..{num_classes - 1}), got {spec.remove_class}"
            )
        kept = remove_class(part, y, spec.remove_class, spec.remove_fraction, np.random.default_rng([sc.seed, 101, i]))
        if len(kept) < sc.data.min_per_site:
            raise InvalidArgument(
                f"{key}.remove_fraction",
                f"{spec.remove_fraction:g} of class {spec.remove_class} leaves {len(kept)} records, fewer than data.min_per_site ({sc.data.min_per_site})",
            )
        out.append(kept)
    return out


def prepare_site(sc: Scenario, data: ScenarioData, name: str, root: Path, fixed_seed: bool = True) -> SiteWorld:
    """One site's files from the scenario: its records' model (``models/mlp``), its DP-SGD pool
    (``pool/``), its public probe set and the public validation set of its merges. No identity
    and no site.toml: those depend on where the site runs. ``fixed_seed``: the pool's noise
    comes from the site's seed (a simulation: its daemon runs with ``--simulation``), else from
    the CSPRNG (a site run elsewhere, ``privfusion demo site``: its daemon refuses a fixed-seed
    pool)."""
    import torch
    from safetensors.numpy import save_file

    index = [s.name for s in sc.sites].index(name)
    spec = sc.sites[index]
    seed = sc.seed * 1000 + index + 1
    root.mkdir(parents=True, exist_ok=True)
    x, y = data.parts[index]
    probe = data.x_public[
        np.random.default_rng(seed).choice(len(data.x_public), size=sc.data.probe_size, replace=False)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: thread hand-offs cost more than they save
    try:
        net = data.network
        model = net.train(
            x,
            y,
            seed=seed,
            epochs=sc.model.epochs if spec.epochs is None else spec.epochs,
            batch_size=sc.model.batch_size,
            learning_rate=sc.model.learning_rate,
        )
        s = SiteWorld(
            name,
            root,
            seed,
            sc.round.alpha if spec.alpha is None else spec.alpha,
            x,
            y,
            np.ascontiguousarray(probe, dtype=np.float32),
            data.architecture,
            net.arrays(model),
            images=None if data.folders is None else data.folders[name],
            own_network=data.own_network,
        )
        # an own network: into the own-model store (own_models/mlp), as `privfusion model import`
        # stores it, with the records' stored preprocessing; its rounds take it from there
        net.save_own(root, MODEL, s.arrays, {"trained_on": len(y), "seed": seed}, data.preprocessing)
        save_file({"x": s.probe}, str(root / "probe.safetensors"))
        # the site's own prepared records, for its rounds' REPAIR and fine-tuning (never sent)
        np.savez(root / "records.npz", x=x, y=y)
        np.savez(root / "validation.npz", x=data.x_public, y=data.y_public)
        if sc.pool is not None:
            s.pool = _train_pool(
                sc, s, data.x_public, data.y_public, data.x_test, data.y_test, data.preprocessing, fixed_seed
            )
    finally:
        torch.set_num_threads(threads)
    return s


def prepare(sc: Scenario, out: Path, progress: Progress) -> World:
    """Data, models, pools, identities, pins and config files of every site."""
    from peer.net.identity import init_identity
    from peer.net.trust import TrustStore

    data = split_data(sc, out / "images")
    world = World(sc, out, {}, data.x_test, data.y_test, data.x_public, data.y_public, round_plan(sc))
    for spec in sc.sites:
        s = prepare_site(sc, data, spec.name, out / "sites" / spec.name)
        init_identity(s.identity, spec.name, ["127.0.0.1", "localhost"])
        world.sites[spec.name] = s
        own = s.network.accuracy(s.arrays, data.x_test, data.y_test)
        counts = np.bincount(s.y, minlength=data.num_classes).tolist()
        pool = (", pool " + ", ".join(f"ε={m['epsilon']:.3g}: {m['accuracy']:.3f}" for m in s.pool)) if s.pool else ""
        epochs = sc.model.epochs if spec.epochs is None else spec.epochs
        progress(
            f"{spec.name}: {len(s.y)} records (labels {counts}), own model ({epochs} epochs) "
            f"test accuracy {own:.3f}{pool}"
        )
    for s in world.sites.values():
        store = TrustStore(s.identity / "trusted")
        for o in world.sites.values():
            if o is not s:
                store.add((o.identity / "site.crt").read_bytes())
        s.config.write_text(site_toml(sc, s), encoding="utf-8")
    return world


def _train_pool(
    sc: Scenario, s: SiteWorld, x_val, y_val, x_test, y_test, preprocessing=None, fixed_seed: bool = True
) -> list[dict]:
    from peer.base.rng import make_randomness
    from peer.dp.accounting import Optimizer, TrainingRecord
    from peer.dp.pools import load_pool, save_trained, warm_pool_profiles

    p = sc.pool
    trainings = [
        TrainingRecord.constant(
            p.adjacency, p.steps, p.learning_rate, p.clip_norm, nm, p.sample_rate, optimizer=Optimizer(p.optimizer)
        )
        for nm in p.noise_multipliers
    ]
    net = s.network
    models = net.train_pool(
        s.x,
        s.y,
        trainings,
        init_seed=s.seed + 500_000,
        randomness=make_randomness(s.seed if fixed_seed else None),
        delta=p.delta,
        # the scenario's public count (required under add-remove), never len(s.y) there
        dataset_size=p.declared_records,
        # an own network (eval mode): BatchNorm would normalise by the PUBLIC validation set's
        # statistics, as `pool train --from-model` does with its public split
        public_x=x_val,
    )
    out = []
    for nm, m in zip(p.noise_multipliers, models, strict=True):
        name = f"dpsgd-sigma{nm:g}"
        module = net.module(m.arrays)
        save_trained(
            s.root / "pool",
            name,
            m,
            accuracy=net.accuracy_of(module, x_val, y_val),
            preprocessing=preprocessing,
            **({"factory": net.factory} if net.is_own else {}),
        )
        out.append(
            {
                "name": name,
                "noise_multiplier": nm,
                "epsilon": m.record.epsilon,
                "delta": m.record.delta,
                "accuracy": net.accuracy_of(module, x_test, y_test),
            }
        )
    # The pool's privacy profiles (T-step PLD and RDP compositions) into the pool's profile
    # cache, as its daemon would build them at start-up: built here, one site after another,
    # rather than by every daemon at once (each would hold ~70 MB of composition buffers at
    # its peak for it). The daemon reads them back, checked against each model's record.
    with contextlib.suppress(InvalidArgument):  # a pool RS cannot account: each request says why
        warm_pool_profiles(load_pool(s.root / "pool"), s.root / "pool")
    return out
