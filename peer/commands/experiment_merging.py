"""``privfusion experiment merging``: DP model merging (RS vs LC, PLD vs RDP)."""

from __future__ import annotations


def register_experiment(sub) -> None:
    p = sub.add_parser("merging", help="DP model merging: Gaussian mean estimation and digits logistic regression")
    p.set_defaults(func=lambda args: 0)
