"""The DP model-merging experiment: RS vs LC, PLD vs RDP (Yin, Zaheer & Li 2026, arXiv:2604.20985).

Every curve but two chooses π / λ from public information only (``peer.dp.accounting.targets``);
"rs_utility" / "lc_utility" score a public subset of the models (MSE in (a), validation accuracy
in (b)) and are charged the composition of that subset — what a measured choice costs.

LC is shown twice, side by side with RS: ``lc_composition``, the proven bound (θ_λ is a
post-processing of releasing every model with λ_i > 0, so it costs their composition — whatever
the training), and ``lc_surrogate``, the design's per-step Gaussian surrogate, which is a bound
only when every merged model declares state-independent gradients (``peer.dp.accounting.lc``). The
ledger charges the surrogate for (a) and the composition for (b); the JSON says which
(``lc_charged``) and whether the surrogate is valid.

(a) Gaussian mean estimation (state-independent gradients). n = 100 records x_i ∈ [0, 1]
    (clipped N(0.3, 0.2²), a fixed public seed), two full-batch DP-GD runs on the linear loss
    ℓ(θ; x) = −θ·x from the public θ_0 = 0 with different noise multipliers σ:
    θ ← θ − η(Σ_i clip_C(−x_i) + σ C z)/n = θ + η x̄ − ησCz/n. The clipped gradient −x_i
    (|x_i| ≤ 1 = C, never clipped) does not depend on θ, so the training records declare
    state-independent gradients and θ_λ is exactly one Gaussian mechanism: the surrogate is its
    bound (and tight), the composition a loose one. With η = 1/T, θ_T = x̄ + N(0, T(ησC/n)²).
    The estimand is the sample mean x̄ of the protected records; the error is MSE = E(θ − x̄)².
    Each model's output distribution is estimated by Monte Carlo with the real DP-SGD code
    (``peer.dp.training.run_dpsgd`` with R independent replicas) and checked against the closed form
    MSE = ((ηT − 1)x̄)² + T(ησC/n)²; the runs are independent, so for any weights
        RS  MSE(π) = Σ_i π_i MSE_i,
        LC  MSE(λ) = (Σ_i λ_i b_i)² + Σ_i λ_i² v_i        (b_i bias, v_i variance of model i),
    exact functions of the per-model Monte Carlo moments. For each target ε′ the weights
    maximise a public prior under the target by PLD and by RDP: −Σ π_i v_i (RS) and −Σ λ_i² v_i
    (LC) with v_i = T(ησC/n)² the closed-form variance (public: training record and n).

(b) Logistic regression on scikit-learn's digits: three full-batch DP-SGD models with different
    (C, σ) from one public initialisation, trained on the protected split (their gradients depend
    on their weights: no declaration); π/λ chosen by the public prior ``privacy_prior`` (each
    model's own ε), accuracy reported on the test split. Frontiers (test accuracy vs ε′) of RS, LC by composition
    (charged) and LC by the surrogate (not a bound here; shown for what it would have claimed), by
    PLD and RDP, against releasing models jointly (every subset, its composition ε; the receiver
    may then post-process to any combination, chosen on validation) — LC by composition is that
    frontier released as one model. The budget PLD saves at equal accuracy: for each release
    chosen under RDP, the same release (same π or λ, hence the same accuracy) certified by PLD,
    saving = 1 − ε_PLD/ε_RDP.

Accounting: ``peer.dp.accounting`` with value_discretization_interval 1e-3 (full-batch Gaussian
models are one Gaussian PLD each, so the discretisation error is of that order) and
dp-accounting's improved RDP conversion; the classical conversion (Mironov 2017, Prop. 3:
ε = min_order r_order + log(1/δ)/(order−1)) is reported beside it, since the saving PLD shows
depends on which conversion RDP is given.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from peer.base.errors import InvalidArgument
from peer.base.extras import pyplot, require
from peer.base.rng import make_randomness
from peer.dp.accounting import TrainingRecord, UnreachableTarget, choose_pi, privacy_profiles, rdp_to_epsilon
from peer.dp.accounting.accountant import Accountant
from peer.dp.accounting.conversions import pld_epsilon
from peer.dp.accounting.lc import lc_composition_epsilon, lc_composition_rdp, surrogate_is_bound
from peer.dp.accounting.pld import compose_plds
from peer.dp.accounting.rdp import rdp_mixture
from peer.dp.accounting.targets import (
    choose_lam_by_utility,
    choose_lam_composition,
    choose_lam_surrogate,
    choose_pi_by_utility,
    privacy_prior,
)
from peer.dp.merging import PoolModel, combine, merge_lc, merge_rs
from peer.dp.pools import load_splits
from peer.dp.training import run_dpsgd, train_pool
from peer.nn.architectures import accuracy, model_from_arrays, state_arrays, train_classifier

INTERVAL = 1e-3
#: the accountant every figure of the experiment is stated by (default orders, PLD grid INTERVAL)
ACCOUNTANT = Accountant(value_discretization_interval=INTERVAL)
FIGURES = ("pld", "rdp")
METHODS = ("rs", "lc_composition", "lc_surrogate", "rs_utility", "lc_utility")


@dataclass(frozen=True)
class Settings:
    delta: float = 1e-5
    seed: int = 0
    # (a) mean estimation
    mean_n: int = 100
    mean_steps: int = 10
    mean_learning_rate: float = 0.1  # = 1/mean_steps: θ_T is x̄ plus noise
    mean_clip: float = 1.0
    mean_noise: tuple[float, ...] = (3.0, 9.0)
    mean_replicas: int = 20_000
    mean_targets: int = 14
    # (b) digits
    digits_steps: int = 60
    digits_learning_rate: float = 4.0
    digits_models: tuple[tuple[float, float], ...] = (
        (2.0, 8.0),
        (1.0, 20.0),
        (0.5, 50.0),
    )  # (clip_norm, noise_multiplier)
    digits_targets: int = 10
    lc_candidates: int = 256
    joint_grid: int = 10
    #: (b) from a model pretrained on public data (``--pretrained``): the pool's models start from
    #: a non-private logistic regression trained on ``public_fraction`` of the training split,
    #: declared public (it never enters DP-SGD), for ``pretrain_epochs`` epochs of Adam
    pretrained: bool = False
    public_fraction: float = 0.3
    pretrain_epochs: int = 30

    @classmethod
    def quick(cls) -> Settings:
        """A reduced run for the default test suite (same code, smaller sizes)."""
        return cls(
            mean_replicas=2000, mean_targets=4, digits_steps=15, digits_targets=3, lc_candidates=30, joint_grid=3
        )


def classical_rdp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """Mironov 2017, Prop. 3: ε = min over orders of r_order + log(1/δ)/(order − 1)."""
    o = np.asarray(orders, dtype=np.float64)
    return float(np.min(np.asarray(rdp) + math.log(1 / delta) / (o - 1)))


def _targets(lo: float, hi: float, count: int) -> list[float]:
    return [float(v) for v in np.geomspace(lo, hi, count)]


def _frontiers(
    profiles,
    trainings,
    targets,
    delta,
    key,
    *,
    rs_prior,
    lc_prior,
    rs_value,
    lc_value,
    rs_score,
    lc_score,
    lc_candidates=2000,
) -> dict:
    """For each target and ε figure (PLD, RDP): π chosen by the public ``rs_prior`` (linear), λ by the
    public ``lc_prior`` (per-model numbers or a public function of λ) under the composition bound
    and under the per-step surrogate; and the charged utility selections ("rs_utility",
    "lc_utility": the public subset scored by ``rs_score(i)`` / ``lc_score(λ)``, charged its
    composition). Each row carries ``key`` = rs_value(π) / lc_value(λ). Unreachable targets are
    left out of that curve."""
    curves: dict[str, dict[str, list]] = {m: {a: [] for a in FIGURES} for m in METHODS}
    choosers = {"lc_composition": choose_lam_composition, "lc_surrogate": choose_lam_surrogate}
    linear_prior = rs_prior
    for target in targets:
        for figure in FIGURES:
            try:
                rs = choose_pi(profiles, rs_prior, target, delta, figure=figure, accountant=ACCOUNTANT)
                curves["rs"][figure].append(_choice_row(rs, key, rs_value(np.asarray(rs.weights))))
            except UnreachableTarget:
                pass
            for method, choose in choosers.items():
                try:
                    lc = choose(
                        trainings,
                        lc_prior,
                        target,
                        delta,
                        figure=figure,
                        accountant=ACCOUNTANT,
                        max_points=lc_candidates,
                    )
                    curves[method][figure].append(_choice_row(lc, key, lc_value(np.asarray(lc.weights))))
                except UnreachableTarget:
                    pass
            try:
                rs = choose_pi_by_utility(
                    profiles,
                    rs_score,
                    target,
                    delta,
                    prior=linear_prior,
                    figure=figure,
                    accountant=ACCOUNTANT,
                )
                curves["rs_utility"][figure].append(_choice_row(rs, key, rs_value(np.asarray(rs.weights))))
                lc = choose_lam_by_utility(
                    trainings,
                    lc_score,
                    target,
                    delta,
                    prior=linear_prior,
                    figure=figure,
                    accountant=ACCOUNTANT,
                    max_points=lc_candidates,
                )
                curves["lc_utility"][figure].append(_choice_row(lc, key, lc_value(np.asarray(lc.weights))))
            except UnreachableTarget:
                pass
    return curves


def _lc_labels(trainings) -> dict:
    """Which LC curve the ledger would charge, and whether the surrogate is a bound here."""
    valid = surrogate_is_bound(trainings)
    return {"lc_charged": "lc_surrogate" if valid else "lc_composition", "surrogate_valid": valid}


def _choice_row(choice, value_name: str, value: float) -> dict:
    row = {
        "target_epsilon": choice.target_epsilon,
        "weights": list(choice.weights),
        "epsilon": choice.epsilon.to_dict(),
        "saturated": choice.saturated,
        value_name: value,
    }
    if choice.selection is not None and choice.selection.get("kind") == "utility":
        row["scored"] = list(choice.selection["scored"])
    return row


# ------------------------------------------------------------------------------------ (a)


def mean_estimation(s: Settings) -> dict:
    rng = np.random.default_rng(s.seed)
    data = np.clip(rng.normal(0.3, 0.2, size=(s.mean_n, 1)), 0.0, 1.0)
    x = torch.as_tensor(data, dtype=torch.float32)
    y = torch.zeros(s.mean_n, dtype=torch.long)
    x_bar = float(x.double().mean())

    def linear_loss(params, x_i, y_i):
        # gradient −x_i: a function of the record alone (state-independent), |x_i| ≤ 1 = C
        return -(params["mean"] * x_i).sum()

    trainings = [
        TrainingRecord.constant(
            "replace-one", s.mean_steps, s.mean_learning_rate, s.mean_clip, sigma, state_independent_gradients=True
        )
        for sigma in s.mean_noise
    ]
    randomness = make_randomness(s.seed)
    bias, var, mse, closed = [], [], [], []
    for t in trainings:
        run = run_dpsgd(
            linear_loss,
            {"mean": torch.zeros(1)},
            x,
            y,
            t.steps,
            randomness=randomness.spawn(),
            replicas=s.mean_replicas,
        )
        err = run.params["mean"].double().numpy()[:, 0] - x_bar
        bias.append(float(err.mean()))
        var.append(float(err.var()))
        mse.append(float(np.mean(err**2)))
        eta, sigma, steps = s.mean_learning_rate, t.steps[0].noise_multiplier, s.mean_steps
        closed.append(((eta * steps - 1) * x_bar) ** 2 + steps * (eta * sigma * s.mean_clip / s.mean_n) ** 2)
    bias_a, var_a = np.array(bias), np.array(var)

    def lc_mse(lam: np.ndarray) -> float:
        return float((lam @ bias_a) ** 2 + (lam**2) @ var_a)

    profiles = privacy_profiles(trainings, accountant=ACCOUNTANT)
    singles = [p.epsilon(s.delta) for p in profiles]
    targets = _targets(min(e.pld for e in singles) * 1.001, max(e.rdp for e in singles) * 1.15, s.mean_targets)
    # the public prior: the closed-form variance of each model's error, T(ησC/n)² (η = 1/T: no
    # bias), a function of the training records and the public n alone; never the Monte Carlo MSE
    public_var = np.array(closed)

    curves = _frontiers(
        profiles,
        trainings,
        targets,
        s.delta,
        "mse",
        rs_prior=[-v for v in public_var],
        lc_prior=lambda lam: -float((np.asarray(lam) ** 2) @ public_var),
        rs_value=lambda pi: float(np.dot(pi, mse)),
        lc_value=lambda lam: lc_mse(np.asarray(lam)),
        rs_score=lambda i: -mse[i],
        lc_score=lambda lam: -lc_mse(np.asarray(lam)),
    )
    return {
        "n": s.mean_n,
        "estimand": "sample mean of the protected records; MSE = E(theta - mean)^2",
        "loss": "linear, l(theta; x) = -theta * x: clipped gradient -x_i independent of theta (declared state-independent)",
        "mse_method": f"Monte Carlo over {s.mean_replicas} independent DP-GD runs per model (real training code); "
        "RS and LC MSE exact functions of the per-model moments",
        **_lc_labels(trainings),
        "models": [
            {
                "noise_multiplier": t.steps[0].noise_multiplier,
                "clip_norm": s.mean_clip,
                "learning_rate": s.mean_learning_rate,
                "steps": s.mean_steps,
                "epsilon": e.to_dict(),
                "mse": m,
                "mse_closed_form": c,
                "bias": b,
                "variance": v,
                "mse_standard_error": float(np.sqrt(2.0 / s.mean_replicas) * m),
                "max_gradient_norm": float(np.max(np.abs(data))),
            }
            for t, e, m, c, b, v in zip(trainings, singles, mse, closed, bias, var, strict=True)
        ],
        "curves": curves,
        "findings": _mean_findings(curves),
    }


def _paired(curve_a: list[dict], curve_b: list[dict], key: str) -> list[tuple[float, float, float]]:
    b = {round(r["target_epsilon"], 12): r[key] for r in curve_b}
    return [
        (r["target_epsilon"], r[key], b[round(r["target_epsilon"], 12)])
        for r in curve_a
        if round(r["target_epsilon"], 12) in b
    ]


def _mean_findings(curves: dict) -> dict:
    """(a) with state-independent gradients the surrogate is the charged bound: LC by it against RS,
    and against LC by composition (what LC would cost without the declaration)."""
    lc_vs_rs = _paired(curves["lc_surrogate"]["pld"], curves["rs"]["pld"], "mse")
    surrogate_vs_composition = _paired(curves["lc_surrogate"]["pld"], curves["lc_composition"]["pld"], "mse")
    pld_vs_rdp = [
        (t, a, b) for method in METHODS for t, a, b in _paired(curves[method]["pld"], curves[method]["rdp"], "mse")
    ]
    return {
        "lc_dominates_rs": all(lc <= rs * (1 + 1e-9) for _, lc, rs in lc_vs_rs),
        "lc_over_rs_mse": [{"target_epsilon": t, "ratio": lc / rs} for t, lc, rs in lc_vs_rs],
        "surrogate_over_composition_mse": [
            {"target_epsilon": t, "ratio": a / b} for t, a, b in surrogate_vs_composition
        ],
        "pld_no_worse_than_rdp": all(p <= r * (1 + 1e-9) for _, p, r in pld_vs_rdp),
        "pld_over_rdp_mse": [{"target_epsilon": t, "ratio": p / r} for t, p, r in pld_vs_rdp],
    }


def _digits_findings(curves: dict, trainings, delta: float) -> dict:
    """(b) where LC by composition (the charged, proven bound) beats RS at the same target, and how
    far the surrogate understates the cost of the releases it would have chosen."""
    lc_vs_rs = _paired(curves["lc_composition"]["pld"], curves["rs"]["pld"], "test_accuracy")
    understated = []
    for r in curves["lc_surrogate"]["pld"]:
        proven = lc_composition_epsilon(trainings, r["weights"], delta, accountant=ACCOUNTANT).pld
        understated.append(
            {
                "target_epsilon": r["target_epsilon"],
                "weights": r["weights"],
                "surrogate_epsilon": r["epsilon"]["pld"],
                "proven_epsilon": proven,
            }
        )
    return {
        "lc_minus_rs_test_accuracy": [{"target_epsilon": t, "difference": lc - rs} for t, lc, rs in lc_vs_rs],
        "lc_beats_rs_at": [t for t, lc, rs in lc_vs_rs if lc > rs + 1e-12],
        "surrogate_releases_proven_cost": understated,
    }


# ------------------------------------------------------------------------------------ (b)


def _public_pretraining(s: Settings, arch: dict, x: np.ndarray, y: np.ndarray):
    """Split the training records into a public part (``s.public_fraction``, a seeded draw,
    declared public) and the protected rest, and pretrain ``arch`` on the public part without
    privacy: free, since it touches no protected record. Returns (init arrays, protected x, y,
    public x, y)."""
    if not 0 < s.public_fraction < 1:
        raise InvalidArgument("public_fraction", f"must be in (0, 1), got {s.public_fraction!r}")
    order = np.random.default_rng(s.seed + 17).permutation(len(y))
    k = round(s.public_fraction * len(y))
    pub, prot = np.sort(order[:k]), np.sort(order[k:])
    model = train_classifier(arch, x[pub], y[pub], seed=s.seed, epochs=s.pretrain_epochs)
    return state_arrays(model), x[prot], y[prot], x[pub], y[pub]


def digits_logreg(s: Settings) -> dict:
    splits = load_splits("digits", split_seed=s.seed)
    arch = {"kind": "mlp", "input_dim": 64, "hidden": [], "output_dim": 10}
    trainings = [
        TrainingRecord.constant("replace-one", s.digits_steps, s.digits_learning_rate, c, sigma)
        for c, sigma in s.digits_models
    ]
    x_protected, y_protected, init, pretraining = splits.x_train, splits.y_train, None, None
    if s.pretrained:
        init, x_protected, y_protected, x_pub, y_pub = _public_pretraining(s, arch, splits.x_train, splits.y_train)
    trained = train_pool(
        arch,
        x_protected,
        y_protected,
        trainings,
        init_seed=s.seed,
        randomness=make_randomness(s.seed),
        delta=s.delta,
        init=init,
        init_description=(
            f"non-private logistic regression pretrained on {len(splits.y_train) - len(y_protected)} "
            "public digits records (Adam)"
            if s.pretrained
            else ""
        ),
    )
    arrays = [m.arrays for m in trained]

    def acc_of(weights, x, yy):
        return accuracy(arch, model_from_arrays(arch, weights), x, yy)

    if s.pretrained:
        pretraining = {
            "public_records": len(splits.y_train) - len(y_protected),
            "protected_records": len(y_protected),
            "epochs": s.pretrain_epochs,
            "public_train_accuracy": acc_of(init, x_pub, y_pub),
            "validation_accuracy": acc_of(init, splits.x_val, splits.y_val),
            "test_accuracy": acc_of(init, splits.x_test, splits.y_test),
            "initialisation": trained[0].record.parameters["initialisation"],
        }

    val = [acc_of(a, splits.x_val, splits.y_val) for a in arrays]
    test = [acc_of(a, splits.x_test, splits.y_test) for a in arrays]
    profiles = privacy_profiles(trainings, accountant=ACCOUNTANT)
    singles = [p.epsilon(s.delta) for p in profiles]

    lo = min(e.pld for e in singles) * 1.001
    targets = _targets(lo, max(e.rdp for e in singles) * 1.1, s.digits_targets)
    curves = _frontiers(
        profiles,
        trainings,
        targets,
        s.delta,
        "test_accuracy",
        rs_prior=privacy_prior(profiles, s.delta, accountant=ACCOUNTANT),
        lc_prior=privacy_prior(profiles, s.delta, accountant=ACCOUNTANT),
        rs_value=lambda pi: float(np.dot(pi, test)),
        lc_value=lambda lam: acc_of(combine(arrays, lam), splits.x_test, splits.y_test),
        rs_score=lambda i: val[i],
        lc_score=lambda lam: acc_of(combine(arrays, lam), splits.x_val, splits.y_val),
        lc_candidates=s.lc_candidates,
    )

    joint = _joint_releases(
        profiles,
        arrays,
        lambda w: acc_of(w, splits.x_val, splits.y_val),
        lambda w: acc_of(w, splits.x_test, splits.y_test),
        s,
    )
    # One real release of each kind through peer.dp.merging (records as a peer would send them).
    pool = [
        PoolModel(f"dpsgd-{i}", arch, a, t, m.dataset_size)
        for i, (a, t, m) in enumerate(zip(arrays, trainings, trained, strict=True))
    ]
    example_target = float(np.sqrt(lo * max(e.pld for e in singles)))
    rs_release = merge_rs(pool, example_target, s.delta, randomness=make_randomness(s.seed))
    lc_release = merge_lc(pool, example_target, s.delta, candidates=s.lc_candidates)
    out = {
        "dataset": "digits",
        "architecture": arch,
        "split": splits.description,
        "sizes": {"protected_train": len(y_protected), "validation": len(splits.x_val), "test": len(splits.x_test)},
        "models": [
            {
                "clip_norm": c,
                "noise_multiplier": sigma,
                "learning_rate": s.digits_learning_rate,
                "steps": s.digits_steps,
                "epsilon": e.to_dict(),
                "validation_accuracy": v,
                "test_accuracy": t,
            }
            for (c, sigma), e, v, t in zip(s.digits_models, singles, val, test, strict=True)
        ],
        **_lc_labels(trainings),
        "curves": curves,
        "findings": _digits_findings(curves, trainings, s.delta),
        "joint": joint,
        "pld_savings": _savings(curves, profiles, trainings, s.delta),
        "example_releases": {
            "target_epsilon": example_target,
            "rs": {
                "record": rs_release.record.to_dict(),
                "expected_test_accuracy": float(np.dot(rs_release.choice.weights, test)),
            },
            "lc": {
                "record": lc_release.record.to_dict(),
                "test_accuracy": acc_of(lc_release.arrays, splits.x_test, splits.y_test),
            },
        },
    }
    if pretraining is not None:
        out["pretraining"] = pretraining
        out["findings"]["against_every_input"] = _against_inputs(curves, test, pretraining["test_accuracy"])
    return out


def _against_inputs(curves: dict, test: Sequence[float], pretrained: float) -> dict:
    """(b) pretrained: every merge of the public-prior and utility curves (PLD and RDP) against
    every input model's test accuracy and the pretrained model's (free: it may be released at
    ε = 0). RS's expected accuracy Σ π_i acc_i can never exceed the best input's; LC's can."""
    best = max(test)
    out: dict[str, Any] = {"best_input_test_accuracy": best, "pretrained_test_accuracy": pretrained}
    for method in METHODS:
        rows = [
            {
                "figure": figure,
                "target_epsilon": r["target_epsilon"],
                "test_accuracy": r["test_accuracy"],
                "minus_best_input": r["test_accuracy"] - best,
                "beats_every_input": r["test_accuracy"] > best + 1e-12,
                "beats_pretrained": r["test_accuracy"] > pretrained + 1e-12,
            }
            for figure in FIGURES
            for r in curves[method][figure]
        ]
        out[method] = {
            "rows": rows,
            "beats_every_input_at": [r["target_epsilon"] for r in rows if r["beats_every_input"]],
        }
    return out


def _joint_releases(profiles, arrays, val_of, test_of, s: Settings) -> list[dict]:
    """Release every model of a subset together: ε of the composition (PLD by FFT, RDP summed);
    the receiver may post-process to any combination of them, chosen on validation."""
    rows = []
    k = len(profiles)
    orders = profiles[0].orders
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            pld = compose_plds([profiles[i].pld for i in subset], INTERVAL)
            rdp = np.sum([profiles[i].rdp for i in subset], axis=0)
            best_val, best_w = -1.0, None
            for w in _grid(size, s.joint_grid):
                lam = np.zeros(k)
                lam[list(subset)] = w
                v = val_of(combine(arrays, lam))
                if v > best_val:
                    best_val, best_w = v, lam
            rows.append(
                {
                    "models": list(subset),
                    "epsilon": {"pld": pld_epsilon(pld, s.delta), "rdp": rdp_to_epsilon(orders, rdp, s.delta)},
                    "post_processing_weights": best_w.tolist(),
                    "validation_accuracy": best_val,
                    "test_accuracy": test_of(combine(arrays, best_w)),
                }
            )
    return rows


def _grid(k: int, m: int) -> list[np.ndarray]:
    return [np.bincount(c, minlength=k) / m for c in itertools.combinations_with_replacement(range(k), m)]


def _savings(curves: dict, profiles, trainings, delta: float) -> dict:
    """For every release chosen under RDP: the same release certified by PLD (same weights, same
    accuracy), saving = 1 − ε_PLD/ε_RDP; and against the classical RDP conversion. "lc" is LC
    under its charged bound (the composition: these models declare nothing)."""
    out = {}
    orders = profiles[0].orders
    for method, curve in (("rs", "rs"), ("lc", "lc_composition")):
        rows = []
        for r in curves[curve]["rdp"]:
            w = np.asarray(r["weights"])
            if method == "lc":
                rdp_curve = lc_composition_rdp(trainings, w, accountant=profiles[0].accountant)
            else:
                rdp_curve = rdp_mixture(w, [p.rdp for p in profiles], orders)
            e_pld, e_rdp = r["epsilon"]["pld"], r["epsilon"]["rdp"]
            e_classical = classical_rdp_epsilon(orders, rdp_curve, delta)
            rows.append(
                {
                    "weights": list(w),
                    "accuracy": r["test_accuracy"],
                    "epsilon_pld": e_pld,
                    "epsilon_rdp": e_rdp,
                    "epsilon_rdp_classical": e_classical,
                    "saving": 1 - e_pld / e_rdp,
                    "saving_vs_classical": 1 - e_pld / e_classical,
                }
            )
        savings = [r["saving"] for r in rows]
        classical = [r["saving_vs_classical"] for r in rows]
        out[method] = {
            "releases": rows,
            "saving_mean": float(np.mean(savings)) if rows else None,
            "saving_range": [float(np.min(savings)), float(np.max(savings))] if rows else None,
            "saving_vs_classical_mean": float(np.mean(classical)) if rows else None,
            "saving_vs_classical_range": [float(np.min(classical)), float(np.max(classical))] if rows else None,
        }
    return out


# ------------------------------------------------------------------------------ figures and tables


STYLES = {
    ("rs", "pld"): ("tab:blue", "-"),
    ("rs", "rdp"): ("tab:blue", "--"),
    ("lc_composition", "pld"): ("tab:orange", "-"),
    ("lc_composition", "rdp"): ("tab:orange", "--"),
    ("lc_surrogate", "pld"): ("tab:red", ":"),
    ("lc_surrogate", "rdp"): ("tab:red", "-."),
    ("rs_utility", "pld"): ("tab:green", "-"),
    ("lc_utility", "pld"): ("tab:purple", "-"),
}


def _method_label(method: str, result: dict) -> str:
    if method == "rs":
        return "RS"
    if method == "rs_utility":
        return "RS, utility selection (charged: scored subset)"
    if method == "lc_utility":
        return "LC, utility selection (charged: scored subset)"
    if method == "lc_composition":
        return "LC, composition (proven)"
    return "LC, surrogate (" + ("proven here" if result["surrogate_valid"] else "NOT a bound here") + ")"


def _figure(result: dict, key: str, model_label, delta: float):
    """A figure with the RS/LC × PLD/RDP curves of ``key`` against the target ε′ and the single
    models as triangles at their PLD ε. Returns (plt, fig, ax)."""
    plt = pyplot("the merging experiment's figures")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (method, acc), (color, ls) in STYLES.items():
        rows = result["curves"][method][acc]
        if rows:
            ax.plot(
                [r["target_epsilon"] for r in rows],
                [r[key] for r in rows],
                ls,
                color=color,
                marker="o",
                ms=3,
                label=f"{_method_label(method, result)} ({acc.upper()})",
            )
    for m in result["models"]:
        ax.plot([m["epsilon"]["pld"]], [m[key]], "k^", ms=7)
        ax.annotate(
            model_label(m), (m["epsilon"]["pld"], m[key]), textcoords="offset points", xytext=(5, 4), fontsize=8
        )
    ax.set_xlabel(f"target ε′ (δ′ = {delta:g})")
    ax.grid(True, which="both", alpha=0.3)
    return plt, fig, ax


def _finish(plt, fig, ax, path, **legend) -> None:
    ax.legend(title="▲ single models (PLD ε)", fontsize=8, title_fontsize=8, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_mean_estimation(result: dict, path, delta: float) -> None:
    plt, fig, ax = _figure(result, "mse", lambda m: f"σ = {m['noise_multiplier']:g}", delta)
    ax.set_yscale("log")
    ax.set_ylabel("MSE of the released estimate")
    ax.set_title(f"(a) Gaussian mean estimation, n = {result['n']}: RS vs LC, PLD vs RDP", fontsize=10)
    _finish(plt, fig, ax, path)


def plot_digits(result: dict, path, delta: float) -> None:
    plt, fig, ax = _figure(
        result, "test_accuracy", lambda m: f"C={m['clip_norm']:g}, σ={m['noise_multiplier']:g}", delta
    )
    for acc, ls in (("pld", "-"), ("rdp", "--")):
        xs, ys = _joint_frontier(result["joint"], acc)
        ax.step(xs, ys, ls, where="post", color="tab:gray", label=f"joint release ({acc.upper()})")
    ax.set_xscale("log")
    ticker = require("matplotlib.ticker", "plots", "the merging experiment's figures")
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xticks([t for t in (0.5, 1, 2, 3, 5, 7, 10, 15, 20, 30) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]])
    ax.set_ylabel("test accuracy")
    ax.set_title("(b) digits, logistic regression: accuracy vs ε")
    _finish(plt, fig, ax, path, loc="lower right")


def _joint_frontier(joint: list[dict], acc: str) -> tuple[list[float], list[float]]:
    """Best test accuracy of a joint release within each ε (a step function)."""
    rows = sorted(joint, key=lambda r: r["epsilon"][acc])
    xs, ys, best = [], [], -1.0
    for r in rows:
        if r["test_accuracy"] > best:
            best = r["test_accuracy"]
            xs.append(r["epsilon"][acc])
            ys.append(best)
    if xs:
        xs.append(xs[-1] * 1.3)
        ys.append(ys[-1])
    return xs, ys


COLUMNS = (
    ("rs", "pld"),
    ("rs", "rdp"),
    ("lc_composition", "pld"),
    ("lc_composition", "rdp"),
    ("lc_surrogate", "pld"),
    ("lc_surrogate", "rdp"),
    ("rs_utility", "pld"),
    ("lc_utility", "pld"),
)
TABLE_HEAD = [
    "| target ε′ | RS (PLD) | RS (RDP) | LC composition (PLD) | LC composition (RDP) | LC surrogate (PLD) | LC surrogate (RDP) "
    "| RS utility sel. (PLD) | LC utility sel. (PLD) |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]


def markdown(result: dict) -> str:
    a, b = result["mean_estimation"], result["digits"]
    lines = [
        "# DP model merging: RS vs LC, PLD vs RDP",
        "",
        f"δ′ = {result['settings']['delta']:g}; seed {result['settings']['seed']}.",
        "",
        (
            "LC is shown under two accountings. *Composition*: θ_λ is a post-processing of releasing every model with "
            "λ_i > 0, so it costs their composition — proven for any training, and what the ledger charges unless "
            "every merged model declares state-independent gradients. *Surrogate*: the per-step Gaussian surrogate "
            "(noise sqrt(Σ(λ_i η_i σ_i C_i)²), sensitivity 2Σλ_i η_i C_i per step), a bound only for state-independent "
            "gradients; for networks it can understate the cost several-fold."
        ),
        "",
        (
            "Selection. RS, LC composition and LC surrogate choose π / λ from a *public prior* only — (a) each "
            "model's closed-form error variance T(ησC/n)², (b) each model's own ε — never from a measured score of "
            "a model that is not released (that would leak the training records). The *utility selection* "
            "columns score a public subset of the models (the subsets whose composition meets the target, the "
            "largest total prior) on the validation split and release the best, charged the composition of the "
            "whole scored subset."
        ),
        "",
        f"## (a) Gaussian mean estimation (n = {a['n']}; gradients state-independent: the surrogate is the charged bound)",
        "",
        a["mse_method"] + ".",
        "",
        "| model σ | ε (PLD) | ε (RDP) | MSE (Monte Carlo) | MSE (closed form) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in a["models"]:
        lines.append(
            f"| {m['noise_multiplier']:g} | {m['epsilon']['pld']:.3f} | {m['epsilon']['rdp']:.3f} | {m['mse']:.3e} | {m['mse_closed_form']:.3e} |"
        )
    lines += ["", *TABLE_HEAD]
    lines += _table_by_target(a["curves"], "mse", "{:.3e}")
    f = a["findings"]
    ratios = [r["ratio"] for r in f["surrogate_over_composition_mse"]]
    lines += [
        "",
        f"LC (surrogate, valid here) dominates RS: **{f['lc_dominates_rs']}**; PLD no worse than RDP: "
        f"**{f['pld_no_worse_than_rdp']}**. Here LC pays off: θ_λ is one Gaussian mechanism, averaging the "
        "models' noise"
        + (
            f"; charged by composition instead, its MSE would be {1 / min(ratios):.2f}× to "
            f"{1 / max(ratios):.2f}× the surrogate's."
            if ratios
            else "."
        ),
        "",
        "## (b) digits, logistic regression (gradients depend on the weights: LC is charged by composition)",
        "",
    ]
    pre = b.get("pretraining")
    if pre is not None:
        lines += [
            f"Pretrained (`--pretrained`): every model starts from a non-private logistic regression trained on "
            f"{pre['public_records']} training records declared public ({pre['epochs']} epochs of Adam; free: it "
            f"touches no protected record); DP-SGD then runs on the other {pre['protected_records']}. The pretrained "
            f"model alone: validation {pre['validation_accuracy']:.3f}, test {pre['test_accuracy']:.3f}.",
            "",
        ]
    lines += [
        "| C | σ | ε (PLD) | ε (RDP) | validation acc. | test acc. |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in b["models"]:
        lines.append(
            f"| {m['clip_norm']:g} | {m['noise_multiplier']:g} | {m['epsilon']['pld']:.3f} | {m['epsilon']['rdp']:.3f} | {m['validation_accuracy']:.3f} | {m['test_accuracy']:.3f} |"
        )
    lines += [
        "",
        (
            "Test accuracy at each target (RS: expected accuracy Σ π_i acc_i; LC surrogate: NOT a valid release "
            "here, shown for what it would have claimed):"
        ),
        "",
        *TABLE_HEAD,
    ]
    lines += _table_by_target(b["curves"], "test_accuracy", "{:.3f}")
    fb = b["findings"]
    beats = fb["lc_beats_rs_at"]
    lines += [
        "",
        (
            "LC by composition beats RS at ε′ = " + ", ".join(f"{t:.3f}" for t in beats) + ": there a measured "
            "combination of the models that fit the budget together is more accurate than any mixture RS may draw from."
            if beats
            else "LC by composition never beats RS here: what fits the budget together is no more "
            "accurate than what RS may draw."
        ),
        "",
        "Releases the surrogate would have chosen, and what they really cost (proven ε, PLD):",
        "",
        "| target ε′ | weights | surrogate ε | proven ε |",
        "| --- | --- | --- | --- |",
    ]
    for r in fb["surrogate_releases_proven_cost"]:
        lines.append(
            f"| {r['target_epsilon']:.3f} | {', '.join(f'{w:.2f}' for w in r['weights'])} | {r['surrogate_epsilon']:.3f} | {r['proven_epsilon']:.3f} |"
        )
    if "against_every_input" in fb:
        ag = fb["against_every_input"]
        lines += [
            "",
            f"Against every input model (best input test accuracy {ag['best_input_test_accuracy']:.3f}; the "
            f"pretrained model alone {ag['pretrained_test_accuracy']:.3f}). RS's expected accuracy can never exceed the "
            "best input's; LC's can:",
            "",
            "| method | releases (PLD and RDP curves) | beat every input | beat the pretrained model | best − best input |",
            "| --- | --- | --- | --- | --- |",
        ]
        for method in METHODS:
            rows = ag[method]["rows"]
            if rows:
                lines.append(
                    f"| {method} | {len(rows)} | {sum(r['beats_every_input'] for r in rows)} | "
                    f"{sum(r['beats_pretrained'] for r in rows)} | {max(r['minus_best_input'] for r in rows):+.3f} |"
                )
    lines += [
        "",
        "Joint release of a subset (composition), best post-processing chosen on validation:",
        "",
        "| models | ε (PLD) | ε (RDP) | test acc. |",
        "| --- | --- | --- | --- |",
    ]
    for r in b["joint"]:
        lines.append(
            f"| {r['models']} | {r['epsilon']['pld']:.3f} | {r['epsilon']['rdp']:.3f} | {r['test_accuracy']:.3f} |"
        )
    lines += [
        "",
        "Budget saved by PLD at equal accuracy (the same release certified by PLD instead of RDP):",
        "",
        "| method | vs improved RDP conversion: mean [min, max] | vs classical RDP conversion: mean [min, max] |",
        "| --- | --- | --- |",
    ]
    for method in ("rs", "lc"):
        sv = b["pld_savings"][method]
        if sv["saving_mean"] is None:
            continue
        lines.append(
            f"| {method.upper()} | {100 * sv['saving_mean']:.1f}% [{100 * sv['saving_range'][0]:.1f}, {100 * sv['saving_range'][1]:.1f}] | "
            f"{100 * sv['saving_vs_classical_mean']:.1f}% [{100 * sv['saving_vs_classical_range'][0]:.1f}, {100 * sv['saving_vs_classical_range'][1]:.1f}] |"
        )
    lines.append("")
    return "\n".join(lines)


def _table_by_target(curves: dict, key: str, fmt: str) -> list[str]:
    targets = sorted({round(r["target_epsilon"], 9) for m in curves.values() for rows in m.values() for r in rows})
    out = []
    for t in targets:
        cells = []
        for method, acc in COLUMNS:
            row = next((r for r in curves[method][acc] if round(r["target_epsilon"], 9) == t), None)
            cells.append("—" if row is None else fmt.format(row[key]))
        out.append(f"| {t:.3f} | " + " | ".join(cells) + " |")
    return out


def run(settings: Settings) -> dict:
    """Both parts; returns the JSON-ready result (figures and tables are written by the caller)."""
    start = time.perf_counter()
    a = mean_estimation(settings)
    t_a = time.perf_counter() - start
    b = digits_logreg(settings)
    t_b = time.perf_counter() - start - t_a
    return {
        "experiment": "merging",
        "settings": _jsonable(asdict(settings)),
        "mean_estimation": a,
        "digits": b,
        "seconds": {"mean_estimation": t_a, "digits": t_b},
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v
