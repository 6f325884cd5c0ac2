"""Release records of the data level: builders of the records the accountant defines
(``dpsgd_record``, ``rs_merge_record``, ``lc_merge_record``; fields: ``peer.base.records``), and
the record-level entry points kept for callers that hold orders rather than an accountant
(``rdp_of_record``, ``pld_of_record``, ``pld_fallbacks``, ``record_epsilon``).

Interpretation lives in one place: a record is read into its typed event
(``peer.dp.accounting.events.event_of``) and interpreted by ``peer.dp.accounting.accountant.
Accountant``, which says per kind what it computes. The builders state their ε by the same
accountant (PLD ε at the record's δ, RDP ε in ``parameters.epsilon_rdp``).

``parameters["selection"]`` of a merge says how π / λ were chosen (``targets.Selection``).
"public-prior": from the training records and a public prior only; the RS / LC bound is the
charge. "utility": from the measured utility of the models listed in ``scored``; the choice and
the release are post-processing of releasing every scored model, so the record is interpreted
as their composition, and the weights must put no mass outside ``scored``. A record without the
field (written before selections were recorded) is interpreted as it always was.
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
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.accounting.events import selection_scored
from peer.dp.accounting.lc import DEFAULT_MAX_GROUPS, lc_report
from peer.dp.accounting.profiles import (
    DEFAULT_INTERVAL,
    privacy_profile,
    resolve_adjacency,
)
from peer.dp.accounting.rs import check_weights, composition_epsilon, rs_epsilon
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord


def rdp_of_record(record: ReleaseRecord, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP ε at each order of the release described by ``record``: ``Accountant(orders).rdp``
    (kept for callers that hold orders rather than an accountant).

    Raises InvalidArgument for a record it cannot interpret (unknown mechanism, missing or bad
    parameters)."""
    return Accountant(orders).rdp(_record(record))


def pld_of_record(record: ReleaseRecord, value_discretization_interval: float = DEFAULT_INTERVAL) -> pldm.PLD:
    """A dp-accounting PrivacyLossDistribution (pessimistic) of the release described by
    ``record``: ``Accountant(value_discretization_interval=…).pld``."""
    return Accountant(value_discretization_interval=value_discretization_interval).pld(_record(record))


def pld_fallbacks(record: ReleaseRecord) -> int:
    """How many parallel composites in ``record`` get the conservative PLD (``Accountant.pld_fallbacks``)."""
    return Accountant().pld_fallbacks(_record(record))


def _settings(accountant: Accountant | None) -> dict:
    """The accountant the builders state a record's ε by (``accountant``, else the default one)."""
    return {"accountant": accountant or DEFAULT_ACCOUNTANT}


def _record(record: Any) -> ReleaseRecord:
    if not isinstance(record, ReleaseRecord):
        raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
    return record


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
    accountant: Accountant | None = None,
) -> ReleaseRecord:
    """The "dpsgd" record of one trained model: epsilon = PLD ε at ``delta`` under the training's
    adjacency (by ``accountant``'s grid; ε by RDP at its orders; default: ``Accountant()``); sensitivity = the largest per-step L2 sensitivity of the clipped gradient sum
    (k·C_t, k = 2 replace-one, 1 add-remove); parameters carry the training record and ε by RDP
    (and by the closed form for full batch)."""
    if not isinstance(training, TrainingRecord):
        raise InvalidArgument("training", f"must be a TrainingRecord, got {type(training).__name__}")
    delta = check_delta(delta)
    eps = privacy_profile(training, **_settings(accountant)).epsilon(delta)
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
    accountant: Accountant | None = None,
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
    scored = selection_scored(selection, weights)
    if scored is None:
        eps = rs_epsilon(models, pi, delta, adjacency=adjacency, **_settings(accountant))
    else:
        eps = composition_epsilon(models, scored, delta, adjacency=adjacency, **_settings(accountant))
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
    accountant: Accountant | None = None,
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
    scored = selection_scored(selection, check_weights(lam, len(models), "lam"))
    report = lc_report(
        models,
        lam,
        delta,
        adjacency=adjacency,
        max_groups=max_groups,
        **_settings(accountant),
    )
    eps = report.epsilon
    if scored is not None:
        eps = composition_epsilon(models, scored, delta, adjacency=adjacency, **_settings(accountant))
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


def record_epsilon(record: ReleaseRecord, delta: float, *, accountant: Accountant | None = None) -> tuple[float, float]:
    """(ε by PLD, ε by RDP) of any interpretable record at ``delta``: ``accountant.epsilon``
    (by default the project's ``Accountant()``)."""
    return (accountant or Accountant()).epsilon(_record(record), delta)


__all__ = ["dpsgd_record", "lc_merge_record", "pld_of_record", "rdp_of_record", "record_epsilon", "rs_merge_record"]
