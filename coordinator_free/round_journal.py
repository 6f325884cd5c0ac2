"""The journal of a named one-shot round: what it asks for and every release it receives, on
disk as it happens, so that a rerun of an attempt that did not fuse (interrupted by a signal,
SIGKILLed, its machine rebooted, aborted short of its quorum) reuses what the peers already
charged instead of buying it again.

A round is named by its ``[round] label``; an unnamed round keeps no journal. The journal of
round NAME is ``OUT/journal/<SHA-256(NAME)[:16]>/``::

    plan.json          the name, every attempt's round id, and the plan: model, method, the roster's
                       peers, every ε/δ, unit, clip and bound asked for, the probe set's SHA-256
    K.asked.json       that a release was asked for (written before the call: the peer may charge
                       it even if its receipt never arrives)
    K.receipt.json     a release's signed receipt, written as it arrives (before any tensor byte)
    K.json, K.safetensors   the whole release (``peer.net.client.save_release``), once received
                       and checked

(``K`` = the first 24 hex digits of SHA-256(peer name ‖ NUL ‖ step): one release per peer and
step.) Every file is
written to a temporary name, fsynced and renamed.

A rerun of NAME (the same label) with the same plan is the same round: for each peer and step,

* a release received whole is reused as it is — checked again against the signer's pinned
  certificate (:func:`peer.net.client.load_saved_release`), not asked for, nothing charged;
* a release whose receipt arrived but whose bytes did not (the process died mid-stream) was
  charged by the peer; one asked for whose receipt never arrived may have been: a model-level
  one (features, weights) is never bought a second time — the peer is left out of this attempt,
  saying which; a data-level merge is asked for again and the peer serves the identical bytes
  again at no charge (``peer.desk.desk.ReleaseDesk.merged``);
* never asked for: asked for as usual.

A rerun whose plan differs is refused before anything is asked, naming what changed (reusing
releases made for another plan would fuse what this plan did not ask for; buying them anew
would spend budget twice for one round): give the round another label. The journal is removed
when an attempt fuses (its report lists every receipt, reused ones with the attempt that got
them); otherwise it stays for the next rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import FailedPrecondition
from peer.net.client import load_saved_release, save_release
from peer.net.trust import TrustStore

#: the steps of a round that a peer charges (``coordinator_free.rounds.CHARGED_STEPS``)
MODEL_LEVEL_STEPS = ("features", "weights")


def round_plan(config, peers: list[str], probe: np.ndarray) -> dict[str, Any]:
    """What a round asks its peers for, as JSON-ready data: the part of the config that shapes a
    release (not timeouts, not what is done locally after fusion), the roster's peers, and the
    SHA-256 of the probe set the features are computed on."""
    clip = config.activation_clip
    return {
        "model": config.model,
        "method": config.method,
        "peers": sorted(peers),
        "features.activation_epsilon": config.activation_epsilon,
        "features.weight_epsilon": config.weight_epsilon,
        "features.unit": config.unit,
        "features.activation_clip": None if clip is None else [float(clip[0]), float(clip[1])],
        "features.weight_bound": config.weight_bound,
        "weights.epsilon": config.weights_epsilon,
        "weights.delta": config.weights_delta,
        "merge.method": config.merge_method,
        "merge.epsilon": config.merge_epsilon,
        "merge.delta": config.merge_delta,
        "probe_sha256": hashlib.sha256(np.ascontiguousarray(probe).tobytes()).hexdigest(),
    }


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Earlier:
    """What an earlier attempt got for one peer and step: the whole release (``release``), only
    its receipt (``receipt``: what the receipt says) when its bytes never arrived, or neither
    when it was asked for (``round_id``: by which attempt) and no receipt arrived."""

    round_id: str
    receipt: dict | None = None
    release: Any = None  # peer.net.wire.Release


class RoundJournal:
    """The journal of one named round (see the module docstring)."""

    def __init__(self, directory: Path, name: str, round_id: str, attempts: list[str], trust: TrustStore):
        self.directory, self.name, self.round_id, self.trust = directory, name, round_id, trust
        #: the round ids of the earlier attempts, oldest first
        self.attempts = attempts

    @classmethod
    def open(cls, out: Path, name: str, round_id: str, plan: dict, trust: TrustStore) -> RoundJournal | None:
        """The journal of round ``name`` for attempt ``round_id`` (None for an unnamed round):
        a new one, or the one an earlier attempt left, whose plan must be ``plan``
        (FailedPrecondition naming every difference otherwise; nothing is written then)."""
        if not name:
            return None
        directory = Path(out) / "journal" / hashlib.sha256(name.encode()).hexdigest()[:16]
        plan_path = directory / "plan.json"
        attempts: list[str] = []
        if plan_path.exists():
            before = json.loads(plan_path.read_text(encoding="utf-8"))
            changed = [
                f"{k}: {before['plan'].get(k)!r} then, {plan.get(k)!r} now"
                for k in sorted(set(before["plan"]) | set(plan))
                if before["plan"].get(k) != plan.get(k)
            ]
            if changed:
                raise FailedPrecondition(
                    f"round {name!r}: an earlier attempt ({', '.join(before['attempts'])}) did not fuse and its "
                    f"releases are kept for a rerun with the same plan, but this one differs: {'; '.join(changed)}. "
                    f"Give the round another label, or ask what the earlier attempt asked (journal {directory})"
                )
            attempts = list(before["attempts"])
        directory.mkdir(parents=True, exist_ok=True)
        doc = {"name": name, "attempts": [*attempts, round_id], "plan": plan}
        _write_atomic(plan_path, json.dumps(doc, indent=1, sort_keys=True))
        return cls(directory, name, round_id, attempts, trust)

    def _stem(self, peer: str, step: str) -> Path:
        return self.directory / hashlib.sha256(f"{peer}\0{step}".encode()).hexdigest()[:24]

    def earlier(self, peer: str, step: str, subject: str) -> Earlier | None:
        """What an earlier attempt got from ``peer`` at ``step`` for ``subject`` (the model or
        pool asked for), or None. A saved release that no longer checks against the signer's
        pin raises (InvalidArgument naming the field): it is never reused, never silently re-bought."""
        if not self.attempts:
            return None
        stem = self._stem(peer, step)
        asked_path, receipt_path = (stem.with_name(stem.name + s) for s in (".asked.json", ".receipt.json"))
        if not receipt_path.exists():
            if not asked_path.exists():
                return None
            asked = json.loads(asked_path.read_text(encoding="utf-8"))
            return Earlier(asked["round_id"]) if asked["subject"] == subject else None
        doc = json.loads(receipt_path.read_text(encoding="utf-8"))
        if doc["subject"] != subject:
            return None  # another model or pool than this attempt asks for: a release of its own
        release = None
        if stem.with_name(stem.name + ".json").exists():
            release = load_saved_release(stem, self.trust)
            if release.receipt.record.release_id != doc["release_id"]:
                release = None  # the bytes of another release than the receipt's: not this one
        return Earlier(doc["round_id"], doc, release)

    def asking(self, peer: str, step: str, subject: str) -> None:
        """Before a release is asked for: from here on the peer may charge it."""
        stem = self._stem(peer, step)
        doc = {"peer": peer, "step": step, "subject": subject, "round_id": self.round_id}
        _write_atomic(stem.with_name(stem.name + ".asked.json"), json.dumps(doc, indent=1, sort_keys=True))

    def receipt(self, peer: str, step: str, receipt) -> None:
        """A receipt as it arrives (before any tensor byte): the peer has charged the release."""
        record = receipt.record
        doc = {
            "peer": peer,
            "step": step,
            "subject": record.subject,
            "release_id": record.release_id,
            "ledger_entry_id": receipt.ledger_entry_id,
            "level": record.level,
            "round_id": self.round_id,
            "receipt": json.loads(receipt.to_json()),
        }
        stem = self._stem(peer, step)
        _write_atomic(stem.with_name(stem.name + ".receipt.json"), json.dumps(doc, indent=1, sort_keys=True))

    def received(self, peer: str, step: str, release) -> None:
        """The whole release, received and checked."""
        save_release(release, self._stem(peer, step))

    def close(self) -> None:
        """The round fused: its report holds every receipt; the journal is no longer needed."""
        shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["MODEL_LEVEL_STEPS", "Earlier", "RoundJournal", "round_plan"]
