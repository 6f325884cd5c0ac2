"""Every refusal that can reach the wire carries a reason (docs/wire.md 7.3).

The sources are scanned with ``ast`` (not imported). In the *serving scope* below — the code a
call runs between the servicer and its reply — every construction of an error class
(``PrivFusionError`` and its subclasses, found in ``peer/`` with their inheritance) must carry
an UPPER_SNAKE reason: a ``reason=`` argument, or a class-level ``reason = "..."`` on the class
or one of its bases (``InvalidArgument``: ``INVALID_FIELD``). A construction is checked, not only
a ``raise``, because an error may be made first and raised later (``limits.py``'s deadline).

Scope: whole modules of ``peer/net`` that serve a call (the servicer, the site and its offer,
limits, the Fuse and partner code, the wire codecs), ``peer/desk`` (the release desk),
``peer/budget/policy.py``, ``peer/dp/pools.py``, ``peer/dp/accounting/per_unit.py`` and the
ledger's functions a charge runs through. Outside it (refusals at a daemon's or a ledger's start,
the CLI, the client's own checks of what a server sent) an error never reaches a caller as a
gRPC status; ``tests/test_wire_reasons.py`` checks that every reason is listed in 7.3.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REASON = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")

#: modules every part of which serves a call
SERVING_MODULES = (
    "peer/net/service.py",
    "peer/net/site.py",
    "peer/net/site_offer.py",
    "peer/net/limits.py",
    "peer/net/fuse.py",
    "peer/net/partners.py",
    "peer/net/releases.py",
    "peer/net/peer_info.py",
    "peer/net/wire.py",
    "peer/net/messages.py",
    "peer/net/codec.py",
    "peer/budget/policy.py",
    "peer/dp/pools.py",
    "peer/dp/accounting/per_unit.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "peer" / "desk").glob("*.py")),
)
#: the ledger's code a charge, a delivery event, a cancellation or a serve-again runs through
#: (its open, schema, verification and reading refuse before the daemon serves, or in ledger commands)
SERVING_FUNCTIONS = {
    "peer/budget/storage.py": {"_write"},
    "peer/budget/charging.py": {
        "budgets_for",
        "relayed_budgets",
        "interpret",
        "charge",
        "parts",
        "check_pool",
        "refuse",
        "record_event",
    },
    "peer/budget/corrections.py": {"cancel", "serve_again"},
}


def _class_reason(node: ast.ClassDef) -> str | None:
    for s in node.body:
        if (
            isinstance(s, ast.Assign)
            and [getattr(t, "id", None) for t in s.targets] == ["reason"]
            and isinstance(s.value, ast.Constant)
            and isinstance(s.value.value, str)
        ):
            return s.value.value
    return None


def error_classes(root: Path = ROOT) -> dict[str, str]:
    """Every error class in ``peer/`` (name → its reason, inherited; "" when it has none)."""
    classes: dict[str, tuple[list[str], str | None]] = {}
    for path in sorted((root / "peer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (bases, _class_reason(node))

    def reason_of(name: str, seen: frozenset[str] = frozenset()) -> str | None:
        """The class's reason ("" for the base, None when it is not an error class)."""
        if name == "PrivFusionError":
            return ""
        if name not in classes or name in seen:
            return None
        bases, own = classes[name]
        inherited = [r for r in (reason_of(b, seen | {name}) for b in bases) if r is not None]
        if not inherited:
            return None
        return own if own is not None else next((r for r in inherited if r), "")

    return {name: r for name in classes if (r := reason_of(name)) is not None}


def _in_scope(tree: ast.Module, functions: set[str] | None):
    if functions is None:
        yield tree
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions:
            yield node


def _reason_values(node: ast.expr) -> list[str] | None:
    """The reasons a ``reason=`` expression can take: a literal, or either arm of a conditional;
    None for anything else (a reason computed at run time cannot be checked here)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _reason_values(node.body), _reason_values(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def refusals_without_reason(root: Path = ROOT) -> list[str]:
    """``path:line Class`` of every error made in the serving scope with no reason."""
    reasons = error_classes(root)
    scope = {m: None for m in SERVING_MODULES} | SERVING_FUNCTIONS
    missing = []
    for rel, functions in scope.items():
        path = root / rel
        if not path.exists():
            continue
        for part in _in_scope(ast.parse(path.read_text(), filename=str(path)), functions):
            for node in ast.walk(part):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name not in reasons:
                    continue
                given = [kw.value for kw in node.keywords if kw.arg == "reason"]
                if given:
                    values = _reason_values(given[0])
                    ok = values is not None and all(REASON.match(v) for v in values)
                else:
                    ok = bool(REASON.match(reasons[name] or ""))
                if not ok:
                    missing.append(f"{rel}:{node.lineno} {name}")
    return missing


def test_every_refusal_a_call_can_reach_carries_a_reason():
    assert all((ROOT / m).exists() for m in SERVING_MODULES if not m.startswith("peer/desk/"))
    assert len(error_classes()) >= 10  # the scan finds the error classes (one that finds none proves nothing)
    assert refusals_without_reason() == [], "refusals with no reason: give each reason= (and a row in docs/wire.md 7.3)"


def test_the_scanner_reports_a_refusal_without_a_reason(tmp_path, monkeypatch):
    """A raise with no reason is found (also one made before it is raised, and inside a scoped
    ledger function); a reason given on the raise or inherited from a class is accepted; a
    lowercase reason is not a reason; code outside the scope is not read."""
    (tmp_path / "peer" / "net").mkdir(parents=True)
    (tmp_path / "peer" / "budget").mkdir()
    (tmp_path / "peer" / "base.py").write_text(
        "class PrivFusionError(Exception):\n"
        '    reason = ""\n'
        "class InvalidArgument(PrivFusionError):\n"
        '    reason = "INVALID_FIELD"\n'
        "class Narrow(InvalidArgument):\n"
        "    pass\n"
        "class NotFound(PrivFusionError):\n"
        '    status = "NOT_FOUND"\n'
    )
    (tmp_path / "peer" / "net" / "service.py").write_text(
        "def f(x):\n"
        '    raise NotFound("no such model")\n'
        "def g(x):\n"
        '    late = NotFound("late")\n'
        "    raise late\n"
        "def h(x):\n"
        '    raise NotFound("m", reason="MODEL_NOT_FOUND")\n'
        '    raise NotFound("m", reason="A_B" if x else "C_D")\n'
        '    raise Narrow("field", "rule")\n'
        '    raise NotFound("m", reason="not-found")\n'
        '    raise NotFound("m", reason=x.reason)\n'
    )
    (tmp_path / "peer" / "budget" / "charging.py").write_text(
        'def charge(ledger):\n    raise NotFound("no charge")\ndef verify(ledger):\n    raise NotFound("at open")\n'
    )
    monkeypatch.setattr(__import__(__name__), "SERVING_MODULES", ("peer/net/service.py",))
    assert refusals_without_reason(tmp_path) == [
        "peer/net/service.py:2 NotFound",
        "peer/net/service.py:4 NotFound",
        "peer/net/service.py:10 NotFound",
        "peer/net/service.py:11 NotFound",
        "peer/budget/charging.py:2 NotFound",
    ]
