"""``privfusion ledger show``: a ledger's entries and where every budget stands;
``privfusion ledger report``: the same, and more, as an audit page (``peer.cli.ledger_report``)."""

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
    report = sub.add_parser(
        "report",
        help="an audit report of a ledger: a self-contained HTML page with figures",
        description="Write DIR/index.html (self-contained: figures embedded) and DIR/*.png: the chain's "
        "verification and the anchor, every budget and its spent ε over time, spending per counterparty, "
        "every release with its record, events and receipt status, and what is and is not protected. "
        "Exits 1 (the page written, with a red banner) when the ledger does not verify or a receipt "
        "contradicts it.",
    )
    report.add_argument("--db", required=True, help="the ledger's SQLite file")
    report.add_argument(
        "--out", required=True, metavar="DIR", help="the report's directory (new, or an earlier report's)"
    )
    report.add_argument(
        "--receipts",
        action="append",
        default=[],
        metavar="PATH",
        help="signed receipts to check against the ledger: a receipt JSON, a saved release's OUT.json, a "
        "round report (rounds/round-ID.json) or a directory of them; repeatable",
    )
    report.add_argument(
        "--cert",
        metavar="FILE",
        help="the site's certificate (site.crt, or the copy a counterparty pins) that signs its receipts "
        "(default: site.crt of --policy's [site] identity)",
    )
    report.add_argument(
        "--policy",
        help="a site.toml whose [policy] gives the limits (as for show) and whose [site] names the site",
    )
    report.add_argument("--no-pld", action="store_true", help="skip the PLD composition (faster)")
    report.set_defaults(func=run_report)


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


def run_report(args: argparse.Namespace) -> int:
    from peer.cli.ledger_report import write_report

    report = write_report(
        args.db, args.out, receipts=args.receipts, cert=args.cert, policy=args.policy, pld=not args.no_pld
    )
    index = Path(args.out) / "index.html"
    checked = f"; {len(report.receipts)} receipt(s) checked" if report.receipts else ""
    print(f"ledger {report.ledger}: {len(report.entries)} entries{checked} -> {index}")
    for note in report.notes:
        print(f"  note: {note}")
    if report.problems:
        for problem in report.problems:
            print(f"ledger report: NOT VERIFIED: {problem}", file=sys.stderr)
        return 1
    print("verified: " + ("the chain, and every receipt agrees with it" if report.receipts else "the chain"))
    return 0


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _open_with_policy(path: str, policy: Policy) -> Ledger:
    from peer.budget.ledger import Ledger

    if not Path(path).exists():  # showing must never create a ledger
        raise NotFound(f"no ledger at {path}")
    return Ledger(path, policy)
