"""Waiting for a daemon started in another process to say it is ready (its ``--ready-file``).

A fixed wall-clock deadline fails a slow or loaded machine: on 2 cores under a load of 10, a
daemon whose start costs 1.8 s of CPU can take a minute of wall time to get it, and a dozen
daemons started together longer still. So the deadline here is on the **CPU time the daemon
process has used** (a start that has burnt ``cpu_seconds`` without becoming ready is stuck in
work), with a much larger wall-clock cap for a process that makes no progress at all (blocked,
deadlocked). A loaded machine then only makes the wait longer, never a failure; a daemon that
exits is reported at once.

CPU time is read from ``/proc/PID/stat`` (utime + stime, Linux); where that cannot be read the
wall-clock cap alone applies.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["NotReady", "process_cpu_seconds", "wait_for_ready_file"]

#: CPU seconds a daemon may use before it must be ready (a normal start uses about 2)
DEFAULT_CPU_SECONDS = 60.0
#: wall-clock seconds before a daemon that makes no progress is given up on
DEFAULT_WALL_SECONDS = 600.0

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class NotReady(TimeoutError):
    """The daemon neither became ready nor exited within its CPU or wall-clock allowance."""


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds used by process ``pid`` so far, or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)
    except (IndexError, ValueError):
        return None


def wait_for_ready_file(
    ready: Path,
    pid: int,
    exited: Callable[[], int | None],
    *,
    cpu_seconds: float = DEFAULT_CPU_SECONDS,
    wall_seconds: float = DEFAULT_WALL_SECONDS,
    poll: float = 0.05,
) -> dict:
    """The JSON the daemon wrote to ``ready`` (``{"port": …}``) once it exists.

    ``exited()`` returns the process's exit code once it has ended (``Popen.poll``), else None;
    an exit raises ``ChildProcessError`` at once. Raises :class:`NotReady` when the process has
    used more than ``cpu_seconds`` of CPU, or ``wall_seconds`` have passed, without the file."""
    started = time.monotonic()
    while True:
        if ready.exists():
            try:
                return json.loads(ready.read_text())
            except (OSError, ValueError):
                pass  # written by rename, so this is a reader's race only: look again
        code = exited()
        if code is not None:
            raise ChildProcessError(f"the daemon exited with {code} before it was ready")
        used = process_cpu_seconds(pid)
        waited = time.monotonic() - started
        if used is not None and used > cpu_seconds:
            raise NotReady(f"the daemon used {used:.1f} s of CPU ({waited:.0f} s wall) and is not ready")
        if waited > wall_seconds:
            raise NotReady(f"the daemon was not ready after {waited:.0f} s (it used {used} s of CPU)")
        time.sleep(poll)
