"""Optional dependencies: the "extras" of the privfusion package, and the error that says which
one to install when a command needs a module that is missing.

A peer's own install (``pip install privfusion``: the daemon, rounds, the ledger) needs none:

- ``plots`` — matplotlib: the figures of ``privfusion simulate`` and ``privfusion experiment``;
- ``dev`` — grpcio-tools: generating the gRPC code from ``proto/`` (``scripts/gen_proto.py``);
- ``test`` — the test tools and everything the tests use, both extras above included
  (``scripts/test.sh``).

Modules of an extra are imported inside the functions that use them, never at module level, so
that importing any module of the project works without them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from peer.base.errors import FailedPrecondition

__all__ = ["LazyModule", "pyplot", "require"]


class MissingExtra(FailedPrecondition):
    """A module of an optional extra is not installed; the message names the extra."""

    def __init__(self, module: str, extra: str, purpose: str):
        self.module, self.extra = module, extra
        super().__init__(
            f"{purpose} needs {module}, which is not installed: install the {extra!r} extra "
            f"(pip install 'privfusion[{extra}]', or pip install -e '.[{extra}]' from a checkout)"
        )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` (of the optional ``extra``), or raise :class:`MissingExtra`. Only the
    module's own absence is turned into that error: a module it fails to import is reported as is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is not None and (e.name == top or e.name.startswith(top + ".")):
            raise MissingExtra(module, extra, purpose) from None
        raise


class LazyModule:
    """A module imported at its first attribute access, for a dependency that is slow to import
    and needed by few commands. dp-accounting's package (which imports scipy.signal) costs about
    1.1 s of CPU in every process that imports it, and every command that opens a site used to
    (the ledger imports the accountant): ``privfusion evaluate``, ``model train`` and a daemon
    without pools never compute a PLD. ``LazyModule("dp_accounting.pld.pld_pmf").DensePLDPmf``
    imports the module there, once; the name stays usable as a module would be."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):  # copy/pickle/inspect probes: not a reason to import
            raise AttributeError(attribute)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r}, {'imported' if self._module is not None else 'not imported yet'})"


def pyplot(purpose: str = "plotting"):
    """matplotlib's pyplot on the non-interactive Agg backend (figures go to files only)."""
    matplotlib = require("matplotlib", "plots", purpose)
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", "plots", purpose)
