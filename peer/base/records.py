"""The release record: one immutable description of what a privacy mechanism released.

In the style of dp_accounting's DpEvent, a record says *what was done* — mechanism, public
parameters, unit of privacy, sensitivity, (ε, δ), randomness, counterparty, time — and nothing
else. It flows unchanged from the mechanism to the ledger, into the signed receipt sent with the
bytes, and into reports. Accountants interpret records; they never reach into models or sockets.

Vocabulary
----------
``level``
    ``"model"``: local DP on a released model's neurons (PrivFusion's feature/weight releases).
    ``"data"``: central DP on a site's training records (DP-SGD pools, RS/LC merges).
``unit``
    What neighbouring means. Model level: ``"neuron"`` (default: one neuron's activation row and
    incoming weight vector may change arbitrarily within the clip bounds) or ``"entry"`` (one
    scalar entry changes; only when explicitly asked for). Data level: ``"record:replace-one"``
    or ``"record:add-remove"``.
``sensitivity_norm``
    The norm the sensitivity is measured in: ``"l1"``, ``"l2"``, or ``"range"`` (the width of
    the clip interval, for mechanisms such as multi-bit whose guarantee is stated per input box).
``randomness``
    ``"csprng"``: noise from a generator seeded with 128 bits from the operating system's CSPRNG,
    fresh per release (the seed is never stored). ``"fixed-seed"``: a test/simulation option;
    the record carries the ``seed`` and, in its serialised form, ``randomness_warning`` =
    ``"fixed seed: not private"`` — anyone who knows the seed can subtract the noise.
    ``"none"``: no randomness was drawn (hand-made records in tests).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument

__all__ = ["FIXED_SEED_WARNING", "ReleaseRecord", "now_rfc3339"]

LEVELS = ("model", "data")
UNITS = ("neuron", "entry", "record:replace-one", "record:add-remove", "none")
NORMS = ("l1", "l2", "range", "none")
#: What every serialised fixed-seed record says (``randomness_warning``).
FIXED_SEED_WARNING = "fixed seed: not private"


def _freeze(value: Any) -> Any:
    """Deep-freeze JSON-like data: dicts to read-only mappings, lists to tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument("parameters", f"must be finite numbers, got {value!r}")
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):  # numpy scalar
        return _freeze(value.item())
    raise InvalidArgument("parameters", f"must be JSON values, got {type(value).__name__}")


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True, eq=True)
class ReleaseRecord:
    """What one mechanism released, and under which guarantee.

    ``epsilon``/``delta`` are the guarantee of this release alone, for ``unit`` at ``level``.
    ``parameters`` holds only public values (clip bounds, noise scale, calibration method,
    dimensions). ``components`` lists the records of sub-releases of a composite release (for
    example the per-layer releases of one model's features); the composite's own
    ``epsilon``/``delta`` then state how they compose (``parameters["composition"]``).
    """

    mechanism: str
    level: str
    unit: str
    epsilon: float
    delta: float
    sensitivity: float | None
    sensitivity_norm: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    randomness: str = "csprng"
    seed: int | None = None
    subject: str = ""
    counterparty: str | None = None
    created_at: str = field(default_factory=now_rfc3339)
    release_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    components: tuple[ReleaseRecord, ...] = ()

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise InvalidArgument("level", f"must be one of {LEVELS}, got {self.level!r}")
        if self.unit not in UNITS:
            raise InvalidArgument("unit", f"must be one of {UNITS}, got {self.unit!r}")
        if self.sensitivity_norm not in NORMS:
            raise InvalidArgument("sensitivity_norm", f"must be one of {NORMS}, got {self.sensitivity_norm!r}")
        eps = check_epsilon(self.epsilon, "epsilon", zero=True, infinite=True)
        delta = check_delta(self.delta, "delta", zero=True)
        if self.sensitivity is not None and not (self.sensitivity >= 0 and math.isfinite(self.sensitivity)):
            raise InvalidArgument("sensitivity", f"must be finite and >= 0, got {self.sensitivity!r}")
        if self.randomness not in ("csprng", "fixed-seed", "none"):
            raise InvalidArgument("randomness", f"must be csprng, fixed-seed or none, got {self.randomness!r}")
        if self.randomness == "fixed-seed" and self.seed is None:
            raise InvalidArgument("seed", "a fixed-seed release must report its seed")
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", delta)
        object.__setattr__(self, "parameters", _freeze(dict(self.parameters)))
        object.__setattr__(self, "components", tuple(self.components))

    def with_(self, **changes: Any) -> ReleaseRecord:
        """A copy with some fields changed (records themselves never change)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "components":
                v = [c.to_dict() for c in v]
            elif f.name == "parameters":
                v = _thaw(v)
            out[f.name] = v
        if math.isinf(out["epsilon"]):
            out["epsilon"] = "inf"
        if self.randomness == "fixed-seed":
            out["randomness_warning"] = FIXED_SEED_WARNING
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReleaseRecord:
        if not isinstance(data, Mapping):
            raise InvalidArgument("record", "must be a JSON object")
        known = {f.name for f in fields(cls)} | {"randomness_warning"}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument("record", f"unknown fields {sorted(unknown)}")
        kwargs = dict(data)
        # derived from ``randomness`` (see to_dict; records written before it carry none): one
        # that contradicts it is refused
        warning = kwargs.pop("randomness_warning", None)
        if warning is not None and (warning != FIXED_SEED_WARNING or kwargs.get("randomness") != "fixed-seed"):
            raise InvalidArgument(
                "randomness_warning",
                f"only a 'fixed-seed' record carries it, as {FIXED_SEED_WARNING!r}; "
                f"got {warning!r} with randomness {kwargs.get('randomness')!r}",
            )
        if kwargs.get("epsilon") == "inf":
            kwargs["epsilon"] = math.inf
        kwargs["components"] = tuple(cls.from_dict(c) for c in kwargs.get("components", ()))
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise InvalidArgument("record", str(e)) from None

    def canonical_json(self) -> bytes:
        """Deterministic bytes of the record: what signatures and checksums are taken over."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> ReleaseRecord:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument("record", f"is not valid JSON: {e}") from None
        return cls.from_dict(data)
