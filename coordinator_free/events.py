"""Round events: the dicts ``coordinator_free.rounds.RoundState`` emits (``on_event``), told to
people in one line each. Used by ``privfusion round`` (stderr progress) and by the simulator
(``scenarios.simulate``), which reads the events of every site's round as JSON lines.

Every event has ``event`` (its kind) and ``site`` (the site running the round); per-peer events
have ``peer``.
"""

from __future__ import annotations

from coordinator_free.rounds import details_line

# Routine progress that ``privfusion round`` does not print (the JSON lines of ``--events`` carry it).
QUIET = ("step", "received", "alive")


def describe(e: dict) -> str:
    """One human line for a round event."""
    who = f"[{e['site']}]"
    peer = e.get("peer")
    ev = e["event"]
    if ev == "started":
        again = (
            f"; a rerun after attempts {', '.join(a[:8] for a in e['attempts_before'])}: what they received is reused"
            if e.get("attempts_before")
            else ""
        )
        return f"{who} round {e['round'][:8]} {e.get('label') or ''} started: peers {', '.join(e['peers'])}, quorum {e['quorum']}, method {e['method']}{again}"
    if ev == "charged":
        return (
            f"{who} {peer}: {e['step']} released (its ledger entry {e['entry_id']}: {e['level']} level, "
            f"this release alone by its record: ε={e['epsilon']:g}, δ={e['delta']:g} per {e['unit']})"
        )
    if ev == "reused":
        return (
            f"{who} {peer}: {e['step']} reused from attempt {e['reused_from'][:8]} of this round (its ledger entry "
            f"{e['entry_id']}): not asked again, nothing charged"
        )
    if ev == "dropped":
        why = details_line(e.get("details"))
        return f"{who} {peer} DROPPED at {e['step']} ({e['status']}; charged: {e['charged']}): {e['reason']}" + (
            f" [{why}]" if why else ""
        )
    if ev == "not-alive":
        return f"{who} {peer} is not alive: {e.get('reason', '')}"
    if ev == "fused":
        return (
            f"{who} fused with {', '.join(e['contributors'])} (weights {', '.join(f'{w:.3g}' for w in e['weights'])})"
        )
    if ev == "after-fusion":
        if e.get("error"):
            return f"{who} the local steps after fusion failed ({e['error']}); the fused model is kept"
        return f"{who} after fusion: {', '.join(e['stages']) or 'nothing'}; adopt: {e['adopt']}"
    if ev == "aborted":
        return f"{who} round ABORTED: {e['reason']}"
    if ev == "interrupted":
        return f"{who} round INTERRUPTED: {e['reason']}"
    if ev in ("contributed", "note", "not-asked"):
        extra = e.get("note") or e.get("reason") or e.get("method", "")
        return f"{who} {peer}: {ev} {extra}"
    return f"{who} {peer or ''} {ev} {e.get('step') or ''}".rstrip()
