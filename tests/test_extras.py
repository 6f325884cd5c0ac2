"""Optional extras: a peer's install has neither matplotlib ('plots') nor grpcio-tools ('dev').

Their absence is simulated in a subprocess by an import hook that refuses both (the test
environment has them installed): every module of the project must still import, the commands a
container runs must still work, and a command that needs an extra must say which one to install
before doing any work."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]

BLOCK = """
import importlib.abc, sys
class _NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("matplotlib", "grpc_tools"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoExtras())
"""


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "proto")]))
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _names(reqs: list[str]) -> set[str]:
    return {r.split("==")[0].lower() for r in reqs}


def test_the_daemon_needs_no_extra_and_the_test_extra_holds_every_other():
    assert not _names(PROJECT["dependencies"]) & {"matplotlib", "grpcio-tools"}
    assert _names(EXTRAS["plots"]) == {"matplotlib"} and _names(EXTRAS["dev"]) == {"grpcio-tools"}
    # the same pins, so that `.[test]` installs what `.[plots]` and `.[dev]` would
    assert set(EXTRAS["plots"]) | set(EXTRAS["dev"]) <= set(EXTRAS["test"])
    scripts = {name: (ROOT / "scripts" / name).read_text() for name in ("simulate.sh", "test.sh")}
    assert "-e '.[plots]'" in scripts["simulate.sh"] and "-e '.[test]'" in scripts["test.sh"]


def test_every_module_imports_without_the_extras():
    r = _run("""
import pkgutil, importlib
names = []
for top in ("peer", "coordinator_free", "scenarios"):
    pkg = importlib.import_module(top)
    for m in pkgutil.walk_packages(pkg.__path__, top + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
            names.append(m.name)
assert "matplotlib" not in sys.modules and "grpc_tools" not in sys.modules
print(len(names))
""")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 40


def test_commands_that_plot_say_which_extra_before_they_run(tmp_path):
    r = _run(f"""
import argparse
from peer.base.extras import MissingExtra, pyplot
try:
    pyplot("x")
except MissingExtra as e:
    print("pyplot:", e)
from scenarios.cli import register
sub = argparse.ArgumentParser().add_subparsers(dest="command")
register(sub)
args = sub.choices["simulate"].parse_args(["--out", {str(tmp_path / "run")!r}])
try:
    args.func(args)
except MissingExtra as e:
    print("simulate:", e)
""")
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert set(lines) == {"pyplot", "simulate"}
    for text in lines.values():
        assert "install the 'plots' extra" in text and "privfusion[plots]" in text
    assert not (tmp_path / "run").exists()  # refused before the simulation started


def test_gen_proto_says_which_extra(tmp_path):
    r = _run(f"""
import runpy
sys.argv = ["gen_proto.py", "--out", {str(tmp_path)!r}]
runpy.run_path("scripts/gen_proto.py", run_name="__main__")
""")
    assert r.returncode == 1 and "install the 'dev' extra" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_container_s_commands_work_without_the_extras(tmp_path):
    """What docker/init-sites.sh and the compose services run: demo site, peer init, roster pin,
    and the daemon's modules."""
    site = tmp_path / "hospital-a"
    r = _run(
        f"""
from scenarios.cli import register_demo
from peer.cli.app import main
import argparse
sub = argparse.ArgumentParser().add_subparsers(dest="command")
register_demo(sub)
args = sub.choices["demo"].parse_args(["site", "--scenario", "hospitals.toml", "--site", "hospital-a",
                                                "--dir", {str(site)!r}, "--roster", "roster.toml"])
assert args.func(args) == 0
assert main(["peer", "init", "--name", "hospital-a", "--dir", {str(site / "identity")!r}]) == 0
import peer.net.daemon
peer.net.daemon.SiteConfig.load({str(site / "site.toml")!r})
assert "matplotlib" not in sys.modules and "grpc_tools" not in sys.modules
# the compose daemon runs without --simulation: its pool's noise is CSPRNG, so it starts
peer.net.daemon.check_servable(peer.net.daemon.SiteConfig.load({str(site / "site.toml")!r}), simulation=False)
""",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
