"""``privfusion round``: run a coordinator-free fusion round for this site; ``privfusion roster``:
pin or check the sites of a roster.

    privfusion round --config site.toml                  # the [round] table of site.toml
    privfusion round --config site.toml --round r1.toml --round r2.toml   # rounds in sequence
    privfusion round --config site.toml --round iterate.toml   # multi-round P2P DP training
    privfusion roster pin --roster roster.toml --dir identity
    privfusion roster check --roster roster.toml --dir identity

The commands reach ``privfusion`` (``peer.cli.app``) through the entry-point group
``privfusion.commands`` (``round`` → :func:`register`, ``roster`` → :func:`register_roster`), so
that nothing under ``peer/`` imports this package.

A round needs this site's daemon config (identity, model store, public probe set) and a
``[round]`` table (see ``coordinator_free.rounds.RoundConfig``)::

    [round]
    roster = "roster.toml"   # the sites (coordinator_free.roster)
    model = "mlp"            # our model to improve
    alpha = 0.5              # our weight; the peers share 1 - alpha
    quorum = 2               # fewest sites (us included) a fused model may come from
    method = "auto"          # "auto" (a merge where a peer offers a pool, else ldp where it carries
                             # signal) | "ldp" (features + PFA weights) | "merged" (RS/LC merges)
    out = "rounds"           # fused models (a model store in OUT/models; a site's own network's go
                             # to its own store, own_models) and round reports
    health_timeout_s = 2.0
    call_timeout_s = 60.0
    [round.features]         # per neuron, model level
    activation_epsilon = 1.0
    weight_epsilon = 1.0
    unit = "neuron"          # or "entry" (much weaker; only when explicitly wanted)
    activation_clip = [0.0, 4.0]   # default: [site.mechanisms].activation_clip
    [round.weights]
    epsilon = 2.0
    delta = 1e-5
    [round.merge]            # per training record, data level
    method = "rs"
    epsilon = 2.0
    delta = 1e-5

A round file whose ``[round]`` says ``method = "iterate"`` (with a ``[round.iterate]`` table)
runs multi-round peer-to-peer DP training instead: local DP-GD segments on this site's own
records, each charged once to its ledger and published, fused with the peers' segments, round
after round, with no coordinator (``coordinator_free.iterate``; its report is OUT/RUN.json).

Progress goes to stderr (``--events``: JSON lines on stdout instead); each round's report is
written to OUT/round-ID.json. Exit status 0 when every round fused, 3 when one aborted (or an
iterate run stopped because its own daemon does not serve). ``--resume`` continues an iterate
run that stopped (``coordinator_free.iterate``); without it a run name already used is refused.

SIGINT (Ctrl-C) or SIGTERM interrupts: nothing more is requested, the releases in flight are
waited for, and the report (status ``interrupted``) lists every receipt received and, per
peer, whether it may have charged; no later round starts. Exit status 128 + the signal's
number (130 for Ctrl-C). A second signal quits at once (the report is then not written).
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from peer.net.identity import format_fingerprint


def _round(args) -> int:
    from coordinator_free.events import QUIET, describe
    from coordinator_free.iterate import IterateConfig
    from coordinator_free.iterate import describe as describe_iterate
    from coordinator_free.runner import run_rounds
    from peer.base.progress import Bars

    bars = RoundBars(Bars(quiet=args.events))

    def on_event(e: dict) -> None:
        if args.events:
            print(json.dumps(e, sort_keys=True, default=str), flush=True)
            return
        if e["event"].startswith("iterate-") or e["event"] == "segment":
            line = describe_iterate(e)
        else:
            line = None if e["event"] in QUIET else describe(e)
        bars.show(e, line)

    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum, _frame):
        if caught:  # a second signal: quit now
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        caught.append(signum)
        stop.set()
        bars.write(
            f"privfusion round: {signal.Signals(signum).name}: stopping — nothing more will be requested; "
            "waiting for the releases in flight to write the report (signal again to quit at once)"
        )

    # signal handlers can only be set from the main thread (the command line's); elsewhere the
    # caller keeps its own handling
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    status = 0
    try:
        # the same rounds the simulator runs in its own process (scenarios.processes.RoundThread)
        rounds = run_rounds(args.config, args.round, on_event, stop, simulation=args.simulation, resume=args.resume)
        for cfg, result in rounds:
            if isinstance(cfg, IterateConfig):
                if not args.events:
                    print(f"iterate run {cfg.run}: {result.status} ({result.reason}); report {result.report_path}")
                if result.status == "interrupted":
                    return 128 + caught[0] if caught else 3
                if result.status == "alone":
                    return 3
                continue
            if result.status == "interrupted":
                unsure = {n: c for n, c in result.report["may_have_charged"].items() if c != "no"}
                print(
                    f"privfusion round: round {result.round_id} interrupted; report {result.report_path} "
                    f"({len(result.report['charges'])} receipts; peers that may have charged: "
                    f"{', '.join(f'{n} ({c})' for n, c in unsure.items()) or 'none'})",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 + caught[0]
            if not args.events:
                print(
                    f"round {result.round_id}: {result.status}"
                    + (f" -> {_fused_path(cfg, result)}" if result.model_name else f" ({result.reason})")
                    + (f"; adopt {result.report['adopt_model']}" if result.report.get("adopt_model") else "")
                    + f"; report {result.report_path}"
                )
                af = result.report.get("after_fusion") or {}
                if af.get("adopt_reason"):
                    print(f"  recommended: {af['adopt']} — {af['adopt_reason']}")
                if result.report.get("fused_vs_own_note"):
                    print(f"  note: {result.report['fused_vs_own_note']}")
            if result.status != "fused":
                status = 3
            if stop.is_set():  # interrupted after the round had finished: start no other
                print(
                    f"privfusion round: {signal.Signals(caught[0]).name}: no further round started",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 + caught[0]
    finally:
        bars.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


class RoundBars:
    """The progress bar of ``privfusion round`` (``peer.base.progress``), driven by the round's
    events: a one-shot round counts the peers that have answered (contributed, dropped, not
    alive, not asked) out of the roster's; an iterate run counts its rounds (a resumed run starts
    at the rounds it had done). The releases themselves are made in the peers' daemons; what is
    counted is what this process waits for. Only counts and the round's name or label are shown."""

    PEER_DONE = ("contributed", "dropped", "not-alive", "not-asked")
    ROUND_DONE = ("fused", "aborted", "interrupted")

    def __init__(self, bars):
        self.bars = bars
        self._answered: set[str] = set()

    def on_event(self, e: dict) -> None:
        ev = e["event"]
        if ev == "started":
            self._answered = set()
            self.bars.start(len(e["peers"]), f"round {e.get('label') or e['round'][:8]}", "peers")
        elif ev in self.PEER_DONE and e.get("peer") not in self._answered:
            self._answered.add(e.get("peer"))
            self.bars.advance()
        elif ev in self.ROUND_DONE or ev == "iterate-finished":
            self.bars.close()
        elif ev == "iterate-started" and not e.get("secure"):  # a secure run's events count no rounds
            self.bars.start(e["rounds"], f"iterate {e['run']}", "rounds", initial=e.get("first_round", 1) - 1)
        elif ev == "iterate-fused":
            self.bars.advance()

    def show(self, e: dict, line: str | None) -> None:
        """Event ``e`` on the bar, and its ``line`` (if any) above it: the line that starts a bar
        before it, the one that ends a bar after it is cleared."""
        if e["event"] in ("started", "iterate-started"):
            if line:
                self.write(line)
            self.on_event(e)
        else:
            self.on_event(e)
            if line:
                self.write(line)

    def write(self, line: str) -> None:
        self.bars.write(line)

    def close(self) -> None:
        self.bars.close()


def _fused_path(cfg, result):
    """Where the round wrote its fused model: OUT/models, or the site's own store (own_models)
    for a site's own network (``coordinator_free.runner.write_round``)."""
    from pathlib import Path

    return Path(result.report.get("fused_store") or cfg.out / "models") / result.model_name


def _pin(args) -> int:
    from pathlib import Path

    from coordinator_free.roster import Roster
    from peer.net.identity import load_identity
    from peer.net.trust import TrustStore

    ident = load_identity(args.dir)
    roster = Roster.load(args.roster)
    for p in roster.pin_all(TrustStore(Path(args.dir) / "trusted"), ident.name):
        print(f"pinned {p.name!r}  SHA-256 {format_fingerprint(p.fingerprint)}")
    print("compare each fingerprint with the one its site reads out to you over another channel")
    return 0


def _check(args) -> int:
    from coordinator_free.roster import Roster
    from peer.net.identity import load_identity
    from peer.net.trust import TrustStore

    ident = load_identity(args.dir)
    roster = Roster.load(args.roster)
    trust = TrustStore(ident.trust_dir)
    for s in roster.peers_of(ident.name):
        print(f"{s.name}\t{s.address}\t{format_fingerprint(s.fingerprint)}")
    roster.check_pins(trust, ident.name)
    print(f"every peer of {ident.name!r} in the roster is pinned with the roster's certificate")
    return 0


def register(subparsers) -> None:
    """``privfusion round``."""
    p = subparsers.add_parser(
        "round",
        help='run a coordinator-free fusion round (or, method = "iterate", multi-round P2P DP training) for this site',
        description="Ask every live roster peer for noisy features and weights (or a DP merge), "
        'align them to this site\'s model and fuse. A round file with method = "iterate" runs multi-round '
        "peer-to-peer DP training instead: local DP-GD segments on this site's records, each charged once to "
        "its ledger and published, fused with the peers' segments round after round (coordinator_free.iterate).",
    )
    p.add_argument("--config", required=True, help="this site's site.toml (identity, models, probe set)")
    p.add_argument(
        "--round",
        action="append",
        metavar="FILE",
        help="a file with a [round] table (repeatable: rounds run in sequence); default: site.toml's [round]",
    )
    p.add_argument("--events", action="store_true", help="print round events as JSON lines on stdout")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an iterate run that stopped (killed, rebooted, its daemon gone) from its report: the rounds "
        "it completed are kept, segments already charged are reused, never charged again; the noise is fresh",
    )
    p.add_argument(
        "--simulation",
        action="store_true",
        help="allow a fixed noise seed (site.seed) for an iterate run's segments, as `peer serve --simulation` "
        "does: NOT PRIVATE, every record says so; without this flag a seed is refused",
    )
    p.set_defaults(func=_round)


def register_roster(subparsers) -> None:
    """``privfusion roster pin|check``."""
    r = subparsers.add_parser("roster", help="pin or check the sites of a roster")
    sub = r.add_subparsers(dest="roster_command", metavar="ACTION")
    sub.required = True
    q = sub.add_parser("pin", help="pin every roster site's certificate in this site's trust store")
    q.add_argument("--roster", required=True)
    q.add_argument("--dir", required=True, help="this site's identity directory")
    q.set_defaults(func=_pin)
    q = sub.add_parser("check", help="check that every roster site is pinned with the roster's certificate")
    q.add_argument("--roster", required=True)
    q.add_argument("--dir", required=True, help="this site's identity directory")
    q.set_defaults(func=_check)
