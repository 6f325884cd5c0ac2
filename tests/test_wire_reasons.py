"""The list of refusal reasons in docs/wire.md (7.3) is the set the code can send.

Every ``google.rpc.ErrorInfo.reason`` is an UPPER_SNAKE_CASE string literal in the source: a
``reason=`` argument (also inside a conditional expression) or a class-level ``reason = "..."``
of an error class. The sources under ``peer/`` and ``coordinator_free/`` are scanned with
``ast`` (not imported), so a reason added, renamed or removed in the code without the table
following fails here, and so does a row left in the table for a reason no code sends. Where the
error's class fixes its status, the table's status must be that one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
REASON = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
#: gRPC's status code names (7.3 names some in backticks; they are not reasons)
STATUS_CODES = frozenset(code.name for code in grpc.StatusCode)
#: error classes whose status is fixed (peer.base.errors, peer.net.limits)
STATUS_OF_CLASS = {
    "InvalidArgument": "INVALID_ARGUMENT",
    "Unsupported": "INVALID_ARGUMENT",
    "NotFound": "NOT_FOUND",
    "FailedPrecondition": "FAILED_PRECONDITION",
    "BudgetExhausted": "RESOURCE_EXHAUSTED",
    "Busy": "RESOURCE_EXHAUSTED",
    "PermissionDenied": "PERMISSION_DENIED",
    "Unauthenticated": "UNAUTHENTICATED",
    "Unavailable": "UNAVAILABLE",
    "StreamTimeout": "DEADLINE_EXCEEDED",
}


def _literals(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def reasons_in_code() -> dict[str, set[str | None]]:
    """Every reason literal in the sources, with the statuses its raising classes fix (None: not fixed there)."""
    found: dict[str, set[str | None]] = {}
    for path in sorted([*(ROOT / "peer").rglob("*.py"), *(ROOT / "coordinator_free").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                for kw in node.keywords:
                    if kw.arg == "reason":
                        for value in _literals(kw.value):
                            if REASON.match(value):
                                found.setdefault(value, set()).add(STATUS_OF_CLASS.get(name))
            elif isinstance(node, ast.ClassDef):
                status = next(
                    (
                        s.value.value
                        for s in node.body
                        if isinstance(s, ast.Assign)
                        and [getattr(t, "id", None) for t in s.targets] == ["status"]
                        and isinstance(s.value, ast.Constant)
                    ),
                    None,
                )
                for s in node.body:
                    if isinstance(s, ast.Assign) and [getattr(t, "id", None) for t in s.targets] == ["reason"]:
                        for value in _literals(s.value):
                            if REASON.match(value):
                                found.setdefault(value, set()).add(status)
    return found


def reasons_in_doc() -> tuple[dict[str, str], set[str]]:
    """(reason → status of each row of the 7.3 table, every reason named anywhere in 7.3)."""
    text = (ROOT / "docs" / "wire.md").read_text()
    section = text[text.index("### 7.3 Error details") : text.index("## 8. Fuse and relays")]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([A-Z0-9_]+)` \| ([A-Z_]+) \|", line)
        if m:
            assert m.group(1) not in rows, f"docs/wire.md 7.3 lists {m.group(1)} twice"
            rows[m.group(1)] = m.group(2)
    named = {t for t in re.findall(r"`([A-Z0-9_]+)`", section) if REASON.match(t) and t not in STATUS_CODES}
    return rows, named


def test_the_reasons_listed_in_the_wire_contract_are_exactly_those_the_code_sends():
    code = reasons_in_code()
    rows, named = reasons_in_doc()
    assert len(code) >= 20  # the scan reads the code (a scanner that finds nothing proves nothing)
    assert set(rows) <= named
    assert sorted(set(code) - named) == [], "reasons the code sends that docs/wire.md 7.3 does not list"
    assert sorted(named - set(code)) == [], "reasons docs/wire.md 7.3 lists that no code sends"
    # the table gives a status for every reason an RPC can send (the secure-aggregation core's
    # are named in 7.3 as sent by no RPC); where the raising class fixes it, it is that status
    for reason in rows:
        fixed = code[reason] - {None}
        assert fixed <= {rows[reason]}, f"{reason}: docs/wire.md says {rows[reason]}, the code raises {sorted(fixed)}"
    for reason in set(code) - set(rows):
        assert reason.startswith("SECAGG_"), f"{reason} needs a row in the table of docs/wire.md 7.3"


def test_the_scanner_finds_reasons_in_each_form_the_code_uses(tmp_path, monkeypatch):
    """The three forms (keyword, conditional keyword, class attribute) are each found, with
    their class's status; a lowercase word passed as ``reason`` (a log field) is not a reason."""
    (tmp_path / "peer").mkdir()
    (tmp_path / "coordinator_free").mkdir()
    (tmp_path / "peer" / "x.py").write_text(
        "class Late(PrivFusionError):\n"
        '    status = "DEADLINE_EXCEEDED"\n'
        '    reason = "TOO_LATE"\n'
        "def f(up):\n"
        '    raise FailedPrecondition("m", reason="NOT_NOW")\n'
        "def g(up):\n"
        '    raise PeerError(s, "m", reason="A_B" if up else "C_D")\n'
        "def h(event):\n"
        '    event("not-asked", reason="interrupted")\n'
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert reasons_in_code() == {
        "TOO_LATE": {"DEADLINE_EXCEEDED"},
        "NOT_NOW": {"FAILED_PRECONDITION"},
        "A_B": {None},
        "C_D": {None},
    }
