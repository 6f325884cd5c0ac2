"""``privfusion ledger show``: a ledger's entries and where every budget stands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from peer.base.errors import NotFound

if TYPE_CHECKING:  # for annotations only: the commands import the ledger when they run
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ledger", help="inspect the privacy-budget ledger")
    sub = parser.add_subparsers(dest="ledger_command", metavar="ACTION")
    sub.required = True
    show = sub.add_parser(
        "show",
        help="entries and spent budgets (filter ε and PLD ε) of a ledger file",
        description="Show a ledger's entries and, per budget (level, unit, model, counterparty), what "
        "was spent by the filter's RDP-derived ε and by PLD composition, and what remains.",
    )
    show.add_argument("--db", required=True, help="the ledger's SQLite file")
    show.add_argument("--counterparty", help="only entries to this peer and the budgets that concern it")
    show.add_argument(
        "--policy",
        help="a site.toml whose [policy] gives the limits (default: the limits "
        "recorded with the last charge of each budget)",
    )
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--no-pld", action="store_true", help="skip the PLD composition (faster)")
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy

    policy = Policy.from_toml(args.policy) if args.policy else None
    ledger = Ledger(args.db) if policy is None else _open_with_policy(args.db, policy)
    try:
        summary = ledger.summary(counterparty=args.counterparty, pld=not args.no_pld)
    finally:
        ledger.close()
    if args.json:
        json.dump(summary, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
        return 0
    print(f"ledger {summary['ledger']}: {len(summary['entries'])} entries")
    print(f"filter: {summary['filter']}; orders {', '.join(f'{o:g}' for o in summary['orders'])}")
    anchor = summary["anchor"]
    if anchor["exists"]:
        upto = anchor["anchored"].get("charges", {}).get("n", 0)
        print(f"anchor: {anchor['path']} (verified: the ledger reaches it; charges anchored up to entry {upto})")
    else:
        print(
            f"anchor: none at {anchor['path']} (the first open with a policy creates it; until then a cut is not detected)"
        )
    print()
    print(f"{'budget':40} {'limit (ε, δ)':>18} {'n':>5} {'spent ε filter':>15} {'spent ε PLD':>12} {'remaining ε':>12}")
    for b in summary["budgets"]:
        limit = "unknown" if b["epsilon_limit"] is None else f"({b['epsilon_limit']:g}, {b['delta_limit']:g})"
        print(
            f"{b['budget']:40} {limit:>18} {b['count']:>5} {_num(b['spent_epsilon_filter']):>15} "
            f"{_num(b['spent_epsilon_pld']):>12} {_num(b['remaining_epsilon_filter']):>12}"
        )
    notes = {b["pld_note"] for b in summary["budgets"] if b["pld_note"]}
    for note in sorted(notes):
        print(f"  PLD: {note}")
    figures = summary["figures"]
    print(f"  spent ε filter: {figures['budgets.spent_epsilon_filter']}")
    print(f"  spent ε PLD: {figures['budgets.spent_epsilon_pld']}")
    print(f"  remaining ε: {figures['budgets.remaining_epsilon_filter']}")
    print()
    print(
        f"{'#':>5} {'charged at':27} {'release':32} {'mechanism':10} {'level':6} {'unit':18} "
        f"{'counterparty':14} {'subject':14} {'ε':>8} {'δ':>8}"
    )
    print(f"  (ε of an entry: {figures['entries.epsilon']})")
    for e in summary["entries"]:
        print(
            f"{e['entry_id']:>5} {e['charged_at']:27} {e['release_id'][:32]:32} {e['mechanism']:10} {e['level']:6} "
            f"{e['unit']:18} {e['counterparty'][:14]:14} {e['subject'][:14]:14} {e['epsilon']:>8.4g} {e['delta']:>8.2g}"
        )
    cancelled, served = summary.get("cancelled", []), summary.get("served_again", [])
    if cancelled:
        print()
        print(f"{len(cancelled)} charge(s) cancelled (their releases never left; not in any budget's sums):")
        for c in cancelled:
            print(f"  entry {c['entry_id']} ({c['counterparty']}) at {c['at']}: {c['reason']}")
    print()
    print(
        f"{len(served)} release(s) served again at no charge (identical bytes of an earlier data-level "
        f"release; post-processing, never added to a budget)"
    )
    for r in served:
        print(f"  {r['at']}: entry {r['entry_id']} again to {r['counterparty']}")
    return 0


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _open_with_policy(path: str, policy: Policy) -> Ledger:
    from peer.budget.ledger import Ledger

    if not Path(path).exists():  # showing must never create a ledger
        raise NotFound(f"no ledger at {path}")
    return Ledger(path, policy)
