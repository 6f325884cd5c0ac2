"""The fusion experiment (issue 2, the paper's Table I on scikit-learn's digits).

Two sites train models of the same architecture from different seeds on their own part of the
digits training set — once split homogeneously (IID), once with a heterogeneous label skew.
Site A then fuses its model with site B's by each method and reports test accuracy:

- ``model_a``, ``model_b``: each model alone;
- ``vanilla_averaging``: α·θ_A + (1−α)·θ_B with no alignment;
- ``prediction_ensemble``: α·p_A + (1−α)·p_B (both models at inference; not a single model);
- ``weight_matching``: Git Re-Basin weight matching on exact weights, then α-fusion;
- ``graph_matching``: non-private spectral graph matching (exact activations and weights);
- ``graph_matching_repair``: the same fusion, then REPAIR (``peer.ldp.repair``): every fused
  hidden unit's pre-activation mean and std reset to the α-interpolation of the endpoints',
  all measured by site A on its own training records (B's statistics from running the aligned
  model A received — post-processing);
- PrivFusion at ε_x = ε_w = ε_f = ε: B releases Laplace activations and multi-bit weight
  features (site A matches against them) and PFA-perturbed weights (site A fuses them), under
  the per-entry unit (``privfusion``, the paper's proofs) and the per-neuron unit
  (``privfusion_per_neuron``, the project's default).
  ``privfusion_repair`` / ``privfusion_per_neuron_repair``: the same fused models after REPAIR,
  B's statistics measured by A on its own records through B's *released* (noisy) weights.

The probe set is public: a slice of the digits training split that neither site trains on, with
each image's four one-pixel shifts (``probe_shifts``), so 128 public images give 640 probes.
Under the per-entry unit more probes cost no privacy and average the Laplace noise down; under
the per-neuron unit the activation row's L1 sensitivity grows with the probe count, so the same
probes make that release noisier — the table shows what each guarantee costs. The clip bounds
are public constants (``FusionConfig``), chosen before seeing any model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from peer.nn.data import load_dataset, split_homogeneous, split_label_skew
from peer.ldp.fusion import (ensemble_proba, fuse_arrays, hidden_sizes, permute_arrays, vanilla_average,
                         weight_matching)
from peer.nn.graph import extract_graph
from peer.ldp.matching import match_graphs
from peer.ldp.mechanisms import perturb_graph, perturb_model_weights
from peer.nn.architectures import accuracy, model_from_arrays, state_arrays, train_classifier
from peer.base.rng import make_randomness
from peer.ldp.repair import repair_fusion
from peer.nn.architectures import input_tensor
from peer.nn.tracing import derive_structure

ARCHITECTURES = {
    "mlp": {"kind": "mlp", "input_dim": 64, "hidden": [128, 128], "output_dim": 10, "activation": "relu"},
    "cnn": {"kind": "cnn", "input_shape": [1, 8, 8], "channels": [16, 32], "kernel_size": 3, "pool": [2, 2],
            "hidden": [128], "output_dim": 10, "activation": "relu"},
}
ALPHAS = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))
#: the paper's grid (1, 0.1, 0.01), and two larger ε that show where the released weights
#: start to carry signal
EPSILONS = (100.0, 10.0, 1.0, 0.1, 0.01)


@dataclass(frozen=True)
class FusionConfig:
    model: str = "mlp"
    #: overrides ARCHITECTURES[model] (e.g. a small network for tests)
    architecture: dict | None = None
    seed: int = 0
    probe_size: int = 128
    epochs: int = 40
    delta: float = 1e-5
    #: add each public probe image's four one-pixel shifts to the probe set
    probe_shifts: bool = True
    #: public clip range of post-ReLU activations (Laplace)
    activation_clip: tuple[float, float] = (0.0, 2.0)
    #: public bound multiplier: weight features are clipped to ±weight_bound_scale/sqrt(fan_in)
    weight_bound_scale: float = 2.0
    epsilons: tuple[float, ...] = EPSILONS
    alphas: tuple[float, ...] = ALPHAS
    label_skew: float = 0.8


@dataclass
class SplitResult:
    methods: dict[str, float] = field(default_factory=dict)
    privfusion: dict[str, float] = field(default_factory=dict)
    privfusion_per_neuron: dict[str, float] = field(default_factory=dict)
    privfusion_repair: dict[str, float] = field(default_factory=dict)
    privfusion_per_neuron_repair: dict[str, float] = field(default_factory=dict)
    alpha_sweep: dict[str, list[list[float]]] = field(default_factory=dict)
    permutation_agreement: dict[str, float] = field(default_factory=dict)


def public_probes(x: np.ndarray, shifts: bool) -> np.ndarray:
    """The probe set from public 8×8 images: the images and, if asked, their one-pixel shifts."""
    if not shifts:
        return x
    im = x.reshape(-1, 8, 8)
    out = [im] + [np.roll(im, s, axis=a) for a in (1, 2) for s in (1, -1)]
    return np.concatenate(out).reshape(-1, 64)


def _acc_of(arch, x, y):
    return lambda arrays: accuracy(arch, model_from_arrays(arch, arrays), x, y)


def _sweep(alphas, fn: Callable[[float], float]) -> list[list[float]]:
    return [[float(a), float(fn(a))] for a in alphas]


def _architecture(cfg: FusionConfig) -> dict:
    return cfg.architecture if cfg.architecture is not None else ARCHITECTURES[cfg.model]


def run_split(cfg: FusionConfig, split: str, progress: Callable[[str], None] = lambda s: None) -> SplitResult:
    arch = _architecture(cfg)
    ds = load_dataset("digits", seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(ds.y_train))
    probe_idx, train_idx = order[: cfg.probe_size], order[cfg.probe_size:]
    x_probe = public_probes(ds.x_train[probe_idx], cfg.probe_shifts)
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
    repaired = _repairer(arch, a, x_tr[parts[0]], ds.x_test, ds.y_test)
    res.alpha_sweep["graph_matching_repair"] = _sweep(cfg.alphas, lambda al: repaired(b_gm, al))

    for u, (unit, key) in enumerate((("entry", "privfusion"), ("neuron", "privfusion_per_neuron"))):
        for k, eps in enumerate(cfg.epsilons):
            progress(f"{split}: PrivFusion, per-{unit}, epsilon={eps:g}")
            randomness = make_randomness(_noise_seed(cfg, u, k))
            noisy_gb, _ = perturb_graph(gb, epsilon_x=eps, epsilon_w=eps,
                                        activation_clip=cfg.activation_clip,
                                        weight_bounds=_weight_bounds(arch, cfg), unit=unit, randomness=randomness)
            pm = match_graphs(ga, noisy_gb)
            # PFA with the mechanisms' public defaults: each neuron's incoming vector (+bias)
            # L2-clipped to 2, entries to ±4/sqrt(fan_in)
            noisy_b, _ = perturb_model_weights(arch, b, epsilon=eps, delta=cfg.delta, unit=unit,
                                               randomness=randomness.spawn())
            b_pf = permute_arrays(arch, noisy_b, pm.permutations)
            sweep = _sweep(cfg.alphas, lambda al: acc(fuse_arrays(a, b_pf, al)))
            res.alpha_sweep[f"{key}_eps{eps:g}"] = sweep
            getattr(res, key)[f"{eps:g}"] = dict(sweep)[0.5]
            if 0.5 in cfg.alphas:
                getattr(res, f"{key}_repair")[f"{eps:g}"] = repaired(b_pf, 0.5)
            res.permutation_agreement[f"{key}_eps{eps:g}"] = _agreement(pm.permutations, gm.permutations)

    for name in ("vanilla_averaging", "prediction_ensemble", "weight_matching", "graph_matching", "graph_matching_repair"):
        res.methods[name] = dict(res.alpha_sweep[name])[0.5]
    res.permutation_agreement["weight_matching"] = _agreement(wm.permutations, gm.permutations)
    return res


def _repairer(arch, a, x_own, x_test, y_test) -> Callable[[dict, float], float]:
    """Test accuracy of α·A + (1 − α)·B_aligned after REPAIR on A's own records ``x_own``."""
    model_a = model_from_arrays(arch, a)
    points = derive_structure(model_a, input_tensor(arch, x_own[:1]).shape[1:]).stat_points
    x = input_tensor(arch, x_own)

    def repaired(b_aligned: dict, alpha: float) -> float:
        if alpha in (0.0, 1.0):
            # an endpoint is its own interpolation: REPAIR would be the identity up to rounding
            return accuracy(arch, model_from_arrays(arch, fuse_arrays(a, b_aligned, alpha)), x_test, y_test)
        fused = model_from_arrays(arch, fuse_arrays(a, b_aligned, alpha))
        out = repair_fusion(fused, model_a, model_from_arrays(arch, b_aligned), points, alpha, x)
        return accuracy(arch, out, x_test, y_test)
    return repaired


def _noise_seed(cfg: FusionConfig, unit_index: int, epsilon_index: int) -> int:
    """The fixed (reported) noise seed of one PrivFusion run of the experiment."""
    return cfg.seed * 100_003 + 2 * epsilon_index + unit_index


def _agreement(p, q) -> float:
    """Fraction of hidden nodes that two alignments map the same way."""
    same = sum(int(np.sum(np.asarray(x) == np.asarray(y))) for x, y in zip(p, q))
    return same / sum(len(x) for x in p)


def _weight_bounds(arch, cfg: FusionConfig) -> dict[str, tuple[float, float]]:
    """Public per-layer weight-feature bounds ±scale/sqrt(fan_in), from the architecture only."""
    from peer.ldp.fusion import weight_layers_of
    from peer.nn.architectures import build_model

    model = build_model(arch)
    out = {}
    for layer in weight_layers_of(arch):
        w = getattr(model, layer.name).weight
        fan_in = int(np.prod(w.shape[1:]))
        c = cfg.weight_bound_scale / np.sqrt(fan_in)
        out[layer.name] = (-c, c)
    return out


def permutation_recovery(cfg: FusionConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """A trained model against a copy of itself with every hidden layer randomly permuted:
    the fraction of hidden nodes each matcher maps back correctly, and the accuracy of the
    α = 0.5 fusion of the model with its re-aligned copy (the original accuracy when exact).

    Non-private graph matching sees both exact graphs; PrivFusion sees the copy's released
    features (Laplace activations and multi-bit weights at ε) against its own exact graph."""
    arch = _architecture(cfg)
    ds = load_dataset("digits", seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed + 7)
    order = rng.permutation(len(ds.y_train))
    probe_idx, train_idx = order[: cfg.probe_size], order[cfg.probe_size:]
    progress(f"permutation recovery: training one {cfg.model.upper()}")
    model = train_classifier(arch, ds.x_train[train_idx], ds.y_train[train_idx], seed=cfg.seed + 11, epochs=cfg.epochs)
    a = state_arrays(model)
    perms = [rng.permutation(n) for n in hidden_sizes(arch)]
    b = permute_arrays(arch, a, perms)
    truth = [np.argsort(p) for p in perms]  # node i of the model is node truth[i] of the copy
    acc = _acc_of(arch, ds.x_test, ds.y_test)
    probe = public_probes(ds.x_train[probe_idx], cfg.probe_shifts)
    ga = extract_graph(arch, model, probe)
    gb = extract_graph(arch, model_from_arrays(arch, b), probe)
    out: dict[str, Any] = {"original_accuracy": acc(a)}
    exact = match_graphs(ga, gb)
    out["graph_matching"] = {"fraction_correct": _agreement(exact.permutations, truth),
                             "fused_accuracy": acc(fuse_arrays(a, permute_arrays(arch, b, exact.permutations), 0.5))}
    for u, unit in enumerate(("entry", "neuron")):
        for k, eps in enumerate(cfg.epsilons):
            progress(f"permutation recovery: per-{unit}, epsilon={eps:g}")
            noisy_gb, _ = perturb_graph(gb, epsilon_x=eps, epsilon_w=eps, activation_clip=cfg.activation_clip,
                                        weight_bounds=_weight_bounds(arch, cfg), unit=unit,
                                        randomness=make_randomness(_noise_seed(cfg, u, k) + 7919))
            pm = match_graphs(ga, noisy_gb)
            out[f"privfusion_{unit}_eps{eps:g}"] = {"fraction_correct": _agreement(pm.permutations, truth)}
    return out


def run(cfg: FusionConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for split in ("homogeneous", "heterogeneous"):
        out[split] = asdict(run_split(cfg, split, progress))
    out["permutation_recovery"] = permutation_recovery(cfg, progress)
    cfg_d = asdict(cfg)
    out["config"] = cfg_d
    return out
