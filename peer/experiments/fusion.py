"""The fusion experiment (issue 2, the paper's Table I on scikit-learn's digits).

Two sites train models of the same architecture from different seeds on their own part of the
digits training set — once split homogeneously (IID), once with a heterogeneous label skew.
Site A then fuses its model with site B's by each method and reports test accuracy:

- ``model_a``, ``model_b``: each model alone;
- ``vanilla_averaging``: α·θ_A + (1−α)·θ_B with no alignment;
- ``prediction_ensemble``: α·p_A + (1−α)·p_B (both models at inference; not a single model);
- ``weight_matching``: Git Re-Basin weight matching on exact weights, then α-fusion;
- ``graph_matching``: non-private spectral graph matching (exact activations and weights);
- PrivFusion at ε_x = ε_w = ε_f = ε: B releases Laplace activations and multi-bit weight
  features (site A matches against them) and PFA-perturbed weights (site A fuses them), under
  the per-entry unit (``privfusion``, the paper's proofs) and the per-neuron unit
  (``privfusion_per_neuron``, the project's default).

The probe set is a public slice of the digits training split that neither site trains on. The
clip bounds are public constants (``FusionConfig``), chosen before seeing any model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from peer.data import load_dataset, split_homogeneous, split_label_skew
from peer.fusion import (ensemble_proba, fuse_arrays, permute_arrays, vanilla_average, weight_matching)
from peer.graph import extract_graph
from peer.matching import match_graphs
from peer.mechanisms import perturb_graph, perturb_model_weights
from peer.models import accuracy, model_from_arrays, state_arrays, train_classifier
from peer.rng import make_randomness

ARCHITECTURES = {
    "mlp": {"kind": "mlp", "input_dim": 64, "hidden": [128, 128], "output_dim": 10, "activation": "relu"},
    "cnn": {"kind": "cnn", "input_shape": [1, 8, 8], "channels": [16, 32], "kernel_size": 3, "pool": [2, 2],
            "hidden": [128], "output_dim": 10, "activation": "relu"},
}
ALPHAS = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))
EPSILONS = (1.0, 0.1, 0.01)


@dataclass(frozen=True)
class FusionConfig:
    model: str = "mlp"
    seed: int = 0
    probe_size: int = 128
    epochs: int = 40
    delta: float = 1e-5
    #: public clip range of post-ReLU activations (Laplace)
    activation_clip: tuple[float, float] = (0.0, 4.0)
    #: public bound multiplier: weight features are clipped to ±weight_bound_scale/sqrt(fan_in)
    weight_bound_scale: float = 2.0
    #: public L2 clip of each neuron's incoming weight vector (+bias), as a multiple of sqrt(2)
    clip_norm_scale: float = 2.0
    epsilons: tuple[float, ...] = EPSILONS
    alphas: tuple[float, ...] = ALPHAS
    label_skew: float = 0.8


@dataclass
class SplitResult:
    methods: dict[str, float] = field(default_factory=dict)
    privfusion: dict[str, float] = field(default_factory=dict)
    privfusion_per_neuron: dict[str, float] = field(default_factory=dict)
    alpha_sweep: dict[str, list[list[float]]] = field(default_factory=dict)
    permutation_agreement: dict[str, float] = field(default_factory=dict)


def _acc_of(arch, x, y):
    return lambda arrays: accuracy(arch, model_from_arrays(arch, arrays), x, y)


def _sweep(alphas, fn: Callable[[float], float]) -> list[list[float]]:
    return [[float(a), float(fn(a))] for a in alphas]


def run_split(cfg: FusionConfig, split: str, progress: Callable[[str], None] = lambda s: None) -> SplitResult:
    arch = ARCHITECTURES[cfg.model]
    ds = load_dataset("digits", seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(ds.y_train))
    probe_idx, train_idx = order[: cfg.probe_size], order[cfg.probe_size:]
    x_probe = ds.x_train[probe_idx]
    x_tr, y_tr = ds.x_train[train_idx], ds.y_train[train_idx]
    if split == "homogeneous":
        parts = split_homogeneous(y_tr, 2, seed=cfg.seed)
    else:
        parts = split_label_skew(y_tr, majority=cfg.label_skew, seed=cfg.seed)
    progress(f"{split}: training two {cfg.model.upper()}s")
    models = [train_classifier(arch, x_tr[p], y_tr[p], seed=cfg.seed + 1 + i, epochs=cfg.epochs) for i, p in enumerate(parts)]
    a, b = (state_arrays(m) for m in models)
    acc = _acc_of(arch, ds.x_test, ds.y_test)
    res = SplitResult()
    res.methods["model_a"] = acc(a)
    res.methods["model_b"] = acc(b)

    res.alpha_sweep["vanilla_averaging"] = _sweep(cfg.alphas, lambda al: acc(vanilla_average(a, b, al)))
    res.alpha_sweep["prediction_ensemble"] = _sweep(cfg.alphas, lambda al: float(np.mean(
        ensemble_proba(arch, a, b, ds.x_test, al).argmax(1) == ds.y_test)))

    progress(f"{split}: weight matching and graph matching")
    wm = weight_matching(arch, a, b, seed=cfg.seed)
    b_wm = permute_arrays(arch, b, wm.permutations)
    res.alpha_sweep["weight_matching"] = _sweep(cfg.alphas, lambda al: acc(fuse_arrays(a, b_wm, al)))

    ga = extract_graph(arch, models[0], x_probe)
    gb = extract_graph(arch, models[1], x_probe)
    gm = match_graphs(ga, gb)
    b_gm = permute_arrays(arch, b, gm.permutations)
    res.alpha_sweep["graph_matching"] = _sweep(cfg.alphas, lambda al: acc(fuse_arrays(a, b_gm, al)))

    for unit, key in (("entry", "privfusion"), ("neuron", "privfusion_per_neuron")):
        for eps in cfg.epsilons:
            progress(f"{split}: PrivFusion, per-{unit}, epsilon={eps:g}")
            randomness = make_randomness(cfg.seed * 1000 + int(round(-np.log10(eps))) * 10 + (unit == "neuron"))
            noisy_gb, _ = perturb_graph(gb, epsilon_x=eps, epsilon_w=eps,
                                        activation_clip=cfg.activation_clip,
                                        weight_bounds=_weight_bounds(arch, cfg), unit=unit, randomness=randomness)
            pm = match_graphs(ga, noisy_gb)
            noisy_b, _ = perturb_model_weights(arch, b, epsilon=eps, delta=cfg.delta,
                                               clip_norm=_clip_norms(arch, cfg), unit=unit,
                                               randomness=randomness.spawn())
            b_pf = permute_arrays(arch, noisy_b, pm.permutations)
            sweep = _sweep(cfg.alphas, lambda al: acc(fuse_arrays(a, b_pf, al)))
            res.alpha_sweep[f"{key}_eps{eps:g}"] = sweep
            getattr(res, key)[f"{eps:g}"] = dict(sweep)[0.5]
            res.permutation_agreement[f"{key}_eps{eps:g}"] = _agreement(pm.permutations, gm.permutations)

    for name in ("vanilla_averaging", "prediction_ensemble", "weight_matching", "graph_matching"):
        res.methods[name] = dict(res.alpha_sweep[name])[0.5]
    res.permutation_agreement["weight_matching"] = _agreement(wm.permutations, gm.permutations)
    return res


def _agreement(p, q) -> float:
    """Fraction of hidden nodes that two alignments map the same way."""
    same = sum(int(np.sum(np.asarray(x) == np.asarray(y))) for x, y in zip(p, q))
    return same / sum(len(x) for x in p)


def _weight_bounds(arch, cfg: FusionConfig) -> dict[str, tuple[float, float]]:
    """Public per-layer weight-feature bounds ±scale/sqrt(fan_in), from the architecture only."""
    from peer.fusion import weight_layers_of
    from peer.models import build_model

    model = build_model(arch)
    out = {}
    for layer in weight_layers_of(arch):
        w = getattr(model, layer.name).weight
        fan_in = int(np.prod(w.shape[1:]))
        c = cfg.weight_bound_scale / np.sqrt(fan_in)
        out[layer.name] = (-c, c)
    return out


def _clip_norms(arch, cfg: FusionConfig) -> dict[str, float]:
    """Public per-layer L2 clip for each neuron's incoming vector (+bias): the norm of a vector
    whose entries all sit at the per-entry bound scale/sqrt(fan_in) is about scale."""
    return {name: cfg.clip_norm_scale for name in _weight_bounds(arch, cfg)}


def run(cfg: FusionConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for split in ("homogeneous", "heterogeneous"):
        out[split] = asdict(run_split(cfg, split, progress))
    cfg_d = asdict(cfg)
    out["config"] = cfg_d
    return out
