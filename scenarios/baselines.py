"""Baselines the simulator reports beside fusion: central-server DP-FedAvg and central pooled
training. Both are computed by the simulator itself (no daemons, no gRPC) on the scenario's own
split: the same sites' protected records, the same test set, the same architecture.

**DP-FedAvg** (McMahan et al. 2018, "Learning differentially private recurrent language models",
with local DP-SGD at every site instead of server-side user-level noise; what Flower + Opacus
deployments run). Round r = 1..R, server model θ^{r−1} (θ^0 = build_model(arch, init_seed),
public)::

    every site i, from θ^{r−1}, runs ``local_steps`` full-batch DP-GD steps on its n_i records:
        θ ← θ − η · ( Σ_{x∈D_i} clip_C(∇ℓ(θ; x)) + σ·C·z ) / n_i,   z ~ N(0, I) fresh per step
    the server averages:  θ^r = Σ_i (n_i / N) θ_i^r,   N = Σ_i n_i

(``peer.dp.training.run_dpsgd``, the project's DP-SGD, runs each site's steps). The unit of
privacy is one training record of one site, add/remove (or replace-one, ``[iterate]
adjacency``); the record counts n_i are treated as public (the server weights by them, as
FedAvg does). A site's records enter only its own R·local_steps Gaussian steps, each with
sensitivity C (2C for replace-one) and noise σC; the server's averaging and the other sites'
updates are post-processing for it. So every site spends the privacy of R·local_steps
adaptively composed full-batch Gaussian mechanisms with noise multiplier σ, whatever n_i is.

σ is the smallest noise multiplier for which those steps fit (ε, δ) by one figure
(``peer.budget.dpsgd_noise.noise_multiplier_for``):

- ``"rdp"`` — RDP over dp-accounting's default orders, converted at δ by dp-accounting's
  improved conversion: what an Opacus / dp-accounting user calibrating DP-FedAvg reports;
- ``"filter"`` — the multi-order RDP filter a site's ledger enforces: what a site that charges
  its ledger before anything leaves (peer-to-peer training) can spend for the same (ε, δ).

Each run reports what every site spent by all three figures (filter, RDP, PLD — the tight one)
after every round. Noise comes from a fixed-seed generator per (baseline seed, site): this is a
simulation, and the report says so; a deployment's noise is CSPRNG-seeded.

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

from peer.base.rng import Randomness, make_randomness
from peer.budget.dpsgd_noise import FIGURES, noise_multiplier_for, run_epsilon
from peer.dp.accounting import GaussianStep
from peer.dp.training import LossFn, classifier_loss, run_dpsgd
from peer.nn.architectures import build_model, input_tensor, torch_threads, train_classifier

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


def spent_epsilon(noise_multiplier: float, steps: int, delta: float, adjacency: str) -> dict[str, float]:
    """ε at δ of ``steps`` full-batch Gaussian steps with noise multiplier σ, by every figure."""
    return {f: run_epsilon(noise_multiplier, steps, delta, adjacency=adjacency, figure=f) for f in FIGURES}


def dp_fedavg(
    architecture: Mapping[str, Any],
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
) -> dict:
    """DP-FedAvg (module docstring) calibrated by ``figure`` to (ε, δ) per record at every site,
    once per seed in ``seeds`` (the seed drives only the noise; θ^0 comes from ``init_seed``).

    Returns σ, what every site spent (every figure, after every round and in total), the mean ±
    sample std over seeds of the server model's test accuracy after every round (every site
    holds the server model, so this is also the mean over sites), and the final accuracy per
    site and per seed."""
    steps_total = rounds * local_steps
    sigma = noise_multiplier_for(epsilon, delta, steps_total, adjacency=adjacency, figure=figure)
    step = GaussianStep(learning_rate=learning_rate, clip_norm=clip_norm, noise_multiplier=sigma)
    names = list(site_names) if site_names is not None else [f"site-{i}" for i in range(len(parts))]
    started = time.monotonic()
    with torch_threads(1):  # many tiny steps: one thread beats OpenMP's hand-offs
        model = build_model(architecture, seed=init_seed)
        params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss_fn = classifier_loss(model)
        tensors = [(input_tensor(architecture, x), torch.as_tensor(np.asarray(y), dtype=torch.long)) for x, y in parts]
        xt = input_tensor(architecture, x_test)
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
        per_round.append(
            {"round": r, "accuracy_mean": m, "accuracy_std": s}
            | {f"epsilon_{f}": e for f, e in spent_epsilon(sigma, r * local_steps, delta, adjacency).items()}
        )
    final_mean, final_std = _mean_std(acc[:, -1])
    n_params = sum(int(v.numel()) for v in params0.values())
    model_bytes = n_params * BYTES_PER_PARAMETER
    return {
        "calibration": figure,
        "noise_multiplier": sigma,
        "steps_per_site": steps_total,
        "epsilon_target": epsilon,
        "delta": delta,
        "epsilon_spent": spent_epsilon(sigma, steps_total, delta, adjacency),
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


def central_pooled(
    architecture: Mapping[str, Any],
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
    from peer.nn.architectures import accuracy

    started = time.monotonic()
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    accs = []
    for seed in seeds:
        model = train_classifier(
            architecture, x, y, seed=int(seed), epochs=epochs, batch_size=batch_size, learning_rate=learning_rate
        )
        accs.append(accuracy(architecture, model, x_test, y_test))
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


def scenario_baselines(
    sc,
    architecture: Mapping[str, Any],
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
    x_test: np.ndarray,
    y_test: np.ndarray,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The simulator's baselines for a scenario (``scenarios.schema.Scenario``) on its split
    (``parts``: every site's protected records, in the scenario's site order): central pooled
    always (seeds: the ``[iterate]`` baseline seeds, else one), DP-FedAvg at both calibrations
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
        )
        for figure in CALIBRATIONS
    }
    out["dp_fedavg"] = {
        "rounds": it.rounds,
        "local_steps": it.local_steps,
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
    c = baselines.get("central_pooled")
    if c:
        lines.append(f"central pooled (non-private): accuracy {c['accuracy_mean']:.3f} ± {c['accuracy_std']:.3f}")
    return "\n".join(lines)


__all__ = [
    "ACCOUNTANT",
    "CALIBRATIONS",
    "central_pooled",
    "dp_fedavg",
    "dp_fedavg_summary",
    "fedavg_round",
    "scenario_baselines",
    "spent_epsilon",
]
