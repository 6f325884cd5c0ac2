"""Signed receipts: the release record a site sends, signed, before the bytes of a release.

A receipt binds, under the releasing site's key (ECDSA P-256 with SHA-256, DER signature):

- who released (``signer``, a site name whose pinned certificate verifies the signature),
- the ledger entry the release was charged to (``ledger_entry_id``, opaque to the receiver),
- the release record itself (its canonical JSON, byte for byte),
- the names and SHA-256 of every tensor of the release, in stream order,
- the SHA-256 of the release's **manifest** (:class:`Manifest`: kind, model, architecture and
  metadata JSON as sent, every tensor's name, dtype, shape, size and SHA-256, the total size,
  and the digests of the upstream receipts the release is built on).

Everything is signed through two language-neutral byte layouts, specified exactly in
``docs/wire.md`` ("Signed bytes") so that a verifier in any language can rebuild them from the
protobuf messages alone:

    manifest_bytes  = "privfusion.v1/manifest/2\\n" STR(kind) STR(model) STR(architecture_json)
                      STR(metadata_json) U32(n) n×[STR(name) U32(dtype) U32(ndim) ndim×U64(dim)
                      U64(nbytes) BYTES(sha256)] U64(total_bytes) U32(m) m×BYTES(receipt digest)
    signing_payload = "privfusion.v1/receipt/2\\n" STR(signer) STR(ledger_entry_id)
                      BYTES(record_json) U32(n) n×[STR(name) BYTES(sha256)]
                      BYTES(SHA-256(manifest_bytes))

A data-level release served again from the site's release store (the identical bytes of an
earlier charge, at no new charge) is signed over the same fields under the context
"privfusion.v1/receipt-served-again/1\\n", followed by STR(served_again) STR(served_to): the
ledger's served-again row and the requester. ``ledger_entry_id`` and the record stay those of
the original charge, so a requester counts releases made (distinct ledger entries) and
releases served again.

A receipt may also carry the releasing site's ledger position right after the charge it names
(``ledger_seq``: the charge chain's sequence number; ``ledger_head``: its 32-byte head hash;
for a release served again, the charge chain's position when it was served), so that every
counterparty holds evidence of how far the ledger reached: a ledger later found shorter, or
with another hash at that position, was cut short or rolled back. With the two fields set the
receipt is signed under "privfusion.v1/receipt/3\n" (served again:
"privfusion.v1/receipt-served-again/2\n"), the earlier layout followed by U64(ledger_seq)
BYTES(ledger_head); without them under the earlier contexts, so receipts written by the
previous version still verify, and a receipt stripped of the fields no longer does.

with U32/U64 unsigned big-endian integers, STR(s) = U32(len(utf8(s))) utf8(s) and BYTES(b) =
U32(len(b)) b. A receipt digest is SHA-256(signing_payload) of that receipt. The context strings
keep a signature over one kind of message from being replayed as another, and their version
suffix ("/2") from being read under an older layout.

The manifest digest is carried in the receipt, so a receipt verifies on its own (an upstream
receipt travels without its manifest) and a manifest is bound by recomputing its digest. A
receipt is saved beside the safetensors it describes, with the manifest, and both can be checked
offline with the signer's certificate alone (:func:`verify_receipt`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.net.identity import SIGNATURE_ALGORITHM, Identity, verify_signature
from privfusion.v1 import tensor_pb2 as tpb

CONTEXT = b"privfusion.v1/receipt/2\n"
#: The context of a receipt for a release served again from the site's release store (no new
#: charge): the layout of ``CONTEXT`` followed by STR(served_again) STR(served_to).
SERVED_AGAIN_CONTEXT = b"privfusion.v1/receipt-served-again/1\n"
#: The contexts of receipts that carry the ledger's position (``ledger_seq``, ``ledger_head``):
#: the earlier layouts followed by U64(ledger_seq) BYTES(ledger_head).
CONTEXT_WITH_POSITION = b"privfusion.v1/receipt/3\n"
SERVED_AGAIN_CONTEXT_WITH_POSITION = b"privfusion.v1/receipt-served-again/2\n"
MANIFEST_CONTEXT = b"privfusion.v1/manifest/2\n"
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


# ---------------------------------------------------------------------------- the byte layout


def _u32(n: int, field: str) -> bytes:
    if not 0 <= n <= _U32_MAX:
        raise InvalidArgument(field, f"must be in [0, 2^32 - 1] to be signed, got {n}")
    return struct.pack(">I", n)


def _u64(n: int, field: str) -> bytes:
    if not 0 <= n <= _U64_MAX:
        raise InvalidArgument(field, f"must be in [0, 2^64 - 1] to be signed, got {n}")
    return struct.pack(">Q", n)


def _bytes(b: bytes, field: str) -> bytes:
    return _u32(len(b), field) + bytes(b)


def _str(s: str, field: str) -> bytes:
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(field, "must be valid Unicode (it is signed as UTF-8)") from None
    return _bytes(raw, field)


def _digest32(b: bytes, field: str) -> bytes:
    if len(b) != 32:
        raise InvalidArgument(field, f"must be a 32-byte SHA-256, got {len(b)} bytes")
    return _bytes(b, field)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the manifest announces it. ``dtype`` is the ``privfusion.v1.DType`` number."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    sha256: bytes


@dataclass(frozen=True)
class Manifest:
    """What a release holds, exactly as it travels in ``ReleaseManifest`` (strings byte for byte).

    ``upstream`` holds the digests (:func:`receipt_digest`) of the receipts the release is built
    on, in the order of ``ReleaseManifest.upstream``.
    """

    kind: str
    model: str
    architecture_json: str
    metadata_json: str
    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    upstream: tuple[bytes, ...] = ()

    def to_bytes(self) -> bytes:
        """``manifest_bytes`` of the module docstring."""
        out = [
            MANIFEST_CONTEXT,
            _str(self.kind, "manifest.kind"),
            _str(self.model, "manifest.model"),
            _str(self.architecture_json, "manifest.architecture_json"),
            _str(self.metadata_json, "manifest.metadata_json"),
            _u32(len(self.tensors), "manifest.tensor_count"),
        ]
        for i, t in enumerate(self.tensors):
            f = f"manifest.tensors[{i}]"
            out += [_str(t.name, f"{f}.name"), _u32(t.dtype, f"{f}.dtype"), _u32(len(t.shape), f"{f}.shape")]
            out += [_u64(d, f"{f}.shape") for d in t.shape]
            out += [_u64(t.nbytes, f"{f}.nbytes"), _digest32(t.sha256, f"{f}.sha256")]
        out += [_u64(self.total_bytes, "manifest.total_bytes"), _u32(len(self.upstream), "manifest.upstream")]
        out += [_digest32(d, f"manifest.upstream[{i}]") for i, d in enumerate(self.upstream)]
        return b"".join(out)

    def digest(self) -> bytes:
        return hashlib.sha256(self.to_bytes()).digest()

    def to_dict(self) -> dict[str, Any]:
        """A JSON form for saved releases (the strings kept byte for byte)."""
        return {
            "kind": self.kind,
            "model": self.model,
            "architecture_json": self.architecture_json,
            "metadata_json": self.metadata_json,
            "total_bytes": self.total_bytes,
            "tensors": [
                {
                    "name": t.name,
                    "dtype": tpb.DType.Name(t.dtype) if t.dtype in tpb.DType.values() else t.dtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "sha256": t.sha256.hex(),
                }
                for t in self.tensors
            ],
            "upstream": [d.hex() for d in self.upstream],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        try:
            tensors = tuple(
                TensorEntry(
                    str(t["name"]),
                    t["dtype"] if isinstance(t["dtype"], int) else tpb.DType.Value(t["dtype"]),
                    tuple(int(x) for x in t["shape"]),
                    int(t["nbytes"]),
                    bytes.fromhex(t["sha256"]),
                )
                for t in d["tensors"]
            )
            return cls(
                str(d["kind"]),
                str(d["model"]),
                str(d["architecture_json"]),
                str(d["metadata_json"]),
                tensors,
                int(d["total_bytes"]),
                tuple(bytes.fromhex(u) for u in d["upstream"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument("manifest", f"is not a PrivFusion release manifest: {e}") from None


def signing_payload(
    signer: str,
    ledger_entry_id: str,
    record_json: bytes,
    tensors: Sequence[tuple[str, bytes]],
    manifest_sha256: bytes,
    served_again: str = "",
    served_to: str = "",
    ledger_seq: int = 0,
    ledger_head: bytes = b"",
) -> bytes:
    """The exact bytes a receipt's signature is over (``signing_payload`` of the module docstring).

    A release served again (``served_again``: the id of the ledger's served-again row; the
    record and ``ledger_entry_id`` are the original charge's) is signed under
    ``SERVED_AGAIN_CONTEXT`` with ``STR(served_again) STR(served_to)`` appended, so a receipt of
    a fresh release keeps the "/2" layout byte for byte and neither kind verifies as the other.
    With the ledger's position (``ledger_seq`` >= 1 and the 32-byte ``ledger_head``, given
    together) the contexts are the "…/3" and "…-served-again/2" ones and
    ``U64(ledger_seq) BYTES(ledger_head)`` comes last."""
    if bool(served_again) != bool(served_to):
        raise InvalidArgument("receipt.served_to", "is given exactly when receipt.served_again is")
    positioned = _check_position(ledger_seq, ledger_head)
    if positioned:
        context = SERVED_AGAIN_CONTEXT_WITH_POSITION if served_again else CONTEXT_WITH_POSITION
    else:
        context = SERVED_AGAIN_CONTEXT if served_again else CONTEXT
    out = [
        context,
        _str(signer, "receipt.signer"),
        _str(ledger_entry_id, "receipt.ledger_entry_id"),
        _bytes(record_json, "receipt.record_json"),
        _u32(len(tensors), "receipt.tensors"),
    ]
    for i, (name, sha) in enumerate(tensors):
        out += [_str(name, f"receipt.tensors[{i}].name"), _digest32(sha, f"receipt.tensors[{i}].sha256")]
    out.append(_digest32(manifest_sha256, "receipt.manifest_sha256"))
    if served_again:
        out += [_str(served_again, "receipt.served_again"), _str(served_to, "receipt.served_to")]
    if positioned:
        out += [_u64(ledger_seq, "receipt.ledger_seq"), _digest32(ledger_head, "receipt.ledger_head")]
    return b"".join(out)


def _check_position(ledger_seq: int, ledger_head: bytes) -> bool:
    """Whether a receipt carries the ledger's position; InvalidArgument unless both fields are
    set (seq >= 1, a 32-byte head) or neither (0 and empty)."""
    if isinstance(ledger_seq, bool) or not isinstance(ledger_seq, int) or ledger_seq < 0:
        raise InvalidArgument("receipt.ledger_seq", f"must be an integer >= 0, got {ledger_seq!r}")
    if not isinstance(ledger_head, (bytes, bytearray)):
        raise InvalidArgument("receipt.ledger_head", "must be bytes")
    if (ledger_seq == 0) != (len(ledger_head) == 0):
        raise InvalidArgument(
            "receipt.ledger_head", "is set (32 bytes) exactly when receipt.ledger_seq is (>= 1), or neither is"
        )
    return ledger_seq > 0


# ---------------------------------------------------------------------------- receipts


@dataclass(frozen=True)
class SignedReceipt:
    signer: str
    ledger_entry_id: str
    record_json: bytes
    tensors: tuple[tuple[str, bytes], ...]
    manifest_sha256: bytes
    signature: bytes
    signature_algorithm: str = SIGNATURE_ALGORITHM
    # a release served again from the site's store: the ledger's served-again row and whom to
    # (empty for a release made and charged for this request)
    served_again: str = ""
    served_to: str = ""
    # the releasing site's ledger position right after the charge (both empty: a receipt of
    # the previous version, which did not carry it)
    ledger_seq: int = 0
    ledger_head: bytes = b""

    @property
    def record(self) -> ReleaseRecord:
        return ReleaseRecord.from_json(self.record_json)

    @property
    def recipient(self) -> str:
        """Whom the bytes were sent to under this receipt: the record's counterparty, or for a
        release served again the requester it was served to."""
        return self.served_to or self.record.counterparty

    def payload(self) -> bytes:
        return signing_payload(
            self.signer,
            self.ledger_entry_id,
            self.record_json,
            self.tensors,
            self.manifest_sha256,
            self.served_again,
            self.served_to,
            self.ledger_seq,
            self.ledger_head,
        )

    def to_json(self) -> str:
        """A self-contained JSON document (saved beside the released tensors)."""
        return json.dumps(
            {
                "signer": self.signer,
                "ledger_entry_id": self.ledger_entry_id,
                "record": json.loads(self.record_json),
                "record_json": self.record_json.decode(),
                "tensors": [{"name": n, "sha256": d.hex()} for n, d in self.tensors],
                "manifest_sha256": self.manifest_sha256.hex(),
                "signature_algorithm": self.signature_algorithm,
                "signature": base64.b64encode(self.signature).decode(),
                **({"served_again": self.served_again, "served_to": self.served_to} if self.served_again else {}),
                **(
                    {"ledger_seq": self.ledger_seq, "ledger_head": self.ledger_head.hex()}
                    if self.ledger_seq or self.ledger_head
                    else {}
                ),
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes | Mapping) -> SignedReceipt:
        try:
            d = text if isinstance(text, Mapping) else json.loads(text)
            return cls(
                d["signer"],
                d["ledger_entry_id"],
                d["record_json"].encode(),
                tuple((t["name"], bytes.fromhex(t["sha256"])) for t in d["tensors"]),
                bytes.fromhex(d["manifest_sha256"]),
                base64.b64decode(d["signature"], validate=True),
                d["signature_algorithm"],
                d.get("served_again", ""),
                d.get("served_to", ""),
                int(d.get("ledger_seq", 0)),
                bytes.fromhex(d.get("ledger_head", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument("receipt", f"is not a PrivFusion receipt document: {e}") from None


def receipt_digest(receipt: SignedReceipt) -> bytes:
    """SHA-256 of the receipt's signing payload: how a manifest names an upstream receipt.

    Over the signed bytes, not the signature: an ECDSA signature can be re-encoded into another
    valid one (s ↔ n − s), so it does not identify what was signed."""
    return hashlib.sha256(receipt.payload()).digest()


def sign_receipt(
    identity: Identity,
    ledger_entry_id: str,
    record: ReleaseRecord,
    manifest: Manifest,
    served_again: str = "",
    served_to: str = "",
    ledger_seq: int = 0,
    ledger_head: bytes = b"",
) -> SignedReceipt:
    """Sign a charged release: the record, the ledger entry and the manifest (which lists the
    tensors' digests; the receipt repeats their names and digests in stream order). With
    ``served_again`` (the ledger's served-again row) and ``served_to``: the identical bytes of
    the charge ``ledger_entry_id`` served again to ``served_to`` at no new charge. With
    ``ledger_seq`` and ``ledger_head``: the ledger's charge chain position right after the
    charge (or when served again), signed too."""
    record_json = record.canonical_json()
    tensors = tuple((t.name, bytes(t.sha256)) for t in manifest.tensors)
    manifest_sha256 = manifest.digest()
    payload = signing_payload(
        identity.name,
        ledger_entry_id,
        record_json,
        tensors,
        manifest_sha256,
        served_again,
        served_to,
        ledger_seq,
        bytes(ledger_head),
    )
    return SignedReceipt(
        identity.name,
        ledger_entry_id,
        record_json,
        tensors,
        manifest_sha256,
        identity.sign(payload),
        SIGNATURE_ALGORITHM,
        served_again,
        served_to,
        ledger_seq,
        bytes(ledger_head),
    )


def check_manifest(receipt: SignedReceipt, manifest: Manifest) -> None:
    """The manifest is the one the receipt signed: same digest, same tensors in the same order.

    Raises ``InvalidArgument`` naming the field at fault."""
    if [(t.name, bytes(t.sha256)) for t in manifest.tensors] != [(n, bytes(d)) for n, d in receipt.tensors]:
        raise InvalidArgument(
            "manifest.tensors", "do not match the tensors the receipt signed (names, checksums, order)"
        )
    if manifest.digest() != receipt.manifest_sha256:
        raise InvalidArgument(
            "manifest",
            "does not match the manifest digest the receipt signed (kind, model, "
            "architecture, metadata, tensor dtypes/shapes/sizes or upstream receipts differ)",
        )


def verify_receipt(
    receipt: SignedReceipt, cert_pem: bytes, expected_signer: str | None = None, manifest: Manifest | None = None
) -> ReleaseRecord:
    """Check the signature against the signer's pinned certificate (and, when given, that
    ``manifest`` is the one signed); return the record.

    Raises ``InvalidArgument`` naming the field at fault: a different signer than expected, an
    unknown algorithm, a signature that does not verify, a manifest other than the signed one,
    or a record that does not parse.
    """
    if expected_signer is not None and receipt.signer != expected_signer:
        raise InvalidArgument("receipt.signer", f"is {receipt.signer!r}, expected {expected_signer!r}")
    if receipt.signature_algorithm != SIGNATURE_ALGORITHM:
        raise InvalidArgument(
            "receipt.signature_algorithm", f"must be {SIGNATURE_ALGORITHM!r}, got {receipt.signature_algorithm!r}"
        )
    payload = receipt.payload()  # malformed fields are refused by name here, before the signature
    try:
        verify_signature(cert_pem, payload, receipt.signature)
    except InvalidArgument:
        raise InvalidArgument(
            "receipt.signature", f"does not verify against {receipt.signer!r}'s pinned certificate"
        ) from None
    if manifest is not None:
        check_manifest(receipt, manifest)
    return receipt.record
