"""A site's store of data-level releases, kept so that each is charged once.

A data-level release (an RS or LC merge of a DP-SGD pool at a target (ε, δ)) is a DP output of
the site's training records, unit one training record. Handing the *identical* bytes out again
— to the same requester or another — is post-processing: it costs no privacy. So a site keeps
each such release (its tensors, its record, the architecture and public metadata sent with it)
and serves a later request with the same public parameters (pool, method, ε, δ) from here,
recording "served again" in the ledger instead of charging (``Ledger.serve_again``).
Model-level (local-DP) releases are per counterparty and never stored.

Layout (``DIR`` is ``LEDGER_STEM.releases/`` beside the ledger)::

    DIR/<key>.safetensors   the released tensors, exactly as sent
    DIR/<key>.json          {"parameters", "record_json", "architecture", "metadata", "tensors"}

``key`` is the SHA-256 of the request's public parameters. Both files are written to a
temporary name, fsynced and renamed (the JSON last, then the directory fsynced), so an entry is
either whole or absent.

Crash safety: the entry is written *before* the release is charged, and its record carries
``parameters["release_sha256"]`` (SHA-256 over the tensors' names and SHA-256s), so the
ledger's hash chain binds the bytes. An entry is served again only if the ledger holds a charge
for its record that is not cancelled; an entry without one (the daemon died between the write
and the charge) never left the site, so it is discarded and a new release is made and charged —
nothing is lost (nothing was spent) and nothing is doubled (``Ledger.charge`` is idempotent per
release id, and one lock per key serialises the decide-store-charge sequence).

Tampering: before serving, every tensor's SHA-256 is recomputed from the file and checked
against the JSON, the JSON's digest against the record's ``release_sha256``, and the record
against the one the ledger charged, byte for byte. A mismatch is *refused*
(FailedPrecondition naming the file): re-making silently would spend budget because of an
attack the operator should see; deleting the two files makes the next request re-make and
charge.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord


def raw_bytes(array: np.ndarray) -> memoryview:
    """The array's raw little-endian C-order bytes (its wire bytes, ``docs/wire.md``), without a
    copy when it already is."""
    a = np.asarray(array)
    le = a.dtype.newbyteorder("<")
    a = np.ascontiguousarray(a.astype(le, copy=False))
    return memoryview(a.reshape(-1).view(np.uint8))


def digest(array: np.ndarray) -> bytes:
    """SHA-256 of the tensor's wire bytes (what a manifest, a receipt and a stored entry bind)."""
    return hashlib.sha256(raw_bytes(array)).digest()


def release_key(pool: str, method: str, epsilon: float, delta: float, pool_fingerprint: str = "") -> str:
    """The store key of a merge request: SHA-256 of its public parameters (floats by repr, so
    only the exact same target is reused) and of the pool's contents (:func:`pool_fingerprint`:
    a pool retrained under the same name is a different pool, whose merges are made anew)."""
    text = json.dumps(
        {
            "kind": "merged",
            "pool": pool,
            "method": method,
            "epsilon": repr(float(epsilon)),
            "delta": repr(float(delta)),
            "pool_fingerprint": pool_fingerprint,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def pool_fingerprint(members) -> str:
    """SHA-256 over a pool's models (``peer.dp.merging.PoolModel``): names and every tensor's bytes."""
    h = hashlib.sha256(b"privfusion.v1/pool/1\n")
    for m in members:
        h.update(m.name.encode() + b"\0")
        for k in sorted(m.arrays):
            h.update(k.encode() + b"\0" + digest(np.asarray(m.arrays[k])))
    return h.hexdigest()


def release_sha256(tensors: list[tuple[str, bytes]]) -> str:
    """SHA-256 over the tensors' names and SHA-256s in stream order (what the record binds)."""
    h = hashlib.sha256(b"privfusion.v1/stored-release/1\n")
    for name, digest in tensors:
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest)
    return h.hexdigest()


@dataclass(frozen=True)
class StoredRelease:
    key: str
    record: ReleaseRecord
    architecture: Mapping[str, Any]
    metadata: Mapping[str, Any]
    tensors: list[tuple[str, np.ndarray]]  # stream order


class ReleaseStore:
    """The data-level releases of one site (see the module docstring)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def lock(self, key: str) -> threading.Lock:
        """The lock that serialises decide → make → store → charge for one key."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.safetensors", self.directory / f"{key}.json"

    def _atomic_write(self, path: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.close(fd)
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put(self, key: str, parameters: Mapping[str, Any], release: StoredRelease) -> None:
        """Write an entry atomically (tensors first, the JSON that makes it an entry last)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        st, js = self._paths(key)
        # np.asarray(order="C") keeps a 0-d tensor 0-d (BatchNorm's num_batches_tracked);
        # np.ascontiguousarray would make it 1-d and the entry would be served in another shape
        arrays = {name: np.asarray(a, order="C") for name, a in release.tensors}
        self._atomic_write(st, lambda p: save_file(arrays, p))
        doc = {
            "parameters": dict(parameters),
            "record_json": release.record.canonical_json().decode(),
            "architecture": release.architecture,
            "metadata": release.metadata,
            "tensors": [{"name": n, "sha256": digest(a).hex()} for n, a in release.tensors],
        }
        text = json.dumps(doc, sort_keys=True, indent=1)
        self._atomic_write(js, lambda p: Path(p).write_text(text))
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def remove(self, key: str) -> None:
        for p in self._paths(key):
            p.unlink(missing_ok=True)

    def get(self, key: str) -> StoredRelease | None:
        """The entry for ``key`` with its bytes checked against its own digests, or None.

        FailedPrecondition (naming the file) when the files do not read back or a tensor's
        bytes differ from the digest the entry (and its record) bind."""
        st, js = self._paths(key)
        if not js.exists():
            return None
        try:
            doc = json.loads(js.read_text())
            record = ReleaseRecord.from_json(doc["record_json"].encode())
            listed = [(t["name"], bytes.fromhex(t["sha256"])) for t in doc["tensors"]]
            arrays = load_file(str(st))
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            raise FailedPrecondition(
                f"release store: entry {js} does not read back ({type(e).__name__}); it is not served "
                "(delete it and its .safetensors to make and charge the release anew)",
                reason="STORED_RELEASE_UNREADABLE",
            ) from None
        if set(arrays) != {n for n, _ in listed} or any(digest(arrays[n]) != d for n, d in listed):
            raise FailedPrecondition(
                f"release store: the tensors of {st} differ from the digests stored with them (the file was "
                "changed); it is not served (delete the entry to make and charge the release anew)",
                reason="STORED_RELEASE_MISMATCH",
            )
        if record.parameters.get("release_sha256") != release_sha256(listed):
            raise FailedPrecondition(
                f"release store: {js} lists tensors other than the ones its record binds; it is not served",
                reason="STORED_RELEASE_MISMATCH",
            )
        return StoredRelease(key, record, doc["architecture"], doc["metadata"], [(n, arrays[n]) for n, _ in listed])


# ---------------------------------------------------------------- segments of a multi-round run

#: The ledger counterparty of a published segment: it is charged once, when it is published,
#: for every peer the policy lets ask for "segment" (each is served it again, at no charge).
SEGMENT_AUDIENCE = "*"


def check_run_name(run: str, field: str = "run") -> str:
    """A run's name: 1–64 characters of letters, digits, ``.``, ``_`` and ``-``."""
    if not isinstance(run, str) or not 1 <= len(run) <= 64 or not all(c.isalnum() or c in "._-" for c in run):
        raise InvalidArgument(field, f"must be 1–64 letters, digits, '.', '_' or '-', got {run!r}")
    return run


def segment_key(run: str, round_number: int) -> str:
    """The store key of round ``round_number``'s segment of ``run``."""
    text = json.dumps({"kind": "segment", "run": run, "round": int(round_number)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def segment_rounds(store: ReleaseStore, run: str) -> list[tuple[int, str]]:
    """(round, key) of every segment of ``run`` in the store, newest first (whether or not its
    charge stands: the caller checks that before serving)."""
    out = []
    if not store.directory.is_dir():
        return out
    for js in store.directory.glob("*.json"):
        try:
            params = json.loads(js.read_text())["parameters"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written (never: JSON is renamed into place) or broken: get() refuses it
        if isinstance(params, dict) and params.get("kind") == "segment" and params.get("run") == run:
            r = params.get("round")
            if isinstance(r, int) and js.stem == segment_key(run, r):
                out.append((r, js.stem))
    return sorted(out, reverse=True)
