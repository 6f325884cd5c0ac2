"""The layout shows the architecture: a pure core, a thin shell, no cycle between packages.

Read from the source with ``ast`` (imports inside functions count too), so a lazy import cannot
hide a dependency. The layers, from the bottom:

    peer.base → peer.nn → peer.ldp, peer.dp → peer.budget → peer.desk → peer.net → peer.cli
    coordinator_free (may use peer) → scenarios (may use both)

``peer`` never imports ``coordinator_free`` or ``scenarios``; the core (base, nn, ldp, dp,
budget) and the release desk (``peer.desk``) import no gRPC and no protobuf; the desk is the
only caller of ``Ledger.charge``.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    "peer.base",
    "peer.nn",
    "peer.ldp",
    "peer.dp",
    "peer.budget",
    "peer.desk",
    "peer.net",
    "peer.experiments",
    "peer.cli",
    "coordinator_free",
    "scenarios",
]
# Which layer may import which (its own and those listed). ldp and dp are side by side.
ALLOWED = {
    "peer.base": set(),
    "peer.nn": {"peer.base"},
    "peer.ldp": {"peer.base", "peer.nn"},
    "peer.dp": {"peer.base", "peer.nn"},
    "peer.budget": {"peer.base", "peer.dp"},
    # the release desk: policy → make → record → charge → sign, over a site's state (no wire)
    "peer.desk": {"peer.base", "peer.nn", "peer.ldp", "peer.dp", "peer.budget"},
    "peer.net": {"peer.base", "peer.nn", "peer.ldp", "peer.dp", "peer.budget", "peer.desk"},
    "peer.experiments": {"peer.base", "peer.nn", "peer.ldp", "peer.dp"},
    "peer.cli": {
        "peer.base",
        "peer.nn",
        "peer.ldp",
        "peer.dp",
        "peer.budget",
        "peer.desk",
        "peer.net",
        "peer.experiments",
    },
    # nothing outside peer/cli imports peer.cli: the command line is the top of the peer, and the
    # layers above reach it only through the entry-point group privfusion.commands
    "coordinator_free": {"peer.base", "peer.nn", "peer.ldp", "peer.dp", "peer.budget", "peer.desk", "peer.net"},
    "scenarios": {
        "peer.base",
        "peer.nn",
        "peer.ldp",
        "peer.dp",
        "peer.budget",
        "peer.desk",
        "peer.net",
        "coordinator_free",
    },
}
CORE = ("peer.base", "peer.nn", "peer.ldp", "peer.dp", "peer.budget")
# what imports no gRPC and no protobuf: the core, and the release desk (it does the ledger's I/O)
NO_WIRE = (*CORE, "peer.desk")
# Pure modules that live in the shell's package because they need the site identity (peer.net.identity):
# like the core, no gRPC, no protobuf, and nothing of the shell that does I/O or holds state.
PURE_SHELL_MODULES = {
    "peer.net.secagg": {"peer.base", "peer.dp", "peer.net.identity"},
    # what a peer says about itself, as the site builds it and the client returns it
    "peer.net.peer_info": {"peer.base"},
}
SHELL_ONLY = ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google.protobuf", "google.rpc", "privfusion")


def modules() -> dict[str, Path]:
    out = {}
    for top in ("peer", "coordinator_free", "scenarios"):
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def imports_of(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


def layer_of(name: str) -> str | None:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def test_every_module_belongs_to_a_layer():
    stray = [m for m in modules() if layer_of(m) is None and m != "peer"]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_layers_import_only_what_is_below_them():
    bad = []
    for module, path in modules().items():
        own = layer_of(module)
        if own is None:
            continue
        for name in imports_of(path, module):
            other = layer_of(name)
            if other is None or other == own:
                continue
            if other not in ALLOWED[own]:
                bad.append(f"{module} imports {name} ({own} may not use {other})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_peer_never_imports_coordinator_free_or_scenarios():
    bad = [
        f"{m} imports {n}"
        for m, p in modules().items()
        if m.startswith("peer")
        for n in imports_of(p, m)
        if n.split(".")[0] in ("coordinator_free", "scenarios")
    ]
    assert not bad, bad


def test_the_core_and_the_desk_import_no_grpc_and_no_protobuf():
    bad = [
        f"{m} imports {n}"
        for m, p in modules().items()
        if layer_of(m) in NO_WIRE
        for n in imports_of(p, m)
        if any(n == s or n.startswith(s + ".") for s in SHELL_ONLY)
    ]
    assert not bad, bad


@pytest.mark.parametrize("module", sorted(PURE_SHELL_MODULES))
def test_pure_modules_of_the_shell_import_only_the_core_and_the_identity(module):
    path = modules()[module]
    allowed = PURE_SHELL_MODULES[module]
    bad = [
        n
        for n in imports_of(path, module)
        if any(n == s or n.startswith(s + ".") for s in SHELL_ONLY)
        or (n.startswith("peer") and not any(n == a or n.startswith(a + ".") for a in allowed))
    ]
    assert not bad, f"{module} must stay pure: {bad}"


def public_names(module: str) -> set[str] | None:
    """The module's ``__all__`` (read from the source), or None when it has none."""
    tree = ast.parse(modules()[module].read_text(), module)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def test_coordinator_free_and_scenarios_use_only_the_public_names_of_peer():
    """Every name coordinator_free/ and scenarios/ take from a ``peer`` module is in that
    module's ``__all__`` (a submodule of a package counts as public); ``import peer.x`` would
    reach past it, so names come by ``from peer.x import name``."""
    mods = modules()
    bad = []
    for module, path in mods.items():
        if layer_of(module) not in ("coordinator_free", "scenarios"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad += [
                    f"{module}: import {a.name} (use from ... import)" for a in node.names if a.name.startswith("peer")
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("peer") and not node.level:
                target = node.module
                if target not in mods:
                    bad.append(f"{module}: from {target} (no such module)")
                    continue
                public = public_names(target)
                for a in node.names:
                    if f"{target}.{a.name}" in mods:
                        continue  # a submodule
                    if public is None:
                        bad.append(f"{module}: from {target} import {a.name} ({target} has no __all__)")
                    elif a.name not in public:
                        bad.append(f"{module}: from {target} import {a.name} (not in its __all__)")
    assert not bad, "\n".join(sorted(set(bad)))


def test_nothing_outside_peer_cli_imports_peer_cli():
    bad = [
        f"{m} imports {n}"
        for m, p in modules().items()
        if not (m == "peer.cli" or m.startswith("peer.cli."))
        for n in imports_of(p, m)
        if n == "peer.cli" or n.startswith("peer.cli.")
    ]
    assert not bad, bad


def test_only_the_command_lines_draw_progress_bars():
    """``peer.base.progress`` (tqdm) is imported by command-line modules only: the core and the
    rounds report progress through a callback they are given (``progress=``, ``on_event``)."""
    command_lines = ("peer.cli", "coordinator_free.cli", "scenarios.cli")
    users = {
        m
        for m, p in modules().items()
        for n in imports_of(p, m)
        if n == "peer.base.progress" or n.startswith("peer.base.progress.") or n == "tqdm" or n.startswith("tqdm.")
    } - {"peer.base.progress"}
    assert users, "nothing draws a progress bar"
    bad = sorted(m for m in users if not any(m == c or m.startswith(c + ".") for c in command_lines))
    assert not bad, bad


@pytest.mark.parametrize("module", ["site", "site_config", "site_lock", "site_identity", "site_offer", "peer_info"])
def test_the_site_holds_no_protobuf_types(module):
    site = ROOT / "peer" / "net" / f"{module}.py"
    names = imports_of(site, f"peer.net.{module}")
    assert not [n for n in names if n.startswith(("privfusion", "grpc", "google"))]


#: The one module that may charge a ledger: the release desk (policy → make → record → charge → sign).
CHARGER = "peer.desk.desk"


def charge_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a method named ``charge`` (``x.charge(...)``, however ``x``
    is spelled) or take it as a value (``getattr(x, "charge")``, ``f = ledger.charge``)."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        named = (isinstance(node, ast.Attribute) and node.attr == "charge") or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "methodcaller")
            and any(isinstance(a, ast.Constant) and a.value == "charge" for a in node.args)
        )
        if named:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_release_desk_is_the_only_caller_of_ledger_charge():
    """Every release takes the desk's one path; a second caller of ``Ledger.charge`` is how a
    release gets out uncharged, or charged by other rules, on one path."""
    bad = [
        f"{m}:{line}"
        for m, p in modules().items()
        if m not in (CHARGER, "peer.budget.ledger")
        for line in charge_calls(p)
    ]
    assert not bad, f"only {CHARGER} may charge a ledger: {bad}"
    assert charge_calls(modules()[CHARGER]), f"{CHARGER} no longer charges: the check above checks nothing"


def test_the_charge_check_sees_every_spelling(tmp_path):
    """Guard for the check above: a charge by any spelling is seen."""
    spelled = tmp_path / "m.py"
    spelled.write_text(
        "def f(site, led):\n"
        "    site.ledger.charge(r, 'b')\n"
        "    c = led.charge\n"
        "    getattr(led, 'charge')(r, 'b')\n"
        "    led.charged(r)\n"
        "    words = {'charges': 'charge'}\n"
    )
    assert charge_calls(spelled) == [2, 3, 4]


def test_no_import_cycle_between_modules():
    graph = {m: {n for n in imports_of(p, m) if n in modules()} - {m} for m, p in modules().items()}
    # a package's __init__ re-exporting its own modules is not a cycle between packages
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append([*stack[stack.index(m) :], m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in graph[m]:
            if not (n.startswith(m + ".") or (m.startswith(n + ".") and n in _packages())):
                visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles[:5]


def _packages() -> set[str]:
    return {m for m, p in modules().items() if p.name == "__init__.py"}


@pytest.mark.parametrize("pattern", [r"\b(DESIGN|STYLE|REFERENCES|CONTRACTS)\.md\b", r"\.\./shared\b"])
def test_nothing_cites_a_document_outside_the_repository(pattern):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    rx = re.compile(pattern)
    bad = []
    for f in files:
        p = ROOT / f
        if f == "tests/test_layout.py" or not p.is_file() or p.suffix in (".png", ".npz", ".safetensors"):
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{f}:{i}" for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]
    assert not bad, bad
