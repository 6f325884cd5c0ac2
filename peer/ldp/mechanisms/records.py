"""The record of several releases made together: parallel or sequential composition.

Why a parallel composite must say what its parts are disjoint in: docs/mechanisms.md,
"Composite records".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness

COMPOSITIONS = ("sequential", "parallel")
#: What the components of a parallel composite are disjoint in (see :func:`composite_record`).
PARALLEL_OVER = ("neurons", "entries")


def composite_record(
    components: Sequence[ReleaseRecord],
    composition: str,
    *,
    randomness: Randomness,
    parameters: Mapping[str, Any] | None = None,
    over: str | None = None,
) -> ReleaseRecord:
    """The record of several releases made together (mechanism ``"composite"``), with the
    components' records unchanged.

    ``"parallel"``: disjoint parts, ε = max, δ = max; ``over`` (required, recorded as
    ``parameters["parallel_over"]``) says what the parts are disjoint in — ``"neurons"``, or
    ``"entries"`` of the same neurons (only under ``unit="entry"``: per neuron they compose
    sequentially). ``"sequential"``: the same unit, ε = Σ, δ = Σ (a conservative summary). Why:
    docs/mechanisms.md, "Composite records".
    """
    if composition not in COMPOSITIONS:
        raise InvalidArgument("composition", f"must be one of {COMPOSITIONS}, got {composition!r}")
    comps = tuple(components)
    if not comps:
        raise InvalidArgument("components", "a composite release needs at least one component")
    units = {c.unit for c in comps}
    if len(units) != 1:
        raise InvalidArgument("components", f"must share one unit of privacy, got {sorted(units)}")
    unit = comps[0].unit
    extra: dict[str, Any] = {}
    if composition == "parallel":
        if over not in PARALLEL_OVER:
            raise InvalidArgument(
                "over",
                f"a parallel composite must say what its components are disjoint in, one of {PARALLEL_OVER}; got {over!r}",
            )
        if over == "entries" and unit != "entry":
            raise InvalidArgument(
                "over", f"components disjoint only in entries are not parallel per {unit!r}; compose them sequentially"
            )
        extra["parallel_over"] = over
    elif over is not None:
        raise InvalidArgument("over", f"applies to parallel composites only, got {over!r} for {composition!r}")
    combine = max if composition == "parallel" else sum
    delta = combine(c.delta for c in comps)
    if delta >= 1:
        raise InvalidArgument("components", f"compose to δ = {delta} >= 1")
    return ReleaseRecord(
        mechanism="composite",
        level="model",
        unit=unit,
        epsilon=combine(c.epsilon for c in comps),
        delta=delta,
        sensitivity=None,
        sensitivity_norm="none",
        parameters={"composition": composition, **extra, **(parameters or {})},
        components=comps,
        **randomness.record_fields(),
    )
