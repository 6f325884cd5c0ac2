"""The ledger's anchor: the latest head of each of its hash chains, kept outside the SQLite file.

A hash chain shows that no row was edited, inserted or removed in the middle; it cannot show
that the *end* was cut off. Dropping the last charges of the ledger and rewriting the ``totals``
cache leaves a shorter chain that verifies, and the budget those charges spent is admitted
again. So every change to a chain is also written here, outside the ledger file, before the
caller may let any byte of the release leave; a ledger whose chains do not reach the anchored
heads is refused at open (``Ledger.verify``).

Format (``LEDGER.anchor`` beside ``LEDGER``; specified in ``docs/architecture.md``, "The
ledger's anchor"): UTF-8 text, one JSON object per line, appended with ``O_APPEND`` and
fsync'd before :meth:`Anchor.append` returns; nothing is ever rewritten. The first line is a
header, ``{"format": "privfusion-ledger-anchor/1", "ledger": NAME}``; every later line is one
point, ``{"format": ..., "chain": C, "n": N, "head": H}``: chain ``C`` (``charges``,
``cancellations``, ``served_again`` or ``events``) held a row with id ``N`` (a charge's
``seq``, the other tables' ``id``) whose hash is ``H`` (64 hex digits). Lines of concurrent
writers may land out of order; a chain's anchored point is the line with the largest ``N``.
A line that does not parse (a write torn by a power cut: the release it was for never left)
is skipped with a warning. What an attacker with write access can and cannot do is stated
in ``docs/architecture.md``.

No gRPC, no protobuf: this is the ledger's storage, beside it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from peer.base.errors import FailedPrecondition

log = logging.getLogger("peer.budget.anchor")

FORMAT = "privfusion-ledger-anchor/1"
CHAINS = ("charges", "cancellations", "served_again", "events")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def anchor_path(ledger_path: str | os.PathLike) -> Path:
    """Where the anchor of the ledger at ``ledger_path`` lives: ``LEDGER.anchor`` beside it."""
    p = Path(ledger_path)
    return p.with_name(p.name + ".anchor")


@dataclass(frozen=True)
class AnchorPoint:
    """Chain ``chain`` held row ``n`` with hash ``head``."""

    chain: str
    n: int
    head: str

    def __post_init__(self) -> None:
        if self.chain not in CHAINS:
            raise ValueError(f"chain must be one of {list(CHAINS)}, got {self.chain!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.head, str) or not _HEX64.fullmatch(self.head):
            raise ValueError("head must be 64 lowercase hex digits")

    def line(self) -> bytes:
        return (json.dumps({"format": FORMAT, "chain": self.chain, "n": self.n, "head": self.head}) + "\n").encode()


class Anchor:
    """The append-only anchor file of one ledger (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.exists()

    def create(self, ledger_name: str) -> None:
        """Write the header line (the file must not exist yet) and fsync the file and its folder."""
        header = (json.dumps({"format": FORMAT, "ledger": ledger_name}) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        except FileExistsError:
            return  # another process created it first: its header is as good as ours
        try:
            os.write(fd, header)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.path.parent)

    def append(self, points: list[AnchorPoint]) -> None:
        """Append ``points`` in one write and fsync before returning (the caller sends after)."""
        if not points:
            return
        data = b"".join(p.line() for p in points)
        if not self.exists():
            # deleted while the ledger was open: anchor again from here (and say so)
            log.warning("anchor-missing anchor=%s: created again; earlier points are lost", self.path)
            self.create(self.path.name.removesuffix(".anchor"))
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            # A torn earlier line (power cut mid-write) must not swallow this one.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            written = os.write(fd, data)
            if written != len(data):
                raise FailedPrecondition(f"ledger anchor {self.path}: short write ({written} of {len(data)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)

    def heads(self) -> dict[str, AnchorPoint]:
        """The anchored point of every chain that has one (the line with the largest ``n``)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise FailedPrecondition(f"ledger anchor {self.path} cannot be read: {e.strerror}") from None
        out: dict[str, AnchorPoint] = {}
        skipped = 0
        for text in raw.split(b"\n"):
            if not text.strip():
                continue
            try:
                d = json.loads(text)
                if not isinstance(d, dict) or d.get("format") != FORMAT:
                    raise ValueError("not an anchor line")
                if "chain" not in d:
                    continue  # the header
                p = AnchorPoint(d["chain"], d["n"], d["head"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                skipped += 1
                continue
            if p.chain not in out or p.n > out[p.chain].n:
                out[p.chain] = p
        if skipped:
            log.warning("anchor-lines-skipped anchor=%s count=%d (torn by a crash, or edited)", self.path, skipped)
        return out


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
