"""Check every site's ledger against the receipts its counterparties hold (scripts/docker_e2e.sh).

    python check-ledgers.py --sites /sites --certs /certs

``--sites`` holds one directory per site (its volume: ``ledger.sqlite``, ``rounds/*.json``);
``--certs`` the sites' public certificates (``NAME.crt``). For every site:

- its ledger verifies (``Ledger.verify``: SQLite integrity, the hash chains, the totals);
- every receipt in every round report written at another site is signed by this site's
  certificate, names a ledger entry here whose record (mechanism, ε, δ, unit, counterparty,
  release id: its canonical JSON's SHA-256) is exactly the one signed, and was sent to the site
  holding it;
- every entry charged here to a site that wrote round reports is in one of those reports: nothing
  was charged that its counterparty does not hold a receipt for.

Prints one line per site and exits 1 with every problem listed when any check fails."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from peer.budget.ledger import Ledger
from peer.net.receipts import SignedReceipt, verify_receipt


def receipts_by_signer(sites: Path) -> tuple[dict[str, list[tuple[str, SignedReceipt]]], set[str]]:
    """signer -> [(holder, receipt)], from every round report under ``sites``; and the holders."""
    out: dict[str, list[tuple[str, SignedReceipt]]] = {}
    holders = set()
    for report in sorted(sites.glob("*/rounds/round-*.json")):
        holder = report.parent.parent.name
        holders.add(holder)
        for charge in json.loads(report.read_text())["charges"]:
            receipt = SignedReceipt.from_json(charge["receipt"])
            out.setdefault(receipt.signer, []).append((holder, receipt))
    return out, holders


def check(sites: Path, certs: Path) -> list[str]:
    problems = []
    receipts, holders = receipts_by_signer(sites)
    if not holders:
        return [f"no round report (*/rounds/round-*.json) under {sites}"]
    for site_dir in sorted(p for p in sites.iterdir() if (p / "ledger.sqlite").is_file()):
        name = site_dir.name
        ledger = Ledger(site_dir / "ledger.sqlite")
        try:
            try:
                ledger.verify()
            except Exception as e:  # the ledger's own words: which chain, which row
                problems.append(f"{name}: ledger does not verify: {e}")
            entries = {str(e.entry_id): e for e in ledger.entries()}
        finally:
            ledger.close()
        cert = (certs / f"{name}.crt").read_bytes()
        held = set()
        for holder, receipt in receipts.get(name, []):
            try:
                verify_receipt(receipt, cert, expected_signer=name)
            except Exception as e:
                problems.append(f"{name}: a receipt held by {holder} does not verify: {e}")
                continue
            entry = entries.get(receipt.ledger_entry_id)
            if entry is None:
                problems.append(
                    f"{name}: a receipt held by {holder} names entry {receipt.ledger_entry_id}: not in the ledger"
                )
                continue
            held.add(receipt.ledger_entry_id)
            record = receipt.record
            if hashlib.sha256(record.canonical_json()).hexdigest() != entry.receipt()["record_sha256"]:
                problems.append(f"{name}: entry {entry.entry_id}: the record signed in the receipt is not the ledger's")
            if receipt.recipient != holder:
                problems.append(f"{name}: entry {entry.entry_id} was sent to {receipt.recipient!r}, held by {holder!r}")
        unheld = [e for k, e in entries.items() if e.counterparty in holders and k not in held]
        for e in unheld:
            problems.append(f"{name}: entry {e.entry_id} charged to {e.counterparty!r} has no receipt in its reports")
        print(
            f"{name}: ledger verifies; {len(entries)} entries; "
            f"{len(receipts.get(name, []))} receipts held by others match it; {len(unheld)} unmatched"
        )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=Path, required=True)
    parser.add_argument("--certs", type=Path, required=True)
    args = parser.parse_args()
    problems = check(args.sites, args.certs)
    for p in problems:
        print(f"check-ledgers: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
