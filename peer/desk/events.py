"""One structured log line per event of a site (JSON): public facts only, never tensors, keys or
raw values."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("privfusion.peer")


def log_event(event: str, **fields: Any) -> None:
    """One structured log line (JSON): public facts only, never tensors, keys or raw values."""
    log.info(json.dumps({"event": event, **fields}, sort_keys=True, default=str))
