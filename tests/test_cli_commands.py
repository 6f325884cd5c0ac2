"""The ``privfusion`` command line's structure: the commands of coordinator_free and scenarios
come through the ``privfusion.commands`` entry points that pyproject.toml declares (nothing under
peer/ imports those packages), each entry point adds exactly the command it is named after, and
an entry point is loaded only when its command (or the whole list) is asked for.

Discovery is tested against a distribution made here from pyproject.toml (a dist-info directory
first on the path), so these tests do not depend on how (or whether) the package is installed."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from peer.cli.app import COMMAND_GROUP, PROJECT_ENTRY_COMMANDS, command_of

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DECLARED = PROJECT["entry-points"][COMMAND_GROUP]


def test_pyproject_declares_the_commands_app_names():
    assert tuple(DECLARED) == PROJECT_ENTRY_COMMANDS
    assert PROJECT["scripts"] == {"privfusion": "peer.cli.app:main"}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_each_entry_point_resolves_and_adds_exactly_its_command(name):
    module, _, attr = DECLARED[name].partition(":")
    register = getattr(importlib.import_module(module), attr)
    sub = argparse.ArgumentParser(prog="x").add_subparsers(dest="command")
    register(sub)
    assert list(sub.choices) == [name]


def test_nothing_under_peer_imports_the_layers_above():
    offenders = []
    for path in sorted((ROOT / "peer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] in ("coordinator_free", "scenarios")
            ]
    assert offenders == []


@pytest.mark.parametrize(
    "argv,command",
    [
        (["round", "--config", "x"], "round"),
        (["--log-level", "DEBUG", "simulate", "--out", "d"], "simulate"),
        (["--log-level=INFO", "peer", "serve"], "peer"),
        (["--help"], None),
        ([], None),
    ],
)
def test_command_of(argv, command):
    assert command_of(argv) == command


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """A 'privfusion' distribution with pyproject.toml's entry points, first on the path."""
    top = tmp_path_factory.mktemp("dist")
    info = top / f"privfusion-{PROJECT['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: privfusion\nVersion: {PROJECT['version']}\n")
    lines = [
        "[console_scripts]",
        *(f"{k} = {v}" for k, v in PROJECT["scripts"].items()),
        "",
        f"[{COMMAND_GROUP}]",
        *(f"{k} = {v}" for k, v in DECLARED.items()),
    ]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return top


def _run(dist: Path | None, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` with ``dist`` first on the path. The working directory is ``dist``'s parent, not
    the checkout: ``python -c`` puts the working directory first on sys.path, and the checkout
    holds the editable install's ``privfusion.egg-info``, whose entry points would win."""
    path = [str(ROOT), str(ROOT / "proto")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(([str(dist)] if dist else []) + path))
    cwd = dist.parent if dist else None
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=cwd)


PROBE = """
import json, sys
from peer.cli.app import build_parser
parser = build_parser({command!r})
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('coordinator_free', 'scenarios'))
print(json.dumps([parser.format_help(), loaded]))
"""


@pytest.mark.parametrize(
    "command,loaded",
    [
        (None, {"coordinator_free.cli", "scenarios.cli"}),  # --help: the whole list
        ("round", {"coordinator_free.cli"}),
        ("simulate", {"scenarios.cli"}),
        ("ledger", set()),  # a built-in command: no entry point
    ],
)
def test_entry_points_are_found_and_loaded_only_when_asked(dist, command, loaded):
    r = _run(dist, PROBE.format(command=command))
    assert r.returncode == 0, r.stderr
    text, modules = json.loads(r.stdout)
    assert {m for m in modules if m.endswith(".cli")} == loaded
    if command is None:
        for name in ("ledger", "peer", *PROJECT_ENTRY_COMMANDS):
            assert f"\n    {name} " in text, name


def test_without_the_entry_points_the_error_says_to_install(tmp_path):
    # a distribution without the group: the commands are missing and the error says why
    bare = tmp_path / "bare"
    info = bare / f"privfusion-{PROJECT['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: privfusion\nVersion: {PROJECT['version']}\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nprivfusion = peer.cli.app:main\n")
    r = _run(bare, "from peer.cli.app import main; main(['round', '--config', 'x'])")
    assert r.returncode == 2 and "pip install -e ." in r.stderr and COMMAND_GROUP in r.stderr, r.stderr


def test_python_m_peer_cli_runs_an_entry_point_command(dist, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(dist), str(ROOT), str(ROOT / "proto")]))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "demo",
            "site",
            "--scenario",
            "nonexistent.toml",
            "--site",
            "a",
            "--dir",
            str(tmp_path),
            "--roster",
            "r.toml",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # argparse got as far as the demo command's own choices: the command was registered
    assert r.returncode == 2 and "argument --scenario: invalid choice" in r.stderr, r.stderr
