"""Secure aggregation on the wire: the protocol's values (``peer.net.secagg``) to and from their
protobuf messages (``SecAggContext``, ``SecAggMessage``; ``docs/wire.md`` §3.5), and the board
a daemon serves its own site's messages from.

Every value is checked as it is read (field named in the error): the context is rebuilt as a
``MaskContext`` (sorted unique sites, bits in [1, 64]); a key is 32 bytes; residues are
little-endian, 4 bytes each when bits ≤ 32 and 8 otherwise, each below 2^bits. Signatures are
not checked here — the receiving site's protocol does that against its pins.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from peer.base.errors import InvalidArgument, NotFound, PermissionDenied
from peer.net.secagg import PUBLIC_KEY_BYTES, MaskContext, MaskedShare, SignedDigest, SignedKey
from privfusion.v1 import peer_pb2 as pb

KINDS = ("key", "masked", "digests")
#: contexts a board keeps (the oldest is forgotten first): a few steps' attempts
BOARD_CONTEXTS = 64
DIGEST_BYTES = 32


def context_message(context: MaskContext) -> pb.SecAggContext:
    return pb.SecAggContext(
        run=context.run_id, step=context.step, attempt=context.attempt, sites=list(context.sites), bits=context.bits
    )


def context_of(message: pb.SecAggContext) -> MaskContext:
    """The context a message names (InvalidArgument naming ``context.<field>``)."""
    if list(message.sites) != sorted(set(message.sites)):
        raise InvalidArgument("context.sites", "must be sorted and unique")
    try:
        return MaskContext(message.run, message.step, message.attempt, tuple(message.sites), message.bits)
    except InvalidArgument as e:
        raise InvalidArgument(f"context.{e.field}", e.rule) from None


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidArgument("kind", f"must be one of {list(KINDS)}, got {kind!r}")
    return kind


def residue_bytes(bits: int) -> int:
    return 4 if bits <= 32 else 8


def pack_residues(y: np.ndarray, bits: int) -> bytes:
    return np.ascontiguousarray(y, dtype=f"<u{residue_bytes(bits)}").tobytes()


def unpack_residues(raw: bytes, context: MaskContext) -> np.ndarray:
    width = residue_bytes(context.bits)
    if len(raw) == 0 or len(raw) % width:
        raise InvalidArgument("message.masked", f"must be a non-empty whole number of {width}-byte residues")
    y = np.frombuffer(raw, dtype=f"<u{width}").astype(np.uint64)
    if context.bits < 64 and np.any(y >> np.uint64(context.bits)):
        raise InvalidArgument("message.masked", f"must hold residues mod 2^{context.bits}")
    return y


def _digest_message(d: SignedDigest) -> pb.SecAggDigest:
    return pb.SecAggDigest(site=d.site, digest=d.digest, signature=d.signature)


def _digest_of(m: pb.SecAggDigest, context: MaskContext, field: str) -> SignedDigest:
    context.check_member(m.site, f"{field}.site")
    if len(m.digest) != DIGEST_BYTES:
        raise InvalidArgument(f"{field}.digest", f"must be {DIGEST_BYTES} bytes (SHA-256)")
    if not m.signature:
        raise InvalidArgument(f"{field}.signature", "is required")
    return SignedDigest(m.site, context, bytes(m.digest), bytes(m.signature))


def message_of_value(kind: str, sender: str, value, context: MaskContext) -> pb.SecAggMessage:
    """The message of one protocol value: a SignedKey ("key"), a MaskedShare ("masked"), a
    sequence of SignedDigest ("digests")."""
    check_kind(kind)
    if kind == "key":
        return pb.SecAggMessage(kind=kind, sender=sender, public_key=value.public_key, key_signature=value.signature)
    if kind == "masked":
        return pb.SecAggMessage(
            kind=kind,
            sender=sender,
            masked=pack_residues(value.y, context.bits),
            digest=_digest_message(value.signed),
            release_id=value.release_id,
        )
    return pb.SecAggMessage(kind=kind, sender=sender, digests=[_digest_message(d) for d in value])


def value_of_message(message: pb.SecAggMessage, context: MaskContext, kind: str, sender: str):
    """The protocol value a message holds, checked against the kind and sender asked for."""
    check_kind(kind)
    if message.kind != kind:
        raise InvalidArgument("message.kind", f"must be {kind!r}, got {message.kind!r}")
    if message.sender != sender:
        raise PermissionDenied(
            f"message.sender: {message.sender!r} where {sender!r} was asked",
            reason="SECAGG_WRONG_SENDER",
            metadata={"site": sender},
        )
    context.check_member(sender, "message.sender")
    if kind == "key":
        if len(message.public_key) != PUBLIC_KEY_BYTES:
            raise InvalidArgument("message.public_key", f"must be {PUBLIC_KEY_BYTES} raw X25519 bytes")
        if not message.key_signature:
            raise InvalidArgument("message.key_signature", "is required")
        return SignedKey(sender, context, bytes(message.public_key), bytes(message.key_signature))
    if kind == "masked":
        if not message.HasField("digest"):
            raise InvalidArgument("message.digest", "is required with a masked vector")
        if not message.release_id:
            raise InvalidArgument("message.release_id", "must name the ledger charge of the step")
        return MaskedShare(
            unpack_residues(message.masked, context),
            _digest_of(message.digest, context, "message.digest"),
            message.release_id,
        )
    if len(message.digests) > len(context.sites):
        raise InvalidArgument("message.digests", f"at most one per site of the context ({len(context.sites)})")
    return tuple(_digest_of(d, context, f"message.digests[{i}]") for i, d in enumerate(message.digests))


def check_recipients(recipients: Iterable[str], context: MaskContext, sender: str) -> tuple[str, ...]:
    out = tuple(recipients)
    if not out or len(set(out)) != len(out):
        raise InvalidArgument("recipients", "must name at least one site, each once")
    for r in out:
        context.check_member(r, "recipients")
        if r == sender:
            raise InvalidArgument("recipients", "the sender does not fetch its own message")
    return out


class SecAggBoard:
    """The messages a daemon's own site published, by (context, kind, recipient); the newest
    :data:`BOARD_CONTEXTS` contexts are kept. Thread-safe."""

    def __init__(self, contexts: int = BOARD_CONTEXTS):
        self._contexts = contexts
        self._lock = threading.Lock()
        self._by_context: OrderedDict[bytes, dict[tuple[str, str], pb.SecAggMessage]] = OrderedDict()

    def publish(self, context: MaskContext, message: pb.SecAggMessage, recipients: Sequence[str]) -> None:
        key = context.canonical()
        with self._lock:
            slot = self._by_context.setdefault(key, {})
            self._by_context.move_to_end(key)
            for r in recipients:
                slot[(message.kind, r)] = message
            while len(self._by_context) > self._contexts:
                self._by_context.popitem(last=False)

    def fetch(self, context: MaskContext, kind: str, recipient: str) -> pb.SecAggMessage:
        with self._lock:
            message = self._by_context.get(context.canonical(), {}).get((kind, recipient))
        if message is None:
            raise NotFound(
                f"secure aggregation: no {kind} published for {recipient!r} in run {context.run_id!r} step "
                f"{context.step} attempt {context.attempt} yet",
                reason="SECAGG_NOT_PUBLISHED",
            )
        return message


__all__ = [
    "KINDS",
    "SecAggBoard",
    "check_kind",
    "check_recipients",
    "context_message",
    "context_of",
    "message_of_value",
    "pack_residues",
    "unpack_residues",
    "value_of_message",
]
