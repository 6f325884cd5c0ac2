"""Interpreting release records (the record fields are those of peer.base.records): RDP and PLD of every mechanism kind, and
builders for the data-level records the accountant defines (dpsgd, rs-merge, lc-merge).

The accountant reads only the record: mechanism, parameters, sensitivity and unit. Per kind:

- ``laplace`` (model level): ε = sensitivity/scale with L1 sensitivity; RDP by Mironov 2017
  Prop. 6 (``rdp.rdp_laplace``), PLD by dp-accounting's ``from_laplace_mechanism``.
- ``multibit`` (model level): pure ε-DP (δ = 0, ε = the record's epsilon); RDP and PLD of binary
  randomised response with that ε, the dominating pair of every ε-DP mechanism.
- ``gaussian`` (model level): ratio μ = sensitivity/noise_std (L2); RDP order·μ²/2, PLD
  dp-accounting's Gaussian PLD.
- ``composite``: ``sequential`` — RDP summed, PLDs composed; ``parallel`` (components touch disjoint
  units, so a neighbouring pair changes one component) — RDP: the elementwise maximum over
  components (for each pair the divergence is that of the one component that changed). PLD: a
  single PLD dominating every component is needed. We return the dominating component's PLD when
  the components are ordered by one parameter (all Gaussian: largest μ; all Laplace: largest ε;
  pure ε-DP kinds — multibit and Laplace — randomised response with the largest ε), or when one
  component dominates every other one mechanism by mechanism (``_dominates``: each is a
  sequential composition of Gaussian / Laplace / multibit releases, and the other's can be
  matched one to one to its own of the same kind with a parameter at least as large — a
  features release's layers, (Laplace ε_x then multibit ε_w) each, against its output layer's
  multibit ε_w). Otherwise we fall back to the sequential composition of the components, which
  dominates each of them (sound, conservative, and possibly above the RDP figure, which takes
  the maximum exactly); :func:`pld_fallbacks` counts where that happened so reports can say so.
- ``dpsgd``: the TrainingRecord in ``parameters["training"]``, accounted under the record's unit.
- ``rs-merge`` / ``lc-merge``: the RS / LC accountants on the listed models and weights. An LC
  merge is interpreted by its charged, proven bound (``lc.lc_rdp`` / ``lc.lc_pld``): the
  composition of the models with λ_i > 0 (Σ of their own RDP curves; their PLDs composed), or
  the per-step surrogate only when every such model's training record declares
  state-independent gradients. The record's ``bound`` and ``surrogate`` parameters describe
  the release; the interpretation re-derives the bound from the models and ignores them.
- ``parameters["selection"]`` of a merge says how π / λ were chosen (``targets.Selection``).
  "public-prior": from the training records and a public prior only; the RS / LC bound above is
  the charge. "utility": from the measured utility of the models listed in ``scored``; the choice
  and the release are post-processing of releasing every scored model, so the record is
  interpreted as their composition (RDP summed, PLDs composed), and the weights must put no mass
  outside ``scored``. A record without the field (written before selections were recorded) is
  interpreted as it always was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from peer.base.checks import check_delta
from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.conversions import DEFAULT_ORDERS, check_orders, pld_epsilon, rdp_to_epsilon
from peer.dp.accounting.lc import DEFAULT_MAX_GROUPS, lc_pld, lc_rdp, lc_report
from peer.dp.accounting.profiles import (
    DEFAULT_INTERVAL,
    model_rdp,
    privacy_profile,
    privacy_profiles,
    resolve_adjacency,
)
from peer.dp.accounting.rdp import rdp_gaussian, rdp_laplace, rdp_mixture, rdp_pure
from peer.dp.accounting.rs import check_subset, check_weights, composition_epsilon, rs_epsilon
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord

DATA_UNITS = {"record:replace-one": "replace-one", "record:add-remove": "add-remove"}


def _param(record: ReleaseRecord, name: str) -> Any:
    if name not in record.parameters:
        raise InvalidArgument(f"parameters.{name}", f"is required for a {record.mechanism!r} record")
    return record.parameters[name]


def _positive(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < math.inf):
        raise InvalidArgument(field_name, f"must be a finite number > 0, got {value!r}")
    return float(value)


def _sensitivity(record: ReleaseRecord, norm: str) -> float:
    if record.sensitivity is None:
        raise InvalidArgument("sensitivity", f"is required for a {record.mechanism!r} record")
    if record.sensitivity_norm != norm:
        raise InvalidArgument(
            "sensitivity_norm", f"must be {norm!r} for a {record.mechanism!r} record, got {record.sensitivity_norm!r}"
        )
    return float(record.sensitivity)


def _laplace_epsilon(record: ReleaseRecord) -> float:
    return _sensitivity(record, "l1") / _positive(_param(record, "scale"), "parameters.scale")


def _gaussian_mu(record: ReleaseRecord) -> float:
    return _sensitivity(record, "l2") / _positive(_param(record, "noise_std"), "parameters.noise_std")


def _pure_epsilon(record: ReleaseRecord) -> float:
    if record.delta != 0:
        raise InvalidArgument("delta", f"a multibit release is pure epsilon-DP: delta must be 0, got {record.delta}")
    return float(record.epsilon)


def _data_adjacency(record: ReleaseRecord) -> str:
    if record.level != "data" or record.unit not in DATA_UNITS:
        raise InvalidArgument(
            "unit",
            f"a {record.mechanism!r} record is data-level with unit in {sorted(DATA_UNITS)}, got level={record.level!r} unit={record.unit!r}",
        )
    return DATA_UNITS[record.unit]


def _training(data: Any, field_name: str) -> TrainingRecord:
    return TrainingRecord.from_dict(data, field_name)


def _dpsgd_training(record: ReleaseRecord) -> tuple[TrainingRecord, str]:
    adjacency = _data_adjacency(record)
    training = _training(_param(record, "training"), "parameters.training")
    if training.adjacency != adjacency:
        raise InvalidArgument(
            "parameters.training.adjacency",
            f"the training says {training.adjacency!r} but the record's unit is {record.unit!r}",
        )
    return training, adjacency


def _merge_models(record: ReleaseRecord, adjacency: str) -> list:
    raw = _param(record, "models")
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise InvalidArgument("parameters.models", "must be a non-empty list")
    models = []
    for i, m in enumerate(raw):
        where = f"parameters.models[{i}]"
        if isinstance(m, Mapping) and "steps" in m:
            models.append(_training(m, where))
        elif isinstance(m, Mapping) and set(m) <= {"epsilon", "delta", "adjacency"} and {"epsilon", "delta"} <= set(m):
            try:
                models.append(ApproxDP(m["epsilon"], m["delta"], m.get("adjacency", adjacency)))
            except InvalidArgument as e:
                raise InvalidArgument(f"{where}.{e.field}", e.rule) from None
        else:
            raise InvalidArgument(where, "must be a TrainingRecord dict or {'epsilon', 'delta'}")
    return models


def _weights(record: ReleaseRecord, name: str, count: int) -> np.ndarray:
    return check_weights(_param(record, name), count, f"parameters.{name}")


def _scored(record: ReleaseRecord, weights: np.ndarray) -> tuple[int, ...] | None:
    """The models a utility selection read (indices), or None when the weights were chosen from
    public information (or the record predates the field)."""
    return _selection_scored(record.parameters.get("selection"), weights)


def _selection_scored(selection: Mapping[str, Any] | None, weights: np.ndarray) -> tuple[int, ...] | None:
    from peer.dp.accounting.targets import SELECTIONS

    if selection is None:
        return None
    if not isinstance(selection, Mapping) or selection.get("kind") not in SELECTIONS:
        raise InvalidArgument("parameters.selection.kind", f"must be one of {SELECTIONS}")
    if selection["kind"] != "utility":
        if selection.get("scored"):
            raise InvalidArgument("parameters.selection.scored", "a public-prior selection reads no measured utility")
        return None
    scored = check_subset(selection.get("scored"), len(weights), "parameters.selection.scored")
    outside = sorted(set(int(i) for i in np.flatnonzero(weights > 0)) - set(scored))
    if outside:
        raise InvalidArgument(
            "parameters.selection.scored",
            f"must include every model the weights put mass on (models {outside} are weighted but were not scored)",
        )
    return scored


def _composition_rdp(models: Sequence, scored: tuple[int, ...], adjacency: str, orders) -> np.ndarray:
    rdps = []
    for i in scored:
        try:
            rdps.append(model_rdp(models[i], adjacency, orders=orders))
        except InvalidArgument as e:
            raise InvalidArgument(f"models[{i}].{e.field}", e.rule) from None
    return np.sum(rdps, axis=0)


def _composition_pld(models: Sequence, scored: tuple[int, ...], adjacency: str, interval: float) -> pldm.PLD:
    profiles = privacy_profiles([models[i] for i in scored], adjacency, value_discretization_interval=interval)
    return pldm.compose_plds([p.pld for p in profiles], interval) if len(profiles) > 1 else profiles[0].pld


def _parallel_family(record: ReleaseRecord) -> tuple[str, float] | None:
    """(family, parameter) when the component's PLD is one of a totally ordered family."""
    if record.mechanism == "gaussian":
        return "gaussian", _gaussian_mu(record)
    if record.mechanism == "laplace":
        return "laplace", _laplace_epsilon(record)
    if record.mechanism == "multibit":
        return "pure", _pure_epsilon(record)
    return None


def _leaves(record: ReleaseRecord) -> dict[str, list[float]] | None:
    """The releases a component composes sequentially, by ordered family ({"gaussian": [μ…],
    "laplace": [ε…], "pure": [ε…]}), or None when it holds anything else."""
    family = _parallel_family(record)
    if family is not None:
        return {family[0]: [family[1]]}
    if record.mechanism != "composite" or record.parameters.get("composition") != "sequential":
        return None
    out: dict[str, list[float]] = {}
    for c in record.components:
        sub = _leaves(c)
        if sub is None:
            return None
        for kind, values in sub.items():
            out.setdefault(kind, []).extend(values)
    return out


def _dominates(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    """Whether the sequential composition ``a`` dominates ``b``: every release of ``b`` is matched
    to its own release of ``a`` of the same family with a parameter at least as large (sorted
    descending, elementwise — the test for such a matching). Sound because each family is
    ordered (a larger μ or ε is a more informative mechanism of the same kind), composition
    preserves that order (Dong, Roth & Su 2022, Lemma 3.3 on trade-off functions), and the
    releases of ``a`` left unmatched only add to it."""
    for kind, theirs in b.items():
        ours = sorted(a.get(kind, ()), reverse=True)
        theirs = sorted(theirs, reverse=True)
        if len(theirs) > len(ours) or any(x < y for x, y in zip(ours, theirs, strict=False)):
            return False
    return True


def _dominant_component(record: ReleaseRecord) -> ReleaseRecord | None:
    """The component of a parallel composite that dominates every other (``_dominates``), or None."""
    leaves = [_leaves(c) for c in record.components]
    if any(x is None for x in leaves):
        return None
    for i, a in enumerate(leaves):
        if all(_dominates(a, b) for b in leaves):
            return record.components[i]
    return None


def pld_fallbacks(record: ReleaseRecord) -> int:
    """How many parallel composites in ``record`` get the conservative PLD of
    :func:`pld_of_record` (the sequential composition of their parts: no part dominates)."""
    if record.mechanism != "composite":
        return 0
    inner = sum(pld_fallbacks(c) for c in record.components)
    if record.parameters.get("composition") != "parallel":
        return inner
    families = [_parallel_family(c) for c in record.components]
    if all(f is not None for f in families) and (
        {f[0] for f in families} in ({"gaussian"}, {"laplace"}) or {f[0] for f in families} <= {"laplace", "pure"}
    ):
        return inner
    dominant = _dominant_component(record)
    return pld_fallbacks(dominant) if dominant is not None else inner + 1


def rdp_of_record(record: ReleaseRecord, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP ε at each order of the release described by ``record`` (module docstring per kind).

    Raises InvalidArgument for a record it cannot interpret (unknown mechanism, missing or bad
    parameters)."""
    orders = check_orders(orders)
    if not isinstance(record, ReleaseRecord):
        raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
    kind = record.mechanism
    if kind == "laplace":
        return rdp_laplace(_laplace_epsilon(record), orders)
    if kind == "multibit":
        return rdp_pure(_pure_epsilon(record), orders)
    if kind == "gaussian":
        return rdp_gaussian(_gaussian_mu(record), orders)
    if kind == "composite":
        composition = _param(record, "composition")
        if not record.components:
            raise InvalidArgument("components", "a composite record needs at least one component")
        parts = np.array([rdp_of_record(c, orders) for c in record.components])
        if composition == "sequential":
            return parts.sum(axis=0)
        if composition == "parallel":
            return parts.max(axis=0)
        raise InvalidArgument("parameters.composition", f"must be 'sequential' or 'parallel', got {composition!r}")
    if kind == "dpsgd":
        training, adjacency = _dpsgd_training(record)
        return model_rdp(training, adjacency, orders=orders)
    if kind == "rs-merge":
        adjacency = _data_adjacency(record)
        models = _merge_models(record, adjacency)
        pi = _weights(record, "pi", len(models))
        scored = _scored(record, pi)
        if scored is not None:
            return _composition_rdp(models, scored, adjacency, orders)
        rdps = []
        for i, m in enumerate(models):
            try:
                rdps.append(model_rdp(m, adjacency, orders=orders))
            except InvalidArgument as e:
                raise InvalidArgument(f"models[{i}].{e.field}", e.rule) from None
        return rdp_mixture(pi, rdps, orders)
    if kind == "lc-merge":
        adjacency = _data_adjacency(record)
        models = _merge_models(record, adjacency)
        lam = _weights(record, "lam", len(models))
        scored = _scored(record, lam)
        if scored is not None:
            return _composition_rdp(models, scored, adjacency, orders)
        return lc_rdp(models, lam, adjacency=adjacency, orders=orders)
    raise InvalidArgument("mechanism", f"no accountant for mechanism {kind!r}")


def pld_of_record(record: ReleaseRecord, value_discretization_interval: float = DEFAULT_INTERVAL) -> pldm.PLD:
    """A dp-accounting PrivacyLossDistribution (pessimistic) of the release described by ``record``.

    ``parallel`` composites: the dominating component's PLD when the components form one ordered
    family, or when one component dominates every other release by release (module docstring);
    otherwise the sequential composition of the components — sound but conservative (a larger
    ε than the true worst component; :func:`pld_fallbacks` counts where).
    """
    interval = pldm.check_interval(value_discretization_interval)
    if not isinstance(record, ReleaseRecord):
        raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
    kind = record.mechanism
    if kind == "laplace":
        return pldm.laplace_pld(_laplace_epsilon(record), interval)
    if kind == "multibit":
        return pldm.approx_dp_pld(_pure_epsilon(record), 0.0, interval)
    if kind == "gaussian":
        return pldm.gaussian_pld(_gaussian_mu(record), interval)
    if kind == "composite":
        composition = _param(record, "composition")
        if not record.components:
            raise InvalidArgument("components", "a composite record needs at least one component")
        if composition == "sequential":
            return pldm.compose_plds([pld_of_record(c, interval) for c in record.components], interval)
        if composition != "parallel":
            raise InvalidArgument("parameters.composition", f"must be 'sequential' or 'parallel', got {composition!r}")
        families = [_parallel_family(c) for c in record.components]
        if all(f is not None for f in families):
            kinds = {f[0] for f in families}
            if kinds == {"gaussian"}:
                return pldm.gaussian_pld(max(f[1] for f in families), interval)
            if kinds == {"laplace"}:
                return pldm.laplace_pld(max(f[1] for f in families), interval)
            if kinds <= {"laplace", "pure"}:
                # Laplace(ε) is ε-DP, hence dominated by randomised response with the same ε.
                return pldm.approx_dp_pld(max(f[1] for f in families), 0.0, interval)
        dominant = _dominant_component(record)
        if dominant is not None:
            return pld_of_record(dominant, interval)
        return pldm.compose_plds([pld_of_record(c, interval) for c in record.components], interval)
    if kind == "dpsgd":
        training, adjacency = _dpsgd_training(record)
        return privacy_profile(training, adjacency, value_discretization_interval=interval).pld
    if kind == "rs-merge":
        adjacency = _data_adjacency(record)
        models = _merge_models(record, adjacency)
        pi = _weights(record, "pi", len(models))
        scored = _scored(record, pi)
        if scored is not None:
            return _composition_pld(models, scored, adjacency, interval)
        profiles = privacy_profiles(models, adjacency, value_discretization_interval=interval)
        return pldm.mixture_pld([p.pld for p in profiles], pi)
    if kind == "lc-merge":
        adjacency = _data_adjacency(record)
        models = _merge_models(record, adjacency)
        lam = _weights(record, "lam", len(models))
        scored = _scored(record, lam)
        if scored is not None:
            return _composition_pld(models, scored, adjacency, interval)
        return lc_pld(models, lam, adjacency=adjacency, value_discretization_interval=interval)[0]
    raise InvalidArgument("mechanism", f"no accountant for mechanism {kind!r}")


# ----- builders of the data-level records (fields: peer.base.records and peer.dp.training) -----


def _randomness_fields(randomness: Mapping[str, Any] | None, default: str) -> dict:
    if randomness is None:
        return {"randomness": default, "seed": None}
    return {"randomness": randomness.get("randomness", default), "seed": randomness.get("seed")}


def _names(names: Sequence[str] | None, count: int) -> list[str]:
    if names is None:
        return [f"model-{i}" for i in range(count)]
    names = list(names)
    if len(names) != count or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgument("names", f"must be {count} non-empty strings")
    return names


def dpsgd_record(
    training: TrainingRecord,
    delta: float,
    *,
    randomness: Mapping[str, Any] | None = None,
    subject: str = "",
    counterparty: str | None = None,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> ReleaseRecord:
    """The "dpsgd" record of one trained model: epsilon = PLD ε at ``delta`` under the training's
    adjacency; sensitivity = the largest per-step L2 sensitivity of the clipped gradient sum
    (k·C_t, k = 2 replace-one, 1 add-remove); parameters carry the training record and ε by RDP
    (and by the closed form for full batch)."""
    if not isinstance(training, TrainingRecord):
        raise InvalidArgument("training", f"must be a TrainingRecord, got {type(training).__name__}")
    delta = check_delta(delta)
    eps = privacy_profile(training, value_discretization_interval=value_discretization_interval).epsilon(delta)
    k = 2.0 if training.adjacency == "replace-one" else 1.0
    params = {"training": training.to_dict(), "epsilon_rdp": _finite_or_str(eps.rdp)}
    if eps.closed_form is not None:
        params["epsilon_closed_form"] = _finite_or_str(eps.closed_form)
    return ReleaseRecord(
        mechanism="dpsgd",
        level="data",
        unit=f"record:{training.adjacency}",
        epsilon=eps.pld,
        delta=delta,
        sensitivity=k * max(s.clip_norm for s, _ in training.runs),
        sensitivity_norm="l2",
        parameters=params,
        subject=subject,
        counterparty=counterparty,
        **_randomness_fields(randomness, "csprng"),
    )


def _merge_record(mechanism, adjacency, epsilon, delta, params, subject, counterparty, randomness) -> ReleaseRecord:
    """A data-level merge record: no sensitivity of its own (its ε comes from the merged models'
    profiles, in ``params``)."""
    return ReleaseRecord(
        mechanism=mechanism,
        level="data",
        unit=f"record:{adjacency}",
        epsilon=epsilon,
        delta=delta,
        sensitivity=None,
        sensitivity_norm="none",
        parameters=params,
        subject=subject,
        counterparty=counterparty,
        **randomness,
    )


def _model_dict(m) -> dict:
    if isinstance(m, TrainingRecord):
        return m.to_dict()
    if isinstance(m, ApproxDP):
        return m.to_dict()
    raise InvalidArgument("models", f"must be TrainingRecord or ApproxDP values, got {type(m).__name__}")


def _finite_or_str(x: float) -> float | str:
    return "inf" if math.isinf(x) else float(x)


def rs_merge_record(
    models: Sequence,
    pi: Sequence[float],
    delta: float,
    *,
    names: Sequence[str] | None = None,
    adjacency: str | None = None,
    randomness: Mapping[str, Any] | None = None,
    subject: str = "",
    counterparty: str | None = None,
    value_discretization_interval: float = DEFAULT_INTERVAL,
    selection: Mapping[str, Any] | None = None,
) -> ReleaseRecord:
    """The "rs-merge" record: epsilon = RS PLD ε at ``delta``; parameters {pi, models, names,
    epsilon_rdp, selection}. It must not say which model was drawn: ``randomness`` describes the
    draw's generator only (``Randomness.record_fields()``). ``selection`` (``targets.Selection``
    as a dict) says how π was chosen; for a utility selection epsilon is the composition of the
    scored models (module docstring)."""
    delta = check_delta(delta)
    models = list(models)
    weights = check_weights(pi, len(models))
    scored = _selection_scored(selection, weights)
    if scored is None:
        eps = rs_epsilon(
            models, pi, delta, adjacency=adjacency, value_discretization_interval=value_discretization_interval
        )
    else:
        eps = composition_epsilon(
            models, scored, delta, adjacency=adjacency, value_discretization_interval=value_discretization_interval
        )
    adjacency = resolve_adjacency(models, adjacency)
    params = {
        "pi": [float(p) for p in weights],
        "models": [_model_dict(m) for m in models],
        "names": _names(names, len(models)),
        "epsilon_rdp": _finite_or_str(eps.rdp),
    }
    if selection is not None:
        params["selection"] = dict(selection)
    return _merge_record(
        "rs-merge", adjacency, eps.pld, delta, params, subject, counterparty, _randomness_fields(randomness, "csprng")
    )


def lc_merge_record(
    models: Sequence[TrainingRecord],
    lam: Sequence[float],
    delta: float,
    *,
    names: Sequence[str] | None = None,
    adjacency: str | None = None,
    subject: str = "",
    counterparty: str | None = None,
    value_discretization_interval: float = DEFAULT_INTERVAL,
    max_groups: int = DEFAULT_MAX_GROUPS,
    selection: Mapping[str, Any] | None = None,
) -> ReleaseRecord:
    """The "lc-merge" record: epsilon = the charged, proven bound's PLD ε at ``delta``
    (``lc.lc_report``); parameters {lam, models, names, bound ("composition" or "surrogate"),
    epsilon_rdp, epsilon_closed_form (when it exists), surrogate {mu, epsilon_pld, epsilon_rdp,
    valid, valid_when} (full-batch models only), selection}. LC draws no randomness of its own
    (randomness "none"). For a utility ``selection`` epsilon is the composition of the scored
    models and bound "composition" (module docstring)."""
    delta = check_delta(delta)
    models = list(models)
    scored = _selection_scored(selection, check_weights(lam, len(models), "lam"))
    report = lc_report(
        models,
        lam,
        delta,
        adjacency=adjacency,
        value_discretization_interval=value_discretization_interval,
        max_groups=max_groups,
    )
    eps = report.epsilon
    if scored is not None:
        eps = composition_epsilon(
            models, scored, delta, adjacency=adjacency, value_discretization_interval=value_discretization_interval
        )
    adjacency = resolve_adjacency(models, adjacency)
    params = {
        "lam": [float(x) for x in check_weights(lam, len(models), "lam")],
        "models": [_model_dict(m) for m in models],
        "names": _names(names, len(models)),
        "bound": report.bound if scored is None else "composition",
        "epsilon_rdp": _finite_or_str(eps.rdp),
    }
    if selection is not None:
        params["selection"] = dict(selection)
    if eps.closed_form is not None:
        params["epsilon_closed_form"] = _finite_or_str(eps.closed_form)
    if report.surrogate is not None:
        sur = report.surrogate
        params["surrogate"] = {
            "mu": _finite_or_str(sur.mu),
            "epsilon_pld": _finite_or_str(sur.epsilon.pld),
            "epsilon_rdp": _finite_or_str(sur.epsilon.rdp),
            "valid": sur.valid,
            "valid_when": sur.valid_when,
        }
    if eps.notes:
        params["notes"] = list(eps.notes)
    return _merge_record(
        "lc-merge", adjacency, eps.pld, delta, params, subject, counterparty, {"randomness": "none", "seed": None}
    )


def record_epsilon(
    record: ReleaseRecord,
    delta: float,
    *,
    orders: Sequence[float] = DEFAULT_ORDERS,
    value_discretization_interval: float = DEFAULT_INTERVAL,
) -> tuple[float, float]:
    """(ε by PLD, ε by RDP) of any interpretable record at ``delta``."""
    delta = check_delta(delta)
    orders = check_orders(orders)
    return (
        pld_epsilon(pld_of_record(record, value_discretization_interval), delta),
        rdp_to_epsilon(orders, rdp_of_record(record, orders), delta),
    )


__all__ = ["dpsgd_record", "lc_merge_record", "pld_of_record", "rdp_of_record", "record_epsilon", "rs_merge_record"]
