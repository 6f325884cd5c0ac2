"""Domain errors of PrivFusion.

Every error names the field (or object) at fault and the rule it broke. The gRPC service maps
these classes to status codes in exactly one place (``peer.service``); nothing else in the math
core knows about gRPC.
"""

from __future__ import annotations


class PrivFusionError(Exception):
    """Base class. ``status`` is the name of the gRPC status code the service maps it to."""

    status = "INTERNAL"


class InvalidArgument(PrivFusionError, ValueError):
    """A value breaks a rule: ``field`` names it, ``rule`` says what was expected."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, rule: str):
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


class NotFound(PrivFusionError, LookupError):
    status = "NOT_FOUND"


class FailedPrecondition(PrivFusionError):
    """The request is well formed but the system is not in a state to serve it."""

    status = "FAILED_PRECONDITION"


class BudgetExhausted(PrivFusionError):
    """Serving the request would overspend a privacy budget; nothing was released."""

    status = "RESOURCE_EXHAUSTED"


class PermissionDenied(PrivFusionError):
    status = "PERMISSION_DENIED"


class Unauthenticated(PrivFusionError):
    status = "UNAUTHENTICATED"


class Unavailable(PrivFusionError):
    status = "UNAVAILABLE"


class Unsupported(InvalidArgument):
    """A model or layer kind the component does not handle."""
