"""The checks of privacy parameters, one rule each for ε and δ wherever they enter: requests,
budgets, accountants, release records.

``check_epsilon`` and ``check_delta`` take the value and the name of the field it came from, and
return it as a float or raise :class:`InvalidArgument` naming that field and the rule. A value must
be a real number (not a bool, not a string: a number written as text is a mistake upstream);
the keyword arguments widen or narrow the default range for the caller's meaning:

- ε: default (0, ∞) — a release or a budget with ε = 0 would need infinite noise;
  ``zero=True`` admits 0 (an ε at which to evaluate δ(ε), a record of a release that spent
  nothing), ``infinite=True`` admits ∞ (a record of a release with no pure-ε guarantee),
  ``maximum`` bounds it above (inclusive).
- δ: default (0, 1) — δ ≥ 1 promises nothing; ``zero=True`` admits 0 (a pure ε-DP budget or
  record), ``maximum`` bounds it above (inclusive, below 1).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from peer.base.errors import InvalidArgument


def _real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (bool excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def check_epsilon(
    value: Any, field: str = "epsilon", *, zero: bool = False, infinite: bool = False, maximum: float = math.inf
) -> float:
    """ε as a float: a number > 0 (≥ 0 with ``zero``), finite (unless ``infinite``), ≤ ``maximum``."""
    v = _real(value)
    ok = (
        v is not None
        and (v >= 0 if zero else v > 0)
        and (math.isfinite(v) or (infinite and v == math.inf))
        and v <= maximum
    )
    if not ok:
        lower = ">= 0" if zero else "> 0"
        upper = f" and <= {maximum:g}" if maximum < math.inf else ""
        kind = "a number (or inf)" if infinite else "a finite number"
        raise InvalidArgument(field, f"must be {kind} {lower}{upper}, got {value!r}")
    return v


def check_delta(value: Any, field: str = "delta", *, zero: bool = False, maximum: float | None = None) -> float:
    """δ as a float: in (0, 1) — [0, 1) with ``zero``; (0, maximum] when ``maximum`` < 1 is given."""
    if maximum is not None and not 0 < maximum < 1:
        raise ValueError(f"check_delta: maximum must be in (0, 1), got {maximum!r}")
    v = _real(value)
    ok = v is not None and (v >= 0 if zero else v > 0) and (v <= maximum if maximum is not None else v < 1)
    if not ok:
        interval = ("[0, " if zero else "(0, ") + (f"{maximum:g}]" if maximum is not None else "1)")
        raise InvalidArgument(field, f"must be a number in {interval}, got {value!r}")
    return v
