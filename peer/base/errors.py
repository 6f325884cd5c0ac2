"""Domain errors of PrivFusion.

Every error names the field (or object) at fault and the rule it broke. The gRPC service maps
these classes to status codes in exactly one place (``peer.net.service``); nothing else in the math
core knows about gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "BudgetExhausted",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "PrivFusionError",
    "Unauthenticated",
    "Unavailable",
    "Unsupported",
]


def detail_text(value: Any) -> str:
    """A metadata value as text: floats exactly (``repr``; ``inf`` for an unbounded end)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
    return str(value)


class PrivFusionError(Exception):
    """Base class. ``status`` is the name of the gRPC status code the service maps it to.

    Optional structured details travel beside the message (the service turns them into
    ``google.rpc`` details; :class:`peer.net.client.PeerError` reads them back):
    ``reason`` — a short UPPER_SNAKE_CASE name of the refusal (``google.rpc.ErrorInfo.reason``),
    ``metadata`` — public facts about it as text (``ErrorInfo.metadata``), e.g. the ε spent and
    remaining in a budget or the ε range a pool can reach; ``violations`` — (field, rule) pairs
    (``google.rpc.BadRequest``), set by :class:`InvalidArgument`. Nothing private goes in them.
    """

    status = "INTERNAL"
    reason = ""
    metadata: Mapping[str, str] = {}

    def __init__(self, *args: Any, reason: str | None = None, metadata: Mapping[str, Any] | None = None):
        super().__init__(*args)
        if reason is not None:
            self.reason = reason
        self.metadata = {str(k): detail_text(v) for k, v in (metadata or {}).items()}

    @property
    def violations(self) -> tuple[tuple[str, str], ...]:
        return ()


class InvalidArgument(PrivFusionError, ValueError):
    """A value breaks a rule: ``field`` names it, ``rule`` says what was expected.

    Its reason is ``INVALID_FIELD`` unless a raise names a more specific one (e.g.
    ``TARGET_UNREACHABLE``): every refusal then carries an ErrorInfo a client can switch on,
    and the field at fault travels, machine-readable, in the BadRequest."""

    status = "INVALID_ARGUMENT"
    reason = "INVALID_FIELD"

    def __init__(self, field: str, rule: str, *, reason: str | None = None, metadata: Mapping[str, Any] | None = None):
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}", reason=reason, metadata=metadata)

    @property
    def violations(self) -> tuple[tuple[str, str], ...]:
        return ((self.field, self.rule),)


class NotFound(PrivFusionError, LookupError):
    status = "NOT_FOUND"


class FailedPrecondition(PrivFusionError):
    """The request is well formed but the system is not in a state to serve it."""

    status = "FAILED_PRECONDITION"


class BudgetExhausted(PrivFusionError):
    """Serving the request would overspend a privacy budget; nothing was released. Its
    metadata names the budget and, as far as the site's policy shows them to the requester,
    the ε spent and remaining at the budget's δ."""

    status = "RESOURCE_EXHAUSTED"
    reason = "BUDGET_EXHAUSTED"


class PermissionDenied(PrivFusionError):
    status = "PERMISSION_DENIED"


class Unauthenticated(PrivFusionError):
    status = "UNAUTHENTICATED"


class Unavailable(PrivFusionError):
    status = "UNAVAILABLE"


class Unsupported(InvalidArgument):
    """A model or layer kind the component does not handle."""
