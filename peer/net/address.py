"""The address a daemon listens on (``[site] listen``, ``privfusion site new --listen``).

Checked in one place, by :func:`check_listen`, so that ``site new`` (which imports nothing
heavy) and the daemon's configuration refuse the same addresses with the same words.
"""

from __future__ import annotations

from peer.base.errors import InvalidArgument


def check_listen(listen: str, field: str = "site.listen") -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; port 0 = any free port), else a clear error."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(
            field, f'must be HOST:PORT with a port in 0..65535 (e.g. "0.0.0.0:50051"), got {listen!r}'
        )
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise InvalidArgument(field, f'an IPv6 host is written in brackets, e.g. "[::]:50051"; got {listen!r}')
    return listen
