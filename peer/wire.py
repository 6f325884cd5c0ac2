"""Tensors and releases on the wire (privfusion.v1), independent of any math.

A tensor is a ``TensorHeader`` (name, dtype, shape, nbytes, SHA-256) followed by
``TensorChunk`` messages of at most ``MAX_CHUNK_BYTES`` raw little-endian bytes. The sender
slices the array's own buffer (one chunk-sized copy at a time); the receiver writes each chunk
straight into a preallocated array and hashes as it goes, so a release of several hundred MB
is held once on each side, never as one message.

A release stream is ``Receipt, ReleaseManifest, (TensorHeader, TensorChunk*)*, ReleaseEnd``
(:func:`release_frames` writes it, :class:`ReleaseReader` checks it frame by frame).

Every check raises ``InvalidArgument`` naming the field, e.g. ``probe.shape`` or
``chunk.data``; the service maps it to INVALID_ARGUMENT (and the client refuses a peer's
malformed stream the same way).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from peer.errors import InvalidArgument
from peer.receipts import SignedReceipt
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import tensor_pb2 as tpb

PROTOCOL = "privfusion.v1"
#: Largest chunk sent or accepted (Flower uses 5 MiB, OpenFL 2 MiB; 4 MiB keeps per-message
#: overhead negligible while bounding what one message can make a peer allocate).
MAX_CHUNK_BYTES = 4 << 20
#: gRPC's own message limit on both ends: above MAX_CHUNK_BYTES (plus framing) so that an
#: oversize chunk reaches the application and is refused by name (INVALID_ARGUMENT); a message
#: above this is refused by gRPC itself with RESOURCE_EXHAUSTED before any handler runs.
GRPC_MESSAGE_LIMIT = 16 << 20
#: Upper bound on one tensor (elements) and on a whole release received by a client (bytes).
MAX_TENSOR_ELEMENTS = 1 << 31
MAX_RELEASE_BYTES = 8 << 30
MAX_DIMS = 8

DTYPES: dict[int, np.dtype] = {
    tpb.DTYPE_FLOAT32: np.dtype("<f4"),
    tpb.DTYPE_FLOAT64: np.dtype("<f8"),
    tpb.DTYPE_INT32: np.dtype("<i4"),
    tpb.DTYPE_INT64: np.dtype("<i8"),
}
_CODES = {v.str: k for k, v in DTYPES.items()}


def grpc_options() -> list[tuple[str, Any]]:
    """Channel and server options of every PrivFusion endpoint (message limits, keepalive)."""
    return [
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def dtype_code(dtype: np.dtype) -> int:
    code = _CODES.get(np.dtype(dtype).newbyteorder("<").str)
    if code is None:
        raise InvalidArgument("dtype", f"{np.dtype(dtype)} cannot travel; use one of {[str(d) for d in DTYPES.values()]}")
    return code


def _le_bytes(array: np.ndarray) -> memoryview:
    """The array's raw little-endian C-order bytes, without a copy when it already is."""
    a = np.asarray(array)
    le = a.dtype.newbyteorder("<")
    a = np.ascontiguousarray(a.astype(le, copy=False))
    return memoryview(a.reshape(-1).view(np.uint8))


def digest(array: np.ndarray) -> bytes:
    """SHA-256 of the tensor's wire bytes."""
    return hashlib.sha256(_le_bytes(array)).digest()


def tensor_messages(name: str, array: np.ndarray, sha256: bytes | None = None,
                    chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[tpb.TensorHeader | tpb.TensorChunk]:
    """The header, then the chunks, of one tensor."""
    a = np.asarray(array)
    code = dtype_code(a.dtype)
    raw = _le_bytes(a)
    yield tpb.TensorHeader(name=name, dtype=code, shape=list(a.shape), nbytes=raw.nbytes,
                           sha256=sha256 if sha256 is not None else hashlib.sha256(raw).digest())
    for start in range(0, raw.nbytes, chunk_bytes):
        yield tpb.TensorChunk(data=raw[start:start + chunk_bytes].tobytes())


class TensorReceiver:
    """Assembles one tensor from its header and chunks, checking everything on the way.

    ``field`` names the tensor in error messages (``probe``, ``tensor[0.weight]``).
    ``allowed`` limits the dtypes; ``max_bytes`` caps what the header may make us allocate.
    """

    def __init__(self, header: tpb.TensorHeader, field: str = "tensor", allowed: Sequence[int] | None = None,
                 max_bytes: int = MAX_RELEASE_BYTES):
        self.field = field
        if header.dtype not in DTYPES or (allowed is not None and header.dtype not in allowed):
            names = [tpb.DType.Name(c) for c in (allowed or DTYPES)]
            raise InvalidArgument(f"{field}.dtype", f"must be one of {names}, got {header.dtype}")
        if len(header.shape) > MAX_DIMS:
            raise InvalidArgument(f"{field}.shape", f"has {len(header.shape)} dimensions, at most {MAX_DIMS} are allowed")
        if any(d < 0 for d in header.shape):
            raise InvalidArgument(f"{field}.shape", f"must be non-negative, got {list(header.shape)}")
        count = math.prod(header.shape)
        if count > MAX_TENSOR_ELEMENTS:
            raise InvalidArgument(f"{field}.shape", f"{list(header.shape)} has {count} elements, more than {MAX_TENSOR_ELEMENTS}")
        self.dtype = DTYPES[header.dtype]
        self.nbytes = count * self.dtype.itemsize
        if header.nbytes != self.nbytes:
            raise InvalidArgument(f"{field}.nbytes", f"is {header.nbytes}, but shape {list(header.shape)} of {self.dtype} needs {self.nbytes}")
        if self.nbytes > max_bytes:
            raise InvalidArgument(f"{field}.nbytes", f"{self.nbytes} exceeds the limit of {max_bytes} bytes")
        if len(header.sha256) != 32:
            raise InvalidArgument(f"{field}.sha256", f"must be 32 bytes, got {len(header.sha256)}")
        self.name = header.name
        self.shape = tuple(int(d) for d in header.shape)
        self.expected = bytes(header.sha256)
        self.array = np.empty(self.shape, dtype=self.dtype)
        self._view = memoryview(self.array.reshape(-1).view(np.uint8)) if self.nbytes else memoryview(b"")
        self._hash = hashlib.sha256()
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes

    def add(self, chunk: tpb.TensorChunk) -> None:
        data = chunk.data
        n = len(data)
        if n == 0:
            raise InvalidArgument("chunk.data", "is empty")
        if n > MAX_CHUNK_BYTES:
            raise InvalidArgument("chunk.data", f"{n} bytes exceeds the chunk limit of {MAX_CHUNK_BYTES}")
        if self.received + n > self.nbytes:
            raise InvalidArgument("chunk.data", f"overruns {self.field}: {self.received + n} bytes for a {self.nbytes}-byte tensor")
        self._view[self.received:self.received + n] = data
        self._hash.update(data)
        self.received += n

    def finish(self) -> np.ndarray:
        if not self.complete:
            raise InvalidArgument(f"{self.field}", f"truncated: {self.received} of {self.nbytes} bytes arrived")
        if self._hash.digest() != self.expected:
            raise InvalidArgument(f"{self.field}.sha256", "does not match the bytes received (corrupted in transit)")
        return self.array


# ------------------------------------------------------------------------------ receipts


def receipt_to_proto(r: SignedReceipt) -> pb.Receipt:
    return pb.Receipt(signer=r.signer, ledger_entry_id=r.ledger_entry_id, record_json=r.record_json,
                      tensors=[tpb.TensorDigest(name=n, sha256=d) for n, d in r.tensors],
                      signature_algorithm=r.signature_algorithm, signature=r.signature)


def receipt_from_proto(m: pb.Receipt) -> SignedReceipt:
    return SignedReceipt(m.signer, m.ledger_entry_id, bytes(m.record_json),
                         tuple((t.name, bytes(t.sha256)) for t in m.tensors), bytes(m.signature),
                         m.signature_algorithm)


# ------------------------------------------------------------------------------ releases


@dataclass
class Release:
    """A release as received: the receipt, what it holds, and its tensors in stream order."""

    receipt: SignedReceipt
    kind: str
    model: str
    architecture: dict | None
    metadata: dict
    arrays: dict[str, np.ndarray]
    upstream: tuple[SignedReceipt, ...] = ()
    total_bytes: int = 0


def release_frames(receipt: SignedReceipt, kind: str, model: str, architecture: Mapping | None,
                   metadata: Mapping, tensors: Sequence[tuple[str, np.ndarray]],
                   upstream: Sequence[SignedReceipt] = (), chunk_bytes: int = MAX_CHUNK_BYTES
                   ) -> Iterator[pb.ReleaseFrame]:
    """The frames of one release; the receipt's digests must be those of ``tensors``."""
    if [n for n, _ in receipt.tensors] != [n for n, _ in tensors]:
        raise InvalidArgument("receipt.tensors", "must list the release's tensors in stream order")
    total = sum(np.asarray(a).nbytes for _, a in tensors)
    yield pb.ReleaseFrame(receipt=receipt_to_proto(receipt))
    yield pb.ReleaseFrame(manifest=pb.ReleaseManifest(
        kind=kind, model=model, architecture_json=json.dumps(dict(architecture), sort_keys=True) if architecture is not None else "",
        metadata_json=json.dumps(dict(metadata), sort_keys=True), tensor_count=len(tensors), total_bytes=total,
        upstream=[receipt_to_proto(u) for u in upstream]))
    for (name, array), (_, sha) in zip(tensors, receipt.tensors):
        for m in tensor_messages(name, array, sha256=sha, chunk_bytes=chunk_bytes):
            yield pb.ReleaseFrame(tensor=m) if isinstance(m, tpb.TensorHeader) else pb.ReleaseFrame(chunk=m)
    yield pb.ReleaseFrame(end=pb.ReleaseEnd(tensor_count=len(tensors), total_bytes=total))


def _json_object(text: str, field: str, allow_empty: bool) -> dict | None:
    if not text and allow_empty:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(field, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, "must be a JSON object")
    return value


class ReleaseReader:
    """Checks a release stream frame by frame (order, sizes, checksums, the receipt's digests).

    ``on_receipt`` is called with the receipt as soon as it arrives (before any tensor byte):
    the client verifies the signature there. Call :meth:`read` with the frame iterator.
    """

    def __init__(self, max_bytes: int = MAX_RELEASE_BYTES, on_receipt=None):
        self.max_bytes = max_bytes
        self.on_receipt = on_receipt

    def read(self, frames: Iterable[pb.ReleaseFrame]) -> Release:
        receipt = manifest = None
        arrays: dict[str, np.ndarray] = {}
        current: TensorReceiver | None = None
        total = 0
        for frame in frames:
            which = frame.WhichOneof("frame")
            if receipt is None:
                if which != "receipt":
                    raise InvalidArgument("frame", f"a release must start with its receipt, got {which!r}")
                receipt = receipt_from_proto(frame.receipt)
                if self.on_receipt is not None:
                    self.on_receipt(receipt)
                continue
            if manifest is None:
                if which != "manifest":
                    raise InvalidArgument("frame", f"the receipt must be followed by the manifest, got {which!r}")
                manifest = frame.manifest
                if manifest.total_bytes > self.max_bytes:
                    raise InvalidArgument("manifest.total_bytes", f"{manifest.total_bytes} exceeds the limit of {self.max_bytes}")
                continue
            if which == "tensor":
                if current is not None:
                    raise InvalidArgument(f"tensor[{current.name}]", f"truncated: {current.received} of {current.nbytes} bytes before the next tensor")
                index = len(arrays)
                if index >= len(receipt.tensors):
                    raise InvalidArgument("tensor", f"more tensors than the receipt lists ({len(receipt.tensors)})")
                name, sha = receipt.tensors[index]
                h = frame.tensor
                if h.name != name or bytes(h.sha256) != sha:
                    raise InvalidArgument(f"tensor[{h.name}]", f"does not match the receipt's tensor {index} ({name!r} and its checksum)")
                if h.name in arrays:
                    raise InvalidArgument(f"tensor[{h.name}]", "appears twice")
                current = TensorReceiver(h, f"tensor[{h.name}]", max_bytes=self.max_bytes - total)
                total += current.nbytes
                if current.complete:
                    arrays[current.name] = current.finish()
                    current = None
            elif which == "chunk":
                if current is None:
                    raise InvalidArgument("chunk", "arrived outside a tensor")
                current.add(frame.chunk)
                if current.complete:
                    arrays[current.name] = current.finish()
                    current = None
            elif which == "end":
                if current is not None:
                    raise InvalidArgument(f"tensor[{current.name}]", f"truncated: {current.received} of {current.nbytes} bytes")
                end = frame.end
                if end.tensor_count != len(arrays) or len(arrays) != len(receipt.tensors) or manifest.tensor_count != len(arrays):
                    raise InvalidArgument("end.tensor_count", f"the release announced {manifest.tensor_count} tensors, the receipt lists {len(receipt.tensors)}, {len(arrays)} arrived")
                if end.total_bytes != total or manifest.total_bytes != total:
                    raise InvalidArgument("end.total_bytes", f"{total} bytes arrived, {end.total_bytes} announced")
                return Release(receipt, manifest.kind, manifest.model,
                               _json_object(manifest.architecture_json, "manifest.architecture_json", True),
                               _json_object(manifest.metadata_json or "{}", "manifest.metadata_json", False) or {},
                               arrays, tuple(receipt_from_proto(u) for u in manifest.upstream), total)
            else:
                raise InvalidArgument("frame", f"unexpected {which!r} inside a release")
        raise InvalidArgument("release", "truncated: the stream ended before ReleaseEnd"
                              + (f" (in tensor {current.name!r}, {current.received} of {current.nbytes} bytes)" if current else ""))
