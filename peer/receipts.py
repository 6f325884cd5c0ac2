"""Signed receipts: the release record a site sends, signed, before the bytes of a release.

A receipt binds four things under the releasing site's key:

- who released (``signer``, a site name whose pinned certificate verifies the signature),
- the ledger entry the release was charged to (``ledger_entry_id``),
- the release record itself (its canonical JSON, byte for byte),
- the names and SHA-256 of every tensor of the release, in stream order.

The signed bytes are :func:`signing_payload`: a fixed context string and a canonical JSON
object, so a signature over one kind of message can never be replayed as another. A receipt is
saved beside the safetensors it describes (``NAME.receipt.json``) and can be checked offline
with the signer's certificate (:func:`verify_receipt`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

from coordinator_free.identity import SIGNATURE_ALGORITHM, Identity, verify_signature
from peer.errors import InvalidArgument
from peer.records import ReleaseRecord

CONTEXT = b"privfusion.v1/receipt\n"


def signing_payload(signer: str, ledger_entry_id: str, record_json: bytes,
                    tensors: Sequence[tuple[str, bytes]]) -> bytes:
    """The exact bytes a receipt's signature is over."""
    body = {
        "signer": signer,
        "ledger_entry_id": ledger_entry_id,
        "record_sha256": hashlib.sha256(record_json).hexdigest(),
        "tensors": [[name, digest.hex()] for name, digest in tensors],
    }
    return CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class SignedReceipt:
    signer: str
    ledger_entry_id: str
    record_json: bytes
    tensors: tuple[tuple[str, bytes], ...]
    signature: bytes
    signature_algorithm: str = SIGNATURE_ALGORITHM

    @property
    def record(self) -> ReleaseRecord:
        return ReleaseRecord.from_json(self.record_json)

    def to_json(self) -> str:
        """A self-contained JSON document (saved beside the released tensors)."""
        return json.dumps({
            "signer": self.signer,
            "ledger_entry_id": self.ledger_entry_id,
            "record": json.loads(self.record_json),
            "record_json": self.record_json.decode(),
            "tensors": [{"name": n, "sha256": d.hex()} for n, d in self.tensors],
            "signature_algorithm": self.signature_algorithm,
            "signature": base64.b64encode(self.signature).decode(),
        }, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "SignedReceipt":
        try:
            d = json.loads(text)
            return cls(d["signer"], d["ledger_entry_id"], d["record_json"].encode(),
                       tuple((t["name"], bytes.fromhex(t["sha256"])) for t in d["tensors"]),
                       base64.b64decode(d["signature"], validate=True), d["signature_algorithm"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument("receipt", f"is not a PrivFusion receipt document: {e}") from None


def sign_receipt(identity: Identity, ledger_entry_id: str, record: ReleaseRecord,
                 tensors: Sequence[tuple[str, bytes]]) -> SignedReceipt:
    record_json = record.canonical_json()
    tensors = tuple((str(n), bytes(d)) for n, d in tensors)
    payload = signing_payload(identity.name, ledger_entry_id, record_json, tensors)
    return SignedReceipt(identity.name, ledger_entry_id, record_json, tensors, identity.sign(payload))


def verify_receipt(receipt: SignedReceipt, cert_pem: bytes, expected_signer: str | None = None) -> ReleaseRecord:
    """Check the signature against the signer's pinned certificate; return the record.

    Raises ``InvalidArgument`` naming the field at fault: a different signer than expected, an
    unknown algorithm, a signature that does not verify, or a record that does not parse.
    """
    if expected_signer is not None and receipt.signer != expected_signer:
        raise InvalidArgument("receipt.signer", f"is {receipt.signer!r}, expected {expected_signer!r}")
    if receipt.signature_algorithm != SIGNATURE_ALGORITHM:
        raise InvalidArgument("receipt.signature_algorithm", f"must be {SIGNATURE_ALGORITHM!r}, got {receipt.signature_algorithm!r}")
    payload = signing_payload(receipt.signer, receipt.ledger_entry_id, receipt.record_json, receipt.tensors)
    try:
        verify_signature(cert_pem, payload, receipt.signature)
    except InvalidArgument:
        raise InvalidArgument("receipt.signature", f"does not verify against {receipt.signer!r}'s pinned certificate") from None
    return receipt.record
