"""``privfusion account rs|lc``: the privacy of a merge of DP-SGD models described in a JSON file.

    privfusion account rs --models M.json --weights 0.2,0.3,0.5 --delta 1e-5 --json
    privfusion account lc --models M.json --target-epsilon 2 --delta 1e-5 --json

M.json::

    {"adjacency": "replace" | "replace-one" | "add-remove",
     "models": [{"name": "m1", "steps": 1000, "noise_multiplier": 1.1, "clip": 1.0,
                 "learning_rate": 0.1, "sample_rate": 1.0, "accuracy": 0.93}, ...]}

``noise_multiplier``, ``clip``, ``learning_rate`` and ``sample_rate`` are numbers (constant over the
run) or lists with one value per step. For RS a model may instead be known only by its guarantee,
``{"name", "epsilon", "delta"}``. ``accuracy`` is needed with ``--target-epsilon``. A DP-SGD model
may add ``"state_independent_gradients": true`` when its clipped per-example gradients do not
depend on its own parameters (e.g. mean estimation with a linear loss; never a neural network).

LC: ``epsilon`` is the proven bound that would be charged — the composition of the models with
λ_i > 0 (θ_λ is a post-processing of releasing them all) — unless every such model declares
state-independent gradients, when the per-step surrogate is the bound. ``bound`` names which;
``surrogate`` gives the per-step surrogate figure {mu, pld, rdp, valid, valid_when} beside it.

With ``--target-epsilon`` the weights are chosen (``peer.dp.accounting.targets``): for RS π maximises
the expected accuracy Σ π_i acc_i (exact: it is linear in π) under ε^RS(π) ≤ E; for LC the file
holds no weights, so the accuracy of a combination cannot be known — λ maximises the linear proxy
Σ λ_i acc_i under the charged bound ≤ E, and the output says so (``privfusion merge`` evaluates
real models). Under the composition bound that proxy always picks one model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.base.errors import InvalidArgument

if TYPE_CHECKING:  # peer.dp loads dp_accounting (slow): imported where the command runs
    from peer.dp.accounting.accountant import Accountant

ADJACENCY_NAMES = {"replace": "replace-one", "replace-one": "replace-one", "add-remove": "add-remove"}
STEP_FIELDS = {
    "learning_rate": "learning_rate",
    "clip": "clip_norm",
    "noise_multiplier": "noise_multiplier",
    "sample_rate": "sample_rate",
}
MODEL_FIELDS = {"name", "steps", "accuracy", "epsilon", "delta", "state_independent_gradients", *STEP_FIELDS}
LC_PROXY_NOTE = (
    "LC weights maximise the linear proxy sum(lam_i * accuracy_i): the accuracy of a combination "
    "is only known by evaluating the combined model (privfusion merge does that); under the "
    "composition bound the proxy picks the most accurate model that meets the target alone"
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "account",
        help="privacy of an RS or LC merge of DP-SGD models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("method", choices=("rs", "lc"), help="rs: random selection; lc: linear combination")
    p.add_argument("--models", required=True, type=Path, help="JSON file describing the models (see above)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--weights", help="comma-separated weights, one per model, summing to 1")
    group.add_argument("--target-epsilon", type=float, help="choose weights meeting this epsilon (uses 'accuracy')")
    p.add_argument("--delta", type=float, required=True, help="delta, in (0, 1)")
    p.add_argument(
        "--figure",
        "--accountant",
        dest="figure",
        choices=("pld", "rdp"),
        default="pld",
        help="the epsilon figure that must meet --target-epsilon: pld (default, the tight one) or rdp "
        "(--accountant is the old name)",
    )
    p.add_argument("--interval", type=float, default=1e-4, help="PLD value discretisation interval (default 1e-4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _number(value: Any, where: str, rule=lambda v: True, text: str = "a number") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not rule(value):
        raise InvalidArgument(where, f"must be {text}, got {value!r}")
    return float(value)


def _per_step(value: Any, steps: int, where: str) -> list:
    if isinstance(value, list):
        if len(value) != steps:
            raise InvalidArgument(where, f"has {len(value)} values for {steps} steps")
        return value
    return [value] * steps


def parse_models(data: Any) -> tuple[str, list[str], list, list[float | None]]:
    """(adjacency, names, models, accuracies) from the M.json object; every error names the model
    index and the field."""
    from peer.dp.accounting import ApproxDP, GaussianStep, TrainingRecord

    if not isinstance(data, dict):
        raise InvalidArgument("models file", "must be a JSON object with 'adjacency' and 'models'")
    unknown = set(data) - {"adjacency", "models"}
    if unknown:
        raise InvalidArgument("models file", f"unknown fields {sorted(unknown)}")
    if data.get("adjacency") not in ADJACENCY_NAMES:
        raise InvalidArgument("adjacency", f"must be 'replace' or 'add-remove', got {data.get('adjacency')!r}")
    adjacency = ADJACENCY_NAMES[data["adjacency"]]
    raw = data.get("models")
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("models", "must be a non-empty list")
    names, models, accuracies = [], [], []
    for i, m in enumerate(raw):
        where = f"models[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgument(where, "must be an object")
        unknown = set(m) - MODEL_FIELDS
        if unknown:
            raise InvalidArgument(where, f"unknown fields {sorted(unknown)} (known: {sorted(MODEL_FIELDS)})")
        name = m.get("name", f"model-{i}")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{where}.name", f"must be a non-empty string, got {name!r}")
        if name in names:
            raise InvalidArgument(f"{where}.name", f"duplicate name {name!r}")
        acc = m.get("accuracy")
        if acc is not None:
            acc = _number(acc, f"{where}.accuracy", lambda v: 0 <= v <= 1, "a number in [0, 1]")
        if "epsilon" in m or "delta" in m:
            extra = set(m) & ({"steps", "state_independent_gradients"} | set(STEP_FIELDS))
            if extra:
                raise InvalidArgument(
                    where, f"give either (epsilon, delta) or DP-SGD hyperparameters, not both ({sorted(extra)})"
                )
            for f in ("epsilon", "delta"):
                if f not in m:
                    raise InvalidArgument(f"{where}.{f}", "is required for an (epsilon, delta) model")
            try:
                models.append(ApproxDP(m["epsilon"], m["delta"], adjacency))
            except InvalidArgument as e:
                raise InvalidArgument(f"{where}.{e.field}", e.rule) from None
        else:
            for f in ("steps", *STEP_FIELDS):
                if f not in m:
                    raise InvalidArgument(f"{where}.{f}", "is required (a missing hyperparameter)")
            steps = m["steps"]
            if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
                raise InvalidArgument(f"{where}.steps", f"must be a positive integer, got {steps!r}")
            columns = {f: _per_step(m[f], steps, f"{where}.{f}") for f in STEP_FIELDS}
            cache: dict = {}
            seq = []
            for t in range(steps):
                key = tuple(columns[f][t] for f in STEP_FIELDS)
                if key not in cache:
                    try:
                        cache[key] = GaussianStep(**{STEP_FIELDS[f]: columns[f][t] for f in STEP_FIELDS})
                    except InvalidArgument as e:
                        field = next(k for k, v in STEP_FIELDS.items() if v == e.field)
                        suffix = f"[{t}]" if isinstance(m[field], list) else ""
                        raise InvalidArgument(f"{where}.{field}{suffix}", e.rule) from None
                seq.append(cache[key])
            declared = m.get("state_independent_gradients", False)
            if not isinstance(declared, bool):
                raise InvalidArgument(
                    f"{where}.state_independent_gradients", f"must be true or false, got {declared!r}"
                )
            models.append(TrainingRecord(adjacency, tuple(seq), declared))
        names.append(name)
        accuracies.append(acc)
    return adjacency, names, models, accuracies


def _weights(text: str, count: int) -> list[float]:
    try:
        values = [float(w) for w in text.split(",")]
    except ValueError:
        raise InvalidArgument("--weights", f"must be comma-separated numbers, got {text!r}") from None
    if len(values) != count:
        raise InvalidArgument("--weights", f"needs one weight per model ({count}), got {len(values)}")
    return values


def account(
    method: str,
    data: Any,
    *,
    delta: float,
    weights: list[float] | None = None,
    target_epsilon: float | None = None,
    figure: str = "pld",
    accountant: Accountant | None = None,
) -> dict:
    """The JSON-ready result of ``privfusion account`` (pure: file contents in, dict out); every ε
    by ``accountant`` (default: the default one; the CLI's is built from ``--interval``)."""
    from peer.base.checks import check_delta, check_epsilon
    from peer.dp.accounting import ApproxDP, choose_lam, choose_pi, lc_report, privacy_profile, rs_epsilon, rs_profiles
    from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT
    from peer.dp.accounting.lc import NO_FREE_LUNCH

    accountant = accountant or DEFAULT_ACCOUNTANT
    delta = check_delta(delta, "--delta")
    adjacency, names, models, accuracies = parse_models(data)
    if method == "lc":
        for i, m in enumerate(models):
            if isinstance(m, ApproxDP):
                raise InvalidArgument(f"models[{i}]", NO_FREE_LUNCH)
    out: dict[str, Any] = {
        "method": method,
        "adjacency": adjacency,
        "names": names,
        "delta": delta,
        "value_discretization_interval": accountant.value_discretization_interval,
    }
    if target_epsilon is not None:
        target_epsilon = check_epsilon(target_epsilon, "--target-epsilon", zero=True)
        missing = [i for i, a in enumerate(accuracies) if a is None]
        if missing:
            raise InvalidArgument(f"models[{missing[0]}].accuracy", "is required with --target-epsilon")
    if method == "rs":
        profiles = rs_profiles(models, adjacency=adjacency, accountant=accountant)
        singles = [p.epsilon(delta) for p in profiles]
        if target_epsilon is not None:
            choice = choose_pi(
                profiles,
                accuracies,
                target_epsilon,
                delta,
                figure=figure,
                accountant=accountant,
            )
            weights, eps = list(choice.weights), choice.epsilon
            out.update(
                target_epsilon=target_epsilon,
                accountant=figure,  # the output key, unchanged
                saturated=choice.saturated,
                expected_accuracy=choice.utility,
            )
        else:
            eps = rs_epsilon(profiles, weights, delta, accountant=accountant)
    else:
        singles = [privacy_profile(m, accountant=accountant).epsilon(delta) for m in models]
        if target_epsilon is not None:
            choice = choose_lam(models, accuracies, target_epsilon, delta, figure=figure, accountant=accountant)
            weights = list(choice.weights)
            out.update(
                target_epsilon=target_epsilon,
                accountant=figure,  # the output key, unchanged
                saturated=choice.saturated,
                accuracy_proxy=choice.utility,
                accuracy_note=LC_PROXY_NOTE,
            )
        report = lc_report(models, weights, delta, accountant=accountant)
        eps = report.epsilon
        out["bound"] = report.bound
        out["surrogate"] = None if report.surrogate is None else report.surrogate.to_dict()
    if (
        weights is not None
        and all(a is not None for a in accuracies)
        and "expected_accuracy" not in out
        and method == "rs"
    ):
        out["expected_accuracy"] = sum(w * a for w, a in zip(weights, accuracies, strict=True))
    out["weights"] = [float(w) for w in weights]
    out["epsilon"] = eps.to_dict()
    out["per_model"] = [{"name": n, "epsilon": e.to_dict()} for n, e in zip(names, singles, strict=True)]
    return out


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument("--models", f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument("--models", f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise InvalidArgument("--models", f"{path} is not valid JSON: {e}") from None


def _fmt(x: Any) -> str:
    return x if isinstance(x, str) else f"{x:.6g}"


def _accountant(interval: float) -> Accountant:
    """The accountant of ``--interval`` (default orders)."""
    from peer.dp.accounting.accountant import Accountant

    try:
        return Accountant(value_discretization_interval=interval)
    except InvalidArgument as e:
        raise InvalidArgument("--interval", e.rule) from None


def run(args) -> int:
    data = _read(args.models)
    count = len(data.get("models", [])) if isinstance(data, dict) and isinstance(data.get("models"), list) else 0
    weights = _weights(args.weights, count) if args.weights is not None else None
    result = account(
        args.method,
        data,
        delta=args.delta,
        weights=weights,
        target_epsilon=args.target_epsilon,
        figure=args.figure,
        accountant=_accountant(args.interval),
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    name_width = max(5, *(len(n) for n in result["names"]))
    print(f"{result['method'].upper()} merge, unit: one record ({result['adjacency']}), delta = {result['delta']:g}")
    print(f"{'model':<{name_width}}  {'weight':>8}  {'eps (PLD)':>10}  {'eps (RDP)':>10}")
    for name, w, single in zip(result["names"], result["weights"], result["per_model"], strict=True):
        e = single["epsilon"]
        print(f"{name:<{name_width}}  {w:>8.4f}  {_fmt(e['pld']):>10}  {_fmt(e['rdp']):>10}")
    e = result["epsilon"]
    line = f"merged: epsilon = {_fmt(e['pld'])} (PLD), {_fmt(e['rdp'])} (RDP)"
    if "closed_form" in e:
        line += f", {_fmt(e['closed_form'])} (closed form)"
    print(line)
    if result["method"] == "lc":
        what = (
            "composition of the models with weight > 0: proven for any training"
            if result["bound"] == "composition"
            else "per-step surrogate: every merged model declares state-independent gradients"
        )
        print(f"charged bound: {what}")
        sur = result["surrogate"]
        if sur is not None and result["bound"] != "surrogate":
            print(
                f"per-step surrogate (NOT a bound for these models): mu = {_fmt(sur['mu'])}, epsilon = {_fmt(sur['pld'])} (PLD), "
                f"{_fmt(sur['rdp'])} (RDP); valid only when {sur['valid_when']}"
            )
    if "target_epsilon" in result:
        print(
            f"target epsilon {result['target_epsilon']:g} by {result['accountant']}: "
            f"{'budget saturated' if result['saturated'] else 'met with room to spare'}"
        )
    if "expected_accuracy" in result:
        print(f"expected accuracy: {result['expected_accuracy']:.4f}")
    if "accuracy_note" in result:
        print(f"accuracy proxy: {result['accuracy_proxy']:.4f} ({result['accuracy_note']})")
    for note in e.get("notes", []):
        print(f"note: {note}")
    return 0


__all__ = ["account", "parse_models", "register", "run"]
