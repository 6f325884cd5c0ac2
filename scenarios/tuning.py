"""Hyperparameters chosen by a documented search, the same protocol for every DP row
(``privfusion simulate SCENARIO --tune``).

**Protocol.** From every site's protected training records a validation part is carved
(``VALIDATION_FRACTION`` of each site's records, by a fixed permutation per site seeded from the
scenario seed); the test set is never read. For each row's noise model, every configuration of
its grid is trained on the remaining records at the scenario's ``[iterate]`` (ε, δ) per record,
adjacency and ``init_seed``, once per search seed (``SEARCH_SEEDS``: disjoint from the
baseline seeds the final test accuracies use), and scored by its mean accuracy on the pooled
validation records. The chosen configuration is the one with the highest mean; ties go to the
earlier one in grid order (the grids list cheaper plans first). σ is calibrated for every
configuration by RDP (dp-accounting's conversion; what a ledger created for the run with
``ledger_orders = "planned"`` admits to within its one order), so every configuration spends the
same ε and only utility is compared.

**Rows and their noise models** (:class:`NoiseModel`: the search takes the row's noise model as
a parameter):

- ``local``: every site adds its full noise to its own DP-SGD steps and the models are averaged
  by record counts (``scenarios.baselines.fedavg_round``): DP-FedAvg with local noise, and the
  peer-to-peer ``iterate`` average when every peer is on time — one search serves both rows, and
  its choice is written into ``[iterate]``, which both use. Grid: rounds × local_steps,
  learning rate, Poisson rate q, clip norm.
- ``central``: a trusted curator runs DP-SGD on the pooled records
  (``scenarios.baselines.pooled_dpsgd``; denominator q·N, N the public count: sites ×
  declared_records × (1 − validation fraction) during the search). Grid: steps, learning rate,
  q, clip norm. Its choice goes into ``[central_dpsgd]``.
- ``secure-aggregation`` (:func:`secure_aggregation`): the same pooled DP-SGD, with the noise the
  secure run *is charged for*: k sites each add a Skellam share of variance V/(k − t), V the
  least total variance whose T (subsampled) Skellam steps meet (ε, δ) by the bound the run's
  ledger charges (``peer.dp.distributed.skellam.calibrate_share``: Agarwal–Kairouz–Liu's Skellam
  RDP, Zhu–Wang's general Poisson-subsampling bound when q < 1, the run's ledger orders and δ
  split, the encoding's integer sensitivities at the run's scale γ). The search trains with
  Gaussian noise of that sum's variance k·V/(k − t), in gradient units (÷ γ): the rounding
  (at most 1/4 per coordinate and record, against V ≈ 10⁷–10¹¹) and the modular wrap (impossible
  at the run's bits and norm bound) are left out. Grid (:func:`secure_grid`): full-batch plans
  and the curator's subsampled ones, so that the search sees what this accounting rewards.
  (An earlier version modelled the row as the curator's Gaussian × k/(k − t) with *tight*
  subsampled-Gaussian RDP; it chose a q = 0.2 plan that the Skellam charge made 3–4.5× noisier,
  9 points worse on test: docs/experiments.md.)

**What the choice costs.** The validation accuracies are computed from protected records
without noise, so the choice is *not* covered by any site's ledger: this search is how the
scenario author fixes the bundled scenarios' public settings in a simulation, as the anchor
comparison (Flower + Opacus, tuned on a validation split) did, and the reported ε of every row
excludes it. A deployment that tunes on its own private records must either use a public
validation set (a choice from public information costs nothing) or pay for the selection
(e.g. the composition of every candidate whose score was read, or private selection with a
random number of runs, Papernot & Steinke 2022).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.budget.dpsgd_noise import noise_multiplier_for
from peer.dp.accounting import GaussianStep
from peer.dp.training import classifier_loss
from peer.nn.architectures import torch_threads
from scenarios.baselines import fedavg_round, pooled_dpsgd
from scenarios.network import Network, as_network

#: Share of each site's protected records held out for validation.
VALIDATION_FRACTION = 0.2
#: Noise seeds of the search (the final test runs use ``[iterate] baseline_seeds``: 0, 1, 2).
SEARCH_SEEDS = (100, 101)
#: How σ is calibrated for every configuration.
FIGURE = "rdp"


@dataclass(frozen=True)
class NoiseModel:
    """Where a row's noise is added. ``pooled`` False: every site's own steps carry its full
    noise (local noise, averaged); True: one noisy sum over every site's records, whose noise
    variance is ``noise_variance_factor`` times a curator's (1: the curator itself)."""

    name: str
    pooled: bool
    noise_variance_factor: float = 1.0
    #: a secure-aggregation row: the noise is the Skellam sum the secure run is charged for
    skellam: SkellamCharge | None = None


@dataclass(frozen=True)
class SkellamCharge:
    """What fixes a secure run's noise besides its plan (all public): k sites, coalitions of up
    to t, the encoding's scale γ and bits, and the orders of the run's ledgers (whose number
    splits δ: ``coordinator_free.secure_iterate``); None: the one integer order planned for
    each configuration's own plan (``ledger_orders = "planned"``:
    ``scenarios.iterate_sites.secure_orders``)."""

    sites: int
    coalition: int
    scale: float
    bits: int
    orders: tuple[float, ...] | None


LOCAL = NoiseModel("local", pooled=False)
CENTRAL = NoiseModel("central", pooled=True)


def secure_aggregation(
    sites: int, coalition: int, *, orders: Sequence[float] | None, scale: float = 1024.0, bits: int = 32
) -> NoiseModel:
    """Secure aggregation among ``sites`` = k sites resisting coalitions of ``coalition`` = t,
    charged as the secure run is (:class:`SkellamCharge`; ``orders``: its ledgers' orders,
    ``scale`` and ``bits``: ``[round.iterate] secure_scale`` / ``modulus_bits``)."""
    if not (isinstance(sites, int) and isinstance(coalition, int) and 0 <= coalition < sites - 1):
        raise InvalidArgument("coalition", f"must be an integer with 0 ≤ t ≤ k − 2 (k = {sites}), got {coalition!r}")
    chosen = None if orders is None else tuple(float(o) for o in orders)
    charge = SkellamCharge(sites, coalition, float(scale), int(bits), chosen)
    return NoiseModel(
        "secure-aggregation", pooled=True, noise_variance_factor=sites / (sites - coalition), skellam=charge
    )


@functools.lru_cache(maxsize=256)
def skellam_noise_multiplier(
    charge: SkellamCharge, dim: int, config: PooledConfig, epsilon: float, delta: float
) -> float:
    """The std of the secure run's summed noise in units of the clip norm C: √(k·V/(k − t)) / (γ·C),
    V calibrated exactly as the run calibrates it (``calibrate_share`` on the encoding's
    sensitivities, δ split over the ledger's orders)."""
    from peer.dp.distributed.encoding import Encoding
    from peer.dp.distributed.skellam import calibrate_share, planned_order

    enc = Encoding(dim=dim, clip_norm=config.clip_norm, scale=charge.scale, bits=charge.bits, beta=0.0)
    sensitivities = (enc.l1_sensitivity, enc.l2_sensitivity)
    orders = charge.orders
    if orders is None:
        order = planned_order(
            epsilon, delta, charge.sites, charge.coalition, *sensitivities, config.sample_rate, config.steps
        )
        orders = (float(order),)
    cal = calibrate_share(
        epsilon,
        delta / len(orders),
        charge.sites,
        charge.coalition,
        *sensitivities,
        config.sample_rate,
        config.steps,
        orders,
    )
    return float(np.sqrt(charge.sites * cal.share_variance) / (charge.scale * config.clip_norm))


@dataclass(frozen=True)
class LocalConfig:
    """One configuration of a local-noise row (the keys of ``[iterate]``)."""

    rounds: int
    local_steps: int
    learning_rate: float
    sample_rate: float
    clip_norm: float


@dataclass(frozen=True)
class PooledConfig:
    """One configuration of a pooled row (the keys of ``[central_dpsgd]``)."""

    steps: int
    learning_rate: float
    sample_rate: float
    clip_norm: float


def local_grid(smallest: bool = False) -> list[LocalConfig]:
    """24 configurations (2 when ``smallest``: for tests): (rounds, local_steps) ∈ {(10, 1),
    (20, 2)} × learning rate ∈ {1, 2, 4} × q ∈ {1, 0.5} × C ∈ {0.5, 1}."""
    if smallest:
        return [LocalConfig(2, 1, 1.0, 1.0, 1.0), LocalConfig(2, 1, 4.0, 1.0, 1.0)]
    return [
        LocalConfig(r, s, lr, q, c)
        for (r, s), lr, q, c in itertools.product(((10, 1), (20, 2)), (1.0, 2.0, 4.0), (1.0, 0.5), (0.5, 1.0))
    ]


def pooled_grid(smallest: bool = False) -> list[PooledConfig]:
    """24 configurations (2 when ``smallest``): steps ∈ {100, 300} × learning rate ∈ {1, 2, 4}
    × q ∈ {0.05, 0.2} × C ∈ {0.5, 1}."""
    if smallest:
        return [PooledConfig(4, 1.0, 0.5, 1.0), PooledConfig(4, 4.0, 0.5, 1.0)]
    return [
        PooledConfig(t, lr, q, c)
        for t, lr, q, c in itertools.product((100, 300), (1.0, 2.0, 4.0), (0.05, 0.2), (0.5, 1.0))
    ]


def secure_grid(smallest: bool = False) -> list[PooledConfig]:
    """28 configurations (2 when ``smallest``) for a secure-aggregation row: full-batch plans,
    steps ∈ {20, 40, 80, 160} × learning rate ∈ {1, 2, 4} × C ∈ {0.5, 1}, then the curator's
    subsampled ones at q = 0.2, steps ∈ {100, 300} × learning rate ∈ {1, 2}, C = 0.5 (charged by
    the general subsampling bound, which full-batch plans avoid)."""
    if smallest:
        return [PooledConfig(4, 1.0, 1.0, 1.0), PooledConfig(4, 4.0, 0.5, 1.0)]
    full = [
        PooledConfig(t, lr, 1.0, c) for t, lr, c in itertools.product((20, 40, 80, 160), (1.0, 2.0, 4.0), (0.5, 1.0))
    ]
    return full + [PooledConfig(t, lr, 0.2, 0.5) for t, lr in itertools.product((100, 300), (1.0, 2.0))]


def validation_split(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], fraction: float, seed: int
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """Every site's records split by a fixed permutation (seeded by ``seed`` and the site's
    index): the first ⌈fraction·n_i⌉ go to the pooled validation set, the rest stay the site's
    training records. Returns (training parts, (x_val, y_val))."""
    if not 0.0 < fraction < 1.0:
        raise InvalidArgument("fraction", f"must be in (0, 1), got {fraction!r}")
    train, xs, ys = [], [], []
    for i, (x, y) in enumerate(parts):
        order = np.random.default_rng([int(seed), i]).permutation(len(y))
        k = int(np.ceil(fraction * len(y)))
        if k >= len(y):
            raise InvalidArgument("fraction", f"leaves site {i} ({len(y)} records) no training records")
        train.append((np.asarray(x)[order[k:]], np.asarray(y)[order[k:]]))
        xs.append(np.asarray(x)[order[:k]])
        ys.append(np.asarray(y)[order[:k]])
    return train, (np.concatenate(xs), np.concatenate(ys))


def _accuracy(model, params, x: torch.Tensor, y: np.ndarray) -> float:
    with torch.no_grad():
        logits = torch.func.functional_call(model, dict(params), (x,))
    return float(np.mean(logits.argmax(dim=1).numpy() == y))


@functools.lru_cache(maxsize=256)
def _calibrated(epsilon: float, delta: float, steps: int, sample_rate: float, adjacency: str) -> float:
    """σ of a plan (a pure function of public numbers; the grids repeat each plan many times)."""
    return noise_multiplier_for(epsilon, delta, steps, sample_rate=sample_rate, adjacency=adjacency, figure=FIGURE)


def score(
    noise: NoiseModel,
    config: LocalConfig | PooledConfig,
    architecture: Mapping[str, Any] | Network,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    epsilon: float,
    delta: float,
    adjacency: str,
    init_seed: int,
    dataset_size: int,
    seeds: Sequence[int],
) -> dict:
    """Validation accuracy (per seed, mean, sample std) of one configuration of a row with noise
    model ``noise``, σ calibrated by ``FIGURE`` to (ε, δ) for its steps (``dataset_size``: the
    pooled rows' public N)."""
    if noise.pooled != isinstance(config, PooledConfig):
        raise InvalidArgument("config", f"a {noise.name} row takes a {'Pooled' if noise.pooled else 'Local'}Config")
    steps = config.steps if noise.pooled else config.rounds * config.local_steps
    with torch_threads(1):
        net = as_network(architecture)
        model = net.build(init_seed)
        if noise.skellam is not None:
            if adjacency != "add-remove":
                raise InvalidArgument("adjacency", f"a secure run is accounted under add-remove, got {adjacency!r}")
            dim = sum(int(p.numel()) for p in model.parameters())
            added = skellam_noise_multiplier(noise.skellam, dim, config, float(epsilon), float(delta))
        else:
            sigma = _calibrated(epsilon, delta, steps, config.sample_rate, adjacency)
            added = sigma * float(np.sqrt(noise.noise_variance_factor))
        step = GaussianStep(config.learning_rate, config.clip_norm, added, config.sample_rate)
        params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss_fn = classifier_loss(model)
        tensors = [(net.inputs(x), torch.as_tensor(np.asarray(y), dtype=torch.long)) for x, y in parts]
        xv, yv = net.inputs(x_val), np.asarray(y_val)
        accs = []
        for seed in seeds:
            if noise.pooled:
                params = pooled_dpsgd(
                    loss_fn, params0, tensors, [step] * steps, make_randomness(int(seed)), dataset_size
                )
            else:
                root = make_randomness(int(seed))
                streams = [root.spawn() for _ in parts]
                params = params0
                for _ in range(config.rounds):
                    params = fedavg_round(loss_fn, params, tensors, [step] * config.local_steps, streams)
            accs.append(_accuracy(model, params, xv, yv))
    a = np.asarray(accs)
    return {
        "config": asdict(config),
        "noise_multiplier": added,
        "accuracy_per_seed": [float(v) for v in accs],
        "accuracy_mean": float(a.mean()),
        "accuracy_std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
    }


def tune(
    sc,
    data,
    noise_models: Sequence[NoiseModel] = (LOCAL, CENTRAL),
    *,
    smallest: bool = False,
    seeds: Sequence[int] = SEARCH_SEEDS,
    fraction: float = VALIDATION_FRACTION,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The search of the module docstring for scenario ``sc`` (with ``[iterate]``) on its split
    ``data`` (``scenarios.world.split_data``): for each noise model, every configuration's
    validation score and the chosen one."""
    it = sc.iterate
    if it is None:
        raise InvalidArgument("iterate", "the search needs the scenario's [iterate] table (its ε, δ, adjacency)")
    if smallest:
        seeds = tuple(seeds)[:1]
    train, (x_val, y_val) = validation_split(data.parts, fraction, sc.seed)
    declared = it.declared_records
    if declared is None:
        declared = int(np.ceil(sum(len(y) for _, y in data.parts) / len(data.parts)))
    pooled_n = max(1, round(declared * len(train) * (1.0 - fraction)))
    rows = {}
    for noise in noise_models:
        started = time.monotonic()
        if noise.skellam is not None:
            grid = secure_grid(smallest)
        else:
            grid = pooled_grid(smallest) if noise.pooled else local_grid(smallest)
        results = []
        for i, config in enumerate(grid, start=1):
            r = score(
                noise, config, data.network, train, x_val, y_val, epsilon=it.epsilon, delta=it.delta,
                adjacency=it.adjacency, init_seed=it.init_seed, dataset_size=pooled_n, seeds=seeds,
            )  # fmt: skip
            results.append(r)
            if progress is not None:
                progress(f"{noise.name} {i}/{len(grid)} {r['config']}: validation {r['accuracy_mean']:.3f}")
        best = max(range(len(results)), key=lambda j: (results[j]["accuracy_mean"], -j))
        rows[noise.name] = {
            "noise_model": asdict(noise),
            "configs": results,
            "chosen": best,
            "wall_s": time.monotonic() - started,
        }
    return {
        "scenario": sc.name,
        "protocol": {
            "validation_fraction": fraction,
            "validation_records": len(y_val),
            "training_records": int(sum(len(y) for _, y in train)),
            "split_seed": sc.seed,
            "search_seeds": [int(s) for s in seeds],
            "epsilon": it.epsilon,
            "delta": it.delta,
            "adjacency": it.adjacency,
            "calibration": FIGURE,
            "pooled_dataset_size": pooled_n,
            "smallest": smallest,
        },
        "rows": rows,
    }


#: Which scenario table each row's choice belongs in.
TABLES = {"local": "iterate", "central": "central_dpsgd", "secure-aggregation": "secure_iterate"}


def chosen_toml(result: Mapping[str, Any]) -> str:
    """The chosen configurations as the scenario tables' keys (to paste into the scenario)."""
    lines = []
    for name, row in result["rows"].items():
        cfg = row["configs"][row["chosen"]]["config"]
        lines.append(f"[{TABLES[name]}]  # chosen by privfusion simulate --tune on the validation split")
        lines += [f"{k} = {v!r}" for k, v in cfg.items()]
        lines.append("")
    return "\n".join(lines)


def markdown(result: Mapping[str, Any]) -> str:
    """Every configuration's validation accuracy, the chosen one marked, per row."""
    p = result["protocol"]
    out = [
        f"### {result['scenario']}",
        "",
        f"Validation: {p['validation_records']} records ({p['validation_fraction']:g} of each site's protected "
        f"records), training on the other {p['training_records']}; ε = {p['epsilon']:g} per record at "
        f"δ = {p['delta']:g} ({p['adjacency']}), σ by {p['calibration'].upper()}; search seeds "
        f"{p['search_seeds']}; pooled N = {p['pooled_dataset_size']}.",
        "",
    ]
    for name, row in result["rows"].items():
        nm = row["noise_model"]
        factor = f", noise variance × {nm['noise_variance_factor']:.4g}" if nm["noise_variance_factor"] != 1 else ""
        if nm.get("skellam"):
            sk = nm["skellam"]
            factor = (
                f", Skellam shares of {sk['sites']} sites (t = {sk['coalition']}, γ = {sk['scale']:g}, "
                f"{sk['bits']} bits) calibrated as the secure run is charged"
            )
        out += [f"**{name}** ({'pooled' if nm['pooled'] else 'local'} noise{factor}; {row['wall_s']:.0f} s)", ""]
        keys = list(row["configs"][0]["config"])
        out.append("| " + " | ".join([*keys, "σ", "validation accuracy", ""]) + " |")
        out.append("|" + "---|" * (len(keys) + 3))
        for j, r in enumerate(row["configs"]):
            mark = "**chosen**" if j == row["chosen"] else ""
            cells = [f"{r['config'][k]:g}" for k in keys]
            acc = f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f}"
            out.append("| " + " | ".join([*cells, f"{r['noise_multiplier']:.3g}", acc, mark]) + " |")
        out.append("")
    return "\n".join(out)


__all__ = [
    "CENTRAL",
    "FIGURE",
    "LOCAL",
    "SEARCH_SEEDS",
    "TABLES",
    "VALIDATION_FRACTION",
    "LocalConfig",
    "NoiseModel",
    "PooledConfig",
    "SkellamCharge",
    "chosen_toml",
    "local_grid",
    "markdown",
    "pooled_grid",
    "score",
    "secure_aggregation",
    "secure_grid",
    "skellam_noise_multiplier",
    "tune",
    "validation_split",
]
