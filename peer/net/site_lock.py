"""One daemon per ledger: the exclusive lock a site holds while it serves from its ledger."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from peer.base.errors import FailedPrecondition

__all__ = ["SiteLock"]


class SiteLock:
    """An exclusive ``flock`` on ``LEDGER.lock``, held while a daemon serves from the ledger.

    The kernel drops it when the process dies (even by SIGKILL), so a crash never leaves a
    stale lock; the file holds the owner's pid for the error message only.
    """

    def __init__(self, ledger: Path, field: str = "site.ledger", holder: str = "daemon"):
        """``field`` and ``holder`` name the file and what holds it in the refusal (another use
        of the same lock: one ``iterate`` run process per run, ``coordinator_free.iterate``)."""
        self.path = ledger.with_name(ledger.name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                owner = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(self._fd)
                self._fd = None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FailedPrecondition(f"{field}: cannot lock {self.path}: {e.strerror}") from None
            rule = "two daemons must never share one ledger" if holder == "daemon" else f"one {holder} at a time"
            raise FailedPrecondition(
                f"{field}: {ledger} is in use by another {holder} (pid {owner}, lock {self.path}); {rule}"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
