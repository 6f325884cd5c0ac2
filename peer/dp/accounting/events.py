"""What a release did, as typed values: one immutable event class per mechanism kind.

In the style of dp_accounting's ``DpEvent`` (``GaussianDpEvent``, ``LaplaceDpEvent``,
``SelfComposedDpEvent``, …): an event holds the public parameters the accountant needs and
nothing else; ``peer.dp.accounting.accountant.Accountant`` interprets it. The serialised
envelope stays the ``ReleaseRecord`` (``peer.base.records``: string ``mechanism``, a parameter
dict, unit, sensitivity, counterparty, time), so ledgers, pools and receipts keep their bytes;
:func:`event_of` reads the typed event out of a record and refuses, naming the field, a record
whose parameters are missing or malformed.

Kinds (``ReleaseRecord.mechanism`` → event):

- ``laplace`` → :class:`LaplaceRelease` (L1 ``sensitivity``, ``parameters.scale``): ε = Δ₁/b.
- ``gaussian`` → :class:`GaussianRelease` (L2 ``sensitivity``, ``parameters.noise_std``):
  μ = Δ₂/σ.
- ``multibit`` → :class:`MultiBitRelease` (pure ε-DP, the record's ``epsilon``; δ must be 0).
- ``composite`` → :class:`Composition` (``parameters.composition`` "sequential" or "parallel",
  the components' events in order).
- ``dpsgd`` → :class:`DpSgdTraining` (``parameters.training``, a TrainingRecord, under the
  record's data-level unit).
- ``rs-merge`` → :class:`RandomSelectionMerge` (``parameters.models``, ``parameters.pi``);
  ``lc-merge`` → :class:`LinearCombinationMerge` (``parameters.models``, ``parameters.lam``).
  ``scored`` is the models a utility selection read (``parameters.selection``), or None when
  the weights are a function of public information (or the record predates the field).
- ``distributed-skellam`` → :class:`DistributedSkellamSteps` (one secure-sum step, or a segment
  of steps, of the distributed Skellam mechanism: ``parameters.share_variance``, ``sites``,
  ``coalition``, ``modulus_bits``, ``scale``, ``l1_sensitivity``, ``l2_sensitivity`` (integer
  units, after rounding; the record's L2 ``sensitivity`` is the same number), ``sample_rate``,
  ``steps``; unit ``record:add-remove`` only, the adjacency its subsampling bound covers).

Data-level events carry the adjacency of the record's unit ("record:replace-one" →
"replace-one", "record:add-remove" → "add-remove").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord
from peer.dp.accounting.weights import SELECTIONS, check_subset, check_weights

#: A data-level record's unit → the adjacency of its event.
DATA_UNITS = {"record:replace-one": "replace-one", "record:add-remove": "add-remove"}
COMPOSITIONS = ("sequential", "parallel")


@dataclass(frozen=True)
class LaplaceRelease:
    """The Laplace mechanism: noise of scale ``scale`` on a query of L1 ``sensitivity``."""

    sensitivity: float
    scale: float

    @property
    def epsilon(self) -> float:
        return self.sensitivity / self.scale


@dataclass(frozen=True)
class GaussianRelease:
    """The Gaussian mechanism: noise of standard deviation ``noise_std`` on a query of L2
    ``sensitivity``; μ = sensitivity / noise_std (μ-GDP)."""

    sensitivity: float
    noise_std: float

    @property
    def mu(self) -> float:
        return self.sensitivity / self.noise_std


@dataclass(frozen=True)
class MultiBitRelease:
    """A pure ``epsilon``-DP release (the multi-bit mechanism of LPGNN): δ = 0."""

    epsilon: float


@dataclass(frozen=True)
class Composition:
    """Releases made together. ``how`` "sequential": on the same unit (they compose);
    "parallel": on disjoint units (a neighbouring pair changes one of them)."""

    how: str
    events: tuple[Event, ...]


@dataclass(frozen=True)
class DpSgdTraining:
    """One model trained by DP-SGD, released whole: its ``training`` record under ``adjacency``."""

    training: TrainingRecord
    adjacency: str


@dataclass(frozen=True)
class RandomSelectionMerge:
    """RS: release model I ~ Cat(π) of ``models``. ``pi`` is a distribution over the models."""

    models: tuple[TrainingRecord | ApproxDP, ...]
    pi: tuple[float, ...]
    adjacency: str
    scored: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LinearCombinationMerge:
    """LC: release Σ λ_i θ_i of ``models``. ``lam`` holds convex weights."""

    models: tuple[TrainingRecord | ApproxDP, ...]
    lam: tuple[float, ...]
    adjacency: str
    scored: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DistributedSkellamSteps:
    """``steps`` secure-sum steps of the distributed Skellam mechanism (``peer.dp.distributed``),
    each Poisson-subsampled at ``sample_rate`` at this site, under add/remove of one record of
    this site (``adjacency``).

    Each of the ``sites`` (k) sites adds a symmetric Skellam share of variance
    ``share_variance`` (v) per coordinate to its integer-encoded clipped gradient sum (scale
    ``scale``, residues mod 2^``modulus_bits``: post-processing, it never changes privacy); a
    coalition of ``coalition`` (t) sites can subtract its own shares, so what is charged is the
    Skellam mechanism with the honest shares' variance (k − t)·v (:attr:`honest_variance`) and
    integer sensitivities ``l1_sensitivity`` Δ₁, ``l2_sensitivity`` Δ₂ of the encoding.
    """

    share_variance: float
    sites: int
    coalition: int
    modulus_bits: int
    scale: float
    l1_sensitivity: float
    l2_sensitivity: float
    sample_rate: float
    steps: int
    adjacency: str = "add-remove"

    @property
    def honest_variance(self) -> float:
        """(k − t)·v: the noise variance per coordinate that a coalition of t sites still faces."""
        return (self.sites - self.coalition) * self.share_variance


Event = (
    LaplaceRelease
    | GaussianRelease
    | MultiBitRelease
    | Composition
    | DpSgdTraining
    | RandomSelectionMerge
    | LinearCombinationMerge
    | DistributedSkellamSteps
)
EVENT_TYPES = (
    LaplaceRelease,
    GaussianRelease,
    MultiBitRelease,
    Composition,
    DpSgdTraining,
    RandomSelectionMerge,
    LinearCombinationMerge,
    DistributedSkellamSteps,
)


# ---- reading an event out of a record ----------------------------------------------------------


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


def _data_adjacency(record: ReleaseRecord) -> str:
    if record.level != "data" or record.unit not in DATA_UNITS:
        raise InvalidArgument(
            "unit",
            f"a {record.mechanism!r} record is data-level with unit in {sorted(DATA_UNITS)}, got level={record.level!r} unit={record.unit!r}",
        )
    return DATA_UNITS[record.unit]


def _laplace(record: ReleaseRecord) -> LaplaceRelease:
    return LaplaceRelease(_sensitivity(record, "l1"), _positive(_param(record, "scale"), "parameters.scale"))


def _gaussian(record: ReleaseRecord) -> GaussianRelease:
    return GaussianRelease(_sensitivity(record, "l2"), _positive(_param(record, "noise_std"), "parameters.noise_std"))


def _multibit(record: ReleaseRecord) -> MultiBitRelease:
    if record.delta != 0:
        raise InvalidArgument("delta", f"a multibit release is pure epsilon-DP: delta must be 0, got {record.delta}")
    return MultiBitRelease(float(record.epsilon))


def _composite(record: ReleaseRecord) -> Composition:
    how = _param(record, "composition")
    if not record.components:
        raise InvalidArgument("components", "a composite record needs at least one component")
    if how not in COMPOSITIONS:
        raise InvalidArgument("parameters.composition", f"must be 'sequential' or 'parallel', got {how!r}")
    return Composition(how, tuple(event_of(c) for c in record.components))


def _dpsgd(record: ReleaseRecord) -> DpSgdTraining:
    adjacency = _data_adjacency(record)
    training = TrainingRecord.from_dict(_param(record, "training"), "parameters.training")
    if training.adjacency != adjacency:
        raise InvalidArgument(
            "parameters.training.adjacency",
            f"the training says {training.adjacency!r} but the record's unit is {record.unit!r}",
        )
    return DpSgdTraining(training, adjacency)


def _merge_models(record: ReleaseRecord, adjacency: str) -> tuple:
    raw = _param(record, "models")
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise InvalidArgument("parameters.models", "must be a non-empty list")
    models = []
    for i, m in enumerate(raw):
        where = f"parameters.models[{i}]"
        if isinstance(m, Mapping) and "steps" in m:
            models.append(TrainingRecord.from_dict(m, where))
        elif isinstance(m, Mapping) and set(m) <= {"epsilon", "delta", "adjacency"} and {"epsilon", "delta"} <= set(m):
            try:
                models.append(ApproxDP(m["epsilon"], m["delta"], m.get("adjacency", adjacency)))
            except InvalidArgument as e:
                raise InvalidArgument(f"{where}.{e.field}", e.rule) from None
        else:
            raise InvalidArgument(where, "must be a TrainingRecord dict or {'epsilon', 'delta'}")
    return tuple(models)


def selection_scored(selection: Mapping[str, Any] | None, weights: np.ndarray) -> tuple[int, ...] | None:
    """The models a utility selection read (indices), or None when the weights were chosen from
    public information (or the record predates the field); ``parameters.selection`` of a merge."""
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


def _merge(record: ReleaseRecord, name: str) -> tuple[tuple, tuple[float, ...], str, tuple[int, ...] | None]:
    adjacency = _data_adjacency(record)
    models = _merge_models(record, adjacency)
    weights = check_weights(_param(record, name), len(models), f"parameters.{name}")
    scored = selection_scored(record.parameters.get("selection"), weights)
    return models, tuple(float(w) for w in weights), adjacency, scored


def _rs(record: ReleaseRecord) -> RandomSelectionMerge:
    return RandomSelectionMerge(*_merge(record, "pi"))


def _lc(record: ReleaseRecord) -> LinearCombinationMerge:
    return LinearCombinationMerge(*_merge(record, "lam"))


def _integer_param(record: ReleaseRecord, name: str, low: int, high: int | None = None) -> int:
    value = _param(record, name)
    field_name = f"parameters.{name}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgument(field_name, f"must be an integer {bounds}, got {value!r}")
    return int(value)


def _distributed_skellam(record: ReleaseRecord) -> DistributedSkellamSteps:
    adjacency = _data_adjacency(record)
    if adjacency != "add-remove":
        raise InvalidArgument(
            "unit",
            f"a distributed-skellam record is accounted under add/remove of one record (the subsampling "
            f"bound's adjacency), got {record.unit!r}",
        )
    l2 = _sensitivity(record, "l2")
    share = _positive(_param(record, "share_variance"), "parameters.share_variance")
    coalition = _integer_param(record, "coalition", 0)
    sites = _integer_param(record, "sites", coalition + 2)
    bits = _integer_param(record, "modulus_bits", 2, 64)
    scale = _positive(_param(record, "scale"), "parameters.scale")
    l1 = _positive(_param(record, "l1_sensitivity"), "parameters.l1_sensitivity")
    l2_param = _positive(_param(record, "l2_sensitivity"), "parameters.l2_sensitivity")
    if not math.isclose(l2_param, l2, rel_tol=1e-12):
        raise InvalidArgument(
            "parameters.l2_sensitivity", f"must equal the record's sensitivity {l2!r}, got {l2_param!r}"
        )
    if l2 > l1 * (1 + 1e-12):
        raise InvalidArgument("sensitivity", f"the L2 sensitivity {l2!r} cannot exceed the L1 sensitivity {l1!r}")
    q = _positive(_param(record, "sample_rate"), "parameters.sample_rate")
    if q > 1:
        raise InvalidArgument("parameters.sample_rate", f"must be in (0, 1], got {q!r}")
    steps = _integer_param(record, "steps", 1)
    event = DistributedSkellamSteps(share, sites, coalition, bits, scale, l1, l2, q, steps, adjacency)
    total = record.parameters.get("total_variance")
    if total is not None and not math.isclose(
        _positive(total, "parameters.total_variance"), event.honest_variance, rel_tol=1e-9
    ):
        raise InvalidArgument(
            "parameters.total_variance",
            f"must be (sites − coalition)·share_variance = {event.honest_variance!r}, got {total!r}",
        )
    return event


#: How each record mechanism is read (one entry per kind; the accountant dispatches on the event's class).
READERS = {
    "laplace": _laplace,
    "gaussian": _gaussian,
    "multibit": _multibit,
    "composite": _composite,
    "dpsgd": _dpsgd,
    "rs-merge": _rs,
    "lc-merge": _lc,
    "distributed-skellam": _distributed_skellam,
}


#: The event class each record mechanism is read into (what ``event_of`` returns for it).
EVENT_CLASSES: dict[str, type] = {
    "laplace": LaplaceRelease,
    "gaussian": GaussianRelease,
    "multibit": MultiBitRelease,
    "composite": Composition,
    "dpsgd": DpSgdTraining,
    "rs-merge": RandomSelectionMerge,
    "lc-merge": LinearCombinationMerge,
    "distributed-skellam": DistributedSkellamSteps,
}


def event_class(record: ReleaseRecord) -> type | None:
    """The event class ``record`` describes (its kind), without reading its parameters; None
    for a mechanism no event describes. For code that dispatches on the kind before the
    parameters are checked (``per_unit.per_neuron_record`` checks them with its own errors)."""
    return EVENT_CLASSES.get(record.mechanism)


def event_of(record: ReleaseRecord) -> Event:
    """The typed event a record describes. Raises InvalidArgument naming the field for an
    unknown mechanism or missing / malformed parameters."""
    if not isinstance(record, ReleaseRecord):
        raise InvalidArgument("record", f"must be a ReleaseRecord, got {type(record).__name__}")
    reader = READERS.get(record.mechanism)
    if reader is None:
        raise InvalidArgument("mechanism", f"no accountant for mechanism {record.mechanism!r}")
    return reader(record)


__all__ = [
    "DATA_UNITS",
    "EVENT_CLASSES",
    "EVENT_TYPES",
    "Composition",
    "DistributedSkellamSteps",
    "DpSgdTraining",
    "Event",
    "GaussianRelease",
    "LaplaceRelease",
    "LinearCombinationMerge",
    "MultiBitRelease",
    "RandomSelectionMerge",
    "event_class",
    "event_of",
    "selection_scored",
]
