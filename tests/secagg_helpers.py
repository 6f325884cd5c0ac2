"""Shared helpers of the secure-aggregation tests: in-memory site identities (the same key type
and certificate profile as ``privfusion peer init``, without touching the disk)."""

from __future__ import annotations

import datetime as dt
import functools
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from peer.net.identity import Identity, make_certificate


def make_identity(name: str, **cert_options) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Identity(name, Path("/nonexistent"), pem, make_certificate(name, key, **cert_options))


@functools.cache
def identities(count: int) -> tuple[Identity, ...]:
    """Sites site-00 … site-NN (cached: key generation is the slow part)."""
    return tuple(make_identity(f"site-{i:02d}") for i in range(count))


def pins(ids) -> dict[str, bytes]:
    return {i.name: i.cert_pem for i in ids}


def expired_identity(name: str) -> Identity:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    return make_identity(name, not_before=start, valid_for=dt.timedelta(days=1))
