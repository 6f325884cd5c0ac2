"""The ``privfusion`` command line.

Each area of the system registers its subcommands from its own module in ``peer.cli``
(a ``register(subparsers)`` function that adds parsers whose ``func(args) -> int`` does the work).
Domain errors are turned into one clear line on stderr and exit status 2, here and only here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from peer.base.errors import PrivFusionError

# Modules in peer.cli, each with register(subparsers).
COMMAND_MODULES: tuple[str, ...] = ("ledger", "account", "pool", "merge", "experiment", "peer", "release", "round", "simulate",
                                    "model_import")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="privfusion",
        description="Private model fusion between sites that do not trust each other.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"peer.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except PrivFusionError as e:
        print(f"privfusion {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
