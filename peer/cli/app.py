"""The ``privfusion`` command line.

Each area of the peer registers its subcommands from its own module in ``peer.cli``
(a ``register(subparsers)`` function that adds parsers whose ``func(args) -> int`` does the work).
Commands of the layers above the peer — ``round`` and ``roster`` (``coordinator_free.cli``),
``simulate`` and ``demo`` (``scenarios.cli``) — come through the entry-point group
``privfusion.commands`` that ``pyproject.toml`` declares: each entry point is named after the one
top-level command it adds, and its object is such a ``register`` function. That keeps the
layering (nothing under ``peer/`` imports ``coordinator_free`` or ``scenarios``) and lets
another installed package add commands.

An entry point is loaded only when its command is asked for, or when the whole list is needed
(``privfusion --help``, an unknown command, ``build_parser()`` without a command). The
registering modules import their heavy dependencies inside the commands, so building a parser
stays fast.

Domain errors are turned into one clear line on stderr and exit status 2, here and only here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from importlib.metadata import EntryPoint, entry_points

from peer.base.errors import PrivFusionError

# Modules in peer.cli, each with register(subparsers).
COMMAND_MODULES: tuple[str, ...] = (
    "ledger",
    "account",
    "pool",
    "merge",
    "experiment",
    "peer",
    "release",
    "model",
    "probe",
    "site",
    "evaluate",
)

# Entry points: name = the command, object = register(subparsers) adding that command.
COMMAND_GROUP = "privfusion.commands"
# What this project's pyproject.toml declares there (named only to explain their absence).
PROJECT_ENTRY_COMMANDS: tuple[str, ...] = ("round", "roster", "simulate", "demo")
_NOT_INSTALLED = (
    f"the commands of the entry-point group {COMMAND_GROUP!r} ({', '.join(PROJECT_ENTRY_COMMANDS)}) "
    "are not installed: install the privfusion package (pip install -e .)"
)


def command_entry_points() -> dict[str, EntryPoint]:
    """The installed ``privfusion.commands`` entry points by command name (the first one found
    on ``sys.path`` wins, as for imports)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        found.setdefault(ep.name, ep)
    return found


def _base_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="privfusion",
        description="Private model fusion between sites that do not trust each other.",
        add_help=add_help,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return parser


def command_of(argv: list[str]) -> str | None:
    """The command word of ``argv`` (None when there is none, e.g. ``--help``)."""
    _, rest = _base_parser(add_help=False).parse_known_args(argv)
    return next((a for a in rest if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every built-in command and the entry-point commands: only ``command``'s
    when it names one, none when it names a built-in one, every one otherwise."""
    parser = _base_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"peer.cli.{name}").register(sub)
    plugins = command_entry_points()
    if command in plugins:
        wanted = [command]
    elif command is not None and command in sub.choices:  # a built-in command: no entry point needed
        wanted = []
    else:  # the whole list: --help, no command, or one nobody registered (argparse lists the choices)
        wanted = list(plugins)
    for name in wanted:
        plugins[name].load()(sub)
    if not plugins:
        parser.epilog = f"Note: {_NOT_INSTALLED}."
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_of(argv)
    parser = build_parser(command)
    if command in PROJECT_ENTRY_COMMANDS and parser.epilog:
        parser.error(f"{command}: {_NOT_INSTALLED}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except PrivFusionError as e:
        print(f"privfusion {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (``privfusion ledger show | head``): end quietly, as a Unix tool
        # does, instead of a traceback; stdout goes to /dev/null so the flush at exit is silent
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
