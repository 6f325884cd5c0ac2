"""The ``privfusion`` command line: one module per area, each registering its subcommands."""

from peer.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
