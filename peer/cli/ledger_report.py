"""``privfusion ledger report``: an audit report of one ledger, for the people who sign off.

``write_report(db, out)`` writes ``OUT/index.html`` — one self-contained page (inline CSS, no
JavaScript, figures embedded as base64 PNG data URIs) — and the same figures as ``OUT/*.png``:

- a summary: the site, the ledger file, the chain's verification (``Ledger.verify``: SQLite's
  integrity, the hash chains, the cached totals, the anchor) with the anchor's state, the number
  of releases, and every budget's limit, spent ε by the filter, spent ε by PLD and remaining ε,
  with the scope of each figure as ``ledger show`` states it;
- every budget's spent ε over time: the filter's figure after each charge, recomputed from the
  entries' own RDP vectors and pure ε at the budget's δ (the last point is the summary's figure);
- spending per counterparty: each per-counterparty budget of a model as the ledger keeps it, and
  the data-level releases to each counterparty composed by the same filter at the data budget's
  δ (the data budget is the site's: it has no per-counterparty part);
- every release: time, id, mechanism, level, unit, counterparty, subject, ε, δ, its full record
  as canonical JSON, its delivery events, its cancellation or serving again, and — when receipts
  are given — what they say about it: each receipt's signature against the site's certificate,
  and whether the ledger entry, the record (byte for byte) and the chain position it signs are
  the ledger's;
- what is and is not protected (:data:`PROTECTION`, the privacy model of docs/architecture.md).

A ledger that does not verify still gets its page, with a red banner at the top saying why; so
does a receipt that contradicts the ledger (a signed receipt for a release the ledger does not
hold is the evidence of a cut the anchor alone cannot see). ``problems`` in the returned report
lists them; the command exits 1 when there is any.

The page shows records (public parameters, ε, δ, counterparties): never training data, tensors
or keys. Every value is escaped with ``html.escape``; names come from peers and files.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, PrivFusionError

#: What the page says is and is not protected, as (heading, paragraphs). It restates the privacy
#: model of docs/architecture.md ("Privacy model"); an installed package carries no docs folder,
#: so the text lives here. Keep the two in step.
PROTECTION: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "What is protected, and the unit of each guarantee",
        (
            "Data level: central differential privacy of the site's training records. DP-SGD pool "
            "models, RS and LC merges of them and iterate segments. Unit: one training record, "
            "replace-one or add/remove, stated on every record and never mixed. This is the only "
            "guarantee about patients' records.",
            "Model level: local differential privacy of a released model's neurons, as in PrivFusion "
            "(activations on a probe set, weight features, released weights). Unit: one neuron (for a "
            "site's own network, one permutation-group element): its activation row and its incoming "
            "weight vector with its bias. A per-entry release is much weaker (a row of P probes is "
            "protected only at P·ε) and is charged to the per-neuron budget through that conversion.",
            "Sensitivity comes from clipping to public bounds, before the noise; the bounds are in "
            "each record. Gaussian noise is calibrated by the analytic Gaussian mechanism unless the "
            "record says otherwise.",
            "Every release is charged to this ledger before any byte of it leaves, atomically, and a "
            "charge is never refunded once bytes may have left (a cancellation withdraws only a charge "
            "whose release provably never left). Requests arrive adaptively, so the budget check is a "
            "privacy filter: an RDP filter over fixed orders with δ split across them, plus a pure-ε "
            "track. The PLD figure is the tight description of the fixed sequence of what was "
            "released, not the adaptive guarantee.",
            "Two budgets are kept apart: the data-level budget of the site's training records, and "
            "the model-level budgets of each model, in total and per counterparty.",
        ),
    ),
    (
        "What the ledger's integrity checks give",
        (
            "The hash chain detects an edit, insertion or deletion of any row, or of the cached "
            "totals. The anchor file beside the ledger detects a cut end, an older copy put back or a "
            "deleted ledger. A ledger without an anchor cannot show a cut made before its first "
            "anchoring.",
            "Cutting or rolling back the ledger and its anchor together, or rewriting both "
            "consistently, is not detected by the site itself: only the signed receipts its "
            "counterparties hold (each names the chain's position after its charge) contradict it. "
            "That is what the receipts section of this report checks.",
            "These are integrity checks, not secrecy, and no defence against someone who holds the "
            "site's key: such a person can sign anything.",
        ),
    ),
    (
        "What is not protected, or rests on an assumption",
        (
            "The model-level unit treats each neuron's released values as the protected record. It "
            "does not account for correlations between neurons, and says nothing directly about "
            "training records. A model-level release of a pool model is charged to model-level "
            "budgets only.",
            "Public by design: architectures, probe sets (the requester's public data), clip bounds, "
            "which sites take part, when, and how many releases they ask for. This report and the "
            "ledger hold records, ε, δ and counterparties, never training data or noise.",
            "An LC merge is charged the composition of the merged models' own profiles (a proven "
            "bound); the per-step surrogate is a bound only for models whose training record "
            "declares state-independent gradients. RS and LC weights are chosen from public "
            "information, or the choice is charged.",
            "A pool model added from another trainer (pool add) is charged from its declared history: "
            "the guarantee is only as true as that declaration, which the site cannot check.",
            "Noise comes from PCG64 seeded with 128 bits from the operating system's CSPRNG, fresh per "
            "release; a fixed seed is a simulation option and every record made with one says "
            "'fixed seed: not private'. Floating-point sampling is not hardened against Mironov's "
            "(2012) side channel.",
            "Post-processing at the requester (matching, fusion, REPAIR, fine-tuning on its own "
            "records) is not charged; the fused model carries information about the requester's own "
            "records, for which no DP is claimed.",
        ),
    ),
)

_MINUTE = timedelta(minutes=1)

STATUS_VERIFIED = "verified"
STATUS_BAD_SIGNATURE = "signature invalid"
STATUS_NO_RECEIPT = "no receipt given"
STATUS_NOT_IN_LEDGER = "receipt for a release not in the ledger"
STATUS_DIFFERS = "receipt contradicts the ledger"
STATUS_UNCHECKED = "signature not checked (no certificate)"
STATUS_OTHER_SIGNER = "signed by another site"


@dataclass
class ReceiptCheck:
    """One receipt read from ``source`` and what it says against the ledger. ``problem``: it
    contradicts the ledger or does not verify."""

    source: str
    signer: str
    ledger_entry_id: str
    release_id: str
    served_again: str
    recipient: str
    status: str
    detail: str = ""
    problem: bool = False


@dataclass
class Report:
    """What the page shows (plain values), and what is wrong (``problems``: empty when the chain
    verifies and no receipt contradicts the ledger)."""

    site: str
    ledger: str
    chain_ok: bool
    chain_detail: str
    summary: dict | None
    entries: list[dict]
    events: dict[str, list[dict]]
    timelines: dict[str, list[tuple[str, float]]]
    spending: list[dict]
    receipts: list[ReceiptCheck]
    skipped: list[str]
    certificate: str
    policy: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- reading receipts


def load_receipts(paths: Sequence[str | Path]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Every signed receipt in ``paths``, as (source, SignedReceipt), and the files of a
    directory that hold none (skipped, named).

    A path is a receipt document (``SignedReceipt.to_json``), a saved release's ``OUT.json``
    (its receipt and the upstream receipts it carries), a round report (``rounds/round-ID.json``:
    the receipt of every charge it received), or a directory searched for ``*.json`` files of
    those kinds. A file named directly that is none of them is refused, naming it."""
    from peer.net.receipts import SignedReceipt

    found: list[tuple[str, Any]] = []
    skipped: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            files, direct = sorted(q for q in p.rglob("*.json") if q.is_file()), False
        elif p.is_file():
            files, direct = [p], True
        else:
            raise NotFound(f"--receipts {str(p)!r}: no such file or directory")
        for f in files:
            try:
                doc = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                if direct:
                    raise InvalidArgument("--receipts", f"{f} is not a JSON file: {e}") from None
                skipped.append(f"{f}: not JSON")
                continue
            docs = _receipt_documents(doc)
            if not docs:
                if direct:
                    raise InvalidArgument(
                        "--receipts", f"{f} holds no receipt (a receipt, a saved release's JSON or a round report)"
                    )
                skipped.append(f"{f}: holds no receipt")
                continue
            for where, d in docs:
                try:
                    found.append((f"{f}{where}", SignedReceipt.from_json(d)))
                except InvalidArgument as e:
                    raise InvalidArgument("--receipts", f"{f}{where}: {e.rule}") from None
    return found, skipped


def _receipt_documents(doc: Any) -> list[tuple[str, Any]]:
    """(where in the file, receipt document) of every receipt a parsed JSON file holds."""
    if not isinstance(doc, dict):
        return []
    if "signature" in doc and "record_json" in doc:
        return [("", doc)]
    meta = doc.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("receipt"), dict):
        out = [(" (receipt)", meta["receipt"])]
        out += [(f" (upstream[{i}])", u) for i, u in enumerate(meta.get("upstream") or []) if isinstance(u, dict)]
        return out
    charges = doc.get("charges")
    if isinstance(charges, list):
        out = []
        for i, c in enumerate(charges):
            r = c.get("receipt") if isinstance(c, dict) else None
            if isinstance(r, str):
                try:
                    r = json.loads(r)
                except ValueError:
                    raise InvalidArgument("--receipts", f"charges[{i}].receipt is not JSON") from None
            if isinstance(r, dict):
                out.append((f" (charges[{i}])", r))
        return out
    return []


def check_receipts(ledger: Any, receipts: Iterable[tuple[str, Any]], cert_pem: bytes | None, site: str) -> list:
    """What each receipt says against ``ledger`` (a :class:`peer.budget.ledger.Ledger`).

    A receipt signed by ``site`` (the ledger's site, the subject of ``cert_pem``) is checked:
    its signature against the certificate (docs/wire.md, "Signed bytes"); then that the entry it
    names is in the ledger with the same release id and the same record byte for byte, and —
    when it carries the ledger's position — that the charge chain has that sequence number and
    head right after the charge (or when it was served again). Receipts of other signers (a
    round report holds every peer's) are listed, not checked. Without a certificate the
    cross-check still runs, but nothing is proven: the status says so."""
    from peer.net.receipts import verify_receipt

    out = []
    for source, r in receipts:
        check = ReceiptCheck(source, r.signer, r.ledger_entry_id, "", r.served_again, "", "")
        try:
            record = r.record
            check.release_id, check.recipient = record.release_id, r.recipient
        except PrivFusionError as e:
            check.status, check.detail, check.problem = STATUS_DIFFERS, f"its record does not parse: {e}", True
            out.append(check)
            continue
        if site and r.signer != site:
            check.status = STATUS_OTHER_SIGNER
            check.detail = f"signed by {r.signer!r}, not {site!r}: not a receipt of this ledger"
            out.append(check)
            continue
        verified = False
        if cert_pem is not None:
            try:
                verify_receipt(r, cert_pem, expected_signer=site or None)
                verified = True
            except PrivFusionError as e:
                check.status, check.detail, check.problem = STATUS_BAD_SIGNATURE, str(e), True
                out.append(check)
                continue
        contradiction = _against_ledger(ledger, r, record)
        if contradiction is not None:
            status, detail = contradiction
            check.status, check.detail = status, detail
            check.problem = verified  # an unsigned claim proves nothing against the ledger
            if not verified:
                check.detail += " (signature not checked: no certificate given)"
        elif verified:
            check.status = STATUS_VERIFIED
            check.detail = "signature, entry, record" + (" and chain position" if r.ledger_seq else "") + " match"
        else:
            check.status = STATUS_UNCHECKED
            check.detail = "entry and record match the ledger, but the signature was not checked"
        out.append(check)
    return out


def _against_ledger(ledger: Any, r: Any, record: Any) -> tuple[str, str] | None:
    """(status, detail) where the receipt and the ledger disagree, None where they agree."""
    found = ledger.charge_of(record.release_id)
    if found is None:
        return STATUS_NOT_IN_LEDGER, (
            f"names entry {r.ledger_entry_id} and release {record.release_id}: the ledger holds no such charge "
            "(cut off, rolled back, or another ledger)"
        )
    entry, cancelled = found
    if cancelled:
        return STATUS_DIFFERS, (
            f"entry {entry.entry_id} was cancelled (the ledger says its release never left), yet a receipt for it "
            "was handed out"
        )
    if str(entry.entry_id) != r.ledger_entry_id:
        return (
            STATUS_DIFFERS,
            f"names entry {r.ledger_entry_id}; the ledger charged this release as entry {entry.entry_id}",
        )
    if entry.record.canonical_json() != r.record_json:
        return STATUS_DIFFERS, f"the record it signs is not the one entry {entry.entry_id} holds"
    if r.ledger_seq:
        try:
            seq, head = ledger.chain_position(entry.entry_id, r.served_again or None)
        except NotFound as e:
            return STATUS_DIFFERS, f"names a chain position the ledger cannot find: {e}"
        if (seq, head) != (r.ledger_seq, r.ledger_head.hex()):
            return STATUS_DIFFERS, (
                f"signs chain position {r.ledger_seq} (head {r.ledger_head.hex()[:16]}…); the ledger has "
                f"{seq} (head {head[:16]}…) there"
            )
    return None


# ---------------------------------------------------------------------------- figures as data


def budget_timelines(entries: Sequence[Any], budgets: Sequence[dict], orders: Sequence[float]) -> dict:
    """For each budget with a known limit: [(charged_at, spent ε by the filter after that
    charge)], recomputed from the entries' RDP vectors (each in the budget's unit) and pure ε
    (the entry's ε when its δ is 0, else none) at the budget's δ. Cancelled entries are in no
    sum. The last point equals the budget's ``spent_epsilon_filter``."""
    import numpy as np

    from peer.budget.filter import FilterBudget

    out = {}
    for b in budgets:
        if b["epsilon_limit"] is None or b["delta_limit"] is None:
            continue
        filt = FilterBudget(b["epsilon_limit"], b["delta_limit"], tuple(orders))
        rdp, pure, points = np.zeros(len(orders)), 0.0, []
        for e in entries:
            if b["budget"] not in e.budgets:
                continue
            rdp = rdp + np.asarray(e.rdp, float)
            pure += e.epsilon if e.delta == 0 else math.inf
            points.append((e.charged_at, filt.spent_epsilon(rdp, pure)[0]))
        out[b["budget"]] = points
    return out


def counterparty_spending(entries: Sequence[Any], budgets: Sequence[dict], orders: Sequence[float]) -> list[dict]:
    """Rows of what each counterparty was given: every model's per-counterparty budget as the
    ledger keeps it, and, per counterparty and data-level unit, its data-level releases
    composed by the filter at that data budget's δ (the data budget is the site's; this is the
    part of it that went to that counterparty, as one fixed sequence through the filter)."""
    import numpy as np

    from peer.budget.filter import FilterBudget

    rows = []
    for b in budgets:
        if b["level"] == "model" and b["counterparty"]:
            rows.append(
                {
                    "counterparty": b["counterparty"],
                    "scope": b["scope"],
                    "releases": b["count"],
                    "epsilon_filter": b["spent_epsilon_filter"],
                    "epsilon_limit": b["epsilon_limit"],
                    "delta": b["delta_limit"],
                    "source": f"budget {b['budget']}",
                }
            )
    data = {b["unit"]: b for b in budgets if b["level"] == "data"}
    groups: dict[tuple[str, str], list] = {}
    for e in entries:
        if e.level == "data":
            groups.setdefault((e.counterparty, e.unit), []).append(e)
    for (cp, unit), es in sorted(groups.items()):
        b = data.get(unit)
        eps = None
        if b is not None and b["delta_limit"] is not None and b["epsilon_limit"] is not None:
            filt = FilterBudget(b["epsilon_limit"], b["delta_limit"], tuple(orders))
            rdp = np.sum([np.asarray(e.rdp, float) for e in es], axis=0)
            pure = sum(e.epsilon if e.delta == 0 else math.inf for e in es)
            eps = filt.spent_epsilon(rdp, pure)[0]
        rows.append(
            {
                "counterparty": cp,
                "scope": f"data level, per {unit}, releases to {cp}",
                "releases": len(es),
                "epsilon_filter": eps,
                "epsilon_limit": None if b is None else b["epsilon_limit"],
                "delta": None if b is None else b["delta_limit"],
                "source": "its data-level releases composed by the filter"
                + ("" if b is not None else " (no limit known for the data budget: not composed)"),
            }
        )
    return sorted(rows, key=lambda r: (r["counterparty"], r["scope"]))


# ---------------------------------------------------------------------------- collecting


def collect(
    db: str | Path,
    *,
    receipts: Sequence[str | Path] = (),
    cert: str | Path | None = None,
    policy: str | Path | None = None,
    pld: bool = True,
) -> Report:
    """Read the ledger ``db`` (and the receipts, certificate and site.toml) into a
    :class:`Report`. A ledger that does not verify is read as it stands and the report says so;
    it is never opened with the policy then (a writer's open would anchor the state found)."""
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy

    db = Path(db)
    if not db.is_file():
        raise NotFound(f"--db {str(db)!r}: no ledger file there")
    site, cert_pem, cert_source = _site_and_certificate(cert, policy)
    pol = Policy.from_toml(policy) if policy else None
    found, skipped = load_receipts(receipts) if receipts else ([], [])
    notes: list[str] = []
    try:
        ledger = Ledger(db, verify=False)
    except (PrivFusionError, sqlite3.Error) as e:  # not a ledger SQLite can open: still a page
        report = Report(
            site, str(db), False, f"cannot be opened: {e}", None, [], {}, {}, [], [], skipped, cert_source, ""
        )
        report.problems.append(f"the ledger cannot be opened: {e}")
        return report
    try:
        try:
            ledger.verify()
            chain_ok, chain_detail = True, "SQLite integrity, the hash chains, the cached totals and the anchor check"
        except (PrivFusionError, sqlite3.Error) as e:
            chain_ok, chain_detail = False, str(e)
        if chain_ok and pol is not None:
            ledger.close()
            ledger = Ledger(db, pol)  # as `ledger show --policy` opens it: the policy's limits
        elif pol is not None:
            notes.append(
                "the policy's limits are not applied: a ledger that does not verify is never opened with a "
                "policy (that would anchor what the file now holds); limits are those recorded with each charge"
            )
        summary, entries, events, all_entries = None, [], {}, []
        try:
            summary = ledger.summary(pld=pld)
            all_entries = ledger.entries(include_cancelled=True)
            live = ledger.entries()
            cancelled = {c["entry_id"]: c for c in summary["cancelled"]}
            served: dict[int, list[dict]] = {}
            for s in summary["served_again"]:
                served.setdefault(s["entry_id"], []).append(s)
            for e in ledger.events():
                events.setdefault(e["release_id"], []).append(e)
            entries = [
                {
                    **e.to_dict(),
                    "record_json": e.record.canonical_json().decode(),
                    "cancelled": cancelled.get(e.entry_id),
                    "served_again": served.get(e.entry_id, []),
                }
                for e in all_entries
            ]
            timelines = budget_timelines(live, summary["budgets"], summary["orders"])
            spending = counterparty_spending(live, summary["budgets"], summary["orders"])
        except (PrivFusionError, sqlite3.Error, ValueError, TypeError, KeyError) as e:
            chain_ok = False
            chain_detail += f"; and the ledger cannot be read: {type(e).__name__}: {e}"
            timelines, spending = {}, []
        checks = check_receipts(ledger, found, cert_pem, site) if found else []
    finally:
        ledger.close()
    report = Report(
        site,
        str(db),
        chain_ok,
        chain_detail,
        summary,
        entries,
        events,
        timelines,
        spending,
        checks,
        skipped,
        cert_source,
        str(policy) if policy else "",
        notes=notes,
    )
    if not chain_ok:
        report.problems.append(f"the ledger does not verify: {chain_detail}")
    bad = [c for c in checks if c.problem]
    if bad:
        kinds = sorted({c.status for c in bad})
        report.problems.append(f"{len(bad)} receipt(s) contradict the ledger or do not verify: {', '.join(kinds)}")
    if summary is not None and not summary["anchor"]["exists"]:
        report.notes.append(
            f"no anchor at {summary['anchor']['path']}: a cut end of the ledger is not detected by this site "
            "(only against its counterparties' receipts)"
        )
    if found and cert_pem is None:
        report.notes.append("no certificate given (--cert, or [site] identity in --policy): receipts are not verified")
    return report


def _site_and_certificate(cert: str | Path | None, policy: str | Path | None) -> tuple[str, bytes | None, str]:
    """(site name, certificate PEM or None, where it came from): the certificate from ``cert``,
    or from the identity directory ``[site] identity`` of the site.toml ``policy`` names; the
    site's name from the certificate, else from ``[site] name``."""
    from peer.base.config import load_toml
    from peer.net.identity import CERT_FILE, certificate_name, load_certificate

    name, path = "", Path(cert) if cert else None
    if policy:
        data, _ = load_toml(policy, "site.toml")
        section = data.get("site") if isinstance(data.get("site"), dict) else {}
        name = section.get("name", "") if isinstance(section.get("name", ""), str) else ""
        if path is None and isinstance(section.get("identity"), str):
            candidate = Path(policy).parent / section["identity"] / CERT_FILE
            path = candidate if candidate.is_file() else None
    if path is None:
        return name, None, ""
    try:
        pem = path.read_bytes()
    except OSError as e:
        raise NotFound(f"--cert {str(path)!r}: {e.strerror}") from None
    subject = certificate_name(load_certificate(pem, "--cert"))
    if name and subject != name:
        raise FailedPrecondition(f"--cert {path} is {subject!r}'s certificate; site.toml names the site {name!r}")
    return subject, pem, str(path)


# ---------------------------------------------------------------------------- figures


def figures(report: Report) -> tuple[dict[str, bytes], str]:
    """PNG bytes by file name — ``budget-NN.png`` per budget over time (NN: its row in the
    budgets table), ``counterparties.png`` — and "" ; or ({}, why) when matplotlib (the
    ``plots`` extra) is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
        from matplotlib.figure import Figure
    except ImportError:
        return {}, (
            "matplotlib is not installed (pip install 'privfusion[plots]'): the page has no figures; every "
            "figure's numbers are in its tables"
        )

    def png(fig: Any) -> bytes:
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()

    out = {}
    budgets = report.summary["budgets"] if report.summary else []
    for i, b in enumerate(budgets, 1):
        points = report.timelines.get(b["budget"])
        if not points:
            continue
        times = [datetime.fromisoformat(t) for t, _ in points]
        eps = [v for _, v in points]
        fig = Figure(figsize=(8, 2.6))
        ax = fig.add_subplot()
        ax.step(times, eps, where="post", marker="o", label="spent ε (filter)")
        ax.axhline(b["epsilon_limit"], color="#b00020", linestyle="--", label=f"limit ε = {b['epsilon_limit']:g}")
        span = (times[-1] - times[0]).total_seconds()
        if span < 60:  # one charge, or a burst: a minute either side instead of matplotlib's years
            ax.set_xlim(times[0] - _MINUTE, times[-1] + _MINUTE)
        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        ax.set_ylim(0, max(b["epsilon_limit"], max(eps)) * 1.08)
        ax.set_ylabel("ε")
        ax.set_title(f"{i}. {b['budget']} (δ = {b['delta_limit']:g})", fontsize=9)
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        out[f"budget-{i:02d}.png"] = png(fig)
    rows = [r for r in report.spending if r["epsilon_filter"] is not None]
    if rows:
        fig = Figure(figsize=(8, 1.6 + 0.4 * len(rows)))
        ax = fig.add_subplot()
        labels = [f"{r['counterparty']} — {r['scope']}" for r in rows]
        ax.barh(range(len(rows)), [r["epsilon_filter"] for r in rows], color="#1565c0")
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("spent ε (filter, at the budget's δ)")
        ax.set_title("spending per counterparty", fontsize=9)
        fig.tight_layout()
        out["counterparties.png"] = png(fig)
    return out, ""


# ---------------------------------------------------------------------------- the page

_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #111; max-width: 1250px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .5em 0; font-size: .85em; }
th, td { border: 1px solid #bbb; padding: .2em .45em; text-align: left; vertical-align: top; }
table.releases { width: 100%; } td.history { width: 34%; } tr.cancelled td { color: #666; }
td.id, td.history, td.scope { overflow-wrap: anywhere; }
th { background: #eee; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.banner { padding: .8em 1em; margin: 0 0 1em 0; font-weight: bold; font-size: 1.1em; }
.bad { background: #b00020; color: #fff; } .good { background: #1b5e20; color: #fff; }
.warn { background: #fff3cd; color: #5c4400; border: 1px solid #e0c060; padding: .5em .8em; margin: .4em 0; }
.status-bad { color: #b00020; font-weight: bold; } .status-good { color: #1b5e20; font-weight: bold; }
.status-none { color: #666; } .scope { color: #444; font-size: .85em; }
pre { white-space: pre-wrap; word-break: break-all; font-size: .8em; background: #f6f6f6; padding: .4em; }
img { max-width: 100%; border: 1px solid #ddd; margin: .3em 0; }
"""


def h(value: Any) -> str:
    """Any value as HTML text: escaped, quotes too."""
    return html.escape(str(value), quote=True)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def _img(name: str, data: bytes, alt: str) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(data).decode()}" alt="{h(alt)}" title="{h(name)}">'


def _status_class(status: str) -> str:
    if status == STATUS_VERIFIED:
        return "status-good"
    if status in (STATUS_NO_RECEIPT, STATUS_UNCHECKED, STATUS_OTHER_SIGNER):
        return "status-none"
    return "status-bad"


def render_html(report: Report, images: dict[str, bytes], figures_note: str) -> str:
    """The page: every value through :func:`h`, figures as data URIs."""
    s = report.summary or {}
    p: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Ledger audit report — {h(report.site or report.ledger)}</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    if report.problems:
        p.append('<div class="banner bad" id="verdict">NOT VERIFIED — do not sign off on this ledger as it stands.<ul>')
        p += [f"<li>{h(x)}</li>" for x in report.problems]
        p.append("</ul></div>")
    else:
        what = "the ledger's chain verifies"
        if report.receipts:
            what += " and every receipt given agrees with it"
        p.append(f'<div class="banner good" id="verdict">Verified: {h(what)}.</div>')
    p.append(f"<h1>Ledger audit report — {h(report.site or 'site not named')}</h1>")
    # under every heading of a ledger that does not verify: its figures are what the file holds
    distrust = (
        ""
        if report.chain_ok
        else '<div class="banner bad">From a ledger that does not verify: what the file now holds, not what '
        "was released.</div>"
    )
    p += [f'<div class="warn">{h(n)}</div>' for n in report.notes]

    p.append('<h2 id="summary">Summary</h2><table>')
    anchor = s.get("anchor") or {}
    if anchor.get("exists"):
        marks = ", ".join(f"{c} up to row {a['n']}" for c, a in anchor["anchored"].items()) or "nothing yet"
        anchor_text = f"{anchor['path']} — anchors {marks}"
    elif anchor:
        anchor_text = f"none at {anchor['path']} (a cut end is not detected until the first open with a policy)"
    else:
        anchor_text = "unknown (the ledger could not be read)"
    rows = [
        ("site", report.site or "not named (give --cert or --policy site.toml)"),
        ("ledger file", report.ledger),
        ("chain verification", ("verified" if report.chain_ok else "FAILED") + f": {report.chain_detail}"),
        ("anchor", anchor_text),
        ("releases charged", f"{len([e for e in report.entries if not e['cancelled']])}"),
        ("charges cancelled", f"{len(s.get('cancelled', []))} (their releases never left)"),
        ("served again at no charge", f"{len(s.get('served_again', []))}"),
        ("filter", f"{s.get('filter', '-')}; orders {', '.join(f'{o:g}' for o in s.get('orders', []))}"),
        ("limits from", report.policy or "the limits recorded with each budget's last charge"),
        (
            "receipts checked",
            f"{len(report.receipts)}" + (f" against {report.certificate}" if report.certificate else ""),
        ),
    ]
    p += [f"<tr><th>{h(k)}</th><td>{h(v)}</td></tr>" for k, v in rows]
    p.append("</table>")

    p.append('<h2 id="budgets">Budgets</h2>')
    p.append(distrust)
    p.append("<table><tr><th>#</th><th>budget</th><th>scope</th><th>limit (ε, δ)</th>")
    p.append("<th>releases</th><th>spent ε filter</th><th>spent ε PLD</th><th>remaining ε</th><th>PLD note</th></tr>")
    for i, b in enumerate(s.get("budgets", []), 1):
        limit = "unknown" if b["epsilon_limit"] is None else f"({b['epsilon_limit']:g}, {b['delta_limit']:g})"
        p.append(
            f"<tr><td>{i}</td><td>{h(b['budget'])}</td><td class='scope'>{h(b['scope'])}</td><td>{h(limit)}</td>"
            f"<td class='num'>{b['count']}</td><td class='num'>{h(_num(b['spent_epsilon_filter']))}</td>"
            f"<td class='num'>{h(_num(b['spent_epsilon_pld']))}</td>"
            f"<td class='num'>{h(_num(b['remaining_epsilon_filter']))}</td><td class='scope'>{h(b['pld_note'])}</td></tr>"
        )
    p.append("</table><p>What each figure covers:</p><ul>")
    scopes = s.get("figures", {})
    for key, label in (
        ("budgets.spent_epsilon_filter", "spent ε filter"),
        ("budgets.spent_epsilon_pld", "spent ε PLD"),
        ("budgets.remaining_epsilon_filter", "remaining ε"),
        ("entries.epsilon", "ε of a release"),
    ):
        if key in scopes:
            p.append(f"<li><b>{h(label)}</b>: {h(scopes[key])}</li>")
    p.append("</ul>")

    p.append('<h2 id="over-time">Every budget over time</h2>')
    p.append(distrust)
    p.append(
        "<p>The filter's spent ε after each charge, at the budget's δ, recomputed from each entry's RDP and "
        "pure ε (its last point is the table's figure). The PLD figure is given for the final state only.</p>"
    )
    if figures_note:
        p.append(f'<div class="warn">{h(figures_note)}</div>')
    for i, b in enumerate(s.get("budgets", []), 1):
        points = report.timelines.get(b["budget"])
        p.append(f"<h3>{i}. {h(b['budget'])} <span class='scope'>({h(b['scope'])})</span></h3>")
        if points is None:
            p.append("<p>No limit known for this budget: no curve.</p>")
            continue
        if not points:
            p.append("<p>Nothing charged to this budget yet.</p>")
            continue
        name = f"budget-{i:02d}.png"
        if name in images:
            p.append(_img(name, images[name], f"spent ε of {b['budget']} over time"))
        p.append("<details><summary>the points</summary><table><tr><th>charged at</th><th>spent ε filter</th></tr>")
        p += [f"<tr><td>{h(t)}</td><td class='num'>{h(_num(v))}</td></tr>" for t, v in points]
        p.append("</table></details>")

    p.append('<h2 id="counterparties">Spending per counterparty</h2>')
    p.append(distrust)
    if "counterparties.png" in images:
        p.append(_img("counterparties.png", images["counterparties.png"], "spending per counterparty"))
    p.append(
        "<table><tr><th>counterparty</th><th>scope</th><th>releases</th><th>spent ε filter</th><th>limit ε</th>"
        "<th>δ</th><th>from</th></tr>"
    )
    for r in report.spending:
        p.append(
            f"<tr><td>{h(r['counterparty'])}</td><td class='scope'>{h(r['scope'])}</td><td class='num'>{r['releases']}</td>"
            f"<td class='num'>{h(_num(r['epsilon_filter']))}</td><td class='num'>{h(_num(r['epsilon_limit']))}</td>"
            f"<td class='num'>{h(_num(r['delta']))}</td><td class='scope'>{h(r['source'])}</td></tr>"
        )
    p.append("</table>")

    by_entry: dict[str, list[ReceiptCheck]] = {}
    orphans = []
    charged = {e["release_id"] for e in report.entries}
    for c in report.receipts:
        if c.status == STATUS_OTHER_SIGNER or c.release_id not in charged:
            orphans.append(c)
        else:
            by_entry.setdefault(c.release_id, []).append(c)
    p.append('<h2 id="releases">Releases</h2>')
    p.append(distrust)
    p.append(
        "<table class='releases'><tr><th>entry</th><th>charged at</th><th>release id</th><th>mechanism</th><th>level</th><th>unit</th>"
        "<th>counterparty</th><th>subject</th><th>ε</th><th>δ</th><th>receipt</th><th>record and history</th></tr>"
    )
    for e in report.entries:
        checks = by_entry.get(e["release_id"], [])
        if not report.receipts:
            receipt_cell = '<span class="status-none">no receipts given to the report</span>'
        elif not checks:
            receipt_cell = f'<span class="status-none">{h(STATUS_NO_RECEIPT)}</span>'
        else:
            receipt_cell = "<br>".join(
                f'<span class="{_status_class(c.status)}">{h(c.status)}</span>'
                + ("" if report.chain_ok else " (against a ledger that does not verify)")
                + (f" (served again {h(c.served_again)} to {h(c.recipient)})" if c.served_again else "")
                for c in checks
            )
        history = []
        if e["cancelled"]:
            c = e["cancelled"]
            history.append(f"<b>cancelled</b> at {h(c['at'])}: {h(c['reason'])} (never left; in no budget's sums)")
        for sv in e["served_again"]:
            history.append(f"served again at {h(sv['at'])} to {h(sv['counterparty'])} (no charge)")
        for ev in report.events.get(e["release_id"], []):
            detail = f": {h(ev['detail'])}" if ev["detail"] else ""
            history.append(f"{h(ev['kind'])} at {h(ev['at'])}{detail}")
        for c in checks:
            history.append(f"receipt {h(c.source)}: {h(c.status)} — {h(c.detail)}")
        row_class = ' class="cancelled"' if e["cancelled"] else ""
        p.append(
            f"<tr{row_class}><td class='num'>{e['entry_id']}</td><td>{h(e['charged_at'])}</td>"
            f"<td class='id'>{h(e['release_id'])}</td><td>{h(e['mechanism'])}</td><td>{h(e['level'])}</td><td>{h(e['unit'])}</td>"
            f"<td>{h(e['counterparty'])}</td><td>{h(e['subject'])}</td><td class='num'>{h(_num(e['epsilon']))}</td>"
            f"<td class='num'>{h(_num(e['delta']))}</td><td>{receipt_cell}</td><td class='history'>"
            + "".join(f"<div>{x}</div>" for x in history)
            + f"<details><summary>record (canonical JSON)</summary><pre>{h(e['record_json'])}</pre></details></td></tr>"
        )
    p.append("</table>")
    if report.receipts:
        p.append('<h2 id="receipts">Receipts not matched to a release of this ledger</h2>')
        if orphans:
            p.append("<table><tr><th>source</th><th>signer</th><th>entry</th><th>release id</th><th>status</th>")
            p.append("<th>detail</th></tr>")
            p += [
                f"<tr><td>{h(c.source)}</td><td>{h(c.signer)}</td><td>{h(c.ledger_entry_id)}</td>"
                f"<td>{h(c.release_id)}</td><td class='{_status_class(c.status)}'>{h(c.status)}</td>"
                f"<td>{h(c.detail)}</td></tr>"
                for c in orphans
            ]
            p.append("</table>")
        else:
            p.append("<p>None: every receipt given names a release of this ledger.</p>")
    if report.skipped:
        p.append("<p>Files without receipts, skipped:</p><ul>")
        p += [f"<li>{h(x)}</li>" for x in report.skipped]
        p.append("</ul>")

    p.append('<h2 id="protection">What is and is not protected</h2>')
    for heading, paragraphs in PROTECTION:
        p.append(f"<h3>{h(heading)}</h3><ul>")
        p += [f"<li>{h(x)}</li>" for x in paragraphs]
        p.append("</ul>")
    p.append("</body></html>")
    return "\n".join(p) + "\n"


# ---------------------------------------------------------------------------- writing

_OURS = re.compile(r"^(index\.html|\.index\.html\.tmp|budget-\d+\.png|counterparties\.png)$")


def write_report(
    db: str | Path,
    out: str | Path,
    *,
    receipts: Sequence[str | Path] = (),
    cert: str | Path | None = None,
    policy: str | Path | None = None,
    pld: bool = True,
) -> Report:
    """Write ``out/index.html`` and ``out/*.png`` for the ledger ``db``; return the report
    (``problems`` says what is wrong). ``out`` is created; an existing one must hold nothing but
    an earlier report's files, which are replaced (so no stale figure survives)."""
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise InvalidArgument("--out", f"{out} exists and is not a directory")
        foreign = sorted(q.name for q in out.iterdir() if not _OURS.match(q.name))
        if foreign:
            raise InvalidArgument(
                "--out",
                f"{out} holds files that are not an earlier report's ({', '.join(foreign[:5])}): use a new directory",
            )
    report = collect(db, receipts=receipts, cert=cert, policy=policy, pld=pld)
    images, note = figures(report)
    page = render_html(report, images, note)
    out.mkdir(parents=True, exist_ok=True)
    for q in out.iterdir():
        q.unlink()
    for name, data in images.items():
        (out / name).write_bytes(data)
    tmp = out / ".index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out / "index.html")
    return report
