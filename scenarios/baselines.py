"""Baselines the simulator reports beside fusion: central-server DP-FedAvg, central DP-SGD on
the pooled records (a trusted curator) and central pooled non-private training. Both are computed by the simulator itself (no daemons, no gRPC) on the scenario's own
split: the same sites' protected records, the same test set, the same architecture.

**DP-FedAvg** (McMahan et al. 2018, "Learning differentially private recurrent language models",
with local DP-SGD at every site instead of server-side user-level noise; what Flower + Opacus
deployments run). Round r = 1..R, server model θ^{r−1} (θ^0 = build_model(arch, init_seed),
public)::

    every site i, from θ^{r−1}, runs ``local_steps`` DP-SGD steps on its n_i records, each on a
    Poisson batch B of rate q (``[iterate] sample_rate``; q = 1: every record, full-batch DP-GD):
        θ ← θ − η · ( Σ_{x∈B} clip_C(∇ℓ(θ; x)) + σ·C·z ) / (q·n_i),   z ~ N(0, I) fresh per step
    the server averages:  θ^r = Σ_i (n_i / N) θ_i^r,   N = Σ_i n_i

(``peer.dp.training.run_dpsgd``, the project's DP-SGD, runs each site's steps). The unit of
privacy is one training record of one site, add/remove (or replace-one, ``[iterate]
adjacency``); the record counts n_i are treated as public (the server weights by them, as
FedAvg does). A site's records enter only its own R·local_steps Gaussian steps, each with
sensitivity C (2C for replace-one) and noise σC; the server's averaging and the other sites'
updates are post-processing for it. So every site spends the privacy of R·local_steps
adaptively composed Gaussian mechanisms (Poisson-subsampled at rate q) with noise multiplier σ,
whatever n_i is.

σ is the smallest noise multiplier for which those steps fit (ε, δ) by one figure
(``peer.budget.dpsgd_noise.noise_multiplier_for``):

- ``"rdp"`` — RDP over dp-accounting's default orders, converted at δ by dp-accounting's
  improved conversion: what an Opacus / dp-accounting user calibrating DP-FedAvg reports;
- ``"filter"`` — the multi-order RDP filter a site's ledger enforces: what a site that charges
  its ledger before anything leaves (peer-to-peer training) can spend for the same (ε, δ).

Each run reports what every site spent by all three figures (filter, RDP, PLD — the tight one)
after every round. Noise comes from a fixed-seed generator per (baseline seed, site): this is a
simulation, and the report says so; a deployment's noise is CSPRNG-seeded.

**Central DP-SGD** (the trusted curator: the ceiling for any DP collaboration at the same
(ε, δ)): one curator holds every site's protected records pooled, N = Σ_i n_i of them, and runs
``[central_dpsgd] steps`` DP-SGD steps (Abadi et al. 2016) from the same public θ^0, the same
architecture, on Poisson batches of rate q::

        θ ← θ − η · ( Σ_{x∈B} clip_C(∇ℓ(θ; x)) + σ·C·z ) / (q·N_declared)

with N_declared = Σ_i declared_records (public; under add-remove never the true count) and σ
calibrated to (ε, δ) per record by the same figure as DP-FedAvg. Each record is in one site's
data, so the per-record guarantee is the same (ε, δ) as every other row's. A distributed-noise
protocol whose summed noise has variance ``noise_variance_factor`` times the curator's (secure
aggregation among k sites resisting coalitions of t: k/(k − t)) is the same run with noise
multiplier σ·√factor; the simulator's central row has factor 1.

**Central pooled**: non-private training of the same architecture, with the scenario's ``[model]``
hyperparameters, on all sites' records pooled — the ceiling no fusion can honestly beat (no
privacy, no decentralisation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.base.rng import Randomness, make_randomness
from peer.budget.dpsgd_noise import FIGURES, noise_multiplier_for, run_epsilon
from peer.dp.accounting import GaussianStep
from peer.dp.training import LossFn, classifier_loss, run_dpsgd
from peer.nn.architectures import torch_threads
from scenarios.network import Network, as_network

CALIBRATIONS = ("rdp", "filter")
ACCOUNTANT = (
    "peer.budget.dpsgd_noise: RDP curves of the full-batch Gaussian (the project's accountant); 'rdp' "
    "converted by dp-accounting 0.6's improved RDP→(ε, δ) conversion over dp-accounting's default orders, "
    "'pld' the exact Gaussian privacy loss (μ = √T/σ), 'filter' the ledger's multi-order RDP filter"
)
BYTES_PER_PARAMETER = 4  # float32 on the wire, as the sites' models are stored


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fedavg_round(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    steps: Sequence[GaussianStep],
    randomness: Sequence[Randomness],
) -> dict[str, torch.Tensor]:
    """One DP-FedAvg round from the server model ``params``: every site i runs ``steps`` on its
    records ``parts[i]`` with denominator n_i (``run_dpsgd``, noise from ``randomness[i]``), and
    the result is Σ_i (n_i/N) θ_i. Pure apart from the generators it advances."""
    sizes = [int(x.shape[0]) for x, _ in parts]
    total = float(sum(sizes))
    out = {k: torch.zeros_like(v) for k, v in params.items()}
    for (x, y), n, rand in zip(parts, sizes, randomness, strict=True):
        local = run_dpsgd(loss_fn, params, x, y, steps, randomness=rand, dataset_size=n).params
        for k in out:
            out[k] += (n / total) * local[k]
    return out


def _accuracy(model: torch.nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: np.ndarray) -> float:
    with torch.no_grad():
        logits = torch.func.functional_call(model, dict(params), (x,))
    return float(np.mean(logits.argmax(dim=1).numpy() == y))


def spent_epsilon(
    noise_multiplier: float, steps: int, delta: float, adjacency: str, sample_rate: float = 1.0
) -> dict[str, float]:
    """ε at δ of ``steps`` Gaussian steps with noise multiplier σ, Poisson rate ``sample_rate``
    (1: full batch), by every figure."""
    return {
        f: run_epsilon(noise_multiplier, steps, delta, sample_rate=sample_rate, adjacency=adjacency, figure=f)
        for f in FIGURES
    }


def dp_fedavg(
    architecture: Mapping[str, Any] | Network,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    rounds: int,
    local_steps: int,
    learning_rate: float,
    clip_norm: float,
    epsilon: float,
    delta: float,
    adjacency: str = "add-remove",
    init_seed: int = 0,
    seeds: Sequence[int] = (0,),
    figure: str = "rdp",
    site_names: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    sample_rate: float = 1.0,
    per_round_epsilon: bool = True,
) -> dict:
    """DP-FedAvg (module docstring) calibrated by ``figure`` to (ε, δ) per record at every site,
    once per seed in ``seeds`` (the seed drives only the noise; θ^0 comes from ``init_seed``).

    Returns σ, what every site spent (every figure, after every round and in total), the mean ±
    sample std over seeds of the server model's test accuracy after every round (every site
    holds the server model, so this is also the mean over sites), and the final accuracy per
    site and per seed. ``per_round_epsilon=False`` leaves every figure out of the rounds but the
    last (a search's many runs need only the final one)."""
    steps_total = rounds * local_steps
    sigma = noise_multiplier_for(
        epsilon, delta, steps_total, sample_rate=sample_rate, adjacency=adjacency, figure=figure
    )
    step = GaussianStep(
        learning_rate=learning_rate, clip_norm=clip_norm, noise_multiplier=sigma, sample_rate=sample_rate
    )
    names = list(site_names) if site_names is not None else [f"site-{i}" for i in range(len(parts))]
    started = time.monotonic()
    with torch_threads(1):  # many tiny steps: one thread beats OpenMP's hand-offs
        net = as_network(architecture)
        model = net.build(init_seed)
        params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss_fn = classifier_loss(model)
        tensors = [(net.inputs(x), torch.as_tensor(np.asarray(y), dtype=torch.long)) for x, y in parts]
        xt = net.inputs(x_test)
        yt = np.asarray(y_test)
        initial = _accuracy(model, params0, xt, yt)
        curves = []
        for seed in seeds:
            # one independent stream per site, all from the baseline seed (fixed: a simulation)
            root = make_randomness(int(seed))
            streams = [root.spawn() for _ in parts]
            params, curve = params0, []
            for _ in range(rounds):
                params = fedavg_round(loss_fn, params, tensors, [step] * local_steps, streams)
                curve.append(_accuracy(model, params, xt, yt))
            curves.append(curve)
            if progress is not None:
                progress(f"DP-FedAvg ({figure} calibration, σ={sigma:.4g}) seed {seed}: accuracy {curve[-1]:.3f}")
    acc = np.asarray(curves)  # (seeds, rounds)
    per_round = []
    for r in range(1, rounds + 1):
        m, s = _mean_std(acc[:, r - 1])
        row = {"round": r, "accuracy_mean": m, "accuracy_std": s}
        if per_round_epsilon or r == rounds:
            spent = spent_epsilon(sigma, r * local_steps, delta, adjacency, sample_rate)
            row |= {f"epsilon_{f}": e for f, e in spent.items()}
        per_round.append(row)
    final_mean, final_std = _mean_std(acc[:, -1])
    n_params = sum(int(v.numel()) for v in params0.values())
    model_bytes = n_params * BYTES_PER_PARAMETER
    return {
        "calibration": figure,
        "noise_multiplier": sigma,
        "steps_per_site": steps_total,
        "sample_rate": sample_rate,
        "epsilon_target": epsilon,
        "delta": delta,
        "epsilon_spent": {f: per_round[-1][f"epsilon_{f}"] for f in FIGURES},
        "initial_accuracy": initial,
        "per_round": per_round,
        "final_accuracy_mean": final_mean,
        "final_accuracy_std": final_std,
        "final_accuracy_per_seed": {str(s): float(a) for s, a in zip(seeds, acc[:, -1], strict=True)},
        "per_site": {
            name: {"records": len(y), "final_accuracy_mean": final_mean, "final_accuracy_std": final_std}
            for name, (_, y) in zip(names, parts, strict=True)
        },
        "parameters": n_params,
        "bytes_per_site": {
            "per_round": 2 * model_bytes,
            "total": 2 * model_bytes * rounds,
            "rule": f"{n_params} float32 parameters × 2 per round (download the server model, upload the update)",
        },
        "seeds": [int(s) for s in seeds],
        "randomness": "fixed-seed (simulation: one NumPy PCG64 stream per baseline seed and site)",
        "wall_s": time.monotonic() - started,
    }


def pooled_dpsgd(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    steps: Sequence[GaussianStep],
    randomness: Randomness,
    dataset_size: int,
) -> dict[str, torch.Tensor]:
    """The curator's DP-SGD run: ``steps`` on the records of every site in ``parts`` concatenated
    (site order), denominator q·``dataset_size`` (``run_dpsgd``: noise, then the Poisson mask, from
    ``randomness``)."""
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    return run_dpsgd(loss_fn, params, x, y, steps, randomness=randomness, dataset_size=dataset_size).params


def record_bytes(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, int]:
    """Bytes each site's records take as float32 inputs and int64 labels: what it uploads to a
    curator that trains on the pooled records."""
    return {str(i): int(np.asarray(x).size * 4 + np.asarray(y).size * 8) for i, (x, y) in enumerate(parts)}


def central_dpsgd(
    architecture: Mapping[str, Any] | Network,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    steps: int,
    sample_rate: float,
    learning_rate: float,
    clip_norm: float,
    epsilon: float,
    delta: float,
    dataset_size: int,
    adjacency: str = "add-remove",
    init_seed: int = 0,
    seeds: Sequence[int] = (0,),
    figure: str = "rdp",
    noise_variance_factor: float = 1.0,
    site_names: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Central DP-SGD on every site's records pooled (module docstring), once per seed (the seed
    drives the noise and the Poisson batches; θ^0 comes from ``init_seed``). ``dataset_size`` is
    the public N of the denominator q·N (declared under add-remove). σ is calibrated by
    ``figure`` to (ε, δ) for ``steps`` steps at rate ``sample_rate``; the run adds noise
    multiplier σ·√``noise_variance_factor`` (≥ 1). Returns σ, the ε spent by the noise added (every
    figure), the mean ± sample std of test accuracy over seeds, per-seed accuracies, the bytes
    each site sends (its records, once) and the wall time."""
    if not noise_variance_factor >= 1.0:
        raise InvalidArgument("noise_variance_factor", f"must be ≥ 1, got {noise_variance_factor!r}")
    sigma = noise_multiplier_for(epsilon, delta, steps, sample_rate=sample_rate, adjacency=adjacency, figure=figure)
    added = sigma * float(np.sqrt(noise_variance_factor))
    step = GaussianStep(
        learning_rate=learning_rate, clip_norm=clip_norm, noise_multiplier=added, sample_rate=sample_rate
    )
    names = list(site_names) if site_names is not None else [f"site-{i}" for i in range(len(parts))]
    started = time.monotonic()
    with torch_threads(1):
        net = as_network(architecture)
        model = net.build(init_seed)
        params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss_fn = classifier_loss(model)
        tensors = [(net.inputs(x), torch.as_tensor(np.asarray(y), dtype=torch.long)) for x, y in parts]
        xt, yt = net.inputs(x_test), np.asarray(y_test)
        accs = []
        for seed in seeds:
            trained = pooled_dpsgd(loss_fn, params0, tensors, [step] * steps, make_randomness(int(seed)), dataset_size)
            accs.append(_accuracy(model, trained, xt, yt))
            if progress is not None:
                progress(f"central DP-SGD ({figure} calibration, σ={added:.4g}) seed {seed}: accuracy {accs[-1]:.3f}")
    m, s = _mean_std(accs)
    sent = record_bytes(parts)
    return {
        "calibration": figure,
        "noise_multiplier": added,
        "noise_multiplier_calibrated": sigma,
        "noise_variance_factor": noise_variance_factor,
        "steps": steps,
        "sample_rate": sample_rate,
        "learning_rate": learning_rate,
        "clip_norm": clip_norm,
        "dataset_size": dataset_size,
        "epsilon_target": epsilon,
        "delta": delta,
        "adjacency": adjacency,
        "epsilon_spent": spent_epsilon(added, steps, delta, adjacency, sample_rate),
        "accuracy_mean": m,
        "accuracy_std": s,
        "accuracy_per_seed": {str(sd): float(a) for sd, a in zip(seeds, accs, strict=True)},
        "seeds": [int(sd) for sd in seeds],
        "bytes_per_site": {name: sent[str(i)] for i, name in enumerate(names)}
        | {"rule": "each site uploads its records once (float32 inputs, int64 labels) to the curator"},
        "randomness": "fixed-seed (simulation: one NumPy PCG64 stream per baseline seed)",
        "label": "central DP-SGD (a trusted curator holds every site's records pooled; Poisson minibatches)",
        "wall_s": time.monotonic() - started,
    }


def central_pooled(
    architecture: Mapping[str, Any] | Network,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seeds: Sequence[int] = (0,),
) -> dict:
    """NON-PRIVATE: the architecture trained (``train_classifier``: Adam, cross-entropy) on every
    site's records pooled, once per seed (initialisation and batch order); test accuracy."""
    net = as_network(architecture)
    started = time.monotonic()
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    accs = []
    for seed in seeds:
        model = net.train(x, y, seed=int(seed), epochs=epochs, batch_size=batch_size, learning_rate=learning_rate)
        accs.append(net.accuracy_of(model, x_test, y_test))
    m, s = _mean_std(accs)
    return {
        "records": len(y),
        "accuracy_mean": m,
        "accuracy_std": s,
        "accuracy_per_seed": {str(sd): float(a) for sd, a in zip(seeds, accs, strict=True)},
        "seeds": [int(sd) for sd in seeds],
        "hyperparameters": {"epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate},
        "label": "central pooled (NON-PRIVATE): one model trained on every site's records together",
        "wall_s": time.monotonic() - started,
    }


def pooled_size(sc, parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """The central DP-SGD denominator's public N: sites × ``[iterate] declared_records`` (each
    site's public count), else (replace-one, where the count is public) the pooled count."""
    it = sc.iterate
    if it.declared_records is not None:
        return int(it.declared_records) * len(parts)
    if it.adjacency == "add-remove":
        raise InvalidArgument("iterate.declared_records", "is required under add-remove (the true count is private)")
    return int(sum(len(y) for _, y in parts))


def scenario_baselines(
    sc,
    architecture: Mapping[str, Any] | Network,
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The simulator's baselines for a scenario (``scenarios.schema.Scenario``) on its split
    (``parts``: every site's protected records, in the scenario's site order): central pooled
    always (seeds: the ``[iterate]`` baseline seeds, else one); DP-FedAvg at both calibrations
    and central DP-SGD (``[central_dpsgd]``, RDP calibration as a curator running Opacus would)
    when the scenario has ``[iterate]``.

    Central pooled's seed for baseline seed s is ``scenario seed × 1000 + 500 + s``: disjoint
    from the sites' own-model seeds (scenario seed × 1000 + 1..k)."""
    it = sc.iterate
    seeds = it.baseline_seeds if it is not None else (0,)
    out: dict[str, Any] = {
        "central_pooled": central_pooled(
            architecture,
            parts,
            x_test,
            y_test,
            epochs=sc.model.epochs,
            batch_size=sc.model.batch_size,
            learning_rate=sc.model.learning_rate,
            seeds=[sc.seed * 1000 + 500 + s for s in seeds],
        )
    }
    if progress is not None:
        c = out["central_pooled"]
        progress(f"central pooled (non-private): accuracy {c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f}")
    if it is None:
        return out
    names = [s.name for s in sc.sites]
    runs = {
        figure: dp_fedavg(
            architecture,
            parts,
            x_test,
            y_test,
            rounds=it.rounds,
            local_steps=it.local_steps,
            learning_rate=it.learning_rate,
            clip_norm=it.clip_norm,
            epsilon=it.epsilon,
            delta=it.delta,
            adjacency=it.adjacency,
            init_seed=it.init_seed,
            seeds=it.baseline_seeds,
            figure=figure,
            site_names=names,
            progress=progress,
            sample_rate=it.sample_rate,
        )
        for figure in CALIBRATIONS
    }
    c = sc.central_dpsgd
    out["central_dpsgd"] = central_dpsgd(
        architecture,
        parts,
        x_test,
        y_test,
        steps=c.steps,
        sample_rate=c.sample_rate,
        learning_rate=c.learning_rate,
        clip_norm=c.clip_norm,
        epsilon=it.epsilon,
        delta=it.delta,
        dataset_size=pooled_size(sc, parts),
        adjacency=it.adjacency,
        init_seed=it.init_seed,
        seeds=it.baseline_seeds,
        figure="rdp",
        site_names=names,
        progress=progress,
    )
    out["dp_fedavg"] = {
        "rounds": it.rounds,
        "local_steps": it.local_steps,
        "sample_rate": it.sample_rate,
        "learning_rate": it.learning_rate,
        "clip_norm": it.clip_norm,
        "epsilon": it.epsilon,
        "delta": it.delta,
        "adjacency": it.adjacency,
        "init_seed": it.init_seed,
        "accountant": ACCOUNTANT,
        "calibrations": runs,
        "label": "central-server DP-FedAvg, local full-batch DP-GD at every site (simulated by the simulator)",
    }
    return out


def dp_fedavg_summary(baselines: Mapping[str, Any]) -> str:
    """One line per calibration, for progress output and the CLI."""
    lines = []
    fa = baselines.get("dp_fedavg")
    if fa:
        for figure, run in fa["calibrations"].items():
            eps = run["epsilon_spent"]
            lines.append(
                f"DP-FedAvg ({figure} calibration, σ={run['noise_multiplier']:.4g}, {fa['rounds']}×{fa['local_steps']} steps): "
                f"accuracy {run['final_accuracy_mean']:.3f} ± {run['final_accuracy_std']:.3f} over {len(run['seeds'])} seeds; "
                f"ε per record spent: filter {eps['filter']:.3f}, RDP {eps['rdp']:.3f}, PLD {eps['pld']:.3f}"
            )
    cd = baselines.get("central_dpsgd")
    if cd:
        eps = cd["epsilon_spent"]
        lines.append(
            f"central DP-SGD (trusted curator, {cd['steps']} steps at q={cd['sample_rate']:g}, σ={cd['noise_multiplier']:.4g}): "
            f"accuracy {cd['accuracy_mean']:.3f} ± {cd['accuracy_std']:.3f} over {len(cd['seeds'])} seeds; "
            f"ε per record spent: filter {eps['filter']:.3f}, RDP {eps['rdp']:.3f}, PLD {eps['pld']:.3f}"
        )
    c = baselines.get("central_pooled")
    if c:
        lines.append(f"central pooled (non-private): accuracy {c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f}")
    return "\n".join(lines)


__all__ = [
    "ACCOUNTANT",
    "CALIBRATIONS",
    "central_dpsgd",
    "central_pooled",
    "dp_fedavg",
    "dp_fedavg_summary",
    "fedavg_round",
    "pooled_dpsgd",
    "pooled_size",
    "record_bytes",
    "scenario_baselines",
    "spent_epsilon",
]
