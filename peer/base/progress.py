"""Progress bars of the long commands (``model train``, ``pool train``, ``round``, an iterate
run, ``simulate``): tqdm on stderr, with the time elapsed and the time remaining.

The only module that draws bars, imported by the command lines only (``peer.cli``,
``coordinator_free.cli``, ``scenarios.cli``; tests/test_layout.py checks it): the core reports progress through a
callback it is given (``progress=`` of the training functions, the ``on_event`` of a round) and
the command lines turn those calls into a bar. It lives in ``peer.base`` because the layers
above the peer (``coordinator_free``) may not import ``peer.cli``.

A bar is shown only on a terminal: when stderr is not one (a pipe, a file, a CI log), or the
command's output is machine-read (``--json``, ``round --events``), nothing is drawn and the lines
the command prints around it are written as they are. A bar counts what the command's own
process does or waits for — epochs, DP-SGD steps, peers answered, iterate rounds — never a value
of a record: its description and unit are constants of the command, its counts public
quantities of the run (how many epochs, steps, peers, rounds were asked for).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# the time remaining is said in words, not only tqdm's "elapsed<remaining"
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed} elapsed, {remaining} left]"


def shown(quiet: bool = False) -> bool:
    """Whether a bar is drawn: stderr is a terminal and the output is not for a program."""
    if quiet:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Bars:
    """One bar at a time on stderr, and the lines a command prints while it is drawn.

    ``start`` replaces any bar still open; ``write`` prints a line above the bar (or plainly when
    no bar is shown), so that a line never lands in the middle of one."""

    def __init__(self, quiet: bool = False):
        self.enabled = shown(quiet)
        self._bar = None

    def start(self, total: int, description: str, unit: str, initial: int = 0) -> None:
        self.close()
        if not self.enabled:
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=description,
            unit=unit,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
        )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write(self, line: str) -> None:
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)


@contextmanager
def progress_bar(total: int, description: str, unit: str, quiet: bool = False) -> Iterator[Callable[[], None]]:
    """A bar of ``total`` ``unit``s for the block; yields the callback that advances it by one
    (what the training functions' ``progress=`` takes)."""
    bars = Bars(quiet)
    bars.start(total, description, unit)
    try:
        yield bars.advance
    finally:
        bars.close()


__all__ = ["BAR_FORMAT", "Bars", "progress_bar", "shown"]
