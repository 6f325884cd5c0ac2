"""Model-level records restated in the per-neuron unit (the ledger's model-level budgets are
per neuron).

The unit of a model-level release is one neuron (its activation row and its incoming weight
vector); a per-entry guarantee is not a per-neuron one, so per-entry releases are restated per
neuron before they are charged (:func:`per_neuron_record`): Laplace exactly — a neuron's
activation row has P entries (``shape = [n, P]``) within ``clip = [lo, hi]``, so its L1
sensitivity is P·(hi − lo) and the per-neuron ε is P·(hi − lo)/scale = P × (per-entry ε); the
Gaussian exactly, from the row's L2 clip; multi-bit as P sequentially composed ε-DP
coordinates. Other per-entry releases are refused. The restatement dispatches on the kind of
event the record describes (``events.event_class``), one function per kind, as the accountant
does. Pure: records in, records out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting.events import Composition, GaussianRelease, LaplaceRelease, MultiBitRelease, event_class


def per_neuron_record(record: ReleaseRecord) -> ReleaseRecord:
    """The model-level record in the per-neuron unit (module docstring).

    Per-neuron records pass unchanged. Per-entry records (``peer.ldp.mechanisms``, ``unit="entry"``)
    are restated for the neuron, whose row has P = ``shape[1]`` entries:
    - Laplace: exactly, by L1 group privacy: sensitivity P·(hi − lo), ε = P·(hi − lo)/scale.
    - Gaussian (the PFA unit): exactly, since the same noise covers the whole row: a replaced row
      of the clip set moves by at most min(2·clip_norm, 2·entry_bound·√P) in L2 (what
      ``gaussian_sensitivity`` gives per neuron); ε restated at the record's δ (analytic).
    - multi-bit: P independent ε-DP coordinates: a sequential composite of P copies (per-neuron
      pure ε = P·ε by basic composition; the accountant sums their RDP).
    Composites are converted component-wise. Everything released about one neuron composes
    sequentially; parallel composition holds only across different neurons. So a ``"parallel"``
    composite stays parallel only when its ``parameters["parallel_over"]`` is ``"neurons"``
    (components touch disjoint neurons, e.g. different layers); one parallel over
    ``"entries"`` (other entries of the same neurons: a layer's activations and weights) — or a
    per-entry one that does not say — becomes ``"sequential"``, the sound reading. The summary
    ε/δ is recomputed by basic composition (sum for sequential, max for parallel); the
    accountant reads the composition, so its RDP follows the same structure. Any other per-entry
    release raises FailedPrecondition.
    """
    if record.level != "model":
        return record
    kind = event_class(record)
    if kind is not Composition:
        if record.unit == "neuron":
            return record
        if record.unit != "entry":
            raise InvalidArgument(
                "unit", f"a model-level release must be per 'neuron' or per 'entry', got {record.unit!r}"
            )
    convert = _PER_NEURON.get(kind)
    if convert is None:
        raise FailedPrecondition(
            f"release {record.release_id}: a per-entry {record.mechanism!r} release has no sound per-neuron "
            "conversion in the ledger; release it per neuron instead",
            reason="PER_ENTRY_NO_CONVERSION",
        )
    return convert(record)


def _composite_per_neuron(record: ReleaseRecord) -> ReleaseRecord:
    how = record.parameters.get("composition")
    if how not in ("sequential", "parallel"):
        raise InvalidArgument("parameters.composition", f"must be 'sequential' or 'parallel', got {how!r}")
    how_per_neuron = _composition_per_neuron(record, how)
    components = tuple(per_neuron_record(c) for c in record.components)
    if components == record.components and record.unit == "neuron" and how_per_neuron == how:
        return record
    if how_per_neuron == "sequential":
        eps, delta = sum(c.epsilon for c in components), min(1.0, sum(c.delta for c in components))
    else:
        eps, delta = (
            max((c.epsilon for c in components), default=0.0),
            max((c.delta for c in components), default=0.0),
        )
    if delta >= 1:
        raise InvalidArgument("delta", "the composed per-neuron δ reaches 1: the release has no guarantee")
    parameters = record.parameters
    if how_per_neuron != how:
        parameters = {k: v for k, v in record.parameters.items() if k != "parallel_over"}
        parameters.update(
            composition="sequential",
            restated="per entry parallel over other entries of the same neurons: sequential per neuron",
        )
    return record.with_(unit="neuron", components=components, epsilon=eps, delta=delta, parameters=parameters)


def _composition_per_neuron(record: ReleaseRecord, how: str) -> str:
    """How the components of a model-level composite compose per neuron.

    Sequential stays sequential. Parallel needs ``parameters["parallel_over"]``: ``"neurons"``
    stays parallel; ``"entries"`` is parallel per entry only (same neurons) and so sequential
    per neuron. A per-neuron record's parallel components are necessarily other neurons; a
    per-entry record that does not say is read as the same neurons (sequential: never less).
    """
    if how == "sequential":
        return how
    over = record.parameters.get("parallel_over")
    if over not in (None, "neurons", "entries"):
        raise InvalidArgument("parameters.parallel_over", f"must be 'neurons' or 'entries', got {over!r}")
    if record.unit == "neuron":
        if over == "entries":
            raise InvalidArgument(
                "parameters.parallel_over",
                "a per-neuron composite cannot be parallel over entries "
                "of the same neurons: everything released about one neuron composes sequentially",
            )
        return "parallel"
    return "parallel" if over == "neurons" else "sequential"


def _row_length(record: ReleaseRecord) -> int:
    try:
        n, row = (int(v) for v in record.parameters["shape"])
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(
            "parameters.shape", f"a per-entry {record.mechanism} record needs its shape [n, P]"
        ) from None
    if n < 1 or row < 1:
        raise InvalidArgument("parameters.shape", f"must be positive, got {[n, row]}")
    return row


def _check_entry_sensitivity(record: ReleaseRecord, expected: float, rule: str) -> None:
    if record.sensitivity is None or not math.isclose(record.sensitivity, expected, rel_tol=1e-9):
        raise InvalidArgument(
            "sensitivity",
            f"a per-entry {record.mechanism} record's sensitivity must be {rule} = {expected:g}, got {record.sensitivity!r}",
        )


def _laplace_per_neuron(record: ReleaseRecord) -> ReleaseRecord:
    p = record.parameters
    try:
        scale = float(p["scale"])
        lo, hi = (float(v) for v in p["clip"])
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument("parameters", "a Laplace record needs 'scale' and 'clip' [lo, hi]") from None
    if not (scale > 0 and math.isfinite(scale)) or not hi > lo:
        raise InvalidArgument(
            "parameters", f"Laplace needs scale > 0 and clip hi > lo, got scale={scale}, clip={[lo, hi]}"
        )
    row = _row_length(record)
    _check_entry_sensitivity(record, hi - lo, "hi − lo")
    sensitivity = row * (hi - lo)
    return record.with_(unit="neuron", sensitivity=sensitivity, epsilon=sensitivity / scale)


def _gaussian_per_neuron(record: ReleaseRecord) -> ReleaseRecord:
    from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

    p = record.parameters
    try:
        noise_std, clip_norm = float(p["noise_std"]), float(p["clip_norm"])
        bound = p.get("entry_bound")
        bound = None if bound is None else float(bound)
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(
            "parameters", "a Gaussian record needs 'noise_std', 'clip_norm' (and 'entry_bound' or null)"
        ) from None
    if not (noise_std > 0 and clip_norm > 0 and (bound is None or bound > 0)):
        raise InvalidArgument("parameters", "Gaussian noise_std, clip_norm and entry_bound must be > 0")
    row = _row_length(record)
    entry = 2 * clip_norm if bound is None else 2 * min(bound, clip_norm)
    _check_entry_sensitivity(record, entry, "2·min(entry_bound, clip_norm)")
    sensitivity = min(2 * clip_norm, math.inf if bound is None else 2 * bound * math.sqrt(row))
    epsilon = get_epsilon_gaussian(noise_std / sensitivity, record.delta) if record.delta > 0 else math.inf
    return record.with_(
        unit="neuron",
        sensitivity=sensitivity,
        epsilon=epsilon,
        parameters={**record.parameters, "adjacency": "replace-one"},
    )


def _multibit_per_neuron(record: ReleaseRecord) -> ReleaseRecord:
    row = _row_length(record)
    coordinate = record.with_(unit="neuron")
    return record.with_(
        mechanism="composite",
        unit="neuron",
        epsilon=row * record.epsilon,
        sensitivity=None,
        sensitivity_norm="none",
        parameters={"composition": "sequential"},
        components=(coordinate,) * row,
    )


#: The restatement of each kind (the event class the record describes, ``events.event_class``):
#: composites component-wise, and the per-entry kinds with a sound per-neuron restatement.
#: A kind not listed (a per-entry DP-SGD or merge record, an unknown mechanism) is refused.
_PER_NEURON: dict[type, Callable[[ReleaseRecord], ReleaseRecord]] = {
    Composition: _composite_per_neuron,
    LaplaceRelease: _laplace_per_neuron,
    GaussianRelease: _gaussian_per_neuron,
    MultiBitRelease: _multibit_per_neuron,
}


__all__ = ["per_neuron_record"]
