"""DP model merging within a site: random selection (RS) and linear combination (LC).

A site holds a pool of models trained on the *same* protected dataset by DP-SGD
(``peer.dp.training``), all from the same public initialisation; someone asks for one model at a
target (ε′, δ′). Instead of retraining, the site releases a merge of its pool:

- **RS** releases θ_I with I ~ Cat(π), I drawn from the release's randomness (CSPRNG-seeded
  unless a fixed seed is asked for, ``peer.base.rng``). Only θ_I leaves, never I: revealing the index
  turns the mixture back into the worst member, so neither the record nor the result says which
  model was drawn. Privacy is the RS bound (``peer.dp.accounting.rs``): PLD
  δ^RS(ε) ≤ max{Σ π_i H_ε(P_i‖Q_i), Σ π_i H_ε(Q_i‖P_i)}, RDP
  ε_order^RS ≤ 1/(order−1)·log Σ π_i exp((order−1) ε_order,i) — for a π fixed independently of
  the training records. The expected prior utility Σ π_i u_i is linear in π, and π is the exact
  optimum under the target (``peer.dp.accounting.choose_pi``, a linear programme per
  accountant): the budget is saturated unless the most useful model alone is already within it.
- **LC** releases θ_λ = Σ_i λ_i θ_i (λ convex weights) of independent DP-SGD runs
  (``peer.dp.accounting.lc``). θ_λ is a post-processing of releasing every model with λ_i > 0, so it
  is charged their composition (RDP summed, PLDs composed): a proven bound for any training. The
  cost depends on λ only through its support, so the choice (``peer.dp.accounting.choose_lam``) is
  which subset of models to combine, and λ over it. The design's per-step Gaussian surrogate
  (s_t = sqrt(Σ(λ_i η_i σ_i C_i)²), Δ_t = k·Σ λ_i η_i C_i, μ² = Σ_t (Δ_t/s_t)²) is reported in the
  record beside the bound and is charged only when every merged model's training record declares
  state-independent gradients (never for DP-SGD on a network); for such a pool the models'
  declared dataset sizes n must agree (the surrogate's per-step ratio relies on the common 1/n
  cancelling). LC refuses models known only by (ε_i, δ_i) (no free lunch: from final guarantees
  alone an LC is no better than releasing every model).

Selection (``peer.dp.accounting.targets``, module docstring). π and λ are a published choice, so
they are either public or charged, and the record's ``selection`` says which:

- ``"public-prior"`` (the default): π / λ maximise a *public prior* — per-model utilities the
  site declares (``prior=``, or every pool model's metadata ``"prior_utility"``), or, when none
  is declared, each model's own ε at δ (``targets.privacy_prior``); for LC the prior may also be
  a function of λ computed from public information only. No model is scored: the measured
  accuracy of a model that is not released is a function of the training records (even on a
  public validation split), and a π chosen by it leaks them.
- ``"utility"`` (opt-in): a public subset S of the pool (``targets.scored_subset``: the subsets
  whose composition meets the target, the largest total prior) is scored by ``score`` — the
  caller's measurement of a model's (or combination's) utility, e.g. accuracy on a validation
  split that is not part of the protected records — and the best is released. Charged as what
  it is: the composition of S's models (the choice and the release are post-processing of
  releasing them all); RS then releases the best scored model with certainty.

Unit of privacy: one training record of the pool's dataset, "replace-one" or "add-remove" —
the same for every model (a mix is refused by the accountant). Public: every model's training
record, the architecture and common initialisation, the prior, π/λ. This module never sees data:
``score`` is the caller's (``peer.dp.pools`` measures it on the validation split).

Pure: no I/O; randomness passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.dp.accounting import (
    ApproxDP,
    TrainingRecord,
    WeightChoice,
    choose_lam,
    choose_pi,
    lc_segments,
    surrogate_is_bound,
)
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant
from peer.dp.accounting.release_accounting import lc_merge_record, rs_merge_record
from peer.dp.accounting.rs import check_weights
from peer.dp.accounting.targets import (
    SELECTIONS,
    Selection,
    choose_lam_by_utility,
    choose_pi_by_utility,
    privacy_prior,
)
from peer.nn.architectures import validate_architecture

METHODS = ("rs", "lc")
#: a pool model's metadata key for the public prior utility its site declares (a finite number)
PRIOR_KEY = "prior_utility"
# LC candidates whose utility is measured: about this many simplex grid points (≈ 20 steps per
# axis for three models) — spread over the faces of the maximal feasible subsets under the
# composition bound, projected onto the feasible boundary under the surrogate.
LC_CANDIDATES = 256
# Far below any utility difference that matters (accuracy moves in steps of 1/len(validation)).
TIE_BREAK = 1e-9


@dataclass(frozen=True)
class PoolModel:
    """One model of a pool: its weights, architecture and what is known about its privacy — the
    full DP-SGD ``TrainingRecord`` or only an ``ApproxDP`` (ε, δ). ``dataset_size`` is the
    declared n of its DP-SGD update (None when unknown). ``metadata`` is the store's (accuracy,
    data split, the model's own "dpsgd" record); merging reads only its declared public prior
    (``PRIOR_KEY``) and the record's randomness (:func:`models_randomness`)."""

    name: str
    architecture: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    privacy: TrainingRecord | ApproxDP
    dataset_size: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MergedModel:
    """A merge ready to release: the weights, the release record ("rs-merge" / "lc-merge"; ε by
    PLD, parameters["epsilon_rdp"] by RDP) and the weight choice (π or λ, ε by every accountant,
    utility — the prior's for a public-prior selection, the measured one for a utility selection —,
    whether the budget is saturated, and the selection). Nothing here says which model an RS
    merge drew."""

    architecture: dict
    arrays: dict[str, np.ndarray]
    record: ReleaseRecord
    choice: WeightChoice


def check_pool(pool: Sequence[PoolModel]) -> dict:
    """The pool's common architecture; refuses an empty pool, duplicate names, or models whose
    architectures or parameter shapes differ."""
    if not pool:
        raise InvalidArgument("pool", "is empty: there is nothing to merge")
    arch = _pool_architecture(pool[0].architecture)
    names = [m.name for m in pool]
    if len(set(names)) != len(names):
        raise InvalidArgument("pool", f"model names must be distinct, got {names}")
    shapes0 = {k: np.shape(v) for k, v in pool[0].arrays.items()}
    for m in pool[1:]:
        if _pool_architecture(m.architecture) != arch:
            raise InvalidArgument(
                "pool",
                f"models must share one architecture: {m.name!r} has {m.architecture}, {pool[0].name!r} has {arch}",
            )
        if {k: np.shape(v) for k, v in m.arrays.items()} != shapes0:
            raise InvalidArgument(
                "pool", f"model {m.name!r} has parameter names or shapes different from {pool[0].name!r}"
            )
    return arch


def _pool_architecture(architecture: Mapping[str, Any]) -> dict:
    """A built-in architecture normalised, or a site's own network's public description
    (``peer.nn.imported``: its structure, checked against its digest)."""
    from peer.nn.imported import imported_architecture, is_imported_architecture, structure_of

    if is_imported_architecture(architecture):
        return imported_architecture(structure_of(architecture))
    return validate_architecture(architecture)


def combine(arrays: Sequence[Mapping[str, np.ndarray]], lam: Sequence[float]) -> dict[str, np.ndarray]:
    """θ_λ = Σ_i λ_i θ_i, entry by entry (float64 sums, stored as float32)."""
    if not arrays:
        raise InvalidArgument("pool", "is empty: there is nothing to merge")
    w = check_weights(lam, len(arrays), "lam")
    keys = list(arrays[0])
    for i, a in enumerate(arrays):
        if sorted(a) != sorted(keys) or any(np.shape(a[k]) != np.shape(arrays[0][k]) for k in keys):
            raise InvalidArgument(f"pool[{i}]", "has parameter names or shapes different from pool[0]")
    return {
        k: sum(float(w[i]) * np.asarray(a[k], dtype=np.float64) for i, a in enumerate(arrays)).astype(np.float32)
        for k in keys
    }


def draw_index(pi: Sequence[float], randomness: Randomness) -> int:
    """I ~ Cat(π) from the release's randomness."""
    p = check_weights(pi, len(pi), "pi")
    return int(randomness.generator.choice(len(p), p=p))


def _check_method_inputs(target_epsilon: float, delta: float) -> None:
    check_epsilon(target_epsilon, "target_epsilon")
    check_delta(delta, "delta")


def pool_prior(
    pool: Sequence[PoolModel],
    delta: float,
    prior: Sequence[float] | None = None,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> tuple[list[float], str]:
    """(the public prior utilities of the pool's models, where they come from): ``prior`` when
    given ("declared"), else every model's metadata ``PRIOR_KEY`` ("declared"), else
    ``targets.privacy_prior`` ("epsilon": each model's ε by ``accountant``). A prior declared
    for some models only is refused,
    naming the others. A declared prior must be public: chosen before the models were trained
    or from their training records (e.g. the site's belief about a noise level) — never a
    measured score of the model itself, such as its metadata "accuracy" (a function of the
    training records: use a utility selection, which is charged, instead)."""
    if prior is not None:
        if isinstance(prior, (str, bytes)) or not hasattr(prior, "__len__") or len(prior) != len(pool):
            raise InvalidArgument("prior", f"must give one public prior utility per pool model ({len(pool)})")
        return [float(u) for u in prior], "declared"
    declared = [m.metadata.get(PRIOR_KEY) for m in pool]
    if all(d is None for d in declared):
        return privacy_prior([m.privacy for m in pool], delta, accountant=accountant), "epsilon"
    missing = [m.name for m, d in zip(pool, declared, strict=True) if d is None]
    if missing:
        raise InvalidArgument(
            f"metadata.{PRIOR_KEY}",
            f"is declared for some pool models but not for {missing}: declare it for all or none",
        )
    out = []
    for m, d in zip(pool, declared, strict=True):
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not np.isfinite(float(d)):
            raise InvalidArgument(f"{m.name}.metadata.{PRIOR_KEY}", "must be a finite number (a public prior utility)")
        out.append(float(d))
    return out, "declared"


def _check_selection(selection: str, score) -> None:
    if selection not in SELECTIONS:
        raise InvalidArgument("selection", f"must be one of {SELECTIONS}, got {selection!r}")
    if selection == "utility" and not callable(score):
        raise InvalidArgument("score", "a utility selection needs the measurement of a model's utility (a callable)")
    if selection == "public-prior" and score is not None:
        raise InvalidArgument(
            "score", "a public-prior selection reads no measured utility; ask for selection='utility' (charged)"
        )


def merge_rs(
    pool: Sequence[PoolModel],
    target_epsilon: float,
    delta: float,
    *,
    randomness: Randomness,
    selection: str = "public-prior",
    prior: Sequence[float] | None = None,
    score: Callable[[Mapping[str, np.ndarray]], float] | None = None,
    figure: str = "pld",
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    subject: str = "",
    counterparty: str | None = None,
) -> MergedModel:
    """Random selection at (target_epsilon, delta), then one model drawn from Cat(π).

    ``selection`` "public-prior": π maximises Σ π_i prior_i subject to the RS bound meeting the
    target by the ε ``figure`` ("pld" or "rdp"); ``prior`` as in ``pool_prior``. "utility": the
    models of the public subset S (``targets.scored_subset``) are scored by ``score(arrays)`` and
    the best is released; charged the composition of S (module docstring). Every ε (the choice's
    and the record's) is stated by ``accountant``."""
    arch = check_pool(pool)
    _check_method_inputs(target_epsilon, delta)
    _check_selection(selection, score)
    models = [m.privacy for m in pool]
    prior_u, prior_name = pool_prior(pool, float(delta), prior, accountant)
    if selection == "utility":
        choice = choose_pi_by_utility(
            models,
            lambda i: float(score(pool[i].arrays)),
            float(target_epsilon),
            float(delta),
            prior=prior_u,
            prior_name=prior_name,
            figure=figure,
            accountant=accountant,
        )
    else:
        choice = choose_pi(models, prior_u, float(target_epsilon), float(delta), figure=figure, accountant=accountant)
        choice = replace(choice, selection=Selection("public-prior", prior_name, tuple(prior_u)).to_dict())
    drawn = pool[draw_index(choice.weights, randomness)]
    record = rs_merge_record(
        models,
        choice.weights,
        float(delta),
        names=[m.name for m in pool],
        randomness=randomness.record_fields(),
        subject=subject,
        counterparty=counterparty,
        selection=choice.selection,
        accountant=accountant,
    )
    record = with_models_randomness(record, pool, choice.weights)
    # the drawn model's own arrays, as read-only views: no copy of what may be a large model
    return MergedModel(arch, {k: _read_only(v) for k, v in drawn.arrays.items()}, record, choice)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = np.asarray(a, dtype=np.float32).view()
    view.flags.writeable = False
    return view


def _check_lc_pool(pool: Sequence[PoolModel]) -> None:
    sizes = {m.dataset_size for m in pool if isinstance(m.privacy, TrainingRecord)}
    if len(sizes) > 1:
        raise InvalidArgument(
            "pool",
            f"an LC merge charged by the per-step surrogate combines runs with one declared dataset size n; got sizes "
            f"{sorted(sizes, key=str)} (the surrogate's per-step noise and sensitivity assume a common 1/n)",
        )


def merge_lc(
    pool: Sequence[PoolModel],
    target_epsilon: float,
    delta: float,
    *,
    selection: str = "public-prior",
    prior: Sequence[float] | Callable[[np.ndarray], float] | None = None,
    score: Callable[[Mapping[str, np.ndarray]], float] | None = None,
    figure: str = "pld",
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    candidates: int = LC_CANDIDATES,
    subject: str = "",
    counterparty: str | None = None,
) -> MergedModel:
    """Linear combination at (target_epsilon, delta).

    ``selection`` "public-prior": λ maximises the prior subject to the charged bound (module
    docstring) meeting the target by the ε ``figure`` ("pld" or "rdp") — per-model priors (``pool_prior``: linear
    Σ λ_i prior_i) or a public function ``prior(λ)`` evaluated on about ``candidates`` λ's.
    "utility": ``score(θ_λ)`` is measured on about ``candidates`` λ's supported on the public
    subset S (``targets.scored_subset``); charged the composition of S. Every ε (the choice's and
    the record's) is stated by ``accountant``."""
    arch = check_pool(pool)
    _check_method_inputs(target_epsilon, delta)
    _check_selection(selection, score)
    models = [m.privacy for m in pool]
    arrays = [m.arrays for m in pool]
    if callable(prior):
        utility, prior_name, prior_u = prior, "declared", None
    else:
        prior_u, prior_name = pool_prior(pool, float(delta), prior, accountant)
        utility = prior_u
    if selection == "utility":

        def scored(lam: np.ndarray) -> float:
            return float(score(combine(arrays, lam)))

        if prior_u is None:
            raise InvalidArgument("prior", "a utility selection chooses its scored subset by per-model prior utilities")
        choice = choose_lam_by_utility(
            models,
            scored,
            float(target_epsilon),
            float(delta),
            prior=prior_u,
            prior_name=prior_name,
            figure=figure,
            accountant=accountant,
            max_points=candidates,
        )
    else:
        if all(isinstance(m, TrainingRecord) for m in models) and surrogate_is_bound(models):
            _check_lc_pool(pool)
            if callable(utility):
                segments = lc_segments(models)
                public = utility

                def utility(lam: np.ndarray) -> float:
                    # a tie goes to the candidate with the larger μ (the one spending more of the
                    # budget, hence carrying less relative noise)
                    return float(public(lam)) + TIE_BREAK * segments.mu(lam) / (1.0 + segments.mu(lam))

        choice = choose_lam(
            models,
            utility,
            float(target_epsilon),
            float(delta),
            figure=figure,
            accountant=accountant,
            max_points=candidates,
        )
        if callable(prior):
            choice = replace(choice, utility=float(prior(np.asarray(choice.weights))))
        choice = replace(
            choice,
            selection=Selection("public-prior", prior_name, None if prior_u is None else tuple(prior_u)).to_dict(),
        )
    record = lc_merge_record(
        models,
        choice.weights,
        float(delta),
        names=[m.name for m in pool],
        subject=subject,
        counterparty=counterparty,
        selection=choice.selection,
        accountant=accountant,
    )
    record = with_models_randomness(record, pool, choice.weights)
    return MergedModel(arch, combine(arrays, choice.weights), record, choice)


def models_randomness(pool: Sequence[PoolModel]) -> list[dict[str, Any]]:
    """Where each pool model's DP-SGD noise came from, read from its own "dpsgd" record in its
    metadata: ``{"randomness": "csprng" | "fixed-seed" | "none" | "unknown", "seed": ...}``
    ("unknown": the store holds no record of it)."""
    out = []
    for m in pool:
        record = m.metadata.get("record") if isinstance(m.metadata, Mapping) else None
        if not isinstance(record, Mapping):
            out.append({"randomness": "unknown", "seed": None})
            continue
        out.append({"randomness": str(record.get("randomness", "csprng")), "seed": record.get("seed")})
    return out


def with_models_randomness(record: ReleaseRecord, pool: Sequence[PoolModel], weights: Sequence[float]) -> ReleaseRecord:
    """A merge's record stating the true randomness of what it releases: the draw's (RS) *and*
    the training noise of every model it may release (weight > 0). A model trained with a
    fixed seed (``privfusion pool train --seed``) is reproducible by anyone who knows the seed,
    so a merge that may release it is not private either: its record then says "fixed-seed"
    (serialised with "fixed seed: not private"), with that model's seed unless the draw's own
    seed is fixed. ``parameters.models_randomness`` lists each model's (in ``names`` order)."""
    per_model = models_randomness(pool)
    params = {**record.parameters, "models_randomness": per_model}
    changes: dict[str, Any] = {"parameters": params}
    if record.randomness != "fixed-seed":
        fixed = [r for r, w in zip(per_model, weights, strict=True) if float(w) > 0 and r["randomness"] == "fixed-seed"]
        if fixed:
            changes.update(randomness="fixed-seed", seed=int(fixed[0]["seed"]))
    return record.with_(**changes)
