"""``privfusion experiment NAME``: reproduce a result of the papers, with figures and tables.

Each experiment lives in its own module of ``peer.cli`` exposing
``register_experiment(experiment_subparsers)``; list it in ``EXPERIMENT_MODULES``.
"""

from __future__ import annotations

import importlib

EXPERIMENT_MODULES: tuple[str, ...] = ("experiment_fusion", "experiment_merging", "experiment_paper")


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="reproduce a paper's results (figures, tables, JSON)")
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    sub.required = True
    for name in EXPERIMENT_MODULES:
        importlib.import_module(f"peer.cli.{name}").register_experiment(sub)
