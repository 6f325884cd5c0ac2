"""Where the release store used to live: it is the release desk's now (``peer.desk.store``, and
``peer.desk.desk.publish_segment`` for a multi-round run's segments). The names stay importable
from here for the code that imports them."""

from peer.desk.desk import publish_segment
from peer.desk.store import (
    SEGMENT_AUDIENCE,
    ReleaseStore,
    StoredRelease,
    check_run_name,
    pool_fingerprint,
    release_key,
    release_sha256,
    segment_key,
    segment_rounds,
)

__all__ = [
    "SEGMENT_AUDIENCE",
    "ReleaseStore",
    "StoredRelease",
    "check_run_name",
    "pool_fingerprint",
    "publish_segment",
    "release_key",
    "release_sha256",
    "segment_key",
    "segment_rounds",
]
