"""How much the PFA smoothing filter helps, on real trained weights.

Trains a digits MLP (64-128-128-10, Adam), releases its weights with
``peer.ldp.mechanisms.perturb_model_weights`` with and without the smoothing filter (same noise: same
seed), and reports, averaged over seeds:

- ``mse_raw`` / ``mse_filtered``: mean squared error of the released weights to the clean
  weights after the public clipping (what the noise was added to), and their ratio;
- ``acc_raw`` / ``acc_filtered``: test accuracy of the released model alone;
- ``fused_raw`` / ``fused_filtered``: test accuracy of α-fusion (α = 0.5) of the clean model
  with the released copy of itself — the identity alignment, so this isolates what the noise
  and the filter do to fusion.

    python benchmarks/pfa_filter.py [--epochs 30] [--seeds 3] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from peer.base.rng import make_randomness
from peer.ldp.mechanisms import clip_rows, perturb_model_weights
from peer.nn.architectures import accuracy, model_from_arrays, state_arrays, train_classifier, weight_layers
from peer.nn.data import load_dataset

ARCH = {"kind": "mlp", "input_dim": 64, "hidden": [128, 128], "output_dim": 10}
SETTINGS = [
    ("neuron", 10.0),
    ("neuron", 100.0),
    ("neuron", 1000.0),
    ("neuron", 3000.0),
    ("entry", 1.0),
    ("entry", 10.0),
    ("entry", 30.0),
    ("entry", 100.0),
    ("entry", 300.0),
]


def rows(arrays, spec):
    w, b = arrays[f"{spec.name}.weight"], arrays[f"{spec.name}.bias"]
    return np.concatenate([w.reshape(spec.units, -1), b[:, None]], axis=1).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    ds = load_dataset("digits")
    model = train_classifier(ARCH, ds.x_train, ds.y_train, seed=0, epochs=args.epochs)
    clean = state_arrays(model)
    specs = weight_layers(ARCH)
    results = {"clean_accuracy": accuracy(ARCH, model, ds.x_test, ds.y_test), "delta": args.delta, "rows": []}
    for unit, eps in SETTINGS:
        acc = {k: [] for k in ("mse_raw", "mse_filtered", "acc_raw", "acc_filtered", "fused_raw", "fused_filtered")}
        for seed in range(args.seeds):
            raw, rec = perturb_model_weights(
                ARCH, clean, epsilon=eps, delta=args.delta, unit=unit, smoothing=False, randomness=make_randomness(seed)
            )
            filt, _ = perturb_model_weights(
                ARCH, clean, epsilon=eps, delta=args.delta, unit=unit, smoothing=True, randomness=make_randomness(seed)
            )
            for name, released in (("raw", raw), ("filtered", filt)):
                err = []
                for spec, comp in zip(specs, rec.components, strict=True):
                    target = clip_rows(
                        rows(clean, spec),
                        clip_norm=comp.parameters["clip_norm"],
                        entry_bound=comp.parameters["entry_bound"],
                    )
                    err.append(((rows(released, spec) - target) ** 2).ravel())
                acc[f"mse_{name}"].append(float(np.mean(np.concatenate(err))))
                acc[f"acc_{name}"].append(accuracy(ARCH, model_from_arrays(ARCH, released), ds.x_test, ds.y_test))
                fused = {k: 0.5 * clean[k] + 0.5 * released[k] for k in clean}
                acc[f"fused_{name}"].append(accuracy(ARCH, model_from_arrays(ARCH, fused), ds.x_test, ds.y_test))
        row = {"unit": unit, "epsilon": eps, "noise_std_first_layer": rec.components[0].parameters["noise_std"]}
        row.update({k: float(np.mean(v)) for k, v in acc.items()})
        row["mse_ratio"] = row["mse_filtered"] / row["mse_raw"]
        results["rows"].append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"clean accuracy {results['clean_accuracy']:.3f}; delta {args.delta}; {args.seeds} seeds")
    print(
        f"{'unit':7} {'eps':>7} {'sigma0':>8} {'mse raw':>9} {'mse filt':>9} {'ratio':>7} "
        f"{'acc raw':>7} {'acc filt':>8} {'fused raw':>9} {'fused filt':>10}"
    )
    for r in results["rows"]:
        print(
            f"{r['unit']:7} {r['epsilon']:7g} {r['noise_std_first_layer']:8.4g} {r['mse_raw']:9.3g} "
            f"{r['mse_filtered']:9.3g} {r['mse_ratio']:7.4f} {r['acc_raw']:7.3f} {r['acc_filtered']:8.3f} "
            f"{r['fused_raw']:9.3f} {r['fused_filtered']:10.3f}"
        )


if __name__ == "__main__":
    main()
