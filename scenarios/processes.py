"""The simulation's running processes (``privfusion simulate``, steps 3–4 of
``scenarios.simulate``): each site's daemon (``privfusion peer serve``) in a process of its own,
each site's rounds in a thread of the simulate process (``RoundThread``) or, for the site the
failure scenario SIGKILLs, in a ``privfusion round`` process (``RoundProcess``), and the run of
them all (:func:`run_sites`)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free.roster import write_roster
from peer.base.errors import FailedPrecondition
from peer.net.readiness import NotReady, wait_for_ready_file
from scenarios.world import Progress, SiteWorld, World, _now, round_toml

# ------------------------------------------------------------------------------------- processes


def _child_env() -> dict:
    # One BLAS/torch thread per process: eight processes share two cores.
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PRIVFUSION_LOG_LEVEL=os.environ.get("PRIVFUSION_LOG_LEVEL", "INFO"),
    )


class Daemon:
    """One site's ``privfusion peer serve`` process."""

    def __init__(self, site: SiteWorld):
        self.site = site
        self.ready = site.root / "daemon.ready.json"
        self.ready.unlink(missing_ok=True)
        # held for the daemon's lifetime (its stderr), closed when it is stopped
        self.log = open(site.root / "daemon.log", "ab")  # noqa: SIM115
        # --simulation: the sites' fixed noise seeds (refused by a production `peer serve`)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "peer",
                "serve",
                "--config",
                str(site.config),
                "--simulation",
                "--ready-file",
                str(self.ready),
            ],
            stdout=self.log,
            stderr=self.log,
            env=_child_env(),
        )
        self.address: str | None = None
        self.killed_at: str | None = None

    def wait_ready(self) -> str:
        """The daemon's address once it is ready. The allowance is on the CPU time the daemon
        used (``peer.net.readiness``): a loaded machine waits longer instead of failing."""
        log = self.site.root / "daemon.log"
        try:
            info = wait_for_ready_file(self.ready, self.proc.pid, self.proc.poll)
        except ChildProcessError:
            raise FailedPrecondition(
                f"the daemon of {self.site.name} exited with {self.proc.returncode}; see {log}"
            ) from None
        except NotReady as e:
            raise FailedPrecondition(f"the daemon of {self.site.name}: {e}; see {log}") from None
        self.address = f"127.0.0.1:{info['port']}"
        return self.address

    def kill(self) -> None:
        self.killed_at = _now()  # taken before the signal: every consequence comes after it
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM: graceful shutdown (health NOT_SERVING, in-flight releases finish)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RoundProcess:
    """One site's ``privfusion round`` process running the plan; its events stream to ``on_event``."""

    def __init__(self, site: SiteWorld, round_files: list[Path], on_event: Callable[[dict], None]):
        self.site = site
        self.events: list[dict] = []
        # held for the process's lifetime (its stderr), closed when it has ended
        self.log = open(site.root / "rounds.log", "ab")  # noqa: SIM115
        # --simulation: the site's fixed noise seed (refused by a production `privfusion round`)
        args = [sys.executable, "-m", "peer.cli", "round", "--config", str(site.config), "--events", "--simulation"]
        for f in round_files:
            args += ["--round", str(f)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, env=_child_env(), text=True)
        self.killed_at: str | None = None
        self._reader = threading.Thread(target=self._read, args=(on_event,), daemon=True)
        self._reader.start()

    def _read(self, on_event) -> None:
        for line in self.proc.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            self.events.append(e)
            on_event(e)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.killed_at = _now()
            self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        self.log.close()
        return code


class RoundThread:
    """One site's rounds run in this (the simulator's) process, on a thread: the same
    ``coordinator_free.runner.run_rounds`` that ``privfusion round`` runs, with the site's own
    site.toml — its identity, trust store, model and probe set — and round files, so every
    call is still a mutual-TLS call between two sites. Why not a process per site: each
    would import torch, gRPC and NumPy again (about 330 MB resident apiece; twelve sites
    need twelve), while this process has them already. The command itself stays covered by
    the failure scenario's victim (below) and by the round tests.

    ``kill`` cannot SIGKILL a thread: it interrupts the rounds as SIGTERM would the command
    (nothing more is requested, the report says ``interrupted``); the exit code is the one the
    command would have (0 every round fused, 3 one did not, 143 interrupted, 2 refused input,
    1 any other error — its traceback in the site's rounds.log)."""

    def __init__(self, site: SiteWorld, round_files: list[Path], on_event: Callable[[dict], None]):
        self.site = site
        self.events: list[dict] = []
        self.killed_at: str | None = None
        self.code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(round_files, on_event), name=f"rounds-{site.name}", daemon=True
        )
        self._thread.start()

    def _run(self, round_files: list[Path], on_event: Callable[[dict], None]) -> None:
        import traceback

        from coordinator_free.iterate import IterateConfig
        from coordinator_free.runner import run_rounds
        from peer.base.errors import PrivFusionError

        def emit(e: dict) -> None:
            e = json.loads(json.dumps(e, sort_keys=True, default=str))  # as the command prints it
            self.events.append(e)
            on_event(e)

        code = 0
        try:
            for cfg, result in run_rounds(self.site.config, round_files, emit, self._stop, simulation=True):
                if result.status == "interrupted":
                    code = 128 + signal.SIGTERM
                    break
                if result.status != "fused" and not isinstance(cfg, IterateConfig):  # as the command
                    code = 3
        except PrivFusionError as e:
            code = 2
            self._log(f"privfusion round: error: {e}\n")
        except Exception:
            code = 1
            self._log(traceback.format_exc())
        self.code = code

    def _log(self, text: str) -> None:
        with open(self.site.root / "rounds.log", "a", encoding="utf-8") as f:
            f.write(text)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.code

    def kill(self) -> None:
        if self._thread.is_alive():
            self.killed_at = _now()
            self._stop.set()

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.code


def _ledger_count(path: Path) -> int:
    from peer.budget.ledger import Ledger

    if not path.exists():
        return 0
    ledger = Ledger(path, verify=False)
    try:
        return len(ledger.entries())
    finally:
        ledger.close()


# ------------------------------------------------------------------------------------- the run


def _shut_down(rounds, daemons) -> None:
    """Stop what a phase started: rounds still running are interrupted and waited for, then every
    daemon gets SIGTERM (all at once, so their grace periods overlap) and is waited for."""
    for r in rounds:
        if r.poll() is None:
            r.kill()
            r.wait()
    daemons = list(daemons)
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.stop()


def run_sites(world: World, progress: Progress) -> dict:
    """Start every daemon, write the roster, run every site's rounds at once, stop the daemons.
    Returns what happened to processes (kills, exit codes)."""
    import torch

    from coordinator_free.events import QUIET, describe

    sc = world.scenario
    # The sites' rounds share this process (RoundThread): one torch thread each, as a round
    # process has (OMP_NUM_THREADS=1); the ops are small and the cores are few.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # and glibc's arenas capped at two, as a daemon's are: by default each of the rounds' ~100
    # threads that allocates while another holds the heap gets an arena that keeps what it
    # freed (measured at 12 sites: the simulate process's peak 723 → 628 MiB); for the rest of
    # this process, as glibc has no way back
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX (malloc.h)
    daemons: dict[str, Daemon] = {}
    rounds: dict[str, RoundProcess | RoundThread] = {}
    failure: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        for s in world.sites.values():
            daemons[s.name] = Daemon(s)
        # all start at once and share the cores: a start-up takes ~5 s of CPU (imports, pools),
        # so the wait is on each daemon's own CPU time, not the wall clock
        for name, d in daemons.items():
            progress(
                f"{name}: daemon serving on {d.wait_ready()} (pid {d.proc.pid}, mutual TLS, ledger {d.site.ledger.name})"
            )
        world.timings["daemons_start_s"] = time.monotonic() - t0
        roster = world.out / "roster.toml"
        write_roster(
            roster, [(n, d.address, str((world.sites[n].identity / "site.crt").resolve())) for n, d in daemons.items()]
        )

        def on_event(e: dict) -> None:
            if e["event"] not in QUIET:
                progress(describe(e))

        t0 = time.monotonic()
        victim = sc.failure.site if sc.failure is not None else None
        if sc.round.repair != "off" and not next(iter(world.sites.values())).network.is_own:
            # REPAIR's statistic points come from a torch.fx trace, which hijacks nn.Module.__call__
            # process-wide while it runs: trace the one architecture now, before the round threads
            # run forward passes (coordinator_free.after_fusion.stat_points_of remembers it); an
            # own network's statistic points were traced when it was stored (its structure)
            from coordinator_free.after_fusion import stat_points_of
            from peer.nn.architectures import input_tensor

            some = next(iter(world.sites.values()))
            shape = tuple(input_tensor(some.architecture, np.asarray(some.x)[:1]).shape[1:])
            stat_points_of(some.architecture, shape)
        for s in world.sites.values():
            files = []
            for label, method, scale in world.plan:
                f = s.root / f"round-{label}.toml"
                f.write_text(round_toml(sc, s, label, method, scale, roster.resolve()), encoding="utf-8")
                files.append(f)
            # a SIGKILL must take the victim's rounds down with its daemon: a process of its own
            rounds[s.name] = (RoundProcess if s.name == victim else RoundThread)(s, files, on_event)
        progress(f"every site started its rounds ({', '.join(label for label, _, _ in world.plan)}) at once")

        if sc.failure is not None:
            while rounds[victim].poll() is None:
                if _ledger_count(world.sites[victim].ledger) >= sc.failure.after_releases:
                    daemons[victim].kill()
                    rounds[victim].kill()
                    failure = {
                        "site": victim,
                        "killed_at": daemons[victim].killed_at,
                        "signal": "SIGKILL",
                        "trigger": f"scripted: once its ledger held {sc.failure.after_releases} charge(s)",
                        "ledger_entries_at_kill": _ledger_count(world.sites[victim].ledger),
                    }
                    progress(
                        f"FAILURE: SIGKILL {victim} (daemon and round) at {failure['killed_at']}: {failure['trigger']}"
                    )
                    break
                time.sleep(0.02)
            if not failure:
                failure = {
                    "site": victim,
                    "killed_at": None,
                    "trigger": f"not reached: its ledger never held {sc.failure.after_releases} charges",
                }
                progress(f"FAILURE not triggered: {failure['trigger']}")
        codes = {n: r.wait() for n, r in rounds.items()}
        world.timings["rounds_s"] = time.monotonic() - t0
    finally:
        _shut_down(rounds.values(), daemons.values())
        torch.set_num_threads(torch_threads)
    return {"exit_codes": codes, "failure": failure, "addresses": {n: d.address for n, d in daemons.items()}}
