"""The README and the command reference cannot drift from the code.

- The README opens with the two commands, and they are the scripts that exist (`.ci/run` calls
  the second).
- `docs/cli.md` has a section for every command of the real parser and names every one of its
  flags there; it has no section for a command that does not exist.
- The README's Install section names every base dependency and extra of `pyproject.toml`, and
  its CPU torch line installs the pinned version.
- Every `privfusion ...` line in a bash block of the README or of `docs/cli.md` parses with the
  real parser (parsed, not run).
- Every relative link of the README, `docs/cli.md` and `docs/experiments.md` names a file of the
  repository.
- The README's example (three sites, one round) runs as written, ports apart (slow).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLI = ROOT / "docs" / "cli.md"
EXPERIMENTS = ROOT / "docs" / "experiments.md"


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(block: str) -> list[str]:
    """The `privfusion ...` commands of a bash block: continuation lines joined, comments,
    redirections and the shell's `for ...; do` / `done` / `&` around them dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r"\s#\s.*$", "", line)
        for part in re.split(r";|&&|\s&(?:\s|$)|\bdo\b", line):
            part = re.sub(r"\d?>\s*\S+", "", part).strip()
            if part.startswith("privfusion "):
                out.append(part)
    return out


def _parser_tree() -> dict[str, argparse.ArgumentParser]:
    from peer.cli.app import build_parser

    tree = {}

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        tree[" ".join(["privfusion", *path])] = p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, [*path, name])

    walk(build_parser(), [])
    return tree


def _sections(text: str) -> dict[str, str]:
    """`## `privfusion X`` headings (any level) → the text up to the next heading."""
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    out = {}
    for head, body in zip(parts[1::2], parts[2::2], strict=True):
        m = re.match(r"#+ `(privfusion[^`]*)`$", head)
        if m:
            out[m.group(1)] = body
    return out


def test_the_readme_opens_with_the_two_commands_and_they_are_the_scripts():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] == "```bash", lines[:3]
    block = lines[3 : lines.index("```", 3)]
    commands = [line.split("#")[0].strip() for line in block]
    assert commands == ["./scripts/simulate.sh", "./scripts/test.sh"], block
    for c in commands:
        script = ROOT / c
        assert script.is_file() and os.access(script, os.X_OK), c
    assert "privfusion simulate" in (ROOT / "scripts" / "simulate.sh").read_text()
    assert re.search(r"^exec \./scripts/test\.sh\s*$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_the_install_section_names_what_pyproject_installs_and_the_torch_pin():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = README.read_text()
    install = text[text.index("## Install") : text.index("\n## ", text.index("## Install") + 1)]
    pins = dict(r.split("==") for r in project["dependencies"])
    # grpcio-health-checking, -reflection, -status: named "grpcio with its health, reflection and status packages"
    names = [n.removeprefix("grpcio-").split("-")[0] if n.startswith("grpcio-") else n for n in pins]
    missing = [n for n in names if not re.search(r"\b" + re.escape(n) + r"\b", install)]
    assert not missing, missing
    for extra, reqs in project["optional-dependencies"].items():
        assert f"`{extra}`" in install, extra
        assert all(r.split("==")[0] in install for r in reqs), (extra, reqs)
    cpu = re.findall(r"--index-url https://download\.pytorch\.org/whl/cpu torch==(\S+)", install)
    assert cpu == [pins["torch"]], (cpu, pins["torch"])
    assert f"`torch=={pins['torch']}`" in install


def test_the_command_reference_has_every_command_and_every_flag():
    tree = _parser_tree()
    sections = _sections(CLI.read_text())
    commands = set(tree) - {"privfusion"}
    assert set(sections) == commands, set(sections) ^ commands
    missing = []
    for name in sorted(commands):
        parser = tree[name]
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            # a bullet of the section starts with the flag (or the positional as --help shows it)
            first = a.option_strings[0] if a.option_strings else parser._get_formatter()._format_action_invocation(a)
            if not re.search(r"^- `" + re.escape(first) + r"(?![\w-])", sections[name], re.M):
                missing.append(f"{name}: {first}")
    assert not missing, missing


def test_every_privfusion_line_of_the_readme_and_the_reference_parses(capsys):
    from peer.cli.app import build_parser

    parser = build_parser()
    seen = 0
    for doc in (README, CLI):
        for block in _bash_blocks(doc.read_text()):
            for c in _commands(block):
                try:
                    args = parser.parse_args(shlex.split(c)[1:])
                except SystemExit:
                    raise AssertionError(f"{doc.name}: {c!r} does not parse: {capsys.readouterr().err}") from None
                assert callable(args.func), c
                seen += 1
    assert seen >= 20, seen


@pytest.mark.parametrize("doc", [README, CLI, EXPERIMENTS], ids=lambda p: p.name)
def test_every_relative_link_names_a_file_of_the_repository(doc):
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative
    bad = [link for link in relative if not (doc.parent / link).exists()]
    assert not bad, bad


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The example's bash block, run in a fresh directory with the ports moved to free ones
    (the only change): three sites, one round, the fused model scored and a peer's ledger shown."""
    text = README.read_text()
    block = _bash_blocks(text[text.index("## Three sites, one round") :])[0]
    moved = block
    for was, now in [
        ("127.0.0.1:5005$n", "127.0.0.1:${PORTS[$n]}"),
        ('address = "127.0.0.1:5005%d"', 'address = "127.0.0.1:%d"'),
        ("$s $n $s >> roster.toml", '$s "${PORTS[$n]}" $s >> roster.toml'),
    ]:
        assert moved.count(was) == 1, f"the example no longer holds {was!r}: update this test"
        moved = moved.replace(was, now)
    script = f"set -euo pipefail\nPORTS=(_ {' '.join(map(str, _free_ports(3)))})\n" + moved
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the daemons, if the script stopped before its kill
    assert proc.returncode == 0, out[-4000:]
    assert "fused with hospital-b, hospital-c" in out, out[-4000:]
    fused = list((tmp_path / "a" / "rounds" / "models").glob("mlp-fused-*.safetensors"))
    assert len(fused) == 1, out[-4000:]
    assert out.count("  accuracy ") == 2, out[-4000:]
    assert "ledger b/ledger.sqlite: 1 entries" in out and "rs-merge" in out, out[-4000:]
    assert "method merged" in out, out[-4000:]
    assert " recommends " in out, out[-4000:]  # model adopt read the round's recommendation
