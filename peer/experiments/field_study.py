"""The fusion paper's field study (Table IV) and its Fig. 5, on scikit-learn's breast-cancer set.

Two sites (A and B) each train the MLP ``ARCHITECTURE`` on their part of the training split;
a public slice of that split (``probe_size`` records, trained on by neither) is the probe set.
The settings (``SETTINGS``):

- ``iid``: a stratified IID split, both sites trained ``epochs`` epochs (the reference);
- ``underfit``: the IID split, site A trained ``underfit_epochs`` (10) epochs, B ``epochs`` (50);
- ``unbalanced``: the IID split, then 80% of class 0 (malignant) removed from A's records and
  70% of class 1 (benign) from B's (our reading of "80% of one class removed, and one model
  trained with 70% of the other class removed"); the test split keeps its natural prevalence;
- ``regions``: non-IID by a covariate that stands for the region: the sites' records sorted by
  ``mean texture`` (a feature, not the label), A below the median, B above.

Every setting reports, on the test split, the paper's Table IV metrics
(``peer.nn.metrics.classification_metrics``: accuracy, macro / weighted F1, recall and
precision, and AUROC) for A alone, B alone, the non-private fusion (exact graph matching,
α = ½) and its REPAIR, and PrivFusion (hybrid + PFA at ``epsilon`` per part, the digits
experiment's mechanisms and bounds: ``peer.experiments.private_rows.private_row``) under the per-entry
and the per-neuron unit, each with its permutation agreement, its records and its per-neuron
charge. The claim, as the design reads it: fusion improves on the site's own model (A) in each
setting; the verdict compares macro F1 (mean over seeds) and asks for an above-chance match.

Fig. 5 (:func:`plot_fig5`): the two sites' training records in the first two principal
components of the whole training split, IID against the region split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.extras import pyplot
from peer.experiments import fusion
from peer.experiments.private_rows import HYBRID_PFA, PARTS, UNITS, Endpoints, private_row
from peer.ldp.fusion import fuse_arrays, permute_arrays
from peer.ldp.matching import match_graphs
from peer.nn.architectures import model_from_arrays, predict_proba, state_arrays, train_classifier
from peer.nn.data import feature_names, load_dataset, remove_class, split_by_feature, split_homogeneous
from peer.nn.graph import extract_graph
from peer.nn.metrics import classification_metrics

ARCHITECTURE = {"kind": "mlp", "input_dim": 30, "hidden": [64, 64], "output_dim": 2, "activation": "relu"}
SETTINGS = ("iid", "underfit", "unbalanced", "regions")
#: the covariate of the region split (a column of scikit-learn's breast-cancer features)
REGION_FEATURE = "mean texture"
METRICS = (
    "accuracy",
    "macro_f1",
    "weighted_f1",
    "macro_recall",
    "weighted_recall",
    "macro_precision",
    "weighted_precision",
)
CLAIM = (
    "Table IV: in the field study's settings (underfitting, class imbalance, non-IID by region) the fused "
    "model does better than the site's own model"
)


@dataclass(frozen=True)
class FieldConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 50
    underfit_epochs: int = 10
    probe_size: int = 64
    epsilon: float = 1.0
    delta: float = 1e-5
    #: fraction of class 0 removed from A's records, of class 1 from B's (``unbalanced``)
    remove_a: float = 0.8
    remove_b: float = 0.7

    @classmethod
    def quick(cls) -> FieldConfig:
        return cls(seeds=(0,), epochs=20, underfit_epochs=5)


def _region_column() -> int:
    return feature_names("breast_cancer").index(REGION_FEATURE)


def site_parts(cfg: FieldConfig, setting: str, x: np.ndarray, y: np.ndarray, seed: int) -> list[np.ndarray]:
    """Indices of A's and B's records among the sites' training records (``x``, ``y``)."""
    if setting not in SETTINGS:
        raise InvalidArgument("setting", f"must be one of {SETTINGS}, got {setting!r}")
    if setting == "regions":
        return split_by_feature(x[:, _region_column()], 2)
    parts = split_homogeneous(y, 2, seed=seed)
    if setting != "unbalanced":
        return parts
    rng = np.random.default_rng(seed + 101)
    return [
        remove_class(part, y, label, fraction, rng)
        for part, label, fraction in ((parts[0], 0, cfg.remove_a), (parts[1], 1, cfg.remove_b))
    ]


def _data(seed: int, probe_size: int):
    ds = load_dataset("breast_cancer", seed=seed)
    order = np.random.default_rng(seed).permutation(len(ds.y_train))
    probe, rest = order[:probe_size], order[probe_size:]
    return ds, ds.x_train[probe], ds.x_train[rest], ds.y_train[rest]


def setting_endpoints(cfg: FieldConfig, setting: str, seed: int) -> tuple[Endpoints, dict]:
    """The two sites of one setting and seed, with every score a private row needs."""
    arch = ARCHITECTURE
    ds, x_probe, x_tr, y_tr = _data(seed, cfg.probe_size)
    parts = site_parts(cfg, setting, x_tr, y_tr, seed)
    epochs = (cfg.underfit_epochs if setting == "underfit" else cfg.epochs, cfg.epochs)
    models = [
        train_classifier(arch, x_tr[p], y_tr[p], seed=seed + 1 + i, epochs=e)
        for i, (p, e) in enumerate(zip(parts, epochs, strict=True))
    ]
    a, b = (state_arrays(m) for m in models)
    ga, gb = (extract_graph(arch, m, x_probe) for m in models)
    exact = match_graphs(ga, gb)
    classes = [0, 1]

    def metrics(arrays: Mapping[str, np.ndarray]) -> dict:
        return classification_metrics(
            ds.y_test, predict_proba(arch, model_from_arrays(arch, arrays), ds.x_test), classes
        )

    repair = fusion.repaired_fusion(arch, a, x_tr[parts[0]])

    def metrics_repaired(b_aligned, alpha) -> dict:
        return classification_metrics(ds.y_test, predict_proba(arch, repair(b_aligned, alpha), ds.x_test), classes)

    fcfg = fusion.FusionConfig(model="mlp", architecture=arch, seed=seed, probe_size=cfg.probe_size, probe_shifts=False)
    ep = Endpoints(
        seed,
        arch,
        fcfg,
        a,
        b,
        ga,
        gb,
        exact.permutations,
        lambda arrays: metrics(arrays)["accuracy"],
        lambda b_aligned, alpha: metrics_repaired(b_aligned, alpha)["accuracy"],
        metrics=metrics,
        metrics_repaired=metrics_repaired,
    )
    b_exact = permute_arrays(arch, b, exact.permutations)
    scores = {
        "model_a": metrics(a),
        "model_b": metrics(b),
        "non_private": metrics(fuse_arrays(a, b_exact, 0.5)),
        "non_private_repair": metrics_repaired(b_exact, 0.5),
    }
    sizes = {
        "records": [len(p) for p in parts],
        "class_counts": [np.bincount(y_tr[p], minlength=2).tolist() for p in parts],
        "epochs": list(epochs),
    }
    return ep, {"scores": scores, "sites": sizes}


def _mean(dicts: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for k in (*METRICS, "auroc"):
        v = np.array([d[k] for d in dicts if d.get(k) is not None], dtype=float)
        if len(v):
            out[k] = {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
    return out


def run(cfg: FieldConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every setting on every seed (JSON-ready); rows as in ``peer.experiments.paper``."""
    if not cfg.seeds:
        raise InvalidArgument("seeds", "at least one seed is needed")
    out: dict[str, Any] = {"config": {**asdict(cfg), "architecture": ARCHITECTURE, "region_feature": REGION_FEATURE}}
    out["claim"] = CLAIM
    settings = {}
    for k, setting in enumerate(SETTINGS):
        per_seed, rows = [], []
        for seed in cfg.seeds:
            progress(f"table IV, {setting}, seed {seed}")
            ep, info = setting_endpoints(cfg, setting, seed)
            per_seed.append({"seed": seed, **info})
            for u, unit in enumerate(UNITS):
                noise_seed = 1_000_003 * seed + 10_007 * (5 + k) + u
                row = private_row(ep, HYBRID_PFA, dict.fromkeys(PARTS, cfg.epsilon), unit, cfg.delta, noise_seed)
                rows.append({"name": f"privfusion_per_{unit}", **row})
        summary = {name: _mean([s["scores"][name] for s in per_seed]) for name in per_seed[0]["scores"]}
        for unit in UNITS:
            rs = [r for r in rows if r["unit"] == unit]
            summary[f"privfusion_per_{unit}"] = _mean([r["metrics"] for r in rs])
            summary[f"privfusion_per_{unit}_repair"] = _mean([r["metrics_repair"] for r in rs])
            summary[f"privfusion_per_{unit}"]["permutation_agreement"] = float(
                np.mean([r["permutation_agreement"] for r in rs])
            )
            summary[f"privfusion_per_{unit}"]["above_chance"] = all(r["above_chance"] for r in rs)
            summary[f"privfusion_per_{unit}"]["charged_per_neuron"] = rs[0]["charged"]["total"]
        settings[setting] = {"seeds": per_seed, "rows": rows, "summary": summary}
    out["settings"] = settings
    out["verdicts"] = verdicts(out)
    return out


def verdicts(result: dict) -> dict:
    """Per unit: in which of the three paper settings the private fusion's macro F1 beats A's
    alone with an above-chance match (reproduced if in all three); the non-private fusion's
    reading beside it (what the mechanisms cost)."""
    out: dict[str, Any] = {}
    paper_settings = [s for s in SETTINGS if s != "iid"]
    for unit in (*UNITS, "non_private"):
        key = f"privfusion_per_{unit}" if unit in UNITS else "non_private"
        held, why = [], []
        for s in paper_settings:
            sm = result["settings"][s]["summary"]
            own, fused = sm["model_a"]["macro_f1"]["mean"], sm[key]["macro_f1"]["mean"]
            ok = fused > own and (unit == "non_private" or sm[key]["above_chance"])
            held += [s] if ok else []
            why.append(f"{s} {100 * fused:.1f} vs own {100 * own:.1f}")
        out[unit] = {
            "reproduced": len(held) == len(paper_settings),
            "held_in": held,
            "why": "macro F1: " + "; ".join(why),
        }
    return out


_LABELS = {
    "model_a": "site A alone",
    "model_b": "site B alone",
    "non_private": "non-private fusion",
    "non_private_repair": "non-private fusion + REPAIR",
    "privfusion_per_entry": "PrivFusion per entry",
    "privfusion_per_entry_repair": "PrivFusion per entry + REPAIR",
    "privfusion_per_neuron": "PrivFusion per neuron",
    "privfusion_per_neuron_repair": "PrivFusion per neuron + REPAIR",
}


def markdown(result: dict) -> list[str]:
    """Table IV as Markdown lines (one table per setting), with the claim and the verdicts."""
    cfg = result["config"]
    lines = [
        "## Table IV: the field study on breast-cancer",
        "",
        f"MLP 30-{'-'.join(str(h) for h in cfg['architecture']['hidden'])}-2, fusion at α = ½, PrivFusion = hybrid + "
        f"PFA at ε = {cfg['epsilon']:g} per part (δ = {cfg['delta']:g}); seeds {', '.join(str(s) for s in cfg['seeds'])}; "
        f"metrics % on the test split (mean over seeds). Region = {cfg['region_feature']} below / above its median.",
        "",
        f"> {result['claim']}",
        "",
    ]
    for unit, v in result["verdicts"].items():
        word = "reproduced" if v["reproduced"] else "not reproduced"
        label = "non-private fusion (no mechanism; the ceiling)" if unit == "non_private" else f"per {unit}"
        lines.append(f"- {label}: **{word}** — {v['why']}")
    lines.append("")
    head = "| model | " + " | ".join(m.replace("_", " ") for m in METRICS) + " | AUROC | perm. agreement % |"
    for setting, data in result["settings"].items():
        site = data["seeds"][0]["sites"]
        lines += [
            f"### {setting}",
            "",
            f"Records A / B (seed {data['seeds'][0]['seed']}): {site['records'][0]} / {site['records'][1]}, "
            f"classes (0, 1) {tuple(site['class_counts'][0])} / {tuple(site['class_counts'][1])}, "
            f"epochs {site['epochs'][0]} / {site['epochs'][1]}.",
            "",
            head,
            "| --- " * (len(METRICS) + 3) + "|",
        ]
        for name, label in _LABELS.items():
            s = data["summary"][name]
            cells = [f"{100 * s[m]['mean']:.1f}" for m in METRICS]
            auroc = f"{100 * s['auroc']['mean']:.1f}" if "auroc" in s else "—"
            agree = ""
            base = data["summary"].get(name.removesuffix("_repair"), {})
            if "permutation_agreement" in base:
                agree = f"{100 * base['permutation_agreement']:.1f}" + ("" if base["above_chance"] else " (chance)")
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {auroc} | {agree} |")
        lines.append("")
    return lines


def plot_fig5(cfg: FieldConfig, path, seed: int | None = None) -> None:
    """Fig. 5: both sites' training records in the first two principal components of the sites'
    training split, IID (left) and by region (right)."""
    from sklearn.decomposition import PCA

    plt = pyplot("the paper experiment's figures")
    seed = cfg.seeds[0] if seed is None else seed
    _, _, x_tr, y_tr = _data(seed, cfg.probe_size)
    z = PCA(n_components=2, random_state=seed).fit_transform(x_tr)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharex=True, sharey=True)
    for ax, setting, title in zip(
        axes, ("iid", "regions"), ("IID", f"non-IID by region ({REGION_FEATURE})"), strict=True
    ):
        for part, (color, name) in zip(
            site_parts(cfg, setting, x_tr, y_tr, seed), (("tab:blue", "site A"), ("tab:orange", "site B")), strict=True
        ):
            ax.scatter(z[part, 0], z[part, 1], s=8, alpha=0.6, color=color, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("PC 1")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("PC 2")
    axes[0].legend(fontsize=8)
    fig.suptitle("Fig. 5: two sites' breast-cancer records (PCA of the training split)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


__all__ = [
    "ARCHITECTURE",
    "CLAIM",
    "METRICS",
    "SETTINGS",
    "FieldConfig",
    "markdown",
    "plot_fig5",
    "run",
    "site_parts",
    "verdicts",
]
